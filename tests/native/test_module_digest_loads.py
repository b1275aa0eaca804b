"""A big module image crosses the wire once per server: the stub names it by its digest
first, and sends it only when the server does not keep it (gpu_server/module_cache.py)."""
import os
import subprocess
import sys
import time

import pytest

from ptx_helpers import compile_ptx
from test_stub import LIBCUDA, stub, stub_env  # noqa: F401 (stub: a fixture)

pytestmark = pytest.mark.gpu

LOAD = r"""
import ctypes, sys
cuda = ctypes.CDLL(sys.argv[1])
image = open(sys.argv[2], "rb").read() + b"\0"
assert cuda.cuInit(0) == 0
dev, ctx, module, fn = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0 and cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
print("load:", cuda.cuModuleLoadData(ctypes.byref(module), image))
print("function:", cuda.cuModuleGetFunction(ctypes.byref(fn), module, b"reverse_blocks"))
"""


def load(server, ptx):
    r = subprocess.run([sys.executable, "-c", LOAD, LIBCUDA, str(ptx)], capture_output=True, text=True, timeout=120,
                       env=stub_env(server.address))
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.splitlines(), r.stderr


def test_a_big_module_is_sent_once_and_named_by_its_digest_after(stub, server, tmp_path):
    # a 400 KiB PTX image: the kernel, and a comment that makes it big
    ptx = tmp_path / "big.ptx"
    ptx.write_text(compile_ptx("dynshared.cu") + "\n" + "// padding padding padding\n" * 16000)
    cache = server.address[len("ipc://"):] + ".modules"
    assert load(server, ptx)[0] == ["load: 0", "function: 0"]
    [kept] = os.listdir(cache)                              # sent, and kept by its digest
    os.utime(os.path.join(cache, kept), (1000, 1000))
    out, err = load(server, ptx)
    assert out == ["load: 0", "function: 0"] and "not kept" not in err, err
    assert os.stat(os.path.join(cache, kept)).st_mtime > time.time() - 60   # read by its digest: used now

    os.truncate(os.path.join(cache, kept), 100)             # damaged on disk: a miss, sent again
    out, err = load(server, ptx)
    assert out == ["load: 0", "function: 0"], err
    assert os.path.getsize(os.path.join(cache, kept)) == ptx.stat().st_size    # whole again (PTX goes without its NUL)
