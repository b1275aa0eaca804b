// Driver API: initialisation, devices, contexts and primary contexts.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <thread>

#include <cudaProfiler.h>

#include "driver_state.h"

namespace phos::driver {

State& state() {
    static State* s = new State();   // never destroyed: other threads may run during exit
    return *s;
}

std::vector<CUctx_st*>& context_stack() {
    thread_local std::vector<CUctx_st*> stack;
    return stack;
}

bool is_handle(const void* p, HandleKind kind) {
    if (!p) return false;
    auto it = state().handles.find(p);
    return it != state().handles.end() && it->second == kind;
}

CUresult require_init() {
    State& s = state();
    if (s.exiting) return CUDA_ERROR_DEINITIALIZED;
    if (!s.init_done) return CUDA_ERROR_NOT_INITIALIZED;
    return s.init_result;
}

// -- initialisation --------------------------------------------------------------------

static std::string program_name() {
    std::ifstream f("/proc/self/cmdline");
    std::string arg0;
    std::getline(f, arg0, '\0');
    return arg0;
}

CUresult connect_front(const std::string& server, wire::Result* hello) {
    State& s = state();
    auto front = std::make_unique<Connection>(server, false);
    if (!front->ok()) {
        hello->status = CUDA_ERROR_NO_DEVICE;
        hello->message = "cannot use PHOS_SERVER=" + server;
        return CUDA_ERROR_NO_DEVICE;
    }
    std::string client = "native stub, pid " + std::to_string(getpid()) + ", " + program_name();
    *hello = front->call(wire::Call::hello(wire::kProtocolVersion, client), nullptr, settings().connect_timeout);
    if (hello->status != CUDA_SUCCESS) return static_cast<CUresult>(hello->status);
    s.front = std::move(front);
    return CUDA_SUCCESS;
}

static CUresult initialise() {
    State& s = state();
    const Settings& cfg = settings();
    std::string curve_error;
    if (!configure_curve(curve_error)) {
        log_error("CURVE keys: %s", curve_error.c_str());
        return CUDA_ERROR_NO_DEVICE;
    }
    wire::Result r;
    CUresult err = connect_front(cfg.server, &r);
    if (err != CUDA_SUCCESS) {
        log_error("%s%s", r.message.c_str(),
                  err == CUDA_ERROR_NO_DEVICE ? " (start one with `phos server`, or point PHOS_SERVER at one)" : "");
        return err;
    }
    if (!r.u64s.empty()) {
        s.device_count = static_cast<int>(r.u64s[0]);
    } else {
        wire::Result count = s.front->call(wire::Call::plain(wire::Kind::deviceGetCount));
        s.device_count = count.status == CUDA_SUCCESS && !count.u64s.empty() ? static_cast<int>(count.u64s[0]) : 0;
    }
    s.primary.assign(static_cast<size_t>(s.device_count), nullptr);
    log_verbose("connected to %s (%s, %d device(s))", cfg.server.c_str(), r.text.c_str(), s.device_count);
    return s.device_count > 0 ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
}

// -- devices ---------------------------------------------------------------------------

CUresult check_device(CUdevice dev) {
    CUresult err = require_init();
    if (err != CUDA_SUCCESS) return err;
    return dev >= 0 && dev < state().device_count ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

CUresult device_attribute(int device, int attribute, int* value) {
    State& s = state();
    auto key = std::make_pair(device, attribute);
    auto it = s.attributes.find(key);
    if (it == s.attributes.end()) {
        // Device attributes never change: ask once, and remember refusals too, quietly
        // (cudaGetDeviceProperties asks for attributes a server may not know).
        wire::Result r = s.front->call(wire::Call::device_attribute(attribute, device));
        const auto status = static_cast<CUresult>(r.status);
        if (status == CUDA_ERROR_NO_DEVICE || status == CUDA_ERROR_CONTEXT_IS_DESTROYED) return status;   // no answer
        if (status != CUDA_SUCCESS) log_verbose("deviceGetAttribute: %s", r.message.c_str());
        int v = r.u64s.empty() ? 0 : static_cast<int>(static_cast<int64_t>(r.u64s[0]));
        it = s.attributes.emplace(key, std::make_pair(status, v)).first;
    }
    if (it->second.first == CUDA_SUCCESS) *value = it->second.second;
    return it->second.first;
}

static DeviceLimits device_limits(int device) {
    State& s = state();
    auto it = s.limits.find(device);
    if (it != s.limits.end()) return it->second;
    DeviceLimits l;
    auto get = [&](CUdevice_attribute a, int* v) { device_attribute(device, a, v); };
    get(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, &l.max_threads_per_block);
    get(CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X, &l.max_block[0]);
    get(CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y, &l.max_block[1]);
    get(CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z, &l.max_block[2]);
    get(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X, &l.max_grid[0]);
    get(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y, &l.max_grid[1]);
    get(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z, &l.max_grid[2]);
    get(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, &l.max_shared_optin);
    s.limits[device] = l;
    return l;
}

// -- contexts --------------------------------------------------------------------------

// At exit, end every context the process still has: the server frees it at once instead
// of waiting to notice the client is gone, and work still queued runs first (device-side
// printf output included), as when a CUDA process exits. Calls made after this (from
// static destructors, say) fail with CUDA_ERROR_DEINITIALIZED, as they do with CUDA.
static pid_t owner_pid = 0;   // a forked child inherits the handler, but not the connections

static void finish_at_exit() {
    if (getpid() != owner_pid) return;
    State& s = state();
    std::unique_lock<std::recursive_mutex> g(s.lock, std::defer_lock);
    for (int i = 0; i < 100 && !g.try_lock(); i++) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (!g.owns_lock()) return;   // another thread is stuck in a call: leave it to the server
    s.exiting = true;
    const double timeout = settings().exit_timeout;
    for (CUctx_st* ctx : s.contexts) {
        if (!ctx->live || !ctx->conn) continue;
        wire::Result r = ctx->conn->call(wire::Call::plain(wire::Kind::ctxDestroy), nullptr, timeout);
        if (r.status != CUDA_SUCCESS) log_verbose("at exit, ctxDestroy: %s", r.message.c_str());
        log_verbose("context %llu: %s", (unsigned long long)ctx->server_id, ctx->conn->stats().c_str());
        ctx->live = false;
    }
}

CUresult open_context(CUctx_st* ctx) {
    State& s = state();
    wire::Result r;
    CUresult err = front_call(wire::Call::ctx_create(ctx->flags, ctx->device), &r);
    if (err != CUDA_SUCCESS) return err;
    if (r.u64s.empty() || r.text.empty()) {
        log_error("ctxCreate: the server sent no worker endpoint");
        return CUDA_ERROR_UNKNOWN;
    }
    auto conn = std::make_unique<Connection>(r.text, true);
    wire::Result a = conn->attach(r.u64s[0], r.data, settings().connect_timeout);
    if (a.status != CUDA_SUCCESS) {
        log_error("attach to %s: %s", r.text.c_str(), a.message.c_str());
        return static_cast<CUresult>(a.status);
    }
    ctx->server_id = r.u64s[0];
    ctx->conn = std::move(conn);
    ctx->uid = s.next_uid++;
    ctx->live = true;
    ctx->limits = device_limits(ctx->device);
    s.handles[ctx] = HandleKind::context;
    if (std::find(s.contexts.begin(), s.contexts.end(), ctx) == s.contexts.end()) s.contexts.push_back(ctx);
    log_verbose("context %llu on device %d: worker %s", (unsigned long long)ctx->server_id, ctx->device, r.text.c_str());
    start_flusher();
    start_agent();
    static std::once_flag exit_handler;
    std::call_once(exit_handler, [] {
        owner_pid = getpid();
        atexit(finish_at_exit);
    });
    return CUDA_SUCCESS;
}

// Ends the server side of a context and forgets everything that lived in it. The
// CUctx_st itself stays allocated, so stale handles on other threads' stacks are safe.
void close_context(CUctx_st* ctx) {
    State& s = state();
    if (ctx->conn) {
        wire::Result r = ctx->conn->call(wire::Call::plain(wire::Kind::ctxDestroy));
        if (r.status != CUDA_SUCCESS) log_verbose("ctxDestroy: %s", r.message.c_str());
        log_verbose("context %llu: %s", (unsigned long long)ctx->server_id, ctx->conn->stats().c_str());
        ctx->conn.reset();
    }
    ctx->live = false;
    // The runtime's state for this context goes with it; a destructor may call back in.
    auto storage = std::move(ctx->local_storage);
    ctx->local_storage.clear();
    for (auto& [key, v] : storage)
        if (v.destructor) v.destructor(ctx, key, v.value);
    for (auto* m : ctx->modules) {
        forget_library_module(m);
        for (auto& f : m->functions) s.handles.erase(f.second.get());
        s.handles.erase(m);
        delete m;
    }
    for (auto* st : ctx->streams) {
        s.handles.erase(st);
        delete st;
    }
    for (auto* e : ctx->events) {
        s.handles.erase(e);
        delete e;
    }
    ctx->modules.clear();
    ctx->streams.clear();
    ctx->events.clear();
    ctx->peers.clear();
    for (CUctx_st* other : s.contexts) other->peers.erase(ctx);
    for (auto* ranges : {&s.allocations, &s.globals}) {
        for (auto it = ranges->begin(); it != ranges->end();) it = it->second.ctx == ctx ? ranges->erase(it) : std::next(it);
    }
    if (!ctx->primary) {
        s.handles.erase(ctx);
        s.contexts.erase(std::remove(s.contexts.begin(), s.contexts.end(), ctx), s.contexts.end());
    }
}

CUresult make_usable(CUctx_st* ctx) {
    if (ctx->live) return CUDA_SUCCESS;
    if (ctx->primary) return open_context(ctx);
    return CUDA_ERROR_CONTEXT_IS_DESTROYED;
}

CUresult current_context(CUctx_st** out) {
    CUresult err = require_init();
    if (err != CUDA_SUCCESS) return err;
    auto& stack = context_stack();
    if (stack.empty() || !stack.back()) return CUDA_ERROR_INVALID_CONTEXT;
    err = make_usable(stack.back());
    if (err != CUDA_SUCCESS) return err;
    *out = stack.back();
    return CUDA_SUCCESS;
}

static CUresult create_context(CUcontext* pctx, unsigned flags, CUdevice dev) {
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    CUresult err = check_device(dev);
    if (err != CUDA_SUCCESS) return err;
    auto* ctx = new CUctx_st();
    ctx->device = dev;
    ctx->flags = flags;
    err = open_context(ctx);
    if (err != CUDA_SUCCESS) {
        delete ctx;
        return err;
    }
    context_stack().push_back(ctx);
    *pctx = ctx;
    return CUDA_SUCCESS;
}

// -- the flusher: sends batches that wait too long ----------------------------------------
//
// Asynchronous calls wait in a batch until a synchronizing call, a full batch, or this
// thread sends them, so that the device is not left idle while the application computes.

void start_flusher() {
    static std::once_flag once;
    std::call_once(once, [] {
        std::thread([] {
            const auto period = std::chrono::duration<double>(std::max(settings().batch_age, 1e-4));
            while (true) {
                std::this_thread::sleep_for(period);
                State& s = state();
                std::unique_lock<std::recursive_mutex> g(s.lock, std::try_to_lock);
                if (!g.owns_lock()) continue;   // a call is running: it will send the batch itself
                for (CUctx_st* ctx : s.contexts) {
                    if (ctx->live && ctx->conn) ctx->conn->flush_if_stale();
                }
            }
        }).detach();
    });
}

void synchronize_busy_contexts() {
    for (CUctx_st* ctx : state().contexts) {
        if (ctx->live && ctx->conn && ctx->conn->has_pending())
            send(ctx, wire::Call::plain(wire::Kind::ctxSynchronize));
    }
}

}  // namespace phos::driver

using namespace phos;
using namespace phos::driver;

// ======================================================================================
// Exported entry points
// ======================================================================================

PHOS_EXPORT CUresult cuInit(unsigned int flags) {
    State& s = state();
    Guard g(s.lock);
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (!s.init_done) {
        s.init_result = initialise();
        s.init_done = true;
    }
    return s.init_result;
}

PHOS_EXPORT CUresult cuDriverGetVersion(int* version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    State& s = state();
    Guard g(s.lock);
    // Before cuInit (cuda-python asks at import) answer without connecting: the stub
    // implements the CUDA 13.0 driver API.
    if (s.driver_version == 0 && s.init_done && s.init_result == CUDA_SUCCESS) {
        wire::Result r;
        if (front_call(wire::Call::plain(wire::Kind::driverGetVersion), &r) == CUDA_SUCCESS && !r.u64s.empty())
            s.driver_version = static_cast<int>(r.u64s[0]);
    }
    *version = s.driver_version ? s.driver_version : CUDA_VERSION;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuDeviceGetCount(int* count) {
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = require_init();
    if (err != CUDA_SUCCESS) return err;
    *count = state().device_count;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuDeviceGet(CUdevice* device, int ordinal) {
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = check_device(ordinal);
    if (err == CUDA_SUCCESS) *device = ordinal;
    return err;
}

PHOS_EXPORT CUresult cuDeviceGetName(char* name, int len, CUdevice dev) {
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    State& s = state();
    Guard g(s.lock);
    CUresult err = check_device(dev);
    if (err != CUDA_SUCCESS) return err;
    if (!s.device_names.count(dev)) {
        wire::Result r;
        err = front_call(wire::Call::on_device(wire::Kind::deviceGetName, dev), &r);
        if (err != CUDA_SUCCESS) return err;
        s.device_names[dev] = r.text;
    }
    const std::string& n = s.device_names[dev];
    size_t k = std::min(n.size(), static_cast<size_t>(len - 1));
    std::memcpy(name, n.data(), k);
    name[k] = '\0';
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuDeviceGetUuid_v2(CUuuid* uuid, CUdevice dev) {
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    State& s = state();
    Guard g(s.lock);
    CUresult err = check_device(dev);
    if (err != CUDA_SUCCESS) return err;
    if (!s.device_uuids.count(dev)) {
        wire::Result r;
        err = front_call(wire::Call::on_device(wire::Kind::deviceGetUuid, dev), &r);
        if (err != CUDA_SUCCESS) return err;
        s.device_uuids[dev] = r.data;
    }
    const std::string& u = s.device_uuids[dev];
    std::memset(uuid->bytes, 0, sizeof uuid->bytes);
    std::memcpy(uuid->bytes, u.data(), std::min(u.size(), sizeof uuid->bytes));
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice dev) {
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    State& s = state();
    Guard g(s.lock);
    CUresult err = check_device(dev);
    if (err != CUDA_SUCCESS) return err;
    if (!s.device_memory.count(dev)) {
        wire::Result r;
        err = front_call(wire::Call::on_device(wire::Kind::deviceTotalMem, dev), &r);
        if (err != CUDA_SUCCESS) return err;
        s.device_memory[dev] = r.u64s.empty() ? 0 : r.u64s[0];
    }
    *bytes = s.device_memory[dev];
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuDeviceGetAttribute(int* value, CUdevice_attribute attribute, CUdevice dev) {
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = check_device(dev);
    if (err != CUDA_SUCCESS) return err;
    return device_attribute(dev, attribute, value);
}

PHOS_EXPORT CUresult cuDeviceComputeCapability(int* major, int* minor, CUdevice dev) {
    if (!major || !minor) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = check_device(dev);
    if (err == CUDA_SUCCESS) err = device_attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, major);
    if (err == CUDA_SUCCESS) err = device_attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, minor);
    return err;
}

PHOS_EXPORT CUresult cuDeviceGetPCIBusId(char* bus_id, int len, CUdevice dev) {
    if (!bus_id || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = check_device(dev);
    int domain = 0, bus = 0, device = 0;
    if (err == CUDA_SUCCESS) err = device_attribute(dev, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, &domain);
    if (err == CUDA_SUCCESS) err = device_attribute(dev, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, &bus);
    if (err == CUDA_SUCCESS) err = device_attribute(dev, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, &device);
    if (err == CUDA_SUCCESS) snprintf(bus_id, static_cast<size_t>(len), "%08X:%02X:%02X.0", domain, bus, device);
    return err;
}

// -- primary contexts ------------------------------------------------------------------

CUctx_st* phos::driver::primary_context_of(CUdevice dev) {
    State& s = state();
    CUctx_st*& p = s.primary[static_cast<size_t>(dev)];
    if (!p) {
        p = new CUctx_st();
        p->device = dev;
        p->primary = true;
        s.handles[p] = HandleKind::context;
    }
    return p;
}

PHOS_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext* pctx, CUdevice dev) {
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = check_device(dev);
    if (err != CUDA_SUCCESS) return err;
    CUctx_st* p = primary_context_of(dev);
    err = make_usable(p);
    if (err != CUDA_SUCCESS) return err;
    p->primary_refs++;
    *pctx = p;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    Guard g(state().lock);
    CUresult err = check_device(dev);
    if (err != CUDA_SUCCESS) return err;
    CUctx_st* p = primary_context_of(dev);
    if (p->primary_refs <= 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (--p->primary_refs == 0 && p->live) close_context(p);
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    Guard g(state().lock);
    CUresult err = check_device(dev);
    if (err != CUDA_SUCCESS) return err;
    CUctx_st* p = primary_context_of(dev);
    if (p->live) close_context(p);
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags) {
    Guard g(state().lock);
    CUresult err = check_device(dev);
    if (err == CUDA_SUCCESS) primary_context_of(dev)->flags = flags;
    return err;
}

PHOS_EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int* flags, int* active) {
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = check_device(dev);
    if (err != CUDA_SUCCESS) return err;
    CUctx_st* p = primary_context_of(dev);
    *flags = p->flags;
    *active = p->live ? 1 : 0;
    return CUDA_SUCCESS;
}

// -- contexts --------------------------------------------------------------------------

PHOS_EXPORT CUresult cuCtxCreate_v4(CUcontext* pctx, CUctxCreateParams* params, unsigned int flags, CUdevice dev) {
    Guard g(state().lock);
    if (params && (params->numExecAffinityParams > 0 || params->cigParams)) {
        log_error("cuCtxCreate: execution affinity and CIG parameters are not supported");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    return create_context(pctx, flags, dev);
}

PHOS_EXPORT CUresult cuCtxCreate_v3(CUcontext* pctx, CUexecAffinityParam* affinity, int count, unsigned int flags,
                                    CUdevice dev) {
    Guard g(state().lock);
    if (affinity && count > 0) {
        log_error("cuCtxCreate: execution affinity is not supported");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    return create_context(pctx, flags, dev);
}

PHOS_EXPORT CUresult cuCtxCreate_v2(CUcontext* pctx, unsigned int flags, CUdevice dev) {
    Guard g(state().lock);
    return create_context(pctx, flags, dev);
}

PHOS_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) {
    Guard g(state().lock);
    CUresult err = require_init();
    if (err != CUDA_SUCCESS) return err;
    if (!is_handle(ctx, HandleKind::context) || ctx->primary) return CUDA_ERROR_INVALID_CONTEXT;
    close_context(ctx);
    auto& stack = context_stack();
    stack.erase(std::remove(stack.begin(), stack.end(), ctx), stack.end());
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    Guard g(state().lock);
    CUresult err = require_init();
    if (err != CUDA_SUCCESS) return err;
    // Replaces the top of the stack; NULL leaves the thread with no current context.
    auto& stack = context_stack();
    if (ctx && !is_handle(ctx, HandleKind::context)) return CUDA_ERROR_INVALID_CONTEXT;
    if (stack.empty()) {
        if (ctx) stack.push_back(ctx);
    } else {
        stack.back() = ctx;
    }
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuCtxGetCurrent(CUcontext* pctx) {
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = require_init();
    if (err != CUDA_SUCCESS) return err;
    auto& stack = context_stack();
    *pctx = stack.empty() ? nullptr : stack.back();
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    Guard g(state().lock);
    CUresult err = require_init();
    if (err != CUDA_SUCCESS) return err;
    if (!is_handle(ctx, HandleKind::context)) return CUDA_ERROR_INVALID_CONTEXT;
    context_stack().push_back(ctx);
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuCtxPopCurrent_v2(CUcontext* pctx) {
    Guard g(state().lock);
    CUresult err = require_init();
    if (err != CUDA_SUCCESS) return err;
    auto& stack = context_stack();
    if (stack.empty()) return CUDA_ERROR_INVALID_CONTEXT;
    if (pctx) *pctx = stack.back();
    stack.pop_back();
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuCtxGetDevice(CUdevice* device) {
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err == CUDA_SUCCESS) *device = ctx->device;
    return err;
}

PHOS_EXPORT CUresult cuCtxGetFlags(unsigned int* flags) {
    if (!flags) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err == CUDA_SUCCESS) *flags = ctx->flags;
    return err;
}

PHOS_EXPORT CUresult cuCtxGetId(CUcontext ctx, unsigned long long* id) {
    if (!id) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = require_init();
    if (err != CUDA_SUCCESS) return err;
    if (!ctx) {
        err = current_context(&ctx);
        if (err != CUDA_SUCCESS) return err;
    }
    if (!is_handle(ctx, HandleKind::context)) return CUDA_ERROR_INVALID_CONTEXT;
    err = make_usable(ctx);
    if (err == CUDA_SUCCESS) *id = ctx->uid;
    return err;
}

PHOS_EXPORT CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int* version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = require_init();
    if (err != CUDA_SUCCESS) return err;
    if (ctx && !is_handle(ctx, HandleKind::context)) return CUDA_ERROR_INVALID_CONTEXT;
    *version = CUDA_VERSION;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuCtxSynchronize() {
    Guard g(state().lock);
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err != CUDA_SUCCESS) return err;
    return send(ctx, wire::Call::plain(wire::Kind::ctxSynchronize));
}

PHOS_EXPORT CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
    Guard g(state().lock);
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err != CUDA_SUCCESS) return err;
    if (least) *least = 0;         // the range current NVIDIA GPUs report
    if (greatest) *greatest = -5;
    return CUDA_SUCCESS;
}

// Cache preferences are hints the hardware may ignore; phos records and reports them.
PHOS_EXPORT CUresult cuCtxSetCacheConfig(CUfunc_cache config) {
    Guard g(state().lock);
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err == CUDA_SUCCESS) ctx->cache_config = config;
    return err;
}

PHOS_EXPORT CUresult cuCtxGetCacheConfig(CUfunc_cache* config) {
    if (!config) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err == CUDA_SUCCESS) *config = static_cast<CUfunc_cache>(ctx->cache_config);
    return err;
}

// -- limits: the server's context has them; each is asked once and then known here --------

static CUresult context_limit(CUlimit limit, const size_t* set, size_t* value) {
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err != CUDA_SUCCESS) return err;
    auto known = ctx->limits_set.find(limit);
    if (!set && known != ctx->limits_set.end()) {
        *value = known->second;
        return CUDA_SUCCESS;
    }
    wire::Call call = wire::Call::plain(wire::Kind::ctxLimit);
    call.number = static_cast<int32_t>(limit);
    call.size = set ? *set : 0;
    call.flags = set ? 1 : 0;
    wire::Result r;
    if ((err = send(ctx, std::move(call), &r)) != CUDA_SUCCESS) return err;
    if (r.u64s.empty()) return CUDA_ERROR_UNKNOWN;
    *value = ctx->limits_set[limit] = static_cast<size_t>(r.u64s[0]);
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuCtxGetLimit(size_t* value, CUlimit limit) {
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    return context_limit(limit, nullptr, value);
}

PHOS_EXPORT CUresult cuCtxSetLimit(CUlimit limit, size_t value) {
    Guard g(state().lock);
    size_t now;
    return context_limit(limit, &value, &now);
}

// -- peers ----------------------------------------------------------------------------------
// Each context is a worker process of its own, on its device: a copy between two contexts
// (cuMemcpyPeer, a copy whose pointers lie on two devices) travels through this process
// (driver_memory.cpp copy_between), with or without peer access. The devices' answers are the
// server's devices' own; enabling access is bookkeeping with CUDA's errors, since a kernel
// cannot reach another context's memory.

static CUresult p2p_attribute(int attribute, CUdevice dev, CUdevice peer, int* value) {
    State& s = state();
    auto key = std::make_tuple(attribute, static_cast<int>(dev), static_cast<int>(peer));
    auto it = s.p2p.find(key);
    if (it == s.p2p.end()) {      // the link never changes: asked once, refusals too
        wire::Result r;
        CUresult err = front_call(wire::Call::p2p_attribute(attribute, dev, peer), &r);
        if (err == CUDA_ERROR_NO_DEVICE || err == CUDA_ERROR_CONTEXT_IS_DESTROYED) return err;   // no answer
        it = s.p2p.emplace(key, std::make_pair(err, r.u64s.empty() ? 0 : static_cast<int>(r.u64s[0]))).first;
    }
    if (it->second.first == CUDA_SUCCESS) *value = it->second.second;
    return it->second.first;
}

PHOS_EXPORT CUresult cuDeviceCanAccessPeer(int* can, CUdevice dev, CUdevice peer) {
    if (!can) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = check_device(dev);
    if (err == CUDA_SUCCESS) err = check_device(peer);
    if (err != CUDA_SUCCESS) return err;
    if (dev == peer) {      // a device is no peer of itself
        *can = 0;
        return CUDA_SUCCESS;
    }
    return p2p_attribute(CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED, dev, peer, can);
}

PHOS_EXPORT CUresult cuDeviceGetP2PAttribute(int* value, CUdevice_P2PAttribute attribute, CUdevice src, CUdevice dst) {
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = check_device(src);
    if (err == CUDA_SUCCESS) err = check_device(dst);
    if (err == CUDA_SUCCESS && src == dst) err = CUDA_ERROR_INVALID_DEVICE;
    if (err == CUDA_SUCCESS) err = p2p_attribute(attribute, src, dst, value);
    return err;
}

// The current context, and `peer` a live context other than it (else CUDA_ERROR_INVALID_CONTEXT).
static CUresult peer_of_current(CUcontext peer, CUctx_st** ctx) {
    CUresult err = current_context(ctx);
    if (err != CUDA_SUCCESS) return err;
    return is_handle(peer, HandleKind::context) && peer->live && peer != *ctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

PHOS_EXPORT CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned int flags) {
    Guard g(state().lock);
    CUctx_st* ctx;
    CUresult err = peer_of_current(peer, &ctx);
    if (err != CUDA_SUCCESS) return err;
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    int can = 0;
    if ((err = cuDeviceCanAccessPeer(&can, ctx->device, peer->device)) != CUDA_SUCCESS) return err;
    if (!can) return CUDA_ERROR_PEER_ACCESS_UNSUPPORTED;
    return ctx->peers.insert(peer).second ? CUDA_SUCCESS : CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
}

PHOS_EXPORT CUresult cuCtxDisablePeerAccess(CUcontext peer) {
    Guard g(state().lock);
    CUctx_st* ctx;
    CUresult err = peer_of_current(peer, &ctx);
    if (err != CUDA_SUCCESS) return err;
    return ctx->peers.erase(peer) ? CUDA_SUCCESS : CUDA_ERROR_PEER_ACCESS_NOT_ENABLED;
}

// -- profiler control: profiling belongs to the server ------------------------------------
// A profiler (Nsight, CUPTI) attaches to the process that owns the GPU, which is the server's
// worker, not this one; the application's start and stop marks have nothing here to switch.
// They succeed, so that programs which bracket their timed region with them (cuda-samples'
// asyncAPI, matrixMul) run on NVIDIA's runtime as they do natively without a profiler.

PHOS_EXPORT CUresult cuProfilerInitialize(const char*, const char*, CUoutput_mode) {
    Guard g(state().lock);
    return require_init();
}

static CUresult profiler_mark() {
    Guard g(state().lock);
    CUctx_st* ctx;
    return current_context(&ctx);     // as the driver answers: CUDA_ERROR_INVALID_CONTEXT without one
}

PHOS_EXPORT CUresult cuProfilerStart() { return profiler_mark(); }
PHOS_EXPORT CUresult cuProfilerStop() { return profiler_mark(); }
