// Causal prefill attention over paged KV on tensor cores (see prefill.rs), in
// the manner of FlashAttention-2. A block of W warps (4 or 8) takes up to
// 16 W query rows -- consecutive tokens of one sequence times the G query
// heads of one KV head, row r = (token r / G, head r % G) -- and streams that
// sequence's keys and values through shared memory PM_BN at a time, so each
// K and V vector is read once per tile and serves every head of its group.
//
// Each warp owns 16 rows. S = Q K^T and O += P V are m16n8k16 MMAs: bf16
// over bf16 pages; f16 over fp8 pages (f16 holds every e4m3 value exactly,
// and the per-vector scales multiply S's and P's columns in f32). The online
// softmax runs in the accumulators' registers (a lane holds rows g and g + 8
// of its warp's 16), and P goes from the S accumulators to the A operand of
// P V without leaving them. Q and P are rounded to 16 bits, as
// FlashAttention does; every sum is f32.
//
// Token t attends to keys 0..lens[t]-1. tiles: (first token, tokens) pairs
// of consecutive tokens that share one block table and have consecutive
// lengths (prefill_tiles), tokens x G <= 16 W. K of key tile j + 1 loads
// while P V of tile j runs, and V of tile j + 1 while its scores do: bf16
// pages by cp.async, fp8 pages into registers (converted to f16 on their
// way to shared memory once the tile there is free).

#define PM_BN 64

// (x, y) as two f16 (F16) or bf16 in one word, x in the low half.
template <bool F16>
__device__ __forceinline__ unsigned pack16(float x, float y) {
    if (F16) {
        __half2 h = __floats2half2_rn(x, y);
        return *(unsigned*)&h;
    }
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *(unsigned*)&h;
}

// Four 8x8 b16 matrices from shared memory, transposed: lanes 8m..8m+7 give
// the rows of matrix m.
__device__ __forceinline__ void ldsm_x4_trans(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// The same, not transposed: lane 4r + c gets elements 2c, 2c + 1 of row r
// of each matrix (the B fragments of K^T from rows of K).
__device__ __forceinline__ void ldsm_x4(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// One key tile in shared memory: 16-bit elements, each row padded by 16
// bytes so that the fragment loads of a warp hit 32 distinct banks.
template <int HD>
struct PmTile {
    unsigned short k[PM_BN][HD + 8];
    unsigned short v[PM_BN][HD + 8];
    float ks[PM_BN], vs[PM_BN];
    int vec[PM_BN];  // bf16 pages: the next key tile's vectors (-1 past the end)
};

// Keys k0..k0+PM_BN-1 of (table, kvh), pages of 1 << psh keys: 16-byte
// global pieces, zeros past maxlen. bf16 pages go straight to shared memory by cp.async (one group
// committed); fp8 pages land in a thread's registers (PmFetch) and go to
// shared memory as f16 with pm_put, their scales times `mul` beside them
// (a null scale buffer is the static format's 1).
template <bool FP8, int HD, int W>
struct PmFetch {
    static constexpr int CH = HD / 16;  // fp8 pieces a key
    static constexpr int N = (PM_BN * CH + 32 * W - 1) / (32 * W);
    uint4 raw[FP8 ? N : 1];
    float sc[FP8 ? N : 1];
};

template <bool FP8, int HD, int W>
__device__ __forceinline__ void pm_fetch(PmFetch<FP8, HD, W>& f, const unsigned char* base,
                                         const float* scales, const int* table, int k0,
                                         int maxlen, int kvh, int kv_heads, int psh, float mul) {
    constexpr int CH = PmFetch<FP8, HD, W>::CH;
#pragma unroll
    for (int i = 0; i < PmFetch<FP8, HD, W>::N; i++) {
        int x = threadIdx.x + i * 32 * W;
        int j = x / CH, c = x % CH, key = k0 + j;
        f.raw[i] = make_uint4(0, 0, 0, 0);
        f.sc[i] = 0.0f;
        if (x < PM_BN * CH && key < maxlen) {
            size_t vec = kv_vec(table[key >> psh], key & ((1 << psh) - 1), kvh, kv_heads, 1 << psh);
            f.raw[i] = *(const uint4*)(base + vec * HD + c * 16);
            if (c == 0) f.sc[i] = scales ? scales[vec] * mul : 1.0f;
        }
    }
}

template <bool FP8, int HD, int W>
__device__ __forceinline__ void pm_put(const PmFetch<FP8, HD, W>& f, unsigned short (*dst)[HD + 8],
                                       float* sc) {
    constexpr int CH = PmFetch<FP8, HD, W>::CH;
#pragma unroll
    for (int i = 0; i < PmFetch<FP8, HD, W>::N; i++) {
        int x = threadIdx.x + i * 32 * W;
        if (x >= PM_BN * CH) break;
        int j = x / CH, c = x % CH;
        const unsigned short* pairs = (const unsigned short*)&f.raw[i];
        unsigned h[8];
#pragma unroll
        for (int e = 0; e < 8; e++) {
            __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(pairs[e], __NV_E4M3);
            h[e] = (unsigned)hr.x | ((unsigned)hr.y << 16);
        }
        uint4* d = (uint4*)&dst[j][c * 16];
        d[0] = make_uint4(h[0], h[1], h[2], h[3]);
        d[1] = make_uint4(h[4], h[5], h[6], h[7]);
        if (c == 0) sc[j] = f.sc[i];
    }
}

// The page of key k0 + threadIdx.x (-1 past maxlen or for threads past
// the tile), loaded ahead so its latency hides behind the scores.
__device__ __forceinline__ int pm_page(const int* table, int k0, int maxlen, int psh) {
    int key = k0 + threadIdx.x;
    return threadIdx.x < PM_BN && key < maxlen ? table[key >> psh] : -1;
}

// The vector index of each key of the tile at k0 from its page (-1 past
// maxlen), which both K's and V's copies read: one lookup a key.
__device__ __forceinline__ void pm_vecs(int* vec, int page, int k0, int kvh, int kv_heads,
                                        int psh) {
    int key = k0 + threadIdx.x;
    if (threadIdx.x < PM_BN)
        vec[threadIdx.x] =
            page >= 0 ? (int)kv_vec(page, key & ((1 << psh) - 1), kvh, kv_heads, 1 << psh) : -1;
}

template <int HD, int W>
__device__ __forceinline__ void pm_copy(unsigned short (*dst)[HD + 8], const unsigned char* base,
                                        const int* vec) {
    constexpr int CH = HD / 8;
    constexpr int N = PM_BN * CH / (32 * W);
    static_assert(PM_BN * CH % (32 * W) == 0, "whole pieces a thread");
#pragma unroll 2
    for (int i = 0; i < N; i++) {
        int x = threadIdx.x + i * 32 * W;
        int j = x / CH, c = x % CH, v = vec[j];
        uint4* d = (uint4*)&dst[j][c * 8];
        if (v >= 0)
            cp_async<16>(d, base + ((size_t)v * HD + c * 8) * 2);
        else
            d[0] = make_uint4(0, 0, 0, 0);
    }
    cp_commit();
}

// 2^x in one MUFU instruction (2^-inf = 0); exp2f adds range handling
// that scores never need.
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffff, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffff, v, 1);
    return v + __shfl_xor_sync(0xffffffff, v, 2);
}

template <bool FP8, int HD, int W>
__device__ void prefill_mma(const float* q, const void* kc, const void* vc, const float* ks,
                            const float* vs, const int* tables, const int* table_off,
                            const int* lens, const int* tiles, float* out,
                            __nv_bfloat16* out16, int n_heads, int kv_heads, int group, int ps,
                            float scale) {
    const int psh = __ffs(ps) - 1;  // pages of a power of two (checked by the host)
    constexpr int KSTEPS = HD / 16;  // k-steps of Q K^T
    constexpr int ONT = HD / 8;      // n-tiles of O
    constexpr int SNT = PM_BN / 8;   // n-tiles of S
    __shared__ __align__(16) PmTile<HD> t;
    int kvh = blockIdx.x;
    int tile = gridDim.y - 1 - blockIdx.y;  // the longest tiles start first
    int t0 = tiles[2 * tile], cnt = tiles[2 * tile + 1];
    int rows = cnt * group;
    const int* table = tables + table_off[t0];
    int maxlen = lens[t0 + cnt - 1];
    const unsigned char* kb = (const unsigned char*)kc;
    const unsigned char* vb = (const unsigned char*)vc;
    // P times a V scale (amax / 448) can fall below f16's normal range for
    // a head of small values; times 448 it is P times the vector's amax,
    // and the output divides the 448 back out.
    const float vmul = FP8 && vs ? FP8_MAX : 1.0f;
    PmFetch<FP8, HD, W> pf;
    if (FP8) {
        pm_fetch<FP8, HD, W>(pf, kb, ks, table, 0, maxlen, kvh, kv_heads, psh, 1.0f);
        pm_put<FP8, HD, W>(pf, t.k, t.ks);
        pm_fetch<FP8, HD, W>(pf, vb, vs, table, 0, maxlen, kvh, kv_heads, psh, vmul);
        pm_put<FP8, HD, W>(pf, t.v, t.vs);
    } else {
        pm_vecs(t.vec, pm_page(table, 0, maxlen, psh), 0, kvh, kv_heads, psh);
        __syncthreads();
        pm_copy<HD, W>(t.k, kb, t.vec);
        pm_copy<HD, W>(t.v, vb, t.vec);
    }

    // This lane's rows (g and g + 8 of the warp's 16), their spans and Q.
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    int r0 = warp * 16 + g, r1 = r0 + 8;
    int len0 = r0 < rows ? lens[t0 + r0 / group] : 0;
    int len1 = r1 < rows ? lens[t0 + r1 / group] : 0;
    // The warp's longest span, and its shortest among real rows: key tiles
    // wholly below the shortest need no mask.
    int wlen = max(len0, len1);
    int wmin = min(r0 < rows ? len0 : 0x7fffffff, r1 < rows ? len1 : 0x7fffffff);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        wlen = max(wlen, __shfl_xor_sync(0xffffffff, wlen, o));
        wmin = min(wmin, __shfl_xor_sync(0xffffffff, wmin, o));
    }
    const float* q0 = q + ((size_t)(t0 + r0 / group) * n_heads + kvh * group + r0 % group) * HD;
    const float* q1 = q + ((size_t)(t0 + r1 / group) * n_heads + kvh * group + r1 % group) * HD;
    unsigned qa[KSTEPS][4];
#pragma unroll
    for (int kk = 0; kk < KSTEPS; kk++) {
        int d = kk * 16 + 2 * tq;
        float2 z = make_float2(0.0f, 0.0f);
        float2 a = r0 < rows ? *(const float2*)(q0 + d) : z;
        float2 b = r0 < rows ? *(const float2*)(q0 + d + 8) : z;
        float2 c = r1 < rows ? *(const float2*)(q1 + d) : z;
        float2 e = r1 < rows ? *(const float2*)(q1 + d + 8) : z;
        qa[kk][0] = pack16<FP8>(a.x, a.y);
        qa[kk][1] = pack16<FP8>(c.x, c.y);
        qa[kk][2] = pack16<FP8>(b.x, b.y);
        qa[kk][3] = pack16<FP8>(e.x, e.y);
    }
    float o[ONT][4];
#pragma unroll
    for (int n = 0; n < ONT; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    const float sl2 = scale * 1.4426950408889634f;  // exp(x) = exp2(x log2 e)

    int ntiles = (maxlen + PM_BN - 1) / PM_BN;
    for (int j = 0; j < ntiles; j++) {
        int k0 = j * PM_BN;
        bool next = j + 1 < ntiles;
        bool live = k0 < wlen;  // some row of this warp sees a key here
        if (!FP8) cp_wait<1>();  // K of tile j
        __syncthreads();
        // bf16: the next tile's pages in flight while the scores run (into
        // t.vec before the barrier below; every thread has issued this
        // tile's copies); fp8: its K.
        int page = !FP8 && next ? pm_page(table, k0 + PM_BN, maxlen, psh) : -1;
        if (FP8 && next)
            pm_fetch<FP8, HD, W>(pf, kb, ks, table, k0 + PM_BN, maxlen, kvh, kv_heads, psh, 1.0f);
        float s[SNT][4];
        if (live) {
#pragma unroll
            for (int n = 0; n < SNT; n++) {
                s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
                // Matrix i of the load: key rows n * 8.., columns 8 i.. of
                // this pair of k-steps (B fragments b0, b1 of each).
#pragma unroll
                for (int kk = 0; kk < KSTEPS; kk += 2) {
                    unsigned b[4];
                    ldsm_x4(b, &t.k[n * 8 + (lane & 7)][kk * 16 + (lane >> 3) * 8]);
                    mma16<FP8>(s[n], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[0], b[1]);
                    mma16<FP8>(s[n], qa[kk + 1][0], qa[kk + 1][1], qa[kk + 1][2], qa[kk + 1][3],
                               b[2], b[3]);
                }
            }
            float mx0 = m0, mx1 = m1;
            if (k0 + PM_BN > wmin) {
#pragma unroll
                for (int n = 0; n < SNT; n++) {
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        int col = n * 8 + 2 * tq + e, key = k0 + col;
                        float f = FP8 ? t.ks[col] * sl2 : sl2;
                        s[n][e] = key < len0 ? s[n][e] * f : -INFINITY;
                        s[n][2 + e] = key < len1 ? s[n][2 + e] * f : -INFINITY;
                    }
                }
            } else {
#pragma unroll
                for (int n = 0; n < SNT; n++) {
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        float f = FP8 ? t.ks[n * 8 + 2 * tq + e] * sl2 : sl2;
                        s[n][e] *= f;
                        s[n][2 + e] *= f;
                    }
                }
            }
#pragma unroll
            for (int n = 0; n < SNT; n++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    mx0 = fmaxf(mx0, s[n][e]);
                    mx1 = fmaxf(mx1, s[n][2 + e]);
                }
            }
            mx0 = quad_max(mx0);
            mx1 = quad_max(mx1);
            // A row with no key yet keeps -inf; exponents then use 0.
            float b0 = mx0 == -INFINITY ? 0.0f : mx0, b1 = mx1 == -INFINITY ? 0.0f : mx1;
            float c0 = ex2(m0 - b0), c1 = ex2(m1 - b1);
            m0 = mx0;
            m1 = mx1;
            l0 *= c0;
            l1 *= c1;
#pragma unroll
            for (int n = 0; n < ONT; n++) {
                o[n][0] *= c0;
                o[n][1] *= c0;
                o[n][2] *= c1;
                o[n][3] *= c1;
            }
#pragma unroll
            for (int n = 0; n < SNT; n++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    s[n][e] = ex2(s[n][e] - b0);
                    s[n][2 + e] = ex2(s[n][2 + e] - b1);
                    l0 += s[n][e];
                    l1 += s[n][2 + e];
                }
            }
        }
        if (!FP8 && next) pm_vecs(t.vec, page, k0 + PM_BN, kvh, kv_heads, psh);
        __syncthreads();  // every warp is done with K of tile j
        if (FP8) {
            if (next) pm_put<FP8, HD, W>(pf, t.k, t.ks);
        } else if (next) {
            pm_copy<HD, W>(t.k, kb, t.vec);
        } else {
            cp_commit();
        }
        if (!FP8) cp_wait<1>();  // V of tile j
        __syncthreads();
        if (FP8 && next)
            pm_fetch<FP8, HD, W>(pf, vb, vs, table, k0 + PM_BN, maxlen, kvh, kv_heads, psh, vmul);
        if (live) {
#pragma unroll
            for (int kk = 0; kk < PM_BN / 16; kk++) {
                int c = kk * 16 + 2 * tq;
                float v0 = FP8 ? t.vs[c] : 1.0f, v1 = FP8 ? t.vs[c + 1] : 1.0f;
                float v8 = FP8 ? t.vs[c + 8] : 1.0f, v9 = FP8 ? t.vs[c + 9] : 1.0f;
                unsigned a0 = pack16<FP8>(s[2 * kk][0] * v0, s[2 * kk][1] * v1);
                unsigned a1 = pack16<FP8>(s[2 * kk][2] * v0, s[2 * kk][3] * v1);
                unsigned a2 = pack16<FP8>(s[2 * kk + 1][0] * v8, s[2 * kk + 1][1] * v9);
                unsigned a3 = pack16<FP8>(s[2 * kk + 1][2] * v8, s[2 * kk + 1][3] * v9);
                int vrow = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
                for (int np = 0; np < HD / 16; np++) {
                    unsigned b[4];
                    ldsm_x4_trans(b, &t.v[vrow][np * 16 + (lane >> 4) * 8]);
                    mma16<FP8>(o[2 * np], a0, a1, a2, a3, b[0], b[1]);
                    mma16<FP8>(o[2 * np + 1], a0, a1, a2, a3, b[2], b[3]);
                }
            }
        }
        __syncthreads();  // every warp is done with V of tile j
        if (FP8) {
            if (next) pm_put<FP8, HD, W>(pf, t.v, t.vs);
        } else if (next) {
            pm_copy<HD, W>(t.v, vb, t.vec);
        } else {
            cp_commit();
        }
    }
    if (!FP8) cp_wait<0>();
    l0 = quad_sum(l0);
    l1 = quad_sum(l1);
    float i0 = l0 > 0.0f ? 1.0f / (l0 * vmul) : 0.0f, i1 = l1 > 0.0f ? 1.0f / (l1 * vmul) : 0.0f;
    size_t at0 = ((size_t)(t0 + r0 / group) * n_heads + kvh * group + r0 % group) * HD;
    size_t at1 = ((size_t)(t0 + r1 / group) * n_heads + kvh * group + r1 % group) * HD;
    // f32 rows, or with `out16` bf16 rows for the next GEMM.
#pragma unroll
    for (int n = 0; n < ONT; n++) {
        int d = n * 8 + 2 * tq;
        float2 v0 = make_float2(o[n][0] * i0, o[n][1] * i0);
        float2 v1 = make_float2(o[n][2] * i1, o[n][3] * i1);
        if (out16 != nullptr) {
            if (r0 < rows) *(__nv_bfloat162*)(out16 + at0 + d) = __float22bfloat162_rn(v0);
            if (r1 < rows) *(__nv_bfloat162*)(out16 + at1 + d) = __float22bfloat162_rn(v1);
        } else {
            if (r0 < rows) *(float2*)(out + at0 + d) = v0;
            if (r1 < rows) *(float2*)(out + at1 + d) = v1;
        }
    }
}

// Four warps a block run three blocks an SM; eight warps one.
#define PREFILL_ENTRY(NAME, FP8, HD, W)                                                          \
    extern "C" __global__ void __launch_bounds__(32 * W, W == 4 ? 3 : 1)                         \
        NAME(const float* q, const void* kc, const void* vc, const float* ks, const float* vs,   \
             const int* tables, const int* table_off, const int* lens, const int* tiles,         \
             float* out, __nv_bfloat16* out16, int n_heads, int kv_heads, int group,             \
             int page_size, float scale) {                                                       \
        PDL_ENTER();                                                                             \
        prefill_mma<FP8, HD, W>(q, kc, vc, ks, vs, tables, table_off, lens, tiles, out, out16,   \
                                n_heads, kv_heads, group, page_size, scale);                     \
    }

PREFILL_ENTRY(prefill_bf16_d64_w4, false, 64, 4)
PREFILL_ENTRY(prefill_bf16_d128_w4, false, 128, 4)
PREFILL_ENTRY(prefill_fp8_d64_w4, true, 64, 4)
PREFILL_ENTRY(prefill_fp8_d128_w4, true, 128, 4)
PREFILL_ENTRY(prefill_bf16_d64_w8, false, 64, 8)
PREFILL_ENTRY(prefill_bf16_d128_w8, false, 128, 8)
PREFILL_ENTRY(prefill_fp8_d64_w8, true, 64, 8)
PREFILL_ENTRY(prefill_fp8_d128_w8, true, 128, 8)
