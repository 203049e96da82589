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

__device__ __forceinline__ void load8(const __nv_bfloat16* p, float v[8]) {
    uint4 u = *(const uint4*)p;
    const __nv_bfloat162* h = (const __nv_bfloat162*)&u;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float2 f = __bfloat1622float2(h[j]);
        v[2 * j] = f.x;
        v[2 * j + 1] = f.y;
    }
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
