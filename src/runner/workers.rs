//! The workers of one run: they take keys from the queue, wait for the key's last write,
//! admit them (a sharded runner's shards, once the caches have reached the revision the shard
//! was acquired at), and reconcile each in isolation.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use tokio::time::Instant;

use super::context::{Action, Context, Reconciler};
use super::watched::Watched;
use crate::client::Fence;
use crate::informer::ConsistencyError;
use crate::listwatch::BoxFuture;
use crate::metrics::{ReconcileResult, RunnerMetrics};
use crate::reflector::CatchUnwind;
use crate::sync::lock;
use crate::sync::panic_message;
use crate::workqueue::WorkQueue;

/// How long a key waits for the informers (to apply its last write, or to reach the revision
/// its shard was acquired at) before it is retried with backoff.
const READ_YOUR_WRITES_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether this process may reconcile a key now, and under which fence: a sharded runner's
/// shards. `None`: not now; the key is dropped from the queue, and whoever holds its shard
/// reconciles it (a sharded runner queues it again if that is still this process).
pub(crate) type Admit = Arc<dyn Fn(&str) -> Option<Admitted> + Send + Sync>;

/// Leave to reconcile one key, held for the whole reconcile.
pub(crate) struct Admitted {
    pub(crate) fence: Option<Fence>,
    /// No reconcile starts under this leave before every watched informer has reached this
    /// revision: a newly held shard's acquire revision, above the previous owner's last write
    /// (read-your-writes does not carry over from one process to another).
    pub(crate) fresh_from: i64,
    /// Resolves if the leave is withdrawn mid-reconcile (the lease that backs it was lost):
    /// the reconcile is then abandoned at its next `.await`.
    pub(crate) revoked: BoxFuture<'static, ()>,
    /// Counts the reconcile in until it is dropped, when the reconcile ends.
    pub(crate) in_flight: Box<dyn Send>,
}

/// What the workers of one run share.
pub(super) struct Workers {
    pub(super) queue: WorkQueue<String>,
    pub(super) reconcile: Reconciler,
    pub(super) runner: Arc<str>,
    pub(super) watched: Arc<[Arc<Watched>]>,
    pub(super) written: Arc<Mutex<HashMap<String, i64>>>,
    /// Past this many records in `written`, the applied ones are pruned.
    pub(super) prune_written_at: Mutex<usize>,
    pub(super) timeout: Option<Duration>,
    pub(super) metrics: Arc<RunnerMetrics>,
    pub(super) admit: Option<Admit>,
}

/// The fewest write records kept before those applied everywhere are pruned.
pub(super) const PRUNE_WRITTEN: usize = 1024;

/// How one reconcile ended.
enum Outcome {
    Finished(Result<Action, String>),
    Panicked(String),
    TimedOut(Duration),
    /// The leave to reconcile was withdrawn: another replica may own the key now.
    Revoked,
}

impl Workers {
    pub(super) async fn work(self: Arc<Self>) {
        let queue = &self.queue;
        while let Some(key) = queue.get().await {
            // After shutdown the queue still hands out queued keys; the runner only finishes
            // the reconciles already in flight.
            if queue.is_shutting_down() {
                queue.done(&key);
                break;
            }
            if let Err(e) = self.read_your_writes(&key).await {
                tracing::warn!(%key, error = %e, "the cache has not caught up with this key's last write; backing off");
                queue.add_rate_limited(key.clone());
                queue.done(&key);
                continue;
            }
            // Admitted last, so that a wait above does not hold up a handover of the key's
            // shard.
            let admitted = match &self.admit {
                None => None,
                Some(admit) => match self.admitted(admit, &key).await {
                    Ok(Some(admitted)) => Some(admitted),
                    Ok(None) => {
                        queue.forget(&key);
                        queue.done(&key);
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(%key, error = %e, "the cache has not caught up with the revision the key's shard was acquired at; backing off");
                        queue.add_rate_limited(key.clone());
                        queue.done(&key);
                        continue;
                    }
                },
            };
            self.reconcile(&key, admitted).await;
            queue.done(&key);
        }
    }

    /// Leave to reconcile `key`, once every informer has reached the revision the leave asks
    /// for. The wait is made without the leave, so that it does not hold up a handover of the
    /// key's shard; the leave is asked for again after it.
    async fn admitted(
        &self,
        admit: &Admit,
        key: &str,
    ) -> Result<Option<Admitted>, ConsistencyError> {
        // Reached by every informer, as shown by a wait (maybe by a proof that nothing changed,
        // which need not move their revisions).
        let mut reached = 0;
        loop {
            let Some(admitted) = admit(key) else {
                return Ok(None);
            };
            let at = admitted.fresh_from;
            if at <= reached || self.watched.iter().all(|w| (w.revision)() >= at) {
                return Ok(Some(admitted));
            }
            drop(admitted);
            self.wait_for_all(at).await?;
            reached = at;
        }
    }

    /// Reconciles one key, isolated: a panic or a timeout is one failed attempt of that key.
    async fn reconcile(&self, key: &str, admitted: Option<Admitted>) {
        let queue = &self.queue;
        let key = key.to_owned();
        let retries = queue.num_requeues(&key);
        let (fence, revoked, _in_flight) = match admitted {
            Some(a) => (a.fence, a.revoked, Some(a.in_flight)),
            None => (
                None,
                Box::pin(std::future::pending()) as BoxFuture<'static, ()>,
                None,
            ),
        };
        let ctx = Context {
            key: key.clone(),
            runner: self.runner.clone(),
            retries,
            fence,
            objects: self.watched.iter().map(|w| (w.get)(&key)).collect(),
            watched: self.watched.clone(),
        };
        let reconcile = self.reconcile.clone();
        // The call itself runs inside the guard too: a reconcile can panic before its future.
        let attempt = CatchUnwind(Box::pin(async move { reconcile(ctx).await }));
        let started = Instant::now();
        let attempt = async {
            match self.timeout {
                Some(timeout) => match tokio::time::timeout(timeout, attempt).await {
                    Ok(Ok(result)) => Outcome::Finished(result),
                    Ok(Err(panic)) => Outcome::Panicked(panic_message(&*panic)),
                    Err(_) => Outcome::TimedOut(timeout),
                },
                None => match attempt.await {
                    Ok(result) => Outcome::Finished(result),
                    Err(panic) => Outcome::Panicked(panic_message(&*panic)),
                },
            }
        };
        // Biased: a reconcile whose leave was withdrawn is not polled (and sends nothing) again.
        let outcome = tokio::select! {
            biased;
            () = revoked => Outcome::Revoked,
            outcome = attempt => outcome,
        };
        let result = match outcome {
            Outcome::Finished(Ok(action)) => {
                queue.forget(&key);
                match action {
                    Action::Done => {}
                    Action::RequeueAfter(delay) => queue.add_after(key, delay),
                    Action::Wrote(revision) => self.wrote(key, revision),
                }
                ReconcileResult::Ok
            }
            Outcome::Finished(Err(e)) => {
                tracing::warn!(%key, error = %e, retries, "reconcile failed; backing off");
                queue.add_rate_limited(key);
                ReconcileResult::Error
            }
            Outcome::Panicked(panic) => {
                tracing::error!(%key, %panic, retries, "reconcile panicked; backing off");
                queue.add_rate_limited(key);
                ReconcileResult::Panic
            }
            Outcome::TimedOut(timeout) => {
                tracing::error!(%key, ?timeout, retries, "reconcile timed out and was cancelled; backing off");
                queue.add_rate_limited(key);
                ReconcileResult::Timeout
            }
            Outcome::Revoked => {
                tracing::warn!(%key, "reconcile abandoned: this replica lost the key's shard");
                queue.forget(&key);
                return;
            }
        };
        self.metrics.reconciled(result, started.elapsed());
    }

    /// Records `key`'s write at `revision`, for its next reconcile to wait for. A key that is
    /// never queued again would keep its record for good: past [`PRUNE_WRITTEN`] records, those
    /// every informer has applied are forgotten (amortized: the bound doubles with what stays).
    fn wrote(&self, key: String, revision: i64) {
        let mut written = lock(&self.written);
        written.insert(key, revision);
        let mut prune_at = lock(&self.prune_written_at);
        if written.len() < *prune_at {
            return;
        }
        let applied = self
            .watched
            .iter()
            .map(|w| (w.revision)())
            .min()
            .unwrap_or(i64::MAX);
        written.retain(|_, r| *r > applied);
        *prune_at = (written.len() * 2).max(PRUNE_WRITTEN);
    }

    /// How many writes are remembered for read-your-writes (keys not reconciled since).
    #[cfg(test)]
    fn remembered_writes(&self) -> usize {
        lock(&self.written).len()
    }

    /// Waits until every informer's cache is at `revision` or later, all at once: a revision
    /// from outside an informer's prefix costs it a head start and a proof
    /// ([`wait_for_revision`](crate::SharedIndexInformer::wait_for_revision)), which add up
    /// when waited for one informer after another.
    async fn wait_for_all(&self, revision: i64) -> Result<(), ConsistencyError> {
        let mut waits: Vec<_> = self
            .watched
            .iter()
            .map(|w| Some((w.wait_for)(revision, READ_YOUR_WRITES_TIMEOUT)))
            .collect();
        std::future::poll_fn(|cx| {
            let mut pending = false;
            for slot in &mut waits {
                if let Some(wait) = slot {
                    match wait.as_mut().poll(cx) {
                        Poll::Ready(Ok(())) => *slot = None,
                        Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                        Poll::Pending => pending = true,
                    }
                }
            }
            if pending {
                Poll::Pending
            } else {
                Poll::Ready(Ok(()))
            }
        })
        .await
    }

    /// Waits until every informer has applied `key`'s last recorded write, then forgets it.
    async fn read_your_writes(&self, key: &str) -> Result<(), ConsistencyError> {
        let Some(revision) = lock(&self.written).get(key).copied() else {
            return Ok(());
        };
        self.wait_for_all(revision).await?;
        let mut written = lock(&self.written);
        if written.get(key) == Some(&revision) {
            written.remove(key);
        }
        Ok(())
    }
}

#[cfg(all(test, feature = "testing"))]
mod tests {
    use super::*;
    use crate::informer::SharedIndexInformer;
    use crate::runner::Runner;
    use crate::testing::FakeSource;

    /// Correctness review, finding 6: keys written once and never reconciled again must not be
    /// remembered for good.
    #[tokio::test]
    async fn writes_applied_everywhere_are_forgotten() {
        let source = FakeSource::<String>::new();
        let informer = SharedIndexInformer::new(source.clone(), Default::default());
        tokio::spawn(informer.clone().run());
        informer.wait_for_cache_sync().await;
        let runner = Runner::new("prune").watch(&informer);
        let workers = Workers {
            queue: runner.queue.clone(),
            reconcile: Arc::new(|_| Box::pin(async { Ok(Action::Done) })),
            runner: runner.name.clone(),
            watched: runner.watched.iter().cloned().collect(),
            written: runner.written.clone(),
            prune_written_at: Mutex::new(PRUNE_WRITTEN),
            timeout: None,
            metrics: runner.metrics.clone(),
            admit: None,
        };
        // 10,000 keys, each written once at a revision the cache then reaches.
        for i in 0..10_000 {
            let revision = source.put(&format!("k{i}"), "v".into());
            workers.wrote(format!("k{i}"), revision);
            if i % 100 == 99 {
                informer
                    .wait_for_revision(revision, Duration::from_secs(10))
                    .await
                    .unwrap();
            }
        }
        assert!(
            workers.remembered_writes() <= 2 * PRUNE_WRITTEN,
            "{} writes remembered",
            workers.remembered_writes()
        );
        informer.stop();
    }
}
