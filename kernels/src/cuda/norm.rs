//! RMSNorm with the residual add before it (`norm.cu`), into f32
//! activations or straight into a bf16 GEMM's input.

use cudarc::driver::{CudaSlice, PushKernelArg};
use half::bf16;

use super::cublas::room;
use super::launch::cfg;
use super::{GemmScratch, Gpu, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// An RMSNorm over `rows` rows of `cols`, with the residual add before it:
/// `x += residual` (when given), then `rmsnorm(x) * w` with `eps`.
#[derive(Clone, Copy)]
pub struct NormArgs<'a> {
    /// Added into the rows first, when given (`rows x cols`).
    pub residual: Option<&'a CudaSlice<f32>>,
    /// The norm's weights (`cols`).
    pub w: &'a CudaSlice<f32>,
    /// Rows.
    pub rows: usize,
    /// Elements per row.
    pub cols: usize,
    /// Added to each row's mean square.
    pub eps: f32,
}

/// Where the norm writes: f32 activations, or bf16 ones for a GEMM.
pub(super) enum NormOut<'a> {
    /// f32.
    F32(&'a mut CudaSlice<f32>),
    /// bf16.
    Bf16(&'a mut CudaSlice<bf16>),
}

/// 16-byte pieces a thread of the norms keeps in registers (`NORM_PIECES`
/// in norm.cu).
pub(super) const NORM_PIECES: usize = 4;

/// Rows from which a norm's blocks take [`NORM_PIECES`] pieces a thread.
const NORM_MANY_ROWS: usize = 256;

/// Threads of a norm's block over `rows` rows of `dim` (up to 1024): for a
/// few rows (decode, where one block's latency is the launch's) one per
/// 16-byte piece of a row, so a row is read in a single round; for many
/// (prefill) as few as hold a row in [`NORM_PIECES`] pieces a thread, so
/// that several blocks share an SM and one block's reductions overlap
/// another's loads rather than all blocks meeting at each barrier.
pub(super) fn norm_threads(dim: usize, rows: usize) -> usize {
    let pieces = if rows < NORM_MANY_ROWS {
        1
    } else {
        NORM_PIECES
    };
    dim.div_ceil(4 * pieces)
        .next_multiple_of(32)
        .clamp(32, 1024)
}

impl Gpu {
    /// `x += residual` (if given), then `out = rmsnorm(x) * w`, per row.
    pub fn rmsnorm_residual(
        &self,
        x: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        norm: &NormArgs<'_>,
    ) -> R {
        self.rmsnorm_launch(x, NormOut::F32(out), norm)
    }

    /// The norm's launch, into f32 or into bf16 (the caller checked that
    /// `out` holds `rows x cols`).
    pub(super) fn rmsnorm_launch(
        &self,
        x: &mut CudaSlice<f32>,
        out: NormOut<'_>,
        norm: &NormArgs<'_>,
    ) -> R {
        let NormArgs {
            residual,
            w,
            rows,
            cols: dim,
            eps,
        } = *norm;
        let f = self.function("rmsnorm_residual")?;
        let mut b = self.stream.launch_builder(f);
        let null = 0u64;
        b.arg(x);
        match residual {
            Some(r) => b.arg(r),
            None => b.arg(&null),
        };
        b.arg(w);
        match out {
            NormOut::F32(o) => b.arg(o).arg(&null),
            NormOut::Bf16(o) => b.arg(&null).arg(o),
        };
        let dim_i = dim as i32;
        b.arg(&dim_i).arg(&eps);
        let threads = norm_threads(dim, rows) as u32;
        // SAFETY: the kernel reads and writes `rows x dim` of each buffer.
        unsafe { b.launch(cfg((rows as u32, 1, 1), threads, 0)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// [`Self::rmsnorm_residual`] with its output rounded to bf16 into
    /// `scratch`, ready for [`Self::matmul_parts_bf16`].
    pub fn rmsnorm_residual_bf16(
        &self,
        x: &mut CudaSlice<f32>,
        scratch: &mut GemmScratch,
        norm: &NormArgs<'_>,
    ) -> R {
        room(scratch, norm.rows * norm.cols)?;
        let out = NormOut::Bf16(&mut scratch.act);
        self.rmsnorm_launch(x, out, norm)
    }
}
