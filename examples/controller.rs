//! The reflector and DeltaFIFO driven by the controller loop, with a process function
//! printing `<DeltaType>: <key>` (the seed's controller example, over etcd).
mod common;

use std::sync::Arc;

use etcd_informer::{
    Controller, ControllerConfig, DeltaFifo, DeltaType, EtcdListerWatcher, Indexer, JsonCodec,
    ReflectorOptions,
};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let shutdown = common::shutdown_signal();
    let (client, _etcd) = common::etcd().await;
    let prefix = common::prefix();
    let lw = EtcdListerWatcher::new(
        client,
        prefix.clone(),
        JsonCodec::<common::ConfigMap>::new(),
    )?;
    let store = Indexer::with_namespace_index();
    let fifo = Arc::new(DeltaFifo::new(Some(Arc::new(store.clone()))));
    let controller = Controller::new(ControllerConfig {
        lister_watcher: lw,
        queue: fifo.clone(),
        process: Box::new(move |deltas, _| {
            for d in deltas {
                if d.is_final_state_unknown() {
                    say!("{} (final state unknown): {}", d.kind, d.object.key());
                } else {
                    say!("{}: {}", d.kind, d.object.key());
                }
                match d.kind {
                    DeltaType::Deleted => {
                        store.delete(d.object.key());
                    }
                    _ => {
                        store.add(d.object.clone());
                    }
                }
            }
            Ok(())
        }),
        retry_on_error: true,
        reflector: ReflectorOptions::default().with_name(prefix),
    });
    let run = tokio::spawn(controller.run());
    shutdown.await;
    fifo.close();
    let _ = run.await;
    Ok(())
}
