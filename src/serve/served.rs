//! What the KV and Watch services share: the cache, the upstream, the headers, and the
//! consistent-read proof.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tonic::Status;

use super::cache::ServedCache;
use super::forward::Upstream;
use super::header::Headers;
use super::stats::ServerMetrics;
use crate::listwatch::ListerWatcher;
use crate::EtcdListerWatcher;

/// What the KV service and the watch service share.
pub(crate) struct Served {
    pub(crate) cache: Arc<ServedCache>,
    pub(crate) upstream: Upstream,
    pub(crate) headers: Headers,
    /// A source over the prefix used only for the consistent-read proof.
    pub(crate) proof: EtcdListerWatcher<Vec<u8>>,
    pub(crate) prefix: Vec<u8>,
    pub(crate) prefix_end: Vec<u8>,
    pub(crate) read_timeout: Duration,
    pub(crate) metrics: ServerMetrics,
}

impl Served {
    /// Whether etcd's range `[key, end)` lies within the served prefix.
    pub(crate) fn covers(&self, key: &[u8], end: &[u8]) -> bool {
        if self.prefix.is_empty() {
            return !key.is_empty();
        }
        if key < self.prefix.as_slice() {
            return false;
        }
        if end.is_empty() {
            return key.starts_with(&self.prefix);
        }
        if self.prefix_end == [0] {
            return true;
        }
        end != [0] && end <= self.prefix_end.as_slice()
    }

    /// Returns once the cache holds every change etcd made before this call (a linearizable
    /// read): etcd's current revision and whether the prefix changed since the cache's revision
    /// come from one linearizable read; if it changed, waits for the cache to catch up (or to
    /// be proven equal to etcd's content at that revision). The proof never moves the cache's
    /// revision: events still on their way through the watch would be skipped.
    pub(crate) async fn linearize(&self) -> Result<(), Status> {
        let deadline = Instant::now() + self.read_timeout;
        let unavailable =
            |what: String| Status::unavailable(format!("etcd-informer cache server: {what}"));
        let since = self.cache.position().revision;
        let fresh = tokio::time::timeout_at(
            deadline,
            self.proof.freshness(since, self.cache.len(), None),
        )
        .await
        .map_err(|_| unavailable("no answer from etcd for the consistent-read proof".into()))?
        .map_err(|e| unavailable(format!("consistent-read proof failed: {e}")))?;
        if fresh.unchanged {
            return Ok(());
        }
        let target = fresh.revision;
        let mut position = self.cache.subscribe();
        let mut asked_at = since;
        loop {
            let now = *position.borrow_and_update();
            if now.revision >= target {
                return Ok(());
            }
            if now.revision != asked_at {
                asked_at = now.revision;
                let proof = self
                    .proof
                    .freshness(now.revision, self.cache.len(), Some(target));
                if let Ok(Ok(fresh)) = tokio::time::timeout_at(deadline, proof).await {
                    if fresh.unchanged {
                        return Ok(());
                    }
                }
            }
            match tokio::time::timeout_at(deadline, position.changed()).await {
                Ok(Ok(())) => {}
                _ => {
                    return Err(unavailable(format!(
                    "the cache did not reach etcd's revision {target} within {:?} (it is at {})",
                    self.read_timeout,
                    self.cache.position().revision
                )))
                }
            }
        }
    }
}
