//! Parity with client-go's `tools/cache` tests: each test here is named after the client-go test
//! whose behaviour it checks (`delta_fifo_test_*` for delta_fifo_test.go, `index_test_*`,
//! `thread_safe_store_test_*`, `store_test_*`, `shared_informer_test_*`, `controller_test_*`;
//! client-go's `Test` prefix and the type in its name are dropped where they only repeat the file,
//! e.g. `TestDeltaFIFO_basic` is `delta_fifo_test_basic`, `TestHammerController` is
//! `controller_test_hammer`). The tests are our own, written from what the client-go tests
//! check, on our API: [`FakeSource`] plays client-go's `FakeControllerSource`, an `Object`'s
//! `mod_revision` its resourceVersion, and a relist is forced by breaking the watch and
//! compacting (client-go's `ResetWatch` / `*DropWatch`). Whatever goes through the informer runs
//! in both processing modes ([`Processing::Atomic`] and [`Processing::DeltaFifo`]). Timed tests
//! run on tokio's paused clock, which plays client-go's fake clock; everything else waits for a
//! condition with a deadline, never for a fixed time.
//!
//! The tests covered are those of the client-go trees read (kubernetes' staging copy, from
//! releases that still had `TestDeltaFIFO_requeueOnPop` and `TestDeltaFIFO_addIfNotPresent` to
//! those with `TestDeltaFIFO_transformer`, `TestThreadSafeStoreRV` and `TestReplaceEvents`).
//!
//! Not ported:
//! - delta_fifo_test.go `TestDeltaFIFO_KeyOf`: client-go keys deltas, tombstones and raw objects
//!   through one `KeyOf`; our deltas always carry an `Object`, whose key is its own.
//! - delta_fifo_test.go `BenchmarkDeltaFIFOListKeys`, thread_safe_store_test.go
//!   `BenchmarkIndexer` and `BenchmarkIndexerWithConcurrentReadWrite`: benchmarks, not behaviour
//!   checks (ours live in benches/).
//! - store_test.go `TestFIFOCache` and `TestUndeltaStore`: we deliberately have neither the plain
//!   `FIFO` nor the `UndeltaStore` (only `DeltaFifo`, `RealFifo` and `Indexer`).
//! - shared_informer_test.go `TestSharedInformerInitializationRace` and
//!   `TestSharedInformerStartRace`: they only exist for Go's race detector (no assertion); the
//!   second also races `SetTransform` / `SetWatchErrorHandler` against `Run`, setters we
//!   deliberately lack (both are fixed in `InformerOptions` at construction).
//! - controller_test.go `TestProcessDeltasInBatch`: checks that a transactional store reports
//!   the part of a batch that failed and that only the rest reaches handlers; our store applies
//!   a batch under one lock and cannot fail half-way, so there is no partial-failure API.
//!
//! Deliberate differences (ported, checking our behaviour):
//! - controller_test.go `TestPanicPropagated`: client-go propagates a handler's panic out of
//!   the informer's `Run`; ours logs the panic, counts it (`HandlerRegistration::panics`), skips that one
//!   notification and keeps running.
//! - thread_safe_store_test.go `TestThreadSafeStoreRV`: client-go's store tracks the highest
//!   resourceVersion of what was written into it; our cache's revision is etcd's revision,
//!   advanced by the informer that fills it (a delete advances it, a store filled by hand stays
//!   at 0), so it is checked through `SharedIndexInformer::revision`.
//! - controller_test.go `TestReplaceEvents`: client-go (RealFIFO, atomic replace) delivers a
//!   relist's deletes before its adds and updates; ours delivers the adds and updates first and
//!   the tombstones last (the cache holds the whole relist when handlers hear of it in the
//!   Atomic mode either way), so the events are compared as a set.
//!
//! Differences in how a behaviour is checked:
//! - A relist queues `DeltaType::Replaced` for every listed object: client-go's informers ask
//!   for that too (`EmitDeltaTypeReplaced`), so where a client-go DeltaFIFO test expects `Sync`
//!   from a `Replace` without that option, the port expects `Replaced`.
//! - Our `DeltaFifo::delete` takes a key and the revision of the delete (a delete not newer than
//!   the state the queue knows is a duplicate); the ports pass the revision client-go's object
//!   carries, and the object itself as the last state where client-go passes it.
//! - `TestDeltaFIFO_transformer` and the transforming-informer tests: our transform belongs to
//!   the informer (applied to what the source returns), not to the queue, so they run through
//!   an informer; "transformed exactly once" is checked by counting the transform's calls.
//! - `TestDeltaFIFO_addIfNotPresent`: client-go rejects empty deltas with an error; ours ignores
//!   them.
//! - Handler counts (`eventHandlerCount`, `isRegistered`) are internal in client-go; here
//!   registration is checked by behaviour: who receives the next change, and what
//!   `remove_event_handler` returns.
//! - `TestShutdown` relies on Go's goroutine-leak checker; here every handler thread must end,
//!   which drops the handler (a reference it holds dies).
//! - `TestSharedInformerHandlerAbuse` runs 4 workers and 2000 changes instead of 100 and 10000
//!   (two cores). It and `TestHammerController`, which only look for hangs and races in
//!   client-go, also check that the cache ends equal to the source, and the hammer that each
//!   key's notifications form a valid add/update/delete sequence.
//! - thread_safe_store_test.go reads the index maps directly; the ports read them through
//!   `list_index_func_values` and `index_keys`.

#![cfg(feature = "testing")]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use etcd_informer::delta_fifo::{PopError, Popped};
use etcd_informer::listwatch::Error;
use etcd_informer::testing::FakeSource;
use etcd_informer::{
    Backoff, Controller, ControllerConfig, DeletedObject, Delta, DeltaFifo, DeltaType, Indexer,
    Indexers, Informer, InformerError, InformerOptions, ListResult, ListWatch, Object, Processing,
    ReflectorOptions, ResourceEventHandlerFuncs, SharedIndexInformer, Store, WatchStream,
};

const MODES: [Processing; 2] = [Processing::Atomic, Processing::DeltaFifo];

/// Real-time bound on anything that must happen.
const PATIENCE: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// Helpers

/// Runs `test` in both processing modes, one after the other.
async fn in_both_modes<F, Fut>(test: F)
where
    F: Fn(Processing) -> Fut,
    Fut: Future<Output = ()>,
{
    for mode in MODES {
        test(mode).await;
    }
}

/// Waits in real time until `cond` holds, without moving tokio's clock: the runtime's tasks
/// and the handler threads run meanwhile.
async fn until(what: &str, cond: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + PATIENCE;
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::task::yield_now().await;
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Like [`until`], letting tokio's clock run too (5 ms steps; on a paused clock they take no
/// real time), for conditions that need timers: backoffs, resyncs.
async fn until_ticking(what: &str, cond: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + PATIENCE;
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// Lets spawned tasks run until they block.
async fn settle() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}

/// Moves the paused clock on by `d`, then lets the tasks that woke up run.
async fn step(d: Duration) {
    tokio::time::advance(d).await;
    settle().await;
}

fn options(mode: Processing) -> InformerOptions<String> {
    InformerOptions::default()
        .with_name(format!("parity-{mode:?}"))
        .with_backoff(Backoff::new(
            Duration::from_millis(1),
            Duration::from_millis(10),
            Duration::from_secs(120),
            0.0,
        ))
        .with_processing(mode)
}

fn started(source: &FakeSource<String>, mode: Processing) -> SharedIndexInformer<String> {
    let informer = SharedIndexInformer::new(source.clone(), options(mode));
    tokio::spawn(informer.clone().run());
    informer
}

/// Makes the source's next changes invisible to the open watch, then (once they are made and
/// [`FakeSource::compact`] ran) forces a relist: the watch breaks, and watching again from its
/// revision fails as compacted.
fn drop_watch(source: &FakeSource<String>) {
    source.break_watches(Error::transient("connection reset"));
}

/// Whether the informer's cache holds exactly the source's objects at their revisions.
fn caught_up(informer: &SharedIndexInformer<String>, source: &FakeSource<String>) -> bool {
    let cache: BTreeMap<String, i64> = informer
        .lister()
        .list()
        .iter()
        .map(|o| (o.key().to_string(), o.mod_revision))
        .collect();
    let want: BTreeMap<String, i64> = source
        .objects()
        .iter()
        .map(|o| (o.key().to_string(), o.mod_revision))
        .collect();
    cache == want
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// A log of notifications shared with a handler.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<String>>>);

impl Log {
    fn push(&self, line: String) {
        self.0.lock().unwrap().push(line);
    }
    fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
    fn clear(&self) {
        self.0.lock().unwrap().clear();
    }
    /// client-go's `testListener`: the keys of the adds and updates received.
    fn names(&self) -> BTreeSet<String> {
        self.lines()
            .iter()
            .filter(|l| l.starts_with("add ") || l.starts_with("update "))
            .map(|l| l.split(' ').nth(1).unwrap_or_default().to_string())
            .collect()
    }
    fn contains(&self, line: &str) -> bool {
        self.0.lock().unwrap().iter().any(|l| l == line)
    }

    /// A handler logging `add KEY VALUE`, `update KEY OLD->NEW`, `delete KEY VALUE final|tombstone`.
    fn handler(&self) -> ResourceEventHandlerFuncs<String> {
        let (a, u, d) = (self.clone(), self.clone(), self.clone());
        ResourceEventHandlerFuncs::new()
            .on_add(move |o, _| a.push(format!("add {} {}", o.key(), o.value)))
            .on_update(move |old, new| {
                u.push(format!("update {} {}->{}", new.key(), old.value, new.value))
            })
            .on_delete(move |o| {
                let how = if o.is_final_state_unknown() {
                    "tombstone"
                } else {
                    "final"
                };
                d.push(format!("delete {} {} {how}", o.key(), o.object().value))
            })
    }
}

/// Holds a handler thread back until opened.
#[derive(Default)]
struct Gate(AtomicBool);

impl Gate {
    fn pass(&self) {
        let deadline = std::time::Instant::now() + PATIENCE;
        while !self.0.load(Ordering::SeqCst) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    fn open(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

// DeltaFifo helpers: objects whose value is their revision, summaries of popped deltas.

type Summary = Vec<(DeltaType, i64, bool)>;

fn obj(key: &str, rev: i64) -> Arc<Object<i64>> {
    Arc::new(Object::new(key, rev, rev))
}

/// A DeltaFifo whose "known objects" (the informer's cache, client-go's `KnownObjects`) hold
/// `cached`.
fn fifo_knowing(cached: &[(&str, i64)]) -> DeltaFifo<i64> {
    let indexer = Indexer::default();
    for (k, r) in cached {
        indexer.add(obj(k, *r));
    }
    let known: Arc<dyn Store<i64>> = Arc::new(indexer);
    DeltaFifo::new(Some(known))
}

fn fifo_alone() -> DeltaFifo<i64> {
    DeltaFifo::new(None)
}

fn summary(deltas: &[Delta<i64>]) -> Summary {
    deltas
        .iter()
        .map(|d| (d.kind, d.object.value, d.is_final_state_unknown()))
        .collect()
}

/// Pops one key: its name, its deltas, and whether it belongs to the initial list.
async fn pop_initial(f: &DeltaFifo<i64>) -> (String, Summary, bool) {
    let mut got = (Vec::new(), false);
    let popped = tokio::time::timeout(
        PATIENCE,
        f.pop(|d, initial| {
            got = (summary(d), initial);
            Ok(())
        }),
    )
    .await
    .expect("something to pop");
    let Popped::Processed(key) = popped else {
        panic!("not processed: {popped:?}");
    };
    (key.to_string(), got.0, got.1)
}

async fn pop(f: &DeltaFifo<i64>) -> (String, Summary) {
    let (key, deltas, _) = pop_initial(f).await;
    (key, deltas)
}

/// The deltas of the next key, as they are.
async fn pop_deltas(f: &DeltaFifo<i64>) -> Vec<Delta<i64>> {
    let mut out = Vec::new();
    let popped = tokio::time::timeout(
        PATIENCE,
        f.pop(|d, _| {
            out = d.to_vec();
            Ok(())
        }),
    )
    .await
    .expect("something to pop");
    assert!(popped.is_processed(), "{popped:?}");
    out
}

/// The value of the newest delta of the next key.
async fn pop_newest(f: &DeltaFifo<i64>) -> i64 {
    pop(f).await.1.last().expect("deltas").1
}

use DeltaType::{Added, Deleted, Replaced, Sync, Updated};
const LIVE: bool = false;
const TOMBSTONE: bool = true;

// ---------------------------------------------------------------------------------------------
// delta_fifo_test.go

#[tokio::test]
async fn delta_fifo_test_basic() {
    // Two producers add concurrently; each one's objects come out in the order it added them.
    let f = Arc::new(fifo_alone());
    const AMOUNT: i64 = 500;
    let producers: Vec<_> = ["a", "b"]
        .into_iter()
        .map(|p| {
            let f = f.clone();
            std::thread::spawn(move || {
                for i in 0..AMOUNT {
                    f.add(obj(&format!("{p}{i}"), i + 1));
                }
            })
        })
        .collect();
    let mut last: HashMap<String, i64> = HashMap::new();
    for _ in 0..2 * AMOUNT {
        let (key, deltas) = pop(&f).await;
        let value = deltas.last().unwrap().1;
        let producer = key[..1].to_string();
        let previous = last.insert(producer.clone(), value).unwrap_or(0);
        assert!(
            value > previous,
            "producer {producer}: got {value} after {previous}"
        );
    }
    for p in producers {
        p.join().unwrap();
    }
    assert!(f.is_empty());
}

#[tokio::test]
async fn delta_fifo_test_replace_with_delete_delta_in() {
    // A relist that lists a key whose delete is still queued must queue the listed object
    // after the delete, or the informer would miss its re-creation (kubernetes#83810).
    let f = fifo_knowing(&[("foo", 1)]);
    assert!(f.delete("foo", 2, None));
    f.replace(vec![obj("foo", 3)]);
    assert_eq!(
        pop(&f).await,
        ("foo".into(), vec![(Deleted, 1, LIVE), (Replaced, 3, LIVE)])
    );
}

#[tokio::test]
async fn delta_fifo_test_replace_makes_deletions_for_objects_only_in_queue() {
    type Ops = fn(&DeltaFifo<i64>);
    let cases: [(&str, Ops, Summary); 6] = [
        (
            "an added object is deleted by a relist that lacks it",
            |f| {
                f.add(obj("foo", 2));
                f.replace(vec![]);
            },
            vec![(Added, 2, LIVE), (Deleted, 2, TOMBSTONE)],
        ),
        (
            "a replaced object gets a single delete",
            |f| {
                f.add(obj("foo", 2));
                f.replace(vec![obj("foo", 2)]);
                f.replace(vec![]);
            },
            vec![
                (Added, 2, LIVE),
                (Replaced, 2, LIVE),
                (Deleted, 2, TOMBSTONE),
            ],
        ),
        (
            "a deleted object gets no second delete",
            |f| {
                f.add(obj("foo", 2));
                assert!(f.delete("foo", 3, None));
                f.replace(vec![]);
            },
            vec![(Added, 2, LIVE), (Deleted, 2, LIVE)],
        ),
        (
            "an object listed twice gets a single delete",
            |f| {
                f.add(obj("foo", 2));
                f.replace(vec![obj("foo", 2)]);
                f.replace(vec![obj("foo", 2)]);
                f.replace(vec![]);
            },
            vec![
                (Added, 2, LIVE),
                (Replaced, 2, LIVE),
                (Replaced, 2, LIVE),
                (Deleted, 2, TOMBSTONE),
            ],
        ),
        (
            "an added object gets a single delete over several relists",
            |f| {
                f.add(obj("foo", 2));
                f.replace(vec![]);
                f.replace(vec![]);
            },
            vec![(Added, 2, LIVE), (Deleted, 2, TOMBSTONE)],
        ),
        (
            "added, deleted and added again: deleted with the newest state",
            |f| {
                f.add(obj("foo", 2));
                assert!(f.delete("foo", 3, None));
                f.add(obj("foo", 4));
                f.replace(vec![]);
            },
            vec![
                (Added, 2, LIVE),
                (Deleted, 2, LIVE),
                (Added, 4, LIVE),
                (Deleted, 4, TOMBSTONE),
            ],
        ),
    ];
    for (name, ops, want) in cases {
        for (with_known, f) in [(true, fifo_knowing(&[])), (false, fifo_alone())] {
            ops(&f);
            assert_eq!(
                pop(&f).await,
                ("foo".into(), want.clone()),
                "{name} (known objects: {with_known})"
            );
            assert!(f.is_empty(), "{name}: no extra deltas");
        }
    }
}

#[tokio::test]
async fn delta_fifo_test_requeue_on_pop() {
    let f = fifo_alone();
    f.add(obj("foo", 10));
    let requeue = |reason: &str| PopError::Requeue {
        reason: reason.into(),
        after: Duration::ZERO,
    };
    let popped = f.pop(|_, _| Err(requeue(""))).await;
    assert!(matches!(popped, Popped::Failed { ref key, .. } if &**key == "foo"));
    assert!(f.get("foo").is_some(), "requeued");

    let popped = f.pop(|_, _| Err(requeue("test error"))).await;
    assert_eq!(
        popped,
        Popped::Failed {
            key: "foo".into(),
            error: requeue("test error")
        },
        "the error is handed back"
    );
    assert!(f.get("foo").is_some(), "requeued again");

    assert!(f.pop(|_, _| Ok(())).await.is_processed());
    assert!(f.get("foo").is_none(), "removed once processed");
}

#[tokio::test]
async fn delta_fifo_test_add_update() {
    let f = fifo_alone();
    f.add(obj("foo", 10));
    f.update(obj("foo", 12));
    assert!(f.delete("foo", 15, Some(obj("foo", 15))));
    assert_eq!(
        f.list_keys()
            .iter()
            .map(|k| k.to_string())
            .collect::<Vec<_>>(),
        ["foo"]
    );
    assert_eq!(f.get("foo").unwrap().last().unwrap().object.value, 15);
    assert_eq!(pop_newest(&f).await, 15);
    assert!(f.is_empty(), "one key, popped once");
    assert!(f.get("foo").is_none());
}

#[tokio::test]
async fn delta_fifo_test_transformer() {
    in_both_modes(|mode| async move {
        let source = FakeSource::new();
        source.put("foo", "10".into());
        source.put("bar", "11".into());
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let options = options(mode).with_transform(Some(Arc::new(move |o: Object<String>| {
            c.fetch_add(1, Ordering::SeqCst);
            o.map(|v| format!("{v}'"))
        })));
        let informer = SharedIndexInformer::new(source.clone(), options);
        let log = Log::default();
        informer.add_event_handler(log.handler()).unwrap();
        tokio::spawn(informer.clone().run());
        until("synced", || informer.has_synced() && log.len() == 2).await;
        source.put("foo", "12".into());
        source.delete("foo");
        until("foo deleted", || log.len() == 4).await;
        // bar vanishes behind the watch's back: the relist turns it into a tombstone.
        drop_watch(&source);
        source.delete("bar");
        source.compact();
        until_ticking("bar's tombstone", || log.len() == 5).await;
        assert_eq!(
            log.lines()[2..],
            [
                "update foo 10'->12'",
                "delete foo 12' final",
                "delete bar 11' tombstone"
            ],
            "{mode:?}: deletes and tombstones carry the object as transformed once"
        );
        // Two listed objects, one watched update; the relist lists nothing.
        assert_eq!(calls.load(Ordering::SeqCst), 3, "{mode:?}");
        informer.stop();
    })
    .await;
}

#[tokio::test]
async fn delta_fifo_test_enqueueing_no_lister() {
    let f = fifo_alone();
    f.add(obj("foo", 10));
    f.update(obj("bar", 15));
    f.add(obj("qux", 17));
    assert!(f.delete("qux", 18, Some(obj("qux", 18))));
    // A delete of a key neither queued nor known is dropped.
    assert!(!f.delete("baz", 20, Some(obj("baz", 20))));
    for want in [10, 15, 18] {
        assert_eq!(pop_newest(&f).await, want);
    }
    assert!(f.is_empty());
}

#[tokio::test]
async fn delta_fifo_test_enqueueing_with_lister() {
    let f = fifo_knowing(&[("foo", 5), ("bar", 6), ("baz", 7)]);
    f.add(obj("foo", 10));
    f.update(obj("bar", 15));
    // baz is known (cached): its delete is queued.
    assert!(f.delete("baz", 20, Some(obj("baz", 20))));
    for want in [10, 15, 20] {
        assert_eq!(pop_newest(&f).await, want);
    }
    assert!(f.is_empty());
}

#[tokio::test]
async fn delta_fifo_test_add_replace() {
    let f = fifo_alone();
    f.add(obj("foo", 10));
    f.replace(vec![obj("foo", 15)]);
    assert_eq!(pop_newest(&f).await, 15);
    assert!(f.is_empty(), "one key, popped once");
    assert!(f.get("foo").is_none());
}

#[tokio::test]
async fn delta_fifo_test_resync_non_existing() {
    let f = fifo_knowing(&[("foo", 5)]);
    assert!(f.delete("foo", 10, Some(obj("foo", 10))));
    f.resync();
    assert_eq!(summary(&f.get("foo").unwrap()), [(Deleted, 10, LIVE)]);
}

#[tokio::test]
async fn delta_fifo_test_resync() {
    let f = fifo_knowing(&[("foo", 5)]);
    f.resync();
    assert_eq!(summary(&f.get("foo").unwrap()), [(Sync, 5, LIVE)]);
}

#[tokio::test]
async fn delta_fifo_test_delete_existing_non_propagated() {
    // A key added but not yet processed (so not known) can still be deleted.
    let f = fifo_knowing(&[]);
    f.add(obj("foo", 5));
    assert!(f.delete("foo", 6, Some(obj("foo", 6))));
    assert_eq!(
        summary(&f.get("foo").unwrap()),
        [(Added, 5, LIVE), (Deleted, 6, LIVE)]
    );
}

#[tokio::test]
async fn delta_fifo_test_replace_makes_deletions() {
    let cached = [("foo", 5), ("bar", 6), ("baz", 7)];

    // With a delete queued already.
    let f = fifo_knowing(&cached);
    assert!(f.delete("baz", 10, Some(obj("baz", 10))));
    f.replace(vec![obj("foo", 5)]);
    assert_eq!(pop(&f).await, ("baz".into(), vec![(Deleted, 10, LIVE)]));
    assert_eq!(pop(&f).await, ("foo".into(), vec![(Replaced, 5, LIVE)]));
    // bar had no delete and is not listed: a tombstone with its cached state.
    assert_eq!(pop(&f).await, ("bar".into(), vec![(Deleted, 6, TOMBSTONE)]));
    assert!(f.is_empty());

    // With an add queued instead.
    let f = fifo_knowing(&cached);
    f.add(obj("baz", 10));
    f.replace(vec![obj("foo", 5)]);
    assert_eq!(
        pop(&f).await,
        (
            "baz".into(),
            vec![(Added, 10, LIVE), (Deleted, 10, TOMBSTONE)]
        )
    );
    assert_eq!(pop(&f).await, ("foo".into(), vec![(Replaced, 5, LIVE)]));
    assert_eq!(pop(&f).await, ("bar".into(), vec![(Deleted, 6, TOMBSTONE)]));
    assert!(f.is_empty());

    // Deleted and re-created in the queue, then gone from the relist: the tombstone carries the
    // newest queued state, not the cached one.
    let f = fifo_knowing(&cached);
    assert!(f.delete("bar", 8, None));
    f.add(obj("bar", 100));
    f.replace(vec![obj("foo", 5)]);
    assert_eq!(
        pop(&f).await,
        (
            "bar".into(),
            vec![
                (Deleted, 6, LIVE),
                (Added, 100, LIVE),
                (Deleted, 100, TOMBSTONE)
            ]
        )
    );
    assert_eq!(pop(&f).await, ("foo".into(), vec![(Replaced, 5, LIVE)]));
    assert_eq!(pop(&f).await, ("baz".into(), vec![(Deleted, 7, TOMBSTONE)]));
    assert!(f.is_empty());

    // Listed first, then gone: the tombstone carries the listed state.
    let f = fifo_knowing(&cached);
    f.replace(vec![obj("bar", 100), obj("foo", 5)]);
    f.replace(vec![obj("foo", 5)]);
    assert_eq!(
        pop(&f).await,
        (
            "bar".into(),
            vec![(Replaced, 100, LIVE), (Deleted, 100, TOMBSTONE)]
        )
    );
    assert_eq!(
        pop(&f).await,
        ("foo".into(), vec![(Replaced, 5, LIVE), (Replaced, 5, LIVE)])
    );
    assert_eq!(pop(&f).await, ("baz".into(), vec![(Deleted, 7, TOMBSTONE)]));
    assert!(f.is_empty());

    // Without known objects, only queued keys can vanish.
    let f = fifo_alone();
    f.add(obj("baz", 10));
    f.replace(vec![obj("foo", 5)]);
    assert_eq!(
        pop(&f).await,
        (
            "baz".into(),
            vec![(Added, 10, LIVE), (Deleted, 10, TOMBSTONE)]
        )
    );
    assert_eq!(pop(&f).await, ("foo".into(), vec![(Replaced, 5, LIVE)]));
    assert!(f.is_empty());
}

#[tokio::test]
async fn delta_fifo_test_replace_makes_deletions_replaced() {
    let f = fifo_knowing(&[("foo", 5), ("bar", 6), ("baz", 7)]);
    assert!(f.delete("baz", 10, Some(obj("baz", 10))));
    f.replace(vec![obj("foo", 6)]);
    assert_eq!(pop(&f).await, ("baz".into(), vec![(Deleted, 10, LIVE)]));
    assert_eq!(pop(&f).await, ("foo".into(), vec![(Replaced, 6, LIVE)]));
    assert_eq!(pop(&f).await, ("bar".into(), vec![(Deleted, 6, TOMBSTONE)]));
    assert!(f.is_empty());
}

#[tokio::test]
async fn delta_fifo_test_replace_delta_type() {
    let f = fifo_knowing(&[("foo", 5)]);
    f.replace(vec![obj("foo", 5)]);
    assert_eq!(pop(&f).await, ("foo".into(), vec![(Replaced, 5, LIVE)]));
}

#[tokio::test]
async fn delta_fifo_test_update_resync_race() {
    // A resync never queues the cached copy over a newer pending change.
    let f = fifo_knowing(&[("foo", 5)]);
    f.update(obj("foo", 6));
    f.resync();
    assert_eq!(pop(&f).await, ("foo".into(), vec![(Updated, 6, LIVE)]));
    assert!(f.is_empty());
}

#[tokio::test]
async fn delta_fifo_test_has_synced_correct_on_deletion() {
    let f = fifo_knowing(&[("foo", 5), ("bar", 6), ("baz", 7)]);
    f.replace(vec![obj("foo", 5)]);
    let mut popped = BTreeMap::new();
    for _ in 0..3 {
        assert!(!f.has_synced(), "tombstones of the first list still queued");
        let (key, deltas, initial) = pop_initial(&f).await;
        assert!(initial, "{key}: tombstones belong to the initial list too");
        popped.insert(key, deltas);
    }
    assert!(f.has_synced());
    assert_eq!(
        popped,
        BTreeMap::from([
            ("foo".into(), vec![(Replaced, 5, LIVE)]),
            ("bar".into(), vec![(Deleted, 6, TOMBSTONE)]),
            ("baz".into(), vec![(Deleted, 7, TOMBSTONE)]),
        ])
    );
}

#[tokio::test]
async fn delta_fifo_test_detect_line_jumpers() {
    // A key keeps its place while more changes for it arrive, and a popped key goes to the back.
    let f = fifo_alone();
    f.add(obj("foo", 10));
    f.add(obj("bar", 1));
    f.add(obj("foo", 11));
    f.add(obj("foo", 13));
    f.add(obj("zab", 30));
    assert_eq!(pop_newest(&f).await, 13);
    f.add(obj("foo", 14));
    for want in [1, 30, 14] {
        assert_eq!(pop_newest(&f).await, want);
    }
}

#[tokio::test]
async fn delta_fifo_test_add_if_not_present() {
    let f = fifo_alone();
    f.add(obj("b", 3));
    let b3 = pop_deltas(&f).await;
    f.add(obj("c", 4));
    let c4 = pop_deltas(&f).await;
    assert!(f.is_empty());

    f.add(obj("a", 1));
    f.add(obj("b", 2));
    f.add_if_not_present("b".into(), b3); // b has newer deltas queued: ignored
    f.add_if_not_present("c".into(), c4); // c has none: put back
    f.add_if_not_present("d".into(), Vec::new()); // nothing to put back
    assert_eq!(f.len(), 3);
    for want in [1, 2, 4] {
        assert_eq!(pop_newest(&f).await, want);
    }
}

#[tokio::test]
async fn delta_fifo_test_has_synced() {
    type Action = fn(&DeltaFifo<i64>) -> Option<()>;
    let add_a: Action = |f| {
        f.add(obj("a", 1));
        None
    };
    let list_none: Action = |f| {
        f.replace(vec![]);
        None
    };
    let list_ab: Action = |f| {
        f.replace(vec![obj("a", 1), obj("b", 2)]);
        None
    };
    // A list naming a key twice (a broken source): the key is queued, and counted, once.
    let list_aa: Action = |f| {
        f.replace(vec![obj("a", 1), obj("a", 2)]);
        None
    };
    let pop_one: Action = |_| Some(());
    let cases: Vec<(Vec<Action>, bool)> = vec![
        (vec![], false),
        (vec![add_a], true),
        (vec![list_none], true),
        (vec![list_ab], false),
        (vec![list_ab, pop_one], false),
        (vec![list_ab, pop_one, pop_one], true),
        (vec![list_aa, pop_one], true),
    ];
    for (i, (actions, synced)) in cases.into_iter().enumerate() {
        let f = fifo_alone();
        for action in actions {
            if action(&f).is_some() {
                pop(&f).await;
            }
        }
        assert_eq!(f.has_synced(), synced, "case {i}");
    }

    // The same broken first list through an informer: it syncs in both modes.
    in_both_modes(|mode| async move {
        let lw = ListWatch::new(
            || async {
                Ok::<_, Error>(ListResult {
                    items: vec![
                        Object::new("a", 1, "one".to_string()),
                        Object::new("a", 2, "two".to_string()),
                    ],
                    revision: 2,
                })
            },
            |_after: i64| async {
                Ok::<_, Error>(Box::pin(tokio_stream::pending()) as WatchStream<String>)
            },
        );
        let informer = SharedIndexInformer::new(lw, options(mode));
        let log = Log::default();
        let registration = informer.add_event_handler(log.handler()).unwrap();
        tokio::spawn(informer.clone().run());
        until("synced despite the duplicate key", || {
            informer.has_synced() && registration.has_synced()
        })
        .await;
        let cached = informer.lister().list();
        assert_eq!(cached.len(), 1, "{mode:?}");
        assert_eq!(cached[0].mod_revision, 2, "{mode:?}: the later entry wins");
        informer.stop();
    })
    .await;
}

#[tokio::test]
async fn delta_fifo_test_pop_should_unblock_when_closed() {
    let f = Arc::new(fifo_knowing(&[("foo", 5)]));
    let poppers: Vec<_> = (0..10)
        .map(|_| {
            let f = f.clone();
            tokio::spawn(async move { f.pop(|_, _| Ok(())).await })
        })
        .collect();
    settle().await;
    f.close();
    for p in poppers {
        let popped = tokio::time::timeout(PATIENCE, p)
            .await
            .expect("pop returns after close")
            .unwrap();
        assert_eq!(popped, Popped::Closed);
    }
}

// ---------------------------------------------------------------------------------------------
// index_test.go

/// An indexer whose index `name` maps an object to the comma-separated parts of its value.
fn indexer_by_parts(name: &str) -> Indexer<String> {
    let mut indexers: Indexers<String> = HashMap::new();
    indexers.insert(
        name.into(),
        etcd_informer::IndexFunc::new(|o: &Object<String>| {
            o.value.split(',').map(str::to_string).collect()
        }),
    );
    Indexer::new(indexers)
}

fn sobj(key: &str, value: &str) -> Arc<Object<String>> {
    Arc::new(Object::new(key, 1, value.to_string()))
}

fn sorted_keys(keys: Vec<Arc<str>>) -> Vec<String> {
    let mut keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
    keys.sort();
    keys
}

fn sorted_names(objects: Vec<Arc<Object<String>>>) -> Vec<String> {
    let mut names: Vec<String> = objects.iter().map(|o| o.key().to_string()).collect();
    names.sort();
    names
}

#[test]
fn index_test_get_index_func_values() {
    let index = indexer_by_parts("testmodes");
    index.add(sobj("one", "bar"));
    index.add(sobj("two", "bar"));
    index.add(sobj("tre", "biz"));
    let mut values = index.list_index_func_values("testmodes");
    values.sort();
    assert_eq!(values, ["bar", "biz"]);
}

#[test]
fn index_test_multi_index_keys() {
    let index = indexer_by_parts("byUser");
    index.add(sobj("one", "ernie,bert"));
    index.add(sobj("two", "bert,oscar"));
    index.add(sobj("tre", "ernie,elmo"));
    let by_user = |user: &str| sorted_names(index.by_index("byUser", user).unwrap());
    assert_eq!(by_user("ernie"), ["one", "tre"]);
    assert_eq!(by_user("bert"), ["one", "two"]);
    assert_eq!(by_user("oscar"), ["two"]);
    assert_eq!(by_user("elmo"), ["tre"]);
    assert_eq!(
        sorted_keys(index.index_keys("byUser", "bert").unwrap()),
        ["one", "two"]
    );
    // Objects sharing a user with "one" (ernie or bert).
    let sharing = index.index("byUser", &sobj("one", "ernie,bert")).unwrap();
    assert_eq!(sorted_names(sharing), ["one", "tre", "two"]);

    index.delete("tre");
    assert_eq!(by_user("ernie"), ["one"]);
    assert!(by_user("elmo").is_empty());

    index.update(sobj("two", "oscar"));
    assert_eq!(by_user("bert"), ["one"]);
}

// ---------------------------------------------------------------------------------------------
// thread_safe_store_test.go

#[test]
fn thread_safe_store_test_delete_removes_empty_sets_from_index() {
    let store = indexer_by_parts("testIndexer");
    store.add(sobj("testKey", "testKey"));
    assert_eq!(store.index_keys("testIndexer", "testKey").unwrap().len(), 1);
    store.delete("testKey");
    assert!(
        store.list_index_func_values("testIndexer").is_empty(),
        "the emptied set is removed from the index"
    );
}

#[test]
fn thread_safe_store_test_add_keeps_non_empty_set_post_delete_from_index() {
    let mut indexers: Indexers<String> = HashMap::new();
    indexers.insert(
        "testIndexer".into(),
        etcd_informer::IndexFunc::new(|_: &Object<String>| vec!["testIndex".to_string()]),
    );
    let store = Indexer::new(indexers);
    store.add(sobj("retain", "retain"));
    store.add(sobj("delete", "delete"));
    assert_eq!(
        store.index_keys("testIndexer", "testIndex").unwrap().len(),
        2
    );
    store.delete("delete");
    assert_eq!(store.list_index_func_values("testIndexer"), ["testIndex"]);
    assert_eq!(
        sorted_keys(store.index_keys("testIndexer", "testIndex").unwrap()),
        ["retain"]
    );
}

#[test]
fn thread_safe_store_test_indexing_functions_with_multiple_values() {
    let store = indexer_by_parts("testIndexer");
    let check = |want: &[(&str, &[&str])]| {
        for (value, keys) in want {
            assert_eq!(
                sorted_keys(store.index_keys("testIndexer", value).unwrap()),
                *keys,
                "index value {value}"
            );
        }
        let mut values = store.list_index_func_values("testIndexer");
        values.sort();
        let mut listed: Vec<&str> = want
            .iter()
            .filter(|(_, keys)| !keys.is_empty())
            .map(|(v, _)| *v)
            .collect();
        listed.sort();
        assert_eq!(values, listed, "only values with keys are listed");
    };
    store.add(sobj("key1", "foo"));
    store.add(sobj("key2", "bar"));
    check(&[("foo", &["key1"]), ("bar", &["key2"])]);
    store.update(sobj("key2", "foo,bar"));
    check(&[("foo", &["key1", "key2"]), ("bar", &["key2"])]);
    store.update(sobj("key1", "foo,bar"));
    check(&[("foo", &["key1", "key2"]), ("bar", &["key1", "key2"])]);
    store.add(sobj("key3", "foo,bar,baz"));
    check(&[
        ("foo", &["key1", "key2", "key3"]),
        ("bar", &["key1", "key2", "key3"]),
        ("baz", &["key3"]),
    ]);
    store.update(sobj("key1", "foo"));
    check(&[
        ("foo", &["key1", "key2", "key3"]),
        ("bar", &["key2", "key3"]),
        ("baz", &["key3"]),
    ]);
    store.update(sobj("key2", "bar"));
    check(&[
        ("foo", &["key1", "key3"]),
        ("bar", &["key2", "key3"]),
        ("baz", &["key3"]),
    ]);
    store.delete("key1");
    check(&[
        ("foo", &["key3"]),
        ("bar", &["key2", "key3"]),
        ("baz", &["key3"]),
    ]);
    store.delete("key3");
    check(&[("foo", &[]), ("bar", &["key2"]), ("baz", &[])]);
}

#[tokio::test]
async fn thread_safe_store_test_rv() {
    // A store filled by hand has no revision: it belongs to the informer that fills it.
    let by_hand = Indexer::default();
    by_hand.add(sobj("key1", "v"));
    assert_eq!(by_hand.revision(), 0);

    in_both_modes(|mode| async move {
        let source = FakeSource::new();
        source.put("key1", "10".into());
        let informer = SharedIndexInformer::new(source.clone(), options(mode));
        assert_eq!(informer.revision(), 0, "{mode:?}: initial state");
        tokio::spawn(informer.clone().run());
        let at_source = || informer.revision() == source.revision();
        until("list applied", at_source).await;
        source.put("key2", "20".into());
        until("add applied", at_source).await;
        source.put("key1", "30".into());
        until("update applied", at_source).await;
        source.delete("key2");
        until("delete applied: a delete advances the revision", at_source).await;
        // A relist sets it to the list's revision.
        drop_watch(&source);
        source.put("key3", "40".into());
        source.compact();
        until_ticking("relist applied", || {
            at_source() && caught_up(&informer, &source)
        })
        .await;
        informer.stop();
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// store_test.go

#[test]
fn store_test_cache() {
    let store: Indexer<String> = Indexer::default();
    store.add(sobj("foo", "bar"));
    assert_eq!(store.get_by_key("foo").unwrap().value, "bar");
    store.update(sobj("foo", "baz"));
    assert_eq!(store.get_by_key("foo").unwrap().value, "baz");
    store.delete("foo");
    assert!(store.get_by_key("foo").is_none());

    store.add(sobj("a", "b"));
    store.add(sobj("c", "d"));
    store.add(sobj("e", "e"));
    let values = |store: &Indexer<String>| -> BTreeSet<String> {
        store.list().iter().map(|o| o.value.clone()).collect()
    };
    assert_eq!(values(&store), set(&["b", "d", "e"]));
    assert_eq!(store.len(), 3, "no extra items");

    store.replace([sobj("foo", "foo"), sobj("bar", "bar")]);
    assert_eq!(values(&store), set(&["foo", "bar"]));
    assert_eq!(store.len(), 2, "no extra items");
}

#[test]
fn store_test_index() {
    let indexer = indexer_by_parts("by_val");
    indexer.add(sobj("a", "b"));
    indexer.add(sobj("c", "b"));
    indexer.add(sobj("e", "f"));
    indexer.add(sobj("g", "h"));
    for (value, ids) in [("b", vec!["a", "c"]), ("f", vec!["e"]), ("h", vec!["g"])] {
        let found = indexer.index("by_val", &sobj("", value)).unwrap();
        assert_eq!(sorted_names(found), ids, "index value {value}");
    }
}

// ---------------------------------------------------------------------------------------------
// shared_informer_test.go

#[tokio::test]
async fn shared_informer_test_indexer() {
    in_both_modes(|mode| async move {
        let source = FakeSource::new();
        source.put("pod1", "a,b".into());
        source.put("pod2", "b".into());
        let informer = SharedIndexInformer::new(source.clone(), options(mode));
        let labels = |name: &str| {
            let mut indexers: Indexers<String> = HashMap::new();
            indexers.insert(
                name.into(),
                etcd_informer::IndexFunc::new(|o: &Object<String>| {
                    o.value.split(',').map(str::to_string).collect()
                }),
            );
            indexers
        };
        informer.add_indexers(labels("labels")).unwrap();
        tokio::spawn(informer.clone().run());
        until("synced", || informer.has_synced()).await;
        let by = |index: &str, value: &str| {
            sorted_names(informer.indexer().by_index(index, value).unwrap())
        };
        assert_eq!(by("labels", "a"), ["pod1"], "{mode:?}");

        source.put("pod3", "a".into());
        until("pod3 indexed", || by("labels", "a") == ["pod1", "pod3"]).await;

        // An index added while running indexes the cache at once.
        informer.add_indexers(labels("labels-again")).unwrap();
        assert_eq!(by("labels-again", "a"), ["pod1", "pod3"], "{mode:?}");
        for index in ["labels", "labels-again"] {
            let values: BTreeSet<String> = informer
                .indexer()
                .list_index_func_values(index)
                .into_iter()
                .collect();
            assert_eq!(values, set(&["a", "b"]), "{mode:?} {index}");
        }
        informer.stop();
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn shared_informer_test_listener_resync_periods() {
    in_both_modes(|mode| async move {
        let source = FakeSource::new();
        source.put("pod1", "1".into());
        source.put("pod2", "1".into());
        let informer = SharedIndexInformer::new(
            source.clone(),
            options(mode).with_resync_period(Duration::from_secs(1)),
        );
        let logs: Vec<Log> = (0..3).map(|_| Log::default()).collect();
        let regs: Vec<_> = [0, 2, 3]
            .into_iter()
            .zip(&logs)
            .map(|(secs, log)| {
                informer
                    .add_event_handler_with_resync(log.handler(), Duration::from_secs(secs))
                    .unwrap()
            })
            .collect();
        tokio::spawn(informer.clone().run());
        let both = set(&["pod1", "pod2"]);
        until("initial list delivered", || {
            logs.iter().all(|l| l.names() == both)
        })
        .await;
        for l in &logs {
            l.clear();
        }
        // Delivered counts of the handlers that must not resync: everything distributed with a
        // resync is queued before the resynced handler can see it, so once that handler has,
        // the others' counts are final.
        let quiet = |i: usize| regs[i].delivered() == 2 && regs[i].backlog() == 0;

        // At 2 s only the 2 s handler resyncs.
        step(Duration::from_secs(1)).await;
        step(Duration::from_secs(1)).await;
        until("the 2 s handler resynced", || logs[1].names() == both).await;
        assert!(
            quiet(0) && quiet(2),
            "{mode:?}: only the 2 s handler resyncs at 2 s"
        );
        assert!(logs[0].lines().is_empty() && logs[2].lines().is_empty());
        logs[1].clear();

        // At 3 s only the 3 s handler does.
        step(Duration::from_secs(1)).await;
        until("the 3 s handler resynced", || logs[2].names() == both).await;
        assert!(
            quiet(0) && regs[1].delivered() == 4,
            "{mode:?}: only the 3 s handler resyncs at 3 s"
        );
        assert!(logs[0].lines().is_empty() && logs[1].lines().is_empty());
        informer.stop();
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn shared_informer_test_resync_check_period() {
    in_both_modes(|mode| async move {
        let source = FakeSource::new();
        source.put("pod1", "1".into());
        let informer = SharedIndexInformer::new(
            source.clone(),
            options(mode).with_resync_period(Duration::from_secs(12 * 3600)),
        );
        let secs = Duration::from_secs;
        let periods = [secs(0), secs(60), secs(55), secs(5)];
        let logs: Vec<Log> = periods.iter().map(|_| Log::default()).collect();
        let regs: Vec<_> = periods
            .iter()
            .zip(&logs)
            .map(|(p, log)| {
                informer
                    .add_event_handler_with_resync(log.handler(), *p)
                    .unwrap()
            })
            .collect();
        // Each handler keeps its own period; the informer checks as often as the shortest.
        let got: Vec<Duration> = regs.iter().map(|r| r.resync_period()).collect();
        assert_eq!(got, periods, "{mode:?}");
        tokio::spawn(informer.clone().run());
        until("initial list delivered", || {
            logs.iter().all(|l| l.len() == 1)
        })
        .await;
        for _ in 0..5 {
            step(secs(1)).await;
        }
        until("the 5 s handler resynced", || logs[3].len() == 2).await;
        assert!(
            regs[..3]
                .iter()
                .all(|r| r.delivered() == 1 && r.backlog() == 0),
            "{mode:?}: nobody else is due at 5 s"
        );
        // Once running, a shorter period is raised to the check period (5 s).
        let late = informer
            .add_event_handler_with_resync(ResourceEventHandlerFuncs::new(), secs(1))
            .unwrap();
        assert_eq!(late.resync_period(), secs(5), "{mode:?}");
        informer.stop();
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn shared_informer_test_watch_disruption() {
    in_both_modes(|mode| async move {
        let source = FakeSource::new();
        source.put("pod1", "1".into());
        source.put("pod2", "1".into());
        let informer = SharedIndexInformer::new(
            source.clone(),
            options(mode).with_resync_period(Duration::from_secs(1)),
        );
        let no_resync = Log::default();
        let resync = Log::default();
        informer
            .add_event_handler_with_resync(no_resync.handler(), Duration::ZERO)
            .unwrap();
        informer
            .add_event_handler_with_resync(resync.handler(), Duration::from_secs(1))
            .unwrap();
        tokio::spawn(informer.clone().run());
        let both = set(&["pod1", "pod2"]);
        until("initial list delivered", || {
            no_resync.names() == both && resync.names() == both
        })
        .await;
        // The resync handler's period is due: it resyncs (and stays the syncing handler).
        step(Duration::from_secs(1)).await;
        until("resynced", || resync.len() == 4).await;
        no_resync.clear();
        resync.clear();

        // pod3 is added and pod2 changed while the watch is down, and the history is compacted:
        // only a relist can see them.
        drop_watch(&source);
        source.put("pod3", "1".into());
        source.put("pod2", "2".into());
        source.compact();
        assert!(no_resync.lines().is_empty() && resync.lines().is_empty());

        until_ticking("relisted", || {
            no_resync.names() == set(&["pod2", "pod3"])
                && resync.names() == set(&["pod1", "pod2", "pod3"])
        })
        .await;
        // The unchanged pod1 is a resync: never for the handler without one.
        assert!(!no_resync.names().contains("pod1"), "{mode:?}");
        assert_eq!(source.list_count(), 2, "{mode:?}");
        informer.stop();
    })
    .await;
}

#[tokio::test]
async fn shared_informer_test_error_handling() {
    in_both_modes(|mode| async move {
        let source: FakeSource<String> = FakeSource::new();
        source.put("pod1", "1".into());
        source.fail_next_list(Error::transient("Access Denied"));
        let errors = Log::default();
        let e = errors.clone();
        let informer = SharedIndexInformer::new(
            source.clone(),
            options(mode).with_watch_error_handler(Some(Arc::new(move |err: &Error| {
                e.push(err.to_string())
            }))),
        );
        tokio::spawn(informer.clone().run());
        until_ticking("error handler called", || errors.len() == 1).await;
        assert!(errors.lines()[0].contains("Access Denied"), "{mode:?}");
        until_ticking("synced after the retry", || informer.has_synced()).await;
        informer.stop();
    })
    .await;
}

#[tokio::test]
async fn shared_informer_test_transformer() {
    in_both_modes(|mode| async move {
        let source = FakeSource::new();
        source.put("pod1", "pod1".into());
        source.put("pod2", "pod2".into());
        let informer = SharedIndexInformer::new(
            source.clone(),
            options(mode).with_transform(Some(Arc::new(|o: Object<String>| {
                o.map(|v| v.to_uppercase())
            }))),
        );
        let log = Log::default();
        informer.add_event_handler(log.handler()).unwrap();
        tokio::spawn(informer.clone().run());
        until("initial list delivered", || log.len() == 2).await;
        let mut lines = log.lines();
        lines.sort();
        assert_eq!(lines, ["add pod1 POD1", "add pod2 POD2"], "{mode:?}");
        informer.stop();
    })
    .await;
}

#[tokio::test]
async fn shared_informer_test_remove_handler() {
    in_both_modes(|mode| async move {
        let source = FakeSource::new();
        source.put("pod1", "1".into());
        let informer = started(&source, mode);
        let (log1, log2, witness) = (Log::default(), Log::default(), Log::default());
        let h1 = informer.add_event_handler(log1.handler()).unwrap();
        let h2 = informer.add_event_handler(log2.handler()).unwrap();
        informer.add_event_handler(witness.handler()).unwrap();
        until("all synced", || {
            log1.len() == 1 && log2.len() == 1 && witness.len() == 1
        })
        .await;

        assert!(informer.remove_event_handler(&h2), "{mode:?}");
        source.put("k1", "1".into());
        until("witness got k1", || witness.len() == 2).await;
        assert_eq!(
            (log1.len(), log2.len()),
            (2, 1),
            "{mode:?}: only h1 still registered"
        );

        assert!(informer.remove_event_handler(&h1), "{mode:?}");
        source.put("k2", "1".into());
        until("witness got k2", || witness.len() == 3).await;
        assert_eq!(
            (log1.len(), log2.len()),
            (2, 1),
            "{mode:?}: neither registered"
        );
        informer.stop();
    })
    .await;
}

#[tokio::test]
async fn shared_informer_test_remove_foreign_handler() {
    in_both_modes(|mode| async move {
        let source = FakeSource::new();
        source.put("pod1", "1".into());
        let source2 = FakeSource::new();
        source2.put("pod1", "1".into());
        let informer = started(&source, mode);
        let informer2 = started(&source2, mode);
        let (log1, log2, log_other) = (Log::default(), Log::default(), Log::default());
        let h1 = informer.add_event_handler(log1.handler()).unwrap();
        let h2 = informer.add_event_handler(log2.handler()).unwrap();
        // informer2's first handler: same position (and internal number) as h1 in informer.
        let other = informer2.add_event_handler(log_other.handler()).unwrap();
        until("synced", || {
            log1.len() == 1 && log2.len() == 1 && log_other.len() == 1
        })
        .await;

        // Removing through the wrong informer is a no-op, for both informers.
        assert!(!informer2.remove_event_handler(&h1), "{mode:?}");
        assert!(!informer2.remove_event_handler(&h2), "{mode:?}");
        source.put("k1", "1".into());
        source2.put("k1", "1".into());
        until("every handler still receives", || {
            log1.len() == 2 && log2.len() == 2 && log_other.len() == 2
        })
        .await;

        assert!(informer.remove_event_handler(&h2), "{mode:?}");
        assert!(informer.remove_event_handler(&h1), "{mode:?}");
        assert!(!informer.remove_event_handler(&other), "{mode:?}");
        source2.put("k2", "1".into());
        until("informer2's handler untouched", || log_other.len() == 3).await;
        informer.stop();
        informer2.stop();
    })
    .await;
}

#[tokio::test]
async fn shared_informer_test_multiple_registration() {
    in_both_modes(|mode| async move {
        let source = FakeSource::new();
        let informer = started(&source, mode);
        let log = Log::default();
        let witness = Log::default();
        // One handler, registered twice.
        let handler = Arc::new(log.handler());
        let reg1 = informer.add_event_handler(handler.clone()).unwrap();
        let reg2 = informer.add_event_handler(handler).unwrap();
        informer.add_event_handler(witness.handler()).unwrap();
        until("synced", || informer.has_synced()).await;
        let count = |key: &str| {
            log.lines()
                .iter()
                .filter(|l| l.starts_with(&format!("add {key} ")))
                .count()
        };

        source.put("k1", "1".into());
        until("both registrations got k1", || count("k1") == 2).await;

        assert!(informer.remove_event_handler(&reg1), "{mode:?}");
        source.put("k2", "1".into());
        until("witness got k2", || witness.contains("add k2 1")).await;
        until("the other registration got k2", || count("k2") == 1).await;

        assert!(informer.remove_event_handler(&reg2), "{mode:?}");
        source.put("k3", "1".into());
        until("witness got k3", || witness.contains("add k3 1")).await;
        assert_eq!(count("k3"), 0, "{mode:?}");
        informer.stop();
    })
    .await;
}

#[tokio::test]
async fn shared_informer_test_removing_removed_shared_informer() {
    let source: FakeSource<String> = FakeSource::new();
    let informer = SharedIndexInformer::new(source, options(Processing::Atomic));
    let reg = informer
        .add_event_handler(ResourceEventHandlerFuncs::new())
        .unwrap();
    assert!(informer.remove_event_handler(&reg));
    assert!(
        !informer.remove_event_handler(&reg),
        "removing twice is a no-op"
    );
}

#[tokio::test]
async fn shared_informer_test_handler_abuse() {
    in_both_modes(|mode| async move {
        let source = FakeSource::new();
        let informer = SharedIndexInformer::new(
            source.clone(),
            options(mode).with_resync_period(Duration::from_secs(1)),
        );
        let run = tokio::spawn(informer.clone().run());
        let workers: Vec<_> = (0..4u64)
            .map(|w| {
                let informer = informer.clone();
                std::thread::spawn(move || {
                    let mut rng = fastrand::Rng::with_seed(w);
                    let mut regs = Vec::new();
                    let deadline = std::time::Instant::now() + PATIENCE;
                    let mut refused = false;
                    while std::time::Instant::now() < deadline {
                        if regs.is_empty() || rng.bool() {
                            let handler = ResourceEventHandlerFuncs::<String>::new()
                                .on_add(|_, _| {})
                                .on_update(|_, _| {})
                                .on_delete(|_| {});
                            match informer
                                .add_event_handler_with_resync(handler, Duration::from_secs(1))
                            {
                                Ok(r) => regs.push(r),
                                // The informer stopped: the test is over.
                                Err(InformerError::Stopped { .. }) => {
                                    refused = true;
                                    break;
                                }
                                Err(e) => panic!("cannot add a handler: {e}"),
                            }
                        } else {
                            let r = regs.swap_remove(rng.usize(..regs.len()));
                            assert!(informer.remove_event_handler(&r));
                        }
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    // A stopped informer still lets its handlers go.
                    for r in regs {
                        assert!(informer.remove_event_handler(&r));
                    }
                    refused
                })
            })
            .collect();
        let mut rng = fastrand::Rng::with_seed(7);
        let mut live: Vec<String> = Vec::new();
        for i in 0..2000 {
            if live.is_empty() || rng.u8(..3) == 0 {
                let key = format!("pod{i}");
                source.put(&key, "1".into());
                live.push(key);
            } else if rng.bool() {
                source.put(&live[rng.usize(..live.len())], i.to_string());
            } else {
                let key = live.swap_remove(rng.usize(..live.len()));
                source.delete(&key);
            }
            if i % 20 == 0 {
                settle().await;
            }
        }
        until("caught up", || caught_up(&informer, &source)).await;
        informer.stop();
        tokio::time::timeout(PATIENCE, run)
            .await
            .expect("run ends after stop")
            .unwrap();
        assert!(informer.is_stopped());
        for w in workers {
            let refused = w.join().expect("no error but Stopped");
            assert!(refused, "{mode:?}: the stopped informer accepted handlers");
        }
    })
    .await;
}

#[tokio::test]
async fn shared_informer_test_state_shared_informer() {
    in_both_modes(|mode| async move {
        let source = FakeSource::new();
        source.put("pod1", "1".into());
        let informer = SharedIndexInformer::new(source.clone(), options(mode));
        let log = Log::default();
        informer.add_event_handler(log.handler()).unwrap();
        assert!(
            !informer.has_started() && !informer.is_stopped(),
            "{mode:?}: new"
        );
        let run = tokio::spawn(informer.clone().run());
        until("initial list delivered", || log.len() == 1).await;
        assert!(
            informer.has_started() && !informer.is_stopped(),
            "{mode:?}: running"
        );
        informer.stop();
        tokio::time::timeout(PATIENCE, run).await.unwrap().unwrap();
        assert!(
            informer.has_started() && informer.is_stopped(),
            "{mode:?}: stopped"
        );
    })
    .await;
}

#[tokio::test]
async fn shared_informer_test_add_on_stopped_shared_informer() {
    in_both_modes(|mode| async move {
        let source = FakeSource::new();
        source.put("pod1", "1".into());
        let informer = SharedIndexInformer::new(source.clone(), options(mode));
        let run = tokio::spawn(informer.clone().run());
        informer.stop();
        tokio::time::timeout(PATIENCE, run).await.unwrap().unwrap();
        assert!(informer.is_stopped());
        let err = informer
            .add_event_handler_with_resync(ResourceEventHandlerFuncs::new(), Duration::ZERO)
            .expect_err("a stopped informer refuses handlers");
        assert!(
            matches!(err, InformerError::Stopped { .. }),
            "{mode:?}: {err}"
        );
        assert!(err.to_string().contains("stopped already"), "{err}");
        assert!(informer.event_stream().is_err(), "{mode:?}");
    })
    .await;
}

#[tokio::test]
async fn shared_informer_test_remove_on_stopped_shared_informer() {
    in_both_modes(|mode| async move {
        let source = FakeSource::new();
        source.put("pod1", "1".into());
        let informer = SharedIndexInformer::new(source.clone(), options(mode));
        let reg = informer
            .add_event_handler(ResourceEventHandlerFuncs::new())
            .unwrap();
        let run = tokio::spawn(informer.clone().run());
        informer.stop();
        tokio::time::timeout(PATIENCE, run).await.unwrap().unwrap();
        assert!(informer.is_stopped());
        assert!(informer.remove_event_handler(&reg), "{mode:?}");
    })
    .await;
}

#[tokio::test]
async fn shared_informer_test_remove_while_active() {
    in_both_modes(|mode| async move {
        let source = FakeSource::new();
        let informer = started(&source, mode);
        let witness = Log::default();
        informer.add_event_handler(witness.handler()).unwrap();

        // A handler caught in the middle of a notification when it is removed.
        let gate = Arc::new(Gate::default());
        let calls = Arc::new(AtomicUsize::new(0));
        let finished = Arc::new(AtomicBool::new(false));
        let removal_returned = Arc::new(AtomicBool::new(false));
        let calls_after_removal = Arc::new(AtomicUsize::new(0));
        let handler = {
            let (gate, calls, finished) = (gate.clone(), calls.clone(), finished.clone());
            let (returned, late) = (removal_returned.clone(), calls_after_removal.clone());
            ResourceEventHandlerFuncs::<String>::new().on_add(move |_, _| {
                if returned.load(Ordering::SeqCst) {
                    late.fetch_add(1, Ordering::SeqCst);
                }
                if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                    gate.pass();
                    // Long enough that a removal not waiting for the handler returns first.
                    std::thread::sleep(Duration::from_millis(30));
                    finished.store(true, Ordering::SeqCst);
                }
            })
        };
        let reg = informer.add_event_handler(handler).unwrap();
        until("synced", || informer.has_synced()).await;
        source.put("pod1", "1".into());
        source.put("pod2", "1".into());
        until("the handler is in pod1's notification", || {
            calls.load(Ordering::SeqCst) == 1
        })
        .await;

        let remover = {
            let (informer, finished, returned) =
                (informer.clone(), finished.clone(), removal_returned.clone());
            std::thread::spawn(move || {
                let removed = informer.remove_event_handler(&reg);
                let handler_done = finished.load(Ordering::SeqCst);
                returned.store(true, Ordering::SeqCst);
                (removed, handler_done)
            })
        };
        gate.open();
        let (removed, handler_done) = remover.join().unwrap();
        assert!(removed, "{mode:?}");
        assert!(
            handler_done,
            "{mode:?}: removal returned while the handler was still running"
        );
        // pod2, queued before the removal, is dropped; later changes never reach it.
        source.put("pod3", "1".into());
        until("witness got pod3", || witness.contains("add pod3 1")).await;
        assert_eq!(calls.load(Ordering::SeqCst), 1, "{mode:?}");
        assert_eq!(calls_after_removal.load(Ordering::SeqCst), 0, "{mode:?}");

        // A handler removing itself from its own notification does not wait for itself.
        let cell: Arc<OnceLock<etcd_informer::HandlerRegistration<String>>> = Arc::default();
        let outcome = Log::default();
        let handler = {
            let (cell, outcome, inf) = (cell.clone(), outcome.clone(), informer.clone());
            ResourceEventHandlerFuncs::<String>::new().on_add(move |o, _| {
                outcome.push(format!("called {}", o.key()));
                if o.key() == "self" {
                    let removed = inf.remove_event_handler(cell.get().expect("registered"));
                    outcome.push(format!("removed {removed}"));
                }
            })
        };
        let reg = informer.add_event_handler(handler).unwrap();
        until("initial adds", || outcome.len() == 3).await;
        cell.set(reg).unwrap();
        source.put("self", "1".into());
        until("removed itself", || outcome.contains("removed true")).await;
        source.put("after", "1".into());
        until("witness got after", || witness.contains("add after 1")).await;
        assert!(!outcome.contains("called after"), "{mode:?}");
        informer.stop();
    })
    .await;
}

#[tokio::test]
async fn shared_informer_test_add_while_active() {
    in_both_modes(|mode| async move {
        let source = FakeSource::new();
        let informer = SharedIndexInformer::new(source.clone(), options(mode));
        let log1 = Log::default();
        let h1 = informer.add_event_handler(log1.handler()).unwrap();
        assert!(!h1.has_synced(), "{mode:?}: synced before run");
        tokio::spawn(informer.clone().run());
        source.put("pod1", "1".into());
        until("h1 got pod1", || log1.names() == set(&["pod1"])).await;
        assert!(h1.has_synced(), "{mode:?}");

        // A handler added while running is synced once it has handled the cache's content.
        let gate = Arc::new(Gate::default());
        let log2 = Log::default();
        let handler = {
            let (gate, log2) = (gate.clone(), log2.clone());
            ResourceEventHandlerFuncs::<String>::new().on_add(move |o, _| {
                gate.pass();
                log2.push(format!("add {} {}", o.key(), o.value));
            })
        };
        let h2 = informer.add_event_handler(handler).unwrap();
        assert!(
            !h2.has_synced(),
            "{mode:?}: synced before handling anything"
        );
        gate.open();
        source.put("pod2", "1".into());
        until("h2 got both", || log2.names() == set(&["pod1", "pod2"])).await;
        assert!(h2.has_synced(), "{mode:?}");
        until("h1 got pod2", || log1.names() == set(&["pod1", "pod2"])).await;
        informer.stop();
    })
    .await;
}

#[tokio::test]
async fn shared_informer_test_shutdown() {
    /// A handler holding `token`: once its thread ends, the token's count drops.
    fn holding(token: &Arc<()>) -> ResourceEventHandlerFuncs<String> {
        let held = token.clone();
        ResourceEventHandlerFuncs::new().on_add(move |_, _| {
            let _ = &held;
        })
    }
    in_both_modes(|mode| async move {
        // Removed after the informer synced.
        let token = Arc::new(());
        let source = FakeSource::new();
        let informer = SharedIndexInformer::new(source.clone(), options(mode));
        let reg = informer.add_event_handler(holding(&token)).unwrap();
        tokio::spawn(informer.clone().run());
        until("synced", || informer.has_synced()).await;
        assert!(informer.remove_event_handler(&reg));
        until("handler thread ended", || Arc::strong_count(&token) == 1).await;
        informer.stop();

        // Added and removed once running.
        let token = Arc::new(());
        let informer = started(&source, mode);
        until("synced", || informer.has_synced()).await;
        let reg = informer.add_event_handler(holding(&token)).unwrap();
        assert!(informer.remove_event_handler(&reg));
        until("handler thread ended", || Arc::strong_count(&token) == 1).await;
        informer.stop();

        // Never run: dropping the informer ends the handler's thread.
        let token = Arc::new(());
        let informer = SharedIndexInformer::new(source.clone(), options(mode));
        informer.add_event_handler(holding(&token)).unwrap();
        drop(informer);
        until("handler thread ended", || Arc::strong_count(&token) == 1).await;

        // Stopped: handler threads end once the informer is gone.
        let token = Arc::new(());
        let informer = SharedIndexInformer::new(source.clone(), options(mode));
        informer.add_event_handler(holding(&token)).unwrap();
        let run = tokio::spawn(informer.clone().run());
        until("synced", || informer.has_synced()).await;
        informer.stop();
        tokio::time::timeout(PATIENCE, run).await.unwrap().unwrap();
        drop(informer);
        until("handler thread ended", || Arc::strong_count(&token) == 1).await;
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// controller_test.go

#[tokio::test]
async fn controller_test_example() {
    // A controller that deletes everything it sees added, and reports the deletes.
    let source: FakeSource<String> = FakeSource::new();
    let downstream: Indexer<String> = Indexer::default();
    let known: Arc<dyn Store<String>> = Arc::new(downstream.clone());
    let fifo = Arc::new(DeltaFifo::new(Some(known)));
    let deleted = Log::default();
    let (src, d) = (source.clone(), deleted.clone());
    let config = ControllerConfig {
        lister_watcher: source.clone(),
        queue: fifo.clone(),
        process: Box::new(move |deltas: &[Delta<String>], _initial| {
            let newest = deltas.last().ok_or("no deltas")?;
            if newest.kind != Deleted {
                downstream.add(newest.object.clone());
                src.delete(newest.object.key());
            } else {
                downstream.delete(newest.object.key());
                d.push(newest.object.key().to_string());
            }
            Ok(())
        }),
        retry_on_error: false,
        reflector: ReflectorOptions::default().with_resync_period(Duration::from_millis(100)),
    };
    let run = tokio::spawn(Controller::new(config).run());
    for name in ["a-hello", "b-controller", "c-framework"] {
        source.put(name, String::new());
    }
    until("three deletes", || deleted.len() == 3).await;
    let mut keys = deleted.lines();
    keys.sort();
    assert_eq!(keys, ["a-hello", "b-controller", "c-framework"]);
    fifo.close();
    tokio::time::timeout(PATIENCE, run).await.unwrap().unwrap();
}

#[tokio::test]
async fn controller_test_example_new_informer() {
    in_both_modes(|mode| async move {
        let source = FakeSource::new();
        let deleted = Log::default();
        let (src, d) = (source.clone(), deleted.clone());
        let handler = ResourceEventHandlerFuncs::new()
            .on_add(move |o: &Arc<Object<String>>, _| {
                src.delete(o.key());
            })
            .on_delete(move |o| d.push(o.key().to_string()));
        let informer = Informer::new(source.clone(), handler, options(mode)).unwrap();
        tokio::spawn(informer.clone().run());
        for name in ["a-hello", "b-controller", "c-framework"] {
            source.put(name, String::new());
        }
        until("three deletes", || deleted.len() == 3).await;
        let mut keys = deleted.lines();
        keys.sort();
        assert_eq!(keys, ["a-hello", "b-controller", "c-framework"], "{mode:?}");
        informer.stop();
    })
    .await;
}

/// Checks that each key's notifications form a valid sequence (an add first and after every
/// delete, updates and deletes only while present) ending in the source's state.
fn check_sequences(log: &Log, source: &FakeSource<String>, mode: Processing) {
    let present: BTreeSet<String> = source
        .objects()
        .iter()
        .map(|o| o.key().to_string())
        .collect();
    let mut by_key: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in log.lines() {
        let mut parts = line.split(' ');
        let (action, key) = (parts.next().unwrap(), parts.next().unwrap());
        by_key.entry(key.into()).or_default().push(action.into());
    }
    for (key, actions) in &by_key {
        let mut exists = false;
        for action in actions {
            match action.as_str() {
                "add" => assert!(!exists, "{mode:?} {key}: add while present: {actions:?}"),
                _ => assert!(exists, "{mode:?} {key}: {action} while absent: {actions:?}"),
            }
            exists = action != "delete";
        }
        assert_eq!(exists, present.contains(key), "{mode:?} {key}: {actions:?}");
    }
    for key in &present {
        assert!(by_key.contains_key(key), "{mode:?}: {key} never announced");
    }
}

#[tokio::test]
async fn controller_test_hammer() {
    in_both_modes(|mode| async move {
        let source = FakeSource::new();
        let log = Log::default();
        let informer = SharedIndexInformer::new(
            source.clone(),
            options(mode).with_resync_period(Duration::from_secs(1)),
        );
        let reg = informer.add_event_handler(log.handler()).unwrap();
        assert!(!reg.has_synced(), "{mode:?}: synced before run");
        let run = tokio::spawn(informer.clone().run());
        until("synced", || reg.has_synced()).await;

        let writers: Vec<_> = (0..3u64)
            .map(|t| {
                let source = source.clone();
                std::thread::spawn(move || {
                    let mut rng = fastrand::Rng::with_seed(t);
                    let mut names: Vec<String> = Vec::new();
                    for i in 0..100 {
                        if names.is_empty() || rng.u8(..3) == 1 {
                            let name = format!("default/{t}-{}", rng.u8(..30));
                            source.put(&name, format!("{t}-{i}"));
                            if !names.contains(&name) {
                                names.push(name);
                            }
                        } else if rng.bool() {
                            source.put(&names[rng.usize(..names.len())], format!("{t}-{i}"));
                        } else {
                            let name = names.swap_remove(rng.usize(..names.len()));
                            source.delete(&name);
                        }
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        until("cache equals the source", || caught_up(&informer, &source)).await;
        // Once `run` has returned every notification is queued; then wait for the handler to
        // have returned from all of them.
        informer.stop();
        tokio::time::timeout(PATIENCE, run).await.unwrap().unwrap();
        until("handler drained", || {
            reg.backlog() == 0 && reg.delivered() as usize == log.len()
        })
        .await;
        check_sequences(&log, &source, mode);
    })
    .await;
}

#[tokio::test]
async fn controller_test_update() {
    in_both_modes(|mode| async move {
        let source = FakeSource::new();
        // The transitions a handler may see: from -> to, and resyncs of either.
        let allowed = [("from", "to"), ("to", "to"), ("from", "from")];
        let bad = Log::default();
        let deletes = Arc::new(AtomicUsize::new(0));
        let handler = {
            let (src, bad, deletes) = (source.clone(), bad.clone(), deletes.clone());
            ResourceEventHandlerFuncs::new()
                .on_update(move |old: &Arc<Object<String>>, new| {
                    let pair = (old.value.as_str(), new.value.as_str());
                    if !allowed.contains(&pair) {
                        bad.push(format!("{} {pair:?}", new.key()));
                    }
                    // The final state: delete it.
                    if new.value == "to" {
                        src.delete(new.key());
                    }
                })
                .on_delete(move |_| {
                    deletes.fetch_add(1, Ordering::SeqCst);
                })
        };
        let informer = Informer::new(source.clone(), handler, options(mode)).unwrap();
        tokio::spawn(informer.clone().run());
        until("watching", || source.open_watches() == 1).await;
        const THREADS: usize = 3;
        let writers: Vec<_> = (0..THREADS)
            .map(|t| {
                let source = source.clone();
                std::thread::spawn(move || {
                    let name = format!("a-{t}");
                    source.put(&name, "from".into());
                    source.put(&name, "to".into());
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        until("every object deleted", || {
            deletes.load(Ordering::SeqCst) == THREADS
        })
        .await;
        assert!(bad.lines().is_empty(), "{mode:?}: {:?}", bad.lines());
        informer.stop();
    })
    .await;
}

#[tokio::test]
async fn controller_test_panic_propagated() {
    // Deliberately different: the panic is logged and counted, the informer keeps running.
    in_both_modes(|mode| async move {
        let source = FakeSource::new();
        let log = Log::default();
        let l = log.clone();
        let informer = SharedIndexInformer::new(source.clone(), options(mode));
        let reg = informer
            .add_event_handler(ResourceEventHandlerFuncs::new().on_add(
                move |o: &Arc<Object<String>>, _| {
                    if o.key() == "test" {
                        panic!("Just panic.");
                    }
                    l.push(o.key().to_string());
                },
            ))
            .unwrap();
        let run = tokio::spawn(informer.clone().run());
        until("synced", || reg.has_synced()).await;
        source.put("test", "1".into());
        source.put("after", "1".into());
        until("the next notification delivered", || {
            log.lines() == ["after"]
        })
        .await;
        assert_eq!(reg.panics(), 1, "{mode:?}");
        assert!(!run.is_finished() && !informer.is_stopped(), "{mode:?}");
        informer.stop();
    })
    .await;
}

#[tokio::test]
async fn controller_test_transforming_informer() {
    in_both_modes(|mode| async move {
        let source = FakeSource::new();
        source.put("pod1", "gen1".into());
        source.put("pod1", "gen2".into());
        let log = Log::default();
        let informer = Informer::new(
            source.clone(),
            log.handler(),
            options(mode).with_transform(Some(Arc::new(|o: Object<String>| {
                o.map(|v| format!("{v}+t"))
            }))),
        )
        .unwrap();
        tokio::spawn(informer.clone().run());
        let store = |want: &[(&str, &str)]| {
            let got: BTreeMap<String, String> = informer
                .lister()
                .list()
                .iter()
                .map(|o| (o.key().to_string(), o.value.clone()))
                .collect();
            let want: BTreeMap<String, String> = want
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            assert_eq!(got, want, "{mode:?}");
        };
        let expect = |n: usize, line: &str| {
            let log = log.clone();
            let line = line.to_string();
            async move {
                until(&line, || log.len() >= n).await;
                assert_eq!(log.lines()[n - 1], line, "{mode:?}");
            }
        };
        expect(1, "add pod1 gen2+t").await;
        store(&[("pod1", "gen2+t")]);
        source.put("pod2", "gen1".into());
        expect(2, "add pod2 gen1+t").await;
        store(&[("pod1", "gen2+t"), ("pod2", "gen1+t")]);
        source.put("pod3", "gen1".into());
        expect(3, "add pod3 gen1+t").await;
        source.put("pod2", "gen2".into());
        expect(4, "update pod2 gen1+t->gen2+t").await;
        source.delete("pod1");
        expect(5, "delete pod1 gen2+t final").await;
        store(&[("pod2", "gen2+t"), ("pod3", "gen1+t")]);
        informer.stop();
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn controller_test_transforming_informer_race() {
    in_both_modes(|mode| async move {
        const OBJECTS: usize = 5;
        let source = FakeSource::new();
        for i in 0..OBJECTS {
            source.put(&format!("namespace/pod-{i}"), "raw".into());
        }
        let calls = Arc::new(AtomicUsize::new(0));
        let transformed_twice = Arc::new(AtomicBool::new(false));
        let transform = {
            let (calls, twice) = (calls.clone(), transformed_twice.clone());
            move |o: Object<String>| {
                calls.fetch_add(1, Ordering::SeqCst);
                if o.value != "raw" {
                    twice.store(true, Ordering::SeqCst);
                }
                o.map(|_| "transformed".to_string())
            }
        };
        let updates = Arc::new(AtomicUsize::new(0));
        let u = updates.clone();
        let informer = Informer::new(
            source.clone(),
            ResourceEventHandlerFuncs::new().on_update(move |_, _| {
                u.fetch_add(1, Ordering::SeqCst);
            }),
            options(mode)
                .with_resync_period(Duration::from_secs(1))
                .with_transform(Some(Arc::new(transform))),
        )
        .unwrap();
        tokio::spawn(informer.clone().run());
        until("synced", || informer.has_synced()).await;

        // Readers check the cached objects while resyncs re-deliver them.
        let stop = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (lister, stop) = (informer.lister(), stop.clone());
                std::thread::spawn(move || {
                    let mut reads = 0u64;
                    while !stop.load(Ordering::SeqCst) {
                        for i in 0..OBJECTS {
                            let o = lister.get(&format!("namespace/pod-{i}")).expect("cached");
                            assert_eq!(o.value, "transformed");
                            reads += 1;
                        }
                    }
                    reads
                })
            })
            .collect();
        until_ticking("three resyncs", || {
            updates.load(Ordering::SeqCst) >= 3 * OBJECTS
        })
        .await;
        stop.store(true, Ordering::SeqCst);
        for r in readers {
            assert!(r.join().expect("every read saw the transformed object") > 0);
        }
        assert!(!transformed_twice.load(Ordering::SeqCst), "{mode:?}");
        assert_eq!(
            calls.load(Ordering::SeqCst),
            OBJECTS,
            "{mode:?}: resyncs never transform"
        );
        informer.stop();
    })
    .await;
}

#[test]
fn controller_test_deletion_handling_object_to_name() {
    // A tombstone names the deleted key, and carries the object (client-go's
    // DeletedFinalStateUnknown with DeletionHandlingObjectToName).
    let cm = Arc::new(Object::new("testnamespace/testname", 3, ()));
    let deleted = DeletedObject::FinalStateUnknown(cm.clone());
    assert_eq!(deleted.key(), cm.key());
    assert_eq!(
        (deleted.object().namespace(), deleted.object().name()),
        ("testnamespace", "testname")
    );
    assert!(Arc::ptr_eq(deleted.object(), &cm));
}

#[tokio::test]
async fn controller_test_replace_events() {
    type Case = (
        &'static str,
        Vec<(&'static str, &'static str)>,
        Vec<(&'static str, &'static str)>,
        Vec<&'static str>,
    );
    let cases: Vec<Case> = vec![
        (
            "create with no initial objects",
            vec![],
            vec![("default/pod-1", "1")],
            vec!["add default/pod-1 1 store=1"],
        ),
        (
            "delete all objects",
            vec![("default/pod-1", "1"), ("default/pod-3", "2")],
            vec![],
            vec![
                "delete default/pod-1 1 store=none",
                "delete default/pod-3 2 store=none",
            ],
        ),
        (
            "create, update, delete",
            vec![
                ("default/pod-1", "1"),
                ("default/pod-2", "2"),
                ("default/pod-3", "3"),
            ],
            vec![
                ("default/pod-1", "4"),
                ("default/pod-2", "5"),
                ("default/pod-4", "6"),
            ],
            vec![
                "add default/pod-4 6 store=6",
                "delete default/pod-3 3 store=none",
                "update default/pod-1 4 store=4",
                "update default/pod-2 5 store=5",
            ],
        ),
    ];
    for mode in MODES {
        for (name, initial, replaced, want) in &cases {
            let source = FakeSource::new();
            for (k, v) in initial {
                source.put(k, v.to_string());
            }
            let informer = SharedIndexInformer::new(source.clone(), options(mode));
            // Records each notification with the cache's state of its key at that moment.
            let log = Log::default();
            let handler = {
                let (a, u, d) = (log.clone(), log.clone(), log.clone());
                let (la, lu, ld) = (informer.lister(), informer.lister(), informer.lister());
                let state = |lister: &etcd_informer::Lister<String>, key: &str| {
                    lister
                        .get(key)
                        .map_or("none".to_string(), |o| o.value.clone())
                };
                ResourceEventHandlerFuncs::new()
                    .on_add(move |o: &Arc<Object<String>>, _| {
                        a.push(format!(
                            "add {} {} store={}",
                            o.key(),
                            o.value,
                            state(&la, o.key())
                        ))
                    })
                    .on_update(move |_, o| {
                        u.push(format!(
                            "update {} {} store={}",
                            o.key(),
                            o.value,
                            state(&lu, o.key())
                        ))
                    })
                    .on_delete(move |o| {
                        let o = o.object();
                        d.push(format!(
                            "delete {} {} store={}",
                            o.key(),
                            o.value,
                            state(&ld, o.key())
                        ))
                    })
            };
            informer.add_event_handler(handler).unwrap();
            tokio::spawn(informer.clone().run());
            until("initial adds", || {
                informer.has_synced() && log.len() == initial.len()
            })
            .await;
            log.clear();

            drop_watch(&source);
            for (k, _) in initial {
                if !replaced.iter().any(|(r, _)| r == k) {
                    source.delete(k);
                }
            }
            for (k, v) in replaced {
                source.put(k, v.to_string());
            }
            source.compact();
            until_ticking("the relist's notifications", || log.len() >= want.len()).await;
            let mut got = log.lines();
            got.sort();
            assert_eq!(got, *want, "{mode:?} {name}");
            let cached: BTreeMap<String, String> = informer
                .lister()
                .list()
                .iter()
                .map(|o| (o.key().to_string(), o.value.clone()))
                .collect();
            let expected: BTreeMap<String, String> = replaced
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            assert_eq!(cached, expected, "{mode:?} {name}");
            informer.stop();
        }
    }
}
