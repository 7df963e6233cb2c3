//! The informer's side of warm restarts (see [`snapshot`](crate::snapshot)): writing its
//! cache on a period and when it stops, and how it started.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::Notify;
use tracing::Instrument;

use super::controller::AbortOnDrop;
use super::shared_informer::{Queue, SharedIndexInformer};
use crate::listwatch::SourceCapabilities;
use crate::snapshot::{write, SnapshotError, SnapshotErrorKind, SnapshotStart};
use crate::store::Indexer;

/// How long after a warm start's sync its records are decoded (see `verify_warm_start`).
const VERIFY_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

impl<T: Send + Sync + 'static> SharedIndexInformer<T> {
    /// How the informer started when snapshots are on: warm (from which revision, how many
    /// keys) or cold (and why); `None` before its first list is decided, and without
    /// snapshots. The same line is logged on start.
    pub fn snapshot_start(&self) -> Option<SnapshotStart> {
        let snapshots = self.shared.snapshots.as_ref()?;
        snapshots.start.get().cloned()
    }

    /// Writes the cache to the snapshot file now (the informer also does every
    /// [`SnapshotOptions::period`](crate::snapshot::SnapshotOptions::period) and when it
    /// stops), returning the revision written. `None`: nothing written, because snapshots are
    /// off (or the processing mode is not revision-atomic), the cache has not synced, the source
    /// does not know its store's cluster id yet, or the cache has not changed since the last
    /// write.
    ///
    /// ```no_run
    /// # async fn demo(informer: etcd_informer::SharedIndexInformer<String>) {
    /// // Before a planned shutdown that does not go through `stop`:
    /// match informer.write_snapshot().await {
    ///     Ok(Some(revision)) => println!("saved at revision {revision}"),
    ///     Ok(None) => println!("nothing to save"),
    ///     Err(e) => eprintln!("{e}"),
    /// }
    /// # }
    /// ```
    pub async fn write_snapshot(&self) -> Result<Option<i64>, SnapshotError> {
        let Some(snapshots) = self.shared.snapshots.as_ref() else {
            return Ok(None);
        };
        // Only a revision-atomic cache is etcd at one revision.
        if !self.has_synced() || !matches!(self.shared.queue, Queue::Atomic(_)) {
            return Ok(None);
        }
        let mut written = snapshots.written.lock().await;
        if let (0, Some(SnapshotStart::Warm { revision, .. })) = (*written, snapshots.start.get()) {
            // The file holds that revision already: a quiet prefix is not written again.
            *written = *revision;
        }
        if self.shared.indexer.revision() == *written {
            return Ok(None);
        }
        let path = snapshots.options.path.clone();
        let joined = |e: tokio::task::JoinError| {
            SnapshotError::new(
                &path,
                SnapshotErrorKind::Io(std::io::Error::other(e.to_string())),
            )
        };
        // Under the store's read lock: the content, its revision and the store it was listed
        // from agree. The source's identity now could name a store it has just found, whose
        // content the cache does not hold yet. Off the runtime's threads: a store of decoded
        // objects is a copy of every pointer, and a compact one whose codec is not the
        // snapshot's decodes every key.
        let codec = snapshots.options.codec.name();
        let started = std::time::Instant::now();
        let shared = self.shared.clone();
        let (revision, cluster_id, content, indexers) =
            tokio::task::spawn_blocking(move || shared.indexer.snapshot_content(codec))
                .await
                .map_err(joined)?;
        let taken = started.elapsed();
        if cluster_id == 0 {
            tracing::debug!(informer = %self.shared.name, "no snapshot written: the cluster id of the listed store is not known");
            return Ok(None);
        }
        if revision == 0 || revision == *written {
            return Ok(None);
        }
        let Some(identity) = self.shared.source.identity() else {
            tracing::debug!(informer = %self.shared.name, "no snapshot written: the source names no store (it cannot resume)");
            return Ok(None);
        };
        let options = snapshots.options.clone();
        let keys = content.len();
        tokio::task::spawn_blocking(move || {
            write(
                &options,
                cluster_id,
                &identity.name,
                revision,
                &content,
                &indexers,
            )
        })
        .await
        .map_err(joined)??;
        *written = revision;
        tracing::debug!(informer = %self.shared.name, revision, keys, content_taken = ?taken, took = ?started.elapsed(), "snapshot written");
        Ok(Some(revision))
    }

    /// The write when the informer stops, logged if it fails.
    pub(super) async fn write_snapshot_on_stop(&self) {
        if let Err(e) = self.write_snapshot().await {
            tracing::warn!(informer = %self.shared.name, error = %e, "writing the snapshot on stop failed");
        }
    }

    /// After a warm start, decodes every record the snapshot installed, off the runtime: a
    /// compact cache's records go in undecoded, checked by a sample of 64, so a change to the
    /// type that breaks a minority of values would pass, and `len`, the indexes and the audit
    /// would count records that `get` and `list` omit. A record that does not decode (or whose
    /// codec panics) is removed, as a cold start would never have cached it, and the reflector
    /// relists (`relist`): the source then reports each such key, as after a cold start, and
    /// knows it as undecodable. The pass runs again once that relist is applied, until one
    /// removes nothing: a relist already under way could have reused a record before it was
    /// removed. From the first removal on, the cache is not taken as the whole prefix by a
    /// consistency proof. The informer is synced meanwhile; the pass starts a second after the
    /// sync and, at a million keys, takes a core for a few seconds.
    pub(super) fn verify_warm_start(&self, relist: Arc<Notify>) -> Option<AbortOnDrop<()>> {
        self.shared.snapshots.as_ref()?;
        let span = tracing::info_span!("verify_warm_start", informer = %self.shared.name);
        let shared = Arc::downgrade(&self.shared);
        let verify = async move {
            let informer = SharedIndexInformer {
                shared: shared.upgrade()?,
            };
            super::shared_informer::wait_until(|| informer.has_synced()).await;
            if !matches!(informer.snapshot_start(), Some(SnapshotStart::Warm { .. })) {
                return None;
            }
            // The changes made while the informer was down come first: the pass competes with
            // applying them for a core.
            tokio::time::sleep(VERIFY_AFTER).await;
            loop {
                let indexer = informer.shared.indexer.clone();
                let removed = tokio::task::spawn_blocking(move || remove_undecodable(&indexer))
                    .await
                    .ok()?;
                if removed.is_empty() {
                    return Some(());
                }
                informer.shared.incomplete.store(true, Ordering::Release);
                tracing::warn!(
                    count = removed.len(),
                    keys = ?removed.iter().take(10).collect::<Vec<_>>(),
                    "records of the snapshot that no longer decode were removed from the cache; relisting"
                );
                let applied = informer.shared.queue.replaces_applied();
                relist.notify_one();
                super::shared_informer::wait_until(|| {
                    informer.shared.queue.replaces_applied() > applied || informer.is_stopped()
                })
                .await;
                if informer.is_stopped() {
                    return None;
                }
            }
        };
        Some(AbortOnDrop(tokio::spawn(
            async move {
                let _: Option<()> = verify.await;
            }
            .instrument(span),
        )))
    }

    /// Starts writing the snapshot every period, while the returned guard and the informer
    /// live; `None` without snapshots.
    pub(super) fn write_snapshots_periodically(&self) -> Option<AbortOnDrop<()>> {
        let period = self.shared.snapshots.as_ref()?.options.period;
        // Below a second, writing a large cache could take most of the time.
        let period = period.max(std::time::Duration::from_secs(1));
        let shared = Arc::downgrade(&self.shared);
        Some(AbortOnDrop(tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(shared) = shared.upgrade() else {
                    return;
                };
                let informer = SharedIndexInformer { shared };
                if let Err(e) = informer.write_snapshot().await {
                    tracing::warn!(informer = %informer.shared.name, error = %e, "writing the snapshot failed");
                }
            }
        })))
    }
}

/// Removes every record of `indexer` that does not decode (a codec that panics counts as one
/// that refuses); returns their keys.
fn remove_undecodable<T: Send + Sync + 'static>(indexer: &Indexer<T>) -> Vec<Arc<str>> {
    let decodes = |key: &str| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            indexer.get_by_key(key).is_some()
        }))
        .unwrap_or(false)
    };
    let mut removed = Vec::new();
    for key in indexer.list_keys() {
        if decodes(&key) {
            continue;
        }
        // Still held and still not decodable (not deleted or rewritten meanwhile): removed.
        let gone = indexer.transaction(|txn| {
            let before = txn.len();
            let held =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| txn.get(&key).is_some()))
                    .unwrap_or(false);
            if !held {
                txn.delete(&key);
            }
            txn.len() < before
        });
        if gone {
            removed.push(key);
        }
    }
    removed
}
