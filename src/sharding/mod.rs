//! Sharded controllers: N replicas of one [`Runner`] share the keys of its informers, each key
//! reconciled by exactly one replica at a time, over etcd leases and transactions only.
//!
//! - **Membership.** Each replica holds a lease and a key `P/members/NAME` with it, and watches
//!   the records under `P` with an informer of its own.
//! - **Assignment.** Keys map to a fixed number of shards (default 64) by a stable hash of the
//!   whole key, or of what [`ShardedRunner::shard_by`] picks (the namespace, say). Shards map to
//!   live members by rendezvous hashing: a member joining or leaving moves about 1/N of them.
//! - **Ownership.** A shard is reconciled only by the holder of its owner record
//!   `P/shards/NNNN`, created only if absent and attached to the holder's lease. A replica told
//!   to give a shard up stops starting reconciles in it, waits until those in flight have ended,
//!   then deletes the record; only then can the new owner create it. A crashed replica's records
//!   vanish with its lease, after its TTL.
//! - **Liveness.** A replica that cannot prove its lease alive for `ttl * 2 / 3` (partitioned,
//!   paused) drops all its shards and abandons its reconciles at once, at least `ttl / 3` before
//!   etcd can expire the lease and let another replica take over; it then joins again with a
//!   new lease.
//! - **Fencing.** Each reconcile gets its shard's [`Fence`]
//!   ([`Context::fence`]): writes made with
//!   [`TypedClient::fenced`](crate::client::TypedClient::fenced) succeed only while the owner
//!   record is the one the shard was acquired with.
//!
//! # Guarantees
//!
//! With fenced writes: no write made for a shard lands after its owner record is gone, whatever
//! the clocks, pauses or partitions. Without fencing, no two replicas reconcile one key at once
//! as long as a replica's clock does not run more than a third slower than etcd's over one
//! TTL, and its lease is not revoked by hand (etcd deletes the records at once; the replica
//! hears of it within moments, but a reconcile already running may finish). A process frozen
//! (SIGSTOP, a stalled VM) resumes to find its lease unproven: no reconcile starts then, but
//! one that was already past an `.await` when the process froze can still finish a write it
//! had sent. Fence the writes that matter.
//!
//! On gaining a shard a replica reconciles every key its caches hold in that shard, and none
//! before every informer the runner watches has reached the revision the shard was acquired
//! at: the new owner sees everything the old one wrote. A key changed while its shard could not
//! admit it (being handed over, or the lease unproven) is reconciled by whoever holds the shard
//! next, this replica included if it keeps it. A key deleted while its shard changed hands is
//! not reconciled as deleted by either replica: make the clean-up of deleted keys level-based
//! (e.g. on resync), not only per key.
//!
//! Every replica's informers cache the whole prefix (reads stay local), so memory is that of
//! one unsharded replica in each.
//!
//! ```no_run
//! # async fn demo(jobs: etcd_informer::SharedIndexInformer<String>) -> Result<(), Box<dyn std::error::Error>> {
//! use etcd_informer::runner::{Action, Context, Runner};
//! use etcd_informer::sharding::ShardedRunner;
//! let client = etcd_informer::connect(["127.0.0.1:2379"]).await?;
//! let runner = Runner::new("jobs").watch(&jobs).workers(4);
//! let sharded = ShardedRunner::new(runner, client, "replica-1");
//! let reconcile = |ctx: Context| async move {
//!     println!("{} is mine (fence {:?})", ctx.key(), ctx.fence());
//!     Ok::<_, String>(Action::Done)
//! };
//! sharded.run_with_context(reconcile, async { let _ = tokio::signal::ctrl_c().await; }).await;
//! # Ok(()) }
//! ```

mod admission;
mod assignment;
mod ownership;
#[cfg(all(test, feature = "testing"))]
mod tests;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::Client;
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::Instrument;

use self::admission::ShardTable;
use self::assignment::{namespace, owner_of, whole_key, ShardBy};
use self::ownership::Records;
use crate::client::Fence;
use crate::codec::TextCodec;
use crate::informer::{AbortOnDrop, ResourceEventHandlerFuncs, SharedIndexInformer};
use crate::lease::KeptLease;
use crate::listwatch::etcd::EtcdListerWatcher;
use crate::metrics::{Handoff, ShardMetrics};
use crate::runner::{by_key, erase, Action, Context, Runner};
use crate::sync::lock;
use crate::workqueue::{Priority, WorkQueue};

/// The number of shards by default: enough for rendezvous hashing to share them within about
/// ±25% among a handful of replicas, few enough that a replica's records stay cheap.
pub const DEFAULT_SHARDS: u32 = 64;

/// How often a replica looks again at its shards when nothing woke it (an acquire that raced
/// with a release, an etcd error).
const RECHECK: Duration = Duration::from_millis(500);

/// How long to retry joining (granting a lease, announcing the member) between attempts.
const JOIN_RETRY: Duration = Duration::from_millis(500);

/// How long a shutting-down replica tries to hand its shards over before it leaves them to
/// expire with its lease.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(10);

/// A [`Runner`] whose keys are shared among replicas; see the [module documentation](self).
///
/// ```no_run
/// # async fn demo(jobs: etcd_informer::SharedIndexInformer<String>) -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use etcd_informer::runner::{Action, Runner};
/// use etcd_informer::sharding::ShardedRunner;
/// let client = etcd_informer::connect(["127.0.0.1:2379"]).await?;
/// // Every replica runs this with its own name; keys of one namespace stay together.
/// let sharded = ShardedRunner::new(Runner::new("jobs").watch(&jobs).workers(4), client, "replica-1")
///     .shard_by_namespace()
///     .lease_ttl(Duration::from_secs(10));
/// let reconcile = |key: String| async move {
///     println!("reconciling {key}");
///     Ok::<_, String>(Action::Done)
/// };
/// sharded.run(reconcile, async { let _ = tokio::signal::ctrl_c().await; }).await;
/// # Ok(()) }
/// ```
pub struct ShardedRunner {
    runner: Runner,
    client: Client,
    member: Arc<str>,
    prefix: Option<String>,
    shards: u32,
    ttl: Duration,
    shard_by: ShardBy,
    status: Arc<Status>,
}

impl fmt::Debug for ShardedRunner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShardedRunner")
            .field("runner", &self.runner)
            .field("member", &self.member)
            .field("shards", &self.shards)
            .field("ttl", &self.ttl)
            .finish()
    }
}

/// What a replica holds, for [`ShardHandle::health`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardHealth {
    /// This replica's member name.
    pub member: String,
    /// The lease it holds its records with, while it holds one.
    pub lease: Option<i64>,
    /// Whether the lease is proven alive (renewed within `ttl * 2 / 3`).
    pub lease_alive: bool,
    /// The shards it holds, including those being handed over.
    pub held: Vec<u32>,
    /// The held shards being handed over (waiting for their reconciles to end).
    pub releasing: Vec<u32>,
    /// The live members it sees, itself included.
    pub members: Vec<String>,
    /// Shards acquired since it started.
    pub acquired: u64,
    /// Shards released since it started.
    pub released: u64,
    /// Times the lease was lost (all shards dropped at once).
    pub leases_lost: u64,
}

/// A handle on a running [`ShardedRunner`]'s state.
#[derive(Clone)]
pub struct ShardHandle(Arc<Status>);

impl fmt::Debug for ShardHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.health().fmt(f)
    }
}

impl ShardHandle {
    /// Whether the replica holds `key`'s shard now (and is not handing it over): whether it
    /// would reconcile the key.
    pub fn holds_key(&self, key: &str) -> bool {
        let table = lock(&self.0.table).clone();
        table.is_some_and(|t| {
            let shard = t.shard_of(key);
            let (held, releasing) = t.held();
            held.contains(&shard) && !releasing.contains(&shard)
        })
    }

    /// What the replica holds now.
    pub fn health(&self) -> ShardHealth {
        let mut health = lock(&self.0.health).clone();
        if let Some(table) = lock(&self.0.table).as_ref() {
            (health.held, health.releasing) = table.held();
        }
        health
    }
}

struct Status {
    health: Mutex<ShardHealth>,
    table: Mutex<Option<Arc<ShardTable>>>,
}

impl ShardedRunner {
    /// Shares `runner`'s keys with the other replicas of the same runner name, as member
    /// `member` (unique among the replicas), with 64 shards, a 5 s lease, and the records under
    /// `/etcd-informer/sharding/RUNNER/`.
    pub fn new(runner: Runner, client: Client, member: impl Into<String>) -> Self {
        let member: Arc<str> = member.into().into();
        ShardedRunner {
            runner,
            client,
            status: Arc::new(Status {
                health: Mutex::new(ShardHealth {
                    member: member.to_string(),
                    ..Default::default()
                }),
                table: Mutex::new(None),
            }),
            member,
            prefix: None,
            shards: DEFAULT_SHARDS,
            ttl: Duration::from_secs(5),
            shard_by: Arc::new(whole_key),
        }
    }

    /// The number of shards (at least 1; default [`DEFAULT_SHARDS`]). Every replica must use
    /// the same.
    #[must_use]
    pub fn shards(mut self, shards: u32) -> Self {
        self.shards = shards.max(1);
        self
    }

    /// The lease TTL (whole seconds, at least 2; default 5 s): how long a crashed replica's
    /// shards wait before others take them over.
    #[must_use]
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Duration::from_secs(ttl.as_secs().max(2));
        self
    }

    /// Where the records live (ends with `/`; default `/etcd-informer/sharding/RUNNER/`).
    #[must_use]
    pub fn records_prefix(mut self, prefix: impl Into<String>) -> Self {
        let mut prefix = prefix.into();
        if !prefix.ends_with('/') {
            prefix.push('/');
        }
        self.prefix = Some(prefix);
        self
    }

    /// Keys whose `shard_by` is equal share a shard (default: the whole key). Every replica
    /// must use the same function.
    #[must_use]
    pub fn shard_by(mut self, shard_by: fn(&str) -> &str) -> Self {
        self.shard_by = Arc::new(shard_by);
        self
    }

    /// Keys of one namespace (`namespace/name`) share a shard.
    #[must_use]
    pub fn shard_by_namespace(mut self) -> Self {
        self.shard_by = Arc::new(namespace);
        self
    }

    /// A handle on this replica's state, for health checks.
    pub fn handle(&self) -> ShardHandle {
        ShardHandle(self.status.clone())
    }

    /// Like [`Runner::run`], for the keys of the shards this replica holds.
    pub async fn run<F, Fut, E>(self, reconcile: F, shutdown: impl Future<Output = ()>)
    where
        F: Fn(String) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        self.run_with_context(by_key(reconcile), shutdown).await
    }

    /// Joins the replicas and reconciles the keys of the shards this replica holds, until
    /// `shutdown` resolves; then hands its shards over (once their reconciles have ended) and
    /// leaves. A lost lease drops every shard and joins again with a new one.
    pub async fn run_with_context<F, Fut, E>(
        mut self,
        reconcile: F,
        shutdown: impl Future<Output = ()>,
    ) where
        F: Fn(Context) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        let prefix = self
            .prefix
            .clone()
            .unwrap_or_else(|| format!("/etcd-informer/sharding/{}/", self.runner.name()));
        let span = tracing::info_span!("sharded_runner", runner = %self.runner.name(), member = %self.member);
        let table = ShardTable::new(self.shards, self.shard_by.clone());
        *lock(&self.status.table) = Some(table.clone());
        let admission = table.clone();
        self.runner.admit = Some(Arc::new(move |key: &str| admission.admit(key)));
        self.runner.renew_queue();
        let coordinator = Coordinator {
            records: Records::new(self.client.clone(), prefix),
            client: self.client.clone(),
            member: self.member.clone(),
            shards: self.shards,
            ttl: self.ttl,
            table,
            queue: self.runner.queue().clone(),
            keys: self.runner.key_source(),
            status: self.status.clone(),
            metrics: Arc::new(ShardMetrics::new(self.runner.name(), &self.member)),
        };
        let stop_runner = Notify::new();
        let runner = &mut self.runner;
        async {
            tokio::join!(
                runner.run_erased(erase(reconcile), stop_runner.notified()),
                async {
                    coordinator.run(shutdown).await;
                    stop_runner.notify_one();
                }
            );
        }
        .instrument(span)
        .await;
        *lock(&self.status.table) = None;
    }
}

/// A lease being joined with: revoked if dropped before [`joined`](Self::joined).
struct Joining(Option<KeptLease>);

impl Joining {
    fn joined(mut self) -> KeptLease {
        self.0.take().expect("a lease until joined")
    }
}

impl Drop for Joining {
    fn drop(&mut self) {
        if let Some(lease) = self.0.take() {
            lease.revoke_in_background();
        }
    }
}

/// Keeps this replica's shards matched to the membership.
struct Coordinator {
    records: Records,
    client: Client,
    member: Arc<str>,
    shards: u32,
    ttl: Duration,
    table: Arc<ShardTable>,
    queue: WorkQueue<String>,
    keys: crate::runner::KeySource,
    status: Arc<Status>,
    metrics: Arc<ShardMetrics>,
}

/// What a replica remembers between converges under one lease.
#[derive(Default)]
struct Round {
    /// When each shard assigned to this member, and not held yet, was first assigned.
    wanted_since: HashMap<u32, Instant>,
    /// Whether the records informer has shown this member's key under this lease.
    seen_self: bool,
    /// Shards whose acquire timed out: maybe created, the answer lost.
    uncertain: BTreeSet<u32>,
}

/// What the records informer shows: the live members and each shard's owner record.
struct View {
    /// Member -> the lease its key is on.
    members: BTreeMap<String, i64>,
    /// Shard -> (owner, the record's mod_revision, its lease).
    owners: HashMap<u32, (String, i64, i64)>,
}

impl Coordinator {
    async fn run(self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        let records = match self.watch_records().await {
            Some(records) => records,
            None => return,
        };
        let (informer, _task, wake) = records;
        let synced = informer.wait_for_cache_sync();
        tokio::select! {
            () = synced => {}
            () = &mut shutdown => return,
        }
        loop {
            let Some(lease) = self.join(&mut shutdown).await else {
                break;
            };
            let mut round = Round::default();
            let why = loop {
                // Raced with the lease: a partition can hang the requests of a converge.
                tokio::select! {
                    biased;
                    why = lease.lost() => break why,
                    gone = self.converge(&informer, &lease, &mut round) => {
                        if let Err(why) = gone {
                            break why;
                        }
                    }
                }
                tokio::select! {
                    biased;
                    why = lease.lost() => break why,
                    () = &mut shutdown => {
                        self.leave(lease).await;
                        informer.stop();
                        return;
                    }
                    () = wake.notified() => {}
                    () = self.table.quiet() => {}
                    () = tokio::time::sleep(RECHECK) => {}
                }
            };
            let dropped = self.table.drop_all();
            self.metrics.handoff(Handoff::Lost, dropped as u64, None);
            self.metrics.held(0);
            {
                let mut health = lock(&self.status.health);
                health.leases_lost += 1;
                health.lease_alive = false;
                health.lease = None;
            }
            tracing::error!(%why, dropped, "lease lost: every shard dropped, reconciles in flight abandoned; joining again");
        }
        informer.stop();
    }

    /// Starts the informer of the records, which wakes the coordinator on every change.
    async fn watch_records(
        &self,
    ) -> Option<(SharedIndexInformer<String>, AbortOnDrop<()>, Arc<Notify>)> {
        let source = match EtcdListerWatcher::new(
            self.client.clone(),
            self.records.prefix().to_owned(),
            TextCodec,
        ) {
            Ok(source) => source,
            Err(e) => {
                tracing::error!(error = %e, "cannot watch the sharding records");
                return None;
            }
        };
        let informer = SharedIndexInformer::new(
            source,
            crate::informer::InformerOptions::default()
                .with_name(format!("{}sharding", self.records.prefix())),
        );
        let wake = Arc::new(Notify::new());
        let (w1, w2, w3) = (wake.clone(), wake.clone(), wake.clone());
        let handler = ResourceEventHandlerFuncs::new()
            .on_add(move |_, _| w1.notify_one())
            .on_update(move |_, _| w2.notify_one())
            .on_delete(move |_| w3.notify_one());
        if let Err(e) = informer.add_event_handler(handler) {
            tracing::error!(error = %e, "cannot watch the sharding records");
            return None;
        }
        let task = AbortOnDrop(tokio::spawn(informer.clone().run()));
        Some((informer, task, wake))
    }

    /// Grants a lease and announces this member, retrying until it works or `shutdown`. The
    /// lease, once lost, drops every shard at once, from its keeper task: the workers stop
    /// starting reconciles without waiting for the coordinator's turn.
    async fn join(
        &self,
        shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> Option<KeptLease> {
        loop {
            // Shutdown first: a join it cuts short revokes its lease (`Joining`), with the member
            // key if that landed, rather than leave a member nobody is behind for a TTL.
            match tokio::select! {
                biased;
                () = shutdown.as_mut() => return None,
                joined = self.try_join() => joined,
            } {
                Ok(lease) => {
                    tracing::info!(lease = lease.id(), "joined");
                    let mut health = lock(&self.status.health);
                    health.lease = Some(lease.id());
                    health.lease_alive = true;
                    return Some(lease);
                }
                Err(e) => tracing::warn!(error = %e, "cannot join yet; retrying"),
            }
            tokio::select! {
                biased;
                () = shutdown.as_mut() => return None,
                () = tokio::time::sleep(JOIN_RETRY) => {}
            }
        }
    }

    async fn try_join(&self) -> Result<KeptLease, String> {
        let span = tracing::info_span!("shard_lease", member = %self.member);
        let (table, metrics) = (self.table.clone(), self.metrics.clone());
        let on_lost = move |_: &str| {
            let dropped = table.drop_all();
            metrics.handoff(Handoff::Lost, dropped as u64, None);
            metrics.held(0);
        };
        let grant = KeptLease::grant(&self.client, self.ttl, span, on_lost);
        let lease = match tokio::time::timeout(self.ttl, grant).await {
            Ok(Ok(lease)) => lease,
            Ok(Err(e)) => return Err(format!("lease grant: {e}")),
            Err(_) => return Err("lease grant timed out".into()),
        };
        self.table.bind(lease.validity());
        let announce = self.records.join(&self.member, lease.id());
        // Failed, timed out or cancelled, the member key may have landed all the same: it goes
        // with the lease.
        let joining = Joining(Some(lease));
        match tokio::time::timeout(self.ttl, announce).await {
            Ok(Ok(())) => Ok(joining.joined()),
            Ok(Err(e)) => Err(format!("announcing the member: {e}")),
            Err(_) => Err("announcing the member timed out".into()),
        }
    }

    fn view(&self, informer: &SharedIndexInformer<String>) -> View {
        let mut view = View {
            members: BTreeMap::new(),
            owners: HashMap::new(),
        };
        for o in informer.lister().list() {
            if let Some(member) = Records::member_of_record(o.key()) {
                view.members.insert(member.to_owned(), o.lease);
            } else if let Some(shard) = Records::shard_of_record(o.key()) {
                view.owners
                    .insert(shard, (o.value.clone(), o.mod_revision, o.lease));
            }
        }
        view
    }

    /// Acquires the free shards assigned to this member, and hands over those assigned to
    /// another. An error when this member's key is gone: its lease was revoked (etcd deleted
    /// the key and the owner records with it), which the keep-alive would only tell at its
    /// next renewal.
    async fn converge(
        &self,
        informer: &SharedIndexInformer<String>,
        lease: &KeptLease,
        round: &mut Round,
    ) -> Result<(), String> {
        let view = self.view(informer);
        // Only the key on this lease counts: one on an earlier lease may still show, then
        // vanish as that lease expires.
        let present = view.members.get(&*self.member) == Some(&lease.id());
        if round.seen_self && !present {
            return Err(format!(
                "this member's key is gone or on another lease: lease {} was revoked (or another replica uses the name {:?})",
                lease.id(),
                self.member
            ));
        }
        round.seen_self |= present;
        {
            let mut health = lock(&self.status.health);
            health.members = view.members.keys().cloned().collect();
            health.lease_alive = lease.is_alive();
        }
        // Until this member sees itself, it would compute an assignment without itself.
        if !lease.is_alive() || !present {
            return Ok(());
        }
        let members: Vec<&str> = view.members.keys().map(String::as_str).collect();
        let mut acquired = BTreeMap::new();
        for shard in 0..self.shards {
            let mine = owner_of(shard, &members) == Some(&*self.member);
            if self.table.holds(shard) {
                if !mine && self.table.begin_release(shard) {
                    tracing::debug!(shard, "handing over");
                } else if mine && self.table.cancel_release(shard) {
                    tracing::debug!(shard, "assigned back before it was handed over: kept");
                }
                continue;
            }
            // A record on this lease that the table does not hold: from an acquire whose
            // answer was lost, or one this replica released and the view still shows.
            if let Some((_, revision, held_by)) = view.owners.get(&shard) {
                if *held_by == lease.id() {
                    let fence = Fence::new(self.records.shard_key_full(shard), *revision);
                    if mine && round.uncertain.remove(&shard) {
                        self.table.insert(shard, fence);
                        round.wanted_since.remove(&shard);
                        acquired.insert(shard, Duration::ZERO);
                    } else if !mine {
                        // Deleted only if it is still that record: harmless when stale.
                        let release = self.records.release(&fence);
                        let _ = tokio::time::timeout(self.ttl, release).await;
                        round.uncertain.remove(&shard);
                    }
                    continue;
                }
            }
            if !mine {
                round.wanted_since.remove(&shard);
                continue;
            }
            let since = *round.wanted_since.entry(shard).or_insert_with(Instant::now);
            if view.owners.contains_key(&shard) {
                // The owner hands it over when it sees the same membership, or its lease
                // expires (maybe an earlier lease of this member's).
                continue;
            }
            let acquire = self.records.acquire(shard, &self.member, lease.id());
            let fence = match tokio::time::timeout(self.ttl, acquire).await {
                Ok(Ok(Some(fence))) => fence,
                Ok(Ok(None)) => continue, // the view was behind: someone owns it
                failed => {
                    // The record may have been created all the same: the view will show it.
                    round.uncertain.insert(shard);
                    match failed {
                        Ok(Err(e)) => tracing::warn!(shard, error = %e, "cannot acquire shard"),
                        _ => tracing::warn!(shard, "acquiring a shard timed out"),
                    }
                    break;
                }
            };
            self.table.insert(shard, fence);
            round.wanted_since.remove(&shard);
            round.uncertain.remove(&shard);
            acquired.insert(shard, since.elapsed());
        }
        if !acquired.is_empty() {
            // Every key of the new shards, from the caches (changes made before this replica
            // held them were dropped by its workers), behind live changes like a list's.
            let mut queued = 0usize;
            self.keys.for_each_key(&mut |key| {
                if acquired.contains_key(&self.table.shard_of(&key)) {
                    self.queue.add_with_priority(key, Priority::Background);
                    queued += 1;
                }
            });
            for took in acquired.values() {
                self.metrics.handoff(Handoff::Acquired, 1, Some(*took));
            }
            lock(&self.status.health).acquired += acquired.len() as u64;
            tracing::info!(shards = ?acquired.keys().collect::<Vec<_>>(), queued, "acquired shards");
        }
        // Keys refused in a shard kept after all (its handover called off, its lease proven
        // again by a late renewal): nobody else will reconcile them.
        let refused = self.table.readmit();
        if !refused.is_empty() {
            tracing::info!(
                keys = refused.len(),
                "reconciling keys refused while their shard could not admit them"
            );
            refused.into_iter().for_each(|key| self.queue.add(key));
        }
        self.hand_over().await;
        self.metrics.held(self.table.held().0.len());
        Ok(())
    }

    /// Deletes the owner records of the releasing shards whose reconciles have ended.
    async fn hand_over(&self) {
        let mut released = Vec::new();
        for (shard, fence, since) in self.table.released() {
            match tokio::time::timeout(self.ttl, self.records.release(&fence)).await {
                Err(_) => {
                    tracing::warn!(shard, "releasing a shard timed out; retrying");
                    break;
                }
                Ok(Ok(_)) => {
                    self.table.remove(shard);
                    self.metrics
                        .handoff(Handoff::Released, 1, Some(since.elapsed()));
                    released.push(shard);
                }
                Ok(Err(e)) => {
                    tracing::warn!(shard, error = %e, "cannot release shard; retrying");
                    break;
                }
            }
        }
        if !released.is_empty() {
            lock(&self.status.health).released += released.len() as u64;
            tracing::info!(shards = ?released, "handed shards over");
        }
    }

    /// Hands every shard over once its reconciles have ended, then revokes the lease (which
    /// deletes the membership key and any record left). Gives up at [`RELEASE_TIMEOUT`], and at
    /// once if the lease is lost meanwhile: reconciles still running are then abandoned before
    /// anyone else can take their shards.
    async fn leave(&self, lease: KeptLease) {
        for shard in self.table.held().0 {
            self.table.begin_release(shard);
        }
        let deadline = Instant::now() + RELEASE_TIMEOUT;
        let handed_over = async {
            while !self.table.held().0.is_empty() {
                self.hand_over().await;
                if self.table.held().0.is_empty() {
                    break;
                }
                let _ = tokio::time::timeout(RECHECK, self.table.quiet()).await;
            }
        };
        tokio::select! {
            biased;
            why = lease.lost() => tracing::warn!(%why, "lease lost while handing shards over"),
            _ = tokio::time::timeout_at(deadline, handed_over) => {}
        }
        self.table.drop_all();
        match tokio::time::timeout(self.ttl, lease.revoke()).await {
            Ok(Ok(())) => {}
            _ => tracing::warn!("cannot revoke the lease; it expires after its TTL"),
        }
        self.metrics.held(0);
        let mut health = lock(&self.status.health);
        health.lease = None;
        health.lease_alive = false;
        tracing::info!("left");
    }
}
