//! Projections that read the same input (q, k and v; gate and up), stacked
//! into one device weight when their types allow, so a decode step streams
//! them in one GEMV launch instead of one each.

use kiln_kernels::KernelError;
use kiln_kernels::cuda::{CudaSlice, DeviceWeight, GemmScratch, Gpu};
use kiln_kernels::matmul::Weight;

type R<T> = Result<T, KernelError>;

/// Weights of one input width, each with its own output.
pub(super) enum Linear {
    /// One stack, row block after row block (`parts` rows each).
    Stacked {
        /// The stacked rows.
        w: DeviceWeight,
        /// Rows of each part, in output order.
        parts: Vec<usize>,
    },
    /// Mixed types: each weight alone.
    Apart(Vec<DeviceWeight>),
}

impl Linear {
    /// Uploads `ws`, stacked when they share a type and width.
    pub(super) fn upload(gpu: &Gpu, ws: &[&Weight]) -> R<Self> {
        Ok(match gpu.weight_stack(ws)? {
            Some(w) => Linear::Stacked {
                w,
                parts: ws.iter().map(|w| w.rows()).collect(),
            },
            None => Linear::Apart(ws.iter().map(|w| gpu.weight(w)).collect::<R<_>>()?),
        })
    }

    /// `outs[i] (m x rows_i) = x (m x k) * w_i^T`.
    pub(super) fn apply(
        &self,
        g: &Gpu,
        x: &CudaSlice<f32>,
        outs: &mut [&mut CudaSlice<f32>],
        m: usize,
        k: usize,
        scratch: &mut GemmScratch,
    ) -> R<()> {
        match self {
            Linear::Stacked { w, parts } => g.matmul_parts(x, w, outs, parts, m, k, scratch),
            Linear::Apart(ws) => {
                for (w, out) in ws.iter().zip(outs.iter_mut()) {
                    let rows = w.size_bytes() / w.row_bytes(k)?;
                    g.matmul(x, w, out, m, rows, k, scratch)?;
                }
                Ok(())
            }
        }
    }

    /// Whether a product of `m` rows reads bf16 activations from the GEMM
    /// scratch ([`Self::apply_bf16`]): bf16 weights, two rows or more.
    pub(super) fn bf16_input(&self, g: &Gpu, m: usize) -> bool {
        self.weights().all(|w| g.takes_bf16_input(w, m))
    }

    /// As [`Self::apply`], on the `m x k` bf16 activations a kernel left in
    /// `scratch` (when [`Self::bf16_input`]).
    pub(super) fn apply_bf16(
        &self,
        g: &Gpu,
        outs: &mut [&mut CudaSlice<f32>],
        m: usize,
        k: usize,
        scratch: &GemmScratch,
    ) -> R<()> {
        match self {
            Linear::Stacked { w, parts } => g.matmul_parts_bf16(w, outs, parts, m, k, scratch),
            Linear::Apart(ws) => {
                for (w, out) in ws.iter().zip(outs.iter_mut()) {
                    let rows = w.size_bytes() / w.row_bytes(k)?;
                    g.matmul_parts_bf16(w, &mut [&mut **out], &[rows], m, k, scratch)?;
                }
                Ok(())
            }
        }
    }

    /// Bytes of weights on the device.
    pub(super) fn size_bytes(&self) -> usize {
        self.weights().map(DeviceWeight::size_bytes).sum()
    }

    /// The device weights.
    pub(super) fn weights(&self) -> impl Iterator<Item = &DeviceWeight> {
        let (one, many) = match self {
            Linear::Stacked { w, .. } => (Some(w), &[][..]),
            Linear::Apart(ws) => (None, &ws[..]),
        };
        one.into_iter().chain(many)
    }
}
