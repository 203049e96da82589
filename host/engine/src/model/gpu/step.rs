//! One forward step on the GPU. Everything the step needs from the host
//! (token ids, positions, block tables, KV slots, expected page tags, tag
//! changes) goes up in one copy; what comes back is one small copy (each
//! sequence's tag-check flag and the greedy tokens), plus the logits rows
//! when some sequence samples from them.
//!
//! The page-tag check is a kernel at the head of the step: a sequence whose
//! pages no longer carry the tags it recorded gets its attention lengths
//! and KV slots cleared on the device, so the rest of the step neither
//! reads nor writes its pages, and its flag tells the engine to abort it.
//!
//! With CUDA graphs on, a small greedy decode step is captured once per
//! (sequences, attention partitions, check) and replayed: its inputs sit at
//! offsets fixed by those three, in buffers that live as long as the graph.

use kiln_kernels::KernelError;
use kiln_kernels::cuda::{PARTITION, prefill_supports, prefill_tiles};

use super::inputs::{GRAPH_MAX_SEQS, Inputs, Layout, graph_bucket};
use super::ops::{CudaStep, Shape};
use super::{GpuKv, GpuModel, Work};
use crate::model::step::{Draw, SeqOut, Step, StepOut, StepTags};

type R<T> = Result<T, KernelError>;

/// Captured steps kept per engine.
const MAX_GRAPHS: usize = 128;

/// What identifies a captured step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct GraphKey {
    seqs: usize,
    parts: usize,
    check: bool,
}

impl GpuModel {
    /// The key to capture this step under, when it can be one: a greedy
    /// decode of at most [`GRAPH_MAX_SEQS`] sequences, with room for its
    /// tag changes.
    fn graph_key(
        &self,
        x: &Inputs,
        tags: &StepTags<'_>,
        max_len: usize,
        page_size: usize,
    ) -> Option<GraphKey> {
        let n = x.ids.len();
        let parts = max_len.div_ceil(PARTITION);
        // The tables must fit the room the key's lengths give them (a
        // table holding pages past its length takes the eager path).
        let room = n * (parts * PARTITION).div_ceil(page_size);
        (self.graphs
            && x.greedy_decode
            && n <= GRAPH_MAX_SEQS
            && tags.changes.len() <= n
            && x.tables.len() <= room)
            .then_some(GraphKey {
                seqs: n,
                parts,
                check: !tags.expected.is_empty(),
            })
    }

    /// One step: checks page tags, writes the new tokens' K and V into their
    /// pages and returns each result the batch asked for.
    pub fn forward(&self, kv: &mut GpuKv, step: &Step<'_>) -> R<StepOut> {
        let (batch, tags) = (&step.seqs[..], step.tags);
        let ps = kv.page_size;
        let mut x = Inputs::gather(batch, ps, self.config.vocab)?;
        let (real_seqs, real_m) = (batch.len(), x.wanted.len());
        if self.graphs && x.greedy_decode {
            x.pad_decode(graph_bucket(x.ids.len()));
        }
        let (n, seqs, m) = (x.ids.len(), x.seq_tab.len() - 1, x.wanted.len());
        let check = !tags.expected.is_empty();
        if check && tags.expected.len() != x.tables.len() {
            return Err(KernelError::Shape(format!(
                "{} expected tags for {} block-table entries",
                tags.expected.len(),
                x.tables.len()
            )));
        }
        if n == 0 {
            return Ok(StepOut {
                rows: Vec::new(),
                ok: vec![true; seqs],
                device: Default::default(),
            });
        }
        let mut max_len = x.lens.iter().copied().max().unwrap_or(1) as usize;
        let key = self.graph_key(&x, &tags, max_len, ps);
        let (change_cap, table_cap) = match key {
            Some(k) => {
                // Room for the longest tables the key's lengths allow.
                max_len = k.parts * PARTITION;
                (n, n * max_len.div_ceil(ps))
            }
            None => (tags.changes.len(), x.tables.len()),
        };
        // Tensor-core prefill attention when the step has a chunk of
        // several tokens (never a captured step: those decode one token a
        // sequence). The step's leading decodes still run the decode
        // kernel, which splits each sequence over the whole GPU; as tiles
        // of one token, a block would stream a whole sequence for one warp.
        let c = &self.config;
        let (mut decodes, mut decode_len) = (0, 0);
        let tiles =
            if kv.tensor_prefill && n > seqs && prefill_supports(c.heads, c.kv_heads, c.head_dim) {
                (decodes, decode_len) = x.leading_single_rows();
                let offs: Vec<i32> = x.offs[decodes..].iter().map(|o| *o as i32).collect();
                let lens: Vec<i32> = x.lens[decodes..].iter().map(|l| *l as i32).collect();
                let mut tiles = prefill_tiles(
                    &offs,
                    &lens,
                    self.config.heads / self.config.kv_heads.max(1),
                    self.gpu.prefill_rows(),
                );
                // Token indices of the whole step.
                tiles
                    .iter_mut()
                    .step_by(2)
                    .for_each(|t| *t += decodes as i32);
                tiles
            } else {
                Vec::new()
            };
        let l = Layout::new(n, seqs, m, change_cap, table_cap, tiles.len() / 2);
        let words = l.words(&x, &tags, &tiles);
        let mut work = self.work(&mut kv.work, n, max_len, seqs, l.words)?;
        if std::mem::take(&mut work.fresh) {
            // Captured steps point into the buffers just replaced.
            kv.graphs.clear();
        }
        let shape = Shape {
            l: &l,
            n,
            seqs,
            m,
            max_len,
            check,
            sample: x.draws.iter().any(|d| matches!(d, Draw::Sample { .. })),
            tiles: tiles.len() / 2,
            decodes,
            decode_len,
        };
        let result = self.run(kv, &mut work, &words, &shape, key, &x.draws);
        kv.work = Some(work);
        // The padding's flags and tokens are nobody's.
        result.map(|mut out| {
            out.ok.truncate(real_seqs);
            out.rows.truncate(real_m);
            out
        })
    }

    /// Uploads the inputs, runs (or replays) the step, downloads results.
    fn run(
        &self,
        kv: &mut GpuKv,
        w: &mut Work,
        words: &[u32],
        s: &Shape<'_>,
        key: Option<GraphKey>,
        draws: &[Draw],
    ) -> R<StepOut> {
        let c = &self.config;
        let g = &self.gpu;
        let start = std::time::Instant::now();
        g.upload_into(words, &mut w.inputs)?;
        // A shape is captured the second time it comes: one seen once (a
        // batch size passed through while sequences join or finish) would
        // pay for a capture it never replays.
        let key = key.filter(|k| kv.graphs.contains_key(k) || !kv.seen.insert(*k));
        match key {
            Some(k) => {
                if !kv.graphs.contains_key(&k) {
                    if kv.graphs.len() >= MAX_GRAPHS {
                        // Old shapes (shorter contexts, other batch sizes)
                        // are unlikely to come back.
                        kv.graphs.clear();
                        kv.seen.clear();
                    }
                    let graph = g.capture(|| self.kernels(kv, w, s))?;
                    kv.graphs.insert(k, graph);
                }
                g.replay(&kv.graphs[&k])?;
            }
            None => self.kernels(kv, w, s)?,
        }
        let (seqs, m) = (s.seqs, s.m);
        let small = g.download_range(&w.b.small, 0..seqs + m)?;
        let device = start.elapsed();
        let ok: Vec<bool> = if s.check {
            small[..seqs].iter().map(|f| *f == 1).collect()
        } else {
            vec![true; seqs]
        };
        let logits = if draws.contains(&Draw::Logits) {
            g.download_range(&w.b.logits, 0..m * c.vocab)?
        } else {
            Vec::new()
        };
        let rows = draws
            .iter()
            .enumerate()
            .map(|(i, d)| match d {
                Draw::Logits => SeqOut::Logits(logits[i * c.vocab..(i + 1) * c.vocab].to_vec()),
                Draw::Greedy | Draw::Sample { .. } => SeqOut::Token(small[seqs + i]),
            })
            .collect();
        Ok(StepOut { rows, ok, device })
    }

    /// Every launch of a step, reading its inputs from `w.inputs`: the tag
    /// scatter and check, then the architecture's forward pass. Launches
    /// only (no copy, allocation or wait), so it can be captured.
    fn kernels(&self, kv: &mut GpuKv, w: &mut Work, s: &Shape<'_>) -> R<()> {
        let (g, l, seqs) = (&self.gpu, s.l, s.seqs);
        g.tag_scatter(&w.inputs, l.changes, l.change_cap, &mut kv.tags)?;
        if s.check {
            g.tag_check(
                &mut w.inputs,
                &l.tags(true),
                &kv.tags,
                &mut w.b.small.slice_mut(..seqs),
                seqs,
            )?;
        }
        let mut ops = CudaStep::new(self, &mut kv.layers, w, s);
        self.config.arch.forward(&mut ops, &self.weights)
    }
}
