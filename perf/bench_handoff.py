"""Live handoff: the application's downtime and the total time, while it writes ~10% of its
memory per second, between two server processes on one GPU (issue 6).

    python perf/bench_handoff.py --backend cuda --sizes 1,8              # on the H200 (perf/device/run.sh handoff)
    python perf/bench_handoff.py --backend emu --sizes 16 --unit MiB      # anywhere
    python perf/bench_handoff.py --backend emu --sizes 256 --unit MiB --chunk-kib 64 --via shm   # 8 GiB's 4,096 chunks
    python perf/bench_handoff.py --backend cuda --sizes 1,8 --via tcp    # two servers sharing nothing but TCP (root)
    python perf/bench_handoff.py --backend emu --sizes 16 --unit MiB --via tcp

--via tcp: each server in a mount namespace of its own (own /dev/shm, /tmp, /run, keys and
image key: tests/share_nothing.py), on tcp://127.0.0.1 with CURVE keys; the rounds stream
over the target's network admin API (gpu_server/control/handoff_net.py) and the client follows with
the target's key. The source has a host store of its own, where the rounds go (unless
--no-source-host-store). Needs root's `unshare -m`.

Downtime is the longest gap between two of the application's completed synchronizing calls
during the handoff; the loop without a handoff gives the baseline gap. That gap includes the
loop's own wait between its steps (--step-ms, 1 ms: kept short, since a wait of 10 ms would put
10 ms of the loop's own sleep into every gap); "longest step" is how long one step (its
launches and the synchronize after them) took from its first call to its end: the stall itself.
Where the rounds did not halve, the source held the application's calls part of the time until
the freeze (PHOS_HANDOFF_THROTTLE): the table says for how long, how much, and the
application's rate of synchronizes then against the second before the handoff.
"""
import argparse
import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_snapshot import GiB, MiB, App, pool_full, rate_timeline, start_server, timed_reattach  # noqa: E402
from spread import REPEAT, spread_text  # noqa: E402


def writer(app, stop, ends, starts, step, failed, share=0.1):
    """Every `step` seconds rewrite share*step of the context's memory (the next slice of its
    buffers) and synchronize; record when each step began and when its sync completed, and in
    `failed` the error that stopped the loop, if one did."""
    try:
        write_steps(app, stop, ends, starts, step, share)
    except Exception as e:     # the handoff lost the application: measure() says so, with the servers' logs
        failed.append(e)


def write_steps(app, stop, ends, starts, step, share):
    app.ok(app.cu.cuCtxSetCurrent(app.ctx))
    per_step = int(sum(n for _, n in app.buffers) * share * step) // 8 * 8
    b, off, i = 0, 0, 0
    while not stop.is_set():
        t = time.perf_counter()
        left = per_step
        while left:
            p, n = app.buffers[b]
            words = min(left, n - off) // 8
            app.launch(int(p) + off, words, i, blocks=min(4096, max(1, words // 256)))
            off, left = off + 8 * words, left - 8 * words
            if off >= n:
                b, off = (b + 1) % len(app.buffers), 0
        app.sync()
        starts.append(t)
        ends.append(time.perf_counter())
        i += 1
        time.sleep(max(0.0, step - (time.perf_counter() - t)))


def share_nothing_servers(backend, work_dir, source_host_memory=0):
    """Two servers in mount namespaces of their own, on TCP with keys of their own (tests/share_nothing.py);
    returns them, the client's environment and the Handoff's to_server_key. source_host_memory:
    the first (the source) has a host store of its own that big, in its own /dev/shm, as a GPU
    server is set up (README): the rounds go there (gpu_server/control/handoff.py, host_store_for)."""
    import pathlib
    from share_nothing import PRIVATE, key_pairs, start_isolated, unshare_permitted
    from phos.schema.admin_net import read_key_file
    why = unshare_permitted()
    if why:
        raise SystemExit(f"--via tcp needs mount namespaces (run as root): unshare -m: {why}")
    a_keys, b_keys = pathlib.Path(work_dir) / "a-keys", pathlib.Path(work_dir) / "b-keys"
    key_pairs(a_keys, b_keys)
    servers = []
    host = ("--host-store", f"{PRIVATE}/host", "--host-memory", str(source_host_memory)) if source_host_memory else ()
    for name, keys, extra in (("one", a_keys, host), ("two", b_keys, ())):
        os.makedirs(os.path.join(work_dir, name))
        servers.append(start_isolated(backend, os.path.join(work_dir, name), keys, extra=extra))
    env = {"PHOS_SERVER_KEY": str(a_keys / "server.key"), "PHOS_CLIENT_KEY": str(a_keys / "client.key_secret")}
    # as a server that runs long has them: pre-started workers, the source's with its host store
    # pinned (the application's worker would pin its copy buffers as it checkpoints, and
    # copy through them: a first round of 1 GiB took 0.8 s and held the application 178 ms)
    for server, key in zip(servers, (a_keys, b_keys)):      # measure() then sets env for the source
        os.environ.update(env, PHOS_SERVER_KEY=str(key / "server.key"))
        pool_full(server.address)
    return servers, env, read_key_file(str(b_keys / "server.key")).decode()


def measure(backend, nbytes, work_dir, chunk_size=0, recovery_dir="", host_store="", step=0.001, tcp=False, host_memory=0):
    from phos.admin_cli import stub
    from phos.client_stub import driver as cu
    from phos.schema import admin_pb2 as pb
    to_key, failed = "", []
    if tcp:
        (one, two), env, to_key = share_nothing_servers(backend, work_dir, host_memory)
        os.environ.update(env)
    else:
        # a target taking recovery images gets the rounds in its recovery directory; else servers
        # sharing a host store, there
        recovering = ["--recovery-dir", recovery_dir, "--checkpoint-every", "600"] if recovery_dir else []
        shared = ["--host-store", host_store] if host_store else []
        one, two = start_server(backend, work_dir, "one", shared), start_server(backend, work_dir, "two", recovering + shared)
    try:
        os.environ["PHOS_SERVER"] = one.address
        cu._reset_for_tests()
        assert cu.cuInit(0)[0] == 0
        reattaches = timed_reattach()
        app = App(cu, nbytes)
        # its worker came from the source's pool: the handoff starts once the pool has another,
        # as on a server that runs long (a worker starting pins its copy buffers and the host
        # store, under a driver lock that every process on the GPU shares)
        pool_full(one.address)
        stop, ends, starts = threading.Event(), [], []
        loop = threading.Thread(target=writer, args=(app, stop, ends, starts, step, failed))
        loop.start()
        time.sleep(1.0)
        baseline = float(np.diff(ends).max()) * 1e3
        baseline_step = max(e - s for s, e in zip(starts, ends)) * 1e3
        t0, t0_wall = time.perf_counter(), time.time()     # the wall clock: to place the servers' log lines
        reply = stub(one.address).Handoff(pb.HandoffRequest(ctx=int(app.ctx), to=two.address, chunk_size=chunk_size,
                                                            to_server_key=to_key), timeout=3600)
        t1 = time.perf_counter()
        time.sleep(1.0)
        stop.set()
        loop.join()
        if failed:
            raise RuntimeError(f"the application failed during the handoff: {failed[0]}; its re-attaches said: "
                               f"{[said for _, _, said in reattaches]}")
        during = [e for e in ends if t0 <= e <= t1 + 1.0]
        before = max(e for e in ends if e < t0)
        marks = [before] + during
        gaps = np.diff(marks)
        gap = float(gaps.max()) * 1e3
        gap_at = (marks[int(gaps.argmax())] - t0) * 1e3          # where it began, after the Handoff call
        step = max(e - s for s, e in zip(starts, ends) if t0 <= e <= t1 + 1.0) * 1e3
        # the gap around the freeze: the server's clock started with the RPC, within a millisecond of t0
        p = reply.phase_ms
        frozen = t0 + (p["pre_copy"] + p["last_round"] / 2) / 1e3
        at_freeze = (min(e for e in ends if e > frozen) - max(e for e in ends if e < frozen)) * 1e3
        # the application's timeline around the freeze, in ms after it: where the gap went
        last = max(e for e in ends if e < frozen)
        after = [e for e in ends if e > frozen][:2]
        timeline = {"t0_wall": t0_wall, "longest_gap_began": gap_at,
                    "gaps_over_5": [[round((marks[i] - t0) * 1e3, 1), round(g * 1e3, 1)] for i, g in enumerate(gaps) if g > 0.005], "frozen": (frozen - t0) * 1e3, "answered": (t1 - t0) * 1e3,
                    "last_sync_before": (last - frozen) * 1e3, "source_let_go": reply.downtime_ms,
                    "reattach": [[(a - frozen) * 1e3, (b - frozen) * 1e3, said] for a, b, said in reattaches],
                    "syncs_after": [(e - frozen) * 1e3 for e in after]}
        # where the rounds did not halve, the source held the application part of the time until
        # the freeze (Handoff.throttle): its rate then, against the second before the call
        held_s = p.get("throttled", 0.0) / 1e3
        rate_held = (sum(frozen - held_s <= e < frozen for e in ends) / held_s) / (sum(t0 - 1.0 <= e < t0 for e in ends) / 1.0) \
            if held_s else None
        # the loop ran a second alone before the call and after its answer: the rate on both sides
        rate = rate_timeline(ends, t0, t0 - 0.9, t1 + 1.0, marks={"frozen": frozen, "answered": t1})
        return {"handoff_s": reply.seconds, "server_hold_ms": reply.downtime_ms, "downtime_ms": gap, "freeze_gap_ms": at_freeze,
                "held_s": held_s, "held_pct": p.get("throttled_hold_pct", 0.0), "rate_held": rate_held,
                "baseline_gap_ms": baseline, "longest_step_ms": step, "baseline_step_ms": baseline_step, "round_bytes": list(reply.round_bytes),
                "phase_ms": {k: round(v, 2) for k, v in reply.phase_ms.items()}, "round_ms": [round(v, 1) for v in reply.round_ms],
                "timeline_ms": timeline, "rate_timeline": rate}
    finally:
        for srv in (one, two):        # the workers' attach lines and the rounds' (PHOS_LOG=INFO), beside the stub's;
            # everything they said where the application failed
            print("".join(line for line in srv.output().splitlines(True) if failed
                          or any(w in line for w in ("attached", "freed", "round", "held", "control call", "retir"))), end="")
        cu._reset_for_tests()
        one.stop()
        two.stop()


def main():
    import logging
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("PHOS_LOG", "INFO")          # the servers' workers log their attaches
    logging.getLogger("phos.client").setLevel(logging.INFO)      # the stub's re-attach, timed
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cuda", choices=["cuda", "emu"])
    ap.add_argument("--sizes", default="1,8")
    ap.add_argument("--unit", default="GiB", choices=["GiB", "MiB"])
    ap.add_argument("--chunk-kib", type=int, default=0,
                    help="chunk size (default: the server's, 2 MiB); small chunks on emu give a large context's chunk count")
    ap.add_argument("--target-recovery-dir", default="",
                    help="the target takes recovery images there (the rounds go there instead of /dev/shm)")
    ap.add_argument("--via", default="host store", choices=["host store", "shm", "tcp"],
                    help="where the rounds go: a HostStore both servers pin (twice the context's size, on /dev/shm), "
                    "chunk files in /dev/shm, or over TCP between two servers that share nothing (see above)")
    ap.add_argument("--source-host-store", action=argparse.BooleanOptionalAction, default=True,
                    help="--via tcp: the source server has a host store of its own (twice the context's size), "
                    "where the rounds go; --no-source-host-store: chunk files in its /dev/shm")
    ap.add_argument("--step-ms", type=float, default=1.0, help="the application's pace: a write and a sync this often")
    ap.add_argument("--repeat", type=int, default=REPEAT,
                    help="runs of each size (a fresh pair of servers each): the device's figures vary from run to run")
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ["PHOS_BENCH_BACKEND"] = args.backend
    import shutil
    import tempfile
    from phos.snapshot import HostStore
    rows = []
    for size in [int(s) for s in args.sizes.split(",") for _ in range(max(1, args.repeat))]:
        nbytes = size * (GiB if args.unit == "GiB" else MiB)
        host = ""
        if args.via == "host store":
            host = tempfile.mkdtemp(prefix="phos-bench-host-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            HostStore.create(host, 2 * nbytes + 512 * MiB, capacity=max(args.chunk_kib << 10, 2 * MiB))
        try:
            row = {"size": f"{size} {args.unit}", "via": args.via,
                   **measure(args.backend, nbytes, tempfile.mkdtemp(prefix="phos-handoff-bench-"),
                             args.chunk_kib << 10, args.target_recovery_dir, host, args.step_ms / 1e3,
                             tcp=args.via == "tcp", host_memory=(2 * nbytes + 512 * MiB) * args.source_host_store)}
        finally:
            if host:
                shutil.rmtree(host, ignore_errors=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| size | handoff total (s) | application downtime (ms) | gap without handoff (ms) | longest step (ms) "
          "| without handoff (ms) | calls held by the source (ms) | bytes per round | throttled: for, at most, its rate |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rounds = ", ".join(f"{b / MiB:.0f} MiB" for b in r["round_bytes"])
        held = f"{r['held_s']:.2f} s, {r['held_pct']:.0f}% held, {100 * r['rate_held']:.0f}% of its rate" if r["held_s"] else "no"
        print(f"| {r['size']} | {r['handoff_s']:.3f} | {r['downtime_ms']:.1f} | {r['baseline_gap_ms']:.1f} | "
              f"{r['longest_step_ms']:.1f} | {r['baseline_step_ms']:.1f} | {r['server_hold_ms']:.1f} | {rounds} | {held} |")
    # where the downtime went: the source's frozen last round, the target adopting it, and
    # after the source let go (the stub re-attaching, replaying, the first calls loading)
    steps = ["last_round_describe", "last_round_fingerprint", "last_round_copy", "last_round_copy_device", "last_round_copy_store",
             "last_round_commit", "target_adopt", "target_manifest", "target_load", "retire"]
    print("\n| size | gap around the freeze (ms) | " + " | ".join(steps) + " |")
    print("|---|---|" + "---|" * len(steps))
    for r in rows:
        p = r["phase_ms"]
        print(f"| {r['size']} | {r['freeze_gap_ms']:.1f} | " + " | ".join(f"{p.get(k, float('nan')):.1f}" for k in steps) + " |")
    figures = {"handoff total (s)": "handoff_s", "application downtime (ms)": "downtime_ms",
               "gap around the freeze (ms)": "freeze_gap_ms", "calls held by the source (ms)": "server_hold_ms",
               "longest step (ms)": "longest_step_ms"}
    print("\n| size | runs | " + " | ".join(f"{k}: least / median / most" for k in figures) + " | downtime within 20 ms |")
    print("|---|---|" + "---|" * (len(figures) + 1))
    for size in dict.fromkeys(r["size"] for r in rows):
        runs = [r for r in rows if r["size"] == size]
        print(f"| {size} | {len(runs)} | " + " | ".join(spread_text(r[k] for r in runs) for k in figures.values()) +
              f" | {sum(r['downtime_ms'] <= 20 for r in runs)} of {len(runs)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
