// Paged decode attention (appended to kernels.cu), split along the
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

#define ATT_THREADS 128
#define ATT_STAGES 4

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// An asynchronous copy of BYTES (8 or 16) from global to shared memory.
template <int BYTES>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
    if (BYTES == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                     "n"(BYTES));
    }
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

// D (rows 0..7 of a m16n8k16 tile, f32) += A * B, A's rows 8..15 zero
// (at most 8 query heads share a KV head). F16: f16 inputs, else bf16.
template <bool F16>
__device__ __forceinline__ void mma_rows8(float& d0, float& d1, unsigned a0, unsigned a2,
                                          unsigned b0, unsigned b1) {
    float d2 = 0.0f, d3 = 0.0f;
    unsigned z = 0;
    if (F16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
            : "r"(a0), "r"(z), "r"(a2), "r"(z), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
            : "r"(a0), "r"(z), "r"(a2), "r"(z), "r"(b0), "r"(b1));
    }
}

// (x, y) as two f16 (F16) or bf16 in one word, low half x; the rounding
// errors go to rx, ry (so hi + lo carries x to ~2^-16 or better).
template <bool F16>
__device__ __forceinline__ unsigned pack_split(float x, float y, float& rx, float& ry) {
    unsigned w;
    if (F16) {
        __half2 h = __floats2half2_rn(x, y);
        rx = x - __low2float(h);
        ry = y - __high2float(h);
        w = *(unsigned*)&h;
    } else {
        __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
        rx = x - __low2float(h);
        ry = y - __high2float(h);
        w = *(unsigned*)&h;
    }
    return w;
}

// Scores of one partition on tensor cores: S = Q (G x HD) K^T, each warp
// taking 8 tokens at a time (4 lanes a token, each loading whole 16-byte
// pieces: 8 bf16 or 16 fp8 elements, fp8 turned into f16 in registers).
// The dot product's order of dimensions is free, so a lane's k positions
// are the dimensions of the pieces it loaded, and Q's fragments follow the
// same order. Q runs as hi + lo halves (two MMAs a step), keeping the
// scores close to f32; K is exact in bf16 (bf16 pages) or f16 (fp8 pages).
template <bool FP8, int G, int HD>
__device__ void scores_mma(const void* kc, const float* ks, const int* pg, int p0, int page_size,
                           int kv_heads, int kvh, int t0, int t1, const float* qs, float* sc,
                           float scale) {
    constexpr int P = FP8 ? 16 : 8;        // elements per piece
    constexpr int SP = P / 4;              // MMA steps per piece
    constexpr int PIECES = HD / (4 * P);   // pieces per lane per token
    constexpr int STEPS = HD / 16;
    constexpr int ELEM = FP8 ? 1 : 2;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int j = lane & 3, row = lane >> 2;
    unsigned qa0[STEPS], qa2[STEPS], qb0[STEPS], qb2[STEPS];
#pragma unroll
    for (int i = 0; i < PIECES; i++) {
#pragma unroll
        for (int h = 0; h < SP; h++) {
            int s = i * SP + h, d = P * (j + 4 * i) + 4 * h;
            float q0 = 0.0f, q1 = 0.0f, q2 = 0.0f, q3 = 0.0f;
            if (row < G) {
                const float* qr = qs + row * HD + d;
                q0 = qr[0];
                q1 = qr[1];
                q2 = qr[2];
                q3 = qr[3];
            }
            float r0, r1, r2, r3, u0, u1;
            qa0[s] = pack_split<FP8>(q0, q1, r0, r1);
            qa2[s] = pack_split<FP8>(q2, q3, r2, r3);
            qb0[s] = pack_split<FP8>(r0, r1, u0, u1);
            qb2[s] = pack_split<FP8>(r2, r3, u0, u1);
        }
    }
    auto vec_of = [&](int t) -> size_t {
        return kv_vec(pg[t / page_size - p0], t % page_size, kvh, kv_heads, page_size);
    };
    int rounds = (t1 - t0 + 31) / 32;
    for (int r = 0; r < rounds; r++) {
        int base = t0 + r * 32 + warp * 8;
        int n = base + row;
        uint4 raw[PIECES];
        if (n < t1) {
            const uint4* src = (const uint4*)((const unsigned char*)kc + vec_of(n) * HD * ELEM);
#pragma unroll
            for (int i = 0; i < PIECES; i++) raw[i] = __ldg(src + j + 4 * i);
        } else {
#pragma unroll
            for (int i = 0; i < PIECES; i++) raw[i] = make_uint4(0, 0, 0, 0);
        }
        float d0 = 0.0f, d1 = 0.0f;
#pragma unroll
        for (int i = 0; i < PIECES; i++) {
            unsigned w[P / 2];
            if (FP8) {
                const __nv_fp8x2_storage_t* p = (const __nv_fp8x2_storage_t*)&raw[i];
#pragma unroll
                for (int x = 0; x < P / 2; x++) {
                    __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(p[x], __NV_E4M3);
                    w[x] = *(unsigned*)&hr;
                }
            } else {
                const unsigned* p = (const unsigned*)&raw[i];
#pragma unroll
                for (int x = 0; x < P / 2; x++) w[x] = p[x];
            }
#pragma unroll
            for (int h = 0; h < SP; h++) {
                int s = i * SP + h;
                mma_rows8<FP8>(d0, d1, qa0[s], qa2[s], w[2 * h], w[2 * h + 1]);
                mma_rows8<FP8>(d0, d1, qb0[s], qb2[s], w[2 * h], w[2 * h + 1]);
            }
        }
        // This lane holds head `row`, tokens base + 2j and base + 2j + 1.
        int ta = base + 2 * j;
        if (row < G) {
            if (ta < t1) sc[row * PART + ta - t0] = d0 * scale * (FP8 ? ks[vec_of(ta)] : 1.0f);
            if (ta + 1 < t1)
                sc[row * PART + ta + 1 - t0] = d1 * scale * (FP8 ? ks[vec_of(ta + 1)] : 1.0f);
        }
    }
}

template <bool FP8, int G>
struct AttShape {
    static const int V = (FP8 && G <= 4) ? 16 : 8;  // elements per piece
    static const int BYTES = V * (FP8 ? 1 : 2);     // bytes per piece
};

// HD = 0: scores by shuffles over any head_dim; HD = 64 or 128: scores by
// scores_mma for that head_dim.
template <bool FP8, int G, int HD>
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
            if (FP8) cp_async<4>(&sring[slot], scales + vec);
        }
        cp_commit();
    };
    // Scores.
    if constexpr (HD > 0) {
        scores_mma<FP8, G, HD>(kc, ks, pg, p0, page_size, kv_heads, kvh, t0, t1, qs, sc, scale);
    } else {
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
    }
    __syncthreads();
    // Softmax pieces: one warp per head.
    for (int g = warp; g < G; g += warps) {
        float m = -INFINITY;
        for (int i = lane; i < t1 - t0; i += 32) m = fmaxf(m, sc[g * PART + i]);
        m = warp_max(m);
        float l = 0.0f;
        for (int i = lane; i < t1 - t0; i += 32) {
            float p = __expf(sc[g * PART + i] - m);
            sc[g * PART + i] = p;
            l += p;
        }
        l = warp_sum(l);
        if (lane == 0) {
            ml[2 * g] = m;
            ml[2 * g + 1] = l;
        }
    }
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
    for (int i = threadIdx.x; i < G * hd; i += ATT_THREADS) {
        float sum = 0.0f;
        for (int w = 0; w < warps; w++) sum += red[w * G * hd + i];
        int g = i / hd, d = i % hd;
        size_t h = (size_t)s * n_heads + kvh * G + g;
        part_out[(h * parts + part) * hd + d] = sum;
    }
    if (threadIdx.x < G) {
        size_t h = (size_t)s * n_heads + kvh * G + threadIdx.x;
        bool empty = t1 <= t0;
        part_ml[(h * parts + part) * 2] = empty ? -INFINITY : ml[2 * threadIdx.x];
        part_ml[(h * parts + part) * 2 + 1] = empty ? 0.0f : ml[2 * threadIdx.x + 1];
    }
}

#define ATTENTION_ENTRY(NAME, FP8, G, HD)                                                       \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                  \
        NAME(const float* q, const void* kc, const void* vc, const float* ks, const float* vs,  \
             const int* tables, const int* table_off, const int* lens, float* part_out,         \
             float* part_ml, int n_heads, int kv_heads, int hd, int page_size, int parts,       \
             int part_len, float scale) {                                                       \
        attention_part<FP8, G, HD>(q, kc, vc, ks, vs, tables, table_off, lens, part_out,        \
                                   part_ml, n_heads, kv_heads, hd, page_size, parts, part_len,  \
                                   scale);                                                      \
    }

// One entry point per format and group size (query heads per KV head), so
// the sums stay in registers; the tensor-core ones also per head_dim.
ATTENTION_ENTRY(attention_part_bf16_g1, false, 1, 0)
ATTENTION_ENTRY(attention_part_bf16_g2, false, 2, 0)
ATTENTION_ENTRY(attention_part_bf16_g3, false, 3, 0)
ATTENTION_ENTRY(attention_part_bf16_g4, false, 4, 0)
ATTENTION_ENTRY(attention_part_bf16_g5, false, 5, 0)
ATTENTION_ENTRY(attention_part_bf16_g6, false, 6, 0)
ATTENTION_ENTRY(attention_part_bf16_g7, false, 7, 0)
ATTENTION_ENTRY(attention_part_bf16_g8, false, 8, 0)
ATTENTION_ENTRY(attention_part_fp8_g1, true, 1, 0)
ATTENTION_ENTRY(attention_part_fp8_g2, true, 2, 0)
ATTENTION_ENTRY(attention_part_fp8_g3, true, 3, 0)
ATTENTION_ENTRY(attention_part_fp8_g4, true, 4, 0)
ATTENTION_ENTRY(attention_part_fp8_g5, true, 5, 0)
ATTENTION_ENTRY(attention_part_fp8_g6, true, 6, 0)
ATTENTION_ENTRY(attention_part_fp8_g7, true, 7, 0)
ATTENTION_ENTRY(attention_part_fp8_g8, true, 8, 0)
ATTENTION_ENTRY(attention_mma_bf16_g1_d64, false, 1, 64)
ATTENTION_ENTRY(attention_mma_bf16_g2_d64, false, 2, 64)
ATTENTION_ENTRY(attention_mma_bf16_g3_d64, false, 3, 64)
ATTENTION_ENTRY(attention_mma_bf16_g4_d64, false, 4, 64)
ATTENTION_ENTRY(attention_mma_bf16_g5_d64, false, 5, 64)
ATTENTION_ENTRY(attention_mma_bf16_g6_d64, false, 6, 64)
ATTENTION_ENTRY(attention_mma_bf16_g7_d64, false, 7, 64)
ATTENTION_ENTRY(attention_mma_bf16_g8_d64, false, 8, 64)
ATTENTION_ENTRY(attention_mma_bf16_g1_d128, false, 1, 128)
ATTENTION_ENTRY(attention_mma_bf16_g2_d128, false, 2, 128)
ATTENTION_ENTRY(attention_mma_bf16_g3_d128, false, 3, 128)
ATTENTION_ENTRY(attention_mma_bf16_g4_d128, false, 4, 128)
ATTENTION_ENTRY(attention_mma_bf16_g5_d128, false, 5, 128)
ATTENTION_ENTRY(attention_mma_bf16_g6_d128, false, 6, 128)
ATTENTION_ENTRY(attention_mma_bf16_g7_d128, false, 7, 128)
ATTENTION_ENTRY(attention_mma_bf16_g8_d128, false, 8, 128)
ATTENTION_ENTRY(attention_mma_fp8_g1_d64, true, 1, 64)
ATTENTION_ENTRY(attention_mma_fp8_g2_d64, true, 2, 64)
ATTENTION_ENTRY(attention_mma_fp8_g3_d64, true, 3, 64)
ATTENTION_ENTRY(attention_mma_fp8_g4_d64, true, 4, 64)
ATTENTION_ENTRY(attention_mma_fp8_g5_d64, true, 5, 64)
ATTENTION_ENTRY(attention_mma_fp8_g6_d64, true, 6, 64)
ATTENTION_ENTRY(attention_mma_fp8_g7_d64, true, 7, 64)
ATTENTION_ENTRY(attention_mma_fp8_g8_d64, true, 8, 64)
ATTENTION_ENTRY(attention_mma_fp8_g1_d128, true, 1, 128)
ATTENTION_ENTRY(attention_mma_fp8_g2_d128, true, 2, 128)
ATTENTION_ENTRY(attention_mma_fp8_g3_d128, true, 3, 128)
ATTENTION_ENTRY(attention_mma_fp8_g4_d128, true, 4, 128)
ATTENTION_ENTRY(attention_mma_fp8_g5_d128, true, 5, 128)
ATTENTION_ENTRY(attention_mma_fp8_g6_d128, true, 6, 128)
ATTENTION_ENTRY(attention_mma_fp8_g7_d128, true, 7, 128)
ATTENTION_ENTRY(attention_mma_fp8_g8_d128, true, 8, 128)
