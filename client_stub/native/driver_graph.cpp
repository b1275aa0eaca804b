// Driver API: stream capture, graphs and host functions.
//
// A graph lives here, in the application's process: capturing a stream records the calls
// made on it (launches with their packed parameters, device copies, memsets, event
// records and waits, host functions) in order, and launching the graph posts them again
// on the launch stream. The server sees ordinary calls, so a graph needs nothing of a
// checkpoint, a restore or a handoff: it is replayed against the same ids and addresses.
// Program order is a valid order of the captured work, so a replay runs it in that order
// on one stream: the same results, with the concurrency of one stream.
//
// A graph built node by node (cuGraphCreate, cuGraphAdd*Node) keeps each node's parameters
// (a kernel's arguments copied when the node is made, as CUDA copies them) and its
// dependencies; a launch makes each node's driver call on the launch stream, in a
// topological order of the dependencies (earlier-made nodes first among those ready), so a
// copy node reads or writes host memory when the graph runs, as CUDA's does. An
// instantiated graph is a copy of the graph; its nodes keep the graph's indices, which
// cuGraphExec*SetParams and cuGraphExecUpdate use.
#include <algorithm>
#include <memory>
#include <set>

#include "driver_state.h"

// cuda.h names the CUDA 12.3 forms by the plain names; phos exports both.
#undef cuGraphGetEdges
#undef cuGraphNodeGetDependencies
#undef cuGraphNodeGetDependentNodes
#undef cuGraphAddDependencies
#undef cuGraphRemoveDependencies

namespace phos::driver {

// What a node does when its graph runs. `recorded` nodes come from stream capture: a call to
// post again. The others come from cuGraphAdd*Node and keep their parameters; a launch makes
// the public driver call they stand for on the launch stream (so every check and every
// transfer path of that call applies), in a topological order of the dependencies.
enum class NodeKind : uint8_t { recorded, host, kernel, memcpy, memset, event_record, event_wait, child, empty };

struct KernelNode {
    CUfunction func = nullptr;        // as given: a CUfunction, or a CUkernel resolved at launch
    unsigned grid[3] = {1, 1, 1}, block[3] = {1, 1, 1}, shared = 0;
    std::string params;               // copied when the node is made, packed as the kernel lays them out
    std::vector<void*> param_pointers;   // kernelParams as cuGraphKernelNodeGetParams hands them out
};

struct GraphNode {
    NodeKind kind = NodeKind::recorded;
    wire::Call call;                  // recorded: a call to post again, on the stream the graph runs on
    CUhostFn host = nullptr;          // host: run when the work before it is done
    void* data = nullptr;
    std::vector<size_t> deps;         // the nodes (indices) that run before this one
    bool removed = false;             // cuGraphDestroyNode: its index stays, unused
    KernelNode kernel;
    CUDA_MEMCPY3D copy{};
    CUDA_MEMSET_NODE_PARAMS fill{};
    CUevent event = nullptr;
    CUgraph_st* child = nullptr;      // child: the graph's own copy of the child graph
};

}  // namespace phos::driver

// A node as the application sees it: made when first asked for.
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

// An instantiated graph: a copy of the graph (so later changes to the graph leave it alone),
// whose nodes have the indices of the graph's, for the cuGraphExec*SetParams calls.
struct CUgraphExec_st {
    CUctx_st* ctx = nullptr;
    CUgraph_st* graph = nullptr;
};

namespace phos::driver {

static uint64_t next_capture_id = 1;

CUgraph_st* capture_of(CUstream stream) {
    if (is_default_stream(stream)) return nullptr;
    return is_handle(stream, HandleKind::stream) ? stream->capturing : nullptr;
}

// A captured node follows the one captured before it.
static void append_captured(CUgraph_st* g, GraphNode node) {
    node.deps.clear();
    if (!g->nodes.empty()) node.deps.push_back(g->nodes.size() - 1);
    g->nodes.push_back(std::move(node));
}

void record_call(CUgraph_st* capture, wire::Call call) {
    GraphNode node;
    node.call = std::move(call);
    append_captured(capture, std::move(node));
}

bool capture_invalidated(const CUgraph_st* graph) { return graph->invalidated; }

CUresult capture_copy(CUstream stream, const CUDA_MEMCPY3D& p) {
    GraphNode node;
    node.kind = NodeKind::memcpy;
    node.copy = p;
    append_captured(capture_of(stream), std::move(node));
    return CUDA_SUCCESS;
}
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

static CUresult run_host_function(const Target& t, CUhostFn fn, void* data) {
    // The work before it must be done; the work after it is not sent until it returns.
    CUresult err = send(t, wire::Call::with_id(wire::Kind::streamSynchronize, t.sid));
    if (err == CUDA_SUCCESS) fn(data);
    return err;
}

// -- graphs as values: made, copied, destroyed ---------------------------------------------

static CUgraph_st* new_graph(CUctx_st* ctx) {
    auto* graph = new CUgraph_st();
    graph->ctx = ctx;
    state().handles[graph] = HandleKind::graph;
    return graph;
}

static void delete_graph(CUgraph_st* graph) {
    for (GraphNode& node : graph->nodes)
        if (node.child) delete_graph(node.child);
    for (const auto& h : graph->handles)
        if (h) state().handles.erase(h.get());
    state().handles.erase(graph);
    delete graph;
}

// A copy with the same node indices and edges; child graphs are copied too.
static CUgraph_st* clone_graph(const CUgraph_st* graph) {
    CUgraph_st* copy = new_graph(graph->ctx);
    copy->nodes = graph->nodes;
    for (GraphNode& node : copy->nodes)
        if (node.child) node.child = clone_graph(node.child);
    return copy;
}

// The nodes in an order that respects every dependency, earlier-made nodes first among those
// ready; fewer than the live nodes when the dependencies hold a cycle.
static std::vector<size_t> launch_order(const std::vector<GraphNode>& nodes) {
    std::vector<size_t> waiting(nodes.size(), 0), order;
    std::vector<std::vector<size_t>> after(nodes.size());
    for (size_t i = 0; i < nodes.size(); i++) {
        if (nodes[i].removed) continue;
        for (size_t d : nodes[i].deps) {
            after[d].push_back(i);
            waiting[i]++;
        }
    }
    std::set<size_t> ready;
    for (size_t i = 0; i < nodes.size(); i++)
        if (!nodes[i].removed && waiting[i] == 0) ready.insert(i);
    while (!ready.empty()) {
        size_t i = *ready.begin();
        ready.erase(ready.begin());
        order.push_back(i);
        for (size_t j : after[i])
            if (--waiting[j] == 0) ready.insert(j);
    }
    return order;
}

static size_t live_nodes(const CUgraph_st* graph) {
    return static_cast<size_t>(std::count_if(graph->nodes.begin(), graph->nodes.end(),
                                             [](const GraphNode& n) { return !n.removed; }));
}

static bool acyclic(const CUgraph_st* graph) {
    if (launch_order(graph->nodes).size() != live_nodes(graph)) return false;
    for (const GraphNode& node : graph->nodes)
        if (!node.removed && node.child && !acyclic(node.child)) return false;
    return true;
}

// -- running a graph's nodes on a stream ----------------------------------------------------

static CUresult run_memset(const CUDA_MEMSET_NODE_PARAMS& p, CUstream stream) {
    for (size_t row = 0; row < std::max<size_t>(p.height, 1); row++) {
        CUdeviceptr at = p.dst + row * p.pitch;
        CUresult err = p.elementSize == 1   ? cuMemsetD8Async(at, static_cast<unsigned char>(p.value), p.width, stream)
                       : p.elementSize == 2 ? cuMemsetD16Async(at, static_cast<unsigned short>(p.value), p.width, stream)
                                            : cuMemsetD32Async(at, p.value, p.width, stream);
        if (err != CUDA_SUCCESS) return err;
    }
    return CUDA_SUCCESS;
}

static CUresult run_kernel(const KernelNode& k, CUstream stream) {
    size_t size = k.params.size();
    void* buffer = const_cast<char*>(k.params.data());
    void* extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, buffer, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, CU_LAUNCH_PARAM_END};
    return cuLaunchKernel(k.func, k.grid[0], k.grid[1], k.grid[2], k.block[0], k.block[1], k.block[2], k.shared,
                          stream, nullptr, extra);
}

static CUresult run_graph(const Target& t, const CUgraph_st* graph) {
    const CUstream stream = t.stream;
    for (size_t i : launch_order(graph->nodes)) {
        const GraphNode& node = graph->nodes[i];
        CUresult err = CUDA_SUCCESS;
        switch (node.kind) {
        case NodeKind::recorded: {
            wire::Call call = node.call;
            call.stream = t.sid;
            err = send(t, std::move(call));
            break;
        }
        case NodeKind::host:
            if (CUgraph_st* outer = capture_of(stream)) append_captured(outer, node);
            else err = run_host_function(t, node.host, node.data);
            break;
        case NodeKind::kernel: err = run_kernel(node.kernel, stream); break;
        case NodeKind::memcpy: err = copy_3d(node.copy, stream, true); break;
        case NodeKind::memset: err = run_memset(node.fill, stream); break;
        case NodeKind::event_record: err = cuEventRecord(node.event, stream); break;
        case NodeKind::event_wait: err = cuStreamWaitEvent(stream, node.event, 0); break;
        case NodeKind::child: err = run_graph(t, node.child); break;
        case NodeKind::empty: break;
        }
        if (err != CUDA_SUCCESS) {
            log_verbose("graph launch: node %zu failed (%d)", i, static_cast<int>(err));
            return err;
        }
    }
    return CUDA_SUCCESS;
}

}  // namespace phos::driver

using namespace phos;
using namespace phos::driver;

PHOS_EXPORT CUresult cuStreamBeginCapture_v2(CUstream stream, CUstreamCaptureMode) {
    Guard g(state().lock);
    CUresult err = require_init();
    if (err != CUDA_SUCCESS) return err;
    if (is_default_stream(stream)) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;    // the legacy stream cannot be captured
    if (!is_handle(stream, HandleKind::stream)) return CUDA_ERROR_INVALID_HANDLE;
    if (stream->capturing) return CUDA_ERROR_ILLEGAL_STATE;
    CUgraph_st* graph = new_graph(stream->ctx);
    graph->capture_id = next_capture_id++;
    graph->origin = stream;
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
    graph->origin = nullptr;
    if (graph->invalidated) {
        delete_graph(graph);
        *out = nullptr;
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    }
    *out = graph;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuGraphCreate(CUgraph* out, unsigned int flags) {
    if (!out || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err != CUDA_SUCCESS) return err;
    *out = new_graph(ctx);
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuGraphClone(CUgraph* out, CUgraph graph) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    if (!is_handle(graph, HandleKind::graph)) return CUDA_ERROR_INVALID_VALUE;
    *out = clone_graph(graph);
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuGraphDestroy(CUgraph graph) {
    Guard g(state().lock);
    if (!is_handle(graph, HandleKind::graph)) return CUDA_ERROR_INVALID_VALUE;
    if (graph->origin && is_handle(graph->origin, HandleKind::stream) && graph->origin->capturing == graph)
        return CUDA_ERROR_ILLEGAL_STATE;    // still being captured
    delete_graph(graph);
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec* out, CUgraph graph, unsigned long long) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    if (!is_handle(graph, HandleKind::graph)) return CUDA_ERROR_INVALID_VALUE;
    if (!acyclic(graph)) {
        log_verbose("cuGraphInstantiate: the graph's dependencies hold a cycle");
        return CUDA_ERROR_INVALID_VALUE;
    }
    auto* exec = new CUgraphExec_st();
    exec->ctx = graph->ctx;
    exec->graph = clone_graph(graph);
    state().handles.erase(exec->graph);      // the application never names it
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
    delete_graph(exec->graph);
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
    if ((err = make_usable(exec->ctx)) != CUDA_SUCCESS) return err;
    Target t;
    if ((err = on_context(exec->ctx, stream, &t)) != CUDA_SUCCESS) return err;
    // A node's call acts in the current context, as it would have when the node was made.
    if ((err = cuCtxPushCurrent_v2(t.ctx)) != CUDA_SUCCESS) return err;
    err = run_graph(t, exec->graph);
    CUcontext popped;
    cuCtxPopCurrent_v2(&popped);
    return err;
}

PHOS_EXPORT CUresult cuLaunchHostFunc(CUstream stream, CUhostFn fn, void* data) {
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUctx_st* ctx;
    CUresult err = current_context(&ctx);
    if (err != CUDA_SUCCESS) return err;
    Target t;
    if ((err = on_context(is_handle(stream, HandleKind::stream) ? stream->ctx : ctx, stream, &t)) != CUDA_SUCCESS)
        return err;
    if (CUgraph_st* graph = capture_of(stream)) {
        GraphNode node;
        node.kind = NodeKind::host;
        node.host = fn;
        node.data = data;
        append_captured(graph, std::move(node));
        return CUDA_SUCCESS;
    }
    return run_host_function(t, fn, data);
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

// -- a graph's nodes and edges, as the application builds and inspects them ----------------

static CUgraphNode node_handle(CUgraph graph, size_t i) {
    if (graph->handles.size() < graph->nodes.size()) graph->handles.resize(graph->nodes.size());
    auto& h = graph->handles[i];
    if (!h) {
        h = std::make_unique<CUgraphNode_st>(CUgraphNode_st{graph, i});
        state().handles[h.get()] = HandleKind::graph_node;
    }
    return h.get();
}

// Fill out[0..*count) from the indices (out null: only the count), as the driver does: NULL
// after the last, and *count the number there are, or the number written when out is smaller.
static CUresult node_list(CUgraph graph, const std::vector<size_t>& indices, CUgraphNode* out, CUgraphEdgeData* data,
                          size_t* count) {
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    if (!out) {
        *count = indices.size();
        return CUDA_SUCCESS;
    }
    for (size_t i = 0; i < *count; i++) {
        out[i] = i < indices.size() ? node_handle(graph, indices[i]) : nullptr;
        if (data) data[i] = CUgraphEdgeData{};
    }
    *count = std::min(*count, indices.size());
    return CUDA_SUCCESS;
}

static CUresult check_graph(CUgraph graph) { return is_handle(graph, HandleKind::graph) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }
static CUresult check_node(CUgraphNode node) {
    return is_handle(node, HandleKind::graph_node) && !node->graph->nodes[node->index].removed ? CUDA_SUCCESS
                                                                                              : CUDA_ERROR_INVALID_VALUE;
}
static GraphNode& node_of(CUgraphNode node) { return node->graph->nodes[node->index]; }

PHOS_EXPORT CUresult cuGraphGetNodes(CUgraph graph, CUgraphNode* nodes, size_t* count) {
    Guard g(state().lock);
    CUresult err = check_graph(graph);
    if (err != CUDA_SUCCESS) return err;
    std::vector<size_t> all;
    for (size_t i = 0; i < graph->nodes.size(); i++)
        if (!graph->nodes[i].removed) all.push_back(i);
    return node_list(graph, all, nodes, nullptr, count);
}

PHOS_EXPORT CUresult cuGraphGetRootNodes(CUgraph graph, CUgraphNode* nodes, size_t* count) {
    Guard g(state().lock);
    CUresult err = check_graph(graph);
    if (err != CUDA_SUCCESS) return err;
    std::vector<size_t> roots;
    for (size_t i = 0; i < graph->nodes.size(); i++)
        if (!graph->nodes[i].removed && graph->nodes[i].deps.empty()) roots.push_back(i);
    return node_list(graph, roots, nodes, nullptr, count);
}

PHOS_EXPORT CUresult cuGraphNodeGetType(CUgraphNode node, CUgraphNodeType* type) {
    if (!type) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    CUresult err = check_node(node);
    if (err != CUDA_SUCCESS) return err;
    const GraphNode& n = node_of(node);
    switch (n.kind) {
    case NodeKind::host: *type = CU_GRAPH_NODE_TYPE_HOST; return CUDA_SUCCESS;
    case NodeKind::kernel: *type = CU_GRAPH_NODE_TYPE_KERNEL; return CUDA_SUCCESS;
    case NodeKind::memcpy: *type = CU_GRAPH_NODE_TYPE_MEMCPY; return CUDA_SUCCESS;
    case NodeKind::memset: *type = CU_GRAPH_NODE_TYPE_MEMSET; return CUDA_SUCCESS;
    case NodeKind::event_record: *type = CU_GRAPH_NODE_TYPE_EVENT_RECORD; return CUDA_SUCCESS;
    case NodeKind::event_wait: *type = CU_GRAPH_NODE_TYPE_WAIT_EVENT; return CUDA_SUCCESS;
    case NodeKind::child: *type = CU_GRAPH_NODE_TYPE_GRAPH; return CUDA_SUCCESS;
    case NodeKind::empty: *type = CU_GRAPH_NODE_TYPE_EMPTY; return CUDA_SUCCESS;
    case NodeKind::recorded: break;
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
    std::vector<std::pair<size_t, size_t>> edges;
    for (size_t i = 0; i < graph->nodes.size(); i++)
        if (!graph->nodes[i].removed)
            for (size_t d : graph->nodes[i].deps) edges.emplace_back(d, i);
    if (!from) {
        *count = edges.size();
        return CUDA_SUCCESS;
    }
    for (size_t i = 0; i < *count; i++) {
        from[i] = i < edges.size() ? node_handle(graph, edges[i].first) : nullptr;
        to[i] = i < edges.size() ? node_handle(graph, edges[i].second) : nullptr;
        if (data) data[i] = CUgraphEdgeData{};
    }
    *count = std::min(*count, edges.size());
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuGraphGetEdges(CUgraph graph, CUgraphNode* from, CUgraphNode* to, size_t* count) {
    return cuGraphGetEdges_v2(graph, from, to, nullptr, count);
}

// The nodes this one depends on, or the nodes that depend on it.
static CUresult neighbours(CUgraphNode node, bool after, CUgraphNode* out, CUgraphEdgeData* data, size_t* count) {
    Guard g(state().lock);
    CUresult err = check_node(node);
    if (err != CUDA_SUCCESS) return err;
    std::vector<size_t> found;
    if (!after) {
        found = node_of(node).deps;
    } else {
        const auto& nodes = node->graph->nodes;
        for (size_t i = 0; i < nodes.size(); i++)
            if (!nodes[i].removed && std::count(nodes[i].deps.begin(), nodes[i].deps.end(), node->index)) found.push_back(i);
    }
    return node_list(node->graph, found, out, data, count);
}

PHOS_EXPORT CUresult cuGraphNodeGetDependencies_v2(CUgraphNode node, CUgraphNode* deps, CUgraphEdgeData* data, size_t* count) {
    return neighbours(node, false, deps, data, count);
}
PHOS_EXPORT CUresult cuGraphNodeGetDependencies(CUgraphNode node, CUgraphNode* deps, size_t* count) {
    return neighbours(node, false, deps, nullptr, count);
}
PHOS_EXPORT CUresult cuGraphNodeGetDependentNodes_v2(CUgraphNode node, CUgraphNode* deps, CUgraphEdgeData* data, size_t* count) {
    return neighbours(node, true, deps, data, count);
}
PHOS_EXPORT CUresult cuGraphNodeGetDependentNodes(CUgraphNode node, CUgraphNode* deps, size_t* count) {
    return neighbours(node, true, deps, nullptr, count);
}

// -- adding nodes ---------------------------------------------------------------------------

// Checks the dependencies (nodes of this graph, each named once) and adds the node after them.
static CUresult add_node(CUgraphNode* out, CUgraph graph, const CUgraphNode* deps, size_t count, GraphNode node) {
    if (!out || (count && !deps)) return CUDA_ERROR_INVALID_VALUE;
    CUresult err = check_graph(graph);
    if (err != CUDA_SUCCESS) return err;
    node.deps.clear();
    for (size_t i = 0; i < count; i++) {
        if (check_node(deps[i]) != CUDA_SUCCESS || deps[i]->graph != graph) return CUDA_ERROR_INVALID_VALUE;
        if (std::count(node.deps.begin(), node.deps.end(), deps[i]->index)) return CUDA_ERROR_INVALID_VALUE;
        node.deps.push_back(deps[i]->index);
    }
    graph->nodes.push_back(std::move(node));
    *out = node_handle(graph, graph->nodes.size() - 1);
    return CUDA_SUCCESS;
}

// A kernel node's parameters, copied: the application may reuse its argument buffers.
static CUresult kernel_node(const CUDA_KERNEL_NODE_PARAMS* p, KernelNode* out) {
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    CUfunction func = p->func ? p->func : reinterpret_cast<CUfunction>(p->kern);
    CUfunc_st* f;
    CUresult err = resolve_function(func, &f);
    if (err != CUDA_SUCCESS) return err;
    KernelNode k;
    k.func = func;
    k.grid[0] = p->gridDimX, k.grid[1] = p->gridDimY, k.grid[2] = p->gridDimZ;
    k.block[0] = p->blockDimX, k.block[1] = p->blockDimY, k.block[2] = p->blockDimZ;
    k.shared = p->sharedMemBytes;
    if ((err = pack_params(f, p->kernelParams, p->extra, k.params)) != CUDA_SUCCESS) return err;
    *out = std::move(k);
    return CUDA_SUCCESS;
}

static CUresult memset_node(const CUDA_MEMSET_NODE_PARAMS* p) {
    if (!p || (p->elementSize != 1 && p->elementSize != 2 && p->elementSize != 4) || (p->height > 1 && p->pitch < p->width * p->elementSize))
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuGraphAddKernelNode_v2(CUgraphNode* out, CUgraph graph, const CUgraphNode* deps, size_t count,
                                             const CUDA_KERNEL_NODE_PARAMS* params) {
    Guard g(state().lock);
    GraphNode node;
    node.kind = NodeKind::kernel;
    CUresult err = kernel_node(params, &node.kernel);
    return err != CUDA_SUCCESS ? err : add_node(out, graph, deps, count, std::move(node));
}

PHOS_EXPORT CUresult cuGraphAddMemcpyNode(CUgraphNode* out, CUgraph graph, const CUgraphNode* deps, size_t count,
                                          const CUDA_MEMCPY3D* params, CUcontext) {
    if (!params) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    GraphNode node;
    node.kind = NodeKind::memcpy;
    node.copy = *params;
    return add_node(out, graph, deps, count, std::move(node));
}

PHOS_EXPORT CUresult cuGraphAddMemsetNode(CUgraphNode* out, CUgraph graph, const CUgraphNode* deps, size_t count,
                                          const CUDA_MEMSET_NODE_PARAMS* params, CUcontext) {
    Guard g(state().lock);
    CUresult err = memset_node(params);
    if (err != CUDA_SUCCESS) return err;
    GraphNode node;
    node.kind = NodeKind::memset;
    node.fill = *params;
    return add_node(out, graph, deps, count, std::move(node));
}

PHOS_EXPORT CUresult cuGraphAddHostNode(CUgraphNode* out, CUgraph graph, const CUgraphNode* deps, size_t count,
                                        const CUDA_HOST_NODE_PARAMS* params) {
    if (!params || !params->fn) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    GraphNode node;
    node.kind = NodeKind::host;
    node.host = params->fn;
    node.data = params->userData;
    return add_node(out, graph, deps, count, std::move(node));
}

PHOS_EXPORT CUresult cuGraphAddEmptyNode(CUgraphNode* out, CUgraph graph, const CUgraphNode* deps, size_t count) {
    Guard g(state().lock);
    GraphNode node;
    node.kind = NodeKind::empty;
    return add_node(out, graph, deps, count, std::move(node));
}

static CUresult add_event_node(CUgraphNode* out, CUgraph graph, const CUgraphNode* deps, size_t count, CUevent event,
                               NodeKind kind) {
    Guard g(state().lock);
    if (!is_handle(event, HandleKind::event)) return CUDA_ERROR_INVALID_VALUE;
    GraphNode node;
    node.kind = kind;
    node.event = event;
    return add_node(out, graph, deps, count, std::move(node));
}

PHOS_EXPORT CUresult cuGraphAddEventRecordNode(CUgraphNode* out, CUgraph graph, const CUgraphNode* deps, size_t count, CUevent event) {
    return add_event_node(out, graph, deps, count, event, NodeKind::event_record);
}

PHOS_EXPORT CUresult cuGraphAddEventWaitNode(CUgraphNode* out, CUgraph graph, const CUgraphNode* deps, size_t count, CUevent event) {
    return add_event_node(out, graph, deps, count, event, NodeKind::event_wait);
}

PHOS_EXPORT CUresult cuGraphAddChildGraphNode(CUgraphNode* out, CUgraph graph, const CUgraphNode* deps, size_t count, CUgraph child) {
    Guard g(state().lock);
    if (check_graph(child) != CUDA_SUCCESS || child == graph) return CUDA_ERROR_INVALID_VALUE;
    GraphNode node;
    node.kind = NodeKind::child;
    node.child = clone_graph(child);      // the node holds a copy, as CUDA's does
    CUresult err = add_node(out, graph, deps, count, node);
    if (err != CUDA_SUCCESS) delete_graph(node.child);
    return err;
}

PHOS_EXPORT CUresult cuGraphChildGraphNodeGetGraph(CUgraphNode node, CUgraph* out) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    if (check_node(node) != CUDA_SUCCESS || node_of(node).kind != NodeKind::child) return CUDA_ERROR_INVALID_VALUE;
    *out = node_of(node).child;
    return CUDA_SUCCESS;
}

// -- edges and node removal -----------------------------------------------------------------

static CUresult edit_edges(CUgraph graph, const CUgraphNode* from, const CUgraphNode* to, size_t count, bool add) {
    Guard g(state().lock);
    CUresult err = check_graph(graph);
    if (err != CUDA_SUCCESS) return err;
    if (count && (!from || !to)) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < count; i++) {
        if (check_node(from[i]) || check_node(to[i]) || from[i]->graph != graph || to[i]->graph != graph || from[i] == to[i])
            return CUDA_ERROR_INVALID_VALUE;
        auto& deps = node_of(to[i]).deps;
        auto it = std::find(deps.begin(), deps.end(), from[i]->index);
        if (add == (it != deps.end())) return CUDA_ERROR_INVALID_VALUE;   // already there / not there
    }
    for (size_t i = 0; i < count; i++) {
        auto& deps = node_of(to[i]).deps;
        if (add) deps.push_back(from[i]->index);
        else deps.erase(std::find(deps.begin(), deps.end(), from[i]->index));
    }
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuGraphAddDependencies_v2(CUgraph graph, const CUgraphNode* from, const CUgraphNode* to,
                                               const CUgraphEdgeData*, size_t count) {
    return edit_edges(graph, from, to, count, true);
}
PHOS_EXPORT CUresult cuGraphAddDependencies(CUgraph graph, const CUgraphNode* from, const CUgraphNode* to, size_t count) {
    return edit_edges(graph, from, to, count, true);
}
PHOS_EXPORT CUresult cuGraphRemoveDependencies_v2(CUgraph graph, const CUgraphNode* from, const CUgraphNode* to,
                                                  const CUgraphEdgeData*, size_t count) {
    return edit_edges(graph, from, to, count, false);
}
PHOS_EXPORT CUresult cuGraphRemoveDependencies(CUgraph graph, const CUgraphNode* from, const CUgraphNode* to, size_t count) {
    return edit_edges(graph, from, to, count, false);
}

PHOS_EXPORT CUresult cuGraphDestroyNode(CUgraphNode node) {
    Guard g(state().lock);
    CUresult err = check_node(node);
    if (err != CUDA_SUCCESS) return err;
    GraphNode& n = node_of(node);
    if (n.child) delete_graph(n.child);
    n = GraphNode{};
    n.removed = true;
    for (GraphNode& other : node->graph->nodes)
        other.deps.erase(std::remove(other.deps.begin(), other.deps.end(), node->index), other.deps.end());
    node->graph->handles[node->index].reset();
    state().handles.erase(node);
    return CUDA_SUCCESS;
}

// -- node parameters: of a graph's node, and of an instantiated graph's copy of it -----------

static CUresult node_of_kind(CUgraphNode node, NodeKind kind, GraphNode** out) {
    if (check_node(node) != CUDA_SUCCESS || node_of(node).kind != kind) return CUDA_ERROR_INVALID_VALUE;
    *out = &node_of(node);
    return CUDA_SUCCESS;
}

// The instantiated graph's copy of a node of the graph it was made from.
static CUresult exec_node(CUgraphExec exec, CUgraphNode node, NodeKind kind, GraphNode** out) {
    if (!is_handle(exec, HandleKind::graph_exec) || check_node(node) != CUDA_SUCCESS) return CUDA_ERROR_INVALID_VALUE;
    if (node->index >= exec->graph->nodes.size() || exec->graph->nodes[node->index].kind != kind ||
        node_of(node).kind != kind)
        return CUDA_ERROR_INVALID_VALUE;
    *out = &exec->graph->nodes[node->index];
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuGraphKernelNodeGetParams_v2(CUgraphNode node, CUDA_KERNEL_NODE_PARAMS* params) {
    if (!params) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    GraphNode* n;
    CUresult err = node_of_kind(node, NodeKind::kernel, &n);
    if (err != CUDA_SUCCESS) return err;
    const KernelNode& k = n->kernel;
    *params = CUDA_KERNEL_NODE_PARAMS{};
    params->func = k.func;
    params->gridDimX = k.grid[0], params->gridDimY = k.grid[1], params->gridDimZ = k.grid[2];
    params->blockDimX = k.block[0], params->blockDimY = k.block[1], params->blockDimZ = k.block[2];
    params->sharedMemBytes = k.shared;
    n->kernel.param_pointers.clear();     // into this node's own copy of the arguments
    CUfunc_st* f;
    if (resolve_function(k.func, &f) == CUDA_SUCCESS)
        for (const wire::ParamInfo& info : f->params) n->kernel.param_pointers.push_back(&n->kernel.params[info.offset]);
    params->kernelParams = n->kernel.param_pointers.empty() ? nullptr : n->kernel.param_pointers.data();
    return CUDA_SUCCESS;
}

PHOS_EXPORT CUresult cuGraphKernelNodeSetParams_v2(CUgraphNode node, const CUDA_KERNEL_NODE_PARAMS* params) {
    Guard g(state().lock);
    GraphNode* n;
    CUresult err = node_of_kind(node, NodeKind::kernel, &n);
    return err != CUDA_SUCCESS ? err : kernel_node(params, &n->kernel);
}

PHOS_EXPORT CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec exec, CUgraphNode node, const CUDA_KERNEL_NODE_PARAMS* params) {
    Guard g(state().lock);
    GraphNode* n;
    CUresult err = exec_node(exec, node, NodeKind::kernel, &n);
    return err != CUDA_SUCCESS ? err : kernel_node(params, &n->kernel);
}

PHOS_EXPORT CUresult cuGraphMemcpyNodeGetParams(CUgraphNode node, CUDA_MEMCPY3D* params) {
    if (!params) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    GraphNode* n;
    CUresult err = node_of_kind(node, NodeKind::memcpy, &n);
    if (err == CUDA_SUCCESS) *params = n->copy;
    return err;
}

PHOS_EXPORT CUresult cuGraphMemcpyNodeSetParams(CUgraphNode node, const CUDA_MEMCPY3D* params) {
    if (!params) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    GraphNode* n;
    CUresult err = node_of_kind(node, NodeKind::memcpy, &n);
    if (err == CUDA_SUCCESS) n->copy = *params;
    return err;
}

PHOS_EXPORT CUresult cuGraphExecMemcpyNodeSetParams(CUgraphExec exec, CUgraphNode node, const CUDA_MEMCPY3D* params, CUcontext) {
    if (!params) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    GraphNode* n;
    CUresult err = exec_node(exec, node, NodeKind::memcpy, &n);
    if (err == CUDA_SUCCESS) n->copy = *params;
    return err;
}

PHOS_EXPORT CUresult cuGraphMemsetNodeGetParams(CUgraphNode node, CUDA_MEMSET_NODE_PARAMS* params) {
    if (!params) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    GraphNode* n;
    CUresult err = node_of_kind(node, NodeKind::memset, &n);
    if (err == CUDA_SUCCESS) *params = n->fill;
    return err;
}

PHOS_EXPORT CUresult cuGraphMemsetNodeSetParams(CUgraphNode node, const CUDA_MEMSET_NODE_PARAMS* params) {
    Guard g(state().lock);
    GraphNode* n;
    CUresult err = node_of_kind(node, NodeKind::memset, &n);
    if (err == CUDA_SUCCESS) err = memset_node(params);
    if (err == CUDA_SUCCESS) n->fill = *params;
    return err;
}

PHOS_EXPORT CUresult cuGraphExecMemsetNodeSetParams(CUgraphExec exec, CUgraphNode node, const CUDA_MEMSET_NODE_PARAMS* params, CUcontext) {
    Guard g(state().lock);
    GraphNode* n;
    CUresult err = exec_node(exec, node, NodeKind::memset, &n);
    if (err == CUDA_SUCCESS) err = memset_node(params);
    if (err == CUDA_SUCCESS) n->fill = *params;
    return err;
}

PHOS_EXPORT CUresult cuGraphHostNodeGetParams(CUgraphNode node, CUDA_HOST_NODE_PARAMS* params) {
    if (!params) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    GraphNode* n;
    CUresult err = node_of_kind(node, NodeKind::host, &n);
    if (err == CUDA_SUCCESS) *params = CUDA_HOST_NODE_PARAMS{n->host, n->data};
    return err;
}

PHOS_EXPORT CUresult cuGraphHostNodeSetParams(CUgraphNode node, const CUDA_HOST_NODE_PARAMS* params) {
    if (!params || !params->fn) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    GraphNode* n;
    CUresult err = node_of_kind(node, NodeKind::host, &n);
    if (err == CUDA_SUCCESS) n->host = params->fn, n->data = params->userData;
    return err;
}

PHOS_EXPORT CUresult cuGraphExecHostNodeSetParams(CUgraphExec exec, CUgraphNode node, const CUDA_HOST_NODE_PARAMS* params) {
    if (!params || !params->fn) return CUDA_ERROR_INVALID_VALUE;
    Guard g(state().lock);
    GraphNode* n;
    CUresult err = exec_node(exec, node, NodeKind::host, &n);
    if (err == CUDA_SUCCESS) n->host = params->fn, n->data = params->userData;
    return err;
}

// An instantiated graph takes the parameters of a graph of the same shape (PyTorch and the
// samples update this way): the same nodes, of the same kinds, with the same dependencies.
PHOS_EXPORT CUresult cuGraphExecUpdate_v2(CUgraphExec exec, CUgraph graph, CUgraphExecUpdateResultInfo* info) {
    Guard g(state().lock);
    if (!is_handle(exec, HandleKind::graph_exec) || check_graph(graph) != CUDA_SUCCESS) return CUDA_ERROR_INVALID_VALUE;
    if (info) *info = CUgraphExecUpdateResultInfo{};
    const auto& now = exec->graph->nodes;
    bool same = now.size() == graph->nodes.size();
    for (size_t i = 0; same && i < now.size(); i++)
        same = now[i].kind == graph->nodes[i].kind && now[i].removed == graph->nodes[i].removed &&
               now[i].deps == graph->nodes[i].deps;
    if (!same) {
        if (info) info->result = CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED;
        return CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE;
    }
    CUgraph_st* copy = clone_graph(graph);
    state().handles.erase(copy);
    delete_graph(exec->graph);
    exec->graph = copy;
    if (info) info->result = CU_GRAPH_EXEC_UPDATE_SUCCESS;
    return CUDA_SUCCESS;
}
