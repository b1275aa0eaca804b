// A trampoline around a driver entry point that reports each call and its result, for
// PHOS_VERBOSE=2 in the stub and for perf/driver_trace (the same over any driver), so
// that the calls NVIDIA's libraries make can be compared between the two.
//
// It passes the six argument registers and ten stack arguments on (cuTensorMapEncodeIm2col,
// the longest driver call, has nine on the stack); no driver call takes a floating-point
// value or a variable argument list. x86-64 System V only.
#pragma once

#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <map>
#include <mutex>
#include <string>

namespace phos::trace {

using Report = void (*)(const char* name, int result);

inline void* wrap(const char* name, void* target, Report report) {
    static std::mutex lock;
    static std::map<void*, void*> made;
    static uint8_t* page = nullptr;
    static size_t used = 0;
    std::lock_guard<std::mutex> g(lock);
    auto it = made.find(target);
    if (it != made.end()) return it->second;
    const size_t kPage = 1 << 16, kCode = 160;
    if (!page || used + kCode > kPage) {
        void* p = mmap(nullptr, kPage, PROT_READ | PROT_WRITE | PROT_EXEC, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return target;
        page = static_cast<uint8_t*>(p);
        used = 0;
    }
    std::string code;
    auto bytes = [&](std::initializer_list<uint8_t> b) { code.append(b.begin(), b.end()); };
    auto imm = [&](const void* v) { code.append(reinterpret_cast<const char*>(&v), 8); };
    const char* label = strdup(name);
    bytes({0x55, 0x48, 0x89, 0xE5});                                    // push rbp; mov rbp, rsp
    bytes({0x57, 0x56, 0x52, 0x51, 0x41, 0x50, 0x41, 0x51});            // push rdi, rsi, rdx, rcx, r8, r9
    for (int i = 9; i >= 0; i--) bytes({0xFF, 0x75, uint8_t(16 + 8 * i)});   // push [rbp + 16 + 8i]: stack arguments
    bytes({0x48, 0x8B, 0x7D, 0xF8, 0x48, 0x8B, 0x75, 0xF0, 0x48, 0x8B, 0x55, 0xE8,   // reload rdi, rsi, rdx,
           0x48, 0x8B, 0x4D, 0xE0, 0x4C, 0x8B, 0x45, 0xD8, 0x4C, 0x8B, 0x4D, 0xD0});  // rcx, r8, r9
    bytes({0x48, 0xB8});                                                // movabs rax, target; call rax
    imm(target);
    bytes({0xFF, 0xD0});
    bytes({0x48, 0x89, 0x45, 0xF8});                                    // mov [rbp - 8], rax
    bytes({0x48, 0xBF});                                                // movabs rdi, name
    imm(label);
    bytes({0x89, 0xC6, 0x48, 0xB8});                                    // mov esi, eax; movabs rax, report
    imm(reinterpret_cast<void*>(report));
    bytes({0xFF, 0xD0, 0x48, 0x8B, 0x45, 0xF8, 0xC9, 0xC3});            // call rax; mov rax, [rbp - 8]; leave; ret
    std::memcpy(page + used, code.data(), code.size());
    void* entry = page + used;
    used += kCode;
    made[target] = entry;
    return entry;
}

}  // namespace phos::trace
