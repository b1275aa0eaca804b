"""The image key: the secret that signs every image's manifest (HMAC-SHA256, image.py).

A server signs the manifests it writes with it, and restores only images whose signature it
checks, so a manifest edited by hand, its unkeyed digest recomputed, is refused. Servers that
share the key file restore each other's images: by default all the servers of one user
share theirs, made on first use in the user's own configuration directory (PHOS_IMAGE_KEY,
`phos server --image-key`, names another file). Messages name the key's file, never the key.
"""
import os
import secrets
import stat
import tempfile
import threading

from phos.base import settings
from phos.schema.control import private_directory

from .store import ImageError

MIN_KEY_BYTES = 16           # a shorter key could be guessed
MAX_KEY_BYTES = 4096         # a key file bigger than this is no key file
OTHERS_ACCESS = stat.S_IWGRP | stat.S_IROTH | stat.S_IWOTH     # a group of servers may share one readable by its group

_keys = {}                   # path -> key: each process reads its key file once
_mu = threading.Lock()


def key_path():
    """The key file this process signs and checks images with."""
    return os.path.abspath(os.path.expanduser(settings.image_key()))


def image_key():
    """This process's image key (key_path()'s), made first when it is the user's default one and
    does not exist yet. ImageError when it cannot be read or made, or is not safe to use."""
    path = key_path()
    key = _keys.get(path)
    if key is None:
        with _mu:
            key = _keys.get(path)
            if key is None:
                key = _keys[path] = _load(path, made_here=settings.image_key.raw() is None)
    return key


def _load(path, made_here):
    """The key in file `path`; made_here: it is the user's default key, made if missing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        if not made_here:
            raise ImageError(f"image key {path} does not exist: write a secret of at least {MIN_KEY_BYTES} bytes "
                             "there (mode 0600), or leave PHOS_IMAGE_KEY and --image-key unset for this user's "
                             "own key") from None
        _make(path)
        return _load(path, made_here=False)
    except OSError as e:
        raise ImageError(f"image key {path} cannot be read: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ImageError(f"image key {path} is not a regular file")
        if st.st_uid not in (0, os.geteuid()):
            raise ImageError(f"image key {path} belongs to uid {st.st_uid}, neither root nor this user "
                             f"(uid {os.geteuid()}): its owner could change it, and sign images this server restores")
        if st.st_mode & OTHERS_ACCESS:
            raise ImageError(f"image key {path} may be read or written by others (mode {st.st_mode & 0o777:o}): "
                             "make it 0600 (or 0640 for servers of one group)")
        key = f.read(MAX_KEY_BYTES + 1).strip()
    if len(key) > MAX_KEY_BYTES:
        raise ImageError(f"image key {path} is over {MAX_KEY_BYTES} bytes long: it is not a key file")
    if len(key) < MIN_KEY_BYTES:
        raise ImageError(f"image key {path} holds {len(key)} bytes, fewer than the {MIN_KEY_BYTES} bytes a key needs")
    return key


def _make(path):
    """Make the user's image key at path, in a directory of the user's own (mode 0700). Written
    aside, then linked into place: a server starting at the same moment reads a whole key, its
    own or ours, never half of one."""
    directory = os.path.dirname(path)
    try:
        private_directory(directory, create=True, what="image key directory")
    except (ValueError, OSError) as e:
        raise ImageError(f"image key {path} cannot be made: {e}") from None
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".image.key-")      # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:       # another server made it first: theirs is the key
            pass
    finally:
        os.unlink(tmp)
