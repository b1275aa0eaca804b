struct Pair { int a; float b; };

__device__ __noinline__ float poly(float x, int deg) {
    float r = 0.0f;
    for (int k = 0; k <= deg; k++) r = r * x + (float)(k + 1);
    return r;
}

__device__ __noinline__ Pair swap_scale(Pair p, float s) {
    Pair q; q.a = (int)(p.b * s); q.b = (float)p.a * s; return q;
}

__device__ __noinline__ int depth2(int x) { return x > 5 ? (int)poly((float)x, 1) : x * 7; }

__device__ __noinline__ void store_sq(int *p, int v) { *p = v * v; }

extern "C" __global__ void use_funcs(const float *in, float *out, int *iout, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float y = poly(in[i], i % 4);          // divergent trip counts inside the callee
    Pair p = swap_scale(Pair{i, in[i]}, 2.0f);
    out[i] = y + p.b;
    iout[3 * i] = p.a;
    iout[3 * i + 1] = (i & 1) ? depth2(i % 10) : -1;    // call under divergence, nested call
    store_sq(&iout[3 * i + 2], i);
}
