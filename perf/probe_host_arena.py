"""Which shared host memory should hold images? The question behind the HostStore (issue 5).

Session 9 put images in a HostStore: a /dev/shm file that every pre-started worker pins in
1 GiB pieces (snapshot/host_store.py). On the H200 its checkpoints ran at 17-22 GB/s where
this probe had measured 55 for a 4 GiB file pinned whole, and pinning 37 GiB took a worker
16 s. This probe times, per GiB, for each kind of host memory at the size asked:

    make          creating and populating it (once per server)
    pin           cuMemHostRegister of all of it in this process; for VMM memory, mapping it
    pin again     the same in a second process (another worker); for VMM memory, importing
                  the exported file descriptor and mapping it
    D2H, H2D      cuMemcpy*Async of 16 MiB chunks into / out of it
    CPU reads     whether the second process can read it with the CPU (a disk copy needs to)

    python perf/probe_host_arena.py [--gib 16] [--only VMM]   # on the H200 (perf/device/run.sh arena)
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
DEVICEMAP = 0x02


def copies(host, dev, nbytes, stream, direction, unified=False):
    """GB/s of 16 MiB copies; unified: cuMemcpyAsync (VMM host memory is not a host pointer to
    cuMemcpyDtoH, the driver knows it by its address)."""
    t = time.perf_counter()
    for off in range(0, nbytes, CHUNK):
        src, dst = (dev + off, host + off) if direction == "d2h" else (host + off, dev + off)
        if unified:
            ok(cu.cuMemcpyAsync(dst, src, CHUNK, stream))
        elif direction == "d2h":
            ok(cu.cuMemcpyDtoHAsync(dst, src, CHUNK, stream))
        else:
            ok(cu.cuMemcpyHtoDAsync(dst, src, CHUNK, stream))
    ok(cu.cuStreamSynchronize(stream))
    return nbytes / (time.perf_counter() - t) / 1e9


PIN_AGAIN = """
import mmap, os, sys, time
import numpy as np
from cuda.bindings import driver as cu
path, nbytes, piece, flags = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
assert int(cu.cuInit(0)[0]) == 0
cu.cuCtxSetCurrent(cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])[1])
fd = os.open(path, os.O_RDWR)
host = np.frombuffer(mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED), np.uint8)
t = time.perf_counter()
for off in range(0, nbytes, piece):
    err = cu.cuMemHostRegister(host.ctypes.data + off, min(piece, nbytes - off), flags)[0]
    if int(err):
        break
print(int(err), time.perf_counter() - t, int(host[::1 << 20].sum() >= 0), flush=True)
"""

IMPORT = """
import ctypes, os, sys, time
from cuda.bindings import driver as cu
fd, nbytes = int(sys.argv[1]), int(sys.argv[2])
assert int(cu.cuInit(0)[0]) == 0
cu.cuCtxSetCurrent(cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])[1])
t = time.perf_counter()
err, handle = cu.cuMemImportFromShareableHandle(fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
assert int(err) == 0, ("import", err)
err, va = cu.cuMemAddressReserve(nbytes, 0, 0, 0)
assert int(cu.cuMemMap(va, nbytes, 0, handle, 0)[0]) == 0
access = []
for kind, where in ((cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE, 0), (cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA, 0)):
    a = cu.CUmemAccessDesc()
    a.location.type, a.location.id = kind, where
    a.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    access.append(a)
err = cu.cuMemSetAccess(va, nbytes, access, 2)[0]
if int(err):
    err = cu.cuMemSetAccess(va, nbytes, access[:1], 1)[0]
    print(0, time.perf_counter() - t, "no (device access only)", flush=True)
    sys.exit(0)
took = time.perf_counter() - t
print(0, took, "trying", flush=True)
value = ctypes.c_uint8.from_address(int(va) + nbytes // 2).value     # a crash here: the CPU cannot
print(0, took, f"yes ({value})", flush=True)
"""


def second(args, pass_fds=()):
    """(status, seconds, CPU reads) from a second process, or why it failed."""
    out = subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True, timeout=600, pass_fds=pass_fds)
    lines = out.stdout.strip().splitlines()
    if not lines:
        return f"exit {out.returncode}: {out.stderr.strip()[-100:]}", float("nan"), "?"
    status, seconds, *reads = lines[-1].split(" ", 2)
    if out.returncode != 0 and reads == ["trying"]:
        reads = [f"no (the process died, exit {out.returncode})"]
    return status, float(seconds), " ".join(reads)


def shm_file(nbytes):
    path = f"/dev/shm/phos-arena-probe-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, nbytes)
    area = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    os.close(fd)
    host = np.frombuffer(area, np.uint8)
    host[::4096] = 1                    # populate, as a server would once
    return path, area, host


def probe_shm(nbytes, dev, stream, piece, flags):
    t = time.perf_counter()
    path, area, host = shm_file(nbytes)
    made = time.perf_counter() - t
    t = time.perf_counter()
    for off in range(0, nbytes, piece):
        ok(cu.cuMemHostRegister(host.ctypes.data + off, min(piece, nbytes - off), flags))
    pinned = time.perf_counter() - t
    d2h, h2d = copies(host.ctypes.data, dev, nbytes, stream, "d2h"), copies(host.ctypes.data, dev, nbytes, stream, "h2d")
    status, again, reads = second([PIN_AGAIN, path, str(nbytes), str(piece), str(flags)])
    for off in range(0, nbytes, piece):
        cu.cuMemHostUnregister(host.ctypes.data + off)
    del host
    area.close()
    os.unlink(path)
    return made, pinned, (status, again, "yes" if status == "0" else reads), d2h, h2d


def probe_host_alloc(nbytes, dev, stream):
    t = time.perf_counter()
    ptr = ok(cu.cuMemHostAlloc(nbytes, 0))
    made = time.perf_counter() - t
    d2h, h2d = copies(int(ptr), dev, nbytes, stream, "d2h"), copies(int(ptr), dev, nbytes, stream, "h2d")
    ok(cu.cuMemFreeHost(ptr))
    return made, 0.0, ("private", float("nan"), "-"), d2h, h2d


def probe_vmm(nbytes, dev, stream):
    """Pinned host memory the driver allocates (cuMemCreate on the host's NUMA node 0) and
    exports as a file descriptor: another process maps it without pinning it again."""
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
    prop.location.id = 0
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    grain = ok(cu.cuMemGetAllocationGranularity(prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
    size = -(-nbytes // grain) * grain
    t = time.perf_counter()
    handle = ok(cu.cuMemCreate(size, prop, 0))
    made = time.perf_counter() - t
    t = time.perf_counter()
    va = ok(cu.cuMemAddressReserve(size, 0, 0, 0))
    ok(cu.cuMemMap(va, size, 0, handle, 0))
    access = cu.CUmemAccessDesc()
    access.location.type, access.location.id = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE, 0
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    ok(cu.cuMemSetAccess(va, size, [access], 1))
    mapped = time.perf_counter() - t
    d2h, h2d = copies(int(va), dev, nbytes, stream, "d2h", True), copies(int(va), dev, nbytes, stream, "h2d", True)
    fd = int(ok(cu.cuMemExportToShareableHandle(handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)))
    status, again, reads = second([IMPORT, str(fd), str(size)], pass_fds=(fd,))
    os.close(fd)
    ok(cu.cuMemUnmap(va, size))
    ok(cu.cuMemRelease(handle))
    ok(cu.cuMemAddressFree(va, size))
    print(f"(VMM host memory: granularity {grain >> 10} KiB)")
    return made, mapped, (status, again, reads), d2h, h2d


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=int, default=16, help="size of each kind of memory")
    ap.add_argument("--only", default="", help="probe only the kinds whose name holds this (e.g. VMM)")
    args = ap.parse_args()
    nbytes = args.gib * GiB
    ok(cu.cuInit(0))
    ok(cu.cuCtxSetCurrent(ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(0))))))
    dev = int(ok(cu.cuMemAlloc(nbytes)))
    ok(cu.cuMemsetD8(dev, 7, nbytes))
    stream = ok(cu.cuStreamCreate(0))
    kinds = {"shm file, pinned whole (flags 0)": lambda: probe_shm(nbytes, dev, stream, nbytes, 0),
             "shm file, pinned in 1 GiB pieces, DEVICEMAP (a worker)": lambda: probe_shm(nbytes, dev, stream, GiB, DEVICEMAP),
             "cuMemHostAlloc (private, reference)": lambda: probe_host_alloc(nbytes, dev, stream),
             "VMM host memory, exported fd": lambda: probe_vmm(nbytes, dev, stream)}
    print(f"\n| memory ({args.gib} GiB) | make (ms/GiB) | pin or map (ms/GiB) | second process: pin or map (ms/GiB) "
          "| its CPU reads it | D2H (GB/s) | H2D (GB/s) |\n|---|---|---|---|---|---|---|")
    for kind, run in kinds.items():
        if args.only.lower() not in kind.lower():
            continue
        try:
            made, pinned, (status, again, reads), d2h, h2d = run()
            again_s = f"{again * 1e3 / args.gib:.0f}" if status == "0" else status
            print(f"| {kind} | {made * 1e3 / args.gib:.0f} | {pinned * 1e3 / args.gib:.0f} | {again_s} | {reads} "
                  f"| {d2h:.1f} | {h2d:.1f} |", flush=True)
        except (OSError, AssertionError, subprocess.TimeoutExpired, ValueError, TypeError, AttributeError) as e:
            print(f"| {kind} | failed: {str(e)[:150]} | | | | | |", flush=True)


if __name__ == "__main__":
    main()
