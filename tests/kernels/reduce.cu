// Block sum: shared-memory tree down to one warp, then warp shuffles; one atomicAdd per block.
extern "C" __global__ void reduce_sum(const float *in, float *out, int n) {
    extern __shared__ float sdata[];
    unsigned tid = threadIdx.x;
    float v = 0.0f;
    for (unsigned i = blockIdx.x * blockDim.x * 2 + tid; i < n; i += blockDim.x * 2 * gridDim.x) {
        v += in[i];
        if (i + blockDim.x < n) v += in[i + blockDim.x];
    }
    sdata[tid] = v;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s >= 32; s >>= 1) {
        if (tid < s) sdata[tid] += sdata[tid + s];
        __syncthreads();
    }
    if (tid < 32) {
        v = sdata[tid];
        for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffff, v, off);
        if (tid == 0) atomicAdd(out, v);
    }
}

// Per-block partial sums (no atomics), integer, exact.
extern "C" __global__ void reduce_int(const int *in, int *partial, int n) {
    __shared__ int s[256];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    s[threadIdx.x] = i < n ? in[i] : 0;
    __syncthreads();
    for (int st = blockDim.x / 2; st > 0; st >>= 1) {
        if (threadIdx.x < st) s[threadIdx.x] += s[threadIdx.x + st];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = s[0];
}
