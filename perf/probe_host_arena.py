"""Can images live in pinned shared memory? The question behind issues 5 and 6, measured alone.

A checkpoint writes every byte twice today: the device copies a chunk into a pinned buffer,
then a thread writes it into a chunk file (95% of a paused checkpoint's time, RESULTS.md).
An image store in shared host memory that the device copies into directly would write it
once, and a handoff's target could read the last delta from it without files. That needs
shared memory that every worker can pin, cheaply enough. For each kind of memory this probe
times, per GiB:

    make          creating and populating it (the server would do this once)
    pin           cuMemHostRegister of the whole of it, in this process
    pin again     the same pages pinned by a second process (another worker, a restore)
    D2H, H2D      cuMemcpy*Async of 16 MiB chunks into / out of it, pinned
    D2H pageable  the same copies before pinning (what an unpinned arena would get)

    python perf/probe_host_arena.py [--gib 4]        # on the H200 (perf/device/run.sh arena)
"""
import argparse
import mmap
import os
import subprocess
import sys
import time

import numpy as np
from cuda.bindings import driver as cu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_snapshot import GiB, MiB  # noqa: E402
from probe_driver_stalls import ok  # noqa: E402

CHUNK = 16 * MiB


def huge_pages_free():
    """Bytes of reserved huge pages not in use (/proc/meminfo)."""
    with open("/proc/meminfo") as f:
        info = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)}
    return info.get("HugePages_Free", 0) * info.get("Hugepagesize", 0) * 1024


def make(kind, nbytes):
    """(path or None, mmap) of nbytes of shared memory of this kind, populated."""
    if kind == "shm file, 4 KiB pages":
        path = f"/dev/shm/phos-arena-probe-{os.getpid()}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    elif kind == "shm file, transparent huge pages":
        path = f"/dev/shm/phos-arena-probe-thp-{os.getpid()}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    else:               # memfd on hugetlbfs: needs huge pages reserved (vm.nr_hugepages)
        free = huge_pages_free()
        if free < nbytes:      # touching a huge page that is not there kills us with SIGBUS
            raise OSError(f"{free >> 20} MiB of huge pages free, {nbytes >> 20} needed")
        fd, path = os.memfd_create("phos-arena-probe", os.MFD_HUGETLB), None
    os.ftruncate(fd, nbytes)
    area = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    if kind == "shm file, transparent huge pages":
        area.madvise(mmap.MADV_HUGEPAGE)
    np.frombuffer(area, np.uint8)[::4096] = 1          # populate, as a server would once
    if path is None:
        path = f"/proc/{os.getpid()}/fd/{fd}"            # a second process opens it from here
    else:
        os.close(fd)
    return path, area


def copies(area, dev, nbytes, stream, direction):
    host = np.frombuffer(area, np.uint8).ctypes.data
    t = time.perf_counter()
    for off in range(0, nbytes, CHUNK):
        if direction == "d2h":
            ok(cu.cuMemcpyDtoHAsync(host + off, dev + off, CHUNK, stream))
        else:
            ok(cu.cuMemcpyHtoDAsync(dev + off, host + off, CHUNK, stream))
    ok(cu.cuStreamSynchronize(stream))
    return nbytes / (time.perf_counter() - t) / 1e9


SECOND = """
import mmap, os, sys, time
import numpy as np
from cuda.bindings import driver as cu
path, nbytes = sys.argv[1], int(sys.argv[2])
assert int(cu.cuInit(0)[0]) == 0
ctx = cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])[1]
cu.cuCtxSetCurrent(ctx)
fd = os.open(path, os.O_RDWR)
area = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
host = np.frombuffer(area, np.uint8)
t = time.perf_counter()
err = cu.cuMemHostRegister(host.ctypes.data, nbytes, 0)[0]
print(int(err), time.perf_counter() - t, flush=True)
"""


def probe(kind, nbytes, dev, stream):
    t = time.perf_counter()
    path, area = make(kind, nbytes)
    made = time.perf_counter() - t
    pageable = copies(area, dev, nbytes, stream, "d2h")
    host = np.frombuffer(area, np.uint8)
    t = time.perf_counter()
    ok(cu.cuMemHostRegister(host.ctypes.data, nbytes, 0))
    pinned = time.perf_counter() - t
    d2h, h2d = copies(area, dev, nbytes, stream, "d2h"), copies(area, dev, nbytes, stream, "h2d")
    out = subprocess.run([sys.executable, "-c", SECOND, path, str(nbytes)], capture_output=True, text=True, timeout=600)
    err, again = (out.stdout.split() + ["?", "nan"])[:2] if out.returncode == 0 else ("exit " + str(out.returncode), "nan")
    ok(cu.cuMemHostUnregister(host.ctypes.data))
    del host
    area.close()
    if path.startswith("/dev/shm/"):
        os.unlink(path)
    gib = nbytes / GiB
    again_s = f"{float(again) * 1e3 / gib:.0f}" if err == "0" else f"failed ({err})"
    return f"| {kind} | {made * 1e3 / gib:.0f} | {pinned * 1e3 / gib:.0f} | {again_s} | {d2h:.1f} | {h2d:.1f} | {pageable:.1f} |"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=int, default=4, help="size of each arena")
    args = ap.parse_args()
    nbytes = args.gib * GiB
    ok(cu.cuInit(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(0))))
    ok(cu.cuCtxSetCurrent(ctx))
    dev = int(ok(cu.cuMemAlloc(nbytes)))
    ok(cu.cuMemsetD8(dev, 7, nbytes))
    stream = ok(cu.cuStreamCreate(0))
    for name in ("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "/proc/sys/vm/nr_hugepages"):
        try:
            with open(name) as f:
                print(f"{name}: {f.read().strip()}")
        except OSError as e:
            print(f"{name}: {e.strerror}")
    t = time.perf_counter()
    ref = ok(cu.cuMemHostAlloc(nbytes, 0))
    alloc_ms = (time.perf_counter() - t) * 1e3 / args.gib
    ok(cu.cuMemFreeHost(ref))
    print(f"\nreference: cuMemHostAlloc of private pinned memory, {alloc_ms:.0f} ms per GiB")
    print(f"\n| memory ({args.gib} GiB) | make (ms/GiB) | pin (ms/GiB) | pin again, second process (ms/GiB) "
          "| D2H pinned (GB/s) | H2D pinned (GB/s) | D2H pageable (GB/s) |\n|---|---|---|---|---|---|---|")
    for kind in ("shm file, 4 KiB pages", "shm file, transparent huge pages", "memfd, hugetlbfs"):
        try:
            print(probe(kind, nbytes, dev, stream), flush=True)
        except (OSError, AssertionError, subprocess.TimeoutExpired) as e:
            print(f"| {kind} | failed: {str(e)[:120]} | | | | | |", flush=True)


if __name__ == "__main__":
    main()
