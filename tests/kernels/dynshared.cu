// A kernel whose dynamic shared memory the launch sizes: it reverses each block's slice of x
// through it, so more than 48 KiB needs the kernel's opt-in (cuFuncSetAttribute).
extern "C" __global__ void reverse_blocks(float* x, int per_block) {
    extern __shared__ float tile[];
    float* mine = x + blockIdx.x * per_block;
    for (int i = threadIdx.x; i < per_block; i += blockDim.x) tile[i] = mine[i];
    __syncthreads();
    for (int i = threadIdx.x; i < per_block; i += blockDim.x) mine[i] = tile[per_block - 1 - i];
}
