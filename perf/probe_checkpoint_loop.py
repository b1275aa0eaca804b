"""The application's speed before, during and after one concurrent checkpoint, and where the
worker's thread spends it.

    python3 perf/probe_checkpoint_loop.py --gib 8 --rate 2G [--py-spy PATH --out DIR]

A smaller, quicker cut of perf/bench_snapshot.py: one server, one application (this process,
through the Python client) launching a kernel and synchronizing in a loop, and one checkpoint
into a HostStore on /dev/shm asked for by another process. Prints the loop's kernels a second in
the windows before the ask, during the checkpoint and after it, and their ratio (during against
the mean of before and after). With --py-spy, samples the worker and this process in each window
(`py-spy record --idle --threads -f raw`, into --out): what changes on the worker's thread while a
checkpoint runs. The windows last 2 s; pick a rate that makes the checkpoint last a few.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_snapshot as bench  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
CHUNK = 16 * MiB
WINDOW = 2          # seconds of each window before and after the checkpoint


def busiest(pids, seconds=0.3):
    """The pid of pids that took the most CPU in the next `seconds`: the application's worker."""
    def cpu(pid):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    before = {p: cpu(p) for p in pids}
    time.sleep(seconds)
    return max(pids, key=lambda p: cpu(p) - before[p])


def sampled(args, name, seconds, pids):
    """Processes that last `seconds`: py-spy on each of pids, or a plain sleep without --py-spy."""
    if not args.py_spy:
        return [subprocess.Popen(["sleep", str(seconds)])]
    return [subprocess.Popen([args.py_spy, "record", "--nonblocking", "--idle", "--threads", "-r", "997", "-f", "raw",
                              "-d", str(seconds), "-p", str(pid), "-o", os.path.join(args.out, f"{name}_{who}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for who, pid in pids.items()]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cuda", choices=["cuda", "emu"])
    ap.add_argument("--gib", type=float, default=8.0, help="the context's allocated memory")
    ap.add_argument("--rate", type=bench.byte_size, default=0, help="the checkpoint's bytes a second (0: full)")
    ap.add_argument("--py-spy", help="a py-spy binary: sample the worker and this process in each window")
    ap.add_argument("--out", default=".", help="where py-spy's samples go")
    args = ap.parse_args()
    os.environ["PHOS_BENCH_BACKEND"] = args.backend
    from phos.client_stub import driver as cu
    from phos.snapshot import HostStore

    nbytes = int(args.gib * GiB) // CHUNK * CHUNK or CHUNK
    work = tempfile.mkdtemp(prefix="phos-probe-")
    shm = tempfile.mkdtemp(prefix="phos-probe-img-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    srv = None
    try:
        HostStore.create(shm, int(nbytes * 1.1) + 64 * (CHUNK + 4096), capacity=CHUNK)
        srv = bench.start_server(args.backend, work, "one", extra=("--host-store", shm))
        os.environ["PHOS_SERVER"] = srv.address
        cu._reset_for_tests()
        assert cu.cuInit(0)[0] == 0
        app = bench.App(cu, nbytes)
        bench.pool_full(srv.address)
        stop, ends = threading.Event(), []
        loop = threading.Thread(target=app.work, args=(stop, ends, 1))
        loop.start()
        time.sleep(0.5)
        pids = {"worker": busiest(srv.workers()), "app": os.getpid()}
        marks = [time.perf_counter()]
        for p in sampled(args, "before", WINDOW, pids):
            p.wait()
        marks.append(time.perf_counter())
        ask = bench.checkpoint_from_another_process(srv.address, int(app.ctx), shm, CHUNK, args.rate)
        spies = sampled(args, "during", WINDOW, pids)
        out, asked = ask()
        for p in spies:
            p.wait()
        marks.append(time.perf_counter())
        for p in sampled(args, "after", WINDOW, pids):
            p.wait()
        marks.append(time.perf_counter())
        stop.set()
        loop.join()
    finally:
        if srv is not None:
            srv.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    result = json.loads(out)
    end = asked["answered"]
    begin = end - result["seconds"]
    ends = np.array(ends)

    def rate(lo, hi):
        return ((ends > lo) & (ends <= hi)).sum() / (hi - lo)
    before, during, after = rate(marks[0], marks[1]), rate(begin, end), rate(marks[2], marks[3])
    print(f"kernels a second: before {before:.0f}, during the {result['seconds']:.2f} s checkpoint {during:.0f}, "
          f"after {after:.0f}: {during / ((before + after) / 2):.3f} of around")
    print("the worker's messages served, before and during (count, ms):", json.dumps(result["messages_served"]))
    print("the checkpoint's steps (ms):", json.dumps({k: round(v, 1) for k, v in result["phase_ms"].items()}))


if __name__ == "__main__":
    main()
