// One activation row (decode at one sequence) against int4 tiles in one
// launch, where gemv_int4 takes two (int4_xfrag, then the GEMV). At one
// row the product is bound by instructions as much as by bytes (Nsight
// Compute on the H200: ~105 a 512-byte tile with issue slots half busy,
// where streaming at copy bandwidth leaves ~130 at full issue), so all but
// dequantizing (int4_pair) and the MMA is paid once for many tiles:
// - a block takes R strips of 16 rows; each warp splits its own groups of
//   x into bf16 hi + lo (as int4_xfrag does) once for all R strips, and
//   reads a tile's B fragments from shared memory once for them too;
// - hi and lo ride in two columns of one MMA (column 0 hi, column 1 lo:
//   lanes g = 0 and g = 1 supply them, the other columns are never read),
//   so a weight word costs one MMA, not two;
// - a lane's first batch of weight tiles and their groups' (d, m) load
//   before the PDL wait: weights depend on no earlier kernel, so they
//   stream while the kernel before this one finishes; the next batch loads
//   while this one's MMAs run, in two register sets used in turn, and at
//   two strips its columns of x with it (a split that waited on its x
//   load stalled the warp: down 13.5 -> 10.6 us on the H200);
// (Weights through a ring of Hopper's bulk copies into shared memory, a
// ring of per-lane cp.asyncs and L2 prefetches all ran slower than these
// per-lane loads: docs/perf.md.)

// Groups a warp takes at once (a batch) at one strip a block; R strips
// take INT4_ONE_GROUPS / R, so a batch is 2 KB of weights a warp.
#define INT4_ONE_GROUPS 2

template <int TILES, int R>
struct Int4OneBatch {
    static constexpr int GB = INT4_ONE_GROUPS / R;
    // The lane's weight tiles and (d, m) of the batch.
    uint4 wq[GB][R][TILES];
    unsigned pa[GB][R], pb[GB][R];
    // At two strips (registers to spare) the lane's columns of x load a
    // batch ahead; at one they load as the split needs them.
    float xv[GB][2 * TILES];
};

// This lane's G / 32 columns of group gi of x (4 at G = 128, else 2).
template <int TILES>
__device__ __forceinline__ void int4_one_x(const float* x, int gi, int lane, float* v) {
    const float* p = x + gi * 64 * TILES + lane * 2 * TILES;
    if constexpr (TILES == 2) {
        float4 q = *(const float4*)p;
        v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
        float2 q = *(const float2*)p;
        v[0] = q.x, v[1] = q.y;
    }
}

// Where a lane's next loads are: its 16 bytes of strip 0's tiles of the
// warp's next group at `nib` (strip r's r * step uint4 further) and the
// group's (d, m) of row g of strip 0 at `p` (strip r's r * pstep words
// further, rows g + 8 at 8 NG); step and pstep are 0 where a block's
// second strip is past the last, which is then read again.
struct Int4OneRows {
    const uint4* nib;
    const unsigned* p;
    int step, pstep, ng8;
};

// Loads a batch and moves `rw` past it (a group of W warps further).
template <int TILES, int R, int W>
__device__ __forceinline__ void int4_one_load(Int4OneBatch<TILES, R>& b, Int4OneRows& rw,
                                              const float* x, int warp, int lane, int first,
                                              int mine) {
    constexpr int GB = Int4OneBatch<TILES, R>::GB;
#pragma unroll
    for (int j = 0; j < GB; j++) {
        bool live = first + j < mine;
        if (R > 1 && live && x) int4_one_x<TILES>(x, warp + (first + j) * W, lane, b.xv[j]);
#pragma unroll
        for (int r = 0; r < R; r++) {
#pragma unroll
            for (int i = 0; i < TILES; i++)
                b.wq[j][r][i] =
                    live ? __ldcs(rw.nib + r * rw.step + i * 32) : make_uint4(0, 0, 0, 0);
            b.pa[j][r] = live ? rw.p[r * rw.pstep] : 0u;
            b.pb[j][r] = live ? rw.p[r * rw.pstep + rw.ng8] : 0u;
        }
        rw.nib += W * TILES * 32;
        rw.p += W;
    }
}

// This lane's G / 32 columns of group gi of x (in v) split into bf16 hi +
// lo words at their places among the group's B fragments in `frag` (a
// tile holds 4 t x 16 words: 8 of hi, then 8 of lo); returns the group's
// sum of hi + lo (every lane gets it).
template <int TILES>
__device__ __forceinline__ float int4_one_stage(const float* v, unsigned* frag, int lane) {
    constexpr int PER = 2 * TILES;  // columns a lane: 4 (G = 128) or 2
    int c0 = lane * PER;            // within the group
    float sum = 0.0f;
#pragma unroll
    for (int p = 0; p < PER; p += 2) {
        int c = c0 + p, i = c >> 6, cc = c & 63;
        int s = cc >> 4, r = cc & 15, t = (r >> 1) & 3, half = r >> 3;
        float rx, ry, lx, ly;
        unsigned hi = pack_split<false>(v[p], v[p + 1], rx, ry);
        unsigned lo = pack_split<false>(rx, ry, lx, ly);
        sum += (v[p] - rx) + (v[p + 1] - ry) + (rx - lx) + (ry - ly);
        unsigned* tw = frag + (i * 4 + t) * 16;
        tw[2 * s + half] = hi;
        tw[8 + 2 * s + half] = lo;
    }
    return warp_sum(sum);
}

// One batch (b, the warp's groups from b GB): stage its groups of x, load
// the next batch (its x and weights) into `next`, then the MMAs of this
// one, from `cur`; acc[r] holds rows g and g + 8 of strip r (meaningful on
// lanes t == 0).
template <int TILES, int R, int W>
__device__ __forceinline__ void int4_one_step(const Int4OneBatch<TILES, R>& cur,
                                              Int4OneBatch<TILES, R>& next, const float* x,
                                              unsigned* frag, Int4OneRows& rw, float2* acc,
                                              int warp, int lane, int b, int mine) {
    constexpr int GB = Int4OneBatch<TILES, R>::GB;
    int first = b * GB;
    float sums[GB];
#pragma unroll
    for (int j = 0; j < GB; j++) {
        if (first + j >= mine) {
            sums[j] = 0.0f;
            continue;
        }
        float v[2 * TILES];
        if constexpr (R > 1) {
#pragma unroll
            for (int c = 0; c < 2 * TILES; c++) v[c] = cur.xv[j][c];
        } else {
            int4_one_x<TILES>(x, warp + (first + j) * W, lane, v);
        }
        sums[j] = int4_one_stage<TILES>(v, frag + j * TILES * 64, lane);
    }
    __syncwarp();
    int4_one_load<TILES, R, W>(next, rw, x, warp, lane, first + GB, mine);
    // Column g of B: hi for g != 1 (only g = 0 is read back), lo for g = 1.
    int g = lane >> 2, t = lane & 3, part = (g == 1) ? 8 : 0;
#pragma unroll
    for (int j = 0; j < GB; j++) {
        if (first + j >= mine) break;  // the same for the whole warp
        float c[R][4];
#pragma unroll
        for (int r = 0; r < R; r++) c[r][0] = c[r][1] = c[r][2] = c[r][3] = 0.0f;
#pragma unroll
        for (int i = 0; i < TILES; i++) {
            const uint4* tw = (const uint4*)(frag + ((j * TILES + i) * 4 + t) * 16 + part);
            uint4 b0 = tw[0], b1 = tw[1];
            unsigned bw[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int r = 0; r < R; r++) int4_tile_steps(c[r], cur.wq[j][r][i], bw);
        }
        float s0 = sums[j];
#pragma unroll
        for (int r = 0; r < R; r++) {
            unsigned pa = cur.pa[j][r], pb = cur.pb[j][r];
            float2 da = __half22float2(*(const __half2*)&pa);
            float2 db = __half22float2(*(const __half2*)&pb);
            acc[r].x += da.x * ((c[r][0] + c[r][1]) - 128.0f * s0) + da.y * s0;
            acc[r].y += db.x * ((c[r][2] + c[r][3]) - 128.0f * s0) + db.y * s0;
        }
    }
    __syncwarp();  // the fragments are read before they refill
}

// What a folded decode step (fold.rs, gemv_norm.cu) adds to the product:
// with `sums`, the input is g * h of a norm whose factor comes from the
// `parts` partial sums of h^2 there (each block adds them up after the
// wait) and scales every output; with `pair`, block b takes strip b of
// the gate half and strip b of the up half of a gate/up stack (R = 2) and
// writes silu(gate) * up of its 16 rows to o0; with `h`, the product adds
// into h and writes gh = gn * h for the next norm's weights gn and the
// block's sum of h^2 to psum[block].
struct Int4OneFold {
    const float* sums;
    int parts;
    float eps;
    int pair;
    float* h;
    const float* gn;
    float* gh;
    float* psum;
};

// What warp 0 of a folded product loads right after the wait, so it lands
// while the products run (loaded at the end, it cost each block dependent
// L2 round trips after its products, a wave at a time): the norm's first
// partial sums (lane, lane + 32, ...), and at lanes t == 0 the residual's
// h and next-norm weights of rows g and g + 8 of each strip.
#define INT4_FOLD_EARLY 4
template <int R>
struct Int4FoldEarly {
    float sums[INT4_FOLD_EARLY];
    float h[R][2], gn[R][2];
};

// A volatile load: the compiler sinks plain ones to their use, past the
// products.
__device__ __forceinline__ float ld_early(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

template <int R>
__device__ __forceinline__ void int4_fold_early(const Int4OneFold& f, Int4FoldEarly<R>& e,
                                                int strip0, int strips) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < INT4_FOLD_EARLY; j++) {
        int i = lane + 32 * j;
        e.sums[j] = f.sums && i < f.parts ? ld_early(f.sums + i) : 0.0f;
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
#pragma unroll
        for (int k = 0; k < 2; k++) {
            int row = (strip0 + r) * 16 + g + 8 * k;
            bool mine = f.h && t == 0 && strip0 + r < strips;
            e.h[r][k] = mine ? ld_early(f.h + row) : 0.0f;
            e.gn[r][k] = mine ? ld_early(f.gn + row) : 0.0f;
        }
    }
}

// Rows g and g + 8 of strip r, summed over the block's W warps in `red`.
template <int R, int W>
__device__ __forceinline__ float2 int4_one_rows(float2 (*red)[R][8], int r, int g) {
    float2 s = red[0][r][g];
    for (int v = 1; v < W; v++) {
        s.x += red[v][r][g].x;
        s.y += red[v][r][g].y;
    }
    return s;
}

// The folded ending (warp 0, after the block's sums meet in `red`): every
// lane adds the warps' sums of its rows, scales them by the norm's factor
// (from the partial sums loaded early, and any past them), then lanes
// t == 0 write rows g and g + 8 of each strip as `f` says.
template <int R, int W>
__device__ __forceinline__ void int4_one_fold_out(float2 (*red)[R][8], const Int4OneFold& f,
                                                  const Int4FoldEarly<R>& early, const Outs& o,
                                                  int K, int strip0, int strips) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float fac = 1.0f;
    if (f.sums) {
        float v = 0.0f;
#pragma unroll
        for (int j = 0; j < INT4_FOLD_EARLY; j++) v += early.sums[j];
        for (int i = lane + 32 * INT4_FOLD_EARLY; i < f.parts; i += 32) v += f.sums[i];
        fac = norm_factor(warp_sum(v), K, f.eps);
    }
    float2 s[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        s[r] = int4_one_rows<R, W>(red, r, g);
        s[r].x *= fac;
        s[r].y *= fac;
    }
    if (f.pair) {
        if (t == 0) {
            o.o0[strip0 * 16 + g] = silu_times(s[0].x, s[R - 1].x);
            o.o0[strip0 * 16 + g + 8] = silu_times(s[0].y, s[R - 1].y);
        }
        return;
    }
    float ss = 0.0f;
#pragma unroll
    for (int r = 0; r < R; r++) {
        int strip = strip0 + r;
        if (strip >= strips || t != 0) continue;
        float v[2] = {s[r].x, s[r].y};
#pragma unroll
        for (int e = 0; e < 2; e++) {
            int row = strip * 16 + g + 8 * e;
            if (f.h) {
                float hn = early.h[r][e] + v[e];
                f.h[row] = hn;
                f.gh[row] = early.gn[r][e] * hn;
                ss += hn * hn;
            } else {
                put_out(o, 0, row, v[e]);
            }
        }
    }
    if (f.h) {
        ss = warp_sum(ss);
        if (lane == 0) f.psum[blockIdx.x] = ss;
    }
}

template <int TILES, int R, int W, bool FOLD>
__device__ void gemv_int4_one_strips(const float* x, const unsigned char* w, Outs o, int K,
                                     Int4OneFold f) {
    constexpr int GB = Int4OneBatch<TILES, R>::GB;
    // Each warp's B fragments for one batch: GB groups of TILES tiles.
    __shared__ __align__(16) unsigned frags[W][GB * TILES * 64];
    __shared__ float2 red[W][R][8];
    const int G = 64 * TILES, NG = K / G, strips = o.n / 16;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // A pair's second strip is the first's twin in the up half.
    bool pair = FOLD && f.pair;
    int strip0 = pair ? blockIdx.x : blockIdx.x * R, apart = pair ? strips / 2 : 1;
    StripPtrs sp = strip_ptrs(w, strip0, o.n, K, NG, lane);
    bool second = pair || strip0 + 1 < strips;
    Int4OneRows rw{sp.nib + warp * TILES * 32, sp.p0 + warp, second ? apart * (K / 2) : 0,
                   second ? apart * 16 * NG : 0, 8 * NG};
    // This warp's groups are warp, warp + W, ...: `mine` of them.
    int mine = warp < NG ? (NG - warp + W - 1) / W : 0;
    int batches = (mine + GB - 1) / GB;
    unsigned* frag = frags[warp];
    Int4OneBatch<TILES, R> b0, b1;
    PDL_LAUNCH();
    // Weights and their scales depend on no earlier kernel: their first
    // batches stream while the kernel before this one finishes.
    int4_one_load<TILES, R, W>(b0, rw, nullptr, warp, lane, 0, mine);
    PDL_WAIT();
    // The first batch's x, written by the kernel before: after the wait.
    static_assert(R == 1 || GB == 1, "a batch of one group at two strips");
    if (R > 1 && mine > 0) int4_one_x<TILES>(x, warp, lane, b0.xv[0]);
    Int4FoldEarly<R> early;
    if constexpr (FOLD) {
        if (warp == 0) int4_fold_early<R>(f, early, strip0, strips);
    }
    float2 acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = make_float2(0.0f, 0.0f);
    for (int b = 0; b < batches; b += 2) {
        int4_one_step<TILES, R, W>(b0, b1, x, frag, rw, acc, warp, lane, b, mine);
        if (b + 1 >= batches) break;
        int4_one_step<TILES, R, W>(b1, b0, x, frag, rw, acc, warp, lane, b + 1, mine);
    }
    if (t == 0) {
#pragma unroll
        for (int r = 0; r < R; r++) red[warp][r][g] = acc[r];
    }
    __syncthreads();
    if constexpr (FOLD) {
        if (warp == 0) int4_one_fold_out<R, W>(red, f, early, o, K, strip0, strips);
        return;
    }
    // Warp 0's lanes t == 0 add the warps' sums, one strip at a time.
    if (warp != 0 || t != 0) return;
#pragma unroll
    for (int r = 0; r < R; r++) {
        int strip = blockIdx.x * R + r;
        if (strip >= strips) break;
        float2 s = int4_one_rows<R, W>(red, r, g);
        put_out(o, 0, strip * 16 + g, s.x);
        put_out(o, 0, strip * 16 + g + 8, s.y);
    }
}

// Three blocks an SM at one strip (80 registers); two at two strips, whose
// second strip's tiles, scales and sums would not fit 80 without spilling
// (a spilled register that a load writes stalls the warp on that load).
// Sixteen warps a block (two strips, one block an SM, the same registers)
// for grids too small to put two blocks of eight on every SM: the warps
// an SM holds decide the bytes it keeps in flight.
#define INT4_ONE_BLOCKS(R, W) ((W) == 16 ? 1 : (R) == 1 ? 3 : 2)
#define GEMV_INT4_ONE(G, R, W)                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * W, INT4_ONE_BLOCKS(R, W))               \
        gemv_int4_one_g##G##_r##R##_w##W(const float* x, const unsigned char* w, float* o0,   \
                                         float* o1, float* o2, int n0, int n1, int N, int K) { \
        gemv_int4_one_strips<G / 64, R, W, false>(x, w, Outs{o0, o1, o2, n0, n1, N}, K,       \
                                                  Int4OneFold{});                             \
    }

GEMV_INT4_ONE(64, 1, 8)
GEMV_INT4_ONE(64, 2, 8)
GEMV_INT4_ONE(64, 2, 16)
GEMV_INT4_ONE(128, 1, 8)
GEMV_INT4_ONE(128, 2, 8)
GEMV_INT4_ONE(128, 2, 16)

// The folded products of a one-token step (Int4OneFold), two strips a
// block.
#define GEMV_INT4_FOLD(G, W)                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * W, INT4_ONE_BLOCKS(2, W))              \
        gemv_int4_fold_g##G##_w##W(const float* x, const unsigned char* w, float* o0,        \
                                   float* o1, float* o2, int n0, int n1, int N, int K,       \
                                   const float* sums, int parts, float eps, int pair,        \
                                   float* h, const float* gn, float* gh, float* psum) {      \
        gemv_int4_one_strips<G / 64, 2, W, true>(x, w, Outs{o0, o1, o2, n0, n1, N}, K,       \
                                                 Int4OneFold{sums, parts, eps, pair, h, gn,  \
                                                             gh, psum});                     \
    }

GEMV_INT4_FOLD(64, 8)
GEMV_INT4_FOLD(64, 16)
GEMV_INT4_FOLD(128, 8)
GEMV_INT4_FOLD(128, 16)
