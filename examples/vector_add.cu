// An ordinary CUDA program. Built with -cudart shared, it runs unmodified under phos.
#include <cstdio>
#include <cuda_runtime.h>

__global__ void add(const float *a, const float *b, float *c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] + b[i];
}

int main() {
    const int n = 1 << 16;
    static float a[n], b[n], c[n];
    for (int i = 0; i < n; i++) { a[i] = i; b[i] = 2 * i; }
    float *da, *db, *dc;
    cudaMalloc(&da, sizeof a); cudaMalloc(&db, sizeof b); cudaMalloc(&dc, sizeof c);
    cudaMemcpy(da, a, sizeof a, cudaMemcpyHostToDevice);
    cudaMemcpy(db, b, sizeof b, cudaMemcpyHostToDevice);
    add<<<(n + 255) / 256, 256>>>(da, db, dc, n);
    cudaError_t err = cudaMemcpy(c, dc, sizeof c, cudaMemcpyDeviceToHost);
    if (err != cudaSuccess) { printf("error: %s\n", cudaGetErrorString(err)); return 1; }
    for (int i = 0; i < n; i++)
        if (c[i] != 3.0f * i) { printf("wrong at %d: %f\n", i, c[i]); return 1; }
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    printf("vector add of %d floats on \"%s\": correct\n", n, prop.name);
    return 0;
}
