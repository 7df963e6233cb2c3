//! The cached object: a decoded etcd value together with its key and revisions.

use std::sync::Arc;

/// One key of the watched prefix, decoded into the user's type `T`.
///
/// Objects are immutable once built and shared as `Arc<Object<T>>` between the store, the
/// indexes, the DeltaFIFO and every handler: nothing in the pipeline copies `T`.
///
/// The key is relative to the watched prefix: `/registry/configmaps/tmp/demo` watched under
/// `/registry/configmaps/` has the key `tmp/demo`, the same `namespace/name` shape client-go uses.
#[derive(Debug, Clone)]
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
    /// [`value_digest`] of the bytes etcd stored (0 when the object was not read from etcd).
    digest: u64,
}

/// Equal key, revisions, lease and value (how the value's bytes were digested aside).
impl<T: PartialEq> PartialEq for Object<T> {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
            && self.mod_revision == other.mod_revision
            && self.create_revision == other.create_revision
            && self.version == other.version
            && self.lease == other.lease
            && self.value == other.value
    }
}

impl<T: Eq> Eq for Object<T> {}

/// One object of a list still encoded (a warm start's snapshot record), for a sink that keeps
/// objects encoded: see [`ListSink::takes_encoded`](crate::ListSink::takes_encoded).
#[derive(Debug, Clone)]
pub struct EncodedObject<'a> {
    /// The key, relative to the source.
    pub key: &'a str,
    /// The value as the codec encodes it.
    pub value: &'a [u8],
    /// `[mod_revision, create_revision, version, lease]`.
    pub revisions: [i64; 4],
    /// [`value_digest`](crate::object::value_digest) of the value as etcd stored it (0: unknown).
    pub digest: u64,
    /// Its values for each index, in the order of the sorted index names.
    pub index: IndexValues<'a>,
    /// Its whole record, where the compact cache can keep it without a copy (a warm start's
    /// file); `None` from anyone but this crate.
    pub record: Option<SharedRecord<'a>>,
}

/// An [`EncodedObject`]'s values for each index: slices of one list that a page's objects
/// share, so that a page of encoded objects costs no allocation per object.
///
/// ```
/// use etcd_informer::IndexValues;
///
/// // Three indexes: the first with one value, the second with none, the third with two.
/// let values = ["ns", "a", "b"];
/// let index = IndexValues::new(&values, &[1, 1, 3]);
/// assert_eq!(index.len(), 3);
/// assert!(index.get(1).is_empty());
/// assert_eq!(index.get(2), ["a", "b"]);
/// assert!(index.get(3).is_empty());
/// ```
#[derive(Clone, Copy, Default)]
pub struct IndexValues<'a> {
    values: &'a [&'a str],
    /// Where each index's values end in `values`.
    ends: &'a [usize],
    /// Where the first index's values start in `values`.
    start: usize,
}

impl<'a> IndexValues<'a> {
    /// The values of each index in turn: index `i`'s are `values[ends[i - 1]..ends[i]]` (the
    /// first's from the start). Ends out of order or past `values` give an index no values.
    pub fn new(values: &'a [&'a str], ends: &'a [usize]) -> Self {
        IndexValues {
            values,
            ends,
            start: 0,
        }
    }

    /// As [`new`](Self::new), the first index's values starting at `values[start]`: one of
    /// many objects' values in one list.
    pub(crate) fn within(values: &'a [&'a str], ends: &'a [usize], start: usize) -> Self {
        IndexValues {
            values,
            ends,
            start,
        }
    }

    /// How many indexes it has values for.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether it has values for no index.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// The values of index `i` (none past the last).
    pub fn get(&self, i: usize) -> &'a [&'a str] {
        let from = match i.checked_sub(1) {
            None => self.start,
            Some(before) => self.ends.get(before).copied().unwrap_or(usize::MAX),
        };
        let to = self.ends.get(i).copied().unwrap_or(0);
        self.values.get(from..to).unwrap_or_default()
    }

    /// The values of each index in turn.
    pub fn iter(&self) -> impl Iterator<Item = &'a [&'a str]> + 'a {
        let this = *self;
        (0..this.len()).map(move |i| this.get(i))
    }
}

impl std::fmt::Debug for IndexValues<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Its own values, not the whole page's.
        f.debug_list().entries(self.iter()).finish()
    }
}

/// Where an [`EncodedObject`]'s record lies in a buffer the compact cache can share: a warm
/// start's file holds its records in the compact cache's own layout, so the cache keeps the
/// file's bytes instead of copying them. Only this crate makes one: it vouches that the bytes
/// are that object's record, and that the buffer holds records only.
#[derive(Clone, Copy)]
pub struct SharedRecord<'a> {
    pub(crate) buffer: &'a Arc<Box<[u8]>>,
    pub(crate) at: u32,
    pub(crate) len: u32,
    /// The key's hash for the store's sets (`store::key_hash`), taken as the file was parsed.
    pub(crate) key_hash: u64,
}

impl std::fmt::Debug for SharedRecord<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the buffer: it is a whole file's records.
        f.debug_struct("SharedRecord")
            .field("at", &self.at)
            .field("len", &self.len)
            .finish()
    }
}

/// What tells whether a cached object is the state of its key a list found, without decoding
/// the listed value: within one store, `mod_revision` alone would do; a store wiped and
/// refilled can give a key the same revisions with another value, which the digest of the
/// value's bytes tells apart.
///
/// ```
/// use etcd_informer::Stamp;
/// let a = Stamp::new(7, 3, 2, b"v1");
/// assert_ne!(a, Stamp::new(7, 3, 2, b"v2"));
/// assert_eq!(a.mod_revision, 7);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    /// etcd `mod_revision`.
    pub mod_revision: i64,
    /// etcd `create_revision`.
    pub create_revision: i64,
    /// etcd `version`.
    pub version: i64,
    /// [`value_digest`] of the value's bytes as etcd stored them.
    pub digest: u64,
}

impl Stamp {
    /// The stamp of a key etcd holds at these revisions with this value.
    pub fn new(mod_revision: i64, create_revision: i64, version: i64, value: &[u8]) -> Self {
        Stamp {
            mod_revision,
            create_revision,
            version,
            digest: value_digest(value),
        }
    }
}

/// A 64-bit digest of a value's bytes: FNV-1a 64's constants over 8-byte little-endian words
/// (then the tail byte by byte), 1.2-1.6 ns per 8 bytes, so that digesting every value read,
/// or a snapshot file of hundreds of megabytes, costs little. Each step is a bijection of the
/// state for a given word and of the word for a given state, so any change confined to one
/// word always changes the result. Not a cryptographic hash: it tells a refilled store's value
/// from the cached one, not a value crafted to collide.
pub fn value_digest(bytes: &[u8]) -> u64 {
    let mut digest = ValueDigest::default();
    digest.update(bytes);
    digest.finish()
}

/// [`value_digest`] of bytes that come a part at a time (a snapshot file read a page at a
/// time): the same as of their concatenation.
pub(crate) struct ValueDigest {
    hash: u64,
    /// The bytes after the last whole word so far, waiting for the next part's.
    pending: [u8; 8],
    pending_len: usize,
}

impl Default for ValueDigest {
    fn default() -> Self {
        ValueDigest {
            hash: ValueDigest::OFFSET,
            pending: [0; 8],
            pending_len: 0,
        }
    }
}

impl ValueDigest {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;

    fn word(&mut self, word: [u8; 8]) {
        self.hash = (self.hash ^ u64::from_le_bytes(word)).wrapping_mul(Self::PRIME);
    }

    pub(crate) fn update(&mut self, mut bytes: &[u8]) {
        if self.pending_len > 0 {
            let take = (8 - self.pending_len).min(bytes.len());
            self.pending[self.pending_len..self.pending_len + take].copy_from_slice(&bytes[..take]);
            self.pending_len += take;
            bytes = &bytes[take..];
            if self.pending_len < 8 {
                return;
            }
            self.word(self.pending);
            self.pending_len = 0;
        }
        let mut words = bytes.chunks_exact(8);
        for word in &mut words {
            let mut w = [0u8; 8];
            w.copy_from_slice(word);
            self.word(w);
        }
        let rest = words.remainder();
        self.pending[..rest.len()].copy_from_slice(rest);
        self.pending_len = rest.len();
    }

    pub(crate) fn finish(self) -> u64 {
        self.pending[..self.pending_len]
            .iter()
            .fold(self.hash, |hash, &b| {
                (hash ^ u64::from(b)).wrapping_mul(Self::PRIME)
            })
    }
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
            digest: 0,
        }
    }

    /// The same object, marked as decoded from the value bytes `raw` (what etcd stored): it
    /// then has a [`stamp`](Self::stamp), so that a relist can keep it without decoding the
    /// listed value again. A [`ListerWatcher`](crate::ListerWatcher) of your own calls it on
    /// what it decodes; [`EtcdListerWatcher`](crate::listwatch::etcd::EtcdListerWatcher) does.
    ///
    /// ```
    /// use etcd_informer::{Object, Stamp};
    /// let o = Object::new("tmp/demo", 7, 42u32).read_from(b"42");
    /// assert_eq!(o.stamp(), Some(Stamp::new(7, 7, 1, b"42")));
    /// assert_eq!(Object::new("tmp/demo", 7, 42u32).stamp(), None);
    /// ```
    pub fn read_from(mut self, raw: &[u8]) -> Self {
        self.digest = value_digest(raw);
        self
    }

    /// The digest of the bytes etcd stored (0: unknown), as kept by a compact cache or a
    /// snapshot and given back by [`with_digest`](Self::with_digest).
    pub(crate) fn digest(&self) -> u64 {
        self.digest
    }

    pub(crate) fn with_digest(mut self, digest: u64) -> Self {
        self.digest = digest;
        self
    }

    /// What a relist compares to decide it need not decode the listed value again; `None`
    /// when the object was not read from etcd (no digest of its bytes).
    pub fn stamp(&self) -> Option<Stamp> {
        (self.digest != 0).then_some(Stamp {
            mod_revision: self.mod_revision,
            create_revision: self.create_revision,
            version: self.version,
            digest: self.digest,
        })
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
            digest: self.digest,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Digests are kept in snapshot files and compared across builds: these figures must not
    /// move. Bytes `i * 37 + 11` for `i` in `0..n`.
    #[test]
    fn the_digest_is_the_one_files_hold() {
        let pinned = [
            (0, 0xcbf2_9ce4_8422_2325),
            (1, 0xaf63_c64c_8601_c72a),
            (7, 0xfcf2_5e86_8166_b7a9),
            (8, 0x648a_88b1_6455_972a),
            (9, 0x2cfd_5e6d_7d6f_bf7b),
            (15, 0x8806_dae3_26c3_cb50),
            (16, 0x86da_ced2_b757_e77b),
            (100, 0xc1f3_b825_ea72_05c5),
        ];
        for (n, digest) in pinned {
            let bytes: Vec<u8> = (0..n as u32).map(|i| (i * 37 + 11) as u8).collect();
            assert_eq!(value_digest(&bytes), digest, "{n} bytes");
        }
    }

    #[test]
    fn the_digest_of_parts_is_the_digest_of_the_whole() {
        let bytes: Vec<u8> = (0..100u8).map(|b| b.wrapping_mul(37)).collect();
        for cuts in [
            vec![],
            vec![3],
            vec![8, 9, 10],
            vec![1, 2, 3, 4, 5, 6, 7, 50, 99],
        ] {
            let mut d = ValueDigest::default();
            let mut from = 0;
            for cut in cuts.iter().copied().chain([bytes.len()]) {
                d.update(&bytes[from..cut]);
                from = cut;
            }
            assert_eq!(d.finish(), value_digest(&bytes), "cut at {cuts:?}");
        }
    }
}
