"""The handoff's algorithm (gpu_server/control/handoff.py) driven without gRPC, processes or a device:
a fake front end whose checkpoints copy given byte counts, and a fake target."""
import asyncio
import time
import types

import pytest

from phos.gpu_server.control import handoff
from phos.schema import admin_pb2 as pb
from phos.schema.cuda_types import CudaError, CUresult

MiB = 1 << 20


class Source:
    """The front end holding the context: checkpoints copy `sizes` bytes, one a round."""
    host_store = None

    def __init__(self, sizes, commit_fails=False, cannot_tell=False):
        self.sizes, self.commit_fails, self.cannot_tell = list(sizes), commit_fails, cannot_tell
        self.moved, self.counts, self.calls = {}, {"handoffs": 0}, []

    async def checkpoint(self, worker, request, on_progress=None, on_delta=None):
        args = {f.name: getattr(request, f.name) for f in request.DESCRIPTOR.fields}
        self.calls.append(("checkpoint", args))
        if args["early"]:
            on_delta(b"packed delta of " + args["name"].encode())
        if args["freeze"] and self.commit_fails:
            raise CudaError(CUresult.CUDA_ERROR_UNKNOWN, "checkpoint: the store is full")
        return pb.CheckpointResult(copied_bytes=self.sizes.pop(0), phase_ms={"copy": 1.0}, seconds=0.002)

    async def thaw(self, worker):
        self.calls.append(("thaw",))

    async def pace(self, worker, hold):
        self.calls.append(("pace", round(hold, 3)))

    async def retire(self, worker, endpoint, standby, server_key=""):
        self.calls.append(("retire", endpoint, standby))

    async def moving_to(self, worker, endpoint, standby, server_key=""):
        self.calls.append(("moving_to", endpoint, standby))
        if self.cannot_tell:
            raise CudaError(CUresult.CUDA_ERROR_UNKNOWN, "movingTo: the worker is busy")

    def worker_alive(self, worker):
        return True

    async def ctx_stats(self, worker):
        return pb.CtxStats(bytes=self.context_bytes)

    context_bytes = 64 * MiB


class Target:
    same_server = False
    remote = False

    def __init__(self, recovery_dir="", refuse=(), host_store=""):
        self.recovery_dir, self.refuse, self.host_store = recovery_dir, refuse, host_store
        self.restores, self.sent, self.dropped, self.waited = [], [], False, False

    async def stats(self):
        return types.SimpleNamespace(recovery_dir=self.recovery_dir, host_store=self.host_store, standby="ipc:///standby")

    async def send(self, store, name, delta=b""):
        self.sent.append(name)

    async def restore(self, store, name, **how):
        self.restores.append((name, how))
        if ("delta" if how.get("delta") else "final" if not how.get("warm") else "warm") in self.refuse:
            raise CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE, "handoff of context 1 failed, it stays live here: no")
        return types.SimpleNamespace(endpoint="ipc:///target.ctx1", phase_ms={"load": 2.0})

    async def drop_warm(self):
        self.dropped = True

    async def wait_loaded(self, timeout):
        self.waited = True


class Store:
    made = []

    def __init__(self, ctx, recovery_dir, host_store):
        self.path, self.recovery, self.rounds, self.removed = "/rounds", bool(recovery_dir), [], []
        self.host_store = host_store
        Store.made.append(self)

    def round_name(self, i):
        self.rounds.append(f"round{i}")
        return self.rounds[-1]

    def remove(self, keep=None):
        self.removed.append(keep)

    def drop_rounds_before(self, name):
        Store.drops.append(name)

    drops = []


def run(source, target, make_store=Store, **kw):
    async def go():
        h = handoff.Handoff(source, "worker", target, 1, "ipc:///two", make_store=make_store, **kw)
        result = await h.run()
        await result.cleanup
        return result
    return asyncio.run(go())


def test_rounds_shrink_then_the_target_adopts_the_delta():
    source, target = Source([100 * MiB, 40 * MiB, 3 * MiB, 1 * MiB]), Target()
    r = run(source, target)
    assert r.round_bytes == [100 * MiB, 40 * MiB, 3 * MiB, 1 * MiB]     # a round of <= 4 MiB ends the pre-copy
    rounds = [args for what, *args in source.calls if what == "checkpoint"]
    assert [a[0]["name"] for a in rounds] == ["round0", "round1", "round2", "round3"]
    assert [a[0]["parent"] for a in rounds] == ["", "round0", "round1", "round2"]
    assert [(a[0]["freeze"], a[0]["paused"], a[0]["precopy"], a[0]["early"]) for a in rounds] == \
        [(False, False, True, False)] * 3 + [(True, True, False, True)]
    # the warm copy restores round 0, advances with each round, then adopts the last one's delta
    assert target.restores == [("round0", {"warm": True, "full": True, "advance": False}),
                               ("round1", {"warm": True, "full": True, "advance": True}),
                               ("round2", {"warm": True, "full": True, "advance": True}),
                               ("round3", {"advance": True, "full": True, "delta": b"packed delta of round3"})]
    assert source.calls[-1] == ("retire", "ipc:///target.ctx1", "ipc:///standby")
    # the client connects ahead to the warm copy's worker just before the freeze
    frozen = next(i for i, (what, *args) in enumerate(source.calls) if what == "checkpoint" and args[0]["freeze"])
    assert source.calls[frozen - 1] == ("moving_to", "ipc:///target.ctx1", "ipc:///standby")
    # where it went, whom to ask if that dies, and the key of its server (this target has none)
    assert source.moved == {1: ("ipc:///target.ctx1", "ipc:///standby", "")} and source.counts["handoffs"] == 1
    assert {"pre_copy", "last_round_delta", "last_round_copy", "last_round", "target_adopt", "target_load",
            "retire"} <= set(r.phase_ms)
    assert r.chunk_size == handoff.DEFAULT_CHUNK_SIZE and len(r.round_ms) == 4 and r.recovery_image == ""
    assert target.sent == ["round0", "round1", "round2", "round3"]       # each before its restore
    assert target.waited and Store.made[-1].removed == [None] and not target.dropped


def test_rounds_that_grow_twice_end_the_pre_copy():
    source = Source([100 * MiB, 50 * MiB, 60 * MiB, 70 * MiB, 80 * MiB, 2 * MiB])
    r = run(source, Target(), max_rounds=12)
    assert r.round_bytes == [100 * MiB, 50 * MiB, 60 * MiB, 70 * MiB, 80 * MiB]


def paces(source):
    return [c[1] for c in source.calls if c[0] == "pace"]


def test_rounds_that_do_not_halve_hold_the_application_more_each_time(monkeypatch):
    """An application writing about as fast as the rounds travel: each round that is more than
    half the one before raises the share of the time its calls are held, so that the next
    round would be a quarter of it (THROTTLE_AIM), up to PHOS_HANDOFF_THROTTLE; rounds that
    halve leave it as it is."""
    monkeypatch.setenv("PHOS_HANDOFF_THROTTLE", "0.9")
    source = Source([800 * MiB, 500 * MiB, 400 * MiB, 100 * MiB, 40 * MiB, 30 * MiB, 28 * MiB, 3 * MiB, 1 * MiB])
    r = run(source, Target())
    # 500 after 800 (0.625): 1 - 0.25/0.625; 400 after 500 (0.8 held 0.6, 2 unheld): 1 - 0.25/2;
    # 100 after 400 halved, 40 after 100 too; 30 after 40 (0.75 held 0.875): past 0.9, so 0.9; then
    # 28 after 30 changes nothing
    assert paces(source) == [0.6, 0.875, 0.9, 0.0]
    # let go of before the freeze: the calls held then would wait out their hold on top of it
    let_go = source.calls.index(("pace", 0.0))
    assert [c[1]["freeze"] for c in source.calls[let_go + 1:] if c[0] == "checkpoint"] == [True]
    assert r.round_bytes[-1] == 1 * MiB and source.calls[-1][0] == "retire"
    assert r.phase_ms["throttled_hold_pct"] == pytest.approx(90) and r.phase_ms["throttled"] > 0


def test_a_failed_handoff_lets_the_held_application_run_at_full_speed(monkeypatch):
    monkeypatch.setenv("PHOS_HANDOFF_THROTTLE", "0.5")
    source = Source([100 * MiB, 80 * MiB, 70 * MiB, 60 * MiB, 2 * MiB, 1 * MiB])
    with pytest.raises(CudaError, match="stays live here"):
        run(source, Target(refuse=("delta", "final")))
    assert paces(source) == [0.5, 0.0] and ("thaw",) in source.calls


def test_a_worker_that_cannot_be_paced_is_handed_off_unthrottled(monkeypatch):
    class Unpaced(Source):
        async def pace(self, worker, hold):
            self.calls.append(("pace", round(hold, 3)))
            raise CudaError(CUresult.CUDA_ERROR_NOT_SUPPORTED, "request 'pace' is not served on the control socket")
    monkeypatch.setenv("PHOS_HANDOFF_THROTTLE", "0.9")
    source = Unpaced([100 * MiB, 80 * MiB, 70 * MiB, 60 * MiB, 2 * MiB, 1 * MiB])
    r = run(source, Target())
    assert paces(source) == [0.688] and source.calls[-1][0] == "retire" and "throttled" not in r.phase_ms


def test_no_throttle_when_it_is_off(monkeypatch):
    monkeypatch.setenv("PHOS_HANDOFF_THROTTLE", "0")
    source = Source([100 * MiB, 80 * MiB, 70 * MiB, 60 * MiB, 2 * MiB, 1 * MiB])
    r = run(source, Target())
    assert paces(source) == [] and "throttled" not in r.phase_ms


def test_into_the_targets_recovery_store_the_last_round_is_committed_first():
    source, target = Source([10 * MiB, 1 * MiB, 1 * MiB]), Target(recovery_dir="/recovery")
    r = run(source, target, max_rounds=2)
    assert not [a for what, *a in source.calls if what == "checkpoint" and a[0]["early"]]
    assert target.restores[-1] == ("round2", {"advance": True, "full": True})
    assert (r.recovery_store, r.recovery_image) == ("/rounds", "round2")
    assert Store.made[-1].removed == ["round2"]          # the rounds go, the recovery image stays


def test_a_target_that_cannot_adopt_leaves_the_context_here():
    source, target = Source([10 * MiB, 1 * MiB, 1 * MiB]), Target(refuse=("delta", "final"))
    with pytest.raises(CudaError, match="stays live here"):
        run(source, target)
    assert ("thaw",) in source.calls and not [c for c in source.calls if c[0] == "retire"]
    assert source.moved == {} and source.counts["handoffs"] == 0
    assert target.dropped and Store.made[-1].removed == [None]


def test_a_delta_the_target_took_stands_though_the_commit_failed():
    source, target = Source([10 * MiB, 1 * MiB], commit_fails=True), Target()
    r = run(source, target)
    assert r.round_bytes == [10 * MiB, 1 * MiB, 0] and source.calls[-1][0] == "retire"


def test_a_failed_commit_without_the_delta_thaws_the_context():
    source, target = Source([10 * MiB, 1 * MiB], commit_fails=True), Target(refuse=("delta",))
    with pytest.raises(CudaError, match="store is full"):
        run(source, target)
    assert ("thaw",) in source.calls and target.dropped and source.moved == {}


def test_a_dropped_inbox_is_refused_at_once_and_its_files_go_after():
    """A handoff's answer does not wait for its inbox's files to go (gigabytes of /dev/shm take
    ~0.25 s a GiB to free); the path is refused from the drop on, and the files do go."""
    import os
    import time

    from phos.gpu_server.control.handoff_net import Inboxes
    inboxes = Inboxes()
    try:
        path = inboxes.open(7)
        with open(os.path.join(path, "chunk"), "wb") as f:
            f.write(b"x" * MiB)
        inboxes.drop_path(path)
        assert not inboxes.is_inbox(path)
        with pytest.raises(CudaError, match="not a handoff inbox"):
            inboxes.store(path)
        deadline = time.monotonic() + 10
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not os.path.exists(path)
        kept = inboxes.open(8)
    finally:
        inboxes.close()          # waits for the removal: nothing is left behind
    assert not os.path.exists(kept)


@pytest.mark.parametrize("target, context_mib, rounds_in_our_host_store", [
    ("on another host", 8, True),
    ("on another host", 64, False),        # 2 x 32 chunks of 2 MiB: more than its 16 free slots
    ("on this host", 8, False),            # it reads the rounds where we put them: files in /dev/shm
    ("sharing our host store", 64, True),  # it pins it too, whatever the room
])
def test_the_rounds_go_to_the_sources_host_store_where_the_target_cannot_read_ours(tmp_path, target, context_mib,
                                                                                   rounds_in_our_host_store):
    """A target on another host reads the rounds only as we send them: with room in our host
    store for the context twice over, the device copies them straight into its slots."""
    from phos.snapshot import HostStore
    ours = HostStore.create(tmp_path / "host", 16 * (4096 + 2 * MiB), capacity=2 * MiB)
    source = Source([100 * MiB, 1 * MiB, 1 * MiB])
    source.host_store, source.context_bytes = ours.path, context_mib * MiB
    t = Target(host_store=ours.path if target == "sharing our host store" else "")
    t.remote = target == "on another host"
    run(source, t)
    assert Store.made[-1].host_store == (ours.path if rounds_in_our_host_store else "")


class SlowTarget(Target):
    """A target whose loads take `load_s`, its rounds arriving at once; records what happened in
    order. fail_load: a round whose load fails."""

    def __init__(self, source, remote, load_s=0.05, fail_load=""):
        super().__init__()
        self.source, self.remote, self.load_s, self.log, self.fail_load = source, remote, load_s, source.calls, fail_load

    async def send(self, store, name, delta=b""):
        self.log.append(("sent", name))

    async def restore(self, store, name, **how):
        self.log.append(("load", name))
        await asyncio.sleep(self.load_s)
        if name == self.fail_load:
            raise CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE, "handoff of context 1 failed, it stays live here: no")
        self.log.append(("loaded", name))
        return await super().restore(store, name, **how)


def events(calls):
    """The source's and the target's calls in order: ("copy", round), ("sent", round), ("load", round), ..."""
    return [("copy", c[1]["name"]) if c[0] == "checkpoint" else c for c in calls]


@pytest.mark.parametrize("remote", [False, True])
def test_a_remote_targets_loads_do_not_pace_the_rounds_but_go_in_order(remote):
    """The frozen round carries what the application wrote since the round before it: a target
    on another host loads each round while the next one travels, so the freeze waits for the
    link, not for its load; a target on this host reads the rounds where they lie, and its
    loads pace them. The remote target's small round 2 does not end the rounds: the load of
    round 1 (40 MiB) is still pending, and the freeze would wait for it."""
    sizes = [100 * MiB, 40 * MiB, 3 * MiB, 1 * MiB] + ([1 * MiB] if remote else [])
    source = Source(sizes)
    target = SlowTarget(source, remote)
    r = run(source, target)
    assert r.round_bytes == sizes
    seen = events(source.calls)
    at = {e: i for i, e in enumerate(seen)}
    last = len(sizes) - 2                 # the last pre-copy round
    frozen = at[("copy", f"round{last + 1}")]
    # the loads go one after another, each after its round was sent, the delta's last
    loads = [e for e in seen if e[0] in ("load", "loaded")]
    assert loads == [(k, f"round{i}") for i in range(len(sizes)) for k in ("load", "loaded")]
    assert all(at[("sent", f"round{i}")] < at[("load", f"round{i}")] for i in range(len(sizes)))
    if remote:      # the freeze came while the target still loaded the last pre-copy round,
        assert at[("sent", f"round{last}")] < frozen < at[("loaded", f"round{last}")]
        assert at[("loaded", f"round{last - 1}")] < frozen        # but none before it
        # each round travelled while the target still loaded the one before, and was taken
        # once the target had loaded the one before that
        assert all(at[("sent", f"round{i}")] < at[("loaded", f"round{i - 1}")] for i in range(1, last + 1))
        assert all(at[("loaded", f"round{i - 2}")] < at[("copy", f"round{i}")] for i in range(2, last + 1))
    else:           # it waited for that load
        assert at[("loaded", f"round{last}")] < frozen
    assert ("retire", "ipc:///target.ctx1", "ipc:///standby") == source.calls[-1]


def test_a_remote_targets_failed_load_after_the_freeze_thaws_the_context():
    """The last pre-copy round's load may fail after the freeze (a remote target loads it
    meanwhile): the delta cannot follow it, and the context thaws here."""
    source = Source([100 * MiB, 40 * MiB, 3 * MiB, 1 * MiB, 1 * MiB])
    target = SlowTarget(source, remote=True, fail_load="round3")
    with pytest.raises(CudaError, match="stays live here"):
        run(source, target)
    assert ("thaw",) in source.calls and not [c for c in source.calls if c[0] == "retire"]
    assert target.dropped and source.moved == {}


class FakeLink:
    """A connection chunks travel on (NetAdminConnection.calls): records each batch's chunks."""

    def __init__(self):
        self.batches, self.window = [], None

    def calls(self, method, bodies, timeout, window, stop):
        self.window = window
        for i, frames in enumerate(bodies):
            self.batches.append(frames[1:])
            yield i, b""


class FakeStore:
    def get_chunk(self, key):
        return key.encode() * 1000


@pytest.mark.parametrize("chunks, most_per_batch, window", [(12, 2, 2), (5, 1, 2), (3, 1, 1), (600, 100, 2)])
def test_a_rounds_chunks_are_shared_out_among_the_links(monkeypatch, chunks, most_per_batch, window):
    """A round smaller than a batch a link (the frozen one's delta, often) goes on every link,
    not on the first alone, which would carry it at a third of the rate of three: a batch holds
    the round's share of a link (WINDOW batches in flight on each), or BATCH_BYTES at most. A
    round of no more chunks than links has one in flight on each: a link that took two at once
    would encrypt the second after the first, while another link stood idle."""
    import concurrent.futures

    from phos.gpu_server.control import handoff_net
    monkeypatch.setattr(handoff_net, "BATCH_BYTES", 100 * 4000)      # 100 of FakeStore's chunks
    target = handoff_net.RemoteTarget("tcp://127.0.0.1:1", 1, (b"k", b"k", b"k"))
    target.inbox = "/inbox"
    target.links = [FakeLink() for _ in range(3)]
    target.senders = concurrent.futures.ThreadPoolExecutor(3)
    keys = [f"{i:04d}" for i in range(chunks)]
    try:
        asyncio.run(target.send_on_links((FakeStore(), keys), 10))
    finally:
        target.senders.shutdown()
    batches = [b for link in target.links for b in link.batches]
    assert sorted(bytes(c[:4]).decode() for b in batches for c in b) == keys      # each chunk once
    assert max(len(b) for b in batches) == most_per_batch
    assert target.sent == set(keys)
    assert {link.window for link in target.links} == {window}


@pytest.mark.parametrize("remote", [False, True])
def test_rounds_the_target_holds_are_dropped_as_the_handoff_goes(remote):
    """A store of fixed size (the source's HostStore) must keep room for the rounds to come:
    the rounds before the last one the target was sent and loaded go while the handoff runs,
    in the background, and before the freeze (their collection holds the store)."""
    sizes = [100 * MiB, 40 * MiB, 20 * MiB, 10 * MiB] + [1 * MiB] * 8
    source = Source(sizes)
    target = SlowTarget(source, remote, load_s=0.02)

    class LoggedStore(Store):
        def drop_rounds_before(self, name):
            source.calls.append(("drop before", name))
            time.sleep(0.1)         # longer than a round takes here
            source.calls.append(("dropped", name))
    run(source, target, make_store=LoggedStore)
    seen = events(source.calls)
    at = {e: i for i, e in enumerate(seen)}
    drops = [e[1] for e in seen if e[0] == "drop before"]
    assert drops, seen
    frozen = next(i for i, c in enumerate(source.calls) if c[0] == "checkpoint" and c[1]["freeze"])
    for name in drops:
        k = int(name.removeprefix("round"))
        # what goes is rounds 0..k-1: the target holds them, and has loaded them all
        assert at[("sent", f"round{k}")] < at[("drop before", name)] < frozen
        assert at[("loaded", f"round{k - 1}")] < at[("drop before", name)]
        # and it ends before the next round starts: that round's store session would wait for
        # its collection, and the application's calls with it
        assert at[("dropped", name)] < min(i for i, e in enumerate(seen) if e[0] == "copy" and i > at[("drop before", name)])


def test_a_client_that_cannot_connect_ahead_is_handed_off_all_the_same():
    """The worker fails to tell its client where to connect ahead: the handoff goes on, and the
    client re-attaches as it would without."""
    source, target = Source([100 * MiB, 3 * MiB, 1 * MiB], cannot_tell=True), Target()
    r = run(source, target)
    assert ("moving_to", "ipc:///target.ctx1", "ipc:///standby") in source.calls
    assert source.calls[-1] == ("retire", "ipc:///target.ctx1", "ipc:///standby") and r.round_bytes[-1] == 1 * MiB
