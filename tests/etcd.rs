//! The etcd source against a real etcd: the shared one of this test binary (or ETCD_ENDPOINTS),
//! and private servers for the tests that stop, wipe or pause etcd.
#![cfg(feature = "testing")]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{
    cache_state, converges, etcd_state, eventually, put_accepted, recorder, shared_client,
    Counting, Log,
};
use etcd_client::Client;
use etcd_informer::listwatch::etcd::ConfigError;
use etcd_informer::listwatch::ListKeyRevisions;
use etcd_informer::testing::etcd::{unique_prefix, EtcdCluster, EtcdServer};
use etcd_informer::{
    connect, Backoff, EtcdListerWatcher, EtcdOptions, InformerOptions, RawCodec,
    SharedIndexInformer, TextCodec,
};

/// Options that notice a dead watch within seconds rather than the production 20 s.
fn quick_etcd_options() -> EtcdOptions {
    EtcdOptions::default()
        .with_progress_interval(Duration::from_millis(500))
        .with_idle_timeout(Duration::from_secs(3))
}

fn informer_options(backoff: Duration) -> InformerOptions<String> {
    InformerOptions::default()
        .with_name("etcd-test")
        .with_backoff(Backoff::new(
            backoff,
            backoff * 2,
            Duration::from_secs(120),
            0.0,
        ))
        // The tests here choose every retry delay (some open a window behind the informer's
        // back with a long one); tests/faults.rs measures the default reconnect backoff.
        .with_reconnect(Backoff::new(
            backoff,
            backoff * 2,
            Duration::from_secs(120),
            0.0,
        ))
}

struct Running {
    informer: SharedIndexInformer<String>,
    log: Log,
    lists: Arc<AtomicUsize>,
}

fn start(client: &Client, prefix: &str, etcd: EtcdOptions, backoff: Duration) -> Running {
    let lw = EtcdListerWatcher::with_options(client.clone(), prefix, TextCodec, etcd).unwrap();
    let lists = Arc::new(AtomicUsize::new(0));
    let informer = SharedIndexInformer::new(
        Counting {
            inner: lw,
            lists: lists.clone(),
            watches: Arc::default(),
            held: Arc::default(),
        },
        informer_options(backoff),
    );
    let log = Log::default();
    informer.add_event_handler(recorder(&log)).unwrap();
    tokio::spawn(informer.clone().run());
    Running {
        informer,
        log,
        lists,
    }
}

async fn synced(r: &Running) {
    tokio::time::timeout(Duration::from_secs(30), r.informer.wait_for_cache_sync())
        .await
        .expect("informer synced within 30 s");
}

/// The handler's log once `cond` holds for it, or after 10 s: handlers hear of a change only
/// after the cache holds it, so a test that saw the cache converge waits for them too.
async fn log_until(r: &Running, cond: impl Fn(&[String]) -> bool) -> Vec<String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let log = log_of(r);
        if cond(&log) || std::time::Instant::now() >= deadline {
            return log;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn log_of(r: &Running) -> Vec<String> {
    r.log.lock().unwrap().clone()
}

async fn put_many(client: &Client, prefix: &str, n: usize, value: &str) {
    let mut kv = client.kv_client();
    for i in 0..n {
        kv.put(format!("{prefix}ns{}/k{i:04}", i % 3), value, None)
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn initial_sync_over_several_pages_has_every_key_and_revision() {
    let client = shared_client().await;
    let prefix = unique_prefix("initial_sync");
    put_many(&client, &prefix, 95, "v").await;
    let etcd = quick_etcd_options().with_page_size(10);
    let r = start(&client, &prefix, etcd, Duration::from_millis(100));
    synced(&r).await;
    let want = etcd_state(&client, &prefix).await;
    assert_eq!(want.len(), 95);
    assert_eq!(
        cache_state(&r.informer),
        want,
        "synced cache equals etcd, revisions included"
    );
    assert_eq!(r.informer.lister().by_namespace("ns1").unwrap().len(), 32);
    assert!(r.informer.last_synced_revision() >= want.values().map(|v| v.0).max().unwrap());
}

#[tokio::test]
async fn list_under_concurrent_writes_is_consistent() {
    let client = shared_client().await;
    let prefix = unique_prefix("concurrent_list");
    put_many(&client, &prefix, 300, "0").await;
    let writer = {
        let (client, prefix) = (client.clone(), prefix.clone());
        tokio::spawn(async move {
            let mut kv = client.kv_client();
            for i in 0..300 {
                kv.put(
                    format!("{prefix}ns{}/k{:04}", i % 3, (i * 7) % 300),
                    format!("w{i}"),
                    None,
                )
                .await
                .unwrap();
                if i % 10 == 0 {
                    kv.delete(format!("{prefix}ns0/k{:04}", (i * 3) % 300), None)
                        .await
                        .unwrap();
                }
            }
        })
    };
    let etcd = quick_etcd_options().with_page_size(7);
    let r = start(&client, &prefix, etcd, Duration::from_millis(100));
    synced(&r).await;
    writer.await.unwrap();
    converges(&r.informer, &client, &prefix, Duration::from_secs(20)).await;
}

#[tokio::test]
async fn add_update_delete_reach_handlers_in_order_with_values() {
    let client = shared_client().await;
    let prefix = unique_prefix("events");
    let r = start(
        &client,
        &prefix,
        quick_etcd_options(),
        Duration::from_millis(100),
    );
    synced(&r).await;
    let mut kv = client.kv_client();
    kv.put(format!("{prefix}tmp/a"), "1", None).await.unwrap();
    kv.put(format!("{prefix}tmp/a"), "2", None).await.unwrap();
    kv.delete(format!("{prefix}tmp/a"), None).await.unwrap();
    kv.put(format!("{prefix}tmp/a"), "3", None).await.unwrap();
    eventually("4 events", Duration::from_secs(10), || {
        log_of(&r).len() == 4
    })
    .await;
    assert_eq!(
        log_of(&r),
        [
            "add tmp/a=1",
            "update tmp/a=1->2",
            "delete tmp/a=2",
            "add tmp/a=3"
        ]
    );
    let obj = r.informer.lister().get("tmp/a").unwrap();
    assert_eq!((obj.version, obj.create_revision), (1, obj.mod_revision));
}

#[tokio::test]
async fn undecodable_value_is_reported_with_its_key_and_others_flow() {
    let client = shared_client().await;
    let prefix = unique_prefix("undecodable");
    let mut kv = client.kv_client();
    kv.put(format!("{prefix}ok/before"), "fine", None)
        .await
        .unwrap();
    kv.put(format!("{prefix}bad/listed"), vec![0xff, 0xfe], None)
        .await
        .unwrap();
    kv.put(format!("{prefix}bad/later"), "fine for now", None)
        .await
        .unwrap();
    let reported: Arc<Mutex<Vec<String>>> = Default::default();
    let rep = reported.clone();
    let etcd = quick_etcd_options().with_on_decode_error(Some(Arc::new(move |e| {
        rep.lock().unwrap().push(e.key_str().unwrap().to_owned())
    })));
    let r = start(&client, &prefix, etcd, Duration::from_millis(100));
    synced(&r).await;
    assert_eq!(*reported.lock().unwrap(), [format!("{prefix}bad/listed")]);
    assert!(r.informer.lister().get("bad/listed").is_none());
    kv.put(format!("{prefix}bad/later"), vec![0xc3, 0x28], None)
        .await
        .unwrap();
    kv.put(format!("{prefix}ok/after"), "fine", None)
        .await
        .unwrap();
    eventually("later key reported", Duration::from_secs(10), || {
        reported.lock().unwrap().len() == 2
    })
    .await;
    eventually("ok/after cached", Duration::from_secs(10), || {
        r.informer.lister().get("ok/after").is_some()
    })
    .await;
    assert!(
        r.informer.lister().get("bad/later").is_none(),
        "a key turned undecodable leaves the cache"
    );
    let log = log_until(&r, |log| {
        log.iter().any(|l| l == "delete bad/later=fine for now")
    })
    .await;
    assert!(
        log.contains(&"delete bad/later=fine for now".to_string()),
        "{log:?}"
    );
    assert_eq!(r.informer.lister().len(), 2);
}

#[tokio::test]
async fn prefix_boundary_and_large_values() {
    let client = shared_client().await;
    let base = unique_prefix("boundary");
    let prefix = format!("{base}a/");
    let mut kv = client.kv_client();
    let big = "x".repeat(1 << 20);
    kv.put(format!("{base}ab/sibling"), "no", None)
        .await
        .unwrap();
    kv.put(format!("{prefix}big/listed"), big.clone(), None)
        .await
        .unwrap();
    let r = start(
        &client,
        &prefix,
        quick_etcd_options(),
        Duration::from_millis(100),
    );
    synced(&r).await;
    kv.put(format!("{base}ab/sibling2"), "no", None)
        .await
        .unwrap();
    kv.put(format!("{prefix}big/watched"), big.clone(), None)
        .await
        .unwrap();
    eventually("big watched value", Duration::from_secs(10), || {
        r.informer.lister().get("big/watched").is_some()
    })
    .await;
    let keys: Vec<String> = r
        .informer
        .lister()
        .list()
        .iter()
        .map(|o| o.key().to_string())
        .collect();
    assert_eq!(keys, ["big/listed", "big/watched"]);
    assert_eq!(
        r.informer.lister().get("big/listed").unwrap().value.len(),
        1 << 20
    );

    let no_slash = EtcdListerWatcher::new(client.clone(), format!("{base}a"), RawCodec);
    assert!(matches!(no_slash, Err(ConfigError::Prefix(_))));
    let raw = EtcdListerWatcher::with_options(
        client.clone(),
        format!("{base}a"),
        RawCodec,
        EtcdOptions::default().with_raw_prefix(true),
    );
    assert!(raw.is_ok(), "a raw prefix is allowed when asked for");
}

#[tokio::test]
async fn compaction_while_disconnected_relists_with_tombstones() {
    let server = EtcdServer::start().await.unwrap_or_else(|e| panic!("{e}"));
    let client = connect(server.endpoints()).await.unwrap();
    let prefix = "/compaction/";
    let mut kv = client.kv_client();
    for k in ["keep", "gone", "changed"] {
        kv.put(format!("{prefix}ns/{k}"), "v1", None).await.unwrap();
    }
    // A long first backoff: the window in which we change etcd behind the informer's back.
    let r = start(
        &client,
        prefix,
        quick_etcd_options(),
        Duration::from_secs(6),
    );
    synced(&r).await;
    assert_eq!(r.lists.load(Ordering::SeqCst), 1);
    server.stop().await.unwrap();
    server.start_again().await.unwrap();
    let other = connect(server.endpoints()).await.unwrap();
    let mut kv = other.kv_client();
    kv.delete(format!("{prefix}ns/gone"), None).await.unwrap();
    kv.put(format!("{prefix}ns/changed"), "v2", None)
        .await
        .unwrap();
    let put = kv.put(format!("{prefix}ns/new"), "v1", None).await.unwrap();
    let rev = put.header().unwrap().revision();
    let mut other_kv = other.kv_client();
    other_kv.compact(rev, None).await.unwrap();
    converges(&r.informer, &other, prefix, Duration::from_secs(30)).await;
    assert!(r.lists.load(Ordering::SeqCst) >= 2, "relisted");
    let wanted = [
        "tombstone ns/gone=v1",
        "update ns/changed=v1->v2",
        "add ns/new=v1",
    ];
    let log = log_until(&r, |log| wanted.iter().all(|w| log.iter().any(|l| l == w))).await;
    assert!(log.contains(&"tombstone ns/gone=v1".to_string()), "{log:?}");
    assert!(
        log.contains(&"update ns/changed=v1->v2".to_string()),
        "{log:?}"
    );
    assert!(log.contains(&"add ns/new=v1".to_string()), "{log:?}");
}

#[tokio::test]
async fn restart_on_same_data_resumes_without_relist() {
    let server = EtcdServer::start().await.unwrap_or_else(|e| panic!("{e}"));
    let client = connect(server.endpoints()).await.unwrap();
    let prefix = "/restart/";
    put_many(&client, prefix, 5, "v1").await;
    let r = start(
        &client,
        prefix,
        quick_etcd_options(),
        Duration::from_millis(200),
    );
    synced(&r).await;
    server.restart().await.unwrap();
    let mut kv = client.kv_client();
    let mut put = None;
    for _ in 0..100 {
        match kv
            .put(format!("{prefix}ns0/after-restart"), "v2", None)
            .await
        {
            Ok(p) => {
                put = Some(p);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    assert!(put.is_some(), "etcd answers after restart");
    converges(&r.informer, &client, prefix, Duration::from_secs(30)).await;
    assert_eq!(
        r.lists.load(Ordering::SeqCst),
        1,
        "resumed the watch, no relist"
    );
}

#[tokio::test]
async fn wiped_etcd_is_noticed_and_relisted() {
    let server = EtcdServer::start().await.unwrap_or_else(|e| panic!("{e}"));
    let client = connect(server.endpoints()).await.unwrap();
    let prefix = "/wipe/";
    put_many(&client, prefix, 20, "old").await;
    let r = start(
        &client,
        prefix,
        quick_etcd_options(),
        Duration::from_millis(200),
    );
    synced(&r).await;
    let before = r.informer.last_synced_revision();
    server.wipe().await.unwrap();
    let fresh = connect(server.endpoints()).await.unwrap();
    fresh
        .kv_client()
        .put(format!("{prefix}ns0/fresh"), "new", None)
        .await
        .unwrap();
    converges(&r.informer, &fresh, prefix, Duration::from_secs(30)).await;
    assert!(r.lists.load(Ordering::SeqCst) >= 2, "relisted");
    assert!(
        r.informer.last_synced_revision() < before,
        "revision went backwards with the store"
    );
    let tombstones = |log: &[String]| log.iter().filter(|l| l.starts_with("tombstone")).count();
    let log = log_until(&r, |log| tombstones(log) >= 20).await;
    assert_eq!(tombstones(&log), 20, "{log:?}");
}

#[tokio::test]
async fn cluster_member_stopped_or_paused_informer_keeps_up() {
    // The informer's log is shown if the test fails.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("etcd_informer=debug"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
    let cluster = EtcdCluster::start(3)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let client = connect(cluster.endpoints()).await.unwrap();
    let prefix = "/cluster/";
    put_many(&client, prefix, 10, "v1").await;
    let r = start(
        &client,
        prefix,
        quick_etcd_options(),
        Duration::from_millis(200),
    );
    synced(&r).await;

    // Stop one member; write through another; the informer catches up within bounded time.
    cluster.stop_member(0).await.unwrap();
    let writer = connect([cluster.member_endpoint(1)]).await.unwrap();
    let key = format!("{prefix}ns0/after-stop");
    put_accepted(&writer, &key, "v2", Duration::from_secs(30)).await;
    converges(&r.informer, &writer, prefix, Duration::from_secs(30)).await;

    // Pause another member (SIGSTOP): the cluster keeps quorum with the remaining two? No:
    // with one stopped and one paused only one answers, so restart the first member first.
    cluster.restart_member(0).await.unwrap();
    cluster.pause_member(1).unwrap();
    let writer = connect([cluster.member_endpoint(2)]).await.unwrap();
    let key = format!("{prefix}ns0/after-pause");
    put_accepted(&writer, &key, "v3", Duration::from_secs(30)).await;
    converges(&r.informer, &writer, prefix, Duration::from_secs(30)).await;
    cluster.resume_member(1).unwrap();
}

/// The most common production setup: the client has every member, and the member serving the
/// watch hangs (SIGSTOP: no FIN, no RST) while the others take writes. Reads answered by the
/// live members must not vouch for the hung stream: the watch moves to a live member and the
/// cache equals etcd again, with the library's default options, in every round.
#[tokio::test]
async fn hung_member_among_all_endpoints_is_left_for_a_live_one() {
    let cluster = EtcdCluster::start(3)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let client = connect(cluster.endpoints()).await.unwrap();
    let prefix = "/hung/";
    put_many(&client, prefix, 10, "v1").await;
    let r = start(
        &client,
        prefix,
        EtcdOptions::default(),
        Duration::from_millis(200),
    );
    synced(&r).await;
    let writers: Vec<Client> = member_clients(&cluster).await;
    for round in 0..3 {
        // The member serving the informer's watch (the test itself watches nothing).
        let mut hung = None;
        for _ in 0..200 {
            hung = cluster.watching_member().await;
            if hung.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let hung = hung.expect("a member serves the informer's watch");
        cluster.pause_member(hung).unwrap();
        let started = tokio::time::Instant::now();
        let live = (hung + 1) % 3;
        for i in 0..5 {
            // A hung leader stalls writes until the others elect a new one.
            let key = format!("{prefix}ns0/round{round}-{i}");
            put_accepted(&writers[live], &key, "v2", Duration::from_secs(30)).await;
        }
        let written = started.elapsed();
        let took = converges(&r.informer, &writers[live], prefix, Duration::from_secs(10)).await;
        let since_hang = started.elapsed();
        eprintln!("round {round}: member {hung} hung; writes done after {written:?}, the cache equalled etcd after {since_hang:?} ({took:?} after the writes)");
        cluster.resume_member(hung).unwrap();
    }
    assert_eq!(
        r.lists.load(Ordering::SeqCst),
        1,
        "re-watched, never relisted"
    );
}

/// One client per member.
async fn member_clients(cluster: &EtcdCluster) -> Vec<Client> {
    let mut clients = Vec::new();
    for endpoint in cluster.endpoints() {
        clients.push(connect_member(endpoint).await);
    }
    clients
}

/// A quiet prefix whose member is alive stays healthy however long nothing is written (its
/// probes are answered on the stream); once the member hangs, health stops saying connected
/// within the idle timeout, and the time since the cache was proven fresh grows.
#[tokio::test]
async fn health_follows_the_stream_not_the_absence_of_errors() {
    let etcd = EtcdServer::start().await.unwrap_or_else(|e| panic!("{e}"));
    let client = etcd.client().await;
    let prefix = "/quiet/";
    put_many(&client, prefix, 3, "v").await;
    let idle = Duration::from_secs(2);
    let options = EtcdOptions::default()
        .with_progress_interval(Duration::from_millis(500))
        .with_idle_timeout(idle);
    let r = start(&client, prefix, options, Duration::from_millis(200));
    synced(&r).await;
    // Three idle timeouts without a write: proven fresh all along.
    let quiet = tokio::time::Instant::now();
    while quiet.elapsed() < idle * 3 {
        let health = r.informer.health();
        assert!(health.is_healthy(), "{health:?}");
        let since = health.reflector.seconds_since_proven_fresh().unwrap();
        assert!(since <= idle.as_secs_f64(), "proven {since} s ago");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    etcd.pause().unwrap();
    let hung = tokio::time::Instant::now();
    let noticed = eventually("health says not connected", idle * 2, || {
        !r.informer.health().is_healthy()
    })
    .await;
    let since = r
        .informer
        .health()
        .reflector
        .seconds_since_proven_fresh()
        .unwrap();
    eprintln!("hung: unhealthy after {noticed:?}, proven fresh {since:.2} s ago");
    assert!(since >= hung.elapsed().as_secs_f64() - 0.5, "{since}");
    etcd.resume().unwrap();
    eventually("healthy again", Duration::from_secs(10), || {
        r.informer.health().is_healthy()
    })
    .await;
    assert_eq!(r.lists.load(Ordering::SeqCst), 1, "no relist");
}

#[tokio::test]
async fn factory_shares_one_informer_per_prefix_and_type() {
    let client = shared_client().await;
    let prefix = unique_prefix("factory");
    let other = unique_prefix("factory-other");
    put_many(&client, &prefix, 12, "v").await;
    put_many(&client, &other, 3, "v").await;
    let factory = etcd_informer::SharedInformerFactory::new(client.clone());
    let a = factory
        .informer_for::<String, _>(prefix.clone(), TextCodec)
        .unwrap();
    let b = factory
        .informer_for::<String, _>(prefix.clone(), TextCodec)
        .unwrap();
    let c = factory
        .informer_for::<Vec<u8>, _>(prefix.clone(), RawCodec)
        .unwrap();
    let d = factory
        .informer_for::<String, _>(other.clone(), TextCodec)
        .unwrap();
    assert!(factory
        .informer_for::<String, _>("/no-slash", TextCodec)
        .is_err());
    assert!(!factory.has_synced());
    factory.start();
    tokio::time::timeout(Duration::from_secs(30), factory.wait_for_cache_sync())
        .await
        .expect("all synced");
    let key = "ns0/k0000";
    assert!(
        Arc::ptr_eq(&a.lister().get(key).unwrap(), &b.lister().get(key).unwrap()),
        "one shared cache"
    );
    assert_eq!(
        (a.lister().len(), c.lister().len(), d.lister().len()),
        (12, 12, 3)
    );
    factory.shutdown().await;
}

/// Connects to one member only, with short request timeouts, so the test controls which member
/// the informer talks to.
async fn connect_member(endpoint: String) -> Client {
    Client::connect([endpoint], Some(etcd_informer::connect_options()))
        .await
        .unwrap()
}

#[tokio::test]
async fn leaderless_or_frozen_member_is_noticed_not_waited_on() {
    let cluster = EtcdCluster::start(3)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let prefix = "/noticed/";
    let client = connect_member(cluster.member_endpoint(0)).await;
    client
        .kv_client()
        .put(format!("{prefix}ns/a"), "1", None)
        .await
        .unwrap();
    let errors: Arc<Mutex<Vec<String>>> = Default::default();
    let e = errors.clone();
    let lw =
        EtcdListerWatcher::with_options(client.clone(), prefix, TextCodec, quick_etcd_options())
            .unwrap();
    let informer = SharedIndexInformer::new(
        lw,
        informer_options(Duration::from_millis(200)).with_watch_error_handler(Some(Arc::new(
            move |err: &etcd_informer::listwatch::Error| e.lock().unwrap().push(err.to_string()),
        ))),
    );
    tokio::spawn(informer.clone().run());
    tokio::time::timeout(Duration::from_secs(30), informer.wait_for_cache_sync())
        .await
        .expect("synced");

    // Member 0 loses its peers: with require-leader, etcd cancels the watch ("no leader")
    // instead of leaving it silently stale.
    cluster.stop_member(1).await.unwrap();
    cluster.stop_member(2).await.unwrap();
    eventually(
        "watch error reported without a leader",
        Duration::from_secs(20),
        || !errors.lock().unwrap().is_empty(),
    )
    .await;
    let first = errors.lock().unwrap()[0].clone();
    eprintln!("first watch error: {first}");
    assert!(
        first.to_lowercase().contains("leader") || first.contains("heard nothing"),
        "{first}"
    );
    cluster.restart_member(1).await.unwrap();
    cluster.restart_member(2).await.unwrap();

    // Member 0 freezes (SIGSTOP): no event, no progress; the silent watch is declared dead.
    let before = errors.lock().unwrap().len();
    cluster.pause_member(0).unwrap();
    eventually("frozen member detected", Duration::from_secs(20), || {
        errors.lock().unwrap().len() > before
    })
    .await;
    cluster.resume_member(0).unwrap();
    let writer = connect_member(cluster.member_endpoint(1)).await;
    let key = format!("{prefix}ns/b");
    put_accepted(&writer, &key, "2", Duration::from_secs(30)).await;
    converges(&informer, &writer, prefix, Duration::from_secs(30)).await;
}

#[tokio::test]
async fn pages_too_large_for_a_message_are_split() {
    let client = shared_client().await;
    let prefix = unique_prefix("split_pages");
    let value = "v".repeat(1 << 20);
    for i in 0..6 {
        client
            .kv_client()
            .put(format!("{prefix}ns/k{i}"), value.clone(), None)
            .await
            .unwrap();
    }
    // 6 MiB in one page against a 3 MiB message limit: the list must shrink its pages.
    let etcd = quick_etcd_options()
        .with_page_size(100)
        .with_max_message_bytes(3 << 20);
    let r = start(&client, &prefix, etcd, Duration::from_millis(100));
    synced(&r).await;
    assert_eq!(r.informer.lister().len(), 6);
    assert_eq!(
        r.lists.load(Ordering::SeqCst),
        1,
        "one list, split into pages, no failure"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn options_out_of_range_are_refused_naming_the_option() {
    let client = shared_client().await;
    for (options, name) in [
        (
            EtcdOptions::default().with_max_message_bytes(0),
            "max_message_bytes",
        ),
        (
            EtcdOptions::default().with_page_timeout(Duration::ZERO),
            "page_timeout",
        ),
        (EtcdOptions::default().with_page_size(0), "page_size"),
    ] {
        let error = EtcdListerWatcher::with_options(client.clone(), "/x/", TextCodec, options)
            .err()
            .expect("refused");
        assert!(
            matches!(&error, ConfigError::Option { name: n, .. } if *n == name),
            "{error}"
        );
        assert!(error.to_string().contains(name), "{error}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_whole_keyspace_can_be_watched_with_an_empty_raw_prefix() {
    let server = EtcdServer::start().await.unwrap_or_else(|e| panic!("{e}"));
    let client = server.client().await;
    client.kv_client().put("a", "1", None).await.unwrap();
    client.kv_client().put("/deep/b", "2", None).await.unwrap();
    let etcd = quick_etcd_options().with_raw_prefix(true);
    let r = start(&client, "", etcd, Duration::from_millis(50));
    synced(&r).await;
    client.kv_client().put("zz", "3", None).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while cache_state(&r.informer).len() < 3 {
        assert!(
            std::time::Instant::now() < deadline,
            "{:?}",
            cache_state(&r.informer)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let keys: Vec<String> = cache_state(&r.informer).into_keys().collect();
    assert_eq!(keys, ["/deep/b", "a", "zz"]);
}

/// A text codec that counts its decodes.
struct CountingCodec(Arc<AtomicUsize>);

impl etcd_informer::codec::Codec<String> for CountingCodec {
    fn decode(&self, bytes: &[u8]) -> Result<String, etcd_informer::codec::CodecError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        TextCodec.decode(bytes)
    }
    fn encode(&self, value: &String) -> Result<Vec<u8>, etcd_informer::codec::CodecError> {
        TextCodec.encode(value)
    }
}

/// A sink that already holds one object unchanged and records what it receives.
struct Recording {
    reuse: Arc<etcd_informer::Object<String>>,
    begun: Mutex<Option<(i64, usize)>>,
    pages: Mutex<Vec<Vec<Arc<etcd_informer::Object<String>>>>>,
}

impl etcd_informer::ListSink<String> for Recording {
    fn begin(&self, revision: i64, keys: usize) {
        *self.begun.lock().unwrap() = Some((revision, keys));
    }
    fn unchanged(&self, key: &str, stamp: &etcd_informer::Stamp) -> bool {
        key == self.reuse.key() && Some(*stamp) == self.reuse.stamp()
    }
    fn page(&self, objects: Vec<Arc<etcd_informer::Object<String>>>) {
        self.pages.lock().unwrap().push(objects);
    }
}

#[tokio::test]
async fn list_into_hands_over_pages_and_skips_keys_the_sink_holds_unchanged() {
    use etcd_informer::ListerWatcher;
    let client = shared_client().await;
    let prefix = unique_prefix("list_into");
    put_many(&client, &prefix, 30, "v").await;
    let decodes = Arc::new(AtomicUsize::new(0));
    let lw = EtcdListerWatcher::with_options(
        client.clone(),
        prefix.clone(),
        CountingCodec(decodes.clone()),
        EtcdOptions::default().with_page_size(10),
    )
    .unwrap();
    let first = lw.list().await.unwrap();
    assert_eq!(decodes.load(Ordering::SeqCst), 30);
    let cached = Arc::new(first.items[0].clone());
    let sink = Arc::new(Recording {
        reuse: cached.clone(),
        begun: Mutex::new(None),
        pages: Mutex::new(Vec::new()),
    });
    let revision = lw.list_into(sink.clone()).await.unwrap();
    assert_eq!(revision, first.revision);
    assert_eq!(*sink.begun.lock().unwrap(), Some((first.revision, 30)));
    let pages = sink.pages.lock().unwrap();
    assert_eq!(pages.len(), 3, "pages of at most 10 keys");
    let objects: Vec<_> = pages.iter().flatten().collect();
    assert_eq!(objects.len(), 29);
    assert!(
        objects.iter().all(|o| o.key() != cached.key()),
        "the unchanged key is kept by the sink, not handed over"
    );
    assert_eq!(
        decodes.load(Ordering::SeqCst),
        30 + 29,
        "the unchanged key is not decoded again"
    );
}

/// A relist of a compact cache after a compaction keeps what did not change as it is: the
/// source decodes, and the cache packs (encodes), only the changed and new keys, not the whole
/// prefix a second time; handlers still get the tombstone, the update and the add.
#[tokio::test]
async fn compact_cache_relist_decodes_only_what_changed() {
    let server = EtcdServer::start().await.unwrap_or_else(|e| panic!("{e}"));
    let client = connect(server.endpoints()).await.unwrap();
    let prefix = "/compact-relist/";
    put_many(&client, prefix, 20, "v1").await;
    let listed = Arc::new(AtomicUsize::new(0));
    let lw = EtcdListerWatcher::with_options(
        client.clone(),
        prefix,
        CountingCodec(listed.clone()),
        quick_etcd_options(),
    )
    .unwrap();
    // No index: nothing needs an unchanged object decoded, not even to index it.
    let packed = Arc::new(AtomicUsize::new(0));
    let options = informer_options(Duration::from_secs(6))
        .with_indexers(std::collections::HashMap::new())
        .with_compact_cache(CountingEncodes(packed.clone()));
    let informer = SharedIndexInformer::new(lw, options);
    let log = Log::default();
    informer.add_event_handler(recorder(&log)).unwrap();
    tokio::spawn(informer.clone().run());
    tokio::time::timeout(Duration::from_secs(30), informer.wait_for_cache_sync())
        .await
        .expect("synced");
    assert_eq!(listed.load(Ordering::SeqCst), 20);
    assert_eq!(packed.load(Ordering::SeqCst), 20);

    // Behind the informer's back (its reconnect waits 6 s): one delete, one update, one add,
    // and a compaction past the revision it watches.
    server.stop().await.unwrap();
    server.start_again().await.unwrap();
    let other = connect(server.endpoints()).await.unwrap();
    let mut kv = other.kv_client();
    kv.delete(format!("{prefix}ns0/k0000"), None).await.unwrap();
    kv.put(format!("{prefix}ns1/k0001"), "v2", None)
        .await
        .unwrap();
    let put = kv.put(format!("{prefix}ns/new"), "v1", None).await.unwrap();
    kv.compact(put.header().unwrap().revision(), None)
        .await
        .unwrap();
    let wanted = [
        "tombstone ns0/k0000=v1",
        "update ns1/k0001=v1->v2",
        "add ns/new=v1",
    ];
    eventually(
        "the relist's notifications",
        Duration::from_secs(30),
        || {
            let log = log.lock().unwrap();
            wanted.iter().all(|w| log.iter().any(|l| l == w))
        },
    )
    .await;
    assert_eq!(
        listed.load(Ordering::SeqCst),
        20 + 2,
        "the relist decoded only the updated and the new key"
    );
    assert_eq!(
        packed.load(Ordering::SeqCst),
        20 + 2,
        "the relist packed only the updated and the new key"
    );
    converges(&informer, &other, prefix, Duration::from_secs(30)).await;
}

/// A text codec that counts its encodes (what a compact cache packs).
struct CountingEncodes(Arc<AtomicUsize>);

impl etcd_informer::codec::Codec<String> for CountingEncodes {
    fn decode(&self, bytes: &[u8]) -> Result<String, etcd_informer::codec::CodecError> {
        TextCodec.decode(bytes)
    }
    fn encode(&self, value: &String) -> Result<Vec<u8>, etcd_informer::codec::CodecError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        TextCodec.encode(value)
    }
}

/// A value whose `secret` is not written back: packed, it would not decode again.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Item {
    n: u64,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    secret: Option<String>,
    #[serde(skip_serializing)]
    hidden: String,
}

#[tokio::test]
async fn compact_cache_reads_as_etcd_and_hands_handlers_decoded_objects() {
    let client = shared_client().await;
    let prefix = unique_prefix("compact");
    let mut kv = client.kv_client();
    let lease = client.lease_client().grant(600, None).await.unwrap().id();
    for i in 0..40 {
        let value = format!(r#"{{"n":{i},"hidden":"h{i}"}}"#);
        let options = (i == 7).then(|| etcd_client::PutOptions::new().with_lease(lease));
        kv.put(format!("{prefix}ns{}/k{i:02}", i % 2), value, options)
            .await
            .unwrap();
    }
    let lw = EtcdListerWatcher::with_options(
        client.clone(),
        prefix.as_str(),
        etcd_informer::JsonCodec::<Item>::new(),
        quick_etcd_options(),
    )
    .unwrap();
    let options = InformerOptions::default()
        .with_name("compact-test")
        .with_compact_cache(etcd_informer::JsonCodec::<Item>::new());
    let informer = SharedIndexInformer::new(lw, options);
    let log = Arc::new(Mutex::new(Vec::<String>::new()));
    let (u, d) = (log.clone(), log.clone());
    informer
        .add_event_handler(
            etcd_informer::ResourceEventHandlerFuncs::new()
                .on_update(move |old: &Arc<etcd_informer::Object<Item>>, new| {
                    let line = format!(
                        "update {} {}/{}",
                        new.key(),
                        old.value.hidden,
                        new.value.hidden
                    );
                    u.lock().unwrap().push(line);
                })
                .on_delete(move |deleted| {
                    let o = deleted.object();
                    d.lock()
                        .unwrap()
                        .push(format!("delete {} {}", o.key(), o.value.hidden));
                }),
        )
        .unwrap();
    tokio::spawn(informer.clone().run());
    tokio::time::timeout(Duration::from_secs(30), informer.wait_for_cache_sync())
        .await
        .expect("synced within 30 s");
    let indexer = informer.indexer();
    assert!(indexer.is_compact());
    // Every field of every object, as etcd has it: the value (its `hidden` part kept although
    // the codec does not write it back: such objects stay decoded) and all four revisions.
    let listed = kv
        .get(
            prefix.as_str(),
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    assert_eq!(indexer.len(), 40);
    for kv in listed.kvs() {
        let key = &kv.key_str().unwrap()[prefix.len()..];
        let o = indexer.get_by_key(key).expect(key);
        let want: Item = serde_json::from_slice(kv.value()).unwrap();
        assert_eq!(o.value, want, "{key}");
        assert_eq!(
            (o.mod_revision, o.create_revision, o.version, o.lease),
            (
                kv.mod_revision(),
                kv.create_revision(),
                kv.version(),
                kv.lease()
            ),
            "{key}"
        );
    }
    assert_eq!(
        informer.lister().by_namespace("ns1").unwrap().len(),
        20,
        "the namespace index"
    );
    // A value that round-trips is packed; handlers get the old object decoded from it.
    kv.put(
        format!("{prefix}ns0/k00"),
        r#"{"n":100,"hidden":"new"}"#,
        None,
    )
    .await
    .unwrap();
    kv.put(
        format!("{prefix}ns1/k01"),
        r#"{"n":1,"secret":"s","hidden":"x"}"#,
        None,
    )
    .await
    .unwrap();
    kv.delete(format!("{prefix}ns1/k01"), None).await.unwrap();
    eventually(
        "the delete reaches the handler",
        Duration::from_secs(10),
        || log.lock().unwrap().iter().any(|l| l.starts_with("delete")),
    )
    .await;
    assert_eq!(
        *log.lock().unwrap(),
        [
            "update ns0/k00 h0/new",
            "update ns1/k01 h1/x",
            "delete ns1/k01 x",
        ]
    );
    assert_eq!(indexer.get_by_key("ns0/k00").unwrap().value.n, 100);
    assert!(indexer.get_by_key("ns1/k01").is_none());
    assert_eq!(indexer.len(), 39);
}

/// Issue 33, finding 5: the audit compares like with like. A key undecodable at the audited
/// revision, fixed after it (before or while the audit reads etcd), is still left out of that
/// revision's keys, as the cache lacked it then: no lost event reported, no relist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_fixed_after_the_audited_revision_is_still_left_out_of_it() {
    use etcd_informer::ListerWatcher;
    use tokio_stream::StreamExt;
    let client = shared_client().await;
    let prefix = unique_prefix("audit_like_with_like");
    let mut kv = client.kv_client();
    kv.put(format!("{prefix}good"), "ok", None).await.unwrap();
    kv.put(format!("{prefix}bad"), vec![0xff_u8, 0xfe], None)
        .await
        .unwrap();
    let lw = EtcdListerWatcher::new(client.clone(), prefix.as_str(), TextCodec).unwrap();
    let listed = lw.list().await.expect("list");
    assert_eq!(listed.items.len(), 1, "the undecodable key is left out");
    let audited = listed.revision;
    let mut watch = lw.watch(audited).await.expect("watch");
    let fixed = kv.put(format!("{prefix}bad"), "fixed", None).await.unwrap();
    let fixed = fixed.header().unwrap().revision();
    // The watch decodes the fixed value: the key is an object again from `fixed` on.
    loop {
        let event = tokio::time::timeout(Duration::from_secs(10), watch.next())
            .await
            .expect("the fix's event")
            .expect("stream");
        if event.revision() == Some(fixed) {
            break;
        }
    }
    let keys = Arc::new(Mutex::new(Vec::new()));
    let sink = keys.clone();
    lw.key_revisions(
        audited,
        Box::new(move |page| sink.lock().unwrap().extend(page)),
    )
    .await
    .expect("keys at the audited revision");
    let keys: Vec<String> = keys
        .lock()
        .unwrap()
        .iter()
        .map(|(k, _)| k.to_string())
        .collect();
    assert_eq!(
        keys,
        ["good"],
        "at revision {audited} the cache held only `good`"
    );
    // At the fix's revision the key is an object, and counted.
    let keys = Arc::new(Mutex::new(Vec::new()));
    let sink = keys.clone();
    lw.key_revisions(
        fixed,
        Box::new(move |page| sink.lock().unwrap().extend(page)),
    )
    .await
    .expect("keys at the fix");
    assert_eq!(keys.lock().unwrap().len(), 2);
}
