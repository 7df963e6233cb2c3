//! What a work queue reports about itself: [`QueueMetrics`], client-go's workqueue metrics as
//! a snapshot.

use std::time::Duration;

/// A snapshot of a queue's counters, from [`WorkQueue::metrics`](super::WorkQueue::metrics).
///
/// Durations are measured on the tokio clock.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueMetrics {
    /// Number of waiting items (same as [`WorkQueue::len`](super::WorkQueue::len)).
    pub depth: usize,
    /// How many of the waiting items are [`Background`](super::Priority::Background).
    pub background_depth: usize,
    /// Number of items with a pending delayed add.
    pub delayed: usize,
    /// Number of items handed out and not yet `done`.
    pub processing: usize,
    /// Items added to the queue. Adds of an item that was already dirty are not counted. A
    /// delayed add counts once the item is ready.
    pub adds: u64,
    /// Calls to [`WorkQueue::add_rate_limited`](super::WorkQueue::add_rate_limited) that the queue accepted.
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

pub(super) fn mean(total: Duration, count: u64) -> Option<Duration> {
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
