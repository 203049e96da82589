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

// rope over a step's queries and keys, then kv_write, in one launch (a
// decode step's layer saves a launch and a pass over the keys). Grid:
// tokens x (heads + kv_heads); threads: dim (a multiple of 32, up to 1024).
// Block y < heads rotates query head y into `q_out` (tokens x heads x hd;
// `q` itself when rotating in place); the others rotate key head
// y - heads in place and write it, rotated, and its value into the pages.
// Token t's query heads start at q + t * q_ld, its key and value heads at
// k + t * kv_ld and v + t * kv_ld: separate buffers, or the rows of one
// stacked projection [q | k | v].
//
// MODE 0: bf16 pages; 1: fp8 with a scale per vector; 2: static fp8 (no
// scales), queries and keys rotated by hadamard_shared after RoPE, the
// rotated values what q_out, k and the pages get.
template <int MODE>
__device__ void rope_kv_write(const float* q, float* k, const float* v, int q_ld, int kv_ld,
                              float* q_out, const int* pos, const float* inv_freq,
                              const int* slots, void* kc, void* vc, float* ks, float* vs,
                              int heads, int kv_heads, int hd, int page_size, int interleaved) {
    __shared__ float rot[1024];
    __shared__ float red[32];
    int t = blockIdx.x, y = blockIdx.y, i = threadIdx.x, half = hd / 2;
    bool is_q = y < heads;
    int kvh = y - heads;
    const float* src = is_q ? q + (size_t)t * q_ld + (size_t)y * hd
                            : k + (size_t)t * kv_ld + (size_t)kvh * hd;
    float* dst = is_q ? q_out + ((size_t)t * heads + y) * hd
                      : k + (size_t)t * kv_ld + (size_t)kvh * hd;
    // The angle before the wait: positions are step inputs no kernel
    // writes, the frequencies constants.
    float s = 0.0f, c = 0.0f;
    if (i < half) sincosf((float)pos[t] * inv_freq[i], &s, &c);
    PDL_WAIT();
    if (i < half) {
        int a = interleaved ? 2 * i : i;
        int b = interleaved ? 2 * i + 1 : i + half;
        float o0, o1;
        rotate_pair(src[a], src[b], s, c, &o0, &o1);
        if (MODE != 2) {
            dst[a] = o0;
            dst[b] = o1;
        }
        rot[a] = o0;
        rot[b] = o1;
    }
    if (MODE == 2) {
        __syncthreads();  // rot complete
        hadamard_shared(rot, hd);
        dst[i] = rot[i];
    }
    if (is_q) return;
    int slot = slots[t];  // after the wait: the tag check clears it
    if (slot < 0) return;
    __syncthreads();  // rot complete
    float kx = rot[i];
    float vx = v[(size_t)t * kv_ld + (size_t)kvh * hd + i];
    size_t vec = kv_vec(slot / page_size, slot % page_size, kvh, kv_heads, page_size);
    if (MODE == 2) {
        fp8_store_unit(kx, (unsigned char*)kc + vec * hd + i);
        fp8_store_unit(vx, (unsigned char*)vc + vec * hd + i);
    } else if (MODE == 1) {
        fp8_store(kx, red, (unsigned char*)kc + vec * hd + i, ks + vec, hd);
        fp8_store(vx, red, (unsigned char*)vc + vec * hd + i, vs + vec, hd);
    } else {
        ((__nv_bfloat16*)kc)[vec * hd + i] = __float2bfloat16(kx);
        ((__nv_bfloat16*)vc)[vec * hd + i] = __float2bfloat16(vx);
    }
}

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
