//! Products with quantized weights (GGUF blocks, int4 groups, FP8 rows)
//! against float64, as each backend reads the activations, through every
//! path a row count takes (GEMVs, tensor-core tiles, W8A8, dequantized
//! GEMMs) and every part of a stack.

use half::bf16;
use kiln_kernels::backend::Backend;
use kiln_kernels::matmul::Weight;
use kiln_kernels::quant::{self, DType};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::{backend, product64, random, rel_err, rng};

/// `m` random rows times `w` (whose values are `rows`) on `be` against
/// float64, within the tolerance of `be` for the weight's format.
fn product_within_tolerance(
    be: &dyn Backend,
    r: &mut ChaCha8Rng,
    w: &Weight,
    rows: &[f32],
    m: usize,
) {
    let (dtype, n, k) = (w.dtype(), w.rows(), w.cols());
    let x = random(r, m * k, 1.0);
    let read = activations_read(&be.name(), dtype, m, &x);
    let want = product64(&read, m, rows, n);
    let mut out = vec![f32::NAN; m * n];
    be.matmul_weight(&x, m, w, &mut out).unwrap();
    let e = rel_err(&out, &want);
    let tol = quantized_tolerance(&be.name(), dtype, n, m);
    assert!(e < tol, "{} {dtype:?} n={n} m={m}: rel err {e}", be.name());
}

/// A random `n x k` weight quantized as `dtype`.
fn random_weight(r: &mut ChaCha8Rng, dtype: DType, n: usize, k: usize) -> Weight {
    let values = random(r, n * k, 0.5);
    Weight::from_bytes(dtype, n, k, quant::quantize_rows(dtype, k, &values)).unwrap()
}

/// Every value of `w`, row-major.
fn values_of(w: &Weight) -> Vec<f32> {
    let mut rows = vec![0.0f32; w.rows() * w.cols()];
    for (i, row) in rows.chunks_exact_mut(w.cols()).enumerate() {
        w.row(i, row);
    }
    rows
}

#[test]
fn gguf_blocks_dequantize_like_the_cpu() {
    let (be, mut r) = (backend(), rng());
    let n = 32 * 50;
    let values = random(&mut r, n, 3.0);
    for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
        let bytes = quant::quantize(dtype, &values);
        let mut want = vec![0.0f32; n];
        quant::dequantize_row(dtype, &bytes, &mut want);
        let got = be.dequantize(dtype, &bytes, n).unwrap();
        let want64: Vec<f64> = want.iter().map(|v| *v as f64).collect();
        // f32 on both sides: only the rounding of d * q + m may differ.
        assert!(rel_err(&got, &want64) < 1e-6, "{} {dtype:?}", be.name());
    }
}

/// Whether `be` multiplies `m` rows by FP8 rows as W8A8: above the FP8
/// GEMV's rows the activations go to e4m3 per row, on the CPU and on CUDA
/// from sm_90 (below it, CUDA dequantizes the weights to bf16 instead).
fn fp8_activations(be: &str, dtype: DType, m: usize) -> bool {
    let sm = be
        .rsplit_once("(sm_")
        .and_then(|(_, t)| t.trim_end_matches(')').parse::<u32>().ok());
    let cuda = be.starts_with("cuda");
    dtype == DType::Fp8Row
        && (!cuda || sm.is_some_and(|sm| sm >= 90))
        && m > kiln_kernels::matmul::FP8_GEMV_ROWS
}

/// The activations as `be` multiplies them: for W8A8, each row's e4m3
/// values times its scale (as `fp8::encode` quantizes it); else `x`.
fn activations_read(be: &str, dtype: DType, m: usize, x: &[f32]) -> Vec<f32> {
    if !fp8_activations(be, dtype, m) {
        return x.to_vec();
    }
    kiln_kernels::fp8::round_rows(x, x.len() / m)
}

/// How close a product with a quantized weight comes to float64 on `be`:
/// f32 throughout on the CPU and for GGUF blocks; on CUDA, int4 tiles take
/// activations as bf16 hi + lo (~2^-16) in their GEMV, int4 rounds both
/// operands to bf16 for cuBLAS above 8 rows, and W8A8 (against the
/// activations as quantized) sums on FP8 tensor cores, whose accumulator
/// keeps fewer bits than f32 (~1e-4 measured on the H200).
fn quantized_tolerance(be: &str, dtype: DType, rows: usize, m: usize) -> f64 {
    let cuda = be.starts_with("cuda");
    let bf16_gemm = matches!(dtype, DType::Fp8Row | DType::Int4G128 | DType::Int4G64);
    let tiles = dtype.int4_group().is_some() && rows.is_multiple_of(16);
    if cuda && fp8_activations(be, dtype, m) {
        1e-3
    } else if cuda && bf16_gemm && m > kiln_kernels::cuda::GEMV_MAX_M {
        8e-3
    } else if cuda && tiles {
        5e-5
    } else {
        1e-5
    }
}

#[test]
fn block_quantized_matmul_and_embedding_match_float64() {
    let (be, mut r) = (backend(), rng());
    let k = 256;
    // On CUDA int4 runs in tensor-core tiles where rows are a multiple of
    // 16, else as Q4_1 blocks (repacked at upload): 208 rows and 200.
    let types = [
        (DType::Q8_0, 200),
        (DType::Q4_0, 200),
        (DType::Q4_1, 200),
        (DType::Int4G128, 208),
        (DType::Int4G64, 208),
        (DType::Int4G128, 200),
        (DType::Fp8Row, 200),
    ];
    for (dtype, n) in types {
        let w = random_weight(&mut r, dtype, n, k);
        let rows = values_of(&w);
        // On CUDA m <= 8 reads the blocks in the GEMVs; int4 tiles take 12,
        // 20 and 64 in their tensor-core GEMM (one strip a block, then
        // two), 70 dequantized for cuBLAS; FP8 rows above one row go to the
        // W8A8 GEMM.
        for m in [1, 5, 8, 12, 20, 64, 70] {
            product_within_tolerance(be.as_ref(), &mut r, &w, &rows, m);
        }
        let ids: Vec<u32> = (0..7).map(|_| r.random_range(0..n as u32)).collect();
        let mut out = vec![f32::NAN; ids.len() * k];
        be.embed_weight(&w, &ids, &mut out).unwrap();
        let want: Vec<f64> = ids
            .iter()
            .flat_map(|id| rows[*id as usize * k..(*id as usize + 1) * k].iter())
            .map(|v| *v as f64)
            .collect();
        assert!(
            rel_err(&out, &want) < 1e-7,
            "{} {dtype:?} embedding",
            be.name()
        );
    }
}

#[test]
fn long_quantized_rows_match_float64_through_every_load_loop() {
    // FP8 rows of 4128: on FP8 tensor cores, 64 pieces of 64 and a 32-wide
    // tail, and 68 rows, so the last strip reads past the end (without
    // them, two whole rounds of four 16-byte loads a lane in the GEMV,
    // then a tail two lanes take, and a last block whose last four warps
    // have none). Int4 rows of 4096: 32
    // and 64 groups, so each warp of the GEMV of up to 8 rows takes two
    // groups at a time, twice or more; rows of 14336 (112 groups) take the
    // one-row GEMV through four batches of loads a warp.
    let (be, mut r) = (backend(), rng());
    for (dtype, n, k) in [
        (DType::Fp8Row, 68, 4128),
        (DType::Int4G128, 48, 4096),
        (DType::Int4G64, 48, 4096),
        (DType::Int4G128, 32, 14336),
    ] {
        let w = random_weight(&mut r, dtype, n, k);
        let rows = values_of(&w);
        for m in [1, 3] {
            product_within_tolerance(be.as_ref(), &mut r, &w, &rows, m);
        }
    }
}

#[test]
fn stacked_projections_match_float64_for_every_part() {
    let (be, mut r) = (backend(), rng());
    let k = 256;
    // q, k and v of a grouped-query layer: a big part and two small ones.
    let parts = [96, 32, 32];
    for dtype in [
        DType::F32,
        DType::Q8_0,
        DType::Q4_1,
        DType::Int4G128,
        DType::Fp8Row,
    ] {
        let ws: Vec<Weight> = parts
            .iter()
            .map(|&rows| {
                let values = random(&mut r, rows * k, 0.5);
                if dtype == DType::F32 {
                    // What the device holds of a float weight: bf16.
                    let rounded = values.iter().map(|v| bf16::from_f32(*v).to_f32()).collect();
                    Weight::from_f32(rows, k, rounded).unwrap()
                } else {
                    Weight::from_bytes(dtype, rows, k, quant::quantize_rows(dtype, k, &values))
                        .unwrap()
                }
            })
            .collect();
        let refs: Vec<&Weight> = ws.iter().collect();
        // 1 and 8 take the decode GEMVs on CUDA; 20 the per-part GEMMs.
        for m in [1, 3, 8, 20] {
            let x = random(&mut r, m * k, 1.0);
            let mut outs: Vec<Vec<f32>> = parts.iter().map(|p| vec![f32::NAN; m * p]).collect();
            be.matmul_stacked(&x, m, &refs, &mut outs).unwrap();
            for ((w, out), &rows) in ws.iter().zip(&outs).zip(&parts) {
                let read = activations_read(&be.name(), dtype, m, &x);
                let want = product64(&read, m, &values_of(w), rows);
                let e = rel_err(out, &want);
                // cuBLAS rounds bf16-weight activations to bf16 first.
                let tol = if dtype == DType::F32 && m > kiln_kernels::cuda::BF16_GEMV_ROWS {
                    8e-3
                } else {
                    quantized_tolerance(&be.name(), dtype, parts.iter().sum(), m)
                };
                assert!(
                    e < tol,
                    "{} {dtype:?} m={m} part of {rows}: rel err {e}",
                    be.name()
                );
            }
        }
    }
}
