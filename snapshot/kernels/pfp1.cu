// The pfp1 chunk fingerprint's lane sums on the GPU (snapshot/fingerprint.py defines pfp1).
// One block per entry; each thread sums the mixed terms of words t, t+blockDim, ..., then the
// block adds its threads' sums. The host finishes each chunk with the length mix (finish_many).
// An entry may be a part of a chunk: the sums add up over parts, so a few big chunks (a
// batch of copies) are hashed by many blocks at once, not one block each.
// The index keys advance by addition (a 64-bit multiply is several instructions here), and
// the loop is unrolled so that each thread has several loads in flight.
// Built into pfp1.ptx by `nvcc -ptx -arch=compute_75 pfp1.cu` (checked in, so servers need no
// compiler; tests/test_snapshot_engine.py checks the two match and runs it on the emulator).
typedef unsigned long long u64;

__device__ __forceinline__ u64 term(u64 w, u64 k, u64 a, u64 b) {
    u64 x = (w ^ k) * a;
    x ^= x >> 32;
    x *= b;
    return x ^ (x >> 29);
}

// chunks: n pairs (device address, byte length | index of its first word << 32: 0 for a whole
// chunk, the part's offset / 8 for a part); sums: n pairs (lane 0 sum, lane 1 sum).
extern "C" __global__ void pfp1_lane_sums(const u64* chunks, u64* sums, unsigned n) {
    __shared__ u64 s0[256], s1[256];
    unsigned c = blockIdx.x, t = threadIdx.x;
    if (c >= n) return;
    const u64* p = (const u64*)chunks[2 * c];
    u64 len = chunks[2 * c + 1] & 0xFFFFFFFFull, first = chunks[2 * c + 1] >> 32, words = len / 8, h0 = 0, h1 = 0;
    u64 k0 = 0x243F6A8885A308D3ull + (first + t) * 0x9E3779B97F4A7C15ull;
    u64 k1 = 0x13198A2E03707344ull + (first + t) * 0xC2B2AE3D27D4EB4Full;
    const u64 d0 = blockDim.x * 0x9E3779B97F4A7C15ull, d1 = blockDim.x * 0xC2B2AE3D27D4EB4Full;
#pragma unroll 4
    for (u64 i = t; i < words; i += blockDim.x) {
        u64 w = p[i];
        h0 += term(w, k0, 0xBF58476D1CE4E5B9ull, 0x94D049BB133111EBull);
        h1 += term(w, k1, 0xFF51AFD7ED558CCDull, 0xC4CEB9FE1A85EC53ull);
        k0 += d0;
        k1 += d1;
    }
    if (t == 0 && len % 8) {       // the zero-padded last word
        const unsigned char* tail = (const unsigned char*)(p + words);
        u64 w = 0;
        for (unsigned b = 0; b < len % 8; b++) w |= (u64)tail[b] << (8 * b);
        h0 += term(w, 0x243F6A8885A308D3ull + (first + words) * 0x9E3779B97F4A7C15ull, 0xBF58476D1CE4E5B9ull, 0x94D049BB133111EBull);
        h1 += term(w, 0x13198A2E03707344ull + (first + words) * 0xC2B2AE3D27D4EB4Full, 0xFF51AFD7ED558CCDull, 0xC4CEB9FE1A85EC53ull);
    }
    s0[t] = h0;
    s1[t] = h1;
    __syncthreads();
    for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
        if (t < half) {
            s0[t] += s0[t + half];
            s1[t] += s1[t + half];
        }
        __syncthreads();
    }
    if (t == 0) {
        sums[2 * c] = s0[0];
        sums[2 * c + 1] = s1[0];
    }
}
