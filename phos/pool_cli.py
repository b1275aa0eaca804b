"""`phos pool up|status|drain|resume|down`: a pool of phos servers on a Ray cluster.

`up` starts a Ray cluster on this machine (or joins one with --ray-address) and the pool's
controller, a named detached actor that outlives the command; the others find it by name.
Where `up` started Ray itself, it notes so in the user's socket directory, and `down` stops
that Ray again.
"""
import json
import os
import subprocess
import sys

from phos.base import settings

STATE_FILE = "pool.json"          # in the user's socket directory: the Ray cluster `up` used


def state_path():
    return os.path.join(settings.socket_directory(), STATE_FILE)


def read_state():
    try:
        with open(state_path()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def write_state(state):
    from phos.schema.control import private_directory
    private_directory(settings.socket_directory(), create=True)
    with open(state_path(), "w") as f:
        json.dump(state, f)


def has_gpus():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def ray_command(*args):
    # the pool's actors answer applications: not at the nice level Ray gives its workers
    return subprocess.run([sys.executable, "-m", "ray.scripts.scripts", *args], capture_output=True, text=True,
                          env=dict(os.environ, RAY_worker_niceness="0"))


def start_ray(opts):
    """A Ray head on this machine; on a machine without GPUs it offers --emu-servers units of
    the emu resource. Returns its address."""
    from phos.pool import EMU_RESOURCE
    emu = opts.emu_servers if opts.emu_servers is not None else (0 if has_gpus() else 1)
    run = ray_command("start", "--head", f"--num-cpus={opts.num_cpus}", "--include-dashboard=false",
                      "--disable-usage-stats", f"--object-store-memory={opts.object_store_mb << 20}",
                      f"--resources={json.dumps({EMU_RESOURCE: emu} if emu else {})}")
    if run.returncode != 0:
        raise SystemExit(f"phos pool up: `ray start --head` failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    return "auto"


def connect(address):
    import logging
    import ray
    from phos.pool import NAMESPACE
    if not ray.is_initialized():
        try:
            ray.init(address=address or read_state().get("ray_address") or "auto", namespace=NAMESPACE,
                     logging_level=logging.WARNING, log_to_driver=False)
        except ConnectionError as e:
            raise SystemExit(f"phos pool: no Ray cluster to join ({e}); start one with `phos pool up`")
    return ray


def controller(address):
    ray = connect(address)
    from phos.pool import CONTROLLER_NAME, NAMESPACE
    try:
        return ray, ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except ValueError:
        raise SystemExit("phos pool: no pool runs on this Ray cluster; start one with `phos pool up`") from None


def cmd_up(opts):
    from phos.pool.placement import POLICIES
    if opts.policy not in POLICIES:
        raise SystemExit(f"phos pool up: --policy must be one of {', '.join(POLICIES)}")
    started = False
    if not opts.ray_address:
        probe = ray_command("status")
        if probe.returncode != 0:            # no cluster runs here yet
            start_ray(opts)
            started = True
    ray = connect(opts.ray_address)
    from phos.pool import CONTROLLER_NAME, EMU_RESOURCE, NAMESPACE
    from phos.pool.controller import SERVER_RESOURCES, launch, server_options
    write_state({"ray_address": opts.ray_address or "auto", "started_ray": started or read_state().get("started_ray", False)})
    try:
        ctrl = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
        print("phos pool: a pool runs on this cluster already", file=sys.stderr)
    except ValueError:
        work = os.path.join(settings.socket_directory(), "pool")
        server = server_options(work, opts.store or os.path.join(work, "recovery"), opts.checkpoint_every,
                                opts.server_pool, opts.host, opts.auth_dir, opts.image_key, opts.log_level)
        ctrl = launch({"listen": opts.listen or f"tcp://{opts.host}:{opts.port}", "policy": opts.policy,
                       "server": server, "max_contexts": opts.max_contexts, "metrics_host": opts.host,
                       "metrics_port": opts.metrics_port})
    total = ray.cluster_resources()
    want = sum(int(total.get(resource, 0)) for _, resource, _ in SERVER_RESOURCES)
    if not want:
        print(f"phos pool: the cluster offers no GPU and no {EMU_RESOURCE} resource: no server starts until a node "
              f"with one joins (`ray start --address ... --resources '{{\"{EMU_RESOURCE}\": 1}}'`)", file=sys.stderr)
    status = ray.get(ctrl.wait_ready.remote(want, opts.wait))
    show_status(status, opts.json)
    if not opts.json:
        print(f"\napplications: PHOS_SERVER={status['address']}")
    return 0


def show_status(status, as_json):
    if as_json:
        print(json.dumps(status))
        return
    from phos.admin_cli import human
    print(f"pool {status['address']}  policy {status['policy']}  metrics {status['metrics']}"
          + (f"  ({status['starting']} server(s) starting)" if status["starting"] else ""))
    print(f"{'NODE':<14} {'SERVER':<24} {'KIND':<5} {'STATE':<9} {'CTXS':>4} {'USED':>11} {'FREE':>11} {'CALLS/S':>9}")
    for s in status["servers"]:
        print(f"{s['node_id'][:12]:<14} {s['address']:<24} {s['kind']:<5} {s['state']:<9} {s['contexts']:>4} "
              f"{human(s['bytes']):>11} {human(s['free']):>11} {s['calls_per_s']:>9.0f}")


def cmd_status(opts):
    ray, ctrl = controller(opts.ray_address)
    show_status(ray.get(ctrl.status.remote()), opts.json)
    return 0


def node_call(ray, ref, command):
    """The answer of a controller call about a NODE; its ValueError (a node not in the pool, or
    not drained) ends the command with that message."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(getattr(e, "cause", None), ValueError) else None
        raise SystemExit(f"phos pool {command}: {cause or e}")


def cmd_drain(opts):
    ray, ctrl = controller(opts.ray_address)
    out = node_call(ray, ctrl.drain.remote(opts.node, opts.rounds), "drain")
    if opts.json:
        print(json.dumps(out))
    else:
        for m in out["moved"]:
            print(f"context {m['ctx']} moved {m['from']} -> {m['to']} in {m['seconds'] * 1e3:.1f} ms "
                  f"(calls held {m['downtime_ms']:.1f} ms)")
        for f in out["failed"]:
            print(f"NOT moved: {f}")
        print(f"node {out['node']} drained in {out['seconds']:.2f} s: {len(out['moved'])} moved, {len(out['failed'])} failed")
    return 1 if out["failed"] else 0


def cmd_resume(opts):
    ray, ctrl = controller(opts.ray_address)
    resumed = node_call(ray, ctrl.resume.remote(opts.node), "resume")
    print(json.dumps(resumed) if opts.json else f"resumed: {', '.join(resumed)} take new contexts again")
    return 0


def cmd_down(opts):
    ray, ctrl = controller(opts.ray_address)
    ray.get(ctrl.stop.remote())
    ray.kill(ctrl)
    state = read_state()
    ray.shutdown()
    if state.get("started_ray") and not opts.keep_ray and not opts.ray_address:
        ray_command("stop")
    try:
        os.unlink(state_path())
    except OSError:
        pass
    print("phos pool: stopped")
    return 0


def add_commands(sub):
    p = sub.add_parser("pool", help="a pool of phos servers on a Ray cluster")
    pool_sub = p.add_subparsers(dest="pool_command", required=True)

    def common(p):
        p.add_argument("--ray-address", help="the Ray cluster (default: the one `phos pool up` used, else `auto`)")
        p.add_argument("--json", action="store_true", help="machine-readable output")

    p = pool_sub.add_parser("up", help="start (or join) a Ray cluster and run the pool on it")
    common(p)
    p.add_argument("--policy", default="most-free", help="placement: most-free (the server with the most free device "
                   "memory) or pack (the fullest server that has room)")
    p.add_argument("--host", default="127.0.0.1", help="the address the pool and its servers listen on (another than "
                   "loopback needs --auth-dir)")
    p.add_argument("--port", type=int, default=5550, help="the pool's port (applications' PHOS_SERVER)")
    p.add_argument("--listen", help="the pool's full address (instead of --host and --port)")
    p.add_argument("--store", help="recovery images of every context, in a directory every node reaches "
                   "(default: the user's socket directory, which only this machine reaches)")
    p.add_argument("--checkpoint-every", type=float, default=2.0, help="seconds between a context's recovery images")
    p.add_argument("--server-pool", type=int, default=settings.pool(), help="workers each server keeps started")
    p.add_argument("--max-contexts", type=int, default=settings.max_contexts(), help="contexts placed on one server at most")
    p.add_argument("--auth-dir", help="CURVE keys (`phos keygen`) for the pool and its servers")
    p.add_argument("--image-key", help="the image key file every server shares (on a store every node reaches)")
    p.add_argument("--metrics-port", type=int, default=0, help="the controller's Prometheus port (default: any free one)")
    p.add_argument("--emu-servers", type=int, help="emu servers on this machine when it starts Ray (default: 1 "
                   "without GPUs, else 0)")
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs this machine's Ray node offers when it starts Ray")
    p.add_argument("--object-store-mb", type=int, default=128, help="its object store, when it starts Ray")
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the servers to start")
    p.add_argument("--log-level", default=settings.log_level(), help="the servers' log level")
    p.set_defaults(func=cmd_up)

    p = pool_sub.add_parser("status", help="the pool's servers, their contexts and memory")
    common(p)
    p.set_defaults(func=cmd_status)

    p = pool_sub.add_parser("drain", help="hand off every context of a node to other nodes, live")
    p.add_argument("node", help="a Ray node id (or its prefix, as `phos pool status` shows it) or a server's address")
    p.add_argument("--rounds", type=int, default=0, help="pre-copy rounds of each handoff at most (default 12)")
    common(p)
    p.set_defaults(func=cmd_drain)

    p = pool_sub.add_parser("resume", help="a drained node takes new contexts again")
    p.add_argument("node", help="a Ray node id (or its prefix) or a server's address, as for drain")
    common(p)
    p.set_defaults(func=cmd_resume)

    p = pool_sub.add_parser("down", help="stop the pool's servers and controller (and the Ray that `up` started)")
    common(p)
    p.add_argument("--keep-ray", action="store_true", help="leave the Ray cluster running")
    p.set_defaults(func=cmd_down)
