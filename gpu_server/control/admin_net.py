"""The admin API over the network: a ZeroMQ ROUTER speaking CURVE only, beside a TCP
listener (at its port + 1: phos.schema.admin_net.admin_address), serving the same `Admin`
servicer (gpu_server/control/admin.py) as the Unix socket does. The framing is in
phos.schema.admin_net, with the client.

Who may call: the public keys in `--auth-dir`'s admins/ directory (ClientKeys, read again
when it changes, so that removing a key's file revokes it for the next call). The admin API
can checkpoint into, restore from and delete the server's files, so tenants' keys (clients/)
do not admit one here. A caller without an admitted key fails its CURVE handshake and gets
nothing; one whose key was revoked since its handshake is answered PERMISSION_DENIED.

The socket has a ZeroMQ context of its own, with PHOS_HANDOFF_CONNECTIONS I/O threads, and its
own authenticator (ZAP answers within a context): ZeroMQ decrypts each connection on one I/O
thread, and a handoff's chunks come on that many connections at once (PUT_CHUNKS, below).
"""
import asyncio
import json
import logging

import grpc
import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from phos.base import settings
from phos.gpu_server.client_keys import ClientKeys, frame_user_id
from phos.schema import admin_pb2 as pb
from phos.schema.admin_net import END, ERROR, METHODS, MORE, PROTOCOL, PUT_CHUNKS, REPLY, ZAP_DOMAIN

log = logging.getLogger("phos.admin")


class Aborted(Exception):
    """A call ended with a gRPC status (what grpc's context.abort raises)."""

    def __init__(self, code, details):
        super().__init__(details)
        self.code, self.details = code, details


class CallContext:
    """What the servicer's methods use of grpc's ServicerContext."""

    async def abort(self, code, details):
        raise Aborted(code, details)


class NetAdminServer:
    def __init__(self, servicer, curve_secret, admins_dir, address):
        self.servicer = servicer
        self.admins = ClientKeys(admins_dir)
        self.zctx = zmq.asyncio.Context(io_threads=settings.handoff_connections())
        self.auth = AsyncioAuthenticator(self.zctx)
        try:
            self.auth.start()
            self.auth.configure_curve_callback(domain=ZAP_DOMAIN.decode(), credentials_provider=self.admins)
            self.sock = self.zctx.socket(zmq.ROUTER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.zap_domain = ZAP_DOMAIN
            self.sock.curve_server, self.sock.curve_secretkey = True, curve_secret
            self.sock.bind(address)
        except BaseException:
            self.close()
            raise
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.tasks = set()
        self.loop_task = asyncio.ensure_future(self.serve())

    async def stop(self):
        self.loop_task.cancel()
        for t in list(self.tasks):
            t.cancel()
        self.close()

    def close(self):
        self.auth.stop()
        self.zctx.destroy(linger=0)

    async def serve(self):
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            if not self.is_call(frames):
                log.warning("admin API: dropped a message that is not a %s call", PROTOCOL.decode())
                continue
            # the body (and a PUT_CHUNKS's chunks) as views of their frames: a handoff's chunks
            # come 16 MiB a message, and a copy of each would cost as much as the store's write
            peer, rid, method = frames[0].bytes, frames[2].bytes, frames[3].bytes.decode("ascii", "replace")
            if not self.admins.still_admitted(frame_user_id(frames[1]) or ""):
                await self.send(peer, rid, ERROR, error_body(grpc.StatusCode.PERMISSION_DENIED,
                                                              "this client's key is no longer admitted"))
                continue
            task = asyncio.ensure_future(self.answer(peer, rid, method, frames[4].buffer,
                                                     [f.buffer for f in frames[5:]]))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    @staticmethod
    def is_call(frames):
        """[peer, PROTOCOL, request id, method, request], and PUT_CHUNKS's chunks after them."""
        if len(frames) < 5 or frames[1].bytes != PROTOCOL:
            return False
        return len(frames) == 5 or frames[3].bytes == PUT_CHUNKS.encode()

    async def send(self, peer, rid, kind, body):
        await self.sock.send_multipart([peer, rid, kind, body], copy=len(body) < 65536)

    async def answer(self, peer, rid, name, body, chunks):
        method = METHODS.get(name)
        try:
            if name == PUT_CHUNKS:
                request = parse(pb.PutChunksRequest, name, body)
                reply = await self.servicer.PutChunks(request, chunks, CallContext())
                await self.send(peer, rid, REPLY, reply.SerializeToString())
                return
            if method is None:
                raise Aborted(grpc.StatusCode.UNIMPLEMENTED, f"no admin call {name!r}")
            request = parse(getattr(pb, method.input_type.name), name, body)
            handler = getattr(self.servicer, name)
            if method.server_streaming:
                async for reply in handler(request, CallContext()):
                    await self.send(peer, rid, MORE, reply.SerializeToString())
                await self.send(peer, rid, END, b"")
            else:
                reply = await handler(request, CallContext())
                await self.send(peer, rid, REPLY, reply.SerializeToString())
        except Aborted as e:
            await self.send(peer, rid, ERROR, error_body(e.code, e.details))
        except asyncio.CancelledError:
            raise
        except Exception as e:     # a bug must not end the admin API: the caller hears of it
            log.exception("admin call %s failed", name)
            await self.send(peer, rid, ERROR, error_body(grpc.StatusCode.INTERNAL, f"{name}: {type(e).__name__}: {e}"))


def parse(request_type, name, body):
    request = request_type()
    try:
        request.ParseFromString(body)
    except Exception:        # protobuf's DecodeError, whatever the implementation
        raise Aborted(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: the request is not a {request_type.__name__}") from None
    return request


def error_body(code, details):
    return json.dumps({"code": code.name, "details": details}).encode()
