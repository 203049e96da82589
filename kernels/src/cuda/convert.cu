// Element-wise conversions and row copies (see convert.rs and cublas.rs).

// f32 to bf16, element-wise (activations before a cuBLAS GEMM).
extern "C" __global__ void to_bf16(const float* x, __nv_bfloat16* y, long long n) {
    PDL_ENTER();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2bfloat16(x[i]);
}

// x[r][c] += b[c] over rows x cols (the q/k/v biases of Qwen2).
extern "C" __global__ void add_bias(float* x, const float* b, long long n, int cols) {
    PDL_ENTER();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += b[i % cols];
}

// out[i] = src[idx[i]] for rows of `cols` floats. One block per row.
extern "C" __global__ void gather_rows(const float* src, const unsigned* idx, float* out, int cols) {
    PDL_ENTER();
    const float* row = src + (size_t)idx[blockIdx.x] * cols;
    float* o = out + (size_t)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) o[i] = row[i];
}
