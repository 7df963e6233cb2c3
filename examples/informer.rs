//! An informer with handler closures, printing `created:`, `updated:` and `deleted:` lines
//! (the seed's informer example, over etcd).
mod common;

use etcd_informer::{EtcdListerWatcher, Informer, JsonCodec, ResourceEventHandlerFuncs};

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
    let informer = Informer::new(lw, handler, Default::default())?;
    let run = tokio::spawn(informer.clone().run());
    shutdown.await;
    informer.stop();
    let _ = run.await;
    Ok(())
}
