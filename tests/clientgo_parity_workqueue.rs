//! Parity with client-go's `util/workqueue` tests: each test here is named after the client-go
//! test whose behaviour it checks (`queue_test_*` for queue_test.go, `delaying_queue_test_*`,
//! `rate_limiting_queue_test_*`, `default_rate_limiters_test_*`). The tests are our own, written
//! from what the client-go tests check. Timed tests run on tokio's paused clock, which plays the
//! part of client-go's fake clock: `tokio::time::advance` stands for `fakeClock.Step`, and a
//! `sleep` in a paused runtime takes no real time.
//!
//! Not ported:
//! - delaying_queue_test.go `BenchmarkDelayingQueue_AddAfter`: a benchmark, not a behaviour check
//!   (our benchmarks live in benches/).
//! - rate_limiting_queue_test.go `TestNewNamedRateLimitingWithCustomQueue` (only in some
//!   client-go trees): plugs a custom queue implementation (a priority queue) into the
//!   rate-limiting queue; we deliberately have no pluggable queue backend.
//! - queue_test.go `TestAdd` and `TestFind` (only in some client-go trees, not in kubernetes'
//!   staging copy): check an `Add` that reports whether the item was added and whether the queue
//!   is shutting down, and a `Find` lookup; both are APIs we deliberately lack.
//!
//! Deliberate differences in how a behaviour is checked:
//! - `TestCollapse` / `TestCollapseWhileProcessing` also check that a pluggable queue's `Touch`
//!   hook is (not) called; we have no pluggable queue, so only the collapsing is checked.
//! - `TestGarbageCollection` uses a Go finalizer; here a weak reference must die once the caller
//!   drops the item it was handed.
//! - `TestRateLimitingQueue` reads each requested ready time off an internal channel; here the
//!   paused clock measures when the item is handed out, and the item is taken before it is
//!   re-added, because two pending delayed adds of one item collapse to the earlier one.
//! - The delaying-queue tests read the `waitingForDepth` gauge; here `metrics().delayed`.
//! - client-go runs the concurrent tests on goroutines under the race detector; here they run on
//!   one paused-clock thread (the unit tests in src/workqueue cover multi-threaded runs).

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_informer::workqueue::{
    ItemExponentialRateLimiter, ItemFastSlowRateLimiter, MaxOfRateLimiter, RateLimiter,
    WithMaxWaitRateLimiter, WorkQueue, WorkQueueConfig,
};
use tokio::time::{advance, timeout, Instant};

const MS: Duration = Duration::from_millis(1);
/// Bound on anything that must finish; on the paused clock a hang turns into this timeout.
const PATIENCE: Duration = Duration::from_secs(3600);

/// The two ways to shut a queue down that client-go's table-driven tests cover.
#[derive(Debug, Clone, Copy)]
enum Shutdown {
    Plain,
    Drain,
}

impl Shutdown {
    async fn apply<K>(self, q: &WorkQueue<K>)
    where
        K: Clone + Eq + Hash + Send + Sync + 'static,
    {
        match self {
            Shutdown::Plain => q.shut_down(),
            Shutdown::Drain => timeout(PATIENCE, q.shut_down_with_drain())
                .await
                .expect("drain finished"),
        }
    }
}

/// Lets spawned tasks run until they block.
async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

fn spawn_drain<K>(q: &WorkQueue<K>) -> tokio::task::JoinHandle<()>
where
    K: Clone + Eq + Hash + Send + Sync + 'static,
{
    let q = q.clone();
    tokio::spawn(async move { q.shut_down_with_drain().await })
}

/// Calls `get` until it reports the shutdown, the way client-go's drain tests make sure the
/// shutdown has begun. Nothing must be handed out on the way.
async fn get_until_shut_down(q: &WorkQueue<&'static str>) {
    let got = timeout(PATIENCE, q.get()).await.expect("get returned");
    assert_eq!(got, None, "nothing is waiting");
    assert!(q.is_shutting_down());
}

// ---------------------------------------------------------------------------------------------
// queue_test.go

#[tokio::test(start_paused = true)]
async fn queue_test_basic() {
    const PRODUCERS: u32 = 50;
    const CONSUMERS: usize = 10;
    const LATE: u32 = u32::MAX;
    for kind in [Shutdown::Plain, Shutdown::Drain] {
        let q: WorkQueue<u32> = WorkQueue::new();
        let producers: Vec<_> = (0..PRODUCERS)
            .map(|i| {
                let q = q.clone();
                tokio::spawn(async move {
                    for _ in 0..50 {
                        q.add(i);
                        tokio::time::sleep(MS).await;
                    }
                })
            })
            .collect();
        let handled = Arc::new(Mutex::new(HashSet::new()));
        let consumers: Vec<_> = (0..CONSUMERS)
            .map(|_| {
                let (q, handled) = (q.clone(), handled.clone());
                tokio::spawn(async move {
                    while let Some(item) = q.get().await {
                        assert_ne!(
                            item, LATE,
                            "{kind:?}: handed out an item added after shutdown"
                        );
                        tokio::time::sleep(3 * MS).await;
                        handled.lock().unwrap().insert(item);
                        q.done(&item);
                    }
                })
            })
            .collect();
        for p in producers {
            p.await.unwrap();
        }
        kind.apply(&q).await;
        q.add(LATE);
        for c in consumers {
            timeout(PATIENCE, c)
                .await
                .expect("consumer stopped")
                .unwrap();
        }
        assert_eq!(q.len(), 0, "{kind:?}");
        // Beyond client-go's check: work queued before the shutdown was not dropped, so every
        // producer's item was handled.
        assert_eq!(
            handled.lock().unwrap().len(),
            PRODUCERS as usize,
            "{kind:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn queue_test_add_while_processing() {
    for kind in [Shutdown::Plain, Shutdown::Drain] {
        let q: WorkQueue<u32> = WorkQueue::new();
        let producers: Vec<_> = (0..50u32)
            .map(|i| {
                let q = q.clone();
                tokio::spawn(async move { q.add(i) })
            })
            .collect();
        let consumers: Vec<_> = (0..10)
            .map(|_| {
                let q = q.clone();
                tokio::spawn(async move {
                    // Each consumer adds an item back (while still processing it) the first time
                    // it sees it.
                    let mut seen: HashMap<u32, u32> = HashMap::new();
                    while let Some(item) = q.get().await {
                        let n = seen.entry(item).or_insert(0);
                        *n += 1;
                        if *n < 2 {
                            q.add(item);
                        }
                        q.done(&item);
                    }
                })
            })
            .collect();
        for p in producers {
            p.await.unwrap();
        }
        kind.apply(&q).await;
        for c in consumers {
            timeout(PATIENCE, c)
                .await
                .expect("consumer stopped")
                .unwrap();
        }
        assert_eq!(q.len(), 0, "{kind:?}");
    }
}

#[test]
fn queue_test_len() {
    let q: WorkQueue<&str> = WorkQueue::new();
    q.add("foo");
    assert_eq!(q.len(), 1);
    q.add("bar");
    assert_eq!(q.len(), 2);
    q.add("foo");
    assert_eq!(q.len(), 2, "a waiting item is not queued twice");
}

#[tokio::test(start_paused = true)]
async fn queue_test_reinsert() {
    let q: WorkQueue<&str> = WorkQueue::new();
    q.add("foo");
    let item = q.get().await.unwrap();
    assert_eq!(item, "foo");
    q.add(item); // while processing
    q.done(&item);
    let again = q.get().await.unwrap();
    assert_eq!(again, "foo", "back in the queue after done");
    q.done(&again);
    assert_eq!(q.len(), 0);
}

#[tokio::test(start_paused = true)]
async fn queue_test_collapse() {
    let q: WorkQueue<&str> = WorkQueue::new();
    q.add("bar");
    q.add("bar");
    assert_eq!(q.get().await, Some("bar"));
    q.done(&"bar");
    assert_eq!(q.len(), 0, "the two adds collapsed into one");
    assert!(timeout(Duration::from_secs(10), q.get()).await.is_err());
}

#[tokio::test(start_paused = true)]
async fn queue_test_collapse_while_processing() {
    let q: WorkQueue<&str> = WorkQueue::new();
    q.add("foo");
    assert_eq!(q.get().await, Some("foo"));
    q.add("foo");
    q.add("foo");

    // A second worker must not get "foo" while the first one still holds it.
    let second = tokio::spawn({
        let q = q.clone();
        async move {
            let item = q.get().await.unwrap();
            q.done(&item);
            item
        }
    });
    settle().await;
    advance(100 * MS).await;
    settle().await;
    assert!(!second.is_finished(), "second worker got the item early");

    q.done(&"foo");
    assert_eq!(second.await.unwrap(), "foo");
    assert_eq!(q.len(), 0, "the two re-adds collapsed into one");
}

#[tokio::test(start_paused = true)]
async fn queue_test_queue_drainage_using_shut_down_with_drain() {
    let q: WorkQueue<&str> = WorkQueue::new();
    q.add("foo");
    q.add("bar");
    let first = q.get().await.unwrap();
    let second = q.get().await.unwrap();

    let drain = spawn_drain(&q);
    get_until_shut_down(&q).await;
    settle().await;
    assert!(
        !drain.is_finished(),
        "drain waits for the items in progress"
    );

    q.done(&first);
    settle().await;
    assert!(!drain.is_finished());
    q.done(&second);
    timeout(PATIENCE, drain).await.expect("drained").unwrap();
}

#[tokio::test(start_paused = true)]
async fn queue_test_no_queue_drainage_using_shut_down() {
    let q: WorkQueue<&str> = WorkQueue::new();
    q.add("foo");
    q.add("bar");
    q.get().await.unwrap();
    q.get().await.unwrap();

    // Returns at once although neither item is done.
    q.shut_down();
    assert!(q.is_shutting_down());
    assert_eq!(q.metrics().processing, 2);
    assert_eq!(q.get().await, None);
}

#[tokio::test(start_paused = true)]
async fn queue_test_force_queue_shutdown_using_shut_down() {
    let q: WorkQueue<&str> = WorkQueue::new();
    q.add("foo");
    q.add("bar");
    q.get().await.unwrap();
    q.get().await.unwrap();

    let drain = spawn_drain(&q);
    get_until_shut_down(&q).await;
    settle().await;
    assert!(!drain.is_finished());

    // A second shutdown (say, on a second SIGTERM) releases the stuck drain.
    q.shut_down();
    timeout(PATIENCE, drain)
        .await
        .expect("drain released")
        .unwrap();
    assert_eq!(q.metrics().processing, 2, "nothing was done");
}

#[tokio::test(start_paused = true)]
async fn queue_test_queue_drainage_using_shut_down_with_drain_with_dirty_item() {
    let q: WorkQueue<&str> = WorkQueue::new();
    q.add("foo");
    let gotten = q.get().await.unwrap();
    q.add("foo");

    let drain = spawn_drain(&q);
    get_until_shut_down(&q).await;

    // Done puts the re-added item back, so get hands it out despite the shutdown.
    q.done(&gotten);
    let again = q.get().await;
    assert_eq!(again, Some("foo"));
    settle().await;
    assert!(!drain.is_finished());
    q.done(&"foo");

    assert_eq!(q.get().await, None, "now really done");
    timeout(PATIENCE, drain).await.expect("drained").unwrap();
}

/// An item whose payload is shared, so the test can tell whether the queue still holds a copy.
#[derive(Clone, Debug)]
struct Big(Arc<Vec<u8>>);

impl PartialEq for Big {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}

impl Eq for Big {}

impl Hash for Big {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.hash(state)
    }
}

#[tokio::test(start_paused = true)]
async fn queue_test_garbage_collection() {
    let q: WorkQueue<Big> = WorkQueue::new();
    let item = Big(Arc::new(b"hello".to_vec()));
    let weak = Arc::downgrade(&item.0);
    q.add(item);
    let got = q.get().await.unwrap();
    q.done(&got);
    drop(got);
    assert!(
        weak.upgrade().is_none(),
        "the queue kept a copy of a finished item"
    );
    // The queue is still alive: it was not dropped to free the item.
    assert_eq!(q.len(), 0);
}

// ---------------------------------------------------------------------------------------------
// delaying_queue_test.go

#[tokio::test(start_paused = true)]
async fn delaying_queue_test_simple_queue() {
    let q: WorkQueue<&str> = WorkQueue::with_config(WorkQueueConfig::new().name("test-simple"));
    q.add_after("foo", 50 * MS);
    assert_eq!(q.metrics().delayed, 1);
    assert_eq!(q.len(), 0, "not ready yet");

    advance(60 * MS).await;
    assert_eq!(q.len(), 1);
    assert_eq!(q.metrics().delayed, 0);
    let item = q.get().await.unwrap();
    q.done(&item);

    // Nothing comes back later.
    advance(Duration::from_secs(10)).await;
    assert_eq!(q.len(), 0);
    assert!(timeout(30 * MS, q.get()).await.is_err());
}

#[tokio::test(start_paused = true)]
async fn delaying_queue_test_deduping() {
    let q: WorkQueue<&str> = WorkQueue::with_config(WorkQueueConfig::new().name("test-dedupe"));

    // The later request is absorbed by the earlier one.
    q.add_after("foo", 50 * MS);
    q.add_after("foo", 70 * MS);
    assert_eq!(q.metrics().delayed, 1);
    assert_eq!(q.len(), 0);
    advance(60 * MS).await;
    assert_eq!(q.len(), 1);
    assert_eq!(q.metrics().delayed, 0);
    let item = q.get().await.unwrap();
    q.done(&item);
    advance(20 * MS).await;
    assert_eq!(q.len(), 0, "the 70 ms request did not fire");

    // The earlier request replaces the later one.
    q.add_after("foo", 50 * MS);
    q.add_after("foo", 30 * MS);
    assert_eq!(q.metrics().delayed, 1);
    assert_eq!(q.len(), 0);
    advance(40 * MS).await;
    assert_eq!(q.len(), 1);
    assert_eq!(q.metrics().delayed, 0);
    let item = q.get().await.unwrap();
    q.done(&item);
    advance(20 * MS).await;
    assert_eq!(q.len(), 0, "the 50 ms request did not fire");
}

#[tokio::test(start_paused = true)]
async fn delaying_queue_test_add_two_fire_early() {
    let q: WorkQueue<&str> =
        WorkQueue::with_config(WorkQueueConfig::new().name("test-addtwofireearly"));
    q.add_after("foo", Duration::from_secs(1));
    q.add_after("bar", 50 * MS);
    assert_eq!(q.metrics().delayed, 2);
    assert_eq!(q.len(), 0);

    advance(60 * MS).await;
    assert_eq!(q.len(), 1);
    assert_eq!(q.metrics().delayed, 1);
    assert_eq!(q.get().await, Some("bar"));

    q.add_after("baz", Duration::from_secs(2));
    advance(Duration::from_secs(1)).await;
    assert_eq!(q.len(), 1);
    assert_eq!(q.metrics().delayed, 1);
    assert_eq!(q.get().await, Some("foo"));

    advance(Duration::from_secs(2)).await;
    assert_eq!(q.len(), 1);
    assert_eq!(q.metrics().delayed, 0);
    assert_eq!(q.get().await, Some("baz"));
}

#[tokio::test(start_paused = true)]
async fn delaying_queue_test_copy_shifting() {
    let q: WorkQueue<&str> = WorkQueue::with_config(WorkQueueConfig::new().name("test-copyshift"));
    q.add_after("foo", Duration::from_secs(1));
    q.add_after("bar", 500 * MS);
    q.add_after("baz", 250 * MS);
    assert_eq!(q.metrics().delayed, 3);
    assert_eq!(q.len(), 0);

    // All three become ready at once; they are queued in ready-time order.
    advance(Duration::from_secs(2)).await;
    assert_eq!(q.len(), 3);
    assert_eq!(q.metrics().delayed, 0);
    assert_eq!(q.get().await, Some("baz"));
    assert_eq!(q.get().await, Some("bar"));
    assert_eq!(q.get().await, Some("foo"));
}

// ---------------------------------------------------------------------------------------------
// rate_limiting_queue_test.go

/// Rate-limits `item`, then returns how long it took to be handed out (on the paused clock).
async fn rate_limited_delay(q: &WorkQueue<&'static str>, item: &'static str) -> Duration {
    let start = Instant::now();
    q.add_rate_limited(item);
    assert_eq!(q.len(), 0, "{item} is delayed, not waiting");
    let got = timeout(PATIENCE, q.get()).await.expect("handed out");
    assert_eq!(got, Some(item));
    q.done(&item);
    start.elapsed()
}

#[tokio::test(start_paused = true)]
async fn rate_limiting_queue_test_rate_limiting_queue() {
    let q: WorkQueue<&str> = WorkQueue::with_config(
        WorkQueueConfig::new()
            .rate_limiter(ItemExponentialRateLimiter::new(MS, Duration::from_secs(1))),
    );
    assert_eq!(rate_limited_delay(&q, "one").await, MS);
    assert_eq!(rate_limited_delay(&q, "one").await, 2 * MS);
    assert_eq!(q.num_requeues(&"one"), 2);

    assert_eq!(rate_limited_delay(&q, "two").await, MS);
    assert_eq!(rate_limited_delay(&q, "two").await, 2 * MS);

    q.forget(&"one");
    assert_eq!(q.num_requeues(&"one"), 0);
    assert_eq!(rate_limited_delay(&q, "one").await, MS);
}

// ---------------------------------------------------------------------------------------------
// default_rate_limiters_test.go

#[test]
fn default_rate_limiters_test_item_exponential_rate_limiter() {
    let limiter = ItemExponentialRateLimiter::new(MS, Duration::from_secs(1));
    for expected in [1, 2, 4, 8, 16] {
        assert_eq!(limiter.when(&"one"), expected * MS);
    }
    assert_eq!(limiter.num_requeues(&"one"), 5);

    assert_eq!(limiter.when(&"two"), MS);
    assert_eq!(limiter.when(&"two"), 2 * MS);
    assert_eq!(limiter.num_requeues(&"two"), 2);

    limiter.forget(&"one");
    assert_eq!(limiter.num_requeues(&"one"), 0);
    assert_eq!(limiter.when(&"one"), MS);
}

#[test]
fn default_rate_limiters_test_item_exponential_rate_limiter_overflow() {
    let limiter = ItemExponentialRateLimiter::new(MS, Duration::from_secs(1000));
    for _ in 0..5 {
        limiter.when(&"one");
    }
    assert_eq!(limiter.when(&"one"), 32 * MS);
    for _ in 0..1000 {
        limiter.when(&"overflow1");
    }
    assert_eq!(limiter.when(&"overflow1"), Duration::from_secs(1000));

    const MINUTE: Duration = Duration::from_secs(60);
    const HOUR: Duration = Duration::from_secs(3600);
    let limiter = ItemExponentialRateLimiter::new(MINUTE, 1000 * HOUR);
    for _ in 0..2 {
        limiter.when(&"two");
    }
    assert_eq!(limiter.when(&"two"), 4 * MINUTE);
    for _ in 0..1000 {
        limiter.when(&"overflow2");
    }
    assert_eq!(limiter.when(&"overflow2"), 1000 * HOUR);
}

#[test]
fn default_rate_limiters_test_item_fast_slow_rate_limiter() {
    let limiter = ItemFastSlowRateLimiter::new(5 * MS, Duration::from_secs(10), 3);
    for _ in 0..3 {
        assert_eq!(limiter.when(&"one"), 5 * MS);
    }
    assert_eq!(limiter.when(&"one"), Duration::from_secs(10));
    assert_eq!(limiter.when(&"one"), Duration::from_secs(10));
    assert_eq!(limiter.num_requeues(&"one"), 5);

    assert_eq!(limiter.when(&"two"), 5 * MS);
    assert_eq!(limiter.when(&"two"), 5 * MS);
    assert_eq!(limiter.num_requeues(&"two"), 2);

    limiter.forget(&"one");
    assert_eq!(limiter.num_requeues(&"one"), 0);
    assert_eq!(limiter.when(&"one"), 5 * MS);
}

#[test]
fn default_rate_limiters_test_max_of_rate_limiter() {
    let limiter: MaxOfRateLimiter<&str> = MaxOfRateLimiter::new(vec![
        Box::new(ItemFastSlowRateLimiter::new(
            5 * MS,
            Duration::from_secs(3),
            3,
        )),
        Box::new(ItemExponentialRateLimiter::new(MS, Duration::from_secs(1))),
    ]);
    // Fast-slow wins while the exponential backoff is below 5 ms, then its slow 3 s wins.
    for _ in 0..3 {
        assert_eq!(limiter.when(&"one"), 5 * MS);
    }
    assert_eq!(limiter.when(&"one"), Duration::from_secs(3));
    assert_eq!(limiter.when(&"one"), Duration::from_secs(3));
    assert_eq!(limiter.num_requeues(&"one"), 5);

    assert_eq!(limiter.when(&"two"), 5 * MS);
    assert_eq!(limiter.when(&"two"), 5 * MS);
    assert_eq!(limiter.num_requeues(&"two"), 2);

    limiter.forget(&"one");
    assert_eq!(limiter.num_requeues(&"one"), 0);
    assert_eq!(limiter.when(&"one"), 5 * MS);
}

/// Returns `low` for its first `threshold` calls (whatever the item) and `high` after that.
struct StepLimiter {
    calls: AtomicU32,
    threshold: u32,
    low: Duration,
    high: Duration,
}

impl RateLimiter<u32> for StepLimiter {
    fn when(&self, _item: &u32) -> Duration {
        if self.calls.fetch_add(1, Ordering::SeqCst) < self.threshold {
            self.low
        } else {
            self.high
        }
    }
    fn forget(&self, _item: &u32) {}
    fn num_requeues(&self, _item: &u32) -> u32 {
        0
    }
}

#[test]
fn default_rate_limiters_test_with_max_wait_rate_limiter() {
    let step = StepLimiter {
        calls: AtomicU32::new(0),
        threshold: 100,
        low: 5 * MS,
        high: Duration::from_secs(1000),
    };
    let limiter = WithMaxWaitRateLimiter::new(step, Duration::from_secs(500));
    for i in 0..100 {
        assert_eq!(limiter.when(&i), 5 * MS, "call {i} is under the cap");
    }
    for i in 100..200 {
        assert_eq!(
            limiter.when(&i),
            Duration::from_secs(500),
            "call {i} is capped"
        );
    }
}
