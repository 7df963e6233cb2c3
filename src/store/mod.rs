//! The thread-safe store and its indexes: client-go's `Store`, `ThreadSafeStore` and `Indexer`.

pub(crate) mod compact;
mod index;
mod indexer;
mod slot_set;
pub(crate) use slot_set::key_hash;
mod table;

pub use index::{
    namespace_index_func, namespace_indexers, IndexFunc, Indexers, StoreError, NAMESPACE_INDEX,
};
pub use indexer::{Indexer, StoreContent};
pub(crate) use indexer::{Records, Retired, SnapshotContent, Txn};
pub(crate) use table::Item;

use std::sync::Arc;

use crate::object::Object;
use crate::object::Stamp;

/// Read access to a set of objects by key: what the DeltaFIFO needs of the cache ("known
/// objects") to find the last state of a key.
pub trait Store<T>: Send + Sync {
    /// The object stored under `key`.
    fn get_by_key(&self, key: &str) -> Option<Arc<Object<T>>>;
    /// The `mod_revision` of the object stored under `key` (a compact store answers without
    /// decoding it).
    fn mod_revision(&self, key: &str) -> Option<i64> {
        self.get_by_key(key).map(|o| o.mod_revision)
    }
    /// Every key stored.
    fn list_keys(&self) -> Vec<Arc<str>>;
    /// How many objects are stored. The default collects every key: a store that can count
    /// them overrides it (a relist asks it once, at the start).
    fn len(&self) -> usize {
        self.list_keys().len()
    }
    /// Whether nothing is stored.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Every object stored.
    fn list(&self) -> Vec<Arc<Object<T>>>;
    /// Empty content to build a relist into, with the store's indexes (and representation) if
    /// it has any.
    fn new_content(&self) -> StoreContent<T>
    where
        T: Send + Sync + 'static,
    {
        StoreContent::default()
    }
    /// Puts the object stored under `key` into `content` if it is in the state `stamp` names
    /// (its revisions and the digest of its value: see [`Stamp`]), and says whether it did: a
    /// relist keeps what did not change without decoding or copying it. An [`Indexer`] shares
    /// the stored object with `content` (a compact one, its packed bytes).
    fn keep_unchanged(&self, content: &mut StoreContent<T>, key: &str, stamp: &Stamp) -> bool
    where
        T: Send + Sync + 'static,
    {
        // The revision first: a compact store would decode the object to tell.
        if self.mod_revision(key) != Some(stamp.mod_revision) {
            return false;
        }
        match self.get_by_key(key) {
            Some(obj) if obj.stamp().as_ref() == Some(stamp) => {
                content.add(obj);
                true
            }
            _ => false,
        }
    }
}

/// The key of an object in the cache: its key relative to the watched prefix (client-go's
/// `MetaNamespaceKeyFunc`, which gives `namespace/name`).
pub fn meta_namespace_key_func<T>(obj: &Object<T>) -> &str {
    obj.key()
}
