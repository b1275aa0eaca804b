// __constant__ and __device__ variables through cudaMemcpyToSymbol/FromSymbol,
// cudaGetSymbolAddress and cudaGetSymbolSize; a kernel reads one and updates the other.
#include "common.h"

__constant__ float coefficients[4];
__device__ int total;
__device__ float table[8] = {1, 2, 3, 4, 5, 6, 7, 8};   // initialised in the module image

__global__ void polynomial(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        y[i] = ((coefficients[3] * v + coefficients[2]) * v + coefficients[1]) * v + coefficients[0] + table[i % 8];
        atomicAdd(&total, 1);
    }
}

int main() {
    const int n = 300;
    float x[n], y[n];
    for (int i = 0; i < n; i++) x[i] = (float)(i % 10) - 4.0f;
    const float c[4] = {1.0f, -2.0f, 0.5f, 0.25f};
    CHECK(cudaMemcpyToSymbol(coefficients, c, sizeof c));
    const int start = 1000;
    CHECK(cudaMemcpyToSymbol(total, &start, sizeof start));
    const float nine = 9.0f;   // table[7] = 9 via an offset copy
    CHECK(cudaMemcpyToSymbol(table, &nine, sizeof nine, 7 * sizeof(float)));

    size_t table_size = 0;
    void* total_address = nullptr;
    CHECK(cudaGetSymbolSize(&table_size, table));
    CHECK(cudaGetSymbolAddress(&total_address, total));

    float *dx, *dy;
    CHECK(cudaMalloc(&dx, sizeof x));
    CHECK(cudaMalloc(&dy, sizeof y));
    CHECK(cudaMemcpy(dx, x, sizeof x, cudaMemcpyHostToDevice));
    polynomial<<<(n + 63) / 64, 64>>>(dx, dy, n);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(y, dy, sizeof y, cudaMemcpyDeviceToHost));

    int count = 0, via_address = 0;
    float c_back[4] = {0, 0, 0, 0};
    CHECK(cudaMemcpyFromSymbol(&count, total, sizeof count));
    CHECK(cudaMemcpy(&via_address, total_address, sizeof via_address, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpyFromSymbol(c_back, coefficients, sizeof c_back));

    const float t[8] = {1, 2, 3, 4, 5, 6, 7, 9};
    int wrong = 0;
    for (int i = 0; i < n; i++) {
        float v = x[i];
        float want = ((c[3] * v + c[2]) * v + c[1]) * v + c[0] + t[i % 8];
        if (y[i] != want) wrong++;
    }
    wrong += count != start + n;
    wrong += via_address != count;
    wrong += table_size != sizeof t;
    for (int k = 0; k < 4; k++) wrong += c_back[k] != c[k];
    // An offset past the variable's end is refused.
    wrong += cudaMemcpyToSymbol(table, &nine, sizeof nine, 8 * sizeof(float)) != cudaErrorInvalidValue;
    cudaGetLastError();
    printf("symbols: count=%d table_size=%zu y0=%.3f wrong=%d\n", count, table_size, y[0], wrong);
    printf(wrong ? "FAIL\n" : "PASS\n");
    return wrong ? 1 : 0;
}
