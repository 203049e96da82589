//! Phase-aware steps (`--weights prefill=F,decode=F`): a step's one-token
//! rows run on the decode weights and its prefill chunks on the prefill
//! weights, as two forward passes over the same KV pages. The split and
//! the merge of the two results are plain data; the runner does the
//! passes.

use super::step::{SeqOut, Step, StepOut, StepTags};

/// A step cut by phase: which rows go to which pass, and each pass's
/// expected page tags (a row's tags are its block table's length, rows in
/// batch order, so a phase's are gathered when the phases interleave).
#[derive(Debug)]
pub struct PhaseSplit {
    /// Per original row: whether it runs on the decode weights.
    pub is_decode: Vec<bool>,
    prefill_tags: Vec<[u64; 2]>,
    decode_tags: Vec<[u64; 2]>,
}

/// Cuts `step` by phase: rows of one new token decode, longer rows
/// prefill. `Err(all_decode)` when every row is of one phase.
pub fn split(step: &Step<'_>) -> Result<PhaseSplit, bool> {
    let is_decode: Vec<bool> = step.seqs.iter().map(|s| s.tokens.len() == 1).collect();
    if is_decode.iter().all(|d| *d) {
        return Err(true);
    }
    if !is_decode.iter().any(|d| *d) {
        return Err(false);
    }
    let (mut prefill_tags, mut decode_tags) = (Vec::new(), Vec::new());
    if !step.tags.expected.is_empty() {
        let mut at = 0;
        for (seq, d) in step.seqs.iter().zip(&is_decode) {
            let tags = step
                .tags
                .expected
                .get(at..at + seq.pages.len())
                .unwrap_or(&[]);
            let to = if *d {
                &mut decode_tags
            } else {
                &mut prefill_tags
            };
            to.extend_from_slice(tags);
            at += seq.pages.len();
        }
    }
    Ok(PhaseSplit {
        is_decode,
        prefill_tags,
        decode_tags,
    })
}

impl PhaseSplit {
    /// The two passes: prefill first, carrying the step's tag changes, then
    /// decode.
    pub fn steps<'a>(&'a self, step: &Step<'a>) -> (Step<'a>, Step<'a>) {
        let (mut prefill, mut decode) = (Step::default(), Step::default());
        for (seq, d) in step.seqs.iter().zip(&self.is_decode) {
            let to = if *d { &mut decode } else { &mut prefill };
            to.seqs.push(*seq);
        }
        prefill.tags = StepTags {
            expected: &self.prefill_tags,
            changes: step.tags.changes,
        };
        decode.tags.expected = &self.decode_tags;
        (prefill, decode)
    }
}

/// The original step's result from its two passes' results.
pub fn merge(step: &Step<'_>, is_decode: &[bool], prefill: StepOut, decode: StepOut) -> StepOut {
    let (mut pre_rows, mut dec_rows) = (prefill.rows.into_iter(), decode.rows.into_iter());
    let (mut pre_ok, mut dec_ok) = (prefill.ok.into_iter(), decode.ok.into_iter());
    let mut out = StepOut {
        rows: Vec::new(),
        ok: Vec::with_capacity(step.seqs.len()),
        device: prefill.device + decode.device,
    };
    for (seq, d) in step.seqs.iter().zip(is_decode) {
        let (rows, ok): (
            &mut dyn Iterator<Item = SeqOut>,
            &mut dyn Iterator<Item = bool>,
        ) = if *d {
            (&mut dec_rows, &mut dec_ok)
        } else {
            (&mut pre_rows, &mut pre_ok)
        };
        out.ok.push(ok.next().unwrap_or(false));
        if seq.logits
            && let Some(row) = rows.next()
        {
            out.rows.push(row);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::step::{Draw, StepSeq};

    fn seq<'a>(tokens: &'a [u32], pages: &'a [u32], logits: bool) -> StepSeq<'a> {
        StepSeq {
            tokens,
            start: 0,
            pages,
            logits,
            write_kv: true,
            draw: Draw::Greedy,
            mask: None,
            scores: None,
        }
    }

    #[test]
    fn interleaved_phases_split_with_their_own_tags_and_merge_in_batch_order() {
        let (one, three) = ([7u32], [1u32, 2, 3]);
        let (p1, p2, p3) = ([10u32], [20u32, 21], [30u32, 31, 32]);
        // Rows: decode, prefill, decode (its tags 3 long), prefill whose
        // result is not wanted.
        let seqs = vec![
            seq(&one, &p1, true),
            seq(&three, &p2, true),
            seq(&one, &p3, true),
            seq(&three, &p1, false),
        ];
        let expected: Vec<[u64; 2]> = (0..7).map(|i| [i, 100 + i]).collect();
        let changes = [(5u32, [9u64, 9])];
        let step = Step {
            seqs,
            tags: StepTags {
                expected: &expected,
                changes: &changes,
            },
        };
        let split = split(&step).unwrap();
        assert_eq!(split.is_decode, [true, false, true, false]);
        let (pre, dec) = split.steps(&step);
        assert_eq!(pre.seqs.len(), 2);
        assert_eq!(dec.seqs.len(), 2);
        // Row 0 holds tag 0, row 1 tags 1..3, row 2 tags 3..6, row 3 tag 6.
        let firsts = |t: &[[u64; 2]]| t.iter().map(|x| x[0]).collect::<Vec<_>>();
        assert_eq!(firsts(pre.tags.expected), [1, 2, 6]);
        assert_eq!(firsts(dec.tags.expected), [0, 3, 4, 5]);
        assert_eq!(pre.tags.changes.len(), 1);
        assert!(dec.tags.changes.is_empty());
        let out = |rows: &[u32], ok: &[bool]| StepOut {
            rows: rows.iter().map(|t| SeqOut::Token(*t)).collect(),
            ok: ok.to_vec(),
            device: std::time::Duration::from_millis(1),
        };
        // Prefill wanted one result (row 1); decode two (rows 0 and 2).
        let merged = merge(
            &step,
            &split.is_decode,
            out(&[11], &[true, false]),
            out(&[10, 12], &[true, true]),
        );
        assert_eq!(
            merged.rows,
            [SeqOut::Token(10), SeqOut::Token(11), SeqOut::Token(12)]
        );
        assert_eq!(merged.ok, [true, true, true, false]);
        assert_eq!(merged.device, std::time::Duration::from_millis(2));
    }

    #[test]
    fn a_step_of_one_phase_is_not_split() {
        let (one, three, pages) = ([7u32], [1u32, 2, 3], [1u32]);
        let decode = Step {
            seqs: vec![seq(&one, &pages, true), seq(&one, &pages, true)],
            ..Default::default()
        };
        assert!(matches!(split(&decode), Err(true)));
        let prefill = Step {
            seqs: vec![seq(&three, &pages, true)],
            ..Default::default()
        };
        assert!(matches!(split(&prefill), Err(false)));
    }
}
