// The CUDA runtime (libcudart.so.13), built on phos's driver API (libcuda.so.1) the
// way NVIDIA's runtime is built on NVIDIA's driver: one implementation of the protocol.
//
// This file holds what the runtime keeps for itself: the per-thread last error and
// device, the kernels and variables an nvcc-built program registers, and which module
// each registered fatbin became in each context.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "common.h"

#if !defined(CUDART_VERSION) || CUDART_VERSION < 13000
#error "phos's libcudart.so.13 implements the CUDA 13 ABI: build it against CUDA 13 headers (CUDA_HOME)"
#endif

namespace phos::runtime {

// One __cudaRegisterFatBinary: an nvcc-built translation unit's device code.
struct Fatbin {
    const void* image = nullptr;                  // the fatbin (0xBA55ED50) the wrapper points to
    bool registered = true;
    std::map<uint64_t, CUmodule> modules;         // context id (cuCtxGetId) -> loaded module
    std::map<uint64_t, CUresult> failures;        // context id -> why loading failed (not retried)
};

// A registered variable (__device__ or __constant__), for cudaMemcpyToSymbol and friends.
struct Variable {
    Fatbin* fatbin = nullptr;
    std::string name;
    size_t size = 0;
};

}  // namespace phos::runtime

// A registered kernel: what __cudaGetKernel hands out as a cudaKernel_t.
struct CUkern_st {
    phos::runtime::Fatbin* fatbin = nullptr;
    const void* host_function = nullptr;
    std::string name;
    uint64_t context = 0;          // the context `function` belongs to
    CUfunction function = nullptr;
};

namespace phos::runtime {

struct State {
    std::recursive_mutex lock;
    std::unordered_set<Fatbin*> fatbins;
    std::unordered_map<const void*, CUkern_st*> kernels;        // host stub -> kernel
    std::unordered_set<const CUkern_st*> kernel_handles;
    std::unordered_map<const void*, Variable> variables;        // host shadow -> variable
    std::map<int, CUcontext> primary;                           // device -> retained primary context
};
State& state();
using Guard = std::lock_guard<std::recursive_mutex>;

// Records a failure as the calling thread's last error (cudaGetLastError) and returns it.
cudaError_t record(cudaError_t error);
cudaError_t to_runtime(CUresult result);
inline cudaError_t check(CUresult result) { return record(to_runtime(result)); }

int& thread_device();
// Makes sure the calling thread has a context: the current one, or its device's primary.
cudaError_t ensure_context();
cudaError_t use_device(int device);

// Registered kernel/variable -> its function/address in the current context.
cudaError_t function_of(CUkern_st* kernel, CUfunction* function);
CUkern_st* kernel_of(const void* host_function_or_kernel);
cudaError_t symbol_address(const void* symbol, CUdeviceptr* address, size_t* size);

cudaError_t launch(CUkern_st* kernel, dim3 grid, dim3 block, void** args, size_t shared_bytes, cudaStream_t stream);
cudaError_t copy(void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t stream, bool async_api);

}  // namespace phos::runtime
