// Activations as e4m3 with a scale per row for the W8A8 GEMM (see
// fp8_gemm.rs): a row's largest magnitude over 448 is its scale, as
// fp8.rs encodes. One block per row; rows of a multiple of 8 elements
// move in 16-byte (bf16) or 32-byte (f32) loads and 8-byte stores, since
// a 1024-token prefill quantizes ~90 MB of activations a layer.

__device__ __forceinline__ void load8(const float* p, float v[8]) {
    float4 a = ((const float4*)p)[0], b = ((const float4*)p)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

// The 8 floats of a packed piece of bf16.
__device__ __forceinline__ void unpack8(uint4 p, float v[8]) {
    const __nv_bfloat162* h = (const __nv_bfloat162*)&p;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        float2 f = __bfloat1622float2(h[e]);
        v[2 * e] = f.x;
        v[2 * e + 1] = f.y;
    }
}

__device__ __forceinline__ void load8(const __nv_bfloat16* p, float v[8]) {
    unpack8(*(const uint4*)p, v);
}

__device__ __forceinline__ float load1(const float* p) { return *p; }
__device__ __forceinline__ float load1(const __nv_bfloat16* p) { return __bfloat162float(*p); }

// One e4m3 code of v / scale (inv = 1 / scale), clamped as fp8.rs clamps.
__device__ __forceinline__ unsigned char e4m3_code(float v, float inv) {
    __nv_fp8_e4m3 q(fminf(fmaxf(v * inv, -FP8_MAX), FP8_MAX));
    return q.__x;
}

// Eight e4m3 codes, element 0 in the lowest byte.
__device__ __forceinline__ uint2 e4m3_piece(const float v[8], float inv) {
    unsigned int lo = 0, hi = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        lo |= (unsigned int)e4m3_code(v[j], inv) << (8 * j);
        hi |= (unsigned int)e4m3_code(v[4 + j], inv) << (8 * j);
    }
    return make_uint2(lo, hi);
}

template <typename T>
__device__ __forceinline__ void quant_row_e4m3(const T* r, unsigned char* o, float* scale_out,
                                               int K) {
    __shared__ float red[32];
    bool wide = (K & 7) == 0;
    float amax = 0.0f;
    if (wide) {
        for (int i = threadIdx.x; i < K / 8; i += blockDim.x) {
            float v[8];
            load8(r + 8 * (size_t)i, v);
#pragma unroll
            for (int j = 0; j < 8; j++) amax = fmaxf(amax, fabsf(v[j]));
        }
    } else {
        for (int i = threadIdx.x; i < K; i += blockDim.x) amax = fmaxf(amax, fabsf(load1(r + i)));
    }
    amax = block_max(amax, red);
    float scale = (amax > 0.0f && isfinite(amax)) ? amax / FP8_MAX : 1.0f;
    float inv = 1.0f / scale;
    if (wide) {
        for (int i = threadIdx.x; i < K / 8; i += blockDim.x) {
            float v[8];
            load8(r + 8 * (size_t)i, v);
            ((uint2*)o)[i] = e4m3_piece(v, inv);
        }
    } else {
        for (int i = threadIdx.x; i < K; i += blockDim.x) o[i] = e4m3_code(load1(r + i), inv);
    }
    if (threadIdx.x == 0) *scale_out = scale;
}

// Rows of K f32 activations as e4m3 codes into q, their scales into scales.
extern "C" __global__ void quant_rows_e4m3(const float* x, unsigned char* q, float* scales,
                                           int K) {
    PDL_ENTER();
    size_t row = blockIdx.x;
    quant_row_e4m3(x + row * K, q + row * K, scales + row, K);
}

// As quant_rows_e4m3, from bf16 activations (a bf16 GEMM's scratch: what
// the norm, SiLU-and-multiply or attention wrote for the next product).
extern "C" __global__ void quant_rows_e4m3_bf16(const __nv_bfloat16* x, unsigned char* q,
                                                float* scales, int K) {
    PDL_ENTER();
    size_t row = blockIdx.x;
    quant_row_e4m3(x + row * K, q + row * K, scales + row, K);
}

// The down projection's input straight from a gate/up product: row r of
// gu (rows x 2f bf16, gate then up) to e4m3 codes of bf16(silu(g) * u),
// the values silu_mul_pairs writes, with the row's scale as
// quant_rows_e4m3_bf16 takes it from them (so the same codes, without the
// bf16 row's write and read). One block per row, f a multiple of 8; a
// thread issues the loads of all its (up to SILU_Q_PIECES) pieces of 8
// before it computes any, so a prefill row's ~57 KB are in flight at once,
// and keeps the bf16 products in their registers; wider rows compute their
// pieces twice. Blocks of 256 threads, or of 512 for a few rows (decode),
// where one block's row is the whole launch.
#define SILU_Q_PIECES 8

// bf16(silu(g) * u) of 8 gate and 8 up values, packed as g and u were.
__device__ __forceinline__ uint4 silu_pack(uint4 g, uint4 u) {
    const __nv_bfloat162* g2 = (const __nv_bfloat162*)&g;
    const __nv_bfloat162* u2 = (const __nv_bfloat162*)&u;
    uint4 o;
    __nv_bfloat162* o2 = (__nv_bfloat162*)&o;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        float2 gf = __bfloat1622float2(g2[e]), uf = __bfloat1622float2(u2[e]);
        o2[e] = __floats2bfloat162_rn(silu_times(gf.x, uf.x), silu_times(gf.y, uf.y));
    }
    return o;
}

__device__ __forceinline__ void silu_piece(const __nv_bfloat16* row, int f, int p, float v[8]) {
    unpack8(silu_pack(*(const uint4*)(row + 8 * p), *(const uint4*)(row + f + 8 * p)), v);
}

extern "C" __global__ void __launch_bounds__(512) silu_mul_pairs_e4m3(const __nv_bfloat16* gu, unsigned char* q,
                                               float* scales, int f) {
    PDL_ENTER();
    const int threads = blockDim.x;
    __shared__ float red[32];
    const __nv_bfloat16* row = gu + (size_t)blockIdx.x * 2 * f;
    unsigned char* o = q + (size_t)blockIdx.x * f;
    int pieces = f / 8;
    uint4 g[SILU_Q_PIECES], u[SILU_Q_PIECES];
#pragma unroll
    for (int j = 0; j < SILU_Q_PIECES; j++) {
        int p = threadIdx.x + j * threads;
        if (p < pieces) {
            g[j] = *(const uint4*)(row + 8 * p);
            u[j] = *(const uint4*)(row + f + 8 * p);
        }
    }
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < SILU_Q_PIECES; j++) {
        int p = threadIdx.x + j * threads;
        if (p < pieces) {
            g[j] = silu_pack(g[j], u[j]);
            float v[8];
            unpack8(g[j], v);
#pragma unroll
            for (int e = 0; e < 8; e++) amax = fmaxf(amax, fabsf(v[e]));
        }
    }
    for (int p = threadIdx.x + SILU_Q_PIECES * threads; p < pieces; p += threads) {
        float w[8];
        silu_piece(row, f, p, w);
#pragma unroll
        for (int e = 0; e < 8; e++) amax = fmaxf(amax, fabsf(w[e]));
    }
    amax = block_max(amax, red);
    float scale = (amax > 0.0f && isfinite(amax)) ? amax / FP8_MAX : 1.0f;
    float inv = 1.0f / scale;
#pragma unroll
    for (int j = 0; j < SILU_Q_PIECES; j++) {
        int p = threadIdx.x + j * threads;
        if (p < pieces) {
            float v[8];
            unpack8(g[j], v);
            ((uint2*)o)[p] = e4m3_piece(v, inv);
        }
    }
    for (int p = threadIdx.x + SILU_Q_PIECES * threads; p < pieces; p += threads) {
        float w[8];
        silu_piece(row, f, p, w);
        ((uint2*)o)[p] = e4m3_piece(w, inv);
    }
    if (threadIdx.x == 0) scales[blockIdx.x] = scale;
}

// rmsnorm_residual's norm with its row written as e4m3 codes and the row's
// scale, as quant_rows_e4m3 takes them from the f32 row rmsnorm_residual
// writes (the codes of the W8A8 GEMM after it, without that row's write
// and read): x[row] += residual[row] (if residual is not null), then
// q[row] = e4m3(rmsnorm(x[row]) * w / scale). One block per row, dim a
// multiple of 4 and at most 4 NORM_PIECES x blockDim (the row held in
// registers, as rmsnorm_residual holds it).
extern "C" __global__ void rmsnorm_residual_e4m3(float* x, const float* residual, const float* w,
                                                 unsigned char* q, float* scales, int dim,
                                                 float eps) {
    PDL_LAUNCH();
    __shared__ float red[32];
    float* xr = x + (size_t)blockIdx.x * dim;
    const float* rr = residual ? residual + (size_t)blockIdx.x * dim : nullptr;
    int n4 = dim >> 2;
    // The weights (never written by a step) load before the wait.
    float4 g[NORM_PIECES];
#pragma unroll
    for (int k = 0; k < NORM_PIECES; k++) {
        int i = threadIdx.x + k * blockDim.x;
        if (i < n4) g[k] = ((const float4*)w)[i];
    }
    PDL_WAIT();
    float4 v[NORM_PIECES];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_PIECES; k++) {
        int i = threadIdx.x + k * blockDim.x;
        if (i < n4) {
            float4 a = ((const float4*)xr)[i];
            if (rr) {
                float4 b = ((const float4*)rr)[i];
                a = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
                ((float4*)xr)[i] = a;
            }
            v[k] = a;
            ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
        }
    }
    float inv = norm_factor(block_sum(ss, red), dim, eps);
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_PIECES; k++) {
        int i = threadIdx.x + k * blockDim.x;
        if (i < n4) {
            v[k] = make_float4(v[k].x * inv * g[k].x, v[k].y * inv * g[k].y,
                               v[k].z * inv * g[k].z, v[k].w * inv * g[k].w);
            amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v[k].x), fabsf(v[k].y)),
                                     fmaxf(fabsf(v[k].z), fabsf(v[k].w))));
        }
    }
    amax = block_max(amax, red);
    float scale = (amax > 0.0f && isfinite(amax)) ? amax / FP8_MAX : 1.0f;
    float qinv = 1.0f / scale;
    unsigned int* o = (unsigned int*)(q + (size_t)blockIdx.x * dim);
#pragma unroll
    for (int k = 0; k < NORM_PIECES; k++) {
        int i = threadIdx.x + k * blockDim.x;
        if (i < n4) {
            o[i] = (unsigned int)e4m3_code(v[k].x, qinv) |
                   (unsigned int)e4m3_code(v[k].y, qinv) << 8 |
                   (unsigned int)e4m3_code(v[k].z, qinv) << 16 |
                   (unsigned int)e4m3_code(v[k].w, qinv) << 24;
        }
    }
    if (threadIdx.x == 0) scales[blockIdx.x] = scale;
}
