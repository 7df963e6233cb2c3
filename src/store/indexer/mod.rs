use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::compact::PackedRepr;
use super::index::{namespace_indexers, Indexers, StoreError};
use super::table::{Item, Shared, Storage, Table};
use super::Store;
use crate::codec::Codec;
use crate::object::EncodedObject;
use crate::object::Object;
use crate::object::Stamp;

/// How often a warm start's sample must meet an index value before its set is reserved for
/// the keys that count stands for (4 of 64, a fair estimate; a value met once is usually one
/// key's own, a name or a uid, and a reserved set holds its memory for good).
const RESERVE_SEEN: usize = 4;

/// The values met at least [`RESERVE_SEEN`] times, and how often.
fn often<'a>(values: impl Iterator<Item = &'a str>) -> Vec<(&'a str, usize)> {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    values.for_each(|v| *seen.entry(v).or_default() += 1);
    seen.retain(|_, n| *n >= RESERVE_SEEN);
    seen.into_iter().collect()
}

/// A thread-safe store of objects by key, with named indexes (client-go's `Indexer` over its
/// `threadSafeMap`).
///
/// Invariants: for every registered index `i`, every stored object `o` and every value `v` in
/// `i(o)`, index `i` lists `o` under `v`, and nothing else. The items and the indexes hold the
/// same pointer to each object, never a copy of it or of its key.
///
/// A **compact** store ([`Indexer::compact`]) keeps each object packed with its value encoded by
/// a codec, and decodes it on every read: a fifth to a seventh of the memory of decoded objects
/// for the benchmark's JSON values, for a decode per object read (BENCHMARKS.md has both). Its
/// index values are computed when an object is stored, from the object as reads will see it;
/// reads decode, and the keys they return are new strings.
///
/// `Indexer` is a cheap handle: clones see the same store.
///
/// ```
/// use std::sync::Arc;
/// use etcd_informer::{Indexer, Object, NAMESPACE_INDEX};
/// let indexer = Indexer::<u32>::with_namespace_index();
/// indexer.add(Arc::new(Object::new("tmp/a", 1, 1)));
/// indexer.add(Arc::new(Object::new("prod/b", 2, 2)));
/// let keys = indexer.index_keys(NAMESPACE_INDEX, "tmp").unwrap();
/// assert_eq!(keys.iter().map(|k| &**k).collect::<Vec<_>>(), ["tmp/a"]);
/// ```
pub struct Indexer<T> {
    inner: Arc<RwLock<Inner<T>>>,
}

impl<T> Clone for Indexer<T> {
    fn clone(&self) -> Self {
        Indexer {
            inner: self.inner.clone(),
        }
    }
}

struct Inner<T> {
    table: Box<dyn Storage<T>>,
    indexers: Indexers<T>,
    /// The revision the content was last written at (see [`Indexer::revision`]).
    revision: i64,
    /// Counts the write locks taken: a proof about the content holds while it is unchanged.
    writes: u64,
    /// A later revision at which etcd's content was proven to be this content, or 0; reset by
    /// every write (see [`Indexer::proven_revision`]).
    proven: i64,
    /// The cluster id of the store the content was listed from (0: unknown), set with the
    /// content it names: what a snapshot of the content records.
    origin: u64,
}

/// A store's next content, keys and indexes, built away from the store (page by page while a
/// list is read) and installed in one step by a relist: the store's lock is then held only for
/// a swap.
///
/// ```
/// use std::sync::Arc;
/// use etcd_informer::{Indexer, Object, NAMESPACE_INDEX};
/// let indexer = Indexer::<u32>::with_namespace_index();
/// let mut next = indexer.new_content();
/// next.add(Arc::new(Object::new("tmp/a", 1, 1)));
/// assert_eq!(next.len(), 1);
/// assert_eq!(next.get("tmp/a").map(|o| o.value), Some(1));
/// ```
pub struct StoreContent<T> {
    inner: Inner<T>,
    /// Whether the table's indexes are maintained (for the indexers in `inner.indexers`).
    indexed: bool,
}

impl<T> Clone for StoreContent<T> {
    fn clone(&self) -> Self {
        StoreContent {
            inner: Inner {
                table: self.inner.table.boxed_clone(),
                indexers: self.inner.indexers.clone(),
                revision: self.inner.revision,
                writes: 0,
                proven: 0,
                origin: 0,
            },
            indexed: self.indexed,
        }
    }
}

impl<T: Send + Sync + 'static> Default for StoreContent<T> {
    /// Content without indexes: the store builds them when it is installed.
    fn default() -> Self {
        StoreContent {
            inner: Inner::shared(),
            indexed: false,
        }
    }
}

impl<T> StoreContent<T> {
    /// Adds (or replaces) the object under its key, indexing it.
    pub fn add(&mut self, obj: Arc<Object<T>>) {
        self.inner.table.add(&self.inner.indexers, obj);
    }

    /// Adds (or replaces) every object of `objs`, a page of a list: a compact store packs
    /// them together.
    pub fn add_page(&mut self, objs: &[Arc<Object<T>>]) {
        self.inner.table.add_all(&self.inner.indexers, objs);
    }

    /// Whether this content can take objects encoded by a codec named `codec`, indexed by
    /// `indexes` (sorted names), without decoding them: it is compact with that codec, indexes
    /// exactly those, and each of `sample` decodes to the index values it carries. If so, the
    /// index values the sample shows are sized for their share of the `keys` to come
    /// (growing a set of a hundred thousand keys rehashes each of them several times).
    pub(crate) fn takes_encoded(
        &mut self,
        codec: &str,
        indexes: &[String],
        keys: usize,
        sample: &[EncodedObject<'_>],
    ) -> bool {
        let Inner {
            table, indexers, ..
        } = &mut self.inner;
        if !self.indexed || table.codec_name() != Some(codec) {
            return false;
        }
        let mut sorted: Vec<_> = indexers.iter().collect();
        sorted.sort_by(|a, b| a.0.cmp(b.0));
        if !sorted.iter().map(|(name, _)| *name).eq(indexes.iter()) {
            return false;
        }
        // Each index's values as sets: the file lists them in no particular order, each
        // once, as the indexes hold them (a compact cache's snapshot takes them from there).
        fn set<S: AsRef<str>>(values: &[S]) -> Vec<&str> {
            let mut set: Vec<&str> = values.iter().map(AsRef::as_ref).collect();
            set.sort_unstable();
            set.dedup();
            set
        }
        // A codec or index function that panics on the sample: decoded instead, where a panic
        // starts cold (it panicked the reflector on every restart, and nothing synced).
        let agrees = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            sample.iter().all(|encoded| {
            table.decode_encoded(encoded).is_some_and(|obj| {
                encoded.index.len() == sorted.len()
                    && sorted
                        .iter()
                        .zip(encoded.index.iter())
                        .all(|((_, f), file)| {
                            let values = f.values(&obj);
                            set(&values) == set(file)
                        })
                })
            })
        }))
        .unwrap_or_else(|panic| {
            tracing::warn!(
                panic = %crate::sync::panic_message(&*panic),
                "a warm start's sample panicked in the codec or an index function; decoding the snapshot instead"
            );
            false
        });
        if !agrees {
            return false;
        }
        let per_record = keys / sample.len().max(1);
        for (i, name) in indexes.iter().enumerate() {
            for (value, n) in often(sample.iter().flat_map(|e| e.index.get(i)).copied()) {
                table.reserve_index(name, value, n * per_record);
            }
        }
        // The items' own sets alike (one a namespace, with a namespace index).
        for (set, n) in often(sample.iter().map(|e| table.items_set_of(e.key))) {
            table.reserve_items_set(set, n * per_record);
        }
        true
    }

    /// Adds (or replaces) every object of `objs` as they are encoded, after
    /// [`takes_encoded`](Self::takes_encoded) said yes.
    pub(crate) fn add_encoded(&mut self, objs: &[EncodedObject<'_>]) {
        self.inner.table.add_encoded(&self.inner.indexers, objs);
    }

    /// Takes `key` from `store` if it holds it in the state `stamp` names, sharing the object
    /// (or the compact store's packed bytes) instead of copying it; says whether it did.
    fn adopt(&mut self, store: &Indexer<T>, key: &str, stamp: &Stamp) -> bool {
        let from = store.read();
        self.inner
            .table
            .adopt(&self.inner.indexers, &*from.table, key, stamp)
    }

    /// Makes room for `additional` more objects (by namespace as they are now, with that index).
    pub fn reserve(&mut self, additional: usize) {
        self.inner.table.reserve(additional);
    }

    /// Defers repacking a compact content while a list builds it (`true`), or ends the
    /// deferral (`false`), repacking it if it needs it as a whole: keys adopted from the cache
    /// keep their chunks, which look mostly dead until every key of them is in.
    pub(crate) fn defer_repacks(&mut self, defer: bool) {
        self.inner.table.defer_repacks(defer);
    }

    /// The object under `key` (decoded again if the content is compact).
    pub fn get(&self, key: &str) -> Option<Arc<Object<T>>> {
        self.inner.table.get(key)
    }

    /// The `mod_revision` of the object under `key`, without decoding it.
    pub fn mod_revision(&self, key: &str) -> Option<i64> {
        self.inner.table.mod_revision(key)
    }

    /// Every object, in no particular order (a relist's content, popped by hand from a
    /// [`RealFifo`](crate::RealFifo)).
    pub fn list(&self) -> Vec<Arc<Object<T>>> {
        let mut out = Vec::with_capacity(self.inner.table.len());
        self.inner.table.for_each(&mut |o| out.push(o));
        out
    }

    /// How many objects it holds.
    pub fn len(&self) -> usize {
        self.inner.table.len()
    }

    /// Whether it holds no object.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T: Send + Sync + 'static> StoreContent<T> {
    /// Content of `items`, indexed when installed.
    pub(crate) fn unindexed(items: impl IntoIterator<Item = Arc<Object<T>>>) -> Self {
        let mut content = StoreContent::default();
        for obj in items {
            content.add(obj);
        }
        content
    }
}

impl<T: Send + Sync + 'static> Inner<T> {
    fn shared() -> Self {
        Inner {
            table: Box::new(Table::new(Shared)),
            indexers: HashMap::new(),
            revision: 0,
            writes: 0,
            proven: 0,
            origin: 0,
        }
    }
}

impl<T> Inner<T> {
    /// An empty table of this one's representation, with this one's indexes.
    fn empty_like(&self) -> Self {
        let mut table = self.table.empty();
        for (name, func) in &self.indexers {
            table.build_index(name, func);
        }
        Inner {
            table,
            indexers: self.indexers.clone(),
            revision: 0,
            writes: 0,
            proven: 0,
            origin: 0,
        }
    }

    /// Whether `other` has the same index functions (the same functions, not just names).
    fn same_indexers(&self, other: &Indexers<T>) -> bool {
        self.indexers.len() == other.len()
            && self
                .indexers
                .iter()
                .all(|(name, f)| other.get(name).is_some_and(|g| f.same(g)))
    }

    fn add(&mut self, obj: Arc<Object<T>>) -> Option<Arc<Object<T>>> {
        self.table.add(&self.indexers, obj)
    }

    fn delete(&mut self, key: &str) -> Option<Arc<Object<T>>> {
        self.table.delete(&self.indexers, key)
    }

    /// Replaces the table with a new one of the same representation holding `items`, indexed;
    /// returns the old table.
    fn replace(&mut self, items: impl IntoIterator<Item = Arc<Object<T>>>) -> Box<dyn Storage<T>> {
        let mut next = self.empty_like();
        let items: Vec<_> = items.into_iter().collect();
        // As one page: a compact table packs them together.
        next.table.add_all(&next.indexers, &items);
        std::mem::replace(&mut self.table, next.table)
    }

    fn check_index(&self, name: &str) -> Result<(), StoreError> {
        if self.table.has_index(name) {
            Ok(())
        } else {
            Err(StoreError::IndexNotFound(name.to_owned()))
        }
    }
}

impl<T: Send + Sync + 'static> Default for Indexer<T> {
    fn default() -> Self {
        Indexer::from_inner(Inner::shared())
    }
}

impl<T: Send + Sync + 'static> Indexer<T> {
    /// An empty store with the given indexes.
    pub fn new(indexers: Indexers<T>) -> Self {
        let indexer = Indexer::default();
        // A fresh store has no index names yet, so this cannot fail.
        let _ = indexer.add_indexers(indexers);
        indexer
    }

    /// An empty store with the namespace index, the usual default.
    pub fn with_namespace_index() -> Self {
        Indexer::new(namespace_indexers())
    }

    /// An empty **compact** store with the given indexes: each object is kept as one
    /// allocation holding its key, revisions and value encoded by `codec`, and is decoded on
    /// every read (`get_by_key`, `list`, `by_index`...), so readers get a fresh `Arc` each
    /// time. Storing an object costs an encode and a decode: reads see what comes back (a field
    /// the codec does not write comes back as its default), and an object whose encoded value
    /// does not decode is kept decoded (and logged).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use etcd_informer::codec::JsonCodec;
    /// use etcd_informer::store::namespace_indexers;
    /// use etcd_informer::{Indexer, Object, NAMESPACE_INDEX};
    /// let indexer = Indexer::compact(namespace_indexers(), JsonCodec::<Vec<u32>>::new());
    /// indexer.add(Arc::new(Object::new("tmp/a", 3, vec![1, 2])));
    /// assert_eq!(indexer.get_by_key("tmp/a").unwrap().value, [1, 2]);
    /// assert_eq!(indexer.by_index(NAMESPACE_INDEX, "tmp").unwrap()[0].mod_revision, 3);
    /// assert!(indexer.is_compact());
    /// ```
    pub fn compact(indexers: Indexers<T>, codec: impl Codec<T>) -> Self {
        Indexer::compact_with(indexers, Arc::new(codec))
    }

    pub(crate) fn compact_with(indexers: Indexers<T>, codec: Arc<dyn Codec<T>>) -> Self {
        let indexer = Indexer::from_inner(Inner {
            table: Box::new(Table::new(PackedRepr::new(codec))),
            indexers: HashMap::new(),
            revision: 0,
            writes: 0,
            proven: 0,
            origin: 0,
        });
        let _ = indexer.add_indexers(indexers);
        indexer
    }
}

impl<T> Indexer<T> {
    fn from_inner(inner: Inner<T>) -> Self {
        Indexer {
            inner: Arc::new(RwLock::new(inner)),
        }
    }

    fn read(&self) -> RwLockReadGuard<'_, Inner<T>> {
        // A panic while holding the lock cannot leave the maps half-updated in a way readers
        // could observe as broken (each write completes or panics before mutating), so a poisoned
        // lock is still usable.
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    /// The lock for a write: whatever was proven about the content no longer holds.
    fn write(&self) -> RwLockWriteGuard<'_, Inner<T>> {
        let mut inner = self.inner.write().unwrap_or_else(|e| e.into_inner());
        inner.writes += 1;
        inner.proven = 0;
        inner
    }

    /// Whether the store is compact (see [`Indexer::compact`]).
    pub fn is_compact(&self) -> bool {
        self.read().table.packed()
    }

    /// Registers more indexes and indexes every object already stored under them. Fails without
    /// changing anything if a name is taken.
    pub fn add_indexers(&self, indexers: Indexers<T>) -> Result<(), StoreError> {
        let mut inner = self.write();
        if let Some(name) = indexers.keys().find(|n| inner.indexers.contains_key(*n)) {
            return Err(StoreError::IndexExists(name.clone()));
        }
        for (name, func) in indexers {
            inner.table.build_index(&name, &func);
            inner.indexers.insert(name, func);
        }
        Ok(())
    }

    /// Inserts or replaces the object under its key and returns the object it replaced.
    pub fn add(&self, obj: Arc<Object<T>>) -> Option<Arc<Object<T>>> {
        self.write().add(obj)
    }

    /// Same as [`add`](Self::add): the store is keyed, so an update is an insert.
    pub fn update(&self, obj: Arc<Object<T>>) -> Option<Arc<Object<T>>> {
        self.add(obj)
    }

    /// Removes the object under `key` and returns it.
    pub fn delete(&self, key: &str) -> Option<Arc<Object<T>>> {
        self.write().delete(key)
    }

    /// Empty content with this store's indexes (and representation), to build a relist into
    /// and install in one step (see [`StoreContent`]).
    pub fn new_content(&self) -> StoreContent<T> {
        StoreContent {
            inner: self.read().empty_like(),
            indexed: true,
        }
    }

    /// Replaces the whole content with `items` and rebuilds the indexes.
    pub fn replace(&self, items: impl IntoIterator<Item = Arc<Object<T>>>) {
        self.write().replace(items);
    }

    /// Runs `f` on the store under one write lock: readers see all of its changes or none
    /// (how the informer applies one etcd revision, or a relist, atomically).
    pub(crate) fn transaction<R>(&self, f: impl FnOnce(&mut Txn<'_, T>) -> R) -> R {
        let mut inner = self.write();
        f(&mut Txn(&mut inner))
    }

    /// The etcd revision the cache holds, as set by the informer that fills it: in the
    /// revision-atomic mode the content is exactly the source's at this revision; 0 before
    /// the first list, and for a store filled by hand.
    pub fn revision(&self) -> i64 {
        self.read().revision
    }

    /// [`revision`](Self::revision) and the number of objects, read together.
    pub fn revision_and_len(&self) -> (i64, usize) {
        let inner = self.read();
        (inner.revision, inner.table.len())
    }

    /// Raises the revision to `revision` if it is lower: the watch reported progress there, so
    /// no change at or below it is still on its way. The content does not change, so a proof
    /// about it still holds.
    pub(crate) fn advance_revision(&self, revision: i64) {
        let mut inner = self.inner.write().unwrap_or_else(|e| e.into_inner());
        inner.revision = inner.revision.max(revision);
    }

    /// [`revision`](Self::revision), the number of objects and the count of writes, read
    /// together: the last one tells [`prove`](Self::prove) whether the content changed since.
    pub(crate) fn revision_len_and_writes(&self) -> (i64, usize, u64) {
        let inner = self.read();
        (inner.revision, inner.table.len(), inner.writes)
    }

    /// The number of writes so far (see [`revision_len_and_writes`](Self::revision_len_and_writes)).
    pub(crate) fn writes(&self) -> u64 {
        self.read().writes
    }

    /// Records that the source proved the content, as it was after `writes` writes, to be its
    /// content at `revision` too; false (nothing recorded) if the content changed since.
    ///
    /// Unlike [`advance_revision`](Self::advance_revision), a proof never moves the revision:
    /// changes at or below `revision` may still be on their way (a key created and deleted in
    /// between leaves no trace in the proof), and once one is applied the content is etcd's at
    /// that change's revision, not at `revision`.
    pub(crate) fn prove(&self, writes: u64, revision: i64) -> bool {
        let mut inner = self.inner.write().unwrap_or_else(|e| e.into_inner());
        if inner.writes != writes {
            return false;
        }
        inner.proven = inner.proven.max(revision);
        true
    }

    /// Every key with its `mod_revision`, sorted by key, and the latest revision the content is
    /// known to be etcd's at ([`proven_revision`](Self::proven_revision)), read together: what
    /// the audit compares with etcd.
    pub(crate) fn key_revisions(&self) -> (i64, Vec<(Box<str>, i64)>) {
        let (at, mut keys) = {
            let inner = self.read();
            let mut keys = Vec::with_capacity(inner.table.len());
            inner
                .table
                .for_each_revision(&mut |key, revision| keys.push((key.into(), revision)));
            (inner.revision.max(inner.proven), keys)
        };
        keys.sort_unstable();
        (at, keys)
    }

    /// The latest revision at which etcd's content is known to be the cache's: at least the
    /// content's own revision, and later while a consistent read's proof holds (until the next
    /// write).
    pub(crate) fn proven_revision(&self) -> i64 {
        let inner = self.read();
        inner.revision.max(inner.proven)
    }

    /// The object under `key`.
    pub fn get_by_key(&self, key: &str) -> Option<Arc<Object<T>>> {
        self.read().table.get(key)
    }

    /// Every object, in no particular order.
    pub fn list(&self) -> Vec<Arc<Object<T>>> {
        let inner = self.read();
        let mut out = Vec::with_capacity(inner.table.len());
        inner.table.for_each(&mut |o| out.push(o));
        out
    }

    /// What a snapshot of the cache records, read under one lock so that all agree: the
    /// revision the content is the source's at, the cluster id of the store it was listed
    /// from, the content, and the indexers. A compact store whose values are encoded by
    /// a codec named `codec` gives its records as they are: a copy of its table that
    /// shares them, made under the lock without decoding anything (decoding a million keys
    /// held the lock, and so every event, for seconds).
    pub(crate) fn snapshot_content(
        &self,
        codec: &str,
    ) -> (i64, u64, SnapshotContent<T>, Indexers<T>) {
        let inner = self.read();
        let content = if inner.table.codec_name() == Some(codec) {
            SnapshotContent::Records(Records(inner.table.boxed_clone()))
        } else {
            let mut out = Vec::with_capacity(inner.table.len());
            inner.table.for_each(&mut |o| out.push(o));
            SnapshotContent::Objects(out)
        };
        (
            inner.revision,
            inner.origin,
            content,
            inner.indexers.clone(),
        )
    }

    /// Every key, in no particular order.
    pub fn list_keys(&self) -> Vec<Arc<str>> {
        self.read().table.keys()
    }

    /// How many objects are stored.
    pub fn len(&self) -> usize {
        self.read().table.len()
    }

    /// Whether the store is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The objects whose index `index_name` contains `value`.
    pub fn by_index(
        &self,
        index_name: &str,
        value: &str,
    ) -> Result<Vec<Arc<Object<T>>>, StoreError> {
        let inner = self.read();
        inner.check_index(index_name)?;
        Ok(inner.table.by_index(index_name, value))
    }

    /// The keys of the objects whose index `index_name` contains `value`.
    pub fn index_keys(&self, index_name: &str, value: &str) -> Result<Vec<Arc<str>>, StoreError> {
        let inner = self.read();
        inner.check_index(index_name)?;
        Ok(inner.table.index_keys(index_name, value))
    }

    /// The objects that share at least one value of index `index_name` with `obj`.
    pub fn index(
        &self,
        index_name: &str,
        obj: &Object<T>,
    ) -> Result<Vec<Arc<Object<T>>>, StoreError> {
        let inner = self.read();
        inner.check_index(index_name)?;
        let values = inner.indexers[index_name].values(obj);
        Ok(inner.table.matching(index_name, &values))
    }

    /// Every value index `index_name` currently has.
    pub fn list_index_func_values(&self, index_name: &str) -> Vec<String> {
        self.read().table.index_values(index_name)
    }

    /// The names of the registered indexes.
    pub fn index_names(&self) -> Vec<String> {
        self.read().indexers.keys().cloned().collect()
    }
}

/// The store under its write lock, for [`Indexer::transaction`].
pub(crate) struct Txn<'a, T>(&'a mut Inner<T>);

/// A store's content for a snapshot ([`Indexer::snapshot_content`]).
pub(crate) enum SnapshotContent<T> {
    /// Its objects.
    Objects(Vec<Arc<Object<T>>>),
    /// A compact store's records.
    Records(Records<T>),
}

impl<T> SnapshotContent<T> {
    /// How many objects it holds.
    pub(crate) fn len(&self) -> usize {
        match self {
            SnapshotContent::Objects(objects) => objects.len(),
            SnapshotContent::Records(records) => records.0.len(),
        }
    }
}

/// A compact store's records, shared with it and read without its lock.
pub(crate) struct Records<T>(Box<dyn Storage<T>>);

impl<T> Records<T> {
    /// Each object, as [`Item`]: a record with its values for each of `indexes`, or an object
    /// the store holds decoded; until `f` breaks. Each call goes in the same order.
    pub(crate) fn for_each_record(
        &self,
        indexes: &[&str],
        f: &mut dyn FnMut(Item<'_, T>) -> ControlFlow<()>,
    ) {
        self.0.for_each_record(indexes, f)
    }
}

/// The objects a store held before a relist was installed.
pub(crate) struct Retired<T>(Box<dyn Storage<T>>);

impl<T> Retired<T> {
    pub(crate) fn is_empty(&self) -> bool {
        self.0.len() == 0
    }

    /// Takes the object under `key` out: its revision, and the object if `unpack`.
    pub(crate) fn take(
        &mut self,
        key: &str,
        unpack: bool,
    ) -> Option<(i64, Option<Arc<Object<T>>>)> {
        self.0.take(key, unpack)
    }

    /// The `mod_revision` of the object under `key`, without decoding it.
    pub(crate) fn mod_revision(&self, key: &str) -> Option<i64> {
        self.0.mod_revision(key)
    }

    /// The stamp of the object under `key`, without decoding it.
    pub(crate) fn stamp(&self, key: &str) -> Option<Stamp> {
        self.0.stamp_of(key)
    }

    /// Every object left.
    pub(crate) fn for_each(&self, f: &mut dyn FnMut(Arc<Object<T>>)) {
        self.0.for_each(f)
    }

    /// How many objects are left.
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }
}

impl<T> Txn<'_, T> {
    /// How many objects the store holds.
    pub(crate) fn len(&self) -> usize {
        self.0.table.len()
    }

    pub(crate) fn add(&mut self, obj: Arc<Object<T>>) -> Option<Arc<Object<T>>> {
        self.0.add(obj)
    }

    pub(crate) fn delete(&mut self, key: &str) -> Option<Arc<Object<T>>> {
        self.0.delete(key)
    }

    /// Installs `content` and returns the previous objects. Its table is used as it is if it
    /// was built for this store's index functions and representation, and rebuilt otherwise
    /// (an index added while the content was built, or content built without indexes).
    pub(crate) fn install(&mut self, content: StoreContent<T>) -> Retired<T> {
        let fits = content.indexed
            && content.inner.same_indexers(&self.0.indexers)
            && content.inner.table.packed() == self.0.table.packed();
        if fits {
            return Retired(std::mem::replace(&mut self.0.table, content.inner.table));
        }
        let mut objects = Vec::with_capacity(content.len());
        content.inner.table.for_each(&mut |o| objects.push(o));
        Retired(self.0.replace(objects))
    }

    /// The object under `key` (decoded again if the store is compact).
    pub(crate) fn get(&self, key: &str) -> Option<Arc<Object<T>>> {
        self.0.table.get(key)
    }

    /// The stamp of the object under `key`, without decoding it.
    pub(crate) fn stamp(&self, key: &str) -> Option<Stamp> {
        self.0.table.stamp_of(key)
    }

    /// Every object (decoded again if the store is compact).
    pub(crate) fn for_each(&self, f: &mut dyn FnMut(Arc<Object<T>>)) {
        self.0.table.for_each(f)
    }

    /// Every key with its `mod_revision`, without decoding.
    pub(crate) fn for_each_revision(&self, f: &mut dyn FnMut(&str, i64)) {
        self.0.table.for_each_revision(f)
    }

    /// Sets the revision the content now holds.
    pub(crate) fn set_revision(&mut self, revision: i64) {
        self.0.revision = revision;
    }

    /// The content is now a list of the store with this cluster id (0: unknown).
    pub(crate) fn set_origin(&mut self, cluster_id: u64) {
        self.0.origin = cluster_id;
    }

    pub(crate) fn revision(&self) -> i64 {
        self.0.revision
    }
}

impl<T: Send + Sync + 'static> Store<T> for Indexer<T> {
    fn new_content(&self) -> StoreContent<T> {
        Indexer::new_content(self)
    }
    fn keep_unchanged(&self, content: &mut StoreContent<T>, key: &str, stamp: &Stamp) -> bool {
        content.adopt(self, key, stamp)
    }
    fn get_by_key(&self, key: &str) -> Option<Arc<Object<T>>> {
        Indexer::get_by_key(self, key)
    }
    fn mod_revision(&self, key: &str) -> Option<i64> {
        self.read().table.mod_revision(key)
    }
    fn list_keys(&self) -> Vec<Arc<str>> {
        Indexer::list_keys(self)
    }
    fn list(&self) -> Vec<Arc<Object<T>>> {
        Indexer::list(self)
    }
    fn len(&self) -> usize {
        Indexer::len(self)
    }
}

#[cfg(test)]
mod tests;
