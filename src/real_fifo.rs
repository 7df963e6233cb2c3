//! The RealFIFO: every change in the order etcd made it, handed out one revision at a time.
//!
//! client-go made in-order processing its default (`RealFIFO`, 1.33) and added batch pops
//! (1.35) and an atomic "replaced all" (1.36). Over etcd the natural batch is the revision:
//! one transaction's changes share a revision and arrive in one watch response, so a consumer
//! that applies a whole [`Batch`] under one store lock never shows a reader half a transaction.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use tokio::sync::Notify;

use crate::listwatch::ListSink;
use crate::object::EncodedObject;
use crate::object::Object;
use crate::object::Stamp;
use crate::queue::{Closed, Delta, DeltaType, Queue};
use crate::store::{Store, StoreContent};
use crate::sync::lock;

/// A relist read page by page into the next store content.
struct Building<T> {
    content: Mutex<StoreContent<T>>,
    /// The cache, whose objects are kept for unchanged listed ones while `reuse` holds.
    known: Arc<dyn Store<T>>,
    reuse_from: Option<i64>,
    reuse: AtomicBool,
}

/// A content for a list to build: its repacks wait until the list is whole (see
/// `StoreContent::defer_repacks`), since keys it adopts from the cache share chunks that look
/// mostly dead until then.
fn list_content<T: Send + Sync + 'static>(known: &dyn Store<T>) -> StoreContent<T> {
    let mut content = known.new_content();
    content.defer_repacks(true);
    content
}

impl<T: Send + Sync + 'static> ListSink<T> for Building<T> {
    fn begin(&self, revision: i64, keys: usize) {
        // A list read below a revision already seen comes from a store that went back in
        // time: equal mod revisions no longer mean equal objects.
        let reuse = self.reuse_from.is_some_and(|from| revision >= from);
        self.reuse.store(reuse, Ordering::Relaxed);
        // Growing a map of a million keys rehashes every key several times over. (A store
        // kept by namespace is not sized: the list has not said which namespaces.)
        lock(&self.content).reserve(keys);
    }

    fn held(&self) -> usize {
        if self.reuse.load(Ordering::Relaxed) {
            self.known.len()
        } else {
            0
        }
    }

    fn unchanged(&self, key: &str, stamp: &Stamp) -> bool {
        self.reuse.load(Ordering::Relaxed)
            && self
                .known
                .keep_unchanged(&mut lock(&self.content), key, stamp)
    }

    fn page(&self, objects: Vec<Arc<Object<T>>>) {
        let mut content = lock(&self.content);
        content.add_page(&objects);
    }

    fn takes_encoded(
        &self,
        codec: &str,
        indexes: &[String],
        keys: usize,
        sample: &[EncodedObject<'_>],
    ) -> bool {
        lock(&self.content).takes_encoded(codec, indexes, keys, sample)
    }

    fn page_encoded(&self, objects: &[EncodedObject<'_>]) {
        lock(&self.content).add_encoded(objects);
    }

    fn discard(&self) {
        *lock(&self.content) = list_content(&*self.known);
    }
}

/// The changes of one revision ([`Batch::Changes`]): most revisions change one key, which is
/// held without a list of its own.
pub type Changes<T> = smallvec::SmallVec<[Delta<T>; 1]>;

/// What [`RealFifo::pop`] hands out.
pub enum Batch<T> {
    /// Every change of one revision (one etcd transaction), in the order etcd reported them.
    Changes {
        /// The revision.
        revision: i64,
        /// The changes; a `Deleted` delta carries the last state known of its key.
        deltas: Changes<T>,
    },
    /// A relist: the source's whole content at `revision`. The consumer diffs it against the
    /// cache: keys the cache holds and the list lacks are tombstones.
    Replace {
        /// The list's revision.
        revision: i64,
        /// The listed objects by key, with their indexes when they were built as the list came.
        items: Arc<StoreContent<T>>,
        /// The store was wiped or restored: revisions started over, so every cached object is
        /// retired, even one listed at the revision the cache holds.
        store_replaced: bool,
        /// This is the first list: its objects are the informer's initial list.
        initial: bool,
    },
    /// Re-deliver the cache as it is when popped (a resync); changes nothing.
    Resync,
    /// Nothing changed up to this revision (a trusted progress notification).
    Progress(i64),
}

impl<T> fmt::Debug for Batch<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Batch::Changes { revision, deltas } => f
                .debug_struct("Changes")
                .field("revision", revision)
                .field("deltas", &deltas.len())
                .finish(),
            Batch::Replace {
                revision,
                items,
                store_replaced,
                initial,
            } => f
                .debug_struct("Replace")
                .field("revision", revision)
                .field("items", &items.len())
                .field("store_replaced", store_replaced)
                .field("initial", initial)
                .finish(),
            Batch::Resync => f.write_str("Resync"),
            Batch::Progress(r) => f.debug_tuple("Progress").field(r).finish(),
        }
    }
}

/// An in-order queue of revisions (client-go's `RealFIFO` with batch pop), filled by a
/// [`Reflector`](crate::Reflector).
///
/// Invariants: batches are handed out in the order their changes happened, each revision's
/// changes in one [`Batch::Changes`], never split; a revision is handed out only once the
/// reflector has committed it (all its changes are queued). `pending` holds, for every key
/// changed since the last queued relist whose change is not yet handed out, the newest queued
/// state; with the queued relist and the cache (popped batches are applied before `pop`
/// returns) it gives the newest state the queue knows of any key, which decides duplicates and
/// the last value of deletes.
///
/// An informer makes one for you ([`Processing::Atomic`](crate::Processing::Atomic)); a
/// pipeline of your own pops it by hand, applying each batch to the store it was given:
///
/// ```no_run
/// use std::sync::Arc;
/// use etcd_informer::{Batch, DeltaType, EtcdListerWatcher, Indexer, RealFifo, Reflector, ReflectorOptions, TextCodec};
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let client = etcd_informer::connect(["127.0.0.1:2379"]).await?;
/// let lw = EtcdListerWatcher::new(client, "/registry/configmaps/", TextCodec)?;
/// let store = Indexer::<String>::with_namespace_index();
/// let fifo = Arc::new(RealFifo::new(Arc::new(store.clone())));
/// tokio::spawn(Reflector::new(lw, fifo.clone(), ReflectorOptions::default()).run());
/// while let Ok(()) = fifo
///     .pop(|batch| match batch {
///         // One etcd revision (a transaction) at a time, in etcd's order.
///         Batch::Changes { revision, deltas } => {
///             for d in deltas {
///                 println!("{revision} {}: {}", d.kind, d.object.key());
///                 match d.kind {
///                     DeltaType::Deleted => drop(store.delete(d.object.key())),
///                     _ => drop(store.add(d.object)),
///                 }
///             }
///         }
///         // A relist: the whole content, to diff against the store (keys it lacks are gone).
///         Batch::Replace { items, .. } => store.replace(items.list()),
///         Batch::Resync | Batch::Progress(_) => {}
///     })
///     .await
/// {}
/// # Ok(()) }
/// ```
pub struct RealFifo<T> {
    inner: Mutex<Inner<T>>,
    notify: Notify,
    /// Notified when a batch is taken, for a producer waiting for room.
    taken: Notify,
    /// The most batches queued before [`Queue::room`] makes the reflector wait.
    max_batches: usize,
    known: Arc<dyn Store<T>>,
    /// Woken after each batch applied (see `notify_applied`).
    applied_moved: OnceLock<Arc<Notify>>,
    /// Relists the consumer has applied (see `replaces_applied`).
    replaces_applied: AtomicU64,
}

/// How many revisions a [`RealFifo`] holds before the reflector waits for the consumer (see
/// [`RealFifo::with_max_batches`]).
pub const MAX_BATCHES: usize = 4096;

/// What [`RealFifo::set_inline`] installs: the consumer's apply of one batch.
pub(crate) type InlineApply<T> = Arc<dyn Fn(Batch<T>) + Send + Sync>;

/// The revision of a key's newest queued change, and its state then (`None`: deleted).
type Pending<T> = (i64, Option<Arc<Object<T>>>);

struct Inner<T> {
    batches: VecDeque<Batch<T>>,
    /// The revision being filled, not yet committed.
    open: Option<(i64, Changes<T>)>,
    /// The newest revision queued (a change, a relist or progress): a committed revision above
    /// it brought only changes that were dropped (duplicates, deletes of keys the cache lacks,
    /// such as a new key whose value does not decode), and is queued as progress so that the
    /// cache's revision still reaches it.
    queued: i64,
    /// Newest queued, unpopped state by key.
    pending: HashMap<Arc<str>, Pending<T>>,
    /// Relists queued and popped so far: while a relist is still queued, every pending entry
    /// came after it (queuing it cleared the others), so a batch popped from before it must
    /// not retire any of them, whatever their revisions (a wiped store starts them over).
    replaces_queued: u64,
    replaces_popped: u64,
    /// The newest queued relist until it is popped.
    replace: Option<Arc<StoreContent<T>>>,
    /// The relist being read, page by page.
    building: Option<Arc<Building<T>>>,
    /// The consumer's apply, called by the producer itself for a revision committed while
    /// nothing else is queued (see [`RealFifo::set_inline`]).
    inline: Option<InlineApply<T>>,
    resync_queued: bool,
    listed: bool,
    synced: bool,
    closed: bool,
}

impl<T> fmt::Debug for RealFifo<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = self.lock();
        f.debug_struct("RealFifo")
            .field("batches", &inner.batches.len())
            .field("synced", &inner.synced)
            .field("closed", &inner.closed)
            .finish()
    }
}

impl<T: Send + Sync + 'static> RealFifo<T> {
    /// A queue whose consumer applies batches to `known` (the informer's indexer).
    pub fn new(known: Arc<dyn Store<T>>) -> Self {
        RealFifo {
            inner: Mutex::new(Inner {
                batches: VecDeque::new(),
                open: None,
                queued: 0,
                pending: HashMap::new(),
                replaces_queued: 0,
                replaces_popped: 0,
                replace: None,
                building: None,
                inline: None,
                resync_queued: false,
                listed: false,
                synced: false,
                closed: false,
            }),
            notify: Notify::new(),
            taken: Notify::new(),
            max_batches: MAX_BATCHES,
            known,
            applied_moved: OnceLock::new(),
            replaces_applied: AtomicU64::new(0),
        }
    }
}

impl<T> RealFifo<T> {
    /// Has `notify` woken (`notify_waiters`) after each batch is applied, popped or inline,
    /// once the queue's lock is released (the synced state included): an informer's consistent
    /// reads wait on it instead of polling. Set once; later calls are ignored.
    pub(crate) fn notify_applied(&self, notify: Arc<Notify>) {
        let _ = self.applied_moved.set(notify);
    }

    fn wake_applied_waiters(&self) {
        if let Some(notify) = self.applied_moved.get() {
            notify.notify_waiters();
        }
    }

    /// The same queue holding at most `max` revisions (at least 1) before the reflector waits
    /// (default [`MAX_BATCHES`]). A relist is queued whatever the count.
    #[must_use]
    pub fn with_max_batches(mut self, max: usize) -> Self {
        self.max_batches = max.max(1);
        self
    }

    fn lock(&self) -> MutexGuard<'_, Inner<T>> {
        lock(&self.inner)
    }

    /// The newest state of `key` the queue knows of; `None` when absent.
    fn newest(&self, inner: &Inner<T>, key: &str) -> Option<Arc<Object<T>>> {
        if let Some((_, state)) = inner.pending.get(key) {
            return state.clone();
        }
        match &inner.replace {
            Some(listed) => listed.get(key),
            None => self.known.get_by_key(key),
        }
    }

    /// The `mod_revision` of [`newest`](Self::newest), without decoding a compact cache's
    /// object.
    fn newest_revision(&self, inner: &Inner<T>, key: &str) -> Option<i64> {
        if let Some((_, state)) = inner.pending.get(key) {
            return state.as_ref().map(|o| o.mod_revision);
        }
        match &inner.replace {
            Some(listed) => listed.mod_revision(key),
            None => self.known.mod_revision(key),
        }
    }

    /// Appends a change to the open revision, committing the open one first if it is older.
    fn push(inner: &mut Inner<T>, revision: i64, delta: Delta<T>) -> bool {
        let mut committed = false;
        if inner.open.as_ref().is_some_and(|(r, _)| *r != revision) {
            committed = Self::commit_locked(inner);
        }
        inner.queued = revision;
        inner
            .open
            .get_or_insert_with(|| (revision, Changes::new()))
            .1
            .push(delta);
        committed
    }

    fn commit_locked(inner: &mut Inner<T>) -> bool {
        match inner.open.take() {
            Some((revision, deltas)) => {
                inner.batches.push_back(Batch::Changes { revision, deltas });
                true
            }
            None => false,
        }
    }

    /// Queues a relist's content as one batch.
    fn queue_replace(&self, items: StoreContent<T>, revision: i64, store_replaced: bool) {
        let items = Arc::new(items);
        let mut inner = self.lock();
        Self::commit_locked(&mut inner);
        // Everything queued before is superseded by the list for the purpose of "newest".
        inner.pending.clear();
        inner.replaces_queued += 1;
        inner.replace = Some(items.clone());
        // A relist after a wipe goes back in revisions: it is the reference from now on.
        inner.queued = revision;
        let initial = !inner.listed;
        inner.listed = true;
        inner.batches.push_back(Batch::Replace {
            revision,
            items,
            store_replaced,
            initial,
        });
        drop(inner);
        self.notify.notify_waiters();
    }

    /// Forgets what `pending` and the flags say about a batch that is being handed out.
    fn taken(inner: &mut Inner<T>, batch: &Batch<T>) {
        match batch {
            Batch::Changes { revision, deltas }
                if inner.replaces_popped == inner.replaces_queued =>
            {
                for d in deltas {
                    let key = d.object.key();
                    if inner.pending.get(key).is_some_and(|(r, _)| r <= revision) {
                        inner.pending.remove(key);
                    }
                }
            }
            // Queued before a relist that is still queued: see `replaces_queued`.
            Batch::Changes { .. } => {}
            Batch::Replace { items, .. } => {
                inner.replaces_popped += 1;
                if inner
                    .replace
                    .as_ref()
                    .is_some_and(|r| Arc::ptr_eq(r, items))
                {
                    inner.replace = None;
                }
            }
            Batch::Resync => inner.resync_queued = false,
            Batch::Progress(_) => {}
        }
        if inner.batches.is_empty() && inner.pending.capacity() > 1024 {
            inner.pending.shrink_to_fit();
            inner.batches.shrink_to_fit();
        }
    }

    /// Makes the consumer `apply` a committed revision (changes or progress) in the
    /// producer's own call, under the queue's lock as [`pop`](Self::pop) would, whenever
    /// nothing is queued before it: the watch path then costs no task wake-up between the
    /// reflector and the cache. Anything else (a relist, a resync, a revision committed behind
    /// others) is left to `pop`, which also takes over whenever the consumer falls behind.
    /// `None` turns it off.
    pub(crate) fn set_inline(&self, apply: Option<InlineApply<T>>) {
        self.lock().inline = apply;
    }

    /// A batch was queued: applies it inline if it may be (see [`set_inline`]), else wakes
    /// the popping consumer. An inline batch frees no room a producer could wait for: the
    /// producer waiting on [`Queue::room`] is the reflector, the one applying it.
    ///
    /// [`set_inline`]: Self::set_inline
    fn queued(&self, mut inner: MutexGuard<'_, Inner<T>>) {
        if let Some(apply) = inner.inline.clone() {
            let alone = inner.batches.len() == 1
                && matches!(
                    inner.batches.front(),
                    Some(Batch::Changes { .. } | Batch::Progress(_))
                );
            if alone && !inner.closed {
                if let Some(batch) = inner.batches.pop_front() {
                    Self::taken(&mut inner, &batch);
                    apply(batch);
                    drop(inner);
                    self.wake_applied_waiters();
                    return;
                }
            }
        }
        drop(inner);
        self.notify.notify_waiters();
    }

    /// Waits for the next batch, removes it and calls `process` with it while holding the
    /// queue, so that nothing is queued against a cache that has not applied it yet. Returns
    /// [`Closed`] once closed and empty.
    pub async fn pop<R>(&self, process: impl FnOnce(Batch<T>) -> R) -> Result<R, Closed> {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut inner = self.lock();
                if let Some(batch) = inner.batches.pop_front() {
                    let is_replace = matches!(batch, Batch::Replace { .. });
                    Self::taken(&mut inner, &batch);
                    let result = process(batch);
                    if is_replace {
                        inner.synced = true;
                        self.replaces_applied.fetch_add(1, Ordering::AcqRel);
                    }
                    drop(inner);
                    self.taken.notify_waiters();
                    self.wake_applied_waiters();
                    return Ok(result);
                }
                if inner.closed {
                    return Err(Closed);
                }
            }
            notified.await;
        }
    }

    /// How many relists the consumer has popped and processed: the cache holds the newest
    /// of them. The reflector counts a relist once it is read, a moment before this.
    pub fn replaces_applied(&self) -> u64 {
        self.replaces_applied.load(Ordering::Acquire)
    }

    /// Whether the first relist has been popped and processed.
    pub fn has_synced(&self) -> bool {
        self.lock().synced
    }

    /// Closes the queue: `pop` returns [`Closed`] once what is queued is drained.
    pub fn close(&self) {
        let mut inner = self.lock();
        Self::commit_locked(&mut inner);
        inner.closed = true;
        drop(inner);
        self.notify.notify_waiters();
    }

    /// Whether [`close`](Self::close) was called.
    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// How many batches are queued.
    pub fn len(&self) -> usize {
        self.lock().batches.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T: Send + Sync + 'static> Queue<T> for RealFifo<T> {
    fn add_if_newer(&self, kind: DeltaType, obj: Arc<Object<T>>) -> bool {
        let mut inner = self.lock();
        if self
            .newest_revision(&inner, obj.key())
            .is_some_and(|current| current >= obj.mod_revision)
        {
            return false;
        }
        let revision = obj.mod_revision;
        inner
            .pending
            .insert(obj.shared_key().clone(), (revision, Some(obj.clone())));
        let committed = Self::push(&mut inner, revision, Delta::new(kind, obj));
        drop(inner);
        if committed {
            self.notify.notify_waiters();
        }
        true
    }

    fn delete(&self, key: &str, revision: i64, last: Option<Arc<Object<T>>>) -> bool {
        let mut inner = self.lock();
        let Some(newest) = self.newest(&inner, key) else {
            return false;
        };
        if newest.mod_revision >= revision {
            return false;
        }
        let object = last
            .filter(|l| l.mod_revision >= newest.mod_revision)
            .unwrap_or(newest);
        inner
            .pending
            .insert(object.shared_key().clone(), (revision, None));
        let committed = Self::push(&mut inner, revision, Delta::new(DeltaType::Deleted, object));
        drop(inner);
        if committed {
            self.notify.notify_waiters();
        }
        true
    }

    fn replace(&self, list: Vec<Arc<Object<T>>>, revision: i64, store_replaced: bool) {
        let items = StoreContent::unindexed(list);
        self.queue_replace(items, revision, store_replaced);
    }

    fn begin_replace(&self, reuse_from: Option<i64>) -> Option<Arc<dyn ListSink<T>>> {
        let building = Arc::new(Building {
            content: Mutex::new(list_content(&*self.known)),
            known: self.known.clone(),
            reuse_from,
            reuse: AtomicBool::new(false),
        });
        self.lock().building = Some(building.clone());
        Some(building)
    }

    fn finish_replace(&self, revision: i64, store_replaced: bool) {
        let Some(building) = self.lock().building.take() else {
            return;
        };
        // The source is done with the sink once its list returned; if it still holds it, take
        // what it put in.
        let mut content = match Arc::try_unwrap(building) {
            Ok(building) => building
                .content
                .into_inner()
                .unwrap_or_else(|e| e.into_inner()),
            Err(shared) => std::mem::take(&mut *lock(&shared.content)),
        };
        // The list is whole: whatever its adoptions left dead is known now.
        content.defer_repacks(false);
        self.queue_replace(content, revision, store_replaced);
    }

    fn resync(&self) {
        let mut inner = self.lock();
        if inner.resync_queued {
            return;
        }
        inner.resync_queued = true;
        inner.batches.push_back(Batch::Resync);
        drop(inner);
        self.notify.notify_waiters();
    }

    fn commit(&self, revision: i64) {
        let mut inner = self.lock();
        if Self::commit_locked(&mut inner) {
            self.queued(inner);
        } else if revision > inner.queued {
            drop(inner);
            self.progress(revision);
        }
    }

    fn room(&self) -> Option<crate::listwatch::BoxFuture<'_, ()>> {
        {
            let inner = self.lock();
            if inner.batches.len() < self.max_batches || inner.closed {
                return None;
            }
        }
        Some(Box::pin(async move {
            loop {
                let taken = self.taken.notified();
                tokio::pin!(taken);
                taken.as_mut().enable();
                {
                    let inner = self.lock();
                    if inner.batches.len() < self.max_batches || inner.closed {
                        return;
                    }
                }
                taken.await;
            }
        }))
    }

    fn progress(&self, revision: i64) {
        let mut inner = self.lock();
        Self::commit_locked(&mut inner);
        inner.queued = inner.queued.max(revision);
        match inner.batches.back_mut() {
            Some(Batch::Progress(r)) => *r = (*r).max(revision),
            _ => inner.batches.push_back(Batch::Progress(revision)),
        }
        self.queued(inner);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Indexer;

    fn obj(key: &str, rev: i64) -> Arc<Object<i64>> {
        Arc::new(Object::new(key, rev, rev).read_from(rev.to_string().as_bytes()))
    }

    /// The stamp of [`obj`]`(_, rev)`, or of the same revisions with another value.
    fn stamp(rev: i64, value: &str) -> Stamp {
        Stamp::new(rev, rev, 1, value.as_bytes())
    }

    fn fifo() -> (RealFifo<i64>, Indexer<i64>) {
        let ix = Indexer::default();
        (RealFifo::new(Arc::new(ix.clone())), ix)
    }

    async fn pop(f: &RealFifo<i64>) -> Batch<i64> {
        f.pop(|b| b).await.unwrap()
    }

    #[tokio::test]
    async fn a_relist_read_by_pages_keeps_cached_objects_of_the_same_store_only() {
        let (f, ix) = fifo();
        let cached = obj("a", 5);
        ix.add(cached.clone());
        // Read at or after the revision seen: unchanged objects are kept, not handed over.
        let sink = f.begin_replace(Some(10)).unwrap();
        sink.begin(10, 2);
        assert_eq!(sink.held(), 1, "the cache's objects may be kept");
        assert!(!sink.unchanged("a", &stamp(6, "6")), "changed since");
        assert!(!sink.unchanged("b", &stamp(7, "7")), "not cached");
        // The same revisions with another value: a store refilled alike.
        assert!(!sink.unchanged("a", &stamp(5, "five")), "another value");
        let mut recreated = stamp(5, "5");
        recreated.version = 2;
        assert!(!sink.unchanged("a", &recreated), "another version");
        assert!(sink.unchanged("a", &stamp(5, "5")));
        sink.page(vec![obj("b", 7)]);
        drop(sink);
        f.finish_replace(10, false);
        match pop(&f).await {
            Batch::Replace {
                items, revision, ..
            } => {
                assert_eq!((items.len(), revision), (2, 10));
                assert!(Arc::ptr_eq(&items.get("a").unwrap(), &cached));
            }
            other => panic!("{other:?}"),
        }
        // A list read below a revision seen comes from a store that went back in time.
        let sink = f.begin_replace(Some(10)).unwrap();
        sink.begin(9, 1);
        assert_eq!(sink.held(), 0);
        assert!(!sink.unchanged("a", &stamp(5, "5")));
        // The store was replaced: never.
        let sink = f.begin_replace(None).unwrap();
        sink.begin(20, 1);
        assert_eq!(sink.held(), 0);
        assert!(!sink.unchanged("a", &stamp(5, "5")));
    }

    #[tokio::test]
    async fn one_revision_is_one_batch_and_only_once_committed() {
        let (f, _ix) = fifo();
        f.replace(vec![], 1, false);
        assert!(matches!(
            pop(&f).await,
            Batch::Replace { initial: true, .. }
        ));
        f.add_if_newer(DeltaType::Added, obj("a", 5));
        f.add_if_newer(DeltaType::Added, obj("b", 5));
        assert!(f.is_empty(), "revision 5 is not committed yet");
        f.add_if_newer(DeltaType::Added, obj("c", 6));
        match pop(&f).await {
            Batch::Changes { revision, deltas } => {
                assert_eq!(revision, 5);
                assert_eq!(deltas.len(), 2);
            }
            other => panic!("{other:?}"),
        }
        assert!(f.is_empty());
        f.commit(6);
        assert!(matches!(pop(&f).await, Batch::Changes { revision: 6, .. }));
    }

    #[tokio::test]
    async fn duplicates_and_unknown_deletes_are_dropped_against_queue_list_and_cache() {
        let (f, ix) = fifo();
        ix.add(obj("cached", 3));
        f.replace(vec![obj("listed", 4), obj("cached", 3)], 4, false);
        // Newest state of "listed" is the queued list's.
        assert!(!f.add_if_newer(DeltaType::Updated, obj("listed", 4)));
        assert!(!f.delete("never", 5, None));
        assert!(f.delete("listed", 5, None));
        // Deleted in the queue: a second delete is dropped.
        assert!(!f.delete("listed", 6, None));
        f.commit(5);
        let _replace = pop(&f).await;
        match pop(&f).await {
            Batch::Changes { deltas, .. } => {
                assert_eq!(deltas[0].kind, DeltaType::Deleted);
                assert_eq!(deltas[0].object.mod_revision, 4, "last state from the list");
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn a_revision_whose_changes_were_all_dropped_still_advances_the_cache() {
        let (f, _ix) = fifo();
        f.replace(vec![], 1, false);
        let _ = pop(&f).await;
        // A new key whose value does not decode reaches the queue as a delete of a key it
        // never knew: dropped, yet etcd is at revision 2 and so is the cache.
        assert!(!f.delete("undecodable", 2, None));
        f.commit(2);
        assert_eq!(f.len(), 1, "revision 2 is queued as progress");
        assert!(matches!(pop(&f).await, Batch::Progress(2)));
        // Committing a revision already queued adds nothing.
        f.add_if_newer(DeltaType::Added, obj("a", 3));
        f.commit(3);
        f.commit(3);
        assert!(matches!(pop(&f).await, Batch::Changes { revision: 3, .. }));
        assert!(f.is_empty());
    }

    /// Correctness review, finding 3: a batch queued before a relist of a wiped store must not
    /// retire what came after the relist, though its revision is higher.
    #[tokio::test]
    async fn a_batch_from_before_a_store_replacement_cannot_hide_a_later_delete() {
        let (f, _ix) = fifo();
        f.replace(vec![], 1, false);
        let _ = pop(&f).await;
        // The consumer lags: revision 995 touching K is still queued.
        assert!(f.add_if_newer(DeltaType::Added, obj("k", 995)));
        f.commit(995);
        // The store is wiped; its relist at 10 lacks K; K is created at 11.
        f.replace(vec![], 10, true);
        assert!(f.add_if_newer(DeltaType::Added, obj("k", 11)));
        f.commit(11);
        assert!(matches!(
            pop(&f).await,
            Batch::Changes { revision: 995, .. }
        ));
        // K's delete at 12 still finds K (pending at 11) and is queued.
        assert!(f.delete("k", 12, None), "the delete of k was dropped");
        f.commit(12);
        assert!(matches!(pop(&f).await, Batch::Replace { revision: 10, .. }));
        assert!(matches!(pop(&f).await, Batch::Changes { revision: 11, .. }));
        match pop(&f).await {
            Batch::Changes {
                revision: 12,
                deltas,
            } => {
                assert_eq!(deltas[0].kind, DeltaType::Deleted);
                assert_eq!(deltas[0].object.mod_revision, 11);
            }
            other => panic!("{other:?}"),
        }
    }

    /// Correctness review, finding 6: a consumer that falls behind makes the producer wait
    /// instead of growing the queue.
    #[tokio::test]
    async fn a_full_queue_makes_the_producer_wait_for_room() {
        let ix = Indexer::default();
        let f = RealFifo::new(Arc::new(ix.clone())).with_max_batches(2);
        f.replace(vec![], 1, false);
        f.add_if_newer(DeltaType::Added, obj("a", 2));
        f.commit(2);
        let mut room = f.room().expect("two batches queued: no room");
        let waited = tokio::time::timeout(std::time::Duration::from_millis(20), &mut room).await;
        assert!(waited.is_err(), "no room until a batch is taken");
        let _ = pop(&f).await;
        tokio::time::timeout(std::time::Duration::from_secs(1), room)
            .await
            .expect("room once a batch is taken");
    }

    /// The fast path: a revision committed with nothing queued before it is applied in the
    /// commit; one committed behind a queued batch waits for `pop`, in order; none after
    /// `set_inline(None)`.
    #[tokio::test]
    async fn a_revision_alone_is_applied_in_its_commit_and_one_behind_others_is_popped() {
        let (f, _ix) = fifo();
        let applied = Arc::new(Mutex::new(Vec::new()));
        let seen = applied.clone();
        f.set_inline(Some(Arc::new(move |batch: Batch<i64>| {
            let revision = match batch {
                Batch::Changes { revision, .. } => revision,
                Batch::Progress(r) => -r,
                _ => 0,
            };
            lock(&seen).push(revision);
        })));
        f.add_if_newer(DeltaType::Added, obj("a", 2));
        f.commit(2);
        f.progress(3);
        assert_eq!(*lock(&applied), vec![2, -3]);
        assert!(f.is_empty());
        // Behind a queued resync: both wait for the consumer, in order.
        f.resync();
        f.add_if_newer(DeltaType::Added, obj("b", 4));
        f.commit(4);
        assert_eq!(f.len(), 2);
        assert!(matches!(pop(&f).await, Batch::Resync));
        assert!(matches!(pop(&f).await, Batch::Changes { revision: 4, .. }));
        // The key popped is no longer pending: a newer change of it is taken.
        assert!(f.add_if_newer(DeltaType::Updated, obj("b", 5)));
        f.set_inline(None);
        f.commit(5);
        assert_eq!(f.len(), 1);
        assert_eq!(*lock(&applied), vec![2, -3]);
    }

    #[tokio::test]
    async fn resync_is_queued_once_and_progress_merges() {
        let (f, _ix) = fifo();
        f.resync();
        f.resync();
        f.progress(7);
        f.progress(9);
        assert_eq!(f.len(), 2);
        assert!(matches!(pop(&f).await, Batch::Resync));
        assert!(matches!(pop(&f).await, Batch::Progress(9)));
        f.close();
        assert!(f.pop(|_| ()).await.is_err());
    }
}
