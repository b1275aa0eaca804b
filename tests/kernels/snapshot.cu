// Kernels for the snapshot tests: an iterative solver, and a kernel that writes through
// a pointer it loads from memory (outside any write set a launch's arguments reveal).
extern "C" __global__ void jacobi_step(const float* in, float* out, const float* rhs, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float left = i > 0 ? in[i - 1] : 0.0f, right = i < n - 1 ? in[i + 1] : 0.0f;
    out[i] = 0.5f * (left + right + rhs[i]);
}

extern "C" __global__ void write_indirect(float* const* table, float value, int n) {
    float* target = table[0];
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) target[i] = value;
}

// Fills n words with distinct non-zero values (benchmarks: nothing deduplicates).
extern "C" __global__ void fill_u64(unsigned long long* p, unsigned long long n, unsigned long long seed) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; i += (unsigned long long)gridDim.x * blockDim.x)
        p[i] = (i * 0x9E3779B97F4A7C15ull + seed) | 1;
}
