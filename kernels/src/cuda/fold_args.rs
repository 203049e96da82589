//! What the folded products of quantized weights (int4 tiles,
//! `int4_fold.rs`; FP8 rows, `fp8_fold.rs`) pass their kernels after the
//! weights: the outputs and their parts, K, and the fold's own arguments
//! (`Int4OneFold` in the source, which both kernels take).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchArgs, PushKernelArg};

use super::Gpu;
use super::fold::{NextNorm, Normed, summed};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// Rows of a strip: a gate/up pairing takes whole ones.
const STRIP: usize = 16;

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
    /// Device address of `s` for a kernel argument (the launch is queued
    /// on this same stream, so no guard is needed past it).
    pub(super) fn address(&self, s: &mut CudaSlice<f32>) -> u64 {
        s.device_ptr_mut(&self.stream).0
    }
}
