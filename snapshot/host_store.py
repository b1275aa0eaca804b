"""An image store in shared host memory, for checkpoints at the host link's speed (issue 5).

A DirStore on /dev/shm writes every byte twice: the device copies a chunk into a pinned
buffer, then a thread writes it into a chunk file, and that file's pages are allocated and
zeroed on the way (most of a paused checkpoint's time). Here the chunks live in
fixed slots of one arena file that every worker of a server maps and pins once, when it is
pre-started: the device copies a chunk straight into its slot, and a restore copies it
straight back at the link's speed, pinned by a second process too (perf/probe_host_arena.py).

    DIR/arena      slots of HEAD + capacity bytes: the chunk's 40-byte header (image.py),
                   then its payload, page-aligned for the copy engines
    DIR/slots      the index: a header, then one record per slot (below)
    DIR/images/    manifests and digests, as in a DirStore; DIR/.lock as well
    DIR/chunks/    a chunk bigger than a slot (a module's image), in a file as in a DirStore

A record is (key, blob length, state, seq). States: FREE, RESERVED (a writer's, its pid in
the key field until it publishes), PUBLISHED. Every change happens under an flock of the
index and takes the next seq, so a reader (no lock) brings its key -> slot map up to date
by looking at the records whose seq moved. A torn read can only name a wrong slot, and the
chunk's header and fingerprint are checked on every read, as in any store.
"""
import contextlib
import fcntl
import itertools
import mmap
import os
import struct
import threading

import numpy as np

from .image import DEFAULT_CHUNK_SIZE, HEADER_SIZE
from .store import DirStore, ImageError, check_key, check_keys, keys_of

MAGIC, VERSION = b"PHOSHOST", 1
INDEX_HEADER = struct.Struct("<8sIIQQQQ")       # magic, version, 0, head, capacity, slots, seq
RECORD = np.dtype([("key", "u1", 16), ("length", "<u4"), ("state", "<u4"), ("seq", "<u8")])
FREE, RESERVED, PUBLISHED = 0, 1, 2
HEAD = 4096                                     # room for the chunk header; keeps payloads page-aligned
DEFAULT_CAPACITY = DEFAULT_CHUNK_SIZE
INDEX_FILE, ARENA_FILE = "slots", "arena"
_open_stores = {}                               # path -> HostStore: one mapping per process (pinned once)
_open_mu = threading.Lock()


def is_host_store(path):
    return os.path.isfile(os.path.join(os.fspath(path), INDEX_FILE))


def open_store(path, fsync=True, create=True):
    """The store at path: a HostStore where one was made, else a DirStore (made if need be,
    unless create is False: reading an image never makes a store)."""
    path = os.path.abspath(os.fspath(path))
    if not is_host_store(path):
        return DirStore(path, fsync=fsync, create=create)
    with _open_mu:
        store = _open_stores.get(path)
        if store is None or not store.is_current():        # made again since: a new mapping
            store = _open_stores[path] = HostStore(path)
        return store


def parse_size(text):
    """'40G', '512M', '1048576' -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = str(text).strip().upper().removesuffix("B").removesuffix("I")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise ValueError(f"size {text!r}: expected a number of bytes, or one with K, M, G or T") from None


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class HostStore(DirStore):
    """A store of images whose chunks live in a shared arena of slots; see the module docstring.
    Manifests, locks and their checks are DirStore's."""

    @classmethod
    def create(cls, path, nbytes, capacity=DEFAULT_CAPACITY):
        """Make an empty store of nbytes of slots at path (a directory on /dev/shm, for memory).
        Its memory is allocated now: a sparse file on a full /dev/shm would kill the worker
        that first touches a page (SIGBUS), and a worker pins allocated pages faster."""
        path = os.path.abspath(os.fspath(path))
        if capacity <= 0 or capacity % 4096:
            raise ImageError(f"slot capacity {capacity} must be a positive multiple of 4096")
        if is_host_store(path):
            raise ImageError(f"{path} already holds a host store")
        slots = nbytes // (HEAD + capacity)
        if slots < 1:
            raise ImageError(f"a host store of {nbytes} bytes holds no slot of {HEAD + capacity} bytes")
        if os.path.isdir(os.path.join(path, "images")) and os.listdir(os.path.join(path, "images")):
            raise ImageError(f"{path} already holds images of a directory store")
        os.makedirs(path, exist_ok=True)
        arena = os.path.join(path, ARENA_FILE)
        with open(arena, "wb") as f:
            try:
                os.posix_fallocate(f.fileno(), 0, slots * (HEAD + capacity))
            except OSError as e:
                os.unlink(arena)
                raise ImageError(f"host store {path}: {slots * (HEAD + capacity)} bytes cannot be allocated there "
                                 f"({e.strerror})") from None
        tmp = os.path.join(path, INDEX_FILE + ".new")
        with open(tmp, "wb") as f:
            f.write(INDEX_HEADER.pack(MAGIC, VERSION, 0, HEAD, capacity, slots, 0))
            f.truncate(INDEX_HEADER.size + slots * RECORD.itemsize)
        os.replace(tmp, os.path.join(path, INDEX_FILE))     # what makes it a host store
        return open_store(path)

    def __init__(self, path):
        super().__init__(path, fsync=False)       # memory: nothing to sync
        index = os.path.join(self.path, INDEX_FILE)
        self._index_fd = os.open(index, os.O_RDWR)
        try:
            self._check_index()
        except BaseException:
            os.close(self._index_fd)
            raise
        try:
            self.arena = self._map_arena()
        except BaseException:
            os.close(self._index_fd)
            raise
        self._index_map = mmap.mmap(self._index_fd, INDEX_HEADER.size + self.slots * RECORD.itemsize, flags=mmap.MAP_SHARED)
        self._records = np.frombuffer(self._index_map, RECORD, self.slots, INDEX_HEADER.size)
        self._header_seq = np.frombuffer(self._index_map, "<u8", 1, INDEX_HEADER.size - 8)     # the index's last seq
        self.memory = np.frombuffer(self.arena, np.uint8)      # what a worker pins (snap.pin)
        self._mu = threading.Lock()         # held with the index's flock, to change records
        self._map_mu = threading.Lock()     # held to bring the key -> slot map up to date
        self._seen = 0                 # the seq our map is up to date with
        self._where = {}               # key -> slot, published chunks
        self._key_of = {}              # slot -> key, for the records that change

    def _check_index(self):
        st = os.fstat(self._index_fd)
        self._inode, size = (st.st_dev, st.st_ino), st.st_size
        head = os.pread(self._index_fd, INDEX_HEADER.size, 0)
        if len(head) < INDEX_HEADER.size:
            raise ImageError(f"host store {self.path}: its index is truncated ({size} bytes)")
        magic, version, _, self.head, self.capacity, self.slots, _ = INDEX_HEADER.unpack(head)
        if magic != MAGIC:
            raise ImageError(f"host store {self.path}: its index is not a phos host store index (magic {magic!r})")
        if version != VERSION:
            raise ImageError(f"host store {self.path}: index version {version}, this reader supports {VERSION}")
        if self.capacity <= 0 or self.capacity % 4096 or self.slots <= 0:
            raise ImageError(f"host store {self.path}: its index names {self.slots} slots of {self.capacity} bytes")
        self.slot_bytes = self.head + self.capacity
        if size != INDEX_HEADER.size + self.slots * RECORD.itemsize or self.head != HEAD:
            raise ImageError(f"host store {self.path}: its index is {size} bytes, not what {self.slots} slots need")

    def _map_arena(self):
        try:
            fd = os.open(os.path.join(self.path, ARENA_FILE), os.O_RDWR)
        except OSError as e:
            raise ImageError(f"host store {self.path}: its arena cannot be opened: {e.strerror}") from None
        try:
            if os.fstat(fd).st_size != self.slots * self.slot_bytes:
                raise ImageError(f"host store {self.path}: its arena is {os.fstat(fd).st_size} bytes, "
                                 f"{self.slots} slots need {self.slots * self.slot_bytes}")
            return mmap.mmap(fd, self.slots * self.slot_bytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)

    def is_current(self):
        """Whether the store at our path is still the one we mapped (not removed, or made anew)."""
        try:
            st = os.stat(os.path.join(self.path, INDEX_FILE))
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._inode

    # -- the index ------------------------------------------------------------------------
    def _seq(self):
        return int(self._header_seq[0])

    @contextlib.contextmanager
    def _locked(self, keeps_map=False):
        """Exclusive: threads here by the mutex, processes by flock. Yields the next seq to use.
        keeps_map: the caller's changes leave our key -> slot map right (it changes no record
        the map holds, or updates the map itself), so a map current before them is current
        after them: the next _refresh has nothing to read (a checkpoint publishes each batch)."""
        with self._mu:
            fcntl.flock(self._index_fd, fcntl.LOCK_EX)
            seq = [self._seq()]
            start, done = seq[0], False

            def take(n=1):         # n seqs: the last is returned
                seq[0] += n
                return seq[0]
            try:
                yield take
                done = True
            finally:      # even after a failure: the records it changed must be seen as changed
                self._header_seq[0] = seq[0]
                if done and keeps_map:
                    with self._map_mu:
                        if self._seen == start:
                            self._seen = seq[0]
                fcntl.flock(self._index_fd, fcntl.LOCK_UN)

    def _refresh(self):
        """Bring key -> slot up to date with the records changed since we last looked."""
        with self._map_mu:
            now = self._seq()
            if now == self._seen:
                return
            rec = self._records
            changed = np.flatnonzero(rec["seq"] > self._seen)
            published = changed[rec["state"][changed] == PUBLISHED]
            if self._key_of:          # the first time, nothing to forget
                for slot in changed.tolist():
                    old = self._key_of.pop(slot, None)
                    if old is not None and self._where.get(old) == slot:
                        del self._where[old]
            slots = published.tolist()
            keys = keys_of(rec["key"][published].tobytes())
            self._where.update(zip(keys, slots))
            self._key_of.update(zip(slots, keys))
            self._seen = now

    def refresh(self):
        """Read the index now (a pre-started worker does, so that a restore need not)."""
        self._refresh()

    def _holds(self, slot, key):
        """Whether the record of slot is chunk key, published (read under the lock: the map may lag)."""
        return self._records["state"][slot] == PUBLISHED and self._records["key"][slot].tobytes().hex() == key

    def _slot(self, key):
        check_key(key)
        self._refresh()
        slot = self._where.get(key)
        if slot is None:
            raise ImageError(f"chunk {key} is missing from the store {self.path}")
        return slot

    # -- writing straight into slots (the snapshot engine) ----------------------------------
    def reserve(self, n):
        """n free slots for this process to fill; ImageError when the store has too few."""
        pid = np.frombuffer(np.array([os.getpid()], "<u8").tobytes(), np.uint8)
        with self._locked(keeps_map=True) as take:
            rec = self._records
            free = np.flatnonzero(rec["state"] == FREE)
            if len(free) < n:
                self._reclaim(take)
                free = np.flatnonzero(rec["state"] == FREE)
            if len(free) < n:
                used = self.slots - len(free)
                raise ImageError(f"host store {self.path} is full: {n} more chunks of up to {self.capacity >> 10} KiB needed, "
                                 f"{used} of its {self.slots} slots are in use")
            slots = free[:n]
            rec["key"][slots] = 0
            rec["key"][slots, :8] = pid
            rec["length"][slots] = 0
            rec["state"][slots] = RESERVED
            last = take(n)
            rec["seq"][slots] = np.arange(last - n + 1, last + 1, dtype=np.uint64)
        return slots.tolist()

    def reclaim(self):
        """Free the slots that writers which died left reserved (garbage collection calls it)."""
        with self._locked() as take:
            self._reclaim(take)

    def _reclaim(self, take):
        """Free the slots that writers which died left reserved (under the lock)."""
        rec = self._records
        held = np.flatnonzero(rec["state"] == RESERVED)
        pids = rec["key"][held, :8].copy().view("<u8").reshape(-1)
        for slot, pid in zip(held.tolist(), pids.tolist()):
            if not _alive(pid):
                rec["state"][slot] = FREE
                rec["seq"][slot] = take()

    def payload(self, slot, nbytes):
        """The writable payload of a slot, nbytes long (a NumPy view of the arena)."""
        if not 0 <= nbytes <= self.capacity:
            raise ImageError(f"chunk of {nbytes} bytes does not fit the host store's {self.capacity}-byte slots")
        start = slot * self.slot_bytes + self.head
        return self.memory[start:start + nbytes]

    def publish(self, slots, keys, headers, payload_lens):
        """Make filled slots the chunks `keys` (headers: their encoded chunk headers), all under
        one lock. Returns [bool]: False where the store held that chunk already; that slot is
        freed and the other copy counts."""
        check_keys(keys)
        for slot, header in zip(slots, headers):
            start = slot * self.slot_bytes
            self.arena[start:start + len(header)] = header
        out, mine = [], set()
        with self._locked(keeps_map=True) as take:
            self._refresh()           # under the lock: nobody publishes the same chunk meanwhile
            rec = self._records
            for slot, key in zip(slots, keys):
                held = self._where.get(key)
                out.append(held is None or held not in mine and not self._holds(held, key))    # a chunk twice here counts once
                if out[-1]:
                    mine.add(slot)
                    self._where[key], self._key_of[slot] = slot, key
            # the records in a few array steps; their seq last, as a reader looks at it first
            fresh = [i for i, new in enumerate(out) if new]
            published = np.array([slots[i] for i in fresh], np.int64)
            rec["key"][published] = np.frombuffer(bytes.fromhex("".join(keys[i] for i in fresh)), np.uint8).reshape(-1, 16)
            rec["length"][published] = [len(headers[i]) + payload_lens[i] for i in fresh]
            rec["state"][published] = PUBLISHED
            rec["state"][[slot for slot, new in zip(slots, out) if not new]] = FREE
            last = take(len(slots))
            rec["seq"][np.asarray(slots, np.int64)] = np.arange(last - len(slots) + 1, last + 1, dtype=np.uint64)
        return out

    def release(self, slots):
        """Give back reserved slots that were not published (a failed or mismatched copy)."""
        if not slots:
            return
        with self._locked(keeps_map=True) as take:
            rec = self._records
            for slot in slots:
                if rec["state"][slot] == RESERVED:
                    rec["state"][slot] = FREE
                    rec["seq"][slot] = take()

    def source(self, key):
        """(header bytes, payload view, blob length) of a chunk in a slot, without copying it: a
        restore copies the payload straight to the device. The caller checks the header
        (image.py). None for a chunk kept in a file (a module image bigger than a slot)."""
        check_key(key)
        self._refresh()
        slot = self._where.get(key)
        if slot is None:
            if DirStore.has_chunk(self, key):
                return None
            raise ImageError(f"chunk {key} is missing from the store {self.path}")
        length = int(self._records["length"][slot])
        if length > HEADER_SIZE + self.capacity:
            raise ImageError(f"chunk {key}: the host store's index gives it {length} bytes, more than a slot")
        start = slot * self.slot_bytes
        header = self.memory[start:start + HEADER_SIZE].tobytes()
        body = max(length - HEADER_SIZE, 0)
        return header, self.memory[start + self.head:start + self.head + body], length

    # -- the store interface: chunks in slots; one bigger than a slot (a module's image) in
    # -- a file, as a DirStore keeps it
    def put_chunk(self, key, blob):
        if self.has_chunk(key):
            return
        parts = blob if isinstance(blob, (tuple, list)) else (blob,)
        data = memoryview(b"".join(bytes(p) for p in parts))
        if len(data) - HEADER_SIZE > self.capacity:
            return DirStore.put_chunk(self, key, data)
        slot, = self.reserve(1)
        try:
            self.payload(slot, len(data) - HEADER_SIZE)[:] = np.frombuffer(data[HEADER_SIZE:], np.uint8)
            self.publish([slot], [key], [bytes(data[:HEADER_SIZE])], [len(data) - HEADER_SIZE])
        except BaseException:
            self.release([slot])
            raise

    def has_chunk(self, key):
        check_key(key)
        self._refresh()
        return key in self._where or DirStore.has_chunk(self, key)

    def missing(self, keys):
        self._refresh()
        lack = {k for k in keys if k not in self._where}
        check_keys(list(lack))    # a key the index holds is one; only the others need the check
        return DirStore.missing(self, lack) if lack and self._may_hold_files() else lack

    def _may_hold_files(self):
        """Whether DIR/chunks may hold a chunk file, each in a subdirectory: a directory's link
        count is 2 plus its subdirectories' where the file system keeps it (tmpfs, ext4; btrfs
        says 1, and is asked file by file). A checkpoint asks about every chunk it copies."""
        try:
            return os.stat(self._chunks).st_nlink != 2
        except FileNotFoundError:
            return False

    def get_chunk(self, key, max_bytes=None):
        got = self.source(key)
        if got is None:
            return DirStore.get_chunk(self, key, max_bytes)
        header, body, length = got
        if max_bytes is not None and length > max_bytes:
            raise ImageError(f"chunk {key} is {length} bytes, over the limit of {max_bytes}")
        return b"".join((header, body))      # one copy, not two (body.tobytes(), then the sum)

    def get_chunk_into(self, key, head, body):
        got = self.source(key)
        if got is None:
            return DirStore.get_chunk_into(self, key, head, body)
        header, payload, length = got
        n = min(len(head), len(header))
        head[:n] = header[:n]
        m = min(len(body), len(payload))
        np.frombuffer(body, np.uint8, m)[:] = payload[:m]
        return length

    def heads(self, keys, nbytes):
        """Read from the index and the slots in a few array steps (a restore's thousands); a
        chunk kept in a file as a DirStore reads it."""
        check_keys(keys)
        self._refresh()
        slots = np.fromiter(map(self._where.get, keys, itertools.repeat(-1)), np.int64, len(keys))
        heads, lengths = np.zeros((len(keys), nbytes), np.uint8), np.full(len(keys), -1, np.int64)
        held = np.flatnonzero(slots >= 0)
        lengths[held] = self._records["length"][slots[held]]
        oversized = held[lengths[held] > HEADER_SIZE + self.capacity]
        if len(oversized):
            raise ImageError(f"chunk {keys[oversized[0]]}: the host store's index gives it {lengths[oversized[0]]} bytes, "
                             "more than a slot")
        heads[held] = self.memory.reshape(self.slots, self.slot_bytes)[slots[held], :nbytes]
        in_files = np.flatnonzero(slots < 0)
        if len(in_files):
            file_heads, file_lengths = DirStore.heads(self, [keys[i] for i in in_files], nbytes)
            heads[in_files] = np.frombuffer(file_heads, np.uint8).reshape(-1, nbytes)
            lengths[in_files] = file_lengths
        return heads.tobytes(), lengths

    def list_chunks(self):
        self._refresh()
        return sorted(set(self._where).union(DirStore.list_chunks(self)))

    def delete_chunk(self, key):
        check_key(key)
        DirStore.delete_chunk(self, key)
        with self._locked() as take:
            self._refresh()
            slot = self._where.get(key)
            if slot is not None and self._holds(slot, key):
                self._records["state"][slot] = FREE
                self._records["seq"][slot] = take()

    def _chunk_stats(self):
        published = self._records["state"] == PUBLISHED
        in_files = DirStore._chunk_stats(self)
        return int(self._records["length"][published].sum(dtype=np.uint64)) + in_files[0], int(published.sum()) + in_files[1]

    def stats(self):
        return {**super().stats(), "capacity_bytes": self.slots * self.capacity,
                "free_slots": int((self._records["state"] == FREE).sum())}

    def __repr__(self):
        return f"HostStore({self.path!r}, {self.slots} slots of {self.capacity >> 10} KiB)"
