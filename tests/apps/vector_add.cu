// c = a + b on the default stream, with plain cudaMalloc/cudaMemcpy.
#include <vector>
#include "common.h"

__global__ void vector_add(const float* a, const float* b, float* c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] + b[i];
}

int main() {
    const int n = 10000;   // not a multiple of the block: the bounds check matters
    std::vector<float> a(n), b(n), c(n, -1.0f);
    for (int i = 0; i < n; i++) {
        a[i] = 0.5f * i;
        b[i] = 1000.0f - i;
    }
    float *da, *db, *dc;
    CHECK(cudaMalloc(&da, n * sizeof(float)));
    CHECK(cudaMalloc(&db, n * sizeof(float)));
    CHECK(cudaMalloc(&dc, n * sizeof(float)));
    CHECK(cudaMemcpy(da, a.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(db, b.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    const int threads = 256, blocks = (n + threads - 1) / threads;
    vector_add<<<blocks, threads>>>(da, db, dc, n);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(c.data(), dc, n * sizeof(float), cudaMemcpyDeviceToHost));
    int wrong = 0;
    double sum = 0;
    for (int i = 0; i < n; i++) {
        if (c[i] != a[i] + b[i]) wrong++;
        sum += c[i];
    }
    CHECK(cudaFree(da));
    CHECK(cudaFree(db));
    CHECK(cudaFree(dc));
    printf("vector_add: n=%d sum=%.1f wrong=%d\n", n, sum, wrong);
    printf(wrong ? "FAIL\n" : "PASS\n");
    return wrong ? 1 : 0;
}
