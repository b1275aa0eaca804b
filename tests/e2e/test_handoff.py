"""Live handoff of a context between two server processes (gpu_server/control/handoff.py).

The application is a Python client program; it keeps its PHOS_SERVER pointing at the first
server, whose front end redirects its re-attach to the context's new worker.
"""
import glob
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from conftest import wait_until
from phos.admin_cli import stub
from phos.schema import admin_pb2 as pb
from phos.schema.image_messages import ImageDelta
from phos.snapshot import DirStore, HostStore, latest_image, read_image
from phos.snapshot.image import encode_delta, read_delta
from test_snapshot_engine import App, checkpoint, region

pytestmark = pytest.mark.gpu     # perf/device/run.sh runs this file with --backend cuda

N, TOTAL = 1 << 15, 300


def reference(cu, rhs):
    app = App(cu)
    x, y, r = app.put(np.zeros(N, np.float32)), app.put(np.zeros(N, np.float32)), app.put(rhs)
    out = app.get(app.jacobi(x, y, r, N, TOTAL), N)
    cu.cuCtxDestroy(app.ctx)
    return out


def start(servers, client, rhs, args=()):
    """Two servers, the reference result, and the program's context on the first server."""
    one, two = servers("one", args=args), servers("two", args=args)
    return (one, two, *program(client(one), rhs))


def program(cu, rhs):
    """The reference result, then the program's context and its vectors: (app, (x, y, r), expected)."""
    expected = reference(cu, rhs)
    app = App(cu)
    x, y, r = app.put(np.zeros(N, np.float32)), app.put(np.zeros(N, np.float32)), app.put(rhs)
    return app, (x, y, r), expected


def handoff_then_kill_the_target(cu, one, two, reattached=True, before_the_kill=lambda app: None):
    """The program, handed off from `one` to `two` at step 100 and `two` SIGKILLed (its front
    end; its workers die with it) right after, finishes with the reference's result."""
    app, (x, y, r), expected = program(cu, np.sin(np.arange(N, dtype=np.float32)))
    for i in range(TOTAL):
        if i == 100:
            app.sync()
            stub(one.address).Handoff(pb.HandoffRequest(ctx=app.id, to=two.address))
            if reattached:
                app.sync()                              # re-attached at two
            before_the_kill(app)
            os.kill(two.proc.pid, signal.SIGKILL)
            two.proc.wait()
        app.jacobi(x, y, r, N, 1)
        x, y = y, x
    assert app.get(x, N).tobytes() == expected.tobytes()


def compute_while(app, x, y, r, mover, steps=TOTAL, wait=120):
    """The program's run of `steps` Jacobi steps, syncing every 5, with `mover` (a thread: a
    handoff, say) started at step 10 and paced so that a fast GPU is still mid-run when it ends.
    Returns (the result's buffer, the step at which the mover was seen done, or None)."""
    moved_at = None
    for i in range(steps):
        if i == 10:
            mover.start()
        if i > 10 and mover.is_alive():
            time.sleep(0.005)
        if i == steps - 20:
            mover.join(wait)                    # a slow handoff: the program waits for it here
        app.jacobi(x, y, r, N, 1)               # reads x, writes y
        x, y = y, x
        if i % 5 == 4:
            app.sync()
            if i > 10 and moved_at is None and not mover.is_alive():
                moved_at = i
    mover.join()
    return x, moved_at


def contexts(server):
    return {c.id: c.state for c in stub(server.address).ListContexts(pb.ListContextsRequest()).contexts}


@pytest.mark.parametrize("spin, via", [("0", "shm"), ("1000", "shm"), ("0", "host store")])
def test_handoff_while_the_program_runs_is_bit_exact(servers, client, monkeypatch, tmp_path, caplog, spin, via):
    """spin: the workers' PHOS_SPIN_US. Spinning (the default on machines with more than four
    cores) serves calls and control messages by another path than sleeping in poll.
    via: where the rounds go; a HostStore both servers share takes them without files.
    The retiring worker tells the client where the context went (Reply.moved)."""
    monkeypatch.setenv("PHOS_SPIN_US", spin)
    caplog.set_level(logging.INFO, logger="phos.client")
    host = HostStore.create(tmp_path / "host", 64 << 20) if via == "host store" else None
    args = ("--host-store", host.path) if host else ()
    one, two, app, (x, y, r), expected = start(servers, client, np.sin(np.arange(N, dtype=np.float32)), args)
    done = {}
    mover = threading.Thread(target=lambda: done.update(
        reply=stub(one.address).Handoff(pb.HandoffRequest(ctx=app.id, to=two.address))))
    x, moved_at = compute_while(app, x, y, r, mover)
    assert moved_at is not None and moved_at < TOTAL - 5, "the handoff should end mid-run"
    assert app.get(x, N).tobytes() == expected.tobytes()
    reply = done["reply"]
    assert reply.ctx == app.id and len(reply.round_bytes) >= 3 and reply.downtime_ms > 0
    assert len(reply.round_ms) == len(reply.round_bytes)             # where the time went, per round
    assert {"pre_copy", "last_round", "target_adopt", "retire"} <= set(reply.phase_ms)
    assert "last_round_delta" in reply.phase_ms, "the target should adopt the last round's delta, sent before the commit"
    assert "could not take the last round's delta" not in one.output()
    assert reply.chunk_size == 2 << 20                   # the default
    assert app.id in contexts(two) and app.id not in contexts(one)
    assert "restoring it afresh" not in two.output()     # the warm copy followed the rounds
    assert "re-attached" in caplog.text and "told by its old worker" in caplog.text     # no front end asked
    if host:       # the rounds went through it, and are gone once the target loaded them
        assert wait_until(lambda: not host.list_images() and not host.stats()["chunks"], 30)
        assert host._seq() >= 2 * len(reply.round_bytes), "the rounds' chunks did not pass through its slots"


def test_objects_made_during_the_handoff_fall_back_on_the_committed_image(servers, client):
    """The program allocates and fills a buffer every iteration while the context moves: each
    round holds other objects than the last, so the target's warm copy cannot take the last
    round's delta and adopts the committed image afresh. Every buffer and the result survive."""
    one, two, app, (x, y, r), expected = start(servers, client, np.sin(np.arange(N, dtype=np.float32)) + 2)
    done, made = {}, []
    mover = threading.Thread(target=lambda: done.update(
        reply=stub(one.address).Handoff(pb.HandoffRequest(ctx=app.id, to=two.address))))
    for i in range(TOTAL):
        if i == 10:
            mover.start()
        if 10 <= i and (mover.is_alive() or not made):
            made.append((app.put(np.full(1024, i, np.float32)), i))    # a new object each iteration
            time.sleep(0.002)
        app.jacobi(x, y, r, N, 1)
        x, y = y, x
    mover.join()
    assert app.get(x, N).tobytes() == expected.tobytes()
    assert all((app.get(p, 1024) == i).all() for p, i in made)
    assert app.id in contexts(two) and app.id not in contexts(one)
    assert "could not take the last round's delta" in one.output() and "restoring it afresh" in two.output()


def test_a_dead_target_leaves_the_context_running_here(servers, client):
    one, two, app, (x, y, r), expected = start(servers, client, np.cos(np.arange(N, dtype=np.float32)))
    x, y = (x, y) if app.jacobi(x, y, r, N, 20) == x else (y, x)
    app.sync()
    two.stop()                                  # the target dies before the context reaches it
    with pytest.raises(grpc.RpcError) as e:
        stub(one.address).Handoff(pb.HandoffRequest(ctx=app.id, to=two.address))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "stays live here" in e.value.details()
    assert contexts(one).get(app.id) == "running"
    assert app.get(app.jacobi(x, y, r, N, TOTAL - 20), N).tobytes() == expected.tobytes()


def test_a_bad_chunk_size_is_refused_and_the_context_stays_here(servers, client):
    one, two, app, (x, y, r), expected = start(servers, client, np.cos(np.arange(N, dtype=np.float32)))
    x, y = (x, y) if app.jacobi(x, y, r, N, 20) == x else (y, x)
    with pytest.raises(grpc.RpcError) as e:
        stub(one.address).Handoff(pb.HandoffRequest(ctx=app.id, to=two.address, chunk_size=12345))
    assert "chunk size 12345 must be a multiple of 8" in e.value.details()
    assert contexts(one).get(app.id) == "running" and app.id not in contexts(two)
    assert app.get(app.jacobi(x, y, r, N, TOTAL - 20), N).tobytes() == expected.tobytes()


def test_target_killed_mid_handoff_leaves_the_program_running_here(servers, client):
    """The target hangs in its restore, with the context frozen on the source, and is then
    SIGKILLed: the source thaws the context, and the program, which kept calling, finishes."""
    one, two, app, (x, y, r), expected = start(servers, client, np.cos(np.arange(N, dtype=np.float32)) + 1)
    os.kill(two.proc.pid, signal.SIGSTOP)      # it accepts the Restore, and never answers

    def handoff():
        try:
            stub(one.address).Handoff(pb.HandoffRequest(ctx=app.id, to=two.address))
        except grpc.RpcError as e:
            done["error"] = e

    def killer():
        time.sleep(1.5)                         # the rounds are done: the source waits on the target
        os.kill(two.proc.pid, signal.SIGKILL)
    done = {}
    threads = [threading.Thread(target=handoff), threading.Thread(target=killer)]
    for i in range(TOTAL):
        if i == 10:
            for t in threads:
                t.start()
        app.jacobi(x, y, r, N, 1)
        x, y = y, x
        if i % 5 == 4:
            app.sync()
    for t in threads:
        t.join()
    e = done["error"]
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "stays live here" in e.details(), e.details()
    assert app.get(x, N).tobytes() == expected.tobytes()
    assert contexts(one).get(app.id) == "running"


@pytest.mark.parametrize("into, words", [("shm", 64 << 20), ("recovery store", 64 << 20), ("shm", 1 << 16),
                                         ("host store", 64 << 20)],
                         ids=["shm", "recovery store", "shm, between rounds", "host store"])
def test_a_failed_handoff_frees_the_targets_warm_copy_at_once(servers, client, tmp_path, into, words):
    """The source's worker dies after the first pre-copy rounds, while the target keeps a warm
    copy: the handoff fails, and the target drops that copy at once instead of holding its
    memory until its attach timeout runs out. The rounds are removed: a directory of their own
    in /dev/shm, or, for a target taking recovery images, its store of the context, or from
    a host store both servers share, every slot (the dead worker's reservations too).
    256 MiB: on emu the worker dies in the middle of a round. 256 KiB (and on cuda, where
    rounds are quick): between two, and the next round's call must not wait for it forever."""
    from test_recovery import recovering
    host = HostStore.create(tmp_path / "host", 2 * 4 * words + (64 << 20)) if into == "host store" else None
    args = ("--host-store", host.path) if host else ()
    one = servers("one", args=args)
    two = recovering(servers, "two", every="600", directory=tmp_path / "rec") if into == "recovery store" else servers("two", args=args)
    app = App(client(one))
    app.put(np.ones(words, np.float32))
    app.sync()
    pid = {c.id: c.pid for c in stub(one.address).ListContexts(pb.ListContextsRequest()).contexts}[app.id]
    before = set(glob.glob("/dev/shm/phos-handoff-*"))
    done = {}

    def handoff():
        try:
            stub(one.address).Handoff(pb.HandoffRequest(ctx=app.id, to=two.address))
        except grpc.RpcError as e:
            done["error"] = e

    def stores():
        if host:
            return [host.path]
        return [tmp_path / "rec" / f"ctx{app.id}"] if into == "recovery store" else set(glob.glob("/dev/shm/phos-handoff-*")) - before
    mover = threading.Thread(target=handoff)
    mover.start()
    # round 1 written: the target holds (or is loading) round 0; the frozen round is still to come
    assert wait_until(lambda: any(glob.glob(f"{d}/images/handoff-*-round1.json") for d in stores()), 60, step=0.005)
    os.kill(pid, signal.SIGKILL)
    mover.join(60)
    assert "error" in done and "exited" in done["error"].details(), done
    assert wait_until(lambda: app.id not in contexts(two), 5), contexts(two)
    if host:
        assert wait_until(lambda: not host.list_images() and host.stats()["free_slots"] == host.slots, 10), \
            ("the failed handoff's rounds were left behind", host.list_images(), host.stats())
    else:
        assert not any(os.path.exists(d) for d in stores()), "the failed handoff's rounds were left behind"


def test_handoff_of_an_unknown_context_is_refused(servers):
    one, two = servers("one"), servers("two")
    with pytest.raises(grpc.RpcError) as e:
        stub(one.address).Handoff(pb.HandoffRequest(ctx=424242, to=two.address))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "no context 424242" in e.value.details()


def warm_then_advance(servers, client, tmp_path, between, by_delta=False, before=None):
    """The target's warm copy: restore image A (warm), then advance it to image B, taken after
    between(app, x) ran. Returns (target, B's name, x, app); the copy is checkpointed again
    into tmp_path/after so that its contents can be compared with B's.
    by_delta: B goes to the target as a delta of A (engine.image_delta), as a handoff's
    last round does; before(admin, store, a, b, delta) runs first."""
    one, two = servers("one"), servers("two")
    app = App(client(one))
    x = app.put(np.arange(N, dtype=np.float32))
    app.sync()
    store = tmp_path / "rounds"
    a = checkpoint(one, app.id, store)["name"]
    between(app, x)
    app.sync()
    b = checkpoint(one, app.id, store, incremental=True)["name"]
    admin = stub(two.address)
    admin.Restore(pb.RestoreRequest(store=str(store), name=a, warm=True))
    warm = contexts(two)
    assert list(warm) == [app.id] and warm[app.id] in ("warming", "restoring")     # no client may attach yet
    delta = b""
    if by_delta:
        from phos.snapshot.engine import image_delta
        delta = image_delta(read_image(DirStore(store), b))
        if before:
            before(admin, str(store), a, b, delta)
    reply = admin.Restore(pb.RestoreRequest(store=str(store), name=b, advance=True, ctx=app.id, delta=delta))
    assert reply.ctx == app.id and contexts(two)[app.id] in ("running", "restoring")
    assert wait_until(lambda: contexts(two)[app.id] == "running", 20)      # loaded: a checkpoint may start
    checkpoint(two, app.id, tmp_path / "after", name="after")
    return two, DirStore(store), b, x


@pytest.mark.parametrize("by_delta", [False, True])
def test_a_warm_copy_advances_to_the_later_image(servers, client, tmp_path, by_delta):
    """Only contents changed between the images: the warm copy loads what changed and then
    holds exactly the later image; given by its manifest, or as a delta of the earlier one."""
    two, store, b, x = warm_then_advance(servers, client, tmp_path,
                                         lambda app, x: app.ok(app.cu.cuMemsetD32(x, 0x01020304, N // 2)), by_delta)
    assert region(DirStore(tmp_path / "after"), "after", int(x)).tobytes() == region(store, b, int(x)).tobytes()
    assert "restoring it afresh" not in two.output()


def test_a_bad_delta_is_refused_and_the_warm_copy_stays(servers, client, tmp_path):
    """A delta that is no ImageDelta, names another parent, a chunk or region the image does not
    have, a malformed key or other objects is refused with a reason, and no fresh restore is
    tried (its manifest may not be committed yet); the warm copy still advances by the good one.
    (A negative cut cannot be written: the schema's types rule it out.)"""
    def bad_ones(admin, store, a, b, delta):
        good = read_delta(delta, b)
        (address, j, key), rest = good.changes[0], good.changes[1:]

        def key_of(n):           # the first change's key of n bytes, as no writer of ours gives it
            with ImageDelta.from_bytes(delta) as d:
                m = d.as_builder()
            m.changes[0].key = bytes(n)
            return m.to_bytes()
        cases = {"not a delta": (b"{", "not an ImageDelta"),
                 "parent": (encode_delta(*good._replace(parent="other")), "moves on from image 'other'"),
                 "index": (encode_delta(*good._replace(changes=[(address, 1 << 40, key), *rest])),
                           "names chunk 1099511627776 of a region"),
                 "region": (encode_delta(*good._replace(changes=[(address + 8, j, key), *rest])), "is not one of its regions"),
                 "key": (key_of(15), "changes are not"),
                 "no key": (key_of(0), "changes are not"),
                 "objects": (encode_delta(*good._replace(objects="0" * 32)), "holds other objects")}
        for what, (d, says) in cases.items():
            with pytest.raises(grpc.RpcError) as e:
                admin.Restore(pb.RestoreRequest(store=store, name=b, advance=True, ctx=app_id(admin), delta=d))
            assert says in e.value.details(), (what, e.value.details())
            assert list(contexts_of(admin).values()) == ["warming"], what

    two, store, b, x = warm_then_advance(servers, client, tmp_path,
                                         lambda app, x: app.ok(app.cu.cuMemsetD32(x, 5, N)), True, bad_ones)
    assert region(DirStore(tmp_path / "after"), "after", int(x)).tobytes() == region(store, b, int(x)).tobytes()
    assert "restoring it afresh" not in two.output()


def contexts_of(admin):
    return {c.id: c.state for c in admin.ListContexts(pb.ListContextsRequest()).contexts}


def app_id(admin):
    return next(iter(contexts_of(admin)))


def test_a_warm_copy_of_other_objects_is_restored_afresh(servers, client, tmp_path):
    """An allocation was made between the images: the warm copy cannot advance, and the later
    image is restored afresh instead, holding it exactly."""
    def allocate(app, x):
        app.put(np.ones(N, np.float32))
        app.ok(app.cu.cuMemsetD32(x, 7, N))
    two, store, b, x = warm_then_advance(servers, client, tmp_path, allocate)
    assert region(DirStore(tmp_path / "after"), "after", int(x)).tobytes() == region(store, b, int(x)).tobytes()
    assert "restoring it afresh" in two.output()


def test_the_targets_recovery_images_follow_on_from_the_handoffs_last_round(servers, client, tmp_path):
    """A target taking recovery images gets the rounds in its store of the context: its first
    image of its own is incremental on the last round, and then the rounds are all gone."""
    from test_recovery import recovering
    directory = tmp_path / "rec"
    one, two = servers("one"), recovering(servers, "two", every="1", directory=directory)
    app = App(client(one))
    x = app.put(np.arange(1 << 20, dtype=np.float32))
    app.sync()
    reply = stub(one.address).Handoff(pb.HandoffRequest(ctx=app.id, to=two.address))
    assert "last_round_delta" not in reply.phase_ms, "a recovery image is committed before the target adopts it"
    store = DirStore(directory / f"ctx{app.id}")
    last = latest_image(store, app.id)
    assert (reply.recovery_store, reply.recovery_image) == (store.path, last)
    assert last.startswith("handoff-") and read_image(store, last).metadata["mode"] == "paused"
    assert app.get(x, 1 << 20).tobytes() == np.arange(1 << 20, dtype=np.float32).tobytes()    # re-attached at two
    app.put(np.ones(8, np.float32))                     # something new for its next image
    app.sync()
    assert wait_until(lambda: any(n.startswith("rec-") and n.endswith("-000001") for n in store.list_images()), 10)
    first = next(n for n in store.list_images() if n.startswith("rec-"))
    assert read_image(store, first).parent == last, "the target's first image is not incremental on the last round"
    assert wait_until(lambda: not [n for n in store.list_images() if n.startswith("handoff-")], 10), store.list_images()


def test_phos_handoff_says_where_the_recovery_image_is(servers, client, tmp_path):
    """`phos handoff` to a server taking recovery images names the image the last round left
    there; with --json too. The context goes on at the target."""
    from test_recovery import recovering
    one, two = servers("one"), recovering(servers, "two", every="600", directory=tmp_path / "rec")
    app = App(client(one))
    x = app.put(np.arange(4096, dtype=np.float32))
    app.sync()
    run = subprocess.run([sys.executable, "-m", "phos.cli", "handoff", str(app.id), "--to", two.address,
                          "--server", one.address, "--json"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    store = DirStore(tmp_path / "rec" / f"ctx{app.id}")
    assert out["recovery_store"] == store.path and out["recovery_image"] == latest_image(store, app.id)
    assert app.get(x, 4096).tobytes() == np.arange(4096, dtype=np.float32).tobytes()
    assert contexts(two).get(app.id) == "running"
    run = subprocess.run([sys.executable, "-m", "phos.cli", "handoff", str(app.id), "--to", one.address,
                          "--server", two.address], capture_output=True, text=True)
    assert run.returncode == 0 and f"moved to {one.address}" in run.stdout, run.stderr
    assert "recovery image" not in run.stdout             # `one` takes none: the rounds went through /dev/shm
    assert wait_until(lambda: not store.list_images(), 5), store.list_images()     # two let go of its image


@pytest.mark.parametrize("reattached", [True, False])
def test_target_server_dying_after_the_handoff_recovers_on_its_standby(servers, client, tmp_path, reattached):
    """The context moved from `one` to `two`, which takes recovery images (standby `three`),
    and `two` dies at once, before it took an image of its own: the handoff's last round, in
    two's recovery store, is the context's recovery image. `one` still redirects to two's dead
    worker: the client must then ask the others instead of asking `one` until it gives up;
    the standby its worker at two named, or, if it had not re-attached there yet, the one
    `one` names with its answer."""
    from test_recovery import recovering
    directory = tmp_path / "rec"
    one = servers("one")
    three = recovering(servers, "three", directory=directory)
    two = recovering(servers, "two", every="600", directory=directory, args=["--standby", three.address])

    def handoff_round_is_the_image(app):
        # the handoff's last round went to two's recovery store: it is the recovery image
        # there from the start, before two took any of its own
        assert latest_image(DirStore(directory / f"ctx{app.id}"), app.id).startswith("handoff-")
    handoff_then_kill_the_target(client(one), one, two, reattached, handoff_round_is_the_image)
    assert "restoring it from recovery image" in three.output()


def test_a_context_comes_back_to_its_source_when_its_target_died(servers, client, tmp_path):
    """`one` handed the context to `two`, and two died: asked again, `one` no longer points at
    two's dead worker (as a pool asks it, when two's node is lost), but restores the context
    from the recovery images both take into one store."""
    from test_recovery import recovering
    directory = tmp_path / "rec"
    one = recovering(servers, "one", every="600", directory=directory)
    two = recovering(servers, "two", every="600", directory=directory)
    handoff_then_kill_the_target(client(one), one, two)
    assert "is gone" in one.output() and "restoring it from recovery image" in one.output(), one.output()[-2000:]


def test_a_program_making_only_asynchronous_calls_follows_a_handoff(servers, client):
    """After a handoff the old worker reads no more: a program that only launches (no
    synchronising call to read the Reply naming the new worker) fills the socket's queue to it,
    and must then learn where its context went instead of blocking in the send for good."""
    one, two, app, (x, y, r), expected = start(servers, client, np.cos(np.arange(N, dtype=np.float32)))
    scratch = app.put(np.zeros(256, np.float32))
    reply = stub(one.address).Handoff(pb.HandoffRequest(ctx=app.id, to=two.address))
    assert reply.ctx == app.id
    conn = app.cu._contexts[app.id]
    out, sent = {}, []

    def launches():
        app.ok(app.cu.cuCtxSetCurrent(app.ctx))   # current per thread, as in CUDA
        a, b = x, y
        for _ in range(TOTAL):
            app.jacobi(a, b, r, N, 1)
            a, b = b, a
            conn.flush()                      # a message each
            sent.append(1)
        for _ in range(2000):                 # past the queue's high-water mark (1000 messages)
            app.ok(app.cu.cuMemsetD8Async(scratch, 0, 1024, 0))
            conn.flush()
            sent.append(1)
        out["x"] = a
    t = threading.Thread(target=launches, daemon=True)
    t.start()
    t.join(180)
    assert not t.is_alive(), f"the program blocked after {len(sent)} messages, sending to the retired worker"
    assert app.get(out["x"], N).tobytes() == expected.tobytes()
    assert app.id in contexts(two)


def test_a_program_rewriting_its_memory_between_rounds_is_held_until_they_converge(servers, client, monkeypatch):
    """The program rewrites all of its 24 MiB again and again (a memset a step), so no round
    halves: the handoff holds its calls for part of each few milliseconds, as much as
    PHOS_HANDOFF_THROTTLE allows at most, the program's calls go on meanwhile, and its data
    arrives intact."""
    monkeypatch.setenv("PHOS_HANDOFF_THROTTLE", "0.8")
    one, two = servers("one"), servers("two")
    cu = client(one)
    app = App(cu)
    words = 6 << 20
    buf = app.ok(cu.cuMemAlloc(4 * words))
    done = {}
    mover = threading.Thread(target=lambda: done.update(
        reply=stub(one.address).Handoff(pb.HandoffRequest(ctx=app.id, to=two.address))))
    mover.start()
    writes = 0
    while mover.is_alive():
        writes += 1
        app.ok(cu.cuMemsetD32(buf, writes, words))
        app.sync()
    mover.join()
    reply = done["reply"]
    assert len(reply.round_bytes) >= 4 and writes > len(reply.round_bytes)
    assert 50 <= reply.phase_ms["throttled_hold_pct"] <= 80 and reply.phase_ms["throttled"] > 0, dict(reply.phase_ms)
    assert "the application is held" in one.output()
    assert app.id in contexts(two)
    assert (app.get(buf, words, np.uint32) == writes).all()


def test_a_pace_outside_its_range_is_refused():
    from phos.gpu_server.backends.emu import EmuBackend
    from phos.gpu_server.worker.control import PACED, SERVING
    from phos.gpu_server.worker.loop import Worker
    from phos.gpu_server.worker.session import Session
    from phos.schema import admin_pb2 as pb
    from phos.schema.cuda_types import CudaError
    worker = Worker(Session(EmuBackend(), 7, b"t" * 16), None).control
    worker.attached()
    with pytest.raises(CudaError, match="0 to 0.95"):
        worker.pace(pb.PaceRequest(hold=0.99), (b"front end", 1))
    assert worker.pace(pb.PaceRequest(hold=0.5), (b"front end", 2)) is None       # done
    assert worker.pacing.hold == 0.5 and 0 < worker.pacing.held() <= 0.0025 and worker.state is PACED
    # past the held half of the period, a message is served; then none until the next period
    worker.pacing.since = time.perf_counter() - 0.003
    assert worker.pacing.held() == 0.0
    worker.pacing.served_in = 0
    assert 0 < worker.pacing.held() <= 0.002
    worker.pace(pb.PaceRequest(hold=0.0), (b"front end", 3))
    assert worker.pacing is None and worker.state is SERVING
