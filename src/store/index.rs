//! Index functions: what an object is listed under in each named index (client-go's
//! `index.go`), and the errors of asking for an index.

use std::collections::HashMap;
use std::sync::Arc;

use crate::object::Object;

/// The name of the namespace index (client-go's `cache.NamespaceIndex`).
pub const NAMESPACE_INDEX: &str = "namespace";

/// Computes the index values of an object; an object may have several (or none).
pub type IndexFunc<T> = Arc<dyn Fn(&Object<T>) -> Vec<String> + Send + Sync>;

/// Named index functions.
pub type Indexers<T> = HashMap<String, IndexFunc<T>>;

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
