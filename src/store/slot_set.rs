//! The hash set a table keeps its slots in (the items, and each index value's keys), hashed by
//! key. Many keys at once (a snapshot's page) are hashed first and inserted in the order of
//! their buckets: inserted as they come, each touched the table at random, a TLB miss or a
//! page fault per key, most of a warm start's time (BENCHMARKS.md, "hash sets filled in bucket
//! order").
//!
//! A key is hashed once ([`key_hash`]: SipHash under keys drawn once per process, so that keys
//! written to the prefix cannot be chosen to collide), wherever its bytes are at hand (a
//! snapshot's records as the file is parsed), and that hash serves every set the key goes
//! into: reading each key again for each set was a cache miss per key and set, a third of a
//! warm start. Each set mixes it with a seed of its own, as std's `HashSet` seeds each set:
//! under one seed, a set iterated (in bucket order) into another that grows as it fills would
//! crowd the front of each smaller table, each insert probing further (rust-lang/rust#36481).
//! The mix is a bijection, so two keys collide in a set exactly when their SipHashes do.

use std::borrow::Borrow;
use std::cmp::Reverse;
use std::collections::binary_heap::PeekMut;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasher, RandomState};
use std::sync::OnceLock;

use hashbrown::hash_table::{Entry, HashTable};

use crate::object::split_key;

/// The hash of `key` every set starts from (see the module docs).
pub(crate) fn key_hash(key: &str) -> u64 {
    static HASHER: OnceLock<RandomState> = OnceLock::new();
    HASHER.get_or_init(RandomState::new).hash_one(key)
}

/// SplitMix64's finalizer: a bijection of `u64` whose every output bit depends on every input
/// bit.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Slots by key.
#[derive(Clone)]
pub(super) struct SlotSet<S> {
    table: HashTable<S>,
    /// Mixed into each [`key_hash`]: this set's own bucket order.
    seed: u64,
}

impl<S> Default for SlotSet<S> {
    fn default() -> Self {
        SlotSet {
            table: HashTable::new(),
            // A fresh `RandomState` has keys of its own (the thread's, advanced).
            seed: RandomState::new().hash_one(()),
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

    /// The hash in this set of a key whose [`key_hash`] is `key_hash`.
    fn hash_of(&self, key_hash: u64) -> u64 {
        mix(key_hash ^ self.seed)
    }

    fn hash(&self, key: &str) -> u64 {
        self.hash_of(key_hash(key))
    }

    /// Makes room for `additional` more slots if it can: a hint (a snapshot's key count is
    /// read before its checksum is checked), so room that cannot be allocated is not made,
    /// and the set grows as slots come instead.
    pub(super) fn reserve(&mut self, additional: usize) {
        let seed = self.seed;
        let _ = self.table.try_reserve(additional, |s| {
            mix(key_hash(Borrow::<str>::borrow(s)) ^ seed)
        });
    }

    pub(super) fn get(&self, key: &str) -> Option<&S> {
        self.table.find(self.hash(key), |s| s.borrow() == key)
    }

    pub(super) fn take(&mut self, key: &str) -> Option<S> {
        match self.table.find_entry(self.hash(key), |s| s.borrow() == key) {
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

// Putting a slot in compares it with the slots of the same hash tag.
impl<S: Borrow<str> + Eq> SlotSet<S> {
    /// Puts `slot` in, in place of the slot of its key if there is one, which it returns.
    pub(super) fn replace(&mut self, slot: S) -> Option<S> {
        let hash = self.hash(Borrow::<str>::borrow(&slot));
        self.replace_hashed(hash, slot)
    }

    /// [`replace`](Self::replace), with the hash of the slot's key in this set.
    fn replace_hashed(&mut self, hash: u64, slot: S) -> Option<S> {
        let seed = self.seed;
        // The key is read only to tell slots with equal hash tags apart: read at once, it would
        // cost a fetch from wherever the record is, for every slot.
        match self.table.entry(
            hash,
            |s| *s == slot,
            |s| mix(key_hash(Borrow::<str>::borrow(s)) ^ seed),
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
        let hashed = slots
            .into_iter()
            .map(|slot| (key_hash(Borrow::<str>::borrow(&slot)), slot))
            .collect();
        self.replace_all_hashed(hashed)
    }

    /// [`replace_all`](Self::replace_all), each slot with its key's [`key_hash`].
    pub(super) fn replace_all_hashed(&mut self, mut hashed: Vec<(u64, S)>) -> Vec<S> {
        self.reserve(hashed.len());
        for (hash, _) in &mut hashed {
            *hash = self.hash_of(*hash);
        }
        // A hash's home bucket is its low bits, and hashbrown's buckets are a power of two of
        // which `capacity` is 7/8 (above 8 buckets): the order only matters for speed.
        let buckets = (self.table.capacity() / 7 * 8).next_power_of_two().max(1) as u64;
        let mask = buckets - 1;
        if buckets > 1 << 32 || hashed.len() as u64 > 1 << 32 {
            // Stable: of two slots of one key, the later one is kept.
            hashed.sort_by_key(|(hash, _)| hash & mask);
            return hashed
                .into_iter()
                .filter_map(|(hash, slot)| self.replace_hashed(hash, slot))
                .collect();
        }
        // The same order, sorting words (bucket, then position: of two slots of one key, the
        // later one is kept) rather than moving the slots themselves around.
        let mut order: Vec<u64> = hashed
            .iter()
            .enumerate()
            .map(|(i, (hash, _))| (hash & mask) << 32 | i as u64)
            .collect();
        order.sort_unstable();
        let mut hashed: Vec<Option<(u64, S)>> = hashed.into_iter().map(Some).collect();
        order
            .into_iter()
            .filter_map(|o| hashed[(o & u64::from(u32::MAX)) as usize].take())
            .filter_map(|(hash, slot)| self.replace_hashed(hash, slot))
            .collect()
    }
}

impl<S: Borrow<str> + Eq> FromIterator<S> for SlotSet<S> {
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

/// Slots by key. Once a namespace index asks for it ([`split_by_namespace`]), in one
/// [`SlotSet`] per namespace (the key's first segment, [`split_key`]), which are that index: not
/// a second slot of every key (22 B a key at 1M keys). Until then in one set: a store without
/// that index does not pay a set for each first segment (keys `user-1/profile`, `user-2/...`).
///
/// [`split_by_namespace`]: Items::split_by_namespace
#[derive(Clone)]
pub(super) struct Items<S> {
    namespaces: HashMap<Box<str>, SlotSet<S>>,
    by_namespace: bool,
    len: usize,
}

impl<S> Default for Items<S> {
    fn default() -> Self {
        Items {
            namespaces: HashMap::new(),
            by_namespace: false,
            len: 0,
        }
    }
}

impl<S: Borrow<str>> Items<S> {
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The set `key` is kept in: its namespace's, or the one set.
    pub(super) fn set_of<'k>(&self, key: &'k str) -> &'k str {
        if self.by_namespace {
            split_key(key).0
        } else {
            ""
        }
    }

    pub(super) fn get(&self, key: &str) -> Option<&S> {
        self.namespaces.get(self.set_of(key))?.get(key)
    }

    /// The slots of namespace `namespace` (once [`split_by_namespace`](Self::split_by_namespace)).
    pub(super) fn namespace(&self, namespace: &str) -> Option<&SlotSet<S>> {
        self.namespaces.get(namespace)
    }

    /// Each namespace with its slots (once [`split_by_namespace`](Self::split_by_namespace)).
    pub(super) fn namespaces(&self) -> impl Iterator<Item = (&str, &SlotSet<S>)> {
        self.namespaces.iter().map(|(ns, set)| (&**ns, set))
    }

    pub(super) fn take(&mut self, key: &str) -> Option<S> {
        let namespace = self.set_of(key);
        let set = self.namespaces.get_mut(namespace)?;
        let slot = set.take(key)?;
        if set.is_empty() {
            self.namespaces.remove(namespace);
        }
        self.len -= 1;
        Some(slot)
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &S> {
        self.namespaces.values().flat_map(SlotSet::iter)
    }

    /// Every slot, the namespaces interleaved in proportion to their sizes, each in its set's
    /// hash order: any run of them is about a random sample of all (a snapshot's first page is
    /// a warm start's sample). The same order on every call while the items do not change.
    pub(super) fn iter_mixed(&self) -> impl Iterator<Item = &S> {
        // The j-th slot of a set of n comes at (j + 1/2) / n of the way, in 32-bit fixed point.
        let at = |j: usize, n: usize| (((2 * j + 1) as u128) << 32) / (2 * n as u128);
        let mut sets: Vec<_> = self
            .namespaces
            .values()
            .map(|s| (s.len(), s.iter()))
            .collect();
        let mut next: BinaryHeap<Reverse<(u128, usize, usize)>> = (sets.iter().enumerate())
            .filter(|(_, (n, _))| *n > 0)
            .map(|(i, (n, _))| Reverse((at(0, *n), i, 0)))
            .collect();
        std::iter::from_fn(move || {
            let mut top = next.peek_mut()?;
            let Reverse((_, i, j)) = *top;
            let (n, slots) = &mut sets[i];
            if j + 1 < *n {
                *top = Reverse((at(j + 1, *n), i, j + 1));
            } else {
                PeekMut::pop(top);
            }
            slots.next()
        })
    }

    /// Takes every slot out.
    pub(super) fn take_all(&mut self) -> Vec<S> {
        let mut out = Vec::with_capacity(std::mem::take(&mut self.len));
        for (_, mut set) in self.namespaces.drain() {
            out.extend(set.drain());
        }
        out
    }

    /// Makes room for `additional` more slots: in the one set, or spread over the namespaces
    /// as the keys held now are (empty, it has no namespaces to size: they grow as keys come).
    pub(super) fn reserve(&mut self, additional: usize) {
        if !self.by_namespace {
            return self.reserve_set("", additional);
        }
        let held = self.len.max(1);
        for set in self.namespaces.values_mut() {
            set.reserve(additional.saturating_mul(set.len()) / held);
        }
    }

    /// Makes room for `additional` more slots in set `set` (see [`set_of`](Self::set_of) and
    /// [`SlotSet::reserve`]).
    pub(super) fn reserve_set(&mut self, set: &str, additional: usize) {
        match self.namespaces.get_mut(set) {
            Some(slots) => slots.reserve(additional),
            None => {
                let mut slots = SlotSet::default();
                slots.reserve(additional);
                self.namespaces.insert(set.into(), slots);
            }
        }
    }
}

impl<S: Borrow<str> + Eq> Items<S> {
    /// Keeps the slots in one set per namespace from now on (a namespace index was asked for).
    pub(super) fn split_by_namespace(&mut self) {
        if !self.by_namespace {
            let slots = self.take_all();
            self.by_namespace = true;
            self.replace_all(slots);
        }
    }

    /// [`replace_all_hashed`](Self::replace_all_hashed), hashing each key.
    pub(super) fn replace_all(&mut self, slots: Vec<S>) -> Vec<S> {
        let hashed = (slots.into_iter())
            .map(|slot| (key_hash(Borrow::<str>::borrow(&slot)), slot))
            .collect();
        self.replace_all_hashed(hashed)
    }

    /// Puts `slot` in, in place of the slot of its key if there is one, which it returns.
    pub(super) fn replace(&mut self, slot: S) -> Option<S> {
        let namespace = self.set_of(slot.borrow());
        let set = match self.namespaces.get_mut(namespace) {
            Some(set) => set,
            None => self.namespaces.entry(namespace.into()).or_default(),
        };
        let old = set.replace(slot);
        self.len += usize::from(old.is_none());
        old
    }

    /// [`SlotSet::replace_all_hashed`], each slot into its namespace's set: returns the slots
    /// replaced.
    pub(super) fn replace_all_hashed(&mut self, hashed: Vec<(u64, S)>) -> Vec<S> {
        // A list's page comes in key order, where a namespace's keys come together (a
        // snapshot's, interleaved: most keys then look their set up).
        let mut groups: Vec<Vec<(u64, S)>> = Vec::new();
        let mut group_of: HashMap<Box<str>, usize> = HashMap::new();
        let mut last = 0;
        for (hash, slot) in hashed {
            let namespace = self.set_of(slot.borrow());
            let previous = groups.get(last).and_then(|g| g.last());
            let group = match previous {
                Some((_, previous)) if self.set_of(previous.borrow()) == namespace => last,
                _ => match group_of.get(namespace) {
                    Some(&group) => group,
                    None => {
                        group_of.insert(namespace.into(), groups.len());
                        groups.push(Vec::new());
                        groups.len() - 1
                    }
                },
            };
            groups[group].push((hash, slot));
            last = group;
        }
        let mut replaced = Vec::new();
        for (namespace, group) in group_of {
            let slots = std::mem::take(&mut groups[group]);
            let added = slots.len();
            let set = self.namespaces.entry(namespace).or_default();
            let old = set.replace_all_hashed(slots);
            self.len += added - old.len();
            replaced.extend(old);
        }
        replaced
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn room_that_cannot_be_allocated_is_not_made() {
        // A snapshot's key count, read before its checksum, sizes the store: a count no
        // memory holds must not abort the process.
        let mut set: SlotSet<String> = SlotSet::default();
        set.reserve(usize::MAX / 2);
        set.reserve(1 << 50);
        set.replace("k".to_owned());
        assert_eq!(set.get("k").map(String::as_str), Some("k"));
    }

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

    fn items(keys: impl IntoIterator<Item = String>) -> Items<String> {
        let mut items = Items::default();
        items.replace_all(keys.into_iter().collect());
        items
    }

    #[test]
    fn items_are_kept_by_namespace_and_counted() {
        let mut items = items(["a/1", "b/1", "a/2", "top", "a/1"].map(str::to_owned));
        assert_eq!(items.len(), 4, "a key twice is held once");
        assert_eq!(
            items.namespaces().count(),
            1,
            "one set until a namespace index"
        );
        items.split_by_namespace();
        assert_eq!(items.len(), 4);
        assert_eq!(items.get("a/2").map(String::as_str), Some("a/2"));
        assert_eq!(items.get("top").map(String::as_str), Some("top"));
        assert_eq!(items.namespace("a").map(SlotSet::len), Some(2));
        assert_eq!(items.namespace("").map(SlotSet::len), Some(1));
        assert_eq!(items.replace("b/2".to_owned()), None);
        assert_eq!(items.replace("b/2".to_owned()).as_deref(), Some("b/2"));
        let page = vec![
            (key_hash("b/3"), "b/3".to_owned()),
            (key_hash("a/1"), "a/1".to_owned()),
        ];
        assert_eq!(items.replace_all_hashed(page), vec!["a/1".to_owned()]);
        assert_eq!(items.len(), 6);
        assert_eq!(items.take("top").as_deref(), Some("top"));
        assert!(items.namespace("").is_none(), "an emptied namespace goes");
        assert!(items.take("top").is_none());
        let mut names: Vec<&str> = items.namespaces().map(|(ns, _)| ns).collect();
        names.sort_unstable();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(items.iter().count(), 5);
        assert_eq!(items.take_all().len(), 5);
        assert_eq!((items.len(), items.iter().count()), (0, 0));
    }

    #[test]
    fn the_mixed_order_samples_every_namespace_in_proportion() {
        let big = (0..900).map(|i| format!("big/{i}"));
        let mut items = items(big.chain((0..100).map(|i| format!("small/{i}"))));
        items.split_by_namespace();
        items.reserve_set("empty", 10);
        let first: Vec<&String> = items.iter_mixed().take(100).collect();
        let small = first.iter().filter(|k| k.starts_with("small/")).count();
        assert!(
            (9..=11).contains(&small),
            "{small} of the first 100 from a tenth"
        );
        let all: HashSet<&String> = items.iter_mixed().collect();
        assert_eq!(all.len(), 1000, "every slot once");
        assert!(
            items.iter_mixed().eq(items.iter_mixed()),
            "the same order again"
        );
    }

    #[test]
    fn each_set_hashes_with_its_own_seed() {
        // One seed for all would make a set iterated into another crowd its buckets.
        let (a, b) = (SlotSet::<String>::default(), SlotSet::<String>::default());
        let differ = (0..4).any(|i| {
            let key = format!("k{i}");
            a.hash(&key) != b.hash(&key)
        });
        assert!(differ, "two sets hash keys alike");
    }
}
