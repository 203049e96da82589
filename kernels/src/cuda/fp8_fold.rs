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

/// The block sizes built (`gemv_e4m3_fold`, `gemv_e4m3_fold_w16`).
pub const FP8_FOLD_WARPS: [usize; 2] = [8, 16];

/// Warps a block of the folded FP8 product takes on a grid of `blocks`
/// blocks over `sms` SMs. At 110 registers a thread, an SM holds two blocks
/// of eight warps or one of sixteen: the same warps, so the same bytes in
/// flight, but a block of sixteen finishes its strip in half the time.
/// A launch lasts about its waves times a block's time, so sixteen wins
/// where it takes fewer than twice the waves of eight (q/k/v's 384 blocks
/// on 132 SMs: three waves against two of twice the length; o's and
/// down's 256: two against one, a tie, and eight keeps its overlap of one
/// block's start with the other's stream; a grid within one wave of
/// sixteen takes sixteen, as the one-row int4 GEMV does).
fn fold_warps(blocks: usize, sms: usize) -> usize {
    let waves = |per_sm: usize| blocks.div_ceil((sms * per_sm).max(1));
    if waves(1) < 2 * waves(2) { 16 } else { 8 }
}

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

    /// `gemv_e4m3_fold` (or its build of sixteen warps, as
    /// [`fold_warps`] or [`Gpu::set_fp8_fold_warps`] says), with K bytes of
    /// shared memory for x's codes.
    fn launch(&self, gpu: &Gpu, x: &CudaSlice<f32>, args: FoldLaunch, grid: usize) -> R {
        let k = args.k();
        let warps = gpu
            .fp8_fold_warps
            .unwrap_or_else(|| fold_warps(grid, gpu.sms));
        let func = gpu.function(if warps == 16 {
            "gemv_e4m3_fold_w16"
        } else {
            "gemv_e4m3_fold"
        })?;
        let threads = 32 * warps as u32;
        let mut b = gpu.stream.launch_builder(func);
        b.arg(x).arg(self.codes).arg(self.scales);
        args.push(&mut b);
        // SAFETY: a strip of 16 of the n rows a block (or a gate strip and
        // its up strip: f / 16 blocks), x of k, the outputs, norm buffers
        // and partial sums checked by the callers; k bytes of shared
        // memory, under the 48 KiB a launch may take by default.
        unsafe { b.launch(super::launch::cfg((grid as u32, 1, 1), threads, k as u32)) }
            .map_err(cuda_err)?;
        Ok(())
    }
}

impl Gpu {
    /// Warps a block of the folded FP8 product takes (8, as a `Gpu` opens,
    /// or 16), or `None` to choose by the grid's waves (`fold_warps`:
    /// sixteen for q/k/v and gate/up on 132 SMs, not yet measured in a
    /// step, so not the default).
    pub fn set_fp8_fold_warps(&mut self, warps: Option<usize>) -> R {
        if warps.is_some_and(|w| !FP8_FOLD_WARPS.contains(&w)) {
            return Err(KernelError::Shape(format!(
                "folded FP8 blocks of {warps:?} warps: {FP8_FOLD_WARPS:?} are built"
            )));
        }
        self.fp8_fold_warps = warps;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::fold_warps;

    #[test]
    fn sixteen_warps_where_they_take_fewer_than_twice_the_waves_of_eight() {
        // Llama-3-8B on 132 SMs: q/k/v (384 strips), o and down (256),
        // gate/up (896 pairs).
        assert_eq!(fold_warps(384, 132), 16);
        assert_eq!(fold_warps(256, 132), 8);
        assert_eq!(fold_warps(896, 132), 16);
        // Within one wave of sixteen, sixteen; one wave of eight past it,
        // eight.
        assert_eq!(fold_warps(100, 132), 16);
        assert_eq!(fold_warps(132, 132), 16);
        assert_eq!(fold_warps(264, 132), 8);
    }
}
