//! Rate limiters that decide how long a failing item waits before it is retried.
//!
//! A [`RateLimiter`] is asked [`when`](RateLimiter::when) an item may be retried. Each call counts
//! as one more failure of that item. [`forget`](RateLimiter::forget) clears the item's history
//! once it succeeds. The trait is object safe, so a
//! [`WorkQueue`](super::WorkQueue) can take any implementation as a `Box<dyn RateLimiter<K>>`.
//!
//! Time is read from [`tokio::time::Instant`], so the limiters follow tokio's paused test clock.

use std::collections::HashMap;
use std::fmt;
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::backoff::Backoff;
use crate::sync::lock;

/// Locks `m`. If the mutex is poisoned, the data is still used: every critical section in this
/// module leaves the data consistent.
/// Decides how long an item waits before it is retried.
///
/// Implementations must be cheap and must not block. They are called with the work queue's
/// internal state unlocked.
pub trait RateLimiter<K>: Send + Sync {
    /// Records one more failure of `item` and returns how long to wait before retrying it.
    fn when(&self, item: &K) -> Duration;
    /// Clears the failure history of `item`, usually after it was processed successfully.
    fn forget(&self, item: &K);
    /// Returns how many failures of `item` have been recorded since it was last forgotten.
    fn num_requeues(&self, item: &K) -> u32;
}

impl<K, R: RateLimiter<K> + ?Sized> RateLimiter<K> for Box<R> {
    fn when(&self, item: &K) -> Duration {
        (**self).when(item)
    }
    fn forget(&self, item: &K) {
        (**self).forget(item)
    }
    fn num_requeues(&self, item: &K) -> u32 {
        (**self).num_requeues(item)
    }
}

impl<K, R: RateLimiter<K> + ?Sized> RateLimiter<K> for Arc<R> {
    fn when(&self, item: &K) -> Duration {
        (**self).when(item)
    }
    fn forget(&self, item: &K) {
        (**self).forget(item)
    }
    fn num_requeues(&self, item: &K) -> u32 {
        (**self).num_requeues(item)
    }
}

/// Per-item exponential backoff: after `n` recorded failures the next delay is
/// `base * 2^n`, capped at `max`.
///
/// The first call to [`when`](RateLimiter::when) for an item returns `base`. The computation
/// never overflows: any delay that would go past `max` is `max`. Each item has its own
/// [`Backoff`] (no jitter, never reset by itself), dropped by [`forget`](RateLimiter::forget).
pub struct ItemExponentialRateLimiter<K> {
    base: Duration,
    max: Duration,
    failures: Mutex<HashMap<K, Backoff>>,
}

impl<K> ItemExponentialRateLimiter<K> {
    /// Default first delay: 5 ms.
    pub const DEFAULT_BASE: Duration = Duration::from_millis(5);
    /// Default largest delay: 1000 s.
    pub const DEFAULT_MAX: Duration = Duration::from_secs(1000);

    /// Creates a limiter whose first delay is `base` and whose delays never exceed `max`.
    pub fn new(base: Duration, max: Duration) -> Self {
        Self {
            base,
            max,
            failures: Mutex::new(HashMap::new()),
        }
    }
}

impl<K> Default for ItemExponentialRateLimiter<K> {
    /// 5 ms base, 1000 s cap.
    fn default() -> Self {
        Self::new(Self::DEFAULT_BASE, Self::DEFAULT_MAX)
    }
}

impl<K> fmt::Debug for ItemExponentialRateLimiter<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ItemExponentialRateLimiter")
            .field("base", &self.base)
            .field("max", &self.max)
            .field("tracked_items", &lock(&self.failures).len())
            .finish()
    }
}

impl<K: Clone + Eq + Hash + Send + Sync> RateLimiter<K> for ItemExponentialRateLimiter<K> {
    fn when(&self, item: &K) -> Duration {
        lock(&self.failures)
            .entry(item.clone())
            .or_insert_with(|| Backoff::without_reset(self.base, self.max, 0.0))
            .next_delay()
    }

    fn forget(&self, item: &K) {
        lock(&self.failures).remove(item);
    }

    fn num_requeues(&self, item: &K) -> u32 {
        lock(&self.failures).get(item).map_or(0, Backoff::failures)
    }
}

/// Per-item two-speed delay: `fast` for the first `max_fast_attempts` failures of an item, then
/// `slow` for every further one, until the item is forgotten. Client-go's
/// `ItemFastSlowRateLimiter`.
///
/// ```
/// use std::time::Duration;
/// use etcd_informer::workqueue::{ItemFastSlowRateLimiter, RateLimiter};
///
/// let limiter = ItemFastSlowRateLimiter::new(Duration::from_millis(5), Duration::from_secs(10), 2);
/// assert_eq!(limiter.when(&"a"), Duration::from_millis(5));
/// assert_eq!(limiter.when(&"a"), Duration::from_millis(5));
/// assert_eq!(limiter.when(&"a"), Duration::from_secs(10));
/// limiter.forget(&"a");
/// assert_eq!(limiter.when(&"a"), Duration::from_millis(5));
/// ```
pub struct ItemFastSlowRateLimiter<K> {
    fast: Duration,
    slow: Duration,
    max_fast_attempts: u32,
    failures: Mutex<HashMap<K, u32>>,
}

impl<K> ItemFastSlowRateLimiter<K> {
    /// Creates a limiter that waits `fast` for an item's first `max_fast_attempts` failures and
    /// `slow` after that.
    pub fn new(fast: Duration, slow: Duration, max_fast_attempts: u32) -> Self {
        Self {
            fast,
            slow,
            max_fast_attempts,
            failures: Mutex::new(HashMap::new()),
        }
    }
}

impl<K> fmt::Debug for ItemFastSlowRateLimiter<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ItemFastSlowRateLimiter")
            .field("fast", &self.fast)
            .field("slow", &self.slow)
            .field("max_fast_attempts", &self.max_fast_attempts)
            .field("tracked_items", &lock(&self.failures).len())
            .finish()
    }
}

impl<K: Clone + Eq + Hash + Send + Sync> RateLimiter<K> for ItemFastSlowRateLimiter<K> {
    fn when(&self, item: &K) -> Duration {
        let attempt = {
            let mut failures = lock(&self.failures);
            let count = failures.entry(item.clone()).or_insert(0);
            *count = count.saturating_add(1);
            *count
        };
        if attempt <= self.max_fast_attempts {
            self.fast
        } else {
            self.slow
        }
    }

    fn forget(&self, item: &K) {
        lock(&self.failures).remove(item);
    }

    fn num_requeues(&self, item: &K) -> u32 {
        lock(&self.failures).get(item).copied().unwrap_or(0)
    }
}

/// An overall token bucket shared by all items: `burst` tokens, refilled at `qps` tokens per
/// second.
///
/// [`when`](RateLimiter::when) reserves the next token and returns how long until it is
/// available. That is zero while tokens remain. Once the bucket is empty, successive calls are
/// spaced `1 / qps` apart. Items are not tracked: [`forget`](RateLimiter::forget) does nothing and
/// [`num_requeues`](RateLimiter::num_requeues) is always 0.
///
/// An infinite `qps` never delays. A `qps` that is zero, negative or NaN never refills: after
/// `burst` calls every delay is [`Duration::MAX`].
pub struct BucketRateLimiter {
    qps: f64,
    burst: u32,
    /// Time between two tokens; `None` if the bucket never refills.
    interval: Option<Duration>,
    state: Mutex<BucketState>,
}

#[derive(Debug, Default)]
struct BucketState {
    /// Time at which the bucket would be full again if nothing else were reserved
    /// (generic cell rate algorithm); `None` before the first reservation.
    full_at: Option<Instant>,
    /// Reservations so far; used only when the bucket never refills.
    taken: u64,
}

impl BucketRateLimiter {
    /// Default rate: 10 tokens per second.
    pub const DEFAULT_QPS: f64 = 10.0;
    /// Default bucket size: 100 tokens.
    pub const DEFAULT_BURST: u32 = 100;

    /// Creates a full bucket of `burst` tokens that refills at `qps` tokens per second.
    pub fn new(qps: f64, burst: u32) -> Self {
        let interval = if qps > 0.0 {
            // Infinite qps gives a zero interval; too small a qps gives an error, meaning "never".
            Duration::try_from_secs_f64(1.0 / qps).ok()
        } else {
            None
        };
        Self {
            qps,
            burst,
            interval,
            state: Mutex::new(BucketState::default()),
        }
    }

    /// The refill rate in tokens per second.
    pub fn qps(&self) -> f64 {
        self.qps
    }

    /// The bucket size.
    pub fn burst(&self) -> u32 {
        self.burst
    }

    fn reserve(&self) -> Duration {
        let mut state = lock(&self.state);
        let Some(interval) = self.interval else {
            state.taken = state.taken.saturating_add(1);
            return if state.taken <= u64::from(self.burst) {
                Duration::ZERO
            } else {
                Duration::MAX
            };
        };
        let now = Instant::now();
        // Before `full_at` the bucket is short of (full_at - now) / interval tokens.
        let full_at = match state.full_at {
            Some(t) if t > now => t,
            _ => now,
        };
        let Some(new_full_at) = full_at.checked_add(interval) else {
            return Duration::MAX;
        };
        state.full_at = Some(new_full_at);
        // The token is available once the shortfall is no larger than the bucket.
        match interval
            .checked_mul(self.burst)
            .and_then(|window| new_full_at.checked_sub(window))
        {
            Some(available_at) => available_at.saturating_duration_since(now),
            None => Duration::ZERO,
        }
    }
}

impl Default for BucketRateLimiter {
    /// 10 qps, burst 100.
    fn default() -> Self {
        Self::new(Self::DEFAULT_QPS, Self::DEFAULT_BURST)
    }
}

impl fmt::Debug for BucketRateLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BucketRateLimiter")
            .field("qps", &self.qps)
            .field("burst", &self.burst)
            .finish()
    }
}

impl<K> RateLimiter<K> for BucketRateLimiter {
    fn when(&self, _item: &K) -> Duration {
        self.reserve()
    }

    fn forget(&self, _item: &K) {}

    fn num_requeues(&self, _item: &K) -> u32 {
        0
    }
}

/// Combines several limiters: the delay is the largest of theirs.
///
/// [`when`](RateLimiter::when) and [`forget`](RateLimiter::forget) are passed to every limiter.
/// [`num_requeues`](RateLimiter::num_requeues) is the largest count. With no limiters the delay is
/// zero.
pub struct MaxOfRateLimiter<K> {
    limiters: Vec<Box<dyn RateLimiter<K>>>,
}

impl<K> MaxOfRateLimiter<K> {
    /// Creates a limiter that takes the maximum over `limiters`.
    pub fn new(limiters: Vec<Box<dyn RateLimiter<K>>>) -> Self {
        Self { limiters }
    }
}

impl<K> fmt::Debug for MaxOfRateLimiter<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MaxOfRateLimiter")
            .field("limiters", &self.limiters.len())
            .finish()
    }
}

impl<K> RateLimiter<K> for MaxOfRateLimiter<K> {
    fn when(&self, item: &K) -> Duration {
        // Every limiter must see the failure, so no short-circuiting.
        self.limiters
            .iter()
            .map(|l| l.when(item))
            .fold(Duration::ZERO, Duration::max)
    }

    fn forget(&self, item: &K) {
        for l in &self.limiters {
            l.forget(item);
        }
    }

    fn num_requeues(&self, item: &K) -> u32 {
        self.limiters
            .iter()
            .map(|l| l.num_requeues(item))
            .max()
            .unwrap_or(0)
    }
}

/// Caps another limiter's delay at `max_wait`; client-go's `WithMaxWaitRateLimiter`.
///
/// [`when`](RateLimiter::when) is the smaller of the inner limiter's delay and `max_wait`. The
/// inner limiter still records the failure. [`forget`](RateLimiter::forget) and
/// [`num_requeues`](RateLimiter::num_requeues) go to the inner limiter unchanged.
///
/// ```
/// use std::time::Duration;
/// use etcd_informer::workqueue::{ItemExponentialRateLimiter, RateLimiter, WithMaxWaitRateLimiter};
///
/// let backoff = ItemExponentialRateLimiter::new(Duration::from_secs(1), Duration::from_secs(1000));
/// let limiter = WithMaxWaitRateLimiter::new(backoff, Duration::from_secs(3));
/// assert_eq!(limiter.when(&"a"), Duration::from_secs(1));
/// assert_eq!(limiter.when(&"a"), Duration::from_secs(2));
/// assert_eq!(limiter.when(&"a"), Duration::from_secs(3)); // 4 s, capped
/// assert_eq!(limiter.num_requeues(&"a"), 3);
/// ```
pub struct WithMaxWaitRateLimiter<R> {
    inner: R,
    max_wait: Duration,
}

impl<R> WithMaxWaitRateLimiter<R> {
    /// Wraps `inner` so that no delay exceeds `max_wait`.
    pub fn new(inner: R, max_wait: Duration) -> Self {
        Self { inner, max_wait }
    }

    /// The largest delay this limiter returns.
    pub fn max_wait(&self) -> Duration {
        self.max_wait
    }

    /// The wrapped limiter.
    pub fn inner(&self) -> &R {
        &self.inner
    }
}

impl<R> fmt::Debug for WithMaxWaitRateLimiter<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WithMaxWaitRateLimiter")
            .field("max_wait", &self.max_wait)
            .finish_non_exhaustive()
    }
}

impl<K, R: RateLimiter<K>> RateLimiter<K> for WithMaxWaitRateLimiter<R> {
    fn when(&self, item: &K) -> Duration {
        self.inner.when(item).min(self.max_wait)
    }

    fn forget(&self, item: &K) {
        self.inner.forget(item)
    }

    fn num_requeues(&self, item: &K) -> u32 {
        self.inner.num_requeues(item)
    }
}

/// The usual limiter for controllers: the larger of per-item exponential backoff (5 ms up to
/// 1000 s) and an overall bucket of 10 qps with burst 100.
pub fn default_controller_rate_limiter<K>() -> MaxOfRateLimiter<K>
where
    K: Clone + Eq + Hash + Send + Sync + 'static,
{
    MaxOfRateLimiter::new(vec![
        Box::new(ItemExponentialRateLimiter::<K>::default()),
        Box::new(BucketRateLimiter::default()),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn exponential_doubles_from_base_and_caps() {
        let rl = ItemExponentialRateLimiter::<&str>::default();
        let mut expected = 5 * MS;
        for n in 0..18 {
            assert_eq!(rl.when(&"a"), expected, "failure {n}");
            expected *= 2;
        }
        // 5 ms * 2^18 = 1310.72 s > 1000 s.
        assert_eq!(rl.when(&"a"), Duration::from_secs(1000));
        assert_eq!(rl.when(&"a"), Duration::from_secs(1000));
        assert_eq!(rl.num_requeues(&"a"), 20);
    }

    #[test]
    fn exponential_never_overflows() {
        let rl = ItemExponentialRateLimiter::<u8>::new(5 * MS, Duration::from_secs(1000));
        for _ in 0..300 {
            assert!(rl.when(&1) <= Duration::from_secs(1000));
        }
        assert_eq!(rl.when(&1), Duration::from_secs(1000));

        let huge =
            ItemExponentialRateLimiter::<u8>::new(Duration::from_secs(u64::MAX / 2), Duration::MAX);
        assert_eq!(huge.when(&1), Duration::from_secs(u64::MAX / 2));
        assert_eq!(huge.when(&1), Duration::from_secs(u64::MAX / 2 * 2));
        assert_eq!(huge.when(&1), Duration::MAX);
        assert_eq!(huge.when(&1), Duration::MAX);

        let max_below_base =
            ItemExponentialRateLimiter::<u8>::new(Duration::from_secs(10), Duration::from_secs(1));
        assert_eq!(max_below_base.when(&1), Duration::from_secs(1));
    }

    #[test]
    fn exponential_tracks_items_separately_and_forget_resets() {
        let rl = ItemExponentialRateLimiter::<String>::new(MS, Duration::from_secs(1));
        let (a, b) = ("a".to_string(), "b".to_string());
        assert_eq!(rl.when(&a), MS);
        assert_eq!(rl.when(&a), 2 * MS);
        assert_eq!(rl.when(&a), 4 * MS);
        assert_eq!(rl.when(&b), MS);
        assert_eq!(rl.num_requeues(&a), 3);
        assert_eq!(rl.num_requeues(&b), 1);

        rl.forget(&a);
        assert_eq!(rl.num_requeues(&a), 0);
        assert_eq!(rl.num_requeues(&b), 1);
        assert_eq!(rl.when(&a), MS);
        assert_eq!(rl.when(&b), 2 * MS);
    }

    #[tokio::test(start_paused = true)]
    async fn bucket_allows_burst_then_spaces_by_one_over_qps() {
        let rl = BucketRateLimiter::default();
        for i in 0..100u32 {
            assert_eq!(
                RateLimiter::<u32>::when(&rl, &i),
                Duration::ZERO,
                "call {i}"
            );
        }
        for k in 1..=5u32 {
            assert_eq!(RateLimiter::<u32>::when(&rl, &0), 100 * MS * k);
        }
        // Five tokens are owed; after 800 ms three are available again.
        tokio::time::advance(800 * MS).await;
        for _ in 0..3 {
            assert_eq!(RateLimiter::<u32>::when(&rl, &0), Duration::ZERO);
        }
        assert_eq!(RateLimiter::<u32>::when(&rl, &0), 100 * MS);
    }

    #[tokio::test(start_paused = true)]
    async fn bucket_refills_to_burst_only() {
        let rl = BucketRateLimiter::new(10.0, 3);
        for _ in 0..3 {
            assert_eq!(RateLimiter::<()>::when(&rl, &()), Duration::ZERO);
        }
        assert_eq!(RateLimiter::<()>::when(&rl, &()), 100 * MS);
        // A long idle period refills the bucket, but only up to 3 tokens.
        tokio::time::advance(Duration::from_secs(3600)).await;
        for _ in 0..3 {
            assert_eq!(RateLimiter::<()>::when(&rl, &()), Duration::ZERO);
        }
        assert_eq!(RateLimiter::<()>::when(&rl, &()), 100 * MS);
    }

    #[tokio::test(start_paused = true)]
    async fn bucket_does_not_track_items() {
        let rl = BucketRateLimiter::new(1.0, 1);
        assert_eq!(RateLimiter::<&str>::when(&rl, &"a"), Duration::ZERO);
        assert_eq!(RateLimiter::<&str>::when(&rl, &"b"), Duration::from_secs(1));
        RateLimiter::<&str>::forget(&rl, &"b");
        assert_eq!(RateLimiter::<&str>::num_requeues(&rl, &"b"), 0);
        // Forget did not give the token back.
        assert_eq!(RateLimiter::<&str>::when(&rl, &"b"), Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn bucket_edge_rates() {
        let unlimited = BucketRateLimiter::new(f64::INFINITY, 0);
        for _ in 0..1000 {
            assert_eq!(RateLimiter::<()>::when(&unlimited, &()), Duration::ZERO);
        }
        for qps in [0.0, -1.0, f64::NAN] {
            let stuck = BucketRateLimiter::new(qps, 2);
            assert_eq!(RateLimiter::<()>::when(&stuck, &()), Duration::ZERO);
            assert_eq!(RateLimiter::<()>::when(&stuck, &()), Duration::ZERO);
            assert_eq!(RateLimiter::<()>::when(&stuck, &()), Duration::MAX);
        }
        let no_burst = BucketRateLimiter::new(2.0, 0);
        assert_eq!(RateLimiter::<()>::when(&no_burst, &()), 500 * MS);
        assert_eq!(RateLimiter::<()>::when(&no_burst, &()), 1000 * MS);
    }

    /// A limiter returning a fixed delay and counting calls, to observe MaxOf's fan-out.
    struct Fixed {
        delay: Duration,
        calls: Mutex<HashMap<u8, u32>>,
    }

    impl Fixed {
        fn new(delay: Duration) -> Arc<Self> {
            Arc::new(Self {
                delay,
                calls: Mutex::new(HashMap::new()),
            })
        }
    }

    impl RateLimiter<u8> for Fixed {
        fn when(&self, item: &u8) -> Duration {
            *lock(&self.calls).entry(*item).or_insert(0) += 1;
            self.delay
        }
        fn forget(&self, item: &u8) {
            lock(&self.calls).remove(item);
        }
        fn num_requeues(&self, item: &u8) -> u32 {
            lock(&self.calls).get(item).copied().unwrap_or(0)
        }
    }

    #[test]
    fn max_of_takes_maximum_and_fans_out() {
        let short = Fixed::new(3 * MS);
        let long = Fixed::new(7 * MS);
        let rl = MaxOfRateLimiter::new(vec![Box::new(short.clone()), Box::new(long.clone())]);
        assert_eq!(rl.when(&1), 7 * MS);
        // Both limiters saw the failure.
        assert_eq!(short.num_requeues(&1), 1);
        assert_eq!(long.num_requeues(&1), 1);

        long.forget(&1);
        assert_eq!(short.num_requeues(&1), 1);
        assert_eq!(rl.num_requeues(&1), 1, "max of 1 and 0");

        rl.when(&1);
        assert_eq!(rl.num_requeues(&1), 2);
        rl.forget(&1);
        assert_eq!(short.num_requeues(&1), 0);
        assert_eq!(long.num_requeues(&1), 0);
        assert_eq!(rl.num_requeues(&1), 0);

        let empty = MaxOfRateLimiter::<u8>::new(Vec::new());
        assert_eq!(empty.when(&1), Duration::ZERO);
        assert_eq!(empty.num_requeues(&1), 0);
    }

    #[test]
    fn max_of_exponential_limiters() {
        let rl = MaxOfRateLimiter::new(vec![
            Box::new(ItemExponentialRateLimiter::<u8>::new(
                MS,
                Duration::from_secs(1),
            )),
            Box::new(ItemExponentialRateLimiter::<u8>::new(2 * MS, 5 * MS)),
        ]);
        assert_eq!(rl.when(&1), 2 * MS);
        assert_eq!(rl.when(&1), 4 * MS);
        assert_eq!(rl.when(&1), 5 * MS); // 4 ms vs capped 5 ms
        assert_eq!(rl.when(&1), 8 * MS); // 8 ms vs 5 ms
        assert_eq!(rl.num_requeues(&1), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn default_controller_limiter_combines_backoff_and_bucket() {
        let rl = default_controller_rate_limiter::<u32>();
        // 100 distinct items fit in the burst: the per-item backoff (5 ms) decides.
        for i in 0..100 {
            assert_eq!(rl.when(&i), 5 * MS);
        }
        // The bucket is empty now, so it decides.
        assert_eq!(rl.when(&100), 100 * MS);
        assert_eq!(rl.when(&101), 200 * MS);
        assert_eq!(rl.num_requeues(&0), 1);
        rl.forget(&0);
        assert_eq!(rl.num_requeues(&0), 0);
    }

    #[test]
    fn fast_slow_switches_after_max_fast_attempts_per_item() {
        let rl = ItemFastSlowRateLimiter::<u8>::new(MS, Duration::from_secs(1), 2);
        assert_eq!(rl.when(&1), MS);
        assert_eq!(rl.when(&2), MS);
        assert_eq!(rl.when(&1), MS);
        assert_eq!(rl.when(&1), Duration::from_secs(1));
        assert_eq!(rl.when(&2), MS);
        assert_eq!(rl.num_requeues(&1), 3);
        rl.forget(&1);
        assert_eq!(rl.num_requeues(&1), 0);
        assert_eq!(rl.when(&1), MS);

        let never_fast = ItemFastSlowRateLimiter::<u8>::new(MS, 2 * MS, 0);
        assert_eq!(never_fast.when(&1), 2 * MS);
        assert!(format!("{rl:?}").contains("max_fast_attempts: 2"));
    }

    #[test]
    fn with_max_wait_caps_and_delegates() {
        let inner = Fixed::new(7 * MS);
        let rl = WithMaxWaitRateLimiter::new(inner.clone(), 5 * MS);
        assert_eq!(rl.when(&1), 5 * MS);
        assert_eq!(inner.num_requeues(&1), 1, "inner limiter saw the failure");
        assert_eq!(rl.num_requeues(&1), 1);
        rl.forget(&1);
        assert_eq!(inner.num_requeues(&1), 0);
        assert_eq!(rl.max_wait(), 5 * MS);
        assert_eq!(rl.inner().delay, 7 * MS);

        let below = WithMaxWaitRateLimiter::new(Fixed::new(3 * MS), 5 * MS);
        assert_eq!(below.when(&1), 3 * MS);
        let boxed: Box<dyn RateLimiter<u8>> = Box::new(WithMaxWaitRateLimiter::new(
            Box::new(Fixed::new(MS)) as Box<dyn RateLimiter<u8>>,
            Duration::ZERO,
        ));
        assert_eq!(boxed.when(&1), Duration::ZERO);
    }

    #[test]
    fn trait_is_object_safe_and_shareable() {
        let boxed: Box<dyn RateLimiter<String>> = Box::new(ItemExponentialRateLimiter::default());
        let shared: Arc<dyn RateLimiter<String>> = Arc::new(BucketRateLimiter::default());
        let nested: Box<dyn RateLimiter<String>> =
            Box::new(MaxOfRateLimiter::new(vec![boxed, Box::new(shared)]));
        fn assert_send_sync<T: Send + Sync>(_: &T) {}
        assert_send_sync(&nested);
        assert_eq!(nested.num_requeues(&"x".to_string()), 0);
    }
}
