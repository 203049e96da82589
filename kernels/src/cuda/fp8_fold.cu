// FP8 rows inside a folded one-token step (fold.rs; see fp8_fold.rs): the
// W8A8 product gemm_e4m3 runs at one row (fp8_mma.cu), with the launches
// that surround it there folded in, as int4_one.cu folds them for int4
// tiles (Int4OneFold): the norm's factor from the residual product's
// partial sums, SiLU-and-multiply of a gate strip with its up strip, and
// the residual add with the next norm's input and sums.
//
// A block of E4_WARPS warps takes one strip of 16 weight rows, or with
// `pair` gate strip b (warps 0-3) and up strip b (warps 4-7), or in the
// twin build strips 2b (warps 0-3) and 2b + 1 (warps 4-7): half the
// blocks, so a grid that takes one and a half waves takes three quarters
// of one, and the kernel after it finds room on the SMs it leaves. The
// warps of a strip split K into 64-wide pieces as gemm_e4m3_strip's do,
// each lane's fragment of a piece one 16-byte load of rows g and g + 8.
// Their first pieces load before the PDL wait (weights depend on no
// earlier kernel); after it the block quantizes x into shared memory
// exactly as quant_rows_e4m3 does (the same codes and scale: no quantizer
// launch runs before it), and the MMAs read x's codes from there (lanes
// g == 0: the one activation row is column 0 of B). Each warp's loads run
// a batch of E4F_U pieces ahead of its MMAs, in two register sets used in
// turn.

#define E4F_U 4

// Pieces p0, p0 + ways, ... (E4F_U of them, none past the last) of rows
// g and g + 8 into a and b.
__device__ __forceinline__ void e4f_load(uint4 (&a)[E4F_U], uint4 (&b)[E4F_U], const uint4* wa,
                                         const uint4* wb, int p0, int ways, int pieces) {
#pragma unroll
    for (int u = 0; u < E4F_U; u++) {
        int p = p0 + u * ways;
        a[u] = p < pieces ? ld_stream(wa + 4 * p) : make_uint4(0, 0, 0, 0);
        b[u] = p < pieces ? ld_stream(wb + 4 * p) : make_uint4(0, 0, 0, 0);
    }
}

// The MMAs of the pieces e4f_load loaded from p0, against x's codes in
// shared memory.
__device__ __forceinline__ void e4f_mma(float (&acc)[4], const uint4 (&a)[E4F_U],
                                        const uint4 (&b)[E4F_U], const unsigned char* xq, int p0,
                                        int ways, int pieces, int g, int t) {
#pragma unroll
    for (int u = 0; u < E4F_U; u++) {
        int p = p0 + u * ways;
        if (p >= pieces) break;  // the same for the whole warp
        uint4 x = g == 0 ? *(const uint4*)(xq + p * 64 + 16 * t) : make_uint4(0, 0, 0, 0);
        mma_e4m3(acc, a[u].x, b[u].x, a[u].y, b[u].y, x.x, x.y);
        mma_e4m3(acc, a[u].z, b[u].z, a[u].w, b[u].w, x.z, x.w);
    }
}

// The strip that warps k (0: the first half, 1: the second; 0 alone
// where a block takes one strip) of block b sum.
template <bool TWIN>
__device__ __forceinline__ int e4f_strip(int b, int k, int pair, int strips) {
    return TWIN ? 2 * b + k : b + (pair && k ? strips / 2 : 0);
}

// The ending (warp 0, after the warps' sums meet in `red`): rows g and
// g + 8 of the block's strip (or strips) summed, scaled by the rows'
// weight scales, x's scale and the norm's factor, then written as `f`
// says (lanes t == 0). R: the strips a block writes (2 in the twin
// build).
template <int R>
__device__ __forceinline__ void e4f_out(float2 (*red)[8], const Int4OneFold& f,
                                        const Int4FoldEarly<R>& early, const Outs& o,
                                        const float (&wsc)[2][2], float xs, int K, int strips) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float fac = xs;
    if (f.sums) {
        float v = 0.0f;
#pragma unroll
        for (int j = 0; j < INT4_FOLD_EARLY; j++) v += early.sums[j];
        for (int i = lane + 32 * INT4_FOLD_EARLY; i < f.parts; i += 32) v += f.sums[i];
        fac *= norm_factor(warp_sum(v), K, f.eps);
    }
    constexpr int W = E4_WARPS;
    const int ways = f.pair || R == 2 ? W / 2 : W;
    float2 s[2] = {make_float2(0.0f, 0.0f), make_float2(0.0f, 0.0f)};
    for (int w = 0; w < W; w++) {
        int k = w >= ways;
        s[k].x += red[w][g].x;
        s[k].y += red[w][g].y;
    }
    float v[2][2];
#pragma unroll
    for (int k = 0; k < 2; k++) {
        v[k][0] = s[k].x * wsc[k][0] * fac;
        v[k][1] = s[k].y * wsc[k][1] * fac;
    }
    int row0 = blockIdx.x * 16;
    if (f.pair) {
        if (t == 0) {
            o.o0[row0 + g] = silu_times(v[0][0], v[1][0]);
            o.o0[row0 + g + 8] = silu_times(v[0][1], v[1][1]);
        }
        return;
    }
    float ss = 0.0f;
#pragma unroll
    for (int r = 0; r < R; r++) {
        int strip = e4f_strip<R == 2>(blockIdx.x, r, 0, strips);
        if (t != 0 || strip >= strips) continue;
#pragma unroll
        for (int e = 0; e < 2; e++) {
            int row = strip * 16 + g + 8 * e;
            if (f.h) {
                float hn = early.h[r][e] + v[r][e];
                f.h[row] = hn;
                f.gh[row] = early.gn[r][e] * hn;
                ss += hn * hn;
            } else {
                put_out(o, 0, row, v[r][e]);
            }
        }
    }
    if (f.h) {
        ss = warp_sum(ss);
        if (lane == 0) f.psum[blockIdx.x] = ss;
    }
}

// x (K f32, K a multiple of 64) against the FP8 rows w (N x K codes, a
// scale a row in ws; N a multiple of 16), folded as `f` says: N / 16
// blocks, or N / 32 with `pair`, or N / 32 rounded up in the twin build
// (never with `pair`). Shared memory: K bytes.
template <bool TWIN>
__device__ __forceinline__ void gemv_e4m3_fold_t(const float* x, const unsigned char* w,
                                                 const float* ws, float* o0, float* o1, float* o2,
                                                 int n0, int n1, int N, int K, const float* sums,
                                                 int parts, float eps, int pair, float* h,
                                                 const float* gn, float* gh, float* psum) {
    constexpr int W = E4_WARPS, R = TWIN ? 2 : 1;
    extern __shared__ __align__(16) unsigned char xq[];
    __shared__ float2 red[W][8];
    __shared__ float xscale;
    const Outs o{o0, o1, o2, n0, n1, N};
    const Int4OneFold f{sums, parts, eps, pair, h, gn, gh, psum};
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int strips = N / 16;
    // The strip this warp sums, and its place among that strip's warps
    // (the twin build's last block has no second strip where the strips
    // are odd: those warps load nothing).
    const int ways = pair || TWIN ? W / 2 : W, kw = warp % ways;
    const int strip = e4f_strip<TWIN>(blockIdx.x, warp >= ways, pair, strips);
    const int pieces = strip < strips ? K / 64 : 0, row0 = strip * 16;
    const uint4* wa = (const uint4*)(w + (size_t)(row0 + g) * K) + t;
    const uint4* wb = (const uint4*)(w + (size_t)(row0 + g + 8) * K) + t;
    PDL_LAUNCH();
    uint4 a0[E4F_U], b0[E4F_U], a1[E4F_U], b1[E4F_U];
    e4f_load(a0, b0, wa, wb, kw, ways, pieces);
    // Warp 0's rows' weight scales (of the gate and up strips with `pair`).
    float wsc[2][2];
#pragma unroll
    for (int k = 0; k < 2; k++) {
        int sk = e4f_strip<TWIN>(blockIdx.x, k, pair, strips), r = sk * 16 + g;
        bool live = warp == 0 && (k == 0 || pair || TWIN) && sk < strips;
        wsc[k][0] = live ? ws[r] : 0.0f;
        wsc[k][1] = live ? ws[r + 8] : 0.0f;
    }
    PDL_WAIT();
    Int4FoldEarly<R> early;
    if (warp == 0) int4_fold_early<R>(f, early, e4f_strip<TWIN>(blockIdx.x, 0, 0, strips), strips);
    quant_row_e4m3(x, xq, &xscale, K);
    __syncthreads();
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int step = E4F_U * ways;
    for (int p = kw; p < pieces; p += 2 * step) {
        e4f_load(a1, b1, wa, wb, p + step, ways, pieces);
        e4f_mma(acc, a0, b0, xq, p, ways, pieces, g, t);
        if (p + step >= pieces) break;
        e4f_load(a0, b0, wa, wb, p + 2 * step, ways, pieces);
        e4f_mma(acc, a1, b1, xq, p + step, ways, pieces, g, t);
    }
    if (t == 0) red[warp][g] = make_float2(acc[0], acc[2]);
    __syncthreads();
    if (warp == 0) e4f_out<R>(red, f, early, o, wsc, xscale, K, strips);
}

// gemv_e4m3_fold (a strip, or a gate/up pair, a block) and
// gemv_e4m3_fold_twin (two strips a block).
#define GEMV_E4M3_FOLD(NAME, TWIN)                                                             \
    extern "C" __global__ void __launch_bounds__(32 * E4_WARPS, 2)                             \
        NAME(const float* x, const unsigned char* w, const float* ws, float* o0, float* o1,    \
             float* o2, int n0, int n1, int N, int K, const float* sums, int parts, float eps,  \
             int pair, float* h, const float* gn, float* gh, float* psum) {                     \
        gemv_e4m3_fold_t<TWIN>(x, w, ws, o0, o1, o2, n0, n1, N, K, sums, parts, eps, pair, h, \
                               gn, gh, psum);                                                   \
    }
GEMV_E4M3_FOLD(gemv_e4m3_fold, false)
GEMV_E4M3_FOLD(gemv_e4m3_fold_twin, true)
