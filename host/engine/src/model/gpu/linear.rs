//! Projections that read the same input (q, k and v; gate and up), stacked
//! into one device weight when their types allow, so a decode step streams
//! them in one GEMV launch instead of one each.

use kiln_kernels::KernelError;
use kiln_kernels::cuda::{CudaSlice, DeviceWeight, GemmScratch, Gpu, NormArgs, StackShape};
use kiln_kernels::matmul::Weight;
use kiln_kernels::quant::DType;

type R<T> = Result<T, KernelError>;

/// Whether a weight's GEMMs can read bf16 activations from the scratch:
/// bf16 rows (cuBLAS) or FP8 rows packed for tensor cores (the W8A8 GEMM,
/// which quantizes them per token). `Gpu::takes_bf16_input` decides it
/// per product; this is the weight's part of that.
pub(super) fn gemm_input(w: &DeviceWeight) -> bool {
    matches!(w, DeviceWeight::Bf16(_) | DeviceWeight::Fp8 { .. })
}

/// The norm before a projection: the hidden rows `h` (`norm.rows` of
/// `norm.cols`), with the residual to add to them first, the norm's
/// weights and epsilon.
pub(super) struct NormIn<'a> {
    /// The hidden rows.
    pub h: &'a mut CudaSlice<f32>,
    /// The norm.
    pub norm: NormArgs<'a>,
}

/// Weights of one input width, each with its own output.
pub(crate) enum Linear {
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
    fn apply(
        &self,
        g: &Gpu,
        x: &CudaSlice<f32>,
        outs: &mut [&mut CudaSlice<f32>],
        m: usize,
        k: usize,
        scratch: &mut GemmScratch,
    ) -> R<()> {
        self.each_stack(k, outs, |w, outs, parts| {
            g.matmul_parts(x, w, outs, StackShape { m, parts, k }, scratch)
        })
    }

    /// Calls `f` with each device weight, its outputs and its parts' rows:
    /// the stack once, or each weight apart with its own output.
    fn each_stack(
        &self,
        k: usize,
        outs: &mut [&mut CudaSlice<f32>],
        mut f: impl FnMut(&DeviceWeight, &mut [&mut CudaSlice<f32>], &[usize]) -> R<()>,
    ) -> R<()> {
        match self {
            Linear::Stacked { w, parts } => f(w, outs, parts),
            Linear::Apart(ws) => {
                for (w, out) in ws.iter().zip(outs.iter_mut()) {
                    let rows = w.size_bytes() / w.row_bytes(k)?;
                    f(w, &mut [&mut **out], &[rows])?;
                }
                Ok(())
            }
        }
    }

    /// `outs[i] = rmsnorm(h += residual) * norm_w * w_i^T` over the norm's
    /// rows. Where every weight runs cuBLAS on bf16 activations (two rows
    /// up, bf16 weights), the norm writes them straight into the GEMM's
    /// scratch; otherwise into `xn` as f32 for [`Self::apply`].
    pub(super) fn apply_normed(
        &self,
        g: &Gpu,
        NormIn { h, norm }: NormIn<'_>,
        xn: &mut CudaSlice<f32>,
        outs: &mut [&mut CudaSlice<f32>],
        scratch: &mut GemmScratch,
    ) -> R<()> {
        let (m, k) = (norm.rows, norm.cols);
        if self.weights().all(|w| g.takes_bf16_input(w, m, k)) {
            if let Linear::Stacked { w, parts } = self {
                return g.normed_parts(h, &norm, w, outs, parts, scratch);
            }
            g.rmsnorm_residual_bf16(h, scratch, &norm)?;
            return self.each_stack(k, outs, |w, outs, parts| {
                g.matmul_parts_bf16(w, outs, StackShape { m, parts, k }, scratch)
            });
        }
        g.rmsnorm_residual(h, xn, &norm)?;
        self.apply(g, xn, outs, m, k, scratch)
    }

    /// The stack as one GEMM at `m` rows of `k` on bf16 activations, where
    /// it is one weight that [takes them](Gpu::takes_bf16_input) there
    /// (cuBLAS on bf16 rows, the W8A8 GEMM on FP8 rows); else `None`.
    pub(super) fn cublas_stack(&self, g: &Gpu, m: usize, k: usize) -> Option<CublasStack<'_>> {
        match self {
            Linear::Stacked { w, parts } if g.takes_bf16_input(w, m, k) => Some(CublasStack {
                w,
                rows: parts.iter().sum(),
            }),
            _ => None,
        }
    }

    /// Whether every weight is FP8 rows.
    pub(super) fn fp8_rows(&self) -> bool {
        self.weights().all(|w| {
            matches!(
                w,
                DeviceWeight::Fp8 { .. }
                    | DeviceWeight::Blocks {
                        dtype: DType::Fp8Row,
                        ..
                    }
            )
        })
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

/// A stack that runs as one GEMM on bf16 activations at its rows: only
/// [`Linear::cublas_stack`] makes one.
pub(super) struct CublasStack<'a> {
    w: &'a DeviceWeight,
    rows: usize,
}

impl CublasStack<'_> {
    /// As [`Linear::apply_normed`], in one GEMM over the whole stack: row r
    /// of `out` is every part's row r side by side (`m x` the stack's rows).
    pub(super) fn apply_normed(
        &self,
        g: &Gpu,
        NormIn { h, norm }: NormIn<'_>,
        out: &mut CudaSlice<f32>,
        scratch: &mut GemmScratch,
    ) -> R<()> {
        g.normed_parts(h, &norm, self.w, &mut [out], &[self.rows], scratch)
    }

    /// As [`Self::apply_normed`], the product in bf16.
    pub(super) fn apply_normed_bf16(
        &self,
        g: &Gpu,
        NormIn { h, norm }: NormIn<'_>,
        out: &mut CudaSlice<half::bf16>,
        scratch: &mut GemmScratch,
    ) -> R<()> {
        g.normed_bf16_out(h, &norm, self.w, out, self.rows, scratch)
    }
}
