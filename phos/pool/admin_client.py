"""The one way the pool reaches a phos server's admin API (schema/admin.proto).

Every admin call the pool makes (its servers' polls, a drain's handoffs) goes through
`admin(server, auth_dir)`: phos.schema.admin_net.open_admin, over TCP with the pool's keys
(CURVE, the client key of the pool's `phos keygen` directory, which keygen puts in admins/),
else over the server's Unix admin socket (a keyless server on this host).

Failures are AdminError with the server's own message, never a gRPC exception.
"""
import os

import grpc

from phos.schema import admin_pb2 as pb
from phos.schema.admin_net import close_admin, open_admin, read_key_file

POLL_TIMEOUT = 10.0          # seconds a list or stats call may take (a busy worker answers within 5 s)
HANDOFF_TIMEOUT = 600.0      # seconds a handoff may take (gigabytes of pre-copy rounds)


class AdminError(Exception):
    """An admin call failed; `code` is the gRPC status code's name ("UNAVAILABLE": nobody answered)."""

    def __init__(self, server, code, message):
        super().__init__(f"{server}: {message} [{code}]")
        self.server, self.code, self.message = server, code, message


class AdminClient:
    """The admin API of the server listening on `server` (its data-plane address)."""

    def __init__(self, server, auth_dir=None):
        self.server = server
        try:
            self.stub = open_admin(server, pool_keys(auth_dir))
        except ValueError as e:
            raise AdminError(server, "INVALID_ARGUMENT", str(e)) from None

    def close(self):
        close_admin(self.stub)

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
                "bytes": r.bytes, "checkpoints": r.checkpoints, "checkpoint_seconds": r.checkpoint_seconds,
                "restores": r.restores, "recovery_dir": r.recovery_dir,
                "standby": r.standby, "host_store": r.host_store}

    def handoff(self, ctx, to, max_rounds=0, chunk_size=0):
        """Move live context ctx to the server at `to`; returns the HandoffReply as a dict. On
        failure (AdminError) the context stays live here."""
        r = self._call(self.stub.Handoff, pb.HandoffRequest(ctx=ctx, to=to, max_rounds=max_rounds, chunk_size=chunk_size),
                       HANDOFF_TIMEOUT)
        return {"ctx": r.ctx, "to": r.to, "round_bytes": list(r.round_bytes), "downtime_ms": r.downtime_ms,
                "seconds": r.seconds, "phase_ms": dict(r.phase_ms)}


def pool_keys(auth_dir):
    """(server public key, client public key, client secret key) of a `phos keygen` directory,
    as open_admin takes them; None without one."""
    if not auth_dir:
        return None
    return (read_key_file(os.path.join(auth_dir, "server.key")),
            *read_key_file(os.path.join(auth_dir, "client.key_secret"), secret=True))


def admin(server, auth_dir=None):
    """An AdminClient for the server listening on `server` (use with `with`); auth_dir: the
    pool's `phos keygen` directory, whose keys reach a server's admin API over TCP."""
    return AdminClient(server, auth_dir)
