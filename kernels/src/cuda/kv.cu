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

// Copies n bytes, 16 at a time where both ends and n allow it (the same
// for the whole block).
__device__ void copy_span(unsigned char* dst, const unsigned char* src, long long n) {
    if ((((size_t)dst | (size_t)src | (size_t)n) & 15) == 0) {
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        for (long long i = threadIdx.x; i < n / 16; i += blockDim.x) d[i] = s[i];
    } else {
        for (long long i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
    }
}

// One layer's part of pages[i] (i = blockIdx.x) to (to_buf) or from `buf`,
// where it lies at i * per_page + layer_off as K (e bytes), V (e bytes),
// then s K scales and s V scales (f32; fp8 pages, else s = 0): the bytes the
// host's pages read and write (kv/transfer.rs). blockIdx.y picks the part.
extern "C" __global__ void kv_pages_copy(unsigned char* k, unsigned char* v, float* ks, float* vs,
                                         const unsigned* pages, long long e, long long s,
                                         long long per_page, long long layer_off,
                                         unsigned char* buf, int to_buf) {
    long long p = pages[blockIdx.x];
    unsigned char* at = buf + blockIdx.x * per_page + layer_off;
    unsigned char* dev;
    long long n = e;
    switch (blockIdx.y) {
        case 0: dev = k + p * e; break;
        case 1: dev = v + p * e; at += e; break;
        case 2: dev = (unsigned char*)(ks + p * s); n = s * 4; at += 2 * e; break;
        default: dev = (unsigned char*)(vs + p * s); n = s * 4; at += 2 * e + s * 4; break;
    }
    if (n == 0) return;
    if (to_buf) copy_span(at, dev, n);
    else copy_span(dev, at, n);
}
