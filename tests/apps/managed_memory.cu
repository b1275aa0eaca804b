// Memory the device reads and writes in place, though it lives in another process: managed
// memory (cudaMallocManaged) written on the host, updated by kernels, read back on the host
// after a synchronisation; a linked list built in it on the host (pointers stored in the data
// mean the same to the device); mapped pinned memory (cudaHostAlloc with cudaHostAllocMapped)
// that a kernel writes through cudaHostGetDevicePointer's pointer. Prints one line per check,
// then PASS.
#include "common.h"

struct Node {
    int value;
    Node* next;
};

__global__ void add_index(int* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += i;
}

__global__ void sum_list(const Node* head, int* out) {
    int s = 0;
    for (const Node* p = head; p; p = p->next) s += p->value;
    *out = s;
}

__global__ void square(const int* in, int* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = in[i] * in[i];
}

int main() {
    int managed_attr = 0;
    CHECK(cudaDeviceGetAttribute(&managed_attr, cudaDevAttrManagedMemory, 0));
    printf("managed memory attribute: %d\n", managed_attr);
    int wrong = managed_attr != 1;

    const int n = 1 << 16;
    int* x;
    CHECK(cudaMallocManaged(&x, n * sizeof(int)));
    for (int i = 0; i < n; i++) x[i] = 3;
    add_index<<<n / 256, 256>>>(x, n);
    CHECK(cudaDeviceSynchronize());
    int bad = 0;
    for (int i = 0; i < n; i++) bad += x[i] != 3 + i;
    add_index<<<n / 256, 256>>>(x, n);      // again, after the host read it
    CHECK(cudaDeviceSynchronize());
    for (int i = 0; i < n; i++) bad += x[i] != 3 + 2 * i;
    cudaPointerAttributes attr;
    CHECK(cudaPointerGetAttributes(&attr, x));
    printf("managed: wrong=%d type managed=%d\n", bad, attr.type == cudaMemoryTypeManaged);
    wrong += bad + (attr.type != cudaMemoryTypeManaged);

    // Pointers the host stores in managed memory are the device's too.
    Node* nodes;
    int* sum;
    CHECK(cudaMallocManaged(&nodes, 10 * sizeof(Node)));
    CHECK(cudaMallocManaged(&sum, sizeof(int)));
    for (int i = 0; i < 10; i++) nodes[i] = Node{i + 1, i + 1 < 10 ? &nodes[i + 1] : nullptr};
    *sum = -1;
    sum_list<<<1, 1>>>(nodes, sum);
    CHECK(cudaDeviceSynchronize());
    printf("linked list: sum=%d\n", *sum);
    wrong += *sum != 55;

    // A managed buffer copied to and from device memory, and set with cudaMemset.
    int* d;
    CHECK(cudaMalloc(&d, n * sizeof(int)));
    CHECK(cudaMemcpy(d, x, n * sizeof(int), cudaMemcpyDefault));
    CHECK(cudaMemset(x, 0, n * sizeof(int)));
    CHECK(cudaMemPrefetchAsync(x, n * sizeof(int), cudaMemLocation{cudaMemLocationTypeDevice, 0}, 0, 0));
    bad = 0;
    for (int i = 0; i < n; i++) bad += x[i] != 0;
    CHECK(cudaMemcpy(x, d, n * sizeof(int), cudaMemcpyDefault));
    for (int i = 0; i < n; i++) bad += x[i] != 3 + 2 * i;
    printf("managed copies: wrong=%d\n", bad);
    wrong += bad;

    // Mapped pinned memory, through the device pointer the runtime hands out.
    int *in, *out, *d_in, *d_out;
    CHECK(cudaHostAlloc(&in, 1000 * sizeof(int), cudaHostAllocMapped));
    CHECK(cudaHostAlloc(&out, 1000 * sizeof(int), cudaHostAllocMapped));
    CHECK(cudaHostGetDevicePointer(&d_in, in, 0));
    CHECK(cudaHostGetDevicePointer(&d_out, out, 0));
    for (int i = 0; i < 1000; i++) in[i] = i - 500, out[i] = 0;
    square<<<4, 256>>>(d_in, d_out, 1000);
    CHECK(cudaDeviceSynchronize());
    bad = 0;
    for (int i = 0; i < 1000; i++) bad += out[i] != (i - 500) * (i - 500);
    printf("mapped host memory: wrong=%d same address=%d\n", bad, d_in == in);
    wrong += bad;

    CHECK(cudaFreeHost(in));
    CHECK(cudaFreeHost(out));
    CHECK(cudaFree(d));
    CHECK(cudaFree(sum));
    CHECK(cudaFree(nodes));
    CHECK(cudaFree(x));
    printf("wrong=%d\n", wrong);
    printf(wrong ? "FAIL\n" : "PASS\n");
    return wrong ? 1 : 0;
}
