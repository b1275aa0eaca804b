"""The CURVE clients a server admits: the public key files in a directory (`phos keygen`'s
clients/), which the front end and every worker check alike.

Read again whenever the directory changes, so that removing a key's file revokes it: new
connections with it fail their handshake (ZAP, through `admits`), and the front end and the
workers end the sessions that authenticated with it (`still_admitted`).
"""
import logging
import os
import socket
import struct

import zmq.auth

log = logging.getLogger("phos.auth")


class ClientKeys:
    def __init__(self, directory):
        self.directory = directory
        self.stamp = None         # the directory's (mtime_ns, inode) when last read
        self.keys = frozenset()

    def _refresh(self):
        try:
            st = os.stat(self.directory)
            stamp = (st.st_mtime_ns, st.st_ino)
        except OSError as e:      # gone: nobody is admitted until it is back
            if self.keys:
                log.warning("client keys directory %s: %s; admitting nobody", self.directory, e)
            self.stamp, self.keys = None, frozenset()
            return
        if stamp != self.stamp:
            try:
                self.keys = frozenset(zmq.auth.load_certificates(self.directory))
            except (OSError, ValueError) as e:
                log.warning("client keys directory %s cannot be read (%s): admitting nobody", self.directory, e)
                self.keys = frozenset()
            self.stamp = stamp

    def admits(self, domain, client_key):
        """ZAP's question: may this z85 public key connect?"""
        self._refresh()
        return client_key in self.keys

    callback = admits     # what configure_curve_callback asks of a credentials provider

    def still_admitted(self, user_id):
        """Whether the session a ZAP User-Id (the key, z85) names may go on."""
        return self.admits("*", user_id.encode() if isinstance(user_id, str) else user_id)


def frame_user_id(frame):
    """The ZAP User-Id of a message (its sender's key, z85), or None."""
    try:
        return frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None


def peer_credentials(fd):
    """(pid, uid) of the process at the other end of a Unix socket connection, by its descriptor
    (SO_PEERCRED, as of its connect; pid 0 where that process is in a PID namespace we cannot
    see), or None for a TCP connection or a descriptor already closed."""
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:
            if conn.family != socket.AF_UNIX:
                return None
            pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
            return pid, uid
    except OSError:
        return None


def loopback_uid(fd):
    """The uid of the local process at the other end of a loopback TCP connection, by its
    descriptor: the owner of the socket /proc/net/tcp lists with our two ends swapped. None
    where the peer is not on this host's loopback, or cannot be found. Keyless loopback
    clients shared one identity, so one local user could use up every other's quota."""
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:
            if conn.family not in (socket.AF_INET, socket.AF_INET6):
                return None
            ours, theirs = conn.getsockname()[:2], conn.getpeername()[:2]
            family = conn.family
    except OSError:
        return None
    import ipaddress
    if not ipaddress.ip_address(theirs[0]).is_loopback and theirs[0] != "::ffff:127.0.0.1":
        return None
    want = (_proc_net_address(family, *theirs), _proc_net_address(family, *ours))
    try:
        with open("/proc/net/tcp6" if family == socket.AF_INET6 else "/proc/net/tcp") as f:
            next(f)
            for line in f:
                fields = line.split()
                if (fields[1], fields[2]) == want:
                    return int(fields[7])
    except (OSError, ValueError, IndexError, StopIteration):
        pass
    return None


def _proc_net_address(family, host, port):
    """host:port as /proc/net/tcp writes it: the address's 32-bit words in host byte order, hex."""
    packed = socket.inet_pton(family, host)
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def pid_alive(pid):
    """Whether process pid runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")      # gone, unless there is no /proc to ask
    except (OSError, IndexError):
        return True
