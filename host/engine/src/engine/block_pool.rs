//! The block pool: physical KV pages, their reference counts and tags, the
//! free queue (least recently freed first), and the prefix cache's index of
//! full pages by hash.
//!
//! A page is in one of three states: in use (referenced by at least one
//! sequence), cached (unreferenced but still named by a hash, so a later
//! request of the same tenant can reuse it) or free. Allocation takes free
//! pages first and evicts the least recently released cached page only when
//! none is left.

use std::collections::{HashMap, VecDeque};

use super::lru::LruList;
use super::prefix::PageHash;

/// A tenant as the engine knows it (interned).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct TenantId(pub u32);

/// Who owns a physical page, and which allocation of it this is. The
/// generation comes from one counter that advances on every allocation, so
/// no two allocations ever carry the same tag. A cached page that is reused
/// keeps its tag: it is the same allocation, with the same contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PageTag {
    /// Allocation number.
    pub generation: u64,
    /// Owning tenant.
    pub tenant: TenantId,
}

/// A change to the set of cached page hashes, for routers that mirror it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixChange {
    /// A page became reusable under this hash.
    Added(PageHash),
    /// The page under this hash was evicted.
    Removed(PageHash),
}

/// Physical pages and their bookkeeping.
#[derive(Debug)]
pub struct BlockPool {
    tags: Vec<PageTag>,
    refs: Vec<u32>,
    hashes: Vec<Option<PageHash>>,
    /// Unreferenced pages named by no hash.
    free: VecDeque<u32>,
    /// Unreferenced cached pages, least recently released first.
    evictable: LruList,
    cached: HashMap<PageHash, u32>,
    journal: Vec<PrefixChange>,
    /// Pages given new tags since the last take, when someone mirrors the
    /// tags (a GPU keeps its own copy for the check it runs).
    retagged: Option<Vec<u32>>,
    next_generation: u64,
}

impl BlockPool {
    /// A pool of `num_pages` free pages.
    pub fn new(num_pages: usize) -> Self {
        Self {
            tags: vec![PageTag::default(); num_pages],
            refs: vec![0; num_pages],
            hashes: vec![None; num_pages],
            free: (0..num_pages as u32).collect(),
            evictable: LruList::new(num_pages),
            cached: HashMap::new(),
            journal: Vec::new(),
            retagged: None,
            next_generation: 1,
        }
    }

    /// Starts recording the pages that get new tags, for
    /// [`Self::take_retagged`].
    pub fn track_retags(&mut self) {
        self.retagged.get_or_insert_with(Vec::new);
    }

    /// Pages given new tags since the last call, with their tags now
    /// (empty unless [`Self::track_retags`] was called).
    pub fn take_retagged(&mut self) -> Vec<(u32, PageTag)> {
        let Some(r) = &mut self.retagged else {
            return Vec::new();
        };
        let pages = std::mem::take(r);
        pages
            .into_iter()
            .map(|p| (p, self.tags[p as usize]))
            .collect()
    }

    /// Pages in the pool.
    pub fn num_pages(&self) -> usize {
        self.tags.len()
    }

    /// Pages an allocation can take: free ones and unreferenced cached ones.
    pub fn num_free(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Unreferenced pages kept for the prefix cache (a subset of
    /// [`Self::num_free`]).
    pub fn num_cached(&self) -> usize {
        self.evictable.len()
    }

    /// Takes a free page for `tenant` (evicting the least recently released
    /// cached page if no plain free page is left), giving it a new tag.
    pub fn allocate(&mut self, tenant: TenantId) -> Option<(u32, PageTag)> {
        let page = match self.free.pop_front() {
            Some(p) => p,
            None => {
                let p = self.evictable.pop_front()?;
                if let Some(h) = self.hashes[p as usize].take() {
                    self.cached.remove(&h);
                    self.journal.push(PrefixChange::Removed(h));
                }
                p
            }
        };
        let tag = PageTag {
            generation: self.next_generation,
            tenant,
        };
        self.next_generation += 1;
        self.tags[page as usize] = tag;
        self.refs[page as usize] = 1;
        if let Some(r) = &mut self.retagged {
            r.push(page);
        }
        Some((page, tag))
    }

    /// Drops one reference. At zero a cached page waits in the evictable
    /// queue; any other page returns to the free queue.
    pub fn release(&mut self, page: u32) {
        let r = &mut self.refs[page as usize];
        debug_assert!(*r > 0, "releasing a free page");
        *r = r.saturating_sub(1);
        if *r == 0 {
            if self.hashes[page as usize].is_some() {
                self.evictable.push_back(page);
            } else {
                self.free.push_back(page);
            }
        }
    }

    /// The cached page named `hash`, if any.
    pub fn lookup(&self, hash: PageHash) -> Option<u32> {
        self.cached.get(&hash).copied()
    }

    /// Takes one more reference on cached `page` (taking it out of the
    /// evictable queue); returns its tag, unchanged.
    pub fn acquire(&mut self, page: u32) -> PageTag {
        let i = page as usize;
        if self.refs[i] == 0 {
            self.evictable.remove(page);
        }
        self.refs[i] += 1;
        self.tags[i]
    }

    /// Names in-use `page` by `hash` so later requests can reuse it. False
    /// (and nothing changes) if the page is already named or another page
    /// holds the same contents.
    pub fn register(&mut self, page: u32, hash: PageHash) -> bool {
        let i = page as usize;
        if self.refs[i] == 0 || self.hashes[i].is_some() || self.cached.contains_key(&hash) {
            return false;
        }
        self.hashes[i] = Some(hash);
        self.cached.insert(hash, page);
        self.journal.push(PrefixChange::Added(hash));
        true
    }

    /// Changes to the cached hashes since the last call.
    pub fn take_journal(&mut self) -> Vec<PrefixChange> {
        std::mem::take(&mut self.journal)
    }

    /// Current tags of every page, indexed by page id.
    pub fn tags(&self) -> &[PageTag] {
        &self.tags
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_allocation_gets_a_fresh_tag_and_lru_order_is_kept() {
        let mut pool = BlockPool::new(3);
        let t = TenantId(7);
        let (a, ta) = pool.allocate(t).unwrap();
        let (b, tb) = pool.allocate(t).unwrap();
        assert_ne!(ta, tb);
        pool.release(b);
        pool.release(a);
        // Page 2 was never used, then b, then a.
        assert_eq!(pool.allocate(t).unwrap().0, 2);
        let (again, tag) = pool.allocate(TenantId(8)).unwrap();
        assert_eq!(again, b);
        assert_ne!(tag, tb, "a reallocated page changes its tag");
        assert_eq!(tag.tenant, TenantId(8));
        assert_eq!(pool.allocate(t).unwrap().0, a);
        assert!(pool.allocate(t).is_none());
    }

    #[test]
    fn cached_pages_are_evicted_only_when_no_free_page_is_left() {
        let mut pool = BlockPool::new(3);
        let t = TenantId(1);
        let (a, ta) = pool.allocate(t).unwrap();
        let (b, _) = pool.allocate(t).unwrap();
        assert!(pool.register(a, 10));
        assert!(pool.register(b, 11));
        assert!(!pool.register(b, 12), "a page has one name");
        pool.release(a);
        pool.release(b);
        assert_eq!((pool.num_free(), pool.num_cached()), (3, 2));
        // Reuse keeps the tag and pins the page.
        assert_eq!(pool.lookup(10), Some(a));
        assert_eq!(pool.acquire(a), ta);
        assert_eq!(pool.num_free(), 2);
        // The plain free page goes first, then the cached one (b).
        let (c, _) = pool.allocate(t).unwrap();
        assert_ne!(c, b);
        assert_eq!(pool.lookup(11), Some(b));
        let (d, _) = pool.allocate(t).unwrap();
        assert_eq!(d, b);
        assert_eq!(pool.lookup(11), None, "evicted");
        assert_eq!(
            pool.take_journal(),
            vec![
                PrefixChange::Added(10),
                PrefixChange::Added(11),
                PrefixChange::Removed(11)
            ]
        );
        assert!(
            pool.allocate(t).is_none(),
            "a referenced page is never evicted"
        );
    }
}
