//! An intrusive doubly linked list of page ids: O(1) push to the back, pop
//! from the front and removal from anywhere. The block pool keeps its
//! unreferenced cached pages in one, least recently released first.

const NIL: u32 = u32::MAX;

/// A queue of distinct page ids in `0..capacity`.
#[derive(Debug)]
pub(super) struct LruList {
    prev: Vec<u32>,
    next: Vec<u32>,
    linked: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl LruList {
    /// An empty list for ids below `capacity`.
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            prev: vec![NIL; capacity],
            next: vec![NIL; capacity],
            linked: vec![false; capacity],
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    /// Ids in the list.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Appends `id` (most recently used); no-op if already linked.
    pub(super) fn push_back(&mut self, id: u32) {
        let i = id as usize;
        if self.linked[i] {
            return;
        }
        self.linked[i] = true;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = id;
        } else {
            self.next[self.tail as usize] = id;
        }
        self.tail = id;
        self.len += 1;
    }

    /// Unlinks `id`; false if it was not in the list.
    pub(super) fn remove(&mut self, id: u32) -> bool {
        let i = id as usize;
        if !self.linked[i] {
            return false;
        }
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.linked[i] = false;
        self.len -= 1;
        true
    }

    /// Removes and returns the least recently pushed id.
    pub(super) fn pop_front(&mut self) -> Option<u32> {
        let h = self.head;
        (h != NIL && self.remove(h)).then_some(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removal_from_the_middle_keeps_the_order_of_the_rest() {
        let mut l = LruList::new(5);
        for i in [3, 1, 4, 0] {
            l.push_back(i);
        }
        assert!(l.remove(1));
        assert!(!l.remove(1));
        l.push_back(3); // already linked: stays where it is
        l.push_back(2);
        let order: Vec<u32> = std::iter::from_fn(|| l.pop_front()).collect();
        assert_eq!(order, vec![3, 4, 0, 2]);
        assert_eq!(l.len(), 0);
    }
}
