// A graph built node by node (cudaGraphCreate, cudaGraphAdd*Node), not captured: a copy in
// from pageable memory and a memset at the roots, two kernels after the copy, a third after
// both and the memset, a copy out added with cudaGraphAddDependencies, a host node that checks
// the result in this process, a child graph and an event record at the end. Launched three
// times with new input each time (a copy node reads host memory when it runs), then with a
// kernel's parameters changed on the instantiated graph, then as a clone; and a captured graph
// whose host copies read and write host memory each time it runs. Prints one line per check,
// then PASS.
#include <cstring>
#include <vector>
#include "common.h"

__global__ void scale(float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a;
}

__global__ void shift(float* x, float b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += b;
}

__global__ void combine(const float* x, const int* z, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] + x[n - 1 - i] + (float)z[i];
}

static const int n = 2048, half = n / 2, threads = 128;

struct Check {                       // what the host node sees, launch after launch
    const float* in;
    const float* out;
    float a, b;
    int runs = 0, wrong = 0;
};

static float x_after(const Check& c, int i) { return i < half ? c.in[i] * c.a : c.in[i] + c.b; }

static void CUDART_CB check_result(void* p) {
    Check* c = static_cast<Check*>(p);
    for (int i = 0; i < n; i++)
        c->wrong += c->out[i] != x_after(*c, i) + x_after(*c, n - 1 - i) + 7.0f;
    c->runs++;
}

int main() {
    std::vector<float> in(n), out(n);
    float *x, *y;
    int* z;
    CHECK(cudaMalloc(&x, n * sizeof(float)));
    CHECK(cudaMalloc(&y, n * sizeof(float)));
    CHECK(cudaMalloc(&z, n * sizeof(int)));
    Check check{in.data(), out.data(), 2.0f, 1.0f};

    cudaGraph_t graph, child;
    CHECK(cudaGraphCreate(&graph, 0));

    cudaGraphNode_t copy_in, fill, k_scale, k_shift, k_combine, copy_out, host, child_node, record;
    cudaMemcpy3DParms in_params = {};
    in_params.srcPtr = make_cudaPitchedPtr(in.data(), n * sizeof(float), n, 1);
    in_params.dstPtr = make_cudaPitchedPtr(x, n * sizeof(float), n, 1);
    in_params.extent = make_cudaExtent(n * sizeof(float), 1, 1);
    in_params.kind = cudaMemcpyHostToDevice;
    CHECK(cudaGraphAddMemcpyNode(&copy_in, graph, nullptr, 0, &in_params));

    cudaMemsetParams fill_params = {};
    fill_params.dst = z;
    fill_params.value = 7;
    fill_params.elementSize = sizeof(int);
    fill_params.width = n;
    fill_params.height = 1;
    CHECK(cudaGraphAddMemsetNode(&fill, graph, nullptr, 0, &fill_params));

    int count = half;
    float* second = x + half;
    void* scale_args[] = {&x, &check.a, &count};
    void* shift_args[] = {&second, &check.b, &count};
    cudaKernelNodeParams kp = {};
    kp.func = (void*)scale;
    kp.gridDim = dim3(half / threads);
    kp.blockDim = dim3(threads);
    kp.kernelParams = scale_args;
    CHECK(cudaGraphAddKernelNode(&k_scale, graph, &copy_in, 1, &kp));
    kp.func = (void*)shift;
    kp.kernelParams = shift_args;
    CHECK(cudaGraphAddKernelNode(&k_shift, graph, &copy_in, 1, &kp));

    int total = n;
    void* combine_args[] = {&x, &z, &y, &total};
    cudaGraphNode_t before_combine[] = {k_scale, k_shift, fill};
    kp.func = (void*)combine;
    kp.gridDim = dim3(n / threads);
    kp.kernelParams = combine_args;
    CHECK(cudaGraphAddKernelNode(&k_combine, graph, before_combine, 3, &kp));

    // The parameters are copied when the node is made: changing them here changes nothing.
    check.a = 100.0f;
    count = 0;

    cudaMemcpy3DParms out_params = {};
    out_params.srcPtr = make_cudaPitchedPtr(y, n * sizeof(float), n, 1);
    out_params.dstPtr = make_cudaPitchedPtr(out.data(), n * sizeof(float), n, 1);
    out_params.extent = make_cudaExtent(n * sizeof(float), 1, 1);
    out_params.kind = cudaMemcpyDeviceToHost;
    CHECK(cudaGraphAddMemcpyNode(&copy_out, graph, nullptr, 0, &out_params));
    CHECK(cudaGraphAddDependencies(graph, &k_combine, &copy_out, nullptr, 1));

    cudaHostNodeParams hp = {check_result, &check};
    CHECK(cudaGraphAddHostNode(&host, graph, &copy_out, 1, &hp));

    // A child graph: a memset of y after the host node has read it (runs, not checked here).
    CHECK(cudaGraphCreate(&child, 0));
    cudaGraphNode_t child_fill;
    fill_params.dst = y;
    fill_params.value = 0;
    CHECK(cudaGraphAddMemsetNode(&child_fill, child, nullptr, 0, &fill_params));
    CHECK(cudaGraphAddChildGraphNode(&child_node, graph, &host, 1, child));
    cudaEvent_t done;
    CHECK(cudaEventCreate(&done));
    CHECK(cudaGraphAddEventRecordNode(&record, graph, &child_node, 1, done));

    size_t nodes = 0, roots = 0, deps = 0;
    CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
    CHECK(cudaGraphGetRootNodes(graph, nullptr, &roots));
    CHECK(cudaGraphNodeGetDependencies(k_combine, nullptr, nullptr, &deps));
    printf("graph: nodes=%zu roots=%zu combine deps=%zu\n", nodes, roots, deps);
    int wrong = (nodes != 9) + (roots != 2) + (deps != 3);

    check.a = 2.0f;
    cudaGraphExec_t exec;
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    for (int run = 0; run < 3; run++) {
        for (int i = 0; i < n; i++) in[i] = (float)(i % 97) + run;
        CHECK(cudaGraphLaunch(exec, s));
        CHECK(cudaStreamSynchronize(s));
    }
    CHECK(cudaEventSynchronize(done));
    printf("launches: runs=%d wrong=%d\n", check.runs, check.wrong);
    wrong += (check.runs != 3) + (check.wrong != 0);

    // New parameters for one kernel of the instantiated graph.
    check.a = 3.0f;
    kp.func = (void*)scale;
    kp.gridDim = dim3(half / threads);
    count = half;
    kp.kernelParams = scale_args;
    CHECK(cudaGraphExecKernelNodeSetParams(exec, k_scale, &kp));
    CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaStreamSynchronize(s));
    printf("exec set params: runs=%d wrong=%d\n", check.runs, check.wrong);
    wrong += (check.runs != 4) + (check.wrong != 0);

    // A clone runs as the original was made (scale by 2).
    cudaGraph_t clone;
    cudaGraphExec_t clone_exec;
    CHECK(cudaGraphClone(&clone, graph));
    CHECK(cudaGraphInstantiate(&clone_exec, clone, 0));
    check.a = 2.0f;
    CHECK(cudaGraphLaunch(clone_exec, s));
    CHECK(cudaStreamSynchronize(s));
    printf("clone: runs=%d wrong=%d\n", check.runs, check.wrong);
    wrong += (check.runs != 5) + (check.wrong != 0);

    // The child's memset ran last: y is zero.
    std::vector<float> after(n, 1.0f);
    CHECK(cudaMemcpy(after.data(), y, n * sizeof(float), cudaMemcpyDeviceToHost));
    int nonzero = 0, bad;
    for (float v : after) nonzero += v != 0.0f;
    printf("child graph: nonzero=%d\n", nonzero);
    wrong += nonzero != 0;

    // A captured graph's host copies read and write host memory each time it runs.
    cudaGraph_t captured;
    cudaGraphExec_t captured_exec;
    std::vector<float> cin(n), cout(n);
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CHECK(cudaMemcpyAsync(x, cin.data(), n * sizeof(float), cudaMemcpyHostToDevice, s));
    shift<<<n / threads, threads, 0, s>>>(x, 0.5f, n);
    CHECK(cudaMemcpyAsync(cout.data(), x, n * sizeof(float), cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamEndCapture(s, &captured));
    CHECK(cudaGraphInstantiate(&captured_exec, captured, 0));
    bad = 0;
    for (int run = 0; run < 2; run++) {
        for (int i = 0; i < n; i++) cin[i] = (float)(i * (run + 1));
        CHECK(cudaGraphLaunch(captured_exec, s));
        CHECK(cudaStreamSynchronize(s));
        for (int i = 0; i < n; i++) bad += cout[i] != cin[i] + 0.5f;
    }
    printf("captured host copies: wrong=%d\n", bad);
    wrong += bad;
    CHECK(cudaGraphExecDestroy(captured_exec));
    CHECK(cudaGraphDestroy(captured));

    CHECK(cudaGraphExecDestroy(clone_exec));
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(clone));
    CHECK(cudaGraphDestroy(child));
    CHECK(cudaGraphDestroy(graph));
    printf("wrong=%d\n", wrong);
    printf(wrong ? "FAIL\n" : "PASS\n");
    return wrong ? 1 : 0;
}
