"""The module images a server's clients sent, kept by digest, so that a library image (cuBLAS's
and cuDNN's run to tens of MB) crosses the wire once per server: a later process, or the same
one in another context, names it by its digest instead (ModuleLoad.digest, phos.capnp).

Content-addressed files in a directory of the server's own (mode 0700), one per image, named
by the hex BLAKE2b-256 of their bytes. An image is stored only after its digest is checked,
and checked again when read, so a file changed on disk is a miss, never a wrong module. The
directory is bounded: past max_bytes, the images used longest ago go.

Each tenant sees only the images it sent itself (view): a subdirectory of its own, named by
its tenant name, so that naming a digest tells no tenant whether another loaded that image.
"""
import hashlib
import os
import secrets

from phos.snapshot.store import open_regular

DIGEST_BYTES = 32


def image_digest(image):
    return hashlib.blake2b(image, digest_size=DIGEST_BYTES).digest()


class ModuleCache:
    def __init__(self, directory, max_bytes, root=None):
        """root: the server's whole cache, which max_bytes bounds, where directory is a view of it."""
        self.directory, self.max_bytes = directory, max_bytes
        self.root = root or directory

    def view(self, tenant):
        """The cache as tenant `tenant` (device_ledger.tenant_name's, checked) sees it: only what it sent."""
        directory = os.path.join(self.root, "t-" + tenant)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        return ModuleCache(directory, self.max_bytes, self.root)

    def _path(self, digest):
        return os.path.join(self.directory, digest.hex())

    def get(self, digest):
        """The image with this digest, or None."""
        if len(digest) != DIGEST_BYTES:
            return None
        path = self._path(digest)
        try:
            fd = open_regular(path, "a cached module image")
        except Exception:        # not a regular file of ours: a miss
            return None
        if fd is None:
            return None
        with os.fdopen(fd, "rb") as f:
            image = f.read()
        if image_digest(image) != digest:
            self._remove(path)
            return None
        try:
            os.utime(path)       # used now: the last to go
        except OSError:
            pass
        return image

    def put(self, digest, image):
        """Keep an image whose digest the caller checked; False when it does not fit at all."""
        if len(image) > self.max_bytes:
            return False
        path = self._path(digest)
        if os.path.exists(path):
            return True
        tmp = os.path.join(self.directory, f".{digest.hex()}.{secrets.token_hex(4)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(image)
            os.replace(tmp, path)       # whole or not at all, whoever else writes it meanwhile
        except OSError:
            self._remove(tmp)
            return False
        self._bound()
        return True

    def _bound(self):
        """The whole cache, every tenant's view in it, within max_bytes: the oldest used go."""
        entries = []
        for directory in [self.root] + [e.path for e in os.scandir(self.root)
                                        if e.name.startswith("t-") and e.is_dir(follow_symlinks=False)]:
            for e in os.scandir(directory):
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not os.path.isdir(e.path) or os.path.islink(e.path):
                    entries.append((st.st_mtime, st.st_size, e.path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            self._remove(path)
            total -= size

    @staticmethod
    def _remove(path):
        try:
            os.unlink(path)
        except OSError:
            pass
