//! What a reflector has been through, for readiness probes and consistent reads: its
//! connection, when the source last proved the cache fresh, its relists by reason, its
//! restarts; read through a cloneable [`RevisionHandle`] while it runs.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use crate::sync::lock;

/// How many times a reflector listed, by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Relists {
    /// The first list.
    pub initial: u64,
    /// The watched revision was compacted (etcd's 410 Gone).
    pub compacted: u64,
    /// The store was wiped, restored or replaced (see [`Error::StoreReplaced`](crate::listwatch::Error::StoreReplaced)), or the key
    /// tally differed when a watch opened again ([`Error::TallyDiffers`](crate::listwatch::Error::TallyDiffers)).
    pub store_replaced: u64,
    /// The reflector's task panicked and started over with a fresh list.
    pub error: u64,
    /// The informer's audit found the cache differing from etcd (an event lost) and asked
    /// for a relist to repair it.
    pub audit: u64,
}

impl Relists {
    /// Relists of every reason.
    pub fn total(&self) -> u64 {
        self.initial + self.compacted + self.store_replaced + self.error + self.audit
    }
}

/// What a reflector has been through, for readiness probes: a cache that stops changing must
/// not look healthy. See [`SharedIndexInformer::health`](crate::SharedIndexInformer::health).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Health {
    /// A list succeeded and the watch after it is open, with no failure since, and the watch
    /// proved alive within the source's [liveness bound](crate::listwatch::Capabilities::liveness_bound): a
    /// watch that has gone silent for longer is not connected, even if nothing failed.
    pub connected: bool,
    /// When the source last proved the cache fresh: a list, or anything its watch stream
    /// yielded (events, bookmarks, the etcd source's answered probes). `None` before the first
    /// list. See [`seconds_since_proven_fresh`](Self::seconds_since_proven_fresh).
    pub proven_fresh_at: Option<SystemTime>,
    /// Since when it is not connected (`None` while connected).
    pub disconnected_since: Option<SystemTime>,
    /// The last list or watch failure (or panic), and when it happened.
    pub last_error: Option<(String, SystemTime)>,
    /// Relists by reason.
    pub relists: Relists,
    /// How many times the reflector's task panicked and was started again (with a relist).
    pub restarts: u64,
}

impl Health {
    /// Seconds since the source last proved the cache fresh ([`proven_fresh_at`]), as of now;
    /// `None` before the first list. Alert when it passes the source's liveness bound (2 s for
    /// the etcd source by default): the cache may have stopped following etcd.
    ///
    /// [`proven_fresh_at`]: Self::proven_fresh_at
    pub fn seconds_since_proven_fresh(&self) -> Option<f64> {
        let at = self.proven_fresh_at?;
        Some(
            SystemTime::now()
                .duration_since(at)
                .unwrap_or_default()
                .as_secs_f64(),
        )
    }
}

/// A cloneable view of a running reflector: the revision it has synced to and its health.
#[derive(Debug, Clone)]
pub struct RevisionHandle {
    pub(super) revision: Arc<AtomicI64>,
    health: Arc<Mutex<Health>>,
    /// When the source last proved the cache fresh, in milliseconds since the Unix epoch (0:
    /// never): kept apart from `health` so that recording it costs no lock per event.
    proven_ms: Arc<AtomicU64>,
    /// The source's [`Capabilities::liveness_bound`](crate::listwatch::Capabilities::liveness_bound).
    liveness_bound: Option<Duration>,
}

impl RevisionHandle {
    pub(super) fn new(liveness_bound: Option<Duration>) -> Self {
        RevisionHandle {
            revision: Arc::new(AtomicI64::new(0)),
            health: Arc::new(Mutex::new(Health {
                disconnected_since: Some(SystemTime::now()),
                ..Health::default()
            })),
            proven_ms: Arc::default(),
            liveness_bound,
        }
    }

    /// The source just proved the cache fresh.
    pub(super) fn proven(&self) {
        let ms = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        self.proven_ms.store(ms, Ordering::Relaxed);
    }

    /// The last revision the reflector has read up to and queued (0 before the first list):
    /// client-go's `LastSyncResourceVersion`. The cache reaches it once the queue is drained.
    pub fn get(&self) -> i64 {
        self.revision.load(Ordering::Acquire)
    }

    /// The reflector's health now.
    pub fn health(&self) -> Health {
        let mut health = self.lock().clone();
        let ms = self.proven_ms.load(Ordering::Relaxed);
        if ms > 0 {
            let proven = SystemTime::UNIX_EPOCH + Duration::from_millis(ms);
            health.proven_fresh_at = Some(proven);
            if let Some(bound) = self.liveness_bound {
                let silent = SystemTime::now().duration_since(proven).unwrap_or_default();
                if health.connected && silent > bound {
                    health.connected = false;
                    health.disconnected_since = Some(proven + bound);
                }
            }
        }
        health
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Health> {
        lock(&self.health)
    }

    pub(super) fn connected(&self) {
        let mut health = self.lock();
        health.connected = true;
        health.disconnected_since = None;
    }

    pub(crate) fn failed(&self, error: String) {
        let mut health = self.lock();
        let now = SystemTime::now();
        health.connected = false;
        health.disconnected_since.get_or_insert(now);
        health.last_error = Some((error, now));
    }
}
