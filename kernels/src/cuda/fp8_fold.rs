//! The products of a folded one-token step (fold.rs) on FP8 rows: W8A8
//! on FP8 tensor cores as `gemm_e4m3` runs one row, each block quantizing
//! the activation row itself (`gemv_e4m3_fold`, fp8_fold.cu). The o and
//! down products add into the hidden row and write the next norm's input
//! and partial sums; q/k/v and the head scale by the norm's factor;
//! gate/up pairs each gate strip with its up strip in one block and writes
//! silu(gate) * up. A layer of FP8 rows then runs no norm, no SiLU and no
//! quantizer kernel, as a bf16 one does.

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::fold::{NextNorm, Normed};
use super::fold_args::{FoldArgs, FoldLaunch};
use super::shape::check_parts;
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

impl Fp8Rows<'_> {
    /// Checks that the rows hold `n` of `k` codes and `x` holds `k`, in
    /// whole strips of rows and 64-wide pieces of `k`.
    fn check(&self, x: &CudaSlice<f32>, n: usize, k: usize) -> R {
        let whole = n.is_multiple_of(STRIP) && k.is_multiple_of(64) && k > 0;
        if !whole || self.scales.len() < n || self.codes.len() < n * k || x.len() < k {
            return Err(KernelError::Shape(format!(
                "folded FP8 product of {k} over {n} rows: the rows hold {} codes and {} \
                 scales, x {}; rows in strips of {STRIP} and k in pieces of 64",
                self.codes.len(),
                self.scales.len(),
                x.len()
            )));
        }
        Ok(())
    }
}

impl Gpu {
    /// `h += x * w^T` for one row (`w`: FP8 rows, `n x k`), then `gh = g *
    /// h` and its blocks' sums of `h^2` into `sum`:
    /// [`Self::gemv_bf16_resid`] on FP8 rows.
    pub(super) fn gemv_fp8_resid(
        &self,
        x: &CudaSlice<f32>,
        w: Fp8Rows<'_>,
        h: &mut CudaSlice<f32>,
        mut next: NextNorm<'_>,
        n: usize,
        k: usize,
    ) -> R {
        w.check(x, n, k)?;
        let grid = n / STRIP;
        next.check(h, n, grid)?;
        let fold = FoldArgs::residual(self, h, &mut next);
        self.launch_fp8_fold(x, w, FoldLaunch::new([0; 3], &[n], k, fold), grid)?;
        next.sum.parts = grid;
        Ok(())
    }

    /// `outs[i] = (rmsnorm(h) * g) * w_i^T` for the parts of the FP8
    /// stack `w`, from the `gh` and `sum` a residual product wrote:
    /// [`Self::gemv_bf16_normed`] on FP8 rows.
    pub(super) fn gemv_fp8_normed(
        &self,
        input: &Normed<'_>,
        w: Fp8Rows<'_>,
        outs: &mut [&mut CudaSlice<f32>],
        parts: &[usize],
        k: usize,
    ) -> R {
        let n = check_parts(outs, parts, 1)?;
        w.check(input.gh, n, k)?;
        let fold = FoldArgs::normed(self, input)?;
        let o = self.out_ptrs(outs, parts);
        self.launch_fp8_fold(
            input.gh,
            w,
            FoldLaunch::new(o.ptrs, parts, k, fold),
            n / STRIP,
        )
    }

    /// `out = silu(gate) * up` after the norm, where the FP8 stack `w`
    /// holds gate over up (`2f x k`): [`Self::gemv_bf16_normed_silu`] on
    /// FP8 rows. A block takes a gate strip and its up strip.
    pub(super) fn gemv_fp8_normed_silu(
        &self,
        input: &Normed<'_>,
        w: Fp8Rows<'_>,
        out: &mut CudaSlice<f32>,
        f: usize,
        k: usize,
    ) -> R {
        w.check(input.gh, 2 * f, k)?;
        let (fold, o) = FoldArgs::paired(self, input, out, f, "FP8")?;
        self.launch_fp8_fold(
            input.gh,
            w,
            FoldLaunch::new(o, &[2 * f], k, fold),
            f / STRIP,
        )
    }

    /// Launches `gemv_e4m3_fold` on `grid` blocks (sizes checked by the
    /// caller), with K bytes of shared memory for x's codes.
    fn launch_fp8_fold(
        &self,
        x: &CudaSlice<f32>,
        w: Fp8Rows<'_>,
        args: FoldLaunch,
        grid: usize,
    ) -> R {
        let k = args.k();
        if k > FP8_FOLD_MAX_K {
            return Err(KernelError::Shape(format!(
                "folded FP8 product of {k} columns: at most {FP8_FOLD_MAX_K} (x's codes in \
                 shared memory)"
            )));
        }
        let func = self.function("gemv_e4m3_fold")?;
        let mut b = self.stream.launch_builder(func);
        b.arg(x).arg(w.codes).arg(w.scales);
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
