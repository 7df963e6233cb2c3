//! A work queue for controllers: deduplicating, with delayed and rate-limited adds.
//!
//! Items are usually object keys such as `"namespace/name"`. Event handlers add keys and worker
//! tasks take them with [`WorkQueue::get`], process them, and call [`WorkQueue::done`]. On failure
//! a worker calls [`WorkQueue::add_rate_limited`]; on success it calls [`WorkQueue::forget`].
//!
//! Items have a [`Priority`]: live changes are [`Live`](Priority::Live) (what `add` uses), the
//! keys of an initial list, a relist or a resync are [`Background`](Priority::Background), so
//! that a live change does not wait behind a 100,000-key backlog. With
//! [`WorkQueueConfig::fairness`], items are also grouped (say by namespace) and groups take
//! turns, so one busy group does not delay the others. Without either, the queue is client-go's
//! FIFO.
//!
//! # Invariants
//!
//! An item is in one of these states:
//!
//! * **waiting**: queued, to be handed out by `get`;
//! * **processing**: handed out by `get`, and `done` not called yet;
//! * **dirty**: added and not handed out yet. Every waiting item is dirty. An item can be
//!   dirty and processing at once if it was added again while it was being processed.
//! * **delayed**: scheduled by [`WorkQueue::add_after`] and not ready yet. This is separate from
//!   the other states: when the time comes the item is added as if by [`WorkQueue::add`].
//!
//! The queue keeps these rules:
//!
//! * An item is never both waiting and processing, and it is waiting at most once. Adding an
//!   item that is already dirty does nothing.
//! * dirty ⊇ waiting. A dirty item that is not waiting is processing. `done` queues it again.
//! * Because of this, two workers never hold the same item at the same time.
//! * An item has at most one pending delayed add, with the earliest requested ready time.
//!
//! Waiting items are kept in two **levels**, `Live` and `Background`, and within each level per
//! **group** (one group without [`WorkQueueConfig::fairness`]), FIFO within a group:
//!
//! * A waiting item is in exactly one level: the highest priority it was added with since it
//!   was last handed out. Adding a `Background` item as `Live` moves it up (its add time, used
//!   for queue latency, is kept); adding a `Live` item as `Background` changes nothing. A dirty
//!   processing item keeps that highest priority, and `done` queues it at that level.
//! * `get` takes from `Live` first, except that after
//!   [`live_burst`](WorkQueueConfig::live_burst) (default 8) `Live` items in a row while
//!   `Background` items wait, one `Background` item is handed out: `Background` never starves,
//!   and it never takes more than 1 hand-out in `live_burst + 1` while `Live` items wait.
//! * Within a level, groups with waiting items take turns, in the order they got their first
//!   waiting item; a group leaves the turns (and memory) when it has none left.
//! * Moving up leaves a stale entry behind in the `Background` FIFO, skipped when `get` reaches
//!   it (so add and get stay O(1) amortized). [`WorkQueue::len`] and the metrics count items,
//!   not entries.
//!
//! Shutting down ([`WorkQueue::shut_down`] or [`WorkQueue::shut_down_with_drain`]) follows
//! client-go's `ShutDown`:
//!
//! * Later adds (plain, delayed and rate-limited) are ignored, and pending delayed adds are
//!   dropped.
//! * Work already accepted is not lost: `get` keeps handing out waiting items, and `done` still
//!   queues an item that was added again while it was processing. `get` returns `None` only
//!   once no item is waiting, so workers that loop on `get` finish the queued work and then stop.
//! * `shut_down` returns at once. `shut_down_with_drain` returns once no item is waiting or
//!   processing, or as soon as `shut_down` is called: a second, plain shutdown is the escape
//!   hatch when workers are stuck.
//!
//! Time comes from [`tokio::time`], so a paused tokio clock (`tokio::time::pause`, or
//! `#[tokio::test(start_paused = true)]`) is the queue's injectable clock, in the role of
//! client-go's fake clock. Delayed items need no background task: they become waiting once their
//! time has come and the queue is used (`get`, `add`, `len`, ...), and `get` sleeps until the
//! earliest one is ready.

mod config;
mod delayed;
mod metrics;
pub mod rate_limiter;
#[cfg(test)]
mod tests;
mod waiting;

pub use config::WorkQueueConfig;
pub use metrics::QueueMetrics;
pub use waiting::Priority;

pub use rate_limiter::{
    default_controller_rate_limiter, BucketRateLimiter, ItemExponentialRateLimiter,
    ItemFastSlowRateLimiter, MaxOfRateLimiter, RateLimiter, WithMaxWaitRateLimiter,
};

use std::collections::HashMap;
use std::fmt;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use self::delayed::Delayed;
use self::waiting::{Ticket, Waiting};
use crate::metrics::WorkQueueMetrics;
use crate::sync::lock;

/// Used as the ready time when `now + delay` cannot be represented.
const FAR_FUTURE: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// A deduplicating work queue that can be shared by many tasks, with delayed and rate-limited
/// adds. See the [module documentation](self) for the rules it keeps.
///
/// Cloning is cheap: clones share the same queue.
///
/// # Example
///
/// ```
/// use etcd_informer::workqueue::WorkQueue;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let queue: WorkQueue<String> = WorkQueue::new();
/// queue.add("default/web".to_string());
/// queue.add("default/web".to_string()); // already waiting: no-op
/// assert_eq!(queue.len(), 1);
///
/// let worker = tokio::spawn({
///     let queue = queue.clone();
///     async move {
///         let mut handled = Vec::new();
///         while let Some(key) = queue.get().await {
///             let ok = true; // reconcile `key` here
///             if ok {
///                 queue.forget(&key);
///             } else {
///                 queue.add_rate_limited(key.clone());
///             }
///             queue.done(&key);
///             handled.push(key);
///         }
///         handled
///     }
/// });
///
/// // Let the worker finish what is queued, then stop it.
/// queue.shut_down_with_drain().await;
/// assert_eq!(worker.await.unwrap(), vec!["default/web".to_string()]);
/// # }
/// ```
pub struct WorkQueue<K> {
    inner: Arc<Inner<K>>,
}

struct Inner<K> {
    name: String,
    state: Mutex<State<K>>,
    /// Wakes `get` callers: items were queued, the earliest delayed time changed, or shutdown.
    ready: Notify,
    /// Wakes `shut_down_with_drain` callers when processing or waiting items may have gone.
    drained: Notify,
    limiter: Box<dyn RateLimiter<K>>,
}

struct State<K> {
    /// Waiting items, by level and group.
    waiting: Waiting<K>,
    /// Dirty items.
    dirty: HashMap<K, Dirty>,
    /// Processing items, with the time each was handed out.
    processing: HashMap<K, Instant>,
    delayed: Delayed<K>,
    shutting_down: bool,
    /// Number of [`WorkQueue::shut_down`] calls. A `shut_down_with_drain` stops waiting when it
    /// changes.
    forced: u64,
    adds: u64,
    retries: u64,
    queue_latency_total: Duration,
    queue_latency_count: u64,
    work_duration_total: Duration,
    work_duration_count: u64,
    /// The queue's [metrics](crate::metrics), updated with the counters above.
    metrics: WorkQueueMetrics,
}

/// What the queue knows about a dirty item.
struct Dirty {
    /// When it was added (for queue latency). Moving up to `Live` keeps it.
    added: Instant,
    /// The highest priority it was added with since it was last handed out.
    priority: Priority,
    /// Its current waiting entry; `None` while it is processing.
    waiting: Option<Ticket>,
}

impl<K: Clone + Eq + Hash> State<K> {
    fn new(name: &str, waiting: Waiting<K>) -> Self {
        Self {
            waiting,
            dirty: HashMap::new(),
            processing: HashMap::new(),
            delayed: Delayed::new(),
            shutting_down: false,
            forced: 0,
            adds: 0,
            retries: 0,
            queue_latency_total: Duration::ZERO,
            queue_latency_count: 0,
            work_duration_total: Duration::ZERO,
            work_duration_count: 0,
            metrics: WorkQueueMetrics::new(name),
        }
    }

    /// Adds `item` at `priority` as of `at`. Returns whether it became waiting.
    fn enqueue(&mut self, item: K, at: Instant, priority: Priority) -> bool {
        if self.shutting_down {
            return false;
        }
        if let Some(dirty) = self.dirty.get_mut(&item) {
            if priority.outranks(dirty.priority) {
                dirty.priority = priority;
                if dirty.waiting.is_some() {
                    // Move up: a new entry at the new level; the old one goes stale.
                    dirty.waiting = Some(self.waiting.push(item, priority));
                    self.waiting.forget_one(Priority::Background);
                }
            }
            return false;
        }
        let processing = self.processing.contains_key(&item);
        let waiting = if processing {
            None
        } else {
            Some(self.waiting.push(item.clone(), priority))
        };
        self.adds += 1;
        self.metrics.adds.increment(1);
        self.metrics.depth(self.waiting.len());
        self.dirty.insert(
            item,
            Dirty {
                added: at,
                priority,
                waiting,
            },
        );
        !processing
    }

    /// Queues a dirty item that has stopped processing, at the highest priority it was added
    /// with. Returns whether it was dirty.
    fn requeue(&mut self, item: &K) -> bool {
        let Some(dirty) = self.dirty.get_mut(item) else {
            return false;
        };
        dirty.waiting = Some(self.waiting.push(item.clone(), dirty.priority));
        self.metrics.depth(self.waiting.len());
        true
    }

    /// Takes the next waiting item, skipping stale entries.
    fn pop(&mut self) -> Option<(K, Dirty)> {
        let dirty = &self.dirty;
        let item = self
            .waiting
            .pop(|item, ticket| dirty.get(item).is_some_and(|d| d.waiting == Some(ticket)))?;
        let record = self.dirty.remove(&item)?;
        Some((item, record))
    }

    /// Adds every delayed item that is ready at `now`. Returns whether any became waiting.
    fn promote_ready(&mut self, now: Instant) -> bool {
        let mut queued = false;
        while let Some((item, at)) = self.delayed.pop_ready(now) {
            queued |= self.enqueue(item, at, Priority::Live);
        }
        queued
    }

    fn is_drained(&self) -> bool {
        self.waiting.len() == 0 && self.processing.is_empty()
    }
}

impl<K> Clone for WorkQueue<K> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<K> fmt::Debug for WorkQueue<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.inner.lock();
        f.debug_struct("WorkQueue")
            .field("name", &self.inner.name)
            .field("depth", &state.waiting.len())
            .field("processing", &state.processing.len())
            .field("delayed", &state.delayed.len())
            .field("shutting_down", &state.shutting_down)
            .finish()
    }
}

impl<K> Inner<K> {
    fn lock(&self) -> MutexGuard<'_, State<K>> {
        // No critical section can leave the state inconsistent, so a poisoned lock is still usable.
        lock(&self.state)
    }
}

impl<K> Default for WorkQueue<K>
where
    K: Clone + Eq + Hash + Send + Sync + 'static,
{
    /// Same as [`WorkQueue::new`].
    fn default() -> Self {
        Self::new()
    }
}

impl<K> WorkQueue<K>
where
    K: Clone + Eq + Hash + Send + Sync + 'static,
{
    /// Creates an unnamed queue with [`default_controller_rate_limiter`]. Same as
    /// `WorkQueue::with_config(WorkQueueConfig::new())`.
    pub fn new() -> Self {
        Self::with_config(WorkQueueConfig::new())
    }

    /// Creates a queue from `config`, like client-go's `NewTypedRateLimitingQueueWithConfig`.
    ///
    /// There is no clock to configure: the queue reads tokio's clock, so a paused tokio clock is
    /// the way to control time in tests.
    ///
    /// ```
    /// use std::time::Duration;
    /// use etcd_informer::workqueue::{ItemExponentialRateLimiter, WorkQueue, WorkQueueConfig};
    ///
    /// let queue: WorkQueue<String> = WorkQueue::with_config(
    ///     WorkQueueConfig::new()
    ///         .name("pods")
    ///         .rate_limiter(ItemExponentialRateLimiter::new(
    ///             Duration::from_millis(10),
    ///             Duration::from_secs(60),
    ///         )),
    /// );
    /// assert_eq!(queue.name(), "pods");
    /// ```
    pub fn with_config(config: WorkQueueConfig<K>) -> Self {
        let limiter = config
            .rate_limiter
            .unwrap_or_else(|| Box::new(default_controller_rate_limiter()));
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State::new(
                    &config.name,
                    Waiting::new(config.live_burst, config.fairness),
                )),
                name: config.name,
                ready: Notify::new(),
                drained: Notify::new(),
                limiter,
            }),
        }
    }

    /// Creates an unnamed queue that uses `limiter` for [`add_rate_limited`](Self::add_rate_limited).
    pub fn with_rate_limiter(limiter: Box<dyn RateLimiter<K>>) -> Self {
        Self::with_config(WorkQueueConfig::new().boxed_rate_limiter(limiter))
    }

    /// Creates a queue with a name, which appears in its tracing events and `Debug` output.
    pub fn named(name: impl Into<String>, limiter: Box<dyn RateLimiter<K>>) -> Self {
        Self::with_config(
            WorkQueueConfig::new()
                .name(name)
                .boxed_rate_limiter(limiter),
        )
    }

    /// The queue's name; empty if it was not given one.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Adds `item`. Does nothing if the item is already waiting or the queue is shutting down. If
    /// the item is processing, it is queued again when it is [`done`](Self::done).
    pub fn add(&self, item: K) {
        self.schedule(item, Duration::ZERO, false, Priority::Live);
    }

    /// Adds `item` at `priority`; [`add`](Self::add) is `add_with_priority(item, Priority::Live)`.
    ///
    /// An item already waiting as [`Background`](Priority::Background) and added as
    /// [`Live`](Priority::Live) moves up to `Live`, at the back of the `Live` items; its queue
    /// latency still counts from its first add. An item waiting as `Live` stays `Live`. An item
    /// added while processing is queued by [`done`](Self::done) at the highest priority it was
    /// added with meanwhile.
    ///
    /// ```
    /// use etcd_informer::workqueue::{Priority, WorkQueue};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let queue: WorkQueue<String> = WorkQueue::new();
    /// queue.add_with_priority("default/listed".to_string(), Priority::Background);
    /// queue.add("default/changed".to_string());
    /// assert_eq!(queue.get().await.as_deref(), Some("default/changed"));
    /// assert_eq!(queue.get().await.as_deref(), Some("default/listed"));
    /// # }
    /// ```
    pub fn add_with_priority(&self, item: K, priority: Priority) {
        self.schedule(item, Duration::ZERO, false, priority);
    }

    /// Adds `item` once `delay` has passed, as [`Live`](Priority::Live); a zero delay adds it at
    /// once.
    ///
    /// If the item already has a pending delayed add, the earlier of the two ready times is kept.
    /// A delayed add does not change an item that is already waiting, and an
    /// [`add`](Self::add) does not cancel a pending delayed add.
    pub fn add_after(&self, item: K, delay: Duration) {
        self.schedule(item, delay, false, Priority::Live);
    }

    /// Adds `item` after the delay its rate limiter gives, as [`Live`](Priority::Live), and counts
    /// a retry.
    ///
    /// This is `add_after(item, limiter.when(&item))`. Does nothing, and does not ask the
    /// limiter, if the queue is shutting down.
    pub fn add_rate_limited(&self, item: K) {
        if self.is_shutting_down() {
            return;
        }
        let delay = self.inner.limiter.when(&item);
        self.schedule(item, delay, true, Priority::Live);
    }

    /// Clears the rate limiter's failure history for `item`. Call it when the item succeeds. It
    /// does not affect the item's place in the queue.
    pub fn forget(&self, item: &K) {
        self.inner.limiter.forget(item);
    }

    /// How many rate-limited retries of `item` the limiter has counted since it was last
    /// forgotten.
    pub fn num_requeues(&self, item: &K) -> u32 {
        self.inner.limiter.num_requeues(item)
    }

    fn schedule(&self, item: K, delay: Duration, retry: bool, priority: Priority) {
        let now = Instant::now();
        let mut state = self.inner.lock();
        if state.shutting_down {
            return;
        }
        if retry {
            state.retries += 1;
            state.metrics.retries.increment(1);
        }
        let mut queued = state.promote_ready(now);
        let mut earlier_deadline = false;
        if delay.is_zero() {
            queued |= state.enqueue(item, now, priority);
        } else {
            let at = now
                .checked_add(delay)
                .or_else(|| now.checked_add(FAR_FUTURE))
                .unwrap_or(now);
            let previous = state.delayed.next_ready();
            earlier_deadline = state.delayed.insert(item, at) && previous.is_none_or(|p| at < p);
        }
        drop(state);
        if earlier_deadline {
            // Every sleeping `get` must recompute how long to sleep.
            self.inner.ready.notify_waiters();
        }
        if queued {
            self.inner.ready.notify_one();
        }
    }

    /// Waits for an item and hands it out. The item stays processing until
    /// [`done`](Self::done) is called for it.
    ///
    /// Returns `None` once the queue is shutting down and no item is waiting. Items already
    /// waiting when the queue was shut down are still handed out first.
    ///
    /// Cancel safe: if the future is dropped, no item is lost.
    pub async fn get(&self) -> Option<K> {
        loop {
            // Register for wake-ups before looking at the state, so none is missed in between.
            let notified = self.inner.ready.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();

            let next_ready = {
                let now = Instant::now();
                let mut state = self.inner.lock();
                state.promote_ready(now);
                if let Some((item, dirty)) = state.pop() {
                    let waited = now.saturating_duration_since(dirty.added);
                    state.queue_latency_total += waited;
                    state.queue_latency_count += 1;
                    state.metrics.waited(waited);
                    state.metrics.depth(state.waiting.len());
                    state.processing.insert(item.clone(), now);
                    let more = state.waiting.len() > 0;
                    drop(state);
                    if more {
                        // Pass the wake-up on in case other callers are waiting.
                        self.inner.ready.notify_one();
                    }
                    return Some(item);
                }
                if state.shutting_down {
                    return None;
                }
                state.delayed.next_ready()
            };

            match next_ready {
                Some(at) => {
                    let _ = tokio::time::timeout_at(at, notified).await;
                }
                None => notified.await,
            }
        }
    }

    /// Marks `item` as no longer processing. If it was added again while processing, it is
    /// queued now. Does nothing if the item is not processing.
    pub fn done(&self, item: &K) {
        let now = Instant::now();
        let mut state = self.inner.lock();
        let Some(started) = state.processing.remove(item) else {
            return;
        };
        let worked = now.saturating_duration_since(started);
        state.work_duration_total += worked;
        state.work_duration_count += 1;
        state.metrics.worked(worked);
        // A dirty item was added before any shutdown (later adds are ignored), so it is queued
        // even when shutting down.
        let queued = state.requeue(item);
        let shutting_down = state.shutting_down;
        drop(state);
        if queued {
            self.inner.ready.notify_one();
        }
        if shutting_down {
            self.inner.drained.notify_waiters();
        }
    }

    /// Shuts the queue down without waiting, like client-go's `ShutDown`. Later adds are ignored
    /// and pending delayed adds are dropped. Items already waiting are still handed out by
    /// `get`, and items added again while processing are queued by `done` as usual; once no item
    /// is waiting, every `get` returns `None`, including callers already waiting.
    ///
    /// Also releases every [`shut_down_with_drain`](Self::shut_down_with_drain) that is waiting:
    /// call it a second time (e.g. on a second signal) when workers are stuck.
    pub fn shut_down(&self) {
        {
            let mut state = self.inner.lock();
            state.shutting_down = true;
            state.forced += 1;
            state.delayed.clear();
        }
        tracing::debug!(queue = %self.inner.name, "work queue shut down");
        self.inner.ready.notify_waiters();
        self.inner.drained.notify_waiters();
    }

    /// Shuts the queue down like [`shut_down`](Self::shut_down), then waits until no item is
    /// waiting or processing, like client-go's `ShutDownWithDrain`.
    ///
    /// Workers must keep calling `get` and `done`, or this never returns on its own. A
    /// [`shut_down`](Self::shut_down) call, before this returns, makes it return at once.
    pub async fn shut_down_with_drain(&self) {
        let forced = {
            let mut state = self.inner.lock();
            state.shutting_down = true;
            state.delayed.clear();
            state.forced
        };
        tracing::debug!(queue = %self.inner.name, "work queue draining");
        // Callers waiting on an empty queue can return `None` now.
        self.inner.ready.notify_waiters();
        loop {
            let notified = self.inner.drained.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            {
                let state = self.inner.lock();
                if state.forced != forced {
                    tracing::debug!(queue = %self.inner.name, "work queue drain cut short by shut_down");
                    return;
                }
                if state.is_drained() {
                    break;
                }
            }
            notified.await;
        }
        tracing::debug!(queue = %self.inner.name, "work queue drained");
    }

    /// Whether [`shut_down`](Self::shut_down) or [`shut_down_with_drain`](Self::shut_down_with_drain)
    /// has been called.
    pub fn is_shutting_down(&self) -> bool {
        self.inner.lock().shutting_down
    }

    /// Number of waiting items. Processing items and items with a pending delayed add are not
    /// counted.
    pub fn len(&self) -> usize {
        self.promote_and_lock().waiting.len()
    }

    /// Whether no item is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A snapshot of the queue's counters. Also refreshes the queue's in-flight
    /// [metrics](crate::metrics) (`unfinished_work_seconds`, `longest_running_processor_seconds`),
    /// which a [`Runner`](crate::runner::Runner) does every second.
    pub fn metrics(&self) -> QueueMetrics {
        let now = Instant::now();
        let state = self.promote_and_lock();
        let running = || {
            state
                .processing
                .values()
                .map(|started| now.saturating_duration_since(*started))
        };
        let longest_running = running().max();
        let unfinished_work = running().sum();
        state.metrics.in_flight(unfinished_work, longest_running);
        QueueMetrics {
            depth: state.waiting.len(),
            background_depth: state.waiting.len_of(Priority::Background),
            delayed: state.delayed.len(),
            processing: state.processing.len(),
            adds: state.adds,
            retries: state.retries,
            longest_running,
            unfinished_work,
            queue_latency_total: state.queue_latency_total,
            queue_latency_count: state.queue_latency_count,
            work_duration_total: state.work_duration_total,
            work_duration_count: state.work_duration_count,
        }
    }

    /// Locks the state after moving ready delayed items into the queue.
    fn promote_and_lock(&self) -> MutexGuard<'_, State<K>> {
        let mut state = self.inner.lock();
        if state.promote_ready(Instant::now()) {
            // A sleeping `get` would wake by itself at that time. This covers the case where it
            // has not been polled since.
            self.inner.ready.notify_one();
        }
        state
    }
}
