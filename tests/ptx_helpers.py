"""Helpers for the PTX interpreter tests: compile tests/kernels/*.cu with nvcc (cached), run on EmuMemory."""
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from phos.gpu_server.backends.emu_memory import EmuMemory
from phos.gpu_server.backends.ptx import parse_module

KERNELS = Path(__file__).parent / "kernels"
NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/bin/nvcc", "/usr/local/cuda/bin/nvcc") if os.path.exists(p)), None)
CACHE = Path(tempfile.gettempdir()) / "phos-ptx-cache"
ARCHS = ("compute_75", "compute_90")
EXTRA_FLAGS = tuple(os.environ.get("PHOS_NVCC_FLAGS", "").split())   # e.g. "-G" to run the suite on debug PTX


def compile_ptx(name, arch="compute_90", flags=()):
    """PTX text of tests/kernels/<name>, compiled once per (source, arch, flags) into a cache under tmp."""
    if NVCC is None:
        pytest.skip("nvcc not found: the PTX interpreter tests compile CUDA C kernels with it")
    src = (KERNELS / name).read_bytes()
    flags = tuple(flags) + EXTRA_FLAGS
    key = hashlib.sha256(src + repr((arch, flags, NVCC)).encode()).hexdigest()[:16]
    out = CACHE / f"{Path(name).stem}-{arch}-{key}.ptx"
    if not out.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        r = subprocess.run([NVCC, "-ptx", f"-arch={arch}", *flags, str(KERNELS / name), "-o", str(tmp)],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"nvcc failed on {name}:\n{r.stderr}")
        os.replace(tmp, out)
    return out.read_text()


class Device:
    """An EmuMemory with array upload/download and kernel launch by Python arguments."""

    def __init__(self, capacity=1 << 30):
        self.mem = EmuMemory(capacity)
        self.printed = []

    def array(self, a):
        a = np.ascontiguousarray(a)
        ptr = self.mem.alloc(max(a.nbytes, 1))
        self.mem.view(ptr, a.nbytes)[:] = a.view(np.uint8).reshape(-1)
        return ptr

    def zeros(self, n, dtype=np.float32):
        return self.array(np.zeros(n, dtype))

    def read(self, ptr, n, dtype=np.float32):
        dtype = np.dtype(dtype)
        return self.mem.view(ptr, n * dtype.itemsize).view(dtype).copy()

    def module(self, ptx):
        mod = parse_module(ptx)
        for name, g in mod.globals.items():
            addr = self.mem.alloc(max(g.size, 1))
            self.mem.view(addr, g.size)[:] = np.frombuffer(g.init, np.uint8)
            mod.bind_global(name, addr)
        return mod

    def load(self, name, arch="compute_90", flags=()):
        return self.module(compile_ptx(name, arch, flags))

    @staticmethod
    def pack(kernel, args):
        """The parameter buffer for args laid out per kernel.params; ints fill the slot, NumPy scalars and bytes are raw."""
        assert len(args) == len(kernel.params), f"{kernel.name} takes {len(kernel.params)} arguments"
        buf = bytearray(kernel.params[-1][0] + kernel.params[-1][1] if kernel.params else 0)
        for (off, size), a in zip(kernel.params, args):
            if isinstance(a, (bytes, bytearray)):
                raw = bytes(a)
            elif isinstance(a, np.generic):
                raw = a.tobytes()
            elif isinstance(a, float):
                raw = np.float32(a).tobytes() if size == 4 else np.float64(a).tobytes()
            else:
                raw = (int(a) & ((1 << 8 * size) - 1)).to_bytes(size, "little")
            assert len(raw) == size, f"argument {a!r} does not fill a {size}-byte parameter"
            buf[off:off + size] = raw
        return bytes(buf)

    def launch(self, mod, name, grid, block, *args, shared=0):
        grid = grid if isinstance(grid, tuple) else (grid, 1, 1)
        block = block if isinstance(block, tuple) else (block, 1, 1)
        mod.launch(name, self.mem, grid, block, shared, self.pack(mod.kernels[name], args), self.printed.append)
