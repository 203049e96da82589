//! Tensor parallelism on the CPU: a model split over R ranks
//! ([`super::shard`]), each with KV pages of its own KV heads at the same
//! page numbers, stepped in lockstep by the architecture's one forward
//! pass. Every operation runs on every rank at once; a projection into the
//! residual stream is each rank's part summed in rank order (the
//! all-reduce), and the head's vocabulary parts are joined. This is the
//! reference the GPU ranks (one device each, NCCL between them) are held
//! to.

use kiln_kernels::KernelError;
use kiln_kernels::kv::KvFormat;
use kiln_kernels::ops::{Rope, add_assign};
use rayon::prelude::*;

use super::arch::{Decoder, Input, Ops, R};
use super::cpu::{CpuStep, KvCache, Model};
use super::shard::{Ranked, rank_config, shard};
use super::step::StepSeq;
use super::{ModelConfig, ModelError};

/// A model's weights split over ranks.
pub struct TpModel {
    /// The whole model's shape.
    config: ModelConfig,
    /// One rank's shape (its heads and MLP width).
    rank: ModelConfig,
    weights: Decoder<Ranked>,
    rope: Rope,
    ranks: usize,
}

impl TpModel {
    /// `model` split over `ranks`; an error says why it does not split.
    pub fn new(model: &Model, ranks: usize) -> Result<Self, ModelError> {
        Ok(Self {
            config: model.config.clone(),
            rank: rank_config(&model.config, ranks)?,
            weights: shard(&model.weights, &model.config, ranks)?,
            rope: model.rope.clone(),
            ranks,
        })
    }

    /// Each rank's KV pages: `num_pages` pages of `page_size` tokens of its
    /// KV heads.
    pub fn kv(&self, format: KvFormat, page_size: usize, num_pages: usize) -> Vec<KvCache> {
        (0..self.ranks)
            .map(|_| KvCache::new(&self.rank, format, page_size, num_pages))
            .collect()
    }

    /// Bytes of the matrices a decode step reads, over all ranks.
    pub fn weight_bytes(&self) -> usize {
        self.weights.weight_bytes()
    }

    /// Runs one step on every rank: as [`Model::forward`], with each rank's
    /// K and V in its own pages.
    pub fn forward(
        &self,
        kv: &mut [KvCache],
        batch: &[StepSeq<'_>],
    ) -> Result<Vec<Vec<f32>>, KernelError> {
        if kv.len() != self.ranks {
            return Err(KernelError::Shape(format!(
                "{} ranks' pages for a model split over {}",
                kv.len(),
                self.ranks
            )));
        }
        let ranks = (kv.iter_mut())
            .map(|kv| CpuStep::new(&self.rank, &self.rope, kv, batch))
            .collect::<R<Vec<_>>>()?;
        let mut step = TpStep { ranks };
        self.config.arch.forward(&mut step, &self.weights)?;
        Ok(step.logits())
    }

    /// `pages`' contents: each rank's in turn, as its own
    /// [`KvCache::read_pages`] gives them.
    pub fn read_pages(kv: &[KvCache], pages: &[u32]) -> Vec<u8> {
        kv.iter().flat_map(|k| k.read_pages(pages)).collect()
    }

    /// Overwrites `pages` with what [`Self::read_pages`] gave for as many
    /// pages of ranks of the same shape.
    pub fn write_pages(kv: &mut [KvCache], pages: &[u32], bytes: &[u8]) -> Result<(), String> {
        let parts = rank_parts(bytes, kv.len())?;
        (kv.iter_mut())
            .zip(parts)
            .try_for_each(|(k, b)| k.write_pages(pages, b))
    }
}

/// `bytes` as `ranks` equal parts, each rank's in turn (pages' contents
/// over ranks, on any backend).
pub(crate) fn rank_parts(bytes: &[u8], ranks: usize) -> Result<Vec<&[u8]>, String> {
    let each = bytes.len() / ranks.max(1);
    if each * ranks != bytes.len() {
        return Err(format!("{} bytes for {ranks} ranks", bytes.len()));
    }
    Ok((0..ranks)
        .map(|i| &bytes[i * each..(i + 1) * each])
        .collect())
}

/// One step's buffers on every rank.
struct TpStep<'a> {
    ranks: Vec<CpuStep<'a>>,
}

impl TpStep<'_> {
    /// Runs `f` on every rank with its part of `parts`.
    fn each<T: Sync>(
        &mut self,
        parts: &[T],
        f: impl Fn(&mut CpuStep<'_>, &T) -> R + Sync + Send,
    ) -> R {
        if parts.len() != self.ranks.len() {
            return Err(KernelError::Shape(format!(
                "{} parts for {} ranks",
                parts.len(),
                self.ranks.len()
            )));
        }
        (self.ranks.par_iter_mut())
            .zip(parts)
            .try_for_each(|(rank, part)| f(rank, part))
    }

    /// Each asking sequence's logits, the ranks' vocabulary parts joined in
    /// rank order.
    fn logits(self) -> Vec<Vec<f32>> {
        let mut ranks = self.ranks.into_iter().map(|r| r.logits);
        let mut joined = ranks.next().unwrap_or_default();
        for part in ranks {
            for (row, more) in joined.iter_mut().zip(part) {
                row.extend(more);
            }
        }
        joined
    }
}

impl<'w> Ops<'w> for TpStep<'_> {
    type W = Ranked;

    fn embed(&mut self, table: &'w Vec<kiln_kernels::matmul::Weight>) -> R {
        self.each(table, |r, t| r.embed(t))
    }

    fn norm(&mut self, w: &'w Vec<Vec<f32>>) -> R {
        self.each(w, |r, w| r.norm(w))
    }

    fn attention(
        &mut self,
        layer: usize,
        qkv: &'w Vec<Vec<kiln_kernels::matmul::Weight>>,
        bias: Option<&'w [Vec<Vec<f32>>; 3]>,
    ) -> R {
        let ranks: Vec<usize> = (0..self.ranks.len()).collect();
        self.each(&ranks, |r, i| {
            let bias = bias.map(|[q, k, v]| [&q[*i][..], &k[*i][..], &v[*i][..]]);
            r.attend(layer, &qkv[*i], bias)
        })
    }

    fn gated_mlp(&mut self, gate_up: &'w Vec<Vec<kiln_kernels::matmul::Weight>>) -> R {
        self.each(gate_up, |r, w| r.gated_mlp(w))
    }

    fn add_projection(
        &mut self,
        input: Input,
        w: &'w Vec<kiln_kernels::matmul::Weight>,
        next: &'w Vec<Vec<f32>>,
    ) -> R {
        self.each(w, |r, w| r.project(input, w))?;
        // The all-reduce: the parts summed in rank order, so every rank
        // (and every run) adds the same rounding.
        let (first, rest) = self
            .ranks
            .split_first_mut()
            .ok_or_else(|| KernelError::Shape("a step over no ranks".into()))?;
        for r in rest.iter() {
            add_assign(&mut first.proj, &r.proj);
        }
        for r in rest.iter_mut() {
            r.proj.copy_from_slice(&first.proj);
        }
        self.each(next, |r, next| r.add_projected(next))
    }

    fn head(&mut self, w: &'w Vec<kiln_kernels::matmul::Weight>) -> R {
        self.each(w, |r, w| r.head(w))
    }
}
