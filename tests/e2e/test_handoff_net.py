"""Live handoff between two servers that share nothing but the network (gpu_server/control/handoff_net.py).

Each server runs in a mount namespace of its own, with its own tmpfs on /dev/shm, /tmp and
/run, its own CURVE keys and its own image key: they talk only over tcp://127.0.0.1, with
keys. The rounds stream over the target's network admin API; the application's stub (the
native one and the Python client) learns the target's worker and key from Reply.moved and
carries on with the same results. A target killed mid-handoff, or the link to it cut in the
middle of a batch of chunks, leaves the context live on the source. Needs root's `unshare -m`
(skipped with the reason where it is not permitted).
"""
import logging
import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

from conftest import wait_until
from phos.schema import admin_pb2 as pb
from phos.schema.admin_net import admin_address, close_admin, open_admin, read_key_file
from share_nothing import PRIVATE, Relay, free_port_pair, key_pairs, start_isolated, unshare_permitted
from test_handoff import compute_while
from test_snapshot_engine import App
from test_stub_reattach import PAUSE, Program, iterate  # noqa: F401 (iterate: a fixture)

N, TOTAL = 1 << 15, 200
SCRATCH = 2 << 20              # words: 8 MiB, twice handoff.SMALL_ROUND

# A's own host store, in its private /dev/shm (pair's parameter: A's extra arguments)
HOST_STORE = ("--host-store", f"{PRIVATE}/host", "--host-memory", "64M")


@pytest.fixture
def pair(tmp_path, backend, request):
    """Two isolated servers, A and B, each with keys of its own; the test's client key (A's
    client pair) is admitted by both, and A's server key by B's admin API (A calls B).
    Parametrized (indirect): A's extra arguments."""
    why = unshare_permitted()
    if why:
        pytest.skip(f"mount namespaces are not permitted here (unshare -m: {why})")
    a_keys, b_keys = tmp_path / "a-keys", tmp_path / "b-keys"
    key_pairs(a_keys, b_keys)
    started = []

    def start(name, keys, extra=()):
        (tmp_path / name).mkdir()
        srv = start_isolated(backend, tmp_path / name, keys, extra=extra)
        started.append(srv)
        return srv
    a, b = start("a", a_keys, getattr(request, "param", ())), start("b", b_keys)
    env = {"PHOS_SERVER_KEY": str(a_keys / "server.key"), "PHOS_CLIENT_KEY": str(a_keys / "client.key_secret")}
    yield a, b, a_keys, b_keys, env
    for srv in started:
        srv.stop()
        print(f"--- server {srv.dir}, last lines:\n{srv.output()[-3000:]}")


def admin(server, keys, env):
    """The admin API of `server`, over TCP, with the test's client key and the server's key."""
    return open_admin(server.address, (read_key_file(str(keys / "server.key")),
                                       *read_key_file(env["PHOS_CLIENT_KEY"], secret=True)))


def contexts(server, keys, env):
    stub = admin(server, keys, env)
    try:
        return {c.id: c.state for c in stub.ListContexts(pb.ListContextsRequest(), timeout=20).contexts}
    finally:
        close_admin(stub)


def phos_handoff(ctx, a, b, b_keys, env, to=None):
    """`phos handoff CTX --to tcp://B --to-key B's key --server tcp://A`, as an operator runs it
    (to: another address for B)."""
    return subprocess.run(["phos", "handoff", str(ctx), "--to", to or b.address, "--to-key", str(b_keys / "server.key"),
                           "--server", a.address, "--json"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **env))


def reference_run(cu, rhs):
    app = App(cu)
    x, y, r = app.put(np.zeros(N, np.float32)), app.put(np.zeros(N, np.float32)), app.put(rhs)
    out = app.get(app.jacobi(x, y, r, N, TOTAL), N)
    cu.cuCtxDestroy(app.ctx)
    return out


@pytest.fixture
def keyed_client(monkeypatch):
    from phos.client_stub import connection, driver

    def connect(server, env):
        driver._reset_for_tests()
        monkeypatch.setattr(connection, "SERVER_KEYS", {})
        monkeypatch.setenv("PHOS_SERVER", server.address)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert driver.cuInit(0) == (driver.CUresult.CUDA_SUCCESS,), driver.last_error
        return driver
    yield connect
    driver._reset_for_tests()


def test_python_client_carries_on_across_a_share_nothing_handoff(pair, keyed_client, caplog):
    """The application computes (and synchronizes) while `phos handoff` moves its context from A to
    B over TCP; it re-attaches at B, authenticated by B's own key, on the connection it made
    there ahead of the move (Reply.movingTo), with results bit-exact."""
    caplog.set_level(logging.INFO, logger="phos.client")
    a, b, a_keys, b_keys, env = pair
    cu = keyed_client(a, env)
    rhs = np.sin(np.arange(N, dtype=np.float32))
    expected = reference_run(cu, rhs)
    app = App(cu)
    x, y, r = app.put(np.zeros(N, np.float32)), app.put(np.zeros(N, np.float32)), app.put(rhs)
    done = {}
    mover = threading.Thread(target=lambda: done.update(r=phos_handoff(app.id, a, b, b_keys, env)))
    x, _ = compute_while(app, x, y, r, mover, steps=TOTAL, wait=300)
    assert done["r"].returncode == 0, done["r"].stderr
    assert app.get(x, N).tobytes() == expected.tobytes()
    assert contexts(b, b_keys, env).get(app.id) == "running"
    assert app.id not in contexts(a, a_keys, env)
    from phos.client_stub import connection
    assert connection.SERVER_KEYS, "the client did not learn B's key from the move"
    said = [r.getMessage() for r in caplog.records if "re-attached" in r.getMessage()]
    assert len(said) == 1 and "connected ahead" in said[0], said


@pytest.mark.parametrize("pair", [HOST_STORE], indirect=True)
def test_a_source_with_a_host_store_sends_the_rounds_from_it(pair, keyed_client):
    """A source with a host store of its own takes a share-nothing handoff's rounds there (the
    device copies into its slots), sends them from there, and the client's data is intact."""
    a, b, a_keys, b_keys, env = pair
    cu = keyed_client(a, env)
    app = App(cu)
    data = np.random.default_rng(3).standard_normal(4 * N).astype(np.float32)
    ptr = app.put(data)
    r = phos_handoff(app.id, a, b, b_keys, env)
    assert r.returncode == 0, r.stderr
    assert app.get(ptr, 4 * N).tobytes() == data.tobytes()
    assert contexts(b, b_keys, env).get(app.id) == "running"
    assert f"the handoff's rounds go to {PRIVATE}/host" in a.output()


def test_a_client_that_missed_the_move_learns_b_key_from_a(pair, keyed_client):
    """A client that did not hear its retiring worker name B (it was reconnecting, say) asks A's
    front end, which answers with B's worker and, as Reply.moved, B's own key: without it the
    client could not authenticate B. The context then carries on there with its data intact."""
    a, b, a_keys, b_keys, env = pair
    cu = keyed_client(a, env)
    app = App(cu)
    data = np.arange(N, dtype=np.float32)
    p = app.put(data)
    app.sync()
    r = phos_handoff(app.id, a, b, b_keys, env)
    assert r.returncode == 0, r.stderr
    from phos.client_stub import connection, driver
    conn = driver._contexts[app.id]
    connection.SERVER_KEYS.clear()
    conn.moved_to = None
    endpoint, _ = conn.find_again(False)
    assert connection.SERVER_KEYS.get(endpoint) == read_key_file(str(b_keys / "server.key")), connection.SERVER_KEYS
    assert (app.get(p, N) == data).all()
    assert contexts(b, b_keys, env).get(app.id) == "running"


def test_native_program_carries_on_across_a_share_nothing_handoff(pair, iterate):
    """An unmodified CUDA program on the native stub, keyed (CURVE), is moved at its pause from A
    to B; it goes on at B and prints what an uninterrupted run prints."""
    a, b, a_keys, b_keys, env = pair
    ref = Program(iterate, a, PAUSE, **env)
    assert ref.until_ready() == f"READY {PAUSE}\n", ref.fail_text()
    ref.go_on()
    code, expected, err = ref.finish()
    assert code == 0 and expected.rstrip().endswith("PASS"), f"{expected}\n{err}"

    prog = Program(iterate, a, PAUSE, **env)
    assert prog.until_ready() == f"READY {PAUSE}\n", prog.fail_text()
    (ctx,) = contexts(a, a_keys, env)
    r = phos_handoff(ctx, a, b, b_keys, env)
    assert r.returncode == 0, r.stderr
    prog.go_on()
    code, out, err = prog.finish()
    assert code == 0 and out == expected, f"{out}\n{err}"
    assert "told by its old worker, connected ahead" in err, err
    assert not contexts(a, a_keys, env)


def test_target_killed_mid_handoff_leaves_the_context_live_on_the_source(pair, keyed_client):
    """B is stopped once its warm copy of the context exists (rounds landed, the handoff going
    on), then killed: the link drops, A's handoff fails saying the context stays, and the
    application, which kept computing, finishes on A with its results intact. The application
    also rewrites a scratch buffer of SCRATCH words each step, and goes on rewriting it after
    its TOTAL jacobi steps until the handoff has ended, so that every round copies more than a
    round that ends the pre-copy: the handoff is still going on when B stops, however fast the
    steps run."""
    a, b, a_keys, b_keys, env = pair
    cu = keyed_client(a, env)
    rhs = np.cos(np.arange(N, dtype=np.float32)) + 1
    expected = reference_run(cu, rhs)
    app = App(cu)
    x, y, r = app.put(np.zeros(N, np.float32)), app.put(np.zeros(N, np.float32)), app.put(rhs)
    scratch = app.ok(cu.cuMemAlloc(4 * SCRATCH))
    done = {}
    watcher = admin(b, b_keys, env)

    def kill_b_once_warm():
        try:
            wait_until(lambda: app.id in {c.id for c in watcher.ListContexts(pb.ListContextsRequest(), timeout=20).contexts},
                       60, step=0.01)
            os.kill(b.proc.pid, signal.SIGSTOP)
            done["warm"] = True
            time.sleep(0.5)
            os.kill(b.proc.pid, signal.SIGKILL)
        finally:
            close_admin(watcher)
    mover = threading.Thread(target=lambda: done.update(r=phos_handoff(app.id, a, b, b_keys, env)))
    killer = threading.Thread(target=kill_b_once_warm)
    i = 0
    while i < TOTAL or mover.is_alive():
        if i == 10:
            killer.start()
            mover.start()
        if i < TOTAL:          # the expected result is that of TOTAL steps
            app.jacobi(x, y, r, N, 1)
            x, y = y, x
        app.ok(cu.cuMemsetD32(scratch, i, SCRATCH))
        if i % 5 == 4:
            app.sync()
        i += 1
    mover.join(300)
    killer.join(60)
    assert done.get("warm"), "B never held a warm copy"
    assert done["r"].returncode != 0 and "stays live here" in done["r"].stderr, done["r"].stderr
    assert app.get(x, N).tobytes() == expected.tobytes()
    assert contexts(a, a_keys, env).get(app.id) == "running"


def test_a_link_cut_mid_batch_leaves_the_context_live_on_the_source(pair, keyed_client):
    """A reaches B's admin API through a relay that resets the first connection to carry 64 KiB
    (a batch of the first round's chunks, on one of the links they travel on) in the middle of
    it: the handoff fails saying the context stays, B keeps no copy of the context, and the
    application, which kept computing, finishes on A with its results intact."""
    a, b, a_keys, b_keys, env = pair
    cu = keyed_client(a, env)
    rhs = np.cos(np.arange(N, dtype=np.float32)) * 2
    expected = reference_run(cu, rhs)
    app = App(cu)
    x, y, r = app.put(np.zeros(N, np.float32)), app.put(np.zeros(N, np.float32)), app.put(rhs)
    port = free_port_pair()
    relay = Relay(port + 1, int(admin_address(b.address).rsplit(":", 1)[1]), cut_after=64 << 10)
    done = {}
    mover = threading.Thread(target=lambda: done.update(r=phos_handoff(app.id, a, b, b_keys, env,
                                                                         to=f"tcp://127.0.0.1:{port}")))
    try:
        x, _ = compute_while(app, x, y, r, mover, steps=TOTAL, wait=300)
    finally:
        relay.close()
    assert relay.was_cut.is_set()
    assert done["r"].returncode != 0 and "stays live here" in done["r"].stderr, done["r"].stderr
    assert "was lost during PutChunks" in done["r"].stderr, done["r"].stderr
    assert app.get(x, N).tobytes() == expected.tobytes()
    assert contexts(a, a_keys, env).get(app.id) == "running"
    assert app.id not in contexts(b, b_keys, env)

