"""Encoding and decoding of phos's messages (schema/phos.capnp), for both sides.

A message is [Request or Reply frame, payload frame 1, payload frame 2, ...]. A worker's
control socket speaks admin.proto's ControlRequest and ControlReply instead (schema/control_socket.py);
an image's delta, which a handoff's target reads, is phos.capnp's ImageDelta (pack_delta, read_delta).
"""
import collections
import os
import struct

import capnp
import numpy as np

capnp.remove_import_hook()
phos_capnp = capnp.load(os.path.join(os.path.dirname(__file__), "phos.capnp"))

PROTOCOL_VERSION = phos_capnp.protocolVersion
MAX_CONTROL_FRAME = 1 << 20          # a Request or Reply frame; bulk bytes go in payload frames
TRAVERSAL_LIMIT_WORDS = MAX_CONTROL_FRAME // 8 * 2

LAUNCH_CONFIG = struct.Struct("<8IQ")   # Launch.config: grid xyz, block xyz, shared bytes, options, stream
LAUNCH_COOPERATIVE = 1 << 24            # Launch.config's options (phos.capnp): bit 24, and the cluster below
STREAM_ALIASES = (0, 1, 2)              # stream ids of the default stream: itself, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD


TENSOR_MAP_TILED = struct.Struct("<IIQ5Q4Q5I5IIIII")       # TensorMapEncode.args (phos.capnp)
TENSOR_MAP_IM2COL = struct.Struct("<IIQ5Q4Q3i3iII5IIIII")


def launch_cluster(options):
    """The thread-block cluster a launch's options name, or None."""
    cluster = (options & 0xFF, (options >> 8) & 0xFF, (options >> 16) & 0xFF)
    return cluster if any(cluster) else None
# A launchBatch record's head: function id, LAUNCH_CONFIG's nine values, params length;
# the params follow (see "Launch batches" in phos.capnp).
LAUNCH_RECORD = struct.Struct("<Q" + LAUNCH_CONFIG.format[1:] + "I")
_U32 = struct.Struct("<I")

# The shared staging area's layout: the staging* constants of phos.capnp (see its header).
COOKIE_BYTES = phos_capnp.stagingCookieBytes
AWAKE_OFFSET = phos_capnp.stagingAwakeOffset
ASLEEP_OFFSET = phos_capnp.stagingAsleepOffset
BOX_OFFSET = phos_capnp.stagingBoxOffset
BOX_SIZE = phos_capnp.stagingBoxSize
SLOTS_OFFSET = phos_capnp.stagingSlotsOffset
SLOT_SIZE = phos_capnp.stagingSlotSize          # clients' two bulk slots
MIN_COPY = phos_capnp.stagingMinCopy            # clients' smallest staged copy
PINNED_HEADER = phos_capnp.pinnedHeaderBytes    # a pinned host file's header; its bytes follow ("Pinned host memory")
MAX_REQUEST_CALLS = phos_capnp.maxRequestCalls

Request = phos_capnp.Request
Reply = phos_capnp.Reply

# A Reply's Result, read (read_result)
Result = collections.namedtuple("Result", "seq status message u64s f64 text data payload params")


class WireError(Exception):
    """A frame that cannot be read: malformed, oversized or from another protocol version."""


# What reading a hostile frame can raise: capnp checks bounds lazily, field by field.
MALFORMED = (WireError, capnp.KjException, ValueError, IndexError, AttributeError)


def describe(error):
    """One readable line for a decoding error (capnp appends a native stack trace)."""
    text = getattr(error, "description", None) or str(error)
    return text.split("\nstack:")[0].strip()


def launch_record(function, config, params):
    """One launchBatch record; config holds LAUNCH_CONFIG's nine values."""
    return LAUNCH_RECORD.pack(function, *config, len(params)) + params


def read_launch_batch(blob):
    """A launchBatch blob's records as [(function, config tuple, params bytes)].

    Reads the whole blob before anything runs, so a malformed one runs no launch.
    Raises WireError."""
    records, off, end = [], 0, len(blob)
    head, unpack = LAUNCH_RECORD.size, LAUNCH_RECORD.unpack_from
    while off < end:
        if end - off < head:
            raise WireError(f"record {len(records) + 1} at byte {off} is cut short: {end - off} bytes left, "
                            f"its head takes {head}")
        r = unpack(blob, off)
        start, off = off + head, off + head + r[10]
        if off > end:
            raise WireError(f"record {len(records) + 1} at byte {start - head} says {r[10]} parameter bytes, "
                            f"{end - start} are left")
        records.append((r[0], r[1:10], blob[start:off]))
    if not records:
        raise WireError("no records")
    return records


def launch_count(blob):
    """How many launches a launchBatch blob holds, by its length fields alone (cheaper than reading it)."""
    count, off, end = 0, 0, len(blob)
    head = LAUNCH_RECORD.size
    while off + head <= end:
        off += head + _U32.unpack_from(blob, off + head - 4)[0]     # the params length ends the head
        count += 1
    return count


def first_seq(call):
    """The seq of a Call's first API call: a launchBatch holds its launches' seqs, ending at its own.

    The mailbox needs it: the worker runs every call sent before it by socket first."""
    if call.which() == "launchBatch":
        return call.seq - max(launch_count(call.launchBatch), 1) + 1
    return call.seq


def decode(struct, frame):
    """Open a capnp frame; the caller reads it inside `with`. Raises WireError."""
    if len(frame) > MAX_CONTROL_FRAME:
        raise WireError(f"control frame of {len(frame)} bytes exceeds {MAX_CONTROL_FRAME}")
    try:
        return struct.from_bytes(bytes(frame), traversal_limit_in_words=TRAVERSAL_LIMIT_WORDS)
    except capnp.KjException as e:
        raise WireError(f"malformed frame: {describe(e)}") from None


_INT_RANGES = {f"{sign}int{bits}": (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if sign == "" else (0, (1 << bits) - 1)
               for sign in ("", "u") for bits in (8, 16, 32, 64)}
_FIELD_RANGES = {}


def _field_ranges(name):
    """{field: (least, most)} of the integer fields of the Call member `name` (its struct's)."""
    ranges = _FIELD_RANGES.get(name)
    if ranges is None:
        member = phos_capnp.Call.schema.fields[name]
        fields = member.schema.fields if member.proto.slot.type.which == "struct" else {}
        ranges = _FIELD_RANGES[name] = {f: _INT_RANGES[str(fs.proto.slot.type.which)] for f, fs in fields.items()
                                        if str(fs.proto.slot.type.which) in _INT_RANGES}
    return ranges


def check_args(name, args):
    """Raise ValueError, naming the field, when an integer argument of call `name` does not fit
    its field: Cap'n Proto would refuse it only when the batch holding it is encoded."""
    if not isinstance(args, dict):
        return
    ranges = _field_ranges(name)
    for key, value in args.items():
        bounds = ranges.get(key)
        if bounds is not None and isinstance(value, int) and not bounds[0] <= value <= bounds[1]:
            raise ValueError(f"{name}: {key} = {value} is outside [{bounds[0]}, {bounds[1]}]")


def too_many_calls(req):
    """Why a Request is refused whole for its number of calls, or None."""
    n = len(req.calls)
    return f"a request of {n} calls: at most {MAX_REQUEST_CALLS} run in one" if n > MAX_REQUEST_CALLS else None


def encode_request(calls, want_reply=True, version=PROTOCOL_VERSION):
    """[Request frame, payload frames...] of calls (seq, name, args, payload). args: None (a Void
    member), a dict of the member's fields, or a value (Data members; a bytearray is frozen).
    A payload goes in the next frame and the call's `payload` field names it."""
    req = Request.new_message(version=version, wantReply=want_reply)
    frames = [None]
    for c, (seq, name, args, payload) in zip(req.init("calls", len(calls)), calls):
        c.seq = seq
        if not isinstance(args, dict):
            setattr(c, name, bytes(args) if isinstance(args, bytearray) else args)
            continue
        fields = c.init(name)
        for key, value in args.items():
            setattr(fields, key, value)
        if payload is not None:
            frames.append(payload)
            fields.payload = len(frames) - 1
    frames[0] = req.to_bytes()
    return frames


class Mailbox:
    """The request and reply boxes of a staging area: frames written, then len, then seq.

    x86 keeps stores in order and loads in order, so a reader that sees the new seq sees
    the bytes before it; on weaker memory models this needs fences.
    """

    def __init__(self, area):
        self.area = area
        self.awake = area[AWAKE_OFFSET:AWAKE_OFFSET + 8].view(np.uint64)
        self.asleep = area[ASLEEP_OFFSET:ASLEEP_OFFSET + 8].view(np.uint64)
        # Each box's head (seq, len) and bytes through memoryviews: a synchronous call's round
        # trip goes through put, seq and take on both sides, and a NumPy slice costs several
        # times a memoryview's there.
        view = memoryview(area).cast("B")
        self.heads = [view[o:o + 16].cast("Q") for o in (BOX_OFFSET, BOX_OFFSET + BOX_SIZE)]
        self.frames = [view[o + 16:o + BOX_SIZE] for o in (BOX_OFFSET, BOX_OFFSET + BOX_SIZE)]

    def put(self, box, seq, frame):
        """Write a frame into box 0 (requests) or 1 (replies); False if it does not fit."""
        n = len(frame)
        if n > BOX_SIZE - 16:
            return False
        self.frames[box][:n] = frame
        head = self.heads[box]
        head[1] = n
        head[0] = seq
        return True

    def seq(self, box):
        return self.heads[box][0]

    def take(self, box):
        """The frame in a box, copied out."""
        n = self.heads[box][1]
        if n > BOX_SIZE - 16:
            raise WireError(f"mailbox frame of {n} bytes exceeds the box")
        return self.frames[box][:n].tobytes()


class Template:
    """A frame whose only variable parts are UInt64 data fields, patched and read in place.

    Building or opening a small message through pycapnp costs several microseconds, more
    than the rest of a synchronous round trip; the commonest frames (a call with no
    arguments, a plain success reply) need neither. `make(*values)` builds the frame with
    distinct sentinel values in those fields; their byte offsets are found once.
    """
    SENTINELS = (0x5A17E11A0001F00D, 0x5A17E11A0002F00D)
    U64 = struct.Struct("<Q")

    def __init__(self, make, fields):
        frame = make(*self.SENTINELS[:fields])
        self.offsets = [frame.index(self.U64.pack(v)) for v in self.SENTINELS[:fields]]
        assert self.offsets == sorted(self.offsets), "the sentinels come in field order"
        blank = bytearray(frame)
        for off in self.offsets:
            blank[off:off + 8] = bytes(8)
        self.blank = bytes(blank)
        # fill(*values): the frame in one struct call, the fixed bytes around the fields as `s` items
        ends = [0, *(off + 8 for off in self.offsets)]
        f = [self.blank[a:off] for a, off in zip(ends, self.offsets)] + [self.blank[ends[-1]:]]
        pack = struct.Struct("<" + "".join(f"{len(x)}sQ" for x in f[:-1]) + f"{len(f[-1])}s").pack
        self.fill = (lambda a: pack(f[0], a, f[1])) if fields == 1 else (lambda a, b: pack(f[0], a, f[1], b, f[2]))

    def read(self, frame):
        """The field values if frame has this template's shape, else None."""
        if len(frame) != len(self.blank):
            return None
        values = [self.U64.unpack_from(frame, off)[0] for off in self.offsets]
        return values if self.fill(*values) == frame else None


def _plain_reply(ack, seq):
    reply = Reply.new_message(ackSeq=ack)
    reply.init("results", 1)[0].seq = seq
    return reply.to_bytes()


def _bare_call(name):
    def make(seq):
        req = Request.new_message(version=PROTOCOL_VERSION, wantReply=True)
        call = req.init("calls", 1)[0]
        call.seq = seq
        setattr(call, name, None)
        return req.to_bytes()
    return make


PLAIN_REPLY = Template(_plain_reply, 2)         # ackSeq, results[0].seq; status 0, nothing else
BARE_CALLS = {name: Template(_bare_call(name), 1) for name in ("ctxSynchronize", "memGetInfo", "ctxDestroy")}
_BARE_BY_SHAPE = {}
for _name, _t in BARE_CALLS.items():
    _BARE_BY_SHAPE.setdefault((len(_t.blank), _t.offsets[0]), {})[_t.blank] = _name


def read_bare_call(frame):
    """(call name, seq) if frame is one of BARE_CALLS, else None: no capnp decoding needed."""
    for (size, off), names in _BARE_BY_SHAPE.items():
        if len(frame) == size:
            name = names.get(bytes(frame[:off]) + bytes(8) + bytes(frame[off + 8:]))
            if name:
                return name, Template.U64.unpack_from(frame, off)[0]
    return None


# -- Replies of the data plane -----------------------------------------------------------------
def build_reply(ack_seq, results, output="", durable=0, moved=None, moving_to=None):
    """Encode a Reply; results are (seq, status, message, fields); moved and moving_to: (endpoint,
    standby, server key). Returns the frames."""
    if len(results) == 1 and not output and not durable and not results[0][1] and not results[0][2] and not results[0][3]:
        return [PLAIN_REPLY.fill(ack_seq, results[0][0])]
    reply = Reply.new_message(ackSeq=ack_seq, durableSeq=durable)
    if output:
        reply.output = output
    if moved:
        reply.moved.endpoint, reply.moved.standby, reply.moved.serverKey = moved
    if moving_to:
        reply.movingTo.endpoint, reply.movingTo.standby, reply.movingTo.serverKey = moving_to
    frames = [None]
    out = reply.init("results", len(results))
    for r, (seq, status, message, fields) in zip(out, results):
        r.seq, r.status = seq, int(status)
        if message:
            r.message = message
        for key, value in fields.items():
            if key == "payload":
                frames.append(value)
                r.payload = len(frames) - 1
            elif key == "params":
                ps = r.init("params", len(value))
                for p, (off, size) in zip(ps, value):
                    p.offset, p.size = off, size
            else:
                setattr(r, key, value)
    frames[0] = reply.to_bytes()
    return frames


def error_reply(status, message):
    return build_reply(0, [(0, status, message, {})])


def read_result(r, frames):
    """A Result as a namedtuple, reading only the fields that are set (each read costs a microsecond)."""
    return Result(r.seq, r.status, r.message if r._has("message") else "",
                  list(r.u64s) if r._has("u64s") else [], r.f64,
                  r.text if r._has("text") else "", bytes(r.data) if r._has("data") else b"",
                  frames[r.payload] if 0 < r.payload < len(frames) else None,
                  [(p.offset, p.size) for p in r.params] if r._has("params") else [])


