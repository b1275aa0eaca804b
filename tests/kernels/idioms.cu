// Common CUDA idioms: warp softmax, cooperative groups, float4, 64-bit math, scoped atomics,
// SIMD intrinsics, double shuffles, match_all, half2 packing, legacy warp-synchronous code.
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
#include <cuda_fp16.h>
namespace cg = cooperative_groups;

extern "C" __global__ void softmax(const float *x, float *y, int cols) {
    int row = blockIdx.x, lane = threadIdx.x;
    const float *r = x + row * cols;
    float m = -INFINITY;
    for (int c = lane; c < cols; c += 32) m = fmaxf(m, r[c]);
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    float s = 0;
    for (int c = lane; c < cols; c += 32) s += expf(r[c] - m);
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
    for (int c = lane; c < cols; c += 32) y[row * cols + c] = expf(r[c] - m) / s;
}

extern "C" __global__ void cgroups(const int *in, int *out) {
    cg::thread_block b = cg::this_thread_block();
    cg::thread_block_tile<32> w = cg::tiled_partition<32>(b);
    cg::thread_block_tile<8> t8 = cg::tiled_partition<8>(b);
    int v = in[b.thread_rank()];
    int s = cg::reduce(w, v, cg::plus<int>());
    int m8 = cg::reduce(t8, v, cg::greater<int>());
    b.sync();
    out[2 * b.thread_rank()] = s;
    out[2 * b.thread_rank() + 1] = m8 + t8.shfl_down(v, 1) * 0 + w.any(v > 50) + w.ballot(v & 1);
}

extern "C" __global__ void misc(const float4 *f4, const long long *ll, double *dsum, unsigned long long *u64s,
                                unsigned *words, int *out, double *dout) {
    int i = threadIdx.x;
    float4 v = __ldg(&f4[i]);
    float4 w = make_float4(v.w, v.z, v.y, v.x);
    ((float4 *)dout)[i] = w;                           // reuse dout as scratch for a v4 store
    long long a = ll[i], b = ll[i + 64] | 1;
    out[8 * i] = (int)(a / b);
    out[8 * i + 1] = (int)(a % b);
    out[8 * i + 2] = __ffsll(a) + __popcll(a) + __clzll(b);
    out[8 * i + 3] = (int)__brevll(a);
    out[8 * i + 4] = __vadd4(words[i], words[i + 64]);
    out[8 * i + 5] = __dp4a((int)words[i], (int)words[i + 64], 5);
    out[8 * i + 6] = __vabsdiffu4(words[i], words[i + 64]);
    out[8 * i + 7] = __usad(words[i], words[i + 64], 3u) + isnan(v.x) + isinf(v.y) * 2 + signbit(v.z) * 4;
    atomicAdd_block(&dsum[0], 1.0);
    atomicAdd_system(&dsum[1], (double)i);
    atomicMax(&u64s[0], (unsigned long long)i * 1000);
    atomicCAS(&u64s[1], 0ull, 77ull);
    double d = __shfl_down_sync(0xffffffff, (double)a, 1);
    int pred;
    unsigned all = __match_all_sync(0xffffffff, i / 32, &pred);
    dout[256 + i] = d + (double)all + pred;
    __half2 h = __floats2half2_rn(v.x, v.y);
    dout[320 + i] = __low2float(h) + __high2float(h);
    __threadfence_block();
    __nanosleep(10);
}

// Legacy warp-synchronous reduction (volatile shared, no __syncwarp).
extern "C" __global__ void legacy_reduce(const int *in, int *out) {
    __shared__ volatile int s[64];
    int t = threadIdx.x;
    s[t] = in[t] + in[t + 32];
    if (t < 32) {
        s[t] += s[t + 16]; s[t] += s[t + 8]; s[t] += s[t + 4]; s[t] += s[t + 2]; s[t] += s[t + 1];
    }
    if (t == 0) out[0] = s[0];
}
