//! The folded products (fold_args.rs) on FP8 rows: W8A8 on FP8 tensor
//! cores as `gemm_e4m3` runs one row, each block quantizing the activation
//! row itself (`gemv_e4m3_fold`, fp8_fold.cu), so a layer of FP8 rows runs
//! no norm, no SiLU and no quantizer kernel, as a bf16 one does.

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::fold_args::{FoldKernel, FoldLaunch};
use super::{Gpu, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// Rows a block takes (one strip; with the gate/up pairing, a gate strip
/// and its up strip).
const STRIP: usize = 16;

/// Threads of a block (`E4_WARPS` warps).
const THREADS: u32 = 256;

/// Most columns a folded FP8 product takes: x's codes in shared memory,
/// beside two blocks an SM.
pub const FP8_FOLD_MAX_K: usize = 32 << 10;

/// FP8 rows as the fold's kernel takes them: the e4m3 codes (`rows x k`,
/// packed) and a scale a row.
#[derive(Clone, Copy)]
pub(super) struct Fp8Rows<'a> {
    pub(super) codes: &'a CudaSlice<u8>,
    pub(super) scales: &'a CudaSlice<f32>,
}

impl FoldKernel for Fp8Rows<'_> {
    const NAME: &'static str = "FP8";

    /// The rows hold `n` of `k` codes and `x` holds `k`, in whole strips
    /// of rows and 64-wide pieces of `k`, at most [`FP8_FOLD_MAX_K`] (x's
    /// codes in shared memory).
    fn check(&self, x: &CudaSlice<f32>, n: usize, k: usize) -> R {
        let whole = n.is_multiple_of(STRIP) && k.is_multiple_of(64) && k > 0;
        let fits = whole && k <= FP8_FOLD_MAX_K;
        if !fits || self.scales.len() < n || self.codes.len() < n * k || x.len() < k {
            return Err(KernelError::Shape(format!(
                "folded FP8 product of {k} over {n} rows: the rows hold {} codes and {} \
                 scales, x {}; rows in strips of {STRIP} and k in pieces of 64, at most \
                 {FP8_FOLD_MAX_K}",
                self.codes.len(),
                self.scales.len(),
                x.len()
            )));
        }
        Ok(())
    }

    fn grid(n: usize) -> usize {
        n / STRIP
    }

    /// `gemv_e4m3_fold`, with K bytes of shared memory for x's codes.
    fn launch(&self, gpu: &Gpu, x: &CudaSlice<f32>, args: FoldLaunch, grid: usize) -> R {
        let k = args.k();
        let func = gpu.function("gemv_e4m3_fold")?;
        let mut b = gpu.stream.launch_builder(func);
        b.arg(x).arg(self.codes).arg(self.scales);
        args.push(&mut b);
        // SAFETY: a strip of 16 of the n rows a block (or a gate strip and
        // its up strip: f / 16 blocks), x of k, the outputs, norm buffers
        // and partial sums checked by the callers; k bytes of shared
        // memory, under the 48 KiB a launch may take by default.
        unsafe { b.launch(super::launch::cfg((grid as u32, 1, 1), THREADS, k as u32)) }
            .map_err(cuda_err)?;
        Ok(())
    }
}
