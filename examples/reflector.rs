//! A reflector feeding a DeltaFIFO that this program pops by hand, printing
//! `<DeltaType>: <key>` (the seed's reflector example, over etcd).
mod common;

use std::sync::Arc;

use etcd_informer::{
    DeltaFifo, DeltaType, EtcdListerWatcher, Indexer, JsonCodec, Reflector, ReflectorOptions,
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
    // The store the popped deltas are applied to; the FIFO consults it as its "known objects".
    let store = Indexer::with_namespace_index();
    let fifo = Arc::new(DeltaFifo::new(Some(Arc::new(store.clone()))));
    let options = ReflectorOptions::default().with_name(prefix);
    tokio::spawn(Reflector::new(lw, fifo.clone(), options).run());
    let popping = async {
        loop {
            let popped = fifo
                .pop(|deltas, _| {
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
                })
                .await;
            if popped.is_closed() {
                break;
            }
        }
    };
    tokio::select! {
        _ = popping => {}
        _ = shutdown => fifo.close(),
    }
    Ok(())
}
