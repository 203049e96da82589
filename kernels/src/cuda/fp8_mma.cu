// W8A8 products of a few activation rows on FP8 tensor cores (see
// fp8_mma.rs): the decode batches' products with FP8 rows, which cuBLASLt
// runs at a third of copy bandwidth and a conversion-bound GEMV no faster.
//
// out[m][n] = xs[m] ws[n] sum_k xq[m][k] w[n][k], with xq the e4m3 codes of
// the activations (a scale per row, as fp8_act.cu writes them) and w the
// FP8 rows' codes as uploaded (K a row, packed; their scales in ws). Nothing is
// converted: the codes go into m16n8k32 e4m3 MMAs (`mma_e4m3`,
// attention_mma.cu; sm_89 and up, where the host alone launches these) as
// loaded.
//
// A block of E4_WARPS warps takes one strip of 16 weight rows; its warps
// split K into 64-wide pieces (warp w takes pieces w, w + E4_WARPS, ...),
// and the last warp a 32-wide tail where K is not a multiple of 64.
// In a piece, lane (g, t) loads 16 bytes of weight rows g and g + 8 at
// k = 64 p + 16 t and the same 16 bytes of activation row g of each block
// of 8: the k order inside a piece is permuted, the same way for both
// operands, so every fragment is one 16-byte load and the sum is unchanged.
// Bytes 0-7 of each load are one MMA's k slots (4t..4t+3 and 16+4t..),
// bytes 8-15 the next one's.

#define E4_WARPS 8

// Output parts of a stack, as `Outs` in gemv.cu, in f32 or bf16.
template <typename T>
struct OutsT {
    T* o0;
    T* o1;
    T* o2;
    int n0, n1, n;
};

__device__ __forceinline__ void store_out(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_out(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

template <typename T>
__device__ __forceinline__ void put_out_t(const OutsT<T>& o, int m, int row, float v) {
    if (row < o.n0) {
        store_out(o.o0 + (size_t)m * o.n0 + row, v);
    } else if (row < o.n0 + o.n1) {
        store_out(o.o1 + (size_t)m * o.n1 + row - o.n0, v);
    } else {
        int n2 = o.n - o.n0 - o.n1;
        store_out(o.o2 + (size_t)m * n2 + row - o.n0 - o.n1, v);
    }
}

// One 64-wide piece of the strip against every block of 8 activation rows
// (rows past M read as zeros). x is written by the kernel before: plain
// loads, after the PDL wait.
template <int NB>
__device__ __forceinline__ void e4_piece(float (&acc)[NB][4], uint4 a, uint4 b,
                                         const unsigned char* xq, int M, int K, int piece, int g,
                                         int t) {
#pragma unroll
    for (int cb = 0; cb < NB; cb++) {
        int m = 8 * cb + g;
        uint4 x = make_uint4(0, 0, 0, 0);
        if (m < M) x = *(const uint4*)(xq + (size_t)m * K + piece * 64 + 16 * t);
        mma_e4m3(acc[cb], a.x, b.x, a.y, b.y, x.x, x.y);
        mma_e4m3(acc[cb], a.z, b.z, a.w, b.w, x.z, x.w);
    }
}

// The 32 columns past the last whole piece (K = 64 p + 32): lane t's 8
// bytes at k = 64 p + 8 t are one MMA's slots.
template <int NB>
__device__ __forceinline__ void e4_tail(float (&acc)[NB][4], const unsigned char* ra,
                                        const unsigned char* rb, const unsigned char* xq, int M,
                                        int K, int k0, int g, int t) {
    uint2 a = __ldcs((const uint2*)(ra + k0 + 8 * t)), b = __ldcs((const uint2*)(rb + k0 + 8 * t));
#pragma unroll
    for (int cb = 0; cb < NB; cb++) {
        int m = 8 * cb + g;
        uint2 x = make_uint2(0, 0);
        if (m < M) x = *(const uint2*)(xq + (size_t)m * K + k0 + 8 * t);
        mma_e4m3(acc[cb], a.x, b.x, a.y, b.y, x.x, x.y);
    }
}

// The strip of block blockIdx.x for NB blocks of 8 activation rows (M <=
// 8 NB; K a multiple of 32). Each lane keeps U pieces' weight loads in
// flight; the first go out before the wait for the kernel that writes xq
// (weights are never written by a step). (Loading the next U while these
// multiply took 110 registers, two blocks an SM, and made the 384 blocks
// of q/k/v two waves: slower.)
template <int NB, typename T>
__device__ __forceinline__ void gemm_e4m3_strip(const unsigned char* __restrict__ w,
                                                const float* __restrict__ ws,
                                                const unsigned char* xq, const float* xs,
                                                const OutsT<T>& o, int M, int K) {
    constexpr int W = E4_WARPS, U = 4;
    __shared__ float red[W][4 * NB][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * 16;
    // Rows past the end read the last row; their sums are never written.
    const unsigned char* ra = w + (size_t)min(row0 + g, o.n - 1) * K;
    const unsigned char* rb = w + (size_t)min(row0 + g + 8, o.n - 1) * K;
    const uint4* wa = (const uint4*)ra + t;
    const uint4* wb = (const uint4*)rb + t;
    const int pieces = K / 64;
    float acc[NB][4];
#pragma unroll
    for (int cb = 0; cb < NB; cb++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[cb][i] = 0.0f;
    int p = warp;
    bool waited = false;
    for (; p + (U - 1) * W < pieces; p += U * W) {
        uint4 a[U], b[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            a[u] = ld_stream(wa + 4 * (p + u * W));
            b[u] = ld_stream(wb + 4 * (p + u * W));
        }
        if (!waited) {
            PDL_WAIT();
            waited = true;
        }
#pragma unroll
        for (int u = 0; u < U; u++) e4_piece<NB>(acc, a[u], b[u], xq, M, K, p + u * W, g, t);
    }
    for (; p < pieces; p += W) {
        uint4 a = ld_stream(wa + 4 * p), b = ld_stream(wb + 4 * p);
        if (!waited) {
            PDL_WAIT();
            waited = true;
        }
        e4_piece<NB>(acc, a, b, xq, M, K, p, g, t);
    }
    if (!waited) PDL_WAIT();
    if ((K & 63) && warp == W - 1) e4_tail<NB>(acc, ra, rb, xq, M, K, 64 * pieces, g, t);
    // The warps' partial sums meet in shared memory; thread j sums value
    // j of the 16 x 8 NB tile (accumulator j / 32 of lane j % 32).
#pragma unroll
    for (int cb = 0; cb < NB; cb++)
#pragma unroll
        for (int i = 0; i < 4; i++) red[warp][4 * cb + i][lane] = acc[cb][i];
    __syncthreads();
    for (int j = threadIdx.x; j < 128 * NB; j += blockDim.x) {
        int q = j >> 5, l = j & 31, cb = q >> 2, i = q & 3;
        float v = 0.0f;
#pragma unroll
        for (int u = 0; u < W; u++) v += red[u][q][l];
        int row = row0 + (l >> 2) + (i >= 2 ? 8 : 0);
        int m = 8 * cb + 2 * (l & 3) + (i & 1);
        if (m < M && row < o.n) put_out_t(o, m, row, v * ws[row] * xs[m]);
    }
}

// One entry point per blocks of 8 activation rows (1 and 2: the engine
// gives cuBLASLt more than 16 rows, where the activations' loads, 8 NB
// for every weight piece, cost more than cuBLASLt's tiles) and output
// type; blocks of E4_WARPS warps, one a strip of 16 weight rows.
#define GEMM_E4M3(NB, SUF, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * E4_WARPS)                                \
        gemm_e4m3_nb##NB##_##SUF(const unsigned char* w, const float* ws,                      \
                                 const unsigned char* xq, const float* xs, T* o0, T* o1,       \
                                 T* o2, int n0, int n1, int n, int M, int K) {                 \
        PDL_LAUNCH();                                                                          \
        gemm_e4m3_strip<NB, T>(w, ws, xq, xs, OutsT<T>{o0, o1, o2, n0, n1, n}, M, K);          \
    }

GEMM_E4M3(1, f32, float)
GEMM_E4M3(2, f32, float)
GEMM_E4M3(1, bf16, __nv_bfloat16)
GEMM_E4M3(2, bf16, __nv_bfloat16)
