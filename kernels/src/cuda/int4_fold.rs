//! The products of a folded one-token step (fold.rs) on int4 tiles: the
//! one-launch GEMV of `int4_one.cu` with the fold's ending
//! (`gemv_int4_fold_g{G}`, two strips a block). The o and down products
//! add into the hidden row and write the next norm's input and partial
//! sums; q/k/v and the head scale by the norm's factor; gate/up pairs
//! each gate strip with its up strip in one block and writes
//! silu(gate) * up. A layer of int4 weights then runs no norm and no SiLU
//! kernel, as a bf16 one does.

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::fold::{NextNorm, Normed};
use super::fold_args::{FoldArgs, FoldLaunch};
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
    /// `h += x * w^T` for one row (`w`: int4 tiles, `n x k`), then `gh = g
    /// * h` and its blocks' sums of `h^2` into `sum`:
    /// [`Self::gemv_bf16_resid`] on int4 tiles.
    pub(super) fn gemv_int4_resid(
        &self,
        x: &CudaSlice<f32>,
        w: Int4Tiles<'_>,
        h: &mut CudaSlice<f32>,
        mut next: NextNorm<'_>,
        n: usize,
        k: usize,
    ) -> R {
        w.check(x, n, k)?;
        let grid = n.div_ceil(STRIP * STRIPS);
        next.check(h, n, grid)?;
        let fold = FoldArgs::residual(self, h, &mut next);
        self.launch_int4_fold(x, w, FoldLaunch::new([0; 3], &[n], k, fold), grid)?;
        next.sum.parts = grid;
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
        self.launch_int4_fold(input.gh, w, FoldLaunch::new(o.ptrs, parts, k, fold), grid)
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
        let (fold, o) = FoldArgs::paired(self, input, out, f, "int4")?;
        self.launch_int4_fold(
            input.gh,
            w,
            FoldLaunch::new(o, &[2 * f], k, fold),
            f / STRIP,
        )
    }

    /// Launches `gemv_int4_fold_g{G}` on `grid` blocks (sizes checked by
    /// the caller).
    fn launch_int4_fold(
        &self,
        x: &CudaSlice<f32>,
        w: Int4Tiles<'_>,
        args: FoldLaunch,
        grid: usize,
    ) -> R {
        let k = args.k();
        let warps = self.int4_one_block_warps(grid, STRIPS, k / w.group);
        let func = self.function(&format!("gemv_int4_fold_g{}_w{warps}", w.group))?;
        let mut b = self.stream.launch_builder(func);
        b.arg(x).arg(w.bytes);
        args.push(&mut b);
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
