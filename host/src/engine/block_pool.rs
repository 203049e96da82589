//! The block pool: physical KV pages, their reference counts and tags, and
//! the free queue (least recently freed first).

use std::collections::VecDeque;

/// A tenant as the engine knows it (interned).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct TenantId(pub u32);

/// Who owns a physical page, and which allocation of it this is. The
/// generation comes from one counter that advances on every allocation, so
/// no two allocations ever carry the same tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PageTag {
    /// Allocation number.
    pub generation: u64,
    /// Owning tenant.
    pub tenant: TenantId,
}

/// Physical pages and their bookkeeping.
#[derive(Debug)]
pub struct BlockPool {
    tags: Vec<PageTag>,
    refs: Vec<u32>,
    free: VecDeque<u32>,
    next_generation: u64,
}

impl BlockPool {
    /// A pool of `num_pages` free pages.
    pub fn new(num_pages: usize) -> Self {
        Self {
            tags: vec![PageTag::default(); num_pages],
            refs: vec![0; num_pages],
            free: (0..num_pages as u32).collect(),
            next_generation: 1,
        }
    }

    /// Pages in the pool.
    pub fn num_pages(&self) -> usize {
        self.tags.len()
    }

    /// Pages not referenced by any sequence.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Takes the least recently freed page for `tenant`, giving it a new tag.
    pub fn allocate(&mut self, tenant: TenantId) -> Option<(u32, PageTag)> {
        let page = self.free.pop_front()?;
        let tag = PageTag {
            generation: self.next_generation,
            tenant,
        };
        self.next_generation += 1;
        self.tags[page as usize] = tag;
        self.refs[page as usize] = 1;
        Some((page, tag))
    }

    /// Drops one reference; the page returns to the free queue at zero.
    pub fn release(&mut self, page: u32) {
        let r = &mut self.refs[page as usize];
        debug_assert!(*r > 0, "releasing a free page");
        *r = r.saturating_sub(1);
        if *r == 0 {
            self.free.push_back(page);
        }
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
}
