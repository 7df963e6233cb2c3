use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::listwatch::{
    BoxFuture, Capabilities, Error, Freshness, KeyRevisionsSink, ListKeyRevisions, ListResult,
    ListerWatcher, ProveFreshness, Result, Resumable, Resume, SavedCache, SourceIdentity,
    WatchEvent, WatchStream,
};
use crate::object::Object;
use crate::sync::lock;

/// An in-memory, revisioned source that a test drives by hand (client-go's
/// `FakeControllerSource`), so controllers can be unit-tested without etcd.
///
/// It behaves like an etcd prefix: every write gets the next revision, lists are consistent
/// snapshots, watches replay history after their start revision, and a start revision at or below
/// the compacted one fails as [`Error::Expired`]. Beyond `list` and `watch` it has etcd's
/// source's [capabilities](crate::listwatch::capabilities): freshness proofs for consistent
/// reads, key revisions for the audit, and resuming from a snapshot (no liveness bound: in
/// memory, a quiet watch is a live one).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use etcd_informer::testing::FakeSource;
/// use etcd_informer::{SharedIndexInformer, ListerWatcher};
/// let source = FakeSource::new();
/// source.put("tmp/a", "one".to_string());
/// let informer = SharedIndexInformer::new(source.clone(), Default::default());
/// tokio::spawn(informer.clone().run());
/// informer.wait_for_cache_sync().await;
/// assert_eq!(informer.lister().get("tmp/a").unwrap().value, "one");
/// # }
/// ```
pub struct FakeSource<T> {
    inner: Arc<Mutex<Inner<T>>>,
}

impl<T> Clone for FakeSource<T> {
    fn clone(&self) -> Self {
        FakeSource {
            inner: self.inner.clone(),
        }
    }
}

struct Inner<T> {
    revision: i64,
    compacted: i64,
    objects: BTreeMap<String, Object<T>>,
    history: Vec<Change<T>>,
    watchers: Vec<mpsc::UnboundedSender<WatchEvent<T>>>,
    list_errors: VecDeque<Error>,
    watch_errors: VecDeque<Error>,
    lists: usize,
    watches: usize,
    /// Freshness questions asked.
    proofs: usize,
    /// Each key's `mod_revision` when the history was last compacted away.
    base: BTreeMap<Arc<str>, i64>,
    /// The next change is kept from the open watches.
    lose_next: bool,
    /// The store's id, for snapshots (issue 26).
    cluster_id: u64,
}

enum Change<T> {
    Put(Object<T>),
    Delete(Arc<str>, i64),
}

impl<T: Clone> Change<T> {
    fn revision(&self) -> i64 {
        match self {
            Change::Put(o) => o.mod_revision,
            Change::Delete(_, r) => *r,
        }
    }

    fn event(&self) -> WatchEvent<T> {
        match self {
            Change::Put(o) if o.version == 1 => WatchEvent::Added(o.clone()),
            Change::Put(o) => WatchEvent::Modified(o.clone()),
            Change::Delete(key, revision) => WatchEvent::Deleted {
                key: key.clone(),
                revision: *revision,
                last: None,
            },
        }
    }
}

impl<T: Clone + Send + Sync + 'static> Default for FakeSource<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Clone + Send + Sync + 'static> FakeSource<T> {
    /// An empty source at revision 1.
    pub fn new() -> Self {
        FakeSource {
            inner: Arc::new(Mutex::new(Inner {
                revision: 1,
                compacted: 0,
                objects: BTreeMap::new(),
                history: Vec::new(),
                watchers: Vec::new(),
                list_errors: VecDeque::new(),
                watch_errors: VecDeque::new(),
                lists: 0,
                watches: 0,
                proofs: 0,
                base: BTreeMap::new(),
                lose_next: false,
                cluster_id: 1,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner<T>> {
        lock(&self.inner)
    }

    /// Writes `value` under `key`; returns the new revision.
    pub fn put(&self, key: &str, value: T) -> i64 {
        let mut inner = self.lock();
        inner.revision += 1;
        let revision = inner.revision;
        let object = match inner.objects.get(key) {
            Some(prev) => {
                let mut next = prev.clone();
                next.mod_revision = revision;
                next.version += 1;
                next.value = value;
                next
            }
            None => Object::new(key, revision, value),
        };
        inner.objects.insert(key.to_owned(), object.clone());
        inner.record(Change::Put(object));
        revision
    }

    /// Deletes `key`; returns the revision of the delete, or `None` if it did not exist.
    pub fn delete(&self, key: &str) -> Option<i64> {
        let mut inner = self.lock();
        inner.objects.remove(key)?;
        inner.revision += 1;
        let revision = inner.revision;
        inner.record(Change::Delete(key.into(), revision));
        Some(revision)
    }

    /// Forgets the history up to the current revision, like etcd's compaction: later watches
    /// from an older revision fail as expired. Open watches are not affected.
    pub fn compact(&self) {
        let mut inner = self.lock();
        inner.compacted = inner.revision;
        inner.history.clear();
        inner.base = inner
            .objects
            .values()
            .map(|o| (o.shared_key().clone(), o.mod_revision))
            .collect();
    }

    /// Keeps the next change from the watches open now, as etcd 3.4.23 loses a delete that a
    /// compaction lands on: the store and later watches have it, the cache does not.
    pub fn lose_next_event(&self) {
        self.lock().lose_next = true;
    }

    /// Replaces the store with an empty one whose revisions start over, as when etcd is wiped
    /// or restored from an old backup; open watches end as if the connection dropped.
    pub fn wipe(&self) {
        let mut inner = self.lock();
        inner.revision = 1;
        inner.compacted = 0;
        inner.objects.clear();
        inner.history.clear();
        inner.base.clear();
        for w in inner.watchers.drain(..) {
            let _ = w.send(WatchEvent::Error(Error::transient("connection reset")));
        }
    }

    /// Every object, in key order, without counting as a list.
    pub fn objects(&self) -> Vec<Object<T>> {
        self.lock().objects.values().cloned().collect()
    }

    /// Ends every open watch with `error` (use [`Error::unavailable`] for a lost connection,
    /// [`Error::Expired`] for a compaction the watch noticed).
    pub fn break_watches(&self, error: Error) {
        let mut inner = self.lock();
        for w in inner.watchers.drain(..) {
            let _ = w.send(WatchEvent::Error(error.clone()));
        }
    }

    /// Sends a bookmark at the current revision on every open watch.
    pub fn bookmark(&self) {
        let mut inner = self.lock();
        let revision = inner.revision;
        inner
            .watchers
            .retain(|w| w.send(WatchEvent::Bookmark(revision)).is_ok());
    }

    /// Makes the next list fail with `error`.
    pub fn fail_next_list(&self, error: Error) {
        self.lock().list_errors.push_back(error);
    }

    /// Makes the next watch fail to start with `error`.
    pub fn fail_next_watch(&self, error: Error) {
        self.lock().watch_errors.push_back(error);
    }

    /// Sends an arbitrary event on every open watch (for duplicates and other misbehaviour).
    pub fn inject(&self, event: impl Fn() -> WatchEvent<T>) {
        let mut inner = self.lock();
        inner.watchers.retain(|w| w.send(event()).is_ok());
    }

    /// The current revision.
    pub fn revision(&self) -> i64 {
        self.lock().revision
    }

    /// How many lists were served (failed ones included).
    pub fn list_count(&self) -> usize {
        self.lock().lists
    }

    /// How many watches were started (failed ones included).
    pub fn watch_count(&self) -> usize {
        self.lock().watches
    }

    /// How many times [`freshness`](crate::listwatch::ProveFreshness::freshness) was asked (failed answers
    /// included).
    pub fn freshness_count(&self) -> usize {
        self.lock().proofs
    }

    /// How many watches are open.
    pub fn open_watches(&self) -> usize {
        let mut inner = self.lock();
        inner.watchers.retain(|w| !w.is_closed());
        inner.watchers.len()
    }
    // ---- Warm restart from a snapshot (issue 26) ----
    /// Gives the store another cluster id (1 at first), as another etcd cluster would have:
    /// a snapshot of the old one is then refused.
    pub fn set_cluster_id(&self, cluster_id: u64) {
        self.lock().cluster_id = cluster_id;
    }

    /// How many keys the store held at `revision`, from the history since; `None` if the
    /// history no longer reaches back there (compacted).
    fn tally_at(inner: &Inner<T>, revision: i64) -> Option<usize> {
        if revision < inner.compacted {
            return None;
        }
        let mut keys = inner.objects.len() as i64;
        for change in inner.history.iter().filter(|c| c.revision() > revision) {
            match change {
                Change::Put(o) if o.version == 1 => keys -= 1,
                Change::Put(_) => {}
                Change::Delete(..) => keys += 1,
            }
        }
        usize::try_from(keys).ok()
    }
}

impl<T: Clone> Inner<T> {
    fn record(&mut self, change: Change<T>) {
        if !std::mem::take(&mut self.lose_next) {
            self.watchers.retain(|w| w.send(change.event()).is_ok());
        }
        self.history.push(change);
    }
}

impl<T: Clone + Send + Sync + 'static> ListerWatcher<T> for FakeSource<T> {
    fn list(&self) -> BoxFuture<'_, Result<ListResult<T>>> {
        let mut inner = self.lock();
        inner.lists += 1;
        let result = match inner.list_errors.pop_front() {
            Some(e) => Err(e),
            None => Ok(ListResult {
                items: inner.objects.values().cloned().collect(),
                revision: inner.revision,
            }),
        };
        Box::pin(async move { result })
    }

    /// Freshness proofs, key revisions and resuming, as etcd's source; no liveness bound (in
    /// memory, a quiet watch is a live one).
    fn capabilities(&self) -> Capabilities<'_> {
        Capabilities::none()
            .with_freshness(self)
            .with_key_revisions(self)
            .with_resume(self)
    }

    fn watch(&self, after_revision: i64) -> BoxFuture<'_, Result<WatchStream<T>>> {
        let mut inner = self.lock();
        inner.watches += 1;
        let result = if let Some(e) = inner.watch_errors.pop_front() {
            Err(e)
        } else if after_revision > inner.revision {
            Err(Error::StoreReplaced {
                revision: after_revision,
                reason: format!(
                    "the store is at revision {}: it went back in time",
                    inner.revision
                ),
            })
        } else if after_revision < inner.compacted {
            Err(Error::expired(
                after_revision,
                format!("compacted at {}", inner.compacted),
            ))
        } else {
            let (tx, rx) = mpsc::unbounded_channel();
            for change in inner
                .history
                .iter()
                .filter(|c| c.revision() > after_revision)
            {
                let _ = tx.send(change.event());
            }
            inner.watchers.push(tx);
            Ok(Box::pin(UnboundedReceiverStream::new(rx)) as WatchStream<T>)
        };
        Box::pin(async move { result })
    }
}

impl<T: Clone + Send + Sync + 'static> ListKeyRevisions for FakeSource<T> {
    /// The keys at the last compaction, with the history up to `at` replayed on them.
    fn key_revisions(&self, at: i64, mut page: KeyRevisionsSink) -> BoxFuture<'_, Result<()>> {
        let inner = self.lock();
        let result = if at < inner.compacted || at > inner.revision {
            Err(Error::expired(
                at,
                format!(
                    "revision {at} is outside the history ({} to {})",
                    inner.compacted, inner.revision
                ),
            ))
        } else {
            let mut keys = inner.base.clone();
            for change in inner.history.iter().take_while(|c| c.revision() <= at) {
                match change {
                    Change::Put(o) => {
                        keys.insert(o.shared_key().clone(), o.mod_revision);
                    }
                    Change::Delete(key, _) => {
                        keys.remove(key);
                    }
                }
            }
            page(keys.into_iter().collect());
            Ok(())
        };
        Box::pin(async move { result })
    }
}

impl<T: Clone + Send + Sync + 'static> ProveFreshness for FakeSource<T> {
    /// From the history: unchanged when nothing was written after `since` up to `at`.
    fn freshness(
        &self,
        since: i64,
        _cached: Option<usize>,
        at: Option<i64>,
    ) -> BoxFuture<'_, Result<Freshness>> {
        let mut inner = self.lock();
        inner.proofs += 1;
        let revision = at.unwrap_or(inner.revision);
        let result = if since > inner.revision {
            // As etcd's source answers: a cache ahead of the store is another store's.
            Err(Error::store_replaced(
                since + 1,
                format!(
                    "the store is at revision {}, below the cache's {since}: it went back in time",
                    inner.revision
                ),
            ))
        } else if revision > inner.revision {
            Err(Error::transient(format!(
                "revision {revision} is in the future (current {})",
                inner.revision
            )))
        } else {
            let changed = since < inner.compacted
                || inner
                    .history
                    .iter()
                    .any(|c| c.revision() > since && c.revision() <= revision);
            Ok(Freshness {
                revision,
                unchanged: !changed,
            })
        };
        Box::pin(async move { result })
    }
}

impl<T: Clone + Send + Sync + 'static> Resumable for FakeSource<T> {
    fn identity(&self) -> SourceIdentity {
        SourceIdentity {
            name: "fake".into(),
            cluster_id: Some(self.lock().cluster_id),
        }
    }

    /// As etcd's source answers: the cluster id, a revision not ahead of the store's, then the
    /// tally at the revision from the history (compacted when it no longer reaches back).
    fn can_resume(&self, saved: SavedCache) -> BoxFuture<'_, Result<Resume>> {
        let (revision, keys, cluster_id) = (saved.revision, saved.keys, saved.cluster_id);
        let inner = self.lock();
        let answer = if cluster_id != inner.cluster_id {
            Resume::Refused(format!(
                "another cluster: the snapshot's is {cluster_id:x}, the source's {:x}",
                inner.cluster_id
            ))
        } else if revision > inner.revision {
            Resume::Refused(format!(
                "the snapshot's revision {revision} is ahead of the store's {}: the store was replaced",
                inner.revision
            ))
        } else {
            match Self::tally_at(&inner, revision) {
                None => Resume::Compacted(format!(
                    "revision {revision} was compacted (compacted up to {})",
                    inner.compacted
                )),
                Some(n) if n != keys => Resume::Refused(format!(
                    "the key tally differs at revision {revision}: the source counts {n}, the snapshot holds {keys}"
                )),
                Some(_) => Resume::Ready,
            }
        };
        Box::pin(async move { Ok(answer) })
    }
}
