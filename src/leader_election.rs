//! Leader election over etcd's election API, with the lease kept alive in the background.

use std::time::Duration;

use etcd_client::{Client, LeaderKey};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::Instrument;

/// Why leading failed or ended.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ElectionError {
    /// etcd refused or failed a request.
    #[error("election {election:?}: {what} failed: {message}")]
    Etcd {
        /// The election name.
        election: String,
        /// The request.
        what: &'static str,
        /// The client's error.
        message: String,
    },
    /// The lease could not be renewed in time, or was revoked: another candidate may lead now.
    #[error("election {election:?}: leadership of {identity:?} lost: {why}")]
    Lost {
        /// The election name.
        election: String,
        /// This candidate.
        identity: String,
        /// Why.
        why: String,
    },
}

/// A candidate in an etcd election (client-go's `leaderelection.LeaderElector`, on etcd's
/// native election API instead of a lock object).
///
/// The candidate holds a lease of `ttl`; while it leads, a background task renews it every
/// `ttl / 3`. If a renewal fails to arrive for `ttl * 2 / 3` (etcd unreachable) or etcd says the
/// lease is gone (revoked, expired), leadership is reported lost *before* the lease can expire on
/// the server, so two leaders never act at once as long as clocks run at the same rate.
#[derive(Clone)]
pub struct LeaderElector {
    client: Client,
    election: String,
    identity: String,
    ttl: Duration,
}

/// Leadership held; see [`LeaderElector::campaign`]. Dropping it stops renewing the lease (it
/// then expires after its TTL); [`resign`](Self::resign) hands leadership over at once.
pub struct Leadership {
    client: Client,
    leader_key: LeaderKey,
    lease: i64,
    lost: watch::Receiver<Option<ElectionError>>,
    keeper: tokio::task::JoinHandle<()>,
}

impl LeaderElector {
    /// A candidate named `identity` in the election `election`, with a 10 s lease.
    pub fn new(client: Client, election: impl Into<String>, identity: impl Into<String>) -> Self {
        LeaderElector {
            client,
            election: election.into(),
            identity: identity.into(),
            ttl: Duration::from_secs(10),
        }
    }

    /// The lease TTL (whole seconds, at least 2): how long a dead leader blocks a successor.
    #[must_use]
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl.max(Duration::from_secs(2));
        self
    }

    /// This candidate's identity.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    fn error(&self, what: &'static str) -> impl FnOnce(etcd_client::Error) -> ElectionError + '_ {
        move |e| ElectionError::Etcd {
            election: self.election.clone(),
            what,
            message: e.to_string(),
        }
    }

    /// Waits until this candidate leads. Cancel by dropping the future (the lease then expires).
    pub async fn campaign(&self) -> Result<Leadership, ElectionError> {
        let ttl_secs = self.ttl.as_secs() as i64;
        let lease = self
            .client
            .lease_client()
            .grant(ttl_secs, None)
            .await
            .map_err(self.error("lease grant"))?
            .id();
        let (lost_tx, lost) = watch::channel(None);
        let span = tracing::info_span!("leader_lease", election = %self.election, identity = %self.identity, lease);
        let keeper = tokio::spawn(keep_alive(self.clone(), lease, lost_tx).instrument(span));
        let campaign = self
            .client
            .election_client()
            .campaign(self.election.clone(), self.identity.clone(), lease)
            .await;
        let leader_key = match campaign.map(|mut r| r.take_leader()) {
            Ok(Some(key)) => key,
            Ok(None) => {
                keeper.abort();
                return Err(ElectionError::Etcd {
                    election: self.election.clone(),
                    what: "campaign",
                    message: "etcd returned no leader key".into(),
                });
            }
            Err(e) => {
                keeper.abort();
                let _ = self.client.lease_client().revoke(lease).await;
                return Err(self.error("campaign")(e));
            }
        };
        tracing::info!(election = %self.election, identity = %self.identity, "became leader");
        Ok(Leadership {
            client: self.client.clone(),
            leader_key,
            lease,
            lost,
            keeper,
        })
    }
}

impl Leadership {
    /// Resolves when leadership is lost, with why.
    pub async fn lost(&self) -> ElectionError {
        let mut lost = self.lost.clone();
        loop {
            if let Some(e) = lost.borrow_and_update().clone() {
                return e;
            }
            if lost.changed().await.is_err() {
                return ElectionError::Lost {
                    election: String::from_utf8_lossy(self.leader_key.name()).into_owned(),
                    identity: String::new(),
                    why: "the lease keeper stopped".into(),
                };
            }
        }
    }

    /// The lease that holds leadership.
    pub fn lease_id(&self) -> i64 {
        self.lease
    }

    /// Whether leadership is still held.
    pub fn is_leader(&self) -> bool {
        self.lost.borrow().is_none() && !self.keeper.is_finished()
    }

    /// Gives leadership up at once so another candidate can take over.
    pub async fn resign(self) {
        self.keeper.abort();
        let _ = self
            .client
            .election_client()
            .resign(Some(
                etcd_client::ResignOptions::new().with_leader(self.leader_key.clone()),
            ))
            .await;
        let _ = self.client.lease_client().revoke(self.lease).await;
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

/// Renews the lease every TTL/3 until told to stop; reports loss when a renewal is overdue
/// (TTL*2/3 since the last acknowledged one) or etcd says the lease is gone.
async fn keep_alive(
    elector: LeaderElector,
    lease: i64,
    lost: watch::Sender<Option<ElectionError>>,
) {
    let ttl = elector.ttl;
    let period = ttl / 3;
    let deadline_after = ttl * 2 / 3;
    let mut last_ok = Instant::now();
    let report = |why: String| {
        tracing::warn!(%why, "leadership lost");
        let _ = lost.send(Some(ElectionError::Lost {
            election: elector.election.clone(),
            identity: elector.identity.clone(),
            why,
        }));
    };
    let mut stream = None;
    loop {
        if stream.is_none() {
            let connect =
                tokio::time::timeout(period, elector.client.lease_client().keep_alive(lease)).await;
            if let Ok(Ok(pair)) = connect {
                stream = Some(pair);
            }
        }
        if let Some((keeper, responses)) = stream.as_mut() {
            let renewed = tokio::time::timeout(period, async {
                keeper.keep_alive().await?;
                responses.message().await
            })
            .await;
            match renewed {
                Ok(Ok(Some(resp))) if resp.ttl() > 0 => last_ok = Instant::now(),
                Ok(Ok(Some(_))) => {
                    report(format!("lease {lease} expired or was revoked"));
                    return;
                }
                _ => stream = None,
            }
        }
        if last_ok.elapsed() >= deadline_after {
            report(format!(
                "no lease renewal for {:?} (TTL {ttl:?}): etcd unreachable",
                last_ok.elapsed()
            ));
            return;
        }
        let next = (last_ok + period).max(Instant::now() + Duration::from_millis(100));
        tokio::time::sleep_until(next.min(last_ok + deadline_after)).await;
    }
}
