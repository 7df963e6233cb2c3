//! Leader election over etcd's election API, with the lease kept alive in the background.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, LeaderKey};

use crate::lease::KeptLease;
use crate::metrics::LeaderMetrics;

/// Why leading failed or ended.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ElectionError {
    /// etcd refused or failed a request.
    #[error("election {election:?}: {what} failed: {message}")]
    Etcd {
        /// The election name.
        election: String,
        /// The request.
        what: &'static str,
        /// What failed.
        message: String,
        /// The client's error, when it returned one.
        #[source]
        source: Option<Arc<etcd_client::Error>>,
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
///
/// ```no_run
/// use std::time::Duration;
/// use etcd_informer::leader_election::LeaderElector;
/// # async fn work() {}
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let client = etcd_informer::connect(["127.0.0.1:2379"]).await?;
/// let elector = LeaderElector::new(client, "my-controller", "pod-1")
///     .with_ttl(Duration::from_secs(15));
/// let leadership = elector.campaign().await?;
/// // Work only while leading: stop as soon as leadership is lost.
/// let lost = tokio::select! {
///     e = leadership.lost() => Some(e),
///     () = work() => None,
/// };
/// match lost {
///     Some(e) => eprintln!("stopped: {e}"),
///     None => leadership.resign().await, // hand over at once
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct LeaderElector {
    client: Client,
    election: String,
    identity: String,
    ttl: Duration,
}

/// Leadership held; see [`LeaderElector::campaign`]. Dropping it stops renewing the lease (it
/// then expires after its TTL, as if this process had crashed); [`resign`](Self::resign) hands
/// leadership over at once.
pub struct Leadership {
    client: Client,
    election: String,
    identity: String,
    leader_key: LeaderKey,
    guard: LeaseGuard,
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

    /// The lease TTL, rounded down to whole seconds (etcd's unit), at least 2 s: how long a
    /// dead leader blocks a successor.
    #[must_use]
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Duration::from_secs(ttl.as_secs().max(2));
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
            source: Some(Arc::new(e)),
        }
    }

    /// Waits until this candidate leads. Cancel by dropping the future: the lease stops being
    /// renewed and is revoked (best effort, on the current runtime), so a campaign won at that
    /// very moment does not block other candidates for long.
    pub async fn campaign(&self) -> Result<Leadership, ElectionError> {
        let state = Arc::new(LeaderState {
            leading: AtomicBool::new(false),
            metrics: LeaderMetrics::new(&self.election, &self.identity),
        });
        let span = tracing::info_span!("leader_lease", election = %self.election, identity = %self.identity);
        let on_lost = {
            let state = state.clone();
            move |_: &str| state.set(false)
        };
        let lease = KeptLease::grant(&self.client, self.ttl, span, on_lost)
            .await
            .map_err(self.error("lease grant"))?;
        // Until the campaign is won, dropping this (a cancelled campaign) revokes the lease.
        let mut guard = LeaseGuard {
            lease: Some(lease),
            revoke_on_drop: true,
            state,
        };
        let campaign = self
            .client
            .election_client()
            .campaign(self.election.clone(), self.identity.clone(), guard.id())
            .await;
        let leader_key = match campaign.map(|mut r| r.take_leader()) {
            Ok(Some(key)) => key,
            Ok(None) => {
                return Err(ElectionError::Etcd {
                    election: self.election.clone(),
                    what: "campaign",
                    message: "etcd returned no leader key".into(),
                    source: None,
                })
            }
            Err(e) => return Err(self.error("campaign")(e)),
        };
        tracing::info!(election = %self.election, identity = %self.identity, "became leader");
        // From here on, dropping leadership only stops renewing (a crash, as far as others
        // can tell); `resign` revokes.
        guard.revoke_on_drop = false;
        guard.state.set(true);
        Ok(Leadership {
            client: self.client.clone(),
            election: self.election.clone(),
            identity: self.identity.clone(),
            leader_key,
            guard,
        })
    }
}

/// Whether this candidate leads, behind its [metrics](crate::metrics).
struct LeaderState {
    leading: AtomicBool,
    metrics: LeaderMetrics,
}

impl LeaderState {
    /// Records that this candidate leads or stopped leading (counted once per change).
    fn set(&self, leading: bool) {
        if self.leading.swap(leading, Ordering::AcqRel) != leading {
            self.metrics.transition(leading);
        }
    }
}

/// Owns the lease: revokes it if the campaign never completed.
struct LeaseGuard {
    /// `None` once resigned.
    lease: Option<KeptLease>,
    revoke_on_drop: bool,
    state: Arc<LeaderState>,
}

impl LeaseGuard {
    fn id(&self) -> i64 {
        self.lease.as_ref().map_or(0, KeptLease::id)
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        self.state.set(false);
        if let Some(lease) = self.lease.take() {
            if self.revoke_on_drop {
                lease.revoke_in_background();
            }
        }
    }
}

impl Leadership {
    /// Resolves when leadership is lost, with why.
    pub async fn lost(&self) -> ElectionError {
        let why = match &self.guard.lease {
            Some(lease) => lease.lost().await,
            None => "resigned".into(),
        };
        ElectionError::Lost {
            election: self.election.clone(),
            identity: self.identity.clone(),
            why,
        }
    }

    /// The lease that holds leadership.
    pub fn lease_id(&self) -> i64 {
        self.guard.id()
    }

    /// Whether leadership is still held.
    pub fn is_leader(&self) -> bool {
        self.guard.lease.as_ref().is_some_and(KeptLease::is_alive)
    }

    /// Gives leadership up at once so another candidate can take over.
    pub async fn resign(mut self) {
        self.guard.state.set(false);
        let _ = self
            .client
            .election_client()
            .resign(Some(
                etcd_client::ResignOptions::new().with_leader(self.leader_key.clone()),
            ))
            .await;
        if let Some(lease) = self.guard.lease.take() {
            let _ = lease.revoke().await;
        }
    }
}
