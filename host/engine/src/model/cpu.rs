//! The CPU backend: weights in host memory, KV in host pages, every
//! operation of [`Ops`] by the kernels' CPU reference.

use kiln_kernels::KernelError;
use kiln_kernels::hadamard;
use kiln_kernels::kv::{KvFormat, KvLayout, KvPages};
use kiln_kernels::matmul::{Weight, matmul};
use kiln_kernels::ops::{Rope, add_assign, rmsnorm, silu_mul};
use rayon::prelude::*;

use super::ModelConfig;
use super::arch::{Backend, Decoder, Input, Ops, R};
use super::step::StepSeq;

/// Weights in host memory.
pub(crate) struct Host;

impl Backend for Host {
    type Vector = Vec<f32>;
    type Matrix = Weight;
    type Stack = Vec<Weight>;

    fn matrix_bytes(m: &Weight) -> usize {
        m.size_bytes()
    }

    fn stack_bytes(s: &Vec<Weight>) -> usize {
        s.iter().map(Weight::size_bytes).sum()
    }
}

/// A model's weights, as loaded.
pub struct Model {
    /// Hyper-parameters.
    pub config: ModelConfig,
    pub(crate) weights: Decoder<Host>,
    pub(crate) rope: Rope,
}

/// KV pages of every layer.
pub struct KvCache {
    layers: Vec<KvPages>,
    page_size: usize,
}

impl KvCache {
    /// `num_pages` pages of `page_size` tokens for `config`.
    pub fn new(config: &ModelConfig, format: KvFormat, page_size: usize, num_pages: usize) -> Self {
        let layout = layout(config, page_size);
        Self {
            layers: (0..config.layers)
                .map(|_| KvPages::new(format, layout, num_pages))
                .collect(),
            page_size,
        }
    }

    /// Bytes one page takes across all layers.
    pub fn page_bytes(config: &ModelConfig, format: KvFormat, page_size: usize) -> usize {
        layout(config, page_size).page_bytes(format) * config.layers
    }

    /// `pages`' contents, each page's layers in turn (as a GPU's pages
    /// give them, `GpuModel::export_kv_pages`).
    pub fn read_pages(&self, pages: &[u32]) -> Vec<u8> {
        let mut out = Vec::new();
        for &page in pages {
            for layer in &self.layers {
                layer.read_page(page as usize, &mut out);
            }
        }
        out
    }

    /// Overwrites `pages` with what [`Self::read_pages`] gave for as many
    /// pages of the same format and layout.
    pub fn write_pages(&mut self, pages: &[u32], bytes: &[u8]) -> Result<(), String> {
        let per_layer = self
            .layers
            .first()
            .map_or(0, |l| l.layout().page_bytes(l.format()));
        if bytes.len() != per_layer * self.layers.len() * pages.len() {
            return Err(format!(
                "{} bytes for {} pages of {} here",
                bytes.len(),
                pages.len(),
                per_layer * self.layers.len()
            ));
        }
        let mut chunks = bytes.chunks(per_layer.max(1));
        for &page in pages {
            for layer in &mut self.layers {
                let chunk = chunks.next().unwrap_or_default();
                layer
                    .write_page(page as usize, chunk)
                    .map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    }
}

fn layout(config: &ModelConfig, page_size: usize) -> KvLayout {
    KvLayout {
        page_size,
        kv_heads: config.kv_heads,
        head_dim: config.head_dim,
    }
}

impl Model {
    /// Bytes of the matrices a decode step reads: every layer's and the
    /// output head.
    pub fn weight_bytes(&self) -> usize {
        self.weights.weight_bytes()
    }

    /// Runs one step: writes the new tokens' K and V into their pages and
    /// returns the logits of each sequence that asked, in batch order.
    pub fn forward(
        &self,
        kv: &mut KvCache,
        batch: &[StepSeq<'_>],
    ) -> Result<Vec<Vec<f32>>, KernelError> {
        let mut step = CpuStep::new(&self.config, &self.rope, kv, batch)?;
        self.config.arch.forward(&mut step, &self.weights)?;
        Ok(step.logits)
    }
}

/// One step's buffers on the CPU, a row per token (of one rank's heads and
/// MLP columns under tensor parallelism, `cpu_tp.rs`).
pub(super) struct CpuStep<'a> {
    c: &'a ModelConfig,
    rope: &'a Rope,
    kv: &'a mut KvCache,
    batch: &'a [StepSeq<'a>],
    /// Where each token came from: (sequence, position).
    owners: Vec<(usize, usize)>,
    /// The residual stream.
    x: Vec<f32>,
    /// The normed rows the next projection reads.
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    /// A projection into the residual stream (a rank's part, then the sum).
    pub(super) proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    /// Each asking sequence's logits (a rank's vocabulary rows).
    pub(super) logits: Vec<Vec<f32>>,
}

impl<'a> CpuStep<'a> {
    /// Buffers for `batch` on a model (or rank) of shape `c`.
    pub(super) fn new(
        c: &'a ModelConfig,
        rope: &'a Rope,
        kv: &'a mut KvCache,
        batch: &'a [StepSeq<'a>],
    ) -> R<Self> {
        if let Some(t) = batch
            .iter()
            .flat_map(|b| b.tokens)
            .find(|t| **t as usize >= c.vocab)
        {
            return Err(KernelError::Shape(format!(
                "token id {t} is outside the vocabulary"
            )));
        }
        let owners: Vec<(usize, usize)> = batch
            .iter()
            .enumerate()
            .flat_map(|(s, b)| (0..b.tokens.len()).map(move |i| (s, b.start + i)))
            .collect();
        let n = owners.len();
        let (q_dim, kv_dim) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let rows = |width: usize| vec![0.0f32; n * width];
        Ok(Self {
            c,
            rope,
            kv,
            batch,
            x: rows(c.hidden),
            xn: rows(c.hidden),
            q: rows(q_dim),
            k: rows(kv_dim),
            v: rows(kv_dim),
            attn: rows(q_dim),
            proj: rows(c.hidden),
            gate: rows(c.ffn),
            up: rows(c.ffn),
            owners,
            logits: Vec::new(),
        })
    }

    fn n(&self) -> usize {
        self.owners.len()
    }

    /// RoPE on each token's q and k (and the FP8 pages' rotation), then
    /// its K and V into its page slot.
    fn rope_and_store(&mut self, layer: usize) {
        let c = self.c;
        let (hd, q_dim, kv_dim) = (c.head_dim, c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let page_size = self.kv.page_size;
        let pages = &mut self.kv.layers[layer];
        let rotates = pages.format().rotates();
        for (t, (s, pos)) in self.owners.iter().enumerate() {
            let (q, k) = (
                &mut self.q[t * q_dim..(t + 1) * q_dim],
                &mut self.k[t * kv_dim..(t + 1) * kv_dim],
            );
            self.rope.apply(q, *pos);
            self.rope.apply(k, *pos);
            if rotates {
                hadamard::rotate_heads(q, hd);
                hadamard::rotate_heads(k, hd);
            }
            let seq = &self.batch[*s];
            if !seq.write_kv {
                continue;
            }
            let page = seq.pages[pos / page_size] as usize;
            let v = &self.v[t * kv_dim..(t + 1) * kv_dim];
            pages.write(page, pos % page_size, k, v);
        }
    }
}

impl<'w> Ops<'w> for CpuStep<'_> {
    type W = Host;

    fn embed(&mut self, table: &'w Weight) -> R {
        let hidden = self.c.hidden;
        let tokens = self.batch.iter().flat_map(|b| b.tokens);
        for (row, tok) in self.x.chunks_exact_mut(hidden).zip(tokens) {
            table.row(*tok as usize, row);
        }
        Ok(())
    }

    fn norm(&mut self, w: &'w Vec<f32>) -> R {
        rmsnorm(&self.x, w, self.c.eps, &mut self.xn);
        Ok(())
    }

    fn attention(
        &mut self,
        layer: usize,
        qkv: &'w Vec<Weight>,
        bias: Option<&'w [Vec<f32>; 3]>,
    ) -> R {
        self.attend(layer, qkv, bias.map(|[q, k, v]| [&q[..], &k[..], &v[..]]))
    }

    fn gated_mlp(&mut self, gate_up: &'w Vec<Weight>) -> R {
        let n = self.n();
        let [wg, wu] = gate_up.as_slice() else {
            return Err(KernelError::Shape("the MLP needs gate and up".into()));
        };
        matmul(&self.xn, n, wg, &mut self.gate)?;
        matmul(&self.xn, n, wu, &mut self.up)?;
        silu_mul(&mut self.gate, &self.up);
        Ok(())
    }

    fn add_projection(&mut self, input: Input, w: &'w Weight, next: &'w Vec<f32>) -> R {
        self.project(input, w)?;
        self.add_projected(next)
    }

    fn head(&mut self, w: &'w Weight) -> R {
        let hidden = self.c.hidden;
        // Only the last token of each sequence that asks.
        let mut last = Vec::new();
        let mut t = 0;
        for b in self.batch {
            t += b.tokens.len();
            if b.logits && !b.tokens.is_empty() {
                last.extend_from_slice(&self.xn[(t - 1) * hidden..t * hidden]);
            }
        }
        let m = last.len() / hidden;
        let vocab = w.rows();
        let mut logits = vec![0.0f32; m * vocab];
        matmul(&last, m, w, &mut logits)?;
        self.logits = logits.chunks_exact(vocab).map(<[f32]>::to_vec).collect();
        Ok(())
    }
}

impl CpuStep<'_> {
    /// Block `layer`'s attention (see [`Ops::attention`]).
    pub(super) fn attend(&mut self, layer: usize, qkv: &[Weight], bias: Option<[&[f32]; 3]>) -> R {
        let n = self.n();
        let [wq, wk, wv] = qkv else {
            return Err(KernelError::Shape("attention needs q, k and v".into()));
        };
        matmul(&self.xn, n, wq, &mut self.q)?;
        matmul(&self.xn, n, wk, &mut self.k)?;
        matmul(&self.xn, n, wv, &mut self.v)?;
        if let Some([bq, bk, bv]) = bias {
            for (out, b) in [(&mut self.q, bq), (&mut self.k, bk), (&mut self.v, bv)] {
                out.chunks_exact_mut(b.len()).for_each(|r| add_assign(r, b));
            }
        }
        self.rope_and_store(layer);
        let q_dim = self.c.heads * self.c.head_dim;
        let scale = 1.0 / (self.c.head_dim as f32).sqrt();
        let (pages, q, owners, batch) = (&self.kv.layers[layer], &self.q, &self.owners, self.batch);
        self.attn
            .par_chunks_mut(q_dim)
            .enumerate()
            .for_each(|(t, out)| {
                let (s, pos) = owners[t];
                let q = &q[t * q_dim..(t + 1) * q_dim];
                pages.attend(q, batch[s].pages, pos + 1, scale, out);
            });
        Ok(())
    }

    /// `proj = input * w`: a rank's part of a projection into the
    /// residual stream, before the ranks' parts are summed.
    pub(super) fn project(&mut self, input: Input, w: &Weight) -> R {
        let n = self.n();
        let x = match input {
            Input::Attention => &self.attn,
            Input::Mlp => &self.gate,
        };
        matmul(x, n, w, &mut self.proj)
    }

    /// `hidden += proj`; the next projection reads `rmsnorm(hidden) * next`.
    pub(super) fn add_projected(&mut self, next: &[f32]) -> R {
        add_assign(&mut self.x, &self.proj);
        rmsnorm(&self.x, next, self.c.eps, &mut self.xn);
        Ok(())
    }
}
