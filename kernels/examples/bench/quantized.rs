//! Products with FP8-row and int4 weights at Llama-3-8B shapes, warm and
//! with the weights out of L2.

use cudarc::driver::CudaSlice;
use half::bf16;
use kiln_kernels::cuda::{GemmShape, Gpu, StackShape};
use rand::Rng;

use super::{E, rel_diff, time_graph};

/// Products with FP8-row and int4 weights at Llama-3-8B shapes (the GEMVs
/// up to 8 rows, dequantize + cuBLAS above; int4's few-row products also
/// in one launch), each checked against cuBLAS on
/// the same values as bf16 first; bandwidth counts the format's own bytes.
/// `one_row` keeps only products of one row.
pub fn quantized_gemv(
    gpu: &mut Gpu,
    rng: &mut rand::rngs::StdRng,
    copy: f64,
    one_row: bool,
) -> Result<(), E> {
    use kiln_kernels::matmul::Weight;
    use kiln_kernels::quant::{DType, dequantize_row, quantize};
    use rayon::prelude::*;
    let s = gpu.stream().clone();
    // `one-row NxK`: that shape alone.
    let only = std::env::args().nth(2);
    println!(
        "{:>10} {:>14} {:>3} {:>10} {:>16} {:>12}",
        "weights", "n x k", "m", "us", "GB/s", "bf16 us"
    );
    for (nn, k) in [
        (4096usize, 4096usize),
        (6144, 4096),
        (28672, 4096),
        (4096, 14336),
    ] {
        if one_row && only.as_ref().is_some_and(|o| *o != format!("{nn}x{k}")) {
            continue;
        }
        let values: Vec<f32> = (0..nn * k).map(|_| rng.random_range(-0.05..0.05)).collect();
        for dtype in [DType::Fp8Row, DType::Int4G128] {
            let bytes: Vec<u8> = values
                .par_chunks(k)
                .flat_map_iter(|row| quantize(dtype, row))
                .collect();
            let rb = dtype.bytes_for(k);
            let mut deq = vec![0.0f32; nn * k];
            for (r, row) in deq.chunks_exact_mut(k).enumerate() {
                dequantize_row(dtype, &bytes[r * rb..(r + 1) * rb], row);
            }
            let w = Weight::from_bytes(dtype, nn, k, bytes)?;
            let dw = gpu.weight(&w)?;
            let wb = s.clone_htod(&deq.iter().map(|v| bf16::from_f32(*v)).collect::<Vec<_>>())?;
            let mut scratch = gpu.gemm_scratch(1024, k, true)?;
            let rows: &[usize] = if one_row {
                &[1]
            } else {
                &[1, 2, 4, 8, 16, 32, 64, 1024]
            };
            for &m in rows {
                let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let x = s.clone_htod(&x)?;
                let mut out: CudaSlice<f32> = s.alloc_zeros(m * nn)?;
                let mut act: CudaSlice<bf16> = s.alloc_zeros(m * k)?;
                let shape = GemmShape { m, n: nn, k };
                gpu.cublas_bf16(&x, &wb, &mut out, shape, &mut act)?;
                let theirs = s.clone_dtoh(&out)?;
                gpu.matmul(&x, &dw, &mut out, shape, &mut scratch)?;
                let err = rel_diff(&s.clone_dtoh(&out)?, &theirs);
                // W8A8 adds the activations' e4m3 rounding (~3%).
                let w8a8 = dtype == DType::Fp8Row && m > kiln_kernels::cuda::FP8_GEMV_ROWS;
                if err.is_nan() || err >= if w8a8 { 6e-2 } else { 1e-2 } {
                    return Err(format!("{dtype:?} {nn}x{k} m={m} vs cuBLAS: rel err {err}").into());
                }
                let t = time_graph(gpu, 30, || {
                    Ok(gpu.matmul(&x, &dw, &mut out, shape, &mut scratch)?)
                })?;
                let g = dw.size_bytes() as f64 / t / 1e9;
                let tb = if m <= 8 {
                    let stack = StackShape { m, parts: &[nn], k };
                    let tb = time_graph(gpu, 30, || {
                        Ok(gpu.gemv_bf16_parts(&x, &wb, &mut [&mut out], stack)?)
                    })?;
                    format!("{:.1}", tb * 1e6)
                } else {
                    let tb = time_graph(gpu, 30, || {
                        Ok(gpu.cublas_bf16(&x, &wb, &mut out, shape, &mut act)?)
                    })?;
                    format!("{:.1}", tb * 1e6)
                };
                println!(
                    "{:>10} {:>14} {m:>3} {:>10.1} {:>16} {tb:>12}",
                    format!("{dtype:?}"),
                    format!("{nn}x{k}"),
                    t * 1e6,
                    format!("{g:.0} ({:.0}%)", 100.0 * g / copy),
                );
                if m == 1 {
                    cold_gemv(gpu, &w, &wb, &x, &mut out, &mut scratch, (copy, ""))?;
                }
                if (2..=kiln_kernels::cuda::GEMV_MAX_M).contains(&m) && dtype == DType::Int4G128 {
                    few_rows(
                        gpu,
                        (&w, &dw, &wb),
                        &x,
                        &mut out,
                        &mut scratch,
                        (copy, &theirs),
                    )?;
                }
                if dtype == DType::Fp8Row && m <= kiln_kernels::cuda::E4M3_MMA_MAX_M {
                    // The same product through cuBLASLt, which the FP8
                    // tensor-core kernel above replaces at these rows.
                    gpu.set_fp8_mma(false);
                    gpu.matmul(&x, &dw, &mut out, shape, &mut scratch)?;
                    let err = rel_diff(&s.clone_dtoh(&out)?, &theirs);
                    let t2 = time_graph(gpu, 30, || {
                        Ok(gpu.matmul(&x, &dw, &mut out, shape, &mut scratch)?)
                    })?;
                    gpu.set_fp8_mma(true);
                    let g2 = dw.size_bytes() as f64 / t2 / 1e9;
                    println!(
                        "{:>10} {:>14} {m:>3} cuBLASLt: {:.1} us, {g2:.0} GB/s ({:.0}%), rel err vs cuBLAS {err:.1e}",
                        "",
                        format!("{nn}x{k}"),
                        t2 * 1e6,
                        100.0 * g2 / copy
                    );
                }
                if m == 1 && dtype == DType::Fp8Row {
                    folded_fp8(gpu, &dw, &x, &mut out, (nn, k), (copy, &theirs))?;
                }
                if m == 1 && dtype == DType::Int4G128 {
                    // The two-launch path (int4_xfrag, then the GEMV of up to
                    // 8 rows), then each block size of the one-launch GEMV,
                    // beside the one-launch GEMV timed above.
                    for (one, strips, wide, what) in [
                        (false, None, None, "two launches"),
                        (true, Some(1), None, "one launch, 1 strip a block"),
                        (true, Some(2), Some(0), "2 strips, 8 warps a block"),
                        (true, Some(2), Some(usize::MAX), "2 strips, 16 warps"),
                    ] {
                        gpu.set_int4_one(one);
                        gpu.set_int4_one_strips(strips)?;
                        gpu.set_int4_one_wide(wide);
                        gpu.matmul(&x, &dw, &mut out, shape, &mut scratch)?;
                        let err = rel_diff(&s.clone_dtoh(&out)?, &theirs);
                        let t2 = time_graph(gpu, 30, || {
                            Ok(gpu.matmul(&x, &dw, &mut out, shape, &mut scratch)?)
                        })?;
                        println!(
                            "{:>10} {:>14}   1 {what}: {:.1} us (the default above), rel err vs cuBLAS {err:.1e}",
                            "",
                            format!("{nn}x{k}"),
                            t2 * 1e6
                        );
                        cold_gemv(gpu, &w, &wb, &x, &mut out, &mut scratch, (copy, what))?;
                    }
                    gpu.set_int4_one(true);
                    gpu.set_int4_one_strips(None)?;
                    gpu.set_int4_one_wide(None);
                }
            }
        }
    }
    Ok(())
}

/// FP8 rows' one-row product as a folded step runs it (`fp8_fold.cu`: the
/// activation row quantized inside each block, no quantizer launch), with
/// a norm factor of 1 from as many partial sums as the FP8 residual
/// product of a 4096-wide model writes, beside the unfolded product timed
/// before it (`theirs`: cuBLAS on the same values).
fn folded_fp8(
    gpu: &mut Gpu,
    dw: &kiln_kernels::cuda::DeviceWeight,
    x: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    (nn, k): (usize, usize),
    (copy, theirs): (f64, &[f32]),
) -> Result<(), E> {
    let sum = gpu.norm_sum_of(k as f32, 2048)?;
    let input = kiln_kernels::cuda::Normed {
        gh: x,
        sum: &sum,
        eps: 0.0,
    };
    gpu.gemv_normed(&input, dw, &mut [&mut *out], &[nn], k)?;
    let err = rel_diff(&gpu.stream().clone_dtoh(&*out)?, theirs);
    if err.is_nan() || err >= 6e-2 {
        return Err(format!("folded FP8 {nn}x{k} vs cuBLAS: rel err {err}").into());
    }
    let t = time_graph(gpu, 30, || {
        Ok(gpu.gemv_normed(&input, dw, &mut [&mut *out], &[nn], k)?)
    })?;
    let g = dw.size_bytes() as f64 / t / 1e9;
    println!(
        "{:>10} {:>14}   1 folded: {:.1} us, {g:.0} GB/s ({:.0}%), rel err vs cuBLAS {err:.1e}",
        "",
        format!("{nn}x{k}"),
        t * 1e6,
        100.0 * g / copy
    );
    Ok(())
}

/// Int4 products of 2 to 8 rows in one launch (`int4_rows.cu`), blocks of
/// eight warps, of sixteen and as the shape chooses, warm and cold, beside
/// the two-launch path timed before (`theirs`: cuBLAS on the same values).
fn few_rows(
    gpu: &mut Gpu,
    (w, dw, wb): (
        &kiln_kernels::matmul::Weight,
        &kiln_kernels::cuda::DeviceWeight,
        &CudaSlice<bf16>,
    ),
    x: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    scratch: &mut kiln_kernels::cuda::GemmScratch,
    (copy, theirs): (f64, &[f32]),
) -> Result<(), E> {
    let (nn, k) = (w.rows(), w.cols());
    let m = x.len() / k;
    let shape = GemmShape { m, n: nn, k };
    gpu.set_int4_rows(true);
    for (wide, what) in [
        (Some(0), "one launch, 8 warps"),
        (Some(usize::MAX), "one launch, 16 warps"),
        (None, "one launch, the default block"),
    ] {
        gpu.set_int4_one_wide(wide);
        gpu.matmul(x, dw, out, shape, scratch)?;
        let err = rel_diff(&gpu.stream().clone_dtoh(out)?, theirs);
        if err.is_nan() || err >= 1e-2 {
            return Err(format!("int4 {nn}x{k} m={m} {what} vs cuBLAS: rel err {err}").into());
        }
        let t = time_graph(gpu, 30, || Ok(gpu.matmul(x, dw, out, shape, scratch)?))?;
        let g = dw.size_bytes() as f64 / t / 1e9;
        println!(
            "{:>10} {:>14} {m:>3} {what}: {:.1} us, {g:.0} GB/s ({:.0}%), rel err vs cuBLAS {err:.1e}",
            "",
            format!("{nn}x{k}"),
            t * 1e6,
            100.0 * g / copy
        );
    }
    cold_gemv(gpu, w, wb, x, out, scratch, (copy, "one launch"))?;
    gpu.set_int4_one_wide(None);
    gpu.set_int4_rows(false);
    cold_gemv(gpu, w, wb, x, out, scratch, (copy, "two launches"))?;
    gpu.set_int4_rows(true);
    Ok(())
}

/// Products of x's rows (`what` says by which path) with the weight out of
/// L2 (~50 MB on the H200): each launch of the timing graph reads the next
/// of enough copies of `w` (and of its bf16 `wb`) to pass 96 MB, as a
/// decode step's layers do.
fn cold_gemv(
    gpu: &Gpu,
    w: &kiln_kernels::matmul::Weight,
    wb: &CudaSlice<bf16>,
    x: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    scratch: &mut kiln_kernels::cuda::GemmScratch,
    (copy, what): (f64, &str),
) -> Result<(), E> {
    let s = gpu.stream().clone();
    let (nn, k) = (w.rows(), w.cols());
    let m = x.len() / k;
    let copies = |bytes: usize| (96usize << 20).div_ceil(bytes).max(2);
    let first = gpu.weight(w)?;
    let n = copies(first.size_bytes());
    let mut dws = vec![first];
    for _ in 1..n {
        dws.push(gpu.weight(w)?);
    }
    let nb = copies(wb.len() * 2);
    let wbs = (0..nb)
        .map(|_| s.clone_dtod(wb))
        .collect::<Result<Vec<_>, _>>()?;
    let (shape, stack) = (GemmShape { m, n: nn, k }, StackShape { m, parts: &[nn], k });
    let mut i = 0;
    let t = time_graph(gpu, 30, || {
        i += 1;
        Ok(gpu.matmul(x, &dws[i % n], out, shape, scratch)?)
    })?;
    let mut j = 0;
    let tb = time_graph(gpu, 30, || {
        j += 1;
        Ok(gpu.gemv_bf16_parts(x, &wbs[j % nb], &mut [&mut *out], stack)?)
    })?;
    let g = dws[0].size_bytes() as f64 / t / 1e9;
    let gb = (wb.len() * 2) as f64 / tb / 1e9;
    println!(
        "{:>10} {:>14} {m:>3} cold{}{what}: {:.1} us, {g:.0} GB/s ({:.0}%); bf16 {:.1} us, {gb:.0} GB/s ({:.0}%) ({n} and {nb} copies)",
        "",
        format!("{nn}x{k}"),
        if what.is_empty() { "" } else { ", " },
        t * 1e6,
        100.0 * g / copy,
        tb * 1e6,
        100.0 * gb / copy,
    );
    Ok(())
}
