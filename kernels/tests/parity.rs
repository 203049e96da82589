//! Every kernel against a float64 reference, on fresh random inputs each
//! run. Written once: on the CPU by default (CI), on CUDA with
//! `KILN_TEST_DEVICE=cuda` (the GPU machine), where a CUDA that does not
//! work fails the tests instead of skipping them.
#![allow(
    clippy::needless_range_loop,
    reason = "references index like the maths"
)]

use half::bf16;
use kiln_kernels::backend::{Backend, Cpu, NormedRow};
use kiln_kernels::ops::{Rope, RopeStyle};
use kiln_kernels::sample::SamplingParams;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Decode and prefill attention.
#[path = "parity/attention.rs"]
mod attention;
#[path = "parity/kv_io.rs"]
mod kv_io;
#[path = "parity/quantized.rs"]
mod quantized;

fn backend() -> Box<dyn Backend> {
    match std::env::var("KILN_TEST_DEVICE").as_deref() {
        Ok("cuda") => Box::new(
            kiln_kernels::cuda::Gpu::new(0)
                .unwrap_or_else(|e| panic!("KILN_TEST_DEVICE=cuda, but CUDA does not work: {e}")),
        ),
        Ok("cpu") | Err(_) => Box::new(Cpu),
        Ok(other) => panic!("KILN_TEST_DEVICE={other}: use cpu or cuda"),
    }
}

/// The backend under test, and on CUDA each other build of a kernel that
/// has several (prefill attention in blocks of 8 warps beside 4), named.
fn variants() -> Vec<(String, Box<dyn Backend>)> {
    let mut all = vec![("default".to_owned(), backend())];
    if std::env::var("KILN_TEST_DEVICE").as_deref() == Ok("cuda") {
        let mut gpu = kiln_kernels::cuda::Gpu::new(0).expect("CUDA works");
        gpu.set_prefill_warps(8).expect("8 warps are built");
        all.push(("prefill in 8 warps".to_owned(), Box::new(gpu)));
    }
    all
}

/// A fresh generator per run; the seed is printed, and `KILN_TEST_SEED`
/// replays it.
fn rng() -> ChaCha8Rng {
    let seed = std::env::var("KILN_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random::<u64>());
    eprintln!("seed {seed}");
    ChaCha8Rng::seed_from_u64(seed)
}

fn random(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// ‖out − want‖ / ‖want‖, with NaN (an unwritten element) failing.
fn rel_err(out: &[f32], want: &[f64]) -> f64 {
    assert_eq!(out.len(), want.len());
    assert!(
        out.iter().all(|v| v.is_finite()),
        "an output was not written or is not finite"
    );
    let num: f64 = out
        .iter()
        .zip(want)
        .map(|(a, b)| (*a as f64 - b).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| b * b).sum();
    (num / den.max(1e-30)).sqrt()
}

#[test]
fn rmsnorm_with_residual_matches_float64() {
    let (be, mut r) = (backend(), rng());
    let (rows, dim) = (7, 576);
    let mut x = random(&mut r, rows * dim, 2.0);
    let res = random(&mut r, rows * dim, 2.0);
    let w = random(&mut r, dim, 1.5);
    let sum: Vec<f64> = x
        .iter()
        .zip(&res)
        .map(|(a, b)| *a as f64 + *b as f64)
        .collect();
    let mut want = vec![0.0; rows * dim];
    for (row, o) in sum.chunks(dim).zip(want.chunks_mut(dim)) {
        let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / dim as f64 + 1e-5).sqrt();
        for i in 0..dim {
            o[i] = row[i] * inv * w[i] as f64;
        }
    }
    let mut out = vec![f32::NAN; rows * dim];
    be.rmsnorm_residual(&mut x, Some(&res), &w, 1e-5, &mut out)
        .unwrap();
    assert!(rel_err(&x, &sum) < 1e-6, "{}: the residual sum", be.name());
    let e = rel_err(&out, &want);
    assert!(e < 1e-5, "{}: rel err {e}", be.name());
}

#[test]
fn rope_in_both_layouts_matches_float64() {
    let (be, mut r) = (backend(), rng());
    for style in [RopeStyle::Interleaved, RopeStyle::Half] {
        let (tokens, heads, dim) = (5, 3, 64);
        let rope = Rope::new(dim, 10000.0, None, style);
        let pos: Vec<usize> = (0..tokens).map(|_| r.random_range(0..4096)).collect();
        let x0 = random(&mut r, tokens * heads * dim, 1.0);
        let mut want = vec![0.0f64; x0.len()];
        let half = dim / 2;
        for t in 0..tokens {
            for h in 0..heads {
                let base = (t * heads + h) * dim;
                for (i, f) in rope.inv_freq().iter().enumerate() {
                    let (a, b) = match style {
                        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                        RopeStyle::Half => (i, i + half),
                    };
                    let ang = pos[t] as f64 * *f as f64;
                    let (x0a, x0b) = (x0[base + a] as f64, x0[base + b] as f64);
                    want[base + a] = x0a * ang.cos() - x0b * ang.sin();
                    want[base + b] = x0a * ang.sin() + x0b * ang.cos();
                }
            }
        }
        let mut x = x0.clone();
        be.rope(&mut x, &pos, &rope).unwrap();
        let e = rel_err(&x, &want);
        assert!(e < 2e-4, "{} {style:?}: rel err {e}", be.name());
    }
}

#[test]
fn silu_mul_and_embedding_match_float64() {
    let (be, mut r) = (backend(), rng());
    // Whole groups of four, then a tail of three (CUDA takes four a thread).
    for n in [10_000, 10_003] {
        let mut gate = random(&mut r, n, 6.0);
        let up = random(&mut r, n, 2.0);
        let want: Vec<f64> = gate
            .iter()
            .zip(&up)
            .map(|(g, u)| *g as f64 / (1.0 + (-*g as f64).exp()) * *u as f64)
            .collect();
        be.silu_mul(&mut gate, &up).unwrap();
        assert!(rel_err(&gate, &want) < 1e-5, "{} n={n}", be.name());
    }
    let (vocab, hidden) = (300, 96);
    let table: Vec<bf16> = random(&mut r, vocab * hidden, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let ids: Vec<u32> = (0..9).map(|_| r.random_range(0..vocab as u32)).collect();
    let want: Vec<f64> = ids
        .iter()
        .flat_map(|id| {
            table[*id as usize * hidden..(*id as usize + 1) * hidden]
                .iter()
                .map(|v| v.to_f64())
        })
        .collect();
    let mut out = vec![f32::NAN; ids.len() * hidden];
    be.embed(&table, hidden, &ids, &mut out).unwrap();
    assert_eq!(
        rel_err(&out, &want),
        0.0,
        "{}: a gather is exact",
        be.name()
    );
}

#[test]
fn page_tag_check_flags_exactly_the_sequences_with_a_stale_page() {
    let (be, mut r) = (backend(), rng());
    let pages_total = 64;
    let current: Vec<[u64; 2]> = (0..pages_total)
        .map(|_| [r.random(), r.random_range(0..5)])
        .collect();
    let seqs = 9;
    let (mut pages, mut expected, mut offsets) = (Vec::new(), Vec::new(), vec![0]);
    let stale: Vec<bool> = (0..seqs).map(|_| r.random_bool(0.4)).collect();
    for s in 0..seqs {
        let n = r.random_range(1..12);
        for i in 0..n {
            let p = r.random_range(0..pages_total as u32);
            let mut tag = current[p as usize];
            if stale[s] && i == n - 1 {
                tag[0] ^= 1; // an old generation of that page
            }
            pages.push(p);
            expected.push(tag);
        }
        offsets.push(pages.len());
    }
    let flags = be.tag_check(&pages, &expected, &offsets, &current).unwrap();
    let want: Vec<bool> = stale.iter().map(|s| !s).collect();
    assert_eq!(flags, want, "{}", be.name());
}

#[test]
fn argmax_picks_the_first_largest_logit() {
    let (be, mut r) = (backend(), rng());
    let n = 49_152;
    let mut x = random(&mut r, 4 * n, 10.0);
    x[n + 7] = 50.0;
    x[n + 9000] = 50.0; // a tie: the lower index wins
    let got = be.argmax_rows(&x, n).unwrap();
    assert_eq!(got[1], 7, "{}", be.name());
    for (row, g) in x.chunks(n).zip(&got) {
        let best = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(row[*g as usize], best);
    }
}

#[test]
fn log_probabilities_match_the_cpus_with_ties_by_id() {
    let (be, mut r) = (backend(), rng());
    let n = 5000;
    let mut x = random(&mut r, 3 * n, 8.0);
    // Ties at the top (lowest id first), a NaN, and a masked row.
    x[10] = 30.0;
    x[4000] = 30.0;
    x[n + 7] = f32::NAN;
    for v in x[2 * n..3 * n].iter_mut().skip(1).step_by(2) {
        *v = f32::NEG_INFINITY;
    }
    let picks = [4000, 3, 2 * 1000];
    let got = be.row_logprobs(&x, n, &picks, 20).unwrap();
    for (i, row) in x.chunks(n).enumerate() {
        let (want_lp, want_top) = kiln_kernels::sample::logprobs(row, picks[i], 20);
        let (lp, top) = &got[i];
        assert!(
            (lp - want_lp).abs() < 1e-4,
            "{} row {i}: {lp} vs {want_lp}",
            be.name()
        );
        let ids: Vec<u32> = top.iter().map(|t| t.0).collect();
        let want_ids: Vec<u32> = want_top.iter().map(|t| t.0).collect();
        assert_eq!(ids, want_ids, "{} row {i}", be.name());
        for (a, b) in top.iter().zip(&want_top) {
            assert!(
                (a.1 - b.1).abs() < 1e-4,
                "{} row {i}: {a:?} vs {b:?}",
                be.name()
            );
        }
    }
    assert_eq!(got[0].1[0].0, 10, "equal logits by id");
}

#[test]
fn masked_rows_keep_exactly_the_allowed_tokens() {
    let (be, mut r) = (backend(), rng());
    // A vocabulary that is not a multiple of 32, and a mask a word short.
    let n: usize = 1000;
    let words = n.div_ceil(32);
    let x = random(&mut r, 3 * n, 5.0);
    let short = words - 1;
    let mut masks = vec![0u32; 2 * short];
    for v in [0, 31, 32, 500] {
        masks[v / 32] |= 1 << (v % 32);
    }
    masks[short..].fill(u32::MAX);
    let got = be.mask_rows(&x, n, &masks, short, &[0, -1, 1]).unwrap();
    for v in 0..n {
        let allowed = [0, 31, 32, 500].contains(&v);
        let want = if allowed { x[v] } else { f32::NEG_INFINITY };
        assert_eq!(got[v], want, "{} row 0 token {v}", be.name());
        assert_eq!(got[n + v], x[n + v], "{}: row 1 has no mask", be.name());
        // Past the mask's words nothing is allowed.
        let past = v >= short * 32;
        let want = if past {
            f32::NEG_INFINITY
        } else {
            x[2 * n + v]
        };
        assert_eq!(got[2 * n + v], want, "{} row 2 token {v}", be.name());
    }
}

#[test]
fn bf16_matmul_matches_float64_for_decode_and_prefill_shapes() {
    let (be, mut r) = (backend(), rng());
    let (n, k) = (384, 512);
    let w: Vec<bf16> = random(&mut r, n * k, 0.5)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    // m = 1 takes the GEMV on CUDA; the rest cuBLAS.
    for m in [1, 3, 8, 40] {
        let x = random(&mut r, m * k, 1.0);
        let mut want = vec![0.0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                want[i * n + j] = (0..k)
                    .map(|t| x[i * k + t] as f64 * w[j * k + t].to_f64())
                    .sum();
            }
        }
        let mut out = vec![f32::NAN; m * n];
        be.matmul_bf16(&x, m, &w, n, k, &mut out).unwrap();
        let e = rel_err(&out, &want);
        // cuBLAS rounds the activations to bf16 first.
        let tol = if m > 1 { 8e-3 } else { 1e-5 };
        assert!(e < tol, "{} m={m}: rel err {e}", be.name());
    }
}

#[test]
fn decode_products_with_the_norm_folded_in_match_float64() {
    let (be, mut r) = (backend(), rng());
    let eps = 1e-5;
    let bf = |v: Vec<f32>| -> Vec<bf16> { v.into_iter().map(bf16::from_f32).collect() };
    // Llama-3-8B's o projection into a hidden row of 4096, then a row of
    // 1000 (125 partial sums of squares, not whole 16-byte pieces) and
    // output rows not a multiple of the kernels' blocks (1001).
    for (hidden, k_in, out_rows) in [(4096, 4096, 1024), (1000, 1536, 1001)] {
        let x = random(&mut r, k_in, 1.0);
        let w = bf(random(&mut r, hidden * k_in, 0.05));
        let h0 = random(&mut r, hidden, 1.0);
        let g = random(&mut r, hidden, 2.0);
        let (mut h, mut gh) = (h0.clone(), vec![f32::NAN; hidden]);
        let ss = be
            .matmul_residual(&x, &w, k_in, &mut h, &g, &mut gh)
            .unwrap();
        // float64: h + x w^T, g h, the sum of squares.
        let y = product64(
            &x,
            1,
            &w.iter().map(|v| v.to_f32()).collect::<Vec<_>>(),
            hidden,
        );
        let h64: Vec<f64> = h0.iter().zip(&y).map(|(a, b)| *a as f64 + b).collect();
        let gh64: Vec<f64> = h64.iter().zip(&g).map(|(a, b)| a * *b as f64).collect();
        let ss64: f64 = h64.iter().map(|v| v * v).sum();
        let e = [rel_err(&h, &h64), rel_err(&gh, &gh64)];
        assert!(e.iter().all(|e| *e < 1e-5), "{} h, gh: {e:?}", be.name());
        let ess = (ss as f64 - ss64).abs() / ss64;
        assert!(ess < 1e-5, "{} sum of squares {ss} vs {ss64}", be.name());
        // What follows the norm: rmsnorm(h) * g times w2, plain and as
        // gate/up with SiLU-and-multiply.
        let xn: Vec<f32> = {
            let s = 1.0 / (ss64 / hidden as f64 + eps as f64).sqrt();
            gh64.iter().map(|v| (v * s) as f32).collect()
        };
        for silu in [false, true] {
            let rows = if silu { 2 * out_rows } else { out_rows };
            let w2 = bf(random(&mut r, rows * hidden, 0.05));
            let w2f: Vec<f32> = w2.iter().map(|v| v.to_f32()).collect();
            let mut want = product64(&xn, 1, &w2f, rows);
            if silu {
                let (gate, up) = want.split_at_mut(out_rows);
                for (a, b) in gate.iter_mut().zip(up.iter()) {
                    *a = *a / (1.0 + (-*a).exp()) * b;
                }
                want.truncate(out_rows);
            }
            let mut out = vec![f32::NAN; out_rows];
            let row = NormedRow { gh: &gh, ss, eps };
            be.matmul_normed(&row, &w2, hidden, silu, &mut out).unwrap();
            let e = rel_err(&out, &want);
            assert!(e < 1e-5, "{} silu={silu} {hidden}: rel err {e}", be.name());
        }
    }
}

/// `x (m x k) * w^T` for `w` (`n x k`), in float64.
fn product64(x: &[f32], m: usize, w: &[f32], n: usize) -> Vec<f64> {
    let k = x.len() / m;
    (0..m * n)
        .map(|o| {
            let (i, j) = (o / n, o % n);
            (0..k)
                .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                .sum()
        })
        .collect()
}

/// Whether `token` is what sampling `row` with `p` and draw `u` picks, in
/// float64 and up to a sliver of mass `eps` (of the nucleus) either side of
/// each boundary: summation order may move a draw that lands within
/// rounding of a boundary to the neighbouring token.
fn valid_pick(row: &[f32], p: SamplingParams, u: f32, token: u32, eps: f64) -> bool {
    if p.is_greedy() {
        return token == kiln_kernels::sample::argmax(row);
    }
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|a, b| row[*b].total_cmp(&row[*a]));
    let k = if p.top_k > 0 {
        p.top_k.min(row.len())
    } else {
        row.len()
    };
    // Logits tied with the k-th largest are all candidates.
    let kth = row[idx[k - 1]];
    let k = k + idx[k..].iter().filter(|i| row[**i] == kth).count();
    let max = row[idx[0]] as f64;
    let weight = |l: f32| ((l as f64 - max) / p.temperature as f64).exp();
    let w: Vec<f64> = idx[..k].iter().map(|i| weight(row[*i])).collect();
    let z: f64 = w.iter().sum();
    // The nucleus, then the draw's target in it.
    let mut keep = k;
    let mut acc = 0.0;
    for (i, v) in w.iter().enumerate() {
        acc += v / z;
        if acc >= p.top_p as f64 {
            keep = i + 1;
            break;
        }
    }
    // Logits tied with the nucleus's last are in it too.
    while keep < k && row[idx[keep]] == row[idx[keep - 1]] {
        keep += 1;
    }
    let zn: f64 = w[..keep].iter().sum();
    let (target, slack) = (u as f64 * zn, eps * zn);
    // Equal logits are one group: any order among them is right, and a
    // tie with the k-th logit is a candidate too.
    let l = row[token as usize];
    if l < row[idx[k - 1]] {
        return false;
    }
    let before: f64 = (0..k).filter(|i| row[idx[*i]] > l).map(|i| w[i]).sum();
    let within: f64 = (0..k).filter(|i| row[idx[*i]] == l).map(|i| w[i]).sum();
    let within = if within > 0.0 { within } else { weight(l) };
    // In the nucleus (up to rounding at its edge), and where the draw lands.
    before <= p.top_p as f64 * z + slack
        && before - slack <= target
        && target <= before + within + slack
}

#[test]
fn sampling_with_top_k_and_top_p_picks_what_the_cpu_picks_for_the_same_draw() {
    let (be, mut r) = (backend(), rng());
    let rows = 24;
    for n in [1000, 50_000] {
        for (temperature, top_k, top_p) in [
            (0.0, 0, 1.0),
            (0.8, 1, 1.0),
            (0.7, 0, 0.9),
            (1.0, 40, 1.0),
            (0.5, 50, 0.8),
            (1.3, 0, 1.0),
        ] {
            let p = SamplingParams {
                temperature,
                top_k,
                top_p,
            };
            let logits = random(&mut r, rows * n, 4.0);
            let u: Vec<f32> = (0..rows).map(|_| r.random::<f32>()).collect();
            let got = be.sample_rows(&logits, n, &vec![p; rows], &u).unwrap();
            for (i, row) in logits.chunks_exact(n).enumerate() {
                if p.top_k > 1 || p.top_p < 1.0 {
                    // The checker itself rejects a token outside the set.
                    let lowest = (0..n).min_by(|a, b| row[*a].total_cmp(&row[*b])).unwrap();
                    assert!(!valid_pick(row, p, u[i], lowest as u32, 1e-4));
                }
                assert!(
                    valid_pick(row, p, u[i], got[i], 1e-4),
                    "{} n={n} {p:?} u={}: token {}",
                    be.name(),
                    u[i],
                    got[i]
                );
            }
        }
    }
}
