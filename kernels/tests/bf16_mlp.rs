//! The bf16 MLP's two kernels against float64: one GEMM over stacked
//! gate/up weights with a bf16 product (cuBLAS's own choice and a tuned
//! cuBLASLt algorithm), and SiLU-and-multiply over its
//! gate and up halves into the down projection's bf16 input. CUDA only, so
//! ignored unless asked for: `KILN_TEST_DEVICE=cuda` with
//! `--include-ignored`.

use half::bf16;
use kiln_kernels::cuda::{Bf16Out, DeviceWeight, GemmShape, Gpu, TuneBf16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Checks that every `got` is `want` rounded once to bf16 (within 2^-8 of
/// it, relatively), give or take `slack` times the values' RMS for the
/// f32 arithmetic before the rounding.
fn one_rounding(what: &str, got: &[bf16], want: &[f64], slack: f64) {
    let rms = (want.iter().map(|w| w * w).sum::<f64>() / want.len() as f64).sqrt();
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g.to_f64() - w).abs();
        assert!(
            err <= w.abs() / 256.0 + slack * rms,
            "{what}[{i}]: {} against {w}",
            g.to_f64()
        );
    }
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn the_bf16_mlp_rounds_only_its_outputs() {
    let gpu = Gpu::open(0, true).expect("a CUDA device");
    let s = gpu.stream().clone();
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    // SmolLM2's widths: 80 rows of 576 into gate and up of 1536 each.
    let (m, k, f) = (80usize, 576usize, 1536usize);
    let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0..2.0)).collect();
    let w: Vec<bf16> = (0..2 * f * k)
        .map(|_| bf16::from_f32(rng.random_range(-0.1..0.1)))
        .collect();
    let weight = DeviceWeight::Bf16(s.clone_htod(&w).unwrap());
    let mut scratch = gpu.gemm_scratch(m, 2 * f, false).unwrap();
    gpu.load_activations(&s.clone_htod(&x).unwrap(), &mut scratch, m * k)
        .unwrap();
    let mut gu = s.alloc_zeros::<bf16>(m * 2 * f).unwrap();
    let shape = GemmShape { m, n: 2 * f, k };
    gpu.matmul_bf16_out(&weight, &mut gu, shape, &mut scratch)
        .unwrap();
    let gu = s.clone_dtoh(&gu).unwrap();
    // The product, from the bf16 activations, in float64.
    let xb: Vec<f64> = x.iter().map(|v| bf16::from_f32(*v).to_f64()).collect();
    let want: Vec<f64> = (0..m * 2 * f)
        .map(|i| {
            let (r, c) = (i / (2 * f), i % (2 * f));
            (0..k).map(|j| xb[r * k + j] * w[c * k + j].to_f64()).sum()
        })
        .collect();
    // f32 sums of 576 exact products: far below a bf16 step.
    one_rounding("gate/up product", &gu, &want, 1e-4);
    // The same product by the fastest of cuBLASLt's algorithms, kept
    // however it compares with cublasGemmEx's (as decode steps past 16
    // rows run it with `--cuda-bf16-mlp-decode`).
    let DeviceWeight::Bf16(wd) = &weight else {
        unreachable!()
    };
    let tune = TuneBf16 {
        rows: &[m],
        candidates: 8,
        keep_below: f64::INFINITY,
        out: Bf16Out::Bf16,
    };
    let tuned = gpu.tune_bf16(wd, 0, shape, tune).unwrap();
    assert!(tuned.len() == 1 && tuned[0].kept, "{tuned:?}");
    let mut gt = s.alloc_zeros::<bf16>(m * 2 * f).unwrap();
    gpu.matmul_bf16_out(&weight, &mut gt, shape, &mut scratch)
        .unwrap();
    one_rounding(
        "tuned gate/up product",
        &s.clone_dtoh(&gt).unwrap(),
        &want,
        1e-4,
    );
    // SiLU-and-multiply over the device's own bf16 product.
    let mut gud = s.clone_htod(&gu).unwrap();
    gpu.silu_mul_pairs(&gud, &mut scratch, m, f).unwrap();
    let act = s.clone_dtoh(scratch.activations()).unwrap();
    let want: Vec<f64> = (0..m * f)
        .map(|i| {
            let (r, c) = (i / f, i % f);
            let g = gu[r * 2 * f + c].to_f64();
            let u = gu[r * 2 * f + f + c].to_f64();
            g / (1.0 + (-g).exp()) * u
        })
        .collect();
    one_rounding("silu-mul pairs", &act[..m * f], &want, 1e-6);
    // Widths of whole 8s only.
    gud = s.alloc_zeros::<bf16>(2 * 12).unwrap();
    assert!(gpu.silu_mul_pairs(&gud, &mut scratch, 1, 12).is_err());
}
