use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::Store;
use crate::Object;

/// The name of the namespace index (client-go's `cache.NamespaceIndex`).
pub const NAMESPACE_INDEX: &str = "namespace";

/// Computes the index values of an object; an object may have several (or none).
pub type IndexFunc<T> = Arc<dyn Fn(&Object<T>) -> Vec<String> + Send + Sync>;

/// Named index functions.
pub type Indexers<T> = HashMap<String, IndexFunc<T>>;

/// One index: index value → keys of the objects that have it.
pub type Index = HashMap<String, HashSet<Arc<str>>>;

/// The namespace index function: the first path segment of the key (`tmp` for `tmp/demo`), as
/// client-go's `MetaNamespaceIndexFunc`.
pub fn namespace_index_func<T>(obj: &Object<T>) -> Vec<String> {
    vec![obj.namespace().to_owned()]
}

/// Just the namespace index, under [`NAMESPACE_INDEX`].
pub fn namespace_indexers<T: 'static>() -> Indexers<T> {
    let mut indexers: Indexers<T> = HashMap::new();
    indexers.insert(
        NAMESPACE_INDEX.to_owned(),
        Arc::new(namespace_index_func::<T>),
    );
    indexers
}

/// Errors of the indexer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// No index of that name is registered.
    #[error("index {0:?} does not exist")]
    IndexNotFound(String),
    /// An index of that name is registered already.
    #[error("index {0:?} already exists")]
    IndexExists(String),
}

/// A thread-safe store of objects by key, with named indexes (client-go's `Indexer` over its
/// `threadSafeMap`).
///
/// Invariants: for every registered index `i`, every stored object `o` and every value `v` in
/// `i(o)`, `indices[i][v]` contains `o`'s key, and nothing else is in `indices`. Keys are shared
/// (`Arc<str>`) between the items map and the indexes, never copied.
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
    items: HashMap<Arc<str>, Arc<Object<T>>>,
    indexers: Indexers<T>,
    indices: HashMap<String, Index>,
    /// The revision the content was last written at (see [`Indexer::revision`]).
    revision: i64,
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
/// assert!(next.get("tmp/a").is_some());
/// ```
pub struct StoreContent<T> {
    inner: Inner<T>,
    /// Whether `inner.indices` is maintained (for the indexers in `inner.indexers`).
    indexed: bool,
}

impl<T> Clone for StoreContent<T> {
    fn clone(&self) -> Self {
        StoreContent {
            inner: Inner {
                items: self.inner.items.clone(),
                indexers: self.inner.indexers.clone(),
                indices: self.inner.indices.clone(),
                revision: self.inner.revision,
            },
            indexed: self.indexed,
        }
    }
}

impl<T> Default for StoreContent<T> {
    /// Content without indexes: the store builds them when it is installed.
    fn default() -> Self {
        StoreContent {
            inner: Inner::empty(HashMap::new()),
            indexed: false,
        }
    }
}

impl<T> StoreContent<T> {
    /// Content of the objects in `items`, indexed when installed.
    pub(crate) fn unindexed(items: HashMap<Arc<str>, Arc<Object<T>>>) -> Self {
        let mut content = StoreContent::default();
        content.inner.items = items;
        content
    }

    /// Adds (or replaces) the object under its key, indexing it.
    pub fn add(&mut self, obj: Arc<Object<T>>) {
        self.inner.add(obj);
    }

    /// Makes room for `additional` more objects.
    pub fn reserve(&mut self, additional: usize) {
        self.inner.items.reserve(additional);
    }

    /// The object under `key`.
    pub fn get(&self, key: &str) -> Option<&Arc<Object<T>>> {
        self.inner.items.get(key)
    }

    /// How many objects it holds.
    pub fn len(&self) -> usize {
        self.inner.items.len()
    }

    /// Whether it holds no object.
    pub fn is_empty(&self) -> bool {
        self.inner.items.is_empty()
    }
}

impl<T> Inner<T> {
    fn empty(indexers: Indexers<T>) -> Self {
        let indices = indexers
            .keys()
            .map(|name| (name.clone(), Index::new()))
            .collect();
        Inner {
            items: HashMap::new(),
            indexers,
            indices,
            revision: 0,
        }
    }

    /// Whether `other` has the same index functions (the same functions, not just names).
    fn same_indexers(&self, other: &Indexers<T>) -> bool {
        self.indexers.len() == other.len()
            && self
                .indexers
                .iter()
                .all(|(name, f)| other.get(name).is_some_and(|g| Arc::ptr_eq(f, g)))
    }
}

impl<T> Default for Indexer<T> {
    fn default() -> Self {
        Indexer {
            inner: Arc::new(RwLock::new(Inner {
                items: HashMap::new(),
                indexers: HashMap::new(),
                indices: HashMap::new(),
                revision: 0,
            })),
        }
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
}

impl<T> Indexer<T> {
    fn read(&self) -> RwLockReadGuard<'_, Inner<T>> {
        // A panic while holding the lock cannot leave the maps half-updated in a way readers
        // could observe as broken (each write completes or panics before mutating), so a poisoned
        // lock is still usable.
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Inner<T>> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers more indexes and indexes every object already stored under them. Fails without
    /// changing anything if a name is taken.
    pub fn add_indexers(&self, indexers: Indexers<T>) -> Result<(), StoreError> {
        let mut inner = self.write();
        if let Some(name) = indexers.keys().find(|n| inner.indexers.contains_key(*n)) {
            return Err(StoreError::IndexExists(name.clone()));
        }
        for (name, func) in indexers {
            let mut index = Index::new();
            for (key, obj) in &inner.items {
                for value in func(obj) {
                    index.entry(value).or_default().insert(key.clone());
                }
            }
            inner.indices.insert(name.clone(), index);
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

    /// Empty content with this store's indexes, to build a relist into and install in one step
    /// (see [`StoreContent`]).
    pub fn new_content(&self) -> StoreContent<T> {
        StoreContent {
            inner: Inner::empty(self.read().indexers.clone()),
            indexed: true,
        }
    }

    /// Replaces the whole content with `items` and rebuilds the indexes.
    pub fn replace(&self, items: impl IntoIterator<Item = Arc<Object<T>>>) {
        let items = items
            .into_iter()
            .map(|o| (o.shared_key().clone(), o))
            .collect();
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
        (inner.revision, inner.items.len())
    }

    /// Raises the revision to `revision` if it is lower: the source proved that nothing under
    /// it changed in between.
    pub(crate) fn advance_revision(&self, revision: i64) {
        let mut inner = self.write();
        inner.revision = inner.revision.max(revision);
    }

    /// The object under `key`.
    pub fn get_by_key(&self, key: &str) -> Option<Arc<Object<T>>> {
        self.read().items.get(key).cloned()
    }

    /// Every object, in no particular order.
    pub fn list(&self) -> Vec<Arc<Object<T>>> {
        self.read().items.values().cloned().collect()
    }

    /// Every key, in no particular order.
    pub fn list_keys(&self) -> Vec<Arc<str>> {
        self.read().items.keys().cloned().collect()
    }

    /// How many objects are stored.
    pub fn len(&self) -> usize {
        self.read().items.len()
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
        let index = inner.index(index_name)?;
        Ok(index
            .get(value)
            .map(|keys| {
                keys.iter()
                    .filter_map(|k| inner.items.get(k).cloned())
                    .collect()
            })
            .unwrap_or_default())
    }

    /// The keys of the objects whose index `index_name` contains `value`.
    pub fn index_keys(&self, index_name: &str, value: &str) -> Result<Vec<Arc<str>>, StoreError> {
        let inner = self.read();
        let index = inner.index(index_name)?;
        Ok(index
            .get(value)
            .map(|keys| keys.iter().cloned().collect())
            .unwrap_or_default())
    }

    /// The objects that share at least one value of index `index_name` with `obj`.
    pub fn index(
        &self,
        index_name: &str,
        obj: &Object<T>,
    ) -> Result<Vec<Arc<Object<T>>>, StoreError> {
        let inner = self.read();
        let index = inner.index(index_name)?;
        let func = &inner.indexers[index_name];
        let mut keys: HashSet<&Arc<str>> = HashSet::new();
        for value in func(obj) {
            if let Some(set) = index.get(&value) {
                keys.extend(set.iter());
            }
        }
        Ok(keys
            .into_iter()
            .filter_map(|k| inner.items.get(k).cloned())
            .collect())
    }

    /// Every value index `index_name` currently has.
    pub fn list_index_func_values(&self, index_name: &str) -> Vec<String> {
        self.read()
            .indices
            .get(index_name)
            .map(|index| index.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// The names of the registered indexes.
    pub fn index_names(&self) -> Vec<String> {
        self.read().indexers.keys().cloned().collect()
    }
}

/// The store under its write lock, for [`Indexer::transaction`].
pub(crate) struct Txn<'a, T>(&'a mut Inner<T>);

impl<T> Txn<'_, T> {
    pub(crate) fn add(&mut self, obj: Arc<Object<T>>) -> Option<Arc<Object<T>>> {
        self.0.add(obj)
    }

    pub(crate) fn delete(&mut self, key: &str) -> Option<Arc<Object<T>>> {
        self.0.delete(key)
    }

    /// Installs `content` and returns the previous objects. Its indexes are used as they are
    /// if they were built for this store's index functions, and rebuilt otherwise (an index
    /// added while the content was built, or content built without indexes).
    pub(crate) fn install(
        &mut self,
        content: StoreContent<T>,
    ) -> HashMap<Arc<str>, Arc<Object<T>>> {
        if content.indexed && content.inner.same_indexers(&self.0.indexers) {
            self.0.indices = content.inner.indices;
            std::mem::replace(&mut self.0.items, content.inner.items)
        } else {
            self.0.replace(content.inner.items)
        }
    }

    pub(crate) fn objects(&self) -> impl Iterator<Item = &Arc<Object<T>>> {
        self.0.items.values()
    }

    /// Sets the revision the content now holds.
    pub(crate) fn set_revision(&mut self, revision: i64) {
        self.0.revision = revision;
    }

    pub(crate) fn revision(&self) -> i64 {
        self.0.revision
    }
}

impl<T> Inner<T> {
    fn add(&mut self, obj: Arc<Object<T>>) -> Option<Arc<Object<T>>> {
        let key = obj.shared_key().clone();
        let old = self.items.insert(key.clone(), obj.clone());
        self.update_indices(old.as_deref(), Some(&obj), &key);
        old
    }

    fn delete(&mut self, key: &str) -> Option<Arc<Object<T>>> {
        let (key, old) = self.items.remove_entry(key)?;
        self.update_indices(Some(&old), None, &key);
        Some(old)
    }

    fn replace(
        &mut self,
        items: HashMap<Arc<str>, Arc<Object<T>>>,
    ) -> HashMap<Arc<str>, Arc<Object<T>>> {
        let old = std::mem::replace(&mut self.items, items);
        let Inner {
            items,
            indexers,
            indices,
            ..
        } = self;
        for (name, func) in indexers.iter() {
            let mut index = Index::new();
            for (key, obj) in items.iter() {
                for value in func(obj) {
                    index.entry(value).or_default().insert(key.clone());
                }
            }
            indices.insert(name.clone(), index);
        }
        old
    }

    fn index(&self, name: &str) -> Result<&Index, StoreError> {
        self.indices
            .get(name)
            .ok_or_else(|| StoreError::IndexNotFound(name.to_owned()))
    }

    fn update_indices(&mut self, old: Option<&Object<T>>, new: Option<&Object<T>>, key: &Arc<str>) {
        for (name, func) in &self.indexers {
            let old_values = old.map(|o| func(o)).unwrap_or_default();
            let new_values = new.map(|o| func(o)).unwrap_or_default();
            if old_values == new_values {
                continue;
            }
            let Some(index) = self.indices.get_mut(name) else {
                continue;
            };
            for value in old_values.iter().filter(|v| !new_values.contains(v)) {
                if let Some(set) = index.get_mut(value) {
                    set.remove(key);
                    if set.is_empty() {
                        index.remove(value);
                    }
                }
            }
            for value in new_values {
                index.entry(value).or_default().insert(key.clone());
            }
        }
    }
}

impl<T: Send + Sync> Store<T> for Indexer<T> {
    fn new_content(&self) -> StoreContent<T> {
        Indexer::new_content(self)
    }
    fn get_by_key(&self, key: &str) -> Option<Arc<Object<T>>> {
        Indexer::get_by_key(self, key)
    }
    fn list_keys(&self) -> Vec<Arc<str>> {
        Indexer::list_keys(self)
    }
    fn list(&self) -> Vec<Arc<Object<T>>> {
        Indexer::list(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(key: &str, rev: i64, labels: &[&str]) -> Arc<Object<Vec<String>>> {
        Arc::new(Object::new(
            key,
            rev,
            labels.iter().map(|s| s.to_string()).collect(),
        ))
    }

    fn label_indexer() -> Indexer<Vec<String>> {
        let indexer = Indexer::with_namespace_index();
        let mut more: Indexers<Vec<String>> = HashMap::new();
        more.insert(
            "label".into(),
            Arc::new(|o: &Object<Vec<String>>| o.value.clone()),
        );
        indexer.add_indexers(more).unwrap();
        indexer
    }

    fn sorted(keys: Vec<Arc<str>>) -> Vec<String> {
        let mut v: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        v.sort();
        v
    }

    #[test]
    fn multi_value_index_follows_updates_and_deletes() {
        let ix = label_indexer();
        ix.add(obj("tmp/a", 1, &["x", "y"]));
        ix.add(obj("tmp/b", 2, &["y"]));
        assert_eq!(
            sorted(ix.index_keys("label", "y").unwrap()),
            ["tmp/a", "tmp/b"]
        );
        ix.update(obj("tmp/a", 3, &["z"]));
        assert_eq!(sorted(ix.index_keys("label", "y").unwrap()), ["tmp/b"]);
        assert!(ix.index_keys("label", "x").unwrap().is_empty());
        assert_eq!(sorted(ix.index_keys("label", "z").unwrap()), ["tmp/a"]);
        ix.delete("tmp/b");
        let mut values = ix.list_index_func_values("label");
        values.sort();
        assert_eq!(values, ["z"], "empty index values are removed");
        assert_eq!(ix.by_index("label", "z").unwrap()[0].mod_revision, 3);
        let same = ix.index("label", &obj("other/c", 9, &["z", "q"])).unwrap();
        assert_eq!(same.len(), 1);
    }

    #[test]
    fn unknown_index_is_an_error() {
        let ix = label_indexer();
        assert_eq!(
            ix.by_index("nope", "x").unwrap_err(),
            StoreError::IndexNotFound("nope".into())
        );
        let mut dup: Indexers<Vec<String>> = HashMap::new();
        dup.insert(NAMESPACE_INDEX.into(), Arc::new(namespace_index_func));
        assert_eq!(
            ix.add_indexers(dup).unwrap_err(),
            StoreError::IndexExists(NAMESPACE_INDEX.into())
        );
    }

    #[test]
    fn indexer_added_later_indexes_existing_objects() {
        let ix: Indexer<Vec<String>> = Indexer::default();
        ix.add(obj("tmp/a", 1, &["x"]));
        ix.add(obj("prod/b", 2, &["x"]));
        let mut more: Indexers<Vec<String>> = HashMap::new();
        more.insert(NAMESPACE_INDEX.into(), Arc::new(namespace_index_func));
        ix.add_indexers(more).unwrap();
        assert_eq!(
            sorted(ix.index_keys(NAMESPACE_INDEX, "prod").unwrap()),
            ["prod/b"]
        );
    }

    #[test]
    fn replace_rebuilds_indexes_and_keys_are_shared() {
        let ix = label_indexer();
        ix.add(obj("tmp/a", 1, &["x"]));
        ix.replace(vec![obj("tmp/b", 5, &["y"])]);
        assert!(ix.get_by_key("tmp/a").is_none());
        assert!(ix.index_keys("label", "x").unwrap().is_empty());
        let stored = ix.get_by_key("tmp/b").unwrap();
        let indexed = ix.index_keys("label", "y").unwrap();
        assert!(
            Arc::ptr_eq(stored.shared_key(), &indexed[0]),
            "index shares the key"
        );
        assert_eq!(ix.len(), 1);
    }
}
