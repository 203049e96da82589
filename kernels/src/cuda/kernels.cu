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

// Sum over the block (blockDim.x a multiple of 32, at most 1024).
__device__ float block_sum(float v, float* shared32) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    int warps = blockDim.x >> 5;
    v = (threadIdx.x < warps) ? shared32[threadIdx.x] : 0.0f;
    if (warp == 0) v = warp_sum(v);
    if (threadIdx.x == 0) shared32[0] = v;
    __syncthreads();
    return shared32[0];
}

// x[row] += residual[row] (if residual is not null), then
// out[row] = x[row] / sqrt(mean(x[row]^2) + eps) * w. One block per row.
extern "C" __global__ void rmsnorm_residual(float* x, const float* residual, const float* w,
                                            float* out, int dim, float eps) {
    __shared__ float red[32];
    float* xr = x + (size_t)blockIdx.x * dim;
    const float* rr = residual ? residual + (size_t)blockIdx.x * dim : nullptr;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xr[i];
        if (rr) { v += rr[i]; xr[i] = v; }
        ss += v * v;
    }
    float inv = rsqrtf(block_sum(ss, red) / dim + eps);
    float* o = out + (size_t)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i] * inv * w[i];
}

// Rotates every head of x (tokens x heads x dim) at its token's position.
// interleaved: pairs (2i, 2i+1) (GGUF llama); else (i, i + dim/2) (HF).
// Grid: (tokens, heads); threads over the dim/2 pairs.
extern "C" __global__ void rope(float* x, const int* pos, const float* inv_freq, int heads,
                                int dim, int interleaved) {
    int half = dim / 2;
    float* h = x + ((size_t)blockIdx.x * heads + blockIdx.y) * dim;
    float p = (float)pos[blockIdx.x];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf(p * inv_freq[i], &s, &c);
        int a = interleaved ? 2 * i : i;
        int b = interleaved ? 2 * i + 1 : i + half;
        float x0 = h[a], x1 = h[b];
        h[a] = x0 * c - x1 * s;
        h[b] = x0 * s + x1 * c;
    }
}

// gate[i] = silu(gate[i]) * up[i].
extern "C" __global__ void silu_mul(float* gate, const float* up, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float g = gate[i];
        gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// out[t] = table[ids[t]] (bf16 rows to f32). One block per token.
extern "C" __global__ void embed_bf16(const __nv_bfloat16* table, const unsigned* ids,
                                      float* out, int hidden) {
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

// As kv_write_bf16, in fp8 e4m3 with one scale per vector.
extern "C" __global__ void kv_write_fp8(const float* k, const float* v, const int* slots,
                                        unsigned char* kc, unsigned char* vc, float* ks,
                                        float* vs, int kv_heads, int hd, int page_size) {
    __shared__ float red[32];
    int slot = slots[blockIdx.x];
    if (slot < 0) return;
    size_t src = ((size_t)blockIdx.x * kv_heads + blockIdx.y) * hd + threadIdx.x;
    size_t vec = kv_vec(slot / page_size, slot % page_size, blockIdx.y, kv_heads, page_size);
    fp8_store(k[src], red, kc + vec * hd + threadIdx.x, ks + vec, hd);
    fp8_store(v[src], red, vc + vec * hd + threadIdx.x, vs + vec, hd);
}

// Most tokens per attention partition.
#define PART 256

// Merges the partitions of each (seq, head): grid seqs x n_heads; threads
// over hd.
extern "C" __global__ void attention_merge(const float* part_out, const float* part_ml,
                                           float* out, int parts, int hd) {
    size_t h = blockIdx.x;
    float m = -INFINITY;
    for (int p = 0; p < parts; p++) m = fmaxf(m, part_ml[(h * parts + p) * 2]);
    float l = 0.0f;
    for (int p = 0; p < parts; p++) {
        float mp = part_ml[(h * parts + p) * 2];
        if (mp > -INFINITY) l += __expf(mp - m) * part_ml[(h * parts + p) * 2 + 1];
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (int p = 0; p < parts; p++) {
            float mp = part_ml[(h * parts + p) * 2];
            if (mp > -INFINITY) acc += __expf(mp - m) * part_out[(h * parts + p) * hd + d];
        }
        out[h * hd + d] = l > 0.0f ? acc / l : 0.0f;
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
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned long long* c = (const unsigned long long*)(in + changes) + 3 * i;
    if (c[0] >= (unsigned long long)pages) return;
    current[2 * c[0]] = c[1];
    current[2 * c[0] + 1] = c[2];
}

// Greedy sampling: the index of each row's largest logit (the lowest index
// on ties, as on the CPU). Grid: rows; 256 threads.
extern "C" __global__ void argmax_rows(const float* logits, int n, unsigned* out) {
    __shared__ float best_v[256];
    __shared__ int best_i[256];
    const float* row = logits + (size_t)blockIdx.x * n;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = row[i];
        if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
    }
    best_v[threadIdx.x] = bv;
    best_i[threadIdx.x] = bi;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            float v = best_v[threadIdx.x + stride];
            int i = best_i[threadIdx.x + stride];
            if (v > best_v[threadIdx.x] || (v == best_v[threadIdx.x] && i < best_i[threadIdx.x])) {
                best_v[threadIdx.x] = v;
                best_i[threadIdx.x] = i;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = best_i[0] == 0x7fffffff ? 0 : best_i[0];
}

#define GEMV_MAX_M 8

// f32 to bf16, element-wise (activations before a cuBLAS GEMM).
extern "C" __global__ void to_bf16(const float* x, __nv_bfloat16* y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2bfloat16(x[i]);
}

// bf16 to f32, element-wise.
extern "C" __global__ void to_f32(const __nv_bfloat16* x, float* y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __bfloat162float(x[i]);
}

// x[r][c] += b[c] over rows x cols (the q/k/v biases of Qwen2).
extern "C" __global__ void add_bias(float* x, const float* b, long long n, int cols) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += b[i % cols];
}

// out[i] = src[idx[i]] for rows of `cols` floats. One block per row.
extern "C" __global__ void gather_rows(const float* src, const unsigned* idx, float* out, int cols) {
    const float* row = src + (size_t)idx[blockIdx.x] * cols;
    float* o = out + (size_t)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) o[i] = row[i];
}
