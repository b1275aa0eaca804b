"""One phos server of the pool: a Ray actor that runs `phos server` on its node and reports on it.

The actor claims one GPU (num_gpus=1: Ray sets CUDA_VISIBLE_DEVICES, which the server and its
workers inherit), or on nodes without GPUs one unit of the EMU_RESOURCE custom resource, and
no CPU (its server's workers use what they need). It starts the server as a child process that
dies with it (PR_SET_PDEATHSIG; its workers die with the server in turn), so a node that Ray
loses takes its server down with it, as a machine's loss would. A thread polls the server's
admin API (admin_client.py) for the controller's view and for its Prometheus metrics.
"""
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from phos.pool.admin_client import AdminError, admin

log = logging.getLogger("phos.pool")

START_TIMEOUT = 60.0         # seconds `phos server` may take to listen
POLL_EVERY = 0.5             # seconds between polls of the admin API


def free_port(host):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent():
    """Run in the child before exec: the kernel kills it when the actor's thread that started
    it ends (the actor's process, for the thread that runs its constructor)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG


def unnice():
    """Undo Ray's niceness for its workers (RAY_worker_niceness, 15 by default): a server's
    workers and the pool's front end answer applications, and at nice 15 on a busy machine
    they wait milliseconds for a core (a device query through the pool would take several
    times as long). Lowering it needs root (or CAP_SYS_NICE); otherwise it stays, and `phos pool up`
    starts Ray with RAY_worker_niceness=0."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:
        pass


def private_mounts(paths):
    """A command prefix that runs a command in a mount namespace of its own, with an empty
    tmpfs on each of paths (e.g. /dev/shm and /tmp): a server that shares no files with the
    others there, as on a machine of its own (needs CAP_SYS_ADMIN, e.g. root)."""
    from phos.base.mounts import private_mounts as hide
    script = " && ".join([*hide(paths), 'exec "$0" "$@"'])
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]


class PhosServer:
    """Options (all from the controller): backend, host (to listen on), pool (pre-started
    workers), recovery_dir, checkpoint_every, standby (the pool's front end: stubs whose server
    died ask it), insecure or auth_dir, image_key, work_dir (logs), metrics_host,
    private_mounts (paths the server gets private, empty copies of: private_mounts())."""

    def __init__(self, options):
        import ray
        unnice()                 # before its server starts: it inherits ours
        self.options = options
        if options.get("auth_dir"):      # this process is a client of its server too (_total_memory): with the pool's keys
            from phos.base import settings
            settings.use_client_keys(os.path.join(options["auth_dir"], "server.key"),
                                     os.path.join(options["auth_dir"], "client.key_secret"))
        self.node_id = ray.get_runtime_context().get_node_id()
        host = options["host"]
        self.port = free_port(host)
        self.address = f"tcp://{host}:{self.port}"
        os.makedirs(options["work_dir"], exist_ok=True)
        self.log_path = os.path.join(options["work_dir"], f"server-{self.port}.log")
        self.proc = self._start()
        self.snap = {"address": self.address, "node_id": self.node_id, "state": "up", "contexts": [], "bytes": 0,
                     "total": self._total_memory(), "calls_per_s": 0.0, "calls_total": 0, "checkpoints": 0,
                     "checkpoint_seconds": 0.0, "restores": 0, "standby_workers": 0, "pid": self.proc.pid, "error": "",
                     "polled_at": time.time()}
        self.last_seqs, self.calls_total = {}, 0
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        from prometheus_client import CollectorRegistry
        from phos.pool.metrics import ServerCollector, serve
        registry = CollectorRegistry()
        registry.register(ServerCollector(self.snapshot))
        self.metrics_port = serve(registry, options.get("metrics_host", host))
        self.snap["metrics"] = f"http://{options.get('metrics_host', host)}:{self.metrics_port}/metrics"
        self.poll_once()
        threading.Thread(target=self._poll, name="phos-pool-poll", daemon=True).start()

    def _start(self):
        o = self.options
        cmd = [sys.executable, "-m", "phos.cli", "server", "--backend", o["backend"], "--listen", self.address,
               "--pool", str(o.get("pool", 1)), "--log-level", o.get("log_level", "WARNING")]
        if o.get("recovery_dir"):
            cmd += ["--recovery-dir", o["recovery_dir"], "--checkpoint-every", str(o.get("checkpoint_every", 2.0))]
            if o.get("standby"):
                cmd += ["--standby", o["standby"]]
        if o.get("auth_dir"):
            cmd += ["--auth-dir", o["auth_dir"]]
        elif o.get("insecure"):
            cmd += ["--insecure"]
        if o.get("image_key"):
            cmd += ["--image-key", o["image_key"]]
        if o.get("private_mounts"):
            cmd = private_mounts(o["private_mounts"]) + cmd
        logf = open(self.log_path, "w")
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent, env=dict(os.environ, **o.get("env", {})))
        logf.close()
        deadline = time.monotonic() + START_TIMEOUT
        while "listening on" not in self.output():
            if proc.poll() is not None or time.monotonic() > deadline:
                if proc.poll() is None:
                    proc.kill()
                raise RuntimeError(f"phos server at {self.address} did not start:\n{self.output()[-3000:]}")
            time.sleep(0.05)
        return proc

    def output(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def _total_memory(self):
        """The device's memory, as the server tells its clients."""
        from phos.client_stub.connection import Connection
        conn = Connection(self.address)
        try:
            res = conn.call("deviceTotalMem", {"device": 0}, timeout=10)
            if res.status:
                raise RuntimeError(f"{self.address}: deviceTotalMem failed: {res.message}")
            return res.u64s[0]
        finally:
            conn.close()

    # -- what the controller asks ---------------------------------------------------------
    def snapshot(self):
        with self.lock:
            return dict(self.snap, contexts=list(self.snap["contexts"]), metrics_port=self.metrics_port)

    def stop(self, timeout=15.0):
        """Stop the server (it stops its workers); returns its exit status."""
        self.stopping.set()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with self.lock:
            self.snap["state"] = "stopped"
        return self.proc.returncode

    def kill(self):
        """Kill the server at once, as a lost machine would (tests, benchmarks)."""
        self.stopping.set()
        self.proc.kill()
        self.proc.wait()
        with self.lock:
            self.snap["state"] = "lost"

    # -- polling --------------------------------------------------------------------------
    def _poll(self):
        while not self.stopping.wait(POLL_EVERY):
            self.poll_once()

    def poll_once(self):
        if self.proc.poll() is not None:
            with self.lock:
                self.snap.update(state="exited", error=f"phos server exited with {self.proc.returncode}")
            return
        began = time.time()        # what the server holds from then on is in what it answers
        try:
            with admin(self.address, self.options.get("auth_dir")) as a:
                contexts, stats = a.list_contexts(), a.stats()
        except AdminError as e:
            with self.lock:
                self.snap.update(state="unanswering", error=str(e))
            return
        with self.lock:
            dt = max(began - self.snap["polled_at"], 1e-6)
            ran = sum(max(c["last_seq"] - self.last_seqs.get(c["id"], c["last_seq"]), 0) for c in contexts)
            self.calls_total += ran
            self.last_seqs = {c["id"]: c["last_seq"] for c in contexts}
            self.snap.update(state="up", error="", contexts=contexts, bytes=stats["bytes"], calls_per_s=ran / dt,
                             calls_total=self.calls_total, checkpoints=stats["checkpoints"], restores=stats["restores"],
                             checkpoint_seconds=stats["checkpoint_seconds"], standby_workers=stats["standby_workers"],
                             polled_at=began)
