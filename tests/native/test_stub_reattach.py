"""The native stub finds a restored context again (schema/phos.capnp, "Snapshots").

A CUDA program (tests/apps/iterate.cu) runs against the stub and stops at a pause; the
test checkpoints its context, kills the server, starts another server at the same address
(the program reads PHOS_SERVER again when it looks for its context), restores the image
there and lets the program go on: it must print exactly what an uninterrupted run prints.
If the image is older than calls the dead worker already acknowledged, the program must
fail with a clear error instead of going on without them. Runs on emu in CI.
"""
import os
import shutil
import signal
import subprocess
import threading
import time

import grpc
import pytest

from conftest import wait_until
from phos.admin_cli import stub as admin
from phos.schema import admin_pb2 as pb

pytestmark = pytest.mark.gpu     # perf/device/run.sh runs this file with --backend cuda

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STUB = os.path.join(ROOT, "phos", "stub")
APP = os.path.join(ROOT, "tests", "apps", "iterate.cu")
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")
NVCC = shutil.which("nvcc") or os.path.join(CUDA_HOME, "bin", "nvcc")
TOTAL, PAUSE, LATER = 30, 10, 20
TIMEOUT = 120


@pytest.fixture(scope="module")
def iterate(stub, tmp_path_factory):
    """tests/apps/iterate.cu, built with nvcc, for the stub."""
    if not os.path.exists(NVCC):
        pytest.skip("nvcc not found: cannot build tests/apps/iterate.cu")
    out = tmp_path_factory.mktemp("iterate") / "iterate"
    gencode = ["-gencode", "arch=compute_90,code=compute_90", "-gencode", "arch=compute_90,code=sm_90"]
    r = subprocess.run([NVCC, "-cudart", "shared", *gencode, "-o", str(out), APP], capture_output=True, text=True)
    assert r.returncode == 0, f"building iterate.cu failed:\n{r.stdout}\n{r.stderr}"
    return str(out)


class Program:
    """iterate running against the stub, driven line by line."""

    def __init__(self, binary, server, *pauses, **env):
        full = dict(os.environ, PHOS_SERVER=server.address, PHOS_REATTACH_TIMEOUT="60")
        full.update(env)
        full["LD_LIBRARY_PATH"] = STUB + (os.pathsep + full["LD_LIBRARY_PATH"] if full.get("LD_LIBRARY_PATH") else "")
        self.proc = subprocess.Popen([binary, str(TOTAL), *map(str, pauses)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full, cwd=ROOT)
        self.lines = []

    def until_ready(self):
        line = self.proc.stdout.readline()
        self.lines.append(line)
        assert line.startswith("READY"), self.fail_text()
        return line

    def go_on(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self):
        try:
            out, err = self.proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        return self.proc.returncode, "".join(self.lines) + out, err

    def fail_text(self):
        if self.proc.poll() is None:
            self.proc.kill()
        out, err = self.proc.communicate()
        return f"stdout:\n{''.join(self.lines)}{out}\nstderr:\n{err}"


def context_of(server):
    """The id of the one context the server holds."""
    contexts = admin(server.address).ListContexts(pb.ListContextsRequest()).contexts
    assert len(contexts) == 1, contexts
    return contexts[0].id


def checkpoint(server, ctx, store):
    msgs = list(admin(server.address).Checkpoint(pb.CheckpointRequest(ctx=ctx, store=str(store))))
    assert msgs[-1].finished
    return msgs[-1]


def kill(server):
    server.proc.kill()          # SIGKILL the front end: its workers die with it (PDEATHSIG)
    server.proc.wait()
    assert wait_until(lambda: not server.workers(), 10)


def reference(binary, server, *pauses):
    prog = Program(binary, server, *pauses)
    for _ in pauses:
        prog.until_ready()
        prog.go_on()
    code, out, err = prog.finish()
    assert code == 0 and out.rstrip().endswith("PASS"), f"{out}\n{err}"
    return out


VARIANTS = {
    "staging": {"PHOS_STAGING": "1"},                                        # copies through the staging area
    "frames": {"PHOS_STAGING": "0"},                                         # copies in frames
    "mailbox": {"PHOS_STAGING": "1", "PHOS_MAILBOX": "1", "PHOS_SPIN_US": "20"},   # synchronous calls through the mailbox
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_killed_server_restored_at_the_same_address_continues(iterate, servers, tmp_path, variant):
    """Checkpoint at the pause, SIGKILL the server, restore the image into a new server at the
    same address: the program re-attaches by itself and prints what an uninterrupted run does."""
    one = servers("one")
    expected = reference(iterate, one, PAUSE)

    prog = Program(iterate, one, PAUSE, **VARIANTS[variant])
    assert prog.until_ready() == f"READY {PAUSE}\n"
    ctx = context_of(one)
    store = tmp_path / "images"
    checkpoint(one, ctx, store)
    kill(one)
    two = servers("two", listen=one.address)     # where the program will look for its context
    reply = admin(two.address).Restore(pb.RestoreRequest(store=str(store)))
    assert reply.ctx == ctx
    prog.go_on()
    code, out, err = prog.finish()
    assert code == 0, f"{out}\n{err}"
    assert out == expected, f"{out}\n{err}"
    assert f"context {ctx} re-attached" in err, err


def test_calls_lost_after_the_cut_fail_clearly(iterate, servers, tmp_path):
    """The image is taken at the first pause; the program then runs on, and the dead worker
    acknowledges calls the image lacks. After the restore, the program must not go on."""
    one = servers("one")
    prog = Program(iterate, one, PAUSE, LATER)
    prog.until_ready()
    ctx = context_of(one)
    store = tmp_path / "images"
    checkpoint(one, ctx, store)
    prog.go_on()
    assert prog.until_ready() == f"READY {LATER}\n"     # synchronized: acknowledged past the cut
    kill(one)
    two = servers("two", listen=one.address)
    assert admin(two.address).Restore(pb.RestoreRequest(store=str(store))).ctx == ctx
    prog.go_on()
    code, out, err = prog.finish()
    assert code != 0, f"{out}\n{err}"
    assert "PASS" not in out
    assert "CUDA_ERROR_CONTEXT_IS_DESTROYED" in out or "cudaErrorContextIsDestroyed" in out, f"{out}\n{err}"
    assert f"context {ctx} was restored from an image taken at call" in err, err
    assert "cannot continue" in err, err


def test_a_context_nobody_restores_fails_after_the_reattach_timeout(iterate, servers):
    """The server dies and nothing restores the context: the program fails once
    PHOS_REATTACH_TIMEOUT has passed, saying why, instead of waiting forever."""
    one = servers("one")
    prog = Program(iterate, one, PAUSE, PHOS_REATTACH_TIMEOUT="1")
    prog.until_ready()
    ctx = context_of(one)
    kill(one)
    prog.go_on()
    code, out, err = prog.finish()
    assert code != 0 and "PASS" not in out, f"{out}\n{err}"
    assert "cudaErrorContextIsDestroyed" in out, f"{out}\n{err}"
    assert f"the worker of context {ctx}" in err and "no server restored the context within 1 s" in err, err


def test_handoff_to_another_server_continues(iterate, servers):
    """A live handoff at the pause: the retiring worker tells the program where its context
    went (a worker on another server); the program prints what an uninterrupted run does."""
    one, two = servers("one"), servers("two")
    expected = reference(iterate, one, PAUSE)
    prog = Program(iterate, one, PAUSE)
    prog.until_ready()
    ctx = context_of(one)
    reply = admin(one.address).Handoff(pb.HandoffRequest(ctx=ctx, to=two.address))
    assert reply.ctx == ctx and context_of(two) == ctx
    prog.go_on()
    code, out, err = prog.finish()
    assert code == 0 and out == expected, f"{out}\n{err}"
    assert f"context {ctx} re-attached" in err, err
    assert "told by its old worker" in err, err       # it asked no front end


def test_target_killed_mid_handoff_the_program_finishes_here(iterate, servers):
    """The target hangs in its restore while the context is frozen on the source, and is then
    SIGKILLed: the source thaws the context and the program, which went on calling, finishes."""
    one, two = servers("one"), servers("two")
    expected = reference(iterate, one, PAUSE)
    prog = Program(iterate, one, PAUSE)
    prog.until_ready()
    ctx = context_of(one)
    os.kill(two.proc.pid, signal.SIGSTOP)      # it accepts the Restore, and never answers
    failed = {}

    def handoff():
        try:
            admin(one.address).Handoff(pb.HandoffRequest(ctx=ctx, to=two.address))
        except grpc.RpcError as e:
            failed["error"] = e
    mover = threading.Thread(target=handoff)
    mover.start()
    time.sleep(1.5)                             # the rounds are done: the source waits on the target
    prog.go_on()                                # its calls wait while the context is frozen
    os.kill(two.proc.pid, signal.SIGKILL)
    mover.join()
    assert "stays live here" in failed["error"].details()
    code, out, err = prog.finish()
    assert code == 0 and out == expected, f"{out}\n{err}"
    assert "re-attached" not in err, err          # it never left the first server
