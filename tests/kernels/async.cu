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
