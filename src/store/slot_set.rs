//! The hash set a table keeps its slots in (the items, and each index value's keys): a slot
//! is hashed by its key, and every set of the process hashes a key alike, so that a key hashed
//! once serves the items and each of its index sets. A snapshot's keys are hashed as they are
//! read, in order, and inserted in the order of their buckets: inserted as they come, each
//! touched the table at random, a TLB miss or a page fault per key, most of a warm start's
//! time (BENCHMARKS.md, "hash sets filled in bucket order").

use std::borrow::Borrow;
use std::hash::BuildHasher;
use std::sync::OnceLock;

use hashbrown::hash_table::{Entry, HashTable};

/// The hash of `key`, as every set of the process hashes it: SipHash (std's) under one random
/// seed per process, so that keys chosen by whoever writes the prefix cannot collide on
/// purpose.
pub(super) fn hash_key(key: &str) -> u64 {
    static SEED: OnceLock<std::hash::RandomState> = OnceLock::new();
    SEED.get_or_init(std::hash::RandomState::new).hash_one(key)
}

fn hash_slot<S: Borrow<str>>(slot: &S) -> u64 {
    hash_key(slot.borrow())
}

/// Slots by key.
#[derive(Clone)]
pub(super) struct SlotSet<S> {
    table: HashTable<S>,
}

impl<S> Default for SlotSet<S> {
    fn default() -> Self {
        SlotSet {
            table: HashTable::new(),
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
        self.table.reserve(additional, hash_slot);
    }

    pub(super) fn get(&self, key: &str) -> Option<&S> {
        self.table.find(hash_key(key), |s| s.borrow() == key)
    }

    /// Puts `slot` in, in place of the slot of its key if there is one, which it returns.
    pub(super) fn replace(&mut self, slot: S) -> Option<S> {
        let hash = hash_slot(&slot);
        self.replace_hashed(hash, slot)
    }

    /// [`replace`](Self::replace) with the key's [`hash_key`] already known.
    fn replace_hashed(&mut self, hash: u64, slot: S) -> Option<S> {
        // The key is read only to tell slots with equal hash tags apart: read at once, it would
        // cost a fetch from wherever the record is, for every slot.
        match self
            .table
            .entry(hash, |s| s.borrow() == slot.borrow(), hash_slot)
        {
            Entry::Occupied(mut held) => Some(std::mem::replace(held.get_mut(), slot)),
            Entry::Vacant(vacant) => {
                vacant.insert(slot);
                None
            }
        }
    }

    /// [`replace`](Self::replace) for each of `slots` in turn, given with their keys' hashes,
    /// done in the order of the buckets they land in (after making room for all of them);
    /// returns the slots replaced.
    pub(super) fn replace_all(&mut self, mut slots: Vec<(u64, S)>) -> Vec<S> {
        self.table.reserve(slots.len(), hash_slot);
        // hashbrown holds `capacity` = 7/8 of its buckets, a power of two, and a hash's home
        // bucket is its low bits.
        let buckets = (self.table.capacity() / 7 * 8).max(1).next_power_of_two() as u64;
        // Stable: of two slots of one key, the later one is kept.
        slots.sort_by_key(|(hash, _)| hash & (buckets - 1));
        slots
            .into_iter()
            .filter_map(|(hash, slot)| self.replace_hashed(hash, slot))
            .collect()
    }

    pub(super) fn take(&mut self, key: &str) -> Option<S> {
        match self.table.find_entry(hash_key(key), |s| s.borrow() == key) {
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
        let slots: Vec<(u64, S)> = iter.into_iter().map(|s| (hash_slot(&s), s)).collect();
        set.replace_all(slots);
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
        let again: Vec<(u64, String)> = ["k1", "new"]
            .iter()
            .map(|k| (hash_key(k), (*k).to_owned()))
            .collect();
        assert_eq!(set.replace_all(again), vec!["k1".to_owned()]);
        assert_eq!(set.len(), 1001);
        assert_eq!(set.take("new").as_deref(), Some("new"));
        assert!(!set.remove("new"));
        assert!(set.get("missing").is_none());
        assert_eq!(set.drain().count(), 1000);
        assert!(set.is_empty());
    }
}
