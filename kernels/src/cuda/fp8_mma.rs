//! W8A8 products of up to [`E4M3_MMA_MAX_M`] activation rows on FP8 tensor
//! cores (`fp8_mma.cu`): the decode batches' products with FP8 rows. The
//! activations arrive as e4m3 codes with a scale per row (the norm, SiLU or
//! [`Gpu::quantize_rows_e4m3`] wrote them), the weights are the FP8 rows'
//! codes as packed at upload (their scales apart), and the e4m3 codes of both go into the MMAs unconverted, so the product
//! streams its weights like the bf16 GEMV streams twice the bytes. Larger
//! batches take cuBLASLt ([`Gpu::gemm_fp8_rows`]).

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::fp8_gemm::{Fp8Out, Fp8Rows, Fp8Scratch};
use super::launch::cfg;
use super::shape::StackShape;
use super::{Gpu, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// Most activation rows the FP8 tensor-core kernel takes (one or two blocks
/// of 8); cuBLASLt above, where the kernel's loads of activations (a
/// fragment of each row for every weight piece) made it slower than
/// cuBLASLt on three Llama-3-8B shapes of four at 32 rows, all at 64.
pub const E4M3_MMA_MAX_M: usize = 16;

/// Weight rows a block of the kernel takes (one MMA's rows).
const STRIP: usize = 16;

/// Threads a block: `E4_WARPS` in `fp8_mma.cu`.
const THREADS: u32 = 256;

impl Gpu {
    /// Whether the product of `m` rows of `k` with `w` takes the FP8
    /// tensor-core kernel: on (see [`Self::set_fp8_mma`]), few enough rows,
    /// rows of whole 32-wide pieces and at most three parts.
    pub(super) fn fp8_mma_takes(&self, shape: &StackShape<'_>) -> bool {
        self.fp8_mma
            && self.fp8_tensor
            && shape.m <= E4M3_MMA_MAX_M
            && shape.k.is_multiple_of(32)
            && shape.parts.len() <= 3
    }

    /// `outs[p] = (xq * xs) (w_p * ws_p)^T` for the parts of a stack, on
    /// the e4m3 activations in `scratch`, in one launch; the caller checked
    /// [`Self::fp8_mma_takes`].
    pub(super) fn gemm_fp8_mma<T: Fp8Out>(
        &self,
        w: Fp8Rows<'_>,
        outs: &mut [&mut CudaSlice<T>],
        shape: StackShape<'_>,
        scratch: &Fp8Scratch,
    ) -> R {
        let StackShape { m, parts, k } = shape;
        let n = super::shape::check_parts(outs, parts, m)?;
        let scales = w.scales;
        if m == 0 || m > E4M3_MMA_MAX_M || !k.is_multiple_of(32) || parts.len() > 3 {
            return Err(KernelError::Shape(format!(
                "the FP8 MMA kernel takes 1-{E4M3_MMA_MAX_M} rows of a multiple of 32 into at \
                 most 3 parts, not {m} x {k} into {}",
                parts.len()
            )));
        }
        if w.codes.len() < n * k
            || scales.len() < n
            || scratch.xq.len() < m * k
            || scratch.xs.len() < m
        {
            return Err(KernelError::Shape(format!(
                "an FP8 product of {m} x {k} by {n} rows: buffers too small"
            )));
        }
        let nb = m.div_ceil(8).next_power_of_two();
        let name = format!("gemm_e4m3_nb{nb}_{}", T::SUFFIX);
        let o = self.out_ptrs(outs, parts);
        let (mi, ki) = (m as i32, k as i32);
        let mut b = self.stream.launch_builder(self.function(&name)?);
        b.arg(w.codes).arg(scales).arg(&scratch.xq).arg(&scratch.xs);
        b.arg(&o.ptrs[0]).arg(&o.ptrs[1]).arg(&o.ptrs[2]);
        b.arg(&o.n0).arg(&o.n1).arg(&o.n).arg(&mi).arg(&ki);
        let grid = n.div_ceil(STRIP) as u32;
        // SAFETY: one block per strip of 16 of the n rows (reads of rows
        // past n clamp to the last, writes skip them); weights, scales and
        // activations checked above, outputs by `check_parts`.
        unsafe { b.launch(cfg((grid, 1, 1), THREADS, 0)) }.map_err(cuda_err)?;
        Ok(())
    }
}
