"""Where the pool puts a new context: the policy alone, over the controller's view of its servers.

A server is a dict as the controller keeps it (controller.py ServerView.as_dict):
address, state ("up", "draining", "drained", "lost"), free (device bytes free, as its last
snapshot said), contexts, unpolled (contexts placed there since that snapshot, placing ones
included; 0 when left out), max_contexts (0: no limit).
"""

POLICIES = ("most-free", "pack")
# Free memory compares in steps of this size: the controller's view of it lags a burst of new
# contexts by a poll, and frees that differ by a few MiB (a worker's buffers) would send the
# whole burst to one server; within a step, the count of contexts (placing ones included) decides.
# A context placed since its server's snapshot counts as a step less free: a snapshot that lags
# the others' (a slow poll) must not take the burst that those show the memory of.
FREE_STEP = 256 << 20


class NoRoom(Exception):
    """No server takes another context."""


def has_room(server):
    return (server["state"] == "up" and server["free"] > 0
            and (not server["max_contexts"] or server["contexts"] < server["max_contexts"]))


def choose(servers, policy="most-free", exclude=()):
    """The server a new context goes to. most-free: the one with the most free device memory
    (in FREE_STEPs; fewer contexts first on a tie, so that a burst of new, still empty contexts
    spreads); pack: the one with the least free memory that still has room (more contexts first
    on a tie), so that whole servers stay free for big contexts. Raises NoRoom."""
    if policy not in POLICIES:
        raise ValueError(f"placement policy {policy!r}: use one of {', '.join(POLICIES)}")
    fits = [s for s in servers if has_room(s) and s["address"] not in exclude]
    if not fits:
        raise NoRoom(f"no server has room for a context ({len(servers)} in the pool"
                     + (f", {len(exclude)} excluded" if exclude else "") + ")")
    if policy == "pack":
        return min(fits, key=lambda s: (free_steps(s), -s["contexts"], s["address"]))
    return max(fits, key=lambda s: (free_steps(s), -s["contexts"], s["address"]))


def free_steps(server):
    return server["free"] // FREE_STEP - server.get("unpolled", 0)
