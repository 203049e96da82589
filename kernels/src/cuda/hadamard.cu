// The Walsh-Hadamard rotation of the static fp8 pages' heads (see
// hadamard.rs).

// Rotates x (n elements in shared memory, thread i holding element i, n
// threads) by the orthonormal Walsh-Hadamard transform, as
// kiln_kernels::hadamard::rotate does and in its order: stage h pairs i
// with i ^ h.
__device__ void hadamard_shared(float* x, int n) {
    int i = threadIdx.x;
    for (int h = 1; h < n; h <<= 1) {
        float a = x[i], b = x[i ^ h];
        __syncthreads();
        x[i] = (i & h) ? b - a : a + b;
        __syncthreads();
    }
    x[i] *= 1.0f / sqrtf((float)n);
}

// Rotates each row of hd (a power of two up to 1024) of x in place by
// hadamard_shared: grid rows, threads hd. Reference path: the engine's
// step rotates inside rope_kv_write; kept for the test of that rotation.
extern "C" __global__ void hadamard_rows(float* x, int hd) {
    PDL_ENTER();
    __shared__ float r[1024];
    float* row = x + (size_t)blockIdx.x * hd;
    r[threadIdx.x] = row[threadIdx.x];
    __syncthreads();
    hadamard_shared(r, hd);
    row[threadIdx.x] = r[threadIdx.x];
}
