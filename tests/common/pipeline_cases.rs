// The pipeline rules of SEMANTICS.md, on the in-memory source (no etcd needed). Included by
// tests/pipeline.rs, tests/pipeline_delta_fifo.rs and tests/pipeline_compact.rs, which set
// `PROCESSING` and `COMPACT`: every rule holds in both processing modes and with a compact cache.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_informer::listwatch::Error;
use etcd_informer::testing::FakeSource;
use etcd_informer::{
    Controller, ControllerConfig, DeltaFifo, DeltaType, Event, InformerOptions, ListerWatcher,
    Object, ReflectorOptions, ResourceEventHandlerFuncs, SharedIndexInformer, WatchEvent,
};
use tokio_stream::StreamExt;

type Log = Arc<Mutex<Vec<String>>>;
type RevisionsByKey = Arc<Mutex<HashMap<String, Vec<i64>>>>;

/// Holds handlers back until opened (a handler thread blocks in `pass`).
#[derive(Default)]
struct Gate(std::sync::atomic::AtomicBool);

impl Gate {
    fn pass(&self) {
        while !self.0.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    fn open(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Waits (in real time) until `cond` holds, failing after 10 s with `what`.
async fn eventually(what: &str, cond: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn recorder(log: &Log) -> ResourceEventHandlerFuncs<String> {
    let (a, u, d) = (log.clone(), log.clone(), log.clone());
    ResourceEventHandlerFuncs::new()
        .on_add(move |o, init| {
            a.lock()
                .unwrap()
                .push(format!("add {} {} {}", o.key(), o.value, init))
        })
        .on_update(move |old, new| {
            u.lock()
                .unwrap()
                .push(format!("update {} {}->{}", new.key(), old.value, new.value))
        })
        .on_delete(move |o| {
            d.lock().unwrap().push(format!(
                "delete {} {} {}",
                o.key(),
                o.object().value,
                if o.is_final_state_unknown() {
                    "tombstone"
                } else {
                    "final"
                }
            ))
        })
}

fn fast_options() -> InformerOptions<String> {
    let options = InformerOptions::default().with_name("test").with_backoff(etcd_informer::Backoff::new(
            Duration::from_millis(1),
            Duration::from_millis(10),
            Duration::from_secs(120),
            0.0,
        )).with_processing(PROCESSING);
    if COMPACT {
        options.with_compact_cache(etcd_informer::codec::TextCodec)
    } else {
        options
    }
}

fn started(
    source: &FakeSource<String>,
    options: InformerOptions<String>,
) -> SharedIndexInformer<String> {
    let informer = SharedIndexInformer::new(source.clone(), options);
    tokio::spawn(informer.clone().run());
    informer
}

/// Whether the informer's cache holds exactly the source's objects at their revisions.
fn caught_up(informer: &SharedIndexInformer<String>, source: &FakeSource<String>) -> bool {
    let cache: Vec<(String, i64)> = informer
        .lister()
        .list()
        .iter()
        .map(|o| (o.key().to_string(), o.mod_revision))
        .collect();
    let want: Vec<(String, i64)> = source
        .objects()
        .iter()
        .map(|o| (o.key().to_string(), o.mod_revision))
        .collect();
    cache == want
}

fn snapshot(log: &Log) -> Vec<String> {
    log.lock().unwrap().clone()
}

#[tokio::test]
async fn add_update_delete_reach_handler_in_order_with_values() {
    let source: FakeSource<String> = FakeSource::new();
    source.put("ns/a", "1".into());
    let informer = SharedIndexInformer::new(source.clone(), fast_options());
    let log = Log::default();
    let reg = informer.add_event_handler(recorder(&log)).unwrap();
    tokio::spawn(informer.clone().run());
    eventually("handler synced", || reg.has_synced()).await;
    source.put("ns/a", "2".into());
    eventually("update", || snapshot(&log).len() == 2).await;
    source.put("ns/b", "x".into());
    eventually("add", || snapshot(&log).len() == 3).await;
    source.delete("ns/a");
    eventually("delete", || snapshot(&log).len() == 4).await;
    assert_eq!(
        snapshot(&log),
        [
            "add ns/a 1 true",
            "update ns/a 1->2",
            "add ns/b x false",
            "delete ns/a 2 final"
        ]
    );
    assert!(informer.lister().get("ns/a").is_none());
    assert_eq!(informer.last_synced_revision(), source.revision());
}

#[tokio::test]
async fn store_is_updated_before_handlers_are_notified() {
    let source: FakeSource<String> = FakeSource::new();
    let informer = SharedIndexInformer::new(source.clone(), fast_options());
    let lister = informer.lister();
    let violations = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(AtomicUsize::new(0));
    let (v1, v2, s1, s2) = (
        violations.clone(),
        violations.clone(),
        seen.clone(),
        seen.clone(),
    );
    let l2 = lister.clone();
    informer
        .add_event_handler(
            ResourceEventHandlerFuncs::<String>::new()
                .on_update(move |_, new| {
                    s1.fetch_add(1, Ordering::SeqCst);
                    if lister
                        .get(new.key())
                        .is_none_or(|c| c.mod_revision < new.mod_revision)
                    {
                        v1.fetch_add(1, Ordering::SeqCst);
                    }
                })
                .on_delete(move |o| {
                    s2.fetch_add(1, Ordering::SeqCst);
                    if let Some(c) = l2.get(o.key()) {
                        if c.mod_revision <= o.object().mod_revision {
                            v2.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }),
        )
        .unwrap();
    tokio::spawn(informer.clone().run());
    informer.wait_for_cache_sync().await;
    source.put("k", "0".into());
    for i in 1..200 {
        source.put("k", i.to_string());
    }
    eventually("all updates", || seen.load(Ordering::SeqCst) == 199).await;
    source.delete("k");
    eventually("the delete", || seen.load(Ordering::SeqCst) == 200).await;
    assert_eq!(violations.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn per_key_revision_order_for_every_handler() {
    let source: FakeSource<String> = FakeSource::new();
    let informer = started(&source, fast_options());
    let logs: Vec<RevisionsByKey> = (0..3).map(|_| Default::default()).collect();
    for log in &logs {
        let (a, u) = (log.clone(), log.clone());
        informer
            .add_event_handler(
                ResourceEventHandlerFuncs::new()
                    .on_add(move |o, _| {
                        a.lock()
                            .unwrap()
                            .entry(o.key().into())
                            .or_default()
                            .push(o.mod_revision)
                    })
                    .on_update(move |_, o| {
                        u.lock()
                            .unwrap()
                            .entry(o.key().into())
                            .or_default()
                            .push(o.mod_revision)
                    }),
            )
            .unwrap();
    }
    informer.wait_for_cache_sync().await;
    for i in 0..300 {
        source.put(&format!("k{}", i % 7), i.to_string());
    }
    for log in &logs {
        eventually("300 events", || {
            log.lock().unwrap().values().map(Vec::len).sum::<usize>() == 300
        })
        .await;
        for (key, revs) in log.lock().unwrap().iter() {
            assert!(
                revs.windows(2).all(|w| w[0] < w[1]),
                "{key}: {revs:?} out of order"
            );
        }
    }
}

#[tokio::test]
async fn relist_after_compaction_delivers_tombstones_with_last_state() {
    let source: FakeSource<String> = FakeSource::new();
    source.put("ns/keep", "k1".into());
    source.put("ns/gone", "g1".into());
    source.put("ns/gone", "g2".into());
    let informer = SharedIndexInformer::new(source.clone(), fast_options());
    let log = Log::default();
    informer.add_event_handler(recorder(&log)).unwrap();
    // Break the first watch before it starts, so the deletes below happen while disconnected.
    source.fail_next_watch(Error::transient("connection refused"));
    tokio::spawn(informer.clone().run());
    eventually("synced", || informer.has_synced()).await;
    source.break_watches(Error::transient("connection reset"));
    source.fail_next_watch(Error::transient("still down"));
    source.delete("ns/gone");
    source.put("ns/new", "n1".into());
    source.compact();
    source.break_watches(Error::transient("connection reset"));
    eventually("relisted", || {
        snapshot(&log).iter().any(|l| l.starts_with("delete"))
    })
    .await;
    eventually("new key", || informer.lister().get("ns/new").is_some()).await;
    let log = snapshot(&log);
    assert!(
        log.contains(&"delete ns/gone g2 tombstone".to_string()),
        "{log:?}"
    );
    assert!(log.contains(&"add ns/new n1 false".to_string()), "{log:?}");
    assert!(
        !log.iter()
            .any(|l| l.contains("ns/keep") && !l.starts_with("add")),
        "unchanged key not re-delivered: {log:?}"
    );
    assert!(source.list_count() >= 2);
    let keys: Vec<String> = informer
        .lister()
        .list()
        .iter()
        .map(|o| o.key().to_string())
        .collect();
    assert_eq!(keys, ["ns/keep", "ns/new"]);
}

#[tokio::test]
async fn transient_watch_errors_resume_without_relist() {
    let source: FakeSource<String> = FakeSource::new();
    source.put("a", "1".into());
    let informer = started(&source, fast_options());
    informer.wait_for_cache_sync().await;
    for i in 2..5 {
        source.break_watches(Error::transient("reset"));
        source.put("a", i.to_string());
    }
    eventually("latest value", || {
        informer.lister().get("a").is_some_and(|o| o.value == "4")
    })
    .await;
    assert_eq!(source.list_count(), 1, "no relist for transient errors");
    assert!(source.watch_count() >= 2);
}

#[tokio::test]
async fn duplicate_and_stale_events_are_dropped() {
    let source: FakeSource<String> = FakeSource::new();
    let informer = SharedIndexInformer::new(source.clone(), fast_options());
    let log = Log::default();
    informer.add_event_handler(recorder(&log)).unwrap();
    tokio::spawn(informer.clone().run());
    informer.wait_for_cache_sync().await;
    let rev = source.put("a", "new".into());
    eventually("add", || snapshot(&log).len() == 1).await;
    source.inject(|| WatchEvent::Modified(Object::new("a", rev, "duplicate".to_string())));
    source.inject(|| WatchEvent::Modified(Object::new("a", rev - 1, "stale".to_string())));
    source.inject(|| WatchEvent::Deleted {
        key: "nobody".into(),
        revision: rev + 5,
        last: None,
    });
    source.put("b", "marker".into());
    eventually("marker", || snapshot(&log).len() == 2).await;
    assert_eq!(snapshot(&log), ["add a new false", "add b marker false"]);
}

#[tokio::test]
async fn slow_handler_stalls_nobody_and_its_backlog_is_visible() {
    let source: FakeSource<String> = FakeSource::new();
    let informer = started(&source, fast_options());
    let gate = Arc::new(Gate::default());
    let g = gate.clone();
    let slow = informer
        .add_event_handler(ResourceEventHandlerFuncs::new().on_add(move |_, _| g.pass()))
        .unwrap();
    let fast_count = Arc::new(AtomicUsize::new(0));
    let f = fast_count.clone();
    informer
        .add_event_handler(ResourceEventHandlerFuncs::new().on_add(move |_, _| {
            f.fetch_add(1, Ordering::SeqCst);
        }))
        .unwrap();
    informer.wait_for_cache_sync().await;
    for i in 0..100 {
        source.put(&format!("k{i}"), "v".into());
    }
    eventually("fast handler got all", || {
        fast_count.load(Ordering::SeqCst) == 100
    })
    .await;
    eventually("cache has all", || informer.lister().len() == 100).await;
    assert!(
        slow.backlog() >= 99,
        "slow handler backlog {}",
        slow.backlog()
    );
    gate.open();
    eventually("slow handler drains", || {
        slow.backlog() == 0 && slow.delivered() == 100
    })
    .await;
}

/// An inline handler is called on the informer's own task as each change is applied: it has
/// heard the cached objects by the time it is registered, then every change in order, before
/// the informer applies the next; no delivery thread calls it, its panic is counted and the
/// next change still reaches it, and once removed it is never called again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inline_handler_runs_on_the_informers_task_in_order() {
    let source: FakeSource<String> = FakeSource::new();
    source.put("a", "1".into());
    let informer = started(&source, fast_options());
    informer.wait_for_cache_sync().await;
    let log = Arc::new(Mutex::new(Vec::<String>::new()));
    let threads = Arc::new(Mutex::new(Vec::<String>::new()));
    let (l1, l2, t1) = (log.clone(), log.clone(), threads.clone());
    let lister = informer.lister();
    let handler = ResourceEventHandlerFuncs::new()
        .on_add(move |o, initial| {
            let name = std::thread::current().name().unwrap_or("").to_owned();
            t1.lock().unwrap().push(name);
            if o.value == "boom" {
                panic!("an inline handler's panic");
            }
            // The change is in the cache already, and nothing after it yet.
            assert_eq!(lister.len(), o.key().trim_start_matches('k').parse::<usize>().map_or(1, |i| i + 2));
            l1.lock().unwrap().push(format!("add {} {initial}", o.key()));
        })
        .on_update(move |_, o| l2.lock().unwrap().push(format!("update {}", o.key())));
    let registration = informer
        .add_inline_event_handler("inline", handler)
        .expect("registered");
    assert_eq!(snapshot(&log), ["add a true"], "the cached object, before it returns");
    assert!(registration.has_synced());
    for i in 0..50 {
        source.put(&format!("k{i}"), "v".into());
    }
    source.put("a", "2".into());
    eventually("every change", || snapshot(&log).len() == 52).await;
    let mut expected = vec!["add a true".to_owned()];
    expected.extend((0..50).map(|i| format!("add k{i} false")));
    expected.push("update a".into());
    assert_eq!(snapshot(&log), expected, "in order");
    assert!(
        threads.lock().unwrap().iter().all(|t| !t.starts_with("handlers-")),
        "no delivery thread called it: {:?}",
        threads.lock().unwrap()
    );
    source.put("k50", "boom".into());
    source.put("k51", "v".into());
    eventually("the change after the panic", || snapshot(&log).len() == 53).await;
    assert_eq!(registration.panics(), 1);
    assert!(informer.remove_event_handler_async(&registration).await);
    // Handlers are called in order of registration: once one registered after the removal
    // has heard the change, the removed one would have.
    let after = Arc::new(Mutex::new(Vec::<String>::new()));
    let a = after.clone();
    let witness = ResourceEventHandlerFuncs::new().on_add(move |o, initial| {
        if !initial {
            a.lock().unwrap().push(o.key().to_string());
        }
    });
    informer
        .add_inline_event_handler("witness", witness)
        .expect("registered");
    source.put("k52", "v".into());
    eventually("the witness heard it", || snapshot(&after) == ["k52"]).await;
    assert_eq!(snapshot(&log).len(), 53, "not called once removed");
}

/// An inline handler that calls what waits for it (its informer's `has_synced`, a handler
/// registration) panics, and the panic is counted, instead of stalling the cache; another
/// informer's `has_synced` is fine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inline_handler_that_waits_for_itself_panics_instead_of_stalling() {
    let source: FakeSource<String> = FakeSource::new();
    let informer = started(&source, fast_options());
    informer.wait_for_cache_sync().await;
    let other_source: FakeSource<String> = FakeSource::new();
    let other = started(&other_source, fast_options());
    other.wait_for_cache_sync().await;
    let seen = Arc::new(AtomicUsize::new(0));
    let (me, s) = (informer.clone(), seen.clone());
    let handler = ResourceEventHandlerFuncs::new().on_add(move |o, _| {
        assert!(other.has_synced());
        s.fetch_add(1, Ordering::SeqCst);
        match o.key() {
            "synced" => {
                me.has_synced();
            }
            "register" => {
                let _ = me.add_event_handler(ResourceEventHandlerFuncs::new());
            }
            _ => {}
        }
    });
    let registration = informer
        .add_inline_event_handler("inline", handler)
        .expect("registered");
    for key in ["synced", "register", "after"] {
        source.put(key, "v".into());
    }
    eventually("every change, and the cache goes on", || {
        seen.load(Ordering::SeqCst) == 3 && informer.lister().len() == 3
    })
    .await;
    assert_eq!(registration.panics(), 2);
    assert_eq!(informer.handler_count(), 1);
}

/// Correctness review, finding 1: handlers that each keep up with their own events but one of
/// which is slower than the rest, call after call (under the 20 ms that counts as stuck), must
/// not hold the others to its pace. `slow_ms` per add for one handler, nothing for `fast`
/// others; `puts` writes paced 1 ms apart; returns how long after the last put the last fast
/// handler had every add.
async fn fast_handlers_keep_their_pace_beside(slow_ms: u64, fast: usize, puts: usize) -> Duration {
    let source: FakeSource<String> = FakeSource::new();
    let informer = started(&source, fast_options());
    informer
        .add_event_handler(ResourceEventHandlerFuncs::new().on_add(move |_, _| {
            std::thread::sleep(Duration::from_millis(slow_ms))
        }))
        .unwrap();
    let done: Arc<Mutex<Vec<Option<std::time::Instant>>>> = Arc::new(Mutex::new(vec![None; fast]));
    for h in 0..fast {
        let (seen, done) = (Arc::new(AtomicUsize::new(0)), done.clone());
        informer
            .add_event_handler(ResourceEventHandlerFuncs::new().on_add(move |_, _| {
                if seen.fetch_add(1, Ordering::SeqCst) + 1 == puts {
                    done.lock().unwrap()[h] = Some(std::time::Instant::now());
                }
            }))
            .unwrap();
    }
    informer.wait_for_cache_sync().await;
    for i in 0..puts {
        source.put(&format!("k{i}"), "v".into());
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let last_put = std::time::Instant::now();
    eventually("every fast handler got every add", || {
        done.lock().unwrap().iter().all(Option::is_some)
    })
    .await;
    let last = done.lock().unwrap().iter().flatten().max().copied().unwrap();
    last.saturating_duration_since(last_put)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_slower_than_the_other_does_not_set_its_pace() {
    // 300 adds at 15 ms each would keep a handler sharing its thread busy 4.5 s past the last put.
    let behind = fast_handlers_keep_their_pace_beside(15, 1, 300).await;
    println!("the fast handler finished {behind:?} after the last put");
    assert!(behind < Duration::from_millis(250), "{behind:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_slow_handler_among_eleven_does_not_set_the_pace_of_ten() {
    let behind = fast_handlers_keep_their_pace_beside(5, 10, 200).await;
    println!("the ten fast handlers finished {behind:?} after the last put");
    assert!(behind < Duration::from_millis(250), "{behind:?}");
}

/// Correctness review, finding 6: removing a handler from async code while it is inside a
/// notification must not block the runtime's thread (one thread here: a blocked thread would
/// stop the timer below).
#[tokio::test(flavor = "current_thread")]
async fn removing_a_busy_handler_from_async_code_leaves_the_runtime_running() {
    let source: FakeSource<String> = FakeSource::new();
    let informer = started(&source, fast_options());
    let gate = Arc::new(Gate::default());
    let g = gate.clone();
    let entered = Arc::new(AtomicUsize::new(0));
    let e = entered.clone();
    let reg = informer
        .add_event_handler(ResourceEventHandlerFuncs::new().on_add(move |_, _| {
            e.fetch_add(1, Ordering::SeqCst);
            g.pass();
        }))
        .unwrap();
    informer.wait_for_cache_sync().await;
    source.put("a", "v".into());
    eventually("the handler is inside its call", || entered.load(Ordering::SeqCst) == 1).await;
    let removal = informer.remove_event_handler_async(&reg);
    tokio::pin!(removal);
    // The runtime goes on while the removal waits for the handler.
    let ticked = tokio::select! {
        _ = &mut removal => false,
        _ = tokio::time::sleep(Duration::from_millis(50)) => true,
    };
    assert!(ticked, "the removal returned while the handler was still inside its call");
    gate.open();
    assert!(removal.await, "it was registered");
    assert_eq!(informer.handler_count(), 0);
}

#[tokio::test]
async fn bounded_backlog_keeps_final_state_of_every_key() {
    let source: FakeSource<String> = FakeSource::new();
    let options = fast_options().with_max_handler_backlog(Some(16));
    let informer = started(&source, options);
    let gate = Arc::new(Gate::default());
    let state: Arc<Mutex<HashMap<String, String>>> = Default::default();
    let (g1, g2, g3) = (gate.clone(), gate.clone(), gate.clone());
    let (s1, s2, s3) = (state.clone(), state.clone(), state.clone());
    let reg = informer
        .add_event_handler(
            ResourceEventHandlerFuncs::<String>::new()
                .on_add(move |o, _| {
                    g1.pass();
                    assert!(
                        s1.lock()
                            .unwrap()
                            .insert(o.key().into(), o.value.clone())
                            .is_none(),
                        "add of a present key"
                    );
                })
                .on_update(move |_, o| {
                    g2.pass();
                    assert!(
                        s2.lock()
                            .unwrap()
                            .insert(o.key().into(), o.value.clone())
                            .is_some(),
                        "update of an absent key"
                    );
                })
                .on_delete(move |o| {
                    g3.pass();
                    s3.lock().unwrap().remove(o.key());
                }),
        )
        .unwrap();
    informer.wait_for_cache_sync().await;
    for i in 0..2000 {
        let key = format!("k{}", i % 8);
        if i % 13 == 0 {
            source.delete(&key);
        } else {
            source.put(&key, i.to_string());
        }
    }
    eventually("cache caught up", || caught_up(&informer, &source)).await;
    assert!(reg.backlog() <= 32, "backlog {} not bounded", reg.backlog());
    gate.open();
    eventually("handler drained", || reg.backlog() == 0).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let cache: HashMap<String, String> = informer
        .lister()
        .list()
        .iter()
        .map(|o| (o.key().to_string(), o.value.clone()))
        .collect();
    assert_eq!(*state.lock().unwrap(), cache);
    assert_eq!(reg.panics(), 0, "no handler assertion failed");
}

#[tokio::test]
async fn late_handler_gets_cached_objects_then_live_stream_without_gap_or_duplicate() {
    let source: FakeSource<String> = FakeSource::new();
    for i in 0..50 {
        source.put(&format!("k{i}"), "0".into());
    }
    let informer = started(&source, fast_options());
    informer.wait_for_cache_sync().await;
    let writer = {
        let source = source.clone();
        tokio::spawn(async move {
            for round in 1..=20 {
                for i in 0..50 {
                    source.put(&format!("k{i}"), round.to_string());
                }
                tokio::task::yield_now().await;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(2)).await;
    let state: Arc<Mutex<HashMap<String, (i64, String)>>> = Default::default();
    let errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let (s1, s2, e1, e2) = (state.clone(), state.clone(), errors.clone(), errors.clone());
    let reg = informer
        .add_event_handler(
            ResourceEventHandlerFuncs::<String>::new()
                .on_add(move |o, _| {
                    if s1
                        .lock()
                        .unwrap()
                        .insert(o.key().into(), (o.mod_revision, o.value.clone()))
                        .is_some()
                    {
                        e1.lock()
                            .unwrap()
                            .push(format!("duplicate add {}", o.key()));
                    }
                })
                .on_update(move |old, new| {
                    let mut s = s2.lock().unwrap();
                    match s.get(new.key()) {
                        Some((rev, _)) if *rev == old.mod_revision => {}
                        other => e2.lock().unwrap().push(format!(
                            "gap on {}: had {other:?}, old {}",
                            new.key(),
                            old.mod_revision
                        )),
                    }
                    s.insert(new.key().into(), (new.mod_revision, new.value.clone()));
                }),
        )
        .unwrap();
    writer.await.unwrap();
    eventually("caught up", || caught_up(&informer, &source)).await;
    eventually("handler synced and drained", || {
        reg.has_synced() && reg.backlog() == 0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(
        errors.lock().unwrap().is_empty(),
        "{:?}",
        errors.lock().unwrap()
    );
    let state = state.lock().unwrap();
    assert_eq!(state.len(), 50);
    assert!(state.values().all(|(_, v)| v == "20"));
}

#[tokio::test]
async fn removed_handler_gets_nothing_more() {
    let source: FakeSource<String> = FakeSource::new();
    let informer = started(&source, fast_options());
    let log = Log::default();
    let reg = informer.add_event_handler(recorder(&log)).unwrap();
    informer.wait_for_cache_sync().await;
    source.put("a", "1".into());
    eventually("one", || snapshot(&log).len() == 1).await;
    informer.remove_event_handler(&reg);
    source.put("b", "1".into());
    eventually("cache has b", || informer.lister().get("b").is_some()).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(snapshot(&log).len(), 1);
}

#[tokio::test]
async fn panicking_handler_is_skipped_not_fatal() {
    let source: FakeSource<String> = FakeSource::new();
    let informer = started(&source, fast_options());
    let log = Log::default();
    let l = log.clone();
    let reg = informer
        .add_event_handler(ResourceEventHandlerFuncs::new().on_add(move |o, _| {
            if o.key() == "boom" {
                panic!("handler bug");
            }
            l.lock().unwrap().push(o.key().to_string());
        }))
        .unwrap();
    informer.wait_for_cache_sync().await;
    source.put("boom", "x".into());
    source.put("after", "y".into());
    eventually("after delivered", || snapshot(&log) == ["after"]).await;
    assert_eq!(reg.panics(), 1);
    assert!(informer.lister().get("boom").is_some(), "cache unaffected");
}

#[tokio::test]
async fn handler_synced_only_after_its_initial_adds() {
    let source: FakeSource<String> = FakeSource::new();
    for i in 0..10 {
        source.put(&format!("k{i}"), "v".into());
    }
    let informer = SharedIndexInformer::new(source.clone(), fast_options());
    let gate = Arc::new(Gate::default());
    let g = gate.clone();
    let reg = informer
        .add_event_handler(ResourceEventHandlerFuncs::new().on_add(move |_, _| g.pass()))
        .unwrap();
    tokio::spawn(informer.clone().run());
    informer.wait_for_cache_sync().await;
    assert_eq!(
        informer.lister().len(),
        10,
        "informer synced means every item applied"
    );
    assert!(!reg.has_synced(), "handler still has initial adds pending");
    gate.open();
    eventually("handler synced", || reg.has_synced()).await;
}

#[tokio::test]
async fn wait_for_cache_sync_is_cancellable() {
    let source: FakeSource<String> = FakeSource::new();
    for _ in 0..1000 {
        source.fail_next_list(Error::transient("etcd down"));
    }
    let informer = started(&source, fast_options());
    let waited =
        tokio::time::timeout(Duration::from_millis(100), informer.wait_for_cache_sync()).await;
    assert!(waited.is_err());
    assert!(!informer.has_synced());
}

#[tokio::test(start_paused = true)]
async fn resync_redelivers_cache_to_due_handlers_only_without_listing() {
    let source: FakeSource<String> = FakeSource::new();
    source.put("a", "1".into());
    let informer = SharedIndexInformer::new(source.clone(), fast_options());
    let counts: Vec<Arc<AtomicUsize>> = (0..2).map(|_| Arc::new(AtomicUsize::new(0))).collect();
    let other_object = Arc::new(AtomicUsize::new(0));
    for (i, period) in [Duration::from_secs(1), Duration::ZERO]
        .into_iter()
        .enumerate()
    {
        let c = counts[i].clone();
        let other = other_object.clone();
        informer
            .add_event_handler_with_resync(
                ResourceEventHandlerFuncs::new().on_update(move |old, new| {
                    if !Arc::ptr_eq(old, new) {
                        other.fetch_add(1, Ordering::SeqCst);
                    }
                    c.fetch_add(1, Ordering::SeqCst);
                }),
                period,
            )
            .unwrap();
    }
    tokio::spawn(informer.clone().run());
    informer.wait_for_cache_sync().await;
    // A real-time deadline: the paused clock jumps ahead whenever this runtime is idle, also
    // while a handler's delivery thread (a real thread) waits for a core on a loaded machine,
    // so a deadline on it could pass before any resync had the time to reach the handler.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while counts[0].load(Ordering::SeqCst) < 3 {
        assert!(std::time::Instant::now() < deadline, "no resync");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        counts[1].load(Ordering::SeqCst),
        0,
        "handler without resync got a Sync"
    );
    assert_eq!(
        other_object.load(Ordering::SeqCst),
        0,
        "sync is update(old == new)"
    );
    assert_eq!(source.list_count(), 1, "resync never lists");
}

#[tokio::test(start_paused = true)]
async fn list_failures_back_off_exponentially() {
    let source: FakeSource<String> = FakeSource::new();
    for _ in 0..4 {
        source.fail_next_list(Error::transient("etcd down"));
    }
    let errors = Arc::new(AtomicUsize::new(0));
    let e = errors.clone();
    let options = InformerOptions::default().with_watch_error_handler(Some(Arc::new(move |_: &Error| {
            e.fetch_add(1, Ordering::SeqCst);
        }))).with_processing(PROCESSING);
    let informer = started(&source, options);
    let start = tokio::time::Instant::now();
    informer.wait_for_cache_sync().await;
    let took = start.elapsed();
    // 800 ms + 1.6 s + 3.2 s + 6.4 s = 12 s at least, at most twice that with jitter.
    assert!(took >= Duration::from_secs(12), "{took:?}");
    assert!(took <= Duration::from_secs(25), "{took:?}");
    assert_eq!(errors.load(Ordering::SeqCst), 4);
    assert_eq!(source.list_count(), 5);
}

#[tokio::test]
async fn bookmarks_advance_the_synced_revision() {
    let source: FakeSource<String> = FakeSource::new();
    source.put("a", "1".into());
    let informer = started(&source, fast_options());
    informer.wait_for_cache_sync().await;
    eventually("watch open", || source.open_watches() == 1).await;
    let ahead = source.revision() + 10;
    source.inject(|| WatchEvent::Bookmark(ahead));
    eventually("bookmark applied", || {
        informer.last_synced_revision() == ahead
    })
    .await;
    // The next watch resumes after the bookmark, not before it: here the bookmark is ahead of
    // the store, so resuming from it fails as expired and the informer relists.
    source.break_watches(Error::transient("reset"));
    eventually("relisted", || source.list_count() == 2).await;
}

#[tokio::test]
async fn event_stream_and_transform() {
    let source: FakeSource<String> = FakeSource::new();
    source.put("a", "hello".into());
    let options = fast_options().with_transform(Some(Arc::new(|o: Object<String>| o.map(|v| v.to_uppercase()))));
    let informer = started(&source, options);
    let mut stream = informer.event_stream().unwrap();
    let first = stream.next().await.unwrap();
    assert!(matches!(&first, Event::Added { object, .. } if object.value == "HELLO"));
    source.delete("a");
    let second = stream.next().await.unwrap();
    assert!(matches!(&second, Event::Deleted(d) if d.key() == "a" && !d.is_final_state_unknown()));
}

#[tokio::test]
async fn sleeping_stream_consumer_stays_bounded_and_ends_with_every_final_state() {
    let source: FakeSource<String> = FakeSource::new();
    const BOUND: usize = 32;
    let options = fast_options().with_max_handler_backlog(Some(BOUND));
    let informer = started(&source, options);
    informer.wait_for_cache_sync().await;
    let mut stream = informer.event_stream().unwrap();
    // Another handler, not slowed by the sleeping consumer.
    let log = Log::default();
    let other = informer.add_event_handler(recorder(&log)).unwrap();
    let mut max_backlog = 0;
    for i in 0..1000 {
        let key = format!("k{}", i % 5);
        if i % 17 == 0 {
            source.delete(&key);
        } else {
            source.put(&key, i.to_string());
        }
        if i % 10 == 0 {
            // Pace the writes to the informer and the other handler, so that a loaded machine
            // that starves them for a moment does not make the other handler merge its
            // backlog too: the point is that the sleeping stream does not hold it back.
            eventually("the informer and the other handler keep up", || {
                caught_up(&informer, &source) && other.backlog() < BOUND / 2
            })
            .await;
            max_backlog = max_backlog.max(stream.backlog());
        }
    }
    eventually("cache caught up", || caught_up(&informer, &source)).await;
    eventually("the other handler kept up", || {
        other.backlog() == 0 && other.delivered() as usize == snapshot(&log).len()
    })
    .await;
    assert!(
        snapshot(&log).len() > BOUND,
        "the other handler got more than the stream keeps"
    );
    max_backlog = max_backlog.max(stream.backlog());
    assert!(
        (1..=BOUND).contains(&max_backlog),
        "stream backlog {max_backlog} not within the bound {BOUND}"
    );
    // The consumer wakes up and drains the stream.
    let mut state: HashMap<String, String> = HashMap::new();
    while stream.backlog() > 0 {
        match stream.next().await.expect("stream open") {
            Event::Added { object, .. } => {
                assert!(
                    state.insert(object.key().into(), object.value.clone()).is_none(),
                    "add of a present key"
                );
            }
            Event::Updated { new, .. } => {
                assert!(
                    state.insert(new.key().into(), new.value.clone()).is_some(),
                    "update of an absent key"
                );
            }
            Event::Deleted(d) => {
                assert!(state.remove(d.key()).is_some(), "delete of an absent key");
            }
        }
    }
    let cache: HashMap<String, String> = informer
        .lister()
        .list()
        .iter()
        .map(|o| (o.key().to_string(), o.value.clone()))
        .collect();
    assert_eq!(state, cache, "the consumer ends with every key's final state");
    // And it goes on receiving changes.
    source.put("k0", "last".into());
    let next = tokio::time::timeout(Duration::from_secs(5), stream.next())
        .await
        .expect("a change after the drain")
        .unwrap();
    assert_eq!(next.key(), "k0");
    drop(stream);
    assert_eq!(informer.handler_count(), 1, "dropping the stream unregisters it");
}

#[tokio::test]
async fn handler_panicking_on_every_event_is_counted_and_the_informer_goes_on() {
    let source: FakeSource<String> = FakeSource::new();
    let informer = started(&source, fast_options());
    let broken = informer
        .add_event_handler(
            ResourceEventHandlerFuncs::<String>::new()
                .on_add(|_, _| panic!("broken handler"))
                .on_update(|_, _| panic!("broken handler")),
        )
        .unwrap();
    let log = Log::default();
    informer.add_event_handler(recorder(&log)).unwrap();
    informer.wait_for_cache_sync().await;
    for i in 0..20 {
        source.put(&format!("k{}", i % 4), i.to_string());
    }
    eventually("every change reached the healthy handler", || {
        snapshot(&log).len() == 20
    })
    .await;
    eventually("every panic counted", || broken.panics() == 20).await;
    assert_eq!(broken.delivered(), 20);
    assert!(caught_up(&informer, &source));
    assert!(informer.health().running, "the informer keeps running");
}

#[tokio::test(start_paused = true)]
async fn controller_retry_on_error_backs_off_per_key() {
    let source: FakeSource<String> = FakeSource::new();
    source.put("bad", "1".into());
    source.put("good", "1".into());
    let fifo = Arc::new(DeltaFifo::new(None));
    let attempts: Arc<Mutex<Vec<(String, tokio::time::Instant)>>> = Default::default();
    let a = attempts.clone();
    let controller = Controller::new(ControllerConfig {
        lister_watcher: source.clone(),
        queue: fifo.clone(),
        process: Box::new(move |deltas, _| {
            let key = deltas[0].object.key().to_string();
            let mut a = a.lock().unwrap();
            a.push((key.clone(), tokio::time::Instant::now()));
            let failures = a.iter().filter(|(k, _)| k == "bad").count();
            if key == "bad" && failures <= 3 {
                return Err("not yet".into());
            }
            Ok(())
        }),
        retry_on_error: true,
        reflector: ReflectorOptions::default(),
    });
    tokio::spawn(controller.run());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while attempts
        .lock()
        .unwrap()
        .iter()
        .filter(|(k, _)| k == "bad")
        .count()
        < 4
    {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let a = attempts.lock().unwrap();
    let bad: Vec<_> = a
        .iter()
        .filter(|(k, _)| k == "bad")
        .map(|(_, t)| *t)
        .collect();
    let gaps: Vec<Duration> = bad.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(
        gaps[0] >= Duration::from_millis(100)
            && gaps[1] >= Duration::from_millis(200)
            && gaps[2] >= Duration::from_millis(400),
        "{gaps:?}"
    );
    assert_eq!(
        a.iter().filter(|(k, _)| k == "good").count(),
        1,
        "other keys flow once"
    );
}

#[tokio::test]
async fn reflector_feeds_a_fifo_popped_by_hand() {
    let source: FakeSource<String> = FakeSource::new();
    source.put("a", "1".into());
    let fifo = Arc::new(DeltaFifo::new(None));
    let reflector =
        etcd_informer::Reflector::new(source.clone(), fifo.clone(), ReflectorOptions::default());
    let task = tokio::spawn(reflector.run());
    let mut kinds = vec![];
    let popped = fifo
        .pop(|d, _| {
            kinds.extend(d.iter().map(|d| d.kind));
            Ok(())
        })
        .await;
    assert!(popped.is_processed());
    source.put("a", "2".into());
    let popped = fifo
        .pop(|d, _| {
            kinds.extend(d.iter().map(|d| d.kind));
            Ok(())
        })
        .await;
    assert!(popped.is_processed());
    assert_eq!(kinds, [DeltaType::Replaced, DeltaType::Updated]);
    task.abort();
    let _ = source.list().await;
}

#[tokio::test]
async fn indexers_added_after_start_reindex_the_cache() {
    let source: FakeSource<String> = FakeSource::new();
    source.put("a/1", "red".into());
    source.put("b/2", "blue".into());
    let informer = started(&source, fast_options());
    informer.wait_for_cache_sync().await;
    let mut by_value: etcd_informer::Indexers<String> = HashMap::new();
    by_value.insert(
        "value".into(),
        etcd_informer::IndexFunc::new(|o: &Object<String>| vec![o.value.clone()]),
    );
    informer.add_indexers(by_value).unwrap();
    assert_eq!(
        informer.lister().by_index("value", "red").unwrap()[0].key(),
        "a/1"
    );
    source.put("c/3", "red".into());
    eventually("new object indexed", || {
        informer.lister().by_index("value", "red").unwrap().len() == 2
    })
    .await;
}

#[tokio::test]
async fn resync_fires_every_period_in_real_time() {
    let source: FakeSource<String> = FakeSource::new();
    source.put("a", "1".into());
    let informer = SharedIndexInformer::new(source.clone(), fast_options());
    let syncs = Arc::new(AtomicUsize::new(0));
    let s = syncs.clone();
    informer
        .add_event_handler_with_resync(
            ResourceEventHandlerFuncs::<String>::new().on_update(move |_, _| {
                s.fetch_add(1, Ordering::SeqCst);
            }),
            Duration::from_secs(1),
        )
        .unwrap();
    tokio::spawn(informer.clone().run());
    informer.wait_for_cache_sync().await;
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let n = syncs.load(Ordering::SeqCst);
    assert!(
        (3..=4).contains(&n),
        "{n} resyncs in 3.5 s with a 1 s period"
    );
}

#[tokio::test]
async fn stopped_informer_lets_handler_threads_finish_and_end() {
    let source: FakeSource<String> = FakeSource::new();
    source.put("a", "1".into());
    let informer = SharedIndexInformer::new(source.clone(), fast_options());
    let token = Arc::new(());
    let held = token.clone();
    // The handler holds the informer too: a cycle that must not keep its thread alive.
    let inf = informer.clone();
    let delivered = Arc::new(AtomicUsize::new(0));
    let d = delivered.clone();
    informer
        .add_event_handler(
            ResourceEventHandlerFuncs::<String>::new().on_add(move |_, _| {
                let _ = (&held, inf.has_synced());
                d.fetch_add(1, Ordering::SeqCst);
            }),
        )
        .unwrap();
    let run = tokio::spawn(informer.clone().run());
    informer.wait_for_cache_sync().await;
    informer.stop();
    tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .expect("run returns after stop")
        .unwrap();
    drop(informer);
    eventually("handler thread ended and dropped its handler", || {
        Arc::strong_count(&token) == 1
    })
    .await;
    assert_eq!(delivered.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn stop_ends_run_under_sustained_writes() {
    let source: FakeSource<String> = FakeSource::new();
    let informer = started(&source, fast_options());
    informer.wait_for_cache_sync().await;
    let writer = {
        let source = source.clone();
        tokio::spawn(async move {
            for i in 0.. {
                source.put(&format!("k{}", i % 100), i.to_string());
                tokio::task::yield_now().await;
            }
        })
    };
    let run = tokio::spawn(informer.clone().run());
    tokio::time::sleep(Duration::from_millis(50)).await;
    informer.stop();
    let _ = run.await;
    writer.abort();
}

#[tokio::test]
async fn wiped_store_reannounces_objects_even_at_equal_revisions() {
    let source: FakeSource<String> = FakeSource::new();
    source.put("a", "old".into()); // revision 2
    source.put("x", "1".into()); // 3
    source.delete("x"); // 4
    let informer = SharedIndexInformer::new(source.clone(), fast_options());
    let log = Log::default();
    informer.add_event_handler(recorder(&log)).unwrap();
    tokio::spawn(informer.clone().run());
    informer.wait_for_cache_sync().await;
    source.wipe();
    assert_eq!(
        source.put("a", "new".into()),
        2,
        "same key, same revision, new value"
    );
    eventually("new value cached", || {
        informer.lister().get("a").is_some_and(|o| o.value == "new")
    })
    .await;
    eventually("handler told", || snapshot(&log).len() == 3).await;
    assert_eq!(
        snapshot(&log),
        [
            "add a old true",
            "delete a old tombstone",
            "add a new false"
        ]
    );
}

#[tokio::test]
async fn resync_due_during_a_long_backoff_still_reaches_the_handler() {
    let source: FakeSource<String> = FakeSource::new();
    source.put("a", "1".into());
    let slow = Duration::from_millis(3200);
    let options = fast_options().with_backoff(etcd_informer::Backoff::new(slow, slow, Duration::from_secs(120), 0.0));
    let informer = SharedIndexInformer::new(source.clone(), options);
    let syncs = Arc::new(AtomicUsize::new(0));
    let s = syncs.clone();
    informer
        .add_event_handler_with_resync(
            ResourceEventHandlerFuncs::<String>::new().on_update(move |_, _| {
                s.fetch_add(1, Ordering::SeqCst);
            }),
            Duration::from_secs(1),
        )
        .unwrap();
    tokio::spawn(informer.clone().run());
    informer.wait_for_cache_sync().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The watch is down for 3.2 s: three resync ticks are missed meanwhile.
    source.break_watches(Error::transient("reset"));
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert!(
        syncs.load(Ordering::SeqCst) >= 1,
        "the resync due when the watch resumed was lost"
    );
}

#[tokio::test]
async fn wipe_proven_by_the_watch_reannounces_even_if_revisions_caught_up() {
    let source: FakeSource<String> = FakeSource::new();
    source.put("a", "1".into()); // revision 2
    source.put("b", "1".into()); // 3
    source.put("c", "1".into()); // 4
    let half = Duration::from_millis(500);
    let options = fast_options().with_backoff(etcd_informer::Backoff::new(half, half, Duration::from_secs(120), 0.0));
    let informer = SharedIndexInformer::new(source.clone(), options);
    let log = Log::default();
    informer.add_event_handler(recorder(&log)).unwrap();
    tokio::spawn(informer.clone().run());
    informer.wait_for_cache_sync().await;
    source.wipe();
    // The re-watch (after 500 ms) finds the store went back; during the next backoff the new
    // store's revision passes the old one, so only the watch's verdict tells of the wipe.
    eventually("wipe noticed", || source.watch_count() >= 2).await;
    assert_eq!(source.put("a", "2".into()), 2);
    for k in ["x", "y", "z"] {
        source.put(k, "1".into());
    }
    eventually("relisted", || source.list_count() >= 2).await;
    // The replacement's deltas reach the handler one by one: wait for all of them, in any order.
    let wanted = ["add a 2 false", "delete a 1 tombstone", "delete b 1 tombstone"];
    eventually("a=2 announced and the wiped a and b tombstoned", || {
        let seen = snapshot(&log);
        wanted.iter().all(|w| seen.contains(&w.to_string()))
    })
    .await;
}

#[tokio::test]
async fn panicking_transform_restarts_the_reflector_and_health_shows_it() {
    let source = FakeSource::new();
    source.put("tmp/a", "1".to_string());
    let panicked = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let p = panicked.clone();
    let options = fast_options().with_transform(Some(Arc::new(move |o: Object<String>| {
            if o.value == "boom" && !p.swap(true, Ordering::SeqCst) {
                panic!("transform bug");
            }
            o
        })));
    let informer = started(&source, options);
    eventually("synced", || informer.has_synced()).await;
    assert!(informer.health().is_healthy(), "{:?}", informer.health());
    source.put("tmp/b", "boom".to_string());
    eventually("the cache follows the source after the restart", || {
        caught_up(&informer, &source)
    })
    .await;
    let health = informer.health();
    assert_eq!(health.reflector.restarts, 1, "{health:?}");
    let (error, _) = health.reflector.last_error.expect("the panic is recorded");
    assert!(error.contains("transform bug"), "{error}");
    eventually("healthy again", || informer.health().is_healthy()).await;
}

#[tokio::test]
async fn panicking_index_function_is_recorded_and_later_changes_flow() {
    let source = FakeSource::new();
    let mut indexers = etcd_informer::store::namespace_indexers::<String>();
    indexers.insert(
        "fragile".into(),
        etcd_informer::IndexFunc::new(|o: &Object<String>| {
            assert!(o.value != "boom", "index bug");
            vec![o.value.clone()]
        }),
    );
    let options = fast_options().with_indexers(indexers);
    let informer = started(&source, options);
    eventually("synced", || informer.has_synced()).await;
    source.put("tmp/a", "boom".to_string());
    eventually("the panic is recorded", || informer.health().apply_panics == 1).await;
    source.put("tmp/c", "fine".to_string());
    eventually("later changes are applied", || {
        informer.lister().get("tmp/c").is_some()
    })
    .await;
}

#[tokio::test]
async fn resync_periods_of_any_length_are_accepted() {
    let source = FakeSource::new();
    source.put("tmp/a", "1".to_string());
    let options = fast_options().with_resync_period(Duration::MAX);
    let informer = started(&source, options);
    let log = Log::default();
    let registration = informer
        .add_event_handler_with_resync(recorder(&log), Duration::MAX)
        .unwrap();
    eventually("synced", || registration.has_synced()).await;
    source.put("tmp/a", "2".to_string());
    eventually("changes flow", || snapshot(&log).len() == 2).await;
    assert!(informer.health().is_healthy());
}

#[tokio::test(start_paused = true)]
async fn relist_after_a_watch_that_stayed_up_is_immediate_a_storm_backs_off() {
    let source = FakeSource::new();
    source.put("tmp/a", "1".to_string());
    let second = Duration::from_secs(1);
    let options = fast_options().with_backoff(etcd_informer::Backoff::new(second, 30 * second, 120 * second, 0.0));
    let informer = started(&source, options);
    while !informer.has_synced() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let expire = || Error::expired(0, "compacted in the test");
    let relisted = |n: usize| {
        let source = source.clone();
        async move {
            while source.list_count() < n {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    };
    // After a watch that stayed up: not a storm, relisted at once.
    tokio::time::sleep(etcd_informer::RELIST_STORM_WINDOW * 2).await;
    let started_at = tokio::time::Instant::now();
    source.break_watches(expire());
    relisted(2).await;
    assert!(started_at.elapsed() < Duration::from_millis(100), "{:?}", started_at.elapsed());
    // The watch after that list expires at once: a storm, so the protective backoff.
    let started_at = tokio::time::Instant::now();
    source.break_watches(expire());
    relisted(3).await;
    assert!(started_at.elapsed() >= second, "{:?}", started_at.elapsed());
    assert!(caught_up(&informer, &source));
}

/// Issue 33, finding 1 (reversing issue 28's choice): a key tally that differs cannot tell a
/// lost event from a store rewritten past the watched revision, where a key at the revision
/// the cache holds may hold another value. The relist retires every cached key and announces
/// every listed one anew, as after a replaced store. (A repeated response no longer moves the
/// tally: issue 28 finding 5.)
#[tokio::test]
async fn a_tally_that_differs_reannounces_every_key() {
    let source: FakeSource<String> = FakeSource::new();
    for k in ["a", "b", "c"] {
        source.put(k, "1".into());
    }
    let informer = SharedIndexInformer::new(source.clone(), fast_options());
    let log = Log::default();
    informer.add_event_handler(recorder(&log)).unwrap();
    tokio::spawn(informer.clone().run());
    informer.wait_for_cache_sync().await;
    eventually("initial adds", || snapshot(&log).len() == 3).await;
    let lists = source.list_count();
    source.break_watches(Error::TallyDiffers {
        revision: source.revision() + 1,
        reason: "etcd counts 2 keys where the watch counted 3".into(),
    });
    eventually("relisted", || source.list_count() > lists).await;
    // A change after the relist: once handlers hear of it, they heard all the relist made.
    source.put("d", "1".into());
    eventually("caught up", || caught_up(&informer, &source)).await;
    eventually("d announced", || {
        snapshot(&log).iter().any(|l| l == "add d 1 false")
    })
    .await;
    // Per key, in order (the DeltaFIFO interleaves keys, the atomic mode retires all first).
    let heard = snapshot(&log)[3..].to_vec();
    for k in ["a", "b", "c", "d"] {
        let of_k: Vec<&String> = heard
            .iter()
            .filter(|l| l.split(' ').nth(1) == Some(k))
            .collect();
        let want = match k {
            "d" => vec!["add d 1 false".to_string()],
            k => vec![format!("delete {k} 1 tombstone"), format!("add {k} 1 false")],
        };
        assert_eq!(of_k, want.iter().collect::<Vec<_>>(), "{heard:?}");
    }
    assert_eq!(heard.len(), 7, "{heard:?}");
    assert_eq!(informer.health().reflector.relists.store_replaced, 1);
}

/// Issue 26, the audit: a delete the watch lost (as etcd 3.4.23 loses one a compaction lands
/// on) is found by the next audit and repaired by a relist; handlers hear of it as a
/// tombstone. The DeltaFIFO mode's cache is not etcd at one revision, so it is not audited.
#[tokio::test]
async fn the_audit_repairs_a_lost_delete_within_a_period() {
    let source: FakeSource<String> = FakeSource::new();
    for k in ["a", "b"] {
        source.put(k, "1".into());
    }
    let period = Duration::from_millis(200);
    let informer = SharedIndexInformer::new(
        source.clone(),
        fast_options().with_audit_period(Some(period)),
    );
    let log = Log::default();
    informer.add_event_handler(recorder(&log)).unwrap();
    tokio::spawn(informer.clone().run());
    informer.wait_for_cache_sync().await;
    source.lose_next_event();
    source.delete("a");
    source.put("c", "1".into());
    eventually("c seen", || informer.lister().get("c").is_some()).await;
    assert!(informer.lister().get("a").is_some(), "the delete was lost");
    if matches!(PROCESSING, etcd_informer::Processing::DeltaFifo) {
        tokio::time::sleep(period * 3).await;
        assert_eq!(informer.health().audit, Default::default());
        return;
    }
    let lost_at = std::time::Instant::now();
    eventually("the audit repaired it", || {
        informer.lister().get("a").is_none()
    })
    .await;
    let took = lost_at.elapsed();
    assert!(took < period * 4, "repaired {took:?} after the loss (period {period:?})");
    eventually("handler told", || {
        snapshot(&log).contains(&"delete a 1 tombstone".to_string())
    })
    .await;
    let health = informer.health();
    assert_eq!(health.audit.repairs, 1, "{health:?}");
    assert_eq!(health.reflector.relists.audit, 1, "{health:?}");
    // Repaired: the next audits find nothing.
    let completed = health.audit.completed;
    eventually("another audit", || informer.health().audit.completed > completed + 1).await;
    assert_eq!(informer.health().audit.repairs, 1);
    assert!(caught_up(&informer, &source));
}
