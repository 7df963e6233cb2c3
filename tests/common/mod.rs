//! Helpers the etcd-backed test binaries share: the shared test etcd's client, waiting with a
//! deadline, the cache compared with etcd, a source that counts its lists and watches, and a
//! handler that records what it is told. Each test binary uses a subset.
//!
//! (`pipeline_cases.rs` next to this file is not part of this module: tests/pipeline.rs and
//! tests/pipeline_delta_fifo.rs `include!` it.)
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, GetOptions, Txn, TxnOp};
use etcd_informer::listwatch::{BoxFuture, Capabilities, ListResult, ListSink, Result as LwResult};
use etcd_informer::testing::etcd::{test_etcd, EtcdServer};
use etcd_informer::{
    connect, ListerWatcher, ResourceEventHandlerFuncs, SharedIndexInformer, WatchStream,
};

/// Key (below the prefix) -> (mod_revision, value).
pub type State = BTreeMap<String, (i64, String)>;

/// What a [`recorder`] was told, one line per call.
pub type Log = Arc<Mutex<Vec<String>>>;

/// Puts 2,000 keys `{prefix}0000`..`{prefix}1999` of 4 KiB each, 100 to a transaction; returns
/// their value bytes (8 MB: what etcd reads for a proof that reads the range's values).
pub async fn put_large_prefix(client: &Client, prefix: &str) -> f64 {
    let value = "v".repeat(4096);
    for batch in 0..20 {
        let puts: Vec<_> = (0..100)
            .map(|i| {
                TxnOp::put(
                    format!("{prefix}{:04}", batch * 100 + i),
                    value.as_str(),
                    None,
                )
            })
            .collect();
        client
            .kv_client()
            .txn(Txn::new().and_then(puts))
            .await
            .expect("a batch of puts");
    }
    2000.0 * 4096.0
}

/// What reads cost `etcd` so far, from its `/metrics` page: the Range requests it served and
/// the bytes it allocated.
pub fn read_cost(etcd: &EtcdServer) -> (f64, f64) {
    let ranges = etcd
        .metric("grpc_server_handled_total", &[r#"grpc_method="Range""#])
        .expect("etcd's Range count from its /metrics page");
    let allocated = etcd
        .metric("go_memstats_alloc_bytes_total", &[])
        .expect("etcd's allocated bytes from its /metrics page");
    (ranges, allocated)
}

/// A client of this test binary's shared etcd (or `ETCD_ENDPOINTS`).
pub async fn shared_client() -> Client {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    connect(&etcd.endpoints)
        .await
        .expect("connect to the test etcd")
}

/// Waits until `cond` holds, failing after `within`; returns how long it took.
pub async fn eventually(what: &str, within: Duration, cond: impl Fn() -> bool) -> Duration {
    let started = tokio::time::Instant::now();
    while !cond() {
        assert!(
            started.elapsed() < within,
            "timed out after {within:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    started.elapsed()
}

/// Puts `key` through `client`, retrying for up to `within` while the cluster refuses it (a
/// member just stopped, paused or resumed: "no leader" comes back at once during an election).
pub async fn put_accepted(client: &Client, key: &str, value: &str, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let mut kv = client.kv_client();
        match tokio::time::timeout(Duration::from_secs(1), kv.put(key, value, None)).await {
            Ok(Ok(_)) => return,
            other => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the cluster took no put of {key} within {within:?}: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Every key under `prefix` as etcd has it now (values that are not UTF-8 read `<bytes>`).
pub async fn etcd_state(client: &Client, prefix: &str) -> State {
    let resp = client
        .kv_client()
        .get(prefix, Some(GetOptions::new().with_prefix()))
        .await
        .expect("read etcd");
    resp.kvs()
        .iter()
        .map(|kv| {
            let key = kv.key_str().unwrap()[prefix.len()..].to_string();
            let value = kv.value_str().unwrap_or("<bytes>").to_string();
            (key, (kv.mod_revision(), value))
        })
        .collect()
}

/// Every object in the informer's cache.
pub fn cache_state(informer: &SharedIndexInformer<String>) -> State {
    informer
        .lister()
        .list()
        .iter()
        .map(|o| (o.key().to_string(), (o.mod_revision, o.value.clone())))
        .collect()
}

/// Waits until the cache equals etcd under `prefix`, failing after `within`; returns how long
/// it took.
pub async fn converges(
    informer: &SharedIndexInformer<String>,
    client: &Client,
    prefix: &str,
    within: Duration,
) -> Duration {
    let started = tokio::time::Instant::now();
    loop {
        let want = etcd_state(client, prefix).await;
        let got = cache_state(informer);
        if got == want {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < within,
            "the cache did not match etcd within {within:?}:\ncache {got:?}\netcd  {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A source that counts its lists and watches, to tell a resumed watch from a relist; while
/// `held` is set, a watch waits before it opens (the cache stays as it is, reads go on). It
/// implements what it changes and forwards the rest with `capabilities` (issue 55).
pub struct Counting<L> {
    pub inner: L,
    pub lists: Arc<AtomicUsize>,
    pub watches: Arc<AtomicUsize>,
    pub held: Arc<AtomicBool>,
}

impl<L: ListerWatcher<String>> ListerWatcher<String> for Counting<L> {
    fn list(&self) -> BoxFuture<'_, LwResult<ListResult<String>>> {
        self.lists.fetch_add(1, Ordering::SeqCst);
        self.inner.list()
    }
    fn list_into(&self, sink: Arc<dyn ListSink<String>>) -> BoxFuture<'_, LwResult<i64>> {
        self.lists.fetch_add(1, Ordering::SeqCst);
        self.inner.list_into(sink)
    }
    fn watch(&self, after: i64) -> BoxFuture<'_, LwResult<WatchStream<String>>> {
        Box::pin(async move {
            while self.held.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            self.watches.fetch_add(1, Ordering::SeqCst);
            self.inner.watch(after).await
        })
    }
    /// Everything else is the inner source's: its freshness proofs, key revisions, resuming.
    fn capabilities(&self) -> Capabilities<'_> {
        self.inner.capabilities()
    }
}

/// A handler writing `add k=v`, `update k=old->new`, `delete k=v` (or `tombstone k=v` for a
/// delete found by a relist) to `log`.
pub fn recorder(log: &Log) -> ResourceEventHandlerFuncs<String> {
    let (a, u, d) = (log.clone(), log.clone(), log.clone());
    ResourceEventHandlerFuncs::new()
        .on_add(move |o, _| {
            a.lock()
                .unwrap()
                .push(format!("add {}={}", o.key(), o.value))
        })
        .on_update(move |old, new| {
            u.lock()
                .unwrap()
                .push(format!("update {}={}->{}", new.key(), old.value, new.value))
        })
        .on_delete(move |o| {
            let kind = if o.is_final_state_unknown() {
                "tombstone"
            } else {
                "delete"
            };
            d.lock()
                .unwrap()
                .push(format!("{kind} {}={}", o.key(), o.object().value))
        })
}

/// Logs written as text (a `tracing_subscriber` writer), to read back in a test.
#[derive(Clone, Default)]
pub struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// The lines that contain every one of `parts`.
    pub fn lines(&self, parts: &[&str]) -> Vec<String> {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .lines()
            .filter(|l| parts.iter().all(|p| l.contains(p)))
            .map(str::to_owned)
            .collect()
    }
}
