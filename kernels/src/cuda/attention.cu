// Paged decode attention on CUDA cores, for any head size and page size
// (attention_flash.cu runs the shapes tensor cores take), split along the
// sequence. Grid: (kv_heads, seqs, partitions of part_len <= PART tokens);
// 128 threads. Each K and V vector of the block's tokens is read once, for
// all G query heads of its KV head, in 16-byte pieces (8 bf16 or 16 fp8
// elements; 8 fp8 for groups above 4, whose sums would not fit in
// registers): TPV = hd / V threads share a vector, 128 / TPV tokens are in
// flight per round. Loads (and fp8 scales) go through cp.async into a ring
// of ATT_STAGES slots per thread in shared memory, so each thread keeps several rounds of
// loads in flight without holding them in registers; a thread only ever
// reads back the slots it filled itself, so no barrier is needed for them.
// fp8 scales are applied once per token (to the score, to the weight of
// the value), not per element. Writes an unnormalized partial output with
// its max and sum for the merge.
// q: seqs x n_heads x hd. tables: the concatenated block tables, seq s's at
// table_off[s]. part_out: seqs x n_heads x parts x hd; part_ml: ... x 2.

// Most tokens per attention partition.
#define PART 256

#define ATT_THREADS 128  // threads of a decode attention block
#define ATT_STAGES 4     // slots per thread of the cp.async ring

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// An asynchronous copy of BYTES (8 or 16) from global to shared memory, to
// a shared-memory address or to a pointer into shared memory.
template <int BYTES>
__device__ __forceinline__ void cp_async(unsigned dst, const void* src) {
    if (BYTES == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(src),
                     "n"(BYTES));
    }
}
template <int BYTES>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
    cp_async<BYTES>(smem_addr(dst), src);
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// V raw elements (bf16 or e4m3) as floats, unscaled.
template <bool FP8, int V>
__device__ __forceinline__ void unpack(const uint4& raw, float* out) {
    if (FP8) {
        const __nv_fp8x2_storage_t* p = (const __nv_fp8x2_storage_t*)&raw;
#pragma unroll
        for (int j = 0; j < V / 2; j++) {
            __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(p[j], __NV_E4M3);
            float2 f = __half22float2(*(const __half2*)&h);
            out[2 * j] = f.x;
            out[2 * j + 1] = f.y;
        }
    } else {
        const __nv_bfloat162* h2 = (const __nv_bfloat162*)&raw;
#pragma unroll
        for (int j = 0; j < V / 2; j++) {
            float2 f = __bfloat1622float2(h2[j]);
            out[2 * j] = f.x;
            out[2 * j + 1] = f.y;
        }
    }
}

template <bool FP8, int G>
struct AttShape {
    static const int V = (FP8 && G <= 4) ? 16 : 8;  // elements per piece
    static const int BYTES = V * (FP8 ? 1 : 2);     // bytes per piece
};

// Softmax pieces of a partition's n scores per head, one warp per head:
// ml gets each head's max and sum, sc the weights exp(s - max).
template <int G>
__device__ void softmax_part(float* sc, float* ml, int n) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int g = warp; g < G; g += ATT_THREADS / 32) {
        float m = -INFINITY;
        for (int i = lane; i < n; i += 32) m = fmaxf(m, sc[g * PART + i]);
        m = warp_max(m);
        float l = 0.0f;
        for (int i = lane; i < n; i += 32) {
            float p = __expf(sc[g * PART + i] - m);
            l += p;
            sc[g * PART + i] = p;
        }
        l = warp_sum(l);
        if (lane == 0) {
            ml[2 * g] = m;
            ml[2 * g + 1] = l;
        }
    }
}

// Sums the warps' partial outputs (red: warps x G x hd) into the
// partition's unnormalized output, with its max and sum for the merge.
template <int G>
__device__ void write_part(const float* red, const float* ml, float* part_out, float* part_ml,
                           int s, int n_heads, int kvh, int hd, int parts, int part, bool empty) {
    for (int i = threadIdx.x; i < G * hd; i += ATT_THREADS) {
        float sum = 0.0f;
        for (int w = 0; w < ATT_THREADS / 32; w++) sum += red[w * G * hd + i];
        int g = i / hd, d = i % hd;
        size_t h = (size_t)s * n_heads + kvh * G + g;
        part_out[(h * parts + part) * hd + d] = sum;
    }
    if (threadIdx.x < G) {
        size_t h = (size_t)s * n_heads + kvh * G + threadIdx.x;
        part_ml[(h * parts + part) * 2] = empty ? -INFINITY : ml[2 * threadIdx.x];
        part_ml[(h * parts + part) * 2 + 1] = empty ? 0.0f : ml[2 * threadIdx.x + 1];
    }
}

// Scores and values by shuffles, over any head_dim.
template <bool FP8, int G>
__device__ void attention_part(const float* q, const void* kc, const void* vc, const float* ks,
                               const float* vs, const int* tables, const int* table_off,
                               const int* lens, float* part_out, float* part_ml, int n_heads,
                               int kv_heads, int hd, int page_size, int parts, int part_len,
                               float scale) {
    constexpr int V = AttShape<FP8, G>::V;
    constexpr int BYTES = AttShape<FP8, G>::BYTES;
    constexpr int ELEM = FP8 ? 1 : 2;
    extern __shared__ __align__(16) float smem[];
    int kvh = blockIdx.x, s = blockIdx.y, part = blockIdx.z;
    int len = lens[s];
    int t0 = part * part_len;
    int t1 = min(len, t0 + part_len);
    int tpv = hd / V;                       // threads per vector
    int lanes = ATT_THREADS / tpv;          // tokens per round
    int sub = threadIdx.x % tpv, tl = threadIdx.x / tpv;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int warps = ATT_THREADS / 32;
    uint4* ring = (uint4*)smem;             // ATT_STAGES x ATT_THREADS pieces
    float* sring = (float*)(ring + ATT_STAGES * ATT_THREADS);  // their fp8 scales
    float* qs = sring + ATT_STAGES * ATT_THREADS;  // G x hd
    float* sc = qs + G * hd;                // G x PART
    float* ml = sc + G * PART;              // G x 2
    float* red = ml + 2 * G;                // warps x G x hd
    int* pg = (int*)(red + warps * G * hd); // the partition's pages
    const float* qsrc = q + ((size_t)s * n_heads + kvh * G) * hd;
    for (int i = threadIdx.x; i < G * hd; i += ATT_THREADS) qs[i] = qsrc[i];
    const int* table = tables + table_off[s];
    int p0 = t0 / page_size;
    for (int i = threadIdx.x; t0 < t1 && i <= (t1 - 1) / page_size - p0; i += ATT_THREADS)
        pg[i] = table[p0 + i];
    __syncthreads();
    int rounds = t1 > t0 ? (t1 - t0 + lanes - 1) / lanes : 0;
    // Round r's piece of this thread: token t0 + r * lanes + tl.
    auto vec_of = [&](int t) -> size_t {
        return kv_vec(pg[t / page_size - p0], t % page_size, kvh, kv_heads, page_size);
    };
    auto issue = [&](const void* base, const float* scales, int r) {
        int t = t0 + r * lanes + tl;
        if (r < rounds && t < t1) {
            size_t vec = vec_of(t);
            int slot = (r % ATT_STAGES) * ATT_THREADS + threadIdx.x;
            cp_async<BYTES>(&ring[slot], (const unsigned char*)base + (vec * hd + sub * V) * ELEM);
            // Static fp8 pages have no scales: 1 (a plain store the same
            // barrier publishes).
            if (FP8 && scales) cp_async<4>(&sring[slot], scales + vec);
            if (FP8 && !scales) sring[slot] = 1.0f;
        }
        cp_commit();
    };
    // Scores.
#pragma unroll
    for (int r = 0; r < ATT_STAGES - 1; r++) issue(kc, ks, r);
    for (int r = 0; r < rounds; r++) {
        issue(kc, ks, r + ATT_STAGES - 1);
        cp_wait<ATT_STAGES - 1>();
        int t = t0 + r * lanes + tl;
        bool valid = t < t1;
        int slot = (r % ATT_STAGES) * ATT_THREADS + threadIdx.x;
        float k[V];
        if (valid) {
            unpack<FP8, V>(ring[slot], k);
        } else {
#pragma unroll
            for (int j = 0; j < V; j++) k[j] = 0.0f;
        }
        float kscale = (FP8 && valid) ? sring[slot] * scale : scale;
#pragma unroll
        for (int g = 0; g < G; g++) {
            const float* qg = qs + g * hd + sub * V;
            float acc = 0.0f;
#pragma unroll
            for (int j = 0; j < V; j++) acc += qg[j] * k[j];
            for (int o = tpv / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
            if (valid && sub == 0) sc[g * PART + (t - t0)] = acc * kscale;
        }
    }
    cp_wait<0>();
    __syncthreads();
    softmax_part<G>(sc, ml, t1 - t0);
    __syncthreads();
    // Values: each thread sums its V dimensions for every head over its
    // tokens, then the token lanes of a warp fold together by shuffles and
    // the warps through shared memory.
    float acc[G][V];
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
        for (int j = 0; j < V; j++) acc[g][j] = 0.0f;
#pragma unroll
    for (int r = 0; r < ATT_STAGES - 1; r++) issue(vc, vs, r);
    for (int r = 0; r < rounds; r++) {
        issue(vc, vs, r + ATT_STAGES - 1);
        cp_wait<ATT_STAGES - 1>();
        int t = t0 + r * lanes + tl;
        if (t < t1) {
            int slot = (r % ATT_STAGES) * ATT_THREADS + threadIdx.x;
            float v[V];
            unpack<FP8, V>(ring[slot], v);
            float vscale = FP8 ? sring[slot] : 1.0f;
#pragma unroll
            for (int g = 0; g < G; g++) {
                float p = sc[g * PART + (t - t0)] * vscale;
#pragma unroll
                for (int j = 0; j < V; j++) acc[g][j] += p * v[j];
            }
        }
    }
    cp_wait<0>();
    // Lanes of one warp holding the same dimensions: lane ^ tpv, ^ 2 tpv...
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
        for (int j = 0; j < V; j++)
            for (int o = tpv; o < 32; o <<= 1)
                acc[g][j] += __shfl_xor_sync(0xffffffff, acc[g][j], o);
    if (lane < tpv) {
#pragma unroll
        for (int g = 0; g < G; g++)
#pragma unroll
            for (int j = 0; j < V; j++) red[(warp * G + g) * hd + sub * V + j] = acc[g][j];
    }
    __syncthreads();
    write_part<G>(red, ml, part_out, part_ml, s, n_heads, kvh, hd, parts, part, t1 <= t0);
}

#define ATTENTION_ENTRY(NAME, FP8, G)                                                           \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                  \
        NAME(const float* q, const void* kc, const void* vc, const float* ks, const float* vs,  \
             const int* tables, const int* table_off, const int* lens, float* part_out,         \
             float* part_ml, int n_heads, int kv_heads, int hd, int page_size, int parts,       \
             int part_len, float scale) {                                                       \
        PDL_ENTER();                                                                            \
        attention_part<FP8, G>(q, kc, vc, ks, vs, tables, table_off, lens, part_out, part_ml,   \
                               n_heads, kv_heads, hd, page_size, parts, part_len, scale);       \
    }

// One entry point per format and group size (query heads per KV head), so
// the sums stay in registers.
ATTENTION_ENTRY(attention_part_bf16_g1, false, 1)
ATTENTION_ENTRY(attention_part_bf16_g2, false, 2)
ATTENTION_ENTRY(attention_part_bf16_g3, false, 3)
ATTENTION_ENTRY(attention_part_bf16_g4, false, 4)
ATTENTION_ENTRY(attention_part_bf16_g5, false, 5)
ATTENTION_ENTRY(attention_part_bf16_g6, false, 6)
ATTENTION_ENTRY(attention_part_bf16_g7, false, 7)
ATTENTION_ENTRY(attention_part_bf16_g8, false, 8)
ATTENTION_ENTRY(attention_part_fp8_g1, true, 1)
ATTENTION_ENTRY(attention_part_fp8_g2, true, 2)
ATTENTION_ENTRY(attention_part_fp8_g3, true, 3)
ATTENTION_ENTRY(attention_part_fp8_g4, true, 4)
ATTENTION_ENTRY(attention_part_fp8_g5, true, 5)
ATTENTION_ENTRY(attention_part_fp8_g6, true, 6)
ATTENTION_ENTRY(attention_part_fp8_g7, true, 7)
ATTENTION_ENTRY(attention_part_fp8_g8, true, 8)

// Merges the partitions of each (seq, head): grid seqs x n_heads; threads
// over hd; `parts` floats of dynamic shared memory hold each partition's
// weight exp(m_p - m), computed once for the block. Writes `out`, or with
// `out16` bf16 rows for the next GEMM.
extern "C" __global__ void attention_merge(const float* part_out, const float* part_ml,
                                           float* out, __nv_bfloat16* out16, int parts, int hd) {
    PDL_ENTER();
    extern __shared__ float wts[];
    __shared__ float red[32];
    size_t h = blockIdx.x;
    const float* ml = part_ml + h * parts * 2;
    float m = -INFINITY;
    for (int p = threadIdx.x; p < parts; p += blockDim.x) m = fmaxf(m, ml[2 * p]);
    m = block_max(m, red);
    float l = 0.0f;
    for (int p = threadIdx.x; p < parts; p += blockDim.x) {
        float mp = ml[2 * p];
        float e = mp > -INFINITY ? __expf(mp - m) : 0.0f;
        wts[p] = e;
        l += e * ml[2 * p + 1];
    }
    l = block_sum(l, red);  // its barriers also publish wts
    float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const float* po = part_out + h * parts * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        int p = 0;
        for (; p + 4 <= parts; p += 4) {
#pragma unroll
            for (int k = 0; k < 4; k++) acc[k] += wts[p + k] * po[(size_t)(p + k) * hd + d];
        }
        for (; p < parts; p++) acc[0] += wts[p] * po[(size_t)p * hd + d];
        float o = ((acc[0] + acc[1]) + (acc[2] + acc[3])) * inv;
        if (out16 != nullptr) {
            out16[h * hd + d] = __float2bfloat16(o);
        } else {
            out[h * hd + d] = o;
        }
    }
}
