"""A snapshot's threads say when they have work: the worker's loop and a checkpoint's waits
give them the interpreter (by sleeping) only then, as each sleep, even sleep(0), lasts the
kernel's timer slack and holds the application's next call."""
import threading

import pytest

from phos.gpu_server.backends.emu import EmuBackend
from phos.gpu_server.worker.session import Session
from phos.snapshot import MemoryStore
from phos.snapshot import engine
from phos.snapshot.engine import Checkpoint
from phos.snapshot.ops import WorkThreads
from conftest import wait_until


def test_work_threads_count_the_work_they_hold():
    pool = WorkThreads(2, "test-work")
    go = threading.Event()
    assert not pool.at_work
    held = [pool.submit(go.wait, 10) for _ in range(3)]      # one of them still queued
    assert pool.at_work and pool.unfinished == 3
    go.set()
    assert all(f.result(10) for f in held)
    assert wait_until(lambda: not pool.at_work, 5), pool.unfinished
    assert pool.submit(sum, [1, 2]).result(10) == 3
    assert wait_until(lambda: pool.unfinished == 0, 5)
    pool.shutdown()
    with pytest.raises(RuntimeError):
        pool.submit(sum, [1])
    assert pool.unfinished == 0, "a refused submission counted as work"


def test_a_failing_task_still_counts_as_finished():
    pool = WorkThreads(1, "test-work")
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 // 0).result(10)
    assert wait_until(lambda: not pool.at_work, 5)
    pool.shutdown()


@pytest.fixture
def checkpoint(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))     # an image key of its own
    s = Session(EmuBackend(), 7, b"t" * 16)
    s.backend.alloc(1 << 20)
    cp = Checkpoint(s, MemoryStore(), "a")
    yield s, cp
    cp.io.shutdown()


def test_a_session_has_threads_at_work_only_while_its_checkpoint_does(checkpoint):
    s, cp = checkpoint
    assert not s.threads_at_work(), "no checkpoint runs"
    s.checkpoint = cp
    assert not s.threads_at_work()
    go = threading.Event()
    cp.io.submit(go.wait, 10)
    assert cp.threads_at_work() and s.threads_at_work()
    go.set()
    assert wait_until(lambda: not s.threads_at_work(), 5)


def test_a_checkpoint_waits_asleep_only_while_its_threads_have_work(checkpoint, monkeypatch):
    _, cp = checkpoint
    slept = []
    monkeypatch.setattr(engine.time, "sleep", lambda seconds: slept.append(seconds))

    def steps(n):
        yield from range(n)

    cp.drain(steps(5))
    assert slept == [], "it slept with nothing to give the interpreter to"
    go = threading.Event()
    cp.io.submit(go.wait, 10)
    cp.drain(steps(3))
    assert slept == [0, 0, 0]
    go.set()
