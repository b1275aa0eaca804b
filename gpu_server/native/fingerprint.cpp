// pfp1's lane sums on the host (snapshot/fingerprint.py, steps 1-3), for the server's Python:
// a handoff's target verifies every chunk it receives, and NumPy's rendering holds the
// interpreter's lock for most of each chunk (more threads verifying would go no faster).
// Called through ctypes, which lets the lock go for the call.
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace {

constexpr uint64_t kS[2] = {0x243F6A8885A308D3ull, 0x13198A2E03707344ull};
constexpr uint64_t kP[2] = {0x9E3779B97F4A7C15ull, 0xC2B2AE3D27D4EB4Full};
constexpr uint64_t kA[2] = {0xBF58476D1CE4E5B9ull, 0xFF51AFD7ED558CCDull};
constexpr uint64_t kB[2] = {0x94D049BB133111EBull, 0xC4CEB9FE1A85EC53ull};

inline uint64_t term(uint64_t w, uint64_t k, int lane) {
    uint64_t x = (w ^ k) * kA[lane];
    x ^= x >> 32;
    x *= kB[lane];
    return x ^ (x >> 29);
}

}  // namespace

// Built for AVX-512 and AVX2 as well as plain x86-64, the loader picking the best the CPU has:
// vectorized (-O3), the 64-bit multiplies that are most of the work run much faster.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PHOS_VECTOR_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4"), optimize("O3")))
#else
#define PHOS_VECTOR_CLONES
#endif

extern "C" __attribute__((visibility("default"))) PHOS_VECTOR_CLONES void phos_pfp1_lane_sums(const unsigned char* buf, size_t len, uint64_t* out) {
    uint64_t h0 = 0, h1 = 0, k0 = kS[0], k1 = kS[1];
    const size_t words = len / 8;
    for (size_t i = 0; i < words; i++) {
        uint64_t w;
        std::memcpy(&w, buf + 8 * i, 8);      // little-endian words: x86 and arm64 alike
        h0 += term(w, k0, 0);
        h1 += term(w, k1, 1);
        k0 += kP[0];
        k1 += kP[1];
    }
    if (len % 8) {                              // the last word, zero-padded
        uint64_t w = 0;
        std::memcpy(&w, buf + 8 * words, len % 8);
        h0 += term(w, k0, 0);
        h1 += term(w, k1, 1);
    }
    out[0] = h0;
    out[1] = h1;
}
