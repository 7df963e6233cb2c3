//! The cache server against etcd itself and etcd's gRPC proxy, on a throwaway etcd.
//!
//! ```text
//! cargo bench --bench serve -- [--keys 100000] [--watch-keys 10000] [--watchers 1,100,1000]
//!     [--rate 100] [--seconds 5] [--lists 5] [--clients 10] [--scenarios list,watch,busy]
//!     [--busy-watchers 1000] [--failover-watchers 2000] [--ways direct,proxy,server,floor]
//! ```
//!
//! Quiet (not run by default): `--lists` linearizable lists of the `--keys` prefix while a
//! writer writes elsewhere at `--rate`: etcd's CPU per list straight to etcd and through cache
//! servers proving their cache by their watch's progress and by a read of the range.
//!
//! Lists: one client lists `--keys` keys of 256 B (median of `--lists`), then `--clients` new
//! clients list them at once; beside them, the client's own floor: decoding the same answer
//! from bytes already in memory (no server can take that away). Busy: `--busy-watchers`
//! watchers through the cache server while another client lists the `--keys` prefix
//! from the same server, one list after another: the watchers' latency beside the same
//! watchers on a quiet server. Failover (not run by default): `--failover-watchers` watchers
//! given two cache servers, one SIGKILLed halfway through the writes; each watcher watches
//! again from its next revision after an error, as a client of etcd would after losing its
//! member: every event delivered once, and the longest delivery (the failover's gap).
//! First (not run by default): the first answer of new forwarded streams (a lease
//! keep-alive, a watch outside the prefix) on a connection already open. Watches: N watch streams on a prefix of `--watch-keys` keys (over
//! at most 20 connections), a writer at `--rate` writes/s for `--seconds`; each event carries
//! its write time, so delivery latency is measured end to end. Each way is measured the same:
//! straight to etcd, through `etcd grpc-proxy` (the etcd binary of `ETCD_BIN` or `PATH`), and
//! through the cache server, which runs in a child process (this binary again, `--child`) so
//! that its CPU time and memory are its own (`--ways` picks among `direct`, `proxy` and
//! `server`, and `floor`, not run by default: a bare tonic Watch server that only forwards
//! etcd's events, the least any server on the same gRPC stack spends per delivery). Prints a
//! table and one JSON line per figure.

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use etcd_client::{Client, GetOptions, Txn, TxnOp, WatchOptions};
use etcd_informer::connect;
use etcd_informer::serve::{CacheServer, CacheServerOptions};
use etcd_informer::testing::etcd::EtcdServer;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::time::Instant;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

struct Args {
    keys: usize,
    watch_keys: usize,
    watchers: Vec<usize>,
    rate: u64,
    seconds: u64,
    lists: usize,
    clients: usize,
    scenarios: Vec<String>,
    busy_watchers: usize,
    failover_watchers: usize,
    /// The ways the watch scenario measures: `direct`, `proxy`, `server`, `floor`.
    ways: Vec<String>,
}

fn args() -> Args {
    let mut a = Args {
        keys: 100_000,
        watch_keys: 10_000,
        watchers: vec![1, 100, 1000],
        rate: 100,
        seconds: 5,
        lists: 5,
        clients: 10,
        scenarios: vec!["list".into(), "watch".into(), "busy".into()],
        busy_watchers: 1000,
        failover_watchers: 2000,
        ways: ["direct", "proxy", "server"].map(str::to_owned).to_vec(),
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        if flag == "--bench" {
            continue;
        }
        let value = it
            .next()
            .unwrap_or_else(|| panic!("{flag} needs a value"))
            .replace('_', "");
        let number = || -> u64 {
            value
                .parse()
                .unwrap_or_else(|_| panic!("{flag} needs a whole number"))
        };
        match flag.as_str() {
            "--keys" => a.keys = number() as usize,
            "--watch-keys" => a.watch_keys = number() as usize,
            "--rate" => a.rate = number(),
            "--seconds" => a.seconds = number(),
            "--lists" => a.lists = number() as usize,
            "--clients" => a.clients = number() as usize,
            "--busy-watchers" => a.busy_watchers = number() as usize,
            "--failover-watchers" => a.failover_watchers = number() as usize,
            "--scenarios" => a.scenarios = value.split(',').map(str::to_owned).collect(),
            "--ways" => a.ways = value.split(',').map(str::to_owned).collect(),
            "--watchers" => {
                a.watchers = value
                    .split(',')
                    .map(|n| n.parse().unwrap_or_else(|_| panic!("--watchers: {n}")))
                    .collect()
            }
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

/// CPU seconds (user + system) of a process so far.
fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// Resident memory of a process, in MiB.
fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

fn now_nanos() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[(((p / 100.0) * (sorted.len() - 1) as f64).round() as usize).min(sorted.len() - 1)]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    percentile(&v, 50.0)
}

/// A process serving etcd's API on `endpoint`: the proxy or the cache server.
struct Front {
    name: &'static str,
    endpoint: String,
    child: Option<Child>,
}

impl Front {
    fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_or(0, |a| a.port())
}

/// Starts `command` and waits for a stdout line containing `ready`.
async fn start_child(mut command: Command, ready: &str) -> Res<Child> {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let wait = async {
        while let Some(line) = lines.next_line().await? {
            if line.contains(ready) {
                return Ok::<_, std::io::Error>(true);
            }
        }
        Ok(false)
    };
    match tokio::time::timeout(Duration::from_secs(120), wait).await {
        Ok(Ok(true)) => {
            // Keep draining its output so that it never blocks on a full pipe.
            tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
            Ok(child)
        }
        _ => Err(format!("the child never printed {ready:?}").into()),
    }
}

async fn start_proxy(etcd: &str) -> Res<Front> {
    let bin = std::env::var_os("ETCD_BIN").unwrap_or_else(|| "etcd".into());
    let port = free_port();
    let mut command = Command::new(bin);
    command.args([
        "grpc-proxy",
        "start",
        &format!("--endpoints={}", etcd.trim_start_matches("http://")),
        &format!("--listen-addr=127.0.0.1:{port}"),
    ]);
    let mut child = command
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let endpoint = format!("127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(Ok(mut c)) =
            tokio::time::timeout(Duration::from_secs(2), connect([endpoint.as_str()])).await
        {
            if c.status().await.is_ok() {
                break;
            }
        }
        if Instant::now() > deadline {
            let _ = child.kill().await;
            return Err("etcd grpc-proxy did not answer".into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(Front {
        name: "grpc-proxy",
        endpoint,
        child: Some(child),
    })
}

async fn start_cache_server(etcd: &str, prefix: &str) -> Res<Front> {
    start_cache_server_trusting(etcd, prefix, None).await
}

/// A cache server whose source trusts etcd's progress revisions as `trust` says, or as the
/// version does with `None`.
async fn start_cache_server_trusting(etcd: &str, prefix: &str, trust: Option<bool>) -> Res<Front> {
    let port = free_port();
    let mut command = Command::new(std::env::current_exe()?);
    let trust = trust.map_or("auto".to_owned(), |t| t.to_string());
    command.args([
        "--child",
        etcd,
        prefix,
        &format!("127.0.0.1:{port}"),
        &trust,
    ]);
    let child = start_child(command, "ready").await?;
    Ok(Front {
        name: "cache server",
        endpoint: format!("127.0.0.1:{port}"),
        child: Some(child),
    })
}

/// The floor of the watch scenario, in a child process like the cache server: the least a
/// server on the same gRPC stack (tonic, h2) can do per delivery. One etcd watch of `prefix`;
/// each of its responses is handed through a broadcast channel to every client stream, which
/// re-addresses it to its watch and sends it, polled inside the response stream (no task, no
/// channel of its own). It serves nothing else and checks nothing: no cache, no history, no
/// requests read after the stream opens, a lagging stream skips what it missed.
async fn start_floor(etcd: &str, prefix: &str) -> Res<Front> {
    let port = free_port();
    let mut command = Command::new(std::env::current_exe()?);
    command.args(["--floor", etcd, prefix, &format!("127.0.0.1:{port}")]);
    let child = start_child(command, "ready").await?;
    Ok(Front {
        name: "floor (bare tonic)",
        endpoint: format!("127.0.0.1:{port}"),
        child: Some(child),
    })
}

mod floor {
    use std::pin::Pin;
    use std::sync::Arc;
    use std::task::{Context, Poll};

    use etcd_client::proto::{PbWatchRequest, PbWatchResponse, PbWatchServer, PbWatchService};
    use tokio_stream::wrappers::BroadcastStream;
    use tokio_stream::Stream;
    use tonic::codec::Streaming;
    use tonic::{Request, Response, Status};

    pub struct Floor {
        pub events: tokio::sync::broadcast::Sender<Arc<PbWatchResponse>>,
    }

    /// One client stream: its created answer, then every upstream response.
    pub struct Outgoing {
        /// Held so the stream stays open; never read.
        _requests: Streaming<PbWatchRequest>,
        created: Option<PbWatchResponse>,
        events: BroadcastStream<Arc<PbWatchResponse>>,
    }

    impl Stream for Outgoing {
        type Item = Result<PbWatchResponse, Status>;

        fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            if let Some(created) = self.created.take() {
                return Poll::Ready(Some(Ok(created)));
            }
            loop {
                match Pin::new(&mut self.events).poll_next(cx) {
                    Poll::Ready(Some(Ok(r))) => return Poll::Ready(Some(Ok((*r).clone()))),
                    Poll::Ready(Some(Err(_lagged))) => continue,
                    Poll::Ready(None) => return Poll::Ready(None),
                    Poll::Pending => return Poll::Pending,
                }
            }
        }
    }

    #[tonic::async_trait]
    impl PbWatchService for Floor {
        type WatchStream = Outgoing;

        async fn watch(
            &self,
            request: Request<Streaming<PbWatchRequest>>,
        ) -> Result<Response<Outgoing>, Status> {
            let events = BroadcastStream::new(self.events.subscribe());
            let created = PbWatchResponse {
                created: true,
                ..Default::default()
            };
            Ok(Response::new(Outgoing {
                _requests: request.into_inner(),
                created: Some(created),
                events,
            }))
        }
    }

    pub fn server(floor: Floor) -> PbWatchServer<Floor> {
        PbWatchServer::new(floor)
    }
}

/// The floor child (see [`start_floor`]).
async fn floor_child(etcd: String, prefix: String, listen: String) -> Res<()> {
    let client = connect([etcd.as_str()]).await?;
    let (events, _) = tokio::sync::broadcast::channel(4096);
    let (_watcher, mut stream) = client
        .watch_client()
        .watch(prefix.as_str(), Some(WatchOptions::new().with_prefix()))
        .await?
        .split();
    let upstream = events.clone();
    tokio::spawn(async move {
        while let Ok(Some(r)) = stream.message().await {
            if !r.events().is_empty() {
                let _ = upstream.send(Arc::new(r.0));
            }
        }
    });
    let incoming =
        tonic::transport::server::TcpIncoming::bind(listen.parse()?)?.with_nodelay(Some(true));
    println!("ready");
    tonic::transport::Server::builder()
        .add_service(floor::server(floor::Floor { events }))
        .serve_with_incoming(incoming)
        .await?;
    Ok(())
}

/// The child: a cache server of `prefixes` (comma-separated) on `listen`.
async fn child(etcd: String, prefixes: String, listen: String, trust: String) -> Res<()> {
    let client = connect([etcd.as_str()]).await?;
    let mut options = CacheServerOptions::default();
    if let Ok(trust) = trust.parse() {
        // As etcd 3.4.25+ and 3.5.8+ are trusted by their version.
        let etcd = options.etcd.clone().with_trust_progress(Some(trust));
        options = options.with_etcd(etcd);
    }
    let mut prefixes = prefixes.split(',');
    let first = prefixes.next().unwrap_or_default().to_owned();
    let mut server = CacheServer::new(client, [etcd], first).with_options(options);
    for prefix in prefixes {
        server = server.with_prefix(prefix);
    }
    let server = server.bind(listen.parse()?).await?;
    server.ready(Duration::from_secs(120)).await?;
    println!("ready");
    server.wait().await?;
    Ok(())
}

async fn load(client: &Client, prefix: &str, keys: usize, size: usize) -> Res<()> {
    let value = "v".repeat(size);
    let mut kv = client.kv_client();
    for chunk in (0..keys).collect::<Vec<_>>().chunks(128) {
        let ops = chunk
            .iter()
            .map(|i| TxnOp::put(format!("{prefix}k{i:07}"), value.clone(), None))
            .collect::<Vec<_>>();
        kv.txn(Txn::new().and_then(ops)).await?;
    }
    Ok(())
}

/// Seconds to list `prefix` once from `endpoint` on a new client.
async fn list_once(endpoint: &str, prefix: &str, keys: usize) -> Res<f64> {
    list_with(endpoint, prefix, keys, GetOptions::new().with_prefix()).await
}

async fn list_with(endpoint: &str, prefix: &str, keys: usize, options: GetOptions) -> Res<f64> {
    let client = connect([endpoint]).await?;
    let mut kv = client.kv_client().max_decoding_message_size(usize::MAX);
    let started = Instant::now();
    let resp = kv.get(prefix, Some(options)).await?;
    let took = started.elapsed().as_secs_f64();
    if resp.kvs().len() != keys {
        return Err(format!("listed {} keys of {keys}", resp.kvs().len()).into());
    }
    Ok(took)
}

struct ListFigures {
    one_ms: f64,
    serializable_ms: f64,
    concurrent_s: f64,
    etcd_cpu_s: f64,
}

/// Milliseconds the client takes to decode a `keys`-key answer like the list's from bytes
/// in memory (median of 5): the part of any list no server can take away.
fn decode_floor_ms(keys: usize) -> f64 {
    use etcd_client::proto::{PbKeyValue, PbRangeResponse};
    use tonic_prost::prost::Message;
    let answer = PbRangeResponse {
        kvs: (0..keys)
            .map(|i| PbKeyValue {
                key: format!("/bench/list/k{i:07}").into_bytes(),
                create_revision: 2 + i as i64,
                mod_revision: 2 + i as i64,
                version: 1,
                value: vec![b'v'; 256],
                lease: 0,
            })
            .collect(),
        count: keys as i64,
        ..Default::default()
    }
    .encode_to_vec();
    let times = (0..5)
        .map(|_| {
            let started = std::time::Instant::now();
            let decoded = PbRangeResponse::decode(answer.as_slice()).map(|r| r.kvs.len());
            let took = started.elapsed().as_secs_f64();
            assert_eq!(decoded.ok(), Some(keys));
            took
        })
        .collect();
    median(times) * 1000.0
}

async fn lists(endpoint: &str, prefix: &str, args: &Args, etcd_pid: u32) -> Res<ListFigures> {
    // One list first to warm whatever caches there are (the server's is built at start).
    list_once(endpoint, prefix, args.keys).await?;
    let mut times = Vec::new();
    let mut serializable = Vec::new();
    for _ in 0..args.lists {
        times.push(list_once(endpoint, prefix, args.keys).await?);
        let options = GetOptions::new().with_prefix().with_serializable();
        serializable.push(list_with(endpoint, prefix, args.keys, options).await?);
    }
    let cpu = cpu_seconds(etcd_pid);
    let started = Instant::now();
    let mut all = Vec::new();
    for _ in 0..args.clients {
        let (endpoint, prefix, keys) = (endpoint.to_string(), prefix.to_string(), args.keys);
        all.push(tokio::spawn(async move {
            list_once(&endpoint, &prefix, keys)
                .await
                .map_err(|e| e.to_string())
        }));
    }
    for task in all {
        task.await??;
    }
    Ok(ListFigures {
        one_ms: median(times) * 1000.0,
        serializable_ms: median(serializable) * 1000.0,
        concurrent_s: started.elapsed().as_secs_f64(),
        etcd_cpu_s: cpu_seconds(etcd_pid) - cpu,
    })
}

struct WatchFigures {
    p50_ms: f64,
    p99_ms: f64,
    events_per_s: f64,
    delivered: usize,
    expected: usize,
    etcd_cpu_s: f64,
    front_cpu_s: f64,
    front_rss_mib: f64,
    /// CPU of this process (the watchers, the writer, the lister) meanwhile.
    clients_cpu_s: f64,
    /// Lists of another prefix made from the same front while the writes ran.
    lists: Option<usize>,
}

/// `n` watchers of `prefix` through `front` while a writer writes; with `busy`, another
/// client lists that (prefix, keys) from the same front, one list after another.
async fn watches(
    writer: &Client,
    front: &Front,
    prefix: &str,
    n: usize,
    args: &Args,
    etcd_pid: u32,
    busy: Option<(&str, usize)>,
) -> Res<WatchFigures> {
    let connections = n.clamp(1, 20);
    let mut clients = Vec::new();
    for _ in 0..connections {
        clients.push(connect([front.endpoint.as_str()]).await?);
    }
    let latencies = Arc::new(Mutex::new(Vec::<f64>::new()));
    let writes = (args.rate * args.seconds) as usize;
    let mut tasks = Vec::new();
    let (created_tx, mut created_rx) = tokio::sync::mpsc::channel::<()>(n.max(1));
    for i in 0..n {
        let mut watch = clients[i % connections].watch_client();
        let (prefix, latencies, created) =
            (prefix.to_string(), latencies.clone(), created_tx.clone());
        tasks.push(tokio::spawn(async move {
            let (_requests, mut responses) = watch
                .watch(prefix.as_str(), Some(WatchOptions::new().with_prefix()))
                .await?
                .split();
            let mut mine = Vec::with_capacity(writes);
            let mut seen = 0;
            // A stream that fails keeps what it received: the figures count it.
            let mut failed = None;
            while seen < writes {
                let r = match responses.message().await {
                    Ok(Some(r)) => r,
                    Ok(None) => break,
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                };
                if r.created() {
                    let _ = created.send(()).await;
                }
                let now = now_nanos();
                for e in r.events() {
                    let sent = e
                        .kv()
                        .and_then(|kv| kv.value_str().ok())
                        .and_then(|v| v.split(':').next())
                        .and_then(|t| t.parse::<u128>().ok());
                    if let Some(sent) = sent {
                        mine.push(now.saturating_sub(sent) as f64 / 1e6);
                        seen += 1;
                    }
                }
            }
            let count = mine.len();
            if let Ok(mut all) = latencies.lock() {
                all.extend(mine);
            }
            Ok::<_, etcd_client::Error>((count, failed))
        }));
    }
    drop(created_tx);
    for _ in 0..n {
        tokio::time::timeout(Duration::from_secs(60), created_rx.recv())
            .await
            .map_err(|_| "watches were not created within 60 s")?;
    }
    let (etcd_cpu, front_cpu) = (cpu_seconds(etcd_pid), front.pid().map_or(0.0, cpu_seconds));
    let clients_cpu = cpu_seconds(std::process::id());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let lister = busy.map(|(list_prefix, keys)| {
        let (endpoint, list_prefix, stop) =
            (front.endpoint.clone(), list_prefix.to_owned(), stop.clone());
        tokio::spawn(async move {
            let mut lists = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                list_once(&endpoint, &list_prefix, keys)
                    .await
                    .map_err(|e| e.to_string())?;
                lists += 1;
            }
            Ok::<usize, String>(lists)
        })
    });
    let started = Instant::now();
    let period = Duration::from_secs_f64(1.0 / args.rate as f64);
    let mut tick = tokio::time::interval(period);
    let mut kv = writer.kv_client();
    let pad = "p".repeat(200);
    for i in 0..writes {
        tick.tick().await;
        let value = format!("{}:{pad}", now_nanos());
        kv.put(format!("{prefix}k{:07}", i % args.watch_keys), value, None)
            .await?;
    }
    let mut delivered = 0;
    for (i, task) in tasks.into_iter().enumerate() {
        // A watcher that did not get every event says why.
        match tokio::time::timeout(Duration::from_secs(60), task).await {
            Ok(Ok(Ok((count, failed)))) => {
                delivered += count;
                match failed {
                    Some(e) => eprintln!("watcher {i}: {e}, after {count} of {writes} events"),
                    None if count < writes => {
                        eprintln!("watcher {i}: its stream ended after {count} of {writes} events")
                    }
                    None => {}
                }
            }
            Ok(Ok(Err(e))) => eprintln!("watcher {i}: {e}"),
            Ok(Err(e)) => eprintln!("watcher {i}: {e}"),
            Err(_) => eprintln!("watcher {i}: not done 60 s after the last write"),
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let lists = match lister {
        Some(task) => Some(task.await??),
        None => None,
    };
    let front_rss_mib = front.pid().map_or(0.0, rss_mib);
    let mut all = std::mem::take(&mut *latencies.lock().map_err(|_| "poisoned")?);
    all.sort_by(f64::total_cmp);
    Ok(WatchFigures {
        p50_ms: percentile(&all, 50.0),
        p99_ms: percentile(&all, 99.0),
        events_per_s: delivered as f64 / elapsed,
        delivered,
        expected: writes * n,
        etcd_cpu_s: cpu_seconds(etcd_pid) - etcd_cpu,
        front_cpu_s: front.pid().map_or(0.0, cpu_seconds) - front_cpu,
        front_rss_mib,
        clients_cpu_s: cpu_seconds(std::process::id()) - clients_cpu,
        lists,
    })
}

async fn run() -> Res<()> {
    let args = args();
    let wants = |scenario: &str| args.scenarios.iter().any(|s| s == scenario);
    let etcd = EtcdServer::start().await?;
    let etcd_pid = etcd.pid().ok_or("etcd has no pid")?;
    let endpoint = etcd.endpoint();
    let client = connect([endpoint.as_str()]).await?;
    let list_prefix = "/bench/list/";
    let watch_prefix = "/bench/watch/";
    eprintln!("loading {} + {} keys...", args.keys, args.watch_keys);
    load(&client, list_prefix, args.keys, 256).await?;
    load(&client, watch_prefix, args.watch_keys, 256).await?;
    let direct = Front {
        name: "etcd direct",
        endpoint: endpoint.trim_start_matches("http://").to_string(),
        child: None,
    };
    let proxy = start_proxy(&endpoint).await?;
    let list_server = start_cache_server(&endpoint, list_prefix).await?;
    let watch_server = start_cache_server(&endpoint, watch_prefix).await?;
    let floor = if args.ways.iter().any(|w| w == "floor") {
        start_floor(&endpoint, watch_prefix).await?
    } else {
        Front {
            name: "floor",
            endpoint: String::new(),
            child: None,
        }
    };
    if wants("list") {
        println!(
            "\n{} keys of 256 B: one list (median of {}), then {} new clients at once\n",
            args.keys, args.lists, args.clients
        );
        println!(
            "| way | one list | one serializable list | {} lists at once | etcd CPU for those |",
            args.clients
        );
        println!("| --- | ---: | ---: | ---: | ---: |");
        let mut one = Vec::new();
        for front in [&direct, &proxy, &list_server] {
            let f = lists(&front.endpoint, list_prefix, &args, etcd_pid).await?;
            println!(
                "| {} | {:.0} ms | {:.0} ms | {:.2} s | {:.2} s |",
                front.name, f.one_ms, f.serializable_ms, f.concurrent_s, f.etcd_cpu_s
            );
            println!(
                "{{\"scenario\":\"list\",\"way\":\"{}\",\"keys\":{},\"one_ms\":{:.1},\"serializable_ms\":{:.1},\"concurrent_clients\":{},\"concurrent_s\":{:.3},\"etcd_cpu_s\":{:.2}}}",
                front.name, args.keys, f.one_ms, f.serializable_ms, args.clients, f.concurrent_s, f.etcd_cpu_s
            );
            one.push(f.one_ms);
        }
        let floor = decode_floor_ms(args.keys);
        println!("the client's own decoding of such an answer, from memory: {floor:.0} ms");
        println!(
            "{{\"scenario\":\"list\",\"way\":\"client decode\",\"keys\":{},\"one_ms\":{floor:.1}}}",
            args.keys
        );
        if let [direct_ms, _, server_ms] = one[..] {
            println!(
                "list from the server vs etcd: {:.1}x faster; without the client's decoding: {:.1}x\n",
                direct_ms / server_ms,
                (direct_ms - floor) / (server_ms - floor)
            );
        }
    }
    if wants("watch") {
        println!(
            "\nwatchers on {} keys, {} writes/s for {} s\n",
            args.watch_keys, args.rate, args.seconds
        );
        watch_header();
        for &n in &args.watchers {
            for (way, front) in [
                ("direct", &direct),
                ("proxy", &proxy),
                ("server", &watch_server),
                ("floor", &floor),
            ] {
                if !args.ways.iter().any(|w| w == way) {
                    continue;
                }
                let f = watches(&client, front, watch_prefix, n, &args, etcd_pid, None).await?;
                watch_row(front.name, n, &f);
            }
        }
    }
    if wants("busy") {
        let n = args.busy_watchers;
        let both = format!("{watch_prefix},{list_prefix}");
        let server = start_cache_server(&endpoint, &both).await?;
        println!(
            "\n{n} watchers through one cache server, quiet, then while another client lists its {}-key prefix one list after another\n",
            args.keys
        );
        watch_header();
        let quiet = watches(&client, &server, watch_prefix, n, &args, etcd_pid, None).await?;
        watch_row("cache server, quiet", n, &quiet);
        let busy = (list_prefix, args.keys);
        let f = watches(
            &client,
            &server,
            watch_prefix,
            n,
            &args,
            etcd_pid,
            Some(busy),
        )
        .await?;
        watch_row("cache server, lists beside", n, &f);
    }
    if wants("quiet") {
        quiet_lists(&client, &endpoint, list_prefix, &args, etcd_pid).await?;
    }
    if wants("first") {
        println!("\nfirst answer of a new forwarded stream (median and slowest of 20)\n");
        println!("| way | lease keep-alive | watch outside the prefix (created) |");
        println!("| --- | ---: | ---: |");
        // Not the grpc-proxy: it answers a new keep-alive stream only after about 20 s.
        for front in [&direct, &watch_server] {
            let [ka, ka_max, w, w_max] =
                first_answers(&front.endpoint, "/bench/elsewhere", 20).await?;
            println!(
                "| {} | {ka:.2} ms (max {ka_max:.2}) | {w:.2} ms (max {w_max:.2}) |",
                front.name
            );
            println!(
                "{{\"scenario\":\"first\",\"way\":\"{}\",\"keep_alive_ms\":{ka:.3},\"watch_created_ms\":{w:.3}}}",
                front.name
            );
        }
    }
    if wants("failover") {
        let n = args.failover_watchers;
        let mut first = start_cache_server(&endpoint, watch_prefix).await?;
        let second = start_cache_server(&endpoint, watch_prefix).await?;
        let endpoints = [first.endpoint.clone(), second.endpoint.clone()];
        let endpoints = [endpoints[0].as_str(), endpoints[1].as_str()];
        let (delivered, expected, repeats, p50, p99, max) =
            failover(&client, endpoints, &mut first, watch_prefix, n, &args).await?;
        println!(
            "\n{n} watchers given two cache servers, one SIGKILLed halfway through {} writes/s for {} s\n",
            args.rate, args.seconds
        );
        println!("| watchers | delivered | repeated | p50 | p99 | max (the failover gap) |");
        println!("| ---: | ---: | ---: | ---: | ---: | ---: |");
        println!("| {n} | {delivered}/{expected} | {repeats} | {p50:.2} ms | {p99:.2} ms | {max:.0} ms |");
        println!(
            "{{\"scenario\":\"failover\",\"watchers\":{n},\"delivered\":{delivered},\"expected\":{expected},\"repeats\":{repeats},\"p50_ms\":{p50:.3},\"p99_ms\":{p99:.3},\"max_ms\":{max:.1}}}"
        );
    }
    Ok(())
}

/// Linearizable lists of a quiet prefix while a writer writes elsewhere at `--rate`
/// (Kubernetes' usual state: most prefixes are quiet while some are written): etcd's CPU per
/// list straight to etcd, and through a cache server whose cache is proven by its watch's
/// progress (etcd 3.4.25+, 3.5.8+; forced here) and by a read of the range (before). Each
/// figure is etcd's CPU over `--lists` lists less the writer's own cost, measured alone for
/// as long.
async fn quiet_lists(
    writer: &Client,
    endpoint: &str,
    prefix: &str,
    args: &Args,
    etcd_pid: u32,
) -> Res<()> {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writing = {
        let (mut kv, stop, rate) = (writer.kv_client(), stop.clone(), args.rate.max(1));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                tick.tick().await;
                let _ = kv.put("/bench/elsewhere/k", "x", None).await;
            }
        })
    };
    let busy_cpu =
        |started: Instant, cpu: f64| (cpu_seconds(etcd_pid) - cpu, started.elapsed().as_secs_f64());
    let (cpu, started) = (cpu_seconds(etcd_pid), Instant::now());
    tokio::time::sleep(Duration::from_secs(args.seconds)).await;
    let (writer_cpu, writer_s) = busy_cpu(started, cpu);
    let writer_rate = writer_cpu / writer_s;
    let progress = start_cache_server_trusting(endpoint, prefix, Some(true)).await?;
    let range = start_cache_server_trusting(endpoint, prefix, Some(false)).await?;
    println!(
        "\n{} linearizable lists of a quiet {}-key prefix while {} writes/s go elsewhere (etcd's CPU less the writer's, {:.1} ms/s)\n",
        args.lists, args.keys, args.rate, writer_rate * 1000.0
    );
    println!("| way | etcd CPU per list | of a direct list's | list time |");
    println!("| --- | ---: | ---: | ---: |");
    let mut direct_ms = None;
    for (name, front) in [
        ("etcd direct", endpoint.trim_start_matches("http://")),
        ("server, proven by progress", progress.endpoint.as_str()),
        ("server, proven by a range read", range.endpoint.as_str()),
    ] {
        let client = connect([front]).await?;
        let mut kv = client.kv_client().max_decoding_message_size(usize::MAX);
        let options = || Some(GetOptions::new().with_prefix());
        kv.get(prefix, options()).await?;
        let (cpu, started) = (cpu_seconds(etcd_pid), Instant::now());
        for _ in 0..args.lists {
            let resp = kv.get(prefix, options()).await?;
            if resp.kvs().len() != args.keys {
                return Err(
                    format!("{name}: listed {} keys of {}", resp.kvs().len(), args.keys).into(),
                );
            }
        }
        let (cpu, s) = busy_cpu(started, cpu);
        let per_list_ms = ((cpu - writer_rate * s) / args.lists as f64).max(0.0) * 1000.0;
        let ratio = direct_ms.map_or(1.0, |d: f64| per_list_ms / d);
        direct_ms.get_or_insert(per_list_ms);
        println!(
            "| {name} | {per_list_ms:.2} ms | {:.1}% | {:.0} ms |",
            ratio * 100.0,
            s * 1000.0 / args.lists as f64
        );
        println!(
            "{{\"scenario\":\"quiet\",\"way\":\"{name}\",\"keys\":{},\"lists\":{},\"etcd_cpu_ms_per_list\":{per_list_ms:.3},\"of_direct\":{ratio:.4}}}",
            args.keys, args.lists
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = writing.await;
    Ok(())
}

/// `n` watchers given both `endpoints`, a writer at `--rate` for `--seconds`, and `kill`
/// SIGKILLed halfway: each watcher watches again from its next revision after an error.
/// Returns (delivered, expected, repeats, p50, p99, max latency in ms).
async fn failover(
    writer: &Client,
    endpoints: [&str; 2],
    kill: &mut Front,
    prefix: &str,
    n: usize,
    args: &Args,
) -> Res<(usize, usize, usize, f64, f64, f64)> {
    let connections = n.clamp(1, 20);
    let mut clients = Vec::new();
    for _ in 0..connections {
        clients.push(connect(endpoints).await?);
    }
    let writes = (args.rate * args.seconds) as usize;
    let from = writer
        .kv_client()
        .get(prefix, Some(GetOptions::new().with_count_only()))
        .await?
        .header()
        .map_or(0, |h| h.revision())
        + 1;
    let (created_tx, mut created_rx) = tokio::sync::mpsc::channel::<()>(n.max(1));
    let mut tasks = Vec::new();
    for i in 0..n {
        let client = clients[i % connections].clone();
        let (prefix, created) = (prefix.to_string(), created_tx.clone());
        tasks.push(tokio::spawn(async move {
            let (mut next, mut seen, mut repeats) = (from, 0, 0);
            let mut latencies = Vec::with_capacity(writes);
            let give_up = Instant::now() + Duration::from_secs(120);
            while seen < writes && Instant::now() < give_up {
                let options = WatchOptions::new().with_prefix().with_start_revision(next);
                let Ok(stream) = client
                    .watch_client()
                    .watch(prefix.as_str(), Some(options))
                    .await
                else {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                };
                let (_requests, mut responses) = stream.split();
                while let Ok(Some(r)) = responses.message().await {
                    if r.created() {
                        let _ = created.try_send(());
                    }
                    let now = now_nanos();
                    for e in r.events() {
                        let Some(kv) = e.kv() else { continue };
                        if kv.mod_revision() < next {
                            repeats += 1;
                            continue;
                        }
                        next = kv.mod_revision() + 1;
                        let sent = kv
                            .value_str()
                            .ok()
                            .and_then(|v| v.split(':').next())
                            .and_then(|t| t.parse::<u128>().ok());
                        if let Some(sent) = sent {
                            latencies.push(now.saturating_sub(sent) as f64 / 1e6);
                            seen += 1;
                        }
                    }
                    if seen >= writes {
                        break;
                    }
                }
            }
            (latencies, repeats)
        }));
    }
    drop(created_tx);
    for _ in 0..n {
        tokio::time::timeout(Duration::from_secs(60), created_rx.recv())
            .await
            .map_err(|_| "watches were not created within 60 s")?;
    }
    let period = Duration::from_secs_f64(1.0 / args.rate as f64);
    let mut tick = tokio::time::interval(period);
    let mut kv = writer.kv_client();
    let pad = "p".repeat(200);
    for i in 0..writes {
        tick.tick().await;
        if i == writes / 2 {
            if let Some(child) = kill.child.as_mut() {
                child.start_kill()?;
            }
        }
        let value = format!("{}:{pad}", now_nanos());
        kv.put(format!("{prefix}k{:07}", i % args.watch_keys), value, None)
            .await?;
    }
    let (mut all, mut repeats) = (Vec::new(), 0);
    for task in tasks {
        let (latencies, repeated) = task.await?;
        all.extend(latencies);
        repeats += repeated;
    }
    all.sort_by(f64::total_cmp);
    let max = all.last().copied().unwrap_or(f64::NAN);
    Ok((
        all.len(),
        writes * n,
        repeats,
        percentile(&all, 50.0),
        percentile(&all, 99.0),
        max,
    ))
}

/// Milliseconds to the first answer of a new forwarded stream on a connection already open
/// (median and slowest of `samples`): a lease keep-alive's first answer, and a watch of a key
/// outside the served prefix until its `created`.
async fn first_answers(endpoint: &str, outside: &str, samples: usize) -> Res<[f64; 4]> {
    let client = connect([endpoint]).await?;
    let (mut keep_alive, mut watch) = (Vec::new(), Vec::new());
    for _ in 0..samples {
        let lease = client.lease_client().grant(60, None).await?.id();
        let started = Instant::now();
        let (mut keeper, mut answers) = client.lease_client().keep_alive(lease).await?;
        keeper.keep_alive().await?;
        answers.message().await?.ok_or("no keep-alive answer")?;
        keep_alive.push(started.elapsed().as_secs_f64() * 1000.0);
        client.lease_client().revoke(lease).await?;
        let started = Instant::now();
        let (_requests, mut responses) = client.watch_client().watch(outside, None).await?.split();
        let created = responses.message().await?.ok_or("no created")?;
        if !created.created() {
            return Err("the first answer was not created".into());
        }
        watch.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    let slowest = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    Ok([
        median(keep_alive.clone()),
        slowest(&keep_alive),
        median(watch.clone()),
        slowest(&watch),
    ])
}

fn watch_header() {
    println!(
        "| way | watchers | delivered | p50 | p99 | events/s | etcd CPU | front CPU | front RSS | clients CPU |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
}

fn watch_row(way: &str, n: usize, f: &WatchFigures) {
    println!(
        "| {way} | {n} | {}/{} | {:.2} ms | {:.2} ms | {:.0} | {:.2} s | {:.2} s | {:.0} MiB | {:.2} s |{}",
        f.delivered,
        f.expected,
        f.p50_ms,
        f.p99_ms,
        f.events_per_s,
        f.etcd_cpu_s,
        f.front_cpu_s,
        f.front_rss_mib,
        f.clients_cpu_s,
        f.lists
            .map_or(String::new(), |l| format!(" ({l} lists meanwhile)"))
    );
    println!(
        "{{\"scenario\":\"watch\",\"way\":\"{way}\",\"watchers\":{n},\"delivered\":{},\"expected\":{},\"p50_ms\":{:.3},\"p99_ms\":{:.3},\"events_per_s\":{:.0},\"etcd_cpu_s\":{:.3},\"front_cpu_s\":{:.3},\"front_rss_mib\":{:.1},\"clients_cpu_s\":{:.3},\"lists\":{}}}",
        f.delivered, f.expected, f.p50_ms, f.p99_ms, f.events_per_s, f.etcd_cpu_s, f.front_cpu_s, f.front_rss_mib, f.clients_cpu_s, f.lists.unwrap_or(0)
    );
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let get = |i: usize| argv.get(i).cloned().unwrap_or_default();
    let result = if argv.get(1).map(String::as_str) == Some("--child") {
        runtime.block_on(child(get(2), get(3), get(4), get(5)))
    } else if argv.get(1).map(String::as_str) == Some("--floor") {
        runtime.block_on(floor_child(get(2), get(3), get(4)))
    } else {
        runtime.block_on(run())
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
