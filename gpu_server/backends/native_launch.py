"""The launchBatch hot path in C++ (gpu_server/native/launch_batch.cpp, in phos/base/native.py's
library), for a backend whose launches go to a driver's cuLaunchKernelEx.

calls.launch_batch offers each batch here first. run() answers False where the Python path
must take the batch, with nothing launched: a checkpoint or restore watching the launches
(Session.touch_kernel), or a record the native code refuses (malformed, a failed check, an id
that is not a function or stream of the context). A restored context whose module globals moved
stays here: the native side gets its moved ranges and translates the parameters' words as
AddressSpace.translate_words does. calls.run_launch then gives those records the meaning and the errors it
always has. The functions and streams batches name are registered here on first use and
forgotten when the context drops or replaces their ids (Session.drop, Session.place).
"""
import ctypes

import numpy as np

from phos.base import native
from phos.schema.cuda_types import STICKY, CudaError
from phos.schema.wire import read_launch_batch

LAUNCHED, UNKNOWN_FUNCTION, UNKNOWN_STREAM, REFUSED, DRIVER_ERROR = range(5)   # launch_batch.cpp's outcomes
_U64 = ctypes.c_uint64


def load(path=None):
    """The native library (phos/base/native.py) with the launcher's calls declared, or None where it
    was not built: every launch then takes the Python path."""
    lib = native.library(path)
    if lib is None:
        return None
    lib.phos_launcher_new.argtypes, lib.phos_launcher_new.restype = [ctypes.c_void_p], ctypes.c_void_p
    lib.phos_launcher_free.argtypes, lib.phos_launcher_free.restype = [ctypes.c_void_p], None
    lib.phos_launcher_function.argtypes = [ctypes.c_void_p, _U64, ctypes.c_void_p, ctypes.c_uint32,
                                           ctypes.POINTER(ctypes.c_uint32), ctypes.c_uint32]
    lib.phos_launcher_function.restype = ctypes.c_int
    lib.phos_launcher_stream.argtypes, lib.phos_launcher_stream.restype = [ctypes.c_void_p, _U64, ctypes.c_void_p], None
    lib.phos_launcher_forget.argtypes, lib.phos_launcher_forget.restype = [ctypes.c_void_p, _U64], None
    lib.phos_launcher_moves.argtypes = [ctypes.c_void_p, *[ctypes.POINTER(_U64)] * 3, _U64]
    lib.phos_launcher_moves.restype = ctypes.c_int
    lib.phos_launcher_run.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, _U64,
                                      ctypes.POINTER(_U64), ctypes.POINTER(_U64), ctypes.POINTER(_U64)]
    lib.phos_launcher_run.restype = ctypes.c_int
    return lib


class NativeLauncher:
    """One context's compiled launch path.

    launch_kernel_ex: the address of the driver's cuLaunchKernelEx (or of a stand-in with its
    signature). failure(err, what): the CudaError the driver's error err means for `what`, as
    the backend's Python launch would raise it. default_streams: the stream ids that mean the
    default stream (schema/wire.py, STREAM_ALIASES)."""

    def __init__(self, lib, launch_kernel_ex, failure, default_streams):
        self.lib, self.failure = lib, failure
        self.handle = lib.phos_launcher_new(launch_kernel_ex)
        self.functions = {}          # registered function id -> its backend Function (names errors)
        self.moves = None            # the address space's Relocations the native side has
        self.count, self.at, self.value = _U64(), _U64(), _U64()
        self.out = (ctypes.byref(self.count), ctypes.byref(self.at), ctypes.byref(self.value))
        for sid in default_streams:
            lib.phos_launcher_stream(self.handle, sid, None)

    def close(self):
        if self.handle:
            self.lib.phos_launcher_free(self.handle)
            self.handle = None

    def forget(self, hid):
        self.functions.pop(hid, None)
        self.lib.phos_launcher_forget(self.handle, hid)

    def run(self, s, blob):
        """Launch every record of blob (bytes) as calls.launch_batch would. False: nothing ran,
        the Python path must take it. A failed launch does not stop the later ones: the first
        failure is raised at the end; a sticky one is raised at once."""
        if s.watches_launches:
            return False
        moves = s.space.relocations()
        if moves is not self.moves and not self._send_moves(moves):
            return False
        blob = blob if isinstance(blob, bytes) else bytes(blob)      # ctypes passes bytes without a copy
        first, failed = 0, None
        while True:
            outcome = self.lib.phos_launcher_run(self.handle, blob, len(blob), first, *self.out)
            if outcome == LAUNCHED:
                break
            if outcome in (UNKNOWN_FUNCTION, UNKNOWN_STREAM):
                if not self._register(s, self.value.value, "function" if outcome == UNKNOWN_FUNCTION else "stream"):
                    return False
                continue
            if outcome != DRIVER_ERROR:
                return False
            at, n = self.at.value, self.count.value
            fn = self.functions[read_launch_batch(blob)[at][0]]
            e = self.failure(self.value.value, f"launch of {fn.name}")
            if e.status in STICKY:
                raise e
            failed = failed or CudaError(e.status, f"record {at + 1} of {n}: {e.message}")
            first = at + 1
        if failed is not None:
            raise failed
        return True

    def _send_moves(self, moves):
        """Give the native side the address space's moved ranges (None: there are none)."""
        ranges = (moves.starts, moves.ends, moves.shifts) if moves is not None else (np.zeros(0, np.uint64),) * 3
        arrays = [np.ascontiguousarray(a, np.uint64) for a in ranges]       # kept alive through the call
        pointers = [a.ctypes.data_as(ctypes.POINTER(_U64)) for a in arrays]
        if self.lib.phos_launcher_moves(self.handle, *pointers, len(arrays[0])):
            return False
        self.moves = moves
        return True

    def _register(self, s, hid, kind):
        """Tell the native side about the context's `kind` hid; False if it is none (the Python
        path then says so for its record)."""
        found = s.objects.get(hid)
        if found is None or found[0] != kind:
            return False
        obj = found[1]
        if kind == "stream":
            self.lib.phos_launcher_stream(self.handle, hid, int(obj))
            return True
        offsets = (ctypes.c_uint32 * max(len(obj.params), 1))(*(off for off, _ in obj.params))
        if self.lib.phos_launcher_function(self.handle, hid, int(obj.handle), obj.size, offsets, len(obj.params)):
            return False
        self.functions[hid] = obj
        return True
