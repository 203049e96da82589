// Cluster GEMM for decode batches of 17 to 64 rows (see cluster.rs):
// out[m][row] = sum_k x[m][k] w[row][k], bf16 weights and activations,
// row-major, K a multiple of 64, f32 out.
//
// A tile is 128 weight rows against every activation row. Its K columns
// are split over the S blocks of a thread-block cluster, so a 4096-row
// weight still makes ~2 blocks an SM (the tiles alone would leave most
// SMs idle, the problem cuBLAS has at these shapes). Each block streams
// its share of the weights through a 4-stage cp.async ring of 64-column
// stages (the weight stages before the PDL wait: they never depend on an
// earlier kernel), multiplies on tensor cores from ldmatrix fragments,
// and leaves its partial tile in shared memory; the cluster then sums the
// S partials through distributed shared memory, each block a 1/S share
// of the tile, in rank order (the same sums every run), and writes f32.
//
// Shared memory holds 128-byte rows (64 bf16) with their 16-byte pieces
// XOR-swizzled by the row's low 3 bits: the 8 rows an ldmatrix phase
// reads, and the 8 pieces a row's cp.asyncs write, fall in distinct banks.

#define CL_ROWS 128     // weight rows a tile
#define CL_STAGES 4     // 64-column stages in the ring
#define CL_THREADS 256  // 4 warps along the rows x 2 along each stage's K
#define CL_PAD 132      // f32 row stride of the partial tile (bank-conflict free)

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define CL_DIMS(S)
#define CL_HOPPER 0
#else
#define CL_DIMS(S) __cluster_dims__(S, 1, 1)
#define CL_HOPPER 1
#endif

// 16 bytes from global to shared memory, or zeros where !live (src must
// still be a valid address).
__device__ __forceinline__ void cp_async16z(unsigned dst, const void* src, bool live) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(live ? 16 : 0));
}

__device__ __forceinline__ void ldsm4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2,
                                      unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// Byte offset of piece `ch` (16 bytes) of row `row` in a swizzled stage.
__device__ __forceinline__ unsigned cl_at(int row, int ch) {
    return row * 128 + ((ch ^ (row & 7)) << 4);
}

#if CL_HOPPER
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}

// Every thread of the cluster: its shared-memory writes before, visible
// to every block's reads after.
__device__ __forceinline__ void cluster_barrier() {
    asm volatile(
        "barrier.cluster.arrive.release.aligned;\n"
        "barrier.cluster.wait.acquire.aligned;\n" ::
            : "memory");
}

// The f32 at shared address `local` in cluster block `rank`.
__device__ __forceinline__ float ld_cluster(unsigned local, unsigned rank) {
    unsigned remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
    return v;
}
#endif


// Warpgroup MMAs (sm_90a): the operands straight from the swizzled
// stages, described by 64-bit descriptors (start >> 4; stride 1024 bytes
// between 8-row groups; 128-byte swizzle), both K-major.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CL_WGMMA 1
__device__ __forceinline__ unsigned long long gmma_desc(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((1024ull >> 4) << 32) |
           (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait0() {
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

// d (64 x N f32 over the warpgroup) += A (64 x 16) * B (16 x N).
template <int N>
__device__ __forceinline__ void wgmma16(float* d, unsigned long long a, unsigned long long b);

template <>
__device__ __forceinline__ void wgmma16<64>(float* d, unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b));
}

template <>
__device__ __forceinline__ void wgmma16<32>(float* d, unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b));
}
#else
#define CL_WGMMA 0
#endif

// NT blocks of 8 activation rows (4 up to 32 rows, 8 up to 64). WG: the
// products on warpgroup MMAs (sm_90a; each warpgroup 64 weight rows over a
// stage's whole K), else on m16n8k16 MMAs from ldmatrix fragments (each
// warp 32 rows over half a stage's K).
//
// LOOK: stages loaded ahead. 3 (the ring less the one computed on), each
// stage's MMAs waited for before the next; or, with WG, 2, so a stage's
// MMAs run on while the next stage's land (its slot is reloaded only two
// stages later).
template <int S, int NT, bool WG, int LOOK>
__device__ void cluster_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w, Outs o, int M,
                             int K) {
#if CL_HOPPER
    if (WG && !CL_WGMMA) return;
    extern __shared__ __align__(128) unsigned char cl_smem[];
    constexpr int XROWS = 8 * NT, WBYTES = CL_ROWS * 128, STAGE = WBYTES + XROWS * 128;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    int rank = S > 1 ? (int)cluster_rank() : 0;
    int n0 = (blockIdx.x / S) * CL_ROWS;
    int chunks = K / 64, c0 = rank * chunks / S, count = (rank + 1) * chunks / S - c0;
    // Swizzled stages start on 1024 bytes (the swizzle's period).
    unsigned raw = smem_addr(cl_smem), base = (raw + 1023) & ~1023u;
    float* red = (float*)(cl_smem + (base - raw));
    auto load_w = [&](int i) {
        unsigned dst = base + (i % CL_STAGES) * STAGE;
        size_t col = (size_t)(c0 + i) * 64;
#pragma unroll
        for (int j = 0; j < CL_ROWS * 8 / CL_THREADS; j++) {
            int idx = tid + j * CL_THREADS, row = idx >> 3, ch = idx & 7;
            bool live = n0 + row < o.n;
            const __nv_bfloat16* src = live ? w + (size_t)(n0 + row) * K + col + ch * 8 : w;
            cp_async16z(dst + cl_at(row, ch), src, live);
        }
    };
    auto load_x = [&](int i) {
        unsigned dst = base + (i % CL_STAGES) * STAGE + WBYTES;
        size_t col = (size_t)(c0 + i) * 64;
#pragma unroll
        for (int j = 0; j < (XROWS * 8 + CL_THREADS - 1) / CL_THREADS; j++) {
            int idx = tid + j * CL_THREADS, row = idx >> 3, ch = idx & 7;
            if (row < XROWS) {
                bool live = row < M;
                const __nv_bfloat16* src = live ? x + (size_t)row * K + col + ch * 8 : x;
                cp_async16z(dst + cl_at(row, ch), src, live);
            }
        }
    };

    PDL_LAUNCH();
    for (int i = 0; i < LOOK; i++)
        if (i < count) load_w(i);
    PDL_WAIT();
    for (int i = 0; i < LOOK; i++) {
        if (i < count) load_x(i);
        cp_commit();
    }

    // WG: d[4 j + c] of warpgroup wg at weight row 64 wg + 16 (warp % 4) +
    // g (+ 8 for c >= 2), activation row 8 j + 2 t (+ 1 for odd c).
    // Else acc[h][j][c] at weight row 32 wn + 16 h + g (+ 8), the same
    // activation row.
    float acc[2][NT][4];
#pragma unroll
    for (int a = 0; a < 2; a++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[a][j][c] = 0.0f;
    int wn = warp & 3, wk = warp >> 2;
    for (int i = 0; i < count; i++) {
        // Stage i has landed and every warp's MMAs are done with stage
        // i + LOOK - CL_STAGES, whose slot the next loads take.
        cp_wait<LOOK - 1>();
        if (WG) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        if (i + LOOK < count) {
            load_w(i + LOOK);
            load_x(i + LOOK);
        }
        cp_commit();
        unsigned sw = base + (i % CL_STAGES) * STAGE, sx = sw + WBYTES;
        if (WG) {
#if CL_WGMMA
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < 4; ks++)
                wgmma16<8 * NT>(&acc[0][0][0], gmma_desc(sw + wk * 8192 + 32 * ks),
                                gmma_desc(sx + 32 * ks));
            wgmma_commit();
            if (LOOK == CL_STAGES - 1) {
                wgmma_wait0();
            } else {
                asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            }
#endif
        } else {
#pragma unroll
            for (int kk = 0; kk < 2; kk++) {
                int ks = 2 * wk + kk;  // this warp's 16-column step of the stage
                unsigned a[2][4], b[NT][2];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    int row = 32 * wn + 16 * h + (lane & 15);
                    ldsm4(sw + cl_at(row, 2 * ks + (lane >> 4)), a[h][0], a[h][1], a[h][2],
                          a[h][3]);
                }
#pragma unroll
                for (int j = 0; j < NT; j += 2) {
                    int row = 8 * j + (lane & 7) + ((lane >> 4) << 3);
                    ldsm4(sx + cl_at(row, 2 * ks + ((lane >> 3) & 1)), b[j][0], b[j][1],
                          b[j + 1][0], b[j + 1][1]);
                }
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    if (8 * j >= M) break;  // the same for the whole block
#pragma unroll
                    for (int h = 0; h < 2; h++)
                        mma16<false>(acc[h][j], a[h][0], a[h][1], a[h][2], a[h][3], b[j][0],
                                     b[j][1]);
                }
            }
        }
    }
    cp_wait<0>();
#if CL_WGMMA
    if (WG) wgmma_wait0();
#endif
    __syncthreads();

    // The block's partial tile in shared memory (the ring is free now):
    // red[m][row]. Without WG the two K halves meet there, the second
    // half's warps first.
    if (WG) {
        const float* d = &acc[0][0][0];
#pragma unroll
        for (int i = 0; i < 4 * NT; i++) {
            int j = i >> 2, c = i & 3;
            int row = 64 * wk + 16 * wn + g + (c >= 2 ? 8 : 0);
            red[(8 * j + 2 * t + (c & 1)) * CL_PAD + row] = d[i];
        }
        __syncthreads();
    } else {
#pragma unroll
        for (int pass = 1; pass >= 0; pass--) {
            if (wk == pass) {
#pragma unroll
                for (int h = 0; h < 2; h++)
#pragma unroll
                    for (int j = 0; j < NT; j++)
#pragma unroll
                        for (int c = 0; c < 4; c++) {
                            int at = (8 * j + 2 * t + (c & 1)) * CL_PAD + 32 * wn + 16 * h + g +
                                     (c >= 2 ? 8 : 0);
                            red[at] = pass ? acc[h][j][c] : red[at] + acc[h][j][c];
                        }
            }
            __syncthreads();
        }
    }

    // The cluster's S partial tiles summed in rank order: block `rank`
    // takes every S-th run of CL_THREADS outputs.
    if (S > 1) cluster_barrier();
    unsigned red_at = smem_addr(red);
    for (int e = rank * CL_THREADS + tid; e < XROWS * CL_ROWS; e += S * CL_THREADS) {
        int m = e / CL_ROWS, row = e % CL_ROWS;
        if (m >= M || n0 + row >= o.n) continue;
        int at = m * CL_PAD + row;
        float v = 0.0f;
        if (S == 1) {
            v = red[at];
        } else {
#pragma unroll
            for (int q = 0; q < S; q++) v += ld_cluster(red_at + 4 * at, q);
        }
        put_out(o, m, n0 + row, v);
    }
    // No block leaves while another may still read its shared memory.
    if (S > 1) cluster_barrier();
#endif
}

#define CLUSTER(S, NT)                                                                          \
    extern "C" __global__ void CL_DIMS(S) __launch_bounds__(CL_THREADS, 2)                    \
        gemm_bf16_cluster_s##S##_nt##NT(const __nv_bfloat16* x, const __nv_bfloat16* w,       \
                                        float* o0, float* o1, float* o2, int n0, int n1, int M, \
                                        int N, int K) {                                         \
        cluster_bf16<S, NT, false, 3>(x, w, Outs{o0, o1, o2, n0, n1, N}, M, K);                 \
    }                                                                                           \
    extern "C" __global__ void CL_DIMS(S) __launch_bounds__(CL_THREADS, 2)                    \
        gemm_bf16_wgmma_s##S##_nt##NT(const __nv_bfloat16* x, const __nv_bfloat16* w,         \
                                      float* o0, float* o1, float* o2, int n0, int n1, int M,   \
                                      int N, int K) {                                           \
        cluster_bf16<S, NT, true, 3>(x, w, Outs{o0, o1, o2, n0, n1, N}, M, K);                  \
    }                                                                                           \
    extern "C" __global__ void CL_DIMS(S) __launch_bounds__(CL_THREADS, 2)                    \
        gemm_bf16_wgmma2_s##S##_nt##NT(const __nv_bfloat16* x, const __nv_bfloat16* w,        \
                                       float* o0, float* o1, float* o2, int n0, int n1, int M,  \
                                       int N, int K) {                                          \
        cluster_bf16<S, NT, true, 2>(x, w, Outs{o0, o1, o2, n0, n1, N}, M, K);                  \
    }
#define CLUSTERS(S) CLUSTER(S, 4) CLUSTER(S, 8)

CLUSTERS(1)
CLUSTERS(2)
CLUSTERS(3)
CLUSTERS(4)
CLUSTERS(5)
CLUSTERS(6)
CLUSTERS(7)
CLUSTERS(8)
