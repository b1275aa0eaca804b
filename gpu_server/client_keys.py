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


def pid_alive(pid):
    """Whether process pid runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")      # gone, unless there is no /proc to ask
    except (OSError, IndexError):
        return True
