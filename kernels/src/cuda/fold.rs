//! One-row decode products with the RMSNorm between them folded in (the
//! kernels of `gemv_norm.cu`). A decode step of one token otherwise runs a
//! one-block norm kernel before each of a layer's two stacks and the head,
//! and a SiLU-and-multiply kernel before the down projection, each a
//! launch whose latency the GEMVs around it wait out. Here the product
//! that adds into the hidden row (o, down) also writes the row times the
//! next norm's weights and its blocks' partial sums of squares
//! ([`NormSum`]); the products after the norm add those up and scale their
//! sums by the norm's factor, and the gate/up product applies
//! SiLU-and-multiply as it writes.

use cudarc::driver::{CudaSlice, PushKernelArg};
use half::bf16;

use super::shape::{OutPtrs, check_parts};
use super::{Gpu, cuda_err, grid_1d};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// Weight rows (warps) per block of the residual GEMV (`RESID_WARPS`):
/// each block writes one partial sum of squares.
const RESID_ROWS: usize = 8;

/// Weight rows (warps) per block of the GEMVs after a norm
/// (`NORMED_WARPS`).
const NORMED_ROWS: usize = 4;

/// What a folded norm carries from the product that writes the hidden row
/// to the products after the norm: each of its blocks' sum of squares.
pub struct NormSum {
    pub(super) partials: CudaSlice<f32>,
    /// How many the last residual product wrote.
    pub(super) parts: usize,
}

/// The norm after a residual product, whose first half
/// [`Gpu::gemv_bf16_resid`] folds in: the norm's weights, and where the
/// product writes the row times them and its partial sums of squares.
pub struct NextNorm<'a> {
    /// The norm's weights (`n`).
    pub g: &'a CudaSlice<f32>,
    /// `g * h` (`n`): the input of the products after the norm.
    pub gh: &'a mut CudaSlice<f32>,
    /// The partial sums of `h^2`.
    pub sum: &'a mut NormSum,
}

impl NextNorm<'_> {
    /// Checks that `h`, the norm's weights and `gh` hold `n` rows and the
    /// sum room for `blocks` partials.
    pub(super) fn check(&self, h: &CudaSlice<f32>, n: usize, blocks: usize) -> R {
        let (g, gh) = (self.g.len(), self.gh.len());
        if h.len() < n || g < n || gh < n || self.sum.partials.len() < blocks {
            return Err(KernelError::Shape(format!(
                "residual GEMV of {n} rows: h, g, gh or the norm's sum too small"
            )));
        }
        Ok(())
    }
}

/// The input of a product after a folded norm, as a residual product left
/// it ([`NextNorm`]), and the norm's epsilon.
#[derive(Clone, Copy)]
pub struct Normed<'a> {
    /// The hidden row times the norm's weights (`k`).
    pub gh: &'a CudaSlice<f32>,
    /// The partial sums of the row's squares.
    pub sum: &'a NormSum,
    /// Added to the row's mean square.
    pub eps: f32,
}

/// The partial sums a residual product left, as a kernel argument
/// (refused before any residual product ran on `sum`).
pub(super) fn summed(sum: &NormSum) -> R<i32> {
    if sum.parts == 0 {
        return Err(KernelError::Shape(
            "a product after a folded norm before any residual product".into(),
        ));
    }
    Ok(sum.parts as i32)
}

/// Checks a one-row GEMV's sizes: `k` a multiple of 8, `x` of `k`, `w` of
/// `n x k`.
fn check(x: &CudaSlice<f32>, w: &CudaSlice<bf16>, n: usize, k: usize) -> R {
    if n == 0 || !k.is_multiple_of(8) || x.len() < k || w.len() < n * k {
        return Err(KernelError::Shape(format!(
            "one-row GEMV of {k} over {n} weight rows: k a multiple of 8, x of k, w of n x k"
        )));
    }
    Ok(())
}

impl Gpu {
    /// A [`NormSum`] for products of up to `rows` output rows.
    pub fn norm_sum(&self, rows: usize) -> R<NormSum> {
        // Whole 16-byte pieces: the products after the norm load them so.
        let blocks = rows.div_ceil(RESID_ROWS).max(1).next_multiple_of(4);
        Ok(NormSum {
            partials: self.stream.alloc_zeros(blocks).map_err(cuda_err)?,
            parts: 0,
        })
    }

    /// The hidden row's sum of squares that `sum` carries, downloaded and
    /// added up (for tests).
    pub fn norm_sum_total(&self, sum: &NormSum) -> R<f32> {
        Ok(self
            .download_range(&sum.partials, 0..sum.parts)?
            .iter()
            .sum())
    }

    /// A [`NormSum`] whose total is `ss`, in as many partial sums as a
    /// residual product of `rows` rows writes (`ss` then zeros), the
    /// padding past them NaN, so a product that reads past its partials
    /// fails (for products after a norm tested on their own).
    pub fn norm_sum_of(&self, ss: f32, rows: usize) -> R<NormSum> {
        let parts = rows.div_ceil(RESID_ROWS).max(1);
        let mut partials = vec![f32::NAN; parts.next_multiple_of(4)];
        partials[..parts].fill(0.0);
        partials[0] = ss;
        Ok(NormSum {
            partials: self.upload(&partials)?,
            parts,
        })
    }

    /// `h += x * w^T` for one row (`w`: bf16, `n x k`), then `gh = g * h`
    /// and the sum of `h^2` into `sum`: the product before a norm with
    /// weights `g`, with the norm's first half folded in.
    pub fn gemv_bf16_resid(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<bf16>,
        h: &mut CudaSlice<f32>,
        next: NextNorm<'_>,
        n: usize,
        k: usize,
    ) -> R {
        check(x, w, n, k)?;
        let grid = n.div_ceil(RESID_ROWS);
        next.check(h, n, grid)?;
        let NextNorm { g, gh, sum } = next;
        let f = self.function("gemv_bf16_resid")?;
        let (ni, ki) = (n as i32, k as i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(x).arg(w).arg(h).arg(g).arg(gh).arg(&mut sum.partials);
        b.arg(&ni).arg(&ki);
        // SAFETY: one warp per weight row, a partial per block; sizes
        // checked above.
        unsafe { b.launch(grid_1d(grid as u32, 32 * RESID_ROWS as u32)) }.map_err(cuda_err)?;
        sum.parts = grid;
        Ok(())
    }

    /// `outs[i] = (rmsnorm(h) * g) * w_i^T` for the parts of the stack `w`
    /// (bf16, `parts[i] x k` each), from the `gh` and `sum` that
    /// [`Self::gemv_bf16_resid`] wrote.
    pub fn gemv_bf16_normed(
        &self,
        input: &Normed<'_>,
        w: &CudaSlice<bf16>,
        outs: &mut [&mut CudaSlice<f32>],
        parts: &[usize],
        k: usize,
    ) -> R {
        let Normed { gh, sum, eps } = *input;
        let n = check_parts(outs, parts, 1)?;
        check(gh, w, n, k)?;
        let f = self.function("gemv_bf16_normed")?;
        let o: OutPtrs = self.out_ptrs(outs, parts);
        let (ki, pi) = (k as i32, summed(sum)?);
        let mut b = self.stream.launch_builder(f);
        b.arg(gh).arg(w).arg(&sum.partials).arg(&pi);
        b.arg(&o.ptrs[0]).arg(&o.ptrs[1]).arg(&o.ptrs[2]);
        b.arg(&o.n0).arg(&o.n1).arg(&o.n).arg(&ki).arg(&eps);
        let grid = n.div_ceil(NORMED_ROWS) as u32;
        // SAFETY: one warp per weight row; sizes checked above.
        unsafe { b.launch(grid_1d(grid, 32 * NORMED_ROWS as u32)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// `out = silu(gate) * up` after the norm, where `w` stacks gate over
    /// up (bf16, `2f x k`) and gate and up are the normed products of
    /// [`Self::gemv_bf16_normed`].
    pub fn gemv_bf16_normed_silu(
        &self,
        input: &Normed<'_>,
        w: &CudaSlice<bf16>,
        out: &mut CudaSlice<f32>,
        f: usize,
        k: usize,
    ) -> R {
        let Normed { gh, sum, eps } = *input;
        check(gh, w, 2 * f, k)?;
        if out.len() < f {
            return Err(KernelError::Shape(format!(
                "SiLU GEMV output of {} for {f}",
                out.len()
            )));
        }
        let func = self.function("gemv_bf16_normed_silu")?;
        let (fi, ki, pi) = (f as i32, k as i32, summed(sum)?);
        let mut b = self.stream.launch_builder(func);
        b.arg(gh).arg(w).arg(&sum.partials).arg(&pi).arg(out);
        b.arg(&fi).arg(&ki).arg(&eps);
        let grid = f.div_ceil(NORMED_ROWS / 2) as u32;
        // SAFETY: a warp per gate row and one per its up row, half a block
        // each; sizes checked.
        unsafe { b.launch(grid_1d(grid, 32 * NORMED_ROWS as u32)) }.map_err(cuda_err)?;
        Ok(())
    }
}
