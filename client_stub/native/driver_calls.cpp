// How the driver's calls leave for the server: the prologue the entry points share (which
// context a call goes to, and the server's id of its stream there), and one way to send a call,
// as its row in calls.def says.
#include "driver_state.h"

namespace phos::driver {

CUresult on_context(CUctx_st* ctx, CUstream stream, Target* t) {
    t->ctx = ctx;
    t->stream = stream;
    t->sid = 0;
    if (is_default_stream(stream)) return CUDA_SUCCESS;
    if (!is_handle(stream, HandleKind::stream) || stream->ctx != ctx) return CUDA_ERROR_INVALID_HANDLE;
    t->sid = stream->id;
    return CUDA_SUCCESS;
}

CUresult on_current(CUstream stream, Target* t) {
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    return err != CUDA_SUCCESS ? err : on_context(ctx, stream, t);
}

CUresult status_of(const wire::Result& r, wire::Kind kind) {
    if (r.status != CUDA_SUCCESS) {
        // Say why when phos cannot do something, or a module does not load; everything
        // else is an ordinary CUDA error the application handles (PHOS_VERBOSE shows all).
        if (r.status == CUDA_ERROR_NOT_SUPPORTED || kind == wire::Kind::moduleLoad)
            log_error("%s", r.message.c_str());
        else if (r.status != CUDA_ERROR_NOT_READY)
            log_verbose("%s: %s", wire::kind_name(kind), r.message.c_str());
    }
    return static_cast<CUresult>(r.status);
}

static CUresult wait_for(Connection& conn, wire::Call call, wire::Result* result, const HostDestination* dest) {
    const wire::Kind kind = call.kind;
    wire::Result r = conn.call(std::move(call), dest);
    CUresult err = status_of(r, kind);
    if (result) *result = std::move(r);
    return err;
}

CUresult send(const Target& t, wire::Call call, wire::Result* result, const HostDestination* dest) {
    switch (wire::mode_of(call.kind)) {
    case wire::Mode::sync: return wait_for(*t.ctx->conn, std::move(call), result, dest);
    case wire::Mode::copy:
        if (call.flags & wire::Call::kWait) return wait_for(*t.ctx->conn, std::move(call), result, dest);
        break;
    case wire::Mode::stream:
        // The graph the stream is captured into keeps the call, to post again at each launch.
        if (CUgraph_st* capture = capture_of(t.stream)) {
            record_call(capture, std::move(call));
            return CUDA_SUCCESS;
        }
        break;
    case wire::Mode::async: break;
    }
    t.ctx->conn->post(std::move(call), dest);
    return CUDA_SUCCESS;
}

CUresult front_call(wire::Call call, wire::Result* result) {
    CUresult err = require_init();
    return err != CUDA_SUCCESS ? err : wait_for(*state().front, std::move(call), result, nullptr);
}

}  // namespace phos::driver
