//! Runs the `informer`, `list_watcher` and `indexer` examples against the test etcd and checks
//! their output lines exactly.
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

    /// Sends Ctrl-C and checks the example exits cleanly.
    fn interrupt(mut self) {
        // SAFETY: plain kill(2) on our own child's pid.
        let pid = i32::try_from(self.child.id()).expect("pid fits i32");
        assert_eq!(unsafe { libc::kill(pid, libc::SIGINT) }, 0);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for example") {
                assert!(status.success(), "example exited with {status}");
                return;
            }
            assert!(
                Instant::now() < deadline,
                "example did not exit within 10 s of Ctrl-C"
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
