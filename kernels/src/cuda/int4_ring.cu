// The ring of the one-launch int4 GEMV's `_ring` builds (int4_one.cu):
// each warp's weight batches land in shared memory by bulk copies (TMA)
// that complete on an mbarrier a ring slot, and the block's (d, m) rows by
// one bulk copy a row; before Hopper the warps copy them themselves.

// Batches of weights a warp keeps in flight.
#define INT4_RING 4

// Shared memory of a block of the one-launch GEMV: each warp's ring of
// INT4_RING batches (R x GB groups of TILES 512-byte tiles), then every
// strip's (d, m) rows at a stride of 4 more than a multiple of 8 words
// (rows g, the 8 a load reads, fall in distinct banks), then the
// mbarriers (one a ring slot, then the scales').
struct Int4Ring {
    unsigned char* ring;
    unsigned* scales;
    unsigned long long* bars;
    int sstride;
};

__device__ __forceinline__ Int4Ring int4_ring(unsigned char* base, int W, int TILES, int R,
                                              int NG) {
    Int4Ring r;
    r.ring = base;
    r.scales = (unsigned*)(base + W * INT4_RING * 2 * TILES * 512);
    r.sstride = (NG + 7) / 8 * 8 + 4;
    r.bars = (unsigned long long*)(r.scales + R * 16 * r.sstride);
    return r;
}

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define INT4_BULK 1
__device__ __forceinline__ void mbar_init(unsigned long long* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_expect(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
                 "r"(bytes)
                 : "memory");
}
// Weights are read once a step: first out of L2 (as the register path's
// streaming loads), so they do not push out what the step reads again.
__device__ __forceinline__ unsigned long long evict_first() {
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes,
                                          unsigned long long* bar, unsigned long long policy) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
        "[%0], [%1], %2, [%3], %4;" ::"r"(smem_u32(dst)),
        "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(policy)
        : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    unsigned done = 0;
    while (!done)
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
            "selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(smem_u32(bar)), "r"(parity)
            : "memory");
}
#else
// Before Hopper: no bulk copies; the warp copies a batch itself, at once.
#define INT4_BULK 0
#endif

// The warp's batch `b` (its groups from b GB) into its ring slot: on
// Hopper lane 0 starts one bulk copy a strip's group; before it, the
// warp's lanes copy the slot themselves. `strip0` is strip 0's first
// tile, `step` the uint4 from it to strip r's (0: the same strip again).
template <int TILES, int R, int W, int GB>
__device__ __forceinline__ void int4_ring_fill(const Int4Ring& rg, const uint4* strip0, int step,
                                               int warp, int lane, int b, int mine) {
    constexpr int PIECE = TILES * 512;
    if (b * GB >= mine) return;
    int slot = b % INT4_RING;
    unsigned char* dst = rg.ring + (warp * INT4_RING + slot) * 2 * PIECE;
    int live = min(GB, mine - b * GB);
#if INT4_BULK
    if (lane != 0) return;
    unsigned long long* bar = rg.bars + warp * INT4_RING + slot;
    // The slot's last reads (generic) come before this copy's writes.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    mbar_expect(bar, live * R * PIECE);
    unsigned long long policy = evict_first();
    for (int j = 0; j < live; j++) {
        int gi = warp + (b * GB + j) * W;
#pragma unroll
        for (int r = 0; r < R; r++)
            bulk_copy(dst + (j * R + r) * PIECE, strip0 + r * step + gi * TILES * 32, PIECE, bar,
                      policy);
    }
#else
    for (int j = 0; j < live; j++) {
        int gi = warp + (b * GB + j) * W;
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int i = 0; i < TILES; i++)
                ((uint4*)(dst + (j * R + r) * PIECE))[i * 32 + lane] =
                    __ldcs(strip0 + r * step + (gi * TILES + i) * 32 + lane);
    }
    __syncwarp();
#endif
}

// Waits for batch `b` in this warp's ring.
__device__ __forceinline__ void int4_ring_wait(const Int4Ring& rg, int warp, int b) {
#if INT4_BULK
    mbar_wait(rg.bars + warp * INT4_RING + b % INT4_RING, (b / INT4_RING) & 1);
#endif
}

// Where a block's weights are for the ring: strip 0's first tile and the
// uint4 from it to strip r's (0 where a block's second strip is past the
// last, which is then read again).
struct Int4RingSrc {
    const uint4* strip0;
    int step;
};

// A block's strips' (d, m) rows into shared memory (rows of NG words at
// the ring's stride), before the first batch needs them: on Hopper lanes
// of warp 0 start one bulk copy a row; before it, warp 0 copies them.
template <int R>
__device__ __forceinline__ void int4_scales_fill(const Int4Ring& rg, const unsigned* params,
                                                 int s0, int s1, int NG) {
    int lane = threadIdx.x & 31;
#if INT4_BULK
    unsigned long long* bar = rg.bars + blockDim.x / 32 * INT4_RING;
    // A bulk copy takes 16-byte pieces: rows of other lengths (or none)
    // copy as below, and lane 0 then arrives for them.
    if (NG % 4 != 0 || NG == 0) {
        for (int i = 0; i < R * 16; i++) {
            const unsigned* row = params + (size_t)((i < 16 ? s0 : s1) * 16 + i % 16) * NG;
            for (int c = lane; c < NG; c += 32) rg.scales[i * rg.sstride + c] = row[c];
        }
        __syncwarp();
        if (lane == 0)
            asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar))
                         : "memory");
        return;
    }
    if (lane == 0) mbar_expect(bar, R * 16 * NG * 4);
    __syncwarp();
    unsigned long long policy = evict_first();
    for (int i = lane; i < R * 16; i += 32) {
        const unsigned* row = params + (size_t)((i < 16 ? s0 : s1) * 16 + i % 16) * NG;
        bulk_copy(rg.scales + i * rg.sstride, row, NG * 4, bar, policy);
    }
#else
    for (int i = 0; i < R * 16; i++) {
        int r = i / 16, row = i % 16;
        for (int c = lane; c < NG; c += 32)
            rg.scales[i * rg.sstride + c] = params[(size_t)((r ? s1 : s0) * 16 + row) * NG + c];
    }
#endif
}
