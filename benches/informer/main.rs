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
//! on `/dev/shm`, or uses `--endpoints A,B` (else `ETCD_ENDPOINTS`) if given (under a unique prefix it deletes afterwards).
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
//!   Before each side's sync the free heap is given back (`malloc_trim(0)`), so that no side
//!   reuses memory the previous one freed and skips its page faults; each line on stderr shows
//!   the side's minor page faults.
//! - `watch`: W writers put M updates of existing keys (one update per key) as fast as etcd takes
//!   them; the time from the first put until every update has reached (a) a raw etcd watch of the
//!   prefix that decodes each event (baseline) or (b) the single handler of a synced informer.
//!   Reported in events/s (higher is better). The sides run one after the other under the same
//!   write load; a missing event fails the benchmark. Details: the write rate etcd sustained and
//!   the CPU time per event of this process (consumer plus writers) and of etcd (when we started
//!   it), which shows what the consumer costs on a machine where it shares the cores with etcd.
//!   The target's CPU figure is the consumer's alone: the writers run on their own threads, left
//!   out, and the other threads' scheduler run times (nanoseconds, `/proc/self/task/*/schedstat`)
//!   are summed, with their voluntary context switches per event as the wake-up count.
//!   `benches/ab BASE --rounds N ...` runs this bench for BASE and for the working tree in one
//!   invocation, alternating, and tabulates both.
//! - `fanout`: the same with H handlers on one shared informer; the informer's figure is the rate
//!   at which the LAST handler has seen all M events. Every handler must see every event.
//! - `runner`: a controller's event. The consumer's CPU per event (every thread but the
//!   writers') of the raw watch (baseline), and of an informer with a `Runner` over it whose
//!   workers run on the writers' threads (the informer column: from etcd's response to the key
//!   in the runner's queue; target raw + 3 us); and the same with the workers counted (to the
//!   reconcile, which looks the object up; reported). The initial list's reconciles are done
//!   before the writes start. Beside them, the floor: a controller written by hand over the
//!   raw watch (a map of the prefix, each key down a channel to a worker on the writers'
//!   threads), what any cache with a queue costs beyond the raw watch.
//! - `latency`: K sequential puts paced at a fixed rate; latency from just before each put to
//!   the handler (or the raw watch) receiving that value, matched by a sequence number in the
//!   value. p50 and p99; the ratio is on p99, and `p99_diff_ms` is informer p99 - raw p99.
//! - `ryw` (read your own writes): K puts one after another, each followed by
//!   `wait_for_revision` with the revision the put returned; from just before the put to the
//!   wait's return, beside the same put's arrival at the informer's handler (the cache held it
//!   by then). The ratio is on p50: what the wait adds to the moment the cache could answer.
//!   Then K/10 puts outside the prefix, each waited for the same way (the watch never brings
//!   them: the wait's head start, then etcd's proof).
//! - `memory`: resident memory per cached object, each side measured in a fresh child process
//!   (the bench re-executes itself with a hidden `--child` argument): the RSS growth from before
//!   the list to after sync, divided by N. Raw: `HashMap<String, Arc<ConfigMap>>` (keys relative
//!   to the prefix, like the informer's) built from pages of P keys. Informer: the namespace
//!   index, no handler; also with H no-op handlers (detail). The primary figure is the RSS growth
//!   after `malloc_trim(0)` (memory the program holds); the RSS growth before trimming is reported
//!   too (`*_untrimmed`).
//!   Relist peak (details `relist_*`): a child syncs an informer (no handler), trims, then ends
//!   its watch as a compaction would; while it relists everything the RSS is sampled every 5 ms.
//!   `relist_peak_ratio` = (peak - before) / (steady - before): the cache's memory at its peak
//!   against its steady state.
//!   Compact cache (details `compact_*`, `reads_*`, `sync_s_*`): a child syncs an informer with
//!   `with_compact_cache(JsonCodec)`; its memory per object is compared with the raw key and
//!   value bytes etcd holds (key relative to the prefix, as cached; target 1.3x) and with the raw
//!   map, by its RSS and by the heap's bytes in use (`compact_heap_*`: glibc's `mallinfo2`,
//!   which the allocator's cached pages do not move). Both informer children then time reads:
//!   `get_by_key` of up to 100,000 random keys (ns per call), `list` of everything and
//!   `by_index` of one namespace (best of 3, ms), and report their time to `has_synced`. A
//!   relist child measures the compact cache's relist peak and its list time
//!   (`compact_relist_list_s`). The table checks the relist peaks (<= 1.5) and the compact
//!   cache (<= 1.3x key + value bytes) as rows of their own.
//! - `metrics`: what the `metrics` feature costs on the watch path: CPU per event of this process
//!   (the `watch` scenario's informer side, one handler) with the informer's metrics going to
//!   the facade's no-op recorder (baseline) and to a Prometheus recorder with buckets
//!   (counters, gauges, and the stage histograms of `etcd_informer_stage_seconds`). Lower is
//!   better; also the cost of one clock read (`clock_read_ns`).
//! - `audit`: what the informer's audit costs: a synced informer (no handler) runs
//!   `audit_now` R times; the time of each, the bytes etcd sent for it (its
//!   `etcd_network_client_grpc_sent_bytes_total`) beside those of the informer's full list,
//!   and the CPU of this process and of etcd. Baseline: the list's time; lower is better.
//! - `prevkv`: etcd's write throughput (W writers, M/4 puts) while a raw watch of the prefix is
//!   open without prev_kv (baseline column) and with prev_kv ("informer" column): does prev_kv
//!   cost etcd throughput? Higher is better.
//! - `restart`: warm restart from a snapshot (issue 26). Time from creating an informer to
//!   `has_synced`, and to its cache holding etcd's revision as of the start, and the bytes etcd
//!   sent to gRPC clients meanwhile (etcd's `etcd_network_client_grpc_sent_bytes_total`, read
//!   from its `/metrics` on the first endpoint): cold (a list; the baseline column) against
//!   warm from a snapshot etcd still has the revision of (0.1% of the keys changed since), and
//!   warm from a snapshot etcd has compacted past (a relist adopting the unchanged keys). Each
//!   warm run starts from the same snapshot file. Also the snapshot's size and write time.
//!   Targets: warm to synced <= 0.1 of cold, warm bytes <= 1% of cold.
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
const ALL_SCENARIOS: [&str; 11] = [
    "sync", "watch", "fanout", "runner", "latency", "ryw", "memory", "prevkv", "metrics", "audit",
    "restart",
];

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

mod args;
mod child;
mod context;
mod data;
mod measure;
mod restart;
mod runner;
mod scenarios;

// What the modules share (each does `use super::*`).
use args::*;
use child::*;
use context::*;
use data::*;
use measure::*;
use restart::*;
use runner::*;
use scenarios::*;

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
    // RUST_LOG=etcd_informer::snapshot=debug shows where a warm start's time goes.
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    if let Some(kind) = args.child.clone() {
        if let Err(e) = run_child(&args, &kind).await {
            fail(format!("child {kind}: {e}"));
        }
        std::process::exit(0);
    }

    // etcd: --endpoints, else ETCD_ENDPOINTS, else a throwaway server on /dev/shm. The
    // children get the same endpoints.
    let external: Option<Vec<String>> = if args.endpoints.is_empty() {
        std::env::var("ETCD_ENDPOINTS").ok().map(|l| {
            l.split(',')
                .map(|e| e.trim().to_owned())
                .filter(|e| !e.is_empty())
                .collect()
        })
    } else {
        Some(args.endpoints.clone())
    };
    let mut server = None;
    let endpoints = match external.filter(|e| !e.is_empty()) {
        Some(e) => e,
        None => {
            let data_root = if std::path::Path::new("/dev/shm").is_dir() {
                Some("/dev/shm".into())
            } else {
                None
            };
            let s = EtcdServer::start_with(
                ServerOptions::default()
                    .with_data_root(data_root)
                    .with_extra_args(vec!["--quota-backend-bytes=8589934592".into()]),
            )
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
    // The writers run on their own threads, named, so that the consumer's CPU and wake-ups
    // can be counted apart from theirs (`ConsumerMark`). Leaked: a runtime cannot be dropped
    // from async code, and it lives as long as the process.
    let writers: &'static tokio::runtime::Runtime = Box::leak(Box::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(WRITER_THREAD)
            .enable_all()
            .build()
            .unwrap_or_else(|e| fail(format!("writer runtime: {e}"))),
    ));
    let mut writer = {
        let endpoints = endpoints.clone();
        writers
            .spawn(async move { connect_writer(&endpoints).await })
            .await
            .unwrap_or_else(|e| fail(e))
    };
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
        writers: writers.handle().clone(),
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
            "runner" => scenario_runner(&bench).await,
            "latency" => scenario_latency(&bench).await,
            "ryw" => scenario_ryw(&bench).await,
            "memory" => {
                let (row, more) = scenario_memory(&bench).await;
                rows.push(row);
                rows.extend(more);
                eprintln!("{s} took {:.1} s", t.elapsed().as_secs_f64());
                continue;
            }
            "prevkv" => scenario_prevkv(&bench).await,
            "metrics" => scenario_metrics(&bench).await,
            "audit" => scenario_audit(&bench).await,
            "restart" => {
                rows.extend(scenario_restart(&bench).await);
                eprintln!("{s} took {:.1} s", t.elapsed().as_secs_f64());
                continue;
            }
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
