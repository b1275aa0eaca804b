// The pfp1 chunk fingerprint's lane sums on the GPU (snapshot/fingerprint.py defines pfp1).
// One block per entry; each thread sums the mixed terms of its words, then the block adds its
// threads' sums. The host finishes each chunk with the length mix (finish_many).
// An entry may be a part of a chunk: the sums add up over parts, so a few big chunks (a
// batch of copies) are hashed by many blocks at once, not one block each.
// The index keys advance by addition (a 64-bit multiply is several instructions here), and
// the loop is unrolled so that each thread has several loads in flight. Launch it with 256
// threads a block (the stride and the reduction assume it).
// Built into pfp1.ptx by `nvcc -ptx -arch=compute_75 pfp1.cu` (checked in, so servers need no
// compiler; tests/e2e/test_snapshot_engine.py checks the two match and runs it on the emulator).
typedef unsigned long long u64;

__device__ __forceinline__ u64 term(u64 w, u64 k, u64 a, u64 b) {
    u64 x = (w ^ k) * a;
    x ^= x >> 32;
    x *= b;
    return x ^ (x >> 29);
}

__device__ __forceinline__ u64 warp_sum(u64 v) {
    for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}

#define S0 0x243F6A8885A308D3ull
#define P0 0x9E3779B97F4A7C15ull
#define S1 0x13198A2E03707344ull
#define P1 0xC2B2AE3D27D4EB4Full
#define MIX0(w, k) term(w, k, 0xBF58476D1CE4E5B9ull, 0x94D049BB133111EBull)
#define MIX1(w, k) term(w, k, 0xFF51AFD7ED558CCDull, 0xC4CEB9FE1A85EC53ull)

// chunks: n pairs (device address; byte length | index of its first word << 32: 0 for a whole
// chunk, the part's offset / 8 for a part); sums: n pairs (lane 0 sum, lane 1 sum).
// Blocks of 256 threads. Each thread loads two words at once (16 bytes: near a plain read's
// speed, where one word at a time is slower; perf/RESULTS.md, probe_fingerprint_kernels); a
// word before the first 16-byte boundary and an odd last word are taken alone. An address
// below 8-byte alignment (a module's int global, which the driver aligns to 4) is read a byte
// at a time: a wider load there faults the context.
extern "C" __global__ void pfp1_lane_sums(const u64* chunks, u64* sums, unsigned n) {
    __shared__ u64 s0[8], s1[8];
    unsigned c = blockIdx.x, t = threadIdx.x;
    if (c >= n) return;
    const u64* p = (const u64*)chunks[2 * c];
    u64 len = chunks[2 * c + 1] & 0xFFFFFFFFull, first = chunks[2 * c + 1] >> 32, words = len / 8, h0 = 0, h1 = 0;
    if ((unsigned long long)p & 7) {
        const unsigned char* b = (const unsigned char*)p;
        for (u64 i = t; i < (len + 7) / 8; i += 256) {
            u64 w = 0;
            for (unsigned j = 0; j < 8 && 8 * i + j < len; j++) w |= (u64)b[8 * i + j] << (8 * j);
            h0 += MIX0(w, S0 + (first + i) * P0);
            h1 += MIX1(w, S1 + (first + i) * P1);
        }
        words = len = 0;                        // the paths below have nothing left to do
    }
    unsigned lead = ((unsigned long long)p & 8) && words ? 1 : 0;
    if (t == 0 && lead) {
        h0 += MIX0(p[0], S0 + first * P0);
        h1 += MIX1(p[0], S1 + first * P1);
    }
    const ulonglong2* q = (const ulonglong2*)(p + lead);
    u64 at = first + lead;                      // index of q's first word
    unsigned pairs = (unsigned)((words - lead) / 2);
    u64 k0 = S0 + (at + 2 * t) * P0, k1 = S1 + (at + 2 * t) * P1;
    const u64 d0 = 512 * P0, d1 = 512 * P1;
#pragma unroll 4
    for (unsigned j = t; j < pairs; j += 256) {
        ulonglong2 w = q[j];
        h0 += MIX0(w.x, k0) + MIX0(w.y, k0 + P0);
        h1 += MIX1(w.x, k1) + MIX1(w.y, k1 + P1);
        k0 += d0;
        k1 += d1;
    }
    if (t == 1 && (words - lead) % 2) {        // the odd last word
        u64 i = words - 1;
        h0 += MIX0(p[i], S0 + (first + i) * P0);
        h1 += MIX1(p[i], S1 + (first + i) * P1);
    }
    if (t == 2 && len % 8) {                   // the zero-padded last bytes
        const unsigned char* tail = (const unsigned char*)(p + words);
        u64 w = 0;
        for (unsigned b = 0; b < len % 8; b++) w |= (u64)tail[b] << (8 * b);
        h0 += MIX0(w, S0 + (first + words) * P0);
        h1 += MIX1(w, S1 + (first + words) * P1);
    }
    h0 = warp_sum(h0);
    h1 = warp_sum(h1);
    if (t % 32 == 0) {
        s0[t / 32] = h0;
        s1[t / 32] = h1;
    }
    __syncthreads();
    if (t < 32) {
        h0 = warp_sum(t < 8 ? s0[t] : 0);
        h1 = warp_sum(t < 8 ? s1[t] : 0);
        if (t == 0) {
            sums[2 * c] = h0;
            sums[2 * c + 1] = h1;
        }
    }
}
