"""PHOS_TENANT_HOST_QUOTA: the host memory the workers of one tenant's contexts hold for it (the
staging areas and pinned host ranges they map, the modules they keep loaded and, on emu, what a
module's parse may take) is counted against that tenant on a server, refused by name past it at
the call that asked for it, and given back when a range is unmapped, a module unloaded or a
context ends. Without it one tenant's workers could take the host's memory from another's."""
import os

import pytest

from conftest import wait_until
from phos.schema import wire
from phos.schema.cuda_types import CUresult
from wire_client import RawSession, client_file, decode_reply, encode

MiB = 1 << 20
QUOTA = 16 * MiB
OOM = CUresult.CUDA_ERROR_OUT_OF_MEMORY
rids = iter(range(100, 1000))     # pinned ranges' ids, fresh for each try


@pytest.fixture
def srv(servers, monkeypatch):
    monkeypatch.setenv("PHOS_TENANT_HOST_QUOTA", str(QUOTA))
    monkeypatch.setenv("PHOS_STAGING", "0")      # the Python client's own staging area (64 MiB) stays out of the sums
    return servers("host-quota")


class Files:
    """Client files (memfds of this process) for the workers to map; closed at the end."""

    def __init__(self):
        self.fds = []

    def make(self, size):
        cookie = os.urandom(wire.COOKIE_BYTES)
        path, fd = client_file(size, cookie)
        self.fds.append(fd)
        return path, cookie

    def close(self):
        for fd in self.fds:
            os.close(fd)


@pytest.fixture
def files():
    f = Files()
    yield f
    f.close()


def attach_staging(s, files, size):
    """Whether s's worker mapped a staging area of size bytes (attach's u64s[1])."""
    path, cookie = files.make(size)
    [*_, (_, status, message, u64s, _)] = s.call(("attach", {"ctx": s.ctx, "token": s.token, "shmPath": path,
                                                            "shmCookie": cookie, "shmSize": size}))
    assert status == 0, message
    return u64s[1]


def host_map(s, files, rid, size):
    """hostMap as a stub sends it (alone, seq 0): (mapped, why not)."""
    path, cookie = files.make(wire.PINNED_HEADER + size)
    s.sock.send_multipart([encode([("hostMap", {"id": rid, "path": path, "cookie": cookie, "size": size})], [0])])
    frames = s.sock.recv_multipart()
    [(_, status, message, u64s, _)] = decode_reply(frames)
    assert status == 0, message
    with wire.decode(wire.Reply, frames[0]) as reply:
        text = reply.results[-1].text
    return u64s[0], text


def host_unmap(s, rid):
    s.sock.send_multipart([encode([("hostUnmap", {"id": rid})], [0])])
    [(_, status, message, _, _)] = decode_reply(s.sock.recv_multipart())
    assert status == 0, message


def test_a_tenants_staging_areas_and_pinned_ranges_share_its_host_quota(srv, files):
    a, b = RawSession(srv.address), RawSession(srv.address)      # one tenant: this test's user
    try:
        assert attach_staging(a, files, wire.SLOTS_OFFSET + 6 * MiB) == 1
        assert host_map(b, files, 1, 8 * MiB) == (1, "")
        mapped, why = host_map(b, files, 2, 4 * MiB)            # past the quota with a's staging area
        assert mapped == 0 and "PHOS_TENANT_HOST_QUOTA" in why and f"of its {QUOTA} bytes" in why, why
        assert attach_staging(b, files, wire.SLOTS_OFFSET + 4 * MiB) == 0      # a staging area is refused too
        assert b.status(("memGetInfo", None)) == (0, "")        # the context goes on, its copies through the socket
        host_unmap(b, 1)                                        # what is unmapped is given back
        assert host_map(b, files, 2, 4 * MiB) == (1, "")
        assert attach_staging(a, files, wire.SLOTS_OFFSET + 6 * MiB) == 1    # attaching again: only growth counts
        assert host_map(b, files, 3, 8 * MiB)[0] == 0
    finally:
        a.close()                                               # a context's end gives back all it held
    assert wait_until(lambda: host_map(b, files, next(rids), 8 * MiB)[0] == 1, timeout=15)
    b.close()


# A module with one kernel; its comment makes its text (what the load is charged for, on emu:
# a text's parse may take PARSE_BYTES_PER_TOKEN a byte) 40 KiB, ~6.5 MB with what its parse may take.
MODULE = """.version 8.0
.target sm_90
.address_size 64
.visible .entry k(.param .u64 p)
{
    ret;
}
"""


def module(n):
    text = MODULE + "// " + str(n) * (40 * 1024 // len(str(n))) + "\n"
    return text.encode()


def test_a_tenants_modules_count_against_its_host_quota(srv, client, backend):
    if backend != "emu":
        pytest.skip("the sizes are emu's, whose modules' parses are charged too")
    cu = client(srv)
    ok_ = lambda res: (int(res[0]) == 0, cu.last_error)
    a = cu.cuCtxCreate(None, 0, 0)[1]
    first, second = cu.cuModuleLoadData(module(1)), cu.cuModuleLoadData(module(2))
    assert ok_(first)[0] and ok_(second)[0], cu.last_error
    assert cu.cuModuleLoadData(module(3))[0] == OOM        # a third would pass the quota: refused by name
    assert "PHOS_TENANT_HOST_QUOTA" in cu.last_error and "a module load" in cu.last_error, cu.last_error
    b = cu.cuCtxCreate(None, 0, 0)[1]                        # the same tenant's other context shares it
    assert cu.cuModuleLoadData(module(3))[0] == OOM and "PHOS_TENANT_HOST_QUOTA" in cu.last_error
    assert cu.cuCtxSetCurrent(a) == (0,)
    assert cu.cuModuleUnload(first[1]) == (0,) and cu.cuCtxSynchronize() == (0,)     # an unload gives it back
    assert cu.cuCtxSetCurrent(b) == (0,)
    third = cu.cuModuleLoadData(module(3))
    assert ok_(third)[0], cu.last_error
    err, fn = cu.cuModuleGetFunction(third[1], b"k")
    assert err == 0, cu.last_error
    assert cu.cuCtxDestroy(b) == (0,) and cu.cuCtxSetCurrent(a) == (0,)
    assert wait_until(lambda: int(cu.cuModuleLoadData(module(4))[0]) == 0, timeout=15), cu.last_error
    assert cu.cuCtxDestroy(a) == (0,)
