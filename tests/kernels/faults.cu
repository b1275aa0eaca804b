#include <cassert>
extern "C" __global__ void oob_write(float *out, int n, int stride) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[(long long)i * stride] = (float)i;    // stride large enough to run past the allocation
}

extern "C" __global__ void null_read(const int *p, int *out) { out[threadIdx.x] = p[threadIdx.x]; }

extern "C" __global__ void oob_shared(int *out, int k) {
    __shared__ int s[64];
    s[threadIdx.x] = threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = s[threadIdx.x + k];   // k pushes past the block's shared memory
}

extern "C" __global__ void trap_kernel(int *out, int when) {
    out[threadIdx.x] = 1;
    if (threadIdx.x == when) __trap();
}

extern "C" __global__ void assert_kernel(int *out, int bad) {
    assert(threadIdx.x != bad);
    out[threadIdx.x] = 2;
}
