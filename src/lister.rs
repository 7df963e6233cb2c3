//! Typed, read-only access to a synced cache (client-go's generated listers).

use std::sync::Arc;

use crate::object::Object;
use crate::store::{Indexer, StoreError, NAMESPACE_INDEX};

/// Reads an informer's cache; cheap to clone, never writes.
///
/// ```
/// use std::sync::Arc;
/// use etcd_informer::{Indexer, Lister, Object};
/// let indexer = Indexer::with_namespace_index();
/// indexer.add(Arc::new(Object::new("tmp/demo", 3, "v")));
/// let lister = Lister::new(indexer);
/// assert_eq!(lister.get("tmp/demo").unwrap().mod_revision, 3);
/// assert_eq!(lister.by_namespace("tmp").unwrap().len(), 1);
/// ```
pub struct Lister<T> {
    indexer: Indexer<T>,
}

impl<T> Clone for Lister<T> {
    fn clone(&self) -> Self {
        Lister {
            indexer: self.indexer.clone(),
        }
    }
}

impl<T> std::fmt::Debug for Lister<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lister")
            .field("len", &self.indexer.len())
            .finish()
    }
}

impl<T> Lister<T> {
    /// A lister over `indexer`.
    pub fn new(indexer: Indexer<T>) -> Self {
        Lister { indexer }
    }

    /// The object under `key` (relative to the prefix, e.g. `namespace/name`).
    pub fn get(&self, key: &str) -> Option<Arc<Object<T>>> {
        self.indexer.get_by_key(key)
    }

    /// Every cached object, sorted by key.
    pub fn list(&self) -> Vec<Arc<Object<T>>> {
        let mut all = self.indexer.list();
        all.sort_by(|a, b| a.key().cmp(b.key()));
        all
    }

    /// The cached objects matching `filter`, sorted by key.
    pub fn list_matching(&self, filter: impl Fn(&Object<T>) -> bool) -> Vec<Arc<Object<T>>> {
        let mut all: Vec<_> = self
            .indexer
            .list()
            .into_iter()
            .filter(|o| filter(o))
            .collect();
        all.sort_by(|a, b| a.key().cmp(b.key()));
        all
    }

    /// The objects whose index `index_name` has `value`, sorted by key.
    pub fn by_index(
        &self,
        index_name: &str,
        value: &str,
    ) -> Result<Vec<Arc<Object<T>>>, StoreError> {
        let mut all = self.indexer.by_index(index_name, value)?;
        all.sort_by(|a, b| a.key().cmp(b.key()));
        Ok(all)
    }

    /// The objects in `namespace` (the first segment of their key), through the namespace index.
    pub fn by_namespace(&self, namespace: &str) -> Result<Vec<Arc<Object<T>>>, StoreError> {
        self.by_index(NAMESPACE_INDEX, namespace)
    }

    /// How many objects are cached.
    pub fn len(&self) -> usize {
        self.indexer.len()
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.indexer.is_empty()
    }
}
