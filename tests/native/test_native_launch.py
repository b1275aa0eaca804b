"""The worker's compiled launch path (gpu_server/native/launch_batch.cpp, gpu_server/backends/native_launch.py):
a launchBatch through a stand-in for the driver's cuLaunchKernelEx, in a real Session on emu.

Checks what the driver is handed (config, attributes, each parameter's bytes), that a batch the
native code must not judge goes to the Python path whole, and that the context's dropped and
replaced ids are forgotten. perf/device/run.sh's core step runs test_launch_batch.py on the H200,
where the same path drives the real driver.
"""
import ctypes
import os
import struct
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import ROOT
from phos.base import native
from phos.gpu_server.backends import native_launch
from phos.gpu_server.backends.backend import Function
from phos.gpu_server.backends.emu import EmuBackend
from phos.gpu_server.worker.session import Session
from phos.schema import wire
from phos.schema.cuda_types import STICKY, CudaError, CUresult

LIBRARY = os.path.join(ROOT, "phos", "stub", native.LIBRARY)
ILLEGAL_ADDRESS = 700          # CUDA_ERROR_ILLEGAL_ADDRESS: sticky
LAUNCH_OUT_OF_RESOURCES = 701  # not sticky


class LaunchAttribute(ctypes.Structure):     # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class LaunchConfig(ctypes.Structure):        # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


LAUNCH_EX = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                             ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)


class StandInDriver:
    """cuLaunchKernelEx's stand-in: records each launch as plain values; fails the launches
    whose number (from 0) is in `failures`, with that error."""

    def __init__(self, sizes):
        self.sizes = sizes          # function handle -> each parameter's size
        self.launches, self.failures = [], {}
        self.pointer = LAUNCH_EX(self.launch)     # kept alive as long as the launcher uses it

    def launch(self, config, function, params, extra):
        c = config.contents
        attrs = [(c.attrs[i].id, tuple(c.attrs[i].value[:3])) for i in range(c.num_attrs)]
        args = [ctypes.string_at(params[i], n) for i, n in enumerate(self.sizes[function])]
        self.launches.append((function, tuple(c.grid), tuple(c.block), c.shared, c.stream or 0, attrs, args))
        return self.failures.get(len(self.launches) - 1, 0)


def failure(err, what):
    return CudaError(err, f"{what} failed: error {err}")


@pytest.fixture
def native():
    if not os.path.exists(LIBRARY):
        pytest.fail(f"{LIBRARY} is not built: make -C client_stub/native")
    return native_launch.load(LIBRARY)


@pytest.fixture
def session(native, monkeypatch):
    """A Session on emu whose backend's launches go to a StandInDriver through the compiled
    path; what reaches the backend's own (Python) launch lands in s.python_launches."""
    backend = EmuBackend()
    driver = StandInDriver({0x1000: (8, 4), 0x2000: ()})
    backend.launcher = native_launch.NativeLauncher(native, ctypes.cast(driver.pointer, ctypes.c_void_p).value, failure,
                                                    wire.STREAM_ALIASES)
    s = Session(backend, 1, b"")
    s.driver, s.python_launches = driver, []
    monkeypatch.setattr(backend, "launch", lambda fn, *rest: s.python_launches.append((fn.name, *rest)))
    yield s
    backend.launcher.close()
    backend.close()


def add_function(s, handle, name, params):
    fn = Function(handle, name, params)
    fn.module_id, fn.size = 0, fn.param_bytes
    return s.add("function", fn)


def batch(s, *records, last=True):
    """launchBatch as Session.execute runs it: (status, message)."""
    status, message, _ = s.execute("launchBatch", b"".join(records), [], last)
    return status, message


def record(fid, params, grid=(2, 1, 1), block=(64, 1, 1), shared=0, options=0, stream=0):
    return wire.launch_record(fid, (*grid, *block, shared, options, stream), params)


def test_the_driver_gets_each_launch_as_sent(session):
    s = session
    k = add_function(s, 0x1000, "k", [(0, 8), (8, 4)])
    sid = s.add("stream", 0xABC0)
    params = struct.pack("<Qi", 0x7F00_0000_1234, -5)
    cluster = 2 | (1 << 8) | wire.LAUNCH_COOPERATIVE
    assert batch(s, record(k, params), record(k, params, (3, 2, 1), (32, 4, 2), 128, cluster, sid),
                 record(k, params, stream=2)) == (0, "")
    args = [struct.pack("<Q", 0x7F00_0000_1234), struct.pack("<i", -5)]
    assert s.driver.launches == [
        (0x1000, (2, 1, 1), (64, 1, 1), 0, 0, [], args),
        # a cluster's 0 stands for 1, as cuda.py's _launch_attributes has it
        (0x1000, (3, 2, 1), (32, 4, 2), 128, 0xABC0, [(4, (2, 1, 1)), (2, (1, 0, 0))], args),
        (0x1000, (2, 1, 1), (64, 1, 1), 0, 0, [], args),      # CU_STREAM_PER_THREAD: the default stream
    ]
    assert s.python_launches == []


def test_a_kernel_without_parameters(session):
    s = session
    k = add_function(s, 0x2000, "empty", [])
    assert batch(s, *[record(k, b"")] * 5) == (0, "")
    assert [launch[6] for launch in s.driver.launches] == [[]] * 5


def test_a_failed_launch_is_reported_after_the_rest_run(session):
    s = session
    k = add_function(s, 0x1000, "k", [(0, 8), (8, 4)])
    s.driver.failures = {1: LAUNCH_OUT_OF_RESOURCES}
    r = record(k, bytes(12))
    expected = (LAUNCH_OUT_OF_RESOURCES, "launchBatch: record 2 of 3: launch of k failed: error 701")
    assert batch(s, r, r, r, last=False) == expected
    assert len(s.driver.launches) == 3             # the third still ran
    # and the next synchronizing call reports it, as for the Python path
    assert s.execute("ctxSynchronize", None, [], True)[:2] == expected
    assert s.execute("ctxSynchronize", None, [], True)[:2] == (0, "")


def test_a_sticky_failure_stops_the_batch(session):
    s = session
    k = add_function(s, 0x1000, "k", [(0, 8), (8, 4)])
    s.driver.failures = {1: ILLEGAL_ADDRESS}
    assert ILLEGAL_ADDRESS in STICKY
    r = record(k, bytes(12))
    status, message = batch(s, r, r, r, r)
    assert (status, message) == (ILLEGAL_ADDRESS, "launchBatch: launch of k failed: error 700")
    assert len(s.driver.launches) == 2


def test_batches_the_native_path_must_not_judge_go_to_python_whole(session):
    s = session
    k = add_function(s, 0x1000, "k", [(0, 8), (8, 4)])
    good = record(k, bytes(12))
    cases = {
        "a zero grid": record(k, bytes(12), grid=(0, 1, 1)),
        "too many threads": record(k, bytes(12), block=(1024, 2, 1)),
        "short parameters": record(k, bytes(8)),
        "no such function": record(0xDEAD, bytes(12)),
        "a stream that is a function": record(k, bytes(12), stream=k),
    }
    for what, bad in cases.items():
        s.python_launches.clear()
        status, message = batch(s, good, bad, good)
        assert s.driver.launches == [], what              # nothing ran natively ...
        assert [launch[0] for launch in s.python_launches] == ["k", "k"], what   # ... the Python path ran the good ones
        assert status == CUresult.CUDA_ERROR_INVALID_VALUE or status == CUresult.CUDA_ERROR_INVALID_HANDLE, what
        assert message.startswith("launchBatch: record 2 of 3: "), (what, message)
    status, message = batch(s, good, good[:-3])
    assert status == CUresult.CUDA_ERROR_INVALID_VALUE and "malformed launch batch" in message
    assert s.driver.launches == [] and len(s.python_launches) == 2      # of the earlier case; none of these


@pytest.mark.parametrize("state", ["checkpoint by copy-on-write", "restore on demand", "checkpoint from its device copy"])
def test_launches_that_must_say_what_they_touch_take_the_python_path(session, state):
    """The Python path tells a snapshot what a launch may write (touch_kernel); a checkpoint
    saving from the cut's device copy needs nothing of it, and launches stay compiled."""
    s = session
    k = add_function(s, 0x1000, "k", [(0, 8), (8, 4)])
    touched = []
    s.touch_kernel = lambda fn, params: touched.append(fn.name)    # the stand-ins below hold no memory
    if state == "checkpoint by copy-on-write":
        s.checkpoint = SimpleNamespace(watches_writes=True)
    elif state == "restore on demand":
        s.restoring = SimpleNamespace()
    else:
        s.checkpoint = SimpleNamespace(watches_writes=False)
    s.snapshotting = s.checkpoint is not None or s.restoring is not None
    assert batch(s, record(k, bytes(12))) == (0, "")
    python = state != "checkpoint from its device copy"
    assert (len(s.python_launches), len(s.driver.launches)) == ((1, 0) if python else (0, 1))
    assert touched == (["k"] if state in ("checkpoint by copy-on-write", "restore on demand") else [])
    s.checkpoint = s.restoring = None
    s.snapshotting = False
    assert batch(s, record(k, bytes(12))) == (0, "")
    assert (len(s.python_launches), len(s.driver.launches)) == ((1, 1) if python else (0, 2))


def test_a_restored_context_whose_globals_moved_launches_here_with_its_words_moved(session):
    """A restore's module globals lie where the driver put them: the compiled path moves each
    parameter word that points into one (pointer arguments, pointers in by-value structs) by the
    rule the Python path applies (Relocations), and follows the moves as globals come and go."""
    from phos.snapshot.relocations import Relocations
    s = session
    k = add_function(s, 0x1000, "k", [(0, 8), (8, 4)])
    wide = add_function(s, 0x3000, "wide", [(0, 40)])
    s.driver.sizes[0x3000] = (40,)
    globals_ = {0x7000_0000: (0x9100_0000, 64), 0x7000_1000: (0x6000_0000, 4096), 0x7100_0000: (0x5000_0000, 256)}
    for app, (device, size) in globals_.items():
        s.space.adopt(device, size)             # as the restore's module load places them
        assert s.space.alias(app, device, size)
    words = [0x7000_0000, 0x7000_003F, 0x7000_0040, 0x7000_1FFF, 0x7100_0010, 0x6FFF_FFFF, 0]
    cases = [struct.pack("<5Q", *words[:5]), struct.pack("<5Q", *words[2:])]
    for params in cases:
        assert batch(s, record(wide, params)) == (0, "")
    reference = [np.frombuffer(p, np.uint64).copy() for p in cases]
    rel = Relocations((app, app + size, device) for app, (device, size) in globals_.items())
    for r in reference:
        rel.apply(r)
    assert [launch[6][0] for launch in s.driver.launches] == [r.tobytes() for r in reference]
    assert struct.unpack("<5Q", s.driver.launches[0][6][0])[:2] == (0x9100_0000, 0x9100_003F)
    assert s.python_launches == []
    # a word of 4 bytes is not a pointer: the parameter bytes past the last whole word stay
    assert batch(s, record(k, struct.pack("<QI", 0x7000_0008, 0x7000))) == (0, "")
    assert s.driver.launches[-1][6] == [struct.pack("<Q", 0x9100_0008), struct.pack("<I", 0x7000)]
    # a global that goes takes its move with it
    s.space.forget(0x9100_0000)
    assert batch(s, record(k, struct.pack("<QI", 0x7000_0008, 1))) == (0, "")
    assert s.driver.launches[-1][6][0] == struct.pack("<Q", 0x7000_0008)
    assert s.python_launches == []


def test_moved_ranges_out_of_order_are_refused(native):
    driver = StandInDriver({})
    launcher = native_launch.NativeLauncher(native, ctypes.cast(driver.pointer, ctypes.c_void_p).value, failure, ())
    u64 = ctypes.c_uint64 * 2
    assert native.phos_launcher_moves(launcher.handle, u64(0x2000, 0x1000), u64(0x2100, 0x1100), u64(1, 1), 2) == 1
    assert native.phos_launcher_moves(launcher.handle, u64(0x1000, 0x1080), u64(0x1100, 0x1100), u64(1, 1), 2) == 1
    assert native.phos_launcher_moves(launcher.handle, u64(0x1000, 0x1100), u64(0x1100, 0x1200), u64(1, 1), 2) == 0
    launcher.close()


def test_dropped_and_replaced_ids_are_forgotten(session):
    s = session
    k = add_function(s, 0x1000, "k", [(0, 8), (8, 4)])
    assert batch(s, record(k, bytes(12))) == (0, "")
    s.place(k, "function", SimpleNamespace(handle=0x2000, name="empty", params=[], size=0))   # a restore's
    assert batch(s, record(k, b"")) == (0, "")
    assert [launch[0] for launch in s.driver.launches] == [0x1000, 0x2000]
    s.drop(k)
    status, message = batch(s, record(k, b""))
    assert status == CUresult.CUDA_ERROR_INVALID_HANDLE and "is not a function of this context" in message
    assert len(s.driver.launches) == 2


def test_parameter_offsets_past_the_parameters_are_refused(native):
    driver = StandInDriver({})
    launcher = native_launch.NativeLauncher(native, ctypes.cast(driver.pointer, ctypes.c_void_p).value, failure, ())
    offsets = (ctypes.c_uint32 * 2)(0, 8)
    assert native.phos_launcher_function(launcher.handle, 7, 0x1000, 8, offsets, 2) == 1
    assert native.phos_launcher_function(launcher.handle, 7, 0x1000, 12, offsets, 2) == 0
    launcher.close()
