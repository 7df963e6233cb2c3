//! Two handlers on one shared informer (the seed's shared informer example, over etcd).
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
            .on_add(|cm, _| say!("created, namespace: {}", cm.namespace())),
    )?;
    informer.add_event_handler(
        ResourceEventHandlerFuncs::new().on_add(|cm, _| say!("created, name: {}", cm.name())),
    )?;
    let run = tokio::spawn(informer.clone().run());
    shutdown.await;
    informer.stop();
    let _ = run.await;
    Ok(())
}
