"""Shared fixtures: a real phos server process per test module, on the chosen backend.

Tests by kind: unit/ (functions and classes in process), e2e/ (through real servers and the
Python client), native/ (the native stub and the CUDA programs in apps/). This folder, on
sys.path (pyproject's pythonpath), keeps what they share: this file, wire_client.py,
ptx_helpers.py, apps/ and kernels/."""
import os
import subprocess
import time

import pytest
import zmq

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


@pytest.fixture(scope="session")
def backend(request):
    return request.config.getoption("--backend")


class ServerProc(LocalServer):
    """A real `phos server` for a test, in the test's tmp dir; workers() lists its context workers."""

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
    from phos.gpu_server.recovery import context_store
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
