//! How a [`WorkQueue`](super::WorkQueue) is set up: its name, rate limiter, priority turns and
//! fairness groups.

use std::fmt;

use super::rate_limiter::RateLimiter;
use super::waiting::GroupFn;

/// Default of [`WorkQueueConfig::live_burst`]. Under a flood of `Live` items, 1 `Background`
/// turn in 9 still drains a relist (at about 11% of the workers' rate) and costs `Live` items at
/// most that share; when `Live` items arrive slower than workers free up, which is the usual
/// case, the burst is never reached and `Live` items wait for no `Background` one.
pub(super) const DEFAULT_LIVE_BURST: usize = 8;

/// How to build a [`WorkQueue`](super::WorkQueue), for [`WorkQueue::with_config`](super::WorkQueue::with_config): client-go's
/// `TypedRateLimitingQueueConfig`.
///
/// Start from [`WorkQueueConfig::new`](super::WorkQueueConfig::new) (or `Default`) and chain the setters. Unset fields keep
/// their defaults: no name, [`default_controller_rate_limiter`](super::default_controller_rate_limiter) (client-go's
/// `DefaultControllerRateLimiter`), a [`live_burst`](Self::live_burst) of 8 and no
/// [`fairness`](Self::fairness) groups. Fields are private so that more can be added later.
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
    pub(super) name: String,
    /// `None` means [`default_controller_rate_limiter`](super::default_controller_rate_limiter).
    pub(super) rate_limiter: Option<Box<dyn RateLimiter<K>>>,
    pub(super) live_burst: usize,
    pub(super) fairness: Option<GroupFn<K>>,
}

impl<K> WorkQueueConfig<K> {
    /// The defaults: no name, [`default_controller_rate_limiter`](super::default_controller_rate_limiter).
    pub fn new() -> Self {
        Self {
            name: String::new(),
            rate_limiter: None,
            live_burst: DEFAULT_LIVE_BURST,
            fairness: None,
        }
    }

    /// Sets the queue's name, which appears in its tracing events and `Debug` output.
    #[must_use]
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Sets the limiter used by [`WorkQueue::add_rate_limited`](super::WorkQueue::add_rate_limited). A `Box<dyn RateLimiter<K>>` or
    /// an `Arc` of a limiter is accepted as well.
    #[must_use]
    pub fn rate_limiter(self, limiter: impl RateLimiter<K> + 'static) -> Self {
        self.boxed_rate_limiter(Box::new(limiter))
    }

    /// Sets how many [`Live`](super::Priority::Live) items `get` hands out in a row, at most,
    /// while [`Background`](super::Priority::Background) items wait; then the oldest
    /// `Background` item (of the group whose turn it is) gets one turn. This keeps a relist or
    /// resync backlog moving under a steady stream of live changes, and bounds what it costs them:
    /// at most 1 hand-out in `n + 1`. A `Background` item's age plays no part, so a large backlog
    /// never overtakes later `Live` items wholesale. Default 8; values below 1 count as 1.
    #[must_use]
    pub fn live_burst(mut self, n: usize) -> Self {
        self.live_burst = n;
        self
    }

    /// Groups items with `group_of` (for example by namespace) and makes `get` take turns
    /// between the groups that have items waiting, within each priority level: round robin in
    /// the order the groups got their first waiting item, FIFO within a group. A group with 50,000
    /// waiting keys then delays another group's item by at most one hand-out per group waiting.
    ///
    /// Without it, every item is in one group: plain FIFO within each level. `group_of` is
    /// called when an item is queued, with the queue's lock held: keep it cheap, and do not use
    /// the queue from it.
    ///
    /// ```
    /// use etcd_informer::workqueue::{WorkQueue, WorkQueueConfig};
    ///
    /// let queue: WorkQueue<String> = WorkQueue::with_config(WorkQueueConfig::new().fairness(
    ///     |key: &String| key.split_once('/').map_or("", |(ns, _)| ns).to_string(),
    /// ));
    /// # drop(queue);
    /// ```
    #[must_use]
    pub fn fairness(mut self, group_of: impl Fn(&K) -> String + Send + Sync + 'static) -> Self {
        self.fairness = Some(Box::new(group_of));
        self
    }

    pub(super) fn boxed_rate_limiter(mut self, limiter: Box<dyn RateLimiter<K>>) -> Self {
        self.rate_limiter = Some(limiter);
        self
    }
}

impl<K> Default for WorkQueueConfig<K> {
    /// Same as [`WorkQueueConfig::new`](super::WorkQueueConfig::new).
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
            .field("live_burst", &self.live_burst)
            .field("fairness", &self.fairness.is_some())
            .finish()
    }
}
