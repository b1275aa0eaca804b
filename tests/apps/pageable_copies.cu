// Large copies between pageable memory and the device, every byte checked: through phos's
// staging area they are memcpy'd into and out of its slots, on PHOS_COPY_THREADS threads.
// Host buffers at odd offsets and of an odd size (the threads' parts are cut at page
// boundaries of the destination), the device->host destination never touched before (its pages
// are faulted in by whichever thread writes them first), synchronous and asynchronous.
// Prints how many threads the process gained across the copies (phos: PHOS_COPY_THREADS - 1).
// With `pause`, it prints READY once the first upload is on the device (and its source zeroed)
// and waits for a line on stdin: tests/native/test_stub_recovery.py kills the worker then, and
// the upload is replayed from the bytes the stub logged.
//   pageable_copies [MiB [pause]]   (default 100)
#include <dirent.h>
#include <cstdlib>
#include <cstring>
#include "common.h"

__global__ void sample(const unsigned char* p, size_t n, size_t stride, unsigned* out, int count) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) {
        size_t at = (size_t)i * stride;
        out[i] = at < n ? p[at] : 0xffffffffu;
    }
}

static unsigned char pattern(size_t i, unsigned seed) { return (unsigned char)((i >> 20) * 29 + (i >> 12) * 7 + i * 13 + seed); }

static size_t wrong(const unsigned char* p, size_t n, unsigned seed) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += p[i] != pattern(i, seed);
    return bad;
}

static int threads() {
    int n = 0;
    if (DIR* d = opendir("/proc/self/task")) {
        while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
        closedir(d);
    }
    return n;
}

int main(int argc, char** argv) {
    const size_t N = ((argc > 1 ? strtoul(argv[1], nullptr, 10) : 100) << 20) + 4097;
    unsigned char* d;
    CHECK(cudaMalloc(&d, N));
    const int count = 4096;
    const size_t stride = N / count + 1;
    unsigned* d_samples;
    CHECK(cudaMalloc(&d_samples, count * sizeof(unsigned)));
    unsigned samples[count];
    CHECK(cudaMemcpy(samples, d_samples, sizeof samples, cudaMemcpyDeviceToHost));   // the small paths warmed
    const int before = threads();

    // pageable buffers at odd offsets from malloc's alignment
    unsigned char* a_block = (unsigned char*)malloc(N + 64);
    unsigned char* a = a_block + 3;
    for (size_t i = 0; i < N; i++) a[i] = pattern(i, 1);

    CHECK(cudaMemcpy(d, a, N, cudaMemcpyHostToDevice));
    sample<<<count / 256, 256>>>(d, N, stride, d_samples, count);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(samples, d_samples, sizeof samples, cudaMemcpyDeviceToHost));
    size_t bad_samples = 0;
    for (int i = 0; i < count; i++) bad_samples += (size_t)i * stride < N && samples[i] != pattern((size_t)i * stride, 1);
    unsigned char* b_block = (unsigned char*)malloc(N + 64);   // not touched before the copy writes it
    unsigned char* b = b_block + 5;
    if (argc > 2 && !strcmp(argv[2], "pause")) {
        memset(a, 0, N);   // a replay of the upload must use the bytes the stub logged
        printf("READY\n");
        fflush(stdout);
        char line[16];
        if (!fgets(line, sizeof line, stdin)) return 2;
    }
    CHECK(cudaMemcpy(b, d, N, cudaMemcpyDeviceToHost));
    printf("sync: device samples wrong=%zu, back wrong=%zu\n", bad_samples, wrong(b, N, 1));

    // asynchronous, on a stream, a new pattern both ways
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    for (size_t i = 0; i < N; i++) a[i] = pattern(i, 2);
    memset(b, 0, N);
    CHECK(cudaMemcpyAsync(d, a, N, cudaMemcpyHostToDevice, s));
    CHECK(cudaMemcpyAsync(b, d, N, cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamSynchronize(s));
    printf("async: back wrong=%zu\n", wrong(b, N, 2));

    printf("threads started by the copies: %d\n", threads() - before);
    CHECK(cudaStreamDestroy(s));
    CHECK(cudaFree(d));
    CHECK(cudaFree(d_samples));
    free(a_block);
    free(b_block);
    printf("PASS\n");
    return 0;
}
