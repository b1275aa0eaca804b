"""The pool on Ray (phos/pool): a Ray cluster of three nodes on one machine
(ray.cluster_utils.Cluster), each running an emu phos server on a TCP port of its own, and the
pool's controller and front end on the head node. The application is this test process,
through the Python client with PHOS_SERVER set to the pool's address, and nothing else.

PRIVATE_MOUNTS gives each server its own mount namespace with empty /dev/shm, /tmp and /run, as
a machine of its own would have: nothing of a handoff may then travel through them, and no
Unix socket of a server is reachable from outside its namespace. The servers, the pool and
the application hold the keys of one `phos keygen` directory: the controller reaches each
server's admin API over TCP, and a drain's handoffs stream over it. Only the recovery store
is shared (outside /tmp): the store every node reaches, from which a lost node's contexts
are restored.
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

import numpy as np
import pytest

from conftest import wait_until

ray = pytest.importorskip("ray")

from phos.gpu_server.client_keys import pid_alive  # noqa: E402
from phos.pool import EMU_RESOURCE, NAMESPACE  # noqa: E402
from phos.pool.controller import launch, server_options  # noqa: E402
from phos.pool.server_actor import free_port  # noqa: E402

# The switch: each node's server in a mount namespace of its own (needs root for unshare).
PRIVATE_MOUNTS = ("/dev/shm", "/tmp", "/run") if os.geteuid() == 0 and shutil.which("unshare") else ()
CONTEXTS = 16
WORDS = 1 << 16                  # each context's buffer: 256 KiB
NODE = dict(num_cpus=1, object_store_memory=80 << 20, resources={EMU_RESOURCE: 1})


class Pool:
    def __init__(self, cluster, ctrl, address, store):
        self.cluster, self.ctrl, self.address, self.store = cluster, ctrl, address, store

    def status(self):
        return ray.get(self.ctrl.status.remote())

    def server_of(self, node):
        return next(s for s in self.status()["servers"] if s["node_id"] == node.node_id)

    def spread(self):
        """{server address: its contexts} as the controller sees them now."""
        return {s["address"]: set(s["context_ids"]) for s in self.status()["servers"] if s["state"] != "lost"}

    def settled(self, contexts):
        """Wait until the controller's polls of its servers show every one of `contexts`."""
        assert wait_until(lambda: set(contexts) <= set().union(*self.spread().values()), 30), self.spread()


# Ray's waits for a starting node that a loaded two-core machine can miss: the head's GCS
# server (30 s by default, settable) and each raylet's registration (30 s, not settable).
RAY_STARTUP_TIMEOUTS = ("Timed out waiting for file", "timed out during startup")


def start_cluster(tries=3):
    """Ray's head and two more nodes, started again where Ray gave up waiting for one."""
    from ray.cluster_utils import Cluster
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")
    for attempt in range(tries):
        cluster = None
        try:
            cluster = Cluster(initialize_head=True, head_node_args=dict(NODE, include_dashboard=False))
            return cluster, [cluster.add_node(**NODE) for _ in range(2)]
        except Exception as e:
            if not any(t in str(e) for t in RAY_STARTUP_TIMEOUTS) or attempt == tries - 1:
                raise
            if cluster is not None:
                cluster.shutdown()
            kill_ray_children()


def kill_ray_children():
    """A head that failed to start leaves its GCS server running, and no Cluster to stop it."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                ray_process = b"ray" in f.read()
        except (ValueError, IndexError, OSError):
            continue
        if ppid == os.getpid() and ray_process:
            os.kill(int(entry), signal.SIGKILL)


@pytest.fixture(scope="module")
def pool():
    # the store every node reaches; outside /tmp, which private mounts hide
    store = tempfile.mkdtemp(prefix="phos-pool-test-", dir="/var/tmp" if PRIVATE_MOUNTS else None)
    cluster, nodes = start_cluster()
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    address = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    keys = os.path.join(store, "keys")
    subprocess.run([sys.executable, "-m", "phos.cli", "keygen", keys], check=True, capture_output=True)
    server = dict(server_options(os.path.join(store, "work"), os.path.join(store, "recovery"), checkpoint_every=0.3,
                                 log_level="INFO", auth_dir=keys), private_mounts=PRIVATE_MOUNTS)
    ctrl = launch({"listen": address, "policy": "most-free", "server": server})
    p = Pool(cluster, ctrl, address, store)
    p.nodes, p.keys = nodes, keys
    pids = []
    try:
        status = ray.get(ctrl.wait_ready.remote(3, 120))
        assert [s["state"] for s in status["servers"]] == ["up"] * 3, status
        pids = [ray.get(ctrl.server_pid.remote(s["address"])) for s in status["servers"]]
        if PRIVATE_MOUNTS:       # each in a mount namespace of its own: not ours, nor each other's
            spaces = {os.readlink(f"/proc/{pid}/ns/mnt") for pid in pids}
            assert len(spaces) == 3 and os.readlink("/proc/self/ns/mnt") not in spaces
        yield p
    finally:
        ports = [urllib.parse.urlparse(s["address"]).port for s in p.status()["servers"]] if ray.is_initialized() else []
        try:
            ray.get(ctrl.stop.remote(), timeout=90)
            ray.kill(ctrl)
        finally:
            ray.shutdown()
            cluster.shutdown()
            left = [pid for pid in pids if pid_alive(pid)]
            left += [int(p) for port in ports for p in subprocess.run(
                ["pgrep", "-f", f"emu-memory-{port}"], capture_output=True, text=True).stdout.split()]
            for pid in left:              # so that they take nothing from the tests after these
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            shutil.rmtree(store, ignore_errors=True)
            assert not left, f"processes left running after the pool stopped: {left}"
            for port in ports:
                assert refused(port), f"something still listens on {port}"


def refused(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except ConnectionRefusedError:
        return True


class Tenant:
    """One context of the application and the bytes it keeps on its device."""

    def __init__(self, cu, i):
        self.cu, self.i = cu, i
        err, self.ctx = cu.cuCtxCreate(None, 0, 0)
        assert err == 0, cu.last_error
        err, self.ptr = cu.cuMemAlloc(WORDS * 4)
        assert err == 0, cu.last_error
        self.step = 0
        self.write()

    def pattern(self):
        return (np.arange(WORDS, dtype=np.uint32) * 7 + self.i * 1000003 + self.step * 31).astype(np.uint32)

    def write(self):
        self.expected = self.pattern()
        (err,) = self.cu.cuMemcpyHtoD(self.ptr, self.expected, self.expected.nbytes)
        assert err == 0, self.cu.last_error

    def check(self):
        out = np.zeros(WORDS, np.uint32)
        (err,) = self.cu.cuMemcpyDtoH(out, self.ptr, out.nbytes)
        assert err == 0, self.cu.last_error
        assert np.array_equal(out, self.expected), f"context {int(self.ctx)}: its data changed"

    def turn(self):
        """One step of load: read back and check, then write the next pattern."""
        (err,) = self.cu.cuCtxSetCurrent(self.ctx)
        assert err == 0, self.cu.last_error
        self.check()
        self.step += 1
        self.write()


@pytest.fixture(scope="module")
def tenants(pool):
    from phos.client_stub import driver as cu
    keys = {"PHOS_SERVER_KEY": os.path.join(pool.keys, "server.key"),
            "PHOS_CLIENT_KEY": os.path.join(pool.keys, "client.key_secret")}
    old = {name: os.environ.get(name) for name in ("PHOS_SERVER", *keys)}
    os.environ.update(PHOS_SERVER=pool.address, **keys)
    cu._reset_for_tests()
    try:
        assert cu.cuInit(0) == (cu.CUresult.CUDA_SUCCESS,), cu.last_error
        yield [Tenant(cu, i) for i in range(CONTEXTS)]
    finally:
        cu._reset_for_tests()
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class Load:
    """The application running: every tenant takes turns on a thread of its own, until stopped;
    every failed call or changed byte is kept."""

    def __init__(self, tenants):
        self.tenants, self.failures, self.turns = tenants, [], 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stopping.is_set():
            for t in self.tenants:
                try:
                    t.turn()
                except AssertionError as e:
                    self.failures.append(str(e))
                    return
            self.turns += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.thread.join(120)
        assert not self.thread.is_alive(), "the application hung"

    def wait_turns(self, n, timeout):
        start = self.turns
        assert wait_until(lambda: self.turns >= start + n or self.failures or not self.thread.is_alive(), timeout), \
            f"the application made {self.turns - start} rounds in {timeout} s"
        assert not self.failures, self.failures


def test_sixteen_contexts_are_placed_across_the_pool(pool, tenants):
    ids = {int(t.ctx) for t in tenants}
    assert wait_until(lambda: set().union(*pool.spread().values()) >= ids, 10), pool.spread()
    counts = sorted(len(c & ids) for c in pool.spread().values())
    assert len(counts) == 3 and counts[-1] - counts[0] <= 2, f"most-free spreads new contexts: {pool.spread()}"
    for t in tenants:
        t.cu.cuCtxSetCurrent(t.ctx)
        t.check()
    metrics = urllib.request.urlopen(pool.status()["metrics"], timeout=10).read().decode()
    assert "phos_pool_placement_seconds_count 16.0" in metrics
    server = pool.status()["servers"][0]
    text = urllib.request.urlopen(server["metrics"], timeout=10).read().decode()
    assert f'phos_server_contexts{{node="{server["node_id"]}",server="{server["address"]}"}}' in text
    assert f'phos_server_checkpoint_seconds_total{{node="{server["node_id"]}",server="{server["address"]}"}}' in text


def test_phos_pool_status_and_a_bad_drain_on_the_command_line(pool, tenants):
    import json
    import sys
    run = subprocess.run([sys.executable, "-m", "phos.cli", "pool", "status", "--json", "--ray-address",
                          pool.cluster.address], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    status = json.loads(run.stdout)
    assert status["address"] == pool.address and len(status["servers"]) == 3
    assert sum(len(s["context_ids"]) for s in status["servers"]) >= CONTEXTS
    run = subprocess.run([sys.executable, "-m", "phos.cli", "pool", "drain", "no-such-node", "--ray-address",
                          pool.cluster.address], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "no server of the pool is on node 'no-such-node'" in run.stderr, run.stderr


def test_a_node_drained_under_load_loses_no_call_and_no_byte(pool, tenants):
    pool.settled(int(t.ctx) for t in tenants)
    node = pool.nodes[0]
    source = pool.server_of(node)
    on_it = set(source["context_ids"])
    assert on_it
    with Load(tenants) as load:
        load.wait_turns(2, 60)
        out = ray.get(pool.ctrl.drain.remote(node.node_id[:12]))
        load.wait_turns(3, 120)
    assert not load.failures, load.failures
    moved = {m["ctx"] for m in out["moved"]}
    assert out["failed"] == [] and moved == on_it, (moved - on_it, on_it - moved, out)
    assert all(m["to"] != source["address"] for m in out["moved"])
    assert wait_until(lambda: pool.server_of(node)["context_ids"] == [], 10)
    assert pool.server_of(node)["state"] == "drained"
    for t in tenants:
        t.cu.cuCtxSetCurrent(t.ctx)
        t.check()
    # a drained node takes no new context
    err, extra = tenants[0].cu.cuCtxCreate(None, 0, 0)
    assert err == 0, tenants[0].cu.last_error
    assert wait_until(lambda: int(extra) in set().union(*pool.spread().values()), 10)
    assert int(extra) not in pool.server_of(node)["context_ids"]
    tenants[0].cu.cuCtxDestroy(extra)
    # resumed, it takes new contexts again: the most free of memory, it gets the next one
    resume = [sys.executable, "-m", "phos.cli", "pool", "resume", node.node_id[:12], "--ray-address", pool.cluster.address]
    run = subprocess.run(resume, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and source["address"] in run.stdout, run.stderr
    assert pool.server_of(node)["state"] == "up"
    err, back = tenants[0].cu.cuCtxCreate(None, 0, 0)
    assert err == 0, tenants[0].cu.last_error
    assert wait_until(lambda: int(back) in pool.server_of(node)["context_ids"], 10), pool.spread()
    tenants[0].cu.cuCtxDestroy(back)
    run = subprocess.run(resume, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "is not drained: its servers are up" in run.stderr, run.stderr


def test_a_killed_nodes_contexts_are_recovered_on_others(pool, tenants):
    pool.settled(int(t.ctx) for t in tenants)
    node = pool.nodes[1]
    lost = pool.server_of(node)
    # the tenants' contexts there: a listing may still show one destroyed a moment ago
    on_it = set(lost["context_ids"]) & {int(t.ctx) for t in tenants}
    assert on_it, pool.spread()
    port = urllib.parse.urlparse(lost["address"]).port
    with Load(tenants) as load:
        load.wait_turns(2, 60)
        time.sleep(1.0)                   # recovery images of the latest writes
        pool.cluster.remove_node(node, allow_graceful=False)
        assert wait_until(lambda: refused(port), 30), "the lost node's server still runs"
        load.wait_turns(3, 180)
    assert not load.failures, load.failures
    status = pool.status()
    assert next(s for s in status["servers"] if s["address"] == lost["address"])["state"] == "lost"
    assert wait_until(lambda: on_it <= set().union(*pool.spread().values()), 30), \
        (f"not shown on any server: {on_it - set().union(*pool.spread().values())}",
         [(s["address"], s["state"], s["error"], s["context_ids"]) for s in pool.status()["servers"]])
    for t in tenants:
        t.cu.cuCtxSetCurrent(t.ctx)
        t.check()
    metrics = urllib.request.urlopen(status["metrics"], timeout=10).read().decode()
    counted = [line for line in metrics.splitlines() if line.startswith("phos_pool_recovery_downtime_seconds_count")]
    assert counted == [f"phos_pool_recovery_downtime_seconds_count {float(len(on_it))}"], (counted, on_it)
