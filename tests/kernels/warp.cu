// Votes, ballots and every shuffle mode; one row of 10 words per thread.
extern "C" __global__ void warp_ops(const int *in, int *out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int v = i < n ? in[i] : 0;
    int lane = threadIdx.x & 31;
    int *o = out + 10 * i;
    unsigned full = __activemask();
    int a = __all_sync(full, v > 0);
    int b = __any_sync(full, v > 100);
    unsigned c = __ballot_sync(full, v & 1);
    int u = __shfl_up_sync(full, v, 3);
    int d = __shfl_down_sync(full, v, 5);
    int x = __shfl_xor_sync(full, v, 6);
    int s = __shfl_sync(full, v, (lane * 7) & 31);
    int w = __shfl_sync(full, v, lane + 1, 8);      // width 8 segments
    int z = __shfl_down_sync(full, v, 2, 16);
    unsigned odd = 0;
    if (lane & 1) odd = __activemask();             // divergent activemask
    if (i < n) { o[0] = a; o[1] = b; o[2] = (int)c; o[3] = u; o[4] = d; o[5] = x; o[6] = s; o[7] = w; o[8] = z; o[9] = (int)odd; }
}

extern "C" __global__ void special_regs(unsigned *out) {
    unsigned t = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    unsigned b = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    unsigned *o = out + 8 * (b * blockDim.x * blockDim.y * blockDim.z + t);
    unsigned lane; asm("mov.u32 %0, %%laneid;" : "=r"(lane));
    unsigned warp; asm("mov.u32 %0, %%warpid;" : "=r"(warp));
    long long c0 = clock64();
    o[0] = threadIdx.x; o[1] = threadIdx.y; o[2] = threadIdx.z;
    o[3] = blockIdx.x + 100 * blockIdx.y + 10000 * blockIdx.z;
    o[4] = blockDim.x + 100 * blockDim.y + 10000 * blockDim.z;
    o[5] = gridDim.x + 100 * gridDim.y + 10000 * gridDim.z;
    o[6] = lane + 100 * warp;
    o[7] = clock64() > c0;
}
