//! The work queue's unit tests: ordering, deduplication, delays, rate limits, shutdown.

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

mod priority;
