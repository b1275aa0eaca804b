"""Each tenant's context workers share one worker's weight of the host's CPU.

A worker runs its context's kernels on the CPU (emu) and its calls' Python either way; the
kernel's scheduler gives every runnable process the same share, so a tenant with four contexts
spinning kernels would take four shares from a tenant with one, and that tenant's calls would
wait. Here a tenant's k workers each run at the nice level whose scheduler weight is
about 1/k of nice 0's (each level is 1.25 times lighter than the one below): together they
weigh about what one worker weighs, whatever k is.

What a tenant can take: an idle host's every core (nice levels share only what is contended),
and, under contention, about as much as any other tenant with running work; not more by
opening more contexts. What it cannot: a share of a tenant's own when the server runs as
another user than root and the tenant's contexts fall in number (a process may raise its
workers' nice level, only root lower it: they keep the lower share until they end). cgroup
v2's cpu.weight would do this per tenant without nice levels; it is not used (it needs a
delegated cgroup, which hosts do not give alike).
"""
import logging
import math
import os

log = logging.getLogger("phos.frontend")

STEP = 1.25            # the scheduler weight of nice n over that of n + 1
MAX_NICE = 19


def nice_for(contexts):
    """The nice level of each of a tenant's `contexts` workers."""
    return min(MAX_NICE, round(math.log(contexts) / math.log(STEP))) if contexts > 1 else 0


def share(workers):
    """Set every live worker's nice level by how many its tenant (worker.client) runs."""
    by_client = {}
    for w in workers:
        if w.proc.returncode is None and w.client:       # "": not known (a restored context)
            by_client.setdefault(w.client, []).append(w)
    base = os.getpriority(os.PRIO_PROCESS, 0)     # the server's own: its operator's choice, kept
    for mine in by_client.values():
        level = min(MAX_NICE, base + nice_for(len(mine)))
        for w in mine:
            set_nice(w.proc.pid, level)


def set_nice(pid, level):
    """Every thread of process pid at nice `level`: on Linux a nice level is a thread's."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return              # gone
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != level:
                os.setpriority(os.PRIO_PROCESS, tid, level)
        except PermissionError:      # lowering it needs root: it keeps the lower share (the module's docstring)
            pass
        except OSError:
            pass             # the thread ended
