"""The emu backend's PTX interpreter, on real nvcc output (tests/kernels/*.cu), against NumPy references."""
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import numpy as np
import pytest

from phos.gpu_server.backends.ptx import TRAP_STATUS, parse_module
from phos.schema.cuda_types import CudaError, CUresult
from ptx_helpers import ARCHS, KERNELS, NVCC, Device, compile_ptx

arch = pytest.mark.parametrize("arch", ARCHS)
rng = np.random.default_rng(1234)


@pytest.fixture(scope="session", autouse=True)
def precompile():
    """Compile every kernel for every arch up front, in parallel (nvcc is most of a cold run)."""
    if NVCC is None:
        return                  # tests that need a kernel skip themselves; hand-written PTX still runs
    jobs = [(p.name, a) for p in sorted(KERNELS.glob("*.cu")) for a in ARCHS]
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda j: compile_ptx(*j), jobs))


# kernels the compiler still leaves to the interpreter (each by the construct it refuses): none
INTERPRETED = set()


@pytest.fixture(params=["interpreter", "compiler"], autouse=True)
def engine(request, monkeypatch, caplog):
    """Every test runs on both engines: the same kernels must give the same results. On the
    compiler, a kernel it refuses (and the interpreter runs) must be one INTERPRETED names."""
    monkeypatch.setenv("PHOS_EMU_COMPILER", "1" if request.param == "compiler" else "0")
    with caplog.at_level(logging.WARNING, logger="phos.gpu_server.backends.ptx.compiler"):
        yield request.param
    said = [r.getMessage() for r in caplog.get_records("call") if "runs in the PTX interpreter" in r.getMessage()]
    assert {m.split("'")[1] for m in said} <= INTERPRETED, said


@pytest.fixture
def dev():
    return Device(1 << 28)


def raises(status, fn, *match):
    with pytest.raises(CudaError) as e:
        fn()
    assert e.value.status == status, e.value
    for m in match:
        assert m in str(e.value), e.value
    return e.value


# ---------------------------------------------------------------- exact references
def rnd(v, mode, dt):
    """Exact value v (Fraction) rounded to float dtype dt with mode rn/rz/rd/ru."""
    dt = np.dtype(dt).type
    with np.errstate(over="ignore"):
        f = dt(float(v))
        if not np.isfinite(f) and mode == "rn":     # overflow
            return f
        cands = {dt(f), np.nextafter(f, dt(-np.inf)), np.nextafter(f, dt(np.inf))}
    cands = sorted((Fraction(float(c)), c) for c in cands if np.isfinite(c))
    if mode == "rn":
        best = min(cands, key=lambda c: (abs(c[0] - v), int(np.array(c[1]).view(f"u{np.dtype(dt).itemsize}")) & 1))
        return best[1]
    if mode == "rz":
        mode = "rd" if v >= 0 else "ru"
    if mode == "rd":
        return max(c for c in cands if c[0] <= v)[1]
    return min(c for c in cands if c[0] >= v)[1]


def f2i(x, mode, lo, hi):
    """cvt float -> int: round to integral, saturate, NaN -> 0."""
    if math.isnan(x):
        return 0
    if math.isinf(x):
        return hi if x > 0 else lo
    r = {"rn": lambda: round(Fraction(x)), "rz": lambda: math.trunc(x), "rd": lambda: math.floor(x),
         "ru": lambda: math.ceil(x)}[mode]()
    return min(max(int(r), lo), hi)


def bits(x, dt=np.float32):
    return int(np.array(x, dt).view(f"i{np.dtype(dt).itemsize}"))


def wrap32(v):
    return (int(v) + 2 ** 31) % 2 ** 32 - 2 ** 31


# ---------------------------------------------------------------- kernels
@arch
def test_vector_add_and_saxpy(dev, arch):
    mod = dev.load("vecadd.cu", arch)
    n = 10_000
    a, b = rng.random(n, np.float32), rng.random(n, np.float32)
    pa, pb, pc = dev.array(a), dev.array(b), dev.zeros(n + 64)
    dev.launch(mod, "vec_add", -(-n // 256), 256, pa, pb, pc, n)
    out = dev.read(pc, n + 64)
    np.testing.assert_array_equal(out[:n], a + b)
    assert not out[n:].any()                         # the bounds guard held
    dev.launch(mod, "saxpy", 7, 96, np.float32(2.5), pa, pb, n)     # grid-stride loop
    np.testing.assert_allclose(dev.read(pb, n), np.float32(2.5) * a + b, rtol=1e-6)


@arch
@pytest.mark.parametrize("shape", [(256, 256, 256), (37, 29, 50)])
def test_tiled_matmul(dev, arch, shape):
    M, N, K = shape
    mod = dev.load("matmul.cu", arch)
    A, B = rng.random((M, K), np.float32), rng.random((K, N), np.float32)
    pa, pb, pc = dev.array(A), dev.array(B), dev.zeros(M * N)
    dev.launch(mod, "matmul", (-(-N // 16), -(-M // 16), 1), (16, 16, 1), pa, pb, pc, M, N, K)
    np.testing.assert_allclose(dev.read(pc, M * N).reshape(M, N), A.astype(np.float64) @ B, rtol=1e-5)


@arch
def test_reduction_shared_and_shuffles(dev, arch):
    mod = dev.load("reduce.cu", arch)
    n = (1 << 16) + 123
    x = rng.random(n, np.float32)
    px, po = dev.array(x), dev.zeros(1)
    dev.launch(mod, "reduce_sum", 40, 256, px, po, n, shared=256 * 4)
    assert dev.read(po, 1)[0] == pytest.approx(x.astype(np.float64).sum(), rel=1e-5)
    xi = rng.integers(-1000, 1000, n, dtype=np.int32)
    blocks = -(-n // 256)
    px, pp = dev.array(xi), dev.zeros(blocks, np.int32)
    dev.launch(mod, "reduce_int", blocks, 256, px, pp, n)
    ref = np.add.reduceat(xi, np.arange(0, n, 256))
    np.testing.assert_array_equal(dev.read(pp, blocks, np.int32), ref)


@arch
def test_histogram_atomics(dev, arch):
    mod = dev.load("histogram.cu", arch)
    n = 50_000
    data = np.concatenate([rng.integers(0, 256, n - 5000), np.full(5000, 7)]).astype(np.uint8)  # one hot bin
    pd, pb = dev.array(data), dev.zeros(256, np.uint32)
    dev.launch(mod, "histogram", 24, 256, pd, pb, n)
    np.testing.assert_array_equal(dev.read(pb, 256, np.uint32), np.bincount(data, minlength=256))


@arch
def test_every_atomic_under_contention(dev, arch):
    mod = dev.load("histogram.cu", arch)
    blocks, bd = 6, 128
    T = blocks * bd
    iv, uv = dev.array(np.zeros(7, np.int32)), dev.array(np.array([0xFFFFFFFF, 0, 0, 0, 0, 0], np.uint32))
    fv, dv = dev.zeros(1), dev.zeros(1, np.float64)
    ull = dev.array(np.array([0, 1 << 40], np.uint64))
    old = dev.zeros(T, np.int32)
    dev.launch(mod, "atomics", blocks, bd, iv, uv, fv, dv, ull, old)
    t = np.arange(T)
    i = dev.read(iv, 7, np.int32)
    assert list(i[:4]) == [t.sum(), -T, -(T - 1), T - 1]
    assert list(i[5:]) == [blocks * 2 * bd, blocks * (bd - 1)]
    u = dev.read(uv, 6, np.uint32)
    xor = 0
    for k in t:
        xor ^= 1 << (k % 7)
    dec = 0
    for _ in t:
        dec = 50 if dec == 0 or dec > 50 else dec - 1
    assert list(u[:5]) == [0, 0xFFFFFFFF, xor, T % 101, dec]
    assert 0 <= u[5] < T                                  # exch: some thread's value
    assert dev.read(fv, 1)[0] == T and dev.read(dv, 1, np.float64)[0] == 0.5 * T
    assert list(dev.read(ull, 2, np.uint64)) == [3 * T, 1000]
    olds, final = dev.read(old, T, np.int32), i[4]        # CAS: the successes form one chain 1..final
    assert {k for k in t if olds[k] == k - 1} == set(range(1, final + 1))


@arch
def test_prefix_scans(dev, arch):
    mod = dev.load("scan.cu", arch)
    x = rng.integers(-100, 100, 1000, dtype=np.int32)
    px, po = dev.array(x), dev.zeros(1000, np.int32)
    dev.launch(mod, "scan_block", 1, 1024, px, po, 1000)
    np.testing.assert_array_equal(dev.read(po, 1000, np.int32), np.cumsum(x))
    n = 3000
    x = rng.integers(-100, 100, n, dtype=np.int32)
    px, po = dev.array(x), dev.zeros(n, np.int32)
    dev.launch(mod, "scan_warp", -(-n // 512), 512, px, po, n)
    ref = np.concatenate([np.cumsum(x[k:k + 512]) for k in range(0, n, 512)])
    np.testing.assert_array_equal(dev.read(po, n, np.int32), ref)


@arch
def test_divergent_loops(dev, arch):
    mod = dev.load("divergent.cu", arch)
    n = 700
    s = np.concatenate([[0, 1, 2, 27, 97], rng.integers(1, 5000, n - 5)]).astype(np.uint32)
    ps, pst, ppk = dev.array(s), dev.zeros(n, np.uint32), dev.zeros(n, np.uint32)
    dev.launch(mod, "collatz", 3, 256, ps, pst, ppk, n)
    steps, peaks = [], []
    for x in map(int, s):
        c, hi = 0, x
        while x not in (0, 1):
            if x & 1:
                x = 3 * x + 1
                hi = max(hi, x)
            else:
                x >>= 1
            c += 1
        steps.append(c)
        peaks.append(hi & 0xFFFFFFFF)
    np.testing.assert_array_equal(dev.read(pst, n, np.uint32), steps)
    np.testing.assert_array_equal(dev.read(ppk, n, np.uint32), peaks)

    v = rng.integers(-300, 300, n, dtype=np.int32)
    pv, po = dev.array(v), dev.zeros(n, np.int32)
    dev.launch(mod, "branchy", 3, 256, pv, po, n)
    ref = []
    for x in map(int, v):
        acc = 0
        for k in range(x & 63):
            if k % 3 == 0:
                continue
            if acc > 400:
                break
            acc += k * (1 if x > 0 else -1)
        if x < 0:
            ref.append(-acc)
            continue
        acc = [acc + 10, acc * 3, acc - 7, acc ^ 0x55, ~acc][int(math.fmod(x, 5))]
        ref.append(acc)
    np.testing.assert_array_equal(dev.read(po, n, np.int32), ref)


@arch
def test_struct_by_value(dev, arch):
    mod = dev.load("structs.cu", arch)
    assert mod.kernels["by_value"].params == [(0, 8), (8, 8), (16, 4), (24, 32), (56, 1), (64, 8)]
    st = np.dtype([("scale", "f4"), ("offset", "f8"), ("idx", "i4", 3)], align=True)
    assert st.itemsize == 32
    p = np.array([(1.5, 0.25, [3, -4, 5])], st)
    n = 300
    x = rng.random(n, np.float32)
    px, po = dev.array(x), dev.zeros(n)
    dev.launch(mod, "by_value", 2, 256, px, po, n, p.tobytes(), np.int8(-3), np.float64(0.5))
    i = np.arange(n)
    ref = x * np.float32(1.5) + np.float32(0.25) + np.array([3, -4, 5])[i % 3] - 3 + 0.5
    np.testing.assert_allclose(dev.read(po, n), ref, rtol=1e-6)


@arch
def test_noinline_device_functions(dev, arch):
    mod = dev.load("devfunc.cu", arch)
    n = 200
    x = rng.random(n, np.float32)
    px, po, pi = dev.array(x), dev.zeros(n), dev.zeros(3 * n, np.int32)
    dev.launch(mod, "use_funcs", 2, 128, px, po, pi, n)

    def poly(v, deg):
        r = np.float32(0)
        for k in range(deg + 1):
            r = np.float32(np.float64(r) * np.float64(v) + (k + 1))
        return r
    i = np.arange(n)
    y = np.array([poly(v, k % 4) for k, v in enumerate(x)], np.float32)
    np.testing.assert_allclose(dev.read(po, n), y + 2 * i.astype(np.float32), rtol=1e-6)
    io = dev.read(pi, 3 * n, np.int32).reshape(n, 3)
    np.testing.assert_array_equal(io[:, 0], (x * np.float32(2)).astype(np.int32))
    d2 = np.where(i % 10 > 5, i % 10 + 2, (i % 10) * 7)
    np.testing.assert_array_equal(io[:, 1], np.where(i & 1, d2, -1))
    np.testing.assert_array_equal(io[:, 2], i * i)


@arch
def test_double_precision(dev, arch):
    mod = dev.load("double.cu", arch)
    n = 257
    x = rng.uniform(-100, 100, n)
    y = rng.uniform(0.5, 10, n) * rng.choice([-1, 1], n)
    px, py, po, pi = dev.array(x), dev.array(y), dev.zeros(4 * n, np.float64), dev.zeros(2 * n, np.int64)
    dev.launch(mod, "dbl", 2, 256, px, py, po, pi, n)
    out = dev.read(po, 4 * n, np.float64).reshape(n, 4)
    np.testing.assert_allclose(out[:, 0], x * y + x / y - np.sqrt(np.abs(x)), rtol=1e-13)
    np.testing.assert_allclose(out[:, 1], (x * y + 1.0) / (1.0 + y * y), rtol=1e-13)
    np.testing.assert_allclose(out[:, 2], np.minimum(x, y) + np.maximum(x, y) * 0.25 + x.astype(np.float32), rtol=1e-13)
    np.testing.assert_allclose(out[:, 3], 1.0 / x + 1.0 / np.sqrt(np.abs(y) + 1.0), rtol=1e-12)
    io = dev.read(pi, 2 * n, np.int64).reshape(n, 2)
    np.testing.assert_array_equal(io[:, 0], np.trunc(x * 1000.0).astype(np.int64))
    xb = x.view(np.int64)
    np.testing.assert_array_equal(io[:, 1], np.rint(y * 3.5).astype(np.int64) + np.fmod(xb, 1000))


@arch
def test_illegal_addresses(dev, arch):
    mod = dev.load("faults.cu", arch)
    out = dev.zeros(64)
    raises(CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, lambda: dev.launch(mod, "oob_write", 2, 64, out, 64, 1000), "oob_write")
    raises(CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, lambda: dev.launch(mod, "null_read", 1, 32, 0, out), "0x0")
    raises(CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, lambda: dev.launch(mod, "oob_shared", 1, 64, out, 64), "shared")
    dev.launch(mod, "oob_shared", 1, 64, out, 0)     # in bounds
    np.testing.assert_array_equal(dev.read(out, 64, np.int32), np.arange(64))


@arch
def test_trap_and_assert(dev, arch):
    mod = dev.load("faults.cu", arch)
    out = dev.zeros(64, np.int32)
    raises(TRAP_STATUS, lambda: dev.launch(mod, "trap_kernel", 1, 64, out, 3), "trap_kernel")
    assert TRAP_STATUS == CUresult.CUDA_ERROR_LAUNCH_FAILED      # what the H200 reports for __trap()
    dev.launch(mod, "trap_kernel", 1, 64, out, 999)
    assert (dev.read(out, 64, np.int32) == 1).all()
    raises(CUresult.CUDA_ERROR_ASSERT, lambda: dev.launch(mod, "assert_kernel", 1, 64, out, 5))
    assert "block: [0,0,0], thread: [5,0,0] Assertion `threadIdx.x != bad` failed." in dev.printed[-1]
    dev.launch(mod, "assert_kernel", 1, 64, out, -1)
    assert (dev.read(out, 64, np.int32) == 2).all()


@arch
def test_printf(dev, arch):
    mod = dev.load("printf.cu", arch)
    dev.launch(mod, "hello", 2, 3, 10, np.float32(1.5), np.float64(12345.678))
    want = [f"block {b} thread {t}: base={10 + t} f={1.5 * t:f} d=1.235e+04 x={255 + t:x} ll=-1234567890123 "
            f"s=str c={chr(65 + t)}%\n" for b in range(2) for t in range(3)]
    want += ["only zero  3.14|7   |0042|1e-05\n"] * 2
    assert sorted(dev.printed) == sorted(want)
    assert dev.printed[:3] == want[:3]                  # thread order within a block


@arch
def test_integer_ops(dev, arch):
    mod = dev.load("intops.cu", arch)
    edge = [0, 1, -1, 2 ** 31 - 1, -2 ** 31 + 1, 12345, -98765, 255, 1 << 16, 7]
    n = 300
    a = np.concatenate([edge, rng.integers(-2 ** 31 + 1, 2 ** 31 - 1, n - len(edge))]).astype(np.int32)
    b = np.concatenate([edge[::-1], rng.integers(-2 ** 31 + 1, 2 ** 31 - 1, n - len(edge))]).astype(np.int32)
    b[20:40] = rng.integers(-40, 40, 20)             # small divisors and shift counts
    pa, pb, po, pw = dev.array(a), dev.array(b), dev.zeros(24 * n, np.uint32), dev.zeros(4 * n, np.int64)
    dev.launch(mod, "intops", 2, 256, pa, pb, po, pw, n)
    out, wide = dev.read(po, 24 * n, np.uint32).reshape(n, 24), dev.read(pw, 4 * n, np.int64).reshape(n, 4)
    M32, M64 = 2 ** 32 - 1, 2 ** 64 - 1

    def cdiv(p, q):
        return abs(p) // abs(q) * (1 if (p < 0) == (q < 0) else -1)
    for i in range(n):
        x, y = int(a[i]), int(b[i])
        ux, uy = x & M32, y & M32
        perm = 0x5140 + (i & 0x0303)
        pool = (uy << 32) | ux
        sx24, sy24 = ((x & 0xFFFFFF) ^ 0x800000) - 0x800000, ((y & 0xFFFFFF) ^ 0x800000) - 0x800000
        sh = uy & 63
        ref = [
            (x * y) >> 32, (ux * uy) >> 32, int(f"{ux:032b}"[::-1], 2), bin(ux).count("1"),
            32 - ux.bit_length(), sum(((pool >> (8 * ((perm >> 4 * k) & 7))) & 0xFF) << 8 * k for k in range(4)),
            cdiv(x, y) if y else 0, (x - cdiv(x, y) * y) if y else 0, ux // uy if uy else 0, ux % uy if uy else 0,
            x >> (uy & 31), ux >> (uy & 31), ux << (uy & 31), (ux >> 5) & 0x3FF, (ux & ~0xFF0) | ((uy << 4) & 0xFF0),
            (ux & -ux).bit_length(), bin((ux << 32) | uy).count("1"), 64 - (x & M64).bit_length(), abs(x - y) + 7,
            sx24 * sy24, ((pool << (sh & 31)) >> 32), pool >> min(sh, 32),
            min(x, y) ^ max(x, y) ^ min(ux, uy) ^ abs(x), (x == 0) + (x < y) * 2 + (ux < uy) * 4 + (x == y) * 8,
        ]
        np.testing.assert_array_equal(out[i], [r & M32 for r in ref], err_msg=f"row {i}: x={x} y={y}")
        X, Y = x * 0x10001, y * 0x7FFF1
        wref = [x * y, ux * uy, (X * Y) >> 64,
                ((X & M64) * (Y & M64) >> 64) + (cdiv(x * 12345, y) if y else 0) + (x >> 40) + ((x & M64) >> 60)]
        np.testing.assert_array_equal(wide[i], [((r + 2 ** 63) & M64) - 2 ** 63 for r in wref], err_msg=f"row {i}")


@arch
def test_narrow_integers(dev, arch):
    mod = dev.load("intops.cu", arch)
    n = 256
    sc = rng.integers(-128, 128, n).astype(np.int8)
    uc = rng.integers(0, 256, n).astype(np.uint8)
    ss = rng.integers(-2 ** 15, 2 ** 15, n).astype(np.int16)
    psc, puc, pss, pus, po = dev.array(sc), dev.array(uc), dev.array(ss), dev.zeros(n, np.uint16), dev.zeros(4 * n, np.int32)
    dev.launch(mod, "narrow", 1, 256, psc, puc, pss, pus, po, n)
    a, b, c = sc.astype(np.int64), uc.astype(np.int64), ss.astype(np.int64)
    ref = np.stack([a, b, ((c * 3 + 2 ** 15) % 2 ** 16 - 2 ** 15) + a * b, ((a + b + 128) % 256 - 128) >> 1], 1)
    np.testing.assert_array_equal(dev.read(po, 4 * n, np.int32).reshape(n, 4), ref)
    np.testing.assert_array_equal(dev.read(pus, n, np.uint16), (c * a + b) % 2 ** 16)


@arch
def test_conversions_rounding_saturation(dev, arch):
    mod = dev.load("cvt.cu", arch)
    special = [np.nan, np.inf, -np.inf, 0.5, 1.5, 2.5, -0.5, -2.5, -0.0, 3e9, -3e9, 1e10, 4.3e9, 255.5, 256.0,
               -1.0, 1e-40, 65519.0, 65520.0, 1e5, 0.999, 1.0000001, 2 ** 24 + 1, -129.7]
    n = 200
    x = np.concatenate([special, rng.uniform(-300, 300, n - len(special))]).astype(np.float32)
    xd = np.concatenate([[1e10, -1e10, 0.5, 2.5, 1e300, -1e-300, 5e9, 1 / 3, -2 / 3, 65504.1, 1e-8],
                         rng.uniform(-1e6, 1e6, n - 11)])
    px, pxd, po, pf, ph = dev.array(x), dev.array(xd), dev.zeros(16 * n, np.int32), dev.zeros(8 * n), dev.zeros(2 * n, np.uint16)
    dev.launch(mod, "conversions", 1, 256, px, pxd, po, pf, ph, n)
    o = dev.read(po, 16 * n, np.int32).reshape(n, 16)
    g = dev.read(pf, 8 * n).reshape(n, 8)
    h = dev.read(ph, 2 * n, np.uint16).reshape(n, 2)
    I32, U32, I64 = (-2 ** 31, 2 ** 31 - 1), (0, 2 ** 32 - 1), (-2 ** 63, 2 ** 63 - 1)
    for i in range(n):
        f, d = float(x[i]), float(xd[i])
        fm = float(np.float32(x[i]) * np.float32(1e6))
        ll = f2i(d * 1e12, "rz", *I64)
        ref = [f2i(f, "rn", *I32), f2i(f, "rz", *I32), f2i(f, "rd", *I32), f2i(f, "ru", *I32), f2i(f, "rn", *U32),
               f2i(f, "rz", *I32), f2i(f, "rz", *U32) & 0xFF, f2i(fm, "rz", *I64), f2i(d, "rn", *I32),
               f2i(d, "ru", *U32), bits(rnd(Fraction(wrap32(i * 16777217)), "rz", np.float32)),
               bits(rnd(Fraction(0xFFFFFFFF - i), "rd", np.float32)),
               bits(rnd(Fraction(d), "rz", np.float32)) if abs(d) < 1e38 else o[i, 12],
               bits(rnd(Fraction(d), "ru", np.float32)) if abs(d) < 1e38 else o[i, 13],
               bits(rnd(Fraction(ll), "rn", np.float32)), (f2i(f, "rz", *I32) + 128) % 256 - 128]
        np.testing.assert_array_equal(o[i], [wrap32(r) for r in ref], err_msg=f"row {i}: f={f!r} d={d!r}")
        fz = 0.0 if math.isnan(f) else f
        with np.errstate(over="ignore"):
            half = np.float32(np.float16(x[i]))
        gref = [min(max(fz, 0.0), 1.0), np.rint(x[i]), np.trunc(x[i]), np.floor(x[i]), np.ceil(x[i]), half,
                np.float32(rnd(Fraction(f), "rz", np.float16)) if np.isfinite(f) and abs(f) < 65504 else g[i, 6],
                float(f2i(abs(f), "rz", *U32))]
        np.testing.assert_array_equal(g[i], np.array(gref, np.float32), err_msg=f"row {i}: f={f!r}")
        with np.errstate(over="ignore"):
            href = [np.array(np.float16(x[i])).view(np.uint16), np.array(np.float16(xd[i])).view(np.uint16)]
        np.testing.assert_array_equal(h[i], href, err_msg=f"row {i}")
    assert g[16, 6] == 0 and h[0, 0] & 0x7C00 == 0x7C00    # subnormal f32 -> 0 in half; NaN stays NaN


@arch
def test_fast_math(dev, arch):
    mod = dev.load("math.cu", arch)
    n = 256
    v = np.concatenate([[1.0, 4.0, 0.5, 2.0], rng.uniform(0.1, 50, n - 4)]).astype(np.float32)
    pv, po = dev.array(v), dev.zeros(12 * n)
    dev.launch(mod, "fastmath", 1, 256, pv, po, n)
    o = dev.read(po, 12 * n).reshape(n, 12)
    assert o.dtype == np.float32
    v64 = v.astype(np.float64)
    np.testing.assert_array_equal(o[:, 0], np.sqrt(v))                     # sqrt.rn: exact
    np.testing.assert_allclose(o[:, 1], 1 / np.sqrt(v64), rtol=2e-7)
    np.testing.assert_allclose(o[:, 2], np.exp(v64 * 0.1), rtol=2e-6)
    np.testing.assert_allclose(o[:, 3], np.log(v64), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(o[:, 4], np.sin(v64), atol=2e-6)
    np.testing.assert_allclose(o[:, 5], np.cos(v64), atol=2e-6)
    np.testing.assert_array_equal(o[:, 6], np.float32(1) / v)              # rcp.rn: exact
    np.testing.assert_allclose(o[:, 7], np.exp2(v64 * 0.1), rtol=2e-6)
    np.testing.assert_allclose(o[:, 8], v64 / 3, rtol=2e-7)
    np.testing.assert_array_equal(o[:, 9], [rnd(Fraction(float(a)) ** 2 - 1, "rn", np.float32) for a in v])  # fma: exact
    np.testing.assert_array_equal(o[:, 10], np.minimum(v, 2) + np.maximum(v, 3) + v - 1)
    ref = np.exp(v64 * 0.05) + np.log(v64) + np.sin(v64) + np.tanh(v64 * 0.01) + np.sqrt(v64)
    np.testing.assert_allclose(o[:, 11], ref, rtol=1e-5)


@arch
def test_libm_full_precision(dev, arch):
    mod = dev.load("mathlib.cu", arch)
    n = 256
    x = np.concatenate([[1e6, 1e20, -3e30, 0.5, 3.14159265, 1e-30, 100.0, 1e9], rng.uniform(-1e4, 1e4, n - 8)]).astype(np.float32)
    y = np.concatenate([[1e6, 1e300, -1e-300, 0.5, np.pi, 1e15, 100.0, -7.0], rng.uniform(-1e4, 1e4, n - 8)])
    px, py, pf, pd = dev.array(x), dev.array(y), dev.zeros(4 * n), dev.zeros(6 * n, np.float64)
    dev.launch(mod, "libm", 2, 128, px, py, pf, pd, n)
    fo, do = dev.read(pf, 4 * n).reshape(n, 4), dev.read(pd, 6 * n, np.float64).reshape(n, 6)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(fo[:, 0], np.sin(x64), atol=2e-7)         # sinf(1e20) needs the slow path
    np.testing.assert_allclose(fo[:, 1], np.cos(x64), atol=2e-7)
    np.testing.assert_allclose(fo[:, 2], np.tan(x64), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(fo[:, 3], [math.erf(v * 1e-6) for v in x64], atol=1e-7)
    with np.errstate(all="ignore"):
        ref = np.stack([np.exp(y * 1e-3), np.log(np.abs(y) + 1), (np.abs(y) + 1) ** 0.37, np.sin(y), np.cbrt(y),
                        np.arctan2(y, 3.0)], 1)
    np.testing.assert_allclose(do, ref, rtol=1e-15)
    raises(CUresult.CUDA_ERROR_INVALID_VALUE, lambda: dev.launch(mod, "libm", 1, 256, px, py, pf, pd, n), ".maxntid")


@arch
def test_directed_rounding_intrinsics(dev, arch):
    mod = dev.load("math.cu", arch)
    n = 256
    x = rng.standard_normal(n).astype(np.float32) * np.float32(100)
    y = rng.standard_normal(n).astype(np.float32)
    y[:8] = [1, 3, -3, 7, 0.1, -0.1, 1e-3, 2]
    dx = rng.standard_normal(n) * 1e3
    px, py, po, pdx, pdo = dev.array(x), dev.array(y), dev.zeros(12 * n), dev.array(dx), dev.zeros(4 * n, np.float64)
    dev.launch(mod, "rounding", 1, 256, px, py, po, pdx, pdo, n)
    o, d = dev.read(po, 12 * n).reshape(n, 12), dev.read(pdo, 4 * n, np.float64).reshape(n, 4)
    F = Fraction
    third = F(1.0 / 3.0)
    for i in range(n):
        a, b, p = F(float(x[i])), F(float(y[i])), F(float(dx[i]))
        ref = [rnd(a + b, "rz", np.float32), rnd(a + b, "rd", np.float32), rnd(a + b, "ru", np.float32),
               rnd(a * b, "rz", np.float32), rnd(a * b, "rd", np.float32), rnd(a * b, "ru", np.float32),
               rnd(a / b, "rz", np.float32), rnd(a / b, "ru", np.float32), o[i, 8],
               rnd(a * b + 1, "rz", np.float32), rnd(1 / b, "ru", np.float32), rnd(a - b, "rd", np.float32)]
        np.testing.assert_array_equal(o[i], np.array(ref, np.float32), err_msg=f"row {i}")
        r = F(float(o[i, 8]))                         # sqrt rounded down: r^2 <= |a| < next(r)^2
        assert r * r <= abs(a) < F(float(np.nextafter(o[i, 8], np.float32(np.inf)))) ** 2
        dref = [rnd(p + third, "rz", np.float64), rnd(p * third, "ru", np.float64), rnd(p / 3, "rd", np.float64)]
        np.testing.assert_array_equal(d[i, :3], dref, err_msg=f"row {i}")
        s = F(float(d[i, 3]))                         # sqrt rounded up: prev(s)^2 < |p| <= s^2
        assert F(float(np.nextafter(d[i, 3], -np.inf))) ** 2 < abs(p) <= s * s


def bf16(v):
    """Exact value v rounded to nearest-even bfloat16, as bits."""
    if isinstance(v, float) and math.isnan(v):
        return 0x7FFF
    sign, v = (0x8000 if v < 0 else 0), abs(v)
    b = int(np.array(np.float32(float(v))).view(np.uint32)) >> 16
    val = lambda c: Fraction(2 ** 128) if c == 0x7F80 else Fraction(float(np.array(c << 16, np.uint32).view(np.float32)))
    cands = [(c, val(c)) for c in (b - 1, b, b + 1) if 0 <= c <= 0x7F80]
    return sign | min(cands, key=lambda c: (abs(c[1] - v), c[0] & 1))[0]


def from_bf16(h):
    return np.float32(np.array(np.uint32(h) << np.uint32(16)).view(np.float32))


@arch
def test_half_and_bfloat16(dev, arch):
    mod = dev.load("half.cu", arch)
    n = 200
    a = rng.uniform(-20, 20, 2 * n).astype(np.float16)
    b = rng.uniform(-20, 20, 2 * n).astype(np.float16)
    a[:4] = [1, 65504, 2 ** -14, 0.1]
    b[:4] = [1, 2, 2 ** -10, -0.1]
    pa, pb, po2, po1 = dev.array(a), dev.array(b), dev.zeros(4 * n, np.float16), dev.zeros(4 * n, np.float16)
    dev.launch(mod, "half_math", 1, 256, pa, pb, po2, po1, n)
    o2, o1 = dev.read(po2, 4 * n, np.float16).reshape(n, 2, 2), dev.read(po1, 4 * n, np.float16).reshape(n, 4)
    F = Fraction
    h = lambda v: rnd(v, "rn", np.float16)
    for i in range(n):
        for k in range(2):
            x, y = F(float(a[2 * i + k])), F(float(b[2 * i + k]))
            assert o2[i, 0, k] == h(x * y + F(float(h(x + y)))), (i, k)
            assert o2[i, 1, k] == h(F(float(h(x - y))) * -y), (i, k)
        x, y = F(float(a[2 * i])), F(float(b[2 * i + 1]))
        want = [h(x * y), h(x - y), x if x < y else max(x, y), abs(h(x * y + x))]
        np.testing.assert_array_equal(o1[i], np.array([float(w) for w in want], np.float16), err_msg=f"row {i}")

    x = np.concatenate([[np.nan, np.inf, 1.0, 1.00390625, 1.01171875, -3.3e38, 1e-40], rng.standard_normal(n - 7)]).astype(np.float32)
    ab = ((rng.standard_normal(2 * n) * 100).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    px, pab, pcv, po = dev.array(x), dev.array(ab), dev.zeros(2 * n, np.uint16), dev.zeros(4 * n, np.uint16)
    dev.launch(mod, "bf16_math", 1, 256, px, pab, pcv, po, n)
    cv = dev.read(pcv, 2 * n, np.uint16).reshape(n, 2)
    for i in range(n):
        f = float(x[i])
        with np.errstate(over="ignore"):
            rz = float(np.float32(x[i]) * np.float32(3))
        want_rz = 0x7FFF if math.isnan(rz) else int(np.array(np.float32(rz)).view(np.uint32)) >> 16
        assert list(cv[i]) == [bf16(f if math.isnan(f) or math.isinf(f) else Fraction(f)) if not math.isinf(f) else 0x7F80,
                               want_rz], (i, f)
    if arch < "compute_80":
        return
    o = dev.read(po, 4 * n, np.uint16).reshape(n, 2, 2)
    for i in range(n):
        for k in range(2):
            v = Fraction(float(from_bf16(ab[2 * i + k])))
            sq = Fraction(float(from_bf16(bf16(v * v))))
            assert o[i, 0, k] == bf16(v * v + sq), (i, k)
            assert o[i, 1, k] == bf16(v + abs(v)), (i, k)


@arch
def test_votes_ballots_shuffles(dev, arch):
    mod = dev.load("warp.cu", arch)
    n = 120                                       # 2 blocks x 64 threads; the last 8 lanes read 0
    v = rng.integers(-50, 200, n).astype(np.int32)
    pv, po = dev.array(v), dev.zeros(10 * 128, np.int32)
    dev.launch(mod, "warp_ops", 2, 64, pv, po, n)
    o = dev.read(po, 10 * n, np.int32).reshape(n, 10)
    vv = np.concatenate([v, np.zeros(8, np.int32)]).reshape(4, 32)
    lane = np.arange(32)
    ref = []
    for w in vv:
        ballot = sum(1 << k for k in lane if w[k] & 1)
        seg8 = (lane & ~7) + ((lane + 1) & 7)
        down16 = np.where((lane & 15) + 2 < 16, lane + 2, lane)
        ref.append(np.stack([
            np.full(32, (w > 0).all()), np.full(32, (w > 100).any()), np.full(32, wrap32(ballot)),
            np.where(lane >= 3, w[lane - 3], w), np.where(lane + 5 < 32, w[np.minimum(lane + 5, 31)], w),
            w[lane ^ 6], w[(lane * 7) & 31], w[seg8], w[down16], np.where(lane & 1, wrap32(0xAAAAAAAA), 0)], 1))
    np.testing.assert_array_equal(o, np.concatenate(ref)[:n])


@arch
def test_special_registers(dev, arch):
    mod = dev.load("warp.cu", arch)
    grid, block = (2, 3, 2), (4, 3, 5)
    nt, nb = 60, 12
    po = dev.zeros(8 * nt * nb, np.uint32)
    dev.launch(mod, "special_regs", grid, block, po)
    o = dev.read(po, 8 * nt * nb, np.uint32).reshape(nb, nt, 8)
    t = np.arange(nt)
    for b in range(nb):
        bx, by, bz = b % 2, b // 2 % 3, b // 6
        np.testing.assert_array_equal(o[b], np.stack([t % 4, t // 4 % 3, t // 12, np.full(nt, bx + 100 * by + 10000 * bz),
                                                      np.full(nt, 4 + 300 + 50000), np.full(nt, 2 + 300 + 20000),
                                                      t % 32 + 100 * (t // 32), np.ones(nt)], 1))


@arch
def test_barrier_reductions_match_redux(dev, arch):
    mod = dev.load("sync.cu", arch)
    nb, bd = 3, 64
    v = rng.integers(-60, 60, nb * bd).astype(np.int32)
    v[5] = 7
    pv, po = dev.array(v), dev.zeros(6 * nb * bd, np.int32)
    dev.launch(mod, "sync_ops", nb, bd, pv, po)
    o = dev.read(po, 6 * nb * bd, np.int32).reshape(nb, bd, 6)
    for b in range(nb):
        w = v[b * bd:(b + 1) * bd]
        np.testing.assert_array_equal(o[b, :, 0], (w > 0).sum())
        np.testing.assert_array_equal(o[b, :, 1], int((w > -50).all()))
        np.testing.assert_array_equal(o[b, :, 2], int((w == 7).any()))
        for k in range(bd):
            warp = w[k // 32 * 32:k // 32 * 32 + 32]
            assert o[b, k, 3] == wrap32(sum(1 << j for j in range(32) if warp[j] & 3 == w[k] & 3))
            if arch >= "compute_80":
                assert tuple(o[b, k, 4:]) == (warp.sum(), warp.max())
    out = dev.zeros(128, np.int32)
    dev.launch(mod, "early_exit_barrier", 2, 64, out, 40)
    got = dev.read(out, 128, np.int32).reshape(2, 64)
    np.testing.assert_array_equal(got[:, :40], np.tile((39 - np.arange(40)) * 2, (2, 1)))


def test_async_copy(dev):
    mod = dev.load("async.cu", "compute_90")
    n4 = 300
    x = rng.random(4 * n4, np.float32)
    px, po = dev.array(x), dev.zeros(n4)
    dev.launch(mod, "async_copy", 3, 128, px, po, n4)
    v = x.reshape(-1, 4)
    src = np.array([(i // 128) * 128 + 127 - i % 128 for i in range(n4)])
    ok = src < n4
    ref = v[np.minimum(src, n4 - 1)] @ np.float32([1, 2, 3, 4])
    np.testing.assert_allclose(dev.read(po, n4)[ok], ref[ok], rtol=1e-6)


def test_cuda_barrier_and_memcpy_async(dev):
    mod = dev.load("async.cu", "compute_90")
    nb, nt, rounds = 4, 256, 3
    x = rng.random(nb * nt, np.float32)
    px, po = dev.array(x), dev.zeros(nb * nt)
    dev.launch(mod, "barrier_copy", nb, nt, px, po, rounds)
    t = np.arange(nt)
    ref = [sum(x[((b + r) % nb) * nt + (t + 1) % nt] * (r + 1) for r in range(rounds)) for b in range(nb)]
    np.testing.assert_allclose(dev.read(po, nb * nt), np.concatenate(ref), rtol=1e-6)
    dev.launch(mod, "group_copy", nb, nt, px, po)
    np.testing.assert_array_equal(dev.read(po, nb * nt), x.reshape(nb, nt)[:, ::-1].reshape(-1) + 1)


def test_grid_sync_in_a_cooperative_launch(dev):
    mod = dev.load("async.cu", "compute_90")
    nb, nt, rounds = 12, 64, 3
    part, out = dev.zeros(nb, np.int32), dev.zeros(rounds, np.int32)

    def launch(cooperative):
        params = dev.pack(mod.kernels["grid_rounds"], (part, out, rounds))
        mod.launch("grid_rounds", dev.mem, (nb, 1, 1), (nt, 1, 1), 0, params, dev.printed.append, 60, cooperative)
    launch(True)
    np.testing.assert_array_equal(dev.read(out, rounds, np.int32), [10 * sum(range(nb)) + nb * r for r in range(rounds)])
    raises(TRAP_STATUS, lambda: launch(False), "grid_rounds")   # no grid.sync() outside one, as on a GPU


@arch
def test_spin_waits_need_yields(dev, arch):
    """Min-PC scheduling alone would spin forever here; the spinning group must yield to parked lanes."""
    mod = dev.load("spin.cu", arch)
    lock, ctr = dev.zeros(1, np.int32), dev.zeros(1, np.int32)
    dev.launch(mod, "spin_lock", 2, 64, lock, ctr)
    assert dev.read(ctr, 1, np.int32)[0] == 128 and dev.read(lock, 1, np.int32)[0] == 0
    flag, data, out = dev.zeros(1, np.int32), dev.zeros(1, np.int32), dev.zeros(64, np.int32)
    dev.launch(mod, "flag_wait", 2, 64, flag, data, out)
    np.testing.assert_array_equal(dev.read(out, 64, np.int32), 42 + np.arange(64))


@arch
def test_generic_pointers(dev, arch):
    mod = dev.load("generic.cu", arch)
    g = np.arange(256, dtype=np.int32) * 10
    t = np.arange(128)
    for which, base, tag in [(0, t, 100), (1, g[::2][:128], 1000), (2, 3 * t, 10000)]:
        pg, po = dev.array(g), dev.zeros(256, np.int32)
        dev.launch(mod, "generic_ptrs", 1, 128, pg, po, which)
        o = dev.read(po, 256, np.int32).reshape(128, 2)
        np.testing.assert_array_equal(o[:, 0], base + 5)
        np.testing.assert_array_equal(o[:, 1], 2 * (base + 5) + tag)
    idx = rng.integers(0, 256, 64).astype(np.int32)
    pi, po = dev.array(idx), dev.zeros(64, np.int32)
    dev.launch(mod, "local_array", 1, 64, pi, po)
    np.testing.assert_array_equal(dev.read(po, 64, np.int32), np.arange(64) * ((idx & 15) + ((idx >> 4) & 15)))


@arch
def test_module_globals(dev, arch):
    mod = dev.load("globals.cu", arch)
    assert mod.globals["coeffs"].space == "const" and mod.globals["counter"].space == "global"
    assert mod.globals["coeffs"].size == 16 and mod.globals["tptr"].align == 8
    assert np.frombuffer(mod.globals["table"].init, np.int32).tolist() == [10, 20, 30]
    n = 100
    po = dev.zeros(n)
    dev.launch(mod, "use_globals", 1, 128, po, n)
    i = np.arange(n)
    ref = np.array([1, 2, 3, 4], np.float32)[i % 4] * i.astype(np.float32) * np.float32(0.5) + np.array([10, 20, 30])[i % 3]
    np.testing.assert_allclose(dev.read(po, n), ref, rtol=1e-6)
    assert dev.read(mod.addrs["counter"], 1, np.int32)[0] == 8
    assert dev.read(mod.addrs["tptr"], 1, np.uint64)[0] == mod.addrs["table"]     # pointer initialiser relocated


@arch
def test_jump_table_named_barriers_recursion(dev, arch):
    mod = dev.load("control.cu", arch)
    n = 100
    x = rng.integers(-1000, 1000, n).astype(np.int32)
    px, po = dev.array(x), dev.zeros(n, np.int32)
    dev.launch(mod, "jump_table", 1, 128, px, po, n)
    pick = lambda k, v: [v + 1, v * 3, v - 7, v ^ 0x55, v << 2, int(v / 3), -v, v & 0xF0, v | 1,
                         int(math.fmod(v, 10)), 0, 0][k]
    np.testing.assert_array_equal(dev.read(po, n, np.int32), [pick(i % 12, int(v)) for i, v in enumerate(x)])
    po = dev.zeros(64, np.int32)
    dev.launch(mod, "named_barriers", 1, 128, po)
    np.testing.assert_array_equal(dev.read(po, 64, np.int32), (63 - np.arange(64)) ** 2)
    raises(CUresult.CUDA_ERROR_NOT_SUPPORTED, lambda: dev.launch(mod, "recursive", 1, 8, po), "recursive call")


def test_brx_idx_and_guarded_exit(dev):
    mod = parse_module(""".version 8.0
.target sm_90
.address_size 64
.visible .entry ctl(.param .u64 out)
{
    .reg .pred %p<3>;
    .reg .b32 %r<6>;
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [out];
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd2, %r1, 4;
    add.s64 %rd3, %rd1, %rd2;
    rem.u32 %r2, %r1, 3;
    $L_tab: .branchtargets $L0, $L1, $L2;
    brx.idx %r2, $L_tab;
$L0:
    mov.u32 %r3, 100;
    bra.uni $Ldone;
$L1:
    mov.u32 %r3, 200;
    bra.uni $Ldone;
$L2:
    mov.u32 %r3, 300;
$Ldone:
    add.u32 %r4, %r3, %r1;
    st.global.u32 [%rd3], %r4;
    setp.lt.u32 %p1, %r1, 8;
    @%p1 exit;
    setp.lt.u32 %p2, %r1, 16;
    @!%p2 bra $Lbar;
    st.global.u32 [%rd3], 2;
    @%p2 ret;
$Lbar:
    bar.sync 0;                 // threads below 16 are gone: they no longer count
    st.global.u32 [%rd3], 3;
}
""")
    out = dev.zeros(64, np.int32)
    dev.launch(mod, "ctl", 1, 64, out)
    t = np.arange(64)
    np.testing.assert_array_equal(dev.read(out, 64, np.int32), np.where(t < 8, np.array([100, 200, 300])[t % 3] + t, np.where(t < 16, 2, 3)))


@arch
def test_common_idioms(dev, arch):
    mod = dev.load("idioms.cu", arch)
    rows, cols = 5, 100
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    px, py = dev.array(x), dev.zeros(rows * cols)
    dev.launch(mod, "softmax", rows, 32, px, py, cols)
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(dev.read(py, rows * cols).reshape(rows, cols), e / e.sum(1, keepdims=True), rtol=1e-5)

    v = rng.integers(0, 100, 64).astype(np.int32)
    pv, po = dev.array(v), dev.zeros(128, np.int32)
    dev.launch(mod, "cgroups", 1, 64, pv, po)
    o = dev.read(po, 128, np.int32).reshape(64, 2)
    t = np.arange(64)
    w = v.reshape(2, 32)
    ballot = np.array([sum(1 << j for j in range(32) if r[j] & 1) for r in w])
    np.testing.assert_array_equal(o[:, 0], w.sum(1)[t // 32])
    np.testing.assert_array_equal(o[:, 1], [wrap32(k) for k in v.reshape(8, 8).max(1)[t // 8] + (w > 50).any(1)[t // 32]
                                            + ballot[t // 32]])

    f4 = rng.standard_normal(256).astype(np.float32)
    f4[0], f4[5] = np.nan, np.inf
    ll = rng.integers(-2 ** 62, 2 ** 62, 128)
    words = rng.integers(0, 2 ** 32, 128, dtype=np.uint64).astype(np.uint32)
    pf, pl, pw = dev.array(f4), dev.array(ll), dev.array(words)
    pds, pu = dev.zeros(2, np.float64), dev.zeros(2, np.uint64)
    po, pdo = dev.zeros(8 * 64, np.int32), dev.zeros(400, np.float64)
    dev.launch(mod, "misc", 1, 64, pf, pl, pds, pu, pw, po, pdo)
    assert list(dev.read(pds, 2, np.float64)) == [64.0, float(t.sum())]
    assert list(dev.read(pu, 2, np.uint64)) == [63000, 77]
    o = dev.read(po, 8 * 64, np.int32).reshape(64, 8)
    a, b = [int(k) for k in ll[:64]], [int(k) | 1 for k in ll[64:]]
    q = [abs(x) // abs(y) * (1 if (x < 0) == (y < 0) else -1) for x, y in zip(a, b)]
    np.testing.assert_array_equal(o[:, 0], [wrap32(k) for k in q])
    np.testing.assert_array_equal(o[:, 1], [wrap32(x - k * y) for x, y, k in zip(a, b, q)])
    M64 = 2 ** 64 - 1
    np.testing.assert_array_equal(o[:, 2], [(x & -x & M64).bit_length() + bin(x & M64).count("1") + 64 - (y & M64).bit_length()
                                            for x, y in zip(a, b)])
    np.testing.assert_array_equal(o[:, 3], [wrap32(int(f"{x & M64:064b}"[::-1], 2)) for x in a])
    wa, wb = words[:64].astype(np.int64), words[64:].astype(np.int64)
    byte = lambda x, k: (x >> 8 * k) & 0xFF
    sbyte = lambda x, k: byte(x, k) - ((byte(x, k) & 0x80) << 1)
    np.testing.assert_array_equal(o[:, 4].view(np.uint32), sum(((byte(wa, k) + byte(wb, k)) & 0xFF) << 8 * k for k in range(4)))
    np.testing.assert_array_equal(o[:, 5], sum(sbyte(wa, k) * sbyte(wb, k) for k in range(4)) + 5)
    np.testing.assert_array_equal(o[:, 6].view(np.uint32), sum(np.abs(byte(wa, k) - byte(wb, k)) << 8 * k for k in range(4)))
    f = f4.reshape(64, 4)
    np.testing.assert_array_equal(o[:, 7].view(np.uint32), (np.abs(wa - wb) + 3 + np.isnan(f[:, 0]) + 2 * np.isinf(f[:, 1])
                                                            + 4 * np.signbit(f[:, 2])) & 0xFFFFFFFF)
    do = dev.read(pdo, 400, np.float64)
    np.testing.assert_array_equal(do[:128].view(np.float32).reshape(64, 4), f[:, ::-1])
    la = np.array(a, np.float64)
    np.testing.assert_array_equal(do[256:320], np.where(t % 32 == 31, la, np.roll(la, -1)) + 0xFFFFFFFF + 1)
    h = f[:, :2].astype(np.float16).astype(np.float64)
    np.testing.assert_array_equal(do[320:384], h[:, 0] + h[:, 1])

    pin, po = dev.array(np.arange(96, dtype=np.int32)), dev.zeros(1, np.int32)
    dev.launch(mod, "legacy_reduce", 1, 64, pin, po)
    s = [2 * k + 32 for k in range(64)]
    for off in (16, 8, 4, 2, 1):                       # warp-synchronous: each step reads, then writes
        s = [s[k] + s[k + off] if k < 32 else s[k] for k in range(64)]
    assert dev.read(po, 1, np.int32)[0] == s[0]


# ---------------------------------------------------------------- failures and API
HAND = """
.version 8.0
.target sm_90
.address_size 64

.visible .entry k(.param .u64 out)
{{
	.reg .b32 %r<4>;
	.reg .b64 %rd<3>;
	ld.param.u64 %rd1, [out];
	mov.u32 %r1, 5;
	{insn}
	st.global.u32 [%rd1], %r2;
	ret;
}}
"""


@pytest.mark.parametrize("insn, name", [("mul.hi.foo.u32 %r2, %r1, %r1;", "mul.hi.foo.u32"),
                                        ("frobnicate.b32 %r2, %r1;", "frobnicate.b32"),
                                        ("prmt.b32.f4e %r2, %r1, %r1, %r1;", "prmt.b32.f4e"),
                                        ("tex.1d.v4.s32.s32 {%r0, %r1, %r2, %r3}, [tex, {%r1}];", "tex.1d.v4.s32.s32")])
def test_unknown_instruction_is_not_supported(dev, insn, name):
    mod = parse_module(HAND.format(insn=insn))
    out = dev.zeros(1, np.int32)
    e = raises(CUresult.CUDA_ERROR_NOT_SUPPORTED, lambda: dev.launch(mod, "k", 1, 1, out),
               f"kernel 'k': unsupported PTX instruction '{name}' at line 12")
    assert dev.read(out, 1, np.int32)[0] == 0          # nothing ran


def test_hand_written_ptx_runs(dev):
    mod = parse_module(HAND.format(insn="mad.lo.s32 %r2, %r1, %r1, 17;"))
    out = dev.zeros(1, np.int32)
    dev.launch(mod, "k", 1, 1, out)
    assert dev.read(out, 1, np.int32)[0] == 42


@pytest.mark.parametrize("insn, value", [("mov.u32 %r2, WARP_SZ;", 32), ("add.u32 %r2, %envreg2, 9;", 9),
                                         ("mov.u64 %rd2, %globaltimer; shr.u64 %rd2, %rd2, 62; cvt.u32.u64 %r2, %rd2;", 0),
                                         ("mov.u64 %rd2, %clock64; shr.u64 %rd2, %rd2, 62; cvt.u32.u64 %r2, %rd2;", 0)])
def test_builtin_constants_and_timers(dev, insn, value):
    mod = parse_module(HAND.format(insn=insn))
    out = dev.zeros(1, np.int32)
    dev.launch(mod, "k", 1, 1, out)
    assert dev.read(out, 1, np.int32)[0] == value


@pytest.mark.parametrize("insn, value", [
    ("bmsk.wrap.b32 %r2, 1, 2;", 0x6),                          # the PTX ISA's example
    ("bmsk.clamp.b32 %r2, %r1, 3;", 0xE0),                     # 3 bits from bit 5
    ("bmsk.wrap.b32 %r2, %r1, 0;", 0),                         # width 0: none
    ("bmsk.wrap.b32 %r2, %r1, 30;", 0xFFFFFFE0),               # past bit 31: cut there
    ("bmsk.wrap.b32 %r2, 37, 3;", 0xE0),                       # position and width wrap at 32
    ("bmsk.clamp.b32 %r2, 37, 3;", 0),                         # a position past 31 clamps to none
    ("bmsk.clamp.b32 %r2, %r1, 40;", 0xFFFFFFE0)])             # a width past 31 to the top
def test_bit_masks(dev, insn, value):
    mod = parse_module(HAND.format(insn=insn))
    out = dev.zeros(1, np.uint32)
    dev.launch(mod, "k", 1, 1, out)
    assert dev.read(out, 1, np.uint32)[0] == value


@pytest.mark.parametrize("text", ["garbage", HAND.format(insn="mov.u32 %r2 %r1;"), HAND.format(insn="@ bra;"),
                                  HAND.format(insn="add.s32 %r2, [%r1;")[:-3]])
def test_syntax_errors_are_invalid_ptx(text):
    raises(CUresult.CUDA_ERROR_INVALID_PTX, lambda: parse_module(text))


def test_red_and_vote_uni(dev):
    mod = parse_module(""".version 8.0
.target sm_90
.address_size 64
.visible .entry k(.param .u64 g, .param .u64 out)
{
    .reg .pred %p<4>;
    .reg .b32 %r<8>;
    .reg .f32 %f<3>;
    .reg .b64 %rd<5>;
    .shared .align 4 .b8 sh[8];
    ld.param.u64 %rd1, [g];
    ld.param.u64 %rd2, [out];
    mov.u32 %r1, %tid.x;
    setp.eq.u32 %p1, %r1, 0;
    @%p1 st.shared.v2.u32 [sh], {%r1, %r1};
    bar.sync 0;
    red.global.add.u32 [%rd1], 1;
    red.relaxed.gpu.global.max.s32 [%rd1+4], %r1;
    cvt.rn.f32.u32 %f1, %r1;
    red.shared.add.f32 [sh], %f1;
    red.shared.xor.b32 [sh+4], %r1;
    setp.lt.u32 %p2, %r1, 1000;
    vote.sync.uni.pred %p3, %p2, -1;
    selp.u32 %r2, 1, 0, %p3;
    setp.lt.u32 %p2, %r1, 40;
    vote.sync.uni.pred %p3, %p2, -1;
    selp.u32 %r3, 2, 0, %p3;
    add.u32 %r4, %r2, %r3;
    mul.wide.u32 %rd3, %r1, 4;
    add.s64 %rd4, %rd2, %rd3;
    st.global.u32 [%rd4], %r4;
    bar.sync 0;
    @!%p1 bra $Ldone;
    ld.shared.v2.u32 {%r5, %r6}, [sh];
    st.global.v2.u32 [%rd1+8], {%r5, %r6};
$Ldone:
    ret;
}
""")
    g, out = dev.zeros(4, np.int32), dev.zeros(64, np.int32)
    dev.launch(mod, "k", 1, 64, g, out)
    r = dev.read(g, 4, np.int32)
    xor = 0
    for t in range(64):
        xor ^= t
    assert list(r[:2]) == [64, 63] and r[2:].view(np.float32)[0] == sum(range(64)) and r[3] == xor
    np.testing.assert_array_equal(dev.read(out, 64, np.int32), [1 + 2 * (t < 32) for t in range(64)])


def test_mangled_ptx_fails_cleanly():
    """Truncated or corrupted PTX raises CudaError (INVALID_PTX, or NOT_SUPPORTED at link), nothing else."""
    import random
    r = random.Random(7)
    texts = [compile_ptx(n, "compute_90") for n in ("devfunc.cu", "printf.cu", "cvt.cu", "warp.cu")]
    for it in range(300):
        t = r.choice(texts)
        i, j = sorted(r.randrange(len(t)) for _ in range(2))
        t = [t[:i], t[:i] + r.choice("{};,[]%@()|!<>-\"") + t[i:], t[:i] + t[j:]][it % 3]
        try:
            for k in parse_module(t).kernels.values():
                k.link()
        except CudaError as e:
            assert e.status in (CUresult.CUDA_ERROR_INVALID_PTX, CUresult.CUDA_ERROR_NOT_SUPPORTED)


def test_launch_configuration_errors(dev):
    mod = dev.load("vecadd.cu")
    args = (0, 0, 0, 0)
    bad = CUresult.CUDA_ERROR_INVALID_VALUE
    raises(bad, lambda: dev.launch(mod, "vec_add", 1, 1025, *args), "1024")
    raises(bad, lambda: dev.launch(mod, "vec_add", 1, (32, 32, 2), *args))
    raises(bad, lambda: dev.launch(mod, "vec_add", 0, 32, *args))
    raises(bad, lambda: dev.launch(mod, "vec_add", (1, 70000, 1), 32, *args))
    raises(bad, lambda: dev.launch(mod, "vec_add", 1, 32, *args, shared=100 * 1024), "shared")
    raises(CUresult.CUDA_ERROR_NOT_FOUND, lambda: mod.launch("nope", dev.mem, (1, 1, 1), (1, 1, 1), 0, b"", print))


def test_param_layout_matches_driver():
    ptx = """.version 8.0
.target sm_90
.address_size 64
.visible .entry k(.param .u64 a, .param .u64 .ptr .global .align 16 b, .param .u32 c, .param .align 8 .b8 s[32],
                  .param .u8 ch, .param .f64 d, .param .b16 h, .param .align 16 .b8 v[16])
{ ret; }"""
    k = parse_module(ptx).kernels["k"]
    assert k.params == [(0, 8), (8, 8), (16, 4), (24, 32), (56, 1), (64, 8), (72, 2), (80, 16)]


def test_a_modules_tokens_are_capped_and_its_parse_has_a_deadline(monkeypatch):
    """Past every cap of what it declares, a module's cost grows with its text (an initialiser
    of 2^24 values took 66 s and 4.1 GiB): its tokens are capped, and its parse has a deadline."""
    import time
    from phos.gpu_server.backends.ptx import parser
    from phos.schema.cuda_types import CudaError, CUresult
    text = ".version 8.0\n.target sm_90\n.address_size 64\n.global .u32 g[] = {" + "1," * 100 + "1};"
    monkeypatch.setattr(parser, "CHECK_EVERY", 16)
    monkeypatch.setattr(parser, "MAX_MODULE_TOKENS", 64)
    with pytest.raises(CudaError) as e:
        parser.parse(text)
    assert e.value.status == CUresult.CUDA_ERROR_INVALID_PTX and "MAX_MODULE_TOKENS" in e.value.message
    monkeypatch.setattr(parser, "MAX_MODULE_TOKENS", 1 << 21)
    assert parser.parse(text).vars["g"].size == 404
    with pytest.raises(CudaError) as e:
        parser.parse(text, deadline=time.monotonic() - 1)
    assert e.value.status == CUresult.CUDA_ERROR_INVALID_PTX and "PHOS_EMU_MODULE_LOAD_TIMEOUT" in e.value.message
