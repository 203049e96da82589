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
use kiln_kernels::cuda::{CudaSlice, DeviceWeight, Gpu, NormSum};

use super::linear::Linear;
use super::{GpuLayer, GpuModel};
use crate::model::ModelConfig;

type R<T> = Result<T, KernelError>;

/// A layer's weights as the folded step streams them: each a bf16 matrix,
/// q/k/v and gate/up stacked. Only [`GpuLayer::folded`] makes one.
pub(super) struct FoldedLayer<'a> {
    /// q, k and v, row block after row block.
    pub qkv: &'a CudaSlice<bf16>,
    /// Their rows.
    pub qkv_parts: &'a [usize],
    /// The o projection.
    pub wo: &'a CudaSlice<bf16>,
    /// gate over up.
    pub gate_up: &'a CudaSlice<bf16>,
    /// The down projection.
    pub down: &'a CudaSlice<bf16>,
}

/// The matrix of a bf16 stack whose parts have the rows `want`.
fn bf16_stack<'a>(l: &'a Linear, want: &[usize]) -> Option<(&'a CudaSlice<bf16>, &'a [usize])> {
    match l {
        Linear::Stacked {
            w: DeviceWeight::Bf16(w),
            parts,
        } if parts.as_slice() == want => Some((w, parts)),
        _ => None,
    }
}

fn bf16(w: &DeviceWeight) -> Option<&CudaSlice<bf16>> {
    match w {
        DeviceWeight::Bf16(w) => Some(w),
        DeviceWeight::Blocks { .. } => None,
    }
}

impl GpuLayer {
    /// The layer as the folded step takes it: every weight bf16, q/k/v and
    /// gate/up stacked, no biases, widths the GEMV takes.
    pub(super) fn folded(&self, c: &ModelConfig) -> Option<FoldedLayer<'_>> {
        let (q_dim, kv_dim) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let widths = [c.hidden, q_dim, c.ffn].iter().all(|k| k.is_multiple_of(8));
        if self.bias.is_some() || !widths {
            return None;
        }
        let (qkv, qkv_parts) = bf16_stack(&self.qkv, &[q_dim, kv_dim, kv_dim])?;
        let (gate_up, _) = bf16_stack(&self.gate_up, &[c.ffn, c.ffn])?;
        Some(FoldedLayer {
            qkv,
            qkv_parts,
            wo: bf16(&self.wo)?,
            gate_up,
            down: bf16(&self.w_down)?,
        })
    }
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
        self.layers.iter().all(|l| l.folded(&self.config).is_some())
            && bf16(self.output.as_ref().unwrap_or(&self.embed)).is_some()
    }

    /// The head after the final norm folded into the last down projection:
    /// `logits = rmsnorm(h) * norm_w * output^T`.
    pub(super) fn folded_head(
        &self,
        g: &Gpu,
        gh: &CudaSlice<f32>,
        sum: &NormSum,
        logits: &mut CudaSlice<f32>,
    ) -> R<()> {
        let c = &self.config;
        let out_w = bf16(self.output.as_ref().unwrap_or(&self.embed))
            .ok_or_else(|| KernelError::Shape("a folded head needs bf16 weights".into()))?;
        g.gemv_bf16_normed(gh, out_w, sum, &mut [logits], &[c.vocab], c.hidden, c.eps)
    }
}
