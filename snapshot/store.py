"""Where images live: a directory (the default) or memory (for handoff).

A store holds opaque blobs under two namespaces and knows nothing of their format:

- chunks, keyed by a 32-hex-digit content key (image.py writes the encoded chunk),
- images, each a manifest blob plus a digest blob, keyed by a name.

Both stores have the same interface:

    put_chunk(key, blob)         has_chunk(key) -> bool     get_chunk(key, max_bytes) -> bytes
    missing(keys) -> the set of those the store lacks (checks thousands at once)
    list_chunks() -> [key]       delete_chunk(key)
    put_manifest(name, manifest, digest)                    get_manifest(name, max_bytes) -> (manifest, digest)
    put_new_manifest(name, manifest, digest)   put_manifest, refused by name where the image exists
    list_images() -> [name]      has_image(name)            delete_image(name)
    heads(keys, nbytes) -> (the first nbytes of each chunk's blob, zero-padded, joined;
                            [blob length, -1 where missing]): what a restore checks up front
    stats() -> {"bytes", "chunks", "images"}
    session()                    a context manager held while writing an image or streaming its
                                 chunks (shared; across processes for DirStore, via flock)
    reading(name)                a context manager held while a restore loads image `name` on
                                 demand: delete_image(name) refuses it meanwhile (ImageInUse)
    try_gc_lock()                a context manager yielding True when no session is active
                                 (exclusive, never waits); garbage collection runs under it

Missing or oversized entries raise ImageError; names and keys are checked so that no
path can leave the store's directory.
"""
import contextlib
import errno
import fcntl
import os
import re
import stat
import tempfile
import threading

KEY_RE = re.compile(r"[0-9a-f]{32}")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}")


class ImageError(Exception):
    """An image or chunk is missing, corrupt, truncated, tampered with or unsupported."""


class ImageInUse(ImageError):
    """An image that a restore still loads on demand: deleting it would take the chunks its
    context has yet to load."""


def _in_use(name):
    return ImageInUse(f"image {name!r} is being restored on demand: a context still loads its chunks from it; "
                      "delete it once that restore has loaded everything")


def _taken(name, where):
    return ImageError(f"image {name!r} already exists in the store {where}: another checkpoint committed "
                      "that name first; give this one another name")


def all_keys(keys):
    """True when every item of the list is a chunk key, checked in a few passes in C for
    thousands: joined by commas, n keys of 32 hex digits leave commas at every 33rd place only."""
    try:
        joined = ",".join(keys).encode("ascii")
    except (TypeError, UnicodeEncodeError):
        return False
    commas = max(len(keys) - 1, 0)
    return (len(joined) == 32 * len(keys) + commas and not joined.translate(None, b"0123456789abcdef,")
            and joined.count(b",") == commas and joined[32::33] == b"," * commas)


def check_key(key):
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise ImageError(f"invalid chunk key {key!r}: expected 32 lowercase hex digits")
    return key


def keys_of(fingerprints):
    """The chunk keys of fingerprints (16 bytes each) given joined: one hex conversion for thousands."""
    hexes = bytes(fingerprints).hex()
    return [hexes[i:i + 32] for i in range(0, len(hexes), 32)]


def check_keys(keys):
    """check_key for a list of thousands: all at once, one by one only to name a bad one."""
    if not all_keys(keys):
        for key in keys:
            check_key(key)


def check_name(name):
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or ".." in name:
        raise ImageError(f"invalid image name {name!r}: use 1-128 characters of [A-Za-z0-9._@+-], "
                         "starting with a letter or digit")
    return name


class _SharedExclusive:
    """In-process counterpart of the store lock: sessions share it, gc takes it alone."""

    def __init__(self):
        self._cv = threading.Condition()
        self._sessions = 0
        self._gc = False

    @contextlib.contextmanager
    def shared(self):
        with self._cv:
            self._cv.wait_for(lambda: not self._gc)
            self._sessions += 1
        try:
            yield
        finally:
            with self._cv:
                self._sessions -= 1
                self._cv.notify_all()

    @contextlib.contextmanager
    def try_exclusive(self):
        with self._cv:
            ok = not self._gc and self._sessions == 0
            if ok:
                self._gc = True
        try:
            yield ok
        finally:
            if ok:
                with self._cv:
                    self._gc = False
                    self._cv.notify_all()


class MemoryStore:
    """Everything in dicts; thread-safe. Used for handoff and tests."""

    def __init__(self):
        self._mu = threading.Lock()
        self._chunks = {}
        self._images = {}
        self._readers = {}          # name -> restores loading it on demand (reading)
        self._lock = _SharedExclusive()

    # chunks
    def put_chunk(self, key, blob):
        """blob: bytes, or a sequence of parts to join (see image.encode_chunk_parts)."""
        check_key(key)
        blob = b"".join(blob) if isinstance(blob, (tuple, list)) else bytes(blob)
        with self._mu:
            self._chunks.setdefault(key, blob)

    def has_chunk(self, key):
        check_key(key)
        return key in self._chunks

    def missing(self, keys):
        keys = list(keys)
        check_keys(keys)
        with self._mu:
            return set(keys) - self._chunks.keys()

    def get_chunk(self, key, max_bytes=None):
        check_key(key)
        try:
            blob = self._chunks[key]
        except KeyError:
            raise ImageError(f"chunk {key} is missing from the store") from None
        if max_bytes is not None and len(blob) > max_bytes:
            raise ImageError(f"chunk {key} is {len(blob)} bytes, over the limit of {max_bytes}")
        return blob

    def get_chunk_into(self, key, head, body):
        """Fill head, then body, from the blob's start (see DirStore); returns the blob's length."""
        blob = memoryview(self.get_chunk(key))
        head[:min(len(head), len(blob))] = blob[:len(head)]
        rest = blob[len(head):len(head) + len(body)]
        body[:len(rest)] = rest
        return len(blob)

    def heads(self, keys, nbytes):
        check_keys(keys)
        blobs = [self._chunks.get(k) for k in keys]
        return (b"".join(bytes(b[:nbytes]).ljust(nbytes, b"\0") if b is not None else bytes(nbytes) for b in blobs),
                [len(b) if b is not None else -1 for b in blobs])

    def list_chunks(self):
        with self._mu:
            return sorted(self._chunks)

    def delete_chunk(self, key):
        check_key(key)
        with self._mu:
            self._chunks.pop(key, None)

    # images
    def put_manifest(self, name, manifest, digest):
        check_name(name)
        with self._mu:
            self._images[name] = (bytes(manifest), bytes(digest))

    def put_new_manifest(self, name, manifest, digest):
        check_name(name)
        with self._mu:
            if name in self._images:
                raise _taken(name, "memory")
            self._images[name] = (bytes(manifest), bytes(digest))

    def get_manifest(self, name, max_bytes=None):
        check_name(name)
        try:
            manifest, digest = self._images[name]
        except KeyError:
            raise ImageError(f"image {name!r} is not in the store") from None
        if max_bytes is not None and len(manifest) > max_bytes:
            raise ImageError(f"manifest of image {name!r} is {len(manifest)} bytes, over the limit of {max_bytes}")
        return manifest, digest

    def has_image(self, name):
        check_name(name)
        return name in self._images

    def list_images(self):
        with self._mu:
            return sorted(self._images)

    def delete_image(self, name):
        check_name(name)
        with self._mu:
            if self._readers.get(name):
                raise _in_use(name)
            if self._images.pop(name, None) is None:
                raise ImageError(f"image {name!r} is not in the store")

    @contextlib.contextmanager
    def reading(self, name):
        check_name(name)
        with self._mu:
            if name not in self._images:
                raise ImageError(f"image {name!r} is not in the store")
            self._readers[name] = self._readers.get(name, 0) + 1
        try:
            yield
        finally:
            with self._mu:
                self._readers[name] -= 1
                if not self._readers[name]:
                    del self._readers[name]

    def stats(self):
        with self._mu:
            return {"bytes": sum(len(b) for b in self._chunks.values())
                    + sum(len(m) + len(d) for m, d in self._images.values()),
                    "chunk_bytes": sum(len(b) for b in self._chunks.values()),
                    "chunks": len(self._chunks), "images": len(self._images)}

    # locking between writers and garbage collection
    def session(self):
        return self._lock.shared()

    def try_gc_lock(self):
        return self._lock.try_exclusive()

    def __repr__(self):
        return f"MemoryStore({len(self._chunks)} chunks, {len(self._images)} images)"


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _own_directory(d, store):
    """A directory of a store must be a directory of its own, not a link (chunks and manifests
    written through it would land wherever it leads), and only its owner, this user or root,
    may write in it (another user could put chunks or manifests there, or swap it for a link).
    Raises ImageError."""
    try:
        st = os.lstat(d)
    except OSError as e:
        raise ImageError(f"image store {store}: {d} cannot be checked: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise ImageError(f"image store {store}: {d} is a symbolic link: refused (what is written there would land "
                         f"outside the store)")
    if not stat.S_ISDIR(st.st_mode):
        raise ImageError(f"image store {store}: {d} is not a directory")
    if st.st_mode & 0o022:
        raise ImageError(f"image store {store}: {d} is writable by other users (mode {st.st_mode & 0o777:o}): refused")
    if st.st_uid not in (0, os.geteuid()):
        raise ImageError(f"image store {store}: {d} belongs to uid {st.st_uid}, neither root nor this user "
                         f"(uid {os.geteuid()}): refused")


def open_regular(path, what, with_stat=False):
    """A read-only descriptor of path, which must be a regular file of its own: a symbolic link
    could lead anywhere (another tenant's image, /etc/passwd) and a FIFO or device would block
    or never end. None if it is missing. with_stat: (descriptor, its os.stat_result), which the
    check took anyway (a restore's check of thousands of chunks saves a system call each)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:          # ELOOP: a symbolic link; a directory in its place; no permission
        why = "it is a symbolic link" if e.errno == errno.ELOOP else e.strerror
        raise ImageError(f"{what} cannot be read ({path}): {why}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ImageError(f"{what} cannot be read ({path}): it is not a regular file")
    return (fd, st) if with_stat else fd


def _read_bounded(path, max_bytes, what):
    fd = open_regular(path, what)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            if max_bytes is not None:
                size = os.fstat(f.fileno()).st_size
                if size > max_bytes:
                    raise ImageError(f"{what} is {size} bytes, over the limit of {max_bytes}")
                data = f.read(max_bytes + 1)
                if len(data) > max_bytes:
                    raise ImageError(f"{what} is over the limit of {max_bytes} bytes")
                return data
            return f.read()
        except OSError as e:
            raise ImageError(f"{what} cannot be read ({path}): {e.strerror}") from None


def images_in(path):
    """The names of the images a store directory holds (a DirStore's or a HostStore's), read
    without opening the store: a HostStore's first opening maps and reads its whole index."""
    try:
        files = os.listdir(os.path.join(path, "images"))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(f[:-5] for f in files if f.endswith(".json") and NAME_RE.fullmatch(f[:-5]) and ".." not in f[:-5])


class DirStore:
    """A directory: images/<name>.json and images/<name>.digest, chunks/ab/abcdef....

    Every file is written to a temporary file in the same directory, fsynced, then
    renamed into place, so a reader sees a whole file or none. A manifest is renamed
    into place after its digest, and it is what makes an image visible.
    """

    def __init__(self, path, fsync=True, create=True):
        """create=False: the store must be there already (what reads an image never makes one)."""
        self.path = os.path.abspath(os.fspath(path))
        self.fsync = fsync
        self._images = os.path.join(self.path, "images")
        self._chunks = os.path.join(self.path, "chunks")
        if not create and not os.path.isdir(self._images):
            raise ImageError(f"no image store at {self.path}")
        os.makedirs(self.path, mode=0o755, exist_ok=True)       # a umask of 002 would leave them open to a group
        os.makedirs(self._images, mode=0o755, exist_ok=True)
        os.makedirs(self._chunks, mode=0o755, exist_ok=True)
        for d in (os.path.realpath(self.path), self._images, self._chunks):    # a link to the whole store is the operator's
            _own_directory(d, self.path)
        self._lockfile = os.path.join(self.path, ".lock")
        self._local = _SharedExclusive()
        self._checked = set()          # chunk subdirectories found to be the store's own

    def _chunk_path(self, key):
        return self._chunk_file(check_key(key))

    def _chunk_file(self, key):          # a key already checked
        return f"{self._chunks}/{key[:2]}/{key}"

    def _write_atomic(self, path, data):
        d = os.path.dirname(path)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                for part in (data if isinstance(data, (tuple, list)) else (data,)):
                    f.write(part)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    # chunks
    def put_chunk(self, key, blob):
        path = self._chunk_path(key)
        if os.path.exists(path):
            return
        d = os.path.dirname(path)
        new_dir = not os.path.isdir(d)
        os.makedirs(d, mode=0o755, exist_ok=True)
        if d not in self._checked:
            _own_directory(d, self.path)
            self._checked.add(d)
        self._write_atomic(path, blob)
        if self.fsync and new_dir:
            _fsync_dir(self._chunks)

    def has_chunk(self, key):
        return os.path.isfile(self._chunk_path(key))

    def missing(self, keys):
        """The keys the store lacks. A few: one access() each. Thousands (a restore of 32 GiB):
        one listing of each chunk directory they fall in, several times faster than a stat each."""
        keys = list(keys)
        check_keys(keys)
        if len(keys) < 256:
            return {k for k in keys if not os.access(self._chunk_file(k), os.F_OK)}
        wanted, lack = {}, set()
        for k in keys:
            wanted.setdefault(k[:2], set()).add(k)
        for sub, want in wanted.items():
            try:
                lack |= want.difference(os.listdir(os.path.join(self._chunks, sub)))
            except FileNotFoundError:
                lack |= want
        return lack

    def get_chunk(self, key, max_bytes=None):
        data = _read_bounded(self._chunk_path(key), max_bytes, f"chunk {key}")
        if data is None:
            raise ImageError(f"chunk {key} is missing from the store {self.path}")
        return data

    def get_chunk_into(self, key, head, body):
        """Read the chunk file's start into head and what follows into body, in one call and
        no copy in between; returns the file's length (the caller checks it against the header)."""
        fd = open_regular(self._chunk_path(key), f"chunk {key}")
        if fd is None:
            raise ImageError(f"chunk {key} is missing from the store {self.path}")
        try:
            size = os.fstat(fd).st_size
            got = os.readv(fd, [head, body])
        except OSError as e:      # not a regular file (a directory in its place), or an I/O error
            raise ImageError(f"chunk {key} cannot be read from the store {self.path}: {e.strerror}") from None
        finally:
            os.close(fd)
        if got != min(size, len(head) + len(body)):
            raise ImageError(f"chunk {key} changed while it was read ({got} of {size} bytes)")
        return size

    def heads(self, keys, nbytes):
        """A stat and one read of nbytes of each chunk file, each a regular file of its own
        (open_regular): no contents are read."""
        check_keys(keys)
        heads, lengths = bytearray(nbytes * len(keys)), [-1] * len(keys)
        for i, key in enumerate(keys):
            got = open_regular(self._chunk_file(key), f"chunk {key}", with_stat=True)
            if got is None:
                continue
            fd, lengths[i] = got[0], got[1].st_size
            try:
                head = os.pread(fd, nbytes, 0)
            except OSError as e:
                raise ImageError(f"chunk {key} cannot be read from the store {self.path}: {e.strerror}") from None
            finally:
                os.close(fd)
            heads[i * nbytes:i * nbytes + len(head)] = head
        return bytes(heads), lengths

    def list_chunks(self):
        out = []
        for sub in sorted(os.listdir(self._chunks)):
            d = os.path.join(self._chunks, sub)
            if len(sub) != 2 or not os.path.isdir(d):
                continue
            out.extend(k for k in sorted(os.listdir(d)) if KEY_RE.fullmatch(k) and k[:2] == sub)
        return out

    def delete_chunk(self, key):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._chunk_path(key))

    def remove_leftovers(self):
        """Remove the temporary files of writers that died (_write_atomic's, a killed worker's):
        called with no session active (garbage collection's lock), when no writer is alive to
        own one. Returns how many went."""
        gone = 0
        dirs = [self._images] + [os.path.join(self._chunks, d) for d in os.listdir(self._chunks) if len(d) == 2]
        for d in dirs:
            try:
                names = [n for n in os.listdir(d) if n.startswith(".tmp-")]
            except (FileNotFoundError, NotADirectoryError):
                continue
            for n in names:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(d, n))
                    gone += 1
        return gone

    # images
    def _image_paths(self, name):
        check_name(name)
        return os.path.join(self._images, name + ".json"), os.path.join(self._images, name + ".digest")

    def put_manifest(self, name, manifest, digest):
        mpath, dpath = self._image_paths(name)
        self._write_atomic(dpath, digest)
        self._write_atomic(mpath, manifest)
        if self.fsync:
            _fsync_dir(self._images)

    def put_new_manifest(self, name, manifest, digest):
        """put_manifest of an image the store must not hold: of two writers committing one name
        at once (two checkpoints given one --name), exactly one commits and the other is refused
        by name. A check before the rename alone let both pass it, and the second replace the
        first. The images directory's flock makes check and commit one step, across processes."""
        fd = os.open(self._images, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if self.has_image(name):
                raise _taken(name, self.path)
            self.put_manifest(name, manifest, digest)
        finally:
            os.close(fd)

    def get_manifest(self, name, max_bytes=None):
        mpath, dpath = self._image_paths(name)
        manifest = _read_bounded(mpath, max_bytes, f"manifest of image {name!r}")
        if manifest is None:
            raise ImageError(f"image {name!r} is not in the store {self.path}")
        digest = _read_bounded(dpath, 4096, f"digest of image {name!r}")
        if digest is None:
            raise ImageError(f"image {name!r}: digest file {dpath} is missing")
        return manifest, digest

    def has_image(self, name):
        return os.path.isfile(self._image_paths(name)[0])

    def list_images(self):
        return images_in(self.path)

    def delete_image(self, name):
        mpath, dpath = self._image_paths(name)
        with self._unread(mpath, name):
            try:
                os.unlink(mpath)
            except FileNotFoundError:
                raise ImageError(f"image {name!r} is not in the store {self.path}") from None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(dpath)
        if self.fsync:
            _fsync_dir(self._images)

    # A restore on demand holds a shared flock of its image's manifest until its last chunk
    # is in; a deletion takes it exclusively, or is refused. Across processes, and a process
    # that dies lets go of it with no file left behind.
    @contextlib.contextmanager
    def reading(self, name):
        mpath, _ = self._image_paths(name)
        fd = open_regular(mpath, f"manifest of image {name!r}")
        if fd is None:
            raise ImageError(f"image {name!r} is not in the store {self.path}")
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if os.fstat(fd).st_nlink == 0:
                raise ImageError(f"image {name!r} was deleted from the store {self.path} as it was being restored")
            yield
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _unread(self, mpath, name):
        """The manifest mpath locked for its deletion; ImageInUse while a restore reads it."""
        try:
            fd = os.open(mpath, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:          # missing, or a link: no restore reads it (unlink says which)
            yield
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _in_use(name) from None
            yield
        finally:
            os.close(fd)

    def stats(self):
        chunk_bytes, chunks = self._chunk_stats()
        image_bytes = images = 0
        for f in os.listdir(self._images):
            if f.endswith(".json") or f.endswith(".digest"):
                with contextlib.suppress(FileNotFoundError):
                    image_bytes += os.stat(os.path.join(self._images, f)).st_size
                images += f.endswith(".json")
        return {"bytes": chunk_bytes + image_bytes, "chunk_bytes": chunk_bytes, "chunks": chunks, "images": images}

    def _chunk_stats(self):
        """(bytes, count) of the chunks held."""
        chunk_bytes = chunks = 0
        for key in DirStore.list_chunks(self):       # the files (a HostStore lists its slots too)
            with contextlib.suppress(FileNotFoundError):
                chunk_bytes += os.stat(self._chunk_path(key)).st_size
                chunks += 1
        return chunk_bytes, chunks

    # locking: flock on <store>/.lock works across processes and across open files of one process
    @contextlib.contextmanager
    def session(self):
        with self._local.shared():
            fd = self._open_lock_shared()
            try:
                if fd is not None:
                    fcntl.flock(fd, fcntl.LOCK_SH)
                yield
            finally:
                if fd is not None:
                    os.close(fd)

    def _open_lock_shared(self):
        """The lock file, for a session; None in a store this user may only read, and that has
        none: nobody collects garbage there (a restore from it holds a session too)."""
        try:
            return self._open_lock(os.O_RDWR | os.O_CREAT)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
        try:
            return self._open_lock(os.O_RDONLY)
        except FileNotFoundError:
            return None

    def _open_lock(self, flags):
        """The lock file, never through a link: a dangling one made its target."""
        try:
            return os.open(self._lockfile, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ImageError(f"image store {self.path}: its lock file {self._lockfile} is a symbolic link: "
                                 "refused") from None
            raise

    @contextlib.contextmanager
    def try_gc_lock(self):
        with self._local.try_exclusive() as ok:
            if not ok:
                yield False
                return
            fd = self._open_lock(os.O_RDWR | os.O_CREAT)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                    yield False
                    return
                yield True
            finally:
                os.close(fd)

    def __repr__(self):
        return f"DirStore({self.path!r})"
