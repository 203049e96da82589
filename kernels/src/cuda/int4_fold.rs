//! The products of a folded one-token step (fold.rs) on int4 tiles: the
//! one-launch GEMV of `int4_one.cu` with the fold's ending
//! (`gemv_int4_fold_g{G}`, two strips a block). The o and down products
//! add into the hidden row and write the next norm's input and partial
//! sums; q/k/v and the head scale by the norm's factor; gate/up pairs
//! each gate strip with its up strip in one block and writes
//! silu(gate) * up. A layer of int4 weights then runs no norm and no SiLU
//! kernel, as a bf16 one does.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, PushKernelArg};

use super::fold::{NextNorm, Normed, summed};
use super::shape::check_parts;
use super::{Gpu, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// Rows a strip of the tiles holds, and strips a block takes.
const STRIP: usize = 16;
const STRIPS: usize = 2;

/// An int4 matrix of tiles as the fold's kernels take it: the bytes, the
/// group and the rows of the whole stack.
#[derive(Clone, Copy)]
pub(super) struct Int4Tiles<'a> {
    pub(super) bytes: &'a CudaSlice<u8>,
    pub(super) group: usize,
    pub(super) rows: usize,
}

/// The kernel's fold arguments (`Int4OneFold`): the norm's partial sums,
/// their count and epsilon (0 = no norm), the gate/up pairing, and the
/// residual's h, next norm weights, gh and partial sums out (0 = none).
struct FoldArgs {
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
    fn normed(gpu: &Gpu, input: &Normed<'_>) -> R<FoldArgs> {
        Ok(FoldArgs {
            sums: input.sum.partials.device_ptr(&gpu.stream).0,
            parts: summed(input.sum)?,
            eps: input.eps,
            ..FoldArgs::NONE
        })
    }
}

impl Int4Tiles<'_> {
    /// Checks that the tiles hold `n` rows of `k` and `x` holds `k`.
    fn check(&self, x: &CudaSlice<f32>, n: usize, k: usize) -> R {
        let whole = n.is_multiple_of(STRIP) && k.is_multiple_of(self.group);
        let bytes = super::int4_device_bytes(n, k, self.group);
        if self.rows != n || !whole || x.len() < k || self.bytes.len() < bytes {
            return Err(KernelError::Shape(format!(
                "folded int4 product of {k} over {n} rows: the tiles hold {} rows, x {}; \
                 rows in strips of {STRIP} and k in groups of {}",
                self.rows,
                x.len(),
                self.group
            )));
        }
        Ok(())
    }
}

impl Gpu {
    /// Device address of `s` for a kernel argument (the launch is queued
    /// on this same stream, so no guard is needed past it).
    fn address(&self, s: &mut CudaSlice<f32>) -> u64 {
        s.device_ptr_mut(&self.stream).0
    }

    /// `h += x * w^T` for one row (`w`: int4 tiles, `n x k`), then `gh = g
    /// * h` and its blocks' sums of `h^2` into `sum`:
    /// [`Self::gemv_bf16_resid`] on int4 tiles.
    pub(super) fn gemv_int4_resid(
        &self,
        x: &CudaSlice<f32>,
        w: Int4Tiles<'_>,
        h: &mut CudaSlice<f32>,
        next: NextNorm<'_>,
        n: usize,
        k: usize,
    ) -> R {
        w.check(x, n, k)?;
        let grid = n.div_ceil(STRIP * STRIPS);
        next.check(h, n, grid)?;
        let NextNorm { g, gh, sum } = next;
        let fold = FoldArgs {
            h: self.address(h),
            gn: g.device_ptr(&self.stream).0,
            gh: self.address(gh),
            psum: self.address(&mut sum.partials),
            ..FoldArgs::NONE
        };
        self.launch_int4_fold(x, w, [0; 3], &[n], k, fold, grid)?;
        sum.parts = grid;
        Ok(())
    }

    /// `outs[i] = (rmsnorm(h) * g) * w_i^T` for the parts of the int4
    /// stack `w`, from the `gh` and `sum` a residual product wrote:
    /// [`Self::gemv_bf16_normed`] on int4 tiles.
    pub(super) fn gemv_int4_normed(
        &self,
        input: &Normed<'_>,
        w: Int4Tiles<'_>,
        outs: &mut [&mut CudaSlice<f32>],
        parts: &[usize],
        k: usize,
    ) -> R {
        let n = check_parts(outs, parts, 1)?;
        w.check(input.gh, n, k)?;
        let fold = FoldArgs::normed(self, input)?;
        let o = self.out_ptrs(outs, parts);
        let grid = n.div_ceil(STRIP * STRIPS);
        self.launch_int4_fold(input.gh, w, o.ptrs, parts, k, fold, grid)
    }

    /// `out = silu(gate) * up` after the norm, where the int4 stack `w`
    /// holds gate over up (`2f x k`): [`Self::gemv_bf16_normed_silu`] on
    /// int4 tiles. A block takes a gate strip and its up strip.
    pub(super) fn gemv_int4_normed_silu(
        &self,
        input: &Normed<'_>,
        w: Int4Tiles<'_>,
        out: &mut CudaSlice<f32>,
        f: usize,
        k: usize,
    ) -> R {
        w.check(input.gh, 2 * f, k)?;
        if out.len() < f || !f.is_multiple_of(STRIP) {
            return Err(KernelError::Shape(format!(
                "SiLU int4 GEMV output of {} for {f} (a multiple of {STRIP})",
                out.len()
            )));
        }
        let fold = FoldArgs {
            pair: 1,
            ..FoldArgs::normed(self, input)?
        };
        let o = [self.address(out), 0, 0];
        self.launch_int4_fold(input.gh, w, o, &[2 * f], k, fold, f / STRIP)
    }

    /// Launches `gemv_int4_fold_g{G}` on `grid` blocks (sizes checked by
    /// the caller).
    #[allow(clippy::too_many_arguments)]
    fn launch_int4_fold(
        &self,
        x: &CudaSlice<f32>,
        w: Int4Tiles<'_>,
        outs: [u64; 3],
        parts: &[usize],
        k: usize,
        f: FoldArgs,
        grid: usize,
    ) -> R {
        let warps = self.int4_one_block_warps(grid, STRIPS, k / w.group);
        let func = self.function(&format!("gemv_int4_fold_g{}_w{warps}", w.group))?;
        let n0 = parts[0] as i32;
        let n1 = parts.get(1).copied().unwrap_or(0) as i32;
        let (n, ki) = (parts.iter().sum::<usize>() as i32, k as i32);
        let mut b = self.stream.launch_builder(func);
        b.arg(x).arg(w.bytes);
        b.arg(&outs[0]).arg(&outs[1]).arg(&outs[2]);
        b.arg(&n0).arg(&n1).arg(&n).arg(&ki);
        b.arg(&f.sums).arg(&f.parts).arg(&f.eps).arg(&f.pair);
        b.arg(&f.h).arg(&f.gn).arg(&f.gh).arg(&f.psum);
        // SAFETY: two strips of 16 of the n rows a block (or a gate strip
        // and its up strip: f / 16 blocks), x of k, the outputs, norm
        // buffers and partial sums checked by the callers.
        unsafe {
            b.launch(super::launch::cfg(
                (grid as u32, 1, 1),
                32 * warps as u32,
                0,
            ))
        }
        .map_err(cuda_err)?;
        Ok(())
    }
}
