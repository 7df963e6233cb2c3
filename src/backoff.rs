//! Exponential backoff: the one used by the reflector (relists, reconnects), the controller's
//! per-key retries and the work queue's [`ItemExponentialRateLimiter`](crate::workqueue::ItemExponentialRateLimiter).

use std::time::Duration;

use tokio::time::Instant;

/// Exponential backoff with jitter, reset after a quiet period (client-go's
/// `NewExponentialBackoffManager(800ms, 30s, 2min, 2.0, 1.0)`).
///
/// Each delay is the previous one doubled, never more than `max` (the first is `initial`,
/// capped at `max` too), then stretched by up to `jitter` × itself.
///
/// ```
/// use std::time::Duration;
/// use etcd_informer::Backoff;
///
/// let mut b = Backoff::without_reset(Duration::from_millis(100), Duration::from_millis(300), 0.0);
/// assert_eq!(b.next_delay(), Duration::from_millis(100));
/// assert_eq!(b.next_delay(), Duration::from_millis(200));
/// assert_eq!(b.next_delay(), Duration::from_millis(300));
/// assert_eq!(b.failures(), 3);
/// b.reset();
/// assert_eq!(b.failures(), 0);
/// assert_eq!(b.next_delay(), Duration::from_millis(100));
/// ```
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    reset_after: Duration,
    jitter: f64,
    next: Duration,
    last: Option<Instant>,
    failures: u32,
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
            failures: 0,
        }
    }

    /// A backoff that never starts over by itself (`reset_after` is `Duration::MAX`): only
    /// [`reset`](Self::reset) brings it back to `initial`. With `jitter` 0 its delays are
    /// exactly `initial × 2^failures`, capped at `max`, as the controller's per-key retries and
    /// [`ItemExponentialRateLimiter`](crate::workqueue::ItemExponentialRateLimiter) use it.
    pub fn without_reset(initial: Duration, max: Duration, jitter: f64) -> Self {
        Backoff::new(initial, max, Duration::MAX, jitter)
    }

    /// A short, capped backoff for reconnecting to an etcd that does not answer: 50 ms
    /// doubling to 1 s, up to 50% jitter, reset after 5 s without a failure. Reconnecting costs
    /// etcd nothing until it answers (a refused connection, or one cheap watch request), so the
    /// informer is back within about a second of its member; client-go's 30 s cap protects an
    /// apiserver, which we do not have in between.
    pub fn reconnect() -> Self {
        Backoff::new(
            Duration::from_millis(50),
            Duration::from_secs(1),
            Duration::from_secs(5),
            0.5,
        )
    }

    /// Starts over: the next delay is the initial one.
    pub fn reset(&mut self) {
        self.next = self.initial;
        self.last = None;
        self.failures = 0;
    }

    /// How many delays were handed out since the backoff last started over (by
    /// [`reset`](Self::reset) or after `reset_after` without a failure), saturating at
    /// `u32::MAX`.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// The delay before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        let now = (self.reset_after < Duration::MAX).then(Instant::now);
        if let (Some(now), Some(last)) = (now, self.last) {
            if now.saturating_duration_since(last) >= self.reset_after {
                self.next = self.initial;
                self.failures = 0;
            }
        }
        let base = self.next.min(self.max);
        self.next = self.next.saturating_mul(2).min(self.max);
        self.failures = self.failures.saturating_add(1);
        let delay = if self.jitter > 0.0 {
            base.mul_f64(1.0 + self.jitter * fastrand::f64())
        } else {
            base
        };
        // The next failure is measured from the end of this delay, not its start.
        self.last = now.map(|now| now.checked_add(delay).unwrap_or(now));
        delay
    }
}
