// SiLU-and-multiply, the FFN's activation (see act.rs).

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
