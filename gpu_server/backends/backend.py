"""What a context worker needs from a device: one interface, two backends.

`cuda` drives a real GPU through cuda-python; `emu` emulates one on the CPU. The
worker checks handles and pointers before it calls a backend, so backends trust
their arguments except for what only the device can know (kernel accesses).
"""
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from phos.snapshot.ops import SnapshotOps


@dataclass
class DeviceInfo:
    name: str
    uuid: bytes
    total_mem: int
    attributes: dict = field(default_factory=dict)   # CUdevice_attribute value -> int

    @property
    def compute_capability(self):
        return self.attributes[75], self.attributes[76]


FUNCTION_ATTRIBUTES = 16     # CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK .. _CLUSTER_SCHEDULING_POLICY_PREFERENCE


@dataclass
class Function:
    """A kernel as the worker sees it: the backend's handle and the parameter layout."""
    handle: object
    name: str
    params: list          # [(offset, size)] per parameter
    # CUfunction_attribute values 0 .. FUNCTION_ATTRIBUTES-1, as the device reports them
    # (registers, static shared memory, ...): a client answers cuFuncGetAttribute from them.
    attributes: tuple = ()
    set_attributes: dict = field(default_factory=dict)   # what the application set: {attribute: value}

    @property
    def param_bytes(self):
        """Size of the packed parameter buffer a launch must send."""
        return max((off + size for off, size in self.params), default=0)


@runtime_checkable
class Backend(Protocol):
    """What a context worker and the snapshot engine need of a device; EmuBackend
    (gpu_server/backends/emu.py) and CudaBackend (gpu_server/backends/cuda.py) implement it, and
    tests/unit/test_interfaces.py checks that they declare every member with its parameters.
    Addresses are device addresses inside `space`; streams and events are the backend's own
    objects (the worker maps handles to them); `stream` None is the default stream."""

    name: str
    """The backend's name, as `--backend` gives it and an image records it."""

    launcher: object
    """The compiled launch path that launchBatch offers its batches to first (a
    gpu_server/native_launch.NativeLauncher), or None: every launch goes through launch()."""

    pins_host_memory: bool
    """Whether host memory must be pinned for the device to copy it at full speed, and
    pinning is slow: a pre-started worker then prepares its snapshot copy buffers and pins
    a host store before it is handed out (snap.prepare, snap.pin)."""

    space: object
    """The context's AddressSpace (gpu_server/address_space.py): its allocations."""

    @property
    def snap(self) -> SnapshotOps:
        """The snapshot engine's device operations (snapshot/ops.py)."""

    @staticmethod
    def devices() -> list:
        """A DeviceInfo for each device this backend can open, by ordinal."""

    @staticmethod
    def driver_version() -> int:
        """The CUDA driver version it serves, as cuDriverGetVersion gives it."""

    @staticmethod
    def p2p_attribute(attribute, device, peer) -> int:
        """cuDeviceGetP2PAttribute: a CUdevice_P2PAttribute of the link from device to peer (two
        distinct ordinals of devices()); CudaError(CUDA_ERROR_INVALID_VALUE) for an unknown attribute."""

    def device_info(self) -> DeviceInfo:
        """The DeviceInfo of the device this context runs on."""

    def rebase(self, base) -> None:
        """Move the context's address range, nothing allocated in it yet, to base (a restored
        context's, from its image: a device's range, address_space.device_base); `space` is new."""

    def alloc(self, nbytes, at=None) -> int:
        """Allocate nbytes of device memory (at that address, for a restore); its address."""

    def free(self, ptr) -> None:
        """Free the allocation at ptr."""

    def mem_info(self) -> tuple:
        """(free, total) bytes of device memory."""

    def htod(self, dst, data, stream) -> None:
        """Copy a host buffer to device address dst, in order on stream."""

    def dtoh(self, src, out, stream) -> None:
        """Copy len(out) bytes from device address src into the host buffer out; done on return."""

    def register_host(self, buf, whole=False) -> None:
        """A host buffer the worker copies through often (the client's staging area): the
        backend may pin it. whole: memory the application allocated as pinned (a pinned host
        range, phos.capnp): pinned at once, as one range, since its copies go straight to the
        device (copy_pinned)."""

    def unregister_host(self, buf) -> None:
        """A buffer register_host(whole=True) pinned goes away: unpin it (no copy uses it any more)."""

    def map_device_host(self, buf, address) -> str | None:
        """The client's memory that kernels read and write in place (managed memory, mapped host
        memory): `buf`, mapped by the worker at `address`, the client's own address of it, becomes
        addressable by the device at that same address (and pinned, as register_host(whole=True)).
        None if it did, else why not."""

    def unmap_device_host(self, buf) -> None:
        """A buffer map_device_host took goes away (after the device's work)."""

    def copy_pinned(self, device, host, to_device, stream) -> None:
        """Copy between device address `device` and a host buffer registered whole, len(host)
        bytes, host->device if to_device, else device->host; queued on stream (None: the default
        stream) and returning at once: the copy is done once the stream's work before it is."""

    def dtod(self, dst, src, nbytes, stream) -> None:
        """Copy nbytes from device address src to dst, in order on stream."""

    def memset(self, dst, value, elem_size, count, stream) -> None:
        """Set count elements of elem_size bytes (1, 2 or 4) at dst to value."""

    def load_module(self, image):
        """Load a module (PTX, cubin or fatbin bytes); the backend's module object."""

    def module_host_bytes(self, image) -> int:
        """The host memory a module of image holds at most, its image included (the tenant's
        PHOS_TENANT_HOST_QUOTA is charged it before the load)."""

    def unload_module(self, module) -> None:
        """Unload a module and free its globals."""

    def module_globals(self, module) -> list:
        """[(name, device address, size)] of a module's globals."""

    def get_function(self, module, name) -> Function:
        """The kernel called name in module, as a Function; CudaError if there is none."""

    def get_global(self, module, name) -> tuple:
        """(device address, size) of the global called name in module; CudaError if none."""

    def launch(self, function, grid, block, shared_bytes, stream, params, options=0) -> None:
        """Launch a kernel with its packed parameter buffer, in order on stream.

        options: Launch.config's options (schema/wire.py: launch_cluster, LAUNCH_COOPERATIVE)."""

    def set_function_attribute(self, function, attribute, value) -> None:
        """cuFuncSetAttribute: a CUfunction_attribute the application may set (dynamic shared
        memory, carveout, cluster sizes)."""

    def get_limit(self, limit) -> int:
        """cuCtxGetLimit: a CUlimit's value; CudaError(CUDA_ERROR_UNSUPPORTED_LIMIT) for a limit
        the device does not have."""

    def set_limit(self, limit, value) -> None:
        """cuCtxSetLimit, with the driver's errors for a limit it lacks or a value it refuses."""

    def occupancy(self, function, query, a, b, flags, grid=0) -> tuple:
        """A cuOccupancy* answer for function: query, a, b and flags as FuncOccupancy
        (phos.capnp) names them; the u64s of the Result."""

    def tensor_map_encode(self, im2col, values) -> bytes:
        """The 128-byte CUtensorMap of cuTensorMapEncodeTiled (or Im2col, when im2col), from
        TensorMapEncode.args unpacked (schema/wire.py: TENSOR_MAP_TILED, TENSOR_MAP_IM2COL)."""

    def take_output(self) -> str:
        """What kernels printed since the last call (printf), and forget it."""

    def stream_create(self, flags, priority):
        """A new stream."""

    def stream_destroy(self, stream) -> None:
        """Destroy a stream once its work is done."""

    def stream_sync(self, stream) -> None:
        """Wait for the stream's work."""

    def stream_query(self, stream) -> bool:
        """Whether the stream's work is done."""

    def stream_wait_event(self, stream, event) -> None:
        """Make the stream's later work wait for the event."""

    def event_create(self, flags):
        """A new event."""

    def event_record(self, event, stream) -> None:
        """Record the event on stream."""

    def event_sync(self, event) -> None:
        """Wait for the event."""

    def event_query(self, event) -> bool:
        """Whether the event has happened."""

    def event_elapsed(self, start, end) -> float:
        """Milliseconds between two recorded events."""

    def event_destroy(self, event) -> None:
        """Destroy an event."""

    def synchronize(self) -> None:
        """Wait for the application's work (not a snapshot's background copy)."""

    def idle(self) -> bool:
        """Whether the application's work is done (what synchronize waits for)."""

    def native_synchronize(self) -> int | None:
        """The address of an `int f(void)` that waits as synchronize does while no snapshot
        runs, for the worker's compiled mailbox (gpu_server/worker/native_box.py); None: only
        synchronize() will do now."""

    def close(self) -> None:
        """Free the context's device memory and everything else it holds."""

