#include <cuda_pipeline.h>
// sm_80+ asynchronous global->shared copies (cp.async), staged through shared memory.
extern "C" __global__ void async_copy(const float4 *in, float *out, int n4) {
    __shared__ float4 buf[128];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n4) __pipeline_memcpy_async(&buf[threadIdx.x], &in[i], sizeof(float4));
    __pipeline_commit();
    __pipeline_wait_prior(0);
    __syncthreads();
    if (i < n4) {
        float4 v = buf[blockDim.x - 1 - threadIdx.x];
        out[i] = v.x + 2 * v.y + 3 * v.z + 4 * v.w;
    }
}

// cuda::barrier with cuda::memcpy_async (mbarrier.init/arrive/try_wait, cp.async.mbarrier.arrive)
#include <cuda/barrier>
#include <cooperative_groups.h>
#include <cooperative_groups/memcpy_async.h>
namespace cg = cooperative_groups;

extern "C" __global__ void barrier_copy(const float *in, float *out, int rounds) {
    __shared__ float tile[256];
#pragma nv_diag_suppress static_var_with_dynamic_init
    __shared__ cuda::barrier<cuda::thread_scope_block> bar;
    auto block = cg::this_thread_block();
    if (block.thread_rank() == 0) init(&bar, block.size());
    block.sync();
    int t = threadIdx.x;
    float acc = 0.0f;
    for (int r = 0; r < rounds; r++) {          // the barrier's phases in turn
        int base = ((blockIdx.x + r) % gridDim.x) * blockDim.x;
        cuda::memcpy_async(block, tile, in + base, sizeof(float) * blockDim.x, bar);
        bar.arrive_and_wait();
        acc += tile[(t + 1) % blockDim.x] * (r + 1);
        bar.arrive_and_wait();                  // all read the tile before the next copy
    }
    out[blockIdx.x * blockDim.x + t] = acc;
}

// cooperative groups' memcpy_async and wait (cp.async groups)
extern "C" __global__ void group_copy(const float *in, float *out) {
    __shared__ float tile[256];
    auto block = cg::this_thread_block();
    int base = blockIdx.x * blockDim.x;
    cg::memcpy_async(block, tile, in + base, sizeof(float) * blockDim.x);
    cg::wait(block);
    out[base + threadIdx.x] = tile[blockDim.x - 1 - threadIdx.x] + 1.0f;
}

// cooperative groups' grid.sync() (a cooperative launch: %envreg1:%envreg2 name its counter)
extern "C" __global__ void grid_rounds(int *partial, int *out, int rounds) {
    cg::grid_group grid = cg::this_grid();
    for (int r = 0; r < rounds; r++) {
        if (threadIdx.x == 0) partial[blockIdx.x] = blockIdx.x * 10 + r;
        grid.sync();                            // every block's value of this round is there
        if (grid.thread_rank() == 0) {
            int s = 0;
            for (int b = 0; b < gridDim.x; b++) s += partial[b];
            out[r] = s;
        }
        grid.sync();                            // read before the next round writes
    }
}
