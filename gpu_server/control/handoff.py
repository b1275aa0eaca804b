"""A live handoff: move a context from this server to another, or to another of its devices
(the admin API's Handoff).

Pre-copy rounds while the application runs, then a frozen last round, then the target
adopts it and this worker retires. The target keeps a warm copy: it restores the first
round and advances with each later one, loading what changed, so that after the freeze
it loads only what the last round changed. Pre-copy rounds hold nothing up (no cut);
they go on while what they copy shrinks. Any failure before the target holds the
context leaves it running here.

Where the application writes about as fast as the rounds travel (a target on another host,
over a link not much faster than its writes), the rounds stop shrinking, and the frozen
round would carry a second or more of its writes. Then, as live migration of virtual
machines does (QEMU's auto-converge), the handoff slows the application: its worker holds
its calls for a share of every few milliseconds and serves one of its messages in each at
most (ContextControl.pace), a larger share each round that fails to halve, up to
PHOS_HANDOFF_THROTTLE, and lets go at the freeze. Each hold is a few milliseconds, far below
the downtime it saves; the result's phase_ms says for how long and how much.

What paces the rounds is what the frozen round must wait for: a target on this host reads
each round where it lies, so its loading paces them; a target on another host needs each
round sent first, and the link paces them while the target loads the round before (the
loads go in order, each after its round arrived; one at most is pending as the next round
goes, or as the frozen one is taken). What the application writes between a round's copy
and the freeze is what the frozen round carries: kept off that window, the target's loads
shrink the rounds the link must carry, and the frozen one with them.

Plain code over two parties, so that it runs without gRPC or processes (tests fake both):
the source, the front end holding the context, and the target it goes to; their Protocols,
HandoffSource and HandoffTarget, are in gpu_server/control/handoff_parties.py. DeviceTarget,
below, is the target where it goes to another device of the same server. Either side's failure
is a CudaError.
"""
import asyncio
import logging
import time
import types
from dataclasses import dataclass, field

from phos.base import settings
from phos.gpu_server.control.handoff_parties import HandoffSource, HandoffTarget
from phos.gpu_server.control.handoff_store import HandoffStore
from phos.schema import admin_pb2 as pb
from phos.schema.cuda_types import CudaError
from phos.snapshot import open_store
from phos.snapshot.image import DEFAULT_CHUNK_SIZE

MAX_ROUNDS = 12                  # pre-copy rounds of a handoff, at most
SMALL_ROUND = 4 << 20            # a pre-copy round this small ends them: the frozen one will be small too
THROTTLE_AIM = 0.25              # a round that did not halve: hold the application so that the next is this share of it
LOADED_TIMEOUT = 600             # seconds the target may load on demand from the rounds before they go

log = logging.getLogger("phos.admin")


@dataclass
class HandoffResult:
    ctx: int
    to: str
    round_bytes: list            # bytes copied by each pre-copy round, then by the final one
    round_ms: list               # how long each round's copy took, the frozen one last
    downtime_ms: float           # the application's calls were held this long
    seconds: float               # the whole handoff
    phase_ms: dict               # where the time went (see HandoffReply in schema/admin.proto)
    chunk_size: int
    recovery_store: str = ""     # the rounds went to the target's recovery store of the context:
    recovery_image: str = ""     # the last one is its recovery image there
    cleanup: asyncio.Future = field(default=None, repr=False)   # removes the rounds once the target loaded them


class Handoff:
    def __init__(self, source: HandoffSource, worker, target: HandoffTarget, ctx, to, max_rounds=0, chunk_size=0,
                 make_store=HandoffStore):
        self.source, self.worker, self.target = source, worker, target
        self.ctx, self.to = ctx, to
        self.max_rounds = max_rounds or MAX_ROUNDS
        # 2 MiB unless asked: 8 MiB chunks at 8 GiB cut the frozen round's per-chunk work
        # by 14 ms but copied twice the bytes, and the downtime grew (perf/RESULTS.md)
        self.chunk = chunk_size or DEFAULT_CHUNK_SIZE
        self.make_store = make_store
        self.store = None          # a HandoffStore, once the target said where
        self.sending = None        # the last round on its way to the target
        self.loading = None        # the target's load of it, in order after the one before
        self.loading_before = None     # the target's load of the round before it
        self.dropping = None           # deleting rounds the target holds already (drop_held_rounds)
        self.max_hold = settings.handoff_throttle()
        self.warm_endpoint = ""        # the worker of the target's warm copy, once a round loaded there
        self.hold, self.throttled_at = 0.0, None     # the share of the time the application is held, since when

    async def run(self):
        """Move the context; returns a HandoffResult, or raises CudaError with the context
        still live here (or, past the target's adoption, gone from here either way)."""
        t0 = time.perf_counter()
        loading = warm = False      # warm: the target may hold a warm copy that is not yet the live one
        w = self.worker
        try:
            info = await self.target.stats()
            store = self.store = self.make_store(self.ctx, info.recovery_dir, await self.host_store_for(info))
            log.info("context %d: the handoff's rounds go to %s", self.ctx, store.path)
            warm = True
            rounds, round_ms, parent = await self.pre_copy()
            held = self.hold
            await self.unthrottle()     # the calls held at the freeze would wait out their hold on top of it
            # the target's key: a client of a server with other keys authenticates it by that
            target_key = getattr(info, "server_key", "")
            await self.connect_ahead(info.standby, target_key)
            frozen = time.perf_counter()
            phases = {"pre_copy": (frozen - t0) * 1e3}
            if self.throttled_at is not None:
                phases.update(throttled=(frozen - self.throttled_at) * 1e3, throttled_hold_pct=held * 100)
            name = store.round_name(len(rounds))
            reply, copied, ms = await self.last_round(name, parent, frozen, phases)
            rounds.append(copied)
            round_ms.append(ms)
            warm = False              # it is the live context there now
            if not self.target.same_server:     # else the front end's table names the new worker already
                self.source.moved[self.ctx] = (reply.endpoint, info.standby, target_key)
            t = time.perf_counter()
            try:
                await self.source.retire(w, reply.endpoint, info.standby, target_key)
            except CudaError:
                if self.source.worker_alive(w):
                    raise
                # it died after the target adopted the context: gone either way, the move stands
            phases["retire"] = (time.perf_counter() - t) * 1e3
            downtime = time.perf_counter() - frozen
            loading = True
            cleanup = asyncio.ensure_future(self.remove_when_loaded(name))
            self.source.counts["handoffs"] += 1
            return HandoffResult(self.ctx, self.to, rounds, round_ms, downtime * 1e3, time.perf_counter() - t0, phases,
                                 self.chunk, *((store.path, name) if store.recovery else ("", "")), cleanup=cleanup)
        except CudaError as e:
            log.warning("context %d: the handoff to %s failed, the context stays here: %s", self.ctx, self.to, e.message)
            await self.stop_loading()
            await self.unthrottle()
            if warm:
                await self.target.drop_warm()
            if self.store is not None:      # gone before the caller hears of the failure
                await asyncio.to_thread(self.store.remove)
                self.store = None
            raise
        finally:
            if not loading and self.store is not None:
                await asyncio.to_thread(self.store.remove)     # off the loop: it may be gigabytes of files

    async def host_store_for(self, info):
        """The source's host store where the rounds go there, else "": where the target pins
        it too (device to device through it), or where the target reads the rounds only as we
        send them (another host) and the store has room for the context twice over (its first
        round, and the later ones beside it): the device copies them straight into its slots,
        not through buffers into files (~2.5 GB/s on the H200)."""
        mine = self.source.host_store or ""
        if mine and info.host_store == mine:
            return mine
        if not (mine and self.target.remote):
            return ""
        chunks = 2 * -(-(await self.source.ctx_stats(self.worker)).bytes // self.chunk)
        store = await asyncio.to_thread(open_store, mine, create=False)
        free = (await asyncio.to_thread(store.stats))["free_slots"]
        return mine if self.chunk <= store.capacity and free >= chunks else ""

    def adopt(self, name, **how):
        """Send round `name` (or, with how's delta, the last round's delta) to the target; its
        load follows the load before it. Returns the loading (its restore reply); the sending is
        self.sending, which caught_up waits for."""
        self.sending = asyncio.ensure_future(self.target.send(self.store.path, name, how.get("delta", b"")))
        self.loading_before = self.loading
        self.loading = asyncio.ensure_future(self.load_after(self.sending, self.loading, name, how))
        return self.loading

    async def load_after(self, sending, before, name, how):
        await sending
        if before is not None:
            await before
        reply = await self.target.restore(self.store.path, name, **how)
        self.warm_endpoint = reply.endpoint
        return reply

    async def connect_ahead(self, standby, server_key):
        """Just before the freeze: the application's client connects to the warm copy's worker
        ahead (Reply.movingTo), so that its re-attach after the move finds the handshake done
        (~5 ms of the downtime over TCP with CURVE). Where the copy is loaded afresh at the last
        round, the client connects anew; where the worker cannot say it, the handoff goes on."""
        if not self.warm_endpoint:
            return
        try:
            await self.source.moving_to(self.worker, self.warm_endpoint, standby, server_key)
        except CudaError as e:
            log.warning("context %d: its client cannot connect ahead to %s: %s", self.ctx, self.warm_endpoint, e.message)

    async def caught_up(self):
        """Until the target is near enough to take the next round: the last round reached it,
        and it loaded that one (where it reads the rounds in place, on this host) or every one
        before it (where it receives them: it loads one while the next travels). The frozen
        round then never waits behind more than one load."""
        if self.sending is not None:
            await self.sending
        wait = self.loading if not self.target.remote else self.loading_before
        if wait is not None:
            await wait

    async def stop_loading(self):
        """A failed handoff: what is still on its way to the target, or loading there, is of no use."""
        pending = [f for f in (self.sending, self.loading, self.loading_before) if f is not None]
        self.sending = self.loading = self.loading_before = None
        for f in pending:
            f.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def pre_copy(self):
        """Pre-copy rounds while the application runs; the target's warm copy loads each round
        while the next one copies (on this host) or travels (to another). Returns the bytes and
        milliseconds of each round, and the last round's name.

        What the application writes while we wait for the target goes into the next round: to
        another host, a round is taken once the target is near (caught_up), so that the wait
        is in it, and a small one ends the rounds only where the load still pending at the
        freeze is small too."""
        rounds, round_ms, name = [], [], ""
        smallest, grew = None, 0      # the smallest round after the first; rounds since it
        remote = self.target.remote
        try:
            for i in range(max(2, self.max_rounds)):
                name, parent = self.store.round_name(i), name
                t = time.perf_counter()
                if remote:
                    await self.caught_up()
                if self.dropping is not None:
                    # a round's start takes the store's session, which waits for a collection
                    # holding its lock: the worker, and the application's calls, would wait with it
                    await self.dropping
                asked = time.perf_counter()
                waited = (asked - t) * 1e3
                copied, steps, ms = await self.round(name, parent, final=False)
                longest = sorted(steps.items(), key=lambda kv: -kv[1])[:4]
                log.info("context %d: handoff pre-copy round %d: %d bytes in %.1f ms (%.1f ms from the ask to the "
                         "answer; %s), after %.1f ms waiting for the target", self.ctx, i, copied, ms,
                         (time.perf_counter() - asked) * 1e3, ", ".join(f"{k} {v:.1f}" for k, v in longest), waited)
                rounds.append(copied)
                round_ms.append(ms)
                if not remote:
                    await self.caught_up()
                if i >= 2:
                    self.drop_held_rounds(parent)
                self.adopt(name, warm=True, full=True, advance=i > 0)
                if i == 0:
                    continue
                # from round 1, which holds what was written while round 0 (all of it) travelled
                await self.throttle(copied, rounds[-2])
                # On while they shrink, with a round's grace: one may grow while the target
                # catches up (round 2 waits for round 0's long load).
                if smallest is None or copied < smallest:
                    smallest, grew = copied, 0
                else:
                    grew += 1
                pending = rounds[-2] if remote and not self.loading_before.done() else 0
                if max(copied, pending) <= SMALL_ROUND or grew >= 2:
                    break
            await self.caught_up()     # before the freeze
        except BaseException:
            await self.stop_loading()
            raise
        finally:
            if self.dropping is not None:      # its collection holds the store: not in the frozen round
                await self.dropping
        return rounds, round_ms, name

    async def throttle(self, copied, before):
        """A round that did not halve against the one `before` it: hold the application's calls
        for more of the time, so that the next round is about THROTTLE_AIM of this one (what it
        writes scales with the share it runs), up to max_hold."""
        if copied <= SMALL_ROUND or not before or copied <= before / 2 or self.hold >= self.max_hold:
            return              # the rounds end at a round this small, or shrink fast enough
        unheld = copied / before / (1 - self.hold)       # the shrink, were the application not held
        hold = min(self.max_hold, 1 - THROTTLE_AIM / unheld)
        if hold < self.hold + 0.01:
            return
        try:
            await self.source.pace(self.worker, hold)
        except CudaError as e:       # the handoff goes on unthrottled; its worker's trouble shows next round
            log.warning("context %d: the application cannot be held: %s", self.ctx, e.message)
            self.max_hold = self.hold
            return
        log.info("context %d: a handoff round of %d bytes after one of %d: the application is held %.0f%% of "
                 "the time", self.ctx, copied, before, hold * 100)
        self.hold, self.throttled_at = hold, self.throttled_at or time.perf_counter()

    async def unthrottle(self):
        """The application runs at its full speed again: for the freeze, or after a failure."""
        if self.hold and self.source.worker_alive(self.worker):
            try:
                await self.source.pace(self.worker, 0.0)
            except CudaError as e:
                log.warning("context %d: the application is still held part of the time: %s", self.ctx, e.message)
        self.hold = 0.0

    def drop_held_rounds(self, before):
        """The rounds before round `before` reached the target, and it loaded them (the rounds
        before the last one it was sent, which caught_up waited for): delete them in the
        background, so that the store keeps room for the rounds to come (a HostStore's slots are
        few: twice the context, host_store_for). One deletion at a time; a later one takes what
        an earlier one skipped."""
        if self.dropping is None or self.dropping.done():
            self.dropping = asyncio.ensure_future(asyncio.to_thread(self.store.drop_rounds_before, before))

    async def last_round(self, name, parent, frozen, phases):
        """The frozen last round, and the target's adopting it. Returns (the target's restore
        reply, bytes copied, milliseconds).

        The target adopts the last round loaded in full before the client comes (the delta is
        small, and a loader thread left running would slow the target's first calls: GIL).
        Unless the round is the target's recovery image (which must be committed first), the
        source sends it as a delta before committing, and the target adopts that while the
        source commits."""
        early, commit_failed, adopt_began = None, None, frozen    # early: the target adopting the delta
        loaded_before = self.loading       # the last pre-copy round's load, which a fallback follows

        def on_delta(delta):
            nonlocal early, adopt_began
            adopt_began = time.perf_counter()
            phases["last_round_delta"] = (adopt_began - frozen) * 1e3
            early = self.adopt(name, advance=True, full=True, delta=delta)
        try:
            copied, steps, ms = await self.round(name, parent, final=True,
                                                 on_delta=None if self.store.recovery else on_delta)
        except CudaError as e:
            if early is None:
                raise               # before its delta: the source thawed itself
            copied, steps, ms, commit_failed = 0, {}, 0.0, e
        t = time.perf_counter()
        phases.update({f"last_round_{k}": v for k, v in steps.items()}, last_round=(t - frozen) * 1e3)
        reply = None
        if early is not None:
            try:
                reply = await early
            except CudaError as e:
                log.info("context %d: the target could not take the last round's delta (%s): it adopts the "
                         "committed image", self.ctx, e.message)
        if reply is None:
            try:
                if commit_failed is not None:
                    raise commit_failed
                adopt_began = time.perf_counter()
                self.loading = loaded_before
                reply = await self.adopt(name, advance=True, full=True)
            except CudaError:
                await self.source.thaw(self.worker)
                raise
        elif commit_failed is not None:      # the target holds it all: the image was for a fallback
            log.warning("context %d: the handoff's last round was not committed (%s); the target took its "
                        "delta", self.ctx, commit_failed.message)
        phases["target_adopt"] = (time.perf_counter() - adopt_began) * 1e3
        phases.update({f"target_{k}": v for k, v in reply.phase_ms.items()})
        return reply, copied, ms

    async def round(self, name, parent, final, on_delta=None):
        """One round into the handoff's store: a pre-copy round, or the frozen last one.
        on_delta: given the last round's delta when the source sends it, before committing.
        Returns (bytes copied, its steps, milliseconds)."""
        result = await self.source.checkpoint(self.worker, pb.WorkerCheckpointRequest(
            store=self.store.path, name=name, parent=parent, paused=final, freeze=final, precopy=not final,
            chunk_size=self.chunk, no_sync=True, early=on_delta is not None), on_delta=on_delta)
        return result.copied_bytes, dict(result.phase_ms), result.seconds * 1e3

    async def remove_when_loaded(self, last):
        """The target loads on demand from the handoff's store: remove the rounds once that is
        done, but the last one where it is the target's recovery image."""
        store = self.store
        await self.target.wait_loaded(LOADED_TIMEOUT)
        await asyncio.to_thread(store.remove, last if store.recovery else None)


class DeviceTarget:
    """A handoff's target (HandoffTarget) on another device of the same server (`phos handoff
    CTX --to-device N`): the warm copy is a worker on device N, kept out of the front end's table
    of contexts (where the live context stays, under the same id) until it adopts the last round
    and takes its place. The restore puts the context's allocations at their addresses, in its
    range (session.py Session.take_base), so the application's pointers stay valid on the new device."""
    same_server = True
    remote = False
    DROP_WAIT = 3.0             # seconds drop_warm waits for the copy's worker to be gone

    def __init__(self, front, ctx, device):
        self.front, self.ctx, self.device = front, ctx, device
        self.copy = None        # the warm copy's WorkerProc

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        pass

    async def stats(self):
        recovery = self.front.recovery
        return types.SimpleNamespace(recovery_dir=recovery.directory if recovery else "",
                                     host_store=self.front.host_store or "",
                                     standby=recovery.standby if recovery else "", server_key="")

    async def send(self, store, name, delta=b""):
        """Nothing to send: the copy reads the rounds where they lie."""

    async def restore(self, store, name, warm=False, advance=False, full=False, delta=b""):
        """As the admin API's Restore does on a target server (FrontEnd.restore and advance)."""
        res = None
        if advance and self.copy is not None:
            try:
                res = await self.front.control(self.copy, pb.RestoreRequest(store=store, name=name, advance=True,
                                                                            full=full, delta=delta))
            except CudaError as e:
                if delta:
                    raise
                log.warning("context %d: the warm copy cannot take image %s (%s): restoring it afresh", self.ctx, name,
                            e.message)
                await self.drop_warm()
        if res is None:
            self.copy = await self.front.standby_worker(self.device)
            self.copy.state = "warming"
            self.front.fill_pool()
            try:
                res = await self.front.control(self.copy, pb.RestoreRequest(store=store, name=name, full=full,
                                                                            warm=warm))
            except BaseException:
                await self.drop_warm()
                raise
            self.copy.ctx_id = res.ctx
        if not warm:                 # the last round: it is the context now
            self.copy.state = "running"
            self.front.workers[self.ctx] = self.copy
            self.front.counts["restores"] += 1
        return types.SimpleNamespace(endpoint=self.copy.endpoint, phase_ms=dict(res.phase_ms))

    async def drop_warm(self):
        """Free the warm copy, if it is not the context yet; once its worker is gone, since it holds
        the round it loads (and the caller removes the rounds next)."""
        copy = self.copy
        if copy is None or copy.state == "running":
            return
        self.copy = None
        if copy.proc.returncode is None:
            copy.proc.kill()
        try:
            await asyncio.wait_for(copy.proc.wait(), self.DROP_WAIT)
        except asyncio.TimeoutError:
            pass

    async def wait_loaded(self, timeout):
        deadline = time.monotonic() + timeout
        while self.copy is not None and self.front.worker_alive(self.copy) and time.monotonic() < deadline:
            try:
                if not (await self.front.ctx_stats(self.copy)).restoring:
                    return
            except CudaError:
                return
            await asyncio.sleep(0.5)
