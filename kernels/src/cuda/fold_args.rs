//! The folded products of quantized weights (int4 tiles, `int4_fold.rs`;
//! FP8 rows, `fp8_fold.rs`), each one kernel ([`FoldKernel`]): the o and
//! down products add into the hidden row and write the next norm's input
//! and partial sums; q/k/v and the head scale by the norm's factor;
//! gate/up pairs each gate strip with its up strip in one block and writes
//! silu(gate) * up. What they pass their kernels after the weights is the
//! same: the outputs and their parts, K, and the fold's own arguments
//! (`Int4OneFold` in the source, which both kernels take).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchArgs, PushKernelArg};

use super::Gpu;
use super::fold::{NextNorm, Normed, summed};
use super::shape::check_parts;
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// Rows of a strip: a gate/up pairing takes whole ones.
const STRIP: usize = 16;

/// Quantized weights whose folded products one kernel runs.
pub(super) trait FoldKernel {
    /// What the weights are called in errors.
    const NAME: &'static str;

    /// Checks that the weights hold `n` rows of `k` and `x` holds `k`, in
    /// the kernel's strips.
    fn check(&self, x: &CudaSlice<f32>, n: usize, k: usize) -> R;

    /// Blocks for `n` rows (the gate/up pairing takes `f / 16`).
    fn grid(n: usize) -> usize;

    /// Launches the kernel on `grid` blocks (sizes checked by the caller).
    fn launch(&self, gpu: &Gpu, x: &CudaSlice<f32>, args: FoldLaunch, grid: usize) -> R;
}

/// The fold's arguments: the norm's partial sums, their count and epsilon
/// (0 = no norm), the gate/up pairing, and the residual's h, next norm
/// weights, gh and partial sums out (0 = none).
pub(super) struct FoldArgs {
    sums: u64,
    parts: i32,
    eps: f32,
    pair: i32,
    h: u64,
    gn: u64,
    gh: u64,
    psum: u64,
}

impl FoldArgs {
    const NONE: FoldArgs = FoldArgs {
        sums: 0,
        parts: 0,
        eps: 0.0,
        pair: 0,
        h: 0,
        gn: 0,
        gh: 0,
        psum: 0,
    };

    /// A product after the norm that `input` carries.
    pub(super) fn normed(gpu: &Gpu, input: &Normed<'_>) -> R<FoldArgs> {
        Ok(FoldArgs {
            sums: input.sum.partials.device_ptr(&gpu.stream).0,
            parts: summed(input.sum)?,
            eps: input.eps,
            ..FoldArgs::NONE
        })
    }

    /// The gate/up product after the norm that `input` carries, writing
    /// silu(gate) * up into `out` (`f` rows, whole strips); its output
    /// pointers too. `what` names the weights in an error.
    pub(super) fn paired(
        gpu: &Gpu,
        input: &Normed<'_>,
        out: &mut CudaSlice<f32>,
        f: usize,
        what: &str,
    ) -> R<(FoldArgs, [u64; 3])> {
        if out.len() < f || !f.is_multiple_of(STRIP) {
            return Err(KernelError::Shape(format!(
                "SiLU {what} GEMV output of {} for {f} (a multiple of {STRIP})",
                out.len()
            )));
        }
        let fold = FoldArgs {
            pair: 1,
            ..FoldArgs::normed(gpu, input)?
        };
        Ok((fold, [gpu.address(out), 0, 0]))
    }

    /// The product that adds into `h` before the norm `next` (checked by
    /// the caller), whose partial sums it writes.
    pub(super) fn residual(gpu: &Gpu, h: &mut CudaSlice<f32>, next: &mut NextNorm<'_>) -> FoldArgs {
        FoldArgs {
            h: gpu.address(h),
            gn: next.g.device_ptr(&gpu.stream).0,
            gh: gpu.address(&mut *next.gh),
            psum: gpu.address(&mut next.sum.partials),
            ..FoldArgs::NONE
        }
    }
}

/// A folded product's kernel arguments after its weights, as both kernels
/// take them: three output pointers, the first two parts' rows and the
/// stack's, K, then the fold's.
pub(super) struct FoldLaunch {
    outs: [u64; 3],
    sizes: [i32; 4],
    fold: FoldArgs,
}

impl FoldLaunch {
    /// The arguments for outputs `outs` of `parts` rows over `k` columns.
    pub(super) fn new(outs: [u64; 3], parts: &[usize], k: usize, fold: FoldArgs) -> FoldLaunch {
        let n0 = parts[0] as i32;
        let n1 = parts.get(1).copied().unwrap_or(0) as i32;
        let n = parts.iter().sum::<usize>() as i32;
        FoldLaunch {
            outs,
            sizes: [n0, n1, n, k as i32],
            fold,
        }
    }

    /// K, the columns of the product.
    pub(super) fn k(&self) -> usize {
        self.sizes[3] as usize
    }

    /// Pushes them onto `b`, after the weights.
    pub(super) fn push<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        let f = &self.fold;
        for o in &self.outs {
            b.arg(o);
        }
        for s in &self.sizes {
            b.arg(s);
        }
        b.arg(&f.sums).arg(&f.parts).arg(&f.eps).arg(&f.pair);
        b.arg(&f.h).arg(&f.gn).arg(&f.gh).arg(&f.psum);
    }
}

impl Gpu {
    /// `h += x * w^T` for one row (`w`: `n x k`), then `gh = g * h` and its
    /// blocks' sums of `h^2` into `sum`: [`Self::gemv_bf16_resid`] on
    /// quantized weights.
    pub(super) fn gemv_folded_resid<W: FoldKernel>(
        &self,
        x: &CudaSlice<f32>,
        w: W,
        h: &mut CudaSlice<f32>,
        mut next: NextNorm<'_>,
        n: usize,
        k: usize,
    ) -> R {
        w.check(x, n, k)?;
        let grid = W::grid(n);
        next.check(h, n, grid)?;
        let fold = FoldArgs::residual(self, h, &mut next);
        w.launch(self, x, FoldLaunch::new([0; 3], &[n], k, fold), grid)?;
        next.sum.parts = grid;
        Ok(())
    }

    /// `outs[i] = (rmsnorm(h) * g) * w_i^T` for the parts of the stack `w`,
    /// from the `gh` and `sum` a residual product wrote:
    /// [`Self::gemv_bf16_normed`] on quantized weights.
    pub(super) fn gemv_folded_normed<W: FoldKernel>(
        &self,
        input: &Normed<'_>,
        w: W,
        outs: &mut [&mut CudaSlice<f32>],
        parts: &[usize],
        k: usize,
    ) -> R {
        let n = check_parts(outs, parts, 1)?;
        w.check(input.gh, n, k)?;
        let fold = FoldArgs::normed(self, input)?;
        let o = self.out_ptrs(outs, parts);
        let args = FoldLaunch::new(o.ptrs, parts, k, fold);
        w.launch(self, input.gh, args, W::grid(n))
    }

    /// `out = silu(gate) * up` after the norm, where the stack `w` holds
    /// gate over up (`2f x k`): [`Self::gemv_bf16_normed_silu`] on
    /// quantized weights. A block takes a gate strip and its up strip.
    pub(super) fn gemv_folded_silu<W: FoldKernel>(
        &self,
        input: &Normed<'_>,
        w: W,
        out: &mut CudaSlice<f32>,
        f: usize,
        k: usize,
    ) -> R {
        w.check(input.gh, 2 * f, k)?;
        let (fold, o) = FoldArgs::paired(self, input, out, f, W::NAME)?;
        w.launch(
            self,
            input.gh,
            FoldLaunch::new(o, &[2 * f], k, fold),
            f / STRIP,
        )
    }

    /// Device address of `s` for a kernel argument (the launch is queued
    /// on this same stream, so no guard is needed past it).
    pub(super) fn address(&self, s: &mut CudaSlice<f32>) -> u64 {
        s.device_ptr_mut(&self.stream).0
    }
}
