"""Transparent recovery: periodic incremental images of a context, and finding them again.

A server started with --recovery-dir gives each context worker a `Recovery`: the worker
takes a concurrent incremental image every --checkpoint-every seconds or every
--checkpoint-calls calls (and when its client's log is full), into <dir>/ctx<ID>, and tells
its client the image's cut (Reply.durableSeq), so that the client logs only the calls
after it. If the worker or the whole server dies, the front end that the client asks
(its own server, or the --standby) restores the latest image whose session token
matches, and the client replays its log (schema/phos.capnp, "Recovery").
"""
import json
import logging
import os
import secrets
import shutil
import threading
import time

from phos.snapshot import delete_image
from phos.snapshot.host_store import open_store

log = logging.getLogger("phos.recovery")


GLOBALS_FILE = "module_globals.json"     # beside a context's recovery images (Recovery.note_globals)
PAUSE_BUDGET_MS = 50.0    # a paused recovery image may hold the application this long (Recovery.paused)
# After a failed image (a full or gone store) the next waits, twice as long after each failure
# up to RETRY_MAX_S; the log says so once, then once a FAILURE_LOG_S: a full recovery directory
# tried about 60 images a second and logged each (3,651 lines).
RETRY_FIRST_S, RETRY_MAX_S, FAILURE_LOG_S = 0.1, 30.0, 60.0


def context_store(directory, ctx_id):
    """The image store of one context: a directory of its own, so pruning never scans others."""
    return os.path.join(directory, f"ctx{ctx_id}")


def module_globals_noted(path):
    """{module id: {global name: address}} that the workers of a context's recovery store noted
    (Recovery.note_globals); {} where there is none or it cannot be read."""
    try:
        with open(os.path.join(path, GLOBALS_FILE)) as f:
            noted = json.load(f)
        return {int(mid): {str(name): int(addr) for name, addr in names.items()} for mid, names in noted.items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, AttributeError) as e:
        log.warning("module globals noted in %s cannot be read (%s): a replay that loads a module may "
                    "find its globals elsewhere", path, e)
        return {}


class Recovery:
    """When one worker takes its recovery images, and which of them it still needs."""

    def __init__(self, directory, ctx_id, every_s=0.0, every_calls=0):
        self.path = context_store(directory, ctx_id)
        os.makedirs(self.path, exist_ok=True)
        self.every_s, self.every_calls = every_s, every_calls
        self.tag = secrets.token_hex(4)    # names this worker's images: it prunes only its own and its parent
        self.count = 0
        self.latest = None                 # name of the newest committed image
        self.durable = 0                   # its cut: the client logs the calls after it
        self.copied = None                 # bytes the newest image copied (None: none taken here yet)
        self.running_paused = False        # the running image holds the application while it copies
        self.pause_too_long = False        # a paused image held it longer than PAUSE_BUDGET: no more of them
        self.taken_at = float("-inf")      # a fresh context is imaged at once (it is cheap)
        self.wanted = False                # the client's log is full
        self.running = None                # name of the image being taken
        self.retired = False               # handed off: the images of the new owner stay
        self.pruning = None                # the thread deleting the previous image
        self.failures = 0                  # images failed in a row
        self.retry_at = 0.0                # ... and when the next may be tried
        self.failure_said = (float("-inf"), 0)   # when the log last told of one, and failures since
        self.globals = module_globals_noted(self.path)   # {module id: {name: address}}, as noted

    def note_globals(self, module_id, places):
        """Note where a module's globals are ({name: address}), beside the images. A module
        loaded after the latest image's cut is loaded again when the client replays its log,
        and the device puts its globals elsewhere: the restored worker makes the addresses the
        client was given reach them (calls.module_load). Written before the client hears of it."""
        self.globals[module_id] = places
        tmp = os.path.join(self.path, f".{GLOBALS_FILE}.{os.getpid()}")
        try:
            with open(tmp, "w") as f:
                json.dump({str(mid): names for mid, names in self.globals.items()}, f)
            os.replace(tmp, os.path.join(self.path, GLOBALS_FILE))
        except OSError as e:
            log.warning("could not note the globals of module %d: %s", module_id, e)

    def restored_from(self, name, cut):
        self.latest, self.durable, self.taken_at = name, cut, time.monotonic()

    def due(self, ack):
        if self.running is not None or time.monotonic() < self.retry_at:
            return False
        if self.latest is None:
            return True
        if ack == self.durable:          # nothing new since the last image
            self.wanted = False
            return False
        return self.wanted or bool(self.every_s and time.monotonic() - self.taken_at >= self.every_s) \
            or bool(self.every_calls and ack - self.durable >= self.every_calls)

    def paused(self, context_bytes, limit):
        """Whether to take the next image with the application paused: when it should copy
        little (what the last one copied, else the whole context) and no paused image here
        held the application longer than PAUSE_BUDGET (a slow fingerprint pass: emu's, or a
        context too large for one). A concurrent image makes each write of the application
        wait for the chunks it touches to be saved: PyTorch's training on the H200 ran 100x
        slower while one copied 23 MB in 0.5 s; paused, that costs a fingerprint pass and the
        copy of what changed, at once."""
        expected = context_bytes if self.copied is None else self.copied
        return bool(limit) and expected <= limit and not self.pause_too_long

    def begin(self, paused=False):
        """Name the next image; returns (store path, name, parent)."""
        self.running_paused = paused
        self.count += 1
        self.running = f"rec-{self.tag}-{self.count:06d}"
        self.wanted = False
        return self.path, self.running, self.latest or ""

    def committed(self, cut, copied=None, pause_ms=0.0):
        """The running image is complete: it replaces the previous one (pruned off the loop)."""
        old, self.latest, self.running = self.latest, self.running, None
        self.copied = copied
        if self.running_paused and pause_ms > PAUSE_BUDGET_MS:
            self.pause_too_long = True
            log.info("recovery image %s paused the application %.1f ms: the next ones are concurrent", self.latest, pause_ms)
        self.durable, self.taken_at = cut, time.monotonic()
        if self.failures:
            log.warning("recovery image %s committed, after %d failed in a row", self.latest, self.failures)
            self.failures, self.retry_at, self.failure_said = 0, 0.0, (float("-inf"), 0)
        if old is not None:
            self.prune_done()
            self.pruning = threading.Thread(target=self._delete, args=(old,), daemon=True)
            self.pruning.start()

    def prune_done(self):
        if self.pruning is not None:
            self.pruning.join()
            self.pruning = None

    def failed(self, why):
        now = time.monotonic()
        self.failures += 1
        self.retry_at = now + min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (self.failures - 1))
        said_at, unsaid = self.failure_said
        if now - said_at >= FAILURE_LOG_S:
            log.warning("recovery image %s failed: %s (%d failed in a row; the next is tried in %.1f s)%s", self.running,
                        why, self.failures, self.retry_at - now,
                        f"; {unsaid} failures since the last such line" if unsaid else "")
            self.failure_said = (now, 0)
        else:
            self.failure_said = (said_at, unsaid + 1)
        self.running, self.taken_at = None, now

    def _delete(self, name):
        try:
            delete_image(open_store(self.path), name)
        except Exception as e:       # pruning is best effort: the next one collects it
            log.info("could not prune recovery image %s: %s", name, e)

    def retire(self):
        """The context lives on elsewhere (a handoff): remove the images this worker took and
        the one it was restored from (a handoff's last round, say), not the new owner's."""
        self.retired = True
        self.prune_done()
        for name in open_store(self.path).list_images():
            if name.startswith(f"rec-{self.tag}-") or name == self.latest:
                self._delete(name)

    def discard(self):
        """The context ended cleanly: nobody will restore it, so its images go."""
        self.prune_done()
        shutil.rmtree(self.path, ignore_errors=True)
