//! Informers: the controller loop, the single-handler `Informer` and the `SharedIndexInformer`.

mod apply;
pub(crate) mod audit;
mod backlog;
mod consistency;
mod controller;
mod event_stream;
mod factory;
mod handler;
mod health;
mod options;
mod processor;
mod registration;
mod shared_informer;
mod snapshot;
mod watchdog;

pub use crate::queue::{MAX_RESYNC_PERIOD, MIN_RESYNC_PERIOD};
pub use crate::reflector::TransformFn;
pub use audit::{AuditHealth, AuditReport};
pub use consistency::ConsistencyError;
pub(crate) use controller::AbortOnDrop;
pub use controller::{Controller, ControllerConfig, ProcessError, ProcessFn};
pub use event_stream::EventStream;
pub use factory::SharedInformerFactory;
pub use handler::{DeletedObject, Event, ResourceEventHandler, ResourceEventHandlerFuncs};
pub use health::InformerHealth;
pub use options::{
    InformerOptions, Processing, RelistUnchanged, DEFAULT_AUDIT_PERIOD, DEFAULT_STREAM_BACKLOG,
};
pub use registration::{HandlerRegistration, REMOVE_PATIENCE};
pub use shared_informer::{InformerError, SharedIndexInformer};

use crate::lister::Lister;
use crate::listwatch::ListerWatcher;
use crate::store::Indexer;

/// An informer with exactly one handler, fixed at construction (client-go's `NewInformer` /
/// `NewIndexerInformer`).
///
/// ```no_run
/// # async fn demo(lw: impl etcd_informer::ListerWatcher<String>) {
/// use etcd_informer::{Informer, ResourceEventHandlerFuncs};
/// let handler = ResourceEventHandlerFuncs::new().on_add(|o, _| println!("created: {}", o.key()));
/// let informer = Informer::new(lw, handler, Default::default()).expect("handler thread");
/// tokio::spawn(informer.clone().run());
/// informer.wait_for_cache_sync().await;
/// # }
/// ```
pub struct Informer<T> {
    inner: SharedIndexInformer<T>,
    registration: std::sync::Arc<HandlerRegistration<T>>,
}

impl<T> Clone for Informer<T> {
    fn clone(&self) -> Self {
        Informer {
            inner: self.inner.clone(),
            registration: self.registration.clone(),
        }
    }
}

impl<T: Send + Sync + 'static> Informer<T> {
    /// An informer over `source` delivering to `handler`.
    pub fn new(
        source: impl ListerWatcher<T>,
        handler: impl ResourceEventHandler<T>,
        options: InformerOptions<T>,
    ) -> Result<Self, InformerError> {
        let inner = SharedIndexInformer::new(source, options);
        let registration = std::sync::Arc::new(inner.add_event_handler(handler)?);
        Ok(Informer {
            inner,
            registration,
        })
    }

    /// Runs until [`stop`](Self::stop) or until the future is dropped.
    pub async fn run(self) {
        self.inner.run().await
    }

    /// Stops the informer.
    pub fn stop(&self) {
        self.inner.stop()
    }

    /// Whether the cache has synced and the handler received every initial add.
    pub fn has_synced(&self) -> bool {
        self.registration.has_synced()
    }

    /// Waits until [`has_synced`](Self::has_synced); cancel by dropping the future.
    pub async fn wait_for_cache_sync(&self) {
        shared_informer::wait_until(|| self.has_synced()).await
    }

    /// The cache.
    pub fn indexer(&self) -> &Indexer<T> {
        self.inner.indexer()
    }

    /// Typed read access to the cache.
    pub fn lister(&self) -> Lister<T> {
        self.inner.lister()
    }

    /// How the informer started when snapshots are on (warm restart, issue 26); see
    /// [`SharedIndexInformer::snapshot_start`].
    pub fn snapshot_start(&self) -> Option<crate::snapshot::SnapshotStart> {
        self.inner.snapshot_start()
    }
}
