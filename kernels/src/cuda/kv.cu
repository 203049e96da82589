// Writes of K and V into their pages (see kv.rs; the layout is in
// common.cu).

// Writes one token's K and V per block (grid: tokens x kv_heads; threads:
// head_dim, a multiple of 32) at global slot slots[t] (page * page_size +
// slot in page); a token whose slot is negative writes nothing. Reference
// path (with kv_write_fp8): the engine's step writes K and V in
// rope_kv_write; kept for the parity tests, which fill pages with it, and
// for the test of the fused launch.
extern "C" __global__ void kv_write_bf16(const float* k, const float* v, const int* slots,
                                         __nv_bfloat16* kc, __nv_bfloat16* vc, int kv_heads,
                                         int hd, int page_size) {
    PDL_ENTER();
    int slot = slots[blockIdx.x];
    if (slot < 0) return;
    size_t src = ((size_t)blockIdx.x * kv_heads + blockIdx.y) * hd + threadIdx.x;
    size_t dst = kv_vec(slot / page_size, slot % page_size, blockIdx.y, kv_heads, page_size) * hd +
                 threadIdx.x;
    kc[dst] = __float2bfloat16(k[src]);
    vc[dst] = __float2bfloat16(v[src]);
}

__device__ void fp8_store(float x, float* red, unsigned char* out, float* scale_out, int hd) {
    float amax = fabsf(x);
    amax = warp_max(amax);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) red[warp] = amax;
    __syncthreads();
    float m = 0.0f;
    for (int w = 0; w < (hd + 31) / 32; w++) m = fmaxf(m, red[w]);
    float scale = (m > 0.0f && isfinite(m)) ? m / FP8_MAX : 1.0f;
    float inv = 1.0f / scale;
    __nv_fp8_e4m3 q(fminf(fmaxf(x * inv, -FP8_MAX), FP8_MAX));
    *out = q.__x;
    if (threadIdx.x == 0) *scale_out = scale;
}

// The static fp8 format's store: e4m3(x), saturating, no scale.
__device__ __forceinline__ void fp8_store_unit(float x, unsigned char* out) {
    __nv_fp8_e4m3 q(fminf(fmaxf(x, -FP8_MAX), FP8_MAX));
    *out = q.__x;
}

// As kv_write_bf16, in fp8 e4m3 with one scale per vector; with no scale
// buffers (ks null: the static format), with none.
extern "C" __global__ void kv_write_fp8(const float* k, const float* v, const int* slots,
                                        unsigned char* kc, unsigned char* vc, float* ks,
                                        float* vs, int kv_heads, int hd, int page_size) {
    PDL_ENTER();
    __shared__ float red[32];
    int slot = slots[blockIdx.x];
    if (slot < 0) return;
    size_t src = ((size_t)blockIdx.x * kv_heads + blockIdx.y) * hd + threadIdx.x;
    size_t vec = kv_vec(slot / page_size, slot % page_size, blockIdx.y, kv_heads, page_size);
    if (!ks) {
        fp8_store_unit(k[src], kc + vec * hd + threadIdx.x);
        fp8_store_unit(v[src], vc + vec * hd + threadIdx.x);
        return;
    }
    fp8_store(k[src], red, kc + vec * hd + threadIdx.x, ks + vec, hd);
    fp8_store(v[src], red, vc + vec * hd + threadIdx.x, vs + vec, hd);
}
