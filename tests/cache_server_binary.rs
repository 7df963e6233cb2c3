//! The `etcd-cache-server` binary as an operator runs it, against real etcd: its command line
//! (help, version, errors, flags, environment and config file), readiness while etcd is
//! missing, its own metrics and health, a drain on SIGTERM, and servers in tiers.
#![cfg(feature = "cli")]

use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use etcd_client::{Client, WatchOptions};
use etcd_informer::testing::etcd::EtcdServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BIN: &str = env!("CARGO_BIN_EXE_etcd-cache-server");

/// A loopback address nothing listens on (yet).
fn free_addr() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a free port");
    listener.local_addr().expect("its address")
}

/// Runs the binary to its end with `args` and only `env` of the binary's own variables.
fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(BIN);
    command.args(args).env_clear().envs(env.iter().copied());
    if let Ok(path) = std::env::var("PATH") {
        command.env("PATH", path);
    }
    command.output().expect("the binary runs")
}

/// The binary serving, killed when dropped.
struct Server(Child);

impl Server {
    fn start(args: &[String]) -> Server {
        Self::start_with(args, &[])
    }

    fn start_with(args: &[String], env: &[(&str, &str)]) -> Server {
        let child = Command::new(BIN)
            .args(args)
            .envs(env.iter().copied())
            // The servers' own logs on failures only: tests start and stop etcd under them.
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the binary starts");
        Server(child)
    }

    fn terminate(&self) {
        // SAFETY: a plain signal to our own child's pid.
        unsafe { libc::kill(self.0.id() as libc::pid_t, libc::SIGTERM) };
    }

    /// Waits for the process to exit, up to `within`.
    async fn exited(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.0.try_wait() {
                return Some(status);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A plain HTTP/1.0 GET: the status and body; `None` if nothing answers.
async fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut stream =
        tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr))
            .await
            .ok()?
            .ok()?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer))
        .await
        .ok()?
        .ok()?;
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer.split_whitespace().nth(1)?.parse().ok()?;
    let body = answer
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_owned());
    Some((status, body))
}

/// Whether the process listening on `listen` has read everything `peer` sent it (Linux's
/// `/proc/net/tcp`): the server's kernel acknowledged every byte (nothing waits in the
/// client's send queue) and nothing waits unread on the server's side of the connection,
/// where the bytes of a connection the server has not accepted yet stay. True if the table
/// cannot be read.
fn server_read_all(listen: SocketAddr, peer: SocketAddr) -> bool {
    let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else {
        return true;
    };
    let hex = |a: SocketAddr| match a {
        SocketAddr::V4(a) => format!(
            "{:08X}:{:04X}",
            u32::from_ne_bytes(a.ip().octets()),
            a.port()
        ),
        SocketAddr::V6(_) => String::new(),
    };
    let (server, client) = (hex(listen), hex(peer));
    // An established connection from `from` to `to` whose queue (`tx_queue:rx_queue`, field
    // `queue`) is empty.
    let empty = |from: &str, to: &str, queue: usize| {
        table.lines().skip(1).any(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields.len() > 4
                && (fields[1], fields[2], fields[3]) == (from, to, "01")
                && fields[4]
                    .split(':')
                    .nth(queue)
                    .is_some_and(|bytes| u64::from_str_radix(bytes, 16) == Ok(0))
        })
    };
    empty(&client, &server, 0) && empty(&server, &client, 1)
}

/// Waits until `path` on `addr` answers `status`, up to `within`.
async fn until_status(addr: SocketAddr, path: &str, status: u16, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let got = http_get(addr, path).await;
        if got.as_ref().is_some_and(|(s, _)| *s == status) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{path} on {addr} did not answer {status} within {within:?}: {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits for the server to confirm the watch: a change after this is delivered.
async fn created(events: &mut etcd_client::WatchStream) {
    let resp = tokio::time::timeout(Duration::from_secs(30), events.message())
        .await
        .expect("the watch is confirmed")
        .expect("the watch goes on")
        .expect("the watch is open");
    assert!(
        resp.created(),
        "the first response confirms the watch: {resp:?}"
    );
}

/// The key of the next event on `events`.
async fn next_key(events: &mut etcd_client::WatchStream) -> Vec<u8> {
    loop {
        let resp = tokio::time::timeout(Duration::from_secs(30), events.message())
            .await
            .expect("the watch delivers")
            .expect("the watch goes on")
            .expect("the watch is open");
        if let Some(kv) = resp.events().iter().find_map(|e| e.kv()) {
            return kv.key().to_vec();
        }
    }
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

/// The server's answer to a gRPC health check: 1 SERVING, 2 NOT_SERVING.
async fn grpc_health(addr: SocketAddr) -> i32 {
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
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

async fn client_of(addr: SocketAddr) -> Client {
    Client::connect([addr.to_string()], None)
        .await
        .expect("a client of the server")
}

fn args(etcd: &str, listen: SocketAddr, metrics: SocketAddr, prefix: &str) -> Vec<String> {
    [
        "--endpoints",
        etcd,
        "--listen-addr",
        &listen.to_string(),
        "--metrics-addr",
        &metrics.to_string(),
        "--prefix",
        prefix,
        "--drain-timeout",
        "3s",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

#[test]
fn help_and_version_print_and_exit_without_listening() {
    let listen = free_addr();
    let help = run(&["--help", "--listen-addr", &listen.to_string()], &[]);
    assert!(help.status.success(), "{help:?}");
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(text.contains("Usage: etcd-cache-server"), "{text}");
    assert!(text.contains("ETCD_CACHE_SERVER_ENDPOINTS"), "{text}");
    let version = run(&["--version"], &[]);
    assert!(version.status.success(), "{version:?}");
    let text = String::from_utf8_lossy(&version.stdout);
    assert!(
        text.contains(env!("CARGO_PKG_VERSION")) && text.contains("commit "),
        "{text}"
    );
    assert!(
        std::net::TcpStream::connect(listen).is_err(),
        "nothing listens after --help"
    );
}

#[test]
fn a_bad_flag_value_or_file_is_an_error_that_names_it() {
    let unknown = run(&["--listen-adress", "127.0.0.1:1"], &[]);
    assert_eq!(unknown.status.code(), Some(2), "{unknown:?}");
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("--listen-adress"));
    let bad = run(&["--prefix", "/a/", "--read-timeout", "soon"], &[]);
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--read-timeout"));
    let missing = run(
        &["--config-file", "/nonexistent/etcd-cache-server.yaml"],
        &[],
    );
    assert_eq!(missing.status.code(), Some(2), "{missing:?}");
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("/nonexistent/etcd-cache-server.yaml")
    );
    let none = run(&[], &[]);
    assert_eq!(none.status.code(), Some(2), "no prefix: {none:?}");
}

/// Every setting, by flag, by environment variable and by config file, read back from the
/// effective configuration (`--print-config`); and the precedence between them.
#[test]
fn every_setting_comes_from_a_flag_the_environment_or_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let pem = dir.path().join("x.pem");
    std::fs::write(&pem, "not read by --print-config").unwrap();
    let pem = pem.to_str().unwrap();
    let settings: Vec<(&str, &str)> = vec![
        ("endpoints", "10.0.0.1:2379,10.0.0.2:2379"),
        ("prefix", "/registry/pods/,/registry/nodes/"),
        ("listen-addr", "127.0.0.1:33790"),
        ("metrics-addr", "127.0.0.1:33791"),
        ("cert-file", pem),
        ("key-file", pem),
        ("trusted-ca-file", pem),
        ("cacert", pem),
        ("cert", pem),
        ("key", pem),
        ("user", "reader:secret"),
        ("history-revisions", "123"),
        ("history-bytes", "4567"),
        ("read-timeout", "7s"),
        ("progress-interval", "11s"),
        ("max-request-bytes", "8910"),
        ("access-ttl", "1500ms"),
        ("identity-refresh", "2s"),
        ("audit-period", "13s"),
        ("drain-timeout", "17s"),
        ("trust-clients-as-server", "true"),
        ("max-forwarded-watches", "4321"),
        ("max-forwarded-watches-per-connection", "87"),
    ];
    let by_flags: Vec<String> = settings
        .iter()
        .flat_map(|(k, v)| [format!("--{k}"), v.to_string()])
        .chain(["--print-config".to_owned()])
        .collect();
    let by_flags = run(
        &by_flags.iter().map(String::as_str).collect::<Vec<_>>(),
        &[],
    );
    assert!(by_flags.status.success(), "{by_flags:?}");
    let expected = String::from_utf8_lossy(&by_flags.stdout).into_owned();
    for (key, value) in &settings {
        let shown = match *key {
            "user" => "reader:***".to_owned(),
            "endpoints" | "prefix" => value.split(',').next().unwrap().to_owned(),
            _ => value.to_string(),
        };
        assert!(
            expected.contains(&shown),
            "{key}: {shown} not in the effective settings:\n{expected}"
        );
    }
    assert!(!expected.contains("secret"), "the password is never shown");

    let vars: Vec<(String, String)> = settings
        .iter()
        .map(|(k, v)| {
            let var = format!("ETCD_CACHE_SERVER_{}", k.to_uppercase().replace('-', "_"));
            (var, v.to_string())
        })
        .collect();
    let env: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let by_env = run(&["--print-config"], &env);
    assert!(by_env.status.success(), "{by_env:?}");
    assert_eq!(
        String::from_utf8_lossy(&by_env.stdout),
        expected,
        "by environment"
    );

    let file = dir.path().join("settings.yaml");
    let yaml: String = settings
        .iter()
        .map(|(k, v)| match *k {
            "endpoints" | "prefix" => format!(
                "{k}:\n{}",
                v.split(',')
                    .map(|i| format!("  - {i}\n"))
                    .collect::<String>()
            ),
            "user" => format!("{k}: \"{v}\"\n"),
            _ => format!("{k}: {v}\n"),
        })
        .collect();
    std::fs::write(&file, yaml).unwrap();
    let file = file.to_str().unwrap();
    let by_file = run(&["--config-file", file, "--print-config"], &[]);
    assert!(by_file.status.success(), "{by_file:?}");
    assert_eq!(
        String::from_utf8_lossy(&by_file.stdout),
        expected,
        "by file"
    );

    // A flag wins over its variable, which wins over the file.
    let both = run(
        &[
            "--config-file",
            file,
            "--print-config",
            "--history-revisions",
            "1",
        ],
        &[
            ("ETCD_CACHE_SERVER_HISTORY_REVISIONS", "2"),
            ("ETCD_CACHE_SERVER_ACCESS_TTL", "3s"),
        ],
    );
    let both = String::from_utf8_lossy(&both.stdout).into_owned();
    assert!(both.contains("history-revisions: 1\n"), "{both}");
    assert!(both.contains("access-ttl: 3s\n"), "{both}");
    assert!(both.contains("read-timeout: 7s\n"), "{both}");
}

/// No etcd at the endpoints: not ready (both health answers 503) and a read through it fails,
/// never an empty success; once etcd starts, ready and reading etcd's keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_etcd_the_server_is_not_ready_and_answers_no_read() {
    let etcd = EtcdServer::start().await.unwrap_or_else(|e| panic!("{e}"));
    let direct = etcd.client().await;
    direct.kv_client().put("/app/a", "1", None).await.unwrap();
    etcd.stop().await.unwrap();
    let (listen, metrics) = (free_addr(), free_addr());
    let server = Server::start(&args(&etcd.endpoint(), listen, metrics, "/app/"));
    until_status(metrics, "/health", 503, Duration::from_secs(30)).await;
    let reader = client_of(listen).await;
    let watched = Instant::now();
    while watched.elapsed() < Duration::from_secs(5) {
        let (status, body) = http_get(metrics, "/health").await.expect("/health answers");
        assert_eq!(status, 503, "{body}");
        assert!(body.contains(r#""health":"false""#), "{body}");
        let own = http_get(listen, "/proxy/health")
            .await
            .expect("/proxy/health answers");
        assert_eq!(own.0, 503, "{own:?}");
        let read = tokio::time::timeout(
            Duration::from_secs(10),
            reader
                .kv_client()
                .get("/app/", Some(etcd_client::GetOptions::new().with_prefix())),
        )
        .await;
        if let Ok(Ok(resp)) = read {
            panic!("a read without etcd answered: {:?}", resp.kvs());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    etcd.start_again().await.unwrap();
    until_status(metrics, "/health", 200, Duration::from_secs(60)).await;
    until_status(listen, "/proxy/health", 200, Duration::from_secs(5)).await;
    assert_eq!(grpc_health(listen).await, 1, "SERVING");
    let resp = reader
        .kv_client()
        .get("/app/", Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .expect("a read once ready");
    assert_eq!(resp.kvs().len(), 1);
    drop(server);
}

/// With etcd: reads and watches through the binary, its own metrics and health, settings from
/// a file and the environment that it then uses, and a drain on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_serves_reports_and_drains_on_sigterm() {
    let etcd = EtcdServer::start().await.unwrap_or_else(|e| panic!("{e}"));
    let direct = etcd.client().await;
    direct.kv_client().put("/app/a", "1", None).await.unwrap();
    let (listen, metrics) = (free_addr(), free_addr());
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("server.yaml");
    // The file sets where the metrics are served; the environment, the request size.
    std::fs::write(
        &file,
        format!("metrics-addr: \"{metrics}\"\nprefix: [/app/]\n"),
    )
    .unwrap();
    let mut command = Command::new(BIN);
    command
        .args([
            "--config-file",
            file.to_str().unwrap(),
            "--endpoints",
            &etcd.endpoint(),
            "--listen-addr",
            &listen.to_string(),
            // Long enough to watch the health answers during the drain on a loaded machine.
            "--drain-timeout",
            "12s",
        ])
        .env("ETCD_CACHE_SERVER_MAX_REQUEST_BYTES", "4096")
        .env("RUST_LOG", "error")
        .stdout(Stdio::null());
    let mut server = Server(command.spawn().expect("the binary starts"));
    until_status(metrics, "/health", 200, Duration::from_secs(60)).await;
    assert_eq!(http_get(metrics, "/readyz").await.map(|a| a.0), Some(200));
    assert_eq!(http_get(metrics, "/livez").await.map(|a| a.0), Some(200));

    let client = client_of(listen).await;
    let got = client.kv_client().get("/app/a", None).await.unwrap();
    assert_eq!(got.kvs()[0].value(), b"1");
    let refused = client
        .kv_client()
        .put("/app/big", vec![b'x'; 8192], None)
        .await;
    assert!(
        refused.is_err(),
        "a request over the environment's max-request-bytes"
    );
    let mut events = client
        .watch_client()
        .watch("/app/", Some(WatchOptions::new().with_prefix()))
        .await
        .unwrap();
    created(&mut events).await;
    direct.kv_client().put("/app/b", "2", None).await.unwrap();
    assert_eq!(next_key(&mut events).await, b"/app/b");

    let (_, text) = http_get(metrics, "/metrics")
        .await
        .expect("/metrics answers");
    assert!(text.contains("etcd_informer_server_"), "{text}");
    assert!(text.contains("process_resident_memory_bytes"), "{text}");

    // SIGTERM: not ready while it drains, then exit 0. A client in the middle of sending a
    // request keeps its connection, so the drain lasts until the drain timeout (12 s) and the
    // health answers can be watched meanwhile.
    let mut slow = tokio::net::TcpStream::connect(listen).await.unwrap();
    slow.write_all(b"GET /proxy/health HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    // Only a connection the server has accepted and read from holds the drain: one still in
    // the listener's queue at SIGTERM is never served, and the server exits at once.
    let peer = slow.local_addr().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !server_read_all(listen, peer) {
        assert!(
            Instant::now() < deadline,
            "the server did not read the slow request within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let terminated = Instant::now();
    server.terminate();
    // Each waited for, not read once: on a loaded machine one answer can take seconds.
    until_status(metrics, "/health", 503, Duration::from_secs(6)).await;
    until_status(metrics, "/livez", 503, Duration::from_secs(6)).await;
    let status = server
        .exited(Duration::from_secs(20))
        .await
        .expect("the server exits after its drain timeout");
    assert!(status.success(), "exit status {status:?}");
    assert!(
        terminated.elapsed() < Duration::from_secs(12 + 10),
        "exited within the drain timeout: {:?}",
        terminated.elapsed()
    );
    drop(slow);
}

/// Servers in tiers: B's upstream is A. A read, a watch, a write and a past revision through
/// B, and A killed and started again under B's watch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_in_tiers_read_watch_and_ride_the_first_tiers_restart() {
    let etcd = EtcdServer::start().await.unwrap_or_else(|e| panic!("{e}"));
    let direct = etcd.client().await;
    let first = direct.kv_client().put("/t/a", "1", None).await.unwrap();
    let first = first.header().unwrap().revision();
    direct.kv_client().put("/t/a", "2", None).await.unwrap();
    let (a, a_metrics, b, b_metrics) = (free_addr(), free_addr(), free_addr(), free_addr());
    let a_args = args(&etcd.endpoint(), a, a_metrics, "/t/");
    let mut server_a = Server::start(&a_args);
    until_status(a_metrics, "/health", 200, Duration::from_secs(60)).await;
    let _server_b = Server::start(&args(&a.to_string(), b, b_metrics, "/t/"));
    until_status(b_metrics, "/health", 200, Duration::from_secs(60)).await;

    let client = client_of(b).await;
    let got = client.kv_client().get("/t/a", None).await.unwrap();
    assert_eq!(got.kvs()[0].value(), b"2");
    let past = client
        .kv_client()
        .get(
            "/t/a",
            Some(etcd_client::GetOptions::new().with_revision(first)),
        )
        .await
        .unwrap();
    assert_eq!(past.kvs()[0].value(), b"1", "a past revision through B");
    let mut events = client
        .watch_client()
        .watch("/t/", Some(WatchOptions::new().with_prefix()))
        .await
        .unwrap();
    created(&mut events).await;
    client
        .kv_client()
        .put("/t/b", "written through B", None)
        .await
        .unwrap();
    assert_eq!(next_key(&mut events).await, b"/t/b");

    // A dies and comes back on the same address: B's watch goes on.
    let _ = server_a.0.kill();
    let _ = server_a.0.wait();
    server_a = Server::start(&a_args);
    until_status(a_metrics, "/health", 200, Duration::from_secs(60)).await;
    direct.kv_client().put("/t/c", "3", None).await.unwrap();
    assert_eq!(
        next_key(&mut events).await,
        b"/t/c",
        "B's watch after A's restart"
    );
    drop(server_a);
}

/// The server's resident memory in bytes (Linux).
fn resident(server: &Server) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", server.0.id()))
        .expect("the server's /proc status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS");
    kib * 1024
}

/// Issue 54, items 1-3: one client cannot make the server hold more than its bounds, with
/// the server in a process of its own so that its resident memory is its own. (1) Token-less
/// ranges of 300 distinct 1 MiB keys, whose access answers the server used to keep until
/// 10,000 of them. (2) Watches outside the prefix beyond the cap of forwarded watches per
/// connection: refused with etcd's "too many requests", counted in the metrics. (3) Watch
/// requests sent behind creates that wait for etcd (paused: each access check waits out its
/// 1 s timeout): 8 streams, each sending up to 128 creates of 1 MiB keys (1 GiB in all, of
/// which the server used to read up to 1,024 requests a stream ahead). Meanwhile another
/// client is served, and the server's resident memory stays within 256 MiB of where it
/// started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_cannot_make_the_server_hold_more_than_its_bounds() {
    let etcd = EtcdServer::start()
        .await
        .unwrap_or_else(|e| panic!("cannot start etcd (set ETCD_BIN or put etcd on PATH): {e}"));
    let direct = etcd.client().await;
    let p = "/bounds/";
    direct
        .kv_client()
        .put(format!("{p}a"), "1", None)
        .await
        .expect("put");
    let (listen, metrics) = (free_addr(), free_addr());
    let mut flags = args(&etcd.endpoint(), listen, metrics, p);
    for flag in [
        "--access-ttl",
        "60s",
        "--max-forwarded-watches-per-connection",
        "50",
    ] {
        flags.push(flag.to_owned());
    }
    // glibc keeps freed blocks of a megabyte or more once it has raised its mmap threshold
    // (up to 32 MiB): a fixed threshold hands them back, so that resident memory is what the
    // server holds, not what its allocator kept.
    let server = Server::start_with(&flags, &[("MALLOC_MMAP_THRESHOLD_", "131072")]);
    until_status(metrics, "/readyz", 200, Duration::from_secs(30)).await;
    let other = client_of(listen).await;
    // Its access answer is remembered for the test's length: it is served while etcd pauses.
    let read = || async {
        let mut kv = other.kv_client();
        let options = etcd_client::GetOptions::new().with_serializable();
        kv.get(format!("{p}a"), Some(options)).await
    };
    read().await.expect("a read before the attack");
    let before = resident(&server);
    let mut peak = before;
    let bound = 256 << 20;

    // (1) Access answers for ever new 1 MiB keys.
    let tokenless = client_of(listen).await;
    for i in 0..300 {
        let key = format!("{p}{i:08}{}", "k".repeat(1 << 20));
        let _ = tokenless.kv_client().get(key, None).await;
        if i % 50 == 0 {
            peak = peak.max(resident(&server));
        }
    }
    peak = peak.max(resident(&server));
    assert!(
        peak < before + bound,
        "access answers of 1 MiB keys: resident {} MiB, from {} MiB",
        peak >> 20,
        before >> 20
    );
    read().await.expect("another client is served");

    // (2) Forwarded watches beyond the cap of one connection.
    let watcher = client_of(listen).await;
    let (mut requests, mut responses) = watcher
        .watch_client()
        .watch("/outside/0", None)
        .await
        .expect("a watch outside the prefix")
        .split();
    for i in 1..60 {
        requests
            .watch(format!("/outside/{i}"), None)
            .await
            .expect("send");
    }
    let (mut created, mut refused) = (0, Vec::new());
    while created + refused.len() < 60 {
        let r = tokio::time::timeout(Duration::from_secs(20), responses.message())
            .await
            .expect("an answer")
            .expect("the stream")
            .expect("open");
        if r.canceled() {
            refused.push(r.cancel_reason().to_owned());
        } else if r.created() {
            created += 1;
        }
    }
    assert_eq!((created, refused.len()), (50, 10), "{refused:?}");
    assert!(refused[0].contains("too many requests"), "{refused:?}");
    // The metrics are sampled every second.
    let counted = |text: &str, name: &str, value: &str| {
        text.lines()
            .any(|l| l.starts_with(&format!("{name}{{")) && l.ends_with(&format!(" {value}")))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, text) = http_get(metrics, "/metrics").await.expect("metrics");
        let open = counted(&text, "etcd_informer_server_forwarded_watches", "50");
        let over = counted(
            &text,
            "etcd_informer_server_forwarded_watches_refused_total",
            "10",
        );
        if open && over {
            break;
        }
        assert!(Instant::now() < deadline, "{text}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    read().await.expect("another client is served");
    // (3) Requests behind creates that wait for etcd.
    etcd.pause().expect("pause etcd");
    let key = format!("{p}{}", "k".repeat(1 << 20));
    let mut streams = Vec::new();
    for _ in 0..8 {
        let client = client_of(listen).await;
        let key = key.clone();
        streams.push(tokio::spawn(async move {
            let (mut requests, responses) = client
                .watch_client()
                .watch(key.as_str(), None)
                .await
                .expect("a watch stream")
                .split();
            let sending = async {
                for _ in 0..128 {
                    if requests.watch(key.as_str(), None).await.is_err() {
                        return;
                    }
                }
            };
            // Sends stall once the server stops reading: 10 s of trying is enough.
            let _ = tokio::time::timeout(Duration::from_secs(10), sending).await;
            (requests, responses)
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(12);
    while Instant::now() < deadline {
        peak = peak.max(resident(&server));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let held: Vec<_> = futures_join(streams).await;
    peak = peak.max(resident(&server));
    assert!(
        peak < before + bound,
        "requests held behind slow creates: resident {} MiB, from {} MiB",
        peak >> 20,
        before >> 20
    );
    let served = tokio::time::timeout(Duration::from_secs(5), read()).await;
    assert!(
        matches!(served, Ok(Ok(_))),
        "another client is served meanwhile: {served:?}"
    );
    // etcd stays paused to the end: the requests still on their way would otherwise be
    // served, each a watch holding its 1 MiB key (as etcd's own watches hold theirs).
    drop(held);
}

/// Waits for every task.
async fn futures_join<T>(tasks: Vec<tokio::task::JoinHandle<T>>) -> Vec<T> {
    let mut done = Vec::new();
    for task in tasks {
        done.push(task.await.expect("a task"));
    }
    done
}
