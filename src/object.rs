//! The cached object: a decoded etcd value together with its key and revisions.

use std::sync::Arc;

/// One key of the watched prefix, decoded into the user's type `T`.
///
/// Objects are immutable once built and shared as `Arc<Object<T>>` between the store, the
/// indexes, the DeltaFIFO and every handler: nothing in the pipeline copies `T`.
///
/// The key is relative to the watched prefix: `/registry/configmaps/tmp/demo` watched under
/// `/registry/configmaps/` has the key `tmp/demo`, the same `namespace/name` shape client-go uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Object<T> {
    key: Arc<str>,
    /// etcd `mod_revision`: the object's resourceVersion.
    pub mod_revision: i64,
    /// etcd `create_revision`: the revision at which the key was last created.
    pub create_revision: i64,
    /// etcd `version`: the number of writes since the key was created (1 on creation).
    pub version: i64,
    /// The etcd lease attached to the key, 0 when none.
    pub lease: i64,
    /// The decoded value.
    pub value: T,
}

impl<T> Object<T> {
    /// An object with the given key, `mod_revision` and value; the other revisions are set to
    /// match a key created at `mod_revision` and never written since.
    ///
    /// ```
    /// use etcd_informer::Object;
    /// let o = Object::new("tmp/demo", 7, "hello");
    /// assert_eq!((o.key(), o.mod_revision, o.version), ("tmp/demo", 7, 1));
    /// ```
    pub fn new(key: impl Into<Arc<str>>, mod_revision: i64, value: T) -> Self {
        Object {
            key: key.into(),
            mod_revision,
            create_revision: mod_revision,
            version: 1,
            lease: 0,
            value,
        }
    }

    /// The key relative to the watched prefix.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The key as a shared string, so stores and indexes can hold it without copying.
    pub fn shared_key(&self) -> &Arc<str> {
        &self.key
    }

    /// The same object with another value (used by transforms).
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Object<U> {
        Object {
            key: self.key,
            mod_revision: self.mod_revision,
            create_revision: self.create_revision,
            version: self.version,
            lease: self.lease,
            value: f(self.value),
        }
    }

    /// The namespace of the key: its first path segment (`tmp` in `tmp/demo`), or `""` for a
    /// key without a `/`, as client-go's `MetaNamespaceKeyFunc` writes cluster-scoped keys.
    pub fn namespace(&self) -> &str {
        split_key(&self.key).0
    }

    /// The name of the key: everything after the first `/` (`demo` in `tmp/demo`).
    pub fn name(&self) -> &str {
        split_key(&self.key).1
    }
}

/// Splits a key into `(namespace, name)` at its first `/`, as client-go's
/// `SplitMetaNamespaceKey` does.
///
/// ```
/// assert_eq!(etcd_informer::split_key("tmp/demo"), ("tmp", "demo"));
/// assert_eq!(etcd_informer::split_key("node-1"), ("", "node-1"));
/// ```
pub fn split_key(key: &str) -> (&str, &str) {
    match key.split_once('/') {
        Some((ns, name)) => (ns, name),
        None => ("", key),
    }
}
