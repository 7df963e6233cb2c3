//! Leader election over etcd's election API, with the lease kept alive in the background.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, LeaderKey};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::Instrument;

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
    leader_key: LeaderKey,
    lost: watch::Receiver<Option<ElectionError>>,
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
        let ttl_secs = self.ttl.as_secs() as i64;
        let granted_at = Instant::now();
        let lease = self
            .client
            .lease_client()
            .grant(ttl_secs, None)
            .await
            .map_err(self.error("lease grant"))?
            .id();
        let (lost_tx, lost) = watch::channel(None);
        let state = Arc::new(LeaderState {
            leading: AtomicBool::new(false),
            metrics: LeaderMetrics::new(&self.election, &self.identity),
        });
        let span = tracing::info_span!("leader_lease", election = %self.election, identity = %self.identity, lease);
        let mut guard = LeaseGuard {
            client: self.client.clone(),
            lease,
            keeper: tokio::spawn(
                keep_alive(self.clone(), lease, granted_at, lost_tx, state.clone())
                    .instrument(span),
            ),
            revoke_on_drop: true,
            state,
        };
        let campaign = self
            .client
            .election_client()
            .campaign(self.election.clone(), self.identity.clone(), lease)
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
            leader_key,
            lost,
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

/// Owns the lease renewal task: stops it when dropped, and revokes the lease if the campaign
/// never completed.
struct LeaseGuard {
    client: Client,
    lease: i64,
    keeper: tokio::task::JoinHandle<()>,
    revoke_on_drop: bool,
    state: Arc<LeaderState>,
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        self.state.set(false);
        self.keeper.abort();
        if self.revoke_on_drop {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let mut leases = self.client.lease_client();
                let lease = self.lease;
                runtime.spawn(async move {
                    let _ = leases.revoke(lease).await;
                });
            }
        }
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
        self.guard.lease
    }

    /// Whether leadership is still held.
    pub fn is_leader(&self) -> bool {
        self.lost.borrow().is_none() && !self.guard.keeper.is_finished()
    }

    /// Gives leadership up at once so another candidate can take over.
    pub async fn resign(self) {
        self.guard.state.set(false);
        self.guard.keeper.abort();
        let _ = self
            .client
            .election_client()
            .resign(Some(
                etcd_client::ResignOptions::new().with_leader(self.leader_key.clone()),
            ))
            .await;
        let _ = self.client.lease_client().revoke(self.guard.lease).await;
    }
}

/// Renews the lease every TTL/3 and reports loss once no renewal has been acknowledged for
/// TTL*2/3 (measured from when the acknowledged request was *sent*, and checked before every
/// wait), or as soon as etcd says the lease is gone. The server keeps the lease for a full TTL
/// after it receives a renewal, so loss is always reported at least TTL/3 before another
/// candidate can win.
async fn keep_alive(
    elector: LeaderElector,
    lease: i64,
    granted_at: Instant,
    lost: watch::Sender<Option<ElectionError>>,
    state: Arc<LeaderState>,
) {
    let ttl = elector.ttl;
    let period = ttl / 3;
    let margin = ttl * 2 / 3;
    let retry = Duration::from_millis(100);
    let report = |why: String| {
        state.set(false);
        tracing::warn!(%why, "leadership lost");
        let _ = lost.send(Some(ElectionError::Lost {
            election: elector.election.clone(),
            identity: elector.identity.clone(),
            why,
        }));
    };
    let mut last_ok = granted_at;
    let mut stream = None;
    loop {
        let deadline = last_ok + margin;
        if Instant::now() >= deadline {
            report(format!(
                "no lease renewal acknowledged for {:?} (TTL {ttl:?}): etcd unreachable",
                last_ok.elapsed()
            ));
            return;
        }
        let (keeper, responses) = match stream.as_mut() {
            Some((keeper, responses)) => (keeper, responses),
            None => {
                match tokio::time::timeout_at(
                    deadline,
                    elector.client.lease_client().keep_alive(lease),
                )
                .await
                {
                    Ok(Ok(pair)) => stream = Some(pair),
                    // The first renewal was answered: the lease is gone, and maybe our key too.
                    Ok(Err(etcd_client::Error::LeaseKeepAliveError(why)))
                        if why.contains("not found") =>
                    {
                        report(format!("lease {lease} expired or was revoked ({why})"));
                        return;
                    }
                    Ok(Err(_)) => {
                        tokio::time::sleep_until((Instant::now() + retry).min(deadline)).await
                    }
                    Err(_) => {}
                }
                continue;
            }
        };
        let sent = Instant::now();
        let renewed = tokio::time::timeout_at(deadline, async {
            keeper.keep_alive().await?;
            responses.message().await
        })
        .await;
        match renewed {
            Ok(Ok(Some(resp))) if resp.ttl() > 0 => last_ok = sent,
            Ok(Ok(Some(_))) => {
                report(format!("lease {lease} expired or was revoked"));
                return;
            }
            Ok(_) => {
                stream = None;
                tokio::time::sleep_until((Instant::now() + retry).min(deadline)).await;
                continue;
            }
            Err(_) => continue,
        }
        tokio::time::sleep_until(last_ok + period).await;
    }
}
