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

use std::ops::Range;

use kiln_kernels::KernelError;
use kiln_kernels::cuda::{CudaView, PARTITION, RopeKv, TagLayout, prefill_tiles};
use kiln_kernels::ops::RopeStyle;

use super::{GpuKv, GpuModel, Work};
use crate::model::llama::{BatchSeq, Draw};

type R<T> = Result<T, KernelError>;

/// Captured steps kept per engine.
const MAX_GRAPHS: usize = 128;

/// Captured decode steps above this many sequences run a batch size
/// rounded up to a multiple of it, so the sizes a full engine passes
/// through as sequences finish and join share a few captured graphs (and
/// the cuBLAS kernels picked for their shapes) instead of paying a first
/// eager run and a capture for each size.
const GRAPH_BUCKET: usize = 8;

/// The batch size a greedy decode step of `n` sequences runs as when
/// captured: `n` itself up to [`GRAPH_BUCKET`] (the GEMV's own sizes), then
/// `n` rounded up to a multiple of it, at most [`GRAPH_MAX_SEQS`].
fn graph_bucket(n: usize) -> usize {
    if n <= GRAPH_BUCKET || n > GRAPH_MAX_SEQS {
        n
    } else {
        n.next_multiple_of(GRAPH_BUCKET).min(GRAPH_MAX_SEQS)
    }
}

/// Most sequences a captured step may hold (cuBLAS runs on a fixed
/// workspace, so GEMMs are captured along with the custom kernels).
const GRAPH_MAX_SEQS: usize = 256;

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

/// The step's inputs, gathered from the batch.
#[derive(Default)]
struct Inputs {
    ids: Vec<u32>,
    pos: Vec<u32>,
    /// Each token's first block-table entry.
    offs: Vec<u32>,
    lens: Vec<u32>,
    slots: Vec<i32>,
    tables: Vec<u32>,
    seq_tab: Vec<u32>,
    tok_off: Vec<u32>,
    /// The token of each sequence that wants a result.
    wanted: Vec<u32>,
    /// How each of those results is chosen.
    draws: Vec<Draw>,
    /// Whether every sequence decodes one token, greedily.
    greedy_decode: bool,
}

/// Where each part sits in the step's buffer of 32-bit words. The sizes of
/// all parts but the last two depend only on the token, sequence and
/// tag-change counts; the expected tags and the tables, whose lengths vary
/// from step to step, come last.
struct Layout {
    changes: usize,
    change_cap: usize,
    ids: usize,
    pos: usize,
    offs: usize,
    lens: usize,
    slots: usize,
    seq_tab: usize,
    tok_off: usize,
    wanted: usize,
    params: usize,
    top_k: usize,
    expected: usize,
    tables: usize,
    tiles: usize,
    words: usize,
}

impl Layout {
    fn new(
        n: usize,
        seqs: usize,
        m: usize,
        change_cap: usize,
        table_cap: usize,
        tiles: usize,
    ) -> Self {
        let mut at = 0;
        let mut take = |len: usize| {
            let start = at;
            at += len;
            start
        };
        let changes = take(6 * change_cap);
        let (ids, pos, offs, lens, slots) = (take(n), take(n), take(n), take(n), take(n));
        let (seq_tab, tok_off, wanted) = (take(seqs + 1), take(seqs + 1), take(m));
        let (params, top_k) = (take(3 * m), take(m));
        // The expected tags are u64 pairs: 8-byte aligned.
        let odd = take(0) % 2;
        take(odd);
        let expected = take(4 * table_cap);
        let tables = take(table_cap + 1);
        let tiles = take(2 * tiles);
        let words = take(0);
        Self {
            changes,
            change_cap,
            ids,
            pos,
            offs,
            lens,
            slots,
            seq_tab,
            tok_off,
            wanted,
            params,
            top_k,
            expected,
            tables,
            tiles,
            words,
        }
    }

    fn tags(&self, check_masks: bool) -> TagLayout {
        TagLayout {
            expected: self.expected,
            tables: self.tables,
            seq_tab: self.seq_tab,
            tok_off: check_masks.then_some(self.tok_off),
            lens: check_masks.then_some(self.lens),
            slots: check_masks.then_some(self.slots),
        }
    }

    fn range(&self, start: usize, len: usize) -> Range<usize> {
        start..start + len
    }
}

fn u64_words(w: u64) -> [u32; 2] {
    [w as u32, (w >> 32) as u32]
}

fn put(words: &mut [u32], at: usize, v: impl IntoIterator<Item = u32>) {
    for (o, x) in words[at..].iter_mut().zip(v) {
        *o = x;
    }
}

/// `range` of `inputs` as i32.
fn ints<'a>(inputs: &'a CudaView<'a, u32>, range: Range<usize>) -> CudaView<'a, i32> {
    let len = range.len();
    let v = inputs.slice(range);
    // SAFETY: i32 and u32 have one size and alignment; every bit pattern
    // is valid in both.
    unsafe { v.transmute::<i32>(len) }.expect("same size")
}

impl Inputs {
    /// Pads a decode step to `to` sequences with empty ones: token 0 at
    /// position 0, no pages, attention over nothing, no KV write (slot -1),
    /// and a greedy result no one reads. Rows never mix in a decode step,
    /// so the real sequences compute what they would alone.
    fn pad_decode(&mut self, to: usize) {
        let empty = self.tables.len() as u32;
        while self.ids.len() < to {
            self.ids.push(0);
            self.pos.push(0);
            self.offs.push(empty);
            self.lens.push(0);
            self.slots.push(-1);
            self.seq_tab.push(empty);
            self.tok_off.push(self.ids.len() as u32);
            self.wanted.push(self.ids.len() as u32 - 1);
            self.draws.push(Draw::Greedy);
        }
    }
}

impl GpuModel {
    fn gather(&self, batch: &[BatchSeq<'_>], page_size: usize) -> R<Inputs> {
        let mut x = Inputs {
            seq_tab: vec![0],
            tok_off: vec![0],
            greedy_decode: true,
            ..Default::default()
        };
        for b in batch {
            let off = x.tables.len() as u32;
            x.tables.extend(b.pages.iter().copied());
            for (i, t) in b.tokens.iter().enumerate() {
                if *t as usize >= self.config.vocab {
                    return Err(KernelError::Shape(format!(
                        "token id {t} is outside the vocabulary"
                    )));
                }
                let at = b.start + i;
                x.ids.push(*t);
                x.pos.push(at as u32);
                let slot = b.pages[at / page_size] as usize * page_size + at % page_size;
                x.slots.push(if b.write_kv { slot as i32 } else { -1 });
                x.lens.push(at as u32 + 1);
                x.offs.push(off);
            }
            if b.logits && !b.tokens.is_empty() {
                x.wanted.push(x.ids.len() as u32 - 1);
                x.draws.push(b.draw);
            }
            x.greedy_decode &=
                b.tokens.len() == 1 && b.logits && b.draw == Draw::Greedy && b.write_kv;
            x.seq_tab.push(x.tables.len() as u32);
            x.tok_off.push(x.ids.len() as u32);
        }
        Ok(x)
    }

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
        let mut x = self.gather(batch, ps)?;
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
        let mut words = vec![0u32; l.words];
        let mut changes: Vec<u32> = tags
            .changes
            .iter()
            .flat_map(|(page, [g, t])| {
                let [a, b, d] = [*page as u64, *g, *t].map(u64_words);
                [a[0], a[1], b[0], b[1], d[0], d[1]]
            })
            .collect();
        // Padding entries name no page.
        changes.resize(6 * change_cap, u32::MAX);
        put(&mut words, l.changes, changes);
        put(&mut words, l.ids, x.ids.iter().copied());
        put(&mut words, l.pos, x.pos.iter().copied());
        put(&mut words, l.offs, x.offs.iter().copied());
        put(&mut words, l.lens, x.lens.iter().copied());
        put(&mut words, l.slots, x.slots.iter().map(|s| *s as u32));
        put(&mut words, l.seq_tab, x.seq_tab.iter().copied());
        put(&mut words, l.tok_off, x.tok_off.iter().copied());
        put(&mut words, l.wanted, x.wanted.iter().copied());
        for (i, d) in x.draws.iter().enumerate() {
            if let Draw::Sample { params, uniform } = d {
                let p = [params.temperature, params.top_p, *uniform];
                put(&mut words, l.params + 3 * i, p.map(f32::to_bits));
                put(&mut words, l.top_k + i, [params.top_k as u32]);
            }
        }
        put(&mut words, l.tiles, tiles.iter().map(|t| *t as u32));
        let expected = tags.expected.iter().flat_map(|t| {
            let [a, b] = t.map(u64_words);
            [a[0], a[1], b[0], b[1]]
        });
        put(&mut words, l.expected, expected);
        put(&mut words, l.tables, x.tables.iter().copied());
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
        let (scratch, abuf) = (&mut w.scratch, &mut w.abuf);
        g.embed_rows(&self.embed, &d_ids, h, n, c.hidden)?;
        let interleaved = c.rope_style == RopeStyle::Interleaved;
        let scale = 1.0 / (hd as f32).sqrt();
        for (li, (layer, pages)) in self.layers.iter().zip(kv.layers.iter_mut()).enumerate() {
            // h += the previous block's output, then the attention norm.
            // From two rows up, bf16 weights run cuBLAS on bf16 activations:
            // the norm and SiLU-mul write those straight into its scratch.
            let norm = (&mut *h, (li > 0).then_some(&*proj), &layer.attn_norm, c.eps);
            let at = RopeKv {
                slots: &d_slots,
                pos: &d_pos,
                inv_freq: &self.inv_freq,
                tokens: n,
                heads: c.heads,
                interleaved,
            };
            if layer.bias.is_none() && layer.qkv.stacks_on_cublas(g, n, c.hidden) {
                // One GEMM for q, k and v (cuBLAS fills the GPU far better
                // with the stack's 6144 rows than with k's or v's 1024).
                layer
                    .qkv
                    .apply_normed_stacked(g, norm, qkv, n, c.hidden, scratch)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_batches_round_up_to_a_multiple_of_eight_past_eight() {
        let got: Vec<usize> = [1, 8, 9, 16, 17, 123, 232, 255, 256, 300]
            .into_iter()
            .map(graph_bucket)
            .collect();
        assert_eq!(got, [1, 8, 16, 16, 24, 128, 232, 256, 256, 300]);
    }

    #[test]
    fn padded_sequences_have_no_pages_no_kv_write_and_nothing_to_attend() {
        let mut x = Inputs {
            ids: vec![5, 6],
            pos: vec![10, 3],
            offs: vec![0, 2],
            lens: vec![11, 4],
            slots: vec![42, 17],
            tables: vec![7, 8, 9],
            seq_tab: vec![0, 2, 3],
            tok_off: vec![0, 1, 2],
            wanted: vec![0, 1],
            draws: vec![Draw::Greedy; 2],
            greedy_decode: true,
        };
        x.pad_decode(4);
        assert_eq!(x.ids, [5, 6, 0, 0]);
        assert_eq!(x.lens, [11, 4, 0, 0]);
        assert_eq!(x.slots, [42, 17, -1, -1]);
        assert_eq!(x.offs, [0, 2, 3, 3]);
        assert_eq!(x.tables, [7, 8, 9], "no pages added");
        assert_eq!(x.seq_tab, [0, 2, 3, 3, 3], "empty tables");
        assert_eq!(x.tok_off, [0, 1, 2, 3, 4], "one token each");
        assert_eq!(x.wanted, [0, 1, 2, 3]);
        assert_eq!(x.draws.len(), 4);
    }
}
