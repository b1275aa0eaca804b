"""The server's native hot paths (gpu_server/native/*.cpp), built beside the stub as
libphos_server.so (`make -C client_stub/native`, PHOS_STUB_DIR): the worker's launch batches
(gpu_server/backends/native_launch.py), its mailbox's synchronizes (gpu_server/worker/native_box.py) and pfp1
fingerprints on the host (snapshot/fingerprint.py).

Loaded once. Where it was not built, library() is None and each caller takes its Python path.
ctypes lets the interpreter's lock go for each call into it.
"""
import ctypes
import logging
import os

from phos.base import settings

log = logging.getLogger("phos.native")
LIBRARY = "libphos_server.so"
_loaded = {}


def library(path=None):
    """The library at path (default: beside the stub), or None where it cannot be loaded."""
    path = path or os.path.join(settings.stub_dir(), LIBRARY)
    if path not in _loaded:
        try:
            _loaded[path] = ctypes.CDLL(path)
        except OSError as e:
            log.info("no native library (%s): Python paths instead", e)
            _loaded[path] = None
    return _loaded[path]


def address(symbol):
    """The address of the library's function `symbol` (to hand to compiled code as a callback),
    or None where the library was not built."""
    lib = library()
    return None if lib is None else ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
