//! etcd-client and this crate's informer through the server; bad and malformed input; many
//! connections.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn informer_through_the_server() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = shared_client().await;
    let p = unique_prefix("serve_informer");
    for i in 0..20 {
        put(&client, &format!("{p}k{i:02}"), &format!("v{i}")).await;
    }
    let server = start_server(&client, etcd.endpoints.clone(), &p).await;
    let via = connect([server.local_addr().to_string()])
        .await
        .expect("connect to the cache server");
    let lw = EtcdListerWatcher::new(via.clone(), p.as_str(), TextCodec).expect("source");
    let informer = SharedIndexInformer::new(lw, Default::default());
    let run = tokio::spawn(informer.clone().run());
    tokio::time::timeout(WITHIN, informer.wait_for_cache_sync())
        .await
        .expect("the informer syncs through the server");
    converges(&informer, &client, &p, WITHIN).await;
    for i in 0..10 {
        put(&client, &format!("{p}k{i:02}"), &format!("w{i}")).await;
    }
    delete(&client, &format!("{p}k15")).await;
    converges(&informer, &client, &p, WITHIN).await;
    // A compaction through the server, then more changes: the informer keeps up.
    let now = put(&client, &format!("{p}k20"), "x").await;
    via.kv_client()
        .compact(now, None)
        .await
        .expect("compact through the server");
    put(&client, &format!("{p}k21"), "y").await;
    delete(&client, &format!("{p}k00")).await;
    converges(&informer, &client, &p, WITHIN).await;
    // A consistent read through the server sees a write made straight to etcd.
    put(&client, &format!("{p}k22"), "z").await;
    let lister = informer
        .consistent_lister(WITHIN)
        .await
        .expect("a consistent read through the server");
    assert!(lister.get("k22").is_some());
    assert_eq!(cache_state(&informer), etcd_state(&client, &p).await);
    // Status, leases and the member list through the server.
    let mut m = via.maintenance_client();
    let status = m.status().await.expect("status through the server");
    assert!(!status.version().is_empty());
    let lease = via
        .lease_client()
        .grant(60, None)
        .await
        .expect("lease grant");
    via.kv_client()
        .put(
            format!("{p}leased"),
            "l",
            Some(PutOptions::new().with_lease(lease.id())),
        )
        .await
        .expect("put with a lease");
    let ttl = via
        .lease_client()
        .time_to_live(lease.id(), None)
        .await
        .expect("lease ttl");
    assert!(ttl.ttl() > 0);
    converges(&informer, &client, &p, WITHIN).await;
    let leased = informer.lister().get("leased").expect("leased key cached");
    assert_eq!(leased.lease, lease.id());
    let members = via
        .cluster_client()
        .member_list()
        .await
        .expect("member list");
    assert_eq!(
        members.members()[0].client_urls(),
        [format!("http://{}", server.local_addr())]
    );
    informer.stop();
    let _ = run.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_etcds_answer() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = shared_client().await;
    let p = unique_prefix("serve_bad_input");
    for i in 0..5 {
        put(&client, &format!("{p}k{i}"), "v").await;
    }
    let server = start_server(&client, etcd.endpoints.clone(), &p).await;
    let via = connect([server.local_addr().to_string()])
        .await
        .expect("connect");
    let kv = |c: &Client| c.kv_client();
    let status_of = |r: Result<etcd_client::GetResponse, etcd_client::Error>| match r {
        Err(etcd_client::Error::GRpcStatus(s)) => (s.code(), s.message().to_string()),
        other => panic!("expected a gRPC error, got {other:?}"),
    };
    // A revision in the future.
    let future = Some(GetOptions::new().with_prefix().with_revision(1 << 40));
    let served = status_of(kv(&via).get(p.as_str(), future.clone()).await);
    let direct = status_of(kv(&client).get(p.as_str(), future).await);
    assert_eq!(served, direct);
    assert_eq!(served.0, tonic::Code::OutOfRange);
    // A revision below the server's history: etcd's own answer (tests/serve/parity.rs has
    // the compacted case).
    let old = Some(GetOptions::new().with_prefix().with_revision(1));
    let served = kv(&via).get(p.as_str(), old.clone()).await;
    let direct = kv(&client).get(p.as_str(), old).await;
    assert_eq!(
        served.map(|r| r.kvs().len()).map_err(|e| e.to_string()),
        direct.map(|r| r.kvs().len()).map_err(|e| e.to_string())
    );
    // The empty key: forwarded, etcd's error.
    let served = status_of(kv(&via).get("", None).await);
    let direct = status_of(kv(&client).get("", None).await);
    assert_eq!(served, direct);
    // Limits of 0, 10^9, negative, and a range outside the prefix: etcd's answer.
    let outside = unique_prefix("serve_bad_input_outside");
    put(&client, &format!("{outside}x"), "y").await;
    for (key, options) in [
        (p.clone(), GetOptions::new().with_prefix().with_limit(0)),
        (
            p.clone(),
            GetOptions::new().with_prefix().with_limit(1_000_000_000),
        ),
        (p.clone(), GetOptions::new().with_prefix().with_limit(-5)),
        (
            p.clone(),
            GetOptions::new()
                .with_prefix()
                .with_limit(2)
                .with_keys_only(),
        ),
        (
            p.clone(),
            GetOptions::new()
                .with_prefix()
                .with_count_only()
                .with_limit(1),
        ),
        (
            p.clone(),
            GetOptions::new()
                .with_prefix()
                .with_min_mod_revision(1 << 40),
        ),
        (outside.clone(), GetOptions::new().with_prefix()),
    ] {
        let served = kv(&via)
            .get(key.as_str(), Some(options.clone()))
            .await
            .expect("served");
        let direct = kv(&client)
            .get(key.as_str(), Some(options))
            .await
            .expect("direct");
        let shape = |r: &etcd_client::GetResponse| {
            let kvs: Vec<_> = r
                .kvs()
                .iter()
                .map(|kv| (kv.key().to_vec(), kv.value().to_vec(), kv.mod_revision()))
                .collect();
            (kvs, r.count(), r.more())
        };
        assert_eq!(shape(&served), shape(&direct));
    }
    // Watches: a forwarded one outside the prefix, filters, a cancel of an unknown id, a
    // progress request; the server keeps serving.
    let mut w = via.watch_client();
    let (mut requests, mut responses) = w
        .watch(outside.as_str(), Some(WatchOptions::new().with_prefix()))
        .await
        .expect("watch outside the prefix")
        .split();
    requests
        .watch(
            p.as_str(),
            Some(
                WatchOptions::new()
                    .with_prefix()
                    .with_filters([WatchFilterType::NoPut])
                    .with_prev_key(),
            ),
        )
        .await
        .expect("second watch");
    requests.cancel(987_654).await.expect("cancel unknown");
    requests.request_progress().await.expect("progress");
    let mut created = 0;
    let mut progress = false;
    while created < 2 || !progress {
        let r = tokio::time::timeout(WITHIN, responses.message())
            .await
            .expect("watch answers")
            .expect("watch stream")
            .expect("open");
        created += usize::from(r.created());
        progress |= r.watch_id() == -1;
    }
    put(&client, &format!("{outside}x"), "z").await;
    put(&client, &format!("{p}k1"), "filtered-out").await;
    delete(&client, &format!("{p}k1")).await;
    let mut seen = Vec::new();
    while seen.len() < 2 {
        let r = tokio::time::timeout(WITHIN, responses.message())
            .await
            .expect("events")
            .expect("watch stream")
            .expect("open");
        for event in r.events() {
            let kv = event.kv().expect("kv");
            let prev = event
                .prev_kv()
                .map(|kv| kv.value_str().unwrap_or("?").to_string());
            seen.push((
                event.event_type(),
                kv.key_str().unwrap_or("?").to_string(),
                prev,
            ));
        }
    }
    // The two watches' events come by different roads (etcd's stream, the cache): in either
    // order.
    seen.sort_by(|a, b| a.1.cmp(&b.1));
    let mut want = vec![
        (EventType::Put, format!("{outside}x"), None),
        (
            EventType::Delete,
            format!("{p}k1"),
            Some("filtered-out".to_string()),
        ),
    ];
    want.sort_by(|a, b| a.1.cmp(&b.1));
    assert_eq!(seen, want);
    let again = kv(&via)
        .get(p.as_str(), Some(GetOptions::new().with_prefix()))
        .await;
    assert_eq!(again.expect("still serving").count(), 4);
    // Issue 53, item 11: a key that is not UTF-8 is served from the cache as any other (it
    // sent every reader of the prefix back to etcd, for good): an open watch hears it, and
    // reads of the prefix and of the key are answered from the cache, as etcd answers them.
    let (_watcher, mut open) = watch_prefix(&via, &p).await;
    let mut odd = p.clone().into_bytes();
    odd.extend_from_slice(b"\xff\xfe");
    let written = client
        .kv_client()
        .put(odd.clone(), "odd", None)
        .await
        .expect("put")
        .header()
        .expect("header")
        .revision();
    let heard = next_response("the odd key's put", &mut open).await;
    let put_kv = heard.events()[0].kv().expect("a put");
    assert_eq!(
        (put_kv.key(), put_kv.mod_revision()),
        (odd.as_slice(), written)
    );
    caught_up(&server, written).await;
    let before = server.stats().ranges_from_cache;
    for (key, options) in [
        (
            p.clone().into_bytes(),
            Some(GetOptions::new().with_prefix()),
        ),
        (odd.clone(), None),
    ] {
        let served = kv(&via).get(key.clone(), options.clone()).await;
        let direct = kv(&client).get(key, options).await;
        let pairs = |r: etcd_client::GetResponse| {
            let kvs = r.kvs().iter();
            kvs.map(|kv| (kv.key().to_vec(), kv.value().to_vec(), kv.mod_revision()))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            pairs(served.expect("served")),
            pairs(direct.expect("direct"))
        );
    }
    assert_eq!(server.stats().ranges_from_cache - before, 2);
}

/// A message whose field 1 is a number where etcd's requests have bytes: it does not decode.
#[derive(Clone, PartialEq, prost::Message)]
struct Garbage {
    #[prost(uint64, tag = "1")]
    key: u64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_and_progress_notifications() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = shared_client().await;
    let p = unique_prefix("serve_malformed");
    put(&client, &format!("{p}k"), "v").await;
    let options = CacheServerOptions::default().with_progress_interval(Duration::from_millis(200));
    let server = start_server_with(&client, etcd.endpoints.clone(), &p, options).await;
    let url = format!("http://{}", server.local_addr());
    let channel = tonic::transport::Channel::from_shared(url)
        .expect("url")
        .connect()
        .await
        .expect("connect");
    let mut grpc = tonic::client::Grpc::new(channel);
    for path in ["/etcdserverpb.KV/Range", "/etcdserverpb.KV/Put"] {
        grpc.ready().await.expect("ready");
        let sent: Result<tonic::Response<Garbage>, _> = grpc
            .unary(
                tonic::Request::new(Garbage { key: 7 }),
                tonic::codegen::http::uri::PathAndQuery::from_static(path),
                tonic_prost::ProstCodec::default(),
            )
            .await;
        let status = sent.expect_err("a malformed request is refused");
        assert_eq!(status.code(), tonic::Code::Internal, "{path}: {status:?}");
    }
    grpc.ready().await.expect("ready");
    let watch: Result<tonic::Response<tonic::codec::Streaming<Garbage>>, _> = grpc
        .streaming(
            tonic::Request::new(tokio_stream::iter([Garbage { key: 7 }])),
            tonic::codegen::http::uri::PathAndQuery::from_static("/etcdserverpb.Watch/Watch"),
            tonic_prost::ProstCodec::default(),
        )
        .await;
    if let Ok(responses) = watch {
        let mut responses = responses.into_inner();
        let ended = tokio::time::timeout(WITHIN, responses.message()).await;
        assert!(
            matches!(ended, Ok(Err(_)) | Ok(Ok(None))),
            "a malformed watch request ends the stream: {ended:?}"
        );
    }
    // The server still serves, and a watch with progress_notify hears of the revision.
    let via = connect([server.local_addr().to_string()])
        .await
        .expect("connect");
    let (_w, mut watch) = via
        .watch_client()
        .watch(
            p.as_str(),
            Some(WatchOptions::new().with_prefix().with_progress_notify()),
        )
        .await
        .expect("watch")
        .split();
    let revision = server.stats().revision;
    let mut notified = false;
    while !notified {
        let r = tokio::time::timeout(WITHIN, watch.message())
            .await
            .expect("a progress notification")
            .expect("stream")
            .expect("open");
        notified = !r.created() && r.events().is_empty();
        if notified {
            assert_eq!(r.header().map(|h| h.revision()), Some(revision));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_connections_each_watching_and_reading() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = shared_client().await;
    let p = unique_prefix("serve_connections");
    put(&client, &format!("{p}k"), "0").await;
    let server = start_server(&client, etcd.endpoints.clone(), &p).await;
    let endpoint = server.local_addr().to_string();
    // Opened a hundred at a time: each connects, reads and watches.
    let mut watchers = Vec::new();
    for _ in 0..10 {
        let mut opening = tokio::task::JoinSet::new();
        for _ in 0..100 {
            let (endpoint, p) = (endpoint.clone(), p.clone());
            opening.spawn(async move {
                let via = connect([endpoint.as_str()]).await.expect("connect");
                let read = GetOptions::new().with_prefix().with_serializable();
                let got = via.kv_client().get(p.as_str(), Some(read)).await;
                assert_eq!(got.expect("a read on each connection").count(), 1);
                let (requests, mut responses) = via
                    .watch_client()
                    .watch(p.as_str(), Some(WatchOptions::new().with_prefix()))
                    .await
                    .expect("a watch on each connection")
                    .split();
                let created = tokio::time::timeout(WITHIN, responses.message())
                    .await
                    .expect("created")
                    .expect("stream")
                    .expect("open");
                assert!(created.created());
                (via, requests, responses)
            });
        }
        while let Some(opened) = opening.join_next().await {
            watchers.push(opened.expect("a connection opened"));
        }
    }
    assert_eq!(server.stats().watch_streams, 1000);
    let rev = put(&client, &format!("{p}k"), "1").await;
    for (_, _, responses) in &mut watchers {
        let r = tokio::time::timeout(WITHIN, responses.message())
            .await
            .expect("every connection hears the write")
            .expect("stream")
            .expect("open");
        assert_eq!(r.events()[0].kv().map(|kv| kv.mod_revision()), Some(rev));
    }
    drop(watchers);
    eventually("the streams are closed", WITHIN, || {
        server.stats().watch_streams == 0
    })
    .await;
}

/// What a client sees of one lock and one election on `name`, with the parts that differ from
/// run to run (lease ids, revisions) left out.
async fn lock_and_election(client: &Client, name: &str) -> Vec<String> {
    use etcd_client::{LockOptions, ProclaimOptions, ResignOptions};
    let mut seen = Vec::new();
    let lease = client
        .lease_client()
        .grant(60, None)
        .await
        .expect("lease grant")
        .id();
    let mut locks = client.lock_client();
    let lock = format!("{name}/lock");
    let held = locks
        .lock(lock.as_str(), Some(LockOptions::new().with_lease(lease)))
        .await
        .expect("lock");
    let key = String::from_utf8_lossy(held.key()).to_string();
    seen.push(format!(
        "lock key under the name: {}",
        key.starts_with(&lock)
    ));
    let value = client
        .kv_client()
        .get(key.as_str(), None)
        .await
        .expect("get the lock's key")
        .kvs()
        .first()
        .map(|kv| kv.lease() == lease);
    seen.push(format!("lock key on the lease: {value:?}"));
    locks.unlock(key.as_str()).await.expect("unlock");
    let gone = client
        .kv_client()
        .get(key.as_str(), GetOptions::new().with_count_only().into())
        .await
        .expect("get the lock's key")
        .count();
    seen.push(format!("lock key after unlock: {gone}"));

    let mut elections = client.election_client();
    let election = format!("{name}/election");
    let campaign = elections
        .campaign(election.as_str(), "first", lease)
        .await
        .expect("campaign");
    let leader = campaign.leader().expect("a leader key").clone();
    seen.push(format!(
        "leader named after the election: {}",
        leader.name() == election.as_bytes()
    ));
    let mut observe = elections.observe(election.as_str()).await.expect("observe");
    let first = observe
        .message()
        .await
        .expect("observed")
        .expect("a leader");
    seen.push(format!(
        "observed: {}",
        String::from_utf8_lossy(first.kv().expect("kv").value())
    ));
    elections
        .proclaim(
            "second",
            Some(ProclaimOptions::new().with_leader(leader.clone())),
        )
        .await
        .expect("proclaim");
    let next = tokio::time::timeout(WITHIN, observe.message())
        .await
        .expect("the proclamation is observed in time")
        .expect("observed")
        .expect("a leader");
    seen.push(format!(
        "observed: {}",
        String::from_utf8_lossy(next.kv().expect("kv").value())
    ));
    let now = elections.leader(election.as_str()).await.expect("leader");
    seen.push(format!(
        "leader: {}",
        String::from_utf8_lossy(now.kv().expect("kv").value())
    ));
    elections
        .resign(Some(ResignOptions::new().with_leader(leader)))
        .await
        .expect("resign");
    let after = elections.leader(election.as_str()).await;
    seen.push(format!(
        "leader after resigning: {:?}",
        after.map(|r| r.kv().is_some()).map_err(|e| match e {
            etcd_client::Error::GRpcStatus(s) => (s.code(), s.message().to_string()),
            other => panic!("{other:?}"),
        })
    ));
    client.lease_client().revoke(lease).await.expect("revoke");
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_and_election_are_etcds() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = shared_client().await;
    let p = unique_prefix("serve_lock");
    let server = start_server(&client, etcd.endpoints.clone(), &p).await;
    let via = connect([server.local_addr().to_string()])
        .await
        .expect("connect");
    let direct = lock_and_election(&client, &format!("{p}direct")).await;
    let served = lock_and_election(&via, &format!("{p}served")).await;
    assert_eq!(served, direct);

    // A lock held through the server excludes one asked of etcd directly.
    let lease = via
        .lease_client()
        .grant(60, None)
        .await
        .expect("grant")
        .id();
    let name = format!("{p}shared");
    let held = via
        .lock_client()
        .lock(
            name.as_str(),
            Some(etcd_client::LockOptions::new().with_lease(lease)),
        )
        .await
        .expect("lock through the server");
    let mut direct_locks = client.lock_client();
    let mut waiting = tokio::spawn({
        let name = name.clone();
        async move { direct_locks.lock(name.as_str(), None).await }
    });
    // Nothing to wait on for a lock that is rightly not granted: a while without it is all
    // the evidence there is.
    let early = tokio::time::timeout(Duration::from_millis(300), &mut waiting).await;
    assert!(
        early.is_err(),
        "etcd granted a lock held through the server"
    );
    via.lock_client().unlock(held.key()).await.expect("unlock");
    let granted = tokio::time::timeout(WITHIN, waiting)
        .await
        .expect("the lock is granted after the unlock")
        .expect("task")
        .expect("lock on etcd");
    client
        .lock_client()
        .unlock(granted.key())
        .await
        .expect("unlock");
    via.lease_client().revoke(lease).await.expect("revoke");
}

/// Linearizable reads of a prefix whose cache cannot catch etcd's revision by itself (a key
/// outside it moved etcd's revision) each need etcd to prove the prefix unchanged; reads made
/// together share one proof instead of each having etcd read the prefix (the guide's
/// "Serving etcd's API", "Limits"). A private etcd: no other test may move its revision meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn linearizable_reads_made_together_share_one_proof() {
    let etcd = private_etcd().await;
    let client = etcd.client().await;
    let p = unique_prefix("serve_proof");
    for i in 0..10 {
        put(&client, &format!("{p}k{i}"), "v").await;
    }
    let server = start_server(&client, vec![etcd.endpoint()], &p).await;
    let via = connect([server.local_addr().to_string()])
        .await
        .expect("connect to the cache server");
    let mut total = 0;
    for round in 0..3 {
        // etcd's revision moves outside the prefix: the cache's own watch hears nothing.
        let elsewhere = format!("{}-elsewhere", p.trim_end_matches('/'));
        put(&client, &elsewhere, &round.to_string()).await;
        let before = server.stats().proofs;
        let reads: Vec<_> = (0..20)
            .map(|_| {
                let mut kv = via.kv_client();
                let key = format!("{p}k0");
                tokio::spawn(async move { kv.get(key, None).await })
            })
            .collect();
        for read in reads {
            let got = read.await.expect("read task").expect("linearizable read");
            assert_eq!(got.kvs().len(), 1);
        }
        let proofs = server.stats().proofs - before;
        assert!(proofs >= 1, "round {round}: no proof was asked of etcd");
        total += proofs;
    }
    assert!(
        total < 30,
        "60 reads in 3 rounds of 20 asked etcd for {total} proofs: they were not shared"
    );
    server.shutdown().await;
}

/// On an etcd whose progress revisions can be trusted (3.4.25+, 3.5.8+; forced here, since
/// neither runs on this machine), a linearizable read of a large quiet prefix while etcd's
/// revision moves elsewhere costs etcd one Range: the count of one key that names its
/// revision. The cache's own watch proves the rest, and etcd reads no value of the prefix.
/// Untrusted (this etcd's default), each read also has etcd read its range: a second Range.
/// A private etcd: its Range count is this test's alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_proven_by_the_watchs_progress_reads_no_values_in_etcd() {
    let etcd = private_etcd().await;
    let client = etcd.client().await;
    let p = unique_prefix("serve_progress");
    let values = put_large_prefix(&client, &format!("{p}k")).await;
    let ranges = || read_cost(&etcd).0;
    let allocated = || read_cost(&etcd).1;
    let elsewhere = format!("{}-elsewhere", p.trim_end_matches('/'));
    for trusted in [true, false] {
        let source = EtcdOptions::default()
            .with_raw_prefix(true)
            .with_trust_progress(Some(trusted));
        let options = CacheServerOptions::default()
            .with_etcd(source)
            .with_audit_period(None);
        let server = start_server_with(&client, vec![etcd.endpoint()], &p, options).await;
        let via = connect([server.local_addr().to_string()])
            .await
            .expect("connect to the cache server");
        // etcd answers whether this client may read each range once (the server remembers).
        for (key, options) in [
            (format!("{p}k0007"), None),
            (
                p.clone(),
                Some(GetOptions::new().with_prefix().with_keys_only()),
            ),
        ] {
            via.kv_client()
                .get(key, options)
                .await
                .expect("a first read");
        }
        // Trusted: reads until one is proven by the watch's progress, which the open watch
        // answers.
        for round in 0..20 {
            let proofs = server.stats().progress_proofs;
            put(&client, &elsewhere, &format!("warm {round}")).await;
            via.kv_client()
                .get(format!("{p}k0007"), None)
                .await
                .expect("a warm-up read");
            if !trusted || server.stats().progress_proofs > proofs {
                break;
            }
        }
        let before = (ranges(), server.stats(), allocated());
        let rounds = 10u8;
        for round in 0..rounds {
            put(&client, &elsewhere, &round.to_string()).await;
            let one = via
                .kv_client()
                .get(format!("{p}k0007"), None)
                .await
                .expect("a one-key linearizable read");
            assert_eq!(one.kvs().len(), 1);
            put(&client, &elsewhere, &round.to_string()).await;
            let all = via
                .kv_client()
                .get(
                    p.as_str(),
                    Some(GetOptions::new().with_prefix().with_keys_only()),
                )
                .await
                .expect("a linearizable list");
            assert_eq!(all.kvs().len(), 2000);
            assert!(
                all.header().expect("header").revision()
                    >= one.header().expect("header").revision()
            );
        }
        let (served, stats) = (ranges() - before.0, server.stats());
        // A one-key read and a list each round.
        let per_round = (allocated() - before.2) / f64::from(rounds);
        let by_progress = stats.progress_proofs - before.1.progress_proofs;
        let by_range = stats.proofs - before.1.proofs;
        let reads = u64::from(2 * rounds);
        let what = format!("{reads} reads: etcd served {served} Ranges, allocated {per_round:.0} bytes per round; {by_progress} proven by progress, {by_range} by a read of the range");
        if trusted {
            assert_eq!(
                (served as u64, by_progress, by_range),
                (reads, reads, 0),
                "{what}"
            );
            // A list's values are in its answer from the cache, never read in etcd: the
            // prefix's values are 8 MB.
            assert!(per_round < values / 4.0, "{what}");
        } else {
            assert_eq!(
                (served as u64, by_progress, by_range),
                (2 * reads, 0, reads),
                "{what}"
            );
            // The measure sees the lists' proofs read the values.
            assert!(per_round > values / 2.0, "{what}");
        }
        server.shutdown().await;
    }
}
