//! The folded one-row products on FP8 rows run on FMAs (`fp8_fma.cu`,
//! W8A32): the fold chain of `fold.rs` against the same chain computed on
//! the host in f64 from the dequantized rows and f32 activations (the
//! W8A8 launches they would replace quantize x, so they are no reference
//! for a kernel that does not), and bit for bit the same launched one by
//! one or replayed from graphs, plain or programmatic; and every e4m3
//! code, subnormals included, read as its value.

use kiln_kernels::cuda::{Fp8FoldFma, Normed};
use kiln_kernels::matmul::Weight;
use kiln_kernels::quant::{DType, dequantize_row};

use super::device;
use super::fold::{Chain, DIM, EPS, FFN, QKV, ROUNDS, Values, rel};

/// `rows` rows of `dtype` bytes as f64.
fn dequantized(dtype: DType, bytes: &[u8], rows: usize, cols: usize) -> Vec<f64> {
    let mut out = vec![0.0f32; rows * cols];
    for (b, o) in bytes.chunks(bytes.len() / rows).zip(out.chunks_mut(cols)) {
        dequantize_row(dtype, b, o);
    }
    out.into_iter().map(f64::from).collect()
}

/// `w` (`x.len()` columns a row) times x.
fn product(w: &[f64], x: &[f64]) -> Vec<f64> {
    w.chunks(x.len())
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

/// The chain on the host: h, u and the q/k/v parts after each round.
struct Host {
    down: Vec<f64>,
    gate_up: Vec<f64>,
    qkv: Vec<f64>,
    g: Vec<f64>,
    h: Vec<f64>,
    u: Vec<f64>,
    q: Vec<f64>,
}

impl Host {
    fn of(v: &Values) -> Host {
        let wide = |x: &[f32]| x.iter().map(|v| f64::from(*v)).collect::<Vec<_>>();
        Host {
            down: dequantized(v.dtype, &v.down, DIM, FFN),
            gate_up: dequantized(v.dtype, &v.gate_up, 2 * FFN, DIM),
            qkv: dequantized(v.dtype, &v.qkv, QKV.iter().sum(), DIM),
            g: wide(&v.g),
            h: wide(&v.h),
            u: wide(&v.u),
            q: Vec::new(),
        }
    }

    fn rounds(&mut self) {
        for _ in 0..ROUNDS {
            for (h, p) in self.h.iter_mut().zip(product(&self.down, &self.u)) {
                *h += p;
            }
            let ms = self.h.iter().map(|h| h * h).sum::<f64>() / DIM as f64;
            let f = 1.0 / (ms + f64::from(EPS)).sqrt();
            let xn: Vec<f64> = self.h.iter().zip(&self.g).map(|(h, g)| h * f * g).collect();
            self.q = product(&self.qkv, &xn);
            let gu = product(&self.gate_up, &xn);
            let (gate, up) = gu.split_at(FFN);
            self.u = gate
                .iter()
                .zip(up)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
        }
    }

    fn results(&self) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let narrow = |x: &[f64]| x.iter().map(|v| *v as f32).collect();
        (narrow(&self.h), narrow(&self.u), narrow(&self.q))
    }
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn fp8_rows_folded_on_fmas_match_the_chain_in_f64_and_replay_exactly() {
    let (mut gpu, seed) = device();
    let values = Values::new(seed, DType::Fp8Row);
    let mut host = Host::of(&values);
    host.rounds();
    let want = host.results();
    host.rounds();
    let want2 = host.results();
    let errs = |a: &(Vec<f32>, Vec<f32>, Vec<f32>), b: &(Vec<f32>, Vec<f32>, Vec<f32>)| {
        [rel(&a.0, &b.0), rel(&a.1, &b.1), rel(&a.2, &b.2)]
    };
    // Every product on FMAs, then q/k/v (and o, down) beside the MMAs'
    // others.
    for which in [Fp8FoldFma::All, Fp8FoldFma::Normed, Fp8FoldFma::Unpaired] {
        gpu.set_fp8_fold_fma(which);
        gpu.set_programmatic(false);
        let mut eager = Chain::of(&gpu, &values);
        eager.folded(&gpu).unwrap();
        let once = eager.results(&gpu);
        eager.folded(&gpu).unwrap();
        let twice = eager.results(&gpu);
        // All on FMAs: f32 sums of up to 4224 products against f64 ones,
        // through eight rounds, ~1e-6; a code read wrong moves a product by
        // far more. With MMAs beside them (x's e4m3 codes, ~3e-2 a product)
        // the host's chain is no reference: only printed, and the graphs
        // below held to the launches.
        for (got, want, pass) in [(&once, &want, 1), (&twice, &want2, 2)] {
            let e = errs(got, want);
            eprintln!(
                "FP8 rows, {which:?} on FMAs, pass {pass}: h {:.2e}, u {:.2e}, q {:.2e}",
                e[0], e[1], e[2]
            );
            let all = which == Fp8FoldFma::All;
            assert!(!all || e.iter().all(|e| *e < 1e-4), "pass {pass}: {e:?}");
        }
        for programmatic in [false, true] {
            gpu.set_programmatic(programmatic);
            let mut chain = Chain::of(&gpu, &values);
            let graph = gpu.capture(|| chain.folded(&gpu)).unwrap();
            for (replay, want) in [(1, &once), (2, &twice)] {
                gpu.replay(&graph).unwrap();
                gpu.synchronize().unwrap();
                assert!(
                    chain.results(&gpu) == *want,
                    "{which:?}: graph (programmatic {programmatic}), replay {replay}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn every_e4m3_code_reads_as_its_value_on_fmas() {
    // Random rows hold few subnormal codes, and one read wrong barely
    // moves a sum: here row r holds code (r + k) mod 256 at column k (the
    // two NaN codes as zeros) and a scale of its own, and x is the first
    // column's one-hot, so row r's product is code r's value times its
    // scale.
    const K: usize = 64;
    const ROWS: usize = 256;
    let (mut gpu, _) = device();
    gpu.set_fp8_fold_fma(Fp8FoldFma::All);
    let row_len = 16 + K;
    let mut bytes = Vec::with_capacity(ROWS * row_len);
    for r in 0..ROWS {
        bytes.extend((1.0f32 + r as f32 / 64.0).to_le_bytes());
        bytes.extend([0u8; 12]);
        bytes.extend((0..K).map(|k| match ((r + k) % 256) as u8 {
            0x7F | 0xFF => 0,
            c => c,
        }));
    }
    let w = Weight::from_bytes(DType::Fp8Row, ROWS, K, bytes.clone()).unwrap();
    let w = gpu.weight(&w).unwrap();
    let mut x = vec![0.0f32; K];
    x[0] = 1.0;
    let x = gpu.upload(&x).unwrap();
    // A norm factor of 1: the sum of squares K over K columns.
    let sum = gpu.norm_sum_of(K as f32, ROWS).unwrap();
    let input = Normed {
        gh: &x,
        sum: &sum,
        eps: 0.0,
    };
    let mut out = gpu.upload(&vec![f32::NAN; ROWS]).unwrap();
    gpu.gemv_normed(&input, &w, &mut [&mut out], &[ROWS], K)
        .unwrap();
    let got = gpu.download(&out).unwrap();
    let mut row = vec![0.0f32; K];
    for (r, got) in got.iter().enumerate() {
        dequantize_row(
            DType::Fp8Row,
            &bytes[r * row_len..(r + 1) * row_len],
            &mut row,
        );
        let want = row[0];
        assert!(
            (got - want).abs() <= 1e-6 * want.abs(),
            "code {r:#04x}: {got:e} against {want:e}"
        );
    }
}
