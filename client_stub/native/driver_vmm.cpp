// Driver API: virtual memory management (cuMemAddressReserve, cuMemCreate, cuMemMap and
// the rest), as PyTorch's expandable segments use it: reserve a range, then map physical
// allocations into it one after another as the segment grows, and unmap them as it shrinks.
//
// The server owns the context's addresses, so a reserved range is the server's
// (memReserve), and a mapping is an allocation the server places at that address inside it
// (memAlloc with `at`): checkpoints, restores and handoffs keep both where they were. A
// physical allocation exists here only as its size until it is mapped, and is mapped whole
// and once; what phos does not model (partial or shared mappings, exported handles) is
// refused by name.
#include "driver_state.h"

using namespace phos;
using namespace phos::driver;

namespace {

// Every size and address here is a multiple of this: the H200's granularity, which both the
// server's driver (its own) and emu (256 bytes) divide.
constexpr size_t kGranularity = 2u << 20;

bool aligned(uint64_t v) { return v % kGranularity == 0; }

PhysicalAllocation* physical(CUmemGenericAllocationHandle handle) {
    auto it = state().physical.find(handle);
    return it == state().physical.end() ? nullptr : it->second.get();
}

CUresult check_properties(const CUmemAllocationProp* prop) {
    if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    // Shareable handle types may be asked for (PyTorch asks, in case it shares memory between
    // processes later); exporting one is what phos refuses, by name (cuMemExportToShareableHandle).
    return check_device(prop->location.id);
}

// The reservation of the current context that holds [ptr, ptr + size), or null.
Reservation* reservation_holding(CUdeviceptr ptr, size_t size, CUctx_st* ctx) {
    auto& reserved = state().reserved;
    auto it = reserved.upper_bound(ptr);
    if (it == reserved.begin()) return nullptr;
    --it;
    Reservation& r = it->second;
    return r.ctx == ctx && ptr + size <= it->first + r.size ? &r : nullptr;
}

// The cuMemMap mapping that holds ptr, or null.
const DeviceRange* mapping_holding(CUdeviceptr ptr) {
    const DeviceRange* r = find_device_range(ptr, nullptr);
    return r && r->physical ? r : nullptr;
}

// The memory goes once it is neither mapped nor referenced.
void drop_if_unused(CUmemGenericAllocationHandle handle) {
    PhysicalAllocation* p = physical(handle);
    if (p && !p->mapped_at && p->references == 0) state().physical.erase(handle);
}

}  // namespace

PHOS_EXPORT CUresult cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                                   CUmemAllocationGranularity_flags) {
    if (!granularity) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = require_init();
    if (err == CUDA_SUCCESS) err = check_properties(prop);
    if (err == CUDA_SUCCESS) *granularity = kGranularity;
    return err;
}

PHOS_EXPORT CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                         unsigned long long flags) {
    if (!ptr || size == 0 || !aligned(size) || flags || (alignment & (alignment - 1))) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err != CUDA_SUCCESS) return err;
    wire::Call call = wire::Call::plain(wire::Kind::memReserve);
    call.size = size;
    call.address2 = alignment;
    call.address = addr;
    wire::Result r;
    if ((err = send(ctx, std::move(call), &r)) != CUDA_SUCCESS) return err;
    if (r.u64s.empty()) return CUDA_ERROR_UNKNOWN;
    state().reserved[r.u64s[0]] = Reservation{size, ctx};
    *ptr = r.u64s[0];
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    Guard g(state().lock);
    auto it = state().reserved.find(ptr);
    if (it == state().reserved.end() || it->second.size != size) return CUDA_ERROR_INVALID_VALUE;
    wire::Call call = wire::Call::plain(wire::Kind::memUnreserve);
    call.address = ptr;
    CUresult err = send(it->second.ctx, std::move(call));     // refused while anything is mapped there
    if (err == CUDA_SUCCESS) state().reserved.erase(it);
    return err;
}

PHOS_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                                 unsigned long long flags) {
    if (!handle || size == 0 || !aligned(size) || flags) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = require_init();
    if (err == CUDA_SUCCESS) err = check_properties(prop);
    if (err != CUDA_SUCCESS) return err;
    auto p = std::make_unique<PhysicalAllocation>();
    p->size = size;
    p->prop = *prop;
    *handle = reinterpret_cast<CUmemGenericAllocationHandle>(p.get());
    state().physical[*handle] = std::move(p);
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    Guard g(state().lock);
    PhysicalAllocation* p = physical(handle);
    if (!p || p->references == 0) return CUDA_ERROR_INVALID_VALUE;
    p->references--;
    drop_if_unused(handle);
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                              unsigned long long flags) {
    if (flags || !aligned(ptr) || !aligned(size)) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    PhysicalAllocation* p = physical(handle);
    if (!p || p->references == 0) return CUDA_ERROR_INVALID_HANDLE;
    if (offset != 0 || size != p->size || p->mapped_at) {
        log_error("cuMemMap: phos maps a physical allocation whole and once (offset %zu, %zu of %zu bytes, mapped at %#llx)",
                  offset, size, p->size, (unsigned long long)p->mapped_at);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err != CUDA_SUCCESS) return err;
    if (!reservation_holding(ptr, size, ctx)) return CUDA_ERROR_INVALID_VALUE;
    wire::Result r;
    if ((err = send(ctx, wire::Call::mem_alloc(size, ptr), &r)) != CUDA_SUCCESS) return err;
    DeviceRange range{size, ctx};
    range.physical = handle;
    state().allocations[ptr] = range;
    p->mapped_at = ptr;
    return CUDA_SUCCESS;
}

// Unmapping frees each mapping in the range, in order after the work before it.
PHOS_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    if (!aligned(ptr) || !aligned(size) || size == 0) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    auto& allocations = state().allocations;
    for (auto it = allocations.lower_bound(ptr); it != allocations.end() && it->first < ptr + size;) {
        if (!it->second.physical) return CUDA_ERROR_INVALID_VALUE;     // cuMemAlloc's memory is not mapped
        ++it;
    }
    for (auto it = allocations.lower_bound(ptr); it != allocations.end() && it->first < ptr + size;) {
        CUmemGenericAllocationHandle handle = it->second.physical;
        send(it->second.ctx, wire::Call::mem_free(it->first));
        if (PhysicalAllocation* p = physical(handle)) p->mapped_at = 0;
        it = allocations.erase(it);
        drop_if_unused(handle);
    }
    return CUDA_SUCCESS;
}

// The device reaches every mapping of its context for reading and writing; a request for
// that, or for reading alone, over mapped memory is granted as it is.
PHOS_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
    if (!desc || count == 0 || !aligned(ptr) || !aligned(size)) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || check_device(desc[i].location.id) != CUDA_SUCCESS)
            return CUDA_ERROR_INVALID_DEVICE;
        if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_NONE) {
            log_error("cuMemSetAccess: phos does not take a mapping's access away");
            return CUDA_ERROR_NOT_SUPPORTED;
        }
    }
    auto& allocations = state().allocations;
    for (CUdeviceptr at = ptr; at < ptr + size;) {
        auto it = allocations.find(at);
        if (it == allocations.end() || !it->second.physical) return CUDA_ERROR_INVALID_VALUE;
        at += it->second.size;
    }
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuMemGetAccess(unsigned long long* flags, const CUmemLocation* location, CUdeviceptr ptr) {
    if (!flags || !location) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    if (!mapping_holding(ptr)) return CUDA_ERROR_INVALID_VALUE;
    *flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp* prop, CUmemGenericAllocationHandle handle) {
    if (!prop) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    PhysicalAllocation* p = physical(handle);
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    *prop = p->prop;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle* handle, void* addr) {
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    const DeviceRange* mapping = mapping_holding(reinterpret_cast<CUdeviceptr>(addr));
    if (!mapping) return CUDA_ERROR_INVALID_VALUE;
    physical(mapping->physical)->references++;
    *handle = mapping->physical;
    return CUDA_SUCCESS;
}
