// GGUF block-quantized weights on the device (see quant.rs).
// Blocks of 32 elements: Q8_0 = f16 d, 32 int8 (w = d q); Q4_0 = f16 d, 16
// bytes of nibbles (w = d (q - 8)); Q4_1 = f16 d, f16 m, 16 bytes of
// nibbles (w = d q + m). Nibble j < 16 is the low half of byte j, j >= 16
// the high half of byte j - 16. DT: 0 = Q8_0, 1 = Q4_0, 2 = Q4_1.

// Most activation rows of a decode GEMV (`GEMV_MAX_M` in gemv.rs).
#define GEMV_MAX_M 8

template <int DT> struct QBlock;
template <> struct QBlock<0> { static const int bytes = 34; };
template <> struct QBlock<1> { static const int bytes = 18; };
template <> struct QBlock<2> { static const int bytes = 20; };

// One block's quants as floats, with w = d * q[j] + mn.
template <int DT>
__device__ __forceinline__ void load_block(const unsigned char* b, float* q, float& d, float& mn) {
    d = __half2float(*(const __half*)b);
    if (DT == 0) {
        mn = 0.0f;
        const unsigned short* p = (const unsigned short*)(b + 2);
#pragma unroll
        for (int j = 0; j < 16; j++) {
            unsigned short v = p[j];
            q[2 * j] = (float)(signed char)(v & 0xff);
            q[2 * j + 1] = (float)(signed char)(v >> 8);
        }
    } else {
        const unsigned short* p;
        if (DT == 1) {
            mn = -8.0f * d;
            p = (const unsigned short*)(b + 2);
        } else {
            mn = __half2float(*(const __half*)(b + 2));
            p = (const unsigned short*)(b + 4);
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            unsigned short v = p[j];
            q[2 * j] = (float)(v & 0xf);
            q[2 * j + 1] = (float)((v >> 8) & 0xf);
            q[16 + 2 * j] = (float)((v >> 4) & 0xf);
            q[16 + 2 * j + 1] = (float)(v >> 12);
        }
    }
}

// One element of a row of blocks.
template <int DT>
__device__ __forceinline__ float block_elem(const unsigned char* row, long long i) {
    const unsigned char* b = row + (i / 32) * QBlock<DT>::bytes;
    float d = __half2float(*(const __half*)b);
    int j = i % 32;
    if (DT == 0) return d * (float)(signed char)b[2 + j];
    int off = DT == 1 ? 2 : 4;
    int q = j < 16 ? (b[off + j] & 0xf) : (b[off + j - 16] >> 4);
    if (DT == 1) return d * (float)(q - 8);
    return d * (float)q + __half2float(*(const __half*)(b + 2));
}

// Decode GEMV over block-quantized weights: out[m][n] = sum_k x[m][k] w[n][k]
// for m < M <= 8, in f32 like the CPU (per block: d * (q . x) + mn * sum(x)).
// One warp per output row, 8 warps per block; lanes take whole blocks.
// Rows go to the parts of `o` as in gemv.cu (stacked weights).
template <int DT>
__device__ void gemv_q(const float* x, const unsigned char* w, Outs o, int M, int K) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int n = blockIdx.x * (blockDim.x >> 5) + warp;
    if (n >= o.n) return;
    int nb = K / 32;
    const unsigned char* row = w + (size_t)n * nb * QBlock<DT>::bytes;
    float acc[GEMV_MAX_M];
#pragma unroll
    for (int m = 0; m < GEMV_MAX_M; m++) acc[m] = 0.0f;
    for (int blk = lane; blk < nb; blk += 32) {
        float q[32], d, mn;
        load_block<DT>(row + (size_t)blk * QBlock<DT>::bytes, q, d, mn);
#pragma unroll
        for (int m = 0; m < GEMV_MAX_M; m++) {
            if (m < M) {
                const float4* xv = (const float4*)(x + (size_t)m * K + blk * 32);
                float dot = 0.0f, sum = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    float4 a = xv[j];
                    dot += a.x * q[4 * j] + a.y * q[4 * j + 1] + a.z * q[4 * j + 2] +
                           a.w * q[4 * j + 3];
                    sum += a.x + a.y + a.z + a.w;
                }
                acc[m] += d * dot + mn * sum;
            }
        }
    }
#pragma unroll
    for (int m = 0; m < GEMV_MAX_M; m++) {
        if (m < M) {
            float v = warp_sum(acc[m]);
            if (lane == 0) put_out(o, m, n, v);
        }
    }
}

// Dequantizes n elements of contiguous blocks to f32 (one thread each).
template <int DT>
__device__ void dequant_f32(const unsigned char* src, float* dst, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = block_elem<DT>(src, i);
}

// out[t] = row ids[t] of a block-quantized table of `cols` columns. One
// block per token.
template <int DT>
__device__ void embed_q(const unsigned char* table, const unsigned* ids, float* out, int cols) {
    const unsigned char* row = table + (size_t)ids[blockIdx.x] * (cols / 32) * QBlock<DT>::bytes;
    float* o = out + (size_t)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) o[i] = block_elem<DT>(row, i);
}

// FP8 rows (DType::Fp8Row): each row a 16-byte header (f32 scale, zeros)
// then K e4m3 bytes; w = e4m3 * scale. Decode GEMV: one warp per row, 16
// weights per lane load and four loads in flight a lane (as the bf16 GEMV),
// f32 sums, the scale applied once per row.
template <int M>
__device__ __forceinline__ void fma16_fp8(float* acc, uint4 p, const float* x, int K, int c0) {
    const unsigned short* pairs = (const unsigned short*)&p;
#pragma unroll
    for (int m = 0; m < M; m++) {
        const float4* xv = (const float4*)(x + (size_t)m * K + c0);
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            // Converted where used (not all 16 first): at one row the
            // kernel must fit 48 registers.
            __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(pairs[2 * j], __NV_E4M3);
            __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(pairs[2 * j + 1], __NV_E4M3);
            float2 a = __half22float2(*(const __half2*)&lo);
            float2 b = __half22float2(*(const __half2*)&hi);
            float4 v = xv[j];
            dot += v.x * a.x + v.y * a.y + v.z * b.x + v.w * b.y;
        }
        acc[m] += dot;
    }
}

// The first U loads of each lane go out before the wait for the kernel
// that writes x (a step never writes weights), as in gemv_bf16_acc.
template <int M>
__device__ void gemv_fp8_rows(const float* x, const unsigned char* w, Outs o, int K) {
    const int U = 4;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int n = blockIdx.x * (blockDim.x >> 5) + warp;
    if (n >= o.n) {
        PDL_WAIT();
        return;
    }
    const unsigned char* row = w + (size_t)n * (16 + K);
    float scale = *(const float*)row;
    const uint4* q = (const uint4*)(row + 16);
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; m++) acc[m] = 0.0f;
    int chunks = K / 16, c = lane;
    if (c + 32 * (U - 1) < chunks) {
        uint4 p[U];
#pragma unroll
        for (int u = 0; u < U; u++) p[u] = ld_stream(q + c + 32 * u);
        PDL_WAIT();
#pragma unroll
        for (int u = 0; u < U; u++) fma16_fp8<M>(acc, p[u], x, K, (c + 32 * u) * 16);
        c += 32 * U;
    } else {
        PDL_WAIT();
    }
    for (; c + 32 * (U - 1) < chunks; c += 32 * U) {
        uint4 p[U];
#pragma unroll
        for (int u = 0; u < U; u++) p[u] = ld_stream(q + c + 32 * u);
#pragma unroll
        for (int u = 0; u < U; u++) fma16_fp8<M>(acc, p[u], x, K, (c + 32 * u) * 16);
    }
    for (; c < chunks; c += 32) fma16_fp8<M>(acc, ld_stream(q + c), x, K, c * 16);
#pragma unroll
    for (int m = 0; m < M; m++) {
        float v = warp_sum(acc[m]);
        if (lane == 0) put_out(o, m, n, v * scale);
    }
}

// One row of x (decode at one sequence, the product that matters most):
// at most 48 registers, so five blocks of 8 warps share an SM and a
// 4096-row product runs in one wave of an H200 (the kernel for 2-8 rows
// takes 86, three blocks an SM, 1.3 waves; at 40 registers it spills).
extern "C" __global__ void __launch_bounds__(256, 5)
    gemv_fp8row_1(const float* x, const unsigned char* w, float* o0, float* o1, float* o2,
                  int n0, int n1, int M, int N, int K) {
    PDL_LAUNCH();
    gemv_fp8_rows<1>(x, w, Outs{o0, o1, o2, n0, n1, N}, K);
}

extern "C" __global__ void gemv_fp8row(const float* x, const unsigned char* w, float* o0,
                                       float* o1, float* o2, int n0, int n1, int M, int N,
                                       int K) {
    PDL_LAUNCH();
    Outs o{o0, o1, o2, n0, n1, N};
    switch (M) {
        case 1: gemv_fp8_rows<1>(x, w, o, K); break;
        case 2: gemv_fp8_rows<2>(x, w, o, K); break;
        case 3: gemv_fp8_rows<3>(x, w, o, K); break;
        case 4: gemv_fp8_rows<4>(x, w, o, K); break;
        case 5: gemv_fp8_rows<5>(x, w, o, K); break;
        case 6: gemv_fp8_rows<6>(x, w, o, K); break;
        case 7: gemv_fp8_rows<7>(x, w, o, K); break;
        default: gemv_fp8_rows<8>(x, w, o, K); break;
    }
}

// FP8 rows of K (a multiple of 16) as bf16 (for a cuBLAS GEMM): a thread
// per 16 weights, one 16-byte load and two 16-byte stores.
extern "C" __global__ void dequant_fp8row_bf16(const unsigned char* src, __nv_bfloat16* dst,
                                               long long pieces, int K) {
    PDL_ENTER();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= pieces) return;
    long long r = i / (K / 16);
    int c = (int)(i % (K / 16));
    const unsigned char* row = src + r * (16 + (long long)K);
    float scale = *(const float*)row;
    uint4 p = *(const uint4*)(row + 16 + 16 * c);
    const unsigned short* pairs = (const unsigned short*)&p;
    uint4 out[2];
    unsigned* o = (unsigned*)out;
#pragma unroll
    for (int e = 0; e < 8; e++) {
        __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(pairs[e], __NV_E4M3);
        float2 f = __half22float2(*(const __half2*)&hr);
        __nv_bfloat162 b = __floats2bfloat162_rn(f.x * scale, f.y * scale);
        o[e] = *(unsigned*)&b;
    }
    uint4* d = (uint4*)(dst + r * K + 16 * c);
    d[0] = out[0];
    d[1] = out[1];
}

// Dequantizes n elements of FP8 rows of K to f32 (one thread each). The
// block formats' dequant kernels take K too (unused) so one launcher
// serves them all.
extern "C" __global__ void dequant_fp8row(const unsigned char* src, float* dst, long long n,
                                          int K) {
    PDL_ENTER();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned char* row = src + (i / K) * (16 + (long long)K);
    __nv_fp8_e4m3 v;
    v.__x = row[16 + i % K];
    dst[i] = (float)v * *(const float*)row;
}

// out[t] = row ids[t] of an FP8-row table of `cols` columns. One block per
// token.
extern "C" __global__ void embed_fp8row(const unsigned char* table, const unsigned* ids,
                                        float* out, int cols) {
    PDL_ENTER();
    const unsigned char* row = table + (size_t)ids[blockIdx.x] * (16 + cols);
    float scale = *(const float*)row;
    float* o = out + (size_t)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        __nv_fp8_e4m3 v;
        v.__x = row[16 + i];
        o[i] = (float)v * scale;
    }
}

// As embed_fp8row, from FP8 rows packed for tensor cores: the codes of
// each row without its header, and the rows' scales apart.
extern "C" __global__ void embed_fp8_packed(const unsigned char* codes, const float* scales,
                                            const unsigned* ids, float* out, int cols) {
    PDL_ENTER();
    unsigned id = ids[blockIdx.x];
    const unsigned char* row = codes + (size_t)id * cols;
    float scale = scales[id];
    float* o = out + (size_t)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        __nv_fp8_e4m3 v;
        v.__x = row[i];
        o[i] = (float)v * scale;
    }
}

#define QUANT_ENTRIES(SUFFIX, DT)                                                               \
    extern "C" __global__ void gemv_##SUFFIX(const float* x, const unsigned char* w, float* o0,  \
                                             float* o1, float* o2, int n0, int n1, int M,       \
                                             int N, int K) {                                    \
        PDL_ENTER();                                                                            \
        gemv_q<DT>(x, w, Outs{o0, o1, o2, n0, n1, N}, M, K);                                    \
    }                                                                                           \
    extern "C" __global__ void dequant_##SUFFIX(const unsigned char* src, float* dst,           \
                                                long long n, int K) {                           \
        PDL_ENTER();                                                                            \
        dequant_f32<DT>(src, dst, n);                                                           \
    }                                                                                           \
    extern "C" __global__ void embed_##SUFFIX(const unsigned char* table, const unsigned* ids,  \
                                              float* out, int cols) {                           \
        PDL_ENTER();                                                                            \
        embed_q<DT>(table, ids, out, cols);                                                     \
    }

QUANT_ENTRIES(q8_0, 0)
QUANT_ENTRIES(q4_0, 1)
QUANT_ENTRIES(q4_1, 2)
