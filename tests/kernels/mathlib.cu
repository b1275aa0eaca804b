// CUDA libm in full precision (long instruction sequences: Payne-Hanek reduction with madc chains,
// rcp.approx.ftz.f64 refinement, local-memory tables) and __launch_bounds__ (.maxntid).
extern "C" __global__ void __launch_bounds__(128) libm(const float *x, const double *y, float *fo, double *dout, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    double w = y[i];
    fo[4 * i] = sinf(v); fo[4 * i + 1] = cosf(v); fo[4 * i + 2] = tanf(v); fo[4 * i + 3] = erff(v * 1e-6f);
    dout[6 * i] = exp(w * 1e-3); dout[6 * i + 1] = log(fabs(w) + 1); dout[6 * i + 2] = pow(fabs(w) + 1, 0.37);
    dout[6 * i + 3] = sin(w); dout[6 * i + 4] = cbrt(w); dout[6 * i + 5] = atan2(w, 3.0);
}
