"""The two parties of a live handoff (gpu_server/control/handoff.py), as the snapshot engine's
are in snapshot/ops.py: what Handoff needs of the server it moves a context from, and of where
it moves it to. Handoff is plain code over them, so that it runs without gRPC or processes
(tests/unit/test_handoff_module.py fakes both).

    HandoffSource   the front end holding the context: gpu_server/control/frontend.py FrontEnd
    HandoffTarget   where it goes: another server over its admin API (handoff_target.py
                    TargetServer, on this host; handoff_net.py RemoteTarget, on another), or
                    another device of the same server (handoff.py DeviceTarget)

tests/unit/test_interfaces.py checks that they declare every member with the same parameters.
Either side's failure is a CudaError.
"""
from typing import Optional, Protocol, runtime_checkable


@runtime_checkable
class HandoffSource(Protocol):
    """The front end holding the context: the calls on its worker's control socket that a
    handoff makes (`worker`: the context's WorkerProc), and what it keeps of the move."""
    host_store: Optional[str]    # its HostStore's path, where it has one: the rounds may go there
    moved: dict                  # ctx id -> (endpoint, standby, server key) where a handoff gave it
    counts: dict                 # its counters; a handoff counts in "handoffs"

    async def checkpoint(self, worker, request, on_progress=None, on_delta=None):
        """A checkpoint of the worker's context (request: admin.proto's WorkerCheckpointRequest);
        returns its CheckpointResult. on_progress(CheckpointProgress) while it copies;
        on_delta(bytes of its ImageDelta message) before it commits, with `early`."""

    async def ctx_stats(self, worker):
        """The context's statistics, a CtxStats (bytes: the device memory it holds)."""

    async def thaw(self, worker):
        """A frozen worker (a checkpoint with freeze) serves its client again."""

    async def pace(self, worker, hold):
        """Hold the client's calls for a share `hold` of the time (0: no longer)."""

    async def retire(self, worker, endpoint, standby, server_key=""):
        """The frozen worker tells its client where its context lives now, and exits."""

    async def moving_to(self, worker, endpoint, standby, server_key=""):
        """The worker tells its client where its context will move, to connect there ahead."""

    @staticmethod
    def worker_alive(worker) -> bool:
        """Whether the worker's process still runs."""


@runtime_checkable
class HandoffTarget(Protocol):
    """Where a handoff moves the context: it keeps a warm copy that restores the first round and
    advances with each later one, then adopts the last. An async context manager (its
    connections last the handoff)."""
    same_server: bool            # it is the source's front end itself (another of its devices)
    remote: bool                 # it reads the rounds only as the source sends them (another host)

    async def __aenter__(self):
        """Open what the handoff talks to it through."""

    async def __aexit__(self, *exc):
        """Close it."""

    async def stats(self):
        """Where the rounds go and whom the client asks next: .recovery_dir (its recovery
        directory, or ""), .host_store (a HostStore it pins, or ""), .standby, .server_key (z85,
        or "")."""

    async def send(self, store, name, delta=b""):
        """Round `name` of the source's store reaches it, or with delta (an ImageDelta message's
        bytes) the last round's changed chunks; nothing to do where it reads the store in place."""

    async def restore(self, store, name, warm=False, advance=False, full=False, delta=b""):
        """Restore round `name`, sent before: warm, as a copy no client attaches to; advance,
        moving the warm copy on to it; full, answering once it is all loaded; delta, by the last
        round's delta instead of its manifest. Returns .endpoint (its worker's) and .phase_ms."""

    async def drop_warm(self):
        """A failed handoff: free the warm copy, where it still has one."""

    async def wait_loaded(self, timeout):
        """Until it has loaded the context it restored on demand, at most timeout seconds."""
