"""Where a handoff's rounds go (gpu_server/control/handoff.py).

A target that takes recovery images gets them in its recovery store of the context
(gpu_server/worker/recovery.py): the last round is then the context's recovery image there from
the moment it adopts it, its own recovery images follow it incrementally, and a target that
dies before it took one loses nothing. The path must be one this server can write, as a
handoff's store always had to be (the same host, or a shared file system). Otherwise, when
both servers pin the same HostStore (--host-store), the rounds go there: the device copies
them into its shared memory and the target's device straight out of it, with no files. A
target on another host reads the rounds as the source sends them: they go to the source's
own HostStore where it has one with room (handoff.Handoff.host_store_for). Else they go to a
directory in /dev/shm named for this process (frontend.sweep_shm removes what a killed one left).
"""
import logging
import os
import secrets
import shutil
import tempfile
import time

from phos.gpu_server.worker.recovery import context_store
from phos.snapshot import DirStore, ImageError, gc, open_store
from phos.snapshot.store import ImageInUse

log = logging.getLogger("phos.admin")
IN_USE_WAIT = 10.0      # seconds the rounds' removal waits for a dropped warm copy to let go of them


class HandoffStore:
    def __init__(self, ctx, recovery_dir="", host_store=""):
        self.tag = secrets.token_hex(4)    # a later handoff of the context into the same store names its own rounds
        self.rounds = []                   # names of the rounds begun
        self.dropped = set()               # ... and of those deleted (drop_rounds_before)
        self.recovery = False
        self.shared = False                # a store others use too: remove our images, not the store
        if recovery_dir:
            path = context_store(os.path.abspath(recovery_dir), ctx)
            try:
                self.made = not os.path.isdir(path)
                DirStore(path)               # makes it, or says why not
                self.path, self.recovery = path, True
            except OSError as e:
                log.warning("context %d: the target's recovery store %s cannot be written here (%s): "
                            "the handoff goes through /dev/shm", ctx, path, e.strerror)
        if not self.recovery and host_store:
            self.path, self.shared = host_store, True
        elif not self.recovery:
            self.path = tempfile.mkdtemp(prefix=f"phos-handoff-{os.getpid()}-",
                                         dir="/dev/shm" if os.path.isdir("/dev/shm") else None)

    def round_name(self, i):
        name = f"handoff-{self.tag}-round{i}"
        self.rounds.append(name)
        return name

    def drop_rounds_before(self, name):
        """Delete the rounds begun before round `name` and collect the chunks no image names any
        more, while the handoff goes on: the target holds those rounds already, and a store of
        fixed size (a HostStore) must keep room for the next ones. A round a restore still
        reads stays (remove() takes it)."""
        try:
            store = open_store(self.path, create=False)
            older = self.rounds[:self.rounds.index(name)]
            self._delete(store, [r for r in older if r not in self.dropped])
            gc(store)        # None while another writes to the store: the next drop collects
        except (OSError, ImageError, ValueError) as e:
            log.warning("could not drop the handoff's earlier rounds from %s: %s", self.path, e)

    def _delete(self, store, names):
        """Delete images `names`; returns those a restore reads still."""
        in_use = []
        for name in names:
            try:
                store.delete_image(name)
            except ImageInUse:        # a warm copy dropped a moment ago still lets go of it
                in_use.append(name)
                continue
            except ImageError:
                pass
            self.dropped.add(name)
        return in_use

    def remove(self, keep=None):
        """Remove the rounds, but `keep` (the last, the target's recovery image now): the
        whole directory in /dev/shm; in a recovery or host store, our images and the chunks no
        image needs any more (others may be the context's recovery images of another server)."""
        if not (self.recovery or self.shared):
            shutil.rmtree(self.path, ignore_errors=True)
            return
        try:
            store = open_store(self.path)
            left, deadline = [name for name in self.rounds if name != keep and name not in self.dropped], \
                time.monotonic() + IN_USE_WAIT
            while left:
                left = self._delete(store, left)
                if left and time.monotonic() > deadline:
                    log.warning("handoff rounds %s stay in %s: a restore still reads them", ", ".join(left), self.path)
                    break
                if left:
                    time.sleep(0.05)
            gc(store)          # None when a recovery image is being written: its next prune collects
            if self.recovery and self.made and keep is None and not store.list_images():
                shutil.rmtree(self.path, ignore_errors=True)
        except (OSError, ImageError) as e:
            log.warning("could not remove the handoff's rounds from %s: %s", self.path, e)
