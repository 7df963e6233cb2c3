//! The controller runner: informers feed a rate-limited work queue of keys, and N workers
//! reconcile them, optionally only while this process leads an election.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use crate::client::Fence;
use crate::informer::{
    AbortOnDrop, ConsistencyError, InformerError, ResourceEventHandlerFuncs, SharedIndexInformer,
};
use crate::leader_election::{ElectionError, LeaderElector};
use crate::listwatch::BoxFuture;
use crate::metrics::{ReconcileResult, RunnerMetrics};
use crate::reflector::{panic_message, CatchUnwind};
use crate::workqueue::{
    default_controller_rate_limiter, Priority, RateLimiter, WorkQueue, WorkQueueConfig,
};
use crate::{lock, Lister, Object};

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

/// A cached object of some watched informer: an `Arc<Object<T>>`.
type AnyObject = Arc<dyn Any + Send + Sync>;

/// Looks a key up in one informer's cache.
type Get = Box<dyn Fn(&str) -> Option<AnyObject> + Send + Sync>;

/// Waits until one informer has applied a revision.
type WaitFor =
    Box<dyn Fn(i64, Duration) -> BoxFuture<'static, Result<(), ConsistencyError>> + Send + Sync>;

/// Adds a runner's handler (named after the runner) to one informer, feeding a queue.
type Register = Box<
    dyn Fn(&str, &WorkQueue<String>, Queueing) -> Result<Registered, InformerError> + Send + Sync,
>;

/// What a runner's handlers queue, and how.
#[derive(Debug, Clone, Copy)]
struct Queueing {
    /// Initial lists and resyncs below live changes.
    priorities: bool,
    /// Resyncs (updates with old and new at one revision) queued at all.
    resyncs: bool,
}

/// A reconcile with its types erased.
pub(crate) type Reconciler =
    Arc<dyn Fn(Context) -> BoxFuture<'static, Result<Action, String>> + Send + Sync>;

/// Whether this process may reconcile a key now, and under which fence: a sharded runner's
/// shards. `None`: not now (another replica's shard); the key is dropped from the queue, and
/// whoever holds its shard reconciles it.
pub(crate) type Admit = Arc<dyn Fn(&str) -> Option<Admitted> + Send + Sync>;

/// Leave to reconcile one key, held for the whole reconcile.
pub(crate) struct Admitted {
    pub(crate) fence: Option<Fence>,
    /// Resolves if the leave is withdrawn mid-reconcile (the lease that backs it was lost):
    /// the reconcile is then abandoned at its next `.await`.
    pub(crate) revoked: BoxFuture<'static, ()>,
    /// Counts the reconcile in until it is dropped, when the reconcile ends.
    pub(crate) in_flight: Box<dyn Send>,
}

/// Calls its argument with every key one informer's cached objects map to.
type ForEachKey = Box<dyn Fn(&mut dyn FnMut(String)) + Send + Sync>;

/// Calls `f` with every key the runner's informers would queue for their cached objects.
pub(crate) struct KeySource(Vec<Arc<Watched>>);

impl KeySource {
    pub(crate) fn for_each_key(&self, f: &mut dyn FnMut(String)) {
        for w in &self.0 {
            (w.keys)(f);
        }
    }
}

/// One watched informer, whatever its object type.
struct Watched {
    informer: String,
    register: Register,
    /// Every key its cached objects map to.
    keys: ForEachKey,
    wait_for: WaitFor,
    /// The revision the informer's cache is at.
    revision: Box<dyn Fn() -> i64 + Send + Sync>,
    /// The key's cached object.
    get: Get,
    /// A `Lister<T>`.
    lister: Box<dyn Any + Send + Sync>,
}

/// A handler added to an informer for one run.
struct Registered {
    informer: String,
    synced: Box<dyn Fn() -> bool + Send + Sync>,
    unregister: Option<Box<dyn FnOnce() + Send + Sync>>,
}

/// The handlers of one run; they leave their informers when this is dropped, however the run
/// ends (returned, cancelled, leadership lost).
struct Registrations(Vec<Registered>);

impl Drop for Registrations {
    fn drop(&mut self) {
        for r in &mut self.0 {
            if let Some(unregister) = r.unregister.take() {
                unregister();
            }
        }
    }
}

/// What a reconcile is given: the key, the key's cached object in the watched informers, their
/// listers, and the runner's name.
///
/// The objects are looked up when the reconcile starts (after any wait for the key's last
/// write, see [`Action::Wrote`]), so they stay the same throughout one reconcile; the listers
/// read the caches as they are when called. Informers are numbered in the order they were
/// passed to [`Runner::watch`] / [`Runner::watch_mapped`], from 0.
///
/// ```no_run
/// # async fn demo(specs: etcd_informer::SharedIndexInformer<u32>, pods: etcd_informer::SharedIndexInformer<String>) {
/// use etcd_informer::runner::{Action, Context, Runner};
/// let runner = Runner::new("replicas").watch(&specs).watch(&pods);
/// let reconcile = |ctx: Context| async move {
///     match ctx.object::<u32>() {
///         Some(spec) => println!("{} wants {} replicas", ctx.key(), spec.value),
///         None => println!("{} was deleted", ctx.key()),
///     }
///     let pods = ctx.lister::<String>().expect("watched").len();
///     println!("{pods} pods cached");
///     Ok::<_, String>(Action::Done)
/// };
/// runner.run_with_context(reconcile, std::future::pending()).await;
/// # }
/// ```
pub struct Context {
    key: String,
    runner: Arc<str>,
    retries: u32,
    fence: Option<Fence>,
    /// Per watched informer, the key's object when the reconcile started.
    objects: Vec<Option<AnyObject>>,
    watched: Arc<[Arc<Watched>]>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("key", &self.key)
            .field("runner", &self.runner)
            .field("retries", &self.retries)
            .field(
                "cached_in",
                &self
                    .objects
                    .iter()
                    .zip(self.watched.iter())
                    .filter(|(o, _)| o.is_some())
                    .map(|(_, w)| w.informer.as_str())
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Context {
    /// The key to reconcile.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The key, by value.
    pub fn into_key(self) -> String {
        self.key
    }

    /// The runner's name.
    pub fn runner(&self) -> &str {
        &self.runner
    }

    /// How many times this key has been retried with backoff since it last succeeded (0 on a
    /// first attempt).
    pub fn retries(&self) -> u32 {
        self.retries
    }

    /// The fence to make this reconcile's writes under, when the runner is sharded: the owner
    /// record of the key's shard (see [`TypedClient::fenced`](crate::client::TypedClient::fenced)).
    /// `None` for a runner that is not sharded.
    pub fn fence(&self) -> Option<&Fence> {
        self.fence.as_ref()
    }

    /// The key's object in the first watched informer of object type `T` whose cache held the
    /// key; `None` if none did (deleted, or never there).
    pub fn object<T: Send + Sync + 'static>(&self) -> Option<Arc<Object<T>>> {
        (0..self.objects.len()).find_map(|i| self.object_in(i))
    }

    /// The key's object in the `informer`-th watched informer, if that informer's objects are
    /// `T`s and its cache held the key.
    pub fn object_in<T: Send + Sync + 'static>(&self, informer: usize) -> Option<Arc<Object<T>>> {
        let object = self.objects.get(informer)?.clone()?;
        object.downcast::<Object<T>>().ok()
    }

    /// Whether no watched informer's cache held the key: it was deleted (or was never there,
    /// e.g. a key added to the queue by hand or a key that only a mapping produces).
    pub fn is_deleted(&self) -> bool {
        self.objects.iter().all(Option::is_none)
    }

    /// The lister of the first watched informer of object type `T`.
    pub fn lister<T: Send + Sync + 'static>(&self) -> Option<&Lister<T>> {
        self.watched.iter().find_map(|w| w.lister.downcast_ref())
    }

    /// The lister of the `informer`-th watched informer, if its objects are `T`s.
    pub fn lister_at<T: Send + Sync + 'static>(&self, informer: usize) -> Option<&Lister<T>> {
        self.watched.get(informer)?.lister.downcast_ref()
    }
}

/// Turns a reconcile of keys into a reconcile of [`Context`]s, for
/// [`run_as_leader`](Runner::run_as_leader).
pub fn by_key<F, Fut>(reconcile: F) -> impl Fn(Context) -> Fut + Send + Sync + 'static
where
    F: Fn(String) -> Fut + Send + Sync + 'static,
{
    move |ctx: Context| reconcile(ctx.into_key())
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
    /// a child object).
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
            let registration = Arc::new(registrar.add_named_event_handler(runner, handler)?);
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
    crate::split_key(key).0.to_owned()
}

pub(crate) fn erase<F, Fut, E>(reconcile: F) -> Reconciler
where
    F: Fn(Context) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
    E: fmt::Display + Send + 'static,
{
    Arc::new(move |ctx| {
        let fut = reconcile(ctx);
        Box::pin(async move { fut.await.map_err(|e| e.to_string()) })
    })
}

/// Refreshes the queue's in-flight metrics while a run lasts.
async fn publish_in_flight(queue: WorkQueue<String>) {
    let mut tick = tokio::time::interval(IN_FLIGHT_METRICS_PERIOD);
    loop {
        tick.tick().await;
        let _ = queue.metrics();
    }
}

/// What the workers of one run share.
struct Workers {
    queue: WorkQueue<String>,
    reconcile: Reconciler,
    runner: Arc<str>,
    watched: Arc<[Arc<Watched>]>,
    written: Arc<Mutex<HashMap<String, i64>>>,
    /// Past this many records in `written`, the applied ones are pruned.
    prune_written_at: Mutex<usize>,
    timeout: Option<Duration>,
    metrics: Arc<RunnerMetrics>,
    admit: Option<Admit>,
}

/// The fewest write records kept before those applied everywhere are pruned.
const PRUNE_WRITTEN: usize = 1024;

/// How one reconcile ended.
enum Outcome {
    Finished(Result<Action, String>),
    Panicked(String),
    TimedOut(Duration),
    /// The leave to reconcile was withdrawn: another replica may own the key now.
    Revoked,
}

impl Workers {
    async fn work(self: Arc<Self>) {
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
                Some(admit) => match admit(&key) {
                    Some(admitted) => Some(admitted),
                    None => {
                        queue.forget(&key);
                        queue.done(&key);
                        continue;
                    }
                },
            };
            self.reconcile(&key, admitted).await;
            queue.done(&key);
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

    /// Waits until every informer has applied `key`'s last recorded write, then forgets it.
    async fn read_your_writes(&self, key: &str) -> Result<(), ConsistencyError> {
        let Some(revision) = lock(&self.written).get(key).copied() else {
            return Ok(());
        };
        for w in self.watched.iter() {
            (w.wait_for)(revision, READ_YOUR_WRITES_TIMEOUT).await?;
        }
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
