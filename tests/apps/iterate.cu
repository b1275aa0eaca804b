// An iterative solver that stops to be checkpointed: `iterate TOTAL PAUSE...` runs TOTAL
// sweeps of a smoothing kernel; after sweep PAUSE (each one given) it synchronizes,
// prints "READY <sweeps done>" and waits for a line on stdin. After the first pause it
// uploads a second right-hand side, so that copies (staged ones when the worker shares
// our host) follow a restore. Prints the result's checksum, with full precision.
// tests/native/test_stub_reattach.py checkpoints the context at a pause, kills the server and
// restores the context elsewhere: the output must not change. Its module globals (weights, a
// pointer, a count only the kernel keeps) must come back with it.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>
#include "common.h"

// Module globals, which a restore brings back where the device puts them: set through the
// runtime's symbol calls, one counted by the kernel alone and read back at the end.
__constant__ float weights[2];          // of the neighbours and of the right-hand side
__device__ const float* rhs_of_sweep;   // the right-hand side's allocation
__device__ unsigned int sweeps_run;

__global__ void sweep(const float* x, float* y, const float* touched, int n, int it) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float left = x[i > 0 ? i - 1 : i], right = x[i < n - 1 ? i + 1 : i];
        y[i] = weights[0] * (left + right) + weights[1] * rhs_of_sweep[i] + 0.001f * (float)it;
    }
    if (i == 0) atomicAdd(&sweeps_run, 1u);
}

int main(int argc, char** argv) {
    const int n = 1 << 16;   // 256 KiB arrays: copies go through the staging area when there is one
    const int total = argc > 1 ? atoi(argv[1]) : 30;
    std::vector<int> pauses;
    for (int a = 2; a < argc; a++) pauses.push_back(atoi(argv[a]));
    std::vector<float> host(n), rhs(n), rhs2(n);
    for (int i = 0; i < n; i++) {
        rhs[i] = (float)((i * 7919) % 1000) / 1000.0f;
        rhs2[i] = (float)((i * 104729) % 997) / 997.0f - 0.5f;
        host[i] = 0.0f;
    }
    float *x, *y, *r;
    CHECK(cudaMalloc(&x, n * sizeof(float)));
    CHECK(cudaMalloc(&y, n * sizeof(float)));
    CHECK(cudaMalloc(&r, n * sizeof(float)));
    CHECK(cudaMemcpy(x, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(y, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(r, rhs.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    const float w[2] = {0.25f, 0.5f};
    const float* rp = r;
    CHECK(cudaMemcpyToSymbol(weights, w, sizeof w));
    CHECK(cudaMemcpyToSymbol(rhs_of_sweep, &rp, sizeof rp));
    const int threads = 256, blocks = (n + threads - 1) / threads;
    size_t next_pause = 0;
    for (int it = 0; it < total; it++) {
        sweep<<<blocks, threads>>>(x, y, r, n, it);
        CHECK(cudaGetLastError());
        float* t = x;
        x = y;
        y = t;
        if (next_pause < pauses.size() && it + 1 == pauses[next_pause]) {
            CHECK(cudaDeviceSynchronize());
            printf("READY %d\n", it + 1);
            fflush(stdout);
            char line[256];
            if (!fgets(line, sizeof line, stdin)) return 2;
            if (next_pause == 0)   // the first thing after a restore may be a staged copy
                CHECK(cudaMemcpy(r, rhs2.data(), n * sizeof(float), cudaMemcpyHostToDevice));
            next_pause++;
        }
    }
    CHECK(cudaMemcpy(host.data(), x, n * sizeof(float), cudaMemcpyDeviceToHost));
    unsigned int counted = 0;
    CHECK(cudaMemcpyFromSymbol(&counted, sweeps_run, sizeof counted));
    double sum = 0;
    uint64_t hash = 1469598103934665603ull;   // FNV-1a over the bytes
    for (int i = 0; i < n; i++) {
        sum += host[i];
        uint32_t bits;
        memcpy(&bits, &host[i], sizeof bits);
        for (int b = 0; b < 4; b++) hash = (hash ^ ((bits >> (8 * b)) & 0xff)) * 1099511628211ull;
    }
    CHECK(cudaFree(x));
    CHECK(cudaFree(y));
    CHECK(cudaFree(r));
    printf("iterate: n=%d sweeps=%d counted=%u sum=%.17g fnv=%016llx first=%.9g last=%.9g\n", n, total, counted, sum,
           (unsigned long long)hash, host[0], host[n - 1]);
    if (counted != (unsigned int)total) return 3;    // a restore lost the kernel's own count
    printf("PASS\n");
    return 0;
}
