extern "C" __global__ void dbl(const double *x, const double *y, double *out, long long *iout, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    double a = x[i], b = y[i];
    out[4 * i] = a * b + a / b - sqrt(fabs(a));
    out[4 * i + 1] = fma(a, b, 1.0) / (1.0 + b * b);
    out[4 * i + 2] = fmin(a, b) + fmax(a, b) * 0.25 + (double)(float)a;
    out[4 * i + 3] = 1.0 / a + rsqrt(fabs(b) + 1.0);
    iout[2 * i] = (long long)(a * 1000.0);
    iout[2 * i + 1] = __double2ll_rn(b * 3.5) + __double_as_longlong(a) % 1000;
}
