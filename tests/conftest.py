"""Shared fixtures: a real phos server process per test module, on the chosen backend."""
import os
import signal
import subprocess
import sys
import time

import pytest
import zmq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_addoption(parser):
    parser.addoption("--backend", default=os.environ.get("PHOS_TEST_BACKEND", "emu"), choices=["emu", "cuda"],
                     help="backend of the servers the end-to-end tests start")


@pytest.fixture(scope="session")
def backend(request):
    return request.config.getoption("--backend")


class ServerProc:
    """A `phos server` child process listening on a private ipc socket."""

    def __init__(self, backend, tmpdir, listen=None, extra=()):
        self.address = listen or f"ipc://{tmpdir}/phos.sock"
        self.log = open(os.path.join(tmpdir, "server.log"), "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "phos.cli", "server", "--backend", backend,
                                      "--listen", self.address, "--log-level", "INFO", *extra],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while "listening on" not in self.output():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{self.output()}")
            time.sleep(0.05)

    def output(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def workers(self):
        """Pids of this server's live context workers."""
        out = subprocess.run(["pgrep", "-f", f"phos.gpu_server.worker.*{self.address}"], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                raise
        self.log.close()


@pytest.fixture(scope="module")
def server(backend, tmp_path_factory):
    srv = ServerProc(backend, tmp_path_factory.mktemp("srv"))
    yield srv
    srv.stop()


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
