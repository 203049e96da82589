//! The folded products ([`super::fold`]) for whichever weight the fold
//! takes: bf16 rows (`fold.rs`), int4 tiles (`int4_fold.rs`) or FP8 rows
//! (`fp8_fold.rs`), so the model's folded step names one product and not
//! a format.

use cudarc::driver::CudaSlice;
use half::bf16;

use super::fold::{NextNorm, Normed};
use super::fp8_fold::Fp8Rows;
use super::int4_fold::Int4Tiles;
use super::{DeviceWeight, Gpu};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// A weight as the fold's products take it.
enum FoldWeight<'a> {
    Bf16(&'a CudaSlice<bf16>),
    Int4(Int4Tiles<'a>),
    Fp8(Fp8Rows<'a>),
}

/// `w` as the fold's products take it: bf16, int4 tiles, or FP8 rows as
/// FP8 tensor cores read them.
fn fold_weight(w: &DeviceWeight) -> R<FoldWeight<'_>> {
    match w {
        DeviceWeight::Bf16(w) => Ok(FoldWeight::Bf16(w)),
        DeviceWeight::Int4 { group, rows, bytes } => Ok(FoldWeight::Int4(Int4Tiles {
            bytes,
            group: *group,
            rows: *rows,
        })),
        DeviceWeight::Fp8 { codes, scales } => Ok(FoldWeight::Fp8(Fp8Rows { codes, scales })),
        DeviceWeight::Blocks { .. } => Err(KernelError::Shape(
            "a folded product needs bf16 weights, int4 tiles or packed FP8 rows".into(),
        )),
    }
}

impl Gpu {
    /// Whether the folded products take `w` (bf16, int4 tiles, or FP8
    /// rows packed for FP8 tensor cores).
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
            FoldWeight::Int4(w) => self.gemv_folded_resid(x, w, h, next, n, k),
            FoldWeight::Fp8(w) => self.gemv_folded_resid(x, w, h, next, n, k),
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
            FoldWeight::Int4(w) => self.gemv_folded_normed(input, w, outs, parts, k),
            FoldWeight::Fp8(w) => self.gemv_folded_normed(input, w, outs, parts, k),
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
            FoldWeight::Int4(w) => self.gemv_folded_silu(input, w, out, f, k),
            FoldWeight::Fp8(w) => self.gemv_folded_silu(input, w, out, f, k),
        }
    }
}
