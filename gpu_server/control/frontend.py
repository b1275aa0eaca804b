"""The front end: handshake, device queries, and one worker process per context.

It runs on uvloop and never sits on the hot path: after ctxCreate the client talks
to its worker directly. It watches every worker, and on SIGTERM stops them all.
"""
import asyncio
import collections
import contextvars
import ipaddress
import logging
import os
import re
import secrets
import shutil
import signal
import sys
import time
import urllib.parse
from dataclasses import dataclass

import zmq
import zmq.asyncio

from phos.base import settings
from phos.gpu_server.backends import load_backend
from phos.gpu_server.control import cpu_share
from phos.gpu_server.client_keys import ClientKeys, frame_user_id, loopback_uid, peer_credentials, pid_alive
from phos.gpu_server.device_ledger import tenant_name
from phos.gpu_server.worker.strangers import PeerWarnings
from phos.schema import admin_pb2 as pb
from phos.schema import control_socket, wire
from phos.schema.control import (admin_socket, emu_ledger_dir, module_cache_dir, private_directory, remove_socket_file,
                                 tenant_ledger_dir)
from phos.schema.wire import build_reply, error_reply
from phos.schema.cuda_types import CudaError, CUresult

log = logging.getLogger("phos.frontend")
WORKER_START_TIMEOUT = settings.worker_start_timeout()


POOL_SIZE = settings.pool()     # pre-started workers, ready for a context or a restore
MAX_STARTING = 2          # workers being pre-started at once
REFILL_AFTER_RESTORE = 0.3    # seconds: a restored context's client re-attaches and runs its first calls first


@dataclass
class WorkerProc:
    ctx_id: int
    proc: asyncio.subprocess.Process
    endpoint: str
    token: bytes
    ctl_endpoint: str
    ctl_token: bytes
    ctl: object = None           # DEALER to the control socket, attached on first use
    ctl_lock: asyncio.Lock = None
    ctl_seq: int = 0
    ctl_waiters: dict = None     # seq -> asyncio.Queue of its replies, (kind, value)
    state: str = "running"
    client: str = ""             # who created its context (ASKER), for PHOS_MAX_CONTEXTS_PER_CLIENT
    device: int = 0              # the device it runs on, as the application numbers them


def check_listen(address, curve_secret, insecure=False):
    """Refuse a listener that others could reach without CURVE authentication: other hosts
    (tcp:// off loopback: always refused without keys), or other users of this host (loopback
    tcp://, abstract ipc://@NAME: refused unless `insecure`; then returns the warning to log).
    A socket path is the user's alone: run() checks its directory."""
    url = urllib.parse.urlparse(address)
    if url.scheme == "ipc":
        path, beside = len(address) - len("ipc://"), len(worker_endpoint(address, MAX_CTX_ID)) - len(address)
        if path + beside > IPC_PATH_MAX:
            raise ValueError(f"listen address {address!r}: its path is {path} characters long, and its workers' "
                             f"sockets beside it take {beside} more, past the {IPC_PATH_MAX} a Unix socket's path "
                             "may have: use a shorter path")
        if address.startswith("ipc://@"):
            return local_without_keys(address, "an abstract socket: any local user may connect", curve_secret, insecure)
        return None
    if url.scheme != "tcp":
        raise ValueError(f"listen address {address!r}: use ipc://PATH or tcp://HOST:PORT")
    # ZeroMQ reads "HOST:PORT@..." and "...;..." otherwise than a URL parser would: the host
    # checked must be the one it binds, so only the plain form is taken.
    if "@" in url.netloc or ";" in address or url.path not in ("", "/"):
        raise ValueError(f"listen address {address!r}: use a plain tcp://HOST:PORT")
    try:
        port = url.port
    except ValueError:
        port = None
    if not port:         # the admin socket, caches and ledgers are named after it: a second port 0 took them over
        raise ValueError(f"listen address {address!r}: name a port (not 0): the server's admin API, its caches and "
                         "its clients find it by that port")
    host = url.hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not curve_secret:
        raise ValueError(f"refusing to listen on {address}: it is reachable from other hosts; "
                         "configure CURVE keys with --auth-dir (see `phos keygen`) or listen on 127.0.0.1")
    return local_without_keys(address, "loopback TCP: any local user may connect", curve_secret, insecure) \
        if loopback else None


ASKER = contextvars.ContextVar("asker", default="")    # the client a front-end call serves (answer)
MOVED = "moved"          # a handler's field that goes to its Reply's `moved`, not to its result


def served_devices(spec, count):
    """The backend's ordinals of the devices `phos server --devices` names ("all", or a list such as
    "1" or "0,1") among the `count` it has, in the order the application numbers them: as with
    CUDA_VISIBLE_DEVICES, `--devices 1` shows the application one device, 0, which is device 1.
    Raises ValueError for an empty list, a device named twice, or one the backend lacks."""
    if spec == "all":
        return list(range(count))
    try:
        picked = [int(part) for part in spec.split(",")]
    except ValueError:
        raise ValueError(f"--devices {spec!r}: give `all`, or device numbers separated by commas (such as 0,1)") from None
    for d in picked:
        if not 0 <= d < count:
            raise ValueError(f"--devices {spec}: there is no device {d}: this backend has {count} device(s)"
                             + (f", 0 to {count - 1}" if count else ""))
        if picked.count(d) > 1:
            raise ValueError(f"--devices {spec}: device {d} is named twice")
    return picked


def local_user(frame):
    """The local user a message came from ("uid N"): by its ipc connection's peer credentials,
    or by the owner of a loopback TCP connection's other end; "" for another host's."""
    try:
        fd = frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return ""
    peer = peer_credentials(fd)
    uid = peer[1] if peer else loopback_uid(fd)
    return "" if uid is None else f"uid {uid}"


def local_without_keys(address, why, curve_secret, insecure):
    if curve_secret:
        return None
    if not insecure:
        raise ValueError(f"refusing to listen on {address} without CURVE keys ({why}); configure --auth-dir "
                         "(see `phos keygen`), listen on ipc://PATH, or pass --insecure")
    return f"listening on {address} without CURVE keys (--insecure): {why}"


REPLY_WAIT_S = 30.0          # a client's Replies wait this long for room in its queue (FrontEnd.reply)
MAX_WAITING_REPLIES = 10000  # ... at most this many of them
IPC_PATH_MAX = getattr(zmq, "IPC_PATH_MAX_LEN", 107)    # sockaddr_un's sun_path, less its terminating NUL
MAX_CTX_ID = 1 << 47                                    # FrontEnd.new_ctx_id's largest


async def accepts_connections(endpoint, timeout=1.0):
    """Whether something listens at a worker's endpoint (tcp://HOST:PORT or ipc://PATH): a
    refused or missing one is a worker that has gone, and its server with it."""
    url = urllib.parse.urlparse(endpoint)
    try:
        if url.scheme == "tcp":
            opening = asyncio.open_connection(url.hostname, url.port)
        elif url.scheme == "ipc" and not endpoint.startswith("ipc://@"):
            opening = asyncio.open_unix_connection(endpoint[len("ipc://"):])
        else:
            return True
        _, writer = await asyncio.wait_for(opening, timeout)
    except (OSError, asyncio.TimeoutError) as e:
        return isinstance(e, asyncio.TimeoutError)        # slow to accept is not gone
    writer.close()
    return True


async def send_if_room(sock, peer, frames):
    """Send a message to one peer of a mandatory ROUTER: False when its queue has no room; True
    when sent, or when the peer has gone (nobody to tell)."""
    try:
        await sock.send_multipart([peer, *frames], flags=zmq.NOBLOCK)
    except zmq.Again:
        return False
    except zmq.ZMQError as e:
        if e.errno != zmq.EHOSTUNREACH:
            raise
    return True


def worker_endpoint(listen, ctx_id):
    url = urllib.parse.urlparse(listen)
    if url.scheme == "ipc":
        return f"{listen}.ctx{ctx_id}"
    return f"tcp://{url.hostname}:*"


def control_endpoint(listen, ctx_id):
    """Control sockets stay on this host: ipc beside the listener, or loopback tcp."""
    if listen.startswith("ipc://"):
        return f"{listen}.ctl{ctx_id}"
    return "tcp://127.0.0.1:*"


@dataclass
class RecoveryOptions:
    """--recovery-dir and friends (gpu_server/worker/recovery.py)."""
    directory: str
    every_s: float = 0.0
    every_calls: int = 0
    standby: str = ""        # the server that restores our contexts if this one dies

    def worker_args(self):
        return ["--recovery-dir", self.directory, "--checkpoint-every", str(self.every_s),
                "--checkpoint-calls", str(self.every_calls), "--standby-server", self.standby]


def alive(proc):
    """Whether a worker runs: a killed one is a zombie until our child watcher reaps it."""
    return proc.returncode is None and pid_alive(proc.pid)


_LEFT_IN_SHM = re.compile(r"phos-handoff-(\d+)-[0-9a-z_]+")


def sweep_shm(directory="/dev/shm"):
    """Remove what a killed process left in shared memory: a handoff's store
    (phos-handoff-<pid>-<random>, removed when the handoff ends), once process <pid> is gone.
    (A process in another PID namespace that shares /dev/shm looks gone too: its handoff then
    fails and its context stays where it was.) Clients' files are memfds, which go with their
    last user. Returns the names removed."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _LEFT_IN_SHM.fullmatch(name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(name)
        except OSError:          # another user's: not ours to remove
            pass
    return removed


class FrontEnd:
    def __init__(self, backend_name, listen, curve=None, recovery=None, host_store=None, devices="all"):
        self.backend_name, self.listen = backend_name, listen
        self.host_store = host_store      # a HostStore's path: pre-started workers pin its memory
        self.backend = load_backend(backend_name)
        present = self.backend.devices()
        self.physical = served_devices(devices, len(present))    # the application's device ordinal -> the backend's
        self.devices = [present[i] for i in self.physical]
        # (server public, server secret, authorized client keys dir, admins' keys dir or None) or None
        self.curve = curve
        self.admin = None           # the admin API's servicer (gpu_server/control/admin.py), once serving
        self.admin_endpoint = ""    # where the admin API is served over TCP ("" only on its Unix socket)
        self.workers = {}           # ctx id -> WorkerProc
        self.pool = []              # started workers no context has claimed yet
        self.filling = 0            # pool workers being started
        self.creating = []          # the clients of contexts asked for whose workers are not yet theirs
        self.pool_size = POOL_SIZE
        self.tenant_quota = settings.tenant_quota()     # bytes all the contexts of one client may hold (0: any)
        self.tenant_host_quota = settings.tenant_host_quota()   # ... of host memory (0: any)
        self.insecure = False       # --insecure: keyless listeners other local users can reach
        self.client_keys = None     # with CURVE: the admitted clients (gpu_server/client_keys.py)
        self.killed = set()         # contexts the operator ended: never restored for their clients
        self.counts = {"checkpoints": 0, "checkpoint_seconds": 0.0, "restores": 0, "handoffs": 0}
        self.moved = {}             # ctx id -> (data endpoint of the worker a handoff gave it to, its server's standby, its server's CURVE key)
        self.waiting = {}           # client (ROUTER identity) -> its Replies waiting for room in its queue
        self.draining = set()       # the tasks sending them (FrontEnd.drain)
        self.overrun = set()        # clients told of in the log for losing Replies (once each)
        self.warnings = PeerWarnings(log)   # about what clients send, rate-limited for each
        self.recovery = recovery    # RecoveryOptions, or None
        self.recovering = {}        # ctx id -> the task restoring it from its recovery images
        self.stopping = asyncio.Event()
        self.zctx = None
        self.module_cache = None    # the modules' cache directory workers share, once serving (open_module_cache)

    # -- calls served here, one row each --------------------------------------------------
    def device(self, ordinal):
        if not 0 <= ordinal < len(self.devices):
            raise CudaError(CUresult.CUDA_ERROR_INVALID_DEVICE, f"device {ordinal} does not exist ({len(self.devices)} present)")
        return self.devices[ordinal]

    async def hello(self, a):
        if a.version != wire.PROTOCOL_VERSION:
            raise CudaError(CUresult.CUDA_ERROR_NOT_SUPPORTED,
                            f"client speaks protocol version {a.version}; this server speaks {wire.PROTOCOL_VERSION}")
        return {"text": self.backend_name, "u64s": [len(self.devices)]}

    async def driver_get_version(self, a):
        return {"u64s": [self.backend.driver_version()]}

    async def device_get_count(self, a):
        return {"u64s": [len(self.devices)]}

    async def device_get_name(self, a):
        return {"text": self.device(a.device).name}

    async def device_get_uuid(self, a):
        return {"data": self.device(a.device).uuid}

    async def device_total_mem(self, a):
        return {"u64s": [self.device(a.device).total_mem]}

    async def device_get_attribute(self, a):
        attrs = self.device(a.device).attributes
        if a.attribute not in attrs:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"device attribute {a.attribute} is not known to this server")
        return {"u64s": [attrs[a.attribute] & (2**64 - 1)]}

    async def device_compute_capability(self, a):
        return {"u64s": list(self.device(a.device).compute_capability)}

    async def device_p2p_attribute(self, a):
        for ordinal in (a.device, a.peer):
            self.device(ordinal)
        if a.device == a.peer:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_DEVICE, f"device {a.device} is not a peer of itself")
        return {"u64s": [self.backend.p2p_attribute(a.attribute, self.physical[a.device], self.physical[a.peer])]}

    async def ctx_create(self, a):
        self.device(a.device)
        most = settings.max_contexts()
        held = sum(1 for w in self.workers.values() if alive(w.proc)) + len(self.creating)
        if most > 0 and held >= most:
            raise CudaError(CUresult.CUDA_ERROR_OUT_OF_MEMORY,
                            f"this server holds {held} contexts, as many as it takes (PHOS_MAX_CONTEXTS={most})")
        client, most = ASKER.get(), settings.max_contexts_per_client()
        mine = sum(1 for w in self.workers.values() if w.client == client and alive(w.proc)) + self.creating.count(client)
        if most > 0 and mine >= most:
            raise CudaError(CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"this client holds {mine} contexts on this server, as "
                            f"many as one client may (PHOS_MAX_CONTEXTS_PER_CLIENT={most})")
        self.creating.append(client)     # counted while its worker starts: concurrent creations see it
        try:
            worker = await self.take_worker(a.device, a.flags)
        finally:
            self.creating.remove(client)
        worker.client = client
        if self.tenant_quota > 0 or self.tenant_host_quota > 0 or self.module_cache:   # its memory counts against its client's quota before
            try:                                             # the client has it; its module images are its own
                await self.control(worker, pb.TenantRequest(name=tenant_name(client)))
            except BaseException:
                self.discard(worker.ctx_id)
                raise
        cpu_share.share(self.workers.values())       # its tenant's workers weigh one worker together
        return {"u64s": [worker.ctx_id], "text": worker.endpoint, "data": worker.token}

    async def reattach(self, a):
        if a.ctx in self.killed:      # final: its client stops looking
            raise CudaError(CUresult.CUDA_ERROR_NOT_PERMITTED, f"context {a.ctx} was ended by the server's operator")
        if a.ctx in self.moved:      # handed off: its worker is elsewhere, and whom to ask if that died
            endpoint, standby, server_key = self.moved[a.ctx]
            if self.recovery is None or await accepts_connections(endpoint):
                # as Reply.moved too: a client that missed its worker's (it was not waiting) learns
                # the key of a server with keys of its own, which authenticates its worker
                return {"u64s": [a.ctx], "text": endpoint, "data": standby.encode(),
                        MOVED: (endpoint, standby, server_key) if server_key else None}
            # where it went is gone (that server died): it comes back here, from its recovery images,
            # as a pool asks of a server when the one it went to is lost
            log.info("context %d: the worker it was handed off to, at %s, is gone", a.ctx, endpoint)
            del self.moved[a.ctx]
        worker = self.workers.get(a.ctx)
        if (worker is None or not alive(worker.proc)) and self.recovery is not None:
            ctx, token = a.ctx, bytes(a.token)
            if ctx not in self.recovering:
                self.recovering[ctx] = asyncio.ensure_future(self.recover(ctx, token))
                self.recovering[ctx].add_done_callback(lambda _: self.recovering.pop(ctx, None))
            worker = await asyncio.shield(self.recovering[ctx])
        if worker is None or worker.state != "running":      # restoring, or a handoff's warm copy
            raise CudaError(CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED, f"context {a.ctx} is not on this server (yet)")
        return {"u64s": [worker.ctx_id], "text": worker.endpoint}

    async def recover(self, ctx, token):
        """The supervisor's part: a context whose worker died (here, or with its whole server)
        comes back from its latest recovery image, if the asker holds its session token."""
        from phos.gpu_server.worker.recovery import context_store
        from phos.snapshot import ImageError, latest_image, open_store
        from phos.snapshot.image_key import image_key
        store = context_store(self.recovery.directory, ctx)
        if not os.path.isdir(store):
            return None
        try:     # by the key its worker restores with (snapshot/engine.py): an image it would refuse is passed over
            name = await asyncio.to_thread(lambda: latest_image(open_store(store), ctx, token, key=image_key()))
        except (OSError, ImageError) as e:
            raise CudaError(CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED, f"context {ctx}: its recovery store {store}: {e}") from None
        if name is None:
            raise CudaError(CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED, f"context {ctx} has no recovery image here for that token")
        self.discard(ctx)              # a zombie, or stuck: it must not serve anyone again
        log.warning("context %d: its worker is gone; restoring it from recovery image %s", ctx, name)
        worker, _ = await self.restore(store, name, full=False)
        return worker

    CALLS = {
        "hello": hello,
        "driverGetVersion": driver_get_version,
        "deviceGetCount": device_get_count,
        "deviceGetName": device_get_name,
        "deviceGetUuid": device_get_uuid,
        "deviceTotalMem": device_total_mem,
        "deviceGetAttribute": device_get_attribute,
        "deviceComputeCapability": device_compute_capability,
        "deviceP2PAttribute": device_p2p_attribute,
        "ctxCreate": ctx_create,
        "reattach": reattach,
    }

    # -- workers ---------------------------------------------------------------------------
    def new_ctx_id(self):
        """Random ids, so that a context restored on another server keeps an id nobody there has."""
        while True:
            ctx_id = secrets.randbelow(MAX_CTX_ID) + 1
            if ctx_id not in self.workers and all(w.ctx_id != ctx_id for w in self.pool):
                return ctx_id

    async def take_worker(self, device=0, flags=0):
        """A pre-started worker when one is ready (device 0, no flags), else a new one; refill the pool."""
        worker = self.pool.pop(0) if self.pool and device == 0 and flags == 0 else None
        if worker is not None and worker.proc.returncode is not None:
            worker = None
        if worker is None:
            worker = await self.start_worker(device, flags)
        self.workers[worker.ctx_id] = worker
        self.fill_pool()
        return worker

    def fill_pool(self):
        """Start workers until the pool is full, a few at a time: a burst of process starts and
        device initializations would slow every running context on this host."""
        while (len(self.pool) + self.filling < self.pool_size and self.filling < MAX_STARTING
               and not self.stopping.is_set()):
            self.filling += 1
            asyncio.get_running_loop().create_task(self._add_to_pool())

    async def _add_to_pool(self):
        worker = None
        try:
            worker = await self.start_worker(0, 0, standby=True)
            await self.open_control(worker)        # a restore into it skips that step
            self.pool.append(worker)
        except CudaError as e:
            if worker is not None and worker.proc.returncode is None:
                worker.proc.kill()
            log.warning("could not pre-start a worker: %s", e.message)
            await asyncio.sleep(1)        # the device may be busy or gone: no tight retry loop
        finally:
            self.filling -= 1
        self.fill_pool()

    def open_module_cache(self):
        """The directory of the module images clients sent (gpu_server/worker/module_cache.py), or None."""
        if settings.module_cache_bytes() <= 0:
            return None
        path = module_cache_dir(self.listen)
        try:
            private_directory(path, create=True)
        except (ValueError, OSError) as e:
            log.warning("module images are not kept: %s", e)
            return None
        return path

    async def standby_worker(self, device=0):
        """A started worker that holds no context yet, for a restore on `device`: the pool's (device 0's), else a new one."""
        if device == 0 and self.pool:
            return self.pool.pop(0)
        return await self.start_worker(device, 0, standby=True)

    async def start_worker(self, device, flags, standby=False):
        """A new worker on `device` (the application's ordinal: its worker is told the backend's)."""
        ctx_id = self.new_ctx_id()
        token, ctl_token = secrets.token_bytes(16), secrets.token_bytes(16)
        endpoint = worker_endpoint(self.listen, ctx_id)
        physical = self.physical[device]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "phos.gpu_server.worker", "--backend", self.backend_name,
            "--endpoint", endpoint, "--ctx", str(ctx_id), "--control", control_endpoint(self.listen, ctx_id),
            "--device", str(physical), "--flags", str(flags), *(["--standby"] if standby else []),
            *(self.recovery.worker_args() if self.recovery else []),
            *(["--host-store", self.host_store] if self.host_store and standby else []),
            *(["--module-cache", self.module_cache] if self.module_cache else []),
            *(["--emu-ledger", emu_ledger_dir(self.listen, physical)] if self.backend_name == "emu" else []),
            *(["--tenant-ledgers", tenant_ledger_dir(self.listen), "--tenant-quota", str(self.tenant_quota),
               "--tenant-host-quota", str(self.tenant_host_quota)]
              if self.tenant_quota > 0 or self.tenant_host_quota > 0 else []),
            *(["--client-keys", self.curve[2]] if self.curve else []),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        try:
            line = await self.worker_ready(proc, token, ctl_token)
        except BaseException:
            # Its caller gave up (a failed handoff cancels the warm copy's start): a worker that
            # started nonetheless would hold a process and a device's memory, owned by no one.
            if proc.returncode is None:
                proc.kill()
            asyncio.get_running_loop().create_task(self.remove_sockets_after(proc, endpoint, ctx_id))
            raise
        if not line.startswith("READY "):
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
            if line.startswith("ERROR "):
                _, status, message = line.split(" ", 2)
                raise CudaError(int(status), message)
            raise CudaError(CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"context worker failed to start (exit {proc.returncode})")
        _, endpoint, ctl_endpoint = line.split(" ")
        worker = WorkerProc(ctx_id, proc, endpoint, token, ctl_endpoint, ctl_token, ctl_lock=asyncio.Lock(), device=device)
        asyncio.get_running_loop().create_task(self.watch(worker))
        log.info("context %d: worker %d at %s", ctx_id, proc.pid, worker.endpoint)
        return worker

    async def remove_sockets_after(self, proc, endpoint, ctx_id):
        """Once a killed worker that never became ours is gone, the socket files it may have bound."""
        await proc.wait()
        for e in (endpoint, control_endpoint(self.listen, ctx_id)):
            remove_socket_file(e)

    async def worker_ready(self, proc, token, ctl_token):
        """Hand a new worker its secrets; its READY line, or what it said instead ("" for nothing)."""
        secret = self.curve[1].decode() if self.curve else ""
        try:
            proc.stdin.write(f"{token.hex()}\n{secret}\n{ctl_token.hex()}\n".encode())
            await proc.stdin.drain()
            proc.stdin.close()
        except (ConnectionError, RuntimeError) as e:     # it died before reading: its exit says why
            log.warning("a new worker closed its stdin: %s", e)
        try:
            return (await asyncio.wait_for(proc.stdout.readline(), WORKER_START_TIMEOUT)).decode().strip()
        except asyncio.TimeoutError:
            return ""

    async def watch(self, worker):
        code = await worker.proc.wait()
        if self.workers.get(worker.ctx_id) is worker:
            del self.workers[worker.ctx_id]
        if worker in self.pool:
            self.pool.remove(worker)
        if worker.ctl is not None:
            worker.ctl.close(linger=0)
        for endpoint in (worker.endpoint, worker.ctl_endpoint):    # a killed worker leaves its socket files
            remove_socket_file(endpoint)
        log.info("context %d: worker exited with %s", worker.ctx_id, code)
        cpu_share.share(self.workers.values())

    # -- the workers' control sockets (ControlRequest, ControlReply in schema/admin.proto) ---------
    async def checkpoint(self, worker, request, on_progress=None, on_delta=None):
        """Checkpoint a worker's context (request: a pb.WorkerCheckpointRequest); returns its
        pb.CheckpointResult. on_progress(pb.CheckpointProgress) while it copies; on_delta(packed
        ImageDelta) with `early`."""
        return await self.control(worker, request, on_progress, on_delta)

    async def ctx_stats(self, worker):
        """What a worker's context holds and does: a pb.CtxStats."""
        return await self.control(worker, pb.CtxStatsRequest())

    async def thaw(self, worker):
        await self.control(worker, pb.ThawRequest())

    async def keep(self, worker, seconds):
        """Its client will hang up and come back within `seconds` (a whole-process checkpoint)."""
        await self.control(worker, pb.KeepContextRequest(ctx=worker.ctx_id, seconds=seconds))

    async def pace(self, worker, hold):
        """Hold the worker's client's calls for `hold` of the time (0: no longer)."""
        await self.control(worker, pb.PaceRequest(hold=hold))

    async def retire(self, worker, endpoint, standby, server_key=""):
        """A frozen worker's context lives at endpoint now: it tells its client (with the CURVE
        public key of the server there, z85) and exits."""
        to = pb.Destination(endpoint=endpoint, standby=standby, server_key=server_key)
        await self.control(worker, pb.RetireRequest(to=to))

    async def moving_to(self, worker, endpoint, standby, server_key=""):
        """A handoff is about to move the worker's context to endpoint: its client connects there ahead."""
        to = pb.Destination(endpoint=endpoint, standby=standby, server_key=server_key)
        await self.control(worker, pb.MovingToRequest(to=to))

    @staticmethod
    def worker_alive(worker):
        return alive(worker.proc)

    async def control(self, worker, request, on_progress=None, on_delta=None):
        """One request on a worker's control socket (one verb's request message of admin.proto's
        ControlRequest); returns its last reply's value (control_socket.read_reply: None for
        done, else the verb's result message; a failure raises CudaError). on_progress and
        on_delta get a checkpoint's replies before it.

        Requests may overlap (a stats query during a checkpoint): replies are routed by seq."""
        await self.open_control(worker)
        return await self._control_call(worker, request, on_progress, on_delta)

    async def open_control(self, worker):
        """Connect to a worker's control socket and present its token, once."""
        async with worker.ctl_lock:
            if worker.ctl is None:
                worker.ctl = self.zctx.socket(zmq.DEALER)
                worker.ctl.setsockopt(zmq.LINGER, 0)
                worker.ctl.connect(worker.ctl_endpoint)
                worker.ctl_waiters = {}
                asyncio.get_running_loop().create_task(self._control_reader(worker))
                await self._control_call(worker, pb.ControlAttachRequest(ctx=worker.ctx_id, token=worker.ctl_token))

    async def _control_call(self, worker, request, on_progress=None, on_delta=None):
        worker.ctl_seq += 1
        seq = worker.ctl_seq
        queue = worker.ctl_waiters[seq] = asyncio.Queue()
        exited = CudaError(CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED, f"the worker of context {worker.ctx_id} exited")
        try:
            # Gone already: the reader woke the calls it knew of, and a closed socket may still
            # take a send without a word (pyzmq), which would leave this call waiting for good.
            if worker.proc.returncode is not None or worker.ctl.closed:
                raise exited
            try:
                await worker.ctl.send(control_socket.request_frame(seq, request))
            except zmq.ZMQError:
                raise exited from None        # watch() closed its socket: the worker is gone
            while True:
                reply = await queue.get()
                if reply is None:
                    raise exited
                what, value = reply
                if what == "failed":
                    raise CudaError(*value)
                if what == "progress":
                    if on_progress is not None:
                        on_progress(value)
                elif what == "delta":
                    if on_delta is not None:
                        on_delta(value)
                else:
                    return value
        finally:
            worker.ctl_waiters.pop(seq, None)

    async def _control_reader(self, worker):
        """Route the control socket's replies to the requests waiting for them, until the worker exits."""
        try:
            while worker.proc.returncode is None:
                if not await worker.ctl.poll(500):
                    continue
                frames = await worker.ctl.recv_multipart()
                try:
                    seq, kind, value = control_socket.read_reply(frames[0])
                except control_socket.MALFORMED as e:
                    log.warning("context %d: malformed control reply: %s", worker.ctx_id, control_socket.describe(e))
                    continue
                waiters = list(worker.ctl_waiters.values()) if seq == 0 else [worker.ctl_waiters.get(seq)]
                for queue in filter(None, waiters):
                    queue.put_nowait((kind, value))
        except zmq.ZMQError as e:
            if worker.proc.returncode is None and not worker.ctl.closed:
                log.warning("context %d: its control socket failed: %s", worker.ctx_id, e)
        except Exception:      # a bug of ours: the calls waiting fail as if the worker had gone, said why here
            log.exception("context %d: reading its worker's control replies failed", worker.ctx_id)
        finally:
            for queue in list(worker.ctl_waiters.values()):
                queue.put_nowait(None)

    async def stop_workers(self):
        everyone = list(self.workers.values()) + self.pool
        for w in everyone:
            if w.proc.returncode is None:
                w.proc.terminate()
        for w in everyone:
            try:
                await asyncio.wait_for(w.proc.wait(), 5)
            except asyncio.TimeoutError:
                w.proc.kill()
                await w.proc.wait()

    # -- the socket loop -------------------------------------------------------------------
    async def answer(self, sock, peer, body, client=""):
        ASKER.set(client)        # this task's own: handlers that await do not mix up their askers
        try:
            with wire.decode(wire.Request, body) as req:
                if (why := wire.too_many_calls(req)) is not None:
                    return await self.reply(sock, peer, error_reply(CUresult.CUDA_ERROR_INVALID_VALUE, why))
                results, moved = [], None
                for call in req.calls:
                    name = call.which()
                    handler = self.CALLS.get(name)
                    try:
                        if handler is None:
                            raise CudaError(CUresult.CUDA_ERROR_INVALID_CONTEXT if name in _CONTEXT_CALLS else CUresult.CUDA_ERROR_NOT_SUPPORTED,
                                            f"call {name!r} needs a context: send it to the context's worker" if name in _CONTEXT_CALLS
                                            else f"call {name!r} is not served by the front end")
                        if name != "hello" and req.version != wire.PROTOCOL_VERSION:
                            raise CudaError(CUresult.CUDA_ERROR_NOT_SUPPORTED,
                                            f"protocol version {req.version}; this server speaks {wire.PROTOCOL_VERSION}")
                        fields = await handler(self, getattr(call, name))
                        if fields and MOVED in fields:
                            moved = fields.pop(MOVED) or moved
                        results.append((call.seq, CUresult.CUDA_SUCCESS, "", fields))
                    except CudaError as e:
                        results.append((call.seq, e.status, f"{name}: {e.message}", {}))
                frames = build_reply(req.calls[-1].seq if len(req.calls) else 0, results, moved=moved)
        except wire.MALFORMED as e:
            self.warnings.warn(peer, "malformed frame from a client: %s", wire.describe(e))
            frames = error_reply(CUresult.CUDA_ERROR_INVALID_VALUE, f"malformed request: {wire.describe(e)}")
        await self.reply(sock, peer, frames)

    async def reply(self, sock, peer, frames):
        """Send a Reply. The socket routes mandatorily: where a client's queue is full (it sends
        without reading), its Replies wait in order for room (drain) instead of being dropped
        silently. One that is gone, or reads nothing for REPLY_WAIT_S, or has more than
        MAX_WAITING_REPLIES waiting, loses them, and the log says so."""
        queue = self.waiting.get(peer)
        if queue is None:
            if await send_if_room(sock, peer, frames):
                return
            queue = self.waiting[peer] = collections.deque()
            drain = asyncio.get_running_loop().create_task(self.drain(sock, peer, queue))
            self.draining.add(drain)
            drain.add_done_callback(self.draining.discard)
        if len(queue) >= MAX_WAITING_REPLIES:
            return self.lose_reply(peer, f"{MAX_WAITING_REPLIES} of its replies already wait for it to read")
        queue.append(frames)

    async def drain(self, sock, peer, queue):
        """Send one client's waiting Replies, oldest first, as its queue makes room."""
        deadline, nap = time.monotonic() + REPLY_WAIT_S, 0.001
        try:
            while queue:
                if await send_if_room(sock, peer, queue[0]):
                    queue.popleft()
                    deadline, nap = time.monotonic() + REPLY_WAIT_S, 0.001
                elif time.monotonic() > deadline:
                    return self.lose_reply(peer, f"it read none of its replies for {REPLY_WAIT_S:g} s")
                else:
                    await asyncio.sleep(nap)
                    nap = min(nap * 2, 0.1)
        finally:
            del self.waiting[peer]

    def lose_reply(self, peer, why):
        if peer not in self.overrun:
            self.overrun.add(peer)
            log.warning("a client that does not read its replies loses them: %s", why)

    async def restore(self, store, name, full, warm=False):
        """Restore an image into a pre-started worker; returns (worker, its pb.RestoreReply).
        warm: a handoff's early image, which no client may attach to until advance()."""
        worker = await self.standby_worker()
        worker.state = "restoring"
        try:
            res = await self.control(worker, pb.RestoreRequest(store=store, name=name, full=full, warm=warm))
        except BaseException:
            if worker.proc.returncode is None:
                worker.proc.kill()
            raise
        finally:     # not before the client re-attached: starting a process (a fork of ours) holds up this loop
            asyncio.get_running_loop().call_later(REFILL_AFTER_RESTORE, self.fill_pool)
        ctx_id = res.ctx
        live = self.workers.get(ctx_id)
        if live is not None and alive(live.proc) and live.state != "warming":
            worker.proc.kill()
            raise CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE, f"context {ctx_id} is live on this server: stop it before restoring its image")
        if live is not None and live.state == "warming":
            self.discard(ctx_id)      # an earlier handoff's warm copy that nobody advanced
        worker.ctx_id, worker.state = ctx_id, "warming" if warm else "running"
        self.workers[ctx_id] = worker
        self.moved.pop(ctx_id, None)          # it came back here
        self.killed.discard(ctx_id)           # restored by its operator: its client may have it again
        self.counts["restores"] += 1
        return worker, res

    def kill(self, ctx):
        """End context ctx now (`phos ctx kill`), even mid-kernel: its worker is killed, and the
        context is forgotten (its recovery images go, and its client is refused a restore)."""
        worker = self.workers.get(ctx)
        if worker is None or worker.state == "warming":
            raise CudaError(CUresult.CUDA_ERROR_NOT_FOUND, f"no context {ctx} on this server")
        self.killed.add(ctx)
        self.discard(ctx)
        if self.recovery is not None:
            from phos.gpu_server.worker.recovery import context_store
            shutil.rmtree(context_store(self.recovery.directory, ctx), ignore_errors=True)
        log.warning("context %d: killed by the operator", ctx)

    def discard(self, ctx):
        """Take context ctx's worker out of the table and kill it if it still runs."""
        worker = self.workers.pop(ctx, None)
        if worker is not None and worker.proc.returncode is None:
            worker.proc.kill()

    async def advance(self, store, name, ctx, final=True, full=False, delta=b""):
        """A handoff's later image: the warm copy of context ctx moves on to it, loading only
        what changed; if it cannot, the image is restored afresh. final: clients may attach then.
        full: answer once everything is loaded. delta: the image as a delta of the warm copy's, a
        packed ImageDelta (its manifest may not be committed yet: no fresh restore then, the
        caller falls back)."""
        warm = self.workers.get(ctx)
        if warm is not None and warm.state == "warming" and alive(warm.proc):
            try:
                res = await self.control(warm, pb.RestoreRequest(store=store, name=name, advance=True, full=full,
                                                                 delta=delta))
                if final:
                    warm.state = "running"
                    self.counts["restores"] += 1
                return warm, res
            except CudaError as e:
                if delta:
                    raise
                log.warning("context %d: the warm copy cannot take image %s (%s): restoring it afresh", ctx, name, e.message)
        elif delta:
            raise CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE, f"no warm copy of context {ctx} here to take the delta of image {name}")
        return await self.restore(store, name, full=full, warm=not final)

    def serve_admin_on_tcp(self, bound):
        """A TCP listener's admin API on the next port (admin_address), CURVE only, for the keys in
        the auth dir's admins/ (gpu_server/control/admin_net.py); None for an ipc:// listener, or without them."""
        if not bound.startswith("tcp://"):
            return None
        if not self.curve or not self.curve[3]:
            log.warning("the admin API is served on the Unix socket only: over TCP it needs CURVE keys with an "
                        "admins/ directory of admitted keys (--auth-dir, `phos keygen`)")
            return None
        from phos.gpu_server.control.admin_net import NetAdminServer
        from phos.schema.admin_net import admin_address
        try:
            net = NetAdminServer(self.admin, self.curve[1], self.curve[3], admin_address(bound))
        except zmq.ZMQError as e:
            raise ValueError(f"cannot serve the admin API on {admin_address(bound)} (the port after the "
                             f"listener's): {e}") from None
        self.admin_endpoint = net.address
        log.warning("admin API listening on %s (CURVE, keys in %s)", net.address, self.curve[3])
        return net

    async def serve(self):
        from phos.gpu_server.control import admin        # gRPC, once run() has set its fork support off
        gone = sweep_shm()
        if gone:
            log.info("removed %d file(s) that killed processes left in /dev/shm: %s", len(gone), ", ".join(gone[:5]))
        zctx = self.zctx = zmq.asyncio.Context()
        sock = zctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)      # a Reply with no room waits (reply), never vanishes
        auth = None
        if self.curve:
            from zmq.auth.asyncio import AsyncioAuthenticator
            auth = AsyncioAuthenticator(zctx)
            auth.start()
            self.client_keys = ClientKeys(self.curve[2])
            auth.configure_curve_callback(domain="*", credentials_provider=self.client_keys)
            sock.curve_server, sock.curve_secretkey = True, self.curve[1]
        sock.bind(self.listen)
        # what ZeroMQ bound, checked as the address given was (a wildcard port is resolved)
        warning = check_listen(sock.getsockopt_string(zmq.LAST_ENDPOINT), self.curve, self.insecure)
        if warning:
            log.warning("%s", warning)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        self.module_cache = self.open_module_cache()
        from phos.gpu_server.control.handoff_net import Inboxes
        self.inboxes = Inboxes()           # rounds of handoffs from servers on other hosts
        admin_server = await admin.start(self, admin_socket(self.listen))     # before we say we listen
        net_admin = self.serve_admin_on_tcp(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        log.warning("phos server (%s backend, %d device(s)) listening on %s", self.backend_name, len(self.devices), self.listen)
        self.fill_pool()
        print(f"phos server listening on {self.listen} ({self.backend_name})"
              + (f"; admin API on {self.admin_endpoint}" if net_admin else ""), flush=True)
        tasks = set()
        try:
            # frames, not bytes: they name the key or the connection they came by (the client)
            async for frames in receive_until(sock, self.stopping, copy=False):
                if len(frames) < 2:
                    log.warning("dropped a message with no request frame")
                    continue
                key = frame_user_id(frames[1])
                if self.client_keys is not None and not self.client_keys.still_admitted(key or ""):
                    task = loop.create_task(self.reply(sock, frames[0].bytes, error_reply(
                        CUresult.CUDA_ERROR_NOT_PERMITTED, "this client's key is no longer admitted")))
                else:
                    client = f"key {key}" if key else local_user(frames[1])
                    task = loop.create_task(self.answer(sock, frames[0].bytes, frames[1].bytes, client))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            self.stopping.set()
            if net_admin:
                await net_admin.stop()
            await admin_server.stop(0.5)
            await self.stop_workers()
            self.inboxes.close()
            sock.close()
            if auth:
                auth.stop()
            zctx.destroy(linger=0)     # closes the control sockets too
            remove_socket_file(self.listen)


async def receive_until(sock, stopping, copy=True):
    """Each message that arrives on sock, until the asyncio.Event `stopping` is set (a front
    end's loop: this server's, or a pool's, phos/pool/frontend.py)."""
    stop = asyncio.ensure_future(stopping.wait())
    try:
        while True:
            recv = asyncio.ensure_future(sock.recv_multipart(copy=copy))
            done, _ = await asyncio.wait({recv, stop}, return_when=asyncio.FIRST_COMPLETED)
            if stop in done:
                recv.cancel()
                return
            yield recv.result()
    finally:
        stop.cancel()


_CONTEXT_CALLS = frozenset(n for n in wire.phos_capnp.Call.schema.union_fields) - set(FrontEnd.CALLS) - {"attach"}


def run(backend, listen, curve=None, pool=POOL_SIZE, recovery=None, host_store=None, insecure=False, devices="all"):
    # We start workers with fork+exec while gRPC's threads run; its fork handlers would run in
    # the child before exec (and can crash it), and we need none of them.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    import uvloop
    check_listen(listen, curve, insecure)
    if listen.startswith("ipc://") and not listen.startswith("ipc://@"):
        private_directory(os.path.dirname(os.path.abspath(listen[len("ipc://"):])), create=True)
    front = FrontEnd(backend, listen, curve, recovery, host_store, devices)
    front.pool_size, front.insecure = pool, insecure
    uvloop.run(front.serve())
