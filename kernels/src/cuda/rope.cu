// Rotary position embedding, alone or with the keys and values then
// written into their pages (see rope.rs; uses kv.cu and hadamard.cu).

// One pair's rotation by the angle whose sine and cosine are s and c,
// with the roundings pinned so every kernel that rotates gives the same
// bits.
__device__ __forceinline__ void rotate_pair(float x0, float x1, float s, float c, float* o0,
                                            float* o1) {
    *o0 = __fmaf_rn(x0, c, -__fmul_rn(x1, s));
    *o1 = __fmaf_rn(x0, s, __fmul_rn(x1, c));
}

// Rotates every head of x (tokens x heads x dim) and of x2 (tokens x heads2
// x dim: a step's keys beside its queries, in the same launch) at its
// token's position. interleaved: pairs (2i, 2i+1) (GGUF llama); else (i,
// i + dim/2) (HF). Grid: (tokens, heads + heads2); threads over the dim/2
// pairs. Reference path: the engine's step uses rope_kv_write; kept for
// the parity tests of RoPE and of the fused launch.
extern "C" __global__ void rope(float* x, float* x2, const int* pos, const float* inv_freq,
                                int heads, int heads2, int dim, int interleaved) {
    PDL_LAUNCH();
    int half = dim / 2;
    int y = blockIdx.y;
    float* h = y < heads ? x + ((size_t)blockIdx.x * heads + y) * dim
                         : x2 + ((size_t)blockIdx.x * heads2 + y - heads) * dim;
    // The thread's first angle before the wait: positions are step inputs
    // no kernel writes, the frequencies constants.
    float p = (float)pos[blockIdx.x];
    float s0 = 0.0f, c0 = 0.0f;
    if (threadIdx.x < half) sincosf(p * inv_freq[threadIdx.x], &s0, &c0);
    PDL_WAIT();
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s = s0, c = c0;
        if (i != threadIdx.x) sincosf(p * inv_freq[i], &s, &c);
        int a = interleaved ? 2 * i : i;
        int b = interleaved ? 2 * i + 1 : i + half;
        rotate_pair(h[a], h[b], s, c, &h[a], &h[b]);
    }
}

// Heads rope_kv_write takes: up to ROPE_HD_MAX elements (a multiple of
// 32), ROPE_WARPS heads a block, a warp a head.
#define ROPE_HD_MAX 256
#define ROPE_WARPS 4

// hadamard_shared over one head held by a warp, lane l holding elements
// l + 32m in x[m]: the same stages in the same order, so the same bits
// (stages below 32 pair lanes, the others a lane's own elements).
__device__ __forceinline__ void hadamard_warp(float (&x)[ROPE_HD_MAX / 32], int hd, int lane) {
#pragma unroll
    for (int h = 1; h < 32; h <<= 1) {
        if (h < hd) {
#pragma unroll
            for (int m = 0; m < ROPE_HD_MAX / 32; m++) {
                float a = x[m], b = __shfl_xor_sync(0xffffffffu, a, h);
                x[m] = (lane & h) ? b - a : a + b;
            }
        }
    }
#pragma unroll
    for (int hm = 1; hm < ROPE_HD_MAX / 32; hm <<= 1) {
        if (32 * hm < hd) {
#pragma unroll
            for (int m = 0; m < ROPE_HD_MAX / 32; m++) {
                if ((m & hm) == 0) {
                    float a = x[m], b = x[m | hm];
                    x[m] = a + b;
                    x[m | hm] = a - b;
                }
            }
        }
    }
    float f = 1.0f / sqrtf((float)hd);
#pragma unroll
    for (int m = 0; m < ROPE_HD_MAX / 32; m++) x[m] *= f;
}

// One head vector (lane l's elements l + 32m in x) into its page slot:
// MODE 0 bf16, 1 e4m3 with the vector's scale (as fp8_store), 2 e4m3.
template <int MODE>
__device__ __forceinline__ void store_head(const float (&x)[ROPE_HD_MAX / 32], void* cache,
                                           float* scales, size_t vec, int hd, int lane) {
    float inv = 1.0f;
    if (MODE == 1) {
        float amax = 0.0f;
#pragma unroll
        for (int m = 0; m < ROPE_HD_MAX / 32; m++)
            if (lane + 32 * m < hd) amax = fmaxf(amax, fabsf(x[m]));
        amax = warp_max(amax);
        float scale = (amax > 0.0f && isfinite(amax)) ? amax / FP8_MAX : 1.0f;
        inv = 1.0f / scale;
        if (lane == 0) scales[vec] = scale;
    }
#pragma unroll
    for (int m = 0; m < ROPE_HD_MAX / 32; m++) {
        int e = lane + 32 * m;
        if (e >= hd) break;
        size_t at = vec * hd + e;
        if (MODE == 0) {
            ((__nv_bfloat16*)cache)[at] = __float2bfloat16(x[m]);
        } else if (MODE == 1) {
            __nv_fp8_e4m3 q(fminf(fmaxf(x[m] * inv, -FP8_MAX), FP8_MAX));
            ((unsigned char*)cache)[at] = q.__x;
        } else {
            fp8_store_unit(x[m], (unsigned char*)cache + at);
        }
    }
}

// The angles of a head's pairs at position p, as every warp that rotates
// a head takes them: lane l's pairs l + 32j.
__device__ __forceinline__ void head_angles(float p, const float* inv_freq, int hd, int lane,
                                            float (&s)[ROPE_HD_MAX / 64],
                                            float (&c)[ROPE_HD_MAX / 64]) {
#pragma unroll
    for (int j = 0; j < ROPE_HD_MAX / 64; j++) {
        int i = lane + 32 * j;
        if (i < hd / 2) sincosf(p * inv_freq[i], &s[j], &c[j]);
    }
}

// One head of src (hd elements, a multiple of 32 up to ROPE_HD_MAX)
// rotated by one warp at head_angles' angles, also into dst where OUT,
// through r (hd floats of shared memory the warp owns): lane l's elements
// l + 32m land in x[m]. A warp that rotates again through r syncs first.
template <bool OUT>
__device__ __forceinline__ void rotate_head(const float* src, float* dst,
                                            const float (&s)[ROPE_HD_MAX / 64],
                                            const float (&c)[ROPE_HD_MAX / 64], int hd,
                                            int interleaved, int lane, float* r,
                                            float (&x)[ROPE_HD_MAX / 32]) {
    int half = hd / 2;
#pragma unroll
    for (int j = 0; j < ROPE_HD_MAX / 64; j++) {
        int i = lane + 32 * j;
        if (i < half) {
            int a = interleaved ? 2 * i : i;
            int b = interleaved ? 2 * i + 1 : i + half;
            float o0, o1;
            rotate_pair(src[a], src[b], s[j], c[j], &o0, &o1);
            if (OUT) {
                dst[a] = o0;
                dst[b] = o1;
            }
            r[a] = o0;
            r[b] = o1;
        }
    }
    __syncwarp();
#pragma unroll
    for (int m = 0; m < ROPE_HD_MAX / 32; m++) {
        int e = lane + 32 * m;
        x[m] = e < hd ? r[e] : 0.0f;
    }
}

// A token's rotated key (x, as rotate_head leaves it) and its value (vr,
// hd floats) into their page slot `vec`, one warp.
template <int MODE>
__device__ __forceinline__ void store_kv(const float (&x)[ROPE_HD_MAX / 32], const float* vr,
                                         void* kc, void* vc, float* ks, float* vs, size_t vec,
                                         int hd, int lane) {
    float vx[ROPE_HD_MAX / 32];
#pragma unroll
    for (int m = 0; m < ROPE_HD_MAX / 32; m++) {
        int e = lane + 32 * m;
        vx[m] = e < hd ? vr[e] : 0.0f;
    }
    store_head<MODE>(x, kc, ks, vec, hd, lane);
    store_head<MODE>(vx, vc, vs, vec, hd, lane);
}

// rope over a step's queries and keys, then kv_write, in one launch (a
// decode step's layer saves a launch and a pass over the keys). Grid:
// tokens x ceil((heads + kv_heads) / ROPE_WARPS), ROPE_WARPS warps a
// block, one head a warp (a block a head left a 1024-token prefill's
// 40960 blocks latency-bound at a sixth of copy bandwidth).
// Head y < heads is query head y, rotated into `q_out` (tokens x heads x
// hd; `q` itself when rotating in place); the others rotate key head
// y - heads in place and write it, rotated, and its value into the pages.
// Token t's query heads start at q + t * q_ld, its key and value heads at
// k + t * kv_ld and v + t * kv_ld: separate buffers, or the rows of one
// stacked projection [q | k | v].
//
// MODE 0: bf16 pages; 1: fp8 with a scale per vector; 2: static fp8 (no
// scales), queries and keys rotated by hadamard_warp after RoPE, the
// rotated values what q_out, k and the pages get.
template <int MODE>
__device__ void rope_kv_write(const float* q, float* k, const float* v, int q_ld, int kv_ld,
                              float* q_out, const int* pos, const float* inv_freq,
                              const int* slots, void* kc, void* vc, float* ks, float* vs,
                              int heads, int kv_heads, int hd, int page_size, int interleaved) {
    __shared__ float rot[ROPE_WARPS][ROPE_HD_MAX];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int t = blockIdx.x, y = blockIdx.y * ROPE_WARPS + warp;
    // A warp past the last head leaves: nothing below syncs the block.
    if (y >= heads + kv_heads) return;
    bool is_q = y < heads;
    int kvh = y - heads;
    const float* src = is_q ? q + (size_t)t * q_ld + (size_t)y * hd
                            : k + (size_t)t * kv_ld + (size_t)kvh * hd;
    float* dst = is_q ? q_out + ((size_t)t * heads + y) * hd
                      : k + (size_t)t * kv_ld + (size_t)kvh * hd;
    // The angles before the wait: positions are step inputs no kernel
    // writes, the frequencies constants.
    float s[ROPE_HD_MAX / 64], c[ROPE_HD_MAX / 64];
    head_angles((float)pos[t], inv_freq, hd, lane, s, c);
    PDL_WAIT();
    float x[ROPE_HD_MAX / 32];
    rotate_head<MODE != 2>(src, dst, s, c, hd, interleaved, lane, rot[warp], x);
    if (MODE == 2) {
        hadamard_warp(x, hd, lane);
#pragma unroll
        for (int m = 0; m < ROPE_HD_MAX / 32; m++)
            if (lane + 32 * m < hd) dst[lane + 32 * m] = x[m];
    }
    if (is_q) return;
    int slot = slots[t];  // after the wait: the tag check clears it
    if (slot < 0) return;
    size_t vec = kv_vec(slot / page_size, slot % page_size, kvh, kv_heads, page_size);
    store_kv<MODE>(x, v + (size_t)t * kv_ld + (size_t)kvh * hd, kc, vc, ks, vs, vec, hd, lane);
}

// A decode step's RoPE and KV write done by its attention instead of
// rope_kv_write (attention_flash with a RopeIn, see rope_attention.rs):
// the step's queries, keys and values, unrotated, token t's heads at
// q + t * q_ld, k + t * kv_ld and v + t * kv_ld (separate rows, or one
// stacked projection's); none where q is null.
struct RopeIn {
    const float* q;
    const float* k;
    const float* v;
    const int* pos;
    const float* inv_freq;
    const int* slots;
    int q_ld;
    int kv_ld;
    int interleaved;
};

#define ROPE_KV_WRITE(NAME, MODE)                                                              \
    extern "C" __global__ void NAME(const float* q, float* k, const float* v, int q_ld,        \
                                    int kv_ld, float* q_out, const int* pos,                   \
                                    const float* inv_freq, const int* slots, void* kc,         \
                                    void* vc, float* ks, float* vs, int heads, int kv_heads,   \
                                    int hd, int page_size, int interleaved) {                  \
        PDL_LAUNCH();                                                                         \
        rope_kv_write<MODE>(q, k, v, q_ld, kv_ld, q_out, pos, inv_freq, slots, kc, vc, ks, vs,  \
                           heads, kv_heads, hd, page_size, interleaved);                       \
    }

ROPE_KV_WRITE(rope_kv_write_bf16, 0)
ROPE_KV_WRITE(rope_kv_write_fp8, 1)
ROPE_KV_WRITE(rope_kv_write_fp8s, 2)
