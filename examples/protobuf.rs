//! The informer over values encoded with the protobuf schema of `proto/configmap.proto`.
//! Writes one demo object (`tmp/protobuf-demo`) so there is something to see.
mod common;

use etcd_informer::client::TypedClient;
use etcd_informer::proto::ConfigMap;
use etcd_informer::{EtcdListerWatcher, Informer, ProstCodec, ResourceEventHandlerFuncs};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let shutdown = common::shutdown_signal();
    let (client, _etcd) = common::etcd().await;
    let prefix = common::arg("prefix", "/registry/configmaps-pb/");
    let writer = TypedClient::new(
        client.clone(),
        prefix.clone(),
        ProstCodec::<ConfigMap>::new(),
    )?;
    let demo = ConfigMap {
        namespace: "tmp".into(),
        name: "protobuf-demo".into(),
        labels: [("app".to_string(), "demo".to_string())].into(),
        data: [("greeting".to_string(), "hello".to_string())].into(),
    };
    writer.put("tmp/protobuf-demo", &demo).await?;
    let lw = EtcdListerWatcher::new(client, prefix, ProstCodec::<ConfigMap>::new())?;
    let handler = ResourceEventHandlerFuncs::<ConfigMap>::new()
        .on_add(|cm, _| say!("created: {} {:?}", cm.key(), cm.value.data))
        .on_update(|_, cm| say!("updated: {} {:?}", cm.key(), cm.value.data))
        .on_delete(|cm| say!("deleted: {}", cm.key()));
    let informer = Informer::new(lw, handler, Default::default())?;
    let run = tokio::spawn(informer.clone().run());
    shutdown.await;
    informer.stop();
    let _ = run.await;
    Ok(())
}
