// 256-bin histogram: per-block shared bins with shared atomics, merged with global atomics.
extern "C" __global__ void histogram(const unsigned char *data, unsigned *bins, int n) {
    __shared__ unsigned local[256];
    for (int b = threadIdx.x; b < 256; b += blockDim.x) local[b] = 0;
    __syncthreads();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)
        atomicAdd(&local[data[i]], 1u);
    __syncthreads();
    for (int b = threadIdx.x; b < 256; b += blockDim.x)
        if (local[b]) atomicAdd(&bins[b], local[b]);
}

// Every atomic flavour on a handful of hot addresses (heavy contention).
extern "C" __global__ void atomics(int *iv, unsigned *uv, float *fv, double *dv, unsigned long long *ull, int *old) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(&iv[0], t);
    atomicSub(&iv[1], 1);
    atomicMin(&iv[2], -t);
    atomicMax(&iv[3], t);
    atomicAnd(&uv[0], ~(1u << (t % 32)));
    atomicOr(&uv[1], 1u << (t % 32));
    atomicXor(&uv[2], 1u << (t % 7));
    atomicInc(&uv[3], 100u);
    atomicDec(&uv[4], 50u);
    atomicExch(&uv[5], (unsigned)t);
    atomicAdd(&fv[0], 1.0f);
    atomicAdd(&dv[0], 0.5);
    atomicAdd(&ull[0], 3ull);
    atomicMin(&ull[1], (unsigned long long)(1000 + t));
    old[t] = atomicCAS(&iv[4], t - 1, t);   // only one chain of successes: 0 -> 1 -> 2 ...
    __shared__ int sh[2];
    if (threadIdx.x == 0) sh[0] = sh[1] = 0;
    __syncthreads();
    atomicAdd(&sh[0], 2);
    atomicMax(&sh[1], threadIdx.x);
    __syncthreads();
    if (threadIdx.x == 0) { atomicAdd(&iv[5], sh[0]); atomicAdd(&iv[6], sh[1]); }
}
