//! The source of objects: list everything at one revision, then watch the changes after it.
//!
//! [`ListerWatcher`] is the seam between the pipeline and where the data lives. The etcd source
//! ([`EtcdListerWatcher`](crate::EtcdListerWatcher)) implements it over a key prefix;
//! [`ListWatch`] builds one from two closures, as client-go's `cache.ListWatch` does; the
//! `testing` feature adds an in-memory one.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tokio_stream::Stream;

use crate::Object;

pub mod etcd;

/// A boxed, sendable future, as returned by [`ListerWatcher`].
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The stream of changes returned by [`ListerWatcher::watch`].
pub type WatchStream<T> = Pin<Box<dyn Stream<Item = WatchEvent<T>> + Send>>;

/// Result alias of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every object under the source at one revision.
#[derive(Debug, Clone)]
pub struct ListResult<T> {
    /// The objects, in key order for etcd.
    pub items: Vec<Object<T>>,
    /// The revision the whole list was read at: the list's resourceVersion.
    pub revision: i64,
}

/// One change reported by a watch.
#[derive(Debug)]
pub enum WatchEvent<T> {
    /// A key was created.
    Added(Object<T>),
    /// A key was written again.
    Modified(Object<T>),
    /// A key was deleted (or its new value is undecodable, so the cache treats it as absent).
    Deleted {
        /// The key, relative to the prefix.
        key: Arc<str>,
        /// The revision of the delete.
        revision: i64,
        /// The last value, when the source knows it (etcd `prev_kv`). The pipeline does not need
        /// it: the DeltaFIFO supplies the last cached value.
        last: Option<Object<T>>,
    },
    /// Nothing changed under the source up to this revision (an etcd progress notification).
    Bookmark(i64),
    /// The watch failed. After an error the stream may end; [`Error::Expired`] always ends it.
    Error(Error),
}

impl<T> WatchEvent<T> {
    /// The revision this event brings the watcher to.
    pub fn revision(&self) -> Option<i64> {
        match self {
            WatchEvent::Added(o) | WatchEvent::Modified(o) => Some(o.mod_revision),
            WatchEvent::Deleted { revision, .. } | WatchEvent::Bookmark(revision) => {
                Some(*revision)
            }
            WatchEvent::Error(_) => None,
        }
    }
}

/// Why a list or watch failed. The reflector relists on [`Error::Expired`] and
/// [`Error::StoreReplaced`], watches again as soon as etcd answers on [`Error::Unavailable`], and
/// retries with the protective backoff on [`Error::Transient`] (etcd answered with an error).
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The requested revision is gone (etcd compacted it, or the store went back in time): the
    /// equivalent of HTTP 410 Gone. Only a fresh list can recover.
    #[error("revision {revision} is no longer available: {reason}")]
    Expired {
        /// The revision that was asked for.
        revision: i64,
        /// What the source said.
        reason: String,
    },
    /// The store went back in time (etcd wiped, or restored from a backup): revisions start
    /// over, so equal revisions no longer mean equal objects. Only a fresh list that retires
    /// everything cached can recover.
    #[error("revision {revision} is no longer available: {reason}")]
    StoreReplaced {
        /// The revision that was asked for.
        revision: i64,
        /// What showed it.
        reason: String,
    },
    /// etcd answered with an error that retrying may fix (no leader, too many requests, a
    /// permission it may yet be granted): retried with the protective backoff.
    #[error("{0}")]
    Transient(String),
    /// etcd could not be reached or stopped answering (connection refused or lost, a silent
    /// watch): retried as soon as an endpoint answers, with a short capped backoff.
    #[error("{0}")]
    Unavailable(String),
}

impl Error {
    /// A transient error from anything displayable.
    pub fn transient(e: impl fmt::Display) -> Self {
        Error::Transient(e.to_string())
    }

    /// Whether only a relist can recover.
    pub fn is_expired(&self) -> bool {
        matches!(self, Error::Expired { .. } | Error::StoreReplaced { .. })
    }

    /// Whether etcd could not be reached ([`Error::Unavailable`]).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Error::Unavailable(_))
    }

    /// Whether the store itself was replaced ([`Error::StoreReplaced`]).
    pub fn is_store_replaced(&self) -> bool {
        matches!(self, Error::StoreReplaced { .. })
    }
}

/// What a source says of a cache's freshness; see [`ListerWatcher::freshness`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Freshness {
    /// The revision the answer is about: the source's current revision (read linearizably), or
    /// the one asked for.
    pub revision: i64,
    /// Nothing under the source changed after the cache's revision up to `revision`, and the
    /// number of keys matches the cache's: the cache holds the source's content at `revision`.
    pub unchanged: bool,
}

/// Lists the objects of a source at one revision, and watches the changes after a revision.
///
/// Contract: `list` returns every object at one revision `R` (a consistent snapshot); `watch(R)`
/// yields every change with a revision greater than `R`, in revision order, with each object's
/// `mod_revision` as its revision, and the changes of one revision together: the stream yields
/// them without waiting in between (etcd never splits a transaction across watch responses),
/// so that the informer can apply each revision atomically. A source that cannot serve `R` any
/// more reports [`Error::Expired`].
pub trait ListerWatcher<T>: Send + Sync + 'static {
    /// Every object, and the revision they were read at.
    fn list(&self) -> BoxFuture<'_, Result<ListResult<T>>>;
    /// The changes after `after_revision` (exclusive).
    fn watch(&self, after_revision: i64) -> BoxFuture<'_, Result<WatchStream<T>>>;
    /// Whether a cache that holds `cached` objects and every change up to `since` is the
    /// source's content at `at` (or, with `None`, at the source's current revision, read
    /// linearizably). Behind the informer's consistent reads. Sources that cannot tell return
    /// an error (the default).
    fn freshness(
        &self,
        since: i64,
        cached: usize,
        at: Option<i64>,
    ) -> BoxFuture<'_, Result<Freshness>> {
        let _ = (since, cached, at);
        Box::pin(async {
            Err(Error::Transient(
                "this source cannot read its current revision".into(),
            ))
        })
    }
    /// How many values failed to decode so far (0 for sources that do not decode), for the
    /// informer's `etcd_informer_decode_errors_total` [metric](crate::metrics).
    fn decode_errors(&self) -> u64 {
        0
    }
}

impl<T, L: ListerWatcher<T> + ?Sized> ListerWatcher<T> for Arc<L> {
    fn decode_errors(&self) -> u64 {
        (**self).decode_errors()
    }
    fn list(&self) -> BoxFuture<'_, Result<ListResult<T>>> {
        (**self).list()
    }
    fn watch(&self, after_revision: i64) -> BoxFuture<'_, Result<WatchStream<T>>> {
        (**self).watch(after_revision)
    }
    fn freshness(
        &self,
        since: i64,
        cached: usize,
        at: Option<i64>,
    ) -> BoxFuture<'_, Result<Freshness>> {
        (**self).freshness(since, cached, at)
    }
}

impl<T, L: ListerWatcher<T> + ?Sized> ListerWatcher<T> for Box<L> {
    fn decode_errors(&self) -> u64 {
        (**self).decode_errors()
    }
    fn list(&self) -> BoxFuture<'_, Result<ListResult<T>>> {
        (**self).list()
    }
    fn watch(&self, after_revision: i64) -> BoxFuture<'_, Result<WatchStream<T>>> {
        (**self).watch(after_revision)
    }
    fn freshness(
        &self,
        since: i64,
        cached: usize,
        at: Option<i64>,
    ) -> BoxFuture<'_, Result<Freshness>> {
        (**self).freshness(since, cached, at)
    }
}

/// A [`ListerWatcher`] made of two closures.
///
/// ```
/// use etcd_informer::{ListWatch, ListResult, Object, WatchStream};
/// let lw = ListWatch::new(
///     || async { Ok::<_, etcd_informer::listwatch::Error>(ListResult { items: vec![Object::new("a", 1, 1u32)], revision: 1 }) },
///     |_after: i64| async { Ok::<_, etcd_informer::listwatch::Error>(Box::pin(tokio_stream::empty()) as WatchStream<u32>) },
/// );
/// # let _ = lw;
/// ```
pub struct ListWatch<L, W> {
    list: L,
    watch: W,
}

impl<L, W> ListWatch<L, W> {
    /// A source whose `list` calls `list` and whose `watch` calls `watch`.
    pub fn new(list: L, watch: W) -> Self {
        ListWatch { list, watch }
    }
}

impl<T, L, LF, W, WF> ListerWatcher<T> for ListWatch<L, W>
where
    L: Fn() -> LF + Send + Sync + 'static,
    LF: Future<Output = Result<ListResult<T>>> + Send + 'static,
    W: Fn(i64) -> WF + Send + Sync + 'static,
    WF: Future<Output = Result<WatchStream<T>>> + Send + 'static,
{
    fn list(&self) -> BoxFuture<'_, Result<ListResult<T>>> {
        Box::pin((self.list)())
    }
    fn watch(&self, after_revision: i64) -> BoxFuture<'_, Result<WatchStream<T>>> {
        Box::pin((self.watch)(after_revision))
    }
}
