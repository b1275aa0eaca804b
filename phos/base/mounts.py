"""A private view of the file system for a server (`unshare -m`): how tests and the pool give
a server empty /dev/shm, /tmp and /run, as on a machine of its own."""
import os
import shlex
import sys

CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # phos's own, kept visible


def private_mounts(paths, also=()):
    """Shell lines that, in a new mount namespace (unshare -m), put an empty tmpfs on each of
    paths (/dev/shm, /tmp, /run: a server that shares no files there with others, as on a
    machine of its own), then bring back at their places the directories under them that must
    stay: the Python that runs phos, its module path and phos's own checkout, which may live in
    /tmp (a clone, a virtual environment or a pip --target there), and those in `also`. A directory is held open before the
    mounts and bound back through its descriptor: its path names the empty tmpfs by then."""
    keep = {sys.prefix, sys.base_prefix, CHECKOUT, *map(str, also),
            *(p for p in sys.path if p)}         # PYTHONPATH's directories too (the H200's packages are in /tmp)
    hidden = [p.rstrip("/") for p in paths]
    under = sorted(k for k in map(os.path.realpath, keep) if os.path.isdir(k) and any(k.startswith(p + "/") for p in hidden))
    under = [k for i, k in enumerate(under) if not any(k.startswith(o + "/") for o in under[:i])]   # the outermost
    if len(under) > 6:
        raise ValueError(f"too many directories to keep visible: {under}")
    fds = list(zip(range(3, 10), under))
    lines = [f"exec {fd}<{shlex.quote(k)}" for fd, k in fds]
    lines += [f"mount -t tmpfs -o mode={755 if p == '/run' else 1777} phos-private {p}" for p in hidden]
    for fd, k in fds:
        lines += [f"mkdir -p {shlex.quote(k)}", f"mount --no-canonicalize --bind /proc/self/fd/{fd} {shlex.quote(k)}",
                  f"exec {fd}<&-"]
    return lines
