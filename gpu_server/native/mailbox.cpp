// The context worker's synchronize round trip: the mailbox's plain ctxSynchronize requests
// (schema/wire.py, BARE_CALLS) seen, run and answered in a spin, with no Python between a
// request and its reply.
//
// Why native: the worker's Python takes several times as long to see, run and answer a
// synchronize as the driver takes to do it, which kept the round trip above its 10 µs target
// (perf/RESULTS.md, bench_stub and bench_launch_decode).
//
// gpu_server/worker/native_box.py owns the policy: it spins here only while the context has nothing
// else going on (no checkpoint, restore or recovery image, no result or error waiting to be
// told), and for a slice of time, after which the worker's loop looks at its sockets. Every
// request this code does not answer is left in the box, untouched, for the Python path
// (worker/loop.py serve_box): another call, a synchronize that calls sent before it by socket must
// run first, a client that sleeps (it is answered over the socket), a failed synchronize (run
// again there, and told as Python tells it).
//
// No CUDA header or library: the synchronize comes as a function pointer (the driver's
// cuCtxSynchronize, or emu's no-op), so CI tests this file without a GPU.
#include <poll.h>

#include <chrono>
#include <cstdint>
#include <cstring>

namespace {

using Clock = std::chrono::steady_clock;

enum Outcome : int {
    kSpunOut = 0,    // the slice ended with nothing for Python
    kForPython = 1,  // a request this code does not answer waits in the box
    kWake = 2,       // answered, but the client fell asleep meanwhile: it needs the doorbell
    kMessage = 3,    // a socket may have a message: the loop looks
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

inline uint64_t load(const unsigned char* at) {
    uint64_t v;
    std::memcpy(&v, at, 8);
    return v;
}

inline void store(unsigned char* at, uint64_t v) { std::memcpy(at, &v, 8); }

}  // namespace

extern "C" {

// Shared with gpu_server/worker/native_box.py (its BoxServer structure), field for field.
struct BoxServer {
    unsigned char* area;        // the client's staging area
    uint64_t request_box;       // offsets in it of the request box and the reply box: (seq, len), then the frame
    uint64_t reply_box;
    uint64_t asleep;            // ... and of the word where the client says which request it sleeps on
    const unsigned char* call;  // a plain ctxSynchronize request, its seq field zero
    uint64_t call_size, call_seq_at;
    const unsigned char* reply; // a plain success reply, its two fields zero: ackSeq, then results[0].seq
    uint64_t reply_size, reply_ack_at, reply_seq_at;
    int (*synchronize)();
    uint64_t seen;              // in and out: the request box's seq last taken
    uint64_t ack;               // in and out: the seq of the last call run
    uint64_t served;            // out: synchronizes answered in this call
    uint64_t served_ns;         // out: ... and their time, from seeing each request to answering it
    int64_t socket_fd;          // ZeroMQ's descriptors (ZMQ_FD) of the worker's sockets, or -1: readable
    int64_t control_fd;         // when a socket's events may have changed since the loop last looked
};

// Spins on the request box for spin_ns, answering the plain synchronizes that follow the last
// call run; returns an Outcome.
__attribute__((visibility("default"))) int phos_box_serve(BoxServer* s, uint64_t spin_ns) {
    auto* request = reinterpret_cast<uint64_t*>(s->area + s->request_box);
    auto* reply = reinterpret_cast<uint64_t*>(s->area + s->reply_box);
    auto* asleep = reinterpret_cast<uint64_t*>(s->area + s->asleep);
    const unsigned char* frame = s->area + s->request_box + 16;
    const uint64_t at = s->call_seq_at;
    pollfd sockets[2] = {{static_cast<int>(s->socket_fd), POLLIN, 0}, {static_cast<int>(s->control_fd), POLLIN, 0}};
    s->served = s->served_ns = 0;
    const auto until = Clock::now() + std::chrono::nanoseconds(spin_ns);
    for (unsigned round = 1;; round++) {
        const uint64_t seq = __atomic_load_n(request, __ATOMIC_ACQUIRE);
        if (seq == s->seen) {
            // a few microseconds apart: a message waits no longer (a poll costs a fraction of that)
            if (round % 64 == 0 && (Clock::now() >= until || poll(sockets, 2, 0) > 0))
                return Clock::now() >= until ? kSpunOut : kMessage;
            cpu_relax();
            continue;
        }
        const auto seen_at = Clock::now();
        // The client writes its frame, then len, then seq (release), and nothing more until it
        // has this request's answer: what we read after the seq stays as it was.
        if (__atomic_load_n(request + 1, __ATOMIC_ACQUIRE) != s->call_size) return kForPython;
        if (std::memcmp(frame, s->call, at) != 0 ||
            std::memcmp(frame + at + 8, s->call + at + 8, s->call_size - at - 8) != 0)
            return kForPython;
        const uint64_t call_seq = load(frame + at);
        if (call_seq != s->ack + 1) return kForPython;                             // calls before it come by socket
        if (__atomic_load_n(asleep, __ATOMIC_ACQUIRE) == seq) return kForPython;  // answered over the socket
        if (s->synchronize() != 0) return kForPython;
        unsigned char* out = s->area + s->reply_box + 16;
        std::memcpy(out, s->reply, s->reply_size);
        store(out + s->reply_ack_at, call_seq);
        store(out + s->reply_seq_at, call_seq);
        __atomic_store_n(reply + 1, s->reply_size, __ATOMIC_RELEASE);
        __atomic_store_n(reply, seq, __ATOMIC_RELEASE);
        s->seen = seq;
        s->ack = call_seq;
        s->served++;
        s->served_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - seen_at).count();
        // The client stores `asleep`, fences, then looks at the reply box once more: our store of
        // the answer must be seen before we read `asleep` (Dekker's pattern), or each misses the other.
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        if (__atomic_load_n(asleep, __ATOMIC_ACQUIRE) == seq) return kWake;
    }
}

// A synchronize with nothing to wait for: emu's, whose work is done when it arrives.
__attribute__((visibility("default"))) int phos_box_no_wait() { return 0; }

}  // extern "C"
