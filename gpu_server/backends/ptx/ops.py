"""Lane-wise numerics for the PTX interpreter: types, IEEE rounding modes, bit tricks, atomics.

Every function takes and returns NumPy arrays (or NumPy scalars for uniform values).
Directed rounding (.rz/.rm/.rp) is exact: the op is done in float64 with an error-free
transform telling which side of the float64 result the true value lies on.
"""
import re

import numpy as np

# Scalar types double as constructors (u32(5)); DT maps PTX type names to dtypes.
u8, u16, u32, u64 = np.uint8, np.uint16, np.uint32, np.uint64
i8, i16, i32, i64 = np.int8, np.int16, np.int32, np.int64
f16, f32, f64, pred = np.float16, np.float32, np.float64, np.bool_

DT = {k: np.dtype(v) for k, v in {
    'b8': u8, 'u8': u8, 's8': i8, 'b16': u16, 'u16': u16, 's16': i16, 'f16': f16, 'bf16': u16,
    'b32': u32, 'u32': u32, 's32': i32, 'f32': f32, 'f16x2': u32, 'bf16x2': u32,
    'b64': u64, 'u64': u64, 's64': i64, 'f64': f64, 'pred': pred}.items()}
UINT = {n: np.dtype(t) for n, t in {1: u8, 2: u16, 4: u32, 8: u64}.items()}


def is_float(t):
    return t in ('f16', 'f32', 'f64')


def as_(v, dt):
    """Reinterpret (same size) or convert (ints of other sizes: truncate / extend by v's signedness)."""
    if v.dtype == dt:
        return v
    dt = np.dtype(dt)
    if v.dtype.itemsize == dt.itemsize:
        return v.view(dt)
    if v.dtype.kind == 'f' or dt.kind == 'f':     # bits of a float in a register of another size
        v = v.view(UINT[v.dtype.itemsize]) if v.dtype.kind == 'f' else v
        return v.astype(UINT[dt.itemsize]).view(dt)
    return v.astype(dt)


# ---- floating point ----
def ftz(x):
    """Flush subnormals to sign-preserving zero (the .ftz modifier, f32 only)."""
    return np.where(np.abs(x) < np.finfo(x.dtype).tiny, x * x.dtype.type(0), x)


def sat(x):
    """.sat: clamp to [0, 1], NaN -> 0."""
    return np.where(np.isnan(x), x.dtype.type(0), np.clip(x, 0, 1)).astype(x.dtype)


def two_sum(a, b):
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _split(a):
    c = 134217729.0 * a
    hi = c - (c - a)
    return hi, a - hi


def two_prod(a, b):
    p = a * b
    ah, al = _split(a)
    bh, bl = _split(b)
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _sign(e):
    return np.sign(np.nan_to_num(e, nan=0.0))


def round_f64(x, es, mode):
    """Directed rounding of float64 x, whose exact value is x + (something of sign es)."""
    if mode == 'rn':
        return x
    inf = np.float64(np.inf)
    if mode == 'rm':
        return np.where(es < 0, np.nextafter(x, -inf), x)
    if mode == 'rp':
        return np.where(es > 0, np.nextafter(x, inf), x)
    return np.where(es * np.sign(x) < 0, np.nextafter(x, 0.0), x)       # rz


def round_to(x, es, mode, dt):
    """Round float64 x (exact value x + sign es) to the narrower float dt with mode rn/rz/rm/rp."""
    if mode == 'rn':
        # Round to odd in float64 first so the final rounding is not a double rounding.
        bits = x.view(u64) if isinstance(x, np.ndarray) else np.float64(x).view(u64)
        fix = (es != 0) & ((bits & u64(1)) == 0) & np.isfinite(x)
        x = np.where(fix, np.nextafter(x, np.copysign(np.inf, es)), x)
        return np.asarray(x).astype(dt)[()] if np.ndim(x) == 0 else x.astype(dt)
    f = np.asarray(x).astype(dt)
    d = np.sign(f.astype(f64) - x)                # side of f relative to the exact value
    d = np.where((d == 0) | np.isnan(d), -es, d)
    neg = np.where(x == 0, es < 0, x < 0)
    inf = dt.type(np.inf)
    if mode == 'rm':
        down, up = d > 0, np.zeros_like(d, bool)
    elif mode == 'rp':
        down, up = np.zeros_like(d, bool), d < 0
    else:
        down, up = (d > 0) & ~neg, (d < 0) & neg
    f = np.where(down, np.nextafter(f, -inf), np.where(up, np.nextafter(f, inf), f))
    return f.astype(dt)[()] if np.ndim(f) == 0 else f.astype(dt)


def _inf_err(x, es, *inputs):
    """An overflow to inf from finite inputs: the exact value lies on the zero side."""
    fin = np.ones(np.shape(x), bool)
    for v in inputs:
        fin = fin & np.isfinite(v)
    return np.where(np.isinf(x) & fin, -np.sign(x), es)


def _odd(s, e):
    """Round to odd: s = RN(x) with x = s + e exactly; if inexact, the neighbour with an odd last bit."""
    fix = (e != 0) & ((np.asarray(s).view(u64) & u64(1)) == 0) & np.isfinite(s)
    return np.where(fix, np.nextafter(s, np.copysign(np.inf, e)), s)


def exact(op, a):
    """(x, es) for op on float64 values a: x is the float64 result rounded to nearest, es = sign(exact - x)."""
    if op in ('add', 'sub'):
        x, e = two_sum(a[0], a[1] if op == 'add' else -a[1])
    elif op == 'mul':
        x, e = two_prod(a[0], a[1])
    elif op == 'fma':       # Boldo & Melquiond: RN(th + RO(tl + ul)) is the correctly rounded a*b+c
        uh, ul = two_prod(a[0], a[1])
        th, tl = two_sum(a[2], uh)
        v0, ve = two_sum(tl, ul)
        v = _odd(v0, ve)
        x, e2 = two_sum(th, v)
        e = np.where(e2 != 0, e2, np.where(v == v0, ve, -ve))
        ok = np.isfinite(uh) & np.isfinite(a[2]) & np.isfinite(x)
        x, e = np.where(ok, x, a[0] * a[1] + a[2]), np.where(ok, e, 0.0)
    elif op in ('div', 'rcp'):
        num, den = (a[0], a[1]) if op == 'div' else (np.float64(1.0), a[0])
        x = num / den
        p, pe = two_prod(x, den)
        e = ((num - p) - pe) * np.sign(den)
    elif op == 'sqrt':
        x = np.sqrt(a[0])
        p, pe = two_prod(x, x)
        e = (a[0] - p) - pe
    elif op in ('min', 'max'):
        x, e = (np.fmin if op == 'min' else np.fmax)(a[0], a[1]), 0.0
    else:
        raise KeyError(op)
    return x, _inf_err(x, _sign(e), *a)


def float_op(op, t, mode, args):
    """add/sub/mul/fma/div/sqrt/rcp of type f16/f32/f64 with rounding mode rn/rz/rm/rp, all exact."""
    dt = DT[t]
    if t == 'f32' and mode == 'rn' and op != 'fma':
        a = args
        with np.errstate(all='ignore'):
            return {'add': lambda: a[0] + a[1], 'sub': lambda: a[0] - a[1], 'mul': lambda: a[0] * a[1],
                    'div': lambda: a[0] / a[1], 'sqrt': lambda: np.sqrt(a[0]),
                    'rcp': lambda: dt.type(1) / a[0]}[op]()
    a = [np.asarray(v, f64) for v in args]
    if t == 'f32' and mode == 'rn':       # fma: a*b is exact in f64, so only s = a*b + c rounds twice
        s = a[0] * a[1] + a[2]
        r = s.astype(f32)
        low = s.view(u64) & u64(0x1FFFFFFF)
        risky = (low == u64(0x10000000)) | ((np.abs(s) < 2.0 ** -125) & (s != 0))   # an f32 midpoint, or subnormal
        if risky.any():
            if r.ndim == 0:
                return round_to(*exact('fma', a), 'rn', dt)
            sub = [np.broadcast_to(v, r.shape)[risky] for v in a]
            r[risky] = round_to(*exact('fma', sub), 'rn', dt)
        return r[()] if r.ndim == 0 else r
    x, es = exact(op, a)
    if op in ('add', 'sub') and mode == 'rm':      # exact zero sums round to -0 unless both are +0
        bb = a[1] if op == 'add' else -a[1]
        x = np.where((x == 0) & (es == 0) & ~(_pos0(a[0]) & _pos0(bb)), -0.0, x)
    if t == 'f64':
        r = round_f64(x, es, mode)
        return r[()] if np.ndim(r) == 0 else r
    return round_to(x, es, mode, dt)


def _round_odd_f32(x, es):
    f = np.asarray(x).astype(f32)
    d = np.sign(f.astype(f64) - x)
    d = np.where((d == 0) | np.isnan(d), -es, d)
    fix = (d != 0) & ((f.view(u32) & u32(1)) == 0) & np.isfinite(f)
    return np.where(fix, np.nextafter(f, np.where(d > 0, -np.inf, np.inf).astype(f32)), f)


def half_op(op, elem, packed, args, sat=False):
    """op on f16/bf16 values held as bits (u16, or two per u32 when packed), rounded to nearest."""
    parts = []
    for k in range(2 if packed else 1):
        a = []
        for v in args:
            h = ((np.asarray(v).astype(u32) >> u32(16 * k)) & u32(0xFFFF)).astype(u16)
            a.append(h.view(f16).astype(f64) if elem == 'f16' else from_bf16(h).astype(f64))
        x, es = exact(op, a)
        if sat:
            x, es = np.where(np.isnan(x), 0.0, np.clip(x, 0.0, 1.0)), np.where((x < 0) | (x > 1), 0, es)
        if elem == 'f16':
            parts.append(np.asarray(round_to(x, es, 'rn', np.dtype(f16))).view(u16))
        else:
            parts.append(np.asarray(to_bf16(_round_odd_f32(x, es), 'rn')))
    r = (parts[1].astype(u32) << u32(16)) | parts[0].astype(u32) if packed else parts[0]
    return r[()] if r.ndim == 0 else r


def _pos0(v):
    return (v == 0) & ~np.signbit(v)


def approx(op, x):
    """The .approx functions. Computed accurately in the argument's precision."""
    with np.errstate(all='ignore'):
        one = x.dtype.type(1)
        return {'rcp': lambda: one / x, 'sqrt': lambda: np.sqrt(x), 'rsqrt': lambda: one / np.sqrt(x),
                'ex2': lambda: np.exp2(x), 'lg2': lambda: np.log2(x), 'sin': lambda: np.sin(x),
                'cos': lambda: np.cos(x), 'tanh': lambda: np.tanh(x)}[op]().astype(x.dtype)


# ---- conversions ----
def int_bounds(dt):
    info = np.iinfo(dt)
    return info.min, info.max


def float_to_int(x, irnd, dt):
    """cvt.{rni,rzi,rmi,rpi}.int.float: round to integral, then clamp to dt's range (NaN -> 0)."""
    x = np.asarray(x, f64)
    r = {'rni': np.rint, 'rzi': np.trunc, 'rmi': np.floor, 'rpi': np.ceil}[irnd](x)
    lo, hi = int_bounds(dt)
    if dt.itemsize < 8:
        out = np.clip(np.nan_to_num(r, nan=0.0), lo, hi).astype(dt)
    else:
        big, small = r >= float(hi) + 1.0 if dt.kind == 'u' else r >= 2.0 ** 63, r < float(lo)
        safe = np.where(big | small | np.isnan(r), 0.0, r)
        out = np.where(big, dt.type(hi), np.where(small, dt.type(lo), safe.astype(dt)))
        out = np.where(np.isnan(r), dt.type(0), out).astype(dt)
    return out[()] if out.ndim == 0 else out


def int_to_float(v, mode, dt):
    """cvt.{rn,rz,rm,rp}.float.int, exact for 64-bit integers too."""
    if v.dtype.itemsize <= 4:
        x = np.asarray(v, f64)
        return round_to(x, 0, mode, dt) if dt != f64 else x.astype(f64)[()] if x.ndim == 0 else x
    x = np.asarray(v).astype(f64)
    top = 2.0 ** 64 if v.dtype.kind == 'u' else 2.0 ** 63
    big = x >= top
    back = np.where(big, 0, x).astype(v.dtype)
    es = np.where(big, -1, (np.asarray(v) > back).astype(np.int8) - (np.asarray(v) < back))
    if dt == f64:
        r = round_f64(x, es, mode)
        return r[()] if np.ndim(r) == 0 else r
    return round_to(x, es, mode, dt)


def to_bf16(x, mode):
    """float32 -> bfloat16 bits (uint16), rn or rz."""
    b = np.asarray(x, f32).view(u32)
    nan = np.isnan(np.asarray(x, f32))
    if mode == 'rz':
        r = b >> u32(16)
    else:
        r = (b + u32(0x7FFF) + ((b >> u32(16)) & u32(1))) >> u32(16)
    r = np.where(nan, u32(0x7FFF), r).astype(u16)      # the canonical NaN, as sm_75 emulation gives too
    return r[()] if r.ndim == 0 else r


def from_bf16(b):
    r = (np.asarray(b).astype(u32) << u32(16)).view(f32)
    return r[()] if r.ndim == 0 else r


# ---- integers ----
def mulhi(a, b, dt):
    """High half of the 2n-bit product of n-bit ints."""
    n = dt.itemsize * 8
    if n <= 32:
        w = i64 if dt.kind == 'i' else u64
        return ((a.astype(w) * b.astype(w)) >> w(n)).astype(dt)
    ua, ub = a.view(u64) if dt.kind == 'i' else a, b.view(u64) if dt.kind == 'i' else b
    m32 = u64(0xFFFFFFFF)
    s32 = u64(32)
    al, ah, bl, bh = ua & m32, ua >> s32, ub & m32, ub >> s32
    ll, lh, hl, hh = al * bl, al * bh, ah * bl, ah * bh
    mid = (ll >> s32) + (lh & m32) + (hl & m32)
    hi = hh + (lh >> s32) + (hl >> s32) + (mid >> s32)
    if dt.kind == 'i':       # signed correction: hi -= (a<0)*b + (b<0)*a  (mod 2^64)
        hi = hi - np.where(a < 0, ub, u64(0)) - np.where(b < 0, ua, u64(0))
        return hi.view(i64)
    return hi


def wide(dt):
    return np.dtype({i16: i32, u16: u32, i32: i64, u32: u64}[dt.type])


def shift(a, s, left, dt):
    """shl/shr with PTX clamping: shifts >= width give 0 (or all sign bits for shr.s)."""
    n = dt.itemsize * 8
    s = np.asarray(s).astype(u32)
    big = s >= n
    sc = np.minimum(s, n - 1).astype(dt)
    if left:
        r = np.where(big, dt.type(0), a << sc)
    elif dt.kind == 'i':
        r = a >> sc
    else:
        r = np.where(big, dt.type(0), a >> sc)
    r = np.asarray(r).astype(dt)
    return r[()] if r.ndim == 0 else r


def int_div(a, b, dt, rem):
    """C division (truncating); x/0 gives all ones and x%0 gives x, as NVIDIA GPUs do."""
    with np.errstate(all='ignore'):
        if dt.kind == 'u':
            safe = np.where(b == 0, dt.type(1), b)
            r = np.where(b == 0, a if rem else dt.type(~dt.type(0)), a % safe if rem else a // safe)
        else:
            safe = np.where(b == 0, dt.type(1), b)
            minus1 = safe == dt.type(-1)      # avoid MIN / -1 overflow traps
            safe2 = np.where(minus1, dt.type(1), safe)
            r_ = np.fmod(a, safe2)
            q = (a - r_) // safe2
            q = np.where(minus1, (dt.type(0) - a).astype(dt), q)
            r_ = np.where(minus1, dt.type(0), r_)
            r = np.where(b == 0, a if rem else dt.type(-1), r_ if rem else q)
    r = np.asarray(r).astype(dt)
    return r[()] if r.ndim == 0 else r


def popc(a):
    a = np.asarray(a)
    n = a.dtype.itemsize
    u = a.view(UINT[n]).astype(u64)
    c = np.zeros(u.shape, u32)
    for sh in range(0, 8 * n, 8):
        c += _POP8[((u >> u64(sh)) & u64(0xFF)).astype(np.intp)]
    return c[()] if c.ndim == 0 else c


_POP8 = np.array([bin(i).count('1') for i in range(256)], u32)
_REV8 = np.array([int(f"{i:08b}"[::-1], 2) for i in range(256)], u64)


def brev(a):
    a = np.asarray(a)
    n = a.dtype.itemsize
    u = a.view(UINT[n]).astype(u64)
    r = np.zeros(u.shape, u64)
    for k in range(n):
        r |= _REV8[((u >> u64(8 * k)) & u64(0xFF)).astype(np.intp)] << u64(8 * (n - 1 - k))
    r = r.astype(UINT[n]).view(a.dtype)
    return r[()] if r.ndim == 0 else r


def msb(u, n):
    """Index of the highest set bit of unsigned u (n bits), -1 for zero."""
    u = np.asarray(u).astype(u64)
    r = np.full(u.shape, -1, np.int64)
    for sh in (32, 16, 8, 4, 2, 1):
        if sh >= n:
            continue
        hit = (u >> u64(sh)) != 0
        r = np.where(hit, r + sh, r)
        u = np.where(hit, u >> u64(sh), u)
    return np.where(u != 0, r + 1, -1)


def clz(a):
    n = a.dtype.itemsize * 8
    r = (n - 1 - msb(a.view(UINT[n // 8]), n)).astype(u32)
    return r[()] if r.ndim == 0 else r


def bfind(a, shiftamt):
    n = a.dtype.itemsize * 8
    u = a.view(UINT[n // 8])
    if a.dtype.kind == 'i':       # signed: find the highest bit that differs from the sign
        u = np.where(a < 0, ~u, u)
    p = msb(u, n)
    r = np.where(p < 0, 0xFFFFFFFF, (n - 1 - p) if shiftamt else p).astype(u32)
    return r[()] if r.ndim == 0 else r


def bfe(a, pos, ln, dt):
    n = dt.itemsize * 8
    ud = UINT[dt.itemsize]
    ua = np.asarray(a).view(ud).astype(u64)
    pos = np.asarray(pos).astype(u64) & u64(0xFF)
    ln = np.asarray(ln).astype(u64) & u64(0xFF)
    p = np.minimum(pos, u64(n))
    avail = np.minimum(ln, u64(n) - p)
    field = np.where(p >= n, u64(0), ua >> np.minimum(p, u64(n - 1)))
    mask = np.where(avail >= 64, ~u64(0), (u64(1) << np.minimum(avail, u64(63))) - u64(1))
    field &= mask
    if dt.kind == 'i':
        sbit = np.where(ln == 0, u64(0), (ua >> np.minimum(pos + ln - u64(1), u64(n - 1))) & u64(1))
        field = np.where((sbit == 1) & (avail < n), field | ~mask, field)
    r = field.astype(ud).view(dt) if n < 64 else field.view(ud).view(dt)
    return r[()] if np.ndim(r) == 0 else r


def bfi(a, b, pos, ln, dt):
    n = dt.itemsize * 8
    ud = UINT[dt.itemsize]
    ua, ub = np.asarray(a).view(ud).astype(u64), np.asarray(b).view(ud).astype(u64)
    pos = np.asarray(pos).astype(u64) & u64(0xFF)
    ln = np.asarray(ln).astype(u64) & u64(0xFF)
    avail = np.where(pos >= n, u64(0), np.minimum(ln, u64(n) - np.minimum(pos, u64(n))))
    fmask = np.where(avail >= 64, ~u64(0), (u64(1) << np.minimum(avail, u64(63))) - u64(1))
    ps = np.minimum(pos, u64(63))
    mask = np.where(avail == 0, u64(0), fmask << ps)
    r = ((ub & ~mask) | ((ua << ps) & mask)).astype(ud).view(dt)
    return r[()] if np.ndim(r) == 0 else r


def prmt(a, b, c):
    """prmt.b32 default mode: each selector nibble picks a byte of {b,a}, bit 3 replicates its sign."""
    pool = (np.asarray(b).astype(u64) << u64(32)) | np.asarray(a).astype(u64)
    c = np.asarray(c).astype(u64)
    r = np.zeros(np.broadcast(pool, c).shape, u64)
    for k in range(4):
        sel = (c >> u64(4 * k)) & u64(0xF)
        byte = (pool >> ((sel & u64(7)) * u64(8))) & u64(0xFF)
        byte = np.where((sel & u64(8)) != 0, np.where((byte & u64(0x80)) != 0, u64(0xFF), u64(0)), byte)
        r |= byte << u64(8 * k)
    r = r.astype(u32)
    return r[()] if r.ndim == 0 else r


def bmsk(a, b, clamp):
    """bmsk.{clamp,wrap}.b32: the mask of b bits from bit a, as the PTX ISA defines it (per lane)."""
    a, b = np.asarray(a).astype(u64), np.asarray(b).astype(u64)
    a1, b1 = a & u64(31), b & u64(31)
    s = a1 + b1
    full = u64(0xFFFFFFFF)
    mask0 = (full << a1) & full
    mask1 = np.where(s >= 32, u64(0), (full << np.minimum(s, u64(31))) & full)
    if clamp:
        mask0 = np.where(a >= 32, u64(0), mask0)
        mask1 = np.where(b >= 32, u64(0), mask1)
    mask1 = np.where((s < 32) & (b1 == 0) & ~(clamp & (b >= 32)), full, mask1)
    r = (mask0 & ~mask1 & full).astype(u32)
    return r[()] if r.ndim == 0 else r


def lop3(a, b, c, lut):
    r = np.zeros(np.broadcast(a, b, c).shape, a.dtype)
    for i in range(8):
        if lut >> i & 1:
            r |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
    return r[()] if r.ndim == 0 else r


# ---- atomics ----
_SMALL = 64


def atomic(arr, idx, fn, ufunc, b, c=None):
    """Apply `cur = fn(cur, b, c)` for every lane at arr[idx], serialised in lane order.

    Returns each lane's old value. Exact under any contention: groups of lanes hitting the
    same element are processed rank by rank (small groups) or by ufunc.accumulate (big ones).
    """
    n = len(idx)
    old = np.empty(n, arr.dtype)
    if n == 0:
        return old
    b = np.broadcast_to(b, (n,))
    c = None if c is None else np.broadcast_to(c, (n,))
    order = np.argsort(idx, kind='stable')
    si, sb = idx[order], b[order]
    sc = None if c is None else c[order]
    start = np.ones(n, bool)
    start[1:] = si[1:] != si[:-1]
    gstart = np.flatnonzero(start)
    gid = np.cumsum(start) - 1
    gsize = np.diff(np.append(gstart, n))
    rank = np.arange(n) - gstart[gid]
    sold = np.empty(n, arr.dtype)
    if ufunc is np.add and arr.dtype.kind in 'iu':          # exact segmented prefix sums
        cs = np.cumsum(sb.astype(np.uint64 if arr.dtype.kind == 'u' else np.int64))
        base = (cs[gstart] - sb[gstart].astype(cs.dtype))
        init = arr[si[gstart]]
        sold[:] = (init[gid].astype(cs.dtype) + (cs - sb.astype(cs.dtype) - base[gid])).astype(arr.dtype)
        end = gstart + gsize - 1
        arr[si[gstart]] = (init.astype(cs.dtype) + cs[end] - base).astype(arr.dtype)
    else:
        big = gsize[gid] > _SMALL
        if big.any() and ufunc is not None:
            for g in np.flatnonzero(gsize > _SMALL):
                s, e = gstart[g], gstart[g] + gsize[g]
                k = si[s]
                if ufunc == 'exch':
                    seq = np.concatenate(([arr[k]], sb[s:e]))
                else:
                    seq = ufunc.accumulate(np.concatenate(([arr[k]], sb[s:e])).astype(arr.dtype), dtype=arr.dtype)
                sold[s:e] = seq[:-1]
                arr[k] = seq[-1]
        elif big.any():
            for g in np.flatnonzero(gsize > _SMALL):
                s, e = gstart[g], gstart[g] + gsize[g]
                k = si[s]
                if sc is not None:              # cas: the value only changes at a success; jump between them
                    j, cur = s, arr[k]
                    while j < e:
                        hit = np.flatnonzero(sb[j:e] == cur)
                        stop = e if not len(hit) else j + hit[0]
                        sold[j:stop + (stop < e)] = cur
                        if stop < e:
                            cur = sc[stop]
                        j = stop + 1
                    arr[k] = cur
                    continue
                for j in range(s, e):
                    cur = arr[k:k + 1]
                    sold[j] = cur[0]
                    arr[k] = fn(cur, sb[j:j + 1], None)[0]
        small = ~big
        for r in range(min(int(rank[small].max(initial=-1)) + 1, _SMALL + 1)):
            sel = np.flatnonzero(small & (rank == r))
            if not len(sel):
                break
            k = si[sel]
            cur = arr[k]
            sold[sel] = cur
            arr[k] = fn(cur, sb[sel], None if sc is None else sc[sel])
    old[order] = sold
    return old


def atom_fn(op, dt):
    """(fn(cur, b, c) -> new, accumulate ufunc or None) for atom/red operation `op`."""
    t = dt.type
    if op == 'add':
        return (lambda cur, b, c: (cur + b).astype(dt)), np.add
    if op == 'min':
        return (lambda cur, b, c: np.minimum(cur, b)), (np.fmin if dt.kind == 'f' else np.minimum)
    if op == 'max':
        return (lambda cur, b, c: np.maximum(cur, b)), (np.fmax if dt.kind == 'f' else np.maximum)
    if op == 'and':
        return (lambda cur, b, c: cur & b), np.bitwise_and
    if op == 'or':
        return (lambda cur, b, c: cur | b), np.bitwise_or
    if op == 'xor':
        return (lambda cur, b, c: cur ^ b), np.bitwise_xor
    if op == 'exch':
        return (lambda cur, b, c: b.astype(dt)), 'exch'
    if op == 'cas':
        return (lambda cur, b, c: np.where(cur == b, c, cur).astype(dt)), None
    if op == 'inc':
        return (lambda cur, b, c: np.where(cur >= b, t(0), cur + t(1)).astype(dt)), None
    if op == 'dec':
        return (lambda cur, b, c: np.where((cur == 0) | (cur > b), b, cur - t(1)).astype(dt)), None
    raise KeyError(op)


# ---- printf ----
_FMT = re.compile(r'%([-+ #0]*)(\*|\d+)?(?:\.(\*|\d+))?(hh|h|ll|l|j|z|t|L)?([diouxXeEfFgGaAcspn%])')


def format_printf(fmt, read_arg, read_str):
    """C printf formatting. read_arg(offset, size, kind) -> value reads the packed argument buffer,
    each argument at its natural alignment; read_str(addr) reads a NUL-terminated string."""
    out, pos, off = [], 0, 0

    def arg(size, kind):
        nonlocal off
        off = -(-off // size) * size
        v = read_arg(off, size, kind)
        off += size
        return v

    for m in _FMT.finditer(fmt):
        out.append(fmt[pos:m.start()])
        pos = m.end()
        flags, width, prec, length, conv = m.groups()
        if conv == '%':
            out.append('%')
            continue
        if width == '*':
            width = str(arg(4, 'i'))
        if prec == '*':
            prec = str(arg(4, 'i'))
        spec = '%' + flags + (width or '') + ('.' + prec if prec is not None else '')
        if conv in 'di':
            v = arg(8 if length in ('l', 'll', 'j', 'z', 't') else 4, 'i')
            out.append((spec + 'd') % v)
        elif conv in 'ouxX':
            v = arg(8 if length in ('l', 'll', 'j', 'z', 't') else 4, 'u')
            out.append((spec + (conv if conv != 'u' else 'd')) % v)
        elif conv in 'eEfFgG':
            out.append((spec + conv) % arg(8, 'f'))
        elif conv in 'aA':
            s = float(arg(8, 'f')).hex()
            out.append(s.upper() if conv == 'A' else s)
        elif conv == 'c':
            out.append((spec + 'c') % chr(arg(4, 'u') & 0xFF))
        elif conv == 's':
            a = arg(8, 'u')
            out.append((spec + 's') % (read_str(a) if a else '(null)'))
        elif conv == 'p':
            out.append((spec + 's') % f"0x{arg(8, 'u'):x}")
        # %n writes nothing here: device printf does not support it
    out.append(fmt[pos:])
    return ''.join(out)


# ---- mbarrier (cuda::barrier) ----
# The 64-bit object in shared memory: pending arrivals in bits 0-31, the expected count in 32-62,
# the phase in bit 63; an arrival's state token is the phase it arrived in (bit 63). The compiled
# engine's crt.py keeps the same layout.
MB_PHASE = 1 << 63


def mb_init(count):
    count &= 0x7FFFFFFF
    return count | count << 32


def mb_arrive(word, n=1, drop=False):
    """(new word, state token) after n arrivals (arrive_drop: the expected count drops by n too)."""
    phase, pending, expected = word & MB_PHASE, word & 0xFFFFFFFF, (word >> 32) & 0x7FFFFFFF
    if drop:
        expected = max(expected - n, 0)
    pending = max(pending - n, 0)
    if pending == 0:                            # the phase completes: the next one starts
        phase ^= MB_PHASE
        pending = expected
    return phase | expected << 32 | pending, word & MB_PHASE


def mb_done(word, state, parity):
    """Whether the phase that state (a token, or with parity a phase parity) names has completed."""
    if parity:
        return (word >> 63) != (state & 1)
    return (word & MB_PHASE) != (state & MB_PHASE)
