// A device function that takes a generic pointer, called on shared, global and local memory.
__device__ __noinline__ void bump(int *p, int k) { p[0] += k; p[1] = p[0] * 2; }

extern "C" __global__ void generic_ptrs(int *g, int *out, int which) {
    __shared__ int sh[128 * 2];
    int loc[4];
    int t = threadIdx.x;
    sh[2 * t] = t; sh[2 * t + 1] = 0;
    loc[0] = t * 3; loc[1] = 0; loc[2] = which; loc[3] = 1;
    __syncthreads();
    int *p = which == 0 ? &sh[2 * t] : which == 1 ? &g[2 * t] : &loc[0];
    bump(p, 5);
    __syncthreads();
    out[2 * t] = p[0];
    out[2 * t + 1] = p[1] + __isShared(p) * 100 + __isGlobal(p) * 1000 + __isLocal(p) * 10000;
}

// Local array with dynamic indexing (forces a stack frame).
extern "C" __global__ void local_array(const int *idx, int *out) {
    int a[16];
    for (int k = 0; k < 16; k++) a[k] = k * threadIdx.x;
    out[threadIdx.x] = a[idx[threadIdx.x] & 15] + a[(idx[threadIdx.x] >> 4) & 15];
}
