//! The W8A8 kernel for few activation rows (`fp8_mma.cu`): decode batches'
//! products with FP8 rows on FP8 tensor cores, against float64 over the
//! same e4m3 values, against cuBLASLt on the same codes, and its bf16
//! output against its f32 output. CUDA only, so ignored unless asked for:
//! `KILN_TEST_DEVICE=cuda` with `--include-ignored`.

use half::bf16;
use kiln_kernels::cuda::{DeviceWeight, E4M3_MMA_MAX_M, GemmShape, Gpu, StackShape};
use kiln_kernels::fp8;
use kiln_kernels::matmul::Weight;
use kiln_kernels::quant::{DType, FP8_ROW_HEADER, dequantize_row, quantize_rows};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// ‖got − want‖ / ‖want‖.
fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den).sqrt()
}

/// `n` FP8 rows of `k` on the device where they are packed for tensor
/// cores, which the kernel takes (sm_90 and up); `None`, saying the test
/// skipped, elsewhere.
fn kernel_weight(gpu: &Gpu, n: usize, k: usize, bytes: Vec<u8>) -> Option<DeviceWeight> {
    let dw = gpu
        .weight(&Weight::from_bytes(DType::Fp8Row, n, k, bytes).unwrap())
        .unwrap();
    if matches!(dw, DeviceWeight::Fp8 { .. }) {
        return Some(dw);
    }
    eprintln!("skipped: FP8 rows take FP8 tensor cores from sm_90");
    None
}

/// `x`'s rows as W8A8 reads them: each row's e4m3 values times its scale.
fn quantized(x: &[f32], k: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; x.len()];
    let mut codes = vec![0u8; k];
    for (row, o) in x.chunks_exact(k).zip(out.chunks_exact_mut(k)) {
        let scale = fp8::encode(row, &mut codes);
        fp8::decode(&codes, scale, o);
    }
    out
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn few_rows_on_fp8_tensor_cores_match_float64_and_cublaslt() {
    let mut gpu = Gpu::open(0, true).expect("a CUDA device");
    let s = gpu.stream().clone();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    // Stacks of parts that are not whole strips (the last strip's rows past
    // the end read a clamped row and write nothing), K of 1, 8 (two rounds
    // of four pieces a warp) and 28 pieces, and of 64 and 1 piece and a
    // 32-wide tail.
    let cases = [
        ([40usize, 24, 8], 64usize),
        ([96, 40, 40], 4096),
        ([48, 0, 0], 14336),
        ([32, 20, 0], 4128),
        ([16, 0, 0], 96),
    ];
    for (parts, k) in cases {
        let parts: Vec<usize> = parts.into_iter().filter(|p| *p > 0).collect();
        let n: usize = parts.iter().sum();
        let values: Vec<f32> = (0..n * k).map(|_| rng.random_range(-0.5..0.5)).collect();
        let bytes = quantize_rows(DType::Fp8Row, k, &values);
        let row_bytes = FP8_ROW_HEADER + k;
        let mut wv = vec![0.0f32; n * k];
        for (j, row) in wv.chunks_exact_mut(k).enumerate() {
            dequantize_row(
                DType::Fp8Row,
                &bytes[j * row_bytes..(j + 1) * row_bytes],
                row,
            );
        }
        let Some(dw) = kernel_weight(&gpu, n, k, bytes) else {
            return;
        };
        let mut scratch = gpu.gemm_scratch(E4M3_MMA_MAX_M, k, true).unwrap();
        for m in [1usize, 3, 8, 9, E4M3_MMA_MAX_M] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-3.0..3.0)).collect();
            let xv = quantized(&x, k);
            let xd = s.clone_htod(&x).unwrap();
            let shape = StackShape {
                m,
                parts: &parts,
                k,
            };
            let mut run = |gpu: &mut Gpu, mma: bool| -> Vec<Vec<f32>> {
                gpu.set_fp8_mma(mma);
                let mut outs: Vec<_> = parts
                    .iter()
                    .map(|p| s.alloc_zeros::<f32>(m * p).unwrap())
                    .collect();
                let mut refs: Vec<_> = outs.iter_mut().collect();
                gpu.matmul_parts(&xd, &dw, &mut refs, shape, &mut scratch)
                    .unwrap();
                outs.iter().map(|o| s.clone_dtoh(o).unwrap()).collect()
            };
            let ours = run(&mut gpu, true);
            let theirs = run(&mut gpu, false);
            let mut row0 = 0;
            for (p, &rows) in parts.iter().enumerate() {
                let want: Vec<f64> = (0..m * rows)
                    .map(|i| {
                        let (r, c) = (i / rows, row0 + i % rows);
                        (0..k)
                            .map(|t| xv[r * k + t] as f64 * wv[c * k + t] as f64)
                            .sum()
                    })
                    .collect();
                let err = rel_err(&ours[p], &want);
                let lt = rel_err(&theirs[p], &want);
                eprintln!("e4m3 MMA m={m} k={k} part {p}: rel err {err:.2e} (cuBLASLt {lt:.2e})");
                assert!(err < 1e-4, "m={m} k={k} part {p}: rel err {err:.2e}");
                // cuBLASLt accumulates in the tensor cores' own registers
                // (fast accumulation), whose error grows with K (1.2e-3
                // measured at 4096).
                assert!(lt < 5e-3, "cuBLASLt m={m} k={k} part {p}: rel err {lt:.2e}");
                row0 += rows;
            }
        }
    }
    gpu.set_fp8_mma(true);
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn the_mma_kernels_bf16_output_is_its_f32_output_rounded() {
    let gpu = Gpu::open(0, true).expect("a CUDA device");
    let s = gpu.stream().clone();
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let (n, k) = (272usize, 1024usize);
    let values: Vec<f32> = (0..n * k).map(|_| rng.random_range(-0.5..0.5)).collect();
    let bytes = quantize_rows(DType::Fp8Row, k, &values);
    let Some(dw) = kernel_weight(&gpu, n, k, bytes) else {
        return;
    };
    let mut scratch = gpu.gemm_scratch(E4M3_MMA_MAX_M, k, true).unwrap();
    for m in [1usize, 5, 9, E4M3_MMA_MAX_M] {
        let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-3.0..3.0)).collect();
        let xd = s.clone_htod(&x).unwrap();
        gpu.load_activations(&xd, &mut scratch, m * k).unwrap();
        let mut f = s.alloc_zeros::<f32>(m * n).unwrap();
        let shape = StackShape { m, parts: &[n], k };
        gpu.matmul_parts_bf16(&dw, &mut [&mut f], shape, &mut scratch)
            .unwrap();
        let mut h = s.alloc_zeros::<bf16>(m * n).unwrap();
        gpu.matmul_bf16_out(&dw, &mut h, GemmShape { m, n, k }, &mut scratch)
            .unwrap();
        let (f, h) = (s.clone_dtoh(&f).unwrap(), s.clone_dtoh(&h).unwrap());
        assert!(f.iter().any(|v| *v != 0.0), "m={m}: an empty product");
        for (i, (a, b)) in f.iter().zip(&h).enumerate() {
            assert_eq!(bf16::from_f32(*a), *b, "m={m}, element {i}");
        }
    }
}
