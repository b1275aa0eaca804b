// A checkpoint's copy of the context on the device, in one launch (gpu_server/backends/cuda_snapshot.py,
// CudaSnapshotOps.freeze). PyTorch's contexts hold thousands of regions, and each device copy
// costs microseconds to issue from Python, so a copy each would hold the application for
// milliseconds; one launch of this kernel takes them all.
// pieces: n triples (destination, source, bytes); one block per piece, pieces of a few MiB at
// most (gpu_server/backends/staging_layout.py, pieces), so that a big region is shared out over all
// the SMs. Where both ends sit at 16-byte boundaries (every allocation) threads move 16 bytes
// at a time; elsewhere (a module's global, which the driver aligns to 4) a byte at a time:
// a wider access there faults the context.
// Built into copy_pieces.ptx by `nvcc -ptx -arch=compute_75 copy_pieces.cu` (checked in, so
// servers need no compiler; tests/e2e/test_snapshot_engine.py checks the two match and runs
// it on the emulator).
typedef unsigned long long u64;

extern "C" __global__ void copy_pieces(const u64* pieces, unsigned n) {
    unsigned c = blockIdx.x, t = threadIdx.x, step = blockDim.x;
    if (c >= n) return;
    char* dst = (char*)pieces[3 * c];
    const char* src = (const char*)pieces[3 * c + 1];
    unsigned len = (unsigned)pieces[3 * c + 2];
    unsigned bulk = 0;
    if ((((u64)dst | (u64)src) & 15) == 0) {
        unsigned pairs = len / 16;
        const ulonglong2* from = (const ulonglong2*)src;
        ulonglong2* to = (ulonglong2*)dst;
#pragma unroll 4
        for (unsigned i = t; i < pairs; i += step) to[i] = from[i];
        bulk = 16 * pairs;
    }
    for (unsigned i = bulk + t; i < len; i += step) dst[i] = src[i];
}
