// Driver API: context-independent loading (cuLibrary*, cuKernel*), which NVIDIA's runtime
// uses for every fatbin a program or library registers.
#include "driver_state.h"

namespace phos::driver {

// The library's module in ctx, loaded there on first use.
static CUresult library_module(CUlib_st* lib, CUctx_st* ctx, CUmod_st** out) {
    auto it = lib->modules.find(ctx);
    if (it != lib->modules.end()) {
        *out = it->second;
        return CUDA_SUCCESS;
    }
    std::vector<CUctx_st*>& stack = context_stack();
    stack.push_back(ctx);     // cuModuleLoadData loads into the current context
    CUmodule m = nullptr;
    CUresult err = cuModuleLoadData(&m, lib->image.data());
    stack.pop_back();
    if (err != CUDA_SUCCESS) return err;
    m->library = lib;
    lib->modules[ctx] = m;
    *out = m;
    return CUDA_SUCCESS;
}

static CUresult kernel_function(CUkern_st* k, CUctx_st* ctx, CUfunc_st** out) {
    CUmod_st* m;
    CUresult err = library_module(k->library, ctx, &m);
    if (err != CUDA_SUCCESS) return err;
    return cuModuleGetFunction(out, m, k->name.c_str());
}

CUresult resolve_function(CUfunction f, CUfunc_st** out) {
    if (is_handle(f, HandleKind::function)) {
        *out = f;
        return CUDA_SUCCESS;
    }
    if (!is_handle(f, HandleKind::kernel)) return CUDA_ERROR_INVALID_HANDLE;
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err != CUDA_SUCCESS) return err;
    return kernel_function(reinterpret_cast<CUkern_st*>(f), ctx, out);
}

void forget_library_module(CUmod_st* m) {
    if (m->library) m->library->modules.erase(m->ctx);
}

// The image's bytes, which the library keeps (std::string's terminating NUL ends PTX text).
static CUresult copy_image(const void* code, std::string* out) {
    const void* data;
    size_t size;
    if (!image_bytes(code, &data, &size)) return CUDA_ERROR_INVALID_IMAGE;
    out->assign(static_cast<const char*>(data), size);
    return CUDA_SUCCESS;
}

}  // namespace phos::driver

using namespace phos;
using namespace phos::driver;

PHOS_EXPORT CUresult cuLibraryLoadData(CUlibrary* library, const void* code, CUjit_option*, void**, unsigned int,
                                       CUlibraryOption* options, void** values, unsigned int count) {
    if (!library || !code) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = require_init();
    if (err != CUDA_SUCCESS) return err;
    for (unsigned i = 0; options && i < count; i++) {
        // Keeping the caller's buffer is a memory-use hint; phos copies either way.
        if (options[i] != CU_LIBRARY_BINARY_IS_PRESERVED) {
            log_error("cuLibraryLoadData: library option %d is not supported", static_cast<int>(options[i]));
            return CUDA_ERROR_NOT_SUPPORTED;
        }
        (void)values;
    }
    auto lib = std::make_unique<CUlib_st>();
    if ((err = copy_image(code, &lib->image)) != CUDA_SUCCESS) return err;
    state().handles[lib.get()] = HandleKind::library;
    *library = lib.release();
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuLibraryUnload(CUlibrary library) {
    State& s = state();
    Guard g(s.lock);
    if (!is_handle(library, HandleKind::library)) return CUDA_ERROR_INVALID_HANDLE;
    auto modules = library->modules;    // cuModuleUnload edits the map
    for (auto& [ctx, m] : modules)
        if (ctx->live) cuModuleUnload(m);
    for (auto& [name, k] : library->kernels) s.handles.erase(k.get());
    s.handles.erase(library);
    delete library;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuLibraryGetKernel(CUkernel* kernel, CUlibrary library, const char* name) {
    if (!kernel || !name) return CUDA_ERROR_INVALID_VALUE;
    State& s = state();
    Guard g(s.lock);
    if (!is_handle(library, HandleKind::library)) return CUDA_ERROR_INVALID_HANDLE;
    auto& k = library->kernels[name];
    if (!k) {
        k = std::make_unique<CUkern_st>();
        k->library = library;
        k->name = name;
        s.handles[k.get()] = HandleKind::kernel;
    }
    *kernel = k.get();
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuLibraryGetModule(CUmodule* module, CUlibrary library) {
    if (!module) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    if (!is_handle(library, HandleKind::library)) return CUDA_ERROR_INVALID_HANDLE;
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err != CUDA_SUCCESS) return err;
    return library_module(library, ctx, module);
}

PHOS_EXPORT CUresult cuLibraryGetGlobal(CUdeviceptr* dptr, size_t* bytes, CUlibrary library, const char* name) {
    CUmodule m;
    Guard g(state().lock);
    CUresult err = cuLibraryGetModule(&m, library);
    return err != CUDA_SUCCESS ? err : cuModuleGetGlobal_v2(dptr, bytes, m, name);
}

PHOS_EXPORT CUresult cuKernelGetFunction(CUfunction* function, CUkernel kernel) {
    if (!function) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    if (!is_handle(kernel, HandleKind::kernel)) return CUDA_ERROR_INVALID_HANDLE;
    return resolve_function(reinterpret_cast<CUfunction>(kernel), function);
}

PHOS_EXPORT CUresult cuKernelGetLibrary(CUlibrary* library, CUkernel kernel) {
    if (!library) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    if (!is_handle(kernel, HandleKind::kernel)) return CUDA_ERROR_INVALID_HANDLE;
    *library = kernel->library;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuKernelGetName(const char** name, CUkernel kernel) {
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    if (!is_handle(kernel, HandleKind::kernel)) return CUDA_ERROR_INVALID_HANDLE;
    *name = kernel->name.c_str();
    return CUDA_SUCCESS;
}

// The per-device forms answer for the device's primary context, where the runtime runs them.
static CUresult kernel_on_device(CUkernel kernel, CUdevice dev, CUfunc_st** out) {
    if (!is_handle(kernel, HandleKind::kernel)) return CUDA_ERROR_INVALID_HANDLE;
    CUresult err = check_device(dev);
    if (err != CUDA_SUCCESS) return err;
    CUctx_st* ctx = primary_context_of(dev);
    if ((err = make_usable(ctx)) != CUDA_SUCCESS) return err;
    return kernel_function(kernel, ctx, out);
}

PHOS_EXPORT CUresult cuKernelGetAttribute(int* value, CUfunction_attribute attribute, CUkernel kernel, CUdevice dev) {
    Guard g(state().lock);
    CUfunc_st* f;
    CUresult err = kernel_on_device(kernel, dev, &f);
    return err != CUDA_SUCCESS ? err : cuFuncGetAttribute(value, attribute, f);
}

PHOS_EXPORT CUresult cuKernelSetAttribute(CUfunction_attribute attribute, int value, CUkernel kernel, CUdevice dev) {
    Guard g(state().lock);
    CUfunc_st* f;
    CUresult err = kernel_on_device(kernel, dev, &f);
    return err != CUDA_SUCCESS ? err : cuFuncSetAttribute(f, attribute, value);
}

PHOS_EXPORT CUresult cuKernelSetCacheConfig(CUkernel kernel, CUfunc_cache config, CUdevice dev) {
    Guard g(state().lock);
    CUfunc_st* f;
    CUresult err = kernel_on_device(kernel, dev, &f);
    return err != CUDA_SUCCESS ? err : cuFuncSetCacheConfig(f, config);
}

PHOS_EXPORT CUresult cuKernelGetParamInfo(CUkernel kernel, size_t index, size_t* offset, size_t* size) {
    Guard g(state().lock);
    CUfunc_st* f;
    CUresult err = resolve_function(reinterpret_cast<CUfunction>(kernel), &f);
    return err != CUDA_SUCCESS ? err : cuFuncGetParamInfo(f, index, offset, size);
}
