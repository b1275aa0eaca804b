// Barrier reductions, warp match/reduce and __syncwarp.
extern "C" __global__ void sync_ops(const int *in, int *out) {
    int t = threadIdx.x, v = in[blockIdx.x * blockDim.x + t];
    int *o = out + 6 * (blockIdx.x * blockDim.x + t);
    o[0] = __syncthreads_count(v > 0);
    o[1] = __syncthreads_and(v > -50);
    o[2] = __syncthreads_or(v == 7);
    o[3] = (int)__match_any_sync(0xffffffff, v & 3);
    __syncwarp();
#if __CUDA_ARCH__ >= 800
    o[4] = __reduce_add_sync(0xffffffff, v);
    o[5] = __reduce_max_sync(0xffffffff, v);
#else
    o[4] = o[5] = 0;
#endif
}

// Threads leave early; the survivors still synchronise (exited threads no longer count).
extern "C" __global__ void early_exit_barrier(int *out, int keep) {
    __shared__ int s[256];
    int t = threadIdx.x;
    if (t >= keep) return;
    s[t] = t * 2;
    __syncthreads();
    out[blockIdx.x * blockDim.x + t] = s[keep - 1 - t];
}
