"""The pool controller: a named, detached Ray actor that keeps the pool's servers.

It starts one server actor (server_actor.py) per GPU in the Ray cluster, and one per unit of
the EMU_RESOURCE custom resource on machines without GPUs, again whenever nodes join; polls
them for their contexts and free memory; serves the pool's front end (frontend.py), which
places new contexts (placement.py) and sends a lost server's contexts to others; drains a
node by live handoffs; and exports its metrics (metrics.py).
"""
import logging
import os
import socket
import threading
import time
import urllib.parse

import ray

from phos.pool import CONTROLLER_NAME, CUDA_SHARED_RESOURCE, EMU_RESOURCE, NAMESPACE
from phos.pool.admin_client import AdminError, admin
from phos.pool.placement import NoRoom, choose
from phos.pool.server_actor import PhosServer, unnice

log = logging.getLogger("phos.pool")

POLL_EVERY = 0.5         # seconds between the controller's looks at its servers
SNAPSHOT_TIMEOUT = 5.0   # seconds a server actor may take to report
# (backend, the Ray resource one server claims, the actor's resource options): a GPU each; on
# machines without GPUs, a unit of EMU_RESOURCE each; CUDA_SHARED_RESOURCE: a cuda server on
# the node's GPUs without Ray's GPU accounting, for several servers sharing one GPU (benchmarks)
SERVER_RESOURCES = (("cuda", "GPU", {"num_gpus": 1}),
                    ("emu", EMU_RESOURCE, {"resources": {EMU_RESOURCE: 1}}),
                    ("cuda", CUDA_SHARED_RESOURCE, {"resources": {CUDA_SHARED_RESOURCE: 1}}))
RECENT = 5.0             # seconds a placement counts on its server whatever its snapshots say
DRAIN_PASSES = 3         # a drain looks this many times for contexts left on the node


class ServerView:
    """What the controller knows of one server actor."""

    def __init__(self, actor, kind, resource):
        self.actor, self.kind, self.resource = actor, kind, resource
        self.address, self.node_id = "", ""
        self.state = "starting"        # starting, up, draining, drained, lost, stopped
        self.snap = None               # its latest snapshot (PhosServer.snapshot)
        self.recent = {}               # ctx id -> when it was placed (or moved) here: a snapshot may predate it
        self.placing = 0               # ctxCreates forwarded and not yet answered
        self.started = None            # the ObjectRef of its first snapshot while it starts

    def contexts(self):
        return [c for c in (self.snap or {}).get("contexts", []) if c["state"] != "warming"]

    def arrived(self, ctx):
        now = time.time()
        self.recent = {c: t for c, t in self.recent.items() if now - t < RECENT}
        self.recent[ctx] = now

    def held(self):
        """The ids of the contexts it holds: its latest snapshot's, and those placed since it
        was taken (the server's clock and ours are the one machine's, or close)."""
        taken = (self.snap or {}).get("polled_at", 0.0)
        return {c["id"] for c in self.contexts()} | {c for c, t in self.recent.items() if t >= taken}

    def as_dict(self, max_contexts=0):
        snap = self.snap or {}
        used, total = snap.get("bytes", 0), snap.get("total", 0)
        held, polled = self.held(), [c["id"] for c in self.contexts()]
        return {"address": self.address, "node_id": self.node_id, "kind": self.kind, "state": self.state,
                "contexts": len(held) + self.placing, "unpolled": len(held - set(polled)) + self.placing,
                "context_ids": polled,
                "bytes": used, "total": total, "free": max(total - used, 0), "calls_per_s": snap.get("calls_per_s", 0.0),
                "max_contexts": max_contexts, "standby_workers": snap.get("standby_workers", 0),
                "metrics": snap.get("metrics", ""), "error": snap.get("error", "")}


class PoolController:
    """Options: listen (the front end's address), policy, server (the PhosServer options:
    recovery_dir, checkpoint_every, pool, insecure/auth_dir, image_key, work_dir, log_level),
    max_contexts (per server, for placement; 0: no limit), metrics_host, metrics_port."""

    def __init__(self, options):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        unnice()
        self.options = options
        self.policy = options.get("policy", "most-free")
        self.lock = threading.RLock()
        self.servers = []                 # ServerView
        self.home = {}                    # ctx id -> the address of the server that holds it
        self.stopping = threading.Event()
        from phos.pool.metrics import ControllerMetrics, serve
        self.metrics = ControllerMetrics(self.view)
        host = options.get("metrics_host", "127.0.0.1")
        self.metrics_url = f"http://{host}:{serve(self.metrics.registry, host, options.get('metrics_port', 0))}/metrics"
        from phos.pool.frontend import PoolFrontEnd
        self.auth_dir = options["server"].get("auth_dir")
        self.front = PoolFrontEnd(options["listen"], self, *curve_options(self.auth_dir))
        self.front.start()
        self.reconcile()
        threading.Thread(target=self._loop, name="phos-pool-controller", daemon=True).start()

    # -- servers --------------------------------------------------------------------------------
    def reconcile(self):
        """Start a server for each GPU and each unit of SERVER_RESOURCES' custom resources
        of the cluster not yet serving."""
        total = ray.cluster_resources()
        with self.lock:
            for kind, resource, _ in SERVER_RESOURCES:
                have = sum(1 for s in self.servers if s.resource == resource and s.state not in ("lost", "stopped"))
                for _ in range(int(total.get(resource, 0)) - have):
                    self.servers.append(self._start_server(kind, resource))

    def _start_server(self, kind, resource):
        opts = dict(self.options["server"], backend=kind, standby=self.options["listen"])
        how = next(h for _, r, h in SERVER_RESOURCES if r == resource)
        actor = ray.remote(PhosServer).options(num_cpus=0, max_restarts=0, **how).remote(opts)
        view = ServerView(actor, kind, resource)
        view.started = actor.snapshot.remote()
        return view

    def _loop(self):
        while not self.stopping.wait(POLL_EVERY):
            try:
                self.poll()
                self.reconcile()
            except Exception:          # a bug of ours must not end the polling
                log.exception("the pool controller's poll failed")

    def poll(self):
        with self.lock:
            views = [s for s in self.servers if s.state not in ("lost", "stopped")]
        refs = {}
        for s in views:
            if s.started is not None:
                ready, _ = ray.wait([s.started], timeout=0)
                if not ready:
                    continue
                refs[s], s.started = s.started, None
            else:
                refs[s] = s.actor.snapshot.remote()
        for s, ref in refs.items():
            try:
                snap = ray.get(ref, timeout=SNAPSHOT_TIMEOUT)
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayError as e:       # the actor died, or its server never started
                self.lose(s, str(e).splitlines()[0] if str(e) else type(e).__name__)
                continue
            with self.lock:
                s.snap = snap
                s.address, s.node_id = snap["address"], snap["node_id"]
                if snap["state"] in ("exited", "lost"):
                    self.lose(s, snap["error"])
                    continue
                if s.state == "starting":
                    s.state = "up"
                    log.info("server %s up on node %s", s.address, s.node_id)
                for c in s.contexts():
                    where = self.home.get(c["id"])
                    holder = self.by_address(where) if where else None
                    if holder is None or holder.state == "lost" or (
                            holder.snap is not None and c["id"] not in {x["id"] for x in holder.contexts()}):
                        self.home[c["id"]] = s.address

    def lose(self, s, why):
        with self.lock:
            if s.state in ("lost", "stopped"):
                return
            log.warning("server %s (node %s) is lost: %s", s.address or "(starting)", s.node_id, why)
            s.state = "lost"

    def view(self):
        with self.lock:
            return [s.as_dict(self.options.get("max_contexts", 0)) for s in self.servers if s.address]

    def by_address(self, address):
        return next((s for s in self.servers if s.address == address), None)

    # -- the front end's directory -------------------------------------------------------------
    def place(self, exclude=()):
        with self.lock:
            server = choose(self.view(), self.policy, exclude)["address"]
            self.by_address(server).placing += 1
            return server

    def placing_done(self, server):
        with self.lock:
            self.by_address(server).placing -= 1

    def placed(self, ctx, server, seconds):
        with self.lock:
            self.home[ctx] = server
            self.by_address(server).arrived(ctx)
        self.metrics.placement.observe(seconds)

    def where(self, ctx):
        with self.lock:
            return self.home.get(ctx)

    def lost(self, server):
        with self.lock:
            s = self.by_address(server)
            return s is None or s.state == "lost"

    def confirm_lost(self, server):
        """Whether a server that did not answer is gone: nothing listens on its port, or Ray says
        its actor died. A slow one is not lost (asking another to restore its contexts would
        leave two copies of them)."""
        with self.lock:
            s = self.by_address(server)
        if s is None or s.state == "lost":
            return True
        url = urllib.parse.urlparse(server)
        try:
            socket.create_connection((url.hostname, url.port), timeout=1.0).close()
        except ConnectionRefusedError:
            self.lose(s, "nothing listens on its port")
            return True
        except OSError:
            pass
        try:
            snap = ray.get(s.actor.snapshot.remote(), timeout=2.0)
        except ray.exceptions.GetTimeoutError:
            return False
        except ray.exceptions.RayError as e:
            self.lose(s, str(e).splitlines()[0])
            return True
        if snap["state"] in ("exited", "lost"):
            self.lose(s, snap["error"])
            return True
        return False

    def recovery_target(self, ctx, exclude=()):
        """The server a lost server's context is restored on (counted as placing until
        placing_done), or None."""
        try:
            return self.place(exclude)
        except NoRoom:
            return None

    def recovered(self, ctx, server, seconds):
        with self.lock:
            self.home[ctx] = server
            self.by_address(server).arrived(ctx)
        self.metrics.recovery_downtime.observe(seconds)
        log.warning("context %d restored on %s, %.1f ms after its stub first asked", ctx, server, seconds * 1e3)

    def any_server(self):
        with self.lock:
            up = [s.address for s in self.servers if s.state in ("up", "draining", "drained") and s.address]
        return up[0] if up else None

    # -- the operator's calls ---------------------------------------------------------------------
    def status(self):
        with self.lock:
            return {"address": self.options["listen"], "policy": self.policy, "metrics": self.metrics_url,
                    "servers": sorted(self.view(), key=lambda s: (s["node_id"], s["address"])),
                    "starting": sum(1 for s in self.servers if s.state == "starting"),
                    "contexts": len(self.home)}

    def wait_ready(self, servers, timeout=120.0):
        """Until `servers` servers are up (or timeout); returns status()."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if sum(1 for s in self.servers if s.state == "up") >= servers:
                    break
            time.sleep(0.1)
        return self.status()

    def servers_of(self, node):
        """The servers a NODE argument names: a Ray node id or its prefix, or a server's address."""
        with self.lock:
            found = [s for s in self.servers if s.address and (s.address == node or s.node_id.startswith(node))
                     and s.state not in ("lost", "stopped")]
        if not found:
            raise ValueError(f"no server of the pool is on node {node!r} (give a node id, a prefix of one, or a "
                             "server's address: `phos pool status`)")
        return found

    def drain(self, node, max_rounds=0):
        """Move every context of the node's servers to other servers by live handoff, the
        applications running; the node takes no new contexts from then on. Returns what moved
        and what did not (a failed handoff leaves its context live where it was)."""
        t0 = time.perf_counter()
        sources = self.servers_of(node)
        with self.lock:
            for s in sources:
                s.state = "draining"
        moved, failed = [], []
        exclude = {s.address for s in sources}
        for _ in range(DRAIN_PASSES):
            left = 0
            for s in sources:
                try:
                    with admin(s.address, self.auth_dir) as a:
                        ids = [c["id"] for c in a.list_contexts() if c["state"] != "warming"]
                except AdminError as e:
                    failed.append({"server": s.address, "error": str(e)})
                    continue
                for ctx in ids:
                    if any(f.get("ctx") == ctx for f in failed):
                        continue
                    left += 1
                    moved_one = self.move(ctx, s.address, exclude, max_rounds)
                    (moved if "error" not in moved_one else failed).append(moved_one)
            if not left:
                break
        with self.lock:
            for s in sources:
                if s.state == "draining":
                    s.state = "drained" if not failed else "draining"
        seconds = time.perf_counter() - t0
        self.metrics.drain.observe(seconds)
        return {"node": node, "servers": sorted(exclude), "moved": moved, "failed": failed, "seconds": seconds}

    def resume(self, node):
        """A drained (or draining) node's servers take new contexts again, as after maintenance.
        Returns the addresses of the servers resumed."""
        sources = self.servers_of(node)
        with self.lock:
            drained = [s for s in sources if s.state in ("draining", "drained")]
            for s in drained:
                s.state = "up"
        resumed = [s.address for s in drained]
        if not resumed:
            raise ValueError(f"node {node!r} is not drained: its servers are {', '.join(s.state for s in sources)}")
        log.info("node %s resumed: %s take new contexts again", node, ", ".join(resumed))
        return resumed

    def move(self, ctx, source, exclude, max_rounds=0):
        try:
            target = self.place(exclude)
        except NoRoom as e:
            return {"ctx": ctx, "from": source, "error": str(e)}
        try:
            with admin(source, self.auth_dir) as a:
                r = a.handoff(ctx, target, max_rounds)
        except AdminError as e:
            return {"ctx": ctx, "from": source, "to": target, "error": str(e)}
        finally:
            self.placing_done(target)
        with self.lock:
            self.home[ctx] = target
            self.by_address(target).arrived(ctx)
        self.metrics.handoff.observe(r["seconds"])
        self.metrics.handoff_downtime.observe(r["downtime_ms"] / 1e3)
        log.info("context %d moved from %s to %s in %.1f ms (held %.1f ms)", ctx, source, target, r["seconds"] * 1e3,
                 r["downtime_ms"])
        return {"ctx": ctx, "from": source, "to": target, "seconds": r["seconds"], "downtime_ms": r["downtime_ms"]}

    def server_pid(self, address):
        """The pid of a server's `phos server` process (tests check that it is gone at the end)."""
        with self.lock:
            return self.by_address(address).snap["pid"]

    def kill_server(self, address):
        """Kill a server at once, as a lost machine would (tests and benchmarks)."""
        s = self.by_address(address)
        ray.get(s.actor.kill.remote())

    def stop(self):
        """Stop every server (each stops its workers) and the front end."""
        self.stopping.set()
        self.front.stop()
        with self.lock:
            views = list(self.servers)
        refs = [s.actor.stop.remote() for s in views if s.state not in ("lost", "stopped")]
        try:
            ray.get(refs, timeout=60)
        except ray.exceptions.RayError:
            pass
        for s in views:
            ray.kill(s.actor)
            s.state = "stopped"
        return True


def curve_options(auth_dir):
    """(listener keys, the pool's own client keys) from a `phos keygen` directory, or (None, None)."""
    if not auth_dir:
        return None, None
    from phos.base.keys import load_curve
    from phos.pool.admin_client import pool_keys
    return load_curve(auth_dir), pool_keys(auth_dir)


def launch(options):
    """Start the pool's controller (named, detached) on this driver's Ray node; returns its handle."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    here = ray.get_runtime_context().get_node_id()
    return ray.remote(PoolController).options(
        name=CONTROLLER_NAME, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_concurrency=16,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote(options)


def server_options(work_dir, recovery_dir, checkpoint_every=2.0, pool=1, host="127.0.0.1", auth_dir=None,
                   image_key=None, log_level="WARNING"):
    """The PhosServer options every server of a pool gets (server_actor.py)."""
    return {"recovery_dir": os.path.abspath(recovery_dir), "checkpoint_every": checkpoint_every, "pool": pool,
            "work_dir": os.path.abspath(work_dir), "log_level": log_level, "host": host, "metrics_host": host,
            **({"auth_dir": os.path.abspath(auth_dir)} if auth_dir else {"insecure": True}),
            **({"image_key": os.path.abspath(image_key)} if image_key else {})}


def get_controller(address=None):
    """The running pool's controller on the Ray cluster at address (default: `auto`)."""
    if not ray.is_initialized():
        ray.init(address=address or "auto", namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)
    return ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
