// Inclusive prefix sum of one block (Hillis-Steele, double-buffered in shared memory).
extern "C" __global__ void scan_block(const int *in, int *out, int n) {
    __shared__ int buf[2][1024];
    int t = threadIdx.x, cur = 0;
    buf[0][t] = t < n ? in[t] : 0;
    __syncthreads();
    for (int off = 1; off < blockDim.x; off <<= 1) {
        int nxt = 1 - cur;
        buf[nxt][t] = buf[cur][t] + (t >= off ? buf[cur][t - off] : 0);
        cur = nxt;
        __syncthreads();
    }
    if (t < n) out[t] = buf[cur][t];
}

// Warp-level inclusive scan with shuffles, then across warps through shared memory.
extern "C" __global__ void scan_warp(const int *in, int *out, int n) {
    __shared__ int sums[32];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int v = i < n ? in[i] : 0;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int d = 1; d < 32; d <<= 1) {
        int u = __shfl_up_sync(0xffffffff, v, d);
        if (lane >= d) v += u;
    }
    if (lane == 31) sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        int s = lane < blockDim.x / 32 ? sums[lane] : 0;
        for (int d = 1; d < 32; d <<= 1) {
            int u = __shfl_up_sync(0xffffffff, s, d);
            if (lane >= d) s += u;
        }
        sums[lane] = s;
    }
    __syncthreads();
    if (warp > 0) v += sums[warp - 1];
    if (i < n) out[i] = v;
}
