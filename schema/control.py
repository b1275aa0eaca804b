"""What the admin API's server and its clients share (schema/admin.proto): where a server's
admin socket is, and a checkpoint's result (a CheckpointResult message) as the dict
`phos checkpoint --json` prints, and back.

Imports no server code, and no capnp: the command line loads it for every client command.
"""
import os
import stat
import urllib.parse

from phos.base import settings

# a checkpoint's result: its dict's scalar keys, the same in CheckpointResult (admin.proto)
CHECKPOINT_SCALARS = ("name", "bytes", "copied_bytes", "stored_bytes", "new_chunks", "reused_chunks", "seconds", "mode",
                      "paused", "pause_ms", "recopied_chunks", "cut_seq", "manifest_bytes")


def _beside(server, ipc_suffix, tcp_name):
    """A path of the server listening on `server`: its ipc socket's path with ipc_suffix, or, for
    tcp://HOST:PORT, tcp_name (which names {port}) in the user's socket directory, where an
    abstract socket's (ipc://@NAME) are too, named after it."""
    url = urllib.parse.urlparse(server)
    if url.scheme == "ipc" and server.startswith("ipc://@"):
        # an abstract socket has no directory; beside its name, its files landed in whatever
        # directory the server started in, where the CLI found them only from there
        name = urllib.parse.quote(server[len("ipc://@"):], safe="")
        return os.path.join(settings.socket_directory(), "@" + name + ipc_suffix)
    if url.scheme == "ipc":
        return server[len("ipc://"):] + ipc_suffix
    if url.scheme == "tcp":
        return os.path.join(settings.socket_directory(), tcp_name.format(port=url.port))
    raise ValueError(f"server address {server!r}: use ipc://PATH or tcp://HOST:PORT")


def admin_socket(server):
    """The admin socket of the server listening on `server` (ipc://PATH or tcp://HOST:PORT)."""
    return "unix:" + _beside(server, ".admin", "admin-{port}.sock")


def module_cache_dir(server):
    """Where the server listening on `server` keeps its clients' module images (gpu_server/worker/module_cache.py)."""
    return _beside(server, ".modules", "modules-{port}")


def emu_ledger_dir(server, device=0):
    """Where the emu workers of the server listening on `server` account the memory of its emu
    device `device` together (gpu_server/backends/emu_memory.py DeviceLedger): each device's is its own."""
    return _beside(server, f".emu-memory-{device}", f"emu-memory-{{port}}-{device}")


def tenant_ledger_dir(server):
    """Where the workers of the server listening on `server` account the device memory each tenant
    holds (PHOS_TENANT_QUOTA): a DeviceLedger directory a tenant (gpu_server/device_ledger.py)."""
    return _beside(server, ".tenants", "tenants-{port}")


def remove_socket_file(endpoint):
    """Remove the file of an ipc:// endpoint whose socket is closed (an abstract one has none)."""
    if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):
        try:
            os.unlink(endpoint[len("ipc://"):])
        except OSError:
            pass


def private_directory(path, create=False, what="socket directory"):
    """Check that the directory holding a server's sockets (or another private file of the
    user's, such as the image key: `what` names it) is this user's own and that nobody else may
    write in it (else another user could put a socket of theirs in place of the server's);
    with create, make it (mode 0700) when it is missing. Raises ValueError."""
    if create:
        os.makedirs(path, mode=0o700, exist_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise ValueError(f"{what} {path} does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{what} {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise ValueError(f"{what} {path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
                         "another user could replace the files in it")
    if st.st_mode & 0o022:
        raise ValueError(f"{what} {path} is writable by others (mode {st.st_mode & 0o777:o})")
    safe_ancestors(path, what)


def safe_ancestors(path, what="socket directory"):
    """Check every directory above path as OpenSSH checks authorized_keys' path (safe_path):
    each must belong to root or to this user, and none may be writable by others, or whoever
    could write there could replace the whole tree below with one of their own. A directory
    writable by all but sticky (/tmp) is allowed: nobody else may rename or remove an entry of
    ours in it, and the entry below is checked to be ours or root's. Both the path as named (a
    link on the way is an entry too) and where it leads are checked. Raises ValueError."""
    uid = os.geteuid()
    named = os.path.abspath(path)
    for chain in (named, os.path.realpath(named)):
        d = os.path.dirname(chain)
        while True:
            try:
                st = os.lstat(d)
            except OSError as e:
                raise ValueError(f"{what} {path}: its ancestor {d} cannot be checked: {e.strerror}") from None
            if st.st_uid not in (0, uid):
                raise ValueError(f"{what} {path}: its ancestor {d} belongs to uid {st.st_uid}, neither root nor this "
                                 f"user (uid {uid}): that user could replace {path}")
            if st.st_mode & 0o022 and not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX) \
                    and not stat.S_ISLNK(st.st_mode):
                raise ValueError(f"{what} {path}: its ancestor {d} is writable by others (mode "
                                 f"{st.st_mode & 0o7777:o}, not sticky): they could replace {path}")
            if d == "/":
                break
            d = os.path.dirname(d)


def checkpoint_message(result):
    """A checkpoint's result dict (snapshot/engine.py Checkpoint.finish's, with the messages served)
    as the CheckpointResult message its worker answers with (gpu_server/worker/control.py)."""
    from phos.schema import admin_pb2 as pb
    served = result.get("messages_served") or {"before": [0, 0.0], "during": [0, 0.0]}
    return pb.CheckpointResult(
        **{k: result[k] for k in CHECKPOINT_SCALARS}, phase_ms=result["phase_ms"],
        trace_ms=[pb.TraceStep(at_ms=at, step=step, ms=ms) for at, step, ms in result["trace_ms"]],
        trace_from=result["trace_from"],
        served_before=pb.Served(messages=served["before"][0], ms=served["before"][1]),
        served_during=pb.Served(messages=served["during"][0], ms=served["during"][1]))


def checkpoint_result(msg):
    """A CheckpointResult message as a dict, keys in the order the worker gives them."""
    out = {k: getattr(msg, k) for k in CHECKPOINT_SCALARS}
    out["phase_ms"] = dict(msg.phase_ms)
    out["trace_ms"] = [[t.at_ms, t.step, t.ms] for t in msg.trace_ms]
    out["trace_from"] = msg.trace_from
    out["messages_served"] = {"before": [msg.served_before.messages, msg.served_before.ms],
                              "during": [msg.served_during.messages, msg.served_during.ms]}
    return out
