//! From etcd's bytes to objects: keys relative to the prefix, values through the codec, and
//! the report of what does not decode.

use std::borrow::Cow;
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
    /// See [`EtcdOptions::escape_keys`](super::EtcdOptions).
    pub(super) escape_keys: bool,
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
        let key = relative_key(&self.prefix, full, self.escape_keys);
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

/// `full` without `prefix`, if it is UTF-8 or keys are escaped (see [`key_text`]).
pub(super) fn relative_key(prefix: &[u8], full: &[u8], escape: bool) -> Option<Arc<str>> {
    key_text(relative(prefix, full), escape).map(Arc::from)
}

/// Marks a key carried as text that is not its own bytes (U+10FFFF, a noncharacter): the
/// rest is its bytes in hex.
const ESCAPED: char = '\u{10FFFF}';

/// A key as text: its bytes when they are UTF-8; otherwise, when keys are escaped, the mark
/// and the bytes in hex (as is a UTF-8 key that itself starts with the mark, so that no two
/// keys share a text), and `None` when they are not. The escaped form costs only the keys
/// that take it: the informer's sources never escape.
pub(crate) fn key_text(key: &[u8], escape: bool) -> Option<Cow<'_, str>> {
    match std::str::from_utf8(key) {
        Ok(text) if !(escape && text.starts_with(ESCAPED)) => Some(Cow::Borrowed(text)),
        _ if escape => Some(Cow::Owned(escape_key(key))),
        _ => None,
    }
}

/// The escaped text of `key` (see [`key_text`]).
pub(crate) fn escape_key(key: &[u8]) -> String {
    use std::fmt::Write;
    let mut text = String::with_capacity(ESCAPED.len_utf8() + 2 * key.len());
    text.push(ESCAPED);
    for byte in key {
        let _ = write!(text, "{byte:02x}");
    }
    text
}

/// The bytes of a key [`key_text`] gave with escaping on.
pub(crate) fn key_bytes(text: &str) -> Cow<'_, [u8]> {
    let Some(hex) = text.strip_prefix(ESCAPED) else {
        return Cow::Borrowed(text.as_bytes());
    };
    let digits = hex.as_bytes();
    let bytes = digits
        .chunks(2)
        .map(|pair| {
            let pair = std::str::from_utf8(pair).unwrap_or("");
            u8::from_str_radix(pair, 16).unwrap_or(0)
        })
        .collect();
    Cow::Owned(bytes)
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
    fn escaped_keys_are_their_bytes_and_no_other_key() {
        let odd = b"/p/\xff\xfe";
        let text = key_text(odd, true).expect("escaped");
        assert_eq!(key_bytes(&text), odd.as_slice());
        assert_eq!(
            key_text(odd, false),
            None,
            "the informer's sources report it"
        );
        assert_eq!(key_text(b"/p/a", true).as_deref(), Some("/p/a"));
        // A UTF-8 key that looks escaped is escaped too: no two keys share a text.
        let looks = "\u{10FFFF}2f".to_string();
        let text = key_text(looks.as_bytes(), true).expect("escaped");
        assert_ne!(text, looks);
        assert_eq!(key_bytes(&text), looks.as_bytes());
        assert_eq!(
            key_text(looks.as_bytes(), false).as_deref(),
            Some(looks.as_str())
        );
    }

    #[test]
    fn range_end_of_prefix() {
        assert_eq!(prefix_range_end(b"/a/"), b"/a0");
        assert_eq!(prefix_range_end(b"a\xff"), b"b");
        assert_eq!(prefix_range_end(b"\xff\xff"), vec![0]);
    }
}
