//! A norm and the product after it as one call, so the norm can write the
//! product's input in the form its GEMM reads: bf16 rows for cuBLAS, or
//! e4m3 codes with a scale per row for FP8 rows' W8A8 GEMM (no f32 or bf16
//! row between them).

use cudarc::driver::{CudaSlice, PushKernelArg};
use half::bf16;

use super::cublas::no_fp8_scratch;
use super::fp8_gemm::{Fp8Rows, Fp8Scratch};
use super::launch::cfg;
use super::norm::{NORM_PIECES, norm_threads};
use super::shape::StackShape;
use super::{DeviceWeight, GemmScratch, Gpu, NormArgs, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

impl Gpu {
    /// `outs[i] = rmsnorm(h += residual) * norm_w * w_i^T` for a stack
    /// that [takes bf16 input](Self::takes_bf16_input) at the norm's rows:
    /// the norm rounds its rows to bf16 for cuBLAS, or to e4m3 with a
    /// scale per row for FP8 rows.
    pub fn normed_parts(
        &self,
        h: &mut CudaSlice<f32>,
        norm: &NormArgs<'_>,
        w: &DeviceWeight,
        outs: &mut [&mut CudaSlice<f32>],
        parts: &[usize],
        scratch: &mut GemmScratch,
    ) -> R {
        let shape = StackShape {
            m: norm.rows,
            parts,
            k: norm.cols,
        };
        if let Some((w8, fp8)) = self.norm_e4m3(h, norm, w, scratch)? {
            return self.gemm_fp8_quantized(w8, outs, shape, fp8);
        }
        self.rmsnorm_residual_bf16(h, scratch, norm)?;
        self.matmul_parts_bf16(w, outs, shape, scratch)
    }

    /// [`Self::normed_parts`] for one product of `n` rows, written in bf16
    /// (the input of a bf16 kernel next).
    pub fn normed_bf16_out(
        &self,
        h: &mut CudaSlice<f32>,
        norm: &NormArgs<'_>,
        w: &DeviceWeight,
        out: &mut CudaSlice<bf16>,
        n: usize,
        scratch: &mut GemmScratch,
    ) -> R {
        let (m, k) = (norm.rows, norm.cols);
        if let Some((w8, fp8)) = self.norm_e4m3(h, norm, w, scratch)? {
            let shape = StackShape { m, parts: &[n], k };
            return self.gemm_fp8_quantized(w8, &mut [out], shape, fp8);
        }
        self.rmsnorm_residual_bf16(h, scratch, norm)?;
        self.matmul_bf16_out(w, out, super::GemmShape { m, n, k }, scratch)
    }

    /// The norm into `scratch`'s FP8 rows where `w` is FP8 rows the W8A8
    /// GEMM takes at the norm's rows and the norm holds a row in registers,
    /// with those rows and the scratch; `None` (nothing run) otherwise.
    fn norm_e4m3<'w, 's>(
        &self,
        h: &mut CudaSlice<f32>,
        norm: &NormArgs<'_>,
        w: &'w DeviceWeight,
        scratch: &'s mut GemmScratch,
    ) -> R<Option<(Fp8Rows<'w>, &'s mut Fp8Scratch)>> {
        let (rows, dim) = (norm.rows, norm.cols);
        let threads = norm_threads(dim, rows);
        let fits = dim.is_multiple_of(4) && dim <= 4 * NORM_PIECES * threads;
        let Some(w8) = self.fp8_stack(w, rows, dim).filter(|_| fits) else {
            return Ok(None);
        };
        let fp8 = scratch.fp8.as_mut().ok_or_else(no_fp8_scratch)?;
        if h.len() < rows * dim
            || norm.residual.is_some_and(|r| r.len() < rows * dim)
            || norm.w.len() < dim
            || fp8.xq.len() < rows * dim
            || fp8.xs.len() < rows
        {
            return Err(KernelError::Shape(format!(
                "a norm of {rows} rows of {dim} into e4m3: buffers too small"
            )));
        }
        let f = self.function("rmsnorm_residual_e4m3")?;
        let mut b = self.stream.launch_builder(f);
        let null = 0u64;
        b.arg(&mut *h);
        match norm.residual {
            Some(r) => b.arg(r),
            None => b.arg(&null),
        };
        let dim_i = dim as i32;
        b.arg(norm.w)
            .arg(&mut fp8.xq)
            .arg(&mut fp8.xs)
            .arg(&dim_i)
            .arg(&norm.eps);
        // SAFETY: one block per row of `dim` (a multiple of 4, held in the
        // block's registers), sizes checked above.
        unsafe { b.launch(cfg((rows as u32, 1, 1), threads as u32, 0)) }.map_err(cuda_err)?;
        Ok(Some((w8, fp8)))
    }
}
