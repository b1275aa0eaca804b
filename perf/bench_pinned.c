// Pinned copies through phos against a plain memcpy of the same buffers, in one run
// (perf/bench_pinned_emu.sh builds and runs it against an emu server).
//
//   memcpy_GBps        memcpy between the pinned buffer and a pageable one of the same size
//   pinned_h2d_GBps    cuMemcpyHtoD from the pinned buffer (a worker on our host maps it, and
//                      copies in place: schema/phos.capnp, "Pinned host memory")
//   pinned_d2h_GBps    cuMemcpyDtoH into it
//   pinned_h2d_async_GBps, pinned_d2h_async_GBps
//                      the Async forms on a stream, then cuStreamSynchronize
//
// Each is the median of --repeats timed rounds, every round timing each copy once, after one
// untimed round. Prints `name value` lines.
//   bench_pinned [--mib N] [--repeats N]
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(call)                                                                 \
    do {                                                                            \
        CUresult e_ = (call);                                                       \
        if (e_ != CUDA_SUCCESS) {                                                   \
            fprintf(stderr, "bench_pinned: %s failed: error %d\n", #call, (int)e_); \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

enum { MAX_REPEATS = 101 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int by_value(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

struct Copy {
    const char* name;
    int kind;    // 0 memcpy to pageable, 1 memcpy from it, 2 h2d, 3 d2h, 4 h2d async, 5 d2h async
};

static void run(int kind, void* pinned, void* pageable, CUdeviceptr device, size_t bytes, CUstream stream) {
    switch (kind) {
    case 0: memcpy(pageable, pinned, bytes); break;
    case 1: memcpy(pinned, pageable, bytes); break;
    case 2: CHECK(cuMemcpyHtoD(device, pinned, bytes)); break;
    case 3: CHECK(cuMemcpyDtoH(pinned, device, bytes)); break;
    case 4: CHECK(cuMemcpyHtoDAsync(device, pinned, bytes, stream)); CHECK(cuStreamSynchronize(stream)); break;
    case 5: CHECK(cuMemcpyDtoHAsync(pinned, device, bytes, stream)); CHECK(cuStreamSynchronize(stream)); break;
    }
}

static double median(double* runs, int n) {
    qsort(runs, n, sizeof runs[0], by_value);
    return runs[n / 2];
}

int main(int argc, char** argv) {
    size_t mib = 256;
    int repeats = 7;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--mib")) mib = strtoul(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--repeats")) repeats = atoi(argv[i + 1]);
    }
    if (repeats < 1 || repeats > MAX_REPEATS) repeats = 7;
    const size_t bytes = mib << 20;
    CUdevice dev;
    CUcontext ctx;
    CUstream stream;
    CUdeviceptr device;
    void* pinned;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuCtxCreate(&ctx, NULL, 0, dev));
    CHECK(cuStreamCreate(&stream, 0));
    CHECK(cuMemAllocHost(&pinned, bytes));
    CHECK(cuMemAlloc(&device, bytes));
    void* pageable = malloc(bytes);
    memset(pinned, 1, bytes);
    memset(pageable, 2, bytes);
    const struct Copy copies[] = {
        {"memcpy_to_pageable_GBps", 0}, {"memcpy_from_pageable_GBps", 1}, {"pinned_h2d_GBps", 2},
        {"pinned_d2h_GBps", 3},         {"pinned_h2d_async_GBps", 4},     {"pinned_d2h_async_GBps", 5},
    };
    // Each round times every kind once, so that all of them meet the same machine (others' jobs
    // come and go on a shared one); a first, untimed round makes the first touches.
    enum { KINDS = sizeof copies / sizeof copies[0] };
    static double runs[KINDS][MAX_REPEATS];
    for (int r = -1; r < repeats; r++) {
        for (int k = 0; k < KINDS; k++) {
            double t = now();
            run(copies[k].kind, pinned, pageable, device, bytes, stream);
            if (r >= 0) runs[k][r] = bytes / (now() - t) / 1e9;
        }
    }
    for (int k = 0; k < KINDS; k++) printf("%s %.2f\n", copies[k].name, median(runs[k], repeats));
    CHECK(cuMemFree(device));
    CHECK(cuMemFreeHost(pinned));
    free(pageable);
    return 0;
}
