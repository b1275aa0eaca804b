// y = a*x + y, compiled to PTX by examples/saxpy.py and run on whatever device phos serves.
extern "C" __global__ void saxpy(float a, const float *x, float *y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
