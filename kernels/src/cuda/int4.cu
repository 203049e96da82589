// Kiln's int4 weights on the device (W4A16; laid out by int4.rs). Rows come in
// strips of 16 and each strip's K in tiles of 64; a tile is 512 bytes, 16 a
// lane, and holds the lane's A fragments of four m16n8k16 MMAs (k steps
// s = 0..3), one 32-bit word a step: nibble j + 4h of word s is row
// g + 8 (j & 1), column 16 s + 2 t + 8 (j >> 1) + h of the tile (lane 4 g + t).
// So `(word >> 4 j) & 0x000f000f` is fragment register j's two quants, and
// or-ing in 0x43004300 makes them the bf16 pair (128 + q_lo, 128 + q_hi), no
// conversion instruction. After all nibbles: the groups' (f16 d, f16 m),
// [row][group], w = q d + m.
//
// Activations ride as bf16 hi + lo (two MMAs), so a product keeps ~2^-16 of
// f32. The MMAs sum x (128 + q) over a group; the group's sum of x takes the
// 128 back out and carries the offset: d (acc - 128 sx) + m sx, in f32.

#define INT4_WARPS 8

// One LOP3 after the shift: written as C, the mask and the or are two
// (a LOP3 holds one immediate; ptxas keeps the other in a register only
// when asked like this), a third of a one-row GEMV's instructions.
__device__ __forceinline__ unsigned int4_pair(unsigned v, int j) {
    unsigned d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;"  // (a & b) | c
        : "=r"(d)
        : "r"(v >> (4 * j)), "r"(0x000F000Fu), "r"(0x43004300u));
    return d;
}

// The activations as B fragments: for tile kt, row m < M and t < 4, 64
// bytes: 8 words of hi pairs (step s: columns 16 s + 2 t, +1; then +8, +9),
// then the 8 words of lo pairs. Then sx[m][group] (f32), the group's sum of
// hi + lo (of hi alone without `with_lo`, for the GEMM, which reads hi alone). One warp per (group, row m); lane l takes columns 2 l, 2 l + 1 of
// each of the group's tiles.
extern "C" __global__ void int4_xfrag(const float* x, __nv_bfloat16* frag, int M, int K,
                                      int G, int with_lo) {
    PDL_ENTER();
    int grp = blockIdx.x, m = blockIdx.y, lane = threadIdx.x;
    unsigned* words = (unsigned*)frag;
    float* sx = (float*)(frag + (size_t)2 * M * K);
    float sum = 0.0f;
    for (int kt = grp * (G / 64); kt < (grp + 1) * (G / 64); kt++) {
        // Column c = 2 lane of the tile: step s = c / 16, r = c % 16 with
        // r = 2 t + 8 half (+ 0 or 1).
        int c = 2 * lane, s = c >> 4, r = c & 15, t = (r >> 1) & 3, half = r >> 3;
        float2 v = *(const float2*)(x + (size_t)m * K + kt * 64 + c);
        __nv_bfloat162 hi = __floats2bfloat162_rn(v.x, v.y);
        float2 hf = __bfloat1622float2(hi);
        __nv_bfloat162 lo = __floats2bfloat162_rn(v.x - hf.x, v.y - hf.y);
        float2 lf = __bfloat1622float2(lo);
        sum += hf.x + hf.y + (with_lo ? lf.x + lf.y : 0.0f);
        size_t base = (((size_t)kt * M + m) * 4 + t) * 16;
        words[base + 2 * s + half] = *(unsigned*)&hi;
        words[base + 8 + 2 * s + half] = *(unsigned*)&lo;
    }
    sum = warp_sum(sum);
    if (lane == 0) sx[(size_t)m * (K / G) + grp] = sum;
}

// A lane's pointers into strip `strip` of an N x K int4 matrix of NG
// groups a row: its 16-byte piece of the strip's first tile, and the
// (d, m) pairs of its rows g and g + 8.
struct StripPtrs {
    const uint4* nib;
    const unsigned* p0;
    const unsigned* p1;
};

__device__ __forceinline__ StripPtrs strip_ptrs(const unsigned char* w, int strip, int N, int K,
                                                int NG, int lane) {
    const unsigned* params = (const unsigned*)(w + (size_t)N * (K / 2));
    const unsigned* p0 = params + (size_t)(strip * 16 + (lane >> 2)) * NG;
    return {(const uint4*)(w + (size_t)strip * 16 * (K / 2)) + lane, p0, p0 + (size_t)8 * NG};
}

// One tile's four k steps for this lane: c += A (tile w) * B (b's 8 words,
// two a step).
__device__ __forceinline__ void int4_tile_steps(float* c, const uint4& w, const unsigned* b) {
    unsigned ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int s = 0; s < 4; s++)
        mma16<false>(c, int4_pair(ws[s], 0), int4_pair(ws[s], 1), int4_pair(ws[s], 2),
                     int4_pair(ws[s], 3), b[2 * s], b[2 * s + 1]);
}

// One tile's MMAs for this lane: c += A (tile w) * B (hw's 8 words of hi,
// then its 8 of lo).
__device__ __forceinline__ void int4_tile_mma(float* c, const uint4& w, const unsigned* hw) {
    unsigned ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int s = 0; s < 4; s++) {
        unsigned a0 = int4_pair(ws[s], 0), a1 = int4_pair(ws[s], 1);
        unsigned a2 = int4_pair(ws[s], 2), a3 = int4_pair(ws[s], 3);
        mma16<false>(c, a0, a1, a2, a3, hw[2 * s], hw[2 * s + 1]);
        mma16<false>(c, a0, a1, a2, a3, hw[8 + 2 * s], hw[8 + 2 * s + 1]);
    }
}

// One group's MMAs for this lane: c += A (the group's TILES tiles) * B.
template <int TILES>
__device__ __forceinline__ void int4_group_mma(float* c, const uint4* w, const uint4* xf) {
#pragma unroll
    for (int i = 0; i < TILES; i++) int4_tile_mma(c, w[i], (const unsigned*)&xf[4 * i]);
}

// out[m][row] = sum_k x[m][k] w[row][k] for m < M <= 8, groups of 64 TILES:
// one block per strip of 16 rows, its warps taking the groups in turn, two
// groups' loads in flight a lane; the warps' sums meet in shared memory.
template <int TILES>
__device__ void gemv_int4_strip(const __nv_bfloat16* frag, const unsigned char* w, Outs o,
                                int M, int K) {
    __shared__ float red[INT4_WARPS][32][4];
    const int G = 64 * TILES;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int strip = blockIdx.x, NG = K / G;
    StripPtrs sp = strip_ptrs(w, strip, o.n, K, NG, lane);
    const uint4* nib = sp.nib;
    const unsigned *p0 = sp.p0, *p1 = sp.p1;
    const uint4* xf = (const uint4*)frag;
    const float* sx = (const float*)(frag + (size_t)2 * M * K);
    float out[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int grp = warp; grp < NG; grp += 2 * INT4_WARPS) {
        int grp2 = grp + INT4_WARPS;
        bool two = grp2 < NG;
        uint4 wq[2 * TILES], xq[8 * TILES];
        // Weights stream past L1; this lane's activation pieces are zero
        // for the columns past M.
#pragma unroll
        for (int i = 0; i < 2 * TILES; i++) {
            int kt = (i < TILES ? grp : grp2 - 1) * TILES + i;
            bool live = i < TILES || two;
            wq[i] = live ? __ldcs(nib + (size_t)kt * 32) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int p = 0; p < 4; p++)
                xq[4 * i + p] = (live && g < M) ? xf[(((size_t)kt * M + g) * 4 + t) * 4 + p]
                                                : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (h == 1 && !two) break;
            int gi = h ? grp2 : grp;
            float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            int4_group_mma<TILES>(c, wq + h * TILES, xq + 4 * h * TILES);
            float2 pa = __half22float2(*(const __half2*)(p0 + gi));
            float2 pb = __half22float2(*(const __half2*)(p1 + gi));
            float s0 = 2 * t < M ? sx[(size_t)(2 * t) * NG + gi] : 0.0f;
            float s1 = 2 * t + 1 < M ? sx[(size_t)(2 * t + 1) * NG + gi] : 0.0f;
            out[0] += pa.x * (c[0] - 128.0f * s0) + pa.y * s0;
            out[1] += pa.x * (c[1] - 128.0f * s1) + pa.y * s1;
            out[2] += pb.x * (c[2] - 128.0f * s0) + pb.y * s0;
            out[3] += pb.x * (c[3] - 128.0f * s1) + pb.y * s1;
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++) red[warp][lane][i] = out[i];
    __syncthreads();
    if (warp != 0) return;
    for (int v = 1; v < INT4_WARPS; v++)
#pragma unroll
        for (int i = 0; i < 4; i++) out[i] += red[v][lane][i];
    int row = strip * 16 + g;
    if (2 * t < M) {
        put_out(o, 2 * t, row, out[0]);
        put_out(o, 2 * t, row + 8, out[2]);
    }
    if (2 * t + 1 < M) {
        put_out(o, 2 * t + 1, row, out[1]);
        put_out(o, 2 * t + 1, row + 8, out[3]);
    }
}

#define GEMV_INT4(G)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * INT4_WARPS)                           \
        gemv_int4_g##G(const __nv_bfloat16* frag, const unsigned char* w, float* o0,         \
                       float* o1, float* o2, int n0, int n1, int M, int N, int K) {          \
        PDL_ENTER();                                                                          \
        gemv_int4_strip<G / 64>(frag, w, Outs{o0, o1, o2, n0, n1, N}, M, K);                 \
    }

GEMV_INT4(64)
GEMV_INT4(128)

// out[m][row] = sum_k x[m][k] w[row][k] for 8 < M <= 8 NB: the GEMV's nibble
// tiles and its two groups' weights in flight a warp, against NB blocks of 8
// activation rows (MMA columns), bf16 activations (their hi halves alone, as
// cuBLAS would round them; xfrag's sums then hold hi alone). A block takes S
// strips of 16 rows: each block reads all M rows' fragments from L2 (M / 4 S
// times its weight bytes), so S = 2 from 32 rows, and past 64 rows the
// dequantized cuBLAS GEMM takes over.
template <int TILES, int NB, int S>
__device__ void gemm_int4_strips(const __nv_bfloat16* frag, const unsigned char* w, Outs o,
                                 int M, int K) {
    __shared__ float red[INT4_WARPS][4 * NB][32];
    const int G = 64 * TILES;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int NG = K / G, N = o.n, strips = N / 16, strip0 = blockIdx.x * S;
    const unsigned* params = (const unsigned*)(w + (size_t)N * (K / 2));
    const uint4* xf = (const uint4*)frag;
    const float* sx = (const float*)(frag + (size_t)2 * M * K);
    float out[S][NB][4];
#pragma unroll
    for (int j = 0; j < S; j++)
#pragma unroll
        for (int cb = 0; cb < NB; cb++)
#pragma unroll
            for (int i = 0; i < 4; i++) out[j][cb][i] = 0.0f;
    for (int grp = warp; grp < NG; grp += 2 * INT4_WARPS) {
        int grp2 = grp + INT4_WARPS;
        bool two = grp2 < NG;
        uint4 wq[S][2 * TILES];
#pragma unroll
        for (int j = 0; j < S; j++) {
            bool live = strip0 + j < strips;
            const uint4* nib = (const uint4*)(w + (size_t)(strip0 + j) * 16 * (K / 2)) + lane;
#pragma unroll
            for (int i = 0; i < 2 * TILES; i++) {
                int kt = (i < TILES ? grp : grp2 - 1) * TILES + i;
                wq[j][i] = (live && (i < TILES || two)) ? __ldcs(nib + (size_t)kt * 32)
                                                         : make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (h == 1 && !two) break;
            int gi = h ? grp2 : grp;
            float2 pa[S], pb[S];
#pragma unroll
            for (int j = 0; j < S; j++) {
                bool live = strip0 + j < strips;
                size_t row = (size_t)(strip0 + j) * 16 + g;
                pa[j] = live ? __half22float2(*(const __half2*)(params + row * NG + gi))
                             : make_float2(0.0f, 0.0f);
                pb[j] = live ? __half22float2(*(const __half2*)(params + (row + 8) * NG + gi))
                             : make_float2(0.0f, 0.0f);
            }
#pragma unroll
            for (int cb = 0; cb < NB; cb++) {
                if (8 * cb >= M) break;  // the same for the whole warp
                int mb = 8 * cb + g;     // this lane's B column: activation row mb
                float c[S][4];
#pragma unroll
                for (int j = 0; j < S; j++)
#pragma unroll
                    for (int i = 0; i < 4; i++) c[j][i] = 0.0f;
#pragma unroll
                for (int i = 0; i < TILES; i++) {
                    size_t at = (((size_t)(gi * TILES + i) * M + mb) * 4 + t) * 4;
                    uint4 hb[2] = {mb < M ? xf[at] : make_uint4(0, 0, 0, 0),
                                   mb < M ? xf[at + 1] : make_uint4(0, 0, 0, 0)};
                    const unsigned* hw = (const unsigned*)hb;
#pragma unroll
                    for (int j = 0; j < S; j++) int4_tile_steps(c[j], wq[j][h * TILES + i], hw);
                }
                int r0 = 8 * cb + 2 * t;
                float s0 = r0 < M ? sx[(size_t)r0 * NG + gi] : 0.0f;
                float s1 = r0 + 1 < M ? sx[(size_t)(r0 + 1) * NG + gi] : 0.0f;
#pragma unroll
                for (int j = 0; j < S; j++) {
                    out[j][cb][0] += pa[j].x * (c[j][0] - 128.0f * s0) + pa[j].y * s0;
                    out[j][cb][1] += pa[j].x * (c[j][1] - 128.0f * s1) + pa[j].y * s1;
                    out[j][cb][2] += pb[j].x * (c[j][2] - 128.0f * s0) + pb[j].y * s0;
                    out[j][cb][3] += pb[j].x * (c[j][3] - 128.0f * s1) + pb[j].y * s1;
                }
            }
        }
    }
    strips_out<NB, S, INT4_WARPS>(red, out, o, M, strip0, strips);
}

#define GEMM_INT4(G, NB)                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * INT4_WARPS)                           \
        gemm_int4_g##G##_nb##NB(const __nv_bfloat16* frag, const unsigned char* w, float* o0, \
                                float* o1, float* o2, int n0, int n1, int M, int N, int K) { \
        PDL_ENTER();                                                                          \
        gemm_int4_strips<G / 64, NB, STRIPS_A_BLOCK(NB)>(frag, w, Outs{o0, o1, o2, n0, n1, N},  \
                                                        M, K);                                \
    }

GEMM_INT4(64, 2)
GEMM_INT4(64, 4)
GEMM_INT4(64, 8)
GEMM_INT4(128, 2)
GEMM_INT4(128, 4)
GEMM_INT4(128, 8)

// Weight (row, col) of an int4 matrix of N rows of K.
__device__ __forceinline__ float int4_elem(const unsigned char* w, int N, int K, int G,
                                           long long row, int col) {
    long long strip = row >> 4;
    int rr = (int)(row & 15), g = rr & 7, hi = rr >> 3;
    int kt = col >> 6, cc = col & 63, s = cc >> 4, r = cc & 15;
    int h = r & 1, t = (r >> 1) & 3, j = hi | ((r >> 3) << 1), nib = j + 4 * h;
    const unsigned char* word =
        w + strip * 16 * (K / 2) + (size_t)kt * 512 + (4 * g + t) * 16 + 4 * s;
    unsigned q = (word[nib >> 1] >> (4 * (nib & 1))) & 0xf;
    const __half2 p = *(const __half2*)(w + (size_t)N * (K / 2) + (row * (K / G) + col / G) * 4);
    float2 dm = __half22float2(p);
    return (float)q * dm.x + dm.y;
}

// Strips of rows from row0 (a multiple of 16) of an int4 matrix as bf16
// rows (for a cuBLAS GEMM): a thread per 16-byte lane piece of a tile, its
// 32 weights as 16 bf16 pairs (rows g and g + 8, the pairs of its
// fragments).
extern "C" __global__ void dequant_int4_bf16(const unsigned char* w, __nv_bfloat16* dst,
                                             long long row0, long long pieces, int N, int K,
                                             int G) {
    PDL_ENTER();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= pieces) return;
    int T = K / 64, lane = (int)(i & 31), kt = (int)((i >> 5) % T);
    long long strip = row0 / 16 + (i >> 5) / T;
    uint4 v = *(const uint4*)(w + strip * 16 * (K / 2) + (size_t)kt * 512 + lane * 16);
    unsigned ws[4] = {v.x, v.y, v.z, v.w};
    int g = lane >> 2, t = lane & 3, grp = kt * 64 / G;
    const __half2* params = (const __half2*)(w + (size_t)N * (K / 2));
    long long rows[2] = {strip * 16 + g, strip * 16 + g + 8};
    float2 dm[2] = {__half22float2(params[rows[0] * (K / G) + grp]),
                    __half22float2(params[rows[1] * (K / G) + grp])};
#pragma unroll
    for (int s = 0; s < 4; s++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int h = j & 1;
            float lo = (float)((ws[s] >> (4 * j)) & 0xf), hi = (float)((ws[s] >> (4 * j + 16)) & 0xf);
            __nv_bfloat162 pair =
                __floats2bfloat162_rn(lo * dm[h].x + dm[h].y, hi * dm[h].x + dm[h].y);
            int col = kt * 64 + 16 * s + 2 * t + 8 * (j >> 1);
            *(__nv_bfloat162*)(dst + (rows[h] - row0) * K + col) = pair;
        }
}

// out[t] = row ids[t] of an int4 table of N rows of `cols`. One block per token.
extern "C" __global__ void embed_int4(const unsigned char* w, const unsigned* ids, float* out,
                                      int N, int cols, int G) {
    PDL_ENTER();
    float* o = out + (size_t)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x)
        o[i] = int4_elem(w, N, cols, G, ids[blockIdx.x], i);
}
