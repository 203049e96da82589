// Skinny bf16 GEMMs for decode batches (see skinny.rs): out[m][row] =
// sum_k x[m][k] w[row][k] for 2 <= M <= 8 NB activation rows, bf16 weights
// and activations, row-major, K a multiple of 64.
//
// A block takes S strips of 16 weight rows; its warps take the strips'
// 64-column tiles in turn and meet in shared memory. Within a tile the
// MMAs' k order is permuted, the same for both operands (a sum does not
// care): lane (g, t) holds columns 16 t .. 16 t + 15 of its rows, so each
// operand fragment is 32 contiguous bytes of a row, two 16-byte loads.
// Word 2 s of those 32 bytes is the pair an m16n8k16 step s reads at
// columns 2 t, 2 t + 1 (registers a0 / a1 / b0), word 2 s + 1 the pair at
// 2 t + 8, 2 t + 9 (a2 / a3 / b1).

#define SKINNY_WARPS 8

template <int NB, int S>
__device__ void skinny_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w, Outs o, int M,
                            int K) {
    __shared__ float red[SKINNY_WARPS][4 * NB][32];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int tiles = K / 64, strips = o.n / 16, strip0 = blockIdx.x * S;
    float out[S][NB][4];
#pragma unroll
    for (int j = 0; j < S; j++)
#pragma unroll
        for (int cb = 0; cb < NB; cb++)
#pragma unroll
            for (int i = 0; i < 4; i++) out[j][cb][i] = 0.0f;
    for (int kt = warp; kt < tiles; kt += SKINNY_WARPS) {
        size_t col = (size_t)kt * 64 + 16 * t;
        // Rows g and g + 8 of each strip: 2 x 2 x 16 bytes a lane.
        uint4 wa[S][4];
#pragma unroll
        for (int j = 0; j < S; j++) {
            bool live = strip0 + j < strips;
            size_t row = (size_t)(strip0 + j) * 16 + g;
            const uint4* r0 = (const uint4*)(w + row * K + col);
            const uint4* r1 = (const uint4*)(w + (row + 8) * K + col);
            uint4 z = make_uint4(0, 0, 0, 0);
            wa[j][0] = live ? __ldcs(r0) : z;
            wa[j][1] = live ? __ldcs(r0 + 1) : z;
            wa[j][2] = live ? __ldcs(r1) : z;
            wa[j][3] = live ? __ldcs(r1 + 1) : z;
        }
        // Every row block's activation pieces load before any MMA: one
        // trip to L2 a tile, not one a row block.
        uint4 xb[NB][2];
#pragma unroll
        for (int cb = 0; cb < NB; cb++) {
            int mb = 8 * cb + g;  // this lane's B column: activation row mb
            const uint4* xr = (const uint4*)(x + (size_t)mb * K + col);
            xb[cb][0] = mb < M ? xr[0] : make_uint4(0, 0, 0, 0);
            xb[cb][1] = mb < M ? xr[1] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int cb = 0; cb < NB; cb++) {
            if (8 * cb >= M) break;  // the same for the whole warp
            const unsigned* bw = (const unsigned*)xb[cb];
#pragma unroll
            for (int j = 0; j < S; j++) {
                const unsigned* lo = (const unsigned*)&wa[j][0];  // row g, 8 words
                const unsigned* hi = (const unsigned*)&wa[j][2];  // row g + 8
#pragma unroll
                for (int s = 0; s < 4; s++)
                    mma16<false>(out[j][cb], lo[2 * s], hi[2 * s], lo[2 * s + 1], hi[2 * s + 1],
                                 bw[2 * s], bw[2 * s + 1]);
            }
        }
    }
    strips_out<NB, S, SKINNY_WARPS>(red, out, o, M, strip0, strips);
}

#define SKINNY(NB)                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * SKINNY_WARPS)                         \
        gemm_bf16_skinny_nb##NB(const __nv_bfloat16* x, const __nv_bfloat16* w, float* o0,  \
                                float* o1, float* o2, int n0, int n1, int M, int N, int K) { \
        PDL_ENTER();                                                                         \
        skinny_bf16<NB, STRIPS_A_BLOCK(NB)>(x, w, Outs{o0, o1, o2, n0, n1, N}, M, K);         \
    }

SKINNY(1)
SKINNY(2)
SKINNY(4)
SKINNY(8)
