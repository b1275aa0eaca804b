"""The one way the pool reaches a phos server's admin API (schema/admin.proto).

Every admin call the pool makes (its servers' polls, a drain's handoffs) goes through
`admin(server)`, so the transport is chosen here alone: today the server's Unix admin
socket (phos.schema.control.admin_socket, reachable where the pool's processes share the
server's socket directory); a `tcp://` admin client with mutual authentication drops in
here without changing its callers.

Failures are AdminError with the server's own message, never a gRPC exception.
"""
import os

import grpc

from phos.schema import admin_pb2 as pb
from phos.schema import admin_pb2_grpc
from phos.schema.control import admin_socket, private_directory

POLL_TIMEOUT = 10.0          # seconds a list or stats call may take (a busy worker answers within 5 s)
HANDOFF_TIMEOUT = 600.0      # seconds a handoff may take (gigabytes of pre-copy rounds)


class AdminError(Exception):
    """An admin call failed; `code` is the gRPC status code's name ("UNAVAILABLE": nobody answered)."""

    def __init__(self, server, code, message):
        super().__init__(f"{server}: {message} [{code}]")
        self.server, self.code, self.message = server, code, message


class AdminClient:
    """The admin API of the server listening on `server` (its data-plane address)."""

    def __init__(self, server):
        self.server = server
        try:
            address = admin_socket(server)
            # a socket someone else could have put there is not the server's
            private_directory(os.path.dirname(os.path.abspath(address[len("unix:"):])))
        except ValueError as e:
            raise AdminError(server, "INVALID_ARGUMENT", str(e)) from None
        self.channel = grpc.insecure_channel(address)
        self.stub = admin_pb2_grpc.AdminStub(self.channel)

    def close(self):
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method, request, timeout):
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as e:
            raise AdminError(self.server, e.code().name, e.details() or "") from None

    def list_contexts(self):
        """[{id, bytes, allocations, last_seq, pid, state}] of every context the server holds."""
        reply = self._call(self.stub.ListContexts, pb.ListContextsRequest(), POLL_TIMEOUT)
        return [{"id": c.id, "bytes": c.bytes, "allocations": c.allocations, "last_seq": c.last_seq, "pid": c.pid,
                 "state": c.state} for c in reply.contexts]

    def stats(self):
        """The server's StatsReply as a dict."""
        r = self._call(self.stub.Stats, pb.StatsRequest(), POLL_TIMEOUT)
        return {"backend": r.backend, "devices": r.devices, "contexts": r.contexts, "standby_workers": r.standby_workers,
                "bytes": r.bytes, "checkpoints": r.checkpoints, "restores": r.restores, "recovery_dir": r.recovery_dir,
                "standby": r.standby, "host_store": r.host_store}

    def handoff(self, ctx, to, max_rounds=0, chunk_size=0):
        """Move live context ctx to the server at `to`; returns the HandoffReply as a dict. On
        failure (AdminError) the context stays live here."""
        r = self._call(self.stub.Handoff, pb.HandoffRequest(ctx=ctx, to=to, max_rounds=max_rounds, chunk_size=chunk_size),
                       HANDOFF_TIMEOUT)
        return {"ctx": r.ctx, "to": r.to, "round_bytes": list(r.round_bytes), "downtime_ms": r.downtime_ms,
                "seconds": r.seconds, "phase_ms": dict(r.phase_ms)}


def admin(server):
    """An AdminClient for the server listening on `server` (use with `with`)."""
    return AdminClient(server)
