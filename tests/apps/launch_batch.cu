// Many launches in a row, then one synchronization: phos's stub sends them packed as
// launch batches (schema/phos.capnp, "Launch batches"). Checks the results, the order of
// launches, a launch refused in the middle of a run, two streams, and a fault in the
// middle of a run, which surfaces at the next synchronization and sticks.
#include <vector>
#include "common.h"

__global__ void add_one(int* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1;
}

__global__ void shift_in(int* x, int bit, int n) {   // the result spells the launch order
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * 2 + bit;
}

__global__ void write_far(int* out, long long stride) {
    out[(long long)threadIdx.x * stride] = 1;   // threads > 0 land far outside the allocation
}

static const int n = 1000, threads = 256, blocks = (n + threads - 1) / threads;

static int count_not(int* d, int want, const char* what) {
    std::vector<int> h(n);
    CHECK(cudaMemcpy(h.data(), d, n * sizeof(int), cudaMemcpyDeviceToHost));
    int wrong = 0;
    for (int v : h) wrong += v != want;
    printf("%s: x=%d wrong=%d\n", what, h[0], wrong);
    return wrong;
}

static void add_ones(int* d, int times, cudaStream_t s = 0) {
    for (int k = 0; k < times; k++) add_one<<<blocks, threads, 0, s>>>(d, n);
}

int main() {
    int *x, *y;
    CHECK(cudaMalloc(&x, n * sizeof(int)));
    CHECK(cudaMalloc(&y, n * sizeof(int)));
    CHECK(cudaMemset(x, 0, n * sizeof(int)));
    CHECK(cudaMemset(y, 0, n * sizeof(int)));
    int wrong = 0;

    add_ones(x, 500);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    wrong += count_not(x, 500, "500 launches, one sync");

    const int pattern = 0xA5C3F1;   // 24 launches, one bit each, most significant first
    for (int b = 23; b >= 0; b--) shift_in<<<blocks, threads>>>(y, (pattern >> b) & 1, n);
    wrong += count_not(y, pattern, "24 launches in order");

    add_ones(x, 10);
    add_one<<<1, 2048>>>(x, n);   // more threads per block than any device allows: refused
    printf("refused launch: %s\n", cudaGetErrorName(cudaGetLastError()));
    add_ones(x, 10);
    CHECK(cudaDeviceSynchronize());
    wrong += count_not(x, 520, "launches around a refused one");

    cudaStream_t s1, s2;
    CHECK(cudaStreamCreate(&s1));
    CHECK(cudaStreamCreate(&s2));
    CHECK(cudaMemsetAsync(y, 0, n * sizeof(int), s2));
    add_ones(x, 100, s1);
    add_ones(y, 100, s2);
    CHECK(cudaStreamSynchronize(s1));
    CHECK(cudaStreamSynchronize(s2));
    wrong += count_not(x, 620, "stream 1");
    wrong += count_not(y, 100, "stream 2");

    add_ones(x, 5);
    write_far<<<1, 32>>>(x, 1LL << 28);
    add_ones(x, 5);
    cudaError_t fault = cudaDeviceSynchronize();
    bool is_fault = fault == cudaErrorIllegalAddress || fault == cudaErrorInvalidAddressSpace;
    printf("fault among launches: %s\n", is_fault ? "memory fault" : cudaGetErrorName(fault));
    wrong += !is_fault;
    printf(wrong ? "FAIL\n" : "PASS\n");
    return wrong ? 1 : 0;
}
