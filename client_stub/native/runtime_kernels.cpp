// Runtime: what nvcc-built programs register and launch.
//
// nvcc's generated code calls, from a constructor before main:
//   handle = __cudaRegisterFatBinary(&wrapper)        wrapper = {magic, version, fatbin, ...}
//   __cudaRegisterFunction(handle, hostStub, name, ...)   per __global__ function
//   __cudaRegisterVar(handle, hostShadow, name, ...)      per __device__/__constant__ variable
//   __cudaRegisterFatBinaryEnd(handle)
// and for each kernel<<<grid, block, shared, stream>>>(args):
//   __cudaPushCallConfiguration(grid, block, shared, stream)
//   __cudaGetKernel(&kernel, hostStub)                     once per call site
//   __cudaPopCallConfiguration(&grid, &block, &shared, &stream)
//   __cudaLaunchKernel(kernel, grid, block, args, shared, stream)
// Nothing is sent to the server at registration: a fatbin becomes a module in a
// context the first time one of its kernels or variables is used there, so a program
// that never touches the GPU never connects.
#include <cstring>
#include <vector>

#include "runtime_state.h"

namespace phos::runtime {

constexpr int kFatbinWrapperMagic = 0x466243B1;

State& state() {
    static State* s = new State();   // never destroyed: __cudaUnregisterFatBinary runs during exit
    return *s;
}

int& thread_device() {
    thread_local int device = 0;
    return device;
}

cudaError_t use_device(int device) {
    State& s = state();
    CUcontext ctx = nullptr;
    auto it = s.primary.find(device);
    if (it != s.primary.end()) {
        ctx = it->second;
    } else {
        CUresult r = cuDevicePrimaryCtxRetain(&ctx, device);
        if (r != CUDA_SUCCESS) return to_runtime(r);
        s.primary[device] = ctx;
    }
    thread_device() = device;
    return to_runtime(cuCtxSetCurrent(ctx));
}

cudaError_t ensure_context() {
    static const CUresult init = cuInit(0);
    if (init != CUDA_SUCCESS) return init == CUDA_ERROR_NO_DEVICE || init == CUDA_ERROR_CONTEXT_IS_DESTROYED
                                          ? cudaErrorNoDevice : to_runtime(init);
    CUcontext current = nullptr;
    if (cuCtxGetCurrent(&current) == CUDA_SUCCESS && current) return cudaSuccess;
    Guard g(state().lock);
    return use_device(thread_device());
}

CUkern_st* kernel_of(const void* host_function_or_kernel) {
    State& s = state();
    auto it = s.kernels.find(host_function_or_kernel);
    if (it != s.kernels.end()) return it->second;
    // CUDA 12+ also accepts the cudaKernel_t from cudaGetKernel where a function is expected.
    auto* k = static_cast<const CUkern_st*>(host_function_or_kernel);
    return s.kernel_handles.count(k) ? const_cast<CUkern_st*>(k) : nullptr;
}

static cudaError_t module_of(Fatbin* fatbin, uint64_t context, CUmodule* module) {
    auto loaded = fatbin->modules.find(context);
    if (loaded != fatbin->modules.end()) {
        *module = loaded->second;
        return cudaSuccess;
    }
    auto failed = fatbin->failures.find(context);
    if (failed != fatbin->failures.end()) return to_runtime(failed->second);
    CUresult r = cuModuleLoadData(module, fatbin->image);
    if (r != CUDA_SUCCESS) {
        fatbin->failures[context] = r;
        return to_runtime(r);
    }
    fatbin->modules[context] = *module;
    return cudaSuccess;
}

static cudaError_t current_context_id(uint64_t* id) {
    cudaError_t e = ensure_context();
    if (e != cudaSuccess) return e;
    unsigned long long uid = 0;
    CUresult r = cuCtxGetId(nullptr, &uid);
    *id = uid;
    return to_runtime(r);
}

cudaError_t function_of(CUkern_st* kernel, CUfunction* function) {
    uint64_t context = 0;
    cudaError_t e = current_context_id(&context);
    if (e != cudaSuccess) return e;
    if (kernel->function && kernel->context == context) {
        *function = kernel->function;
        return cudaSuccess;
    }
    if (!kernel->fatbin->registered) return cudaErrorInvalidDeviceFunction;
    CUmodule module;
    if ((e = module_of(kernel->fatbin, context, &module)) != cudaSuccess) return e;
    CUresult r = cuModuleGetFunction(&kernel->function, module, kernel->name.c_str());
    if (r != CUDA_SUCCESS) return r == CUDA_ERROR_NOT_FOUND ? cudaErrorInvalidDeviceFunction : to_runtime(r);
    kernel->context = context;
    *function = kernel->function;
    return cudaSuccess;
}

cudaError_t symbol_address(const void* symbol, CUdeviceptr* address, size_t* size) {
    State& s = state();
    auto it = s.variables.find(symbol);
    if (it == s.variables.end() || !it->second.fatbin->registered) return cudaErrorInvalidSymbol;
    uint64_t context = 0;
    cudaError_t e = current_context_id(&context);
    if (e != cudaSuccess) return e;
    CUmodule module;
    if ((e = module_of(it->second.fatbin, context, &module)) != cudaSuccess) return e;
    CUresult r = cuModuleGetGlobal(address, size, module, it->second.name.c_str());
    return r == CUDA_ERROR_NOT_FOUND ? cudaErrorInvalidSymbol : to_runtime(r);
}

cudaError_t launch(CUkern_st* kernel, dim3 grid, dim3 block, void** args, size_t shared_bytes, cudaStream_t stream) {
    if (!kernel) return record(cudaErrorInvalidDeviceFunction);
    CUfunction function;
    cudaError_t e;
    {
        Guard g(state().lock);
        e = function_of(kernel, &function);
    }
    if (e != cudaSuccess) return record(e);
    CUresult r = cuLaunchKernel(function, grid.x, grid.y, grid.z, block.x, block.y, block.z,
                                static_cast<unsigned>(shared_bytes), stream, args, nullptr);
    // An impossible block gives cudaErrorInvalidValue, as NVIDIA's CUDA 13 runtime does on the
    // H200 (not cudaErrorInvalidConfiguration, which its documentation suggests).
    return record(to_runtime(r));
}

// -- launch configuration stack (per thread; no round trip) ---------------------------------

struct LaunchConfiguration {
    dim3 grid, block;
    size_t shared_bytes;
    cudaStream_t stream;
};

static std::vector<LaunchConfiguration>& configurations() {
    thread_local std::vector<LaunchConfiguration> stack;
    return stack;
}

}  // namespace phos::runtime

using namespace phos;
using namespace phos::runtime;

// ======================================================================================
// Registration and launch entry points (crt/host_runtime.h)
// ======================================================================================

PHOS_EXPORT void** __cudaRegisterFatBinary(void* wrapper) {
    Guard g(state().lock);
    auto* fatbin = new Fatbin();
    int magic = 0;
    std::memcpy(&magic, wrapper, sizeof magic);
    if (magic == kFatbinWrapperMagic) {
        std::memcpy(&fatbin->image, static_cast<char*>(wrapper) + 8, sizeof fatbin->image);
    } else {
        fatbin->image = wrapper;   // a bare fatbin, as some tools register
    }
    state().fatbins.insert(fatbin);
    return reinterpret_cast<void**>(fatbin);
}

PHOS_EXPORT void __cudaRegisterFatBinaryEnd(void**) {}

PHOS_EXPORT void __cudaUnregisterFatBinary(void** handle) {
    // Runs at exit, or when a library holding device code is unloaded: forget its
    // kernels and variables (their addresses may be reused) but say nothing to the
    // server; the context goes away with the process.
    State& s = state();
    Guard g(s.lock);
    auto* fatbin = reinterpret_cast<Fatbin*>(handle);
    if (!s.fatbins.count(fatbin)) return;
    fatbin->registered = false;
    for (auto it = s.kernels.begin(); it != s.kernels.end();) it = it->second->fatbin == fatbin ? s.kernels.erase(it) : std::next(it);
    for (auto it = s.variables.begin(); it != s.variables.end();)
        it = it->second.fatbin == fatbin ? s.variables.erase(it) : std::next(it);
}

PHOS_EXPORT void __cudaRegisterFunction(void** handle, const char* host_function, char* device_function,
                                        const char* device_name, int, uint3*, uint3*, dim3*, dim3*, int*) {
    State& s = state();
    Guard g(s.lock);
    auto* k = new CUkern_st();
    k->fatbin = reinterpret_cast<Fatbin*>(handle);
    k->host_function = host_function;
    k->name = device_name ? device_name : device_function;
    s.kernels[host_function] = k;
    s.kernel_handles.insert(k);
}

PHOS_EXPORT void __cudaRegisterVar(void** handle, char* host_variable, char* device_address, const char* device_name,
                                   int, size_t size, int, int) {
    State& s = state();
    Guard g(s.lock);
    s.variables[host_variable] = Variable{reinterpret_cast<Fatbin*>(handle), device_name ? device_name : device_address, size};
}

PHOS_EXPORT void __cudaRegisterManagedVar(void**, void**, char*, const char* device_name, int, size_t, int, int) {
    log_error("unsupported CUDA call __cudaRegisterManagedVar (__managed__ variable %s)", device_name ? device_name : "?");
}

PHOS_EXPORT char __cudaInitModule(void** handle) {
    State& s = state();
    Guard g(s.lock);
    auto* fatbin = reinterpret_cast<Fatbin*>(handle);
    uint64_t context = 0;
    CUmodule module;
    if (!s.fatbins.count(fatbin) || current_context_id(&context) != cudaSuccess) return 0;
    return module_of(fatbin, context, &module) == cudaSuccess ? 1 : 0;
}

PHOS_EXPORT unsigned __cudaPushCallConfiguration(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream) {
    configurations().push_back(LaunchConfiguration{grid, block, shared_bytes, stream});
    return 0;
}

PHOS_EXPORT cudaError_t __cudaPopCallConfiguration(dim3* grid, dim3* block, size_t* shared_bytes, void* stream) {
    auto& stack = configurations();
    if (stack.empty()) return cudaErrorMissingConfiguration;
    const LaunchConfiguration c = stack.back();
    stack.pop_back();
    *grid = c.grid;
    *block = c.block;
    *shared_bytes = c.shared_bytes;
    *static_cast<cudaStream_t*>(stream) = c.stream;
    return cudaSuccess;
}

PHOS_EXPORT cudaError_t __cudaGetKernel(cudaKernel_t* kernel, const void* host_function) {
    Guard g(state().lock);
    CUkern_st* k = kernel_of(host_function);
    if (kernel) *kernel = k;
    return k ? cudaSuccess : record(cudaErrorInvalidDeviceFunction);
}

PHOS_EXPORT cudaError_t __cudaLaunchKernel(cudaKernel_t kernel, dim3 grid, dim3 block, void** args, size_t shared_bytes,
                                           cudaStream_t stream) {
    CUkern_st* k;
    {
        Guard g(state().lock);
        k = state().kernel_handles.count(kernel) ? kernel : nullptr;
    }
    return launch(k, grid, block, args, shared_bytes, stream);
}

PHOS_EXPORT cudaError_t __cudaLaunchKernel_ptsz(cudaKernel_t kernel, dim3 grid, dim3 block, void** args,
                                                size_t shared_bytes, cudaStream_t stream) {
    return __cudaLaunchKernel(kernel, grid, block, args, shared_bytes, stream);
}

// ======================================================================================
// Runtime API: launches, functions, symbols
// ======================================================================================

PHOS_EXPORT cudaError_t cudaLaunchKernel(const void* function, dim3 grid, dim3 block, void** args, size_t shared_bytes,
                                         cudaStream_t stream) {
    CUkern_st* k;
    {
        Guard g(state().lock);
        k = kernel_of(function);
    }
    return launch(k, grid, block, args, shared_bytes, stream);
}

PHOS_EXPORT cudaError_t cudaLaunchKernel_ptsz(const void* function, dim3 grid, dim3 block, void** args,
                                              size_t shared_bytes, cudaStream_t stream) {
    return cudaLaunchKernel(function, grid, block, args, shared_bytes, stream);
}

PHOS_EXPORT cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t* config, const void* function, void** args) {
    if (!config) return record(cudaErrorInvalidValue);
    if (config->numAttrs > 0) {
        log_error("cudaLaunchKernelEx: launch attribute %d is not supported", static_cast<int>(config->attrs[0].id));
        return record(cudaErrorNotSupported);
    }
    return cudaLaunchKernel(function, config->gridDim, config->blockDim, args, config->dynamicSmemBytes, config->stream);
}

PHOS_EXPORT cudaError_t cudaLaunchKernelExC_ptsz(const cudaLaunchConfig_t* config, const void* function, void** args) {
    return cudaLaunchKernelExC(config, function, args);
}

static cudaError_t resolve(const void* function, CUfunction* f) {
    cudaError_t e = ensure_context();
    if (e != cudaSuccess) return e;
    Guard g(state().lock);
    CUkern_st* k = kernel_of(function);
    return k ? function_of(k, f) : cudaErrorInvalidDeviceFunction;
}

PHOS_EXPORT cudaError_t cudaGetFuncBySymbol(cudaFunction_t* function, const void* symbol) {
    if (!function) return record(cudaErrorInvalidValue);
    CUfunction f;
    cudaError_t e = resolve(symbol, &f);
    if (e == cudaSuccess) *function = reinterpret_cast<cudaFunction_t>(f);
    return record(e);
}

PHOS_EXPORT cudaError_t cudaFuncGetName(const char** name, const void* function) {
    if (!name) return record(cudaErrorInvalidValue);
    Guard g(state().lock);
    CUkern_st* k = kernel_of(function);
    if (!k) return record(cudaErrorInvalidDeviceFunction);
    *name = k->name.c_str();
    return cudaSuccess;
}

PHOS_EXPORT cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, const void* function) {
    if (!attributes) return record(cudaErrorInvalidValue);
    CUfunction f;
    cudaError_t e = resolve(function, &f);
    if (e != cudaSuccess) return record(e);
    std::memset(attributes, 0, sizeof *attributes);
    int v = 0;
    auto get = [&](CUfunction_attribute a) { return cuFuncGetAttribute(&v, a, f) == CUDA_SUCCESS ? v : 0; };
    attributes->sharedSizeBytes = static_cast<size_t>(get(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES));
    attributes->constSizeBytes = static_cast<size_t>(get(CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES));
    attributes->localSizeBytes = static_cast<size_t>(get(CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES));
    attributes->maxThreadsPerBlock = get(CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
    attributes->numRegs = get(CU_FUNC_ATTRIBUTE_NUM_REGS);
    attributes->ptxVersion = get(CU_FUNC_ATTRIBUTE_PTX_VERSION);
    attributes->binaryVersion = get(CU_FUNC_ATTRIBUTE_BINARY_VERSION);
    attributes->cacheModeCA = get(CU_FUNC_ATTRIBUTE_CACHE_MODE_CA);
    attributes->maxDynamicSharedSizeBytes = get(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES);
    attributes->preferredShmemCarveout = get(CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT);
    return cudaSuccess;
}

// A preference the hardware may ignore: accepted for a known function.
PHOS_EXPORT cudaError_t cudaFuncSetCacheConfig(const void* function, cudaFuncCache) {
    Guard g(state().lock);
    return kernel_of(function) ? cudaSuccess : record(cudaErrorInvalidDeviceFunction);
}

// See cuOccupancyMaxActiveBlocksPerMultiprocessor: from the device's limits, assuming
// 32 registers per thread and no static shared memory (the server reports neither).
PHOS_EXPORT cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* blocks, const void* function,
                                                                               int block_size, size_t dynamic_shared,
                                                                               unsigned int flags) {
    CUfunction f;
    cudaError_t e = resolve(function, &f);
    if (e != cudaSuccess) return record(e);
    return check(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(blocks, f, block_size, dynamic_shared, flags));
}

PHOS_EXPORT cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, const void* function, int block_size,
                                                                      size_t dynamic_shared) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(blocks, function, block_size, dynamic_shared, 0);
}

PHOS_EXPORT cudaError_t cudaGetSymbolAddress(void** address, const void* symbol) {
    if (!address) return record(cudaErrorInvalidValue);
    Guard g(state().lock);
    CUdeviceptr a = 0;
    size_t size = 0;
    cudaError_t e = symbol_address(symbol, &a, &size);
    if (e == cudaSuccess) *address = reinterpret_cast<void*>(a);
    return record(e);
}

PHOS_EXPORT cudaError_t cudaGetSymbolSize(size_t* size, const void* symbol) {
    if (!size) return record(cudaErrorInvalidValue);
    Guard g(state().lock);
    CUdeviceptr a = 0;
    return record(symbol_address(symbol, &a, size));
}

static cudaError_t symbol_copy(const void* symbol, size_t count, size_t offset, CUdeviceptr* where) {
    Guard g(state().lock);
    size_t size = 0;
    cudaError_t e = symbol_address(symbol, where, &size);
    if (e != cudaSuccess) return e;
    if (offset > size || count > size - offset) return cudaErrorInvalidValue;
    *where += offset;
    return cudaSuccess;
}

PHOS_EXPORT cudaError_t cudaMemcpyToSymbolAsync(const void* symbol, const void* src, size_t count, size_t offset,
                                                cudaMemcpyKind kind, cudaStream_t stream) {
    if (kind != cudaMemcpyHostToDevice && kind != cudaMemcpyDeviceToDevice && kind != cudaMemcpyDefault)
        return record(cudaErrorInvalidMemcpyDirection);
    CUdeviceptr dst = 0;
    cudaError_t e = symbol_copy(symbol, count, offset, &dst);
    if (e != cudaSuccess) return record(e);
    return copy(reinterpret_cast<void*>(dst), src, count, kind, stream, true);
}

PHOS_EXPORT cudaError_t cudaMemcpyToSymbol(const void* symbol, const void* src, size_t count, size_t offset,
                                           cudaMemcpyKind kind) {
    if (kind != cudaMemcpyHostToDevice && kind != cudaMemcpyDeviceToDevice && kind != cudaMemcpyDefault)
        return record(cudaErrorInvalidMemcpyDirection);
    CUdeviceptr dst = 0;
    cudaError_t e = symbol_copy(symbol, count, offset, &dst);
    if (e != cudaSuccess) return record(e);
    return copy(reinterpret_cast<void*>(dst), src, count, kind, nullptr, false);
}

PHOS_EXPORT cudaError_t cudaMemcpyFromSymbolAsync(void* dst, const void* symbol, size_t count, size_t offset,
                                                  cudaMemcpyKind kind, cudaStream_t stream) {
    if (kind != cudaMemcpyDeviceToHost && kind != cudaMemcpyDeviceToDevice && kind != cudaMemcpyDefault)
        return record(cudaErrorInvalidMemcpyDirection);
    CUdeviceptr src = 0;
    cudaError_t e = symbol_copy(symbol, count, offset, &src);
    if (e != cudaSuccess) return record(e);
    return copy(dst, reinterpret_cast<const void*>(src), count, kind, stream, true);
}

PHOS_EXPORT cudaError_t cudaMemcpyFromSymbol(void* dst, const void* symbol, size_t count, size_t offset,
                                             cudaMemcpyKind kind) {
    if (kind != cudaMemcpyDeviceToHost && kind != cudaMemcpyDeviceToDevice && kind != cudaMemcpyDefault)
        return record(cudaErrorInvalidMemcpyDirection);
    CUdeviceptr src = 0;
    cudaError_t e = symbol_copy(symbol, count, offset, &src);
    if (e != cudaSuccess) return record(e);
    return copy(dst, reinterpret_cast<const void*>(src), count, kind, nullptr, false);
}

PHOS_EXPORT cudaError_t cudaMemcpyToSymbol_ptds(const void* symbol, const void* src, size_t count, size_t offset,
                                                cudaMemcpyKind kind) {
    return cudaMemcpyToSymbol(symbol, src, count, offset, kind);
}
PHOS_EXPORT cudaError_t cudaMemcpyFromSymbol_ptds(void* dst, const void* symbol, size_t count, size_t offset,
                                                  cudaMemcpyKind kind) {
    return cudaMemcpyFromSymbol(dst, symbol, count, offset, kind);
}
PHOS_EXPORT cudaError_t cudaMemcpyToSymbolAsync_ptsz(const void* symbol, const void* src, size_t count, size_t offset,
                                                     cudaMemcpyKind kind, cudaStream_t stream) {
    return cudaMemcpyToSymbolAsync(symbol, src, count, offset, kind, stream);
}
PHOS_EXPORT cudaError_t cudaMemcpyFromSymbolAsync_ptsz(void* dst, const void* symbol, size_t count, size_t offset,
                                                       cudaMemcpyKind kind, cudaStream_t stream) {
    return cudaMemcpyFromSymbolAsync(dst, symbol, count, offset, kind, stream);
}

PHOS_EXPORT cudaError_t cudaGetKernel(cudaKernel_t* kernel, const void* host_function) {
    if (!kernel) return record(cudaErrorInvalidValue);
    return __cudaGetKernel(kernel, host_function);
}

PHOS_EXPORT cudaError_t cudaFuncGetParamInfo(const void* function, size_t index, size_t* offset, size_t* size) {
    CUfunction f;
    cudaError_t e = resolve(function, &f);
    if (e != cudaSuccess) return record(e);
    return check(cuFuncGetParamInfo(f, index, offset, size));
}
