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

- **Manifests.** Canonical JSON (sorted keys, no whitespace, ASCII, no NaN) of:

      {"format": "phos-image", "version": 1, "name": str, "parent": str | null,
       "created": unix time, "cut_seq": int, "backend": "cuda" | "emu" | ...,
       "device": {"name", "uuid" (hex), "cc": [major, minor], "total_mem"},
       "address_space": {"base", "size"}                      (optional)
       "modules":     [{"id", "name", "kind", "image": key, "size"}],
       "functions":   [{"id", "module", "name", "params": [[offset, size], ...],
                        "attributes"?: [[CUfunction_attribute, value], ...] (what the application set)}],
       "globals":     [{"module", "name", "address", "size", "chunk_size", "chunks": [key],
                        "device" (optional: where the device had it, when not at address)}],
       "streams":     [{"id", "flags", "priority"}],
       "events":      [{"id", "flags"}],
       "allocations": [{"address", "size", "chunk_size", "chunks": [key]}],
       "error":       {"status", "message"},
       "session":     {"ctx", "token", "next_id",
                       "limits"?: [[CUlimit, value], ...] (what the application set),
                       "reserved"?: [[base, length], ...] (cuMemAddressReserve's ranges;
                                    the allocations mapped in them are among "allocations"),
                       "tenant"?: the name of the tenant whose quota its memory counts against
                                  (PHOS_TENANT_QUOTA: 64 lowercase hex digits, a digest)}
                                                                  (optional)
       "metadata":    {...}    e.g. {"mode": "concurrent", "paused": false, "pause_ms": 0.4,
                                      "recopied_chunks": 0}}

  `session` is the context the image was taken of, which a restore takes on: its id (ctx),
  the digest of its session token (token: 64 lowercase hex digits, token_digest) and the
  next handle it gives out (next_id). The snapshot engine always writes it, and restores
  only an image that has it; latest_image picks images by it.

  A region (allocation or global) of `size` bytes has ceil(size / chunk_size) chunks;
  chunk j holds bytes [j*chunk_size, min(size, (j+1)*chunk_size)). Entries may carry
  extra fields; the ones above are required and type-checked.

  Beside it, its signature line: b"hmac-sha256:<hex>\\n", HMAC-SHA256 under the image key of
  the server that wrote it (image_key.py) of b"phos-manifest-v1" and the manifest's exact
  bytes. A restore checks it under its own server's key and refuses anything else, so a
  manifest edited by hand cannot be given a digest that passes. (b"blake2b-256:<hex>\\n", a
  plain BLAKE2b digest, person b"phos-manifest-v1": an unsigned image, as tools and tests write
  them without a key; servers never restore one.)

- **Deltas.** A handoff's last round sends its image to the warm target as a delta of the
  parent image the target holds, before the manifest is committed (encode_delta; checked by
  validate_delta, or decode_delta from its JSON text). A JSON object:

      {"format": "phos-delta-2", "name": str, "parent": str | null, "cut_seq": int,
       "objects": str      (a digest of the image's objects: snapshot/engine.py objects_digest),
       "next_id": int      (the session's, as in the manifest),
       "error":   {"status", "message"},
       "changes": [[region address, chunk index in that region, chunk key], ...]}

  changes lists the chunks whose keys differ from the parent's (or every chunk).

Every failure raises ImageError with a message naming the image, chunk or field.

Incremental images: chunks are shared by every image in a store, so ImageWriter stores
only chunks the store does not already hold. Deleting an image removes the chunks no
other manifest references (delete_image / gc).
"""
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

from .fingerprint import fingerprint
from .image_key import image_key
from .store import DirStore, ImageError, MemoryStore, all_keys, check_key, check_name, keys_of  # noqa: F401 (re-exported)

log = logging.getLogger("phos.snapshot")

FORMAT = "phos-image"
VERSION = 1
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
MAX_JSON_DEPTH = 32
U64 = 1 << 64

DIGEST_PERSON = b"phos-manifest-v1"
DIGEST_PLAIN = b"blake2b-256"
DIGEST_KEYED = b"hmac-sha256"
_DIGEST_RE = re.compile(rb"(blake2b-256|hmac-sha256):([0-9a-f]{64})\n?")
# a chunk header's fields (HEADER) as an array type: a restore checks thousands at once
_HEADS = np.dtype([("magic", "S4"), ("version", "<u2"), ("comp", "<u2"), ("raw", "<u8"), ("stored", "<u8"),
                   ("fp", "u1", 16)])
_QUOTED_KEY_RE = re.compile(rb'"([0-9a-f]{32})"')
_HEX_RE = re.compile(r"(?:[0-9a-f]{2}){0,64}")
_CONTAINERS = itertools.repeat((dict, list))
_TOKEN_RE = re.compile(r"[0-9a-f]{64}")
DELTA_FORMAT = "phos-delta-2"
# A manifest's "created" key, metadata mode and session key, as canonical JSON writes them (for
# latest_image's glance): a quote inside a string is escaped (\"), so only keys match.
_CREATED_RE = re.compile(rb'"created":(-?[0-9][0-9.eE+-]*)[,}]')
_MODE_RE = re.compile(rb'"mode":"([a-z]*)"')
_SESSION_KEY = b'"session":'


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

def canonical_json(obj):
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                          allow_nan=False).encode("ascii")
    except (TypeError, ValueError) as e:
        raise ImageError(f"manifest cannot be written as canonical JSON: {e}") from None


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


def _depth_ok(obj, limit=MAX_JSON_DEPTH):
    """No value nests deeper than limit (the top object is at depth 0). Walks containers
    level by level; a list holding no container (thousands of chunk keys) is passed over
    by one scan in C."""
    level, depth = [obj] if isinstance(obj, (dict, list)) else [], 0
    while level:
        nested = []
        for o in level:
            values = o.values() if isinstance(o, dict) else o
            if depth >= limit and len(values):
                return False
            if not any(map(isinstance, values, _CONTAINERS)):
                continue
            nested.extend(v for v in values if isinstance(v, (dict, list)))
        level, depth = nested, depth + 1
    return True


class _V:
    """Field checks that raise ImageError naming the field's path."""

    def __init__(self, image):
        self.image = image

    def fail(self, path, msg):
        raise ImageError(f"image {self.image!r}: manifest field {path}: {msg}")

    def get(self, obj, field, path, optional=False):
        if not isinstance(obj, dict):
            self.fail(path, f"expected an object, found {type(obj).__name__}")
        if field not in obj:
            if optional:
                return None
            self.fail(f"{path}.{field}" if path else field, "missing")
        return obj[field]

    def int(self, obj, field, path, lo=0, hi=U64 - 1, optional=False):
        p = f"{path}.{field}" if path else field
        v = self.get(obj, field, path, optional)
        if v is None and optional:
            return None
        if not isinstance(v, int) or isinstance(v, bool):
            self.fail(p, f"expected an integer, found {type(v).__name__}")
        if not lo <= v <= hi:
            self.fail(p, f"{v} is out of range [{lo}, {hi}]")
        return v

    def str(self, obj, field, path, optional=False, maxlen=4096):
        p = f"{path}.{field}" if path else field
        v = self.get(obj, field, path, optional)
        if v is None and optional:
            return None
        if not isinstance(v, str):
            self.fail(p, f"expected a string, found {type(v).__name__}")
        if len(v) > maxlen:
            self.fail(p, f"string of {len(v)} characters is over the limit of {maxlen}")
        return v

    def key(self, v, path):
        if not isinstance(v, str) or len(v) != 32 or not re.fullmatch(r"[0-9a-f]{32}", v):
            self.fail(path, f"expected a chunk key (32 lowercase hex digits), found {v!r:.80}")
        return v

    def list(self, obj, field, path):
        p = f"{path}.{field}" if path else field
        v = self.get(obj, field, path)
        if not isinstance(v, list):
            self.fail(p, f"expected a list, found {type(v).__name__}")
        return v

    def obj(self, obj, field, path, optional=False):
        p = f"{path}.{field}" if path else field
        v = self.get(obj, field, path, optional)
        if v is None and optional:
            return None
        if not isinstance(v, dict):
            self.fail(p, f"expected an object, found {type(v).__name__}")
        return v

    def session(self, m):
        """The manifest's session, if it has one, checked; None if not."""
        sess = self.obj(m, "session", "", optional=True)
        if sess is not None:
            self.int(sess, "ctx", "session")
            token = self.str(sess, "token", "session", maxlen=64)
            if not _TOKEN_RE.fullmatch(token):
                self.fail("session.token", f"expected a token digest (64 lowercase hex digits), found {token!r:.80}")
            self.int(sess, "next_id", "session")
            tenant = self.str(sess, "tenant", "session", optional=True, maxlen=64)
            if tenant is not None and not _TOKEN_RE.fullmatch(tenant):      # a digest too (tenant_name)
                self.fail("session.tenant", f"expected a tenant's name (64 lowercase hex digits), found {tenant!r:.80}")
            for field, what in (("limits", "[CUlimit, value]"), ("reserved", "[base, length]")):
                pairs = sess.get(field, [])
                for k, pair in enumerate(pairs if isinstance(pairs, list) else [None]):
                    if (not isinstance(pair, list) or len(pair) != 2
                            or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < U64 for x in pair)):
                        self.fail(f"session.{field}[{k}]", f"expected {what}, found {pair!r:.80}")
        return sess

    def region(self, e, p):
        self.int(e, "address", p)
        size = self.int(e, "size", p)
        cs = self.int(e, "chunk_size", p, lo=1, hi=MAX_CHUNK_BYTES)
        if e["address"] + size > U64:
            self.fail(f"{p}.size", f"region {e['address']:#x}+{size} runs past the 64-bit address space")
        chunks = self.list(e, "chunks", p)
        want = chunk_count(size, cs)
        if len(chunks) != want:
            self.fail(f"{p}.chunks", f"{len(chunks)} chunks, expected {want} for {size} bytes in "
                                     f"chunks of {cs}")
        if not all_keys(chunks):
            for j, k in enumerate(chunks):      # one is bad: name it
                self.key(k, f"{p}.chunks[{j}]")


def validate_manifest(m, name=None, depth_checked=False):
    """Check a manifest dict's structure, types and consistency; ImageError on the first problem.
    depth_checked: the caller has checked its nesting (_parse_manifest does, before anything else)."""
    v = _V(name if name is not None else (m.get("name") if isinstance(m, dict) else None))
    if not isinstance(m, dict):
        raise ImageError(f"image {v.image!r}: manifest is not a JSON object")
    if m.get("format") != FORMAT:
        raise ImageError(f"image {v.image!r}: not a phos image: format is {m.get('format')!r:.80}, "
                         f"expected {FORMAT!r}")
    ver = m.get("version")
    if ver != VERSION:
        raise ImageError(f"image {v.image!r}: unsupported image version {ver!r:.40} "
                         f"(this reader supports version {VERSION})")
    mname = v.str(m, "name", "", maxlen=128)
    if name is not None and mname != name:
        v.fail("name", f"the manifest is for image {mname!r}, stored as {name!r}")
    parent = m.get("parent")
    if "parent" not in m:
        v.fail("parent", "missing")
    if parent is not None:
        v.str(m, "parent", "", maxlen=128)
    created = v.get(m, "created", "")
    if not isinstance(created, (int, float)) or isinstance(created, bool) or not math.isfinite(created):
        v.fail("created", f"expected a timestamp, found {created!r:.40}")
    v.int(m, "cut_seq", "")
    v.str(m, "backend", "", maxlen=64)

    dev = v.obj(m, "device", "")
    v.str(dev, "name", "device", maxlen=256)
    uuid = v.str(dev, "uuid", "device", maxlen=128)
    if not _HEX_RE.fullmatch(uuid):
        v.fail("device.uuid", f"expected lowercase hex, found {uuid!r:.80}")
    cc = v.get(dev, "cc", "device")
    if (not isinstance(cc, list) or len(cc) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1000 for x in cc)):
        v.fail("device.cc", f"expected [major, minor], found {cc!r:.80}")
    v.int(dev, "total_mem", "device")

    aspace = v.obj(m, "address_space", "", optional=True)
    if aspace is not None:
        v.int(aspace, "base", "address_space")
        v.int(aspace, "size", "address_space")

    ids = {}

    def unique(kind, i, p):
        if (kind, i) in ids:
            v.fail(p, f"{kind} id {i} is used twice (also at {ids[(kind, i)]})")
        ids[(kind, i)] = p

    modules = set()
    for j, e in enumerate(v.list(m, "modules", "")):
        p = f"modules[{j}]"
        i = v.int(e, "id", p)
        unique("module", i, p + ".id")
        modules.add(i)
        v.str(e, "name", p)
        v.str(e, "kind", p, maxlen=64)
        v.key(v.get(e, "image", p), p + ".image")
        v.int(e, "size", p, hi=MAX_CHUNK_BYTES)
    for j, e in enumerate(v.list(m, "functions", "")):
        p = f"functions[{j}]"
        unique("function", v.int(e, "id", p), p + ".id")
        mod = v.int(e, "module", p)
        if mod not in modules:
            v.fail(p + ".module", f"module {mod} is not in the image")
        v.str(e, "name", p)
        params = v.list(e, "params", p)
        for k, pr in enumerate(params):
            if (not isinstance(pr, list) or len(pr) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < (1 << 32) for x in pr)):
                v.fail(f"{p}.params[{k}]", f"expected [offset, size], found {pr!r:.80}")
        for k, at in enumerate(e.get("attributes", []) if isinstance(e.get("attributes", []), list) else [None]):
            if (not isinstance(at, list) or len(at) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) and -(1 << 31) <= x < (1 << 31) for x in at)):
                v.fail(f"{p}.attributes[{k}]", f"expected [attribute, value], found {at!r:.80}")
    for j, e in enumerate(v.list(m, "globals", "")):
        p = f"globals[{j}]"
        mod = v.int(e, "module", p)
        if mod not in modules:
            v.fail(p + ".module", f"module {mod} is not in the image")
        v.str(e, "name", p)
        v.region(e, p)
        v.int(e, "device", p, optional=True)
    for j, e in enumerate(v.list(m, "streams", "")):
        p = f"streams[{j}]"
        unique("stream", v.int(e, "id", p), p + ".id")
        v.int(e, "flags", p, hi=(1 << 32) - 1)
        v.int(e, "priority", p, lo=-(1 << 31), hi=(1 << 31) - 1)
    for j, e in enumerate(v.list(m, "events", "")):
        p = f"events[{j}]"
        unique("event", v.int(e, "id", p), p + ".id")
        v.int(e, "flags", p, hi=(1 << 32) - 1)
    spans = []
    for j, e in enumerate(v.list(m, "allocations", "")):
        p = f"allocations[{j}]"
        v.region(e, p)
        if e["size"]:
            spans.append((e["address"], e["address"] + e["size"], p))
    spans.sort()
    for (a0, a1, p0), (b0, b1, p1) in zip(spans, spans[1:]):
        if b0 < a1:
            v.fail(p1 + ".address", f"allocation {b0:#x}..{b1:#x} overlaps {p0} at {a0:#x}..{a1:#x}")

    err = v.obj(m, "error", "")
    v.int(err, "status", "error", lo=-(1 << 63), hi=U64 - 1)
    v.str(err, "message", "error", maxlen=65536)
    v.session(m)
    v.obj(m, "metadata", "")
    if not depth_checked and not _depth_ok(m):
        raise ImageError(f"image {v.image!r}: manifest nests deeper than {MAX_JSON_DEPTH} levels")
    return m


class Manifest:
    """A verified manifest. Fields are attributes; to_dict() gives the JSON object."""

    def __init__(self, data, raw=None):
        self._data = data
        self.raw = raw if raw is not None else canonical_json(data)

    def __getattr__(self, field):
        try:
            return self.__dict__["_data"][field]
        except KeyError:
            raise AttributeError(field) from None

    def __getitem__(self, field):
        return self._data[field]

    def to_dict(self):
        return json.loads(self.raw)

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


def _parse_manifest(name, raw):
    def no_constants(c):
        raise ValueError(f"{c} is not allowed")
    try:
        text = bytes(raw).decode("ascii")
        data = json.loads(text, parse_constant=no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ImageError(f"image {name!r}: manifest is not valid JSON ({str(e)[:200]})") from None
    if isinstance(data, dict) and (data.get("format") != FORMAT or data.get("version") != VERSION):
        validate_manifest(data, name)        # raises the format/version error
    if not _depth_ok(data):
        raise ImageError(f"image {name!r}: manifest nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        canon = canonical_json(data)
    except ImageError:
        canon = None
    if canon != bytes(raw):
        raise ImageError(f"image {name!r}: manifest is not in canonical form (rewritten or hand-edited)")
    return data


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
    data = _parse_manifest(name, raw)
    validate_manifest(data, name, depth_checked=True)
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
    image_key()) once it is checked as a restore checks one: canonical JSON, format, fields, and
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
            validate_manifest(m, self.name)
            raw = canonical_json(m)
            if len(raw) > MAX_MANIFEST_BYTES:
                raise ImageError(f"image {self.name!r}: manifest of {len(raw)} bytes is over the limit")
            man = Manifest(json.loads(raw), raw)
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
    """Every chunk key any manifest in the store mentions (conservative: any quoted key).

    Raises ImageError when a manifest cannot be read, so that gc never frees chunks an
    unreadable image may need.
    """
    refs = set()
    for name in store.list_images():
        raw, _ = store.get_manifest(name, max_bytes=MAX_MANIFEST_BYTES)
        refs.update(m.decode() for m in _QUOTED_KEY_RE.findall(bytes(raw)))
    return refs


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

def encode_delta(name, parent, cut_seq, objects, next_id, error, changes):
    """A delta (see the module docstring) of image `name`, as a JSON-ready dict."""
    return {"format": DELTA_FORMAT, "name": name, "parent": parent, "cut_seq": cut_seq, "objects": objects,
            "next_id": next_id, "error": error, "changes": changes}


def validate_delta(d, name):
    """Check a delta of image `name`: its format, fields and types; ImageError on the first
    problem. Returns it. (Whether it moves on from the image a restore holds is the restore's
    to check.)"""
    def bad(why):
        raise ImageError(f"delta of image {name!r}: {why}")
    if not isinstance(d, dict) or d.get("format") != DELTA_FORMAT or d.get("name") != name:
        bad(f"not a {DELTA_FORMAT} delta of that image")
    if d.get("parent") is not None and not isinstance(d["parent"], str):
        bad("parent is not an image name")
    for field in ("cut_seq", "next_id"):
        if not isinstance(d.get(field), int) or isinstance(d[field], bool) or not 0 <= d[field] < U64:
            bad(f"{field} is not a count")
    error = d.get("error")
    if not isinstance(error, dict) or not isinstance(error.get("status"), int) or not isinstance(error.get("message"), str):
        bad("error is not {status, message}")
    changes = d.get("changes")
    if not isinstance(changes, list) or not all(
            isinstance(c, list) and len(c) == 3 and type(c[0]) is int and type(c[1]) is int for c in changes) \
            or not all_keys([c[2] for c in changes]):
        bad("changes are not [region address, chunk index, chunk key] triples")
    if not isinstance(d.get("objects"), str):
        bad("it names no objects")
    return d


def decode_delta(text, name):
    """The checked delta of image `name` from its JSON text (validate_delta)."""
    try:
        d = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ImageError(f"delta of image {name!r} is not JSON: {str(e)[:200]}") from None
    return validate_delta(d, name)


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
    # Newest first by a glance at the text, then its digest checked until one qualifies. The
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
    it (ImageError). Found in its text without parsing it all, the session's object read as
    JSON where its key is; the whole is parsed when the text does not hold the mode and the
    session each exactly once in the form a writer gives them."""
    modes, at = _MODE_RE.findall(raw), raw.find(_SESSION_KEY)
    if len(modes) == 1 and at >= 0 and raw.find(_SESSION_KEY, at + 1) < 0:
        start = at + len(_SESSION_KEY)
        end = raw.find(b"}", start) + 1          # a writer's session holds no nested object
        try:
            session = json.loads(raw[start:end]) if end else None
        except ValueError:
            session = None
        if isinstance(session, dict):
            _V(name).session({"session": session})
            return modes[0].decode(), session
    data = json.loads(raw)
    return data.get("metadata", {}).get("mode"), _V(name).session(data) or {}


def _created(raw):
    """A manifest's "created" time, found without parsing it all (a 32 GiB context's manifest
    takes a millisecond to parse on the H200); parsed when the text holds it other than once."""
    found = _CREATED_RE.findall(raw)
    return float(found[0]) if len(found) == 1 else float(json.loads(raw).get("created"))


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
