// Driver API: stream capture, graphs and host functions.
//
// A graph lives here, in the application's process: capturing a stream records the calls
// made on it (launches with their packed parameters, device copies, memsets, event
// records and waits, host functions) in order, and launching the graph posts them again
// on the launch stream. The server sees ordinary calls, so a graph needs nothing of a
// checkpoint, a restore or a handoff: it is replayed against the same ids and addresses.
// Program order is a valid order of the captured work, so a replay runs it in that order
// on one stream: the same results, with the concurrency of one stream.
#include <algorithm>
#include <memory>

#include "driver_state.h"

// cuda.h names the CUDA 12.3 forms by the plain names; phos exports both.
#undef cuGraphGetEdges
#undef cuGraphNodeGetDependencies
#undef cuGraphNodeGetDependentNodes

namespace phos::driver {

struct GraphNode {
    wire::Call call;                 // a call to post again, on the stream the graph runs on
    CUhostFn host = nullptr;         // or a host function, run when the work before it is done
    void* data = nullptr;
};

}  // namespace phos::driver

// A node as the application sees it (cuGraphGetNodes): made when first asked for.
struct CUgraphNode_st {
    CUgraph_st* graph = nullptr;
    size_t index = 0;
};

struct CUgraph_st {
    CUctx_st* ctx = nullptr;
    uint64_t capture_id = 0;
    CUstream origin = nullptr;                 // the stream whose capture made it
    std::vector<CUstream_st*> joined;          // streams that joined that capture
    bool invalidated = false;                  // a call the capture cannot record was made
    std::vector<phos::driver::GraphNode> nodes;
    std::vector<std::unique_ptr<CUgraphNode_st>> handles;   // handles[i] names nodes[i]
};

struct CUgraphExec_st {
    CUctx_st* ctx = nullptr;
    std::vector<phos::driver::GraphNode> nodes;
};

namespace phos::driver {

static uint64_t next_capture_id = 1;

CUgraph_st* capture_of(CUstream stream) {
    if (!stream || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD) return nullptr;
    return is_handle(stream, HandleKind::stream) ? stream->capturing : nullptr;
}

void submit(CUctx_st* ctx, CUstream stream, wire::Call call) {
    if (CUgraph_st* g = capture_of(stream)) {
        g->nodes.push_back(GraphNode{std::move(call)});
        return;
    }
    ctx->conn->post(std::move(call));
}

bool capture_invalidated(const CUgraph_st* graph) { return graph->invalidated; }
uint64_t capture_id(const CUgraph_st* graph) { return graph->capture_id; }

CUresult refuse_in_capture(CUstream stream) {
    CUgraph_st* g = capture_of(stream);
    if (!g) return CUDA_SUCCESS;
    g->invalidated = true;     // as CUDA does: the capture can no longer be completed
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
}

// A stream that waits for an event recorded inside a capture joins that capture.
void join_capture(CUstream stream, CUevent event) {
    CUgraph_st* g = event->captured_in;
    if (!g || capture_of(stream) || !is_handle(stream, HandleKind::stream)) return;
    if (std::find(g->joined.begin(), g->joined.end(), stream) != g->joined.end() || stream == g->origin) return;
    stream->capturing = g;
    g->joined.push_back(stream);
}

static void end_capture(CUgraph_st* g) {
    g->origin->capturing = nullptr;
    for (CUstream_st* s : g->joined)
        if (is_handle(s, HandleKind::stream) && s->capturing == g) s->capturing = nullptr;
    for (CUevent_st* e : g->ctx->events)
        if (e->captured_in == g) e->captured_in = nullptr;
    g->joined.clear();
}

static CUresult run_host_function(CUctx_st* ctx, uint64_t sid, CUhostFn fn, void* data) {
    // The work before it must be done; the work after it is not sent until it returns.
    CUresult err = context_call(ctx, wire::Call::with_id(wire::Kind::streamSynchronize, sid));
    if (err == CUDA_SUCCESS) fn(data);
    return err;
}

}  // namespace phos::driver

using namespace phos;
using namespace phos::driver;

PHOS_EXPORT CUresult cuStreamBeginCapture_v2(CUstream stream, CUstreamCaptureMode) {
    Guard g(state().lock);
    CUresult err = require_init();
    if (err != CUDA_SUCCESS) return err;
    if (!stream || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;    // the legacy stream cannot be captured
    if (!is_handle(stream, HandleKind::stream)) return CUDA_ERROR_INVALID_HANDLE;
    if (stream->capturing) return CUDA_ERROR_ILLEGAL_STATE;
    auto* graph = new CUgraph_st();
    graph->ctx = stream->ctx;
    graph->capture_id = next_capture_id++;
    graph->origin = stream;
    state().handles[graph] = HandleKind::graph;
    stream->capturing = graph;
    return CUDA_SUCCESS;
}

// The CUDA 10.0 form, before capture modes; cuda.h maps the name to the newest form.
#undef cuStreamBeginCapture
PHOS_EXPORT CUresult cuStreamBeginCapture(CUstream stream) { return cuStreamBeginCapture_v2(stream, CU_STREAM_CAPTURE_MODE_GLOBAL); }

PHOS_EXPORT CUresult cuStreamEndCapture(CUstream stream, CUgraph* out) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUgraph_st* graph = capture_of(stream);
    if (!graph) return CUDA_ERROR_ILLEGAL_STATE;
    if (graph->origin != stream) return CUDA_ERROR_STREAM_CAPTURE_UNMATCHED;
    end_capture(graph);
    if (graph->invalidated) {
        state().handles.erase(graph);
        delete graph;
        *out = nullptr;
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    }
    *out = graph;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuGraphDestroy(CUgraph graph) {
    Guard g(state().lock);
    if (!is_handle(graph, HandleKind::graph)) return CUDA_ERROR_INVALID_VALUE;
    if (graph->origin && is_handle(graph->origin, HandleKind::stream) && graph->origin->capturing == graph)
        return CUDA_ERROR_ILLEGAL_STATE;    // still being captured
    for (const auto& node : graph->handles)
        if (node) state().handles.erase(node.get());
    state().handles.erase(graph);
    delete graph;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec* out, CUgraph graph, unsigned long long) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    if (!is_handle(graph, HandleKind::graph)) return CUDA_ERROR_INVALID_VALUE;
    auto* exec = new CUgraphExec_st();
    exec->ctx = graph->ctx;
    exec->nodes = graph->nodes;
    state().handles[exec] = HandleKind::graph_exec;
    *out = exec;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec* out, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS* params) {
    CUresult err = cuGraphInstantiateWithFlags(out, graph, params ? params->flags : 0);
    if (params) {
        params->result_out = err == CUDA_SUCCESS ? CUDA_GRAPH_INSTANTIATE_SUCCESS : CUDA_GRAPH_INSTANTIATE_ERROR;
        params->hErrNode_out = nullptr;
    }
    return err;
}

// The CUDA 10 and 11 form, with an error node and a log buffer.
PHOS_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec* out, CUgraph graph, CUgraphNode* error_node, char* log, size_t size) {
    if (error_node) *error_node = nullptr;
    if (log && size) log[0] = '\0';
    return cuGraphInstantiateWithFlags(out, graph, 0);
}

PHOS_EXPORT CUresult cuGraphExecDestroy(CUgraphExec exec) {
    Guard g(state().lock);
    if (!is_handle(exec, HandleKind::graph_exec)) return CUDA_ERROR_INVALID_VALUE;
    state().handles.erase(exec);
    delete exec;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuGraphUpload(CUgraphExec exec, CUstream) {
    Guard g(state().lock);
    return is_handle(exec, HandleKind::graph_exec) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;   // nothing to upload
}

PHOS_EXPORT CUresult cuGraphLaunch(CUgraphExec exec, CUstream stream) {
    Guard g(state().lock);
    CUresult err = require_init();
    if (err != CUDA_SUCCESS) return err;
    if (!is_handle(exec, HandleKind::graph_exec)) return CUDA_ERROR_INVALID_VALUE;
    CUctx_st* ctx = exec->ctx;
    if ((err = make_usable(ctx)) != CUDA_SUCCESS) return err;
    uint64_t sid = 0;
    if ((err = stream_id(stream, ctx, &sid)) != CUDA_SUCCESS) return err;
    for (const GraphNode& node : exec->nodes) {
        if (node.host) {
            if (CUgraph_st* outer = capture_of(stream)) outer->nodes.push_back(node);
            else if ((err = run_host_function(ctx, sid, node.host, node.data)) != CUDA_SUCCESS) return err;
            continue;
        }
        wire::Call call = node.call;
        call.stream = sid;
        submit(ctx, stream, std::move(call));
    }
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuLaunchHostFunc(CUstream stream, CUhostFn fn, void* data) {
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err != CUDA_SUCCESS) return err;
    uint64_t sid = 0;
    if ((err = stream_id(stream, is_handle(stream, HandleKind::stream) ? stream->ctx : ctx, &sid)) != CUDA_SUCCESS)
        return err;
    if (CUgraph_st* graph = capture_of(stream)) {
        graph->nodes.push_back(GraphNode{wire::Call{}, fn, data});
        return CUDA_SUCCESS;
    }
    return run_host_function(is_handle(stream, HandleKind::stream) ? stream->ctx : ctx, sid, fn, data);
}

namespace {
struct StreamCallback {
    CUstreamCallback fn;
    CUstream stream;
    void* data;
};
void call_stream_callback(void* p) {
    auto* cb = static_cast<StreamCallback*>(p);
    cb->fn(cb->stream, CUDA_SUCCESS, cb->data);
    delete cb;
}
}  // namespace

PHOS_EXPORT CUresult cuStreamAddCallback(CUstream stream, CUstreamCallback fn, void* data, unsigned int flags) {
    if (!fn || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    if (capture_of(stream)) return refuse_in_capture(stream);     // not allowed in a capture, as in CUDA
    auto* cb = new StreamCallback{fn, stream, data};
    CUresult err = cuLaunchHostFunc(stream, call_stream_callback, cb);
    if (err != CUDA_SUCCESS) delete cb;
    return err;
}

// -- a graph's nodes, as the application may inspect them ------------------------------------
// A graph runs its nodes in the order they were captured (see the top of this file), so its
// edges are that chain: node i before node i + 1.

static CUgraphNode node_handle(CUgraph graph, size_t i) {
    if (graph->handles.size() < graph->nodes.size()) graph->handles.resize(graph->nodes.size());
    auto& h = graph->handles[i];
    if (!h) {
        h = std::make_unique<CUgraphNode_st>(CUgraphNode_st{graph, i});
        state().handles[h.get()] = HandleKind::graph_node;
    }
    return h.get();
}

// Fill out[0..*count) from first..last (out null: only the count), as the driver does: NULL
// after the last, and *count the number there are, or the number written when out is smaller.
static CUresult node_list(CUgraph graph, size_t first, size_t last, CUgraphNode* out, size_t* count) {
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    size_t n = last > first ? last - first : 0;
    if (!out) {
        *count = n;
        return CUDA_SUCCESS;
    }
    for (size_t i = 0; i < *count; i++) out[i] = i < n ? node_handle(graph, first + i) : nullptr;
    *count = std::min(*count, n);
    return CUDA_SUCCESS;
}

static CUresult check_graph(CUgraph graph) { return is_handle(graph, HandleKind::graph) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }
static CUresult check_node(CUgraphNode node) { return is_handle(node, HandleKind::graph_node) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }

PHOS_EXPORT CUresult cuGraphGetNodes(CUgraph graph, CUgraphNode* nodes, size_t* count) {
    Guard g(state().lock);
    CUresult err = check_graph(graph);
    return err != CUDA_SUCCESS ? err : node_list(graph, 0, graph->nodes.size(), nodes, count);
}

PHOS_EXPORT CUresult cuGraphGetRootNodes(CUgraph graph, CUgraphNode* nodes, size_t* count) {
    Guard g(state().lock);
    CUresult err = check_graph(graph);
    return err != CUDA_SUCCESS ? err : node_list(graph, 0, std::min<size_t>(1, graph->nodes.size()), nodes, count);
}

PHOS_EXPORT CUresult cuGraphNodeGetType(CUgraphNode node, CUgraphNodeType* type) {
    if (!type) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = check_node(node);
    if (err != CUDA_SUCCESS) return err;
    const GraphNode& n = node->graph->nodes[node->index];
    if (n.host) {
        *type = CU_GRAPH_NODE_TYPE_HOST;
        return CUDA_SUCCESS;
    }
    switch (n.call.kind) {
    case wire::Kind::launch: *type = CU_GRAPH_NODE_TYPE_KERNEL; break;
    case wire::Kind::memcpyHtoD: case wire::Kind::memcpyDtoH: case wire::Kind::memcpyDtoD: *type = CU_GRAPH_NODE_TYPE_MEMCPY; break;
    case wire::Kind::memset: *type = CU_GRAPH_NODE_TYPE_MEMSET; break;
    case wire::Kind::eventRecord: *type = CU_GRAPH_NODE_TYPE_EVENT_RECORD; break;
    case wire::Kind::streamWaitEvent: *type = CU_GRAPH_NODE_TYPE_WAIT_EVENT; break;
    default: *type = CU_GRAPH_NODE_TYPE_EMPTY; break;
    }
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuGraphGetEdges_v2(CUgraph graph, CUgraphNode* from, CUgraphNode* to, CUgraphEdgeData* data, size_t* count) {
    if (!count || (!from != !to)) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = check_graph(graph);
    if (err != CUDA_SUCCESS) return err;
    size_t edges = graph->nodes.empty() ? 0 : graph->nodes.size() - 1;
    if (!from) {
        *count = edges;
        return CUDA_SUCCESS;
    }
    for (size_t i = 0; i < *count; i++) {
        from[i] = i < edges ? node_handle(graph, i) : nullptr;
        to[i] = i < edges ? node_handle(graph, i + 1) : nullptr;
        if (data) data[i] = CUgraphEdgeData{};
    }
    *count = std::min(*count, edges);
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuGraphGetEdges(CUgraph graph, CUgraphNode* from, CUgraphNode* to, size_t* count) {
    return cuGraphGetEdges_v2(graph, from, to, nullptr, count);
}

// The node before this one, and the node after it.
static CUresult neighbour(CUgraphNode node, bool after, CUgraphNode* out, CUgraphEdgeData* data, size_t* count) {
    Guard g(state().lock);
    CUresult err = check_node(node);
    if (err != CUDA_SUCCESS) return err;
    size_t i = node->index, n = node->graph->nodes.size();
    size_t first = after ? i + 1 : (i ? i - 1 : 0), last = after ? std::min(i + 2, n) : i;
    if (out && data)
        for (size_t k = 0; k < *count; k++) data[k] = CUgraphEdgeData{};
    return node_list(node->graph, first, last, out, count);
}

PHOS_EXPORT CUresult cuGraphNodeGetDependencies_v2(CUgraphNode node, CUgraphNode* deps, CUgraphEdgeData* data, size_t* count) {
    return neighbour(node, false, deps, data, count);
}
PHOS_EXPORT CUresult cuGraphNodeGetDependencies(CUgraphNode node, CUgraphNode* deps, size_t* count) {
    return neighbour(node, false, deps, nullptr, count);
}
PHOS_EXPORT CUresult cuGraphNodeGetDependentNodes_v2(CUgraphNode node, CUgraphNode* deps, CUgraphEdgeData* data, size_t* count) {
    return neighbour(node, true, deps, data, count);
}
PHOS_EXPORT CUresult cuGraphNodeGetDependentNodes(CUgraphNode node, CUgraphNode* deps, size_t* count) {
    return neighbour(node, true, deps, nullptr, count);
}
