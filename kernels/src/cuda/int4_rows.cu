// A few activation rows (decode of 2 to 8 sequences) against int4 tiles in
// one launch. Where gemv_int4 runs a block per strip on fragments that
// int4_xfrag wrote, every block reading all M rows' fragments from L2 (at
// eight rows four times its weight bytes), this is the one-row kernel's
// block (int4_one.cu: two strips, weight batches a batch ahead in
// registers, loaded before the PDL wait) with more of the MMA's eight
// columns in use:
// - hi and lo of row m ride in columns 2m and 2m + 1, rows 4..7 in a
//   second MMA on the same A registers, so four rows cost the MMAs one row
//   does and eight twice that; lane t's outputs are then row t's (and
//   row 4 + t's), with no shuffle;
// - each warp's rows of x for its next group land by cp.async in shared
//   memory a batch ahead (eight rows in registers a batch ahead would
//   spill), and the warp splits them into bf16 hi + lo fragments there;
// - a group's sums of x (which take the MMAs' 128 a quant back out) come
//   from one more MMA a step on the same B words, whose A is all ones:
//   lane t gets row t's sum where it needs it.

// The bf16 pair (1, 1): the A operand that sums B's columns.
#define INT4_ROWS_ONES 0x3F803F80u

// Shared memory a warp takes at MR rows of groups of G: its rows of x for
// one group (MR x G floats), then their B fragments (MR x G words).
#define INT4_ROWS_WARP_FLOATS(MR, G) (2 * (MR) * (G))

// A lane's places, fixed for the kernel: where its next group's columns
// of x's first row are (`src`, moved a group of the warp's on by each
// fetch), where they land (`dst`, a shared-memory address, and `row`, the
// same place as a pointer) and where its stage writes (`base`, a block
// plus the word `half`, and the swizzles f0 and f1 of its two pairs'
// blocks, int4_rows_lane).
struct Int4RowsLane {
    const float* src;
    unsigned dst;
    const float* row;
    int base, f0, f1;
};

// Starts the copies of this lane's columns of its warp's next group of x's
// M rows into xs (G floats a row; the lane reads back only its own
// columns), then moves `src` to the group after, W groups on.
template <int TILES, int W>
__device__ __forceinline__ void int4_rows_fetch(Int4RowsLane& l, int K, int M) {
    constexpr int PER = 2 * TILES, G = 64 * TILES;
    const float* src = l.src;
#pragma unroll 2
    for (int m = 0; m < M; m++, src += K) cp_async<PER * 4>(l.dst + m * G * 4, src);
    cp_commit();
    l.src += W * G;
}

// Where B word `half` (b0 or b1) of column n of MMA set nb lies for step s
// of tile i and lanes t: a (tile, step, t) block holds 8 columns of NB x 2
// words (a lane's words of a step lie together: one 8- or 16-byte load),
// the columns XOR-swizzled by (s ^ 2 t) % 8, so the lanes of each phase of
// a step's loads (a quarter warp at 16 bytes, a half at 8) fall in
// distinct banks and a stage's 32 stores of one row in 16.
template <int NB>
__device__ __forceinline__ int int4_rows_block(int i, int s, int t) {
    return ((i * 4 + s) * 4 + t) * 16 * NB;
}
__device__ __forceinline__ int int4_rows_swizzle(int s, int t) { return (s ^ (2 * t)) & 7; }

// A lane's places (Int4RowsLane) at the start: its columns of group `warp`
// of x and of xs, and where its stage writes: its first pair of columns'
// (tile, step, t) block plus the word `half` of it and that block's
// swizzle f0; at groups of 128 its second pair (two columns on) lies in
// the next t's block, of swizzle f1.
template <int TILES, int NB>
__device__ __forceinline__ Int4RowsLane int4_rows_lane(const float* x, const float* xs, int warp,
                                                       int lane) {
    constexpr int PER = 2 * TILES, G = 64 * TILES;
    int c = lane * PER, i = c >> 6, cc = c & 63;
    int s = cc >> 4, r = cc & 15, t = (r >> 1) & 3, half = r >> 3;
    const float* row = xs + lane * PER;
    return {x + (size_t)warp * G + lane * PER,
            (unsigned)__cvta_generic_to_shared(row),
            row,
            int4_rows_block<NB>(i, s, t) + half,
            int4_rows_swizzle(s, t),
            int4_rows_swizzle(s, t + 1)};
}

// (x, y) as a bf16 pair (round to nearest), and what each leaves over:
// pack_split's, reading the halves back by a shift and a mask where
// __low2float and __high2float take a byte permute and a multiply each.
__device__ __forceinline__ unsigned int4_rows_split(float x, float y, float& rx, float& ry) {
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    unsigned w = *(unsigned*)&h;
    rx = x - __uint_as_float(w << 16);
    ry = y - __uint_as_float(w & 0xffff0000u);
    return w;
}

// This lane's columns of the group's rows (in xs) split into bf16 hi + lo
// pairs at their places among the B fragments: row m's hi in column
// 2 (m % 4) of MMA set m / 4, its lo in the column after; a word holds
// columns (rows of B) 2 t, 2 t + 1 of a step (b0) or 2 t + 8, 2 t + 9 (b1).
template <int TILES, int MR>
__device__ __forceinline__ void int4_rows_stage(unsigned* frag, int M, const Int4RowsLane& at) {
    constexpr int PER = 2 * TILES, G = 64 * TILES, NB = MR / 4;
    const float* row = at.row;
#pragma unroll 1
    for (int m = 0; m < M; m++, row += G) {
        float v[PER];
        if constexpr (TILES == 2) {
            float4 q = *(const float4*)row;
            v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
        } else {
            float2 q = *(const float2*)row;
            v[0] = q.x, v[1] = q.y;
        }
        // Row m's hi column n is even, so its lo column's swizzled place is
        // the hi's with the low bit flipped.
        int n = 2 * (m & 3), set = (m >> 2) * 2 + at.base;
#pragma unroll
        for (int p = 0; p < PER; p += 2) {
            float rx, ry, lx, ly;
            unsigned hi = int4_rows_split(v[p], v[p + 1], rx, ry);
            unsigned lo = int4_rows_split(rx, ry, lx, ly);
            // The second pair: the next t's block.
            int col = n ^ (p ? at.f1 : at.f0), block = set + p / 2 * 16 * NB;
            frag[block + col * 2 * NB] = hi;
            frag[block + (col ^ 1) * 2 * NB] = lo;
        }
    }
}

// One tile's four k steps for this lane (g, t), for both strips (A: the
// tiles w0's and w1's dequantized pairs) against its B words of each MMA
// set (column g: row 4 nb + g / 2 of x, hi for even g, lo for odd), read
// a step at a time (a tile's at once would spill at eight rows), and the
// MMA whose A is all ones that sums each set's columns into cs. `lane_frag`
// is frag at this lane's t block, `u` its swizzled column at step 0 in words:
// ((g ^ 2 t) % 8) 2 NB, so step s's is u ^ 2 NB s (int4_rows_swizzle).
template <int NB>
__device__ __forceinline__ void int4_tile_rows(float (*c0)[4], float (*c1)[4], float (*cs)[4],
                                               const uint4& w0, const uint4& w1,
                                               const unsigned* lane_frag, int u, int i) {
    unsigned ws0[4] = {w0.x, w0.y, w0.z, w0.w}, ws1[4] = {w1.x, w1.y, w1.z, w1.w};
#pragma unroll
    for (int s = 0; s < 4; s++) {
        const unsigned* at = lane_frag + int4_rows_block<NB>(i, s, 0) + (u ^ (2 * NB * s));
        uint2 b[NB];
        if constexpr (NB == 2) {
            uint4 q = *(const uint4*)at;
            b[0] = make_uint2(q.x, q.y);
            b[1] = make_uint2(q.z, q.w);
        } else {
            b[0] = *(const uint2*)at;
        }
        unsigned a0 = int4_pair(ws0[s], 0), a1 = int4_pair(ws0[s], 1);
        unsigned a2 = int4_pair(ws0[s], 2), a3 = int4_pair(ws0[s], 3);
#pragma unroll
        for (int nb = 0; nb < NB; nb++) mma16<false>(c0[nb], a0, a1, a2, a3, b[nb].x, b[nb].y);
        a0 = int4_pair(ws1[s], 0), a1 = int4_pair(ws1[s], 1);
        a2 = int4_pair(ws1[s], 2), a3 = int4_pair(ws1[s], 3);
#pragma unroll
        for (int nb = 0; nb < NB; nb++) mma16<false>(c1[nb], a0, a1, a2, a3, b[nb].x, b[nb].y);
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
            mma16<false>(cs[nb], INT4_ROWS_ONES, INT4_ROWS_ONES, INT4_ROWS_ONES, INT4_ROWS_ONES,
                         b[nb].x, b[nb].y);
    }
}

// One batch (the warp's b-th group, both strips): stage its rows of x,
// start the next batch's weights and x, then its MMAs; acc[r][nb] holds
// rows g and g + 8 of strip r for activation row 4 nb + t.
template <int TILES, int W, int MR>
__device__ __forceinline__ void int4_rows_step(const Int4OneBatch<TILES, 2>& cur,
                                               Int4OneBatch<TILES, 2>& next, int M, int K,
                                               unsigned* frag, Int4OneRows& rw, Int4RowsLane& at,
                                               float2 (*acc)[MR / 4], int warp, int lane, int b,
                                               int mine) {
    constexpr int R = 2, NB = MR / 4;
    // The wait is no compiler fence: the warp barrier keeps the stage's
    // loads of xs after it (and, at the first batch, its stores after the
    // zeroing of frag).
    cp_wait<0>();
    __syncwarp();
    int4_rows_stage<TILES, MR>(frag, M, at);
    __syncwarp();
    // xs is free once the stage has read it (this lane's own columns).
    int4_one_load<TILES, R, W>(next, rw, nullptr, warp, lane, b + 1, mine);
    if (b + 1 < mine) int4_rows_fetch<TILES, W>(at, K, M);
    int g = lane >> 2, t = lane & 3;
    float c[R][NB][4], cs[NB][4];
#pragma unroll
    for (int nb = 0; nb < NB; nb++) {
        cs[nb][0] = cs[nb][1] = cs[nb][2] = cs[nb][3] = 0.0f;
#pragma unroll
        for (int r = 0; r < R; r++) c[r][nb][0] = c[r][nb][1] = c[r][nb][2] = c[r][nb][3] = 0.0f;
    }
    const unsigned* lane_frag = frag + int4_rows_block<NB>(0, 0, t);
    int u = ((g ^ (2 * t)) & 7) * 2 * NB;
#pragma unroll
    for (int i = 0; i < TILES; i++)
        int4_tile_rows<NB>(c[0], c[1], cs, cur.wq[0][0][i], cur.wq[0][1][i], lane_frag, u, i);
#pragma unroll
    for (int r = 0; r < R; r++) {
        float2 da = __half22float2(*(const __half2*)&cur.pa[0][r]);
        float2 db = __half22float2(*(const __half2*)&cur.pb[0][r]);
#pragma unroll
        for (int nb = 0; nb < NB; nb++) {
            // Columns 2 t and 2 t + 1: row 4 nb + t's hi and lo.
            float s0 = cs[nb][0] + cs[nb][1];
            acc[r][nb].x += da.x * ((c[r][nb][0] + c[r][nb][1]) - 128.0f * s0) + da.y * s0;
            acc[r][nb].y += db.x * ((c[r][nb][2] + c[r][nb][3]) - 128.0f * s0) + db.y * s0;
        }
    }
    __syncwarp();  // the fragments are read before the next stage writes them
}

template <int TILES, int W, int MR>
__device__ void gemv_int4_rows_strips(const float* x, const unsigned char* w, Outs o, int M,
                                      int K) {
    constexpr int R = 2, G = 64 * TILES, NB = MR / 4;
    static_assert(Int4OneBatch<TILES, R>::GB == 1, "a batch of one group at two strips");
    __shared__ float2 red[W][R][NB][32];
    extern __shared__ __align__(16) float int4_rows_smem[];
    const int NG = K / G, strips = o.n / 16;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float* xs = int4_rows_smem + warp * INT4_ROWS_WARP_FLOATS(MR, G);
    unsigned* frag = (unsigned*)(xs + MR * G);
    int strip0 = blockIdx.x * R;
    StripPtrs sp = strip_ptrs(w, strip0, o.n, K, NG, lane);
    bool second = strip0 + 1 < strips;
    Int4OneRows rw{sp.nib + warp * TILES * 32, sp.p0 + warp, second ? K / 2 : 0,
                   second ? 16 * NG : 0, 8 * NG};
    // This warp's groups are warp, warp + W, ...: `mine` of them, a batch
    // each.
    int mine = warp < NG ? (NG - warp + W - 1) / W : 0;
    // Rows past M are never staged; their columns' results are never read
    // (an MMA's column of D reads only its column of B), but their
    // fragments hold zeros rather than what shared memory held. The first
    // step's warp barrier orders these stores before its stage's.
    if (M < MR)
        for (int i = lane; i < MR * G; i += 32) frag[i] = 0u;
    Int4OneBatch<TILES, R> b0, b1;
    PDL_LAUNCH();
    // Weights and their scales depend on no earlier kernel.
    int4_one_load<TILES, R, W>(b0, rw, nullptr, warp, lane, 0, mine);
    PDL_WAIT();
    Int4RowsLane at = int4_rows_lane<TILES, NB>(x, xs, warp, lane);
    if (mine > 0) int4_rows_fetch<TILES, W>(at, K, M);
    float2 acc[R][NB];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int nb = 0; nb < NB; nb++) acc[r][nb] = make_float2(0.0f, 0.0f);
    for (int b = 0; b < mine; b += 2) {
        int4_rows_step<TILES, W, MR>(b0, b1, M, K, frag, rw, at, acc, warp, lane, b, mine);
        if (b + 1 >= mine) break;
        int4_rows_step<TILES, W, MR>(b1, b0, M, K, frag, rw, at, acc, warp, lane, b + 1,
                                     mine);
    }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int nb = 0; nb < NB; nb++) red[warp][r][nb][lane] = acc[r][nb];
    __syncthreads();
    // Warp 0 adds the warps' sums: lane (g, t) those of rows g and g + 8 of
    // each strip for activation rows t and 4 + t.
    if (warp != 0) return;
#pragma unroll
    for (int r = 0; r < R; r++) {
        int strip = strip0 + r;
        if (strip >= strips) break;
#pragma unroll
        for (int nb = 0; nb < NB; nb++) {
            int m = 4 * nb + t;
            if (m >= M) continue;
            float2 s = red[0][r][nb][lane];
            for (int v = 1; v < W; v++) {
                s.x += red[v][r][nb][lane].x;
                s.y += red[v][r][nb][lane].y;
            }
            put_out(o, m, strip * 16 + g, s.x);
            put_out(o, m, strip * 16 + g + 8, s.y);
        }
    }
}

// Up to MR rows (4: one MMA a step; 8: two), two strips a block, eight
// warps (two blocks an SM) or sixteen (one: grids of at most a wave, as
// the one-row kernel takes them); int4.rs sizes the dynamic shared memory.
#define GEMV_INT4_ROWS(MR, G, W)                                                              \
    extern "C" __global__ void __launch_bounds__(32 * W, (W) == 16 ? 1 : 2)                  \
        gemv_int4_rows##MR##_g##G##_w##W(const float* x, const unsigned char* w, float* o0,  \
                                         float* o1, float* o2, int n0, int n1, int M, int N, \
                                         int K) {                                            \
        gemv_int4_rows_strips<G / 64, W, MR>(x, w, Outs{o0, o1, o2, n0, n1, N}, M, K);       \
    }

GEMV_INT4_ROWS(4, 64, 8)
GEMV_INT4_ROWS(4, 64, 16)
GEMV_INT4_ROWS(4, 128, 8)
GEMV_INT4_ROWS(4, 128, 16)
GEMV_INT4_ROWS(8, 64, 8)
GEMV_INT4_ROWS(8, 64, 16)
GEMV_INT4_ROWS(8, 128, 8)
GEMV_INT4_ROWS(8, 128, 16)
