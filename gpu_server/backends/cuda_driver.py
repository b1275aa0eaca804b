"""The driver calls the cuda backend (cuda.py) and its snapshot operations (cuda_snapshot.py)
share: cuda-python's results unpacked into CudaError, and the driver functions they call through
ctypes on their hot paths, with the structures those take."""
import ctypes

from cuda.bindings import driver as cu

from phos.schema.cuda_types import CudaError, CUresult

DEVICEMAP = 0x02         # CU_MEMHOSTREGISTER_DEVICEMAP
PIN_PAUSE = 0.001        # host memory is pinned and unpinned a piece at a time, this long apart


def ok(result, what):
    """Unpack a cuda-python result tuple, raising CudaError on failure."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise failure(err, what)
    return rest[0] if len(rest) == 1 else tuple(rest) if rest else None


def failure(err, what):
    """The CudaError of the driver's error err in `what`."""
    return CudaError(int(err), f"{what} failed: {error_string(err)}")


def error_string(err):
    """The driver's words for an error: a ctypes call gives a bare int, cuda-python wants its enum."""
    try:
        return cu.cuGetErrorString(cu.CUresult(int(err)))[1].decode(errors="replace")
    except (ValueError, TypeError, AttributeError):
        return f"error {int(err)}"


def _driver_call(name, *argtypes):
    f = getattr(_libcuda, name)
    f.argtypes, f.restype = argtypes, ctypes.c_int
    return f


# Launches are the hot path: calling the driver through ctypes costs less than cuda-python's
# wrapper, and cuLaunchKernelEx with a prepared CUlaunchConfig less again than cuLaunchKernel:
# four arguments to convert instead of eleven (an application repeats a handful of launch shapes).
# A checkpoint's copies are the other: a dozen calls a batch, taken between the application's.
_libcuda = ctypes.CDLL("libcuda.so.1")
_P, _U64, _N = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
cuLaunchKernelEx = _driver_call("cuLaunchKernelEx", _P, _P, _P, _P)
cuMemcpyDtoDAsync = _driver_call("cuMemcpyDtoDAsync_v2", _U64, _U64, _N, _P)
cuMemcpyDtoHAsync = _driver_call("cuMemcpyDtoHAsync_v2", _P, _U64, _N, _P)
cuMemcpyHtoDAsync = _driver_call("cuMemcpyHtoDAsync_v2", _U64, _P, _N, _P)
cuEventRecord = _driver_call("cuEventRecord", _P, _P)
# A restore maps every allocation before the context is usable: through ctypes, with the
# properties cuda-python built passed by address (getPtr).
cuMemCreate = _driver_call("cuMemCreate", ctypes.POINTER(_U64), _N, _P, ctypes.c_ulonglong)
cuMemMap = _driver_call("cuMemMap", _U64, _N, _N, _U64, ctypes.c_ulonglong)
cuMemSetAccess = _driver_call("cuMemSetAccess", _U64, _N, _P, _N)
cuMemUnmap = _driver_call("cuMemUnmap", _U64, _N)
cuMemRelease = _driver_call("cuMemRelease", _U64)
cuEventQuery = _driver_call("cuEventQuery", _P)
cuStreamQuery = _driver_call("cuStreamQuery", _P)      # a synchronize polls it while a checkpoint runs
cuCtxSynchronize = _driver_call("cuCtxSynchronize")     # the sync round trip's call: quicker through ctypes
CTX_SYNCHRONIZE_ADDRESS = ctypes.cast(cuCtxSynchronize, ctypes.c_void_p).value     # ... and native_box's
cuOccupancyMaxActiveClusters = _driver_call("cuOccupancyMaxActiveClusters", _P, _P, _P)
# The tensor maps a client's libraries encode for the device (the format is the driver's own).
_I, _UI = ctypes.c_int, ctypes.c_uint
cuTensorMapEncodeTiled = _driver_call("cuTensorMapEncodeTiled", _P, _I, _UI, _U64, _P, _P, _P, _P, _I, _I, _I, _I)
cuTensorMapEncodeIm2col = _driver_call("cuTensorMapEncodeIm2col", _P, _I, _UI, _U64, _P, _P, _P, _P, _UI, _UI, _P,
                                       _I, _I, _I, _I)


def check(err, what):
    """Raise CudaError for a failed ctypes driver call."""
    if err:
        ok((err,), what)


def ready(err, what):
    """A query's answer: False while the device is still at it, True once done; an error raises."""
    if int(err) == CUresult.CUDA_ERROR_NOT_READY:
        return False
    check(int(err), what)
    return True


class LaunchConfig(ctypes.Structure):      # CUlaunchConfig (cuda.h)
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


class LaunchAttribute(ctypes.Structure):   # CUlaunchAttribute: an id, then a 64-byte value union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]
