"""The host memory a server's processes may use: the host's, or less where a memory cgroup
limits them (v2's memory.max, v1's memory.limit_in_bytes, the tightest of the cgroup and its
ancestors).

The emu device's memory is host memory: a device granted beyond it (16 GiB in a 3 GiB cgroup)
let one tenant fill the host, and the kernel's OOM killer then ended whichever worker it chose,
another tenant's too. So the emu device is no bigger than what the host can back, less room
for the workers themselves (emu.py), and an allocation past it is refused at once, by name.
"""
import os

HEADROOM_MIN = 512 << 20      # bytes left to the server's processes themselves (interpreters, buffers), at least
HEADROOM_SHARE = 8            # ... or this share of the limit (1/8), whichever is more


def host_total(meminfo="/proc/meminfo"):
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_limit(proc_cgroup="/proc/self/cgroup", root="/sys/fs/cgroup"):
    """The tightest memory limit of this process's cgroup and its ancestors, or None."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    limits = []
    for hierarchy, controllers, path in (line for line in lines if len(line) == 3):
        if hierarchy == "0" and controllers == "":            # v2: the root, or unified/ beside v1's
            unified = root if os.path.exists(os.path.join(root, "cgroup.controllers")) else os.path.join(root, "unified")
            limits += _limits(unified, path, "memory.max")
        elif "memory" in controllers.split(","):               # v1
            limits += _limits(os.path.join(root, "memory"), path, "memory.limit_in_bytes")
    return min(limits) if limits else None


def _limits(mount, path, name):
    """The limits `name` gives in the cgroup at path under mount and in each of its ancestors. A
    container may see its own cgroup as the mount's root: the path is then not there, and the
    root's file is its."""
    out = []
    parts = [p for p in path.split("/") if p]
    for n in range(len(parts), -1, -1):
        f = os.path.join(mount, *parts[:n], name)
        try:
            with open(f) as fh:
                text = fh.read().strip()
        except OSError:
            continue
        if text and text != "max":
            try:
                value = int(text)
            except ValueError:
                continue
            if value < 1 << 60:          # v1 says "no limit" with a page-rounded 2^63
                out.append(value)
    return out


def backable():
    """Bytes of device memory the host can back for this server's emu devices, or None when
    nothing is known."""
    limits = [v for v in (host_total(), cgroup_limit()) if v]
    if not limits:
        return None
    limit = min(limits)
    return max(0, limit - max(HEADROOM_MIN, limit // HEADROOM_SHARE))
