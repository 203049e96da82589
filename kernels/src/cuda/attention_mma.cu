// Tensor-core pieces of decode attention (used by attention_flash.cu): m16n8k16
// MMAs. For the scores, the G <= 8 query heads of one KV head are the A rows
// 0..7 as the high halves of Q and rows 8..15 as their low halves (hi + lo
// carry Q to ~2^-16 or better), so one MMA gives both terms of every score and
// all 16 rows work. Each lane loads whole 16-byte (or 8-byte) pieces straight
// from the pages; because the order of a reduction is free and the columns of a
// product may be any permutation we can undo, no data is shuffled between
// lanes. The f32 side of the values product (P) runs as two or three bf16 / f16
// terms, so the results stay within ~2^-22 of f32 arithmetic.

// fp8 pages on sm_89 and up score on e4m3 tensor cores (m16n8k32): the
// raw key bytes are the B operand as loaded, and Q rides as two e4m3
// pieces, hi (rows 0..7) and lo (rows 8..15, its residual times 16), so Q
// keeps ~2^-8 of its value (bf16's precision) with no conversion of K.
// (The instruction needs PTX ISA 8.4: CUDA 12.4 or later.)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && \
    (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 4))
#define FP8_MMA 1
#else
#define FP8_MMA 0
#endif

// d (a whole m16n8k32 tile, f32) += A * B over e4m3 inputs.
__device__ __forceinline__ void mma_e4m3(float* d, unsigned a0, unsigned a1, unsigned a2,
                                         unsigned a3, unsigned b0, unsigned b1) {
#if FP8_MMA
    asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// Four values as e4m3 in one word (x[0] in the low byte), and their
// residuals times 16 as e4m3 in `lo`.
__device__ __forceinline__ unsigned pack_e4m3(const float* x, unsigned& lo) {
    unsigned hi = 0;
    lo = 0;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        __nv_fp8_e4m3 h(x[e]);
        __nv_fp8_e4m3 l((x[e] - (float)h) * 16.0f);
        hi |= (unsigned)h.__x << (8 * e);
        lo |= (unsigned)l.__x << (8 * e);
    }
    return hi;
}

// d (a whole m16n8k16 tile, f32) += A * B. F16: f16 inputs, else bf16.
template <bool F16>
__device__ __forceinline__ void mma16(float* d, unsigned a0, unsigned a1, unsigned a2,
                                      unsigned a3, unsigned b0, unsigned b1) {
    if (F16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
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

// 16 bytes at p, read once: past L1.
__device__ __forceinline__ uint4 load16(const unsigned char* p) { return __ldcs((const uint4*)p); }

// WORDS 32-bit words from p (16-byte aligned when WORDS >= 4, else 8),
// read once.
template <int WORDS>
__device__ __forceinline__ void load_words(const unsigned char* p, unsigned* w) {
    if constexpr (WORDS >= 4) {
#pragma unroll
        for (int k = 0; k < WORDS / 4; k++) {
            uint4 v = load16(p + 16 * k);
            w[4 * k] = v.x;
            w[4 * k + 1] = v.y;
            w[4 * k + 2] = v.z;
            w[4 * k + 3] = v.w;
        }
    } else {
        uint2 v = __ldcs((const uint2*)p);
        w[0] = v.x;
        w[1] = v.y;
    }
}

// Q's A fragments for scoring against K pieces loaded as in score8_with: lane
// (row, j) holds head `row` (zero past G) at the dimensions of the pieces a
// lane j loads, as hi (A rows 0..7) and lo (A rows 8..15) halves: bf16 for
// bf16 pages; for fp8, e4m3 (E4) or else f16.
template <bool FP8, int G, int HD>
struct QFrags {
    static constexpr bool E4 = FP8 && FP8_MMA;   // e4m3 MMAs (m16n8k32)
    static constexpr int P = FP8 ? 16 : 8;       // elements per piece
    static constexpr int SP = E4 ? 2 : P / 4;    // MMA steps per piece
    static constexpr int PIECES = HD / (4 * P);  // pieces per lane per token
    static constexpr int STEPS = PIECES * SP;
    // Step s's A fragment: hi and lo of dimensions d, d + 1, then of d + 8,
    // d + 9 (as the m16n8k16 A registers a0..a3); with E4, hi and lo of
    // d..d + 3, then of d + 4..d + 7.
    uint4 a[STEPS];
    // E4: what the lane's head's scores are multiplied by (Q went in
    // scaled so its largest element is e4m3's largest).
    float inv = 1.0f;

    __device__ __forceinline__ QFrags(const float* qs, int row, int j) {
        if constexpr (E4) {
            // The lane's elements, loaded once (one round trip: at batch 1
            // this setup is on every block's critical path).
            float4 x[PIECES * P / 4];
            float amax = 0.0f;
#pragma unroll
            for (int i = 0; i < PIECES; i++) {
#pragma unroll
                for (int v = 0; v < P / 4; v++) {
                    float4 f = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    if (row < G) f = *(const float4*)(qs + row * HD + P * (j + 4 * i) + 4 * v);
                    x[i * P / 4 + v] = f;
                }
            }
#pragma unroll
            for (int v = 0; v < PIECES * P / 4; v++) {
                amax = fmaxf(amax, fmaxf(fmaxf(fabsf(x[v].x), fabsf(x[v].y)),
                                         fmaxf(fabsf(x[v].z), fabsf(x[v].w))));
            }
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, 1));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, 2));
            float sq = amax > 0.0f ? 448.0f / amax : 1.0f;
            if (!isfinite(sq)) sq = 1.0f;  // a Q below ~1e-36: scores of zero
            inv = 1.0f / sq;
#pragma unroll
            for (int i = 0; i < PIECES; i++) {
#pragma unroll
                for (int h = 0; h < SP; h++) {
                    // Elements 8h..8h + 7 of piece i: float4s 2h, 2h + 1.
                    float4 lo4 = x[i * P / 4 + 2 * h], hi4 = x[i * P / 4 + 2 * h + 1];
                    float y[8] = {lo4.x * sq, lo4.y * sq, lo4.z * sq, lo4.w * sq,
                                  hi4.x * sq, hi4.y * sq, hi4.z * sq, hi4.w * sq};
                    uint4& f = a[i * SP + h];
                    f.x = pack_e4m3(y, f.y);
                    f.z = pack_e4m3(y + 4, f.w);
                }
            }
        } else {
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
                    a[s].x = pack_split<FP8>(q0, q1, r0, r1);
                    a[s].z = pack_split<FP8>(q2, q3, r2, r3);
                    a[s].y = pack_split<FP8>(r0, r1, u0, u1);
                    a[s].w = pack_split<FP8>(r2, r3, u0, u1);
                }
            }
        }
    }

    // The fragments laid out [step][lane], so a warp reads a step's with one
    // conflict-free 16-byte load per lane, straight into an A operand.
    __device__ __forceinline__ void store(uint4* frags, int lane) const {
#pragma unroll
        for (int s = 0; s < STEPS; s++) frags[s * 32 + lane] = a[s];
    }

    // Floats of shared memory after the fragments: E4's per-head factors.
    static constexpr int SCALES = E4 ? 8 : 0;

    // E4: each head's factor into scales[row] (lanes j == 0).
    __device__ __forceinline__ void store_scale(float* scales, int row, int j) const {
        if (E4 && j == 0) scales[row] = inv;
    }

    // Scores of 8 tokens, step s's fragment from frag(s): lane (row, j)
    // passes pieces j, j + 4, ... of token `row` of the 8 (raw, zero for a
    // token past the end) and gets head row's scores of tokens 2j and
    // 2j + 1 (unscaled): C rows row (hi) plus row + 8 (lo). Two independent
    // sums (even and odd steps) keep the MMAs from waiting on each other.
    template <class F>
    static __device__ __forceinline__ void score8_with(const uint4* raw, float& d0, float& d1,
                                                       F frag) {
        float d[2][4] = {};
        if constexpr (E4) {
#pragma unroll
            for (int i = 0; i < PIECES; i++) {
                const unsigned* p = (const unsigned*)&raw[i];
#pragma unroll
                for (int h = 0; h < SP; h++) {
                    int s = i * SP + h;
                    uint4 f = frag(s);
                    mma_e4m3(d[s & 1], f.x, f.y, f.z, f.w, p[2 * h], p[2 * h + 1]);
                }
            }
            // Rows 8..15 carry Q's residuals times 16.
            d0 = (d[0][2] + d[1][2]) * 0.0625f + (d[0][0] + d[1][0]);
            d1 = (d[0][3] + d[1][3]) * 0.0625f + (d[0][1] + d[1][1]);
        } else {
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
                    uint4 f = frag(s);
                    mma16<FP8>(d[s & 1], f.x, f.y, f.z, f.w, w[2 * h], w[2 * h + 1]);
                }
            }
            d0 = (d[0][2] + d[1][2]) + (d[0][0] + d[1][0]);
            d1 = (d[0][3] + d[1][3]) + (d[0][1] + d[1][1]);
        }
    }
};

// Column block i of a values MMA from one lane's words of tokens a and b
// (its NB dimensions of each): the pair (a, b) of dimension i, as bf16 or
// (from e4m3) f16, token a in the low half.
template <bool FP8>
__device__ __forceinline__ unsigned token_pair(const unsigned* wa, const unsigned* wb, int i) {
    if (FP8) {
        int m = i >> 2, q = i & 3;
        unsigned x = __byte_perm(wa[m], wb[m], q < 2 ? 0x5140 : 0x7362);
        __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
            (__nv_fp8x2_storage_t)((q & 1) ? (x >> 16) : (x & 0xffff)), __NV_E4M3);
        return *(unsigned*)&h;
    } else {
        int m = i >> 1;
        return __byte_perm(wa[m], wb[m], (i & 1) ? 0x7632 : 0x5410);
    }
}

