// The stub's settings: every PHOS_* variable it reads, and nowhere else (phos/base/settings.py
// declares them with the Python side's, for README.md's table). Part of the driver library,
// which links the generated schema: the default server's socket is schema/phos.capnp's defaultSocket.
#include "common.h"

#include <cstdarg>
#include <cstdlib>

#include <unistd.h>

#include <algorithm>

#include "phos.capnp.h"   // generated at build time by `capnp compile -oc++`

namespace phos {

static std::string env_string(const char* name, const char* fallback) {
    const char* v = getenv(name);
    return (v && *v) ? v : fallback;
}

static double env_seconds(const char* name, double fallback) {
    const char* v = getenv(name);
    if (!v || !*v) return fallback;
    char* end = nullptr;
    double d = strtod(v, &end);
    return (end != v && d >= 0) ? d : fallback;
}

static long env_long(const char* name, long fallback) {
    const char* v = getenv(name);
    if (!v || !*v) return fallback;
    char* end = nullptr;
    long n = strtol(v, &end, 0);
    return end != v ? n : fallback;
}

// "1" on, "0" off, anything else (or unset) automatic.
static int env_tristate(const char* name) {
    const std::string v = env_string(name, "");
    return v == "0" ? 0 : v == "1" ? 1 : -1;
}

// schema/phos.capnp's defaultSocket in the user's own socket directory, by the rule
// phos/base/settings.py's socket_directory() follows: /run/phos for root, else
// $XDG_RUNTIME_DIR/phos, else /tmp/phos-UID.
static std::string default_server() {
    std::string dir;
    const char* runtime = getenv("XDG_RUNTIME_DIR");
    if (geteuid() == 0) dir = "/run/phos";
    else if (runtime && *runtime) dir = std::string(runtime) + "/phos";
    else dir = "/tmp/phos-" + std::to_string(geteuid());
    return "ipc://" + dir + "/" + ::DEFAULT_SOCKET.get().cStr();
}

const Settings& settings() {
    static const Settings s = [] {
        Settings t;
        t.server = env_string("PHOS_SERVER", default_server().c_str());
        t.connect_timeout = env_seconds("PHOS_CONNECT_TIMEOUT", 5.0);
        t.gone_timeout = env_seconds("PHOS_GONE_TIMEOUT", 10.0);
        t.batch_calls = env_long("PHOS_BATCH_CALLS", 64);
        t.batch_bytes = env_long("PHOS_BATCH_BYTES", 1 << 20);
        t.batch_age = env_long("PHOS_BATCH_AGE_US", 1000) * 1e-6;
        t.inline_copy_max = env_long("PHOS_INLINE_COPY_MAX", 64 << 10);
        t.log_calls = env_long("PHOS_LOG_CALLS", 1 << 16);
        t.log_bytes = env_long("PHOS_LOG_BYTES", 256L << 20);
        t.reattach_timeout = env_seconds("PHOS_REATTACH_TIMEOUT", 60.0);
        t.staging = env_tristate("PHOS_STAGING");
        t.mailbox = env_tristate("PHOS_MAILBOX");
        // Spinning beats a wake-up where cores are plentiful (1 ms, as the worker and the
        // Python client); on small machines it would starve the worker the spinning thread waits for.
        const long cores = sysconf(_SC_NPROCESSORS_ONLN);
        t.spin = std::max(0L, env_long("PHOS_SPIN_US", cores > 4 ? 1000 : 0)) * 1e-6;
        // A staged copy's memcpy on one core is slower than the DMA behind it (parallel_copy.cpp);
        // a few threads suffice where one falls short, and a core is left to the worker on our host.
        t.copy_threads = std::clamp(env_long("PHOS_COPY_THREADS", std::min(4L, cores - 1)), 1L, 64L);
        t.verbose = env_long("PHOS_VERBOSE", 0) != 0 || env_long("PHOS_DEBUG", 0) != 0;
        t.trace = env_long("PHOS_VERBOSE", 0) >= 2;
        t.server_key = env_string("PHOS_SERVER_KEY", "");
        t.client_key = env_string("PHOS_CLIENT_KEY", "");
        t.exit_timeout = env_seconds("PHOS_EXIT_TIMEOUT", 10.0);
        t.batch_calls = std::clamp(t.batch_calls, 1L, static_cast<long>(::MAX_REQUEST_CALLS));   // a server refuses more
        return t;
    }();
    return s;
}

std::string server_now() { return env_string("PHOS_SERVER", default_server().c_str()); }

std::string standby_now(const std::string& fallback) { return env_string("PHOS_STANDBY", fallback.c_str()); }

bool verbose() { return settings().verbose; }

void log_verbose(const char* fmt, ...) {
    if (!verbose()) return;
    va_list ap;
    va_start(ap, fmt);
    log_line(fmt, ap);
    va_end(ap);
}

}  // namespace phos
