"""PTX kernels compiled to native code: C (cgen.py) through gcc, loaded with ctypes.

Why C through gcc rather than llvmlite: gcc is already required by the set-up, the C a
kernel becomes is readable when a result must be checked by eye, and gcc -O2 code ran the
benchmark kernels (perf/bench_emu.py) as fast as we need; llvmlite would add a dependency
and a second IR to maintain for no measured gain. A compiled kernel is a shared object named
by the digest of its C source (which holds the whole kernel and its layout), kept in memory
and on disk, so a second process, or a second server, reuses it without calling gcc.

Blocks spread over the cores: each OS thread runs a range of blocks in C, with the GIL
released by ctypes. A kernel cgen refuses runs in the interpreter, which says so once a kernel.
"""
import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import numpy as np

from phos.gpu_server.ptx.cgen import KernelSource, Refused
from phos.gpu_server.ptx.decode import err
from phos.schema.cuda_types import CUresult

log = logging.getLogger(__name__)
CFLAGS = ["-O2", "-shared", "-fPIC", "-fno-strict-aliasing", "-ffp-contract=off", "-fno-math-errno",
          "-w", "-std=gnu11"]


def cpu_flags():
    """-mfma where the CPU has it: fma.rn then is one instruction, not a call into libm's fmaf
    (the tiled matmul ran 2x slower through the call). Part of the digest: a cache directory
    shared between machines never hands one a kernel its CPU cannot run."""
    try:
        words = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return ["-mfma"] if "fma" in words and os.uname().machine == "x86_64" else []
CHUNK_BLOCKS = 64           # blocks a worker takes at a time: spreads uneven blocks, amortises the call


class Ctx(ctypes.Structure):
    """Mirror of the C runtime's Ctx (crt.py)."""
    _fields_ = [("arena", ctypes.c_void_p), ("base", ctypes.c_uint64),
                ("lo", ctypes.c_void_p), ("hi", ctypes.c_void_p), ("host", ctypes.c_void_p), ("nalloc", ctypes.c_int64),
                ("params", ctypes.c_void_p), ("psize", ctypes.c_uint64), ("gsym", ctypes.c_void_p),
                ("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3),
                ("shbytes", ctypes.c_uint64), ("dyn", ctypes.c_uint64), ("local_size", ctypes.c_uint64),
                ("stop", ctypes.c_int32), ("err", ctypes.c_int32), ("err_line", ctypes.c_int32),
                ("err_width", ctypes.c_int32), ("err_addr", ctypes.c_uint64)]


def cache_dir():
    from phos import settings
    d = settings.emu_kernel_cache()
    return Path(d) if d else Path(tempfile.gettempdir()) / f"phos-emu-kernels-{os.getuid()}"


_loaded = {}                # digest -> ctypes function: one load a process
_lock = threading.Lock()
_pool = None


def workers():
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max(1, len(os.sched_getaffinity(0))), thread_name_prefix="emu-blocks")
    return _pool


def build(source):
    """run_blocks of the shared object compiled from C source (from the disk cache if there)."""
    flags = CFLAGS + cpu_flags()
    digest = hashlib.sha256((" ".join(flags) + "\n" + source).encode()).hexdigest()[:32]
    with _lock:
        fn = _loaded.get(digest)
        if fn is not None:
            return fn
        d = cache_dir()
        so = d / f"{digest}.so"
        if not so.exists():
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / f"{digest}.{os.getpid()}.{threading.get_ident()}"
            Path(f"{tmp}.c").write_text(source)
            r = subprocess.run(["gcc", *flags, f"{tmp}.c", "-o", f"{tmp}.so", "-lm"], capture_output=True, text=True)
            os.unlink(f"{tmp}.c")
            if r.returncode:
                raise Refused(f"gcc failed: {r.stderr[:2000]}")
            os.replace(f"{tmp}.so", so)            # atomic: a concurrent process sees all of it or none
        lib = ctypes.CDLL(str(so))
        fn = lib.run_blocks
        fn.argtypes = [ctypes.POINTER(Ctx), ctypes.c_int64, ctypes.c_int64]
        fn.restype = ctypes.c_int
        _loaded[digest] = fn
        return fn


class Compiled:
    """A kernel's native code, or None in .fn where it is refused (.why says why)."""

    def __init__(self, K):
        self.fn, self.why, self.globals = None, None, []
        try:
            src = KernelSource(K)
            self.globals = src.globals
            self.fn = build(src.text)
        except Refused as e:
            self.why = str(e)
            log.warning("emu: kernel '%s' runs in the PTX interpreter: the compiler %s", K.name,
                        self.why if self.why.startswith("gcc") else f"refused {self.why}")


def compiled(K):
    """K's Compiled, made on first use (one per Kernel, so the fallback is logged once)."""
    c = K.__dict__.get('_compiled')
    if c is None:
        c = K._compiled = Compiled(K)
    return c


def allocations(mem):
    """Sorted (lo, hi, host pointer) arrays of every allocation and host window kernels may touch."""
    arena = mem.arena.ctypes.data
    lo = [int(x) for x in mem._bases]
    hi = [int(x) for x in mem._ends]
    host = [arena + a - mem.base for a in lo]
    for a, b, buf in mem.host_windows:
        lo.append(int(a))
        hi.append(int(b))
        host.append(np.asarray(buf).ctypes.data if not isinstance(buf, int) else buf)
    order = np.argsort(np.array(lo, np.uint64), kind='stable')
    return (np.array(lo, np.uint64)[order], np.array(hi, np.uint64)[order],
            np.array(host, np.uint64)[order])


ERRORS = {1: (CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, "{w}-byte access at {a:#x} is outside every allocation"),
          2: (CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, "{w}-byte shared access outside the shared memory, at {a:#x}"),
          3: (CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, "{w}-byte local access outside the local memory, at {a:#x}"),
          4: (CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, "{w}-byte param access outside the parameters, at {a:#x}"),
          5: (CUresult.CUDA_ERROR_MISALIGNED_ADDRESS, "misaligned {w}-byte access at {a:#x}"),
          6: (CUresult.CUDA_ERROR_LAUNCH_FAILED, "deadlock, {a} threads wait at a barrier that cannot complete"),
          7: (CUresult.CUDA_ERROR_LAUNCH_TIMEOUT, "stopped at the emu's launch time limit (PHOS_EMU_LAUNCH_TIMEOUT)"),
          8: (None, "trap at line {line}")}


def launch(C, K, mem, symbols, grid, block, dyn, params, deadline):
    """Run the whole grid of K's compiled code C; raises CudaError as the interpreter does."""
    from phos.gpu_server.ptx.interp import TRAP_STATUS
    lo, hi, host = allocations(mem)
    pbuf = np.frombuffer(bytes(params) + bytes(8), np.uint8)
    gsym = np.array([symbols[g] for g in C.globals] or [0], np.uint64)
    c = Ctx()
    c.arena, c.base = mem.arena.ctypes.data, mem.base
    c.lo, c.hi, c.host, c.nalloc = lo.ctypes.data, hi.ctypes.data, host.ctypes.data, len(lo)
    c.params, c.psize, c.gsym = pbuf.ctypes.data, len(params), gsym.ctypes.data
    c.grid[:], c.block[:] = grid, block
    c.shbytes, c.dyn, c.local_size = K.shared_static + dyn, dyn, K.local_size
    nblocks = grid[0] * grid[1] * grid[2]
    n = len(os.sched_getaffinity(0))
    chunk = max(1, min(CHUNK_BLOCKS, -(-nblocks // n)))
    ref, taken, lock = ctypes.byref(c), [0], threading.Lock()

    def worker():
        """Ranges of blocks taken in turn (a grid may have 2^63 of them: none listed ahead)."""
        while not c.stop and not c.err:
            with lock:
                first = taken[0]
                taken[0] += chunk
            if first >= nblocks or C.fn(ref, first, min(first + chunk, nblocks)):
                return
    futures = [workers().submit(worker) for _ in range(min(n, -(-nblocks // chunk)))]
    try:
        for f in futures:
            while True:
                left = deadline.at - time.monotonic()
                try:
                    f.result(timeout=None if left == float('inf') else max(left, 0.001))
                    break
                except FutureTimeout:
                    c.stop = 1                      # the blocks in flight stop at their next yield
                    deadline.check()
    finally:
        c.stop = 1
        for f in futures:
            f.result()
        keep = (lo, hi, host, pbuf, gsym)       # noqa: F841 (alive until every block is done)
    if c.err:
        status, msg = ERRORS.get(c.err, (CUresult.CUDA_ERROR_LAUNCH_FAILED, "error {e}"))
        raise err(status or TRAP_STATUS, f"kernel '{K.name}': " + msg.format(w=c.err_width, a=c.err_addr,
                                                                             line=c.err_line, e=c.err))
