// Causal prefill attention over paged KV (see prefill.rs), flash
// style: one block takes a tile of consecutive query tokens of one sequence
// and all query heads of one KV head, and streams that sequence's keys and
// values through shared memory PF_KT at a time, so each K and V vector is
// read once per tile instead of once per query token. Token t attends to
// keys 0..lens[t]-1 (its position and everything before), as the decode
// kernel does one token at a time; online softmax in registers.
//
// tiles: (first token, tokens) pairs; a tile's tokens share one block
// table (table_off of its first token) and have consecutive lengths, so the
// last one sees the most keys. Rows of a tile: tokens x G <= PF_ROWS.
// Threads: PF_THREADS; head_dim a multiple of 32 up to 128.

#define PF_KT 32
#define PF_ROWS 32
#define PF_THREADS 256
#define PF_MAX_HD 128

template <bool FP8>
struct KvTile {
    // Raw page elements (bf16 or e4m3) of PF_KT vectors, rows padded by one
    // 32-bit word so the lanes of a warp (one key each) hit distinct banks.
    unsigned char k[PF_KT * (PF_MAX_HD * (FP8 ? 1 : 2) + 4)];
    unsigned char v[PF_KT * PF_MAX_HD * (FP8 ? 1 : 2)];
    float ks[PF_KT], vs[PF_KT];
};

template <bool FP8>
__device__ __forceinline__ float tile_elem(const unsigned char* base, int stride, int j, int d,
                                           const float* scales) {
    if (FP8) {
        __nv_fp8_e4m3 q;
        q.__x = base[j * stride + d];
        return (float)q * scales[j];
    } else {
        return __bfloat162float(((const __nv_bfloat16*)(base + j * stride))[d]);
    }
}

template <bool FP8, int G>
__device__ void prefill_attention(const float* q, const void* kc, const void* vc, const float* ks,
                                  const float* vs, const int* tables, const int* table_off,
                                  const int* lens, const int* tiles, float* out, int n_heads,
                                  int kv_heads, int hd, int page_size, float scale) {
    constexpr int ELEM = FP8 ? 1 : 2;
    constexpr int WARPS = PF_THREADS / 32;
    constexpr int RPW = PF_ROWS / WARPS;  // rows per warp
    __shared__ float qs[PF_ROWS * PF_MAX_HD];
    __shared__ KvTile<FP8> tile;
    int kvh = blockIdx.x;
    int t0 = tiles[2 * blockIdx.y], cnt = tiles[2 * blockIdx.y + 1];
    int rows = cnt * G;
    int kstride = hd * ELEM + 4, vstride = hd * ELEM;
    for (int x = threadIdx.x; x < rows * hd; x += blockDim.x) {
        int r = x / hd, d = x % hd;
        int i = r / G, g = r % G;
        qs[r * hd + d] = q[((size_t)(t0 + i) * n_heads + kvh * G + g) * hd + d] * scale;
    }
    const int* table = tables + table_off[t0];
    int maxlen = lens[t0 + cnt - 1];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float m[RPW], l[RPW], acc[RPW][PF_MAX_HD / 32];
#pragma unroll
    for (int k = 0; k < RPW; k++) {
        m[k] = -INFINITY;
        l[k] = 0.0f;
#pragma unroll
        for (int c = 0; c < PF_MAX_HD / 32; c++) acc[k][c] = 0.0f;
    }
    for (int k0 = 0; k0 < maxlen; k0 += PF_KT) {
        __syncthreads();
        // The tile's keys and values, as stored (2-byte or 1-byte units).
        for (int x = threadIdx.x; x < PF_KT * hd; x += blockDim.x) {
            int j = x / hd, d = x % hd;
            int key = k0 + j;
            if (key < maxlen) {
                size_t vec =
                    kv_vec(table[key / page_size], key % page_size, kvh, kv_heads, page_size);
                const unsigned char* kp = (const unsigned char*)kc + (vec * hd + d) * ELEM;
                const unsigned char* vp = (const unsigned char*)vc + (vec * hd + d) * ELEM;
                for (int b = 0; b < ELEM; b++) {
                    tile.k[j * kstride + d * ELEM + b] = kp[b];
                    tile.v[j * vstride + d * ELEM + b] = vp[b];
                }
                if (FP8 && d == 0) {
                    // Static fp8 pages have no scales: 1.
                    tile.ks[j] = ks ? ks[vec] : 1.0f;
                    tile.vs[j] = vs ? vs[vec] : 1.0f;
                }
            }
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < RPW; k++) {
            int r = k * WARPS + warp;
            if (r >= rows) break;  // the same for the whole warp
            int len = lens[t0 + r / G];
            if (k0 >= len) continue;
            // Lane j scores key k0 + j.
            int key = k0 + lane;
            float s = -INFINITY;
            if (key < len) {
                float dot = 0.0f;
                for (int d = 0; d < hd; d++)
                    dot += qs[r * hd + d] * tile_elem<FP8>(tile.k, kstride, lane, d, tile.ks);
                s = dot;
            }
            float m_new = fmaxf(m[k], warp_max(s));
            float p = key < len ? __expf(s - m_new) : 0.0f;
            float corr = __expf(m[k] - m_new);
            l[k] = l[k] * corr + warp_sum(p);
            m[k] = m_new;
#pragma unroll
            for (int c = 0; c < PF_MAX_HD / 32; c++) acc[k][c] *= corr;
            int valid = min(PF_KT, len - k0);
            for (int j = 0; j < valid; j++) {
                float pj = __shfl_sync(0xffffffff, p, j);
#pragma unroll
                for (int c = 0; c < PF_MAX_HD / 32; c++) {
                    int d = lane + 32 * c;
                    if (d < hd) acc[k][c] += pj * tile_elem<FP8>(tile.v, vstride, j, d, tile.vs);
                }
            }
        }
    }
#pragma unroll
    for (int k = 0; k < RPW; k++) {
        int r = k * WARPS + warp;
        if (r >= rows) break;
        int i = r / G, g = r % G;
        float* o = out + ((size_t)(t0 + i) * n_heads + kvh * G + g) * hd;
#pragma unroll
        for (int c = 0; c < PF_MAX_HD / 32; c++) {
            int d = lane + 32 * c;
            if (d < hd) o[d] = l[k] > 0.0f ? acc[k][c] / l[k] : 0.0f;
        }
    }
}

#define PREFILL_ENTRY(NAME, FP8, G)                                                             \
    extern "C" __global__ void NAME(const float* q, const void* kc, const void* vc,              \
                                    const float* ks, const float* vs, const int* tables,         \
                                    const int* table_off, const int* lens, const int* tiles,     \
                                    float* out, int n_heads, int kv_heads, int hd,               \
                                    int page_size, float scale) {                                \
        PDL_ENTER();                                                                             \
        prefill_attention<FP8, G>(q, kc, vc, ks, vs, tables, table_off, lens, tiles, out,        \
                                  n_heads, kv_heads, hd, page_size, scale);                      \
    }

PREFILL_ENTRY(prefill_bf16_g1, false, 1)
PREFILL_ENTRY(prefill_bf16_g2, false, 2)
PREFILL_ENTRY(prefill_bf16_g3, false, 3)
PREFILL_ENTRY(prefill_bf16_g4, false, 4)
PREFILL_ENTRY(prefill_bf16_g8, false, 8)
PREFILL_ENTRY(prefill_fp8_g1, true, 1)
PREFILL_ENTRY(prefill_fp8_g2, true, 2)
PREFILL_ENTRY(prefill_fp8_g3, true, 3)
PREFILL_ENTRY(prefill_fp8_g4, true, 4)
PREFILL_ENTRY(prefill_fp8_g8, true, 8)
