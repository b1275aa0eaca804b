"""Encoding and decoding of data-plane messages (schema/phos.capnp).

A message is [Request or Reply frame, payload frame 1, payload frame 2, ...].
"""
import os
import struct

import capnp
import numpy as np

capnp.remove_import_hook()
phos_capnp = capnp.load(os.path.join(os.path.dirname(__file__), "phos.capnp"))

PROTOCOL_VERSION = phos_capnp.protocolVersion
MAX_CONTROL_FRAME = 1 << 20          # a Request or Reply frame; bulk bytes go in payload frames
TRAVERSAL_LIMIT_WORDS = MAX_CONTROL_FRAME // 8 * 2

LAUNCH_CONFIG = struct.Struct("<8IQ")   # Launch.config: grid xyz, block xyz, shared bytes, 0, stream
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
DEFAULT_SERVER = phos_capnp.defaultServer       # phos/settings.py reads the same constant

Request = phos_capnp.Request
Reply = phos_capnp.Reply


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
        self.boxes = [area[o:o + 16].view(np.uint64) for o in (BOX_OFFSET, BOX_OFFSET + BOX_SIZE)]

    def put(self, box, seq, frame):
        """Write a frame into box 0 (requests) or 1 (replies); False if it does not fit."""
        n = len(frame)
        if n > BOX_SIZE - 16:
            return False
        start = BOX_OFFSET + box * BOX_SIZE + 16
        self.area[start:start + n] = np.frombuffer(frame, np.uint8)
        head = self.boxes[box]
        head[1] = n
        head[0] = seq
        return True

    def seq(self, box):
        return int(self.boxes[box][0])

    def take(self, box):
        """The frame in a box, copied out."""
        n = int(self.boxes[box][1])
        if n > BOX_SIZE - 16:
            raise WireError(f"mailbox frame of {n} bytes exceeds the box")
        start = BOX_OFFSET + box * BOX_SIZE + 16
        return self.area[start:start + n].tobytes()


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
        blank = bytearray(frame)
        for off in self.offsets:
            blank[off:off + 8] = bytes(8)
        self.blank = bytes(blank)

    def fill(self, *values):
        out = bytearray(self.blank)
        for off, v in zip(self.offsets, values):
            self.U64.pack_into(out, off, v)
        return bytes(out)

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
