// The flash decode attention kernel's work around its loop (see
// attention_flash.cu, which follows): the step's RoPE and KV write before
// the loop (`rin`), and the merge of a sequence's partitions by the block
// that finishes last (`done`).

#define FLASH_WARPS 4

// The scales of static fp8 pages (see attention_flash's smask): the pair
// `load` reads for two tokens.
__device__ __align__(8) float kiln_unit_scales[2] = {1.0f, 1.0f};

// Before the PDL wait: the K and V lines (and K's fp8 scales) of the block's
// first 2 x FLASH_WARPS chunks, the ones its warps load first, asked of L2,
// so those loads meet L2 once the wait ends where they would otherwise
// follow the page table to DRAM (at one sequence, a decode step's
// attention starts ~6 us after the launch before it ends). Only a hint:
// nothing enters registers, so lens and tables, which the step's tag check
// may yet change, only aim it; it reads no page the loop would not.
template <bool FP8, int HD>
__device__ __forceinline__ void flash_prefetch(const void* kc, const void* vc, const float* ks,
                                               const int* tables, const int* table_off,
                                               const int* lens, int s, int kvh, int kv_heads,
                                               int page_size, int t0, int part_len) {
    constexpr int BYTES = HD * (FP8 ? 1 : 2);  // a token's vector
    constexpr int FIRST = 2 * FLASH_WARPS * 16;  // == the block's threads
    int t = t0 + threadIdx.x;
    if (threadIdx.x >= FIRST || t >= min(lens[s], t0 + part_len)) return;
    int page = tables[table_off[s] + t / page_size];
    size_t vec = kv_vec(page, t % page_size, kvh, kv_heads, page_size);
    const char* k = (const char*)kc + vec * BYTES;
    const char* v = (const char*)vc + vec * BYTES;
#pragma unroll
    for (int b = 0; b < BYTES; b += 128) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(k + b));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(v + b));
    }
    // A line holds 32 tokens' scales (vectors of a page and head lie
    // together, pages 16-aligned).
    if (FP8 && ks != nullptr && (vec & 31) == 0) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(ks + vec));
    }
}

// A decode step's RoPE and KV write inside its attention (`rin`, see
// RopeIn): the block's G query heads rotated into qrot (G x HD floats of
// shared memory; then Hadamard-rotated on static fp8 pages, ks null, as
// rope_kv_write rotates them), and the block whose partition ends the
// sequence (`last`) writes the token's rotated key and its value into its
// page slot. Each warp rotates through HD floats of `scratch` of its own.
// The block's threads see the written vectors after the barrier at its
// end, before any of them reads the pages (the loop's page loads cannot
// move above it: their addresses come from `pg`, read after it). It
// writes only where the sequence has a token (lens[s] > 0) in the
// launch's partitions, as the engine's tag check leaves every row whose
// slot it keeps.
template <bool FP8, int G, int HD>
__device__ void flash_rope(const RopeIn& rin, float* qrot, float* scratch, int s, int kvh,
                           int kv_heads, int page_size, bool last, const void* kc, const void* vc,
                           const float* ks, const float* vs) {
    // qrot, then the scratch of every warp up to the key's, inside `red`.
    static_assert(G * HD + ((G < FLASH_WARPS ? G : FLASH_WARPS - 1) + 1) * HD <=
                      FLASH_WARPS * (G * HD + 2 * G),
                  "flash_rope's rows outgrow the block's red");
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    bool unit = FP8 && ks == nullptr;  // static fp8 pages
    float* r = scratch + warp * HD;
    float sn[ROPE_HD_MAX / 64], cs[ROPE_HD_MAX / 64], x[ROPE_HD_MAX / 32];
    head_angles((float)rin.pos[s], rin.inv_freq, HD, lane, sn, cs);
    for (int g = warp; g < G; g += FLASH_WARPS) {
        rotate_head<false>(rin.q + (size_t)s * rin.q_ld + (size_t)(kvh * G + g) * HD, nullptr, sn,
                           cs, HD, rin.interleaved, lane, r, x);
        __syncwarp();  // r again below
        if (unit) hadamard_warp(x, HD, lane);
#pragma unroll
        for (int m = 0; m < HD / 32; m++) qrot[g * HD + lane + 32 * m] = x[m];
    }
    // The key's warp: one with no query head where there is one.
    int slot = last ? rin.slots[s] : -1;  // the tag check clears it
    if (warp == (G < FLASH_WARPS ? G : FLASH_WARPS - 1) && slot >= 0) {
        size_t kv_at = (size_t)s * rin.kv_ld + (size_t)kvh * HD;
        rotate_head<false>(rin.k + kv_at, nullptr, sn, cs, HD, rin.interleaved, lane, r, x);
        if (unit) hadamard_warp(x, HD, lane);
        size_t vec = kv_vec(slot / page_size, slot % page_size, kvh, kv_heads, page_size);
        // The pages are this launch's to write (the kernel's pointers are
        // const for the loop that only reads them).
        void *kw = (void*)kc, *vw = (void*)vc;
        float *ksw = (float*)ks, *vsw = (float*)vs;
        const float* vr = rin.v + kv_at;
        if (!FP8) {
            store_kv<0>(x, vr, kw, vw, ksw, vsw, vec, HD, lane);
        } else if (!unit) {
            store_kv<1>(x, vr, kw, vw, ksw, vsw, vec, HD, lane);
        } else {
            store_kv<2>(x, vr, kw, vw, ksw, vsw, vec, HD, lane);
        }
    }
    __syncthreads();
}

// The merge of one KV head's partitions inside the launch (`done`, one
// counter per sequence and KV head, zero between launches): each block
// has written its partial sums and (max, sum) as for attention_merge; the
// last of the sequence's `parts` blocks to count itself in reads them all
// back and writes the normalized output of the G heads, one warp a head,
// and zeroes the counter for the next launch. The barrier gathers the
// block's partials and thread 0's fence orders them before its count (a
// release); the last block's thread 0 fences after the count it saw (an
// acquire) before the barrier its readers pass, and they read past L1.
template <int G, int HD>
__device__ void flash_merge_last(unsigned* done, const float* part_out, const float* part_ml,
                                 float* out, __nv_bfloat16* out16, int s, int kvh, int n_heads,
                                 int kv_heads, int parts) {
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        unsigned* c = done + (size_t)s * kv_heads + kvh;
        last = atomicAdd(c, 1u) == (unsigned)parts - 1;
        if (last) {
            __threadfence();
            *c = 0;
        }
    }
    __syncthreads();
    if (!last) return;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int g = warp; g < G; g += FLASH_WARPS) {
        size_t h = (size_t)s * n_heads + kvh * G + g;
        const float* ml = part_ml + h * parts * 2;
        float m = -INFINITY;
        for (int p = lane; p < parts; p += 32) m = fmaxf(m, __ldcg(ml + 2 * p));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
        float l = 0.0f;
        for (int p = lane; p < parts; p += 32) {
            float mp = __ldcg(ml + 2 * p);
            if (mp > -INFINITY) l += __expf(mp - m) * __ldcg(ml + 2 * p + 1);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffff, l, o);
        float inv = l > 0.0f ? 1.0f / l : 0.0f;
        float acc[HD / 32];
#pragma unroll
        for (int k = 0; k < HD / 32; k++) acc[k] = 0.0f;
        const float* po = part_out + h * parts * HD;
        for (int p = 0; p < parts; p++) {
            float mp = __ldcg(ml + 2 * p);
            float e = mp > -INFINITY ? __expf(mp - m) : 0.0f;
#pragma unroll
            for (int k = 0; k < HD / 32; k++) acc[k] += e * __ldcg(po + (size_t)p * HD + lane + 32 * k);
        }
#pragma unroll
        for (int k = 0; k < HD / 32; k++) {
            float o = acc[k] * inv;
            if (out16 != nullptr) {
                out16[h * HD + lane + 32 * k] = __float2bfloat16(o);
            } else {
                out[h * HD + lane + 32 * k] = o;
            }
        }
    }
}
