// The driver's objects and process-wide state, shared by the driver_*.cpp files.
//
// A CUcontext, CUmodule, CUfunction, CUstream or CUevent the application holds is a
// pointer to one of the structs below; the server's ids never leave this library
// (they are small integers, and 1 and 2 would collide with CU_STREAM_LEGACY and
// CU_STREAM_PER_THREAD). Every entry point takes `state().lock`.
#pragma once

#include <cuda.h>

#include <map>
#include <tuple>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common.h"
#include "session.h"
#include "wire.h"

#if !defined(CUDA_VERSION) || CUDA_VERSION < 13000
#error "phos's native stub implements the CUDA 13 ABI: build it against CUDA 13 headers (CUDA_HOME)"
#endif

// Launch checks use these device limits; fetched once per device.
struct DeviceLimits {
    int max_threads_per_block = 1024;
    int max_block[3] = {1024, 1024, 64};
    int max_grid[3] = {2147483647, 65535, 65535};
    int max_shared_optin = 48 << 10;
};

// Context-local storage (cuGetExportTable): the runtime's per-context state, whose
// destructor runs when the context goes.
using LocalStorageDestructor = void (*)(CUcontext ctx, void* key, void* value);
struct LocalValue {
    void* value = nullptr;
    LocalStorageDestructor destructor = nullptr;
};

struct CUctx_st {
    uint64_t uid = 0;             // unique in the process, new each time the context is (re)opened
    uint64_t server_id = 0;       // the front end's ctx id
    int device = 0;
    unsigned flags = 0;
    bool primary = false;
    bool live = false;            // false once destroyed; a primary context reopens on next use
    int primary_refs = 0;
    int cache_config = 0;         // a hint only: recorded and reported back
    std::unique_ptr<phos::Connection> conn;
    DeviceLimits limits;
    std::unordered_set<CUmod_st*> modules;
    std::unordered_set<CUstream_st*> streams;
    std::unordered_set<CUevent_st*> events;
    std::map<void*, LocalValue> local_storage;
    std::map<CUlimit, size_t> limits_set;     // cuCtxGetLimit / SetLimit: the server's answers
    std::unordered_set<CUctx_st*> peers;      // the contexts it enabled peer access to
};

struct CUfunc_st {
    CUctx_st* ctx = nullptr;
    CUmod_st* module = nullptr;
    uint64_t id = 0;
    std::string name;
    std::vector<phos::wire::ParamInfo> params;
    size_t params_size = 0;       // bytes of the packed parameter buffer
    std::vector<int> attributes;         // CUfunction_attribute values, from the server
    std::map<std::tuple<int, uint64_t, uint64_t, uint32_t, uint64_t>, std::vector<uint64_t>> occupancy;   // answers asked
    int max_dynamic_shared = 48 << 10;   // cuFuncSetAttribute's opt-in
    int shared_carveout = -1;
    std::map<int, int> set;              // attribute -> the value cuFuncSetAttribute gave the server last
};

struct CUmod_st {
    CUctx_st* ctx = nullptr;
    CUlib_st* library = nullptr;  // the library it was loaded for, if any
    uint64_t id = 0;
    std::map<std::string, std::unique_ptr<CUfunc_st>> functions;   // by name: asked once
};

// A library (cuLibraryLoadData) belongs to no context: it becomes a module in each
// context on first use, so the many fatbins a program registers cost nothing until one
// of their kernels runs.
struct CUlib_st {
    std::string image;                                  // copied: the caller may free its buffer
    std::map<CUctx_st*, CUmod_st*> modules;
    std::map<std::string, std::unique_ptr<CUkern_st>> kernels;
};

struct CUkern_st {
    CUlib_st* library = nullptr;
    std::string name;
};

struct CUstream_st {
    CUctx_st* ctx = nullptr;
    CUgraph_st* capturing = nullptr;   // the graph its calls are recorded into (driver_graph.cpp)
    uint64_t id = 0;
    unsigned flags = 0;
    int priority = 0;
};

struct CUevent_st {
    CUctx_st* ctx = nullptr;
    CUgraph_st* captured_in = nullptr; // recorded inside this capture: a stream waiting on it joins it
    uint64_t id = 0;
    unsigned flags = 0;
};

namespace phos::driver {

enum class HandleKind : uint8_t { context, module, function, stream, event, library, kernel, graph, graph_node, graph_exec, mem_pool };

struct DeviceRange {           // a device allocation or a module global
    size_t size = 0;
    CUctx_st* ctx = nullptr;
    CUmemoryPool pool = nullptr;  // the pool a stream-ordered allocation came from
    CUmemGenericAllocationHandle physical = 0;   // the cuMemCreate allocation mapped here (cuMemMap)
};

// cuMemCreate's physical memory: the server allocates it where it is first mapped
// (driver_vmm.cpp), so it exists in this process as a size and properties until then.
struct PhysicalAllocation {
    size_t size = 0;
    CUmemAllocationProp prop{};
    CUdeviceptr mapped_at = 0;
    int references = 1;           // cuMemCreate's, and one per cuMemRetainAllocationHandle
};

struct Reservation {          // cuMemAddressReserve's range, in one context's addresses
    size_t size = 0;
    CUctx_st* ctx = nullptr;
};

struct HostRange {             // page-locked ("pinned") host memory, as the application sees it
    size_t size = 0;
    unsigned flags = 0;
    bool allocated = false;    // by cuMemAllocHost/cuMemHostAlloc (else cuMemHostRegister)
    std::shared_ptr<SharedHost> shared;   // allocated as memory workers on our host map (else plain)
    bool in_place = false;     // the device reads and writes it in place, at this address (managed,
                               // DEVICEMAP): mapped there by the worker of the context it was made in
    bool managed = false;      // by cuMemAllocManaged
};

struct State {
    std::recursive_mutex lock;
    bool init_done = false;
    bool exiting = false;                              // after the exit handler: every call fails
    CUresult init_result = CUDA_ERROR_NOT_INITIALIZED;
    std::unique_ptr<Connection> front;
    int device_count = 0;
    int driver_version = 0;
    std::map<std::pair<int, int>, std::pair<CUresult, int>> attributes;   // (device, attribute) -> answer
    std::map<std::tuple<int, int, int>, std::pair<CUresult, int>> p2p;    // (attribute, device, peer) -> answer
    std::map<int, std::string> device_names;
    std::map<int, std::string> device_uuids;
    std::map<int, size_t> device_memory;
    std::map<int, DeviceLimits> limits;
    std::vector<CUctx_st*> primary;                    // per device; never freed
    std::vector<CUctx_st*> contexts;                   // every open context
    std::unordered_map<const void*, HandleKind> handles;
    std::map<uint64_t, DeviceRange> allocations;       // base -> range
    std::map<uint64_t, DeviceRange> globals;           // module globals, for pointer checks
    std::map<uintptr_t, HostRange> host;               // base -> pinned range
    std::map<CUdeviceptr, Reservation> reserved;       // base -> cuMemAddressReserve's range
    std::map<CUmemGenericAllocationHandle, std::unique_ptr<PhysicalAllocation>> physical;
    uint64_t next_uid = 1;
};

State& state();
using Guard = std::lock_guard<std::recursive_mutex>;

// The calling thread's context stack (cuCtxPushCurrent/PopCurrent, cuCtxSetCurrent).
std::vector<CUctx_st*>& context_stack();

bool is_handle(const void* p, HandleKind kind);
CUresult require_init();
// The current context, reopened if it is a primary context that was reset.
CUresult current_context(CUctx_st** ctx);
CUresult make_usable(CUctx_st* ctx);
CUresult open_context(CUctx_st* ctx);
void close_context(CUctx_st* ctx);

// The bytes of a module image: a fatbin, a fatbin wrapper, a cubin or PTX text.
bool image_bytes(const void* image, const void** data, size_t* size);
// A function handle as launches and attribute calls take it: a CUfunction, or a CUkernel
// resolved in the current context (the driver accepts either).
CUresult resolve_function(CUfunction f, CUfunc_st** out);
// A launch's arguments (kernelParams or extra), packed as the kernel lays them out.
CUresult pack_params(const CUfunc_st* f, void** kernel_params, void** extra, std::string& out);
// A 2D or 3D copy of linear memory, as cuMemcpy3D(Async) makes it (driver_memory.cpp).
CUresult copy_3d(const CUDA_MEMCPY3D& p, CUstream stream, bool async_api);
// Stream capture (driver_graph.cpp): the graph a stream's calls are recorded into, if any;
// record a call in it (send does, for calls.def's stream calls); refuse a call a capture cannot
// record (and spoil the capture); a stream waiting on an event recorded in a capture joins it.
CUgraph_st* capture_of(CUstream stream);
void record_call(CUgraph_st* capture, wire::Call call);
CUresult refuse_in_capture(CUstream stream);
void join_capture(CUstream stream, CUevent event);
bool capture_invalidated(const CUgraph_st* graph);
// A 2D/3D copy recorded in a stream capture as a memcpy node (run again with each launch).
CUresult capture_copy(CUstream stream, const CUDA_MEMCPY3D& p);
uint64_t capture_id(const CUgraph_st* graph);

// Forgets a module of a library's (its context is going, or it is unloaded).
void forget_library_module(CUmod_st* m);

// -- sending calls (driver_calls.cpp) ----------------------------------------------------

// The NULL, legacy and per-thread streams: the default stream of the context in use.
inline bool is_default_stream(CUstream stream) {
    return !stream || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD;
}

// Where a call goes: a context's worker, and for work on a stream, the stream as the application
// named it (a capture records by it) and the server's id of it in that context (0: the default).
struct Target {
    Target(CUctx_st* c = nullptr) : ctx(c) {}
    CUctx_st* ctx;
    CUstream stream = nullptr;
    uint64_t sid = 0;
};

// The prologue the entry points share: each fills `t`, or says why the call cannot be made.
// on_context: `stream` must belong to `ctx`, a context the caller holds (else CUDA_ERROR_INVALID_HANDLE).
CUresult on_context(CUctx_st* ctx, CUstream stream, Target* t);
// on_current: the calling thread's current context (the library initialised, a reset primary
// context opened again).
CUresult on_current(CUstream stream, Target* t);
// on_handle: the context of `handle`, once the library is initialised and `handle` is one of
// ours of `kind` (a stream, an event, a module).
template <typename Handle>
CUresult on_handle(Handle* handle, HandleKind kind, CUstream stream, Target* t) {
    CUresult err = require_init();
    if (err != CUDA_SUCCESS) return err;
    if (!is_handle(handle, kind)) return CUDA_ERROR_INVALID_HANDLE;
    return on_context(handle->ctx, stream, t);
}

// Sends `call` to the target's worker as its row in calls.def says: a synchronous call (a copy
// with kWait) waits and returns its status, its Result in `result` and its bytes in `dest`;
// another is queued, its failure the next synchronizing call's, a device->host copy's bytes
// landing in `dest` with a later Reply; a stream call on a captured stream is recorded instead.
CUresult send(const Target& t, wire::Call call, wire::Result* result = nullptr, const HostDestination* dest = nullptr);
// A call to the front end (synchronous, as all of them are).
CUresult front_call(wire::Call call, wire::Result* result);
// A Result's status, its failure said the way the stub's policy says.
CUresult status_of(const wire::Result& r, wire::Kind kind);

CUresult device_attribute(int device, int attribute, int* value);
CUresult check_device(CUdevice dev);
// A device's primary context, made on first use; neither retained nor opened.
CUctx_st* primary_context_of(CUdevice dev);

// Pointer bookkeeping.
const DeviceRange* find_device_range(uint64_t ptr, uint64_t* base = nullptr);
bool device_range_ok(uint64_t ptr, size_t n);
const HostRange* find_host_range(const void* p, uintptr_t* base = nullptr);
bool is_pinned(const void* p, size_t n);

// Waits for every context with work in flight (before host memory it may use goes away).
void synchronize_busy_contexts();

void start_flusher();

// The front end connection (State::front), made anew at `server` with a hello (its Result in
// `hello`): at start, and when a restored process resumes against another server (agent.cpp).
CUresult connect_front(const std::string& server, wire::Result* hello);
// The checkpoint agent (agent.cpp): how `phos checkpoint --pid` reaches this process.
void start_agent();

}  // namespace phos::driver
