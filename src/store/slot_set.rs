//! The hash set a table keeps its slots in (the items, and each index value's keys), hashed by
//! key. Many keys at once (a snapshot's page) are hashed first and inserted in the order of
//! their buckets: inserted as they come, each touched the table at random, a TLB miss or a
//! page fault per key, most of a warm start's time (BENCHMARKS.md, "hash sets filled in bucket
//! order").
//!
//! Each set hashes with a seed of its own, as std's `HashSet` does: under one seed, a set
//! iterated (in bucket order) into another that grows as it fills would crowd the front of
//! each smaller table, each insert probing further (rust-lang/rust#36481). So a key is hashed
//! once per set it goes into.

use std::borrow::Borrow;
use std::hash::{BuildHasher, RandomState};

use hashbrown::hash_table::{Entry, HashTable};

/// Slots by key.
#[derive(Clone)]
pub(super) struct SlotSet<S> {
    table: HashTable<S>,
    /// SipHash keys of this set's own: keys written to the prefix cannot be chosen to collide.
    seed: RandomState,
}

impl<S> Default for SlotSet<S> {
    fn default() -> Self {
        SlotSet {
            table: HashTable::new(),
            seed: RandomState::new(),
        }
    }
}

impl<S: Borrow<str>> SlotSet<S> {
    pub(super) fn len(&self) -> usize {
        self.table.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    pub(super) fn reserve(&mut self, additional: usize) {
        let seed = &self.seed;
        self.table
            .reserve(additional, |s| seed.hash_one(Borrow::<str>::borrow(s)));
    }

    pub(super) fn get(&self, key: &str) -> Option<&S> {
        self.table
            .find(self.seed.hash_one(key), |s| s.borrow() == key)
    }

    /// Puts `slot` in, in place of the slot of its key if there is one, which it returns.
    pub(super) fn replace(&mut self, slot: S) -> Option<S> {
        let hash = self.seed.hash_one(Borrow::<str>::borrow(&slot));
        self.replace_hashed(hash, slot)
    }

    /// [`replace`](Self::replace), with the hash of the slot's key under this set's seed.
    fn replace_hashed(&mut self, hash: u64, slot: S) -> Option<S> {
        let seed = &self.seed;
        // The key is read only to tell slots with equal hash tags apart: read at once, it would
        // cost a fetch from wherever the record is, for every slot.
        match self.table.entry(
            hash,
            |s| s.borrow() == slot.borrow(),
            |s| seed.hash_one(Borrow::<str>::borrow(s)),
        ) {
            Entry::Occupied(mut held) => Some(std::mem::replace(held.get_mut(), slot)),
            Entry::Vacant(vacant) => {
                vacant.insert(slot);
                None
            }
        }
    }

    /// [`replace`](Self::replace) for each of `slots` in turn, done in the order of the buckets
    /// they land in (after making room for all of them); returns the slots replaced.
    pub(super) fn replace_all(&mut self, slots: Vec<S>) -> Vec<S> {
        self.reserve(slots.len());
        let mut hashed: Vec<(u64, S)> = slots
            .into_iter()
            .map(|slot| (self.seed.hash_one(Borrow::<str>::borrow(&slot)), slot))
            .collect();
        // A hash's home bucket is its low bits, and hashbrown's buckets are a power of two of
        // which `capacity` is 7/8 (above 8 buckets): the order only matters for speed.
        let buckets = (self.table.capacity() / 7 * 8).next_power_of_two().max(1) as u64;
        // Stable: of two slots of one key, the later one is kept.
        hashed.sort_by_key(|(hash, _)| hash & (buckets - 1));
        hashed
            .into_iter()
            .filter_map(|(hash, slot)| self.replace_hashed(hash, slot))
            .collect()
    }

    pub(super) fn take(&mut self, key: &str) -> Option<S> {
        match self
            .table
            .find_entry(self.seed.hash_one(key), |s| s.borrow() == key)
        {
            Ok(held) => Some(held.remove().0),
            Err(_) => None,
        }
    }

    pub(super) fn remove(&mut self, key: &str) -> bool {
        self.take(key).is_some()
    }

    pub(super) fn iter(&self) -> hashbrown::hash_table::Iter<'_, S> {
        self.table.iter()
    }

    pub(super) fn drain(&mut self) -> hashbrown::hash_table::Drain<'_, S> {
        self.table.drain()
    }
}

impl<S: Borrow<str>> FromIterator<S> for SlotSet<S> {
    fn from_iter<I: IntoIterator<Item = S>>(iter: I) -> Self {
        let mut set = SlotSet::default();
        set.replace_all(iter.into_iter().collect());
        set
    }
}

impl<'a, S: Borrow<str>> IntoIterator for &'a SlotSet<S> {
    type Item = &'a S;
    type IntoIter = hashbrown::hash_table::Iter<'a, S>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_replaces_takes_and_finds_by_key() {
        let mut set: SlotSet<String> = (0..1000).map(|i| format!("k{i}")).collect();
        assert_eq!(set.len(), 1000);
        assert_eq!(set.get("k7").map(String::as_str), Some("k7"));
        assert_eq!(set.replace("k7".to_owned()).as_deref(), Some("k7"));
        assert_eq!(set.len(), 1000);
        let again = vec!["k1".to_owned(), "new".to_owned()];
        assert_eq!(set.replace_all(again), vec!["k1".to_owned()]);
        assert_eq!(set.len(), 1001);
        assert_eq!(set.take("new").as_deref(), Some("new"));
        assert!(!set.remove("new"));
        assert!(set.get("missing").is_none());
        assert_eq!(set.drain().count(), 1000);
        assert!(set.is_empty());
    }

    #[test]
    fn each_set_hashes_with_its_own_seed() {
        // One seed for all would make a set iterated into another crowd its buckets.
        let (a, b) = (SlotSet::<String>::default(), SlotSet::<String>::default());
        let differ = (0..4).any(|i| {
            let key = format!("k{i}");
            a.seed.hash_one(&key) != b.seed.hash_one(&key)
        });
        assert!(differ, "two sets hash keys alike");
    }
}
