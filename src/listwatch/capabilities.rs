//! What a source can do beyond listing and watching: prove a cache fresh (consistent reads),
//! list its keys with their revisions (the audit), and name its store and judge a saved cache
//! (snapshots and warm restarts). Each is a trait of its own that the informer asks for
//! through [`ListerWatcher::capabilities`]; a source without one says so, and the informer
//! says what it then cannot do (see [`Capabilities::lacking`]).
//!
//! A source that wraps another forwards them all in one line, and keeps every capability of
//! the source it wraps:
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use etcd_informer::listwatch::{
//!     BoxFuture, Capabilities, ListResult, ListSink, ListerWatcher, Result, WatchStream,
//! };
//!
//! /// Counts the lists of the source it wraps.
//! struct CountingLists<L> { inner: L, lists: AtomicUsize }
//!
//! impl<T: 'static, L: ListerWatcher<T>> ListerWatcher<T> for CountingLists<L> {
//!     fn list(&self) -> BoxFuture<'_, Result<ListResult<T>>> {
//!         self.lists.fetch_add(1, Ordering::Relaxed);
//!         self.inner.list()
//!     }
//!     fn list_into(&self, sink: Arc<dyn ListSink<T>>) -> BoxFuture<'_, Result<i64>> {
//!         self.lists.fetch_add(1, Ordering::Relaxed);
//!         self.inner.list_into(sink)
//!     }
//!     fn watch(&self, after: i64) -> BoxFuture<'_, Result<WatchStream<T>>> {
//!         self.inner.watch(after)
//!     }
//!     fn capabilities(&self) -> Capabilities<'_> {
//!         self.inner.capabilities()
//!     }
//! }
//! ```

use std::time::Duration;

use super::{
    BoxFuture, Error, Freshness, KeyRevisionsSink, ListerWatcher, Result, Resume, SourceIdentity,
};

/// Proves a cache fresh: behind the informer's consistent reads.
pub trait ProveFreshness: Send + Sync {
    /// Whether a cache that holds every change up to `since` is the source's content at `at`
    /// (or, with `None`, at the source's current revision, read linearizably). `cached` is
    /// `Some(n)` when the cache is exactly the source's content at `since`, `n` objects (the
    /// revision-atomic mode), `None` when it may hold later changes too (the DeltaFIFO mode):
    /// only an exact count may stand in for the source's own count at `since`.
    fn freshness(
        &self,
        since: i64,
        cached: Option<usize>,
        at: Option<i64>,
    ) -> BoxFuture<'_, Result<Freshness>>;
}

/// Lists the keys with their revisions, without values: behind the informer's audit.
pub trait ListKeyRevisions: Send + Sync {
    /// Every key at revision `at` with its `mod_revision`, in key order, handed to `page` a
    /// page at a time. Keys the source could not turn into objects at that `mod_revision`
    /// (undecodable) are left out, as the cache lacks them too. [`Error::Expired`] when `at`
    /// is gone.
    fn key_revisions(&self, at: i64, page: KeyRevisionsSink) -> BoxFuture<'_, Result<()>>;
}

/// Names its store and judges a saved cache: behind [snapshots](crate::snapshot) and warm
/// restarts.
pub trait Resumable: Send + Sync {
    /// Who the source reads from, recorded in a snapshot of the cache and compared when one
    /// is loaded ([`SourceIdentity`]).
    fn identity(&self) -> SourceIdentity;
    /// Whether `saved` can follow the source by watching from its revision ([`Resume`]).
    /// Asked once when an informer starts from a snapshot. A source that cannot tell answers
    /// [`Resume::Refused`], never [`Resume::Ready`]: a wrong answer means a wrong cache.
    fn can_resume(&self, saved: SavedCache) -> BoxFuture<'_, Result<Resume>>;
}

/// A cache saved in a snapshot, as [`Resumable::can_resume`] is asked about it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SavedCache {
    /// The revision the cache holds the source's content at.
    pub revision: i64,
    /// How many objects it holds.
    pub keys: usize,
    /// The store it was saved from (the source's [`SourceIdentity::cluster_id`] then).
    pub cluster_id: u64,
    /// A hint: some of the cache's keys (relative to the source, in order), where a source
    /// that walks every key to count them may split the count into parts asked at once. A
    /// source may ignore them (etcd's skips any out of order or repeated).
    pub splits: Vec<String>,
}

impl SavedCache {
    /// A cache of `keys` objects at `revision` of the store `cluster_id`, with no splits.
    pub fn new(revision: i64, keys: usize, cluster_id: u64) -> Self {
        SavedCache {
            revision,
            keys,
            cluster_id,
            splits: Vec::new(),
        }
    }

    /// Sets [`splits`](Self::splits).
    #[must_use]
    pub fn with_splits(mut self, splits: Vec<String>) -> Self {
        self.splits = splits;
        self
    }
}

/// What a source can do beyond listing and watching ([`ListerWatcher::capabilities`]).
/// Nothing by default; a source says what it can with the `with_` methods.
#[derive(Clone, Copy, Default)]
#[non_exhaustive]
pub struct Capabilities<'a> {
    /// Proves a cache fresh: without it, consistent reads fail saying so.
    pub freshness: Option<&'a dyn ProveFreshness>,
    /// Lists keys with their revisions: without it, the informer runs no audit.
    pub key_revisions: Option<&'a dyn ListKeyRevisions>,
    /// Names its store and judges a saved cache: without it, no snapshot is written and an
    /// informer always starts cold.
    pub resume: Option<&'a dyn Resumable>,
    /// How long a live watch of this source can go without yielding anything: a source that
    /// proves its stream alive at least this often (with events, or bookmarks at the revision
    /// already delivered) says so, and an informer that hears nothing for longer reports itself
    /// unhealthy. Without it, silence says nothing about the source.
    pub liveness_bound: Option<Duration>,
    /// How many values failed to decode so far, for the informer's
    /// `etcd_informer_decode_errors_total` [metric](crate::metrics) (0 for sources that do not
    /// decode).
    pub decode_errors: u64,
}

impl<'a> Capabilities<'a> {
    /// Nothing beyond listing and watching.
    pub fn none() -> Self {
        Capabilities::default()
    }

    /// Sets [`freshness`](Self::freshness).
    #[must_use]
    pub fn with_freshness(mut self, source: &'a dyn ProveFreshness) -> Self {
        self.freshness = Some(source);
        self
    }

    /// Sets [`key_revisions`](Self::key_revisions).
    #[must_use]
    pub fn with_key_revisions(mut self, source: &'a dyn ListKeyRevisions) -> Self {
        self.key_revisions = Some(source);
        self
    }

    /// Sets [`resume`](Self::resume).
    #[must_use]
    pub fn with_resume(mut self, source: &'a dyn Resumable) -> Self {
        self.resume = Some(source);
        self
    }

    /// Sets [`liveness_bound`](Self::liveness_bound).
    #[must_use]
    pub fn with_liveness_bound(mut self, bound: Duration) -> Self {
        self.liveness_bound = Some(bound);
        self
    }

    /// Sets [`decode_errors`](Self::decode_errors).
    #[must_use]
    pub fn with_decode_errors(mut self, errors: u64) -> Self {
        self.decode_errors = errors;
        self
    }

    /// What the informer cannot do over this source, in words, for its start line and its
    /// errors: empty when it lacks nothing.
    pub fn lacking(&self) -> Vec<&'static str> {
        let mut lacking = Vec::new();
        if self.freshness.is_none() {
            lacking.push("freshness proofs (consistent reads fail)");
        }
        if self.key_revisions.is_none() {
            lacking.push("key revisions (no audit)");
        }
        if self.resume.is_none() {
            lacking.push("resuming (no snapshot, always a cold start)");
        }
        if self.liveness_bound.is_none() {
            lacking.push("a liveness bound (a silent watch looks healthy)");
        }
        lacking
    }
}

impl std::fmt::Debug for Capabilities<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capabilities")
            .field("freshness", &self.freshness.is_some())
            .field("key_revisions", &self.key_revisions.is_some())
            .field("resume", &self.resume.is_some())
            .field("liveness_bound", &self.liveness_bound)
            .field("decode_errors", &self.decode_errors)
            .finish()
    }
}

/// The capabilities of any source, asked as methods: what the informer calls. A capability
/// the source lacks answers as "not supported", saying so.
pub(crate) trait SourceCapabilities<T> {
    fn freshness(
        &self,
        since: i64,
        cached: Option<usize>,
        at: Option<i64>,
    ) -> BoxFuture<'_, Result<Freshness>>;
    fn key_revisions(&self, at: i64, page: KeyRevisionsSink) -> BoxFuture<'_, Result<()>>;
    fn identity(&self) -> Option<SourceIdentity>;
    fn can_resume(&self, saved: SavedCache) -> BoxFuture<'_, Result<Resume>>;
    fn liveness_bound(&self) -> Option<Duration>;
    fn decode_errors(&self) -> u64;
}

fn unsupported<'a, V: Send + 'a>(what: &'static str) -> BoxFuture<'a, Result<V>> {
    Box::pin(async move {
        Err(Error::transient(format!(
            "the source cannot {what}: its ListerWatcher::capabilities() lacks it (a wrapper forwards the inner source's)"
        )))
    })
}

impl<T, L: ListerWatcher<T> + ?Sized> SourceCapabilities<T> for L {
    fn freshness(
        &self,
        since: i64,
        cached: Option<usize>,
        at: Option<i64>,
    ) -> BoxFuture<'_, Result<Freshness>> {
        match self.capabilities().freshness {
            Some(source) => source.freshness(since, cached, at),
            None => unsupported("prove a cache fresh"),
        }
    }
    fn key_revisions(&self, at: i64, page: KeyRevisionsSink) -> BoxFuture<'_, Result<()>> {
        match self.capabilities().key_revisions {
            Some(source) => source.key_revisions(at, page),
            None => unsupported("list its keys at a revision"),
        }
    }
    fn identity(&self) -> Option<SourceIdentity> {
        self.capabilities().resume.map(Resumable::identity)
    }
    fn can_resume(&self, saved: SavedCache) -> BoxFuture<'_, Result<Resume>> {
        match self.capabilities().resume {
            Some(source) => source.can_resume(saved),
            None => Box::pin(async {
                Ok(Resume::Refused(
                    "the source cannot tell whether a saved cache can follow it".into(),
                ))
            }),
        }
    }
    fn liveness_bound(&self) -> Option<Duration> {
        self.capabilities().liveness_bound
    }
    fn decode_errors(&self) -> u64 {
        self.capabilities().decode_errors
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Proves;

    impl ProveFreshness for Proves {
        fn freshness(
            &self,
            _: i64,
            _: Option<usize>,
            _: Option<i64>,
        ) -> BoxFuture<'_, Result<Freshness>> {
            Box::pin(async { Err(Error::transient("not asked")) })
        }
    }

    #[test]
    fn what_a_source_lacks_is_said_in_words() {
        let none = Capabilities::none().lacking();
        assert_eq!(none.len(), 4, "{none:?}");
        assert!(none[0].contains("consistent reads fail"), "{none:?}");
        let some = Capabilities::none()
            .with_freshness(&Proves)
            .with_liveness_bound(Duration::from_secs(2))
            .lacking();
        assert_eq!(
            some,
            [
                "key revisions (no audit)",
                "resuming (no snapshot, always a cold start)"
            ]
        );
    }
}
