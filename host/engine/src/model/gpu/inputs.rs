//! A step's inputs: gathered from the batch (padded to a captured batch
//! size where graphs run), laid out in one buffer of 32-bit words so they
//! go up in one copy, at offsets a captured step can keep.

use std::ops::Range;

use kiln_kernels::KernelError;
use kiln_kernels::cuda::{CudaView, TagLayout};

use crate::model::step::{Draw, StepSeq, StepTags};

type R<T> = Result<T, KernelError>;

/// Most sequences a captured step may hold (cuBLAS runs on a fixed
/// workspace, so GEMMs are captured along with the custom kernels).
pub(super) const GRAPH_MAX_SEQS: usize = 256;

/// Captured decode steps above this many sequences run a batch size
/// rounded up to a multiple of it, so the sizes a full engine passes
/// through as sequences finish and join share a few captured graphs (and
/// the cuBLAS kernels picked for their shapes) instead of paying a first
/// eager run and a capture for each size.
const GRAPH_BUCKET: usize = 8;

/// The batch size a greedy decode step of `n` sequences runs as when
/// captured: `n` itself up to [`GRAPH_BUCKET`] (the GEMV's own sizes), then
/// `n` rounded up to a multiple of it, at most [`GRAPH_MAX_SEQS`].
pub(super) fn graph_bucket(n: usize) -> usize {
    if n <= GRAPH_BUCKET || n > GRAPH_MAX_SEQS {
        n
    } else {
        n.next_multiple_of(GRAPH_BUCKET).min(GRAPH_MAX_SEQS)
    }
}

/// Every batch size [`graph_bucket`] gives for steps of 1 to `most`
/// sequences, in order.
pub(super) fn decode_buckets(most: usize) -> impl Iterator<Item = usize> {
    let mut last = 0;
    (1..=most.min(GRAPH_MAX_SEQS)).filter_map(move |n| {
        let b = graph_bucket(n);
        (b != last).then(|| {
            last = b;
            b
        })
    })
}

/// The step's inputs, gathered from the batch.
#[derive(Default)]
pub(super) struct Inputs {
    /// Each token's id.
    pub(super) ids: Vec<u32>,
    /// Each token's position in its sequence.
    pub(super) pos: Vec<u32>,
    /// Each token's first block-table entry.
    pub(super) offs: Vec<u32>,
    /// Tokens each token attends to (its position + 1).
    pub(super) lens: Vec<u32>,
    /// Each token's KV slot (-1: write nothing).
    pub(super) slots: Vec<i32>,
    /// Every sequence's pages, one table after another.
    pub(super) tables: Vec<u32>,
    /// Sequence s's table entries are seq_tab[s]..seq_tab[s + 1].
    pub(super) seq_tab: Vec<u32>,
    /// Sequence s's tokens are tok_off[s]..tok_off[s + 1].
    pub(super) tok_off: Vec<u32>,
    /// The token of each sequence that wants a result.
    pub(super) wanted: Vec<u32>,
    /// How each of those results is chosen.
    pub(super) draws: Vec<Draw>,
    /// Each result's output-format mask among `masks` (-1: none).
    pub(super) mask_slot: Vec<i32>,
    /// The masks, [`Inputs::mask_words`] words each.
    pub(super) masks: Vec<u32>,
    /// Each result's log-probability slot (-1: none asked).
    pub(super) score_slot: Vec<i32>,
    /// Most likely tokens each slot holds (the most any result asked).
    pub(super) score_top: usize,
    /// Words of one mask: the longest mask's, rounded up to a power of
    /// two (so captured steps see few sizes), at most the vocabulary's.
    pub(super) mask_words: usize,
    /// Whether every sequence decodes one token, greedily.
    pub(super) greedy_decode: bool,
}

/// Where each part sits in the step's buffer of 32-bit words. The sizes of
/// all parts but the last two depend only on the token, sequence and
/// tag-change counts; the expected tags and the tables, whose lengths vary
/// from step to step, come last.
pub(super) struct Layout {
    pub(super) changes: usize,
    pub(super) change_cap: usize,
    pub(super) ids: usize,
    pub(super) pos: usize,
    pub(super) offs: usize,
    pub(super) lens: usize,
    pub(super) slots: usize,
    pub(super) seq_tab: usize,
    pub(super) tok_off: usize,
    pub(super) wanted: usize,
    pub(super) params: usize,
    pub(super) top_k: usize,
    pub(super) expected: usize,
    pub(super) tables: usize,
    pub(super) tiles: usize,
    pub(super) mask_slot: usize,
    pub(super) score_slot: usize,
    pub(super) masks: usize,
    /// The words [`Layout::words`] fills (the masks' start).
    pub(super) words: usize,
    /// The input buffer's length, masks included.
    pub(super) total: usize,
}

impl Layout {
    /// The layout of a step of `n` tokens, `seqs` sequences and `m`
    /// results, with room for `change_cap` tag changes, `table_cap` table
    /// entries, `tiles` prefill tiles and `mask_cap` words of masks.
    pub(super) fn new(
        n: usize,
        seqs: usize,
        m: usize,
        (change_cap, table_cap): (usize, usize),
        tiles: usize,
        mask_cap: usize,
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
        let mask_slot = take(m);
        let score_slot = take(m);
        // The masks go up in a copy of their own: the buffer of words
        // stops before them.
        let words = take(0);
        let masks = take(mask_cap);
        let total = take(0);
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
            mask_slot,
            score_slot,
            masks,
            words,
            total,
        }
    }

    /// The step's buffer of words: `x`, the tag changes and expected tags,
    /// the prefill tiles, each where this layout puts it.
    pub(super) fn words(&self, x: &Inputs, tags: &StepTags<'_>, tiles: &[i32]) -> Vec<u32> {
        let (l, change_cap) = (self, self.change_cap);
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
        put(
            &mut words,
            l.mask_slot,
            x.mask_slot.iter().map(|s| *s as u32),
        );
        put(
            &mut words,
            l.score_slot,
            x.score_slot.iter().map(|s| *s as u32),
        );
        words
    }

    /// Where the tag check finds its inputs (and, with `check_masks`, the
    /// lengths and slots it clears for a sequence that fails).
    pub(super) fn tags(&self, check_masks: bool) -> TagLayout {
        TagLayout {
            expected: self.expected,
            tables: self.tables,
            seq_tab: self.seq_tab,
            tok_off: check_masks.then_some(self.tok_off),
            lens: check_masks.then_some(self.lens),
            slots: check_masks.then_some(self.slots),
        }
    }

    /// `len` words from `start`.
    pub(super) fn range(&self, start: usize, len: usize) -> Range<usize> {
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
pub(super) fn ints<'a>(inputs: &'a CudaView<'a, u32>, range: Range<usize>) -> CudaView<'a, i32> {
    let len = range.len();
    let v = inputs.slice(range);
    // SAFETY: i32 and u32 have one size and alignment; every bit pattern
    // is valid in both.
    unsafe { v.transmute::<i32>(len) }.expect("same size")
}

impl Inputs {
    /// The step's inputs for `batch`, with pages of `page_size` tokens and a
    /// vocabulary of `vocab` token ids.
    pub(super) fn gather(batch: &[StepSeq<'_>], page_size: usize, vocab: usize) -> R<Inputs> {
        let mut x = Self {
            seq_tab: vec![0],
            tok_off: vec![0],
            greedy_decode: true,
            ..Default::default()
        };
        let longest = (batch.iter().filter_map(|b| b.mask.map(<[u32]>::len))).max();
        if let Some(l) = longest {
            x.mask_words = l.max(1).next_power_of_two().min(vocab.div_ceil(32));
        }
        for b in batch {
            let off = x.tables.len() as u32;
            x.tables.extend(b.pages.iter().copied());
            for (i, t) in b.tokens.iter().enumerate() {
                if *t as usize >= vocab {
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
                x.mask_slot.push(match b.mask {
                    Some(m) => {
                        let slot = x.masks.len() / x.mask_words;
                        let at = x.masks.len();
                        x.masks.extend(m.iter().take(x.mask_words));
                        x.masks.resize(at + x.mask_words, 0);
                        slot as i32
                    }
                    None => -1,
                });
                x.score_slot.push(match b.scores {
                    Some(top) => {
                        x.score_top = x.score_top.max(top);
                        x.score_slot.iter().filter(|s| **s >= 0).count() as i32
                    }
                    None => -1,
                });
            }
            // Steps that score their tokens are never captured.
            x.greedy_decode &= b.tokens.len() == 1
                && b.logits
                && b.draw == Draw::Greedy
                && b.write_kv
                && b.scores.is_none();
            x.seq_tab.push(x.tables.len() as u32);
            x.tok_off.push(x.ids.len() as u32);
        }
        Ok(x)
    }

    /// Whether some result is drawn within an output format's mask.
    pub(super) fn masked(&self) -> bool {
        !self.masks.is_empty()
    }

    /// The sequences at the head of the batch that compute one token each
    /// (decodes come first in a step): their tokens are rows `0..d`, one
    /// per sequence, which the decode attention kernel takes as a batch of
    /// `d`. Returns `d` and the longest span among them.
    pub(super) fn leading_single_rows(&self) -> (usize, usize) {
        let d = self
            .tok_off
            .windows(2)
            .take_while(|w| w[1] - w[0] == 1)
            .count();
        let longest = self.lens[..d].iter().max().map_or(0, |l| *l as usize);
        (d, longest)
    }

    /// Pads a decode step to `to` sequences with empty ones: token 0 at
    /// position 0, no pages, attention over nothing, no KV write (slot -1),
    /// and a greedy result no one reads. Rows never mix in a decode step,
    /// so the real sequences compute what they would alone.
    pub(super) fn pad_decode(&mut self, to: usize) {
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
            self.mask_slot.push(-1);
            self.score_slot.push(-1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_buckets_are_each_size_a_captured_step_pads_to() {
        let b: Vec<usize> = decode_buckets(40).collect();
        assert_eq!(b, [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40]);
        assert_eq!(decode_buckets(1000).last(), Some(GRAPH_MAX_SEQS));
        assert_eq!(decode_buckets(1000).count(), 8 + GRAPH_MAX_SEQS / 8 - 1);
    }

    #[test]
    fn a_mixed_steps_leading_decodes_are_its_single_rows() {
        let batch = [
            seq(&[5], 20, &[0, 1]),
            seq(&[6], 40, &[2, 3, 4]),
            seq(&[7, 8, 9], 0, &[5]),
            seq(&[3], 9, &[6]),
        ];
        let x = Inputs::gather(&batch, 16, 100).unwrap();
        // The last one-token sequence follows a prompt chunk: it stays
        // with the chunk.
        assert_eq!(x.leading_single_rows(), (2, 41));
        let chunk_first = Inputs::gather(&batch[2..], 16, 100).unwrap();
        assert_eq!(chunk_first.leading_single_rows(), (0, 0));
    }

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
            mask_slot: vec![-1, 0],
            masks: vec![7],
            mask_words: 1,
            score_slot: vec![-1, -1],
            score_top: 0,
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
        assert_eq!(x.mask_slot, [-1, 0, -1, -1], "padding is unmasked");
    }

    fn seq<'a>(tokens: &'a [u32], start: usize, pages: &'a [u32]) -> StepSeq<'a> {
        StepSeq {
            tokens,
            start,
            pages,
            logits: true,
            write_kv: true,
            draw: Draw::Greedy,
            mask: None,
            scores: None,
        }
    }

    #[test]
    fn gathered_tokens_write_their_page_slots_and_attend_to_their_prefix() {
        // Pages of 4 tokens: a prefill of three tokens from position 3 (its
        // second page is 9), then a decode at position 5 (page 2 of [1, 2]).
        let batch = [seq(&[10, 11, 12], 3, &[4, 9]), seq(&[13], 5, &[1, 2])];
        let x = Inputs::gather(&batch, 4, 100).unwrap();
        assert_eq!(x.slots, [4 * 4 + 3, 9 * 4, 9 * 4 + 1, 2 * 4 + 1]);
        assert_eq!(x.lens, [4, 5, 6, 6]);
        assert_eq!(x.offs, [0, 0, 0, 2]);
        assert_eq!(x.tables, [4, 9, 1, 2]);
        assert_eq!((x.seq_tab, x.tok_off), (vec![0, 2, 4], vec![0, 3, 4]));
        assert_eq!(x.wanted, [2, 3], "each sequence's last token");
        assert!(!x.greedy_decode, "a prefill chunk");
        let bad = [seq(&[100], 0, &[0])];
        assert!(
            Inputs::gather(&bad, 4, 100).is_err(),
            "outside the vocabulary"
        );
    }

    #[test]
    fn a_masked_result_gets_its_mask_in_a_slot_of_the_vocabularys_words() {
        let bits = [0b1010u32, 1, 0xFFFF_FFFF, 9];
        let mut masked = seq(&[8], 0, &[6]);
        masked.mask = Some(&bits);
        let batch = [seq(&[7], 2, &[5]), masked];
        // 40 tokens: two words a mask, the rest of the given bits dropped.
        let x = Inputs::gather(&batch, 4, 40).unwrap();
        assert!(x.masked());
        assert_eq!((&x.mask_slot, x.mask_words), (&vec![-1, 0], 2));
        assert_eq!(x.masks, [0b1010, 1]);
        // Shorter masks: a power of two of words, the rest allowing nothing.
        let three = [1u32, 2, 3];
        let mut short = seq(&[8], 0, &[6]);
        short.mask = Some(&three);
        let x = Inputs::gather(&[short], 4, 1000).unwrap();
        assert_eq!((x.mask_words, x.masks), (4, vec![1, 2, 3, 0]));
        let plain = Inputs::gather(&batch[..1], 4, 40).unwrap();
        assert!(!plain.masked());
    }

    #[test]
    fn the_words_hold_each_input_where_the_layout_puts_it() {
        let batch = [seq(&[7], 2, &[5]), seq(&[8], 0, &[6])];
        let x = Inputs::gather(&batch, 4, 100).unwrap();
        // Room for two tag changes, one given; four table entries, two used.
        let l = Layout::new(2, 2, 2, (2, 4), 0, 0);
        let changes = [(3u32, [1u64 << 32 | 2, 9])];
        let expected = [[1, 2], [3, 4]];
        let tags = StepTags {
            expected: &expected,
            changes: &changes,
        };
        let w = l.words(&x, &tags, &[]);
        assert_eq!(w.len(), l.words);
        assert_eq!(&w[l.range(l.ids, 2)], &[7, 8]);
        assert_eq!(&w[l.range(l.slots, 2)], &[5 * 4 + 2, 6 * 4]);
        assert_eq!(&w[l.range(l.tables, 2)], &[5, 6]);
        assert_eq!(&w[l.range(l.changes, 6)], &[3, 0, 2, 1, 9, 0]);
        assert!(
            w[l.range(l.changes + 6, 6)].iter().all(|v| *v == u32::MAX),
            "an unused change names no page"
        );
        assert_eq!(l.expected % 2, 0, "u64 tags are 8-byte aligned");
        assert_eq!(&w[l.range(l.expected, 8)], &[1, 0, 2, 0, 3, 0, 4, 0]);
    }
}
