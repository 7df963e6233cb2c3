//! A small real controller without Kubernetes: a "replica set" over etcd.
//!
//! For each spec `/demo/replicasets/<name>` = `{"replicas": n}` it keeps exactly the pods
//! `/demo/pods/<name>-0` .. `<name>-(n-1)` (JSON `{"owner": name, "index": i}`), creating and
//! deleting them as specs change. Run two instances: only the leader of the election
//! `/demo/election/replicaset-controller` acts; kill it and the other takes over within about
//! the lease TTL (`--ttl`, 5 s).
//!
//! Try it (with a throwaway or docker-compose etcd on 127.0.0.1:2379):
//! ```text
//! cargo run --example lightweight_controller -- --id a &
//! cargo run --example lightweight_controller -- --id b &
//! etcdctl put /demo/replicasets/web '{"replicas": 3}'
//! etcdctl get --prefix /demo/pods/ --keys-only
//! ```
mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use etcd_informer::client::{TypedClient, WriteError};
use etcd_informer::leader_election::LeaderElector;
use etcd_informer::listwatch::etcd::EtcdOptions;
use etcd_informer::runner::{Action, Runner};
use etcd_informer::{EtcdListerWatcher, JsonCodec, Lister, Object, SharedIndexInformer};

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct ReplicaSet {
    replicas: i64,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Pod {
    owner: String,
    index: i64,
}

const SPECS: &str = "/demo/replicasets/";
const PODS: &str = "/demo/pods/";
const OWNER_INDEX: &str = "owner";
/// The most pods one spec may ask for: a typo must not flood etcd.
const MAX_REPLICAS: i64 = 1000;

struct Reconciler {
    specs: Lister<ReplicaSet>,
    pods: Lister<Pod>,
    spec_client: TypedClient<ReplicaSet>,
    pod_client: TypedClient<Pod>,
    identity: String,
}

impl Reconciler {
    async fn reconcile(&self, name: String) -> Result<Action, WriteError> {
        let replicas = match self.specs.get(&name) {
            Some(spec) => spec.value.replicas,
            None => match self.spec_client.get(&name).await {
                // Present in etcd but not in the cache: undecodable. Leave its pods alone.
                Err(WriteError::Decode(e)) => {
                    eprintln!("[{}] skipping {SPECS}{name}: {e}", self.identity);
                    return Ok(Action::Done);
                }
                Err(e) => return Err(e),
                Ok(Some(spec)) => spec.value.replicas,
                Ok(None) => 0,
            },
        };
        if !(0..=MAX_REPLICAS).contains(&replicas) {
            eprintln!(
                "[{}] skipping {SPECS}{name}: replicas {replicas} is not within 0..={MAX_REPLICAS}",
                self.identity
            );
            return Ok(Action::Done);
        }
        let owned: HashMap<i64, Arc<Object<Pod>>> = self
            .pods
            .by_index(OWNER_INDEX, &name)
            .unwrap_or_default()
            .into_iter()
            .map(|p| (p.value.index, p))
            .collect();
        for index in 0..replicas {
            if owned.contains_key(&index) {
                continue;
            }
            let pod = Pod {
                owner: name.clone(),
                index,
            };
            match self
                .pod_client
                .create(&format!("{name}-{index}"), &pod)
                .await
            {
                Ok(_) => println!("[{}] created {PODS}{name}-{index}", self.identity),
                // Created already (the cache had not seen it yet): fine.
                Err(e) if e.is_conflict() => {}
                Err(e) => return Err(e),
            }
        }
        for (index, pod) in owned.iter().filter(|(i, _)| **i >= replicas) {
            match self.pod_client.delete(pod.key(), pod.mod_revision).await {
                Ok(_) => println!("[{}] deleted {PODS}{name}-{index}", self.identity),
                // Changed since we looked: the change will bring us back here.
                Err(e) if e.is_conflict() => {}
                Err(e) => return Err(e),
            }
        }
        Ok(Action::Done)
    }
}

fn informer<T>(
    client: &etcd_client::Client,
    prefix: &str,
) -> Result<SharedIndexInformer<T>, Box<dyn std::error::Error>>
where
    T: serde::Serialize + serde::de::DeserializeOwned + Send + Sync + 'static,
{
    let options = EtcdOptions {
        on_decode_error: Some(Arc::new(|e| eprintln!("undecodable: {e}"))),
        ..Default::default()
    };
    let lw =
        EtcdListerWatcher::with_options(client.clone(), prefix, JsonCodec::<T>::new(), options)?;
    Ok(SharedIndexInformer::new(lw, Default::default()))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let shutdown = common::shutdown_signal();
    let (client, _etcd) = common::etcd().await;
    let identity = common::arg("id", &format!("pid-{}", std::process::id()));
    let ttl = Duration::from_secs(common::arg("ttl", "5").parse().unwrap_or(5));

    let specs = informer::<ReplicaSet>(&client, SPECS)?;
    let pods = informer::<Pod>(&client, PODS)?;
    let mut owner = HashMap::new();
    owner.insert(
        OWNER_INDEX.to_string(),
        Arc::new(|p: &Object<Pod>| vec![p.value.owner.clone()])
            as etcd_informer::store::IndexFunc<Pod>,
    );
    pods.add_indexers(owner)?;
    tokio::spawn(specs.clone().run());
    tokio::spawn(pods.clone().run());

    let reconciler = Arc::new(Reconciler {
        specs: specs.lister(),
        pods: pods.lister(),
        spec_client: TypedClient::new(client.clone(), SPECS, JsonCodec::new())?,
        pod_client: TypedClient::new(client.clone(), PODS, JsonCodec::new())?,
        identity: identity.clone(),
    });
    let elector = LeaderElector::new(
        client.clone(),
        "/demo/election/replicaset-controller",
        identity.clone(),
    )
    .with_ttl(ttl);
    tokio::pin!(shutdown);
    println!("[{identity}] waiting to lead");
    loop {
        let runner = Runner::new("replicaset")
            .watch(&specs)
            .watch_mapped(&pods, |p: &Object<Pod>| vec![p.value.owner.clone()])
            .workers(2);
        let r = reconciler.clone();
        let reconcile = move |name: String| {
            let r = r.clone();
            async move { r.reconcile(name).await }
        };
        match runner
            .run_as_leader(&elector, reconcile, &mut shutdown)
            .await
        {
            Ok(()) => break,
            Err(e) => {
                eprintln!("[{identity}] {e}; campaigning again");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
    println!("[{identity}] stopped");
    Ok(())
}
