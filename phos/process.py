"""Whole applications: CRIU for the process, phos for its GPU contexts (docs/DESIGN.md,
"Whole applications").

`phos checkpoint --pid PID DIR` asks the process's checkpoint agent (client_stub/native/agent.cpp,
client_stub/agent.py) to freeze: every call answered, every connection to a server closed, no
call able to start. Then each context is imaged (paused: nothing runs in it) and CRIU dumps the
process tree. DIR then holds:

    process/        CRIU's images (and its dump.log)
    gpu/            a phos image store: one image per context, named ctx<ID>
    manifest.json   both halves named, with each file's SHA-256, signed with the image key

Only once both halves are in DIR does the application stop (CRIU's dump ends it, and its
contexts are ended) or, with leave_running, go on; any failure before that thaws it where it
was, and DIR is removed. `phos restore DIR --process` checks the manifest and every file, restores
the contexts on a server (pushed into its inbox when it is reached over the network), restores
the process with CRIU, and thaws it against that server: its stub attaches to the restored
contexts. The agent's connection is the one resource outside the dump: the dump names it
external, and the restore puts a new connection of its own in its place, on which it says thaw.
"""
import concurrent.futures
import contextlib
import hashlib
import hmac
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time

from phos.base import settings
from phos.client_stub.agent import address as agent_address
from phos.schema import admin_pb2 as pb

FORMAT = "phos-process"
VERSION = 2                  # 2: a file's digest is its pieces' (tree_digests)
DIGEST_PIECE = 16 << 20
DIGEST_THREADS = min(8, os.cpu_count() or 1)
KEEP_SECONDS = 600.0        # a frozen context waits this long for its client (the dump runs meanwhile)
AGENT_TIMEOUT = 120.0       # seconds a freeze may take: the calls in flight end first
MANIFEST = "manifest.json"
MIN_CRIU = (4, 0)


class ProcessError(Exception):
    """A whole-process checkpoint, restore or migration that cannot be done, saying why."""


# -- CRIU ----------------------------------------------------------------------------------------
def find_criu():
    """(path, version) of the criu to run: PHOS_CRIU, else the set-up's, else the PATH's; CRIU 4
    or newer (3.x fails on current kernels: 'Unexpected rt vDSO area bounds')."""
    candidates = [settings.criu()] if settings.criu() else [
        os.path.join(settings.prefix(), "criu", "sbin", "criu"), shutil.which("criu") or ""]
    tried = []
    for path in filter(None, candidates):
        if not os.access(path, os.X_OK):
            tried.append(f"{path}: not an executable file")
            continue
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired) as e:
            tried.append(f"{path}: {e}")
            continue
        m = re.search(r"Version:\s*(\d+)\.(\d+)", out)
        if m is None:
            tried.append(f"{path}: says no version")
        elif (int(m[1]), int(m[2])) < MIN_CRIU:
            tried.append(f"{path} is CRIU {m[1]}.{m[2]}, too old (4 or newer is needed)")
        else:
            return path, f"{m[1]}.{m[2]}"
    where = "; ".join(tried) or "none found (PHOS_CRIU unset, none under PHOS_PREFIX, none on the PATH)"
    raise ProcessError(f"whole-process checkpoints need CRIU 4 or newer: {where}. scripts/setup.sh builds it "
                       f"into {settings.prefix()}, or set PHOS_CRIU")


def run_criu(args, log_dir, log_name, pass_fds=()):
    """Run criu with `args`, its log in log_dir; ProcessError with the log's errors if it fails."""
    criu, _ = find_criu()
    cmd = [criu, *args, "-o", log_name, "-v4", "--work-dir", log_dir]
    r = subprocess.run(cmd, capture_output=True, text=True, pass_fds=pass_fds)
    if r.returncode != 0:
        raise ProcessError(f"criu {args[0]} failed: {criu_errors(os.path.join(log_dir, log_name), r.stderr)}")


def criu_errors(log_path, stderr=""):
    """CRIU's own words for a failure: the log's error lines, and a hint for the usual causes."""
    try:
        with open(log_path, errors="replace") as f:
            # where root lacks CAP_SYS_RESOURCE every run logs this one, harmlessly
            lines = [ln.strip() for ln in f if ("Error" in ln or "error" in ln.split(":", 1)[0])
                     and "RLIMIT_NOFILE" not in ln]
    except OSError:
        lines = []
    text = " | ".join(lines[-4:]) or stderr.strip() or "no log"
    if re.search(r"tty|TTY|terminal", text):
        text += " (a process on a terminal needs --shell-job)"
    if "Can't fork for" in text or "File exists" in text:
        text += " (its PID is taken: the original still runs, or has not been reaped yet)"
    return text


# -- the process's checkpoint agent ----------------------------------------------------------------
class Agent:
    """A connection to the checkpoint agent of process `pid` (or one made anew by a restore)."""

    def __init__(self, pid=None, sock=None):
        self.pid, self.buffer = pid, b""
        if sock is not None:
            self.sock = sock
            return
        if not os.path.exists(f"/proc/{pid}"):
            raise ProcessError(f"no process {pid}")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(agent_address(pid))
        except OSError:
            self.sock.close()
            raise ProcessError(f"process {pid} has no phos checkpoint agent: it is not a CUDA program on phos's stub, "
                               "or has made no context yet") from None

    def ask(self, line, timeout=AGENT_TIMEOUT):
        self.sock.sendall(line.encode() + b"\n")
        return self.answer(timeout)

    def answer(self, timeout=AGENT_TIMEOUT):
        self.sock.settimeout(timeout)
        data = self.buffer
        try:
            while b"\n" not in data:
                got = self.sock.recv(4096)
                if not got:
                    raise ProcessError(f"process {self.pid}'s agent hung up")
                data += got
        except socket.timeout:
            raise ProcessError(f"process {self.pid}'s agent did not answer within {timeout:g} s") from None
        line, self.buffer = data.split(b"\n", 1)
        reply = json.loads(line)
        if "error" in reply:
            raise ProcessError(f"process {self.pid}: {reply['error']}")
        return reply

    def close(self):
        self.sock.close()


def contexts_of(pid):
    """The agent's view of process `pid`: {stub, pid, contexts: [{ctx, server}]}."""
    agent = Agent(pid)
    try:
        return agent.ask("contexts", timeout=10)
    finally:
        agent.close()


# -- the admin API ---------------------------------------------------------------------------------
@contextlib.contextmanager
def admin(server):
    from phos.schema.admin_net import close_admin, open_admin
    try:
        stub = open_admin(server)
    except ValueError as e:
        raise ProcessError(f"server {server}: {e}") from None
    try:
        yield stub
    finally:
        close_admin(stub)


def ask(server, method, request, timeout=600):
    import grpc
    with admin(server) as stub:
        try:
            return getattr(stub, method)(request, timeout=timeout)
        except grpc.RpcError as e:
            raise ProcessError(f"server {server}: {method}: {e.details()}") from None


def checkpoint_context(server, ctx, store, name):
    import grpc
    with admin(server) as stub:
        try:
            for msg in stub.Checkpoint(pb.CheckpointRequest(ctx=ctx, store=store, name=name, paused=True), timeout=3600):
                if msg.finished:
                    return msg.result
        except grpc.RpcError as e:
            raise ProcessError(f"server {server}: checkpoint of context {ctx}: {e.details()}") from None
    raise ProcessError(f"server {server}: the checkpoint of context {ctx} ended without a result")


# -- the manifest ------------------------------------------------------------------------------------
def image_digest(store, name):
    """SHA-256 of a context image's manifest in `store` (its chunks are checked by their own
    fingerprints as they load)."""
    from phos.snapshot import ImageError, open_store, read_image
    try:
        return hashlib.sha256(read_image(open_store(store, create=False), name, check_chunks=False).raw).hexdigest()
    except (ImageError, OSError) as e:
        raise ProcessError(f"image {name} in {store}: {e}") from None


def piece_digest(path, offset):
    """SHA-256 of the DIGEST_PIECE bytes of a file at offset (fewer at its end)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return hashlib.sha256(f.read(DIGEST_PIECE)).digest()


def tree_digests(root):
    """{relative path: digest} of every regular file under root, logs aside. A file's digest is
    the SHA-256 of its pieces' SHA-256s, the pieces hashed on several threads (hashlib lets go
    of the interpreter): CRIU's pages file is most of a process image, and one SHA-256 of it
    alone is seconds of a checkpoint's and of a restore's time."""
    pieces = {}
    for base, dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(base, name)
            if name.endswith(".log") or not os.path.isfile(path) or os.path.islink(path):
                continue
            pieces[path] = range(0, max(os.path.getsize(path), 1), DIGEST_PIECE)
    with concurrent.futures.ThreadPoolExecutor(DIGEST_THREADS) as pool:
        digests = {path: [pool.submit(piece_digest, path, offset) for offset in offsets]
                   for path, offsets in pieces.items()}
        return {os.path.relpath(path, root): hashlib.sha256(b"".join(d.result() for d in ds)).hexdigest()
                for path, ds in digests.items()}


def signature(body):
    from phos.snapshot.image_key import image_key
    return hmac.new(image_key(), json.dumps(body, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def write_manifest(directory, body):
    path = os.path.join(directory, MANIFEST)
    with open(path + ".tmp", "w") as f:
        json.dump({**body, "signature": signature(body)}, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def read_manifest(directory):
    """The manifest of a process image, its signature checked and the GPU images it names
    (check_files checks its files)."""
    from phos.snapshot import ImageError
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            body = json.load(f)
    except FileNotFoundError:
        raise ProcessError(f"{directory} is no process image: it has no {MANIFEST}") from None
    except (OSError, ValueError) as e:
        raise ProcessError(f"{path} cannot be read: {e}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("version") != VERSION:
        raise ProcessError(f"{path} is not a {FORMAT} v{VERSION} manifest")
    sig = body.pop("signature", None)
    try:
        good = isinstance(sig, str) and hmac.compare_digest(sig, signature(body))
    except ImageError as e:
        raise ProcessError(f"{path}: the image key: {e}") from None
    if not good:
        raise ProcessError(f"{path} is unsigned or its signature does not match (damaged, edited, or signed "
                           "with another image key)")
    for c in body["contexts"] if body.get("gpu_store") else ():
        if c["image"] and image_digest(body["gpu_store"], c["image"]) != c["manifest_sha256"]:
            raise ProcessError(f"image {c['image']} in {body['gpu_store']} is not the one checkpointed with the process")
    return body


def check_files(directory, body):
    """Every file of the image is the one its manifest names, and nothing else is where CRIU reads."""
    for part in ("process", "gpu"):
        named = body.get("files", {}).get(part, {})
        found = tree_digests(os.path.join(directory, part))
        for rel, digest in named.items():
            if rel not in found:
                raise ProcessError(f"{directory}: {part}/{rel} is missing")
            if found[rel] != digest:
                raise ProcessError(f"{directory}: {part}/{rel} is damaged (its SHA-256 differs from the manifest's)")
        extra = sorted(set(found) - set(named))
        if extra and part == "process":      # CRIU would restore from what it finds: nothing unsigned may be there
            raise ProcessError(f"{directory}: {part}/{extra[0]} is not in the manifest")


# -- checkpoint ------------------------------------------------------------------------------------
def checkpoint(pid, directory, leave_running=False, shell_job=False, live_on=None, gpu_store=None):
    """Checkpoint process `pid` whole into `directory` (new or empty). Returns a report dict.
    live_on: the server its contexts were moved to (migrate): they stay live there, kept for the
    process's return, and are not imaged. gpu_store: the image store the contexts go into instead
    of directory/gpu (the server's host store: pinned memory, as fast as the device copies); the
    manifest names it and each image's manifest digest."""
    find_criu()
    if os.path.exists(directory) and os.listdir(directory):
        raise ProcessError(f"{directory} is not empty: a process image goes into a new directory")
    t0 = time.perf_counter()
    info = contexts_of(pid)
    server_of = {c["ctx"]: live_on or c["server"] for c in info["contexts"]}
    for ctx, server in server_of.items():       # each waits for its client through the dump
        ask(server, "KeepContext", pb.KeepContextRequest(ctx=ctx, seconds=KEEP_SECONDS), timeout=30)
    made = not os.path.exists(directory)
    os.makedirs(os.path.join(directory, "process"), exist_ok=True)
    agent = Agent(pid)
    try:
        t_freeze = time.perf_counter()
        frozen = agent.ask("freeze")
        for c in frozen["contexts"]:      # made since we asked: kept now, within its orphan grace
            if c["ctx"] not in server_of:
                server_of[c["ctx"]] = live_on or c["server"]
                ask(server_of[c["ctx"]], "KeepContext", pb.KeepContextRequest(ctx=c["ctx"], seconds=KEEP_SECONDS),
                    timeout=30)
        t_gpu = time.perf_counter()
        gpu = {}
        store = os.path.abspath(gpu_store) if gpu_store else os.path.join(directory, "gpu")
        for c in frozen["contexts"] if live_on is None else ():
            name = f"pid{pid}-ctx{c['ctx']}-{time.time_ns()}" if gpu_store else f"ctx{c['ctx']}"
            r = checkpoint_context(server_of[c["ctx"]], c["ctx"], store, name)
            gpu[c["ctx"]] = {"image": r.name, "bytes": r.bytes, "seconds": r.seconds,
                             "manifest_sha256": image_digest(store, r.name) if gpu_store else ""}
        t_cpu = time.perf_counter()
        # --leave-running alone: the process dies (CRIU's dump ends it) only once both halves are in
        pids = tree_pids(pid)        # frozen: its threads that could fork wait for the driver's lock, or compute
        args = ["dump", "-t", str(pid), "-D", os.path.join(directory, "process"), f"--external=unix[{frozen['socket']}]"]
        args += ["--leave-running"] * leave_running + ["--shell-job"] * shell_job
        run_criu(args, os.path.join(directory, "process"), "dump.log")
        t_done = time.perf_counter()
        body = {"format": FORMAT, "version": VERSION, "pid": pid, "pids": pids, "stub": frozen["stub"],
                "socket": frozen["socket"],
                "shell_job": shell_job, "created": time.time(), "gpu_store": store if gpu_store else "",
                "contexts": [{"ctx": c["ctx"], "server": server_of[c["ctx"]], "image": gpu.get(c["ctx"], {}).get("image", ""),
                              "manifest_sha256": gpu.get(c["ctx"], {}).get("manifest_sha256", "")}
                             for c in frozen["contexts"]],
                "files": {part: tree_digests(os.path.join(directory, part)) for part in ("process", "gpu")}}
        write_manifest(directory, body)
    except BaseException:
        with contextlib.suppress(OSError, ProcessError, ValueError):
            agent.ask("thaw")         # where it was: the application goes on unharmed
        agent.close()
        remove_image(directory, made)
        raise
    t_thaw = time.perf_counter()
    try:
        if leave_running:
            agent.ask("thaw")
    finally:
        agent.close()
    if not leave_running and live_on is None:
        for c in frozen["contexts"]:        # the image holds them now; nobody comes back for these
            with contextlib.suppress(ProcessError):
                ask(server_of[c["ctx"]], "KillContext", pb.KillContextRequest(ctx=c["ctx"]), timeout=30)
    t_end = time.perf_counter()
    return {"pid": pid, "directory": directory, "stub": frozen["stub"], "leave_running": leave_running,
            "contexts": [{"ctx": c["ctx"], **gpu.get(c["ctx"], {})} for c in frozen["contexts"]],
            "gpu_bytes": sum(g["bytes"] for g in gpu.values()),
            "process_bytes": sum(os.path.getsize(os.path.join(directory, "process", f)) for f in body["files"]["process"]),
            "ms": {"agent": (t_freeze - t0) * 1e3, "freeze": (t_gpu - t_freeze) * 1e3, "gpu": (t_cpu - t_gpu) * 1e3,
                   "cpu": (t_done - t_cpu) * 1e3, "manifest": (t_thaw - t_done) * 1e3,
                   "thaw" if leave_running else "end": (t_end - t_thaw) * 1e3, "total": (t_end - t0) * 1e3}}


def remove_image(directory, made):
    """What a failed checkpoint wrote: the directory if it made it, else its parts."""
    if made:
        shutil.rmtree(directory, ignore_errors=True)
        return
    for part in ("process", "gpu", MANIFEST):
        path = os.path.join(directory, part)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.unlink(path)


# -- restore ----------------------------------------------------------------------------------------
def pid_state(pid):
    """The state letter of process pid ('Z' a zombie), or None if there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def tree_pids(pid):
    """pid and its descendants' PIDs, which CRIU dumps with it and restores under the same PIDs."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def check_pid_free(body, wait=10.0):
    """CRIU restores the processes under their old PIDs: refuse, by name, a restore whose PIDs are
    taken. A dumped process not yet reaped is waited for a while (the dump's children go to init,
    which reaps them in its own time)."""
    pid, pids = body["pid"], body.get("pids", [body["pid"]])
    deadline = time.monotonic() + wait
    while any(pid_state(p) == "Z" for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    if pid_state(pid) not in (None, "Z"):
        try:
            running = {c["ctx"] for c in contexts_of(pid)["contexts"]}
        except ProcessError:
            running = set()
        if running and running >= {c["ctx"] for c in body["contexts"]}:
            raise ProcessError(f"this image already runs: process {pid} holds its contexts (restore it again once "
                               "that process is gone)")
    for p in pids:
        state = pid_state(p)
        what = "the process" if p == pid else "a child of the process"
        if state == "Z":
            raise ProcessError(f"PID {p}, which {what} is restored under, is held by a process that exited and has "
                               "not been reaped by its parent")
        if state is not None:
            raise ProcessError(f"PID {p}, which {what} is restored under, is taken by another process")


def restore_contexts(body, directory, server):
    """Each imaged context restored on `server`; pushed into its inbox when the server is reached
    over the network (it need not see this directory)."""
    from phos.schema.admin_net import over_network
    store = body.get("gpu_store") or os.path.join(directory, "gpu")
    for c in body["contexts"]:
        if not c["image"]:
            continue          # live on `server` already (migrate)
        if over_network(server):
            push_and_restore(server, c["ctx"], store, c["image"])
            continue
        r = ask(server, "Restore", pb.RestoreRequest(store=store, name=c["image"]))
        if r.ctx != c["ctx"]:
            raise ProcessError(f"image {c['image']} restored context {r.ctx}, not {c['ctx']}")


def forget_contexts(body, server):
    """End the contexts restored for a process that will not be: nobody will attach to them."""
    for c in body["contexts"]:
        if c["image"]:
            with contextlib.suppress(ProcessError):
                ask(server, "KillContext", pb.KillContextRequest(ctx=c["ctx"]), timeout=30)


def push_and_restore(server, ctx, store, name):
    import asyncio

    from phos.gpu_server.control.handoff_net import RemoteTarget
    from phos.schema.admin_net import client_curve
    from phos.schema.cuda_types import CudaError

    async def push():
        async with RemoteTarget(server, ctx, client_curve()) as target:
            await target.send(store, name)
            await target.restore(store, name, full=True)
    try:
        asyncio.run(push())
    except (CudaError, ValueError) as e:
        raise ProcessError(f"server {server}: restoring context {ctx}: {getattr(e, 'message', e)}") from None


def thaw_line(server):
    """What a restored process is told: its server, and the CURVE key files it reaches it with
    (ours: PHOS_SERVER_KEY, PHOS_CLIENT_KEY) when it is reached over the network."""
    from phos.schema.admin_net import over_network
    words = [server]
    if over_network(server) and settings.server_key() and settings.client_key():
        words += [os.path.abspath(settings.server_key()), os.path.abspath(settings.client_key())]
    if any(not w or any(c.isspace() for c in w) for w in words):
        raise ProcessError(f"a server address or key file with spaces cannot be passed to the process: {words}")
    return "thaw " + " ".join(words)


def restore(directory, server):
    """Restore the process image in `directory` with its contexts on `server`, then thaw it there.
    Returns a report."""
    t0 = time.perf_counter()
    find_criu()
    body = read_manifest(directory)
    check_pid_free(body)
    thaw = thaw_line(server)
    t_check = time.perf_counter()
    # the files are checked as the contexts are restored (the server checks its images itself);
    # a file found damaged then ends the contexts restored for the process
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        files_checked = pool.submit(check_files, directory, body)
        try:
            restore_contexts(body, directory, server)
        finally:
            files_error = files_checked.exception()
    if files_error is not None:
        forget_contexts(body, server)
        raise files_error
    t_gpu = time.perf_counter()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    work = tempfile.mkdtemp(prefix="phos-restore-")
    try:
        args = ["restore", "-D", os.path.join(directory, "process"), "--restore-detached",
                f"--inherit-fd=fd[{theirs.fileno()}]:socket:[{body['socket']}]"] + ["--shell-job"] * body["shell_job"]
        try:
            run_criu(args, work, "restore.log", pass_fds=(theirs.fileno(),))
        except ProcessError:
            forget_contexts(body, server)
            raise
        theirs.close()
        t_cpu = time.perf_counter()
        reply = Agent(pid=body["pid"], sock=ours).ask(thaw)
        t_end = time.perf_counter()
    finally:
        ours.close()
        theirs.close()
        shutil.rmtree(work, ignore_errors=True)
    if reply.get("lost"):
        raise ProcessError(f"process {body['pid']} is restored, but a context of it is lost: {reply['lost']}")
    return {"pid": body["pid"], "server": server, "contexts": [c["ctx"] for c in body["contexts"]],
            "ms": {"check": (t_check - t0) * 1e3, "gpu": (t_gpu - t_check) * 1e3, "cpu": (t_cpu - t_gpu) * 1e3,
                   "attach": (t_end - t_cpu) * 1e3, "total": (t_end - t0) * 1e3}}


# -- migrate ----------------------------------------------------------------------------------------
# On the target host, through `remote` (ssh HOST, or nsenter into another mount namespace): the
# image arrives as a tar stream on stdin, is restored by that host's phos and removed.
REMOTE_RESTORE = ('d=$(mktemp -d) && tar -xf - -C "$d" && python3 -m phos.cli restore "$d" --process '
                  '--server "$1" --json; rc=$?; rm -rf "$d"; exit $rc')


def migrate(pid, to, directory=None, shell_job=False, remote=None):
    """Move process `pid` whole to the server `to`: its contexts by live handoff (the application
    runs meanwhile), then the process by CRIU through `directory` (default a private temporary
    one), restored against `to`: here, or on the host `remote` reaches (a command prefix), to
    which the image is sent. Returns a report: each handoff's downtime, the process's, and where
    the time went."""
    t0 = time.perf_counter()
    find_criu()
    handoffs = []
    for c in contexts_of(pid)["contexts"]:
        r = ask(c["server"], "Handoff", pb.HandoffRequest(ctx=c["ctx"], to=to))
        handoffs.append({"ctx": c["ctx"], "downtime_ms": r.downtime_ms, "seconds": r.seconds})
    t_moved = time.perf_counter()
    own = directory is None
    directory = directory or os.path.join(tempfile.mkdtemp(prefix="phos-migrate-"), "image")
    try:
        cp = checkpoint(pid, directory, shell_job=shell_job, live_on=to)
    except BaseException:
        if own:
            shutil.rmtree(os.path.dirname(directory), ignore_errors=True)
        raise        # the process goes on, its contexts at `to`
    t_dumped = time.perf_counter()
    try:
        rs = send_and_restore(directory, to, remote) if remote else restore(directory, to)
    except ProcessError as e:       # the process is only in its image now: keep it
        raise ProcessError(f"{e}; the process's image stays in {directory}: restore it with "
                           f"`phos restore {directory} --process --server {to}`") from None
    t_end = time.perf_counter()
    if own:
        shutil.rmtree(os.path.dirname(directory), ignore_errors=True)
    stopped = cp["ms"]["freeze"] + cp["ms"]["cpu"] + cp["ms"]["manifest"] + cp["ms"]["end"] + (t_end - t_dumped) * 1e3
    return {"pid": pid, "to": to, "remote": remote or "", "handoffs": handoffs, "process_bytes": cp["process_bytes"],
            "downtime_ms": {"process": stopped, "contexts": max((h["downtime_ms"] for h in handoffs), default=0.0)},
            "ms": {"handoffs": (t_moved - t0) * 1e3, "freeze": cp["ms"]["freeze"], "dump": cp["ms"]["cpu"],
                   "manifest": cp["ms"]["manifest"], "restore": rs["ms"]["cpu"], "attach": rs["ms"]["attach"],
                   "send_and_restore": (t_end - t_dumped) * 1e3, "total": (t_end - t0) * 1e3}}


def send_and_restore(directory, to, remote):
    """The image in `directory` sent to the host `remote` reaches and restored there against `to`;
    that host's restore's report."""
    import shlex
    tar = subprocess.Popen(["tar", "-C", directory, "-cf", "-", "."], stdout=subprocess.PIPE)
    try:
        r = subprocess.run([*shlex.split(remote), "sh", "-c", REMOTE_RESTORE, "sh", to], stdin=tar.stdout,
                           capture_output=True, text=True)
    finally:
        tar.stdout.close()
        tar.wait()
    if r.returncode != 0:
        raise ProcessError(f"restoring through `{remote}`: {r.stderr.strip()[-2000:] or f'exit status {r.returncode}'}")
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise ProcessError(f"restoring through `{remote}`: no report came back ({r.stdout[-500:]!r})") from None
