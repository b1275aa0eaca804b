"""phos chunk fingerprint "pfp1": a 128-bit hash for change detection and content addressing.

The same function is computed by this NumPy reference (the `emu` backend, the image
reader) and by a CUDA hash kernel on the `cuda` backend; both must agree bit for bit.
It is fast, not cryptographic: it detects accidental change (and any change to a
single 64-bit word, always), but someone who controls a chunk's bytes could craft a
collision. Manifests carry a BLAKE2b digest for tamper detection; see image.py.

Algorithm (all arithmetic on unsigned 64-bit integers, wrapping modulo 2**64)
------------------------------------------------------------------------------

Input: a byte string `buf` of length L (L >= 0).

1. Words. Zero-pad `buf` at the end to a multiple of 8 bytes and read it as
   N = ceil(L / 8) little-endian uint64 words w[0..N-1]. (L = 0 gives N = 0.)

2. Two independent lanes, l = 0 and l = 1, with these constants:

       lane 0: S0 = 0x243F6A8885A308D3   P0 = 0x9E3779B97F4A7C15
               A0 = 0xBF58476D1CE4E5B9   B0 = 0x94D049BB133111EB
       lane 1: S1 = 0x13198A2E03707344   P1 = 0xC2B2AE3D27D4EB4F
               A1 = 0xFF51AFD7ED558CCD   B1 = 0xC4CEB9FE1A85EC53

   For every word index i (each independent of all others):

       k  = S_l + i * P_l            # index key: a Weyl sequence, so word order matters
       x  = w[i] ^ k
       x  = x * A_l
       x  = x ^ (x >> 32)
       x  = x * B_l
       x  = x ^ (x >> 29)
       t_l[i] = x

   Every step is a bijection of x for fixed i (xor with a constant, multiplication by
   an odd constant, xorshift), so changing any one word always changes its term.

3. Reduce: H_l = sum over i of t_l[i]  (mod 2**64). The sum is associative and
   commutative: a GPU kernel may compute it in any order (per-thread partial sums
   over a grid-stride loop where k advances by stride*P_l, warp shuffles, then one
   atomicAdd on unsigned long long per block, or a second reduction pass).

4. Final mix with the byte length L (this separates "ab" from "ab\\0", which pad to
   the same words), using fmix64 from MurmurHash3:

       fmix64(z): z ^= z >> 33; z *= 0xFF51AFD7ED558CCD; z ^= z >> 33;
                  z *= 0xC4CEB9FE1A85EC53; z ^= z >> 33; return z

       a  = fmix64(H_0 ^ (L * 0x9E3779B97F4A7C15) ^ 0x452821E638D01377)
       b  = fmix64(H_1 ^ a ^ L)
       h0 = fmix64(a + b)
       h1 = fmix64(b ^ h0 ^ 0x5851F42D4C957F2D)

5. Output: the 16 bytes h0 little-endian, then h1 little-endian. `key(fp)` is its
   lowercase hex (32 characters), the name a chunk is stored under.

Known answers (pinned in tests/unit/test_snapshot_image.py):

    fingerprint(b"")                      = 3338822534e18f2973c2cd5f9cdfc9dd
    fingerprint(bytes(range(256)) * 17)   = b3ec6b17740d8ce79967b02b3c9e55e3   (L = 4352)

`reference_fingerprint` below is the same algorithm one word at a time, in plain Python.

`fingerprints(buf, chunk_size)` splits buf into consecutive chunks of chunk_size bytes
(the last may be shorter) and fingerprints each independently, word indices starting
at 0 in every chunk.
"""
import ctypes
import functools
import sys

import numpy as np

MASK64 = (1 << 64) - 1

S = (0x243F6A8885A308D3, 0x13198A2E03707344)
P = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)
A = (0xBF58476D1CE4E5B9, 0xFF51AFD7ED558CCD)
B = (0x94D049BB133111EB, 0xC4CEB9FE1A85EC53)
LEN_MUL = 0x9E3779B97F4A7C15
FINAL_XOR = 0x5851F42D4C957F2D
LEN_XOR = 0x452821E638D01377

FP_BYTES = 16
BLOCK_WORDS = 8192            # 64 KiB of input per step: the working set stays in L2

_u64 = np.uint64
_A = np.array(A, dtype=np.uint64).reshape(2, 1)
_B = np.array(B, dtype=np.uint64).reshape(2, 1)
_SH32 = _u64(32)
_SH29 = _u64(29)
_key_cache = {}


def _fmix64(z):
    z ^= z >> 33
    z = (z * 0xFF51AFD7ED558CCD) & MASK64
    z ^= z >> 33
    z = (z * 0xC4CEB9FE1A85EC53) & MASK64
    z ^= z >> 33
    return z


def _finish(h0, h1, length):
    a = _fmix64(h0 ^ ((length * LEN_MUL) & MASK64) ^ LEN_XOR)
    b = _fmix64(h1 ^ a ^ (length & MASK64))
    o0 = _fmix64((a + b) & MASK64)
    o1 = _fmix64(b ^ o0 ^ FINAL_XOR)
    return o0.to_bytes(8, "little") + o1.to_bytes(8, "little")


def finish_many(sums, lengths):
    """_finish of many chunks at once: sums is (n, 2) uint64 lane sums, lengths n byte
    lengths; returns the n 16-byte fingerprints. (Step 4 on NumPy's wrapping uint64; for a
    few, a batch of copies, Python's integers are quicker than NumPy's calls.)"""
    if len(lengths) <= 32:
        return [_finish(int(h0), int(h1), int(n)) for (h0, h1), n in zip(np.asarray(sums, np.uint64).reshape(-1, 2).tolist(),
                                                                           np.asarray(lengths, np.uint64).tolist())]

    def fmix(z):
        for shift, mul in ((33, 0xFF51AFD7ED558CCD), (33, 0xC4CEB9FE1A85EC53)):
            z = (z ^ (z >> _u64(shift))) * _u64(mul)
        return z ^ (z >> _u64(33))
    sums = np.asarray(sums, np.uint64).reshape(-1, 2)
    n = np.asarray(lengths, np.uint64)
    with np.errstate(over="ignore"):
        a = fmix(sums[:, 0] ^ (n * _u64(LEN_MUL)) ^ _u64(LEN_XOR))
        b = fmix(sums[:, 1] ^ a ^ n)
        o0 = fmix(a + b)
        o1 = fmix(b ^ o0 ^ _u64(FINAL_XOR))
    raw = np.stack([o0, o1], axis=1).astype("<u8").tobytes()
    return [raw[i:i + FP_BYTES] for i in range(0, len(raw), FP_BYTES)]


def hash_parts(rows, part):
    """(n, 2) chunks (address, length) as entries of the pfp1 kernel (kernels/pfp1.cu) of at
    most `part` bytes (a multiple of 8): (address, length | first word << 32), and the index of
    each chunk's first entry. Their lane sums add up to the chunk's (step 3 above)."""
    lengths = rows[:, 1]
    counts = np.maximum((lengths + np.uint64(part - 1)) // np.uint64(part), np.uint64(1))
    firsts = (np.cumsum(counts) - counts).astype(np.int64)
    owner = np.repeat(np.arange(len(rows)), counts.astype(np.int64))
    offsets = (np.arange(len(owner)) - firsts[owner]).astype(np.uint64) * np.uint64(part)
    sizes = np.minimum(lengths[owner] - offsets, np.uint64(part))
    return np.stack([rows[owner, 0] + offsets, sizes | ((offsets // np.uint64(8)) << np.uint64(32))], axis=1), firsts


def _keys(start, n):
    """Index keys for words start..start+n-1 of both lanes, shape (2, n); cached."""
    ck = (start, n)
    k = _key_cache.get(ck)
    if k is None:
        i = np.arange(start, start + n, dtype=np.uint64)
        k = np.empty((2, n), dtype=np.uint64)
        for lane in range(2):
            np.multiply(i, _u64(P[lane]), out=k[lane])
            k[lane] += _u64(S[lane])
        if len(_key_cache) > 256:
            _key_cache.clear()
        _key_cache[ck] = k
    return k


class _Scratch:
    def __init__(self, n):
        self.x = np.empty((2, n), dtype=np.uint64)
        self.t = np.empty((2, n), dtype=np.uint64)


def _lane_sums(words, scratch=None):
    """(H_0, H_1) for a uint64 word array whose word indices start at 0."""
    n = words.shape[0]
    h = np.zeros(2, dtype=np.uint64)
    if n == 0:
        return 0, 0
    blk = min(n, BLOCK_WORDS)
    if scratch is None or scratch.x.shape[1] < blk:
        scratch = _Scratch(blk)
    with np.errstate(over="ignore"):
        for s in range(0, n, BLOCK_WORDS):
            m = min(BLOCK_WORDS, n - s)
            x = scratch.x[:, :m]
            t = scratch.t[:, :m]
            np.bitwise_xor(words[None, s:s + m], _keys(s, m), out=x)
            x *= _A
            np.right_shift(x, _SH32, out=t)
            x ^= t
            x *= _B
            np.right_shift(x, _SH29, out=t)
            x ^= t
            h += x.sum(axis=1, dtype=np.uint64)
    return int(h[0]), int(h[1])


def _as_bytes_view(buf):
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise ValueError("fingerprint needs a contiguous buffer")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def _words(mv):
    """Little-endian uint64 words of a byte view, zero-padding a partial last word."""
    length = len(mv)
    full = length // 8
    body = np.frombuffer(mv[:full * 8], dtype="<u8") if full else np.empty(0, dtype="<u8")
    if length % 8:
        tail = bytes(mv[full * 8:]) + bytes(8 - length % 8)
        body = np.concatenate([body, np.frombuffer(tail, dtype="<u8")])
    if body.dtype != np.uint64:             # big-endian host: compute on native words
        body = body.astype(np.uint64)
    return body


@functools.cache
def _native():
    """phos_pfp1_lane_sums of the server's native library (gpu_server/native/fingerprint.cpp),
    or None: not built, or a big-endian host (it reads words as they lie in memory)."""
    from phos.base import native
    lib = native.library() if sys.byteorder == "little" else None
    if lib is None:
        return None
    sums = lib.phos_pfp1_lane_sums
    sums.argtypes, sums.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p], None
    return sums


def native_lane_sums(mv):
    """(H_0, H_1) of a byte view through the native library (step 1-3 at several GB/s a core,
    the interpreter's lock let go), or None where it is not there."""
    sums = _native()
    if sums is None:
        return None
    out = np.empty(2, np.uint64)
    sums(np.frombuffer(mv, np.uint8).ctypes.data if len(mv) else None, len(mv), out.ctypes.data)
    return int(out[0]), int(out[1])


def fingerprint(buf, _scratch=None):
    """The 16-byte pfp1 fingerprint of a bytes-like object (see the module docstring): through
    the native library where it was built, else NumPy (_lane_sums)."""
    mv = _as_bytes_view(buf)
    sums = native_lane_sums(mv)
    h0, h1 = sums if sums is not None else _lane_sums(_words(mv), _scratch)
    return _finish(h0, h1, len(mv))


def fingerprints(buf, chunk_size):
    """Fingerprints of consecutive chunk_size-byte chunks of buf (the last may be shorter)."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    mv = _as_bytes_view(buf)
    scratch = _Scratch(min(BLOCK_WORDS, (chunk_size + 7) // 8))
    return [fingerprint(mv[off:off + chunk_size], scratch) for off in range(0, len(mv), chunk_size)]


def key(fp):
    """The store key of a fingerprint: 32 lowercase hex digits."""
    return bytes(fp).hex()


def fingerprint_key(buf):
    return fingerprint(buf).hex()


def reference_fingerprint(buf):
    """A pure-Python, word-at-a-time rendering of the algorithm, for cross-checking (slow)."""
    data = bytes(buf)
    length = len(data)
    data += bytes(-length % 8)
    h = [0, 0]
    for i in range(len(data) // 8):
        w = int.from_bytes(data[8 * i:8 * i + 8], "little")
        for lane in range(2):
            x = w ^ ((S[lane] + i * P[lane]) & MASK64)
            x = (x * A[lane]) & MASK64
            x ^= x >> 32
            x = (x * B[lane]) & MASK64
            x ^= x >> 29
            h[lane] = (h[lane] + x) & MASK64
    return _finish(h[0], h[1], length)
