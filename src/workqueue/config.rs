//! How a [`WorkQueue`](super::WorkQueue) is set up: its name and rate limiter.

use std::fmt;

use super::rate_limiter::RateLimiter;

/// How to build a [`WorkQueue`](super::WorkQueue), for [`WorkQueue::with_config`](super::WorkQueue::with_config): client-go's
/// `TypedRateLimitingQueueConfig`.
///
/// Start from [`WorkQueueConfig::new`](super::WorkQueueConfig::new) (or `Default`) and chain the setters. Unset fields keep
/// their defaults: no name, and [`default_controller_rate_limiter`](super::default_controller_rate_limiter) (client-go's
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
    pub(super) name: String,
    /// `None` means [`default_controller_rate_limiter`](super::default_controller_rate_limiter).
    pub(super) rate_limiter: Option<Box<dyn RateLimiter<K>>>,
}

impl<K> WorkQueueConfig<K> {
    /// The defaults: no name, [`default_controller_rate_limiter`](super::default_controller_rate_limiter).
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

    /// Sets the limiter used by [`WorkQueue::add_rate_limited`](super::WorkQueue::add_rate_limited). A `Box<dyn RateLimiter<K>>` or
    /// an `Arc` of a limiter is accepted as well.
    #[must_use]
    pub fn rate_limiter(self, limiter: impl RateLimiter<K> + 'static) -> Self {
        self.boxed_rate_limiter(Box::new(limiter))
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
            .finish()
    }
}
