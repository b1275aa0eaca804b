// Device queries through the runtime: count, properties, attributes, versions, memory.
#include <cstring>
#include "common.h"

int main() {
    int count = 0, device = -1, runtime = 0, driver = 0;
    CHECK(cudaGetDeviceCount(&count));
    CHECK(cudaSetDevice(0));
    CHECK(cudaGetDevice(&device));
    CHECK(cudaRuntimeGetVersion(&runtime));
    CHECK(cudaDriverGetVersion(&driver));
    cudaDeviceProp p;
    CHECK(cudaGetDeviceProperties(&p, 0));
    int warp = 0, sms = 0, major = 0;
    CHECK(cudaDeviceGetAttribute(&warp, cudaDevAttrWarpSize, 0));
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
    size_t free_bytes = 0, total_bytes = 0;
    CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    int wrong = 0;
    wrong += count < 1 || device != 0 || runtime != 13000 || driver < 12000;
    wrong += warp != p.warpSize || sms != p.multiProcessorCount || major != p.major;
    wrong += p.maxThreadsPerBlock < 256 || p.maxThreadsDim[0] < 256 || p.totalGlobalMem < (1ull << 30);
    wrong += strlen(p.name) == 0 || free_bytes == 0 || free_bytes > total_bytes;
    wrong += cudaSetDevice(count) != cudaErrorInvalidDevice;
    cudaGetLastError();
    printf("device_query: count=%d name=%s cc=%d.%d sms=%d warp=%d maxThreadsPerBlock=%d runtime=%d\n", count, p.name,
           p.major, p.minor, p.multiProcessorCount, p.warpSize, p.maxThreadsPerBlock, runtime);
    printf(wrong ? "FAIL\n" : "PASS\n");
    return wrong ? 1 : 0;
}
