//! Several cache servers over one etcd cluster serve one fleet: a client given all of them
//! moves from one that drains or dies to another without a relist, a lost or repeated event,
//! or a delete etcd never made.

use super::*;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use etcd_informer::testing::etcd::EtcdCluster;
use etcd_informer::ResourceEventHandlerFuncs;

/// What the informer's handlers heard: per key, the mod_revisions of its adds and updates in
/// order, and the keys of its deletes.
#[derive(Default)]
struct Heard {
    revisions: BTreeMap<String, Vec<i64>>,
    deleted: Vec<String>,
}

/// Three servers over a 3-member cluster, an informer given all three, writes (puts and
/// deletes) all along: one server drained (its `shutdown`, what SIGTERM does in the example),
/// then another dropped (its streams end as in a drain; a real SIGKILL of a server process is
/// in `tests/examples.rs`). The
/// informer ends on the third, converged, with its relists unchanged, each key's revisions
/// heard in order and at most once, and a delete only for keys etcd deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_informer_moves_between_servers_without_a_relist() {
    let cluster = EtcdCluster::start(3)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let client = connect(cluster.endpoints()).await.expect("connect");
    let p = "/registry/replicas/";
    for i in 0..20 {
        put(&client, &format!("{p}k{i}"), "initial").await;
    }
    let options = CacheServerOptions::default().with_drain_timeout(Duration::from_secs(5));
    let mut servers = Vec::new();
    for _ in 0..3 {
        servers.push(start_server_with(&client, cluster.endpoints(), p, options.clone()).await);
    }
    let addresses: Vec<String> = servers.iter().map(|s| s.local_addr().to_string()).collect();
    let via = connect(addresses).await.expect("connect to the servers");
    let lw = EtcdListerWatcher::new(via, p, TextCodec).expect("source");
    let informer = SharedIndexInformer::new(lw, Default::default());
    let heard = Arc::new(Mutex::new(Heard::default()));
    let (added, updated, deleted) = (heard.clone(), heard.clone(), heard.clone());
    let record = |heard: &Mutex<Heard>, key: &str, revision: i64| {
        let mut heard = heard.lock().expect("heard");
        heard
            .revisions
            .entry(key.to_owned())
            .or_default()
            .push(revision);
    };
    informer
        .add_event_handler(
            ResourceEventHandlerFuncs::new()
                .on_add(move |o, _| record(&added, o.key(), o.mod_revision))
                .on_update(move |_, o| record(&updated, o.key(), o.mod_revision))
                .on_delete(move |o| {
                    let key = o.key().to_owned();
                    deleted.lock().expect("heard").deleted.push(key);
                }),
        )
        .expect("handler");
    let run = tokio::spawn(informer.clone().run());
    tokio::time::timeout(WITHIN, informer.wait_for_cache_sync())
        .await
        .expect("sync");
    let relists = informer.health().reflector.relists.total();

    // Writes all along: puts of 30 keys, every fifth write a delete.
    let writing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let writer = {
        let (client, writing, p) = (client.clone(), writing.clone(), p.to_owned());
        tokio::spawn(async move {
            let mut deleted_by_etcd = BTreeSet::new();
            let mut i = 0u64;
            while writing.load(std::sync::atomic::Ordering::Relaxed) {
                let key = format!("k{}", i % 30);
                if i % 5 == 4 {
                    delete(&client, &format!("{p}{key}")).await;
                    deleted_by_etcd.insert(key);
                } else {
                    put(&client, &format!("{p}{key}"), &i.to_string()).await;
                }
                i += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            deleted_by_etcd
        })
    };
    let pause = || tokio::time::sleep(Duration::from_millis(700));
    pause().await;
    // The server the informer's watch is on is drained; then the one it moved to is dropped.
    let drained = servers.remove(watched(&servers).await);
    let started = tokio::time::Instant::now();
    drained.shutdown().await;
    let drain_took = started.elapsed();
    pause().await;
    drop(servers.remove(watched(&servers).await));
    pause().await;
    watched(&servers).await;
    writing.store(false, std::sync::atomic::Ordering::Relaxed);
    let deleted_by_etcd = writer.await.expect("writer");
    converges(&informer, &client, p, Duration::from_secs(60)).await;

    let health = informer.health();
    let (spurious, out_of_order) = {
        let heard = heard.lock().expect("heard");
        let spurious: Vec<String> = heard
            .deleted
            .iter()
            .filter(|k| !deleted_by_etcd.contains(*k))
            .cloned()
            .collect();
        let out_of_order: Vec<(String, Vec<i64>)> = heard
            .revisions
            .iter()
            .filter(|(_, r)| r.windows(2).any(|w| w[0] >= w[1]))
            .map(|(k, r)| (k.clone(), r.clone()))
            .collect();
        (spurious, out_of_order)
    };
    assert!(
        health.reflector.relists.total() == relists
            && spurious.is_empty()
            && out_of_order.is_empty()
            && drain_took < Duration::from_secs(5),
        "relists {relists} -> {:?}; deletes etcd never made: {spurious:?}; revisions repeated or back: {out_of_order:?}; drain took {drain_took:?}",
        health.reflector.relists
    );
    informer.stop();
    let _ = run.await;
}

/// A draining server says NOT_SERVING at once, ends open watch streams, forwarded lease
/// keep-alive streams and an election observer still waiting for etcd's first answer with
/// etcd's own `etcdserver: server stopped`, and refuses new ones; it is gone within its drain
/// timeout (a keep-alive stream held its connection open past it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_server_ends_its_watch_streams_as_a_stopping_etcd_does() {
    let client = shared_client().await;
    let p = unique_prefix("serve_drain");
    let options = CacheServerOptions::default().with_drain_timeout(Duration::from_secs(3));
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let server = start_server_with(&client, etcd.endpoints.clone(), &p, options).await;
    let address = server.local_addr().to_string();
    let via = connect([address.clone()]).await.expect("connect");
    let (_requests, mut watch) = via
        .watch_client()
        .watch(p.as_str(), Some(WatchOptions::new().with_prefix()))
        .await
        .expect("watch")
        .split();
    let created = watch.message().await.expect("stream").expect("open");
    assert!(created.created());
    let mut leases = via.lease_client();
    let lease = leases.grant(60, None).await.expect("grant").id();
    let (mut keeper, mut kept) = leases.keep_alive(lease).await.expect("keep-alive");
    keeper.keep_alive().await.expect("send a keep-alive");
    let answer = kept
        .message()
        .await
        .expect("keep-alive stream")
        .expect("answer");
    assert_eq!(answer.id(), lease);
    // An observer of an election with no leader: etcd sends it nothing yet, headers included.
    let mut elections = via.election_client();
    let election = format!("{p}election");
    let mut observing = Box::pin(async move { elections.observe(election).await.map(|_| ()) });
    // Driven until it is surely sent and forwarded: no answer comes without a leader.
    let early = tokio::time::timeout(Duration::from_millis(300), &mut observing).await;
    assert!(
        early.is_err(),
        "an observer with no leader was answered: {early:?}"
    );
    let started = tokio::time::Instant::now();
    let shutdown = tokio::spawn(server.shutdown());
    for (what, ended) in [
        (
            "the watch stream",
            tokio::time::timeout(WITHIN, watch.message())
                .await
                .map(|m| m.map(|_| ())),
        ),
        (
            "the forwarded keep-alive stream",
            tokio::time::timeout(WITHIN, kept.message())
                .await
                .map(|m| m.map(|_| ())),
        ),
        (
            "the forwarded observer of an election with no leader",
            tokio::time::timeout(WITHIN, observing).await,
        ),
    ] {
        match ended {
            Ok(Err(etcd_client::Error::GRpcStatus(status))) => assert_eq!(
                (status.code(), status.message()),
                (tonic::Code::Unavailable, "etcdserver: server stopped"),
                "{what}"
            ),
            other => panic!("{what} ended with {other:?}"),
        }
    }
    // A client closes a stream that failed (etcd-client's keeper would be dropped, clientv3
    // opens a new one): the connection can then close.
    drop(keeper);
    let _ = client.clone().lease_revoke(lease).await;
    shutdown.await.expect("shutdown");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "drained in {:?}, with nothing left open",
        started.elapsed()
    );
    let refused = tokio::time::timeout(Duration::from_secs(5), async {
        connect([address])
            .await?
            .kv_client()
            .get(p.as_str(), None)
            .await
    })
    .await;
    assert!(
        !matches!(refused, Ok(Ok(_))),
        "nothing is served after the drain: {refused:?}"
    );
}

/// The index of the server that holds the informer's watch (waits for one to).
async fn watched(servers: &[RunningServer]) -> usize {
    let deadline = tokio::time::Instant::now() + WITHIN;
    loop {
        if let Some(i) = servers.iter().position(|s| s.stats().watches > 0) {
            return i;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no server holds the informer's watch: {:?}",
            servers.iter().map(RunningServer::stats).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A wiped upstream is one store replacement to an informer behind two servers, also when it
/// moves to the other server after the wipe (each server lists the new store on its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wipe_is_one_replacement_whichever_server_the_informer_is_on() {
    let p = "/registry/replicas-wiped/";
    // A term the wiped store starts below, as in the one-server test of this case.
    let (etcd, client) = etcd_to_wipe(p).await;
    let options = CacheServerOptions::default().with_drain_timeout(Duration::from_secs(5));
    let mut servers = Vec::new();
    for _ in 0..2 {
        servers.push(start_server_with(&client, etcd.endpoints(), p, options.clone()).await);
    }
    let addresses: Vec<String> = servers.iter().map(|s| s.local_addr().to_string()).collect();
    let via = connect(addresses).await.expect("connect to the servers");
    let (informer, deleted, run) = synced_informer_logging_deletes(via, p).await;
    converges(&informer, &client, p, WITHIN).await;
    etcd.wipe().await.expect("wipe etcd");
    let client = etcd.client().await;
    for i in 0..10 {
        put(&client, &format!("{p}new{i}"), "new store").await;
    }
    converges(&informer, &client, p, Duration::from_secs(60)).await;
    // The informer moves to the other server, which may have listed the new store before or
    // after the one it was on.
    let drained = servers.remove(watched(&servers).await);
    drained.shutdown().await;
    for round in 0..3 {
        put(&client, &format!("{p}later{round}"), "new store").await;
        converges(&informer, &client, p, WITHIN).await;
    }
    let spurious: Vec<String> = deleted
        .lock()
        .expect("log")
        .iter()
        .filter(|k| !k.starts_with("old"))
        .cloned()
        .collect();
    let relists = informer.health().reflector.relists;
    assert!(
        spurious.is_empty() && relists.store_replaced == 1,
        "one store replacement for one wipe, and no delete for a key etcd never deleted: {relists:?}, deletes {spurious:?}"
    );
    informer.stop();
    let _ = run.await;
}
