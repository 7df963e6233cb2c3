//! The coordinator against real etcd, where one step of it is the point.

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Poll, Waker};

use super::*;
use crate::connect;
use crate::testing::etcd::{test_etcd, unique_prefix};

fn coordinator(client: Client, prefix: &str, member: &str, ttl: Duration) -> Coordinator {
    let runner = Runner::new("sharding-tests");
    Coordinator {
        records: Records::new(client.clone(), prefix.to_owned()),
        client,
        member: member.into(),
        shards: 4,
        ttl,
        table: ShardTable::new(4, Arc::new(whole_key)),
        queue: runner.queue().clone(),
        keys: runner.key_source(),
        status: Arc::new(Status {
            health: Mutex::default(),
            table: Mutex::new(None),
        }),
        metrics: Arc::new(ShardMetrics::new("sharding-tests", member)),
    }
}

/// Issue 28, minor: a shutdown that comes once the member key is written, before `join` has
/// returned, must not leave that key (a member nobody is behind) for a whole TTL: shutdown wins,
/// and the lease is revoked.
#[tokio::test]
async fn a_shutdown_during_join_leaves_no_member_behind() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = connect(&etcd.endpoints).await.expect("connect");
    let prefix = unique_prefix("sharding_join_shutdown");
    let ttl = Duration::from_secs(30);
    let coordinator = coordinator(client.clone(), &prefix, "m", ttl);
    let member_key = format!("{prefix}members/m");
    let present = || {
        let mut kv = client.kv_client();
        let key = member_key.clone();
        async move { kv.get(key, None).await.expect("read etcd").count() > 0 }
    };

    let fired = AtomicBool::new(false);
    let mut shutdown = pin!(std::future::poll_fn(|_| {
        match fired.load(Ordering::SeqCst) {
            true => Poll::Ready(()),
            false => Poll::Pending,
        }
    }));
    let mut join = pin!(coordinator.join(&mut shutdown));
    let mut cx = std::task::Context::from_waker(Waker::noop());
    // Polled by hand, so that it does not see its answers until the test lets it: each poll
    // moves it one request on (grant, then announce).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Poll::Ready(lease) = join.as_mut().poll(&mut cx) {
            panic!(
                "joined before the test saw the member key: {:?}",
                lease.map(|l| l.id())
            );
        }
        // Long enough for a put once sent to be seen (it is not answered until the next poll);
        // spent in full only while join is still in its grant.
        let waited = Instant::now() + Duration::from_secs(1);
        while Instant::now() < waited && !present().await {
            tokio::task::yield_now().await;
        }
        if present().await {
            break;
        }
        assert!(Instant::now() < deadline, "the member key never showed");
    }
    // The member key is written; join has not returned. Shutdown now.
    fired.store(true, Ordering::SeqCst);
    match join.as_mut().poll(&mut cx) {
        Poll::Ready(None) => {}
        Poll::Ready(Some(lease)) => {
            let id = lease.id();
            let _ = lease.revoke().await;
            panic!("join returned lease {id} after shutdown");
        }
        Poll::Pending => panic!("join goes on after shutdown"),
    }
    let shut_down = Instant::now();
    let gone_by = shut_down + Duration::from_secs(3);
    while present().await {
        assert!(
            Instant::now() < gone_by,
            "the member key outlived the shutdown by 3 s (its lease's TTL is {ttl:?})"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!(
        "the member key went {:?} after shutdown",
        shut_down.elapsed()
    );
}

/// Issue 28, finding 2 (the narrower variant), through the coordinator: a key refused while
/// the lease's proof had lapsed, with the lease going on (a renewal accepted late, no
/// `drop_all`), is queued again at the next converge.
#[tokio::test]
async fn a_key_refused_while_the_lease_was_unproven_is_queued_again_once_it_is_proven() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = connect(&etcd.endpoints).await.expect("connect");
    let prefix = unique_prefix("sharding_unproven");
    let coordinator = coordinator(client, &prefix, "m", Duration::from_secs(10));
    let (informer, _task, _wake) = coordinator.watch_records().await.expect("records");
    informer.wait_for_cache_sync().await;
    let mut shutdown = pin!(std::future::pending::<()>());
    let lease = coordinator.join(&mut shutdown).await.expect("joined");
    let mut round = Round::default();
    let deadline = Instant::now() + Duration::from_secs(10);
    while coordinator.table.held().0.len() < 4 {
        assert!(
            Instant::now() < deadline,
            "the only member never held every shard"
        );
        coordinator
            .converge(&informer, &lease, &mut round)
            .await
            .expect("converge");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(coordinator.queue.len(), 0, "the runner watches no informer");

    // The proof lapses for a moment (the keeper task ran late), then a renewal is accepted.
    coordinator
        .table
        .bind(crate::lease::Validity::until(Instant::now()));
    assert!(
        coordinator.table.admit("k").is_none(),
        "refused while unproven"
    );
    coordinator.table.bind(lease.validity());
    coordinator
        .converge(&informer, &lease, &mut round)
        .await
        .expect("converge");
    assert_eq!(
        coordinator.queue.len(),
        1,
        "the refused key is queued again"
    );
    assert_eq!(coordinator.queue.get().await.as_deref(), Some("k"));
    let _ = lease.revoke().await;
    informer.stop();
}
