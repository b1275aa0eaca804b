"""The emu device's limits hold against any client: its memory is one device's, shared by all
the contexts of a server (a killed worker's share comes back); a kernel runs for at most
PHOS_EMU_LAUNCH_TIMEOUT seconds; a module beyond the PTX loader's caps fails to load at once,
before anything is expanded or allocated."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import wait_until
from phos.gpu_server.client_keys import pid_alive
from phos.gpu_server.backends.ptx import parser
from phos.schema.cuda_types import CudaError, CUresult

MiB = 1 << 20
OOM, INVALID_PTX = CUresult.CUDA_ERROR_OUT_OF_MEMORY, CUresult.CUDA_ERROR_INVALID_PTX
HEADER = ".version 8.0\n.target sm_90\n.address_size 64\n"


@pytest.fixture(autouse=True)
def emu_only(backend):
    if backend != "emu":
        pytest.skip("the emu backend's own limits")


def emu_server(servers, monkeypatch, name, **env):
    """A server whose workers see the PHOS_* settings env gives."""
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    return servers(name)


def ok(res, cu):
    assert int(res[0]) == 0, (res, cu.last_error)
    return res[1] if len(res) == 2 else res[1:]


def free_bytes(cu):
    err, free, total = cu.cuMemGetInfo()
    assert err == 0, cu.last_error
    return free


def load(cu, ptx):
    """cuModuleLoadData's (status, module, time it took)."""
    t = time.monotonic()
    err, module = cu.cuModuleLoadData((HEADER + ptx).encode())
    return int(err), module, time.monotonic() - t


def worker_pid(server, ctx):
    """The pid of the worker holding context ctx on this server."""
    for pid in server.workers():
        with open(f"/proc/{pid}/cmdline") as f:
            if f"--ctx {int(ctx)} " in f.read().replace("\0", " "):
                return pid
    raise AssertionError(f"no worker holds context {int(ctx)}")


# -- device memory: one device's, for all the contexts of a server --------------------------------
def test_the_contexts_of_a_server_share_its_device_memory(servers, monkeypatch, client):
    cu = client(emu_server(servers, monkeypatch, "shared", PHOS_EMU_MEMORY=64 * MiB))
    a = ok(cu.cuCtxCreate(None, 0, 0), cu)
    a_ptr = ok(cu.cuMemAlloc(40 * MiB), cu)
    assert free_bytes(cu) == 24 * MiB
    b = ok(cu.cuCtxCreate(None, 0, 0), cu)
    assert free_bytes(cu) == 24 * MiB                  # B sees what A holds
    assert cu.cuMemAlloc(40 * MiB)[0] == OOM and "PHOS_EMU_MEMORY" in cu.last_error
    ok(cu.cuMemAlloc(16 * MiB), cu)
    assert free_bytes(cu) == 8 * MiB
    ok(cu.cuCtxSetCurrent(a), cu)
    assert free_bytes(cu) == 8 * MiB
    assert cu.cuMemFree(a_ptr) == (0,) and cu.cuCtxSynchronize() == (0,)     # the client sends frees later
    ok(cu.cuCtxSetCurrent(b), cu)
    assert free_bytes(cu) == 48 * MiB                  # what A freed, B may take
    ok(cu.cuMemAlloc(40 * MiB), cu)
    assert cu.cuCtxDestroy(b) == (0,)                  # a context's end gives back all it held
    ok(cu.cuCtxSetCurrent(a), cu)
    assert wait_until(lambda: free_bytes(cu) == 64 * MiB, timeout=5)
    assert cu.cuCtxDestroy(a) == (0,)


def test_a_killed_workers_memory_goes_back_to_the_device(servers, monkeypatch, client):
    """A worker SIGKILLed never says what it gave back: the ledger finds it gone and takes its share back."""
    srv = emu_server(servers, monkeypatch, "killed", PHOS_EMU_MEMORY=64 * MiB)
    cu = client(srv)
    a = ok(cu.cuCtxCreate(None, 0, 0), cu)
    ok(cu.cuMemAlloc(48 * MiB), cu)
    b = ok(cu.cuCtxCreate(None, 0, 0), cu)
    assert cu.cuMemAlloc(48 * MiB)[0] == OOM
    pid = worker_pid(srv, a)
    os.kill(pid, signal.SIGKILL)
    # Its lock goes with its last thread: the process may show as a zombie (its first thread
    # dead) a moment before, and the device's memory is free only then.
    assert wait_until(lambda: not pid_alive(pid) and free_bytes(cu) == 64 * MiB, timeout=5), free_bytes(cu)
    ok(cu.cuMemAlloc(48 * MiB), cu)
    assert free_bytes(cu) == 16 * MiB
    assert cu.cuCtxDestroy(b) == (0,)


def test_a_context_holds_no_more_than_its_quota(servers, monkeypatch, client):
    cu = client(emu_server(servers, monkeypatch, "quota", PHOS_EMU_MEMORY=64 * MiB, PHOS_EMU_CONTEXT_QUOTA=16 * MiB))
    ctx = ok(cu.cuCtxCreate(None, 0, 0), cu)
    assert free_bytes(cu) == 16 * MiB
    assert cu.cuMemAlloc(24 * MiB)[0] == OOM and "PHOS_EMU_CONTEXT_QUOTA" in cu.last_error
    ok(cu.cuMemAlloc(16 * MiB), cu)
    assert free_bytes(cu) == 0
    assert cu.cuCtxDestroy(ctx) == (0,)


def test_module_globals_are_device_memory(servers, monkeypatch, client):
    """A module's globals take device memory as allocations do: one that does not fit fails the
    load with CUDA_ERROR_OUT_OF_MEMORY before anything is allocated, however big it is declared."""
    cu = client(emu_server(servers, monkeypatch, "globals", PHOS_EMU_MEMORY=64 * MiB))
    ctx = ok(cu.cuCtxCreate(None, 0, 0), cu)
    err, _, _ = load(cu, ".global .b8 g[100000000];")
    assert err == OOM and "module global 'g'" in cu.last_error
    err, _, took = load(cu, ".global .b8 big[3000000000] = {1};")      # 3 GB, one byte initialised
    assert err == OOM and took < 2
    assert free_bytes(cu) == 64 * MiB                 # the failed loads hold nothing
    err, module, _ = load(cu, ".global .b8 g[33554432] = {7, 8};")
    assert err == 0, cu.last_error
    assert free_bytes(cu) == 32 * MiB
    assert cu.cuModuleUnload(module) == (0,)
    assert free_bytes(cu) == 64 * MiB
    assert cu.cuCtxDestroy(ctx) == (0,)


# -- the PTX loader's caps -------------------------------------------------------------------------
@pytest.mark.parametrize("ptx, cap, value", [
    (".visible .entry k()\n{\n.reg .b32 %r<5000000>;\nret;\n}\n", "MAX_FUNCTION_NAMES", 5000000),
    (".visible .entry k()\n{\n.local .b8 l[1073741824];\nret;\n}\n", "MAX_ARRAY_BYTES['local']", 1073741824),
    (".shared .align 4 .b8 s[1073741824];", "MAX_ARRAY_BYTES['shared']", 1073741824),
    (".global .b8 g[2000000000000] = {1};", "MAX_GLOBAL_BYTES", 2000000000000),
], ids=["registers", "local", "shared", "global"])
def test_a_module_beyond_a_cap_fails_to_load_at_once(cu, ptx, cap, value):
    err, _, took = load(cu, ptx)
    assert err == INVALID_PTX and cap in cu.last_error and str(value) in cu.last_error, cu.last_error
    assert took < 2
    assert cu.cuCtxSynchronize() == (0,)


def test_a_module_of_too_much_text_is_refused_by_its_token_count(cu):
    """Under every cap of what it declares, one initialiser of 2^24 values (34 MB of PTX) took
    66 s and 4.1 GiB to load: a module's tokens are capped."""
    err, _, _ = load(cu, ".global .u32 g[] = {" + "0," * (1 << 22) + "0};")
    assert err == INVALID_PTX and "MAX_MODULE_TOKENS" in cu.last_error, cu.last_error
    assert cu.cuCtxSynchronize() == (0,)
    assert load(cu, ".global .u32 g[] = {1, 2, 3};")[0] == 0      # the context goes on


def test_a_module_load_past_its_deadline_is_refused(servers, monkeypatch, client):
    """512k globals had no answer after 300 s: a load has a deadline (here, one no load meets)."""
    cu = client(emu_server(servers, monkeypatch, "deadline", PHOS_EMU_MODULE_LOAD_TIMEOUT=1e-9))
    ok(cu.cuCtxCreate(None, 0, 0), cu)
    err, _, _ = load(cu, "".join(f".global .u32 g{i};\n" for i in range(2000)))
    assert err == INVALID_PTX and "PHOS_EMU_MODULE_LOAD_TIMEOUT" in cu.last_error, cu.last_error
    free, total = ok(cu.cuMemGetInfo(), cu)
    assert free == total                                       # the refused load holds no memory


@pytest.mark.parametrize("ptx, cap", [
    (".global .u32 g[] = {1, 2, 3, 4, 5};", "MAX_INITIALIZER_VALUES"),
    (".global .u32 a<3>;\n.global .u32 b<3>;", "MAX_MODULE_NAMES"),
], ids=["initialiser", "module"])
def test_the_other_caps(monkeypatch, ptx, cap):
    """Caps too big to reach in a quick test, made small here."""
    monkeypatch.setattr(parser, cap, 4)
    with pytest.raises(CudaError) as e:
        parser.parse(HEADER + ptx)
    assert e.value.status == INVALID_PTX and cap in e.value.message


# -- the launch time limit -------------------------------------------------------------------------
ENDLESS_PTX = HEADER + """
.visible .entry spin()
{
$L: bra.uni $L;
}
.visible .entry nothing()
{
ret;
}
"""
TIMEOUT_SCRIPT = """
import json, time
from phos.client_stub import driver as cu
cu.cuInit(0)
results = {{}}
for name, grid in (("spin", (1, 1, 1)), ("nothing", (2**31 - 1, 65535, 65535))):
    err, ctx = cu.cuCtxCreate(None, 0, 0)        # a context each: the timeout is sticky, as on a GPU
    err, module = cu.cuModuleLoadData({ptx!r})
    err, f = cu.cuModuleGetFunction(module, name.encode())
    t = time.monotonic()
    cu.cuLaunchKernel(f, *grid, 32, 1, 1, 0, 0, ((), ()), 0)
    status = int(cu.cuCtxSynchronize()[0])
    results[name] = (status, cu.last_error, time.monotonic() - t)
    assert int(cu.cuCtxSynchronize()[0]) == status           # and every later call says so
    cu.cuCtxDestroy(ctx)
print(json.dumps(results), flush=True)
"""


def test_a_launch_past_its_time_limit_fails(servers, monkeypatch):
    """A kernel that never ends, and a grid of 9e18 blocks, are stopped after PHOS_EMU_LAUNCH_TIMEOUT
    seconds with CUDA_ERROR_LAUNCH_TIMEOUT (a child process: without the limit they would never end)."""
    srv = emu_server(servers, monkeypatch, "timeout", PHOS_EMU_LAUNCH_TIMEOUT=1)
    script = TIMEOUT_SCRIPT.format(ptx=ENDLESS_PTX.encode())
    env = dict(os.environ, PHOS_SERVER=srv.address)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout.strip().splitlines()[-1])
    for name, (status, message, took) in results.items():
        assert status == CUresult.CUDA_ERROR_LAUNCH_TIMEOUT, (name, message)
        assert "PHOS_EMU_LAUNCH_TIMEOUT" in message and took < 5, (name, message, took)


BUSY_SCRIPT = """
import sys
from phos.client_stub import driver as cu
cu.cuInit(0)
err, ctx = cu.cuCtxCreate(None, 0, 0)
err, p = cu.cuMemAlloc(1 << 20)
err, module = cu.cuModuleLoadData({ptx!r})
err, f = cu.cuModuleGetFunction(module, b"spin")
print("ready", flush=True)
sys.stdin.readline()
cu.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, 0, ((), ()), 0)
cu.cuCtxSynchronize()
"""


def test_ctx_list_answers_at_once_with_a_busy_contexts_last_known_state(servers, monkeypatch):
    """A context in one long call cannot describe itself: `phos ctx list` waited 5 s for each
    such one. It lists it as last described, "busy", and asks it again only once it answered."""
    from phos.admin_cli import stub as admin
    from phos.schema import admin_pb2 as pb
    srv = emu_server(servers, monkeypatch, "busy", PHOS_EMU_LAUNCH_TIMEOUT=30)
    prog = subprocess.Popen([sys.executable, "-c", BUSY_SCRIPT.format(ptx=ENDLESS_PTX.encode())], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ, PHOS_SERVER=srv.address))
    try:
        assert prog.stdout.readline() == "ready\n"
        [idle] = admin(srv.address).ListContexts(pb.ListContextsRequest(), timeout=30).contexts
        assert idle.bytes >= 1 << 20 and idle.state != "busy", idle
        prog.stdin.write("go\n")
        prog.stdin.flush()
        assert wait_until(lambda: admin(srv.address).ListContexts(pb.ListContextsRequest(), timeout=30)
                          .contexts[0].state == "busy", 30)
        for _ in range(3):   # a deadline under the 5 s each listing waited for a busy context
            [busy] = admin(srv.address).ListContexts(pb.ListContextsRequest(), timeout=3).contexts
            assert busy.state == "busy" and busy.bytes == idle.bytes and busy.id == idle.id, busy
    finally:
        prog.kill()
        prog.wait()


def memory_cgroup(limit):
    """A memory cgroup of `limit` bytes (v2, else v1), or None where none can be made (not root,
    no memory controller)."""
    import uuid
    name = f"phos-test-{uuid.uuid4().hex[:8]}"
    for parent, limit_file in (("/sys/fs/cgroup", "memory.max"), ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")):
        path = os.path.join(parent, name)
        if not os.path.exists(os.path.join(parent, "cgroup.procs")):
            continue            # not a cgroup file system (a hybrid host's /sys/fs/cgroup is a tmpfs)
        try:
            os.mkdir(path)
        except OSError:
            continue
        try:
            with open(os.path.join(path, limit_file), "w") as f:
                f.write(str(limit))
            return path
        except OSError:
            os.rmdir(path)
    return None


def test_device_memory_the_host_cannot_back_is_refused_at_allocation(backend, tmp_path):
    """In a 3 GiB memory cgroup standing in for a small host, the emu device's 16 GiB were
    granted, and the OOM killer ended another tenant's worker: the device is no bigger than
    what the cgroup can back, and an allocation past that is refused by name."""
    from conftest import ServerProc
    from phos.client_stub import driver
    if backend != "emu":
        pytest.skip("the emu device's memory is host memory")
    limit = 3 << 30
    cgroup = memory_cgroup(limit)
    if cgroup is None:
        pytest.skip("needs a memory cgroup of its own (root, a memory controller)")
    srv = ServerProc(backend, tmp_path, wrap=("sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh"))
    try:
        driver._reset_for_tests()
        os.environ["PHOS_SERVER"] = srv.address
        assert driver.cuInit(0) == (0,)
        err, total = driver.cuDeviceTotalMem(0)
        assert err == 0 and 0 < total < limit, total
        err, ctx = driver.cuCtxCreate(None, 0, 0)
        assert err == 0, driver.last_error
        err, _ = driver.cuMemAlloc(4 << 30)
        assert err == CUresult.CUDA_ERROR_OUT_OF_MEMORY and "what the host's memory can back" in driver.last_error
        err, p = driver.cuMemAlloc(1 << 30)
        assert err == 0, driver.last_error
        driver.cuCtxDestroy(ctx)
    finally:
        driver._reset_for_tests()
        os.environ.pop("PHOS_SERVER", None)
        srv.stop()
        wait_until(lambda: not srv.workers(), 10)
        wait_until(lambda: subprocess.run(["rmdir", cgroup]).returncode == 0, 10)
