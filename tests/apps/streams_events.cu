// Two non-default streams with pinned buffers, async copies both ways, events for
// ordering (cudaStreamWaitEvent) and timing, queries, and the default stream's ordering.
#include <vector>
#include "common.h"

__global__ void scale(float* x, float f, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= f;
}

__global__ void add_into(float* dst, const float* src, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] += src[i];
}

int main() {
    const int n = 4096;
    const size_t bytes = n * sizeof(float);
    float *h_a, *h_b, *h_out;
    CHECK(cudaMallocHost(&h_a, bytes));
    CHECK(cudaHostAlloc(&h_b, bytes, cudaHostAllocDefault));
    CHECK(cudaMallocHost(&h_out, bytes));
    for (int i = 0; i < n; i++) {
        h_a[i] = (float)i;
        h_b[i] = (float)(2 * i + 1);
        h_out[i] = -1.0f;
    }
    cudaPointerAttributes attr;
    CHECK(cudaPointerGetAttributes(&attr, h_a));
    if (attr.type != cudaMemoryTypeHost) {
        printf("FAIL: pinned memory reports type %d\n", (int)attr.type);
        return 1;
    }

    float *d_a, *d_b;
    CHECK(cudaMalloc(&d_a, bytes));
    CHECK(cudaMalloc(&d_b, bytes));
    CHECK(cudaPointerGetAttributes(&attr, d_a));
    if (attr.type != cudaMemoryTypeDevice) {
        printf("FAIL: device memory reports type %d\n", (int)attr.type);
        return 1;
    }

    cudaStream_t s1, s2;
    CHECK(cudaStreamCreate(&s1));
    CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    cudaEvent_t start, stop, b_ready;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    CHECK(cudaEventCreateWithFlags(&b_ready, cudaEventDisableTiming));

    const int threads = 128, blocks = (n + threads - 1) / threads;
    CHECK(cudaEventRecord(start, s1));
    CHECK(cudaMemcpyAsync(d_a, h_a, bytes, cudaMemcpyHostToDevice, s1));
    scale<<<blocks, threads, 0, s1>>>(d_a, 3.0f, n);                 // a = 3i
    CHECK(cudaMemcpyAsync(d_b, h_b, bytes, cudaMemcpyHostToDevice, s2));
    scale<<<blocks, threads, 0, s2>>>(d_b, 0.5f, n);                 // b = i + 0.5
    CHECK(cudaEventRecord(b_ready, s2));
    CHECK(cudaStreamWaitEvent(s1, b_ready, 0));                      // s1 waits for b
    add_into<<<blocks, threads, 0, s1>>>(d_a, d_b, n);               // a = 4i + 0.5
    CHECK(cudaMemcpyAsync(h_out, d_a, bytes, cudaMemcpyDeviceToHost, s1));
    CHECK(cudaEventRecord(stop, s1));
    CHECK(cudaGetLastError());
    CHECK(cudaEventSynchronize(stop));
    CHECK(cudaEventQuery(stop));
    CHECK(cudaStreamQuery(s1));

    float ms = -1.0f;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    int wrong = 0;
    for (int i = 0; i < n; i++)
        if (h_out[i] != 4.0f * i + 0.5f) wrong++;

    // The legacy default stream orders after the blocking stream s1.
    scale<<<blocks, threads, 0, s1>>>(d_a, 2.0f, n);                 // a = 8i + 1
    std::vector<float> back(n);
    CHECK(cudaMemcpy(back.data(), d_a, bytes, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (back[i] != 8.0f * i + 1.0f) wrong++;
    CHECK(cudaStreamSynchronize(s2));

    CHECK(cudaEventDestroy(start));
    CHECK(cudaEventDestroy(stop));
    CHECK(cudaEventDestroy(b_ready));
    CHECK(cudaStreamDestroy(s1));
    CHECK(cudaStreamDestroy(s2));
    CHECK(cudaFree(d_a));
    CHECK(cudaFree(d_b));
    CHECK(cudaFreeHost(h_a));
    CHECK(cudaFreeHost(h_b));
    CHECK(cudaFreeHost(h_out));
    printf("streams_events: n=%d elapsed_ok=%d wrong=%d\n", n, ms >= 0.0f, wrong);
    printf(wrong || ms < 0.0f ? "FAIL\n" : "PASS\n");
    return wrong || ms < 0.0f ? 1 : 0;
}
