//! An etcd lease kept alive in the background, that says it is lost *before* etcd can expire
//! it: what leader election and shard ownership hold their keys with.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::Client;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::Instrument;

/// A granted lease and the task that renews it.
///
/// Invariant: while [`lost`](Self::lost) has not resolved, etcd acknowledged a renewal of the
/// lease sent less than `ttl * 2 / 3` ago. etcd keeps a lease for a full TTL after it receives a
/// renewal, so loss is reported here at least `ttl / 3` before etcd can expire the lease and
/// delete the keys attached to it (as long as the two clocks run at the same rate). Whoever acts
/// on behalf of the lease stops when it is lost, and nobody else can take over before that.
///
/// Dropping a `KeptLease` stops renewing it: it expires after its TTL, as if the process had
/// crashed. [`revoke`](Self::revoke) ends it at once.
pub(crate) struct KeptLease {
    client: Client,
    id: i64,
    valid_until: Validity,
    lost: watch::Receiver<Option<String>>,
    keeper: tokio::task::JoinHandle<()>,
}

impl Drop for KeptLease {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

impl KeptLease {
    /// Grants a lease of `ttl` (whole seconds, at least 1) and starts renewing it every
    /// `ttl / 3`. `on_lost` runs once, with why, when the lease is lost.
    pub(crate) async fn grant(
        client: &Client,
        ttl: Duration,
        span: tracing::Span,
        on_lost: impl FnOnce(&str) + Send + 'static,
    ) -> Result<KeptLease, etcd_client::Error> {
        let ttl = Duration::from_secs(ttl.as_secs().max(1));
        let granted_at = Instant::now();
        let id = client
            .lease_client()
            .grant(ttl.as_secs() as i64, None)
            .await?
            .id();
        let valid_until = Validity(Arc::new(Mutex::new(granted_at + ttl * 2 / 3)));
        let (lost_tx, lost) = watch::channel(None);
        let report = move |why: String| {
            on_lost(&why);
            tracing::warn!(%why, "lease lost");
            let _ = lost_tx.send(Some(why));
        };
        let keeper = tokio::spawn(
            keep_alive(client.clone(), id, ttl, valid_until.clone(), report).instrument(span),
        );
        Ok(KeptLease {
            client: client.clone(),
            id,
            valid_until,
            lost,
            keeper,
        })
    }

    /// The lease's id.
    pub(crate) fn id(&self) -> i64 {
        self.id
    }

    /// Until when the lease is proven alive, for checks that cannot wait for the keeper task
    /// to run (a process that was frozen resumes with every task due at once).
    pub(crate) fn validity(&self) -> Validity {
        self.valid_until.clone()
    }

    /// Resolves when the lease is lost, with why.
    pub(crate) async fn lost(&self) -> String {
        let mut lost = self.lost.clone();
        loop {
            if let Some(why) = lost.borrow_and_update().clone() {
                return why;
            }
            if lost.changed().await.is_err() {
                return "the lease keeper stopped".into();
            }
        }
    }

    /// Whether the lease is still proven alive.
    pub(crate) fn is_alive(&self) -> bool {
        self.lost.borrow().is_none() && !self.keeper.is_finished()
    }

    /// Stops renewing and revokes the lease, deleting every key attached to it.
    pub(crate) async fn revoke(self) -> Result<(), etcd_client::Error> {
        self.keeper.abort();
        self.client.lease_client().revoke(self.id).await.map(drop)
    }

    /// Stops renewing, and revokes the lease in the background on the current runtime, if any:
    /// for a lease dropped before it was used (a cancelled campaign).
    pub(crate) fn revoke_in_background(self) {
        self.keeper.abort();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let mut leases = self.client.lease_client();
            let id = self.id;
            runtime.spawn(async move {
                let _ = leases.revoke(id).await;
            });
        }
    }
}

/// Until when a [`KeptLease`] is proven alive: `ttl * 2 / 3` after the last acknowledged
/// renewal was sent.
#[derive(Clone)]
pub(crate) struct Validity(Arc<Mutex<Instant>>);

impl Validity {
    /// A validity that ends at `at`, for tests.
    #[cfg(test)]
    pub(crate) fn until(at: Instant) -> Self {
        Validity(Arc::new(Mutex::new(at)))
    }

    /// Moves the end of the proof to `at`, as a renewal does, for tests.
    #[cfg(test)]
    pub(crate) fn renewed_until(&self, at: Instant) {
        *crate::sync::lock(&self.0) = at;
    }

    pub(crate) fn is_valid(&self) -> bool {
        Instant::now() < *crate::sync::lock(&self.0)
    }
}

/// Renews the lease every TTL/3 and reports loss once no renewal has been acknowledged for
/// TTL*2/3 (measured from when the acknowledged request was *sent*, and checked before every
/// wait), or as soon as etcd says the lease is gone.
async fn keep_alive(
    client: Client,
    lease: i64,
    ttl: Duration,
    valid_until: Validity,
    report: impl FnOnce(String),
) {
    let period = ttl / 3;
    let margin = ttl * 2 / 3;
    let retry = Duration::from_millis(100);
    let mut last_ok = *crate::sync::lock(&valid_until.0) - margin;
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
                match tokio::time::timeout_at(deadline, client.lease_client().keep_alive(lease))
                    .await
                {
                    Ok(Ok(pair)) => stream = Some(pair),
                    // The first renewal was answered: the lease is gone, and its keys too.
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
            Ok(Ok(Some(resp))) if resp.ttl() > 0 => {
                last_ok = sent;
                *crate::sync::lock(&valid_until.0) = sent + margin;
            }
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
