"""A big module image crosses the wire once per server: the stub names it by its digest
first, and sends it only when the server does not keep it (gpu_server/worker/module_cache.py)."""
import os
import subprocess
import sys
import time

import pytest

from conftest import recovery_images, wait_until
from phos.admin_cli import stub as admin
from phos.schema import admin_pb2 as pb
from ptx_helpers import compile_ptx
from test_stub import LIBCUDA, stub_env
from test_stub_recovery import kill_worker

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


def big_ptx(tmp_path):
    """A 400 KiB PTX image: the kernel, and a comment that makes it big."""
    ptx = tmp_path / "big.ptx"
    ptx.write_text(compile_ptx("dynshared.cu") + "\n" + "// padding padding padding\n" * 16000)
    return ptx


def load(server, ptx):
    r = subprocess.run([sys.executable, "-c", LOAD, LIBCUDA, str(ptx)], capture_output=True, text=True, timeout=120,
                       env=stub_env(server.address))
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.splitlines(), r.stderr


def test_a_big_module_is_sent_once_and_named_by_its_digest_after(stub, server, tmp_path):
    ptx = big_ptx(tmp_path)
    cache = server.address[len("ipc://"):] + ".modules"
    assert load(server, ptx)[0] == ["load: 0", "function: 0"]
    [view] = os.listdir(cache)                              # the client's tenant's own view of the cache
    [kept] = os.listdir(os.path.join(cache, view))          # sent, and kept by its digest
    kept = os.path.join(view, kept)
    os.utime(os.path.join(cache, kept), (1000, 1000))
    out, err = load(server, ptx)
    assert out == ["load: 0", "function: 0"] and "not kept" not in err, err
    assert os.stat(os.path.join(cache, kept)).st_mtime > time.time() - 60   # read by its digest: used now

    os.truncate(os.path.join(cache, kept), 100)             # damaged on disk: a miss, sent again
    out, err = load(server, ptx)
    assert out == ["load: 0", "function: 0"], err
    assert os.path.getsize(os.path.join(cache, kept)) == ptx.stat().st_size    # whole again (PTX goes without its NUL)


# Loads the big module after the context's first recovery image, then launches its kernel
# after the worker was killed: the replay loads it once, as the lost worker had.
LOAD_THEN_LAUNCH = r"""
import ctypes, struct, sys
cuda = ctypes.CDLL(sys.argv[1])
image = open(sys.argv[2], "rb").read() + b"\0"
P = ctypes.c_void_p
def ok(status):
    assert status == 0, status
dev, ctx, module, fn, buf = ctypes.c_int(), P(), P(), P(), ctypes.c_uint64()
ok(cuda.cuInit(0)); ok(cuda.cuDeviceGet(ctypes.byref(dev), 0)); ok(cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev))
ok(cuda.cuMemAlloc_v2(ctypes.byref(buf), 16))
print("CONTEXT", flush=True); sys.stdin.readline()
ok(cuda.cuModuleLoadData(ctypes.byref(module), image))
ok(cuda.cuModuleGetFunction(ctypes.byref(fn), module, b"reverse_blocks"))
ok(cuda.cuCtxSynchronize())
print("LOADED", flush=True); sys.stdin.readline()
host = (ctypes.c_float * 4)(1, 2, 3, 4)
ok(cuda.cuMemcpyHtoD_v2(buf, host, 16))
ptr, n = ctypes.c_uint64(buf.value), ctypes.c_int(4)
params = (P * 2)(ctypes.cast(ctypes.byref(ptr), P), ctypes.cast(ctypes.byref(n), P))
ok(cuda.cuLaunchKernel(fn, 1, 1, 1, 4, 1, 1, 16, None, params, None))
ok(cuda.cuMemcpyDtoH_v2(host, buf, 16))
print("RESULT", list(host), flush=True)
"""


def test_a_replay_loads_a_module_the_server_missed_once(stub, servers, tmp_path):
    """The stub named the image by its digest, the server did not keep it, and the image
    followed: a replay after the worker's death must load the module once, as the lost worker
    did, so that the function handles the program holds name the same functions."""
    directory = tmp_path / "rec"
    one = servers("one", args=["--recovery-dir", str(directory), "--checkpoint-every", "600"])
    prog = subprocess.Popen([sys.executable, "-c", LOAD_THEN_LAUNCH, LIBCUDA, str(big_ptx(tmp_path))], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=stub_env(one.address, PHOS_REATTACH_TIMEOUT="60"))
    try:
        assert prog.stdout.readline() == "CONTEXT\n", prog.stderr.read()
        [ctx] = admin(one.address).ListContexts(pb.ListContextsRequest()).contexts
        assert wait_until(lambda: recovery_images(directory, ctx.id), 20), "no recovery image of the new context"
        prog.stdin.write("go\n"), prog.stdin.flush()
        assert prog.stdout.readline() == "LOADED\n", prog.stderr.read()
        assert len(recovery_images(directory, ctx.id)) == 1     # the replay will hold the load
        kill_worker(one, ctx)
        prog.stdin.write("go\n"), prog.stdin.flush()
        out, err = prog.communicate(timeout=120)
    finally:
        if prog.poll() is None:
            prog.kill()
    assert prog.returncode == 0 and out == "RESULT [4.0, 3.0, 2.0, 1.0]\n", f"{out}\n{err}\n{one.output()[-4000:]}"
    assert f"context {ctx.id} re-attached" in err, err
