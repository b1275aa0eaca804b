"""Time per launch of the emu backend's two engines, compiled and interpreted, on three reference kernels.

    python perf/bench_emu.py [--arch compute_90] [--repeat 3] [--interp-repeat 1]

Compiles tests/kernels/*.cu with nvcc (cached under tmp), runs each kernel directly on
EmuMemory with PHOS_EMU_COMPILER=1 (native code, ptx/compiler.py) and then 0 (the PTX
interpreter), checks each result against NumPy and prints the best time of the repeats.
The compiled engine's first launch builds the kernel (or loads it from the disk cache):
it is timed apart, as "first".
"""
import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from ptx_helpers import Device  # noqa: E402

TARGETS = {"vector add 2^24 f32": 0.2, "matmul 1024x1024 tiled": 2.0, "reduction 2^20 f32 shfl": 0.2}


def bench(dev, arch):
    rng = np.random.default_rng(0)
    n = 1 << 24
    a, b = rng.random(n, np.float32), rng.random(n, np.float32)
    va = dev.load("vecadd.cu", arch)
    pa, pb, pc = dev.array(a), dev.array(b), dev.zeros(n)

    def vec_add():
        dev.launch(va, "vec_add", n // 256, 256, pa, pb, pc, n)
    yield "vector add 2^24 f32", vec_add, lambda: dev.mem.view(pc, 4 * n).fill(0), \
        lambda: np.array_equal(dev.read(pc, n), a + b)

    M = 1024
    A, B = rng.random((M, M), np.float32), rng.random((M, M), np.float32)
    mm = dev.load("matmul.cu", arch)
    pA, pB, pC = dev.array(A), dev.array(B), dev.zeros(M * M)

    def matmul():
        dev.launch(mm, "matmul", (M // 16, M // 16, 1), (16, 16, 1), pA, pB, pC, M, M, M)
    yield "matmul 1024x1024 tiled", matmul, lambda: dev.mem.view(pC, 4 * M * M).fill(0), \
        lambda: np.allclose(dev.read(pC, M * M).reshape(M, M), A.astype(np.float64) @ B, rtol=1e-4)

    n = 1 << 20
    rd = dev.load("reduce.cu", arch)
    po = dev.zeros(1)

    def reduce():
        dev.launch(rd, "reduce_sum", n // 512, 256, pa, po, n, shared=256 * 4)
    yield "reduction 2^20 f32 shfl", reduce, lambda: dev.mem.view(po, 4).fill(0), \
        lambda: abs(dev.read(po, 1)[0] / a[:n].astype(np.float64).sum() - 1) < 1e-5


def timed(run, clear, check, repeat):
    """Best time of `repeat` runs, and check() of the last one. Each run starts on cleared outputs,
    untimed: a result the other engine (or an earlier run) left there never passes for this one's."""
    times = []
    for _ in range(repeat):
        clear()
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return min(times), check()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="compute_90")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--interp-repeat", type=int, default=1, help="launches timed in the interpreter (slow)")
    args = ap.parse_args()
    dev = Device(1 << 30)
    print(f"{len(os.sched_getaffinity(0))} cores")
    print(f"{'kernel':<26}{'first':>8}{'compiled':>10}{'interp':>9}{'speed-up':>10}{'target':>8}  result")
    ok = True
    for name, run, clear, check in bench(dev, args.arch):
        os.environ["PHOS_EMU_COMPILER"] = "1"
        clear()
        t = time.perf_counter()
        run()
        first = time.perf_counter() - t
        comp, good_c = timed(run, clear, check, args.repeat)
        os.environ["PHOS_EMU_COMPILER"] = "0"
        interp, good_i = timed(run, clear, check, args.interp_repeat)
        target = TARGETS[name]
        met = comp <= target
        ok &= good_c and good_i and met
        print(f"{name:<26}{first:>8.3f}{comp:>10.3f}{interp:>9.2f}{interp / comp:>9.0f}x{target:>8.1f}  "
              f"{'ok' if good_c and good_i else 'WRONG'}{'' if met else ' (over target)'}")
    os.environ.pop("PHOS_EMU_COMPILER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
