//! A work queue for controllers: deduplicating, with delayed and rate-limited adds.
//!
//! Items are usually object keys such as `"namespace/name"`. Event handlers add keys and worker
//! tasks take them with [`WorkQueue::get`], process them, and call [`WorkQueue::done`]. On failure
//! a worker calls [`WorkQueue::add_rate_limited`]; on success it calls [`WorkQueue::forget`].
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

pub mod rate_limiter;

pub use rate_limiter::{
    default_controller_rate_limiter, BucketRateLimiter, ItemExponentialRateLimiter,
    ItemFastSlowRateLimiter, MaxOfRateLimiter, RateLimiter, WithMaxWaitRateLimiter,
};

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::fmt;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::metrics::WorkQueueMetrics;

/// Used as the ready time when `now + delay` cannot be represented.
const FAR_FUTURE: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// A snapshot of a queue's counters, from [`WorkQueue::metrics`].
///
/// Durations are measured on the tokio clock.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueMetrics {
    /// Number of waiting items (same as [`WorkQueue::len`]).
    pub depth: usize,
    /// Number of items with a pending delayed add.
    pub delayed: usize,
    /// Number of items handed out and not yet `done`.
    pub processing: usize,
    /// Items added to the queue. Adds of an item that was already dirty are not counted. A
    /// delayed add counts once the item is ready.
    pub adds: u64,
    /// Calls to [`WorkQueue::add_rate_limited`] that the queue accepted.
    pub retries: u64,
    /// How long the longest-running item still processing has been processing.
    pub longest_running: Option<Duration>,
    /// How long the items still processing have been processing, summed (client-go's
    /// `unfinished_work_seconds`).
    pub unfinished_work: Duration,
    /// Total time items waited between being added (or becoming ready) and being handed out.
    pub queue_latency_total: Duration,
    /// Number of waits summed in `queue_latency_total`, which is the number of items handed out.
    pub queue_latency_count: u64,
    /// Total time between handing an item out and its `done`.
    pub work_duration_total: Duration,
    /// Number of `done` calls summed in `work_duration_total`.
    pub work_duration_count: u64,
}

impl QueueMetrics {
    /// Mean time from add to `get`, or `None` if nothing has been handed out.
    pub fn mean_queue_latency(&self) -> Option<Duration> {
        mean(self.queue_latency_total, self.queue_latency_count)
    }

    /// Mean time from `get` to `done`, or `None` if nothing has been done.
    pub fn mean_work_duration(&self) -> Option<Duration> {
        mean(self.work_duration_total, self.work_duration_count)
    }
}

fn mean(total: Duration, count: u64) -> Option<Duration> {
    if count == 0 {
        return None;
    }
    let nanos = total.as_nanos() / u128::from(count);
    // nanos <= total.as_nanos(), so the seconds fit in a u64.
    Some(Duration::new(
        (nanos / 1_000_000_000) as u64,
        (nanos % 1_000_000_000) as u32,
    ))
}

/// How to build a [`WorkQueue`], for [`WorkQueue::with_config`]: client-go's
/// `TypedRateLimitingQueueConfig`.
///
/// Start from [`WorkQueueConfig::new`] (or `Default`) and chain the setters. Unset fields keep
/// their defaults: no name, and [`default_controller_rate_limiter`] (client-go's
/// `DefaultControllerRateLimiter`). Fields are private so that more can be added later.
///
/// There is no clock setting: the queue and the limiters in this crate read tokio's clock, so
/// pausing it (`tokio::time::pause`) is how tests control time.
///
/// ```
/// use std::time::Duration;
/// use etcd_informer::workqueue::{ItemFastSlowRateLimiter, WorkQueue, WorkQueueConfig};
///
/// let config = WorkQueueConfig::new()
///     .name("nodes")
///     .rate_limiter(ItemFastSlowRateLimiter::new(
///         Duration::from_millis(5),
///         Duration::from_secs(10),
///         3,
///     ));
/// let queue: WorkQueue<String> = WorkQueue::with_config(config);
/// assert_eq!(queue.name(), "nodes");
/// ```
pub struct WorkQueueConfig<K> {
    name: String,
    /// `None` means [`default_controller_rate_limiter`].
    rate_limiter: Option<Box<dyn RateLimiter<K>>>,
}

impl<K> WorkQueueConfig<K> {
    /// The defaults: no name, [`default_controller_rate_limiter`].
    pub fn new() -> Self {
        Self {
            name: String::new(),
            rate_limiter: None,
        }
    }

    /// Sets the queue's name, which appears in its tracing events and `Debug` output.
    #[must_use]
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Sets the limiter used by [`WorkQueue::add_rate_limited`]. A `Box<dyn RateLimiter<K>>` or
    /// an `Arc` of a limiter is accepted as well.
    #[must_use]
    pub fn rate_limiter(self, limiter: impl RateLimiter<K> + 'static) -> Self {
        self.boxed_rate_limiter(Box::new(limiter))
    }

    fn boxed_rate_limiter(mut self, limiter: Box<dyn RateLimiter<K>>) -> Self {
        self.rate_limiter = Some(limiter);
        self
    }
}

impl<K> Default for WorkQueueConfig<K> {
    /// Same as [`WorkQueueConfig::new`].
    fn default() -> Self {
        Self::new()
    }
}

impl<K> fmt::Debug for WorkQueueConfig<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkQueueConfig")
            .field("name", &self.name)
            .field(
                "rate_limiter",
                &if self.rate_limiter.is_some() {
                    "custom"
                } else {
                    "default_controller_rate_limiter"
                },
            )
            .finish()
    }
}

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
    /// Waiting items, in order.
    queue: VecDeque<K>,
    /// Dirty items, with the time each was added (for queue latency).
    dirty: HashMap<K, Instant>,
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

/// Items waiting for a delayed add. A heap ordered by ready time. An item whose ready time is
/// moved earlier leaves its old heap entry behind, and that entry is skipped later.
struct Delayed<K> {
    heap: BinaryHeap<Reverse<(Instant, u64)>>,
    by_seq: HashMap<u64, K>,
    by_item: HashMap<K, (Instant, u64)>,
    next_seq: u64,
}

impl<K> Delayed<K> {
    fn len(&self) -> usize {
        self.by_item.len()
    }
}

impl<K: Clone + Eq + Hash> Delayed<K> {
    fn new() -> Self {
        Self {
            heap: BinaryHeap::new(),
            by_seq: HashMap::new(),
            by_item: HashMap::new(),
            next_seq: 0,
        }
    }

    /// Schedules `item` at `at` unless it is already scheduled no later. Returns whether the
    /// schedule changed.
    fn insert(&mut self, item: K, at: Instant) -> bool {
        if let Some(&(current, seq)) = self.by_item.get(&item) {
            if current <= at {
                return false;
            }
            self.by_seq.remove(&seq);
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.heap.push(Reverse((at, seq)));
        self.by_seq.insert(seq, item.clone());
        self.by_item.insert(item, (at, seq));
        true
    }

    /// The earliest ready time, dropping stale heap entries on the way.
    fn next_ready(&mut self) -> Option<Instant> {
        while let Some(&Reverse((at, seq))) = self.heap.peek() {
            if self.by_seq.contains_key(&seq) {
                return Some(at);
            }
            self.heap.pop();
        }
        None
    }

    /// Removes and returns an item whose ready time is at or before `now`, with that time.
    fn pop_ready(&mut self, now: Instant) -> Option<(K, Instant)> {
        while let Some(&Reverse((at, seq))) = self.heap.peek() {
            if at > now {
                return None;
            }
            self.heap.pop();
            if let Some(item) = self.by_seq.remove(&seq) {
                self.by_item.remove(&item);
                return Some((item, at));
            }
        }
        None
    }

    fn clear(&mut self) {
        self.heap.clear();
        self.by_seq.clear();
        self.by_item.clear();
    }
}

impl<K: Clone + Eq + Hash> State<K> {
    fn new(name: &str) -> Self {
        Self {
            queue: VecDeque::new(),
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

    /// Adds `item` as of `at`. Returns whether it became waiting.
    fn enqueue(&mut self, item: K, at: Instant) -> bool {
        if self.shutting_down || self.dirty.contains_key(&item) {
            return false;
        }
        self.adds += 1;
        self.metrics.adds.increment(1);
        let processing = self.processing.contains_key(&item);
        if !processing {
            self.queue.push_back(item.clone());
            self.metrics.depth(self.queue.len());
        }
        self.dirty.insert(item, at);
        !processing
    }

    /// Adds every delayed item that is ready at `now`. Returns whether any became waiting.
    fn promote_ready(&mut self, now: Instant) -> bool {
        let mut queued = false;
        while let Some((item, at)) = self.delayed.pop_ready(now) {
            queued |= self.enqueue(item, at);
        }
        queued
    }

    fn is_drained(&self) -> bool {
        self.queue.is_empty() && self.processing.is_empty()
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
            .field("depth", &state.queue.len())
            .field("processing", &state.processing.len())
            .field("delayed", &state.delayed.len())
            .field("shutting_down", &state.shutting_down)
            .finish()
    }
}

impl<K> Inner<K> {
    fn lock(&self) -> MutexGuard<'_, State<K>> {
        // No critical section can leave the state inconsistent, so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
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
                state: Mutex::new(State::new(&config.name)),
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
        self.schedule(item, Duration::ZERO, false);
    }

    /// Adds `item` once `delay` has passed; a zero delay adds it at once.
    ///
    /// If the item already has a pending delayed add, the earlier of the two ready times is kept.
    /// A delayed add does not change an item that is already waiting, and an
    /// [`add`](Self::add) does not cancel a pending delayed add.
    pub fn add_after(&self, item: K, delay: Duration) {
        self.schedule(item, delay, false);
    }

    /// Adds `item` after the delay its rate limiter gives, and counts a retry.
    ///
    /// This is `add_after(item, limiter.when(&item))`. Does nothing, and does not ask the
    /// limiter, if the queue is shutting down.
    pub fn add_rate_limited(&self, item: K) {
        if self.is_shutting_down() {
            return;
        }
        let delay = self.inner.limiter.when(&item);
        self.schedule(item, delay, true);
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

    fn schedule(&self, item: K, delay: Duration, retry: bool) {
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
            queued |= state.enqueue(item, now);
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
                if let Some(item) = state.queue.pop_front() {
                    let added = state.dirty.remove(&item).unwrap_or(now);
                    let waited = now.saturating_duration_since(added);
                    state.queue_latency_total += waited;
                    state.queue_latency_count += 1;
                    state.metrics.waited(waited);
                    state.metrics.depth(state.queue.len());
                    state.processing.insert(item.clone(), now);
                    let more = !state.queue.is_empty();
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
        let queued = state.dirty.contains_key(item);
        if queued {
            state.queue.push_back(item.clone());
            state.metrics.depth(state.queue.len());
        }
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
        self.promote_and_lock().queue.len()
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
            depth: state.queue.len(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use tokio::time::{advance, timeout};

    const MS: Duration = Duration::from_millis(1);

    fn queue() -> WorkQueue<String> {
        WorkQueue::new()
    }

    fn s(v: &str) -> String {
        v.to_string()
    }

    /// Lets spawned tasks run until they block.
    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    /// Whether `get` would return something within `wait` (of paused time).
    async fn try_get(q: &WorkQueue<String>, wait: Duration) -> Option<String> {
        timeout(wait, q.get()).await.ok().flatten()
    }

    #[tokio::test(start_paused = true)]
    async fn add_dedups_waiting_items_and_keeps_order() {
        let q = queue();
        q.add(s("a"));
        q.add(s("b"));
        q.add(s("a"));
        q.add(s("c"));
        q.add(s("b"));
        assert_eq!(q.len(), 3);
        assert_eq!(q.get().await, Some(s("a")));
        assert_eq!(q.get().await, Some(s("b")));
        assert_eq!(q.get().await, Some(s("c")));
        assert!(q.is_empty());
        assert_eq!(try_get(&q, Duration::from_secs(1)).await, None);
        assert_eq!(q.metrics().adds, 3);
    }

    #[tokio::test(start_paused = true)]
    async fn processing_item_is_not_handed_out_twice() {
        let q = queue();
        q.add(s("a"));
        let item = q.get().await.unwrap();
        assert_eq!(item, "a");

        // Re-added while processing: dirty, not waiting.
        q.add(s("a"));
        q.add(s("a"));
        assert_eq!(q.len(), 0);
        assert_eq!(try_get(&q, Duration::from_secs(10)).await, None);

        // Done queues it again, once.
        q.done(&item);
        assert_eq!(q.len(), 1);
        assert_eq!(q.get().await, Some(s("a")));
        assert_eq!(q.len(), 0);
        q.done(&s("a"));
        assert_eq!(q.len(), 0);
        assert_eq!(try_get(&q, Duration::from_secs(10)).await, None);
        assert_eq!(q.metrics().adds, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn done_for_unknown_item_is_a_no_op() {
        let q = queue();
        q.add(s("a"));
        // "a" is waiting, not processing: done must not queue a duplicate.
        q.done(&s("a"));
        q.done(&s("zzz"));
        assert_eq!(q.len(), 1);
        assert_eq!(q.metrics().work_duration_count, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_get_is_woken_by_add_from_another_task() {
        let q = queue();
        let getter = tokio::spawn({
            let q = q.clone();
            async move { q.get().await }
        });
        settle().await;
        assert!(!getter.is_finished());
        let adder = tokio::spawn({
            let q = q.clone();
            async move { q.add(s("x")) }
        });
        adder.await.unwrap();
        assert_eq!(getter.await.unwrap(), Some(s("x")));
    }

    #[tokio::test(start_paused = true)]
    async fn cancelled_get_loses_nothing() {
        let q = queue();
        assert_eq!(try_get(&q, 5 * MS).await, None);
        let getters: Vec<_> = (0..3)
            .map(|_| {
                let q = q.clone();
                tokio::spawn(async move { q.get().await })
            })
            .collect();
        settle().await;
        // Cancel one waiting getter, then add two items: the other two must get them.
        getters[0].abort();
        settle().await;
        q.add(s("a"));
        q.add(s("b"));
        let mut got = Vec::new();
        for g in getters.into_iter().skip(1) {
            got.push(g.await.unwrap().unwrap());
        }
        got.sort();
        assert_eq!(got, vec![s("a"), s("b")]);
    }

    #[tokio::test(start_paused = true)]
    async fn workers_never_hold_the_same_item_at_once() {
        let q = queue();
        let in_flight = Arc::new(Mutex::new(HashSet::new()));
        let processed = Arc::new(Mutex::new(0u32));
        let mut workers = Vec::new();
        for _ in 0..4 {
            let (q, in_flight, processed) = (q.clone(), in_flight.clone(), processed.clone());
            workers.push(tokio::spawn(async move {
                while let Some(key) = q.get().await {
                    assert!(
                        in_flight.lock().unwrap().insert(key.clone()),
                        "{key} held twice"
                    );
                    tokio::time::sleep(10 * MS).await;
                    assert!(in_flight.lock().unwrap().remove(&key));
                    *processed.lock().unwrap() += 1;
                    q.done(&key);
                }
            }));
        }
        // Keep re-adding the same two keys while they are being processed.
        for i in 0..200 {
            q.add(format!("k{}", i % 2));
            tokio::time::sleep(MS).await;
        }
        q.shut_down_with_drain().await;
        for w in workers {
            w.await.unwrap();
        }
        assert!(in_flight.lock().unwrap().is_empty());
        // Each key is processed for 10 ms at a time, and re-adds while it is processing collapse,
        // so there are far fewer runs than adds.
        let runs = *processed.lock().unwrap();
        assert!((2..=60).contains(&runs), "runs = {runs}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn workers_never_hold_the_same_item_at_once_multi_thread() {
        let q: WorkQueue<u32> = WorkQueue::new();
        let in_flight = Arc::new(Mutex::new(HashSet::new()));
        let mut workers = Vec::new();
        for _ in 0..4 {
            let (q, in_flight) = (q.clone(), in_flight.clone());
            workers.push(tokio::spawn(async move {
                let mut n = 0u32;
                while let Some(key) = q.get().await {
                    assert!(in_flight.lock().unwrap().insert(key), "{key} held twice");
                    tokio::task::yield_now().await;
                    assert!(in_flight.lock().unwrap().remove(&key));
                    q.done(&key);
                    n += 1;
                }
                n
            }));
        }
        let producers: Vec<_> = (0..2)
            .map(|p| {
                let q = q.clone();
                tokio::spawn(async move {
                    for i in 0..2000u32 {
                        q.add((i + p) % 8);
                        if i % 16 == 0 {
                            tokio::task::yield_now().await;
                        }
                    }
                })
            })
            .collect();
        for p in producers {
            p.await.unwrap();
        }
        timeout(Duration::from_secs(60), q.shut_down_with_drain())
            .await
            .expect("drain hung");
        let mut total = 0;
        for w in workers {
            total += w.await.unwrap();
        }
        assert!(total >= 8);
        let m = q.metrics();
        assert_eq!(m.processing, 0);
        assert_eq!(m.depth, 0);
        assert_eq!(u64::from(total), m.queue_latency_count);
        assert_eq!(
            m.adds, m.queue_latency_count,
            "every accepted add was handed out once"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shut_down_racing_with_gets_releases_them_all() {
        for _ in 0..50 {
            let q: WorkQueue<u32> = WorkQueue::new();
            let getters: Vec<_> = (0..8)
                .map(|_| {
                    let q = q.clone();
                    tokio::spawn(async move { q.get().await })
                })
                .collect();
            q.shut_down();
            for g in getters {
                let got = timeout(Duration::from_secs(30), g)
                    .await
                    .expect("get not woken");
                assert_eq!(got.unwrap(), None);
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn add_after_waits_for_the_delay() {
        let q = queue();
        q.add_after(s("a"), Duration::from_secs(1));
        assert_eq!(q.len(), 0);
        assert_eq!(q.metrics().delayed, 1);
        advance(999 * MS).await;
        assert_eq!(q.len(), 0);
        advance(MS).await;
        assert_eq!(q.len(), 1);
        assert_eq!(q.metrics().delayed, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn add_after_zero_adds_at_once() {
        let q = queue();
        q.add_after(s("a"), Duration::ZERO);
        assert_eq!(q.len(), 1);
        assert_eq!(q.metrics().delayed, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn add_after_keeps_earliest_ready_time() {
        // Earlier request second.
        let q = queue();
        q.add_after(s("a"), Duration::from_secs(10));
        q.add_after(s("a"), Duration::from_secs(1));
        // Earlier request first.
        q.add_after(s("b"), Duration::from_secs(2));
        q.add_after(s("b"), Duration::from_secs(20));
        assert_eq!(q.metrics().delayed, 2);

        advance(999 * MS).await;
        assert_eq!(q.len(), 0);
        advance(MS).await;
        assert_eq!(q.len(), 1, "a ready at 1 s, not 10 s");
        assert_eq!(q.get().await, Some(s("a")));
        q.done(&s("a"));
        advance(999 * MS).await;
        assert_eq!(q.len(), 0);
        advance(MS).await;
        assert_eq!(q.len(), 1, "b ready at 2 s, not 20 s");
        assert_eq!(q.get().await, Some(s("b")));
        q.done(&s("b"));

        // The later requests were absorbed: nothing comes back at 10 s or 20 s.
        advance(Duration::from_secs(30)).await;
        assert_eq!(q.len(), 0);
        assert_eq!(q.metrics().adds, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn get_sleeps_until_delayed_item_is_ready() {
        let q = queue();
        let start = Instant::now();
        q.add_after(s("a"), Duration::from_secs(3));
        assert_eq!(q.get().await, Some(s("a")));
        assert_eq!(start.elapsed(), Duration::from_secs(3));
    }

    #[tokio::test(start_paused = true)]
    async fn earlier_delayed_add_wakes_sleeping_get() {
        let q = queue();
        let start = Instant::now();
        q.add_after(s("late"), Duration::from_secs(10));
        let getter = tokio::spawn({
            let q = q.clone();
            async move { (q.get().await, Instant::now()) }
        });
        settle().await;
        q.add_after(s("early"), Duration::from_secs(1));
        let (item, at) = getter.await.unwrap();
        assert_eq!(item, Some(s("early")));
        assert_eq!(at - start, Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn delayed_add_of_waiting_item_is_deduplicated() {
        let q = queue();
        q.add(s("a"));
        q.add_after(s("a"), 5 * MS);
        advance(10 * MS).await;
        assert_eq!(q.len(), 1);
        assert_eq!(q.metrics().adds, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn delayed_item_ready_while_processing_waits_for_done() {
        let q = queue();
        q.add(s("a"));
        let a = q.get().await.unwrap();
        q.add_after(s("a"), 5 * MS);
        advance(10 * MS).await;
        assert_eq!(q.len(), 0);
        q.done(&a);
        assert_eq!(q.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn add_rate_limited_backs_off_exponentially_and_forget_resets() {
        let q = queue();
        let key = s("a");
        for (n, expected) in [5u64, 10, 20, 40].into_iter().enumerate() {
            let start = Instant::now();
            q.add_rate_limited(key.clone());
            assert_eq!(q.num_requeues(&key), n as u32 + 1);
            assert_eq!(q.len(), 0);
            assert_eq!(q.get().await, Some(key.clone()));
            assert_eq!(start.elapsed(), Duration::from_millis(expected));
            q.done(&key);
        }
        assert_eq!(q.metrics().retries, 4);

        q.forget(&key);
        assert_eq!(q.num_requeues(&key), 0);
        let start = Instant::now();
        q.add_rate_limited(key.clone());
        assert_eq!(q.get().await, Some(key.clone()));
        assert_eq!(start.elapsed(), 5 * MS);
    }

    #[tokio::test(start_paused = true)]
    async fn custom_rate_limiter_is_used() {
        struct Constant;
        impl RateLimiter<String> for Constant {
            fn when(&self, _: &String) -> Duration {
                Duration::from_secs(7)
            }
            fn forget(&self, _: &String) {}
            fn num_requeues(&self, _: &String) -> u32 {
                42
            }
        }
        let q = WorkQueue::named("custom", Box::new(Constant));
        assert_eq!(q.name(), "custom");
        assert_eq!(q.num_requeues(&s("a")), 42);
        let start = Instant::now();
        q.add_rate_limited(s("a"));
        assert_eq!(q.get().await, Some(s("a")));
        assert_eq!(start.elapsed(), Duration::from_secs(7));
    }

    #[tokio::test(start_paused = true)]
    async fn shut_down_wakes_all_waiting_gets() {
        let q = queue();
        q.add_after(s("later"), Duration::from_secs(60));
        let getters: Vec<_> = (0..3)
            .map(|_| {
                let q = q.clone();
                tokio::spawn(async move { (q.get().await, Instant::now()) })
            })
            .collect();
        settle().await;
        let start = Instant::now();
        q.shut_down();
        assert!(q.is_shutting_down());
        for g in getters {
            let (item, at) = g.await.unwrap();
            assert_eq!(item, None);
            assert_eq!(at, start, "woken promptly");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn shut_down_keeps_queued_items_and_ignores_adds() {
        let q = queue();
        q.add(s("a"));
        q.add(s("b"));
        let a = q.get().await.unwrap();
        q.add(s("a")); // dirty while processing
        q.add_after(s("c"), MS);
        q.shut_down();
        // The waiting item is still handed out; the delayed one is dropped.
        assert_eq!(q.len(), 1);
        let b = q.get().await.unwrap();
        assert_eq!(b, "b");
        assert_eq!(q.get().await, None);
        assert_eq!(q.len(), 0);

        q.add(s("d"));
        q.add_after(s("e"), MS);
        q.add_rate_limited(s("f"));
        assert_eq!(
            q.num_requeues(&s("f")),
            0,
            "limiter not consulted after shutdown"
        );
        advance(Duration::from_secs(1)).await;
        // "a" was added again before the shutdown: done queues it.
        q.done(&a);
        assert_eq!(q.get().await, Some(s("a")));
        q.done(&a);
        q.done(&b);
        let m = q.metrics();
        assert_eq!((m.depth, m.delayed, m.processing, m.retries), (0, 0, 0, 0));
        assert_eq!(q.get().await, None);
    }

    #[tokio::test(start_paused = true)]
    async fn shut_down_with_drain_waits_for_processing_items() {
        let q = queue();
        q.add(s("a"));
        q.add(s("b"));
        q.add_after(s("delayed"), MS);
        let a = q.get().await.unwrap();

        let drain = tokio::spawn({
            let q = q.clone();
            async move { q.shut_down_with_drain().await }
        });
        settle().await;
        assert!(q.is_shutting_down());
        assert!(!drain.is_finished());

        // New adds are ignored, but the waiting item is still handed out.
        q.add(s("c"));
        assert_eq!(q.len(), 1);
        let b = q.get().await.unwrap();
        assert_eq!(b, "b");
        // Nothing waiting any more: get returns None although items are processing.
        assert_eq!(q.get().await, None);

        q.done(&a);
        settle().await;
        assert!(!drain.is_finished(), "b is still processing");
        advance(Duration::from_secs(1)).await;
        assert!(!drain.is_finished());

        q.done(&b);
        drain.await.unwrap();
        assert_eq!(q.get().await, None);
        assert_eq!(q.metrics().delayed, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn shut_down_with_drain_requeues_items_dirtied_before_shutdown() {
        let q = queue();
        q.add(s("a"));
        let a = q.get().await.unwrap();
        q.add(s("a")); // accepted before shutdown
        let drain = tokio::spawn({
            let q = q.clone();
            async move { q.shut_down_with_drain().await }
        });
        settle().await;
        q.done(&a);
        settle().await;
        assert!(!drain.is_finished());
        assert_eq!(q.get().await, Some(s("a")));
        q.done(&a);
        drain.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn shut_down_with_drain_on_idle_queue_returns_and_releases_gets() {
        let q = queue();
        let getter = tokio::spawn({
            let q = q.clone();
            async move { q.get().await }
        });
        settle().await;
        q.shut_down_with_drain().await;
        assert_eq!(getter.await.unwrap(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn shut_down_during_drain_releases_the_drain_and_keeps_waiting_items() {
        let q = queue();
        q.add(s("a"));
        q.add(s("b"));
        let a = q.get().await.unwrap();
        let drain = tokio::spawn({
            let q = q.clone();
            async move { q.shut_down_with_drain().await }
        });
        settle().await;
        assert!(!drain.is_finished());
        q.shut_down();
        drain.await.unwrap();
        assert_eq!(q.get().await, Some(s("b")), "b still handed out");
        assert_eq!(q.get().await, None);
        q.done(&a);
        // A new drain waits for b, and a later shut_down releases it too.
        let drain = tokio::spawn({
            let q = q.clone();
            async move { q.shut_down_with_drain().await }
        });
        settle().await;
        assert!(!drain.is_finished());
        q.shut_down();
        drain.await.unwrap();
        q.done(&s("b"));
        q.shut_down_with_drain().await;
    }

    #[tokio::test(start_paused = true)]
    async fn metrics_count_adds_retries_and_durations() {
        let q = queue();
        assert_eq!(q.metrics(), QueueMetrics::default());
        assert_eq!(q.metrics().mean_queue_latency(), None);
        assert_eq!(q.metrics().mean_work_duration(), None);

        q.add(s("a"));
        q.add(s("a"));
        q.add(s("b"));
        let m = q.metrics();
        assert_eq!((m.depth, m.adds, m.retries), (2, 2, 0));

        advance(Duration::from_secs(3)).await;
        let a = q.get().await.unwrap();
        advance(Duration::from_secs(1)).await;
        let b = q.get().await.unwrap();
        advance(Duration::from_secs(2)).await;
        let m = q.metrics();
        assert_eq!(m.processing, 2);
        assert_eq!(m.longest_running, Some(Duration::from_secs(3)));
        assert_eq!(m.queue_latency_total, Duration::from_secs(7));
        assert_eq!(m.queue_latency_count, 2);
        assert_eq!(m.mean_queue_latency(), Some(Duration::from_millis(3500)));

        q.done(&a);
        advance(Duration::from_secs(4)).await;
        q.done(&b);
        let m = q.metrics();
        assert_eq!(m.longest_running, None);
        assert_eq!(m.work_duration_total, Duration::from_secs(3 + 6));
        assert_eq!(m.work_duration_count, 2);
        assert_eq!(m.mean_work_duration(), Some(Duration::from_millis(4500)));

        // A rate-limited add counts as a retry now and as an add once ready. Queue latency for a
        // delayed item starts at its ready time.
        q.add_rate_limited(s("c"));
        let m = q.metrics();
        assert_eq!((m.retries, m.adds, m.delayed, m.depth), (1, 2, 1, 0));
        advance(Duration::from_secs(1)).await;
        let m = q.metrics();
        assert_eq!((m.retries, m.adds, m.delayed, m.depth), (1, 3, 0, 1));
        q.get().await.unwrap();
        assert_eq!(
            q.metrics().queue_latency_total,
            Duration::from_secs(7) + Duration::from_secs(1) - 5 * MS
        );
    }

    #[test]
    fn queue_and_futures_are_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>(_: &T) {}
        fn assert_send<T: Send>(_: &T) {}
        let q: WorkQueue<String> = WorkQueue::default();
        assert_send_sync(&q);
        assert_send(&q.get());
        assert_send(&q.shut_down_with_drain());
        assert!(format!("{q:?}").contains("WorkQueue"));
    }

    #[test]
    fn usable_without_a_runtime_except_get() {
        // Construction, adds and inspection need no tokio runtime.
        let q: WorkQueue<u8> = WorkQueue::new();
        q.add(1);
        q.add_after(2, Duration::from_secs(1));
        q.add_rate_limited(3);
        assert_eq!(q.len(), 1);
        assert_eq!(q.num_requeues(&3), 1);
        q.shut_down();
        assert_eq!(q.len(), 1, "queued work survives shutdown");
        q.add(4);
        assert_eq!(q.len(), 1);
    }
}
