// Module-scope __constant__ and __device__ variables, with initialisers and a pointer initialiser.
__constant__ float coeffs[4] = {1.0f, 2.0f, 3.0f, 4.0f};
__constant__ double scale = 0.5;
__device__ int counter = 7;
__device__ int table[3] = {10, 20, 30};
__device__ int *tptr = table;

extern "C" __global__ void use_globals(float *out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = coeffs[i % 4] * i * (float)scale + tptr[i % 3];
    if (i == 0) atomicAdd(&counter, 1);
}

// Adds through a pointer argument: given a global's address, which a restore may have moved.
extern "C" __global__ void add_to(int *p, int by) { *p += by; }
