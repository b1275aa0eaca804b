"""The admin API (schema/admin.proto) over the network: its client, and the framing it shares
with the server (gpu_server/control/admin_net.py).

A server that listens on tcp://HOST:PORT serves its admin API on tcp://HOST:PORT+1 as well
(admin_address), on a ZeroMQ ROUTER that speaks CURVE only, admitting the public keys in its
`--auth-dir`'s admins/ directory. A message carries one call of the Admin service, by name,
with its request serialized as protobuf; the server answers with the serialized reply (a
streaming call: several, then an end marker) or an error carrying a gRPC status code's name.
The same `Admin` servicer (gpu_server/control/admin.py) serves both transports.

One call is this transport's alone: PUT_CHUNKS, a handoff's chunks (gpu_server/control/handoff_net.py).
Its request (a PutChunksRequest) is followed by the chunks' frames (one or more each), each
chunk a stored blob sent from the sender's memory as it is and verified where it lands: in one
protobuf message, every batch would be copied three times more on the way (serialized, parsed,
listed). A handoff sends them on several connections at once, a few batches in flight on each
(NetAdminConnection.calls), since ZeroMQ encrypts each connection's bytes on one I/O thread.

open_admin(server) is the one way to reach any server's admin API: a gRPC stub over the Unix
socket for ipc:// and unix: addresses (and a keyless loopback tcp:// server), a NetAdminStub
for tcp:// ones. Both have a method per
Admin call (`stub.ListContexts(request, timeout=...)`; Checkpoint returns an iterator), and
both raise grpc.RpcError subclasses with .code() and .details().

Imports no server code, and no capnp: the command line loads it for every admin command.
"""
import itertools
import json
import os
import threading
import time
import urllib.parse

import grpc
import zmq

from phos.base import settings
from phos.schema import admin_pb2 as pb

PROTOCOL = b"phos-admin-1"      # the first frame of every request: a peer of another version is told so
REPLY, MORE, END, ERROR = b"reply", b"more", b"end", b"error"
PUT_CHUNKS = "PutChunks"        # the bulk call: PutChunksRequest, then the chunks' frames (above)
ZAP_DOMAIN = b"phos-admin"      # the admin socket's ZAP domain: its own allowlist (admins/), not the clients'
DEFAULT_TIMEOUT = 60.0          # seconds a call without a timeout of its own waits for its answer
METHODS = {m.name: m for m in pb.DESCRIPTOR.services_by_name["Admin"].methods}


def admin_address(server):
    """The admin API of the server listening on `server`: tcp://HOST:PORT+1 for tcp://HOST:PORT,
    else its Unix socket (schema/control.py admin_socket)."""
    url = urllib.parse.urlparse(server)
    if url.scheme == "tcp":
        try:
            port = url.port
        except ValueError:
            port = None
        if not port:
            raise ValueError(f"server address {server!r}: a tcp:// server is named with its port (tcp://HOST:PORT)")
        host = f"[{url.hostname}]" if ":" in (url.hostname or "") else url.hostname
        return f"tcp://{host}:{port + 1}"
    from phos.schema.control import admin_socket
    return admin_socket(server)


class AdminCallError(grpc.RpcError):
    """A failed call over the network, shaped like gRPC's: .code() and .details()."""

    def __init__(self, code, details):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details

    def __str__(self):
        return f"{self._details} [{self._code.name}]"


def read_key_file(path, secret=False):
    """The z85 public key of a `phos keygen` key file (with secret: the (public, secret) pair of a
    *.key_secret file), as bytes; ValueError says what is wrong."""
    import zmq.auth
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"key file {path}: {e}") from None
    if secret and not secret_key:
        raise ValueError(f"key file {path} holds no secret key (give the *.key_secret file)")
    return (public, secret_key) if secret else public


def client_curve():
    """(server public key, client public key, client secret key) from PHOS_SERVER_KEY and
    PHOS_CLIENT_KEY, as the data-plane clients read them; ValueError when they are missing."""
    server_key, client_key = settings.server_key(), settings.client_key()
    if not server_key or not client_key:
        raise ValueError("a tcp:// server's admin API needs CURVE keys: set PHOS_SERVER_KEY (the server's public "
                         "key file) and PHOS_CLIENT_KEY (a secret key file whose public key is in the server's "
                         "admins/ directory)")
    return (read_key_file(server_key), *read_key_file(client_key, secret=True))


class NetAdminConnection:
    """One DEALER socket to a server's network admin API, CURVE-authenticated. Calls go one at a
    time (a lock), or several of one method in a row (calls); a call's answer is matched by its
    request id, so the answer to one that timed out is dropped, not taken for the next one's.
    A ZeroMQ context of its own: its one I/O thread encrypts this connection's bytes, so that
    several connections encrypt on several cores."""

    def __init__(self, address, curve):
        self.address = address
        server_public, public, secret = curve
        self.zctx = zmq.Context()
        self.sock = self.zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.curve_serverkey, self.sock.curve_publickey, self.sock.curve_secretkey = server_public, public, secret
        self.sock.setsockopt(zmq.SNDHWM, 0)
        # a handshake the server refused (our key is not admitted), or a connection lost while a
        # call waits (the server died: its answer will never come), ends the call at once
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_DISCONNECTED)
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.ids = itertools.count(1)
        self.lock = threading.Lock()
        self.refused = None       # why the server refused our handshake, once it has
        self.lost = False         # the connection dropped while a call waited

    def close(self):
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        self.zctx.term()

    def _check_monitor(self):
        import zmq.utils.monitor
        while self.monitor.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.lost = True
                continue
            self.refused = (f"the server at {self.address} refused this client's key (CURVE handshake failed: "
                            f"{'not admitted' if event['event'] == zmq.EVENT_HANDSHAKE_FAILED_AUTH else 'event ' + str(event['event'])}"
                            "; is its public key in the server's admins/ directory, and PHOS_SERVER_KEY the server's?)")

    def call(self, method, body, timeout):
        """Yield the serialized answers to one call (one, or a stream's); AdminCallError on failure."""
        with self.lock:
            self._begin()
            rid = self._send(method, [body])
            while True:
                kind, payload = self._answer({rid}, method, timeout)[1:]
                if kind == END:
                    return
                yield payload
                if kind == REPLY:
                    return

    def calls(self, method, bodies, timeout, window, stop=None):
        """Unary calls of one method, `window` of them in flight at once, so that the link carries
        the next while the server works on one. Each body is a list of frames, sent without a
        copy: the caller leaves their memory unchanged until its answer came. Yields (the body's
        index, its answer) as answers come, in any order; AdminCallError on the first failure,
        or when the threading.Event `stop` is set. Each answer may take `timeout` seconds."""
        with self.lock:
            self._begin()
            pending, bodies, more = {}, enumerate(bodies), True       # pending: request id -> index
            while True:
                while more and len(pending) < window:
                    i, frames = next(bodies, (None, None))
                    more = i is not None
                    if more:
                        pending[self._send(method, frames, copy=False)] = i
                if not pending:
                    return
                rid, kind, payload = self._answer(pending, method, timeout, stop)
                if kind != REPLY:
                    raise AdminCallError(grpc.StatusCode.INTERNAL, f"{method}: a stream's answer to a unary call")
                yield pending.pop(rid), payload

    def _begin(self):
        self._check_monitor()      # a drop between calls is no news for this one; a refusal is
        self.lost = False
        if self.refused:
            raise AdminCallError(grpc.StatusCode.UNAUTHENTICATED, self.refused)

    def _send(self, method, frames, copy=True):
        """Send one call; its request id."""
        rid = next(self.ids).to_bytes(8, "little")
        self.sock.send_multipart([PROTOCOL, rid, method.encode(), *frames], copy=copy)
        return rid

    def _answer(self, rids, method, timeout, stop=None):
        """(request id, kind, payload) of the next answer to one of the calls `rids` names, within
        timeout seconds; an error answer, a refused handshake, a lost connection or `stop` raise
        AdminCallError. Answers to other calls (ones that timed out) are dropped."""
        deadline = time.monotonic() + (timeout or DEFAULT_TIMEOUT)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._check_monitor()
                raise AdminCallError(grpc.StatusCode.UNAVAILABLE if self.refused else grpc.StatusCode.DEADLINE_EXCEEDED,
                                     self.refused or f"no answer from the admin API at {self.address} within "
                                     f"{timeout or DEFAULT_TIMEOUT:g} s (is the server up, and does it admit this "
                                     "client's key?)")
            if stop is not None and stop.is_set():
                raise AdminCallError(grpc.StatusCode.CANCELLED, f"{method} was cancelled")
            ready = dict(poller.poll(min(left, 0.2) * 1000))
            if self.monitor in ready or not ready:
                self._check_monitor()
                if self.refused:
                    raise AdminCallError(grpc.StatusCode.UNAUTHENTICATED, self.refused)
                if self.lost and not self.sock.poll(0):
                    raise AdminCallError(grpc.StatusCode.UNAVAILABLE, f"the connection to the admin API at "
                                         f"{self.address} was lost during {method}")
            if self.sock not in ready:
                continue
            frames = self.sock.recv_multipart()
            if len(frames) != 3 or frames[0] not in rids:
                continue              # the answer to a call that timed out
            rid, kind, payload = frames
            if kind == ERROR:
                try:
                    err = json.loads(payload)
                    code = grpc.StatusCode[err["code"]]
                    details = str(err["details"])
                except (ValueError, KeyError, TypeError):
                    code, details = grpc.StatusCode.INTERNAL, "a malformed error answer"
                raise AdminCallError(code, details)
            return rid, kind, payload


class NetAdminStub:
    """The Admin service over a NetAdminConnection, with a grpc stub's interface: a method per
    call taking (request, timeout=None); a streaming call returns an iterator of replies."""

    def __init__(self, address, curve=None):
        self.connection = NetAdminConnection(address, curve or client_curve())

    def close(self):
        self.connection.close()

    def __getattr__(self, name):
        method = METHODS.get(name)
        if method is None:
            raise AttributeError(name)
        reply_type = pb.DESCRIPTOR.message_types_by_name[method.output_type.name]

        def unary(request, timeout=None):
            answers = list(self.connection.call(name, request.SerializeToString(), timeout))
            if len(answers) != 1:
                raise AdminCallError(grpc.StatusCode.INTERNAL, f"{name}: {len(answers)} answers to a unary call")
            return _parse(reply_type, answers[0])

        def streaming(request, timeout=None):
            return (_parse(reply_type, a) for a in self.connection.call(name, request.SerializeToString(), timeout))
        return streaming if method.server_streaming else unary


def _parse(reply_type, data):
    from google.protobuf import message_factory
    msg = message_factory.GetMessageClass(reply_type)()
    msg.ParseFromString(data)
    return msg


def is_loopback(server):
    """Whether a tcp:// address names this host (a loopback address)."""
    import ipaddress
    host = urllib.parse.urlparse(server).hostname or ""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def over_network(server, curve=None):
    """Whether the admin API of `server` is reached over TCP: a tcp:// server, unless it is on
    this host (loopback) and no keys are given (curve, or PHOS_SERVER_KEY and PHOS_CLIENT_KEY):
    then its Unix socket, which a keyless (--insecure) loopback server alone serves."""
    if not server.startswith("tcp://"):
        return False
    return curve is not None or bool(settings.server_key() and settings.client_key()) or not is_loopback(server)


def open_admin(server, curve=None):
    """A stub of the admin API of the server listening on `server` (ipc://PATH, unix:PATH, or
    tcp://HOST:PORT, whose admin API is at PORT+1: see over_network); curve: (server public
    key, client public key, client secret key) for tcp://, default PHOS_SERVER_KEY and
    PHOS_CLIENT_KEY. Close it with close_admin. ValueError for an address or keys it cannot use."""
    if over_network(server, curve):
        return NetAdminStub(admin_address(server), curve)
    from phos.schema import admin_pb2_grpc
    from phos.schema.control import private_directory
    from phos.schema.control import admin_socket
    address = server if server.startswith("unix:") else admin_socket(server)
    # a socket someone else could have put there is not the server's
    private_directory(os.path.dirname(os.path.abspath(address[len("unix:"):])))
    channel = grpc.insecure_channel(address)
    stub = admin_pb2_grpc.AdminStub(channel)
    stub.channel = channel
    return stub


def close_admin(stub):
    """Close a stub open_admin gave."""
    (stub.connection if isinstance(stub, NetAdminStub) else stub.channel).close()


class AsyncNetAdminStub:
    """A NetAdminStub for asyncio code (a handoff's target): each call runs on a thread, so the
    loop goes on meanwhile; streaming calls are not offered."""

    def __init__(self, address, curve):
        self.stub = NetAdminStub(address, curve)

    def __getattr__(self, name):
        call = getattr(self.stub, name)

        async def unary(request, timeout=None):
            import asyncio
            return await asyncio.to_thread(call, request, timeout)
        return unary

    async def close(self):
        import asyncio
        await asyncio.to_thread(self.stub.close)


def open_admin_async(server, curve=None):
    """open_admin for asyncio code: a grpc.aio stub for a Unix socket, an AsyncNetAdminStub for
    tcp://. Close it with `await stub.close()`."""
    if over_network(server, curve):
        return AsyncNetAdminStub(admin_address(server), curve)
    from phos.schema import admin_pb2_grpc
    from phos.schema.control import admin_socket
    address = server if server.startswith("unix:") else admin_socket(server)
    channel = grpc.aio.insecure_channel(address)
    stub = admin_pb2_grpc.AdminStub(channel)
    stub.close = channel.close
    return stub
