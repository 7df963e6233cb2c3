//! An informer with handler closures, printing `created:`, `updated:` and `deleted:` lines
//! (the seed's informer example, over etcd).
//!
//! `--snapshot PATH` turns on warm restarts: the cache is saved to PATH every minute and on
//! Ctrl-C, and the next start loads it instead of listing when etcd still has its revision.
//! Once synced, one line says how it started: `snapshot: warm start from the snapshot at
//! revision R (N keys), no list`, or `snapshot: cold start: <why>`.
mod common;

use etcd_informer::{
    EtcdListerWatcher, Informer, InformerOptions, JsonCodec, ResourceEventHandlerFuncs,
};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let shutdown = common::shutdown_signal();
    let (client, _etcd) = common::etcd().await;
    let lw = EtcdListerWatcher::new(
        client,
        common::prefix(),
        JsonCodec::<common::ConfigMap>::new(),
    )?;
    let handler = ResourceEventHandlerFuncs::new()
        .on_add(|cm, _| say!("created: {}", cm.key()))
        .on_update(|_, cm| say!("updated: {}", cm.key()))
        .on_delete(|cm| say!("deleted: {}", cm.key()));
    let snapshot = common::arg("snapshot", "");
    let mut options = InformerOptions::default();
    if !snapshot.is_empty() {
        options = options.with_snapshot(snapshot, JsonCodec::new());
    }
    let informer = Informer::new(lw, handler, options)?;
    let run = tokio::spawn(informer.clone().run());
    let synced = informer.clone();
    tokio::spawn(async move {
        synced.wait_for_cache_sync().await;
        if let Some(start) = synced.snapshot_start() {
            say!("snapshot: {start}");
        }
    });
    shutdown.await;
    informer.stop();
    let _ = run.await;
    Ok(())
}
