// Sampling on the device (launched from cuda/sample.rs): temperature, top-k and
// top-p over a whole logits row without sorting it, with the uniform draw made
// by the host from the request's seeded generator. What it picks is what
// kernels/src/sample.rs picks for the same draw: the candidates are the top-k
// logits, their softmax at temperature T, the nucleus the shortest prefix
// (largest first) whose mass reaches top_p, and the token the first in that
// order where the running mass reaches u times the nucleus's mass.
//
// Each "first prefix reaching a mass" is a radix select on order-preserving
// keys of the logits: four passes of 8 bits, each a 256-bin histogram of
// weight (a count, or exp((l - max) / T)) in shared memory.

#define SAMPLE_THREADS 1024

__device__ __forceinline__ unsigned order_key(float f) {
    unsigned b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The key t with weight{key > t} < target <= weight{key >= t} among keys at
// least `floor`, weights counts (by_mass false) or exp((l - mx) / t).
// When rounding leaves the target out of reach, the smallest key present.
__device__ unsigned select_key(const float* row, int n, unsigned floor, bool by_mass, float mx,
                               float t, float target, float* hist) {
    unsigned prefix = 0;
    float above = 0.0f;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0.0f;
        __syncthreads();
        unsigned high_mask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            unsigned k = order_key(row[i]);
            if (k < floor || (k & high_mask) != prefix) continue;
            float w = by_mass ? expf((row[i] - mx) / t) : 1.0f;
            atomicAdd(&hist[(k >> shift) & 0xff], w);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float acc = above;
            int chosen = -1, lowest = -1;
            for (int b = 255; b >= 0; b--) {
                if (hist[b] <= 0.0f) continue;
                lowest = b;
                if (acc + hist[b] >= target) {
                    chosen = b;
                    break;
                }
                acc += hist[b];
            }
            if (chosen < 0) {
                // Out of reach: the last bin with any weight, mass above it.
                chosen = lowest < 0 ? 0 : lowest;
                acc -= lowest < 0 ? 0.0f : hist[lowest];
            }
            hist[256] = acc;
            hist[257] = __uint_as_float(prefix | ((unsigned)chosen << shift));
        }
        __syncthreads();
        above = hist[256];
        prefix = __float_as_uint(hist[257]);
        __syncthreads();
    }
    return prefix;
}

// Sum over the block of `v` (blockDim.x == SAMPLE_THREADS).
__device__ float sample_sum(float v, float* red) {
    return block_sum(v, red);
}

// One row per block of SAMPLE_THREADS threads. params: per row
// (temperature, top_p, uniform); top_k: per row (0 = all).
extern "C" __global__ void sample_rows(const float* logits, int n, const float* params,
                                       const int* top_k, unsigned* out) {
    PDL_ENTER();
    __shared__ float hist[258];
    __shared__ float red[32];
    __shared__ int best;
    const float* row = logits + (size_t)blockIdx.x * n;
    float t = params[3 * blockIdx.x], top_p = params[3 * blockIdx.x + 1];
    float u = params[3 * blockIdx.x + 2];
    int k = top_k[blockIdx.x];
    // The largest logit, lowest index on ties (the greedy answer).
    float mx = -INFINITY;
    int arg = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = row[i];
        if (v > mx || (v == mx && i < arg)) { mx = v; arg = i; }
    }
    float gmx = warp_max(mx);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = gmx;
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = -INFINITY;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) m = fmaxf(m, red[w]);
        red[0] = m;
        best = 0x7fffffff;
    }
    __syncthreads();
    float gmax = red[0];
    __syncthreads();
    if (mx == gmax) atomicMin(&best, arg);
    __syncthreads();
    if (t <= 0.0f || k == 1) {
        if (threadIdx.x == 0) out[blockIdx.x] = best == 0x7fffffff ? 0 : best;
        return;
    }
    // Top-k: the k-th largest key (ties at it all stay in).
    unsigned floor = 0;
    if (k > 0 && k < n) floor = select_key(row, n, 0, false, gmax, t, (float)k, hist);
    // The candidates' mass; the nucleus reaching top_p of it.
    float z = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (order_key(row[i]) >= floor) z += expf((row[i] - gmax) / t);
    z = sample_sum(z, red);
    if (top_p < 1.0f) {
        floor = select_key(row, n, floor, true, gmax, t, top_p * z, hist);
        z = 0.0f;
        for (int i = threadIdx.x; i < n; i += blockDim.x)
            if (order_key(row[i]) >= floor) z += expf((row[i] - gmax) / t);
        z = sample_sum(z, red);
    }
    // The draw: the first key where the running mass reaches u * z.
    unsigned pick = select_key(row, n, floor, true, gmax, t, u * z, hist);
    if (threadIdx.x == 0) best = 0x7fffffff;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (order_key(row[i]) == pick) atomicMin(&best, i);
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = best == 0x7fffffff ? (unsigned)arg : best;
}

// Keeps (v, i) in (bv, bi) when v is larger, or equal at a lower index
// (NaN never wins).
__device__ __forceinline__ void arg_take(float& bv, int& bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) {
        bv = v;
        bi = i;
    }
}

// Greedy sampling: the index of each row's largest logit (the lowest index
// on ties, as on the CPU). Grid: rows; threads: a multiple of 32. Rows of
// a multiple of 4 are read as 16-byte pieces, four pieces in flight per
// thread.
extern "C" __global__ void argmax_rows(const float* logits, int n, unsigned* out) {
    PDL_ENTER();
    __shared__ float wv[32];
    __shared__ int wi[32];
    const float* row = logits + (size_t)blockIdx.x * n;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    int bd = blockDim.x;
    if ((n & 3) == 0) {
        const float4* r4 = (const float4*)row;
        int n4 = n >> 2, i = threadIdx.x;
        for (; i + 3 * bd < n4; i += 4 * bd) {
            float4 a[4];
#pragma unroll
            for (int k = 0; k < 4; k++) a[k] = r4[i + k * bd];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                int e = 4 * (i + k * bd);
                arg_take(bv, bi, a[k].x, e);
                arg_take(bv, bi, a[k].y, e + 1);
                arg_take(bv, bi, a[k].z, e + 2);
                arg_take(bv, bi, a[k].w, e + 3);
            }
        }
        for (; i < n4; i += bd) {
            float4 a = r4[i];
            arg_take(bv, bi, a.x, 4 * i);
            arg_take(bv, bi, a.y, 4 * i + 1);
            arg_take(bv, bi, a.z, 4 * i + 2);
            arg_take(bv, bi, a.w, 4 * i + 3);
        }
    } else {
        for (int i = threadIdx.x; i < n; i += bd) arg_take(bv, bi, row[i], i);
    }
    for (int o = 16; o > 0; o >>= 1) {
        float v = __shfl_xor_sync(0xffffffff, bv, o);
        int j = __shfl_xor_sync(0xffffffff, bi, o);
        arg_take(bv, bi, v, j);
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        wv[warp] = bv;
        wi[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        bv = lane < (bd >> 5) ? wv[lane] : -INFINITY;
        bi = lane < (bd >> 5) ? wi[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            float v = __shfl_xor_sync(0xffffffff, bv, o);
            int j = __shfl_xor_sync(0xffffffff, bi, o);
            arg_take(bv, bi, v, j);
        }
        if (lane == 0) out[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;
    }
}

// Output formats: row r of logits (n wide) keeps only the tokens its mask
// allows (bit v % 32 of word v / 32 of mask slot[r]; words past `words`
// allow nothing); a row whose slot is negative is left alone. Grid: rows.
extern "C" __global__ void mask_rows(float* logits, int n, const unsigned* masks, int words,
                                     const int* slot) {
    PDL_ENTER();
    int s = slot[blockIdx.x];
    if (s < 0) return;
    float* row = logits + (size_t)blockIdx.x * n;
    const unsigned* m = masks + (size_t)s * words;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        int w = i >> 5;
        unsigned bits = w < words ? m[w] : 0u;
        if (!((bits >> (i & 31)) & 1u)) row[i] = -INFINITY;
    }
}

// Log-probabilities, part one (before any mask): for each row whose slot s
// is not negative, out[s * (2 + 2 * top)] = ln of the row's softmax
// denominator and, from out[... + 2] on, the `top` most likely tokens as
// (id bits, log-probability) pairs, most likely first, equal logits by id.
// A NaN logit counts as impossible. Grid: rows; threads: a multiple of 32.
extern "C" __global__ void top_logprobs_rows(const float* logits, int n, const int* slot, int top,
                                             float* out) {
    PDL_ENTER();
    __shared__ float red[32];
    __shared__ float wv[32];
    __shared__ int wi[32];
    __shared__ float z_s;
    int s = slot[blockIdx.x];
    if (s < 0) return;
    const float* row = logits + (size_t)blockIdx.x * n;
    float* o = out + (size_t)s * (2 + 2 * top);
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = row[i];
        if (v == v) mx = fmaxf(mx, v);
    }
    mx = warp_max(mx);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mx;
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = -INFINITY;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) m = fmaxf(m, red[w]);
        z_s = m;
    }
    __syncthreads();
    float gmax = z_s;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = row[i];
        if (v == v) sum += expf(v - gmax);
    }
    __syncthreads();
    sum = block_sum(sum, red);
    float log_z = gmax + logf(sum);
    if (threadIdx.x == 0) o[0] = log_z;
    // The k-th most likely: the largest (value, then lowest index) after
    // the (k-1)-th in that order.
    float lv = INFINITY;
    int li = -1;
    for (int k = 0; k < top; k++) {
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            float v = row[i];
            if (v != v) v = -INFINITY;
            bool after = v < lv || (v == lv && i > li);
            if (after && (v > bv || (v == bv && i < bi))) {
                bv = v;
                bi = i;
            }
        }
        for (int off = 16; off > 0; off >>= 1) {
            float v = __shfl_xor_sync(0xffffffff, bv, off);
            int j = __shfl_xor_sync(0xffffffff, bi, off);
            if (v > bv || (v == bv && j < bi)) {
                bv = v;
                bi = j;
            }
        }
        int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        __syncthreads();
        if (lane == 0) {
            wv[warp] = bv;
            wi[warp] = bi;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < (int)(blockDim.x >> 5); w++) {
                if (wv[w] > wv[0] || (wv[w] == wv[0] && wi[w] < wi[0])) {
                    wv[0] = wv[w];
                    wi[0] = wi[w];
                }
            }
            o[2 + 2 * k] = __int_as_float(wi[0] == 0x7fffffff ? 0 : wi[0]);
            o[3 + 2 * k] = wv[0] - log_z;
        }
        __syncthreads();
        lv = wv[0];
        li = wi[0];
    }
}

// Log-probabilities, part two (after the draw): the drawn token's, at
// out[s * (2 + 2 * top) + 1], from part one's denominator. The drawn token
// is one its mask allows, so its logit is the model's. Grid: rows / 32.
extern "C" __global__ void chosen_logprobs_rows(const float* logits, int n, int rows,
                                                const unsigned* picks, const int* slot, int top,
                                                float* out) {
    PDL_ENTER();
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    int s = slot[r];
    if (s < 0) return;
    float* o = out + (size_t)s * (2 + 2 * top);
    float v = logits[(size_t)r * n + picks[r]];
    o[1] = v == v ? v - o[0] : -INFINITY;
}
