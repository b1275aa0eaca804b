// Shared by the test programs: fail loudly on any CUDA error.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CHECK(call)                                                                              \
    do {                                                                                         \
        cudaError_t err_ = (call);                                                               \
        if (err_ != cudaSuccess) {                                                               \
            printf("FAIL %s:%d: %s -> %s (%s)\n", __FILE__, __LINE__, #call, cudaGetErrorName(err_), \
                   cudaGetErrorString(err_));                                                    \
            exit(1);                                                                             \
        }                                                                                        \
    } while (0)
