// Host copies of bulk bytes on a few threads (parallel_copy.cpp says why and how).
#pragma once

#include <cstddef>

#include "common.h"

namespace phos {

// Copies of this many bytes and more are split between threads; smaller ones are one memcpy.
constexpr size_t kParallelCopyMin = 4u << 20;

// memcpy(dst, src, n) (the two must not overlap), by `threads` threads at once, the caller one
// of them, when n >= kParallelCopyMin and threads > 1; the helpers start at the first such copy
// (and stay: a later call asking for fewer threads may get the help of more). Returns once every
// byte is copied. Safe from any thread, before and after fork; never throws.
void parallel_copy(void* dst, const void* src, size_t n, long threads) noexcept;

// The same, with PHOS_COPY_THREADS threads: how the stub copies bulk bytes into and out of the
// staging area, payloads and Replies.
inline void copy_bulk(void* dst, const void* src, size_t n) noexcept {
    parallel_copy(dst, src, n, settings().copy_threads);
}

}  // namespace phos
