"""The front end: handshake, device queries, and one worker process per context.

It runs on uvloop and never sits on the hot path: after ctxCreate the client talks
to its worker directly. It watches every worker, and on SIGTERM stops them all.
"""
import asyncio
import ipaddress
import logging
import os
import secrets
import signal
import sys
import urllib.parse
from dataclasses import dataclass

import zmq
import zmq.asyncio

from phos.gpu_server.backend import load_backend
from phos.gpu_server.worker import build_reply, error_reply
from phos.schema import wire
from phos.schema.cuda_types import CudaError, CUresult

log = logging.getLogger("phos.frontend")
WORKER_START_TIMEOUT = float(os.environ.get("PHOS_WORKER_START_TIMEOUT", "60"))


@dataclass
class WorkerProc:
    ctx_id: int
    proc: asyncio.subprocess.Process
    endpoint: str
    token: bytes


def check_listen(address, curve_secret):
    """Refuse a listener reachable from other hosts unless CURVE authentication is on."""
    url = urllib.parse.urlparse(address)
    if url.scheme == "ipc":
        return
    if url.scheme != "tcp":
        raise ValueError(f"listen address {address!r}: use ipc://PATH or tcp://HOST:PORT")
    host = url.hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not curve_secret:
        raise ValueError(f"refusing to listen on {address}: it is reachable from other hosts; "
                         "configure CURVE keys with --auth-dir (see `phos keygen`) or listen on 127.0.0.1")


def worker_endpoint(listen, ctx_id):
    url = urllib.parse.urlparse(listen)
    if url.scheme == "ipc":
        return f"{listen}.ctx{ctx_id}"
    return f"tcp://{url.hostname}:*"


class FrontEnd:
    def __init__(self, backend_name, listen, curve=None):
        self.backend_name, self.listen = backend_name, listen
        self.backend = load_backend(backend_name)
        self.devices = self.backend.devices()
        self.curve = curve          # (server public, server secret, authorized client keys dir) or None
        self.workers = {}           # ctx id -> WorkerProc
        self.next_ctx = 1
        self.stopping = asyncio.Event()

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

    async def ctx_create(self, a):
        self.device(a.device)
        worker = await self.start_worker(a.device, a.flags)
        return {"u64s": [worker.ctx_id], "text": worker.endpoint, "data": worker.token}

    CALLS = {
        "hello": hello,
        "driverGetVersion": driver_get_version,
        "deviceGetCount": device_get_count,
        "deviceGetName": device_get_name,
        "deviceGetUuid": device_get_uuid,
        "deviceTotalMem": device_total_mem,
        "deviceGetAttribute": device_get_attribute,
        "deviceComputeCapability": device_compute_capability,
        "ctxCreate": ctx_create,
    }

    # -- workers ---------------------------------------------------------------------------
    async def start_worker(self, device, flags):
        ctx_id, self.next_ctx = self.next_ctx, self.next_ctx + 1
        token = secrets.token_bytes(16)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "phos.gpu_server.worker", "--backend", self.backend_name,
            "--endpoint", worker_endpoint(self.listen, ctx_id), "--ctx", str(ctx_id),
            "--device", str(device), "--flags", str(flags),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        secret = self.curve[1].decode() if self.curve else ""
        proc.stdin.write(f"{token.hex()}\n{secret}\n".encode())
        await proc.stdin.drain()
        proc.stdin.close()
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), WORKER_START_TIMEOUT)).decode().strip()
        except asyncio.TimeoutError:
            line = ""
        if not line.startswith("READY "):
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
            if line.startswith("ERROR "):
                _, status, message = line.split(" ", 2)
                raise CudaError(int(status), message)
            raise CudaError(CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"context worker failed to start (exit {proc.returncode})")
        worker = WorkerProc(ctx_id, proc, line.split(" ", 1)[1], token)
        self.workers[ctx_id] = worker
        asyncio.get_running_loop().create_task(self.watch(worker))
        log.info("context %d: worker %d at %s", ctx_id, proc.pid, worker.endpoint)
        return worker

    async def watch(self, worker):
        code = await worker.proc.wait()
        self.workers.pop(worker.ctx_id, None)
        log.info("context %d: worker exited with %s", worker.ctx_id, code)

    async def stop_workers(self):
        for w in list(self.workers.values()):
            if w.proc.returncode is None:
                w.proc.terminate()
        for w in list(self.workers.values()):
            try:
                await asyncio.wait_for(w.proc.wait(), 5)
            except asyncio.TimeoutError:
                w.proc.kill()
                await w.proc.wait()

    # -- the socket loop -------------------------------------------------------------------
    async def answer(self, sock, peer, body):
        try:
            with wire.decode(wire.Request, body) as req:
                results = []
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
                        results.append((call.seq, CUresult.CUDA_SUCCESS, "", fields))
                    except CudaError as e:
                        results.append((call.seq, e.status, f"{name}: {e.message}", {}))
                frames = build_reply(req.calls[-1].seq if len(req.calls) else 0, results)
        except wire.MALFORMED as e:
            log.warning("malformed frame from a client: %s", wire.describe(e))
            frames = error_reply(CUresult.CUDA_ERROR_INVALID_VALUE, f"malformed request: {wire.describe(e)}")
        await sock.send_multipart([peer, *frames])

    async def serve(self):
        zctx = zmq.asyncio.Context()
        sock = zctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        auth = None
        if self.curve:
            from zmq.auth.asyncio import AsyncioAuthenticator
            auth = AsyncioAuthenticator(zctx)
            auth.start()
            auth.configure_curve(domain="*", location=self.curve[2])
            sock.curve_server, sock.curve_secretkey = True, self.curve[1]
        sock.bind(self.listen)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        log.warning("phos server (%s backend, %d device(s)) listening on %s", self.backend_name, len(self.devices), self.listen)
        print(f"phos server listening on {self.listen} ({self.backend_name})", flush=True)
        tasks = set()
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            while True:
                recv = asyncio.ensure_future(sock.recv_multipart())
                done, _ = await asyncio.wait({recv, stop}, return_when=asyncio.FIRST_COMPLETED)
                if stop in done:
                    recv.cancel()
                    break
                frames = recv.result()
                if len(frames) < 2:
                    log.warning("dropped a message with no request frame")
                    continue
                task = loop.create_task(self.answer(sock, frames[0], frames[1]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            await self.stop_workers()
            sock.close()
            if auth:
                auth.stop()
            zctx.term()
            if self.listen.startswith("ipc://"):
                try:
                    os.unlink(self.listen[len("ipc://"):])
                except OSError:
                    pass


_CONTEXT_CALLS = frozenset(n for n in wire.phos_capnp.Call.schema.union_fields) - set(FrontEnd.CALLS) - {"attach"}


def run(backend, listen, curve=None):
    import uvloop
    check_listen(listen, curve)
    if listen.startswith("ipc://"):
        os.makedirs(os.path.dirname(listen[len("ipc://"):]) or ".", exist_ok=True)
    uvloop.run(FrontEnd(backend, listen, curve).serve())
