//! From etcd's bytes to objects: keys relative to the prefix, values through the codec, and
//! the report of what does not decode.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use etcd_client::proto::PbKeyValue;

use super::options::DecodeErrorHandler;
use crate::codec::{Codec, DecodeError, DecodeErrorKind};
use crate::object::Object;

/// Turns etcd values into objects, reporting those that do not decode.
pub(super) struct Decoder<T> {
    pub(super) prefix: Arc<[u8]>,
    pub(super) codec: Arc<dyn Codec<T>>,
    pub(super) errors: Arc<AtomicU64>,
    pub(super) on_error: Option<DecodeErrorHandler>,
    pub(super) undecodable: Arc<Undecodable>,
}

/// The keys under the prefix that are not objects (the key is not UTF-8, or the value does
/// not decode), with the `mod_revision` they failed at: the cache lacks them on purpose, and
/// the audit must not take them for lost events. A key fixed or deleted since is kept with the
/// revision it was at and the revision it stopped failing at, until no audit can ask about a
/// revision where it still failed: an audit reads etcd as of its own revision, and the key may
/// have been fixed after it. Bounded by the keys under the prefix, and [`MAX_FIXED`].
#[derive(Default)]
pub(super) struct Undecodable {
    keys: Mutex<Keys>,
    /// How many entries both maps hold, read without the lock on the decode path (almost
    /// always 0).
    len: AtomicUsize,
}

#[derive(Default)]
struct Keys {
    /// Failing now: the `mod_revision` each failed at.
    failing: HashMap<Box<[u8]>, i64>,
    /// Failing no more: for each time it failed and was fixed, the `mod_revision` it failed at
    /// and the revision it was fixed or deleted at (a key fixed and broken again within one
    /// audit's span keeps both: the audit may ask of either).
    fixed: HashMap<Box<[u8]>, Vec<(i64, i64)>>,
}

/// The most keys remembered as fixed; past it one is forgotten, at worst costing an audit a
/// relist it did not need (the DeltaFifo mode, without audits, never prunes them).
const MAX_FIXED: usize = 4096;

/// The most spans of one key remembered as fixed (the oldest is forgotten first).
const MAX_SPANS: usize = 8;

impl Undecodable {
    fn insert(&self, key: &[u8], mod_revision: i64) {
        let mut keys = crate::sync::lock(&self.keys);
        keys.failing.insert(key.into(), mod_revision);
        self.len
            .store(keys.failing.len() + keys.fixed.len(), Ordering::Relaxed);
    }

    /// `key` is an object again, or deleted, at `revision`.
    pub(super) fn remove(&self, key: &[u8], revision: i64) {
        if self.len.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut keys = crate::sync::lock(&self.keys);
        if let Some(failed) = keys.failing.remove(key) {
            if keys.fixed.len() >= MAX_FIXED && !keys.fixed.contains_key(key) {
                if let Some(any) = keys.fixed.keys().next().cloned() {
                    keys.fixed.remove(&any);
                }
            }
            let spans = keys.fixed.entry(key.into()).or_default();
            // Without audits nothing prunes them: a key that keeps breaking keeps its last few.
            if spans.len() >= MAX_SPANS {
                spans.remove(0);
            }
            spans.push((failed, revision));
        }
        self.len
            .store(keys.failing.len() + keys.fixed.len(), Ordering::Relaxed);
    }

    /// Forgets everything: a list reports anew what does not decode.
    pub(super) fn clear(&self) {
        let mut keys = crate::sync::lock(&self.keys);
        keys.failing.clear();
        keys.fixed.clear();
        self.len.store(0, Ordering::Relaxed);
    }

    /// Forgets the keys fixed at or before `at`: at `at` and later etcd shows them at their
    /// fixed `mod_revision` (or not at all), never at the one they failed at.
    pub(super) fn prune(&self, at: i64) {
        if self.len.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut keys = crate::sync::lock(&self.keys);
        keys.fixed.retain(|_, spans| {
            spans.retain(|(_, fixed_at)| *fixed_at > at);
            !spans.is_empty()
        });
        self.len
            .store(keys.failing.len() + keys.fixed.len(), Ordering::Relaxed);
    }

    /// Whether `key` failed to decode at `mod_revision` (and so is not in the cache at any
    /// revision where etcd shows it at that `mod_revision`).
    pub(super) fn holds(&self, key: &[u8], mod_revision: i64) -> bool {
        if self.len.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let keys = crate::sync::lock(&self.keys);
        keys.failing.get(key) == Some(&mod_revision)
            || keys
                .fixed
                .get(key)
                .is_some_and(|spans| spans.iter().any(|(failed, _)| *failed == mod_revision))
    }
}

impl<T: 'static> Decoder<T> {
    /// The key relative to the prefix; a key that is not UTF-8 is reported.
    pub(super) fn key(&self, full: &[u8], revision: i64) -> Option<Arc<str>> {
        let key = relative_key(&self.prefix, full);
        if key.is_none() {
            self.report(full, revision, DecodeErrorKind::KeyNotUtf8);
        }
        key
    }

    pub(super) fn object(&self, kv: &PbKeyValue) -> Option<Object<T>> {
        let key = self.key(&kv.key, kv.mod_revision)?;
        match self.codec.decode(&kv.value) {
            Ok(value) => {
                self.undecodable.remove(&kv.key, kv.mod_revision);
                let mut obj = Object::new(key, kv.mod_revision, value);
                obj.create_revision = kv.create_revision;
                obj.version = kv.version;
                obj.lease = kv.lease;
                Some(obj.read_from(&kv.value))
            }
            Err(source) => {
                self.report(&kv.key, kv.mod_revision, DecodeErrorKind::Value(source));
                None
            }
        }
    }

    pub(super) fn report(&self, key: &[u8], revision: i64, kind: DecodeErrorKind) {
        let error = DecodeError::new(key.to_vec(), revision, kind);
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.undecodable.insert(key, revision);
        tracing::warn!(key = %error.escaped_key(), revision, %error, "undecodable key or value; treating the key as absent");
        if let Some(h) = &self.on_error {
            h(&error);
        }
    }
}

/// `full` without `prefix`, if it is UTF-8.
pub(super) fn relative_key(prefix: &[u8], full: &[u8]) -> Option<Arc<str>> {
    std::str::from_utf8(relative(prefix, full))
        .ok()
        .map(Arc::from)
}

/// `full` without `prefix`.
pub(super) fn relative<'k>(prefix: &[u8], full: &'k [u8]) -> &'k [u8] {
    full.strip_prefix(prefix).unwrap_or(full)
}

/// The end of the range of keys starting with `prefix` (etcd's `GetPrefixRangeEnd`).
pub(crate) fn prefix_range_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // All 0xff (or empty): every key from the prefix on.
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 50, item 5: a key fixed and broken again before an audit at a revision where it
    /// first failed still counts as undecodable there (it lost its "fixed" entry before, and
    /// the audit took it for a lost event: a needless relist).
    #[test]
    fn a_key_fixed_and_broken_again_is_remembered_at_both_failures() {
        let keys = Undecodable::default();
        keys.insert(b"k", 5);
        keys.remove(b"k", 7);
        keys.insert(b"k", 9);
        assert!(keys.holds(b"k", 5), "failed at 5, fixed at 7");
        assert!(keys.holds(b"k", 9), "failing since 9");
        keys.remove(b"k", 11);
        keys.prune(8);
        assert!(!keys.holds(b"k", 5), "no audit asks before 8 any more");
        assert!(keys.holds(b"k", 9));
        keys.prune(11);
        assert!(!keys.holds(b"k", 9));
    }

    #[test]
    fn range_end_of_prefix() {
        assert_eq!(prefix_range_end(b"/a/"), b"/a0");
        assert_eq!(prefix_range_end(b"a\xff"), b"b");
        assert_eq!(prefix_range_end(b"\xff\xff"), vec![0]);
    }
}
