// Control flow nvcc emits less often: jump tables, named barriers with thread counts, recursion.
__device__ __noinline__ int pick(int k, int x) {
    switch (k) {       // dense cases: a jump table (brx.idx)
        case 0: return x + 1;
        case 1: return x * 3;
        case 2: return x - 7;
        case 3: return x ^ 0x55;
        case 4: return x << 2;
        case 5: return x / 3;
        case 6: return -x;
        case 7: return x & 0xF0;
        case 8: return x | 1;
        case 9: return x % 10;
        default: return 0;
    }
}

extern "C" __global__ void jump_table(const int *in, int *out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = pick(i % 12, in[i]);
}

// Warps 0-1 produce into shared memory, warps 2-3 consume: barrier 1 with 128 threads, and a
// bar.arrive from the producers so they do not wait.
extern "C" __global__ void named_barriers(int *out) {
    __shared__ int buf[64];
    int t = threadIdx.x;
    if (t < 64) {
        buf[t] = t * t;
        asm volatile("bar.arrive 1, 128;");
    } else {
        asm volatile("bar.sync 1, 128;");
        out[t - 64] = buf[127 - t];
    }
}

__device__ __noinline__ int fib(int n) { return n < 2 ? n : fib(n - 1) + fib(n - 2); }

extern "C" __global__ void recursive(int *out) { out[threadIdx.x] = fib(threadIdx.x); }
