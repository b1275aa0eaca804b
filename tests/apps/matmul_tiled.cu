// C = A x B with shared-memory tiles and __syncthreads, on sizes that are not
// multiples of the tile; checked against the CPU.
#include <cmath>
#include <vector>
#include "common.h"

constexpr int TILE = 16;

__global__ void matmul(const float* A, const float* B, float* C, int M, int N, int K) {
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE];
    int row = blockIdx.y * TILE + threadIdx.y, col = blockIdx.x * TILE + threadIdx.x;
    float acc = 0.0f;
    for (int t = 0; t < (K + TILE - 1) / TILE; t++) {
        int ka = t * TILE + threadIdx.x, kb = t * TILE + threadIdx.y;
        As[threadIdx.y][threadIdx.x] = (row < M && ka < K) ? A[row * K + ka] : 0.0f;
        Bs[threadIdx.y][threadIdx.x] = (kb < K && col < N) ? B[kb * N + col] : 0.0f;
        __syncthreads();
        for (int k = 0; k < TILE; k++) acc += As[threadIdx.y][k] * Bs[k][threadIdx.x];
        __syncthreads();
    }
    if (row < M && col < N) C[row * N + col] = acc;
}

int main() {
    const int M = 45, N = 38, K = 52;
    std::vector<float> A(M * K), B(K * N), C(M * N), want(M * N);
    for (int i = 0; i < M * K; i++) A[i] = (float)((i * 7) % 13) / 4.0f - 1.0f;
    for (int i = 0; i < K * N; i++) B[i] = (float)((i * 5) % 11) / 8.0f - 0.5f;
    for (int r = 0; r < M; r++)
        for (int c = 0; c < N; c++) {
            double s = 0;
            for (int k = 0; k < K; k++) s += (double)A[r * K + k] * B[k * N + c];
            want[r * N + c] = (float)s;
        }
    float *dA, *dB, *dC;
    CHECK(cudaMalloc(&dA, A.size() * sizeof(float)));
    CHECK(cudaMalloc(&dB, B.size() * sizeof(float)));
    CHECK(cudaMalloc(&dC, C.size() * sizeof(float)));
    CHECK(cudaMemcpy(dA, A.data(), A.size() * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dB, B.data(), B.size() * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMemset(dC, 0, C.size() * sizeof(float)));
    dim3 block(TILE, TILE), grid((N + TILE - 1) / TILE, (M + TILE - 1) / TILE);
    matmul<<<grid, block>>>(dA, dB, dC, M, N, K);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(C.data(), dC, C.size() * sizeof(float), cudaMemcpyDeviceToHost));
    int wrong = 0;
    double trace = 0;
    for (int i = 0; i < M * N; i++)
        if (std::fabs(C[i] - want[i]) > 1e-3f * (1.0f + std::fabs(want[i]))) wrong++;
    for (int i = 0; i < (M < N ? M : N); i++) trace += want[i * N + i];
    CHECK(cudaFree(dA));
    CHECK(cudaFree(dB));
    CHECK(cudaFree(dC));
    printf("matmul_tiled: %dx%dx%d trace=%.3f wrong=%d\n", M, N, K, trace, wrong);
    printf(wrong ? "FAIL\n" : "PASS\n");
    return wrong ? 1 : 0;
}
