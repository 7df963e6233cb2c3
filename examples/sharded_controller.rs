//! A controller shared by several processes: each job `/demo/jobs/K` is reconciled by exactly
//! one replica, which writes `/demo/done/K` = `NAME REV` (the job's `mod_revision` it saw),
//! fenced by its shard's owner record, then prints `reconciled K by NAME at REV`.
//!
//! Replicas share the job keys over 64 shards held with etcd leases (`--lease-ttl`, 5 s): start
//! or stop one and about a third of the shards move; kill one (`kill -9`) and the others take
//! its shards over once its lease expires. Ctrl-C hands this replica's shards over and exits 0.
//! Several replicas must share one etcd: set `ETCD_ENDPOINTS` (a throwaway etcd is started
//! only when none is given and nothing answers on 127.0.0.1:2379).
//!
//! Options: `--name NAME` (required, unique per replica), `--prefix` (default `/demo/jobs/`),
//! `--lease-ttl SECONDS` (5), `--workers N` (4), `--work-ms MS` (0: how long each reconcile
//! waits, as an I/O-bound one would).
//!
//! ```text
//! export ETCD_ENDPOINTS=127.0.0.1:2379
//! cargo run --example sharded_controller -- --name a &
//! cargo run --example sharded_controller -- --name b &
//! for i in $(seq 1 20); do etcdctl put /demo/jobs/job-$i run; done
//! etcdctl get --prefix /demo/done/
//! ```
mod common;

use std::time::Duration;

use etcd_informer::client::{TypedClient, WriteError};
use etcd_informer::runner::{Action, Context, Runner};
use etcd_informer::sharding::ShardedRunner;
use etcd_informer::{EtcdListerWatcher, SharedIndexInformer, TextCodec};

const DONE_PREFIX: &str = "/demo/done/";

#[tokio::main]
async fn main() {
    let shutdown = common::shutdown_signal();
    let name = common::arg("name", "");
    if name.is_empty() {
        eprintln!("error: --name NAME is required (unique per replica)");
        std::process::exit(2);
    }
    let prefix = common::arg("prefix", "/demo/jobs/");
    let number = |flag: &str, default: &str| -> u64 {
        let value = common::arg(flag, default);
        value.parse().unwrap_or_else(|_| {
            eprintln!("error: --{flag} must be a whole number, not {value:?}");
            std::process::exit(2);
        })
    };
    let ttl = Duration::from_secs(number("lease-ttl", "5"));
    let workers = number("workers", "4") as usize;
    let work = Duration::from_millis(number("work-ms", "0"));

    let (client, _etcd) = common::etcd().await;
    let lw =
        EtcdListerWatcher::new(client.clone(), prefix.as_str(), TextCodec).unwrap_or_else(|e| {
            eprintln!("error: {e}");
            std::process::exit(2);
        });
    let jobs = SharedIndexInformer::new(lw, Default::default());
    tokio::spawn(jobs.clone().run());
    let done = TypedClient::new(client.clone(), DONE_PREFIX, TextCodec).unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(2);
    });

    let runner = Runner::new("sharded-jobs").watch(&jobs).workers(workers);
    let sharded = ShardedRunner::new(runner, client, name.clone())
        .lease_ttl(ttl)
        .records_prefix(records_prefix(&prefix));
    let me = name.clone();
    let reconcile = move |ctx: Context| {
        let (done, me) = (done.clone(), me.clone());
        async move {
            // A deleted job has nothing to do.
            let Some(job) = ctx.object::<String>() else {
                return Ok(Action::Done);
            };
            tokio::time::sleep(work).await;
            let done = match ctx.fence() {
                Some(fence) => done.fenced(fence.clone()),
                None => done,
            };
            let revision = job.mod_revision;
            match done.put(ctx.key(), &format!("{me} {revision}")).await {
                Ok(_) => {
                    say!("reconciled {} by {me} at {revision}", ctx.key());
                    Ok(Action::Done)
                }
                // The shard moved on: its new owner reconciles the job.
                Err(e @ WriteError::Fenced { .. }) => {
                    eprintln!("warning: {e}");
                    Ok(Action::Done)
                }
                Err(e) => Err(e),
            }
        }
    };
    eprintln!("{name}: sharing the jobs under {prefix} (lease TTL {ttl:?})");
    sharded.run_with_context(reconcile, shutdown).await;
    jobs.stop();
    eprintln!("{name}: shards handed over; bye");
}

/// Where the replicas keep their records: beside the jobs, never under them (the jobs informer
/// would take them for jobs). `/demo/jobs/` -> `/demo/sharding/jobs/`.
fn records_prefix(jobs: &str) -> String {
    match jobs.trim_end_matches('/').rsplit_once('/') {
        Some((parent, leaf)) => format!("{parent}/sharding/{leaf}/"),
        None => "/sharding/".to_owned(),
    }
}
