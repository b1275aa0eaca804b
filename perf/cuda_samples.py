#!/usr/bin/env python3
"""NVIDIA's cuda-samples, natively and on phos: which run, on which runtime?

    python3 perf/cuda_samples.py SAMPLES_DIR [--only a,b] [--timeout 120] [--jobs N]

SAMPLES_DIR is a checkout of github.com/NVIDIA/cuda-samples (the folder holding Common/
and Samples/). Each sample in SAMPLES below is built with nvcc, unchanged, as
`nvcc -cudart shared -gencode arch=compute_90,code=compute_90` (PTX only, so that the emu
backend can interpret it; a GPU's driver compiles it), and run:

  native   NVIDIA's libcudart.so.13 and driver (only where `nvidia-smi` works)
  phos     LD_LIBRARY_PATH=phos/stub: NVIDIA's libcudart.so.13 (the copy phos/stub holds)
           on phos's libcuda.so.1, as PyTorch runs

Each phos run gets a server of its own, which this script starts on a private ipc socket
(backend `cuda` where a GPU is, else `emu`; --backend picks, --server uses a running one
instead) and stops after the run, workers and all.
Every run has a time limit (--timeout); on emu a run that outlasts it is reported as
"slow" (too slow for the PTX interpreter), not as a failure. A sample passes when it exits
0 and prints its own success marker where it has one; "ran" is an exit 0 of a sample with
no self-check; "waived" is its exit 2 (EXIT_WAIVED: a feature it needs is absent).
Failures are listed with the stub's own lines (`phos: unsupported CUDA call X`, with
PHOS_VERBOSE=1 the failing call's message) and the sample's error line.

Prints one table and the reasons; exits 0 (it measures, it does not judge). Ends every
process it starts: each run is its own process group, killed whole after it returns or
times out, and so is the server.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CUDA_HOME = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))

# Markers: a regex the sample prints on success (None: its exit status is its verdict).
PASS_RES = r"Result = PASS"
PASSED = r"PASSED"
TEST_PASSED = r"Test passed"
OK_RET = r"returned OK"


@dataclass
class Sample:
    path: str                         # under Samples/
    marker: str | None = None         # success marker (regex); None: exit 0 is enough
    checks: bool = True               # False: no self-check at all (exit 0 = "ran")
    args: tuple[str, ...] = ()
    fatbin: tuple[str, str] | None = None   # (kernel source, file name the sample loads)
    ptx: tuple[str, str] | None = None      # (kernel source, file name the sample loads)
    libs: tuple[str, ...] = ()        # extra link flags
    flags: tuple[str, ...] = ()       # extra nvcc flags
    note: str = ""                    # what the sample needs, for the reader

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[1]


# The samples run: small, self-checking programs with no graphics, MPI or CUDA libraries.
SAMPLES = [
    # 0_Introduction
    Sample("0_Introduction/asyncAPI"),
    Sample("0_Introduction/clock", checks=False),
    Sample("0_Introduction/cudaOpenMP", flags=("-Xcompiler", "-fopenmp"), libs=("-lgomp",)),
    Sample("0_Introduction/fp16ScalarProduct", marker=PASSED),
    Sample("0_Introduction/matrixMul", marker=PASS_RES),
    Sample("0_Introduction/matrixMulDrv", marker=PASS_RES, fatbin=("matrixMul_kernel.cu", "matrixMul_kernel64.fatbin"),
           libs=("-lcuda",), note="driver API only"),
    Sample("0_Introduction/matrixMulDynlinkJIT", libs=("-lcuda", "-ldl"), note="driver API (dlopen), PTX JIT"),
    Sample("0_Introduction/mergeSort"),
    Sample("0_Introduction/simpleAWBarrier", marker=PASSED),
    Sample("0_Introduction/simpleAssert", marker=OK_RET),
    Sample("0_Introduction/simpleAtomicIntrinsics", marker=OK_RET),
    Sample("0_Introduction/simpleAttributes"),
    Sample("0_Introduction/simpleCallback", marker=r"Success"),
    Sample("0_Introduction/simpleCooperativeGroups", marker=r"Done"),
    Sample("0_Introduction/simpleCubemapTexture"),
    Sample("0_Introduction/simpleDrvRuntime", marker=PASS_RES, fatbin=("vectorAdd_kernel.cu", "vectorAdd_kernel64.fatbin"),
           libs=("-lcuda",)),
    Sample("0_Introduction/simpleHyperQ"),
    Sample("0_Introduction/simpleIPC", note="forks processes sharing memory by cudaIpc*"),
    Sample("0_Introduction/simpleLayeredTexture"),
    Sample("0_Introduction/simpleMultiCopy"),
    Sample("0_Introduction/simpleMultiGPU"),
    Sample("0_Introduction/simpleOccupancy", marker=r"Test PASSED"),
    Sample("0_Introduction/simpleP2P", note="needs 2 GPUs"),
    Sample("0_Introduction/simplePitchLinearTexture", marker=OK_RET),
    Sample("0_Introduction/simplePrintf", checks=False),
    Sample("0_Introduction/simpleStreams"),
    Sample("0_Introduction/simpleSurfaceWrite", marker=OK_RET),
    Sample("0_Introduction/simpleTemplates", marker=r"Test Results: 0 Failures"),
    Sample("0_Introduction/simpleTexture", marker=OK_RET),
    Sample("0_Introduction/simpleTextureDrv", fatbin=("simpleTexture_kernel.cu", "simpleTexture_kernel64.fatbin"),
           libs=("-lcuda",), note="driver API only"),
    Sample("0_Introduction/simpleVoteIntrinsics"),
    Sample("0_Introduction/simpleZeroCopy"),
    Sample("0_Introduction/systemWideAtomics"),
    Sample("0_Introduction/template"),
    Sample("0_Introduction/vectorAdd", marker=r"Test PASSED"),
    Sample("0_Introduction/vectorAddDrv", marker=PASS_RES, fatbin=("vectorAdd_kernel.cu", "vectorAdd_kernel64.fatbin"),
           libs=("-lcuda",), note="driver API only"),
    Sample("0_Introduction/vectorAddMMAP", marker=PASS_RES, fatbin=("vectorAdd_kernel.cu", "vectorAdd_kernel64.fatbin"),
           libs=("-lcuda",), note="driver API only (virtual memory)"),
    # 1_Utilities
    Sample("1_Utilities/deviceQuery", marker=PASS_RES),
    Sample("1_Utilities/deviceQueryDrv", marker=PASS_RES, libs=("-lcuda",), note="driver API only"),
    Sample("1_Utilities/topologyQuery", checks=False),
    # 2_Concepts_and_Techniques
    Sample("2_Concepts_and_Techniques/convolutionSeparable", marker=TEST_PASSED),
    Sample("2_Concepts_and_Techniques/convolutionTexture", marker=TEST_PASSED),
    Sample("2_Concepts_and_Techniques/dct8x8", marker=TEST_PASSED),
    Sample("2_Concepts_and_Techniques/eigenvalues", marker=r"Test Succeeded"),
    Sample("2_Concepts_and_Techniques/histogram", marker=TEST_PASSED),
    Sample("2_Concepts_and_Techniques/inlinePTX", marker=r"Test Successful"),
    Sample("2_Concepts_and_Techniques/interval"),
    Sample("2_Concepts_and_Techniques/radixSortThrust", marker=TEST_PASSED),
    Sample("2_Concepts_and_Techniques/reduction", marker=TEST_PASSED),
    Sample("2_Concepts_and_Techniques/reductionMultiBlockCG"),
    Sample("2_Concepts_and_Techniques/scalarProd", marker=TEST_PASSED),
    Sample("2_Concepts_and_Techniques/scan"),
    Sample("2_Concepts_and_Techniques/segmentationTreeThrust"),
    Sample("2_Concepts_and_Techniques/shfl_scan"),
    Sample("2_Concepts_and_Techniques/sortingNetworks"),
    Sample("2_Concepts_and_Techniques/streamOrderedAllocation", marker=r"streamOrderedAllocationPostSync PASSED"),
    Sample("2_Concepts_and_Techniques/streamOrderedAllocationIPC", libs=("-lcuda",),
           note="forks processes sharing a memory pool by IPC"),
    Sample("2_Concepts_and_Techniques/streamOrderedAllocationP2P", note="needs 2 GPUs"),
    Sample("2_Concepts_and_Techniques/threadFenceReduction"),
    Sample("2_Concepts_and_Techniques/threadMigration", fatbin=("threadMigration_kernel.cu", "threadMigration_kernel64.fatbin"),
           libs=("-lcuda", "-lpthread"), note="driver API only"),
    # 3_CUDA_Features
    Sample("3_CUDA_Features/StreamPriorities"),
    Sample("3_CUDA_Features/bf16TensorCoreGemm"),
    Sample("3_CUDA_Features/binaryPartitionCG", checks=False),
    Sample("3_CUDA_Features/cudaCompressibleMemory", libs=("-lcuda",)),
    Sample("3_CUDA_Features/cudaTensorCoreGemm"),
    Sample("3_CUDA_Features/dmmaTensorCoreGemm"),
    Sample("3_CUDA_Features/globalToShmemAsyncCopy", marker=PASS_RES),
    Sample("3_CUDA_Features/graphConditionalNodes", checks=False),
    Sample("3_CUDA_Features/graphMemoryFootprint"),
    Sample("3_CUDA_Features/graphMemoryNodes", marker=r"Validation PASSED"),
    Sample("3_CUDA_Features/immaTensorCoreGemm"),
    Sample("3_CUDA_Features/jacobiCudaGraphs", marker=PASSED),
    Sample("3_CUDA_Features/memMapIPCDrv", ptx=("memMapIpc_kernel.cu", "memMapIpc_kernel64.ptx"), libs=("-lcuda", "-lrt"),
           note="driver API only; forks processes sharing memory by VMM handles"),
    Sample("3_CUDA_Features/newdelete"),
    Sample("3_CUDA_Features/ptxjit", ptx=("ptxjit_kernel.cu", "ptxjit_kernel64.ptx"), libs=("-lcuda",),
           note="cuLink* PTX JIT, runtime launch"),
    Sample("3_CUDA_Features/simpleCudaGraphs", checks=False),
    Sample("3_CUDA_Features/tf32TensorCoreGemm"),
    Sample("3_CUDA_Features/warpAggregatedAtomicsCG", marker=PASSED),
    # 5_Domain_Specific
    Sample("5_Domain_Specific/BlackScholes", marker=TEST_PASSED),
    Sample("5_Domain_Specific/FDTD3d"),
    Sample("5_Domain_Specific/HSOpticalFlow"),
    Sample("5_Domain_Specific/SobolQRNG"),
    Sample("5_Domain_Specific/binomialOptions", marker=TEST_PASSED),
    Sample("5_Domain_Specific/dxtc", marker=TEST_PASSED),
    Sample("5_Domain_Specific/fastWalshTransform", marker=TEST_PASSED),
    Sample("5_Domain_Specific/quasirandomGenerator"),
    Sample("5_Domain_Specific/stereoDisparity"),
    # 6_Performance
    Sample("6_Performance/LargeKernelParameter", marker=TEST_PASSED),
    Sample("6_Performance/UnifiedMemoryPerf"),
    Sample("6_Performance/alignedTypes", marker=TEST_PASSED),
    Sample("6_Performance/cudaGraphsPerfScaling", marker=TEST_PASSED),
    Sample("6_Performance/transpose", marker=TEST_PASSED),
]

# Not built, and why (the rest of Samples/ is graphics, D3D/Vulkan/EGL, NVRTC or libraries).
NOT_BUILT = {
    "0_Introduction/UnifiedMemoryStreams": "needs cuBLAS and OpenMP",
    "0_Introduction/*_nvrtc, 2_Concepts_and_Techniques/inlinePTX_nvrtc, 5_Domain_Specific/*_nvrtc":
        "need libnvrtc, and NVRTC compiles to SASS (cubin) that the emu backend cannot run; driver API only",
    "0_Introduction/simpleCUDA2GL, simpleTexture3D, 2_Concepts_and_Techniques/boxFilter, FunctionPointers, "
    "imageDenoising, particles, 3_CUDA_Features/bindlessTexture, 5_Domain_Specific/*GL*, Mandelbrot, "
    "SobelFilter, bicubicTexture, bilateralFilter, marchingCubes, nbody, recursiveGaussian, smokeParticles, "
    "volumeFiltering, volumeRender": "OpenGL/GLUT",
    "0_Introduction/simpleMPI": "MPI",
    "2_Concepts_and_Techniques/EGLStream_*": "EGL",
    "2_Concepts_and_Techniques/MC_*": "cuRAND (curand_kernel.h, libcurand)",
    "3_CUDA_Features/cdp*": "dynamic parallelism: needs -rdc=true and libcudadevrt, device-side launches",
    "5_Domain_Specific/MonteCarloMultiGPU": "cuRAND",
    "5_Domain_Specific/convolutionFFT2D": "cuFFT",
    "5_Domain_Specific/dwtHaar1D": "its data files (signal_2_18.dat, regression_2_18.gold.dat) were missing objects "
                                   "in the mirror this list was made from",
    "5_Domain_Specific/NV12toBGRandResize": "no self-check: converts video frames and writes images",
    "5_Domain_Specific/p2pBandwidthLatencyTest": "a bandwidth benchmark over several GPUs, no self-check",
    "5_Domain_Specific/simpleD3D*, simpleVulkan*, vulkanImageCUDA": "Direct3D / Vulkan",
    "4_CUDA_Libraries/*, 7_libNVVM/*, 8_Platform_Specific/*": "CUDA libraries, libNVVM, Tegra/Windows",
}

# POSIX shared memory the IPC samples name after a pid and leave behind when they fail
SHM_PREFIXES = ("simpleIPCshm", "streamOrderedAllocationIPCshm", "memmap_ipc_shm")
SHM = Path("/dev/shm")

MODES = ("native", "phos")
HEADERS = {"native": "native", "phos": "phos"}


@dataclass
class Outcome:
    verdict: str        # pass, ran, waived, FAIL, slow/timeout, build, error (no server), -
    seconds: float = 0.0
    rc: int | None = None
    reason: str = ""


@dataclass
class Procs:
    """Every process group this script starts (leader's pid: its Popen), so that all are
    ended however it stops."""
    groups: dict[int, subprocess.Popen] = field(default_factory=dict)

    def add(self, p: subprocess.Popen) -> None:
        self.groups[p.pid] = p

    def end(self, pid: int, grace: float = 0.0) -> None:
        """SIGTERM, up to `grace` seconds for the group to go, then SIGKILL."""
        p = self.groups.pop(pid, None)
        try:
            if grace:
                os.killpg(pid, signal.SIGTERM)
                deadline = time.monotonic() + grace
                while time.monotonic() < deadline:
                    if p:
                        p.poll()          # reap the leader: a zombie still counts as the group's
                    os.killpg(pid, 0)     # raises once no process of the group is left
                    time.sleep(0.05)
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if p:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def end_all(self) -> None:
        for pid in list(self.groups):
            self.end(pid)


PROCS = Procs()
STOPPING: list[int] = []   # a signal came: start no more runs


def run_group(cmd: list[str], *, cwd: Path, env: dict, timeout: float) -> tuple[int | None, str, str, float]:
    """Runs cmd as its own process group; kills the whole group when it returns or times out.
    Returns (exit status or None on timeout, stdout, stderr, seconds)."""
    start = time.monotonic()
    if STOPPING:
        return None, "", "stopped", 0.0
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
    PROCS.add(p)
    try:
        out, err = p.communicate(timeout=timeout)
        rc: int | None = p.returncode
    except subprocess.TimeoutExpired:
        PROCS.end(p.pid)
        out, err = p.communicate()
        rc = None
    PROCS.end(p.pid)   # children it forked (simpleIPC, ...) go with it
    return rc, out.decode(errors="replace"), err.decode(errors="replace"), time.monotonic() - start


def sources_of(sdir: Path, name: str) -> list[str]:
    """The executable's sources as its CMakeLists.txt names them."""
    text = (sdir / "CMakeLists.txt").read_text()
    m = re.search(r"add_executable\(\s*" + re.escape(name) + r"\s+([^)]*)\)", text)
    if not m:
        raise RuntimeError(f"no add_executable({name} ...) in {sdir}/CMakeLists.txt")
    return [s for s in m.group(1).split() if not s.startswith("$")]


def build(sample: Sample, samples_dir: Path, bdir: Path, lib_dir: Path, reuse: bool = False) -> str | None:
    """Builds one sample into bdir; returns None, or the reason it did not build."""
    sdir = samples_dir / "Samples" / sample.path
    if reuse and (bdir / sample.name).exists():
        return None
    bdir.mkdir(parents=True, exist_ok=True)
    if (sdir / "data").is_dir() and not (bdir / "data").exists():
        (bdir / "data").symlink_to(sdir / "data")
    nvcc = str(CUDA_HOME / "bin" / "nvcc") if (CUDA_HOME / "bin" / "nvcc").exists() else "nvcc"
    common = [nvcc, "-std=c++17", "--extended-lambda", "-Wno-deprecated-gpu-targets", "-I", str(samples_dir / "Common"),
              "-I", str(sdir)] + (["-I", str(sdir / "inc")] if (sdir / "inc").is_dir() else [])
    gencode = ["-gencode", "arch=compute_90,code=compute_90"]
    steps = []
    if sample.fatbin:
        steps.append(common + gencode + ["-fatbin", "-o", str(bdir / sample.fatbin[1]), str(sdir / sample.fatbin[0])])
    if sample.ptx:
        steps.append(common + ["-arch=compute_90", "-ptx", "-o", str(bdir / sample.ptx[1]), str(sdir / sample.ptx[0])])
    srcs = [str((sdir / s).resolve()) for s in sources_of(sdir, sample.name)]
    steps.append(common + gencode + ["-cudart", "shared", *sample.flags, "-o", str(bdir / sample.name), *srcs,
                                     "-L", str(lib_dir), *sample.libs])
    for cmd in steps:
        r = subprocess.run(cmd, cwd=bdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            (bdir / "build.log").write_text(" ".join(cmd) + "\n" + r.stdout)
            errs = [ln for ln in r.stdout.splitlines() if "error" in ln.lower()] or r.stdout.splitlines()[-1:]
            return (errs[0] if errs else f"nvcc exit {r.returncode}").strip()[:200]
    return None


def reason_of(out: str, err: str, rc: int | None) -> str:
    """The stub's own lines first (unsupported calls, refusals), then the sample's error line."""
    phos = []
    for ln in err.splitlines():
        ln = ln.strip()
        if ln.startswith("phos:") and ln not in phos:
            phos.append(ln)
    # the stub's routine PHOS_VERBOSE lines say nothing about the failure
    keyw = re.compile(r"unsupported|not supported|refus|fail|error|invalid|cannot|unknown|no such|not a bound|"
                      r"moduleLoad|launchBatch", re.I)
    phos = [ln for ln in phos if keyw.search(ln)]
    phos.sort(key=lambda ln: 0 if "unsupported" in ln else 1)
    app = []
    for ln in (out + "\n" + err).splitlines():
        ln = ln.strip()
        if ln.startswith("phos:") or not ln:
            continue
        if re.search(r"CUDA error|code=\d|error|fail|mismatch|not supported|abort|assert|terminate|segmentation", ln, re.I):
            if ln not in app:
                app.append(ln)
    why = phos[:3] + app[:2]
    if rc is not None and rc < 0:
        why.append(f"killed by signal {-rc}")
    if not why:
        tail = [ln.strip() for ln in (out + "\n" + err).splitlines() if ln.strip() and not ln.startswith("phos:")]
        why = [f"exit {rc}; last line: {tail[-1]}" if tail else f"exit {rc}, no output"]
    return " | ".join(s[:220] for s in why)


def judge(sample: Sample, rc: int | None, out: str, err: str, secs: float, slow_word: str) -> Outcome:
    if rc is None:
        return Outcome(slow_word, secs, rc, f"no exit within the time limit ({secs:.0f} s)")
    if rc != 0 and slow_word == "slow" and re.search(r"LaunchTimeout|LAUNCH_TIMEOUT|code=702", out + err):
        # emu's own limit on one launch (PHOS_EMU_LAUNCH_TIMEOUT) ended a kernel: too slow, not wrong
        return Outcome(slow_word, secs, rc, "a launch outran the emu backend's PHOS_EMU_LAUNCH_TIMEOUT")
    if rc == 2:   # the sample's own word on what it lacks
        said = [ln.strip() for ln in (out + "\n" + err).splitlines()
                if re.search(r"waiv|not support|doesn't support|requires|needs|at least", ln, re.I)
                and not ln.startswith("phos:")]
        return Outcome("waived", secs, rc, said[0][:220] if said else reason_of(out, err, rc))
    if rc == 0:
        if sample.marker and not re.search(sample.marker, out + err):
            return Outcome("FAIL", secs, rc, f"exit 0 but no '{sample.marker}' | " + reason_of(out, err, rc))
        return Outcome("pass" if sample.checks else "ran", secs, rc)
    return Outcome("FAIL", secs, rc, reason_of(out, err, rc))


def start_server(backend: str, sock_dir: Path) -> tuple[str, int]:
    """A phos server on a private ipc socket in sock_dir, as its own process group (its
    context workers are in it too); returns (address, group id)."""
    sock = sock_dir / "phos.sock"
    addr = f"ipc://{sock}"
    if STOPPING:
        raise RuntimeError("stopped")
    with open(sock_dir / "server.log", "wb") as log:
        # one emu launch may run as long as the whole run may (the default ends it at 60 s)
        env = dict(os.environ, PHOS_EMU_LAUNCH_TIMEOUT=os.environ.get("PHOS_EMU_LAUNCH_TIMEOUT", "0"))
        p = subprocess.Popen([sys.executable, "-m", "phos.cli", "server", "--backend", backend, "--listen", addr],
                             cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    PROCS.add(p)
    for _ in range(600):
        if sock.exists() or p.poll() is not None:
            break
        time.sleep(0.05)
    if not sock.exists():
        PROCS.end(p.pid)
        lines = [ln for ln in (sock_dir / "server.log").read_text(errors="replace").splitlines() if ln.strip()]
        raise RuntimeError(f"the {backend} server did not start: " + (lines[-1].strip() if lines else "no output"))
    return addr, p.pid


def have_gpu() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("samples_dir", type=Path, help="a cuda-samples checkout (holds Common/ and Samples/)")
    ap.add_argument("--only", help="comma-separated sample names (default: all in SAMPLES)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per run (default 120)")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="samples run at once (default: half the CPUs)")
    ap.add_argument("--backend", choices=("emu", "cuda"), help="default: cuda with a GPU, else emu")
    ap.add_argument("--server", help="a running phos server to use instead of starting one")
    ap.add_argument("--modes", default=",".join(MODES), help="which of native,phos to run")
    ap.add_argument("--work", type=Path, help="build and run folder (default: a temporary one, removed)")
    ap.add_argument("--reuse", action="store_true", help="keep binaries already built in --work")
    ap.add_argument("--stub", type=Path, default=ROOT / "phos" / "stub", help="phos's native stub (phos/stub)")
    args = ap.parse_args()

    samples_dir = args.samples_dir.resolve()
    if not (samples_dir / "Common").is_dir() or not (samples_dir / "Samples").is_dir():
        ap.error(f"{samples_dir} has no Common/ and Samples/")
    stub = args.stub.resolve()
    if not (stub / "libcuda.so.1").exists() or not (stub / "libcudart.so.13").exists():
        ap.error(f"no native stub in {stub}: make -C client_stub/native")
    chosen = SAMPLES
    if args.only:
        want = set(args.only.split(","))
        chosen = [s for s in SAMPLES if s.name in want]
        missing = want - {s.name for s in chosen}
        if missing:
            ap.error("not in SAMPLES: " + ", ".join(sorted(missing)))
    gpu = have_gpu()
    backend = args.backend or ("cuda" if gpu else "emu")
    modes = [m for m in args.modes.split(",") if m in MODES]
    if "native" in modes and not gpu:
        modes.remove("native")
    slow_word = "slow" if backend == "emu" else "timeout"

    t0 = time.monotonic()
    tmp = None
    if args.work:
        work = args.work.resolve()
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.mkdtemp(prefix="phos-samples-")
        work = Path(tmp)

    def stop(signum, frame):
        # end what runs now so that the worker threads return, and start nothing new
        STOPPING.append(signum)
        PROCS.end_all()
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    results: dict[str, dict[str, Outcome]] = {s.name: {} for s in chosen}
    shm_before = set(os.listdir(SHM)) if SHM.is_dir() else set()
    try:
        # -lcuda links against CUDA's stub library, else phos's libcuda.so (both export every cu*)
        lib_dir = CUDA_HOME / "lib64" / "stubs"
        if not (lib_dir / "libcuda.so").exists():
            lib_dir = stub
        print(f"building {len(chosen)} samples in {work} ...", flush=True)
        tb = time.monotonic()
        built = []
        ex = concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2)
        try:
            futs = {ex.submit(build, s, samples_dir, work / s.name, lib_dir, args.reuse): s for s in chosen}
            for f in concurrent.futures.as_completed(futs):
                s = futs[f]
                try:
                    why = f.result()
                except Exception as e:  # noqa: BLE001 - a sample that cannot build is reported, not fatal
                    why = str(e)
                if why:
                    for m in modes:
                        results[s.name][m] = Outcome("build", 0, None, why)
                else:
                    built.append(s)
        finally:
            ex.shutdown(wait=True, cancel_futures=True)
        build_s = time.monotonic() - tb
        built.sort(key=chosen.index)
        print(f"built {len(built)}/{len(chosen)} in {build_s:.0f} s", flush=True)

        # Each phos run gets a server of its own unless --server names one: a client killed at
        # its time limit leaves its worker running the launches already sent, for minutes on emu,
        # and ending the server's process group ends that worker too.
        print(f"phos runs: {'server ' + args.server if args.server else 'a private ' + backend + ' server each'}",
              flush=True)
        base = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PHOS_SERVER", "CUDA_VISIBLE_DEVICES")}
        prev = os.environ.get("LD_LIBRARY_PATH")
        tail = f":{prev}" if prev else ""
        envs = {
            "native": dict(base, LD_LIBRARY_PATH=f"{CUDA_HOME / 'lib64'}{tail}"),
            "phos": dict(base, LD_LIBRARY_PATH=f"{stub}{tail}", PHOS_VERBOSE="1"),
        }

        def one(s: Sample, mode: str) -> tuple[str, str, Outcome]:
            bdir = work / s.name
            env = envs[mode]
            server_pid = None
            sock_dir = None
            if mode != "native":
                if args.server:
                    env = dict(env, PHOS_SERVER=args.server)
                else:   # a short path: an ipc socket's name has a length limit
                    sock_dir = Path(tempfile.mkdtemp(prefix="phos-cs-", dir="/tmp"))
                    try:
                        addr, server_pid = start_server(backend, sock_dir)
                    except RuntimeError as e:
                        shutil.rmtree(sock_dir, ignore_errors=True)
                        return s.name, mode, Outcome("error", 0, None, str(e))
                    env = dict(env, PHOS_SERVER=addr)
            try:
                rc, out, err, secs = run_group([str(bdir / s.name), *s.args], cwd=bdir, env=env, timeout=args.timeout)
            finally:
                if server_pid:
                    PROCS.end(server_pid, grace=5.0)
                if sock_dir:
                    if (sock_dir / "server.log").exists():
                        shutil.copy(sock_dir / "server.log", bdir / f"{mode}.server.log")
                    shutil.rmtree(sock_dir, ignore_errors=True)
            (bdir / f"{mode}.out").write_text(out)
            (bdir / f"{mode}.err").write_text(err)
            o = judge(s, rc, out, err, secs, "timeout" if mode == "native" else slow_word)
            if STOPPING:
                o = Outcome("stopped", secs, rc, "interrupted")
            print(f"  {s.name:28s} {HEADERS[mode]:24s} {o.verdict:7s} {secs:6.1f} s", flush=True)
            return s.name, mode, o

        tr = time.monotonic()
        ex = concurrent.futures.ThreadPoolExecutor(max(1, args.jobs))
        try:
            futs = [ex.submit(one, s, m) for s in built for m in modes]
            for f in concurrent.futures.as_completed(futs):
                name, mode, o = f.result()
                results[name][mode] = o
        finally:
            ex.shutdown(wait=True, cancel_futures=True)
        run_s = time.monotonic() - tr
    finally:
        PROCS.end_all()
        if SHM.is_dir():
            for n in set(os.listdir(SHM)) - shm_before:
                if n.startswith(SHM_PREFIXES):
                    (SHM / n).unlink(missing_ok=True)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    # the table
    cols = [m for m in MODES if m in modes]
    print()
    print(f"cuda-samples on phos ({backend} backend), limit {args.timeout:.0f} s a run; GPU here: {'yes' if gpu else 'no'}")
    head = ["sample"] + [HEADERS[m] for m in cols]
    rows = [[s.name] + [cell(results[s.name].get(m)) for m in cols] for s in chosen]
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    print()
    for m in cols:
        counts: dict[str, int] = {}
        for s in chosen:
            v = results[s.name].get(m, Outcome("-")).verdict
            counts[v] = counts.get(v, 0) + 1
        print(f"{HEADERS[m]:24s} " + ", ".join(f"{k} {counts[k]}" for k in ("pass", "ran", "waived", "FAIL", slow_word, "build", "error")
                                              if k in counts))
    print("\nreasons (failures, waivers, builds):")
    for s in chosen:
        for m in cols:
            o = results[s.name].get(m)
            if o and o.verdict in ("FAIL", "waived", "build", "error"):
                print(f"  {s.name} [{HEADERS[m]}] {o.verdict}: {o.reason}")
    print("\nnot built:")
    for k, v in NOT_BUILT.items():
        print(f"  {k}: {v}")
    print(f"\ntook {time.monotonic() - t0:.0f} s (build {build_s:.0f} s, runs {run_s:.0f} s, {args.jobs} at once)")
    return 0


def cell(o: Outcome | None) -> str:
    if o is None:
        return "-"
    if o.verdict in ("build",):
        return "build failed"
    return f"{o.verdict} ({o.seconds:.1f} s)" if o.verdict != "slow" else f"slow (>{o.seconds:.0f} s)"


if __name__ == "__main__":
    sys.exit(main())
