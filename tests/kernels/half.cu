#include <cuda_fp16.h>
#include <cuda_bf16.h>
// __half / __half2 arithmetic (add.f16x2, fma.rn.f16x2, ...) and comparisons.
extern "C" __global__ void half_math(const __half2 *a, const __half2 *b, __half2 *o2, __half *o1, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    o2[2 * i] = __hfma2(a[i], b[i], __hadd2(a[i], b[i]));
    o2[2 * i + 1] = __hmul2(__hsub2(a[i], b[i]), __hneg2(b[i]));
    __half x = __low2half(a[i]), y = __high2half(b[i]);
    o1[4 * i] = __hmul(x, y);
    o1[4 * i + 1] = __hsub(x, y);
    o1[4 * i + 2] = __hlt(x, y) ? x : __hmax(x, y);
    o1[4 * i + 3] = __habs(__hfma(x, y, x));
}

// bfloat16: conversions everywhere, native arithmetic on sm_80+.
extern "C" __global__ void bf16_math(const float *x, const __nv_bfloat162 *a, unsigned short *cv, __nv_bfloat162 *o, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    cv[2 * i] = __bfloat16_as_ushort(__float2bfloat16_rn(x[i]));
    cv[2 * i + 1] = __bfloat16_as_ushort(__float2bfloat16_rz(x[i] * 3.0f));
#if __CUDA_ARCH__ >= 800
    o[2 * i] = __hfma2(a[i], a[i], __hmul2(a[i], a[i]));
    o[2 * i + 1] = __hadd2(a[i], __hmax2(a[i], __hneg2(a[i])));
#endif
}
