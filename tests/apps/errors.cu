// Error paths: an impossible launch configuration is refused at launch (and reported
// by cudaGetLastError); an out-of-bounds store surfaces as cudaErrorIllegalAddress at
// the next synchronization, and sticks.
#include "common.h"

__global__ void fill(int* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = i;
}

__global__ void write_far(int* out, long long stride) {
    out[(long long)threadIdx.x * stride] = 1;   // threads > 0 land far outside the allocation
}

static int expect(const char* what, cudaError_t got, cudaError_t want) {
    printf("%s: %s\n", what, cudaGetErrorName(got));
    return got == want ? 0 : 1;
}

// A stray write faults as an illegal address or, natively on the H200 when it lands in
// another part of the address space, as an invalid address space: both are memory faults.
static int expect_fault(const char* what, cudaError_t got) {
    bool fault = got == cudaErrorIllegalAddress || got == cudaErrorInvalidAddressSpace;
    printf("%s: %s\n", what, fault ? "memory fault" : cudaGetErrorName(got));
    return fault ? 0 : 1;
}

int main() {
    int* d;
    CHECK(cudaMalloc(&d, 64 * sizeof(int)));
    int wrong = 0;

    fill<<<1, 2048>>>(d, 64);   // more threads per block than any device allows
    wrong += expect("too many threads: launch", cudaGetLastError(), cudaErrorInvalidValue);
    wrong += expect("after cudaGetLastError", cudaGetLastError(), cudaSuccess);
    wrong += expect("device still usable", cudaDeviceSynchronize(), cudaSuccess);

    fill<<<1, 64>>>(d, 64);
    wrong += expect("good launch", cudaGetLastError(), cudaSuccess);
    int host[64];
    CHECK(cudaMemcpy(host, d, sizeof host, cudaMemcpyDeviceToHost));
    wrong += host[63] != 63;

    wrong += expect("cudaMemcpy to a bad device pointer",
                    cudaMemcpy((void*)0x10, host, sizeof host, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
    cudaGetLastError();

    write_far<<<1, 32>>>(d, 1LL << 28);
    wrong += expect("illegal address: launch", cudaGetLastError(), cudaSuccess);
    wrong += expect_fault("illegal address: synchronize", cudaDeviceSynchronize());
    wrong += expect_fault("illegal address: sticky", cudaMemcpy(host, d, sizeof host, cudaMemcpyDeviceToHost));
    printf(wrong ? "FAIL\n" : "PASS\n");
    return wrong ? 1 : 0;
}
