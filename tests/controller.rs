//! The controller toolkit against real etcd: safe writes, the runner, leader election.
#![cfg(feature = "testing")]

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{eventually, shared_client};
use etcd_client::Client;
use etcd_informer::client::{TypedClient, WriteError};
use etcd_informer::leader_election::LeaderElector;
use etcd_informer::runner::{by_key, Action, Context, Runner};
use etcd_informer::testing::etcd::{unique_prefix, EtcdCluster, EtcdServer};
use etcd_informer::{connect, EtcdListerWatcher, SharedIndexInformer, TextCodec};

fn informer(client: &Client, prefix: &str) -> SharedIndexInformer<String> {
    let lw = EtcdListerWatcher::new(client.clone(), prefix, TextCodec).unwrap();
    let informer = SharedIndexInformer::new(lw, Default::default());
    tokio::spawn(informer.clone().run());
    informer
}

#[tokio::test]
async fn safe_writes_detect_conflicts() {
    let client = shared_client().await;
    let prefix = unique_prefix("safe_writes");
    let typed = TypedClient::new(client.clone(), prefix.clone(), TextCodec).unwrap();
    let rev = typed.create("a", &"one".to_string()).await.unwrap();
    let again = typed.create("a", &"two".to_string()).await.unwrap_err();
    assert!(again.is_conflict(), "{again}");
    let read = typed.get("a").await.unwrap().unwrap();
    assert_eq!((read.value.as_str(), read.mod_revision), ("one", rev));

    // Someone else writes between our read and our update.
    client
        .kv_client()
        .put(format!("{prefix}a"), "theirs", None)
        .await
        .unwrap();
    match typed
        .update("a", &"ours".to_string(), read.mod_revision)
        .await
    {
        Err(WriteError::Conflict {
            expected, actual, ..
        }) => {
            assert_eq!(expected, rev);
            assert!(actual.unwrap() > rev);
        }
        other => panic!("expected a conflict, got {other:?}"),
    }
    assert_eq!(
        typed.get("a").await.unwrap().unwrap().value,
        "theirs",
        "their write survived"
    );
    assert!(typed.delete("a", rev).await.unwrap_err().is_conflict());
    let current = typed.get("a").await.unwrap().unwrap();
    let updated = typed
        .update("a", &"ours".to_string(), current.mod_revision)
        .await
        .unwrap();
    typed.delete("a", updated).await.unwrap();
    assert!(typed.get("a").await.unwrap().is_none());
    assert!(
        typed
            .update("a", &"x".to_string(), updated)
            .await
            .unwrap_err()
            .is_conflict(),
        "deleted key"
    );

    client
        .kv_client()
        .put(format!("{prefix}bad"), vec![0xff], None)
        .await
        .unwrap();
    match typed.get("bad").await {
        Err(WriteError::Decode(e)) => assert_eq!(e.key_str(), Some(&*format!("{prefix}bad"))),
        other => panic!("expected a decode error, got {other:?}"),
    }
    assert!(TypedClient::new(client, "/no-slash", TextCodec).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runner_reconciles_each_key_alone_backs_off_and_drains_on_shutdown() {
    let client = shared_client().await;
    let prefix = unique_prefix("runner");
    for i in 0..5 {
        client
            .kv_client()
            .put(format!("{prefix}ns/k{i}"), "0", None)
            .await
            .unwrap();
    }
    client
        .kv_client()
        .put(format!("{prefix}ns/failing"), "0", None)
        .await
        .unwrap();
    let informer = informer(&client, &prefix);
    let runner = Runner::new("test").watch(&informer).workers(4);
    let in_flight: Arc<Mutex<HashSet<String>>> = Default::default();
    let overlaps = Arc::new(AtomicUsize::new(0));
    let unsynced = Arc::new(AtomicUsize::new(0));
    let failures = Arc::new(AtomicUsize::new(0));
    let done: Arc<Mutex<Vec<String>>> = Default::default();
    let slow_finished = Arc::new(AtomicBool::new(false));
    let (f, o, u, d, s, inf) = (
        in_flight.clone(),
        overlaps.clone(),
        unsynced.clone(),
        done.clone(),
        slow_finished.clone(),
        informer.clone(),
    );
    let fail = failures.clone();
    let reconcile = move |key: String| {
        let (f, o, u, d, s, fail, inf) = (
            f.clone(),
            o.clone(),
            u.clone(),
            d.clone(),
            s.clone(),
            fail.clone(),
            inf.clone(),
        );
        async move {
            if !inf.has_synced() {
                u.fetch_add(1, Ordering::SeqCst);
            }
            if !f.lock().unwrap().insert(key.clone()) {
                o.fetch_add(1, Ordering::SeqCst);
            }
            let result = if key == "ns/failing" {
                fail.fetch_add(1, Ordering::SeqCst);
                Err("always fails".to_string())
            } else if key == "ns/slow" {
                tokio::time::sleep(Duration::from_millis(500)).await;
                s.store(true, Ordering::SeqCst);
                Ok(Action::Done)
            } else {
                tokio::time::sleep(Duration::from_millis(5)).await;
                Ok(Action::Done)
            };
            f.lock().unwrap().remove(&key);
            d.lock().unwrap().push(key);
            result
        }
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(runner.run(reconcile, async move {
        let _ = stop_rx.await;
    }));
    // Hammer one key with changes while it is being reconciled.
    for i in 0..50 {
        client
            .kv_client()
            .put(format!("{prefix}ns/k0"), i.to_string(), None)
            .await
            .unwrap();
    }
    eventually("every key reconciled", Duration::from_secs(10), || {
        let d = done.lock().unwrap();
        (0..5).all(|i| d.contains(&format!("ns/k{i}")))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let attempts = failures.load(Ordering::SeqCst);
    // 5 ms doubling: about 8 attempts in a second; a spinning retry would make thousands.
    assert!(
        (3..=20).contains(&attempts),
        "failing key retried {attempts} times in ~1 s"
    );
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "a key was reconciled by two workers at once"
    );
    assert_eq!(
        unsynced.load(Ordering::SeqCst),
        0,
        "reconciled before the informer synced"
    );
    let k0 = done
        .lock()
        .unwrap()
        .iter()
        .filter(|k| *k == "ns/k0")
        .count();
    assert!(k0 < 51, "changes coalesce: {k0} reconciles for 51 versions");

    // Shutdown waits for a reconcile in flight.
    client
        .kv_client()
        .put(format!("{prefix}ns/slow"), "0", None)
        .await
        .unwrap();
    eventually("slow reconcile started", Duration::from_secs(10), || {
        in_flight.lock().unwrap().contains("ns/slow")
    })
    .await;
    stop_tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("runner stops")
        .unwrap();
    assert!(
        slow_finished.load(Ordering::SeqCst),
        "shutdown returned before the reconcile in flight finished"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runner_requeue_after() {
    let client = shared_client().await;
    let prefix = unique_prefix("requeue");
    client
        .kv_client()
        .put(format!("{prefix}ns/a"), "0", None)
        .await
        .unwrap();
    let informer = informer(&client, &prefix);
    let count = Arc::new(AtomicUsize::new(0));
    let c = count.clone();
    let runner = Runner::new("requeue").watch(&informer);
    let run = runner.run(
        move |_key| {
            let c = c.clone();
            async move {
                c.fetch_add(1, Ordering::SeqCst);
                Ok::<_, String>(Action::RequeueAfter(Duration::from_millis(100)))
            }
        },
        tokio::time::sleep(Duration::from_millis(1050)),
    );
    run.await;
    let n = count.load(Ordering::SeqCst);
    assert!(
        (5..=12).contains(&n),
        "{n} reconciles in ~1 s with a 100 ms requeue"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_election_hands_over_and_never_overlaps() {
    let client = shared_client().await;
    let election = unique_prefix("election");
    let a =
        LeaderElector::new(client.clone(), election.clone(), "a").with_ttl(Duration::from_secs(2));
    let b =
        LeaderElector::new(client.clone(), election.clone(), "b").with_ttl(Duration::from_secs(2));
    let leading_a = a.campaign().await.unwrap();
    assert!(leading_a.is_leader());
    let b_task = tokio::spawn(async move {
        let l = b.campaign().await.unwrap();
        (tokio::time::Instant::now(), l)
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!b_task.is_finished(), "b cannot lead while a does");

    // a's lease is revoked (as an operator or a partition would): a notices promptly.
    let revoked_at = tokio::time::Instant::now();
    client
        .lease_client()
        .revoke(leading_a.lease_id())
        .await
        .unwrap();
    let lost = tokio::time::timeout(Duration::from_secs(3), leading_a.lost()).await;
    assert!(lost.is_ok(), "a noticed the revoked lease");
    let a_stopped = tokio::time::Instant::now();
    let (b_started, leading_b) = tokio::time::timeout(Duration::from_secs(5), b_task)
        .await
        .expect("b takes over")
        .unwrap();
    assert!(
        b_started - revoked_at < Duration::from_secs(3),
        "b took over within about the TTL"
    );
    assert!(
        a_stopped <= b_started + Duration::from_millis(700),
        "a stopped acting about when b started"
    );
    leading_b.resign().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashed_leader_is_replaced_after_the_ttl() {
    let client = shared_client().await;
    let election = unique_prefix("crash");
    let a =
        LeaderElector::new(client.clone(), election.clone(), "a").with_ttl(Duration::from_secs(2));
    let b =
        LeaderElector::new(client.clone(), election.clone(), "b").with_ttl(Duration::from_secs(2));
    let leading_a = a.campaign().await.unwrap();
    let crashed_at = tokio::time::Instant::now();
    drop(leading_a); // a crashes: its lease is no longer renewed
    let leading_b = tokio::time::timeout(Duration::from_secs(6), b.campaign())
        .await
        .expect("b leads")
        .unwrap();
    let waited = crashed_at.elapsed();
    assert!(
        waited >= Duration::from_millis(1000),
        "b waited for a's lease to expire ({waited:?})"
    );
    leading_b.resign().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_cut_off_from_etcd_stops_its_workers_within_the_ttl() {
    let server = EtcdServer::start().await.unwrap_or_else(|e| panic!("{e}"));
    let client = connect(server.endpoints()).await.unwrap();
    client
        .kv_client()
        .put("/cut/ns/a", "0", None)
        .await
        .unwrap();
    let informer = informer(&client, "/cut/");
    let elector =
        LeaderElector::new(client.clone(), "/cut-election/", "a").with_ttl(Duration::from_secs(3));
    let reconciles = Arc::new(AtomicUsize::new(0));
    let r = reconciles.clone();
    let mut runner = Runner::new("cut").watch(&informer);
    let run = tokio::spawn(async move {
        runner
            .run_as_leader(
                &elector,
                by_key(move |_k| {
                    let r = r.clone();
                    async move {
                        r.fetch_add(1, Ordering::SeqCst);
                        Ok::<_, String>(Action::RequeueAfter(Duration::from_millis(50)))
                    }
                }),
                std::future::pending::<()>(),
            )
            .await
    });
    eventually("leading and reconciling", Duration::from_secs(10), || {
        reconciles.load(Ordering::SeqCst) > 0
    })
    .await;
    server.pause().unwrap();
    let paused_at = tokio::time::Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(6), run).await;
    let took = paused_at.elapsed();
    server.resume().unwrap();
    let result = result
        .expect("run_as_leader returned after losing the lease")
        .unwrap();
    assert!(result.is_err(), "reports the loss");
    assert!(
        took < Duration::from_secs(3),
        "stopped within the TTL: {took:?}"
    );
    let after = reconciles.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        reconciles.load(Ordering::SeqCst),
        after,
        "no reconcile after losing leadership"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_campaign_frees_its_lease() {
    // A private etcd: the test counts every lease in it.
    let server = EtcdServer::start().await.unwrap_or_else(|e| panic!("{e}"));
    let client = connect(server.endpoints()).await.unwrap();
    let election = "/cancelled/".to_string();
    let a =
        LeaderElector::new(client.clone(), election.clone(), "a").with_ttl(Duration::from_secs(2));
    let b =
        LeaderElector::new(client.clone(), election.clone(), "b").with_ttl(Duration::from_secs(2));
    let leading_a = a.campaign().await.unwrap();
    assert_eq!(
        client.lease_client().leases().await.unwrap().leases().len(),
        1
    );
    // b waits behind a, then gives up.
    assert!(
        tokio::time::timeout(Duration::from_millis(500), b.campaign())
            .await
            .is_err()
    );
    // Its lease is revoked at once, well before its 2 s TTL could expire it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
    while client.lease_client().leases().await.unwrap().leases().len() != 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "b's lease outlived its campaign"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    leading_a.resign().await;
    let c =
        LeaderElector::new(client.clone(), election.clone(), "c").with_ttl(Duration::from_secs(2));
    let leading_c = tokio::time::timeout(Duration::from_secs(2), c.campaign())
        .await
        .expect("nobody blocks c: b's abandoned campaign left no live lease")
        .unwrap();
    // b's lease would live on only if something kept renewing it; give a TTL and more.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let leases = client.lease_client().leases().await.unwrap();
    assert_eq!(leases.leases().len(), 1, "only c's lease is alive");
    leading_c.resign().await;
}

/// A leader cut off from etcd (its member frozen) while the rest of the cluster carries on must
/// stop acting before anyone else can start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_off_leader_stops_before_a_successor_starts() {
    let cluster = EtcdCluster::start(3)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let only = |i: usize| {
        Client::connect(
            [cluster.member_endpoint(i)],
            Some(etcd_informer::connect_options()),
        )
    };
    let client_a = only(0).await.unwrap();
    let client_b = only(1).await.unwrap();
    let a = LeaderElector::new(client_a, "/overlap/", "a").with_ttl(Duration::from_secs(3));
    let b = LeaderElector::new(client_b, "/overlap/", "b").with_ttl(Duration::from_secs(3));
    let leading_a = a.campaign().await.unwrap();
    let b_task = tokio::spawn(async move {
        let l = b.campaign().await;
        (tokio::time::Instant::now(), l)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    cluster.pause_member(0).unwrap();
    let lost = tokio::time::timeout(Duration::from_secs(10), leading_a.lost()).await;
    let a_stopped = tokio::time::Instant::now();
    assert!(lost.is_ok(), "a noticed it was cut off");
    let (b_started, leading_b) = tokio::time::timeout(Duration::from_secs(20), b_task)
        .await
        .expect("b takes over")
        .unwrap();
    cluster.resume_member(0).unwrap();
    assert!(a_stopped < b_started, "a stopped acting before b started");
    leading_b.unwrap().resign().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_whose_lease_vanished_learns_it_on_reconnect() {
    let server = EtcdServer::start().await.unwrap_or_else(|e| panic!("{e}"));
    let client = connect(server.endpoints()).await.unwrap();
    // A long TTL: only an explicit "lease not found" can make a notice this fast.
    let a = LeaderElector::new(client.clone(), "/vanished/", "a").with_ttl(Duration::from_secs(9));
    let leading_a = a.campaign().await.unwrap();
    server.wipe().await.unwrap();
    let wiped_at = tokio::time::Instant::now();
    let lost = tokio::time::timeout(Duration::from_secs(10), leading_a.lost()).await;
    let took = wiped_at.elapsed();
    let why = lost.expect("a learns it lost the lease").to_string();
    assert!(took < Duration::from_secs(3), "took {took:?}: {why}");
    assert!(why.contains("expired or was revoked"), "{why}");
}

/// Waits for `task` to finish, failing after `within`.
async fn finished<T>(what: &str, within: Duration, task: tokio::task::JoinHandle<T>) -> T {
    tokio::time::timeout(within, task)
        .await
        .unwrap_or_else(|_| panic!("timed out after {within:?}: {what}"))
        .expect("task panicked")
}

async fn put(client: &Client, key: String, value: &str) {
    client.kv_client().put(key, value, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runner_survives_panicking_reconciles_and_gives_them_a_context() {
    let client = shared_client().await;
    let prefix = unique_prefix("runner-panics");
    for key in ["ns/a", "ns/b", "ns/boom"] {
        put(&client, format!("{prefix}{key}"), "v1").await;
    }
    let informer = informer(&client, &prefix);
    let runner = Runner::new("panics").watch(&informer).workers(2);
    let attempts: Arc<Mutex<Vec<(String, u32)>>> = Default::default();
    // What each reconcile saw: key, value (or "deleted"), runner name.
    let seen: Arc<Mutex<Vec<(String, String, String)>>> = Default::default();
    let (a, s) = (attempts.clone(), seen.clone());
    let reconcile = move |ctx: Context| {
        let (attempts, seen) = (a.clone(), s.clone());
        async move {
            let tries = {
                let mut attempts = attempts.lock().unwrap();
                attempts.push((ctx.key().to_owned(), ctx.retries()));
                attempts.iter().filter(|(k, _)| k == ctx.key()).count()
            };
            if ctx.key() == "ns/boom" && tries <= 2 {
                panic!("reconcile bug on attempt {tries}");
            }
            let value = match ctx.object::<String>() {
                Some(o) => o.value.clone(),
                None => "deleted".to_owned(),
            };
            assert_eq!(ctx.is_deleted(), value == "deleted");
            assert!(ctx.lister::<String>().is_some() && ctx.lister::<u64>().is_none());
            assert!(
                ctx.object::<u64>().is_none(),
                "typed lookups do not mix types"
            );
            seen.lock()
                .unwrap()
                .push((ctx.key().to_owned(), value, ctx.runner().to_owned()));
            Ok::<_, String>(Action::Done)
        }
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(runner.run_with_context(reconcile, async move {
        let _ = stop_rx.await;
    }));
    let saw = |key: &str, value: &str| {
        seen.lock()
            .unwrap()
            .iter()
            .any(|(k, v, r)| k == key && v == value && r == "panics")
    };
    eventually("every key reconciled", Duration::from_secs(10), || {
        saw("ns/a", "v1") && saw("ns/b", "v1") && saw("ns/boom", "v1")
    })
    .await;
    let boom: Vec<u32> = attempts
        .lock()
        .unwrap()
        .iter()
        .filter(|(k, _)| k == "ns/boom")
        .map(|(_, retries)| *retries)
        .collect();
    assert_eq!(
        boom,
        [0, 1, 2],
        "two panics, retried with backoff, then converged"
    );
    for key in ["ns/a", "ns/b"] {
        let n = attempts
            .lock()
            .unwrap()
            .iter()
            .filter(|(k, _)| k == key)
            .count();
        assert_eq!(n, 1, "{key} is unaffected by the panics");
    }
    // Later changes to the key that panicked are reconciled, and deletes show as such.
    put(&client, format!("{prefix}ns/boom"), "v2").await;
    client
        .kv_client()
        .delete(format!("{prefix}ns/a"), None)
        .await
        .unwrap();
    eventually("later changes reconciled", Duration::from_secs(10), || {
        saw("ns/boom", "v2") && saw("ns/a", "deleted")
    })
    .await;
    stop_tx.send(()).unwrap();
    finished("runner stops", Duration::from_secs(10), run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_that_never_returns_times_out_and_is_retried() {
    let client = shared_client().await;
    let prefix = unique_prefix("runner-timeout");
    put(&client, format!("{prefix}ns/stuck"), "0").await;
    put(&client, format!("{prefix}ns/fine"), "0").await;
    let informer = informer(&client, &prefix);
    let runner = Runner::new("timeouts")
        .watch(&informer)
        .workers(2)
        .reconcile_timeout(Duration::from_millis(300));
    let attempts = Arc::new(AtomicUsize::new(0));
    let cancelled = Arc::new(AtomicBool::new(false));
    let done: Arc<Mutex<Vec<String>>> = Default::default();
    let (a, c, d) = (attempts.clone(), cancelled.clone(), done.clone());
    /// Sets its flag when dropped: the stuck reconcile was cancelled, not leaked.
    struct OnDrop(Arc<AtomicBool>);
    impl Drop for OnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let reconcile = move |key: String| {
        let (a, c, d) = (a.clone(), c.clone(), d.clone());
        async move {
            if key == "ns/stuck" && a.fetch_add(1, Ordering::SeqCst) == 0 {
                let _guard = OnDrop(c);
                std::future::pending::<()>().await;
            }
            d.lock().unwrap().push(key);
            Ok::<_, String>(Action::Done)
        }
    };
    let started = tokio::time::Instant::now();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(runner.run(reconcile, async move {
        let _ = stop_rx.await;
    }));
    eventually("the stuck key converged", Duration::from_secs(10), || {
        done.lock().unwrap().contains(&"ns/stuck".to_owned())
    })
    .await;
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(300),
        "retried only after the timeout: {took:?}"
    );
    assert_eq!(
        attempts.load(Ordering::SeqCst),
        2,
        "timed out once, then retried"
    );
    assert!(
        cancelled.load(Ordering::SeqCst),
        "the stuck reconcile was dropped"
    );
    assert!(done.lock().unwrap().contains(&"ns/fine".to_owned()));
    stop_tx.send(()).unwrap();
    finished("runner stops", Duration::from_secs(10), run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runner_removes_its_handlers_when_it_returns() {
    let client = shared_client().await;
    let prefix = unique_prefix("runner-release");
    put(&client, format!("{prefix}ns/a"), "0").await;
    let informer = informer(&client, &prefix);
    informer.wait_for_cache_sync().await;
    assert_eq!(informer.handler_count(), 0);
    let runner = Runner::new("zq7rel").watch(&informer).watch(&informer);
    let reconciled = Arc::new(AtomicUsize::new(0));
    let r = reconciled.clone();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(runner.run(
        move |_key| {
            let r = r.clone();
            async move {
                r.fetch_add(1, Ordering::SeqCst);
                Ok::<_, String>(Action::Done)
            }
        },
        async move {
            let _ = stop_rx.await;
        },
    ));
    eventually("reconciled", Duration::from_secs(10), || {
        reconciled.load(Ordering::SeqCst) > 0
    })
    .await;
    assert_eq!(informer.handler_count(), 2, "one handler per watch");
    stop_tx.send(()).unwrap();
    finished("runner stops", Duration::from_secs(10), run).await;
    assert_eq!(
        informer.handler_count(),
        0,
        "handlers removed when run returns"
    );
    // The informer goes on without them.
    put(&client, format!("{prefix}ns/b"), "0").await;
    eventually("cache follows", Duration::from_secs(10), || {
        informer.lister().get("ns/b").is_some()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runner_campaigns_again_after_losing_leadership() {
    let client = shared_client().await;
    let prefix = unique_prefix("runner-again");
    let election = unique_prefix("runner-again-election");
    put(&client, format!("{prefix}ns/a"), "0").await;
    let informer = informer(&client, &prefix);
    let elector =
        LeaderElector::new(client.clone(), election.clone(), "a").with_ttl(Duration::from_secs(2));
    let runner = Runner::new("again").watch(&informer);
    let seen: Arc<Mutex<Vec<String>>> = Default::default();
    let s = seen.clone();
    let reconcile = move |key: String| {
        let s = s.clone();
        async move {
            s.lock().unwrap().push(key);
            Ok::<_, String>(Action::Done)
        }
    };

    // First term: leads, reconciles, loses its lease.
    let (rec, el) = (reconcile.clone(), elector.clone());
    let first = tokio::spawn(async move {
        let mut runner = runner;
        let result = runner
            .run_as_leader(&el, by_key(rec), std::future::pending::<()>())
            .await;
        (result, runner)
    });
    eventually("first term reconciles", Duration::from_secs(10), || {
        seen.lock().unwrap().contains(&"ns/a".to_owned())
    })
    .await;
    let leader = client
        .election_client()
        .leader(election.clone())
        .await
        .unwrap();
    let lease = leader.kv().expect("a leader key").lease();
    client.lease_client().revoke(lease).await.unwrap();
    let (result, mut runner) = finished("leadership lost", Duration::from_secs(5), first).await;
    assert!(result.is_err(), "reports the loss");
    assert_eq!(informer.handler_count(), 0, "handlers removed on loss");

    // Second term, same runner: the changes made meanwhile are reconciled.
    seen.lock().unwrap().clear();
    put(&client, format!("{prefix}ns/b"), "0").await;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let second = tokio::spawn(async move {
        runner
            .run_as_leader(&elector, by_key(reconcile), async move {
                let _ = stop_rx.await;
            })
            .await
    });
    eventually("second term reconciles", Duration::from_secs(10), || {
        let seen = seen.lock().unwrap();
        seen.contains(&"ns/a".to_owned()) && seen.contains(&"ns/b".to_owned())
    })
    .await;
    stop_tx.send(()).unwrap();
    let result = finished("runner stops", Duration::from_secs(10), second).await;
    assert!(result.is_ok(), "{result:?}");
    assert_eq!(informer.handler_count(), 0);
}

/// Reconciles a runner makes after a compaction relist that finds all but one of 100 keys
/// unchanged, for each [`RelistUnchanged`] choice and both processing modes, and with the
/// runner's resyncs off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relist_of_unchanged_keys_reconciles_only_what_changed_unless_asked() {
    use etcd_informer::listwatch::Error;
    use etcd_informer::testing::FakeSource;
    use etcd_informer::{InformerOptions, Processing, RelistUnchanged};
    for processing in [Processing::Atomic, Processing::DeltaFifo] {
        for (choice, resyncs, expected) in [
            (RelistUnchanged::ResyncingHandlers, true, 1),
            (RelistUnchanged::Nobody, true, 1),
            (RelistUnchanged::Everyone, true, 100),
            // Other handlers hear of every key; the runner reconciles only the change.
            (RelistUnchanged::Everyone, false, 1),
        ] {
            let source = FakeSource::<String>::new();
            for i in 0..100 {
                source.put(&format!("k{i:03}"), "v1".into());
            }
            let options = InformerOptions::default()
                .with_processing(processing)
                .with_relist_unchanged(choice)
                .with_backoff(etcd_informer::Backoff::new(
                    Duration::from_millis(1),
                    Duration::from_millis(10),
                    Duration::from_secs(120),
                    0.0,
                ));
            let informer = SharedIndexInformer::new(source.clone(), options);
            tokio::spawn(informer.clone().run());
            let reconciled = Arc::new(AtomicUsize::new(0));
            let count = reconciled.clone();
            let runner = Runner::new("relist")
                .watch(&informer)
                .workers(2)
                .resyncs(resyncs);
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let task = tokio::spawn(runner.run(
                move |_key| {
                    let count = count.clone();
                    async move {
                        count.fetch_add(1, Ordering::SeqCst);
                        Ok::<_, String>(Action::Done)
                    }
                },
                async {
                    let _ = rx.await;
                },
            ));
            eventually(
                "the initial list reconciled",
                Duration::from_secs(10),
                || reconciled.load(Ordering::SeqCst) == 100,
            )
            .await;
            // One change made while the watch is down, then the history compacted: a relist.
            let lists = source.list_count();
            source.break_watches(Error::transient("connection reset"));
            let revision = source.put("k000", "v2".into());
            source.compact();
            eventually("relisted", Duration::from_secs(10), || {
                source.list_count() > lists && informer.revision() >= revision
            })
            .await;
            eventually("the relist reconciled", Duration::from_secs(10), || {
                reconciled.load(Ordering::SeqCst) >= 100 + expected
            })
            .await;
            // Nothing more comes.
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert_eq!(
                reconciled.load(Ordering::SeqCst) - 100,
                expected,
                "{processing:?}, {choice:?}, runner resyncs {resyncs}"
            );
            let _ = tx.send(());
            task.await.unwrap();
            informer.stop();
        }
    }
}

/// A live change is reconciled ahead of an initial list's backlog with priorities (the
/// default), and behind all of it without.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_change_overtakes_the_initial_list_unless_priorities_are_off() {
    use etcd_informer::testing::FakeSource;
    for priorities in [true, false] {
        let source = FakeSource::<String>::new();
        for i in 0..2000 {
            source.put(&format!("list/k{i:04}"), "v1".into());
        }
        let informer = SharedIndexInformer::new(source.clone(), Default::default());
        tokio::spawn(informer.clone().run());
        informer.wait_for_cache_sync().await;
        let order = Arc::new(Mutex::new(Vec::<String>::new()));
        let seen = order.clone();
        let runner = Runner::new("priorities")
            .watch(&informer)
            .workers(2)
            .priorities(priorities);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(runner.run(
            move |key| {
                let seen = seen.clone();
                async move {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    seen.lock().unwrap().push(key);
                    Ok::<_, String>(Action::Done)
                }
            },
            async {
                let _ = rx.await;
            },
        ));
        eventually(
            "the list is being reconciled",
            Duration::from_secs(10),
            || order.lock().unwrap().len() >= 100,
        )
        .await;
        source.put("live", "changed".into());
        eventually("everything reconciled", Duration::from_secs(30), || {
            order.lock().unwrap().len() == 2001
        })
        .await;
        let position = order
            .lock()
            .unwrap()
            .iter()
            .position(|k| k == "live")
            .expect("the live change was reconciled");
        println!("priorities {priorities}: the live change was reconciled {position}th of 2001");
        if priorities {
            assert!(
                position < 1000,
                "the live change waited behind the list: {position}"
            );
        } else {
            assert!(position > 1900, "without priorities it is FIFO: {position}");
        }
        let _ = tx.send(());
        task.await.unwrap();
        informer.stop();
    }
}
