"""Time per launch of the emu backend's PTX interpreter on three reference kernels.

    python perf/bench_emu.py [--arch compute_90] [--repeat 3]

Compiles tests/kernels/*.cu with nvcc (cached under tmp), runs each kernel directly on
EmuMemory, checks the result against NumPy and prints the best time of `repeat` launches.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from ptx_helpers import Device  # noqa: E402

TARGETS = {"vector add 2^20 f32": 0.5, "matmul 256x256 tiled": 3.0, "reduction 2^20 f32": None}


def bench(dev, arch, repeat):
    rng = np.random.default_rng(0)
    n = 1 << 20
    a, b = rng.random(n, np.float32), rng.random(n, np.float32)
    va = dev.load("vecadd.cu", arch)
    pa, pb, pc = dev.array(a), dev.array(b), dev.zeros(n)
    yield "vector add 2^20 f32", lambda: dev.launch(va, "vec_add", n // 256, 256, pa, pb, pc, n), \
        lambda: np.array_equal(dev.read(pc, n), a + b)

    M = 256
    A, B = rng.random((M, M), np.float32), rng.random((M, M), np.float32)
    mm = dev.load("matmul.cu", arch)
    pA, pB, pC = dev.array(A), dev.array(B), dev.zeros(M * M)
    yield "matmul 256x256 tiled", lambda: dev.launch(mm, "matmul", (M // 16, M // 16, 1), (16, 16, 1), pA, pB, pC, M, M, M), \
        lambda: np.allclose(dev.read(pC, M * M).reshape(M, M), A.astype(np.float64) @ B, rtol=1e-5)

    rd = dev.load("reduce.cu", arch)
    po = dev.zeros(1)

    def reduce():
        dev.mem.view(po, 4)[:] = 0
        dev.launch(rd, "reduce_sum", 1024, 256, pa, po, n, shared=256 * 4)
    yield "reduction 2^20 f32", reduce, lambda: abs(dev.read(po, 1)[0] / a.astype(np.float64).sum() - 1) < 1e-5


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="compute_90")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    dev = Device(1 << 30)
    print(f"{'kernel':<24}{'arch':<12}{'s/launch':>10}{'target':>9}  result")
    ok = True
    for name, run, check in bench(dev, args.arch, args.repeat):
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
        good, target = check(), TARGETS[name]
        met = target is None or min(times) <= target
        ok &= good and met
        print(f"{name:<24}{args.arch:<12}{min(times):>10.3f}{'-' if target is None else f'{target:.1f}':>9}  "
              f"{'ok' if good else 'WRONG'}{'' if met else ' (over target)'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
