//! Runs every example against the test etcd and checks its output lines exactly (where two
//! tasks print concurrently, as a sorted set).
#![cfg(feature = "testing")]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use etcd_informer::testing::etcd::{test_etcd, unique_prefix};

/// A running example whose stdout lines arrive on a channel.
struct Example {
    child: Child,
    lines: mpsc::Receiver<String>,
}

fn example_path(name: &str) -> PathBuf {
    // Integration tests run from target/<profile>/deps; `cargo test` builds the examples into
    // target/<profile>/examples.
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let path = dir.join("examples").join(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo test`, which builds the examples",
        path.display()
    );
    path
}

impl Example {
    fn start(name: &str, endpoints: &[String], args: &[&str]) -> Example {
        let mut child = Command::new(example_path(name))
            .args(args)
            .env("ETCD_ENDPOINTS", endpoints.join(","))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start example {name}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Example { child, lines }
    }

    /// The next `n` lines, failing after 30 s.
    fn next_lines(&self, n: usize) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        (0..n)
            .map(|i| {
                let left = deadline.saturating_duration_since(Instant::now());
                self.lines.recv_timeout(left).unwrap_or_else(|_| {
                    panic!("timed out waiting for output line {} of {n}", i + 1)
                })
            })
            .collect()
    }

    /// Waits for the example to exit by itself, failing after `within`.
    fn exit_status(mut self, within: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for example") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "example did not exit within {within:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends Ctrl-C and checks the example exits cleanly.
    fn interrupt(self) {
        self.stop_with(libc::SIGINT);
    }

    /// Sends `signal` and checks the example exits cleanly within 15 s (a cache server's drain
    /// takes up to 10 s).
    fn stop_with(mut self, signal: i32) {
        // SAFETY: plain kill(2) on our own child's pid.
        let pid = i32::try_from(self.child.id()).expect("pid fits i32");
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for example") {
                assert!(status.success(), "example exited with {status}");
                return;
            }
            assert!(
                Instant::now() < deadline,
                "example did not exit within 15 s of signal {signal}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Example {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn cm(ns: &str, name: &str, labels: &str) -> String {
    format!(r#"{{"namespace":"{ns}","name":"{name}","labels":{labels},"data":{{"k":"v"}}}}"#)
}

async fn put(client: &etcd_client::Client, key: String, value: String) {
    client.kv_client().put(key, value, None).await.expect("put");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn informer_example_prints_created_updated_deleted() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = etcd.client().await;
    let prefix = unique_prefix("example_informer");
    put(&client, format!("{prefix}tmp/a"), cm("tmp", "a", "{}")).await;
    let ex = Example::start("informer", &etcd.endpoints, &["--prefix", &prefix]);
    assert_eq!(ex.next_lines(1), ["created: tmp/a"]);
    put(
        &client,
        format!("{prefix}tmp/a"),
        cm("tmp", "a", r#"{"x":"y"}"#),
    )
    .await;
    assert_eq!(ex.next_lines(1), ["updated: tmp/a"]);
    client
        .kv_client()
        .delete(format!("{prefix}tmp/a"), None)
        .await
        .unwrap();
    assert_eq!(ex.next_lines(1), ["deleted: tmp/a"]);
    ex.interrupt();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn informer_example_says_how_it_started_from_its_snapshot() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = etcd.client().await;
    let prefix = unique_prefix("example_informer_snapshot");
    let dir = std::env::temp_dir().join(format!("example-snapshot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("informer.snap");
    let _ = std::fs::remove_file(&path);
    let path_arg = path.to_str().expect("UTF-8 path").to_owned();
    put(&client, format!("{prefix}tmp/a"), cm("tmp", "a", "{}")).await;
    let args = ["--prefix", prefix.as_str(), "--snapshot", path_arg.as_str()];

    let ex = Example::start("informer", &etcd.endpoints, &args);
    let mut lines = ex.next_lines(2);
    lines.sort();
    assert_eq!(lines[0], "created: tmp/a");
    assert!(
        lines[1].starts_with("snapshot: cold start: no snapshot at"),
        "{lines:?}"
    );
    // Ctrl-C stops the informer, which writes the snapshot.
    ex.interrupt();
    assert!(path.exists(), "the snapshot was written on Ctrl-C");

    let ex = Example::start("informer", &etcd.endpoints, &args);
    let mut lines = ex.next_lines(2);
    lines.sort();
    assert_eq!(lines[0], "created: tmp/a");
    assert!(
        lines[1].starts_with("snapshot: warm start from the snapshot at revision")
            && lines[1].ends_with("(1 keys), no list"),
        "{lines:?}"
    );
    ex.interrupt();
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_watcher_example_prints_list_then_events() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = etcd.client().await;
    let prefix = unique_prefix("example_list_watcher");
    put(&client, format!("{prefix}tmp/a"), cm("tmp", "a", "{}")).await;
    put(&client, format!("{prefix}tmp/b"), cm("tmp", "b", "{}")).await;
    let ex = Example::start("list_watcher", &etcd.endpoints, &["--prefix", &prefix]);
    assert_eq!(
        ex.next_lines(4),
        ["Initial list:", "tmp/a", "tmp/b", "Start watching..."]
    );
    put(&client, format!("{prefix}tmp/c"), cm("tmp", "c", "{}")).await;
    put(
        &client,
        format!("{prefix}tmp/a"),
        cm("tmp", "a", r#"{"x":"y"}"#),
    )
    .await;
    client
        .kv_client()
        .delete(format!("{prefix}tmp/b"), None)
        .await
        .unwrap();
    assert_eq!(
        ex.next_lines(3),
        ["ADDED: tmp/c", "MODIFIED: tmp/a", "DELETED: tmp/b"]
    );
    ex.interrupt();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn indexer_example_prints_keys_by_namespace_and_label() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = etcd.client().await;
    let prefix = unique_prefix("example_indexer");
    put(
        &client,
        format!("{prefix}tmp/a"),
        cm("tmp", "a", r#"{"app":"web"}"#),
    )
    .await;
    put(
        &client,
        format!("{prefix}tmp/b"),
        cm("tmp", "b", r#"{"app":"db"}"#),
    )
    .await;
    put(
        &client,
        format!("{prefix}prod/c"),
        cm("prod", "c", r#"{"app":"web"}"#),
    )
    .await;
    let ex = Example::start("indexer", &etcd.endpoints, &["--prefix", &prefix]);
    assert_eq!(ex.next_lines(2), ["tmp/a", "tmp/b"]);
    ex.interrupt();
    let ex = Example::start(
        "indexer",
        &etcd.endpoints,
        &["--prefix", &prefix, "--namespace", "prod"],
    );
    assert_eq!(ex.next_lines(1), ["prod/c"]);
    ex.interrupt();
    let ex = Example::start(
        "indexer",
        &etcd.endpoints,
        &["--prefix", &prefix, "--label", "app=web"],
    );
    assert_eq!(ex.next_lines(2), ["prod/c", "tmp/a"]);
    ex.interrupt();
}

#[test]
fn example_with_unreachable_etcd_names_it_and_fails_fast() {
    let start = Instant::now();
    let output = Command::new(example_path("informer"))
        .env("ETCD_ENDPOINTS", "127.0.0.1:9")
        .output()
        .expect("run example");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("127.0.0.1:9"),
        "stderr names the endpoint: {stderr}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "took {:?}",
        start.elapsed()
    );
}

/// The metrics the example serves at `addr`, in Prometheus text format.
fn scrape(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(addr).expect("connect to the metrics address");
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut response = String::new();
    conn.read_to_string(&mut response)
        .expect("read the metrics");
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_owned()
}

/// The values of `name`'s series whose labels contain every one of `labels`.
fn values(text: &str, name: &str, labels: &[&str]) -> Vec<f64> {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| labels.iter().all(|label| l.contains(label)))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect()
}

fn free_addr() -> String {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    probe.local_addr().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_server_example_serves_its_prefix() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = etcd.client().await;
    let prefix = unique_prefix("example_cache_server");
    put(&client, format!("{prefix}a"), "1".into()).await;
    let addr = free_addr();
    let example = Example::start(
        "cache_server",
        &etcd.endpoints,
        &["--prefix", &prefix, "--listen", &addr],
    );
    let ready = example.next_lines(1).remove(0);
    assert!(
        ready.starts_with(&format!("ready: serving {prefix} at {addr} (revision "))
            && ready.ends_with(", keys: 1)"),
        "{ready}"
    );
    let via = etcd_informer::connect([addr.as_str()])
        .await
        .expect("connect");
    put(&via, format!("{prefix}b"), "2".into()).await;
    let got = via
        .kv_client()
        .get(
            prefix.as_str(),
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .expect("get through the server");
    let keys: Vec<_> = got
        .kvs()
        .iter()
        .map(|kv| kv.key_str().unwrap().to_string())
        .collect();
    assert_eq!(keys, [format!("{prefix}a"), format!("{prefix}b")]);
    example.interrupt();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lightweight_controller_serves_metrics_that_move() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = etcd.client().await;
    let prefix = unique_prefix("example_metrics");
    let addr = free_addr();
    let ex = Example::start(
        "lightweight_controller",
        &etcd.endpoints,
        &["--id", "m", "--prefix", &prefix, "--metrics-addr", &addr],
    );
    assert_eq!(ex.next_lines(1), ["[m] waiting to lead"]);
    let specs = format!(r#"informer="{prefix}replicasets/""#);
    let pods = format!(r#"informer="{prefix}pods/""#);
    // Leading, informers listed, the runner's handlers registered.
    let deadline = Instant::now() + Duration::from_secs(30);
    let text = loop {
        let text = scrape(&addr);
        let synced = values(
            &text,
            "etcd_informer_runner_synced",
            &[r#"runner="replicaset""#],
        );
        if synced == [1.0] {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "the runner never started:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    for informer in [&specs, &pods] {
        let initial = values(
            &text,
            "etcd_informer_relists_total",
            &[informer, r#"reason="initial""#],
        );
        assert!(initial.iter().sum::<f64>() >= 1.0, "{informer}:\n{text}");
        let backlog = values(
            &text,
            "etcd_informer_handler_backlog",
            &[informer, r#"handler="replicaset""#],
        );
        assert_eq!(backlog.len(), 1, "{informer}:\n{text}");
    }
    // Sampled every second once listed; a live watch is proven at least every idle timeout
    // (2 s), probes of a quiet one included.
    for informer in [&specs, &pods] {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let text = scrape(&addr);
            let stale = values(
                &text,
                "etcd_informer_seconds_since_proven_fresh",
                &[informer],
            );
            if stale.len() == 1 {
                assert!(stale[0] < 4.0, "{informer}: {stale:?}\n{text}");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{informer}: no freshness gauge\n{text}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let depth = values(
        &text,
        "etcd_informer_workqueue_depth",
        &[r#"name="replicaset""#],
    );
    assert_eq!(depth.len(), 1, "{text}");
    let leading = values(
        &text,
        "etcd_informer_leader_is_leader",
        &[r#"identity="m""#],
    );
    assert_eq!(leading, [1.0], "{text}");
    let adds = |text: &str| {
        values(
            text,
            "etcd_informer_workqueue_adds_total",
            &[r#"name="replicaset""#],
        )
        .iter()
        .sum::<f64>()
    };
    let ok = |text: &str| {
        values(
            text,
            "etcd_informer_reconciles_total",
            &[r#"runner="replicaset""#, r#"result="ok""#],
        )
        .iter()
        .sum::<f64>()
    };
    let (adds_before, ok_before) = (adds(&text), ok(&text));

    put(
        &client,
        format!("{prefix}replicasets/web"),
        r#"{"replicas": 1}"#.into(),
    )
    .await;
    assert_eq!(
        ex.next_lines(1),
        [format!("[m] created {prefix}pods/web-0")]
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = scrape(&addr);
        let added = values(
            &text,
            "etcd_informer_events_total",
            &[&specs, r#"kind="added""#],
        );
        if adds(&text) > adds_before && ok(&text) > ok_before && added.iter().sum::<f64>() >= 1.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "work queue adds, reconciles and events did not grow after a put:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    ex.interrupt();
}

#[test]
fn lightweight_controller_with_its_metrics_address_taken_names_it_and_exits_2() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let output = Command::new(example_path("lightweight_controller"))
        .args(["--metrics-addr", &addr])
        // Never reached: the metrics address is checked first.
        .env("ETCD_ENDPOINTS", "127.0.0.1:9")
        .output()
        .expect("run example");
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains(&addr), "stderr names the address: {stderr}");
}

/// The next `n` lines, sorted: for output whose order between keys (or handlers) is not fixed.
fn sorted(mut lines: Vec<String>) -> Vec<String> {
    lines.sort();
    lines
}

/// Puts `tmp/c`, updates `tmp/a` and deletes `tmp/b` one at a time, checking after each the
/// line `<verb>: <key>` the example prints for it, with `verbs` = (added, updated, deleted).
async fn add_update_delete(
    ex: &Example,
    client: &etcd_client::Client,
    prefix: &str,
    verbs: [&str; 3],
) {
    put(client, format!("{prefix}tmp/c"), cm("tmp", "c", "{}")).await;
    assert_eq!(ex.next_lines(1), [format!("{}: tmp/c", verbs[0])]);
    put(
        client,
        format!("{prefix}tmp/a"),
        cm("tmp", "a", r#"{"x":"y"}"#),
    )
    .await;
    assert_eq!(ex.next_lines(1), [format!("{}: tmp/a", verbs[1])]);
    client
        .kv_client()
        .delete(format!("{prefix}tmp/b"), None)
        .await
        .unwrap();
    assert_eq!(ex.next_lines(1), [format!("{}: tmp/b", verbs[2])]);
}

/// The reflector and the controller print `<DeltaType>: <key>`: Replaced for the initial list,
/// then Added, Updated and Deleted from the watch.
async fn prints_deltas(example: &str) {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = etcd.client().await;
    let prefix = unique_prefix(&format!("example_{example}"));
    put(&client, format!("{prefix}tmp/a"), cm("tmp", "a", "{}")).await;
    put(&client, format!("{prefix}tmp/b"), cm("tmp", "b", "{}")).await;
    let ex = Example::start(example, &etcd.endpoints, &["--prefix", &prefix]);
    assert_eq!(
        sorted(ex.next_lines(2)),
        ["Replaced: tmp/a", "Replaced: tmp/b"]
    );
    add_update_delete(&ex, &client, &prefix, ["Added", "Updated", "Deleted"]).await;
    ex.interrupt();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflector_example_prints_replaced_then_watch_deltas() {
    prints_deltas("reflector").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_example_prints_replaced_then_watch_deltas() {
    prints_deltas("controller").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_informer_example_runs_both_handlers() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = etcd.client().await;
    let prefix = unique_prefix("example_shared_informer");
    put(&client, format!("{prefix}tmp/a"), cm("tmp", "a", "{}")).await;
    put(&client, format!("{prefix}prod/b"), cm("prod", "b", "{}")).await;
    let ex = Example::start("shared_informer", &etcd.endpoints, &["--prefix", &prefix]);
    assert_eq!(
        sorted(ex.next_lines(4)),
        [
            "created, name: a",
            "created, name: b",
            "created, namespace: prod",
            "created, namespace: tmp",
        ]
    );
    put(&client, format!("{prefix}dev/c"), cm("dev", "c", "{}")).await;
    assert_eq!(
        sorted(ex.next_lines(2)),
        ["created, name: c", "created, namespace: dev"]
    );
    ex.interrupt();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quickstart_example_prints_sync_then_changes() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = etcd.client().await;
    let prefix = unique_prefix("example_quickstart");
    put(&client, format!("{prefix}tmp/a"), cm("tmp", "a", "{}")).await;
    put(&client, format!("{prefix}tmp/b"), cm("tmp", "b", "{}")).await;
    let ex = Example::start("quickstart", &etcd.endpoints, &["--prefix", &prefix]);
    // The handler's lines and the sync line come from different tasks: any order.
    assert_eq!(
        sorted(ex.next_lines(3)),
        ["created: tmp/a", "created: tmp/b", "synced: 2 objects"]
    );
    add_update_delete(&ex, &client, &prefix, ["created", "updated", "deleted"]).await;
    ex.interrupt();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protobuf_example_writes_its_demo_and_prints_its_changes() {
    use etcd_informer::client::TypedClient;
    use etcd_informer::proto::ConfigMap;
    use etcd_informer::ProstCodec;

    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = etcd.client().await;
    let prefix = unique_prefix("example_protobuf");
    let ex = Example::start("protobuf", &etcd.endpoints, &["--prefix", &prefix]);
    assert_eq!(
        ex.next_lines(1),
        [r#"created: tmp/protobuf-demo {"greeting": "hello"}"#]
    );
    let writer = TypedClient::new(
        client.clone(),
        prefix.clone(),
        ProstCodec::<ConfigMap>::new(),
    )
    .expect("typed client");
    let demo = ConfigMap {
        namespace: "tmp".into(),
        name: "protobuf-demo".into(),
        labels: Default::default(),
        data: [("greeting".to_string(), "bye".to_string())].into(),
    };
    writer.put("tmp/protobuf-demo", &demo).await.expect("put");
    assert_eq!(
        ex.next_lines(1),
        [r#"updated: tmp/protobuf-demo {"greeting": "bye"}"#]
    );
    client
        .kv_client()
        .delete(format!("{prefix}tmp/protobuf-demo"), None)
        .await
        .unwrap();
    assert_eq!(ex.next_lines(1), ["deleted: tmp/protobuf-demo"]);
    ex.interrupt();
}

/// One short round of every fault kind against the informer of one endpoint (about 10 s): the
/// soak's report lines, its table and its verdict.
#[test]
fn chaos_example_runs_a_quick_round_of_every_fault() {
    // The soak starts its own cluster; ETCD_ENDPOINTS is not read.
    let ex = Example::start(
        "chaos",
        &[],
        &[
            "--rounds",
            "1",
            "--endpoints",
            "one",
            "--quick",
            "--seed",
            "42",
        ],
    );
    assert_eq!(
        ex.next_lines(1),
        ["chaos soak: seed 42, 1 round(s) of each fault kind per endpoint mode, quick timeouts"]
    );
    let faults = ["compaction", "kill-restart", "pause-resume", "wipe-cluster"];
    let rounds = ex.next_lines(faults.len());
    for (i, line) in rounds.iter().enumerate() {
        assert!(
            line.starts_with(&format!("seed 42 one endpoint round {} ", i + 1))
                && line.ends_with(", 0 violations"),
            "{line}"
        );
    }
    let mut seen: Vec<&str> = faults
        .iter()
        .copied()
        .filter(|f| rounds.iter().any(|l| l.contains(&format!(" {f} ("))))
        .collect();
    seen.sort_unstable();
    assert_eq!(seen, faults, "each fault kind once: {rounds:?}");
    let table = ex.next_lines(2 + faults.len() + 1);
    assert_eq!(table[0], "");
    assert!(
        table[1].starts_with("endpoints") && table[1].contains("relisted"),
        "{table:?}"
    );
    for row in &table[2..2 + faults.len()] {
        assert!(row.starts_with("one endpoint"), "{table:?}");
    }
    assert_eq!(
        table[2 + faults.len()],
        "no violation, every round converged (seed 42)"
    );
    let status = ex.exit_status(Duration::from_secs(30));
    assert!(status.success(), "chaos exited with {status}");
}

/// The owner of every shard under the sharded example's records, by the owner records.
async fn shard_owners(client: &etcd_client::Client, records: &str) -> Vec<String> {
    let resp = client
        .kv_client()
        .get(
            format!("{records}shards/"),
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .expect("read the shard records");
    resp.kvs()
        .iter()
        .map(|kv| String::from_utf8_lossy(kv.value()).into_owned())
        .collect()
}

/// Reads `reconciled K by NAME at REV` lines from `examples` until every job in `expected`
/// (job -> revision) has been reconciled at that revision; returns job -> the replicas that
/// reconciled that revision.
fn reconciled_lines(
    examples: &[&Example],
    expected: &std::collections::BTreeMap<String, i64>,
) -> std::collections::BTreeMap<String, Vec<String>> {
    let mut seen: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    let deadline = Instant::now() + Duration::from_secs(60);
    while expected.keys().any(|k| !seen.contains_key(k)) {
        assert!(
            Instant::now() < deadline,
            "not every job was reconciled; seen {seen:?}"
        );
        let mut quiet = true;
        for ex in examples {
            while let Ok(line) = ex.lines.try_recv() {
                quiet = false;
                let words: Vec<&str> = line.split(' ').collect();
                let ["reconciled", job, "by", name, "at", rev] = words[..] else {
                    panic!("unexpected line {line:?}");
                };
                if expected.get(job) == Some(&rev.parse().expect("a revision")) {
                    seen.entry(job.to_owned())
                        .or_default()
                        .push(name.to_owned());
                }
            }
        }
        if quiet {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_controller_example_shares_jobs_among_three_processes() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = etcd.client().await;
    let base = unique_prefix("example_sharded");
    let jobs = format!("{base}jobs/");
    let records = format!("{base}sharding/jobs/");
    let replicas: Vec<Example> = ["a", "b", "c"]
        .iter()
        .map(|name| {
            Example::start(
                "sharded_controller",
                &etcd.endpoints,
                &["--name", name, "--prefix", &jobs, "--lease-ttl", "2"],
            )
        })
        .collect();
    // Every shard owned, by all three, before the jobs arrive: then no handoff is under way.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let owners = shard_owners(&client, &records).await;
        let distinct: std::collections::BTreeSet<_> = owners.iter().collect();
        if owners.len() == 64 && distinct.len() == 3 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the three replicas never shared the 64 shards: {} owned by {distinct:?}",
            owners.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Job names unique to this run: the example writes to the fixed /demo/done/.
    let nonce = base
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap()
        .to_owned();
    let mut expected = std::collections::BTreeMap::new();
    for i in 0..30 {
        let job = format!("{nonce}-{i}");
        let resp = client
            .kv_client()
            .put(format!("{jobs}{job}"), "run", None)
            .await
            .expect("put a job");
        expected.insert(job, resp.header().unwrap().revision());
    }
    let seen = reconciled_lines(&replicas.iter().collect::<Vec<_>>(), &expected);
    let mut by = std::collections::BTreeMap::<&str, usize>::new();
    for (job, names) in &seen {
        assert_eq!(names.len(), 1, "{job} reconciled by {names:?}");
        *by.entry(names[0].as_str()).or_default() += 1;
        let done = client
            .kv_client()
            .get(format!("/demo/done/{job}"), None)
            .await
            .expect("read /demo/done");
        let value = String::from_utf8_lossy(done.kvs()[0].value()).into_owned();
        assert_eq!(value, format!("{} {}", names[0], expected[job]));
    }
    assert_eq!(by.len(), 3, "every replica took a share: {by:?}");

    // One leaves with Ctrl-C: its jobs go to the other two.
    let mut replicas = replicas.into_iter();
    let leaving = replicas.next().unwrap();
    leaving.interrupt();
    let rest: Vec<Example> = replicas.collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    while shard_owners(&client, &records)
        .await
        .iter()
        .any(|o| o == "a")
        || shard_owners(&client, &records).await.len() < 64
    {
        assert!(
            Instant::now() < deadline,
            "a's shards were never taken over"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (job, revision) in expected.iter_mut() {
        let resp = client
            .kv_client()
            .put(format!("{jobs}{job}"), "again", None)
            .await
            .expect("put a job");
        *revision = resp.header().unwrap().revision();
    }
    let seen = reconciled_lines(&rest.iter().collect::<Vec<_>>(), &expected);
    for (job, names) in &seen {
        // A replica reconciles every key of a shard it gains: a put racing the takeover can be
        // reconciled twice by it at one revision (the guide's "Controllers", "What a replica
        // reconciles"), never by two replicas.
        let by: std::collections::BTreeSet<_> = names.iter().collect();
        assert!(
            by.len() == 1 && names.len() <= 2,
            "{job} reconciled by {names:?}"
        );
        assert_ne!(names[0], "a");
    }
    for ex in rest {
        ex.interrupt();
    }
}

/// Issue 37: two `cache_server` processes in front of a 3-member cluster, under writes. One is
/// SIGKILLed, then started again on its address, then the other gets SIGTERM (a drain).
/// A raw etcd-client watch given both addresses, which watches again from its last revision
/// after each error, sees every revision once, in order; an informer given both ends with
/// etcd's content, no relist and no delete etcd did not make.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_server_replicas_survive_a_kill_a_restart_and_a_drain() {
    use std::collections::BTreeSet;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    use etcd_informer::{
        EtcdListerWatcher, ResourceEventHandlerFuncs, SharedIndexInformer, TextCodec,
    };

    let cluster = etcd_informer::testing::etcd::EtcdCluster::start(3)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let endpoints = cluster.endpoints();
    let client = etcd_informer::connect(endpoints.clone())
        .await
        .expect("connect to the cluster");
    let prefix = unique_prefix("example_cache_server_replicas");
    let from = client
        .kv_client()
        .put(format!("{prefix}k0"), "initial", None)
        .await
        .expect("put")
        .header()
        .map_or(0, |h| h.revision())
        + 1;
    let (a, b) = (free_addr(), free_addr());
    let (server_a, server_b) = (
        cache_server(&endpoints, &prefix, &a),
        cache_server(&endpoints, &prefix, &b),
    );
    let via = etcd_informer::connect([a.as_str(), b.as_str()])
        .await
        .expect("connect to both");

    // The raw watcher: every mod_revision it hears, watching again after each error.
    let heard = Arc::new(Mutex::new(Vec::<i64>::new()));
    let watching = Arc::new(AtomicBool::new(true));
    let writing = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (via, prefix, heard, watching, writing) = (
            via.clone(),
            prefix.clone(),
            heard.clone(),
            watching.clone(),
            writing.clone(),
        );
        tokio::spawn(async move {
            let mut next = from;
            // Streams that ended or went silent under it (a server killed or drained).
            let mut failed_over = 0;
            while watching.load(Ordering::Relaxed) {
                let options = etcd_client::WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(next);
                let Ok(stream) = via
                    .watch_client()
                    .watch(prefix.as_str(), Some(options))
                    .await
                else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                let (_requests, mut responses) = stream.split();
                loop {
                    let r =
                        match tokio::time::timeout(Duration::from_millis(500), responses.message())
                            .await
                        {
                            Ok(Ok(Some(r))) => r,
                            // The server ended the stream (drained: an error; killed: a
                            // reset or an end), or it went silent while writes go on.
                            Ok(Err(_)) | Ok(Ok(None)) => {
                                failed_over += 1;
                                break;
                            }
                            Err(_) if writing.load(Ordering::Relaxed) => {
                                failed_over += 1;
                                break;
                            }
                            // Quiet after the writes: look at `watching` again.
                            Err(_) => break,
                        };
                    assert!(!r.canceled(), "cancelled: {r:?}");
                    let mut heard = heard.lock().expect("heard");
                    for e in r.events() {
                        let revision = e.kv().map_or(0, |kv| kv.mod_revision());
                        heard.push(revision);
                        next = revision + 1;
                    }
                }
            }
            failed_over
        })
    };
    let lw = EtcdListerWatcher::new(via, prefix.as_str(), TextCodec).expect("source");
    let informer = SharedIndexInformer::new(lw, Default::default());
    let deleted = Arc::new(Mutex::new(Vec::<String>::new()));
    let d = deleted.clone();
    informer
        .add_event_handler(
            ResourceEventHandlerFuncs::new()
                .on_delete(move |o| d.lock().expect("deleted").push(o.key().to_owned())),
        )
        .expect("handler");
    let run = tokio::spawn(informer.clone().run());
    tokio::time::timeout(Duration::from_secs(30), informer.wait_for_cache_sync())
        .await
        .expect("the informer syncs through the servers");
    let relists = informer.health().reflector.relists.total();

    // Writes all along, to 7 keys; every fifth a delete.
    let mut writes = Writes {
        client: client.clone(),
        prefix: prefix.clone(),
        n: 0,
        revisions: Vec::new(),
        deleted: BTreeSet::new(),
    };
    writing.store(true, Ordering::Relaxed);
    writes.for_(Duration::from_millis(500)).await;
    drop(server_a); // SIGKILL
    writes.for_(Duration::from_millis(800)).await;
    // Started on a blocking thread: waiting for its ready line must not hold a runtime worker.
    let restart = {
        let (endpoints, prefix, a) = (endpoints.clone(), prefix.clone(), a.clone());
        tokio::task::spawn_blocking(move || cache_server(&endpoints, &prefix, &a))
    };
    writes.for_(Duration::from_millis(500)).await;
    let server_a = restart.await.expect("server A started again");
    writes.for_(Duration::from_millis(500)).await;
    let drained = tokio::task::spawn_blocking(move || server_b.stop_with(libc::SIGTERM));
    writes.for_(Duration::from_millis(800)).await;
    drained.await.expect("server B drained and exited cleanly");
    writes.for_(Duration::from_millis(300)).await;
    writing.store(false, Ordering::Relaxed);
    let (written, deleted_by_etcd) = (writes.revisions, writes.deleted);

    // Everything written reaches the watcher and the informer through server A.
    let last = *written.last().expect("writes");
    let deadline = Instant::now() + Duration::from_secs(30);
    while heard.lock().expect("heard").last().copied() < Some(last) {
        assert!(
            Instant::now() < deadline,
            "the watcher stopped at {:?} of {last}",
            heard.lock().expect("heard").last()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    watching.store(false, Ordering::Relaxed);
    let failed_over = watcher.await.expect("watcher");
    let heard: Vec<i64> = heard.lock().expect("heard").clone();
    let deletes_heard: Vec<String> = deleted.lock().expect("deleted").clone();
    let spurious: Vec<&String> = deletes_heard
        .iter()
        .filter(|k| !deleted_by_etcd.contains(*k))
        .collect();
    let etcd_keys = client
        .kv_client()
        .get(
            prefix.as_str(),
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .expect("list etcd")
        .kvs()
        .len();
    let deadline = Instant::now() + Duration::from_secs(30);
    while informer.indexer().len() != etcd_keys || informer.revision() < last {
        assert!(
            Instant::now() < deadline,
            "the informer holds {} keys at {}, etcd {etcd_keys} at {last}",
            informer.indexer().len(),
            informer.revision()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let relisted = informer.health().reflector.relists.total() - relists;
    informer.stop();
    let _ = run.await;
    assert!(
        heard == written && failed_over >= 1 && relisted == 0 && spurious.is_empty(),
        "the watcher heard {} revisions of {} written (in order, once each: {}), its stream failing {failed_over} times; the informer relisted {relisted} times and heard deletes etcd never made: {spurious:?}",
        heard.len(),
        written.len(),
        heard == written
    );
    server_a.stop_with(libc::SIGTERM);
}

/// The `cache_server` example serving `prefix` at `addr`, once it says it is ready.
fn cache_server(endpoints: &[String], prefix: &str, addr: &str) -> Example {
    let server = Example::start(
        "cache_server",
        endpoints,
        &["--prefix", prefix, "--listen", addr],
    );
    let ready = server.next_lines(1).remove(0);
    assert!(ready.starts_with("ready: serving"), "{ready}");
    server
}

/// A writer of puts and deletes under a prefix, keeping the revisions it made.
struct Writes {
    client: etcd_client::Client,
    prefix: String,
    n: u64,
    /// The revision of each write that changed something, in order.
    revisions: Vec<i64>,
    /// Keys (relative to the prefix) etcd deleted.
    deleted: std::collections::BTreeSet<String>,
}

impl Writes {
    /// Writes every 10 ms for `how_long`: 7 keys, every fifth write a delete.
    async fn for_(&mut self, how_long: Duration) {
        let until = Instant::now() + how_long;
        let mut kv = self.client.kv_client();
        while Instant::now() < until {
            let key = format!("k{}", self.n % 7);
            let full = format!("{}{key}", self.prefix);
            let revision = if self.n % 5 == 4 {
                let done = kv.delete(full, None).await.expect("delete");
                // A delete of a key already gone writes nothing.
                (done.deleted() > 0).then(|| {
                    self.deleted.insert(key);
                    done.header().map_or(0, |h| h.revision())
                })
            } else {
                let done = kv.put(full, self.n.to_string(), None).await.expect("put");
                done.header().map(|h| h.revision())
            };
            self.revisions.extend(revision);
            self.n += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
