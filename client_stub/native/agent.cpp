// The checkpoint agent: how `phos checkpoint --pid`, `phos restore --process` and `phos migrate`
// reach this process (docs/DESIGN.md, "Whole applications"; phos/process.py is the other end,
// and client_stub/agent.py the Python client's twin).
//
// A thread listens on the abstract Unix socket "phos-agent-<pid>", for peers of our own user or
// root. Each connection carries one request line and gets one JSON line back:
//   contexts         the live contexts: {"stub", "pid", "contexts": [{"ctx", "server"}]}
//   freeze           every call sent and answered, then every connection to a server closed
//                    (Connection::detach), the driver's lock held so no call starts: the process
//                    holds no socket to a server and no call in flight, and CRIU may dump it. The
//                    reply adds "socket": the inode of this connection, which the dump names as
//                    external and a restore replaces with one of its own. Then one more line:
//   thaw [SERVER [SERVER_KEY CLIENT_KEY]]
//                    PHOS_SERVER becomes SERVER (a restored process's new server), with these CURVE
//                    key files if given (PHOS_SERVER_KEY, PHOS_CLIENT_KEY), and every context
//                    attaches again (Connection::resume): {"thawed", "contexts", "lost"}.
// A frozen agent whose peer hangs up, or says nothing for kFrozenTicks seconds of our running
// time (a dump stops that clock), thaws where it was: the application never stays stopped.

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <pthread.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>

#include "driver_state.h"

namespace phos::driver {
namespace {

constexpr int kFrozenTicks = 600;      // seconds of running time a freeze waits for its thaw
constexpr size_t kMaxLine = 4096;

// The listener, which a forked child must not keep: it has no agent thread to answer on it, and
// would hold the name after we close ours to be dumped.
std::atomic<int> listening{-1};
void forget_listener_in_child() {
    const int fd = listening.exchange(-1);
    if (fd >= 0) close(fd);
}

std::string quote(const std::string& s) {
    std::string out = "\"";
    for (unsigned char c : s) {
        if (c == '"' || c == '\\') out += '\\', out += static_cast<char>(c);
        else if (c < 0x20) {
            char esc[8];
            snprintf(esc, sizeof esc, "\\u%04x", c);
            out += esc;
        } else out += static_cast<char>(c);
    }
    return out + "\"";
}

int listen_agent() {
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    const std::string name = "phos-agent-" + std::to_string(getpid());
    memcpy(a.sun_path + 1, name.data(), name.size());   // abstract: no file to leave behind or restore
    const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    if (bind(fd, reinterpret_cast<sockaddr*>(&a), len) != 0 || listen(fd, 4) != 0) {
        log_verbose("checkpoint agent: cannot listen on @%s: %s", name.c_str(), strerror(errno));
        close(fd);
        return -1;
    }
    listening = fd;
    return fd;
}

// Our own user or root: anyone else could stop us.
bool peer_allowed(int fd) {
    ucred c{};
    socklen_t len = sizeof c;
    return getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &c, &len) == 0 && (c.uid == 0 || c.uid == getuid());
}

// One line from `fd`, waiting at most `ticks` seconds of our running time; false on hang-up,
// error, silence or a line too long.
bool read_line(int fd, std::string& line, int ticks) {
    line.clear();
    for (int waited = 0; waited < ticks;) {
        pollfd p{fd, POLLIN, 0};
        const int n = poll(&p, 1, 1000);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return false;
        if (n == 0) {
            waited++;
            continue;
        }
        char buf[512];
        const ssize_t got = read(fd, buf, sizeof buf);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return false;
        line.append(buf, static_cast<size_t>(got));
        const size_t end = line.find('\n');
        if (end != std::string::npos) {
            line.resize(end);
            return true;
        }
        if (line.size() > kMaxLine) return false;
    }
    return false;
}

void write_line(int fd, const std::string& text) {
    const std::string out = text + "\n";
    for (size_t done = 0; done < out.size();) {
        const ssize_t n = send(fd, out.data() + done, out.size() - done, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return;   // the peer went: it learns nothing more
        done += static_cast<size_t>(n);
    }
}

std::string server_of(const CUctx_st* ctx) {
    const std::string& found = ctx->conn->found_at();
    return found.empty() ? server_now() : found;
}

std::string contexts_json(const std::vector<CUctx_st*>& contexts) {
    std::string out = "[";
    for (CUctx_st* ctx : contexts) {
        if (out.size() > 1) out += ",";
        out += "{\"ctx\":" + std::to_string(ctx->conn->context_id()) + ",\"server\":" + quote(server_of(ctx)) + "}";
    }
    return out + "]";
}

std::vector<CUctx_st*> live_contexts() {
    std::vector<CUctx_st*> out;
    for (CUctx_st* ctx : state().contexts)
        if (ctx->live && ctx->conn && ctx->conn->reattachable()) out.push_back(ctx);
    return out;
}

std::string header() { return "\"stub\":\"native\",\"pid\":" + std::to_string(getpid()); }

// freeze, then thaw: the driver's lock is held in between, so no call of the application's starts.
void freeze(int conn, int& listener) {
    State& s = state();
    Guard g(s.lock);
    std::vector<CUctx_st*> frozen;
    std::string lost;
    for (CUctx_st* ctx : live_contexts()) {
        std::string why;
        if (ctx->conn->detach(why)) frozen.push_back(ctx);
        else lost += (lost.empty() ? "" : "; ") + why;
    }
    if (!lost.empty()) {   // a context is gone already: nothing to image for it, and the cut would lie
        for (CUctx_st* ctx : frozen) {
            std::string why;
            if (!ctx->conn->resume(server_of(ctx), why)) log_error("checkpoint agent: %s", why.c_str());
        }
        write_line(conn, "{\"error\":" + quote("a context of this process is lost: " + lost) + "}");
        return;
    }
    const std::string before = server_now();
    s.front.reset();   // its socket too: the image holds no connection to a server
    struct stat st{};
    fstat(conn, &st);
    write_line(conn, "{\"frozen\":true," + header() + ",\"socket\":" + std::to_string(st.st_ino) +
                         ",\"contexts\":" + contexts_json(frozen) + "}");
    listening = -1;
    close(listener);   // nor a listener a restore would have to bind again
    listener = -1;

    std::string line;
    const bool told = read_line(conn, line, kFrozenTicks) && line.rfind("thaw", 0) == 0;
    if (!told) log_error("checkpoint agent: no thaw came (%s): going on where we were", line.empty() ? "hang-up" : line.c_str());
    std::istringstream words(told ? line.substr(4) : "");
    std::string server, server_key, client_key;
    words >> server >> server_key >> client_key;
    if (!server.empty()) setenv("PHOS_SERVER", server.c_str(), 1);   // where later contexts are made too
    if (!client_key.empty()) {
        setenv("PHOS_SERVER_KEY", server_key.c_str(), 1);
        setenv("PHOS_CLIENT_KEY", client_key.c_str(), 1);
        std::string why;
        if (!configure_curve_from(server_key, client_key, why)) log_error("checkpoint agent: CURVE keys: %s", why.c_str());
    }
    wire::Result hello;
    if (connect_front(server_now(), &hello) != CUDA_SUCCESS) {
        log_error("checkpoint agent: the front end at %s: %s", server_now().c_str(), hello.message.c_str());
        s.front = std::make_unique<Connection>(server_now(), false);   // its calls fail, saying so
    }
    std::string resumed = "[";
    lost.clear();
    for (CUctx_st* ctx : frozen) {
        std::string why;
        const std::string at = server.empty() ? (ctx->conn->found_at().empty() ? before : ctx->conn->found_at()) : server;
        if (ctx->conn->resume(at, why)) {
            resumed += (resumed.size() > 1 ? "," : "") + std::to_string(ctx->conn->context_id());
        } else {
            log_error("checkpoint agent: %s", why.c_str());
            lost += (lost.empty() ? "" : "; ") + why;
        }
    }
    write_line(conn, "{\"thawed\":true," + header() + ",\"contexts\":" + resumed + "],\"lost\":" + quote(lost) + "}");
}

void serve(int conn, int& listener) {
    std::string line;
    if (!read_line(conn, line, 10)) return;
    if (line == "contexts") {
        Guard g(state().lock);
        write_line(conn, "{" + header() + ",\"contexts\":" + contexts_json(live_contexts()) + "}");
    } else if (line == "freeze") {
        freeze(conn, listener);
    } else {
        write_line(conn, "{\"error\":" + quote("unknown request: " + line.substr(0, 64)) + "}");
    }
}

void run() {
    int listener = -1;
    while (true) {
        if (listener < 0) listener = listen_agent();
        if (listener < 0) return;   // said why (verbose): the process cannot be checkpointed whole
        const int conn = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
        if (conn < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            return;
        }
        if (peer_allowed(conn)) serve(conn, listener);
        close(conn);
    }
}

}  // namespace

void start_agent() {
    static std::once_flag once;
    std::call_once(once, [] {
        pthread_atfork(nullptr, nullptr, forget_listener_in_child);
        std::thread(run).detach();
    });
}

}  // namespace phos::driver
