//! A step of one token with the norms folded into its GEMVs
//! (`kiln_kernels::cuda` `gemv_resid` / `gemv_normed`): where every
//! product of the model is a bf16 weight, int4 tiles or FP8 rows and the
//! batch is one row, the o and down projections add into the hidden row
//! and write it times the next norm's weights with partial sums of
//! squares, and the products after each norm (q/k/v, gate/up with
//! SiLU-and-multiply, the head) scale by the norm's factor. A layer then
//! runs no norm and no SiLU kernel: five launches instead of eight, which
//! matters most when one row's GEMVs are short (docs/perf.md has the
//! measured step times).

use kiln_kernels::KernelError;
use kiln_kernels::cuda::{DeviceWeight, FP8_FOLD_MAX_K, Gpu};

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
        "a folded step needs bf16 weights, int4 tiles or FP8 rows, q/k/v and gate/up stacked"
            .into(),
    )
}

/// The quantized weights a folded step takes beside bf16.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FoldFormats {
    /// Int4 tiles.
    pub int4: bool,
    /// FP8 rows packed for FP8 tensor cores.
    pub fp8: bool,
}

/// Whether the fold may take `w` (`n x k`): bf16, or int4 tiles or FP8
/// rows where `q` allows them (FP8 rows in strips of 16 rows and pieces of
/// 64 columns, at most [`FP8_FOLD_MAX_K`] of them).
fn takes(w: &DeviceWeight, q: FoldFormats, n: usize, k: usize) -> bool {
    let allowed = match w {
        DeviceWeight::Int4 { .. } => q.int4,
        DeviceWeight::Fp8 { .. } => {
            q.fp8 && n.is_multiple_of(16) && k.is_multiple_of(64) && k <= FP8_FOLD_MAX_K
        }
        _ => true,
    };
    Gpu::folds_weight(w) && allowed
}

/// Whether a block runs folded: every weight bf16 (or int4 tiles or FP8
/// rows, where `q` allows them), q/k/v and gate/up stacked, no biases,
/// widths the GEMV takes.
fn foldable_block(b: &Block<Cuda>, c: &ModelConfig, q: FoldFormats) -> bool {
    let (q_dim, kv_dim) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
    let widths = [c.hidden, q_dim, c.ffn].iter().all(|k| k.is_multiple_of(8));
    let qkv = fold_stack(&b.qkv, &[q_dim, kv_dim, kv_dim])
        .is_ok_and(|(w, _)| takes(w, q, q_dim + 2 * kv_dim, c.hidden));
    // Int4 and FP8 pair each gate strip of 16 rows with its up strip.
    let strips = |w: &DeviceWeight| {
        !matches!(w, DeviceWeight::Int4 { .. } | DeviceWeight::Fp8 { .. })
            || c.ffn.is_multiple_of(16)
    };
    let gate_up = fold_stack(&b.gate_up, &[c.ffn, c.ffn])
        .is_ok_and(|(w, _)| takes(w, q, 2 * c.ffn, c.hidden) && strips(w));
    widths
        && b.qkv_bias.is_none()
        && qkv
        && gate_up
        && takes(&b.wo, q, c.hidden, q_dim)
        && takes(&b.down, q, c.hidden, c.ffn)
}

impl GpuModel {
    /// Whether a step of `tokens` tokens runs folded: switched on (for a
    /// model [`Self::foldable`]) and one row, the folded kernels' only
    /// batch.
    pub(super) fn folds(&self, tokens: usize) -> bool {
        self.fold && tokens == 1
    }

    /// Whether the model's weights allow the folded step at all (int4
    /// tiles and FP8 rows only where `q` allows them).
    pub(super) fn foldable(&self, q: FoldFormats) -> bool {
        let w = &self.weights;
        w.blocks.iter().all(|b| foldable_block(b, &self.config, q))
            && takes(w.head(), q, self.config.vocab, self.config.hidden)
    }
}
