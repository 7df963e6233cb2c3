//! A chaos driver: an informer over a prefix of a real 3-member etcd cluster, a seeded schedule
//! of writes, faults injected while the writes go on, and checks that the cache comes back to
//! etcd's exact state and that the handlers' history is sound.
//!
//! One [`Chaos`] owns a fresh [`EtcdCluster`] of three members and one informer connected to
//! member 0 only ([`Endpoints::One`]) or to all members ([`Endpoints::All`]). Each
//! [`round`](Chaos::round) injects one [`Fault`]:
//!
//! | fault | what happens to etcd |
//! | --- | --- |
//! | [`KillRestart`](Fault::KillRestart) | the target member is SIGKILLed; writes, deletes and a compaction go to the others; the member is restarted on its data |
//! | [`PauseResume`](Fault::PauseResume) | the target member is SIGSTOPped for [`ChaosConfig::pause`] while the others take writes |
//! | [`Compaction`](Fault::Compaction) | the target member is SIGSTOPped past the watch's idle timeout; the others take writes and are compacted to their current revision, so the informer's revision is gone when it comes back (unless its new watch is served before the resumed member applies the compaction: a relist is likely, not certain) |
//! | [`WipeCluster`](Fault::WipeCluster) | every member is wiped and the cluster recreated ([`EtcdCluster::wipe`]); new keys are written, fewer than the old store's revision |
//! | [`HungMember`](Fault::HungMember) | all endpoints only: the member serving the watch is SIGSTOPped and stays hung while the others take writes, until the cache equals etcd through them; then it is resumed. Its time runs from the hang |
//!
//! On etcd 3.5.0 to 3.5.2 a kill waits until its member has applied every write and its
//! backend has committed: those versions can bring a member killed during an apply back with
//! its revisions off from the cluster's for good (etcd-io/etcd#13766, fixed in 3.5.3), which no
//! client can repair. The soak met it on 3.5.1: after a kill, the one-endpoint cache held every
//! key written since at a `mod_revision` one below what the other members answered.
//!
//! With the `server` feature, [`ChaosConfig::with_through_server`] puts a
//! [`CacheServer`](crate::serve::CacheServer) in front of the three members and gives the
//! informer the server as its only endpoint: the same faults and checks, through the server.
//!
//! The target is the informer's member (0) with one endpoint; with all three, mostly the member
//! serving the informer's watch (the one whose `/metrics` count a watcher), sometimes another
//! one. Writes always go through members other than the target.
//!
//! Every round then measures the time from the end of the fault (the start, for a hung member)
//! until the cache equals etcd
//! exactly (every key, value and `mod_revision`, etcd read linearizably) and checks the history
//! the handler recorded:
//!
//! - per key, the revisions of adds and updates strictly increase: no event is delivered twice
//!   and none goes back (a wipe starts revisions over: values carry the store's *epoch*, which
//!   the driver bumps at each wipe, and order is `(epoch, mod_revision)`);
//! - an add comes only for an absent key, an update and a delete only for a present one;
//! - an update's old object and a delete's object are the last object delivered for the key;
//! - a tombstone ([`DeletedObject::is_final_state_unknown`](crate::DeletedObject::is_final_state_unknown))
//!   comes only after a list other than the first;
//! - once the cache has converged, the last event of every key is etcd's final state (a delete,
//!   or no event at all, for a key etcd lacks).
//!
//! ```no_run
//! use etcd_informer::testing::chaos::{fault_schedule, Chaos, ChaosConfig, Endpoints};
//!
//! # async fn demo() -> Result<(), etcd_informer::testing::chaos::ChaosError> {
//! let mut chaos = Chaos::start(ChaosConfig::new(7, Endpoints::One)).await?;
//! for fault in fault_schedule(7, 1, Endpoints::One) {
//!     let report = chaos.round(fault).await?; // fails if the cache never converges
//!     println!("{report}");
//!     report.check()?; // fails on a history violation
//! }
//! # Ok(()) }
//! ```

mod checker;
mod report;
mod schedule;
mod workload;

use std::collections::BTreeSet;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, GetOptions};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use self::checker::{diff, recorder, Checker, History, Kind, State};
use super::etcd::{EtcdCluster, HarnessError};
use crate::backoff::Backoff;
use crate::codec::TextCodec;
use crate::informer::InformerOptions;
use crate::informer::SharedIndexInformer;
use crate::listwatch::etcd::EtcdListerWatcher;
use crate::listwatch::etcd::EtcdOptions;
use crate::listwatch::WatchStream;
use crate::listwatch::{
    BoxFuture, Capabilities, ListResult, ListSink, ListerWatcher, Result as LwResult,
};
use crate::sync::lock;

pub use report::{ChaosError, RoundReport};
pub use schedule::{fault_schedule, Endpoints, Fault};

/// Members of the cluster.
const MEMBERS: usize = 3;
/// How long one write may be retried (across the writer members) before it is given up.
const WRITE_DEADLINE: Duration = Duration::from_secs(10);
/// Request timeout of the driver's own clients.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// How often convergence is polled.
const POLL: Duration = Duration::from_millis(25);
/// How long handlers may take, after the cache converged, to deliver what it applied.
const DRAIN: Duration = Duration::from_secs(10);

/// Settings of a [`Chaos`] run.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ChaosConfig {
    /// Seeds every random choice of the schedule: operations, keys, target members, counts.
    pub seed: u64,
    /// Which members the informer's client is given.
    pub endpoints: Endpoints,
    /// The watched prefix (must end with `/`).
    pub prefix: String,
    /// How many distinct keys the writes touch.
    pub keys: usize,
    /// How long [`Fault::PauseResume`] keeps its member stopped.
    pub pause: Duration,
    /// How long the cache may take to equal etcd after a fault ended (and to sync at start).
    pub deadline: Duration,
    /// The informer's etcd source options; the defaults notice a dead watch within seconds.
    pub etcd: EtcdOptions,
    /// The informer's reflector backoff.
    pub backoff: Backoff,
    /// The informer's only endpoint is a [`CacheServer`](crate::serve::CacheServer) in front
    /// of every member (with [`ChaosConfig::etcd`] for its own source); the faults target its
    /// members as with [`Endpoints::All`], whatever `endpoints` says.
    #[cfg(feature = "server")]
    pub through_server: bool,
}

impl ChaosConfig {
    /// 24 keys under `/chaos/`, 3 s pauses, 90 s deadlines, progress every 500 ms, a watch
    /// silent for 3 s declared dead, and a reflector backoff of 50 ms doubling to 1 s.
    pub fn new(seed: u64, endpoints: Endpoints) -> Self {
        ChaosConfig {
            seed,
            endpoints,
            prefix: "/chaos/".into(),
            keys: 24,
            pause: Duration::from_secs(3),
            deadline: Duration::from_secs(90),
            etcd: EtcdOptions {
                progress_interval: Duration::from_millis(500),
                idle_timeout: Duration::from_secs(3),
                ..EtcdOptions::default()
            },
            backoff: Backoff::new(
                Duration::from_millis(50),
                Duration::from_secs(1),
                Duration::from_secs(120),
                0.5,
            ),
            #[cfg(feature = "server")]
            through_server: false,
        }
    }

    /// The informer reads through a cache server (see [`ChaosConfig::through_server`]).
    #[cfg(feature = "server")]
    pub fn with_through_server(mut self, through_server: bool) -> Self {
        self.through_server = through_server;
        if through_server {
            self.endpoints = Endpoints::All;
        }
        self
    }
}

// ---------------------------------------------------------------------------------------------
// Schedule

// ---------------------------------------------------------------------------------------------
// History

// ---------------------------------------------------------------------------------------------
// The informer's source

/// The etcd source, counting its lists: a tombstone is allowed only after the second.
struct CountingLists<L> {
    inner: L,
    lists: Arc<AtomicUsize>,
}

impl<L: ListerWatcher<String>> ListerWatcher<String> for CountingLists<L> {
    fn list(&self) -> BoxFuture<'_, LwResult<ListResult<String>>> {
        self.lists.fetch_add(1, Ordering::SeqCst);
        self.inner.list()
    }
    fn list_into(&self, sink: Arc<dyn ListSink<String>>) -> BoxFuture<'_, LwResult<i64>> {
        self.lists.fetch_add(1, Ordering::SeqCst);
        self.inner.list_into(sink)
    }
    fn watch(&self, after_revision: i64) -> BoxFuture<'_, LwResult<WatchStream<String>>> {
        self.inner.watch(after_revision)
    }
    fn capabilities(&self) -> Capabilities<'_> {
        self.inner.capabilities()
    }
}

// ---------------------------------------------------------------------------------------------
// The driver

/// A 3-member etcd cluster, an informer over [`ChaosConfig::prefix`], the seeded schedule, and
/// the history checker; see the [module docs](crate::testing::chaos). Dropping it stops the informer and the
/// cluster.
pub struct Chaos {
    config: ChaosConfig,
    cluster: EtcdCluster,
    /// One client per member, with short request timeouts: writes and reads pick their member.
    clients: Vec<Client>,
    rng: fastrand::Rng,
    informer: SharedIndexInformer<String>,
    /// The informer's `run`, once started.
    run: Option<JoinHandle<()>>,
    lists: Arc<AtomicUsize>,
    watch_errors: Arc<AtomicUsize>,
    history: History,
    checker: Checker,
    /// Keys believed present (from confirmed writes), so that deletes mostly hit something.
    present: BTreeSet<String>,
    /// The store epoch, bumped at every wipe.
    epoch: u64,
    /// Values written so far, to make each one unique.
    values: u64,
    round: usize,
    /// Confirmed and given-up writes of the current round.
    writes: (usize, usize),
    /// The cluster runs etcd 3.5.0 to 3.5.2, whose members can come back from a SIGKILL
    /// during an apply with their revisions off from the cluster's for good (etcd-io/etcd#13766,
    /// fixed in 3.5.3): a kill waits until its member is quiet (see [`Chaos::quiesce`]).
    kill_corrupts: bool,
    /// The cache server the informer reads through, if it does: held to keep it serving.
    #[cfg(feature = "server")]
    _server: Option<crate::serve::RunningServer>,
}

impl fmt::Debug for Chaos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Chaos")
            .field("config", &self.config)
            .field("round", &self.round)
            .field("epoch", &self.epoch)
            .finish_non_exhaustive()
    }
}

impl Drop for Chaos {
    fn drop(&mut self) {
        self.informer.stop();
        if let Some(run) = &self.run {
            run.abort();
        }
    }
}

impl Chaos {
    /// Starts the cluster, writes an initial population of keys, starts the informer, and
    /// waits until it has synced and its cache equals etcd.
    pub async fn start(config: ChaosConfig) -> Result<Chaos, ChaosError> {
        let seed = config.seed;
        let endpoints = config.endpoints;
        let fail_etcd = |what: String| ChaosError::Etcd {
            seed,
            endpoints,
            round: 0,
            phase: "start".into(),
            what,
        };
        let cluster = EtcdCluster::start(MEMBERS)
            .await
            .map_err(|source| ChaosError::Harness {
                seed,
                endpoints,
                round: 0,
                phase: "start".into(),
                source: Box::new(source),
            })?;
        let mut clients = Vec::with_capacity(MEMBERS);
        for endpoint in cluster.endpoints() {
            let options = ConnectOptions::new()
                .with_timeout(REQUEST_TIMEOUT)
                .with_connect_timeout(REQUEST_TIMEOUT);
            let client = Client::connect([&endpoint], Some(options))
                .await
                .map_err(|e| fail_etcd(format!("connecting to {endpoint}: {e}")))?;
            clients.push(client);
        }
        let informer_endpoints = match endpoints {
            Endpoints::One => vec![cluster.member_endpoint(0)],
            Endpoints::All => cluster.endpoints(),
        };
        #[cfg(feature = "server")]
        let (informer_endpoints, server) = if config.through_server {
            let own = crate::connect(&informer_endpoints)
                .await
                .map_err(|e| fail_etcd(format!("the server's client: {e}")))?;
            let options = crate::serve::CacheServerOptions {
                etcd: config.etcd.clone(),
                ..Default::default()
            };
            let server =
                crate::serve::CacheServer::new(own, informer_endpoints, config.prefix.clone())
                    .with_options(options)
                    .bind(([127, 0, 0, 1], 0).into())
                    .await
                    .map_err(|e| fail_etcd(format!("starting the cache server: {e}")))?;
            server
                .ready(config.deadline)
                .await
                .map_err(|e| fail_etcd(format!("the cache server did not sync: {e}")))?;
            (vec![server.local_addr().to_string()], Some(server))
        } else {
            (informer_endpoints, None)
        };
        let informer_client = crate::connect(&informer_endpoints)
            .await
            .map_err(|e| fail_etcd(format!("connecting to {informer_endpoints:?}: {e}")))?;
        let source = EtcdListerWatcher::with_options(
            informer_client,
            config.prefix.clone(),
            TextCodec,
            config.etcd.clone(),
        )
        .map_err(|e| fail_etcd(format!("the informer's source: {e}")))?;
        let lists = Arc::new(AtomicUsize::new(0));
        let watch_errors = Arc::new(AtomicUsize::new(0));
        let errors = watch_errors.clone();
        let informer = SharedIndexInformer::new(
            CountingLists {
                inner: source,
                lists: lists.clone(),
            },
            InformerOptions {
                name: format!("chaos {endpoints}"),
                backoff: config.backoff.clone(),
                watch_error_handler: Some(Arc::new(move |_| {
                    errors.fetch_add(1, Ordering::Relaxed);
                })),
                ..InformerOptions::default()
            },
        );
        let history = History::default();
        informer
            .add_event_handler(recorder(&history, &lists))
            .map_err(|e| fail_etcd(format!("registering the recorder: {e}")))?;
        let mut chaos = Chaos {
            rng: fastrand::Rng::with_seed(seed),
            config,
            cluster,
            clients,
            run: None,
            informer,
            lists,
            watch_errors,
            history,
            checker: Checker::default(),
            present: BTreeSet::new(),
            epoch: 0,
            values: 0,
            round: 0,
            writes: (0, 0),
            kill_corrupts: false,
            #[cfg(feature = "server")]
            _server: server,
        };
        if let Ok(status) = chaos.clients[0].status().await {
            chaos.kill_corrupts = kills_corrupt(status.version());
            if chaos.kill_corrupts {
                tracing::warn!(version = status.version(), "etcd 3.5.0-3.5.2 can corrupt a member killed during an apply (etcd-io/etcd#13766): kills wait until their member is quiet");
            }
        }
        // A population to list, written before the informer starts (with one endpoint, through
        // the other members, as every write).
        let all: Vec<usize> = (0..MEMBERS).collect();
        let writers: Vec<usize> = match endpoints {
            Endpoints::One => (1..MEMBERS).collect(),
            Endpoints::All => all.clone(),
        };
        let n = chaos.config.keys;
        chaos.write_ops(n, &writers, false).await;
        chaos.run = Some(tokio::spawn(chaos.informer.clone().run()));
        let started = Instant::now();
        let synced =
            tokio::time::timeout(chaos.config.deadline, chaos.informer.wait_for_cache_sync()).await;
        if synced.is_err() {
            return Err(fail_etcd(format!(
                "the informer did not sync within {:?}",
                chaos.config.deadline
            )));
        }
        let (etcd, _) = chaos.converge(started, &all, "start").await?;
        let (violations, _) = chaos.check_history(&etcd, &all).await;
        if !violations.is_empty() {
            return Err(ChaosError::Violations {
                seed,
                endpoints,
                round: 0,
                phase: "start".into(),
                violations,
            });
        }
        Ok(chaos)
    }

    /// The cluster, e.g. for its logs.
    pub fn cluster(&self) -> &EtcdCluster {
        &self.cluster
    }

    /// The informer under test.
    pub fn informer(&self) -> &SharedIndexInformer<String> {
        &self.informer
    }

    /// The settings.
    pub fn config(&self) -> &ChaosConfig {
        &self.config
    }

    /// Injects `fault` while writes go on, ends it, and waits until the cache equals etcd;
    /// then checks the history. Fails if the cache does not converge within
    /// [`ChaosConfig::deadline`] (the error has the differences) or etcd cannot be driven;
    /// history violations are in the report ([`RoundReport::check`]).
    pub async fn round(&mut self, fault: Fault) -> Result<RoundReport, ChaosError> {
        self.round += 1;
        self.writes = (0, 0);
        let lists_before = self.lists.load(Ordering::SeqCst);
        let errors_before = self.watch_errors.load(Ordering::Relaxed);
        let events_before = lock(&self.history).len();
        let watching = self.watching_member().await;
        let target = match (fault, self.config.endpoints) {
            (Fault::WipeCluster, _) => None,
            (Fault::HungMember, _) => match watching {
                Some(m) => Some(m),
                None => Some(self.rng.usize(0..MEMBERS)),
            },
            (_, Endpoints::One) => Some(0),
            // Mostly the member serving the informer's watch, sometimes another one.
            (_, Endpoints::All) => match watching {
                Some(m) if self.rng.u8(0..4) != 0 => Some(m),
                _ => Some(self.rng.usize(0..MEMBERS)),
            },
        };
        // Writes go through the members the fault does not hit.
        let writers: Vec<usize> = (0..MEMBERS).filter(|i| Some(*i) != target).collect();
        tracing::info!(round = self.round, %fault, ?target, endpoints = %self.config.endpoints, "chaos round");

        // Before the fault, the informer follows live.
        let n = self.rng.usize(3..8);
        self.write_ops(n, &writers, false).await;
        let fault_end = match fault {
            Fault::KillRestart => {
                let t = target.unwrap_or(0);
                if self.kill_corrupts {
                    self.quiesce(t, &writers, fault).await?;
                }
                self.cluster.kill_member(t);
                let n = self.rng.usize(10..25);
                self.write_ops(n, &writers, false).await;
                self.delete_some(&writers).await;
                self.compact(&writers, fault).await?;
                let n = self.rng.usize(1..4);
                self.write_ops(n, &writers, false).await;
                self.harness(fault, self.cluster.restart_member(t).await)?;
                Instant::now()
            }
            Fault::PauseResume => {
                let t = target.unwrap_or(0);
                self.harness(fault, self.cluster.pause_member(t))?;
                self.write_for(self.config.pause, &writers).await;
                self.harness(fault, self.cluster.resume_member(t))?;
                Instant::now()
            }
            Fault::Compaction => {
                let t = target.unwrap_or(0);
                // Paused past the idle timeout, the informer gives its watch up and comes back
                // to a revision that is gone.
                let window = self.config.etcd.idle_timeout + Duration::from_millis(1500);
                let paused = Instant::now();
                self.harness(fault, self.cluster.pause_member(t))?;
                self.write_for(window / 2, &writers).await;
                self.delete_some(&writers).await;
                self.compact(&writers, fault).await?;
                let left = window.saturating_sub(paused.elapsed());
                self.write_for(left, &writers).await;
                self.harness(fault, self.cluster.resume_member(t))?;
                Instant::now()
            }
            Fault::WipeCluster => {
                let n = self.rng.usize(10..20);
                self.write_ops(n, &writers, false).await;
                let old_revision = self.etcd_revision(&writers, fault).await?;
                self.harness(fault, self.cluster.wipe().await)?;
                let end = Instant::now();
                self.epoch += 1;
                self.present.clear();
                // New keys, in fewer revisions than the old store had.
                let budget = usize::try_from(old_revision / 3).unwrap_or(1).max(1);
                let n = self.rng.usize(5..15).min(budget);
                self.write_ops(n, &writers, true).await;
                end
            }
            Fault::HungMember => {
                if self.config.endpoints == Endpoints::One {
                    return Err(self.etcd_error(
                        &fault.to_string(),
                        "a hung member can only be left with all endpoints".into(),
                    ));
                }
                self.harness(fault, self.cluster.pause_member(target.unwrap_or(0)))?;
                let hung = Instant::now();
                let n = self.rng.usize(5..15);
                self.write_ops(n, &writers, false).await;
                self.delete_some(&writers).await;
                hung
            }
        };
        let phase = fault.to_string();
        // With one endpoint the informer can catch up only once its member answers a
        // linearizable read again: when that happens is measured beside the convergence.
        let answered = (self.config.endpoints == Endpoints::One
            && matches!(fault, Fault::KillRestart | Fault::WipeCluster))
        .then(|| {
            let mut kv = self.clients[0].kv_client();
            let prefix = self.config.prefix.clone();
            tokio::spawn(async move {
                loop {
                    let options = GetOptions::new().with_count_only();
                    if kv.get(prefix.as_str(), Some(options)).await.is_ok() {
                        return fault_end.elapsed();
                    }
                    tokio::time::sleep(POLL).await;
                }
            })
        });
        let converged = self.converge(fault_end, &writers, &phase).await;
        let member_answered_after = match answered {
            Some(task) => tokio::time::timeout(self.config.deadline, task)
                .await
                .ok()
                .and_then(Result::ok),
            None => None,
        };
        if fault == Fault::HungMember {
            // Hung until now, whether the cache converged or not.
            self.harness(fault, self.cluster.resume_member(target.unwrap_or(0)))?;
        }
        let (etcd, converged_after) = converged?;
        let (violations, late_keys) = self.check_history(&etcd, &writers).await;
        let history = lock(&self.history);
        let events = &history[events_before..];
        let tombstones = events
            .iter()
            .filter(|e| {
                matches!(
                    e.kind,
                    Kind::Delete {
                        tombstone: true,
                        ..
                    }
                )
            })
            .count();
        Ok(RoundReport {
            seed: self.config.seed,
            endpoints: self.config.endpoints,
            round: self.round,
            fault,
            target,
            watching,
            converged_after,
            member_answered_after,
            writes: self.writes.0,
            failed_writes: self.writes.1,
            relists: self.lists.load(Ordering::SeqCst) - lists_before,
            watch_errors: self.watch_errors.load(Ordering::Relaxed) - errors_before,
            events: events.len(),
            tombstones,
            late_keys,
            violations,
        })
    }

    // -- Errors

    fn harness<T>(&self, fault: Fault, result: Result<T, HarnessError>) -> Result<T, ChaosError> {
        result.map_err(|source| ChaosError::Harness {
            seed: self.config.seed,
            endpoints: self.config.endpoints,
            round: self.round,
            phase: fault.to_string(),
            source: Box::new(source),
        })
    }

    fn etcd_error(&self, phase: &str, what: String) -> ChaosError {
        ChaosError::Etcd {
            seed: self.config.seed,
            endpoints: self.config.endpoints,
            round: self.round,
            phase: phase.to_string(),
            what,
        }
    }

    // -- The schedule

    /// etcd's current revision, read linearizably through one of `members`.
    async fn etcd_revision(&self, members: &[usize], fault: Fault) -> Result<i64, ChaosError> {
        let deadline = Instant::now() + WRITE_DEADLINE;
        let mut last_error = String::new();
        for attempt in 0.. {
            let mut kv = self.clients[members[attempt % members.len()]].kv_client();
            let options = GetOptions::new().with_prefix().with_count_only();
            match kv.get(self.config.prefix.as_str(), Some(options)).await {
                Ok(resp) => return Ok(resp.header().map_or(0, |h| h.revision())),
                Err(e) => last_error = e.to_string(),
            }
            if Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(self.etcd_error(
            &fault.to_string(),
            format!("reading etcd's revision: {last_error}"),
        ))
    }

    /// The member serving the informer's watch: the one whose metrics count a watcher (the
    /// driver itself watches nothing). `None` if none does, e.g. between two watches.
    async fn watching_member(&self) -> Option<usize> {
        self.cluster.watching_member().await
    }

    // -- Checks

    /// etcd's content under the prefix and its revision, read linearizably through the first
    /// of `members` that answers.
    async fn read_etcd(&self, members: &[usize]) -> Result<(State, i64), String> {
        let mut errors = Vec::new();
        for &m in members {
            let mut kv = self.clients[m].kv_client();
            let options = GetOptions::new().with_prefix();
            match kv.get(self.config.prefix.as_str(), Some(options)).await {
                Ok(resp) => {
                    let revision = resp.header().map_or(0, |h| h.revision());
                    let state = resp
                        .kvs()
                        .iter()
                        .map(|kv| {
                            let key = String::from_utf8_lossy(kv.key());
                            let key = key
                                .strip_prefix(self.config.prefix.as_str())
                                .unwrap_or(&key);
                            let value = String::from_utf8_lossy(kv.value()).into_owned();
                            (key.to_string(), (kv.mod_revision(), value))
                        })
                        .collect();
                    return Ok((state, revision));
                }
                Err(e) => errors.push(format!("member {m}: {e}")),
            }
        }
        Err(errors.join("; "))
    }

    fn cache(&self) -> State {
        self.informer
            .lister()
            .list()
            .iter()
            .map(|o| (o.key().to_string(), (o.mod_revision, o.value.clone())))
            .collect()
    }

    /// Polls until the cache equals etcd, failing with the differences after the deadline
    /// (counted from `since`). Returns etcd's state and how long after `since` the cache was
    /// seen equal to it.
    async fn converge(
        &self,
        since: Instant,
        readers: &[usize],
        phase: &str,
    ) -> Result<(State, Duration), ChaosError> {
        let deadline = since + self.config.deadline;
        loop {
            let etcd = self.read_etcd(readers).await;
            let cache = self.cache();
            if let Ok((state, _)) = &etcd {
                if *state == cache {
                    return Ok((cache, since.elapsed()));
                }
            }
            if Instant::now() >= deadline {
                let (diff, etcd_revision) = match &etcd {
                    Ok((state, revision)) => (diff(&cache, state), *revision),
                    Err(e) => (format!("cannot read etcd: {e}"), 0),
                };
                return Err(ChaosError::NotConverged {
                    seed: self.config.seed,
                    endpoints: self.config.endpoints,
                    round: self.round,
                    phase: phase.to_string(),
                    waited: since.elapsed(),
                    cache_revision: self.informer.revision(),
                    etcd_revision,
                    lists: self.lists.load(Ordering::SeqCst),
                    diff,
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Checks the events recorded since the last check, waiting up to [`DRAIN`] for the handler
    /// to receive everything the cache applied: its last events must equal etcd, `etcd` at
    /// first and etcd read again through `readers` while they differ. A write whose reply
    /// failed was retried elsewhere, but its first attempt can still commit later (a proposal
    /// forwarded to a hung leader lands once it resumes, after the cache converged): etcd's
    /// state then moves on without the driver, and the handler must follow it. Returns the
    /// violations and how many keys etcd changed after `etcd` (reported, so that a late
    /// write is never silent).
    async fn check_history(&mut self, etcd: &State, readers: &[usize]) -> (Vec<String>, usize) {
        let deadline = Instant::now() + DRAIN;
        let mut violations = Vec::new();
        let mut now = etcd.clone();
        loop {
            violations.extend(self.checker.advance(&self.history));
            let mismatches = self.checker.final_mismatches(&now);
            if mismatches.is_empty() || Instant::now() >= deadline {
                violations.extend(
                    mismatches
                        .into_iter()
                        .map(|m| format!("{m} ({DRAIN:?} after the cache converged)")),
                );
                let moved = etcd.keys().chain(now.keys());
                let late = moved
                    .filter(|k| etcd.get(*k) != now.get(*k))
                    .collect::<std::collections::BTreeSet<_>>()
                    .len();
                return (violations, late);
            }
            tokio::time::sleep(POLL).await;
            if let Ok((state, _)) = self.read_etcd(readers).await {
                now = state;
            }
        }
    }
}

/// Whether an etcd version can corrupt a member killed during an apply (etcd-io/etcd#13766:
/// 3.5.0 to 3.5.2).
fn kills_corrupt(version: &str) -> bool {
    let mut parts = version
        .split('.')
        .map(|p| p.parse::<u32>().unwrap_or(u32::MAX));
    matches!(
        (parts.next(), parts.next(), parts.next()),
        (Some(3), Some(5), Some(0..=2))
    )
}
