//! What an informer reports about itself: [`InformerHealth`], and the gauges it samples.

use std::sync::atomic::Ordering;

use super::audit::AuditHealth;
use super::shared_informer::SharedIndexInformer;
use crate::reflector::{Health, RevisionHandle};

/// An informer's health; see [`SharedIndexInformer::health`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InformerHealth {
    /// `run` is running.
    pub running: bool,
    /// The first list has been applied.
    pub synced: bool,
    /// The cache's revision ([`SharedIndexInformer::revision`]).
    pub revision: i64,
    /// The revision the reflector has read up to.
    pub last_synced_revision: i64,
    /// Changes whose application to the cache panicked.
    pub apply_panics: u64,
    /// The reflector's connection, last error, relists and restarts.
    pub reflector: Health,
    /// What the audits against etcd found ([`InformerOptions::audit_period`](crate::InformerOptions::audit_period)).
    pub audit: AuditHealth,
}

impl InformerHealth {
    /// Running, synced and connected to etcd: the cache follows etcd.
    pub fn is_healthy(&self) -> bool {
        self.running && self.synced && self.reflector.connected
    }
}

impl<T: Send + Sync + 'static> SharedIndexInformer<T> {
    /// The informer's health, for a readiness probe: fail it unless
    /// [`InformerHealth::is_healthy`], rather than serve a cache that stopped changing.
    ///
    /// ```no_run
    /// # fn demo(informer: etcd_informer::SharedIndexInformer<String>) {
    /// let health = informer.health();
    /// if !health.is_healthy() {
    ///     eprintln!("not ready: {:?}", health.reflector.last_error);
    /// }
    /// # }
    /// ```
    pub fn health(&self) -> InformerHealth {
        InformerHealth {
            running: self.has_started() && !self.shared.stopped.load(Ordering::Acquire),
            synced: self.has_synced(),
            revision: self.revision(),
            last_synced_revision: self.last_synced_revision(),
            apply_panics: self.shared.apply_panics.load(Ordering::Relaxed),
            reflector: self
                .shared
                .revision
                .get()
                .map(RevisionHandle::health)
                .unwrap_or_default(),
            audit: self.shared.audit.get(),
        }
    }
}
