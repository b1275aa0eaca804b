"""The phos image format: a manifest plus content-addressed chunks, checked on read.

Layout in a store (see store.py):

- **Chunks.** A chunk's key is the hex of its pfp1 fingerprint (fingerprint.py). Its
  stored blob is a 40-byte little-endian header, then the payload (a restore checks every
  chunk's presence and header up front, check_chunks; its contents as it loads them):

      offset size field
      0      4    magic b"PHCK"
      4      2    chunk format version (1)
      6      2    compression: 0 = raw, 1 = zstd (one frame, content size in its header)
      8      8    raw length (bytes of the chunk's contents)
      16     8    stored length (bytes of payload after the header)
      24     16   fingerprint of the raw contents (equals the key)

  The writer stores raw bytes when zstd does not make them smaller. The reader checks
  every field, refuses a declared length over its limit before allocating anything,
  decompresses to at most the declared length, and re-fingerprints the result.

- **Manifests.** A Manifest message of schema/image.capnp: the image's objects, its
  session, and for each region the keys of its chunks (the schema says what each field holds).
  encode_manifest writes one from a dict of its fields (as the snapshot engine describes the
  context); decode_manifest reads one back into such a dict, and validate_manifest checks what
  the schema cannot say: the format and version, names and text lengths, ranges (a chunk size,
  a module's size), each region's chunk count for its size, ids unique per kind, the modules
  that functions and globals name, allocations that do not overlap, the session's digests.
  Version 1 was canonical JSON, which a reader refuses by name.

  `session` is the context the image was taken of, which a restore takes on: its id (ctx),
  the digest of its session token (token_digest) and the next handle it gives out (next_id).
  The snapshot engine always writes it, and restores only an image that has it; latest_image
  picks images by it.

  Beside it, its signature line: b"hmac-sha256:<hex>\\n", HMAC-SHA256 under the image key of
  the server that wrote it (image_key.py) of b"phos-manifest-v1" and the manifest's exact
  bytes. A restore checks it under its own server's key and refuses anything else, so a
  manifest edited by hand cannot be given a digest that passes. (b"blake2b-256:<hex>\\n", a
  plain BLAKE2b digest, person b"phos-manifest-v1": an unsigned image, as tools and tests write
  them without a key; servers never restore one.)

- **Deltas.** A handoff's last round sends its image to the warm target as a delta of the
  parent image the target holds, before the manifest is committed: an ImageDelta message of
  schema/image.capnp (encode_delta), which the control plane and the admin API carry as bytes
  to the worker that advances by it, which reads and checks it (read_delta). Its changes are
  the chunks whose keys differ from the parent's (or every chunk).

Every failure raises ImageError with a message naming the image, chunk or field.

Incremental images: chunks are shared by every image in a store, so ImageWriter stores
only chunks the store does not already hold. Deleting an image removes the chunks no
other manifest references (delete_image / gc).
"""
import collections
import hashlib
import hmac
import itertools
import json
import logging
import math
import re
import struct
import threading
import time

import numpy as np
import zstandard

from phos.schema import image_messages as messages
from phos.schema.wire import describe

from .fingerprint import fingerprint
from .image_key import image_key
from .store import DirStore, MemoryStore  # noqa: F401 (re-exported)
from .store import KEY_RE, ImageError, all_keys, check_key, check_name, keys_of

log = logging.getLogger("phos.snapshot")

FORMAT = messages.MANIFEST_FORMAT
VERSION = messages.MANIFEST_VERSION
DELTA_FORMAT = messages.DELTA_FORMAT
CHUNK_MAGIC = b"PHCK"
CHUNK_VERSION = 1
COMP_RAW = 0
COMP_ZSTD = 1
COMPRESSIONS = {COMP_RAW: "raw", COMP_ZSTD: "zstd"}
HEADER = struct.Struct("<4sHHQQ16s")
HEADER_SIZE = HEADER.size                 # 40

DEFAULT_CHUNK_SIZE = 2 << 20              # the VMM granularity on the H200
MAX_CHUNK_BYTES = 256 << 20               # largest chunk a reader accepts
MAX_MANIFEST_BYTES = 64 << 20
U64 = 1 << 64

DIGEST_PERSON = b"phos-manifest-v1"
DIGEST_PLAIN = b"blake2b-256"
DIGEST_KEYED = b"hmac-sha256"
_DIGEST_RE = re.compile(rb"(blake2b-256|hmac-sha256):([0-9a-f]{64})\n?")
# a chunk header's fields (HEADER) as an array type: a restore checks thousands at once
_HEADS = np.dtype([("magic", "S4"), ("version", "<u2"), ("comp", "<u2"), ("raw", "<u8"), ("stored", "<u8"),
                   ("fp", "u1", 16)])
# a chunk key as a version-1 manifest (JSON) quotes it: gc keeps the chunks of such images
_QUOTED_KEY_RE = re.compile(rb'"([0-9a-f]{32})"')
_HEX_RE = re.compile(r"(?:[0-9a-f]{2})*")
_TOKEN_RE = re.compile(r"[0-9a-f]{64}")


# ---------------------------------------------------------------------------------
# chunks

_tls = threading.local()


def _compressor(level):
    cache = getattr(_tls, "cctx", None)
    if cache is None:
        cache = _tls.cctx = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
    return c


def _decompressor():
    d = getattr(_tls, "dctx", None)
    if d is None:
        d = _tls.dctx = zstandard.ZstdDecompressor()
    return d


def encode_chunk(data, fp=None, level=1):
    """The stored blob of a chunk (header + payload) and its fingerprint."""
    parts, fp = encode_chunk_parts(data, fp, level)
    return b"".join(parts), fp


def chunk_header(comp, raw_len, stored_len, fp):
    """The 40-byte header a stored chunk starts with (HEADER: magic, version, compression, raw
    and stored lengths, fingerprint)."""
    return HEADER.pack(CHUNK_MAGIC, CHUNK_VERSION, comp, raw_len, stored_len, fp)


def encode_chunk_parts(data, fp=None, level=1):
    """Like encode_chunk, with the blob as (header, payload): big chunks are written without
    joining them into one more copy."""
    raw = memoryview(data).cast("B")
    if len(raw) > MAX_CHUNK_BYTES:
        raise ImageError(f"chunk of {len(raw)} bytes is over the limit of {MAX_CHUNK_BYTES}")
    if fp is None:
        fp = fingerprint(raw)
    comp, payload = COMP_RAW, raw
    if level is not None and len(raw) >= 64:
        z = _compressor(level).compress(raw)
        if len(z) < len(raw):
            comp, payload = COMP_ZSTD, z
    return (chunk_header(comp, len(raw), len(payload), fp), payload), fp


def _check_header(key, blob_len, head, expected_len, max_len):
    """A chunk blob's header fields, checked against its key and length: (compression, raw bytes)."""
    if blob_len < HEADER_SIZE:
        raise ImageError(f"chunk {key} is truncated: {blob_len} bytes, shorter than its {HEADER_SIZE}-byte header")
    magic, version, comp, raw_len, stored_len, fp = HEADER.unpack_from(head)
    if magic != CHUNK_MAGIC:
        # the file's own bytes are never quoted: a chunk may be anything someone put there
        raise ImageError(f"chunk {key} is not a phos chunk: it does not start with the magic {CHUNK_MAGIC!r}")
    if version != CHUNK_VERSION:
        raise ImageError(f"chunk {key} has unsupported chunk format version {version} "
                         f"(this reader supports {CHUNK_VERSION})")
    if comp not in COMPRESSIONS:
        raise ImageError(f"chunk {key} has unknown compression id {comp}")
    if fp.hex() != key:
        raise ImageError(f"chunk {key} header names fingerprint {fp.hex()}, not its key")
    if raw_len > max_len:
        raise ImageError(f"chunk {key} declares {raw_len} bytes, over the limit of {max_len}")
    if expected_len is not None and raw_len != expected_len:
        raise ImageError(f"chunk {key} holds {raw_len} bytes, expected {expected_len}")
    if stored_len != blob_len - HEADER_SIZE:
        what = "truncated" if blob_len - HEADER_SIZE < stored_len else "longer than its header says"
        raise ImageError(f"chunk {key} is {what}: header says {stored_len} payload bytes, found {blob_len - HEADER_SIZE}")
    if comp == COMP_RAW and stored_len != raw_len:
        raise ImageError(f"chunk {key} is stored raw but its header says {stored_len} stored and {raw_len} raw bytes")
    return comp, raw_len


def decode_chunk(blob, key, expected_len=None, max_len=MAX_CHUNK_BYTES, check=True, view=False):
    """The verified contents of a stored chunk blob; ImageError on any mismatch.

    check=False skips only the last step, fingerprinting the contents: for a caller that
    fingerprints them itself (the snapshot engine does it on the device after loading).
    view: a raw chunk's contents as a view of the blob, not bytes of their own (always where
    unchecked: the caller copies them on anyway)."""
    check_key(key)
    blob = memoryview(blob).cast("B")
    comp, raw_len = _check_header(key, len(blob), blob, expected_len, max_len)
    payload = blob[HEADER_SIZE:]
    if comp == COMP_RAW:
        data = payload if view or not check else bytes(payload)
    else:
        try:
            declared = zstandard.frame_content_size(payload)
        except zstandard.ZstdError as e:
            raise ImageError(f"chunk {key}: compressed payload is corrupt ({e})") from None
        if declared != raw_len:
            raise ImageError(f"chunk {key}: compressed frame declares {declared} bytes, header says {raw_len}")
        try:
            data = _decompressor().decompress(payload, max_output_size=raw_len, allow_extra_data=False)
        except zstandard.ZstdError as e:
            raise ImageError(f"chunk {key}: compressed payload is corrupt ({e})") from None
        if len(data) != raw_len:
            raise ImageError(f"chunk {key} decompressed to {len(data)} bytes, header says {raw_len}")
    found = fingerprint(data).hex() if check else key
    if found != key:
        raise ImageError(f"chunk {key} is corrupt: its contents fingerprint to {found}")
    return data


def check_chunks(store, keys, lengths):
    """(i, why) of the first chunk of `keys` that the store lacks or holds wrongly, or None:
    each must be there, a regular file of its own in a DirStore, with a header that fits its
    key and raw length (lengths[i]) and a blob of the length the header says. One stat and one
    header read a chunk file (a HostStore's headers: a few array steps); no contents are read:
    their fingerprints are checked as they load. Raises ImageError for a chunk that cannot be
    read at all (a link, a FIFO)."""
    if not len(keys):
        return None
    unique = list(dict.fromkeys(keys))          # a chunk of zeros may be thousands of a region's
    if len(unique) == len(keys):
        ix = slice(None)
    else:
        at = dict(zip(unique, range(len(unique))))
        ix = np.fromiter(map(at.__getitem__, keys), np.int64, len(keys))
    heads, blob_lens = store.heads(unique, HEADER_SIZE)
    blob_lens = np.asarray(blob_lens, np.int64)[ix]
    missing = np.flatnonzero(blob_lens < 0)
    if len(missing):
        return int(missing[0]), "is missing from the store"
    h = np.frombuffer(heads, _HEADS)[ix]
    fps = np.frombuffer(bytes.fromhex("".join(unique)), np.uint8).reshape(-1, 16)[ix]
    raw = h["raw"]
    ok = ((blob_lens >= HEADER_SIZE) & (h["magic"] == CHUNK_MAGIC) & (h["version"] == CHUNK_VERSION)
          & np.isin(h["comp"], list(COMPRESSIONS)) & (raw == np.asarray(lengths, np.uint64))
          & (h["stored"] == blob_lens.astype(np.uint64) - np.uint64(HEADER_SIZE))
          & ((h["comp"] != COMP_RAW) | (h["stored"] == raw)) & (h["fp"] == fps).all(axis=1))
    bad = np.flatnonzero(~ok)
    if not len(bad):
        return None
    i = int(bad[0])
    try:        # says what is wrong with it, as a read would
        _check_header(keys[i], int(blob_lens[i]), h[i:i + 1].tobytes(), int(lengths[i]), MAX_CHUNK_BYTES)
    except ImageError as e:
        return i, str(e).removeprefix(f"chunk {keys[i]} ")
    return i, "has a damaged header"


def read_chunk(store, key, expected_len=None, max_len=MAX_CHUNK_BYTES, check=True):
    """The verified contents of chunk `key` in `store` (check: see decode_chunk)."""
    check_key(key)
    return decode_chunk(store.get_chunk(key, max_bytes=HEADER_SIZE + max_len), key, expected_len, max_len, check)


def read_chunk_into(store, key, out, check=True):
    """Chunk `key`'s verified contents, read straight into `out`, a writable buffer of their
    length (a restore's pinned host buffer): a raw chunk is never held in between, which
    made reading cost three times the copy (check: see decode_chunk)."""
    check_key(key)
    out = memoryview(out).cast("B")
    head = bytearray(HEADER_SIZE)
    blob_len = store.get_chunk_into(key, head, out)
    comp, _ = _check_header(key, blob_len, head, len(out), MAX_CHUNK_BYTES)
    if comp != COMP_RAW:      # compressed: its payload landed in out, decode it whole
        out[:] = read_chunk(store, key, len(out), check=False)
    found = fingerprint(out).hex() if check else key
    if found != key:
        raise ImageError(f"chunk {key} is corrupt: its contents fingerprint to {found}")


def chunk_payload(store, key, expected_len):
    """A raw chunk's payload where the store keeps it, header checked, without copying it (a
    HostStore's shared memory: a restore copies it straight to the device); None when the
    store has no such place or the chunk is compressed. The caller checks the fingerprint."""
    got = store.source(key) if hasattr(store, "source") else None
    if got is None:
        return None
    header, payload, blob_len = got
    comp, _ = _check_header(key, blob_len, header, expected_len, MAX_CHUNK_BYTES)
    return payload if comp == COMP_RAW else None


def chunk_blob_parts(store, key):
    """A stored chunk blob as the buffers it lies in, (header, payload), without a copy where
    the store keeps it in memory (a HostStore's slots: a handoff sends them as they lie); else
    its bytes, read whole. Not checked: whoever receives them does."""
    got = store.source(key) if hasattr(store, "source") else None
    if got is None:
        return [store.get_chunk(key)]
    header, payload, _ = got
    return [header, payload]


def chunk_count(size, chunk_size):
    return -(-size // chunk_size) if size else 0


def chunk_lengths(size, chunk_size):
    """Lengths of a region's chunks: full chunks, then the remainder."""
    return [min(chunk_size, size - j * chunk_size) for j in range(chunk_count(size, chunk_size))]


def read_region(store, entry, max_len=MAX_CHUNK_BYTES):
    """The verified contents of an allocation or global entry of a Manifest, as a bytearray."""
    size, cs, keys = entry["size"], entry["chunk_size"], entry["chunks"]
    lengths = chunk_lengths(size, cs)
    if len(lengths) != len(keys):
        raise ImageError(f"region at {entry.get('address', 0):#x} has {len(keys)} chunks, expected {len(lengths)}")
    out = bytearray(size)
    for j, (k, n) in enumerate(zip(keys, lengths)):
        out[j * cs:j * cs + n] = read_chunk(store, k, expected_len=n, max_len=max_len)
    return out


# ---------------------------------------------------------------------------------
# manifests

def _signature(data, key):
    """The hex HMAC-SHA256 of a manifest's bytes under an image key."""
    if isinstance(key, str):
        key = key.encode()
    if not key:
        raise ImageError("the image key is empty")
    h = hmac.new(bytes(key), DIGEST_PERSON, hashlib.sha256)
    h.update(data)
    return h.hexdigest().encode()


def manifest_digest(data, key=None):
    """The line stored beside a manifest: its signature under key, or without one a plain digest
    (an unsigned image, which no server restores)."""
    if key is None:
        h = hashlib.blake2b(data, digest_size=32, person=DIGEST_PERSON)
        return DIGEST_PLAIN + b":" + h.hexdigest().encode() + b"\n"
    return DIGEST_KEYED + b":" + _signature(data, key) + b"\n"


def _check_digest(name, data, digest, key):
    """Check a manifest against its digest line. key: the image key it must be signed with (a
    server's restore), an unsigned one refused; None: a signed one is checked under this
    process's image key (image_key.py), an unsigned one against its plain digest (a tool that
    reads images). A failure never says what the signature should be: that would sign a forgery."""
    m = _DIGEST_RE.fullmatch(bytes(digest))
    if not m:
        raise ImageError(f"image {name!r}: digest file is malformed (not an algorithm and a hex digest)")
    if m.group(1) == DIGEST_KEYED:
        if not hmac.compare_digest(_signature(data, image_key() if key is None else key), m.group(2)):
            raise ImageError(f"image {name!r}: its manifest's signature does not match this server's image key "
                             "(manifest digest mismatch: the manifest was modified, or the key is wrong: the image "
                             "is signed with a server key other than this one)")
        return
    if key is not None:
        raise ImageError(f"image {name!r}: its manifest is not signed: refusing an unsigned manifest (this server "
                         "restores images signed with its image key only)")
    expected = manifest_digest(data).strip().split(b":")[1]
    if not hmac.compare_digest(expected, m.group(2)):
        raise ImageError(f"image {name!r}: manifest digest mismatch: the digest file says "
                         f"{m.group(2).decode()}, the manifest hashes to {expected.decode()} "
                         "(the manifest was modified or corrupted)")


class _Field:
    """How a field of a struct of schema/image.capnp reads in Python (see its annotations)."""

    def __init__(self, member, schema_field):
        self.member = member                               # the schema's name (camelCase)
        self.name = re.sub(r"[A-Z]", lambda c: "_" + c.group().lower(), member)
        self.kind = str(schema_field.proto.slot.type.which)       # uint64, text, data, struct, list, enum...
        marks = {a.id for a in schema_field.proto.annotations}
        self.optional = messages.ANNOTATIONS["optional"] in marks
        self.keys = messages.ANNOTATIONS["keys"] in marks
        self.inner = (schema_field.schema if self.kind in ("struct", "enum")
                      else schema_field.schema.elementType if self.kind == "list" else None)
        self.pair = None        # a $pair struct's (text, [its fields]): read as a two-item list
        if self.kind in ("struct", "list"):
            text = next((a.value.text for a in self.inner.node.annotations if a.id == messages.ANNOTATIONS["pair"]), None)
            if text is not None:
                self.pair = text, list(_fields(self.inner).values())
        self.pointer = self.kind in ("text", "data", "struct", "list")


_shapes = {}
_INT_RANGES = {f"{sign}int{bits}": (0, (1 << bits) - 1) if sign else (-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
               for sign in ("", "u") for bits in (8, 16, 32, 64)}


def _fields(schema):
    """{name in Python: _Field} of a struct of schema/image.capnp (made once a struct)."""
    shape = _shapes.get(schema.node.id)
    if shape is None:
        fields = [_Field(member, schema.fields[member]) for member in schema.fieldnames]
        shape = _shapes[schema.node.id] = {f.name: f for f in fields}
    return shape


def _at(path, name):
    return f"{path}.{name}" if path else name


def _write(builder, schema, value, path, fail):
    """Fill a struct's builder from a dict of its fields; fail(path, why) for what the schema
    cannot hold."""
    if not isinstance(value, dict):
        fail(path, f"expected an object, found {type(value).__name__}")
    fields = _fields(schema)
    for name in value:
        if name not in fields:
            fail(_at(path, name), "not a field of the image format")
    for f in fields.values():
        p = _at(path, f.name)
        if f.name not in value:
            if not f.optional:
                fail(p, "missing")
            continue
        v = value[f.name]
        if v is None and f.optional:
            continue
        if f.kind == "struct":
            (_write_pair if f.pair else _write)(builder.init(f.member), f.pair or f.inner, v, p, fail)
        elif f.kind == "list":
            if not isinstance(v, list):
                fail(p, f"expected a list, found {type(v).__name__}")
            for j, (item, e) in enumerate(zip(builder.init(f.member, len(v)), v)):
                (_write_pair if f.pair else _write)(item, f.pair or f.inner, e, f"{p}[{j}]", fail)
        else:
            setattr(builder, f.member, _scalar(f, v, p, fail))


def _write_pair(builder, pair, value, path, fail):
    text, fields = pair
    if (not isinstance(value, list) or len(value) != len(fields)
            or not all(isinstance(x, int) and not isinstance(x, bool) and _fits(f, x) for f, x in zip(fields, value))):
        fail(path, f"expected {text}, found {value!r:.80}")
    for f, x in zip(fields, value):
        setattr(builder, f.member, x)


def _fits(f, number):
    lo, hi = _INT_RANGES[f.kind]
    return lo <= number <= hi


def _scalar(f, v, path, fail):
    """The value a scalar, text or data field of the schema takes for v."""
    kind = f.kind
    if kind in _INT_RANGES:
        if not isinstance(v, int) or isinstance(v, bool):
            fail(path, f"expected an integer, found {type(v).__name__}")
        if not _fits(f, v):
            fail(path, f"{v} is out of range [{_INT_RANGES[kind][0]}, {_INT_RANGES[kind][1]}]")
        return v
    if kind in ("float32", "float64"):
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            fail(path, f"expected a number, found {type(v).__name__}")
        try:
            return float(v)
        except OverflowError:
            fail(path, f"{v} is out of range")
    if kind == "bool":
        if not isinstance(v, bool):
            fail(path, f"expected true or false, found {type(v).__name__}")
        return v
    if kind == "text":
        if not isinstance(v, str):
            fail(path, f"expected a string, found {type(v).__name__}")
        try:
            v.encode()
        except UnicodeEncodeError:
            fail(path, f"expected Unicode text, found {v!r:.80}")
        return v
    if kind == "enum":
        names = f.inner.enumerants
        if not isinstance(v, str) or v not in names:
            fail(path, f"expected one of {', '.join(names)}, found {v!r:.80}")
        return v
    if f.keys:
        if not isinstance(v, list):
            fail(path, f"expected a list, found {type(v).__name__}")
        if not all_keys(v):
            for j, k in enumerate(v):      # one is bad: name it
                if not isinstance(k, str) or not KEY_RE.fullmatch(k):
                    fail(f"{path}[{j}]", f"expected a chunk key (32 lowercase hex digits), found {k!r:.80}")
        return bytes.fromhex("".join(v))
    if not isinstance(v, str) or not _HEX_RE.fullmatch(v):
        fail(path, f"expected lowercase hex digits, found {v!r:.80}")
    return bytes.fromhex(v)


def _read(reader, schema):
    """A dict of a struct's fields, read from its message."""
    out = {}
    for f in _fields(schema).values():
        if f.optional and f.pointer and not reader._has(f.member):
            continue
        v = getattr(reader, f.member)
        if f.kind == "struct":
            v = [getattr(v, e.member) for e in f.pair[1]] if f.pair else _read(v, f.inner)
        elif f.kind == "list":
            v = [[getattr(e, x.member) for x in f.pair[1]] for e in v] if f.pair else [_read(e, f.inner) for e in v]
        elif f.kind == "data":
            v = keys_of(v) if f.keys else v.hex()
        elif f.kind == "enum":
            v = str(v)
        out[f.name] = v
    return out


def _open(message_type, raw):
    """A reader of a message of image.capnp, reading no more words than its bytes hold, twice
    over: a hostile message of a few bytes cannot make its reader walk millions."""
    return message_type.from_bytes(raw, traversal_limit_in_words=len(raw) // 4 + 64)


def _trailing(raw):
    """The bytes after the message that raw begins with (its segment table's sizes)."""
    count = int.from_bytes(raw[:4], "little") + 1
    table = (4 + 4 * count + 7) // 8 * 8
    if len(raw) < table:
        return 0
    return len(raw) - table - 8 * sum(struct.unpack_from(f"<{count}I", raw, 4))


def encode_manifest(m, name=None):
    """The bytes of the Manifest message (schema/image.capnp) of a manifest dict. ImageError
    names a field the schema cannot hold: missing, of another type or out of its type's range,
    or not one it has."""
    image = name if name is not None else (m.get("name") if isinstance(m, dict) else None)

    def fail(path, why):
        raise ImageError(f"image {image!r}: manifest field {path}: {why}")
    if not isinstance(m, dict):
        raise ImageError(f"image {image!r}: manifest is not an object")
    builder = messages.Manifest.new_message()
    _write(builder, messages.Manifest.schema, m, "", fail)
    return builder.to_bytes()


def decode_manifest(raw, name=None):
    """The fields of a Manifest message as a dict (the form encode_manifest takes), its format
    and version checked first (another version's fields may mean something else); ImageError
    for bytes that are no such message."""
    raw = bytes(raw)
    if raw[:1] == b"{":
        raise ImageError(f"image {name!r}: its manifest is canonical JSON, of image version 1: this reader reads "
                         f"version {VERSION} only (take the image again)")
    try:
        with _open(messages.Manifest, raw) as r:
            if r.format != FORMAT:
                raise ImageError(f"image {name!r}: not a phos image: format is {r.format!r:.80}, expected {FORMAT!r}")
            if r.version != VERSION:
                raise ImageError(f"image {name!r}: unsupported image version {r.version} "
                                 f"(this reader supports version {VERSION})")
            extra = _trailing(raw)
            if extra:
                raise ImageError(f"image {name!r}: manifest is not in canonical form: {extra} bytes follow its message "
                                 "(rewritten or hand-edited)")
            data = _read(r, messages.Manifest.schema)
    except ImageError:
        raise
    except Exception as e:         # what reading hostile bytes can raise: capnp checks them as it goes
        raise ImageError(f"image {name!r}: manifest is not a Manifest message ({describe(e)[:200]})") from None
    data.setdefault("parent", None)
    return data


def validate_manifest(m, name=None):
    """Check a manifest dict as a reader checks one: its schema's types (encode_manifest), then
    what the schema cannot say (_check_beyond_schema). ImageError on the first problem; returns m."""
    _check_beyond_schema(decode_manifest(encode_manifest(m, name), name), name)
    return m


def _check_beyond_schema(m, name=None):
    """The checks of a decoded manifest that its schema cannot say: ImageError naming the field."""
    image = name if name is not None else m["name"]

    def fail(path, why):
        raise ImageError(f"image {image!r}: manifest field {path}: {why}")

    def text(value, path, limit=4096):
        if len(value) > limit:
            fail(path, f"string of {len(value)} characters is over the limit of {limit}")

    def at_most(value, path, limit, least=0):
        if not least <= value <= limit:
            fail(path, f"{value} is out of range [{least}, {limit}]")

    text(m["name"], "name", 128)
    if name is not None and m["name"] != name:
        fail("name", f"the manifest is for image {m['name']!r}, stored as {name!r}")
    if m["parent"] is not None:
        text(m["parent"], "parent", 128)
    if not math.isfinite(m["created"]):
        fail("created", f"expected a timestamp, found {m['created']!r:.40}")
    text(m["backend"], "backend", 64)
    dev = m["device"]
    text(dev["name"], "device.name", 256)
    text(dev["uuid"], "device.uuid", 128)
    if not all(x < 1000 for x in dev["cc"]):
        fail("device.cc", f"expected [major, minor], found {dev['cc']!r:.80}")

    ids = {}

    def unique(kind, i, p):
        if (kind, i) in ids:
            fail(p, f"{kind} id {i} is used twice (also at {ids[(kind, i)]})")
        ids[(kind, i)] = p

    def region(e, p):
        size, cs, chunks = e["size"], e["chunk_size"], e["chunks"]
        at_most(cs, f"{p}.chunk_size", MAX_CHUNK_BYTES, 1)
        if e["address"] + size > U64:
            fail(f"{p}.size", f"region {e['address']:#x}+{size} runs past the 64-bit address space")
        want = chunk_count(size, cs)
        if len(chunks) != want:
            fail(f"{p}.chunks", f"{len(chunks)} chunks, expected {want} for {size} bytes in chunks of {cs}")
        if chunks and len(chunks[-1]) != 32:
            fail(f"{p}.chunks", "not 16-byte chunk fingerprints")

    def module_of(e, p):
        if e["module"] not in modules:
            fail(p + ".module", f"module {e['module']} is not in the image")

    modules = set()
    for j, e in enumerate(m["modules"]):
        p = f"modules[{j}]"
        unique("module", e["id"], p + ".id")
        modules.add(e["id"])
        text(e["name"], p + ".name")
        text(e["kind"], p + ".kind", 64)
        if not KEY_RE.fullmatch(e["image"]):
            fail(p + ".image", f"expected a chunk key (32 lowercase hex digits), found {e['image']!r:.80}")
        at_most(e["size"], p + ".size", MAX_CHUNK_BYTES)
    for j, e in enumerate(m["functions"]):
        p = f"functions[{j}]"
        unique("function", e["id"], p + ".id")
        module_of(e, p)
        text(e["name"], p + ".name")
    for j, e in enumerate(m["globals"]):
        p = f"globals[{j}]"
        module_of(e, p)
        text(e["name"], p + ".name")
        region(e, p)
    for kind in ("streams", "events"):
        for j, e in enumerate(m[kind]):
            unique(kind[:-1], e["id"], f"{kind}[{j}].id")
    spans = []
    for j, e in enumerate(m["allocations"]):
        p = f"allocations[{j}]"
        region(e, p)
        if e["size"]:
            spans.append((e["address"], e["address"] + e["size"], p))
    spans.sort()
    for (a0, a1, p0), (b0, b1, p1) in zip(spans, spans[1:]):
        if b0 < a1:
            fail(p1 + ".address", f"allocation {b0:#x}..{b1:#x} overlaps {p0} at {a0:#x}..{a1:#x}")
    text(m["error"]["message"], "error.message", 65536)
    if "session" in m:
        _check_session(m["session"], fail)


def _check_session(sess, fail):
    """A manifest's session: its digests 32 bytes each (a token's, a tenant's name)."""
    if not _TOKEN_RE.fullmatch(sess["token"]):
        fail("session.token", f"expected a token digest (64 lowercase hex digits), found {sess['token']!r:.80}")
    tenant = sess.get("tenant")
    if tenant is not None and not _TOKEN_RE.fullmatch(tenant):      # a digest too (tenant_name)
        fail("session.tenant", f"expected a tenant's name (64 lowercase hex digits), found {tenant!r:.80}")


class Manifest:
    """A verified manifest. Fields are attributes; to_dict() gives a copy of its dict of fields
    (decode_manifest), raw its message's bytes."""

    def __init__(self, data, raw=None):
        self._data = data
        self.raw = raw if raw is not None else encode_manifest(data)

    def __getattr__(self, field):
        try:
            return self.__dict__["_data"][field]
        except KeyError:
            raise AttributeError(field) from None

    def __getitem__(self, field):
        return self._data[field]

    def to_dict(self):
        return decode_manifest(self.raw)

    def to_json(self, indent=2):
        return json.dumps(self._data, sort_keys=True, indent=indent)

    def regions(self):
        """(kind, entry) for every allocation and global."""
        return [("allocation", e) for e in self._data["allocations"]] + \
               [("global", e) for e in self._data["globals"]]

    def chunk_refs(self):
        """[(key, where)] for every chunk the image references, with a readable location."""
        refs = [(e["image"], f"modules[{j}].image") for j, e in enumerate(self._data["modules"])]
        for kind in ("globals", "allocations"):
            for j, e in enumerate(self._data[kind]):
                refs.extend((k, f"{kind}[{j}].chunks[{c}] at {e['address'] + c * e['chunk_size']:#x}")
                            for c, k in enumerate(e["chunks"]))
        return refs

    def _keys(self):
        """Every chunk key the image references, modules' first, repeats and all."""
        d = self._data
        return itertools.chain((e["image"] for e in d["modules"]),
                               *(e["chunks"] for kind in ("globals", "allocations") for e in d[kind]))

    def chunk_keys(self):
        return set(self._keys())

    def chunk_lengths(self):
        """The raw length of each chunk, in _keys()' order (a region's last chunk may be short)."""
        d, parts = self._data, []
        parts.append(np.array([e["size"] for e in d["modules"]], np.int64))
        for kind in ("globals", "allocations"):
            for e in d[kind]:
                n, cs = len(e["chunks"]), e["chunk_size"]
                lens = np.full(n, cs, np.int64)
                if n:
                    lens[-1] = e["size"] - (n - 1) * cs
                parts.append(lens)
        return np.concatenate(parts)

    def bad_chunk(self, store, known=None):
        """ImageError's message for the first chunk that the store lacks or holds wrongly
        (check_chunks), or None. known: {key: raw length} of chunks the caller verified into
        the store itself, which are not looked at again where the image gives them that length."""
        keys, lengths = list(self._keys()), self.chunk_lengths()
        idx = np.arange(len(keys))
        if known:
            idx = np.fromiter((i for i, k in enumerate(keys) if known.get(k) != lengths[i]), np.int64)
        try:
            found = check_chunks(store, [keys[i] for i in idx], lengths[idx])
        except ImageError as e:
            return f"image {self.name!r}: {e}"
        if found is None:
            return None
        i, why = int(idx[found[0]]), found[1]
        return f"image {self.name!r}: chunk {keys[i]} ({self.chunk_refs()[i][1]}) {why}"

    def missing_chunk(self, store, present=frozenset()):
        """(key, where) of a chunk neither in `present` nor in the store, or None."""
        # a writer's `present` holds nearly all: no set of them all is built
        k = min(store.missing({k for k in self._keys() if k not in present}), default=None)
        return None if k is None else (k, next(where for key, where in self.chunk_refs() if key == k))

    @property
    def total_bytes(self):
        return sum(e["size"] for e in self._data["allocations"]) + sum(e["size"] for e in self._data["globals"])

    def __repr__(self):
        return (f"Manifest({self._data['name']!r}, {len(self._data['allocations'])} allocations, "
                f"{self.total_bytes} bytes)")


def read_image(store, name, key=None, check_chunks=True):
    """The verified Manifest of image `name`: format, version, signature (_check_digest: key),
    fields, and its chunks present with sound headers (check_chunks)."""
    check_name(name)
    raw, digest = store.get_manifest(name, max_bytes=MAX_MANIFEST_BYTES)
    _check_digest(name, raw, digest, key)
    return _verified(store, name, raw, check_chunks)


def read_latest_image(store, key=None):
    """The verified Manifest of latest_image(store), or None: each manifest is read once, and
    the chosen one's digest checked once (an on-demand restore's path, where reading it again
    took 3.2 ms at 32 GiB on the H200). Refuses the chosen one as read_image would, and, when
    none qualifies, says why the newest was refused (a store of images another key signed)."""
    refused = []
    found = _latest(store, key=key, refused=refused)        # its digest checked
    if found is None and refused:       # say why the newest could not be had, not merely that none could
        raise ImageError(refused[0])
    return None if found is None else _verified(store, found[0], found[1], True)


def _verified(store, name, raw, check_chunks):
    """The Manifest of a manifest whose digest was checked: parsed, validated, its chunks present."""
    data = decode_manifest(raw, name)
    _check_beyond_schema(data, name)
    man = Manifest(data, bytes(raw))
    if check_chunks:
        bad = man.bad_chunk(store)
        if bad:
            raise ImageError(bad)
    return man


def list_images(store):
    return store.list_images()


# ---------------------------------------------------------------------------------
# images received from another server (a handoff over the network)

def put_received_chunk(store, blob, landed=None):
    """Store a chunk blob another server sent (header + payload), verified first where it lies
    (a frame as it arrived: no copy): its key is its header's fingerprint, decode_chunk checks
    the header's fields and lengths, and the contents must fingerprint to the key. Returns 1 if
    the store lacked it, else 0; ImageError naming the chunk if it is bad. landed: a dict that
    gets {key: raw length} of each chunk verified here (put_received_manifest's known)."""
    blob = memoryview(blob).cast("B")
    if len(blob) < HEADER_SIZE:
        raise ImageError(f"a received chunk of {len(blob)} bytes is shorter than its {HEADER_SIZE}-byte header")
    key = bytes(HEADER.unpack_from(blob)[5]).hex()
    if store.has_chunk(key):
        return 0
    data = decode_chunk(blob, key, view=True)      # checked where it lies: the blob is stored as it came
    store.put_chunk(key, blob)
    if landed is not None:
        landed[key] = len(data)
    return 1


def put_received_manifest(store, name, raw, key=None, known=None):
    """Commit a manifest another server sent, signed with this server's image key (key: default
    image_key()) once it is checked as a restore checks one: its message, format, fields, and
    every chunk it names present in `store` with a sound header (the chunks' contents were checked
    as they landed, put_received_chunk). known: {key: raw length} of the chunks put_received_chunk
    verified into this store (its landed), which need no second look: a header read a chunk file
    costs ~40 ms a round of 4,096 chunks. The sender signed it with its own key, which this server
    need not share: the caller trusts the sender (an authenticated admin peer). Returns its Manifest."""
    check_name(name)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ImageError(f"image {name!r}: a manifest of {len(raw)} bytes is over the limit of {MAX_MANIFEST_BYTES}")
    raw = bytes(raw)
    man = _verified(store, name, raw, check_chunks=False)
    bad = man.bad_chunk(store, known)
    if bad:
        raise ImageError(bad)
    store.put_manifest(name, raw, manifest_digest(raw, image_key() if key is None else key))
    return man


# ---------------------------------------------------------------------------------
# writing

class ImageWriter:
    """Writes one image: add chunks, then commit the manifest.

    Chunks the store already holds are not written again, so an image taken after a
    previous one of the same context stores only what changed. The writer holds the
    store's shared session from creation to commit/abort, so garbage collection cannot
    remove a chunk it reuses. Use it as a context manager, or call commit() or abort().
    """

    def __init__(self, store, name, parent=None, key=None, level=1, known=()):
        """known: keys of the parent image's chunks, when the caller holds them (a worker that
        committed the parent): they are taken as present without asking the store, since
        the writer's session keeps garbage collection from removing a parent's chunks."""
        check_name(name)
        if parent is not None:
            check_name(parent)
        self._session = store.session()
        self._session.__enter__()          # first: gc cannot run between the checks below and our use
        self._open = True
        try:
            if parent is not None and not store.has_image(parent):
                raise ImageError(f"parent image {parent!r} is not in the store")
            if store.has_image(name):
                raise ImageError(f"image {name!r} already exists in the store")
        except BaseException:
            self.close()
            raise
        self.store, self.name, self.parent, self.key, self.level = store, name, parent, key, level
        self.new_chunks = self.reused_chunks = 0
        self.raw_bytes = self.stored_bytes = 0
        self._mu = threading.Lock()
        self.present = set(known) if parent is not None else set()     # keys the store is known to hold

    def _check_open(self):
        if not self._open:
            raise ImageError(f"image writer for {self.name!r} is closed")

    def add_chunk(self, data, fp=None):
        """Store one chunk (unless the store holds it already) and return its key.

        fp: its fingerprint when the caller computed it already (the snapshot engine
        fingerprints on the device); the reader checks it again on every read."""
        self._check_open()
        raw = memoryview(data).cast("B")
        fp = fingerprint(raw) if fp is None else bytes(fp)
        k = fp.hex()
        if self.reuse_chunk(k):
            return k
        parts, _ = encode_chunk_parts(raw, fp, self.level)
        self.store.put_chunk(k, parts)
        with self._mu:
            self.new_chunks += 1
            self.raw_bytes += len(raw)
            self.stored_bytes += sum(len(p) for p in parts)
            self.present.add(k)
        return k

    def add_slots(self, slots, payloads, fps):
        """Publish chunks the device copied straight into a HostStore's reserved slots (raw,
        fingerprinted on the device); returns their keys. Chunks the store held already
        free their slot."""
        self._check_open()
        fps = [bytes(fp) for fp in fps]
        keys = keys_of(b"".join(fps))
        lens = [len(p) for p in payloads]
        headers = [chunk_header(COMP_RAW, n, n, fp) for n, fp in zip(lens, fps)]
        new = self.store.publish(slots, keys, headers, lens)
        with self._mu:
            for k, n, fresh in zip(keys, lens, new):
                self.present.add(k)
                if fresh:
                    self.new_chunks += 1
                    self.raw_bytes += n
                    self.stored_bytes += HEADER_SIZE + n
                else:
                    self.reused_chunks += 1
        return keys

    def reuse_chunk(self, key):
        """True when the store already holds chunk `key` (e.g. a device-side fingerprint
        matched): the caller may then reference it without sending the bytes."""
        return self.reuse_chunks([key])[0]

    def reuse_chunks(self, keys):
        """reuse_chunk for many keys at once (a cut's thousands): [bool]."""
        self._check_open()
        present = self.present
        new = [k for k in keys if k not in present]
        lacking = self.store.missing(new)          # thousands at once
        found = [k not in lacking for k in keys] if lacking else [True] * len(keys)
        with self._mu:
            self.reused_chunks += sum(found)
            present.update(k for k in new if k not in lacking)
        return found

    def reuse_known(self, n):
        """Count n chunks the caller knows the store holds (its parent's, unchanged) as reused."""
        with self._mu:
            self.reused_chunks += n

    def add_region(self, data, chunk_size=DEFAULT_CHUNK_SIZE):
        """Split a buffer into chunks and add each; returns their keys."""
        mv = memoryview(data).cast("B")
        return [self.add_chunk(mv[o:o + chunk_size]) for o in range(0, len(mv), chunk_size)]

    def commit(self, manifest):
        """Complete, validate and store the manifest; returns the Manifest. One that cannot be
        committed (refused, or no room for its manifest) gives up the image (abort)."""
        self._check_open()
        committed = False
        try:
            m = dict(manifest)
            m.setdefault("format", FORMAT)
            m.setdefault("version", VERSION)
            m.setdefault("name", self.name)
            m.setdefault("parent", self.parent)
            m.setdefault("created", time.time())
            m.setdefault("cut_seq", 0)
            for f in ("modules", "functions", "globals", "streams", "events", "allocations"):
                m.setdefault(f, [])
            m.setdefault("error", {"status": 0, "message": ""})
            m.setdefault("metadata", {})
            if m["parent"] != self.parent:
                raise ImageError(f"image {self.name!r}: manifest names parent {m['parent']!r}, "
                                 f"the writer {self.parent!r}")
            raw = encode_manifest(m, self.name)
            if len(raw) > MAX_MANIFEST_BYTES:
                raise ImageError(f"image {self.name!r}: manifest of {len(raw)} bytes is over the limit")
            data = decode_manifest(raw, self.name)      # as a restore will read it
            _check_beyond_schema(data, self.name)
            man = Manifest(data, raw)
            missing = man.missing_chunk(self.store, self.present)
            if missing:
                raise ImageError(f"image {self.name!r}: chunk {missing[0]} ({missing[1]}) was never added to the store")
            self.store.put_new_manifest(self.name, raw, manifest_digest(raw, self.key))
            committed = True
            return man
        finally:
            if committed:
                self.close()
            else:
                self.abort()

    def close(self):
        if self._open:
            self._open = False
            self._session.__exit__(None, None, None)

    def abort(self):
        """Give up the image: what it stored goes at once (garbage collection, when no other
        writer is active), not at the next deletion. A checkpoint that failed for want of room
        (ENOSPC) kept its chunks, and the room, until then."""
        self.close()
        try:
            gc(self.store)
        except (ImageError, OSError) as e:      # an unreadable manifest keeps every chunk: the next deletion tries again
            log.info("image %r given up: its chunks stay until a later collection (%s)", self.name, e)

    def stats(self):
        return {"new_chunks": self.new_chunks, "reused_chunks": self.reused_chunks,
                "raw_bytes": self.raw_bytes, "stored_bytes": self.stored_bytes}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ---------------------------------------------------------------------------------
# deleting

def referenced_chunks(store):
    """Every chunk key the manifests in the store name (named_chunks).

    Raises ImageError when a manifest cannot be read, so that gc never frees chunks an
    unreadable image may need.
    """
    refs = set()
    for name in store.list_images():
        raw, _ = store.get_manifest(name, max_bytes=MAX_MANIFEST_BYTES)
        refs.update(named_chunks(bytes(raw)))
    return refs


def named_chunks(raw):
    """The chunk keys a manifest's bytes name, read as far as they can be and unchecked: its
    modules' and regions' (a message damaged past them names no more: no restore could read it
    either); of a version-1 manifest (JSON), any quoted key, so that its chunks stay for a reader
    of that version."""
    if raw[:1] == b"{":
        return {m.decode() for m in _QUOTED_KEY_RE.findall(raw)}
    keys = set()
    try:
        with _open(messages.Manifest, raw) as r:
            keys.update(e.image.hex() for e in r.modules)
            for e in itertools.chain(r.globals, r.allocations):
                keys.update(keys_of(e.chunks))
    except Exception:       # what reading hostile bytes can raise (decode_manifest)
        pass
    return keys


def gc(store):
    """Delete chunks no manifest references. Returns (chunks, bytes) freed, or None when a
    writer or reader session is active (try again later)."""
    with store.try_gc_lock() as ok:
        if not ok:
            return None
        refs = referenced_chunks(store)
        before = store.stats()["chunk_bytes"]
        freed = 0
        for k in store.list_chunks():
            if k not in refs:
                store.delete_chunk(k)
                freed += 1
        if hasattr(store, "reclaim"):      # a HostStore: slots a writer that died had reserved
            store.reclaim()
        if hasattr(store, "remove_leftovers"):     # the temporary files of writers that died
            store.remove_leftovers()
        return freed, before - store.stats()["chunk_bytes"]


def token_digest(token):
    """What an image keeps of a session token: enough to check a re-attach, useless to attach."""
    return hashlib.blake2b(bytes(token), digest_size=32, person=b"phos-session-v1").hexdigest()


def check_token(token, digest):
    return hmac.compare_digest(token_digest(token), digest)


# ---------------------------------------------------------------------------------
# deltas

# A delta's fields, read from its message (read_delta); changes: [(region address, chunk index
# in that region, chunk key)].
Delta = collections.namedtuple("Delta", "name parent cut_seq objects next_id error changes")


def encode_delta(name, parent, cut_seq, objects, next_id, error, changes):
    """The bytes of the ImageDelta message (schema/image.capnp) of image `name`: changes are
    [region address, chunk index in it, chunk key] of the chunks whose keys are not the parent's."""
    d = messages.ImageDelta.new_message(format=DELTA_FORMAT, name=name, cutSeq=cut_seq, objects=objects, nextId=next_id)
    if parent is not None:
        d.parent = parent
    d.error.status, d.error.message = int(error["status"]), error["message"]
    for c, (address, index, key) in zip(d.init("changes", len(changes)), changes):
        c.address, c.index, c.key = address, index, bytes.fromhex(key)
    return d.to_bytes()


def read_delta(blob, name):
    """The Delta of an ImageDelta message of image `name`, checked: ImageError for bytes that
    are no such message, or a delta of another image. (Whether it moves on from the image a
    restore holds is the restore's to check.)"""
    def bad(why):
        raise ImageError(f"delta of image {name!r}: {why}")
    try:
        with _open(messages.ImageDelta, bytes(blob)) as d:
            if d.format != DELTA_FORMAT or d.name != name:
                bad(f"not a {DELTA_FORMAT} delta of that image")
            changes = [(c.address, c.index, c.key) for c in d.changes]
            delta = Delta(name, d.parent or None, d.cutSeq, d.objects, d.nextId,
                          {"status": d.error.status, "message": d.error.message}, changes)
    except ImageError:
        raise
    except Exception as e:         # what reading hostile bytes can raise (decode_manifest)
        raise ImageError(f"delta of image {name!r} is not an ImageDelta message ({describe(e)[:200]})") from None
    if not all(len(key) == 16 for _, _, key in changes):
        bad("changes are not [region address, chunk index, chunk key] triples")
    if not delta.objects:
        bad("it names no objects")
    return delta._replace(changes=[(address, j, key.hex()) for address, j, key in changes])


def latest_image(store, ctx=None, token=None, key=None):
    """The name of the newest readable, consistent image in a store (of context ctx, and whose
    session token is `token`, if given), or None. A handoff's pre-copy round is consistent in
    its objects only: never anybody's latest. key: the image key a restore will check it with
    (_check_digest): an image it would refuse, unsigned or forged, is passed over for an
    older good one."""
    found = _latest(store, ctx, token, key)
    return None if found is None else found[0]


def _latest(store, ctx=None, token=None, key=None, refused=None):
    """latest_image's (name, manifest bytes, digest bytes); its digest checked with key.
    refused: a list that gets why each image newer than the one found was refused."""
    # Newest first by a glance at each message, then its digest checked until one qualifies. The
    # full check is left to whoever restores it (Restore reads it anyway): parsing and checking
    # a 32 GiB context's manifest costs the front end 3.2-4.3 ms of an on-demand restore on the H200.
    dated = []
    for name in store.list_images():
        try:
            raw, digest = store.get_manifest(name, max_bytes=MAX_MANIFEST_BYTES)
            dated.append((_created(raw), name, raw, digest))
        except Exception:       # an unreadable image is never anybody's latest
            continue
    for _, name, raw, digest in sorted(dated, key=lambda d: d[:2], reverse=True):
        try:
            _check_digest(name, raw, digest, key)
            mode, session = _glance(raw, name)
        except Exception as e:
            if refused is not None:
                refused.append(str(e))
            continue
        if mode == "precopy":
            continue
        if ctx is not None and session.get("ctx") != ctx:
            continue
        if token is not None and not check_token(token, session.get("token", "")):
            continue
        return name, raw, digest
    return None


def _glance(raw, name=None):
    """(metadata mode, session) of a manifest, its session checked as validate_manifest checks
    it (ImageError): read from its message alone, not the thousands of chunk keys beside them."""
    def fail(path, why):
        raise ImageError(f"image {name!r}: manifest field {path}: {why}")
    try:
        with _open(messages.Manifest, raw) as r:
            mode = str(r.metadata.mode)
            session = _read(r.session, _fields(messages.Manifest.schema)["session"].inner) if r._has("session") else {}
    except Exception as e:         # what reading hostile bytes can raise (decode_manifest)
        raise ImageError(f"image {name!r}: manifest is not a Manifest message ({describe(e)[:200]})") from None
    if session:
        _check_session(session, fail)
    return mode, session


def _created(raw):
    """A manifest's `created` time, read from its message alone."""
    with _open(messages.Manifest, raw) as r:
        return r.created


def delete_image(store, name, key=None, verify=False):
    """Remove an image and the chunks that no other image references.

    Returns gc's result. With verify, the image is read (and checked) first, so that only
    a genuine image is deleted. Images whose parent is `name` keep working: they list
    all their chunks themselves.
    """
    check_name(name)
    if verify:
        read_image(store, name, key=key, check_chunks=False)
    store.delete_image(name)
    return gc(store)
