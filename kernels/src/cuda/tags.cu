// The page-tag check a step starts with (see tags.rs).

// The batched page-tag check, run inside a step before anything reads or
// writes KV. Inputs sit in `in`, the step's one buffer of 32-bit words (word
// offsets given): `expected` holds two u64 words (generation, tenant) per
// block-table entry, `tables` the entries, sequence s's at
// seq_tab[s]..seq_tab[s + 1]; `current` two u64 words per physical page.
// flags[s] = 1 when every page of s still carries the tag s recorded. When
// s fails and tok_off >= 0, its tokens t in tok_off[s]..tok_off[s + 1] get
// lens[t] = 0 and slots[t] = -1, so the rest of the step neither reads nor
// writes its pages. Grid: sequences.
extern "C" __global__ void tag_check(unsigned* in, int expected, int tables, int seq_tab,
                                     int tok_off, int lens, int slots,
                                     const unsigned long long* current, unsigned* flags) {
    PDL_ENTER();
    int s = blockIdx.x;
    const unsigned long long* exp = (const unsigned long long*)(in + expected);
    const int* tab = (const int*)(in + tables);
    const int* st = (const int*)(in + seq_tab);
    int ok = 1;
    for (int i = st[s] + threadIdx.x; i < st[s + 1]; i += blockDim.x) {
        size_t p = (unsigned)tab[i];
        if (current[2 * p] != exp[2 * i] || current[2 * p + 1] != exp[2 * i + 1]) ok = 0;
    }
    ok = __syncthreads_and(ok);
    if (threadIdx.x == 0) flags[s] = ok;
    if (!ok && tok_off >= 0) {
        const int* to = (const int*)(in + tok_off);
        for (int t = to[s] + threadIdx.x; t < to[s + 1]; t += blockDim.x) {
            ((int*)(in + lens))[t] = 0;
            ((int*)(in + slots))[t] = -1;
        }
    }
}

// Pages given new tags since the last step: `n` triples of u64 words
// (page, generation, tenant) at word offset `changes` of `in`; a page at or
// past `pages` is padding (a captured step has room for a fixed number).
extern "C" __global__ void tag_scatter(const unsigned* in, int changes, int n,
                                       unsigned long long* current, long long pages) {
    PDL_ENTER();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned long long* c = (const unsigned long long*)(in + changes) + 3 * i;
    if (c[0] >= (unsigned long long)pages) return;
    current[2 * c[0]] = c[1];
    current[2 * c[0] + 1] = c[2];
}
