//! The source of objects: list everything at one revision, then watch the changes after it.
//!
//! [`ListerWatcher`] is the seam between the pipeline and where the data lives. The etcd source
//! ([`EtcdListerWatcher`](crate::listwatch::etcd::EtcdListerWatcher)) implements it over a key prefix;
//! [`ListWatch`] builds one from two closures, as client-go's `cache.ListWatch` does; the
//! `testing` feature adds an in-memory one.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tokio_stream::Stream;

use crate::object::EncodedObject;
use crate::object::Object;
use crate::object::Stamp;

pub mod capabilities;
pub mod etcd;
mod hedged;

pub(crate) use self::capabilities::SourceCapabilities;
pub use self::capabilities::{
    Capabilities, ListKeyRevisions, ProveFreshness, Resumable, SavedCache,
};

/// A boxed, sendable future, as returned by [`ListerWatcher`].
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Where [`ListerWatcher::list_into`] puts the pages of a list: the informer's queue builds the
/// next cache content from them (keys and indexes) while the source reads on. Pages may come
/// from several threads at once, in any order.
pub trait ListSink<T>: Send + Sync {
    /// Called once, before any page, with the revision the list is read at and how many keys
    /// the source counts in it (a hint for sizing).
    fn begin(&self, revision: i64, keys: usize) {
        let _ = (revision, keys);
    }
    /// How many objects the sink holds that the list may find unchanged (a relist into a
    /// cache), asked after [`begin`](Self::begin). A list into a sink that holds at least
    /// half its keys reads smaller pages: such a page is mostly kept, not decoded, so a large
    /// one in flight only adds to the memory peak. Default 0.
    fn held(&self) -> usize {
        0
    }
    /// Whether the sink already has `key` in the state the list found it in (`stamp`: its
    /// revisions and the digest of its value bytes, so that a store wiped and refilled with
    /// the same revisions is not taken for the cached one) and keeps it: the source then
    /// neither decodes the value nor puts the key in a page, so that a relist of a large,
    /// mostly unchanged prefix neither decodes nor holds every object twice. `false` (the
    /// default): every key comes in a page.
    fn unchanged(&self, key: &str, stamp: &Stamp) -> bool {
        let _ = (key, stamp);
        false
    }
    /// Takes one page of objects.
    fn page(&self, objects: Vec<Arc<Object<T>>>);
    /// Whether the sink takes the list's `keys` objects still encoded ([`page_encoded`](
    /// Self::page_encoded)) instead of decoded: it keeps objects encoded by a codec named
    /// `codec` (a compact cache), indexes exactly `indexes` (sorted names), and each object
    /// of `sample` (spread evenly over the list) decodes, with the index values given.
    /// `false` (the default): pages of decoded objects.
    fn takes_encoded(
        &self,
        codec: &str,
        indexes: &[String],
        keys: usize,
        sample: &[EncodedObject<'_>],
    ) -> bool {
        let _ = (codec, indexes, keys, sample);
        false
    }
    /// Takes one page of encoded objects, after [`takes_encoded`](Self::takes_encoded) said
    /// yes.
    fn page_encoded(&self, objects: &[EncodedObject<'_>]) {
        let _ = objects;
    }
    /// Drops every object taken so far: the list will start again (a warm start's records,
    /// taken while the source was asked whether it can follow on from them, and it said no).
    /// A sink that says yes to [`takes_encoded`](Self::takes_encoded) must implement it.
    fn discard(&self) {}
}

/// The stream of changes returned by [`ListerWatcher::watch`].
pub type WatchStream<T> = Pin<Box<dyn Stream<Item = WatchEvent<T>> + Send>>;

std::thread_local! {
    /// When the source received the response whose events its stream is yielding now; set by
    /// the stream inside `poll_next`, taken by the reflector right after that poll returns on
    /// the same thread (so the stage latencies need no timestamp in `WatchEvent`).
    static RECEIVED: std::cell::Cell<Option<std::time::Instant>> = const { std::cell::Cell::new(None) };
}

/// Called by a [`WatchStream`] inside `poll_next` as it yields the first event of a response
/// received at `at`.
pub(crate) fn stamp_received(at: std::time::Instant) {
    RECEIVED.with(|r| r.set(Some(at)));
}

/// The stamp the stream just polled left, if it left one.
pub(crate) fn take_received() -> Option<std::time::Instant> {
    RECEIVED.with(std::cell::Cell::take)
}

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

/// The underlying error a [`Error`] keeps as its [`source`](std::error::Error::source): etcd's
/// (an [`etcd_client::Error`]) for the etcd source. Shared, so that the error stays `Clone`.
pub type Cause = Arc<dyn std::error::Error + Send + Sync + 'static>;

/// Why a list or watch failed. The reflector relists on [`Error::Expired`] and
/// [`Error::StoreReplaced`], watches again as soon as etcd answers on [`Error::Unavailable`], and
/// retries with the protective backoff on [`Error::Transient`] (etcd answered with an error).
///
/// The error etcd returned, when there is one, is the [`source`](std::error::Error::source);
/// the variant is decided on its gRPC status code, never on its text. Build errors with the
/// constructors ([`Error::transient`], [`Error::unavailable`], [`Error::expired`],
/// [`Error::store_replaced`]) and attach a cause with [`Error::with_source`]:
///
/// ```
/// use etcd_informer::listwatch::Error;
///
/// let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
/// let e = Error::unavailable("the watch of /pods/ broke").with_source(io);
/// assert!(e.is_unavailable());
/// assert_eq!(e.to_string(), "the watch of /pods/ broke");
/// assert_eq!(std::error::Error::source(&e).unwrap().to_string(), "reset by peer");
///
/// let compacted = Error::expired(42, "etcd compacted up to revision 50");
/// let replaced = Error::store_replaced(42, "etcd is at revision 3");
/// assert!(compacted.is_expired() && replaced.is_expired() && replaced.is_store_replaced());
/// assert_ne!(compacted.to_string(), replaced.to_string());
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The requested revision is gone (etcd compacted it): the equivalent of HTTP 410 Gone.
    /// Only a fresh list can recover.
    #[error("revision {revision} was compacted away: {reason}")]
    Expired {
        /// The revision that was asked for.
        revision: i64,
        /// What the source said.
        reason: String,
        /// etcd's error, when it reported the compaction as one.
        #[source]
        source: Option<Cause>,
    },
    /// The store went back in time (etcd wiped, or restored from a backup): revisions start
    /// over, so equal revisions no longer mean equal objects. Only a fresh list that retires
    /// everything cached can recover.
    #[error("the store was replaced (wiped or restored) before revision {revision}: {reason}")]
    StoreReplaced {
        /// The revision that was asked for.
        revision: i64,
        /// What showed it.
        reason: String,
    },
    /// When a watch was opened again, etcd counted another number of keys under the prefix at
    /// the watched revision than the list and the events since did: the store was replaced
    /// (wiped and written past that revision) or an event was lost on the way. Nothing tells
    /// which, and in a rewritten store a key at the revision the cache holds may hold another
    /// value, so the reflector relists as for [`Error::StoreReplaced`]: every value read afresh,
    /// every cached key retired and every listed one announced anew.
    #[error("the key tally differs at revision {revision}: {reason}")]
    TallyDiffers {
        /// The revision that was asked for.
        revision: i64,
        /// What showed it.
        reason: String,
    },
    /// etcd answered with an error that retrying may fix (no leader, too many requests, a
    /// permission it may yet be granted): retried with the protective backoff.
    #[error("{message}")]
    Transient {
        /// What failed, naming the prefix.
        message: String,
        /// etcd's error, if it returned one.
        #[source]
        source: Option<Cause>,
    },
    /// etcd could not be reached or stopped answering (connection refused or lost, a silent
    /// watch): retried as soon as an endpoint answers, with a short capped backoff.
    #[error("{message}")]
    Unavailable {
        /// What failed, naming the prefix.
        message: String,
        /// etcd's (or the transport's) error, if there was one.
        #[source]
        source: Option<Cause>,
    },
}

impl Error {
    /// A transient error from anything displayable, without a source.
    pub fn transient(e: impl fmt::Display) -> Self {
        Error::Transient {
            message: e.to_string(),
            source: None,
        }
    }

    /// An [`Error::Unavailable`] from anything displayable, without a source.
    pub fn unavailable(e: impl fmt::Display) -> Self {
        Error::Unavailable {
            message: e.to_string(),
            source: None,
        }
    }

    /// An [`Error::Expired`]: `revision` was compacted away.
    pub fn expired(revision: i64, reason: impl fmt::Display) -> Self {
        Error::Expired {
            revision,
            reason: reason.to_string(),
            source: None,
        }
    }

    /// An [`Error::StoreReplaced`]: the store went back in time before `revision`.
    pub fn store_replaced(revision: i64, reason: impl fmt::Display) -> Self {
        Error::StoreReplaced {
            revision,
            reason: reason.to_string(),
        }
    }

    /// This error with `cause` as its [`source`](std::error::Error::source) (ignored by
    /// [`Error::StoreReplaced`], which no single error shows).
    #[must_use]
    pub fn with_source(self, cause: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.with_cause(Arc::new(cause))
    }

    /// [`Error::with_source`] with an already shared cause.
    #[must_use]
    pub fn with_cause(mut self, cause: Cause) -> Self {
        match &mut self {
            Error::Expired { source, .. }
            | Error::Transient { source, .. }
            | Error::Unavailable { source, .. } => *source = Some(cause),
            Error::StoreReplaced { .. } | Error::TallyDiffers { .. } => {}
        }
        self
    }

    /// Whether only a relist can recover.
    pub fn is_expired(&self) -> bool {
        matches!(
            self,
            Error::Expired { .. } | Error::StoreReplaced { .. } | Error::TallyDiffers { .. }
        )
    }

    /// Whether the key tally differed ([`Error::TallyDiffers`]).
    pub fn is_tally_differs(&self) -> bool {
        matches!(self, Error::TallyDiffers { .. })
    }

    /// Whether etcd could not be reached ([`Error::Unavailable`]).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Error::Unavailable { .. })
    }

    /// Whether the store itself was replaced ([`Error::StoreReplaced`]).
    pub fn is_store_replaced(&self) -> bool {
        matches!(self, Error::StoreReplaced { .. })
    }

    /// The etcd error behind this one, if etcd returned one.
    pub fn etcd_error(&self) -> Option<&etcd_client::Error> {
        let source: &(dyn std::error::Error + 'static) = match self {
            Error::Expired { source, .. }
            | Error::Transient { source, .. }
            | Error::Unavailable { source, .. } => source.as_deref()?,
            Error::StoreReplaced { .. } | Error::TallyDiffers { .. } => return None,
        };
        source.downcast_ref()
    }
}

/// What a source says of a cache's freshness; see [`ProveFreshness::freshness`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Freshness {
    /// The revision the answer is about: the source's current revision (read linearizably), or
    /// the one asked for.
    pub revision: i64,
    /// Nothing under the source changed after the cache's revision up to `revision`, and the
    /// number of keys matches the cache's: the cache holds the source's content at `revision`.
    pub unchanged: bool,
}

// ---- Warm restart from a snapshot (issue 26): what a source says of a saved cache ----

/// Who a source reads from, as a [snapshot](crate::snapshot) records it: a snapshot is only
/// loaded into an informer over the same store (`cluster_id`) and prefix (`name`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceIdentity {
    /// What the source reads: the etcd prefix, or a name for other sources.
    pub name: String,
    /// The store's cluster id (etcd's response header); `None` while the source has not heard
    /// from it yet, or for a source that has none to tell (then no snapshot is written).
    pub cluster_id: Option<u64>,
}

/// Whether a cache saved at a revision can follow the source from there; see
/// [`Resumable::can_resume`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// Same store, the revision is still there, and the source counts as many keys at it as
    /// the cache holds: watch from the revision, no list.
    Ready,
    /// The revision was compacted away: nothing can show the changes since, nor count the keys
    /// at it, so the cache cannot be proven to be this store; a list is needed (the informer
    /// starts cold).
    Compacted(String),
    /// The cache must not be used: another store, one replaced since (its revision is behind
    /// the cache's, or the key tally differs), or a source that cannot tell. Why.
    Refused(String),
}

/// Lists the objects of a source at one revision, and watches the changes after a revision:
/// client-go's `ListerWatcher`, with what some sources can do beyond it asked for through
/// [`capabilities`](Self::capabilities) (freshness proofs, the audit's key revisions,
/// resuming from a snapshot: see [`Capabilities`]).
///
/// Contract: `list` returns every object at one revision `R` (a consistent snapshot); `watch(R)`
/// yields every change with a revision greater than `R`, in revision order, with each object's
/// `mod_revision` as its revision, and the changes of one revision together: the stream yields
/// them without waiting in between (etcd never splits a transaction across watch responses),
/// so that the informer can apply each revision atomically. A source that cannot serve `R` any
/// more reports [`Error::Expired`].
///
/// A source implements three methods: `list`, `watch` and `capabilities`. One that wraps
/// another implements what it changes and forwards `capabilities` in one line, keeping every
/// capability of the source it wraps (see the [`capabilities`] module). `list_into` is
/// provided as one page of `list`: a wrapper over a paging source (etcd's) forwards it too, or
/// its lists arrive whole. What a source lacks, the informer says at start and in its errors.
pub trait ListerWatcher<T>: Send + Sync + 'static {
    /// Every object, and the revision they were read at.
    fn list(&self) -> BoxFuture<'_, Result<ListResult<T>>>;
    /// Lists as [`list`](Self::list) does, handing the objects to `sink` a page at a time as
    /// they are decoded, so that the cache is built while the source reads the next page;
    /// returns the list's revision. After an error, what the sink received is discarded. By
    /// default one page: [`list`](Self::list)'s whole list ([`list_whole_into`]).
    fn list_into(&self, sink: Arc<dyn ListSink<T>>) -> BoxFuture<'_, Result<i64>>
    where
        T: 'static,
    {
        Box::pin(list_whole_into(self, sink))
    }
    /// The changes after `after_revision` (exclusive).
    fn watch(&self, after_revision: i64) -> BoxFuture<'_, Result<WatchStream<T>>>;
    /// What the source can do beyond listing and watching ([`Capabilities`]). Required, so
    /// that a source says it on purpose: [`Capabilities::none`] for one that only lists and
    /// watches, the inner source's for a wrapper (which keeps them all). A wrapper is right to
    /// forward them while it keeps the inner source's keys and revisions; one that filters or
    /// rewrites keys answers for itself (the audit and the freshness proof count keys).
    fn capabilities(&self) -> Capabilities<'_>;
}

/// Receives the pages of [`ListKeyRevisions::key_revisions`]: keys relative to the source, with
/// their `mod_revision`s.
pub type KeyRevisionsSink = Box<dyn FnMut(Vec<(Arc<str>, i64)>) + Send>;

/// [`ListerWatcher::list_into`] for a source that reads its list whole: lists, then hands
/// everything to `sink` as one page.
pub async fn list_whole_into<T, L: ListerWatcher<T> + ?Sized>(
    source: &L,
    sink: Arc<dyn ListSink<T>>,
) -> Result<i64> {
    let list = source.list().await?;
    sink.begin(list.revision, list.items.len());
    sink.page(list.items.into_iter().map(Arc::new).collect());
    Ok(list.revision)
}

/// A shared or boxed source is the source: every method forwards.
macro_rules! forward_lister_watcher {
    ($($pointer:ident),*) => {$(
        impl<T, L: ListerWatcher<T> + ?Sized> ListerWatcher<T> for $pointer<L> {
            fn list(&self) -> BoxFuture<'_, Result<ListResult<T>>> {
                (**self).list()
            }
            fn list_into(&self, sink: Arc<dyn ListSink<T>>) -> BoxFuture<'_, Result<i64>>
            where
                T: 'static,
            {
                (**self).list_into(sink)
            }
            fn watch(&self, after_revision: i64) -> BoxFuture<'_, Result<WatchStream<T>>> {
                (**self).watch(after_revision)
            }
            fn capabilities(&self) -> Capabilities<'_> {
                (**self).capabilities()
            }
        }
    )*};
}

forward_lister_watcher!(Arc, Box);

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
    /// Closures cannot prove freshness, list keys at a revision, or name a store.
    fn capabilities(&self) -> Capabilities<'_> {
        Capabilities::none()
    }
}
