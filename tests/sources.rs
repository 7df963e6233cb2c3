//! Sources as users write them (issue 55): a wrapper that changes one thing and forwards the
//! rest in one line keeps every capability of the source it wraps (a warm start and a
//! consistent read through it); a source with only `list` and `watch` (and no capabilities)
//! drives an informer and says what it cannot do.
#![cfg(feature = "testing")]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{converges, shared_client, Counting};
use etcd_informer::listwatch::{
    BoxFuture, Capabilities, ListResult, ListerWatcher, Result, WatchStream,
};
use etcd_informer::snapshot::{SnapshotOptions, SnapshotStart};
use etcd_informer::testing::etcd::unique_prefix;
use etcd_informer::{EtcdListerWatcher, InformerOptions, SharedIndexInformer, TextCodec};

const WITHIN: Duration = Duration::from_secs(30);

/// An informer over `source` with a snapshot at `path`, synced.
async fn synced<L: ListerWatcher<String>>(
    source: L,
    prefix: &str,
    path: &std::path::Path,
) -> (SharedIndexInformer<String>, tokio::task::JoinHandle<()>) {
    let options = InformerOptions::default()
        .with_name(prefix.to_owned())
        .with_snapshot_options(SnapshotOptions::new(path, TextCodec));
    let informer = SharedIndexInformer::new(source, options);
    let run = tokio::spawn(informer.clone().run());
    tokio::time::timeout(WITHIN, informer.wait_for_cache_sync())
        .await
        .expect("synced within 30 s");
    (informer, run)
}

async fn stopped(informer: SharedIndexInformer<String>, run: tokio::task::JoinHandle<()>) {
    informer.stop();
    tokio::time::timeout(WITHIN, run)
        .await
        .expect("run ended")
        .expect("run did not panic");
}

fn snapshot_path(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "etcd-informer-sources-test-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join("cache.snap")
}

/// `Counting` (tests/common) implements what it changes (`list`, `list_into`, `watch`) and
/// forwards the rest with `capabilities`: through it, an informer starts warm from its
/// snapshot (no list) and answers a consistent read, as over the etcd source itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrapper_keeps_warm_starts_and_consistent_reads() {
    let client = shared_client().await;
    let prefix = unique_prefix("sources_wrapper");
    for i in 0..20 {
        let key = format!("{prefix}k{i:02}");
        client
            .kv_client()
            .put(key, format!("v{i}"), None)
            .await
            .expect("put");
    }
    let path = snapshot_path("wrapper");
    let counting = || {
        let lists = Arc::new(AtomicUsize::new(0));
        let source = Counting {
            inner: EtcdListerWatcher::new(client.clone(), prefix.as_str(), TextCodec)
                .expect("source"),
            lists: lists.clone(),
            watches: Arc::default(),
            held: Arc::default(),
        };
        (source, lists)
    };
    let (source, lists) = counting();
    let (first, run) = synced(source, &prefix, &path).await;
    assert_eq!(lists.load(Ordering::SeqCst), 1, "a cold start lists once");
    stopped(first, run).await;
    assert!(path.exists(), "a snapshot was written through the wrapper");

    client
        .kv_client()
        .put(format!("{prefix}k00"), "changed", None)
        .await
        .expect("put");
    let (source, lists) = counting();
    let (second, run) = synced(source, &prefix, &path).await;
    assert!(
        matches!(
            second.snapshot_start(),
            Some(SnapshotStart::Warm { keys: 20, .. })
        ),
        "{:?}",
        second.snapshot_start()
    );
    assert_eq!(
        lists.load(Ordering::SeqCst),
        0,
        "a warm start reads no list"
    );
    let written = client
        .kv_client()
        .put(format!("{prefix}k01"), "read", None)
        .await
        .expect("put")
        .header()
        .expect("header")
        .revision();
    let lister = tokio::time::timeout(WITHIN, second.consistent_lister(Duration::from_secs(10)))
        .await
        .expect("an answer")
        .expect("a consistent read through the wrapper");
    let read = lister.get("k01").expect("the key");
    assert_eq!(read.value, "read");
    assert!(second.revision() >= written);
    converges(&second, &client, &prefix, WITHIN).await;
    stopped(second, run).await;
}

/// A source that lists and watches, and can do nothing more.
struct ListAndWatch(EtcdListerWatcher<String>);

impl ListerWatcher<String> for ListAndWatch {
    fn list(&self) -> BoxFuture<'_, Result<ListResult<String>>> {
        self.0.list()
    }
    fn watch(&self, after: i64) -> BoxFuture<'_, Result<WatchStream<String>>> {
        self.0.watch(after)
    }
    fn capabilities(&self) -> Capabilities<'_> {
        Capabilities::none()
    }
}

/// A source with only `list` and `watch` (its capabilities `none`) drives an informer (its
/// cache follows etcd), and says what it cannot do: it starts cold saying it cannot resume, no
/// snapshot is written (it names no store), a consistent read fails saying the source cannot
/// prove a cache fresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_with_only_list_and_watch_drives_an_informer_and_says_what_it_cannot() {
    let client = shared_client().await;
    let prefix = unique_prefix("sources_minimal");
    client
        .kv_client()
        .put(format!("{prefix}a"), "1", None)
        .await
        .expect("put");
    let path = snapshot_path("minimal");
    let source = ListAndWatch(
        EtcdListerWatcher::new(client.clone(), prefix.as_str(), TextCodec).expect("source"),
    );
    let (informer, run) = synced(source, &prefix, &path).await;
    client
        .kv_client()
        .put(format!("{prefix}b"), "2", None)
        .await
        .expect("put");
    converges(&informer, &client, &prefix, WITHIN).await;
    match informer.snapshot_start() {
        Some(SnapshotStart::Cold { reason }) => {
            assert!(reason.contains("cannot resume"), "{reason}")
        }
        other => panic!("a cold start saying why, not {other:?}"),
    }
    let Err(refused) = informer.consistent_lister(Duration::from_secs(2)).await else {
        panic!("a consistent read without a freshness proof");
    };
    assert!(
        refused.to_string().contains("cannot prove a cache fresh"),
        "{refused}"
    );
    stopped(informer, run).await;
    assert!(
        !path.exists(),
        "a source that names no store gets no snapshot"
    );
}
