// Driver API: cuGetProcAddress and its table, error names, the older variants of calls
// that CUDA 13's cuda.h maps to newer symbols, and the per-thread-stream variants.
#include "error_table.h"
#include <cstring>
#include <string>
#include <unordered_map>

#include <cudaProfiler.h>

#include "call_trace.h"
#include "driver_state.h"
#include "unsupported.h"

using namespace phos;
using namespace phos::driver;

// -- older variants: same behaviour, the ABI of an earlier cuda.h -------------------------
// cuda.h #defines these names to their newest variant; undo that to define the old ones.
#undef cuCtxCreate
#undef cuCtxDestroy
#undef cuCtxPushCurrent
#undef cuCtxPopCurrent
#undef cuStreamDestroy
#undef cuEventDestroy
#undef cuEventElapsedTime
#undef cuDeviceGetUuid
#undef cuDevicePrimaryCtxRelease
#undef cuDevicePrimaryCtxReset
#undef cuDevicePrimaryCtxSetFlags
#undef cuMemHostRegister
#undef cuGetProcAddress

PHOS_EXPORT CUresult cuCtxCreate_v2(CUcontext* pctx, unsigned int flags, CUdevice dev);
PHOS_EXPORT CUresult cuCtxCreate_v3(CUcontext* pctx, CUexecAffinityParam* affinity, int count, unsigned int flags,
                                    CUdevice dev);
PHOS_EXPORT CUresult cuFuncGetParamCount(CUfunction f, size_t* count);
PHOS_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec* out, CUgraph graph, CUgraphNode* error_node, char* log, size_t size);
PHOS_EXPORT CUresult cuStreamGetCaptureInfo_v2(CUstream stream, CUstreamCaptureStatus* status, cuuint64_t* id,
                                               CUgraph* graph, const CUgraphNode** deps, size_t* count);

PHOS_EXPORT CUresult cuCtxCreate(CUcontext* pctx, unsigned int flags, CUdevice dev) { return cuCtxCreate_v2(pctx, flags, dev); }
PHOS_EXPORT CUresult cuCtxDestroy(CUcontext ctx) { return cuCtxDestroy_v2(ctx); }
PHOS_EXPORT CUresult cuCtxPushCurrent(CUcontext ctx) { return cuCtxPushCurrent_v2(ctx); }
PHOS_EXPORT CUresult cuCtxPopCurrent(CUcontext* pctx) { return cuCtxPopCurrent_v2(pctx); }
PHOS_EXPORT CUresult cuStreamDestroy(CUstream stream) { return cuStreamDestroy_v2(stream); }
PHOS_EXPORT CUresult cuEventDestroy(CUevent event) { return cuEventDestroy_v2(event); }
PHOS_EXPORT CUresult cuEventElapsedTime(float* ms, CUevent start, CUevent end) { return cuEventElapsedTime_v2(ms, start, end); }
PHOS_EXPORT CUresult cuDeviceGetUuid(CUuuid* uuid, CUdevice dev) { return cuDeviceGetUuid_v2(uuid, dev); }
PHOS_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev) { return cuDevicePrimaryCtxRelease_v2(dev); }
PHOS_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev) { return cuDevicePrimaryCtxReset_v2(dev); }
PHOS_EXPORT CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags) { return cuDevicePrimaryCtxSetFlags_v2(dev, flags); }
PHOS_EXPORT CUresult cuMemHostRegister(void* p, size_t n, unsigned int flags) { return cuMemHostRegister_v2(p, n, flags); }

// CUDA 13 forms that name the context explicitly.
PHOS_EXPORT CUresult cuCtxSynchronize_v2(CUcontext ctx) {
    Guard g(state().lock);
    if (!ctx) return cuCtxSynchronize();
    CUresult err = require_init();
    if (err != CUDA_SUCCESS) return err;
    if (!is_handle(ctx, HandleKind::context)) return CUDA_ERROR_INVALID_CONTEXT;
    if ((err = make_usable(ctx)) != CUDA_SUCCESS) return err;
    return send(ctx, wire::Call::plain(wire::Kind::ctxSynchronize));
}

PHOS_EXPORT CUresult cuCtxGetDevice_v2(CUdevice* device, CUcontext ctx) {
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    if (!ctx) return cuCtxGetDevice(device);
    if (!is_handle(ctx, HandleKind::context)) return CUDA_ERROR_INVALID_CONTEXT;
    *device = ctx->device;
    return CUDA_SUCCESS;
}

// -- per-thread default stream variants --------------------------------------------------
// phos gives every thread the legacy default stream: these behave like the plain calls.

#define PER_THREAD(name, base, params, args) \
    PHOS_EXPORT CUresult name params;        \
    PHOS_EXPORT CUresult name params { return base args; }

PER_THREAD(cuMemcpy_ptds, cuMemcpy, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))
PER_THREAD(cuMemcpyAsync_ptsz, cuMemcpyAsync, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st))
PER_THREAD(cuMemcpyHtoD_v2_ptds, cuMemcpyHtoD_v2, (CUdeviceptr d, const void* s, size_t n), (d, s, n))
PER_THREAD(cuMemcpyDtoH_v2_ptds, cuMemcpyDtoH_v2, (void* d, CUdeviceptr s, size_t n), (d, s, n))
PER_THREAD(cuMemcpyDtoD_v2_ptds, cuMemcpyDtoD_v2, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))
PER_THREAD(cuMemcpyHtoDAsync_v2_ptsz, cuMemcpyHtoDAsync_v2, (CUdeviceptr d, const void* s, size_t n, CUstream st), (d, s, n, st))
PER_THREAD(cuMemcpyDtoHAsync_v2_ptsz, cuMemcpyDtoHAsync_v2, (void* d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st))
PER_THREAD(cuMemcpyDtoDAsync_v2_ptsz, cuMemcpyDtoDAsync_v2, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st))
PER_THREAD(cuMemcpyPeer_ptds, cuMemcpyPeer, (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n), (d, dc, s, sc, n))
PER_THREAD(cuMemcpyPeerAsync_ptsz, cuMemcpyPeerAsync, (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream st),
           (d, dc, s, sc, n, st))
PER_THREAD(cuMemcpy2D_v2_ptds, cuMemcpy2D_v2, (const CUDA_MEMCPY2D* p), (p))
PER_THREAD(cuMemcpy2DUnaligned_v2_ptds, cuMemcpy2DUnaligned_v2, (const CUDA_MEMCPY2D* p), (p))
PER_THREAD(cuMemcpy2DAsync_v2_ptsz, cuMemcpy2DAsync_v2, (const CUDA_MEMCPY2D* p, CUstream st), (p, st))
PER_THREAD(cuMemcpy3D_v2_ptds, cuMemcpy3D_v2, (const CUDA_MEMCPY3D* p), (p))
PER_THREAD(cuMemcpy3DAsync_v2_ptsz, cuMemcpy3DAsync_v2, (const CUDA_MEMCPY3D* p, CUstream st), (p, st))
PER_THREAD(cuMemPrefetchAsync_v2_ptsz, cuMemPrefetchAsync_v2, (CUdeviceptr p, size_t n, CUmemLocation l, unsigned f, CUstream st),
           (p, n, l, f, st))
PER_THREAD(cuStreamAttachMemAsync_ptsz, cuStreamAttachMemAsync, (CUstream st, CUdeviceptr p, size_t n, unsigned f), (st, p, n, f))
PER_THREAD(cuMemsetD8_v2_ptds, cuMemsetD8_v2, (CUdeviceptr d, unsigned char v, size_t n), (d, v, n))
PER_THREAD(cuMemsetD16_v2_ptds, cuMemsetD16_v2, (CUdeviceptr d, unsigned short v, size_t n), (d, v, n))
PER_THREAD(cuMemsetD32_v2_ptds, cuMemsetD32_v2, (CUdeviceptr d, unsigned int v, size_t n), (d, v, n))
PER_THREAD(cuMemsetD8Async_ptsz, cuMemsetD8Async, (CUdeviceptr d, unsigned char v, size_t n, CUstream st), (d, v, n, st))
PER_THREAD(cuMemsetD16Async_ptsz, cuMemsetD16Async, (CUdeviceptr d, unsigned short v, size_t n, CUstream st), (d, v, n, st))
PER_THREAD(cuMemsetD32Async_ptsz, cuMemsetD32Async, (CUdeviceptr d, unsigned int v, size_t n, CUstream st), (d, v, n, st))
PER_THREAD(cuLaunchKernel_ptsz, cuLaunchKernel,
           (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned sh,
            CUstream st, void** kp, void** ex),
           (f, gx, gy, gz, bx, by, bz, sh, st, kp, ex))
PER_THREAD(cuLaunchCooperativeKernel_ptsz, cuLaunchCooperativeKernel,
           (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned sh,
            CUstream st, void** kp),
           (f, gx, gy, gz, bx, by, bz, sh, st, kp))
PER_THREAD(cuLaunchKernelEx_ptsz, cuLaunchKernelEx, (const CUlaunchConfig* c, CUfunction f, void** kp, void** ex), (c, f, kp, ex))
PER_THREAD(cuStreamSynchronize_ptsz, cuStreamSynchronize, (CUstream st), (st))
PER_THREAD(cuStreamQuery_ptsz, cuStreamQuery, (CUstream st), (st))
PER_THREAD(cuStreamWaitEvent_ptsz, cuStreamWaitEvent, (CUstream st, CUevent e, unsigned fl), (st, e, fl))
PER_THREAD(cuStreamGetFlags_ptsz, cuStreamGetFlags, (CUstream st, unsigned* fl), (st, fl))
PER_THREAD(cuStreamGetPriority_ptsz, cuStreamGetPriority, (CUstream st, int* p), (st, p))
PER_THREAD(cuStreamGetCtx_ptsz, cuStreamGetCtx, (CUstream st, CUcontext* c), (st, c))
PER_THREAD(cuStreamGetId_ptsz, cuStreamGetId, (CUstream st, unsigned long long* id), (st, id))
PER_THREAD(cuStreamIsCapturing_ptsz, cuStreamIsCapturing, (CUstream st, CUstreamCaptureStatus* s), (st, s))
PER_THREAD(cuStreamGetCaptureInfo_v3_ptsz, cuStreamGetCaptureInfo_v3,
           (CUstream st, CUstreamCaptureStatus* s, cuuint64_t* id, CUgraph* g, const CUgraphNode** d,
            const CUgraphEdgeData** e, size_t* n),
           (st, s, id, g, d, e, n))
PER_THREAD(cuStreamGetCaptureInfo_v2_ptsz, cuStreamGetCaptureInfo_v2,
           (CUstream st, CUstreamCaptureStatus* s, cuuint64_t* id, CUgraph* g, const CUgraphNode** d, size_t* n),
           (st, s, id, g, d, n))
PER_THREAD(cuStreamBeginCapture_v2_ptsz, cuStreamBeginCapture_v2, (CUstream st, CUstreamCaptureMode m), (st, m))
PER_THREAD(cuStreamEndCapture_ptsz, cuStreamEndCapture, (CUstream st, CUgraph* g), (st, g))
PER_THREAD(cuGraphInstantiateWithParams_ptsz, cuGraphInstantiateWithParams,
           (CUgraphExec* e, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS* p), (e, g, p))
PER_THREAD(cuGraphUpload_ptsz, cuGraphUpload, (CUgraphExec e, CUstream st), (e, st))
PER_THREAD(cuGraphLaunch_ptsz, cuGraphLaunch, (CUgraphExec e, CUstream st), (e, st))
PER_THREAD(cuLaunchHostFunc_ptsz, cuLaunchHostFunc, (CUstream st, CUhostFn f, void* d), (st, f, d))
PER_THREAD(cuStreamAddCallback_ptsz, cuStreamAddCallback, (CUstream st, CUstreamCallback f, void* d, unsigned fl),
           (st, f, d, fl))
PER_THREAD(cuMemAllocAsync_ptsz, cuMemAllocAsync, (CUdeviceptr* p, size_t n, CUstream st), (p, n, st))
PER_THREAD(cuMemAllocFromPoolAsync_ptsz, cuMemAllocFromPoolAsync, (CUdeviceptr* p, size_t n, CUmemoryPool m, CUstream st),
           (p, n, m, st))
PER_THREAD(cuMemFreeAsync_ptsz, cuMemFreeAsync, (CUdeviceptr p, CUstream st), (p, st))
PER_THREAD(cuEventRecord_ptsz, cuEventRecord, (CUevent e, CUstream st), (e, st))
PER_THREAD(cuEventRecordWithFlags_ptsz, cuEventRecordWithFlags, (CUevent e, CUstream st, unsigned fl), (e, st, fl))

// -- errors ------------------------------------------------------------------------------

namespace {
const phos::ErrorText kErrors[] = {
#define PHOS_ERROR(name, value, text) {value, #name, text},
#include "tables/driver_errors.def"
#undef PHOS_ERROR
};
const phos::ErrorText* find_error(CUresult e) { return phos::lookup_error(kErrors, static_cast<int>(e)); }
}  // namespace

PHOS_EXPORT CUresult cuGetErrorString(CUresult error, const char** text) {
    if (!text) return CUDA_ERROR_INVALID_VALUE;
    const phos::ErrorText* t = find_error(error);
    *text = t ? t->text : nullptr;
    return t ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

PHOS_EXPORT CUresult cuGetErrorName(CUresult error, const char** name) {
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    const phos::ErrorText* t = find_error(error);
    *name = t ? t->name : nullptr;
    return t ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

// -- cuGetProcAddress --------------------------------------------------------------------

PHOS_EXPORT CUresult cuGetProcAddress(const char*, void**, int, cuuint64_t);

namespace {
struct ProcEntry {
    const char* name;
    int version;
    void* function;
    bool per_thread;
};

const ProcEntry kEntries[] = {
#define ENTRY(name, version, symbol) {#name, version, reinterpret_cast<void*>(&symbol), false},
#define ENTRY_PER_THREAD(name, version, symbol) {#name, version, reinterpret_cast<void*>(&symbol), true},
#include "driver_entry_points.def"
#undef ENTRY
#undef ENTRY_PER_THREAD
};

// "cuGraphAddKernelNode_v2_ptsz" -> "cuGraphAddKernelNode": how unsupported stubs are found.
std::string base_name(std::string n) {
    for (const char* suffix : {"_ptds", "_ptsz"}) {
        size_t k = std::strlen(suffix);
        if (n.size() > k && n.compare(n.size() - k, k, suffix) == 0) n.resize(n.size() - k);
    }
    size_t v = n.rfind("_v");
    if (v != std::string::npos && v + 2 < n.size() && n.find_first_not_of("0123456789", v + 2) == std::string::npos)
        n.resize(v);
    return n;
}

void* unsupported_stub(const char* symbol) {
    static const auto* stubs = [] {
        auto* m = new std::unordered_map<std::string, void*>();
        for (size_t i = 0; i < phos_unsupported_driver_count; i++) {
            const auto& s = phos_unsupported_driver[i];
            m->emplace(base_name(s.name), s.function);   // the first (plain) variant wins
        }
        return m;
    }();
    auto it = stubs->find(base_name(symbol));
    return it == stubs->end() ? nullptr : it->second;
}

// PHOS_VERBOSE=2: an entry point handed out wrapped so that each call is named, with its
// result: libraries call the driver through these pointers, not by symbol (call_trace.h).
void trace_result(const char* name, int result) { log_error("call %s -> %d", name, result); }

CUresult lookup(const char* symbol, void** pfn, int version, cuuint64_t flags, CUdriverProcAddressQueryResult* status) {
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    const ProcEntry* best = nullptr;
    const ProcEntry* best_per_thread = nullptr;
    bool known = false;
    for (const auto& e : kEntries) {
        if (std::strcmp(e.name, symbol) != 0) continue;
        known = true;
        if (e.version > version) continue;
        const ProcEntry*& slot = e.per_thread ? best_per_thread : best;
        if (!slot || e.version > slot->version) slot = &e;
    }
    if ((flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && best_per_thread) best = best_per_thread;
    CUdriverProcAddressQueryResult result = CU_GET_PROC_ADDRESS_SUCCESS;
    *pfn = best ? best->function : nullptr;
    if (!best && known) {
        result = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
    } else if (!best) {
        *pfn = unsupported_stub(symbol);    // known to CUDA, not to phos: fails loudly if called
        if (!*pfn) result = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    }
    if (result != CU_GET_PROC_ADDRESS_SUCCESS)
        log_verbose("cuGetProcAddress: %s (version %d, flags %llu) not found", symbol, version, (unsigned long long)flags);
    else if (settings().trace && *pfn)
        *pfn = trace::wrap(symbol, *pfn, &trace_result);
    // NVIDIA's driver (580, on the H200) answers a missing name with CUDA_SUCCESS when the
    // caller asked for the status, which then says why; without a status, NOT_FOUND.
    if (status) {
        *status = result;
        return CUDA_SUCCESS;
    }
    return *pfn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}
}  // namespace

PHOS_EXPORT CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version, cuuint64_t flags,
                                         CUdriverProcAddressQueryResult* status) {
    return lookup(symbol, pfn, version, flags, status);
}

PHOS_EXPORT CUresult cuGetProcAddress(const char* symbol, void** pfn, int version, cuuint64_t flags) {
    return lookup(symbol, pfn, version, flags, nullptr);
}

extern "C" int phos_unsupported_call(const char* name, std::atomic<bool>* said) {
    if (!said->exchange(true)) log_error("unsupported CUDA call %s", name);
    return CUDA_ERROR_NOT_SUPPORTED;
}
