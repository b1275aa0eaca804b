// Driver API: device memory, copies, memsets, page-locked host memory, pointer queries.
//
// Copy semantics follow CUDA's "API synchronization behavior":
//  * host->device: the bytes are captured (copied, or borrowed from pinned memory for an
//    async copy) and the call returns without a round trip; a large pageable copy is sent
//    from the caller's buffer and waits for the server, so no buffer is borrowed past return.
//    With a shared staging area, copies of 256 KiB and more are copied into it and the
//    call returns; a failure is reported by the next synchronizing call.
//  * device->host: waits for the bytes, except a small async copy into pinned memory, whose
//    bytes land by the next synchronizing call (they ride on its Reply). With a staging
//    area, copies of 256 KiB and more come through it, and wait.
//  * pinned memory the worker maps (host_alloc): either way a reference travels, and the worker
//    copies in place, on the stream; the synchronous forms wait for it, the Async ones do not
//    (schema/phos.capnp, "Pinned host memory").
// Pointers are checked here against the allocations the stub has seen, so a bad pointer
// fails at once, as it does on a GPU.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "driver_state.h"

namespace phos::driver {

const DeviceRange* find_device_range(uint64_t ptr, uint64_t* base) {
    State& s = state();
    for (auto* ranges : {&s.allocations, &s.globals}) {
        auto it = ranges->upper_bound(ptr);
        if (it == ranges->begin()) continue;
        --it;
        if (ptr < it->first + it->second.size) {
            if (base) *base = it->first;
            return &it->second;
        }
    }
    return nullptr;
}

bool device_range_ok(uint64_t ptr, size_t n) {
    uint64_t base = 0;
    const DeviceRange* r = find_device_range(ptr, &base);
    if (!r || ptr + n < ptr) return false;
    uint64_t end = base + r->size;
    // cuMemMap's mappings side by side are one range, as in CUDA (a tensor spans them)
    for (auto next = state().allocations.find(end); ptr + n > end && r->physical && next != state().allocations.end() &&
                                                    next->second.physical;
         next = state().allocations.find(end)) {
        r = &next->second;
        end += r->size;
    }
    return ptr + n <= end;
}

const HostRange* find_host_range(const void* p, uintptr_t* base) {
    State& s = state();
    uintptr_t a = reinterpret_cast<uintptr_t>(p);
    auto it = s.host.upper_bound(a);
    if (it == s.host.begin()) return nullptr;
    --it;
    if (a >= it->first + it->second.size) return nullptr;
    if (base) *base = it->first;
    return &it->second;
}

bool is_pinned(const void* p, size_t n) {
    uintptr_t base = 0;
    const HostRange* r = find_host_range(p, &base);
    return r && reinterpret_cast<uintptr_t>(p) + n <= base + r->size;
}

// -- copies shared by the entry points -----------------------------------------------------

// The pinned range the worker of `ctx` maps that holds [host, host + n) wholly, with the
// offset of `host` in it; null if there is none.
static const SharedHost* mapped_range(CUctx_st* ctx, const void* host, size_t n, uint64_t* offset) {
    uintptr_t base = 0;
    const HostRange* r = find_host_range(host, &base);
    const uintptr_t at = reinterpret_cast<uintptr_t>(host);
    if (!r || !r->shared || at + n < at || at + n > base + r->size || !ctx->conn->shares_host(*r->shared)) return nullptr;
    *offset = at - reinterpret_cast<uintptr_t>(r->shared->data());   // a registered range's file starts at its first page
    return r->shared.get();
}

// A copy between host and device in a stream capture becomes a memcpy node: the host memory is
// read or written again each time the graph runs, as CUDA's capture does.
static CUDA_MEMCPY3D linear_copy(CUmemorytype to, uint64_t dst, CUmemorytype from, uint64_t src, size_t n) {
    CUDA_MEMCPY3D p{};
    p.dstMemoryType = to;
    p.srcMemoryType = from;
    if (to == CU_MEMORYTYPE_HOST) p.dstHost = reinterpret_cast<void*>(dst);
    else p.dstDevice = dst;
    if (from == CU_MEMORYTYPE_HOST) p.srcHost = reinterpret_cast<const void*>(src);
    else p.srcDevice = src;
    p.WidthInBytes = n;
    p.Height = p.Depth = 1;
    return p;
}

static CUresult copy_to_device_in(CUctx_st* ctx, CUdeviceptr dst, const void* src, size_t n, CUstream stream,
                                  bool async_api) {
    Target t;
    CUresult err = on_context(ctx, stream, &t);
    if (err != CUDA_SUCCESS) return err;
    if (n == 0) return CUDA_SUCCESS;
    if (!src || !device_range_ok(dst, n)) return CUDA_ERROR_INVALID_VALUE;
    if (capture_of(stream))
        return async_api ? capture_copy(stream, linear_copy(CU_MEMORYTYPE_DEVICE, dst, CU_MEMORYTYPE_HOST,
                                                           reinterpret_cast<uint64_t>(src), n))
                         : refuse_in_capture(stream);     // a synchronous copy cannot be captured, as in CUDA
    // A copy the worker makes in place, of a pinned range it maps: the synchronous form waits for it.
    uint64_t offset = 0;
    if (const SharedHost* h = mapped_range(ctx, src, n, &offset))
        return send(t, wire::Call::memcpy_pinned(dst, src, h->id(), offset, n, t.sid, true, !async_api));
    if (n >= staging::kMinCopy && ctx->conn->staging()) {
        ctx->conn->copy_to_device_staged(dst, src, n, t.sid);
        return CUDA_SUCCESS;
    }
    // The application may not touch pinned memory until an async copy completes: borrow it.
    if (async_api && is_pinned(src, n))
        return send(t, wire::Call::memcpy_htod(dst, t.sid, wire::Payload::borrow(src, n), false));
    if (n <= static_cast<size_t>(settings().inline_copy_max))
        return send(t, wire::Call::memcpy_htod(dst, t.sid, wire::Payload::copy_of(src, n), false));
    return send(t, wire::Call::memcpy_htod(dst, t.sid, wire::Payload::borrow(src, n), true));
}

static CUresult copy_to_device(CUdeviceptr dst, const void* src, size_t n, CUstream stream, bool async_api) {
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    return err != CUDA_SUCCESS ? err : copy_to_device_in(ctx, dst, src, n, stream, async_api);
}

static CUresult copy_to_host_in(CUctx_st* ctx, void* dst, CUdeviceptr src, size_t n, CUstream stream, bool async_api) {
    Target t;
    CUresult err = on_context(ctx, stream, &t);
    if (err != CUDA_SUCCESS) return err;
    if (n == 0) return CUDA_SUCCESS;
    if (!dst || !device_range_ok(src, n)) return CUDA_ERROR_INVALID_VALUE;
    if (capture_of(stream))
        return async_api ? capture_copy(stream, linear_copy(CU_MEMORYTYPE_HOST, reinterpret_cast<uint64_t>(dst),
                                                           CU_MEMORYTYPE_DEVICE, src, n))
                         : refuse_in_capture(stream);
    uint64_t offset = 0;
    if (const SharedHost* h = mapped_range(ctx, dst, n, &offset))
        return send(t, wire::Call::memcpy_pinned(src, dst, h->id(), offset, n, t.sid, false, !async_api));
    if (n >= staging::kMinCopy && ctx->conn->staging()) {
        // Waits, even for an asynchronous copy into pinned memory: CUDA allows it to
        // complete early, and the bytes are here sooner than through frames.
        return status_of(ctx->conn->copy_from_device_staged(dst, src, n, t.sid), wire::Kind::memcpyDtoH);
    }
    // An async copy into pinned memory returns at once: its bytes land with a later Reply.
    HostDestination to{dst, n};
    return send(t, wire::Call::memcpy_dtoh(src, n, t.sid, !(async_api && is_pinned(dst, n))), nullptr, &to);
}

static CUresult copy_to_host(void* dst, CUdeviceptr src, size_t n, CUstream stream, bool async_api) {
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    return err != CUDA_SUCCESS ? err : copy_to_host_in(ctx, dst, src, n, stream, async_api);
}

static CUresult copy_on_device_in(CUctx_st* ctx, CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream) {
    Target t;
    CUresult err = on_context(ctx, stream, &t);
    if (err != CUDA_SUCCESS) return err;
    if (n == 0) return CUDA_SUCCESS;
    if (!device_range_ok(dst, n) || !device_range_ok(src, n)) return CUDA_ERROR_INVALID_VALUE;
    return send(t, wire::Call::memcpy_dtod(dst, src, n, t.sid));
}

// A copy between two contexts (cuMemcpyPeer, or a copy whose pointers lie in two contexts'
// memory). Each context is a worker process of its own, maybe on another device, so the bytes
// come here from the source and go on to the destination, a piece at a time: two transfers
// instead of one device-to-device copy, and the copy is done (or failed) when this returns.
// `stream` may be either context's: on the source's, the bytes are read after its work before
// them; on the destination's, they are written in order with its work. The other side uses its
// default stream.
static CUresult copy_between(CUctx_st* dst_ctx, CUdeviceptr dst, CUctx_st* src_ctx, CUdeviceptr src, size_t n,
                             CUstream stream) {
    for (CUctx_st* c : {dst_ctx, src_ctx})
        if (!is_handle(c, HandleKind::context) || make_usable(c) != CUDA_SUCCESS) return CUDA_ERROR_INVALID_CONTEXT;
    if (src_ctx == dst_ctx) return copy_on_device_in(src_ctx, dst, src, n, stream);
    CUstream on_src = nullptr, on_dst = nullptr;
    if (!is_default_stream(stream)) {
        if (!is_handle(stream, HandleKind::stream)) return CUDA_ERROR_INVALID_HANDLE;
        if (stream->ctx == src_ctx) on_src = stream;
        else if (stream->ctx == dst_ctx) on_dst = stream;
        else return CUDA_ERROR_INVALID_HANDLE;
    }
    if (capture_of(stream)) return refuse_in_capture(stream);    // two contexts: no graph of one holds it
    constexpr size_t kPiece = 32 << 20;      // bounds the memory it takes here
    std::vector<char> piece(std::min(n, kPiece));
    for (size_t done = 0; done < n; done += piece.size()) {
        const size_t k = std::min(piece.size(), n - done);
        CUresult err = copy_to_host_in(src_ctx, piece.data(), src + done, k, on_src, false);
        if (err == CUDA_SUCCESS) err = copy_to_device_in(dst_ctx, dst + done, piece.data(), k, on_dst, false);
        if (err != CUDA_SUCCESS) return err;
    }
    return CUDA_SUCCESS;
}

// A device-to-device copy in the contexts its pointers lie in, the current one or others (with
// unified addressing a pointer names its device).
static CUresult copy_on_device(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream) {
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err != CUDA_SUCCESS) return err;
    const DeviceRange* to = find_device_range(dst);
    const DeviceRange* from = find_device_range(src);
    if (to && from && (to->ctx != ctx || from->ctx != ctx)) return copy_between(to->ctx, dst, from->ctx, src, n, stream);
    return copy_on_device_in(ctx, dst, src, n, stream);
}

// A memset of memory the device uses in place (managed, mapped host memory): it is this
// process's memory, so it is set here, once the work before it is done.
static CUresult fill_in_place(void* dst, uint32_t value, int elem_size, size_t count) {
    synchronize_busy_contexts();
    for (size_t i = 0; i < count; i++)
        std::memcpy(static_cast<char*>(dst) + i * elem_size, &value, static_cast<size_t>(elem_size));
    return CUDA_SUCCESS;
}

static CUresult fill(CUdeviceptr dst, uint32_t value, int elem_size, size_t count, CUstream stream) {
    Target t;
    CUresult err = on_current(stream, &t);
    if (err != CUDA_SUCCESS) return err;
    if (count == 0) return CUDA_SUCCESS;
    const HostRange* in_place = find_host_range(reinterpret_cast<void*>(dst));
    if (in_place && in_place->in_place && is_pinned(reinterpret_cast<void*>(dst), count * elem_size))
        return refuse_in_capture(stream) != CUDA_SUCCESS ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
                                                         : fill_in_place(reinterpret_cast<void*>(dst), value, elem_size, count);
    if (dst % static_cast<unsigned>(elem_size) != 0 || !device_range_ok(dst, count * elem_size))
        return CUDA_ERROR_INVALID_VALUE;
    return send(t, wire::Call::memset(dst, value, elem_size, count, t.sid));
}

// cuMemcpy/cuMemcpyAsync infer the direction from the addresses (unified addressing).
static CUresult copy_any(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream, bool async_api) {
    const bool dst_dev = find_device_range(dst) != nullptr;
    const bool src_dev = find_device_range(src) != nullptr;
    void* dst_host = reinterpret_cast<void*>(dst);
    const void* src_host = reinterpret_cast<const void*>(src);
    if (dst_dev && src_dev) return copy_on_device(dst, src, n, stream);
    if (dst_dev) return copy_to_device(dst, src_host, n, stream, async_api);
    if (src_dev) return copy_to_host(dst_host, src, n, stream, async_api);
    // Host to host: let device->host copies that may target these bytes land first.
    synchronize_busy_contexts();
    if (n) std::memmove(dst_host, src_host, n);
    return CUDA_SUCCESS;
}

// 2D and 3D copies between linear memory (host or device; CUDA arrays are not supported),
// row by row through the 1D copies above, or as one copy when the rows lie back to back on
// both sides. Graph memcpy nodes (driver_graph.cpp) run through here too.
static CUresult copy_rows(const CUDA_MEMCPY3D& p, CUstream stream, bool async_api) {
    if (p.srcMemoryType == CU_MEMORYTYPE_ARRAY || p.dstMemoryType == CU_MEMORYTYPE_ARRAY) {
        log_verbose("a 2D/3D copy names a CUDA array: phos has no CUDA arrays");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    auto address = [](CUmemorytype type, const void* host, CUdeviceptr device, bool* on_device) {
        uint64_t a = type == CU_MEMORYTYPE_HOST ? reinterpret_cast<uint64_t>(host) : device;
        // CU_MEMORYTYPE_UNIFIED (cudaMemcpyDefault): the address says where it lies.
        *on_device = type == CU_MEMORYTYPE_DEVICE || (type == CU_MEMORYTYPE_UNIFIED && find_device_range(a));
        return a;
    };
    bool src_dev = false, dst_dev = false;
    const uint64_t src = address(p.srcMemoryType, p.srcHost, p.srcDevice, &src_dev);
    const uint64_t dst = address(p.dstMemoryType, p.dstHost, p.dstDevice, &dst_dev);
    const size_t width = p.WidthInBytes, height = p.Height ? p.Height : 1, depth = p.Depth ? p.Depth : 1;
    const size_t src_pitch = p.srcPitch ? p.srcPitch : width, dst_pitch = p.dstPitch ? p.dstPitch : width;
    const size_t src_rows = p.srcHeight ? p.srcHeight : height, dst_rows = p.dstHeight ? p.dstHeight : height;
    if (width == 0) return CUDA_SUCCESS;
    if (!src || !dst || src_pitch < width || dst_pitch < width || src_rows < height || dst_rows < height)
        return CUDA_ERROR_INVALID_VALUE;
    auto row = [&](uint64_t base, size_t pitch, size_t rows, size_t x, size_t y, size_t z) {
        return base + ((z * rows + y) * pitch + x);
    };
    auto one = [&](uint64_t d, uint64_t s, size_t n) -> CUresult {
        if (dst_dev && src_dev) return copy_on_device(d, s, n, stream);
        if (dst_dev) return copy_to_device(d, reinterpret_cast<const void*>(s), n, stream, async_api);
        if (src_dev) return copy_to_host(reinterpret_cast<void*>(d), s, n, stream, async_api);
        synchronize_busy_contexts();
        std::memmove(reinterpret_cast<void*>(d), reinterpret_cast<const void*>(s), n);
        return CUDA_SUCCESS;
    };
    const bool packed = src_pitch == width && dst_pitch == width && (depth == 1 || (src_rows == height && dst_rows == height));
    if (packed)
        return one(row(dst, dst_pitch, dst_rows, p.dstXInBytes, p.dstY, p.dstZ),
                   row(src, src_pitch, src_rows, p.srcXInBytes, p.srcY, p.srcZ), width * height * depth);
    for (size_t z = 0; z < depth; z++)
        for (size_t y = 0; y < height; y++) {
            CUresult err = one(row(dst, dst_pitch, dst_rows, p.dstXInBytes, p.dstY + y, p.dstZ + z),
                               row(src, src_pitch, src_rows, p.srcXInBytes, p.srcY + y, p.srcZ + z), width);
            if (err != CUDA_SUCCESS) return err;
        }
    return CUDA_SUCCESS;
}

CUresult copy_3d(const CUDA_MEMCPY3D& p, CUstream stream, bool async_api) { return copy_rows(p, stream, async_api); }

static CUDA_MEMCPY3D as_3d(const CUDA_MEMCPY2D& p) {
    CUDA_MEMCPY3D q{};
    q.srcXInBytes = p.srcXInBytes; q.srcY = p.srcY; q.srcMemoryType = p.srcMemoryType; q.srcHost = p.srcHost;
    q.srcDevice = p.srcDevice; q.srcArray = p.srcArray; q.srcPitch = p.srcPitch;
    q.dstXInBytes = p.dstXInBytes; q.dstY = p.dstY; q.dstMemoryType = p.dstMemoryType; q.dstHost = p.dstHost;
    q.dstDevice = p.dstDevice; q.dstArray = p.dstArray; q.dstPitch = p.dstPitch;
    q.WidthInBytes = p.WidthInBytes; q.Height = p.Height; q.Depth = 1;
    return q;
}

static size_t page_round(size_t n) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    return (n + page - 1) / page * page;
}

// Pinned memory the current context's worker maps too, when it shares our host (it maps our
// staging area) and agrees; else null. Smaller allocations than a staged copy stay private:
// their copies travel in frames about as fast, and a file and a round trip each cost more.
static std::shared_ptr<SharedHost> share_with_worker(size_t n) {
    CUctx_st* ctx = nullptr;
    if (n < staging::kMinCopy || current_context(&ctx) != CUDA_SUCCESS || !ctx->conn->staging()) return nullptr;
    std::shared_ptr<SharedHost> h = SharedHost::make(n);
    if (h && !ctx->conn->shares_host(*h)) {
        ctx->conn->forget_host(*h);
        h.reset();
    }
    return h;
}

// Memory the device reads and writes in place (schema/phos.capnp, "Memory the device reads and
// writes in place"): a shared file, mapped here and by the current context's worker at the same
// address, which the device then addresses there too. Fails, saying why, where that cannot be.
static CUresult in_place_alloc(void** pp, size_t n, unsigned flags, bool managed, const char* call) {
    if (!pp || n == 0) return CUDA_ERROR_INVALID_VALUE;
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err != CUDA_SUCCESS) return err;
    std::shared_ptr<SharedHost> h = SharedHost::make(n, true);
    if (!h) {
        log_error("%s: cannot make %zu bytes of shared memory for the device to use in place", call, n);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    std::string why;
    if (!ctx->conn->map_in_place(*h, why)) {
        log_error("%s: the device cannot use %zu bytes of this process's memory in place: %s", call, n, why.c_str());
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    HostRange range{n, flags, true, h};
    range.in_place = true;
    range.managed = managed;
    state().host[reinterpret_cast<uintptr_t>(h->data())] = std::move(range);
    *pp = h->data();
    return CUDA_SUCCESS;
}

static CUresult host_alloc(void** pp, size_t n, unsigned flags) {
    if (flags & CU_MEMHOSTALLOC_DEVICEMAP) return in_place_alloc(pp, n, flags, false, "cuMemHostAlloc(DEVICEMAP)");
    if (!pp || n == 0) return CUDA_ERROR_INVALID_VALUE;
    std::shared_ptr<SharedHost> shared = share_with_worker(n);
    void* p = shared ? shared->data() : nullptr;
    if (!p && posix_memalign(&p, static_cast<size_t>(sysconf(_SC_PAGESIZE)), page_round(n)) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    state().host[reinterpret_cast<uintptr_t>(p)] = HostRange{n, flags, true, std::move(shared)};
    *pp = p;
    return CUDA_SUCCESS;
}

// A shared range goes: every worker that maps it is told so.
static void forget_everywhere(const SharedHost& h) {
    for (CUctx_st* ctx : state().contexts)
        if (ctx->live && ctx->conn) ctx->conn->forget_host(h);
}

// True where a shared range (its whole pages) meets the pages [start, end).
static bool shares_pages(uintptr_t start, uintptr_t end) {
    for (const auto& [at, range] : state().host) {
        if (at >= end + static_cast<uintptr_t>(sysconf(_SC_PAGESIZE))) break;
        const SharedHost* h = range.shared.get();
        const uintptr_t lo = h ? reinterpret_cast<uintptr_t>(h->data()) : 0;
        if (h && lo < end && start < lo + h->size()) return true;
    }
    return false;
}

// cuMemHostRegister with DEVICEMAP: the device is in another process, so the application's
// pages are made shared where they are (SharedHost::adopt) and the current context's worker maps
// them at the same address, as memory allocated for the device in place is (in_place_alloc).
// Where the worker does not share our host, or cannot map that address, the call fails saying
// why, and the pages are left as they were.
static CUresult register_in_place(void* p, size_t n, unsigned flags) {
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err != CUDA_SUCCESS) return err;
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE)), a = reinterpret_cast<uintptr_t>(p);
    if (shares_pages(a / page * page, (a + n + page - 1) / page * page)) {
        log_error("cuMemHostRegister(DEVICEMAP) of %zu bytes at %p: its pages hold memory the device uses in place "
                  "already; the device shares whole pages with this process, so one page cannot be registered twice",
                  n, p);
        return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    }
    std::string why;
    std::shared_ptr<SharedHost> h = SharedHost::adopt(p, n, why);
    if (h && !ctx->conn->map_in_place(*h, why)) {
        ctx->conn->forget_host(*h);
        h.reset();    // the pages private again, bytes kept
    }
    if (!h) {
        log_error("cuMemHostRegister(DEVICEMAP) of %zu bytes at %p: the device cannot use this memory in place: %s",
                  n, p, why.c_str());
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    HostRange range{n, flags, false, std::move(h)};
    range.in_place = true;
    state().host[a] = std::move(range);
    return CUDA_SUCCESS;
}

}  // namespace phos::driver

using namespace phos;
using namespace phos::driver;

// ======================================================================================
// Exported entry points
// ======================================================================================

PHOS_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* dptr, size_t bytesize) {
    if (!dptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err != CUDA_SUCCESS) return err;
    wire::Result r;
    err = send(ctx, wire::Call::mem_alloc(bytesize), &r);
    if (err != CUDA_SUCCESS) return err;
    if (r.u64s.empty()) return CUDA_ERROR_UNKNOWN;
    state().allocations[r.u64s[0]] = DeviceRange{bytesize, ctx};
    *dptr = r.u64s[0];
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    State& s = state();
    Guard g(s.lock);
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err != CUDA_SUCCESS) return err;
    if (dptr == 0) return CUDA_SUCCESS;      // as the driver: NVIDIA's runtime frees NULL to start a context
    auto managed = s.host.find(static_cast<uintptr_t>(dptr));
    if (managed != s.host.end() && managed->second.managed) return cuMemFreeHost(reinterpret_cast<void*>(dptr));
    auto it = s.allocations.find(dptr);
    if (it == s.allocations.end() || it->second.physical) return CUDA_ERROR_INVALID_VALUE;   // cuMemUnmap's to free
    CUctx_st* owner = it->second.ctx;
    s.allocations.erase(it);
    return send(owner, wire::Call::mem_free(dptr));
}

PHOS_EXPORT CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total_bytes) {
    Guard g(state().lock);
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err != CUDA_SUCCESS) return err;
    wire::Result r;
    err = send(ctx, wire::Call::plain(wire::Kind::memGetInfo), &r);
    if (err != CUDA_SUCCESS) return err;
    if (free_bytes) *free_bytes = r.u64s.size() > 0 ? r.u64s[0] : 0;
    if (total_bytes) *total_bytes = r.u64s.size() > 1 ? r.u64s[1] : 0;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size, CUdeviceptr dptr) {
    Guard g(state().lock);
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err != CUDA_SUCCESS) return err;
    uint64_t b = 0;
    const DeviceRange* r = find_device_range(dptr, &b);
    if (!r) return CUDA_ERROR_NOT_FOUND;
    if (base) *base = b;
    if (size) *size = r->size;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    Guard g(state().lock);
    return copy_to_device(dst, src, n, nullptr, false);
}

PHOS_EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream stream) {
    Guard g(state().lock);
    return copy_to_device(dst, src, n, stream, true);
}

PHOS_EXPORT CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    Guard g(state().lock);
    return copy_to_host(dst, src, n, nullptr, false);
}

PHOS_EXPORT CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream stream) {
    Guard g(state().lock);
    return copy_to_host(dst, src, n, stream, true);
}

PHOS_EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    Guard g(state().lock);
    return copy_on_device(dst, src, n, nullptr);
}

PHOS_EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream) {
    Guard g(state().lock);
    return copy_on_device(dst, src, n, stream);
}

PHOS_EXPORT CUresult cuMemcpyPeer(CUdeviceptr dst, CUcontext dst_ctx, CUdeviceptr src, CUcontext src_ctx, size_t n) {
    Guard g(state().lock);
    CUresult err = require_init();
    return err != CUDA_SUCCESS ? err : copy_between(dst_ctx, dst, src_ctx, src, n, nullptr);
}

PHOS_EXPORT CUresult cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dst_ctx, CUdeviceptr src, CUcontext src_ctx, size_t n,
                                       CUstream stream) {
    Guard g(state().lock);
    CUresult err = require_init();
    return err != CUDA_SUCCESS ? err : copy_between(dst_ctx, dst, src_ctx, src, n, stream);
}

PHOS_EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    Guard g(state().lock);
    return copy_any(dst, src, n, nullptr, false);
}

PHOS_EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream) {
    Guard g(state().lock);
    return copy_any(dst, src, n, stream, true);
}

PHOS_EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t n) {
    Guard g(state().lock);
    return fill(dst, value, 1, n, nullptr);
}

PHOS_EXPORT CUresult cuMemsetD16_v2(CUdeviceptr dst, unsigned short value, size_t n) {
    Guard g(state().lock);
    return fill(dst, value, 2, n, nullptr);
}

PHOS_EXPORT CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned int value, size_t n) {
    Guard g(state().lock);
    return fill(dst, value, 4, n, nullptr);
}

PHOS_EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t n, CUstream stream) {
    Guard g(state().lock);
    return fill(dst, value, 1, n, stream);
}

PHOS_EXPORT CUresult cuMemsetD16Async(CUdeviceptr dst, unsigned short value, size_t n, CUstream stream) {
    Guard g(state().lock);
    return fill(dst, value, 2, n, stream);
}

PHOS_EXPORT CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned int value, size_t n, CUstream stream) {
    Guard g(state().lock);
    return fill(dst, value, 4, n, stream);
}

// -- page-locked host memory: memory the workers on our host map (host_alloc), else ordinary
//    memory the stub tracks as "pinned" ------------------------------------------------------

PHOS_EXPORT CUresult cuMemAllocHost_v2(void** pp, size_t bytesize) {
    Guard g(state().lock);
    return host_alloc(pp, bytesize, 0);
}

PHOS_EXPORT CUresult cuMemHostAlloc(void** pp, size_t bytesize, unsigned int flags) {
    Guard g(state().lock);
    return host_alloc(pp, bytesize, flags);
}

PHOS_EXPORT CUresult cuMemFreeHost(void* p) {
    State& s = state();
    Guard g(s.lock);
    auto it = s.host.find(reinterpret_cast<uintptr_t>(p));
    if (it == s.host.end() || !it->second.allocated) return CUDA_ERROR_INVALID_VALUE;
    synchronize_busy_contexts();   // copies may still read or write these bytes
    if (const std::shared_ptr<SharedHost>& shared = it->second.shared) forget_everywhere(*shared);
    else free(p);
    s.host.erase(it);              // a shared range: its mapping and its file's name go with it
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuMemHostRegister_v2(void* p, size_t bytesize, unsigned int flags) {
    State& s = state();
    Guard g(s.lock);
    if (!p || bytesize == 0 || reinterpret_cast<uintptr_t>(p) + bytesize < reinterpret_cast<uintptr_t>(p))
        return CUDA_ERROR_INVALID_VALUE;
    uintptr_t a = reinterpret_cast<uintptr_t>(p);
    auto next = s.host.lower_bound(a);
    if (find_host_range(p) || (next != s.host.end() && next->first < a + bytesize))
        return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    if (flags & CU_MEMHOSTREGISTER_DEVICEMAP) return register_in_place(p, bytesize, flags);
    s.host[a] = HostRange{bytesize, flags, false, nullptr};
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuMemHostUnregister(void* p) {
    State& s = state();
    Guard g(s.lock);
    auto it = s.host.find(reinterpret_cast<uintptr_t>(p));
    if (it == s.host.end() || it->second.allocated) return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    synchronize_busy_contexts();   // kernels may still use a range registered with DEVICEMAP
    if (const std::shared_ptr<SharedHost>& shared = it->second.shared) forget_everywhere(*shared);
    s.host.erase(it);              // a shared range: its pages private again (SharedHost's destructor)
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuMemAllocManaged(CUdeviceptr* dptr, size_t bytesize, unsigned int flags) {
    if (!dptr || (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST)) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    void* p = nullptr;
    CUresult err = in_place_alloc(&p, bytesize, flags, true, "cuMemAllocManaged");
    if (err == CUDA_SUCCESS) *dptr = reinterpret_cast<CUdeviceptr>(p);
    return err;
}

// Memory the device uses in place has one address, the application's (flags: 0, as CUDA asks).
PHOS_EXPORT CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* dptr, void* p, unsigned int flags) {
    if (!dptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    const HostRange* r = find_host_range(p);
    if (!r || !r->in_place) {
        log_verbose("cuMemHostGetDevicePointer: %p is not memory the device uses in place "
                    "(cuMemHostAlloc with DEVICEMAP, cuMemAllocManaged)", p);
        return CUDA_ERROR_INVALID_VALUE;
    }
    *dptr = reinterpret_cast<CUdeviceptr>(p);
    return CUDA_SUCCESS;
}

// Managed memory lives in one place, the application's pages, which the device uses in place:
// there is nothing to move or to advise, and every stream may touch it.
static CUresult check_in_place(CUdeviceptr p, size_t n) {
    const HostRange* r = find_host_range(reinterpret_cast<void*>(p));
    return r && r->in_place && is_pinned(reinterpret_cast<void*>(p), n) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

PHOS_EXPORT CUresult cuMemPrefetchAsync_v2(CUdeviceptr p, size_t n, CUmemLocation, unsigned int, CUstream) {
    Guard g(state().lock);
    return check_in_place(p, n);
}

PHOS_EXPORT CUresult cuMemAdvise_v2(CUdeviceptr p, size_t n, CUmem_advise, CUmemLocation) {
    Guard g(state().lock);
    return check_in_place(p, n);
}

PHOS_EXPORT CUresult cuStreamAttachMemAsync(CUstream, CUdeviceptr p, size_t n, unsigned int) {
    Guard g(state().lock);
    return check_in_place(p, n ? n : 1);
}

PHOS_EXPORT CUresult cuMemHostGetFlags(unsigned int* flags, void* p) {
    if (!flags) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    const HostRange* r = find_host_range(p);
    if (!r) return CUDA_ERROR_INVALID_VALUE;
    *flags = r->flags;
    return CUDA_SUCCESS;
}

// -- pointer attributes ------------------------------------------------------------------

static CUresult pointer_attribute(void* data, CUpointer_attribute attribute, CUdeviceptr ptr) {
    uint64_t dbase = 0;
    uintptr_t hbase = 0;
    const DeviceRange* dev = find_device_range(ptr, &dbase);
    const HostRange* host = dev ? nullptr : find_host_range(reinterpret_cast<void*>(ptr), &hbase);
    if (!dev && !host) return CUDA_ERROR_INVALID_VALUE;
    CUctx_st* ctx = dev ? dev->ctx : nullptr;
    if (!ctx && !context_stack().empty()) ctx = context_stack().back();
    switch (attribute) {
    case CU_POINTER_ATTRIBUTE_CONTEXT: *static_cast<CUcontext*>(data) = ctx; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        *static_cast<unsigned*>(data) = dev ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
        // Pinned host memory answers with its own address, as under unified addressing on a
        // GPU; the device it is remoted to cannot read it there (see README, pinned memory).
        *static_cast<CUdeviceptr*>(data) = ptr;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
        if (!host) return CUDA_ERROR_INVALID_VALUE;
        *static_cast<void**>(data) = reinterpret_cast<void*>(ptr);
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: *static_cast<int*>(data) = host && host->managed; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *static_cast<int*>(data) = ctx ? ctx->device : 0; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
        *static_cast<CUdeviceptr*>(data) = dev ? dbase : hbase;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *static_cast<size_t*>(data) = dev ? dev->size : host->size; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MAPPED: *static_cast<int*>(data) = 1; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
    case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID:
    case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR:
        *static_cast<unsigned long long*>(data) = dev ? dbase : hbase;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MAPPING_SIZE: *static_cast<size_t*>(data) = dev ? dev->size : host->size; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS: *static_cast<int*>(data) = 0; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS: *static_cast<unsigned*>(data) = CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_P2P_TOKENS: return CUDA_ERROR_NOT_SUPPORTED;
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE: *static_cast<void**>(data) = nullptr; return CUDA_SUCCESS;
    default: *static_cast<unsigned*>(data) = 0; return CUDA_SUCCESS;   // capabilities phos does not offer
    }
}

PHOS_EXPORT CUresult cuPointerGetAttribute(void* data, CUpointer_attribute attribute, CUdeviceptr ptr) {
    if (!data) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = require_init();
    if (err != CUDA_SUCCESS) return err;
    return pointer_attribute(data, attribute, ptr);
}

// Like the driver, an unknown pointer is not an error here: its attributes read as empty.
PHOS_EXPORT CUresult cuPointerGetAttributes(unsigned int count, CUpointer_attribute* attributes, void** data,
                                            CUdeviceptr ptr) {
    if (!attributes || !data) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = require_init();
    if (err != CUDA_SUCCESS) return err;
    for (unsigned i = 0; i < count; i++) {
        if (!data[i]) continue;
        err = pointer_attribute(data[i], attributes[i], ptr);
        if (err == CUDA_ERROR_INVALID_VALUE) {
            switch (attributes[i]) {
            case CU_POINTER_ATTRIBUTE_CONTEXT:
            case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
            case CU_POINTER_ATTRIBUTE_HOST_POINTER:
            case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
            case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
            case CU_POINTER_ATTRIBUTE_BUFFER_ID: std::memset(data[i], 0, 8); break;
            case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *static_cast<int*>(data[i]) = -2; break;
            default: *static_cast<unsigned*>(data[i]) = 0; break;
            }
        } else if (err != CUDA_SUCCESS) {
            return err;
        }
    }
    return CUDA_SUCCESS;
}

// -- tensor maps: the server's driver encodes them (TensorMapEncode, phos.capnp) -----------

namespace {
template <typename T>
void put(std::string& out, const T& v) {
    out.append(reinterpret_cast<const char*>(&v), sizeof v);
}
template <typename T, size_t N>
void put_array(std::string& out, const T* values, unsigned n) {
    for (size_t i = 0; i < N; i++) put<T>(out, i < n && values ? values[i] : T{});
}

// The arguments both encodings share, around the ones of each (TensorMapEncode.args).
std::string tensor_map_head(CUtensorMapDataType type, cuuint32_t rank, void* address, const cuuint64_t* dims,
                            const cuuint64_t* strides) {
    std::string a;
    put<uint32_t>(a, type);
    put<uint32_t>(a, rank);
    put<uint64_t>(a, reinterpret_cast<uint64_t>(address));
    put_array<cuuint64_t, 5>(a, dims, rank);
    put_array<cuuint64_t, 4>(a, strides, rank - 1);
    return a;
}

void tensor_map_tail(std::string& a, cuuint32_t rank, const cuuint32_t* element_strides, CUtensorMapInterleave interleave,
                     CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill oob) {
    put_array<cuuint32_t, 5>(a, element_strides, rank);
    for (uint32_t v : {uint32_t(interleave), uint32_t(swizzle), uint32_t(l2), uint32_t(oob)}) put(a, v);
}

CUresult encode_tensor_map(CUtensorMap* map, bool im2col, std::string args) {
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err != CUDA_SUCCESS) return err;
    wire::Call call = wire::Call::plain(wire::Kind::tensorMapEncode);
    call.flags = im2col ? 1 : 0;
    call.bytes = std::move(args);
    wire::Result r;
    if ((err = send(ctx, std::move(call), &r)) != CUDA_SUCCESS) return err;
    if (r.data.size() != sizeof *map) return CUDA_ERROR_UNKNOWN;
    std::memcpy(map, r.data.data(), sizeof *map);
    return CUDA_SUCCESS;
}
}  // namespace

PHOS_EXPORT CUresult cuTensorMapEncodeTiled(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* address,
                                            const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                                            const cuuint32_t* element_strides, CUtensorMapInterleave interleave,
                                            CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2,
                                            CUtensorMapFloatOOBfill oob) {
    if (!map || !dims || !box || !element_strides || rank == 0 || rank > 5 || (rank > 1 && !strides)) {
        log_verbose("cuTensorMapEncodeTiled: missing arguments or rank %u", rank);
        return CUDA_ERROR_INVALID_VALUE;
    }
    Guard g(state().lock);
    std::string a = tensor_map_head(type, rank, address, dims, strides);
    put_array<cuuint32_t, 5>(a, box, rank);
    tensor_map_tail(a, rank, element_strides, interleave, swizzle, l2, oob);
    return encode_tensor_map(map, false, std::move(a));
}

PHOS_EXPORT CUresult cuTensorMapEncodeIm2col(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* address,
                                             const cuuint64_t* dims, const cuuint64_t* strides, const int* lower,
                                             const int* upper, cuuint32_t channels, cuuint32_t pixels,
                                             const cuuint32_t* element_strides, CUtensorMapInterleave interleave,
                                             CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2,
                                             CUtensorMapFloatOOBfill oob) {
    if (!map || !dims || !element_strides || !lower || !upper || rank < 3 || rank > 5 || !strides)
        return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    std::string a = tensor_map_head(type, rank, address, dims, strides);
    put_array<int, 3>(a, lower, rank - 2);
    put_array<int, 3>(a, upper, rank - 2);
    put<uint32_t>(a, channels);
    put<uint32_t>(a, pixels);
    tensor_map_tail(a, rank, element_strides, interleave, swizzle, l2, oob);
    return encode_tensor_map(map, true, std::move(a));
}

// -- stream-ordered allocation -------------------------------------------------------------
// The server allocates at once and frees after the device's work is done (a free waits for
// it there), which is one valid order of the stream's work. A pool is bookkeeping here: its
// memory is the context's, which checkpoints, restores and handoffs carry as any allocation.

struct CUmemPoolHandle_st {
    int device = 0;
    uint64_t release_threshold = 0;
    int reuse_flags = 1;               // follow-event, opportunistic and internal-dependency reuse
    uint64_t used = 0, used_high = 0;
};

namespace {
CUmemPoolHandle_st* default_pool(int device) {
    static std::map<int, CUmemPoolHandle_st*> pools;     // never freed, as the driver's
    auto& p = pools[device];
    if (!p) {
        p = new CUmemPoolHandle_st();
        p->device = device;
        state().handles[p] = HandleKind::mem_pool;
    }
    return p;
}
}  // namespace

PHOS_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr* dptr, size_t bytesize, CUmemoryPool pool, CUstream stream) {
    Guard g(state().lock);
    if (!is_handle(pool, HandleKind::mem_pool)) return CUDA_ERROR_INVALID_VALUE;
    CUresult err = refuse_in_capture(stream);    // graphs hold no allocation nodes here
    if (err == CUDA_SUCCESS) err = cuMemAlloc_v2(dptr, bytesize);
    if (err != CUDA_SUCCESS) return err;
    state().allocations[*dptr].pool = pool;
    pool->used += bytesize;
    pool->used_high = std::max(pool->used_high, pool->used);
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuMemAllocAsync(CUdeviceptr* dptr, size_t bytesize, CUstream stream) {
    Guard g(state().lock);
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err != CUDA_SUCCESS) return err;
    return cuMemAllocFromPoolAsync(dptr, bytesize, default_pool(ctx->device), stream);
}

PHOS_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream) {
    Guard g(state().lock);
    CUresult err = refuse_in_capture(stream);
    if (err != CUDA_SUCCESS) return err;
    auto range = state().allocations.find(dptr);
    const DeviceRange freed = range == state().allocations.end() ? DeviceRange{} : range->second;
    if ((err = cuMemFree_v2(dptr)) != CUDA_SUCCESS) return err;
    if (freed.pool) freed.pool->used -= std::min<uint64_t>(freed.pool->used, freed.size);
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool* pool, CUdevice dev) {
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = check_device(dev);
    if (err == CUDA_SUCCESS) *pool = default_pool(dev);
    return err;
}

PHOS_EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool* pool, CUdevice dev) { return cuDeviceGetDefaultMemPool(pool, dev); }

PHOS_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t) {
    Guard g(state().lock);
    return is_handle(pool, HandleKind::mem_pool) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;   // nothing is cached
}

PHOS_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void* value) {
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    if (!is_handle(pool, HandleKind::mem_pool)) return CUDA_ERROR_INVALID_VALUE;
    switch (attr) {
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: pool->release_threshold = *static_cast<cuuint64_t*>(value); return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: pool->reuse_flags = *static_cast<int*>(value); return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
        if (*static_cast<cuuint64_t*>(value) != 0) return CUDA_ERROR_INVALID_VALUE;   // only a reset
        pool->used_high = pool->used;
        return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

PHOS_EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void* value) {
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    if (!is_handle(pool, HandleKind::mem_pool)) return CUDA_ERROR_INVALID_VALUE;
    switch (attr) {
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: *static_cast<cuuint64_t*>(value) = pool->release_threshold; return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: *static_cast<int*>(value) = pool->reuse_flags; return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT:
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: *static_cast<cuuint64_t*>(value) = pool->used; return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: *static_cast<cuuint64_t*>(value) = pool->used_high; return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

// -- 2D and 3D copies of linear memory (copy_rows) ----------------------------------------

PHOS_EXPORT CUresult cuMemcpy2D_v2(const CUDA_MEMCPY2D* p) {
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    return copy_rows(as_3d(*p), nullptr, false);
}
PHOS_EXPORT CUresult cuMemcpy2DUnaligned_v2(const CUDA_MEMCPY2D* p) { return cuMemcpy2D_v2(p); }
PHOS_EXPORT CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D* p, CUstream stream) {
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    return copy_rows(as_3d(*p), stream, true);
}
PHOS_EXPORT CUresult cuMemcpy3D_v2(const CUDA_MEMCPY3D* p) {
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    return copy_rows(*p, nullptr, false);
}
PHOS_EXPORT CUresult cuMemcpy3DAsync_v2(const CUDA_MEMCPY3D* p, CUstream stream) {
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    return copy_rows(*p, stream, true);
}
