"""Transparent recovery in the native stub (schema/phos.capnp, "Recovery").

tests/apps/iterate.cu runs against the stub on a server that takes recovery images of its
context. Its worker, or its whole server, is SIGKILLed, and the program must print exactly
what an uninterrupted run prints: the stub finds the context again (on its server, or on
the standby), replays its log after the image's cut (acknowledged calls and staged copies
too) and drops the Results it had delivered before. Runs on emu in CI, and skips like
tests/native/test_stub_reattach.py where the stub or the program cannot be built.
"""
import os
import signal
import subprocess

import pytest

import test_stub_reattach
from conftest import recovery_images as images, wait_until
from phos.admin_cli import stub as admin
from phos.schema import admin_pb2 as pb
from phos.snapshot import DirStore, latest_image
from test_stub_reattach import PAUSE, STUB, Program, iterate, kill, reference  # noqa: F401 (iterate: the fixture)

pytestmark = pytest.mark.gpu     # perf/device/run.sh runs this file with --backend cuda

# sweeps of a run killed while it computes: seconds of work on emu, and on a GPU (where 400
# sweeps end in milliseconds, before the test can kill anything)
RUNNING_TOTAL = {"emu": 400, "cuda": 300_000}


def recovering(servers, name, directory, every, *more):
    """A server taking recovery images of its contexts into `directory` every `every` seconds."""
    return servers(name, args=["--recovery-dir", str(directory), "--checkpoint-every", str(every), *more])


def the_context(server):
    """The server's one context (id, worker pid, last executed seq)."""
    contexts = admin(server.address).ListContexts(pb.ListContextsRequest()).contexts
    assert len(contexts) == 1, (contexts, server.output()[-4000:])
    return contexts[0]


def kill_worker(server, ctx):
    pid = ctx.pid
    assert pid in server.workers()
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: pid not in server.workers(), 10)


def finish(prog, expected, ctx, *servers):
    """The program's end; on failure, with the last of each server's log in `servers`."""
    code, out, err = prog.finish()
    logs = "".join(f"\n--- server log {s.address}:\n{s.output()[-6000:]}" for s in servers)
    assert code == 0 and out == expected, f"{out}\n{err}{logs}"
    assert f"context {ctx} re-attached" in err, err
    return err


VARIANTS = {
    "staging": {"PHOS_STAGING": "1"},                 # staged copies: the log keeps copies of the slots' bytes
    "frames": {"PHOS_STAGING": "0"},                  # framed copies: the log owns what it would have borrowed
    # a log of 512 KiB fills with the second upload: the stub asks for images (logFull)
    "small-log": {"PHOS_STAGING": "1", "PHOS_LOG_BYTES": str(512 << 10), "PHOS_VERBOSE": "1"},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_worker_killed_at_a_pause_replays_from_an_older_image(iterate, servers, tmp_path, variant):
    """Only the image of the new context exists (no periodic one in time): the worker is
    SIGKILLed at the pause, after it acknowledged calls that image lacks. Its server restores
    the context from the image and the stub replays everything after the cut, the uploads
    with the bytes it logged, dropping the Results of calls that had been answered."""
    directory = tmp_path / "rec"
    one = recovering(servers, "one", directory, 600)
    expected = reference(iterate, one, PAUSE)
    prog = Program(iterate, one, PAUSE, **VARIANTS[variant])
    assert prog.until_ready() == f"READY {PAUSE}\n"
    ctx = the_context(one)
    assert wait_until(lambda: images(directory, ctx.id), 20), "no recovery image of the new context"
    kill_worker(one, ctx)
    prog.go_on()
    err = finish(prog, expected, ctx.id)
    if variant == "small-log":
        assert "the recovery log was full" in err, err


def running(iterate, server):
    """The program and its expected output, once it computes past its pause (50 calls on)."""
    expected = reference(iterate, server, PAUSE)
    prog = Program(iterate, server, PAUSE)
    prog.until_ready()
    at_pause = the_context(server).last_seq
    prog.go_on()
    assert wait_until(lambda: the_context(server).last_seq > at_pause + 50, 30), prog.fail_text()
    return prog, expected


def test_worker_killed_while_the_program_runs(iterate, servers, tmp_path, monkeypatch, backend):
    """Images every 0.2 s; the worker is SIGKILLed while the program's launches run."""
    monkeypatch.setattr(test_stub_reattach, "TOTAL", RUNNING_TOTAL[backend])
    directory = tmp_path / "rec"
    one = recovering(servers, "one", directory, 0.2)
    prog, expected = running(iterate, one)
    assert wait_until(lambda: len(images(directory, the_context(one).id)) > 0, 20)
    ctx = the_context(one)
    assert prog.proc.poll() is None, prog.fail_text()
    kill_worker(one, ctx)
    finish(prog, expected, ctx.id)


def test_handoff_while_the_program_runs(iterate, servers, monkeypatch, backend):
    """A live handoff while the program's launches run (no recovery images): it re-attaches
    at the target and prints what an uninterrupted run prints. The run is four times longer
    than the others: a handoff (seconds on emu) must end before the program does."""
    monkeypatch.setattr(test_stub_reattach, "TOTAL", 4 * RUNNING_TOTAL[backend])
    one, two = servers("one"), servers("two")
    prog, expected = running(iterate, one)
    ctx = the_context(one)
    reply = admin(one.address).Handoff(pb.HandoffRequest(ctx=ctx.id, to=two.address))
    assert reply.ctx == ctx.id and prog.proc.poll() is None, prog.fail_text()
    finish(prog, expected, ctx.id)


@pytest.mark.parametrize("how", ["killed", "killed-env", "stopped"])
def test_server_lost_recovers_on_the_standby(iterate, servers, tmp_path, how):
    """The program's server dies with its workers ("killed"), or stops answering while its
    context's worker dies ("stopped": SIGSTOP, so it accepts connections and never greets).
    A second server sharing the recovery directory, named by the first one's --standby (or
    by PHOS_STANDBY), restores the context when the stub, passing over its own server, asks there."""
    directory = tmp_path / "rec"
    two = recovering(servers, "two", directory, 0.2)
    one = recovering(servers, "one", directory, 0.2, *([] if how == "killed-env" else ["--standby", two.address]))
    expected = reference(iterate, one, PAUSE)
    prog = Program(iterate, one, PAUSE, **({"PHOS_STANDBY": two.address} if how == "killed-env" else {}))
    prog.until_ready()
    ctx = the_context(one)
    assert wait_until(lambda: images(directory, ctx.id), 20), "no recovery image of the context"
    if how == "stopped":
        os.kill(one.proc.pid, signal.SIGSTOP)
        kill_worker(one, ctx)
    else:
        kill(one)
    try:
        prog.go_on()
        err = finish(prog, expected, ctx.id)
        assert f"context {ctx.id} re-attached at {two.address}" in err, err
    finally:
        if how == "stopped":
            kill(one)           # SIGKILL reaches a stopped process; SIGTERM at the end would wait


def test_target_server_lost_after_a_handoff_recovers_on_its_standby(iterate, servers, tmp_path, monkeypatch, backend):
    """The context moves from `one` to `two` (recovery images, standby `three`), then `two`
    dies at once, before it took an image of its own: the handoff's last round is the image.
    `one` still points at two's dead worker, and names two's standby with it: the stub asks
    `one` last from then on, and the standby restores the context."""
    monkeypatch.setattr(test_stub_reattach, "TOTAL", 4 * RUNNING_TOTAL[backend])
    directory = tmp_path / "rec"
    one = servers("one")
    three = recovering(servers, "three", directory, 0.2)
    two = recovering(servers, "two", directory, 600, "--standby", three.address)     # no image of its own
    prog, expected = running(iterate, one)
    ctx = the_context(one)
    admin(one.address).Handoff(pb.HandoffRequest(ctx=ctx.id, to=two.address))
    # the handoff's last round is in two's recovery store: the context's recovery image at once
    assert latest_image(DirStore(directory / f"ctx{ctx.id}"), ctx.id).startswith("handoff-")
    assert prog.proc.poll() is None, prog.fail_text()
    kill(two)          # perhaps before the stub re-attached there: `one` names two's standby then
    err = finish(prog, expected, ctx.id, three, one)
    assert f"context {ctx.id} re-attached at {three.address}" in err, err


def test_large_pageable_upload_replayed_from_the_log(iterate, servers, tmp_path):
    """tests/apps/pageable_copies.cu, 100 MiB + odd bytes, its staged chunks logged as copies of their
    slots (Payload::copy_of, on PHOS_COPY_THREADS=4 threads, as the slots are filled). The worker is
    SIGKILLed at the pause, after the upload, whose source the program then zeroed: the server restores
    the context from the image of the new context and the stub replays the upload from its log; every
    byte read back after is the upload's."""
    from test_stub import APPS, NVCC
    exe = tmp_path / "pageable_copies"
    r = subprocess.run([NVCC, "-cudart", "shared", "-gencode", "arch=compute_90,code=compute_90", "-I", APPS,
                        "-o", str(exe), os.path.join(APPS, "pageable_copies.cu")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    one = recovering(servers, "one", tmp_path / "rec", 600)
    env = dict(os.environ, PHOS_SERVER=one.address, PHOS_STAGING="1", PHOS_COPY_THREADS="4", PHOS_VERBOSE="1",
               LD_LIBRARY_PATH=os.pathsep.join(p for p in (STUB, os.environ.get("LD_LIBRARY_PATH")) if p))
    proc = subprocess.Popen([str(exe), "100", "pause"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline() == "READY\n"
        ctx = the_context(one)
        assert wait_until(lambda: images(tmp_path / "rec", ctx.id), 20), "no recovery image of the new context"
        kill_worker(one, ctx)
        out, err = proc.communicate("go\n", timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out + err + one.output()[-4000:]
    assert out.splitlines() == ["sync: device samples wrong=0, back wrong=0", "async: back wrong=0",
                                "threads started by the copies: 3", "PASS"], out + err
    assert f"context {ctx.id} re-attached" in err and "host copies on 4 threads" in err, err
