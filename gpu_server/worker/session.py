"""A context's session: its handles, its staging area and mapped host memory, its tenant, and the
driver calls it executes (the call table is calls.py). One Session a worker; the worker's loop
(loop.py) hands it each call, and the snapshot engine steps through it (snapshot/engine.py)."""
import ctypes
import fcntl
import logging
import mmap
import os
import re
import stat

import numpy as np

from phos.gpu_server.address_space import check_base
from phos.base import settings
from phos.gpu_server.worker.calls import CONNECTION_CALLS, WORKER_CALLS
from phos.gpu_server.device_ledger import TENANT_HOST_FULL, check_tenant_name, host_ledger_dir, tenant_ledger
from phos.schema import wire
from phos.schema.cuda_types import STICKY, CudaError, CUresult
from phos.snapshot import engine
from phos.snapshot.image import token_digest

log = logging.getLogger("phos.worker")
PINNED_HOST_BYTES = settings.pinned_host_bytes()   # the client's pinned host memory a worker maps, at most
FIRST_HANDLE = 0x1000


class Session:
    """One context's state: backend, virtual handles, error state. The snapshot engine sees
    it as a SnapshotSession (snapshot/ops.py): through lookup, reach_global and the methods
    after drop."""

    def __init__(self, backend, ctx_id, token):
        self.backend, self.space = backend, backend.space
        self.ctx_id, self.token_digest = ctx_id, token_digest(token)
        self.checkpoint = None     # a snapshot.engine.Checkpoint while one runs
        self.restoring = None      # a snapshot.engine.Restore while contents load
        self.snapshotting = False  # either of them: calls must tell them what they touch
        self.objects = {}          # virtual id -> (kind, object)
        self.meta = {}             # virtual id -> extra facts kept for snapshots (module images)
        self.next_id = FIRST_HANDLE
        self.recovery = None       # a gpu_server.recovery.Recovery when the server takes recovery images
        self.globals_noted = {}    # {module id: {name: address}} of a recovery store restored from (module_load)
        self.limits = {}           # {CUlimit: value} the application set
        self.modules = None        # the server's ModuleCache, if it keeps module images
        self.sticky = None         # (status, message) that fails every later call
        self.deferred = None       # first failure of an asynchronous call since the last reply
        self.closing = False
        self.client = None         # (pid, uid) of the process that attached last, on this host (open_client_file)
        self.shm = None            # the client's staging area, when it shares our host
        self.box = None            # its mailbox (wire.Mailbox)
        self.host_ranges = {}      # the client's pinned host ranges we map: hostMap's id -> their bytes
        self.in_place = {}         # ... those the device reads and writes in place: id -> FixedMapping
        self.host_bytes = 0        # ... how many bytes they hold together
        self.tenant = None         # the name of the tenant whose quota its memory counts against (join_tenant)
        self.tenants = None        # (their ledgers' directory, PHOS_TENANT_QUOTA, PHOS_TENANT_HOST_QUOTA) when it has either
        self.host_ledger = None    # the tenant's host memory ledger (PHOS_TENANT_HOST_QUOTA), once it has joined
        self.host_held = 0         # the host memory held for the client: its staging area, pinned ranges, modules
        self.module_bytes = {}     # id() of a loaded module -> the host memory charged for it (load_module)

    def staging(self, offset, nbytes):
        """A range of the shared staging area, checked."""
        if self.shm is None:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, "no shared staging area is attached")
        if offset + nbytes > len(self.shm):
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"staging range {offset}+{nbytes} exceeds the {len(self.shm)}-byte area")
        return self.shm[offset:offset + nbytes]

    def map_staging(self, path, cookie, size):
        """Map the client's staging file if it is really theirs (map_client_file) and its tenant's
        host memory quota has room for it; else the client copies through the socket."""
        if size < wire.SLOTS_OFFSET:        # no room for the mailbox
            return False
        # a client attaching again: its earlier area goes when this one replaces it, so only the
        # growth is charged (a refusal keeps the earlier one)
        more = size - (len(self.shm) if self.shm is not None else 0)
        try:
            self.charge_host(max(more, 0), "a staging area")
        except CudaError as e:
            log.warning("context %d: its client's staging area is not mapped: %s", self.ctx_id, e.message)
            return False
        area = map_client_file(path, cookie, size, self.client)
        if area is None:
            self.refund_host(max(more, 0))
            return False
        if more < 0:
            self.refund_host(-more)
        self.shm = np.frombuffer(area, np.uint8)
        self.box = wire.Mailbox(self.shm)
        self.backend.register_host(self.shm)
        return True

    def map_host(self, rid, path, cookie, size, address=0):
        """Map the client's pinned host range `rid` (phos.capnp, "Pinned host memory"): its file,
        if it is really theirs (map_client_file), while we map PINNED_HOST_BYTES at most; the
        backend pins it. With `address` (memory the device reads and writes in place: managed,
        mapped host memory) it is mapped at that address, the client's own, and the backend makes
        it the device's there. None once mapped, else why not."""
        if not rid or rid in self.host_ranges:
            return f"pinned host range {rid} is 0 or mapped already"
        if not 0 < size <= PINNED_HOST_BYTES - self.host_bytes:
            return (f"{size} more bytes of pinned host memory would pass the {PINNED_HOST_BYTES} a worker maps "
                    f"(PHOS_PINNED_HOST_BYTES; {self.host_bytes} mapped)")
        try:
            self.charge_host(size, "a pinned host range")
        except CudaError as e:
            return e.message
        why = self._map_host(rid, path, cookie, size, address)
        if why is not None:
            self.refund_host(size)
        return why

    def _map_host(self, rid, path, cookie, size, address):
        if address:
            mapping = map_client_file_at(path, cookie, size, address, self.client)
            if isinstance(mapping, str):
                return mapping
            data = mapping.array()
            why = self.backend.map_device_host(data, address)
            if why is not None:
                del data
                mapping.close()
                return why
            self.in_place[rid] = mapping
        else:
            area = map_client_file(path, cookie, wire.PINNED_HEADER + size, self.client)
            if area is None:
                return f"{path!r} is not a pinned host file of this client's"
            data = np.frombuffer(area, np.uint8, size, wire.PINNED_HEADER)
            self.backend.register_host(data, whole=True)
        self.host_ranges[rid] = data
        self.host_bytes += size
        return None

    def unmap_host(self, rid):
        """The client freed pinned range `rid`: unmapped once the device's work that may use it is done."""
        data = self.host_ranges.get(rid)
        if data is None:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"pinned host range {rid} is not mapped for this context")
        self.backend.synchronize()
        del self.host_ranges[rid]
        self.host_bytes -= data.nbytes
        self.refund_host(data.nbytes)
        mapping = self.in_place.pop(rid, None)
        if mapping is None:
            self.backend.unregister_host(data)       # the mapping goes with the last reference to data
            return
        self.backend.unmap_device_host(data)
        del data
        mapping.close()

    # -- the host memory held for the client, charged to its tenant (PHOS_TENANT_HOST_QUOTA) --------
    def charge_host(self, nbytes, what):
        """Count nbytes more of host memory held for the client; CUDA_ERROR_OUT_OF_MEMORY, naming
        PHOS_TENANT_HOST_QUOTA, where they would pass its tenant's quota."""
        if self.host_ledger is not None:
            self.host_ledger.charge(nbytes, what)
        self.host_held += nbytes

    def refund_host(self, nbytes):
        self.host_held -= nbytes
        if self.host_ledger is not None:
            self.host_ledger.refund(nbytes)

    def load_module(self, image):
        """The backend's module of image, the host memory it holds (Backend.module_host_bytes: its
        image, kept for checkpoints, and on emu what its parse may take) charged first, so that a
        load past the tenant's quota is refused before it takes the memory; unload_module gives them back."""
        nbytes = self.backend.module_host_bytes(image)
        self.charge_host(nbytes, "a module load")
        try:
            module = self.backend.load_module(image)
        except BaseException:
            self.refund_host(nbytes)
            raise
        self.module_bytes[id(module)] = nbytes      # the module is held (objects) until unload_module
        return module

    def unload_module(self, module):
        self.backend.unload_module(module)
        self.refund_host(self.module_bytes.pop(id(module), 0))

    def pinned(self, rid, offset, nbytes):
        """Bytes [offset, offset + nbytes) of the client's pinned range `rid`, checked."""
        data = self.host_ranges.get(rid)
        if data is None:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"pinned host range {rid} is not mapped for this context")
        if offset > data.nbytes or nbytes > data.nbytes - offset:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE,
                            f"pinned range {offset}+{nbytes} exceeds the {data.nbytes} bytes of range {rid}")
        return data[offset:offset + nbytes]

    def add(self, kind, obj, **meta):
        hid, self.next_id = self.next_id, self.next_id + 1
        self.objects[hid] = (kind, obj)
        if meta:
            self.meta[hid] = meta
        return hid

    def lookup(self, kind, hid):
        found = self.objects.get(hid)
        if found is None or found[0] != kind:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_HANDLE, f"{hid:#x} is not a {kind} of this context")
        return found[1]

    def threads_at_work(self):
        """Whether a running checkpoint's or restore's threads have work to do."""
        job = self.checkpoint or self.restoring
        return job is not None and job.threads_at_work()

    def touch(self, ptr, nbytes, write=True, whole=False):
        """A call is about to access [ptr, ptr+nbytes) (whole: the allocation holding ptr).
        A restore loads it first; a checkpoint saves it first if the call writes it."""
        if self.restoring is not None:
            self.restoring.before_access(ptr, nbytes, whole)
        if write and self.checkpoint is not None:
            self.checkpoint.before_write(ptr, nbytes, whole)

    def reach_global(self, old, ptr, size, name):
        """Make the address the client knows a module global by (old) reach where the device
        put it now (ptr): the device places a module's globals itself, elsewhere in each
        process (AddressSpace.alias). False, with a warning, when another range holds old."""
        if old == ptr or self.space.alias(old, ptr, size):
            return True
        log.warning("context %d: global %s moved from %#x to %#x, and its old address is taken: the client's "
                    "pointers to it are stale", self.ctx_id, name, old, ptr)
        return False

    @property
    def watches_launches(self):
        """Whether a launch must say what it may touch before it runs (touch_kernel): while a
        restore loads on demand, or a checkpoint saves what calls write first. Not while one
        saves from the cut's device copy, which no launch can change."""
        return self.restoring is not None or self.checkpoint is not None and self.checkpoint.watches_writes

    def touch_kernel(self, fn, params):
        """A launch may write anywhere in each allocation its parameters point into, and in
        every global of its module (which it names without a pointer)."""
        if not self.watches_launches:
            return
        for ptr in engine.kernel_pointers(self, params):
            self.touch(ptr, 0, whole=True)
        for _, ptr, size in self.backend.module_globals(self.lookup("module", fn.module_id)):
            self.touch(self.space.to_app(ptr), size)
        if self.restoring is not None:       # and the allocations those globals point into
            for ptr in tuple(self.restoring.followed):
                self.touch(ptr, 0, whole=True)

    def drop(self, hid):
        self.objects.pop(hid, None)
        self.meta.pop(hid, None)
        if self.backend.launcher is not None:
            self.backend.launcher.forget(hid)

    # -- SnapshotSession (snapshot/ops.py): what the snapshot engine reads and changes
    def listing(self):
        return [(hid, kind, obj, self.meta.get(hid, {})) for hid, (kind, obj) in sorted(self.objects.items())]

    def note(self, hid, facts):
        self.meta.setdefault(hid, {}).update(facts)

    def place(self, hid, kind, obj, facts=None):
        self.objects[hid] = (kind, obj)
        if self.backend.launcher is not None:
            self.backend.launcher.forget(hid)
        if facts:
            self.meta[hid] = facts

    def state(self):
        status, message = self.sticky or (0, "")
        session = {"ctx": self.ctx_id, "token": self.token_digest, "next_id": self.next_id}
        if self.limits:
            session["limits"] = [[limit, value] for limit, value in sorted(self.limits.items())]
        if self.space.reserved:
            session["reserved"] = [[base, length] for base, length in sorted(self.space.reserved.items())]
        if self.tenant is not None:        # a restore of the image charges the same tenant
            session["tenant"] = self.tenant
        return session, {"status": int(status), "message": message}

    def join_tenant(self, name):
        """Count this context's allocations against tenant `name`'s quota from now on, if the
        server has one (the address space charges them); its images name the tenant either way."""
        if self.tenant is not None:
            raise CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE, "this context has its tenant already")
        check_tenant_name(name)
        if self.tenants is not None:
            root, quota, host_quota = self.tenants
            if quota > 0:
                ledger = tenant_ledger(root, name, quota)
                try:
                    self.space.charge_to(ledger)
                except CudaError:
                    ledger.close()
                    raise
            if host_quota > 0:
                host = tenant_ledger(host_ledger_dir(root), name, host_quota, full=TENANT_HOST_FULL)
                try:
                    host.charge(self.host_held, "the host memory held")
                except CudaError:
                    host.close()
                    if quota > 0:
                        self.space.ledger.close()
                        self.space.ledger = None
                    raise
                self.host_ledger = host
        if self.modules is not None:       # its loads by digest find only the images it sent itself
            self.modules = self.modules.view(name)
        self.tenant = name

    def take_base(self, base):
        """A restored context's addresses are where its image had them, on whichever device it
        lands (a handoff between devices keeps its pointers): move the empty range there."""
        if base != self.space.base:
            check_base(base)
            self.backend.rebase(base)
            self.space = self.backend.space

    def adopt(self, session, error):
        self.ctx_id, self.token_digest, self.next_id = session["ctx"], session["token"], session["next_id"]
        for base, length in session.get("reserved", []):     # around the mappings recreated in them
            self.space.adopt_reservation(base, length)
        for limit, value in session.get("limits", []):
            self.backend.set_limit(limit, value)
            self.limits[limit] = value
        self.sticky = (error["status"], error["message"]) if error["status"] else None

    def execute(self, name, args, payloads, last):
        """Run one call; returns (status, message, fields)."""
        if self.sticky:
            return (*self.sticky, {})
        if last and self.deferred and name not in CONNECTION_CALLS:
            deferred, self.deferred = self.deferred, None
            return (*deferred, {})
        handler = WORKER_CALLS.get(name)
        if handler is None:
            return CUresult.CUDA_ERROR_NOT_SUPPORTED, f"call {name!r} is not served by a context worker", {}
        try:
            return CUresult.CUDA_SUCCESS, "", handler(self, args, payloads) or {}
        except CudaError as e:
            status, message = int(e.status), f"{name}: {e.message}"
        except Exception as e:     # a bug of ours: fail the call loudly, keep serving
            log.exception("context %d: %s raised", self.ctx_id, name)
            status, message = int(CUresult.CUDA_ERROR_UNKNOWN), f"{name}: internal error: {type(e).__name__}: {e}"
        if status in STICKY:
            self.sticky = (status, message)
        elif not last and self.deferred is None:
            self.deferred = (status, message)
        return status, message, {}


# A client's file, as it names it: a memfd of its own process (schema/phos.capnp, "Pinned host memory").
CLIENT_FILE = re.compile(r"/proc/(\d+)/fd/(\d+)")
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)


def open_client_file(path, cookie, size, client):
    """A file a client made for us (its staging area, a pinned host range), opened read-write, if
    it is really theirs: a memfd of the client's process, /proc/PID/fd/N as it names it, of
    `size` bytes or more, sealed against shrinking (so that our mapping of it can never fault:
    SIGBUS would kill the worker), made by the client's user, starting with the random cookie the
    client sent (which only its maker knows). client: (pid, uid) of the connection that asked
    (SO_PEERCRED), whose pid replaces the one in the path (the kernel's word, right in any PID
    namespace); None over loopback TCP, where the name's pid stands and the memfd's name, seal
    and cookie alone vouch for it. Its descriptor, or None."""
    m = CLIENT_FILE.fullmatch(path)
    if m is None or len(cookie) < wire.COOKIE_BYTES or size <= 0:
        return None
    pid, uid = client if client and client[0] else (int(m.group(1)), None)
    try:
        # The link is followed, but only into that process's own descriptors; what it leads to must
        # then be a sealed memfd (below), so naming any other file (an O_PATH descriptor of a file
        # the client may not write, say) gets nothing. Non-blocking: a FIFO must not stall us.
        fd = os.open(f"/proc/{pid}/fd/{m.group(2)}", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError, OverflowError):
        return None
    try:
        st = os.fstat(fd)
        if (stat.S_ISREG(st.st_mode) and uid in (None, st.st_uid) and st.st_size >= size
                and os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:phos")
                and fcntl.fcntl(fd, fcntl.F_GET_SEALS) & F_SEAL_SHRINK and os.pread(fd, len(cookie), 0) == cookie):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def map_client_file(path, cookie, size, client):
    """Map `size` bytes of a client's file (open_client_file's checks). The mmap, or None."""
    fd = open_client_file(path, cookie, size, client)
    if fd is None:
        return None
    try:
        return mmap.mmap(fd, size)
    except (OSError, ValueError, OverflowError):
        return None
    finally:
        os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
MAP_FIXED_NOREPLACE = 0x100000     # Linux 4.17+; an older kernel takes it as a hint, which the check below catches


class FixedMapping:
    """`size` bytes of a client's file mapped at a chosen address (map_client_file_at)."""

    def __init__(self, address, size):
        self.address, self.size = address, size

    def array(self):
        return np.ctypeslib.as_array((ctypes.c_uint8 * self.size).from_address(self.address))

    def close(self):
        if self.address:
            _libc.munmap(self.address, self.size)
            self.address = 0


def map_client_file_at(path, cookie, size, address, client):
    """The application's bytes of a client's pinned host file (open_client_file's checks) mapped
    at `address`, the client's own address of them, so that pointers the application stored in
    them mean the same here and on the device. A FixedMapping, or why not."""
    page = mmap.PAGESIZE
    if address % page or not 0 < address < 1 << 47:
        return f"{address:#x} is not a page of the user address space"
    fd = open_client_file(path, cookie, wire.PINNED_HEADER + size, client)
    if fd is None:
        return f"{path!r} is not a pinned host file of this client's"
    try:
        got = _libc.mmap(address, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | MAP_FIXED_NOREPLACE,
                         fd, wire.PINNED_HEADER)
        errno = ctypes.get_errno()
    finally:
        os.close(fd)
    if got in (None, ctypes.c_void_p(-1).value):
        return (f"the worker cannot map {size} bytes at the application's address {address:#x}: "
                f"{os.strerror(errno)}")
    if got != address:
        _libc.munmap(got, size)
        return f"the worker cannot map {size} bytes at the application's address {address:#x}: the kernel placed them elsewhere"
    return FixedMapping(address, size)
