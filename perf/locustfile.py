"""Load test: many tenants at once, each a real phos session through the Python client.

Each locust user is one application with its own context. It loads vec_add
(tests/kernels/vecadd.cu, compiled to PTX by nvcc) once, then loops at its own pace
(`wait_time`): cuMemAlloc ×3, cuMemcpyHtoD ×2, cuLaunchKernel, cuMemcpyDtoH (the result
is checked), cuCtxSynchronize, cuMemFree ×3, on 4 KiB, 128 KiB or 1 MiB vectors. Every
call fires a locust request event named after it (request_type "cuda"). Asynchronous
calls (cuMemcpyHtoD under 256 KiB, cuLaunchKernel, cuMemFree) return once queued, so
their times are the client's cost; their errors surface at the next synchronous call,
as in CUDA.

Headless, 64 users for 5 minutes against one server:

    PHOS_MAX_CONTEXTS_PER_CLIENT=0 phos server --backend emu --listen ipc:///tmp/phos-load/phos.sock &
    PHOS_SERVER=ipc:///tmp/phos-load/phos.sock locust -f perf/locustfile.py --headless \\
        -u 64 -r 4 -t 5m --stop-timeout 30 --csv /tmp/phos-load/locust --only-summary

At the end it prints p50/p95/p99 per call in µs, calls/s and errors as a markdown table
(also written to $PHOS_LOCUST_SUMMARY if set): locust's own percentiles are whole
milliseconds. When the users have stopped it checks for leaks and exits 1 if it finds any: worker
processes of that server, its clients' /dev/shm/phos-* files, the server's per-context ipc sockets,
and device memory (cuMemGetInfo from a fresh context, before against after).

Concurrency. Locust runs users as gevent greenlets in one process. Two things make
them run concurrently: client_stub/connection.py uses zmq.green once gevent has patched
the process, so a call waiting for its reply yields to the other users instead of
blocking the process; and each user loads its own copy of phos.client_stub.driver,
like a separate application, because the module keeps one client's state in globals
(front-end connection, contexts, and a lock held across each call's round trip): 64
users sharing it would queue behind that lock and measure the queue, not the server.
Real threads would not help: that lock serializes them too, and gevent's patched lock
is not safe across threads.
"""
import ctypes
import glob
import importlib.util
import logging
import os
import random
import subprocess
import sys
import time

import numpy as np
from locust import User, between, events, task

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from ptx_helpers import compile_ptx  # noqa: E402  (nvcc, cached)

log = logging.getLogger("phos.locust")
SERVER = os.environ.get("PHOS_SERVER", "ipc:///tmp/phos/phos.sock")
SIZES = (1 << 10, 32 << 10, 256 << 10)       # floats per vector: 4 KiB (inline), 128 KiB (zero-copy), 1 MiB (staging)
PTX = compile_ptx("vecadd.cu", "compute_75").encode()
LEAK_WAIT = 10.0                              # seconds a stopped context may take to go away
# seconds between rounds, per user: 64 users then ask for ~20 rounds/s, about half of what a
# 2-core machine running the emu backend serves; PHOS_LOCUST_WAIT="MIN,MAX" changes it
WAIT = tuple(float(x) for x in os.environ.get("PHOS_LOCUST_WAIT", "1,5").split(","))


class CallFailed(Exception):
    pass


def new_client():
    """A private copy of phos.client_stub.driver: one application's worth of client state."""
    spec = importlib.util.find_spec("phos.client_stub.driver")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class PhosUser(User):
    wait_time = between(*WAIT)

    def on_start(self):
        self.cu = new_client()
        rng = np.random.default_rng()
        self.inputs = {n: rng.random((2, n), dtype=np.float32) for n in SIZES}
        self.open()

    def on_stop(self):
        if getattr(self, "ctx", None) is not None:
            self.call("cuCtxDestroy", self.ctx)
            self.ctx = None

    def open(self):
        self.call("cuInit", 0)
        self.ctx = self.call("cuCtxCreate", None, 0, 0)
        _contexts.add(int(self.ctx))
        module = self.call("cuModuleLoadData", PTX)
        self.fn = self.call("cuModuleGetFunction", module, b"vec_add")

    def call(self, name, *args, nbytes=0):
        """Run one driver call, fire its request event; returns its value or raises CallFailed."""
        start = time.perf_counter()
        res = getattr(self.cu, name)(*args)
        elapsed = (time.perf_counter() - start) * 1000
        error = None if res[0] == 0 else CallFailed(f"{res[0].name}: {self.cu.last_error}")
        self.environment.events.request.fire(request_type="cuda", name=name, response_time=elapsed,
                                             response_length=nbytes, exception=error, context={})
        _times.setdefault(name, []).append(elapsed)
        if error:
            raise error
        return res[1] if len(res) == 2 else res[1:] or None

    @task
    def round(self):
        n = random.choice(SIZES)
        a, b = self.inputs[n]
        nbytes = a.nbytes
        try:
            pa, pb, pc = (self.call("cuMemAlloc", nbytes) for _ in range(3))
            self.call("cuMemcpyHtoD", pa, a, nbytes, nbytes=nbytes)
            self.call("cuMemcpyHtoD", pb, b, nbytes, nbytes=nbytes)
            args = ((pa, pb, pc, n), (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int))
            self.call("cuLaunchKernel", self.fn, (n + 255) // 256, 1, 1, 256, 1, 1, 0, 0, args, 0)
            out = np.empty(n, np.float32)
            start = time.perf_counter()
            self.call("cuMemcpyDtoH", out, pc, nbytes, nbytes=nbytes)
            if not np.array_equal(out, a + b):     # a wrong answer counts as a failed copy-out
                self.environment.events.request.fire(
                    request_type="cuda", name="result check", response_time=(time.perf_counter() - start) * 1000,
                    response_length=nbytes, exception=CallFailed(f"vec_add of {n} floats gave a wrong result"), context={})
            self.call("cuCtxSynchronize")
            for p in (pa, pb, pc):
                self.call("cuMemFree", p)
        except CallFailed:
            # the context may hold a sticky error: start this application afresh
            self.cu.cuCtxDestroy(self.ctx)
            self.open()


# -- leak check -------------------------------------------------------------------------
def free_device_memory():
    """Free device memory as a fresh context sees it (device-wide on cuda), or None.

    Read until it holds still: taking a pre-started worker makes the server start another."""
    cu = new_client()
    try:
        if cu.cuInit(0)[0] != 0:
            return None
        err, ctx = cu.cuCtxCreate(None, 0, 0)
        if err != 0:
            return None
        free, deadline = cu.cuMemGetInfo()[1], time.monotonic() + 20
        while time.monotonic() < deadline:
            time.sleep(1)
            free, last = cu.cuMemGetInfo()[1], free
            if free == last:
                break
        cu.cuCtxDestroy(ctx)
        return free
    finally:
        cu._reset_for_tests()


def leftovers():
    """What the users' contexts left behind: worker processes, staging files, worker sockets.

    By context id: the server keeps pre-started workers (PHOS_POOL) that are not leaks."""
    found = []
    out = subprocess.run(["pgrep", "-af", "phos.gpu_server.worker"], capture_output=True, text=True).stdout
    workers = [line.split()[0] for line in out.splitlines()
               if SERVER in line and any(f"--ctx {ctx} " in line for ctx in _contexts)]
    if workers:
        found.append(f"{len(workers)} worker process(es): {' '.join(workers)}")
    shm = glob.glob(f"/dev/shm/phos-{os.getpid()}-*")      # the clients' staging files are named by their pid
    if shm:
        found.append(f"{len(shm)} staging file(s) in /dev/shm")
    if SERVER.startswith("ipc://"):
        path = SERVER[len("ipc://"):]
        socks = [f for ctx in _contexts for f in (f"{path}.ctx{ctx}", f"{path}.ctl{ctx}") if os.path.exists(f)]
        if socks:
            found.append(f"{len(socks)} worker socket file(s)")
    return found


_free_before = []
_contexts = set()    # ids of every context the users opened
_times = {}          # call name -> every response time (ms): locust rounds its percentiles to whole ms


def summary(environment):
    """p50/p95/p99 per call in µs, calls/s and errors, as a markdown table."""
    stats = environment.stats
    seconds = max(stats.total.last_request_timestamp - stats.total.start_time, 1e-9)
    rows = ["| call | calls | calls/s | errors | p50 (µs) | p95 (µs) | p99 (µs) |", "|---|---|---|---|---|---|---|"]
    for name in sorted(_times):
        t = np.array(_times[name]) * 1000
        p50, p95, p99 = np.percentile(t, [50, 95, 99])
        rows.append(f"| {name} | {len(t)} | {len(t) / seconds:.1f} | {stats.get(name, 'cuda').num_failures} "
                    f"| {p50:.0f} | {p95:.0f} | {p99:.0f} |")
    total = sum(len(t) for t in _times.values())
    rows.append(f"| all | {total} | {total / seconds:.1f} | {stats.total.num_failures} | | | |")
    return "\n".join(rows)


@events.test_start.add_listener
def measure_before(environment, **kw):
    _free_before[:] = [free_device_memory()]


@events.test_stop.add_listener
def check_leaks(environment, **kw):
    deadline = time.monotonic() + LEAK_WAIT
    while (found := leftovers()) and time.monotonic() < deadline:
        time.sleep(0.2)
    before, after = _free_before[0] if _free_before else None, free_device_memory()
    if before is not None and after is not None and after < before - (32 << 20):
        found.append(f"device memory: {before - after} bytes fewer free than before the run")
    table = summary(environment)
    print(table, flush=True)
    if os.environ.get("PHOS_LOCUST_SUMMARY"):
        with open(os.environ["PHOS_LOCUST_SUMMARY"], "w") as f:
            f.write(table + "\n")
    if found:
        log.error("LEAK CHECK FAILED: %s", "; ".join(found))
        environment.process_exit_code = 1
    else:
        log.warning("leak check passed: %d contexts, none left a worker process, /dev/shm/phos-* file or "
                    "worker socket; free device memory %s before, %s after", len(_contexts), before, after)
