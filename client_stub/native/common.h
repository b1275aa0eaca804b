// Helpers shared by every part of the native stub: exporting, logging, settings.
#pragma once

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <string>

// Everything is hidden (-fvisibility=hidden) except the CUDA entry points marked here;
// the version scripts (libcuda.map, libnvidia-ml.map) are the second fence.
#define PHOS_EXPORT extern "C" __attribute__((visibility("default")))

namespace phos {

// "phos: <message>" on stderr, always.
void log_error(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
// The same, only with PHOS_VERBOSE=1 (or PHOS_DEBUG=1) in the environment.
void log_verbose(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
bool verbose();

// Log lines go to stderr whole (log.cpp).
void log_line(const char* fmt, va_list ap);

// Every PHOS_* variable the stub reads, read once, in settings.cpp alone (NVML reads none).
// phos/base/settings.py declares them all, with their defaults and meanings, for README.md's table;
// tests/unit/test_settings.py checks that the two agree.
struct Settings {
    std::string server;          // PHOS_SERVER: the front end's ZeroMQ endpoint
    double connect_timeout;      // PHOS_CONNECT_TIMEOUT: seconds to wait for hello / attach
    double gone_timeout;         // PHOS_GONE_TIMEOUT: seconds disconnected before a call fails
    long batch_calls;            // PHOS_BATCH_CALLS: flush an asynchronous batch at this many calls
    long batch_bytes;            // PHOS_BATCH_BYTES: ... or this many payload bytes
    double batch_age;            // PHOS_BATCH_AGE_US (as seconds): ... or when its first call is this old
    long inline_copy_max;        // host->device copies up to this size are captured and sent async
    long log_calls;              // PHOS_LOG_CALLS: bound of the replay log, in calls
    long log_bytes;              // PHOS_LOG_BYTES: ... and in the host bytes it holds
    double reattach_timeout;     // PHOS_REATTACH_TIMEOUT: seconds to find a lost context again
    int staging;                 // PHOS_STAGING: 1 offer a shared staging area always, 0 never, -1 on ipc/loopback
    int mailbox;                 // PHOS_MAILBOX: synchronous calls through the staging area's mailbox:
                                 // 1 always, 0 never, -1 (default) while we spin and the worker is awake
    double spin;                 // PHOS_SPIN_US (as seconds): spin this long for a reply before sleeping
    long copy_threads;           // PHOS_COPY_THREADS: threads that copy bulk host bytes, the caller included
                                 // (parallel_copy.h); 1: memcpy on the caller's thread alone
    bool verbose;                // PHOS_VERBOSE or PHOS_DEBUG: a non-zero number
    bool trace;                  // PHOS_VERBOSE=2: name each call made through cuGetProcAddress's answers
    std::string server_key;      // PHOS_SERVER_KEY: the server's CURVE public key file ("" none)
    std::string client_key;      // PHOS_CLIENT_KEY: our CURVE secret key file, needed with it
    double exit_timeout;         // PHOS_EXIT_TIMEOUT: seconds to wait at exit for each ctxDestroy
};
const Settings& settings();

// Read at call time, not once: a lost context may have moved to another server.
std::string server_now();                                  // PHOS_SERVER, else the default (settings.cpp)
std::string standby_now(const std::string& fallback);      // PHOS_STANDBY, else `fallback`

}  // namespace phos
