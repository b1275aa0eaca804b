#include "transport.h"

#include <poll.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>

#include "common.h"

namespace phos {

using Clock = std::chrono::steady_clock;

// One ZeroMQ context for the process, never terminated: zmq_ctx_term at exit would
// wait for sockets that other threads may still hold.
static void* zmq_context() {
    static void* ctx = [] {
        void* c = zmq_ctx_new();
        zmq_ctx_set(c, ZMQ_BLOCKY, 0);
        return c;
    }();
    return ctx;
}

void Message::clear() {
    for (auto& f : frames_) zmq_msg_close(&f);
    frames_.clear();
}

static void set_int(void* socket, int option, int value) {
    zmq_setsockopt(socket, option, &value, sizeof value);
}

extern "C" bool phos_load_sodium(const char** why);   // static_link/sodium_loader.cpp

namespace {
struct CurveKeys {
    bool on = false;
    std::string server_public, public_key, secret_key;   // z85, 40 characters each
    std::mutex mu;
    std::map<std::string, std::string> learned;         // endpoint -> its server's public key
};
CurveKeys& curve_keys() {
    static CurveKeys keys;
    return keys;
}

// The z85 value of `field = "..."` in a ZeroMQ certificate file (what pyzmq's
// zmq.auth.create_certificates writes); "" if the file or the field is not there.
std::string certificate_field(const std::string& path, const char* field, std::string& error) {
    std::ifstream f(path);
    if (!f) {
        error = "cannot read the key file " + path + ": " + strerror(errno);
        return "";
    }
    std::stringstream text;
    text << f.rdbuf();
    const std::string s = text.str(), key = std::string(field) + " = \"";
    size_t at = s.find(key);
    if (at == std::string::npos || s.size() < at + key.size() + 41 || s[at + key.size() + 40] != '"') {
        error = "the key file " + path + " has no " + field + " (make keys with `phos keygen`)";
        return "";
    }
    return s.substr(at + key.size(), 40);
}
}  // namespace

bool configure_curve(std::string& error) {
    const Settings& cfg = settings();
    return configure_curve_from(cfg.server_key, cfg.client_key, error);
}

bool configure_curve_from(const std::string& server_key, const std::string& client_key, std::string& error) {
    CurveKeys& k = curve_keys();
    if (server_key.empty() && client_key.empty()) return true;
    if (server_key.empty() || client_key.empty()) {
        error = server_key.empty() ? "PHOS_CLIENT_KEY is set but PHOS_SERVER_KEY is not"
                                   : "PHOS_SERVER_KEY is set but PHOS_CLIENT_KEY is not";
        return false;
    }
    if (!zmq_has("curve")) {
        error = "this libzmq has no CURVE";
        return false;
    }
    std::string server_public = certificate_field(server_key, "public-key", error);
    if (server_public.empty()) return false;
    std::string public_key = certificate_field(client_key, "public-key", error);
    if (public_key.empty()) return false;
    std::string secret_key = certificate_field(client_key, "secret-key", error);
    if (secret_key.empty()) return false;
    const char* why = nullptr;
    if (!phos_load_sodium(&why)) {
        error = std::string("CURVE needs libsodium (Debian: libsodium23): ") + (why ? why : "?");
        return false;
    }
    std::lock_guard<std::mutex> lock(k.mu);
    k.server_public.swap(server_public);
    k.public_key.swap(public_key);
    k.secret_key.swap(secret_key);
    k.on = true;
    return true;
}

void remember_server_key(const std::string& endpoint, const std::string& z85) {
    CurveKeys& k = curve_keys();
    if (z85.size() != 40) return;
    std::lock_guard<std::mutex> lock(k.mu);
    k.learned[endpoint] = z85;
}

// Our key pair and the server's key on a socket about to connect to `endpoint`.
static void apply_curve(void* socket, const std::string& endpoint) {
    CurveKeys& k = curve_keys();
    if (!k.on) return;
    std::string server = k.server_public;
    {
        std::lock_guard<std::mutex> lock(k.mu);
        auto it = k.learned.find(endpoint);
        if (it != k.learned.end()) server = it->second;
    }
    zmq_setsockopt(socket, ZMQ_CURVE_SERVERKEY, server.c_str(), 41);
    zmq_setsockopt(socket, ZMQ_CURVE_PUBLICKEY, k.public_key.c_str(), 41);
    zmq_setsockopt(socket, ZMQ_CURVE_SECRETKEY, k.secret_key.c_str(), 41);
}

Socket::Socket(const std::string& endpoint) : endpoint_(endpoint) { open(); }

void Socket::reopen(const std::string& endpoint) {
    close();
    endpoint_ = endpoint;
    error_.clear();
    connected_ = ever_connected_ = dropped_ = greeted_ = false;
    open();
}

void Socket::take(Socket& other) {
    close();
    endpoint_ = other.endpoint_;
    error_ = other.error_;
    socket_ = other.socket_;
    monitor_ = other.monitor_;
    connected_ = other.connected_;
    greeted_ = other.greeted_;
    ever_connected_ = other.ever_connected_;
    dropped_ = other.dropped_;
    disconnected_since_ = other.disconnected_since_;
    other.socket_ = other.monitor_ = nullptr;
}

void Socket::open() {
    static std::atomic<unsigned> next_monitor{0};
    const std::string& endpoint = endpoint_;
    void* ctx = zmq_context();
    socket_ = zmq_socket(ctx, ZMQ_DEALER);
    if (!socket_) {
        error_ = std::string("cannot create a ZeroMQ socket: ") + zmq_strerror(zmq_errno());
        return;
    }
    set_int(socket_, ZMQ_LINGER, 0);
    set_int(socket_, ZMQ_SNDHWM, 0);              // never drop or block on a long batch queue
    set_int(socket_, ZMQ_RCVHWM, 0);
    // Notice a server that vanished without closing by TCP keepalive (~10 s), not ZeroMQ's
    // heartbeats: a heartbeat waits behind our queued messages, which a worker that reads none
    // for a while (paced, frozen, in a long call) leaves queued, and the connection would be
    // dropped with its answers on their way (gpu_server/worker/main.py client_socket does the same).
    set_int(socket_, ZMQ_TCP_KEEPALIVE, 1);
    set_int(socket_, ZMQ_TCP_KEEPALIVE_IDLE, 5);
    set_int(socket_, ZMQ_TCP_KEEPALIVE_INTVL, 1);
    set_int(socket_, ZMQ_TCP_KEEPALIVE_CNT, 5);
    set_int(socket_, ZMQ_RECONNECT_IVL, 50);
    set_int(socket_, ZMQ_RECONNECT_IVL_MAX, 1000);
    apply_curve(socket_, endpoint);

    std::string monitor_address = "inproc://phos-monitor-" + std::to_string(next_monitor++);
    const int events = ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED;
    if (zmq_socket_monitor(socket_, monitor_address.c_str(), events) == 0) {
        monitor_ = zmq_socket(ctx, ZMQ_PAIR);
        set_int(monitor_, ZMQ_LINGER, 0);
        if (zmq_connect(monitor_, monitor_address.c_str()) != 0) {
            zmq_close(monitor_);
            monitor_ = nullptr;
        }
    }
    if (zmq_connect(socket_, endpoint.c_str()) != 0) {
        error_ = "cannot connect to " + endpoint + ": " + zmq_strerror(zmq_errno());
        zmq_close(socket_);
        socket_ = nullptr;
    }
}

Socket::~Socket() { close(); }

void Socket::close() {
    // Stop the monitor before closing its reader: libzmq sends an event (a disconnect, say)
    // blocking, under the lock that stopping the monitor takes, and with no reader left that
    // send waits for ever (a program hung in cudaDeviceReset while its worker went away).
    if (socket_) zmq_socket_monitor(socket_, nullptr, 0);
    if (monitor_) zmq_close(monitor_);
    monitor_ = nullptr;
    if (socket_) zmq_close(socket_);
    socket_ = nullptr;
}

bool Socket::lost() {
    drain_monitor();
    return dropped_;
}

bool Socket::greeted() {
    drain_monitor();
    return greeted_ || !monitor_;   // without a monitor we cannot tell: say yes
}

// zmq calls this (from its I/O thread) once it no longer needs an owned payload.
static void release_owned(void*, void* hint) {
    delete static_cast<std::shared_ptr<const char[]>*>(hint);
}

bool Socket::send(const std::string& request, const std::vector<const wire::Payload*>& payloads) {
    zmq_msg_t msg;
    zmq_msg_init_size(&msg, request.size());
    std::memcpy(zmq_msg_data(&msg), request.data(), request.size());
    int more = payloads.empty() ? 0 : ZMQ_SNDMORE;
    if (zmq_msg_send(&msg, socket_, more) < 0) {
        zmq_msg_close(&msg);
        error_ = std::string("send failed: ") + zmq_strerror(zmq_errno());
        return false;
    }
    for (size_t i = 0; i < payloads.size(); i++) {
        const wire::Payload& p = *payloads[i];
        if (p.owned) {
            auto* keep = new std::shared_ptr<const char[]>(p.owned);
            zmq_msg_init_data(&msg, const_cast<char*>(p.owned.get()), p.size, release_owned, keep);
        } else {
            zmq_msg_init_data(&msg, const_cast<void*>(p.borrowed), p.size, nullptr, nullptr);
        }
        if (zmq_msg_send(&msg, socket_, i + 1 < payloads.size() ? ZMQ_SNDMORE : 0) < 0) {
            zmq_msg_close(&msg);
            error_ = std::string("send failed: ") + zmq_strerror(zmq_errno());
            return false;
        }
    }
    return true;
}

void Socket::drain_monitor() {
    if (!monitor_) return;
    while (true) {
        zmq_msg_t event, address;
        zmq_msg_init(&event);
        if (zmq_msg_recv(&event, monitor_, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&event);
            return;
        }
        uint16_t id = 0;
        if (zmq_msg_size(&event) >= 2) std::memcpy(&id, zmq_msg_data(&event), 2);
        zmq_msg_close(&event);
        zmq_msg_init(&address);                       // the second frame names the endpoint
        zmq_msg_recv(&address, monitor_, 0);
        zmq_msg_close(&address);
        if (id == ZMQ_EVENT_CONNECTED) {
            connected_ = ever_connected_ = true;
        } else if (id == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
            greeted_ = true;
        } else if (id == ZMQ_EVENT_DISCONNECTED && connected_) {
            connected_ = greeted_ = false;
            dropped_ = true;
            disconnected_since_ = Clock::now();
        }
    }
}

bool Socket::readable() {
    int events = 0;
    size_t size = sizeof events;
    return zmq_getsockopt(socket_, ZMQ_EVENTS, &events, &size) == 0 && (events & ZMQ_POLLIN);
}

void Socket::wait_readable(double seconds) {
    if (readable()) return;          // also re-arms ZMQ_FD, which signals only changes
    int fd = -1;
    size_t size = sizeof fd;
    if (zmq_getsockopt(socket_, ZMQ_FD, &fd, &size) != 0) return;
    struct pollfd p = {fd, POLLIN, 0};
    struct timespec t;
    t.tv_sec = static_cast<time_t>(seconds);
    t.tv_nsec = static_cast<long>((seconds - static_cast<double>(t.tv_sec)) * 1e9);
    ppoll(&p, 1, &t, nullptr);
}

Socket::Wait Socket::receive_once(Message& message, int poll_ms) {
    message.clear();
    zmq_pollitem_t items[2] = {{socket_, 0, ZMQ_POLLIN, 0}, {monitor_, 0, ZMQ_POLLIN, 0}};
    int n = zmq_poll(items, monitor_ ? 2 : 1, poll_ms);
    if (n < 0 && zmq_errno() != EINTR) {
        error_ = std::string("poll failed: ") + zmq_strerror(zmq_errno());
        return Wait::gone;
    }
    if (monitor_ && (items[1].revents & ZMQ_POLLIN)) drain_monitor();
    if (items[0].revents & ZMQ_POLLIN) {
        while (true) {
            message.frames_.emplace_back();
            zmq_msg_t& f = message.frames_.back();
            zmq_msg_init(&f);
            if (zmq_msg_recv(&f, socket_, 0) < 0) {
                if (zmq_errno() == EINTR) {
                    zmq_msg_close(&f);
                    message.frames_.pop_back();
                    continue;
                }
                error_ = std::string("receive failed: ") + zmq_strerror(zmq_errno());
                return Wait::gone;
            }
            if (!zmq_msg_more(&f)) return Wait::message;
        }
    }
    if (ever_connected_ && !connected_ &&
        std::chrono::duration<double>(Clock::now() - disconnected_since_).count() > settings().gone_timeout) {
        return Wait::gone;
    }
    return Wait::timeout;
}

}  // namespace phos
