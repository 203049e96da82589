//! A step of one token with the norms folded into its GEMVs
//! (`kiln_kernels::cuda` `gemv_resid` / `gemv_normed`): where every
//! product of the model is a bf16 weight or int4 tiles and the batch is one
//! row, the o and down projections add into the hidden row and write it
//! times the next norm's weights with partial sums of squares, and the
//! products after each norm (q/k/v, gate/up with SiLU-and-multiply, the
//! head) scale by the norm's factor. A layer then runs no norm and no SiLU
//! kernel: five launches instead of eight, which matters most when one
//! row's GEMVs are short (docs/perf.md has the measured step times).

use kiln_kernels::KernelError;
use kiln_kernels::cuda::{DeviceWeight, Gpu};

use super::linear::Linear;
use super::{Cuda, GpuModel};
use crate::model::ModelConfig;
use crate::model::arch::Block;

type R<T> = Result<T, KernelError>;

/// The matrix of a stack the fold takes whose parts have the rows `want`.
pub(super) fn fold_stack<'a>(l: &'a Linear, want: &[usize]) -> R<(&'a DeviceWeight, &'a [usize])> {
    match l {
        Linear::Stacked { w, parts } if parts.as_slice() == want && Gpu::folds_weight(w) => {
            Ok((w, parts))
        }
        _ => Err(unfoldable()),
    }
}

/// A weight the fold takes.
pub(super) fn fold_weight(w: &DeviceWeight) -> R<&DeviceWeight> {
    if Gpu::folds_weight(w) {
        Ok(w)
    } else {
        Err(unfoldable())
    }
}

fn unfoldable() -> KernelError {
    KernelError::Shape(
        "a folded step needs bf16 weights or int4 tiles, q/k/v and gate/up stacked".into(),
    )
}

/// Whether the fold may take `w`: bf16, or int4 tiles where `int4`.
fn takes(w: &DeviceWeight, int4: bool) -> bool {
    Gpu::folds_weight(w) && (int4 || !is_int4(w))
}

fn is_int4(w: &DeviceWeight) -> bool {
    matches!(w, DeviceWeight::Int4 { .. })
}

/// Whether a block runs folded: every weight bf16 (or int4 tiles, with
/// `int4`), q/k/v and gate/up stacked, no biases, widths the GEMV takes.
fn foldable_block(b: &Block<Cuda>, c: &ModelConfig, int4: bool) -> bool {
    let (q_dim, kv_dim) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
    let widths = [c.hidden, q_dim, c.ffn].iter().all(|k| k.is_multiple_of(8));
    let qkv = fold_stack(&b.qkv, &[q_dim, kv_dim, kv_dim]).is_ok_and(|(w, _)| takes(w, int4));
    // Int4 pairs each gate strip of 16 rows with its up strip.
    let gate_up = fold_stack(&b.gate_up, &[c.ffn, c.ffn])
        .is_ok_and(|(w, _)| takes(w, int4) && (!is_int4(w) || c.ffn.is_multiple_of(16)));
    widths && b.qkv_bias.is_none() && qkv && gate_up && takes(&b.wo, int4) && takes(&b.down, int4)
}

impl GpuModel {
    /// Whether a step of `tokens` tokens runs folded: switched on (for a
    /// model [`Self::foldable`]) and one row, the folded kernels' only
    /// batch.
    pub(super) fn folds(&self, tokens: usize) -> bool {
        self.fold && tokens == 1
    }

    /// Whether the model's weights allow the folded step at all (int4
    /// tiles only with `int4`).
    pub(super) fn foldable(&self, int4: bool) -> bool {
        let w = &self.weights;
        w.blocks
            .iter()
            .all(|b| foldable_block(b, &self.config, int4))
            && takes(w.head(), int4)
    }
}
