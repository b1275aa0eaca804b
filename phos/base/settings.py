"""Every PHOS_* environment variable: its name, type, default, who reads it and what it means.

One declaration a variable, and one helper (Setting.__call__) that reads them all. A module
that wants a value at import reads it then (`CONNECT_TIMEOUT = settings.connect_timeout()`);
one that must see a change reads it at call time (the client reads PHOS_SERVER again when it
looks for a lost context). An empty value counts as unset. The native stub reads its own
variables in client_stub/native/settings.cpp (its Settings struct): the table below declares
those too, so that README.md's "Settings" table (`python -m phos.base.settings` prints it;
tests/unit/test_settings.py checks it) lists every variable once, with the side that reads it.

Light on purpose: stdlib only, imported by the client, the server and the `phos` command.
"""
import functools
import os
import re
from typing import Any, Callable, NamedTuple

# Who reads a variable: the Python client (client_stub), the native stub (client_stub/native),
# the server (front end, workers, backends, snapshot engine), the `phos` command line.
CLIENT, STUB, SERVER, CLI = "client", "stub", "server", "cli"


def socket_directory():
    """The user's own directory for a server's sockets: /run/phos for root, else
    $XDG_RUNTIME_DIR/phos, else /tmp/phos-UID (schema/phos.capnp, `defaultSocket`; the stub's
    settings.cpp follows the same rule). The server makes it 0700 and refuses one another user owns."""
    if os.geteuid() == 0:
        return "/run/phos"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(runtime, "phos") if runtime else f"/tmp/phos-{os.geteuid()}"


@functools.lru_cache(maxsize=None)
def default_socket():
    """schema/phos.capnp's `defaultSocket`, read from the schema's text (not through pycapnp,
    which this module does not import), as the native stub reads it through the generated header."""
    from importlib.resources import files
    text = files("phos.schema").joinpath("phos.capnp").read_text()
    m = re.search(r'^const defaultSocket :Text = "([^"]*)";', text, re.M)
    if m is None:
        raise RuntimeError("schema/phos.capnp declares no `const defaultSocket :Text`")
    return m.group(1)


def default_server():
    """The server address when PHOS_SERVER is unset: `defaultSocket` in socket_directory()."""
    return f"ipc://{socket_directory()}/{default_socket()}"


def _spin_default():
    # Spinning beats a wake-up where cores are plentiful; on small machines it starves the peer.
    return 1000.0 if (os.cpu_count() or 1) > 4 else 0.0


def _copy_threads_default():
    # The stub's (client_stub/native/settings.cpp): a few threads copy where one falls short; a core
    # is left to the worker on the same host.
    return min(4, max(1, (os.cpu_count() or 1) - 1))


def _handoff_connections_default():
    # Each connection encrypts on one core of the source and decrypts on one of the target's;
    # half the cores leaves the others to verify and store the chunks.
    return max(2, min(8, (os.cpu_count() or 1) // 2))


def _image_key_default():
    """The user's image key: in $XDG_CONFIG_HOME/phos, else ~/.config/phos, kept across reboots
    (a runtime directory is not), so that the user's servers restore each other's images."""
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(config, "phos", "image.key")


def _stub_dir_default():
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "stub")   # phos/stub


def tristate(raw):
    """"1": on, "0": off, anything else: automatic (None)."""
    return True if raw == "1" else False if raw == "0" else None


def present(raw):
    """On for any (non-empty) value."""
    return True


MOST_HOLD = 0.95      # the largest share of the time a worker may hold its client's calls


def hold_share(raw):
    """A share of the time, 0 to MOST_HOLD (a worker answers its client for the rest)."""
    value = float(raw)
    if not 0.0 <= value <= MOST_HOLD:
        raise ValueError(raw)
    return value


def positive_int(raw):
    value = int(raw)
    if value < 1:
        raise ValueError(raw)
    return value


class Setting(NamedTuple):
    name: str
    type: Callable[[str], Any]     # parses the variable's text
    default: Any                   # the value when unset (a callable: computed when read)
    readers: str                   # CLIENT, STUB, SERVER, CLI, comma-separated
    meaning: str                   # one line, for README.md's table
    shown: str = ""                # the default as the table shows it, where str(default) won't do

    def raw(self):
        """The variable's text, or None when unset (or empty)."""
        return os.environ.get(self.name) or None

    def __call__(self):
        """The value now, typed; the default when unset. Raises ValueError naming the variable."""
        raw = self.raw()
        if raw is None:
            return self.default() if callable(self.default) else self.default
        try:
            return self.type(raw)
        except ValueError:
            raise ValueError(f"{self.name}={raw!r}: not a valid {getattr(self.type, '__name__', 'value')}") from None

    def default_text(self):
        if self.shown:
            return self.shown
        d = self.default() if callable(self.default) else self.default
        return "unset" if d is None else f"`{d}`" if isinstance(d, str) else f"{d:g}" if isinstance(d, float) else str(d)


TABLE = []


def _declare(name, type, default, readers, meaning, shown=""):
    setting = Setting(name, type, default, readers, meaning, shown)
    TABLE.append(setting)
    return setting


# -- where the server is, and how a client talks to it ------------------------------------------
server = _declare("PHOS_SERVER", str, default_server, f"{CLIENT}, {STUB}, {CLI}",
                  "the front end's address; clients read it again when they look for a lost context; "
                  "`phos server --listen` and the admin commands default to it (`phos run`: else a local server); "
                  "the default is `phos.sock` in the user's socket directory: /run/phos for root, else "
                  "$XDG_RUNTIME_DIR/phos, else /tmp/phos-UID", shown="ipc:///run/phos/phos.sock (root)")
standby = _declare("PHOS_STANDBY", str, "", f"{CLIENT}, {STUB}",
                   "the server to ask for a lost context after PHOS_SERVER (default: the standby attach named)",
                   shown="unset")
server_key = _declare("PHOS_SERVER_KEY", str, None, f"{CLIENT}, {STUB}, {CLI}",
                      "CURVE: the server's public key file (`phos keygen`); the `phos` admin commands use it "
                      "for a tcp:// server's admin API; the native stub loads libsodium.so.23 for CURVE, its own "
                      "copy in phos/stub first")
client_key = _declare("PHOS_CLIENT_KEY", str, None, f"{CLIENT}, {STUB}, {CLI}",
                      "CURVE: the client's secret key file, needed with PHOS_SERVER_KEY (for the admin API, "
                      "its public key must be in the server's admins/)")
connect_timeout = _declare("PHOS_CONNECT_TIMEOUT", float, 5.0, f"{CLIENT}, {STUB}",
                           "seconds to wait for the answer to hello and attach")
gone_timeout = _declare("PHOS_GONE_TIMEOUT", float, 10.0, f"{CLIENT}, {STUB}",
                        "seconds disconnected from a server before a call fails")
reattach_timeout = _declare("PHOS_REATTACH_TIMEOUT", float, 60.0, f"{CLIENT}, {STUB}",
                            "seconds a client looks for a context whose worker went away (restored by a "
                            "server) before the waiting call fails")
log_calls = _declare("PHOS_LOG_CALLS", int, 1 << 16, f"{CLIENT}, {STUB}",
                     "the replay log holds this many calls (with recovery: then it asks for an image)")
log_bytes = _declare("PHOS_LOG_BYTES", int, 256 << 20, f"{CLIENT}, {STUB}",
                     "... and this many bytes of host data", shown="268435456 (256 MiB)")
spin_us = _declare("PHOS_SPIN_US", float, _spin_default, f"{CLIENT}, {STUB}, {SERVER}",
                   "microseconds a client spins for a reply, and a worker for the next message, before sleeping",
                   shown="1000 with more than 4 cores, else 0")
staging = _declare("PHOS_STAGING", tristate, None, f"{CLIENT}, {STUB}",
                   "`1`: offer the worker a shared staging area (bulk copies, mailbox) always; `0`: never; "
                   "unset: when it is reached over ipc:// or tcp://127.x", shown="unset (automatic)")
verbose = _declare("PHOS_VERBOSE", present, False, f"{CLIENT}, {STUB}",
                   "say why calls fail (client: any value; stub: a non-zero number, which also reports "
                   "connections and staging statistics and, per context, the synchronous calls the program "
                   "waited for longest; `2`: the stub also names every driver call that "
                   "NVIDIA's runtime and libraries resolve through cuGetProcAddress, as it is made, and any "
                   "call of an export-table slot phos does not know)", shown="unset")


def use_client_keys(server_key, client_key):
    """Make this process a client with these key files (what PHOS_SERVER_KEY and PHOS_CLIENT_KEY
    name), for the clients it makes from now on: a pool's server actor, say."""
    os.environ["PHOS_SERVER_KEY"], os.environ["PHOS_CLIENT_KEY"] = server_key, client_key


# -- the native stub alone ------------------------------------------------------------------------
debug = _declare("PHOS_DEBUG", present, False, STUB, "as PHOS_VERBOSE (a non-zero number)", shown="unset")
mailbox = _declare("PHOS_MAILBOX", tristate, None, STUB,
                   "synchronous calls through the staging area's mailbox: `1` always, `0` never, unset: while "
                   "the stub spins and the worker is awake", shown="unset (automatic)")
batch_calls = _declare("PHOS_BATCH_CALLS", int, 64, STUB,
                       "send a batch of asynchronous calls at this many calls (at most phos.capnp's maxRequestCalls, 4096)")
batch_bytes = _declare("PHOS_BATCH_BYTES", int, 1 << 20, STUB, "... or this many payload bytes",
                          shown="1048576 (1 MiB)")
batch_age_us = _declare("PHOS_BATCH_AGE_US", int, 1000, STUB, "... or when its first call is this many microseconds old; "
                        "after a call that waited for its answer (the device may be idle), 50 µs, doubling each batch up to this")
inline_copy_max = _declare("PHOS_INLINE_COPY_MAX", int, 64 << 10, STUB,
                           "host-to-device copies up to this many bytes are captured and sent asynchronously")
copy_threads = _declare("PHOS_COPY_THREADS", int, _copy_threads_default, STUB,
                        "threads that copy a staged copy's bytes between the application's memory and the staging "
                        "area (4 MiB and more at once), the calling thread one of them, the others started at the "
                        "first such copy; `0` or `1`: the calling thread alone",
                        shown="the cores less one, 1 to 4")
exit_timeout = _declare("PHOS_EXIT_TIMEOUT", float, 10.0, STUB,
                        "seconds the stub waits at exit for each context's ctxDestroy")

# -- the server ---------------------------------------------------------------------------------
pool = _declare("PHOS_POOL", int, 1, f"{SERVER}, {CLI}",
                "workers kept started, ready for a new context or a restore (`phos server --pool`'s default)")
max_contexts = _declare("PHOS_MAX_CONTEXTS", int, 64, SERVER,
                        "contexts a server holds at once: a cuCtxCreate beyond fails with CUDA_ERROR_OUT_OF_MEMORY "
                        "(each is a worker process; 0: no limit)")
max_contexts_per_client = _declare("PHOS_MAX_CONTEXTS_PER_CLIENT", int, 32, SERVER,
                                   "contexts one client holds at once on a server, a client being a CURVE key, "
                                   "else the local user of an ipc:// or loopback tcp:// connection: a cuCtxCreate "
                                   "beyond fails with CUDA_ERROR_OUT_OF_MEMORY (0: no limit)")
tenant_quota = _declare("PHOS_TENANT_QUOTA", int, 0, SERVER,
                        "the bytes of device memory all the contexts of one tenant may hold together on a server, "
                        "on every backend, a tenant being a client as PHOS_MAX_CONTEXTS_PER_CLIENT counts them: an "
                        "allocation beyond fails with CUDA_ERROR_OUT_OF_MEMORY, and cuMemGetInfo reports no more "
                        "free than the quota leaves (0: no quota)")
tenant_host_quota = _declare("PHOS_TENANT_HOST_QUOTA", int, 0, SERVER,
                             "the bytes of host memory all the contexts of one tenant (as PHOS_TENANT_QUOTA counts "
                             "them) may hold together on a server: the staging areas and pinned host ranges their "
                             "workers map and the modules they keep loaded (on emu, what a module's parse may take "
                             "as well). Past it a module load fails with CUDA_ERROR_OUT_OF_MEMORY, and a staging "
                             "area or a pinned range stays the client's own, its copies going through the socket "
                             "or the staging area (0: no quota)")
worker_start_timeout = _declare("PHOS_WORKER_START_TIMEOUT", float, 60.0, SERVER,
                                "seconds the front end waits for a worker to start")
attach_timeout = _declare("PHOS_ATTACH_TIMEOUT", float, 30.0, SERVER,
                          "seconds a new context waits for its client's attach before it is freed")
orphan_grace = _declare("PHOS_ORPHAN_GRACE", float, 2.0, SERVER,
                        "seconds a context stays without a client before it is freed")
restore_grace = _declare("PHOS_RESTORE_GRACE", float, 60.0, SERVER,
                         "seconds a restored context waits for its client to re-attach before it is freed "
                         "(was read from PHOS_REATTACH_TIMEOUT, now the client's alone)")
log_level = _declare("PHOS_LOG", str, "WARNING", f"{SERVER}, {CLI}",
                     "the server's and its workers' log level (`phos server --log-level`'s default)")
switch_us = _declare("PHOS_SWITCH_US", float, 200.0, SERVER,
                     "a worker's interpreter switch interval in microseconds (sys.setswitchinterval)")
recovery_paused_bytes = _declare("PHOS_RECOVERY_PAUSED_BYTES", int, 256 << 20, SERVER,
                                  "a recovery image is taken with the application paused when it should copy at "
                                  "most this many bytes (what the previous one copied; the first: the context's "
                                  "bytes), else concurrently (0: always concurrently)", shown="268435456 (256 MiB)")
native_launch = _declare("PHOS_NATIVE_LAUNCH", int, 1, SERVER,
                         "a cuda worker launches a launchBatch's kernels through its compiled path "
                         "(libphos_server.so beside the stub) where it was built (0: through Python always)")
native_box = _declare("PHOS_NATIVE_BOX", int, 1, SERVER,
                      "a worker answers its client's plain synchronizes in the mailbox through its compiled path "
                      "(libphos_server.so beside the stub) where it was built, while nothing else goes on in the "
                      "context (0: through Python always)")
checkpoint_device_copy = _declare("PHOS_CHECKPOINT_DEVICE_COPY", int, 1, SERVER,
                                  "a concurrent checkpoint first copies the context on the device, where the device has "
                                  "room, and saves from that copy: the application waits for that copy only, not for "
                                  "copy-on-write saves (0: copy-on-write always)")
profile_dir = _declare("PHOS_PROFILE_DIR", str, None, SERVER,
                       "each worker writes a cProfile file per checkpoint into this directory")
profile_workers = _declare("PHOS_PROFILE_WORKERS", present, False, SERVER,
                          "with PHOS_PROFILE_DIR, each worker profiles its whole serving loop into DIR/worker-PID.prof "
                          "instead of each checkpoint apart", shown="unset")
trace_seconds = _declare("PHOS_TRACE_SECONDS", float, 0.03, SERVER,
                         "a checkpoint traces its steps this many seconds from the cut (1: its whole copy)")
module_cache_bytes = _declare("PHOS_MODULE_CACHE_BYTES", int, 4 << 30, SERVER,
                              "the bytes of module images a server keeps on disk for its clients, beside its "
                              "socket (0: none kept)", shown="4294967296 (4 GiB)")
pinned_host_bytes = _declare("PHOS_PINNED_HOST_BYTES", int, 32 << 30, SERVER,
                             "the bytes of its client's pinned host memory a context's worker maps (on one host: "
                             "copies from and to it then travel as references); past them, the client's pinned "
                             "memory stays its own and its copies go through the staging area",
                             shown="34359738368 (32 GiB)")
image_key = _declare("PHOS_IMAGE_KEY", str, _image_key_default, f"{SERVER}, {CLI}",
                     "the file of the key that signs every image's manifest (HMAC-SHA256) and that a restore "
                     "checks it with (`phos server --image-key`'s default; `phos image inspect` reads with it): "
                     "servers sharing it restore each other's images; the default one is made (mode 0600) on first use",
                     shown="$XDG_CONFIG_HOME/phos/image.key, else ~/.config/phos/image.key")
criu = _declare("PHOS_CRIU", str, "", CLI,
                "the criu binary (CRIU 4 or newer) that whole-process checkpoints, restores and migrations "
                "run (`phos checkpoint --pid`); unset: the set-up's, under PHOS_PREFIX, else criu on the PATH")
prefix = _declare("PHOS_PREFIX", str, "/opt/phos", CLI,
                  "where scripts/setup.sh installs what Debian's packages lack (CRIU 4, built from Debian's source "
                  "archive where the system's criu is older), and where phos looks for it")
handoff_connections = _declare("PHOS_HANDOFF_CONNECTIONS", positive_int, _handoff_connections_default, SERVER,
                                "connections a handoff to a tcp:// server sends its rounds' chunks on at once, "
                                "ZeroMQ encrypting each on a core of its own; a server's network admin API decrypts "
                                "this many connections at once (its I/O threads)",
                                shown="half the cores, at least 2 and at most 8")
handoff_throttle = _declare("PHOS_HANDOFF_THROTTLE", hold_share, 0.9, SERVER,
                             "the largest share of the time a handoff may hold the application's calls when its "
                             "pre-copy rounds do not shrink (the application writes about as fast as the rounds "
                             "travel): then the last round, the downtime, would be large; 0: never hold them")
emu_devices = _declare("PHOS_EMU_DEVICES", int, 1, SERVER,
                       "how many devices the emu backend has, each with a name, a UUID and PHOS_EMU_MEMORY bytes of "
                       "its own (`phos server --devices` picks those a server serves)")
emu_memory = _declare("PHOS_EMU_MEMORY", int, 16 << 30, SERVER,
                      "each emu device's memory in bytes, at most its share of what the host's memory can back "
                      "(cgroup limits included, less an eighth or 512 MiB for the server's own processes)",
                        shown="17179869184 (16 GiB)")
emu_context_quota = _declare("PHOS_EMU_CONTEXT_QUOTA", int, 0, SERVER,
                             "the bytes of emu device memory one context may hold (PHOS_EMU_MEMORY's bytes are "
                             "shared by all the contexts of a device; 0: no quota of its own)")
emu_launch_timeout = _declare("PHOS_EMU_LAUNCH_TIMEOUT", float, 60.0, SERVER,
                              "seconds an emu kernel may run: a launch running longer is stopped and fails with "
                              "CUDA_ERROR_LAUNCH_TIMEOUT (0: no limit)")
emu_module_load_timeout = _declare("PHOS_EMU_MODULE_LOAD_TIMEOUT", float, 20.0, SERVER,
                                   "seconds loading one module (parsing its PTX, placing its globals) may take on "
                                   "emu: a load taking longer is refused with CUDA_ERROR_INVALID_PTX (0: no limit)")
emu_compiler = _declare("PHOS_EMU_COMPILER", lambda raw: {"1": True, "0": False}[raw.strip()], True, SERVER,
                        "1: emu kernels run as native code compiled from their PTX (C through gcc), those the "
                        "compiler cannot translate in the interpreter; 0: every kernel in the PTX interpreter")
emu_kernel_cache = _declare("PHOS_EMU_KERNEL_CACHE", str, "", SERVER,
                            "the directory of the emu's compiled kernels, by digest, shared by its processes",
                            shown="phos-emu-kernels-UID in the temporary directory")


# -- the `phos` command line --------------------------------------------------------------------
stub_dir = _declare("PHOS_STUB_DIR", str, _stub_dir_default, CLI,
                    "where `phos run` finds the native stub (when phos is installed away from the checkout "
                    "that built it)", shown="phos/stub")
server_start_timeout = _declare("PHOS_SERVER_START_TIMEOUT", float, 60.0, CLI,
                                "seconds `phos run` waits for the local server it starts")

BY_NAME = {s.name: s for s in TABLE}


def markdown_table():
    """README.md's table of settings, generated from TABLE (tests/unit/test_settings.py checks it)."""
    lines = ["| Variable | Default | Read by | Meaning |", "|---|---|---|---|"]
    lines += [f"| `{s.name}` | {s.default_text()} | {s.readers} | {s.meaning} |" for s in TABLE]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
