// SiLU-and-multiply, the FFN's activation (see act.rs).

// silu(g) * u, as every kernel that computes it rounds it.
__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// gate[i] = silu(gate[i]) * up[i] (into outb as bf16 instead where outb is
// not null: the input of the down projection's bf16 GEMM). Four elements a
// thread in 16-byte loads (a 64-row decode batch's 7 MB read at 1.45 TB/s
// one element a thread on the H200); the last thread takes n's tail.
extern "C" __global__ void silu_mul(float* gate, const float* up, __nv_bfloat16* outb, int n) {
    PDL_ENTER();
    int i = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (i + 3 < n) {
        float4 g = *(const float4*)(gate + i), u = *(const float4*)(up + i);
        float4 v = make_float4(silu_times(g.x, u.x), silu_times(g.y, u.y), silu_times(g.z, u.z),
                               silu_times(g.w, u.w));
        if (outb) {
            __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y);
            __nv_bfloat162 hi = __floats2bfloat162_rn(v.z, v.w);
            uint2 packed = make_uint2(*(unsigned*)&lo, *(unsigned*)&hi);
            *(uint2*)(outb + i) = packed;
        } else {
            *(float4*)(gate + i) = v;
        }
        return;
    }
    for (; i < n; i++) {
        float v = silu_times(gate[i], up[i]);
        if (outb) {
            outb[i] = __float2bfloat16(v);
        } else {
            gate[i] = v;
        }
    }
}

// out[r][c] = bf16(silu(gu[r][c]) * gu[r][f + c]) over a row-major rows x 2f
// bf16 product, gate then up side by side in each row (one GEMM over the
// stacked gate/up weights): eight columns a thread, f a multiple of 8.
extern "C" __global__ void silu_mul_pairs(const __nv_bfloat16* gu, __nv_bfloat16* out, int rows,
                                          int f) {
    PDL_ENTER();
    long i = ((long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (i >= (long)rows * f) return;
    long r = i / f, c = i % f;
    uint4 g = *(const uint4*)(gu + r * 2 * f + c);
    uint4 u = *(const uint4*)(gu + r * 2 * f + f + c);
    const __nv_bfloat162* g2 = (const __nv_bfloat162*)&g;
    const __nv_bfloat162* u2 = (const __nv_bfloat162*)&u;
    uint4 o;
    __nv_bfloat162* o2 = (__nv_bfloat162*)&o;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        float2 gf = __bfloat1622float2(g2[e]), uf = __bfloat1622float2(u2[e]);
        o2[e] = __floats2bfloat162_rn(silu_times(gf.x, uf.x), silu_times(gf.y, uf.y));
    }
    *(uint4*)(out + i) = o;
}
