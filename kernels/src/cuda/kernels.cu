// Kiln's CUDA kernels, compiled at run time by NVRTC. Every kernel has a CPU
// reference in kiln-kernels; the parity tests hold them to it.
//
// Layouts follow the CPU side: activations are row-major f32; weights are
// row-major bf16 [out][in]; KV element (page, slot, head, d) lives at
// ((page * page_size + slot) * kv_heads + head) * head_dim + d, with one f32
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

// Writes one token's K and V per block (grid: tokens x kv_heads; threads:
// head_dim, a multiple of 32) at vector slots[t] * kv_heads + head; a
// token whose slot is negative writes nothing.
extern "C" __global__ void kv_write_bf16(const float* k, const float* v, const int* slots,
                                         __nv_bfloat16* kc, __nv_bfloat16* vc, int kv_heads,
                                         int hd) {
    int slot = slots[blockIdx.x];
    if (slot < 0) return;
    size_t src = ((size_t)blockIdx.x * kv_heads + blockIdx.y) * hd + threadIdx.x;
    size_t dst = ((size_t)slot * kv_heads + blockIdx.y) * hd + threadIdx.x;
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
                                        float* vs, int kv_heads, int hd) {
    __shared__ float red[32];
    int slot = slots[blockIdx.x];
    if (slot < 0) return;
    size_t src = ((size_t)blockIdx.x * kv_heads + blockIdx.y) * hd + threadIdx.x;
    size_t vec = (size_t)slot * kv_heads + blockIdx.y;
    fp8_store(k[src], red, kc + vec * hd + threadIdx.x, ks + vec, hd);
    fp8_store(v[src], red, vc + vec * hd + threadIdx.x, vs + vec, hd);
}

template <bool FP8>
__device__ __forceinline__ float kv_load(const void* data, const float* scales, size_t vec, int hd,
                                         int d) {
    if (FP8) {
        __nv_fp8_e4m3 q;
        q.__x = ((const unsigned char*)data)[vec * hd + d];
        return (float)q * scales[vec];
    } else {
        return __bfloat162float(((const __nv_bfloat16*)data)[vec * hd + d]);
    }
}

#define MAX_GROUP 8
#define PART 256
#define VEC 8

// Loads VEC consecutive elements of one K or V vector as floats.
template <bool FP8>
__device__ __forceinline__ void kv_load8(const void* data, const float* scales, size_t vec, int hd,
                                         int d0, float* out) {
    if (FP8) {
        uint2 raw = *(const uint2*)((const unsigned char*)data + vec * hd + d0);
        const unsigned char* b = (const unsigned char*)&raw;
        float s = scales[vec];
        for (int j = 0; j < VEC; j++) {
            __nv_fp8_e4m3 q;
            q.__x = b[j];
            out[j] = (float)q * s;
        }
    } else {
        uint4 raw = *(const uint4*)((const __nv_bfloat16*)data + vec * hd + d0);
        const __nv_bfloat162* h2 = (const __nv_bfloat162*)&raw;
        for (int j = 0; j < 4; j++) {
            float2 f = __bfloat1622float2(h2[j]);
            out[2 * j] = f.x;
            out[2 * j + 1] = f.y;
        }
    }
}

// Paged decode attention, split along the sequence. Grid: (kv_heads, seqs,
// partitions of PART tokens); 128 threads. Each K and V vector of the
// block's tokens is read once, with 8-element vector loads, for all query
// heads of its KV head: hd / 8 threads share a vector, so 128 / (hd / 8)
// tokens are in flight per block. Writes an unnormalized partial output
// with its max and sum for the merge.
// q: seqs x n_heads x hd. tables: the concatenated block tables, seq s's at
// table_off[s]. part_out: seqs x n_heads x parts x hd; part_ml: ... x 2.
template <bool FP8, int G>
__device__ void attention_part(const float* q, const void* kc, const void* vc, const float* ks,
                               const float* vs, const int* tables, const int* table_off,
                               const int* lens, float* part_out, float* part_ml, int n_heads,
                               int kv_heads, int hd, int page_size, int parts, float scale) {
    extern __shared__ float smem[];
    int kvh = blockIdx.x, s = blockIdx.y, part = blockIdx.z;
    const int group = G;
    int len = lens[s];
    int t0 = part * PART;
    int t1 = min(len, t0 + PART);
    int tpv = hd / VEC;                    // threads per vector
    int lanes = blockDim.x / tpv;          // tokens in flight
    int sub = threadIdx.x % tpv, tl = threadIdx.x / tpv;
    float* qs = smem;                      // group x hd
    float* sc = qs + group * hd;           // group x PART
    float* ml = sc + group * PART;         // group x 2
    float* red = ml + 2 * group;           // lanes x group x hd
    int* pg = (int*)(red + lanes * group * hd);  // the partition's pages
    const float* qsrc = q + ((size_t)s * n_heads + kvh * group) * hd;
    for (int i = threadIdx.x; i < group * hd; i += blockDim.x) qs[i] = qsrc[i];
    const int* table = tables + table_off[s];
    int p0 = t0 / page_size;
    for (int i = threadIdx.x; t0 < t1 && i <= (t1 - 1) / page_size - p0; i += blockDim.x)
        pg[i] = table[p0 + i];
    __syncthreads();
    // Scores.
    // The loop runs the same number of times in every lane of a warp (the
    // shuffles need all 32), with lanes past the end computing on zeros.
    for (int base = t0; base < t1; base += lanes) {
        int t = base + tl;
        bool valid = t < t1;
        float k[VEC];
        if (valid) {
            size_t vec = ((size_t)pg[t / page_size - p0] * page_size + t % page_size) * kv_heads + kvh;
            kv_load8<FP8>(kc, ks, vec, hd, sub * VEC, k);
        } else {
            for (int j = 0; j < VEC; j++) k[j] = 0.0f;
        }
#pragma unroll
        for (int g = 0; g < G; g++) {
            const float* qg = qs + g * hd + sub * VEC;
            float acc = 0.0f;
            for (int j = 0; j < VEC; j++) acc += qg[j] * k[j];
            for (int o = tpv / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
            if (valid && sub == 0) sc[g * PART + (t - t0)] = acc * scale;
        }
    }
    __syncthreads();
    // Softmax pieces: one warp per head.
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int g = warp; g < group; g += warps) {
        float m = -INFINITY;
        for (int i = lane; i < t1 - t0; i += 32) m = fmaxf(m, sc[g * PART + i]);
        m = warp_max(m);
        float l = 0.0f;
        for (int i = lane; i < t1 - t0; i += 32) {
            float p = __expf(sc[g * PART + i] - m);
            sc[g * PART + i] = p;
            l += p;
        }
        l = warp_sum(l);
        if (lane == 0) { ml[2 * g] = m; ml[2 * g + 1] = l; }
    }
    __syncthreads();
    // Values: each thread accumulates its 8 dimensions for every head over
    // its tokens; the token lanes are then summed through shared memory.
    float acc[G][VEC];
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
        for (int j = 0; j < VEC; j++) acc[g][j] = 0.0f;
    for (int t = t0 + tl; t < t1; t += lanes) {
        size_t vec = ((size_t)pg[t / page_size - p0] * page_size + t % page_size) * kv_heads + kvh;
        float v[VEC];
        kv_load8<FP8>(vc, vs, vec, hd, sub * VEC, v);
#pragma unroll
        for (int g = 0; g < G; g++) {
            float p = sc[g * PART + (t - t0)];
#pragma unroll
            for (int j = 0; j < VEC; j++) acc[g][j] += p * v[j];
        }
    }
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
        for (int j = 0; j < VEC; j++) red[(tl * group + g) * hd + sub * VEC + j] = acc[g][j];
    __syncthreads();
    for (int i = threadIdx.x; i < group * hd; i += blockDim.x) {
        float sum = 0.0f;
        for (int l = 0; l < lanes; l++) sum += red[l * group * hd + i];
        int g = i / hd, d = i % hd;
        size_t h = (size_t)s * n_heads + kvh * group + g;
        part_out[(h * parts + part) * hd + d] = sum;
    }
    if (threadIdx.x < group) {
        size_t h = (size_t)s * n_heads + kvh * group + threadIdx.x;
        bool empty = t1 <= t0;
        part_ml[(h * parts + part) * 2] = empty ? -INFINITY : ml[2 * threadIdx.x];
        part_ml[(h * parts + part) * 2 + 1] = empty ? 0.0f : ml[2 * threadIdx.x + 1];
    }
}

#define ATTENTION_ENTRY(NAME, FP8, G)                                                          \
    extern "C" __global__ void NAME(const float* q, const void* kc, const void* vc,              \
                                    const float* ks, const float* vs, const int* tables,         \
                                    const int* table_off, const int* lens, float* part_out,      \
                                    float* part_ml, int n_heads, int kv_heads, int hd,           \
                                    int page_size, int parts, float scale) {                     \
        attention_part<FP8, G>(q, kc, vc, ks, vs, tables, table_off, lens, part_out, part_ml,    \
                               n_heads, kv_heads, hd, page_size, parts, scale);                  \
    }

// One entry point per format and group size (query heads per KV head), so
// the accumulators stay in registers.
ATTENTION_ENTRY(attention_part_bf16_g1, false, 1)
ATTENTION_ENTRY(attention_part_bf16_g2, false, 2)
ATTENTION_ENTRY(attention_part_bf16_g3, false, 3)
ATTENTION_ENTRY(attention_part_bf16_g4, false, 4)
ATTENTION_ENTRY(attention_part_bf16_g5, false, 5)
ATTENTION_ENTRY(attention_part_bf16_g6, false, 6)
ATTENTION_ENTRY(attention_part_bf16_g7, false, 7)
ATTENTION_ENTRY(attention_part_bf16_g8, false, 8)
ATTENTION_ENTRY(attention_part_fp8_g1, true, 1)
ATTENTION_ENTRY(attention_part_fp8_g2, true, 2)
ATTENTION_ENTRY(attention_part_fp8_g3, true, 3)
ATTENTION_ENTRY(attention_part_fp8_g4, true, 4)
ATTENTION_ENTRY(attention_part_fp8_g5, true, 5)
ATTENTION_ENTRY(attention_part_fp8_g6, true, 6)
ATTENTION_ENTRY(attention_part_fp8_g7, true, 7)
ATTENTION_ENTRY(attention_part_fp8_g8, true, 8)

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

// Decode GEMV: out[m][n] = sum_k x[m][k] * w[n][k] for m < M <= 8, bf16
// weights streamed once with 16-byte loads, the whole batch per weight read.
// One warp per output row; 8 warps per block. k must be a multiple of 8.
extern "C" __global__ void gemv_bf16(const float* x, const __nv_bfloat16* w, float* out, int M,
                                     int N, int K) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int n = blockIdx.x * (blockDim.x >> 5) + warp;
    if (n >= N) return;
    const uint4* wrow = (const uint4*)(w + (size_t)n * K);
    float acc[GEMV_MAX_M];
    for (int m = 0; m < GEMV_MAX_M; m++) acc[m] = 0.0f;
#pragma unroll 4
    for (int c = lane; c < K / 8; c += 32) {
        uint4 pack = wrow[c];
        const __nv_bfloat162* h2 = (const __nv_bfloat162*)&pack;
        float wf[8];
        for (int j = 0; j < 4; j++) {
            float2 f = __bfloat1622float2(h2[j]);
            wf[2 * j] = f.x;
            wf[2 * j + 1] = f.y;
        }
        for (int m = 0; m < M; m++) {
            const float4* xv = (const float4*)(x + (size_t)m * K + c * 8);
            float4 a = xv[0], b = xv[1];
            acc[m] += a.x * wf[0] + a.y * wf[1] + a.z * wf[2] + a.w * wf[3] + b.x * wf[4] +
                      b.y * wf[5] + b.z * wf[6] + b.w * wf[7];
        }
    }
    for (int m = 0; m < M; m++) {
        float v = warp_sum(acc[m]);
        if (lane == 0) out[(size_t)m * N + n] = v;
    }
}

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
