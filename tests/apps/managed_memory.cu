// Memory the device reads and writes in place, though it lives in another process: managed
// memory (cudaMallocManaged) written on the host, updated by kernels, read back on the host
// after a synchronisation; a linked list built in it on the host (pointers stored in the data
// mean the same to the device); mapped pinned memory (cudaHostAlloc with cudaHostAllocMapped)
// that a kernel writes through cudaHostGetDevicePointer's pointer; the application's own
// memory (malloc'd, at an address not page-aligned, with bytes of its own around it on the same
// pages) registered with cudaHostRegisterMapped, which kernels read and write in place and which
// keeps its bytes, and its neighbours', after cudaHostUnregister. Prints one line per check,
// then PASS.
#include <cstdlib>
#include <cstring>

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

    // The application's own memory, registered mapped: the runtime's device pointer, and the
    // host pointer itself (the same address, as a GPU with unified addressing has it).
    const int m = 3000;
    char* block = static_cast<char*>(malloc(m * sizeof(int) + 64));
    int* reg = reinterpret_cast<int*>(block + 32);          // a page's middle, not its start
    memset(block, 0x5a, 32);
    memset(block + 32 + m * sizeof(int), 0xa5, 32);
    for (int i = 0; i < m; i++) reg[i] = i;
    CHECK(cudaHostRegister(reg, m * sizeof(int), cudaHostRegisterMapped));
    int* d_reg;
    CHECK(cudaHostGetDevicePointer(&d_reg, reg, 0));
    add_index<<<(m + 255) / 256, 256>>>(d_reg, m);          // reg[i] = 2i
    CHECK(cudaDeviceSynchronize());
    bad = 0;
    for (int i = 0; i < m; i++) bad += reg[i] != 2 * i;
    for (int i = 0; i < m; i++) reg[i] = i - 1000;          // the host writes, the device reads
    square<<<(m + 255) / 256, 256>>>(reg, d, m);
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(x, d, m * sizeof(int), cudaMemcpyDeviceToHost));
    for (int i = 0; i < m; i++) bad += x[i] != (i - 1000) * (i - 1000);
    unsigned int reg_flags = 0;
    CHECK(cudaHostGetFlags(&reg_flags, reg));
    CHECK(cudaHostUnregister(reg));
    for (int i = 0; i < m; i++) bad += reg[i] != i - 1000;  // its bytes stay the application's
    for (int i = 0; i < 32; i++) bad += block[i] != 0x5a || block[32 + m * sizeof(int) + i] != static_cast<char>(0xa5);
    reg[0] = 7;                                             // and writable, as before
    bad += reg[0] != 7;
    free(block);
    printf("registered mapped memory: wrong=%d same address=%d mapped flag=%d\n", bad, d_reg == reg,
           (reg_flags & cudaHostRegisterMapped) != 0);
    wrong += bad + (d_reg != reg);

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
