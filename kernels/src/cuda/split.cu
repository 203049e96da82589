// Split bf16 GEMMs for decode batches of 9 to 64 rows (see split.rs):
// out[m][row] = sum_k x[m][k] w[row][k], bf16 weights and activations,
// row-major, K a multiple of 64.
//
// A block's 8 warps take 8 strips of 16 weight rows over one slice of K
// (blockIdx.y), all walking the same 64-column tiles, so the activation
// pieces one warp brings into L1 serve the other seven and each weight
// byte streams once. Fragments as in skinny.cu (the MMAs' k order permuted
// alike in both operands, 32 contiguous bytes a lane). Slices' sums meet
// in a workspace: the block of a row group that finishes last (a counter
// per group) adds them, writes the outputs and resets the counter.

#define SPLIT_WARPS 8

template <int NB>
__device__ void split_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w, Outs o, int M, int K,
                           int ks, float* ws, unsigned* counters) {
    __shared__ bool last;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int strip = blockIdx.x * SPLIT_WARPS + warp, N = o.n;
    bool live = strip < N / 16;
    int splits = gridDim.y, k0 = blockIdx.y * ks, k1 = min(K, k0 + ks);
    size_t row = (size_t)strip * 16 + g;
    const __nv_bfloat16* w0 = w + row * K;  // rows g and g + 8 of the strip
    const __nv_bfloat16* w1 = w0 + (size_t)8 * K;
    float out[NB][4];
#pragma unroll
    for (int cb = 0; cb < NB; cb++)
#pragma unroll
        for (int i = 0; i < 4; i++) out[cb][i] = 0.0f;
    const uint4 z = make_uint4(0, 0, 0, 0);
    for (int c0 = k0; c0 < k1; c0 += 128) {
        // Two tiles' weights in flight a lane, then each tile's MMAs.
        uint4 wa[2][4];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            size_t col = (size_t)c0 + 64 * u + 16 * t;
            bool ok = live && c0 + 64 * u < k1;
            const uint4* r0 = (const uint4*)(w0 + col);
            const uint4* r1 = (const uint4*)(w1 + col);
            wa[u][0] = ok ? __ldcs(r0) : z;
            wa[u][1] = ok ? __ldcs(r0 + 1) : z;
            wa[u][2] = ok ? __ldcs(r1) : z;
            wa[u][3] = ok ? __ldcs(r1 + 1) : z;
        }
#pragma unroll
        for (int u = 0; u < 2; u++) {
            if (c0 + 64 * u >= k1) break;  // the same for the whole block
            size_t col = (size_t)c0 + 64 * u + 16 * t;
            uint4 xb[NB][2];
#pragma unroll
            for (int cb = 0; cb < NB; cb++) {
                int mb = 8 * cb + g;  // this lane's B column: activation row mb
                const uint4* xr = (const uint4*)(x + (size_t)mb * K + col);
                xb[cb][0] = mb < M ? xr[0] : z;
                xb[cb][1] = mb < M ? xr[1] : z;
            }
            const unsigned* lo = (const unsigned*)&wa[u][0];  // row g, 8 words
            const unsigned* hi = (const unsigned*)&wa[u][2];  // row g + 8
#pragma unroll
            for (int cb = 0; cb < NB; cb++) {
                if (8 * cb >= M) break;
                const unsigned* bw = (const unsigned*)xb[cb];
#pragma unroll
                for (int s = 0; s < 4; s++)
                    mma16<false>(out[cb], lo[2 * s], hi[2 * s], lo[2 * s + 1], hi[2 * s + 1],
                                 bw[2 * s], bw[2 * s + 1]);
            }
        }
    }
    // out[cb] is an m16n8 tile: weight rows g, g + 8; activation rows
    // 8 cb + 2 t, + 1.
    if (splits == 1) {
        if (!live) return;
#pragma unroll
        for (int cb = 0; cb < NB; cb++) {
            int r0 = 8 * cb + 2 * t;
            if (r0 < M) {
                put_out(o, r0, row, out[cb][0]);
                put_out(o, r0, row + 8, out[cb][2]);
            }
            if (r0 + 1 < M) {
                put_out(o, r0 + 1, row, out[cb][1]);
                put_out(o, r0 + 1, row + 8, out[cb][3]);
            }
        }
        return;
    }
    float* part = ws + (size_t)blockIdx.y * M * N;
    if (live) {
#pragma unroll
        for (int cb = 0; cb < NB; cb++) {
            int r0 = 8 * cb + 2 * t;
            if (r0 < M) {
                part[(size_t)r0 * N + row] = out[cb][0];
                part[(size_t)r0 * N + row + 8] = out[cb][2];
            }
            if (r0 + 1 < M) {
                part[(size_t)(r0 + 1) * N + row] = out[cb][1];
                part[(size_t)(r0 + 1) * N + row + 8] = out[cb][3];
            }
        }
    }
    // Release this block's sums before counting it; the last block sees
    // every other block's (threadfence on both sides of the counter).
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&counters[blockIdx.x], 1u) == (unsigned)splits - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (live) {
#pragma unroll
        for (int cb = 0; cb < NB; cb++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int m = 8 * cb + 2 * t + (i & 1);
                size_t r = row + 8 * (i >> 1);
                if (m >= M) continue;
                float v = 0.0f;
                // L2 reads (not L1): other SMs wrote them.
                for (int sp = 0; sp < splits; sp++)
                    v += __ldcg(ws + ((size_t)sp * M + m) * N + r);
                put_out(o, m, (int)r, v);
            }
        }
    }
    if (threadIdx.x == 0) counters[blockIdx.x] = 0;
}

#define SPLIT(NB)                                                                             \
    extern "C" __global__ void __launch_bounds__(32 * SPLIT_WARPS)                           \
        gemm_bf16_split_nb##NB(const __nv_bfloat16* x, const __nv_bfloat16* w, float* o0,    \
                               float* o1, float* o2, int n0, int n1, int M, int N, int K,     \
                               int ks, float* ws, unsigned* counters) {                       \
        PDL_ENTER();                                                                          \
        split_bf16<NB>(x, w, Outs{o0, o1, o2, n0, n1, N}, M, K, ks, ws, counters);            \
    }

SPLIT(2)
SPLIT(4)
SPLIT(8)
