//! The KV cache manager: each sequence's append-only block table over the
//! block pool, with the tag it expects for every page.

use std::collections::HashMap;

use super::block_pool::{BlockPool, PageTag, TenantId};
use super::integrity::IntegrityCheck;

/// A sequence id.
pub type SeqId = u64;

/// A sequence's pages, in position order, with their expected tags.
#[derive(Debug, Default, Clone)]
pub struct BlockTable {
    /// Page ids: the mapping the kernels read.
    pub pages: Vec<u32>,
    /// The tag each page had when this sequence got it.
    pub expected: Vec<PageTag>,
    /// The pages the pool gave this sequence: the ownership record freeing
    /// goes by, kept apart from the mapping so a corrupted mapping can
    /// neither leak a page nor free someone else's.
    owned: Vec<u32>,
}

/// Block tables over one pool.
#[derive(Debug)]
pub struct KvCacheManager {
    pool: BlockPool,
    tables: HashMap<SeqId, BlockTable>,
    page_size: usize,
}

impl KvCacheManager {
    /// A manager of `num_pages` pages of `page_size` tokens.
    pub fn new(num_pages: usize, page_size: usize) -> Self {
        Self {
            pool: BlockPool::new(num_pages),
            tables: HashMap::new(),
            page_size,
        }
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Free pages.
    pub fn num_free(&self) -> usize {
        self.pool.num_free()
    }

    /// All pages.
    pub fn num_pages(&self) -> usize {
        self.pool.num_pages()
    }

    /// Makes `seq`'s table cover `tokens` tokens, allocating for `tenant`.
    /// All or nothing: false (and no change) if the pool is short.
    pub fn allocate(&mut self, seq: SeqId, tenant: TenantId, tokens: usize) -> bool {
        let have = self.tables.get(&seq).map_or(0, |t| t.pages.len());
        let need = tokens.div_ceil(self.page_size).saturating_sub(have);
        if need > self.pool.num_free() {
            return false;
        }
        let table = self.tables.entry(seq).or_default();
        for _ in 0..need {
            if let Some((page, tag)) = self.pool.allocate(tenant) {
                table.pages.push(page);
                table.expected.push(tag);
                table.owned.push(page);
            }
        }
        true
    }

    /// Returns every page of `seq` to the pool.
    pub fn free(&mut self, seq: SeqId) {
        if let Some(t) = self.tables.remove(&seq) {
            for p in t.owned {
                self.pool.release(p);
            }
        }
    }

    /// `seq`'s block table.
    pub fn table(&self, seq: SeqId) -> Option<&BlockTable> {
        self.tables.get(&seq)
    }

    /// Runs the batched tag check over `seqs`; one flag per sequence.
    pub fn check(&self, seqs: &[SeqId], checker: &dyn IntegrityCheck) -> Vec<bool> {
        if !checker.enabled() {
            return vec![true; seqs.len()];
        }
        let mut expected = Vec::new();
        let mut offsets = Vec::with_capacity(seqs.len() + 1);
        offsets.push(0);
        for s in seqs {
            if let Some(t) = self.tables.get(s) {
                expected.extend(t.pages.iter().copied().zip(t.expected.iter().copied()));
            }
            offsets.push(expected.len());
        }
        checker.check(&expected, &offsets, self.pool.tags())
    }

    /// Test-only fault injection: points `victim`'s page `index` at
    /// `donor`'s first page, keeping the victim's expected tag, as a buggy
    /// or malicious mapping would.
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn corrupt_mapping(&mut self, victim: SeqId, donor: SeqId, index: usize) -> bool {
        let Some(page) = self
            .tables
            .get(&donor)
            .and_then(|t| t.pages.first().copied())
        else {
            return false;
        };
        match self.tables.get_mut(&victim) {
            Some(t) if index < t.pages.len() => {
                t.pages[index] = page;
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::integrity::{NoCheck, TagCheck};

    #[test]
    fn allocation_is_all_or_nothing_and_free_returns_pages() {
        let mut kv = KvCacheManager::new(4, 16);
        assert!(kv.allocate(1, TenantId(0), 33));
        assert_eq!(kv.num_free(), 1);
        assert!(!kv.allocate(2, TenantId(0), 40), "needs 3, has 1");
        assert_eq!(kv.num_free(), 1);
        assert!(kv.allocate(1, TenantId(0), 48));
        kv.free(1);
        assert_eq!(kv.num_free(), 4);
    }

    #[test]
    fn stale_page_tag_fails_only_that_sequence() {
        let mut kv = KvCacheManager::new(8, 16);
        for s in 1..=3 {
            assert!(kv.allocate(s, TenantId(s as u32), 20));
        }
        assert_eq!(kv.check(&[1, 2, 3], &TagCheck), vec![true, true, true]);
        assert!(kv.corrupt_mapping(2, 3, 1));
        assert_eq!(kv.check(&[1, 2, 3], &TagCheck), vec![true, false, true]);
        assert_eq!(kv.check(&[1, 2, 3], &NoCheck), vec![true, true, true]);
        for s in 1..=3 {
            kv.free(s);
        }
        assert_eq!(kv.num_free(), 8, "a corrupted mapping leaks nothing");
    }

    #[test]
    fn a_page_freed_and_reallocated_no_longer_matches_the_old_tag() {
        let mut kv = KvCacheManager::new(1, 16);
        assert!(kv.allocate(1, TenantId(1), 1));
        let stale = kv.table(1).unwrap().clone();
        kv.free(1);
        assert!(kv.allocate(2, TenantId(2), 1));
        assert_eq!(kv.table(2).unwrap().pages, stale.pages);
        assert_ne!(kv.table(2).unwrap().expected, stale.expected);
    }
}
