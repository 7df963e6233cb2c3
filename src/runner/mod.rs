//! The controller runner: informers feed a rate-limited work queue of keys, and N workers
//! reconcile them, optionally only while this process leads an election.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use crate::informer::{AbortOnDrop, ResourceEventHandlerFuncs, SharedIndexInformer};
use crate::leader_election::{ElectionError, LeaderElector};
use crate::metrics::RunnerMetrics;
use crate::object::Object;
use crate::workqueue::{
    default_controller_rate_limiter, Priority, RateLimiter, WorkQueue, WorkQueueConfig,
};

mod context;
mod watched;
mod workers;

pub use context::{by_key, Action, Context};
pub(crate) use context::{erase, Reconciler};
pub(crate) use watched::KeySource;
pub(crate) use workers::{Admit, Admitted};

use watched::{AnyObject, Queueing, Register, Registered, Registrations, Watched};
use workers::{Workers, PRUNE_WRITTEN};

/// How often a runner whose informers have not synced says so.
const SYNC_WARNING_PERIOD: Duration = Duration::from_secs(10);

/// How often a running runner refreshes its queue's in-flight metrics (client-go: 500 ms).
const IN_FLIGHT_METRICS_PERIOD: Duration = Duration::from_secs(1);

/// Why a runner stopped early.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunnerError {
    /// Leadership was lost; the workers were stopped.
    #[error(transparent)]
    Election(#[from] ElectionError),
}

/// Runs a reconcile for every key its informers report changed, on `workers` tasks, with
/// client-go's work-queue guarantees:
///
/// - a key is never reconciled by two workers at once (per-key concurrency is always 1);
///   changes arriving meanwhile coalesce into one more reconcile;
/// - failures are retried with the rate limiter's backoff (default: client-go's default
///   controller limiter, per key 5 ms doubling to 1000 s, and at most 10/s overall with bursts
///   of 100);
/// - a reconcile that panics, or outlives the [`reconcile_timeout`](Self::reconcile_timeout),
///   is logged with its key, counted (`etcd_informer_reconciles_total{result="panic"|"timeout"}`)
///   and retried with backoff like a failure; other keys and the workers carry on;
/// - reconciles start only once every informer has synced (a warning every 10 s names the
///   informers still waited for);
/// - the runner's handlers are in its informers only while it runs.
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
    name: Arc<str>,
    /// The queue of the current or next run; a run that ends shuts it down, and the next run
    /// starts with a new one.
    queue: WorkQueue<String>,
    limiter: Arc<dyn RateLimiter<String>>,
    workers: usize,
    reconcile_timeout: Option<Duration>,
    watched: Vec<Arc<Watched>>,
    /// The revision of each key's last write, until the informers have applied it.
    written: Arc<Mutex<HashMap<String, i64>>>,
    metrics: Arc<RunnerMetrics>,
    /// Set by a sharded runner: which keys this replica may reconcile now.
    pub(crate) admit: Option<Admit>,
    queueing: Queueing,
    fairness: Option<GroupOf>,
}

/// The fairness group of a key.
type GroupOf = Arc<dyn Fn(&str) -> String + Send + Sync>;

impl fmt::Debug for Runner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runner")
            .field("name", &self.name)
            .field("workers", &self.workers)
            .field("reconcile_timeout", &self.reconcile_timeout)
            .field(
                "watched",
                &self
                    .watched
                    .iter()
                    .map(|w| w.informer.as_str())
                    .collect::<Vec<_>>(),
            )
            .field("queue_depth", &self.queue.len())
            .finish()
    }
}

impl Runner {
    /// A runner with one worker, no reconcile timeout and client-go's default controller rate
    /// limiter ([`default_controller_rate_limiter`]). Its queue and handlers are named `name`
    /// (in logs and [metrics](crate::metrics)).
    pub fn new(name: impl Into<String>) -> Self {
        let name: Arc<str> = name.into().into();
        let limiter: Arc<dyn RateLimiter<String>> = Arc::new(default_controller_rate_limiter());
        Runner {
            queue: new_queue(&name, &limiter, None),
            metrics: Arc::new(RunnerMetrics::new(&name)),
            name,
            limiter,
            workers: 1,
            reconcile_timeout: None,
            watched: Vec::new(),
            written: Arc::default(),
            admit: None,
            queueing: Queueing {
                priorities: true,
                resyncs: true,
            },
            fairness: None,
        }
    }

    /// Reconcile the key of every object of `informer` that is added, updated or deleted.
    #[must_use]
    pub fn watch<T: Send + Sync + 'static>(self, informer: &SharedIndexInformer<T>) -> Self {
        self.watch_mapped(informer, |o: &Object<T>| vec![o.key().to_owned()])
    }

    /// Reconcile the keys `map` gives for every changed object of `informer` (e.g. the owner of
    /// a child object). `map` runs on the informer's own task as each change is applied (the
    /// runner's handler is [inline](SharedIndexInformer::add_inline_event_handler)): keep it
    /// quick, and never block in it.
    #[must_use]
    pub fn watch_mapped<T: Send + Sync + 'static>(
        mut self,
        informer: &SharedIndexInformer<T>,
        map: impl Fn(&Object<T>) -> Vec<String> + Send + Sync + 'static,
    ) -> Self {
        let map = Arc::new(map);
        let waiter = informer.clone();
        let at = informer.clone();
        let registrar = informer.clone();
        let lister = informer.lister();
        let getter = informer.lister();
        let all = informer.lister();
        let keys_of = map.clone();
        let register: Register = Box::new(move |runner, queue, queueing| {
            let Queueing {
                priorities,
                resyncs,
            } = queueing;
            let (q1, q2, q3) = (queue.clone(), queue.clone(), queue.clone());
            let (m1, m2, m3) = (map.clone(), map.clone(), map.clone());
            // The initial list and resyncs (old and new at one revision) wait behind live
            // changes.
            let level = move |background: bool| match background && priorities {
                true => Priority::Background,
                false => Priority::Live,
            };
            let handler = ResourceEventHandlerFuncs::new()
                .on_add(move |o, initial| {
                    let p = level(initial);
                    m1(o).into_iter().for_each(|k| q1.add_with_priority(k, p))
                })
                .on_update(move |old, o| {
                    let resync = old.mod_revision == o.mod_revision;
                    if resync && !resyncs {
                        return;
                    }
                    let p = level(resync);
                    m2(o).into_iter().for_each(|k| q2.add_with_priority(k, p))
                })
                .on_delete(move |o| m3(o.object()).into_iter().for_each(|k| q3.add(k)));
            // It only enqueues: called on the informer's task, no thread wakes per event.
            let registration = Arc::new(registrar.add_inline_event_handler(runner, handler)?);
            let (synced, informer) = (registration.clone(), registrar.clone());
            Ok(Registered {
                informer: registrar.name().to_owned(),
                synced: Box::new(move || synced.has_synced()),
                unregister: Some(Box::new(move || {
                    // Runs from `Drop`, maybe on a runtime thread: never waits for the handler.
                    informer.detach(&registration);
                })),
            })
        });
        self.watched.push(Arc::new(Watched {
            informer: informer.name().to_owned(),
            register,
            wait_for: Box::new(move |revision, timeout| {
                let informer = waiter.clone();
                Box::pin(async move { informer.wait_for_revision(revision, timeout).await })
            }),
            keys: Box::new(move |f| {
                for o in all.list() {
                    keys_of(&o).into_iter().for_each(&mut *f);
                }
            }),
            revision: Box::new(move || at.revision()),
            get: Box::new(move |key| getter.get(key).map(|o| o as AnyObject)),
            lister: Box::new(lister),
        }));
        self
    }

    /// How many keys are reconciled concurrently (at least 1; default 1). One key is never
    /// reconciled by two workers at once, whatever this is.
    #[must_use]
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = n.max(1);
        self
    }

    /// The backoff of failed (and panicked, and timed out) reconciles. Default:
    /// [`default_controller_rate_limiter`] (client-go's `DefaultControllerRateLimiter`). Set it
    /// before adding keys to [`queue`](Self::queue) by hand: it replaces the queue.
    #[must_use]
    pub fn rate_limiter(mut self, limiter: impl RateLimiter<String> + 'static) -> Self {
        self.limiter = Arc::new(limiter);
        self.queue = new_queue(&self.name, &self.limiter, self.fairness.clone());
        self
    }

    /// Whether the keys of an initial list and of resyncs (an update whose old and new object
    /// are at one revision) are queued as [`Priority::Background`], below live changes (default
    /// `true`): a live change is then reconciled within a few reconciles' time even behind a
    /// 100,000-key initial list (BENCHMARKS.md), while the list still drains (the queue's
    /// [`live_burst`](WorkQueueConfig::live_burst) turns). `false`: one FIFO, client-go's.
    #[must_use]
    pub fn priorities(mut self, on: bool) -> Self {
        self.queueing.priorities = on;
        self
    }

    /// Whether resyncs are reconciled (default `true`): updates whose old and new object are
    /// at one revision, from the informer's resync period or from a relist that found the key
    /// unchanged ([`RelistUnchanged`](crate::RelistUnchanged)). `false`: the runner reconciles
    /// only changes, whatever other handlers of the same informers are told.
    #[must_use]
    pub fn resyncs(mut self, on: bool) -> Self {
        self.queueing.resyncs = on;
        self
    }

    /// Takes turns between the groups `group_of` gives keys (e.g. their namespace, with
    /// [`namespace_of`]), within each priority, so one busy group cannot delay the others'
    /// keys. Set it before adding keys to [`queue`](Self::queue) by hand: it replaces the
    /// queue.
    #[must_use]
    pub fn fairness(mut self, group_of: impl Fn(&str) -> String + Send + Sync + 'static) -> Self {
        self.fairness = Some(Arc::new(group_of));
        self.queue = new_queue(&self.name, &self.limiter, self.fairness.clone());
        self
    }

    /// Cancels a reconcile that runs longer than `timeout` (at its next `.await`) and retries
    /// the key with backoff. Default: none (a reconcile that never returns holds its key and a
    /// worker forever).
    #[must_use]
    pub fn reconcile_timeout(mut self, timeout: Duration) -> Self {
        self.reconcile_timeout = Some(timeout);
        self
    }

    /// The runner's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The work queue of the current (or next) run, e.g. to add keys by hand or read its
    /// metrics. A run shuts its queue down when it ends; the next run starts with a new one.
    pub fn queue(&self) -> &WorkQueue<String> {
        &self.queue
    }

    /// Runs `reconcile(key)` until `shutdown` resolves, then stops taking keys and waits for
    /// the reconciles in flight to finish. The runner's handlers leave their informers when it
    /// returns.
    pub async fn run<F, Fut, E>(self, reconcile: F, shutdown: impl Future<Output = ()>)
    where
        F: Fn(String) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        self.run_with_context(by_key(reconcile), shutdown).await
    }

    /// Like [`run`](Self::run), with a [`Context`] for each reconcile.
    pub async fn run_with_context<F, Fut, E>(
        mut self,
        reconcile: F,
        shutdown: impl Future<Output = ()>,
    ) where
        F: Fn(Context) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        self.run_erased(erase(reconcile), shutdown).await
    }

    /// Campaigns with `elector`, then runs like [`run_with_context`](Self::run_with_context)
    /// while leading (wrap a reconcile of keys with [`by_key`]). Returns `Ok` after `shutdown`
    /// (resigning leadership), or [`RunnerError::Election`] when leadership is lost, after
    /// stopping the workers at once (reconciles in flight are abandoned: another leader may
    /// already be acting) and removing the runner's handlers. The runner can campaign again.
    pub async fn run_as_leader<F, Fut, E>(
        &mut self,
        elector: &LeaderElector,
        reconcile: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), RunnerError>
    where
        F: Fn(Context) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        tokio::pin!(shutdown);
        let leadership = tokio::select! {
            l = elector.campaign() => l?,
            _ = &mut shutdown => return Ok(()),
        };
        tracing::info!(runner = %self.name, identity = elector.identity(), "leading; starting workers");
        self.renew_queue();
        let queue = self.queue.clone();
        let outcome = tokio::select! {
            _ = self.run_erased(erase(reconcile), &mut shutdown) => Ok(()),
            lost = leadership.lost() => Err(lost),
        };
        match outcome {
            Ok(()) => {
                leadership.resign().await;
                Ok(())
            }
            Err(lost) => {
                queue.shut_down();
                self.metrics.synced(false);
                tracing::error!(runner = %self.name, error = %lost, "leadership lost; workers stopped");
                Err(lost.into())
            }
        }
    }

    /// The keys of every object cached by the watched informers.
    pub(crate) fn key_source(&self) -> KeySource {
        KeySource(self.watched.clone())
    }

    /// Starts over with a new queue if the last run shut it down.
    pub(crate) fn renew_queue(&mut self) {
        if self.queue.is_shutting_down() {
            self.queue = new_queue(&self.name, &self.limiter, self.fairness.clone());
        }
    }

    pub(crate) async fn run_erased(
        &mut self,
        reconcile: Reconciler,
        shutdown: impl Future<Output = ()>,
    ) {
        let span = tracing::info_span!("runner", name = %self.name);
        self.renew_queue();
        let this = &*self;
        async move {
            let queue = this.queue.clone();
            let registrations = this.register(&queue);
            tokio::pin!(shutdown);
            tokio::select! {
                _ = this.wait_synced(&registrations) => {}
                _ = &mut shutdown => return,
            }
            let workers = Arc::new(Workers {
                queue: queue.clone(),
                reconcile,
                runner: this.name.clone(),
                watched: this.watched.iter().cloned().collect(),
                written: this.written.clone(),
                prune_written_at: Mutex::new(PRUNE_WRITTEN),
                timeout: this.reconcile_timeout,
                metrics: this.metrics.clone(),
                admit: this.admit.clone(),
            });
            let tasks: Vec<_> = (0..this.workers)
                .map(|id| {
                    let span = tracing::info_span!("worker", id);
                    AbortOnDrop(tokio::spawn(workers.clone().work().instrument(span)))
                })
                .collect();
            let _in_flight = crate::metrics::ENABLED
                .then(|| AbortOnDrop(tokio::spawn(publish_in_flight(queue.clone()))));
            shutdown.await;
            tracing::info!("shutting down; waiting for reconciles in flight");
            queue.shut_down();
            for mut task in tasks {
                let _ = (&mut task.0).await;
            }
            this.metrics.synced(false);
            drop(registrations);
        }
        .instrument(span)
        .await
    }

    /// Adds this runner's handler to every watched informer, feeding `queue`.
    fn register(&self, queue: &WorkQueue<String>) -> Registrations {
        let registered = self.watched.iter().map(|w| {
            (w.register)(&self.name, queue, self.queueing).unwrap_or_else(|e| {
                // Only a failure to start a thread gets here; the runner would never sync, so
                // say so loudly and let `run` wait visibly.
                tracing::error!(runner = %self.name, informer = %w.informer, error = %e, "cannot watch informer");
                Registered {
                    informer: w.informer.clone(),
                    synced: Box::new(|| false),
                    unregister: None,
                }
            })
        });
        Registrations(registered.collect())
    }

    /// Waits until every handler has synced, warning every [`SYNC_WARNING_PERIOD`] meanwhile.
    async fn wait_synced(&self, registrations: &Registrations) {
        self.metrics.synced(false);
        let started = Instant::now();
        let mut warn_at = started + SYNC_WARNING_PERIOD;
        loop {
            let unsynced: Vec<&str> = registrations
                .0
                .iter()
                .filter(|r| !(r.synced)())
                .map(|r| r.informer.as_str())
                .collect();
            if unsynced.is_empty() {
                break;
            }
            if Instant::now() >= warn_at {
                tracing::warn!(waited = ?started.elapsed(), informers = ?unsynced, "informers have not synced yet; no reconcile runs until they do");
                warn_at += SYNC_WARNING_PERIOD;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.metrics.synced(true);
        tracing::info!("informers synced; starting workers");
    }
}

fn new_queue(
    name: &str,
    limiter: &Arc<dyn RateLimiter<String>>,
    fairness: Option<GroupOf>,
) -> WorkQueue<String> {
    let mut config = WorkQueueConfig::new()
        .name(name)
        .rate_limiter(limiter.clone());
    if let Some(group_of) = fairness {
        config = config.fairness(move |key: &String| group_of(key));
    }
    WorkQueue::with_config(config)
}

/// The namespace of a `namespace/name` key (empty without one): a fairness group for
/// [`Runner::fairness`].
pub fn namespace_of(key: &str) -> String {
    crate::object::split_key(key).0.to_owned()
}

/// Refreshes the queue's in-flight metrics while a run lasts.
async fn publish_in_flight(queue: WorkQueue<String>) {
    let mut tick = tokio::time::interval(IN_FLIGHT_METRICS_PERIOD);
    loop {
        tick.tick().await;
        let _ = queue.metrics();
    }
}
