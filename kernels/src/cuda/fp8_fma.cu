// FP8 rows inside a folded one-token step on FMAs (W8A32): the same
// arguments and the same fold as gemv_e4m3_fold (fp8_fold.cu), laid out as
// the bf16 GEMVs of gemv_norm.cu are: each lane a 16-byte piece of a
// weight row a load (16 weights), x read as f32 where it lies, no shared
// memory and no barrier before the products. A block takes a strip of 16
// rows: W warps of R rows each (rows warp, warp + W, ...), whose loads of
// x serve all R (one row a warp read x at ~25 bytes a clock an SM, about
// what an SM's L1 serves: 55% of copy). With `pair`, a gate strip and its
// up strip: each warp's gate rows and their up rows.
//
// No conversion instruction runs: an e4m3 code's sign and seven bits of
// exponent and mantissa, moved to bits 31 and 20-26, are an f32 of the
// same value times 2^-120 (subnormal codes too), so each weight costs a
// shift, an arithmetic shift and a mask before its FMA; the 2^120 joins
// the row's scale at the end. (The F2FP conversions of gemv_fp8row, on
// 16 an SM a clock, held it to ~30% of copy.)

// Code j of the four in q as f32, times 2^-120.
template <int J>
__device__ __forceinline__ float e4w_code(unsigned q) {
    int top = (int)(q << (24 - 8 * J));
    return __int_as_float((top >> 4) & 0x87F00000);
}

// acc[r] += the 16 codes of p[r] against x[0..16), for R rows.
template <int R>
__device__ __forceinline__ void e4w_fma16(float (&acc)[R][2], const uint4 (&p)[R],
                                          const float* x) {
    const float4* xv = (const float4*)x;
    // Plain loads: x is written by the kernel before (see fma8 in gemv.cu).
    float4 xs[4] = {xv[0], xv[1], xv[2], xv[3]};
#pragma unroll
    for (int r = 0; r < R; r++) {
        const unsigned w[4] = {p[r].x, p[r].y, p[r].z, p[r].w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float* a = acc[r];
            a[0] = fmaf(xs[i].x, e4w_code<0>(w[i]), a[0]);
            a[1] = fmaf(xs[i].y, e4w_code<1>(w[i]), a[1]);
            a[0] = fmaf(xs[i].z, e4w_code<2>(w[i]), a[0]);
            a[1] = fmaf(xs[i].w, e4w_code<3>(w[i]), a[1]);
        }
    }
}

// This lane's sums of rows w[0..R) (K codes each) against x: pieces lane,
// lane + 32, ...; the first U pieces load before the PDL wait.
template <int R, int U>
__device__ __forceinline__ void e4w_rows(const float* x, const uint4* const (&w)[R], int K,
                                         float (&acc)[R][2]) {
    const int lane = threadIdx.x & 31, pieces = K / 16;
#pragma unroll
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = 0.0f;
    int c = lane;
    uint4 p[U][R];
#pragma unroll
    for (int u = 0; u < U; u++) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            p[u][r] = c + 32 * u < pieces ? ld_stream(w[r] + c + 32 * u) : make_uint4(0, 0, 0, 0);
        }
    }
    PDL_WAIT();
    while (true) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (c + 32 * u < pieces) e4w_fma16<R>(acc, p[u], x + 16 * (c + 32 * u));
        }
        c += 32 * U;
        if (c >= pieces) break;
#pragma unroll
        for (int u = 0; u < U; u++) {
#pragma unroll
            for (int r = 0; r < R; r++) {
                p[u][r] =
                    c + 32 * u < pieces ? ld_stream(w[r] + c + 32 * u) : make_uint4(0, 0, 0, 0);
            }
        }
    }
}

// The norm's factor from the residual product's `parts` partial sums
// (every warp sums them in the same order, so every warp gets the same
// bits), or 1 without a norm.
__device__ __forceinline__ float e4w_factor(const Int4OneFold& f, int K) {
    if (!f.sums) return 1.0f;
    int lane = threadIdx.x & 31;
    float v = 0.0f;
    for (int i = lane; i < f.parts; i += 32) v += f.sums[i];
    return norm_factor(warp_sum(v), K, f.eps);
}

// A block of W warps, R rows a warp (with `pair`, R / 2 gate rows and
// their up rows), U loads in flight a row.
template <int W, int R, int U, bool PAIR>
__device__ __forceinline__ void e4w_fold(const float* x, const unsigned char* w, const float* ws,
                                         const Outs& o, const Int4OneFold& f, int N, int K) {
    static_assert(W * R == (PAIR ? 32 : 16), "a strip of 16 rows a block (a pair of strips)");
    __shared__ float red[W];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int row[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        row[r] = PAIR ? blockIdx.x * 16 + warp + (r % (R / 2)) * W + (r < R / 2 ? 0 : N / 2)
                      : blockIdx.x * 16 + warp + r * W;
    }
    const uint4* rows[R];
#pragma unroll
    for (int r = 0; r < R; r++) rows[r] = (const uint4*)(w + (size_t)row[r] * K);
    PDL_LAUNCH();
    float acc[R][2];
    e4w_rows<R, U>(x, rows, K, acc);
    const float fac = e4w_factor(f, K);
    // The sums times 2^120 first: the norm's factor (up to 1 / sqrt(eps))
    // times 2^120 would overflow.
    float v[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        v[r] = warp_sum(acc[r][0] + acc[r][1]) * 0x1p120f * (fac * ws[row[r]]);
    }
    if (PAIR) {
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < R / 2; r++) o.o0[row[r]] = silu_times(v[r], v[r + R / 2]);
        }
        return;
    }
    if (!f.h) {
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < R; r++) put_out(o, 0, row[r], v[r]);
        }
        return;
    }
    if (lane == 0) {
        float ss = 0.0f;
#pragma unroll
        for (int r = 0; r < R; r++) {
            float hn = f.h[row[r]] + v[r];
            f.h[row[r]] = hn;
            f.gh[row[r]] = f.gn[row[r]] * hn;
            ss += hn * hn;
        }
        red[warp] = ss;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float ss = 0.0f;
#pragma unroll
        for (int i = 0; i < W; i++) ss += red[i];
        f.psum[blockIdx.x] = ss;
    }
}

// gemv_e4m3_fold's arguments and grid (N / 16 blocks; f / 16 with `pair`,
// `_pair`): four warps of four rows, two loads in flight a row; eight
// warps of two gate rows and their up rows with `pair`.
#define GEMV_E4M3W_FOLD(NAME, W, R, PAIR, MINB)                                                    \
    extern "C" __global__ void __launch_bounds__(32 * W, MINB)                                     \
        NAME(const float* x, const unsigned char* w, const float* ws, float* o0, float* o1,        \
             float* o2, int n0, int n1, int N, int K, const float* sums, int parts, float eps,     \
             int pair, float* h, const float* gn, float* gh, float* psum) {                        \
        const Outs o{o0, o1, o2, n0, n1, N};                                                       \
        const Int4OneFold f{sums, parts, eps, pair, h, gn, gh, psum};                              \
        e4w_fold<W, R, 2, PAIR>(x, w, ws, o, f, N, K);                                             \
    }
GEMV_E4M3W_FOLD(gemv_e4m3w_fold, 4, 4, false, 6)
GEMV_E4M3W_FOLD(gemv_e4m3w_fold_pair, 8, 4, true, 3)
