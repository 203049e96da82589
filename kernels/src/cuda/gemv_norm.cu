// One-row decode GEMVs with the RMSNorm between them folded in (appended
// after gemv.cu). For a norm with weights g over a hidden row h of K,
//   (rmsnorm(h) * g) . w = ((g * h) . w) / sqrt(mean(h^2) + eps),
// so no norm kernel runs between two products of a decode step:
// - the product that adds into h (the o and down projections; `resid`)
//   also writes gh = g * h for the next norm's g and the sum of h^2,
// - the products after the norm (q/k/v, gate/up, the head; `normed`) read
//   gh as their input and scale each sum by the norm's factor.
// The sum of squares is reduced in a fixed order (each block's rows, then
// the blocks' sums by whichever block finishes last), so it is the same
// on every run; the last block also resets the count for the next launch.

#define FOLD_WARPS 4

// The norm's factor for a sum of squares ss over K elements, as
// rmsnorm_residual computes it.
__device__ __forceinline__ float norm_factor(float ss, int K, float eps) {
    return rsqrtf(ss / K + eps);
}

// h[row] += x . w[row] for the n rows of w; gh[row] = g[row] * h[row];
// ss[0] = sum over rows of h[row]^2. partials holds a float per block and
// done counts the blocks that wrote theirs (zero before the launch, zero
// after it). One warp per row, FOLD_WARPS rows per block.
extern "C" __global__ void __launch_bounds__(32 * FOLD_WARPS)
    gemv_bf16_resid(const float* x, const __nv_bfloat16* __restrict__ w, float* h,
                    const float* g, float* gh, float* partials, float* ss, unsigned* done,
                    int n, int K) {
    PDL_LAUNCH();
    __shared__ float sq[FOLD_WARPS];
    __shared__ float red[32];
    __shared__ bool last;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int row = blockIdx.x * FOLD_WARPS + warp;
    float s = 0.0f;
    if (row < n) {
        const uint4* wr[1] = {bf16_row(w, row, K)};
        float acc[1][1];
        gemv_bf16_acc<1, 4, 1>(x, wr, K, acc);
        float v = warp_sum(acc[0][0]);
        if (lane == 0) {
            float hn = h[row] + v;
            h[row] = hn;
            gh[row] = g[row] * hn;
            s = hn * hn;
        }
    } else {
        PDL_WAIT();
    }
    if (lane == 0) sq[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        float p = 0.0f;
#pragma unroll
        for (int i = 0; i < FOLD_WARPS; i++) p += sq[i];
        partials[blockIdx.x] = p;
        // The partial is visible to every block before the count says so.
        __threadfence();
        last = atomicAdd(done, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    float t = 0.0f;
    // Past L1: other blocks wrote these.
    for (int i = threadIdx.x; i < (int)gridDim.x; i += blockDim.x) t += __ldcg(partials + i);
    t = block_sum(t, red);
    if (threadIdx.x == 0) {
        *ss = t;
        *done = 0;
    }
}

// out = (gh . w[row]) * norm_factor(ss[0]) for each row of the stack,
// rows going to the parts of o as in gemv.cu.
extern "C" __global__ void __launch_bounds__(32 * FOLD_WARPS)
    gemv_bf16_normed(const float* gh, const __nv_bfloat16* __restrict__ w, const float* ss,
                     float* o0, float* o1, float* o2, int n0, int n1, int n, int K, float eps) {
    PDL_LAUNCH();
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int row = blockIdx.x * FOLD_WARPS + warp;
    if (row >= n) {
        PDL_WAIT();
        return;
    }
    const uint4* wr[1] = {bf16_row(w, row, K)};
    float acc[1][1];
    gemv_bf16_acc<1, 4, 1>(gh, wr, K, acc);
    float v = warp_sum(acc[0][0]);
    if (lane == 0) put_out(Outs{o0, o1, o2, n0, n1, n}, 0, row, v * norm_factor(*ss, K, eps));
}

// The gate/up stack (gate rows 0..f, up rows f..2f) after the norm, with
// SiLU-and-multiply: out[row] = silu(gate) * up of the normed products. One
// warp streams gate row `row` and up row `row` together.
extern "C" __global__ void __launch_bounds__(32 * FOLD_WARPS)
    gemv_bf16_normed_silu(const float* gh, const __nv_bfloat16* __restrict__ w,
                          const float* ss, float* out, int f, int K, float eps) {
    PDL_LAUNCH();
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int row = blockIdx.x * FOLD_WARPS + warp;
    if (row >= f) {
        PDL_WAIT();
        return;
    }
    const uint4* wr[2] = {bf16_row(w, row, K), bf16_row(w, row + f, K)};
    float acc[2][1];
    gemv_bf16_acc<1, 4, 2>(gh, wr, K, acc);
    float gate = warp_sum(acc[0][0]), up = warp_sum(acc[1][0]);
    if (lane == 0) {
        float s = norm_factor(*ss, K, eps);
        out[row] = silu_times(gate * s, up * s);
    }
}
