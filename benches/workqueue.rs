//! How long a live change waits in a `WorkQueue` behind a backlog, FIFO against priorities, and
//! one group's keys behind another's, with and without fairness.
//!
//! ```text
//! cargo bench --bench workqueue -- [--keys N] [--workers W] [--reconcile-ms R]
//!     [--live-every-ms E] [--duration-s D] [--fair-keys F] [--runs K]
//!     [--scenario backlog,fairness,runner,relist]
//! ```
//!
//! Defaults: N = 100,000, W = 4, R = 1, E = 10, D = 5, F = 50,000, K = 1. No etcd is involved.
//!
//! - `backlog`: N keys are queued at once, as an initial list would queue them (`add` in `fifo`
//!   mode, today's behaviour; `Priority::Background` in `priority` mode). W worker tasks loop on
//!   `get`, a reconcile of `tokio::time::sleep(R ms)` (on a multi-thread runtime), `done`.
//!   Meanwhile a live change (a key not in the backlog, added `Live`) arrives every E ms for the
//!   first D seconds: that window is the same in both modes, so `fifo`'s samples (which wait
//!   for the backlog) do not make the run longer than draining the backlog does. For each live
//!   key: the time from its add to `get` returning it, and to its reconcile's end. Also the
//!   backlog's drain time (from the first add to the last backlog key's `done`) and the
//!   throughput (reconciles per second until the last `done`).
//! - `fairness`: F keys in group `busy` and one key every E ms in group `quiet`, all `Live`,
//!   without and with `WorkQueueConfig::fairness` (group = the key's text before `/`). The quiet
//!   keys' latency, add to the end of their reconcile. The run stops once every quiet key is
//!   reconciled (without fairness, that is after the busy backlog; with it, after D seconds), so
//!   its drain time is only reported when the busy backlog was drained.
//!
//! - `runner`: the same as `backlog`, end to end through an informer and a `Runner` (an
//!   in-memory source): N keys in the informer's initial list, which the runner queues; once
//!   they are queued, a new key put in the source every E ms for D seconds; from each put to
//!   its reconcile's start and end. Modes: `Runner::priorities(true)` (the default) and `(false)` (one FIFO).
//!
//! - `relist`: a runner (W workers, a reconcile that only counts) over an informer of N
//!   keys, after its initial list is reconciled; then the watch breaks, one key changes and the
//!   history is compacted, so the informer relists and finds all other keys unchanged. Per
//!   `RelistUnchanged` choice: the reconciles the relist triggered, and the process CPU time
//!   and wall time from the break until the cache has relisted and the queue is idle.
//!
//! A `tokio::time::sleep` of 1 ms lasts about 2 ms (tokio's timer has 1 ms ticks and rounds
//! up), so 4 workers reconcile about 1,900 keys/s and draining 100,000 keys takes about 52 s.
//! One run of both scenarios takes about 2¼ minutes, nearly all of it the two backlog drains.
//!
//! Latencies are pooled over the K runs; drain time and throughput are medians. Progress goes
//! to stderr; then one JSON line per scenario and mode, and a Markdown table. The target: with
//! priorities, a live change reconciled within 50 ms at p99 (4 workers, 1 ms reconcile, 100k
//! backlog).

use std::collections::HashMap;
use std::process::exit;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_informer::workqueue::{Priority, WorkQueue, WorkQueueConfig};
use tokio::sync::Notify;

const TARGET_P99_MS: f64 = 50.0;

#[derive(Debug, Clone)]
struct Args {
    keys: usize,
    workers: usize,
    reconcile: Duration,
    live_every: Duration,
    duration: Duration,
    fair_keys: usize,
    runs: usize,
    scenarios: Vec<String>,
}

fn fail(msg: String) -> ! {
    eprintln!("workqueue bench: {msg}");
    exit(2)
}

fn parse_args() -> Args {
    let mut a = Args {
        keys: 100_000,
        workers: 4,
        reconcile: Duration::from_millis(1),
        live_every: Duration::from_millis(10),
        duration: Duration::from_secs(5),
        fair_keys: 50_000,
        runs: 1,
        scenarios: vec![
            "backlog".into(),
            "fairness".into(),
            "runner".into(),
            "relist".into(),
        ],
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
        let value = inline
            .or_else(|| it.next())
            .unwrap_or_else(|| fail(format!("{flag} needs a value")));
        let num = |v: &str| -> f64 {
            v.replace('_', "")
                .parse()
                .unwrap_or_else(|_| fail(format!("{flag}: not a number: {v}")))
        };
        let ms = |v: &str| Duration::from_secs_f64(num(v) / 1000.0);
        match flag.as_str() {
            "--keys" => a.keys = num(&value) as usize,
            "--workers" => a.workers = (num(&value) as usize).max(1),
            "--reconcile-ms" => a.reconcile = ms(&value),
            "--live-every-ms" => a.live_every = ms(&value).max(Duration::from_micros(100)),
            "--duration-s" => a.duration = Duration::from_secs_f64(num(&value)),
            "--fair-keys" => a.fair_keys = num(&value) as usize,
            "--runs" => a.runs = (num(&value) as usize).max(1),
            "--scenario" => a.scenarios = value.split(',').map(str::to_owned).collect(),
            _ => fail(format!("unknown flag {flag}")),
        }
    }
    for s in &a.scenarios {
        if !["backlog", "fairness", "runner", "relist"].contains(&s.as_str()) {
            fail(format!(
                "unknown scenario {s} (backlog, fairness, runner, relist)"
            ));
        }
    }
    a
}

/// What one run of one mode measured.
#[derive(Debug, Default)]
struct Run {
    /// Per sampled key: add to `get`, add to the end of its reconcile, in ms.
    samples: Vec<(f64, f64)>,
    /// First add to the last backlog key's `done`, if the backlog was drained.
    drain: Option<Duration>,
    reconciles: usize,
    /// First add to the last `done`.
    elapsed: Duration,
}

/// Shared by the workers of one run.
struct Shared {
    queue: WorkQueue<String>,
    /// Add time of each sampled key, written before the key is added.
    sampled: Mutex<HashMap<String, Instant>>,
    samples: Mutex<Vec<(f64, f64)>>,
    /// Backlog keys reconciled.
    backlog_done: AtomicUsize,
    reconciles: AtomicUsize,
    last_done: Mutex<Option<Instant>>,
    drained: Mutex<Option<Instant>>,
    /// Woken when the backlog is drained or a sample is recorded.
    progress: Notify,
    /// Set when the run has what it needs: workers stop after their current key (a shut-down
    /// queue would still hand out the whole backlog).
    stop: AtomicBool,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

async fn worker(shared: Arc<Shared>, backlog: usize, reconcile: Duration) {
    while let Some(key) = shared.queue.get().await {
        let got = Instant::now();
        tokio::time::sleep(reconcile).await;
        shared.queue.done(&key);
        let finished = Instant::now();
        shared.reconciles.fetch_add(1, Ordering::Relaxed);
        *lock(&shared.last_done) = Some(finished);
        if shared.stop.load(Ordering::Relaxed) {
            return;
        }
        let added = lock(&shared.sampled).get(&key).copied();
        match added {
            Some(added) => {
                lock(&shared.samples).push((ms(got - added), ms(finished - added)));
                shared.progress.notify_one();
            }
            None => {
                if shared.backlog_done.fetch_add(1, Ordering::Relaxed) + 1 == backlog {
                    *lock(&shared.drained) = Some(finished);
                    shared.progress.notify_one();
                }
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One run: `backlog` keys queued at once with `backlog_priority`, a sampled key every
/// `live_every` for `duration`, `workers` workers. Stops once every sampled key is reconciled
/// and, if `drain`, the backlog too.
fn run(
    args: &Args,
    queue: WorkQueue<String>,
    backlog: impl Iterator<Item = String>,
    backlog_len: usize,
    backlog_priority: Priority,
    sampled_key: impl Fn(usize) -> String + Send + 'static,
    drain: bool,
) -> Run {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| fail(format!("tokio runtime: {e}")));
    let shared = Arc::new(Shared {
        queue,
        sampled: Mutex::new(HashMap::new()),
        samples: Mutex::new(Vec::new()),
        backlog_done: AtomicUsize::new(0),
        reconciles: AtomicUsize::new(0),
        last_done: Mutex::new(None),
        drained: Mutex::new(None),
        progress: Notify::new(),
        stop: AtomicBool::new(false),
    });
    let live_count = (args.duration.as_secs_f64() / args.live_every.as_secs_f64()).ceil() as usize;
    rt.block_on(async {
        let start = Instant::now();
        for key in backlog {
            shared.queue.add_with_priority(key, backlog_priority);
        }
        let workers: Vec<_> = (0..args.workers)
            .map(|_| tokio::spawn(worker(shared.clone(), backlog_len, args.reconcile)))
            .collect();
        let producer = tokio::spawn({
            let shared = shared.clone();
            let every = args.live_every;
            async move {
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                for i in 0..live_count {
                    tick.tick().await;
                    let key = sampled_key(i);
                    lock(&shared.sampled).insert(key.clone(), Instant::now());
                    shared.queue.add(key);
                }
            }
        });
        loop {
            let notified = shared.progress.notified();
            let samples = lock(&shared.samples).len();
            let drained = lock(&shared.drained).is_some() || backlog_len == 0;
            if samples == live_count && (drained || !drain) {
                break;
            }
            let _ = tokio::time::timeout(Duration::from_millis(100), notified).await;
        }
        shared.stop.store(true, Ordering::Relaxed);
        shared.queue.shut_down();
        let _ = producer.await;
        for w in workers {
            let _ = w.await;
        }
        let last = lock(&shared.last_done).unwrap_or(start);
        Run {
            samples: std::mem::take(&mut *lock(&shared.samples)),
            drain: lock(&shared.drained).map(|at| at - start),
            reconciles: shared.reconciles.load(Ordering::Relaxed),
            elapsed: last - start,
        }
    })
}

/// One `runner` run: `args.keys` keys in the initial list, a put every `live_every` for
/// `duration`, a runner with `args.workers` workers and priorities or not. Stops once every
/// put is reconciled.
fn run_runner(args: &Args, priorities: bool) -> Run {
    use etcd_informer::runner::{Action, Runner};
    use etcd_informer::testing::FakeSource;
    use etcd_informer::SharedIndexInformer;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| fail(format!("tokio runtime: {e}")));
    let live_count = (args.duration.as_secs_f64() / args.live_every.as_secs_f64()).ceil() as usize;
    rt.block_on(async {
        let source = FakeSource::<String>::new();
        for i in 0..args.keys {
            source.put(&format!("ns-{}/obj-{i:06}", i % 10), "v".into());
        }
        let informer = SharedIndexInformer::new(source.clone(), Default::default());
        tokio::spawn(informer.clone().run());
        informer.wait_for_cache_sync().await;
        let sampled: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
        let samples: Arc<Mutex<Vec<(f64, f64)>>> = Arc::default();
        let reconciles = Arc::new(AtomicUsize::new(0));
        let last_done: Arc<Mutex<Option<Instant>>> = Arc::default();
        let runner = Runner::new("bench")
            .watch(&informer)
            .workers(args.workers)
            .priorities(priorities);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let queue = runner.queue().clone();
        let start = Instant::now();
        let reconcile = {
            let (sampled, samples, reconciles, last_done) = (
                sampled.clone(),
                samples.clone(),
                reconciles.clone(),
                last_done.clone(),
            );
            let work = args.reconcile;
            move |key: String| {
                let (sampled, samples, reconciles, last_done) = (
                    sampled.clone(),
                    samples.clone(),
                    reconciles.clone(),
                    last_done.clone(),
                );
                async move {
                    let got = Instant::now();
                    tokio::time::sleep(work).await;
                    let finished = Instant::now();
                    reconciles.fetch_add(1, Ordering::Relaxed);
                    *lock(&last_done) = Some(finished);
                    if let Some(put) = lock(&sampled).get(&key).copied() {
                        lock(&samples).push((ms(got - put), ms(finished - put)));
                    }
                    Ok::<_, String>(Action::Done)
                }
            }
        };
        let task = tokio::spawn(runner.run(reconcile, async {
            let _ = rx.await;
        }));
        // Live changes start once the runner's handler has queued the initial list (its
        // one-time delivery of 100k notifications is not what is measured here).
        while queue.metrics().adds < args.keys as u64 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let mut tick = tokio::time::interval(args.live_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        for i in 0..live_count {
            tick.tick().await;
            let key = format!("live/change-{i}");
            lock(&sampled).insert(key.clone(), Instant::now());
            source.put(&key, "v".into());
        }
        while lock(&samples).len() < live_count {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = tx.send(());
        task.abort();
        informer.stop();
        let last = lock(&last_done).unwrap_or(start);
        let samples = std::mem::take(&mut *lock(&samples));
        Run {
            samples,
            drain: None,
            reconciles: reconciles.load(Ordering::Relaxed),
            elapsed: last - start,
        }
    })
}

/// The process's CPU time (user + system) so far.
fn cpu_time() -> Duration {
    // SAFETY: getrusage fills the struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// One `relist` run for `choice`: (reconciles triggered, CPU time, wall time).
fn run_relist(args: &Args, choice: etcd_informer::RelistUnchanged) -> (usize, Duration, Duration) {
    use etcd_informer::listwatch::Error;
    use etcd_informer::runner::{Action, Runner};
    use etcd_informer::testing::FakeSource;
    use etcd_informer::{Backoff, InformerOptions, SharedIndexInformer};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| fail(format!("tokio runtime: {e}")));
    rt.block_on(async {
        let source = FakeSource::<String>::new();
        for i in 0..args.keys {
            source.put(&format!("ns-{}/obj-{i:06}", i % 10), "v".into());
        }
        // A relist at once, not after client-go's protective backoff.
        let quick = Backoff::new(
            Duration::from_millis(1),
            Duration::from_millis(10),
            Duration::from_secs(120),
            0.0,
        );
        let options = InformerOptions::default()
            .with_relist_unchanged(choice)
            .with_backoff(quick);
        let informer = SharedIndexInformer::new(source.clone(), options);
        tokio::spawn(informer.clone().run());
        informer.wait_for_cache_sync().await;
        let reconciles = Arc::new(AtomicUsize::new(0));
        let count = reconciles.clone();
        let runner = Runner::new("bench").watch(&informer).workers(args.workers);
        let queue = runner.queue().clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(runner.run(
            move |_key: String| {
                count.fetch_add(1, Ordering::Relaxed);
                async { Ok::<_, String>(Action::Done) }
            },
            async {
                let _ = rx.await;
            },
        ));
        let idle = |expected: usize| {
            let m = queue.metrics();
            reconciles.load(Ordering::Relaxed) >= expected && m.depth == 0 && m.processing == 0
        };
        while !idle(args.keys) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let before = reconciles.load(Ordering::Relaxed);
        let lists = source.list_count();
        let (cpu, wall) = (cpu_time(), Instant::now());
        // One change while the watch is down, then the history compacted past it: the watch
        // cannot resume, and the informer relists.
        source.break_watches(Error::transient("connection reset"));
        source.put("ns-0/obj-000000", "changed".into());
        source.compact();
        while source.list_count() == lists || !informer.has_synced() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // The relist is applied once the informer is back at the source's revision; then the
        // queue drains what it triggered.
        while informer.revision() < source.revision() || !idle(before) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let mut last = reconciles.load(Ordering::Relaxed);
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let now = reconciles.load(Ordering::Relaxed);
            if now == last && idle(now) {
                break;
            }
            last = now;
        }
        let (cpu, wall) = (cpu_time() - cpu, wall.elapsed());
        let _ = tx.send(());
        task.abort();
        informer.stop();
        (last - before, cpu, wall)
    })
}

/// The `q` quantile (nearest rank) of sorted `v`.
fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The figures of one scenario and mode over all runs.
struct Summary {
    scenario: &'static str,
    mode: &'static str,
    samples: usize,
    get: [f64; 3],
    done: [f64; 3],
    drain_s: f64,
    throughput: f64,
}

fn summarize(scenario: &'static str, mode: &'static str, runs: &[Run]) -> Summary {
    let mut get: Vec<f64> = runs
        .iter()
        .flat_map(|r| r.samples.iter().map(|s| s.0))
        .collect();
    let mut done: Vec<f64> = runs
        .iter()
        .flat_map(|r| r.samples.iter().map(|s| s.1))
        .collect();
    get.sort_by(f64::total_cmp);
    done.sort_by(f64::total_cmp);
    let p = |v: &[f64]| [quantile(v, 0.5), quantile(v, 0.99), quantile(v, 1.0)];
    Summary {
        scenario,
        mode,
        samples: done.len(),
        get: p(&get),
        done: p(&done),
        drain_s: median(
            runs.iter()
                .filter_map(|r| r.drain.map(|d| d.as_secs_f64()))
                .collect(),
        ),
        throughput: median(
            runs.iter()
                .map(|r| r.reconciles as f64 / r.elapsed.as_secs_f64().max(1e-9))
                .collect(),
        ),
    }
}

fn json_num(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.3}")
    } else {
        "null".into()
    }
}

fn main() {
    let args = parse_args();
    eprintln!("workqueue bench: {args:?}");
    let started = Instant::now();
    let namespace = |key: &String| key.split_once('/').map_or("", |(ns, _)| ns).to_string();
    let mut results: Vec<(&'static str, &'static str, Vec<Run>)> = Vec::new();
    let mut record = |scenario, mode, r: Run| {
        eprintln!(
            "  {scenario}/{mode}: {} samples, done p99 {:.1} ms, drain {:?}, {} reconciles in {:.2} s",
            r.samples.len(),
            {
                let mut d: Vec<f64> = r.samples.iter().map(|s| s.1).collect();
                d.sort_by(f64::total_cmp);
                quantile(&d, 0.99)
            },
            r.drain,
            r.reconciles,
            r.elapsed.as_secs_f64()
        );
        match results
            .iter_mut()
            .find(|(s, m, _)| *s == scenario && *m == mode)
        {
            Some((_, _, runs)) => runs.push(r),
            None => results.push((scenario, mode, vec![r])),
        }
    };
    let mut relists = Vec::new();
    for run_no in 1..=args.runs {
        eprintln!("run {run_no}/{}", args.runs);
        if args.scenarios.iter().any(|s| s == "backlog") {
            let backlog = |n| (0..n).map(|i| format!("ns-{}/obj-{i:06}", i % 10));
            for (mode, priority) in [("fifo", Priority::Live), ("priority", Priority::Background)] {
                let r = run(
                    &args,
                    WorkQueue::new(),
                    backlog(args.keys),
                    args.keys,
                    priority,
                    |i| format!("live/change-{i}"),
                    true,
                );
                record("backlog", mode, r);
            }
        }
        if args.scenarios.iter().any(|s| s == "relist") {
            use etcd_informer::RelistUnchanged;
            for choice in [
                RelistUnchanged::ResyncingHandlers,
                RelistUnchanged::Nobody,
                RelistUnchanged::Everyone,
            ] {
                let (triggered, cpu, wall) = run_relist(&args, choice);
                eprintln!(
                    "  relist/{choice:?}: {triggered} reconciles, CPU {cpu:?}, wall {wall:?}"
                );
                relists.push((choice, triggered, cpu, wall));
            }
        }
        if args.scenarios.iter().any(|s| s == "runner") {
            for (mode, priorities) in [("fifo", false), ("priority", true)] {
                record("runner", mode, run_runner(&args, priorities));
            }
        }
        if args.scenarios.iter().any(|s| s == "fairness") {
            let busy = |n| (0..n).map(|i| format!("busy/obj-{i:06}"));
            for (mode, config) in [
                ("no fairness", WorkQueueConfig::new()),
                ("fairness", WorkQueueConfig::new().fairness(namespace)),
            ] {
                let r = run(
                    &args,
                    WorkQueue::with_config(config),
                    busy(args.fair_keys),
                    args.fair_keys,
                    Priority::Live,
                    |i| format!("quiet/obj-{i}"),
                    false,
                );
                record("fairness", mode, r);
            }
        }
    }

    let summaries: Vec<Summary> = results
        .iter()
        .map(|(s, m, runs)| summarize(s, m, runs))
        .collect();
    for s in &summaries {
        println!(
            "{{\"scenario\":\"{}\",\"mode\":\"{}\",\"runs\":{},\"keys\":{},\"workers\":{},\"reconcile_ms\":{},\"live_every_ms\":{},\"samples\":{},\"get_p50_ms\":{},\"get_p99_ms\":{},\"get_max_ms\":{},\"done_p50_ms\":{},\"done_p99_ms\":{},\"done_max_ms\":{},\"drain_s\":{},\"throughput_per_s\":{}}}",
            s.scenario,
            s.mode,
            args.runs,
            if s.scenario == "fairness" { args.fair_keys } else { args.keys },
            args.workers,
            json_num(ms(args.reconcile)),
            json_num(ms(args.live_every)),
            s.samples,
            json_num(s.get[0]),
            json_num(s.get[1]),
            json_num(s.get[2]),
            json_num(s.done[0]),
            json_num(s.done[1]),
            json_num(s.done[2]),
            json_num(s.drain_s),
            json_num(s.throughput),
        );
    }
    if !summaries.is_empty() {
        println!();
        println!("| scenario | mode | samples | to get p50 / p99 / max (ms) | to reconciled p50 / p99 / max (ms) | drain (s) | reconciles/s |");
        println!("| --- | --- | ---: | ---: | ---: | ---: | ---: |");
    }
    for s in &summaries {
        let drain = if s.drain_s.is_finite() {
            format!("{:.2}", s.drain_s)
        } else {
            "-".into()
        };
        println!(
            "| {} | {} | {} | {:.2} / {:.2} / {:.2} | {:.2} / {:.2} / {:.2} | {drain} | {:.0} |",
            s.scenario,
            s.mode,
            s.samples,
            s.get[0],
            s.get[1],
            s.get[2],
            s.done[0],
            s.done[1],
            s.done[2],
            s.throughput
        );
    }
    for p in summaries.iter().filter(|s| s.mode == "priority") {
        let verdict = if p.done[1] <= TARGET_P99_MS {
            "met"
        } else {
            "MISSED"
        };
        println!(
            "\ntarget ({}): live change reconciled within {TARGET_P99_MS} ms at p99 with priorities: {verdict} ({:.2} ms)",
            p.scenario, p.done[1]
        );
    }
    if !relists.is_empty() {
        println!();
        println!(
            "| relist of {} keys, 1 changed: `RelistUnchanged` | reconciles triggered | CPU (ms, median) | wall (ms, median) |",
            args.keys
        );
        println!("| --- | ---: | ---: | ---: |");
        for choice in [
            etcd_informer::RelistUnchanged::ResyncingHandlers,
            etcd_informer::RelistUnchanged::Nobody,
            etcd_informer::RelistUnchanged::Everyone,
        ] {
            let runs: Vec<_> = relists.iter().filter(|r| r.0 == choice).collect();
            let triggered = median(runs.iter().map(|r| r.1 as f64).collect());
            let cpu = median(runs.iter().map(|r| ms(r.2)).collect());
            let wall = median(runs.iter().map(|r| ms(r.3)).collect());
            println!("| {choice:?} | {triggered:.0} | {cpu:.0} | {wall:.0} |");
            println!(
                "{{\"scenario\":\"relist\",\"mode\":\"{choice:?}\",\"keys\":{},\"reconciles\":{triggered},\"cpu_ms\":{},\"wall_ms\":{}}}",
                args.keys,
                json_num(cpu),
                json_num(wall)
            );
        }
    }
    eprintln!("workqueue bench: {:.1} s", started.elapsed().as_secs_f64());
}
