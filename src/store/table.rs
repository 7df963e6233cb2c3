//! The items and indexes behind an [`Indexer`](super::Indexer), generic over how one object is
//! held: shared as decoded (`Arc<Object<T>>`, the default) or packed into its encoded bytes (the
//! compact mode, see [`compact`](super::compact)).
//!
//! The items and every index hold the same slot (a pointer hashed and compared by the object's
//! key), so an object costs one slot per index value and no copy of its key. With a namespace
//! index, the items are kept in one set per namespace ([`Items`]), which are that index: it
//! costs nothing more.

use std::any::Any;
use std::borrow::Borrow;
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::ops::ControlFlow;
use std::sync::Arc;

use super::slot_set::{key_hash, Items, SlotSet};
use super::{IndexFunc, Indexers};
use crate::object::EncodedObject;
use crate::object::Object;
use crate::object::Stamp;

/// How a table holds its objects.
pub(super) trait Repr<T>: Send + Sync + Sized + 'static {
    /// What the items and the indexes keep of an object; hashed and compared by key.
    type Slot: Clone + Eq + Hash + Borrow<str> + Send + Sync;
    /// The slot of `obj`. Calls `seen` once with the object as reads will see it (`obj`, or a
    /// decoded copy), which is what the indexes must see.
    fn pack(&mut self, obj: &Arc<Object<T>>, seen: &mut dyn FnMut(&Object<T>)) -> Self::Slot;
    /// [`pack`](Self::pack) for each of `objs`, in order (a page of a list); `seen` gets the
    /// index of each object in `objs`.
    fn pack_all(
        &mut self,
        objs: &[Arc<Object<T>>],
        seen: &mut dyn FnMut(usize, &Object<T>),
    ) -> Vec<Self::Slot> {
        let mut slots = Vec::with_capacity(objs.len());
        for (i, obj) in objs.iter().enumerate() {
            slots.push(self.pack(obj, &mut |o| seen(i, o)));
        }
        slots
    }
    /// The object in `slot`; `None` only if a packed value no longer decodes (logged).
    fn unpack(&self, slot: &Self::Slot) -> Option<Arc<Object<T>>>;
    /// The object's `mod_revision`, without unpacking it.
    fn mod_revision(&self, slot: &Self::Slot) -> i64;
    /// The object's stamp ([`Object::stamp`]), without unpacking it.
    fn stamp(&self, slot: &Self::Slot) -> Option<Stamp>;
    /// The object's key as a shared string.
    fn shared_key(&self, slot: &Self::Slot) -> Arc<str>;
    /// `slot` left the table (its key was deleted or given another slot).
    fn release(&mut self, _slot: &Self::Slot) {}
    /// A slot of another table of this representation, to be held here too without a copy of
    /// the object; `None` when it cannot be shared.
    fn adopt(&mut self, slot: &Self::Slot) -> Option<Self::Slot> {
        Some(slot.clone())
    }
    /// Whether the slots hold enough dead bytes to be worth copying into fresh ones.
    fn needs_repack(&self) -> bool {
        false
    }
    /// Fresh slots for `slots`, in order.
    fn repack(&mut self, slots: Vec<Self::Slot>) -> Vec<Self::Slot> {
        slots
    }
    /// The name of the codec the slots hold values encoded with (a compact table).
    fn codec_name(&self) -> Option<&'static str> {
        None
    }
    /// The object `encoded` holds, decoded as reads would see it (a compact table).
    fn decode_encoded(&self, _encoded: &EncodedObject<'_>) -> Option<Object<T>> {
        None
    }
    /// Slots for `objs` as they are, without decoding them (a compact table); `None` when
    /// the representation holds decoded objects.
    fn pack_encoded(&mut self, _objs: &[EncodedObject<'_>]) -> Option<Vec<Self::Slot>> {
        None
    }
    /// `slot`'s record as a snapshot file holds it (`store::compact`'s layout): a packed
    /// object's; `None` for one held decoded.
    fn record<'a>(&self, _slot: &'a Self::Slot) -> Option<&'a [u8]> {
        None
    }
    /// An empty representation of the same kind.
    fn empty(&self) -> Self;
    /// Whether objects are packed (then unpacking decodes).
    fn packed(&self) -> bool;
}

/// One object of a table as a snapshot writes it (see [`Storage::for_each_record`]).
pub(crate) enum Item<'a, T> {
    /// A packed object's record, with its values for each index asked for, in that order
    /// (each index's values as a set).
    Record(&'a [u8], &'a [Vec<&'a str>]),
    /// An object held decoded.
    Decoded(Arc<Object<T>>),
}

/// The default representation: the decoded object itself, shared.
#[derive(Clone)]
pub(super) struct Shared;

/// An `Arc<Object<T>>` hashed and compared by its key.
pub(super) struct SharedSlot<T>(pub(super) Arc<Object<T>>);

impl<T> Clone for SharedSlot<T> {
    fn clone(&self) -> Self {
        SharedSlot(self.0.clone())
    }
}

impl<T> PartialEq for SharedSlot<T> {
    fn eq(&self, other: &Self) -> bool {
        self.0.key() == other.0.key()
    }
}

impl<T> Eq for SharedSlot<T> {}

impl<T> Hash for SharedSlot<T> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // As `str` hashes, so that lookups by `&str` find it (the `Borrow` contract).
        self.0.key().hash(state)
    }
}

impl<T> Borrow<str> for SharedSlot<T> {
    fn borrow(&self) -> &str {
        self.0.key()
    }
}

impl<T: Send + Sync + 'static> Repr<T> for Shared {
    type Slot = SharedSlot<T>;

    fn pack(&mut self, obj: &Arc<Object<T>>, seen: &mut dyn FnMut(&Object<T>)) -> SharedSlot<T> {
        seen(obj);
        SharedSlot(obj.clone())
    }

    fn unpack(&self, slot: &SharedSlot<T>) -> Option<Arc<Object<T>>> {
        Some(slot.0.clone())
    }

    fn mod_revision(&self, slot: &SharedSlot<T>) -> i64 {
        slot.0.mod_revision
    }

    fn stamp(&self, slot: &SharedSlot<T>) -> Option<Stamp> {
        slot.0.stamp()
    }

    fn shared_key(&self, slot: &SharedSlot<T>) -> Arc<str> {
        slot.0.shared_key().clone()
    }

    fn empty(&self) -> Self {
        Shared
    }

    fn packed(&self) -> bool {
        false
    }
}

/// The values of `obj` for each of `indexers` whose values the key does not give, in their
/// order (with only the namespace index: none, and nothing allocated).
fn index_values<T>(indexers: &Indexers<T>, obj: &Object<T>) -> Vec<Vec<String>> {
    indexers
        .values()
        .filter(|f| !f.keyed())
        .map(|f| f.values(obj))
        .collect()
}

/// Removes `key` from the set of `value` in `index`, and the set if it empties.
fn unindex<S: Borrow<str> + Eq + Hash>(
    index: &mut HashMap<String, SlotSet<S>>,
    value: &str,
    key: &str,
) {
    if let Some(set) = index.get_mut(value) {
        set.remove(key);
        if set.is_empty() {
            index.remove(value);
        }
    }
}

/// The object-safe face of a [`Table`], whatever its representation.
pub(super) trait Storage<T>: Send + Sync {
    fn get(&self, key: &str) -> Option<Arc<Object<T>>>;
    /// The `mod_revision` of the object under `key`, without unpacking it.
    fn mod_revision(&self, key: &str) -> Option<i64>;
    /// The stamp of the object under `key`, without unpacking it.
    fn stamp_of(&self, key: &str) -> Option<Stamp>;
    fn len(&self) -> usize;
    /// Makes room for `additional` more keys (see `Items::reserve`).
    fn reserve(&mut self, additional: usize);
    /// The set of the items `key` is kept in: its namespace, once a namespace index exists.
    fn items_set_of<'k>(&self, key: &'k str) -> &'k str;
    /// Makes room for `additional` more keys in the items' set `set`.
    fn reserve_items_set(&mut self, set: &str, additional: usize);
    /// Defers repacking while a list builds this table: keys it adopts from the cache keep
    /// their chunks, which look mostly dead until the list is whole (a snapshot's records,
    /// in hash order, spread every list page over all of them). `false` ends the deferral,
    /// repacking if the whole table needs it.
    fn defer_repacks(&mut self, defer: bool);
    fn keys(&self) -> Vec<Arc<str>>;
    fn for_each(&self, f: &mut dyn FnMut(Arc<Object<T>>));
    /// Each object as a snapshot writes it, decoding none that is packed: its record (see
    /// [`Repr::record`]) with its values for each of `indexes`, taken from the indexes
    /// themselves (as sets: in no particular order, each once; the namespace index's from the
    /// key); or the object, where it is held decoded. Stops when `f` breaks. In hash order,
    /// the namespaces interleaved ([`Items::iter_mixed`]): any run is about a random sample.
    /// The order is the same on every call on a table that did not change (a snapshot's
    /// writer walks it twice).
    fn for_each_record(&self, indexes: &[&str], f: &mut dyn FnMut(Item<'_, T>) -> ControlFlow<()>);
    fn for_each_revision(&self, f: &mut dyn FnMut(&str, i64));
    /// Inserts or replaces, keeping the indexes of `indexers`; returns the replaced object.
    fn add(&mut self, indexers: &Indexers<T>, obj: Arc<Object<T>>) -> Option<Arc<Object<T>>>;
    /// Inserts or replaces every object of `objs` (a page of a list), keeping the indexes.
    fn add_all(&mut self, indexers: &Indexers<T>, objs: &[Arc<Object<T>>]);
    /// Makes room for `additional` more keys under `value` in index `name` (not the namespace
    /// index: see [`reserve_items_set`](Self::reserve_items_set)).
    fn reserve_index(&mut self, name: &str, value: &str, additional: usize);
    /// The name of the codec a compact table encodes with.
    fn codec_name(&self) -> Option<&'static str>;
    /// The object `encoded` holds, decoded with a compact table's codec.
    fn decode_encoded(&self, encoded: &EncodedObject<'_>) -> Option<Object<T>>;
    /// Inserts or replaces every object of `objs` without decoding them (a compact table),
    /// indexed by the values they carry (in the order of the sorted index names); `false`
    /// when the table holds decoded objects.
    fn add_encoded(&mut self, indexers: &Indexers<T>, objs: &[EncodedObject<'_>]) -> bool;
    /// Removes, keeping the indexes of `indexers`; returns the removed object.
    fn delete(&mut self, indexers: &Indexers<T>, key: &str) -> Option<Arc<Object<T>>>;
    /// Removes from the items only (for a table being retired), unpacked only if `unpack`:
    /// the removed object's revision, and the object.
    fn take(&mut self, key: &str, unpack: bool) -> Option<(i64, Option<Arc<Object<T>>>)>;
    /// Takes `key` from `from`, a table of the same representation, if it holds it in the
    /// state `stamp` names: both tables then share the object (a compact table, its packed bytes),
    /// indexed here by `indexers`. Returns whether it did.
    fn adopt(
        &mut self,
        indexers: &Indexers<T>,
        from: &dyn Storage<T>,
        key: &str,
        stamp: &Stamp,
    ) -> bool;
    /// Builds (or rebuilds) index `name` over every item.
    fn build_index(&mut self, name: &str, func: &IndexFunc<T>);
    /// Whether index `name` exists.
    fn has_index(&self, name: &str) -> bool;
    fn by_index(&self, name: &str, value: &str) -> Vec<Arc<Object<T>>>;
    fn index_keys(&self, name: &str, value: &str) -> Vec<Arc<str>>;
    /// The objects with any of `values` in index `name`, each once.
    fn matching(&self, name: &str, values: &[String]) -> Vec<Arc<Object<T>>>;
    fn index_values(&self, name: &str) -> Vec<String>;
    /// An empty table of the same representation, without indexes.
    fn empty(&self) -> Box<dyn Storage<T>>;
    fn boxed_clone(&self) -> Box<dyn Storage<T>>;
    fn packed(&self) -> bool;
    fn as_any(&self) -> &dyn Any;
}

/// Objects by key and the indexes over them, every one of them holding `R::Slot`s.
pub(super) struct Table<T, R: Repr<T>> {
    repr: R,
    items: Items<R::Slot>,
    /// The indexes whose values the key gives (the namespace index): the items' own sets.
    keyed_indexes: Vec<String>,
    /// Every other index: each value's slots.
    indices: HashMap<String, HashMap<String, SlotSet<R::Slot>>>,
    /// See [`Storage::defer_repacks`].
    repacks_deferred: bool,
}

impl<T, R: Repr<T>> Table<T, R> {
    pub(super) fn new(repr: R) -> Self {
        Table {
            repr,
            items: Items::default(),
            keyed_indexes: Vec::new(),
            indices: HashMap::new(),
            repacks_deferred: false,
        }
    }

    /// Whether index `name` is answered by the items' namespaces.
    fn keyed(&self, name: &str) -> bool {
        self.keyed_indexes.iter().any(|k| k == name)
    }

    /// The slots under `value` in index `name`.
    fn index_set(&self, name: &str, value: &str) -> Option<&SlotSet<R::Slot>> {
        if self.keyed(name) {
            return self.items.namespace(value);
        }
        self.indices.get(name)?.get(value)
    }

    fn unpack_all<'a>(
        &'a self,
        slots: impl Iterator<Item = &'a R::Slot> + 'a,
    ) -> Vec<Arc<Object<T>>> {
        slots.filter_map(|s| self.repr.unpack(s)).collect()
    }

    /// Moves `key` from the index values `old` to `new` (with its new slot) in index `name`.
    fn reindex(
        &mut self,
        name: &str,
        key: &str,
        old: Vec<String>,
        new: Option<(Vec<String>, &R::Slot)>,
    ) {
        let Some(index) = self.indices.get_mut(name) else {
            return;
        };
        let (new_values, slot) = match new {
            Some((values, slot)) => (values, Some(slot)),
            None => (Vec::new(), None),
        };
        for value in old.iter().filter(|v| !new_values.contains(v)) {
            unindex(index, value, key);
        }
        if let Some(slot) = slot {
            // `replace`, not `insert`: the set must hold the new slot even where the value
            // stayed, since the slot is the object.
            for value in new_values {
                index.entry(value).or_default().replace(slot.clone());
            }
        }
    }
}

impl<T, R: Repr<T>> Table<T, R> {
    /// Puts `slot` in the items and indexes, under `values` (see [`index_values`]); returns
    /// the object it replaced.
    fn insert(
        &mut self,
        indexers: &Indexers<T>,
        slot: R::Slot,
        values: Vec<Vec<String>>,
    ) -> Option<Arc<Object<T>>> {
        let replaced = self.items.replace(slot.clone());
        let old = replaced.as_ref().and_then(|s| self.repr.unpack(s));
        let key: &str = slot.borrow();
        if replaced.is_some() && old.is_none() {
            // The replaced object's index values are unknown: look for its key everywhere.
            self.unindex_everywhere(key);
        }
        let mut values = values.into_iter();
        for (name, func) in indexers {
            if func.keyed() {
                // The items are that index.
                continue;
            }
            let new_values = values.next().unwrap_or_default();
            let old_values = old.as_deref().map(|o| func.values(o)).unwrap_or_default();
            self.reindex(name, key, old_values, Some((new_values, &slot)));
        }
        if let Some(replaced) = replaced {
            self.repr.release(&replaced);
        }
        old
    }

    /// Removes `key` from every index, whatever its values.
    fn unindex_everywhere(&mut self, key: &str) {
        for index in self.indices.values_mut() {
            index.retain(|_, set| {
                set.remove(key);
                !set.is_empty()
            });
        }
    }

    /// Copies every object into fresh slots once the old ones hold more dead bytes than live.
    fn repack_if_needed(&mut self) {
        if self.repacks_deferred || !self.repr.needs_repack() {
            return;
        }
        let slots = self.items.take_all();
        self.items.replace_all(self.repr.repack(slots));
        let items = &self.items;
        for index in self.indices.values_mut() {
            for set in index.values_mut() {
                *set = set
                    .iter()
                    .filter_map(|s| items.get(Borrow::<str>::borrow(s)).cloned())
                    .collect();
            }
        }
    }
}

impl<T, R> Clone for Table<T, R>
where
    R: Repr<T> + Clone,
{
    fn clone(&self) -> Self {
        Table {
            repr: self.repr.clone(),
            items: self.items.clone(),
            keyed_indexes: self.keyed_indexes.clone(),
            indices: self.indices.clone(),
            repacks_deferred: self.repacks_deferred,
        }
    }
}

impl<T, R> Storage<T> for Table<T, R>
where
    T: Send + Sync + 'static,
    R: Repr<T> + Clone,
{
    fn get(&self, key: &str) -> Option<Arc<Object<T>>> {
        self.items.get(key).and_then(|s| self.repr.unpack(s))
    }

    fn mod_revision(&self, key: &str) -> Option<i64> {
        self.items.get(key).map(|s| self.repr.mod_revision(s))
    }

    fn stamp_of(&self, key: &str) -> Option<Stamp> {
        self.items.get(key).and_then(|s| self.repr.stamp(s))
    }

    fn len(&self) -> usize {
        self.items.len()
    }

    fn reserve(&mut self, additional: usize) {
        self.items.reserve(additional);
    }

    fn items_set_of<'k>(&self, key: &'k str) -> &'k str {
        self.items.set_of(key)
    }

    fn reserve_items_set(&mut self, set: &str, additional: usize) {
        self.items.reserve_set(set, additional);
    }

    fn defer_repacks(&mut self, defer: bool) {
        self.repacks_deferred = defer;
        self.repack_if_needed();
    }

    fn keys(&self) -> Vec<Arc<str>> {
        self.items.iter().map(|s| self.repr.shared_key(s)).collect()
    }

    fn for_each(&self, f: &mut dyn FnMut(Arc<Object<T>>)) {
        for obj in self.items.iter().filter_map(|s| self.repr.unpack(s)) {
            f(obj);
        }
    }

    fn for_each_record(&self, indexes: &[&str], f: &mut dyn FnMut(Item<'_, T>) -> ControlFlow<()>) {
        // Every index entry as (its record's address, the index's number, the value), sorted:
        // a record is known by its address, so an entry left behind by an older record of the
        // same key is never taken for the current one's. Sorted, not a map of each key's
        // values: one allocation, not one or more a key.
        let mut entries: Vec<(usize, usize, &str)> = Vec::new();
        for (i, name) in indexes.iter().enumerate() {
            let Some(index) = self.indices.get(*name) else {
                continue;
            };
            for (value, set) in index {
                entries.extend(
                    set.iter()
                        .filter_map(|slot| self.repr.record(slot))
                        .map(|record| (record.as_ptr() as usize, i, value.as_str())),
                );
            }
        }
        entries.sort_unstable();
        let keyed: Vec<usize> = (indexes.iter().enumerate())
            .filter(|(_, name)| self.keyed(name))
            .map(|(i, _)| i)
            .collect();
        let mut values: Vec<Vec<&str>> = vec![Vec::new(); indexes.len()];
        for slot in self.items.iter_mixed() {
            let flow = match self.repr.record(slot) {
                Some(record) => {
                    values.iter_mut().for_each(Vec::clear);
                    let at = record.as_ptr() as usize;
                    let first = entries.partition_point(|(a, _, _)| *a < at);
                    for (_, i, value) in entries[first..].iter().take_while(|(a, _, _)| *a == at) {
                        values[*i].push(value);
                    }
                    for &i in &keyed {
                        values[i].push(self.items.set_of(slot.borrow()));
                    }
                    f(Item::Record(record, &values))
                }
                None => match self.repr.unpack(slot) {
                    Some(obj) => f(Item::Decoded(obj)),
                    None => ControlFlow::Continue(()),
                },
            };
            if flow.is_break() {
                return;
            }
        }
    }

    fn for_each_revision(&self, f: &mut dyn FnMut(&str, i64)) {
        for slot in self.items.iter() {
            f(slot.borrow(), self.repr.mod_revision(slot));
        }
    }

    fn add(&mut self, indexers: &Indexers<T>, obj: Arc<Object<T>>) -> Option<Arc<Object<T>>> {
        let mut values = Vec::new();
        let slot = self
            .repr
            .pack(&obj, &mut |seen| values = index_values(indexers, seen));
        let old = self.insert(indexers, slot, values);
        self.repack_if_needed();
        old
    }

    fn reserve_index(&mut self, name: &str, value: &str, additional: usize) {
        if let Some(index) = self.indices.get_mut(name) {
            index
                .entry(value.to_owned())
                .or_default()
                .reserve(additional);
        }
    }

    fn codec_name(&self) -> Option<&'static str> {
        self.repr.codec_name()
    }

    fn decode_encoded(&self, encoded: &EncodedObject<'_>) -> Option<Object<T>> {
        self.repr.decode_encoded(encoded)
    }

    fn add_encoded(&mut self, indexers: &Indexers<T>, objs: &[EncodedObject<'_>]) -> bool {
        let Some(slots) = self.repr.pack_encoded(objs) else {
            return false;
        };
        // Each object's values come in the order of the sorted names: `order` gives, for
        // each of the indexers in their own order, where its values are.
        let mut sorted: Vec<&String> = indexers.keys().collect();
        sorted.sort();
        let order: Vec<usize> = indexers
            .keys()
            .map(|name| sorted.iter().position(|s| *s == name).unwrap_or(usize::MAX))
            .collect();
        let names: Vec<&String> = indexers.keys().collect();
        // Each key hashed once for all its sets, where the file's parse did not already.
        let hashes: Vec<u64> = objs
            .iter()
            .map(|o| o.record.map_or_else(|| key_hash(o.key), |r| r.key_hash))
            .collect();
        // Each set is filled a page at a time, in the order of its buckets (see `SlotSet`).
        // The indexes first, so that the items take the slots themselves, not copies (each
        // copy of a slot of a snapshot's page counts on its page's one reference count).
        index_encoded(&mut self.indices, &names, &order, &slots, &hashes, objs);
        let replaced = (self.items).replace_all_hashed(hashes.iter().copied().zip(slots).collect());
        if !replaced.is_empty() {
            // A key already held, or twice in this page (which a snapshot never holds): as any
            // replacement; the page's last record of the key is the one kept.
            let last: HashMap<&str, usize> =
                objs.iter().enumerate().map(|(i, o)| (o.key, i)).collect();
            for old in replaced {
                let key: &str = old.borrow();
                self.unindex_everywhere(key);
                let kept = self.items.get(key).cloned();
                if let (Some(kept), Some(&at)) = (kept, last.get(key)) {
                    for (name, &i) in names.iter().zip(&order) {
                        let Some(index) = self.indices.get_mut(name.as_str()) else {
                            continue;
                        };
                        for &value in objs[at].index.get(i) {
                            index
                                .entry(value.to_owned())
                                .or_default()
                                .replace(kept.clone());
                        }
                    }
                }
                self.repr.release(&old);
            }
        }
        self.repack_if_needed();
        true
    }

    fn add_all(&mut self, indexers: &Indexers<T>, objs: &[Arc<Object<T>>]) {
        let mut values = vec![Vec::new(); objs.len()];
        let slots = self.repr.pack_all(objs, &mut |i, seen| {
            values[i] = index_values(indexers, seen)
        });
        for (slot, values) in slots.into_iter().zip(values) {
            self.insert(indexers, slot, values);
        }
        self.repack_if_needed();
    }

    fn adopt(
        &mut self,
        indexers: &Indexers<T>,
        from: &dyn Storage<T>,
        key: &str,
        stamp: &Stamp,
    ) -> bool {
        let Some(from) = from.as_any().downcast_ref::<Self>() else {
            return false;
        };
        let Some(slot) = from.items.get(key) else {
            return false;
        };
        if from.repr.stamp(slot).as_ref() != Some(stamp) {
            return false;
        }
        // The index values come from the object as reads see it (decoded once here, and
        // dropped at once, if the table is compact).
        let values = if indexers.is_empty() {
            Vec::new()
        } else {
            match from.repr.unpack(slot) {
                Some(obj) => index_values(indexers, &obj),
                None => return false,
            }
        };
        let Some(slot) = self.repr.adopt(slot) else {
            return false;
        };
        self.insert(indexers, slot, values);
        true
    }

    fn delete(&mut self, indexers: &Indexers<T>, key: &str) -> Option<Arc<Object<T>>> {
        let slot = self.items.take(key)?;
        let old = self.repr.unpack(&slot);
        if let Some(old) = &old {
            for (name, func) in indexers.iter().filter(|(_, f)| !f.keyed()) {
                self.reindex(name, key, func.values(old), None);
            }
        } else {
            // Its index values are unknown: look for it everywhere.
            self.unindex_everywhere(key);
        }
        self.repr.release(&slot);
        self.repack_if_needed();
        old
    }

    fn take(&mut self, key: &str, unpack: bool) -> Option<(i64, Option<Arc<Object<T>>>)> {
        let slot = self.items.take(key)?;
        let revision = self.repr.mod_revision(&slot);
        let obj = if unpack {
            self.repr.unpack(&slot)
        } else {
            None
        };
        self.repr.release(&slot);
        Some((revision, obj))
    }

    fn build_index(&mut self, name: &str, func: &IndexFunc<T>) {
        self.keyed_indexes.retain(|k| k != name);
        if func.keyed() {
            self.indices.remove(name);
            self.keyed_indexes.push(name.to_owned());
            self.items.split_by_namespace();
            return;
        }
        let mut index: HashMap<String, SlotSet<R::Slot>> = HashMap::new();
        for slot in self.items.iter() {
            let Some(obj) = self.repr.unpack(slot) else {
                continue;
            };
            for value in func.values(&obj) {
                index.entry(value).or_default().replace(slot.clone());
            }
        }
        self.indices.insert(name.to_owned(), index);
    }

    fn has_index(&self, name: &str) -> bool {
        self.indices.contains_key(name) || self.keyed(name)
    }

    fn by_index(&self, name: &str, value: &str) -> Vec<Arc<Object<T>>> {
        match self.index_set(name, value) {
            Some(set) => self.unpack_all(set.iter()),
            None => Vec::new(),
        }
    }

    fn index_keys(&self, name: &str, value: &str) -> Vec<Arc<str>> {
        match self.index_set(name, value) {
            Some(set) => set.iter().map(|s| self.repr.shared_key(s)).collect(),
            None => Vec::new(),
        }
    }

    fn matching(&self, name: &str, values: &[String]) -> Vec<Arc<Object<T>>> {
        let mut slots: HashSet<&R::Slot> = HashSet::new();
        for value in values {
            if let Some(set) = self.index_set(name, value) {
                slots.extend(set.iter());
            }
        }
        self.unpack_all(slots.into_iter())
    }

    fn index_values(&self, name: &str) -> Vec<String> {
        if self.keyed(name) {
            return (self.items.namespaces())
                .filter(|(_, set)| !set.is_empty())
                .map(|(ns, _)| ns.to_owned())
                .collect();
        }
        self.indices
            .get(name)
            .map(|index| index.keys().cloned().collect())
            .unwrap_or_default()
    }

    fn empty(&self) -> Box<dyn Storage<T>> {
        Box::new(Table::<T, R>::new(self.repr.empty()))
    }

    fn boxed_clone(&self) -> Box<dyn Storage<T>> {
        Box::new(self.clone())
    }

    fn packed(&self) -> bool {
        self.repr.packed()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Puts each of `slots` (those of `objs`, in order) into the sets of its index values:
/// index `names[n]`'s values are `objs[_].index.get(order[n])`.
fn index_encoded<S: Clone + Eq + Borrow<str>>(
    indices: &mut HashMap<String, HashMap<String, SlotSet<S>>>,
    names: &[&String],
    order: &[usize],
    slots: &[S],
    hashes: &[u64],
    objs: &[EncodedObject<'_>],
) {
    for (name, &i) in names.iter().zip(order) {
        let Some(index) = indices.get_mut(name.as_str()) else {
            continue;
        };
        // A list's pages come in key order, where neighbours mostly share their values (a
        // namespace): the previous value's group is tried before the map. (A snapshot's
        // records come in the store's hash order, sorting them cost its write 0.6 s at 1M.)
        let mut groups: Vec<(&str, Vec<(u64, S)>)> = Vec::new();
        let mut group_of: HashMap<&str, usize> = HashMap::new();
        let mut previous: Option<(&str, usize)> = None;
        for ((slot, &hash), o) in slots.iter().zip(hashes).zip(objs) {
            for &value in o.index.get(i) {
                let group = match previous {
                    Some((v, group)) if v == value => group,
                    _ => {
                        let group = *group_of.entry(value).or_insert_with(|| {
                            groups.push((value, Vec::new()));
                            groups.len() - 1
                        });
                        previous = Some((value, group));
                        group
                    }
                };
                groups[group].1.push((hash, slot.clone()));
            }
        }
        for (value, slots) in groups {
            // A value already indexed costs no allocation.
            match index.get_mut(value) {
                Some(set) => drop(set.replace_all_hashed(slots)),
                None => {
                    let mut set = SlotSet::default();
                    set.replace_all_hashed(slots);
                    index.insert(value.to_owned(), set);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{Codec, CodecError};
    use crate::object::IndexValues;
    use crate::store::compact::PackedRepr;

    struct Decimal;

    impl Codec<u32> for Decimal {
        fn decode(&self, bytes: &[u8]) -> Result<u32, CodecError> {
            Ok(std::str::from_utf8(bytes)?.parse()?)
        }
        fn encode(&self, value: &u32) -> Result<Vec<u8>, CodecError> {
            Ok(value.to_string().into_bytes())
        }
    }

    /// A compact table of numbers, indexed by their parity.
    fn packed_by_parity() -> (Indexers<u32>, Table<u32, PackedRepr<u32>>) {
        let mut indexers: Indexers<u32> = HashMap::new();
        indexers.insert(
            "parity".into(),
            IndexFunc::new(|o: &Object<u32>| vec![(o.value % 2).to_string()]),
        );
        let mut table = Table::new(PackedRepr::<u32>::new(Arc::new(Decimal)));
        table.build_index("parity", &indexers["parity"]);
        (indexers, table)
    }

    #[test]
    fn a_repack_moves_every_slot_of_the_items_and_indexes_to_fresh_chunks() {
        let (indexers, mut table) = packed_by_parity();
        let objs: Vec<_> = (0..200u32)
            .map(|i| Arc::new(Object::new(format!("ns/k{i:03}"), 1, i)))
            .collect();
        table.add_all(&indexers, &objs);
        let first = table.items.get("ns/k199").unwrap().clone();
        for i in 0..150 {
            table.delete(&indexers, &format!("ns/k{i:03}"));
        }
        let kept = table.items.get("ns/k199").unwrap();
        assert!(!kept.same_chunk(&first), "repacked");
        for set in table.indices["parity"].values() {
            for slot in set {
                let item = table.items.get(Borrow::<str>::borrow(slot)).unwrap();
                assert!(slot.same_chunk(item), "an index still holds an old slot");
            }
        }
        assert_eq!(table.by_index("parity", "1").len(), 25);
        assert_eq!(table.get("ns/k150").map(|o| o.value), Some(150));

        // Objects stored one by one (watch events, DeltaFIFO pops) end up packed together too.
        for i in 0..100u32 {
            table.add(
                &indexers,
                Arc::new(Object::new(format!("ns/one{i:03}"), 2, i)),
            );
        }
        let together = (0..100)
            .filter(|i| {
                let key = format!("ns/one{i:03}");
                table.items.get(key.as_str()).unwrap().shares_chunk()
            })
            .count();
        assert!(together > 50, "only {together} of 100 share a chunk");
        assert_eq!(table.by_index("parity", "0").len(), 25 + 50);
    }

    #[test]
    fn encoded_pages_keep_the_last_record_of_a_key_in_the_items_and_indexes() {
        let (indexers, mut table) = packed_by_parity();
        let values: Vec<String> = (0..20u32).map(|i| i.to_string()).collect();
        const PARITIES: [&str; 2] = ["0", "1"];
        let record = |key: &'static str, value: usize| EncodedObject {
            key,
            value: values[value].as_bytes(),
            revisions: [value as i64 + 1, 1, 1, 0],
            digest: 0,
            index: IndexValues::new(&PARITIES[value % 2..value % 2 + 1], &[1]),
            record: None,
        };
        // Twice in one page, then again in the next, each time under the other parity.
        let first = [record("ns/a", 1), record("ns/b", 2), record("ns/a", 4)];
        assert!(table.add_encoded(&indexers, &first));
        assert_eq!(table.get("ns/a").map(|o| o.value), Some(4));
        assert_eq!(
            table.index_keys("parity", "1").len(),
            0,
            "a's odd record went"
        );
        assert!(table.add_encoded(&indexers, &[record("ns/a", 7)]));
        assert_eq!(table.len(), 2);
        assert_eq!(table.get("ns/a").map(|o| o.value), Some(7));
        let keys = |value| {
            let mut keys = table.index_keys("parity", value);
            keys.sort();
            keys
        };
        assert_eq!(keys("1"), vec![Arc::from("ns/a")]);
        assert_eq!(keys("0"), vec![Arc::from("ns/b")]);
        assert_eq!(table.by_index("parity", "1")[0].value, 7);
    }

    #[test]
    fn an_unchanged_object_is_adopted_without_a_copy_and_indexed() {
        let (indexers, mut live) = packed_by_parity();
        let objs: Vec<_> = (0..10u32)
            .map(|i| Arc::new(Object::new(format!("ns/k{i}"), 5, i).read_from(&[i as u8])))
            .collect();
        live.add_all(&indexers, &objs);
        let mut next = live.empty();
        next.build_index("parity", &indexers["parity"]);
        let stamp = |rev, value: u8| Stamp::new(rev, rev, 1, &[value]);
        assert!(next.adopt(&indexers, &live, "ns/k3", &stamp(5, 3)));
        assert!(
            !next.adopt(&indexers, &live, "ns/k4", &stamp(6, 4)),
            "another revision"
        );
        assert!(
            !next.adopt(&indexers, &live, "ns/k5", &stamp(5, 50)),
            "the same revisions, another value"
        );
        assert!(
            !next.adopt(&indexers, &live, "ns/k99", &stamp(5, 99)),
            "not there"
        );
        let next = next
            .as_any()
            .downcast_ref::<Table<u32, PackedRepr<u32>>>()
            .unwrap();
        assert!(next
            .items
            .get("ns/k3")
            .unwrap()
            .same_chunk(live.items.get("ns/k3").unwrap()));
        assert_eq!(next.len(), 1);
        assert_eq!(next.get("ns/k3").map(|o| o.value), Some(3));
        assert_eq!(next.index_keys("parity", "1").len(), 1);
        // A table of another representation cannot share its slots.
        let mut shared = Table::new(Shared);
        assert!(!shared.adopt(&indexers, &live, "ns/k3", &stamp(5, 3)));
    }
}
