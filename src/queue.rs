//! The vocabulary the reflector, the queues and the informer share: the changes a queue holds
//! ([`Delta`], [`DeltaType`], [`DeletedObject`]), the [`Queue`] trait the reflector fills,
//! [`Closed`], and the bounds of a resync period. It sits below all three so that none of them
//! imports another to name these (ARCHITECTURE.md, "Layers").

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::listwatch::{BoxFuture, ListSink};
use crate::object::Object;

/// What happened to an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeltaType {
    /// Created (a watch event).
    Added,
    /// Written again (a watch event).
    Updated,
    /// Deleted; see [`Delta::deleted`].
    Deleted,
    /// Present in a relist.
    Replaced,
    /// Re-delivered by a resync; the object did not change.
    Sync,
}

impl fmt::Display for DeltaType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// One change of one object.
#[derive(Debug)]
pub struct Delta<T> {
    /// What happened.
    pub kind: DeltaType,
    /// The object after the change; for [`DeltaType::Deleted`], the last state known.
    pub object: Arc<Object<T>>,
    /// For a [`DeltaType::Deleted`] delta (`None` for the others), the delete as handlers see
    /// it, holding `object`: [`DeletedObject::Deleted`] for a delete seen in the watch,
    /// [`DeletedObject::FinalStateUnknown`] for one found by a relist (client-go's
    /// `DeletedFinalStateUnknown`: the key is gone, and `object` is the last state the cache
    /// knew, which may be older than the key's real final state).
    pub deleted: Option<DeletedObject<T>>,
}

impl<T> Clone for Delta<T> {
    fn clone(&self) -> Self {
        Delta {
            kind: self.kind,
            object: self.object.clone(),
            deleted: self.deleted.clone(),
        }
    }
}

impl<T> Delta<T> {
    pub(crate) fn new(kind: DeltaType, object: Arc<Object<T>>) -> Self {
        let deleted = (kind == DeltaType::Deleted).then(|| DeletedObject::Deleted(object.clone()));
        Delta {
            kind,
            object,
            deleted,
        }
    }

    pub(crate) fn tombstone(object: Arc<Object<T>>) -> Self {
        Delta {
            kind: DeltaType::Deleted,
            deleted: Some(DeletedObject::FinalStateUnknown(object.clone())),
            object,
        }
    }

    /// Whether this is a tombstone: a delete found by a relist rather than seen in the watch
    /// ([`DeletedObject::FinalStateUnknown`] in [`deleted`](Self::deleted)).
    pub fn is_final_state_unknown(&self) -> bool {
        self.deleted
            .as_ref()
            .is_some_and(DeletedObject::is_final_state_unknown)
    }
}

/// The error of [`RealFifo::pop`](crate::RealFifo::pop) once the queue is closed and empty
/// ([`DeltaFifo::pop`](crate::DeltaFifo::pop) says
/// [`Popped::Closed`](crate::delta_fifo::Popped::Closed)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the DeltaFIFO is closed")]
pub struct Closed;

/// The object a delete reports.
#[derive(Debug)]
pub enum DeletedObject<T> {
    /// The watch saw the delete; this is the key's last state.
    Deleted(Arc<Object<T>>),
    /// A relist found the key gone (client-go's `DeletedFinalStateUnknown`): the object is the
    /// last state the cache knew, and changes between it and the delete were missed.
    FinalStateUnknown(Arc<Object<T>>),
}

impl<T> Clone for DeletedObject<T> {
    fn clone(&self) -> Self {
        match self {
            DeletedObject::Deleted(o) => DeletedObject::Deleted(o.clone()),
            DeletedObject::FinalStateUnknown(o) => DeletedObject::FinalStateUnknown(o.clone()),
        }
    }
}

impl<T> DeletedObject<T> {
    /// The last known state of the deleted object.
    pub fn object(&self) -> &Arc<Object<T>> {
        match self {
            DeletedObject::Deleted(o) | DeletedObject::FinalStateUnknown(o) => o,
        }
    }

    /// The deleted key.
    pub fn key(&self) -> &str {
        self.object().key()
    }

    /// Whether this is a tombstone from a relist rather than a delete seen in the watch.
    pub fn is_final_state_unknown(&self) -> bool {
        matches!(self, DeletedObject::FinalStateUnknown(_))
    }
}

/// What a [`Reflector`](crate::Reflector) fills: client-go's `Queue` as the reflector sees it. Implemented by
/// [`DeltaFifo`](crate::DeltaFifo) (one slot per key) and [`RealFifo`](crate::RealFifo) (every
/// change in order, one batch per revision).
pub trait Queue<T>: Send + Sync {
    /// Queues a watched change unless the queue already knows the key at the same or a newer
    /// revision (a duplicate). Returns whether it was queued.
    fn add_if_newer(&self, kind: DeltaType, obj: Arc<Object<T>>) -> bool;
    /// Queues a delete of `key` at `revision`, carrying the last state known (`last`, else the
    /// queue's or the cache's). Dropped, returning false, when the key is unknown or already
    /// newer.
    fn delete(&self, key: &str, revision: i64, last: Option<Arc<Object<T>>>) -> bool;
    /// Replaces the content with a list read at `revision`; keys it lacks become tombstones.
    /// With `store_replaced` (revisions started over) every cached key is retired first.
    fn replace(&self, list: Vec<Arc<Object<T>>>, revision: i64, store_replaced: bool);
    /// Starts a relist read page by page: the source puts the pages into the returned sink as
    /// they are decoded, and [`finish_replace`](Self::finish_replace) then queues them as
    /// [`replace`](Self::replace) would. Cached objects may stand in for listed ones of the
    /// same key and mod revision if the list is read at `reuse_from` or later (the same store);
    /// `None`: never (the store was replaced, revisions started over). Returning `None` (the
    /// default): the queue takes lists whole.
    fn begin_replace(&self, reuse_from: Option<i64>) -> Option<Arc<dyn ListSink<T>>> {
        let _ = reuse_from;
        None
    }
    /// Queues the relist begun with [`begin_replace`](Self::begin_replace), read at `revision`.
    fn finish_replace(&self, revision: i64, store_replaced: bool) {
        let _ = (revision, store_replaced);
    }
    /// Re-delivers the cache to handlers without contacting the source.
    fn resync(&self);
    /// Every change up to `revision` is queued: the revision is complete.
    fn commit(&self, revision: i64);
    /// Nothing changed up to `revision` beyond what is queued (a trusted bookmark).
    fn progress(&self, revision: i64);
    /// `None` while the queue can take another revision; else a future that resolves once it
    /// can. The reflector waits on it after each revision, so a consumer that falls behind
    /// slows the watch (and, through the watch's bounded buffer, etcd's stream) instead of
    /// growing the queue without bound.
    fn room(&self) -> Option<BoxFuture<'_, ()>>;
}

/// The shortest resync period honoured (client-go's `minimumResyncPeriod`).
pub const MIN_RESYNC_PERIOD: Duration = Duration::from_secs(1);

/// The longest resync period honoured: longer ones (up to `Duration::MAX`) mean "once a year",
/// instead of overflowing the clock.
pub const MAX_RESYNC_PERIOD: Duration = Duration::from_secs(365 * 24 * 3600);

/// `period` within [`MIN_RESYNC_PERIOD`] and [`MAX_RESYNC_PERIOD`]; zero (never) stays zero.
pub(crate) fn clamp_resync(period: Duration) -> Duration {
    if period.is_zero() {
        period
    } else {
        period.clamp(MIN_RESYNC_PERIOD, MAX_RESYNC_PERIOD)
    }
}

/// When the source received each committed revision (its first event), for an informer's
/// watch-to-cache latency: the reflector records, the consumer takes. Bounded: stamps nobody
/// takes (another processing mode, a relist in between) are dropped oldest first.
#[derive(Default)]
pub(crate) struct ReceivedAt(
    std::sync::Mutex<std::collections::VecDeque<(i64, std::time::Instant)>>,
);

impl ReceivedAt {
    /// Twice the RealFifo's default bound: the consumer is never that far behind.
    const MAX: usize = 8192;

    pub(crate) fn record(&self, revision: i64, at: std::time::Instant) {
        let mut stamps = crate::sync::lock(&self.0);
        if stamps.len() >= Self::MAX {
            stamps.pop_front();
        }
        stamps.push_back((revision, at));
    }

    /// Forgets every stamp: the store was replaced and its revisions start over.
    pub(crate) fn clear(&self) {
        crate::sync::lock(&self.0).clear();
    }

    /// The stamp of `revision`, dropping the older ones.
    pub(crate) fn take(&self, revision: i64) -> Option<std::time::Instant> {
        let mut stamps = crate::sync::lock(&self.0);
        while let Some(&(r, at)) = stamps.front() {
            if r > revision {
                return None;
            }
            stamps.pop_front();
            if r == revision {
                return Some(at);
            }
        }
        None
    }
}
