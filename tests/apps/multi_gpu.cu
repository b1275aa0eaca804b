// Two devices at once: memory and kernels on both, copies between them (cudaMemcpyPeer, its
// Async form, cudaMemcpy by unified addressing), and peer access with its errors.
// Fewer than two devices: says so and passes.
#include "common.h"

__global__ void fill(float* p, int n, float base) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = base + i;
}

__global__ void add_one(float* p, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] += 1.0f;
}

static int count_wrong(const float* h, int n, float base) {
    int wrong = 0;
    for (int i = 0; i < n; i++) wrong += h[i] != base + i;
    return wrong;
}

int main() {
    int count = 0;
    CHECK(cudaGetDeviceCount(&count));
    if (count < 2) {
        printf("multi_gpu: %d device(s), two needed: nothing to do\nPASS\n", count);
        return 0;
    }
    const int n = 1 << 20;             // 4 MiB a buffer: through the staging area where there is one
    const size_t bytes = n * sizeof(float);
    float *a = nullptr, *b = nullptr, *c = nullptr;
    CHECK(cudaSetDevice(0));
    CHECK(cudaMalloc(&a, bytes));
    CHECK(cudaMalloc(&c, bytes));
    CHECK(cudaSetDevice(1));
    CHECK(cudaMalloc(&b, bytes));
    cudaPointerAttributes pa, pb;
    CHECK(cudaPointerGetAttributes(&pa, a));
    CHECK(cudaPointerGetAttributes(&pb, b));
    int wrong = a == b || pa.device != 0 || pb.device != 1;    // unified addressing: a pointer names its device

    int can01 = 0, can10 = 0, can00 = 1;
    CHECK(cudaDeviceCanAccessPeer(&can01, 0, 1));
    CHECK(cudaDeviceCanAccessPeer(&can10, 1, 0));
    CHECK(cudaDeviceCanAccessPeer(&can00, 0, 0));
    wrong += can00 != 0;

    CHECK(cudaSetDevice(0));
    fill<<<n / 256, 256>>>(a, n, 1.0f);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpyPeer(b, 1, a, 0, bytes));             // device 0 -> device 1
    CHECK(cudaSetDevice(1));
    add_one<<<n / 256, 256>>>(b, n);                       // on device 1
    CHECK(cudaGetLastError());
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    CHECK(cudaMemcpyPeerAsync(a, 0, b, 1, bytes, s));      // device 1 -> device 0, on a stream of device 1
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaSetDevice(0));
    CHECK(cudaMemcpy(c, b, bytes, cudaMemcpyDefault));     // device 1 -> device 0, by the pointers
    float* h = static_cast<float*>(malloc(bytes));
    CHECK(cudaMemcpy(h, a, bytes, cudaMemcpyDeviceToHost));
    int wrong_a = count_wrong(h, n, 2.0f);
    CHECK(cudaMemcpy(h, c, bytes, cudaMemcpyDeviceToHost));
    int wrong_c = count_wrong(h, n, 2.0f);
    wrong += wrong_a + wrong_c;

    // Peer access: enabled once, not twice; disabled once, not twice.
    cudaError_t enable = cudaDeviceEnablePeerAccess(1, 0);
    cudaError_t again = cudaDeviceEnablePeerAccess(1, 0);
    cudaError_t disable = cudaDeviceDisablePeerAccess(1);
    cudaError_t disable_again = cudaDeviceDisablePeerAccess(1);
    cudaGetLastError();
    wrong += enable != (can01 ? cudaSuccess : cudaErrorPeerAccessUnsupported);
    wrong += can01 && (again != cudaErrorPeerAccessAlreadyEnabled || disable != cudaSuccess);
    wrong += disable_again != cudaErrorPeerAccessNotEnabled;

    printf("multi_gpu: devices=%d can_access 0->1=%d 1->0=%d 0->0=%d wrong_a=%d wrong_c=%d\n", count, can01, can10,
           can00, wrong_a, wrong_c);
    printf("peer access: enable=%s again=%s disable=%s disable again=%s\n", cudaGetErrorName(enable),
           cudaGetErrorName(again), cudaGetErrorName(disable), cudaGetErrorName(disable_again));
    free(h);
    CHECK(cudaFree(a));
    CHECK(cudaFree(c));
    CHECK(cudaSetDevice(1));
    CHECK(cudaStreamDestroy(s));
    CHECK(cudaFree(b));
    printf(wrong ? "FAIL\n" : "PASS\n");
    return wrong ? 1 : 0;
}
