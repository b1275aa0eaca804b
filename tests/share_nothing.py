"""Servers that share nothing but the network: each in a mount namespace of its own, with its
own tmpfs on /dev/shm, /tmp and /run, its own CURVE keys and its own image key, listening on
tcp://127.0.0.1 (tests/e2e/test_handoff_net.py, perf/bench_handoff.py --via tcp). Needs
root's `unshare -m`; unshare_permitted() says why not."""
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import threading

from phos.base.mounts import private_mounts
from phos.stub_run import LocalServer, free_port_pair  # noqa: F401 (free_port_pair: the tests')

# Inside the server's new mount namespace: private tmpfs on /dev/shm, /tmp and /run (Python,
# phos and the keys' directory kept visible where they live there: private_mounts), its keys
# copied into its own /dev/shm, and an image key of its own; then the server ("$@").
def isolate(keys):
    """The script, for sh -c in a new mount namespace, that isolates a server keyed by `keys`."""
    return "\n".join(["set -e", *private_mounts(["/dev/shm", "/tmp", "/run"], also=[keys]),
                      "mkdir -m 700 /dev/shm/phos-private",
                      f"cp -r {shlex.quote(str(keys))} /dev/shm/phos-private/keys",
                      "head -c 32 /dev/urandom > /dev/shm/phos-private/image.key",
                      "chmod 600 /dev/shm/phos-private/image.key",
                      'exec "$@"'])
PRIVATE = "/dev/shm/phos-private"


def unshare_permitted():
    """None if this process may make mount namespaces, else why not."""
    try:
        r = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if r.returncode == 0 else r.stderr.decode().strip() or f"exit status {r.returncode}"


def keygen(directory):
    subprocess.run([sys.executable, "-m", "phos.cli", "keygen", str(directory)], check=True, capture_output=True)
    return directory


def key_pairs(a_keys, b_keys):
    """Keys for a handoff from A to B: A's client key (the caller's) admitted by B as a client and
    an admin, and A's server key by B's admin API (A calls B with it)."""
    keygen(a_keys)
    keygen(b_keys)
    for sub in ("clients", "admins"):
        shutil.copy(a_keys / "clients" / "client.key", b_keys / sub / "caller.key")
    shutil.copy(a_keys / "server.key", b_keys / "admins" / "server-a.key")


def start_isolated(backend, directory, keys, pool=1, extra=()):
    """A `phos server` in a namespace of its own, on a free tcp://127.0.0.1 port, with the keys in
    `keys`; extra: more of its arguments (paths in PRIVATE are its own)."""
    wrap = ["unshare", "-m", "--propagation", "private", "sh", "-c", isolate(keys), "sh"]
    return LocalServer(backend, directory, listen=f"tcp://127.0.0.1:{free_port_pair()}", pool=pool, wrap=wrap,
                       extra=("--auth-dir", f"{PRIVATE}/keys", "--image-key", f"{PRIVATE}/image.key", *extra))


class Relay:
    """The link between two servers, made visible: a TCP relay from 127.0.0.1:`port` to
    127.0.0.1:`to_port` that counts the bytes each connection carries toward `to_port`
    (carried, in the order they were accepted). cut_after: the first connection to carry more
    than that many bytes is reset there, both ways, as a link that fails mid-message."""

    def __init__(self, port, to_port, cut_after=None):
        self.to_port, self.cut_after = to_port, cut_after
        self.carried = []
        self.was_cut = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", port))
        threading.Thread(target=self.accept, daemon=True).start()

    def close(self):
        self.listener.close()

    def accept(self):
        while True:
            try:
                near, _ = self.listener.accept()
                far = socket.create_connection(("127.0.0.1", self.to_port))
            except OSError:
                return
            self.carried.append(0)
            threading.Thread(target=self.pump, args=(near, far, len(self.carried) - 1), daemon=True).start()
            threading.Thread(target=self.pump, args=(far, near, None), daemon=True).start()

    def pump(self, src, dst, counted):
        try:
            while data := src.recv(1 << 16):
                if counted is not None:
                    self.carried[counted] += len(data)
                    if self.cut_after is not None and self.carried[counted] > self.cut_after and not self.was_cut.is_set():
                        self.was_cut.set()
                        for s in (src, dst):
                            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                            s.close()      # a reset, not an orderly end
                        return
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            for s in (src, dst):
                s.close()

