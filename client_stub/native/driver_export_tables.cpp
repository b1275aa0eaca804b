// Driver API: cuGetExportTable, the driver's private tables that NVIDIA's own runtime
// (libcudart 13, and the copies linked into cuBLAS, cuBLASLt and cuDNN) asks for.
//
// A table is an array of function pointers, most starting with their own size in bytes.
// Each one here is built from the public driver calls phos implements: a runtime that
// loads its kernels through it reaches the server as ordinary module loads and launches,
// so what the runtime does above the driver stays in the application's process.
// The layouts are the ones documented by public reverse-engineering work (ZLUDA's
// dark_api, LUPINE's client); slots nobody has seen called are left empty, as there. Each
// table is as long as the H200's driver (580) says in its first slot
// (perf/probe_export_tables.c); that driver has no heap-access table, so neither has phos.
#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <set>
#include <string>
#include <utility>

#include "driver_state.h"
#include "md2.h"

using namespace phos;
using namespace phos::driver;

namespace {

using Table = const void*;
template <typename F>
constexpr Table fn(F* f) {
    return reinterpret_cast<Table>(f);
}
constexpr Table size_of(size_t slots) { return reinterpret_cast<Table>(slots * sizeof(void*)); }

// -- the runtime's interface: modules from fatbins, the primary context ------------------

CUresult module_from_fatbin_wrapper(CUmodule* module, const void* wrapper) {
    if (!module || !wrapper) return CUDA_ERROR_INVALID_VALUE;
    log_verbose("cuGetExportTable: a module from a fatbin");
    return cuModuleLoadData(module, wrapper);
}

// The extended forms take options the runtime passes as NULL / 0; anything else is unknown.
CUresult module_from_fatbin_wrapper_ext(CUmodule* module, const void* wrapper, void* a3, void* a4, unsigned a5) {
    if (a3 || a4 || a5) {
        log_error("cuGetExportTable: a module load with unknown options (%p, %p, %u)", a3, a4, a5);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    return module_from_fatbin_wrapper(module, wrapper);
}

CUresult module_from_fatbin(const void* fatbin, CUmodule* module, void* a3, void* a4, unsigned a5) {
    return module_from_fatbin_wrapper_ext(module, fatbin, a3, a4, a5);
}

// The device's primary context, without retaining or opening it.
CUresult primary_context(CUcontext* pctx, CUdevice dev) {
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = check_device(dev);
    if (err != CUDA_SUCCESS) return err;
    *pctx = primary_context_of(dev);
    return CUDA_SUCCESS;
}

void runtime_notice(size_t value) { log_verbose("cuGetExportTable: runtime notice %zu", value); }
CUresult load_compilers() { return CUDA_SUCCESS; }

Table kRuntimeInterface[13] = {
    size_of(13), fn(module_from_fatbin_wrapper), fn(primary_context), nullptr, nullptr, nullptr,
    fn(module_from_fatbin_wrapper_ext), fn(runtime_notice), fn(module_from_fatbin), nullptr, nullptr, nullptr,
    fn(load_compilers),
};

// -- tools: profiler hooks phos does not drive ------------------------------------------

int no_tool() { return 0; }

// Buffers the runtime's tool callbacks write their state into.
uint32_t tool_buffer_large[1024];
uint32_t tool_buffer_small[14];
void tool_buffer_1(void** p, size_t* n) {
    *p = tool_buffer_large;
    *n = sizeof tool_buffer_large / sizeof tool_buffer_large[0];
}
void tool_buffer_2(void** p, size_t* n) {
    *p = tool_buffer_small;
    *n = sizeof tool_buffer_small / sizeof tool_buffer_small[0];
}

// cuBLASLt keys its kernel registry by the context this answers (and by the context's id,
// below): without it every candidate kernel is dropped and a GEMM is "not supported".
CUresult tools_current_context(CUcontext* ctx) {
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    return cuCtxGetCurrent(ctx);
}
const Table kToolsTls[3] = {size_of(3), fn(no_tool), fn(tools_current_context)};
const Table kToolsCallbackHooks[7] = {size_of(7),  fn(no_tool), fn(tool_buffer_1), fn(no_tool),
                                      fn(no_tool), fn(no_tool), fn(tool_buffer_2)};

// -- context-local storage: a value per (context, key), kept on the context --------------

CUresult storage_context(CUcontext ctx, CUctx_st** out) {
    if (!ctx) {
        auto& stack = context_stack();
        if (stack.empty() || !stack.back()) return CUDA_ERROR_INVALID_CONTEXT;
        ctx = stack.back();
    }
    if (!is_handle(ctx, HandleKind::context)) return CUDA_ERROR_INVALID_CONTEXT;
    *out = ctx;
    return CUDA_SUCCESS;
}

// A key holds its first value: putting it again is refused and changes nothing, as with the
// H200's driver (perf/probe_context_storage.py);
// a runtime that races to set up its state keeps the state that won.
CUresult storage_put(CUcontext ctx, void* key, void* value, LocalStorageDestructor destructor) {
    Guard g(state().lock);
    CUctx_st* c;
    CUresult err = storage_context(ctx, &c);
    if (err != CUDA_SUCCESS) return err;
    return c->local_storage.emplace(key, LocalValue{value, destructor}).second ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

// The caller frees the value itself: the destructor runs only when the context goes.
CUresult storage_delete(CUcontext ctx, void* key) {
    Guard g(state().lock);
    CUctx_st* c;
    CUresult err = storage_context(ctx, &c);
    if (err != CUDA_SUCCESS) return err;
    return c->local_storage.erase(key) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult storage_get(void** value, CUcontext ctx, void* key) {
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUctx_st* c;
    CUresult err = storage_context(ctx, &c);
    if (err != CUDA_SUCCESS) return err;
    auto it = c->local_storage.find(key);
    if (it == c->local_storage.end()) return CUDA_ERROR_INVALID_HANDLE;
    *value = it->second.value;
    return CUDA_SUCCESS;
}

const Table kContextLocalStorage[4] = {fn(storage_put), fn(storage_delete), fn(storage_get), nullptr};

// -- contexts, heaps, device extensions ---------------------------------------------------

// A context's identity: slot 4 is cuCtxGetId (the H200's driver answers the same number). The
// table is as long as that driver's, 93 slots; the rest stay empty.
CUresult context_identity(CUcontext ctx, unsigned long long* id) { return cuCtxGetId(ctx, id); }
Table kContextIdentity[93] = {size_of(93), nullptr, nullptr, nullptr, fn(context_identity)};

CUresult create_context_bypass(CUcontext* pctx, unsigned flags, CUdevice dev) {
    return cuCtxCreate_v4(pctx, nullptr, flags, dev);
}
const Table kContextCreateBypass[2] = {size_of(2), fn(create_context_bypass)};

CUresult device_attribute_ext(CUdevice dev, unsigned attribute, int unknown, size_t (*result)[2]) {
    if (!result) return CUDA_ERROR_INVALID_VALUE;
    int value = 0;
    CUresult err = cuDeviceGetAttribute(&value, static_cast<CUdevice_attribute>(attribute), dev);
    if (err == CUDA_SUCCESS) {
        (*result)[0] = static_cast<size_t>(value);
        (*result)[1] = 0;
    }
    log_verbose("cuGetExportTable: device attribute %u (%d) -> %d, %d", attribute, unknown, value, static_cast<int>(err));
    return err;
}
CUresult device_flag(unsigned char* result, CUdevice dev) {
    log_verbose("cuGetExportTable: device flag of %d", dev);
    if (result) *result = 0;
    return CUDA_SUCCESS;
}
Table kDeviceExtended[31] = {};

// The H200's driver answers 0 and leaves the detail as it was.
CUresult context_check(CUcontext, unsigned* result, const void**) {
    if (result) *result = 0;
    return CUDA_SUCCESS;
}
unsigned context_check_2() {
    log_verbose("cuGetExportTable: context check 2");
    return 0;
}
Table kContextChecks[15] = {size_of(15), nullptr, fn(context_check), fn(context_check_2)};

// -- slots the H200's driver fills and phos leaves empty --------------------------------------
// What they do is not public. With PHOS_VERBOSE=2 each is filled with a function that names
// its table and slot when called, and fails: a library that needs one then says which,
// instead of finding the slot empty (perf/probe_context_storage.py lists the driver's slots).

const char* const kUnknownSlotTables[] = {"runtime interface", "device extended", "context checks", "context identity",
                                          "1734dc26"};

template <int kTable, int kSlot>
CUresult unknown_slot() {
    static std::atomic<bool> said{false};
    if (!said.exchange(true)) log_error("unsupported CUDA export table call: %s, slot %d", kUnknownSlotTables[kTable], kSlot);
    return CUDA_ERROR_NOT_SUPPORTED;
}

template <int kTable, size_t... kSlot>
void fill_unknown(Table* table, size_t filled_by_driver, std::index_sequence<kSlot...>) {
    ((kSlot > 0 && kSlot < filled_by_driver && !table[kSlot] ? table[kSlot] = fn(unknown_slot<kTable, int(kSlot)>) : nullptr), ...);
}

// cuBLASLt asks for this table before it uses one of its nvjet kernels, and crashes without
// it; what its slots do is not public. Each fails, naming itself, so that cuBLASLt says which.
Table kTable1734dc26[17] = {size_of(17)};

// -- the runtime's integrity check ---------------------------------------------------------
// The runtime passes its version and the time, and compares the answer with an HMAC-MD2 it
// computes itself over this process, the tables' addresses and every device's identity.

CUresult integrity_check(unsigned version, uint64_t unix_seconds, uint64_t (*result)[2]);
const Table kIntegrityCheck[3] = {size_of(3), fn(integrity_check), nullptr};

struct IntegrityInput {
    uint32_t driver_version;
    uint32_t runtime_version;
    uint32_t process;
    uint32_t thread;
    const void* runtime_table;
    const void* integrity_table;
    const void* integrity_function;
    uint64_t unix_seconds;
};
static_assert(sizeof(IntegrityInput) == 48);

struct DeviceIdentity {
    CUuuid uuid;
    int32_t pci_domain;
    int32_t pci_bus;
    int32_t pci_device;
};
static_assert(sizeof(DeviceIdentity) == 28);

CUresult integrity_check(unsigned version, uint64_t unix_seconds, uint64_t (*result)[2]) {
    if (!result) return CUDA_ERROR_INVALID_VALUE;
    log_verbose("cuGetExportTable: integrity check for runtime %u", version);
    // Runtimes whose version ends in 0 or 1 expect fixed answers.
    if (version % 10 == 0 || version % 10 == 1) {
        (*result)[0] = version % 10 == 0 ? 0x3341181C03CB675Cull : 0x1841181C03CB675Cull;
        (*result)[1] = 0x8ED383AA1F4CD1E8ull;
        return CUDA_SUCCESS;
    }
    int driver_version = 0, count = 0;
    CUresult err = cuDriverGetVersion(&driver_version);
    if (err == CUDA_SUCCESS) err = cuDeviceGetCount(&count);
    if (err != CUDA_SUCCESS) return err;
    IntegrityInput input = {static_cast<uint32_t>(driver_version), version, static_cast<uint32_t>(getpid()),
                            static_cast<uint32_t>(pthread_self()), kRuntimeInterface, kIntegrityCheck,
                            reinterpret_cast<const void*>(&integrity_check), unix_seconds};
    std::vector<DeviceIdentity> devices(static_cast<size_t>(count));
    for (int d = 0; d < count; d++) {
        DeviceIdentity& id = devices[static_cast<size_t>(d)];
        std::memset(&id, 0, sizeof id);
        if ((err = cuDeviceGetUuid_v2(&id.uuid, d)) != CUDA_SUCCESS ||
            (err = cuDeviceGetAttribute(&id.pci_domain, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, d)) != CUDA_SUCCESS ||
            (err = cuDeviceGetAttribute(&id.pci_bus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, d)) != CUDA_SUCCESS ||
            (err = cuDeviceGetAttribute(&id.pci_device, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, d)) != CUDA_SUCCESS)
            return err;
    }
    static const uint8_t kKey[16] = {0x14, 0x6A, 0xDD, 0xAE, 0x53, 0xA9, 0xA7, 0x52,
                                     0xAA, 0x08, 0x41, 0x36, 0x0B, 0xF5, 0x5A, 0x9F};
    const md2::Part parts[2] = {{&input, sizeof input}, {devices.data(), devices.size() * sizeof(DeviceIdentity)}};
    uint8_t digest[16];
    md2::hmac(kKey, parts, 2, digest);
    std::memcpy(*result, digest, 16);
    return CUDA_SUCCESS;
}

// -- the tables, by id ---------------------------------------------------------------------

struct ExportTable {
    const char* name;
    uint8_t id[16];
    const Table* table;
};

const ExportTable kTables[] = {
    {"runtime interface", {0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a, 0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9},
     kRuntimeInterface},
    {"tools TLS", {0x42, 0xd8, 0x5a, 0x81, 0x23, 0xf6, 0xcb, 0x47, 0x82, 0x98, 0xf6, 0xe7, 0x8a, 0x3a, 0xec, 0xdc},
     kToolsTls},
    {"tools callback hooks", {0xa0, 0x94, 0x79, 0x8c, 0x2e, 0x74, 0x2e, 0x74, 0x93, 0xf2, 0x08, 0x00, 0x20, 0x0c, 0x0a, 0x66},
     kToolsCallbackHooks},
    {"context-local storage", {0xc6, 0x93, 0x33, 0x6e, 0x11, 0x21, 0xdf, 0x11, 0xa8, 0xc3, 0x68, 0xf3, 0x55, 0xd8, 0x95, 0x93},
     kContextLocalStorage},
    {"context create bypass", {0x0c, 0xa5, 0x0b, 0x8c, 0x10, 0x04, 0x92, 0x9a, 0x89, 0xa7, 0xd0, 0xdf, 0x10, 0xe7, 0x72, 0x86},
     kContextCreateBypass},
    {"device extended", {0xb1, 0x05, 0x41, 0xe1, 0xf7, 0xc7, 0xc7, 0x4a, 0x9f, 0x64, 0xf2, 0x23, 0xbe, 0x99, 0xf1, 0xe2},
     kDeviceExtended},
    {"integrity check", {0xd4, 0x08, 0x20, 0x55, 0xbd, 0xe6, 0x70, 0x4b, 0x8d, 0x34, 0xba, 0x12, 0x3c, 0x66, 0xe1, 0xf2},
     kIntegrityCheck},
    {"context checks", {0x26, 0x3e, 0x88, 0x60, 0x7c, 0xd2, 0x61, 0x43, 0x92, 0xf6, 0xbb, 0xd5, 0x00, 0x6d, 0xfa, 0x7e},
     kContextChecks},
    {"1734dc26", {0x17, 0x34, 0xdc, 0x26, 0x80, 0x0d, 0x47, 0x45, 0x87, 0x26, 0xc0, 0xf1, 0xe7, 0xdd, 0x8b, 0xca},
     kTable1734dc26},
    {"context identity", {0x21, 0x31, 0x8c, 0x60, 0x97, 0x14, 0x32, 0x48, 0x8c, 0xa6, 0x41, 0xff, 0x73, 0x24, 0xc8, 0xf2},
     kContextIdentity},
};

std::string uuid_text(const CUuuid& id) {
    static const char kHex[] = "0123456789abcdef";
    std::string s;
    for (int i = 0; i < 16; i++) {
        if (i == 4 || i == 6 || i == 8 || i == 10) s += '-';
        auto b = static_cast<uint8_t>(id.bytes[i]);
        s += kHex[b >> 4];
        s += kHex[b & 15];
    }
    return s;
}

}  // namespace

PHOS_EXPORT CUresult cuGetExportTable(const void** table, const CUuuid* id) {
    if (!table || !id) return CUDA_ERROR_INVALID_VALUE;
    *table = nullptr;
    static const bool device_extended_filled = [] {
        kDeviceExtended[0] = size_of(31);
        kDeviceExtended[5] = fn(device_attribute_ext);
        kDeviceExtended[13] = fn(device_flag);
        fill_unknown<4>(kTable1734dc26, 17, std::make_index_sequence<17>());
        if (settings().trace) {     // slots 1-9 and 11-12; 1-29; 1-14 (slot 10 of the first stays empty there too)
            fill_unknown<0>(kRuntimeInterface, 10, std::make_index_sequence<13>());
            kRuntimeInterface[11] = kRuntimeInterface[11] ? kRuntimeInterface[11] : fn(unknown_slot<0, 11>);
            fill_unknown<1>(kDeviceExtended, 30, std::make_index_sequence<31>());
            fill_unknown<2>(kContextChecks, 15, std::make_index_sequence<15>());
            fill_unknown<3>(kContextIdentity, 93, std::make_index_sequence<93>());
        }
        return true;
    }();
    (void)device_extended_filled;
    for (const auto& t : kTables) {
        if (std::memcmp(t.id, id->bytes, 16) != 0) continue;
        log_verbose("cuGetExportTable: %s", t.name);
        *table = t.table;
        return CUDA_SUCCESS;
    }
    // Tables the runtime asks for and goes on without (the driver has them; what they do is
    // not public): noted only when verbose.
    static const char* const kOptional[] = {"f8cff951-2146-8b4e-b9e2-fb469e7c0dd9", "69a28e9f-2449-8b47-b030-c5da330ea4e9"};
    static std::mutex said_lock;
    static std::set<std::string> said;
    std::string text = uuid_text(*id);
    std::lock_guard<std::mutex> g(said_lock);
    bool optional = false;
    for (const char* o : kOptional) optional |= text == o;
    if (!said.insert(text).second) return CUDA_ERROR_INVALID_VALUE;
    if (optional) log_verbose("cuGetExportTable: no table {%s}; the runtime goes on without it", text.c_str());
    else log_error("unsupported CUDA export table {%s}", text.c_str());
    return CUDA_ERROR_INVALID_VALUE;
}
