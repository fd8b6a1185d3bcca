// Host shim for CUDA kernel sources: lets g++ compile a .cu file's kernels as ordinary C++
// functions so tests can run them over NumPy buffers (see cuda_host.py for the contract).
#pragma once
#include <cstdint>
#if __has_include(<cuda_fp16.h>)
#include <cuda_fp16.h>
#endif

#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __restrict__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict

struct fleetmpi_host_dim3 { unsigned int x, y, z; };

extern "C" {
fleetmpi_host_dim3 gridDim = {1, 1, 1};
fleetmpi_host_dim3 blockDim = {1, 1, 1};
fleetmpi_host_dim3 blockIdx = {0, 0, 0};
fleetmpi_host_dim3 threadIdx = {0, 0, 0};

// One simulated thread: the launcher calls this, then the kernel, for every (block, thread).
void fleetmpi_host_set_thread(unsigned int grid, unsigned int block, unsigned int block_index,
                              unsigned int thread_index) {
    gridDim.x = grid;
    blockDim.x = block;
    blockIdx.x = block_index;
    threadIdx.x = thread_index;
}
}
