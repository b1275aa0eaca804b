"""Pinned host memory the worker maps (schema/phos.capnp, "Pinned host memory"): on one host,
cuMemAllocHost's bytes are a sealed memfd that the context's worker maps too, and a copy
from or to them travels as a reference (memcpyPinned), copied in place by the worker.

A Python program drives the native stub through ctypes (no nvcc needed) against an emu server.
"""
import fcntl
import mmap
import re
import os
import secrets
import subprocess
import sys

import numpy as np
import pytest

from conftest import recovery_images, wait_until
from phos.admin_cli import stub as admin
from phos.schema import admin_pb2 as pb
from phos.schema import wire
from phos.schema.cuda_types import CUresult
from test_stub import LIBCUDA, stub_env
from test_stub_recovery import kill_worker
from wire_client import RawSession, client_file, decode_reply

pytestmark = pytest.mark.gpu     # perf/device/run.sh runs this file with --backend cuda

# What the programs below start with: the stub loaded (argv[1]), and their checks.
PRELUDE = r"""
import ctypes, mmap, os, sys
import numpy as np
cuda = ctypes.CDLL(sys.argv[1])
P, U64, SZ = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t

def ok(status, what):
    if status != 0:
        sys.exit(f"{what} failed: {status}")

def shared(addr):
    # mapped from the stub's memfd
    for line in open("/proc/self/maps"):
        fields = line.split(None, 5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= addr < hi:
            return len(fields) > 5 and fields[5].startswith("/memfd:phos")
    return False
"""

PROGRAM = PRELUDE + r"""
mode = sys.argv[2]
N = (4 << 20) + 123                  # above the stub's smallest shared allocation (256 KiB), and odd

def memfds_open():
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:phos") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))

def pinned():
    p = P()
    ok(cuda.cuMemAllocHost_v2(ctypes.byref(p), SZ(N)), "cuMemAllocHost")
    return p.value, np.frombuffer((ctypes.c_ubyte * N).from_address(p.value), np.uint8)

def pattern(n, seed, start=0):
    return ((np.arange(start, start + n) * 7 + seed) % 251).astype(np.uint8)

def wrong(have, want):
    return int((have != want).sum())

def wait_for_line(word):
    print(word, flush=True)
    sys.stdin.readline()

dev, ctx, stream, d = ctypes.c_int(), P(), P(), U64()
ok(cuda.cuInit(0), "cuInit")
ok(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ok(cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate")
ok(cuda.cuStreamCreate(ctypes.byref(stream), 0), "cuStreamCreate")
ok(cuda.cuMemAlloc_v2(ctypes.byref(d), SZ(N)), "cuMemAlloc")
(ha, a), (hb, b), (hc, c) = pinned(), pinned(), pinned()
print("shared:", sum(map(shared, (ha, hb, hc))))
print("memfds open:", memfds_open())

if mode == "hold":
    wait_for_line("READY")

if mode == "copies":
    a[:] = pattern(N, 1)
    ok(cuda.cuMemcpyHtoD_v2(U64(d.value), P(ha), SZ(N)), "cuMemcpyHtoD")
    a[:] = 0                         # returned: the device has the bytes, ours may change
    ok(cuda.cuMemcpyDtoH_v2(P(hb), U64(d.value), SZ(N)), "cuMemcpyDtoH")
    print("sync wrong:", wrong(b, pattern(N, 1)))
    # asynchronous, at odd offsets inside the ranges: done by the stream's synchronization
    off, n = 4097, N - 3 * 4097
    a[:] = pattern(N, 2)
    ok(cuda.cuMemcpyHtoDAsync_v2(U64(d.value + off), P(ha + off), SZ(n), stream), "cuMemcpyHtoDAsync")
    b[:] = 0
    ok(cuda.cuMemcpyDtoHAsync_v2(P(hb), U64(d.value), SZ(N), stream), "cuMemcpyDtoHAsync")
    ok(cuda.cuStreamSynchronize(stream), "cuStreamSynchronize")
    want = pattern(N, 1)
    want[off:off + n] = pattern(n, 2, off)
    print("async wrong:", wrong(b, want))
    # unified addressing: cuMemcpy finds the direction from the addresses
    ok(cuda.cuMemcpy(U64(hc + 5), U64(d.value), SZ(N - 5)), "cuMemcpy")
    print("cuMemcpy wrong:", wrong(c[5:], want[:N - 5]))
    # a copy past the device allocation fails at once, as on a GPU; the context goes on
    print("too large:", cuda.cuMemcpyHtoDAsync_v2(U64(d.value + 1), P(ha), SZ(N), stream))
    ok(cuda.cuCtxSynchronize(), "cuCtxSynchronize")

if mode == "recovery":
    wait_for_line("ALLOCATED")       # the test waits for the context's first recovery image
    a[:] = pattern(N, 3)
    ok(cuda.cuMemcpyHtoDAsync_v2(U64(d.value), P(ha), SZ(N), stream), "cuMemcpyHtoDAsync")
    ok(cuda.cuStreamSynchronize(stream), "cuStreamSynchronize")
    a[:] = pattern(N, 4)             # after the copy: its replay must send the bytes it had then
    ok(cuda.cuMemcpyDtoHAsync_v2(P(hb), U64(d.value), SZ(N), stream), "cuMemcpyDtoHAsync")
    ok(cuda.cuStreamSynchronize(stream), "cuStreamSynchronize")
    print("before wrong:", wrong(b, pattern(N, 3)))
    b[:] = 5                         # answered before the worker is lost: a replay must not write here
    wait_for_line("COPIED")          # the test kills the worker
    ok(cuda.cuMemcpyDtoH_v2(P(hc), U64(d.value), SZ(N)), "cuMemcpyDtoH")
    print("replayed wrong:", wrong(c, pattern(N, 3)))
    print("answered untouched:", bool((b == 5).all()))
    ok(cuda.cuMemcpyHtoD_v2(U64(d.value), P(ha), SZ(N)), "cuMemcpyHtoD")
    ok(cuda.cuMemcpyDtoH_v2(P(hc), U64(d.value), SZ(N)), "cuMemcpyDtoH")
    print("after wrong:", wrong(c, pattern(N, 4)))

for h in (ha, hb, hc):
    ok(cuda.cuMemFreeHost(P(h)), "cuMemFreeHost")
print("freed: shared:", sum(map(shared, (ha, hb, hc))))
print("memfds open:", memfds_open())
print("PASS")
"""

COPIES_OUT = ["sync wrong: 0", "async wrong: 0", "cuMemcpy wrong: 0", f"too large: {int(CUresult.CUDA_ERROR_INVALID_VALUE)}",
              "freed: shared: 0", "memfds open: 0", "PASS"]


def run(address, mode="copies", **env):
    return subprocess.run([sys.executable, "-c", PROGRAM, LIBCUDA, mode], capture_output=True, text=True, timeout=120,
                          env=stub_env(address, PHOS_VERBOSE="1", **env))


def start(address, mode, **env):
    return subprocess.Popen([sys.executable, "-c", PROGRAM, LIBCUDA, mode], text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=stub_env(address, PHOS_VERBOSE="1", PHOS_REATTACH_TIMEOUT="60", **env))


def stats(stderr):
    """(bytes staged, bytes copied in place) of the stub's statistics (PHOS_VERBOSE), summed."""
    found = re.findall(r"(\d+) bytes staged, (\d+) bytes copied in place", stderr)
    assert found, f"no statistics in the stub's verbose output:\n{stderr}"
    return tuple(sum(int(f[i]) for f in found) for i in range(2))


def test_the_worker_maps_pinned_memory_and_copies_in_place(stub, server):
    r = run(server.address)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and lines[:2] == ["shared: 3", "memfds open: 3"] and lines[2:] == COPIES_OUT, \
        f"{r.stdout}\n{r.stderr}"
    assert r.stderr.count("the worker mapped pinned host memory") == 3, r.stderr
    staged, in_place = stats(r.stderr)
    n = (4 << 20) + 123
    assert staged == 0 and in_place == 5 * n - 3 * 4097 - 5, r.stderr       # the program's five copies, no more


def test_without_a_shared_host_pinned_memory_is_the_stubs_own(stub, server):
    r = run(server.address, PHOS_STAGING="0")
    assert r.returncode == 0 and r.stdout.splitlines() == ["shared: 0", "memfds open: 0", *COPIES_OUT], \
        f"{r.stdout}\n{r.stderr}"
    assert "pinned host memory" not in r.stderr and stats(r.stderr) == (0, 0), r.stderr


def test_a_worker_that_refuses_leaves_it_the_stubs_own(stub, servers, monkeypatch):
    """Past PHOS_PINNED_HOST_BYTES a worker maps no more: the allocation falls back to the stub's
    own memory, whose copies go through the staging area."""
    monkeypatch.setenv("PHOS_PINNED_HOST_BYTES", str(6 << 20))     # room for one of the three
    srv = servers("bounded")
    r = run(srv.address)
    assert r.returncode == 0 and r.stdout.splitlines() == ["shared: 1", "memfds open: 1", *COPIES_OUT], \
        f"{r.stdout}\n{r.stderr}"
    assert r.stderr.count("the worker mapped pinned host memory") == 1, r.stderr
    assert r.stderr.count("the worker did not map pinned host memory") == 2 and "PHOS_PINNED_HOST_BYTES" in r.stderr
    staged, in_place = stats(r.stderr)
    assert staged > 0 and in_place > 0, r.stderr


def test_pinned_memory_has_no_name_another_process_could_open_or_a_killed_one_leave(stub, server):
    """Its files are memfds: nothing in /dev/shm while they are held, and they go with the program."""
    prog = start(server.address, "hold")
    try:
        assert prog.stdout.readline() == "shared: 3\n", prog.stderr.read()
        assert prog.stdout.readline() == "memfds open: 3\n"
        assert prog.stdout.readline() == "READY\n"
        assert not [n for n in os.listdir("/dev/shm") if str(prog.pid) in n]
        fds = [f"/proc/{prog.pid}/fd/{n}" for n in os.listdir(f"/proc/{prog.pid}/fd")]
        memfds = [os.open(f, os.O_RDONLY) for f in fds if os.readlink(f).startswith("/memfd:phos")]
        try:
            assert [fcntl.fcntl(f, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK for f in memfds] == [fcntl.F_SEAL_SHRINK] * 3
        finally:
            for f in memfds:
                os.close(f)
    finally:
        prog.kill()
        prog.wait(30)


def test_a_replay_sends_pinned_copies_with_their_bytes(stub, servers, tmp_path):
    """With recovery images the log keeps a host->device copy from a pinned range with the bytes
    it had (the range changes after it), and resends nothing into a range that was answered
    before; the worker found again maps the ranges anew as the program copies."""
    directory = tmp_path / "rec"
    one = servers("one", args=["--recovery-dir", str(directory), "--checkpoint-every", "600"])
    prog = start(one.address, "recovery")
    try:
        assert prog.stdout.readline() == "shared: 3\n", prog.stderr.read()
        assert prog.stdout.readline() == "memfds open: 3\n"
        assert prog.stdout.readline() == "ALLOCATED\n"
        [ctx] = admin(one.address).ListContexts(pb.ListContextsRequest()).contexts
        assert wait_until(lambda: recovery_images(directory, ctx.id), 20), "no recovery image of the new context"
        prog.stdin.write("go\n"), prog.stdin.flush()
        assert prog.stdout.readline() == "before wrong: 0\n"
        assert prog.stdout.readline() == "COPIED\n"
        assert len(recovery_images(directory, ctx.id)) == 1      # the replay holds the copies
        kill_worker(one, ctx)
        prog.stdin.write("go\n"), prog.stdin.flush()
        out, err = prog.communicate(timeout=120)
    finally:
        if prog.poll() is None:
            prog.kill()
    assert prog.returncode == 0 and out.splitlines() == [
        "replayed wrong: 0", "answered untouched: True", "after wrong: 0", "freed: shared: 0", "memfds open: 0",
        "PASS"], f"{out}\n{err}\n{one.output()[-4000:]}"
    assert f"context {ctx.id} re-attached" in err, err
    assert err.count("the worker mapped pinned host memory") == 5, err     # 3, then 2 again as they are used


# -- the application's own memory, registered with DEVICEMAP (cudaHostRegisterMapped) --------

REGISTER = PRELUDE + r"""
DEVICEMAP = 0x02
N = 3 * mmap.PAGESIZE

dev, ctx, d = ctypes.c_int(), P(), U64()
ok(cuda.cuInit(0), "cuInit")
ok(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ok(cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate")
ok(cuda.cuMemAlloc_v2(ctypes.byref(d), SZ(N)), "cuMemAlloc")
pages = mmap.mmap(-1, N + 2 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)   # the application's own memory
whole = np.frombuffer(pages, np.uint8)
whole[:] = np.arange(whole.size) % 251
before = whole.copy()
at = ctypes.addressof(ctypes.c_char.from_buffer(pages)) + mmap.PAGESIZE + 100   # inside a page
mine = whole[mmap.PAGESIZE + 100:mmap.PAGESIZE + 100 + N]
print("register:", cuda.cuMemHostRegister_v2(P(at), SZ(N), DEVICEMAP))
print("shared:", shared(at), "bytes kept:", bool((whole == before).all()))
dptr = U64()
print("device pointer:", cuda.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), P(at), 0), dptr.value == at)
print("same page again:", cuda.cuMemHostRegister_v2(P(at + N + 8), SZ(16), DEVICEMAP))
others = mmap.mmap(-1, mmap.PAGESIZE)                         # shared with whoever else maps it
others[:3] = b"abc"
print("a shared mapping:", cuda.cuMemHostRegister_v2(P(ctypes.addressof(ctypes.c_char.from_buffer(others))),
                                                     SZ(mmap.PAGESIZE), DEVICEMAP), others[:3] == b"abc")
if shared(at):
    # copies to and from it travel as references, at offsets into its first page
    ok(cuda.cuMemcpyHtoD_v2(U64(d.value), P(at), SZ(N)), "cuMemcpyHtoD")
    mine[:] = 0
    ok(cuda.cuMemcpyDtoH_v2(P(at), U64(d.value), SZ(N)), "cuMemcpyDtoH")
    print("copies wrong:", int((mine != before[mmap.PAGESIZE + 100:mmap.PAGESIZE + 100 + N]).sum()))
    mine[:7] = 9
    print("unregister:", cuda.cuMemHostUnregister(P(at)))
    print("after: shared:", shared(at), "bytes kept:", bool((mine[:7] == 9).all() and (mine[7:] == before[mmap.PAGESIZE + 107:mmap.PAGESIZE + 100 + N]).all()),
          "neighbours kept:", bool((whole[:mmap.PAGESIZE + 100] == before[:mmap.PAGESIZE + 100]).all()))
    print("unregister again:", cuda.cuMemHostUnregister(P(at)))
"""


def register(address, **env):
    r = subprocess.run([sys.executable, "-c", REGISTER, LIBCUDA], capture_output=True, text=True, timeout=120,
                       env=stub_env(address, PHOS_VERBOSE="1", **env))
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    return r.stdout.splitlines(), r.stderr


def test_registered_memory_is_shared_with_the_worker_where_it_lies(stub, server):
    """cuMemHostRegister with DEVICEMAP: the application's pages become a shared file mapped over
    them, bytes kept, which the worker maps at the same address; the device pointer is the
    address; copies use it in place; unregistered, the pages are private again, bytes kept."""
    out, err = register(server.address)
    assert out == ["register: 0", "shared: True bytes kept: True", "device pointer: 0 True",
                   f"same page again: {int(CUresult.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)}",
                   f"a shared mapping: {int(CUresult.CUDA_ERROR_NOT_SUPPORTED)} True", "copies wrong: 0",
                   "unregister: 0", "after: shared: False bytes kept: True neighbours kept: True",
                   f"unregister again: {int(CUresult.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)}"], err
    assert "for the device to use in place" in err and "one page cannot be registered twice" in err, err
    assert "its pages are a shared mapping" in err and "only private anonymous memory" in err, err
    _, in_place = stats(err)
    assert in_place == 2 * 3 * mmap.PAGESIZE, err


def test_registered_memory_on_a_host_the_worker_does_not_share_is_refused_saying_why(stub, server):
    out, err = register(server.address, PHOS_STAGING="0")
    assert out == [f"register: {int(CUresult.CUDA_ERROR_NOT_SUPPORTED)}", "shared: False bytes kept: True",
                   f"device pointer: {int(CUresult.CUDA_ERROR_INVALID_VALUE)} False",
                   f"same page again: {int(CUresult.CUDA_ERROR_NOT_SUPPORTED)}",
                   f"a shared mapping: {int(CUresult.CUDA_ERROR_NOT_SUPPORTED)} True"], err
    assert "cuMemHostRegister(DEVICEMAP)" in err and "does not share this host" in err, err


# -- the worker's side, from a client that bypasses the stub ----------------------------------

def pinned_file(size, **how):
    """A pinned host file as a client makes it (wire_client.client_file), the cookie at the start
    of its header, the bytes after it. (path, cookie, its bytes as this process maps them, its fd)."""
    cookie = secrets.token_bytes(wire.COOKIE_BYTES)
    path, fd = client_file(wire.PINNED_HEADER + size, cookie, **how)
    area = mmap.mmap(fd, wire.PINNED_HEADER + size)
    return path, cookie, np.frombuffer(area, np.uint8, size, wire.PINNED_HEADER), fd


def one_call(session, name, args, seq=0, want_reply=True):
    """The Result (seq, status, message, u64s, payload) of one call sent alone, or None without a reply."""
    session.sock.send_multipart([wire.encode_request([(seq, name, args, None)], want_reply)[0]])
    return decode_reply(session.sock.recv_multipart())[-1] if want_reply else None


OTHERS_MEMFD = """
import fcntl, os, sys
fd = os.memfd_create("phos", os.MFD_ALLOW_SEALING)
os.ftruncate(fd, int(sys.argv[2]))
os.pwrite(fd, bytes.fromhex(sys.argv[1]), 0)
fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
print(f"/proc/{os.getpid()}/fd/{fd}", flush=True)
sys.stdin.readline()
"""


def test_the_worker_checks_what_a_client_says_of_pinned_memory(server, tmp_path):
    size = 1 << 20
    path, cookie, data, fd = pinned_file(size)
    unsealed, _, _, unsealed_fd = pinned_file(size, sealed=False)     # a client could cut it short: SIGBUS
    misnamed, _, _, misnamed_fd = pinned_file(size, name="other")     # somebody else's memory
    regular = tmp_path / "regular"
    regular.write_bytes(cookie + bytes(wire.PINNED_HEADER + size))
    regular_fd = os.open(regular, os.O_PATH)          # a file the client need not be able to write
    # another process's memfd, named as it names it: the worker looks in the asking process's descriptors
    other = subprocess.Popen([sys.executable, "-c", OTHERS_MEMFD, cookie.hex(), str(wire.PINNED_HEADER + size)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    s = RawSession(server.address)
    try:
        others = other.stdout.readline().strip()
        [(_, status, _, [device], _)] = s.call(("memAlloc", {"size": size}))
        assert status == 0

        def host_map(rid, where=path, secret=cookie, nbytes=size):
            r = one_call(s, "hostMap", {"id": rid, "path": where, "cookie": secret, "size": nbytes})
            assert r[1] == 0, r
            return r[3]
        for where, secret, nbytes in [("/etc/passwd", cookie, 16), (f"/proc/{os.getpid()}/fd/999999", cookie, size),
                                      (f"/proc/{os.getpid()}/fd/{regular_fd}", cookie, size), (others, cookie, size),
                                      (unsealed, cookie, size), (misnamed, cookie, size), (path + "/", cookie, size),
                                      (path, bytes(16), size), (path, cookie[:8], size),
                                      (path, cookie, size + 1), (path, cookie, 0), (path, cookie, 2**64 - 1)]:
            assert host_map(7, where, secret, nbytes) == [0], (where, secret, nbytes)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)                     # what the seal is for
        assert host_map(0) == [0]                       # ids are never 0
        assert host_map(7) == [1]
        assert host_map(7) == [0]                       # mapped already

        def copy(**args):
            fields = {"device": device, "range": 7, "offset": 0, "size": size, "stream": 0, "toDevice": True, "wait": True}
            r = one_call(s, "memcpyPinned", dict(fields, **args), seq=next(s.seqs))
            assert "internal error" not in r[2], r
            return r[1]
        data[:] = np.arange(size) % 253
        assert copy() == 0                              # host->device from our bytes, in place
        assert copy(toDevice=False, offset=4096, size=size - 4096) == 0
        assert (data[4096:] == np.arange(size - 4096) % 253).all()
        invalid = int(CUresult.CUDA_ERROR_INVALID_VALUE)
        assert copy(range=8) == invalid                 # a range this context does not have
        assert copy(offset=1) == invalid                # past the range's end
        assert copy(offset=2**64 - 1, size=2) == invalid
        assert copy(size=2**64 - 1) == invalid
        assert copy(device=device + 1) == invalid       # past the allocation's end

        # an asynchronous copy's failure waits for the next synchronizing call, not for hostUnmap
        one_call(s, "memcpyPinned", {"device": device, "range": 9, "size": 1, "toDevice": True}, seq=next(s.seqs),
                 want_reply=False)
        assert one_call(s, "hostUnmap", {"id": 7})[1] == 0
        assert one_call(s, "ctxSynchronize", None, seq=next(s.seqs))[1] == invalid
        assert one_call(s, "hostUnmap", {"id": 7})[1] == invalid     # unmapped already
        assert copy() == invalid
    finally:
        s.close()
        other.kill()
        other.wait()
        for descriptor in (fd, unsealed_fd, misnamed_fd, regular_fd):
            os.close(descriptor)


def test_memory_for_the_device_is_mapped_at_the_clients_address_or_refused_saying_why(server):
    """hostMap with an address (managed and mapped host memory): the worker maps the range at that
    address, or answers [0] with the reason; the address of a range mapped already is refused."""
    size = 1 << 16
    (path, cookie, _, fd), (path2, cookie2, _, fd2) = pinned_file(size), pinned_file(size)
    at = 0x300000000000 + (secrets.randbelow(1 << 20) << 21)
    s = RawSession(server.address)
    try:
        def host_map(rid, where, secret, address):
            args = {"id": rid, "path": where, "cookie": secret, "size": size, "address": address}
            s.sock.send_multipart([wire.encode_request([(0, "hostMap", args, None)], True)[0]])
            with wire.decode(wire.Reply, s.sock.recv_multipart()[0]) as reply:
                r = reply.results[-1]
                assert r.status == 0, r.message
                return list(r.u64s), r.text
        assert host_map(1, path, cookie, at) == ([1], "")
        status, why = host_map(2, path2, cookie2, at)        # taken, in the worker, by range 1
        assert status == [0] and f"cannot map {size} bytes at the application's address {at:#x}" in why, why
        status, why = host_map(3, path2, cookie2, at + 1)
        assert status == [0] and "is not a page" in why, why
        assert one_call(s, "hostUnmap", {"id": 1})[1] == 0
        assert host_map(2, path2, cookie2, at) == ([1], "")  # free again
    finally:
        s.close()
        os.close(fd)
        os.close(fd2)
