struct Params { float scale; double offset; int idx[3]; };

// Signature matches the documented cuFuncGetParamInfo example: (0,8),(8,8),(16,4),(24,32),(56,1),(64,8).
extern "C" __global__ void by_value(const float *in, float *out, int n, Params p, char c, double d) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = in[i] * p.scale + (float)p.offset + p.idx[i % 3] + c + (float)d;
}
