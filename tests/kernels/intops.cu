// Integer ops: one output row of 24 words per thread, computed from a pair of inputs.
extern "C" __global__ void intops(const int *a, const int *b, unsigned *out, long long *wide, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int x = a[i], y = b[i];
    unsigned ux = (unsigned)x, uy = (unsigned)y;
    unsigned *o = out + 24 * i;
    o[0] = __mulhi(x, y);
    o[1] = __umulhi(ux, uy);
    o[2] = __brev(ux);
    o[3] = __popc(ux);
    o[4] = __clz(x);
    o[5] = __byte_perm(ux, uy, 0x5140 + (i & 0x0303));
    o[6] = y != 0 ? x / y : 0;
    o[7] = y != 0 ? x % y : 0;
    o[8] = uy != 0 ? ux / uy : 0;
    o[9] = uy != 0 ? ux % uy : 0;
    o[10] = x >> (uy & 31);
    o[11] = ux >> (uy & 31);
    o[12] = ux << (uy & 31);
    o[13] = (ux >> 5) & 0x3ff;                 // bfe
    o[14] = (ux & ~0xff0u) | ((uy << 4) & 0xff0u);  // bfi
    o[15] = __ffs(x);
    o[16] = __popcll(((unsigned long long)ux << 32) | uy);
    o[17] = __clzll((long long)x);
    o[18] = __sad(x, y, 7u);
    o[19] = (unsigned)__mul24(x, y);
    o[20] = __funnelshift_l(ux, uy, uy & 63);
    o[21] = __funnelshift_rc(ux, uy, uy & 63);
    o[22] = (unsigned)min(x, y) ^ (unsigned)max(x, y) ^ min(ux, uy) ^ (unsigned)abs(x);
    o[23] = !x + (x < y) * 2 + (ux < uy) * 4 + (x == y) * 8;
    long long lx = x, ly = y;
    wide[4 * i] = lx * ly;                             // mul.wide.s32
    wide[4 * i + 1] = (long long)((unsigned long long)ux * uy);   // mul.wide.u32
    wide[4 * i + 2] = __mul64hi(lx * 0x10001, ly * 0x7fff1);
    wide[4 * i + 3] = (long long)__umul64hi((unsigned long long)lx * 0x10001, (unsigned long long)ly * 0x7fff1)
                      + (ly != 0 ? (lx * 12345) / ly : 0) + (lx >> 40) + ((unsigned long long)lx >> 60);
}

// Narrow integer types: char/short arithmetic, sign/zero extension on load and store.
extern "C" __global__ void narrow(const signed char *sc, const unsigned char *uc, const short *ss, unsigned short *us,
                                  int *out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    signed char a = sc[i]; unsigned char b = uc[i]; short c = ss[i];
    out[4 * i] = a;
    out[4 * i + 1] = b;
    out[4 * i + 2] = (short)(c * 3) + a * b;
    out[4 * i + 3] = (signed char)(a + b) >> 1;
    us[i] = (unsigned short)(c * a + b);
}
