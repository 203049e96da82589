//! The KV cache manager: each sequence's append-only block table over the
//! block pool, with the tag it expects for every page, and the prefix
//! cache's matching (at admission) and registration (after each step).

use std::collections::HashMap;

use super::block_pool::{BlockPool, PageTag, PrefixChange, TenantId};
use super::integrity::IntegrityCheck;
use super::prefix::PageHash;

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
    /// Leading pages already named in the prefix cache.
    named: usize,
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

    /// Unreferenced pages kept for the prefix cache (counted as free).
    pub fn num_cached(&self) -> usize {
        self.pool.num_cached()
    }

    /// Starts `seq`'s table with the longest run of cached pages matching
    /// `hashes` (the chained hashes of its prompt's full pages) that
    /// `tenant` owns. Each reused page keeps its tag, which the table
    /// records like any other. Returns how many pages were reused; does
    /// nothing for a sequence that already has pages.
    pub fn attach_prefix(&mut self, seq: SeqId, tenant: TenantId, hashes: &[PageHash]) -> usize {
        if self.tables.get(&seq).is_some_and(|t| !t.pages.is_empty()) {
            return 0;
        }
        let table = self.tables.entry(seq).or_default();
        for h in hashes {
            let Some(page) = self.pool.lookup(*h) else {
                break;
            };
            // The salt already keeps tenants apart; the owner in the tag is
            // a second, independent guard.
            if self.pool.tags()[page as usize].tenant != tenant {
                break;
            }
            let tag = self.pool.acquire(page);
            table.pages.push(page);
            table.expected.push(tag);
            table.owned.push(page);
        }
        table.named = table.pages.len();
        table.named
    }

    /// Names `seq`'s pages in the prefix cache: page `i` gets `hashes[i]`,
    /// for every page whose tokens are all in the cache (`computed`).
    pub fn cache_pages(&mut self, seq: SeqId, hashes: &[PageHash], computed: usize) {
        let Some(t) = self.tables.get_mut(&seq) else {
            return;
        };
        let full = (computed / self.page_size)
            .min(hashes.len())
            .min(t.owned.len());
        // By the ownership record, never the mapping: a corrupted mapping
        // must not publish someone else's page under this name.
        if full > t.named {
            for (page, hash) in t.owned[t.named..full].iter().zip(&hashes[t.named..full]) {
                self.pool.register(*page, *hash);
            }
        }
        t.named = t.named.max(full);
    }

    /// Starts recording retagged pages (see [`BlockPool::track_retags`]).
    pub fn track_retags(&mut self) {
        self.pool.track_retags();
    }

    /// `page`'s current tag.
    pub fn page_tag(&self, page: u32) -> PageTag {
        self.pool.tags()[page as usize]
    }

    /// Pages given new tags since the last call, with their tags.
    pub fn take_retagged(&mut self) -> Vec<(u32, PageTag)> {
        self.pool.take_retagged()
    }

    /// Changes to the cached hashes since the last call.
    pub fn take_prefix_changes(&mut self) -> Vec<PrefixChange> {
        self.pool.take_journal()
    }

    /// Makes `seq`'s table cover `tokens` tokens, allocating for `tenant`.
    /// All or nothing: false (and no change) if the pool is short.
    pub fn allocate(&mut self, seq: SeqId, tenant: TenantId, tokens: usize) -> bool {
        self.allocate_leaving(seq, tenant, tokens, 0)
    }

    /// [`allocate`](Self::allocate), unless it would leave fewer than
    /// `reserve` pages free.
    pub fn allocate_leaving(
        &mut self,
        seq: SeqId,
        tenant: TenantId,
        tokens: usize,
        reserve: usize,
    ) -> bool {
        let need = self.need(seq, tokens);
        if need > 0 && need + reserve > self.pool.num_free() {
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

    /// Pages `seq`'s table lacks to cover `tokens` tokens.
    fn need(&self, seq: SeqId, tokens: usize) -> usize {
        let have = self.tables.get(&seq).map_or(0, |t| t.pages.len());
        tokens.div_ceil(self.page_size).saturating_sub(have)
    }

    /// The most tokens `seq` could cover while leaving `reserve` pages
    /// free: its pages and those free above the reserve.
    pub fn tokens_leaving(&self, seq: SeqId, reserve: usize) -> usize {
        let have = self.tables.get(&seq).map_or(0, |t| t.pages.len());
        (have + self.pool.num_free().saturating_sub(reserve)) * self.page_size
    }

    /// Whether the free pages would cover `seq` to `tokens` tokens.
    pub fn fits(&self, seq: SeqId, tokens: usize) -> bool {
        self.need(seq, tokens) <= self.pool.num_free()
    }

    /// Drops `seq`'s reference on each of its pages.
    pub fn free(&mut self, seq: SeqId) {
        if let Some(t) = self.tables.remove(&seq) {
            // Last page first, so a sequence's tail is evicted before its
            // head (the head is the part other requests share).
            for p in t.owned.into_iter().rev() {
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
    fn a_tenants_prefix_is_reused_with_its_tags_and_never_by_another_tenant() {
        let mut kv = KvCacheManager::new(8, 16);
        let (a, b) = (TenantId(1), TenantId(2));
        assert!(kv.allocate(1, a, 40));
        kv.cache_pages(1, &[100, 101], 40);
        let first = kv.table(1).unwrap().clone();
        kv.free(1);
        assert_eq!((kv.num_free(), kv.num_cached()), (8, 2));
        assert_eq!(kv.attach_prefix(2, a, &[100, 101, 102]), 2);
        let t = kv.table(2).unwrap();
        assert_eq!(t.pages, first.pages[..2]);
        assert_eq!(t.expected, first.expected[..2], "reuse keeps the tags");
        assert_eq!(kv.check(&[2], &TagCheck), vec![true]);
        // A page of tenant a under a hash tenant b somehow computed: refused.
        assert_eq!(kv.attach_prefix(3, b, &[100]), 0);
        kv.free(2);
        kv.free(3);
        assert_eq!(kv.num_free(), 8);
    }

    #[test]
    fn only_unpinned_cached_pages_are_evicted() {
        let mut kv = KvCacheManager::new(2, 16);
        let a = TenantId(1);
        assert!(kv.allocate(1, a, 32));
        kv.cache_pages(1, &[7, 8], 32);
        kv.free(1);
        assert_eq!(kv.attach_prefix(2, a, &[7]), 1);
        let held = kv.table(2).unwrap().clone();
        // Page of hash 8 is evicted for a new allocation; 7 is pinned.
        assert!(kv.allocate(3, a, 16));
        assert_eq!(kv.attach_prefix(4, a, &[7, 8]), 1);
        assert_eq!(kv.table(2).unwrap().expected, held.expected);
        assert!(!kv.allocate(5, a, 16), "pinned pages are never evicted");
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
