//! Faults: a watcher that does not read, an upstream wiped, stopped or hung, and a relist of the
//! cache under open watches.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_that_does_not_read_holds_no_one_back_and_etcd_catches_it_up() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = shared_client().await;
    let p = unique_prefix("serve_slow");
    let options = CacheServerOptions::default()
        .with_history_revisions(10_000)
        .with_history_bytes(8 << 20);
    let server = start_server_with(&client, etcd.endpoints.clone(), &p, options).await;
    let endpoint = server.local_addr().to_string();
    // The slow client opens its watch and reads nothing.
    let slow = connect([endpoint.clone()]).await.expect("connect");
    // etcd catches a watch up in responses of up to 1,000 revisions, here over the client's
    // default 4 MiB: a client of etcd itself would need the same room.
    let (mut slow_requests, mut slow_responses) = slow
        .watch_client()
        .max_decoding_message_size(64 << 20)
        .watch(p.as_str(), Some(WatchOptions::new().with_prefix()))
        .await
        .expect("slow watch")
        .split();
    let created = slow_responses
        .message()
        .await
        .expect("stream")
        .expect("open");
    assert!(created.created(), "{created:?}");
    // A reader on another connection: 1,000 watches on one stream, of small values.
    let small = format!("{p}small/");
    let fast = connect([endpoint]).await.expect("connect");
    let (mut requests, mut responses) = fast
        .watch_client()
        .watch(small.as_str(), Some(WatchOptions::new().with_prefix()))
        .await
        .expect("fast watch")
        .split();
    for _ in 1..1000 {
        requests
            .watch(small.as_str(), Some(WatchOptions::new().with_prefix()))
            .await
            .expect("another watch");
    }
    let mut created = 0;
    while created < 1000 {
        let r = tokio::time::timeout(WITHIN, responses.message())
            .await
            .expect("created")
            .expect("stream")
            .expect("open");
        created += usize::from(r.created());
    }
    // Large values the slow watcher's connection cannot take, with a small one every tenth.
    let value = "x".repeat(16 * 1024);
    let big = |i: usize| format!("{p}big/k{}", i % 10);
    // Every revision the slow watcher is owed.
    let mut written = Vec::new();
    for i in 0..100 {
        written.push(put(&client, &big(i), &value).await);
        if i % 10 == 0 {
            written.push(put(&client, &format!("{small}k"), &i.to_string()).await);
        }
    }
    // Every fast watch gets every event, while the slow one reads nothing.
    let mut events = 0usize;
    while events < 10 * 1000 {
        let r = tokio::time::timeout(WITHIN, responses.message())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "the fast watcher is held back: {events} events; {:?}",
                    server.stats()
                )
            })
            .expect("stream")
            .expect("open");
        events += r.events().len();
    }
    assert_eq!(server.stats().slow_watches_forwarded, 0);
    // More large values than the history's 8 MiB hold: the slow watcher falls out of it.
    let writes = 400;
    for i in 0..writes {
        written.push(put(&client, &big(i), &value).await);
    }
    caught_up(&server, *written.last().expect("writes")).await;
    // Now the slow one reads: what fit in its buffers, then the rest from etcd, which still
    // holds it (nothing was compacted), as a client of etcd would get it: every revision, in
    // order, no gap, no repeat, no cancel. Once its watch has moved to etcd, it asks for
    // progress: the answer names a revision it has received every event up to.
    let mut delivered = Vec::new();
    let mut asked = false;
    let mut progress = None;
    while delivered.len() < written.len() || (asked && progress.is_none()) {
        let r = tokio::time::timeout(WITHIN, slow_responses.message())
            .await
            .unwrap_or_else(|_| panic!("the slow watcher hears: {} so far", delivered.len()))
            .expect("stream")
            .expect("open");
        assert!(!r.canceled(), "cancelled: {r:?}");
        assert!(!r.created(), "announced twice: {r:?}");
        if r.watch_id() == -1 {
            let revision = r.header().expect("header").revision();
            progress = Some((revision, delivered.len()));
            continue;
        }
        if !asked && server.stats().slow_watches_forwarded == 1 {
            slow_requests.request_progress().await.expect("progress");
            asked = true;
        }
        delivered.extend(
            r.events()
                .iter()
                .filter_map(|e| e.kv().map(|kv| kv.mod_revision())),
        );
    }
    assert_eq!(delivered, written, "every revision once, in order");
    let (revision, heard_before) = progress.expect("a progress answer");
    let owed = written.iter().filter(|&&w| w <= revision).count();
    assert!(
        owed <= heard_before,
        "progress at {revision} came after {heard_before} events, with {owed} at or below it"
    );
    assert_eq!(
        server.stats().slow_watches_forwarded,
        1,
        "only the slow watch"
    );
    // The fast ones are still open and hear the next small write, and so does the slow one.
    let after = put(&client, &format!("{small}k"), "after").await;
    let r = tokio::time::timeout(WITHIN, slow_responses.message())
        .await
        .expect("the slow watch goes on")
        .expect("stream")
        .expect("open");
    assert_eq!(
        r.events()
            .first()
            .and_then(|e| e.kv())
            .map(|kv| kv.mod_revision()),
        Some(after)
    );
    // Caught up, it is served from the cache again, and etcd no longer: no gap, no repeat.
    until_taken_back(
        &server,
        &client,
        &format!("{small}k"),
        &mut slow_responses,
        1,
    )
    .await;
    let mut more = Vec::new();
    for i in 0..20 {
        more.push(put(&client, &format!("{small}k"), &format!("more{i}")).await);
    }
    let mut heard_more = Vec::new();
    while heard_more.len() < more.len() {
        let r = tokio::time::timeout(WITHIN, slow_responses.message())
            .await
            .unwrap_or_else(|_| panic!("back in the cache, the watch hears {heard_more:?}"))
            .expect("stream")
            .expect("open");
        assert!(!r.canceled() && !r.created(), "{r:?}");
        heard_more.extend(event_revisions(&r));
    }
    assert_eq!(
        heard_more, more,
        "every revision once, in order, from the cache"
    );
    let mut heard = 0;
    while heard < 1000 {
        let r = tokio::time::timeout(WITHIN, responses.message())
            .await
            .expect("the fast watches are still open")
            .expect("stream")
            .expect("open");
        heard += r.events().len();
    }
    let (revisions, bytes) = (
        server.stats().history_revisions,
        server.stats().history_bytes,
    );
    assert!(
        bytes <= 8 << 20 && revisions < writes,
        "history bounded: {revisions}, {bytes}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_wipe_reaches_the_informer_through_the_server() {
    let etcd = private_etcd().await;
    let client = etcd.client().await;
    let p = "/registry/wiped/";
    for i in 0..10 {
        put(&client, &format!("{p}k{i}"), "before").await;
    }
    let server = start_server(&client, etcd.endpoints(), p).await;
    let via = connect([server.local_addr().to_string()])
        .await
        .expect("connect");
    let lw = EtcdListerWatcher::new(via, p, TextCodec).expect("source");
    let informer = SharedIndexInformer::new(lw, Default::default());
    let run = tokio::spawn(informer.clone().run());
    tokio::time::timeout(WITHIN, informer.wait_for_cache_sync())
        .await
        .expect("sync");
    converges(&informer, &client, p, WITHIN).await;
    etcd.wipe().await.expect("wipe etcd");
    let client = etcd.client().await;
    put(&client, &format!("{p}after"), "new store").await;
    converges(&informer, &client, p, Duration::from_secs(60)).await;
    informer.stop();
    let _ = run.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_and_watches_through_an_upstream_outage() {
    let etcd = private_etcd().await;
    let client = etcd.client().await;
    let p = "/registry/outage/";
    for i in 0..5 {
        put(&client, &format!("{p}k{i}"), "v").await;
    }
    // Serializable reads outlive etcd only as long as the client's access answer (5 s by
    // default); a long one keeps this test about the cache, whatever the stop takes.
    let options = CacheServerOptions::default()
        .with_read_timeout(Duration::from_secs(2))
        .with_access_ttl(Duration::from_secs(120));
    let server = start_server_with(&client, etcd.endpoints(), p, options).await;
    let via = connect([server.local_addr().to_string()])
        .await
        .expect("connect");
    let serializable = || Some(GetOptions::new().with_prefix().with_serializable());
    let linearizable = || Some(GetOptions::new().with_prefix());
    // An idle prefix while etcd moves on and compacts: a linearizable read still proves fresh.
    for i in 0..20 {
        put(&client, &format!("/elsewhere/k{i}"), "x").await;
    }
    let now = put(&client, "/elsewhere/last", "x").await;
    client
        .kv_client()
        .compact(now, None)
        .await
        .expect("compact");
    let started = tokio::time::Instant::now();
    let got = via
        .kv_client()
        .get(p, linearizable())
        .await
        .expect("linearizable read");
    assert_eq!(got.count(), 5);
    // Answered at all means proven within the read timeout (2 s), not waited out.
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "proved, not timed out"
    );
    assert_eq!(
        via.kv_client()
            .get(p, serializable())
            .await
            .expect("read")
            .count(),
        5
    );
    let (_w, mut watch) = watch_prefix(&via, p).await;
    // etcd stops: serializable reads still come from the cache; linearizable ones fail with
    // Unavailable within the read timeout instead of answering unproven.
    eventually("the server is ready", WITHIN, || server.is_ready()).await;
    etcd.stop().await.expect("stop etcd");
    eventually("the server reports itself not ready", WITHIN, || {
        !server.is_ready()
    })
    .await;
    let got = via.kv_client().get(p, serializable()).await;
    assert_eq!(
        got.expect("serializable read while etcd is down").count(),
        5
    );
    let started = tokio::time::Instant::now();
    match via.kv_client().get(p, linearizable()).await {
        Err(etcd_client::Error::GRpcStatus(s)) => {
            assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}")
        }
        other => panic!("a linearizable read with etcd down answered: {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(10));
    // etcd is back: the open watch hears the next write, and reads are proven again.
    etcd.start_again().await.expect("start etcd again");
    let client = etcd.client().await;
    let rev = put(&client, &format!("{p}back"), "again").await;
    let event = loop {
        let r = tokio::time::timeout(Duration::from_secs(60), watch.message())
            .await
            .expect("the watch hears after the outage")
            .expect("stream")
            .expect("open");
        if let Some(e) = r.events().first() {
            break e
                .kv()
                .map(|kv| (kv.key_str().unwrap_or("?").to_string(), kv.mod_revision()));
        }
    };
    assert_eq!(event, Some((format!("{p}back"), rev)));
    let got = via.kv_client().get(p, linearizable()).await.expect("read");
    assert_eq!(got.count(), 6);
    eventually("the server is ready again", WITHIN, || server.is_ready()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_upstream_fails_linearizable_reads_in_time_and_nothing_else() {
    let etcd = private_etcd().await;
    let client = etcd.client().await;
    let p = "/registry/hung/";
    put(&client, &format!("{p}k"), "v").await;
    // As above: the access answer outlives the hang.
    let options = CacheServerOptions::default()
        .with_read_timeout(Duration::from_secs(2))
        .with_access_ttl(Duration::from_secs(120));
    let server = start_server_with(&client, etcd.endpoints(), p, options).await;
    let via = connect([server.local_addr().to_string()])
        .await
        .expect("connect");
    let serializable = || Some(GetOptions::new().with_prefix().with_serializable());
    assert_eq!(
        via.kv_client()
            .get(p, serializable())
            .await
            .expect("read")
            .count(),
        1
    );
    let (_w, mut watch) = watch_prefix(&via, p).await;
    assert_eq!(grpc_health(&server).await, 1, "SERVING");
    // etcd hangs (SIGSTOP): it accepts connections and answers nothing.
    etcd.pause().expect("pause etcd");
    let got = tokio::time::timeout(WITHIN, via.kv_client().get(p, serializable())).await;
    assert_eq!(
        got.expect("no hang").expect("read from the cache").count(),
        1
    );
    let started = tokio::time::Instant::now();
    let mut kv = via.kv_client();
    let linearizable = kv.get(p, Some(GetOptions::new().with_prefix()));
    match tokio::time::timeout(WITHIN, linearizable)
        .await
        .expect("no hang")
    {
        Err(etcd_client::Error::GRpcStatus(s)) => {
            assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}")
        }
        other => panic!("a linearizable read with etcd hung answered: {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    eventually("the server reports itself not ready", WITHIN, || {
        !server.is_ready()
    })
    .await;
    assert_eq!(grpc_health(&server).await, 2, "NOT_SERVING");
    etcd.resume().expect("resume etcd");
    let rev = put(&client, &format!("{p}k"), "after").await;
    let heard = loop {
        let r = tokio::time::timeout(Duration::from_secs(60), watch.message())
            .await
            .expect("the watch hears after the hang")
            .expect("stream")
            .expect("open");
        if let Some(e) = r.events().first() {
            break e.kv().map(|kv| kv.mod_revision());
        }
    };
    assert_eq!(heard, Some(rev));
    eventually("the server is ready again", WITHIN, || server.is_ready()).await;
    assert_eq!(grpc_health(&server).await, 1, "SERVING again");
}

/// A 3-member cluster, a server that sees it through member 0 alone, and a watch of `p`
/// through the server; then, while member 0 is down, the prefix changes (`k1` changed, `k2`
/// deleted, `k4` created, and `more`) and etcd compacts past the changes: the server's watch
/// cannot resume, so its cache relists once member 0 is back.
async fn relisted_while_watched(
    p: &str,
    more: &[(&str, &str)],
) -> (
    etcd_informer::testing::etcd::EtcdCluster,
    Client,
    RunningServer,
    (
        etcd_client::WatchRequestSender,
        etcd_client::WatchResponseStream,
    ),
) {
    use etcd_informer::testing::etcd::EtcdCluster;
    let cluster = EtcdCluster::start(3)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let all = connect(cluster.endpoints()).await.expect("connect");
    let member = cluster.member_endpoint(0);
    let one = connect([member.clone()])
        .await
        .expect("connect to member 0");
    for k in ["k1", "k2", "k3"] {
        put(&all, &format!("{p}{k}"), "v1").await;
    }
    let server = start_server(&one, vec![member], p).await;
    let via = connect([server.local_addr().to_string()])
        .await
        .expect("connect");
    let (requests, mut watch) = via
        .watch_client()
        .watch(p, Some(WatchOptions::new().with_prefix().with_prev_key()))
        .await
        .expect("watch")
        .split();
    assert!(watch
        .message()
        .await
        .expect("stream")
        .expect("created")
        .created());
    cluster.stop_member(0).await.expect("stop member 0");
    let others = connect([cluster.member_endpoint(1), cluster.member_endpoint(2)])
        .await
        .expect("connect to members 1 and 2");
    common::put_accepted(&others, &format!("{p}k1"), "v2", WITHIN).await;
    delete(&others, &format!("{p}k2")).await;
    put(&others, &format!("{p}k4"), "v1").await;
    for (k, v) in more {
        put(&others, &format!("{p}{k}"), v).await;
    }
    let now = put(&others, "/registry/elsewhere", "x").await;
    others
        .kv_client()
        .compact(
            now,
            Some(etcd_client::CompactionOptions::new().with_physical()),
        )
        .await
        .expect("compact");
    cluster.restart_member(0).await.expect("restart member 0");
    (cluster, all, server, (requests, watch))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_watches_stay_open_through_a_relist_of_the_cache() {
    let p = "/registry/relisted/";
    let (_cluster, _all, server, (_requests, mut watch)) = relisted_while_watched(p, &[]).await;
    // The open watch stays open and receives the difference.
    let mut seen = std::collections::BTreeMap::new();
    while seen.len() < 3 {
        let r = tokio::time::timeout(Duration::from_secs(60), watch.message())
            .await
            .expect("the difference arrives")
            .expect("stream")
            .expect("open");
        assert!(!r.canceled(), "the watch stays open: {r:?}");
        for e in r.events() {
            let kv = e.kv().expect("kv");
            let value = kv.value_str().unwrap_or("").to_string();
            seen.insert(
                kv.key_str().unwrap_or("?").to_string(),
                (e.event_type(), value),
            );
        }
    }
    let want: std::collections::BTreeMap<_, _> = [
        (format!("{p}k1"), (EventType::Put, "v2".to_string())),
        (format!("{p}k2"), (EventType::Delete, String::new())),
        (format!("{p}k4"), (EventType::Put, "v1".to_string())),
    ]
    .into_iter()
    .collect();
    assert_eq!(seen, want);
    let relists = &server.health()[0].1.relists;
    assert!(relists.compacted >= 1, "the cache relisted: {relists:?}");
}

/// Issue 34, item 5: when a key was created and then changed while the server's watch was
/// down, the relist's difference would bring it as a put of version 2, and a client counting
/// keys by version (the informer's key tally) would count wrong: the open watch is cancelled
/// with `compact_revision` instead, as etcd cancels a watch below its compaction, with no
/// event of the difference; a list and a watch from its revision then follow etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relist_that_cannot_be_told_as_events_ends_open_watches_as_a_compaction_does() {
    let p = "/registry/relisted-twice/";
    let (_cluster, all, server, (mut requests, mut watch)) =
        relisted_while_watched(p, &[("k5", "v1"), ("k5", "v2")]).await;
    let cancelled = loop {
        let r = tokio::time::timeout(Duration::from_secs(60), watch.message())
            .await
            .expect("the relist reaches the watch")
            .expect("stream")
            .expect("open");
        assert!(r.events().is_empty(), "no difference as events: {r:?}");
        if r.canceled() {
            break r;
        }
    };
    assert!(cancelled.compact_revision() > 0, "{cancelled:?}");
    // Issue 53, item 7: etcd keeps the id of a watch it ended as compacted until the client
    // cancels it, and acknowledges that cancel (etcd-client waits for it).
    requests
        .cancel(cancelled.watch_id())
        .await
        .expect("send the cancel");
    let acknowledged = next_response("the cancel", &mut watch).await;
    assert_eq!(
        (acknowledged.watch_id(), acknowledged.canceled()),
        (cancelled.watch_id(), true),
        "{acknowledged:?}"
    );
    let via = connect([server.local_addr().to_string()])
        .await
        .expect("connect");
    let listed = via
        .kv_client()
        .get(p, Some(GetOptions::new().with_prefix()))
        .await
        .expect("list");
    let content: Vec<(String, String)> = listed
        .kvs()
        .iter()
        .map(|kv| {
            let key = kv
                .key_str()
                .unwrap_or("?")
                .trim_start_matches(p)
                .to_string();
            (key, kv.value_str().unwrap_or("").to_string())
        })
        .collect();
    let want = [("k1", "v2"), ("k3", "v1"), ("k4", "v1"), ("k5", "v2")]
        .map(|(k, v)| (k.to_string(), v.to_string()));
    assert_eq!(content, want);
    let from = listed.header().expect("header").revision() + 1;
    let (_requests, mut resumed) = via
        .watch_client()
        .watch(
            p,
            Some(WatchOptions::new().with_prefix().with_start_revision(from)),
        )
        .await
        .expect("watch from the list")
        .split();
    let rev = put(&all, &format!("{p}k6"), "v1").await;
    let heard = loop {
        let r = tokio::time::timeout(WITHIN, resumed.message())
            .await
            .expect("the new watch hears")
            .expect("stream")
            .expect("open");
        assert!(!r.canceled(), "{r:?}");
        if let Some(e) = r.events().first() {
            break e.kv().map(|kv| kv.mod_revision());
        }
    };
    assert_eq!(heard, Some(rev));
}

/// One client cannot make the server buffer without bound: a request above
/// `max_request_bytes` is refused before it is read whole (etcd refuses it too), and a client
/// that creates watches without reading its responses stalls only itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_requests_and_clients_that_never_read_are_bounded() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = shared_client().await;
    let p = unique_prefix("serve_bounds");
    let server = start_server(&client, etcd.endpoints.clone(), &p).await;
    let via = connect([server.local_addr().to_string()])
        .await
        .expect("connect to the cache server");
    let big = vec![b'x'; 3 << 20];
    let refused = via.kv_client().put(format!("{p}big"), big, None).await;
    assert!(refused.is_err(), "a 3 MiB put is refused: {refused:?}");

    // A watch stream whose client creates watches without reading a response.
    let mut watcher = via.clone();
    let (mut requests, _responses) = watcher
        .watch(
            p.as_str(),
            Some(etcd_client::WatchOptions::new().with_prefix()),
        )
        .await
        .expect("watch through the server")
        .split();
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counted = sent.clone();
    let key = format!("{p}k");
    let flood = tokio::spawn(async move {
        while counted.load(std::sync::atomic::Ordering::Relaxed) < 1_000_000
            && requests.watch(key.as_str(), None).await.is_ok()
        {
            counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    });
    // The server stops reading that stream; everyone else is served meanwhile.
    put(&client, &format!("{p}k"), "v").await;
    let got = via
        .kv_client()
        .get(format!("{p}k"), None)
        .await
        .expect("a read through the server while one client floods it");
    assert_eq!(got.kvs().len(), 1);
    // The flood stalls once the server's bound and the transport's windows are full.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut last = u64::MAX;
    loop {
        let now = sent.load(std::sync::atomic::Ordering::Relaxed);
        if now == last {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the flood never stalled: {now} sent"
        );
        last = now;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        last < 100_000,
        "{last} watch creations taken from a client that never reads"
    );
    flood.abort();
    server.shutdown().await;
}

/// etcd's raft term, asked of `client` (etcd directly, or the server: a Range of `prefix`).
async fn raft_term(client: &Client, prefix: &str) -> u64 {
    let resp = client
        .kv_client()
        .get(
            prefix,
            Some(GetOptions::new().with_prefix().with_count_only()),
        )
        .await
        .expect("count");
    resp.header().expect("header").raft_term()
}

/// Issue 34 item 5. Through the server, a wiped upstream is one store replacement, as it is
/// directly against etcd: the cache's answers never name the new store's identity with the
/// old store's keys, nor the old identity with the new keys. The upstream's raft term is
/// raised first (restarts), so that the new store's term is below it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_wipe_is_one_store_replacement_through_the_server() {
    let p = "/registry/wiped-once/";
    let (etcd, client) = etcd_to_wipe(p).await;
    let term_before = raft_term(&client, p).await;
    let server = start_server(&client, etcd.endpoints(), p).await;
    let via = connect([server.local_addr().to_string()])
        .await
        .expect("connect");
    let (informer, deleted, run) = synced_informer_logging_deletes(via.clone(), p).await;
    converges(&informer, &client, p, WITHIN).await;
    etcd.wipe().await.expect("wipe etcd");
    let client = etcd.client().await;
    let term_after = raft_term(&client, p).await;
    assert!(
        term_after < term_before,
        "the test needs a wipe that lowers the term: {term_before} -> {term_after}"
    );
    for i in 0..10 {
        put(&client, &format!("{p}new{i}"), "new store").await;
    }
    converges(&informer, &client, p, Duration::from_secs(60)).await;
    // Until the server's answers name the new store's term (the identity refresh), then
    // writes the informer hears after it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while raft_term(&via, p).await != term_after {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the server never named the new store's term {term_after}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for round in 0..2 {
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
    let replaced = informer.health().reflector.relists.store_replaced;
    assert!(
        spurious.is_empty() && replaced == 1,
        "one store replacement for one wipe, and no delete for a key etcd never deleted: {replaced} replacements, deletes {spurious:?}"
    );
    informer.stop();
    let _ = run.await;
}

/// A revision a connection was answered names the store it was answered in. After a wipe, the
/// connection's serializable reads are answered from the cache of the new store at once, not
/// held for the read timeout (5 s) waiting for a revision of the old store and then forwarded.
/// Before the connection's revisions were tied to the caches' content, each such read took
/// the read timeout and went to etcd, until the new store passed the old revision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_wipe_a_connection_waits_for_no_revision_of_the_old_store() {
    let p = "/registry/wiped-seen/";
    let (etcd, client) = etcd_to_wipe(p).await;
    let server = start_server(&client, etcd.endpoints(), p).await;
    let endpoint = server.local_addr().to_string();
    let via = connect([endpoint.clone()]).await.expect("connect");
    // Writes through the connection: it is answered revisions the new store will not reach.
    let mut seen = 0;
    for i in 0..40 {
        seen = put(&via, &format!("{p}conn{i}"), "old store").await;
    }
    let serializable = || Some(GetOptions::new().with_prefix().with_serializable());
    let keys = |resp: &etcd_client::GetResponse| -> Vec<String> {
        resp.kvs()
            .iter()
            .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
            .collect()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let read = via.kv_client().get(p, serializable()).await.expect("read");
    assert_eq!(
        keys(&read).len(),
        50,
        "the cache holds the old store's keys"
    );
    etcd.wipe().await.expect("wipe etcd");
    let client = etcd.client().await;
    let new_key = format!("{p}new");
    let written = put(&client, &new_key, "new store").await;
    assert!(
        written < seen,
        "the test needs a new store behind the old one: {written} >= {seen}"
    );
    // Until the server holds the new store, as a fresh connection reads it.
    let fresh = connect([endpoint]).await.expect("connect");
    loop {
        let read = fresh.kv_client().get(p, serializable()).await;
        if read
            .as_ref()
            .is_ok_and(|r| keys(r) == std::slice::from_ref(&new_key))
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the server never held the new store: {read:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let forwarded = server.stats().forwarded;
    for _ in 0..3 {
        let started = tokio::time::Instant::now();
        let read = via
            .kv_client()
            .get(p, serializable())
            .await
            .expect("a serializable read on the old connection");
        let took = started.elapsed();
        assert_eq!(keys(&read), std::slice::from_ref(&new_key));
        assert!(
            took < Duration::from_secs(2),
            "a serializable read on a connection answered revision {seen} of the old store took {took:?}"
        );
    }
    assert_eq!(
        server.stats().forwarded,
        forwarded,
        "the reads were answered from the cache"
    );
}

/// How a client's watch of `key` ends or starts: its error's code, or whether etcd created and
/// cancelled it and why.
async fn watch_outcome(client: &Client, key: &str) -> String {
    let watched = client.watch_client().watch(key, None).await;
    let mut stream = match watched {
        Err(etcd_client::Error::GRpcStatus(s)) => return format!("error {:?}", s.code()),
        Err(other) => panic!("{other:?}"),
        Ok(watch) => watch.split().1,
    };
    match tokio::time::timeout(WITHIN, stream.message()).await {
        Err(_) => "no answer".into(),
        Ok(Err(etcd_client::Error::GRpcStatus(s))) => format!("error {:?}", s.code()),
        Ok(Err(other)) => panic!("{other:?}"),
        Ok(Ok(None)) => "ended".into(),
        Ok(Ok(Some(r))) => format!(
            "created {} cancelled {} ({})",
            r.created(),
            r.canceled(),
            r.cancel_reason()
        ),
    }
}

/// A private etcd with `{p}a` = "1" and a user root (password "rootpwd", role root), auth
/// still off; and a client of it.
async fn etcd_with_root(p: &str) -> (EtcdServer, Client) {
    let etcd = private_etcd().await;
    let client = etcd.client().await;
    put(&client, &format!("{p}a"), "1").await;
    let mut auth = client.auth_client();
    auth.user_add("root", "rootpwd", None)
        .await
        .expect("user add");
    auth.user_grant_role("root", "root")
        .await
        .expect("grant root");
    (etcd, client)
}

/// Waits until the server's gRPC health check says `want` (1 SERVING, 2 NOT_SERVING), at most
/// `within` (then fails with `what`); returns how long it took.
async fn until_health(server: &RunningServer, want: i32, within: Duration, what: &str) -> Duration {
    let started = std::time::Instant::now();
    loop {
        let health = grpc_health(server).await;
        if health == want {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < within,
            "{what}: still {health} after {:?}",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// etcd's auth turned on while a server without credentials of its own runs (issue 34, item
/// 13): etcd cancels the server's own watch and refuses its lists. The server then says so in
/// its health check, ends the watches it served from the cache (their clients watch again,
/// through etcd), and forwards every read, so that root's reads see root's writes; token-less
/// clients get etcd's answers. Once auth is off again it serves from its cache again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_turned_on_while_serving() {
    let p = "/registry/auth/";
    let (etcd, client) = etcd_with_root(p).await;
    let mut auth = client.auth_client();
    let server = start_server(&client, etcd.endpoints(), p).await;
    let via_addr = server.local_addr().to_string();
    let via = connect([via_addr.clone()]).await.expect("connect");
    let (_keep, mut served_watch) = watch_prefix(&via, p).await;
    assert_eq!(grpc_health(&server).await, 1);

    auth.auth_enable().await.expect("auth enable");
    let root = etcd_client::ConnectOptions::new().with_user("root", "rootpwd");
    let root_direct = Client::connect(etcd.endpoints(), Some(root.clone()))
        .await
        .expect("root on etcd");
    let root_via = Client::connect([via_addr.clone()], Some(root))
        .await
        .expect("root through the server");
    // Issue 53, item 4: root reads at once, before the server has noticed that etcd refuses
    // it: the consistent-read proof is refused to the server (it has no user), not to root,
    // whose read is forwarded with its token (before: "consistent-read proof failed: ...
    // user name is empty", where etcd answers).
    let at_once = root_via.kv_client().get(format!("{p}a"), None).await;
    let direct = root_direct.kv_client().get(format!("{p}a"), None).await;
    assert_eq!(
        at_once
            .map(|r| r.kvs()[0].value().to_vec())
            .map_err(|e| e.to_string()),
        direct
            .map(|r| r.kvs()[0].value().to_vec())
            .map_err(|e| e.to_string()),
        "a linearizable read as root right after auth is turned on"
    );

    // The watch the server served from its cache ends, with the reason.
    let ended = tokio::time::timeout(WITHIN, async {
        loop {
            match served_watch.message().await {
                Ok(Some(r)) if r.canceled() => return format!("cancelled: {}", r.cancel_reason()),
                Ok(Some(_)) => continue,
                other => return format!("{other:?}"),
            }
        }
    })
    .await
    .expect("the served watch ends once etcd refuses the server's own watch");
    assert!(ended.contains("refuses"), "{ended}");
    until_health(
        &server,
        2,
        Duration::from_secs(10),
        "NOT_SERVING while etcd refuses the server",
    )
    .await;

    // root writes and reads through the server as on etcd.
    root_via
        .kv_client()
        .put(format!("{p}a"), "2", None)
        .await
        .expect("root's put through the server");
    for serializable in [false, true] {
        let options = serializable.then(|| GetOptions::new().with_serializable());
        let read = |c: &Client| {
            let (c, key, options) = (c.clone(), format!("{p}a"), options.clone());
            async move {
                let r = c.kv_client().get(key, options).await.expect("root's get");
                r.kvs().first().map(|kv| kv.value().to_vec())
            }
        };
        assert_eq!(read(&root_via).await, Some(b"2".to_vec()), "{serializable}");
        assert_eq!(read(&root_via).await, read(&root_direct).await);
    }
    // Token-less clients get etcd's own answers.
    let tokenless_get = |c: &Client| {
        let c = c.clone();
        let key = format!("{p}a");
        async move { outcome(c.kv_client().get(key, None).await) }
    };
    assert_eq!(tokenless_get(&via).await, tokenless_get(&client).await);
    assert_eq!(
        watch_outcome(&via, &format!("{p}a")).await,
        watch_outcome(&client, &format!("{p}a")).await
    );

    // A server whose own client is root keeps following etcd: it serves from its cache, and
    // token-less clients still get etcd's refusals (item 13: a watch's code too).
    let with_user = start_server(&root_direct, etcd.endpoints(), p).await;
    let via_root_server = connect([with_user.local_addr().to_string()])
        .await
        .expect("connect");
    assert_eq!(grpc_health(&with_user).await, 1);
    assert_eq!(
        tokenless_get(&via_root_server).await,
        tokenless_get(&client).await
    );
    let direct_watch = watch_outcome(&client, &format!("{p}a")).await;
    assert_eq!(
        watch_outcome(&via_root_server, &format!("{p}a")).await,
        direct_watch
    );
    with_user.shutdown().await;

    // Auth off again: the server follows etcd again and serves from its cache.
    root_direct
        .auth_client()
        .auth_disable()
        .await
        .expect("auth disable");
    until_health(
        &server,
        1,
        Duration::from_secs(20),
        "SERVING once etcd accepts the server again",
    )
    .await;
    let rev = put(&client, &format!("{p}a"), "3").await;
    caught_up(&server, rev).await;
    let before = server.stats().ranges_from_cache;
    let got = via
        .kv_client()
        .get(format!("{p}a"), Some(GetOptions::new().with_serializable()))
        .await
        .expect("get");
    assert_eq!(got.kvs()[0].value(), b"3");
    assert!(server.stats().ranges_from_cache > before);
}

/// etcd's auth turned off again after refusing the server for 20 s (its reflector's backoff
/// stretched past 6 s by then): the server serves from its cache again within seconds, since a
/// token-less read etcd answers cuts the backoff short. Before, it forwarded every read until
/// the backoff ran out (up to 30 s). etcd compacted its history meanwhile (as etcd-client's
/// own suite does right after its auth tests), so the server's watch must relist: that relist
/// does not wait out the backoff the refusals stretched either (CI saw the cache stuck for
/// more than 20 s, every read failing "the cache did not reach etcd's revision").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_turned_off_again_is_served_from_the_cache_within_seconds() {
    let p = "/registry/auth-off/";
    let (etcd, client) = etcd_with_root(p).await;
    let mut auth = client.auth_client();
    let server = start_server(&client, etcd.endpoints(), p).await;
    assert_eq!(grpc_health(&server).await, 1);
    auth.auth_enable().await.expect("auth enable");
    until_health(
        &server,
        2,
        Duration::from_secs(10),
        "NOT_SERVING while etcd refuses the server",
    )
    .await;
    // The refusals go on long enough for the backoff between attempts to grow past 6 s.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let root = etcd_client::ConnectOptions::new().with_user("root", "rootpwd");
    let mut root = Client::connect(etcd.endpoints(), Some(root))
        .await
        .expect("root on etcd");
    let put = root.put(format!("{p}b"), "2", None).await.expect("put");
    let compacted = put.header().expect("header").revision();
    root.compact(compacted, None).await.expect("compact");
    root.auth_client()
        .auth_disable()
        .await
        .expect("auth disable");
    let started = std::time::Instant::now();
    // 0.9 s alone, over 3 s once in CI among the binary's other tests; without the fix, the
    // relist waits out the next delay of a backoff stretched this far: 12.8 s at least.
    let within = Duration::from_secs(10);
    let took = until_health(
        &server,
        1,
        within,
        "serving from its cache within 10 s after auth was turned off",
    )
    .await;
    println!("SERVING again {took:?} after auth was turned off");
    let via = connect([server.local_addr().to_string()])
        .await
        .expect("connect");
    // The write made while etcd refused the server, read from the cache (a serializable read
    // answered from a cache that stopped at its old revision would lack it).
    loop {
        let before = server.stats().ranges_from_cache;
        let got = via
            .kv_client()
            .get(format!("{p}b"), Some(GetOptions::new().with_serializable()))
            .await
            .expect("get");
        if server.stats().ranges_from_cache > before
            && got.kvs().first().map(|kv| kv.value()) == Some(b"2")
        {
            break;
        }
        assert!(
            started.elapsed() < within,
            "the write made before auth was turned off is not served from the cache within {within:?}: {:?}",
            server.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "the cache past etcd's compaction {:?} after auth was turned off",
        started.elapsed()
    );
}

/// Issue 34, item 10: a watch's creation waits for etcd's answer on the client's access
/// without holding back the stream's other watches. With etcd unreachable for the server's
/// checks (a partition in front of its upstream channel, its cache still following etcd),
/// watch A hears its next event at once, while B, created before that event on the same
/// stream, is answered only when its check gives up (1 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_creation_waiting_for_etcd_holds_back_no_other_watch_of_its_stream() {
    use etcd_informer::testing::etcd::TcpProxy;
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = shared_client().await;
    let p = unique_prefix("serve_creation");
    let proxy = TcpProxy::start(&etcd.endpoints[0]).await.expect("proxy");
    // The cache follows etcd on `client`; access checks and forwards go through the proxy.
    let server = start_server(&client, vec![proxy.endpoint()], &p).await;
    let via = connect([server.local_addr().to_string()])
        .await
        .expect("connect");
    let (mut requests, mut responses) = via
        .watch_client()
        .watch(format!("{p}a/"), Some(WatchOptions::new().with_prefix()))
        .await
        .expect("watch A")
        .split();
    let created = responses.message().await.expect("stream").expect("open");
    assert!(created.created());
    let a = created.watch_id();
    proxy.cut();
    requests
        .watch(format!("{p}b/"), Some(WatchOptions::new().with_prefix()))
        .await
        .expect("create B");
    let rev = put(&client, &format!("{p}a/1"), "v").await;
    let first = tokio::time::timeout(WITHIN, responses.message())
        .await
        .expect("an answer")
        .expect("stream")
        .expect("open");
    assert_eq!(
        (first.watch_id(), first.events().len(), first.created()),
        (a, 1, false),
        "A's event comes before B's answer: {first:?}"
    );
    assert_eq!(
        first.events()[0].kv().map(|kv| kv.mod_revision()),
        Some(rev)
    );
    let second = tokio::time::timeout(WITHIN, responses.message())
        .await
        .expect("B's answer")
        .expect("stream")
        .expect("open");
    assert!(
        second.created() && second.canceled(),
        "B is refused while its access cannot be checked: {second:?}"
    );
    proxy.heal();
    server.shutdown().await;
}

/// Issue 34, item 10: a client that asks for a leader (`hasleader` metadata, etcd-client's
/// `with_require_leader`) is refused as etcd refuses it once its member has lost the leader:
/// its open watch stream ends, and a read fails, with `etcdserver: no leader`; through the
/// server the "member" is its upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_requires_a_leader_hears_when_there_is_none_as_from_etcd() {
    use etcd_informer::testing::etcd::EtcdCluster;
    let cluster = EtcdCluster::start(3)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let member = cluster.member_endpoint(0);
    let one = connect([member.clone()])
        .await
        .expect("connect to member 0");
    let p = "/registry/leader/";
    put(&one, &format!("{p}a"), "1").await;
    let mut options = CacheServerOptions::default();
    options.identity_refresh = Duration::from_millis(100);
    let server = start_server_with(&one, vec![member.clone()], p, options).await;
    let require_leader = || etcd_client::ConnectOptions::new().with_require_leader(true);
    let direct = Client::connect([member], Some(require_leader()))
        .await
        .expect("connect to member 0");
    let via = Client::connect([server.local_addr().to_string()], Some(require_leader()))
        .await
        .expect("connect to the server");
    let mut streams = Vec::new();
    for client in [&direct, &via] {
        let (requests, mut responses) = client
            .watch_client()
            .watch(p, Some(WatchOptions::new().with_prefix()))
            .await
            .expect("watch")
            .split();
        let created = responses.message().await.expect("stream").expect("open");
        assert!(created.created());
        streams.push((requests, responses));
    }
    cluster.stop_member(1).await.expect("stop member 1");
    cluster.stop_member(2).await.expect("stop member 2");
    let mut ended = Vec::new();
    for (_, responses) in &mut streams {
        let end = tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                match responses.message().await {
                    Ok(Some(_)) => continue,
                    other => return outcome(other),
                }
            }
        })
        .await
        .expect("the stream ends once the member has no leader");
        ended.push(end);
    }
    assert_eq!(ended[0], "Unavailable etcdserver: no leader", "etcd");
    assert_eq!(ended[1], ended[0], "through the server");
    let read = |c: &Client| {
        let c = c.clone();
        async move { outcome(c.kv_client().get(format!("{p}a"), None).await) }
    };
    assert_eq!(read(&direct).await, "Unavailable etcdserver: no leader");
    let serializable = via
        .kv_client()
        .get(format!("{p}a"), Some(GetOptions::new().with_serializable()))
        .await;
    match serializable {
        Err(etcd_client::Error::GRpcStatus(s)) => {
            assert_eq!(s.message(), "etcdserver: no leader", "{s:?}")
        }
        other => panic!("a read that requires a leader through the server: {other:?}"),
    }
    server.shutdown().await;
}

/// Issue 53, item 1: an upstream that does not answer for a while (paused 11 s: its Status
/// times out) has said nothing of its leader; etcd's own member, paused as long, ends no
/// `hasleader` watch, and neither does the server (it ended every one at the first
/// unanswered Status).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_that_requires_a_leader_rides_an_upstream_that_pauses() {
    let etcd = EtcdServer::start().await.unwrap_or_else(|e| panic!("{e}"));
    let client = connect([etcd.endpoint()]).await.expect("connect");
    let p = "/registry/paused/";
    put(&client, &format!("{p}a"), "1").await;
    let mut options = CacheServerOptions::default();
    options.identity_refresh = Duration::from_millis(500);
    let server = start_server_with(&client, etcd.endpoints(), p, options).await;
    let require_leader = etcd_client::ConnectOptions::new().with_require_leader(true);
    let via = Client::connect([server.local_addr().to_string()], Some(require_leader))
        .await
        .expect("connect to the server");
    let (_requests, mut responses) = via
        .watch_client()
        .watch(p, Some(WatchOptions::new().with_prefix()))
        .await
        .expect("watch")
        .split();
    let created = responses.message().await.expect("stream").expect("open");
    assert!(created.created());
    etcd.pause().expect("pause etcd");
    tokio::time::sleep(Duration::from_secs(11)).await;
    etcd.resume().expect("resume etcd");
    put(&client, &format!("{p}b"), "2").await;
    let heard = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match responses.message().await {
                Ok(Some(resp)) => {
                    if resp.events().iter().any(|e| {
                        e.kv()
                            .is_some_and(|kv| kv.key() == format!("{p}b").as_bytes())
                    }) {
                        return Ok(());
                    }
                }
                other => return Err(outcome(other)),
            }
        }
    })
    .await
    .expect("the watch delivers the put after the pause");
    assert_eq!(heard, Ok(()), "the watch went on");
    server.shutdown().await;
}

/// Issue 37 (via issue 34): servers in front of one store must never show a client its raft
/// term going back, which a client takes for a restored store (the informer relists and
/// retires every key). A server's Status is read every few seconds, so after an election a
/// server could name the old term while another already names the new one: a linearizable
/// read through it now names the term its consistent-read proof saw, as etcd's would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_linearizable_read_names_the_clusters_term_now() {
    use etcd_informer::testing::etcd::EtcdCluster;
    let cluster = EtcdCluster::start(3)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let leader = cluster.leader_index().await.expect("a leader");
    let m = (leader + 1) % 3;
    let member = cluster.member_endpoint(m);
    let client = connect([member.clone()]).await.expect("connect");
    let p = "/registry/term/";
    put(&client, &format!("{p}a"), "1").await;
    // A Status read once an hour, and no probe of the server's own watch meanwhile: only the
    // proof can tell the server of the new term.
    let mut options = CacheServerOptions::default();
    options.identity_refresh = Duration::from_secs(3600);
    options.etcd = options
        .etcd
        .clone()
        .with_progress_interval(Duration::from_secs(600))
        .with_idle_timeout(Duration::from_secs(1200));
    let server = start_server_with(&client, vec![member], p, options).await;
    let via = connect([server.local_addr().to_string()])
        .await
        .expect("connect");
    let term = |c: &Client| {
        let c = c.clone();
        async move {
            let r = c.kv_client().get(format!("{p}a"), None).await;
            r.ok().and_then(|r| r.header().map(|h| h.raft_term()))
        }
    };
    let before = term(&client).await.expect("etcd's term");
    assert_eq!(term(&via).await, Some(before));
    cluster.stop_member(leader).await.expect("stop the leader");
    let deadline = tokio::time::Instant::now() + WITHIN;
    let after = loop {
        if let Some(t) = term(&client).await.filter(|&t| t > before) {
            break t;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "a new leader in time"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(term(&via).await, Some(after), "etcd is at term {after}");
    server.shutdown().await;
}

/// A client that never reads its forwarded watches and snapshots stalls only itself, as
/// against etcd, where only its own connection fills: every other client's forwarded calls go
/// on. (With one upstream connection for every client, another client's put hung beside 4
/// unread snapshots, and after 28 MiB of watch responses left unread.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_its_forwarded_watches_stalls_no_one_else() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = shared_client().await;
    let p = unique_prefix("serve_stall");
    let server = start_server(&client, etcd.endpoints.clone(), &p).await;
    let server_endpoint = server.local_addr().to_string();
    for (way, endpoint) in [
        ("etcd", etcd.endpoints[0].clone()),
        ("the server", server_endpoint),
    ] {
        // Keys outside the served prefix: their watches and writes are forwarded.
        let q = unique_prefix("serve_stall_outside");
        let stalled = connect([endpoint.clone()]).await.expect("connect");
        let (mut requests, _responses) = stalled
            .watch_client()
            .watch(format!("{q}big0"), None)
            .await
            .expect("forwarded watch")
            .split();
        for i in 1..4 {
            requests
                .watch(format!("{q}big{i}").as_str(), None)
                .await
                .expect("another forwarded watch on the stream");
        }
        let other = connect([endpoint]).await.expect("connect");
        let big = vec![b'x'; 1 << 20];
        // Snapshots it does not read either (of a store of at least 4 MiB): forwarded streams
        // of the Maintenance service.
        let mut snapshots = Vec::new();
        for i in 0..4 {
            client
                .kv_client()
                .put(format!("{q}big{i}"), big.clone(), None)
                .await
                .expect("a 1 MiB put to etcd");
        }
        for _ in 0..4 {
            let snapshot = stalled.maintenance_client().snapshot().await;
            snapshots.push(snapshot.expect("a snapshot"));
        }
        // Another client's forwarded put, within 10 s.
        let neighbour_put = || {
            let (other, key) = (other.clone(), format!("{q}small"));
            async move {
                let mut kv = other.kv_client();
                tokio::time::timeout(Duration::from_secs(10), kv.put(key, "v", None)).await
            }
        };
        let forwarded = neighbour_put().await;
        assert!(
            matches!(forwarded, Ok(Ok(_))),
            "{way}: another client's put beside unread snapshots: {forwarded:?}",
        );
        for round in 0..12 {
            for i in 0..4 {
                client
                    .kv_client()
                    .put(format!("{q}big{i}"), big.clone(), None)
                    .await
                    .expect("a 1 MiB put to etcd");
            }
            let forwarded = neighbour_put().await;
            assert!(
                matches!(forwarded, Ok(Ok(_))),
                "{way}, round {round}: another client's put, after {} MiB its neighbour never \
                 read: {forwarded:?}",
                (round + 1) * 4
            );
        }
        if way == "the server" {
            assert_eq!(
                server.stats().client_upstreams,
                1,
                "the one client connection with forwarded streams has an upstream of its own"
            );
        }
        // Their watches' values are no longer needed in etcd's store.
        client
            .kv_client()
            .delete(
                q.as_str(),
                Some(etcd_client::DeleteOptions::new().with_prefix()),
            )
            .await
            .expect("delete");
    }
    // The stalled client is gone, and so is its upstream channel.
    let deadline = tokio::time::Instant::now() + WITHIN;
    while server.stats().client_upstreams != 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the upstream channel outlived its client connection"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server.shutdown().await;
}

/// A watch that falls out of the history after its stream's token expired goes on, as it goes
/// on straight on etcd, which checks a watch's permission once, when it is created: the
/// server forwards the rest of it as its own user (`upstream_user`), not with the client's
/// expired token (simple tokens, here with a TTL of 2 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_moved_out_of_the_history_outlives_its_clients_token() {
    use etcd_informer::testing::etcd::ServerOptions;
    // Tokens last 2 s unused: the server's own watch stream, which probes itself after 1 s of
    // silence, keeps its token; the reader's, unused, expires.
    let options = ServerOptions::default().with_extra_args(vec!["--auth-token-ttl=2".into()]);
    let etcd = EtcdServer::start_with(options)
        .await
        .unwrap_or_else(|e| panic!("cannot start etcd (set ETCD_BIN or put etcd on PATH): {e}"));
    let p = "/registry/moved/";
    let admin = etcd.client().await;
    let mut auth = admin.auth_client();
    auth.user_add("root", "rootpw", None).await.expect("root");
    auth.user_grant_role("root", "root").await.expect("root");
    auth.role_add("reader").await.expect("role");
    auth.role_grant_permission("reader", etcd_client::Permission::read(p).with_prefix())
        .await
        .expect("grant");
    auth.user_add("reader", "readerpw", None)
        .await
        .expect("reader");
    auth.user_grant_role("reader", "reader")
        .await
        .expect("grant");
    auth.auth_enable().await.expect("auth enable");
    let as_user = |name: &str, password: &str, endpoint: String| {
        // Tokens expire within seconds here: the writer and the server's own client get new
        // ones.
        let options = etcd_client::ConnectOptions::new()
            .with_user(name, password)
            .with_auto_token_refresh(name == "root");
        async move {
            Client::connect([endpoint], Some(options))
                .await
                .expect("connect")
        }
    };
    let root = as_user("root", "rootpw", etcd.endpoint()).await;
    let options = CacheServerOptions::default()
        .with_history_bytes(256 << 10)
        .with_upstream_user("root", "rootpw");
    let server = start_server_with(&root, etcd.endpoints(), p, options).await;
    let value = "x".repeat(64 * 1024);
    for (name, endpoint) in [
        ("etcd", etcd.endpoint()),
        ("the cache server", server.local_addr().to_string()),
    ] {
        let reader = as_user("reader", "readerpw", endpoint).await;
        let (_requests, mut responses) = reader
            .watch_client()
            .max_decoding_message_size(64 << 20)
            .watch(p, Some(WatchOptions::new().with_prefix()))
            .await
            .expect("watch")
            .split();
        assert!(next_response(name, &mut responses).await.created());
        // The reader's token expires unused (TTL 2 s): a new request with it is refused.
        tokio::time::sleep(Duration::from_secs(4)).await;
        let refused = outcome(reader.kv_client().get(p, None).await);
        assert!(
            refused.contains("invalid auth token"),
            "{name}: the test needs an expired token: {refused}"
        );
        // Then 12.8 MB while the client reads nothing: more than its stream's buffers take
        // (2 MiB of window, 16 responses), and responses that batch revisions past the
        // history's 256 KiB put the watch out of it at once.
        let moved = server.stats().slow_watches_forwarded;
        let mut written = Vec::new();
        for i in 0..200 {
            written.push(put(&root, &format!("{p}k{}", i % 10), &value).await);
        }
        caught_up(&server, *written.last().expect("writes")).await;
        let mut delivered = Vec::new();
        while delivered.len() < written.len() {
            let r = next_response(name, &mut responses).await;
            assert!(!r.canceled(), "{name}: cancelled: {r:?}");
            delivered.extend(
                r.events()
                    .iter()
                    .filter_map(|e| e.kv().map(|kv| kv.mod_revision())),
            );
        }
        if name != "etcd" {
            let now = server.stats().slow_watches_forwarded;
            assert!(now > moved, "the watch never fell out of the history");
        }
        assert_eq!(delivered, written, "{name}: every revision once, in order");
    }
}

/// etcd forgets its simple tokens when it restarts: the server's own watch, opened again with
/// its old token, is refused once. The server renews its token and goes on with its served
/// watches, rather than taking that for a refusal of its credentials and ending them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_etcd_forgot_is_renewed_and_served_watches_go_on() {
    let etcd = private_etcd().await;
    let p = "/registry/forgotten/";
    let mut auth = etcd.client().await.auth_client();
    auth.user_add("root", "rootpw", None).await.expect("root");
    auth.user_grant_role("root", "root").await.expect("root");
    auth.auth_enable().await.expect("auth enable");
    let as_root = |endpoints: Vec<String>| async move {
        let options = etcd_client::ConnectOptions::new()
            .with_user("root", "rootpw")
            .with_auto_token_refresh(true);
        Client::connect(endpoints, Some(options))
            .await
            .expect("connect as root")
    };
    let root = as_root(etcd.endpoints()).await;
    let options = CacheServerOptions::default().with_upstream_user("root", "rootpw");
    let server = start_server_with(&root, etcd.endpoints(), p, options).await;
    let via = as_root(vec![server.local_addr().to_string()]).await;
    let (_requests, mut responses) = watch_prefix(&via, p).await;
    let name = "the served watch";
    let first = put(&root, &format!("{p}a"), "before").await;
    assert_eq!(
        event_revisions(&next_response(name, &mut responses).await),
        [first]
    );
    etcd.restart().await.expect("restart etcd");
    for i in 0..5 {
        let written = put(&root, &format!("{p}a"), &i.to_string()).await;
        let r = next_response(name, &mut responses).await;
        assert!(
            !r.canceled(),
            "cancelled after etcd forgot the tokens: {r:?}"
        );
        assert_eq!(event_revisions(&r), [written]);
    }
}

/// Issue 53, item 7: a create etcd refuses for the client's access takes no watch id: the
/// next create with an automatic id gets the one the refused create would have had, as from
/// etcd (whose answer to the refusal is -1, or the id asked for in older releases), both for a
/// range served from the cache and for one forwarded to etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_create_takes_no_watch_id() {
    let p = "/registry/ids/";
    let (etcd, client) = etcd_with_root(p).await;
    let mut auth = client.auth_client();
    auth.role_add("ok-reader").await.expect("role add");
    auth.role_grant_permission(
        "ok-reader",
        etcd_client::Permission::read(format!("{p}ok/")).with_prefix(),
    )
    .await
    .expect("grant");
    auth.user_add("limited", "pwd", None).await.expect("user");
    auth.user_grant_role("limited", "ok-reader")
        .await
        .expect("grant role");
    auth.auth_enable().await.expect("auth enable");
    let root = etcd_client::ConnectOptions::new().with_user("root", "rootpwd");
    let root_direct = Client::connect(etcd.endpoints(), Some(root))
        .await
        .expect("root on etcd");
    // A server that is root follows etcd, and serves the prefix from its cache.
    let server = start_server(&root_direct, etcd.endpoints(), p).await;
    let limited = || Some(etcd_client::ConnectOptions::new().with_user("limited", "pwd"));
    let direct = Client::connect(etcd.endpoints(), limited())
        .await
        .expect("limited on etcd");
    let via = Client::connect([server.local_addr().to_string()], limited())
        .await
        .expect("limited through the server");
    let mut seen = Vec::new();
    for (name, target) in [("etcd", &direct), ("the cache server", &via)] {
        let (mut requests, mut responses) = watch_prefix(target, &format!("{p}ok/")).await;
        let mut answers = Vec::new();
        for key in [
            format!("{p}secret"),
            format!("{p}ok/a"),
            "/registry/elsewhere".to_owned(),
            format!("{p}ok/b"),
        ] {
            requests.watch(key, None).await.expect("send");
            let r = next_response(name, &mut responses).await;
            answers.push((r.watch_id(), r.created(), r.canceled()));
        }
        seen.push(answers);
    }
    assert_eq!(seen[0], seen[1], "etcd (left) and the cache server (right)");
    let ids: Vec<i64> = seen[0].iter().filter(|a| !a.2).map(|a| a.0).collect();
    assert_eq!(ids, [1, 2], "{:?}", seen[0]);
}

/// Issue 53, item 3: a stream's last word (here the drain's "server stopped") goes after what
/// the client has not read yet, within the drain timeout: a client whose buffers are full
/// reads every event it was sent and then the error, which tells clientv3 to go to another
/// server. Before, the word was dropped when the buffer was full and the stream ended with
/// OK, which clientv3 takes as final.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_stream_ends_with_its_reason_after_what_the_client_had_not_read() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = shared_client().await;
    let p = unique_prefix("serve_last_word");
    // The history holds every event: the watch is served from the cache. The drain leaves
    // the client a minute to read 48 MiB: a debug build beside the other tests of this binary
    // on 2 cores read 18 MiB in 15 s once, and the stream was cut.
    let options = CacheServerOptions::default()
        .with_history_bytes(256 << 20)
        .with_drain_timeout(Duration::from_secs(60));
    let server = start_server_with(&client, etcd.endpoints.clone(), &p, options).await;
    let from = put(&client, &format!("{p}first"), "x").await;
    // 48 MiB of events: more than the stream's buffer and the transport's windows hold.
    let value = "v".repeat(16 << 10);
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let (client, p, value) = (client.clone(), p.clone(), value.clone());
            tokio::spawn(async move {
                for i in 0..768 {
                    put(&client, &format!("{p}{w}/{i}"), &value).await;
                }
            })
        })
        .collect();
    for writer in writers {
        writer.await.expect("writer");
    }
    let last = put(&client, &format!("{p}last"), "x").await;
    caught_up(&server, last).await;
    let via = connect([server.local_addr().to_string()])
        .await
        .expect("connect to the cache server");
    let (_requests, mut responses) = via
        .watch_client()
        .max_decoding_message_size(64 << 20)
        .watch(
            p.as_str(),
            Some(WatchOptions::new().with_prefix().with_start_revision(from)),
        )
        .await
        .expect("watch")
        .split();
    let created = next_response("created", &mut responses).await;
    assert!(created.created());
    // The client reads nothing until its stream is full (the server sends nothing more),
    // and then the drain begins.
    let deadline = std::time::Instant::now() + WITHIN;
    let mut sent = u64::MAX;
    loop {
        assert_eq!(
            server.stats().slow_watches_forwarded,
            0,
            "served from the cache"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = server.stats().events_sent;
        if now == sent {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the stream never filled"
        );
        sent = now;
    }
    let drained = tokio::spawn(server.shutdown());
    let mut events = 0;
    let end = loop {
        match tokio::time::timeout(WITHIN, responses.message()).await {
            Err(_) => panic!("no end after {events} events"),
            Ok(Ok(Some(r))) => events += r.events().len(),
            Ok(Ok(None)) => break "ended with OK".to_owned(),
            Ok(Err(e)) => break e.to_string(),
        }
    };
    // What a client needs is an end it does not take as final, never OK. Twice in CI (a
    // debug build beside this binary's other tests on 2 cores) the connection was reset once
    // the client had read about 18 MiB, before the word; the cause is not known. A reset is
    // not final either: a client watches again.
    if end.contains("ConnectionReset") {
        eprintln!("the connection was reset after {events} events ({sent} sent): {end}");
    } else {
        assert!(
            end.contains("server stopped"),
            "the stream's end after {events} events: {end}"
        );
        assert!(
            events as u64 >= sent && sent > 0,
            "{events} events read, {sent} sent"
        );
    }
    drop((_requests, responses, via));
    drained.await.expect("drained");
}
