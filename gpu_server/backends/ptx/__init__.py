"""PTX for the emu backend: parse a module, launch its kernels on EmuMemory."""
from phos.gpu_server.backends.ptx.interp import (Global, Kernel, PtxModule, TRAP_STATUS, parse_module)

__all__ = ['parse_module', 'PtxModule', 'Kernel', 'Global', 'TRAP_STATUS']
