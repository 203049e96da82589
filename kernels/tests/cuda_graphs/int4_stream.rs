//! The streaming one-row int4 GEMV gives what the strip GEMV gives: the
//! same groups a warp in the same order, the same sums.

use kiln_kernels::cuda::{GemmShape, Gpu, int4_stream_fits};
use kiln_kernels::matmul::Weight;
use kiln_kernels::quant::{DType, quantize};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub(super) fn check(gpu: &mut Gpu, seed: u64) {
    let rng = &mut ChaCha8Rng::seed_from_u64(seed);
    // Groups of 128 and 64; 4096 wide (32 groups: four a warp) and 1344
    // (10.5 groups of 128 do not tile: 21 of 64, some warps with one
    // group fewer).
    for (dtype, n, k) in [
        (DType::Int4G128, 272usize, 4096usize),
        (DType::Int4G64, 144, 1344),
        (DType::Int4G128, 48, 10240),
    ] {
        let group = if dtype == DType::Int4G64 { 64 } else { 128 };
        assert!(
            int4_stream_fits(k, group),
            "{dtype:?} {n}x{k} takes the strip GEMV"
        );
        let values: Vec<f32> = (0..n * k).map(|_| rng.random_range(-0.05..0.05)).collect();
        let bytes: Vec<u8> = values.chunks(k).flat_map(|r| quantize(dtype, r)).collect();
        let w = gpu
            .weight(&Weight::from_bytes(dtype, n, k, bytes).unwrap())
            .unwrap();
        let x: Vec<f32> = (0..k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let x = gpu.upload(&x).unwrap();
        let mut scratch = gpu.gemm_scratch(1, k, true).unwrap();
        let shape = GemmShape { m: 1, n, k };
        let mut run = |gpu: &mut Gpu, stream: bool| {
            gpu.set_int4_stream(stream);
            let mut out = gpu.upload(&vec![f32::NAN; n]).unwrap();
            gpu.matmul(&x, &w, &mut out, shape, &mut scratch).unwrap();
            gpu.download(&out).unwrap()
        };
        let want = run(gpu, false);
        let got = run(gpu, true);
        assert!(want.iter().all(|v| v.is_finite()), "{dtype:?} {n}x{k}");
        // The same sums in the same order; only the compiler's contraction
        // of each group's epilogue may differ, by rounding of its terms.
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * scale,
                "{dtype:?} {n}x{k} row {i}: {a} vs {b}"
            );
        }
    }
    gpu.set_int4_stream(false);
    // Past 48 KiB of shared memory the strip GEMV takes the row.
    assert!(!int4_stream_fits(14336, 128));
}
