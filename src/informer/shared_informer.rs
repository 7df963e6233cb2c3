//! The shared informer: one cache and one watch, any number of handlers.

use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::{Stream, StreamExt};

use super::controller::{Controller, ControllerConfig};
use super::handler::{DeletedObject, Event, ResourceEventHandler};
use super::processor::Listener;
use crate::delta_fifo::{Delta, DeltaFifo, DeltaType};
use crate::listwatch::{BoxFuture, ListResult, ListerWatcher, WatchEvent, WatchStream};
use crate::reflector::{Backoff, ReflectorOptions, RevisionHandle, WatchErrorHandler};
use crate::store::{Indexer, Indexers, StoreError};
use crate::{Lister, Object};

/// Rewrites each object before it is cached (client-go's `TransformFunc`), e.g. to drop fields
/// the program never reads and save memory.
pub type TransformFn<T> = Arc<dyn Fn(Object<T>) -> Object<T> + Send + Sync>;

/// The shortest resync period honoured (client-go's `minimumResyncPeriod`).
pub const MIN_RESYNC_PERIOD: Duration = Duration::from_secs(1);

/// Options of a [`SharedIndexInformer`].
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
    /// every notification is delivered, however far behind the handler falls.
    pub max_handler_backlog: Option<usize>,
    /// Called with every list or watch failure.
    pub watch_error_handler: Option<WatchErrorHandler>,
    /// Retry delays of the reflector.
    pub backoff: Backoff,
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
/// - each handler runs on its own thread with its own backlog ([`HandlerRegistration::backlog`]):
///   a slow or stuck handler delays nobody else, nor the cache;
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

struct Shared<T> {
    name: String,
    indexer: Indexer<T>,
    fifo: Arc<DeltaFifo<T>>,
    processor: Mutex<Processor<T>>,
    source: Mutex<Option<Box<dyn ListerWatcher<T>>>>,
    started: AtomicBool,
    /// Set once `run` has ended: handlers get what is queued, then their threads end.
    stopped: AtomicBool,
    default_resync: Duration,
    resync_check_period: Mutex<Duration>,
    revision: OnceLock<RevisionHandle>,
    watch_error_handler: Option<WatchErrorHandler>,
    backoff: Backoff,
    max_handler_backlog: Option<usize>,
    next_id: AtomicU64,
}

/// The registered handlers.
///
/// Invariant: `syncing` holds the ids of the listeners whose resync was due at the last resync
/// tick; only they receive `Sync` notifications.
struct Processor<T> {
    listeners: Vec<Arc<Listener<T>>>,
    syncing: Vec<u64>,
}

impl<T: Send + Sync + 'static> Processor<T> {
    fn distribute(&self, event: Event<T>, is_sync: bool) {
        for l in &self.listeners {
            if !is_sync || self.syncing.contains(&l.id) {
                l.push(event.clone());
            }
        }
    }
}

impl<T> Drop for Shared<T> {
    fn drop(&mut self) {
        let processor = self.processor.get_mut().unwrap_or_else(|e| e.into_inner());
        for l in processor.listeners.drain(..) {
            l.stop_thread();
        }
    }
}

/// Errors when registering a handler.
#[derive(Debug, thiserror::Error)]
pub enum InformerError {
    /// The handler's thread could not be started.
    #[error("cannot start a thread for handler {name}: {source}")]
    Thread {
        /// The handler's name.
        name: String,
        /// Why.
        source: std::io::Error,
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
            .is_some_and(|s| s.fifo.has_synced() && self.listener.initial_delivered())
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
}

impl<T: Send + Sync + 'static> SharedIndexInformer<T> {
    /// An informer over `source`. Nothing happens until [`run`](Self::run).
    pub fn new(source: impl ListerWatcher<T>, options: InformerOptions<T>) -> Self {
        let indexer = Indexer::new(options.indexers);
        let fifo = Arc::new(DeltaFifo::new(Some(Arc::new(indexer.clone()))));
        let source: Box<dyn ListerWatcher<T>> = match options.transform {
            Some(transform) => Box::new(Transformed { source, transform }),
            None => Box::new(source),
        };
        let default_resync = clamp_resync(options.resync_period);
        SharedIndexInformer {
            shared: Arc::new(Shared {
                name: options.name,
                indexer,
                fifo,
                processor: Mutex::new(Processor {
                    listeners: Vec::new(),
                    syncing: Vec::new(),
                }),
                source: Mutex::new(Some(source)),
                started: AtomicBool::new(false),
                stopped: AtomicBool::new(false),
                default_resync,
                resync_check_period: Mutex::new(default_resync),
                revision: OnceLock::new(),
                watch_error_handler: options.watch_error_handler,
                backoff: options.backoff,
                max_handler_backlog: options.max_handler_backlog,
                next_id: AtomicU64::new(0),
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

    /// Registers a handler that receives a resync every `resync_period` (zero: never; at least
    /// [`MIN_RESYNC_PERIOD`]). Once the informer runs, a period shorter than its resync check
    /// period is raised to it.
    ///
    /// If the cache holds objects already, the handler first receives an add for each (with
    /// `is_in_initial_list` true), then the changes after them.
    pub fn add_event_handler_with_resync(
        &self,
        handler: impl ResourceEventHandler<T>,
        resync_period: Duration,
    ) -> Result<HandlerRegistration<T>, InformerError> {
        let mut period = clamp_resync(resync_period);
        {
            let mut check = self
                .shared
                .resync_check_period
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if !period.is_zero() {
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
            }
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let name = format!("{}#{id}", self.shared.name);
        let listener = Listener::spawn(
            id,
            name.clone(),
            Arc::new(handler),
            period,
            self.shared.max_handler_backlog,
        )
        .map_err(|source| InformerError::Thread { name, source })?;
        // Holding the processor while listing the cache: no change can be applied between the
        // snapshot and the registration, so there is no gap and no duplicate.
        let mut processor = self.processor();
        for object in self.shared.indexer.list() {
            listener.push(Event::Added {
                object,
                is_in_initial_list: true,
            });
        }
        processor.listeners.push(listener.clone());
        if self.shared.stopped.load(Ordering::Acquire) {
            listener.close();
        }
        Ok(HandlerRegistration {
            listener,
            informer: Arc::downgrade(&self.shared),
        })
    }

    /// Unregisters a handler; its pending notifications are dropped.
    pub fn remove_event_handler(&self, registration: &HandlerRegistration<T>) {
        let mut processor = self.processor();
        processor
            .listeners
            .retain(|l| l.id != registration.listener.id);
        registration.listener.stop_thread();
    }

    /// The changes as a stream of [`Event`]s, starting with an add for every cached object.
    /// The stream's buffer is unbounded; dropping the stream unregisters it.
    pub fn event_stream(&self) -> Result<EventStream<T>, InformerError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let registration = self.add_event_handler(StreamHandler { tx })?;
        Ok(EventStream {
            rx,
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
        let Some(source) = self
            .shared
            .source
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            return;
        };
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
        let this = self.clone();
        let config = ControllerConfig {
            lister_watcher: source,
            queue: self.shared.fifo.clone(),
            process: Box::new(move |deltas, initial| {
                this.handle_deltas(deltas, initial);
                Ok(())
            }),
            retry_on_error: false,
            reflector: ReflectorOptions {
                name: self.shared.name.clone(),
                resync_period,
                should_resync: Some(should_resync),
                watch_error_handler: self.shared.watch_error_handler.clone(),
                backoff: self.shared.backoff.clone(),
            },
        };
        // However `run` ends (stopped, or its future dropped), let each handler thread finish
        // its backlog and end, instead of waiting forever for events that cannot come.
        let _close_handlers = CloseHandlersOnDrop(self.shared.clone());
        let revision = &self.shared.revision;
        Controller::new(config)
            .run_with(|handle| {
                let _ = revision.set(handle);
            })
            .await;
    }

    /// Stops the informer: the reflector stops, and [`run`](Self::run) returns once what is
    /// queued is applied; handlers then finish their backlogs and their threads end.
    pub fn stop(&self) {
        self.shared.fifo.close();
    }

    /// Applies one key's deltas to the cache, then tells the handlers (client-go's
    /// `HandleDeltas`).
    fn handle_deltas(&self, deltas: &[Delta<T>], is_in_initial_list: bool) {
        let processor = self.processor();
        let indexer = &self.shared.indexer;
        for d in deltas {
            match d.kind {
                DeltaType::Deleted => {
                    indexer.delete(d.object.key());
                    let deleted = if d.final_state_unknown {
                        DeletedObject::FinalStateUnknown(d.object.clone())
                    } else {
                        DeletedObject::Deleted(d.object.clone())
                    };
                    processor.distribute(Event::Deleted(deleted), false);
                }
                DeltaType::Added | DeltaType::Updated | DeltaType::Replaced | DeltaType::Sync => {
                    match indexer.add(d.object.clone()) {
                        Some(old) => {
                            let is_sync = d.kind == DeltaType::Sync
                                || (d.kind == DeltaType::Replaced
                                    && old.mod_revision == d.object.mod_revision);
                            processor.distribute(
                                Event::Updated {
                                    old,
                                    new: d.object.clone(),
                                },
                                is_sync,
                            );
                        }
                        None => processor.distribute(
                            Event::Added {
                                object: d.object.clone(),
                                is_in_initial_list,
                            },
                            false,
                        ),
                    }
                }
            }
        }
    }

    /// Picks the handlers whose resync is due; the reflector resyncs only if there are any.
    fn should_resync(&self) -> bool {
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
        processor.syncing = due;
        true
    }

    /// Whether the first list has been fully applied to the cache.
    pub fn has_synced(&self) -> bool {
        self.shared.fifo.has_synced()
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

    /// Whether [`run`](Self::run) has been called.
    pub fn has_started(&self) -> bool {
        self.shared.started.load(Ordering::Acquire)
    }

    /// The informer's name.
    pub fn name(&self) -> &str {
        &self.shared.name
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
        period.max(MIN_RESYNC_PERIOD)
    }
}

/// A handler that forwards into a channel, behind [`EventStream`].
struct StreamHandler<T> {
    tx: mpsc::UnboundedSender<Event<T>>,
}

impl<T: Send + Sync + 'static> ResourceEventHandler<T> for StreamHandler<T> {
    fn on_add(&self, object: &Arc<Object<T>>, is_in_initial_list: bool) {
        let _ = self.tx.send(Event::Added {
            object: object.clone(),
            is_in_initial_list,
        });
    }
    fn on_update(&self, old: &Arc<Object<T>>, new: &Arc<Object<T>>) {
        let _ = self.tx.send(Event::Updated {
            old: old.clone(),
            new: new.clone(),
        });
    }
    fn on_delete(&self, obj: &DeletedObject<T>) {
        let _ = self.tx.send(Event::Deleted(obj.clone()));
    }
}

/// The changes of an informer as a [`Stream`]; see [`SharedIndexInformer::event_stream`].
pub struct EventStream<T: Send + Sync + 'static> {
    rx: mpsc::UnboundedReceiver<Event<T>>,
    registration: HandlerRegistration<T>,
    informer: SharedIndexInformer<T>,
}

impl<T: Send + Sync + 'static> EventStream<T> {
    /// Whether every initial add has been delivered into the stream.
    pub fn has_synced(&self) -> bool {
        self.registration.has_synced()
    }
}

impl<T: Send + Sync + 'static> Stream for EventStream<T> {
    type Item = Event<T>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event<T>>> {
        self.rx.poll_recv(cx)
    }
}

impl<T: Send + Sync + 'static> Drop for EventStream<T> {
    fn drop(&mut self) {
        self.informer.remove_event_handler(&self.registration);
    }
}

/// A source whose objects pass through a transform.
struct Transformed<L, T> {
    source: L,
    transform: TransformFn<T>,
}

impl<T: Send + Sync + 'static, L: ListerWatcher<T>> ListerWatcher<T> for Transformed<L, T> {
    fn list(&self) -> BoxFuture<'_, crate::listwatch::Result<ListResult<T>>> {
        Box::pin(async move {
            let mut list = self.source.list().await?;
            list.items = list
                .items
                .into_iter()
                .map(|o| (self.transform)(o))
                .collect();
            Ok(list)
        })
    }

    fn watch(&self, after: i64) -> BoxFuture<'_, crate::listwatch::Result<WatchStream<T>>> {
        Box::pin(async move {
            let stream = self.source.watch(after).await?;
            let transform = self.transform.clone();
            let mapped = stream.map(move |event| match event {
                WatchEvent::Added(o) => WatchEvent::Added(transform(o)),
                WatchEvent::Modified(o) => WatchEvent::Modified(transform(o)),
                WatchEvent::Deleted {
                    key,
                    revision,
                    last,
                } => WatchEvent::Deleted {
                    key,
                    revision,
                    last: last.map(|o| transform(o)),
                },
                other => other,
            });
            Ok(Box::pin(mapped) as WatchStream<T>)
        })
    }
}
