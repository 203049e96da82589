// One-row decode GEMVs with the RMSNorm between them folded in (see
// fold.rs; uses gemv.cu, norm.cu and act.cu). For a norm with weights g over a hidden row h of K,
//   (rmsnorm(h) * g) . w = ((g * h) . w) / sqrt(mean(h^2) + eps),
// so no norm kernel runs between two products of a decode step:
// - the product that adds into h (the o and down projections; `resid`)
//   also writes gh = g * h for the next norm's g, and each block the sum
//   of its rows' h^2,
// - the products after the norm (q/k/v, gate/up, the head; `normed`) read
//   gh as their input; each block sums those partial sums (loaded after
//   the wait, while its weights stream) and scales its rows by the norm's
//   factor. The sums run in a fixed order, so every run gives the same
//   bits, and no block waits for another's.
//
// Blocks are sized so Llama-3-8B's products run in whole waves on an H200
// (132 SMs): at most 40 registers, so 12 blocks of 4 warps share an SM and
// the q/k/v stack (1536 blocks) runs in one wave of 1584 (at 44 registers,
// 11 a SM would leave 84 blocks for a second); the residual products' 512
// blocks of 8 warps in one wave of 5 a SM.

#define RESID_WARPS 8
#define NORMED_WARPS 4

// h[row] += x . w[row] for the n rows of w; gh[row] = g[row] * h[row];
// partials[block] = the sum of its rows' h[row]^2. One warp per row.
__device__ void gemv_resid(const float* x, const __nv_bfloat16* __restrict__ w, float* h,
                           const float* g, float* gh, float* partials, int n, int K) {
    __shared__ float sq[RESID_WARPS];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int row = blockIdx.x * RESID_WARPS + warp;
    float s = 0.0f;
    if (row < n) {
        float acc[1];
        gemv_bf16_acc<1, 4>(x, bf16_row(w, row, K), K, acc);
        float v = warp_sum(acc[0]);
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
        for (int i = 0; i < RESID_WARPS; i++) p += sq[i];
        partials[blockIdx.x] = p;
    }
}

// Loads this thread's share of the resid launch's `parts` partial sums
// (after the wait: the kernel before wrote them).
struct PartialLoad {
    const float* partials;
    int parts;
    float t;
    __device__ __forceinline__ void operator()() {
        float v = 0.0f;
        for (int i = 4 * threadIdx.x; i < parts; i += 4 * blockDim.x) {
            float4 p = *(const float4*)(partials + i);
            v += p.x + (i + 1 < parts ? p.y : 0.0f) + (i + 2 < parts ? p.z : 0.0f) +
                 (i + 3 < parts ? p.w : 0.0f);
        }
        t = v;
    }
};

// out = (gh . w[row]) * the norm's factor, for each row of the stack
// (rows going to the parts of o as in gemv.cu). One warp per row.
__device__ void gemv_normed(const float* gh, const __nv_bfloat16* __restrict__ w,
                            const float* partials, int parts, Outs o, int K, float eps) {
    __shared__ float red[32];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int row = blockIdx.x * NORMED_WARPS + warp;
    PartialLoad load{partials, parts, 0.0f};
    float acc[1];
    bool active = row < o.n;
    if (active) {
        gemv_bf16_acc<1, 4>(gh, bf16_row(w, row, K), K, acc, load);
    } else {
        PDL_WAIT();
        load();
    }
    float f = norm_factor(block_sum(load.t, red), K, eps);
    if (active) {
        float v = warp_sum(acc[0]) * f;
        if (lane == 0) put_out(o, 0, row, v);
    }
}

// The gate/up stack (gate rows 0..f over up rows f..2f) after the norm,
// with SiLU-and-multiply: out[row] = silu(gate) * up of the normed
// products. A block takes NORMED_WARPS / 2 rows: its first warps their
// gate rows, the others their up rows, one weight row a warp as in the
// plain GEMV; the up sums meet the gate sums in shared memory.
__device__ void gemv_normed_silu(const float* gh, const __nv_bfloat16* __restrict__ w,
                                 const float* partials, int parts, float* out, int f, int K,
                                 float eps) {
    constexpr int PAIRS = NORMED_WARPS / 2;
    __shared__ float red[32];
    __shared__ float ups[PAIRS];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    bool up = warp >= PAIRS;
    int row = blockIdx.x * PAIRS + warp % PAIRS;
    PartialLoad load{partials, parts, 0.0f};
    float acc[1];
    bool active = row < f;
    if (active) {
        gemv_bf16_acc<1, 4>(gh, bf16_row(w, up ? row + f : row, K), K, acc, load);
    } else {
        PDL_WAIT();
        load();
    }
    float v = active ? warp_sum(acc[0]) : 0.0f;
    if (up && lane == 0) ups[warp - PAIRS] = v;
    // block_sum's barriers also publish ups.
    float s = norm_factor(block_sum(load.t, red), K, eps);
    if (active && !up && lane == 0) out[row] = silu_times(v * s, ups[warp] * s);
}

extern "C" __global__ void __launch_bounds__(32 * RESID_WARPS, 5)
    gemv_bf16_resid(const float* x, const __nv_bfloat16* __restrict__ w, float* h,
                    const float* g, float* gh, float* partials, int n, int K) {
    PDL_LAUNCH();
    gemv_resid(x, w, h, g, gh, partials, n, K);
}

extern "C" __global__ void __launch_bounds__(32 * NORMED_WARPS, 12)
    gemv_bf16_normed(const float* gh, const __nv_bfloat16* __restrict__ w,
                     const float* partials, int parts, float* o0, float* o1, float* o2, int n0,
                     int n1, int n, int K, float eps) {
    PDL_LAUNCH();
    gemv_normed(gh, w, partials, parts, Outs{o0, o1, o2, n0, n1, n}, K, eps);
}

extern "C" __global__ void __launch_bounds__(32 * NORMED_WARPS, 12)
    gemv_bf16_normed_silu(const float* gh, const __nv_bfloat16* __restrict__ w,
                          const float* partials, int parts, float* out, int f, int K, float eps) {
    PDL_LAUNCH();
    gemv_normed_silu(gh, w, partials, parts, out, f, K, eps);
}
