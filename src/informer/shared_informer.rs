//! The shared informer: one cache and one watch, any number of handlers. This file holds its
//! state and its run loop; the files beside it add its other methods by concept (handlers in
//! `registration.rs`, applying what the queue pops in `apply.rs`, consistent reads in
//! `consistency.rs`, `health.rs`, `event_stream.rs`), and import the state from here.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::Instrument;

use super::audit::{AuditCounts, AuditReport, Audited};
use super::controller::{AbortOnDrop, Controller, ControllerConfig};
use super::options::{InformerOptions, Processing, RelistUnchanged};
use super::processor::{merge_due, refuse_in_inline_handler, Processor};
use crate::delta_fifo::DeltaFifo;
use crate::lister::Lister;
use crate::listwatch::ListerWatcher;
use crate::listwatch::SourceCapabilities;
use crate::metrics::{AuditMetrics, InformerMetrics};
use crate::queue::clamp_resync;
use crate::queue::ReceivedAt;
use crate::real_fifo::RealFifo;
use crate::reflector::{
    Backoff, Reflector, ReflectorOptions, RevisionHandle, TransformFn, WatchErrorHandler,
};
use crate::snapshot::{SnapshotStart, Snapshots, WarmSource};
use crate::store::{Indexer, Indexers, StoreError};
use crate::sync::lock;

/// A cache of a source kept current by one list-and-watch, shared by any number of handlers
/// (client-go's `SharedIndexInformer`).
///
/// Guarantees:
/// - the cache is updated before any handler hears of the change;
/// - each handler receives every change in etcd's order, a revision (one transaction) at a
///   time, in the default [`Processing::Atomic`]; with [`Processing::DeltaFifo`], one key's
///   changes in revision order and, across keys, the order the DeltaFIFO hands keys out
///   (first changed, first delivered);
/// - a read of the cache from within a handler sees the cache as it is then, which may be
///   past the event being handled (later changes applied, their notifications still queued):
///   act on the event's objects, or re-read the key, as a client-go handler would;
/// - each handler has its own backlog ([`HandlerRegistration::backlog`](crate::HandlerRegistration::backlog)); handlers share a
///   delivery thread while they keep up, and one stuck for over 20 ms on a notification is left
///   that thread while the others move on: a slow or stuck handler delays the others by 20 ms at
///   most, once, and never the cache;
/// - a handler added late receives an add for every cached object, then the live changes, with
///   no gap and no duplicate;
/// - a panicking handler has that notification logged and skipped.
///
/// `SharedIndexInformer` is a cheap handle; clones share one informer.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use etcd_informer::{EtcdListerWatcher, JsonCodec, ResourceEventHandlerFuncs, SharedIndexInformer};
/// let client = etcd_informer::connect(["127.0.0.1:2379"]).await?;
/// let lw = EtcdListerWatcher::new(client, "/registry/configmaps/", JsonCodec::<serde_json::Value>::new())?;
/// let informer = SharedIndexInformer::new(lw, Default::default());
/// informer.add_event_handler(ResourceEventHandlerFuncs::new().on_add(|o, _| println!("created: {}", o.key())))?;
/// tokio::spawn(informer.clone().run());
/// informer.wait_for_cache_sync().await;
/// println!("{} objects cached", informer.lister().list().len());
/// # Ok(()) }
/// ```
pub struct SharedIndexInformer<T> {
    pub(super) shared: Arc<Shared<T>>,
}

impl<T> Clone for SharedIndexInformer<T> {
    fn clone(&self) -> Self {
        SharedIndexInformer {
            shared: self.shared.clone(),
        }
    }
}

/// The informer's queue, by [`Processing`] mode.
pub(super) enum Queue<T> {
    Atomic(Arc<RealFifo<T>>),
    DeltaFifo(Arc<DeltaFifo<T>>),
}

impl<T: Send + Sync + 'static> Queue<T> {
    pub(super) fn has_synced(&self) -> bool {
        match self {
            Queue::Atomic(q) => q.has_synced(),
            Queue::DeltaFifo(q) => q.has_synced(),
        }
    }

    /// How many relists the cache has applied (the queue has handed them to it whole).
    pub(super) fn replaces_applied(&self) -> u64 {
        match self {
            Queue::Atomic(q) => q.replaces_applied(),
            Queue::DeltaFifo(q) => q.replaces_applied(),
        }
    }

    fn close(&self) {
        match self {
            Queue::Atomic(q) => q.close(),
            Queue::DeltaFifo(q) => q.close(),
        }
    }
}

pub(super) struct Shared<T> {
    pub(super) name: String,
    pub(super) indexer: Indexer<T>,
    pub(super) queue: Queue<T>,
    pub(super) processor: Mutex<Processor<T>>,
    pub(super) source: Arc<dyn ListerWatcher<T>>,
    /// Applied by the reflector to everything the source yields.
    pub(super) transform: Option<TransformFn<T>>,
    pub(super) started: AtomicBool,
    /// Set once `run` has ended: handlers get what is queued, then their threads end.
    pub(super) stopped: AtomicBool,
    pub(super) default_resync: Duration,
    pub(super) resync_check_period: Mutex<Duration>,
    pub(super) revision: OnceLock<RevisionHandle>,
    pub(super) watch_error_handler: Option<WatchErrorHandler>,
    pub(super) backoff: Backoff,
    pub(super) reconnect: Backoff,
    pub(super) max_handler_backlog: Option<usize>,
    pub(super) relist_unchanged: RelistUnchanged,
    pub(super) next_id: AtomicU64,
    /// Batches whose application panicked.
    pub(super) apply_panics: AtomicU64,
    pub(super) metrics: InformerMetrics,
    /// When the source received each revision the reflector committed (metrics only).
    pub(super) received_at: Arc<ReceivedAt>,
    pub(super) audit_period: Option<Duration>,
    pub(super) audit: Arc<AuditCounts>,
    /// Set by `run` in the revision-atomic mode.
    pub(super) auditor: OnceLock<Arc<Audited<T>>>,
    /// Warm restart from a snapshot (issue 26): `None` when off.
    pub(super) snapshots: Option<Snapshots<T>>,
    /// The cache lacks keys of the prefix that it held (records of a warm start that no
    /// longer decode, removed): a freshness proof may not take its count for the prefix's.
    pub(super) incomplete: AtomicBool,
    /// Woken (`notify_waiters`) whenever the cache's revision, its proof or its synced state
    /// may have moved: consistent reads wait on it (see `consistency.rs`).
    pub(super) moved: Arc<Notify>,
}

impl<T> Drop for Shared<T> {
    fn drop(&mut self) {
        let processor = self.processor.get_mut().unwrap_or_else(|e| e.into_inner());
        for l in processor.listeners.drain(..) {
            l.stop_thread();
        }
        processor.shutdown();
    }
}

/// Errors when registering a handler.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InformerError {
    /// The thread that delivers to handlers could not be started.
    #[error("cannot start a delivery thread for handler {name}: {source}")]
    Thread {
        /// The handler's name.
        name: String,
        /// Why.
        source: std::io::Error,
    },
    /// The informer has stopped ([`run`](SharedIndexInformer::run) has ended): a handler
    /// added now would never hear of a change (client-go refuses it too).
    #[error("handler not added to informer {informer}: it has stopped already")]
    Stopped {
        /// The informer's name.
        informer: String,
    },
    /// An index operation failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl<T: Send + Sync + 'static> SharedIndexInformer<T> {
    /// An informer over `source`. Nothing happens until [`run`](Self::run).
    pub fn new(source: impl ListerWatcher<T>, options: InformerOptions<T>) -> Self {
        let indexer = match options.compact {
            Some(codec) => Indexer::compact_with(options.indexers, codec),
            None => Indexer::new(options.indexers),
        };
        let known = Arc::new(indexer.clone());
        let moved = Arc::new(Notify::new());
        let queue = match options.processing {
            Processing::Atomic => {
                let fifo = RealFifo::new(known);
                fifo.notify_applied(moved.clone());
                Queue::Atomic(Arc::new(fifo))
            }
            Processing::DeltaFifo => {
                let fifo = DeltaFifo::new(Some(known));
                fifo.notify_applied(moved.clone());
                Queue::DeltaFifo(Arc::new(fifo))
            }
        };
        let source: Arc<dyn ListerWatcher<T>> = Arc::new(source);
        let (source, snapshots) = with_snapshots(source, options.snapshot, options.processing);
        let default_resync = clamp_resync(options.resync_period);
        SharedIndexInformer {
            shared: Arc::new(Shared {
                indexer,
                queue,
                processor: Mutex::new(Processor::new(&options.name)),
                source,
                transform: options.transform,
                started: AtomicBool::new(false),
                stopped: AtomicBool::new(false),
                default_resync,
                resync_check_period: Mutex::new(default_resync),
                revision: OnceLock::new(),
                watch_error_handler: options.watch_error_handler,
                backoff: options.backoff,
                reconnect: options.reconnect,
                max_handler_backlog: options.max_handler_backlog,
                relist_unchanged: options.relist_unchanged,
                next_id: AtomicU64::new(0),
                apply_panics: AtomicU64::new(0),
                metrics: InformerMetrics::new(&options.name),
                received_at: Arc::default(),
                audit_period: options.audit_period,
                audit: Arc::default(),
                auditor: OnceLock::new(),
                snapshots,
                incomplete: AtomicBool::new(false),
                moved,
                name: options.name,
            }),
        }
    }

    pub(super) fn processor(&self) -> MutexGuard<'_, Processor<T>> {
        refuse_in_inline_handler(self.owner(), "a handler registration");
        lock(&self.shared.processor)
    }

    /// Identifies this informer to its inline handlers' guard.
    pub(super) fn owner(&self) -> usize {
        Arc::as_ptr(&self.shared) as *const () as usize
    }

    /// Runs the informer: lists, watches and delivers until [`stop`](Self::stop) or until the
    /// future is dropped. A second call returns at once.
    pub async fn run(self) {
        if self.shared.started.swap(true, Ordering::AcqRel) {
            tracing::warn!(informer = %self.shared.name, "informer already started");
            return;
        }
        let source = self.shared.source.clone();
        // What the informer cannot do over this source, said once: a wrapper that forgot to
        // forward the capabilities of the source it wraps shows here.
        let lacking = source.capabilities().lacking();
        let auditable = source.capabilities().key_revisions.is_some();
        if !lacking.is_empty() {
            tracing::info!(informer = %self.shared.name, lacking = %lacking.join("; "), "the source lacks capabilities");
        }
        let resync_period = *lock(&self.shared.resync_check_period);
        let weak = Arc::downgrade(&self.shared);
        let should_resync = Arc::new(move || {
            weak.upgrade()
                .is_some_and(|shared| SharedIndexInformer { shared }.should_resync())
        });
        let reflector = ReflectorOptions {
            name: self.shared.name.clone(),
            resync_period,
            should_resync: Some(should_resync),
            watch_error_handler: self.shared.watch_error_handler.clone(),
            backoff: self.shared.backoff.clone(),
            reconnect: self.shared.reconnect.clone(),
        };
        // However `run` ends (stopped, or its future dropped), let each handler finish its
        // backlog and end, instead of waiting forever for events that cannot come.
        let _close_handlers = CloseHandlersOnDrop(self.shared.clone());
        let _sampler = crate::metrics::ENABLED
            .then(|| AbortOnDrop(tokio::spawn(sample_metrics(Arc::downgrade(&self.shared)))));
        let revision = &self.shared.revision;
        match &self.shared.queue {
            Queue::DeltaFifo(fifo) => {
                let this = self.clone();
                let config = ControllerConfig {
                    lister_watcher: source,
                    queue: fifo.clone(),
                    process: Box::new(move |deltas, initial| {
                        this.apply_guarded(|| this.handle_deltas(deltas, initial));
                        Ok(())
                    }),
                    retry_on_error: false,
                    reflector,
                };
                Controller::new(config)
                    .with_transform(self.shared.transform.clone())
                    .run_with(|handle| {
                        let _ = revision.set(handle);
                    })
                    .await;
            }
            Queue::Atomic(fifo) => {
                let span = tracing::info_span!("controller", name = %self.shared.name);
                let mut reflector = Reflector::new(source, fifo.clone(), reflector)
                    .with_transform(self.shared.transform.clone());
                if crate::metrics::ENABLED {
                    reflector = reflector.with_received_at(self.shared.received_at.clone());
                }
                // Only this mode's cache is exactly etcd at one revision, as the audit needs.
                let relist = Arc::new(Notify::new());
                reflector = reflector.with_relist_trigger(relist.clone());
                let _verify = self.verify_warm_start(relist.clone());
                let auditor = self
                    .shared
                    .auditor
                    .get_or_init(|| Arc::new(self.audited(relist)));
                // A source that cannot list its keys at a revision has no audit.
                let _audits = self
                    .shared
                    .audit_period
                    .filter(|_| auditable)
                    .map(|period| {
                        let span = tracing::info_span!("audit", informer = %self.shared.name);
                        AbortOnDrop(tokio::spawn(auditor.clone().every(period).instrument(span)))
                    });
                let _ = revision.set(reflector.revision());
                // The reflector applies what it commits itself while this loop has nothing
                // queued (one task wake-up less per revision); the loop takes the rest.
                let _inline = InlineApplyOnWhileRunning::new(fifo, &self.shared);
                let reflector = AbortOnDrop(tokio::spawn(reflector.run()));
                let _snapshots = self.write_snapshots_periodically();
                async {
                    while fifo
                        .pop(|batch| self.apply_guarded(|| self.handle_batch(batch)))
                        .await
                        .is_ok()
                    {
                        if fifo.is_closed() {
                            // Stop feeding a closed queue so that draining it ends.
                            reflector.0.abort();
                        }
                    }
                }
                .instrument(span)
                .await;
                self.write_snapshot_on_stop().await;
            }
        }
    }

    /// Audits the cache against etcd now, as the periodic audit does
    /// ([`InformerOptions::audit_period`]): etcd's keys and `mod_revision`s at the cache's
    /// revision compared key by key, any difference repaired by a relist. `None` when it could
    /// not (not running in the revision-atomic mode, not synced, a relist under way, changes
    /// queued, the revision compacted, etcd unreachable: the log says which).
    ///
    /// ```no_run
    /// # async fn demo(informer: etcd_informer::SharedIndexInformer<String>) {
    /// if let Some(report) = informer.audit_now().await {
    ///     println!("{} keys audited at {}: {} differed", report.keys, report.revision, report.differing);
    /// }
    /// # }
    /// ```
    pub async fn audit_now(&self) -> Option<AuditReport> {
        let auditor = self.shared.auditor.get()?.clone();
        auditor.once().await
    }

    /// What the audit task needs: the cache, the source, and when it may audit.
    fn audited(&self, relist: Arc<Notify>) -> Audited<T> {
        let weak = Arc::downgrade(&self.shared);
        Audited {
            name: self.shared.name.clone(),
            cached: {
                let indexer = self.shared.indexer.clone();
                Box::new(move || indexer.key_revisions())
            },
            source: self.shared.source.clone(),
            metrics: AuditMetrics::new(&self.shared.name),
            counts: self.shared.audit.clone(),
            ready: Box::new(move || {
                let health = SharedIndexInformer {
                    shared: weak.upgrade()?,
                }
                .health();
                let quiet = health.synced
                    && health.reflector.connected
                    && health.last_synced_revision == health.revision;
                quiet.then_some(health.reflector.relists.total())
            }),
            relist,
            asked_at: Mutex::new(None),
            running: tokio::sync::Mutex::new(()),
        }
    }

    /// Stops the informer: the reflector stops, and [`run`](Self::run) returns once what is
    /// queued is applied; handlers then finish their backlogs and their threads end.
    pub fn stop(&self) {
        self.shared.queue.close();
    }

    /// Picks the handlers whose resync is due; the reflector resyncs only if there are any.
    fn should_resync(&self) -> bool {
        // Before the processor lock: popping holds the queue's lock, then takes the processor's.
        // Only the reflector, which is asking, queues resyncs, so an empty queue stays free of
        // them until it answers.
        let drained = match &self.shared.queue {
            Queue::Atomic(q) => q.is_empty(),
            Queue::DeltaFifo(q) => q.is_empty(),
        };
        let mut processor = self.processor();
        let now = Instant::now();
        let due: Vec<u64> = processor
            .listeners
            .iter()
            .filter(|l| l.take_resync(now))
            .map(|l| l.id)
            .collect();
        if due.is_empty() {
            // Keep the set of the last resync: its Sync deltas may still be queued.
            return false;
        }
        merge_due(&mut processor.syncing, due, drained);
        true
    }

    /// Whether the first list has been fully applied to the cache.
    pub fn has_synced(&self) -> bool {
        refuse_in_inline_handler(self.owner(), "has_synced");
        self.shared.queue.has_synced()
    }

    /// Waits until [`has_synced`](Self::has_synced). Cancel it by dropping the future (for
    /// example with `tokio::time::timeout` or `tokio::select!`).
    pub async fn wait_for_cache_sync(&self) {
        wait_until(|| self.has_synced()).await
    }

    /// The cache, with its indexes.
    pub fn indexer(&self) -> &Indexer<T> {
        &self.shared.indexer
    }

    /// Typed read access to the cache.
    pub fn lister(&self) -> Lister<T> {
        Lister::new(self.shared.indexer.clone())
    }

    /// Adds indexes, indexing what is cached already. Fails if one of that name exists.
    pub fn add_indexers(&self, indexers: Indexers<T>) -> Result<(), InformerError> {
        // Under the processor lock, so no delta is applied half-indexed.
        let _processor = self.processor();
        Ok(self.shared.indexer.add_indexers(indexers)?)
    }

    /// Adds the index `name` (see [`InformerOptions::with_index`], the way to give it before
    /// the informer runs), indexing what is cached already. Fails if one of that name exists.
    pub fn add_index(
        &self,
        name: impl Into<String>,
        index: impl Fn(&crate::object::Object<T>) -> Vec<String> + Send + Sync + 'static,
    ) -> Result<(), InformerError> {
        let index = crate::store::IndexFunc::new(index);
        self.add_indexers(Indexers::from([(name.into(), index)]))
    }

    /// The revision the reflector has read and queued up to (client-go's
    /// `LastSyncResourceVersion`); 0 before the first list. The cache reaches it once the
    /// queued changes are applied.
    pub fn last_synced_revision(&self) -> i64 {
        self.shared.revision.get().map_or(0, RevisionHandle::get)
    }

    /// The revision the cache is at. In the [`Processing::Atomic`] mode the cache holds exactly
    /// the source's content at this revision (as the codec and transform see it); in the
    /// [`Processing::DeltaFifo`] mode it holds every change up to it, and maybe some later
    /// ones. 0 before the first list. Unlike [`last_synced_revision`](Self::last_synced_revision)
    /// (what the reflector has read and queued), this is what readers of the cache see.
    pub fn revision(&self) -> i64 {
        match &self.shared.queue {
            Queue::Atomic(_) => self.shared.indexer.revision(),
            Queue::DeltaFifo(fifo) => fifo.applied_revision(),
        }
    }

    /// The latest revision at which etcd's content under the prefix is known to be the
    /// cache's: [`revision`](Self::revision), or later while the proof of a consistent read
    /// holds (the source showed nothing changed since). Falls back to `revision` when the
    /// cache next changes: a proof lets a consistent read return, but never moves `revision`
    /// past changes still on their way (a key put and deleted in between leaves no trace in
    /// the proof, yet its put is applied afterwards).
    pub fn proven_revision(&self) -> i64 {
        match &self.shared.queue {
            Queue::Atomic(_) => self.shared.indexer.proven_revision(),
            // A proof made before a relist that is still on its way (the old store's, after
            // a wipe) proves nothing of the new content.
            Queue::DeltaFifo(fifo) if fifo.relist_pending() => fifo.applied_revision(),
            Queue::DeltaFifo(fifo) => fifo
                .applied_revision()
                .max(self.shared.indexer.proven_revision()),
        }
    }

    /// The cache's revision and size, read so that the size is no older than the revision, and
    /// the count of writes to the cache as of that moment or earlier (see [`Self::prove`]).
    pub(super) fn revision_len_and_writes(&self) -> (i64, usize, u64) {
        match &self.shared.queue {
            Queue::Atomic(_) => self.shared.indexer.revision_len_and_writes(),
            Queue::DeltaFifo(fifo) => {
                // Writes first: a change applied after it is read voids the proof.
                let writes = self.shared.indexer.writes();
                (fifo.applied_revision(), self.shared.indexer.len(), writes)
            }
        }
    }

    /// Records that the source proved the cache, as it was after `writes` writes, to be its
    /// content at `revision`; false if the cache changed since.
    pub(super) fn prove(&self, writes: u64, revision: i64) -> bool {
        let proven = self.shared.indexer.prove(writes, revision);
        if proven {
            self.shared.moved.notify_waiters();
        }
        proven
    }

    /// Whether [`run`](Self::run) has been called.
    pub fn has_started(&self) -> bool {
        self.shared.started.load(Ordering::Acquire)
    }

    /// Whether [`run`](Self::run) has ended (client-go's `IsStopped`): handlers can no longer
    /// be added.
    pub fn is_stopped(&self) -> bool {
        self.shared.stopped.load(Ordering::Acquire)
    }

    /// The informer's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }
}

/// The source and snapshot state of an informer (warm restart, issue 26): with snapshots on,
/// the source is wrapped so that its first list may come from the snapshot. Only the
/// revision-atomic mode's cache is etcd at one revision, which a snapshot must be.
fn with_snapshots<T: Send + Sync + 'static>(
    source: Arc<dyn ListerWatcher<T>>,
    options: Option<crate::snapshot::SnapshotOptions<T>>,
    processing: Processing,
) -> (Arc<dyn ListerWatcher<T>>, Option<Snapshots<T>>) {
    let Some(options) = options else {
        return (source, None);
    };
    let start = Arc::new(OnceLock::new());
    let source = match processing {
        Processing::Atomic => Arc::new(WarmSource::new(source, options.clone(), start.clone())),
        Processing::DeltaFifo => {
            let reason = "snapshots need Processing::Atomic (a DeltaFifo cache is not etcd at one revision); none read or written";
            tracing::warn!(path = %options.path.display(), "cold start: {reason}");
            let _ = start.set(SnapshotStart::Cold {
                reason: reason.into(),
            });
            source
        }
    };
    let snapshots = Snapshots {
        options,
        start,
        written: tokio::sync::Mutex::new(0),
    };
    (source, Some(snapshots))
}

/// Marks the informer stopped and closes its handlers when dropped.
struct CloseHandlersOnDrop<T>(Arc<Shared<T>>);

impl<T> Drop for CloseHandlersOnDrop<T> {
    fn drop(&mut self) {
        self.0.stopped.store(true, Ordering::Release);
        // Consistent reads waiting for the cache end now, not at their timeouts.
        self.0.moved.notify_waiters();
        let processor = lock(&self.0.processor);
        for l in &processor.listeners {
            l.close();
        }
    }
}

/// Lets a [`RealFifo`]'s producer apply revisions for the informer while `run` runs (see
/// `RealFifo::set_inline`), and stops it when dropped.
struct InlineApplyOnWhileRunning<T: Send + Sync + 'static>(Arc<RealFifo<T>>);

impl<T: Send + Sync + 'static> InlineApplyOnWhileRunning<T> {
    fn new(fifo: &Arc<RealFifo<T>>, shared: &Arc<Shared<T>>) -> Self {
        // Weak: the queue belongs to the informer, which must not own itself through it.
        let shared = Arc::downgrade(shared);
        fifo.set_inline(Some(Arc::new(move |batch| {
            if let Some(shared) = shared.upgrade() {
                let this = SharedIndexInformer { shared };
                this.apply_guarded(|| this.handle_batch(batch));
            }
        })));
        InlineApplyOnWhileRunning(fifo.clone())
    }
}

impl<T: Send + Sync + 'static> Drop for InlineApplyOnWhileRunning<T> {
    fn drop(&mut self) {
        self.0.set_inline(None);
    }
}

/// Polls `cond` until it holds. Polling (every 10 ms, as client-go polls every 100 ms) keeps
/// every "synced" condition cheap to evaluate and free of extra wake-up machinery.
pub(crate) async fn wait_until(cond: impl Fn() -> bool) {
    while !cond() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// How often an informer samples the gauges of its [metrics](crate::metrics) (revisions, queue
/// depth, decode errors).
const METRICS_SAMPLE_PERIOD: Duration = Duration::from_secs(1);

/// Publishes an informer's sampled [metrics](crate::metrics) every second while it runs (and
/// it exists).
async fn sample_metrics<T: Send + Sync + 'static>(shared: Weak<Shared<T>>) {
    let mut tick = tokio::time::interval(METRICS_SAMPLE_PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let queued = match &shared.queue {
            Queue::Atomic(q) => q.len(),
            Queue::DeltaFifo(q) => q.len(),
        };
        let decode_errors = shared.source.decode_errors();
        let informer = SharedIndexInformer { shared };
        informer.shared.metrics.sample(
            informer.revision(),
            informer.last_synced_revision(),
            queued,
            decode_errors,
            informer.health().reflector.seconds_since_proven_fresh(),
        );
    }
}
