// Runtime errors: names, texts, the per-thread last error, and driver -> runtime codes.
#include "error_table.h"
#include "runtime_state.h"
#include "unsupported.h"

namespace phos::runtime {

namespace {
const phos::ErrorText kErrors[] = {
#define PHOS_ERROR(name, value, text) {value, #name, text},
#include "tables/runtime_errors.def"
#undef PHOS_ERROR
};
const phos::ErrorText* find_error(int value) { return phos::lookup_error(kErrors, value); }

thread_local cudaError_t last_error = cudaSuccess;
}  // namespace

cudaError_t record(cudaError_t error) {
    // cudaErrorNotReady answers a query; it is not a failure and is not remembered.
    if (error != cudaSuccess && error != cudaErrorNotReady) last_error = error;
    return error;
}

// The runtime's codes were laid out to match the driver's: a CUresult maps to the
// cudaError_t of the same value when there is one. The exceptions are the driver codes
// the runtime renames, and codes the runtime lacks.
cudaError_t to_runtime(CUresult result) {
    switch (result) {
    case CUDA_SUCCESS: return cudaSuccess;
    case CUDA_ERROR_NOT_INITIALIZED: return cudaErrorInitializationError;
    case CUDA_ERROR_DEINITIALIZED: return cudaErrorCudartUnloading;
    case CUDA_ERROR_INVALID_CONTEXT: return cudaErrorDeviceUninitialized;
    case CUDA_ERROR_CONTEXT_ALREADY_CURRENT: return cudaErrorIncompatibleDriverContext;
    case CUDA_ERROR_INVALID_IMAGE: return cudaErrorInvalidKernelImage;
    case CUDA_ERROR_NOT_FOUND: return cudaErrorSymbolNotFound;
    default: break;
    }
    return find_error(static_cast<int>(result)) ? static_cast<cudaError_t>(result) : cudaErrorUnknown;
}

}  // namespace phos::runtime

using namespace phos::runtime;

PHOS_EXPORT const char* cudaGetErrorString(cudaError_t error) {
    const phos::ErrorText* e = find_error(error);
    return e ? e->text : "unrecognized error code";
}

PHOS_EXPORT const char* cudaGetErrorName(cudaError_t error) {
    const phos::ErrorText* e = find_error(error);
    return e ? e->name : "unrecognized error code";
}

PHOS_EXPORT cudaError_t cudaGetLastError() {
    cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}

PHOS_EXPORT cudaError_t cudaPeekAtLastError() { return last_error; }

// The runtime's loud stubs (generated) fail like any runtime call: last error included.
extern "C" int phos_unsupported_call(const char* name, std::atomic<bool>* said) {
    if (!said->exchange(true)) phos::log_error("unsupported CUDA call %s", name);
    return record(cudaErrorNotSupported);
}
