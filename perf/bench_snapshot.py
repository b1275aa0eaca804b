"""Checkpoint and restore: phos next to the driver's own cuCheckpointProcess*, side by side.

    python perf/bench_snapshot.py --backend cuda --sizes 1,8,32            # on the H200 (perf/device/run.sh)
    python perf/bench_snapshot.py --backend emu --sizes 64,256 --unit MiB   # anywhere, no driver rows

For each size, a context holds that much allocated, non-zero memory (every chunk distinct,
so nothing deduplicates). The driver's rows come from a child process that allocates and
fills the same amount, which we lock, checkpoint, restore and unlock from here.

phos rows: the application (this process, through the Python client) keeps launching a
kernel and synchronizing while a concurrent checkpoint, asked for by another process as
`phos checkpoint` would be, runs; we record its throughput
against a run without checkpoint and the longest gap between two completed syncs (the
pause it saw). Then: a checkpoint to local disk, a full restore into a second server
process on the same GPU, and an on-demand restore after the first server is killed, timed
from the Restore call (on an admin channel already connected, as a supervisor's is; the JSON's
admin_connect_ms is what connecting cost) to the end of the application's first kernel there. "host memory"
is a HostStore on /dev/shm (snapshot/host_store.py), pinned by every server's pre-started
worker: the device copies chunks straight into it and back.
"""
import argparse
import cProfile
import logging.handlers
import ctypes
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
from spread import REPEAT, spread_text  # noqa: E402
from ptx_helpers import compile_ptx  # noqa: E402  (tests/kernels/snapshot.cu: fill_u64)
from phos.admin_cli import byte_size  # noqa: E402
from phos.schema.control import checkpoint_result  # noqa: E402
from phos.snapshot.engine import TRACE_SECONDS  # noqa: E402

FILL_PTX = compile_ptx("snapshot.cu", "compute_75")

GiB, MiB = 1 << 30, 1 << 20
GPU_BOUND = 32          # kernels a sync in the throughput-bound loop
PRINTED_MS = 30         # of a checkpoint's trace, the part the table shows
AROUND = 0.7            # s of the working loop alone right before and after a checkpoint: its rate without one
BIN_MS = 10             # the rate timelines' bin: a pause of a few ms still shows as a dip
MAX_BINS = 400          # bins widen past this many: the JSON stays small for a long handoff
P, U64 = ctypes.c_void_p, ctypes.c_uint64


# -- the driver's checkpoint, in a child process ----------------------------------------------
DRIVER_CHILD = r"""
import sys, ctypes, signal
from cuda.bindings import driver as cu
nbytes = int(sys.argv[1]); ptx = sys.stdin.read().encode() + b"\0"
def ok(r):
    assert int(r[0]) == 0, r
    return r[1] if len(r) > 1 else None
ok(cu.cuInit(0)); dev = ok(cu.cuDeviceGet(0)); ctx = ok(cu.cuDevicePrimaryCtxRetain(dev)); ok(cu.cuCtxSetCurrent(ctx))
fn = ok(cu.cuModuleGetFunction(ok(cu.cuModuleLoadData(ptx)), b"fill_u64"))
left = nbytes
while left:
    n = min(left, 1 << 30); p = ok(cu.cuMemAlloc(n)); left -= n
    ok(cu.cuLaunchKernel(fn, 4096, 1, 1, 256, 1, 1, 0, 0, ((int(p), n // 8, left), (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64)), 0))
ok(cu.cuCtxSynchronize())
print("READY", flush=True)
signal.pause()
"""


def driver_rows(nbytes):
    from cuda.bindings import driver as cu
    child = subprocess.Popen([sys.executable, "-c", DRIVER_CHILD, str(nbytes)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    child.stdin.write(FILL_PTX)
    child.stdin.close()
    assert child.stdout.readline().strip() == "READY"

    def timed(fn):
        t = time.perf_counter()
        err = fn(child.pid, None)
        assert int(err[0] if isinstance(err, tuple) else err) == 0, (fn.__name__, err)
        return time.perf_counter() - t
    lock = timed(cu.cuCheckpointProcessLock)
    ckpt = timed(cu.cuCheckpointProcessCheckpoint)
    rest = timed(cu.cuCheckpointProcessRestore)
    unlock = timed(cu.cuCheckpointProcessUnlock)
    child.kill()
    child.wait()
    return {"checkpoint_s": lock + ckpt, "restore_s": rest + unlock, "pause_ms": (lock + ckpt + rest + unlock) * 1e3}


# -- phos ---------------------------------------------------------------------------------------
class App:
    """The application: a context full of distinct data, and a kernel it keeps running."""

    def __init__(self, cu, nbytes):
        self.cu = cu
        self.ctx = self.ok(cu.cuCtxCreate(None, 0, 0))
        self.fill = self.ok(cu.cuModuleGetFunction(self.ok(cu.cuModuleLoadData(FILL_PTX.encode())), b"fill_u64"))
        self.buffers, left = [], nbytes
        while left:
            n = min(left, GiB)
            p = self.ok(cu.cuMemAlloc(n))
            self.launch(p, n // 8, left)
            self.buffers.append((p, n))
            left -= n
        self.scratch = self.ok(cu.cuMemAlloc(8 * MiB))      # what the working loop writes
        self.work_words = MiB if os.environ.get("PHOS_BENCH_BACKEND") != "emu" else 4096   # emu interprets PTX
        self.sync()

    def ok(self, res):
        assert int(res[0]) == 0, (res, self.cu.last_error)
        return res[1] if len(res) == 2 else None

    def launch(self, p, words, seed, blocks=4096):
        self.ok(self.cu.cuLaunchKernel(self.fill, blocks, 1, 1, 256, 1, 1, 0, 0, ((p, words, seed), (P, U64, U64)), 0))

    def sync(self):
        self.ok(self.cu.cuCtxSynchronize())

    def work(self, stop, record, launches=1):
        """Launch `launches` kernels on the scratch buffer and sync, until stop is set; record each
        sync's end time. One launch a sync: the application waits on phos at every kernel (a
        latency-bound loop); many: the device's work dominates (a throughput-bound one)."""
        self.ok(self.cu.cuCtxSetCurrent(self.ctx))        # contexts are current per thread
        i = 0
        while not stop.is_set():
            for _ in range(launches):
                self.launch(self.scratch, self.work_words, i, blocks=64)
                i += 1
            self.sync()
            record.append(time.perf_counter())


CHECKPOINT_CHILD = """
import json, sys
from phos.admin_cli import stub
from phos.schema import admin_pb2 as pb
from phos.schema.control import checkpoint_result
address, ctx, store, chunk, rate = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
admin = stub(address)
admin.Stats(pb.StatsRequest())                  # connected before we are timed
print("READY", flush=True)
sys.stdin.readline()
request = pb.CheckpointRequest(ctx=ctx, store=store, chunk_size=chunk, bytes_per_second=rate)
print(json.dumps(checkpoint_result(list(admin.Checkpoint(request))[-1].result)), flush=True)
"""


def checkpoint_from_another_process(address, ctx, store, chunk, rate=0):
    """A function that checkpoints from a process of its own, started and connected already, as
    `phos checkpoint` would: the application's process runs the application alone (its Python
    threads would share their GIL with the admin call's otherwise). Returns the result.
    rate: the checkpoint's bytes a second (CheckpointRequest.bytes_per_second; 0: as fast as it goes)."""
    child = subprocess.Popen([sys.executable, "-c", CHECKPOINT_CHILD, address, str(ctx), store, str(chunk), str(rate)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "READY"

    def run():
        marks = {"asked": time.perf_counter()}
        child.stdin.write("go\n")
        child.stdin.flush()
        out = child.stdout.readline()
        marks["answered"] = time.perf_counter()
        assert child.wait() == 0 and out, "the checkpoint failed (the child said why)"
        marks["child_exited"] = time.perf_counter()
        return out, marks       # parsed once the loop stopped: a long trace holds this process's interpreter for ms
    return run


def run_work(app, seconds=None, during=None, launches=1, around=0.0):
    """Syncs per second of the working loop, and its longest gap, for `seconds` or while `during` runs
    (with `around` seconds of the loop alone before and after it); and the end time of each of its syncs."""
    stop, ends = threading.Event(), []
    t = threading.Thread(target=app.work, args=(stop, ends, launches))
    gc.disable()        # as timeit does: this process's own collections are not phos's pauses
    start = time.perf_counter()
    t.start()
    time.sleep(around)
    result = during() if during else time.sleep(seconds)
    time.sleep(around)
    stop.set()
    t.join()
    gc.enable()
    elapsed = time.perf_counter() - start
    gaps = np.diff([start] + ends) if ends else np.array([elapsed])
    return len(ends) / elapsed, float(gaps.max()) * 1e3, result, np.array(ends)


BYSTANDER = """
import sys, time, json, numpy as np
kind, ends = sys.argv[1], []
a, b = np.ones(1 << 20), np.empty(1 << 20)      # 8 MiB each: past the caches
table = {i * 7919: i for i in range(1 << 22)} if kind == "lookups" else None      # ~300 MiB of Python objects
keys = [int(k) * 7919 for k in np.random.default_rng(0).integers(0, 1 << 22, 2000)]
print("READY", flush=True)
import select
while not select.select([sys.stdin], [], [], 0)[0]:
    if kind == "cpu":
        sum(range(3000))
    elif kind == "lookups":          # an interpreter whose objects miss the caches, as a worker's do
        for k in keys:
            table[k]
    else:
        np.copyto(b, a)
    ends.append(time.perf_counter())
print(json.dumps(ends), flush=True)
"""


def bystanders():
    """Processes beside the benchmark that keep timing their own loops: one in pure Python
    (the CPU), one copying 8 MiB arrays (host memory bandwidth), one looking up a dict too big for
    the caches (memory latency). If they slow down while a checkpoint runs, the machine is slower
    then, for every process, not just phos's application.
    Returns a function that stops them and gives each one's loop ends."""
    procs = {kind: subprocess.Popen([sys.executable, "-c", BYSTANDER, kind], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True) for kind in ("cpu", "memory", "lookups")}
    for p in procs.values():
        assert p.stdout.readline().strip() == "READY"

    def stop():
        out = {}
        for kind, p in procs.items():
            p.stdin.write("stop\n")
            p.stdin.flush()
            out[kind] = np.array(json.loads(p.stdout.readline()))
            p.wait()
        return out
    return stop


def numa_facts(shm_dir):
    """The host's NUMA nodes, the GPU's, and where the pages of the host store lie (the
    processes' numa_maps of it; N<node>=pages)."""
    import glob
    facts = {"nodes": sorted(os.path.basename(n) for n in glob.glob("/sys/devices/system/node/node[0-9]*")),
             "gpu_node": [open(f).read().strip() for f in glob.glob("/sys/bus/pci/drivers/nvidia/*/numa_node")]}
    pages = {}
    for maps in glob.glob("/proc/[0-9]*/numa_maps"):
        try:
            with open(maps) as f:
                lines = [ln for ln in f if shm_dir in ln]
        except OSError:
            continue
        for ln in lines:
            for word in ln.split():
                if word[0] == "N" and "=" in word:
                    node, n = word[1:].split("=")
                    pages[node] = max(pages.get(node, 0), int(n))
    facts["store_pages_by_node"] = pages
    return facts


def rate_timeline(ends, origin, lo, hi, marks=None, per_sync=1):
    """The loop's completed syncs counted in bins from `lo` to `hi` (perf_counter times), the
    bins and `marks` in ms after `origin`: what perf/plots.py draws as the application's rate
    through a checkpoint or a handoff. Counts, not the raw times: a second at 67,000 syncs/s
    would be 67,000 numbers. per_sync: kernels a sync, to turn syncs/s into kernels/s."""
    span_ms = max(hi - lo, 1e-3) * 1e3
    bin_ms = max(BIN_MS, math.ceil(span_ms / MAX_BINS))
    edges = lo + np.arange(0, span_ms + bin_ms, bin_ms) / 1e3
    counts = np.histogram(np.asarray(ends), edges)[0]
    return {"bin_ms": bin_ms, "start_ms": round((lo - origin) * 1e3, 3), "counts": counts.tolist(), "per_sync": per_sync,
            "marks_ms": {k: round((v - origin) * 1e3, 3) for k, v in (marks or {}).items()}}


def longest_gap_ms(ends, after, until):
    """The longest time between two syncs of the loop that spans part of (after, until]."""
    i, j = max(np.searchsorted(ends, after) - 1, 0), np.searchsorted(ends, until) + 1
    return float(np.diff(ends[i:j]).max()) * 1e3 if j - i > 1 else float("nan")


def syncs_per_s(ends, after, until):
    """The rate of the syncs that ended in (after, until]."""
    return float(((ends > after) & (ends <= until)).sum()) / max(until - after, 1e-9)


def start_server(backend, work_dir, name, extra=()):
    """A server whose pre-started worker is up: restores adopt it instead of starting one.
    extra: more `phos server` arguments."""
    from conftest import ServerProc
    d = os.path.join(work_dir, name)
    os.makedirs(d, exist_ok=True)
    srv = ServerProc(backend, d, pool=1, extra=tuple(extra))
    pool_full(srv.address)
    return srv


def pool_full(address):
    """Wait until the server's pre-started worker is up: one being started (and pinning the
    host store) slows every other process's driver calls meanwhile."""
    from phos.admin_cli import stub
    from phos.schema import admin_pb2 as pb
    deadline = time.monotonic() + 60
    while stub(address).Stats(pb.StatsRequest()).standby_workers < 1 and time.monotonic() < deadline:
        time.sleep(0.05)


def timed_reattach():
    """Record when the client's re-attaches start and end (perf_counter), to place them in the
    gap, and what the client said of its steps (finding the context, attaching to its worker)."""
    from phos.client_stub.connection import Connection
    marks, plain = [], getattr(Connection.reattach, "plain", Connection.reattach)

    def reattach(self, seq):
        said = logging.handlers.BufferingHandler(100)
        client = logging.getLogger("phos.client")
        level, propagate = client.level, client.propagate
        client.addHandler(said)
        client.setLevel(logging.INFO)
        client.propagate = False     # kept here, not written out meanwhile: a write to a slow disk is not the stub's time
        profile = cProfile.Profile() if os.environ.get("PHOS_PROFILE_DIR") else None
        t, wall = time.perf_counter(), time.time()
        try:
            if profile is None:
                return plain(self, seq)
            return profile.runcall(plain, self, seq)     # where its time goes (perf/show_profiles.py)
        finally:       # each line with when it was logged, in ms after the re-attach began
            marks.append((t, time.perf_counter(), "; ".join(f"{r.getMessage()} (at {(r.created - wall) * 1e3:.1f})"
                                                             for r in said.buffer)))
            if profile is not None:
                profile.dump_stats(os.path.join(os.environ["PHOS_PROFILE_DIR"], f"reattach-{os.getpid()}-{time.time_ns()}.prof"))
            client.removeHandler(said)
            client.setLevel(level)
            client.propagate = propagate
    reattach.plain = plain
    Connection.reattach = reattach
    return marks


def phos_rows(backend, nbytes, work_dir, shm_dir, disk_dir, chunk, copy_rate=0):
    from phos.admin_cli import stub
    from phos.client_stub import driver as cu
    from phos.schema import admin_pb2 as pb

    from phos.snapshot import HostStore, delete_image
    # host memory: a HostStore that every server's pre-started worker pins, room for one image
    host = HostStore.create(shm_dir, int(nbytes * 1.1) + 64 * (chunk + 4096), capacity=chunk)

    def server(name):
        return start_server(backend, work_dir, name, extra=("--host-store", shm_dir))

    def checkpoint(srv, ctx, store, **kw):
        msgs = list(stub(srv.address).Checkpoint(pb.CheckpointRequest(ctx=ctx, store=store, chunk_size=chunk, **kw)))
        return checkpoint_result(msgs[-1].result)

    row = {}
    one = server("one")
    # did its workers pin the host store (INFO: "pinned host store ... in N s"), or say why not?
    row["host_store_log"] = [ln.split("] ", 1)[-1] for ln in one.output().splitlines() if "host store" in ln][:4]
    os.environ["PHOS_SERVER"] = one.address
    cu._reset_for_tests()
    assert cu.cuInit(0)[0] == 0
    app = App(cu, nbytes)
    ctx = int(app.ctx)
    time.sleep(0.5)
    pool_full(one.address)         # the application took the pre-started worker: its successor is up
    row["kernels_per_s"], row["gap_ms_idle"], _, _ = run_work(app, seconds=1.0)
    baseline = run_work(app, seconds=1.0, launches=GPU_BOUND)[0]
    # stop the world first: where a copy's time goes (device copies vs storing), with no
    # application beside it; deleted at once, so that the next image is copied whole again
    res = checkpoint(one, ctx, shm_dir, paused=True)
    row["checkpoint_paused_s"], row["checkpoint_paused_phase_ms"] = res["seconds"], res["phase_ms"]
    delete_image(host, res["name"])
    row["numa"] = numa_facts(shm_dir)
    for launches in (GPU_BOUND, 1):       # the last one is kept: the restores below use it
        stop_bystanders = bystanders() if launches == 1 else None
        t = time.perf_counter()
        rate, gap, (res, marks), ends = run_work(
            app, during=checkpoint_from_another_process(one.address, ctx, shm_dir, chunk, copy_rate), launches=launches,
            around=AROUND if launches == 1 else 0.0)
        res = json.loads(res)
        # the checkpoint ran during the `seconds` before its answer came (a millisecond or two on):
        # its window; the rest of the wall time is the admin call's own, from another process
        end = marks["answered"]
        begin = end - res["seconds"]
        during = syncs_per_s(ends, begin, end)
        alone = AROUND if launches == 1 else 0.0
        timeline = rate_timeline(ends, begin, marks["asked"] - alone, marks["child_exited"] + alone, per_sync=launches,
                                 marks={"asked": marks["asked"], "cut": res.get("trace_from", begin),
                                        "checkpoint_end": end, "asker_exited": marks["child_exited"]})
        if launches == GPU_BOUND:
            row["gpu_bound"] = {"kernels_per_s": baseline * launches, "kernels_per_s_during": during * launches,
                                "gap_ms": gap, "checkpoint_s": res["seconds"], "rate_timeline": timeline}
            delete_image(host, res["name"])
    row["checkpoint_host_s"] = res["seconds"]
    row["pause_ms"] = longest_gap_ms(ends, marks["asked"], marks["child_exited"])    # the admin call's span
    row["gap_ms_whole_loop"] = gap
    row["messages_served"] = res["messages_served"]
    row["checkpoint_host_phase_ms"] = res["phase_ms"]
    row["checkpoint_host_wall_s"] = time.perf_counter() - t
    row["kernels_per_s_during"] = during
    row["rate_timeline"] = timeline      # one kernel a sync, with AROUND s of the loop alone on each side

    def around(times):     # a loop's rate in the AROUND seconds (less the loop's start) before the ask and after the asker ended
        asked, exited, alone = marks["asked"], marks["child_exited"], AROUND - 0.05
        return (syncs_per_s(times, asked - alone, asked) + syncs_per_s(times, exited, exited + alone)) / 2
    row["kernels_per_s_around"] = around(ends)
    loops = stop_bystanders()
    row["bystanders_during_vs_around"] = {k: syncs_per_s(v, begin, end) / around(v) for k, v in loops.items()}
    row["kernels_per_s_wall"] = rate
    row["wall_ms"] = {"asked_to_start": round((begin - marks["asked"]) * 1e3, 1),
                      "answer_to_child_exit": round((marks["child_exited"] - end) * 1e3, 1),
                      "kernels_per_s_before": round(syncs_per_s(ends, marks["asked"], begin)),
                      "kernels_per_s_after": round(syncs_per_s(ends, end, marks["child_exited"]))}
    row["checkpoint_host_meta"] = {k: res[k] for k in ("pause_ms", "paused", "recopied_chunks", "copied_bytes")}
    row["cut_ms"] = res["pause_ms"]
    # the pause, step by step: the worker's steps from its cut (trace_ms; perf_counter is the
    # machine's monotonic clock, in both processes) beside this loop's syncs then
    t_cut = res["trace_from"]
    row["gap_at_cut_ms"] = longest_gap_ms(ends, t_cut, t_cut)     # the pause the cut's fingerprint pass made

    def traced(times):
        return [round((e - t_cut) * 1e3, 3) for e in times if -0.005 < e - t_cut < TRACE_SECONDS]
    row["pause_trace"] = {"steps": res["trace_ms"], "syncs_ms": traced(ends),
                          "bystanders_ms": {k: traced(v) for k, v in loops.items()}}
    if disk_dir:
        row["checkpoint_disk_s"] = checkpoint(one, ctx, disk_dir)["seconds"]
    two = server("two")                         # a full restore into a second server process
    t = time.perf_counter()
    stub(two.address).Restore(pb.RestoreRequest(store=shm_dir, full=True))
    row["restore_host_full_s"] = time.perf_counter() - t
    two.stop()
    if disk_dir:
        three = server("three")
        t = time.perf_counter()
        stub(three.address).Restore(pb.RestoreRequest(store=disk_dir, full=True))
        row["restore_disk_full_s"] = time.perf_counter() - t
        three.stop()
    # on demand: the application's own server dies; its context comes back elsewhere
    app.sync()
    checkpoint(one, ctx, shm_dir, incremental=True)         # the cut the application is at now
    one.proc.kill()
    one.proc.wait()
    four = server("four")
    os.environ["PHOS_SERVER"] = four.address
    reattaches = timed_reattach()
    collections = []          # this process's garbage collections in that window: (start, end, generation)
    gc.callbacks.append(lambda phase, info: collections.append([time.perf_counter(), None, info["generation"]])
                        if phase == "start" else collections[-1].__setitem__(1, time.perf_counter()))
    admin = stub(four.address)       # connected first, as an orchestrator's channel is: the timer starts at the ask
    t = time.perf_counter()
    admin.Stats(pb.StatsRequest())
    row["admin_connect_ms"] = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    reply = admin.Restore(pb.RestoreRequest(store=shm_dir))
    row["restore_on_demand_usable_s"] = time.perf_counter() - t
    row["restore_on_demand_phase_ms"] = {k: round(v, 2) for k, v in reply.phase_ms.items()}
    row["restore_on_demand_server_s"] = reply.seconds
    app.launch(app.scratch, app.work_words, 7, blocks=64)
    app.sync()
    row["first_kernel_after_restore_s"] = time.perf_counter() - t
    row["reattach_ms"] = [[round((a - t) * 1e3, 1), round((b - t) * 1e3, 1), said] for a, b, said in reattaches]
    gc.callbacks.pop()
    row["gc_in_restore_ms"] = [[round((a - t) * 1e3, 1), round((b - a) * 1e3, 2), g] for a, b, g in collections]
    row["threads_in_restore"] = [th.name for th in threading.enumerate()]     # who else may hold our interpreter
    cu._reset_for_tests()
    four.stop()
    one.stop()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cuda", choices=["cuda", "emu"])
    ap.add_argument("--sizes", default="1,8,32")
    ap.add_argument("--unit", default="GiB", choices=["GiB", "MiB"])
    ap.add_argument("--chunk-mb", type=int, default=16, help="chunk size of the phos images")
    ap.add_argument("--disk", default="/var/tmp/phos-bench", help="image store on local disk")
    ap.add_argument("--no-driver", action="store_true")
    ap.add_argument("--no-disk", action="store_true", help="host memory only: no checkpoint to and restore from disk")
    ap.add_argument("--repeat", type=int, default=REPEAT,
                    help="runs of each size, the driver's and phos's side by side: the device's figures vary from run to run")
    ap.add_argument("--rate", type=byte_size, default=0, metavar="BYTES",
                    help="the concurrent checkpoints keep to this many bytes a second (phos checkpoint --rate)")
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ["PHOS_BENCH_BACKEND"] = args.backend
    os.environ.setdefault("PHOS_LOG", "INFO")        # the servers' workers say how pinning went
    unit = GiB if args.unit == "GiB" else MiB
    rows = []
    for size, run in [(int(s), run) for s in args.sizes.split(",") for run in range(max(1, args.repeat))]:
        nbytes = size * unit
        work = tempfile.mkdtemp(prefix="phos-bench-")
        shm = tempfile.mkdtemp(prefix="phos-bench-img-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        disk = os.path.join(args.disk, f"img-{size}")
        shutil.rmtree(disk, ignore_errors=True)
        os.makedirs(disk, exist_ok=True)
        try:
            rate = f", copy at {args.rate / 1e9:.3g} GB/s" if args.rate else ""
            row = {"size": f"{size} {args.unit}{rate}", "bytes": nbytes}
            if args.backend == "cuda" and not args.no_driver:
                row["driver"] = driver_rows(nbytes)
            row["phos"] = phos_rows(args.backend, nbytes, work, shm, None if args.no_disk else disk, args.chunk_mb * MiB,
                                    args.rate)
            rows.append(row)
            print(json.dumps(row), flush=True)
        finally:
            for d in (work, shm, disk):
                shutil.rmtree(d, ignore_errors=True)
    print_table(rows)
    print_spread(rows)
    print_pause_traces(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def serve_us(p, when):
    n, ms = p["messages_served"][when]
    return f"{1e3 * ms / max(n, 1):.1f}"


def print_pause_traces(rows):
    """Where each run's pause went: the loop's syncs and the worker's steps of over 0.1 ms, in
    ms after the cut began (the cut's own step, the fingerprints' arrival, and the rest), for the
    first PRINTED_MS (the JSON holds the whole trace: PHOS_TRACE_SECONDS=1 traces the copy)."""
    print("\n| size | syncs after the cut (ms) | the worker's steps: start+ms |\n|---|---|---|")
    for r in rows:
        t = r["phos"].get("pause_trace")
        if t:
            steps = ", ".join(f"{name} {start:.1f}+{ms:.1f}" for start, name, ms in t["steps"]
                              if (ms > 0.1 or name == "cut_fingerprints_ready") and start < PRINTED_MS)
            syncs = ", ".join(f"{s:.1f}" for s in t["syncs_ms"] if s < PRINTED_MS)
            print(f"| {r['size']} | {syncs} | {steps} |")


def print_spread(rows):
    """Least, median and most of each figure over the runs of a size, the driver's beside phos's
    (runs side by side in one call: a slow VM slows both)."""
    def get(d, key, scale=1.0):
        return None if d is None or d.get(key) is None else scale * d[key]

    def pct(p, during, of):
        return 100 * p[during] / p[of]

    def locked(d):      # the driver's lock stops the application for its whole checkpoint and restore
        return None if d is None else 0.0
    figures = {   # figure: (the driver's, phos's), each from a row's "driver" and "phos" parts
        "checkpoint to host (s)": (lambda d: get(d, "checkpoint_s"), lambda p: p["checkpoint_host_s"]),
        "checkpoint to disk (s)": (lambda d: None, lambda p: get(p, "checkpoint_disk_s")),
        "full restore (s)": (lambda d: get(d, "restore_s"), lambda p: p["restore_host_full_s"]),
        "the application's pause (ms)": (lambda d: get(d, "pause_ms"), lambda p: p["pause_ms"]),
        "of it, across the cut (ms)": (lambda d: None, lambda p: p["gap_at_cut_ms"]),
        "throughput, one kernel a sync (%)": (locked, lambda p: pct(p, "kernels_per_s_during", "kernels_per_s")),
        "the same, against the loop right around it (%)": (
            locked, lambda p: pct(p, "kernels_per_s_during", "kernels_per_s_around")),
        f"throughput, {GPU_BOUND} kernels a sync (%)": (
            locked, lambda p: pct(p["gpu_bound"], "kernels_per_s_during", "kernels_per_s")),
        "first kernel after on-demand restore (ms)": (lambda d: None, lambda p: 1e3 * p["first_kernel_after_restore_s"]),
    }
    print("\n| size | runs | figure | driver: least / median / most | phos: least / median / most |\n|---|---|---|---|---|")
    for size in dict.fromkeys(r["size"] for r in rows):
        runs = [r for r in rows if r["size"] == size]
        for name, (driver, phos) in figures.items():
            print(f"| {size} | {len(runs)} | {name} | {spread_text(driver(r.get('driver')) for r in runs)} | "
                  f"{spread_text(phos(r['phos']) for r in runs)} |")


def print_table(rows):
    def disk(p, key, nbytes=None):          # "-" in a run with --no-disk
        s = p.get(key)
        return "-" if s is None else f"{s:.3f} ({gbs(nbytes, s)})" if nbytes else f"{s:.3f}"

    def gbs(nbytes, s):
        return f"{nbytes / s / 1e9:.2f}" if s else "-"
    print("\n| size | system | checkpoint to host (s, GB/s) | to disk (s, GB/s) | restore from host, full (s, GB/s) | from disk (s) "
          "| longest gap between the application's syncs (ms) | kernel throughput during checkpoint | first kernel after on-demand restore (ms) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        d, p, n = r.get("driver"), r["phos"], r["bytes"]
        if d:
            print(f"| {r['size']} | driver (cuCheckpointProcess*) | {d['checkpoint_s']:.3f} ({gbs(n, d['checkpoint_s'])}) | - | "
                  f"{d['restore_s']:.3f} ({gbs(n, d['restore_s'])}) | - | {d['pause_ms']:.0f} (locked throughout) | 0% (locked) | - |")
        ratio = f" ({d['checkpoint_s'] / p['checkpoint_host_s']:.1f}× faster)" if d else ""
        print(f"| {r['size']} | phos (concurrent) | {p['checkpoint_host_s']:.3f} ({gbs(n, p['checkpoint_host_s'])}){ratio} | "
              f"{disk(p, 'checkpoint_disk_s', n)} | "
              f"{p['restore_host_full_s']:.3f} ({gbs(n, p['restore_host_full_s'])}) | {disk(p, 'restore_disk_full_s')} | "
              f"{p['pause_ms']:.1f} (across the cut {p['gap_at_cut_ms']:.1f}, the cut itself {p['cut_ms']:.1f}; "
              f"loop without checkpoint {p['gap_ms_idle']:.1f}) | "
              f"{100 * p['kernels_per_s_during'] / p['kernels_per_s']:.0f}% ({p['kernels_per_s_during']:.0f} vs {p['kernels_per_s']:.0f}/s) | "
              f"{p['first_kernel_after_restore_s'] * 1e3:.1f} |")
    print("\n| size | kernel throughput during the checkpoint: one kernel a sync, against the loop's first second "
          f"| against its {AROUND} s right before and after | bystanders' loops then: CPU, memory, lookups "
          "| the worker's µs a message, before and during | 32 kernels a sync | its longest gap (ms) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        p, g = r["phos"], r["phos"]["gpu_bound"]
        b = p["bystanders_during_vs_around"]
        print(f"| {r['size']} | {100 * p['kernels_per_s_during'] / p['kernels_per_s']:.0f}% | "
              f"{100 * p['kernels_per_s_during'] / p['kernels_per_s_around']:.0f}% ({p['kernels_per_s_around']:.0f}/s) | "
              f"{100 * b['cpu']:.0f}%, {100 * b['memory']:.0f}%, {100 * b['lookups']:.0f}% | {serve_us(p, 'before')}, {serve_us(p, 'during')} | "
              f"{100 * g['kernels_per_s_during'] / g['kernels_per_s']:.0f}% ({g['kernels_per_s_during']:.0f} vs {g['kernels_per_s']:.0f}/s) | "
              f"{g['gap_ms']:.1f} |")
    print("\n| size | the admin call, asked → checkpoint begins (ms) | its answer → the asking process ended (ms) | "
          "kernels/s in those | over the whole call |")
    print("|---|---|---|---|---|")
    for r in rows:
        p = r["phos"]
        w = p["wall_ms"]
        print(f"| {r['size']} | {w['asked_to_start']} | {w['answer_to_child_exit']} | {w['kernels_per_s_before']} and "
              f"{w['kernels_per_s_after']} | {p['kernels_per_s_wall']:.0f} |")
    print("\n| size | paused checkpoint to host (s, GB/s) | its steps (ms) |")
    print("|---|---|---|")
    for r in rows:
        p = r["phos"]
        steps = ", ".join(f"{k} {v:.0f}" for k, v in p["checkpoint_paused_phase_ms"].items())
        print(f"| {r['size']} | {p['checkpoint_paused_s']:.3f} ({gbs(r['bytes'], p['checkpoint_paused_s'])}) | {steps} |")


if __name__ == "__main__":
    main()
