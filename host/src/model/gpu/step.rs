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
use kiln_kernels::cuda::{PARTITION, RopeKv, prefill_tiles};
use kiln_kernels::ops::RopeStyle;

use super::inputs::{Inputs, Layout, graph_bucket, ints};
use super::{GpuKv, GpuModel, Work};
use crate::model::llama::{BatchSeq, Draw};

type R<T> = Result<T, KernelError>;

/// Captured steps kept per engine.
const MAX_GRAPHS: usize = 128;

/// Most sequences a captured step may hold (cuBLAS runs on a fixed
/// workspace, so GEMMs are captured along with the custom kernels).
pub(super) const GRAPH_MAX_SEQS: usize = 256;

/// Page tags for one step, each tag as (generation, tenant).
#[derive(Debug, Default, Clone, Copy)]
pub struct StepTags<'a> {
    /// The tag each block-table entry expects, sequences in batch order;
    /// empty when the check is off.
    pub expected: &'a [[u64; 2]],
    /// Pages given new tags since the last step.
    pub changes: &'a [(u32, [u64; 2])],
}

/// One sequence's result.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqOut {
    /// Its logits, to sample from.
    Logits(Vec<f32>),
    /// Its greedy token, chosen on the device.
    Token(u32),
}

/// What a step returns.
#[derive(Debug, Clone, Default)]
pub struct StepOut {
    /// One result per sequence that asked for one, in batch order.
    pub rows: Vec<SeqOut>,
    /// Per sequence of the batch: whether its pages passed the tag check.
    pub ok: Vec<bool>,
    /// How long the host waited on the device: the inputs' upload, the
    /// kernels (or the graph's replay) and the results' download.
    pub device: std::time::Duration,
}

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
    pub fn forward(
        &self,
        kv: &mut GpuKv,
        batch: &[BatchSeq<'_>],
        tags: StepTags<'_>,
    ) -> R<StepOut> {
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
        // Flash-style prefill when the step has a chunk of several tokens
        // (never a captured step: those decode one token a sequence).
        let tiles = if kv.flash_prefill && n > seqs {
            let offs: Vec<i32> = x.offs.iter().map(|o| *o as i32).collect();
            let lens: Vec<i32> = x.lens.iter().map(|l| *l as i32).collect();
            prefill_tiles(
                &offs,
                &lens,
                self.config.heads / self.config.kv_heads.max(1),
            )
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
        let step = Step {
            l: &l,
            n,
            seqs,
            m,
            max_len,
            check,
            sample: x.draws.iter().any(|d| matches!(d, Draw::Sample { .. })),
            tiles: tiles.len() / 2,
        };
        let result = self.run(kv, &mut work, &words, &step, key, &x.draws);
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
        s: &Step<'_>,
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
        let small = g.download_range(&w.small, 0..seqs + m)?;
        let device = start.elapsed();
        let ok: Vec<bool> = if s.check {
            small[..seqs].iter().map(|f| *f == 1).collect()
        } else {
            vec![true; seqs]
        };
        let logits = if draws.contains(&Draw::Logits) {
            g.download_range(&w.logits, 0..m * c.vocab)?
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
    /// scatter and check, the layers, the head and the argmax. Launches
    /// only (no copy, allocation or wait), so it can be captured.
    fn kernels(&self, kv: &mut GpuKv, w: &mut Work, s: &Step<'_>) -> R<()> {
        let c = &self.config;
        let g = &self.gpu;
        let (l, n, seqs, m) = (s.l, s.n, s.seqs, s.m);
        g.tag_scatter(&w.inputs, l.changes, l.change_cap, &mut kv.tags)?;
        if s.check {
            g.tag_check(
                &mut w.inputs,
                &l.tags(true),
                &kv.tags,
                &mut w.small.slice_mut(..seqs),
                seqs,
            )?;
        }
        let inputs = w.inputs.slice(..);
        let d_ids = inputs.slice(l.range(l.ids, n));
        let d_wanted = inputs.slice(l.range(l.wanted, m));
        let d_pos = ints(&inputs, l.range(l.pos, n));
        let d_tables = ints(&inputs, l.tables..l.words);
        let (d_offs, d_lens) = (
            ints(&inputs, l.range(l.offs, n)),
            ints(&inputs, l.range(l.lens, n)),
        );
        let d_slots = ints(&inputs, l.range(l.slots, n));
        let (hd, q_dim, kv_dim) = (c.head_dim, c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let (h, xn, q, k, v) = (&mut w.h, &mut w.xn, &mut w.q, &mut w.k, &mut w.v);
        let qkv = &mut w.qkv;
        let (attn, proj, gate, up) = (&mut w.attn, &mut w.proj, &mut w.gate, &mut w.up);
        let (scratch, abuf, sum) = (&mut w.scratch, &mut w.abuf, &mut w.norm_sum);
        g.embed_rows(&self.embed, &d_ids, h, n, c.hidden)?;
        let interleaved = c.rope_style == RopeStyle::Interleaved;
        let scale = 1.0 / (hd as f32).sqrt();
        // Folded (one token, bf16 weights): past layer 0, xn holds the
        // hidden row times the norm's weights and `sum` its sum of squares,
        // and h is always up to date (see fold.rs).
        let folds = self.folds(n);
        for (li, (layer, pages)) in self.layers.iter().zip(kv.layers.iter_mut()).enumerate() {
            let folded = layer.folded(c).filter(|_| folds);
            let at = RopeKv {
                slots: &d_slots,
                pos: &d_pos,
                inv_freq: &self.inv_freq,
                tokens: n,
                heads: c.heads,
                interleaved,
            };
            // h += the previous block's output, then the attention norm.
            // From two rows up, bf16 weights run cuBLAS on bf16 activations:
            // the norm and SiLU-mul write those straight into its scratch.
            let residual = (li > 0 && folded.is_none()).then_some(&*proj);
            let norm = (&mut *h, residual, &layer.attn_norm, c.eps);
            let stack = layer.qkv.cublas_stack(g, n, c.hidden);
            if let Some(f) = folded.as_ref().filter(|_| li > 0) {
                let outs = &mut [&mut *q, &mut *k, &mut *v];
                g.gemv_bf16_normed(xn, f.qkv, sum, outs, f.qkv_parts, c.hidden, c.eps)?;
                g.rope_kv_write(pages, q, k, v, &at)?;
            } else if let Some(stack) = stack.filter(|_| layer.bias.is_none()) {
                // One GEMM for q, k and v (cuBLAS fills the GPU far better
                // with the stack's 6144 rows than with k's or v's 1024).
                stack.apply_normed(g, norm, qkv, scratch)?;
                g.rope_kv_write_stacked(pages, qkv, q, &at)?;
            } else {
                let outs = &mut [&mut *q, &mut *k, &mut *v];
                layer
                    .qkv
                    .apply_normed(g, norm, xn, outs, n, c.hidden, scratch)?;
                if let Some([bq, bk, bv]) = &layer.bias {
                    g.add_bias(q, bq, n, q_dim)?;
                    g.add_bias(k, bk, n, kv_dim)?;
                    g.add_bias(v, bv, n, kv_dim)?;
                }
                g.rope_kv_write(pages, q, k, v, &at)?;
            }
            if s.tiles > 0 {
                let d_tiles = ints(&inputs, l.range(l.tiles, 2 * s.tiles));
                g.prefill_attention(
                    pages, q, &d_tables, &d_offs, &d_lens, &d_tiles, attn, c.heads, scale,
                )?;
            } else {
                g.paged_attention(
                    pages,
                    q,
                    &d_tables,
                    &d_offs,
                    &d_lens,
                    abuf,
                    attn,
                    n,
                    c.heads,
                    s.max_len,
                    scale,
                    Default::default(),
                )?;
            }
            if let Some(f) = &folded {
                // h += o, then the FFN norm folded into gate/up, and the
                // next norm (the next layer's, or the final one) into down.
                let ffn_norm = &layer.ffn_norm;
                g.gemv_bf16_resid(attn, f.wo, h, ffn_norm, xn, sum, c.hidden, q_dim)?;
                g.gemv_bf16_normed_silu(xn, f.gate_up, sum, gate, c.ffn, c.hidden, c.eps)?;
                let next = self.layers.get(li + 1).map_or(&self.norm, |l| &l.attn_norm);
                g.gemv_bf16_resid(gate, f.down, h, next, xn, sum, c.hidden, c.ffn)?;
                continue;
            }
            g.matmul(attn, &layer.wo, proj, n, c.hidden, q_dim, scratch)?;
            let gate_up = &mut [&mut *gate, &mut *up];
            let norm = (&mut *h, Some(&*proj), &layer.ffn_norm, c.eps);
            layer
                .gate_up
                .apply_normed(g, norm, xn, gate_up, n, c.hidden, scratch)?;
            if g.takes_bf16_input(&layer.w_down, n, c.ffn) {
                g.silu_mul_bf16(gate, up, scratch, n * c.ffn)?;
                let down = &layer.w_down;
                g.matmul_parts_bf16(down, &mut [&mut *proj], &[c.hidden], n, c.ffn, scratch)?;
            } else {
                g.silu_mul(gate, up, n * c.ffn)?;
                g.matmul(gate, &layer.w_down, proj, n, c.hidden, c.ffn, scratch)?;
            }
        }
        if m > 0 {
            if folds {
                // One token, so its row is the one wanted.
                self.folded_head(g, xn, sum, &mut w.logits)?;
            } else {
                g.rmsnorm_residual(h, Some(&*proj), &self.norm, xn, n, c.hidden, c.eps)?;
                // Decode wants every token's row, already in place.
                let rows = if m == n {
                    &*xn
                } else {
                    g.gather_rows(xn, &d_wanted, &mut w.last, m, c.hidden)?;
                    &w.last
                };
                let out_w = self.output.as_ref().unwrap_or(&self.embed);
                g.matmul(rows, out_w, &mut w.logits, m, c.vocab, c.hidden, scratch)?;
            }
            let mut picks = w.small.slice_mut(seqs..seqs + m);
            if s.sample {
                let params = inputs.slice(l.range(l.params, 3 * m));
                // SAFETY: the words hold f32 bit patterns (`f32::to_bits`).
                let params = unsafe { params.transmute::<f32>(3 * m) }.expect("same size");
                let top_k = ints(&inputs, l.range(l.top_k, m));
                g.sample_rows(&w.logits, m, c.vocab, &params, &top_k, &mut picks)?;
            } else {
                g.argmax_rows(&w.logits, m, c.vocab, &mut picks)?;
            }
        }
        Ok(())
    }
}

/// A step's shape, as the launches see it.
struct Step<'a> {
    l: &'a Layout,
    n: usize,
    seqs: usize,
    m: usize,
    max_len: usize,
    check: bool,
    /// Whether some result is sampled on the device (else argmax).
    sample: bool,
    /// Flash-style prefill tiles (none: decode attention per token).
    tiles: usize,
}
