// RMSNorm with the residual add before it (see norm.rs).

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
