// FP8 rows inside a folded one-token step (fold.rs; see fp8_fold.rs): the
// W8A8 product gemm_e4m3 runs at one row (fp8_mma.cu), with the launches
// that surround it there folded in, as int4_one.cu folds them for int4
// tiles (Int4OneFold): the norm's factor from the residual product's
// partial sums, SiLU-and-multiply of a gate strip with its up strip, and
// the residual add with the next norm's input and sums.
//
// A block of E4_WARPS warps takes one strip of 16 weight rows, or with
// `pair` gate strip b (warps 0-3) and up strip b (warps 4-7); the warps of
// a strip split K into 64-wide pieces as gemm_e4m3_strip's do, each lane's
// fragment of a piece one 16-byte load of rows g and g + 8. Their first
// pieces load before the PDL wait (weights depend on no earlier kernel);
// after it the block quantizes x into shared memory exactly as
// quant_rows_e4m3 does (the same codes and scale: no quantizer launch runs
// before it), and the MMAs read x's codes from there (lanes g == 0: the
// one activation row is column 0 of B). Each warp's loads run a batch of
// E4F_U pieces ahead of its MMAs, in two register sets used in turn.

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

// The ending (warp 0, after the warps' sums meet in `red`): rows g and
// g + 8 of the block's strip (or strips) summed, scaled by the rows'
// weight scales, x's scale and the norm's factor, then written as `f`
// says (lanes t == 0).
__device__ __forceinline__ void e4f_out(float2 (*red)[8], const Int4OneFold& f,
                                        const Int4FoldEarly<1>& early, const Outs& o,
                                        const float (&wsc)[2][2], float xs, int K) {
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
    const int ways = f.pair ? W / 2 : W;
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
    if (t == 0) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            int row = row0 + g + 8 * e;
            if (f.h) {
                float hn = early.h[0][e] + v[0][e];
                f.h[row] = hn;
                f.gh[row] = early.gn[0][e] * hn;
                ss += hn * hn;
            } else {
                put_out(o, 0, row, v[0][e]);
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
// blocks, or N / 32 with `pair`. Shared memory: K bytes.
extern "C" __global__ void __launch_bounds__(32 * E4_WARPS, 2)
    gemv_e4m3_fold(const float* x, const unsigned char* w, const float* ws, float* o0, float* o1,
                   float* o2, int n0, int n1, int N, int K, const float* sums, int parts,
                   float eps, int pair, float* h, const float* gn, float* gh, float* psum) {
    constexpr int W = E4_WARPS;
    extern __shared__ __align__(16) unsigned char xq[];
    __shared__ float2 red[W][8];
    __shared__ float xscale;
    const Outs o{o0, o1, o2, n0, n1, N};
    const Int4OneFold f{sums, parts, eps, pair, h, gn, gh, psum};
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int strips = N / 16, pieces = K / 64;
    // The strip this warp sums, and its place among that strip's warps.
    const int ways = pair ? W / 2 : W, kw = warp % ways;
    const int row0 = (blockIdx.x + (pair && warp >= ways ? strips / 2 : 0)) * 16;
    const uint4* wa = (const uint4*)(w + (size_t)(row0 + g) * K) + t;
    const uint4* wb = (const uint4*)(w + (size_t)(row0 + g + 8) * K) + t;
    PDL_LAUNCH();
    uint4 a0[E4F_U], b0[E4F_U], a1[E4F_U], b1[E4F_U];
    e4f_load(a0, b0, wa, wb, kw, ways, pieces);
    // Warp 0's rows' weight scales (of the gate and up strips with `pair`).
    float wsc[2][2];
#pragma unroll
    for (int k = 0; k < 2; k++) {
        int r = (blockIdx.x + (k ? strips / 2 : 0)) * 16 + g;
        bool live = warp == 0 && (k == 0 || pair);
        wsc[k][0] = live ? ws[r] : 0.0f;
        wsc[k][1] = live ? ws[r + 8] : 0.0f;
    }
    PDL_WAIT();
    Int4FoldEarly<1> early;
    if (warp == 0) int4_fold_early<1>(f, early, blockIdx.x, strips);
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
    if (warp == 0) e4f_out(red, f, early, o, wsc, xscale, K);
}
