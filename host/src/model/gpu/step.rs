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

use std::ops::Range;

use kiln_kernels::KernelError;
use kiln_kernels::cuda::{CudaView, TagLayout};
use kiln_kernels::ops::RopeStyle;

use super::{GpuKv, GpuModel, Work};
use crate::model::llama::BatchSeq;

type R<T> = Result<T, KernelError>;

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
}

/// The step's host-side input words and where each part sits.
#[derive(Default)]
struct Packed {
    words: Vec<u32>,
    tags: TagLayout,
    changes: usize,
    n_changes: usize,
    ids: Range<usize>,
    pos: Range<usize>,
    tables: Range<usize>,
    offs: Range<usize>,
    lens: Range<usize>,
    slots: Range<usize>,
    wanted: Range<usize>,
}

impl Packed {
    fn push(&mut self, v: impl IntoIterator<Item = u32>) -> Range<usize> {
        let start = self.words.len();
        self.words.extend(v);
        start..self.words.len()
    }
}

fn u64_words(w: u64) -> [u32; 2] {
    [w as u32, (w >> 32) as u32]
}

/// `range` of `inputs` as i32.
fn ints<'a>(inputs: &'a CudaView<'a, u32>, range: &Range<usize>) -> CudaView<'a, i32> {
    let v = inputs.slice(range.clone());
    // SAFETY: i32 and u32 have one size and alignment; every bit pattern
    // is valid in both.
    unsafe { v.transmute::<i32>(range.len()) }.expect("same size")
}

impl GpuModel {
    /// One step: checks page tags, writes the new tokens' K and V into their
    /// pages and returns each result the batch asked for.
    pub fn forward(
        &self,
        kv: &mut GpuKv,
        batch: &[BatchSeq<'_>],
        tags: StepTags<'_>,
    ) -> R<StepOut> {
        let c = &self.config;
        let ps = kv.page_size;
        let check = !tags.expected.is_empty();
        let mut p = Packed::default();
        // 8-byte data first: expected tags, tag changes.
        p.tags.expected = p
            .push(tags.expected.iter().flat_map(|t| {
                let [a, b] = t.map(u64_words);
                [a[0], a[1], b[0], b[1]]
            }))
            .start;
        p.changes = p
            .push(tags.changes.iter().flat_map(|(page, [g, t])| {
                let [a, b, d] = [*page as u64, *g, *t].map(u64_words);
                [a[0], a[1], b[0], b[1], d[0], d[1]]
            }))
            .start;
        p.n_changes = tags.changes.len();
        let (mut ids, mut pos, mut slots, mut lens, mut offs) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut tables, mut seq_tab, mut tok_off, mut wanted) =
            (Vec::new(), vec![0u32], vec![0u32], Vec::new());
        let mut greedy = Vec::new();
        for b in batch {
            let off = tables.len() as u32;
            tables.extend(b.pages.iter().copied());
            for (i, t) in b.tokens.iter().enumerate() {
                if *t as usize >= c.vocab {
                    return Err(KernelError::Shape(format!(
                        "token id {t} is outside the vocabulary"
                    )));
                }
                let at = b.start + i;
                ids.push(*t);
                pos.push(at as u32);
                let slot = b.pages[at / ps] as usize * ps + at % ps;
                slots.push(if b.write_kv { slot as i32 } else { -1 });
                lens.push(at as u32 + 1);
                offs.push(off);
            }
            if b.logits && !b.tokens.is_empty() {
                wanted.push(ids.len() as u32 - 1);
                greedy.push(b.greedy);
            }
            seq_tab.push(tables.len() as u32);
            tok_off.push(ids.len() as u32);
        }
        let n = ids.len();
        if tags.expected.len() != if check { tables.len() } else { 0 } {
            return Err(KernelError::Shape(format!(
                "{} expected tags for {} block-table entries",
                tags.expected.len(),
                tables.len()
            )));
        }
        if n == 0 {
            return Ok(StepOut {
                rows: Vec::new(),
                ok: vec![true; batch.len()],
            });
        }
        tables.push(0);
        p.ids = p.push(ids);
        p.pos = p.push(pos);
        p.tables = p.push(tables);
        p.tags.tables = p.tables.start;
        p.offs = p.push(offs);
        p.lens = p.push(lens.iter().copied());
        p.slots = p.push(slots.iter().map(|s| *s as u32));
        p.tags.seq_tab = p.push(seq_tab).start;
        p.tags.tok_off = Some(p.push(tok_off).start);
        p.tags.lens = Some(p.lens.start);
        p.tags.slots = Some(p.slots.start);
        p.wanted = p.push(wanted.iter().copied());
        let max_len = lens.iter().copied().max().unwrap_or(1) as usize;
        let mut work = self.work(&mut kv.work, n, max_len, batch.len(), p.words.len())?;
        let result = self.run(kv, &mut work, &p, n, max_len, batch.len(), check, &greedy);
        kv.work = Some(work);
        result
    }

    /// Uploads the inputs, runs the check, the layers and the head.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        kv: &mut GpuKv,
        w: &mut Work,
        p: &Packed,
        n: usize,
        max_len: usize,
        seqs: usize,
        check: bool,
        greedy: &[bool],
    ) -> R<StepOut> {
        let c = &self.config;
        let g = &self.gpu;
        g.upload_into(&p.words, &mut w.inputs)?;
        g.tag_scatter(&w.inputs, p.changes, p.n_changes, &mut kv.tags)?;
        if check {
            g.tag_check(
                &mut w.inputs,
                &p.tags,
                &kv.tags,
                &mut w.small.slice_mut(..seqs),
                seqs,
            )?;
        }
        let inputs = w.inputs.slice(..);
        let (d_ids, d_wanted) = (inputs.slice(p.ids.clone()), inputs.slice(p.wanted.clone()));
        let (d_pos, d_tables) = (ints(&inputs, &p.pos), ints(&inputs, &p.tables));
        let (d_offs, d_lens) = (ints(&inputs, &p.offs), ints(&inputs, &p.lens));
        let d_slots = ints(&inputs, &p.slots);
        let (hd, q_dim, kv_dim) = (c.head_dim, c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let (h, xn, q, k, v) = (&mut w.h, &mut w.xn, &mut w.q, &mut w.k, &mut w.v);
        let (attn, proj, gate, up) = (&mut w.attn, &mut w.proj, &mut w.gate, &mut w.up);
        let (scratch, abuf) = (&mut w.scratch, &mut w.abuf);
        g.embed_rows(&self.embed, &d_ids, h, n, c.hidden)?;
        let interleaved = c.rope_style == RopeStyle::Interleaved;
        let scale = 1.0 / (hd as f32).sqrt();
        for (li, (layer, pages)) in self.layers.iter().zip(kv.layers.iter_mut()).enumerate() {
            // h += the previous block's output, then the attention norm.
            let residual = (li > 0).then_some(&*proj);
            g.rmsnorm_residual(h, residual, &layer.attn_norm, xn, n, c.hidden, c.eps)?;
            g.matmul(xn, &layer.wq, q, n, q_dim, c.hidden, scratch)?;
            g.matmul(xn, &layer.wk, k, n, kv_dim, c.hidden, scratch)?;
            g.matmul(xn, &layer.wv, v, n, kv_dim, c.hidden, scratch)?;
            if let Some([bq, bk, bv]) = &layer.bias {
                g.add_bias(q, bq, n, q_dim)?;
                g.add_bias(k, bk, n, kv_dim)?;
                g.add_bias(v, bv, n, kv_dim)?;
            }
            g.rope(q, &d_pos, &self.inv_freq, n, c.heads, hd, interleaved)?;
            g.rope(k, &d_pos, &self.inv_freq, n, c.kv_heads, hd, interleaved)?;
            g.kv_write(pages, k, v, &d_slots, n)?;
            g.paged_attention(
                pages, q, &d_tables, &d_offs, &d_lens, abuf, attn, n, c.heads, max_len, scale,
            )?;
            g.matmul(attn, &layer.wo, proj, n, c.hidden, q_dim, scratch)?;
            g.rmsnorm_residual(h, Some(&*proj), &layer.ffn_norm, xn, n, c.hidden, c.eps)?;
            g.matmul(xn, &layer.w_gate, gate, n, c.ffn, c.hidden, scratch)?;
            g.matmul(xn, &layer.w_up, up, n, c.ffn, c.hidden, scratch)?;
            g.silu_mul(gate, up, n * c.ffn)?;
            g.matmul(gate, &layer.w_down, proj, n, c.hidden, c.ffn, scratch)?;
        }
        let m = greedy.len();
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
            g.argmax_rows(
                &w.logits,
                m,
                c.vocab,
                &mut w.small.slice_mut(seqs..seqs + m),
            )?;
        }
        let small = g.download_range(&w.small, 0..seqs + m)?;
        let ok: Vec<bool> = if check {
            small[..seqs].iter().map(|f| *f == 1).collect()
        } else {
            vec![true; seqs]
        };
        let logits = if greedy.iter().all(|x| *x) {
            Vec::new()
        } else {
            g.download_range(&w.logits, 0..m * c.vocab)?
        };
        let rows = greedy
            .iter()
            .enumerate()
            .map(|(i, gr)| {
                if *gr {
                    SeqOut::Token(small[seqs + i])
                } else {
                    SeqOut::Logits(logits[i * c.vocab..(i + 1) * c.vocab].to_vec())
                }
            })
            .collect();
        Ok(StepOut { rows, ok })
    }
}
