//! After the cache has synced, prints the keys in `--namespace` (default `tmp`) through the
//! namespace index, or with `--label k=v` the keys whose labels match, through a label index
//! (the seed's indexer example, over etcd).
mod common;

use std::collections::HashMap;

use etcd_informer::{EtcdListerWatcher, JsonCodec, Object, SharedIndexInformer, NAMESPACE_INDEX};

const LABEL_INDEX: &str = "label";

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
    let mut labels: etcd_informer::Indexers<common::ConfigMap> = HashMap::new();
    labels.insert(
        LABEL_INDEX.into(),
        etcd_informer::IndexFunc::new(|cm: &Object<common::ConfigMap>| {
            cm.value
                .labels
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect()
        }),
    );
    informer.add_indexers(labels)?;
    let run = tokio::spawn(informer.clone().run());
    informer.wait_for_cache_sync().await;
    let label = common::arg("label", "");
    let keys = if label.is_empty() {
        informer
            .indexer()
            .index_keys(NAMESPACE_INDEX, &common::arg("namespace", "tmp"))?
    } else {
        informer.indexer().index_keys(LABEL_INDEX, &label)?
    };
    let mut keys: Vec<_> = keys.iter().map(|k| k.to_string()).collect();
    keys.sort();
    for key in keys {
        say!("{key}");
    }
    shutdown.await;
    informer.stop();
    let _ = run.await;
    Ok(())
}
