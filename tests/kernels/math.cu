extern "C" __global__ void fastmath(const float *x, float *out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    float *o = out + 12 * i;
    o[0] = sqrtf(v);
    o[1] = rsqrtf(v);
    o[2] = __expf(v * 0.1f);
    o[3] = __logf(v);
    o[4] = __sinf(v);
    o[5] = __cosf(v);
    o[6] = 1.0f / v;
    o[7] = exp2f(v * 0.1f);
    o[8] = __fdividef(v, 3.0f);
    o[9] = fmaf(v, v, -1.0f);
    o[10] = fminf(v, 2.0f) + fmaxf(v, 3.0f) + fabsf(-v) + copysignf(1.0f, -v);
    o[11] = expf(v * 0.05f) + logf(v) + sinf(v) + tanhf(v * 0.01f) + powf(v, 0.5f);
}

// IEEE directed-rounding intrinsics.
extern "C" __global__ void rounding(const float *x, const float *y, float *out, const double *dx, double *dout, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float a = x[i], b = y[i];
    float *o = out + 12 * i;
    o[0] = __fadd_rz(a, b); o[1] = __fadd_rd(a, b); o[2] = __fadd_ru(a, b);
    o[3] = __fmul_rz(a, b); o[4] = __fmul_rd(a, b); o[5] = __fmul_ru(a, b);
    o[6] = __fdiv_rz(a, b); o[7] = __fdiv_ru(a, b); o[8] = __fsqrt_rd(fabsf(a));
    o[9] = __fmaf_rz(a, b, 1.0f); o[10] = __frcp_ru(b); o[11] = __fsub_rd(a, b);
    double p = dx[i];
    double *d = dout + 4 * i;
    d[0] = __dadd_rz(p, 1.0 / 3.0); d[1] = __dmul_ru(p, 1.0 / 3.0); d[2] = __ddiv_rd(p, 3.0); d[3] = __dsqrt_ru(fabs(p));
}
