// Driver API: modules, functions, kernel launches and occupancy.
#include <elf.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>

#include "blake2b.h"
#include "driver_state.h"
#include "phos.capnp.h"   // generated at build time by `capnp compile -oc++`

namespace phos::driver {

constexpr uint32_t kFatbinMagic = 0xBA55ED50;
constexpr uint32_t kFatbinWrapperMagic = 0x466243B1;
constexpr uint32_t kLaunchCooperative = 1u << 24;    // Launch.config's options (phos.capnp)

// A fatbin: {u32 magic; u16 version; u16 header_size; u64 size of what follows}.
static size_t fatbin_size(const uint8_t* p) {
    uint16_t header_size;
    uint64_t size;
    std::memcpy(&header_size, p + 6, 2);
    std::memcpy(&size, p + 8, 8);
    return header_size + size;
}

// A cubin: the furthest byte any header, section or segment names.
static size_t elf_size(const uint8_t* p) {
    Elf64_Ehdr eh;
    std::memcpy(&eh, p, sizeof eh);
    size_t end = std::max<size_t>(sizeof eh, eh.e_shoff + size_t(eh.e_shnum) * eh.e_shentsize);
    end = std::max<size_t>(end, eh.e_phoff + size_t(eh.e_phnum) * eh.e_phentsize);
    for (unsigned i = 0; i < eh.e_shnum && eh.e_shentsize >= sizeof(Elf64_Shdr); i++) {
        Elf64_Shdr sh;
        std::memcpy(&sh, p + eh.e_shoff + size_t(i) * eh.e_shentsize, sizeof sh);
        if (sh.sh_type != SHT_NOBITS) end = std::max<size_t>(end, sh.sh_offset + sh.sh_size);
    }
    return end;
}

// The bytes of a module image handed to cuModuleLoadData and friends: a fatbin, a fatbin
// wrapper (what __cudaRegisterFatBinary gets), a cubin, or NUL-terminated PTX text.
bool image_bytes(const void* image, const void** data, size_t* size) {
    const auto* p = static_cast<const uint8_t*>(image);
    uint32_t magic;
    std::memcpy(&magic, p, 4);
    if (magic == kFatbinMagic) {
        *data = p;
        *size = fatbin_size(p);
    } else if (magic == kFatbinWrapperMagic) {
        const uint8_t* fatbin;
        std::memcpy(&fatbin, p + 8, sizeof fatbin);
        if (!fatbin) return false;
        std::memcpy(&magic, fatbin, 4);
        if (magic != kFatbinMagic) return false;
        *data = fatbin;
        *size = fatbin_size(fatbin);
    } else if (std::memcmp(p, ELFMAG, SELFMAG) == 0) {
        *data = p;
        *size = elf_size(p);
    } else {
        *data = p;
        *size = std::strlen(static_cast<const char*>(image));
    }
    return *size > 0;
}

// Images this big are named by their digest first: the server may keep them from an earlier
// load (cuBLAS's and cuDNN's libraries are megabytes each, loaded by every process).
constexpr size_t kByDigestMin = 256 << 10;

static CUresult load_module(CUmodule* module, wire::Payload image) {
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err != CUDA_SUCCESS) return err;
    wire::Result r;
    std::string digest;
    if (image.size >= kByDigestMin) {
        digest = blake2b::digest256(image.data(), image.size);
        wire::Call call = wire::Call::module_load(image, digest);
        call.flags |= wire::Call::kByDigest;
        const uint64_t before = ctx->conn->last_seq();
        r = ctx->conn->call(std::move(call));    // not kept there: no error, the image follows
        const bool missed = r.status == CUDA_ERROR_NOT_FOUND && ctx->conn->last_seq() == before + 1;
        if (r.status != CUDA_SUCCESS && !missed) return status_of(r, wire::Kind::moduleLoad);   // or an earlier call's
        // The log keeps it as a load with the image (a replay's server may not keep it). One
        // that missed must not load it again there, before the call that sends the image.
        if (missed) ctx->conn->replay_as_nothing(before + 1);
    }
    if (digest.empty() || r.status != CUDA_SUCCESS)
        err = send(ctx, wire::Call::module_load(std::move(image), std::move(digest)), &r);
    if (err != CUDA_SUCCESS) return err;
    auto* m = new CUmod_st();
    m->ctx = ctx;
    m->id = r.u64s.empty() ? 0 : r.u64s[0];
    ctx->modules.insert(m);
    state().handles[m] = HandleKind::module;
    *module = m;
    return CUDA_SUCCESS;
}

static CUresult load_module_from_memory(CUmodule* module, const void* image) {
    if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
    const void* data;
    size_t size;
    if (!image_bytes(image, &data, &size)) return CUDA_ERROR_INVALID_IMAGE;
    // Borrowing is safe: loading is synchronous, so the bytes are read before we return.
    return load_module(module, wire::Payload::borrow(data, size));
}

static CUresult check_launch_shape(const CUctx_st* ctx, const unsigned grid[3], const unsigned block[3],
                                   unsigned shared_bytes) {
    const DeviceLimits& l = ctx->limits;
    uint64_t threads = uint64_t(block[0]) * block[1] * block[2];
    for (int i = 0; i < 3; i++) {
        if (grid[i] == 0 || block[i] == 0) return CUDA_ERROR_INVALID_VALUE;
        if (block[i] > static_cast<unsigned>(l.max_block[i]) || grid[i] > static_cast<unsigned>(l.max_grid[i]))
            return CUDA_ERROR_INVALID_VALUE;
    }
    if (threads > static_cast<uint64_t>(l.max_threads_per_block)) return CUDA_ERROR_INVALID_VALUE;
    if (shared_bytes > static_cast<unsigned>(l.max_shared_optin)) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

// Packs the arguments the way the kernel lays them out (moduleGetFunction's params).
CUresult pack_params(const CUfunc_st* f, void** kernel_params, void** extra, std::string& out) {
    out.assign(f->params_size, '\0');
    if (kernel_params && extra) return CUDA_ERROR_INVALID_VALUE;
    if (kernel_params) {
        for (size_t i = 0; i < f->params.size(); i++) {
            if (!kernel_params[i]) return CUDA_ERROR_INVALID_VALUE;
            std::memcpy(&out[f->params[i].offset], kernel_params[i], f->params[i].size);
        }
        return CUDA_SUCCESS;
    }
    if (extra) {
        const void* buffer = nullptr;
        size_t size = 0;
        for (size_t i = 0; extra[i] != CU_LAUNCH_PARAM_END; i += 2) {
            if (extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER) buffer = extra[i + 1];
            else if (extra[i] == CU_LAUNCH_PARAM_BUFFER_SIZE) size = *static_cast<size_t*>(extra[i + 1]);
            else return CUDA_ERROR_INVALID_VALUE;
        }
        if (f->params_size == 0) return CUDA_SUCCESS;
        if (!buffer || size < f->params_size) return CUDA_ERROR_INVALID_VALUE;
        std::memcpy(&out[0], buffer, f->params_size);
        return CUDA_SUCCESS;
    }
    return f->params.empty() ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult launch(CUfunction f, const unsigned grid[3], const unsigned block[3], unsigned shared_bytes,
                       CUstream stream, void** kernel_params, void** extra, uint32_t options = 0) {
    CUresult err = require_init();
    if (err != CUDA_SUCCESS) return err;
    if ((err = resolve_function(f, &f)) != CUDA_SUCCESS) return err;
    Target t;
    if ((err = on_context(f->ctx, stream, &t)) != CUDA_SUCCESS) return err;
    if ((err = check_launch_shape(t.ctx, grid, block, shared_bytes)) != CUDA_SUCCESS) {
        log_verbose("launch of %s: grid (%u, %u, %u), block (%u, %u, %u), %u shared bytes are out of bounds", f->name.c_str(),
                    grid[0], grid[1], grid[2], block[0], block[1], block[2], shared_bytes);
        return err;
    }
    std::string params;
    if ((err = pack_params(f, kernel_params, extra, params)) != CUDA_SUCCESS) {
        log_verbose("launch of %s: its parameters could not be packed", f->name.c_str());
        return err;
    }
    return send(t, wire::Call::launch(f->id, wire::Dim3{grid[0], grid[1], grid[2]},
                                      wire::Dim3{block[0], block[1], block[2]}, shared_bytes, t.sid, std::move(params),
                                      options));
}

// A cuOccupancy* answer from the server's driver (FuncOccupancy, phos.capnp); each asked once
// per function, since frameworks ask again before many launches.
static CUresult occupancy(CUfunction f, int query, uint64_t a, uint64_t b, uint32_t flags, std::vector<uint64_t>* out,
                          uint64_t grid = 0) {
    CUresult err = resolve_function(f, &f);
    if (err != CUDA_SUCCESS) return err;
    auto key = std::make_tuple(query, a, b, flags, grid);
    auto it = f->occupancy.find(key);
    if (it == f->occupancy.end()) {
        wire::Call call = wire::Call::plain(wire::Kind::funcOccupancy);
        call.id = f->id;
        call.number = query;
        call.address = a;
        call.size = b;
        call.flags = flags;
        call.address2 = grid;
        wire::Result r;
        if ((err = send(f->ctx, std::move(call), &r)) != CUDA_SUCCESS) return err;
        if (r.u64s.empty()) return CUDA_ERROR_UNKNOWN;
        log_verbose("occupancy of %s: query %d (%llu, %llu, %u, grid %llx) -> %llu", f->name.c_str(), query,
                    (unsigned long long)a, (unsigned long long)b, flags, (unsigned long long)grid,
                    (unsigned long long)r.u64s[0]);
        it = f->occupancy.emplace(key, r.u64s).first;
    }
    *out = it->second;
    return CUDA_SUCCESS;
}

// FuncOccupancy.Query (phos.capnp), by number.
constexpr int kMaxActiveBlocks = static_cast<int>(::FuncOccupancy::Query::MAX_ACTIVE_BLOCKS);
constexpr int kAvailableDynamicShared = static_cast<int>(::FuncOccupancy::Query::AVAILABLE_DYNAMIC_SHARED);
constexpr int kMaxPotentialBlockSize = static_cast<int>(::FuncOccupancy::Query::MAX_POTENTIAL_BLOCK_SIZE);
constexpr int kMaxActiveClusters = static_cast<int>(::FuncOccupancy::Query::MAX_ACTIVE_CLUSTERS);

}  // namespace phos::driver

using namespace phos;
using namespace phos::driver;

// ======================================================================================
// Exported entry points
// ======================================================================================

PHOS_EXPORT CUresult cuModuleLoadData(CUmodule* module, const void* image) {
    Guard g(state().lock);
    return load_module_from_memory(module, image);
}

PHOS_EXPORT CUresult cuModuleLoadFatBinary(CUmodule* module, const void* fatbin) {
    Guard g(state().lock);
    return load_module_from_memory(module, fatbin);
}

PHOS_EXPORT CUresult cuModuleLoadDataEx(CUmodule* module, const void* image, unsigned int count, CUjit_option* options,
                                        void** values) {
    Guard g(state().lock);
    // JIT options steer NVIDIA's compiler, which phos does not run here; answer the log
    // options with empty logs so callers that print them print nothing.
    for (unsigned i = 0; options && values && i < count; i++) {
        if (options[i] == CU_JIT_INFO_LOG_BUFFER || options[i] == CU_JIT_ERROR_LOG_BUFFER) {
            if (values[i]) *static_cast<char*>(values[i]) = '\0';
        } else if (options[i] == CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES || options[i] == CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES) {
            values[i] = nullptr;
        }
    }
    return load_module_from_memory(module, image);
}

PHOS_EXPORT CUresult cuModuleLoad(CUmodule* module, const char* fname) {
    if (!module || !fname) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    std::ifstream f(fname, std::ios::binary);
    if (!f) return CUDA_ERROR_FILE_NOT_FOUND;
    std::ostringstream bytes;
    bytes << f.rdbuf();
    std::string image = bytes.str();
    if (image.empty()) return CUDA_ERROR_INVALID_IMAGE;
    const void* data;
    size_t size;
    image.push_back('\0');   // so PTX text reads as a C string
    if (!image_bytes(image.data(), &data, &size)) return CUDA_ERROR_INVALID_IMAGE;
    return load_module(module, wire::Payload::copy_of(data, size));
}

PHOS_EXPORT CUresult cuModuleUnload(CUmodule module) {
    State& s = state();
    Guard g(s.lock);
    Target t;
    CUresult err = on_handle(module, HandleKind::module, nullptr, &t);
    if (err != CUDA_SUCCESS) return err;
    send(t, wire::Call::with_id(wire::Kind::moduleUnload, module->id));
    forget_library_module(module);
    for (auto& f : module->functions) s.handles.erase(f.second.get());
    module->ctx->modules.erase(module);
    s.handles.erase(module);
    delete module;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuModuleGetFunction(CUfunction* out, CUmodule module, const char* name) {
    if (!out || !name) return CUDA_ERROR_INVALID_VALUE;
    State& s = state();
    Guard g(s.lock);
    Target t;
    CUresult err = on_handle(module, HandleKind::module, nullptr, &t);
    if (err != CUDA_SUCCESS) return err;
    auto it = module->functions.find(name);
    if (it == module->functions.end()) {
        wire::Result r;
        err = send(t, wire::Call::module_symbol(wire::Kind::moduleGetFunction, module->id, name), &r);
        if (err != CUDA_SUCCESS) return err;
        auto f = std::make_unique<CUfunc_st>();
        f->ctx = module->ctx;
        f->module = module;
        f->id = r.u64s.empty() ? 0 : r.u64s[0];
        f->name = name;
        f->params = r.params;
        for (const auto& p : f->params) f->params_size = std::max<size_t>(f->params_size, size_t(p.offset) + p.size);
        // The device's own figures for the kernel follow its id (calls.module_get_function).
        for (size_t i = 1; i < r.u64s.size(); i++) f->attributes.push_back(static_cast<int>(r.u64s[i]));
        if (f->attributes.size() > CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
            f->max_dynamic_shared = f->attributes[CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES];
        s.handles[f.get()] = HandleKind::function;
        it = module->functions.emplace(name, std::move(f)).first;
    }
    *out = it->second.get();
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuModuleGetGlobal_v2(CUdeviceptr* dptr, size_t* bytes, CUmodule module, const char* name) {
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    Target t;
    CUresult err = on_handle(module, HandleKind::module, nullptr, &t);
    if (err != CUDA_SUCCESS) return err;
    wire::Result r;
    err = send(t, wire::Call::module_symbol(wire::Kind::moduleGetGlobal, module->id, name), &r);
    if (err != CUDA_SUCCESS) return err;
    if (r.u64s.size() < 2) return CUDA_ERROR_UNKNOWN;
    state().globals[r.u64s[0]] = DeviceRange{static_cast<size_t>(r.u64s[1]), module->ctx};
    if (dptr) *dptr = r.u64s[0];
    if (bytes) *bytes = r.u64s[1];
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuFuncGetParamInfo(CUfunction f, size_t index, size_t* offset, size_t* size) {
    Guard g(state().lock);
    if (!is_handle(f, HandleKind::function)) return CUDA_ERROR_INVALID_HANDLE;
    if (index >= f->params.size()) return CUDA_ERROR_INVALID_VALUE;
    if (offset) *offset = f->params[index].offset;
    if (size) *size = f->params[index].size;
    return CUDA_SUCCESS;
}

// CUDA 13.1 added this; cuda-python asks for it.
PHOS_EXPORT CUresult cuFuncGetParamCount(CUfunction f, size_t* count) {
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    if (!is_handle(f, HandleKind::function)) return CUDA_ERROR_INVALID_HANDLE;
    *count = f->params.size();
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuFuncGetName(const char** name, CUfunction f) {
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    if (!is_handle(f, HandleKind::function)) return CUDA_ERROR_INVALID_HANDLE;
    *name = f->name.c_str();
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuFuncGetModule(CUmodule* module, CUfunction f) {
    if (!module) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    if (!is_handle(f, HandleKind::function)) return CUDA_ERROR_INVALID_HANDLE;
    *module = f->module;
    return CUDA_SUCCESS;
}

// The device's figures, reported with the function; the two the application sets come
// from what it set.
PHOS_EXPORT CUresult cuFuncGetAttribute(int* value, CUfunction_attribute attribute, CUfunction f) {
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = resolve_function(f, &f);
    if (err != CUDA_SUCCESS) return err;
    if (attribute == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) *value = f->max_dynamic_shared;
    else if (attribute == CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT) *value = f->shared_carveout;
    else if (attribute >= 0 && static_cast<size_t>(attribute) < f->attributes.size()) *value = f->attributes[attribute];
    else {
        log_verbose("cuFuncGetAttribute: attribute %d of %s is not known", static_cast<int>(attribute), f->name.c_str());
        return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuFuncSetCacheConfig(CUfunction f, CUfunc_cache) {
    Guard g(state().lock);
    return resolve_function(f, &f);   // a hint
}

// The server's driver is told (the kernel runs there, and a restore tells the next one); the
// two the launch checks and cuFuncGetAttribute reports are kept here too.
PHOS_EXPORT CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute attribute, int value) {
    Guard g(state().lock);
    CUresult err = resolve_function(f, &f);
    if (err != CUDA_SUCCESS) return err;
    switch (attribute) {
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
        if (value < 0 || value > f->ctx->limits.max_shared_optin) return CUDA_ERROR_INVALID_VALUE;
        break;
    case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT:
        if (value < -1 || value > 100) return CUDA_ERROR_INVALID_VALUE;
        break;
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH:
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT:
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH:
    case CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED:
    case CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE:
        break;
    default:
        log_error("cuFuncSetAttribute: attribute %d cannot be set", static_cast<int>(attribute));
        return CUDA_ERROR_INVALID_VALUE;
    }
    // Libraries set the same value before every launch (flash attention's kernels do): the
    // server has it already, and a round trip each held PyTorch's attention 2.3x slower.
    if (auto was = f->set.find(attribute); was != f->set.end() && was->second == value) return CUDA_SUCCESS;
    wire::Call call = wire::Call::plain(wire::Kind::funcSetAttribute);
    call.id = f->id;
    call.number = attribute;
    call.flags = static_cast<uint32_t>(value);
    if ((err = send(f->ctx, std::move(call))) != CUDA_SUCCESS) return err;
    if (attribute == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) f->max_dynamic_shared = value;
    else if (attribute == CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT) f->shared_carveout = value;
    else if (static_cast<size_t>(attribute) < f->attributes.size()) f->attributes[attribute] = value;
    f->occupancy.clear();     // the answers may change with it
    f->set[attribute] = value;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                                    unsigned int by, unsigned int bz, unsigned int shared_bytes, CUstream stream,
                                    void** kernel_params, void** extra) {
    Guard g(state().lock);
    const unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    return launch(f, grid, block, shared_bytes, stream, kernel_params, extra);
}

// A cluster-dimension attribute as Launch.config's options carry it (phos.capnp).
static CUresult cluster_option(const CUlaunchAttribute& a, uint32_t* options) {
    const auto& c = a.value.clusterDim;
    if (c.x > 0xFF || c.y > 0xFF || c.z > 0xFF) return CUDA_ERROR_INVALID_CLUSTER_SIZE;
    *options = (*options & ~0xFFFFFFu) | c.x | (c.y << 8) | (c.z << 16);
    return CUDA_SUCCESS;
}

static uint64_t dropped_attributes = 0;    // launch attribute ids dropped so far (under the state's lock)

PHOS_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig* config, CUfunction f, void** kernel_params, void** extra) {
    if (!config || (config->numAttrs && !config->attrs)) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    uint32_t options = 0;
    for (unsigned i = 0; i < config->numAttrs; i++) {
        const CUlaunchAttribute& a = config->attrs[i];
        switch (a.id) {
        case CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION:
            if (CUresult err = cluster_option(a, &options); err != CUDA_SUCCESS) return err;
            break;
        case CU_LAUNCH_ATTRIBUTE_COOPERATIVE:
            if (a.value.cooperative) options |= kLaunchCooperative;
            break;
        // Hints and orderings a launch may drop: without them the kernel runs after the
        // previous work on its stream, as a plain launch does.
        case CU_LAUNCH_ATTRIBUTE_IGNORE:
        case CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW:
        case CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE:
        case CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION:
        case CU_LAUNCH_ATTRIBUTE_PRIORITY:
        case CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN_MAP:
        case CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN:
        case CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT:
            if (a.id < 64 && !(dropped_attributes & (1ull << a.id))) {    // said once each (PHOS_VERBOSE)
                dropped_attributes |= 1ull << a.id;
                log_verbose("cuLaunchKernelEx: launch attribute %d dropped (a hint or ordering)", static_cast<int>(a.id));
            }
            break;
        default:
            log_error("cuLaunchKernelEx: launch attribute %d is not supported", static_cast<int>(a.id));
            return CUDA_ERROR_NOT_SUPPORTED;
        }
    }
    const unsigned grid[3] = {config->gridDimX, config->gridDimY, config->gridDimZ};
    const unsigned block[3] = {config->blockDimX, config->blockDimY, config->blockDimZ};
    return launch(f, grid, block, config->sharedMemBytes, config->hStream, kernel_params, extra, options);
}

PHOS_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                               unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared_bytes,
                                               CUstream stream, void** kernel_params) {
    Guard g(state().lock);
    const unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    return launch(f, grid, block, shared_bytes, stream, kernel_params, nullptr, kLaunchCooperative);
}

PHOS_EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* blocks, CUfunction f, int block_size,
                                                                          size_t dynamic_shared, unsigned int flags) {
    if (!blocks || block_size <= 0) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    std::vector<uint64_t> r;
    CUresult err = occupancy(f, kMaxActiveBlocks, block_size, dynamic_shared, flags, &r);
    if (err == CUDA_SUCCESS) *blocks = static_cast<int>(r[0]);
    return err;
}

PHOS_EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, CUfunction f, int block_size,
                                                                 size_t dynamic_shared) {
    return cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(blocks, f, block_size, dynamic_shared, 0);
}

PHOS_EXPORT CUresult cuOccupancyAvailableDynamicSMemPerBlock(size_t* bytes, CUfunction f, int blocks, int block_size) {
    if (!bytes || blocks <= 0 || block_size <= 0) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    std::vector<uint64_t> r;
    CUresult err = occupancy(f, kAvailableDynamicShared, blocks, block_size, 0, &r);
    if (err == CUDA_SUCCESS) *bytes = r[0];
    return err;
}

// A block-size-dependent shared memory callback would need the server to call back into this
// process for every size it tries: only a constant size is supported.
PHOS_EXPORT CUresult cuOccupancyMaxPotentialBlockSizeWithFlags(int* min_grid, int* block_size, CUfunction f,
                                                               CUoccupancyB2DSize shared_of_size, size_t dynamic_shared,
                                                               int limit, unsigned int flags) {
    if (!min_grid || !block_size) return CUDA_ERROR_INVALID_VALUE;
    if (shared_of_size) {
        log_error("cuOccupancyMaxPotentialBlockSize: a block-size-to-shared-memory callback is not supported");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    Guard g(state().lock);
    std::vector<uint64_t> r;
    CUresult err = occupancy(f, kMaxPotentialBlockSize, dynamic_shared, static_cast<uint64_t>(std::max(limit, 0)), flags, &r);
    if (err != CUDA_SUCCESS) return err;
    if (r.size() < 2) return CUDA_ERROR_UNKNOWN;
    *min_grid = static_cast<int>(r[0]);
    *block_size = static_cast<int>(r[1]);
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuOccupancyMaxPotentialBlockSize(int* min_grid, int* block_size, CUfunction f,
                                                      CUoccupancyB2DSize shared_of_size, size_t dynamic_shared, int limit) {
    return cuOccupancyMaxPotentialBlockSizeWithFlags(min_grid, block_size, f, shared_of_size, dynamic_shared, limit, 0);
}

PHOS_EXPORT CUresult cuOccupancyMaxActiveClusters(int* clusters, CUfunction f, const CUlaunchConfig* config) {
    if (!clusters || !config || (config->numAttrs && !config->attrs)) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    uint32_t cluster = 0;
    for (unsigned i = 0; i < config->numAttrs; i++) {
        if (config->attrs[i].id != CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION) continue;
        if (CUresult err = cluster_option(config->attrs[i], &cluster); err != CUDA_SUCCESS) return err;
    }
    auto packed = [](unsigned x, unsigned y, unsigned z) { return uint64_t(x) | (uint64_t(y) << 21) | (uint64_t(z) << 42); };
    std::vector<uint64_t> r;
    CUresult err = occupancy(f, kMaxActiveClusters, packed(config->blockDimX, config->blockDimY, config->blockDimZ),
                             config->sharedMemBytes, cluster, &r, packed(config->gridDimX, config->gridDimY, config->gridDimZ));
    if (err == CUDA_SUCCESS) *clusters = static_cast<int>(r[0]);
    return err;
}

// Lazy, as NVIDIA's driver by default: NVIDIA's runtime then loads a fatbin when one of its
// kernels is first used, not every fatbin of the process at start (PyTorch registers thousands).
PHOS_EXPORT CUresult cuModuleGetLoadingMode(CUmoduleLoadingMode* mode) {
    if (!mode) return CUDA_ERROR_INVALID_VALUE;
    *mode = CU_MODULE_LAZY_LOADING;
    return CUDA_SUCCESS;
}
