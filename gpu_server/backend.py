"""What a context worker needs from a device: one interface, two backends.

`cuda` drives a real GPU through cuda-python; `emu` emulates one on the CPU. The
worker checks handles and pointers before it calls a backend, so backends trust
their arguments except for what only the device can know (kernel accesses).
"""
from dataclasses import dataclass, field


@dataclass
class DeviceInfo:
    name: str
    uuid: bytes
    total_mem: int
    attributes: dict = field(default_factory=dict)   # CUdevice_attribute value -> int

    @property
    def compute_capability(self):
        return self.attributes[75], self.attributes[76]


@dataclass
class Function:
    """A kernel as the worker sees it: the backend's handle and the parameter layout."""
    handle: object
    name: str
    params: list          # [(offset, size)] per parameter

    @property
    def param_bytes(self):
        """Size of the packed parameter buffer a launch must send."""
        return max((off + size for off, size in self.params), default=0)


def load_backend(name):
    """The backend class for a name; imported lazily so `emu` never needs cuda-python."""
    if name == "emu":
        from phos.gpu_server.emu import EmuBackend
        return EmuBackend
    if name == "cuda":
        from phos.gpu_server.cuda import CudaBackend
        return CudaBackend
    raise ValueError(f"unknown backend {name!r}: choose 'cuda' or 'emu'")
