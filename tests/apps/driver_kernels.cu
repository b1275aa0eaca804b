// Kernels for driver_api.cu, compiled to PTX (nvcc -ptx) and loaded with cuModuleLoad.
struct Affine {
    float scale;
    double shift;
    int pad[3];
};

__device__ int launches;

extern "C" __global__ void affine(float* x, int n, Affine a, char tag) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * a.scale + (float)a.shift + (tag == 'z' ? 0.0f : 1000.0f);
    if (i == 0) atomicAdd(&launches, 1);
}
