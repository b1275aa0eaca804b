// Runtime API: devices, memory, streams and events, each on top of the driver API.
#include <algorithm>
#include <cstring>
#include <vector>

#include "runtime_state.h"

namespace phos::runtime {

// Copies by kind; the driver decides what waits (see driver_memory.cpp).
cudaError_t copy(void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t stream, bool async_api) {
    cudaError_t e = ensure_context();
    if (e != cudaSuccess) return record(e);
    const auto d = reinterpret_cast<CUdeviceptr>(dst);
    const auto s = reinterpret_cast<CUdeviceptr>(src);
    CUresult r;
    switch (kind) {
    case cudaMemcpyHostToDevice:
        r = async_api ? cuMemcpyHtoDAsync(d, src, count, stream) : cuMemcpyHtoD(d, src, count);
        break;
    case cudaMemcpyDeviceToHost:
        r = async_api ? cuMemcpyDtoHAsync(dst, s, count, stream) : cuMemcpyDtoH(dst, s, count);
        break;
    case cudaMemcpyDeviceToDevice:
        r = async_api ? cuMemcpyDtoDAsync(d, s, count, stream) : cuMemcpyDtoD(d, s, count);
        break;
    case cudaMemcpyHostToHost:
    case cudaMemcpyDefault:
        r = async_api ? cuMemcpyAsync(d, s, count, stream) : cuMemcpy(d, s, count);
        break;
    default:
        return record(cudaErrorInvalidMemcpyDirection);
    }
    return check(r);
}

static bool is_device_pointer(const void* p) {
    unsigned type = 0;
    return cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, reinterpret_cast<CUdeviceptr>(p)) ==
               CUDA_SUCCESS && type == CU_MEMORYTYPE_DEVICE;
}

static cudaError_t copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                           cudaMemcpyKind kind, cudaStream_t stream, bool async_api) {
    if (width > dpitch || width > spitch) return record(cudaErrorInvalidPitchValue);
    if (width == 0 || height == 0) return cudaSuccess;
    if (dpitch == width && spitch == width) return copy(dst, src, width * height, kind, stream, async_api);
    if (kind == cudaMemcpyDefault) {
        kind = is_device_pointer(src) ? (is_device_pointer(dst) ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost)
                                      : (is_device_pointer(dst) ? cudaMemcpyHostToDevice : cudaMemcpyHostToHost);
    }
    if (kind == cudaMemcpyDeviceToHost && !async_api) {
        // One round trip: fetch the rows' whole span, then place each row.
        const size_t span = spitch * (height - 1) + width;
        std::vector<char> staging(span);
        cudaError_t e = copy(staging.data(), src, span, kind, stream, false);
        if (e != cudaSuccess) return e;
        for (size_t row = 0; row < height; row++)
            std::memcpy(static_cast<char*>(dst) + row * dpitch, staging.data() + row * spitch, width);
        return cudaSuccess;
    }
    for (size_t row = 0; row < height; row++) {   // host->device rows are posted without waiting
        cudaError_t e = copy(static_cast<char*>(dst) + row * dpitch, static_cast<const char*>(src) + row * spitch,
                             width, kind, stream, async_api);
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

}  // namespace phos::runtime

using namespace phos;
using namespace phos::runtime;

// ======================================================================================
// Devices
// ======================================================================================

PHOS_EXPORT cudaError_t cudaGetDeviceCount(int* count) {
    if (!count) return record(cudaErrorInvalidValue);
    *count = 0;
    CUresult r = cuInit(0);
    if (r != CUDA_SUCCESS) return record(r == CUDA_ERROR_CONTEXT_IS_DESTROYED ? cudaErrorNoDevice : to_runtime(r));
    return check(cuDeviceGetCount(count));
}

PHOS_EXPORT cudaError_t cudaSetDevice(int device) {
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) return e;
    if (device < 0 || device >= count) return record(cudaErrorInvalidDevice);
    Guard g(state().lock);
    return record(use_device(device));
}

PHOS_EXPORT cudaError_t cudaInitDevice(int device, unsigned int device_flags, unsigned int) {
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) return e;
    if (device < 0 || device >= count) return record(cudaErrorInvalidDevice);
    if (device_flags) cuDevicePrimaryCtxSetFlags(device, device_flags);
    CUcontext ctx;
    Guard g(state().lock);
    if (!state().primary.count(device)) {
        CUresult r = cuDevicePrimaryCtxRetain(&ctx, device);
        if (r != CUDA_SUCCESS) return check(r);
        state().primary[device] = ctx;
    }
    return cudaSuccess;
}

PHOS_EXPORT cudaError_t cudaGetDevice(int* device) {
    if (!device) return record(cudaErrorInvalidValue);
    CUcontext current = nullptr;
    CUdevice d;
    if (cuCtxGetCurrent(&current) == CUDA_SUCCESS && current && cuCtxGetDevice(&d) == CUDA_SUCCESS) {
        *device = d;
    } else {
        *device = thread_device();
    }
    return cudaSuccess;
}

PHOS_EXPORT cudaError_t cudaSetDeviceFlags(unsigned int flags) {
    CUresult r = cuInit(0);
    if (r != CUDA_SUCCESS) return check(r);
    return check(cuDevicePrimaryCtxSetFlags(thread_device(), flags));
}

PHOS_EXPORT cudaError_t cudaGetDeviceFlags(unsigned int* flags) {
    if (!flags) return record(cudaErrorInvalidValue);
    int active = 0;
    CUresult r = cuInit(0);
    if (r != CUDA_SUCCESS) return check(r);
    return check(cuDevicePrimaryCtxGetState(thread_device(), flags, &active));
}

PHOS_EXPORT cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device) {
    CUresult r = cuInit(0);
    if (r != CUDA_SUCCESS) return check(r);
    // cudaDeviceAttr and CUdevice_attribute share their numbering.
    r = cuDeviceGetAttribute(value, static_cast<CUdevice_attribute>(attribute), device);
    return record(r == CUDA_ERROR_INVALID_DEVICE ? cudaErrorInvalidDevice : to_runtime(r));
}

PHOS_EXPORT cudaError_t cudaDeviceGetPCIBusId(char* bus_id, int len, int device) {
    CUresult r = cuInit(0);
    if (r != CUDA_SUCCESS) return check(r);
    return check(cuDeviceGetPCIBusId(bus_id, len, device));
}

PHOS_EXPORT cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
    if (!prop) return record(cudaErrorInvalidValue);
    CUresult r = cuInit(0);
    if (r != CUDA_SUCCESS) return record(r == CUDA_ERROR_CONTEXT_IS_DESTROYED ? cudaErrorNoDevice : to_runtime(r));
    int count = 0;
    cuDeviceGetCount(&count);
    if (device < 0 || device >= count) return record(cudaErrorInvalidDevice);
    std::memset(prop, 0, sizeof *prop);
    if ((r = cuDeviceGetName(prop->name, sizeof prop->name, device)) != CUDA_SUCCESS) return check(r);
    if ((r = cuDeviceGetUuid(reinterpret_cast<CUuuid*>(&prop->uuid), device)) != CUDA_SUCCESS) return check(r);
    if ((r = cuDeviceTotalMem(&prop->totalGlobalMem, device)) != CUDA_SUCCESS) return check(r);

    // Every other field is a device attribute; one the server does not know reads as 0.
    auto attr = [device](CUdevice_attribute a) {
        int v = 0;
        return cuDeviceGetAttribute(&v, a, device) == CUDA_SUCCESS ? v : 0;
    };
    auto bytes = [&](CUdevice_attribute a) { return static_cast<size_t>(static_cast<unsigned>(attr(a))); };
    prop->sharedMemPerBlock = bytes(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK);
    prop->regsPerBlock = attr(CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK);
    prop->warpSize = attr(CU_DEVICE_ATTRIBUTE_WARP_SIZE);
    prop->memPitch = bytes(CU_DEVICE_ATTRIBUTE_MAX_PITCH);
    prop->maxThreadsPerBlock = attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
    prop->maxThreadsDim[0] = attr(CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X);
    prop->maxThreadsDim[1] = attr(CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y);
    prop->maxThreadsDim[2] = attr(CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z);
    prop->maxGridSize[0] = attr(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X);
    prop->maxGridSize[1] = attr(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y);
    prop->maxGridSize[2] = attr(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z);
    prop->totalConstMem = bytes(CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY);
    prop->major = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
    prop->minor = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
    prop->textureAlignment = bytes(CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT);
    prop->texturePitchAlignment = bytes(CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT);
    prop->multiProcessorCount = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
    prop->integrated = attr(CU_DEVICE_ATTRIBUTE_INTEGRATED);
    prop->canMapHostMemory = attr(CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY);
    prop->maxTexture1D = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE1D_WIDTH);
    prop->maxTexture1DMipmap = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE1D_MIPMAPPED_WIDTH);
    prop->maxTexture2D[0] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_WIDTH);
    prop->maxTexture2D[1] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_HEIGHT);
    prop->maxTexture2DMipmap[0] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_MIPMAPPED_WIDTH);
    prop->maxTexture2DMipmap[1] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_MIPMAPPED_HEIGHT);
    prop->maxTexture2DLinear[0] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_LINEAR_WIDTH);
    prop->maxTexture2DLinear[1] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_LINEAR_HEIGHT);
    prop->maxTexture2DLinear[2] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_LINEAR_PITCH);
    prop->maxTexture2DGather[0] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_GATHER_WIDTH);
    prop->maxTexture2DGather[1] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_GATHER_HEIGHT);
    prop->maxTexture3D[0] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_WIDTH);
    prop->maxTexture3D[1] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_HEIGHT);
    prop->maxTexture3D[2] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_DEPTH);
    prop->maxTexture3DAlt[0] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_WIDTH_ALTERNATE);
    prop->maxTexture3DAlt[1] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_HEIGHT_ALTERNATE);
    prop->maxTexture3DAlt[2] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_DEPTH_ALTERNATE);
    prop->maxTextureCubemap = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURECUBEMAP_WIDTH);
    prop->maxTexture1DLayered[0] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE1D_LAYERED_WIDTH);
    prop->maxTexture1DLayered[1] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE1D_LAYERED_LAYERS);
    prop->maxTexture2DLayered[0] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_LAYERED_WIDTH);
    prop->maxTexture2DLayered[1] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_LAYERED_HEIGHT);
    prop->maxTexture2DLayered[2] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_LAYERED_LAYERS);
    prop->maxTextureCubemapLayered[0] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURECUBEMAP_LAYERED_WIDTH);
    prop->maxTextureCubemapLayered[1] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURECUBEMAP_LAYERED_LAYERS);
    prop->maxSurface1D = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACE1D_WIDTH);
    prop->maxSurface2D[0] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACE2D_WIDTH);
    prop->maxSurface2D[1] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACE2D_HEIGHT);
    prop->maxSurface3D[0] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACE3D_WIDTH);
    prop->maxSurface3D[1] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACE3D_HEIGHT);
    prop->maxSurface3D[2] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACE3D_DEPTH);
    prop->maxSurface1DLayered[0] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACE1D_LAYERED_WIDTH);
    prop->maxSurface1DLayered[1] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACE1D_LAYERED_LAYERS);
    prop->maxSurface2DLayered[0] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACE2D_LAYERED_WIDTH);
    prop->maxSurface2DLayered[1] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACE2D_LAYERED_HEIGHT);
    prop->maxSurface2DLayered[2] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACE2D_LAYERED_LAYERS);
    prop->maxSurfaceCubemap = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACECUBEMAP_WIDTH);
    prop->maxSurfaceCubemapLayered[0] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACECUBEMAP_LAYERED_WIDTH);
    prop->maxSurfaceCubemapLayered[1] = attr(CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACECUBEMAP_LAYERED_LAYERS);
    prop->surfaceAlignment = bytes(CU_DEVICE_ATTRIBUTE_SURFACE_ALIGNMENT);
    prop->concurrentKernels = attr(CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS);
    prop->ECCEnabled = attr(CU_DEVICE_ATTRIBUTE_ECC_ENABLED);
    prop->pciBusID = attr(CU_DEVICE_ATTRIBUTE_PCI_BUS_ID);
    prop->pciDeviceID = attr(CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID);
    prop->pciDomainID = attr(CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID);
    prop->tccDriver = attr(CU_DEVICE_ATTRIBUTE_TCC_DRIVER);
    prop->asyncEngineCount = attr(CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT);
    prop->unifiedAddressing = attr(CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING);
    prop->memoryBusWidth = attr(CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH);
    prop->l2CacheSize = attr(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE);
    prop->persistingL2CacheMaxSize = attr(CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE);
    prop->maxThreadsPerMultiProcessor = attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR);
    prop->streamPrioritiesSupported = attr(CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED);
    prop->globalL1CacheSupported = attr(CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED);
    prop->localL1CacheSupported = attr(CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED);
    prop->sharedMemPerMultiprocessor = bytes(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR);
    prop->regsPerMultiprocessor = attr(CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR);
    prop->managedMemory = attr(CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY);
    prop->isMultiGpuBoard = attr(CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD);
    prop->multiGpuBoardGroupID = attr(CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD_GROUP_ID);
    prop->hostNativeAtomicSupported = attr(CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED);
    prop->pageableMemoryAccess = attr(CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS);
    prop->concurrentManagedAccess = attr(CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS);
    prop->computePreemptionSupported = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED);
    prop->canUseHostPointerForRegisteredMem = attr(CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM);
    prop->cooperativeLaunch = attr(CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH);
    prop->sharedMemPerBlockOptin = bytes(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
    prop->pageableMemoryAccessUsesHostPageTables = attr(CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES);
    prop->directManagedMemAccessFromHost = attr(CU_DEVICE_ATTRIBUTE_DIRECT_MANAGED_MEM_ACCESS_FROM_HOST);
    prop->maxBlocksPerMultiProcessor = attr(CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR);
    prop->accessPolicyMaxWindowSize = attr(CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE);
    prop->reservedSharedMemPerBlock = bytes(CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK);
    prop->hostRegisterSupported = attr(CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED);
    prop->sparseCudaArraySupported = attr(CU_DEVICE_ATTRIBUTE_SPARSE_CUDA_ARRAY_SUPPORTED);
    prop->hostRegisterReadOnlySupported = attr(CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED);
    prop->timelineSemaphoreInteropSupported = attr(CU_DEVICE_ATTRIBUTE_TIMELINE_SEMAPHORE_INTEROP_SUPPORTED);
    prop->memoryPoolsSupported = attr(CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED);
    prop->gpuDirectRDMASupported = attr(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED);
    prop->gpuDirectRDMAFlushWritesOptions = static_cast<unsigned>(attr(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS));
    prop->gpuDirectRDMAWritesOrdering = attr(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING);
    prop->memoryPoolSupportedHandleTypes = static_cast<unsigned>(attr(CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES));
    prop->deferredMappingCudaArraySupported = attr(CU_DEVICE_ATTRIBUTE_DEFERRED_MAPPING_CUDA_ARRAY_SUPPORTED);
    prop->ipcEventSupported = attr(CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED);
    prop->clusterLaunch = attr(CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH);
    prop->unifiedFunctionPointers = attr(CU_DEVICE_ATTRIBUTE_UNIFIED_FUNCTION_POINTERS);
    prop->deviceNumaConfig = attr(CU_DEVICE_ATTRIBUTE_NUMA_CONFIG);
    prop->deviceNumaId = attr(CU_DEVICE_ATTRIBUTE_NUMA_ID);
    prop->mpsEnabled = attr(CU_DEVICE_ATTRIBUTE_MPS_ENABLED);
    prop->hostNumaId = attr(CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID);
    prop->gpuPciDeviceID = static_cast<unsigned>(attr(CU_DEVICE_ATTRIBUTE_GPU_PCI_DEVICE_ID));
    prop->gpuPciSubsystemID = static_cast<unsigned>(attr(CU_DEVICE_ATTRIBUTE_GPU_PCI_SUBSYSTEM_ID));
    prop->hostNumaMultinodeIpcSupported = attr(CU_DEVICE_ATTRIBUTE_HOST_NUMA_MULTINODE_IPC_SUPPORTED);
    return cudaSuccess;
}

PHOS_EXPORT cudaError_t cudaDeviceSynchronize() {
    cudaError_t e = ensure_context();
    if (e != cudaSuccess) return record(e);
    return check(cuCtxSynchronize());
}

PHOS_EXPORT cudaError_t cudaDeviceReset() {
    CUresult r = cuInit(0);
    if (r != CUDA_SUCCESS) return check(r);
    int device = 0;
    cudaGetDevice(&device);
    // The server forgets the context; the next runtime call on this device opens a new
    // one, and registered kernels load again there (modules are cached per context id).
    return check(cuDevicePrimaryCtxReset(device));
}

PHOS_EXPORT cudaError_t cudaDriverGetVersion(int* version) {
    if (!version) return record(cudaErrorInvalidValue);
    return check(cuDriverGetVersion(version));
}

PHOS_EXPORT cudaError_t cudaRuntimeGetVersion(int* version) {
    if (!version) return record(cudaErrorInvalidValue);
    *version = CUDART_VERSION;
    return cudaSuccess;
}

PHOS_EXPORT cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
    cudaError_t e = ensure_context();
    if (e != cudaSuccess) return record(e);
    return check(cuCtxGetStreamPriorityRange(least, greatest));
}

// One device per server context: no peer access to offer.
PHOS_EXPORT cudaError_t cudaDeviceCanAccessPeer(int* can_access, int device, int peer) {
    if (!can_access) return record(cudaErrorInvalidValue);
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) return e;
    if (device < 0 || device >= count || peer < 0 || peer >= count) return record(cudaErrorInvalidDevice);
    *can_access = 0;
    return cudaSuccess;
}

PHOS_EXPORT cudaError_t cudaDeviceSetCacheConfig(cudaFuncCache config) {
    cudaError_t e = ensure_context();
    if (e != cudaSuccess) return record(e);
    return check(cuCtxSetCacheConfig(static_cast<CUfunc_cache>(config)));
}

PHOS_EXPORT cudaError_t cudaDeviceGetCacheConfig(cudaFuncCache* config) {
    cudaError_t e = ensure_context();
    if (e != cudaSuccess) return record(e);
    return check(cuCtxGetCacheConfig(reinterpret_cast<CUfunc_cache*>(config)));
}

PHOS_EXPORT cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** function, unsigned int version,
                                                         unsigned long long flags,
                                                         cudaDriverEntryPointQueryResult* status) {
    CUdriverProcAddressQueryResult s = CU_GET_PROC_ADDRESS_SUCCESS;
    CUresult r = cuGetProcAddress(symbol, function, static_cast<int>(version), flags, &s);
    if (status) *status = static_cast<cudaDriverEntryPointQueryResult>(s);
    return check(r);
}

PHOS_EXPORT cudaError_t cudaGetDriverEntryPoint(const char* symbol, void** function, unsigned long long flags,
                                                cudaDriverEntryPointQueryResult* status) {
    return cudaGetDriverEntryPointByVersion(symbol, function, CUDART_VERSION, flags, status);
}

// ======================================================================================
// Memory
// ======================================================================================

PHOS_EXPORT cudaError_t cudaMalloc(void** ptr, size_t size) {
    if (!ptr) return record(cudaErrorInvalidValue);
    cudaError_t e = ensure_context();
    if (e != cudaSuccess) return record(e);
    if (size == 0) {   // as CUDA: success, and a null pointer
        *ptr = nullptr;
        return cudaSuccess;
    }
    CUdeviceptr p = 0;
    CUresult r = cuMemAlloc(&p, size);
    if (r == CUDA_SUCCESS) *ptr = reinterpret_cast<void*>(p);
    return check(r);
}

PHOS_EXPORT cudaError_t cudaMallocPitch(void** ptr, size_t* pitch, size_t width, size_t height) {
    if (!pitch) return record(cudaErrorInvalidValue);
    const size_t alignment = 512;
    *pitch = (width + alignment - 1) / alignment * alignment;
    return cudaMalloc(ptr, *pitch * height);
}

PHOS_EXPORT cudaError_t cudaFree(void* ptr) {
    cudaError_t e = ensure_context();   // cudaFree(0) is the classic way to create the context
    if (e != cudaSuccess) return record(e);
    if (!ptr) return cudaSuccess;
    return check(cuMemFree(reinterpret_cast<CUdeviceptr>(ptr)));
}

// Pinned memory starts the device's context, as CUDA's does: its worker may map the memory
// (driver_memory.cpp, host_alloc).
PHOS_EXPORT cudaError_t cudaMallocHost(void** ptr, size_t size) {
    if (!ptr) return record(cudaErrorInvalidValue);
    if (size == 0) {
        *ptr = nullptr;
        return cudaSuccess;
    }
    cudaError_t e = ensure_context();
    if (e != cudaSuccess) return record(e);
    return check(cuMemAllocHost(ptr, size));
}

PHOS_EXPORT cudaError_t cudaHostAlloc(void** ptr, size_t size, unsigned int flags) {
    if (!ptr) return record(cudaErrorInvalidValue);
    if (size == 0) {
        *ptr = nullptr;
        return cudaSuccess;
    }
    cudaError_t e = ensure_context();
    if (e != cudaSuccess) return record(e);
    return check(cuMemHostAlloc(ptr, size, flags));
}

PHOS_EXPORT cudaError_t cudaFreeHost(void* ptr) {
    if (!ptr) return cudaSuccess;
    return check(cuMemFreeHost(ptr));
}

PHOS_EXPORT cudaError_t cudaHostRegister(void* ptr, size_t size, unsigned int flags) {
    CUresult r = cuMemHostRegister(ptr, size, flags);
    return record(r == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED ? cudaErrorHostMemoryAlreadyRegistered : to_runtime(r));
}

PHOS_EXPORT cudaError_t cudaHostUnregister(void* ptr) {
    CUresult r = cuMemHostUnregister(ptr);
    return record(r == CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED ? cudaErrorHostMemoryNotRegistered : to_runtime(r));
}

PHOS_EXPORT cudaError_t cudaHostGetFlags(unsigned int* flags, void* ptr) { return check(cuMemHostGetFlags(flags, ptr)); }

PHOS_EXPORT cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
    return copy(dst, src, count, kind, nullptr, false);
}

PHOS_EXPORT cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                                        cudaStream_t stream) {
    return copy(dst, src, count, kind, stream, true);
}

PHOS_EXPORT cudaError_t cudaMemcpy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                                     size_t height, cudaMemcpyKind kind) {
    return copy_2d(dst, dpitch, src, spitch, width, height, kind, nullptr, false);
}

PHOS_EXPORT cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                                          size_t height, cudaMemcpyKind kind, cudaStream_t stream) {
    return copy_2d(dst, dpitch, src, spitch, width, height, kind, stream, true);
}

PHOS_EXPORT cudaError_t cudaMemset(void* ptr, int value, size_t count) {
    cudaError_t e = ensure_context();
    if (e != cudaSuccess) return record(e);
    return check(cuMemsetD8(reinterpret_cast<CUdeviceptr>(ptr), static_cast<unsigned char>(value), count));
}

PHOS_EXPORT cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t stream) {
    cudaError_t e = ensure_context();
    if (e != cudaSuccess) return record(e);
    return check(cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(ptr), static_cast<unsigned char>(value), count, stream));
}

PHOS_EXPORT cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
    cudaError_t e = ensure_context();
    if (e != cudaSuccess) return record(e);
    return check(cuMemGetInfo(free_bytes, total_bytes));
}

PHOS_EXPORT cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* ptr) {
    if (!attributes) return record(cudaErrorInvalidValue);
    cudaError_t e = ensure_context();
    if (e != cudaSuccess) return record(e);
    std::memset(attributes, 0, sizeof *attributes);
    const auto p = reinterpret_cast<CUdeviceptr>(ptr);
    unsigned type = 0;
    if (cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p) != CUDA_SUCCESS) {
        attributes->type = cudaMemoryTypeUnregistered;   // ordinary host memory: not an error
        attributes->device = -2;
        attributes->hostPointer = const_cast<void*>(ptr);
        return cudaSuccess;
    }
    int device = 0;
    cuPointerGetAttribute(&device, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p);
    attributes->device = device;
    if (type == CU_MEMORYTYPE_DEVICE) {
        attributes->type = cudaMemoryTypeDevice;
        attributes->devicePointer = const_cast<void*>(ptr);
    } else {
        attributes->type = cudaMemoryTypeHost;   // pinned; not mapped into the remote device
        attributes->hostPointer = const_cast<void*>(ptr);
    }
    return cudaSuccess;
}

PHOS_EXPORT cudaError_t cudaMemcpy_ptds(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
    return cudaMemcpy(dst, src, count, kind);
}
PHOS_EXPORT cudaError_t cudaMemcpyAsync_ptsz(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                                             cudaStream_t stream) {
    return cudaMemcpyAsync(dst, src, count, kind, stream);
}
PHOS_EXPORT cudaError_t cudaMemcpy2D_ptds(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                                          size_t height, cudaMemcpyKind kind) {
    return cudaMemcpy2D(dst, dpitch, src, spitch, width, height, kind);
}
PHOS_EXPORT cudaError_t cudaMemcpy2DAsync_ptsz(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                                               size_t height, cudaMemcpyKind kind, cudaStream_t stream) {
    return cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream);
}
PHOS_EXPORT cudaError_t cudaMemset_ptds(void* ptr, int value, size_t count) { return cudaMemset(ptr, value, count); }
PHOS_EXPORT cudaError_t cudaMemsetAsync_ptsz(void* ptr, int value, size_t count, cudaStream_t stream) {
    return cudaMemsetAsync(ptr, value, count, stream);
}

// ======================================================================================
// Streams and events
// ======================================================================================

PHOS_EXPORT cudaError_t cudaStreamCreateWithPriority(cudaStream_t* stream, unsigned int flags, int priority) {
    if (!stream) return record(cudaErrorInvalidValue);
    cudaError_t e = ensure_context();
    if (e != cudaSuccess) return record(e);
    return check(cuStreamCreateWithPriority(stream, flags, priority));
}

PHOS_EXPORT cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
    return cudaStreamCreateWithPriority(stream, flags, 0);
}

PHOS_EXPORT cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithPriority(stream, 0, 0); }

PHOS_EXPORT cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    if (!stream) return record(cudaErrorInvalidResourceHandle);
    return check(cuStreamDestroy(stream));
}

PHOS_EXPORT cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    cudaError_t e = ensure_context();
    if (e != cudaSuccess) return record(e);
    return check(cuStreamSynchronize(stream));
}

PHOS_EXPORT cudaError_t cudaStreamQuery(cudaStream_t stream) {
    cudaError_t e = ensure_context();
    if (e != cudaSuccess) return record(e);
    return check(cuStreamQuery(stream));
}

PHOS_EXPORT cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
    cudaError_t e = ensure_context();
    if (e != cudaSuccess) return record(e);
    return check(cuStreamWaitEvent(stream, event, flags));
}

PHOS_EXPORT cudaError_t cudaStreamGetFlags(cudaStream_t stream, unsigned int* flags) {
    return check(cuStreamGetFlags(stream, flags));
}

PHOS_EXPORT cudaError_t cudaStreamGetPriority(cudaStream_t stream, int* priority) {
    return check(cuStreamGetPriority(stream, priority));
}

// Capture is not supported, so no stream is ever capturing.
PHOS_EXPORT cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus* status) {
    if (!status) return record(cudaErrorInvalidValue);
    *status = cudaStreamCaptureStatusNone;
    return cudaSuccess;
}

PHOS_EXPORT cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
    if (!event) return record(cudaErrorInvalidValue);
    cudaError_t e = ensure_context();
    if (e != cudaSuccess) return record(e);
    return check(cuEventCreate(event, flags));
}

PHOS_EXPORT cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, 0); }

PHOS_EXPORT cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    return check(cuEventRecord(event, stream));
}

PHOS_EXPORT cudaError_t cudaEventRecordWithFlags(cudaEvent_t event, cudaStream_t stream, unsigned int flags) {
    return check(cuEventRecordWithFlags(event, stream, flags));
}

PHOS_EXPORT cudaError_t cudaEventSynchronize(cudaEvent_t event) { return check(cuEventSynchronize(event)); }

PHOS_EXPORT cudaError_t cudaEventQuery(cudaEvent_t event) { return check(cuEventQuery(event)); }

PHOS_EXPORT cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
    return check(cuEventElapsedTime(ms, start, end));
}

PHOS_EXPORT cudaError_t cudaEventDestroy(cudaEvent_t event) { return check(cuEventDestroy(event)); }

PHOS_EXPORT cudaError_t cudaStreamSynchronize_ptsz(cudaStream_t stream) { return cudaStreamSynchronize(stream); }
PHOS_EXPORT cudaError_t cudaStreamQuery_ptsz(cudaStream_t stream) { return cudaStreamQuery(stream); }
PHOS_EXPORT cudaError_t cudaStreamWaitEvent_ptsz(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
    return cudaStreamWaitEvent(stream, event, flags);
}
PHOS_EXPORT cudaError_t cudaStreamGetFlags_ptsz(cudaStream_t stream, unsigned int* flags) {
    return cudaStreamGetFlags(stream, flags);
}
PHOS_EXPORT cudaError_t cudaStreamGetPriority_ptsz(cudaStream_t stream, int* priority) {
    return cudaStreamGetPriority(stream, priority);
}
PHOS_EXPORT cudaError_t cudaStreamIsCapturing_ptsz(cudaStream_t stream, cudaStreamCaptureStatus* status) {
    return cudaStreamIsCapturing(stream, status);
}
PHOS_EXPORT cudaError_t cudaEventRecord_ptsz(cudaEvent_t event, cudaStream_t stream) {
    return cudaEventRecord(event, stream);
}
PHOS_EXPORT cudaError_t cudaEventRecordWithFlags_ptsz(cudaEvent_t event, cudaStream_t stream, unsigned int flags) {
    return cudaEventRecordWithFlags(event, stream, flags);
}

// ======================================================================================
// Small local helpers programs link against
// ======================================================================================

PHOS_EXPORT cudaChannelFormatDesc cudaCreateChannelDesc(int x, int y, int z, int w, cudaChannelFormatKind kind) {
    cudaChannelFormatDesc d;
    d.x = x;
    d.y = y;
    d.z = z;
    d.w = w;
    d.f = kind;
    return d;
}

// With no profiler attached, as here, NVIDIA's runtime does nothing and succeeds.
PHOS_EXPORT cudaError_t cudaProfilerStart() { return cudaSuccess; }
PHOS_EXPORT cudaError_t cudaProfilerStop() { return cudaSuccess; }
