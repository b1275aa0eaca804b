"""The devices a worker drives: the declared interface (backend.py), the H200 through the
driver (cuda.py, cuda_snapshot.py) and the emulated device (emu*.py, ptx/), and what they share
(the staging layout, host memory). load_backend: the one way to pick one by name."""


def load_backend(name):
    """The backend class for a name; imported lazily so `emu` never needs cuda-python."""
    if name == "emu":
        from phos.gpu_server.backends.emu import EmuBackend
        return EmuBackend
    if name == "cuda":
        from phos.gpu_server.backends.cuda import CudaBackend
        return CudaBackend
    raise ValueError(f"unknown backend {name!r}: choose 'cuda' or 'emu'")
