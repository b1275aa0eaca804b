"""A server of several devices (`phos server --devices`), on emu with PHOS_EMU_DEVICES=2: what
applications see of its devices, contexts on each, copies between them (the Python client's
peer calls) and a live handoff from one device to another (`phos handoff --to-device`)."""
import glob
import json
import os
import signal
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest

from conftest import ROOT, wait_until
from phos.admin_cli import stub
from phos.gpu_server.address_space import device_base
from phos.schema import admin_pb2 as pb
from phos.schema.cuda_types import CUresult
from test_handoff import N, TOTAL, compute_while, program
from test_snapshot_engine import App

OK = CUresult.CUDA_SUCCESS


def ok(cu, res):
    assert res[0] == OK, (res, cu.last_error)
    return res[1] if len(res) == 2 else res[1:]


def devices_of(server):
    return {c.id: c.device for c in stub(server.address).ListContexts(pb.ListContextsRequest()).contexts}


def test_the_application_sees_the_devices_served(two_devices, client):
    """Each emu device has a name and UUID of its own; `--devices 1` shows device 1 alone, as
    device 0, as CUDA_VISIBLE_DEVICES=1 would."""
    cu = client(two_devices("both"))
    assert ok(cu, cu.cuDeviceGetCount()) == 2
    names = [ok(cu, cu.cuDeviceGetName(64, d)) for d in (0, 1)]
    uuids = [ok(cu, cu.cuDeviceGetUuid(d)).bytes for d in (0, 1)]
    assert names[0] != names[1] and uuids[0] != uuids[1]
    assert cu.cuDeviceGet(2)[0] == CUresult.CUDA_ERROR_INVALID_DEVICE
    assert cu.cuCtxCreate(None, 0, 2)[0] == CUresult.CUDA_ERROR_INVALID_DEVICE

    cu = client(two_devices("second", "1"))
    assert ok(cu, cu.cuDeviceGetCount()) == 1
    assert ok(cu, cu.cuDeviceGetName(64, 0)) == names[1] and ok(cu, cu.cuDeviceGetUuid(0)).bytes == uuids[1]
    ok(cu, cu.cuCtxCreate(None, 0, 0))
    assert int(ok(cu, cu.cuMemAlloc(4096))) == device_base(1)      # device 1's addresses
    assert ok(cu, cu.cuCtxGetDevice()) == cu.CUdevice(0)


@pytest.mark.parametrize("devices, why", [("0,0", "device 0 is named twice"), ("2", "there is no device 2"),
                                          ("-1", "there is no device -1"), ("", "give `all`, or device numbers"),
                                          ("one", "give `all`, or device numbers")])
def test_a_bad_device_list_is_refused_at_start(backend, tmp_path, monkeypatch, devices, why):
    if backend != "emu":
        pytest.skip("emu's devices: PHOS_EMU_DEVICES")
    monkeypatch.setenv("PHOS_EMU_DEVICES", "2")
    r = subprocess.run([sys.executable, "-m", "phos.cli", "server", "--listen", f"ipc://{tmp_path}/s.sock",
                        f"--devices={devices}"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode != 0 and why in r.stderr, r.stderr


def test_contexts_on_two_devices_hold_their_own_data_and_memory(two_devices, client):
    """A context on device 1 runs in a worker of device 1 (`ctx list` says so) and counts against
    device 1's memory alone; each context keeps its own data, at its device's addresses."""
    server = two_devices("both")
    cu = client(server)
    ctx0 = ok(cu, cu.cuCtxCreate(None, 0, 0))
    a = ok(cu, cu.cuMemAlloc(1 << 20))
    ok(cu, cu.cuMemcpyHtoD(a, np.full(1 << 18, 7, np.float32), 1 << 20))
    free0, total = ok(cu, cu.cuMemGetInfo())
    ctx1 = ok(cu, cu.cuDevicePrimaryCtxRetain(1))
    ok(cu, cu.cuCtxPushCurrent(ctx1))
    assert ok(cu, cu.cuCtxGetDevice()) == cu.CUdevice(1)
    b = ok(cu, cu.cuMemAlloc(3 << 20))
    ok(cu, cu.cuMemcpyHtoD(b, np.full(3 << 18, 9, np.float32), 3 << 20))
    free1, _ = ok(cu, cu.cuMemGetInfo())
    assert (int(a), int(b)) == (device_base(0), device_base(1))
    assert (free0, free1) == (total - (1 << 20), total - (3 << 20)), "each device counts its own contexts' memory"
    out = np.zeros(3 << 18, np.float32)
    ok(cu, cu.cuMemcpyDtoH(out, b, out.nbytes))
    assert (out == 9).all()
    ok(cu, cu.cuCtxPopCurrent())
    out = np.zeros(1 << 18, np.float32)
    ok(cu, cu.cuMemcpyDtoH(out, a, out.nbytes))
    assert (out == 7).all()
    assert devices_of(server) == {int(ctx0): 0, int(ctx1): 1}


def test_peer_copies_and_peer_access(two_devices, client):
    """cuMemcpyPeer(Async) between contexts of the two devices, both ways, through the client;
    peer access with CUDA's answers and errors."""
    cu = client(two_devices("both"))
    ctx0 = ok(cu, cu.cuCtxCreate(None, 0, 0))
    a = ok(cu, cu.cuMemAlloc(8 << 20))
    data = np.arange(2 << 20, dtype=np.float32)
    ok(cu, cu.cuMemcpyHtoD(a, data, data.nbytes))
    ctx1 = ok(cu, cu.cuCtxCreate(None, 0, 1))
    b = ok(cu, cu.cuMemAlloc(8 << 20))
    stream1 = ok(cu, cu.cuStreamCreate(0))

    ok(cu, cu.cuMemcpyPeer(b, ctx1, a, ctx0, data.nbytes))                  # 0 -> 1
    ok(cu, cu.cuCtxSetCurrent(ctx0))
    ok(cu, cu.cuMemsetD32(a, 0, data.size))
    ok(cu, cu.cuCtxSetCurrent(ctx1))                    # a stream is its context's: the current one
    ok(cu, cu.cuMemcpyPeerAsync(a, ctx0, b, ctx1, data.nbytes, stream1))    # 1 -> 0, on device 1's stream
    ok(cu, cu.cuStreamSynchronize(stream1))
    ok(cu, cu.cuCtxSetCurrent(ctx0))
    out = np.zeros_like(data)
    ok(cu, cu.cuMemcpyDtoH(out, a, out.nbytes))
    assert (out == data).all()
    assert cu.cuMemcpyPeer(b, ctx1, int(a) + (8 << 20), ctx0, 4)[0] == CUresult.CUDA_ERROR_INVALID_VALUE
    assert cu.cuMemcpyPeer(b, cu.CUcontext(12345), a, ctx0, 4)[0] == CUresult.CUDA_ERROR_INVALID_CONTEXT

    assert ok(cu, cu.cuDeviceCanAccessPeer(0, 1)) == 1 and ok(cu, cu.cuDeviceCanAccessPeer(0, 0)) == 0
    assert cu.cuDeviceCanAccessPeer(0, 2)[0] == CUresult.CUDA_ERROR_INVALID_DEVICE
    assert cu.cuDeviceGetP2PAttribute(2, 1, 1)[0] == CUresult.CUDA_ERROR_INVALID_DEVICE
    assert ok(cu, cu.cuDeviceGetP2PAttribute(2, 1, 0)) == 1
    assert cu.cuCtxEnablePeerAccess(ctx0, 0)[0] == CUresult.CUDA_ERROR_INVALID_CONTEXT       # itself
    assert cu.cuCtxEnablePeerAccess(ctx1, 1)[0] == CUresult.CUDA_ERROR_INVALID_VALUE         # flags
    assert cu.cuCtxDisablePeerAccess(ctx1)[0] == CUresult.CUDA_ERROR_PEER_ACCESS_NOT_ENABLED
    ok(cu, cu.cuCtxEnablePeerAccess(ctx1, 0))
    assert cu.cuCtxEnablePeerAccess(ctx1, 0)[0] == CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
    ok(cu, cu.cuCtxDisablePeerAccess(ctx1))
    ctx2 = ok(cu, cu.cuCtxCreate(None, 0, 0))          # another context of device 0: no peer of it
    assert cu.cuCtxEnablePeerAccess(ctx0, 0)[0] == CUresult.CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
    ok(cu, cu.cuCtxDestroy(ctx2))


def test_handoff_to_another_device_while_the_program_writes(two_devices, client):
    """`phos handoff CTX --to-device 1` on the same server: the pre-copy rounds and the frozen
    last round go to a worker on device 1, the program keeps computing and gets the reference's
    result, its pointers unchanged; `ctx list` shows the new device, whose memory now holds the
    context, and a device the server lacks, or the context's own, is refused by name."""
    server = two_devices("both")
    cu = client(server)
    app, (x, y, r), expected = program(cu, np.sin(np.arange(N, dtype=np.float32)))
    done = {}

    def handoff():
        out = subprocess.run([sys.executable, "-m", "phos.cli", "handoff", str(app.id), "--to-device", "1", "--json",
                              "--server", server.address], capture_output=True, text=True, timeout=120, cwd=ROOT)
        done.update(rc=out.returncode, out=out.stdout, err=out.stderr)
    x, moved_at = compute_while(app, x, y, r, threading.Thread(target=handoff))
    assert done["rc"] == 0, done["err"]
    assert moved_at is not None and moved_at < TOTAL - 5, "the handoff should end mid-run"
    reply = json.loads(done["out"])
    assert reply["to"] == "device 1" and len(reply["round_bytes"]) >= 2 and reply["downtime_ms"] > 0
    assert app.get(x, N).tobytes() == expected.tobytes()
    assert devices_of(server) == {app.id: 1}
    listed = subprocess.run([sys.executable, "-m", "phos.cli", "ctx", "list", "--server", server.address],
                            capture_output=True, text=True, timeout=60, cwd=ROOT).stdout
    assert "DEVICE" in listed.splitlines()[0] and f"{app.id:>16}  {1:>6}" in listed

    free, total = app.ok(cu.cuMemGetInfo())
    assert free == total - 3 * N * 4, "device 1 holds the context's memory now"
    other = App(cu)                             # a new context on device 0, which the context left
    assert wait_until(lambda: app.ok(cu.cuMemGetInfo()) == (total, total), 10), app.ok(cu.cuMemGetInfo())
    cu.cuCtxDestroy(other.ctx)

    for request, code, says in [(pb.HandoffRequest(ctx=app.id, to_device=5), grpc.StatusCode.INVALID_ARGUMENT,
                                 "this server has no device 5"),
                                (pb.HandoffRequest(ctx=app.id, to_device=1), grpc.StatusCode.INVALID_ARGUMENT,
                                 f"context {app.id} is on device 1 already"),
                                (pb.HandoffRequest(ctx=app.id, to_device=0, to=server.address),
                                 grpc.StatusCode.INVALID_ARGUMENT, "not both")]:
        with pytest.raises(grpc.RpcError) as e:
            stub(server.address).Handoff(request)
        assert e.value.code() == code and says in e.value.details(), e.value.details()
    stub(server.address).Handoff(pb.HandoffRequest(ctx=app.id, to_device=0))      # and back
    assert devices_of(server) == {app.id: 0}
    assert app.get(x, N).tobytes() == expected.tobytes()


def test_a_failed_handoff_to_another_device_frees_its_warm_copy(two_devices, client):
    """The context's worker dies after the first pre-copy rounds: the handoff fails, and the warm
    copy on device 1 goes at once, its memory with it, and the rounds too."""
    server = two_devices("both")
    cu = client(server)
    app = App(cu)
    app.put(np.ones(64 << 20, np.float32))       # 256 MiB: the worker dies in the middle of a round
    app.sync()
    pid = {c.id: c.pid for c in stub(server.address).ListContexts(pb.ListContextsRequest()).contexts}[app.id]
    before = set(glob.glob("/dev/shm/phos-handoff-*"))
    done = {}

    def handoff():
        try:
            stub(server.address).Handoff(pb.HandoffRequest(ctx=app.id, to_device=1))
        except grpc.RpcError as e:
            done["error"] = e
    mover = threading.Thread(target=handoff)
    mover.start()
    rounds = lambda: set(glob.glob("/dev/shm/phos-handoff-*")) - before      # noqa: E731
    assert wait_until(lambda: any(glob.glob(f"{d}/images/handoff-*-round1.json") for d in rounds()), 60, step=0.005)
    os.kill(pid, signal.SIGKILL)
    mover.join(60)
    assert "error" in done and "exited" in done["error"].details(), done
    assert not rounds(), "the failed handoff's rounds were left behind"
    ok(cu, cu.cuCtxCreate(None, 0, 1))
    total = ok(cu, cu.cuMemGetInfo())[1]
    # A killed worker's share of the device's ledger goes when its process has gone, files and
    # all, a moment after it shows as a zombie (test_emu_limits waits so too)
    assert wait_until(lambda: ok(cu, cu.cuMemGetInfo())[0] == total, 30), "the warm copy still holds device 1's memory"
    assert wait_until(lambda: len(server.workers()) == 2, 30), server.workers()   # the new context's and the pool's
