// Collatz steps: a data-dependent trip count per thread, plus a nested divergent branch.
extern "C" __global__ void collatz(const unsigned *start, unsigned *steps, unsigned *peak, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned long long x = start[i];
    unsigned s = 0, hi = (unsigned)x;
    while (x != 1 && x != 0) {
        if (x & 1) {
            x = 3 * x + 1;
            if (x > hi) hi = (unsigned)x;
        } else {
            x >>= 1;
        }
        s++;
    }
    steps[i] = s;
    peak[i] = hi;
}

// Early exits and a break/continue mix.
extern "C" __global__ void branchy(const int *in, int *out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int v = in[i], acc = 0;
    for (int k = 0; k < (v & 63); k++) {
        if (k % 3 == 0) continue;
        if (acc > 400) break;
        acc += k * (v > 0 ? 1 : -1);
    }
    if (v < 0) { out[i] = -acc; return; }
    switch (v % 5) {
        case 0: acc += 10; break;
        case 1: acc *= 3; break;
        case 2: acc -= 7; break;
        case 3: acc ^= 0x55; break;
        default: acc = ~acc;
    }
    out[i] = acc;
}
