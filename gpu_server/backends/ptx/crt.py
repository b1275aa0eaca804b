"""The C runtime every compiled kernel's source starts with (see compiler.py).

A block runs on one OS thread: its threads run one after the other, each until its next
sync point (bar.sync, a warp collective, a yield in a long loop) where it saves its live
registers and returns; the scheduler below then completes barriers and warp collectives.
Memory accesses resolve device addresses to host pointers, checked against the
allocations as the interpreter checks them, so a bad kernel faults instead of the server.
"""

PRELUDE = r'''
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>
#include <time.h>
#include <fenv.h>

enum { ST_RUN = 0, ST_BAR = 1, ST_WARP = 2, ST_EXIT = 3, ST_ERR = 4 };
enum { E_GLOBAL = 1, E_SHARED = 2, E_LOCAL = 3, E_PARAM = 4, E_ALIGN = 5, E_DEADLOCK = 6, E_STOP = 7, E_TRAP = 8,
       E_ASSERT = 9, E_HOST = 10, E_BRX = 11 };
#define SHARED_WIN %(shared_win)dULL
#define LOCAL_WIN %(local_win)dULL
#define PARAM_WIN %(param_win)dULL
#define WIN_SIZE %(win)dULL
#define YIELD_EVERY 16384
#ifndef BLOCK_THREADS               /* compiler.py builds a kernel for the launch shape it runs with, */
#define BLOCK_THREADS 0             /* or for any (0: the launch's, b->nt and c->shbytes) */
#define BLOCK_X 0
#define BLOCK_Y 0
#define BLOCK_Z 0
#define SHARED_FIXED 0
#define SHARED_BYTES 0ULL
#endif
#define BLOCK_X_ (BLOCK_X ? BLOCK_X : 1)
#define BLOCK_Y_ (BLOCK_X ? BLOCK_Y : 1)
/* a thread function's block constants (%%ntid, %%ctaid, %%nctaid), once, and a thread's %%tid */
#define BLOCK_VARS \
    const uint32_t ntid_x = BLOCK_X ? BLOCK_X : c->block[0], ntid_y = BLOCK_X ? BLOCK_Y : c->block[1], \
                   ntid_z = BLOCK_X ? BLOCK_Z : c->block[2]; \
    const uint32_t ctaid_x = b->ctaid[0], ctaid_y = b->ctaid[1], ctaid_z = b->ctaid[2]; \
    const uint32_t nctaid_x = c->grid[0], nctaid_y = c->grid[1], nctaid_z = c->grid[2]; \
    (void)ntid_x; (void)ntid_y; (void)ntid_z; (void)ctaid_x; (void)ctaid_y; (void)ctaid_z; \
    (void)nctaid_x; (void)nctaid_y; (void)nctaid_z;
#define THREAD_VARS \
    const uint32_t tid_ = BLOCK_X ? 0 : tids_[t]; \
    const uint32_t tid_x = BLOCK_X ? t %% BLOCK_X_ : tid_ & 1023, \
                   tid_y = BLOCK_X ? t / BLOCK_X_ %% BLOCK_Y_ : (tid_ >> 10) & 1023, \
                   tid_z = BLOCK_X ? t / (BLOCK_X_ * BLOCK_Y_) : tid_ >> 20; \
    (void)tid_x; (void)tid_y; (void)tid_z;
#define THREADS(b) (BLOCK_THREADS ? (uint32_t)BLOCK_THREADS : (b)->nt)
#define SHBYTES(c) (SHARED_FIXED ? SHARED_BYTES : (c)->shbytes)

typedef struct {                     /* filled by compiler.py (ctypes mirror: Ctx there) */
    uint8_t *arena; uint64_t base;
    uint64_t *lo, *hi; uint8_t **host; int64_t nalloc;   /* sorted allocations, host pointers */
    uint8_t *params; uint64_t psize;
    uint64_t *gsym;
    uint32_t grid[3], block[3];
    uint64_t shbytes, dyn, local_size;
    volatile int32_t stop;
    int32_t err, err_line, err_width; uint64_t err_addr;
    /* printf (kind 0: format, argument buffer) and assert (1: message, file, line, function), done by
       the host (compiler.py) with the thread's local memory and shared memory to read addresses in */
    int64_t (*host_call)(int32_t kind, uint64_t, uint64_t, uint64_t, uint64_t, uint8_t *loc, uint8_t *shm,
                         uint32_t block, uint32_t thread);
    uint64_t capacity;               /* of the device memory from base (isspacep.global) */
    uint32_t envreg[32];             /* %%envreg0-31: a cooperative launch's grid.sync() word (interp.launch) */
} Ctx;

typedef union { uint64_t u; double d; float f; } Slot;
typedef struct { uint64_t a, b, c; uint32_t mask; int32_t site, kind; uint64_t r; uint8_t p; } Xchg;
typedef struct { uint64_t lo, hi; uint8_t *host; } GCache;
typedef struct {
    Ctx *c; uint8_t *shm, *loc; uint32_t nt, ctaid[3], lin, epoch;   /* epoch: barriers completed */
    uint8_t *state; int32_t *pc; Slot *save; Xchg *x; GCache g;
    GCache recent[4]; uint32_t next_recent;         /* allocations hit lately, before a binary search */
    uint32_t *tid;                                  /* each thread's %%tid: x | y << 10 | z << 20 */
    GCache *site;                                   /* each global access's allocation hit last */
    struct { uint32_t arrived, expect; } bar[16];   /* named barriers: arrivals, thread count (0: all) */
    uint32_t n[4];                                  /* threads in each state (ST_RUN .. ST_EXIT) */
    int32_t upc;                                    /* the sync point every thread not exited waits at, or -1 */
    int32_t left_at;                                /* a region's: the one its threads left at, -1 several, -2 none */
} Blk;

static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline double u2d(uint64_t u) { double f; memcpy(&f, &u, 8); return f; }
static inline uint64_t d2u(double f) { uint64_t u; memcpy(&u, &f, 8); return u; }
static inline float ftzf(float x) { return fabsf(x) < 1.17549435e-38f ? copysignf(0.0f, x) : x; }
static inline float satf(float x) { return x != x ? 0.0f : x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }
static inline double satd(double x) { return x != x ? 0.0 : x < 0.0 ? 0.0 : x > 1.0 ? 1.0 : x; }
static inline uint64_t now_ns(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
                                      return (uint64_t)ts.tv_sec * 1000000000ULL + ts.tv_nsec; }

static int fault(Blk *b, int kind, uint64_t a, int w, int line) {
    Ctx *c = b->c;
    if (!c->err) { c->err = kind; c->err_addr = a; c->err_width = w; c->err_line = line; }
    return 0;
}

/* A global access outside the allocation the fast path caches (b->g): the few allocations hit
   lately first (a kernel reading two arrays in turn), then a binary search of them all. */
static uint8_t *gslow(Blk *b, uint64_t a, unsigned w, int line) {
    Ctx *c = b->c;
    if (w > 1 && (a & (w - 1))) { fault(b, E_ALIGN, a, w, line); return NULL; }
    for (int k = 0; k < 4; k++) {
        GCache *r = &b->recent[k];
        if (a >= r->lo && a + w <= r->hi && a + w > a) { b->g = *r; return r->host + (a - r->lo); }
    }
    int64_t l = 0, h = c->nalloc - 1, i = -1;
    while (l <= h) { int64_t m = (l + h) / 2; if (c->lo[m] <= a) { i = m; l = m + 1; } else h = m - 1; }
    if (i < 0 || a + w > c->hi[i] || a + w < a) { fault(b, E_GLOBAL, a, w, line); return NULL; }
    b->g.lo = c->lo[i]; b->g.hi = c->hi[i]; b->g.host = c->host[i];
    b->recent[b->next_recent++ & 3] = b->g;
    return c->host[i] + (a - c->lo[i]);
}

static inline uint8_t *gptr(Blk *b, uint64_t a, unsigned w, int line) {
    if (a >= b->g.lo && a + w <= b->g.hi && !(a & (w - 1))) return b->g.host + (a - b->g.lo);
    return gslow(b, a, w, line);
}

static inline uint8_t *sptr(Blk *b, uint64_t a, unsigned w, int line) {
    if (a + w <= b->c->shbytes && a + w >= a && !(a & (w - 1))) return b->shm + a;
    fault(b, (a & (w - 1)) ? E_ALIGN : E_SHARED, a, w, line); return NULL;
}

static inline uint8_t *lptr(Blk *b, uint32_t t, uint64_t a, unsigned w, int line) {
    uint64_t n = b->c->local_size;
    if (a + w <= n && a + w >= a && !(a & (w - 1))) return b->loc + (uint64_t)t * n + a;
    fault(b, (a & (w - 1)) ? E_ALIGN : E_LOCAL, a, w, line); return NULL;
}

static inline uint8_t *pptr(Blk *b, uint64_t a, unsigned w, int line) {
    if (a + w <= b->c->psize && a + w >= a) return b->c->params + a;
    fault(b, E_PARAM, a, w, line); return NULL;
}

static uint8_t *genslow(Blk *b, uint32_t t, uint64_t a, unsigned w, int line) {
    if (a - SHARED_WIN < WIN_SIZE) return sptr(b, a - SHARED_WIN, w, line);
    if (a - LOCAL_WIN < WIN_SIZE) return lptr(b, t, a - LOCAL_WIN, w, line);
    if (a - PARAM_WIN < WIN_SIZE) return pptr(b, a - PARAM_WIN, w, line);
    return gslow(b, a, w, line);
}

/* Directed rounding (.rz, .rm, .rp): the operation under the rounding mode the PTX names, out of
   line and compiled with rounding-math so that gcc neither folds nor moves it across fesetround.
   op: 0 add, 1 sub, 2 mul, 3 fma, 4 div, 5 sqrt. */
#define RND_OP(T, FMA, SQRT) \
static __attribute__((noinline, optimize("rounding-math"))) T rnd_##T(int op, T a, T b, T c, int mode) { \
    int o = fegetround(); fesetround(mode); volatile T x = a, y = b, z = c, r; \
    switch (op) { case 0: r = x + y; break; case 1: r = x - y; break; case 2: r = x * y; break; \
                  case 3: r = FMA(x, y, z); break; case 4: r = x / y; break; default: r = SQRT(x); } \
    T v = r; fesetround(o); return v; }
typedef float f32; typedef double f64;
RND_OP(f32, fmaf, sqrtf)
RND_OP(f64, fma, sqrt)
#define RND_CVT(NAME, TO, FROM) \
static __attribute__((noinline, optimize("rounding-math"))) TO NAME(FROM a, int mode) { \
    int o = fegetround(); fesetround(mode); volatile FROM x = a; volatile TO r = (TO)x; fesetround(o); return r; }
RND_CVT(cvt_f32_s64, float, int64_t)
RND_CVT(cvt_f32_u64, float, uint64_t)
RND_CVT(cvt_f64_s64, double, int64_t)
RND_CVT(cvt_f64_u64, double, uint64_t)
RND_CVT(cvt_f32_f64, float, double)

/* f16 and bf16, held as bits. f16 converts exactly through _Float16; a bf16 from a double rounds
   to odd in f32 first, so that the rounding to nearest bf16 after it rounds once (ops.half_op). */
static inline double half_val(uint32_t h, int bf) {
    if (bf) return (double)u2f(h << 16);
    _Float16 f; uint16_t u = h; memcpy(&f, &u, 2); return (double)f;
}
static inline uint16_t f16_of(double x) { _Float16 f = (_Float16)x; uint16_t u; memcpy(&u, &f, 2); return u; }
static __attribute__((noinline, optimize("rounding-math"))) uint16_t f16_of_rnd(double x, int mode) {
    int o = fegetround(); fesetround(mode); volatile double v = x; volatile _Float16 f = (_Float16)v;
    fesetround(o); _Float16 g = f; uint16_t u; memcpy(&u, &g, 2); return u;
}
static inline uint16_t bf16_of_f32(float x, int rz) {
    uint32_t b = f2u(x);
    if (x != x) return 0x7FFF;                  /* the canonical NaN, as sm_75 emulation gives too */
    return rz ? b >> 16 : (uint16_t)((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}
static inline uint16_t bf16_of(double x) {
    if (x != x) return 0x7FFF;
    float f = (float)x;
    if ((double)f != x && isfinite(f)) {
        if (fabs((double)f) > fabs(x)) f = nextafterf(f, 0.0f);
        f = u2f(f2u(f) | 1);
    } else if (!isfinite(f) && isfinite(x)) f = u2f(f2u(copysignf(3.4028235e38f, f)) | 1);
    return bf16_of_f32(f, 0);
}
/* op: 0 add, 1 sub, 2 mul, 3 fma, 4 min, 5 max, 6 neg, 7 abs; on each half of a packed pair */
static inline uint32_t half_op(int op, int bf, int packed, uint32_t a, uint32_t b, uint32_t c, int sat) {
    uint32_t r = 0;
    for (int k = 0; k < (packed ? 2 : 1); k++) {
        uint32_t s = 16 * k;
        double x = half_val((a >> s) & 0xFFFF, bf), y = half_val((b >> s) & 0xFFFF, bf),
               z = half_val((c >> s) & 0xFFFF, bf), v;
        switch (op) { case 0: v = x + y; break; case 1: v = x - y; break; case 2: v = x * y; break;
                      case 3: v = fma(x, y, z); break; case 4: v = fmin(x, y); break; case 5: v = fmax(x, y); break;
                      case 6: v = -x; break; default: v = fabs(x); }
        if (sat) v = v != v ? 0.0 : v < 0.0 ? 0.0 : v > 1.0 ? 1.0 : v;
        r |= (uint32_t)(bf ? bf16_of(v) : f16_of(v)) << s;
    }
    return r;
}

/* mbarrier objects in shared memory, laid out as ops.mb_init describes. A block's threads run on
   one OS thread, so plain reads and writes do. */
#define MB_PHASE (1ULL << 63)
static inline uint64_t mb_arrive(uint8_t *p, uint32_t n, int drop) {
    uint64_t w = *(uint64_t *)p, phase = w & MB_PHASE, pending = w & 0xFFFFFFFFu, expected = (w >> 32) & 0x7FFFFFFFu;
    if (drop) expected = expected > n ? expected - n : 0;
    pending = pending > n ? pending - n : 0;
    if (!pending) { phase ^= MB_PHASE; pending = expected; }
    *(uint64_t *)p = phase | expected << 32 | pending;
    return w & MB_PHASE;
}
static inline int mb_done(uint8_t *p, uint64_t state, int parity) {
    uint64_t w = *(uint64_t *)p;
    return parity ? (w >> 63) != (state & 1) : (w & MB_PHASE) != (state & MB_PHASE);
}

/* Bit manipulation, as ops.py defines each for the interpreter */
static inline uint64_t bfe_u(uint64_t a, uint32_t pos, uint32_t len, int n, int sgn) {
    pos &= 0xFF; len &= 0xFF;
    uint32_t p = pos < (uint32_t)n ? pos : n, avail = len < n - p ? len : n - p;
    uint64_t field = p >= (uint32_t)n ? 0 : a >> p;
    uint64_t mask = avail >= 64 ? ~0ULL : (1ULL << avail) - 1;
    field &= mask;
    if (sgn) {
        uint32_t sp = len == 0 ? 0 : (pos + len - 1 < (uint32_t)n - 1 ? pos + len - 1 : n - 1);
        uint64_t sbit = len == 0 ? 0 : (a >> sp) & 1;
        if (sbit && avail < (uint32_t)n) field |= ~mask;
    }
    return field;
}
static inline uint64_t bfi_u(uint64_t a, uint64_t b, uint32_t pos, uint32_t len, int n) {
    pos &= 0xFF; len &= 0xFF;
    uint32_t avail = pos >= (uint32_t)n ? 0 : (len < n - pos ? len : n - pos);
    uint64_t fmask = avail >= 64 ? ~0ULL : (1ULL << avail) - 1;
    uint32_t ps = pos < 63 ? pos : 63;
    uint64_t mask = avail == 0 ? 0 : fmask << ps;
    return (b & ~mask) | ((a << ps) & mask);
}
static inline uint32_t bfind_u(uint64_t u, int n, int sgn, int shiftamt) {
    if (sgn && (u >> (n - 1)) & 1) u = ~u;
    if (n < 64) u &= (1ULL << n) - 1;
    if (!u) return 0xFFFFFFFFu;
    int p = 63 - __builtin_clzll(u);
    return shiftamt ? (uint32_t)(n - 1 - p) : (uint32_t)p;
}
static inline uint32_t prmt_u(uint32_t a, uint32_t b, uint32_t c) {
    uint64_t pool = ((uint64_t)b << 32) | a; uint32_t r = 0;
    for (int k = 0; k < 4; k++) {
        uint32_t sel = (c >> (4 * k)) & 0xF, byte = (pool >> ((sel & 7) * 8)) & 0xFF;
        if (sel & 8) byte = (byte & 0x80) ? 0xFF : 0;
        r |= byte << (8 * k);
    }
    return r;
}
static inline uint32_t bmsk_u(uint32_t a, uint32_t b, int clamp) {   /* as the PTX ISA defines it */
    uint32_t a1 = a & 31, b1 = b & 31, sum = a1 + b1, mask0 = ~0u << a1;
    uint32_t mask1 = sum >= 32 ? 0 : ~0u << sum;
    int over = sum >= 32;
    if (clamp) { if (a >= 32) { mask0 = 0; over = 1; } if (b >= 32) over = 1; }
    if (over) mask1 = 0; else if (b1 == 0) mask1 = ~0u;
    return mask0 & ~mask1;
}
static inline uint32_t lop3_u(uint32_t a, uint32_t b, uint32_t c, uint32_t lut) {
    uint32_t r = 0;
    for (int i = 0; i < 8; i++)
        if ((lut >> i) & 1) r |= ((i & 4) ? a : ~a) & ((i & 2) ? b : ~b) & ((i & 1) ? c : ~c);
    return r;
}
/* vadd4, vabsdiff2, ... (SIMD video ops): per byte (n 4) or half (n 2); sat clamps each part to the
   destination's type, add sums the parts into c instead (ops d_simd in decode.py) */
static inline uint32_t simd_op(int op, int n, uint32_t a, uint32_t b, uint32_t c, int sa, int sb, int sd,
                               int sat, int add) {
    int bits = 32 / n; int64_t m = (1LL << bits) - 1, sum = (int32_t)c; uint32_t r = 0;
    if (!sd) sum = c;
    for (int k = 0; k < n; k++) {
        int64_t x = (a >> (bits * k)) & m, y = (b >> (bits * k)) & m, v;
        if (sa && x >= (1LL << (bits - 1))) x -= 1LL << bits;
        if (sb && y >= (1LL << (bits - 1))) y -= 1LL << bits;
        switch (op) { case 0: v = x + y; break; case 1: v = x - y; break; case 2: v = x > y ? x - y : y - x; break;
                      case 3: v = x < y ? x : y; break; case 4: v = x > y ? x : y; break; default: v = (x + y + 1) >> 1; }
        if (add) { sum += v; continue; }
        if (sat) {
            int64_t lo = sd ? -(1LL << (bits - 1)) : 0, hi = sd ? (1LL << (bits - 1)) - 1 : m;
            v = v < lo ? lo : v > hi ? hi : v;
        }
        r |= (uint32_t)((v & m) << (bits * k));
    }
    return add ? (uint32_t)sum : r;
}
static inline int64_t dp_part(uint32_t x, int k, int bits, int sgn) {
    int64_t v = (x >> (bits * k)) & ((1u << bits) - 1);
    return sgn && v >= (1 << (bits - 1)) ? v - (1 << bits) : v;
}

/* The fast paths, inline in thread_fn over its locals (glo, ghi, gh: the last allocation hit;
   shm, shlim; lbase, lsz): kept out of memory, a store through a kernel pointer cannot make
   gcc reload them, as it must reload b->... fields under -fno-strict-aliasing. */
#define HOST_CALL(kind, x0, x1, x2, x3) c->host_call(kind, x0, x1, x2, x3, lbase, shm, b->lin, t)
#define LIKELY(x) __builtin_expect(!!(x), 1)
/* w bytes at a inside [0, n), aligned (al): one test, no overflow past 2^64 (bitwise &: one branch) */
#define IN(a, w, n, al) (((a) <= (n) - (w)) & ((n) >= (w)) & !((a) & ((al) - 1)))
/* Past the last allocation hit, the one this access (site) hit last: threads reading a, b and
   writing c in turn hit each array at its own access. */
#define GPTR(p, a, w, line, slow, k) do { uint64_t a_ = (a); \
    if (LIKELY(IN(a_ - glo, w, ghi - glo, w))) p = gh + (a_ - glo); \
    else { GCache *s_ = &b->site[k]; \
        if (IN(a_ - s_->lo, w, s_->hi - s_->lo, w)) { b->g = *s_; p = s_->host + (a_ - s_->lo); } \
        else { p = slow; if (!p) return ST_ERR; *s_ = b->g; } \
        glo = b->g.lo; ghi = b->g.hi; gh = b->g.host; } } while (0)
/* A region's: each access's own allocation cache, in locals (g_k) for all its threads */
#define GPTR_SITE(p, a, w, line, slow, k) do { uint64_t a_ = (a); \
    if (LIKELY(IN(a_ - g_##k.lo, w, g_##k.hi - g_##k.lo, w))) p = g_##k.host + (a_ - g_##k.lo); \
    else { p = slow; if (!p) return ST_ERR; g_##k = b->g; } } while (0)
#define SPTR(p, a, w, line) do { uint64_t a_ = (a); \
    if (LIKELY(IN(a_, w, shlim, w))) p = shm + a_; \
    else { sptr(b, a_, w, line); return ST_ERR; } } while (0)
#define PPTR(p, a, w, line) do { uint64_t a_ = (a); \
    if (LIKELY(IN(a_, w, psz, 1))) p = prm + a_; else { pptr(b, a_, w, line); return ST_ERR; } } while (0)
#define LPTR(p, a, w, line) do { uint64_t a_ = (a); \
    if (LIKELY(IN(a_, w, lsz, w))) p = lbase + a_; \
    else { lptr(b, t, a_, w, line); return ST_ERR; } } while (0)

static inline void bar_arrive(Blk *b, uint32_t id, uint32_t count) {
    b->bar[id & 15].arrived++;
    if (count) b->bar[id & 15].expect = count;
}

static inline uint8_t *genptr(Blk *b, uint32_t t, uint64_t a, unsigned w, int line) {
    if (a >= b->g.lo && a + w <= b->g.hi && !(a & (w - 1))) return b->g.host + (a - b->g.lo);
    return genslow(b, t, a, w, line);
}

#define CAS_LOOP(T, p, v, expr) ({ T _o = __atomic_load_n((T *)(p), __ATOMIC_RELAXED), _n; \
    do { T o = _o; (void)o; _n = (expr); } while (!__atomic_compare_exchange_n((T *)(p), &_o, _n, 0, \
        __ATOMIC_RELAXED, __ATOMIC_RELAXED)); _o; })
static inline float atom_add_f32(uint8_t *p, float v) {
    uint32_t o = __atomic_load_n((uint32_t *)p, __ATOMIC_RELAXED), n;
    do { n = f2u(u2f(o) + v); } while (!__atomic_compare_exchange_n((uint32_t *)p, &o, n, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return u2f(o);
}
static inline double atom_add_f64(uint8_t *p, double v) {
    uint64_t o = __atomic_load_n((uint64_t *)p, __ATOMIC_RELAXED), n;
    do { n = d2u(u2d(o) + v); } while (!__atomic_compare_exchange_n((uint64_t *)p, &o, n, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return u2d(o);
}

/* The lanes of warp w (from thread t0, n of them) in grp, waiting at one site, complete its collective
   together, as the interpreter's group does. */
static void warp_group(Blk *b, uint32_t t0, uint32_t n, uint32_t grp) {
    Xchg *xs = b->x + t0;
    uint32_t l = __builtin_ctz(grp);
    int kind = xs[l].kind;                 /* one site, one instruction */
    uint32_t yes = 0, acc = xs[l].a;
    if (kind >= 4 && kind <= 8) {          /* ballot, all, any, uni, activemask: the lanes voting yes */
        for (uint32_t q = l; q < n; q++) yes |= (uint32_t)(((grp >> q) & 1) && xs[q].a) << q;
    } else if (kind >= 9 && kind <= 14) {  /* redux add, min, max (signed by c), and, or, xor */
        int sg = (int)xs[l].c;
        for (uint32_t q = l + 1; q < n; q++) {
            if (!((grp >> q) & 1)) continue;
            uint32_t v = xs[q].a;
            if (kind == 9) acc += v;
            else if (kind == 10) acc = sg ? ((int32_t)v < (int32_t)acc ? v : acc) : (v < acc ? v : acc);
            else if (kind == 11) acc = sg ? ((int32_t)v > (int32_t)acc ? v : acc) : (v > acc ? v : acc);
            else if (kind == 12) acc &= v; else if (kind == 13) acc |= v; else acc ^= v;
        }
    }
    if (kind >= 4 && kind <= 8) {
        uint64_t r = kind == 4 ? yes : kind == 8 ? grp : 0;
        uint8_t p = kind == 5 ? yes == grp : kind == 6 ? yes != 0 : kind == 7 ? (yes == grp || !yes) : 0;
        for (uint32_t k = l; k < n; k++) if ((grp >> k) & 1) { xs[k].r = r; xs[k].p = p; }
    } else if (kind >= 9 && kind <= 14) {
        for (uint32_t k = l; k < n; k++) if ((grp >> k) & 1) xs[k].r = acc;
    } else if (kind > 3 && kind != 16 && kind != 17) {   /* bar.warp.sync, lanes in step */
        for (uint32_t k = l; k < n; k++) if ((grp >> k) & 1) xs[k].r = 0;
    } else {
        for (uint32_t k = l; k < n; k++) {
            if (!((grp >> k) & 1)) continue;
            Xchg *x = &xs[k];
            if (kind <= 3) {            /* shfl up, down, bfly, idx */
                int64_t bv = x->b & 31, cv = x->c & 31, seg = (x->c >> 8) & 31, j;
                int64_t maxl = (k & seg) | (cv & ~seg), minl = k & seg; int ok;
                if (kind == 0) { j = (int64_t)k - bv; ok = j >= maxl; }
                else if (kind == 1) { j = k + bv; ok = j <= maxl; }
                else if (kind == 2) { j = k ^ bv; ok = j <= maxl; }
                else { j = minl | (bv & ~seg); ok = j <= maxl; }
                if (!(ok && j < (int64_t)n)) j = k;
                x->r = ((grp >> j) & 1) ? xs[j].a : x->a; x->p = ok;
            } else {                    /* match.any, match.all */
                uint32_t same = 0;
                for (uint32_t q = 0; q < n; q++) if (((grp >> q) & 1) && xs[q].a == x->a) same |= 1u << q;
                x->r = kind == 16 ? same : same == grp ? grp : 0; x->p = same == grp;
            }
        }
    }
    for (uint32_t k = l; k < n; k++) if ((grp >> k) & 1) b->state[t0 + k] = ST_RUN;
    b->n[ST_WARP] -= __builtin_popcount(grp); b->n[ST_RUN] += __builtin_popcount(grp);
}

/* A warp collective: lanes wait (ST_WARP) until every live lane their member mask names waits
   too; then the lanes at each site complete together. */
static int warp_resolve(Blk *b, uint32_t w) {
    uint32_t t0 = w * 32, n = b->nt - t0 < 32 ? b->nt - t0 : 32, waiting = 0, exited = 0;
    const uint8_t *st = b->state + t0;
    const Xchg *xs = b->x + t0;
    for (uint32_t l = 0; l < n; l++) {
        waiting |= (uint32_t)(st[l] == ST_WARP) << l;
        exited |= (uint32_t)(st[l] == ST_EXIT) << l;
    }
    if (!waiting) return 0;
    uint32_t live = (n == 32 ? ~0u : (1u << n) - 1) & ~exited;
    if (waiting == live) {                 /* the common case: every live lane waits, all at one site */
        int32_t site = xs[__builtin_ctz(waiting)].site;
        uint32_t same = 0;
        for (uint32_t l = 0; l < n; l++) same |= (uint32_t)(xs[l].site == site) << l;
        if ((same & waiting) == waiting) { warp_group(b, t0, n, waiting); return 1; }
    }
    uint32_t running = 0, done = 0;
    for (uint32_t l = 0; l < n; l++) running |= (uint32_t)(st[l] == ST_RUN) << l;
    for (uint32_t l = 0; l < n; l++)     /* kind 18 (lanes in step) waits for every lane that runs */
        if (((waiting >> l) & 1) && ((xs[l].mask & live & ~waiting) || (xs[l].kind == 18 && running)))
            waiting &= ~(1u << l);
    while (waiting) {
        uint32_t l = __builtin_ctz(waiting), grp = 0;
        int32_t site = xs[l].site;
        for (uint32_t k = l; k < n; k++)
            if (((waiting >> k) & 1) && xs[k].site == site) grp |= 1u << k;
        waiting &= ~grp;
        warp_group(b, t0, n, grp);
        done = 1;
    }
    return done;
}
'''

SCHEDULER = r'''
/* A thread at bar.sync/bar.red waits (ST_BAR) with the barrier in x.b, its bar.red op in x.c
   (1 popc, 2 and, 3 or) and predicate in x.a; bar.arrive only counts. A barrier completes when
   its arrivals reach its thread count, or every thread not exited when it names none. */
static int bar_release(Blk *b, uint32_t alive) {
    uint32_t nt = b->nt; int woke = 0;
    if (BAR_SIMPLE ? b->n[ST_BAR] == alive : !BAR_RED && b->n[ST_BAR] == alive && b->bar[0].arrived == alive && !b->bar[0].expect) {
        /* every thread waits at barrier 0 (the common case): no bar.red result to give, all go on */
        if (b->n[ST_EXIT]) { for (uint32_t t = 0; t < nt; t++) b->state[t] = b->state[t] == ST_BAR ? ST_RUN : b->state[t]; }
        else memset(b->state, ST_RUN, nt);
        b->n[ST_RUN] += alive; b->n[ST_BAR] = 0;
        b->bar[0].arrived = 0; b->epoch++;
        return 1;
    }
    if (BAR_SIMPLE) return 0;                  /* (its arrivals are its waiting threads, not counted) */
    for (uint32_t id = 0; id < 16; id++) {
        uint32_t arr = b->bar[id].arrived, need = b->bar[id].expect ? b->bar[id].expect : alive;
        if (!arr || arr < need) continue;
        uint32_t cnt = 0, tot = 0;
        if (BAR_RED)
            for (uint32_t t = 0; t < nt; t++)
                if (b->state[t] == ST_BAR && b->x[t].b == id) { tot++; cnt += b->x[t].a != 0; }
        for (uint32_t t = 0; t < nt; t++) {
            Xchg *x = &b->x[t];
            if (b->state[t] != ST_BAR || x->b != id) continue;
            x->r = x->c == 1 ? cnt : x->c == 2 ? cnt == tot : cnt > 0;
            b->state[t] = ST_RUN; b->n[ST_BAR]--; b->n[ST_RUN]++;
        }
        b->bar[id].arrived = b->bar[id].expect = 0;
        b->epoch++; woke = 1;
    }
    return woke;
}

/* Whether every thread from t on that runs waits at sync point p (a region runs them all). */
static int same_pc(Blk *b, uint32_t t, uint32_t p) {
    const uint8_t *st = b->state; const int32_t *pc = b->pc;
    uint32_t other = 0;
    for (uint32_t u = t + 1; u < b->nt; u++) other |= (st[u] == ST_RUN) & (pc[u] != (int32_t)p);
    return !other;
}

/* One round of a block: each runnable thread to its next sync point (all those waiting at a sync
   point that has a region at once: REGIONS), then the barriers and warp collectives that completed.
   Returns 1 while the block runs, 0 once every thread exited, -1 on an error (c->err says which). */
static int block_step(Blk *b) {
    uint32_t nt = b->nt;
    int ran = 0, all_ran = b->n[ST_RUN] + b->n[ST_EXIT] == nt;
    int32_t upc = b->upc, left_at = -1;
    b->upc = -1;
    for (uint32_t t = 0; t < nt;) {
        if (b->state[t] != ST_RUN) { t++; continue; }
        uint32_t p = (uint32_t)b->pc[t];
        if (p <= NSYNC && REGIONS[p] && ((int32_t)p == upc || same_pc(b, t, p))) {
            upc = p;                             /* (every thread from t on that runs waits at p) */
            uint32_t u = t + 1;                  /* a stretch of running threads */
            if (b->n[ST_RUN] == nt) u = nt;
            else while (u < nt && b->state[u] == ST_RUN) u++;
            if (REGIONS[p](b, t, u) == ST_ERR) return -1;
            int32_t at = b->left_at;
            left_at = !ran || left_at == -2 ? at : at == -2 || at == left_at ? left_at : -1;
            t = u;
        } else {
            int s = thread_fn(b, t);
            if (s == ST_ERR) return -1;
            b->state[t] = s; b->n[ST_RUN]--; b->n[s]++;
            left_at = -1;
            t++;
        }
        ran = 1;
    }
    if (all_ran && left_at >= 0) b->upc = left_at;     /* every thread went to one sync point */
    if (b->c->stop) { fault(b, E_STOP, 0, 0, 0); return -1; }
    if (b->n[ST_EXIT] == nt) return 0;
    int woke = 0;
    if (b->n[ST_WARP] && all_ran && left_at >= 0 && b->n[ST_WARP] == nt - b->n[ST_EXIT]) {
        /* every thread not exited waits at one warp sync point: each warp completes it */
        if (SYNC_FREE[left_at] && !b->n[ST_EXIT]) {
            memset(b->state, ST_RUN, nt);
            b->n[ST_RUN] = nt; b->n[ST_WARP] = 0;
        } else
            for (uint32_t t0 = 0; t0 < nt; t0 += 32) {
                uint32_t n = nt - t0 < 32 ? nt - t0 : 32, live = 0;
                for (uint32_t l = 0; l < n; l++) live |= (uint32_t)(b->state[t0 + l] == ST_WARP) << l;
                if (live) warp_group(b, t0, n, live);
            }
        woke = 1;
    } else if (b->n[ST_WARP])
        for (uint32_t w = 0; w * 32 < nt; w++) woke |= warp_resolve(b, w);
    if (b->n[ST_BAR]) woke |= bar_release(b, nt - b->n[ST_EXIT]);
    if (woke || ran) return 1;
    fault(b, E_DEADLOCK, nt - b->n[ST_EXIT], 0, 0); return -1;
}

static int block_open(Blk *b, Ctx *c) {
    uint32_t nt = c->block[0] * c->block[1] * c->block[2];
    memset(b, 0, sizeof *b);
    b->c = c; b->nt = nt;
    uint64_t shstride = (c->shbytes + 15) / 16 * 16;
    b->shm = calloc(shstride ? shstride : 16, 1);
    b->loc = calloc(c->local_size ? (size_t)nt * c->local_size : 16, 1);
    b->state = malloc(nt); b->pc = malloc(nt * sizeof(int32_t));
    b->save = malloc((size_t)nt * (NSAVE ? NSAVE : 1) * sizeof(Slot));
    b->x = calloc(nt, sizeof(Xchg));
    b->tid = malloc(nt * sizeof(uint32_t));
    b->site = calloc(NSITES ? NSITES : 1, sizeof(GCache));
    if (!b->shm || !b->loc || !b->state || !b->pc || !b->save || !b->x || !b->tid || !b->site) {
        c->err = -1; return -1;
    }
    for (uint32_t t = 0; t < nt; t++)
        b->tid[t] = t % c->block[0] | (t / c->block[0] % c->block[1]) << 10 | (t / (c->block[0] * c->block[1])) << 20;
    return 0;
}

static void block_start(Blk *b, int64_t g) {
    Ctx *c = b->c;
    b->lin = (uint32_t)g;
    b->ctaid[0] = g % c->grid[0]; b->ctaid[1] = (g / c->grid[0]) % c->grid[1];
    b->ctaid[2] = g / ((int64_t)c->grid[0] * c->grid[1]);
    if (c->shbytes) memset(b->shm, 0, (c->shbytes + 15) / 16 * 16);
    memset(b->state, ST_RUN, b->nt); memset(b->pc, 0, b->nt * sizeof(int32_t));
    b->n[ST_RUN] = b->nt; b->n[ST_BAR] = b->n[ST_WARP] = b->n[ST_EXIT] = 0;
    b->upc = 0;
    b->epoch = 0;
    memset(b->bar, 0, sizeof b->bar);
}

static void block_close(Blk *b) {
    free(b->shm); free(b->loc); free(b->state); free(b->pc); free(b->save); free(b->x); free(b->tid); free(b->site);
}

/* Blocks first..last-1 of the grid, one after another on the calling OS thread; returns 0 or -1 (c->err says why). */
int run_blocks(Ctx *c, int64_t first, int64_t last) {
    Blk b;
    int rc = block_open(&b, c);
    for (int64_t g = first; g < last && !rc && !c->err && !c->stop; g++) {
        block_start(&b, g);
        while ((rc = block_step(&b)) > 0) {}
    }
    block_close(&b);
    return rc || c->err ? -1 : 0;
}

/* Every block of the grid at once, a round of each in turn (a cooperative launch: a block may wait
   in grid.sync() for all the others, which must run meanwhile). */
int run_grid(Ctx *c, int64_t nblocks) {
    Blk *bs = calloc(nblocks, sizeof(Blk));
    int8_t *live = malloc(nblocks);
    int rc = !bs || !live ? -1 : 0;
    int64_t opened = 0;
    for (; opened < nblocks && !rc; opened++) {
        rc = block_open(&bs[opened], c);
        if (!rc) block_start(&bs[opened], opened);
        if (live) live[opened] = 1;
    }
    for (int64_t running = nblocks; running && !rc && !c->err;) {
        for (int64_t g = 0; g < nblocks && !rc; g++) {
            if (!live[g]) continue;
            int s = block_step(&bs[g]);
            if (s < 0) rc = -1;
            else if (s == 0) { live[g] = 0; running--; }
        }
    }
    for (int64_t g = 0; g < opened; g++) block_close(&bs[g]);
    free(bs); free(live);
    if (rc && !c->err) c->err = -1;
    return rc || c->err ? -1 : 0;
}
'''
