// Driver API: streams and events. The server runs each stream's calls in order and
// gives the default stream its legacy semantics; the stub only names streams and events.
#include "driver_state.h"

using namespace phos;
using namespace phos::driver;

static CUresult create_stream(CUstream* out, unsigned flags, int priority) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err != CUDA_SUCCESS) return err;
    wire::Result r;
    err = send(ctx, wire::Call::stream_create(flags, priority), &r);
    if (err != CUDA_SUCCESS) return err;
    auto* s = new CUstream_st();
    s->ctx = ctx;
    s->id = r.u64s.empty() ? 0 : r.u64s[0];
    s->flags = flags;
    s->priority = priority;
    ctx->streams.insert(s);
    state().handles[s] = HandleKind::stream;
    *out = s;
    return CUDA_SUCCESS;
}

// A synchronous call about a stream; the default streams go to the current context.
static CUresult stream_query_call(wire::Kind kind, CUstream stream) {
    CUresult err = require_init();
    if (err != CUDA_SUCCESS) return err;
    if ((err = refuse_in_capture(stream)) != CUDA_SUCCESS) return err;   // a capture does not run its work
    Target t;
    err = is_default_stream(stream) ? on_current(stream, &t) : on_handle(stream, HandleKind::stream, stream, &t);
    return err != CUDA_SUCCESS ? err : send(t, wire::Call::with_id(kind, t.sid));
}

static CUresult event_call(wire::Kind kind, CUevent event) {
    Target t;
    CUresult err = on_handle(event, HandleKind::event, nullptr, &t);
    return err != CUDA_SUCCESS ? err : send(t, wire::Call::with_id(kind, event->id));
}

static CUresult record_event(CUevent event, CUstream stream) {
    Target t;
    CUresult err = on_handle(event, HandleKind::event, stream, &t);
    if (err != CUDA_SUCCESS) return err;
    event->captured_in = capture_of(stream);
    return send(t, wire::Call::event_record(event->id, t.sid));
}

static CUresult elapsed_time(float* ms, CUevent start, CUevent end) {
    if (!ms) return CUDA_ERROR_INVALID_VALUE;
    Target t;
    CUresult err = on_handle(start, HandleKind::event, nullptr, &t);
    if (err != CUDA_SUCCESS) return err;
    if (!is_handle(end, HandleKind::event) || end->ctx != start->ctx) return CUDA_ERROR_INVALID_HANDLE;
    wire::Result r;
    err = send(t, wire::Call::event_elapsed(start->id, end->id), &r);
    if (err == CUDA_SUCCESS) *ms = static_cast<float>(r.f64);
    return err;
}

// ======================================================================================
// Exported entry points
// ======================================================================================

PHOS_EXPORT CUresult cuStreamCreate(CUstream* stream, unsigned int flags) {
    Guard g(state().lock);
    return create_stream(stream, flags, 0);
}

PHOS_EXPORT CUresult cuStreamCreateWithPriority(CUstream* stream, unsigned int flags, int priority) {
    Guard g(state().lock);
    return create_stream(stream, flags, priority);
}

PHOS_EXPORT CUresult cuStreamDestroy_v2(CUstream stream) {
    State& s = state();
    Guard g(s.lock);
    Target t;
    CUresult err = on_handle(stream, HandleKind::stream, nullptr, &t);
    if (err != CUDA_SUCCESS) return err;
    // Work already queued on the stream still runs, as with CUDA.
    send(t, wire::Call::with_id(wire::Kind::streamDestroy, stream->id));
    stream->ctx->streams.erase(stream);
    s.handles.erase(stream);
    delete stream;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuStreamSynchronize(CUstream stream) {
    Guard g(state().lock);
    return stream_query_call(wire::Kind::streamSynchronize, stream);
}

PHOS_EXPORT CUresult cuStreamQuery(CUstream stream) {
    Guard g(state().lock);
    return stream_query_call(wire::Kind::streamQuery, stream);
}

PHOS_EXPORT CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags) {
    Guard g(state().lock);
    Target t;
    CUresult err = on_handle(event, HandleKind::event, stream, &t);
    if (err != CUDA_SUCCESS) return err;
    join_capture(stream, event);
    return send(t, wire::Call::stream_wait_event(t.sid, event->id, flags));
}

PHOS_EXPORT CUresult cuStreamGetFlags(CUstream stream, unsigned int* flags) {
    if (!flags) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    if (is_default_stream(stream)) {
        *flags = 0;
        return CUDA_SUCCESS;
    }
    if (!is_handle(stream, HandleKind::stream)) return CUDA_ERROR_INVALID_HANDLE;
    *flags = stream->flags;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuStreamGetPriority(CUstream stream, int* priority) {
    if (!priority) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    if (is_default_stream(stream)) {
        *priority = 0;
        return CUDA_SUCCESS;
    }
    if (!is_handle(stream, HandleKind::stream)) return CUDA_ERROR_INVALID_HANDLE;
    *priority = stream->priority;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuStreamGetCtx(CUstream stream, CUcontext* pctx) {
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    if (is_default_stream(stream)) {
        CUctx_st* ctx;
        CUresult err = current_context(&ctx);
        if (err == CUDA_SUCCESS) *pctx = ctx;
        return err;
    }
    if (!is_handle(stream, HandleKind::stream)) return CUDA_ERROR_INVALID_HANDLE;
    *pctx = stream->ctx;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuStreamGetId(CUstream stream, unsigned long long* id) {
    if (!id) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    if (is_default_stream(stream)) {
        *id = reinterpret_cast<uintptr_t>(stream);
        return CUDA_SUCCESS;
    }
    if (!is_handle(stream, HandleKind::stream)) return CUDA_ERROR_INVALID_HANDLE;
    *id = stream->id;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuEventCreate(CUevent* event, unsigned int flags) {
    if (!event) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err != CUDA_SUCCESS) return err;
    wire::Result r;
    err = send(ctx, wire::Call::event_create(flags), &r);
    if (err != CUDA_SUCCESS) return err;
    auto* e = new CUevent_st();
    e->ctx = ctx;
    e->id = r.u64s.empty() ? 0 : r.u64s[0];
    e->flags = flags;
    ctx->events.insert(e);
    state().handles[e] = HandleKind::event;
    *event = e;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuEventRecord(CUevent event, CUstream stream) {
    Guard g(state().lock);
    return record_event(event, stream);
}

// CU_EVENT_RECORD_EXTERNAL only matters inside graphs, which phos does not capture.
PHOS_EXPORT CUresult cuEventRecordWithFlags(CUevent event, CUstream stream, unsigned int) {
    Guard g(state().lock);
    return record_event(event, stream);
}

PHOS_EXPORT CUresult cuEventSynchronize(CUevent event) {
    Guard g(state().lock);
    return event_call(wire::Kind::eventSynchronize, event);
}

PHOS_EXPORT CUresult cuEventQuery(CUevent event) {
    Guard g(state().lock);
    return event_call(wire::Kind::eventQuery, event);
}

PHOS_EXPORT CUresult cuEventElapsedTime_v2(float* ms, CUevent start, CUevent end) {
    Guard g(state().lock);
    return elapsed_time(ms, start, end);
}

PHOS_EXPORT CUresult cuEventDestroy_v2(CUevent event) {
    State& s = state();
    Guard g(s.lock);
    Target t;
    CUresult err = on_handle(event, HandleKind::event, nullptr, &t);
    if (err != CUDA_SUCCESS) return err;
    send(t, wire::Call::with_id(wire::Kind::eventDestroy, event->id));
    event->ctx->events.erase(event);
    s.handles.erase(event);
    delete event;
    return CUDA_SUCCESS;
}

// -- stream capture queries: answered here (driver_graph.cpp keeps the captures) -----------
// Frameworks ask before every allocation and many launches whether they are inside a
// capture.

static CUresult check_stream(CUstream stream) {
    CUresult err = require_init();
    if (err != CUDA_SUCCESS) return err;
    if (is_default_stream(stream)) return CUDA_SUCCESS;
    return is_handle(stream, HandleKind::stream) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

static CUstreamCaptureStatus capture_status(CUstream stream) {
    CUgraph_st* g = capture_of(stream);
    return !g ? CU_STREAM_CAPTURE_STATUS_NONE : capture_invalidated(g) ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                                                                        : CU_STREAM_CAPTURE_STATUS_ACTIVE;
}

PHOS_EXPORT CUresult cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus* status) {
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = check_stream(stream);
    if (err == CUDA_SUCCESS) *status = capture_status(stream);
    return err;
}

PHOS_EXPORT CUresult cuStreamGetCaptureInfo_v3(CUstream stream, CUstreamCaptureStatus* status, cuuint64_t* id,
                                               CUgraph* graph, const CUgraphNode** deps, const CUgraphEdgeData** edges,
                                               size_t* count) {
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = check_stream(stream);
    if (err != CUDA_SUCCESS) return err;
    *status = capture_status(stream);
    CUgraph_st* capture = capture_of(stream);
    if (id) *id = capture ? capture_id(capture) : 0;
    if (graph) *graph = capture;
    if (deps) *deps = nullptr;
    if (edges) *edges = nullptr;
    if (count) *count = 0;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuStreamGetCaptureInfo_v2(CUstream stream, CUstreamCaptureStatus* status, cuuint64_t* id,
                                               CUgraph* graph, const CUgraphNode** deps, size_t* count) {
    return cuStreamGetCaptureInfo_v3(stream, status, id, graph, deps, nullptr, count);
}

// The calling thread's capture mode: kept, so a framework that swaps it gets it back.
PHOS_EXPORT CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode* mode) {
    if (!mode) return CUDA_ERROR_INVALID_VALUE;
    thread_local CUstreamCaptureMode current = CU_STREAM_CAPTURE_MODE_GLOBAL;
    std::swap(current, *mode);
    return CUDA_SUCCESS;
}

// phos makes no green contexts: every stream belongs to a plain one.
PHOS_EXPORT CUresult cuStreamGetGreenCtx(CUstream stream, CUgreenCtx* green) {
    if (!green) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = check_stream(stream);
    if (err == CUDA_SUCCESS) *green = nullptr;
    return err;
}
