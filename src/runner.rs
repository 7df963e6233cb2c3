//! The controller runner: informers feed a rate-limited work queue of keys, and N workers
//! reconcile them, optionally only while this process leads an election.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::Instrument;

use crate::informer::{
    ConsistencyError, HandlerRegistration, ResourceEventHandlerFuncs, SharedIndexInformer,
};
use crate::leader_election::{ElectionError, LeaderElector};
use crate::listwatch::BoxFuture;
use crate::workqueue::WorkQueue;
use crate::Object;

/// What a reconcile asks for next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Done with this key until it changes again.
    Done,
    /// Reconcile the key again after this delay (even if it does not change).
    RequeueAfter(Duration),
    /// Done, and this reconcile wrote at this revision (the revision a
    /// [`TypedClient`](crate::client::TypedClient) write returned): the key's next reconcile
    /// waits until every watched informer's cache has applied it, so it never acts on a cache
    /// older than its own last write (read-your-writes; client-go's KEP-5647).
    Wrote(i64),
}

/// How long a key with a recorded write waits for the informers before it is retried with
/// backoff.
const READ_YOUR_WRITES_TIMEOUT: Duration = Duration::from_secs(10);

/// Waits until one informer has applied a revision.
type WaitFor =
    Arc<dyn Fn(i64, Duration) -> BoxFuture<'static, Result<(), ConsistencyError>> + Send + Sync>;

/// Why a runner stopped early.
#[derive(Debug, thiserror::Error)]
pub enum RunnerError {
    /// Leadership was lost; the workers were stopped.
    #[error(transparent)]
    Election(#[from] ElectionError),
}

type Synced = Box<dyn Fn() -> bool + Send + Sync>;

/// Runs `reconcile(key)` for every key its informers report changed, on `workers` tasks, with
/// client-go's work-queue guarantees: a key is never reconciled by two workers at once, changes
/// arriving meanwhile coalesce into one more reconcile, failures are retried with per-key
/// exponential backoff (5 ms to 1000 s, and at most 10/s overall with bursts of 100), and
/// reconciles start only once every informer has synced.
///
/// ```no_run
/// # async fn demo(informer: etcd_informer::SharedIndexInformer<String>) {
/// use etcd_informer::runner::{Action, Runner};
/// let runner = Runner::new("demo").watch(&informer).workers(2);
/// let shutdown = async { let _ = tokio::signal::ctrl_c().await; };
/// runner
///     .run(|key| async move { println!("reconcile {key}"); Ok::<_, String>(Action::Done) }, shutdown)
///     .await;
/// # }
/// ```
pub struct Runner {
    name: String,
    queue: WorkQueue<String>,
    workers: usize,
    synced: Vec<Synced>,
    /// One per watched informer: waits until its cache has applied a revision.
    wait_for: Vec<WaitFor>,
    /// The revision of each key's last write, until the informers have applied it.
    written: Arc<Mutex<HashMap<String, i64>>>,
    /// Removes this runner's handlers from their informers; run on drop.
    unregister: Vec<Box<dyn FnOnce() + Send + Sync>>,
}

impl Drop for Runner {
    fn drop(&mut self) {
        for unregister in self.unregister.drain(..) {
            unregister();
        }
    }
}

impl fmt::Debug for Runner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runner")
            .field("name", &self.name)
            .field("workers", &self.workers)
            .field("queue_depth", &self.queue.len())
            .finish()
    }
}

impl Runner {
    /// A runner with one worker and the default controller rate limiter.
    pub fn new(name: impl Into<String>) -> Self {
        Runner {
            name: name.into(),
            queue: WorkQueue::new(),
            workers: 1,
            synced: Vec::new(),
            wait_for: Vec::new(),
            written: Arc::default(),
            unregister: Vec::new(),
        }
    }

    /// Reconcile the key of every object of `informer` that is added, updated or deleted.
    #[must_use]
    pub fn watch<T: Send + Sync + 'static>(self, informer: &SharedIndexInformer<T>) -> Self {
        self.watch_mapped(informer, |o: &Object<T>| vec![o.key().to_owned()])
    }

    /// Reconcile the keys `map` gives for every changed object of `informer` (e.g. the owner of
    /// a child object).
    #[must_use]
    pub fn watch_mapped<T: Send + Sync + 'static>(
        mut self,
        informer: &SharedIndexInformer<T>,
        map: impl Fn(&Object<T>) -> Vec<String> + Send + Sync + 'static,
    ) -> Self {
        let map = Arc::new(map);
        let waiter = informer.clone();
        self.wait_for.push(Arc::new(move |revision, timeout| {
            let informer = waiter.clone();
            Box::pin(async move { informer.wait_for_revision(revision, timeout).await })
        }));
        let (q1, q2, q3) = (self.queue.clone(), self.queue.clone(), self.queue.clone());
        let (m1, m2, m3) = (map.clone(), map.clone(), map);
        let handler = ResourceEventHandlerFuncs::new()
            .on_add(move |o, _| m1(o).into_iter().for_each(|k| q1.add(k)))
            .on_update(move |_, o| m2(o).into_iter().for_each(|k| q2.add(k)))
            .on_delete(move |o| m3(o.object()).into_iter().for_each(|k| q3.add(k)));
        match informer.add_event_handler(handler) {
            Ok(registration) => {
                let registration: HandlerRegistration<T> = registration;
                self.synced
                    .push(Box::new(move || registration.has_synced()));
            }
            Err(e) => {
                // A thread that cannot start, or an informer that has stopped: the runner
                // would never sync, so say so loudly and let `run` wait visibly.
                tracing::error!(runner = %self.name, error = %e, "cannot watch informer");
                self.synced.push(Box::new(|| false));
            }
        }
        self
    }

    /// How many keys are reconciled concurrently (at least 1).
    #[must_use]
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = n.max(1);
        self
    }

    /// The work queue, e.g. to add keys by hand or read its metrics.
    pub fn queue(&self) -> &WorkQueue<String> {
        &self.queue
    }

    /// Runs until `shutdown` resolves, then stops taking keys and waits for the reconciles in
    /// flight to finish. The runner's handlers leave their informers when it returns.
    pub async fn run<F, Fut, E>(self, reconcile: F, shutdown: impl Future<Output = ()>)
    where
        F: Fn(String) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        let span = tracing::info_span!("runner", name = %self.name);
        async move {
            tokio::pin!(shutdown);
            tokio::select! {
                _ = self.wait_synced() => {}
                _ = &mut shutdown => return,
            }
            let workers = self.spawn_workers(Arc::new(reconcile));
            shutdown.await;
            tracing::info!("shutting down; waiting for reconciles in flight");
            self.queue.shut_down();
            for mut w in workers {
                let _ = (&mut w.0).await;
            }
        }
        .instrument(span)
        .await
    }

    /// Like [`run`](Self::run), but reconciles only while `elector` leads. Returns
    /// [`RunnerError::Election`] when leadership is lost, after stopping the workers at once
    /// (reconciles in flight are abandoned: another leader may already be acting).
    pub async fn run_as_leader<F, Fut, E>(
        self,
        elector: &LeaderElector,
        reconcile: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), RunnerError>
    where
        F: Fn(String) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        tokio::pin!(shutdown);
        let leadership = tokio::select! {
            l = elector.campaign() => l?,
            _ = &mut shutdown => return Ok(()),
        };
        tracing::info!(runner = %self.name, identity = elector.identity(), "leading; starting workers");
        let queue = self.queue.clone();
        let outcome = tokio::select! {
            _ = self.run(reconcile, &mut shutdown) => Ok(()),
            lost = leadership.lost() => Err(lost),
        };
        match outcome {
            Ok(()) => {
                leadership.resign().await;
                Ok(())
            }
            Err(lost) => {
                queue.shut_down();
                tracing::error!(error = %lost, "leadership lost; workers stopped");
                Err(lost.into())
            }
        }
    }

    async fn wait_synced(&self) {
        crate::informer::wait_until(|| self.synced.iter().all(|s| s())).await;
        tracing::info!("informers synced; starting workers");
    }

    fn spawn_workers<F, Fut, E>(&self, reconcile: Arc<F>) -> Vec<crate::informer::AbortOnDrop<()>>
    where
        F: Fn(String) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        (0..self.workers)
            .map(|i| {
                let queue = self.queue.clone();
                let reconcile = reconcile.clone();
                let wait_for = self.wait_for.clone();
                let written = self.written.clone();
                let span = tracing::info_span!("worker", id = i);
                crate::informer::AbortOnDrop(tokio::spawn(
                    async move {
                        while let Some(key) = queue.get().await {
                            // After shutdown the queue still hands out queued keys; the runner
                            // only finishes the reconciles already in flight.
                            if queue.is_shutting_down() {
                                queue.done(&key);
                                break;
                            }
                            if let Err(e) = read_your_writes(&written, &wait_for, &key).await {
                                tracing::warn!(%key, error = %e, "the cache has not caught up with this key's last write; backing off");
                                queue.add_rate_limited(key.clone());
                                queue.done(&key);
                                continue;
                            }
                            match reconcile(key.clone()).await {
                                Ok(Action::Done) => queue.forget(&key),
                                Ok(Action::RequeueAfter(delay)) => {
                                    queue.forget(&key);
                                    queue.add_after(key.clone(), delay);
                                }
                                Ok(Action::Wrote(revision)) => {
                                    queue.forget(&key);
                                    lock(&written).insert(key.clone(), revision);
                                }
                                Err(e) => {
                                    tracing::warn!(%key, error = %e, retries = queue.num_requeues(&key), "reconcile failed; backing off");
                                    queue.add_rate_limited(key.clone());
                                }
                            }
                            queue.done(&key);
                        }
                    }
                    .instrument(span),
                ))
            })
            .collect()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Waits until every informer has applied `key`'s last recorded write, then forgets it.
async fn read_your_writes(
    written: &Mutex<HashMap<String, i64>>,
    wait_for: &[WaitFor],
    key: &str,
) -> Result<(), ConsistencyError> {
    let Some(revision) = lock(written).get(key).copied() else {
        return Ok(());
    };
    for wait in wait_for {
        wait(revision, READ_YOUR_WRITES_TIMEOUT).await?;
    }
    let mut written = lock(written);
    if written.get(key) == Some(&revision) {
        written.remove(key);
    }
    Ok(())
}
