"""Fuzzing: garbage, random and out-of-order input never crashes or hangs the server,
and another tenant's results stay correct.

Each generated case sends frames to the front end, to the fuzzer's own context worker
(attached), or to that worker from a connection that never attached ("stranger"), then
pings the same socket: the server must have answered each frame with an error, or
dropped it, and still answer. Cases:
  bytes     random bytes, one or more frames
  mutant    a valid Request cut short, with bytes flipped, or with garbage appended
  request   a structurally valid Request built from the real schema, random calls and
            field values (huge sizes, stray handles and pointers), random payload frames
  sequence  calls out of order on a model of the context's objects: launch before load,
            free twice, use after destroy, destroy twice, other tenants' handles; the
            model says which must be refused, and the worker must refuse exactly those
  mailbox   garbage in the shared-memory request box, with or without a doorbell
  staging   attach offering a real staging file: too small, shorter than it says, wrong cookie
  huge      an oversized control frame, or a big payload frame that does not match
Every 100 cases, and at the end, a victim session (the Python client) must still
compute vec_add correctly, and the front end and the victim's worker must be alive.

    python3 -m pytest -q tests/e2e/test_fuzz.py             # the CI sample (a few hundred cases)
    python3 -m pytest -q -m fuzz tests/e2e/test_fuzz.py     # nightly: 20,000 cases
"""
import collections
import ctypes
import mmap
import os
import struct
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings, strategies as st

from conftest import ServerProc, wait_until
from phos.gpu_server.address_space import BASE
from phos.gpu_server.client_keys import pid_alive
from phos.gpu_server.worker.strangers import REFUSALS
from phos.schema import wire
from phos.schema.cuda_types import STICKY, CUresult
from ptx_helpers import compile_ptx
from wire_client import RawSession, client_file, dealer, decode_reply, encode

pytestmark = pytest.mark.gpu     # perf/device/run.sh runs this file with --backend cuda

CI_CASES = int(os.environ.get("PHOS_FUZZ_CI_CASES", "300"))
NIGHTLY_CASES = int(os.environ.get("PHOS_FUZZ_CASES", "20000"))
VICTIM_EVERY = 100
PING_VERSION = 0x0BADF00D          # a protocol version no generated frame uses: the stranger's ping
ANSWER_TIMEOUT = 20.0              # seconds a ping may take before we call it a hang
EMU_MEMORY = 64 << 20              # keeps whatever the fuzzer allocates small
INVALID_HANDLE, INVALID_VALUE = CUresult.CUDA_ERROR_INVALID_HANDLE, CUresult.CUDA_ERROR_INVALID_VALUE
CALL = wire.phos_capnp.Call.schema
FRONT_CALLS = CALL.union_fields
# ctxDestroy ends the context (a fresh one costs a worker start), so it comes from the sequences, rarely
WORKER_CALLS = tuple(n for n in CALL.union_fields if n not in ("ctxCreate", "ctxDestroy"))
PTX = compile_ptx("vecadd.cu", "compute_75").encode()


@pytest.fixture(scope="module")
def server(backend, tmp_path_factory):
    """This module's own server (it replaces conftest's): emu memory kept small."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PHOS_EMU_MEMORY", str(EMU_MEMORY))
        srv = ServerProc(backend, tmp_path_factory.mktemp("fuzz"))
    yield srv
    srv.stop()


# -- values ------------------------------------------------------------------------------
# Sizes and counts stay small or are impossibly large: nothing in between, so that no case
# asks the device for gigabytes of real work. Pointers fall near the context's base.
U64 = st.one_of(st.integers(0, 8), st.integers(0, 4096),
                st.sampled_from([2**32 - 1, 2**32, 2**48, 2**63 - 1, 2**63, 2**64 - 1]),
                st.integers(2**48, 2**64 - 1), st.integers(BASE - 64, BASE + (4 << 20)),
                st.integers(0x1000 - 2, 0x1040))
U32 = st.one_of(st.integers(0, 8), st.sampled_from([2**31 - 1, 2**31, 2**32 - 1, 1 << 20]), st.integers(0, 2**32 - 1))
I32 = st.one_of(st.integers(-2, 8), st.integers(-2**31, 2**31 - 1))
TEXT = st.one_of(st.text(max_size=24), st.sampled_from(["vec_add", "saxpy", "", "x" * 300, "/dev/shm/phos-x", "/etc/passwd"]))
DATA = st.binary(max_size=48)


@st.composite
def launch_config(draw):
    """Launch.config's 40 bytes: a small grid, or one outside the limits; never a huge valid one."""
    dims = [draw(st.one_of(st.integers(1, 4), st.sampled_from([0, 65536, 2**31, 2**32 - 1]))) for _ in range(3)]
    block = [draw(st.one_of(st.integers(1, 64), st.sampled_from([0, 1025, 2048, 2**32 - 1]))) for _ in range(3)]
    shared = draw(st.one_of(st.just(0), st.integers(0, 2**32 - 1)))
    return wire.LAUNCH_CONFIG.pack(*dims, *block, shared, 0, draw(st.sampled_from([0, 1, 2, 0x1000, 2**64 - 1])))


@st.composite
def launch_blob(draw):
    """A launchBatch blob: records as the schema lays them out, sometimes cut or lying about lengths."""
    out = b""
    for _ in range(draw(st.integers(0, 3))):
        params = draw(st.binary(max_size=32))
        n = draw(st.one_of(st.just(len(params)), U32))
        out += struct.pack("<Q", draw(U64)) + draw(launch_config()) + struct.pack("<I", n) + params
    return out[:draw(st.integers(0, len(out)))] if draw(st.booleans()) else out


VALUES = {"uint64": U64, "uint32": U32, "int32": I32, "uint8": st.integers(0, 255), "bool": st.booleans(),
          "enum": st.integers(0, 9),   # past the last enumerant too: a bad value must be refused
          "text": TEXT, "data": DATA}


def call_args(name):
    """A strategy for one call's arguments, from the real schema: any subset of its fields set."""
    field = CALL.fields[name]
    kind = field.proto.slot.type.which()
    if kind == "void":
        return st.none()
    if kind == "data":                    # launchBatch
        return st.one_of(launch_blob(), DATA)
    fields = field.schema.fields
    optional = {}
    for f in field.schema.fieldnames:
        optional[f] = launch_config() | DATA if f == "config" else VALUES[fields[f].proto.slot.type.which()]
    if name == "ctxCreate":               # never a real context: only devices that do not exist
        optional["device"] = st.one_of(st.integers(1, 2**31 - 1), st.integers(-2**31, -1))
        return st.fixed_dictionaries({"device": optional.pop("device")}, optional=optional)
    return st.fixed_dictionaries({}, optional=optional)


ARGS = {name: call_args(name) for name in CALL.union_fields}


@st.composite
def request(draw, names):
    """(Request frame, payload frames) with 0-4 random calls."""
    calls = [(n, draw(ARGS[n])) for n in draw(st.lists(st.sampled_from(names), max_size=4))]
    seqs = draw(st.one_of(st.just(None), st.lists(U64, min_size=len(calls), max_size=len(calls))))
    version = draw(st.one_of(st.just(wire.PROTOCOL_VERSION), U32.filter(lambda v: v != PING_VERSION)))
    frame = encode(calls, seqs or range(1, len(calls) + 1), want_reply=draw(st.booleans()), version=version)
    payloads = draw(st.lists(st.one_of(st.binary(max_size=64), st.just(PTX), st.binary(min_size=4096, max_size=4096)), max_size=3))
    return frame, payloads


TARGETS = st.sampled_from(["front", "worker", "stranger"])


def names_for(target):
    return FRONT_CALLS if target == "front" else WORKER_CALLS


@st.composite
def bytes_case(draw):
    frames = draw(st.lists(st.binary(max_size=2048), min_size=1, max_size=3))
    return ("frames", draw(TARGETS), frames)


@st.composite
def mutant_case(draw):
    target = draw(TARGETS)
    frame, payloads = draw(request(names_for(target)))
    frame = bytearray(frame)
    how = draw(st.sampled_from(["cut", "flip", "append", "segments"]))
    if how == "cut":
        frame = frame[:draw(st.integers(0, max(len(frame) - 1, 0)))]
    elif how == "flip":
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(frame) - 1))
            frame[i] ^= draw(st.integers(1, 255))
    elif how == "append":
        frame += draw(st.binary(min_size=1, max_size=256))
    else:                                  # a segment table that lies: many segments, huge sizes
        frame[:8] = struct.pack("<II", draw(U32), draw(U32))
    return ("frames", target, [bytes(frame), *payloads])


@st.composite
def request_case(draw):
    target = draw(TARGETS)
    frame, payloads = draw(request(names_for(target)))
    return ("frames", target, [frame, *payloads])


@st.composite
def huge_case(draw):
    if draw(st.booleans()):
        return ("frames", draw(TARGETS), [bytes(wire.MAX_CONTROL_FRAME + draw(st.integers(1, 64)))])
    size = draw(st.sampled_from([1 << 20, 8 << 20]))
    said = draw(st.sampled_from([size - 1, size + 1, 2**63, 0]))
    frame = encode([("memcpyHtoD", {"dst": BASE, "size": said, "payload": 1})], [1], want_reply=draw(st.booleans()))
    return ("frames", "worker", [frame, bytes(size)])


KINDS = ("ptr", "module", "function", "stream", "event")
# live: one of ours (a pointer: its base, a few bytes in, or its last 4 bytes); dead: destroyed or
# freed; other: one of ours of another kind; victim: the other tenant's; raw: any number
REF = st.tuples(st.sampled_from(["live", "live", "dead", "other", "victim", "raw"]), st.integers(0, 7), U64)
OPS = st.one_of(
    st.tuples(st.just("alloc"), st.sampled_from([1, 16, 256, 4096, 2**63])),
    st.tuples(st.just("free"), REF),
    st.tuples(st.just("htod"), REF, st.integers(0, 64)),
    st.tuples(st.just("dtoh"), REF, st.integers(0, 64)),
    st.tuples(st.just("dtod"), REF, REF, st.integers(0, 64)),
    st.tuples(st.just("memset"), REF, st.integers(0, 64)),
    st.tuples(st.just("load"), st.sampled_from(["ptx", "garbage", "empty"])),
    st.tuples(st.just("unload"), REF),
    st.tuples(st.just("getfn"), REF, st.sampled_from(["vec_add", "saxpy", "nope"])),
    st.tuples(st.just("launch"), REF, REF, REF, st.integers(0, 300), st.booleans()),
    st.tuples(st.just("stream_create")),
    st.tuples(st.just("stream_destroy"), REF),
    st.tuples(st.just("stream_sync"), REF),
    st.tuples(st.just("event_create")),
    st.tuples(st.just("event_destroy"), REF),
    st.tuples(st.just("event_record"), REF, REF),
    st.tuples(st.just("event_query"), REF),
    st.tuples(st.just("sync")),
)


@st.composite
def sequence_case(draw):
    ops = draw(st.lists(OPS, min_size=2, max_size=8))
    if draw(st.booleans()):               # a kernel to launch, well or badly
        ops = [("load", "ptx"), ("getfn", ("live", -1, 0), "vec_add")] + ops
    if draw(st.integers(0, 99).map(lambda v: v == 57)):    # 1 in 100 (not 0: Hypothesis favours bounds)
        ops.append(("destroy",))          # the context, twice, then use it
    return ("sequence", ops)


@st.composite
def mailbox_case(draw):
    frame, _ = draw(request(WORKER_CALLS))
    body = draw(st.one_of(st.just(frame), st.binary(max_size=512)))
    length = draw(st.one_of(st.just(len(body)), U64))
    return ("mailbox", body, length, draw(st.one_of(st.just(None), U64)), draw(st.booleans()))


@st.composite
def staging_case(draw):
    """attach offering a real /dev/shm file: sizes around the mailbox layout's, right or wrong cookie."""
    near = st.integers(wire.SLOTS_OFFSET - 64, wire.SLOTS_OFFSET + 64)
    size = draw(st.one_of(near, st.integers(0, wire.SLOTS_OFFSET + 8192), U64))
    file_size = draw(st.one_of(st.just(min(size, wire.SLOTS_OFFSET + 8192)), near, st.integers(0, 64)))
    return ("staging", size, file_size, draw(st.booleans()))


# Always run too, whatever Hypothesis draws: the misuse a CUDA program commits most.
LIVE, DEAD, VICTIM = ("live", 0, 0), ("dead", 0, 0), ("victim", 0, 0)
EXPLICIT = [
    ("sequence", [("launch", ("raw", 0, 0x1000), LIVE, LIVE, 1, True),         # launch before load
                  ("getfn", LIVE, "vec_add"), ("load", "ptx"), ("getfn", LIVE, "vec_add"), ("alloc", 4096),
                  ("launch", LIVE, LIVE, LIVE, 64, True), ("launch", LIVE, LIVE, LIVE, 64, False), ("dtoh", LIVE, 64),
                  ("unload", LIVE), ("unload", DEAD), ("getfn", DEAD, "vec_add"), ("launch", DEAD, LIVE, LIVE, 1, True),
                  ("free", LIVE), ("free", DEAD), ("htod", DEAD, 16),                       # free twice, use after free
                  ("stream_create",), ("stream_destroy", LIVE), ("stream_destroy", DEAD), ("stream_sync", DEAD),
                  ("event_create",), ("event_destroy", LIVE), ("event_destroy", DEAD), ("event_query", DEAD),
                  ("event_record", VICTIM, VICTIM), ("unload", VICTIM),
                  ("stream_create",), ("event_create",), ("event_query", ("other", 0, 0)),  # a stream used as an event
                  ("alloc", 16), ("htod", ("live", 3, 0), 4), ("htod", ("live", 3, 0), 5), ("sync",)]),  # the last 4 bytes
    ("sequence", [("load", "ptx"), ("getfn", LIVE, "vec_add"),                   # a kernel faults: sticky, renewed
                  ("launch", LIVE, ("raw", 0, BASE + (8 << 20)), ("raw", 0, BASE), 64, True), ("sync",)]),
    ("sequence", [("alloc", 16), ("destroy",)]),                                  # destroy twice, use after destroy
    ("staging", wire.BOX_OFFSET + 16, wire.BOX_OFFSET + 16, True),                # no room for the mailbox
]

CASES = st.one_of(bytes_case(), mutant_case(), request_case(), request_case(), sequence_case(), sequence_case(),
                  mailbox_case(), staging_case(), huge_case())


# -- the harness ---------------------------------------------------------------------------
class Model:
    """What the fuzzer's context holds, as far as the calls it sent say: decides which must fail."""

    def __init__(self):
        self.live = {k: [] for k in KINDS}      # ids (or (base, size) for ptr), in creation order
        self.dead = {k: [] for k in KINDS}
        self.fn_module = {}

    def has(self, kind, hid):
        if kind == "stream" and hid in (0, 1, 2):
            return True
        return hid in self.live[kind]

    def inside(self, ptr, n):
        """True if [ptr, ptr+n) lies in one live allocation (the worker's own rule)."""
        return any(b <= ptr < b + s and ptr + n <= b + s for b, s in self.live["ptr"])

    def kill(self, kind, hid):
        if hid in self.live[kind]:
            self.live[kind].remove(hid)
            self.dead[kind].append(hid)


class Fuzzer:
    """Two contexts of its own: `s` takes the frame and mailbox cases (and a stranger connects
    to its worker), `q` the sequences, so that random frames cannot upset q's model."""

    def __init__(self, server, victim):
        self.server, self.victim = server, victim
        self.front = dealer(server.address)
        self.seq = 1 << 40                 # our pings' seqs, far from the generated ones
        self.cases = 0
        self.sessions = []                 # every context id the fuzzer opened
        self.s = self.q = self.stranger = None
        self.tally = collections.Counter()  # (case kind or call, status) of what the server answered
        self.renew_s()
        self.renew_q()

    # sessions
    def open(self, old):
        """A fresh context (after a sticky error or a destroy); returns (session, worker pid)."""
        if old is not None:
            old.close(destroy=False)       # a context with a sticky error is freed when its client leaves
        session = RawSession(self.server.address)
        self.sessions.append(session.ctx)
        pids = [p for p in self.server.workers() if f"--ctx {session.ctx} " in cmdline(p)]
        assert len(pids) == 1, (session.ctx, pids)
        return session, pids[0]

    def renew_q(self):
        self.q, self.q_pid = self.open(self.q)
        self.model = Model()

    def renew_s(self):
        """s, a stranger on its worker, and a staging area whose mailbox the fuzzer scribbles on."""
        self.s, self.s_pid = self.open(self.s)
        self.new_stranger()
        size = wire.SLOTS_OFFSET + (1 << 20)
        assert self.attach_staging(size, size, True)

    def new_stranger(self):
        """A fresh unattached connection to s's worker. The worker cuts off a peer after REFUSALS
        refusals (gpu_server/worker/strangers.py): each case sends the stranger's socket two
        messages at most, so it is renewed before a ping could be one the worker ignores."""
        if self.stranger is not None:
            self.stranger.close(linger=0)
        self.stranger = dealer(self.s.endpoint)
        self.stranger_sent = 0

    def attach_staging(self, size, file_size, right_cookie):
        """Offer s's worker a staging file of file_size bytes as one of size; True if it mapped it."""
        cookie = os.urandom(16)
        path, fd = client_file(file_size, cookie if right_cookie else os.urandom(16))
        try:
            self.seq += 1
            seq = self.seq
            self.s.sock.send(encode([("attach", {"ctx": self.s.ctx, "token": self.s.token, "shmPath": path,
                                                 "shmCookie": cookie, "shmSize": size})], [seq]))
            # a request the fuzzer wrote into the old mailbox may be answered over the socket first
            seen, answered = self.replies(self.s.sock, lambda rs: any(r[0] == seq for r in rs), lambda: pid_alive(self.s_pid))
            assert answered, f"the worker died: {self.server.output()[-3000:]}"
            self.check(seen, "staging")
            _, status, message, u64s, _ = next(r for r in seen if r[0] == seq)
            assert status == 0, message
            if u64s[1]:                     # the worker uses this area now: so do we
                self.area = np.frombuffer(mmap.mmap(fd, size), np.uint8)
                self.box = wire.Mailbox(self.area)
            return u64s[1] == 1
        finally:
            os.close(fd)

    # answers
    def replies(self, sock, done, alive=lambda: True):
        """Read replies until done(results) says so; every reply must decode. Returns (results, answered)."""
        deadline = time.monotonic() + ANSWER_TIMEOUT
        seen = []
        while time.monotonic() < deadline:
            if sock.poll(50):
                frames = sock.recv_multipart()
                results = decode_reply(frames)          # a reply the client cannot read is a failure
                seen += results
                if done(results):
                    return seen, True
            elif not alive():
                return seen, False
        raise AssertionError(f"no answer within {ANSWER_TIMEOUT} s: the server hangs")

    def ping(self, target):
        """Make sure everything sent on target's socket was handled: returns the results seen."""
        self.seq += 1
        seq = self.seq
        if target == "stranger":
            self.stranger.send(encode([("memGetInfo", None)], [seq], version=PING_VERSION))
            seen, answered = self.replies(self.stranger, lambda rs: any(f"{PING_VERSION}" in r[2] for r in rs),
                                          lambda: pid_alive(self.s_pid))
            assert answered, f"the worker died: {self.server.output()[-3000:]}"
            assert all(r[1] != 0 for r in seen), f"a connection that never attached got an answer: {seen}"
            return seen
        sock = self.front if target == "front" else self.s.sock
        sock.send(encode([("deviceGetCount" if target == "front" else "memGetInfo", None)], [seq]))
        alive = (lambda: self.server.proc.poll() is None) if target == "front" else (lambda: pid_alive(self.s_pid))
        seen, answered = self.replies(sock, lambda rs: any(r[0] == seq for r in rs), alive)
        if not answered:
            raise AssertionError(f"{target} died: {self.server.output()[-3000:]}")
        return seen

    def check(self, seen, what):
        self.tally.update((what, r[1]) for r in seen)
        internal = [r for r in seen if "internal error" in r[2]]
        assert not internal, f"the server failed on its own: {internal}"

    def worker_result(self, seen):
        """After a ping of s's worker: renew s if a sticky error now fails every call."""
        if seen[-1][1] in STICKY:
            self.renew_s()

    # cases
    def run(self, case):
        self.cases += 1
        kind = case[0]
        if kind == "frames":
            _, target, frames = case
            if target == "stranger":
                if self.stranger_sent + 2 > REFUSALS:
                    self.new_stranger()
                self.stranger_sent += 2
            sock = {"front": self.front, "worker": self.s.sock, "stranger": self.stranger}[target]
            sock.send_multipart(frames)
            seen = self.ping(target)
            self.check(seen, target)
            if target == "worker":
                self.worker_result(seen)
        elif kind == "sequence":
            self.run_sequence(case[1])
        elif kind == "staging":
            _, size, file_size, right_cookie = case
            took = self.attach_staging(size, file_size, right_cookie)
            assert took == (right_cookie and wire.SLOTS_OFFSET <= size <= file_size), case
            seen = self.ping("worker")
            self.check(seen, "staging")
            self.worker_result(seen)
        elif kind == "mailbox":
            _, body, length, seq, ring = case
            n = min(len(body), wire.BOX_SIZE - 16)
            start = wire.BOX_OFFSET + 16
            self.area[start:start + n] = np.frombuffer(body[:n], np.uint8)
            head = self.area[wire.BOX_OFFSET:wire.BOX_OFFSET + 16].view(np.uint64)
            head[1] = np.uint64(length)
            head[0] = np.uint64((self.box.seq(0) + 1) % 2**64 if seq is None else seq)
            if ring:
                self.s.sock.send(wire.Request.new_message(version=wire.PROTOCOL_VERSION, doorbell=True).to_bytes())
            seen = self.ping("worker")
            self.check(seen, "mailbox")
            self.worker_result(seen)
        if self.cases % VICTIM_EVERY == 0:
            self.victim.check()
            assert self.server.proc.poll() is None

    def resolve(self, kind, ref):
        how, i, raw = ref
        m = self.model
        others = [h for k in KINDS if k not in (kind, "ptr") for h in m.live[k]]
        pool = {"live": m.live[kind], "dead": m.dead[kind], "other": others if kind != "ptr" else []}.get(how)
        if pool:
            value = pool[i % len(pool)]
            if kind != "ptr":
                return value
            base, size = value
            return base + size - 4 if i % 4 == 3 else base + (i if i % 4 == 1 else 0)
        if how == "victim":
            return self.victim.handles[kind]
        return raw

    def run_sequence(self, ops):
        m, sock = self.model, self.q.sock
        for op in ops:
            name, *a = op
            expect = None                       # INVALID_VALUE / INVALID_HANDLE / 0 where the model knows
            payloads = []
            if name == "alloc":
                call = ("memAlloc", {"size": a[0]})
            elif name == "free":
                p = self.resolve("ptr", a[0])
                call, expect = ("memFree", {"ptr": p}), 0 if any(b == p for b, _ in m.live["ptr"]) else INVALID_VALUE
            elif name in ("htod", "dtoh", "memset"):
                p, n = self.resolve("ptr", a[0]), a[1]
                expect = 0 if m.inside(p, n) else INVALID_VALUE
                if name == "htod":
                    call, payloads = ("memcpyHtoD", {"dst": p, "size": n, "payload": 1}), [bytes(n)]
                elif name == "dtoh":
                    call = ("memcpyDtoH", {"src": p, "size": n})
                else:
                    call = ("memset", {"dst": p, "value": 7, "elemSize": 1, "count": n})
            elif name == "dtod":
                d, src, n = self.resolve("ptr", a[0]), self.resolve("ptr", a[1]), a[2]
                call, expect = ("memcpyDtoD", {"dst": d, "src": src, "size": n}), 0 if m.inside(d, n) and m.inside(src, n) else INVALID_VALUE
            elif name == "load":
                image = {"ptx": PTX, "garbage": b"\x7fELF" + bytes(60), "empty": b""}[a[0]]
                call, payloads = ("moduleLoad", {"payload": 1}), [image]
            elif name == "unload":
                h = self.resolve("module", a[0])
                call, expect = ("moduleUnload", {"id": h}), 0 if m.has("module", h) else INVALID_HANDLE
            elif name == "getfn":
                h = self.resolve("module", a[0])
                call = ("moduleGetFunction", {"module": h, "name": a[1]})
                expect = (0 if a[1] != "nope" else None) if m.has("module", h) else INVALID_HANDLE
            elif name == "launch":
                f, p, q, n, good_shape = self.resolve("function", a[0]), self.resolve("ptr", a[1]), self.resolve("ptr", a[2]), a[3], a[4]
                grid = (1, 1, 1, 64, 1, 1) if good_shape else (0, 1, 1, 64, 1, 1)
                params = struct.pack("<QQQi", p, q, q, n) + bytes(4)
                call = ("launch", {"function": f, "config": wire.LAUNCH_CONFIG.pack(*grid, 0, 0, 0), "params": params[:28]})
                expect = None if m.has("function", f) else INVALID_HANDLE
                if m.has("function", f) and not good_shape:
                    expect = INVALID_VALUE
            elif name == "stream_create":
                call = ("streamCreate", {"flags": 0})
            elif name in ("stream_destroy", "stream_sync"):
                h = self.resolve("stream", a[0])
                call = ("streamDestroy" if name == "stream_destroy" else "streamSynchronize", {"id": h})
                expect = (None if name == "stream_destroy" and h in (0, 1, 2) else 0) if m.has("stream", h) else INVALID_HANDLE
            elif name == "event_create":
                call = ("eventCreate", {"flags": 0})
            elif name in ("event_destroy", "event_query"):
                h = self.resolve("event", a[0])
                call = ("eventDestroy" if name == "event_destroy" else "eventQuery", {"id": h})
                expect = (0 if name == "event_destroy" else None) if m.has("event", h) else INVALID_HANDLE
            elif name == "event_record":
                e, st_ = self.resolve("event", a[0]), self.resolve("stream", a[1])
                call = ("eventRecord", {"event": e, "stream": st_})
                expect = 0 if m.has("event", e) and m.has("stream", st_) else INVALID_HANDLE
            elif name == "sync":
                call = ("ctxSynchronize", None)
            elif name == "destroy":
                return self.destroy()
            self.seq += 1
            sock.send_multipart([encode([call], [self.seq]), *payloads])
            seen, answered = self.replies(sock, lambda rs, s=self.seq: any(r[0] == s for r in rs),
                                          lambda: pid_alive(self.q_pid))
            assert answered, f"worker died on {call[0]}: {self.server.output()[-3000:]}"
            self.check(seen, call[0] if expect is None else f"{call[0]} (checked)")
            _, status, message, u64s, _ = seen[-1]
            if status in STICKY:
                return self.renew_q()
            if expect is not None:
                assert status == expect, f"{op}: the model expects {expect}, the worker said {status} {message!r}"
            if status == 0:
                self.learn(name, call, u64s)

    def learn(self, name, call, u64s):
        m, args = self.model, call[1]
        if name == "alloc":
            m.live["ptr"].append((u64s[0], args["size"]))
        elif name == "free":
            hit = [x for x in m.live["ptr"] if x[0] == args["ptr"]]
            m.live["ptr"].remove(hit[0])
            m.dead["ptr"].append(hit[0])
        elif name == "load":
            m.live["module"].append(u64s[0])
        elif name == "unload":
            m.kill("module", args["id"])
            for fn, mod in list(m.fn_module.items()):
                if mod == args["id"]:
                    m.kill("function", fn)
        elif name == "getfn":
            m.live["function"].append(u64s[0])
            m.fn_module[u64s[0]] = args["module"]
        elif name == "stream_create":
            m.live["stream"].append(u64s[0])
        elif name == "stream_destroy":
            m.kill("stream", args["id"])
        elif name == "event_create":
            m.live["event"].append(u64s[0])
        elif name == "event_destroy":
            m.kill("event", args["id"])

    def destroy(self):
        """ctxDestroy twice in one request, then a call: the worker answers and goes away cleanly."""
        ctx, pid = self.q.ctx, self.q_pid
        self.q.sock.send(encode([("ctxDestroy", None), ("ctxDestroy", None)], [1, 2]))
        self.q.sock.send(encode([("ctxSynchronize", None)], [3]))      # use after destroy: nobody answers
        seen, _ = self.replies(self.q.sock, lambda rs: any(r[0] == 2 for r in rs))
        if seen[-1][1] not in STICKY:       # a fault of an earlier launch can surface here (on a GPU)
            assert all(r[1] == 0 for r in seen), seen
            assert wait_until(lambda: not pid_alive(pid), timeout=10), "a destroyed context lives on"
            path = self.server.address[len("ipc://"):]
            assert wait_until(lambda: not os.path.exists(f"{path}.ctx{ctx}"), timeout=5), "its socket file stays"
        self.renew_q()

    def finish(self):
        self.victim.check()
        assert self.server.proc.poll() is None
        self.stranger.close()
        self.s.close()
        self.q.close()
        self.front.close()
        # every context the fuzzer opened goes away (sticky ones when their client left)
        def left():
            return [(c, p) for p in self.server.workers() for c in self.sessions if f"--ctx {c} " in cmdline(p)]
        assert wait_until(lambda: not left(), timeout=10), f"fuzzed contexts outlived their clients: {left()}"
        log = self.server.output()
        assert "Traceback" not in log, log[log.index("Traceback") - 500:][:4000]


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return ""


class Victim:
    """Another tenant, through the Python client: vec_add on its own data must stay right."""
    N = 4096

    def __init__(self, cu, server):
        self.cu = cu
        ok = self.ok
        self.x = np.arange(self.N, dtype=np.float32)
        self.px, self.py, self.out = (ok(cu.cuMemAlloc(self.N * 4)) for _ in range(3))
        ok(cu.cuMemcpyHtoD(self.px, self.x, self.x.nbytes))
        ok(cu.cuMemcpyHtoD(self.py, self.x, self.x.nbytes))
        self.module = ok(cu.cuModuleLoadData(PTX))
        self.fn = ok(cu.cuModuleGetFunction(self.module, b"vec_add"))
        stream, event = ok(cu.cuStreamCreate(0)), ok(cu.cuEventCreate(0))
        self.handles = {"ptr": int(self.px), "module": int(self.module), "function": int(self.fn),
                        "stream": int(stream), "event": int(event)}
        ctx = int(ok(cu.cuCtxGetCurrent()))
        self.pid = [p for p in server.workers() if f"--ctx {ctx} " in cmdline(p)][0]
        self.check()

    def ok(self, res):
        assert int(res[0]) == 0, (res, self.cu.last_error)
        return res[1] if len(res) == 2 else res[1:]

    def check(self):
        cu, ok = self.cu, self.ok
        assert pid_alive(self.pid), "the victim's worker died"
        ok(cu.cuMemsetD32(self.out, 0, self.N))
        args = ((self.px, self.py, self.out, self.N), (ctypes.c_void_p,) * 3 + (ctypes.c_int,))
        ok(cu.cuLaunchKernel(self.fn, self.N // 256, 1, 1, 256, 1, 1, 0, 0, args, 0))
        out = np.empty(self.N, np.float32)
        ok(cu.cuMemcpyDtoH(out, self.out, out.nbytes))
        assert np.array_equal(out, 2 * self.x), "the victim's result is wrong"


def fuzz(server, cu, cases, derandomize):
    fuzzer = Fuzzer(server, Victim(cu, server))

    @settings(max_examples=cases, deadline=None, derandomize=derandomize, database=None,
              phases=[Phase.explicit, Phase.generate], print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(CASES)
    def one_case(case):
        fuzzer.run(case)
    for case in EXPLICIT:
        one_case = example(case)(one_case)

    start = time.monotonic()
    one_case()
    fuzzer.finish()
    print(f"\n{fuzzer.cases} fuzz cases in {time.monotonic() - start:.1f} s, {len(fuzzer.sessions)} contexts; answers:")
    for (what, status), n in sorted(fuzzer.tally.items()):
        print(f"  {what:28} {CUresult(status).name if status in CUresult._value2member_map_ else status:36} {n}")
    assert fuzzer.cases >= cases


def test_fuzz_sample(server, cu):
    """The CI sample: a fixed set of a few hundred cases."""
    fuzz(server, cu, CI_CASES, derandomize=True)


@pytest.mark.fuzz
def test_fuzz_nightly(server, cu):
    fuzz(server, cu, NIGHTLY_CASES, derandomize=False)


def test_calls_out_of_order_through_the_client(cu):
    """The same misuse through the Python client gets CUDA's errors, and the context carries on."""
    ok = CUresult.CUDA_SUCCESS
    assert cu.cuModuleGetFunction(cu.CUmodule(0x1000), b"vec_add")[0] == INVALID_HANDLE     # before any load
    err, p = cu.cuMemAlloc(64)
    assert cu.cuMemFree(p) == (ok,)
    assert cu.cuMemFree(p)[0] == INVALID_VALUE      # at once, as CUDA's driver answers it
    assert "outside this context's allocations" in cu.last_error
    assert cu.cuCtxSynchronize() == (ok,)
    err, s = cu.cuStreamCreate(0)
    assert cu.cuStreamDestroy(s) == (ok,)
    assert cu.cuStreamSynchronize(s)[0] == INVALID_HANDLE               # use after destroy
    err, ctx = cu.cuCtxCreate(None, 0, 0)
    assert cu.cuCtxDestroy(ctx) == (ok,)
    assert cu.cuCtxDestroy(ctx)[0] == CUresult.CUDA_ERROR_INVALID_CONTEXT    # destroy twice
    assert cu.cuCtxSetCurrent(ctx)[0] == CUresult.CUDA_ERROR_INVALID_CONTEXT
    assert cu.cuCtxSynchronize() == (ok,)           # the fixture's context is current again, and fine
