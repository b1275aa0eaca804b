// What NVIDIA's runtime and the libraries built on it ask of the driver beyond plain
// launches: device properties, kernel attributes, occupancy, cooperative launches, driver
// entry points by version, capture status, pointer attributes, stream-ordered allocation,
// graphs captured from a stream, host functions, and profiler marks. Prints one line per feature, then PASS.
#include <cuda.h>
#include <cuda_profiler_api.h>
#include <vector>
#include "common.h"

__global__ void scale(float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a;
}

__global__ void add(float* x, float b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += b;
}

static const int n = 4096, threads = 256, blocks = n / threads;

static int count_not(const float* d, float want) {
    std::vector<float> h(n);
    CHECK(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
    int wrong = 0;
    for (float v : h) wrong += v != want;
    return wrong;
}

static void CUDART_CB host_step(void* data) { *static_cast<int*>(data) += 1; }

int main() {
    int wrong = 0;
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("properties: sm_%d%d, %d threads a block\n", prop.major, prop.minor, prop.maxThreadsPerBlock);

    cudaFuncAttributes attr;
    CHECK(cudaFuncGetAttributes(&attr, scale));
    printf("attributes: registers>0=%d max threads>0=%d\n", attr.numRegs > 0, attr.maxThreadsPerBlock > 0);
    wrong += attr.numRegs <= 0 || attr.maxThreadsPerBlock <= 0;

    int per_sm = 0, min_grid = 0, best_block = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, scale, threads, 0));
    CHECK(cudaOccupancyMaxPotentialBlockSize(&min_grid, &best_block, scale, 0, 0));
    printf("occupancy: blocks per SM>0=%d block size>0=%d\n", per_sm > 0, best_block > 0);
    wrong += per_sm <= 0 || best_block <= 0 || min_grid <= 0;

    float* x;
    CHECK(cudaMalloc(&x, n * sizeof(float)));
    CHECK(cudaMemset(x, 0, n * sizeof(float)));
    float b = 1.0f;
    int count = n;
    void* add_args[] = {&x, &b, &count};
    CHECK(cudaLaunchCooperativeKernel((void*)add, blocks, threads, add_args, 0, 0));
    int bad = count_not(x, 1.0f);
    printf("cooperative: wrong=%d\n", bad);
    wrong += bad;

    // The driver through the runtime's entry-point lookup (cuGetProcAddress).
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    CHECK(cudaGetDriverEntryPointByVersion("cuMemsetD32", &fn, 12000, cudaEnableDefault, &found));
    int ok = found == cudaDriverEntryPointSuccess && fn &&
             reinterpret_cast<CUresult (*)(CUdeviceptr, unsigned, size_t)>(fn)((CUdeviceptr)x, 0x40000000u, n) == CUDA_SUCCESS;
    bad = count_not(x, 2.0f);   // 0x40000000 is 2.0f
    printf("entry point: found=%d wrong=%d\n", ok, bad);
    wrong += !ok + bad;

    cudaStreamCaptureStatus capture;
    CHECK(cudaStreamIsCapturing(0, &capture));
    printf("capturing: %d\n", (int)capture);
    wrong += capture != cudaStreamCaptureStatusNone;

    cudaPointerAttributes pa;
    CHECK(cudaPointerGetAttributes(&pa, x));
    float* pinned;
    CHECK(cudaMallocHost(&pinned, 64));
    cudaPointerAttributes ph;
    CHECK(cudaPointerGetAttributes(&ph, pinned));
    printf("pointers: device=%d host=%d\n", pa.type == cudaMemoryTypeDevice, ph.type == cudaMemoryTypeHost);
    wrong += pa.type != cudaMemoryTypeDevice || ph.type != cudaMemoryTypeHost;

    // Stream-ordered allocation, from the device's default pool.
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    float* y;
    CHECK(cudaMallocAsync(&y, n * sizeof(float), s));
    CHECK(cudaMemsetAsync(y, 0, n * sizeof(float), s));
    CHECK(cudaStreamSynchronize(s));
    bad = count_not(y, 0.0f);
    cudaMemPool_t pool;
    CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
    unsigned long long used = 0;
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used));
    CHECK(cudaFreeAsync(y, s));
    printf("stream-ordered allocation: wrong=%d in use>0=%d\n", bad, used > 0);
    wrong += bad + (used == 0);

    // A graph captured from a stream, replayed three times: x = (x * 2 + 1) each time, and a
    // host function counting the replays in stream order.
    int replays = 0;
    CHECK(cudaMemcpy(x, std::vector<float>(n, 1.0f).data(), n * sizeof(float), cudaMemcpyHostToDevice));
    cudaGraph_t graph;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    CHECK(cudaStreamIsCapturing(s, &capture));
    scale<<<blocks, threads, 0, s>>>(x, 2.0f, n);
    add<<<blocks, threads, 0, s>>>(x, 1.0f, n);
    CHECK(cudaLaunchHostFunc(s, host_step, &replays));
    CHECK(cudaStreamEndCapture(s, &graph));
    // Its nodes, as PyTorch inspects a captured graph: two kernels, then the host function.
    size_t nodes = 0;
    CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
    std::vector<cudaGraphNode_t> node(nodes > 0 ? nodes : 1);
    CHECK(cudaGraphGetNodes(graph, node.data(), &nodes));
    cudaGraphNodeType first = cudaGraphNodeTypeEmpty, last = cudaGraphNodeTypeEmpty;
    if (nodes) {
        CHECK(cudaGraphNodeGetType(node[0], &first));
        CHECK(cudaGraphNodeGetType(node[nodes - 1], &last));
    }
    int node_types_wrong = nodes != 3 || first != cudaGraphNodeTypeKernel || last != cudaGraphNodeTypeHost;
    cudaGraphExec_t exec;
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 3; i++) CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaStreamSynchronize(s));
    bad = count_not(x, 15.0f);   // 1 -> 3 -> 7 -> 15
    printf("graph: capturing=%d wrong=%d replays=%d nodes=%zu\n", (int)capture, bad, replays, nodes);
    wrong += bad + (capture != cudaStreamCaptureStatusActive) + (replays != 3) + node_types_wrong;
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));

    // A host function outside a capture runs after the work before it.
    int seen = 0;
    CHECK(cudaLaunchHostFunc(s, host_step, &seen));
    CHECK(cudaStreamSynchronize(s));
    printf("host function: ran=%d\n", seen);
    wrong += seen != 1;

    // Profiler marks around a region succeed without a profiler (profiling is the server's).
    cudaError_t start = cudaProfilerStart(), stop = cudaProfilerStop();
    printf("profiler: start=%d stop=%d\n", (int)start, (int)stop);
    wrong += start != cudaSuccess || stop != cudaSuccess;

    printf("wrong=%d\n", wrong);
    printf(wrong ? "FAIL\n" : "PASS\n");
    return wrong ? 1 : 0;
}
