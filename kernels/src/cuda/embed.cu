// Embedding rows of a bf16 table (see embed.rs; quant.cu embeds GGUF
// blocks).

// out[t] = table[ids[t]] (bf16 rows to f32). One block per token.
extern "C" __global__ void embed_bf16(const __nv_bfloat16* table, const unsigned* ids,
                                      float* out, int hidden) {
    PDL_ENTER();
    const __nv_bfloat16* row = table + (size_t)ids[blockIdx.x] * hidden;
    float* o = out + (size_t)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = __bfloat162float(row[i]);
}
