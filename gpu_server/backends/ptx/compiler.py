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

from phos.gpu_server.backends.ptx.cgen import KernelSource, Refused
from phos.gpu_server.backends.ptx.decode import TRAP_STATUS, err
from phos.gpu_server.backends.ptx.parser import gc_paused
from phos.schema.cuda_types import CUresult

log = logging.getLogger(__name__)
CFLAGS = ["-shared", "-fPIC", "-fno-strict-aliasing", "-ffp-contract=off", "-fno-math-errno",
          "-w", "-std=gnu11"]


LARGE_SOURCE = 1 << 20      # bytes of C from which gcc optimises at -O1: on sources this large (CUB's onesweep
                            # kernel) -O2 takes gcc several times as long, and the kernel runs as fast from either


def opt_flag(source):
    return "-O1" if len(source) >= LARGE_SOURCE else "-O2"


def cpu_flags():
    """-mfma where the CPU has it: fma.rn then is one instruction, not a call into libm's fmaf
    (a call per fma slows kernels that do many, as the tiled matmul). Part of the digest: a cache directory
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
                ("err_width", ctypes.c_int32), ("err_addr", ctypes.c_uint64), ("host_call", ctypes.c_void_p),
                ("capacity", ctypes.c_uint64), ("envreg", ctypes.c_uint32 * 32)]


HOST_CALL = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int32, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64,
                             ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32)


def cache_dir():
    from phos.base import settings
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
    """The shared object compiled from C source (from the disk cache if there): its run_blocks
    (a range of blocks, one after another) and run_grid (every block at once)."""
    flags = [opt_flag(source)] + CFLAGS + cpu_flags()
    digest = hashlib.sha256((" ".join(flags) + "\n" + source).encode()).hexdigest()[:32]
    with _lock:
        lib = _loaded.get(digest)
        if lib is not None:
            return lib
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
        lib.run_blocks.argtypes = [ctypes.POINTER(Ctx), ctypes.c_int64, ctypes.c_int64]
        lib.run_grid.argtypes = [ctypes.POINTER(Ctx), ctypes.c_int64]
        lib.run_blocks.restype = lib.run_grid.restype = ctypes.c_int
        _loaded[digest] = lib
        return lib


SHAPES = 4                  # launch shapes (block size, shared bytes) a kernel is built for; past them, one build for all


class Compiled:
    """A kernel's C source, and its native code for each launch shape (built on first use): the
    block's thread count and shared memory size as constants let gcc address the threads' save
    slots and check shared accesses with immediates. .fn: the last one built; None, and .why,
    where the kernel is refused."""

    def __init__(self, K):
        self.K, self.fn, self.why, self.globals, self.frame_bytes = K, None, None, [], 0
        self.text, self.libs = None, {}
        try:
            with gc_paused():
                src = KernelSource(K)
            self.globals, self.frame_bytes, self.text = src.globals, src.frame_bytes, src.text
        except Refused as e:
            self.refuse(e)

    def refuse(self, e):
        self.why, self.fn, self.text = str(e), None, None
        log.warning("emu: kernel '%s' runs in the PTX interpreter: the compiler %s", self.K.name,
                    self.why if self.why.startswith("gcc") else f"refused {self.why}")

    def library(self, block, shared_bytes):
        """The native code for blocks of shape `block` (x, y, z) with `shared_bytes` of shared memory,
        or None where the kernel is refused (the interpreter runs it)."""
        if self.text is None:
            return None
        shape = (tuple(block), shared_bytes)
        shape = shape if len(self.libs) < SHAPES or shape in self.libs else None
        lib = self.libs.get(shape)
        if lib is None:
            x, y, z = block
            fixed = "" if shape is None else (
                f"#define BLOCK_THREADS {x * y * z}\n#define BLOCK_X {x}\n#define BLOCK_Y {y}\n#define BLOCK_Z {z}\n"
                f"#define SHARED_FIXED 1\n#define SHARED_BYTES {shared_bytes}ULL\n")
            try:
                lib = self.libs[shape] = build(fixed + self.text)
            except Refused as e:
                self.refuse(e)
                return None
        self.fn = lib
        return lib


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
          8: (None, "trap at line {line}"),
          9: (CUresult.CUDA_ERROR_ASSERT, "device-side assert triggered"),
          11: (CUresult.CUDA_ERROR_ILLEGAL_INSTRUCTION, "brx.idx out of range")}


class Host:
    """printf and assert of the compiled threads (their host_call), formatted as the interpreter
    formats them. The text of a launch is kept and handed to printf in the order the interpreter's
    lanes in step print it: by batch of blocks run together, barrier interval, loop iterations of
    the thread in that interval, the printf's place in the code, block, thread."""

    def __init__(self, K, c, lo, hi, host, pbuf, grid, block, per_batch):
        self.K, self.c, self.lo, self.hi, self.host, self.pbuf = K, c, lo, hi, host, pbuf
        self.grid, self.block, self.per_batch = grid, block, per_batch
        self.out, self.error = [], None
        self.fn = HOST_CALL(self.call)

    def read(self, a, n, loc, shm):
        """n bytes at generic address a, as the thread whose memories are loc and shm sees them."""
        from phos.gpu_server.backends.ptx.decode import LOCAL_WIN, PARAM_WIN, SHARED_WIN, WIN
        for win, base, size in ((SHARED_WIN, shm, self.c.shbytes), (LOCAL_WIN, loc, self.c.local_size),
                                (PARAM_WIN, self.pbuf.ctypes.data, self.c.psize)):
            if 0 <= a - win < WIN:
                if a - win + n > size:
                    break
                return ctypes.string_at(base + a - win, n)
        else:
            i = int(np.searchsorted(self.lo, np.uint64(a), 'right')) - 1
            if i >= 0 and a + n <= int(self.hi[i]):
                return ctypes.string_at(int(self.host[i]) + a - int(self.lo[i]), n)
        raise err(CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, f"kernel '{self.K.name}': {n}-byte access at {a:#x} "
                                                       "is outside every allocation")

    def cstr(self, a, loc, shm):
        out = b""
        while len(out) < 1 << 16:
            ch = self.read(a + len(out), 1, loc, shm)
            if ch == b"\0":
                break
            out += ch
        return out.decode('utf-8', 'replace')

    def call(self, kind, x0, x1, x2, x3, loc, shm, blk, t):
        from phos.gpu_server.backends.ptx import ops
        try:
            if kind == 0:
                if not x0:
                    return -1                       # what printf returns for a NULL format
                fmt = self.cstr(x0, loc, shm)

                def arg(off, size, k):
                    raw = self.read(x1 + off, size, loc, shm)
                    return int.from_bytes(raw, 'little', signed=k == 'i') if k != 'f' else \
                        float(np.frombuffer(raw, np.float64)[0])
                text = ops.format_printf(fmt, arg, lambda a: self.cstr(a, loc, shm))
                site = []                               # the call sites it is in, outermost first
                while x2:
                    site.insert(0, x2 & 0xFFFF)
                    x2 >>= 16
                self.out.append(((blk // self.per_batch, x3 >> 32, x3 & 0xFFFFFFFF, site, blk, t), text))
                return sum(c[-1] != '%' for c in ops._FMT.findall(fmt))     # printf returns the argument count
            msg, file, func = (self.cstr(a, loc, shm) for a in (x0, x1, x3))
            bx, by, bz = self.block
            gx, gy, _ = self.grid
            tid = (t % bx, t // bx % by, t // (bx * by))
            bid = (blk % gx, blk // gx % gy, blk // (gx * gy))
            self.out.append(((blk // self.per_batch, 1 << 62, 0, [], blk, t),
                             f"{file}:{x2}: {func}: block: [{bid[0]},{bid[1]},{bid[2]}], thread: "
                             f"[{tid[0]},{tid[1]},{tid[2]}] Assertion `{msg}` failed.\n"))
            return 0
        except Exception as e:                      # noqa: BLE001 (raised by launch, in its thread)
            self.error = self.error or e
            return -2

    def flush(self, printf):
        for _, text in sorted(self.out, key=lambda r: r[0]):
            printf(text)


def launch(C, lib, K, mem, symbols, grid, block, dyn, params, printf, per_batch, deadline, envreg=None,
           cooperative=False):
    """Run the whole grid of K's compiled code C (lib: its build for this launch's shape); raises
    CudaError as the interpreter does."""
    lo, hi, host = allocations(mem)
    pbuf = np.frombuffer(bytes(params) + bytes(8), np.uint8)
    gsym = np.array([symbols[g] for g in C.globals] or [0], np.uint64)
    c = Ctx()
    c.arena, c.base, c.capacity = mem.arena.ctypes.data, mem.base, mem.capacity
    c.lo, c.hi, c.host, c.nalloc = lo.ctypes.data, hi.ctypes.data, host.ctypes.data, len(lo)
    c.params, c.psize, c.gsym = pbuf.ctypes.data, len(params), gsym.ctypes.data
    c.grid[:], c.block[:] = grid, block
    c.shbytes, c.dyn, c.local_size = K.shared_static + dyn, dyn, K.local_size + C.frame_bytes
    for n, v in (envreg or {}).items():
        c.envreg[n] = v
    host_calls = Host(K, c, lo, hi, host, pbuf, grid, block, per_batch)
    c.host_call = ctypes.cast(host_calls.fn, ctypes.c_void_p)
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
            if first >= nblocks or lib.run_blocks(ref, first, min(first + chunk, nblocks)):
                return
    if cooperative:
        futures = [workers().submit(lib.run_grid, ref, nblocks)]
    else:
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
        host_calls.flush(printf)
    if host_calls.error is not None:
        raise host_calls.error
    if c.err:
        status, msg = ERRORS.get(c.err, (CUresult.CUDA_ERROR_LAUNCH_FAILED, "error {e}"))
        raise err(status or TRAP_STATUS, f"kernel '{K.name}': " + msg.format(w=c.err_width, a=c.err_addr,
                                                                             line=c.err_line, e=c.err))
