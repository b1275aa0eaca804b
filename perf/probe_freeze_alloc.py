"""What a concurrent checkpoint's device copy (CudaSnapshotOps.freeze) costs to allocate.

The cut allocates a copy as large as the context (GPT-2's 9.65 GiB) while the application is
held. This times, on a fresh context, each way to get that memory:

- cuMemAllocAsync from the device's default pool (what freeze does), first and second time;
- the same after the pool was told to keep its memory (release threshold: everything);
- cuMemAlloc;
- cuMemCreate + cuMemMap of the same bytes (what a copy reserved ahead could use).

    python3 perf/probe_freeze_alloc.py --gib 1,9.65
"""
import argparse
import time

from cuda.bindings import driver as cu

GiB = 1 << 30


def ok(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err):
        raise RuntimeError(f"{err}")
    return rest[0] if len(rest) == 1 else rest


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t) * 1e3, out


def pool_async(stream, nbytes):
    ms, ptr = timed(lambda: ok(cu.cuMemAllocAsync(nbytes, stream)))
    ok(cu.cuStreamSynchronize(stream))
    return ms, ptr


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", default="1,9.65")
    args = p.parse_args()
    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxSetCurrent(ctx))
    stream = ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    pool = ok(cu.cuDeviceGetDefaultMemPool(dev))
    print("| GiB | way | ms |\n|---|---|---|")
    for gib in (float(g) for g in args.gib.split(",")):
        nbytes = int(gib * GiB) // (2 << 20) * (2 << 20)
        for attempt in ("first", "second"):
            ms, ptr = pool_async(stream, nbytes)
            print(f"| {gib} | cuMemAllocAsync, default pool, {attempt} | {ms:.2f} |")
            ok(cu.cuMemFreeAsync(ptr, stream))
            ok(cu.cuStreamSynchronize(stream))
        keep = cu.cuuint64_t(0xFFFFFFFFFFFFFFFF)
        ok(cu.cuMemPoolSetAttribute(pool, cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, keep))
        for attempt in ("first", "second"):
            ms, ptr = pool_async(stream, nbytes)
            print(f"| {gib} | cuMemAllocAsync, pool keeps its memory, {attempt} | {ms:.2f} |")
            ok(cu.cuMemFreeAsync(ptr, stream))
            ok(cu.cuStreamSynchronize(stream))
        ok(cu.cuMemPoolTrimTo(pool, 0))
        ok(cu.cuMemPoolSetAttribute(pool, cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, cu.cuuint64_t(0)))
        ms, ptr = timed(lambda: ok(cu.cuMemAlloc(nbytes)))
        print(f"| {gib} | cuMemAlloc | {ms:.2f} |")
        ms, _ = timed(lambda: ok(cu.cuMemFree(ptr)))
        print(f"| {gib} | cuMemFree | {ms:.2f} |")
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = 0
        ms, handle = timed(lambda: ok(cu.cuMemCreate(nbytes, prop, 0)))
        print(f"| {gib} | cuMemCreate | {ms:.2f} |")
        va = ok(cu.cuMemAddressReserve(nbytes, 0, 0, 0))
        ms, _ = timed(lambda: ok(cu.cuMemMap(va, nbytes, 0, handle, 0)))
        access = cu.CUmemAccessDesc()
        access.location = prop.location
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        ms2, _ = timed(lambda: ok(cu.cuMemSetAccess(va, nbytes, [access], 1)))
        print(f"| {gib} | cuMemMap + cuMemSetAccess | {ms:.2f} + {ms2:.2f} |")
        ok(cu.cuMemUnmap(va, nbytes))
        ok(cu.cuMemAddressFree(va, nbytes))
        ok(cu.cuMemRelease(handle))


if __name__ == "__main__":
    main()
