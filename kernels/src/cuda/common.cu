// Kiln's CUDA kernels, compiled at run time by NVRTC. Every kernel has a CPU
// reference in kiln-kernels; the parity tests hold them to it.
//
// This file comes first in `SOURCE` (source.rs): the includes, macros and
// device helpers the other files use. Each file after it uses only what
// the files before it define.
//
// Layouts follow the CPU side: activations are row-major f32; weights are
// row-major bf16 [out][in]; KV element (page, slot, head, d) lives at
// ((page * kv_heads + head) * page_size + slot) * head_dim + d, with one f32
// scale per (page, slot, head) vector in the fp8 format (e4m3(x / s),
// s = amax / 448).

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#define FP8_MAX 448.0f

// Programmatic dependent launch (sm_90 and up; see graph.rs): every kernel
// opens with PDL_ENTER (or PDL_LAUNCH, loads that need no earlier result,
// then PDL_WAIT): it lets the next kernel of a captured step start its
// blocks, then waits until the kernels before it have finished and their
// writes are visible, before it reads or writes anything they touch.
// Outside a programmatic edge both are no-ops.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_LAUNCH() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define PDL_LAUNCH()
#define PDL_WAIT()
#endif
#define PDL_ENTER() \
    do {            \
        PDL_LAUNCH(); \
        PDL_WAIT();   \
    } while (0)

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

// Sum (or, with MAX, maximum) over the block (blockDim.x a multiple of 32,
// at most 1024); every thread gets it.
template <bool MAX>
__device__ float block_reduce(float v, float* shared32) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = MAX ? warp_max(v) : warp_sum(v);
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    int warps = blockDim.x >> 5;
    float none = MAX ? -INFINITY : 0.0f;
    v = (threadIdx.x < warps) ? shared32[threadIdx.x] : none;
    if (warp == 0) v = MAX ? warp_max(v) : warp_sum(v);
    if (threadIdx.x == 0) shared32[0] = v;
    __syncthreads();
    return shared32[0];
}

__device__ float block_sum(float v, float* shared32) { return block_reduce<false>(v, shared32); }

__device__ float block_max(float v, float* shared32) { return block_reduce<true>(v, shared32); }

// The vector index of (page, slot in page, head): a head's vectors of one
// page lie together.
__device__ __forceinline__ size_t kv_vec(size_t page, int slot, int head, int kv_heads,
                                         int page_size) {
    return (page * kv_heads + head) * page_size + slot;
}
