#include <cuda_fp16.h>
// Conversions with every rounding mode and saturation; one row of 20 words per thread.
extern "C" __global__ void conversions(const float *x, const double *xd, int *out, float *fout, unsigned short *hout, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float f = x[i]; double d = xd[i];
    int *o = out + 16 * i;
    o[0] = __float2int_rn(f);
    o[1] = __float2int_rz(f);
    o[2] = __float2int_rd(f);
    o[3] = __float2int_ru(f);
    o[4] = (int)__float2uint_rn(f);
    o[5] = (int)f;                       // cvt.rzi.s32.f32, saturating
    o[6] = (int)(unsigned char)__float2uint_rz(f);
    o[7] = (int)(long long)(f * 1e6f);
    o[8] = __double2int_rn(d);
    o[9] = (int)__double2uint_ru(d);
    o[10] = __float_as_int(__int2float_rz(i * 16777217));
    o[11] = __float_as_int(__uint2float_rd(0xffffffffu - i));
    o[12] = __float_as_int(__double2float_rz(d));
    o[13] = __float_as_int(__double2float_ru(d));
    o[14] = __float_as_int((float)(long long)(d * 1e12));
    o[15] = (int)(signed char)(int)f;
    float *g = fout + 8 * i;
    g[0] = __saturatef(f);
    g[1] = rintf(f);
    g[2] = truncf(f);
    g[3] = floorf(f);
    g[4] = ceilf(f);
    g[5] = __half2float(__float2half(f));
    g[6] = __half2float(__float2half_rz(f));
    g[7] = (float)(unsigned)(f < 0 ? -f : f);
    hout[2 * i] = __half_as_ushort(__float2half_rn(f));
    hout[2 * i + 1] = __half_as_ushort(__double2half(d));
}
