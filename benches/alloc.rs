//! Allocations per event on the watch path, counted by a counting global allocator: a bench
//! binary of its own, so that no timed scenario pays for the count.
//!
//! ```text
//! cargo bench --bench alloc -- [--events 20000] [--value-bytes 256]
//! ```
//!
//! Starts a throwaway etcd (`ETCD_BIN` or `PATH`). For each consumer, `--events` keys are put
//! under a prefix of their own, the consumer is started (and synced), and a child process (this
//! binary again, `--writer`) updates each key once: every allocation of this process meanwhile
//! is the consumer's (and the runtime's background, a few hundred in all). Consumers:
//! - `raw watch`: etcd-client's watch of the prefix, each value decoded with serde_json: the
//!   least any consumer allocates;
//! - `informer, 1 handler`: an informer with one handler on its delivery thread;
//! - `informer, runner-style handler`: an informer with an inline handler that enqueues the
//!   key in a work queue (what a runner's handler does).
//!
//! Prints a table and one JSON line per consumer: allocations and bytes per event, and the
//! informer's over the raw watch's. With `ALLOC_SITES=1` (slower: every 64th allocation
//! captures its call stack), each row is followed by where the allocations come from.

use std::alloc::{GlobalAlloc, Layout, System};
use std::backtrace::Backtrace;
use std::cell::Cell;
use std::collections::HashMap;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, Txn, TxnOp, WatchOptions};
use etcd_informer::testing::etcd::EtcdServer;
use etcd_informer::workqueue::WorkQueue;
use etcd_informer::{
    connect, EtcdListerWatcher, InformerOptions, JsonCodec, ResourceEventHandlerFuncs,
    SharedIndexInformer,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;
use tokio::sync::Notify;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Counts every allocation (and reallocation, a new block) of the process.
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

/// With `ALLOC_SITES` set, every 64th allocation while a consumer is measured records its
/// call stack: where the allocations come from, printed after each consumer.
static SAMPLING: AtomicBool = AtomicBool::new(false);
static SITES: Mutex<Vec<Backtrace>> = Mutex::new(Vec::new());

thread_local! {
    static SAMPLING_HERE: Cell<bool> = const { Cell::new(false) };
}

fn sample() {
    // Not while this thread is already sampling (the capture allocates), nor while it panics
    // (the panic hook holds std's backtrace lock).
    if std::thread::panicking() || SAMPLING_HERE.with(|s| s.replace(true)) {
        return;
    }
    let trace = Backtrace::force_capture();
    if let Ok(mut sites) = SITES.lock() {
        sites.push(trace);
    }
    SAMPLING_HERE.with(|s| s.set(false));
}

/// The sampled call stacks by their first three frames outside the allocator and the
/// standard library, the commonest first.
fn print_sites() {
    let traces = std::mem::take(&mut *SITES.lock().unwrap_or_else(|e| e.into_inner()));
    let skip = [
        "alloc::",
        "core::",
        "std::",
        "backtrace",
        "Counting",
        "__rust",
        "hashbrown",
        "__libc",
        "clone3",
        "start_thread",
        "sample",
    ];
    let mut counts: HashMap<String, usize> = HashMap::new();
    for trace in &traces {
        let text = trace.to_string();
        let frames: Vec<&str> = text
            .lines()
            .filter_map(|l| l.trim().split_once(": ").map(|(_, f)| f))
            .filter(|f| !skip.iter().any(|s| f.contains(s)))
            .take(3)
            .collect();
        *counts.entry(frames.join(" < ")).or_default() += 1;
    }
    let mut counts: Vec<_> = counts.into_iter().collect();
    counts.sort_by_key(|c| std::cmp::Reverse(c.1));
    for (site, n) in counts.iter().take(25) {
        println!(
            "  {:5.1}% {site}",
            100.0 * *n as f64 / traces.len().max(1) as f64
        );
    }
}

// SAFETY: every call goes to the system allocator unchanged; the counters only count.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // The sampler's own allocations are not counted.
        if !SAMPLING_HERE.with(Cell::get) {
            let n = ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
            if n % 64 == 0 && SAMPLING.load(Ordering::Relaxed) {
                sample();
            }
        }
        // SAFETY: as the caller's contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as the caller's contract.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !SAMPLING_HERE.with(Cell::get) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            BYTES.fetch_add(new_size as u64, Ordering::Relaxed);
        }
        // SAFETY: as the caller's contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// What is stored under each key.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Item {
    seq: u64,
    data: String,
}

fn value(seq: u64, bytes: usize) -> String {
    let item = Item {
        seq,
        data: "x".repeat(bytes.saturating_sub(24)),
    };
    serde_json::to_string(&item).unwrap_or_default()
}

/// Counts events until `target`, then wakes the measurement.
struct Arrivals {
    count: AtomicUsize,
    target: usize,
    done: Notify,
}

impl Arrivals {
    fn new(target: usize) -> Arc<Self> {
        Arc::new(Arrivals {
            count: AtomicUsize::new(0),
            target,
            done: Notify::new(),
        })
    }
    fn one(&self) {
        if self.count.fetch_add(1, Ordering::Relaxed) + 1 == self.target {
            self.done.notify_one();
        }
    }
}

struct Args {
    events: usize,
    value_bytes: usize,
}

fn args() -> Args {
    let mut a = Args {
        events: 20_000,
        value_bytes: 256,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        if flag == "--bench" {
            continue;
        }
        let value = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        let n = value
            .replace('_', "")
            .parse()
            .unwrap_or_else(|_| panic!("{flag} needs a whole number"));
        match flag.as_str() {
            "--events" => a.events = n,
            "--value-bytes" => a.value_bytes = n,
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

async fn load(client: &Client, prefix: &str, args: &Args) -> Res<()> {
    let mut kv = client.kv_client();
    for chunk in (0..args.events).collect::<Vec<_>>().chunks(128) {
        let ops = chunk
            .iter()
            .map(|i| TxnOp::put(format!("{prefix}k{i:07}"), value(0, args.value_bytes), None))
            .collect::<Vec<_>>();
        kv.txn(Txn::new().and_then(ops)).await?;
    }
    Ok(())
}

/// The writer child: once told to go, updates each of the `events` keys once.
async fn writer(endpoint: String, prefix: String, events: usize, bytes: usize) -> Res<()> {
    let client = connect([endpoint.as_str()]).await?;
    println!("ready");
    let mut line = String::new();
    BufReader::new(tokio::io::stdin())
        .read_line(&mut line)
        .await?;
    let writers = 8;
    let mut tasks = Vec::new();
    for w in 0..writers {
        let (mut kv, prefix) = (client.kv_client(), prefix.clone());
        tasks.push(tokio::spawn(async move {
            for i in (w..events).step_by(writers) {
                kv.put(format!("{prefix}k{i:07}"), value(i as u64 + 1, bytes), None)
                    .await?;
            }
            Ok::<_, etcd_client::Error>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

/// Allocations and bytes of this process while the writer child updates every key of
/// `prefix` and `arrivals` sees each.
async fn measure(
    endpoint: &str,
    prefix: &str,
    args: &Args,
    arrivals: &Arrivals,
) -> Res<(f64, f64)> {
    let mut child = Command::new(std::env::current_exe()?)
        .args([
            "--writer",
            endpoint,
            prefix,
            &args.events.to_string(),
            &args.value_bytes.to_string(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut stdout = BufReader::new(child.stdout.take().ok_or("no stdout")?);
    let mut line = String::new();
    stdout.read_line(&mut line).await?;
    if line.trim() != "ready" {
        return Err(format!("the writer said {line:?}").into());
    }
    let mut stdin = child.stdin.take().ok_or("no stdin")?;
    let done = arrivals.done.notified();
    tokio::pin!(done);
    done.as_mut().enable();
    let (allocations, bytes) = (
        ALLOCATIONS.load(Ordering::Relaxed),
        BYTES.load(Ordering::Relaxed),
    );
    SAMPLING.store(std::env::var_os("ALLOC_SITES").is_some(), Ordering::Relaxed);
    stdin.write_all(b"go\n").await?;
    tokio::time::timeout(Duration::from_secs(120), done)
        .await
        .map_err(|_| {
            format!(
                "{prefix}: {} of {} events",
                arrivals.count.load(Ordering::Relaxed),
                arrivals.target
            )
        })?;
    let per_event = |now: u64, then: u64| (now - then) as f64 / args.events as f64;
    let figures = (
        per_event(ALLOCATIONS.load(Ordering::Relaxed), allocations),
        per_event(BYTES.load(Ordering::Relaxed), bytes),
    );
    SAMPLING.store(false, Ordering::Relaxed);
    let status = child.wait().await?;
    if !status.success() {
        return Err(format!("the writer failed: {status}").into());
    }
    Ok(figures)
}

async fn raw_watch(client: &Client, endpoint: &str, prefix: &str, args: &Args) -> Res<(f64, f64)> {
    let arrivals = Arrivals::new(args.events);
    let options = WatchOptions::new().with_prefix();
    let (_requests, mut stream) = client
        .watch_client()
        .watch(prefix, Some(options))
        .await?
        .split();
    let seen = arrivals.clone();
    let task = tokio::spawn(async move {
        while let Ok(Some(resp)) = stream.message().await {
            for event in resp.events() {
                let Some(kv) = event.kv() else { continue };
                if serde_json::from_slice::<Item>(kv.value()).is_ok() {
                    seen.one();
                }
            }
        }
    });
    let figures = measure(endpoint, prefix, args, &arrivals).await;
    task.abort();
    figures
}

async fn informer(
    client: &Client,
    endpoint: &str,
    prefix: &str,
    args: &Args,
    inline: bool,
) -> Res<(f64, f64)> {
    let arrivals = Arrivals::new(args.events);
    let lw = EtcdListerWatcher::new(client.clone(), prefix, JsonCodec::<Item>::new())?;
    let informer: SharedIndexInformer<Item> =
        SharedIndexInformer::new(lw, InformerOptions::default());
    let queue: WorkQueue<String> = WorkQueue::new();
    let registration = if inline {
        let (seen, queue) = (arrivals.clone(), queue.clone());
        let handler = ResourceEventHandlerFuncs::new().on_update(move |_, o| {
            queue.add(o.key().to_string());
            seen.one();
        });
        informer.add_inline_event_handler("enqueue", handler)?
    } else {
        let seen = arrivals.clone();
        let handler = ResourceEventHandlerFuncs::new().on_update(move |_, _| seen.one());
        informer.add_event_handler(handler)?
    };
    let run = tokio::spawn(informer.clone().run());
    tokio::time::timeout(Duration::from_secs(60), informer.wait_for_cache_sync()).await?;
    // A worker takes the keys off the queue, as a runner's would (its allocations count).
    let drain = {
        let queue = queue.clone();
        tokio::spawn(async move {
            while let Some(key) = queue.get().await {
                queue.done(&key);
            }
        })
    };
    let figures = measure(endpoint, prefix, args, &arrivals).await;
    queue.shut_down();
    drain.abort();
    informer.stop();
    run.abort();
    drop(registration);
    figures
}

async fn run() -> Res<()> {
    let args = args();
    let etcd = EtcdServer::start().await?;
    let endpoint = etcd.endpoint();
    let client = connect([endpoint.as_str()]).await?;
    println!(
        "\n{} events of {}-byte values, allocations of this process per event\n",
        args.events, args.value_bytes
    );
    println!("| consumer | allocations | bytes | allocations over the raw watch's |");
    println!("| --- | ---: | ---: | ---: |");
    let mut raw = None;
    for (n, name) in [
        "raw watch",
        "informer, 1 handler",
        "informer, runner-style handler",
    ]
    .into_iter()
    .enumerate()
    {
        let prefix = format!("/bench/alloc/{n}/");
        load(&client, &prefix, &args).await?;
        let (allocations, bytes) = match n {
            0 => raw_watch(&client, &endpoint, &prefix, &args).await?,
            1 => informer(&client, &endpoint, &prefix, &args, false).await?,
            _ => informer(&client, &endpoint, &prefix, &args, true).await?,
        };
        let ratio = allocations / *raw.get_or_insert(allocations);
        println!("| {name} | {allocations:.1} | {bytes:.0} | {ratio:.2} |");
        if std::env::var_os("ALLOC_SITES").is_some() {
            print_sites();
        }
        println!(
            "{{\"scenario\":\"alloc\",\"consumer\":\"{name}\",\"events\":{},\"allocations_per_event\":{allocations:.2},\"bytes_per_event\":{bytes:.1},\"over_raw\":{ratio:.3}}}",
            args.events
        );
    }
    Ok(())
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let get = |i: usize| argv.get(i).cloned().unwrap_or_default();
    let result = if argv.get(1).map(String::as_str) == Some("--writer") {
        let number = |i: usize| get(i).parse().unwrap_or(0);
        runtime.block_on(writer(get(2), get(3), number(4), number(5)))
    } else {
        runtime.block_on(run())
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
