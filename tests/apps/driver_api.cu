// The CUDA driver API directly, as driver-API programs and cuda-python use it: context,
// module from a PTX file, parameter layout, launches with kernelParams and with `extra`,
// module globals, pinned memory with an async device->host copy, streams and events.
//   driver_api KERNELS.ptx
#include <cuda.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CHECK(call)                                                                 \
    do {                                                                            \
        CUresult r_ = (call);                                                       \
        if (r_ != CUDA_SUCCESS) {                                                   \
            const char* name_ = nullptr;                                            \
            cuGetErrorName(r_, &name_);                                             \
            printf("FAIL %s:%d: %s -> %s\n", __FILE__, __LINE__, #call, name_);     \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

struct Affine {
    float scale;
    double shift;
    int pad[3];
};

// Counts a failed expectation and names its line, so a difference from NVIDIA's driver is easy to find.
static int check(int line, bool bad) {
    if (bad) printf("check at line %d failed\n", line);
    return bad ? 1 : 0;
}

int main(int argc, char** argv) {
    if (argc < 2) {
        printf("usage: driver_api KERNELS.ptx\n");
        return 2;
    }
    CHECK(cuInit(0));
    int version = 0, count = 0;
    CHECK(cuDriverGetVersion(&version));
    CHECK(cuDeviceGetCount(&count));
    CUdevice dev;
    CHECK(cuDeviceGet(&dev, 0));
    CUcontext ctx;
    CHECK(cuCtxCreate(&ctx, nullptr, 0, dev));
    CUmodule module;
    CHECK(cuModuleLoad(&module, argv[1]));
    CUfunction affine;
    CHECK(cuModuleGetFunction(&affine, module, "affine"));

    int wrong = 0;
    size_t offsets[4], sizes[4];
    for (int i = 0; i < 4; i++) CHECK(cuFuncGetParamInfo(affine, i, &offsets[i], &sizes[i]));
    wrong += check(__LINE__, cuFuncGetParamInfo(affine, 4, &offsets[0], &sizes[0]) != CUDA_ERROR_INVALID_VALUE);
    printf("params: (%zu,%zu) (%zu,%zu) (%zu,%zu) (%zu,%zu)\n", offsets[0], sizes[0], offsets[1], sizes[1], offsets[2],
           sizes[2], offsets[3], sizes[3]);

    const int n = 1000;
    std::vector<float> x(n);
    for (int i = 0; i < n; i++) x[i] = (float)i;
    CUdeviceptr d;
    CHECK(cuMemAlloc(&d, n * sizeof(float)));
    CHECK(cuMemcpyHtoD(d, x.data(), n * sizeof(float)));

    // kernelParams: one pointer per parameter.
    Affine a{2.0f, 0.5, {0, 0, 0}};
    char tag = 'z';
    int count_n = n;
    void* params[] = {&d, &count_n, &a, &tag};
    CHECK(cuLaunchKernel(affine, (n + 127) / 128, 1, 1, 128, 1, 1, 0, nullptr, params, nullptr));   // 2i + 0.5

    // extra: the parameters packed by the caller, at the offsets the driver reported.
    std::vector<char> buffer(offsets[3] + sizes[3], 0);
    Affine b{1.0f, -0.5, {0, 0, 0}};
    std::memcpy(&buffer[offsets[0]], &d, sizeof d);
    std::memcpy(&buffer[offsets[1]], &count_n, sizeof count_n);
    std::memcpy(&buffer[offsets[2]], &b, sizeof b);
    std::memcpy(&buffer[offsets[3]], &tag, sizeof tag);
    size_t buffer_size = buffer.size();
    void* extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, buffer.data(), CU_LAUNCH_PARAM_BUFFER_SIZE, &buffer_size,
                     CU_LAUNCH_PARAM_END};
    CUstream stream;
    CHECK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    CUevent start, stop;
    CHECK(cuEventCreate(&start, CU_EVENT_DEFAULT));
    CHECK(cuEventCreate(&stop, CU_EVENT_DEFAULT));
    CHECK(cuCtxSynchronize());
    CHECK(cuEventRecord(start, stream));
    CHECK(cuLaunchKernel(affine, (n + 127) / 128, 1, 1, 128, 1, 1, 0, stream, nullptr, extra));   // 2i

    // Pinned destination: the async copy completes by the stream synchronization.
    float* pinned;
    CHECK(cuMemAllocHost((void**)&pinned, n * sizeof(float)));
    for (int i = 0; i < n; i++) pinned[i] = -1.0f;
    CHECK(cuMemcpyDtoHAsync(pinned, d, n * sizeof(float), stream));
    CHECK(cuEventRecord(stop, stream));
    CHECK(cuStreamSynchronize(stream));
    for (int i = 0; i < n; i++) wrong += pinned[i] != 2.0f * i;
    float ms = -1;
    CHECK(cuEventElapsedTime(&ms, start, stop));
    wrong += check(__LINE__, ms < 0);

    CUdeviceptr launches;
    size_t launches_size = 0;
    int launches_value = 0;
    CHECK(cuModuleGetGlobal(&launches, &launches_size, module, "launches"));
    CHECK(cuMemcpyDtoH(&launches_value, launches, sizeof launches_value));
    wrong += check(__LINE__, launches_size != sizeof(int) || launches_value != 2);

    CHECK(cuMemsetD32(d, 0x40400000, n));   // 3.0f
    CHECK(cuMemcpyDtoH(x.data(), d, n * sizeof(float)));
    for (int i = 0; i < n; i++) wrong += x[i] != 3.0f;

    unsigned type = 0;
    CHECK(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, d));
    wrong += check(__LINE__, type != CU_MEMORYTYPE_DEVICE);
    CUdeviceptr base;
    size_t size;
    CHECK(cuMemGetAddressRange(&base, &size, d + 40));
    wrong += check(__LINE__, base != d || size != n * sizeof(float));

    void* fn = nullptr;
    CUdriverProcAddressQueryResult status;
    CHECK(cuGetProcAddress("cuMemAlloc", &fn, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &status));
    wrong += check(__LINE__, fn == nullptr || status != CU_GET_PROC_ADDRESS_SUCCESS);
    // A missing name must give no function; print how, so native and phos can be compared.
    fn = nullptr;
    CUresult missing = cuGetProcAddress("cuNoSuchFunction", &fn, 12000, 0, &status);
    printf("cuGetProcAddress(missing): result=%d status=%d\n", (int)missing, (int)status);
    wrong += check(__LINE__, fn != nullptr || missing != CUDA_SUCCESS || status != CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);

    CHECK(cuEventDestroy(start));
    CHECK(cuEventDestroy(stop));
    CHECK(cuStreamDestroy(stream));
    CHECK(cuMemFreeHost(pinned));
    CHECK(cuMemFree(d));
    CHECK(cuModuleUnload(module));
    CHECK(cuCtxDestroy(ctx));
    printf("driver_api: devices=%d version_ok=%d launches=%d wrong=%d\n", count, version >= 12000, launches_value, wrong);
    printf(wrong ? "FAIL\n" : "PASS\n");
    return wrong ? 1 : 0;
}
