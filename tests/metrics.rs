//! The latency of a change by stage, against a real etcd: every change applied through the
//! etcd watch is timed from the watch task receiving it to the cache applying it, and from
//! the cache to each handler starting on it (`etcd_informer_stage_seconds`).
#![cfg(all(feature = "testing", feature = "metrics"))]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::shared_client;
use etcd_informer::testing::etcd::unique_prefix;
use etcd_informer::{
    EtcdListerWatcher, InformerOptions, ResourceEventHandlerFuncs, SharedIndexInformer, TextCodec,
};
use metrics_exporter_prometheus::PrometheusBuilder;

/// The value of the rendered series whose line starts with `series`.
fn value(rendered: &str, series: &str) -> Option<f64> {
    rendered
        .lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_change_is_timed_by_stage() {
    const CHANGES: usize = 50;
    let client = shared_client().await;
    let prefix = unique_prefix("stages");
    let recorder = PrometheusBuilder::new()
        .set_buckets(&[0.001, 0.01, 0.1, 1.0])
        .unwrap()
        .build_recorder();
    let handle = recorder.handle();
    let seen = Arc::new(AtomicUsize::new(0));
    // Handles are registered with the recorder current when the informer and its handler are
    // created; they record into it from any thread afterwards.
    let informer = metrics::with_local_recorder(&recorder, || {
        let lw = EtcdListerWatcher::new(client.clone(), prefix.as_str(), TextCodec).unwrap();
        let informer = SharedIndexInformer::new(lw, InformerOptions::default().with_name("stages"));
        let s = seen.clone();
        informer
            .add_named_event_handler(
                "counter",
                ResourceEventHandlerFuncs::<String>::new().on_add(move |_, _| {
                    s.fetch_add(1, Ordering::Relaxed);
                }),
            )
            .unwrap();
        informer
    });
    tokio::spawn(informer.clone().run());
    tokio::time::timeout(Duration::from_secs(30), informer.wait_for_cache_sync())
        .await
        .expect("synced");
    let mut kv = client.kv_client();
    for i in 0..CHANGES {
        kv.put(format!("{prefix}k{i}"), "v", None).await.unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while seen.load(Ordering::Relaxed) < CHANGES {
        assert!(Instant::now() < deadline, "the handler saw every change");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let rendered = handle.render();
    let watch = value(
        &rendered,
        r#"etcd_informer_stage_seconds_count{informer="stages",stage="watch_to_cache"}"#,
    );
    let handler = value(
        &rendered,
        r#"etcd_informer_stage_seconds_count{informer="stages",stage="cache_to_handler",handler="counter"}"#,
    );
    assert_eq!(watch, Some(CHANGES as f64), "{rendered}");
    assert_eq!(handler, Some(CHANGES as f64), "{rendered}");
    // Each stage took under a second on loopback: the sums are real durations, not garbage.
    for stage in ["watch_to_cache", "cache_to_handler"] {
        let under_a_second = rendered
            .lines()
            .find(|l| {
                l.starts_with("etcd_informer_stage_seconds_bucket")
                    && l.contains(&format!("stage=\"{stage}\""))
                    && l.contains("le=\"1\"")
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok());
        assert_eq!(under_a_second, Some(CHANGES as f64), "{stage}: {rendered}");
    }
}

/// The cache server's stage: every watch response carrying changes is timed from its cache
/// applying the revision to the response leaving for the client (`cache_to_watcher`).
#[cfg(feature = "server")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_server_times_its_responses_to_each_watcher() {
    use etcd_client::WatchOptions;
    let etcd = etcd_informer::testing::etcd::test_etcd()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let client = etcd.client().await;
    let prefix = unique_prefix("server_stage");
    let recorder = PrometheusBuilder::new()
        .set_buckets(&[0.001, 0.01, 0.1, 1.0])
        .unwrap()
        .build_recorder();
    let handle = recorder.handle();
    // The stage's handle is registered as the server binds, on this thread (the test's own,
    // where its future runs): it records into this recorder from any thread afterwards.
    let _recorder = metrics::set_default_local_recorder(&recorder);
    let server = etcd_informer::serve::CacheServer::new(
        client.clone(),
        etcd.endpoints.clone(),
        prefix.as_str(),
    )
    .bind("127.0.0.1:0".parse().unwrap())
    .await
    .expect("the cache server binds");
    server.ready(Duration::from_secs(30)).await.expect("ready");
    let mut via = etcd_informer::connect([server.local_addr().to_string()])
        .await
        .expect("connect to the server");
    // From a known revision: a watch from "now" could start after the first put.
    let now = via
        .kv_client()
        .get(prefix.as_str(), None)
        .await
        .expect("a read through the server")
        .header()
        .expect("a header")
        .revision();
    let options = WatchOptions::new()
        .with_prefix()
        .with_start_revision(now + 1);
    let (_watcher, mut stream) = via
        .watch(prefix.as_str(), Some(options))
        .await
        .expect("watch through the server")
        .split();
    let mut kv = client.kv_client();
    const CHANGES: usize = 5;
    let mut seen = 0;
    for i in 0..CHANGES {
        kv.put(format!("{prefix}k{i}"), "v", None).await.unwrap();
        while seen <= i {
            let response = tokio::time::timeout(Duration::from_secs(10), stream.message())
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "no event within 10 s for change {i}: {:?} {:?}",
                        server.stats(),
                        server.health()
                    )
                })
                .expect("the stream goes on")
                .expect("a response");
            seen += response.events().len();
        }
    }
    let rendered = handle.render();
    let series = format!(
        r#"etcd_informer_stage_seconds_count{{informer="{prefix}",stage="cache_to_watcher"}}"#
    );
    let sent = value(&rendered, &series).unwrap_or_else(|| panic!("{series} in {rendered}"));
    assert!(
        (1.0..=CHANGES as f64).contains(&sent),
        "{sent} responses timed for {CHANGES} changes: {rendered}"
    );
    server.shutdown().await;
}

/// A cache server's metrics of what its cache serves carry each served prefix as their own
/// series: a range of one prefix and a watch of the other count each under its own prefix.
#[cfg(feature = "server")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_server_counts_each_prefix_in_its_own_series() {
    use etcd_client::WatchOptions;
    let etcd = etcd_informer::testing::etcd::test_etcd()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let client = etcd.client().await;
    let ranged = unique_prefix("server_prefix_ranged");
    let watched = unique_prefix("server_prefix_watched");
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    // The handles are registered as the server binds, on this thread.
    let _recorder = metrics::set_default_local_recorder(&recorder);
    let server =
        etcd_informer::serve::CacheServer::new(client.clone(), etcd.endpoints.clone(), &*ranged)
            .with_prefix(watched.as_str())
            .bind("127.0.0.1:0".parse().unwrap())
            .await
            .expect("the cache server binds");
    server.ready(Duration::from_secs(30)).await.expect("ready");
    let via = etcd_informer::connect([server.local_addr().to_string()])
        .await
        .expect("connect to the server");
    for _ in 0..3 {
        via.kv_client()
            .get(
                ranged.as_str(),
                Some(etcd_client::GetOptions::new().with_serializable()),
            )
            .await
            .expect("a read through the server");
    }
    let (_watcher, mut stream) = via
        .watch_client()
        .watch(watched.as_str(), Some(WatchOptions::new().with_prefix()))
        .await
        .expect("watch through the server")
        .split();
    let created = stream.message().await.expect("stream").expect("created");
    assert!(created.created());
    client
        .kv_client()
        .put(format!("{watched}k"), "v", None)
        .await
        .unwrap();
    let event = tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("the event")
        .expect("stream")
        .expect("a response");
    assert_eq!(event.events().len(), 1);
    let series = |name: &str, prefix: &str| format!(r#"{name}{{prefix="{prefix}"}}"#);
    // Sampled every second.
    let want = [
        (series("etcd_informer_server_ranges_total", &ranged), 3.0),
        (series("etcd_informer_server_ranges_total", &watched), 0.0),
        (series("etcd_informer_server_watches", &watched), 1.0),
        (series("etcd_informer_server_watches", &ranged), 0.0),
        (
            series("etcd_informer_server_events_sent_total", &watched),
            1.0,
        ),
        (
            series("etcd_informer_server_events_sent_total", &ranged),
            0.0,
        ),
    ];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let rendered = handle.render();
        let got: Vec<Option<f64>> = want.iter().map(|(s, _)| value(&rendered, s)).collect();
        if want.iter().zip(&got).all(|((_, w), g)| *g == Some(*w)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "per-prefix series {want:?}, got {got:?} in {rendered}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    server.shutdown().await;
}
