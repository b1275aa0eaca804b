"""Checkpoint and restore of live contexts through real servers (snapshot/engine.py).

A Python client program is the application; the tests drive checkpoints and restores
through the admin API and the `phos` CLI, kill servers, and check that the program goes
on, bit for bit. Runs on emu in CI, and with --backend cuda in perf/device/run.sh.
"""
import ctypes
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from conftest import wait_until
from ptx_helpers import compile_ptx
from phos.admin_cli import stub
from phos.schema import admin_pb2 as pb
from phos.schema.control import checkpoint_result
from phos.schema.cuda_types import CudaError
from phos.snapshot import DirStore, HostStore, latest_image, open_store, read_image, read_region
from phos.snapshot.fingerprint import _finish, finish_many, fingerprint, hash_parts
from phos.snapshot.image import read_delta

pytestmark = pytest.mark.gpu     # perf/device/run.sh runs this file with --backend cuda

P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
MiB = 1 << 20


class App:
    """The application: a context running the snapshot kernels through the Python client."""

    def __init__(self, cu):
        self.cu = cu
        self.ctx = self.ok(cu.cuCtxCreate(None, 0, 0))
        mod = self.ok(cu.cuModuleLoadData(compile_ptx("snapshot.cu").encode()))
        self.jacobi_fn = self.ok(cu.cuModuleGetFunction(mod, b"jacobi_step"))
        self.indirect_fn = self.ok(cu.cuModuleGetFunction(mod, b"write_indirect"))

    @property
    def id(self):
        return int(self.ctx)

    def ok(self, res):
        assert int(res[0]) == 0, (res, self.cu.last_error)
        return res[1] if len(res) == 2 else res[1:] if len(res) > 2 else None

    def put(self, a):
        a = np.ascontiguousarray(a)
        ptr = self.ok(self.cu.cuMemAlloc(a.nbytes))
        self.ok(self.cu.cuMemcpyHtoD(ptr, a, a.nbytes))
        return ptr

    def get(self, ptr, n, dtype=np.float32):
        out = np.zeros(n, dtype)
        self.ok(self.cu.cuMemcpyDtoH(out, ptr, out.nbytes))
        return out

    def jacobi(self, x, y, rhs, n, iters):
        """iters Jacobi sweeps, ping-ponging x and y; returns the pointer holding the result."""
        for _ in range(iters):
            self.ok(self.cu.cuLaunchKernel(self.jacobi_fn, -(-n // 256), 1, 1, 256, 1, 1, 0, 0,
                                           ((x, y, rhs, n), (P, P, P, I)), 0))
            x, y = y, x
        return x

    def write_indirect(self, table, value, n):
        self.ok(self.cu.cuLaunchKernel(self.indirect_fn, 64, 1, 1, 256, 1, 1, 0, 0, ((table, value, n), (P, F, I)), 0))

    def sync(self):
        self.ok(self.cu.cuCtxSynchronize())


def filler(nbytes, seed=0):
    """Distinct, non-zero contents: every chunk differs, so nothing deduplicates."""
    return (np.arange(nbytes // 8, dtype=np.uint64) * 0x9E3779B97F4A7C15 + seed).view(np.uint8)


@pytest.fixture
def copy_on_write(monkeypatch):
    """Checkpoints save what calls write first (copy-on-write), not from a device copy of the
    cut (what the device does when it has no room for one)."""
    from phos.snapshot import engine
    monkeypatch.setattr(engine, "DEVICE_COPY", False)


def emu_session_holding(data):
    """A worker's session on an emulated device, in process, with one allocation holding data."""
    from phos.gpu_server.backends.emu import EmuBackend
    from phos.gpu_server.worker.session import Session
    s = Session(EmuBackend(), 7, b"t" * 16)
    ptr = s.backend.alloc(len(data))
    s.backend.htod(ptr, data.tobytes(), None)
    return s, ptr


def checkpoint(server, ctx, store, **kw):
    msgs = list(stub(server.address).Checkpoint(pb.CheckpointRequest(ctx=ctx, store=str(store), **kw)))
    assert msgs[-1].finished
    return checkpoint_result(msgs[-1].result)


def restore(server, store, **kw):
    return stub(server.address).Restore(pb.RestoreRequest(store=str(store), **kw))


def checkpoint_underway(server, app, store):
    """Start a checkpoint in a thread and return (thread, result dict) once it is copying."""
    done = {}
    t = threading.Thread(target=lambda: done.update(checkpoint(server, app.id, store)))
    t.start()
    assert wait_until(lambda: state_of(server, app.id) == "checkpointing" or done, 20, 0.002)
    assert not done, "the checkpoint ended before the program could write during it: make the filler bigger"
    return t, done


def state_of(server, ctx):
    for c in stub(server.address).ListContexts(pb.ListContextsRequest()).contexts:
        if c.id == ctx:
            return c.state
    return None


def kill(server):
    server.proc.kill()          # the workers die with it (PDEATHSIG)
    server.proc.wait()
    assert wait_until(lambda: not server.workers(), 10)


def region(store, name, address):
    m = read_image(store, name)
    entry = next(e for e in m.allocations if e["address"] == address)
    return np.frombuffer(bytes(read_region(store, entry)), np.uint8)


def shipped_ptx(name):
    """snapshot/kernels/NAME.ptx, as the cuda backend loads it, checked to be NAME.cu's current build."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "snapshot", "kernels")
    ptx = open(os.path.join(root, f"{name}.ptx"), "rb").read()
    fresh = compile_ptx(os.path.abspath(os.path.join(root, f"{name}.cu")), "compute_75")
    assert fresh.split("\n", 7)[-1] == ptx.decode().split("\n", 7)[-1], f"snapshot/kernels/{name}.ptx is stale: rebuild it from {name}.cu"
    return ptx


def test_pfp1_kernel_matches_the_reference():
    """The GPU hash kernel computes pfp1 exactly (run here on the emulator), and its PTX is current."""
    from phos.gpu_server.backends.emu import EmuBackend
    ptx = shipped_ptx("pfp1")
    b = EmuBackend()
    fn = b.get_function(b.load_module(ptx), "pfp1_lane_sums")
    rng = np.random.default_rng(1)
    datas = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 5, 8, 4096, 10001, 70003)]
    ptrs = []
    for d in datas:
        ptrs.append(b.alloc(max(len(d), 1)))
        b.htod(ptrs[-1], d.tobytes(), None)
    rows = np.array([(p, len(d)) for p, d in zip(ptrs, datas)], np.uint64)

    def lane_sums(entries):
        table, sums = b.alloc(16 * len(entries)), b.alloc(16 * len(entries))
        b.htod(table, entries.tobytes(), None)
        b.launch(fn, (len(entries), 1, 1), (256, 1, 1), 0, None, struct.pack("<QQII", table, sums, len(entries), 0))
        out = np.zeros(16 * len(entries), np.uint8)
        b.dtoh(sums, out, None)
        return out.view(np.uint64).reshape(-1, 2)
    whole = lane_sums(rows)
    for (s0, s1), d in zip(whole, datas):
        assert _finish(int(s0), int(s1), len(d)) == fingerprint(d.tobytes()), len(d)
    # in parts of 4 KiB (cuda.py hashes a batch's few big chunks so): the parts add up
    entries, firsts = hash_parts(rows, 4096)
    assert len(entries) == 1 + 1 + 1 + 1 + 3 + 18
    assert (np.add.reduceat(lane_sums(entries), firsts, axis=0) == whole).all()
    # a part that starts 8 bytes past a 16-byte boundary (the kernel loads two words at once)
    p, d = ptrs[-1], datas[-1]
    split = np.array([(p, 8), (p + 8, (len(d) - 8) | 1 << 32)], np.uint64)
    assert (lane_sums(split).sum(axis=0) == whole[-1]).all()
    # chunks below 8-byte alignment (a module's int global): read a byte at a time, same sums
    odd = np.array([(p + 4, len(d) - 4), (ptrs[2] + 1, 7), (ptrs[3] + 2, 3)], np.uint64)
    expect = [d[4:], datas[2][1:8], datas[3][2:5]]
    assert finish_many(lane_sums(odd), odd[:, 1]) == [fingerprint(e.tobytes()) for e in expect]
    assert finish_many(whole, rows[:, 1]) == [fingerprint(d.tobytes()) for d in datas]


def test_copy_pieces_kernel_copies_each_piece_and_nothing_else():
    """The cut's device copy kernel (run here on the emulator) copies every piece whole: 16
    bytes at a time where both ends allow, a byte at a time elsewhere, the tail past the last
    16-byte word too; bytes between pieces stay as they were. Its PTX is current."""
    from phos.gpu_server.backends.emu import EmuBackend
    from phos.gpu_server.backends.staging_layout import pieces
    b = EmuBackend()
    fn = b.get_function(b.load_module(shipped_ptx("copy_pieces")), "copy_pieces")
    size = 1 << 16
    data = np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8)
    src, dst = b.alloc(size), b.alloc(size)
    b.htod(src, data.tobytes(), None)
    b.htod(dst, bytes(size), None)
    # aligned, split into pieces with a short last one; a 3-byte piece; ends at odd places
    # (a module's 4-byte global); aligned with a tail of 7 bytes past the last whole word
    copies = [(0, 0, 10000), (10016, 10016, 3), (12001, 14003, 77), (16384, 20480, 4096 + 7)]
    table = pieces([dst + d for d, _, _ in copies], [src + s for _, s, _ in copies], [n for _, _, n in copies], 4096)
    assert len(table) == 3 + 1 + 1 + 2
    device_table = b.alloc(table.nbytes)
    b.htod(device_table, table.tobytes(), None)
    b.launch(fn, (len(table), 1, 1), (256, 1, 1), 0, None, struct.pack("<QII", device_table, len(table), 0))
    out = np.zeros(size, np.uint8)
    b.dtoh(dst, out, None)
    expect = np.zeros(size, np.uint8)
    for d, s, n in copies:
        expect[d:d + n] = data[s:s + n]
    assert (out == expect).all()


def image_store(kind, tmp_path):
    """(path, `phos server` arguments) of an image store: a directory, or a HostStore in
    shared memory that the servers' workers copy straight into and out of."""
    path = tmp_path / "images"
    if kind == "host":
        HostStore.create(path, 256 * MiB)
        return path, ("--host-store", str(path))
    return path, ()


@pytest.mark.parametrize("kind", ["dir", "host"])
def test_killed_server_restored_elsewhere_continues_bit_for_bit(servers, client, tmp_path, monkeypatch, kind):
    """Checkpoint at iteration k, kill the server, restore into another server process: the
    program continues with the same pointers and ends bit for bit where an uninterrupted run does."""
    n, k, total = 1 << 15, 15, 40
    rhs = np.sin(np.arange(n, dtype=np.float32))
    store, args = image_store(kind, tmp_path)
    one = servers("one", args=args)
    cu = client(one)
    ref_app = App(cu)
    x, y, r = ref_app.put(np.zeros(n, np.float32)), ref_app.put(np.zeros(n, np.float32)), ref_app.put(rhs)
    expected = ref_app.get(ref_app.jacobi(x, y, r, n, total), n)
    cu.cuCtxDestroy(ref_app.ctx)

    app = App(cu)
    x, y, r = app.put(np.zeros(n, np.float32)), app.put(np.zeros(n, np.float32)), app.put(rhs)
    x, y = (x, y) if app.jacobi(x, y, r, n, k) == x else (y, x)
    app.sync()
    result = checkpoint(one, app.id, store)
    assert result["mode"] == "concurrent" and not result["paused"]
    kill(one)
    two = servers("two", args=args)            # another server process, another address
    standby = lambda: stub(two.address).Stats(pb.StatsRequest()).standby_workers     # noqa: E731
    assert wait_until(lambda: standby() == 1, 30)
    monkeypatch.setenv("PHOS_SERVER", two.address)
    reply = restore(two, store)
    assert reply.ctx == app.id
    # the restore took the pre-started worker; its replacement starts only once the client had
    # time to re-attach: a process start holds the front end up while it answers the client
    assert len(two.workers()) == 1
    addresses = {e["address"] for e in read_image(open_store(store), reply.name).allocations}
    assert {int(x), int(y), int(r)} <= addresses
    out = app.get(app.jacobi(x, y, r, n, total - k), n)
    assert out.tobytes() == expected.tobytes()
    assert wait_until(lambda: standby() == 1, 30), "the pool was not refilled after the restore"


def test_module_globals_below_the_allocations_keep_their_own_contents(servers, client, tmp_path, monkeypatch):
    """A program loads its module (globals with initialisers, one a pointer to another) before
    it allocates, so the globals lie below its allocations: each region's chunks in the image
    are its own (a checkpoint gave the allocation the globals' chunks, and them its), and a
    restore elsewhere brings back every global and allocation, with the kernel's updates.

    The device places a module's globals itself, elsewhere in each process (the driver does; emu
    does too): the addresses the program holds still reach them, as copies' and kernels'
    pointers, and the pointer one global holds to another is moved with it, through two restores."""
    one = servers("one")
    cu = client(one)
    app = App(cu)
    mod = app.ok(cu.cuModuleLoadData(compile_ptx("globals.cu").encode()))
    use = app.ok(cu.cuModuleGetFunction(mod, b"use_globals"))
    add_to = app.ok(cu.cuModuleGetFunction(mod, b"add_to"))
    counter, _ = app.ok(cu.cuModuleGetGlobal(mod, b"counter"))
    table, _ = app.ok(cu.cuModuleGetGlobal(mod, b"table"))
    n = 3 << 18                                       # 3 MiB of floats: more than one 2 MiB chunk
    out = app.put(np.full(n, -1, np.float32))     # above the globals on emu; the driver puts its own where it likes

    def run():
        app.ok(cu.cuLaunchKernel(use, -(-n // 256), 1, 1, 256, 1, 1, 0, 0, ((out, n), (P, I)), 0))
        app.sync()
    run()
    expected = app.get(out, n)
    assert app.get(counter, 1, np.int32)[0] == 8 and app.get(table, 3, np.int32).tolist() == [10, 20, 30]
    store = tmp_path / "images"
    name = checkpoint(one, app.id, store)["name"]
    assert region(open_store(store), name, int(out)).tobytes() == expected.tobytes()
    globals_ = {g["name"]: g for g in read_image(open_store(store), name).globals}
    assert bytes(read_region(open_store(store), globals_["counter"])) == np.int32(8).tobytes()
    kill(one)
    two = servers("two")
    monkeypatch.setenv("PHOS_SERVER", two.address)
    assert restore(two, store).ctx == app.id
    assert app.get(out, n).tobytes() == expected.tobytes()
    assert app.get(counter, 1, np.int32)[0] == 8 and app.get(table, 3, np.int32).tolist() == [10, 20, 30]
    run()                                             # tptr still points at table; counter goes on
    assert app.get(out, n).tobytes() == expected.tobytes() and app.get(counter, 1, np.int32)[0] == 9
    app.ok(cu.cuLaunchKernel(add_to, 1, 1, 1, 1, 1, 1, 0, 0, ((counter, 100), (P, I)), 0))
    app.ok(cu.cuMemsetD32(int(table) + 4, 21, 1))
    app.sync()
    assert app.get(counter, 1, np.int32)[0] == 109
    assert int(app.ok(cu.cuModuleGetGlobal(mod, b"counter"))[0]) == int(counter)
    name = checkpoint(two, app.id, store)["name"]     # of the restored context: its globals moved once already
    kill(two)
    three = servers("three")
    monkeypatch.setenv("PHOS_SERVER", three.address)
    assert restore(three, store, name=name).ctx == app.id
    run()
    assert app.get(counter, 1, np.int32)[0] == 110 and app.get(table, 3, np.int32).tolist() == [10, 21, 30]
    assert app.get(out, 6).tolist() == [i * 0.5 * (1, 2, 3, 4)[i % 4] + (10, 21, 30)[i % 3] for i in range(6)]


@pytest.mark.parametrize("kind", ["dir", "host"])
def test_concurrent_checkpoint_saves_the_state_at_the_cut(servers, client, tmp_path, kind):
    """The program keeps writing (memset, copies, kernels) while the checkpoint copies: the image
    holds the state at the cut, and no pause was needed."""
    store, args = image_store(kind, tmp_path)
    one = servers("one", args=args)
    app = App(client(one))
    app.put(filler(96 * MiB))                  # copied first, so the writes below land mid-copy
    n = 1 << 18
    before_x, before_y = np.arange(n, dtype=np.float32), np.full(n, 3.0, np.float32)
    x, y, r = app.put(before_x), app.put(before_y), app.put(np.ones(n, np.float32))
    app.sync()
    t, done = checkpoint_underway(one, app, store)
    app.ok(app.cu.cuMemsetD32(x, 0x7F7F7F7F, n))
    app.ok(app.cu.cuMemcpyHtoD(y, np.zeros(n, np.float32), 4 * n))
    app.jacobi(x, y, r, n, 3)
    app.sync()
    t.join()
    assert done["mode"] == "concurrent" and not done["paused"] and done["recopied_chunks"] == 0
    s = open_store(store)
    assert region(s, done["name"], int(x)).tobytes() == before_x.tobytes()
    assert region(s, done["name"], int(y)).tobytes() == before_y.tobytes()
    # what serving cost before and during it (perf/bench_snapshot.py): the puts and the sync
    # before, the writes during (some of the writes may come after its end, on a slow machine)
    (n_before, ms_before), (n_during, ms_during) = done["messages_served"]["before"], done["messages_served"]["during"]
    assert n_before >= 5 and n_during >= 1 and ms_before > 0 and ms_during > 0
    # counted afresh whenever a checkpoint ends; the front end's control messages are not counted
    checkpoint(one, app.id, store)
    for _ in range(5):
        app.sync()
    assert checkpoint(one, app.id, store)["messages_served"]["before"][0] == 5


def test_a_precopy_round_holds_no_write_up_and_stores_what_it_copied(tmp_path):
    """A handoff's pre-copy round has no cut: a write during it is not saved first (no
    copy-on-write, no fence), and every chunk is stored under the fingerprint of its own
    bytes, whatever the application wrote meanwhile, so a warm target can load each one."""
    from phos.snapshot.engine import Checkpoint
    from phos.snapshot.image import read_chunk
    s, ptr = emu_session_holding(filler(8 << 20))
    cp = Checkpoint(s, DirStore(tmp_path), "round0", precopy=True, chunk_size=1 << 20)
    urgent, save = [], cp.save
    cp.save = lambda idx, urgent_=False: urgent.append(urgent_) or save(idx, urgent_)
    cp.cut(0, paused=False)
    cp.before_write(ptr, 8 << 20)                  # what a call writing it asks: returns at once
    s.backend.htod(ptr, filler(8 << 20, seed=3).tobytes(), None)
    result = cp.finish(1)
    assert result["mode"] == "precopy" and True not in urgent and result["recopied_chunks"] == 0
    m = read_image(DirStore(tmp_path), "round0")
    assert m.metadata["mode"] == "precopy"
    assert latest_image(DirStore(tmp_path)) is None, "a pre-copy round is consistent in its objects only"
    for k in m.allocations[0]["chunks"]:           # check=True: the bytes fingerprint to their key
        read_chunk(DirStore(tmp_path), k, expected_len=1 << 20, check=True)


@pytest.mark.parametrize("written_behind", [False, True])
def test_a_copy_on_write_before_the_cuts_fingerprints_is_checked_once_they_are_in(tmp_path, written_behind, copy_on_write):
    """On a GPU the cut's fingerprint pass takes milliseconds. A call that writes memory right
    after the cut has its chunks copied into store slots, and goes on before the pass is done
    (its kernel waits behind the pass on the device): the copy is checked once the fingerprints
    are in. A copy that differs from the cut (memory written behind our back in between) is not
    published: the checkpoint pauses and takes the image again."""
    from phos.snapshot.engine import Checkpoint
    s, ptr = emu_session_holding(filler(8 << 20))
    HostStore.create(tmp_path / "host", 64 << 20, capacity=1 << 20)
    store = open_store(tmp_path / "host")
    ops, pass_done = s.backend.snap, threading.Event()

    class SlowPass:                  # the emulator's pass, not done until pass_done is set
        def __getattr__(self, name):
            return getattr(ops, name)

        def fingerprints(self, chunks, fence, frozen=None):
            wait = ops.fingerprints(chunks, fence, frozen)
            return lambda block=True: wait() if pass_done.is_set() else None
    s.backend.snap = SlowPass()
    cp = Checkpoint(s, store, "a", chunk_size=1 << 20)
    cp.cut(0, paused=False)
    at_cut = filler(8 << 20)
    if written_behind:
        s.backend.htod(ptr + (2 << 20), filler(1 << 20, seed=9).tobytes(), None)    # no call said so
    cp.before_write(ptr + (2 << 20), 1 << 20)        # the call's copy-on-write: kept aside, not checked
    assert cp.fps is None and len(cp.kept) == 1
    s.backend.htod(ptr + (2 << 20), filler(1 << 20, seed=7).tobytes(), None)        # the call's write
    pass_done.set()
    result = cp.finish(1)
    if written_behind:
        assert result["paused"] and result["recopied_chunks"] == 1
        now = at_cut.copy()
        now[2 << 20:3 << 20] = filler(1 << 20, seed=7)
        assert region(store, "a", ptr).tobytes() == now.tobytes()
    else:
        assert not result["paused"] and result["recopied_chunks"] == 0
        assert region(store, "a", ptr).tobytes() == at_cut.tobytes()
    assert store.stats()["free_slots"] + len(list(store.list_chunks())) == store.slots, "a slot was left reserved"


def test_a_paused_checkpoint_given_its_parents_layout_asks_only_about_what_changed(tmp_path):
    """With the parent's regions and keys (prior), a paused checkpoint takes the parent's key
    wherever a chunk's fingerprint is unchanged and asks the store about the rest: the image and
    its counts are those of one taken without them. A layout that differs is not used."""
    from phos.snapshot.engine import Checkpoint
    s, ptr = emu_session_holding(filler(8 << 20))
    ways = ("plain", "by_prior", "other_layout")
    bases = {}
    for way in ways:                          # each in a store of its own: the same base, the same changes
        bases[way] = Checkpoint(s, DirStore(tmp_path / way), "base", paused=True, chunk_size=1 << 20)
        bases[way].cut(0, paused=True)
        bases[way].finish(0)
    s.backend.htod(ptr + (3 << 20), filler(1 << 20, seed=5).tobytes(), None)          # one chunk changes
    s.backend.htod(ptr + (5 << 20), filler(8 << 20)[:1 << 20].tobytes(), None)       # one becomes chunk 0's
    results = {}
    for way in ways:
        base = bases[way]
        prior = {"plain": None, "by_prior": (base.chunks.regions, base.keys),
                 "other_layout": ([(ptr, 4 << 20, 1 << 20)], base.keys[:4])}[way]
        cp = Checkpoint(s, DirStore(tmp_path / way), "next", parent="base", paused=True, chunk_size=1 << 20,
                        known=base.chunk_keys(), prior=prior)
        asked, reuse = [], cp.writer.reuse_chunks
        cp.writer.reuse_chunks = lambda keys: asked.append(len(keys)) or reuse(keys)
        cp.cut(1, paused=True)
        deltas = []
        results[way] = (cp.finish(1, deltas.append), read_image(DirStore(tmp_path / way), "next").allocations[0]["chunks"],
                        asked, read_delta(deltas[0], "next").changes)
    plain, by_prior, other = results["plain"], results["by_prior"], results["other_layout"]
    assert by_prior[1] == plain[1] == other[1] and by_prior[1] != bases["plain"].keys
    for k in ("new_chunks", "reused_chunks", "copied_bytes"):
        assert by_prior[0][k] == plain[0][k] == other[0][k], k
    assert plain[0]["new_chunks"] == 1 and plain[0]["reused_chunks"] == 7
    assert by_prior[2][0] == 2 and plain[2][0] == other[2][0] == 8, "the cut looks up the two changed chunks only"
    # the handoff's delta: the two changed chunks, or, without the parent's keys, every chunk
    assert by_prior[3] == [(ptr, 3, by_prior[1][3]), (ptr, 5, by_prior[1][5])]
    assert plain[3] == [(ptr, j, k) for j, k in enumerate(plain[1])]


def test_a_concurrent_checkpoint_copies_in_the_steps_its_worker_takes(tmp_path):
    """The background copy runs in steps that the worker's loop takes between calls (no thread of
    its own, which would take the interpreter from the loop): nothing is copied until a step is
    taken. A write mid-copy saves its chunk first, and the image is the state at the cut."""
    from phos.snapshot.engine import Checkpoint
    before = filler(8 << 20)
    s, ptr = emu_session_holding(before)
    cp = Checkpoint(s, DirStore(tmp_path), "a", chunk_size=1 << 20)
    cp.cut(0, paused=False)
    threading.Event().wait(0.1)
    assert cp.running and not cp.chunks.state.any(), "copying began without being stepped"
    for _ in range(10000):                       # (a step that only looked at the device waits a little)
        if cp.chunks.state.any():
            break
        cp.advance()
    assert cp.chunks.state.any() and cp.bytes_done < 8 << 20      # under way, not done
    cp.before_write(ptr + (7 << 20), 8)          # a call about to write the last chunk: saved first
    s.backend.htod(ptr + (7 << 20), bytes(8), None)
    while cp.running:
        cp.advance()
    result = cp.finish(1)
    assert result["mode"] == "concurrent" and not result["paused"] and result["recopied_chunks"] == 0
    assert region(DirStore(tmp_path), "a", ptr).tobytes() == before.tobytes()
    from phos.snapshot.image import _glance      # latest_image's glance reads what we write
    raw = DirStore(tmp_path).get_manifest("a")[0]
    assert _glance(raw) == ("concurrent", {"ctx": 7, "token": s.token_digest, "next_id": s.next_id})


def test_a_paced_checkpoint_keeps_to_its_rate_and_saves_the_cut(tmp_path, monkeypatch):
    """rate: from the cut on, the background copy hands the device no more than that many bytes a
    second (and a batch or two in flight), so that it takes longer and the application keeps more
    of its speed; the image is still the state at the cut. A rate for a paused checkpoint, or
    one under the least, is refused by name."""
    from phos.snapshot import engine
    monkeypatch.setattr(engine, "LEAST_RATE", 1 << 20)
    monkeypatch.setattr(engine, "BATCH_BYTES", 1 << 20)         # a chunk a batch: the copy's pace shows
    before = filler(8 << 20)
    s, ptr = emu_session_holding(before)
    for bad, why in ((dict(rate=1 << 19), "under the least"), (dict(rate=16 << 20, paused=True), "only a concurrent")):
        with pytest.raises(CudaError, match=why):
            engine.Checkpoint(s, DirStore(tmp_path), "bad", chunk_size=1 << 20, **bad)
    rate = 16 << 20                               # 8 MiB in 0.5 s
    cp = engine.Checkpoint(s, DirStore(tmp_path), "a", chunk_size=1 << 20, rate=rate)
    cp.cut(0, paused=False)
    t, ahead = time.perf_counter(), 0
    s.backend.htod(ptr, bytes(8), None)          # after the cut: not in the image
    while cp.running:
        cp.advance()
        ahead = max(ahead, cp.fed - rate * (time.perf_counter() - t))
    took = time.perf_counter() - t
    assert ahead <= 3 << 20 and took >= 0.3, (ahead, took)        # a few batches in flight at most
    cp.finish(1)
    assert region(DirStore(tmp_path), "a", ptr).tobytes() == before.tobytes()


def slow_cut_fingerprints(session, looks):
    """Make the cut's fingerprints take `looks` looks to come in, as a GPU's pass over a large
    context does, so that a call's copy-on-write starts before them."""
    snap = session.backend.snap
    taken = snap.fingerprints

    def fingerprints(chunks, fence, frozen=None):
        wait, left = taken(chunks, fence, frozen), [looks]

        def slow(block=True):
            left[0] -= 1
            return wait() if block or left[0] < 0 else None
        return slow
    snap.fingerprints = fingerprints


@pytest.mark.parametrize("behind_our_back", [False, True])
def test_a_copy_on_write_before_the_cuts_fingerprints_are_in(tmp_path, behind_our_back, copy_on_write):
    """A call right after the cut saves its chunks at once, beside the cut's fingerprint pass,
    and checks them against it when it is done: a chunk the store holds already is taken as
    it is, and one written after the cut behind our back is still caught (the image is then
    taken again at a new cut, paused)."""
    from phos.snapshot.engine import Checkpoint
    before = filler(8 << 20)
    s, ptr = emu_session_holding(before)
    store = DirStore(tmp_path)
    first = Checkpoint(s, store, "a", chunk_size=1 << 20)
    first.cut(0, paused=True)
    first.finish(0)
    slow_cut_fingerprints(s, looks=50)
    cp = Checkpoint(s, store, "b", parent="a", chunk_size=1 << 20)
    cp.cut(1, paused=False)
    if behind_our_back:                          # a kernel storing through a pointer it loaded
        s.backend.htod(ptr + (6 << 20), bytes(8), None)
    cp.before_write(ptr + (6 << 20), 1 << 20)    # a call about to write chunk 6: saved first
    assert cp.fps is not None and cp.done(range(6, 7))
    s.backend.htod(ptr + (6 << 20), b"\xff" * 8, None)
    while cp.running:
        cp.advance()
    result = cp.finish(2)
    assert result["paused"] == (result["recopied_chunks"] > 0) and (behind_our_back or not result["paused"])
    expected = s.backend.snap.view(ptr, 8 << 20) if result["paused"] else before    # paused: a new cut, now
    assert region(store, "b", ptr).tobytes() == expected.tobytes()


def test_differing_chunk_keys_are_found_in_one_step_or_one_by_one():
    """A warm copy's advance finds the chunks whose keys changed: NumPy compares lists of
    32-hex-digit keys; a list holding anything else is compared one by one, the same way."""
    from phos.snapshot.engine import differing
    a = [f"{i:032x}" for i in range(100)]
    b = list(a)
    b[3], b[97] = "f" * 32, "e" * 32
    assert differing(a, b).tolist() == [3, 97] and differing(a, a).tolist() == []
    assert differing(a[:3] + [None], a[:3] + ["0" * 32]).tolist() == [3]
    assert differing(["ab", "cd"], ["ab", "ce"]).tolist() == [1]


def test_what_a_call_touches_that_is_not_yet_saved(tmp_path):
    """not_done: the chunks a call's range, or its kernel's whole allocation, covers until
    they are saved; then nothing, and a whole allocation found saved is not looked at again."""
    from phos.snapshot.engine import Checkpoint
    s, ptr = emu_session_holding(filler(8 << 20))
    cp = Checkpoint(s, DirStore(tmp_path), "a", chunk_size=1 << 20)
    cp.cut(0, paused=False)
    assert list(cp.not_done(ptr, 0, whole=True)) == list(range(8))
    assert list(cp.not_done(ptr + (3 << 20) - 1, 2, whole=False)) == [2, 3]
    assert cp.not_done(ptr + (8 << 20), 8, whole=False) is None and cp.not_done(ptr - 1, 0, whole=True) is None
    while cp.running:
        cp.advance()
    assert cp.not_done(ptr + 5, 0, whole=True) is None and cp.settled == {0}
    assert cp.not_done(ptr, 8 << 20, whole=False) is None
    cp.finish(1)


def test_a_waiting_call_goes_before_the_checkpoints_next_step(tmp_path, monkeypatch):
    """The worker's loop says when a call waits (busy): the copy's next step waits for it, but
    no longer than STEP_AT_LEAST since its last, or a steady stream of calls would stall it."""
    from phos.snapshot import engine
    s, _ = emu_session_holding(filler(8 << 20))
    cp = engine.Checkpoint(s, DirStore(tmp_path), "a", chunk_size=1 << 20)
    cp.cut(0, paused=False)
    cp.advance()
    stepped = cp.stepped_at
    asked = []

    def busy():
        asked.append(True)
        return True
    cp.look_at = time.perf_counter() + 3600      # no step due: the loop is not asked about calls
    cp.advance(busy=busy)
    assert not asked and cp.stepped_at == stepped
    monkeypatch.setattr(engine, "LOOK_EVERY", 0.0)
    cp.look_at = 0.0                             # only the waiting call may hold the next step
    monkeypatch.setattr(engine, "STEP_AT_LEAST", 3600.0)
    cp.advance(busy=busy)
    assert asked and cp.stepped_at == stepped, "a step was taken while a call waited"
    monkeypatch.setattr(engine, "STEP_AT_LEAST", 0.0)
    cp.advance(busy=busy)
    assert cp.stepped_at > stepped, "the copy waited longer than STEP_AT_LEAST"
    while cp.running:
        cp.advance(busy=busy)
    assert cp.finish(1)["bytes"] == 8 << 20


def test_a_second_checkpoint_while_one_runs_is_refused_at_once(servers, client, tmp_path):
    one = servers("one")
    app = App(client(one))
    app.put(filler(96 * MiB))
    app.sync()
    t, done = checkpoint_underway(one, app, tmp_path / "images")
    with pytest.raises(grpc.RpcError) as e:
        checkpoint(one, app.id, tmp_path / "other")
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "still running" in e.value.details()
    t.join()
    assert done["bytes"] >= 96 * MiB


@pytest.mark.parametrize("device_copy", [False, True])
def test_a_write_through_a_loaded_pointer_is_caught(servers, client, tmp_path, monkeypatch, device_copy):
    """A kernel writes memory no argument names, mid-copy. Saved by copy-on-write, validation
    sees the change, the engine pauses and recopies, and the image is the consistent state at
    the new cut. Saved from the cut's device copy, the write cannot reach the image: it is the
    state at the cut, with nothing recopied."""
    monkeypatch.setenv("PHOS_CHECKPOINT_DEVICE_COPY", str(int(device_copy)))
    one = servers("one")
    app = App(client(one))
    app.put(filler(256 * MiB))                 # copied first: the kernel below runs before `target` is
    n = 1 << 18
    target = app.put(np.ones(n, np.float32))
    table = app.put(np.array([int(target)], np.uint64))
    app.sync()
    store = tmp_path / "images"
    t, done = checkpoint_underway(one, app, store)
    app.write_indirect(table, 7.0, n)
    app.sync()
    t.join()
    image = region(DirStore(store), done["name"], int(target)).view(np.float32)
    assert read_image(DirStore(store), done["name"]).metadata["device_copy"] == device_copy
    if device_copy:
        assert done["mode"] == "concurrent" and not done["paused"] and done["recopied_chunks"] == 0
        assert (image == 1.0).all()
    else:
        assert done["mode"] == "concurrent" and done["paused"] and done["recopied_chunks"] >= 1
        assert (image == 7.0).all()
    assert (app.get(target, n) == 7.0).all()


def test_a_deferred_loader_loads_only_what_calls_touch_until_it_is_started(tmp_path):
    """A restore on demand holds its background loader until the worker starts it (its client
    served first): meanwhile a call loads just the chunks it touches; once started, everything
    loads and the contents are the image's."""
    from phos.gpu_server.backends.emu import EmuBackend
    from phos.gpu_server.worker.session import Session
    from phos.snapshot.engine import Checkpoint, Restore
    s, ptr = emu_session_holding(filler(8 << 20))
    cp = Checkpoint(s, DirStore(tmp_path), "a", paused=True, chunk_size=1 << 20)
    cp.cut(1, paused=True)
    cp.finish(1)
    fresh = Session(EmuBackend(), 0, b"t" * 16)
    r = Restore(fresh, DirStore(tmp_path), "a")
    r.recreate()
    r.start(full=False, deferred=True)
    assert r.loader_held and r.running and r.thread is None
    threading.Event().wait(0.2)
    assert r.bytes_done == 0, "the loader ran before it was started"
    r.before_access(ptr + (3 << 20) + 5, 8)
    assert r.bytes_done == 1 << 20                  # the one chunk the call touched
    r.start_loader()
    r.wait()
    assert not r.running and r.bytes_done == r.bytes_total == 8 << 20
    out = np.empty(8 << 20, np.uint8)
    fresh.backend.dtoh(ptr, out, None)
    assert out.tobytes() == filler(8 << 20).tobytes()


def test_on_demand_restore_runs_kernels_before_everything_is_loaded(servers, client, tmp_path, monkeypatch):
    one = servers("one")
    app = App(client(one))
    app.put(filler(160 * MiB))
    n = 1 << 16
    rhs = np.cos(np.arange(n, dtype=np.float32))
    x, y, r = app.put(rhs * 2), app.put(np.zeros(n, np.float32)), app.put(rhs)
    app.sync()
    store = tmp_path / "images"
    checkpoint(one, app.id, store)
    kill(one)
    two = servers("two")
    monkeypatch.setenv("PHOS_SERVER", two.address)
    reply = restore(two, store)
    out = app.get(app.jacobi(x, y, r, n, 1), n)
    stats = {c.id: c for c in stub(two.address).ListContexts(pb.ListContextsRequest()).contexts}
    expected = np.empty(n, np.float32)
    left, right = np.r_[0.0, rhs[:-1] * 2].astype(np.float32), np.r_[rhs[1:] * 2, 0.0].astype(np.float32)
    expected[:] = np.float32(0.5) * (left + right + rhs)
    assert np.allclose(out, expected, rtol=1e-6)
    first = json.loads(subprocess.run([sys.executable, "-m", "phos.cli", "ctx", "list", "--json", "--server", two.address],
                                      capture_output=True, text=True, check=True).stdout)
    assert any(c["id"] == reply.ctx for c in first)
    assert stats[reply.ctx].first_call_loaded < reply.bytes, "the first call waited for the whole image"


@pytest.mark.parametrize("kind", ["dir", "host"])
def test_incremental_checkpoint_stores_only_what_changed(servers, client, tmp_path, kind):
    store, args = image_store(kind, tmp_path)
    one = servers("one", args=args)
    app = App(client(one))
    big = app.put(filler(32 * MiB))
    app.sync()
    first = checkpoint(one, app.id, store)
    app.ok(app.cu.cuMemsetD8(big, 0x55, MiB))      # one chunk changes
    app.sync()
    second = checkpoint(one, app.id, store, incremental=True)
    assert first["copied_bytes"] >= 32 * MiB and second["copied_bytes"] <= 2 * MiB
    assert second["stored_bytes"] < first["stored_bytes"] / 8
    m = read_image(open_store(store), second["name"])
    assert m.parent == first["name"]
    image = region(open_store(store), second["name"], int(big))
    if kind == "host":          # the chunks went to the slots, none to files
        assert open_store(store).stats()["chunks"] == first["new_chunks"] + second["new_chunks"]
        assert not os.listdir(store / "chunks")
    assert (image[:MiB] == 0x55).all() and image[MiB:].tobytes() == filler(32 * MiB)[MiB:].tobytes()


def test_corrupt_and_truncated_images_are_refused(servers, client, tmp_path):
    one = servers("one")
    app = App(client(one))
    app.put(filler(4 * MiB))
    app.sync()
    store = tmp_path / "images"
    good = checkpoint(one, app.id, store, name="good")["name"]
    bad = tmp_path / "bad"
    checkpoint(one, app.id, bad, name="bad")
    two = servers("two")
    chunk = next(p for p in sorted((bad / "chunks").rglob("*")) if p.is_file() and p.stat().st_size > 4096)
    raw = bytearray(chunk.read_bytes())
    raw[-1] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    with pytest.raises(grpc.RpcError) as e:
        restore(two, bad, full=True)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and chunk.name in e.value.details()
    manifest = bad / "images" / "bad.json"
    manifest.write_bytes(manifest.read_bytes()[:-20])
    with pytest.raises(grpc.RpcError) as e:
        restore(two, bad, name="bad")
    assert "bad" in e.value.details() and e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert wait_until(lambda: stub(two.address).Stats(pb.StatsRequest()).standby_workers == 1, 30)    # refilled
    standby = two.workers()
    with pytest.raises(grpc.RpcError) as e:
        restore(two, tmp_path / "nothing-here")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "no image in" in e.value.details()
    assert two.workers() == standby and not (tmp_path / "nothing-here").exists(), "no worker spent, no store made"
    read_image(DirStore(store), good)          # the other image is intact
    assert not stub(two.address).ListContexts(pb.ListContextsRequest()).contexts   # no half-restored context
    assert app.get(app.put(np.ones(8, np.float32)), 8).sum() == 8                   # and the program runs on


def test_cli_and_admin_api(servers, client, tmp_path):
    one = servers("one")
    app = App(client(one))
    a = app.put(filler(3 * MiB))
    app.sync()
    cli = [sys.executable, "-m", "phos.cli"]
    rows = json.loads(subprocess.run(cli + ["ctx", "list", "--json", "--server", one.address],
                                     capture_output=True, text=True, check=True).stdout)
    row = next(r for r in rows if r["id"] == app.id)
    assert row["bytes"] >= 3 * MiB
    store = tmp_path / "images"
    out = subprocess.run(cli + ["checkpoint", str(app.id), str(store), "--pause", "--json", "--server", one.address],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["mode"] == "paused" and result["bytes"] >= 3 * MiB
    image = json.loads(subprocess.run(cli + ["image", "inspect", str(store), "--json"],
                                      capture_output=True, text=True, check=True).stdout)
    assert {"address": int(a), "size": 3 * MiB} in [{k: e[k] for k in ("address", "size")} for e in image["allocations"]]
    text = subprocess.run(cli + ["checkpoint", str(app.id), str(store), "--server", one.address],
                          capture_output=True, text=True, check=True).stdout
    assert "GB/s" in text and "paused" in text
    bad = subprocess.run(cli + ["checkpoint", "12345", str(store), "--server", one.address], capture_output=True, text=True)
    assert bad.returncode != 0 and "no context 12345" in bad.stderr
    slow = subprocess.run(cli + ["checkpoint", str(app.id), str(store), "--rate", "1M", "--server", one.address],
                          capture_output=True, text=True)
    assert slow.returncode != 0 and "under the least of 64 MiB a second" in slow.stderr, slow.stderr
    paced = subprocess.run(cli + ["checkpoint", str(app.id), str(store), "--rate", "64M", "--json", "--server", one.address],
                           capture_output=True, text=True, check=True)
    assert json.loads(paced.stdout)["mode"] == "concurrent"
    assert np.array_equal(app.get(a, 3 * MiB, np.uint8), filler(3 * MiB))
    stats = stub(one.address).Stats(pb.StatsRequest())
    assert stats.checkpoints == 3 and stats.contexts >= 1
    assert 0 < stats.checkpoint_seconds < 60
    freed = stub(one.address).DeleteImage(pb.DeleteImageRequest(store=str(store), name=result["name"]))
    assert freed.freed_chunks == 0          # the other images still hold every chunk
    assert len(DirStore(store).list_images()) == 2


def test_a_context_whose_worker_does_not_answer_is_listed_as_busy(servers, client):
    """ListContexts asks each worker to describe its context; one that does not answer in time
    (here stopped; on emu, a batch of kernels takes seconds) is listed as last seen, "busy",
    not left out as if it had gone."""
    one = servers("one")
    app = App(client(one))
    app.put(filler(3 * MiB))
    app.sync()
    seen = {c.id: c for c in stub(one.address).ListContexts(pb.ListContextsRequest()).contexts}
    assert seen[app.id].state == "running" and seen[app.id].bytes >= 3 * MiB
    pid = seen[app.id].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        now = {c.id: c for c in stub(one.address).ListContexts(pb.ListContextsRequest()).contexts}
    finally:
        os.kill(pid, signal.SIGCONT)
    assert now[app.id].state == "busy" and now[app.id].bytes == seen[app.id].bytes and now[app.id].pid == pid
    app.sync()                 # it serves on
    assert {c.id: c.state for c in stub(one.address).ListContexts(pb.ListContextsRequest()).contexts}[app.id] == "running"


def test_a_full_host_store_fails_the_checkpoint_clearly_and_the_context_lives_on(servers, client, tmp_path):
    host = HostStore.create(tmp_path / "small", 8 * (4096 + (2 << 20)))       # 8 slots, 16 MiB
    one = servers("one", args=("--host-store", host.path))
    app = App(client(one))
    data = filler(32 * MiB)
    ptr = app.put(data)
    app.sync()
    with pytest.raises(grpc.RpcError, match="is full"):
        checkpoint(one, app.id, host.path)
    assert not host.list_images()
    assert host.stats()["free_slots"] == 8, "what the failed checkpoint stored (its module) was not given back"
    assert app.get(ptr, 32 * MiB, np.uint8).tobytes() == data.tobytes()       # still live, unharmed
    assert checkpoint(one, app.id, tmp_path / "dir")["bytes"] >= 32 * MiB     # and a store with room takes it


def test_a_compressed_image_in_a_host_store_goes_through_buffers_and_restores(servers, client, tmp_path, monkeypatch):
    """Compressed chunks cannot be copied straight into slots or out of them: they go through
    the buffers, into slots all the same, and restore bit for bit."""
    store, args = image_store("host", tmp_path)
    one = servers("one", args=args)
    app = App(client(one))
    data = filler(8 * MiB)
    ptr = app.put(data)
    app.sync()
    result = checkpoint(one, app.id, store, compress=True)
    assert result["stored_bytes"] < result["copied_bytes"] and open_store(store).stats()["chunks"] == result["new_chunks"]
    kill(one)
    two = servers("two", args=args)
    monkeypatch.setenv("PHOS_SERVER", two.address)
    restore(two, store, full=True)
    assert app.get(ptr, 8 * MiB, np.uint8).tobytes() == data.tobytes()


def test_a_damaged_host_store_is_refused_clearly_and_the_context_lives_on(servers, client, tmp_path):
    """Bad input: a host store whose index was overwritten. Every admin call naming it says
    so; the context, its worker and the server go on."""
    host = HostStore.create(tmp_path / "host", 64 * MiB)
    one = servers("one")
    app = App(client(one))
    data = filler(4 * MiB)
    ptr = app.put(data)
    app.sync()
    with open(os.path.join(host.path, "slots"), "r+b") as f:
        f.write(b"NOTPHOS!")
    calls = {"checkpoint": lambda: checkpoint(one, app.id, host.path),
             "incremental checkpoint": lambda: checkpoint(one, app.id, host.path, incremental=True),
             "restore": lambda: restore(one, host.path),
             "restore by name": lambda: restore(one, host.path, name="x"),
             "delete": lambda: stub(one.address).DeleteImage(pb.DeleteImageRequest(store=str(host.path), name="x"))}
    for what, call in calls.items():
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert "not a phos host store index" in e.value.details(), (what, e.value.details())
    assert app.get(ptr, 4 * MiB, np.uint8).tobytes() == data.tobytes()
    assert checkpoint(one, app.id, tmp_path / "dir")["bytes"] >= 4 * MiB


def test_reading_a_store_that_is_not_there_makes_no_directory(server, tmp_path):
    """Restore and DeleteImage of a path that holds no store fail, and leave no store behind."""
    missing = tmp_path / "missing"
    for name in ("", "img"):
        with pytest.raises(grpc.RpcError):
            restore(server, missing, name=name)
    with pytest.raises(grpc.RpcError):
        stub(server.address).DeleteImage(pb.DeleteImageRequest(store=str(missing), name="img"))
    assert not missing.exists()


def test_the_cli_names_a_store_from_where_it_runs(server, tmp_path):
    """A relative path means the caller's directory, not the server's."""
    (tmp_path / "here").mkdir()
    r = subprocess.run([sys.executable, "-m", "phos.cli", "restore", "rel/store", "--name", "img", "--server", server.address],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path / "here")
    assert r.returncode != 0 and str(tmp_path / "here" / "rel" / "store") in r.stderr, r.stderr
    assert not (tmp_path / "here" / "rel").exists()


@pytest.mark.parametrize("room", [True, False])
def test_a_concurrent_cut_saves_from_a_device_copy_where_the_device_has_room(tmp_path, monkeypatch, room):
    """The cut copies the context on the device (freeze) and saves from that copy: a call that
    writes memory before it is saved needs no copy-on-write, and the image holds the cut's
    bytes. Without room for the copy, calls save what they write first, as before."""
    from phos.snapshot.engine import Checkpoint
    at_cut = filler(8 << 20)
    s, ptr = emu_session_holding(at_cut)
    if not room:
        monkeypatch.setattr(s.backend.snap, "freeze", lambda regions, step=None, ahead=None: None)
    saved = []
    real_save = Checkpoint.save
    monkeypatch.setattr(Checkpoint, "save", lambda self, idx, urgent=False: (saved.append(urgent), real_save(self, idx, urgent))[1])
    store = DirStore(tmp_path)
    cp = Checkpoint(s, store, "a", chunk_size=1 << 20)
    cp.cut(1, paused=False)
    s.checkpoint = cp
    s.touch(ptr, 8 << 20)                                  # a call about to write it all
    s.backend.htod(ptr, filler(8 << 20, seed=5).tobytes(), None)
    result = cp.finish(2)
    assert (True in saved) == (not room), "copy-on-write saves: expected only without room for a device copy"
    assert read_image(store, "a").metadata["device_copy"] == room and result["bytes"] == 8 << 20
    assert region(store, "a", ptr).tobytes() == at_cut.tobytes()


def fingerprints_held(snap):
    """The cut's fingerprint pass stays under way (its wait says None) until the test sets the
    Event it returns, as a device's pass takes milliseconds behind the application's kernels."""
    real, ready = snap.fingerprints, threading.Event()

    def fingerprints(chunks, fence, frozen=None):
        wait = real(chunks, fence, frozen)
        return lambda block=True: wait(block) if block or ready.is_set() else None
    snap.fingerprints = fingerprints
    return ready


@pytest.mark.parametrize("parent", [False, True])
def test_a_device_copy_goes_to_a_host_store_before_the_cuts_fingerprints_are_in(tmp_path, parent):
    """From the cut's device copy into a HostStore's slots, the background copy starts before
    the cut's fingerprints are in (nothing can change those bytes); its batches are checked
    and published once they are, and the image holds the cut's bytes. After a parent of the
    same layout it waits for them: they say which chunks the store holds already."""
    from phos.snapshot.engine import Checkpoint
    at_cut = filler(8 << 20)
    s, ptr = emu_session_holding(at_cut)
    store = HostStore.create(tmp_path / "host", 24 * ((1 << 20) + 4096), capacity=1 << 20)
    if parent:
        first = Checkpoint(s, store, "parent", chunk_size=1 << 20)
        first.cut(1, paused=False)
        s.checkpoint = first
        first.finish(1)
    ready = fingerprints_held(s.backend.snap)
    # with the parent's regions and keys, as a worker keeps them of its last image (Worker.remember)
    cp = Checkpoint(s, store, "a", chunk_size=1 << 20, **({"parent": "parent", "prior": (first.chunks.regions, first.keys),
                                                           "known": first.chunk_keys()} if parent else {}))
    cp.cut(2, paused=False)
    s.checkpoint = cp
    assert cp.frozen is not None and cp.direct
    for _ in range(50):
        cp.advance()
    copied_early = sum(len(batch[0]) for batch, _ in cp.kept)
    assert copied_early == (0 if parent else 8), "chunks copied before the cut's fingerprints"
    s.backend.htod(ptr, filler(8 << 20, seed=5).tobytes(), None)      # the application writes after the cut
    ready.set()
    result = cp.finish(3)
    assert not cp.kept and result["recopied_chunks"] == 0 and result["device_copy"]
    assert region(store, "a", ptr).tobytes() == at_cut.tobytes()
    assert result["copied_bytes"] == (0 if parent else 8 << 20)


# -- the cut's device copy, mapped ahead of the cut (SnapshotOps.map_ahead) -----------------
class Sent(list):
    """A worker's socket, in process: what it sent. No call ever waits on it."""

    def send_multipart(self, frames, copy=True, flags=0):
        self.append([bytes(f) for f in frames])

    def getsockopt(self, option):
        return 0


def worker_holding(data):
    """The control (ContextControl) of a worker in process (emu) whose context holds data
    (emu_session_holding), with the front end attached to its control socket."""
    from phos.gpu_server.worker.loop import Worker
    s, ptr = emu_session_holding(data)
    w = Worker(s, Sent(), Sent())
    w.control.peers.add(b"front end")
    return w.control, s, ptr


def ask_checkpoint(w, seq, store, name):
    """A concurrent checkpoint asked for on the control socket, as the front end asks."""
    from phos.schema import admin_pb2 as pb
    w.call(b"front end", seq, "checkpoint", pb.WorkerCheckpointRequest(
        store=str(store), name=name, parent="", paused=False, compress=False, chunk_size=1 << 20, freeze=False,
        precopy=False, no_sync=True, early=False, rate=0))


def answers(w):
    """[(seq, kind, value)] of the worker's control replies so far; a checkpoint's result as the
    dict `phos checkpoint --json` prints."""
    from phos.schema import control_socket
    from phos.schema.control import checkpoint_result
    replies = [control_socket.read_reply(frame) for _, frame in w.sock]
    return [(seq, kind, checkpoint_result(value) if kind == "checkpointed" else value) for seq, kind, value in replies]


def mapping_held(snap):
    """map_ahead's memory comes only once the test hands it over (hand_over), as a device's
    mapping takes milliseconds: [(the Future the checkpoint got, the real one)]."""
    from concurrent.futures import Future
    real, held = snap.map_ahead, []

    def map_ahead(nbytes):
        held.append((Future(), real(nbytes)))
        return held[-1][0]
    snap.map_ahead = map_ahead
    return held


def hand_over(held):
    for given, real in held:
        if not given.done():
            given.set_result(real.result())


@pytest.mark.parametrize("growth", ["none", "within its room", "past its room"])
def test_a_concurrent_checkpoint_maps_its_device_copy_ahead_of_the_cut(tmp_path, monkeypatch, growth):
    """Asked for, a concurrent checkpoint maps the memory for its cut's device copy first, the
    application's calls served meanwhile, and the worker takes the cut once it is mapped: the
    cut copies into it, and the trace shows the mapping as a step before the cut. A checkpoint
    or restore asked for meanwhile is refused as while one runs. A context that grew past that
    memory by the cut is copied into memory mapped then. Either way the image is the state at
    the cut, and nothing mapped is left."""
    from phos.schema import admin_pb2 as pb
    from phos.snapshot import engine
    from phos.schema.cuda_types import CUresult
    monkeypatch.setattr(engine, "DEVICE_COPY", True)
    if growth == "past its room":                # memory for the context's bytes then, none more
        monkeypatch.setattr(engine, "AHEAD_SPARE", 0)
        monkeypatch.setattr(engine, "AHEAD_ROOM", 1 << 40)
    w, s, ptr = worker_holding(filler(8 << 20))
    snap = s.backend.snap
    held = mapping_held(snap)
    store = tmp_path / "images"
    ask_checkpoint(w, 1, store, "a")
    cp = s.checkpoint
    assert cp is not None and cp.before_cut and len(held) == 1 and not answers(w), "the cut did not wait for the mapping"
    s.backend.htod(ptr, b"\xff" * 8, None)      # the application's calls, served while it maps
    more = None
    if growth != "none":
        more = s.backend.alloc(1 << 20)
        s.backend.htod(more, filler(1 << 20, seed=3).tobytes(), None)
    ask_checkpoint(w, 2, tmp_path / "other", "b")
    w.call(b"front end", 3, "restore", pb.RestoreRequest(store=str(store), name="a", full=False, advance=False, warm=False))
    refused = {seq: (kind, value) for seq, kind, value in answers(w)}
    assert refused == {2: ("failed", (CUresult.CUDA_ERROR_ILLEGAL_STATE,
                                      "checkpoint: a checkpoint or restore of this context is still running")),
                       3: ("failed", (CUresult.CUDA_ERROR_ILLEGAL_STATE, "restore: this worker already holds a context"))}
    assert len(held) == 1 and snap.mapped_ahead == 1, "a refused checkpoint mapped memory"
    for _ in range(3):
        w.tick()
    assert s.checkpoint is cp and cp.before_cut and not cp.running, "cut before its memory was mapped"
    w.loop.ack = 7                              # the last call answered: the cut's
    at_cut = snap.view(ptr, 8 << 20).copy()
    hand_over(held)
    w.tick()
    assert not cp.before_cut and cp.cut_seq == 7
    s.touch(ptr, 8 << 20)                       # a call after the cut writes it all
    s.backend.htod(ptr, filler(8 << 20, seed=5).tobytes(), None)
    while s.checkpoint is not None:
        w.tick()
    seq, kind, result = answers(w)[-1]
    assert (seq, kind) == (1, "checkpointed") and result["cut_seq"] == 7 and result["mode"] == "concurrent"
    assert read_image(DirStore(store), "a").metadata["device_copy"]
    assert region(DirStore(store), "a", ptr).tobytes() == at_cut.tobytes()
    if more is not None:
        assert region(DirStore(store), "a", more).tobytes() == filler(1 << 20, seed=3).tobytes()
    [(at, _, ms)] = [step for step in result["trace_ms"] if step[1] == "freeze_map_ahead"]
    assert at < 0 < ms and result["phase_ms"]["freeze_map_ahead"] > 0, "the mapping is not traced before the cut"
    assert snap.copies_ahead == (growth != "past its room"), "the cut copied elsewhere than into the memory mapped ahead"
    assert snap.mapped_ahead == 0, "memory mapped ahead was left"


@pytest.mark.parametrize("end", ["context gone", "cut failed"])
def test_a_checkpoint_ended_before_its_cut_leaves_nothing_mapped(tmp_path, monkeypatch, end):
    """A checkpoint that ends before its cut gives back what it was mapping, once mapped: the
    worker's teardown aborts it (the context went away), or its cut failed (answered as a
    failed checkpoint; the context lives on, and the next checkpoint is taken)."""
    from phos.snapshot import engine
    from phos.schema.cuda_types import CudaError, CUresult
    monkeypatch.setattr(engine, "DEVICE_COPY", True)
    w, s, ptr = worker_holding(filler(4 << 20))
    snap = s.backend.snap
    held = mapping_held(snap)
    store = tmp_path / "images"
    ask_checkpoint(w, 1, store, "a")
    assert s.checkpoint.before_cut and snap.mapped_ahead == 1
    if end == "context gone":
        handing = threading.Timer(0.2, hand_over, [held])    # still mapping as the context goes
        handing.start()
        s.checkpoint.abort("the context went away during the checkpoint")     # as worker.main's teardown
        handing.join()
        assert held[0][0].done() and snap.mapped_ahead == 0
        assert not DirStore(store).list_images()
        return

    def describe(*_):
        raise CudaError(CUresult.CUDA_ERROR_UNKNOWN, "no description")
    described = engine.describe
    monkeypatch.setattr(engine, "describe", describe)
    hand_over(held)
    w.tick()
    assert s.checkpoint is None and not s.snapshotting and snap.mapped_ahead == 0
    assert answers(w)[-1] == (1, "failed", (CUresult.CUDA_ERROR_UNKNOWN, "checkpoint: no description"))
    monkeypatch.setattr(engine, "describe", described)
    ask_checkpoint(w, 2, store, "b")
    hand_over(held)
    while s.checkpoint is not None:
        w.tick()
    assert answers(w)[-1][1] == "checkpointed" and snap.copies_ahead == 1 and snap.mapped_ahead == 0


def test_a_checkpoint_whose_device_copy_could_not_be_mapped_saves_by_copy_on_write(tmp_path, monkeypatch):
    """Where the device had no room for the copy mapped ahead (or mapping it failed), the cut
    makes no device copy, as it would find itself: calls save what they write first."""
    from concurrent.futures import Future
    from phos.snapshot import engine
    from phos.snapshot.engine import Checkpoint
    monkeypatch.setattr(engine, "DEVICE_COPY", True)
    w, s, ptr = worker_holding(filler(8 << 20))
    none = Future()
    none.set_result(None)
    monkeypatch.setattr(s.backend.snap, "map_ahead", lambda nbytes: none)
    saved = []
    real_save = Checkpoint.save
    monkeypatch.setattr(Checkpoint, "save", lambda self, idx, urgent=False: (saved.append(urgent), real_save(self, idx, urgent))[1])
    at_cut = filler(8 << 20)
    ask_checkpoint(w, 1, tmp_path, "a")
    assert s.checkpoint.running                  # cut at once: nothing to wait for
    s.touch(ptr, 8 << 20)
    s.backend.htod(ptr, filler(8 << 20, seed=5).tobytes(), None)
    while s.checkpoint is not None:
        w.tick()
    assert answers(w)[-1][1] == "checkpointed" and True in saved, "no copy-on-write without a device copy"
    assert not read_image(DirStore(tmp_path), "a").metadata["device_copy"]
    assert region(DirStore(tmp_path), "a", ptr).tobytes() == at_cut.tobytes()


def test_a_checkpoint_asked_for_while_a_recovery_image_maps_ahead_waits_for_it(tmp_path, monkeypatch):
    """A recovery image whose cut waits for its memory is the running checkpoint: a checkpoint
    asked for meanwhile is queued behind it, as behind one that copies, and taken once it ends."""
    from phos.gpu_server.worker import control as worker
    from phos.snapshot import engine
    monkeypatch.setattr(engine, "DEVICE_COPY", True)
    monkeypatch.setattr(worker, "RECOVERY_PAUSED_BYTES", 0)        # concurrent, as a big context's
    w, s, ptr = worker_holding(filler(4 << 20))
    snap = s.backend.snap
    held = mapping_held(snap)
    w.recovery_options = (str(tmp_path / "recovery"), 600.0, 0)
    w.start_recovery()
    try:
        w.take_recovery_image()
        assert s.checkpoint.before_cut and w.recovering
        ask_checkpoint(w, 1, tmp_path / "images", "a")
        assert w.queued_checkpoint is not None and not answers(w) and len(held) == 1
        w.loop.ack = 3                          # the recovery image's cut
        hand_over(held)
        assert wait_until(lambda: w.tick() or s.checkpoint is None or len(held) == 2, 30, 0)
        assert len(held) == 2 and s.recovery.latest is not None and s.recovery.durable == 3, \
            "the recovery image was not committed first"
        hand_over(held)
        while s.checkpoint is not None:
            w.tick()
        assert [(seq, kind) for seq, kind, _ in answers(w)] == [(1, "checkpointed")]
        assert snap.copies_ahead == 2 and snap.mapped_ahead == 0
    finally:
        s.recovery.prune_done()


def test_a_servers_concurrent_checkpoint_maps_its_device_copy_before_the_cut(servers, client, tmp_path):
    """Through a server: the memory for the cut's device copy is mapped before the cut (its
    trace shows that step ahead of it), so the cut itself maps nothing; the image holds the
    program's memory, and the program goes on."""
    one = servers("one")
    app = App(client(one))
    n = 1 << 18
    before = np.arange(n, dtype=np.float32)
    x = app.put(before)
    app.put(filler(8 * MiB))
    app.sync()
    store = tmp_path / "images"
    done = checkpoint(one, app.id, store)
    assert done["mode"] == "concurrent" and not done["paused"]
    assert read_image(open_store(store), done["name"]).metadata["device_copy"]
    ahead = [step for step in done["trace_ms"] if step[1] == "freeze_map_ahead"]
    assert len(ahead) == 1 and ahead[0][0] <= 0 and "freeze_map_ahead" in done["phase_ms"], done["trace_ms"]
    assert "cut_freeze_alloc" not in done["phase_ms"], "the cut mapped its copy's memory itself"
    assert region(open_store(store), done["name"], int(x)).tobytes() == before.tobytes()
    assert app.get(x, n).tobytes() == before.tobytes()
