// cudaDeviceReset ends the context; the next call starts a new one, and the program's
// kernels and __device__ variables load again there.
#include "common.h"

__device__ int counter;

__global__ void bump(int* out) {
    int v = atomicAdd(&counter, 1);
    out[threadIdx.x] = v >= 0 ? (int)threadIdx.x + 1 : -1;
}

static int run_once(int expected_counter) {
    int* d;
    int h[32];
    CHECK(cudaMalloc(&d, sizeof h));
    bump<<<1, 32>>>(d);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
    int c = -1, wrong = 0;
    CHECK(cudaMemcpyFromSymbol(&c, counter, sizeof c));
    for (int i = 0; i < 32; i++) wrong += h[i] != i + 1;
    wrong += c != expected_counter;
    CHECK(cudaFree(d));
    return wrong;
}

int main() {
    int wrong = run_once(32);
    CHECK(cudaDeviceReset());
    wrong += run_once(32);   // a new context: the variable starts from its initial value again
    printf("device_reset: wrong=%d\n", wrong);
    printf(wrong ? "FAIL\n" : "PASS\n");
    return wrong ? 1 : 0;
}
