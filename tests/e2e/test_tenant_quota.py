"""PHOS_TENANT_QUOTA: the device memory all the contexts of one tenant (a client as
PHOS_MAX_CONTEXTS_PER_CLIENT counts them: a CURVE key, else a local user) may hold together on a
server, on every backend. One tenant's contexts cannot pass it together, another tenant's are not
touched by it, and what a destroyed, killed or restored context holds is counted right."""
import json
import os
import shutil
import signal
import subprocess
import sys

import grpc
import numpy as np
import pytest

from conftest import wait_until
from phos.admin_cli import stub
from phos.schema import admin_pb2 as pb
from phos.schema.cuda_types import CUresult
from share_nothing import free_port_pair, keygen

MiB = 1 << 20
QUOTA = 32 * MiB         # sizes in 2 MiB steps: a GPU's allocation granularity
OOM = CUresult.CUDA_ERROR_OUT_OF_MEMORY


def quota_server(servers, monkeypatch, name, **kw):
    monkeypatch.setenv("PHOS_TENANT_QUOTA", str(QUOTA))
    monkeypatch.setenv("PHOS_ORPHAN_GRACE", "0.5")
    return servers(name, **kw)


def ok(res, cu):
    assert int(res[0]) == 0, (res, cu.last_error)
    return res[1] if len(res) == 2 else res[1:]


def free_bytes(cu):
    err, free, _ = cu.cuMemGetInfo()
    assert err == 0, cu.last_error
    return free


def put(cu, nbytes, seed):
    ptr = ok(cu.cuMemAlloc(nbytes), cu)
    data = (np.arange(nbytes, dtype=np.uint64) * 2654435761 + seed).astype(np.uint8)
    assert cu.cuMemcpyHtoD(ptr, data, nbytes) == (0,), cu.last_error
    return ptr, data


def read(cu, ptr, nbytes):
    out = np.zeros(nbytes, np.uint8)
    assert cu.cuMemcpyDtoH(out, ptr, nbytes) == (0,), cu.last_error
    return out


# A tenant in a process of its own: its context takes `hold` bytes, says what it saw, then waits
# to be killed (or ends, with `end`).
TENANT = """
import json, sys, time
from phos.client_stub import driver as cu
assert cu.cuInit(0) == (0,)
err, ctx = cu.cuCtxCreate(None, 0, 0)
assert err == 0, cu.last_error
free = cu.cuMemGetInfo()[1]
err, ptr = cu.cuMemAlloc({hold})
print(json.dumps([free, int(err), cu.last_error]), flush=True)
if {end}:
    cu.cuCtxDestroy(ctx)
else:
    time.sleep(600)
"""


def start_tenant(srv, hold, end=False, **env):
    proc = subprocess.Popen([sys.executable, "-c", TENANT.format(hold=hold, end=end)], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PHOS_SERVER=srv.address, **env))
    line = proc.stdout.readline()
    assert line, f"the tenant's process ended with {proc.wait()}"
    free, status, message = json.loads(line)
    return proc, free, status, message


def test_the_contexts_of_a_tenant_share_its_quota(servers, monkeypatch, client):
    cu = client(quota_server(servers, monkeypatch, "shared"))
    a = ok(cu.cuCtxCreate(None, 0, 0), cu)
    assert free_bytes(cu) == QUOTA                     # cuMemGetInfo says what the quota leaves
    a_ptr, a_data = put(cu, 24 * MiB, 1)
    assert free_bytes(cu) == 8 * MiB
    b = ok(cu.cuCtxCreate(None, 0, 0), cu)             # the same tenant: this test's user
    assert free_bytes(cu) == 8 * MiB
    assert cu.cuMemAlloc(16 * MiB)[0] == OOM
    assert "PHOS_TENANT_QUOTA" in cu.last_error and f"hold {24 * MiB} of its {QUOTA} bytes" in cu.last_error
    b_ptr, b_data = put(cu, 8 * MiB, 2)                # the context goes on
    assert free_bytes(cu) == 0
    ok(cu.cuCtxSetCurrent(a), cu)
    assert np.array_equal(read(cu, a_ptr, 24 * MiB), a_data)
    assert cu.cuMemAlloc(2 * MiB)[0] == OOM
    assert cu.cuMemFree(a_ptr) == (0,) and cu.cuCtxSynchronize() == (0,)
    a_ptr, a_data = put(cu, 16 * MiB, 3)               # what it freed, it may take again
    assert free_bytes(cu) == 8 * MiB
    ok(cu.cuCtxSetCurrent(b), cu)
    assert np.array_equal(read(cu, b_ptr, 8 * MiB), b_data)
    assert cu.cuCtxDestroy(b) == (0,)                  # a context's end gives back all it held
    ok(cu.cuCtxSetCurrent(a), cu)
    assert wait_until(lambda: free_bytes(cu) == 16 * MiB, timeout=10), free_bytes(cu)
    assert np.array_equal(read(cu, a_ptr, 16 * MiB), a_data)
    assert cu.cuCtxDestroy(a) == (0,)


def test_a_killed_clients_memory_goes_back_to_its_tenant(servers, monkeypatch, client):
    srv = quota_server(servers, monkeypatch, "killed")
    proc, free, status, message = start_tenant(srv, 24 * MiB)
    try:
        assert (free, status) == (QUOTA, 0), message
        cu = client(srv)
        ok(cu.cuCtxCreate(None, 0, 0), cu)
        assert free_bytes(cu) == 8 * MiB and cu.cuMemAlloc(16 * MiB)[0] == OOM
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert wait_until(lambda: free_bytes(cu) == QUOTA, timeout=15), free_bytes(cu)
    ok(cu.cuMemAlloc(QUOTA), cu)


def test_another_tenant_has_a_quota_of_its_own(servers, monkeypatch, client, tmp_path):
    """Two CURVE keys are two tenants: one that holds its whole quota takes nothing from the other."""
    keys, other = keygen(tmp_path / "keys"), keygen(tmp_path / "other")
    shutil.copy(other / "clients" / "client.key", keys / "clients" / "other.key")
    srv = quota_server(servers, monkeypatch, "two", listen=f"tcp://127.0.0.1:{free_port_pair()}",
                       args=("--auth-dir", str(keys)))
    monkeypatch.setenv("PHOS_SERVER_KEY", str(keys / "server.key"))
    monkeypatch.setenv("PHOS_CLIENT_KEY", str(keys / "client.key_secret"))
    cu = client(srv)
    ok(cu.cuCtxCreate(None, 0, 0), cu)
    put(cu, QUOTA, 4)
    assert cu.cuMemAlloc(2 * MiB)[0] == OOM and "PHOS_TENANT_QUOTA" in cu.last_error
    _, free, status, message = start_tenant(srv, QUOTA, end=True, PHOS_CLIENT_KEY=str(other / "client.key_secret"))
    assert (free, status) == (QUOTA, 0), message
    _, free, status, message = start_tenant(srv, 2 * MiB, end=True)     # the first key's: a context more
    assert (free, status) == (0, OOM) and "PHOS_TENANT_QUOTA" in message, message


def test_a_restored_context_counts_against_its_tenant(servers, monkeypatch, client, tmp_path):
    """An image names its context's tenant: its restore charges the allocations it makes again, and
    fails with CUDA_ERROR_OUT_OF_MEMORY when they do not fit the tenant's quota."""
    srv = quota_server(servers, monkeypatch, "restored")
    cu = client(srv)
    a = ok(cu.cuCtxCreate(None, 0, 0), cu)
    put(cu, 24 * MiB, 5)
    done = list(stub(srv.address).Checkpoint(pb.CheckpointRequest(ctx=int(a), store=str(tmp_path / "store"))))
    assert done[-1].finished
    assert cu.cuCtxDestroy(a) == (0,)
    ok(cu.cuCtxCreate(None, 0, 0), cu)
    assert wait_until(lambda: free_bytes(cu) == QUOTA, timeout=10), free_bytes(cu)
    b_ptr = ok(cu.cuMemAlloc(16 * MiB), cu)
    with pytest.raises(grpc.RpcError) as e:
        stub(srv.address).Restore(pb.RestoreRequest(store=str(tmp_path / "store")))
    assert "PHOS_TENANT_QUOTA" in e.value.details() and f"CUresult {int(OOM)}" in e.value.details()
    assert cu.cuMemFree(b_ptr) == (0,) and cu.cuCtxSynchronize() == (0,)
    # what the failed restore took comes back with its worker
    assert wait_until(lambda: free_bytes(cu) == QUOTA, timeout=10), free_bytes(cu)
    stub(srv.address).Restore(pb.RestoreRequest(store=str(tmp_path / "store")))
    assert free_bytes(cu) == 8 * MiB
