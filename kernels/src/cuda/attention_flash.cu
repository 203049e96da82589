// Paged decode attention, one pass per warp (see attention.rs; uses
// attention_mma.cu; head sizes 64 and 128). Each warp takes 16 tokens of
// the partition at a time and runs them through scores
// (QFrags::score8_with, twice), an online softmax and the values MMAs
// without leaving registers: the scores' C fragments (head `row`, tokens
// 2j, 2j + 1 of each 8) are exactly the B fragment of the values product
// O^T = V^T P^T over those 16 tokens, so no scores go through shared memory
// and warps never wait for each other until the block merges their (max,
// sum, output) at the end. With `out` (the launch has one partition) the
// block writes the normalized output itself and no merge runs after it;
// with `done` too (several partitions), the block of each sequence and KV
// head that finishes last merges them (flash_merge_last) and no merge
// launch runs either.
//
// K and V of the warp's next chunk are loaded into registers while this
// one is summed: a cp.async ring in shared memory measured slower, its
// round trip and warp syncs costing more than the loads they hide.
//
// fp8 weights: a token's weight on its raw e4m3 V is p * vscale; the warp
// keeps them relative to the largest V scale it has seen (cref), so the f16
// A terms stay within [0, 1] where f16 keeps its precision, and rescales
// its sums when cref grows, as it does when the running max grows.
//
// Shared memory (flash_shared on the host must agree): Q's fragments
// (HD / 16 x 32 lanes x 16 bytes; with e4m3 scores HD / 32 x 32 x 16 and
// 8 head factors, less), red (WARPS x (G x HD + 2 G)), pg (part_len /
// page_size + 1 pages). page_size: a power of two, at least 16.

template <bool FP8, int G, int HD>
__device__ void attention_flash(const float* q, const void* kc, const void* vc, const float* ks,
                                const float* vs, const int* tables, const int* table_off,
                                const int* lens, float* part_out, float* part_ml, int n_heads,
                                int kv_heads, int page_size, int parts, int part_len,
                                float scale, float* out, __nv_bfloat16* out16,
                                unsigned* done, const RopeIn& rin) {
    constexpr int WARPS = FLASH_WARPS;
    constexpr int ELEM = FP8 ? 1 : 2;
    constexpr int NB = HD / 8;
    constexpr int WORDS = NB * ELEM / 4;
    constexpr int TERMS = FP8 ? 2 : 3;
    using Q = QFrags<FP8, G, HD>;
    constexpr int PIECES = Q::PIECES;
    extern __shared__ __align__(16) float smem[];
    int kvh = blockIdx.x, s = blockIdx.y, part = blockIdx.z;
    int t0 = part * part_len;
    flash_prefetch<FP8, HD>(kc, vc, ks, tables, table_off, lens, s, kvh, kv_heads, page_size, t0,
                            part_len);
    PDL_WAIT();
    int t1 = min(lens[s], t0 + part_len);
    int p0 = t0 / page_size;
    int npages = t1 > t0 ? (t1 - 1) / page_size - p0 + 1 : 0;
    constexpr int RED = WARPS * (G * HD + 2 * G);  // floats
    uint4* qfs = (uint4*)smem;  // Q's fragments
    float* qscale = (float*)(qfs + Q::STEPS * 32);  // E4: per head
    float* red = qscale + Q::SCALES;
    int* pg = (int*)(red + RED);
    const int* table = tables + table_off[s];
    for (int i = threadIdx.x; i < npages; i += WARPS * 32) pg[i] = table[p0 + i];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int j = lane & 3, row = lane >> 2;
    // With `rin`, the queries rotated here (into `red`, free until the
    // warps' merge at the end), and the sequence's new key and value
    // written.
    const float* qs = q + ((size_t)s * n_heads + kvh * G) * HD;
    if (rin.q != nullptr) {
        float* qrot = red;
        flash_rope<FP8, G, HD>(rin, qrot, red + G * HD, s, kvh, kv_heads, page_size,
                               t1 > t0 && t1 == lens[s], kc, vc, ks, vs);
        qs = qrot;
    }
    // Q's fragments, the same for every warp: one warp makes them.
    if (warp == 0) {
        Q qf(qs, row, j);
        qf.store(qfs, lane);
        qf.store_scale(qscale, row, j);
    }
    __syncthreads();
    // The factor of the lane's head's scores: the softmax scale, and with
    // e4m3 scores Q's own.
    float qk_scale = Q::E4 ? scale * qscale[row] : scale;
    auto frag = [&](int st) { return qfs[st * 32 + lane]; };
    int chunks = (t1 - t0 + 15) / 16;
    // Static fp8 pages have no scales: every token reads the 1s of
    // kiln_unit_scales (a mask, not a branch in the loop: a branch there
    // cost the kernel a stack frame and 16% of its speed).
    const size_t smask = ks ? ~(size_t)0 : 0;
    const float* ksp = ks ? ks : kiln_unit_scales;
    const float* vsp = vs ? vs : kiln_unit_scales;
    // Lane-held token x of chunk c (x = 2n + e: tokens 8n + 2j + e), which
    // is both a score it holds and a V row it loads.
    auto token = [&](int c, int x) { return t0 + c * 16 + 8 * (x >> 1) + 2 * j + (x & 1); };
    struct Chunk {
        uint4 k[2][PIECES];   // tokens row and 8 + row of the chunk
        unsigned v[4][WORDS]; // this lane's dimensions of its 4 tokens
        float ks[4], vs[4];   // their scales (fp8)
    };
    // A chunk's 16 tokens lie in one page (16 | page_size, a power of
    // two, and chunks start 16-aligned), so one page lookup places them.
    int sh = __ffs(page_size) - 1;
    auto load = [&](int c, Chunk& ch) {
        int cs = t0 + c * 16;
        bool live = c < chunks;
        size_t base = 0;  // the vector index of the chunk's first token
        if (live) {
            int page = pg[(cs >> sh) - p0];
            base = ((size_t)(page * kv_heads + kvh) << sh) + (cs & (page_size - 1));
        }
#pragma unroll
        for (int n = 0; n < 2; n++) {
            if (live && cs + 8 * n + row < t1) {
                const unsigned char* p = (const unsigned char*)kc + (base + 8 * n + row) * HD * ELEM;
#pragma unroll
                for (int i = 0; i < PIECES; i++) ch.k[n][i] = load16(p + 16 * (j + 4 * i));
            } else {
#pragma unroll
                for (int i = 0; i < PIECES; i++) ch.k[n][i] = make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int x = 0; x < 4; x++) {
            int off = 8 * (x >> 1) + 2 * j + (x & 1);  // token(c, x) - cs
            bool ok = live && cs + off < t1;
            size_t vec = base + off;
            if (ok) {
                load_words<WORDS>((const unsigned char*)vc + (vec * HD + row * NB) * ELEM, ch.v[x]);
            } else {
#pragma unroll
                for (int w = 0; w < WORDS; w++) ch.v[x][w] = 0;
            }
        }
        if (FP8) {
            // The scales of tokens x = 2n, 2n + 1 lie side by side (an even
            // vector index: chunks start 16-aligned): one 8-byte load each
            // for K and V; the second of a pair may lie past the sequence's
            // end (but inside its page) and is dropped.
#pragma unroll
            for (int n = 0; n < 2; n++) {
                int off = 8 * n + 2 * j;
                bool ok0 = live && cs + off < t1, ok1 = live && cs + off + 1 < t1;
                float2 k2 = make_float2(0.0f, 0.0f), v2 = k2;
                if (ok0) {
                    size_t at = (base + off) & smask;
                    k2 = *(const float2*)(ksp + at);
                    v2 = *(const float2*)(vsp + at);
                }
                ch.ks[2 * n] = k2.x;
                ch.vs[2 * n] = v2.x;
                ch.ks[2 * n + 1] = ok1 ? k2.y : 0.0f;
                ch.vs[2 * n + 1] = ok1 ? v2.y : 0.0f;
            }
        }
    };
    // O^T = V^T P^T: MMA i's rows are dimensions (row g: g * NB + 2i, row
    // g + 8: g * NB + 2i + 1, the lane's own loaded dimensions), its columns
    // the heads, so all 16 rows work; lane (g, j) sums heads 2j and 2j + 1:
    // o[i] = (dim 2i: head 2j, 2j + 1; dim 2i + 1: head 2j, 2j + 1).
    float o[NB / 2][4];
#pragma unroll
    for (int i = 0; i < NB / 2; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m = -INFINITY, l = 0.0f, cref = 0.0f;
    // Sums chunk c from ch.
    auto step = [&](int c, const Chunk& ch) {
        // Scores of the lane's 4 tokens; past the end: -inf.
        float sv[4];
        Q::score8_with(ch.k[0], sv[0], sv[1], frag);
        Q::score8_with(ch.k[1], sv[2], sv[3], frag);
        float cm = -INFINITY, cv = 0.0f;
#pragma unroll
        for (int x = 0; x < 4; x++) {
            sv[x] = token(c, x) < t1 ? sv[x] * qk_scale * (FP8 ? ch.ks[x] : 1.0f) : -INFINITY;
            cm = fmaxf(cm, sv[x]);
            if (FP8) cv = fmaxf(cv, ch.vs[x]);
        }
        // The four lanes of a quad hold one head's 16 scores.
        cm = fmaxf(cm, __shfl_xor_sync(0xffffffff, cm, 1));
        cm = fmaxf(cm, __shfl_xor_sync(0xffffffff, cm, 2));
        float m_new = fmaxf(m, cm);  // finite: the chunk has a token
        float alpha = __expf(m - m_new);
        float p[4], psum = 0.0f;
#pragma unroll
        for (int x = 0; x < 4; x++) {
            p[x] = __expf(sv[x] - m_new);
            psum += p[x];
        }
        l = l * alpha + psum;
        m = m_new;
        if (FP8) {
            cv = fmaxf(cv, __shfl_xor_sync(0xffffffff, cv, 1));
            cv = fmaxf(cv, __shfl_xor_sync(0xffffffff, cv, 2));
            float c_new = fmaxf(cref, cv);
            alpha *= c_new > 0.0f ? cref / c_new : 1.0f;
            float inv = c_new > 0.0f ? 1.0f / c_new : 0.0f;
#pragma unroll
            for (int x = 0; x < 4; x++) p[x] *= ch.vs[x] * inv;
            cref = c_new;
        }
        if (row >= G) {
#pragma unroll
            for (int x = 0; x < 4; x++) p[x] = 0.0f;
        }
        // This lane's sums are heads 2j and 2j + 1: their rescales live in
        // the lanes of rows 2j and 2j + 1. Once the maxima settle no head
        // rescales, and the warp skips it.
        if (__any_sync(0xffffffff, alpha != 1.0f)) {
            float al0 = __shfl_sync(0xffffffff, alpha, 8 * j);
            float al1 = __shfl_sync(0xffffffff, alpha, 8 * j + 4);
#pragma unroll
            for (int i = 0; i < NB / 2; i++) {
                o[i][0] *= al0;
                o[i][1] *= al1;
                o[i][2] *= al0;
                o[i][3] *= al1;
            }
        }
        // P^T's B fragment is this lane's own weights: head g, tokens 2j,
        // 2j + 1 and 2j + 8, 2j + 9.
        unsigned b0[TERMS], b1[TERMS];
#pragma unroll
        for (int k = 0; k < TERMS; k++) {
            b0[k] = pack_split<FP8>(p[0], p[1], p[0], p[1]);
            b1[k] = pack_split<FP8>(p[2], p[3], p[2], p[3]);
        }
#pragma unroll
        for (int i = 0; i < NB / 2; i++) {
            unsigned a0 = token_pair<FP8>(ch.v[0], ch.v[1], 2 * i);
            unsigned a1 = token_pair<FP8>(ch.v[0], ch.v[1], 2 * i + 1);
            unsigned a2 = token_pair<FP8>(ch.v[2], ch.v[3], 2 * i);
            unsigned a3 = token_pair<FP8>(ch.v[2], ch.v[3], 2 * i + 1);
#pragma unroll
            for (int k = 0; k < TERMS; k++) mma16<FP8>(o[i], a0, a1, a2, a3, b0[k], b1[k]);
        }
    };
    // Two chunks in turn, one summed while the next loads.
    Chunk a, b;
    load(warp, a);
    for (int c = warp; c < chunks; c += 2 * WARPS) {
        load(c + WARPS, b);
        step(c, a);
        if (c + WARPS >= chunks) break;
        load(c + 2 * WARPS, a);
        step(c + WARPS, b);
    }
    // Per warp: head row's max, sum (over the quad) and output.
    l += __shfl_xor_sync(0xffffffff, l, 1);
    l += __shfl_xor_sync(0xffffffff, l, 2);
    float* wo = red + warp * (G * HD + 2 * G);
    float f = FP8 ? cref : 1.0f;
#pragma unroll
    for (int e = 0; e < 2; e++) {
        int h = 2 * j + e;
        if (h < G) {
#pragma unroll
            for (int i = 0; i < NB / 2; i++) {
                wo[h * HD + row * NB + 2 * i] = o[i][e] * f;
                wo[h * HD + row * NB + 2 * i + 1] = o[i][2 + e] * f;
            }
        }
    }
    if (row < G && j == 0) {
        wo[G * HD + 2 * row] = m;
        wo[G * HD + 2 * row + 1] = l;
    }
    __syncthreads();
    // The block's output: warps merged at their common max; with `out`
    // or `out16` (the sequence in one partition) normalized into it (f32,
    // or bf16 for the next GEMM), no merge launch after; else partial, for
    // the merge.
    bool direct = parts == 1 && (out != nullptr || out16 != nullptr);
    for (int i = threadIdx.x; i < G * HD; i += WARPS * 32) {
        int g = i / HD;
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; w++) mx = fmaxf(mx, red[w * (G * HD + 2 * G) + G * HD + 2 * g]);
        float sum = 0.0f, lsum = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) {
            const float* r = red + w * (G * HD + 2 * G);
            float mw = r[G * HD + 2 * g];
            if (mw > -INFINITY) {
                float e = __expf(mw - mx);
                sum += r[i] * e;
                lsum += r[G * HD + 2 * g + 1] * e;
            }
        }
        size_t h = (size_t)s * n_heads + kvh * G + g;
        if (direct) {
            float o = sum * (lsum > 0.0f ? 1.0f / lsum : 0.0f);
            if (out16 != nullptr) {
                out16[h * HD + i % HD] = __float2bfloat16(o);
            } else {
                out[h * HD + i % HD] = o;
            }
        } else {
            part_out[(h * parts + part) * HD + i % HD] = sum;
        }
    }
    if (direct) return;
    if (threadIdx.x < G) {
        int g = threadIdx.x;
        float mx = -INFINITY, sum = 0.0f;
        for (int w = 0; w < WARPS; w++) mx = fmaxf(mx, red[w * (G * HD + 2 * G) + G * HD + 2 * g]);
        for (int w = 0; w < WARPS; w++) {
            const float* r = red + w * (G * HD + 2 * G) + G * HD + 2 * g;
            if (r[0] > -INFINITY) sum += r[1] * __expf(r[0] - mx);
        }
        size_t h = (size_t)s * n_heads + kvh * G + g;
        bool empty = t1 <= t0;
        part_ml[(h * parts + part) * 2] = empty ? -INFINITY : mx;
        part_ml[(h * parts + part) * 2 + 1] = empty ? 0.0f : sum;
    }
    if (done != nullptr) {
        flash_merge_last<G, HD>(done, part_out, part_ml, out, out16, s, kvh, n_heads, kv_heads,
                                parts);
    }
}

// MINB: blocks an SM the build is held to (the registers it may take).
#define ATTENTION_FLASH_AT(NAME, FP8, G, HD, MINB)                                             \
    extern "C" __global__ void __launch_bounds__(FLASH_WARPS * 32, MINB)                        \
        NAME(const float* q, const void* kc, const void* vc, const float* ks, const float* vs,  \
             const int* tables, const int* table_off, const int* lens, float* part_out,         \
             float* part_ml, int n_heads, int kv_heads, int hd, int page_size, int parts,       \
             int part_len, float scale, float* out, __nv_bfloat16* out16, unsigned* done,       \
             RopeIn rin) {                                                                      \
        PDL_LAUNCH();                                                                           \
        attention_flash<FP8, G, HD>(q, kc, vc, ks, vs, tables, table_off, lens, part_out,       \
                                    part_ml, n_heads, kv_heads, page_size, parts, part_len,     \
                                    scale, out, out16, done, rin);                              \
    }
#define ATTENTION_FLASH(NAME, FP8, G, HD) ATTENTION_FLASH_AT(NAME, FP8, G, HD, FP8 ? 3 : 1)

// attention_flash_{fmt}_g{G}_d{HD}: every format, group size (query heads
// per KV head) and head size.
ATTENTION_FLASH(attention_flash_bf16_g1_d64, false, 1, 64)
ATTENTION_FLASH(attention_flash_bf16_g2_d64, false, 2, 64)
ATTENTION_FLASH(attention_flash_bf16_g3_d64, false, 3, 64)
ATTENTION_FLASH(attention_flash_bf16_g4_d64, false, 4, 64)
ATTENTION_FLASH(attention_flash_bf16_g5_d64, false, 5, 64)
ATTENTION_FLASH(attention_flash_bf16_g6_d64, false, 6, 64)
ATTENTION_FLASH(attention_flash_bf16_g7_d64, false, 7, 64)
ATTENTION_FLASH(attention_flash_bf16_g8_d64, false, 8, 64)
ATTENTION_FLASH(attention_flash_bf16_g1_d128, false, 1, 128)
ATTENTION_FLASH(attention_flash_bf16_g2_d128, false, 2, 128)
ATTENTION_FLASH(attention_flash_bf16_g3_d128, false, 3, 128)
ATTENTION_FLASH(attention_flash_bf16_g4_d128, false, 4, 128)
ATTENTION_FLASH(attention_flash_bf16_g5_d128, false, 5, 128)
ATTENTION_FLASH(attention_flash_bf16_g6_d128, false, 6, 128)
ATTENTION_FLASH(attention_flash_bf16_g7_d128, false, 7, 128)
ATTENTION_FLASH(attention_flash_bf16_g8_d128, false, 8, 128)
ATTENTION_FLASH(attention_flash_fp8_g1_d64, true, 1, 64)
ATTENTION_FLASH(attention_flash_fp8_g2_d64, true, 2, 64)
ATTENTION_FLASH(attention_flash_fp8_g3_d64, true, 3, 64)
ATTENTION_FLASH(attention_flash_fp8_g4_d64, true, 4, 64)
ATTENTION_FLASH(attention_flash_fp8_g5_d64, true, 5, 64)
ATTENTION_FLASH(attention_flash_fp8_g6_d64, true, 6, 64)
ATTENTION_FLASH(attention_flash_fp8_g7_d64, true, 7, 64)
ATTENTION_FLASH(attention_flash_fp8_g8_d64, true, 8, 64)
ATTENTION_FLASH(attention_flash_fp8_g1_d128, true, 1, 128)
ATTENTION_FLASH(attention_flash_fp8_g2_d128, true, 2, 128)
ATTENTION_FLASH(attention_flash_fp8_g3_d128, true, 3, 128)
ATTENTION_FLASH(attention_flash_fp8_g4_d128, true, 4, 128)
ATTENTION_FLASH(attention_flash_fp8_g5_d128, true, 5, 128)
ATTENTION_FLASH(attention_flash_fp8_g6_d128, true, 6, 128)
ATTENTION_FLASH(attention_flash_fp8_g7_d128, true, 7, 128)
ATTENTION_FLASH(attention_flash_fp8_g8_d128, true, 8, 128)

// attention_flash_fp8_g{G}_d128_r4: the fp8 d128 kernels held to 128
// registers, four blocks an SM where the builds above run three (168
// registers; these spill ~50 bytes, so each block runs slower): for a
// launch whose blocks overflow one wave of three an SM but fit one of four
// (64 sequences of 8 KV heads in one partition: 512 blocks on 132 SMs).
// The same operations, so the same bits.
ATTENTION_FLASH_AT(attention_flash_fp8_g1_d128_r4, true, 1, 128, 4)
ATTENTION_FLASH_AT(attention_flash_fp8_g2_d128_r4, true, 2, 128, 4)
ATTENTION_FLASH_AT(attention_flash_fp8_g3_d128_r4, true, 3, 128, 4)
ATTENTION_FLASH_AT(attention_flash_fp8_g4_d128_r4, true, 4, 128, 4)
ATTENTION_FLASH_AT(attention_flash_fp8_g5_d128_r4, true, 5, 128, 4)
ATTENTION_FLASH_AT(attention_flash_fp8_g6_d128_r4, true, 6, 128, 4)
ATTENTION_FLASH_AT(attention_flash_fp8_g7_d128_r4, true, 7, 128, 4)
ATTENTION_FLASH_AT(attention_flash_fp8_g8_d128_r4, true, 8, 128, 4)
