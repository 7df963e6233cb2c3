//! One shared informer per prefix and type, started and waited for together.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use etcd_client::Client;

use super::options::InformerOptions;
use super::shared_informer::SharedIndexInformer;
use crate::codec::Codec;
use crate::listwatch::etcd::{ConfigError, EtcdListerWatcher, EtcdOptions};
use crate::sync::lock;

struct Entry {
    informer: Box<dyn Any + Send + Sync>,
    run: Option<Box<dyn FnOnce() -> tokio::task::JoinHandle<()> + Send>>,
    has_synced: Box<dyn Fn() -> bool + Send + Sync>,
    stop: Box<dyn Fn() + Send + Sync>,
}

/// Hands out one [`SharedIndexInformer`] per (prefix, type) over one etcd client, so every part
/// of a program that asks for the same prefix shares one watch and one cache (client-go's
/// `SharedInformerFactory`).
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use etcd_informer::{JsonCodec, SharedInformerFactory};
/// let factory = SharedInformerFactory::new(etcd_informer::connect(["127.0.0.1:2379"]).await?);
/// let cms = factory.informer_for("/registry/configmaps/", JsonCodec::<serde_json::Value>::new())?;
/// let same = factory.informer_for("/registry/configmaps/", JsonCodec::<serde_json::Value>::new())?;
/// factory.start();
/// factory.wait_for_cache_sync().await;
/// assert_eq!(cms.lister().len(), same.lister().len());
/// # Ok(()) }
/// ```
pub struct SharedInformerFactory {
    client: Client,
    etcd: EtcdOptions,
    resync_period: Duration,
    informers: Mutex<HashMap<(Vec<u8>, TypeId), Entry>>,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl SharedInformerFactory {
    /// A factory over `client` with default options.
    pub fn new(client: Client) -> Self {
        Self::with_options(client, EtcdOptions::default(), Duration::ZERO)
    }

    /// A factory whose informers use `etcd` options and the default handler resync period
    /// `resync_period`.
    pub fn with_options(client: Client, etcd: EtcdOptions, resync_period: Duration) -> Self {
        SharedInformerFactory {
            client,
            etcd,
            resync_period,
            informers: Mutex::new(HashMap::new()),
            tasks: Mutex::new(Vec::new()),
        }
    }

    /// The informer for `prefix` and `T`, created on first request (with `codec` and the
    /// namespace index) and shared afterwards.
    pub fn informer_for<T, C>(
        &self,
        prefix: impl Into<Vec<u8>>,
        codec: C,
    ) -> Result<SharedIndexInformer<T>, ConfigError>
    where
        T: Send + Sync + 'static,
        C: Codec<T>,
    {
        let prefix = prefix.into();
        let mut informers = lock(&self.informers);
        let key = (prefix.clone(), TypeId::of::<T>());
        if let Some(entry) = informers.get(&key) {
            if let Some(informer) = entry.informer.downcast_ref::<SharedIndexInformer<T>>() {
                return Ok(informer.clone());
            }
        }
        let name = String::from_utf8_lossy(&prefix).into_owned();
        let lw =
            EtcdListerWatcher::with_options(self.client.clone(), prefix, codec, self.etcd.clone())?;
        let informer = SharedIndexInformer::new(
            lw,
            InformerOptions {
                name,
                resync_period: self.resync_period,
                ..Default::default()
            },
        );
        let (run, synced, stop) = (informer.clone(), informer.clone(), informer.clone());
        informers.insert(
            key,
            Entry {
                informer: Box::new(informer.clone()),
                run: Some(Box::new(move || tokio::spawn(run.run()))),
                has_synced: Box::new(move || synced.has_synced()),
                stop: Box::new(move || stop.stop()),
            },
        );
        Ok(informer)
    }

    /// Starts every informer not started yet (on the current tokio runtime).
    pub fn start(&self) {
        let mut informers = lock(&self.informers);
        let mut tasks = lock(&self.tasks);
        for entry in informers.values_mut() {
            if let Some(run) = entry.run.take() {
                tasks.push(run());
            }
        }
    }

    /// Whether every informer handed out has synced.
    pub fn has_synced(&self) -> bool {
        let informers = lock(&self.informers);
        informers.values().all(|e| (e.has_synced)())
    }

    /// Waits until every informer has synced; cancel by dropping the future.
    pub async fn wait_for_cache_sync(&self) {
        super::shared_informer::wait_until(|| self.has_synced()).await
    }

    /// Stops every informer and waits for them to end.
    pub async fn shutdown(&self) {
        {
            let informers = lock(&self.informers);
            for entry in informers.values() {
                (entry.stop)();
            }
        }
        let tasks = std::mem::take(&mut *lock(&self.tasks));
        for task in tasks {
            let _ = task.await;
        }
    }
}
