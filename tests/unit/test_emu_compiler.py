"""The emu's PTX compiler (gpu_server/backends/ptx/compiler.py) against the interpreter and exact references:
barriers in loops under divergent branches, warp collectives under partial masks, atomics across
blocks, the fallback, and a compiled kernel reused by a second process from the disk cache."""
import hashlib
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from phos.gpu_server.backends.ptx import compiler
from ptx_helpers import CACHE, NVCC, Device

SOURCE = r'''
#include <cuda_fp16.h>
extern "C" __global__ void bar_loops(int *out, int rounds) {
    __shared__ int s[256];
    int t = threadIdx.x, acc = t + blockIdx.x;
    for (int r = 0; r < rounds; r++) {
        if (t % 3 == 0) acc += r;
        else if (t % 3 == 1) acc ^= r * 7;
        else for (int k = 0; k < t % 5; k++) acc += k;
        s[t] = acc;
        __syncthreads();
        if (t & 1) acc += s[(t + 1) % blockDim.x];
        else acc -= s[(t + 3) % blockDim.x];
        __syncthreads();
    }
    out[blockIdx.x * blockDim.x + t] = acc;
}

extern "C" __global__ void partial_warps(int *out, unsigned *ballots) {
    int t = threadIdx.x, lane = t & 31, v = t * 10;
    if (lane < 16) {
        v += __shfl_down_sync(0x0000ffffu, v, 1, 16);
        unsigned b = __ballot_sync(0x0000ffffu, t & 1);
        if (lane == 0) ballots[2 * (t >> 5)] = b;
    } else {
        v += __shfl_xor_sync(0xffff0000u, v, 2);
        unsigned b = __ballot_sync(0xffff0000u, lane % 3 == 0);
        if (lane == 16) ballots[2 * (t >> 5) + 1] = b;
    }
    out[t] = v;
}

extern "C" __global__ void atomics_across_blocks(int *count, unsigned *maxv, float *fsum, int *slots) {
    int g = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(count, 1);
    atomicMax(maxv, (unsigned)(g * 2654435761u));
    atomicAdd(fsum, 1.0f);
    int i = 0;
    while (atomicCAS(&slots[i], 0, g + 1) != 0) i++;   // every thread claims a slot of its own
}

__device__ __noinline__ float twice(float x) { return 2.0f * x; }

__device__ __noinline__ int say(int v) {
    int n = printf("  v=%d twice=%.1f\n", v, twice((float)v));
    return v + n;
}

extern "C" __global__ void printf_calls(int *out, int rounds) {
    int t = threadIdx.x, acc = 0;
    for (int r = 0; r < rounds; r++) {
        if ((t + r) % 2) printf("block %d thread %d round %d: %d %.2f\n", blockIdx.x, t, r, r * t, twice(r + 0.5f));
        __syncthreads();
        acc += say(t + 100 * blockIdx.x + r);
    }
    out[blockIdx.x * blockDim.x + t] = acc;
}

extern "C" __global__ void misc_fallback(int *out, int a, int b) {
    // a 64-bit integer to f16 (cvt.rn.f16.s64): the interpreter rounds it exactly, the compiler refuses
    out[threadIdx.x] = (int)__half2float(__ll2half_rn((long long)a * b + threadIdx.x));
}

extern "C" __global__ void yields_before_a_barrier(int *out, int n) {
    int t = threadIdx.x, x = t;
    if (t < 32) {                           // a long loop (it yields) with warp syncs in it, while warp 1 waits
#pragma unroll 1
        for (int i = 0; i < n; i++) {
            if (i % 20000 == 0) __syncwarp();
            x += (i & 7) + 1;
        }
    }
    __syncthreads();
    out[blockIdx.x * blockDim.x + t] = x;
}

extern "C" __global__ void lockstep_reduce(const int *in, int *out) {
    volatile __shared__ int s[64];      // warp-synchronous: the lanes of a warp in step, no sync
    int t = threadIdx.x;
    s[t] = in[t];
    if (t < 32) {
        s[t] += s[t + 32]; s[t] += s[t + 16]; s[t] += s[t + 8]; s[t] += s[t + 4]; s[t] += s[t + 2]; s[t] += s[t + 1];
    }
    if (t == 0) out[0] = s[0];
}
'''


@pytest.fixture(scope="module")
def ptx():
    if NVCC is None:
        pytest.skip("nvcc not found")
    CACHE.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    out = CACHE / f"compiler-{key}.ptx"
    if not out.exists():
        src = CACHE / f"compiler-{key}.{os.getpid()}.cu"
        src.write_text(SOURCE)
        subprocess.run([NVCC, "-ptx", "-arch=compute_90", str(src), "-o", str(out)], check=True)
        src.unlink()
    return out.read_text()


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch):
    """An empty disk cache, and none of the kernels this process loaded before."""
    monkeypatch.setenv("PHOS_EMU_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setattr(compiler, "_loaded", {})
    return tmp_path / "kernels"


def run_both(ptx, monkeypatch, fn):
    """fn(dev, mod) on the interpreter, then on the compiler (each on a fresh device); both results."""
    out = []
    for flag in ("0", "1"):
        monkeypatch.setenv("PHOS_EMU_COMPILER", flag)
        dev = Device(1 << 26)
        mod = dev.module(ptx)
        out.append(fn(dev, mod))
    for name, k in mod.kernels.items():
        c = k.__dict__.get('_compiled')
        if c is not None and name != 'misc_fallback':
            assert c.fn is not None, c.why           # the compiled engine ran it, not the fallback
    return out


def outputs_of_both(ptx, monkeypatch, kernel, nb, nt, *args):
    """The int32 a thread that `kernel(out, *args)` writes to out[its global index], on each engine."""
    def fn(dev, mod):
        p = dev.zeros(nb * nt, np.int32)
        dev.launch(mod, kernel, nb, nt, p, *args)
        return dev.read(p, nb * nt, np.int32)
    return run_both(ptx, monkeypatch, fn)


def test_barriers_in_loops_under_divergent_branches(ptx, kernel_cache, monkeypatch):
    nb, nt, rounds = 3, 96, 5
    interp, native = outputs_of_both(ptx, monkeypatch, "bar_loops", nb, nt, rounds)
    ref = []
    for blk in range(nb):
        acc = [t + blk for t in range(nt)]
        for r in range(rounds):
            for t in range(nt):
                acc[t] = acc[t] + r if t % 3 == 0 else acc[t] ^ (r * 7) if t % 3 == 1 else acc[t] + sum(range(t % 5))
            s = list(acc)
            acc = [acc[t] + s[(t + 1) % nt] if t & 1 else acc[t] - s[(t + 3) % nt] for t in range(nt)]
        ref += acc
    np.testing.assert_array_equal(native, np.array(ref, np.int32))
    np.testing.assert_array_equal(native, interp)


def test_threads_that_yield_while_others_wait(ptx, kernel_cache, monkeypatch):
    # warp 0 yields in its loop (and comes back to warp syncs) while warp 1 waits at the barrier: a
    # region must run just the threads that run, however often they yielded
    nb, nt, n = 2, 64, 40000
    interp, native = outputs_of_both(ptx, monkeypatch, "yields_before_a_barrier", nb, nt, n)
    t = np.arange(nt)
    want = np.where(t < 32, t + sum((i & 7) + 1 for i in range(n)), t)
    np.testing.assert_array_equal(native, np.tile(want, nb).astype(np.int32))
    np.testing.assert_array_equal(native, interp)


def test_warp_collectives_under_partial_masks(ptx, kernel_cache, monkeypatch):
    nt = 64

    def fn(dev, mod):
        p, q = dev.zeros(nt, np.int32), dev.zeros(4, np.uint32)
        dev.launch(mod, "partial_warps", 1, nt, p, q)
        return dev.read(p, nt, np.int32), dev.read(q, 4, np.uint32)
    (iv, ib), (nv, nb_) = run_both(ptx, monkeypatch, fn)
    t = np.arange(nt)
    lane = t & 31
    src = np.where(lane < 16, np.where(lane + 1 < 16, t + 1, t), t ^ 2)
    np.testing.assert_array_equal(nv, 10 * t + 10 * src)
    low = sum(1 << k for k in range(16) if k & 1)
    high = sum(1 << k for k in range(16, 32) if k % 3 == 0)
    np.testing.assert_array_equal(nb_, [low, high, low, high])
    np.testing.assert_array_equal(nv, iv)
    np.testing.assert_array_equal(nb_, ib)


def test_warp_synchronous_shared_memory_in_step(ptx, kernel_cache, monkeypatch):
    nb = 3
    x = np.arange(nb * 64, dtype=np.int32) * 7 % 101

    def fn(dev, mod):
        pin, po = dev.array(x), dev.zeros(nb, np.int32)
        for b in range(nb):
            dev.launch(mod, "lockstep_reduce", 1, 64, pin + 4 * 64 * b, po + 4 * b)
        return dev.read(po, nb, np.int32)
    interp, native = run_both(ptx, monkeypatch, fn)
    np.testing.assert_array_equal(native, x.reshape(nb, 64).sum(1))
    np.testing.assert_array_equal(native, interp)


def test_atomics_across_blocks(ptx, kernel_cache, monkeypatch):
    nb, nt = 37, 64
    n = nb * nt

    def fn(dev, mod):
        c, m, f, s = dev.zeros(1, np.int32), dev.zeros(1, np.uint32), dev.zeros(1), dev.zeros(n + 1, np.int32)
        dev.launch(mod, "atomics_across_blocks", nb, nt, c, m, f, s)
        return (dev.read(c, 1, np.int32)[0], dev.read(m, 1, np.uint32)[0], dev.read(f, 1)[0],
                np.sort(dev.read(s, n + 1, np.int32)))
    for count, maxv, fsum, slots in run_both(ptx, monkeypatch, fn):
        assert count == n and fsum == n
        assert maxv == max((g * 2654435761) % 2 ** 32 for g in range(n))
        np.testing.assert_array_equal(slots, np.arange(n + 1))      # one 0 left over, each id once


def test_device_functions_and_printf_as_the_interpreter(ptx, kernel_cache, monkeypatch):
    nb, nt, rounds = 3, 8, 4

    def fn(dev, mod):
        p = dev.zeros(nb * nt, np.int32)
        dev.launch(mod, "printf_calls", nb, nt, p, rounds)
        return dev.printed, dev.read(p, nb * nt, np.int32)
    (ip, iv), (cp, cv) = run_both(ptx, monkeypatch, fn)
    # the same lines in the same order: where lanes in step would print them (branches that
    # rejoin before the next printf; a thread left behind in a callee may print later there)
    assert cp == ip
    want = []
    for r in range(rounds):
        want += [f"block {b} thread {t} round {r}: {r * t} {2 * r + 1:.2f}\n"
                 for b in range(nb) for t in range(nt) if (t + r) % 2]
        want += [f"  v={t + 100 * b + r} twice={2.0 * (t + 100 * b + r):.1f}\n" for b in range(nb) for t in range(nt)]
    assert cp == want
    np.testing.assert_array_equal(cv, [sum(t + 100 * b + r + 2 for r in range(rounds))
                                       for b in range(nb) for t in range(nt)])
    np.testing.assert_array_equal(cv, iv)


def test_refused_kernel_falls_back_once_by_name(ptx, kernel_cache, monkeypatch, caplog):
    monkeypatch.setenv("PHOS_EMU_COMPILER", "1")
    dev = Device(1 << 24)
    mod = dev.module(ptx)
    p = dev.zeros(32, np.int32)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            dev.launch(mod, "misc_fallback", 1, 32, p, 2049, 8)
    why = mod.kernels['misc_fallback']._compiled.why
    assert why.startswith("'cvt.rn.f16.s64' at line ")
    assert [r.getMessage() for r in caplog.records if "misc_fallback" in r.getMessage()] == \
        [f"emu: kernel 'misc_fallback' runs in the PTX interpreter: the compiler refused {why}"]
    exact = 2049 * 8 + np.arange(32)         # f16 steps by 16 here: halfway cases and both sides of them
    np.testing.assert_array_equal(dev.read(p, 32, np.int32), np.float16(exact).astype(np.int32))


def test_a_second_process_reuses_the_compiled_kernel(ptx, kernel_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("PHOS_EMU_COMPILER", "1")
    dev = Device(1 << 24)
    mod = dev.module(ptx)
    p = dev.zeros(96, np.int32)
    dev.launch(mod, "bar_loops", 1, 96, p, 3)
    built = sorted(kernel_cache.glob("*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    ptx_file = tmp_path / "k.ptx"
    ptx_file.write_text(ptx)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
        import numpy as np
        from ptx_helpers import Device
        dev = Device(1 << 24)
        mod = dev.module(open({str(ptx_file)!r}).read())
        p = dev.zeros(96, np.int32)
        dev.launch(mod, "bar_loops", 1, 96, p, 3)
        assert mod.kernels["bar_loops"]._compiled.fn is not None, mod.kernels["bar_loops"]._compiled.why
        sys.stdout.write(dev.read(p, 96, np.int32).tobytes().hex())
    """)
    # no gcc on the second process's PATH: it can only load what the first one built
    env = {**os.environ, "PATH": str(tmp_path), "PHOS_EMU_KERNEL_CACHE": str(kernel_cache)}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(np.frombuffer(bytes.fromhex(r.stdout), np.int32), dev.read(p, 96, np.int32))
    assert sorted(kernel_cache.glob("*.so")) == built and built[0].stat().st_mtime_ns == stamp
