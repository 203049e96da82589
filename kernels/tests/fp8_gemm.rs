//! FP8 W8A8 GEMMs through cuBLASLt: activations quantized on the device
//! exactly as `fp8::encode` quantizes each row on the host, and the GEMM
//! over FP8 rows (packed codes and a scale vector, as uploaded; both scale
//! vectors applied by cuBLASLt) matching float64 over the same e4m3 values. CUDA only, so
//! ignored unless asked for: `KILN_TEST_DEVICE=cuda` with
//! `--include-ignored`.

use half::bf16;
use kiln_kernels::cuda::{DeviceWeight, GemmShape, Gpu, NormArgs, StackShape};
use kiln_kernels::fp8;
use kiln_kernels::matmul::Weight;
use kiln_kernels::quant::{DType, FP8_ROW_HEADER, dequantize_row, fp8_rows_packed, quantize_rows};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn fp8_rows_times_fp8_activations_match_float64_over_the_same_values() {
    let gpu = Gpu::open(0, true).expect("a CUDA device");
    let s = gpu.stream().clone();
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    // Row counts that are not multiples of 16, to test the layouts' edges.
    for (m, n, k) in [(37usize, 200usize, 256usize), (130, 96, 512)] {
        let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-3.0..3.0)).collect();
        let values: Vec<f32> = (0..n * k).map(|_| rng.random_range(-0.5..0.5)).collect();
        let w = quantize_rows(DType::Fp8Row, k, &values);
        // The weights as the device packs them for FP8 tensor cores.
        let (codes, scales) = fp8_rows_packed(&w, k).unwrap();
        let xd = s.clone_htod(&x).unwrap();
        let (wd, ws) = (
            s.clone_htod(&codes).unwrap(),
            s.clone_htod(&scales).unwrap(),
        );
        let mut xq = s.alloc_zeros::<u8>(m * k).unwrap();
        let mut xs = s.alloc_zeros::<f32>(m).unwrap();
        let mut out = s.alloc_zeros::<f32>(m * n).unwrap();
        gpu.quantize_rows_e4m3(&xd, &mut xq, &mut xs, m, k).unwrap();
        gpu.gemm_fp8_rows(
            &wd.slice(..),
            &ws.slice(..),
            &xq,
            &xs,
            &mut out,
            GemmShape { m, n, k },
        )
        .unwrap();
        let (q, scales, got) = (
            s.clone_dtoh(&xq).unwrap(),
            s.clone_dtoh(&xs).unwrap(),
            s.clone_dtoh(&out).unwrap(),
        );
        // The device's quantization is the host's, bit for bit.
        for r in 0..m {
            let mut want = vec![0u8; k];
            let scale = fp8::encode(&x[r * k..(r + 1) * k], &mut want);
            assert_eq!(scales[r], scale, "row {r}'s scale");
            assert_eq!(&q[r * k..(r + 1) * k], &want[..], "row {r}'s e4m3 bytes");
        }
        // The product over exactly those values, in float64.
        let mut xv = vec![0.0f32; m * k];
        for r in 0..m {
            fp8::decode(
                &q[r * k..(r + 1) * k],
                scales[r],
                &mut xv[r * k..(r + 1) * k],
            );
        }
        let row_bytes = FP8_ROW_HEADER + k;
        let mut wv = vec![0.0f32; n * k];
        for (j, row) in wv.chunks_exact_mut(k).enumerate() {
            dequantize_row(DType::Fp8Row, &w[j * row_bytes..(j + 1) * row_bytes], row);
        }
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|t| xv[i * k + t] as f64 * wv[j * k + t] as f64)
                    .sum();
                num += (got[i * n + j] as f64 - want).powi(2);
                den += want * want;
            }
        }
        let rel = (num / den).sqrt();
        eprintln!("FP8 GEMM {m} x {k} by {n}: rel err {rel:.2e}");
        // FP8 tensor cores keep fewer accumulator bits than f32 (the H200
        // reads ~1e-4 here); a wrong layout, stride or scale reads ~1.
        assert!(rel < 1e-3, "{m} x {k} by {n}: rel err {rel}");
    }
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn bf16_activations_quantize_as_the_host_and_the_gemm_writes_bf16() {
    let gpu = Gpu::open(0, true).expect("a CUDA device");
    let s = gpu.stream().clone();
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    // 100 columns take the kernel's one-at-a-time path, 512 its 8-wide one.
    for (m, n, k) in [(5usize, 32usize, 100usize), (70, 112, 512)] {
        let x: Vec<bf16> = (0..m * k)
            .map(|_| bf16::from_f32(rng.random_range(-3.0..3.0)))
            .collect();
        let wide: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
        let xd = s.clone_htod(&x).unwrap();
        let mut xq = s.alloc_zeros::<u8>(m * k).unwrap();
        let mut xs = s.alloc_zeros::<f32>(m).unwrap();
        gpu.quantize_rows_e4m3(&xd, &mut xq, &mut xs, m, k).unwrap();
        let (q, scales) = (s.clone_dtoh(&xq).unwrap(), s.clone_dtoh(&xs).unwrap());
        for r in 0..m {
            let mut want = vec![0u8; k];
            let scale = fp8::encode(&wide[r * k..(r + 1) * k], &mut want);
            assert_eq!(scales[r], scale, "row {r}'s scale");
            assert_eq!(&q[r * k..(r + 1) * k], &want[..], "row {r}'s e4m3 bytes");
        }
        if !k.is_multiple_of(16) {
            continue;
        }
        // The same product into bf16 and into f32: one bf16 rounding apart
        // (a step of up to 2^-7 of the value where the two kernels' f32
        // sums fall either side of a rounding boundary).
        let values: Vec<f32> = (0..n * k).map(|_| rng.random_range(-0.5..0.5)).collect();
        let w = quantize_rows(DType::Fp8Row, k, &values);
        let (codes, scales) = fp8_rows_packed(&w, k).unwrap();
        let (wd, ws) = (
            s.clone_htod(&codes).unwrap(),
            s.clone_htod(&scales).unwrap(),
        );
        let mut out16 = s.alloc_zeros::<bf16>(m * n).unwrap();
        let mut out32 = s.alloc_zeros::<f32>(m * n).unwrap();
        let shape = GemmShape { m, n, k };
        let (wv, sv) = (wd.slice(..), ws.slice(..));
        gpu.gemm_fp8_rows(&wv, &sv, &xq, &xs, &mut out16, shape)
            .unwrap();
        gpu.gemm_fp8_rows(&wv, &sv, &xq, &xs, &mut out32, shape)
            .unwrap();
        let (got, want) = (s.clone_dtoh(&out16).unwrap(), s.clone_dtoh(&out32).unwrap());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let err = (g.to_f32() - w).abs();
            assert!(
                err <= w.abs() / 128.0 + 1e-6,
                "element {i}: bf16 {g} against f32 {w}"
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn silu_pairs_quantize_in_one_pass_as_in_two() {
    let gpu = Gpu::open(0, true).expect("a CUDA device");
    let s = gpu.stream().clone();
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    // Rows of 17408 hold more pieces than a thread keeps in registers.
    for (rows, f) in [(3usize, 64usize), (33, 1536), (4, 17408)] {
        let gu: Vec<bf16> = (0..rows * 2 * f)
            .map(|_| bf16::from_f32(rng.random_range(-6.0..6.0)))
            .collect();
        let gud = s.clone_htod(&gu).unwrap();
        let mut scratch = gpu.gemm_scratch(rows, f, false).unwrap();
        gpu.silu_mul_pairs(&gud, &mut scratch, rows, f).unwrap();
        let (mut q1, mut s1) = (
            s.alloc_zeros::<u8>(rows * f).unwrap(),
            s.alloc_zeros(rows).unwrap(),
        );
        let (mut q2, mut s2) = (
            s.alloc_zeros::<u8>(rows * f).unwrap(),
            s.alloc_zeros(rows).unwrap(),
        );
        gpu.quantize_rows_e4m3(scratch.activations(), &mut q1, &mut s1, rows, f)
            .unwrap();
        gpu.silu_mul_pairs_e4m3(&gud, &mut q2, &mut s2, rows, f)
            .unwrap();
        let (s1, s2): (Vec<f32>, Vec<f32>) =
            (s.clone_dtoh(&s1).unwrap(), s.clone_dtoh(&s2).unwrap());
        assert_eq!(s1, s2, "{rows} x {f}: row scales");
        assert_eq!(
            s.clone_dtoh(&q1).unwrap(),
            s.clone_dtoh(&q2).unwrap(),
            "{rows} x {f}: e4m3 codes"
        );
    }
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn a_norm_into_e4m3_gives_the_product_of_the_f32_norm() {
    // The norm writes e4m3 codes and row scales for the W8A8 GEMM itself:
    // the same residual sum, codes and so products, bit for bit, as the
    // norm into f32 whose rows the GEMM then quantizes.
    let gpu = Gpu::open(0, true).expect("a CUDA device");
    let s = gpu.stream().clone();
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    // A few rows (a block of a thread a piece) and many (prefill's fewer
    // threads a block, each holding several pieces).
    for m in [70usize, 300] {
        let (k, parts) = (512usize, [96usize, 32]);
        let n: usize = parts.iter().sum();
        let values: Vec<f32> = (0..n * k).map(|_| rng.random_range(-0.5..0.5)).collect();
        let bytes = quantize_rows(DType::Fp8Row, k, &values);
        let dw = gpu
            .weight(&Weight::from_bytes(DType::Fp8Row, n, k, bytes).unwrap())
            .unwrap();
        if !matches!(dw, DeviceWeight::Fp8 { .. }) {
            eprintln!("skipped: FP8 rows take the W8A8 GEMM from sm_90");
            return;
        }
        let mut v = |n: usize, lo: f32, hi: f32| -> Vec<f32> {
            (0..n).map(|_| rng.random_range(lo..hi)).collect()
        };
        let (x, res, nw) = (v(m * k, -2.0, 2.0), v(m * k, -1.0, 1.0), v(k, 0.5, 1.5));
        let (res, nw) = (s.clone_htod(&res).unwrap(), s.clone_htod(&nw).unwrap());
        let norm = NormArgs {
            residual: Some(&res),
            w: &nw,
            rows: m,
            cols: k,
            eps: 1e-5,
        };
        let mut scratch = gpu.gemm_scratch(m, k, true).unwrap();
        let mut run = |fused: bool| {
            let mut h = s.clone_htod(&x).unwrap();
            let mut outs: Vec<_> = parts
                .iter()
                .map(|p| s.alloc_zeros::<f32>(m * p).unwrap())
                .collect();
            let mut refs: Vec<&mut _> = outs.iter_mut().collect();
            if fused {
                gpu.normed_parts(&mut h, &norm, &dw, &mut refs, &parts, &mut scratch)
                    .unwrap();
            } else {
                let mut xn = s.alloc_zeros::<f32>(m * k).unwrap();
                gpu.rmsnorm_residual(&mut h, &mut xn, &norm).unwrap();
                let shape = StackShape {
                    m,
                    parts: &parts,
                    k,
                };
                gpu.matmul_parts(&xn, &dw, &mut refs, shape, &mut scratch)
                    .unwrap();
            }
            let bits = |d: &cudarc::driver::CudaSlice<f32>| -> Vec<u32> {
                s.clone_dtoh(d)
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            (bits(&h), outs.iter().map(bits).collect::<Vec<_>>())
        };
        let (want, got) = (run(false), run(true));
        assert!(want.0 == got.0, "{m} rows: the residual sums differ");
        for (p, (w, g)) in want.1.iter().zip(&got.1).enumerate() {
            assert!(w == g, "{m} rows: part {p}'s products differ");
        }
    }
}
