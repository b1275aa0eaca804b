// Histogram with shared and global atomicAdd, plus atomicMax, atomicMin and an
// atomicCAS ticket counter; results checked exactly on the host.
#include <vector>
#include "common.h"

constexpr int BINS = 64;

__global__ void histogram(const unsigned* data, int n, unsigned* bins, int* maxv, int* minv, unsigned* tickets,
                          unsigned* order) {
    __shared__ unsigned local[BINS];
    for (int b = threadIdx.x; b < BINS; b += blockDim.x) local[b] = 0;
    __syncthreads();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        unsigned v = data[i];
        atomicAdd(&local[v % BINS], 1u);
        atomicMax(maxv, (int)v);
        atomicMin(minv, (int)v);
    }
    __syncthreads();
    for (int b = threadIdx.x; b < BINS; b += blockDim.x)
        if (local[b]) atomicAdd(&bins[b], local[b]);
    if (threadIdx.x == 0) {   // one ticket per block, taken with compare-and-swap
        unsigned seen = *tickets, prev;
        while ((prev = atomicCAS(tickets, seen, seen + 1)) != seen) seen = prev;
        order[seen] = blockIdx.x;
    }
}

int main() {
    const int n = 20000, blocks = 24, threads = 128;
    std::vector<unsigned> data(n);
    for (int i = 0; i < n; i++) data[i] = (unsigned)((i * 2654435761u) >> 7) % 100000u;
    unsigned* d_data;
    unsigned *d_bins, *d_tickets, *d_order;
    int *d_max, *d_min;
    CHECK(cudaMalloc(&d_data, n * sizeof(unsigned)));
    CHECK(cudaMalloc(&d_bins, BINS * sizeof(unsigned)));
    CHECK(cudaMalloc(&d_tickets, sizeof(unsigned)));
    CHECK(cudaMalloc(&d_order, blocks * sizeof(unsigned)));
    CHECK(cudaMalloc(&d_max, sizeof(int)));
    CHECK(cudaMalloc(&d_min, sizeof(int)));
    CHECK(cudaMemcpy(d_data, data.data(), n * sizeof(unsigned), cudaMemcpyHostToDevice));
    CHECK(cudaMemset(d_bins, 0, BINS * sizeof(unsigned)));
    CHECK(cudaMemset(d_tickets, 0, sizeof(unsigned)));
    const int lo = -1, hi = 0x7fffffff;
    CHECK(cudaMemcpy(d_max, &lo, sizeof(int), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_min, &hi, sizeof(int), cudaMemcpyHostToDevice));
    histogram<<<blocks, threads>>>(d_data, n, d_bins, d_max, d_min, d_tickets, d_order);
    CHECK(cudaGetLastError());

    std::vector<unsigned> bins(BINS), order(blocks);
    unsigned tickets = 0;
    int maxv = 0, minv = 0;
    CHECK(cudaMemcpy(bins.data(), d_bins, BINS * sizeof(unsigned), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(order.data(), d_order, blocks * sizeof(unsigned), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(&tickets, d_tickets, sizeof(unsigned), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(&maxv, d_max, sizeof(int), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(&minv, d_min, sizeof(int), cudaMemcpyDeviceToHost));

    std::vector<unsigned> want(BINS, 0);
    int want_max = -1, want_min = 0x7fffffff;
    for (unsigned v : data) {
        want[v % BINS]++;
        want_max = (int)v > want_max ? (int)v : want_max;
        want_min = (int)v < want_min ? (int)v : want_min;
    }
    int wrong = 0;
    for (int b = 0; b < BINS; b++) wrong += bins[b] != want[b];
    std::vector<int> seen(blocks, 0);   // every block took exactly one ticket
    for (unsigned b : order) wrong += (b >= (unsigned)blocks) || seen[b]++;
    wrong += tickets != (unsigned)blocks;
    wrong += maxv != want_max;
    wrong += minv != want_min;
    printf("atomics: n=%d bin0=%u max=%d min=%d tickets=%u wrong=%d\n", n, bins[0], maxv, minv, tickets, wrong);
    printf(wrong ? "FAIL\n" : "PASS\n");
    return wrong ? 1 : 0;
}
