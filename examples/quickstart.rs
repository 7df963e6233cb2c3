//! The shortest useful program: cache a prefix, print changes, read the cache.
mod common;

use etcd_informer::{EtcdListerWatcher, JsonCodec, ResourceEventHandlerFuncs, SharedIndexInformer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let shutdown = common::shutdown_signal();
    let (client, _etcd) = common::etcd().await;
    let lw = EtcdListerWatcher::new(
        client,
        common::prefix(),
        JsonCodec::<common::ConfigMap>::new(),
    )?;
    let informer = SharedIndexInformer::new(lw, Default::default());
    informer.add_event_handler(
        ResourceEventHandlerFuncs::new()
            .on_add(|cm, _| say!("created: {}", cm.key()))
            .on_update(|_, cm| say!("updated: {}", cm.key()))
            .on_delete(|cm| say!("deleted: {}", cm.key())),
    )?;
    tokio::spawn(informer.clone().run());
    informer.wait_for_cache_sync().await;
    say!("synced: {} objects", informer.lister().len());
    shutdown.await;
    informer.stop();
    Ok(())
}
