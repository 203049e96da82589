//! A step of one token with the norms folded into its GEMVs
//! (`kiln_kernels::cuda` `gemv_bf16_resid` / `gemv_bf16_normed`): where every
//! product of the model is a bf16 weight and the batch is one row, the o
//! and down projections add into the hidden row and write it times the
//! next norm's weights with partial sums of squares, and the products
//! after each norm (q/k/v, gate/up with SiLU-and-multiply, the head) scale
//! by the norm's factor. A layer then runs no norm and no SiLU kernel: five
//! launches instead of eight, which matters most when one row's GEMVs are
//! short (docs/perf.md has the measured step times).

use half::bf16;
use kiln_kernels::KernelError;
use kiln_kernels::cuda::{CudaSlice, DeviceWeight};

use super::linear::Linear;
use super::{Cuda, GpuModel};
use crate::model::ModelConfig;
use crate::model::arch::Block;

type R<T> = Result<T, KernelError>;

/// The matrix of a bf16 stack whose parts have the rows `want`.
pub(super) fn bf16_stack<'a>(
    l: &'a Linear,
    want: &[usize],
) -> R<(&'a CudaSlice<bf16>, &'a [usize])> {
    match l {
        Linear::Stacked {
            w: DeviceWeight::Bf16(w),
            parts,
        } if parts.as_slice() == want => Ok((w, parts)),
        _ => Err(unfoldable()),
    }
}

/// The matrix of a bf16 weight.
pub(super) fn bf16(w: &DeviceWeight) -> R<&CudaSlice<bf16>> {
    match w {
        DeviceWeight::Bf16(w) => Ok(w),
        DeviceWeight::Blocks { .. } | DeviceWeight::Int4 { .. } | DeviceWeight::Fp8 { .. } => {
            Err(unfoldable())
        }
    }
}

fn unfoldable() -> KernelError {
    KernelError::Shape("a folded step needs bf16 weights, q/k/v and gate/up stacked".into())
}

/// Whether a block runs folded: every weight bf16, q/k/v and gate/up
/// stacked, no biases, widths the GEMV takes.
fn foldable_block(b: &Block<Cuda>, c: &ModelConfig) -> bool {
    let (q_dim, kv_dim) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
    let widths = [c.hidden, q_dim, c.ffn].iter().all(|k| k.is_multiple_of(8));
    widths
        && b.qkv_bias.is_none()
        && bf16_stack(&b.qkv, &[q_dim, kv_dim, kv_dim]).is_ok()
        && bf16_stack(&b.gate_up, &[c.ffn, c.ffn]).is_ok()
        && bf16(&b.wo).is_ok()
        && bf16(&b.down).is_ok()
}

impl GpuModel {
    /// Whether a step of `tokens` tokens runs folded: switched on (for a
    /// model [`Self::foldable`]) and one row, the folded kernels' only
    /// batch.
    pub(super) fn folds(&self, tokens: usize) -> bool {
        self.fold && tokens == 1
    }

    /// Whether the model's weights allow the folded step at all.
    pub(super) fn foldable(&self) -> bool {
        let w = &self.weights;
        w.blocks.iter().all(|b| foldable_block(b, &self.config)) && bf16(w.head()).is_ok()
    }
}
