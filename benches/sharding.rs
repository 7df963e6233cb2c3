//! Sharded runners against a throwaway etcd (or `ETCD_ENDPOINTS`): reconcile throughput with
//! 1, 2 and 3 replicas for an I/O-bound reconcile, and handoff times on a join and a crash.
//!
//! ```text
//! cargo bench --bench sharding -- [--keys 3000] [--work-ms 10] [--workers 4] [--ttl 5]
//!     [--shards 64] [--runs 3]
//! ```
//!
//! Replicas run in this process, each with its own etcd client: the reconcile only waits
//! (`--work-ms`), then writes its result under its shard's fence, so what limits throughput is
//! the waiting, spread over `workers × replicas` reconciles at once.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, Txn, TxnOp};
use etcd_informer::client::TypedClient;
use etcd_informer::runner::{Action, Context, Runner};
use etcd_informer::sharding::{ShardHandle, ShardedRunner, DEFAULT_SHARDS};
use etcd_informer::testing::etcd::{unique_prefix, EtcdServer};
use etcd_informer::{connect, EtcdListerWatcher, SharedIndexInformer, TextCodec};
use tokio::time::Instant;

struct Args {
    keys: usize,
    work: Duration,
    workers: usize,
    ttl: Duration,
    runs: usize,
    shards: u32,
}

fn args() -> Args {
    let mut a = Args {
        keys: 3000,
        work: Duration::from_millis(10),
        workers: 4,
        ttl: Duration::from_secs(5),
        runs: 3,
        shards: DEFAULT_SHARDS,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        if flag == "--bench" {
            continue;
        }
        let value: u64 = it
            .next()
            .and_then(|v| v.replace('_', "").parse().ok())
            .unwrap_or_else(|| panic!("{flag} needs a whole number"));
        match flag.as_str() {
            "--keys" => a.keys = value as usize,
            "--work-ms" => a.work = Duration::from_millis(value),
            "--workers" => a.workers = value as usize,
            "--ttl" => a.ttl = Duration::from_secs(value),
            "--runs" => a.runs = value as usize,
            "--shards" => a.shards = value as u32,
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

/// One in-process replica.
struct Replica {
    handle: ShardHandle,
    informer: SharedIndexInformer<String>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Replica {
    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
        self.informer.stop();
    }

    fn crash(self) {
        self.task.abort();
        self.informer.stop();
    }
}

/// The keys, the records, and what was reconciled (key -> the value it was reconciled at).
struct Setup {
    endpoints: Vec<String>,
    jobs: String,
    done: String,
    records: String,
    work: Duration,
    workers: usize,
    ttl: Duration,
    shards: u32,
    reconciled: Arc<Mutex<HashMap<String, String>>>,
    /// Replica -> the keys it reconciled.
    by_replica: Arc<Mutex<HashMap<String, HashSet<String>>>>,
}

impl Setup {
    fn new(endpoints: &[String], a: &Args) -> Setup {
        let base = unique_prefix("bench_sharding");
        Setup {
            endpoints: endpoints.to_vec(),
            jobs: format!("{base}jobs/"),
            done: format!("{base}done/"),
            records: format!("{base}sharding/"),
            work: a.work,
            workers: a.workers,
            ttl: a.ttl,
            shards: a.shards,
            reconciled: Arc::default(),
            by_replica: Arc::default(),
        }
    }

    async fn start(&self, name: &str) -> Replica {
        let client = connect(&self.endpoints).await.expect("connect");
        let lw = EtcdListerWatcher::new(client.clone(), self.jobs.clone(), TextCodec).unwrap();
        let informer = SharedIndexInformer::new(lw, Default::default());
        tokio::spawn(informer.clone().run());
        let runner = Runner::new("bench").watch(&informer).workers(self.workers);
        let sharded = ShardedRunner::new(runner, client.clone(), name)
            .lease_ttl(self.ttl)
            .shards(self.shards)
            .records_prefix(self.records.clone());
        let handle = sharded.handle();
        let done = TypedClient::new(client, self.done.clone(), TextCodec).unwrap();
        let (work, reconciled, by) = (self.work, self.reconciled.clone(), self.by_replica.clone());
        let me = name.to_owned();
        let reconcile = move |ctx: Context| {
            let (done, reconciled, by, me) =
                (done.clone(), reconciled.clone(), by.clone(), me.clone());
            async move {
                let Some(job) = ctx.object::<String>() else {
                    return Ok(Action::Done);
                };
                tokio::time::sleep(work).await;
                let fence = ctx.fence().cloned().expect("sharded");
                done.fenced(fence)
                    .put(ctx.key(), &job.value)
                    .await
                    .map_err(|e| e.to_string())?;
                reconciled
                    .lock()
                    .unwrap()
                    .insert(ctx.key().to_owned(), job.value.clone());
                by.lock()
                    .unwrap()
                    .entry(me)
                    .or_default()
                    .insert(ctx.key().to_owned());
                Ok::<_, String>(Action::Done)
            }
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(sharded.run_with_context(reconcile, async {
            let _ = rx.await;
        }));
        Replica {
            handle,
            informer,
            stop: Some(tx),
            task,
        }
    }

    /// Writes every job with `value`, 128 to a transaction.
    async fn write(&self, client: &Client, keys: usize, value: &str) {
        let mut kv = client.kv_client();
        let names: Vec<String> = (0..keys).map(|i| format!("job-{i:06}")).collect();
        for chunk in names.chunks(128) {
            let ops: Vec<TxnOp> = chunk
                .iter()
                .map(|k| TxnOp::put(format!("{}{k}", self.jobs), value, None))
                .collect();
            kv.txn(Txn::new().and_then(ops)).await.expect("write jobs");
        }
    }

    /// Waits until every job was reconciled at `value`; returns how long that took.
    async fn reconciled(&self, keys: usize, value: &str, within: Duration) -> Duration {
        let started = Instant::now();
        loop {
            let done = self
                .reconciled
                .lock()
                .unwrap()
                .values()
                .filter(|v| *v == value)
                .count();
            if done == keys {
                return started.elapsed();
            }
            assert!(
                started.elapsed() < within,
                "only {done} of {keys} jobs reconciled at {value:?} within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// Waits until the replicas hold every shard between them, none handing one over.
async fn settled(replicas: &[&Replica], shards: u32, within: Duration) -> Duration {
    let started = Instant::now();
    loop {
        let healths: Vec<_> = replicas.iter().map(|r| r.handle.health()).collect();
        let held: usize = healths.iter().map(|h| h.held.len()).sum();
        if held == shards as usize
            && healths
                .iter()
                .all(|h| h.releasing.is_empty() && h.members.len() == replicas.len())
        {
            return started.elapsed();
        }
        assert!(started.elapsed() < within, "the replicas never settled");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[tokio::main]
async fn main() {
    let a = args();
    let (_server, endpoints) = match std::env::var("ETCD_ENDPOINTS") {
        Ok(list) => (None, list.split(',').map(str::to_owned).collect()),
        Err(_) => {
            let server = EtcdServer::start().await.unwrap_or_else(|e| panic!("{e}"));
            let endpoints = server.endpoints();
            (Some(server), endpoints)
        }
    };
    let writer = connect(&endpoints).await.expect("connect");
    let within = Duration::from_secs(300);
    println!(
        "sharded runners: {} keys, reconcile = {:?} wait + a fenced put, {} workers per replica, {} shards, lease TTL {:?}, {} runs",
        a.keys, a.work, a.workers, a.shards, a.ttl, a.runs
    );
    let mut per_replicas: Vec<Vec<f64>> = vec![Vec::new(); 3];
    let mut joins = Vec::new();
    let mut join_all = Vec::new();
    let mut crash_all = Vec::new();
    let mut crashes = Vec::new();
    for run in 0..a.runs {
        // Throughput with 1, 2, 3 replicas, settled before the jobs are written.
        for n in 1..=3 {
            let setup = Setup::new(&endpoints, &a);
            let mut replicas = Vec::new();
            for i in 0..n {
                replicas.push(setup.start(&format!("r{i}")).await);
            }
            settled(&replicas.iter().collect::<Vec<_>>(), a.shards, within).await;
            let started = Instant::now();
            setup.write(&writer, a.keys, "v1").await;
            setup.reconciled(a.keys, "v1", within).await;
            let rate = a.keys as f64 / started.elapsed().as_secs_f64();
            let largest = replicas
                .iter()
                .map(|r| r.handle.health().held.len())
                .max()
                .unwrap_or(0);
            println!(
                "run {run}: {n} replica(s): {rate:.0} reconciles/s (largest share {largest} of {} shards)",
                a.shards
            );
            per_replicas[n - 1].push(rate);
            for r in replicas {
                r.stop().await;
            }
        }

        // Handoffs, with every job reconciled once already.
        let setup = Setup::new(&endpoints, &a);
        let r0 = setup.start("r0").await;
        let r1 = setup.start("r1").await;
        settled(&[&r0, &r1], a.shards, within).await;
        setup.write(&writer, a.keys, "v1").await;
        setup.reconciled(a.keys, "v1", within).await;
        // A join: from the start of the new replica until the three hold every shard, and
        // until the new owner has reconciled every key of the shards it took (it reconciles
        // the keys of a shard it gains).
        let joined_at = Instant::now();
        let r2 = setup.start("r2").await;
        settled(&[&r0, &r1, &r2], a.shards, within).await;
        let settle = joined_at.elapsed();
        let moved = r2.handle.health().held.len();
        let moved_keys = (0..a.keys)
            .filter(|i| r2.handle.holds_key(&format!("job-{i:06}")))
            .count();
        loop {
            let by_r2 = setup
                .by_replica
                .lock()
                .unwrap()
                .get("r2")
                .map_or(0, |k| k.len());
            if by_r2 >= moved_keys {
                break;
            }
            assert!(joined_at.elapsed() < within, "the joiner never caught up");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let all = joined_at.elapsed();
        println!(
            "run {run}: join: {moved} shards ({moved_keys} keys) moved, settled {settle:?} after the start; their keys reconciled by the new owner after {all:?}"
        );
        joins.push(settle.as_secs_f64());
        join_all.push(all.as_secs_f64());
        // A crash: from the kill until the survivors hold every shard (the lease expired),
        // and until a change to every job, written right after the kill, is reconciled.
        r2.crash();
        let crashed_at = Instant::now();
        setup.write(&writer, a.keys, "v2").await;
        settled(&[&r0, &r1], a.shards, within).await;
        let taken_over = crashed_at.elapsed();
        setup.reconciled(a.keys, "v2", within).await;
        let all = crashed_at.elapsed();
        println!(
            "run {run}: crash: shards taken over {taken_over:?} after the kill (TTL {:?}), every change reconciled after {all:?}",
            a.ttl
        );
        crashes.push(taken_over.as_secs_f64());
        crash_all.push(all.as_secs_f64());
        r0.stop().await;
        r1.stop().await;
    }
    let base = median(per_replicas[0].clone());
    println!();
    println!(
        "| replicas | reconciles/s (median of {}) | vs 1 replica |",
        a.runs
    );
    println!("| --- | --- | --- |");
    for (n, rates) in per_replicas.iter().enumerate() {
        let m = median(rates.clone());
        println!("| {} | {m:.0} | {:.2} |", n + 1, m / base);
    }
    println!();
    println!(
        "handoff on a join (2 -> 3 replicas): every shard held, none handing over, after {:.2} s; the moved keys reconciled by their new owner after {:.2} s (medians)",
        median(joins.clone()),
        median(join_all.clone())
    );
    println!(
        "handoff on a crash (3 -> 2 replicas, lease TTL {:?}): every shard held by the survivors after {:.2} s; a change to every job, written at the kill, reconciled after {:.2} s (medians)",
        a.ttl,
        median(crashes.clone()),
        median(crash_all.clone())
    );
    println!(
        "{{\"bench\":\"sharding\",\"keys\":{},\"work_ms\":{},\"workers\":{},\"rates\":{:?},\"join_settled_s\":{:?},\"join_reconciled_s\":{:?},\"crash_taken_over_s\":{:?},\"crash_reconciled_s\":{:?}}}",
        a.keys,
        a.work.as_millis(),
        a.workers,
        per_replicas,
        joins,
        join_all,
        crashes,
        crash_all
    );
}
