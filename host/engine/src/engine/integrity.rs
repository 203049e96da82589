//! The batched page-tag check run before every step that reads KV.

use super::block_pool::PageTag;

/// Compares the tags sequences expect with the pages' current tags.
pub trait IntegrityCheck: Send {
    /// Whether the check does anything (when false, callers skip building
    /// its inputs, so switching it off costs nothing).
    fn enabled(&self) -> bool;

    /// `expected[i]` is `(page, tag)`; sequence `s` owns
    /// `expected[offsets[s]..offsets[s + 1]]`. Returns one flag per
    /// sequence: true when every one of its pages still carries its tag.
    fn check(
        &self,
        expected: &[(u32, PageTag)],
        offsets: &[usize],
        current: &[PageTag],
    ) -> Vec<bool>;
}

/// The real check: one pass over all of the batch's pages.
#[derive(Debug, Default, Clone, Copy)]
pub struct TagCheck;

impl IntegrityCheck for TagCheck {
    fn enabled(&self) -> bool {
        true
    }

    fn check(
        &self,
        expected: &[(u32, PageTag)],
        offsets: &[usize],
        current: &[PageTag],
    ) -> Vec<bool> {
        let ok_page: Vec<bool> = expected
            .iter()
            .map(|(page, tag)| current.get(*page as usize) == Some(tag))
            .collect();
        offsets
            .windows(2)
            .map(|w| ok_page[w[0]..w[1]].iter().all(|x| *x))
            .collect()
    }
}

/// `--kv-integrity off`: checks nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoCheck;

impl IntegrityCheck for NoCheck {
    fn enabled(&self) -> bool {
        false
    }

    fn check(&self, _: &[(u32, PageTag)], offsets: &[usize], _: &[PageTag]) -> Vec<bool> {
        vec![true; offsets.len().saturating_sub(1)]
    }
}
