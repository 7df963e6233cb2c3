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

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, GetOptions, Txn, TxnOp};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::etcd::{EtcdCluster, HarnessError};
use crate::codec::TextCodec;
use crate::listwatch::{
    BoxFuture, Freshness, ListResult, ListSink, ListerWatcher, Result as LwResult,
};
use crate::{
    Backoff, EtcdListerWatcher, EtcdOptions, InformerOptions, Object, ResourceEventHandlerFuncs,
    SharedIndexInformer, WatchStream,
};

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

/// The fault a round injects; see the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fault {
    /// SIGKILL a member, write, delete and compact on the others, restart it.
    KillRestart,
    /// SIGSTOP a member for [`ChaosConfig::pause`] while the others take writes.
    PauseResume,
    /// SIGSTOP a member past the watch's idle timeout, write and compact meanwhile.
    Compaction,
    /// Wipe and recreate the whole cluster, then write fewer revisions than it had.
    WipeCluster,
    /// SIGSTOP the member serving the watch and keep it hung until the cache equals etcd
    /// through the others (all endpoints only).
    HungMember,
}

impl Fault {
    /// Every fault kind.
    pub const ALL: [Fault; 5] = [
        Fault::KillRestart,
        Fault::PauseResume,
        Fault::Compaction,
        Fault::WipeCluster,
        Fault::HungMember,
    ];

    /// The fault kinds that make sense with `endpoints`: a hung member can only be left for
    /// another one when the informer has the others.
    pub fn for_endpoints(endpoints: Endpoints) -> &'static [Fault] {
        match endpoints {
            Endpoints::One => &Self::ALL[..4],
            Endpoints::All => &Self::ALL,
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Fault::KillRestart => "kill-restart",
            Fault::PauseResume => "pause-resume",
            Fault::Compaction => "compaction",
            Fault::WipeCluster => "wipe-cluster",
            Fault::HungMember => "hung-member",
        })
    }
}

/// Which members the informer's client is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Endpoints {
    /// Member 0 only: every fault but the wipe hits the informer's own member.
    One,
    /// All three members: the client may move to another one.
    All,
}

impl fmt::Display for Endpoints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Endpoints::One => "one endpoint",
            Endpoints::All => "all endpoints",
        })
    }
}

/// `rounds_per_fault` rounds of every fault kind that makes sense with `endpoints`
/// ([`Fault::for_endpoints`]), in an order shuffled by `seed`.
pub fn fault_schedule(seed: u64, rounds_per_fault: usize, endpoints: Endpoints) -> Vec<Fault> {
    let mut faults: Vec<Fault> = (0..rounds_per_fault)
        .flat_map(|_| Fault::for_endpoints(endpoints).iter().copied())
        .collect();
    fastrand::Rng::with_seed(seed ^ 0x5eed_fa17).shuffle(&mut faults);
    faults
}

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
        }
    }
}

/// Why a chaos run stopped. Every variant names the seed, the endpoint mode, the round and the
/// fault (round 0 is the initial sync).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChaosError {
    /// Starting or controlling etcd failed.
    #[error("seed {seed}, {endpoints}, round {round} ({phase}): etcd harness: {source}")]
    Harness {
        /// The run's seed.
        seed: u64,
        /// The endpoint mode.
        endpoints: Endpoints,
        /// The round.
        round: usize,
        /// The fault, or `start`.
        phase: String,
        /// What failed.
        #[source]
        source: Box<HarnessError>,
    },
    /// A request the driver cannot do without failed (connecting, compacting).
    #[error("seed {seed}, {endpoints}, round {round} ({phase}): {what}")]
    Etcd {
        /// The run's seed.
        seed: u64,
        /// The endpoint mode.
        endpoints: Endpoints,
        /// The round.
        round: usize,
        /// The fault, or `start`.
        phase: String,
        /// What failed, with etcd's error.
        what: String,
    },
    /// The cache did not equal etcd within the deadline.
    #[error(
        "seed {seed}, {endpoints}, round {round} ({phase}): the cache still differed from etcd \
         {waited:?} after the fault ended (cache at revision {cache_revision}, etcd at \
         {etcd_revision}, {lists} lists so far); key: cache / etcd\n{diff}"
    )]
    NotConverged {
        /// The run's seed.
        seed: u64,
        /// The endpoint mode.
        endpoints: Endpoints,
        /// The round.
        round: usize,
        /// The fault, or `start`.
        phase: String,
        /// How long it waited.
        waited: Duration,
        /// The cache's revision at the end.
        cache_revision: i64,
        /// etcd's revision at the last read (0 if it could not be read).
        etcd_revision: i64,
        /// How many times the informer listed.
        lists: usize,
        /// One line per key that differs (or the last error reading etcd).
        diff: String,
    },
    /// The handler's history broke a rule.
    #[error("seed {seed}, {endpoints}, round {round} ({phase}): history violations:\n{}", violations.join("\n"))]
    Violations {
        /// The run's seed.
        seed: u64,
        /// The endpoint mode.
        endpoints: Endpoints,
        /// The round.
        round: usize,
        /// The fault, or `start`.
        phase: String,
        /// One line per violation.
        violations: Vec<String>,
    },
}

/// What one round did and measured.
#[derive(Debug, Clone)]
pub struct RoundReport {
    /// The run's seed.
    pub seed: u64,
    /// The endpoint mode.
    pub endpoints: Endpoints,
    /// The round, from 1 (0 is the initial sync).
    pub round: usize,
    /// The fault injected.
    pub fault: Fault,
    /// The member the fault hit (`None`: all of them).
    pub target: Option<usize>,
    /// The member that served the informer's watch when the round began, if one did.
    pub watching: Option<usize>,
    /// From the end of the fault until the cache equalled etcd.
    pub converged_after: Duration,
    /// After a restart or a wipe with one endpoint: from the end of the fault until the
    /// informer's member first answered a linearizable read (before that, no client of it can
    /// catch up). `None` for other faults and modes.
    pub member_answered_after: Option<Duration>,
    /// Writes (puts, deletes, transactions) that etcd confirmed.
    pub writes: usize,
    /// Writes given up after 10 s of retries (their outcome is unknown, which the
    /// checks do not mind: they compare against what etcd holds).
    pub failed_writes: usize,
    /// Lists the informer made during the round (relists).
    pub relists: usize,
    /// List and watch errors reported during the round.
    pub watch_errors: usize,
    /// Notifications the handler received during the round.
    pub events: usize,
    /// Tombstones among [`events`](Self::events).
    pub tombstones: usize,
    /// Broken history rules, one line each; empty when all is well.
    pub violations: Vec<String>,
}

impl RoundReport {
    /// `Err` with every violation, naming the seed, round and fault, if there are any.
    pub fn check(&self) -> Result<(), ChaosError> {
        if self.violations.is_empty() {
            return Ok(());
        }
        Err(ChaosError::Violations {
            seed: self.seed,
            endpoints: self.endpoints,
            round: self.round,
            phase: self.fault.to_string(),
            violations: self.violations.clone(),
        })
    }
}

impl fmt::Display for RoundReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let target = match self.target {
            None => "all members".to_string(),
            Some(t) if self.watching == Some(t) => format!("member {t}, the informer's"),
            Some(t) => format!("member {t}"),
        };
        write!(
            f,
            "seed {} {} round {} {} ({target}): converged {:?} after the fault ended{}; \
             {} writes ({} given up), {} relists, {} watch errors, {} events ({} tombstones), \
             {} violations",
            self.seed,
            self.endpoints,
            self.round,
            self.fault,
            self.converged_after,
            match self.member_answered_after {
                Some(answered) => format!(
                    " ({:?} after its member answered a linearizable read at {answered:?})",
                    self.converged_after.saturating_sub(answered)
                ),
                None => String::new(),
            },
            self.writes,
            self.failed_writes,
            self.relists,
            self.watch_errors,
            self.events,
            self.tombstones,
            self.violations.len()
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Schedule

/// One write of the schedule; keys relative to the prefix.
#[derive(Debug, Clone)]
enum Op {
    Put {
        key: String,
        value: String,
    },
    Delete {
        key: String,
    },
    /// Several puts and one delete in one revision.
    Txn {
        puts: Vec<(String, String)>,
        delete: String,
    },
}

/// `(mod_revision, value)` of a key: what the cache and etcd are compared on.
type State = BTreeMap<String, (i64, String)>;

/// The store epoch written into every value (`e<epoch>-...`): 0 for the first store, bumped at
/// every wipe, so that order survives revisions starting over.
fn epoch_of(value: &str) -> u64 {
    value
        .strip_prefix('e')
        .and_then(|rest| rest.split('-').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// History

#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    revision: i64,
    value: String,
}

impl Seen {
    fn of(obj: &Object<String>) -> Self {
        Seen {
            revision: obj.mod_revision,
            value: obj.value.clone(),
        }
    }

    fn order(&self) -> (u64, i64) {
        (epoch_of(&self.value), self.revision)
    }
}

impl fmt::Display for Seen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.value, self.revision)
    }
}

#[derive(Debug, Clone)]
enum Kind {
    Add(Seen),
    Update { old: Seen, new: Seen },
    Delete { last: Seen, tombstone: bool },
}

/// One notification as the handler received it.
#[derive(Debug, Clone)]
struct Recorded {
    key: String,
    kind: Kind,
    /// How many lists the informer had started when the handler received it.
    lists: usize,
}

impl fmt::Display for Recorded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Add(o) => write!(f, "add {o}"),
            Kind::Update { old, new } => write!(f, "update {old} -> {new}"),
            Kind::Delete { last, tombstone } => {
                let kind = if *tombstone { "tombstone" } else { "delete" };
                write!(f, "{kind} {last}")
            }
        }
    }
}

type History = Arc<Mutex<Vec<Recorded>>>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A handler recording every notification with the number of lists made so far.
fn recorder(history: &History, lists: &Arc<AtomicUsize>) -> ResourceEventHandlerFuncs<String> {
    let record = {
        let (history, lists) = (history.clone(), lists.clone());
        move |key: &str, kind: Kind| {
            let lists = lists.load(Ordering::SeqCst);
            lock(&history).push(Recorded {
                key: key.to_string(),
                kind,
                lists,
            });
        }
    };
    let (on_add, on_update, on_delete) = (record.clone(), record.clone(), record);
    ResourceEventHandlerFuncs::new()
        .on_add(move |o, _| on_add(o.key(), Kind::Add(Seen::of(o))))
        .on_update(move |old, new| {
            on_update(
                new.key(),
                Kind::Update {
                    old: Seen::of(old),
                    new: Seen::of(new),
                },
            )
        })
        .on_delete(move |d| {
            on_delete(
                d.key(),
                Kind::Delete {
                    last: Seen::of(d.object()),
                    tombstone: d.is_final_state_unknown(),
                },
            )
        })
}

/// What the handler has been told of one key.
#[derive(Debug)]
struct KeyState {
    /// The last object delivered (kept after a delete, for ordering).
    last: Seen,
    present: bool,
}

/// Checks the recorded history incrementally; see the module docs for the rules.
#[derive(Debug, Default)]
struct Checker {
    /// Events of the history already checked.
    checked: usize,
    keys: HashMap<String, KeyState>,
}

impl Checker {
    /// Checks the events recorded since the last call; returns the violations found.
    fn advance(&mut self, history: &History) -> Vec<String> {
        let new: Vec<Recorded> = lock(history)[self.checked..].to_vec();
        let count = new.len();
        let mut violations = Vec::new();
        for (i, event) in new.into_iter().enumerate() {
            let index = self.checked + i;
            let mut bad = |why: String| {
                violations.push(format!(
                    "event {index} ({event}) of key {}: {why}",
                    event.key
                ))
            };
            let state = self.keys.get(&event.key);
            match &event.kind {
                Kind::Add(new) => {
                    if let Some(s) = state {
                        if s.present {
                            bad(format!("added while present (last delivered {})", s.last));
                        }
                        if new.order() <= s.last.order() {
                            bad(format!("not newer than the last delivered {}", s.last));
                        }
                    }
                }
                Kind::Update { old, new } => match state {
                    Some(s) if s.present => {
                        if *old != s.last {
                            bad(format!("old object is not the last delivered {}", s.last));
                        }
                        if new.order() <= s.last.order() {
                            bad(format!("not newer than the last delivered {}", s.last));
                        }
                    }
                    _ => bad("updated while absent".into()),
                },
                Kind::Delete { last, tombstone } => {
                    match state {
                        Some(s) if s.present => {
                            if *last != s.last {
                                bad(format!(
                                    "carries another object than the last delivered {}",
                                    s.last
                                ));
                            }
                        }
                        _ => bad("deleted while absent".into()),
                    }
                    if *tombstone && event.lists < 2 {
                        bad(format!(
                            "tombstone before any relist ({} lists)",
                            event.lists
                        ));
                    }
                }
            }
            let (last, present) = match event.kind {
                Kind::Add(new) | Kind::Update { new, .. } => (new, true),
                Kind::Delete { last, .. } => (last, false),
            };
            self.keys.insert(event.key, KeyState { last, present });
        }
        self.checked += count;
        violations
    }

    /// Keys whose last delivered event is not etcd's state `etcd`.
    fn final_mismatches(&self, etcd: &State) -> Vec<String> {
        let mut out = Vec::new();
        for (key, (revision, value)) in etcd {
            let want = Seen {
                revision: *revision,
                value: value.clone(),
            };
            match self.keys.get(key) {
                Some(s) if s.present && s.last == want => {}
                Some(s) if s.present => out.push(format!(
                    "key {key}: last event is {}, etcd has {want}",
                    s.last
                )),
                Some(s) => out.push(format!(
                    "key {key}: last event is a delete of {}, etcd has {want}",
                    s.last
                )),
                None => out.push(format!("key {key}: no event, etcd has {want}")),
            }
        }
        for (key, s) in &self.keys {
            if s.present && !etcd.contains_key(key) {
                out.push(format!(
                    "key {key}: last event is {}, etcd has no such key",
                    s.last
                ));
            }
        }
        out.sort();
        out
    }
}

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
    fn liveness_bound(&self) -> Option<Duration> {
        self.inner.liveness_bound()
    }
    fn decode_errors(&self) -> u64 {
        self.inner.decode_errors()
    }
    fn freshness(
        &self,
        since: i64,
        cached: usize,
        at: Option<i64>,
    ) -> BoxFuture<'_, LwResult<Freshness>> {
        self.inner.freshness(since, cached, at)
    }
}

// ---------------------------------------------------------------------------------------------
// The driver

/// A 3-member etcd cluster, an informer over [`ChaosConfig::prefix`], the seeded schedule, and
/// the history checker; see the [module docs](self). Dropping it stops the informer and the
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
        let violations = chaos.check_history(&etcd).await;
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
        let violations = self.check_history(&etcd).await;
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

    fn key(&mut self) -> String {
        let i = self.rng.usize(0..self.config.keys.max(1));
        format!("ns{}/k{i:02}", i % 3)
    }

    fn value(&mut self) -> String {
        self.values += 1;
        format!("e{}-r{}-w{}", self.epoch, self.round, self.values)
    }

    /// A key believed present, else any key.
    fn present_key(&mut self, except: &[String]) -> String {
        let candidates: Vec<&String> = self
            .present
            .iter()
            .filter(|k| !except.contains(k))
            .collect();
        if candidates.is_empty() {
            return self.key();
        }
        candidates[self.rng.usize(0..candidates.len())].clone()
    }

    /// The next operation: half puts, a quarter deletes, a quarter transactions (only puts and
    /// transactions with `creating`).
    fn next_op(&mut self, creating: bool) -> Op {
        let roll = self.rng.u8(0..100);
        if roll < 50 || (creating && roll < 75) {
            let key = self.key();
            let value = self.value();
            Op::Put { key, value }
        } else if roll < 75 {
            let key = self.present_key(&[]);
            Op::Delete { key }
        } else {
            let n = self.rng.usize(2..=4);
            let mut keys: Vec<String> = Vec::with_capacity(n);
            while keys.len() < n.min(self.config.keys.saturating_sub(1)).max(1) {
                let key = self.key();
                if !keys.contains(&key) {
                    keys.push(key);
                }
            }
            let delete = self.present_key(&keys);
            if keys.contains(&delete) {
                // Too few keys for a distinct delete: a plain put instead.
                let value = self.value();
                return Op::Put {
                    key: keys.swap_remove(0),
                    value,
                };
            }
            let puts = keys.into_iter().map(|k| (k, self.value())).collect();
            Op::Txn { puts, delete }
        }
    }

    /// Applies `op` through one of `writers`, retrying across them for up to
    /// [`WRITE_DEADLINE`]. Returns whether etcd confirmed it.
    async fn apply(&mut self, op: &Op, writers: &[usize]) -> bool {
        let prefix = self.config.prefix.clone();
        let deadline = Instant::now() + WRITE_DEADLINE;
        let mut attempt = self.rng.usize(0..writers.len());
        loop {
            let mut kv = self.clients[writers[attempt % writers.len()]].kv_client();
            let result = match op {
                Op::Put { key, value } => kv
                    .put(format!("{prefix}{key}"), value.as_str(), None)
                    .await
                    .map(drop),
                Op::Delete { key } => kv.delete(format!("{prefix}{key}"), None).await.map(drop),
                Op::Txn { puts, delete } => {
                    let mut ops: Vec<TxnOp> = puts
                        .iter()
                        .map(|(k, v)| TxnOp::put(format!("{prefix}{k}"), v.as_str(), None))
                        .collect();
                    ops.push(TxnOp::delete(format!("{prefix}{delete}"), None));
                    kv.txn(Txn::new().and_then(ops)).await.map(drop)
                }
            };
            match result {
                Ok(()) => break,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!(error = %e, "chaos write failed; retrying");
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => {
                    tracing::warn!(error = %e, ?op, "chaos write given up");
                    self.writes.1 += 1;
                    return false;
                }
            }
        }
        self.writes.0 += 1;
        match op {
            Op::Put { key, .. } => {
                self.present.insert(key.clone());
            }
            Op::Delete { key } => {
                self.present.remove(key);
            }
            Op::Txn { puts, delete } => {
                self.present.remove(delete);
                self.present.extend(puts.iter().map(|(k, _)| k.clone()));
            }
        }
        true
    }

    /// `n` operations of the schedule, one after the other.
    async fn write_ops(&mut self, n: usize, writers: &[usize], creating: bool) {
        for _ in 0..n {
            let op = self.next_op(creating);
            self.apply(&op, writers).await;
        }
    }

    /// Operations of the schedule, 20-100 ms apart, for `window`.
    async fn write_for(&mut self, window: Duration, writers: &[usize]) {
        let start = Instant::now();
        while start.elapsed() < window {
            let op = self.next_op(false);
            self.apply(&op, writers).await;
            let pace = Duration::from_millis(self.rng.u64(20..100));
            tokio::time::sleep(pace.min(window.saturating_sub(start.elapsed()))).await;
        }
    }

    /// Deletes one to three keys believed present, so that the fault always hides deletes.
    async fn delete_some(&mut self, writers: &[usize]) {
        for _ in 0..self.rng.usize(1..=3) {
            if self.present.is_empty() {
                break;
            }
            let key = self.present_key(&[]);
            self.apply(&Op::Delete { key }, writers).await;
        }
    }

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

    /// Compacts etcd to its current revision through one of `writers`.
    async fn compact(&mut self, writers: &[usize], fault: Fault) -> Result<(), ChaosError> {
        let revision = self.etcd_revision(writers, fault).await?;
        let deadline = Instant::now() + WRITE_DEADLINE;
        let mut last_error = String::new();
        for attempt in 0.. {
            let mut kv = self.clients[writers[attempt % writers.len()]].kv_client();
            match kv.compact(revision, None).await {
                Ok(_) => {
                    tracing::debug!(revision, "compacted");
                    return Ok(());
                }
                // Already compacted there (no write since the last compaction): as good.
                Err(e) if e.to_string().contains("compacted") => return Ok(()),
                Err(e) => last_error = e.to_string(),
            }
            if Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(self.etcd_error(
            &fault.to_string(),
            format!("compacting to revision {revision}: {last_error}"),
        ))
    }

    /// Waits until member `t` has applied every write (its serializable revision is the
    /// cluster's), then for etcd's backend to commit (every 100 ms), so that a SIGKILL cannot
    /// land inside an apply; see `kill_corrupts`.
    async fn quiesce(&self, t: usize, writers: &[usize], fault: Fault) -> Result<(), ChaosError> {
        let cluster = self.etcd_revision(writers, fault).await?;
        let deadline = Instant::now() + WRITE_DEADLINE;
        loop {
            let options = GetOptions::new().with_serializable().with_count_only();
            let mut kv = self.clients[t].kv_client();
            let applied = kv
                .get(self.config.prefix.as_str(), Some(options))
                .await
                .map_or(0, |r| r.header().map_or(0, |h| h.revision()));
            if applied >= cluster {
                break;
            }
            if Instant::now() >= deadline {
                return Err(self.etcd_error(
                    &fault.to_string(),
                    format!(
                        "member {t} did not apply revision {cluster} within {WRITE_DEADLINE:?}"
                    ),
                ));
            }
            tokio::time::sleep(POLL).await;
        }
        // The backend's commit cannot be observed; its interval is 100 ms.
        tokio::time::sleep(Duration::from_millis(300)).await;
        Ok(())
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
    /// to receive everything the cache applied (its last events must equal `etcd`).
    async fn check_history(&mut self, etcd: &State) -> Vec<String> {
        let deadline = Instant::now() + DRAIN;
        let mut violations = Vec::new();
        loop {
            violations.extend(self.checker.advance(&self.history));
            let mismatches = self.checker.final_mismatches(etcd);
            if mismatches.is_empty() {
                return violations;
            }
            if Instant::now() >= deadline {
                violations.extend(
                    mismatches
                        .into_iter()
                        .map(|m| format!("{m} ({DRAIN:?} after the cache converged)")),
                );
                return violations;
            }
            tokio::time::sleep(POLL).await;
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

/// One line per key whose `(mod_revision, value)` differs between the cache and etcd.
fn diff(cache: &State, etcd: &State) -> String {
    let show = |s: Option<&(i64, String)>| {
        s.map_or_else(|| "absent".to_string(), |(r, v)| format!("{v}@{r}"))
    };
    let keys: BTreeSet<&String> = cache.keys().chain(etcd.keys()).collect();
    let lines: Vec<String> = keys
        .into_iter()
        .filter(|k| cache.get(*k) != etcd.get(*k))
        .map(|k| format!("  {k}: {} / {}", show(cache.get(k)), show(etcd.get(k))))
        .collect();
    if lines.is_empty() {
        "  (none at the last read)".into()
    } else {
        lines.join("\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(revision: i64, value: &str) -> Seen {
        Seen {
            revision,
            value: value.into(),
        }
    }

    fn event(key: &str, kind: Kind, lists: usize) -> Recorded {
        Recorded {
            key: key.into(),
            kind,
            lists,
        }
    }

    fn check(events: Vec<Recorded>) -> Vec<String> {
        let history = History::new(Mutex::new(events));
        Checker::default().advance(&history)
    }

    #[test]
    fn a_sound_history_passes_and_is_checked_once() {
        let history = History::new(Mutex::new(vec![
            event("a", Kind::Add(seen(2, "e0-1")), 1),
            event(
                "a",
                Kind::Update {
                    old: seen(2, "e0-1"),
                    new: seen(5, "e0-2"),
                },
                1,
            ),
            event(
                "a",
                Kind::Delete {
                    last: seen(5, "e0-2"),
                    tombstone: false,
                },
                1,
            ),
            event("a", Kind::Add(seen(7, "e0-3")), 1),
            event("b", Kind::Add(seen(8, "e0-4")), 1),
            event(
                "b",
                Kind::Delete {
                    last: seen(8, "e0-4"),
                    tombstone: true,
                },
                2,
            ),
        ]));
        let mut checker = Checker::default();
        assert_eq!(checker.advance(&history), Vec::<String>::new());
        assert_eq!(checker.advance(&history), Vec::<String>::new());
        let etcd: State = [("a".to_string(), (7, "e0-3".to_string()))].into();
        assert_eq!(checker.final_mismatches(&etcd), Vec::<String>::new());
    }

    #[test]
    fn duplicates_and_reordering_are_caught() {
        let dup = check(vec![
            event("a", Kind::Add(seen(2, "e0-1")), 1),
            event(
                "a",
                Kind::Update {
                    old: seen(2, "e0-1"),
                    new: seen(2, "e0-1"),
                },
                1,
            ),
        ]);
        assert!(dup[0].contains("not newer"), "{dup:?}");
        let twice = check(vec![
            event("a", Kind::Add(seen(2, "e0-1")), 1),
            event("a", Kind::Add(seen(3, "e0-2")), 1),
        ]);
        assert!(twice[0].contains("added while present"), "{twice:?}");
        let stale_old = check(vec![
            event("a", Kind::Add(seen(2, "e0-1")), 1),
            event(
                "a",
                Kind::Update {
                    old: seen(1, "e0-0"),
                    new: seen(4, "e0-2"),
                },
                1,
            ),
        ]);
        assert!(stale_old[0].contains("old object"), "{stale_old:?}");
    }

    #[test]
    fn deletes_must_carry_the_last_object_and_tombstones_need_a_relist() {
        let wrong = check(vec![
            event("a", Kind::Add(seen(2, "e0-1")), 1),
            event(
                "a",
                Kind::Delete {
                    last: seen(1, "e0-0"),
                    tombstone: false,
                },
                1,
            ),
        ]);
        assert!(wrong[0].contains("another object"), "{wrong:?}");
        let early = check(vec![
            event("a", Kind::Add(seen(2, "e0-1")), 1),
            event(
                "a",
                Kind::Delete {
                    last: seen(2, "e0-1"),
                    tombstone: true,
                },
                1,
            ),
        ]);
        assert!(early[0].contains("before any relist"), "{early:?}");
        let absent = check(vec![event(
            "a",
            Kind::Delete {
                last: seen(2, "e0-1"),
                tombstone: false,
            },
            1,
        )]);
        assert!(absent[0].contains("deleted while absent"), "{absent:?}");
    }

    #[test]
    fn a_wipe_starts_revisions_over_in_a_new_epoch() {
        let tombstone = |r, v: &str| {
            event(
                "a",
                Kind::Delete {
                    last: seen(r, v),
                    tombstone: true,
                },
                2,
            )
        };
        let ok = check(vec![
            event("a", Kind::Add(seen(50, "e0-1")), 1),
            tombstone(50, "e0-1"),
            event("a", Kind::Add(seen(3, "e1-2")), 2),
        ]);
        assert_eq!(ok, Vec::<String>::new());
        let same_epoch = check(vec![
            event("a", Kind::Add(seen(50, "e0-1")), 1),
            tombstone(50, "e0-1"),
            event("a", Kind::Add(seen(3, "e0-2")), 2),
        ]);
        assert!(same_epoch[0].contains("not newer"), "{same_epoch:?}");
    }

    #[test]
    fn final_state_must_be_etcds() {
        let history = History::new(Mutex::new(vec![
            event("a", Kind::Add(seen(2, "e0-1")), 1),
            event("b", Kind::Add(seen(3, "e0-2")), 1),
        ]));
        let mut checker = Checker::default();
        checker.advance(&history);
        let etcd: State = [
            ("b".to_string(), (4, "e0-3".to_string())),
            ("c".to_string(), (5, "e0-4".to_string())),
        ]
        .into();
        let m = checker.final_mismatches(&etcd);
        assert_eq!(m.len(), 3, "{m:?}");
        assert!(m[0].starts_with("key a: last event is e0-1@2, etcd has no such key"));
        assert!(m[1].starts_with("key b: last event is e0-2@3, etcd has e0-3@4"));
        assert!(m[2].starts_with("key c: no event"));
    }

    #[test]
    fn schedules_are_seeded_and_cover_every_fault() {
        let s = fault_schedule(3, 2, Endpoints::All);
        assert_eq!(s, fault_schedule(3, 2, Endpoints::All));
        assert!(!fault_schedule(3, 2, Endpoints::One).contains(&Fault::HungMember));
        assert_eq!(s.len(), 10);
        for f in Fault::ALL {
            assert_eq!(s.iter().filter(|x| **x == f).count(), 2);
        }
        assert_eq!(epoch_of("e12-r3-w4"), 12);
        assert!(kills_corrupt("3.5.1") && !kills_corrupt("3.5.3") && !kills_corrupt("3.4.23"));
    }
}
