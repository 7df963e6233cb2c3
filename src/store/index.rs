//! Index functions: what an object is listed under in each named index (client-go's
//! `index.go`), and the errors of asking for an index.

use std::collections::HashMap;
use std::sync::Arc;

use crate::object::Object;

/// The name of the namespace index (client-go's `cache.NamespaceIndex`).
pub const NAMESPACE_INDEX: &str = "namespace";

/// Computes the index values of an object; an object may have several (or none). Cloning
/// shares the function.
///
/// ```
/// use etcd_informer::{IndexFunc, Object};
///
/// let by_value = IndexFunc::new(|o: &Object<String>| vec![o.value.clone()]);
/// let object = Object::new("tmp/demo", 2, "blue".to_string());
/// assert_eq!(by_value.values(&object), ["blue"]);
/// assert_eq!(IndexFunc::namespace().values(&object), ["tmp"]);
/// ```
pub struct IndexFunc<T>(Func<T>);

type ValuesFn<T> = dyn Fn(&Object<T>) -> Vec<String> + Send + Sync;

enum Func<T> {
    /// [`namespace_index_func`], whose value the key alone gives: the store's items are kept
    /// by namespace, and are this index.
    Namespace,
    Custom(Arc<ValuesFn<T>>),
}

impl<T> IndexFunc<T> {
    /// An index function computing an object's values with `f`.
    pub fn new(f: impl Fn(&Object<T>) -> Vec<String> + Send + Sync + 'static) -> Self {
        IndexFunc(Func::Custom(Arc::new(f)))
    }

    /// The namespace index function ([`namespace_index_func`]), which costs the store nothing
    /// beyond its items: they are kept in one set per namespace.
    pub fn namespace() -> Self {
        IndexFunc(Func::Namespace)
    }

    /// The values `obj` is listed under.
    pub fn values(&self, obj: &Object<T>) -> Vec<String> {
        match &self.0 {
            Func::Namespace => namespace_index_func(obj),
            Func::Custom(f) => f(obj),
        }
    }

    /// Whether the key alone gives the values: the namespace index, which a store answers
    /// from its items (kept in one set per namespace) rather than from sets of its own.
    pub(crate) fn keyed(&self) -> bool {
        matches!(self.0, Func::Namespace)
    }

    /// Whether `other` is this function (a clone of it, or both the namespace function), not
    /// just one that computes the same.
    pub(crate) fn same(&self, other: &Self) -> bool {
        match (&self.0, &other.0) {
            (Func::Namespace, Func::Namespace) => true,
            (Func::Custom(f), Func::Custom(g)) => Arc::ptr_eq(f, g),
            _ => false,
        }
    }
}

impl<T> Clone for IndexFunc<T> {
    fn clone(&self) -> Self {
        IndexFunc(match &self.0 {
            Func::Namespace => Func::Namespace,
            Func::Custom(f) => Func::Custom(f.clone()),
        })
    }
}

impl<T> std::fmt::Debug for IndexFunc<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Func::Namespace => "IndexFunc::namespace()",
            Func::Custom(_) => "IndexFunc::new(..)",
        })
    }
}

/// Named index functions.
pub type Indexers<T> = HashMap<String, IndexFunc<T>>;

/// The namespace index function: the first path segment of the key (`tmp` for `tmp/demo`), as
/// client-go's `MetaNamespaceIndexFunc`. [`IndexFunc::namespace`] is the index of it.
pub fn namespace_index_func<T>(obj: &Object<T>) -> Vec<String> {
    vec![obj.namespace().to_owned()]
}

/// Just the namespace index, under [`NAMESPACE_INDEX`].
pub fn namespace_indexers<T: 'static>() -> Indexers<T> {
    HashMap::from([(NAMESPACE_INDEX.to_owned(), IndexFunc::namespace())])
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
