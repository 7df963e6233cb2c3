//! The cache server against real etcd: etcdctl run against etcd and against the server must
//! print the same thing; etcd-client and this crate's informer work through it unchanged.
//!
//! The etcdctl comparisons run on a private etcd each (a header's revision is etcd's current
//! one, so no other test may write meanwhile); the others share this binary's etcd with unique
//! prefixes. The etcdctl used is the one beside `ETCD_BIN` when there is one (3.5.1's), else
//! `etcdctl` on `PATH`.
#![cfg(all(feature = "testing", feature = "server"))]

mod clients;
#[path = "../common/mod.rs"]
mod common;
mod etcdctl;
mod faults;
mod fidelity;
mod parity;
mod replicas;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use common::{
    cache_state, converges, etcd_state, eventually, put_large_prefix, read_cost, shared_client,
};
use etcd_client::{
    Client, Compare, CompareOp, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchFilterType,
    WatchOptions,
};
use etcd_informer::serve::{CacheServer, CacheServerOptions, RunningServer};
use etcd_informer::testing::etcd::{test_etcd, unique_prefix, EtcdServer};
use etcd_informer::{connect, EtcdListerWatcher, EtcdOptions, SharedIndexInformer, TextCodec};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const WITHIN: Duration = Duration::from_secs(20);

/// The etcdctl matching the etcd under test.
fn etcdctl() -> PathBuf {
    if let Some(bin) = std::env::var_os("ETCD_BIN") {
        let beside = PathBuf::from(bin).with_file_name("etcdctl");
        if beside.is_file() {
            return beside;
        }
    }
    PathBuf::from("etcdctl")
}

fn etcdctl_command(endpoint: &str, args: &[&str]) -> Command {
    let mut command = Command::new(etcdctl());
    for var in [
        "ETCDCTL_ENDPOINTS",
        "ETCDCTL_USER",
        "ETCDCTL_CACERT",
        "ETCDCTL_CERT",
        "ETCDCTL_KEY",
    ] {
        command.env_remove(var);
    }
    command
        .env("ETCDCTL_API", "3")
        .arg("--endpoints")
        .arg(endpoint)
        .args(args)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    command
}

/// What etcdctl printed: stdout, stderr without its client-side retry log lines (they carry
/// timestamps and random client ids), and the exit status.
#[derive(Debug, PartialEq, Eq)]
struct Printed {
    stdout: String,
    stderr: String,
    code: Option<i32>,
}

async fn ctl(endpoint: &str, args: &[&str]) -> Printed {
    let out = tokio::time::timeout(WITHIN, etcdctl_command(endpoint, args).output())
        .await
        .unwrap_or_else(|_| panic!("etcdctl {args:?} against {endpoint} did not end in {WITHIN:?}"))
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {} (install etcd's etcdctl or set ETCD_BIN beside one): {e}",
                etcdctl().display()
            )
        });
    let stderr = String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| !l.starts_with("{\"level\""))
        .collect::<Vec<_>>()
        .join("\n");
    Printed {
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr,
        code: out.status.code(),
    }
}

/// Runs `args` against etcd and against the server and asserts both print the same.
async fn same(etcd: &str, server: &str, args: &[&str]) -> Printed {
    let direct = ctl(etcd, args).await;
    let served = ctl(server, args).await;
    assert_eq!(
        direct, served,
        "etcdctl {args:?}: etcd (left) and the cache server (right) differ"
    );
    direct
}

/// Runs `etcdctl watch ...` until a line satisfies `last`, then kills it; returns the lines.
async fn watch_until(endpoint: &str, args: &[&str], last: impl Fn(&str) -> bool) -> String {
    let mut child = etcdctl_command(endpoint, args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", etcdctl().display()));
    let stdout = child.stdout.take().expect("piped stdout");
    let mut lines = BufReader::new(stdout).lines();
    let mut seen = String::new();
    let read = async {
        while let Ok(Some(line)) = lines.next_line().await {
            seen.push_str(&line);
            seen.push('\n');
            if last(&line) {
                return true;
            }
        }
        false
    };
    let done = tokio::time::timeout(WITHIN, read).await;
    let _ = child.kill().await;
    assert!(
        matches!(done, Ok(true)),
        "etcdctl {args:?} against {endpoint} never printed its last line; it printed:\n{seen}"
    );
    seen
}

/// gRPC's standard health check (`grpc.health.v1`), as Kubernetes' gRPC probes send it.
#[derive(Clone, PartialEq, prost::Message)]
struct HealthCheckRequest {
    #[prost(string, tag = "1")]
    service: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct HealthCheckResponse {
    #[prost(int32, tag = "1")]
    status: i32,
}

/// The server's answer to a health check: 1 SERVING, 2 NOT_SERVING.
async fn grpc_health(server: &RunningServer) -> i32 {
    let url = format!("http://{}", server.local_addr());
    let channel = tonic::transport::Channel::from_shared(url)
        .expect("url")
        .connect()
        .await
        .expect("connect for a health check");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/grpc.health.v1.Health/Check");
    let request = tonic::Request::new(HealthCheckRequest {
        service: String::new(),
    });
    let answer: tonic::Response<HealthCheckResponse> = grpc
        .unary(request, path, tonic_prost::ProstCodec::default())
        .await
        .expect("a health answer");
    answer.into_inner().status
}

/// A watch of `prefix` through `via` from now, once the server has confirmed it.
async fn watch_prefix(
    via: &Client,
    prefix: &str,
) -> (
    etcd_client::WatchRequestSender,
    etcd_client::WatchResponseStream,
) {
    let (requests, mut responses) = via
        .watch_client()
        .watch(prefix, Some(WatchOptions::new().with_prefix()))
        .await
        .expect("watch")
        .split();
    let created = responses.message().await.expect("stream").expect("created");
    assert!(created.created(), "{created:?}");
    (requests, responses)
}

async fn start_server(client: &Client, endpoints: Vec<String>, prefix: &str) -> RunningServer {
    start_server_with(client, endpoints, prefix, CacheServerOptions::default()).await
}

async fn start_server_with(
    client: &Client,
    endpoints: Vec<String>,
    prefix: &str,
    options: CacheServerOptions,
) -> RunningServer {
    let server = CacheServer::new(client.clone(), endpoints, prefix)
        .with_options(options)
        .bind("127.0.0.1:0".parse().expect("address"))
        .await
        .expect("the cache server binds");
    server.ready(WITHIN).await.expect("the cache server syncs");
    server
}

/// An informer of `prefix` over `via`, synced, whose handler logs the keys of its deletes;
/// with the task running it.
async fn synced_informer_logging_deletes(
    via: Client,
    prefix: &str,
) -> (
    SharedIndexInformer<String>,
    std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    tokio::task::JoinHandle<()>,
) {
    let lw = EtcdListerWatcher::new(via, prefix, TextCodec).expect("source");
    let informer = SharedIndexInformer::new(lw, Default::default());
    let deleted = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let d = deleted.clone();
    informer
        .add_event_handler(
            etcd_informer::ResourceEventHandlerFuncs::new()
                .on_delete(move |o| d.lock().expect("log").push(o.key().to_owned())),
        )
        .expect("handler");
    let run = tokio::spawn(informer.clone().run());
    tokio::time::timeout(WITHIN, informer.wait_for_cache_sync())
        .await
        .expect("sync");
    (informer, deleted, run)
}

async fn private_etcd() -> EtcdServer {
    EtcdServer::start()
        .await
        .unwrap_or_else(|e| panic!("cannot start etcd (set ETCD_BIN or put etcd on PATH): {e}"))
}

/// A private etcd to wipe, its raft term raised first (two restarts) so that the wiped store's
/// term is below it, with `{p}old0`..`{p}old9` written; and a client of it.
async fn etcd_to_wipe(p: &str) -> (EtcdServer, Client) {
    let etcd = private_etcd().await;
    for _ in 0..2 {
        etcd.restart().await.expect("restart etcd");
    }
    let client = etcd.client().await;
    for i in 0..10 {
        put(&client, &format!("{p}old{i}"), "before").await;
    }
    (etcd, client)
}

async fn put(client: &Client, key: &str, value: &str) -> i64 {
    let resp = client
        .kv_client()
        .put(key, value, None)
        .await
        .expect("put to etcd");
    resp.header().expect("header").revision()
}

async fn delete(client: &Client, key: &str) -> i64 {
    let resp = client
        .kv_client()
        .delete(key, None)
        .await
        .expect("delete in etcd");
    resp.header().expect("header").revision()
}

/// An answer as a comparison sees it: a gRPC error as its code and message (etcd's text), any
/// other outcome as its debug form.
fn outcome<T: std::fmt::Debug>(result: Result<T, etcd_client::Error>) -> String {
    match result {
        Err(etcd_client::Error::GRpcStatus(s)) => format!("{:?} {}", s.code(), s.message()),
        other => format!("{other:?}"),
    }
}

/// The next response of a watch stream.
async fn next_response(
    name: &str,
    responses: &mut etcd_client::WatchResponseStream,
) -> etcd_client::WatchResponse {
    tokio::time::timeout(WITHIN, responses.message())
        .await
        .unwrap_or_else(|_| panic!("{name}: no answer"))
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .unwrap_or_else(|| panic!("{name}: the stream ended"))
}

/// Waits until the server's cache reaches `revision`.
async fn caught_up(server: &RunningServer, revision: i64) {
    eventually(
        &format!("the cache server reaches revision {revision}"),
        WITHIN,
        || server.stats().revision >= revision,
    )
    .await;
}

/// Waits until the server has taken `taken` forwarded watches back to its cache. A relay hands
/// its watch back only where the cache is when it checks, so meanwhile `key` is written again
/// now and then, and the watch read from `responses` hears each write once, in order.
async fn until_taken_back(
    server: &RunningServer,
    client: &Client,
    key: &str,
    responses: &mut etcd_client::WatchResponseStream,
    taken: u64,
) {
    let deadline = tokio::time::Instant::now() + WITHIN;
    let mut poll = tokio::time::interval(Duration::from_millis(20));
    for round in 0.. {
        if server.stats().watches_taken_back >= taken {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the forwarded watch never came back to the cache: {:?}",
            server.stats()
        );
        if round % 25 == 24 {
            let written = put(client, key, &format!("again{round}")).await;
            let r = tokio::time::timeout(WITHIN, responses.message())
                .await
                .expect("the watch hears the write")
                .expect("stream")
                .expect("open");
            assert_eq!(event_revisions(&r), [written], "{r:?}");
        }
        poll.tick().await;
    }
}

/// The `mod_revision`s of a watch response's events, in order.
fn event_revisions(r: &etcd_client::WatchResponse) -> Vec<i64> {
    r.events()
        .iter()
        .filter_map(|e| e.kv())
        .map(|kv| kv.mod_revision())
        .collect()
}
