//! Items waiting for a delayed add, ordered by ready time.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::Hash;

use tokio::time::Instant;

/// Items waiting for a delayed add. A heap ordered by ready time. An item whose ready time is
/// moved earlier leaves its old heap entry behind, and that entry is skipped later.
pub(super) struct Delayed<K> {
    pub(super) heap: BinaryHeap<Reverse<(Instant, u64)>>,
    pub(super) by_seq: HashMap<u64, K>,
    pub(super) by_item: HashMap<K, (Instant, u64)>,
    pub(super) next_seq: u64,
}

impl<K> Delayed<K> {
    pub(super) fn len(&self) -> usize {
        self.by_item.len()
    }
}

impl<K: Clone + Eq + Hash> Delayed<K> {
    pub(super) fn new() -> Self {
        Self {
            heap: BinaryHeap::new(),
            by_seq: HashMap::new(),
            by_item: HashMap::new(),
            next_seq: 0,
        }
    }

    /// Schedules `item` at `at` unless it is already scheduled no later. Returns whether the
    /// schedule changed.
    pub(super) fn insert(&mut self, item: K, at: Instant) -> bool {
        if let Some(&(current, seq)) = self.by_item.get(&item) {
            if current <= at {
                return false;
            }
            self.by_seq.remove(&seq);
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.heap.push(Reverse((at, seq)));
        self.by_seq.insert(seq, item.clone());
        self.by_item.insert(item, (at, seq));
        true
    }

    /// The earliest ready time, dropping stale heap entries on the way.
    pub(super) fn next_ready(&mut self) -> Option<Instant> {
        while let Some(&Reverse((at, seq))) = self.heap.peek() {
            if self.by_seq.contains_key(&seq) {
                return Some(at);
            }
            self.heap.pop();
        }
        None
    }

    /// Removes and returns an item whose ready time is at or before `now`, with that time.
    pub(super) fn pop_ready(&mut self, now: Instant) -> Option<(K, Instant)> {
        while let Some(&Reverse((at, seq))) = self.heap.peek() {
            if at > now {
                return None;
            }
            self.heap.pop();
            if let Some(item) = self.by_seq.remove(&seq) {
                self.by_item.remove(&item);
                return Some((item, at));
            }
        }
        None
    }

    pub(super) fn clear(&mut self) {
        self.heap.clear();
        self.by_seq.clear();
        self.by_item.clear();
    }
}
