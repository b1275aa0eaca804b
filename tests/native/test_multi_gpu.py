"""Two devices through the native stub, on a server of two emu devices (PHOS_EMU_DEVICES=2): a
CUDA program using both at once (tests/apps/multi_gpu.cu), the stub's peer calls driven through
ctypes, and a program whose context is handed off to the other device while it runs."""
import subprocess
import sys

from phos.gpu_server.address_space import device_base
from phos.schema import admin_pb2 as pb
from test_stub import LIBCUDA, apps, phos_run, stub_env  # noqa: F401 (apps: a fixture)
from test_stub_reattach import PAUSE, Program, admin, context_of, iterate, reference  # noqa: F401 (iterate: a fixture)


def test_a_program_on_two_devices_gets_native_results(apps, two_devices):
    """Kernels on both devices, cudaMemcpyPeer(Async) and cudaMemcpy between them, peer access:
    what a GPU machine of two peer devices prints."""
    r = phos_run(two_devices("both"), apps / "multi_gpu")
    assert r.returncode == 0 and r.stdout.rstrip().endswith("PASS"), f"{r.stdout}\n{r.stderr}"
    assert "devices=2 can_access 0->1=1 1->0=1 0->0=0 wrong_a=0 wrong_c=0" in r.stdout
    assert ("enable=cudaSuccess again=cudaErrorPeerAccessAlreadyEnabled disable=cudaSuccess "
            "disable again=cudaErrorPeerAccessNotEnabled") in r.stdout


PROGRAM = r"""
import ctypes, sys
import numpy as np
cuda = ctypes.CDLL(sys.argv[1])
P, U64, SZ, I = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int
N = (40 << 20) + 4096             # more than one piece (32 MiB) of a copy between contexts
DEVICE_ORDINAL, ACCESS_SUPPORTED = 9, 2      # CU_POINTER_ATTRIBUTE_..., CU_DEVICE_P2P_ATTRIBUTE_...

def ok(status, what):
    if status != 0:
        sys.exit(f"{what} failed: {status}")

def read(ptr, n=N):
    out = np.zeros(n, np.uint8)
    ok(cuda.cuMemcpyDtoH_v2(out.ctypes.data_as(P), ptr, SZ(n)), "cuMemcpyDtoH")
    return out

def context(device):
    ctx, ptr, stream = P(), U64(), P()
    ok(cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, device), "cuCtxCreate")
    ok(cuda.cuMemAlloc_v2(ctypes.byref(ptr), SZ(N)), "cuMemAlloc")
    ok(cuda.cuStreamCreate(ctypes.byref(stream), 0), "cuStreamCreate")
    return ctx, ptr, stream

def answer(fn, *args):
    v = I(-1)
    status = fn(ctypes.byref(v), *args)
    return (status, v.value)

ok(cuda.cuInit(0), "cuInit")
data = (np.arange(N, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)
ctx0, a, s0 = context(0)
ok(cuda.cuMemcpyHtoD_v2(a, data.ctypes.data_as(P), SZ(N)), "cuMemcpyHtoD")
ctx1, b, s1 = context(1)
print("addresses", hex(a.value), hex(b.value))
print("ordinals", *(answer(cuda.cuPointerGetAttribute, DEVICE_ORDINAL, p)[1] for p in (a, b)))

ok(cuda.cuMemcpyPeer(b, ctx1, a, ctx0, SZ(N)), "cuMemcpyPeer")              # 0 -> 1, current: ctx1
print("0->1 wrong", int((read(b) != data).sum()))
ok(cuda.cuMemsetD8_v2(b, 7, SZ(N)), "cuMemsetD8")
ok(cuda.cuMemcpyPeerAsync(a, ctx0, b, ctx1, SZ(N), s1), "cuMemcpyPeerAsync")   # 1 -> 0, on ctx1's stream
ok(cuda.cuStreamSynchronize(s1), "cuStreamSynchronize")
ok(cuda.cuMemsetD8_v2(b, 9, SZ(4096)), "cuMemsetD8")
ok(cuda.cuCtxSetCurrent(ctx0), "cuCtxSetCurrent")
print("1->0 async wrong", int((read(a) != 7).sum()))
ok(cuda.cuMemcpyDtoD_v2(a, b, SZ(4096)), "cuMemcpyDtoD")                    # by the pointers: from ctx1's
print("dtod by pointers wrong", int((read(a, 4096) != 9).sum()))
ctx2, c, s2 = context(0)
print("stream of neither", cuda.cuMemcpyPeerAsync(b, ctx1, a, ctx0, SZ(16), s2))
print("past the end", cuda.cuMemcpyPeer(b, ctx1, U64(a.value + N), ctx0, SZ(16)))
print("not a context", cuda.cuMemcpyPeer(b, P(0x1234), a, ctx0, SZ(16)))

ok(cuda.cuCtxSetCurrent(ctx0), "cuCtxSetCurrent")
print("can access", answer(cuda.cuDeviceCanAccessPeer, 0, 1), answer(cuda.cuDeviceCanAccessPeer, 0, 0),
      answer(cuda.cuDeviceCanAccessPeer, 0, 2)[0])
print("p2p attribute", answer(cuda.cuDeviceGetP2PAttribute, ACCESS_SUPPORTED, 1, 0),
      answer(cuda.cuDeviceGetP2PAttribute, ACCESS_SUPPORTED, 1, 1)[0])
print("enable itself", cuda.cuCtxEnablePeerAccess(ctx0, 0), "flags", cuda.cuCtxEnablePeerAccess(ctx1, 1),
      "same device", cuda.cuCtxEnablePeerAccess(ctx2, 0))
print("enable", cuda.cuCtxEnablePeerAccess(ctx1, 0), cuda.cuCtxEnablePeerAccess(ctx1, 0))
print("disable", cuda.cuCtxDisablePeerAccess(ctx1), cuda.cuCtxDisablePeerAccess(ctx1))
ok(cuda.cuCtxEnablePeerAccess(ctx1, 0), "cuCtxEnablePeerAccess")
ok(cuda.cuCtxDestroy_v2(ctx1), "cuCtxDestroy")
print("peer destroyed", cuda.cuCtxDisablePeerAccess(ctx1))
"""


def test_the_stubs_peer_calls(stub, two_devices, tmp_path):
    server = two_devices("both")
    (tmp_path / "peers.py").write_text(PROGRAM)
    r = subprocess.run([sys.executable, str(tmp_path / "peers.py"), LIBCUDA], capture_output=True, text=True,
                       timeout=300, env=stub_env(server.address))
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert f"addresses {device_base(0):#x} {device_base(1):#x}" in r.stdout      # each device's own
    expected = ["ordinals 0 1", "0->1 wrong 0", "1->0 async wrong 0", "dtod by pointers wrong 0",
                "stream of neither 400", "past the end 1", "not a context 201",
                "can access (0, 1) (0, 0) 101", "p2p attribute (0, 1) 101",
                "enable itself 201 flags 1 same device 217", "enable 0 704", "disable 0 705", "peer destroyed 201"]
    for line in expected:
        assert line in r.stdout, f"{line!r} missing:\n{r.stdout}\n{r.stderr}"


def test_a_program_handed_off_to_another_device_continues(iterate, two_devices):
    """`phos handoff --to-device` at the pause: the retiring worker tells the program where its
    context went, a worker on device 1 of the same server; the program, its module globals
    included, prints what an uninterrupted run does."""
    server = two_devices("both")
    expected = reference(iterate, server, PAUSE)
    prog = Program(iterate, server, PAUSE)
    prog.until_ready()
    ctx = context_of(server)
    reply = admin(server.address).Handoff(pb.HandoffRequest(ctx=ctx, to_device=1))
    assert reply.ctx == ctx and reply.to == "device 1"
    assert [c.device for c in admin(server.address).ListContexts(pb.ListContextsRequest()).contexts] == [1]
    prog.go_on()
    code, out, err = prog.finish()
    assert code == 0 and out == expected, f"{out}\n{err}"
    assert f"context {ctx} re-attached" in err and "told by its old worker" in err, err
