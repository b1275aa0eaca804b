"""Launch batches (schema/phos.capnp, "Launch batches"): consecutive launches travel as one
launchBatch call, with the semantics of the same launches sent one by one.

Python client, the worker's Session in process, raw frames, and the native stub.
"""
import os
import struct
import subprocess
import time
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import ROOT
from phos.gpu_server.backends.emu import EmuBackend
from phos.gpu_server.worker.session import Session
from phos.schema import wire
from phos.schema.cuda_types import STICKY, CUresult
from ptx_helpers import compile_ptx
from test_bad_input import assert_server_healthy, open_worker, request, results
from test_kernels_e2e import Dev, i32, ptr
from test_stub import APPS, NVCC, phos_run

pytestmark = pytest.mark.gpu     # perf/device/run.sh runs this file with --backend cuda

OK = 0
N = 256                                      # elements of the vectors below
GRID, BLOCK = (1, 1, 1), (N, 1, 1)
MAILBOX_STALL = 10      # seconds: a worker waits 12 (ORPHAN_GRACE + 10) for socket calls it misses


def config(grid=GRID, block=BLOCK, stream=0):
    return (*grid, *block, 0, 0, stream)


# -- the Python client --------------------------------------------------------------------

@pytest.fixture
def dev(cu):
    return Dev(cu)


@pytest.fixture
def accumulate(cu, dev):
    """vec_add(a, c, c): each launch adds a (all ones) into c. Returns (fn, a, c, args)."""
    _, fn = dev.kernel("vecadd.cu", "vec_add")
    a, c = dev.put(np.ones(N, np.float32)), dev.put(np.zeros(N, np.float32))
    return fn, a, c, ((a, c, c, N), (ptr, ptr, ptr, i32))


def connection(cu):
    return cu._current()[1]


def test_many_launches_then_one_sync(cu, dev, accumulate):
    fn, a, c, args = accumulate
    start = time.monotonic()
    for _ in range(300):
        assert cu.cuLaunchKernel(fn, *GRID, *BLOCK, 0, 0, args, 0) == (OK,)
    assert cu.cuCtxSynchronize() == (OK,)
    # the last launches and the sync travel through the mailbox when the worker shares our host:
    # the worker must see that the Request begins with the batch's first launch, not its last
    assert time.monotonic() - start < MAILBOX_STALL, "the synchronizing call waited for calls that never came"
    assert (dev.get(c, N, np.float32) == 300).all()


def test_launches_coalesce_into_one_entry(cu, dev, accumulate):
    """One seq per launch; the entry holds the last one's and stays in the replay log until acknowledged."""
    fn, a, c, args = accumulate
    conn = connection(cu)
    cu.cuCtxSynchronize()
    first = conn.seq + 1
    for _ in range(10):
        cu.cuLaunchKernel(fn, *GRID, *BLOCK, 0, 0, args, 0)
    assert conn.seq == first + 9
    [(seq, name, blob, payload)] = conn.batch
    assert (seq, name, payload) == (first + 9, "launchBatch", None)
    records = wire.read_launch_batch(bytes(blob))
    assert [r[0] for r in records] == [int(fn)] * 10 and records[0][1] == config()
    assert cu.cuMemsetD32Async(c, 0, 1, 0) == (OK,)          # anything else closes the batch
    cu.cuLaunchKernel(fn, *GRID, *BLOCK, 0, 0, args, 0)
    assert [e[1] for e in conn.batch] == ["launchBatch", "memset", "launchBatch"]
    conn.flush()
    assert [e[0] for e in conn.log] == [first + 9, first + 10, first + 11]
    assert cu.cuCtxSynchronize() == (OK,)
    assert not conn.log
    out = dev.get(c, N, np.float32)
    assert out[0] == 1 and (out[1:] == 11).all()


def test_error_in_the_middle_of_a_batch(cu, dev, accumulate):
    """Reported at the next sync, naming the kernel; launches before and after it ran."""
    fn, a, c, args = accumulate
    conn = connection(cu)
    for _ in range(5):
        cu.cuLaunchKernel(fn, *GRID, *BLOCK, 0, 0, args, 0)
    assert cu.cuLaunchKernel(fn, 1, 1, 1, 2048, 1, 1, 0, 0, args, 0) == (OK,)    # too big: the worker refuses it
    params = conn.batch[-1][2][-28:]                         # the last record's parameters
    conn.post_launch(0xBAD, config(), bytes(params))          # no such function
    conn.post_launch(int(fn), config(), bytes(params[:8]))    # too few parameter bytes
    for _ in range(5):
        cu.cuLaunchKernel(fn, *GRID, *BLOCK, 0, 0, args, 0)
    assert conn.batch[-1][1] == "launchBatch" and len(wire.read_launch_batch(bytes(conn.batch[-1][2]))) == 13
    assert cu.cuCtxSynchronize() == (CUresult.CUDA_ERROR_INVALID_VALUE,)
    assert "vec_add" in cu.last_error and "2048 threads" in cu.last_error and "record 6 of 13" in cu.last_error
    assert cu.cuCtxSynchronize() == (OK,)                    # the first failure only, once
    assert (dev.get(c, N, np.float32) == 10).all()


def test_launches_on_streams_keep_their_order(cu, dev):
    _, fn = dev.kernel("vecadd.cu", "vec_add")
    x, y = dev.put(np.ones(N, np.float32)), dev.put(np.full(N, 2, np.float32))
    err, s = cu.cuStreamCreate(0)
    for k in range(20):     # x += y then y += x, alternating: only the right order gives Fibonacci
        src, dst = (y, x) if k % 2 == 0 else (x, y)
        cu.cuLaunchKernel(fn, *GRID, *BLOCK, 0, s, ((src, dst, dst, N), (ptr, ptr, ptr, i32)), 0)
    assert cu.cuStreamSynchronize(s) == (OK,)
    fib = [1, 2]
    for k in range(20):
        fib[k % 2] = fib[0] + fib[1]
    assert (dev.get(x, N, np.float32) == fib[0]).all() and (dev.get(y, N, np.float32) == fib[1]).all()


# -- the worker's semantics, in process on the emu backend -------------------------------

@pytest.fixture
def session():
    s = Session(EmuBackend(), 1, b"")
    yield s
    s.backend.close()


def _call(s, name, args, last=True, payloads=()):
    """Session.execute as run_calls calls it; a dict stands for the call's capnp struct."""
    return s.execute(name, SimpleNamespace(**args) if isinstance(args, dict) else args, list(payloads), last)


def _setup(s, kernel_file, kernel):
    status, _, fields = _call(s, "moduleLoad", {"payload": 1, "digest": b""}, payloads=[compile_ptx(kernel_file).encode()])
    assert status == OK
    status, _, fields = _call(s, "moduleGetFunction", {"module": fields["u64s"][0], "name": kernel})
    assert status == OK
    return fields["u64s"][0]


def test_sticky_error_stops_the_rest_of_the_batch(session):
    s = session
    add = _setup(s, "vecadd.cu", "vec_add")
    oob = _setup(s, "faults.cu", "oob_write")
    a, c = s.backend.alloc(4 * N), s.backend.alloc(4 * N)
    s.backend.memset(a, 0x3F800000, 4, N, None)               # 1.0f
    s.backend.memset(c, 0, 4, N, None)
    good = wire.launch_record(add, config(), struct.pack("<QQQi", a, c, c, N))
    bad = wire.launch_record(oob, config(block=(32, 1, 1)), struct.pack("<Qii", c, N, 1 << 26))
    status, message, _ = _call(s, "launchBatch", good + good + bad + good, last=False)
    assert status in STICKY and "oob_write" in message
    out = np.frombuffer(s.backend.mem.view(c, 4 * N), np.float32)
    # The fourth never ran (it would make every element 3). The faulting kernel's thread 0 writes
    # c[0] = 0 in bounds, and may do so before another lane faults, as on a GPU.
    assert (out[1:] == 2).all() and out[0] in (0, 2)
    assert _call(s, "ctxSynchronize", None)[0] == status


def test_non_sticky_failure_is_deferred_to_the_next_sync(session):
    s = session
    add = _setup(s, "vecadd.cu", "vec_add")
    a, c = s.backend.alloc(4 * N), s.backend.alloc(4 * N)
    s.backend.memset(a, 0x3F800000, 4, N, None)
    s.backend.memset(c, 0, 4, N, None)
    params = struct.pack("<QQQi", a, c, c, N)
    good = wire.launch_record(add, config(), params)
    blob = good + wire.launch_record(add, config(grid=(0, 1, 1)), params) + good
    status, message, _ = _call(s, "launchBatch", blob, last=False)
    assert status == CUresult.CUDA_ERROR_INVALID_VALUE and "vec_add" in message
    assert (np.frombuffer(s.backend.mem.view(c, 4 * N), np.float32) == 2).all()
    status, message, _ = _call(s, "ctxSynchronize", None)
    assert status == CUresult.CUDA_ERROR_INVALID_VALUE and "record 2 of 3" in message and "vec_add" in message
    assert _call(s, "ctxSynchronize", None)[0] == OK


# -- malformed blobs as raw frames ----------------------------------------------------------

def _worker_with_vec_add(raw):
    sock, ctx, token, _ = open_worker(raw)
    ptx = compile_ptx("vecadd.cu").encode()
    sock.send_multipart([request(("attach", {"ctx": ctx, "token": token}), ("moduleLoad", {"payload": 1})), ptx])
    frames = sock.recv_multipart()
    with wire.decode(wire.Reply, frames[0]) as reply:
        assert [r.status for r in reply.results] == [0, 0], [r.message for r in reply.results]
        module = reply.results[1].u64s[0]
    sock.send(request(("moduleGetFunction", {"module": module, "name": "vec_add"}), ("memAlloc", {"size": 4 * N}),
                      ("memAlloc", {"size": 4 * N})))
    frames = sock.recv_multipart()
    with wire.decode(wire.Reply, frames[0]) as reply:
        fn, a, c = (r.u64s[0] for r in reply.results)
    sock.send(request(("memset", {"dst": a, "value": 0x3F800000, "elemSize": 4, "count": N}),
                      ("memset", {"dst": c, "value": 0, "elemSize": 4, "count": N})))
    assert results(sock) == [(0, "")]            # the last call's Result: the first one succeeded silently
    return sock, fn, a, c


def _read_c(sock, c):
    sock.send(request(("memcpyDtoH", {"src": c, "size": 4 * N})))
    frames = sock.recv_multipart()
    return np.frombuffer(frames[1], np.float32)


def test_malformed_batches_get_clear_errors(raw):
    sock, fn, a, c = _worker_with_vec_add(raw)
    good = wire.launch_record(fn, config(), struct.pack("<QQQi", a, c, c, N))
    cases = [
        (b"", "no records"),
        (good[:20], "cut short"),
        (good + good[:51], "record 2 at byte 80 is cut short"),
        (good[:-1], "says 28 parameter bytes, 27 are left"),
        (good[:48] + struct.pack("<I", 0xFFFFFFFF) + good[52:], "says 4294967295 parameter bytes"),
    ]
    for blob, why in cases:
        sock.send(request(("launchBatch", blob)))
        [(status, message)] = results(sock)
        assert status == CUresult.CUDA_ERROR_INVALID_VALUE and "malformed launch batch" in message and why in message, message
    assert (_read_c(sock, c) == 0).all()                      # not even the good first record ran
    # asynchronous, as clients send it: reported by the synchronizing call after it
    sock.send(request(("launchBatch", good + good[:30]), ("ctxSynchronize", None)))
    assert [s for s, _ in results(sock)][-1] == CUresult.CUDA_ERROR_INVALID_VALUE
    # still serving this session, and others
    sock.send(request(("launchBatch", good + good), ("ctxSynchronize", None)))
    assert [s for s, _ in results(sock)][-1] == OK
    assert (_read_c(sock, c) == 2).all()
    assert_server_healthy(raw)
    sock.send(request(("ctxDestroy", None)))
    results(sock)
    sock.close()


# -- the native stub ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def launch_batch_app(stub, tmp_path_factory):  # noqa: F811 (stub: the fixture imported above)
    if not os.path.exists(NVCC):
        pytest.skip("nvcc not found: cannot build tests/apps/launch_batch.cu")
    exe = tmp_path_factory.mktemp("apps") / "launch_batch"
    r = subprocess.run([NVCC, "-cudart", "shared", "-gencode", "arch=compute_90,code=compute_90",
                        "-gencode", "arch=compute_90,code=sm_90", "-I", APPS, "-o", str(exe),
                        f"{APPS}/launch_batch.cu"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, f"building launch_batch failed:\n{r.stdout}\n{r.stderr}"
    return exe


@pytest.mark.parametrize("settings", [{}, {"PHOS_MAILBOX": "1"}], ids=["socket", "mailbox"])
def test_native_stub_many_launches(launch_batch_app, server, settings, backend):
    start = time.monotonic()
    r = phos_run(server, launch_batch_app, env=dict(os.environ, PHOS_VERBOSE="1", **settings))
    assert r.returncode == 0 and r.stdout.rstrip().endswith("PASS"), f"{r.stdout}\n{r.stderr}"
    assert time.monotonic() - start < MAILBOX_STALL, "a mailbox request that began with a batch waited"
    for line in ["500 launches, one sync: x=500 wrong=0", f"24 launches in order: x={0xA5C3F1} wrong=0",
                 "refused launch: cudaErrorInvalidValue", "launches around a refused one: x=520 wrong=0",
                 "stream 1: x=620 wrong=0", "stream 2: x=100 wrong=0", "fault among launches: memory fault"]:
        assert line in r.stdout, r.stdout
    if backend == "emu":     # emu faults at the launch; a GPU reports it at the next synchronizing call
        assert "launchBatch: " in r.stderr  # the fault came from a launch batch (PHOS_VERBOSE shows why)
