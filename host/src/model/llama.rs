//! The llama-family forward pass over a batch of sequences whose KV lives
//! in pages.

use kiln_kernels::KernelError;
use kiln_kernels::hadamard;
use kiln_kernels::kv::{KvFormat, KvLayout, KvPages};
use kiln_kernels::matmul::{Weight, matmul};
use kiln_kernels::ops::{Rope, add_assign, rmsnorm, silu_mul};
use rayon::prelude::*;

use super::ModelConfig;

/// One transformer block's weights.
pub struct Layer {
    pub(super) attn_norm: Vec<f32>,
    pub(super) wq: Weight,
    pub(super) wk: Weight,
    pub(super) wv: Weight,
    pub(super) wo: Weight,
    pub(super) bias: Option<[Vec<f32>; 3]>,
    pub(super) ffn_norm: Vec<f32>,
    pub(super) w_gate: Weight,
    pub(super) w_up: Weight,
    pub(super) w_down: Weight,
}

/// A model's weights.
pub struct Model {
    /// Hyper-parameters.
    pub config: ModelConfig,
    pub(super) embed: Weight,
    pub(super) layers: Vec<Layer>,
    pub(super) norm: Vec<f32>,
    /// `None` when the output projection is tied to the embedding.
    pub(super) output: Option<Weight>,
    pub(super) rope: Rope,
}

/// KV pages of every layer.
pub struct KvCache {
    layers: Vec<KvPages>,
    page_size: usize,
}

impl KvCache {
    /// `num_pages` pages of `page_size` tokens for `config`.
    pub fn new(config: &ModelConfig, format: KvFormat, page_size: usize, num_pages: usize) -> Self {
        let layout = KvLayout {
            page_size,
            kv_heads: config.kv_heads,
            head_dim: config.head_dim,
        };
        Self {
            layers: (0..config.layers)
                .map(|_| KvPages::new(format, layout, num_pages))
                .collect(),
            page_size,
        }
    }

    /// Bytes one page takes across all layers.
    pub fn page_bytes(config: &ModelConfig, format: KvFormat, page_size: usize) -> usize {
        let layout = KvLayout {
            page_size,
            kv_heads: config.kv_heads,
            head_dim: config.head_dim,
        };
        layout.page_bytes(format) * config.layers
    }
}

/// One sequence's part of a step: tokens to feed at positions
/// `start..start + tokens.len()`, its block table, and whether the logits of
/// its last token are wanted.
#[derive(Debug, Clone, Copy)]
pub struct BatchSeq<'a> {
    /// New tokens.
    pub tokens: &'a [u32],
    /// Position of the first new token.
    pub start: usize,
    /// Page ids covering positions `0..start + tokens.len()`.
    pub pages: &'a [u32],
    /// Whether to return logits for the last token.
    pub logits: bool,
    /// Whether to write the new tokens' K and V; false when the pages
    /// already hold them (a prefix-cache hit recomputed for its logits).
    pub write_kv: bool,
    /// How its next token is chosen, as far as a device may choose it.
    pub draw: Draw,
}

/// How a sequence's next token is chosen, as far as a device may do it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Draw {
    /// The logits go back to the host (teacher forcing, host sampling).
    Logits,
    /// The argmax: a device may return it instead of the logits.
    Greedy,
    /// Temperature / top-k / top-p sampling with this uniform draw, made by
    /// the host from the request's seeded generator: a device may sample.
    Sample {
        /// The sampling parameters.
        params: kiln_kernels::sample::SamplingParams,
        /// The draw in `[0, 1)`.
        uniform: f32,
    },
}

impl Model {
    /// Bytes of the matrices a decode step reads: every layer's and the
    /// output head.
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
            .map(Weight::size_bytes)
            .sum();
        layers + self.output().size_bytes()
    }

    fn output(&self) -> &Weight {
        self.output.as_ref().unwrap_or(&self.embed)
    }

    /// Runs one step: writes the new tokens' K and V into their pages and
    /// returns the logits of each sequence that asked, in batch order.
    pub fn forward(
        &self,
        kv: &mut KvCache,
        batch: &[BatchSeq<'_>],
    ) -> Result<Vec<Vec<f32>>, KernelError> {
        let c = &self.config;
        let (hd, q_dim, kv_dim) = (c.head_dim, c.heads * c.head_dim, c.kv_heads * c.head_dim);
        // Where each flattened token came from: (sequence, position).
        let owners: Vec<(usize, usize)> = batch
            .iter()
            .enumerate()
            .flat_map(|(s, b)| (0..b.tokens.len()).map(move |i| (s, b.start + i)))
            .collect();
        let n = owners.len();
        let mut x = vec![0.0f32; n * c.hidden];
        for (row, tok) in x
            .chunks_exact_mut(c.hidden)
            .zip(batch.iter().flat_map(|b| b.tokens))
        {
            if *tok as usize >= c.vocab {
                return Err(KernelError::Shape(format!(
                    "token id {tok} is outside the vocabulary"
                )));
            }
            self.embed.row(*tok as usize, row);
        }
        let mut xn = vec![0.0f32; n * c.hidden];
        let (mut q, mut k, mut v) = (
            vec![0.0; n * q_dim],
            vec![0.0; n * kv_dim],
            vec![0.0; n * kv_dim],
        );
        let mut attn = vec![0.0f32; n * q_dim];
        let mut proj = vec![0.0f32; n * c.hidden];
        let (mut gate, mut up) = (vec![0.0f32; n * c.ffn], vec![0.0f32; n * c.ffn]);
        let scale = 1.0 / (hd as f32).sqrt();
        let rotates = kv.layers.first().is_some_and(|p| p.format().rotates());
        for (layer, pages) in self.layers.iter().zip(kv.layers.iter_mut()) {
            rmsnorm(&x, &layer.attn_norm, c.eps, &mut xn);
            matmul(&xn, n, &layer.wq, &mut q)?;
            matmul(&xn, n, &layer.wk, &mut k)?;
            matmul(&xn, n, &layer.wv, &mut v)?;
            if let Some([bq, bk, bv]) = &layer.bias {
                q.chunks_exact_mut(q_dim).for_each(|r| add_assign(r, bq));
                k.chunks_exact_mut(kv_dim).for_each(|r| add_assign(r, bk));
                v.chunks_exact_mut(kv_dim).for_each(|r| add_assign(r, bv));
            }
            for (t, (s, pos)) in owners.iter().enumerate() {
                self.rope.apply(&mut q[t * q_dim..(t + 1) * q_dim], *pos);
                self.rope.apply(&mut k[t * kv_dim..(t + 1) * kv_dim], *pos);
                if rotates {
                    hadamard::rotate_heads(&mut q[t * q_dim..(t + 1) * q_dim], hd);
                    hadamard::rotate_heads(&mut k[t * kv_dim..(t + 1) * kv_dim], hd);
                }
                if !batch[*s].write_kv {
                    continue;
                }
                let page = batch[*s].pages[pos / kv.page_size] as usize;
                pages.write(
                    page,
                    pos % kv.page_size,
                    &k[t * kv_dim..(t + 1) * kv_dim],
                    &v[t * kv_dim..(t + 1) * kv_dim],
                );
            }
            let pages = &*pages;
            attn.par_chunks_mut(q_dim).enumerate().for_each(|(t, out)| {
                let (s, pos) = owners[t];
                pages.attend(
                    &q[t * q_dim..(t + 1) * q_dim],
                    batch[s].pages,
                    pos + 1,
                    scale,
                    out,
                );
            });
            matmul(&attn, n, &layer.wo, &mut proj)?;
            add_assign(&mut x, &proj);
            rmsnorm(&x, &layer.ffn_norm, c.eps, &mut xn);
            matmul(&xn, n, &layer.w_gate, &mut gate)?;
            matmul(&xn, n, &layer.w_up, &mut up)?;
            silu_mul(&mut gate, &up);
            matmul(&gate, n, &layer.w_down, &mut proj)?;
            add_assign(&mut x, &proj);
        }
        // Final norm and logits only for the last token of asking sequences.
        let mut last = Vec::new();
        let mut t = 0;
        for b in batch {
            t += b.tokens.len();
            if b.logits && !b.tokens.is_empty() {
                last.extend_from_slice(&x[(t - 1) * c.hidden..t * c.hidden]);
            }
        }
        let m = last.len() / c.hidden;
        let mut normed = vec![0.0f32; last.len()];
        rmsnorm(&last, &self.norm, c.eps, &mut normed);
        let mut logits = vec![0.0f32; m * c.vocab];
        matmul(&normed, m, self.output(), &mut logits)?;
        Ok(logits.chunks_exact(c.vocab).map(<[f32]>::to_vec).collect())
    }
}
