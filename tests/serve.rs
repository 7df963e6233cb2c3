//! The cache server against real etcd: etcdctl run against etcd and against the server must
//! print the same thing; etcd-client and this crate's informer work through it unchanged.
//!
//! The etcdctl comparisons run on a private etcd each (a header's revision is etcd's current
//! one, so no other test may write meanwhile); the others share this binary's etcd with unique
//! prefixes. The etcdctl used is the one beside `ETCD_BIN` when there is one (3.5.1's), else
//! `etcdctl` on `PATH`.
#![cfg(all(feature = "testing", feature = "server"))]

mod common;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use common::{cache_state, converges, etcd_state, eventually, shared_client};
use etcd_client::{
    Client, Compare, CompareOp, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchFilterType,
    WatchOptions,
};
use etcd_informer::serve::{CacheServer, CacheServerOptions, RunningServer};
use etcd_informer::testing::etcd::{test_etcd, unique_prefix, EtcdServer};
use etcd_informer::{connect, EtcdListerWatcher, SharedIndexInformer, TextCodec};
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

async fn private_etcd() -> EtcdServer {
    EtcdServer::start()
        .await
        .unwrap_or_else(|e| panic!("cannot start etcd (set ETCD_BIN or put etcd on PATH): {e}"))
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

/// Waits until the server's cache reaches `revision`.
async fn caught_up(server: &RunningServer, revision: i64) {
    eventually(
        &format!("the cache server reaches revision {revision}"),
        WITHIN,
        || server.stats().revision >= revision,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcdctl_reads_match_etcd() {
    let etcd = private_etcd().await;
    let client = etcd.client().await;
    let p = "/registry/things/";
    for i in 0..5 {
        put(&client, &format!("{p}k{i}"), &format!("v{i}")).await;
    }
    put(&client, &format!("{p}k1"), "v1b").await;
    delete(&client, &format!("{p}k3")).await;
    put(&client, "/other/x", "outside").await;
    let server = start_server(&client, etcd.endpoints(), p).await;
    let first_listed = server.stats().revision.to_string();
    let a = put(&client, &format!("{p}k5"), "v5").await;
    put(&client, &format!("{p}k0"), "v0b").await;
    delete(&client, &format!("{p}k2")).await;
    let txn = Txn::new().and_then(vec![
        TxnOp::put(format!("{p}k6"), "v6", None),
        TxnOp::put(format!("{p}k7"), "a-small-value", None),
    ]);
    let last = client
        .kv_client()
        .txn(txn)
        .await
        .expect("txn")
        .header()
        .expect("header")
        .revision();
    caught_up(&server, last).await;
    // A compaction through the server, within the server's history: both refuse below it
    // from now on, and compacting again is etcd's error through both.
    let (e, s) = (etcd.endpoint(), server.local_addr().to_string());
    let listed = a;
    let compact = ["compact", &listed.to_string()].map(str::to_owned);
    let compact: Vec<&str> = compact.iter().map(String::as_str).collect();
    let compacted = ctl(&s, &compact).await;
    assert_eq!(compacted.stdout, format!("compacted revision {listed}\n"));
    let again = same(&e, &s, &compact).await;
    assert!(again.stderr.contains("compacted"), "{again:?}");
    let k1 = format!("{p}k1");
    let k6 = format!("{p}k6");
    let missing = format!("{p}missing");
    let (rev_a, rev_a1, rev_listed, rev_below) = (
        a.to_string(),
        (a + 1).to_string(),
        listed.to_string(),
        (listed - 1).to_string(),
    );
    let cases: Vec<Vec<&str>> = vec![
        vec!["get", "--prefix", p],
        vec!["get", "--prefix", p, "-w", "json"],
        vec!["get", "--prefix", p, "-w", "fields"],
        vec!["get", "--prefix", p, "--limit", "2", "-w", "json"],
        vec!["get", "--prefix", p, "--limit", "0", "-w", "json"],
        vec!["get", "--prefix", p, "--limit", "1000000000", "-w", "json"],
        vec!["get", "--prefix", p, "--keys-only"],
        vec!["get", "--prefix", p, "--keys-only", "-w", "json"],
        vec!["get", "--prefix", p, "--count-only", "-w", "fields"],
        vec!["get", "--prefix", p, "--print-value-only"],
        vec!["get", &k1],
        vec!["get", &k1, "-w", "json"],
        vec!["get", &k1, &k6],
        vec!["get", &missing, "-w", "json"],
        vec![
            "get",
            "--prefix",
            p,
            "--sort-by",
            "VALUE",
            "--order",
            "DESCEND",
            "-w",
            "json",
        ],
        vec!["get", "--prefix", p, "--sort-by", "CREATE"],
        vec![
            "get",
            "--prefix",
            p,
            "--sort-by",
            "MODIFY",
            "--limit",
            "2",
            "-w",
            "json",
        ],
        vec![
            "get",
            "--prefix",
            p,
            "--sort-by",
            "VERSION",
            "--order",
            "DESCEND",
        ],
        vec![
            "get", "--prefix", p, "--order", "DESCEND", "--limit", "3", "-w", "json",
        ],
        vec!["get", "--prefix", p, "--rev", &rev_a],
        vec!["get", "--prefix", p, "--rev", &rev_a1, "-w", "json"],
        vec!["get", "--prefix", p, "--rev", &first_listed],
        vec!["watch", "--prefix", p, "--rev", &rev_below],
        vec!["get", "--prefix", p, "--rev", &rev_listed, "-w", "json"],
        vec!["get", "--prefix", p, "--rev", &rev_below],
        vec!["get", "--prefix", p, "--rev", "100000"],
        vec!["get", "--prefix", p, "--consistency", "s", "-w", "json"],
        // Outside the prefix: forwarded.
        vec!["get", "--prefix", "/other/", "-w", "json"],
        vec!["get", "--from-key", p],
        vec!["get", ""],
    ];
    for args in &cases {
        same(&e, &s, args).await;
    }
    let stats = server.stats();
    assert!(stats.ranges_from_cache >= 20, "{stats:?}");
    assert!(stats.forwarded >= 3, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcdctl_watch_matches_etcd() {
    let etcd = private_etcd().await;
    let client = etcd.client().await;
    let p = "/registry/watched/";
    put(&client, &format!("{p}before"), "old").await;
    let server = start_server(&client, etcd.endpoints(), p).await;
    let listed = server.stats().revision;
    let first = put(&client, &format!("{p}k1"), "a").await;
    put(&client, &format!("{p}k2"), "b").await;
    put(&client, &format!("{p}k1"), "a2").await;
    delete(&client, &format!("{p}k2")).await;
    put(&client, &format!("{p}before"), "new").await;
    let txn = Txn::new().and_then(vec![
        TxnOp::put(format!("{p}k3"), "c", None),
        TxnOp::delete(format!("{p}k1"), None),
    ]);
    client.kv_client().txn(txn).await.expect("txn");
    let end = put(&client, &format!("{p}zz-end"), "END").await;
    caught_up(&server, end).await;
    let (e, s) = (etcd.endpoint(), server.local_addr().to_string());
    let from = first.to_string();
    let end_key = format!("{p}zz-end");
    let k1 = format!("{p}k1");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["watch", "--prefix", p, "--rev", &from], "END"),
        (
            vec!["watch", "--prefix", p, "--rev", &from, "--prev-kv"],
            "END",
        ),
        // The whole catch-up comes as one response: one JSON line.
        (
            vec!["watch", "--prefix", p, "--rev", &from, "-w", "json"],
            "RU5E",
        ),
        (vec!["watch", &end_key, "--rev", &from], "END"),
        (
            vec!["watch", &k1, &end_key, "--rev", &from, "--prev-kv"],
            "a2",
        ),
    ];
    for (args, last) in &cases {
        let direct = watch_until(&e, args, |l| l.contains(last)).await;
        let served = watch_until(&s, args, |l| l.contains(last)).await;
        assert_eq!(
            direct, served,
            "etcdctl {args:?}: etcd (left) and the cache server (right) differ"
        );
    }
    // A live watch: from the next revision, the events of writes made after it opened.
    let next = (end + 1).to_string();
    let live = ["watch", "--prefix", p, "--rev", &next, "--prev-kv"];
    let writer = {
        let client = client.clone();
        let p = p.to_string();
        tokio::spawn(async move {
            put(&client, &format!("{p}k4"), "live").await;
            put(&client, &format!("{p}k4"), "live2").await;
            delete(&client, &format!("{p}k4")).await;
            put(&client, &format!("{p}zz-end"), "END2").await;
        })
    };
    let (direct, served) = tokio::join!(
        watch_until(&e, &live, |l| l == "END2"),
        watch_until(&s, &live, |l| l == "END2")
    );
    writer.await.expect("writer");
    assert_eq!(
        direct, served,
        "live watch: etcd (left) and the cache server (right) differ"
    );
    // Below the history (and below etcd's compaction): both cancel with compacted.
    let compact_at = (listed + 2).to_string();
    ctl(&e, &["compact", &compact_at]).await;
    let below = (listed - 1).to_string();
    let printed = same(&e, &s, &["watch", "--prefix", p, "--rev", &below]).await;
    assert_ne!(printed.code, Some(0), "{printed:?}");
    assert!(printed.stderr.contains("compacted"), "{printed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_through_the_server_and_read_your_writes() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = shared_client().await;
    let p = unique_prefix("serve_writes");
    let server = start_server(&client, etcd.endpoints.clone(), &p).await;
    let (e, s) = (etcd.endpoints[0].clone(), server.local_addr().to_string());
    // The same commands on two keys, one through each: the same output.
    for (direct, served) in [
        (vec!["put", "a", "1"], vec!["put", "b", "1"]),
        (vec!["put", "a", "2"], vec!["put", "b", "2"]),
        (vec!["del", "a"], vec!["del", "b"]),
        (vec!["del", "a"], vec!["del", "b"]),
    ] {
        let key = |args: &Vec<&str>| {
            let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
            args[1] = format!("{p}{}", args[1]);
            args
        };
        let (d, v) = (key(&direct), key(&served));
        let d: Vec<&str> = d.iter().map(String::as_str).collect();
        let v: Vec<&str> = v.iter().map(String::as_str).collect();
        assert_eq!(ctl(&e, &d).await, ctl(&s, &v).await, "{d:?} / {v:?}");
    }
    // Read-your-writes through the server, and linearizable reads of writes made directly.
    let via = connect([s.clone()])
        .await
        .expect("connect to the cache server");
    let key = format!("{p}ryw");
    for i in 0..50 {
        let value = i.to_string();
        if i % 2 == 0 {
            via.kv_client()
                .put(key.as_str(), value.as_str(), None)
                .await
                .expect("put via server");
        } else {
            put(&client, &key, &value).await;
        }
        let got = via
            .kv_client()
            .get(key.as_str(), None)
            .await
            .expect("get via server");
        assert_eq!(
            got.kvs().first().and_then(|kv| kv.value_str().ok()),
            Some(value.as_str()),
            "write {i} not visible to the next linearizable read through the server"
        );
    }
    // A conditional transaction through the server.
    let txn = Txn::new()
        .when(vec![Compare::value(key.as_str(), CompareOp::Equal, "49")])
        .and_then(vec![TxnOp::put(key.as_str(), "txn", None)]);
    let resp = via.kv_client().txn(txn).await.expect("txn via server");
    assert!(resp.succeeded());
    let got = via.kv_client().get(key.as_str(), None).await.expect("get");
    assert_eq!(got.kvs()[0].value_str().ok(), Some("txn"));
    assert!(server.stats().forwarded >= 26, "{:?}", server.stats());
    // Lease keep-alives and snapshots (streams) pass through to etcd.
    let granted = ctl(&s, &["lease", "grant", "30"]).await;
    let id = granted
        .stdout
        .split_whitespace()
        .nth(1)
        .unwrap_or_else(|| panic!("{granted:?}"))
        .to_string();
    let kept = ctl(&s, &["lease", "keep-alive", "--once", &id]).await;
    assert!(kept.stdout.contains("keepalived with TTL(30)"), "{kept:?}");
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("snapshot.db");
    let saved = ctl(&s, &["snapshot", "save", &file.to_string_lossy()]).await;
    assert_eq!(saved.code, Some(0), "{saved:?}");
    assert!(std::fs::metadata(&file).expect("snapshot written").len() > 0);
}

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
    // A revision below the server's history: etcd's compacted error.
    let old = Some(GetOptions::new().with_prefix().with_revision(1));
    let served = status_of(kv(&via).get(p.as_str(), old).await);
    assert_eq!(
        served,
        (
            tonic::Code::OutOfRange,
            "etcdserver: mvcc: required revision has been compacted".to_string()
        )
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
    assert_eq!(
        seen,
        vec![
            (EventType::Put, format!("{outside}x"), None),
            (
                EventType::Delete,
                format!("{p}k1"),
                Some("filtered-out".to_string())
            ),
        ]
    );
    let again = kv(&via)
        .get(p.as_str(), Some(GetOptions::new().with_prefix()))
        .await;
    assert_eq!(again.expect("still serving").count(), 4);
    // A key that is not UTF-8 cannot be cached: from then on the server forwards, and its
    // answers stay etcd's.
    let mut odd = p.clone().into_bytes();
    odd.extend_from_slice(b"\xff\xfe");
    client
        .kv_client()
        .put(odd.clone(), "odd", None)
        .await
        .expect("put");
    eventually("the server forwards everything", WITHIN, || {
        server.stats().forwarding_all
    })
    .await;
    let served = kv(&via)
        .get(p.as_str(), Some(GetOptions::new().with_prefix()))
        .await;
    let served = served.expect("served");
    assert_eq!(served.count(), 5);
    assert!(served.kvs().iter().any(|kv| kv.key() == odd.as_slice()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_that_does_not_read_is_cancelled_and_holds_no_one_back() {
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
    let (_slow_requests, mut slow_responses) = slow
        .watch_client()
        .watch(p.as_str(), Some(WatchOptions::new().with_prefix()))
        .await
        .expect("slow watch")
        .split();
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
    for i in 0..100 {
        put(&client, &big(i), &value).await;
        if i % 10 == 0 {
            put(&client, &format!("{small}k"), &i.to_string()).await;
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
    assert_eq!(server.stats().slow_watches_cancelled, 0);
    // More large values than the history's 8 MiB hold: the slow watcher falls out of it.
    let writes = 400;
    let mut last = 0;
    for i in 0..writes {
        last = put(&client, &big(i), &value).await;
    }
    caught_up(&server, last).await;
    // Now the slow one reads: what fit in its buffers, then a cancel with compact_revision.
    let mut delivered = Vec::new();
    let compact_revision = loop {
        let r = tokio::time::timeout(WITHIN, slow_responses.message())
            .await
            .expect("the slow watcher hears")
            .expect("stream")
            .expect("open");
        if r.canceled() {
            break r.compact_revision();
        }
        delivered.extend(
            r.events()
                .iter()
                .filter_map(|e| e.kv().map(|kv| kv.mod_revision())),
        );
    };
    assert!(compact_revision > 0, "cancelled with a compact revision");
    assert!(delivered.len() < writes, "the slow watcher was cut short");
    assert!(
        delivered.windows(2).all(|w| w[0] < w[1]),
        "in order, no repeats"
    );
    assert_eq!(
        server.stats().slow_watches_cancelled,
        1,
        "only the slow watch"
    );
    // The fast ones are still open and hear the next small write.
    put(&client, &format!("{small}k"), "after").await;
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
async fn a_client_reads_only_what_etcd_lets_it() {
    let etcd = private_etcd().await;
    let e = etcd.endpoint();
    for args in [
        vec!["user", "add", "root", "--new-user-password=rootpw"],
        vec!["user", "add", "reader", "--new-user-password=readerpw"],
        vec!["role", "add", "r"],
        vec![
            "role",
            "grant-permission",
            "r",
            "read",
            "/registry/allowed/",
            "--prefix=true",
        ],
        vec!["user", "grant-role", "reader", "r"],
        vec!["auth", "enable"],
    ] {
        let printed = ctl(&e, &args).await;
        assert_eq!(printed.code, Some(0), "etcdctl {args:?}: {printed:?}");
    }
    let root = Client::connect(
        etcd.endpoints(),
        Some(etcd_client::ConnectOptions::new().with_user("root", "rootpw")),
    )
    .await
    .expect("connect as root");
    put(&root, "/registry/allowed/a", "visible").await;
    put(&root, "/registry/secret/b", "hidden").await;
    let server = start_server(&root, etcd.endpoints(), "/registry/").await;
    let s = server.local_addr().to_string();
    let reader = "--user=reader:readerpw";
    for args in [
        vec![
            reader,
            "get",
            "--prefix",
            "/registry/allowed/",
            "-w",
            "json",
        ],
        vec![reader, "get", "--prefix", "/registry/"],
        vec![reader, "get", "/registry/secret/b"],
        vec![
            reader,
            "get",
            "--prefix",
            "/registry/secret/",
            "--consistency",
            "s",
        ],
        vec!["get", "--prefix", "/registry/allowed/"],
        vec![
            "--user=root:rootpw",
            "get",
            "--prefix",
            "/registry/",
            "-w",
            "json",
        ],
        vec![reader, "watch", "--prefix", "/registry/secret/"],
    ] {
        same(&e, &s, &args).await;
    }
    let refused = ctl(&s, &[reader, "get", "/registry/secret/b"]).await;
    assert!(refused.stderr.contains("permission denied"), "{refused:?}");
    assert!(!refused.stdout.contains("hidden"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_and_watches_through_an_upstream_outage() {
    let etcd = private_etcd().await;
    let client = etcd.client().await;
    let p = "/registry/outage/";
    for i in 0..5 {
        put(&client, &format!("{p}k{i}"), "v").await;
    }
    let options = CacheServerOptions::default().with_read_timeout(Duration::from_secs(2));
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
    assert!(started.elapsed() < Duration::from_secs(1), "proved at once");
    assert_eq!(
        via.kv_client()
            .get(p, serializable())
            .await
            .expect("read")
            .count(),
        5
    );
    let (_w, mut watch) = via
        .watch_client()
        .watch(p, Some(WatchOptions::new().with_prefix()))
        .await
        .expect("watch")
        .split();
    let created = watch.message().await.expect("stream").expect("created");
    assert!(created.created());
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_upstream_fails_linearizable_reads_in_time_and_nothing_else() {
    let etcd = private_etcd().await;
    let client = etcd.client().await;
    let p = "/registry/hung/";
    put(&client, &format!("{p}k"), "v").await;
    let options = CacheServerOptions::default().with_read_timeout(Duration::from_secs(2));
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
    let (_w, mut watch) = via
        .watch_client()
        .watch(p, Some(WatchOptions::new().with_prefix()))
        .await
        .expect("watch")
        .split();
    assert!(watch
        .message()
        .await
        .expect("stream")
        .expect("created")
        .created());
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

/// A CA that issues certificates for 127.0.0.1 (as tests/tls.rs's).
struct Authority {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
}

impl Authority {
    fn new() -> Self {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "serve-test-ca");
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.self_signed(&key).expect("self-signed");
        Authority { cert, key }
    }

    fn issue(&self, usage: rcgen::ExtendedKeyUsagePurpose) -> (String, String) {
        let mut params =
            rcgen::CertificateParams::new(vec!["localhost".to_string()]).expect("params");
        params
            .subject_alt_names
            .push(rcgen::SanType::IpAddress("127.0.0.1".parse().expect("ip")));
        params.extended_key_usages = vec![usage];
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .expect("signed");
        (cert.pem(), key.serialize_pem())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_on_the_listening_side() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = shared_client().await;
    let p = unique_prefix("serve_tls");
    put(&client, &format!("{p}k"), "secret-free").await;
    let ca = Authority::new();
    let (server_cert, server_key) = ca.issue(rcgen::ExtendedKeyUsagePurpose::ServerAuth);
    let (client_cert, client_key) = ca.issue(rcgen::ExtendedKeyUsagePurpose::ClientAuth);
    let dir = tempfile::tempdir().expect("tempdir");
    let write = |name: &str, pem: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, pem).expect("write pem");
        path.to_string_lossy().into_owned()
    };
    let ca_file = write("ca.pem", &ca.cert.pem());
    let cert_file = write("client.pem", &client_cert);
    let key_file = write("client-key.pem", &client_key);
    let tls = etcd_informer::serve::ServerTls {
        cert_pem: server_cert.into_bytes(),
        key_pem: server_key.into_bytes(),
        client_ca_pem: Some(ca.cert.pem().into_bytes()),
    };
    let options = CacheServerOptions::default().with_tls(Some(tls));
    let server = start_server_with(&client, etcd.endpoints.clone(), &p, options).await;
    let s = format!("https://{}", server.local_addr());
    let get = ["get", "--prefix", p.as_str()];
    let direct = ctl(&etcd.endpoints[0], &get).await;
    let cacert = format!("--cacert={ca_file}");
    let (cert, key) = (format!("--cert={cert_file}"), format!("--key={key_file}"));
    let mut with_certs = vec![cacert.as_str(), cert.as_str(), key.as_str()];
    with_certs.extend(get);
    let served = ctl(&s, &with_certs).await;
    assert_eq!(
        direct, served,
        "etcd (left) and the TLS cache server (right) differ"
    );
    // Without a client certificate the server refuses.
    let mut without = vec![cacert.as_str(), "--command-timeout=2s"];
    without.extend(get);
    let refused = ctl(&s, &without).await;
    assert_ne!(refused.code, Some(0), "{refused:?}");
    assert!(refused.stdout.is_empty(), "{refused:?}");
    // The member list names the server with its https URL.
    let members = ctl(
        &s,
        &[
            cacert.as_str(),
            cert.as_str(),
            key.as_str(),
            "member",
            "list",
        ],
    )
    .await;
    assert!(members.stdout.contains(&s), "{members:?}");
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
