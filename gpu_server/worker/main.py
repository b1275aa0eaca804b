"""A context worker's process: how it starts (main: `python -m phos.gpu_server.worker`, as the
front end starts it), the sockets it binds, the watch on its client during a long call, and
how it ends.

It reads its session token (and CURVE secret, if any) from stdin, binds, then prints
`READY <endpoint>` on stdout, or `ERROR <status> <message>` if the context could not be created;
then its loop (loop.py) serves the context until it is destroyed or its client is gone.
"""
import argparse
import ctypes
import logging
import os
import select
import signal
import sys
import threading
import time

import zmq
from zmq.auth.thread import ThreadAuthenticator

from phos.base import settings
from phos.gpu_server.backends import load_backend
from phos.gpu_server.client_keys import ClientKeys, pid_alive
from phos.gpu_server.worker.control import ORPHAN_GRACE, PROFILE_DIR, PROFILE_WORKER
from phos.gpu_server.worker.loop import Worker
from phos.gpu_server.worker.module_cache import ModuleCache
from phos.gpu_server.worker.session import Session
from phos.schema.control import remove_socket_file
from phos.schema.cuda_types import CudaError, CUresult
from phos.snapshot.host_store import open_store
from phos.snapshot.image import ImageError

log = logging.getLogger("phos.worker")


def client_socket(zctx):
    """The socket clients attach on.

    A peer that vanished without closing (its host gone) is found by TCP keepalive, not by
    ZeroMQ's heartbeats: a heartbeat's answer waits behind the messages queued before it, and
    where we read none for a while (a paced or frozen context, a long call) and the client's
    queue to us is full, it never comes, and the connection would be dropped with the answers
    on their way to the client (the client stub does the same, client_stub/native/transport.cpp)."""
    sock = zctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 1000)
    for option, value in KEEPALIVE.items():
        sock.setsockopt(option, value)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)      # a reply that cannot be queued waits (Worker.send_to)
    return sock


# probes after 5 idle seconds, one a second, 5 unanswered: a vanished peer is found in ~10 s
KEEPALIVE = {zmq.TCP_KEEPALIVE: 1, zmq.TCP_KEEPALIVE_IDLE: 5, zmq.TCP_KEEPALIVE_INTVL: 1, zmq.TCP_KEEPALIVE_CNT: 5}


class ClientWatch(threading.Thread):
    """Ends the worker when every connection of its client has hung up while one call runs
    long (a kernel that never ends, a synchronize behind it): the serve loop, which frees a
    context whose client is gone, is not running then, and cannot take a new connection's
    attach either. So a client that hung up to connect again (a re-attach that tired of
    waiting) must not count as gone: on this host, its process still runs; over TCP, only the
    orphan grace tells, as in the serve loop."""

    def __init__(self, worker):
        super().__init__(name="client-watch", daemon=True)
        self.worker = worker

    def run(self):
        w = self.worker
        alone_since = None
        while True:
            time.sleep(0.5)
            since, fds = w.busy_since, dict(w.client_fds)
            if since is None or time.monotonic() - since < 1.0 or not fds or not all(map(hung_up, fds)) \
                    or any(pid is not None and pid_alive(pid) for pid in fds.values()):
                alone_since = None
                continue
            alone_since = alone_since or time.monotonic()
            if None in fds.values() and time.monotonic() - alone_since < ORPHAN_GRACE:
                continue
            log.warning("context %d: its client is gone while a call runs: ending the context", w.session.ctx_id)
            if w.session.recovery is not None:
                w.session.recovery.discard()       # nobody will restore it
            os._exit(0)                # the device frees the context with the process, kernel and all


def hung_up(fd):
    """Whether the peer of a connection (a client's, by its descriptor) has closed it."""
    p = select.poll()
    p.register(fd, select.POLLRDHUP | select.POLLHUP)
    try:
        return bool(p.poll(0))
    except OSError:
        return True


def _die_with_parent():
    """Ask Linux to SIGTERM us when the front end dies, so no worker is orphaned."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _exit_on_sigterm(*_):
    """Exit through the cleanup in main(). The SystemExit lands wherever the main thread is,
    and where that is a callback whose exceptions Python ignores (a weakref callback run by the
    garbage collector, which a signal may interrupt), it is lost and the worker lives on alone.
    So a timer ends the process anyway if the cleanup has not within 5 s."""
    timer = threading.Timer(5.0, os._exit, (0,))
    timer.daemon = True
    timer.start()
    sys.exit(0)


def pin_host_store(backend, path):
    """Pin a HostStore's memory (SnapshotOps.pin); without it, checkpoints and restores
    through that store copy through buffers (slower, still correct)."""
    try:
        store = open_store(path)
    except (OSError, ImageError) as e:
        log.warning("host store %s cannot be used: %s", path, e)
        return
    t = time.perf_counter()
    if backend.snap.pin(store.memory, store.slot_bytes):
        log.info("pinned host store %s (%d MiB) in %.2f s", path, store.memory.nbytes >> 20, time.perf_counter() - t)
    store.refresh()       # a restore into this worker then reads only the index's later changes


def main(argv=None):
    ap = argparse.ArgumentParser(prog="phos-worker")
    ap.add_argument("--backend", required=True)
    ap.add_argument("--endpoint", required=True, help="bind address, e.g. ipc:///tmp/w.sock or tcp://127.0.0.1:*")
    ap.add_argument("--ctx", type=int, required=True)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--flags", type=int, default=0)
    ap.add_argument("--control", help="bind address of the control socket for the front end")
    ap.add_argument("--standby", action="store_true", help="pre-started: wait for a client or a restore without a deadline")
    ap.add_argument("--recovery-dir", help="take recovery images of the context into DIR/ctx<ID> (gpu_server/worker/recovery.py)")
    ap.add_argument("--checkpoint-every", type=float, default=0.0, help="seconds between recovery images")
    ap.add_argument("--checkpoint-calls", type=int, default=0, help="calls between recovery images")
    ap.add_argument("--standby-server", default="", help="the server that restores the context if this one dies")
    ap.add_argument("--host-store", help="a HostStore whose memory to pin, for copies straight to and from it")
    ap.add_argument("--module-cache", help="the server's module images by digest (gpu_server/worker/module_cache.py)")
    ap.add_argument("--emu-ledger", help="emu: the device memory the server's contexts hold (gpu_server/backends/emu_memory.py)")
    ap.add_argument("--tenant-ledgers", help="the device memory each tenant holds (gpu_server/device_ledger.py)")
    ap.add_argument("--tenant-quota", type=int, default=0, help="bytes a tenant's contexts may hold (PHOS_TENANT_QUOTA)")
    ap.add_argument("--tenant-host-quota", type=int, default=0,
                    help="bytes of host memory a tenant's contexts may hold (PHOS_TENANT_HOST_QUOTA)")
    ap.add_argument("--client-keys", help="CURVE: the directory of admitted client keys (gpu_server/client_keys.py)")
    opts = ap.parse_args(argv)
    logging.basicConfig(level=settings.log_level(), format="%(asctime)s %(name)s[%(process)d] %(message)s")
    _die_with_parent()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # A restore's loader and the I/O threads share the GIL with the loop serving the client: hand it back fast.
    sys.setswitchinterval(settings.switch_us() / 1e6)
    token = bytes.fromhex(sys.stdin.readline().strip())
    curve_secret = sys.stdin.readline().strip().encode()
    control_token = bytes.fromhex(sys.stdin.readline().strip())
    try:
        backend = load_backend(opts.backend)(opts.device, **({"ledger": opts.emu_ledger} if opts.emu_ledger else {}))
    except CudaError as e:
        print(f"ERROR {int(e.status)} {e.message}", flush=True)
        return 1
    except Exception as e:     # the device could not be opened: say why instead of dying silently
        log.exception("context %d: backend %s failed to start", opts.ctx, opts.backend)
        print(f"ERROR {int(CUresult.CUDA_ERROR_UNKNOWN)} {opts.backend} backend failed to start: {e}", flush=True)
        return 1
    zctx = zmq.Context()
    sock = client_socket(zctx)
    client_keys = None
    if curve_secret:
        # the front end's allowlist, here too: a client may reach a worker without it
        client_keys = ClientKeys(opts.client_keys or "")
        auth = ThreadAuthenticator(zctx)
        auth.start()
        auth.configure_curve_callback(domain="*", credentials_provider=client_keys)
        sock.curve_server, sock.curve_secretkey = True, curve_secret
    monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
    sock.bind(opts.endpoint)
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    ctl, ctl_endpoint = None, "-"
    if opts.control:
        ctl = zctx.socket(zmq.ROUTER)
        ctl.setsockopt(zmq.LINGER, 1000)
        ctl.bind(opts.control)
        ctl_endpoint = ctl.getsockopt_string(zmq.LAST_ENDPOINT)
    # Cached now: a checkpoint's cut must not pay for it. A pre-started worker also readies the
    # snapshot kernels and copy buffers, before it says READY: the front end hands it out then,
    # and a restore sent to it meanwhile would wait ~150 ms on the H200 (perf/bench_snapshot.py).
    if opts.standby:
        backend.device_info()
        if backend.pins_host_memory:
            backend.snap.prepare()
            if opts.host_store:
                pin_host_store(backend, opts.host_store)
    print(f"READY {endpoint} {ctl_endpoint}", flush=True)
    if not opts.standby:
        backend.device_info()
        if backend.pins_host_memory and opts.host_store:
            # a worker started for a waiting client pins the store behind its calls: unpinned, a
            # checkpoint or restore through the store would copy through buffers
            threading.Thread(target=pin_host_store, args=(backend, opts.host_store), name="phos-pin-store",
                             daemon=True).start()
    session = Session(backend, opts.ctx, token)
    if (opts.tenant_quota > 0 or opts.tenant_host_quota > 0) and opts.tenant_ledgers:
        session.tenants = (opts.tenant_ledgers, opts.tenant_quota, opts.tenant_host_quota)
    if opts.module_cache:
        session.modules = ModuleCache(opts.module_cache, settings.module_cache_bytes())
    recovery = (opts.recovery_dir, opts.checkpoint_every, opts.checkpoint_calls) if opts.recovery_dir else None
    ended = False          # destroyed, or its client is gone (not killed): nobody will restore it
    try:
        worker = Worker(session, sock, ctl, control_token, recovery, opts.standby_server)
        worker.client_keys = client_keys
        ClientWatch(worker).start()
        if PROFILE_WORKER:
            import cProfile
            profiler = cProfile.Profile()
            try:
                profiler.runcall(worker.serve, monitor, standby=opts.standby)
            finally:
                profiler.dump_stats(os.path.join(PROFILE_DIR, f"worker-{os.getpid()}.prof"))
        else:
            worker.serve(monitor, standby=opts.standby)
        ended = True
        if any(worker.box_answers):      # how much of the synchronous traffic the compiled path took
            log.info("context %d: mailbox requests answered in compiled code %d, by Python %d", session.ctx_id,
                     *worker.box_answers)
    finally:
        if session.checkpoint is not None:
            session.checkpoint.abort("the context went away during the checkpoint")
        if ended and session.recovery is not None and not session.recovery.retired:
            session.recovery.discard()
        # The client's socket first: after a handoff it learns the worker left at once, not after
        # the device has freed gigabytes (backend.close).
        sock.close(linger=500)
        if ctl is not None:
            ctl.close(linger=500)
        t = time.perf_counter()
        backend.close()
        if session.space.ledger is not None:      # the tenant's share back now, not at another worker's recount
            session.space.ledger.close()
        if session.host_ledger is not None:
            session.host_ledger.close()
        # when, and how long: freeing a big context may stall the device's other contexts
        log.info("context %d: its device memory freed in %.1f ms", session.ctx_id, (time.perf_counter() - t) * 1e3)
        for ep in (endpoint, ctl_endpoint):
            remove_socket_file(ep)
    return 0

