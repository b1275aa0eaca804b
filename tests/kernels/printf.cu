#include <cstdio>
extern "C" __global__ void hello(int base, float f, double d) {
    printf("block %d thread %u: base=%d f=%f d=%.3e x=%x ll=%lld s=%s c=%c%%\n",
           blockIdx.x, threadIdx.x, base + (int)threadIdx.x, f * threadIdx.x, d, 255u + threadIdx.x,
           -1234567890123ll, "str", 'A' + (int)threadIdx.x);
    if (threadIdx.x == 0) printf("only zero %5.2f|%-4d|%04u|%g\n", 3.14159f, 7, 42u, 1e-5);
}
