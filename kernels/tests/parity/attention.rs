//! Paged decode and causal prefill attention against float64, in bf16 and
//! fp8 pages, at SmolLM2's and Llama-3-8B's head shapes.

use kiln_kernels::backend::{AttentionCase, AttentionKernel, KvRow};
use kiln_kernels::kv::{KvFormat, KvLayout};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::{backend, random, rel_err, rng, variants};

/// Float64 attention of each sequence's query over its unquantized rows.
fn attention_reference(c: &AttentionCase, keys: &[Vec<f32>], vals: &[Vec<f32>]) -> Vec<f64> {
    let (hd, kvh) = (c.layout.head_dim, c.layout.kv_heads);
    let group = c.heads / kvh;
    let mut out = vec![0.0f64; c.q.len()];
    for (s, len) in c.lens.iter().enumerate() {
        for h in 0..c.heads {
            let q = &c.q[(s * c.heads + h) * hd..(s * c.heads + h + 1) * hd];
            let g = h / group;
            let scores: Vec<f64> = (0..*len)
                .map(|t| {
                    let k = &keys[s][(t * kvh + g) * hd..(t * kvh + g + 1) * hd];
                    q.iter()
                        .zip(k)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        * c.scale as f64
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for (t, p) in e.iter().enumerate() {
                let v = &vals[s][(t * kvh + g) * hd..(t * kvh + g + 1) * hd];
                for d in 0..hd {
                    out[(s * c.heads + h) * hd + d] += p / z * v[d] as f64;
                }
            }
        }
    }
    out
}

/// Query heads, KV heads and head size: SmolLM2's (groups of 3, 64) and
/// Llama-3-8B's (groups of 4, 128).
pub(super) const SMALL: [usize; 3] = [6, 2, 64];
pub(super) const LLAMA3: [usize; 3] = [8, 2, 128];

pub(super) fn attention_case(
    r: &mut ChaCha8Rng,
    format: KvFormat,
    lens: &[usize],
    shape: [usize; 3],
) -> (AttentionCase, Vec<Vec<f32>>, Vec<Vec<f32>>) {
    attention_case_paged(r, format, lens, shape, 16)
}

/// As [`attention_case`], in pages of `page_size` tokens.
fn attention_case_paged(
    r: &mut ChaCha8Rng,
    format: KvFormat,
    lens: &[usize],
    [heads, kv_heads, head_dim]: [usize; 3],
    page_size: usize,
) -> (AttentionCase, Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let layout = KvLayout {
        page_size,
        kv_heads,
        head_dim,
    };
    let row = layout.kv_heads * layout.head_dim;
    let pages_needed: usize = lens.iter().map(|l| l.div_ceil(page_size)).sum();
    let num_pages = pages_needed + 7;
    // Scattered pages, as block tables have them.
    let mut free: Vec<u32> = (0..num_pages as u32).collect();
    for i in (1..free.len()).rev() {
        free.swap(i, r.random_range(0..=i));
    }
    let (mut rows, mut tables, mut keys, mut vals) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for len in lens {
        let table: Vec<u32> = (0..len.div_ceil(page_size))
            .map(|_| free.pop().unwrap())
            .collect();
        let k = random(r, len * row, 2.0);
        let v = random(r, len * row, 2.0);
        for t in 0..*len {
            rows.push(KvRow {
                slot: table[t / page_size] as usize * page_size + t % page_size,
                k: k[t * row..(t + 1) * row].to_vec(),
                v: v[t * row..(t + 1) * row].to_vec(),
            });
        }
        tables.push(table);
        keys.push(k);
        vals.push(v);
    }
    let q = random(r, lens.len() * heads * layout.head_dim, 1.0);
    let case = AttentionCase {
        format,
        layout,
        num_pages,
        rows,
        q,
        heads,
        tables,
        lens: lens.to_vec(),
        scale: 0.125,
        kernel: AttentionKernel::Best,
    };
    (case, keys, vals)
}

/// Each value's bits.
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn paged_decode_attention_matches_float64_in_bf16_and_fp8() {
    let (be, mut r) = (backend(), rng());
    // Lengths across partition boundaries (512) and within one page.
    let lens = [1, 17, 300, 513, 1100];
    let cases = [
        (KvFormat::Bf16, 1e-2),
        (KvFormat::Fp8, 6e-2),
        (KvFormat::Fp8Static, 6e-2),
    ];
    // Pages of 16, and of 64 for Llama-3's shape (chunks at every offset
    // of a page).
    let shapes = [(SMALL, 16), (LLAMA3, 16), (LLAMA3, 64)];
    for ((format, tol), (shape, page)) in cases.into_iter().flat_map(|c| shapes.map(|s| (c, s))) {
        let (mut case, keys, vals) = attention_case_paged(&mut r, format, &lens, shape, page);
        let shape = (shape, page);
        let want = attention_reference(&case, &keys, &vals);
        let mut first: Option<Vec<f64>> = None;
        let mut flash: Option<Vec<f32>> = None;
        for kernel in [
            AttentionKernel::Best,
            AttentionKernel::Flash,
            AttentionKernel::FlashFourAnSm,
            AttentionKernel::FlashFusedMerge,
            AttentionKernel::FlashUnsplit,
            AttentionKernel::Shuffle,
        ] {
            case.kernel = kernel;
            let out = be.paged_attention(&case).unwrap();
            // The other builds run the same operations on the same bytes.
            match kernel {
                AttentionKernel::Flash => flash = Some(out.clone()),
                AttentionKernel::FlashFourAnSm => assert!(
                    flash.as_ref().is_some_and(|f| bits(f) == bits(&out)),
                    "{} {format:?} {shape:?}: {kernel:?} changed the output",
                    be.name()
                ),
                // The same partials, merged in another order.
                AttentionKernel::FlashFusedMerge => {
                    let wide = |f: &Vec<f32>| f.iter().map(|v| *v as f64).collect::<Vec<_>>();
                    let e = flash
                        .as_ref()
                        .map_or(f64::INFINITY, |f| rel_err(&out, &wide(f)));
                    assert!(
                        e < 1e-5,
                        "{} {format:?} {shape:?}: fused merge off by {e}",
                        be.name()
                    );
                }
                _ => {}
            }
            let e = rel_err(&out, &want);
            let what = format!("{} {format:?} {kernel:?} {shape:?}", be.name());
            assert!(e < tol, "{what}: rel err {e}");
            // The kernels read the same stored pages: they may differ only
            // in the order of their sums, and over fp8 pages in Q's
            // precision (the flash kernel scores on e4m3 tensor cores with Q
            // as two e4m3 pieces: bf16's 2^-8, where the shuffle kernel
            // keeps f32).
            let agree = match format {
                KvFormat::Bf16 => 1e-5,
                KvFormat::Fp8 | KvFormat::Fp8Static => 5e-3,
            };
            match &first {
                None => first = Some(out.iter().map(|v| *v as f64).collect()),
                Some(f) => {
                    let e = rel_err(&out, f);
                    assert!(e < agree, "{what} against Best: {e}");
                }
            }
        }
    }
}

#[test]
fn causal_prefill_attention_matches_float64_in_bf16_and_fp8() {
    let mut r = rng();
    // Each build of the kernel (blocks of 4 and 8 warps on CUDA).
    for (variant, be) in variants() {
        // Sequences of these lengths, the last `new` tokens of each a prefill
        // chunk (the rest cached before): chunks across tiles, pages and key
        // tiles, and a whole prompt from position 0; at SmolLM2's heads (a
        // group of 3 and 64 dimensions) and Llama-3-8B's (4 and 128).
        let seqs = [(45, 45), (300, 70), (33, 1), (600, 13)];
        let cases = [
            (KvFormat::Bf16, 1e-2),
            (KvFormat::Fp8, 6e-2),
            (KvFormat::Fp8Static, 6e-2),
        ];
        for ((format, tol), shape) in cases.into_iter().flat_map(|c| [(c, SMALL), (c, LLAMA3)]) {
            let lens: Vec<usize> = seqs.iter().map(|(l, _)| *l).collect();
            let (mut case, keys, vals) = attention_case(&mut r, format, &lens, shape);
            // One query per new token, attending to its position and before.
            let (mut tables, mut qlens, mut qkeys, mut qvals) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for (s, (len, new)) in seqs.iter().enumerate() {
                for pos in len - new..*len {
                    tables.push(case.tables[s].clone());
                    qlens.push(pos + 1);
                    qkeys.push(keys[s].clone());
                    qvals.push(vals[s].clone());
                }
            }
            case.q = random(&mut r, qlens.len() * case.heads * case.layout.head_dim, 1.0);
            case.tables = tables;
            case.lens = qlens;
            let want = attention_reference(&case, &qkeys, &qvals);
            let out = be.prefill_attention(&case).unwrap();
            let e = rel_err(&out, &want);
            assert!(e < tol, "{} ({variant}) {format:?}: rel err {e}", be.name());
            // Against the decode kernel, one query per token over the same
            // stored pages: they differ in the order of the sums and in Q's and
            // P's precision (prefill rounds both to 16 bits on tensor cores, as
            // FlashAttention does; decode keeps Q to ~2^-16 over bf16 pages
            // and scores on e4m3 tensor cores over fp8 pages).
            let per_token = be.paged_attention(&case).unwrap();
            let per_token: Vec<f64> = per_token.iter().map(|v| *v as f64).collect();
            let e = rel_err(&out, &per_token);
            let agree = match (be.name() == "cpu", format) {
                (true, KvFormat::Bf16) => 1e-5,
                _ => 5e-3,
            };
            assert!(
                e < agree,
                "{} ({variant}) {format:?}: against decode attention, rel err {e}",
                be.name()
            );
        }
    }
}
