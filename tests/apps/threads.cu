// Several host threads share the device: each has its own stream, pinned buffers and
// kernels in flight at the same time as the others'.
#include <thread>
#include <vector>
#include "common.h"

__global__ void iota_scaled(int* out, int n, int scale) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = i * scale;
}

static void worker(int id, int* wrong) {
    const int n = 2048 + 256 * id, rounds = 5;
    CHECK(cudaSetDevice(0));
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    int *d, *h;
    CHECK(cudaMalloc(&d, n * sizeof(int)));
    CHECK(cudaMallocHost(&h, n * sizeof(int)));
    for (int r = 1; r <= rounds; r++) {
        iota_scaled<<<(n + 255) / 256, 256, 0, stream>>>(d, n, id * 100 + r);
        CHECK(cudaMemcpyAsync(h, d, n * sizeof(int), cudaMemcpyDeviceToHost, stream));
        CHECK(cudaStreamSynchronize(stream));
        for (int i = 0; i < n; i++) *wrong += h[i] != i * (id * 100 + r);
    }
    CHECK(cudaFreeHost(h));
    CHECK(cudaFree(d));
    CHECK(cudaStreamDestroy(stream));
}

int main() {
    const int threads = 4;
    std::vector<int> wrong(threads, 0);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; t++) pool.emplace_back(worker, t, &wrong[t]);
    for (auto& t : pool) t.join();
    int total = 0;
    for (int w : wrong) total += w;
    printf("threads: %d threads wrong=%d\n", threads, total);
    printf(total ? "FAIL\n" : "PASS\n");
    return total ? 1 : 0;
}
