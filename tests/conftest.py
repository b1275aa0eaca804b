"""Shared fixtures: a real phos server process per test module, on the chosen backend.

Tests by kind: unit/ (functions and classes in process), e2e/ (through real servers and the
Python client), native/ (the native stub and the CUDA programs in apps/). This folder, on
sys.path (pyproject's pythonpath), keeps what they share: this file, wire_client.py,
ptx_helpers.py, apps/ and kernels/."""
import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import zmq

from phos.gpu_server.control.frontend import check_listen
from phos.stub_run import LocalServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_addoption(parser):
    parser.addoption("--backend", default=os.environ.get("PHOS_TEST_BACKEND", "emu"), choices=["emu", "cuda"],
                     help="backend of the servers the end-to-end tests start")


def pytest_runtest_setup(item):
    """`gpu` marks what perf/device/run.sh also runs on the H200 (pytest -m 'gpu and not fuzz' --backend cuda);
    CI runs those on emu. gpu(only=True) marks a test that means nothing without a real GPU."""
    mark = item.get_closest_marker("gpu")
    if mark is not None and mark.kwargs.get("only") and item.config.getoption("--backend") != "cuda":
        pytest.skip("needs a real GPU: run it with --backend cuda (perf/device/run.sh)")


# A stuck test fails with every thread's stack, so that the run goes on and its report shows
# where: a hang would otherwise hold the whole run until CI's own limit, and show nothing.
# No test takes near this, the pool's module fixture (three Ray nodes) in its first test included.
TEST_LIMIT_S = 400
STUCK = signal.SIGUSR2        # a signal no code of phos or its tests takes


class TestTimeout(Exception):
    pass


def _stuck(signum, frame):
    raise TestTimeout(f"a test ran past {TEST_LIMIT_S} s (tests/conftest.py TEST_LIMIT_S); "
                       "the stacks of every thread are above")


class Watchdog:
    """Interrupts the main thread, in whatever it waits on, when a test (its setup, call and
    teardown together) runs past its limit; when even that does not end it, ends the run with
    the stacks written to the run's own stderr (pytest's capture holds fd 2 meanwhile)."""
    last_word = sys.__stderr__

    def __init__(self, limit_s):
        self.limit_s, self.done = limit_s, threading.Event()
        self.main = threading.main_thread().ident

    def __enter__(self):
        faulthandler.dump_traceback_later(self.limit_s * 2, exit=True, file=self.last_word)
        threading.Thread(target=self.watch, daemon=True, name="test-watchdog").start()
        return self

    def watch(self):
        if not self.done.wait(self.limit_s):
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
            signal.pthread_kill(self.main, STUCK)

    def __exit__(self, *exc):
        self.done.set()
        faulthandler.cancel_dump_traceback_later()


def pytest_configure(config):
    signal.signal(STUCK, _stuck)
    capture = getattr(config.pluginmanager.getplugin("capturemanager"), "_global_capturing", None)
    saved = getattr(getattr(capture, "err", None), "targetfd_save", None)     # fd 2 before pytest took it
    if saved is not None:
        Watchdog.last_word = os.fdopen(os.dup(saved), "w")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with Watchdog(TEST_LIMIT_S):
        yield


def pytest_sessionfinish(session, exitstatus):
    """The run's end, its processes and sockets closing, is watched too: stuck there, it ends
    with the stacks."""
    faulthandler.dump_traceback_later(TEST_LIMIT_S, exit=True, file=Watchdog.last_word)


@pytest.fixture(scope="session")
def backend(request):
    return request.config.getoption("--backend")


STUB_DIR = os.path.join(ROOT, "phos", "stub")
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")


@pytest.fixture(scope="session")
def stub():
    """phos/stub, built by make (a no-op when it is up to date). A machine without the build
    tools (the device machine) runs the stub built elsewhere and carried in phos/stub."""
    if not os.path.exists(os.path.join(CUDA_HOME, "include", "cuda.h")):
        pytest.skip(f"no CUDA 13 headers under {CUDA_HOME}: the stub cannot be built here")
    r = subprocess.run(["make", "-s", "-C", os.path.join(ROOT, "client_stub", "native")], capture_output=True, text=True)
    if r.returncode != 0 and "client_stub/native: " in r.stderr:   # a build dependency is missing
        if not os.path.exists(os.path.join(STUB_DIR, "libcuda.so.1")):
            pytest.skip(r.stderr.strip().splitlines()[-1])
        return STUB_DIR
    assert r.returncode == 0, f"building the native stub failed:\n{r.stdout}\n{r.stderr}"
    return STUB_DIR


class ServerProc(LocalServer):
    """A real `phos server` for a test, in the test's tmp dir; workers() lists its context workers.
    Its socket is there too, unless a long temporary directory (TMPDIR, pytest's numbering) would
    leave its workers' sockets no room (check_listen): then in a short directory of its own."""

    def __init__(self, backend, directory, listen=None, **kw):
        self.socket_dir = None
        if listen is None:
            listen = f"ipc://{directory}/phos.sock"
            try:
                check_listen(listen, None)
            except ValueError:
                self.socket_dir = tempfile.mkdtemp(prefix="phos-test-", dir="/tmp")
                listen = f"ipc://{self.socket_dir}/phos.sock"
        super().__init__(backend, directory, listen, **kw)

    def stop(self):
        super().stop()
        if self.socket_dir:     # its workers end a moment after it: one starting up may still bind there
            wait_until(lambda: not self.workers(), 10)
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    def workers(self):
        """Pids of this server's live context workers."""
        out = subprocess.run(["pgrep", "-f", f"phos.gpu_server.worker.*{self.address}"], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]


def stop_and_show(srv):
    """Stop a fixture's server and print its last log lines: pytest shows them for a failing test."""
    srv.stop()
    print(f"--- server {srv.dir}, last lines:\n{srv.output()[-3000:]}")


@pytest.fixture(scope="module")
def server(backend, tmp_path_factory):
    srv = ServerProc(backend, tmp_path_factory.mktemp("srv"))
    yield srv
    stop_and_show(srv)


@pytest.fixture
def servers(backend, tmp_path):
    """servers(name, listen=None, pool=1, args=()) starts a server in tmp_path/name, with more
    `phos server` arguments; all stop at the end."""
    started = []

    def start(name, listen=None, pool=1, args=()):
        (tmp_path / name).mkdir()
        srv = ServerProc(backend, tmp_path / name, listen=listen, pool=pool, extra=tuple(args))
        started.append(srv)
        return srv
    yield start
    for srv in started:
        stop_and_show(srv)


@pytest.fixture
def two_devices(backend, servers, monkeypatch):
    """two_devices(name, devices="all") starts a server (servers') whose emu backend has two
    devices (PHOS_EMU_DEVICES=2), serving those `phos server --devices` names."""
    if backend != "emu":
        pytest.skip("a server of two emu devices (PHOS_EMU_DEVICES)")
    monkeypatch.setenv("PHOS_EMU_DEVICES", "2")
    return lambda name, devices="all": servers(name, args=("--devices", devices))


@pytest.fixture
def client(monkeypatch):
    """Connect the Python client to a server: client(server) -> driver module."""
    from phos.client_stub import driver

    def connect(server):
        driver._reset_for_tests()
        monkeypatch.setenv("PHOS_SERVER", server.address)
        assert driver.cuInit(0) == (driver.CUresult.CUDA_SUCCESS,)
        return driver
    yield connect
    driver._reset_for_tests()


@pytest.fixture
def cu(server, monkeypatch):
    """The Python client, initialised against this module's server, with a fresh context."""
    from phos.client_stub import driver
    driver._reset_for_tests()
    monkeypatch.setenv("PHOS_SERVER", server.address)
    assert driver.cuInit(0) == (driver.CUresult.CUDA_SUCCESS,)
    err, ctx = driver.cuCtxCreate(None, 0, 0)
    assert err == driver.CUresult.CUDA_SUCCESS, driver.last_error
    yield driver
    driver.cuCtxDestroy(ctx)
    driver._reset_for_tests()


def recovery_images(directory, ctx):
    """The committed recovery images of context `ctx` under a --recovery-dir. Its manifest
    commits an image (its digest file lands first): a killed server may leave only that."""
    from phos.gpu_server.worker.recovery import context_store
    from phos.snapshot import DirStore
    path = context_store(directory, ctx)
    return [n for n in DirStore(path).list_images() if n.startswith("rec-")] if os.path.isdir(path) else []


def wait_until(predicate, timeout, step=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


@pytest.fixture
def raw(server):
    """A bare DEALER to the front end, for sending hand-made frames."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10000)
    sock.connect(server.address)
    yield sock
    sock.close()
