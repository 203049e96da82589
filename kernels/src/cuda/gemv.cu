// Decode GEMVs (see gemv.rs).
//
// A stacked weight is several matrices of the same input width one under
// the other (q, k and v; gate and up), so one launch streams them all and
// the small ones ride along with the big. Row n of the stack goes to output
// part 0 while n < n0, to part 1 while n < n0 + n1, else to part 2; each
// part is a row-major [M][rows of that part] matrix of its own.
struct Outs {
    float* o0;
    float* o1;
    float* o2;
    int n0, n1, n;
};

__device__ __forceinline__ void put_out(const Outs& o, int m, int row, float v) {
    if (row < o.n0) {
        o.o0[(size_t)m * o.n0 + row] = v;
    } else if (row < o.n0 + o.n1) {
        o.o1[(size_t)m * o.n1 + row - o.n0] = v;
    } else {
        int n2 = o.n - o.n0 - o.n1;
        o.o2[(size_t)m * n2 + row - o.n0 - o.n1] = v;
    }
}

// Strips of 16 weight rows a block of the tensor-core GEMMs (int4.cu,
// skinny.cu) for NB blocks of 8 activation rows: one up to 16 rows, two
// from 17 (gemv.rs's `row_blocks` counts the same way).
#define STRIPS_A_BLOCK(NB) ((NB) >= 4 ? 2 : 1)

// The tensor-core GEMMs' ending: each of WARPS warps holds its sums of S
// strips, out[j][cb] an m16n8 tile (rows g, g + 8; activation rows
// 8 cb + 2 t, + 1); they meet in `red` (shared) a strip at a time and warp 0
// writes the strips that exist and the activation rows below M.
template <int NB, int S, int WARPS>
__device__ __forceinline__ void strips_out(float (*red)[4 * NB][32], float (&out)[S][NB][4],
                                           const Outs& o, int M, int strip0, int strips) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < S; j++) {
#pragma unroll
        for (int cb = 0; cb < NB; cb++)
#pragma unroll
            for (int i = 0; i < 4; i++) red[warp][4 * cb + i][lane] = out[j][cb][i];
        __syncthreads();
        if (warp == 0 && strip0 + j < strips) {
            int row = (strip0 + j) * 16 + g;
#pragma unroll
            for (int cb = 0; cb < NB; cb++) {
                float v[4];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    v[i] = out[j][cb][i];
                    for (int u = 1; u < WARPS; u++) v[i] += red[u][4 * cb + i][lane];
                }
                int r0 = 8 * cb + 2 * t;
                if (r0 < M) {
                    put_out(o, r0, row, v[0]);
                    put_out(o, r0, row + 8, v[2]);
                }
                if (r0 + 1 < M) {
                    put_out(o, r0 + 1, row, v[1]);
                    put_out(o, r0 + 1, row + 8, v[3]);
                }
            }
        }
        __syncthreads();
    }
}

// 16 weight bytes, read once: streamed past L1 (evict first), which keeps
// L1 for the activations every warp of the block re-reads.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) { return __ldcs(p); }

// acc[m] += x[m][c0..c0 + 8] . the 8 bf16 weights in `pack`.
template <int M>
__device__ __forceinline__ void fma8(float* acc, uint4 pack, const float* x, int K,
                                     int c0) {
    const __nv_bfloat162* h2 = (const __nv_bfloat162*)&pack;
    float wf[8];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float2 f = __bfloat1622float2(h2[j]);
        wf[2 * j] = f.x;
        wf[2 * j + 1] = f.y;
    }
#pragma unroll
    for (int m = 0; m < M; m++) {
        const float4* xv = (const float4*)(x + (size_t)m * K + c0);
        // Plain (coherent) loads: x is written by the kernel before, which
        // may still run when this one starts (PDL_WAIT orders only coherent
        // accesses; a read-only __ldg may be hoisted above it).
        float4 a = xv[0], b = xv[1];
        acc[m] += a.x * wf[0] + a.y * wf[1] + a.z * wf[2] + a.w * wf[3] + b.x * wf[4] +
                  b.y * wf[5] + b.z * wf[6] + b.w * wf[7];
    }
}

// Does nothing: gemv_bf16_acc's default work after the wait.
struct NoHook {
    __device__ __forceinline__ void operator()() const {}
};

// acc[m] (this lane's share) += x[m] . wrow over the row's K / 8 pieces
// (the M rows of x a compile-time constant, so the sums live in
// registers): each lane keeps U 16-byte loads in flight before it uses any
// of them. The first U load before the wait for the kernel that writes x
// (weights are never written by a step). Every lane passes PDL_WAIT once,
// then runs `after` (loads of what the kernels before wrote, to overlap
// with the weights).
template <int M, int U, typename After = NoHook>
__device__ __forceinline__ void gemv_bf16_acc(const float* x, const uint4* wrow, int K,
                                              float (&acc)[M], After&& after = After()) {
    int lane = threadIdx.x & 31;
    int chunks = K / 8;
#pragma unroll
    for (int m = 0; m < M; m++) acc[m] = 0.0f;
    int c = lane;
    if (c + 32 * (U - 1) < chunks) {
        uint4 p[U];
#pragma unroll
        for (int u = 0; u < U; u++) p[u] = ld_stream(wrow + c + 32 * u);
        PDL_WAIT();
        after();
#pragma unroll
        for (int u = 0; u < U; u++) fma8<M>(acc, p[u], x, K, (c + 32 * u) * 8);
        c += 32 * U;
    } else {
        PDL_WAIT();
        after();
    }
    for (; c + 32 * (U - 1) < chunks; c += 32 * U) {
        uint4 p[U];
#pragma unroll
        for (int u = 0; u < U; u++) p[u] = ld_stream(wrow + c + 32 * u);
#pragma unroll
        for (int u = 0; u < U; u++) fma8<M>(acc, p[u], x, K, (c + 32 * u) * 8);
    }
    for (; c < chunks; c += 32) fma8<M>(acc, ld_stream(wrow + c), x, K, c * 8);
}

// A bf16 weight's row as 16-byte pieces.
__device__ __forceinline__ const uint4* bf16_row(const __nv_bfloat16* w, int row, int K) {
    return (const uint4*)(w + (size_t)row * K);
}

// out[m][row] = x[m] . w[row] for the M rows of x: one warp per weight row.
template <int M, int U>
__device__ void gemv_bf16_rows(const float* x, const __nv_bfloat16* __restrict__ w,
                               Outs o, int K) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int row = blockIdx.x * (blockDim.x >> 5) + warp;
    if (row >= o.n) {
        PDL_WAIT();
        return;
    }
    float acc[M];
    gemv_bf16_acc<M, U>(x, bf16_row(w, row, K), K, acc);
#pragma unroll
    for (int m = 0; m < M; m++) {
        float v = warp_sum(acc[m]);
        if (lane == 0) put_out(o, m, row, v);
    }
}

// One entry point per batch size (1..8), 4 loads in flight per lane (8
// measured slower on the H200 at one row). Blocks of 4 warps, a row each;
// at one row at most 40 registers, so 12 blocks share an SM and
// Llama-3-8B's q/k/v stack (1536 blocks) runs in one wave of an H200
// (see gemv_norm.cu).
#define GEMV_BF16(M, U)                                                                         \
    extern "C" __global__ void __launch_bounds__(128, M == 1 ? 12 : 1)                         \
        gemv_bf16_##M##_u##U(const float* x, const __nv_bfloat16* __restrict__ w,              \
                             float* o0, float* o1, float* o2, int n0, int n1, int n, int K) {  \
        PDL_LAUNCH();                                                                         \
        gemv_bf16_rows<M, U>(x, w, Outs{o0, o1, o2, n0, n1, n}, K);                           \
    }

GEMV_BF16(1, 4)
GEMV_BF16(2, 4)
GEMV_BF16(3, 4)
GEMV_BF16(4, 4)
GEMV_BF16(5, 4)
GEMV_BF16(6, 4)
GEMV_BF16(7, 4)
GEMV_BF16(8, 4)
