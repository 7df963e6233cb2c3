//! A small real controller without Kubernetes: a "replica set" over etcd.
//!
//! For each spec `/demo/replicasets/<name>` = `{"replicas": n}` it keeps exactly the pods
//! `/demo/pods/<name>-0` .. `<name>-(n-1)` (JSON `{"owner": name, "index": i}`), creating and
//! deleting them as specs change. Run two instances: only the leader of the election
//! `/demo/election/replicaset-controller` acts; kill it and the other takes over within about
//! the lease TTL (`--ttl`, 5 s). `--prefix` moves everything from `/demo/` elsewhere.
//!
//! `--metrics-addr 127.0.0.1:9090` serves the crate's metrics in Prometheus text format at
//! `/metrics` (an address already in use fails at start, with status 2).
//!
//! Try it (with a throwaway or docker-compose etcd on 127.0.0.1:2379):
//! ```text
//! cargo run --example lightweight_controller -- --id a &
//! cargo run --example lightweight_controller -- --id b &
//! etcdctl put /demo/replicasets/web '{"replicas": 3}'
//! etcdctl get --prefix /demo/pods/ --keys-only
//! cargo run --example lightweight_controller -- --id c --metrics-addr 127.0.0.1:9090 &
//! curl -s 127.0.0.1:9090/metrics | grep etcd_informer_
//! ```
mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use etcd_informer::client::{TypedClient, WriteError};
use etcd_informer::leader_election::LeaderElector;
use etcd_informer::listwatch::etcd::EtcdOptions;
use etcd_informer::runner::{Action, Context, Runner};
use etcd_informer::{EtcdListerWatcher, InformerOptions, JsonCodec, Object, SharedIndexInformer};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct ReplicaSet {
    replicas: i64,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Pod {
    owner: String,
    index: i64,
}

const OWNER_INDEX: &str = "owner";
/// The most pods one spec may ask for: a typo must not flood etcd.
const MAX_REPLICAS: i64 = 1000;

struct Reconciler {
    specs_prefix: String,
    pods_prefix: String,
    spec_client: TypedClient<ReplicaSet>,
    pod_client: TypedClient<Pod>,
    identity: String,
}

impl Reconciler {
    async fn reconcile(&self, ctx: Context) -> Result<Action, WriteError> {
        let (name, specs, pods) = (ctx.key(), &self.specs_prefix, &self.pods_prefix);
        let replicas = match ctx.object::<ReplicaSet>() {
            Some(spec) => spec.value.replicas,
            None => match self.spec_client.get(name).await {
                // Present in etcd but not in the cache: undecodable. Leave its pods alone.
                Err(WriteError::Decode(e)) => {
                    eprintln!("[{}] skipping {specs}{name}: {e}", self.identity);
                    return Ok(Action::Done);
                }
                Err(e) => return Err(e),
                Ok(Some(spec)) => spec.value.replicas,
                Ok(None) => 0,
            },
        };
        if !(0..=MAX_REPLICAS).contains(&replicas) {
            eprintln!(
                "[{}] skipping {specs}{name}: replicas {replicas} is not within 0..={MAX_REPLICAS}",
                self.identity
            );
            return Ok(Action::Done);
        }
        let owned: HashMap<i64, Arc<Object<Pod>>> = ctx
            .lister::<Pod>()
            .expect("the runner watches pods")
            .by_index(OWNER_INDEX, name)
            .unwrap_or_default()
            .into_iter()
            .map(|p| (p.value.index, p))
            .collect();
        for index in 0..replicas {
            if owned.contains_key(&index) {
                continue;
            }
            let pod = Pod {
                owner: name.to_owned(),
                index,
            };
            match self
                .pod_client
                .create(&format!("{name}-{index}"), &pod)
                .await
            {
                Ok(_) => println!("[{}] created {pods}{name}-{index}", self.identity),
                // Created already (the cache had not seen it yet): fine.
                Err(e) if e.is_conflict() => {}
                Err(e) => return Err(e),
            }
        }
        for (index, pod) in owned.iter().filter(|(i, _)| **i >= replicas) {
            match self.pod_client.delete(pod.key(), pod.mod_revision).await {
                Ok(_) => println!("[{}] deleted {pods}{name}-{index}", self.identity),
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
    let options = EtcdOptions::default()
        .with_on_decode_error(Some(Arc::new(|e| eprintln!("undecodable: {e}"))));
    let lw =
        EtcdListerWatcher::with_options(client.clone(), prefix, JsonCodec::<T>::new(), options)?;
    let options = InformerOptions::default().with_name(prefix.to_owned());
    Ok(SharedIndexInformer::new(lw, options))
}

/// Serves the metrics in Prometheus text format on `addr` (`GET /metrics`), or exits with
/// status 2 naming the address if it cannot be bound.
async fn serve_metrics(addr: &str) {
    let listener = match TcpListener::bind(addr).await {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!("error: cannot serve metrics on {addr} (--metrics-addr): {e}");
            std::process::exit(2);
        }
    };
    // Buckets from 50 µs (a change's stages take well under a millisecond) to about 13 s for
    // every duration histogram (the default would render them as summaries).
    let buckets: Vec<f64> = (0..19).map(|i| 0.000_05 * 2f64.powi(i)).collect();
    let handle = PrometheusBuilder::new()
        .set_buckets(&buckets)
        .and_then(PrometheusBuilder::install_recorder)
        .unwrap_or_else(|e| {
            eprintln!("error: cannot install the metrics recorder: {e}");
            std::process::exit(2);
        });
    etcd_informer::metrics::describe();
    eprintln!("serving metrics on http://{addr}/metrics");
    let upkeep = handle.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            upkeep.run_upkeep();
        }
    });
    tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((conn, _)) => {
                    tokio::spawn(answer(conn, handle.clone()));
                }
                Err(e) => {
                    eprintln!("metrics: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    });
}

/// Answers one HTTP request: the metrics for `GET /metrics`, 404 otherwise.
async fn answer(mut conn: tokio::net::TcpStream, handle: PrometheusHandle) {
    let mut request = Vec::new();
    let mut buf = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 16 * 1024 {
        match conn.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => request.extend_from_slice(&buf[..n]),
        }
    }
    let (status, body) = if request.starts_with(b"GET /metrics ") {
        ("200 OK", handle.render())
    } else {
        ("404 Not Found", "try GET /metrics\n".to_owned())
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = conn.write_all(head.as_bytes()).await;
    let _ = conn.write_all(body.as_bytes()).await;
    let _ = conn.shutdown().await;
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let shutdown = common::shutdown_signal();
    // First, so that a taken address fails at once, before anything else is started.
    let metrics_addr = common::arg("metrics-addr", "");
    if !metrics_addr.is_empty() {
        serve_metrics(&metrics_addr).await;
    }
    let (client, _etcd) = common::etcd().await;
    let identity = common::arg("id", &format!("pid-{}", std::process::id()));
    let ttl = Duration::from_secs(common::arg("ttl", "5").parse().unwrap_or(5));
    let prefix = common::arg("prefix", "/demo/");
    let specs_prefix = format!("{prefix}replicasets/");
    let pods_prefix = format!("{prefix}pods/");

    let specs = informer::<ReplicaSet>(&client, &specs_prefix)?;
    let pods = informer::<Pod>(&client, &pods_prefix)?;
    let mut owner = HashMap::new();
    owner.insert(
        OWNER_INDEX.to_string(),
        etcd_informer::IndexFunc::new(|p: &Object<Pod>| vec![p.value.owner.clone()]),
    );
    pods.add_indexers(owner)?;
    tokio::spawn(specs.clone().run());
    tokio::spawn(pods.clone().run());

    let reconciler = Arc::new(Reconciler {
        spec_client: TypedClient::new(client.clone(), &specs_prefix, JsonCodec::new())?,
        pod_client: TypedClient::new(client.clone(), &pods_prefix, JsonCodec::new())?,
        specs_prefix,
        pods_prefix,
        identity: identity.clone(),
    });
    let reconcile = move |ctx: Context| {
        let r = reconciler.clone();
        async move { r.reconcile(ctx).await }
    };
    let elector = LeaderElector::new(
        client.clone(),
        format!("{prefix}election/replicaset-controller"),
        identity.clone(),
    )
    .with_ttl(ttl);
    // One runner for the process: after losing leadership it campaigns again as it is.
    let mut runner = Runner::new("replicaset")
        .watch(&specs)
        .watch_mapped(&pods, |p: &Object<Pod>| vec![p.value.owner.clone()])
        .workers(2)
        .reconcile_timeout(Duration::from_secs(30));
    tokio::pin!(shutdown);
    println!("[{identity}] waiting to lead");
    loop {
        match runner
            .run_as_leader(&elector, reconcile.clone(), &mut shutdown)
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
