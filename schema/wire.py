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

# The shared staging area's layout (see the header of phos.capnp).
COOKIE_BYTES = 16
AWAKE_OFFSET = 16
BOX_OFFSET = 4096
BOX_SIZE = 64 << 10
SLOTS_OFFSET = BOX_OFFSET + 2 * BOX_SIZE

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


def decode(struct, frame):
    """Open a capnp frame; the caller reads it inside `with`. Raises WireError."""
    if len(frame) > MAX_CONTROL_FRAME:
        raise WireError(f"control frame of {len(frame)} bytes exceeds {MAX_CONTROL_FRAME}")
    try:
        return struct.from_bytes(bytes(frame), traversal_limit_in_words=TRAVERSAL_LIMIT_WORDS)
    except capnp.KjException as e:
        raise WireError(f"malformed frame: {describe(e)}") from None


class Mailbox:
    """The request and reply boxes of a staging area: frames written, then len, then seq.

    x86 keeps stores in order and loads in order, so a reader that sees the new seq sees
    the bytes before it; on weaker memory models this needs fences.
    """

    def __init__(self, area):
        self.area = area
        self.awake = area[AWAKE_OFFSET:AWAKE_OFFSET + 8].view(np.uint64)
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
