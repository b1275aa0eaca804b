// Entry points phos does not implement: generated stubs that say so once and fail.
//
// The Makefile writes one stub for every name in tables/*_entry_points.txt that the
// implementation does not define (tools/gen_unsupported.sh), so a program never links
// against a CUDA call that silently does nothing.
#pragma once

#include <atomic>
#include <cstddef>

struct phos_stub_entry {
    const char* name;
    void* function;
};

extern "C" {
// Prints "phos: unsupported CUDA call <name>" the first time; returns the error to give.
__attribute__((visibility("hidden"))) int phos_unsupported_call(const char* name, std::atomic<bool>* said);

__attribute__((visibility("hidden"))) extern const phos_stub_entry phos_unsupported_driver[];
__attribute__((visibility("hidden"))) extern const size_t phos_unsupported_driver_count;
}
