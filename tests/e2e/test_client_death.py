"""A client SIGKILLed in the middle of a call leaves nothing behind within 5 s: no worker
process, no staging file in /dev/shm, no worker socket, and (on a GPU) no device memory.

Also the other side: a worker that answers and exits at once (ctxDestroy) must not look
lost to a busy client, and a connection to a worker's socket that never attached must not
keep a dead client's context alive.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ROOT, wait_until
from wire_client import dealer

pytestmark = pytest.mark.gpu     # perf/device/run.sh runs this file with --backend cuda

CLEAN_WITHIN = 5.0
PRELUDE = """
import ctypes, os, sys, time
import numpy as np
sys.path.insert(0, {tests!r})
os.environ["PHOS_SERVER"] = {address!r}
from phos.client_stub import driver as cu
from ptx_helpers import compile_ptx
assert cu.cuInit(0)[0] == 0
err, ctx = cu.cuCtxCreate(None, 0, 0)
assert err == 0, cu.last_error
conn = cu._contexts[int(ctx)]
print(int(ctx), conn.endpoint, conn.staging is not None, flush=True)
"""

BIG_COPIES = """
err, p = cu.cuMemAlloc(256 << 20)
data = np.ones(256 << 20, np.uint8)
print("busy", flush=True)
while True:
    cu.cuMemcpyHtoD(p, data, data.nbytes); cu.cuMemcpyDtoH(data, p, data.nbytes)
"""

LAUNCHES = """
_, mod = cu.cuModuleLoadData(compile_ptx("vecadd.cu", "compute_75").encode())
_, fn = cu.cuModuleGetFunction(mod, b"vec_add")
n = 1 << 16
ptrs = [cu.cuMemAlloc(n * 4)[1] for _ in range(3)]
args = (tuple(ptrs) + (n,), (ctypes.c_void_p,) * 3 + (ctypes.c_int,))
print("busy", flush=True)
while True:
    for _ in range(100):
        cu.cuLaunchKernel(fn, n // 256, 1, 1, 256, 1, 1, 0, 0, args, 0)
    cu.cuCtxSynchronize()
"""


# A synchronous call waiting in the shared mailbox behind socket calls that never arrive:
# what a client killed between sending its calls and zmq flushing them leaves behind.
MAILBOX_WAIT = """
import mmap
from phos.schema import wire
from wire_client import RawSession, client_file, encode
s = RawSession({address!r})
size = wire.SLOTS_OFFSET + 4096
cookie = os.urandom(16)
path, fd = client_file(size, cookie)
area = np.frombuffer(mmap.mmap(fd, size), np.uint8)
[*_, r] = s.call(("attach", {{"ctx": s.ctx, "token": s.token, "shmPath": path, "shmCookie": cookie, "shmSize": size}}))
os.close(fd)
assert r[1] == 0 and r[3][1] == 1, r
print(s.ctx, s.endpoint, True, flush=True)
wire.Mailbox(area).put(0, 1, encode([("ctxSynchronize", None)], [1000]))    # calls up to 999 "on the way"
s.sock.send(wire.Request.new_message(version=wire.PROTOCOL_VERSION, doorbell=True).to_bytes())
print("busy", flush=True)
time.sleep(3600)
"""


def device_free(cu):
    err, free, total = cu.cuMemGetInfo()
    assert err == 0
    return free


@pytest.mark.parametrize("work", [BIG_COPIES, LAUNCHES, MAILBOX_WAIT], ids=["big-copy", "launch-stream", "mailbox-wait"])
def test_sigkill_mid_call_leaves_nothing(server, cu, backend, work):
    time.sleep(0.5)          # let contexts of earlier tests finish going away before measuring
    free_before = device_free(cu)
    tests = os.path.join(ROOT, "tests")
    if work is MAILBOX_WAIT:     # a raw client: imports only
        script = f"import os, sys, time\nimport numpy as np\nsys.path.insert(0, {tests!r})\n" + work.format(address=server.address)
    else:
        script = PRELUDE.format(tests=tests, address=server.address) + textwrap.dedent(work)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        ctx, endpoint, staged = child.stdout.readline().split()
        worker = set(p for p in server.workers() if f"--ctx {ctx} " in open(f"/proc/{p}/cmdline").read().replace("\0", " "))
        assert len(worker) == 1
        assert child.stdout.readline().strip() == "busy"
        if backend == "cuda" and work is not MAILBOX_WAIT:      # the child's allocation shows device-wide
            assert device_free(cu) < free_before
        time.sleep(0.3)             # deep in the loop: a copy or a launch is in flight
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert staged == "True", "the child should have used a staging file (same host)"

    path = server.address[len("ipc://"):]
    assert endpoint == f"ipc://{path}.ctx{ctx}"

    def left():     # (the staging file is a memfd: it goes with the last process that has it)
        return {"workers": set(server.workers()) & worker,
                "sockets": [f for f in (f"{path}.ctx{ctx}", f"{path}.ctl{ctx}") if os.path.exists(f)]}
    start = time.monotonic()
    assert wait_until(lambda: not any(left().values()), timeout=CLEAN_WITHIN), f"after {CLEAN_WITHIN} s: {left()}"
    # Within 1 MiB: the driver's own bookkeeping moves by 64 KiB pages between two readings (seen
    # on the H200), while any allocation of a context is at least one 2 MiB VMM granule.
    assert wait_until(lambda: device_free(cu) >= free_before - (1 << 20), timeout=max(0.1, CLEAN_WITHIN - (time.monotonic() - start))), \
        f"device memory not given back: {device_free(cu)} free, {free_before} before"
    # the server and the other session carry on
    err, p = cu.cuMemAlloc(1 << 20)
    assert err == 0 and cu.cuMemsetD8(p, 1, 1 << 20) == (0,) and cu.cuCtxSynchronize() == (0,)
    assert server.proc.poll() is None


def test_a_stranger_connection_does_not_keep_a_dead_clients_context(server):
    script = PRELUDE.format(tests=os.path.join(ROOT, "tests"), address=server.address) + "time.sleep(3600)\n"
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    stranger = None
    try:
        ctx, endpoint, _ = child.stdout.readline().split()
        worker = set(p for p in server.workers() if f"--ctx {ctx} " in open(f"/proc/{p}/cmdline").read().replace("\0", " "))
        stranger = dealer(endpoint)          # connects, never attaches
        time.sleep(0.5)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    try:
        assert wait_until(lambda: not set(server.workers()) & worker, timeout=CLEAN_WITHIN), "the context outlived its client"
    finally:
        stranger.close()


def test_a_stranger_connecting_again_and_again_does_not_keep_a_dead_clients_context(server):
    """Each new connection gave the context the grace anew: one connecting again and again (as
    a DEALER does once cut off) kept a dead client's context, and its quota, for good."""
    import threading
    script = PRELUDE.format(tests=os.path.join(ROOT, "tests"), address=server.address) + "time.sleep(3600)\n"
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    stop = threading.Event()
    try:
        ctx, endpoint, _ = child.stdout.readline().split()
        worker = set(p for p in server.workers() if f"--ctx {ctx} " in open(f"/proc/{p}/cmdline").read().replace("\0", " "))
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()

    def knock():
        while not stop.wait(0.2):
            sock = dealer(endpoint)
            sock.send(b"knock")
            time.sleep(0.05)
            sock.close()
    knocking = threading.Thread(target=knock, daemon=True)
    knocking.start()
    try:
        assert wait_until(lambda: not set(server.workers()) & worker, timeout=CLEAN_WITHIN), "the context outlived its client"
    finally:
        stop.set()
        knocking.join()


# 24 applications in one process as gevent greenlets (as locust runs them), each creating and
# destroying contexts: a busy process is slow to read the answer that precedes the worker's exit.
GREEN_DESTROYS = """
from gevent import monkey; monkey.patch_all()
import gevent, importlib.util, os, time
os.environ["PHOS_SERVER"] = {address!r}
failures = []
def application():
    spec = importlib.util.find_spec("phos.client_stub.driver")
    cu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cu)
    cu.cuInit(0)
    for _ in range(3):
        err, ctx = cu.cuCtxCreate(None, 0, 0)
        assert err == 0, cu.last_error
        start = time.monotonic()
        err, = cu.cuCtxDestroy(ctx)
        if err or time.monotonic() - start > 2:
            failures.append((int(err), round(time.monotonic() - start, 1), cu.last_error))
gevent.joinall([gevent.spawn(application) for _ in range(24)], raise_error=True)
print(len(failures), failures[:3])
"""


def test_answer_before_the_worker_exits_is_read(server):
    """ctxDestroy's worker answers, then exits: the client must take the answer, not the exit
    for a worker that went away (it then looked for the context for PHOS_REATTACH_TIMEOUT s)."""
    pytest.importorskip("gevent")
    env = dict(os.environ, PHOS_REATTACH_TIMEOUT="3")
    out = subprocess.run([sys.executable, "-c", GREEN_DESTROYS.format(address=server.address)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("0 "), out.stdout
