"""`phos run [--server ADDR] -- ./app ARGS`: run an unmodified CUDA program on phos.

The program finds phos's libcuda.so.1 (and NVIDIA's libcudart.so.13 beside it) first on
LD_LIBRARY_PATH (phos/stub, built by `make -C client_stub/native`), and its calls go to
the server named by PHOS_SERVER. Without --server, a local emu server is started on a
private ipc socket for the program's lifetime and stopped after it.

Every CUDA runtime, NVIDIA's shared one, a copy pinned by RPATH or one linked statically,
reaches the GPU through libcuda.so.1, which the library path redirects.
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from phos.base import settings

# PHOS_STUB_DIR: where the stub is when phos is installed away from the checkout that built it
STUB_DIR = settings.stub_dir()
SERVER_START_TIMEOUT = settings.server_start_timeout()


def stub_environment(server, base=None):
    """The environment a program needs to run on phos: the stub first on the library path."""
    env = dict(os.environ if base is None else base)
    path = env.get("LD_LIBRARY_PATH", "")
    env["LD_LIBRARY_PATH"] = STUB_DIR + (os.pathsep + path if path else "")
    env["PHOS_SERVER"] = server
    return env


def _check_stub():
    missing = [n for n in ("libcudart.so.13", "libcuda.so.1") if not os.path.exists(os.path.join(STUB_DIR, n))]
    if missing:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        raise SystemExit(f"phos run: {', '.join(missing)} not found in {STUB_DIR}; "
                         f"build the native stub with `make -C {os.path.join(root, 'client_stub', 'native')}`")


def free_port_pair():
    """A port whose next port is free too (a tcp:// server's admin API is at its port + 1)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two free consecutive ports")


class LocalServer:
    """A `phos server` child process, stopped (with its workers) by stop().

    `phos run` starts an emu server on a private ipc socket; the tests start others.
    Without a directory it makes one for the socket and log, and removes it on stop.
    """

    def __init__(self, backend="emu", directory=None, listen=None, extra=(), pool=0, wrap=()):
        """wrap: a command the server runs under (it ends by running its arguments), such as
        the tests' unshare into a mount namespace of its own."""
        self.owned = directory is None
        self.dir = tempfile.mkdtemp(prefix="phos-run-") if self.owned else str(directory)
        self.address = listen or f"ipc://{self.dir}/phos.sock"
        self.log = open(os.path.join(self.dir, "server.log"), "w+")
        self.proc = subprocess.Popen(
            [*wrap, sys.executable, "-m", "phos.cli", "server", "--backend", backend, "--listen", self.address,
             "--log-level", "INFO", "--pool", str(pool), *extra],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while "listening on" not in self.output():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                text = self.output()
                self.stop()
                raise SystemExit(f"phos: the {backend} server did not start:\n{text}")
            time.sleep(0.02)

    def output(self):
        if not self.log.closed:
            self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)     # the front end stops its workers
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        if self.owned:
            shutil.rmtree(self.dir, ignore_errors=True)


def run(argv: list[str], server: str | None) -> int:
    """Run argv on phos and return its exit status (128 + N if killed by signal N)."""
    if not argv:
        raise SystemExit("phos run: give the program to run after --")
    _check_stub()
    local = None if server else LocalServer()
    try:
        env = stub_environment(server or local.address)
        try:
            proc = subprocess.Popen(argv, env=env)
        except OSError as e:
            raise SystemExit(f"phos run: cannot run {argv[0]}: {e.strerror}")
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:        # the program got the SIGINT too; wait for it
                continue
        return 128 - code if code < 0 else code
    finally:
        if local is not None:
            local.stop()
