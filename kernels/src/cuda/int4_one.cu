// One activation row (decode at one sequence) against int4 tiles in one
// launch, where gemv_int4 takes two (int4_xfrag, then the GEMV). Here:
// - a lane's first batch of weight tiles and their groups' (d, m) load
//   before the PDL wait: weights depend on no earlier kernel, so they
//   stream while the kernel before this one finishes;
// - each warp reads only its own groups of x (a float4 or float2 a lane),
//   splits them into bf16 hi + lo as int4_xfrag does, sums each group with
//   a warp sum, and lays the B fragments out in its own shared memory, from
//   where the four lanes whose MMA column is activation row 0 read them;
// - the next batch's tiles load while this batch's MMAs run.
// A block per strip of 16 rows; its warps take the groups in turn.

// Groups a warp takes at once (a batch): their weight tiles stay in flight.
#define INT4_ONE_GROUPS 2

template <int TILES>
__device__ __forceinline__ void int4_one_batch(uint4* wq, unsigned* pa, unsigned* pb,
                                               const StripPtrs& sp, int warp, int first,
                                               int mine) {
    constexpr int GB = INT4_ONE_GROUPS;
#pragma unroll
    for (int j = 0; j < GB; j++) {
        int n = first + j;
        bool live = n < mine;
        int gi = warp + n * INT4_WARPS;
#pragma unroll
        for (int i = 0; i < TILES; i++)
            wq[j * TILES + i] =
                live ? __ldcs(sp.nib + (size_t)(gi * TILES + i) * 32) : make_uint4(0, 0, 0, 0);
        pa[j] = live ? sp.p0[gi] : 0u;
        pb[j] = live ? sp.p1[gi] : 0u;
    }
}

// This lane's G / 32 columns of group gi of x, split into bf16 hi + lo
// words at their places among the group's B fragments in `frag` (a tile
// holds 4 t x 16 words: 8 of hi, then 8 of lo); returns the group's sum of
// hi + lo (every lane gets it).
template <int TILES>
__device__ __forceinline__ float int4_one_stage(const float* x, unsigned* frag, int gi,
                                                int lane) {
    constexpr int PER = 2 * TILES;  // columns a lane: 4 (G = 128) or 2
    int c0 = lane * PER;            // within the group
    float v[4];
    if constexpr (PER == 4) {
        float4 q = *(const float4*)(x + gi * 64 * TILES + c0);
        v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
        float2 q = *(const float2*)(x + gi * 64 * TILES + c0);
        v[0] = q.x, v[1] = q.y;
    }
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

template <int TILES>
__device__ void gemv_int4_one_strip(const float* x, const unsigned char* w, Outs o, int K) {
    constexpr int GB = INT4_ONE_GROUPS;
    // Each warp's B fragments for one batch: GB groups of TILES tiles.
    __shared__ __align__(16) unsigned frags[INT4_WARPS][GB * TILES * 64];
    __shared__ float red[INT4_WARPS][8][2];
    const int G = 64 * TILES, NG = K / G;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    StripPtrs sp = strip_ptrs(w, blockIdx.x, o.n, K, NG, lane);
    // This warp's groups are warp, warp + INT4_WARPS, ...: `mine` of them.
    int mine = warp < NG ? (NG - warp + INT4_WARPS - 1) / INT4_WARPS : 0;
    unsigned* frag = frags[warp];
    uint4 wq[GB * TILES];
    unsigned pa[GB], pb[GB];
    PDL_LAUNCH();
    int4_one_batch<TILES>(wq, pa, pb, sp, warp, 0, mine);
    PDL_WAIT();
    float acc0 = 0.0f, acc8 = 0.0f;  // rows g and g + 8 (lanes t == 0)
    for (int first = 0; first < mine; first += GB) {
        float sums[GB];
#pragma unroll
        for (int j = 0; j < GB; j++)
            sums[j] = first + j < mine
                          ? int4_one_stage<TILES>(x, frag + j * TILES * 64,
                                                  warp + (first + j) * INT4_WARPS, lane)
                          : 0.0f;
        __syncwarp();
        uint4 nq[GB * TILES];
        unsigned na[GB], nb[GB];
        int4_one_batch<TILES>(nq, na, nb, sp, warp, first + GB, mine);
#pragma unroll
        for (int j = 0; j < GB; j++) {
            if (first + j >= mine) break;  // the same for the whole warp
            float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int i = 0; i < TILES; i++) {
                uint4 hw[4] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0),
                               make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
                if (g == 0) {
                    const uint4* tw = (const uint4*)(frag + ((j * TILES + i) * 4 + t) * 16);
#pragma unroll
                    for (int q = 0; q < 4; q++) hw[q] = tw[q];
                }
                int4_tile_mma(c, wq[j * TILES + i], (const unsigned*)hw);
            }
            float s0 = sums[j];
            float2 da = __half22float2(*(const __half2*)&pa[j]);
            float2 db = __half22float2(*(const __half2*)&pb[j]);
            acc0 += da.x * (c[0] - 128.0f * s0) + da.y * s0;
            acc8 += db.x * (c[2] - 128.0f * s0) + db.y * s0;
        }
        __syncwarp();  // the fragments are read before the next batch's land
#pragma unroll
        for (int i = 0; i < GB * TILES; i++) wq[i] = nq[i];
#pragma unroll
        for (int j = 0; j < GB; j++) {
            pa[j] = na[j];
            pb[j] = nb[j];
        }
    }
    if (t == 0) {
        red[warp][g][0] = acc0;
        red[warp][g][1] = acc8;
    }
    __syncthreads();
    if (warp != 0 || t != 0) return;
    for (int v = 1; v < INT4_WARPS; v++) {
        acc0 += red[v][g][0];
        acc8 += red[v][g][1];
    }
    int row = blockIdx.x * 16 + g;
    put_out(o, 0, row, acc0);
    put_out(o, 0, row + 8, acc8);
}

#define GEMV_INT4_ONE(G)                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * INT4_WARPS, 3)                        \
        gemv_int4_one_g##G(const float* x, const unsigned char* w, float* o0, float* o1,     \
                           float* o2, int n0, int n1, int N, int K) {                        \
        gemv_int4_one_strip<G / 64>(x, w, Outs{o0, o1, o2, n0, n1, N}, K);                   \
    }

GEMV_INT4_ONE(64)
GEMV_INT4_ONE(128)
