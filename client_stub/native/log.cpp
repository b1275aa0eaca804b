#include "common.h"

#include <cstdarg>
#include <cstdio>
#include <cstdlib>

#include <unistd.h>

#include <algorithm>

namespace phos {

static void vlog(const char* fmt, va_list ap) {
    char line[2048];
    vsnprintf(line, sizeof line, fmt, ap);
    fprintf(stderr, "phos: %s\n", line);   // one call, so lines from threads don't interleave
}

void log_error(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vlog(fmt, ap);
    va_end(ap);
}

bool verbose() {
    static const bool on = env_long("PHOS_VERBOSE", 0) != 0 || env_long("PHOS_DEBUG", 0) != 0;
    return on;
}

void log_verbose(const char* fmt, ...) {
    if (!verbose()) return;
    va_list ap;
    va_start(ap, fmt);
    vlog(fmt, ap);
    va_end(ap);
}

std::string env_string(const char* name, const char* fallback) {
    const char* v = getenv(name);
    return (v && *v) ? v : fallback;
}

double env_seconds(const char* name, double fallback) {
    const char* v = getenv(name);
    if (!v || !*v) return fallback;
    char* end = nullptr;
    double d = strtod(v, &end);
    return (end != v && d >= 0) ? d : fallback;
}

long env_long(const char* name, long fallback) {
    const char* v = getenv(name);
    if (!v || !*v) return fallback;
    char* end = nullptr;
    long n = strtol(v, &end, 0);
    return end != v ? n : fallback;
}

const Settings& settings() {
    static const Settings s = [] {
        Settings t;
        t.server = env_string("PHOS_SERVER", kDefaultServer);
        t.connect_timeout = env_seconds("PHOS_CONNECT_TIMEOUT", 5.0);
        t.gone_timeout = env_seconds("PHOS_GONE_TIMEOUT", 10.0);
        t.batch_calls = env_long("PHOS_BATCH_CALLS", 64);
        t.batch_bytes = env_long("PHOS_BATCH_BYTES", 1 << 20);
        t.batch_age = env_long("PHOS_BATCH_AGE_US", 1000) * 1e-6;
        t.inline_copy_max = env_long("PHOS_INLINE_COPY_MAX", 64 << 10);
        t.log_calls = env_long("PHOS_LOG_CALLS", 1 << 16);
        t.log_bytes = env_long("PHOS_LOG_BYTES", 256L << 20);
        t.reattach_timeout = env_seconds("PHOS_REATTACH_TIMEOUT", 60.0);
        const std::string staging = env_string("PHOS_STAGING", "");
        t.staging = staging == "0" ? 0 : staging == "1" ? 1 : -1;
        const std::string mailbox = env_string("PHOS_MAILBOX", "");
        t.mailbox = mailbox == "0" ? 0 : mailbox == "1" ? 1 : -1;
        // Spinning beats a wake-up where cores are plentiful (1 ms, as the worker and the
        // Python client); on small machines it would starve the worker the spinning thread waits for.
        const long cores = sysconf(_SC_NPROCESSORS_ONLN);
        t.spin = std::max(0L, env_long("PHOS_SPIN_US", cores > 4 ? 1000 : 0)) * 1e-6;
        if (t.batch_calls < 1) t.batch_calls = 1;
        return t;
    }();
    return s;
}

}  // namespace phos
