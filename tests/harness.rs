#![cfg(feature = "testing")]
//! Tests of the throwaway-etcd harness itself, against real etcd processes.

use std::ffi::OsStr;
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions};
use etcd_informer::testing::etcd::{
    test_etcd, test_etcd_with_env, unique_prefix, EtcdCluster, EtcdServer, ServerOptions,
};

/// Retries `$op` (an expression awaiting a `Result`) until it succeeds or `$timeout` passes,
/// e.g. while a cluster elects a leader.
macro_rules! eventually {
    ($timeout:expr, $op:expr) => {{
        let timeout: Duration = $timeout;
        let deadline = Instant::now() + timeout;
        loop {
            match $op {
                Ok(v) => break v,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("retrying: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("still failing after {timeout:?}: {e}"),
            }
        }
    }};
}

/// A client whose requests time out, so that a request routed to a paused or stopped member
/// fails (and can be retried) instead of hanging.
async fn client_with_timeout(endpoints: Vec<String>) -> Client {
    let options = ConnectOptions::new().with_timeout(Duration::from_secs(2));
    Client::connect(endpoints, Some(options)).await.unwrap()
}

async fn get_value(client: &mut Client, key: &str) -> Option<Vec<u8>> {
    let resp = client.get(key, None).await.expect("get");
    resp.kvs().first().map(|kv| kv.value().to_vec())
}

fn pid_alive(pid: u32) -> bool {
    // A zombie has exited; only count live processes.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

#[tokio::test]
async fn start_put_get_and_drop_cleans_up() {
    let server = EtcdServer::start().await.unwrap();
    let endpoint = server.endpoint();
    assert!(endpoint.starts_with("http://127.0.0.1:"), "{endpoint}");
    assert_eq!(server.endpoints(), vec![endpoint.clone()]);
    assert!(server.data_dir().join("member").is_dir());

    let mut client = server.client().await;
    client.put("/a", "1", None).await.unwrap();
    assert_eq!(
        get_value(&mut client, "/a").await.as_deref(),
        Some(&b"1"[..])
    );

    let pid = server.pid().unwrap();
    let dir = server.data_dir().parent().unwrap().to_path_buf();
    drop(server);
    assert!(!pid_alive(pid), "etcd {pid} survived drop");
    assert!(!dir.exists(), "{} survived drop", dir.display());
}

#[tokio::test]
async fn restart_and_kill_keep_data_and_revision() {
    let server = EtcdServer::start().await.unwrap();
    let endpoint = server.endpoint();
    let mut client = server.client().await;
    client.put("/k", "v1", None).await.unwrap();
    let rev = client
        .put("/k", "v2", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    assert!(rev >= 3, "revision {rev}");

    server.stop().await.unwrap();
    assert!(!server.is_running());
    assert!(server.pid().is_none());
    server.restart().await.unwrap(); // also works from stopped
    assert_eq!(server.endpoint(), endpoint);

    let mut client = server.client().await;
    let resp = client.get("/k", None).await.unwrap();
    assert_eq!(resp.kvs()[0].value(), b"v2");
    assert_eq!(resp.header().unwrap().revision(), rev);

    server.kill();
    assert!(!server.is_running());
    server.start_again().await.unwrap();
    let put = client.put("/k", "v3", None).await.unwrap();
    assert_eq!(put.header().unwrap().revision(), rev + 1);
    assert!(
        server.start_again().await.is_err(),
        "start_again while running must fail"
    );
}

#[tokio::test]
async fn wipe_resets_data_and_revision() {
    let server = EtcdServer::start().await.unwrap();
    let endpoint = server.endpoint();
    let mut client = server.client().await;
    for i in 0..5 {
        client.put("/w", i.to_string(), None).await.unwrap();
    }
    server.wipe().await.unwrap();
    assert_eq!(server.endpoint(), endpoint);

    let mut client = server.client().await;
    let resp = client.get("/w", None).await.unwrap();
    assert!(resp.kvs().is_empty());
    assert_eq!(resp.header().unwrap().revision(), 1);
    let put = client.put("/w", "fresh", None).await.unwrap();
    assert_eq!(put.header().unwrap().revision(), 2);
}

#[tokio::test]
async fn pause_times_out_and_resume_recovers() {
    let server = EtcdServer::start().await.unwrap();
    let options = ConnectOptions::new().with_timeout(Duration::from_millis(500));
    let mut client = Client::connect(server.endpoints(), Some(options))
        .await
        .unwrap();
    client.put("/p", "before", None).await.unwrap();

    server.pause().unwrap();
    assert!(server.member().is_paused());
    let started = Instant::now();
    let paused = tokio::time::timeout(Duration::from_secs(5), client.get("/p", None)).await;
    assert!(
        !matches!(paused, Ok(Ok(_))),
        "request to a paused etcd succeeded"
    );
    assert!(started.elapsed() >= Duration::from_millis(400));

    server.resume().unwrap();
    assert!(!server.member().is_paused());
    let value = eventually!(Duration::from_secs(5), client.get("/p", None).await);
    assert_eq!(value.kvs()[0].value(), b"before");

    // A paused server can still be stopped gracefully.
    server.pause().unwrap();
    let started = Instant::now();
    server.stop().await.unwrap();
    assert!(!server.is_running());
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "stop fell back to SIGKILL"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_member_cluster_survives_a_stopped_member() {
    let cluster = EtcdCluster::start(3).await.unwrap();
    assert_eq!(cluster.len(), 3);
    assert_eq!(cluster.endpoints().len(), 3);
    assert_ne!(cluster.member_endpoint(0), cluster.member_endpoint(1));

    let member_client = |i: usize| client_with_timeout(vec![cluster.member_endpoint(i)]);
    let mut c0 = member_client(0).await;
    let mut c2 = member_client(2).await;
    c0.put("/c", "from-0", None).await.unwrap();
    assert_eq!(
        get_value(&mut c2, "/c").await.as_deref(),
        Some(&b"from-0"[..])
    );

    // Stop the leader: the remaining two elect a new one and keep serving.
    let leader = cluster.leader_index().await.expect("a leader");
    cluster.stop_member(leader).await.unwrap();
    assert!(!cluster.member(leader).is_running());
    let (a, b) = ((leader + 1) % 3, (leader + 2) % 3);
    let mut ca = member_client(a).await;
    let mut cb = member_client(b).await;
    eventually!(
        Duration::from_secs(15),
        ca.put("/c", "while-down", None).await
    );
    assert_eq!(
        get_value(&mut cb, "/c").await.as_deref(),
        Some(&b"while-down"[..])
    );
    let new_leader = eventually!(
        Duration::from_secs(15),
        cluster.leader_index().await.ok_or("no leader")
    );
    assert_ne!(new_leader, leader);

    // The restarted member catches up.
    cluster.restart_member(leader).await.unwrap();
    let mut cl = member_client(leader).await;
    assert_eq!(
        get_value(&mut cl, "/c").await.as_deref(),
        Some(&b"while-down"[..])
    );

    // A paused member does not answer; the cluster client still works via the others.
    cluster.pause_member(a).unwrap();
    let mut all = client_with_timeout(cluster.endpoints()).await;
    eventually!(
        Duration::from_secs(15),
        all.put("/c", "paused-one", None).await
    );
    cluster.resume_member(a).unwrap();
    eventually!(Duration::from_secs(15), ca.get("/c", None).await);
}

#[tokio::test]
async fn shared_test_etcd_is_reused() {
    let first = test_etcd().await.unwrap();
    let second = test_etcd().await.unwrap();
    assert!(!first.endpoints.is_empty());
    assert_eq!(first, second);

    let prefix = unique_prefix("shared_test_etcd_is_reused");
    let mut client = first.client().await;
    client.put(format!("{prefix}x"), "1", None).await.unwrap();
    let mut other = second.client().await;
    assert_eq!(
        get_value(&mut other, &format!("{prefix}x"))
            .await
            .as_deref(),
        Some(&b"1"[..])
    );
}

#[tokio::test]
async fn shared_test_etcd_outlives_the_first_runtime() {
    // Each #[tokio::test] has its own runtime; the shared server must survive them.
    let endpoints = std::thread::spawn(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(test_etcd())
            .unwrap()
    })
    .join()
    .unwrap();
    let mut client = endpoints.client().await;
    let key = format!("{}k", unique_prefix("outlives"));
    client.put(key.as_str(), "v", None).await.unwrap();
    assert_eq!(test_etcd().await.unwrap(), endpoints);
}

#[test]
fn unique_prefixes_differ() {
    let a = unique_prefix("t");
    let b = unique_prefix("t");
    assert_ne!(a, b);
    assert!(a.starts_with("/etcd-informer-test/t-"), "{a}");
    assert!(a.ends_with('/'));
    assert_eq!(unique_prefix("a/b").matches('/').count(), 3);
}

#[tokio::test]
async fn missing_etcd_explains_how_to_get_it() {
    let err = test_etcd_with_env(None, Some(OsStr::new("/nonexistent")))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("apt-get install etcd-server"), "{err}");
    assert!(err.contains("ETCD_BIN"), "{err}");
    assert!(err.contains("ETCD_ENDPOINTS"), "{err}");
    assert!(err.contains("/nonexistent"), "{err}");

    // ETCD_ENDPOINTS wins and is used as given.
    let given = test_etcd_with_env(
        Some("127.0.0.1:1, http://127.0.0.1:2"),
        Some(OsStr::new("/nonexistent")),
    )
    .await
    .unwrap();
    assert_eq!(given.endpoints, ["127.0.0.1:1", "http://127.0.0.1:2"]);
}

const ORPHAN_HELPER_ENV: &str = "ETCD_HARNESS_ORPHAN_HELPER";
const ORPHAN_ROOT_ENV: &str = "ETCD_HARNESS_ORPHAN_ROOT";

/// Run in a child process by `etcd_dies_with_the_test_process`.
#[test]
#[ignore = "helper run in a subprocess by etcd_dies_with_the_test_process"]
fn orphan_helper() {
    if std::env::var_os(ORPHAN_HELPER_ENV).is_none() {
        return;
    }
    // Start both servers from a short-lived thread and runtime, like a #[tokio::test] does.
    let (shared, leaked) = std::thread::spawn(|| {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let shared = test_etcd().await.unwrap();
            let root = std::env::var_os(ORPHAN_ROOT_ENV).map(Into::into);
            let leaked = EtcdServer::start_with(ServerOptions::default().with_data_root(root))
                .await
                .unwrap();
            let endpoint = leaked.endpoint();
            std::mem::forget(leaked); // like a static that is never dropped
            (shared.endpoints[0].clone(), endpoint)
        })
    })
    .join()
    .unwrap();
    // Both outlive the thread that started them.
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        for endpoint in [&shared, &leaked] {
            let mut client = Client::connect([endpoint], None).await.unwrap();
            client.status().await.unwrap();
        }
    });
    println!("ORPHAN_ENDPOINTS {shared} {leaked}");
}

/// Live etcd processes whose command line mentions `needle`.
fn etcd_processes_with(needle: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline);
        let exe = cmdline.split('\0').next().unwrap_or_default();
        if Path::new(exe).file_name() == Some(OsStr::new("etcd"))
            && cmdline.contains(needle)
            && pid_alive(pid)
        {
            found.push(pid);
        }
    }
    found
}

#[test]
fn etcd_dies_with_the_test_process() {
    // The leaked server's directory goes here, so that it is cleaned up too.
    let root = tempfile::tempdir().unwrap();
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["orphan_helper", "--exact", "--ignored", "--nocapture"])
        .env(ORPHAN_HELPER_ENV, "1")
        .env(ORPHAN_ROOT_ENV, root.path())
        .env_remove("ETCD_ENDPOINTS")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "helper failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("ORPHAN_ENDPOINTS "))
        .unwrap_or_else(|| panic!("no endpoints in helper output: {stdout}"));
    let endpoints: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(endpoints.len(), 2, "{line}");

    let deadline = Instant::now() + Duration::from_secs(10);
    for endpoint in endpoints {
        let addr = endpoint.trim_start_matches("http://");
        loop {
            let procs = etcd_processes_with(addr);
            let listening = TcpStream::connect(addr).is_ok();
            if procs.is_empty() && !listening {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "etcd for {endpoint} outlived its test process: pids {procs:?}, listening {listening}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
