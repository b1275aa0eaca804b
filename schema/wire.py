"""Encoding and decoding of data-plane messages (schema/phos.capnp).

A message is [Request or Reply frame, payload frame 1, payload frame 2, ...].
"""
import os
import struct

import capnp

capnp.remove_import_hook()
phos_capnp = capnp.load(os.path.join(os.path.dirname(__file__), "phos.capnp"))

PROTOCOL_VERSION = phos_capnp.protocolVersion
MAX_CONTROL_FRAME = 1 << 20          # a Request or Reply frame; bulk bytes go in payload frames
TRAVERSAL_LIMIT_WORDS = MAX_CONTROL_FRAME // 8 * 2

LAUNCH_CONFIG = struct.Struct("<8IQ")   # Launch.config: grid xyz, block xyz, shared bytes, 0, stream

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
