"""Transparent recovery (gpu_server/worker/recovery.py): a Python client program carries on, with
bit-exact results, when its worker or its whole server is killed, under periodic images.

The program mixes what a replay must get right: launches, staged and framed copies both
ways, allocations, and reads whose results it already used before the kill.
"""
import os
import signal

import numpy as np
import pytest

from conftest import recovery_images, wait_until
from test_snapshot_engine import App

pytestmark = pytest.mark.gpu     # perf/device/run.sh runs this file with --backend cuda

N, TOTAL, KILL_AT = 1 << 16, 240, 90       # 256 KiB vectors: copies go through the staging area


def program(cu, kill=None):
    """The iterative program; kill() is called once, mid-run. Returns its outputs."""
    app = App(cu)
    rhs = np.sin(np.arange(N, dtype=np.float32))
    x, y, r = app.put(np.zeros(N, np.float32)), app.put(np.zeros(N, np.float32)), app.put(rhs)
    sums = []
    for i in range(TOTAL):
        app.jacobi(x, y, r, N, 1)               # reads x, writes y
        x, y = y, x
        if i % 10 == 9:
            sums.append(float(app.get(x, 64).astype(np.float64).sum()))      # a small read, framed
        if i == KILL_AT and kill:
            kill(app)
        if i == KILL_AT + 20:                   # after the kill: a new buffer and a staged upload
            r = app.put(np.cos(np.arange(N, dtype=np.float32)) + rhs)
    out = app.get(x, N)
    app.ok(cu.cuCtxDestroy(app.ctx))
    return sums, out.tobytes()


def recovering(servers, name="one", every="0.05", **kw):
    return servers(name, args=["--recovery-dir", str(kw.pop("directory")), "--checkpoint-every", every, *kw.pop("args", [])])


def images(directory):
    return sorted(os.listdir(directory))


def test_worker_killed_mid_run_recovers_bit_exact(servers, client, tmp_path):
    srv = recovering(servers, every="0.3", directory=tmp_path / "rec")
    cu = client(srv)
    expected = program(cu)
    assert wait_until(lambda: images(tmp_path / "rec") == [], 10), "a context destroyed cleanly leaves no recovery images"
    killed = []

    def kill(app):
        app.sync()
        assert wait_until(lambda: recovery_images(tmp_path / "rec", app.id), 10)
        before = set(srv.workers())
        pid = next(p for p in before if f"--ctx {app.id}" in open(f"/proc/{p}/cmdline").read().replace("\0", " "))
        app.get(app.put(np.ones(8, np.float32)), 8)     # answered, after the image's cut: replayed later
        conn = cu._contexts[app.id]
        os.kill(pid, signal.SIGKILL)
        killed.append((pid, conn, conn.acked))

    assert program(cu, kill) == expected
    pid, conn, acked = killed[0]
    assert pid not in srv.workers()
    assert conn.answered == acked, "the replay redid calls whose Results the program had used"
    assert "restoring it from recovery image" in srv.output()


def test_whole_server_killed_recovers_on_the_standby(servers, client, tmp_path):
    directory = tmp_path / "rec"
    two = recovering(servers, "two", directory=directory)
    one = recovering(servers, "one", directory=directory, args=["--standby", two.address])
    cu = client(one)
    expected = program(cu)

    def kill(app):
        app.sync()
        assert wait_until(lambda: recovery_images(directory, app.id), 10)
        os.kill(one.proc.pid, signal.SIGKILL)      # the front end; its workers die with it
        one.proc.wait()

    assert program(cu, kill) == expected
    assert "restoring it from recovery image" in two.output()


def test_a_full_log_asks_for_an_image(servers, client, tmp_path, monkeypatch):
    """No periodic images at all: the client's bounded log alone makes the worker take them."""
    from phos.client_stub import connection
    monkeypatch.setattr(connection, "LOG_BYTES", 1 << 20)
    srv = recovering(servers, every="0", directory=tmp_path / "rec")
    cu = client(srv)
    app = App(cu)
    ptr = app.put(np.zeros(N, np.float32))
    conn = cu._contexts[app.id]
    for k in range(12):                          # 12 x 256 KiB > 1 MiB of logged host bytes
        app.ok(cu.cuMemcpyHtoD(ptr, np.full(N, k, np.float32), N * 4))
    # the bound is checked before each call: the log holds at most the bound and the call just sent
    # (1 in ~15 runs found the last image not yet covering the calls before it: 1.25 MiB here)
    assert conn.recovery and conn.durable > 0 and conn.log_bytes <= connection.LOG_BYTES + N * 4
    assert (app.get(ptr, N) == 11).all()


def test_recovery_needs_the_session_token(servers, tmp_path):
    """Another tenant cannot get a context restored (or learn where it lives) by its id."""
    from phos.client_stub.connection import Connection
    srv = recovering(servers, directory=tmp_path / "rec")
    (tmp_path / "rec" / "ctx77" / "images").mkdir(parents=True)
    front = Connection(srv.address)
    try:
        res = front.call("reattach", {"ctx": 77, "token": b"x" * 16}, timeout=10)
    finally:
        front.close()
    assert res.status != 0 and "no recovery image here for that token" in res.message


def test_recovery_flags_need_a_directory(tmp_path):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "phos.cli", "server", "--listen", f"ipc://{tmp_path}/s.sock",
                        "--checkpoint-every", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "need --recovery-dir" in r.stderr


@pytest.fixture(autouse=True)
def _fast_reattach(monkeypatch):
    monkeypatch.setenv("PHOS_REATTACH_TIMEOUT", "60")


def test_where_module_globals_were_is_noted_for_a_replay_and_a_bad_note_is_ignored(tmp_path):
    """A module loaded after the latest image's cut is loaded again by the client's replay: its
    worker notes where its globals were, a restored worker keeps the note, and a damaged note
    costs only the aliases (a warning), not the restore."""
    from phos.gpu_server.worker.recovery import GLOBALS_FILE, Recovery, module_globals_noted
    first = Recovery(str(tmp_path), 7)
    first.note_globals(3, {"counter": 0x600400000100, "table": 0x600400000200})
    first.note_globals(9, {"weights": 0x600400200000})
    want = {3: {"counter": 0x600400000100, "table": 0x600400000200}, 9: {"weights": 0x600400200000}}
    assert module_globals_noted(first.path) == want
    assert Recovery(str(tmp_path), 7).globals == want       # the worker restored from this store
    assert module_globals_noted(str(tmp_path / "ctx8")) == {}
    with open(os.path.join(first.path, GLOBALS_FILE), "w") as f:
        f.write('{"3": {"counter": "not an address"}}')
    assert module_globals_noted(first.path) == {}
    with open(os.path.join(first.path, GLOBALS_FILE), "w") as f:
        f.write('{"3": {"counter"')                            # torn
    assert module_globals_noted(first.path) == {}


def test_a_recovery_image_is_paused_while_it_copies_little(tmp_path):
    """Concurrent images make every write of the application wait for its chunks to be saved
    (PyTorch's training on the H200: 100x slower while one ran): an image that should copy
    little (what the last one copied, else the whole context) is taken paused, unless a paused
    image here held the application past the budget."""
    from phos.gpu_server.worker.recovery import PAUSE_BUDGET_MS, Recovery
    r = Recovery(str(tmp_path), 1)
    try:
        assert r.paused(100 << 20, 256 << 20)                   # the first: the context's bytes
        assert not r.paused(300 << 20, 256 << 20)
        assert not r.paused(1, 0)                               # 0: always concurrent
        r.begin(paused=False)
        r.committed(10, copied=300 << 20)
        assert not r.paused(100 << 20, 256 << 20)              # the last one copied too much
        r.begin(paused=False)
        r.committed(20, copied=1 << 20)
        assert r.paused(100 << 20, 256 << 20)
        r.begin(paused=True)
        r.committed(30, copied=1 << 20, pause_ms=PAUSE_BUDGET_MS / 2)
        assert r.paused(100 << 20, 256 << 20)
        r.begin(paused=True)
        r.committed(40, copied=1 << 20, pause_ms=PAUSE_BUDGET_MS * 2)
        assert not r.paused(100 << 20, 256 << 20)              # it held the application too long
    finally:
        r.prune_done()              # it prunes each replaced image in a thread


@pytest.mark.parametrize("limit, mode", [("268435456", "paused"), ("0", "concurrent")])
def test_the_server_takes_small_recovery_images_paused(servers, client, tmp_path, monkeypatch, limit, mode):
    from phos.gpu_server.worker.recovery import context_store
    from phos.snapshot import DirStore, read_image
    monkeypatch.setenv("PHOS_RECOVERY_PAUSED_BYTES", limit)
    directory = tmp_path / "rec"
    srv = recovering(servers, every="600", directory=directory)    # the new context's image alone
    cu = client(srv)
    app = App(cu)
    app.get(app.put(np.ones(N, np.float32)), 8)
    assert wait_until(lambda: recovery_images(directory, app.id), 10)
    store = DirStore(context_store(directory, app.id))
    modes = {read_image(store, name).metadata["mode"] for name in recovery_images(directory, app.id)}
    assert modes == {mode}, modes
    app.ok(cu.cuCtxDestroy(app.ctx))
