//! The DeltaFIFO: a queue of keys, each with the list of changes (deltas) not yet processed.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::object::Object;
use crate::queue::Queue;
use crate::store::Store;
use crate::sync::lock;

pub use crate::queue::{Closed, Delta, DeltaType};

/// Capacity (in keys) above which a drained queue releases its memory.
const SHRINK_ABOVE: usize = 1024;

/// What one [`DeltaFifo::pop`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Popped {
    /// The key's deltas were processed; they are gone from the queue.
    Processed(Arc<str>),
    /// The process function failed on the key's deltas: they were dropped, or put back on
    /// [`PopError::Requeue`].
    Failed {
        /// The key whose deltas failed.
        key: Arc<str>,
        /// What the process function returned.
        error: PopError,
    },
    /// The queue is closed and empty: nothing will be popped any more.
    Closed,
}

impl Popped {
    /// The key popped, unless the queue is closed.
    pub fn key(&self) -> Option<&Arc<str>> {
        match self {
            Popped::Processed(key) | Popped::Failed { key, .. } => Some(key),
            Popped::Closed => None,
        }
    }

    /// Whether the queue was closed and empty.
    pub fn is_closed(&self) -> bool {
        matches!(self, Popped::Closed)
    }

    /// Whether the key's deltas were processed without error.
    pub fn is_processed(&self) -> bool {
        matches!(self, Popped::Processed(_))
    }
}

/// What the function given to [`DeltaFifo::pop`] returns when it could not process the deltas.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PopError {
    /// Drop the deltas.
    #[error("processing failed; deltas dropped: {0}")]
    Drop(String),
    /// Put the deltas back, unless newer ones for the key arrived meanwhile (client-go's
    /// `ErrRequeue` with `AddIfNotPresent`), and do not hand the key out again before `after`.
    #[error("processing failed; retrying in {after:?}: {reason}")]
    Requeue {
        /// Why processing failed.
        reason: String,
        /// The earliest time to retry, from now.
        after: Duration,
    },
}

/// A producer/consumer queue of deltas, one slot per key (client-go's `DeltaFIFO`).
///
/// Invariants: a key is in the queue order if and only if it has a non-empty delta list; a
/// key's deltas are in the order they happened; two deletes never end a list (the one carrying the
/// real final state is kept); `pop` hands out each key's whole list at once, and never the same
/// key to two callers.
///
/// The FIFO knows the cache ("known objects", usually the informer's [`Indexer`](crate::store::Indexer))
/// so that deletes carry the last state of the key, relists detect vanished keys, and resyncs
/// re-deliver cached objects.
///
/// ```
/// use std::sync::Arc;
/// use etcd_informer::delta_fifo::Popped;
/// use etcd_informer::{DeltaFifo, DeltaType, Object};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let fifo = DeltaFifo::new(None);
/// fifo.add(Arc::new(Object::new("a", 2, "one")));
/// fifo.update(Arc::new(Object::new("a", 3, "two")));
/// // One slot per key: both deltas of "a" come out together, oldest first.
/// let mut kinds = vec![];
/// let popped = fifo
///     .pop(|deltas, _initial| {
///         kinds.extend(deltas.iter().map(|d| d.kind));
///         Ok(())
///     })
///     .await;
/// assert_eq!(popped, Popped::Processed("a".into()));
/// assert_eq!(kinds, [DeltaType::Added, DeltaType::Updated]);
/// fifo.close();
/// assert_eq!(fifo.pop(|_, _| Ok(())).await, Popped::Closed);
/// # }
/// ```
pub struct DeltaFifo<T> {
    inner: Mutex<Inner<T>>,
    notify: Notify,
    known: Option<Arc<dyn Store<T>>>,
    /// The revision the consumer has applied everything up to (see `applied_revision`).
    applied: AtomicI64,
    /// Woken whenever `applied` or `has_synced` may have moved (see `notify_applied`).
    applied_moved: OnceLock<Arc<Notify>>,
    /// Relists drained from the queue (see `replaces_applied`).
    replaces_applied: AtomicU64,
    /// `Inner::replaces_queued`, readable without the queue's lock (see `relist_pending`).
    replaces_queued: AtomicU64,
}

struct Inner<T> {
    /// The revision everything queued so far was read up to.
    revision: i64,
    items: HashMap<Arc<str>, Vec<Delta<T>>>,
    queue: VecDeque<Arc<str>>,
    /// Keys requeued after a failure, and when they may be handed out again.
    not_before: HashMap<Arc<str>, Instant>,
    populated: bool,
    initial_population_count: usize,
    closed: bool,
    /// Relists queued so far: each is applied once the queue has drained after it.
    replaces_queued: u64,
}

impl<T> fmt::Debug for DeltaFifo<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = self.lock();
        f.debug_struct("DeltaFifo")
            .field("queued", &inner.queue.len())
            .field("populated", &inner.populated)
            .field("initial_population_count", &inner.initial_population_count)
            .field("closed", &inner.closed)
            .finish()
    }
}

impl<T: Send + Sync + 'static> DeltaFifo<T> {
    /// A FIFO that looks up the last state of keys in `known` (pass the informer's indexer).
    pub fn new(known: Option<Arc<dyn Store<T>>>) -> Self {
        DeltaFifo {
            inner: Mutex::new(Inner {
                revision: 0,
                items: HashMap::new(),
                queue: VecDeque::new(),
                not_before: HashMap::new(),
                populated: false,
                initial_population_count: 0,
                closed: false,
                replaces_queued: 0,
            }),
            notify: Notify::new(),
            known,
            applied: AtomicI64::new(0),
            applied_moved: OnceLock::new(),
            replaces_applied: AtomicU64::new(0),
            replaces_queued: AtomicU64::new(0),
        }
    }

    /// Has `notify` woken (`notify_waiters`) each time the applied revision or the synced state
    /// may have moved: after a pop that emptied the queue or ended the first list, after each
    /// revision reached with nothing queued, and after each list. An informer's consistent
    /// reads wait on it instead of polling. Set once; later calls are ignored.
    pub(crate) fn notify_applied(&self, notify: Arc<Notify>) {
        let _ = self.applied_moved.set(notify);
    }
}

impl<T> DeltaFifo<T> {
    /// Wakes the informer's waits (see [`DeltaFifo::notify_applied`]).
    fn wake_applied_waiters(&self) {
        if let Some(notify) = self.applied_moved.get() {
            notify.notify_waiters();
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner<T>> {
        lock(&self.inner)
    }

    /// The newest state of `key` the FIFO knows of: its newest queued delta, else the cache.
    /// `None` when the key is absent (never seen, or deleted last).
    fn newest(&self, inner: &Inner<T>, key: &str) -> Option<Arc<Object<T>>> {
        match inner.items.get(key).and_then(|d| d.last()) {
            Some(d) if d.kind == DeltaType::Deleted => None,
            Some(d) => Some(d.object.clone()),
            None => self.known.as_ref().and_then(|k| k.get_by_key(key)),
        }
    }

    /// Queues an `Added` delta.
    pub fn add(&self, obj: Arc<Object<T>>) {
        let mut inner = self.lock();
        inner.populated = true;
        self.queue_action(&mut inner, Delta::new(DeltaType::Added, obj));
        drop(inner);
        self.notify.notify_waiters();
    }

    /// Queues an `Updated` delta.
    pub fn update(&self, obj: Arc<Object<T>>) {
        let mut inner = self.lock();
        inner.populated = true;
        self.queue_action(&mut inner, Delta::new(DeltaType::Updated, obj));
        drop(inner);
        self.notify.notify_waiters();
    }

    /// Queues a watch event's object as `kind` unless the FIFO already knows the key at the same
    /// or a newer revision, which makes it a duplicate (etcd has shipped bugs that repeated
    /// events after a reconnect). Returns whether it was queued.
    pub fn add_if_newer(&self, kind: DeltaType, obj: Arc<Object<T>>) -> bool {
        let mut inner = self.lock();
        if let Some(current) = self.newest(&inner, obj.key()) {
            if current.mod_revision >= obj.mod_revision {
                return false;
            }
        }
        inner.populated = true;
        self.queue_action(&mut inner, Delta::new(kind, obj));
        drop(inner);
        self.notify.notify_waiters();
        true
    }

    /// Queues a `Deleted` delta for `key`, carrying the last state known of it (`last` when the
    /// source supplied it, else the newest queued delta, else the cache).
    ///
    /// A delete for a key that is neither queued nor cached is dropped, and so is one whose
    /// revision is not newer than the state known. Returns whether it was queued.
    pub fn delete(&self, key: &str, revision: i64, last: Option<Arc<Object<T>>>) -> bool {
        let mut inner = self.lock();
        let Some(newest) = self.newest(&inner, key) else {
            return false;
        };
        if revision != 0 && newest.mod_revision >= revision {
            return false;
        }
        inner.populated = true;
        let object = last
            .filter(|l| l.mod_revision >= newest.mod_revision)
            .unwrap_or(newest);
        self.queue_action(&mut inner, Delta::new(DeltaType::Deleted, object));
        drop(inner);
        self.notify.notify_waiters();
        true
    }

    /// Replaces the whole content with a fresh list: every object is queued as `Replaced`, and
    /// every key the cache or the queue holds that the list lacks gets a `Deleted` tombstone
    /// ([`Delta::is_final_state_unknown`]) with its last known state.
    pub fn replace(&self, list: Vec<Arc<Object<T>>>) {
        let mut inner = self.lock();
        self.replace_locked(&mut inner, list);
        self.replace_queued(&mut inner);
        drop(inner);
        self.notify.notify_waiters();
        // An empty list is synced at once.
        self.wake_applied_waiters();
    }

    fn replace_locked(&self, inner: &mut Inner<T>, list: Vec<Arc<Object<T>>>) {
        let list_len = list.len();
        let known_keys = self
            .known
            .as_ref()
            .map(|k| k.list_keys())
            .unwrap_or_default();
        // Only keys queued or cached before this list can have vanished; on the first list
        // there are none, and the set of listed keys is not worth building.
        let queued_before: Vec<Arc<str>> = inner.items.keys().cloned().collect();
        let listed: HashSet<Arc<str>> = if queued_before.is_empty() && known_keys.is_empty() {
            HashSet::new()
        } else {
            list.iter().map(|o| o.shared_key().clone()).collect()
        };
        inner.items.reserve(list_len);
        inner.queue.reserve(list_len);
        for obj in list {
            self.queue_action(inner, Delta::new(DeltaType::Replaced, obj));
        }
        let mut vanished: Vec<Arc<str>> = queued_before
            .into_iter()
            .filter(|k| !listed.contains(k))
            .collect();
        vanished.extend(
            known_keys
                .into_iter()
                .filter(|k| !listed.contains(k) && !inner.items.contains_key(k)),
        );
        let mut tombstones = 0;
        for key in vanished {
            // A key whose newest delta is a delete is already gone for the consumer.
            if let Some(last) = self.newest(inner, &key) {
                self.queue_action(inner, Delta::tombstone(last));
                tombstones += 1;
            }
        }
        if !inner.populated {
            inner.populated = true;
            // Keys, not list entries: a list naming a key twice queues it once.
            inner.initial_population_count = inner.queue.len();
        }
        tracing::debug!(items = list_len, tombstones, "DeltaFIFO replaced");
    }

    /// Queues a `Sync` delta for every cached key that has nothing queued, so a resync never
    /// overwrites a newer pending change with the cached copy.
    pub fn resync(&self) {
        let Some(known) = &self.known else { return };
        let mut inner = self.lock();
        for key in known.list_keys() {
            if inner.items.contains_key(&key) {
                continue;
            }
            if let Some(obj) = known.get_by_key(&key) {
                self.queue_action(&mut inner, Delta::new(DeltaType::Sync, obj));
            }
        }
        drop(inner);
        self.notify.notify_waiters();
    }

    /// Puts `deltas` back for `key` unless the key has deltas queued already (newer ones win).
    pub fn add_if_not_present(&self, key: Arc<str>, deltas: Vec<Delta<T>>) {
        let mut inner = self.lock();
        Self::add_if_not_present_locked(&mut inner, key, deltas);
        drop(inner);
        self.notify.notify_waiters();
    }

    fn add_if_not_present_locked(inner: &mut Inner<T>, key: Arc<str>, deltas: Vec<Delta<T>>) {
        if deltas.is_empty() || inner.items.contains_key(&key) {
            return;
        }
        inner.populated = true;
        inner.queue.push_back(key.clone());
        inner.items.insert(key, deltas);
    }

    /// Appends a delta to its key's slot. Callers wake `pop` once they release the lock.
    fn queue_action(&self, inner: &mut Inner<T>, delta: Delta<T>) {
        let key = delta.object.shared_key().clone();
        let deltas = inner.items.entry(key.clone()).or_default();
        if deltas.is_empty() {
            inner.queue.push_back(key);
        }
        deltas.push(delta);
        dedup_deletes(deltas);
    }

    /// Waits for a key, removes it with its deltas and calls `process(deltas, is_in_initial_list)`
    /// while holding the queue, so nothing for that key is queued until processing is done.
    ///
    /// On [`PopError::Requeue`] the deltas go back (unless newer ones arrived) and the key is not
    /// handed out again before the delay; other keys keep flowing meanwhile. Returns the key
    /// processed ([`Popped::Processed`]) or the process function's error ([`Popped::Failed`]),
    /// or [`Popped::Closed`] once closed and empty.
    pub async fn pop<F>(&self, process: F) -> Popped
    where
        F: FnOnce(&[Delta<T>], bool) -> Result<(), PopError>,
    {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let wait_until;
            {
                let mut inner = self.lock();
                let now = Instant::now();
                let ready = if inner.not_before.is_empty() {
                    (!inner.queue.is_empty()).then_some(0)
                } else {
                    inner
                        .queue
                        .iter()
                        .position(|k| inner.not_before.get(k).is_none_or(|t| *t <= now))
                };
                if let Some(pos) = ready {
                    let Some(key) = inner.queue.remove(pos) else {
                        continue;
                    };
                    let deltas = inner.items.remove(&key).unwrap_or_default();
                    inner.not_before.remove(&key);
                    let is_in_initial_list = inner.initial_population_count > 0;
                    if is_in_initial_list {
                        inner.initial_population_count -= 1;
                    }
                    let result = process(&deltas, is_in_initial_list);
                    if let Err(PopError::Requeue { after, .. }) = &result {
                        inner.not_before.insert(key.clone(), now + *after);
                        Self::add_if_not_present_locked(&mut inner, key.clone(), deltas);
                    } else if inner.queue.is_empty() && inner.items.capacity() > SHRINK_ABOVE {
                        // A relist of a big prefix grows the maps; give that memory back once
                        // it is drained instead of keeping it for the informer's lifetime.
                        inner.items.shrink_to_fit();
                        inner.queue.shrink_to_fit();
                    }
                    // Only these move what an informer's waits look at; a key requeued is not
                    // applied.
                    let applied_moved = inner.queue.is_empty();
                    if applied_moved {
                        self.drained(&inner);
                    }
                    let moved = applied_moved
                        || (is_in_initial_list && inner.initial_population_count == 0);
                    drop(inner);
                    if moved {
                        self.wake_applied_waiters();
                    }
                    return match result {
                        Ok(()) => Popped::Processed(key),
                        Err(error) => Popped::Failed { key, error },
                    };
                }
                if inner.closed && inner.queue.is_empty() {
                    return Popped::Closed;
                }
                wait_until = inner.not_before.values().min().copied();
            }
            match wait_until {
                Some(t) => {
                    tokio::select! {
                        _ = &mut notified => {}
                        _ = tokio::time::sleep_until(t) => {}
                    }
                }
                None => notified.await,
            }
        }
    }

    /// Closes the queue: `pop` returns [`Closed`] once what is queued is drained.
    pub fn close(&self) {
        self.lock().closed = true;
        self.notify.notify_waiters();
    }

    /// Whether [`close`](Self::close) was called.
    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// The revision up to which every queued change has been popped and processed (0 before
    /// the first list). The cache holds every change up to it, and none later only while the
    /// queue is empty: it is a lower bound of the cache's freshness, not an exact revision.
    pub fn applied_revision(&self) -> i64 {
        self.applied.load(Ordering::Acquire)
    }

    /// Records that every change up to `revision` is queued.
    fn reached(&self, revision: i64) {
        let mut inner = self.lock();
        inner.revision = inner.revision.max(revision);
        if inner.queue.is_empty() {
            self.drained(&inner);
            drop(inner);
            self.wake_applied_waiters();
        }
    }

    /// Counts a relist queued; one that queued nothing (an empty list, nothing cached) is
    /// applied at once.
    fn replace_queued(&self, inner: &mut Inner<T>) {
        inner.replaces_queued += 1;
        self.replaces_queued
            .store(inner.replaces_queued, Ordering::Release);
        if inner.queue.is_empty() {
            self.drained(inner);
        }
    }

    /// Whether a relist is queued that the consumer has not applied whole yet: until it has,
    /// what was proven of the cache before (the old store's, after a wipe) says nothing.
    pub(crate) fn relist_pending(&self) -> bool {
        // Applied first: a relist queued after it only makes the answer more cautious.
        let applied = self.replaces_applied.load(Ordering::Acquire);
        applied < self.replaces_queued.load(Ordering::Acquire)
    }

    /// Records that the consumer has applied everything queued: every change read up to the
    /// queue's revision, and every relist.
    fn drained(&self, inner: &Inner<T>) {
        self.applied.fetch_max(inner.revision, Ordering::AcqRel);
        self.replaces_applied
            .store(inner.replaces_queued, Ordering::Release);
    }

    /// How many relists ([`replace`](Self::replace) or the reflector's) the consumer has
    /// applied: each counts once the queue has drained after it, when the cache holds it
    /// whole. The reflector counts a relist once it is read, a moment before this.
    pub fn replaces_applied(&self) -> u64 {
        self.replaces_applied.load(Ordering::Acquire)
    }

    /// Whether the first list (or first add) has been fully popped and processed.
    pub fn has_synced(&self) -> bool {
        let inner = self.lock();
        inner.populated && inner.initial_population_count == 0
    }

    /// The keys with queued deltas, oldest first.
    pub fn list_keys(&self) -> Vec<Arc<str>> {
        self.lock().queue.iter().cloned().collect()
    }

    /// The deltas queued for `key`.
    pub fn get(&self, key: &str) -> Option<Vec<Delta<T>>> {
        self.lock().items.get(key).cloned()
    }

    /// How many keys have queued deltas.
    pub fn len(&self) -> usize {
        self.lock().queue.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T: Send + Sync + 'static> Queue<T> for DeltaFifo<T> {
    /// Always room: the DeltaFIFO holds one slot per key, so it is bounded by the prefix's size.
    fn room(&self) -> Option<crate::listwatch::BoxFuture<'_, ()>> {
        None
    }

    fn add_if_newer(&self, kind: DeltaType, obj: Arc<Object<T>>) -> bool {
        DeltaFifo::add_if_newer(self, kind, obj)
    }

    fn delete(&self, key: &str, revision: i64, last: Option<Arc<Object<T>>>) -> bool {
        DeltaFifo::delete(self, key, revision, last)
    }

    fn replace(&self, list: Vec<Arc<Object<T>>>, revision: i64, store_replaced: bool) {
        let mut inner = self.lock();
        if store_replaced {
            // Every key the cache or the queue holds first gets a tombstone, so that handlers
            // hear of every listed object anew even where its revision equals the cached one
            // (revisions started over); under one lock, so no reader sees it half retired.
            self.replace_locked(&mut inner, Vec::new());
            // Revisions started over: the applied revision does too, once this is drained.
            self.applied.store(0, Ordering::Release);
            inner.revision = revision;
        } else {
            inner.revision = inner.revision.max(revision);
        }
        self.replace_locked(&mut inner, list);
        self.replace_queued(&mut inner);
        drop(inner);
        self.notify.notify_waiters();
        // An empty list is synced at once.
        self.wake_applied_waiters();
    }

    fn resync(&self) {
        DeltaFifo::resync(self)
    }

    fn commit(&self, revision: i64) {
        self.reached(revision)
    }

    fn progress(&self, revision: i64) {
        self.reached(revision)
    }
}

/// Collapses two trailing deletes into one, keeping the one with the real final state.
fn dedup_deletes<T>(deltas: &mut Vec<Delta<T>>) {
    let n = deltas.len();
    if n < 2 || deltas[n - 1].kind != DeltaType::Deleted || deltas[n - 2].kind != DeltaType::Deleted
    {
        return;
    }
    let last = deltas.pop();
    if let (Some(last), Some(prev)) = (last, deltas.last_mut()) {
        if prev.is_final_state_unknown() && !last.is_final_state_unknown() {
            *prev = last;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Indexer;

    fn obj(key: &str, rev: i64) -> Arc<Object<i64>> {
        Arc::new(Object::new(key, rev, rev))
    }

    fn fifo_with(cached: &[(&str, i64)]) -> (DeltaFifo<i64>, Indexer<i64>) {
        let ix = Indexer::default();
        for (k, r) in cached {
            ix.add(obj(k, *r));
        }
        (DeltaFifo::new(Some(Arc::new(ix.clone()))), ix)
    }

    async fn pop_all(f: &DeltaFifo<i64>) -> Vec<(String, Vec<(DeltaType, i64, bool)>)> {
        let mut out = vec![];
        while !f.is_empty() {
            let mut got = vec![];
            let popped = f
                .pop(|d, _| {
                    got = d
                        .iter()
                        .map(|d| (d.kind, d.object.mod_revision, d.is_final_state_unknown()))
                        .collect();
                    Ok(())
                })
                .await;
            let key = popped.key().expect("queue open");
            out.push((key.to_string(), got));
        }
        out
    }

    #[tokio::test]
    async fn coalesces_per_key_in_order() {
        let (f, _) = fifo_with(&[]);
        f.add(obj("a", 1));
        f.add(obj("b", 2));
        f.update(obj("a", 3));
        assert_eq!(f.list_keys().len(), 2, "one slot per key");
        let all = pop_all(&f).await;
        assert_eq!(all[0].0, "a");
        assert_eq!(
            all[0].1,
            [(DeltaType::Added, 1, false), (DeltaType::Updated, 3, false)]
        );
        assert_eq!(all[1].0, "b");
    }

    #[tokio::test]
    async fn two_deletes_collapse_keeping_the_real_final_state() {
        let (f, _) = fifo_with(&[("a", 1)]);
        f.replace(vec![]); // tombstone for a
        assert!(
            !f.delete("a", 5, Some(obj("a", 4))),
            "already deleted: nothing newer"
        );
        let deltas = f.get("a").unwrap();
        assert_eq!(deltas.len(), 1);
        assert!(deltas[0].is_final_state_unknown());

        // A real delete followed by a tombstone keeps the real one.
        let mut v = vec![
            Delta::new(DeltaType::Deleted, obj("b", 2)),
            Delta::tombstone(obj("b", 1)),
        ];
        dedup_deletes(&mut v);
        assert_eq!(v.len(), 1);
        assert!(!v[0].is_final_state_unknown());
        // A tombstone followed by a real delete keeps the real one too.
        let mut v = vec![
            Delta::tombstone(obj("b", 1)),
            Delta::new(DeltaType::Deleted, obj("b", 2)),
        ];
        dedup_deletes(&mut v);
        assert_eq!(
            (
                v.len(),
                v[0].is_final_state_unknown(),
                v[0].object.mod_revision
            ),
            (1, false, 2)
        );
    }

    /// The informer's consistent reads wait on `notify_applied`'s notify instead of polling:
    /// each move of the applied revision or of the synced state must wake them.
    #[tokio::test]
    async fn every_move_of_what_is_applied_wakes_the_applied_notify() {
        let (f, _) = fifo_with(&[]);
        let moved = Arc::new(Notify::new());
        f.notify_applied(moved.clone());
        let woken = |what: &str, act: &dyn Fn()| {
            let notified = moved.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            act();
            assert!(
                futures_ready(notified.as_mut()),
                "{what} did not wake the applied notify"
            );
        };
        woken("an empty first list", &|| {
            Queue::replace(&f, Vec::new(), 5, false)
        });
        assert!(f.has_synced());
        woken("a revision reached with nothing queued", &|| {
            Queue::commit(&f, 6)
        });
        assert_eq!(f.applied_revision(), 6);
        f.add(obj("a", 7));
        Queue::commit(&f, 7);
        let notified = moved.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let popped = f.pop(|_, _| Ok(())).await;
        assert!(matches!(popped, Popped::Processed(_)));
        assert!(futures_ready(notified.as_mut()), "a pop did not wake it");
        assert_eq!(f.applied_revision(), 7);
    }

    /// Whether `future` is ready, polled once.
    fn futures_ready(future: std::pin::Pin<&mut impl std::future::Future>) -> bool {
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        future.poll(&mut cx).is_ready()
    }

    /// The informer's consistent reads wait for a relist to be applied whole (issue 50):
    /// counted once the queue drains after it, at once when it queued nothing, never while a
    /// key of it is requeued.
    #[tokio::test(start_paused = true)]
    async fn a_relist_counts_as_applied_once_drained_and_not_while_requeued() {
        let (f, _) = fifo_with(&[]);
        Queue::replace(&f, vec![], 3, false);
        assert_eq!(
            f.replaces_applied(),
            1,
            "an empty relist is applied at once"
        );
        assert_eq!(f.applied_revision(), 3);
        assert!(!f.relist_pending());
        Queue::replace(&f, vec![obj("a", 4), obj("b", 4)], 4, true);
        assert!(f.relist_pending());
        let requeued = f
            .pop(|_, _| {
                Err(PopError::Requeue {
                    reason: "boom".into(),
                    after: Duration::from_secs(1),
                })
            })
            .await;
        assert!(matches!(requeued, Popped::Failed { .. }));
        assert!(matches!(f.pop(|_, _| Ok(())).await, Popped::Processed(_)));
        assert_eq!(f.replaces_applied(), 1, "a key of the relist is requeued");
        assert!(matches!(f.pop(|_, _| Ok(())).await, Popped::Processed(_)));
        assert_eq!(f.replaces_applied(), 2);
        assert_eq!(f.applied_revision(), 4);
        assert!(!f.relist_pending());
    }

    #[tokio::test]
    async fn delete_of_unknown_key_is_dropped() {
        let (f, _) = fifo_with(&[("a", 1)]);
        assert!(!f.delete("zzz", 9, None));
        assert!(f.is_empty());
        assert!(f.delete("a", 2, None), "cached key is deleted");
        let d = f.get("a").unwrap();
        assert_eq!(
            (d[0].kind, d[0].object.mod_revision),
            (DeltaType::Deleted, 1),
            "carries last cached value"
        );
    }

    #[tokio::test]
    async fn delete_carries_newest_queued_state() {
        let (f, _) = fifo_with(&[("a", 1)]);
        f.update(obj("a", 2));
        assert!(f.delete("a", 3, None));
        let d = f.get("a").unwrap();
        assert_eq!(d[1].object.mod_revision, 2);
    }

    #[tokio::test]
    async fn duplicates_by_revision_are_dropped() {
        let (f, _) = fifo_with(&[("a", 5)]);
        assert!(!f.add_if_newer(DeltaType::Updated, obj("a", 5)));
        assert!(!f.add_if_newer(DeltaType::Updated, obj("a", 4)));
        assert!(f.add_if_newer(DeltaType::Updated, obj("a", 6)));
        assert!(
            !f.add_if_newer(DeltaType::Updated, obj("a", 6)),
            "queued state counts too"
        );
        assert!(!f.delete("a", 6, None), "delete not newer than state");
        assert!(f.delete("a", 7, None));
        assert!(
            f.add_if_newer(DeltaType::Added, obj("a", 3)),
            "a deleted key accepts any revision (store wiped)"
        );
    }

    #[tokio::test]
    async fn replace_emits_tombstones_for_cached_and_queued_keys() {
        let (f, _) = fifo_with(&[("cached-gone", 1), ("kept", 2)]);
        f.add(obj("queued-gone", 3));
        f.replace(vec![obj("kept", 4), obj("new", 5)]);
        let all = pop_all(&f).await;
        let by_key: HashMap<_, _> = all.into_iter().collect();
        assert_eq!(by_key["cached-gone"], [(DeltaType::Deleted, 1, true)]);
        assert_eq!(
            by_key["queued-gone"],
            [(DeltaType::Added, 3, false), (DeltaType::Deleted, 3, true)]
        );
        assert_eq!(by_key["kept"], [(DeltaType::Replaced, 4, false)]);
        assert_eq!(by_key["new"], [(DeltaType::Replaced, 5, false)]);
    }

    #[tokio::test]
    async fn resync_skips_keys_with_queued_deltas() {
        let (f, _) = fifo_with(&[("a", 1), ("b", 2)]);
        f.update(obj("a", 3));
        f.resync();
        let all: HashMap<_, _> = pop_all(&f).await.into_iter().collect();
        assert_eq!(
            all["a"],
            [(DeltaType::Updated, 3, false)],
            "stale cached copy not queued"
        );
        assert_eq!(all["b"], [(DeltaType::Sync, 2, false)]);
    }

    #[tokio::test]
    async fn has_synced_counts_initial_items_and_tombstones() {
        let (f, _) = fifo_with(&[("old", 1)]);
        assert!(!f.has_synced());
        f.replace(vec![obj("a", 2), obj("b", 3)]);
        let mut initial = vec![];
        for _ in 0..2 {
            let popped = f
                .pop(|_, init| {
                    initial.push(init);
                    Ok(())
                })
                .await;
            assert!(popped.is_processed());
            assert!(!f.has_synced(), "tombstone still pending");
        }
        let popped = f
            .pop(|_, init| {
                initial.push(init);
                Ok(())
            })
            .await;
        assert!(popped.is_processed());
        assert!(f.has_synced());
        assert_eq!(initial, [true, true, true]);
        f.add(obj("c", 4));
        let popped = f
            .pop(|_, init| {
                assert!(!init);
                Ok(())
            })
            .await;
        assert!(popped.is_processed());
    }

    #[tokio::test(start_paused = true)]
    async fn requeue_backs_off_and_yields_to_newer_deltas() {
        let (f, _) = fifo_with(&[]);
        f.add(obj("a", 1));
        f.add(obj("b", 2));
        let popped = f
            .pop(|_, _| {
                Err(PopError::Requeue {
                    reason: "boom".into(),
                    after: Duration::from_secs(5),
                })
            })
            .await;
        assert!(matches!(popped, Popped::Failed { ref key, .. } if &**key == "a"));
        // b is handed out while a waits.
        let start = Instant::now();
        assert_eq!(f.pop(|_, _| Ok(())).await, Popped::Processed("b".into()));
        // Newer deltas for a join its slot; a comes back only after the delay.
        f.update(obj("a", 7));
        let mut seen = vec![];
        let popped = f
            .pop(|d, _| {
                seen = d.iter().map(|d| d.object.mod_revision).collect();
                Ok(())
            })
            .await;
        assert_eq!(popped, Popped::Processed("a".into()));
        assert_eq!(seen, [1, 7]);
        assert!(start.elapsed() >= Duration::from_secs(5));
    }

    #[tokio::test]
    async fn add_if_not_present_keeps_newer() {
        let (f, _) = fifo_with(&[]);
        f.update(obj("a", 5));
        f.add_if_not_present("a".into(), vec![Delta::new(DeltaType::Added, obj("a", 1))]);
        assert_eq!(f.get("a").unwrap().len(), 1);
        assert_eq!(f.get("a").unwrap()[0].object.mod_revision, 5);
    }

    #[tokio::test]
    async fn close_drains_then_fails() {
        let (f, _) = fifo_with(&[]);
        f.add(obj("a", 1));
        f.close();
        assert!(f.pop(|_, _| Ok(())).await.is_processed());
        assert_eq!(f.pop(|_, _| Ok(())).await, Popped::Closed);
    }
}
