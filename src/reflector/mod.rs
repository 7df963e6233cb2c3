//! The reflector: lists a source, then watches it, and mirrors every change into a DeltaFIFO.

use std::fmt;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::time::Instant;
use tokio_stream::{Stream, StreamExt};
use tracing::Instrument;

use crate::listwatch::SourceCapabilities;
use crate::listwatch::{take_received, Error, ListResult, ListerWatcher, WatchEvent, WatchStream};
use crate::metrics::{RelistMetrics, RelistReason};
use crate::object::Object;
use crate::queue::{DeltaType, ReceivedAt, MAX_RESYNC_PERIOD};
use crate::sync::panic_message;

mod health;

pub use self::health::{Health, Relists, RevisionHandle};
pub use crate::backoff::Backoff;
pub use crate::queue::Queue;

/// A relist is part of a storm when the watch opened after the previous list did not stay up
/// this long and expired without etcd becoming unreachable in between: then it waits for
/// [`ReflectorOptions::backoff`], doubling each time. A relist
/// after a watch that did stay up (a member restarted, a compaction while the informer was
/// away) happens at once and starts the backoff over: a fault every few seconds must not push
/// recovery tens of seconds away, as a backoff that resets only after two quiet minutes
/// (client-go's) does, while a list whose watch expires at once still backs off.
pub const RELIST_STORM_WINDOW: Duration = Duration::from_secs(2);

/// Rewrites each object before it is cached (client-go's `TransformFunc`), e.g. to drop fields
/// the program never reads and save memory. Applied by the reflector to everything the source
/// yields, so the source itself stays whole (its consistent reads and liveness included).
pub type TransformFn<T> = Arc<dyn Fn(Object<T>) -> Object<T> + Send + Sync>;

/// Called with every list or watch failure.
pub type WatchErrorHandler = Arc<dyn Fn(&Error) + Send + Sync>;

/// Decides on each resync tick whether to resync now.
pub type ShouldResync = Arc<dyn Fn() -> bool + Send + Sync>;

/// Options of a [`Reflector`].
#[derive(Clone)]
#[non_exhaustive]
pub struct ReflectorOptions {
    /// A name for logs and spans (the prefix, for the etcd source).
    pub name: String,
    /// How often to ask whether to resync; zero disables resync; longer than
    /// [`MAX_RESYNC_PERIOD`] is that.
    pub resync_period: Duration,
    /// Asked on each resync tick; resync happens only when it says yes (always when `None`).
    pub should_resync: Option<ShouldResync>,
    /// Called with every list or watch failure, after it is logged.
    pub watch_error_handler: Option<WatchErrorHandler>,
    /// The protective backoff: delays between relists in a storm (see
    /// [`RELIST_STORM_WINDOW`]; others are immediate), and retries after etcd answered with an
    /// error. Default: client-go's reflector figures (SEMANTICS etcd rule 12).
    pub backoff: Backoff,
    /// Delays between attempts to watch again while etcd cannot be reached
    /// ([`Error::Unavailable`]); default [`Backoff::reconnect`].
    pub reconnect: Backoff,
}

impl ReflectorOptions {
    /// Sets the name for logs and spans (`name`).
    #[must_use]
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Sets the resync period (zero disables resync) (`resync_period`).
    #[must_use]
    pub fn with_resync_period(mut self, resync_period: Duration) -> Self {
        self.resync_period = resync_period;
        self
    }

    /// Sets the predicate asked on each resync tick (`should_resync`).
    #[must_use]
    pub fn with_should_resync(mut self, should_resync: Option<ShouldResync>) -> Self {
        self.should_resync = should_resync;
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

    /// Sets the protective backoff between relists in a storm and after errors (`backoff`).
    #[must_use]
    pub fn with_backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Sets the delays between attempts to watch again while etcd is unreachable (`reconnect`).
    #[must_use]
    pub fn with_reconnect(mut self, reconnect: Backoff) -> Self {
        self.reconnect = reconnect;
        self
    }
}

impl Default for ReflectorOptions {
    fn default() -> Self {
        ReflectorOptions {
            name: "reflector".into(),
            resync_period: Duration::ZERO,
            should_resync: None,
            watch_error_handler: None,
            backoff: Backoff::default(),
            reconnect: Backoff::reconnect(),
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

/// Lists a [`ListerWatcher`], replaces its [`Queue`] (a [`DeltaFifo`](crate::DeltaFifo) or a
/// [`RealFifo`](crate::RealFifo)) with the list, then watches from the
/// list's revision and queues every change (client-go's `Reflector`).
///
/// - On [`Error::Expired`] (compaction) it relists and replaces, which turns keys that vanished
///   meanwhile into tombstones.
/// - On a transient error it watches again from the last revision it delivered, after a backoff.
/// - A list at a revision lower than one already seen means the store was wiped or restored: it
///   is logged and replaces the cache like any relist.
/// - Events not newer than the state the FIFO knows for their key are dropped as duplicates.
///
/// ```
/// use std::sync::Arc;
/// use etcd_informer::testing::FakeSource;
/// use etcd_informer::{Delta, DeltaFifo, DeltaType, Reflector, ReflectorOptions};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let source = FakeSource::<String>::new();
/// source.put("a", "1".into());
/// let fifo = Arc::new(DeltaFifo::new(None));
/// let reflector = Reflector::new(source.clone(), fifo.clone(), ReflectorOptions::default());
/// let task = tokio::spawn(reflector.run());
/// // The list arrives as Replaced deltas, later changes as they happen.
/// let mut kinds = vec![];
/// let mut record = |deltas: &[Delta<String>], _initial| {
///     kinds.extend(deltas.iter().map(|d| d.kind));
///     Ok(())
/// };
/// assert!(fifo.pop(&mut record).await.is_processed());
/// source.put("a", "2".into());
/// assert!(fifo.pop(&mut record).await.is_processed());
/// assert_eq!(kinds, [DeltaType::Replaced, DeltaType::Updated]);
/// task.abort();
/// # }
/// ```
pub struct Reflector<T, L> {
    lw: L,
    fifo: Arc<dyn Queue<T>>,
    options: ReflectorOptions,
    handle: RevisionHandle,
    relists: RelistMetrics,
    /// When the current watch was opened.
    watching_since: Option<Instant>,
    transform: Option<TransformFn<T>>,
    /// Where committed revisions' receipt times go (metrics only).
    received_at: Option<Arc<ReceivedAt>>,
    /// When the response being read arrived, and the first event of the revision being read.
    response_at: Option<std::time::Instant>,
    revision_at: Option<std::time::Instant>,
    /// Notified when the informer's audit asks for a relist.
    relist: Option<Arc<tokio::sync::Notify>>,
    /// Notified when the next attempt can succeed before the backoff ends (see
    /// [`with_retry_trigger`](Self::with_retry_trigger)).
    retry: Option<Arc<tokio::sync::Notify>>,
    /// The current run of failures, logged as one story rather than a line per retry.
    outage: OutageLog,
}

/// Why the reflector lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ListReason {
    Initial,
    Compacted,
    StoreReplaced,
    /// The key tally differed when a watch opened again (see [`Error::TallyDiffers`]).
    TallyDiffers,
    /// The informer's audit found the cache differing from etcd.
    Audit,
    /// The reflector's task panicked and started over.
    Restarted,
}

enum WatchEnd {
    /// Relist, for this reason: the revision is gone, or the store with it.
    Expired(ListReason),
    /// etcd cannot be reached: watch again as soon as it answers.
    Unavailable,
    /// etcd answered with an error: watch again after the protective backoff.
    Failed,
}

impl WatchEnd {
    fn after(e: &Error) -> Self {
        if e.is_store_replaced() {
            WatchEnd::Expired(ListReason::StoreReplaced)
        } else if e.is_tally_differs() {
            WatchEnd::Expired(ListReason::TallyDiffers)
        } else if e.is_expired() {
            WatchEnd::Expired(ListReason::Compacted)
        } else if e.is_unavailable() {
            WatchEnd::Unavailable
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
            handle: RevisionHandle::new(lw.liveness_bound()),
            lw,
            fifo,
            relists: RelistMetrics::new(&options.name),
            options,
            watching_since: None,
            outage: OutageLog::default(),
            transform: None,
            received_at: None,
            response_at: None,
            revision_at: None,
            relist: None,
            retry: None,
        }
    }

    /// Ends the watch and relists when `relist` is notified (the informer's audit found the
    /// cache differing from etcd).
    pub(crate) fn with_relist_trigger(mut self, relist: Arc<tokio::sync::Notify>) -> Self {
        self.relist = Some(relist);
        self
    }

    /// Cuts a wait between failed attempts short when `retry` is notified (`notify_waiters`):
    /// its owner saw that the next attempt can succeed (the cache server: etcd turned its auth
    /// off, after refusing the server's credentials long enough to stretch the backoff). The
    /// backoff then starts over.
    #[cfg_attr(not(feature = "server"), allow(dead_code))]
    pub(crate) fn with_retry_trigger(mut self, retry: Arc<tokio::sync::Notify>) -> Self {
        self.retry = Some(retry);
        self
    }

    /// Waits `delay` after a failed attempt, or until the retry trigger fires; whether it
    /// fired.
    async fn pause(&self, delay: Duration) -> bool {
        let Some(retry) = &self.retry else {
            tokio::time::sleep(delay).await;
            return false;
        };
        tokio::select! {
            _ = tokio::time::sleep(delay) => false,
            _ = retry.notified() => {
                tracing::info!("retrying before the backoff ends: the next attempt can succeed");
                true
            }
        }
    }

    /// Records when each committed revision was received, for the consumer's latency metric.
    pub(crate) fn with_received_at(mut self, received_at: Arc<ReceivedAt>) -> Self {
        self.received_at = Some(received_at);
        self
    }

    /// Notes the receipt stamp the stream's last poll left, and the revision's first one.
    fn note_received(&mut self, event: &Option<WatchEvent<T>>) {
        if let Some(at) = take_received() {
            self.response_at = Some(at);
        }
        if matches!(event, Some(e) if e.revision().is_some()) && self.revision_at.is_none() {
            self.revision_at = self.response_at;
        }
    }

    /// Rewrites every listed and watched object with `transform` before it is queued.
    #[must_use]
    pub fn with_transform(mut self, transform: Option<TransformFn<T>>) -> Self {
        self.transform = transform;
        self
    }

    fn transformed(&self, obj: Object<T>) -> Arc<Object<T>> {
        Arc::new(match &self.transform {
            Some(transform) => transform(obj),
            None => obj,
        })
    }

    /// A handle to read the last synced revision and the health while the reflector runs.
    pub fn revision(&self) -> RevisionHandle {
        self.handle.clone()
    }

    /// Runs until the returned future is dropped. Never returns otherwise: a panic inside (a
    /// transform, a codec, a bug) is logged, recorded in [`Health`], and the reflector starts
    /// over with a fresh list, so the cache never silently stops changing.
    pub async fn run(mut self) {
        let span = tracing::info_span!("reflector", name = %self.options.name);
        // Restarts that come close together back off like relists.
        let mut restarts = self.options.backoff.clone();
        let mut reason = ListReason::Initial;
        loop {
            let attempt = CatchUnwind(Box::pin(self.run_inner(reason)));
            let Err(panic) = attempt.instrument(span.clone()).await;
            let message = panic_message(&*panic);
            tracing::error!(name = %self.options.name, panic = %message, "the reflector panicked; starting over with a relist");
            self.handle
                .failed(format!("the reflector panicked: {message}"));
            self.handle.lock().restarts += 1;
            reason = ListReason::Restarted;
            tokio::time::sleep(restarts.next_delay()).await;
        }
    }

    async fn run_inner(&mut self, first: ListReason) -> std::convert::Infallible {
        let mut backoff = self.options.backoff.clone();
        let mut reconnect = self.options.reconnect.clone();
        // One resync schedule for the reflector's life, so frequent re-watches do not keep
        // pushing the next resync away; clamped so that a period of years cannot overflow the
        // clock.
        let period = self.options.resync_period.min(MAX_RESYNC_PERIOD);
        let mut resync = (!period.is_zero()).then(|| {
            let mut interval = tokio::time::interval_at(Instant::now() + period, period);
            // After a long list or backoff, one late resync, not a burst of them (the burst's
            // later ticks would find no handler due and cancel the first one's delivery).
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            interval
        });
        let mut reason = first;
        let mut highest_seen = 0i64;
        loop {
            // Pages go into the queue's next content as they arrive when it can take them so.
            // After a replaced store or a tally that differed, every value is read afresh.
            let afresh = matches!(reason, ListReason::StoreReplaced | ListReason::TallyDiffers);
            let reuse_from = (!afresh).then_some(highest_seen);
            // A transform needs each object whole before it is queued, so transformed lists
            // are read whole.
            let sink = match self.transform {
                Some(_) => None,
                None => self.fifo.begin_replace(reuse_from),
            };
            let listed = match &sink {
                Some(sink) => self
                    .lw
                    .list_into(sink.clone())
                    .await
                    .map(|revision| ListResult {
                        items: Vec::new(),
                        revision,
                    }),
                None => self.lw.list().await,
            };
            let paged = sink.is_some();
            drop(sink);
            let list = match listed {
                Ok(list) => list,
                Err(e) => {
                    self.report(&e);
                    if e.is_store_replaced() {
                        // The source recognised another store: list it afresh, now.
                        reason = ListReason::StoreReplaced;
                        continue;
                    }
                    let delay = if e.is_unavailable() {
                        reconnect.next_delay()
                    } else {
                        backoff.next_delay()
                    };
                    if self.pause(delay).await {
                        // What stretched the backoff is over (etcd's refusals).
                        backoff.reset();
                    }
                    continue;
                }
            };
            // A tally that differed cannot tell a store rewritten past the watched revision
            // from a lost event, and in the first case a key listed at the revision the cache
            // holds may hold another value: both are handled as a replaced store, so that
            // handlers hear of every listed key anew.
            let replaced = list.revision < highest_seen
                || matches!(reason, ListReason::StoreReplaced | ListReason::TallyDiffers);
            if reason == ListReason::TallyDiffers {
                tracing::warn!(
                    list_revision = list.revision,
                    "the key tally differed (a store rewritten, or an event lost); replacing the cache"
                );
            } else if replaced {
                tracing::warn!(
                    list_revision = list.revision,
                    highest_seen,
                    "the store was wiped or restored; replacing the cache"
                );
            }
            {
                let mut health = self.handle.lock();
                // A tally that differed is counted with the replaced stores (it usually is
                // one).
                let counted = match (replaced, reason) {
                    (true, _) => {
                        health.relists.store_replaced += 1;
                        RelistReason::StoreReplaced
                    }
                    (false, ListReason::Compacted) => {
                        health.relists.compacted += 1;
                        RelistReason::Compacted
                    }
                    (false, ListReason::Restarted) => {
                        health.relists.error += 1;
                        RelistReason::Error
                    }
                    (false, ListReason::Audit) => {
                        health.relists.audit += 1;
                        RelistReason::Audit
                    }
                    _ => {
                        health.relists.initial += 1;
                        RelistReason::Initial
                    }
                };
                self.relists.relisted(counted);
            }
            // After a wipe, revisions start over in the new store (or, past the watched
            // revision, repeat), so an object listed at the revision the cache holds may still
            // differ: the queue retires every cached key (tombstones) and adds the list afresh.
            if paged {
                // Off the runtime's threads: a compact content repacks once its list is whole,
                // if it needs to (a copy of every record, at a million keys half a second).
                let (fifo, revision) = (self.fifo.clone(), list.revision);
                let finished =
                    tokio::task::spawn_blocking(move || fifo.finish_replace(revision, replaced))
                        .await;
                if let Err(e) = finished {
                    // The cache lacks this list (a panic in a repack, say): watching on from
                    // it would follow a cache that never took it. List again, after a backoff.
                    let message = format!("queueing the list failed: {}", panic_or_error(e));
                    tracing::error!("{message}; listing again");
                    self.handle.failed(message);
                    // A replaced store stays one: the next list must retire every cached key.
                    if !matches!(reason, ListReason::StoreReplaced | ListReason::TallyDiffers) {
                        reason = ListReason::Restarted;
                    }
                    if self.pause(backoff.next_delay()).await {
                        backoff.reset();
                    }
                    continue;
                }
            } else {
                let items = list
                    .items
                    .into_iter()
                    .map(|o| self.transformed(o))
                    .collect();
                self.fifo.replace(items, list.revision, replaced);
            }
            // Whether a watch after this list stayed up (see `RELIST_STORM_WINDOW`).
            let mut watch_stayed_up = false;
            // Whether a failed watch after this list already waited a backoff delay.
            let mut paused = false;
            let mut revision = list.revision;
            highest_seen = revision;
            self.handle.revision.store(revision, Ordering::Release);
            self.handle.proven();
            tracing::debug!(revision, "listed");

            // Watch until the revision expires. Re-watching from the last revision is cheap
            // for etcd, so it happens as soon as etcd answers; a relist is what must be
            // protected, so relists that come close together back off.
            loop {
                let end = self.watch(&mut revision, &mut resync).await;
                let was_up = self.watching_since.take().map(|t| t.elapsed());
                // A watch that ended because etcd could not be reached was not expired by the
                // list before it: a relist after the outage (its revision compacted meanwhile,
                // its store wiped) is a recovery, not a storm.
                watch_stayed_up |= was_up.is_some_and(|up| up >= RELIST_STORM_WINDOW)
                    || matches!(end, WatchEnd::Unavailable);
                // A watch that stayed up a while ends a run of failures: the next outage is
                // retried at once again, however recent the last one was.
                if was_up.is_some_and(|up| up >= RELIST_STORM_WINDOW / 2) {
                    reconnect.reset();
                }
                match end {
                    WatchEnd::Expired(why) => {
                        reason = why;
                        if watch_stayed_up {
                            backoff.reset();
                        } else if why != ListReason::Audit && !paused {
                            // The audit asks at most once per period, and only once its last
                            // repair is done: never a storm, and a repair should not wait. A
                            // failed watch's pause since the list was this relist's wait (the
                            // backoff goes on growing): waiting again would only add to it, as
                            // when etcd refused the watch and compacted meanwhile.
                            tokio::time::sleep(backoff.next_delay()).await;
                        }
                        break;
                    }
                    WatchEnd::Unavailable => tokio::time::sleep(reconnect.next_delay()).await,
                    WatchEnd::Failed => {
                        paused = true;
                        if self.pause(backoff.next_delay()).await {
                            // What stretched the backoff is over (etcd's refusals): a relist
                            // that follows (the revision compacted meanwhile) is a recovery,
                            // not a storm, and must not wait out the stretched backoff.
                            backoff.reset();
                            watch_stayed_up = true;
                        }
                    }
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
        self.handle.connected();
        self.outage.recovered();
        self.watching_since = Some(Instant::now());
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
                    let relist = self.relist.clone();
                    let audit = async {
                        match &relist {
                            Some(relist) => relist.notified().await,
                            None => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        biased;
                        _ = audit => {
                            tracing::info!(revision = *revision, "relisting: the audit found the cache differing from etcd");
                            self.fifo.commit(*revision);
                            return WatchEnd::Expired(ListReason::Audit);
                        }
                        event = stream.next() => {
                            self.note_received(&event);
                            event
                        }
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
                self.handle.failed("the watch ended".into());
                return WatchEnd::Unavailable;
            };
            match event {
                WatchEvent::Added(obj) => {
                    *revision = obj.mod_revision.max(*revision);
                    self.fifo
                        .add_if_newer(DeltaType::Added, self.transformed(obj));
                }
                WatchEvent::Modified(obj) => {
                    *revision = obj.mod_revision.max(*revision);
                    self.fifo
                        .add_if_newer(DeltaType::Updated, self.transformed(obj));
                }
                WatchEvent::Deleted {
                    key,
                    revision: r,
                    last,
                } => {
                    *revision = r.max(*revision);
                    self.fifo.delete(&key, r, last.map(|o| self.transformed(o)));
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
            self.handle.revision.store(*revision, Ordering::Release);
            // A revision is complete once the stream has nothing more ready: sources yield a
            // revision's events together (etcd never splits a transaction across responses).
            let stamp = self.revision_at.take();
            ready = ready_now(&mut stream);
            let more_of_this_revision =
                matches!(&ready, Some(Some(e)) if e.revision() == Some(*revision));
            if more_of_this_revision {
                self.revision_at = stamp;
            }
            if let Some(event) = &ready {
                self.note_received(event);
            }
            if !more_of_this_revision {
                // Before the commit: the queue's consumer may apply the revision within it.
                if let (Some(stamps), Some(at)) = (&self.received_at, stamp) {
                    stamps.record(*revision, at);
                }
                self.fifo.commit(*revision);
                // Once per revision rather than per event: the proof's clock read is not free.
                self.handle.proven();
                if let Some(room) = self.fifo.room() {
                    room.await;
                }
            }
        }
    }

    fn report(&mut self, e: &Error) {
        self.handle.failed(e.to_string());
        if e.is_expired() {
            tracing::info!(error = %e, "revision expired; relisting");
        } else {
            self.outage.failed(e);
        }
        if let Some(h) = &self.options.watch_error_handler {
            h(e);
        }
    }
}

/// How often a run of failures is summarized after its first warning.
const OUTAGE_SUMMARY_PERIOD: Duration = Duration::from_secs(30);

/// Logs a run of list/watch failures as one story: the first failure at WARN, the retries
/// after it at DEBUG with a WARN summary every [`OUTAGE_SUMMARY_PERIOD`], and one INFO line
/// when a watch is open again, saying how long the source was down. An outage of minutes is
/// a handful of lines, not one per retry (every 50 ms to 1 s while etcd is unreachable).
#[derive(Debug, Default)]
struct OutageLog {
    /// When the first failure of the run happened; `None` while the source answers.
    since: Option<Instant>,
    /// Failures in the run.
    failures: u64,
    /// Failures since the last line at WARN, and when that line was.
    unreported: u64,
    reported_at: Option<Instant>,
}

impl OutageLog {
    fn failed(&mut self, e: &Error) {
        let now = Instant::now();
        self.failures += 1;
        let Some(since) = self.since else {
            self.since = Some(now);
            self.reported_at = Some(now);
            tracing::warn!(error = %e, "list/watch failed; retrying (repeats are summarized every {}s)", OUTAGE_SUMMARY_PERIOD.as_secs());
            return;
        };
        self.unreported += 1;
        tracing::debug!(error = %e, failures = self.failures, "list/watch failed again; retrying");
        if self
            .reported_at
            .is_none_or(|at| now.duration_since(at) >= OUTAGE_SUMMARY_PERIOD)
        {
            tracing::warn!(
                error = %e,
                down_for = ?now.duration_since(since),
                failures = self.failures,
                "list/watch still failing: {} more failures since the last warning; retrying",
                self.unreported
            );
            self.unreported = 0;
            self.reported_at = Some(now);
        }
    }

    /// A watch is open again: ends the run, with a line if it was warned of.
    fn recovered(&mut self) {
        if let Some(since) = self.since.take() {
            tracing::info!(
                down_for = ?since.elapsed(),
                failures = self.failures,
                "list/watch is back"
            );
        }
        *self = OutageLog::default();
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

/// Catches a panic while polling the wrapped future (no `futures` dependency for one adapter).
pub(crate) struct CatchUnwind<F>(pub(crate) Pin<Box<F>>);

impl<F: std::future::Future> std::future::Future for CatchUnwind<F> {
    type Output = Result<F::Output, Box<dyn std::any::Any + Send>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = self.0.as_mut();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}

/// The text of a panic payload.
/// What a blocking task that failed said: its panic's message, or why it did not finish.
fn panic_or_error(e: tokio::task::JoinError) -> String {
    match e.try_into_panic() {
        Ok(panic) => format!("panicked: {}", panic_message(&*panic)),
        Err(e) => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::{OutageLog, OUTAGE_SUMMARY_PERIOD};
    use crate::listwatch::Error;

    /// Lines written by a subscriber, for asserting on what was logged.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            crate::sync::lock(&self.0).extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Captured {
        fn lines(&self, level: &str) -> Vec<String> {
            String::from_utf8_lossy(&crate::sync::lock(&self.0))
                .lines()
                .filter(|l| l.contains(level))
                .map(str::to_owned)
                .collect()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_outage_is_one_warning_a_summary_per_period_and_a_line_when_back() {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        let _guard = tracing::subscriber::set_default(subscriber);
        let mut log = OutageLog::default();
        let refused = Error::unavailable("/services/: connection refused");
        // 70 s of retries, one every 500 ms: 140 failures.
        for _ in 0..140 {
            log.failed(&refused);
            tokio::time::advance(std::time::Duration::from_millis(500)).await;
        }
        log.recovered();
        let warns = captured.lines("WARN");
        assert_eq!(
            warns.len(),
            1 + (70 / OUTAGE_SUMMARY_PERIOD.as_secs()) as usize,
            "the first failure, then one summary per 30 s: {warns:#?}"
        );
        assert!(warns[0].contains("connection refused"), "{}", warns[0]);
        assert!(
            warns[1].contains("60 more failures since the last warning"),
            "{}",
            warns[1]
        );
        let back = captured.lines("INFO");
        assert_eq!(back.len(), 1, "{back:#?}");
        assert!(
            back[0].contains("list/watch is back") && back[0].contains("down_for=70s"),
            "{}",
            back[0]
        );
        assert!(back[0].contains("failures=140"), "{}", back[0]);
        // A watch opened again with no failure before it says nothing.
        log.recovered();
        assert_eq!(captured.lines("INFO").len(), 1);
        // The next outage warns at once again.
        log.failed(&refused);
        assert_eq!(captured.lines("WARN").len(), warns.len() + 1);
    }

    /// A relist after failed watches waits no second backoff: four refused watches pause 0.8-1.6,
    /// 1.6-3.2, 3.2-6.4 and 6.4-12.8 s (24 s at most), and the compacted one after them relists
    /// at once, not after another 12.8 s or more. (The cache server saw that wait when etcd
    /// turned its auth off and compacted before the server's probe cut the pause short.)
    #[tokio::test(start_paused = true)]
    async fn a_relist_after_failed_watches_waits_no_second_backoff() {
        use crate::testing::FakeSource;
        use std::time::Duration;
        let source: FakeSource<String> = FakeSource::new();
        source.put("ns/a", "1".into());
        for _ in 0..4 {
            source.fail_next_watch(Error::transient("etcdserver: user name is empty"));
        }
        source.fail_next_watch(Error::expired(1, "compacted"));
        let informer =
            crate::SharedIndexInformer::new(source.clone(), crate::InformerOptions::default());
        let started = tokio::time::Instant::now();
        let run = tokio::spawn(informer.clone().run());
        while source.list_count() < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let took = started.elapsed();
        assert!(
            took < Duration::from_millis(24_500),
            "relisted after {took:?}"
        );
        run.abort();
    }
}
