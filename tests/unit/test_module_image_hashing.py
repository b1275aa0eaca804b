"""A checkpoint hashes a module's image once, and off its cut: the libraries PyTorch loads hold
tens of MB of module images, whose hashing in the cut paused the application 40 ms."""
import threading

import numpy as np

from phos.gpu_server.backends.emu import EmuBackend
from phos.gpu_server.worker.session import Session
from phos.snapshot import MemoryStore, read_image
from phos.snapshot import engine
from phos.snapshot.engine import Checkpoint, Restore
from ptx_helpers import compile_ptx


def test_module_images_are_hashed_off_the_cut_and_once(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))     # an image key of its own
    s = Session(EmuBackend(), 7, b"t" * 16)
    image = compile_ptx("vecadd.cu").encode()
    s.add("module", s.backend.load_module(image), image=image)
    ptr = s.backend.alloc(1 << 20)
    s.backend.htod(ptr, np.arange(1 << 18, dtype=np.uint32).tobytes(), None)
    hashed_on = []
    real = engine.fingerprint

    def spy(buf, *a):
        hashed_on.append(threading.current_thread())
        return real(buf, *a)

    monkeypatch.setattr(engine, "fingerprint", spy)
    store = MemoryStore()
    for name in ("a", "b"):
        cp = Checkpoint(s, store, name, parent="a" if name == "b" else None)
        cp.cut(1, paused=False)
        assert threading.main_thread() not in hashed_on, "the cut hashed the module's image itself"
        cp.finish(1)
    assert len(hashed_on) == 1, "the module's image was hashed more than once"
    modules = read_image(store, "b").modules
    assert len(modules) == 1 and modules[0]["image"] == real(image).hex()
    r = Restore(Session(EmuBackend(), 0, b"t" * 16), store, "b")
    r.recreate()
    r.start(full=True)
    r.wait()
    out = np.zeros(4, np.uint32)
    r.session.backend.dtoh(ptr, out.view(np.uint8), None)
    assert list(out) == [0, 1, 2, 3]
    assert [kind for _, kind, _, _ in r.session.listing()] == ["module"]      # the module came back too
