//! cuBLASLt algorithms tuned at load for a decode step's bf16 products:
//! each product's shape at every batch size a captured decode step runs
//! through cuBLAS, timed with its weights out of L2 against
//! `cublasGemmEx`'s own choice (`Gpu::tune_bf16` keeps the faster).

use std::collections::HashSet;

use kiln_kernels::KernelError;
use kiln_kernels::cuda::{
    Bf16Out, DeviceWeight, GemmShape, SKINNY_WINS_M, TUNE_KEEP_BELOW, TuneBf16,
};

use super::GpuModel;
use super::inputs::decode_buckets;
use super::linear::Linear;

/// cuBLASLt's candidates timed per shape, its best guess first.
const CANDIDATES: usize = 16;

impl GpuModel {
    /// Tunes the bf16 products of decode steps of up to `most_rows`
    /// sequences on the main lane (the one that decodes), at the batch
    /// sizes above the skinny GEMM's that graphs pad them to; returns how
    /// many (rows, product) pairs now run a tuned algorithm, of how many
    /// timed. Before graphs are captured: a captured product keeps what it
    /// ran. Batch sizes tuned before (for the same MLP) are not timed
    /// again; a product whose tuning fails keeps cuBLAS's own choice.
    pub fn tune_bf16(&mut self, most_rows: usize) -> Result<(usize, usize), KernelError> {
        let done = match self.tuned {
            Some((rows, mlp)) if mlp == self.bf16_mlp_decode => rows,
            _ => 0,
        };
        let rows: Vec<usize> = decode_buckets(most_rows)
            .filter(|&m| m > SKINNY_WINS_M.max(done))
            .collect();
        if rows.is_empty() {
            return Ok((0, 0));
        }
        let (c, g) = (&self.config, &self.gpu);
        let Some(b) = self.weights.blocks.first() else {
            return Ok((0, 0));
        };
        let q_dim = c.heads * c.head_dim;
        let f32_out = Bf16Out::F32;
        let mut products: Vec<(&DeviceWeight, usize, usize, usize, Bf16Out)> = Vec::new();
        // The stacks as a decode step runs them (`ops.rs`): q/k/v whole
        // unless it has biases; gate/up by parts into f32, or whole into
        // bf16 for the bf16 MLP.
        let stacks = [
            (&b.qkv, b.qkv_bias.is_none(), f32_out),
            (&b.gate_up, self.bf16_mlp_decode, Bf16Out::Bf16),
        ];
        for (l, whole, whole_out) in stacks {
            let Linear::Stacked { w, parts } = l else {
                continue;
            };
            if whole {
                products.push((w, 0, parts.iter().sum(), c.hidden, whole_out));
                continue;
            }
            let mut row0 = 0;
            for &p in parts {
                products.push((w, row0, p, c.hidden, f32_out));
                row0 += p;
            }
        }
        products.push((&b.wo, 0, c.hidden, q_dim, f32_out));
        products.push((&b.down, 0, c.hidden, c.ffn, f32_out));
        products.push((self.weights.head(), 0, c.vocab, c.hidden, f32_out));
        let mut seen = HashSet::new();
        let (mut kept, mut timed) = (0, 0);
        for (w, row0, n, k, out) in products {
            let DeviceWeight::Bf16(wb) = w else { continue };
            if !seen.insert((n, k, out)) {
                continue;
            }
            let shape = GemmShape { m: 0, n, k };
            let tune = TuneBf16 {
                rows: &rows,
                candidates: CANDIDATES,
                keep_below: TUNE_KEEP_BELOW,
                out,
            };
            let found = match g.tune_bf16(wb, row0, shape, tune) {
                Ok(found) => found,
                Err(e) => {
                    tracing::warn!(n, k, "bf16 product left to cuBLAS's choice: {e}");
                    continue;
                }
            };
            for t in found {
                timed += 1;
                kept += usize::from(t.kept);
                tracing::debug!(
                    m = t.shape.m,
                    n,
                    k,
                    gemmex_us = t.gemmex_us,
                    best_us = t.best.us,
                    rank = t.best.rank,
                    kept = t.kept,
                    "bf16 product tuned"
                );
            }
        }
        self.tuned = Some((done.max(most_rows), self.bf16_mlp_decode));
        Ok((kept, timed))
    }

    /// Forgets the tuning: bf16 products run cuBLAS's own choices (weights
    /// a runner gives back keep their tuning otherwise).
    pub fn clear_bf16_tuning(&mut self) -> Result<(), KernelError> {
        self.tuned = None;
        self.gpu.clear_bf16_tuning()
    }
}
