//! The reflector: lists a source, then watches it, and mirrors every change into a DeltaFIFO.

use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::time::Instant;
use tokio_stream::{Stream, StreamExt};
use tracing::Instrument;

use crate::delta_fifo::DeltaType;
use crate::listwatch::{Error, ListerWatcher, WatchEvent, WatchStream};
use crate::Object;

/// What a [`Reflector`] fills: client-go's `Queue` as the reflector sees it. Implemented by
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
    /// Re-delivers the cache to handlers without contacting the source.
    fn resync(&self);
    /// Every change up to `revision` is queued: the revision is complete.
    fn commit(&self, revision: i64);
    /// Nothing changed up to `revision` beyond what is queued (a trusted bookmark).
    fn progress(&self, revision: i64);
}

/// Called with every list or watch failure.
pub type WatchErrorHandler = Arc<dyn Fn(&Error) + Send + Sync>;

/// Decides on each resync tick whether to resync now.
pub type ShouldResync = Arc<dyn Fn() -> bool + Send + Sync>;

/// Exponential backoff with jitter, reset after a quiet period (client-go's
/// `NewExponentialBackoffManager(800ms, 30s, 2min, 2.0, 1.0)`).
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    reset_after: Duration,
    jitter: f64,
    next: Duration,
    last: Option<Instant>,
}

impl Default for Backoff {
    /// 800 ms doubling to 30 s, reset after 2 minutes without a failure, up to 100% jitter:
    /// the reflector's figures in client-go.
    fn default() -> Self {
        Backoff::new(
            Duration::from_millis(800),
            Duration::from_secs(30),
            Duration::from_secs(120),
            1.0,
        )
    }
}

impl Backoff {
    /// A backoff starting at `initial`, doubling up to `max`, starting over when the previous
    /// failure is older than `reset_after`, each delay stretched by up to `jitter` × itself.
    pub fn new(initial: Duration, max: Duration, reset_after: Duration, jitter: f64) -> Self {
        Backoff {
            initial,
            max,
            reset_after,
            jitter,
            next: initial,
            last: None,
        }
    }

    /// The delay before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        let now = Instant::now();
        if self
            .last
            .is_some_and(|t| now.duration_since(t) >= self.reset_after)
        {
            self.next = self.initial;
        }
        let base = self.next;
        self.next = (self.next * 2).min(self.max);
        let delay = base.mul_f64(1.0 + self.jitter * fastrand::f64());
        // The next failure is measured from the end of this delay, not its start.
        self.last = Some(now + delay);
        delay
    }
}

/// Options of a [`Reflector`].
#[derive(Clone)]
pub struct ReflectorOptions {
    /// A name for logs and spans (the prefix, for the etcd source).
    pub name: String,
    /// How often to ask whether to resync; zero disables resync.
    pub resync_period: Duration,
    /// Asked on each resync tick; resync happens only when it says yes (always when `None`).
    pub should_resync: Option<ShouldResync>,
    /// Called with every list or watch failure, after it is logged.
    pub watch_error_handler: Option<WatchErrorHandler>,
    /// Delays between retries.
    pub backoff: Backoff,
}

impl Default for ReflectorOptions {
    fn default() -> Self {
        ReflectorOptions {
            name: "reflector".into(),
            resync_period: Duration::ZERO,
            should_resync: None,
            watch_error_handler: None,
            backoff: Backoff::default(),
        }
    }
}

impl fmt::Debug for ReflectorOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReflectorOptions")
            .field("name", &self.name)
            .field("resync_period", &self.resync_period)
            .finish_non_exhaustive()
    }
}

/// Lists a [`ListerWatcher`], replaces the [`DeltaFifo`] with the list, then watches from the
/// list's revision and queues every change (client-go's `Reflector`).
///
/// - On [`Error::Expired`] (compaction) it relists and replaces, which turns keys that vanished
///   meanwhile into tombstones.
/// - On a transient error it watches again from the last revision it delivered, after a backoff.
/// - A list at a revision lower than one already seen means the store was wiped or restored: it
///   is logged and replaces the cache like any relist.
/// - Events not newer than the state the FIFO knows for their key are dropped as duplicates.
pub struct Reflector<T, L> {
    lw: L,
    fifo: Arc<dyn Queue<T>>,
    options: ReflectorOptions,
    last_synced: Arc<AtomicI64>,
}

/// A cloneable view of the revision a reflector has synced to.
#[derive(Debug, Clone)]
pub struct RevisionHandle(Arc<AtomicI64>);

impl RevisionHandle {
    /// The last revision the reflector has read up to and queued (0 before the first list):
    /// client-go's `LastSyncResourceVersion`. The cache reaches it once the queue is drained.
    pub fn get(&self) -> i64 {
        self.0.load(Ordering::Acquire)
    }
}

enum WatchEnd {
    /// Relist: the revision is gone (and with `store_replaced`, the whole store was).
    Expired { store_replaced: bool },
    /// Watch again from the last revision, after a backoff.
    Failed,
}

impl WatchEnd {
    fn after(e: &Error) -> Self {
        if e.is_expired() {
            WatchEnd::Expired {
                store_replaced: e.is_store_replaced(),
            }
        } else {
            WatchEnd::Failed
        }
    }
}

impl<T: Send + Sync + 'static, L: ListerWatcher<T>> Reflector<T, L> {
    /// A reflector from `lw` into `fifo` (a [`DeltaFifo`](crate::DeltaFifo) or a
    /// [`RealFifo`](crate::RealFifo)).
    pub fn new(lw: L, fifo: Arc<dyn Queue<T>>, options: ReflectorOptions) -> Self {
        Reflector {
            lw,
            fifo,
            options,
            last_synced: Arc::new(AtomicI64::new(0)),
        }
    }

    /// A handle to read the last synced revision while the reflector runs.
    pub fn revision(&self) -> RevisionHandle {
        RevisionHandle(self.last_synced.clone())
    }

    /// Runs until the returned future is dropped. Never returns otherwise.
    pub async fn run(self) {
        let span = tracing::info_span!("reflector", name = %self.options.name);
        self.run_inner().instrument(span).await
    }

    async fn run_inner(mut self) {
        let mut backoff = self.options.backoff.clone();
        // One resync schedule for the reflector's life, so frequent re-watches do not keep
        // pushing the next resync away.
        let period = self.options.resync_period;
        let mut resync = (!period.is_zero()).then(|| {
            let mut interval = tokio::time::interval_at(Instant::now() + period, period);
            // After a long list or backoff, one late resync, not a burst of them (the burst's
            // later ticks would find no handler due and cancel the first one's delivery).
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            interval
        });
        let mut store_replaced = false;
        let mut highest_seen = 0i64;
        loop {
            // List.
            let list = match self.lw.list().await {
                Ok(list) => list,
                Err(e) => {
                    self.report(&e);
                    tokio::time::sleep(backoff.next_delay()).await;
                    continue;
                }
            };
            let items = list.items.into_iter().map(Arc::new).collect();
            let replaced = list.revision < highest_seen || store_replaced;
            if replaced {
                tracing::warn!(
                    list_revision = list.revision,
                    highest_seen,
                    "the store was wiped or restored; replacing the cache"
                );
            }
            // After a wipe, revisions start over in the new store, so an object listed at the
            // revision the cache holds may still differ: the queue retires every cached key
            // (tombstones) and adds the list afresh.
            self.fifo.replace(items, list.revision, replaced);
            let mut revision = list.revision;
            highest_seen = revision;
            self.last_synced.store(revision, Ordering::Release);
            tracing::debug!(revision, "listed");

            // Watch until the revision expires, then relist after a backoff too: a relist
            // storm against a struggling etcd makes it worse.
            loop {
                let end = self.watch(&mut revision, &mut resync).await;
                tokio::time::sleep(backoff.next_delay()).await;
                if let WatchEnd::Expired {
                    store_replaced: replaced,
                } = end
                {
                    store_replaced = replaced;
                    break;
                }
            }
            highest_seen = highest_seen.max(revision);
        }
    }

    async fn watch(
        &mut self,
        revision: &mut i64,
        resync: &mut Option<tokio::time::Interval>,
    ) -> WatchEnd {
        let mut stream = match self.lw.watch(*revision).await {
            Ok(s) => s,
            Err(e) => {
                self.report(&e);
                return WatchEnd::after(&e);
            }
        };
        // An event already taken from the stream, not yet handled.
        let mut ready: Option<Option<WatchEvent<T>>> = None;
        loop {
            let event = match ready.take() {
                Some(event) => event,
                None => {
                    let tick = async {
                        match resync.as_mut() {
                            Some(interval) => interval.tick().await,
                            None => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        biased;
                        event = stream.next() => event,
                        _ = tick => {
                            if self.options.should_resync.as_ref().is_none_or(|f| f()) {
                                tracing::trace!("resync");
                                self.fifo.resync();
                            }
                            continue;
                        }
                    }
                }
            };
            let Some(event) = event else {
                tracing::debug!(revision = *revision, "watch ended; watching again");
                self.fifo.commit(*revision);
                return WatchEnd::Failed;
            };
            match event {
                WatchEvent::Added(obj) => {
                    *revision = obj.mod_revision.max(*revision);
                    self.fifo.add_if_newer(DeltaType::Added, Arc::new(obj));
                }
                WatchEvent::Modified(obj) => {
                    *revision = obj.mod_revision.max(*revision);
                    self.fifo.add_if_newer(DeltaType::Updated, Arc::new(obj));
                }
                WatchEvent::Deleted {
                    key,
                    revision: r,
                    last,
                } => {
                    *revision = r.max(*revision);
                    self.fifo.delete(&key, r, last.map(Arc::new));
                }
                WatchEvent::Bookmark(r) => {
                    *revision = r.max(*revision);
                    self.fifo.progress(*revision);
                }
                WatchEvent::Error(e) => {
                    self.fifo.commit(*revision);
                    self.report(&e);
                    return WatchEnd::after(&e);
                }
            }
            self.last_synced.store(*revision, Ordering::Release);
            // A revision is complete once the stream has nothing more ready: sources yield a
            // revision's events together (etcd never splits a transaction across responses).
            ready = ready_now(&mut stream);
            let more_of_this_revision =
                matches!(&ready, Some(Some(e)) if e.revision() == Some(*revision));
            if !more_of_this_revision {
                self.fifo.commit(*revision);
            }
        }
    }

    fn report(&self, e: &Error) {
        if e.is_expired() {
            tracing::info!(error = %e, "revision expired; relisting");
        } else {
            tracing::warn!(error = %e, "list/watch failed; retrying with backoff");
        }
        if let Some(h) = &self.options.watch_error_handler {
            h(e);
        }
    }
}

/// The stream's next item if it is ready now, without waiting.
fn ready_now<T>(stream: &mut WatchStream<T>) -> Option<Option<WatchEvent<T>>> {
    let mut cx = Context::from_waker(Waker::noop());
    match Pin::new(stream).poll_next(&mut cx) {
        Poll::Ready(item) => Some(item),
        Poll::Pending => None,
    }
}
