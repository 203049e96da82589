// Kiln's CUDA kernels, compiled at run time by NVRTC. Every kernel has a CPU
// reference in kiln-kernels; the parity tests hold them to it.
//
// Layouts follow the CPU side: activations are row-major f32; weights are
// row-major bf16 [out][in]; KV element (page, slot, head, d) lives at
// ((page * kv_heads + head) * page_size + slot) * head_dim + d, with one f32
// scale per (page, slot, head) vector in the fp8 format (e4m3(x / s),
// s = amax / 448).

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#define FP8_MAX 448.0f

// Programmatic dependent launch (sm_90 and up; see graph.rs): every kernel
// opens with PDL_ENTER (or PDL_LAUNCH, loads that need no earlier result,
// then PDL_WAIT): it lets the next kernel of a captured step start its
// blocks, then waits until the kernels before it have finished and their
// writes are visible, before it reads or writes anything they touch.
// Outside a programmatic edge both are no-ops.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_LAUNCH() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define PDL_LAUNCH()
#define PDL_WAIT()
#endif
#define PDL_ENTER() \
    do {            \
        PDL_LAUNCH(); \
        PDL_WAIT();   \
    } while (0)

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

// Sum (or, with MAX, maximum) over the block (blockDim.x a multiple of 32,
// at most 1024); every thread gets it.
template <bool MAX>
__device__ float block_reduce(float v, float* shared32) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = MAX ? warp_max(v) : warp_sum(v);
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    int warps = blockDim.x >> 5;
    float none = MAX ? -INFINITY : 0.0f;
    v = (threadIdx.x < warps) ? shared32[threadIdx.x] : none;
    if (warp == 0) v = MAX ? warp_max(v) : warp_sum(v);
    if (threadIdx.x == 0) shared32[0] = v;
    __syncthreads();
    return shared32[0];
}

__device__ float block_sum(float v, float* shared32) { return block_reduce<false>(v, shared32); }

__device__ float block_max(float v, float* shared32) { return block_reduce<true>(v, shared32); }

// 16-byte pieces a thread of rmsnorm_residual keeps in registers.
#define NORM_PIECES 4

// Four results at element 4i of a row: f32 into out, or rounded to bf16
// into outb where it is not null (the input of a bf16 GEMM).
__device__ __forceinline__ void store4(float* out, __nv_bfloat16* outb, int i, float4 v) {
    if (outb) {
        __nv_bfloat162* o2 = (__nv_bfloat162*)(outb + 4 * (size_t)i);
        o2[0] = __floats2bfloat162_rn(v.x, v.y);
        o2[1] = __floats2bfloat162_rn(v.z, v.w);
    } else {
        ((float4*)out)[i] = v;
    }
}

// The RMSNorm's factor for a row of K elements whose squares sum to ss
// (rmsnorm_residual, and the GEMVs with the norm folded in).
__device__ __forceinline__ float norm_factor(float ss, int K, float eps) {
    return rsqrtf(ss / K + eps);
}

// x[row] += residual[row] (if residual is not null), then
// out[row] = x[row] / sqrt(mean(x[row]^2) + eps) * w (into outb as bf16
// instead where outb is not null). One block per row;
// where dim is a multiple of 4 and at most 16 x blockDim, each thread
// keeps its 16-byte pieces of the row in registers between the two
// passes (a decode step's one row is then a single round of loads).
extern "C" __global__ void rmsnorm_residual(float* x, const float* residual, const float* w,
                                            float* out, __nv_bfloat16* outb, int dim,
                                            float eps) {
    PDL_LAUNCH();
    __shared__ float red[32];
    float* xr = x + (size_t)blockIdx.x * dim;
    const float* rr = residual ? residual + (size_t)blockIdx.x * dim : nullptr;
    float* o = outb ? nullptr : out + (size_t)blockIdx.x * dim;
    __nv_bfloat16* ob = outb ? outb + (size_t)blockIdx.x * dim : nullptr;
    float ss = 0.0f;
    if ((dim & 3) == 0 && dim <= 4 * NORM_PIECES * (int)blockDim.x) {
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
#pragma unroll
        for (int k = 0; k < NORM_PIECES; k++) {
            int i = threadIdx.x + k * blockDim.x;
            if (i < n4) {
                store4(o, ob, i, make_float4(v[k].x * inv * g[k].x, v[k].y * inv * g[k].y,
                                             v[k].z * inv * g[k].z, v[k].w * inv * g[k].w));
            }
        }
        return;
    }
    PDL_WAIT();
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xr[i];
        if (rr) { v += rr[i]; xr[i] = v; }
        ss += v * v;
    }
    float inv = norm_factor(block_sum(ss, red), dim, eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xr[i] * inv * w[i];
        if (ob) {
            ob[i] = __float2bfloat16(v);
        } else {
            o[i] = v;
        }
    }
}

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
// pairs.
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

// silu(g) * u, as every kernel that computes it rounds it.
__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// gate[i] = silu(gate[i]) * up[i] (into outb as bf16 instead where outb is
// not null: the input of the down projection's bf16 GEMM).
extern "C" __global__ void silu_mul(float* gate, const float* up, __nv_bfloat16* outb, int n) {
    PDL_ENTER();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = silu_times(gate[i], up[i]);
        if (outb) {
            outb[i] = __float2bfloat16(v);
        } else {
            gate[i] = v;
        }
    }
}

// out[t] = table[ids[t]] (bf16 rows to f32). One block per token.
extern "C" __global__ void embed_bf16(const __nv_bfloat16* table, const unsigned* ids,
                                      float* out, int hidden) {
    PDL_ENTER();
    const __nv_bfloat16* row = table + (size_t)ids[blockIdx.x] * hidden;
    float* o = out + (size_t)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = __bfloat162float(row[i]);
}

// The vector index of (page, slot in page, head): a head's vectors of one
// page lie together.
__device__ __forceinline__ size_t kv_vec(size_t page, int slot, int head, int kv_heads,
                                         int page_size) {
    return (page * kv_heads + head) * page_size + slot;
}

// Writes one token's K and V per block (grid: tokens x kv_heads; threads:
// head_dim, a multiple of 32) at global slot slots[t] (page * page_size +
// slot in page); a token whose slot is negative writes nothing.
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

// Rotates x (n elements in shared memory, thread i holding element i, n
// threads) by the orthonormal Walsh-Hadamard transform, as
// kiln_kernels::hadamard::rotate does and in its order: stage h pairs i
// with i ^ h.
__device__ void hadamard_shared(float* x, int n) {
    int i = threadIdx.x;
    for (int h = 1; h < n; h <<= 1) {
        float a = x[i], b = x[i ^ h];
        __syncthreads();
        x[i] = (i & h) ? b - a : a + b;
        __syncthreads();
    }
    x[i] *= 1.0f / sqrtf((float)n);
}

// Rotates each row of hd (a power of two up to 1024) of x in place by
// hadamard_shared: grid rows, threads hd. The reference rope_kv_write's
// rotation is checked against.
extern "C" __global__ void hadamard_rows(float* x, int hd) {
    PDL_ENTER();
    __shared__ float r[1024];
    float* row = x + (size_t)blockIdx.x * hd;
    r[threadIdx.x] = row[threadIdx.x];
    __syncthreads();
    hadamard_shared(r, hd);
    row[threadIdx.x] = r[threadIdx.x];
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

// Most tokens per attention partition.
#define PART 256

// Merges the partitions of each (seq, head): grid seqs x n_heads; threads
// over hd; `parts` floats of dynamic shared memory hold each partition's
// weight exp(m_p - m), computed once for the block.
extern "C" __global__ void attention_merge(const float* part_out, const float* part_ml,
                                           float* out, int parts, int hd) {
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
        out[h * hd + d] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) * inv;
    }
}

// The batched page-tag check, run inside a step before anything reads or
// writes KV. Inputs sit in `in`, the step's one buffer of 32-bit words (word
// offsets given): `expected` holds two u64 words (generation, tenant) per
// block-table entry, `tables` the entries, sequence s's at
// seq_tab[s]..seq_tab[s + 1]; `current` two u64 words per physical page.
// flags[s] = 1 when every page of s still carries the tag s recorded. When
// s fails and tok_off >= 0, its tokens t in tok_off[s]..tok_off[s + 1] get
// lens[t] = 0 and slots[t] = -1, so the rest of the step neither reads nor
// writes its pages. Grid: sequences.
extern "C" __global__ void tag_check(unsigned* in, int expected, int tables, int seq_tab,
                                     int tok_off, int lens, int slots,
                                     const unsigned long long* current, unsigned* flags) {
    PDL_ENTER();
    int s = blockIdx.x;
    const unsigned long long* exp = (const unsigned long long*)(in + expected);
    const int* tab = (const int*)(in + tables);
    const int* st = (const int*)(in + seq_tab);
    int ok = 1;
    for (int i = st[s] + threadIdx.x; i < st[s + 1]; i += blockDim.x) {
        size_t p = (unsigned)tab[i];
        if (current[2 * p] != exp[2 * i] || current[2 * p + 1] != exp[2 * i + 1]) ok = 0;
    }
    ok = __syncthreads_and(ok);
    if (threadIdx.x == 0) flags[s] = ok;
    if (!ok && tok_off >= 0) {
        const int* to = (const int*)(in + tok_off);
        for (int t = to[s] + threadIdx.x; t < to[s + 1]; t += blockDim.x) {
            ((int*)(in + lens))[t] = 0;
            ((int*)(in + slots))[t] = -1;
        }
    }
}

// Pages given new tags since the last step: `n` triples of u64 words
// (page, generation, tenant) at word offset `changes` of `in`; a page at or
// past `pages` is padding (a captured step has room for a fixed number).
extern "C" __global__ void tag_scatter(const unsigned* in, int changes, int n,
                                       unsigned long long* current, long long pages) {
    PDL_ENTER();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned long long* c = (const unsigned long long*)(in + changes) + 3 * i;
    if (c[0] >= (unsigned long long)pages) return;
    current[2 * c[0]] = c[1];
    current[2 * c[0] + 1] = c[2];
}

// Keeps (v, i) in (bv, bi) when v is larger, or equal at a lower index
// (NaN never wins).
__device__ __forceinline__ void arg_take(float& bv, int& bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) {
        bv = v;
        bi = i;
    }
}

// Greedy sampling: the index of each row's largest logit (the lowest index
// on ties, as on the CPU). Grid: rows; threads: a multiple of 32. Rows of
// a multiple of 4 are read as 16-byte pieces, four pieces in flight per
// thread.
extern "C" __global__ void argmax_rows(const float* logits, int n, unsigned* out) {
    PDL_ENTER();
    __shared__ float wv[32];
    __shared__ int wi[32];
    const float* row = logits + (size_t)blockIdx.x * n;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    int bd = blockDim.x;
    if ((n & 3) == 0) {
        const float4* r4 = (const float4*)row;
        int n4 = n >> 2, i = threadIdx.x;
        for (; i + 3 * bd < n4; i += 4 * bd) {
            float4 a[4];
#pragma unroll
            for (int k = 0; k < 4; k++) a[k] = r4[i + k * bd];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                int e = 4 * (i + k * bd);
                arg_take(bv, bi, a[k].x, e);
                arg_take(bv, bi, a[k].y, e + 1);
                arg_take(bv, bi, a[k].z, e + 2);
                arg_take(bv, bi, a[k].w, e + 3);
            }
        }
        for (; i < n4; i += bd) {
            float4 a = r4[i];
            arg_take(bv, bi, a.x, 4 * i);
            arg_take(bv, bi, a.y, 4 * i + 1);
            arg_take(bv, bi, a.z, 4 * i + 2);
            arg_take(bv, bi, a.w, 4 * i + 3);
        }
    } else {
        for (int i = threadIdx.x; i < n; i += bd) arg_take(bv, bi, row[i], i);
    }
    for (int o = 16; o > 0; o >>= 1) {
        float v = __shfl_xor_sync(0xffffffff, bv, o);
        int j = __shfl_xor_sync(0xffffffff, bi, o);
        arg_take(bv, bi, v, j);
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        wv[warp] = bv;
        wi[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        bv = lane < (bd >> 5) ? wv[lane] : -INFINITY;
        bi = lane < (bd >> 5) ? wi[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            float v = __shfl_xor_sync(0xffffffff, bv, o);
            int j = __shfl_xor_sync(0xffffffff, bi, o);
            arg_take(bv, bi, v, j);
        }
        if (lane == 0) out[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;
    }
}

#define GEMV_MAX_M 8

// f32 to bf16, element-wise (activations before a cuBLAS GEMM).
extern "C" __global__ void to_bf16(const float* x, __nv_bfloat16* y, long long n) {
    PDL_ENTER();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2bfloat16(x[i]);
}

// bf16 to f32, element-wise.
extern "C" __global__ void to_f32(const __nv_bfloat16* x, float* y, long long n) {
    PDL_ENTER();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __bfloat162float(x[i]);
}

// x[r][c] += b[c] over rows x cols (the q/k/v biases of Qwen2).
extern "C" __global__ void add_bias(float* x, const float* b, long long n, int cols) {
    PDL_ENTER();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += b[i % cols];
}

// out[i] = src[idx[i]] for rows of `cols` floats. One block per row.
extern "C" __global__ void gather_rows(const float* src, const unsigned* idx, float* out, int cols) {
    PDL_ENTER();
    const float* row = src + (size_t)idx[blockIdx.x] * cols;
    float* o = out + (size_t)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) o[i] = row[i];
}
