//! The response header of answers from the cache: the upstream's identity (cluster id, member
//! id, raft term), so that a client's identity checks see the upstream etcd and notice when it
//! is replaced, and the cache's revision.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::proto::PbResponseHeader;
use etcd_client::Client;

use crate::lock;

/// The upstream's identity as last seen, shared by the services.
#[derive(Clone, Default)]
pub(crate) struct Headers {
    seen: Arc<Mutex<PbResponseHeader>>,
    /// The upstream's etcd version, `major.minor` (`None` until heard).
    version: Arc<Mutex<Option<(u32, u32)>>>,
}

impl Headers {
    /// A header naming the upstream, at `revision`.
    pub(crate) fn header(&self, revision: i64) -> PbResponseHeader {
        let mut header = *lock(&self.seen);
        header.revision = revision;
        header
    }

    /// Whether the upstream was heard from.
    pub(crate) fn known(&self) -> bool {
        lock(&self.seen).cluster_id != 0
    }

    /// Whether the upstream refuses a watch as etcd 3.5 and later do: every refusal as
    /// "permission denied", under the watch id asked for (3.4 says why, under id -1). Assumed
    /// until the upstream's version is known.
    pub(crate) fn plain_watch_refusals(&self) -> bool {
        lock(&self.version).is_none_or(|v| v >= (3, 5))
    }

    /// Asks the upstream's status once.
    pub(crate) async fn refresh(&self, client: &Client) -> Result<(), etcd_client::Error> {
        let mut maintenance = client.maintenance_client();
        // A hung upstream must not stop the refreshes for good.
        let status = tokio::time::timeout(Duration::from_secs(5), maintenance.status())
            .await
            .map_err(|_| {
                etcd_client::Error::WatchError("no answer to Status within 5 s".into())
            })??;
        let mut numbers = status.version().split('.').map(|n| n.parse::<u32>().ok());
        if let (Some(Some(major)), Some(Some(minor))) = (numbers.next(), numbers.next()) {
            *lock(&self.version) = Some((major, minor));
        }
        if let Some(h) = status.header() {
            let mut seen = lock(&self.seen);
            if seen.cluster_id != h.cluster_id() || seen.raft_term != h.raft_term() {
                tracing::info!(
                    cluster_id = h.cluster_id(),
                    member_id = h.member_id(),
                    raft_term = h.raft_term(),
                    "upstream identity"
                );
            }
            *seen = PbResponseHeader {
                cluster_id: h.cluster_id(),
                member_id: h.member_id(),
                revision: 0,
                raft_term: h.raft_term(),
            };
        }
        Ok(())
    }

    /// Refreshes every `period` for as long as it runs.
    pub(crate) async fn keep_fresh(self, client: Client, period: Duration) {
        loop {
            if let Err(e) = self.refresh(&client).await {
                tracing::warn!(error = %e, "cannot read the upstream's status");
            }
            tokio::time::sleep(period).await;
        }
    }
}
