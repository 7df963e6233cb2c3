//! End-to-end benchmark of `etcd-informer` against a hand-written etcd-client baseline.
//!
//! ```text
//! cargo bench --bench informer -- [--keys N] [--value-bytes S] [--events M] [--handlers H]
//!     [--scenario NAME[,NAME...]] [--page-size P] [--runs R] [--writers W]
//!     [--latency-puts K] [--latency-rate PUTS_PER_S] [--processing atomic|delta-fifo]
//! ```
//!
//! Defaults: N = 100,000 keys of about S = 256 bytes, M = 20,000 events, H = 10 handlers,
//! P = the informer's default page size (`EtcdOptions::default().page_size`), R = 3 runs per side
//! (the sides alternate and medians are reported), W = 16 concurrent writers, K = 2,000 puts at
//! 500 puts/s, the informer's default processing mode (`atomic`; `delta-fifo` measures the
//! DeltaFIFO mode).
//!
//! The benchmark starts its own throwaway etcd (the crate's test harness) with its data directory
//! on `/dev/shm`, or uses `ETCD_ENDPOINTS` if set (under a unique prefix it deletes afterwards).
//! It loads N ConfigMap-like JSON objects (`{namespace, name, labels (3), data}`) under
//! `<prefix><namespace>/<name>` in 10 namespaces, with concurrent transactions of 128 puts each.
//!
//! Each scenario prints ONE JSON line (`scenario`, `baseline`, `informer`, `ratio` =
//! informer / baseline, `unit`, `lower_is_better`, `keys`, `value_bytes`, `etcd_version`, plus
//! detail fields); a Markdown table of every scenario follows at the end. Progress goes to stderr.
//!
//! # Scenarios
//!
//! - `sync`: time from starting a `SharedIndexInformer<ConfigMap>` (JSON codec, namespace index,
//!   no handler) to `has_synced` (polled every 1 ms). Baseline: a paged range read of the prefix
//!   pinned at the first page's revision, `serde_json` decoding of every value and insertion into
//!   a `HashMap<String, Arc<ConfigMap>>`, measured with pages of 10,000 and 50,000 keys and
//!   unpaged (limit 0, one response); the best of the three is the baseline. The informer is
//!   measured at its page size (`--page-size`, default `EtcdOptions::default().page_size`: the
//!   reported figure) and at 5k, 10k, 50k, 100k and 1e9 ("unpaged") keys per page (detail fields
//!   `informer_s_by_page`, `informer_ratio_by_page`), to choose `EtcdOptions::page_size`. Also
//!   `informer_list_only_s`: `EtcdListerWatcher::list` alone (fetch + decode, no cache), so
//!   `informer_cache_pipeline_s` = sync - list is what the DeltaFIFO, indexer and controller cost.
//! - `watch`: W writers put M updates of existing keys (one update per key) as fast as etcd takes
//!   them; the time from the first put until every update has reached (a) a raw etcd watch of the
//!   prefix that decodes each event (baseline) or (b) the single handler of a synced informer.
//!   Reported in events/s (higher is better). The sides run one after the other under the same
//!   write load; a missing event fails the benchmark. Details: the write rate etcd sustained and
//!   the CPU time per event of this process (consumer plus writers) and of etcd (when we started
//!   it), which shows what the consumer costs on a machine where it shares the cores with etcd.
//! - `fanout`: the same with H handlers on one shared informer; the informer's figure is the rate
//!   at which the LAST handler has seen all M events. Every handler must see every event.
//! - `latency`: K sequential puts paced at a fixed rate; latency from just before each put to
//!   the handler (or the raw watch) receiving that value, matched by a sequence number in the
//!   value. p50 and p99; the ratio is on p99, and `p99_diff_ms` is informer p99 - raw p99.
//! - `memory`: resident memory per cached object, each side measured in a fresh child process
//!   (the bench re-executes itself with a hidden `--child` argument): the RSS growth from before
//!   the list to after sync, divided by N. Raw: `HashMap<String, Arc<ConfigMap>>` (keys relative
//!   to the prefix, like the informer's) built from pages of P keys. Informer: the namespace
//!   index, no handler; also with H no-op handlers (detail). The primary figure is the RSS growth
//!   after `malloc_trim(0)` (memory the program holds); the RSS growth before trimming is reported
//!   too (`*_untrimmed`).
//! - `prevkv`: etcd's write throughput (W writers, M/4 puts) while a raw watch of the prefix is
//!   open without prev_kv (baseline column) and with prev_kv ("informer" column): does prev_kv
//!   cost etcd throughput? Higher is better.
//!
//! Each informer measured is stopped and its cache emptied before the next measurement starts,
//! so that freeing it does not overlap the next one.
//!
//! Run one scenario with `--scenario sync` (or several: `--scenario sync,memory`). On a noisy
//! machine compare ratios, not absolute times: both sides are measured in the same run.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{Client, GetOptions, Txn, TxnOp, WatchOptions};
// The harness's server options (may be renamed `ServerOptions` upstream): imported here only.
use etcd_informer::testing::etcd::{EtcdServer, ServerOptions};
use etcd_informer::{
    EtcdListerWatcher, EtcdOptions, HandlerRegistration, InformerOptions, JsonCodec, ListerWatcher,
    Processing, ResourceEventHandlerFuncs, SharedIndexInformer,
};
use serde_json::{json, Value};
use tokio::sync::Notify;

const NAMESPACES: usize = 10;
const TXN_OPS: usize = 128;
const LOADERS: usize = 8;
const MAX_MESSAGE: usize = 1 << 30;
/// "Unpaged" for the informer, whose page size must be at least 1.
const HUGE_PAGE: i64 = 1_000_000_000;
const ALL_SCENARIOS: [&str; 6] = ["sync", "watch", "fanout", "latency", "memory", "prevkv"];

/// A ConfigMap-like object, stored as JSON.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct ConfigMap {
    namespace: String,
    name: String,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    data: BTreeMap<String, String>,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Res<T> = Result<T, BoxError>;

/// The temporary directory of the etcd we started, removed by [`fail`] (the process exits without
/// dropping the server; the harness's parent-death signal kills etcd itself).
static ETCD_DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

/// Prints the message and exits non-zero.
fn fail(message: impl std::fmt::Display) -> ! {
    eprintln!("BENCHMARK FAILED: {message}");
    if let Some(dir) = ETCD_DIR.get() {
        let _ = std::fs::remove_dir_all(dir);
    }
    std::process::exit(1);
}

// ---------------------------------------------------------------------------------------------
// Arguments

#[derive(Debug, Clone)]
struct Args {
    keys: usize,
    value_bytes: usize,
    events: usize,
    handlers: usize,
    scenarios: Vec<String>,
    page_size: i64,
    runs: usize,
    writers: usize,
    latency_puts: usize,
    latency_rate: u64,
    processing: Processing,
    // Hidden, for the memory child processes.
    child: Option<String>,
    endpoints: Vec<String>,
    prefix: Option<String>,
}

fn parse_args() -> Args {
    let mut a = Args {
        keys: 100_000,
        value_bytes: 256,
        events: 20_000,
        handlers: 10,
        scenarios: ALL_SCENARIOS.iter().map(|s| s.to_string()).collect(),
        page_size: EtcdOptions::default().page_size,
        runs: 3,
        writers: 16,
        latency_puts: 2_000,
        latency_rate: 500,
        processing: Processing::default(),
        child: None,
        endpoints: Vec::new(),
        prefix: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_owned(), Some(v.to_owned())),
            _ => (arg.clone(), None),
        };
        // `cargo bench` passes `--bench` to harness-less benchmarks.
        if flag == "--bench" {
            continue;
        }
        let mut value = || -> String {
            inline
                .clone()
                .or_else(|| it.next())
                .unwrap_or_else(|| fail(format!("{flag} needs a value")))
        };
        fn num<T: std::str::FromStr>(flag: &str, v: String) -> T {
            v.replace('_', "")
                .parse()
                .unwrap_or_else(|_| fail(format!("{flag}: not a number: {v}")))
        }
        match flag.as_str() {
            "--keys" => a.keys = num(&flag, value()),
            "--value-bytes" => a.value_bytes = num(&flag, value()),
            "--events" => a.events = num(&flag, value()),
            "--handlers" => a.handlers = num(&flag, value()),
            "--page-size" => a.page_size = num(&flag, value()),
            "--runs" => a.runs = num(&flag, value()),
            "--writers" => a.writers = num(&flag, value()),
            "--latency-puts" => a.latency_puts = num(&flag, value()),
            "--latency-rate" => a.latency_rate = num(&flag, value()),
            "--scenario" => {
                a.scenarios = value().split(',').map(|s| s.trim().to_owned()).collect();
                for s in &a.scenarios {
                    if !ALL_SCENARIOS.contains(&s.as_str()) {
                        fail(format!(
                            "unknown scenario {s:?}; known: {}",
                            ALL_SCENARIOS.join(", ")
                        ));
                    }
                }
            }
            "--processing" => {
                a.processing = match value().as_str() {
                    "atomic" => Processing::Atomic,
                    "delta-fifo" => Processing::DeltaFifo,
                    other => fail(format!(
                        "--processing {other:?}: expected atomic or delta-fifo"
                    )),
                }
            }
            "--child" => a.child = Some(value()),
            "--endpoints" => a.endpoints = value().split(',').map(str::to_owned).collect(),
            "--prefix" => a.prefix = Some(value()),
            "-h" | "--help" => {
                eprintln!(
                    "usage: cargo bench --bench informer -- [--keys N] [--value-bytes S] [--events M] \
                     [--handlers H] [--scenario {}] [--page-size P] [--runs R] [--writers W] \
                     [--latency-puts K] [--latency-rate PUTS_PER_S] [--processing atomic|delta-fifo]",
                    ALL_SCENARIOS.join("|")
                );
                std::process::exit(0);
            }
            other => fail(format!("unknown argument {other:?} (try --help)")),
        }
    }
    if a.keys == 0 || a.runs == 0 || a.writers == 0 || a.page_size < 1 || a.latency_rate == 0 {
        fail("--keys, --runs, --writers, --page-size and --latency-rate must be positive");
    }
    a
}

// ---------------------------------------------------------------------------------------------
// Data

fn rel_key(i: usize) -> String {
    format!("ns-{:02}/cm-{:08}", i % NAMESPACES, i)
}

fn full_key(prefix: &str, i: usize) -> String {
    format!("{prefix}{}", rel_key(i))
}

/// The value of key `i` carrying sequence number `seq`, padded to about `size` bytes of JSON.
fn make_value(i: usize, seq: u64, size: usize) -> Vec<u8> {
    const TIERS: [&str; 3] = ["web", "api", "db"];
    let mut labels = BTreeMap::new();
    labels.insert("app".to_owned(), format!("app-{}", i % 100));
    labels.insert("tier".to_owned(), TIERS[i % 3].to_owned());
    labels.insert("release".to_owned(), format!("r{}", i % 7));
    let mut data = BTreeMap::new();
    data.insert("seq".to_owned(), seq.to_string());
    data.insert("payload".to_owned(), String::new());
    let mut cm = ConfigMap {
        namespace: format!("ns-{:02}", i % NAMESPACES),
        name: format!("cm-{i:08}"),
        labels,
        data,
    };
    let base = serde_json::to_vec(&cm).expect("encode").len();
    if size > base {
        // Varied filler, so decoding is not a run of one byte.
        let filler: String = (0..size - base)
            .map(|k| {
                let c = (i.wrapping_mul(31) + seq as usize + k * 7) % 36;
                char::from_digit(c as u32, 36).unwrap_or('x')
            })
            .collect();
        cm.data.insert("payload".to_owned(), filler);
    }
    serde_json::to_vec(&cm).expect("encode")
}

fn prefix_range_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

fn seq_of(cm: &ConfigMap) -> Option<u64> {
    cm.data.get("seq")?.parse().ok()
}

// ---------------------------------------------------------------------------------------------
// Measurement helpers

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn round(x: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (x * f).round() / f
}

/// Resident set size of this process, in bytes.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// CPU time (user + system) used so far by a process (this one if `pid` is `None`), in seconds;
/// 0 if unknown.
fn cpu_seconds(pid: Option<u32>) -> f64 {
    let path = match pid {
        Some(p) => format!("/proc/{p}/stat"),
        None => "/proc/self/stat".to_owned(),
    };
    let Ok(stat) = std::fs::read_to_string(path) else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // USER_HZ is 100 on Linux.
    (ticks(11) + ticks(12)) / 100.0
}

/// CPU used by this process and by etcd between two points.
#[derive(Clone, Copy)]
struct CpuMark {
    own: f64,
    etcd: f64,
}

impl CpuMark {
    fn now(etcd_pid: Option<u32>) -> CpuMark {
        CpuMark {
            own: cpu_seconds(None),
            etcd: etcd_pid.map_or(0.0, |p| cpu_seconds(Some(p))),
        }
    }

    /// (own, etcd) CPU microseconds per event since `self`.
    fn per_event(&self, etcd_pid: Option<u32>, events: usize) -> (f64, f64) {
        let now = CpuMark::now(etcd_pid);
        (
            (now.own - self.own) * 1e6 / events as f64,
            (now.etcd - self.etcd) * 1e6 / events as f64,
        )
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim_malloc() {
    extern "C" {
        fn malloc_trim(pad: usize) -> i32;
    }
    // SAFETY: glibc's malloc_trim only releases free memory back to the system.
    unsafe {
        malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim_malloc() {}

/// Counts the events a consumer receives and records when the last expected one arrived, and
/// optionally the arrival time of each sequence number (for latency).
struct Sink {
    target: usize,
    count: AtomicUsize,
    bad: AtomicUsize,
    done_at: Mutex<Option<Instant>>,
    done: Notify,
    base: Instant,
    seq_base: u64,
    /// Nanoseconds since `base` at which each sequence number arrived (0: not yet).
    arrivals: Vec<AtomicU64>,
}

impl Sink {
    fn new(target: usize, seq_base: u64, track: bool, base: Instant) -> Arc<Sink> {
        Arc::new(Sink {
            target,
            count: AtomicUsize::new(0),
            bad: AtomicUsize::new(0),
            done_at: Mutex::new(None),
            done: Notify::new(),
            base,
            seq_base,
            arrivals: if track {
                (0..target).map(|_| AtomicU64::new(0)).collect()
            } else {
                Vec::new()
            },
        })
    }

    fn record(&self, cm: &ConfigMap) {
        let now = Instant::now();
        if !self.arrivals.is_empty() {
            match seq_of(cm).and_then(|s| s.checked_sub(self.seq_base)) {
                Some(i) if (i as usize) < self.arrivals.len() => {
                    let nanos = now.duration_since(self.base).as_nanos() as u64;
                    self.arrivals[i as usize].store(nanos.max(1), Ordering::Relaxed);
                }
                _ => {
                    self.bad.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            }
        }
        if self.count.fetch_add(1, Ordering::AcqRel) + 1 == self.target {
            *self.done_at.lock().unwrap_or_else(|e| e.into_inner()) = Some(now);
            self.done.notify_one();
        }
    }

    fn count(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    fn done_at(&self) -> Option<Instant> {
        *self.done_at.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until every expected event arrived, or fails loudly after `deadline`.
    async fn wait(&self, what: &str, deadline: Duration) -> Instant {
        let waited = tokio::time::timeout(deadline, async {
            loop {
                if let Some(t) = self.done_at() {
                    return t;
                }
                let _ = tokio::time::timeout(Duration::from_millis(50), self.done.notified()).await;
            }
        })
        .await;
        match waited {
            Ok(t) => t,
            Err(_) => fail(format!(
                "{what}: only {} of {} events arrived within {:?} ({} unmatched)",
                self.count(),
                self.target,
                deadline,
                self.bad.load(Ordering::Relaxed)
            )),
        }
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

// ---------------------------------------------------------------------------------------------
// The benchmark context

struct Bench {
    args: Args,
    endpoints: Vec<String>,
    /// The etcd we started, for its CPU time.
    etcd_pid: Option<u32>,
    prefix: String,
    writer: Client,
    version: String,
    /// The next sequence number to write (unique over the whole run).
    next_seq: AtomicU64,
    /// Where the next batch of updates starts in the key space.
    next_key: AtomicUsize,
}

impl Bench {
    async fn raw_client(&self) -> Client {
        Client::connect(&self.endpoints, None)
            .await
            .unwrap_or_else(|e| fail(format!("connecting to etcd: {e}")))
    }

    async fn informer_client(&self) -> Client {
        etcd_informer::connect(&self.endpoints)
            .await
            .unwrap_or_else(|e| fail(format!("connecting to etcd: {e}")))
    }

    fn informer(&self, client: Client, page_size: i64) -> SharedIndexInformer<ConfigMap> {
        let lw = EtcdListerWatcher::with_options(
            client,
            self.prefix.clone(),
            JsonCodec::<ConfigMap>::new(),
            EtcdOptions {
                page_size,
                ..EtcdOptions::default()
            },
        )
        .unwrap_or_else(|e| fail(e));
        SharedIndexInformer::new(
            lw,
            InformerOptions {
                name: "bench".into(),
                processing: self.args.processing,
                ..InformerOptions::default()
            },
        )
    }

    /// Reserves `n` sequence numbers and `n` keys; returns (first seq, first key index).
    fn reserve(&self, n: usize) -> (u64, usize) {
        let seq = self.next_seq.fetch_add(n as u64, Ordering::Relaxed);
        let key = self.next_key.fetch_add(n, Ordering::Relaxed) % self.args.keys;
        (seq, key)
    }

    fn base_json(&self, scenario: &str) -> serde_json::Map<String, Value> {
        let mut m = serde_json::Map::new();
        m.insert("scenario".into(), json!(scenario));
        m.insert("keys".into(), json!(self.args.keys));
        m.insert("value_bytes".into(), json!(self.args.value_bytes));
        m.insert("etcd_version".into(), json!(self.version));
        m.insert("runs".into(), json!(self.args.runs));
        m.insert(
            "processing".into(),
            json!(format!("{:?}", self.args.processing)),
        );
        m
    }

    async fn current_revision(&self) -> i64 {
        let mut c = self.writer.clone();
        let resp = c
            .get(
                self.prefix.as_bytes(),
                Some(GetOptions::new().with_limit(1).with_keys_only()),
            )
            .await
            .unwrap_or_else(|e| fail(format!("get: {e}")));
        resp.header().map_or(0, |h| h.revision())
    }

    /// Loads the N keys with concurrent transactions of 128 puts.
    async fn load(&self) {
        let started = Instant::now();
        let next = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..LOADERS {
            let next = next.clone();
            let mut client = self.writer.clone();
            let prefix = self.prefix.clone();
            let (n, size) = (self.args.keys, self.args.value_bytes);
            tasks.push(tokio::spawn(async move {
                loop {
                    let first = next.fetch_add(TXN_OPS, Ordering::Relaxed);
                    if first >= n {
                        return;
                    }
                    let ops: Vec<TxnOp> = (first..(first + TXN_OPS).min(n))
                        .map(|i| TxnOp::put(full_key(&prefix, i), make_value(i, 0, size), None))
                        .collect();
                    client
                        .txn(Txn::new().and_then(ops))
                        .await
                        .unwrap_or_else(|e| fail(format!("loading keys: {e}")));
                }
            }));
        }
        for t in tasks {
            t.await.unwrap_or_else(|e| fail(e));
        }
        let sample = make_value(0, 0, self.args.value_bytes).len();
        eprintln!(
            "loaded {} keys (values of {} bytes) in {:.1} s",
            self.args.keys,
            sample,
            started.elapsed().as_secs_f64()
        );
    }

    /// `m` puts of existing keys by W concurrent writers, as fast as etcd takes them. Returns
    /// when the first put was sent and how long all took.
    async fn write_updates(&self, m: usize) -> (Instant, Duration) {
        let (seq0, key0) = self.reserve(m);
        let writers = self.args.writers;
        let started = Instant::now();
        let mut tasks = Vec::new();
        for w in 0..writers {
            let mut client = self.writer.clone();
            let prefix = self.prefix.clone();
            let (n, size) = (self.args.keys, self.args.value_bytes);
            tasks.push(tokio::spawn(async move {
                for j in (w..m).step_by(writers) {
                    let i = (key0 + j) % n;
                    client
                        .put(
                            full_key(&prefix, i),
                            make_value(i, seq0 + j as u64, size),
                            None,
                        )
                        .await
                        .unwrap_or_else(|e| fail(format!("put: {e}")));
                }
            }));
        }
        for t in tasks {
            t.await.unwrap_or_else(|e| fail(e));
        }
        (started, started.elapsed())
    }

    /// A raw watch of the prefix from `revision + 1` feeding `sink` with decoded values.
    async fn raw_watch(&self, revision: i64, prev_kv: bool, sink: Arc<Sink>) -> AbortOnDrop<()> {
        let client = self.raw_client().await;
        let mut options = WatchOptions::new()
            .with_range(prefix_range_end(self.prefix.as_bytes()))
            .with_start_revision(revision + 1);
        if prev_kv {
            options = options.with_prev_key();
        }
        let mut stream = client
            .watch_client()
            .max_decoding_message_size(MAX_MESSAGE)
            .watch(self.prefix.as_bytes(), Some(options))
            .await
            .unwrap_or_else(|e| fail(format!("watch: {e}")));
        AbortOnDrop(tokio::spawn(async move {
            let _client = client;
            loop {
                match stream.message().await {
                    Ok(Some(resp)) => {
                        for event in resp.events() {
                            let Some(kv) = event.kv() else { continue };
                            match serde_json::from_slice::<ConfigMap>(kv.value()) {
                                Ok(cm) => sink.record(&cm),
                                Err(_) => {
                                    sink.bad.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        }
                    }
                    Ok(None) => fail("the raw watch ended"),
                    Err(e) => fail(format!("the raw watch failed: {e}")),
                }
            }
        }))
    }

    /// A synced informer at the default page size with `handlers` handlers feeding `sinks`.
    async fn synced_informer(&self, sinks: &[Arc<Sink>]) -> RunningInformer {
        let client = self.informer_client().await;
        let informer = self.informer(client, self.args.page_size);
        let mut registrations = Vec::new();
        for sink in sinks {
            let (a, u) = (sink.clone(), sink.clone());
            let handler = ResourceEventHandlerFuncs::new()
                .on_add(move |o, initial| {
                    if !initial {
                        a.record(&o.value)
                    }
                })
                .on_update(move |_, new| u.record(&new.value));
            registrations.push(
                informer
                    .add_event_handler(handler)
                    .unwrap_or_else(|e| fail(e)),
            );
        }
        let task = tokio::spawn(informer.clone().run());
        let deadline = Duration::from_secs(600);
        let synced = tokio::time::timeout(deadline, async {
            while !(informer.has_synced() && registrations.iter().all(|r| r.has_synced())) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await;
        if synced.is_err() {
            fail(format!("the informer did not sync within {deadline:?}"));
        }
        RunningInformer {
            informer,
            registrations,
            task,
        }
    }
}

struct RunningInformer {
    informer: SharedIndexInformer<ConfigMap>,
    registrations: Vec<HandlerRegistration<ConfigMap>>,
    task: tokio::task::JoinHandle<()>,
}

impl RunningInformer {
    /// Stops the informer and frees its cache before returning, so that tearing it down does not
    /// overlap the next measurement.
    async fn shutdown(self) {
        stop_informer(self.informer, self.task).await;
        drop(self.registrations);
    }
}

async fn stop_informer(
    informer: SharedIndexInformer<ConfigMap>,
    task: tokio::task::JoinHandle<()>,
) {
    informer.stop();
    task.abort();
    let _ = task.await;
    // The reflector task (aborted with `run`) is dropped later on a worker thread and would free
    // the cache then, in the middle of the next measurement: empty the cache here instead.
    informer.indexer().replace(Vec::new());
    drop(informer);
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// A paged range read of the prefix at one revision, decoded into a map (the raw baseline).
/// `page` 0 reads everything in one response.
async fn raw_list(
    client: &Client,
    prefix: &str,
    page: i64,
) -> Res<(HashMap<String, Arc<ConfigMap>>, i64)> {
    let mut kv = client.kv_client().max_decoding_message_size(MAX_MESSAGE);
    let end = prefix_range_end(prefix.as_bytes());
    let mut map = HashMap::new();
    let mut revision = 0;
    let mut start = prefix.as_bytes().to_vec();
    loop {
        let mut options = GetOptions::new().with_range(end.clone()).with_limit(page);
        if revision != 0 {
            options = options.with_revision(revision);
        }
        let resp = kv.get(start.clone(), Some(options)).await?;
        if revision == 0 {
            revision = resp.header().map_or(0, |h| h.revision());
        }
        for kv in resp.kvs() {
            let cm: ConfigMap = serde_json::from_slice(kv.value())?;
            let key = std::str::from_utf8(&kv.key()[prefix.len()..])?.to_owned();
            map.insert(key, Arc::new(cm));
        }
        if !resp.more() {
            break;
        }
        let Some(last) = resp.kvs().last() else {
            return Err("more keys follow an empty page".into());
        };
        start = last.key().to_vec();
        start.push(0);
    }
    Ok((map, revision))
}

fn page_label(page: i64) -> String {
    if page == 0 || page >= HUGE_PAGE {
        "unpaged".to_owned()
    } else {
        page.to_string()
    }
}

// ---------------------------------------------------------------------------------------------
// Scenarios

/// One scenario's result, for the final table.
struct Row {
    scenario: String,
    baseline: f64,
    informer: f64,
    ratio: f64,
    unit: String,
    target: String,
    met: Option<bool>,
}

fn emit(mut line: serde_json::Map<String, Value>, row: &Row, lower_is_better: bool) -> Row {
    line.insert("baseline".into(), json!(round(row.baseline, 4)));
    line.insert("informer".into(), json!(round(row.informer, 4)));
    line.insert("ratio".into(), json!(round(row.ratio, 3)));
    line.insert("unit".into(), json!(row.unit));
    line.insert("lower_is_better".into(), json!(lower_is_better));
    line.insert("target".into(), json!(row.target));
    line.insert("target_met".into(), json!(row.met));
    println!("{}", Value::Object(line));
    Row {
        scenario: row.scenario.clone(),
        baseline: row.baseline,
        informer: row.informer,
        ratio: row.ratio,
        unit: row.unit.clone(),
        target: row.target.clone(),
        met: row.met,
    }
}

async fn scenario_sync(b: &Bench) -> Row {
    let n = b.args.keys;
    let baseline_pages: Vec<i64> = vec![10_000, 50_000, 0];
    let mut informer_pages: Vec<i64> = Vec::new();
    for p in [b.args.page_size, 5_000, 10_000, 50_000, 100_000, HUGE_PAGE] {
        if !informer_pages.contains(&p) {
            informer_pages.push(p);
        }
    }
    let mut base_times: BTreeMap<i64, Vec<f64>> = BTreeMap::new();
    let mut inf_times: BTreeMap<i64, Vec<f64>> = BTreeMap::new();
    let mut list_only = Vec::new();
    for run in 0..b.args.runs {
        {
            // The informer's list alone (fetch + decode, no cache), to split its sync time.
            let client = b.informer_client().await;
            let lw = EtcdListerWatcher::with_options(
                client,
                b.prefix.clone(),
                JsonCodec::<ConfigMap>::new(),
                EtcdOptions {
                    page_size: b.args.page_size,
                    ..EtcdOptions::default()
                },
            )
            .unwrap_or_else(|e| fail(e));
            let started = Instant::now();
            let list = lw
                .list()
                .await
                .unwrap_or_else(|e| fail(format!("list: {e}")));
            let secs = started.elapsed().as_secs_f64();
            if list.items.len() != n {
                fail(format!(
                    "list found {} keys, expected {n}",
                    list.items.len()
                ));
            }
            drop(list);
            eprintln!(
                "sync run {run}: EtcdListerWatcher::list alone, page {}: {secs:.3} s",
                page_label(b.args.page_size)
            );
            list_only.push(secs);
        }
        for &page in &baseline_pages {
            let client = b.raw_client().await;
            let started = Instant::now();
            let (map, _) = raw_list(&client, &b.prefix, page)
                .await
                .unwrap_or_else(|e| fail(format!("raw list: {e}")));
            let secs = started.elapsed().as_secs_f64();
            if map.len() != n {
                fail(format!("raw list found {} keys, expected {n}", map.len()));
            }
            drop(map);
            eprintln!(
                "sync run {run}: raw page {:>8}: {secs:.3} s",
                page_label(page)
            );
            base_times.entry(page).or_default().push(secs);
        }
        for &page in &informer_pages {
            let client = b.informer_client().await;
            let informer = b.informer(client, page);
            let started = Instant::now();
            let task = tokio::spawn(informer.clone().run());
            while !informer.has_synced() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let secs = started.elapsed().as_secs_f64();
            let cached = informer.indexer().len();
            stop_informer(informer, task).await;
            if cached != n {
                fail(format!("the informer cached {cached} keys, expected {n}"));
            }
            eprintln!(
                "sync run {run}: informer page {:>8}: {secs:.3} s",
                page_label(page)
            );
            inf_times.entry(page).or_default().push(secs);
        }
    }
    let base_med: BTreeMap<i64, f64> = base_times.iter().map(|(p, v)| (*p, median(v))).collect();
    let inf_med: BTreeMap<i64, f64> = inf_times.iter().map(|(p, v)| (*p, median(v))).collect();
    let (best_page, baseline) = base_med
        .iter()
        .min_by(|a, b| a.1.total_cmp(b.1))
        .map(|(p, t)| (*p, *t))
        .unwrap_or((0, f64::NAN));
    let informer = inf_med[&b.args.page_size];
    let (inf_best_page, inf_best) = inf_med
        .iter()
        .min_by(|a, b| a.1.total_cmp(b.1))
        .map(|(p, t)| (*p, *t))
        .unwrap_or((0, f64::NAN));
    let ratio = informer / baseline;
    let by = |m: &BTreeMap<i64, f64>| -> Value {
        Value::Object(
            m.iter()
                .map(|(p, t)| (page_label(*p), json!(round(*t, 4))))
                .collect(),
        )
    };
    let runs = |m: &BTreeMap<i64, Vec<f64>>| -> Value {
        Value::Object(
            m.iter()
                .map(|(p, t)| {
                    (
                        page_label(*p),
                        json!(t.iter().map(|x| round(*x, 4)).collect::<Vec<_>>()),
                    )
                })
                .collect(),
        )
    };
    let mut line = b.base_json("sync");
    line.insert("informer_page_size".into(), json!(b.args.page_size));
    line.insert("baseline_best_page".into(), json!(page_label(best_page)));
    line.insert("baseline_s_by_page".into(), by(&base_med));
    line.insert("informer_s_by_page".into(), by(&inf_med));
    line.insert(
        "informer_ratio_by_page".into(),
        Value::Object(
            inf_med
                .iter()
                .map(|(p, t)| (page_label(*p), json!(round(t / baseline, 3))))
                .collect(),
        ),
    );
    line.insert(
        "informer_best_page".into(),
        json!(page_label(inf_best_page)),
    );
    line.insert(
        "informer_best_ratio".into(),
        json!(round(inf_best / baseline, 3)),
    );
    line.insert(
        "informer_list_only_s".into(),
        json!(round(median(&list_only), 4)),
    );
    line.insert(
        "informer_cache_pipeline_s".into(),
        json!(round(informer - median(&list_only), 4)),
    );
    line.insert("baseline_runs".into(), runs(&base_times));
    line.insert("informer_runs".into(), runs(&inf_times));
    let row = Row {
        scenario: "sync".into(),
        baseline,
        informer,
        ratio,
        unit: "s".into(),
        target: "<= 1.25x raw best".into(),
        met: Some(ratio <= 1.25),
    };
    emit(line, &row, true)
}

/// One side of one watch run.
struct WatchRun {
    /// Events/s reaching the consumer (the last handler).
    rate: f64,
    /// Writes/s etcd took meanwhile.
    writes: f64,
    /// CPU µs per event of this process (consumer + writers) and of etcd.
    own_cpu_us: f64,
    etcd_cpu_us: f64,
}

/// A raw watch under the write load.
async fn watch_baseline_once(b: &Bench, deadline: Duration) -> WatchRun {
    let m = b.args.events;
    let revision = b.current_revision().await;
    let sink = Sink::new(m, 0, false, Instant::now());
    let _watch = b.raw_watch(revision, false, sink.clone()).await;
    let cpu = CpuMark::now(b.etcd_pid);
    let (started, took) = b.write_updates(m).await;
    let done = sink.wait("raw watch", deadline).await;
    let (own_cpu_us, etcd_cpu_us) = cpu.per_event(b.etcd_pid, m);
    tokio::time::sleep(Duration::from_millis(50)).await;
    if sink.count() != m {
        fail(format!("raw watch: {} events, expected {m}", sink.count()));
    }
    WatchRun {
        rate: m as f64 / done.duration_since(started).as_secs_f64(),
        writes: m as f64 / took.as_secs_f64(),
        own_cpu_us,
        etcd_cpu_us,
    }
}

/// An informer with `handlers` handlers under the write load; the rate is the one at which the
/// last handler saw every event.
async fn watch_informer_once(b: &Bench, handlers: usize, deadline: Duration) -> WatchRun {
    let m = b.args.events;
    let sinks: Vec<Arc<Sink>> = (0..handlers)
        .map(|_| Sink::new(m, 0, false, Instant::now()))
        .collect();
    let running = b.synced_informer(&sinks).await;
    let cpu = CpuMark::now(b.etcd_pid);
    let (started, took) = b.write_updates(m).await;
    let mut last = started;
    for (h, sink) in sinks.iter().enumerate() {
        last = last.max(sink.wait(&format!("informer handler {h}"), deadline).await);
    }
    let (own_cpu_us, etcd_cpu_us) = cpu.per_event(b.etcd_pid, m);
    tokio::time::sleep(Duration::from_millis(50)).await;
    for (h, sink) in sinks.iter().enumerate() {
        if sink.count() != m {
            fail(format!(
                "informer handler {h}: {} events, expected {m}",
                sink.count()
            ));
        }
    }
    running.shutdown().await;
    WatchRun {
        rate: m as f64 / last.duration_since(started).as_secs_f64(),
        writes: m as f64 / took.as_secs_f64(),
        own_cpu_us,
        etcd_cpu_us,
    }
}

async fn scenario_watch(b: &Bench, name: &str, handlers: usize) -> Row {
    let m = b.args.events;
    let deadline = Duration::from_secs(60 + (m / 1000) as u64);
    let (mut base, mut inf, mut base_w, mut inf_w) = (vec![], vec![], vec![], vec![]);
    let (mut base_cpu, mut inf_cpu, mut base_etcd, mut inf_etcd) = (vec![], vec![], vec![], vec![]);
    for run in 0..b.args.runs {
        let r = watch_baseline_once(b, deadline).await;
        eprintln!(
            "{name} run {run}: raw watch {:.0} events/s (writes {:.0}/s; CPU/event: bench {:.1} us, etcd {:.1} us)",
            r.rate, r.writes, r.own_cpu_us, r.etcd_cpu_us
        );
        base.push(r.rate);
        base_w.push(r.writes);
        base_cpu.push(r.own_cpu_us);
        base_etcd.push(r.etcd_cpu_us);
        let r = watch_informer_once(b, handlers, deadline).await;
        eprintln!(
            "{name} run {run}: informer ({handlers} handler(s)) {:.0} events/s (writes {:.0}/s; CPU/event: bench {:.1} us, etcd {:.1} us)",
            r.rate, r.writes, r.own_cpu_us, r.etcd_cpu_us
        );
        inf.push(r.rate);
        inf_w.push(r.writes);
        inf_cpu.push(r.own_cpu_us);
        inf_etcd.push(r.etcd_cpu_us);
    }
    let (baseline, informer) = (median(&base), median(&inf));
    let ratio = informer / baseline;
    let r0 = |v: &[f64]| v.iter().map(|x| x.round()).collect::<Vec<_>>();
    let mut line = b.base_json(name);
    line.insert("events".into(), json!(m));
    line.insert("handlers".into(), json!(handlers));
    line.insert("writers".into(), json!(b.args.writers));
    line.insert("baseline_runs".into(), json!(r0(&base)));
    line.insert("informer_runs".into(), json!(r0(&inf)));
    line.insert(
        "per_run_ratios".into(),
        json!(base
            .iter()
            .zip(&inf)
            .map(|(b, i)| round(i / b, 3))
            .collect::<Vec<_>>()),
    );
    line.insert(
        "baseline_writes_per_s".into(),
        json!(median(&base_w).round()),
    );
    line.insert(
        "informer_writes_per_s".into(),
        json!(median(&inf_w).round()),
    );
    for (field, v) in [
        ("baseline_bench_cpu_us_per_event", &base_cpu),
        ("informer_bench_cpu_us_per_event", &inf_cpu),
        ("baseline_etcd_cpu_us_per_event", &base_etcd),
        ("informer_etcd_cpu_us_per_event", &inf_etcd),
    ] {
        line.insert(field.into(), json!(round(median(v), 1)));
    }
    let need = if handlers > 1 { 0.9 } else { 0.95 };
    let row = Row {
        scenario: name.into(),
        baseline,
        informer,
        ratio,
        unit: "events/s".into(),
        target: format!(">= {need}x raw"),
        met: Some(ratio >= need),
    };
    emit(line, &row, false)
}

/// Latencies (µs) of K paced puts reaching `sink`.
async fn paced_puts(b: &Bench, sink: &Sink, seq0: u64, key0: usize) -> Vec<f64> {
    let k = b.args.latency_puts;
    let mut sent = vec![0u64; k];
    let mut client = b.writer.clone();
    let mut tick = tokio::time::interval(Duration::from_nanos(1_000_000_000 / b.args.latency_rate));
    for (j, slot) in sent.iter_mut().enumerate() {
        tick.tick().await;
        let i = (key0 + j) % b.args.keys;
        let value = make_value(i, seq0 + j as u64, b.args.value_bytes);
        let key = full_key(&b.prefix, i);
        *slot = Instant::now().duration_since(sink.base).as_nanos() as u64;
        client
            .put(key, value, None)
            .await
            .unwrap_or_else(|e| fail(format!("put: {e}")));
    }
    sink.wait("latency", Duration::from_secs(60)).await;
    let mut lat: Vec<f64> = sent
        .iter()
        .zip(&sink.arrivals)
        .map(|(s, a)| (a.load(Ordering::Relaxed) as f64 - *s as f64) / 1000.0)
        .collect();
    lat.sort_by(f64::total_cmp);
    lat
}

async fn scenario_latency(b: &Bench) -> Row {
    let k = b.args.latency_puts;
    let (mut b50, mut b99, mut i50, mut i99, mut bmax, mut imax) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    for run in 0..b.args.runs {
        {
            let (seq0, key0) = b.reserve(k);
            let revision = b.current_revision().await;
            let sink = Sink::new(k, seq0, true, Instant::now());
            let _watch = b.raw_watch(revision, false, sink.clone()).await;
            let lat = paced_puts(b, &sink, seq0, key0).await;
            let (p50, p99) = (percentile(&lat, 50.0), percentile(&lat, 99.0));
            eprintln!(
                "latency run {run}: raw watch p50 {:.3} ms p99 {:.3} ms",
                p50 / 1e3,
                p99 / 1e3
            );
            b50.push(p50);
            b99.push(p99);
            bmax.push(lat[lat.len() - 1]);
        }
        {
            let (seq0, key0) = b.reserve(k);
            let sink = Sink::new(k, seq0, true, Instant::now());
            let running = b.synced_informer(std::slice::from_ref(&sink)).await;
            let lat = paced_puts(b, &sink, seq0, key0).await;
            running.shutdown().await;
            let (p50, p99) = (percentile(&lat, 50.0), percentile(&lat, 99.0));
            eprintln!(
                "latency run {run}: informer p50 {:.3} ms p99 {:.3} ms",
                p50 / 1e3,
                p99 / 1e3
            );
            i50.push(p50);
            i99.push(p99);
            imax.push(lat[lat.len() - 1]);
        }
    }
    let ms = |v: &[f64]| round(median(v) / 1e3, 4);
    let (baseline, informer) = (median(&b99) / 1e3, median(&i99) / 1e3);
    let diff = informer - baseline;
    let mut line = b.base_json("latency");
    line.insert("puts".into(), json!(k));
    line.insert("puts_per_s".into(), json!(b.args.latency_rate));
    line.insert("baseline_p50_ms".into(), json!(ms(&b50)));
    line.insert("informer_p50_ms".into(), json!(ms(&i50)));
    line.insert("baseline_p99_ms".into(), json!(ms(&b99)));
    line.insert("informer_p99_ms".into(), json!(ms(&i99)));
    line.insert("baseline_max_ms".into(), json!(ms(&bmax)));
    line.insert("informer_max_ms".into(), json!(ms(&imax)));
    line.insert("p99_diff_ms".into(), json!(round(diff, 4)));
    let r3 = |v: &[f64]| v.iter().map(|x| round(x / 1e3, 3)).collect::<Vec<_>>();
    line.insert("baseline_p99_runs_ms".into(), json!(r3(&b99)));
    line.insert("informer_p99_runs_ms".into(), json!(r3(&i99)));
    let row = Row {
        scenario: "latency".into(),
        baseline,
        informer,
        ratio: informer / baseline,
        unit: "ms p99".into(),
        target: "p99 <= raw p99 + 0.5 ms".into(),
        met: Some(diff <= 0.5),
    };
    emit(line, &row, true)
}

/// Runs a memory child; returns its JSON report.
async fn memory_child(b: &Bench, kind: &str, handlers: usize) -> Value {
    let exe = std::env::current_exe().unwrap_or_else(|e| fail(e));
    let output = tokio::process::Command::new(exe)
        .arg("--child")
        .arg(kind)
        .arg("--endpoints")
        .arg(b.endpoints.join(","))
        .arg("--prefix")
        .arg(&b.prefix)
        .arg("--keys")
        .arg(b.args.keys.to_string())
        .arg("--page-size")
        .arg(b.args.page_size.to_string())
        .arg("--handlers")
        .arg(handlers.to_string())
        .arg("--processing")
        .arg(match b.args.processing {
            Processing::DeltaFifo => "delta-fifo",
            _ => "atomic",
        })
        .stderr(std::process::Stdio::inherit())
        .output()
        .await
        .unwrap_or_else(|e| fail(format!("running the {kind} child: {e}")));
    if !output.status.success() {
        fail(format!("the {kind} child failed: {}", output.status));
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| fail(format!("the {kind} child printed no report")));
    serde_json::from_str(line).unwrap_or_else(|e| fail(format!("{kind} child report: {e}")))
}

async fn scenario_memory(b: &Bench) -> Row {
    let n = b.args.keys as f64;
    let per = |v: &Value, field: &str| -> f64 {
        let before = v["rss_before"].as_f64().unwrap_or(f64::NAN);
        (v[field].as_f64().unwrap_or(f64::NAN) - before) / n
    };
    let h = b.args.handlers;
    let mut cols: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for run in 0..b.args.runs {
        let raw = memory_child(b, "memory-raw", 0).await;
        let inf = memory_child(b, "memory-informer", 0).await;
        let infh = memory_child(b, "memory-informer", h).await;
        for (name, v) in [("raw", &raw), ("informer", &inf), ("informer_h", &infh)] {
            cols.entry(name).or_default().push(per(v, "rss_trimmed"));
            let untrimmed: &'static str = match name {
                "raw" => "raw_untrimmed",
                "informer" => "informer_untrimmed",
                _ => "informer_h_untrimmed",
            };
            cols.entry(untrimmed).or_default().push(per(v, "rss_after"));
        }
        eprintln!(
            "memory run {run}: raw {:.0} B/object ({:.0} untrimmed), informer {:.0} ({:.0}), with {h} handlers {:.0} ({:.0})",
            per(&raw, "rss_trimmed"),
            per(&raw, "rss_after"),
            per(&inf, "rss_trimmed"),
            per(&inf, "rss_after"),
            per(&infh, "rss_trimmed"),
            per(&infh, "rss_after"),
        );
    }
    let med = |k: &str| median(cols.get(k).map_or(&[][..], |v| &v[..]));
    let (baseline, informer) = (med("raw"), med("informer"));
    let mut line = b.base_json("memory");
    line.insert("page_size".into(), json!(b.args.page_size));
    line.insert("handlers".into(), json!(h));
    line.insert(
        "informer_with_handlers_b_per_object".into(),
        json!(med("informer_h").round()),
    );
    line.insert(
        "ratio_with_handlers".into(),
        json!(round(med("informer_h") / baseline, 3)),
    );
    line.insert(
        "baseline_untrimmed_b_per_object".into(),
        json!(med("raw_untrimmed").round()),
    );
    line.insert(
        "informer_untrimmed_b_per_object".into(),
        json!(med("informer_untrimmed").round()),
    );
    line.insert(
        "informer_with_handlers_untrimmed_b_per_object".into(),
        json!(med("informer_h_untrimmed").round()),
    );
    line.insert(
        "ratio_untrimmed".into(),
        json!(round(med("informer_untrimmed") / med("raw_untrimmed"), 3)),
    );
    let ratio = informer / baseline;
    let row = Row {
        scenario: "memory".into(),
        baseline,
        informer,
        ratio,
        unit: "B/object".into(),
        target: "<= 1.2x raw".into(),
        met: Some(ratio <= 1.2),
    };
    emit(line, &row, true)
}

/// Puts per prevkv measurement: a quarter of `--events` (prev_kv writes are slow).
fn prevkv_events(b: &Bench) -> usize {
    (b.args.events / 4).max(1)
}

/// etcd's write rate with a raw watch open on the prefix, with or without prev_kv.
async fn writes_with_watch(b: &Bench, prev_kv: bool) -> f64 {
    let m = prevkv_events(b);
    let revision = b.current_revision().await;
    let sink = Sink::new(m, 0, false, Instant::now());
    let _watch = b.raw_watch(revision, prev_kv, sink.clone()).await;
    let (_, took) = b.write_updates(m).await;
    sink.wait(
        if prev_kv { "prev_kv watch" } else { "watch" },
        Duration::from_secs(120),
    )
    .await;
    m as f64 / took.as_secs_f64()
}

async fn scenario_prevkv(b: &Bench) -> Row {
    let (mut without, mut with) = (vec![], vec![]);
    for run in 0..b.args.runs {
        let w = writes_with_watch(b, false).await;
        let p = writes_with_watch(b, true).await;
        eprintln!(
            "prevkv run {run}: writes/s with a plain watch {w:.0}, with a prev_kv watch {p:.0}"
        );
        without.push(w);
        with.push(p);
    }
    let (baseline, informer) = (median(&without), median(&with));
    let mut line = b.base_json("prevkv");
    line.insert("events".into(), json!(prevkv_events(b)));
    line.insert("writers".into(), json!(b.args.writers));
    line.insert(
        "note".into(),
        json!("baseline: etcd writes/s with a plain watch; informer column: with a prev_kv watch"),
    );
    line.insert(
        "without_prev_kv_runs".into(),
        json!(without.iter().map(|x| x.round()).collect::<Vec<_>>()),
    );
    line.insert(
        "with_prev_kv_runs".into(),
        json!(with.iter().map(|x| x.round()).collect::<Vec<_>>()),
    );
    let row = Row {
        scenario: "prevkv".into(),
        baseline,
        informer,
        ratio: informer / baseline,
        unit: "writes/s".into(),
        target: "(informational)".into(),
        met: None,
    };
    emit(line, &row, false)
}

// ---------------------------------------------------------------------------------------------
// Memory child processes

async fn run_child(args: &Args, kind: &str) -> Res<()> {
    let prefix = args.prefix.clone().ok_or("--prefix is required")?;
    let endpoints = args.endpoints.clone();
    let n = args.keys;
    let client = match kind {
        "memory-raw" => Client::connect(&endpoints, None).await?,
        _ => etcd_informer::connect(&endpoints).await?,
    };
    // Warm the connection up so that its buffers are counted before, not after.
    client
        .kv_client()
        .get(
            prefix.as_bytes(),
            Some(GetOptions::new().with_limit(1).with_keys_only()),
        )
        .await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let rss_before = rss_bytes();
    let report = |objects: usize| -> Value {
        let rss_after = rss_bytes();
        trim_malloc();
        let rss_trimmed = rss_bytes();
        json!({
            "kind": kind,
            "objects": objects,
            "rss_before": rss_before,
            "rss_after": rss_after,
            "rss_trimmed": rss_trimmed,
        })
    };
    let line = match kind {
        "memory-raw" => {
            let (map, _) = raw_list(&client, &prefix, args.page_size).await?;
            tokio::time::sleep(Duration::from_millis(200)).await;
            let line = report(map.len());
            std::mem::forget(map);
            line
        }
        "memory-informer" => {
            let lw = EtcdListerWatcher::with_options(
                client.clone(),
                prefix.clone(),
                JsonCodec::<ConfigMap>::new(),
                EtcdOptions {
                    page_size: args.page_size,
                    ..EtcdOptions::default()
                },
            )?;
            let options = InformerOptions {
                processing: args.processing,
                ..InformerOptions::default()
            };
            let informer = SharedIndexInformer::new(lw, options);
            let seen = Arc::new(AtomicUsize::new(0));
            let mut registrations = Vec::new();
            for _ in 0..args.handlers {
                let seen = seen.clone();
                registrations.push(informer.add_event_handler(
                    ResourceEventHandlerFuncs::new().on_add(move |_, _| {
                        seen.fetch_add(1, Ordering::Relaxed);
                    }),
                )?);
            }
            let task = tokio::spawn(informer.clone().run());
            while !(informer.has_synced() && registrations.iter().all(|r| r.has_synced())) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            let objects = informer.indexer().list_keys().len();
            if seen.load(Ordering::Relaxed) != objects * args.handlers {
                return Err("a handler missed initial adds".into());
            }
            let line = report(objects);
            std::mem::forget(task);
            std::mem::forget(registrations);
            std::mem::forget(informer);
            line
        }
        other => return Err(format!("unknown child {other}").into()),
    };
    if line["objects"].as_u64() != Some(n as u64) {
        return Err(format!("child cached {} objects, expected {n}", line["objects"]).into());
    }
    println!("{line}");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Main

fn print_table(rows: &[Row]) {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n| scenario | raw baseline | informer | ratio | unit | target | met |"
    );
    let _ = writeln!(out, "| --- | ---: | ---: | ---: | --- | --- | --- |");
    for r in rows {
        let fmt = |x: f64| {
            if x.abs() >= 100.0 {
                format!("{x:.0}")
            } else {
                format!("{x:.3}")
            }
        };
        let met = match r.met {
            Some(true) => "yes",
            Some(false) => "NO",
            None => "-",
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.3} | {} | {} | {} |",
            r.scenario,
            fmt(r.baseline),
            fmt(r.informer),
            r.ratio,
            r.unit,
            r.target,
            met
        );
    }
    print!("{out}");
}

async fn connect_writer(endpoints: &[String]) -> Client {
    let started = Instant::now();
    loop {
        match Client::connect(endpoints, None).await {
            Ok(mut c) => {
                if c.status().await.is_ok() {
                    return c;
                }
            }
            Err(e) if started.elapsed() > Duration::from_secs(10) => {
                fail(format!("cannot reach etcd at {}: {e}", endpoints.join(",")))
            }
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::main]
async fn main() {
    let args = parse_args();
    if let Some(kind) = args.child.clone() {
        if let Err(e) = run_child(&args, &kind).await {
            fail(format!("child {kind}: {e}"));
        }
        std::process::exit(0);
    }

    // etcd: ETCD_ENDPOINTS, else a throwaway server on /dev/shm.
    let external: Option<Vec<String>> = std::env::var("ETCD_ENDPOINTS").ok().map(|l| {
        l.split(',')
            .map(|e| e.trim().to_owned())
            .filter(|e| !e.is_empty())
            .collect()
    });
    let mut server = None;
    let endpoints = match external.filter(|e| !e.is_empty()) {
        Some(e) => e,
        None => {
            let data_root = if std::path::Path::new("/dev/shm").is_dir() {
                Some("/dev/shm".into())
            } else {
                None
            };
            let s = EtcdServer::start_with(ServerOptions {
                data_root,
                extra_args: vec!["--quota-backend-bytes=8589934592".into()],
            })
            .await
            .unwrap_or_else(|e| fail(format!("starting etcd: {e}")));
            let endpoints = s.endpoints();
            if let Some(dir) = s.data_dir().parent() {
                let _ = ETCD_DIR.set(dir.to_path_buf());
            }
            eprintln!(
                "started etcd at {} (data in {})",
                s.endpoint(),
                s.data_dir().display()
            );
            server = Some(s);
            endpoints
        }
    };
    let mut writer = connect_writer(&endpoints).await;
    let version = writer
        .status()
        .await
        .map(|s| s.version().to_owned())
        .unwrap_or_else(|e| fail(format!("status: {e}")));
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let prefix = format!("/etcd-informer-bench/{}-{nanos}/", std::process::id());
    eprintln!(
        "etcd {version}; prefix {prefix}; {} keys of ~{} bytes; scenarios {}",
        args.keys,
        args.value_bytes,
        args.scenarios.join(",")
    );
    let bench = Bench {
        args: args.clone(),
        endpoints,
        etcd_pid: server.as_ref().and_then(EtcdServer::pid),
        prefix,
        writer,
        version,
        next_seq: AtomicU64::new(1),
        next_key: AtomicUsize::new(0),
    };
    bench.load().await;

    let started = Instant::now();
    let mut rows = Vec::new();
    for s in ALL_SCENARIOS {
        if !args.scenarios.iter().any(|x| x == s) {
            continue;
        }
        let t = Instant::now();
        let row = match s {
            "sync" => scenario_sync(&bench).await,
            "watch" => scenario_watch(&bench, "watch", 1).await,
            "fanout" => scenario_watch(&bench, "fanout", args.handlers).await,
            "latency" => scenario_latency(&bench).await,
            "memory" => scenario_memory(&bench).await,
            "prevkv" => scenario_prevkv(&bench).await,
            _ => unreachable!(),
        };
        eprintln!("{s} took {:.1} s", t.elapsed().as_secs_f64());
        rows.push(row);
    }
    print_table(&rows);
    eprintln!(
        "scenarios took {:.1} s in all",
        started.elapsed().as_secs_f64()
    );
    if server.is_none() {
        let mut c = bench.writer.clone();
        let _ = c
            .delete(
                bench.prefix.as_bytes(),
                Some(etcd_client::DeleteOptions::new().with_prefix()),
            )
            .await;
    }
    drop(server.take());
    // Skip dropping large caches and runtimes: exit now.
    std::process::exit(0);
}
