//! Warm restart from a local snapshot (issue 26), against a real etcd (`ETCD_BIN`): a warm start
//! reads no list and then hears what changed while it was down; a snapshot etcd compacted past
//! is loaded and the relist adopts its unchanged keys without decoding them; every bad snapshot
//! (truncated, corrupt, another cluster, a replaced store, a tally that differs, another prefix
//! or codec) gives a cold start naming the reason and a correct cache; a crash mid-write leaves
//! the previous snapshot usable.
#![cfg(feature = "testing")]

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{converges, eventually, shared_client, Counting};
use etcd_client::Client;
use etcd_informer::codec::{Codec, CodecError};
use etcd_informer::snapshot::{SnapshotOptions, SnapshotStart};
use etcd_informer::testing::etcd::{unique_prefix, EtcdServer};
use etcd_informer::{
    EtcdListerWatcher, InformerOptions, ResourceEventHandlerFuncs, SharedIndexInformer, TextCodec,
};

const WITHIN: Duration = Duration::from_secs(30);

/// UTF-8 text, counting its decodes (to tell adopted keys from decoded ones).
#[derive(Clone, Default)]
struct CountingText(Arc<AtomicUsize>);

impl Codec<String> for CountingText {
    fn decode(&self, bytes: &[u8]) -> Result<String, CodecError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        TextCodec.decode(bytes)
    }
    fn encode(&self, value: &String) -> Result<Vec<u8>, CodecError> {
        TextCodec.encode(value)
    }
}

/// Another codec type for the same `String`s: its snapshots are not the first one's.
struct OtherText;

impl Codec<String> for OtherText {
    fn decode(&self, bytes: &[u8]) -> Result<String, CodecError> {
        TextCodec.decode(bytes)
    }
    fn encode(&self, value: &String) -> Result<Vec<u8>, CodecError> {
        TextCodec.encode(value)
    }
}

/// A running informer with snapshots on, its source's list count and what handlers heard.
struct Running {
    informer: SharedIndexInformer<String>,
    lists: Arc<AtomicUsize>,
    log: Arc<Mutex<Vec<String>>>,
    run: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Stops the informer (which writes its snapshot) and waits for it to end.
    async fn stop(self) {
        self.informer.stop();
        tokio::time::timeout(WITHIN, self.run)
            .await
            .expect("run ended")
            .expect("run did not panic");
    }

    fn start(&self) -> SnapshotStart {
        self.informer.snapshot_start().expect("decided once synced")
    }

    fn lists(&self) -> usize {
        self.lists.load(Ordering::SeqCst)
    }
}

async fn start(
    client: &Client,
    prefix: &str,
    snapshot: SnapshotOptions<String>,
    codec: impl Codec<String>,
) -> Running {
    let lists = Arc::new(AtomicUsize::new(0));
    let lw = Counting {
        inner: EtcdListerWatcher::new(client.clone(), prefix, codec).expect("source"),
        lists: lists.clone(),
        watches: Arc::default(),
        held: Arc::default(),
    };
    let options = InformerOptions::default()
        .with_name(prefix.to_owned())
        .with_snapshot_options(snapshot);
    let informer = SharedIndexInformer::new(lw, options);
    let log = Arc::new(Mutex::new(Vec::new()));
    let (a, u, d) = (log.clone(), log.clone(), log.clone());
    informer
        .add_event_handler(
            ResourceEventHandlerFuncs::new()
                .on_add(move |o, initial| {
                    let kind = if initial { "initial" } else { "add" };
                    a.lock()
                        .unwrap()
                        .push(format!("{kind} {}={}", o.key(), o.value))
                })
                .on_update(move |_, o| {
                    u.lock()
                        .unwrap()
                        .push(format!("update {}={}", o.key(), o.value))
                })
                .on_delete(move |o| {
                    let kind = if o.is_final_state_unknown() {
                        "tombstone"
                    } else {
                        "delete"
                    };
                    d.lock().unwrap().push(format!("{kind} {}", o.key()))
                }),
        )
        .expect("handler");
    let run = tokio::spawn(informer.clone().run());
    tokio::time::timeout(WITHIN, informer.wait_for_cache_sync())
        .await
        .expect("synced within 30 s");
    Running {
        informer,
        lists,
        log,
        run,
    }
}

fn snapshot_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "etcd-informer-snapshot-test-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join("cache.snap")
}

fn options(path: &Path) -> SnapshotOptions<String> {
    SnapshotOptions::new(path, TextCodec)
}

async fn put_keys(client: &Client, prefix: &str, n: usize) -> i64 {
    let mut kv = client.kv_client();
    let mut revision = 0;
    for i in 0..n {
        let put = kv
            .put(format!("{prefix}ns/k{i:03}"), format!("v{i}"), None)
            .await
            .expect("put");
        revision = put.header().map_or(0, |h| h.revision());
    }
    revision
}

/// Fills `prefix` with `n` keys, runs an informer with a snapshot at `path` and stops it,
/// which writes the snapshot; returns the snapshot's revision (read from its header).
async fn snapshot_of(client: &Client, prefix: &str, path: &Path, n: usize) -> i64 {
    let revision = put_keys(client, prefix, n).await;
    let first = start(client, prefix, options(path), TextCodec).await;
    assert_eq!(
        first.start(),
        SnapshotStart::Cold {
            reason: format!("no snapshot at {} yet (no such file)", path.display())
        }
    );
    eventually("the cache at the last put", WITHIN, || {
        first.informer.revision() >= revision
    })
    .await;
    // The cache may have moved past the last put (other tests write to the same etcd): the
    // snapshot holds the revision it had when it stopped.
    let informer = first.informer.clone();
    first.stop().await;
    assert!(
        path.exists(),
        "the informer wrote its snapshot when it stopped"
    );
    informer.revision()
}

/// A cold start for `reason` (a substring), with one list, and a cache equal to etcd.
async fn assert_cold(run: &Running, client: &Client, prefix: &str, reason: &str) {
    match run.start() {
        SnapshotStart::Cold { reason: why } => {
            assert!(
                why.contains(reason),
                "cold for {why:?}, expected {reason:?}"
            )
        }
        warm => panic!("expected a cold start ({reason}), got {warm}"),
    }
    assert_eq!(run.lists(), 1, "a cold start lists once");
    converges(&run.informer, client, prefix, WITHIN).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_start_reads_no_list_and_hears_the_changes_made_while_down() {
    let client = shared_client().await;
    let prefix = unique_prefix("snapshot_warm");
    let path = snapshot_path("warm");
    let revision = snapshot_of(&client, &prefix, &path, 50).await;

    // While the informer is down: a new key, an update, a delete.
    let mut kv = client.kv_client();
    kv.put(format!("{prefix}ns/new"), "n", None).await.unwrap();
    kv.put(format!("{prefix}ns/k001"), "changed", None)
        .await
        .unwrap();
    kv.delete(format!("{prefix}ns/k002"), None).await.unwrap();

    let decodes = Arc::new(AtomicUsize::new(0));
    let codec = CountingText(decodes.clone());
    let second = start(&client, &prefix, options(&path), codec.clone()).await;
    assert_eq!(second.start(), SnapshotStart::Warm { revision, keys: 50 });
    assert_eq!(second.lists(), 0, "a warm start reads no list");
    converges(&second.informer, &client, &prefix, WITHIN).await;
    eventually("handlers told of the three changes", WITHIN, || {
        second.log.lock().unwrap().len() == 53
    })
    .await;
    let log = second.log.lock().unwrap().clone();
    assert!(
        log[..50].iter().all(|l| l.starts_with("initial ")),
        "the snapshot's objects come first, as adds of an initial list: {log:?}"
    );
    assert_eq!(
        log[50..],
        ["add ns/new=n", "update ns/k001=changed", "delete ns/k002",]
    );
    // Only the changes' two values were read from etcd (the snapshot's are decoded by the
    // snapshot's own codec).
    assert_eq!(decodes.load(Ordering::SeqCst), 2);
    second.stop().await;
}

/// Issue 35: a snapshot whose revision etcd compacted cannot be proven to be this store at its
/// revision: the start is cold, and handlers hear etcd's content only, never the snapshot's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_etcd_compacted_past_starts_cold_and_no_object_of_it_reaches_a_handler() {
    let client = shared_client().await;
    let prefix = unique_prefix("snapshot_compacted");
    let path = snapshot_path("compacted");
    snapshot_of(&client, &prefix, &path, 50).await;
    let mut kv = client.kv_client();
    kv.put(format!("{prefix}ns/new"), "n", None).await.unwrap();
    kv.put(format!("{prefix}ns/k001"), "changed", None)
        .await
        .unwrap();
    let del = kv.delete(format!("{prefix}ns/k002"), None).await.unwrap();
    let now = del.header().map_or(0, |h| h.revision());
    kv.compact(now, None).await.expect("compact");
    let second = start(&client, &prefix, options(&path), TextCodec).await;
    assert_cold(&second, &client, &prefix, "compacted").await;
    let log = second.log.lock().unwrap().clone();
    assert_eq!(log.len(), 50, "{log:?}");
    assert!(
        log.contains(&"initial ns/k001=changed".to_owned()),
        "{log:?}"
    );
    assert!(log.contains(&"initial ns/new=n".to_owned()), "{log:?}");
    assert!(
        !log.iter().any(|l| l.contains("ns/k002")),
        "the key deleted while the informer was down never reaches a handler: {log:?}"
    );
    second.stop().await;
}

/// Issue 35: a compaction landing exactly on the snapshot's next revision (a watch from the
/// snapshot would open at the compaction revision, where etcd 3.4 before 3.4.36 drops deletes):
/// the deletes made while the informer was down are all seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compaction_on_the_snapshots_next_revision_loses_no_delete() {
    // Its own etcd: nothing else writes, so the first delete is the snapshot's next revision.
    let etcd = EtcdServer::start()
        .await
        .unwrap_or_else(|e| panic!("cannot start etcd (set ETCD_BIN or put etcd on PATH): {e}"));
    let client = etcd.client().await;
    let prefix = "/compacted-next/".to_owned();
    let path = snapshot_path("compacted_next");
    let revision = snapshot_of(&client, &prefix, &path, 30).await;
    let mut kv = client.kv_client();
    let mut deleted = Vec::new();
    let mut compact_at = 0;
    for i in 0..15 {
        let key = format!("{prefix}ns/k{i:03}");
        let r = kv.delete(key.as_str(), None).await.unwrap();
        let at = r.header().map_or(0, |h| h.revision());
        if compact_at == 0 {
            compact_at = at;
        }
        deleted.push(format!("ns/k{i:03}"));
    }
    assert_eq!(
        compact_at,
        revision + 1,
        "the compaction lands on the snapshot's next revision"
    );
    kv.compact(compact_at, None).await.expect("compact");
    let second = start(&client, &prefix, options(&path), TextCodec).await;
    assert_cold(&second, &client, &prefix, "compacted").await;
    let log = second.log.lock().unwrap().clone();
    for key in &deleted {
        assert!(
            !log.iter().any(|l| l.contains(key.as_str())),
            "{key}, deleted while down, reached a handler: {log:?}"
        );
    }
    assert_eq!(second.informer.lister().len(), 15);
    second.stop().await;
}

/// Issue 35: a store wiped, refilled with other keys past the snapshot's revision, then
/// compacted: no key of the old store ever reaches a handler or a lister.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_wiped_refilled_and_compacted_never_shows_the_old_store() {
    let etcd = EtcdServer::start()
        .await
        .unwrap_or_else(|e| panic!("cannot start etcd (set ETCD_BIN or put etcd on PATH): {e}"));
    let client = etcd.client().await;
    let prefix = "/wiped/";
    let path = snapshot_path("wiped_refilled");
    let revision = snapshot_of(&client, prefix, &path, 40).await;
    etcd.wipe().await.expect("wipe");
    let client = etcd.client().await;
    let mut kv = client.kv_client();
    let mut now = 0;
    while now <= revision + 5 {
        let r = kv
            .put(format!("{prefix}other/x{now}"), "new", None)
            .await
            .unwrap();
        now = r.header().map_or(0, |h| h.revision());
    }
    kv.compact(now, None).await.expect("compact");
    let second = start(&client, prefix, options(&path), TextCodec).await;
    match second.start() {
        SnapshotStart::Cold { .. } => {}
        warm => panic!("the old store's snapshot was used: {warm}"),
    }
    let log = second.log.lock().unwrap().clone();
    assert!(
        log.iter().all(|l| l.contains("other/")),
        "a key of the old store reached a handler: {log:?}"
    );
    assert!(second
        .informer
        .lister()
        .list()
        .iter()
        .all(|o| o.key().starts_with("other/")));
    converges(&second.informer, &client, prefix, WITHIN).await;
    second.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_or_corrupt_snapshot_starts_cold() {
    let client = shared_client().await;
    let prefix = unique_prefix("snapshot_corrupt");
    let path = snapshot_path("corrupt");
    snapshot_of(&client, &prefix, &path, 20).await;
    let whole = std::fs::read(&path).unwrap();

    std::fs::write(&path, &whole[..whole.len() / 2]).unwrap();
    let run = start(&client, &prefix, options(&path), TextCodec).await;
    assert_cold(&run, &client, &prefix, "truncated").await;
    run.informer.stop();
    let _ = run.run.await;

    let mut flipped = whole.clone();
    let middle = flipped.len() / 2;
    flipped[middle] ^= 0x01;
    std::fs::write(&path, &flipped).unwrap();
    let run = start(&client, &prefix, options(&path), TextCodec).await;
    assert_cold(&run, &client, &prefix, "checksum").await;
    run.informer.stop();
    let _ = run.run.await;

    // A value garbled so that it no longer decodes: values are decoded as the file is read,
    // before its checksum is known, yet the checksum is what the start line names.
    let mut garbled = whole.clone();
    let at = garbled
        .windows(3)
        .position(|w| w == b"v19")
        .expect("a value in the file");
    garbled[at] = 0xff;
    std::fs::write(&path, &garbled).unwrap();
    let run = start(&client, &prefix, options(&path), TextCodec).await;
    assert_cold(&run, &client, &prefix, "checksum").await;
    run.informer.stop();
    let _ = run.run.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_prefix_or_codec_starts_cold() {
    let client = shared_client().await;
    let prefix = unique_prefix("snapshot_identity");
    let path = snapshot_path("identity");
    snapshot_of(&client, &prefix, &path, 10).await;
    let saved = std::fs::read(&path).unwrap();

    let other = unique_prefix("snapshot_identity_other");
    put_keys(&client, &other, 3).await;
    let run = start(&client, &other, options(&path), TextCodec).await;
    assert_cold(&run, &client, &other, &format!("written for {prefix:?}")).await;
    run.stop().await;

    std::fs::write(&path, &saved).unwrap();
    let run = start(
        &client,
        &prefix,
        SnapshotOptions::new(&path, OtherText),
        OtherText,
    )
    .await;
    assert_cold(&run, &client, &prefix, "written with codec").await;
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_cluster_starts_cold() {
    let client = shared_client().await;
    let prefix = unique_prefix("snapshot_cluster");
    let path = snapshot_path("cluster");
    snapshot_of(&client, &prefix, &path, 10).await;

    let other = EtcdServer::start().await.expect("a second etcd");
    let other_client = other.client().await;
    put_keys(&other_client, &prefix, 10).await;
    let run = start(&other_client, &prefix, options(&path), TextCodec).await;
    assert_cold(&run, &other_client, &prefix, "another cluster").await;
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_store_starts_cold() {
    let server = EtcdServer::start().await.expect("etcd");
    let client = server.client().await;
    let prefix = "/snapshot/replaced/";
    let path = snapshot_path("replaced");
    let revision = snapshot_of(&client, prefix, &path, 30).await;
    let saved = std::fs::read(&path).unwrap();

    // Wiped: etcd's revision is now behind the snapshot's.
    server.wipe().await.expect("wipe");
    let client = server.client().await;
    put_keys(&client, prefix, 5).await;
    let run = start(&client, prefix, options(&path), TextCodec).await;
    assert_cold(&run, &client, prefix, "ahead of etcd's").await;
    run.stop().await;

    // Wiped and written past the snapshot's revision: the tally at it differs.
    std::fs::write(&path, &saved).unwrap();
    server.wipe().await.expect("wipe");
    let client = server.client().await;
    let mut kv = client.kv_client();
    for i in 0..revision {
        kv.put(format!("{prefix}other"), format!("{i}"), None)
            .await
            .unwrap();
    }
    let run = start(&client, prefix, options(&path), TextCodec).await;
    assert_cold(&run, &client, prefix, "tally differs").await;
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_mid_write_leaves_the_previous_snapshot_usable() {
    let client = shared_client().await;
    let prefix = unique_prefix("snapshot_crash");
    let path = snapshot_path("crash");
    let revision = snapshot_of(&client, &prefix, &path, 20).await;

    // A crash while writing the next one leaves its temporary file, cut short.
    let mut temp = path.clone().into_os_string();
    temp.push(".tmp");
    let whole = std::fs::read(&path).unwrap();
    std::fs::write(&temp, &whole[..whole.len() / 3]).unwrap();

    let run = start(&client, &prefix, options(&path), TextCodec).await;
    assert_eq!(run.start(), SnapshotStart::Warm { revision, keys: 20 });
    assert_eq!(run.lists(), 0);
    converges(&run.informer, &client, &prefix, WITHIN).await;

    // The next write replaces both.
    client
        .kv_client()
        .put(format!("{prefix}ns/after"), "a", None)
        .await
        .unwrap();
    eventually("the put cached", WITHIN, || {
        run.informer.lister().get("ns/after").is_some()
    })
    .await;
    let written = run.informer.write_snapshot().await.expect("written");
    assert!(
        written.is_some_and(|r| r >= revision),
        "written at {written:?}"
    );
    assert!(
        !Path::new(&temp).exists(),
        "the temporary file was renamed over the snapshot"
    );
    run.stop().await;
}

/// etcd's count at the snapshot's revision, asked in parts split at some of its keys, is the
/// whole prefix's: splits out of order, repeated, at the prefix itself or past every key change
/// nothing, a key deleted since still counts at the revision, and a compacted revision is said
/// to be one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_counts_a_snapshots_keys_in_parts_as_it_counts_them_whole() {
    use etcd_informer::listwatch::{Resumable, Resume, SavedCache};

    let client = shared_client().await;
    let prefix = unique_prefix("snapshot_parts");
    let mut kv = client.kv_client();
    let mut at = 0;
    for i in 0..20 {
        let r = kv
            .put(format!("{prefix}ns/k{i:03}"), "v", None)
            .await
            .unwrap();
        at = r.header().map_or(0, |h| h.revision());
    }
    // Beside the prefix, on both sides: never counted.
    let before = prefix.trim_end_matches('/').to_owned();
    kv.put(before.as_str(), "x", None).await.unwrap();
    kv.put(format!("{before}0"), "x", None).await.unwrap();
    kv.delete(format!("{prefix}ns/k005"), None).await.unwrap();
    let cluster_id = (kv.get(prefix.as_str(), None).await.unwrap())
        .header()
        .map_or(0, |h| h.cluster_id());
    let source = EtcdListerWatcher::new(client.clone(), prefix.as_str(), TextCodec).unwrap();
    let owned = |keys: &[&str]| keys.iter().map(|k| k.to_string()).collect::<Vec<_>>();
    for splits in [
        owned(&[]),
        owned(&["ns/k005", "ns/k010", "ns/k015"]),
        owned(&["ns/k010", "ns/k005", "ns/k010", "", "zzz"]),
        owned(&["a", "ns/k000", "ns/k019", "ns/k0190"]),
    ] {
        let answer = source
            .can_resume(SavedCache::new(at, 20, cluster_id).with_splits(splits.clone()))
            .await;
        assert_eq!(answer.unwrap(), Resume::Ready, "split at {splits:?}");
        match source
            .can_resume(SavedCache::new(at, 19, cluster_id).with_splits(splits.clone()))
            .await
        {
            Ok(Resume::Refused(why)) => assert!(why.contains("etcd counts 20"), "{why}"),
            other => panic!("split at {splits:?}: expected a refusal, got {other:?}"),
        }
    }
    let now = (kv.put(format!("{prefix}ns/last"), "v", None).await.unwrap())
        .header()
        .map_or(0, |h| h.revision());
    kv.compact(now, None).await.expect("compact");
    let splits = owned(&["ns/k005", "ns/k010"]);
    let answer = source
        .can_resume(SavedCache::new(at, 20, cluster_id).with_splits(splits))
        .await
        .unwrap();
    assert!(matches!(answer, Resume::Compacted(_)), "{answer:?}");
}

/// The in-memory source answers as etcd's does (no etcd needed).
#[tokio::test]
async fn the_fake_source_answers_as_etcd_does() {
    use etcd_informer::listwatch::{Resumable, Resume, SavedCache};
    use etcd_informer::testing::FakeSource;

    let source = FakeSource::<String>::new();
    source.put("a", "1".into());
    let at = source.put("b", "2".into());
    source.delete("a");
    source.put("c", "3".into());
    assert_eq!(
        source.can_resume(SavedCache::new(at, 2, 1)).await.unwrap(),
        Resume::Ready
    );
    let refused = |r: Resume, what: &str| match r {
        Resume::Refused(why) => assert!(why.contains(what), "{why}"),
        other => panic!("expected refused ({what}), got {other:?}"),
    };
    refused(
        source.can_resume(SavedCache::new(at, 3, 1)).await.unwrap(),
        "tally differs",
    );
    refused(
        source.can_resume(SavedCache::new(at, 2, 9)).await.unwrap(),
        "another cluster",
    );
    refused(
        source
            .can_resume(SavedCache::new(at + 10, 2, 1))
            .await
            .unwrap(),
        "ahead",
    );
    source.compact();
    assert!(matches!(
        source.can_resume(SavedCache::new(at, 2, 1)).await.unwrap(),
        Resume::Compacted(_)
    ));
}

/// A DeltaFifo cache is not etcd at one revision: no snapshot is read or written.
#[tokio::test]
async fn the_delta_fifo_mode_neither_reads_nor_writes_snapshots() {
    use etcd_informer::testing::FakeSource;
    use etcd_informer::Processing;

    let path = snapshot_path("delta_fifo");
    let source = FakeSource::<String>::new();
    source.put("a", "1".into());
    let options = InformerOptions::default()
        .with_processing(Processing::DeltaFifo)
        .with_snapshot(&path, TextCodec);
    let informer = SharedIndexInformer::new(source, options);
    let run = tokio::spawn(informer.clone().run());
    tokio::time::timeout(WITHIN, informer.wait_for_cache_sync())
        .await
        .expect("synced");
    match informer.snapshot_start() {
        Some(SnapshotStart::Cold { reason }) => assert!(reason.contains("Processing::Atomic")),
        other => panic!("expected a cold start, got {other:?}"),
    }
    assert_eq!(informer.write_snapshot().await.unwrap(), None);
    informer.stop();
    let _ = run.await;
    assert!(!path.exists());
}

/// With the in-memory source: warm without a list, and the changes after.
#[tokio::test]
async fn warm_from_the_fake_source() {
    use etcd_informer::testing::FakeSource;

    let path = snapshot_path("fake");
    let source = FakeSource::<String>::new();
    for i in 0..5 {
        source.put(&format!("ns/{i}"), i.to_string());
    }
    let informer = SharedIndexInformer::new(
        source.clone(),
        InformerOptions::default().with_snapshot(&path, TextCodec),
    );
    let run = tokio::spawn(informer.clone().run());
    informer.wait_for_cache_sync().await;
    informer.stop();
    run.await.unwrap();
    source.put("ns/5", "5".into());
    let lists = source.list_count();

    let informer = SharedIndexInformer::new(
        source.clone(),
        InformerOptions::default().with_snapshot(&path, TextCodec),
    );
    let run = tokio::spawn(informer.clone().run());
    informer.wait_for_cache_sync().await;
    assert!(informer.snapshot_start().unwrap().is_warm());
    assert_eq!(source.list_count(), lists, "no list");
    eventually("the put after the snapshot", WITHIN, || {
        informer.lister().list().len() == 6
    })
    .await;
    informer.stop();
    run.await.unwrap();

    // Warm again, nothing changed since: the file is not written again.
    let informer = SharedIndexInformer::new(
        source.clone(),
        InformerOptions::default().with_snapshot(&path, TextCodec),
    );
    let run = tokio::spawn(informer.clone().run());
    informer.wait_for_cache_sync().await;
    assert!(informer.snapshot_start().unwrap().is_warm());
    assert_eq!(informer.write_snapshot().await.unwrap(), None);
    informer.stop();
    run.await.unwrap();
}

/// A value the codec no longer decodes: a cold start naming the key, and a correct cache.
#[tokio::test]
async fn a_value_that_no_longer_decodes_starts_cold() {
    use etcd_informer::testing::FakeSource;

    /// Decodes only values that do not start with "bad".
    struct Picky;
    impl Codec<String> for Picky {
        fn decode(&self, bytes: &[u8]) -> Result<String, CodecError> {
            match TextCodec.decode(bytes)? {
                v if v.starts_with("bad") => Err("no longer accepted".into()),
                v => Ok(v),
            }
        }
        fn encode(&self, value: &String) -> Result<Vec<u8>, CodecError> {
            TextCodec.encode(value)
        }
    }
    let path = snapshot_path("picky");
    let source = FakeSource::<String>::new();
    source.put("ns/a", "good".into());
    source.put("ns/b", "bad".into());
    let snapshot = || SnapshotOptions::new(&path, Picky).with_codec_id("picky");
    let informer = SharedIndexInformer::new(
        source.clone(),
        InformerOptions::default().with_snapshot_options(snapshot()),
    );
    let run = tokio::spawn(informer.clone().run());
    informer.wait_for_cache_sync().await;
    informer.stop();
    run.await.unwrap();

    let informer = SharedIndexInformer::new(
        source.clone(),
        InformerOptions::default().with_snapshot_options(snapshot()),
    );
    let run = tokio::spawn(informer.clone().run());
    tokio::time::timeout(WITHIN, informer.wait_for_cache_sync())
        .await
        .expect("synced");
    match informer.snapshot_start() {
        Some(SnapshotStart::Cold { reason }) => {
            assert!(reason.contains("\"ns/b\" does not decode"), "{reason}")
        }
        other => panic!("expected a cold start, got {other:?}"),
    }
    assert_eq!(informer.lister().list().len(), 2);
    informer.stop();
    run.await.unwrap();
}

/// Issue 35, "A race": a snapshot records the store its content was listed from, not the one
/// the source names now. Here the source already names another store (as when it has just
/// found the store replaced, before the relist replaces the cache): the snapshot written then
/// still names the store of its content, so a restart in front of that store starts warm from
/// it (it started cold before: the snapshot named the other store).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_names_the_store_its_content_was_listed_from() {
    use etcd_informer::testing::FakeSource;
    let path = snapshot_path("origin");
    let store = || {
        let source = FakeSource::<String>::new();
        source.set_cluster_id(1);
        source.put("a", "old".into());
        source
    };
    let source = store();
    let informer = SharedIndexInformer::new(
        source.clone(),
        InformerOptions::default().with_snapshot_options(options(&path)),
    );
    tokio::spawn(informer.clone().run());
    tokio::time::timeout(WITHIN, informer.wait_for_cache_sync())
        .await
        .expect("synced");
    source.set_cluster_id(2);
    let written = informer.write_snapshot().await.expect("write");
    assert!(written.is_some(), "a snapshot was written");
    let again = SharedIndexInformer::new(
        store(),
        InformerOptions::default().with_snapshot_options(options(&path)),
    );
    tokio::spawn(again.clone().run());
    tokio::time::timeout(WITHIN, again.wait_for_cache_sync())
        .await
        .expect("synced");
    assert!(
        matches!(again.snapshot_start(), Some(SnapshotStart::Warm { .. })),
        "{:?}",
        again.snapshot_start()
    );
}

/// A compact informer of `prefix` with a snapshot at `path`, its values packed (and the
/// snapshot's encoded) with `codec`, indexed by `indexers`; running, synced.
async fn start_compact(
    client: &Client,
    prefix: &str,
    path: &Path,
    codec: CountingText,
    indexers: etcd_informer::Indexers<String>,
) -> (SharedIndexInformer<String>, tokio::task::JoinHandle<()>) {
    let lw = EtcdListerWatcher::new(client.clone(), prefix, TextCodec).expect("source");
    let options = InformerOptions::default()
        .with_name(prefix.to_owned())
        .with_indexers(indexers)
        .with_compact_cache(codec.clone())
        .with_snapshot_options(SnapshotOptions::new(path, codec));
    let informer = SharedIndexInformer::new(lw, options);
    let run = tokio::spawn(informer.clone().run());
    tokio::time::timeout(WITHIN, informer.wait_for_cache_sync())
        .await
        .expect("synced within 30 s");
    (informer, run)
}

async fn stop(informer: SharedIndexInformer<String>, run: tokio::task::JoinHandle<()>) {
    informer.stop();
    tokio::time::timeout(WITHIN, run)
        .await
        .expect("run ended")
        .expect("run did not panic");
}

/// A compact cache takes a snapshot's pages as they are read, before the file's checksum is
/// known: a file garbled in a value that still decodes is installed, then dropped once the
/// checksum fails, and the informer starts cold with etcd's value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compact_cache_drops_a_snapshot_whose_checksum_fails_after_taking_it() {
    let client = shared_client().await;
    let prefix = unique_prefix("snapshot_compact_garbled");
    let path = snapshot_path("compact_garbled");
    let revision = put_keys(&client, &prefix, 50).await;
    let indexers = etcd_informer::namespace_indexers();
    let codec = CountingText::default();
    let (first, run) = start_compact(&client, &prefix, &path, codec, indexers.clone()).await;
    eventually("the cache at the last put", WITHIN, || {
        first.revision() >= revision
    })
    .await;
    stop(first, run).await;

    // "v17" becomes "w17": still a value the codec decodes.
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes
        .windows(3)
        .position(|w| w == b"v17")
        .expect("the value is in the file");
    bytes[at] = b'w';
    std::fs::write(&path, &bytes).unwrap();

    let decodes = CountingText::default();
    let (second, run) = start_compact(&client, &prefix, &path, decodes.clone(), indexers).await;
    match second.snapshot_start() {
        Some(SnapshotStart::Cold { reason }) => {
            assert!(reason.contains("checksum"), "{reason}")
        }
        other => panic!("expected a cold start, got {other:?}"),
    }
    converges(&second, &client, &prefix, WITHIN).await;
    assert_eq!(second.indexer().len(), 50);
    let kept = second.indexer().get_by_key("ns/k017").expect("cached");
    assert_eq!(kept.value.as_str(), "v17", "the garbled record was dropped");
    stop(second, run).await;
}

/// Issue 35: a compact cache takes the snapshot's records as they are (the lever for a warm
/// start ten times faster than a cold one): only a sample is decoded, and the cache, its
/// indexes and what it hears since are etcd's. An index function that changed under the same
/// name is caught by the sample: the records are decoded and indexed afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compact_cache_starts_warm_without_decoding_the_snapshot() {
    let client = shared_client().await;
    let prefix = unique_prefix("snapshot_compact");
    let path = snapshot_path("compact");
    let keys = 500;
    let revision = put_keys(&client, &prefix, keys).await;
    let by_length = |long: usize| {
        let index = etcd_informer::IndexFunc::new(move |o: &etcd_informer::Object<String>| {
            vec![(o.value.len() >= long).to_string()]
        });
        etcd_informer::Indexers::from([("long".to_owned(), index)])
    };
    let (first, run) = start_compact(
        &client,
        &prefix,
        &path,
        CountingText::default(),
        by_length(3),
    )
    .await;
    eventually("the cache at the last put", WITHIN, || {
        first.revision() >= revision
    })
    .await;
    // The snapshot holds the cache's revision when it stopped (other tests write too).
    let snapshotted = first.clone();
    stop(first, run).await;
    let revision = snapshotted.revision();

    // While the informer is down: a new key, an update, a delete.
    let mut kv = client.kv_client();
    kv.put(format!("{prefix}ns/new"), "n", None).await.unwrap();
    kv.put(format!("{prefix}ns/k001"), "changed", None)
        .await
        .unwrap();
    kv.delete(format!("{prefix}ns/k002"), None).await.unwrap();

    let decodes = Arc::new(AtomicUsize::new(0));
    let (second, run) = start_compact(
        &client,
        &prefix,
        &path,
        CountingText(decodes.clone()),
        by_length(3),
    )
    .await;
    assert_eq!(
        second.snapshot_start(),
        Some(SnapshotStart::Warm { revision, keys })
    );
    let decoded = decodes.load(Ordering::SeqCst);
    assert!(
        decoded < keys / 5,
        "{decoded} of {keys} values decoded for a warm start into a compact cache"
    );
    converges(&second, &client, &prefix, WITHIN).await;
    // v10..v499 have 3 bytes or more (490), and now "changed" (k001, was v1) too; v0..v9
    // are shorter, less k001 and the deleted k002, with "n" (ns/new).
    let long = second.indexer().index_keys("long", "true").unwrap().len();
    let short = second.indexer().index_keys("long", "false").unwrap().len();
    assert_eq!((long, short), (491, 9));
    stop(second, run).await;

    // The same index name, another function: the sample disagrees, every record is decoded.
    let decodes = Arc::new(AtomicUsize::new(0));
    let (third, run) = start_compact(
        &client,
        &prefix,
        &path,
        CountingText(decodes.clone()),
        by_length(4),
    )
    .await;
    assert!(third.snapshot_start().is_some_and(|s| s.is_warm()));
    assert!(decodes.load(Ordering::SeqCst) >= keys, "decoded afresh");
    converges(&third, &client, &prefix, WITHIN).await;
    let long = third.indexer().index_keys("long", "true").unwrap().len();
    // v100..v499 and "changed" have 4 bytes or more.
    assert_eq!(long, 401);
    stop(third, run).await;
}

/// Issue 35: a compact cache takes the snapshot's records while etcd is asked; when etcd
/// cannot vouch for them (here: compacted past, with keys deleted since), they are dropped
/// before the list, and no key of the snapshot stays in the cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compact_cache_drops_the_records_etcd_did_not_vouch_for() {
    let etcd = EtcdServer::start()
        .await
        .unwrap_or_else(|e| panic!("cannot start etcd (set ETCD_BIN or put etcd on PATH): {e}"));
    let client = etcd.client().await;
    let prefix = "/compact-refused/";
    let path = snapshot_path("compact_refused");
    let revision = put_keys(&client, prefix, 100).await;
    let indexers = etcd_informer::namespace_indexers();
    let (first, run) = start_compact(
        &client,
        prefix,
        &path,
        CountingText::default(),
        indexers.clone(),
    )
    .await;
    eventually("the cache at the last put", WITHIN, || {
        first.revision() >= revision
    })
    .await;
    stop(first, run).await;

    let mut kv = client.kv_client();
    for i in 0..10 {
        kv.delete(format!("{prefix}ns/k{i:03}"), None)
            .await
            .unwrap();
    }
    let now = kv.put(format!("{prefix}ns/new"), "n", None).await.unwrap();
    let now = now.header().map_or(0, |h| h.revision());
    client
        .kv_client()
        .compact(now, None)
        .await
        .expect("compact");

    let (second, run) =
        start_compact(&client, prefix, &path, CountingText::default(), indexers).await;
    match second.snapshot_start() {
        Some(SnapshotStart::Cold { reason }) => {
            assert!(reason.contains("compacted"), "{reason}")
        }
        other => panic!("expected a cold start, got {other:?}"),
    }
    converges(&second, &client, prefix, WITHIN).await;
    assert_eq!(second.indexer().len(), 91);
    assert!(second.indexer().get_by_key("ns/k000").is_none());
    stop(second, run).await;
}

/// A codec that, once `refuse` is set, no longer decodes values starting with "bad": a change
/// to the type that breaks a minority of the values a snapshot holds, under the same codec id.
#[derive(Clone, Default)]
struct Tightened(Arc<std::sync::atomic::AtomicBool>);

impl Codec<String> for Tightened {
    fn decode(&self, bytes: &[u8]) -> Result<String, CodecError> {
        match TextCodec.decode(bytes)? {
            v if v.starts_with("bad") && self.0.load(Ordering::SeqCst) => {
                Err("no longer accepted".into())
            }
            v => Ok(v),
        }
    }
    fn encode(&self, value: &String) -> Result<Vec<u8>, CodecError> {
        TextCodec.encode(value)
    }
}

/// Issue 50, item 3: a compact cache's warm start installs records undecoded, checking a sample
/// of 64: a record that no longer decodes and is not in the sample was installed, counted by
/// `len` and the indexes though `get` and `list` omit it, and a watched delete of it was
/// dropped. The warm start now decodes every record once in the background, removes those that
/// fail and relists, so the cache ends as a cold start's would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_start_keeps_no_record_that_no_longer_decodes() {
    let client = shared_client().await;
    let prefix = unique_prefix("snapshot_tightened");
    let path = snapshot_path("tightened");
    let keys = 2000;
    put_keys(&client, &prefix, keys).await;
    let bad = format!("{prefix}ns/k1234");
    let put = client
        .kv_client()
        .put(bad.clone(), "bad-1234", None)
        .await
        .unwrap();
    let revision = put.header().unwrap().revision();
    let start = |codec: Tightened| {
        let lw = EtcdListerWatcher::new(client.clone(), prefix.as_str(), codec.clone()).unwrap();
        let options = InformerOptions::default()
            .with_name(prefix.clone())
            .with_compact_cache(codec.clone())
            .with_snapshot_options(SnapshotOptions::new(&path, codec));
        let informer = SharedIndexInformer::new(lw, options);
        let run = tokio::spawn(informer.clone().run());
        (informer, run)
    };
    // The sample is the first page of a file in hash order, which varies between processes: a
    // start whose sample met the record (1 in 31) starts cold, as it should, and is tried again.
    let mut attempts = 0;
    let (second, run) = loop {
        attempts += 1;
        let codec = Tightened::default();
        let (first, run) = start(codec.clone());
        eventually("the first cache at the last put", WITHIN, || {
            first.has_synced() && first.revision() >= revision
        })
        .await;
        stop(first, run).await;
        codec.0.store(true, Ordering::SeqCst);
        let (second, run) = start(codec);
        tokio::time::timeout(WITHIN, second.wait_for_cache_sync())
            .await
            .expect("synced");
        match second.snapshot_start() {
            Some(SnapshotStart::Warm { .. }) => break (second, run),
            Some(SnapshotStart::Cold { reason })
                if reason.contains("does not decode") && attempts < 4 =>
            {
                stop(second, run).await;
                let _ = std::fs::remove_file(&path);
            }
            other => panic!("a warm start (the sample missed the record): {other:?}"),
        }
    };
    eventually("len agrees with list", WITHIN, || {
        second.indexer().len() == second.lister().list().len()
    })
    .await;
    // ns/k1234 was one of the keys, now bad.
    assert_eq!(
        second.lister().list().len(),
        keys - 1,
        "every key but the bad one"
    );
    // The relist after the removal, so that the source knows the key as undecodable.
    eventually("the relist after the removal", WITHIN, || {
        second.health().reflector.relists.audit >= 1
    })
    .await;
    let relative = bad.trim_start_matches(prefix.as_str());
    assert!(second.indexer().get_by_key(relative).is_none());

    // Its delete, and a change after it, reach a cache that agrees with etcd.
    client.kv_client().delete(bad.clone(), None).await.unwrap();
    let put = client
        .kv_client()
        .put(format!("{prefix}ns/k000"), "changed", None)
        .await
        .unwrap();
    let revision = put.header().unwrap().revision();
    eventually("the change after the delete", WITHIN, || {
        second.revision() >= revision
    })
    .await;
    assert_eq!(second.indexer().len(), keys - 1);
    assert_eq!(second.lister().list().len(), keys - 1);
    stop(second, run).await;
}

/// Issue 50, item 5: a codec that panics on a record of a compact cache's warm-start sample
/// (an old value, since rewritten in etcd) starts the informer cold; it panicked the
/// reflector on every restart before, and the informer never synced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_codec_that_panics_on_the_sample_starts_cold() {
    use etcd_informer::testing::FakeSource;

    #[derive(Clone, Default)]
    struct Fragile(Arc<std::sync::atomic::AtomicBool>);
    impl Codec<String> for Fragile {
        fn decode(&self, bytes: &[u8]) -> Result<String, CodecError> {
            let value = TextCodec.decode(bytes)?;
            if value == "boom" && self.0.load(Ordering::SeqCst) {
                panic!("the codec cannot take {value}");
            }
            Ok(value)
        }
        fn encode(&self, value: &String) -> Result<Vec<u8>, CodecError> {
            TextCodec.encode(value)
        }
    }
    let path = snapshot_path("fragile");
    let source = FakeSource::<String>::new();
    for i in 0..5 {
        source.put(&format!("ns/{i}"), i.to_string());
    }
    // Fewer keys than the sample: every record is sampled.
    source.put("ns/boom", "boom".into());
    let codec = Fragile::default();
    let start = |codec: Fragile| {
        let options = InformerOptions::default()
            .with_compact_cache(codec.clone())
            .with_snapshot_options(SnapshotOptions::new(&path, codec));
        let informer = SharedIndexInformer::new(source.clone(), options);
        let run = tokio::spawn(informer.clone().run());
        (informer, run)
    };
    let (first, run) = start(codec.clone());
    tokio::time::timeout(WITHIN, first.wait_for_cache_sync())
        .await
        .expect("synced");
    first.stop();
    run.await.unwrap();

    // etcd holds another value now; the snapshot, the one the codec panics on.
    source.put("ns/boom", "fine".into());
    codec.0.store(true, Ordering::SeqCst);
    let (second, run) = start(codec);
    tokio::time::timeout(WITHIN, second.wait_for_cache_sync())
        .await
        .expect("synced despite the codec's panic");
    assert!(
        matches!(second.snapshot_start(), Some(SnapshotStart::Cold { .. })),
        "{:?}",
        second.snapshot_start()
    );
    assert_eq!(second.indexer().len(), 6);
    second.stop();
    run.await.unwrap();
}
