"""Whole applications (phos/process.py): `phos checkpoint --pid`, `phos restore --process`,
`phos migrate`, through real servers, real CRIU and real programs on emu.

The programs (tests/apps/steps.cu on the native stub, tests/apps/steps.py on the Python client)
run on by themselves, their output in a file; each is checkpointed mid-run, and the output of
the run that goes on elsewhere must be exactly that of an uninterrupted run."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import wait_until
from phos.stub_run import LocalServer
from share_nothing import keygen, start_isolated, unshare_permitted

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STUB = os.path.join(ROOT, "phos", "stub")
APPS = os.path.join(ROOT, "tests", "apps")
NVCC = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
STEPS, DELAY_MS = 30, 60


def criu_missing():
    from phos.process import ProcessError, find_criu
    try:
        find_criu()
    except ProcessError as e:
        return str(e)
    r = subprocess.run([find_criu()[0], "check"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"criu check: {r.stdout}{r.stderr}"


pytestmark = pytest.mark.skipif(criu_missing() is not None, reason=f"{criu_missing()}")


@pytest.fixture(scope="module")
def programs(stub, tmp_path_factory):
    """steps (native, nvcc -cudart shared) and the PTX steps.py loads."""
    out = tmp_path_factory.mktemp("steps")
    src = out / "step.cu"
    src.write_text('extern "C" __global__ void step(float* x, int n, int k) {\n'
                   "    int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
                   "    if (i < n) x[i] = x[i] * 0.5f + (float)((i + k) % 17);\n}\n")
    subprocess.run([NVCC, "-ptx", "-arch=compute_90", str(src), "-o", str(out / "step.ptx")], check=True)
    subprocess.run([NVCC, "-cudart", "shared", "-gencode", "arch=compute_90,code=compute_90", "-o", str(out / "steps"),
                    os.path.join(APPS, "steps.cu")], check=True)
    return {"native": lambda delay=DELAY_MS: [str(out / "steps"), str(STEPS), str(delay)],
            "python": lambda delay=DELAY_MS: [sys.executable, os.path.join(APPS, "steps.py"), str(out / "step.ptx"),
                                              str(STEPS), str(delay), "2"]}


@pytest.fixture
def backend(request):
    return request.config.getoption("--backend")


@pytest.fixture
def servers(tmp_path, backend):
    made = []

    def start(**kw):
        directory = tmp_path / f"server{len(made)}"
        directory.mkdir(mode=0o700)
        s = LocalServer(backend, str(directory), pool=1, **kw)
        made.append(s)
        return s
    yield start
    for s in made:
        s.stop()


class App:
    """A program on phos, started in a session of its own, its output in files, stdin empty."""

    def __init__(self, argv, server, out, **env):
        self.out = out
        full = dict(os.environ, PHOS_SERVER=server.address, LD_LIBRARY_PATH=STUB, PYTHONUNBUFFERED="1", **env)
        with open(out, "w") as f, open(f"{out}.err", "w") as err:    # the stub's own words go to stderr
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=err, env=full,
                                         start_new_session=True, cwd=ROOT)
        self.pid = self.proc.pid

    def lines(self):
        with open(self.out) as f:
            return f.read().splitlines()

    def at_step(self, k, timeout=60):
        assert wait_until(lambda: any(line.startswith(f"step {k} ") for line in self.lines()), timeout), self.lines()


def reference(program, server, tmp_path, name):
    """The output of an uninterrupted run."""
    app = App(program(0), server, tmp_path / f"{name}.ref")
    assert app.proc.wait(timeout=120) == 0, app.lines()
    return app.lines()


def checkpointed(program, server, tmp_path, at, *extra):
    """An uninterrupted run's output; then the program checkpointed whole at step `at` (which
    ends it, as `criu dump` does) and its server stopped: (that output, the App, the image)."""
    expected = reference(program, server, tmp_path, "ref")
    app = App(program(), server, tmp_path / "out")
    app.at_step(at)
    image = tmp_path / "image"
    r = phos("checkpoint", "--pid", app.pid, image, *extra)
    assert r.returncode == 0, r.stderr
    assert app.proc.wait(timeout=30) == -9
    server.stop()
    return expected, app, image


def phos(*args, **env):
    return subprocess.run([sys.executable, "-m", "phos.cli", *map(str, args)], capture_output=True, text=True,
                          env=dict(os.environ, **env), timeout=300)


def gone(pid):
    from phos.process import pid_state
    return pid_state(pid) in (None, "Z")


def finished(out, pid, timeout=120):
    """The restored process's output once it has printed DONE (it is no child of ours to wait for)."""
    assert wait_until(lambda: any(line.startswith("DONE") for line in open(out).read().splitlines()), timeout), \
        open(out).read()
    assert wait_until(lambda: gone(pid), 30)
    return open(out).read().splitlines()


def tree_digest(directory):
    h = hashlib.sha256()
    for base, _, files in sorted(os.walk(directory)):
        for name in sorted(files):
            if not name.endswith(".log"):
                h.update(name.encode() + open(os.path.join(base, name), "rb").read())
    return h.hexdigest()


@pytest.mark.parametrize("which", ["native", "python"])
def test_checkpointed_process_comes_back_on_a_new_server(which, programs, servers, tmp_path):
    """Checkpointed mid-run with --pid; the program and its server are killed; a new server gets
    the contexts, CRIU brings the process back, and the output is an uninterrupted run's."""
    expected, app, image = checkpointed(programs[which], servers(), tmp_path, 5)
    b = servers()
    r = phos("restore", image, "--process", "--server", b.address, "--json")
    assert r.returncode == 0, r.stderr
    assert finished(app.out, app.pid) == expected


@pytest.mark.parametrize("which", ["native", "python"])
def test_restored_on_a_server_in_a_namespace_of_its_own(which, programs, servers, backend, tmp_path):
    """The program's server is gone; a server in a mount namespace of its own, sharing no files,
    reached over TCP with CURVE keys (which the program was not started with), gets the contexts
    through its network admin API and the restored program finishes there."""
    why = unshare_permitted()
    if why:
        pytest.skip(f"cannot make a mount namespace: {why}")
    expected, app, image = checkpointed(programs[which], servers(), tmp_path, 3)
    keys = keygen(tmp_path / "keys")
    (tmp_path / "b").mkdir(mode=0o700)
    b = start_isolated(backend, str(tmp_path / "b"), keys)
    try:
        env = {"PHOS_SERVER_KEY": str(keys / "server.key"), "PHOS_CLIENT_KEY": str(keys / "client.key_secret")}
        r = phos("restore", image, "--process", "--server", b.address, **env)
        assert r.returncode == 0, r.stderr
        assert finished(app.out, app.pid) == expected
    finally:
        b.stop()


def test_leave_running_then_restore_the_image(programs, servers, tmp_path):
    """--leave-running: the program goes on and finishes as if never stopped, and its image is
    whole. (Restoring it needs the files it had open as they were at the dump: CRIU refuses an
    output file that has grown since, saying so.)"""
    a = servers()
    expected = reference(programs["native"], a, tmp_path, "native")
    app = App(programs["native"](), a, tmp_path / "out")
    app.at_step(3)
    image = tmp_path / "image"
    r = phos("checkpoint", "--pid", app.pid, image, "--leave-running", "--server", a.address, "--json")
    assert r.returncode == 0, r.stderr
    assert app.proc.wait(timeout=120) == 0
    assert app.lines() == expected
    from phos.process import read_manifest
    assert [c["ctx"] for c in read_manifest(str(image))["contexts"]] == [c["ctx"] for c in json.loads(r.stdout)["contexts"]]
    refused(phos("restore", image, "--process", "--server", a.address), "bad size")


def test_migrate_moves_the_process_and_its_contexts(programs, servers, tmp_path):
    """`phos migrate`: the contexts move by live handoff, then the process by CRIU; the program
    ends on the target server with an uninterrupted run's output, and the source holds nothing."""
    a, b = servers(), servers()
    expected = reference(programs["python"], a, tmp_path, "python")
    app = App(programs["python"](delay=300), a, tmp_path / "out")     # still running after two handoffs on a busy host
    app.at_step(4)
    mover = subprocess.Popen([sys.executable, "-m", "phos.cli", "migrate", str(app.pid), "--to", b.address, "--server",
                              a.address, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert app.proc.wait(timeout=60) == -9     # reaped, as its parent would: the restore needs its PID free
    out, err = mover.communicate(timeout=300)
    assert mover.returncode == 0, err
    report = json.loads(out)
    assert report["downtime_ms"]["process"] > 0 and len(report["handoffs"]) == 2, report
    assert finished(app.out, app.pid) == expected
    r = phos("ctx", "list", "--server", a.address, "--json")
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


@pytest.fixture
def image(programs, servers, tmp_path):
    """A native program's process image, the program stopped and its server gone; and a live server."""
    _, app, path = checkpointed(programs["native"], servers(), tmp_path, 2)
    return path, servers(), app


def refused(r, *words):
    assert r.returncode != 0, r.stdout
    for w in words:
        assert w in r.stderr, r.stderr


def test_damaged_and_unsigned_images_are_refused_and_left_as_they_are(image):
    path, b, app = image
    victim = next(p for p in sorted((path / "process").iterdir()) if p.name.startswith("pages-"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    before = tree_digest(path)
    refused(phos("restore", path, "--process", "--server", b.address), "damaged", victim.name)
    assert tree_digest(path) == before
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    manifest = (path / "manifest.json").read_text()
    (path / "manifest.json").write_text(manifest.replace('"signature"', '"unsigned"'))
    refused(phos("restore", path, "--process", "--server", b.address), "signature")
    (path / "manifest.json").write_text(manifest)
    (path / "process" / "extra.img").write_bytes(b"x")
    refused(phos("restore", path, "--process", "--server", b.address), "extra.img", "not in the manifest")
    (path / "process" / "extra.img").unlink()
    assert gone(app.pid) and not phos("ctx", "list", "--server", b.address, "--json").stdout.strip("[]\n")


def test_unreachable_server_and_second_restore_are_refused(image, tmp_path):
    path, b, app = image
    before = tree_digest(path)
    refused(phos("restore", path, "--process", "--server", f"ipc://{tmp_path}/nobody.sock"), "nobody.sock")
    assert tree_digest(path) == before and gone(app.pid)
    r = phos("restore", path, "--process", "--server", b.address)
    assert r.returncode == 0, r.stderr
    refused(phos("restore", path, "--process", "--server", b.address), "already runs")
    assert wait_until(lambda: any(line.startswith("DONE") for line in open(app.out).read().splitlines()), 120)


def test_missing_or_old_criu_and_processes_without_phos_are_named(tmp_path, servers, programs):
    refused(phos("checkpoint", "--pid", os.getpid(), tmp_path / "i", PHOS_CRIU=str(tmp_path / "none")), "CRIU 4", "none")
    old = tmp_path / "criu"
    old.write_text("#!/bin/sh\necho 'Version: 3.17'\n")
    old.chmod(0o755)
    refused(phos("checkpoint", "--pid", os.getpid(), tmp_path / "i", PHOS_CRIU=str(old)), "3.17", "too old")
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        refused(phos("checkpoint", "--pid", sleeper.pid, tmp_path / "i"), "no phos checkpoint agent")
    finally:
        sleeper.kill()
        sleeper.wait()
    refused(phos("checkpoint", "--pid", 999999999, tmp_path / "i"), "no process")
    assert not (tmp_path / "i").exists()


def test_a_dump_that_fails_leaves_the_program_running(programs, servers, tmp_path):
    """A process CRIU refuses (here: on a terminal, without --shell-job) is thawed where it was and
    finishes unharmed; nothing is left in the image directory."""
    import pty
    a = servers()
    expected = reference(programs["native"], a, tmp_path, "native")
    leader, follower = pty.openpty()
    full = dict(os.environ, PHOS_SERVER=a.address, LD_LIBRARY_PATH=STUB)
    proc = subprocess.Popen(programs["native"](), stdin=follower, stdout=follower, stderr=follower, env=full,
                            start_new_session=True, cwd=ROOT)
    os.close(follower)
    out = b""
    while b"step 2 " not in out:
        out += os.read(leader, 4096)
    r = phos("checkpoint", "--pid", proc.pid, tmp_path / "image", "--server", a.address)
    refused(r, "criu dump failed")
    assert not (tmp_path / "image").exists()
    deadline = time.monotonic() + 120
    while b"DONE" not in out and time.monotonic() < deadline:
        try:
            out += os.read(leader, 4096)
        except OSError:
            break
    assert proc.wait(timeout=60) == 0
    assert out.decode().replace("\r\n", "\n").splitlines() == expected


def test_contexts_imaged_into_the_servers_host_store(programs, servers, tmp_path):
    """--gpu-store: the contexts go into the server's host store (pinned memory) and the process
    directory holds the process alone; a new server on the same store restores both halves."""
    store = f"/dev/shm/phos-test-{os.getpid()}-{tmp_path.name}"
    try:
        a = servers(extra=("--host-store", store, "--host-memory", "256M"))
        expected, app, image = checkpointed(programs["native"], a, tmp_path, 3, "--gpu-store", store)
        assert not (image / "gpu").exists()
        b = servers(extra=("--host-store", store))
        manifest = json.loads((image / "manifest.json").read_text())
        assert manifest["gpu_store"] == store and all(c["manifest_sha256"] for c in manifest["contexts"])
        r = phos("restore", image, "--process", "--server", b.address)
        assert r.returncode == 0, r.stderr
        assert finished(app.out, app.pid) == expected
    finally:
        shutil.rmtree(store, ignore_errors=True)


def test_migrate_to_another_host(programs, backend, tmp_path):
    """`phos migrate --remote`: between two servers in mount namespaces of their own (TCP, CURVE),
    the contexts move by handoff and the process is sent to the target's namespace as a tar
    stream and restored there (`nsenter` into it stands for `ssh` to another host); the program
    ends there with an uninterrupted run's output. Its output file, the keys and phos are where
    both "hosts" see them (/var/tmp, the checkout); /tmp, /run and /dev/shm are each one's own."""
    why = unshare_permitted()
    if why or not shutil.which("nsenter"):
        pytest.skip(f"cannot make or enter a mount namespace: {why or 'no nsenter'}")
    shared = tempfile.mkdtemp(prefix="phos-test-migrate-", dir="/var/tmp")
    started = []
    try:
        keys = keygen(os.path.join(shared, "keys"))
        env = {"PHOS_SERVER_KEY": os.path.join(keys, "server.key"), "PHOS_CLIENT_KEY": os.path.join(keys, "client.key_secret")}
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            started.append(start_isolated(backend, str(tmp_path / name), keys))
        a, b = started
        binary = shutil.copy(programs["native"]()[0], shared)     # the program's files are on both hosts
        ref = App([binary, *programs["native"](0)[1:]], a, os.path.join(shared, "ref"), **env)
        assert ref.proc.wait(timeout=120) == 0, ref.lines()
        app = App([binary, *programs["native"]()[1:]], a, os.path.join(shared, "out"), **env)
        app.at_step(4)
        mover = subprocess.Popen([sys.executable, "-m", "phos.cli", "migrate", str(app.pid), "--to", b.address,
                                  "--remote", f"nsenter -t {b.proc.pid} -m", "--json"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, **env))
        assert app.proc.wait(timeout=60) == -9
        out, err = mover.communicate(timeout=300)
        assert mover.returncode == 0, err
        assert json.loads(out)["remote"].startswith("nsenter")
        assert finished(app.out, app.pid) == ref.lines()
    finally:
        for s in started:
            s.stop()
        shutil.rmtree(shared, ignore_errors=True)


def test_keep_context_refuses_bad_input_by_name(programs, servers, tmp_path):
    """KeepContext (how a checkpoint holds a context while its client is dumped): an unknown
    context and a wait out of bounds are refused, naming them, and the context goes on."""
    from phos import process
    from phos.schema import admin_pb2 as pb
    a = servers()
    app = App(programs["native"](), a, tmp_path / "out")
    app.at_step(1)
    (c,) = process.contexts_of(app.pid)["contexts"]
    for ctx, seconds, words in ((c["ctx"], -1.0, "keep"), (c["ctx"], 1e9, "at most"), (c["ctx"] ^ 1, 5.0, "no context")):
        with pytest.raises(process.ProcessError, match=words):
            process.ask(a.address, "KeepContext", pb.KeepContextRequest(ctx=ctx, seconds=seconds), timeout=30)
    assert app.proc.wait(timeout=120) == 0
    assert app.lines()[-1].startswith("DONE")
