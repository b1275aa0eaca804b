"""The checkpoint agent of the Python client: how `phos checkpoint --pid`, `phos restore --process`
and `phos migrate` reach this process. The native stub's twin (client_stub/native/agent.cpp says
the protocol; phos/process.py is the other end).

A daemon thread listens on the abstract Unix socket "phos-agent-<pid>" for peers of our own user
or root; each connection carries one request line (contexts, freeze, then thaw [SERVER [SERVER_KEY
CLIENT_KEY]]) and
gets JSON lines back. A freeze holds the driver's lock until the thaw, so no call starts while
the process is dumped."""
import json
import logging
import os
import socket
import struct
import threading

from phos.base import settings
from phos.schema.cuda_types import CudaError

log = logging.getLogger("phos.client")

FROZEN_TICKS = 600        # seconds of running time a freeze waits for its thaw (a dump stops that clock)
MAX_LINE = 4096
_process = None           # the driver's contexts as the agent sees them (driver.py's AgentView), given to start()
_start_lock = threading.Lock()
_listening = []           # the listener, which a forked child must not keep (it has no agent thread)


def address(pid):
    """The agent's abstract socket name for process `pid` (phos/process.py connects to it)."""
    return f"\0phos-agent-{pid}"


def start(process):
    """Serve the contexts of `process` (the driver's AgentView) from a thread of their own, once
    a process. The driver hands them over, so this module needs no import of it."""
    global _process
    with _start_lock:
        if _process is not None:
            return
        _process = process
    os.register_at_fork(after_in_child=_forget_listener)
    threading.Thread(target=_run, name="phos-agent", daemon=True).start()


def _forget_listener():
    while _listening:
        _listening.pop().close()


def _listen():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(address(os.getpid()))
        s.listen(4)
    except OSError as e:
        log.info("checkpoint agent: cannot listen: %s", e)
        s.close()
        return None
    _listening[:] = [s]
    return s


def _peer_allowed(conn):
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid in (0, os.getuid())


def _read_line(conn, ticks):
    """One line, waiting at most `ticks` seconds of our running time; None on hang-up or silence."""
    data = b""
    waited = 0
    conn.settimeout(1.0)
    while waited < ticks and len(data) <= MAX_LINE:
        try:
            got = conn.recv(512)
        except socket.timeout:
            waited += 1
            continue
        except OSError:
            return None
        if not got:
            return None
        data += got
        if b"\n" in data:
            return data.split(b"\n", 1)[0].decode(errors="replace")
    return None


def _write(conn, obj):
    try:
        conn.sendall(json.dumps(obj).encode() + b"\n")
    except OSError:
        pass          # the peer went: it learns nothing more


def _contexts(process):
    return [{"ctx": ctx_id, "server": settings.server()} for ctx_id in process.contexts]


def _freeze(conn, listener):
    process = _process
    with process.lock:
        frozen, lost = [], []
        for ctx_id, c in list(process.contexts.items()):
            try:
                c.detach()
                frozen.append(ctx_id)
            except CudaError as e:
                lost.append(f"context {ctx_id}: {e.message}")
        before = settings.server()
        if lost:        # nothing to image for a lost context, and the cut would lie
            _resume(process, frozen, before)
            _write(conn, {"error": "a context of this process is lost: " + "; ".join(lost)})
            return listener
        process.close_front_end()
        _write(conn, {"frozen": True, "stub": "python", "pid": os.getpid(), "socket": os.fstat(conn.fileno()).st_ino,
                      "contexts": [{"ctx": i, "server": before} for i in frozen]})
        _listening.clear()
        listener.close()         # the image holds no listener a restore would bind again
        line = _read_line(conn, FROZEN_TICKS)
        if line is None or not line.startswith("thaw"):
            log.error("checkpoint agent: no thaw came (%s): going on where we were", line or "hang-up")
            line = "thaw"
        server, *keys = line[5:].split()[:3] or [""]
        if server:
            os.environ[settings.server.name] = server      # where later contexts are made too
        if len(keys) == 2:        # the CURVE key files of that server (PHOS_SERVER_KEY, PHOS_CLIENT_KEY)
            os.environ[settings.server_key.name], os.environ[settings.client_key.name] = keys
        resumed, lost = _resume(process, frozen, server or before)
        _write(conn, {"thawed": True, "stub": "python", "pid": os.getpid(), "contexts": resumed, "lost": "; ".join(lost)})
        return None


def _resume(process, frozen, server):
    why = process.reach_front_end()
    if why:
        log.error("checkpoint agent: the front end at %s: %s", server, why)
    resumed, lost = [], []
    for ctx_id in frozen:
        try:
            process.contexts[ctx_id].resume(server)
            resumed.append(ctx_id)
        except CudaError as e:
            log.error("checkpoint agent: context %d: %s", ctx_id, e.message)
            lost.append(f"context {ctx_id}: {e.message}")
    return resumed, lost


def _serve(conn, listener):
    line = _read_line(conn, 10)
    if line == "contexts":
        with _process.lock:
            _write(conn, {"stub": "python", "pid": os.getpid(), "contexts": _contexts(_process)})
    elif line == "freeze":
        return _freeze(conn, listener)
    elif line is not None:
        _write(conn, {"error": f"unknown request: {line[:64]}"})
    return listener


def _run():
    listener = None
    while True:
        if listener is None:
            listener = _listen()
            if listener is None:
                return
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            if _peer_allowed(conn):
                listener = _serve(conn, listener)
