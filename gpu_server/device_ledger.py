"""Device memory that several worker processes hold together, each counting its own.

A DeviceLedger accounts one pool of bytes shared by the contexts of a server, each a worker
process of its own: the emu device's memory (gpu_server/backends/emu_memory.py), a tenant's quota on
every backend (PHOS_TENANT_QUOTA: one ledger directory per tenant, tenant_ledger), and the host
memory a tenant's workers hold for it (PHOS_TENANT_HOST_QUOTA: a twin ledger, host_ledger_dir).
"""
import contextlib
import fcntl
import hashlib
import os
import re
import secrets
import struct
import threading

from phos.schema.control import private_directory
from phos.schema.cuda_types import CudaError, CUresult

ENTRY = struct.Struct("<Q")   # a ledger entry: the bytes its worker holds

# What a charge past the ledger's capacity, and past a context's own quota, fail with (their
# fields: what, nbytes, free, capacity, total, held, quota); each user of a ledger names its settings.
FULL = "{what} of {nbytes} bytes does not fit in the {free} bytes free of the ledger's {capacity}"
OVER_QUOTA = "{what} of {nbytes} bytes exceeds this context's quota: it holds {held} of its {quota} bytes"

# A tenant's ledger directory is named by a digest of its identity, never the identity itself
# (a CURVE key, a user): the name is all a worker or an image needs to find the tenant's ledger.
TENANT_NAME = re.compile(r"[0-9a-f]{64}")
TENANT_FULL = ("{what} of {nbytes} bytes would pass this tenant's quota: its contexts on this server hold "
               "{total} of its {capacity} bytes (PHOS_TENANT_QUOTA)")
TENANT_HOST_FULL = ("{what} of {nbytes} bytes would pass this tenant's host memory quota: its contexts on this "
                    "server hold {total} of its {capacity} bytes of host memory (PHOS_TENANT_HOST_QUOTA)")


class DeviceLedger:
    """The device memory that the contexts of one server hold, each in a worker of its own.

    Every worker keeps the bytes it holds in a file of its own in the server's ledger directory,
    and holds an flock on that file for its whole life. The kernel drops the lock when the process
    ends, however it ends (SIGKILL too): a file nobody holds locked is a dead worker's, and a
    recount deletes it, which gives its memory back. The `.lock` file's flock makes every change
    one step for all the workers, and the file keeps their total, so that a charge that fits
    reads one number instead of every file. A worker changes the total before its own file when
    it charges, after it when it gives back: killed in between, it leaves the total too high,
    never too low, and a recount (when a charge does not fit, and for free()) makes it exact.
    Without a directory the ledger counts this process alone (an EmuMemory of its own, as the
    interpreter's tests make). full and over_quota: the messages of a charge that fails (FULL,
    OVER_QUOTA), naming the settings that set capacity and quota.
    """

    def __init__(self, capacity, directory=None, quota=0, full=FULL, over_quota=OVER_QUOTA):
        self.capacity, self.directory, self.quota = capacity, directory, quota
        self.full, self.over_quota = full, over_quota
        self.held = 0
        self._thread_lock = threading.Lock()     # flock does not part the threads of one process
        self._lock_fd = self._entry_fd = None
        self._entry = None
        if directory is not None:
            private_directory(directory, create=True)
            self._lock_fd = os.open(os.path.join(directory, ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            with self._locked():
                self._entry = f"{os.getpid()}.{secrets.token_hex(4)}"
                self._entry_fd = os.open(os.path.join(directory, self._entry),
                                         os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                fcntl.flock(self._entry_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._set_held(0)

    @contextlib.contextmanager
    def _locked(self):
        with self._thread_lock:
            if self._lock_fd is None:
                yield
                return
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    # -- under the lock ----------------------------------------------------------------------------
    def _set_held(self, held):
        self.held = held
        if self._entry_fd is not None:
            os.pwrite(self._entry_fd, ENTRY.pack(held), 0)

    def _total(self):
        """What the workers hold together, or more (see the class)."""
        if self._lock_fd is None:
            return self.held
        return self._read(self._lock_fd)

    def _set_total(self, total):
        if self._lock_fd is not None:
            os.pwrite(self._lock_fd, ENTRY.pack(max(total, 0)), 0)

    def _recount(self):
        """What the live workers hold together, exactly; deletes the entries of dead ones."""
        total = self.held
        if self.directory is not None:
            for name in os.listdir(self.directory):
                if not name.startswith(".") and name != self._entry:
                    total += self._held_by_live(os.path.join(self.directory, name))
        self._set_total(total)
        return total

    @classmethod
    def _held_by_live(cls, path):
        """The bytes an entry's worker holds, or 0 after deleting the entry when that worker is gone."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return 0
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:          # its worker holds it: alive
                return cls._read(fd)
            os.unlink(path)                  # nobody holds it: its worker died without closing it
            return 0
        finally:
            os.close(fd)

    @staticmethod
    def _read(fd):
        raw = os.pread(fd, ENTRY.size, 0)
        return ENTRY.unpack(raw)[0] if len(raw) == ENTRY.size else 0

    def _free(self, total):
        free = self.capacity - total
        return max(0, min(free, self.quota - self.held) if self.quota else free)

    # -- the ledger's operations -------------------------------------------------------------------
    def free(self):
        """The bytes this context could still take: what the device has free, within its quota."""
        with self._locked():
            return self._free(self._recount())

    def charge(self, nbytes, what="an allocation"):
        """Take nbytes for this context, or raise CUDA_ERROR_OUT_OF_MEMORY when they are not free."""
        with self._locked():
            if self.quota and self.held + nbytes > self.quota:
                raise CudaError(CUresult.CUDA_ERROR_OUT_OF_MEMORY, self.over_quota.format(
                    what=what, nbytes=nbytes, held=self.held, quota=self.quota))
            total = self._total()
            if total + nbytes > self.capacity:
                total = self._recount()
            if total + nbytes > self.capacity:
                raise CudaError(CUresult.CUDA_ERROR_OUT_OF_MEMORY, self.full.format(
                    what=what, nbytes=nbytes, free=self.capacity - total, capacity=self.capacity, total=total))
            self._set_total(total + nbytes)
            self._set_held(self.held + nbytes)

    def refund(self, nbytes):
        with self._locked():
            self._set_held(self.held - nbytes)
            self._set_total(self._total() - nbytes)

    def close(self):
        """Give back everything this context holds."""
        with self._locked():
            held = self.held
            if self._entry_fd is not None:
                os.unlink(os.path.join(self.directory, self._entry))
                os.close(self._entry_fd)
                self._entry_fd = None
            self.held = 0
            self._set_total(self._total() - held)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


# -- tenants (PHOS_TENANT_QUOTA) ---------------------------------------------------------------------
def tenant_name(client):
    """The name of a tenant's ledger directory: a digest of the client as the front end names it
    (frontend.py ASKER: "key <z85>", "uid <n>", or "" for a keyless TCP connection)."""
    return hashlib.sha256(b"phos-tenant\0" + client.encode()).hexdigest()


def check_tenant_name(name):
    """Raise CudaError unless name is one tenant_name gives (never a path: it names a directory)."""
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"{name!r:.80} is not a tenant's name")


def tenant_ledger(root, name, quota, full=TENANT_FULL):
    """This worker's share of tenant `name`'s ledger: its directory under root (schema/control.py
    tenant_ledger_dir, or host_ledger_dir of it for PHOS_TENANT_HOST_QUOTA), capacity the quota."""
    check_tenant_name(name)
    private_directory(root, create=True, what="tenant ledger directory")    # makedirs leaves parents' modes to umask
    return DeviceLedger(quota, os.path.join(root, name), full=full)


def host_ledger_dir(root):
    """Where, under a server's tenant ledgers (root), each tenant's host memory is accounted: a
    ledger of its own, since host and device memory are two resources (PHOS_TENANT_HOST_QUOTA)."""
    return os.path.join(root, "host")
