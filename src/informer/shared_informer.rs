//! The shared informer: one cache and one watch, any number of handlers.

use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;
use tokio_stream::Stream;
use tracing::Instrument;

use super::controller::{AbortOnDrop, Controller, ControllerConfig};
use super::handler::{Event, ResourceEventHandler};
use super::processor::{merge_due, Listener, Processor};
use crate::codec::Codec;
use crate::delta_fifo::DeltaFifo;
use crate::listwatch::{Error as SourceError, Freshness, ListerWatcher};
use crate::metrics::{EventKind, InformerMetrics};
use crate::queue::{DeletedObject, Delta, DeltaType, MAX_RESYNC_PERIOD, MIN_RESYNC_PERIOD};
use crate::real_fifo::{Batch, RealFifo};
use crate::reflector::{
    Backoff, Health, Reflector, ReflectorOptions, RevisionHandle, WatchErrorHandler,
};
use crate::store::{Indexer, Indexers, StoreContent, StoreError, Txn};
use crate::{Lister, Object};

pub use crate::reflector::TransformFn;

/// The backlog bound of an [`EventStream`] when [`InformerOptions::max_handler_backlog`] is
/// `None`: a stream's consumer is async code that usually keeps up, so 1024 pending events is
/// far more than it needs in bursts, and at about 100 bytes each it keeps a sleeping consumer
/// to around 100 KB plus the objects (beyond that, events merge per key).
pub const DEFAULT_STREAM_BACKLOG: usize = 1024;

/// How often an informer samples the gauges of its [metrics](crate::metrics) (revisions, queue
/// depth, decode errors).
const METRICS_SAMPLE_PERIOD: Duration = Duration::from_secs(1);

/// How long [`SharedIndexInformer::remove_event_handler`] waits at most for the handler to
/// return from a notification in progress.
pub const REMOVE_PATIENCE: Duration = Duration::from_secs(10);

/// How an informer moves changes from the watch into its cache.
///
/// | | [`Atomic`](Processing::Atomic) (default) | [`DeltaFifo`](Processing::DeltaFifo) |
/// | --- | --- | --- |
/// | queue | [`RealFifo`]: every change in order, one batch per revision | [`DeltaFifo`]: one slot per key, changes coalesced |
/// | a reader of the cache sees | etcd at [`SharedIndexInformer::revision`], never part of a transaction | each key at some revision; a transaction can be seen half applied |
/// | handlers see across keys | etcd's order | first-changed key first |
/// | [`revision`](SharedIndexInformer::revision) | exact | a lower bound |
///
/// Atomic is the default because its guarantee is the stronger one at no measured cost
/// (BENCHMARKS.md compares both). The DeltaFifo mode is the seed's and client-go's classic
/// pipeline; the `reflector` and `controller` examples use a `DeltaFifo` by hand.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Processing {
    /// Revision-atomic, in-order processing (client-go's `RealFIFO` with batch pop).
    #[default]
    Atomic,
    /// Per-key processing through a [`DeltaFifo`].
    DeltaFifo,
}

/// An informer's health; see [`SharedIndexInformer::health`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InformerHealth {
    /// `run` is running.
    pub running: bool,
    /// The first list has been applied.
    pub synced: bool,
    /// The cache's revision ([`SharedIndexInformer::revision`]).
    pub revision: i64,
    /// The revision the reflector has read up to.
    pub last_synced_revision: i64,
    /// Changes whose application to the cache panicked.
    pub apply_panics: u64,
    /// The reflector's connection, last error, relists and restarts.
    pub reflector: Health,
}

impl InformerHealth {
    /// Running, synced and connected to etcd: the cache follows etcd.
    pub fn is_healthy(&self) -> bool {
        self.running && self.synced && self.reflector.connected
    }
}

/// Why a consistent read or [`SharedIndexInformer::wait_for_revision`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsistencyError {
    /// The cache did not reach the revision in time.
    #[error("informer {informer}: the cache did not reach revision {revision} within {waited:?} (it is at {applied})")]
    Timeout {
        /// The informer's name.
        informer: String,
        /// The revision waited for.
        revision: i64,
        /// The revision the cache had reached.
        applied: i64,
        /// How long it waited.
        waited: Duration,
    },
    /// The source could not be asked for its revision (etcd unreachable, for example).
    #[error("informer {informer}: cannot read the current revision: {source}")]
    Source {
        /// The informer's name.
        informer: String,
        /// What the source said.
        #[source]
        source: SourceError,
    },
}

/// Options of a [`SharedIndexInformer`].
#[non_exhaustive]
pub struct InformerOptions<T> {
    /// A name for logs, spans and handler threads (the etcd prefix, usually).
    pub name: String,
    /// The resync period of handlers added without one; zero for none.
    pub resync_period: Duration,
    /// The indexes of the cache. The default has the namespace index.
    pub indexers: Indexers<T>,
    /// Applied to every object before it is cached.
    pub transform: Option<TransformFn<T>>,
    /// Past this many pending notifications a handler's backlog is merged per key, so it stays
    /// bounded by the number of keys while every key's final state is still delivered. `None`:
    /// every notification is delivered, however far behind the handler falls; an
    /// [`event_stream`](SharedIndexInformer::event_stream) is bounded anyway, at
    /// [`DEFAULT_STREAM_BACKLOG`].
    pub max_handler_backlog: Option<usize>,
    /// Called with every list or watch failure.
    pub watch_error_handler: Option<WatchErrorHandler>,
    /// The reflector's protective backoff: relists close together, and retries after etcd
    /// answered with an error (default: client-go's 800 ms doubling to 30 s, reset after 2 min).
    pub backoff: Backoff,
    /// The reflector's delays between attempts to reach an etcd that does not answer
    /// (default [`Backoff::reconnect`]: 50 ms doubling to 1 s).
    pub reconnect: Backoff,
    /// How changes reach the cache; see [`Processing`].
    pub processing: Processing,
    /// `Some`: the cache is compact ([`Indexer::compact`]): it keeps each object packed, its
    /// value encoded by this codec, and decodes it on every read. Handlers still get the
    /// decoded objects as they arrive; the cost is an encode and a decode per change, a decode
    /// per read, and one more per update or delete (the old object handed to handlers). Reads
    /// see values as they come back from the codec. Best with the default [`Processing`].
    pub compact: Option<Arc<dyn Codec<T>>>,
}

impl<T> InformerOptions<T> {
    /// Sets the name for logs, spans and handler threads (`name`).
    #[must_use]
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Sets the default resync period of handlers (zero for none) (`resync_period`).
    #[must_use]
    pub fn with_resync_period(mut self, resync_period: Duration) -> Self {
        self.resync_period = resync_period;
        self
    }

    /// Sets the indexes of the cache (`indexers`).
    #[must_use]
    pub fn with_indexers(mut self, indexers: Indexers<T>) -> Self {
        self.indexers = indexers;
        self
    }

    /// Sets the function applied to every object before it is cached (`transform`).
    #[must_use]
    pub fn with_transform(mut self, transform: Option<TransformFn<T>>) -> Self {
        self.transform = transform;
        self
    }

    /// Sets the backlog past which a handler's notifications are merged per key (`max_handler_backlog`).
    #[must_use]
    pub fn with_max_handler_backlog(mut self, max_handler_backlog: Option<usize>) -> Self {
        self.max_handler_backlog = max_handler_backlog;
        self
    }

    /// Sets the handler called with every list or watch failure (`watch_error_handler`).
    #[must_use]
    pub fn with_watch_error_handler(
        mut self,
        watch_error_handler: Option<WatchErrorHandler>,
    ) -> Self {
        self.watch_error_handler = watch_error_handler;
        self
    }

    /// Sets the reflector's protective backoff (`backoff`).
    #[must_use]
    pub fn with_backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Sets the reflector's delays between attempts to reach etcd (`reconnect`).
    #[must_use]
    pub fn with_reconnect(mut self, reconnect: Backoff) -> Self {
        self.reconnect = reconnect;
        self
    }

    /// Sets how changes reach the cache (`processing`).
    #[must_use]
    pub fn with_processing(mut self, processing: Processing) -> Self {
        self.processing = processing;
        self
    }

    /// Makes the cache compact, its values packed with `codec` (`compact`): a fifth to a
    /// seventh of the memory for a decode on every read (BENCHMARKS.md).
    ///
    /// ```
    /// use etcd_informer::codec::JsonCodec;
    /// use etcd_informer::InformerOptions;
    /// let options = InformerOptions::<serde_json::Value>::default()
    ///     .with_compact_cache(JsonCodec::new());
    /// assert!(options.compact.is_some());
    /// ```
    #[must_use]
    pub fn with_compact_cache(mut self, codec: impl Codec<T>) -> Self {
        self.compact = Some(Arc::new(codec));
        self
    }
}

impl<T: Send + Sync + 'static> Default for InformerOptions<T> {
    fn default() -> Self {
        InformerOptions {
            name: "informer".into(),
            resync_period: Duration::ZERO,
            indexers: crate::store::namespace_indexers(),
            transform: None,
            max_handler_backlog: None,
            watch_error_handler: None,
            backoff: Backoff::default(),
            reconnect: Backoff::reconnect(),
            processing: Processing::default(),
            compact: None,
        }
    }
}

impl<T> fmt::Debug for InformerOptions<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InformerOptions")
            .field("name", &self.name)
            .field("resync_period", &self.resync_period)
            .field("indexers", &self.indexers.keys().collect::<Vec<_>>())
            .field("max_handler_backlog", &self.max_handler_backlog)
            .field("processing", &self.processing)
            .field("compact", &self.compact.is_some())
            .finish_non_exhaustive()
    }
}

/// A cache of a source kept current by one list-and-watch, shared by any number of handlers
/// (client-go's `SharedIndexInformer`).
///
/// Guarantees:
/// - the cache is updated before any handler hears of the change;
/// - each handler receives one key's changes in revision order; across keys, in the order the
///   DeltaFIFO hands keys out (first changed, first delivered);
/// - each handler has its own backlog ([`HandlerRegistration::backlog`]); handlers share a
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
    shared: Arc<Shared<T>>,
}

impl<T> Clone for SharedIndexInformer<T> {
    fn clone(&self) -> Self {
        SharedIndexInformer {
            shared: self.shared.clone(),
        }
    }
}

/// The informer's queue, by [`Processing`] mode.
enum Queue<T> {
    Atomic(Arc<RealFifo<T>>),
    DeltaFifo(Arc<DeltaFifo<T>>),
}

impl<T: Send + Sync + 'static> Queue<T> {
    fn has_synced(&self) -> bool {
        match self {
            Queue::Atomic(q) => q.has_synced(),
            Queue::DeltaFifo(q) => q.has_synced(),
        }
    }

    fn close(&self) {
        match self {
            Queue::Atomic(q) => q.close(),
            Queue::DeltaFifo(q) => q.close(),
        }
    }
}

struct Shared<T> {
    name: String,
    indexer: Indexer<T>,
    queue: Queue<T>,
    processor: Mutex<Processor<T>>,
    source: Arc<dyn ListerWatcher<T>>,
    /// Applied by the reflector to everything the source yields.
    transform: Option<TransformFn<T>>,
    started: AtomicBool,
    /// Set once `run` has ended: handlers get what is queued, then their threads end.
    stopped: AtomicBool,
    default_resync: Duration,
    resync_check_period: Mutex<Duration>,
    revision: OnceLock<RevisionHandle>,
    watch_error_handler: Option<WatchErrorHandler>,
    backoff: Backoff,
    reconnect: Backoff,
    max_handler_backlog: Option<usize>,
    next_id: AtomicU64,
    /// Batches whose application panicked.
    apply_panics: AtomicU64,
    metrics: InformerMetrics,
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

/// A handle on a registered handler (client-go's `ResourceEventHandlerRegistration`).
pub struct HandlerRegistration<T> {
    listener: Arc<Listener<T>>,
    informer: Weak<Shared<T>>,
}

impl<T> fmt::Debug for HandlerRegistration<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerRegistration")
            .field("id", &self.listener.id)
            .field("name", &self.listener.name)
            .finish()
    }
}

impl<T: Send + Sync + 'static> HandlerRegistration<T> {
    /// Whether the informer has synced and this handler has received every initial add.
    pub fn has_synced(&self) -> bool {
        self.informer
            .upgrade()
            .is_some_and(|s| s.queue.has_synced() && self.listener.initial_delivered())
    }

    /// Notifications queued for this handler and not yet delivered.
    pub fn backlog(&self) -> usize {
        self.listener.backlog()
    }

    /// Notifications delivered to this handler so far.
    pub fn delivered(&self) -> u64 {
        self.listener.delivered()
    }

    /// Notifications whose handling panicked.
    pub fn panics(&self) -> u64 {
        self.listener.panics()
    }

    /// The handler's resync period as in effect (zero: never): the one asked for, raised to
    /// [`MIN_RESYNC_PERIOD`], and, for a handler added once the informer ran, to its resync
    /// check period.
    pub fn resync_period(&self) -> Duration {
        self.listener.resync_period
    }
}

impl<T: Send + Sync + 'static> SharedIndexInformer<T> {
    /// An informer over `source`. Nothing happens until [`run`](Self::run).
    pub fn new(source: impl ListerWatcher<T>, options: InformerOptions<T>) -> Self {
        let indexer = match options.compact {
            Some(codec) => Indexer::compact_with(options.indexers, codec),
            None => Indexer::new(options.indexers),
        };
        let known = Arc::new(indexer.clone());
        let queue = match options.processing {
            Processing::Atomic => Queue::Atomic(Arc::new(RealFifo::new(known))),
            Processing::DeltaFifo => Queue::DeltaFifo(Arc::new(DeltaFifo::new(Some(known)))),
        };
        let source: Arc<dyn ListerWatcher<T>> = Arc::new(source);
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
                next_id: AtomicU64::new(0),
                apply_panics: AtomicU64::new(0),
                metrics: InformerMetrics::new(&options.name),
                name: options.name,
            }),
        }
    }

    fn processor(&self) -> MutexGuard<'_, Processor<T>> {
        self.shared
            .processor
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a handler with the informer's default resync period.
    pub fn add_event_handler(
        &self,
        handler: impl ResourceEventHandler<T>,
    ) -> Result<HandlerRegistration<T>, InformerError> {
        self.add_event_handler_with_resync(handler, self.shared.default_resync)
    }

    /// Registers a handler named `name` (in logs, its thread's name and its
    /// [metrics](crate::metrics)), with the informer's default resync period.
    pub fn add_named_event_handler(
        &self,
        name: impl Into<String>,
        handler: impl ResourceEventHandler<T>,
    ) -> Result<HandlerRegistration<T>, InformerError> {
        let period = self.resync_period_for(self.shared.default_resync);
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        self.spawn_handler(id, name.into(), handler, period)
    }

    /// Registers a handler that receives a resync every `resync_period` (zero: never; at least
    /// [`MIN_RESYNC_PERIOD`], at most [`MAX_RESYNC_PERIOD`]). Once the informer runs, a period shorter than its resync check
    /// period is raised to it.
    ///
    /// If the cache holds objects already, the handler first receives an add for each (with
    /// `is_in_initial_list` true), then the changes after them. Fails with
    /// [`InformerError::Stopped`] once the informer has stopped.
    pub fn add_event_handler_with_resync(
        &self,
        handler: impl ResourceEventHandler<T>,
        resync_period: Duration,
    ) -> Result<HandlerRegistration<T>, InformerError> {
        if self.is_stopped() {
            return Err(self.stopped_error());
        }
        let period = self.resync_period_for(resync_period);
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let name = format!("{}#{id}", self.shared.name);
        self.spawn_handler(id, name, handler, period)
    }

    fn spawn_handler(
        &self,
        id: u64,
        name: String,
        handler: impl ResourceEventHandler<T>,
        period: Duration,
    ) -> Result<HandlerRegistration<T>, InformerError> {
        let listener = Listener::new(
            id,
            name.clone(),
            &self.shared.name,
            period,
            self.shared.max_handler_backlog,
        );
        self.processor()
            .attach(&listener, Arc::new(handler))
            .map_err(|source| InformerError::Thread { name, source })?;
        self.register(listener)
    }

    /// The resync period a handler asking for `resync_period` gets, lowering the informer's
    /// resync check period to it before the informer starts.
    fn resync_period_for(&self, resync_period: Duration) -> Duration {
        let mut period = clamp_resync(resync_period);
        let mut check = self
            .shared
            .resync_check_period
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if period.is_zero() {
            return period;
        }
        if self.shared.started.load(Ordering::Acquire) {
            if check.is_zero() {
                tracing::warn!(
                    informer = %self.shared.name,
                    requested = ?period,
                    "the informer started without resync; this handler will not be resynced"
                );
            } else if period < *check {
                tracing::warn!(
                    informer = %self.shared.name,
                    requested = ?period,
                    check_period = ?*check,
                    "handler resync period raised to the informer's resync check period"
                );
                period = period.max(*check);
            }
        } else if check.is_zero() || period < *check {
            *check = period;
        }
        period
    }

    /// Adds a listener to the processor, queueing an add for every cached object first.
    fn register(
        &self,
        listener: Arc<Listener<T>>,
    ) -> Result<HandlerRegistration<T>, InformerError> {
        // Holding the processor while listing the cache: no change can be applied between the
        // snapshot and the registration, so there is no gap and no duplicate.
        let mut processor = self.processor();
        // Under the processor lock: `run` ending sets `stopped` before it takes the lock to
        // close the handlers, so a handler registered here is either closed by it or refused.
        if self.is_stopped() {
            drop(processor);
            listener.stop_thread();
            return Err(self.stopped_error());
        }
        listener.push_all(
            self.shared
                .indexer
                .list()
                .into_iter()
                .map(|object| Event::Added {
                    object,
                    is_in_initial_list: true,
                }),
        );
        processor.listeners.push(listener.clone());
        Ok(HandlerRegistration {
            listener,
            informer: Arc::downgrade(&self.shared),
        })
    }

    fn stopped_error(&self) -> InformerError {
        InformerError::Stopped {
            informer: self.shared.name.clone(),
        }
    }

    /// Unregisters a handler; its pending notifications are dropped. Returns once the handler
    /// can no longer be called: if it is handling a notification, when it returns from it (for
    /// at most [`REMOVE_PATIENCE`]; a handler stuck longer is logged and left to finish on its
    /// own). Called from within the handler itself, it returns at once and the handler is not
    /// called again after the notification in progress.
    ///
    /// Returns whether the handler was registered with this informer: a registration of
    /// another informer, or one removed already, is left alone (client-go's no-op).
    ///
    /// It blocks the calling thread while it waits: from async code, use
    /// [`remove_event_handler_async`](Self::remove_event_handler_async).
    pub fn remove_event_handler(&self, registration: &HandlerRegistration<T>) -> bool {
        let removed = self.detach(registration);
        if removed {
            registration.listener.stop_thread_and_wait(REMOVE_PATIENCE);
        }
        removed
    }

    /// [`remove_event_handler`](Self::remove_event_handler) for async code: the wait for a
    /// notification in progress happens on a blocking thread, never on the runtime's.
    pub async fn remove_event_handler_async(&self, registration: &HandlerRegistration<T>) -> bool {
        let removed = self.detach(registration);
        if removed {
            let listener = registration.listener.clone();
            let waited = tokio::task::spawn_blocking(move || {
                listener.stop_thread_and_wait(REMOVE_PATIENCE);
            });
            let _ = waited.await;
        }
        removed
    }

    /// Unregisters a handler and stops its delivery without waiting for a notification in
    /// progress; for `Drop` impls, which may run on a runtime thread and must not block it.
    pub(crate) fn detach(&self, registration: &HandlerRegistration<T>) -> bool {
        if !std::ptr::eq(registration.informer.as_ptr(), Arc::as_ptr(&self.shared)) {
            return false;
        }
        let mut processor = self.processor();
        let before = processor.listeners.len();
        processor
            .listeners
            .retain(|l| !Arc::ptr_eq(l, &registration.listener));
        let removed = processor.listeners.len() < before;
        // Not under the processor lock: the handler may be calling into the informer.
        drop(processor);
        if removed {
            registration.listener.stop_thread();
        }
        removed
    }

    /// How many handlers and event streams are registered.
    pub fn handler_count(&self) -> usize {
        self.processor().listeners.len()
    }

    /// The changes as a stream of [`Event`]s, starting with an add for every cached object.
    /// Dropping the stream unregisters it.
    ///
    /// The stream's buffer is bounded: past [`InformerOptions::max_handler_backlog`] pending
    /// events ([`DEFAULT_STREAM_BACKLOG`] if `None`) they are merged per key, as a handler's
    /// backlog is, so a consumer that falls behind costs memory in proportion to the number of
    /// keys, slows nobody else, and still receives every key's final state (intermediate ones
    /// may be skipped). [`EventStream::backlog`] tells how far behind it is.
    pub fn event_stream(&self) -> Result<EventStream<T>, InformerError> {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let listener = Listener::new(
            id,
            format!("{}#{id}", self.shared.name),
            &self.shared.name,
            Duration::ZERO,
            Some(
                self.shared
                    .max_handler_backlog
                    .unwrap_or(DEFAULT_STREAM_BACKLOG),
            ),
        );
        let registration = self.register(listener)?;
        Ok(EventStream {
            registration,
            informer: self.clone(),
        })
    }

    /// Runs the informer: lists, watches and delivers until [`stop`](Self::stop) or until the
    /// future is dropped. A second call returns at once.
    pub async fn run(self) {
        if self.shared.started.swap(true, Ordering::AcqRel) {
            tracing::warn!(informer = %self.shared.name, "informer already started");
            return;
        }
        let source = self.shared.source.clone();
        let resync_period = *self
            .shared
            .resync_check_period
            .lock()
            .unwrap_or_else(|e| e.into_inner());
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
                let reflector = Reflector::new(source, fifo.clone(), reflector)
                    .with_transform(self.shared.transform.clone());
                let _ = revision.set(reflector.revision());
                let reflector = AbortOnDrop(tokio::spawn(reflector.run()));
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
            }
        }
    }

    /// Stops the informer: the reflector stops, and [`run`](Self::run) returns once what is
    /// queued is applied; handlers then finish their backlogs and their threads end.
    pub fn stop(&self) {
        self.shared.queue.close();
    }

    /// Runs `apply` catching a panic (an index function, a bug): it is logged and recorded in
    /// [`health`](Self::health), so it does not end `run` and the cache does not silently
    /// stop; the changes of that batch may be partly applied.
    fn apply_guarded(&self, apply: impl FnOnce()) {
        if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(apply)) {
            let message = crate::reflector::panic_message(&*panic);
            tracing::error!(informer = %self.shared.name, panic = %message, "applying a change to the cache panicked");
            self.shared.apply_panics.fetch_add(1, Ordering::Relaxed);
            if let Some(handle) = self.shared.revision.get() {
                handle.failed(format!(
                    "applying a change to the cache panicked: {message}"
                ));
            }
        }
    }

    /// Applies one key's deltas to the cache, then tells the handlers (client-go's
    /// `HandleDeltas`).
    fn handle_deltas(&self, deltas: &[Delta<T>], is_in_initial_list: bool) {
        let processor = self.processor();
        let events = self.shared.indexer.transaction(|txn| {
            deltas
                .iter()
                .map(|d| apply_delta(txn, d, is_in_initial_list))
                .collect::<Vec<_>>()
        });
        self.distribute(&processor, events);
    }

    /// Counts and hands the notifications of one apply to the handlers, in order.
    fn distribute(&self, processor: &Processor<T>, events: Vec<(Event<T>, bool)>) {
        for (event, is_sync) in events {
            if !is_sync {
                self.shared.metrics.event(event_kind(&event));
            }
            processor.distribute(event, is_sync);
        }
    }

    /// Applies one batch to the cache under one store lock, sets the cache's revision, then
    /// tells the handlers, in order.
    fn handle_batch(&self, batch: Batch<T>) {
        let processor = self.processor();
        let indexer = &self.shared.indexer;
        let events = match batch {
            Batch::Changes { revision, deltas } => indexer.transaction(|txn| {
                let events: Vec<_> = deltas.iter().map(|d| apply_delta(txn, d, false)).collect();
                txn.set_revision(revision.max(txn.revision()));
                events
            }),
            Batch::Replace {
                revision,
                items,
                store_replaced,
                initial,
            } => {
                let items = Arc::try_unwrap(items).unwrap_or_else(|shared| (*shared).clone());
                // Without handlers, only the metrics hear of the changes: no list of a million
                // notifications to build and drop, and no cached object decoded.
                let listening = !processor.listeners.is_empty();
                let metrics = &self.shared.metrics;
                indexer.transaction(|txn| {
                    let mut events = Vec::new();
                    let out = if listening {
                        Replaced::Notify(&mut events)
                    } else {
                        Replaced::Count(metrics)
                    };
                    apply_replace(txn, items, store_replaced, initial, out);
                    // After a wipe the revisions start over; otherwise never go back (a
                    // consistent read may have proven a later revision already).
                    let revision = if store_replaced {
                        revision
                    } else {
                        revision.max(txn.revision())
                    };
                    txn.set_revision(revision);
                    events
                })
            }
            Batch::Resync => indexer.transaction(|txn| {
                let mut events = Vec::new();
                txn.for_each(&mut |o| {
                    let event = Event::Updated {
                        old: o.clone(),
                        new: o,
                    };
                    events.push((event, true));
                });
                events
            }),
            Batch::Progress(revision) => {
                indexer.advance_revision(revision);
                Vec::new()
            }
        };
        self.distribute(&processor, events);
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

    /// Adds indexes, indexing what is cached already.
    pub fn add_indexers(&self, indexers: Indexers<T>) -> Result<(), InformerError> {
        // Under the processor lock, so no delta is applied half-indexed.
        let _processor = self.processor();
        Ok(self.shared.indexer.add_indexers(indexers)?)
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

    /// The cache's revision and size, read so that the size is no older than the revision.
    fn revision_and_len(&self) -> (i64, usize) {
        match &self.shared.queue {
            Queue::Atomic(_) => self.shared.indexer.revision_and_len(),
            Queue::DeltaFifo(fifo) => (fifo.applied_revision(), self.shared.indexer.len()),
        }
    }

    /// Records that the source proved the cache is its content at `revision`.
    fn advance_revision(&self, revision: i64) {
        match &self.shared.queue {
            Queue::Atomic(_) => self.shared.indexer.advance_revision(revision),
            Queue::DeltaFifo(fifo) => fifo.advance_applied(revision),
        }
    }

    /// Asks the source whether the cache is its content at `at` (or now).
    async fn freshness(&self, at: Option<i64>) -> Result<Freshness, ConsistencyError> {
        let (since, cached) = self.revision_and_len();
        let fresh = self
            .shared
            .source
            .freshness(since, cached, at)
            .await
            .map_err(|source| ConsistencyError::Source {
                informer: self.shared.name.clone(),
                source,
            })?;
        // Only a synced cache can be the source's content.
        if fresh.unchanged && self.has_synced() {
            self.advance_revision(fresh.revision);
        }
        Ok(fresh)
    }

    /// Waits until the cache reflects the source at `revision` or later: its [`revision`]
    /// reaches it, or the source shows that nothing under the prefix changed between the
    /// cache's revision and `revision` (one read per change of the cache's revision, so a quiet
    /// prefix on a busy etcd is answered at once, on every etcd version). Fails after
    /// `timeout`, or when the source cannot be read; cancel it by dropping the future.
    ///
    /// Use it with the revision a write returned
    /// ([`TypedClient`](crate::client::TypedClient)) to read your own writes.
    ///
    /// [`revision`]: Self::revision
    pub async fn wait_for_revision(
        &self,
        revision: i64,
        timeout: Duration,
    ) -> Result<(), ConsistencyError> {
        let started = Instant::now();
        let deadline = started + timeout;
        let mut asked_at = None;
        loop {
            let applied = self.revision();
            if applied >= revision && self.has_synced() {
                return Ok(());
            }
            if asked_at != Some(applied) && self.has_synced() {
                asked_at = Some(applied);
                let ask = tokio::time::timeout_at(deadline, self.freshness(Some(revision)));
                match ask.await {
                    Ok(Ok(fresh)) if fresh.unchanged => return Ok(()),
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => return Err(e),
                    Err(_elapsed) => {}
                }
            }
            if Instant::now() >= deadline {
                return Err(ConsistencyError::Timeout {
                    informer: self.shared.name.clone(),
                    revision,
                    applied: self.revision(),
                    waited: started.elapsed(),
                });
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// A lister that reads the cache only once it is at least as fresh as etcd is now: one
    /// linearizable read gives etcd's current revision (and, for a prefix that did not change
    /// since the cache's revision, proves the cache current at once), then it waits as
    /// [`wait_for_revision`](Self::wait_for_revision) does. Kubernetes' consistent reads from
    /// the watch cache (KEP-2340), over etcd.
    ///
    /// ```no_run
    /// # async fn demo(informer: etcd_informer::SharedIndexInformer<String>) -> Result<(), Box<dyn std::error::Error>> {
    /// let lister = informer.consistent_lister(std::time::Duration::from_secs(3)).await?;
    /// println!("{} objects as of now", lister.list().len());
    /// # Ok(()) }
    /// ```
    pub async fn consistent_lister(
        &self,
        timeout: Duration,
    ) -> Result<Lister<T>, ConsistencyError> {
        let started = Instant::now();
        let current = tokio::time::timeout(timeout, self.freshness(None))
            .await
            .map_err(|_| ConsistencyError::Source {
                informer: self.shared.name.clone(),
                source: SourceError::transient(format!("no answer within {timeout:?}")),
            })??;
        if !(current.unchanged && self.has_synced()) {
            let left = timeout.saturating_sub(started.elapsed());
            self.wait_for_revision(current.revision, left).await?;
        }
        Ok(self.lister())
    }

    /// The informer's health, for a readiness probe: fail it unless
    /// [`InformerHealth::is_healthy`], rather than serve a cache that stopped changing.
    ///
    /// ```no_run
    /// # fn demo(informer: etcd_informer::SharedIndexInformer<String>) {
    /// let health = informer.health();
    /// if !health.is_healthy() {
    ///     eprintln!("not ready: {:?}", health.reflector.last_error);
    /// }
    /// # }
    /// ```
    pub fn health(&self) -> InformerHealth {
        InformerHealth {
            running: self.has_started() && !self.shared.stopped.load(Ordering::Acquire),
            synced: self.has_synced(),
            revision: self.revision(),
            last_synced_revision: self.last_synced_revision(),
            apply_panics: self.shared.apply_panics.load(Ordering::Relaxed),
            reflector: self
                .shared
                .revision
                .get()
                .map(RevisionHandle::health)
                .unwrap_or_default(),
        }
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

/// Applies one delta to the store; returns the notification and whether it is a resync (for
/// due handlers only).
fn apply_delta<T>(
    txn: &mut Txn<'_, T>,
    d: &Delta<T>,
    is_in_initial_list: bool,
) -> (Event<T>, bool) {
    match d.kind {
        DeltaType::Deleted => {
            txn.delete(d.object.key());
            let deleted = d
                .deleted
                .clone()
                .unwrap_or_else(|| DeletedObject::Deleted(d.object.clone()));
            (Event::Deleted(deleted), false)
        }
        DeltaType::Added | DeltaType::Updated | DeltaType::Replaced | DeltaType::Sync => {
            match txn.add(d.object.clone()) {
                Some(old) => {
                    let is_sync = d.kind == DeltaType::Sync
                        || (d.kind == DeltaType::Replaced
                            && old.mod_revision == d.object.mod_revision);
                    let event = Event::Updated {
                        old,
                        new: d.object.clone(),
                    };
                    (event, is_sync)
                }
                None => {
                    let event = Event::Added {
                        object: d.object.clone(),
                        is_in_initial_list,
                    };
                    (event, false)
                }
            }
        }
    }
}

fn event_kind<T>(event: &Event<T>) -> EventKind {
    match event {
        Event::Added { .. } => EventKind::Added,
        Event::Updated { .. } => EventKind::Updated,
        Event::Deleted(_) => EventKind::Deleted,
    }
}

/// Where [`apply_replace`] reports what changed.
enum Replaced<'a, T> {
    /// To handlers: every notification, in order.
    Notify(&'a mut Vec<(Event<T>, bool)>),
    /// Only to the metrics: no notification is built, no cached object decoded.
    Count(&'a InformerMetrics),
}

/// Replaces the store's content with a relist and reports the changes: adds, updates (resyncs
/// where the revision is unchanged) and tombstones for the keys that vanished. After a wipe
/// every cached key is retired and every listed one added.
fn apply_replace<T>(
    txn: &mut Txn<'_, T>,
    items: StoreContent<T>,
    store_replaced: bool,
    initial: bool,
    out: Replaced<'_, T>,
) {
    let mut old = txn.install(items);
    match out {
        Replaced::Notify(events) => {
            let tombstone =
                |o: Arc<Object<T>>| (Event::Deleted(DeletedObject::FinalStateUnknown(o)), false);
            if store_replaced {
                old.for_each(&mut |o| events.push(tombstone(o)));
            }
            txn.for_each(&mut |new| {
                let previous = if store_replaced || old.is_empty() {
                    None
                } else {
                    old.take(new.key(), true)
                };
                events.push(match previous {
                    Some((revision, Some(old))) => {
                        let is_sync = revision == new.mod_revision;
                        (Event::Updated { old, new }, is_sync)
                    }
                    _ => {
                        let event = Event::Added {
                            object: new,
                            is_in_initial_list: initial,
                        };
                        (event, false)
                    }
                });
            });
            if !store_replaced {
                old.for_each(&mut |o| events.push(tombstone(o)));
            }
        }
        Replaced::Count(metrics) => {
            let retired_first = if store_replaced { old.len() } else { 0 };
            for _ in 0..retired_first {
                metrics.event(EventKind::Deleted);
            }
            txn.for_each_revision(&mut |key, revision| {
                let previous = if store_replaced || old.is_empty() {
                    None
                } else {
                    old.take(key, false)
                };
                match previous {
                    Some((old_revision, _)) if old_revision == revision => {}
                    Some(_) => metrics.event(EventKind::Updated),
                    None => metrics.event(EventKind::Added),
                }
            });
            if !store_replaced {
                for _ in 0..old.len() {
                    metrics.event(EventKind::Deleted);
                }
            }
        }
    }
}

/// Marks the informer stopped and closes its handlers when dropped.
struct CloseHandlersOnDrop<T>(Arc<Shared<T>>);

impl<T> Drop for CloseHandlersOnDrop<T> {
    fn drop(&mut self) {
        self.0.stopped.store(true, Ordering::Release);
        let processor = self.0.processor.lock().unwrap_or_else(|e| e.into_inner());
        for l in &processor.listeners {
            l.close();
        }
    }
}

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

/// Polls `cond` until it holds. Polling (every 10 ms, as client-go polls every 100 ms) keeps
/// every "synced" condition cheap to evaluate and free of extra wake-up machinery.
pub(crate) async fn wait_until(cond: impl Fn() -> bool) {
    while !cond() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn clamp_resync(period: Duration) -> Duration {
    if period.is_zero() {
        period
    } else {
        period.clamp(MIN_RESYNC_PERIOD, MAX_RESYNC_PERIOD)
    }
}

/// The changes of an informer as a [`Stream`]; see [`SharedIndexInformer::event_stream`].
///
/// The stream ends when the informer stops (after what is buffered) or is dropped.
///
/// ```
/// use etcd_informer::testing::FakeSource;
/// use etcd_informer::{Event, SharedIndexInformer};
/// use tokio_stream::StreamExt;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let source = FakeSource::<String>::new();
/// source.put("a", "1".into());
/// let informer = SharedIndexInformer::new(source.clone(), Default::default());
/// let mut events = informer.event_stream()?;
/// tokio::spawn(informer.clone().run());
/// match events.next().await {
///     Some(Event::Added { object, is_in_initial_list }) => {
///         assert_eq!((object.key(), is_in_initial_list), ("a", true));
///     }
///     other => panic!("expected the initial add, got {other:?}"),
/// }
/// source.put("a", "2".into());
/// assert!(matches!(events.next().await, Some(Event::Updated { .. })));
/// informer.stop();
/// # Ok(()) }
/// ```
pub struct EventStream<T: Send + Sync + 'static> {
    registration: HandlerRegistration<T>,
    informer: SharedIndexInformer<T>,
}

impl<T: Send + Sync + 'static> EventStream<T> {
    /// Whether the informer has synced and every initial add has been taken from the stream.
    pub fn has_synced(&self) -> bool {
        self.registration.has_synced()
    }

    /// Events buffered for the stream and not taken yet (bounded; see
    /// [`SharedIndexInformer::event_stream`]).
    pub fn backlog(&self) -> usize {
        self.registration.backlog()
    }
}

impl<T: Send + Sync + 'static> fmt::Debug for EventStream<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventStream")
            .field("informer", &self.informer.name())
            .field("backlog", &self.backlog())
            .finish()
    }
}

impl<T: Send + Sync + 'static> Stream for EventStream<T> {
    type Item = Event<T>;
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event<T>>> {
        self.registration.listener.poll_next(cx)
    }
}

impl<T: Send + Sync + 'static> Drop for EventStream<T> {
    fn drop(&mut self) {
        // Never blocks: a stream has no delivery thread to wait for, and a drop may run on a
        // runtime thread.
        self.informer.detach(&self.registration);
    }
}
