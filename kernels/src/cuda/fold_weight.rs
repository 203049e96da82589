//! The folded products ([`super::fold`]) for whichever weight the fold
//! takes: bf16 rows (`fold.rs`) or int4 tiles (`int4_fold.rs`), so the
//! model's folded step names one product and not a format.

use cudarc::driver::CudaSlice;
use half::bf16;

use super::fold::{NextNorm, Normed};
use super::int4_fold::Int4Tiles;
use super::{DeviceWeight, Gpu};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// A weight as the fold's products take it.
enum FoldWeight<'a> {
    Bf16(&'a CudaSlice<bf16>),
    Int4(Int4Tiles<'a>),
}

/// `w` as the fold's products take it: bf16, or int4 tiles.
fn fold_weight(w: &DeviceWeight) -> R<FoldWeight<'_>> {
    match w {
        DeviceWeight::Bf16(w) => Ok(FoldWeight::Bf16(w)),
        DeviceWeight::Int4 { group, rows, bytes } => Ok(FoldWeight::Int4(Int4Tiles {
            bytes,
            group: *group,
            rows: *rows,
        })),
        DeviceWeight::Blocks { .. } | DeviceWeight::Fp8 { .. } => Err(KernelError::Shape(
            "a folded product needs bf16 weights or int4 tiles".into(),
        )),
    }
}

impl Gpu {
    /// Whether the folded products take `w` (bf16, or int4 tiles).
    pub fn folds_weight(w: &DeviceWeight) -> bool {
        fold_weight(w).is_ok()
    }

    /// [`Self::gemv_bf16_resid`] for a weight the fold takes
    /// ([`Self::folds_weight`]).
    pub fn gemv_resid(
        &self,
        x: &CudaSlice<f32>,
        w: &DeviceWeight,
        h: &mut CudaSlice<f32>,
        next: NextNorm<'_>,
        n: usize,
        k: usize,
    ) -> R {
        match fold_weight(w)? {
            FoldWeight::Bf16(w) => self.gemv_bf16_resid(x, w, h, next, n, k),
            FoldWeight::Int4(w) => self.gemv_int4_resid(x, w, h, next, n, k),
        }
    }

    /// [`Self::gemv_bf16_normed`] for a weight the fold takes.
    pub fn gemv_normed(
        &self,
        input: &Normed<'_>,
        w: &DeviceWeight,
        outs: &mut [&mut CudaSlice<f32>],
        parts: &[usize],
        k: usize,
    ) -> R {
        match fold_weight(w)? {
            FoldWeight::Bf16(w) => self.gemv_bf16_normed(input, w, outs, parts, k),
            FoldWeight::Int4(w) => self.gemv_int4_normed(input, w, outs, parts, k),
        }
    }

    /// [`Self::gemv_bf16_normed_silu`] for a weight the fold takes.
    pub fn gemv_normed_silu(
        &self,
        input: &Normed<'_>,
        w: &DeviceWeight,
        out: &mut CudaSlice<f32>,
        f: usize,
        k: usize,
    ) -> R {
        match fold_weight(w)? {
            FoldWeight::Bf16(w) => self.gemv_bf16_normed_silu(input, w, out, f, k),
            FoldWeight::Int4(w) => self.gemv_int4_normed_silu(input, w, out, f, k),
        }
    }
}
