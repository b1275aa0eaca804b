"""The pool on Ray (phos/pool): placement latency, a node's drain, and a handoff between two servers.

    python perf/bench_pool.py                                   # emu: a Ray cluster of 3 nodes on this machine
    python perf/bench_pool.py --backend cuda --nodes 2 --sizes 1,8 --unit GiB    # the H200: two servers, one GPU
    python perf/bench_pool.py --ray-address auto                # a running pool (`phos pool up`)
    python perf/bench_pool.py --source tcp://A:P --target tcp://B:Q --sizes 1 --unit GiB   # any two servers

- placement: --contexts contexts created one after another through the pool's address
  (cuCtxCreate, asked to answered, in the application), p50 and p99; and a forwarded device
  query through the pool against the same query sent to a server directly (the pool's own cost).
- drain: --drain contexts on one node's server, each holding --drain-mib MiB and
  written by the application throughout; `drain` of that node, whole, and each handoff.
- handoff: a context of each of --sizes on --source (default: one pool server), the
  application writing ~10% of it a second (perf/bench_handoff.py's writer), handed off to
  --target (default: another); the application's longest gap and the source's hold.

With --private-mounts (root) each local node's server has its own /dev/shm and /tmp.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GiB, MiB = 1 << 30, 1 << 20


def pct(values, q):
    return float(np.percentile(np.array(values) * 1e3, q))


def local_pool(args, work):
    """A Ray cluster of args.nodes nodes on this machine, and the pool on it; returns (cluster, ctrl, address)."""
    import ray
    from ray.cluster_utils import Cluster
    from phos.pool import CUDA_SHARED_RESOURCE, EMU_RESOURCE, NAMESPACE
    from phos.pool.controller import launch, server_options
    from phos.pool.server_actor import free_port
    resource = EMU_RESOURCE if args.backend == "emu" else CUDA_SHARED_RESOURCE
    node = dict(num_cpus=1, object_store_memory=80 << 20, resources={resource: 1})
    cluster = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False))
    for _ in range(args.nodes - 1):
        cluster.add_node(**node)
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    address = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    server = server_options(os.path.join(work, "work"), os.path.join(work, "recovery"), args.checkpoint_every,
                            pool=args.server_pool)
    if args.private_mounts:
        server["private_mounts"] = ["/dev/shm", "/tmp"]
    ctrl = launch({"listen": address, "policy": "most-free", "server": server})
    ray.get(ctrl.wait_ready.remote(args.nodes, 300))
    return cluster, ctrl, address


def pools_full(ray, ctrl, want, timeout=300):
    """Until every server of the pool holds `want` pre-started workers: a placement then times the
    pool, not a worker's cold start (seconds on the H200, when 40 a server are still starting)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = [s["standby_workers"] for s in ray.get(ctrl.status.remote())["servers"] if s["state"] == "up"]
        if counts and min(counts) >= want:
            return
        time.sleep(0.5)
    print(f"bench_pool: the servers' pools did not fill within {timeout} s ({counts}): placement may time cold starts",
          flush=True)


def connect(cu, server):
    os.environ["PHOS_SERVER"] = server
    cu._reset_for_tests()
    assert cu.cuInit(0)[0] == 0, cu.last_error


def placement(cu, address, servers, n):
    connect(cu, address)
    created, times = [], []
    for _ in range(n):
        t = time.perf_counter()
        err, ctx = cu.cuCtxCreate(None, 0, 0)
        times.append(time.perf_counter() - t)
        assert err == 0, cu.last_error
        created.append(ctx)
    for ctx in created:
        cu.cuCtxDestroy(ctx)
    query = {}
    for name, where in (("through the pool", address), ("to a server", servers[0])):
        connect(cu, where)
        qs = []
        for _ in range(200):
            t = time.perf_counter()
            cu.cuDeviceGetCount()
            qs.append(time.perf_counter() - t)
        query[name] = pct(qs, 50)
    return {"contexts": n, "create_p50_ms": pct(times, 50), "create_p99_ms": pct(times, 99),
            "create_max_ms": max(times) * 1e3, "query_p50_ms": query}


def drain(cu, ray, ctrl, source, n, mib):
    connect(cu, source)          # all on one server (the drain does not care how they got there)
    words = mib * MiB // 4
    apps = []
    for i in range(n):
        err, ctx = cu.cuCtxCreate(None, 0, 0)
        assert err == 0, cu.last_error
        err, p = cu.cuMemAlloc(words * 4)
        assert err == 0, cu.last_error
        data = np.full(words, i, np.uint32)
        assert cu.cuMemcpyHtoD(p, data, data.nbytes)[0] == 0
        apps.append([ctx, p, data])
    stop, failures = threading.Event(), []

    def write():                 # the application keeps writing each context's first KiB, and syncs
        step = 0
        while not stop.is_set():
            for a in apps:
                step += 1
                a[2][:256] = step
                if cu.cuCtxSetCurrent(a[0])[0] or cu.cuMemcpyHtoD(a[1], a[2][:256], 1024)[0] \
                        or cu.cuCtxSynchronize()[0]:
                    failures.append(cu.last_error)
    t = threading.Thread(target=write, daemon=True)
    t.start()
    try:
        out = ray.get(ctrl.drain.remote(source))
    finally:
        stop.set()
        t.join()
    intact = 0
    for ctx, p, data in apps:
        back = np.zeros_like(data)
        cu.cuCtxSetCurrent(ctx)
        intact += cu.cuMemcpyDtoH(back, p, back.nbytes)[0] == 0 and np.array_equal(back, data)
        cu.cuCtxDestroy(ctx)
    return {"contexts": n, "mib_each": mib, "drain_s": out["seconds"], "moved": len(out["moved"]),
            "failed": len(out["failed"]), "failed_calls": len(failures), "intact": intact,
            "handoff_ms_p50": pct([m["seconds"] for m in out["moved"]], 50) if out["moved"] else None,
            "held_ms_max": max((m["downtime_ms"] for m in out["moved"]), default=None)}


def handoff(cu, source, target, nbytes, backend):
    from bench_handoff import writer
    from bench_snapshot import App
    from phos.pool.admin_client import admin
    os.environ["PHOS_BENCH_BACKEND"] = backend
    connect(cu, source)
    app = App(cu, nbytes)
    stop, ends, starts = threading.Event(), [], []
    loop = threading.Thread(target=writer, args=(app, stop, ends, starts, 0.001))
    loop.start()
    time.sleep(1.0)
    t0 = time.perf_counter()
    try:
        with admin(source) as a:
            r = a.handoff(int(app.ctx), target)
    finally:
        t1 = time.perf_counter()
        time.sleep(1.0)
        stop.set()
        loop.join()
    marks = [max(e for e in ends if e < t0)] + [e for e in ends if t0 <= e <= t1 + 1.0]
    cu.cuCtxDestroy(app.ctx)
    return {"bytes": nbytes, "to": target, "handoff_s": r["seconds"], "held_ms": r["downtime_ms"],
            "app_longest_gap_ms": float(np.diff(marks).max()) * 1e3, "rounds": len(r["round_bytes"])}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="emu", choices=["emu", "cuda"])
    ap.add_argument("--nodes", type=int, default=3, help="local Ray nodes, one server each")
    ap.add_argument("--ray-address", help="use the pool running on this Ray cluster instead")
    ap.add_argument("--contexts", type=int, default=64)
    ap.add_argument("--drain", type=int, default=8)
    ap.add_argument("--drain-mib", type=int, default=16)
    ap.add_argument("--sizes", default="64", help="handoff sizes, comma-separated")
    ap.add_argument("--unit", default="MiB", choices=["MiB", "GiB"])
    ap.add_argument("--source", help="the handoff's source server (default: a server of the pool)")
    ap.add_argument("--target", help="the handoff's target server, e.g. tcp://B:PORT (default: another)")
    ap.add_argument("--server-pool", type=int, default=4, help="workers each local server keeps started")
    ap.add_argument("--checkpoint-every", type=float, default=2.0)
    ap.add_argument("--private-mounts", action="store_true", help="each local server with its own /dev/shm and /tmp")
    ap.add_argument("--skip", default="", help="parts to skip: placement,drain,handoff")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR1, all_threads=True)      # where a stuck run is: kill -USR1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))       # stop the local cluster on the way out
    import ray
    from phos.client_stub import driver as cu
    work = tempfile.mkdtemp(prefix="phos-bench-pool-", dir="/var/tmp" if args.private_mounts else None)
    cluster = None
    try:
        if args.ray_address:
            from phos.pool.controller import get_controller
            ctrl = get_controller(args.ray_address)
            address = ray.get(ctrl.status.remote())["address"]
        else:
            cluster, ctrl, address = local_pool(args, work)
        servers = [s["address"] for s in ray.get(ctrl.status.remote())["servers"] if s["state"] == "up"]
        if not args.ray_address:
            pools_full(ray, ctrl, args.server_pool)
        results = {"backend": args.backend, "servers": len(servers)}
        skip = set(args.skip.split(","))
        if "placement" not in skip:
            results["placement"] = placement(cu, address, servers, args.contexts)
            print(json.dumps({"placement": results["placement"]}), flush=True)
        if "drain" not in skip:
            results["drain"] = drain(cu, ray, ctrl, servers[0], args.drain, args.drain_mib)
            print(json.dumps({"drain": results["drain"]}), flush=True)
        if "handoff" not in skip:
            time.sleep(2.0)
            servers = [s["address"] for s in ray.get(ctrl.status.remote())["servers"] if s["state"] == "up"]
            source, target = args.source or servers[0], args.target or next(s for s in servers if s != (args.source or servers[0]))
            unit = GiB if args.unit == "GiB" else MiB
            results["handoff"] = [handoff(cu, source, target, int(s) * unit, args.backend) for s in args.sizes.split(",")]
            print(json.dumps({"handoff": results["handoff"]}), flush=True)
        print_table(results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        cu._reset_for_tests()
        if cluster is not None:
            ray.get(ctrl.stop.remote(), timeout=120)
            ray.kill(ctrl)
            ray.shutdown()
            cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)


def print_table(r):
    print(f"\nphos pool ({r['backend']}, {r['servers']} servers)")
    if "placement" in r:
        p = r["placement"]
        print(f"| placement, {p['contexts']} contexts | p50 {p['create_p50_ms']:.1f} ms | p99 {p['create_p99_ms']:.1f} ms "
              f"| max {p['create_max_ms']:.1f} ms |")
        q = p["query_p50_ms"]
        print(f"| a device query, p50 | through the pool {q['through the pool']:.3f} ms | to a server {q['to a server']:.3f} ms |")
    if "drain" in r:
        d = r["drain"]
        print(f"| drain, {d['contexts']} x {d['mib_each']} MiB | {d['drain_s']:.2f} s | moved {d['moved']}, failed {d['failed']} "
              f"| failed calls {d['failed_calls']} | intact {d['intact']} | handoff p50 {d['handoff_ms_p50']:.0f} ms "
              f"| held at most {d['held_ms_max']:.1f} ms |")
    for h in r.get("handoff", []):
        print(f"| handoff {h['bytes'] / MiB:.0f} MiB -> {h['to']} | {h['handoff_s']:.2f} s | held {h['held_ms']:.1f} ms "
              f"| the application's longest gap {h['app_longest_gap_ms']:.1f} ms | {h['rounds']} rounds |")


if __name__ == "__main__":
    main()
