// Host copies of bulk bytes on a few threads (parallel_copy.h).
//
// Why: a pageable copy through the staging area is a memcpy into (or out of) a 32 MiB slot on
// the application's thread for every chunk the worker copies to (or from) the device, and one
// core's memcpy is slower than the DMA behind it (on the H200's VM a 4 GiB pageable load ran at
// 5.9 GB/s through phos, 8.67 natively). Several cores together copy faster.
//
// How: helper threads, started at the first large copy, so a program that never makes one never
// has them. A copy is cut into page-aligned parts (threads never write the same page); the
// caller publishes the job, copies parts itself, and then waits for the parts helpers took. As
// the caller takes parts too, a copy completes even if no helper wakes in time.
//
// Safe in any application:
// * One copy uses the helpers at a time. Another thread that copies meanwhile copies alone
//   (memcpy): it never waits for someone else's copy.
// * fork(): the child has none of our threads, and perhaps a pool caught mid-copy. A child
//   forgets the pool (pthread_atfork; the old one is left untouched, as its lock may be held by
//   a thread that does not exist there) and starts helpers of its own at its first large copy.
// * Exit: helpers are detached, and the pool is never destroyed (a condition variable may not
//   be destroyed while threads wait on it): the process ends them wherever they wait.
// * Helpers block the asynchronous signals, so the application's handlers run on its own threads.
// * Nothing throws: where memory or a thread cannot be had, fewer threads copy, or memcpy alone.
#include "parallel_copy.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <new>

namespace phos {

namespace {

constexpr size_t kMinPart = 1u << 20;   // smaller parts cost more in hand-offs than they gain
constexpr long kMaxThreads = 64;

struct Pool {
    std::mutex lock;
    std::condition_variable work;       // helpers wait here for parts to take
    std::condition_variable done;       // the caller waits here for the parts helpers took
    // The job, valid while parts are left to take or being copied (next < parts or running > 0).
    char* dst = nullptr;
    const char* src = nullptr;
    size_t n = 0, parts = 0, next = 0, running = 0;
    long helpers = 0;
    const size_t page = static_cast<size_t>(std::max(4096L, sysconf(_SC_PAGESIZE)));

    // Where part i starts: a page boundary of dst, so that no two threads write one page.
    size_t start(size_t i) const {
        if (i == 0) return 0;
        if (i >= parts) return n;
        const uintptr_t base = reinterpret_cast<uintptr_t>(dst);
        const uintptr_t at = (base + n / parts * i) & ~static_cast<uintptr_t>(page - 1);
        return at <= base ? 0 : std::min(n, static_cast<size_t>(at - base));
    }
    // Takes part i (under `lock`), copies it without the lock, hands it back.
    void copy_one(std::unique_lock<std::mutex>& held) {
        const size_t i = next++;
        const size_t begin = start(i), end = start(i + 1);
        char* to = dst;
        const char* from = src;
        running++;
        held.unlock();
        std::memcpy(to + begin, from + begin, end - begin);
        held.lock();
        if (--running == 0 && next >= parts) done.notify_one();
    }
};

Pool* pool = nullptr;                     // the process's; made and used by the copy holding `busy`
std::atomic<bool> busy{false};            // a copy is using `pool`

void* helper(void* arg) {
    Pool* p = static_cast<Pool*>(arg);
    std::unique_lock<std::mutex> held(p->lock);
    while (true) {
        p->work.wait(held, [p] { return p->next < p->parts; });
        p->copy_one(held);
    }
    return nullptr;
}

// In a forked child (only the forking thread exists): the parent's pool has no threads here.
void forget_pool_in_child() {
    pool = nullptr;
    busy.store(false, std::memory_order_relaxed);
}

// Starts helpers until `want` run; false if none can be had. Called holding `busy`.
bool start_helpers(Pool* p, long want) {
    if (p->helpers >= want) return true;
    sigset_t all, old;
    sigfillset(&all);
    for (int sync : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP}) sigdelset(&all, sync);   // a fault stays a fault
    pthread_sigmask(SIG_SETMASK, &all, &old);   // inherited by the helpers
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    while (p->helpers < want) {
        pthread_t t;
        if (pthread_create(&t, &attr, helper, p) != 0) break;   // out of threads: the rest copy
        pthread_setname_np(t, "phos-copy");
        p->helpers++;
    }
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    return p->helpers > 0;
}

// The pool, with helpers enough for `threads`, or null. Called holding `busy`.
Pool* pool_for(long threads) {
    if (!pool) {
        static bool registered = false;   // once per process: the handler stays registered in children
        if (!registered) registered = pthread_atfork(nullptr, nullptr, forget_pool_in_child) == 0;
        if (!registered) return nullptr;   // a child could not tell the pool is not its own
        pool = new (std::nothrow) Pool();
        if (!pool) return nullptr;
    }
    return start_helpers(pool, threads - 1) ? pool : nullptr;
}

}  // namespace

void parallel_copy(void* dst, const void* src, size_t n, long threads) noexcept {
    threads = std::min(threads, kMaxThreads);
    if (n < kParallelCopyMin || threads <= 1 || busy.exchange(true, std::memory_order_acquire)) {
        std::memcpy(dst, src, n);   // small, one thread asked for, or another copy has the helpers
        return;
    }
    Pool* p = pool_for(threads);
    if (!p) {
        busy.store(false, std::memory_order_release);
        std::memcpy(dst, src, n);
        return;
    }
    // Not cancelled while helpers write into dst (pthread_cond_wait is a cancellation point).
    int cancel_state;
    pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &cancel_state);
    {
        std::unique_lock<std::mutex> held(p->lock);
        p->dst = static_cast<char*>(dst);
        p->src = static_cast<const char*>(src);
        p->n = n;
        p->next = 0;
        // a few parts a thread, so that a helper that wakes late takes fewer
        p->parts = std::min(static_cast<size_t>(threads) * 4, n / kMinPart);
        p->work.notify_all();
        while (p->next < p->parts) p->copy_one(held);
        p->done.wait(held, [p] { return p->running == 0; });
        p->parts = p->next = 0;   // nothing left to take: helpers sleep
    }
    busy.store(false, std::memory_order_release);
    pthread_setcancelstate(cancel_state, nullptr);
}

}  // namespace phos
