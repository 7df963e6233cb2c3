//! The response header of answers from the cache: the identity (cluster id, raft term) of the
//! store the cache holds, so that a client's identity checks see the upstream etcd and notice
//! when it is replaced, the upstream's member id, and the cache's revision.
//!
//! The identity is the one the caches' sources recorded when they listed the store they hold,
//! taken at the moment a cache takes that store's content: an answer never names a wiped
//! store's successor with the old store's keys, nor the old store with the new keys (a client
//! would take either for a second replacement). The upstream's status, asked every few seconds,
//! can only raise the term of the store held (a leader elected since), and only when asked
//! after the caches took that store.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::proto::PbResponseHeader;
use etcd_client::Client;

use crate::listwatch::etcd::Identity;
use crate::sync::lock;

/// What the upstream's Status last said, and when it was asked.
#[derive(Clone, Copy, Default)]
struct Status {
    header: PbResponseHeader,
    asked: Option<Instant>,
}

/// The store the caches hold, and when a cache took it.
#[derive(Clone, Copy)]
struct Held {
    identity: Identity,
    taken: Instant,
}

/// The upstream's identity as last seen, shared by the services.
#[derive(Clone, Default)]
pub(crate) struct Headers {
    seen: Arc<Mutex<Status>>,
    held: Arc<Mutex<Option<Held>>>,
    /// The upstream's etcd version, `(major, minor, patch)` (`None` until heard).
    version: Arc<Mutex<Option<(u32, u32, u32)>>>,
    /// The upstream has named no leader for [`NO_LEADER_AFTER`] or longer: the server is then
    /// as a member cut off from its cluster, and refuses what asks for a leader.
    no_leader: Arc<tokio::sync::watch::Sender<bool>>,
    /// Since when the upstream's answers have named no leader.
    leaderless_since: Arc<Mutex<Option<Instant>>>,
    /// How many times a cache replaced its content wholesale (a wiped or restored store, or an
    /// event its watch lost): a revision answered before names what was replaced.
    generation: Arc<AtomicU64>,
}

/// How long the upstream must name no leader before the server gives up on what asks for one:
/// etcd ends such streams after three election timeouts in a row without a leader
/// (`monitorLeader`, 1 s each by default), so an ordinary election never ends them. A Status
/// that goes unanswered says nothing of the leader (etcd's own member, paused or cut off,
/// ends nothing either).
const NO_LEADER_AFTER: Duration = Duration::from_secs(3);

/// Whether etcd `version` refuses a watch in the plain form (the id asked for, "permission
/// denied" whatever the reason): 3.4.0-3.4.21 and 3.5.0-3.5.5. Later releases (etcd PRs 14296
/// and 14322, in 3.4.22 and 3.5.6) answer id -1 with the reason: an invalid token, an empty
/// user name, an old auth revision, or permission denied. An unknown version is taken for a
/// current one.
fn plain_watch_refusals(version: Option<(u32, u32, u32)>) -> bool {
    match version {
        Some((3, 4, patch)) => patch <= 21,
        Some((3, 5, patch)) => patch <= 5,
        Some((3, minor, _)) => minor < 4,
        Some((major, _, _)) => major < 3,
        None => false,
    }
}

impl Headers {
    /// A header naming the upstream, at `revision`.
    pub(crate) fn header(&self, revision: i64) -> PbResponseHeader {
        let status = *lock(&self.seen);
        let mut header = status.header;
        if let Some(held) = *lock(&self.held) {
            header.cluster_id = held.identity.cluster_id;
            let same_store = status.asked.is_some_and(|asked| asked > held.taken)
                && status.header.cluster_id == held.identity.cluster_id;
            header.raft_term = if same_store {
                held.identity.raft_term.max(status.header.raft_term)
            } else {
                held.identity.raft_term
            };
        }
        header.revision = revision;
        header
    }

    /// See [`replaced`](Self::replaced): the revisions answered since belong together.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// A cache replaced its content wholesale: revisions answered before belong to another
    /// store, or to content that was wrong, and promise nothing of what is held now.
    pub(crate) fn replaced(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    /// Whether the upstream was heard from.
    pub(crate) fn known(&self) -> bool {
        lock(&self.seen).header.cluster_id != 0
    }

    /// A cache took the content of the store `identity` names (a first list, or a store
    /// replaced): answers name it from now on, whatever the one held before.
    pub(crate) fn take(&self, identity: Identity) {
        if identity.cluster_id == 0 {
            return;
        }
        *lock(&self.held) = Some(Held {
            identity,
            taken: Instant::now(),
        });
    }

    /// A linearizable read asked of the upstream at `asked` (a consistent-read proof) was
    /// answered by `cluster_id` at `raft_term`: the cluster's term now. Answers of the store
    /// held carry at least it from now on, so that a client moving between servers in front of
    /// one store never sees its term go back (which a client takes for a restored store), even
    /// before this server's next Status.
    pub(crate) fn proven(&self, cluster_id: u64, raft_term: u64, asked: Instant) {
        let mut seen = lock(&self.seen);
        if seen.header.cluster_id == cluster_id && raft_term > seen.header.raft_term {
            seen.header.raft_term = raft_term;
            seen.asked = seen.asked.max(Some(asked));
        }
    }

    /// A cache took more of the store it holds, whose source now records `identity`: its term
    /// may have risen (a leader elected since), never fallen.
    pub(crate) fn follow(&self, identity: Identity) {
        let mut held = lock(&self.held);
        match held.as_mut() {
            Some(held) if held.identity.cluster_id == identity.cluster_id => {
                held.identity.raft_term = held.identity.raft_term.max(identity.raft_term);
            }
            Some(_) => {}
            None => {
                drop(held);
                self.take(identity);
            }
        }
    }

    /// Whether the upstream refuses a watch in the plain form: every refusal as "permission
    /// denied", under the watch id asked for. See [`plain_watch_refusals`].
    pub(crate) fn plain_watch_refusals(&self) -> bool {
        plain_watch_refusals(*lock(&self.version))
    }

    /// Whether the upstream answers a progress request only once the stream's watches are
    /// synced (3.4.25+, 3.5.8+): then its answer promises every event up to it was sent.
    /// Before, it answered at once, ahead of a watch still catching up. Not assumed.
    pub(crate) fn synced_progress(&self) -> bool {
        lock(&self.version).is_some_and(|v| match (v.0, v.1) {
            (3, 4) => v >= (3, 4, 25),
            (3, 5) => v >= (3, 5, 8),
            _ => v >= (3, 6, 0),
        })
    }

    /// Whether the upstream has named no leader for [`NO_LEADER_AFTER`] or longer.
    pub(crate) fn no_leader(&self) -> bool {
        *self.no_leader.borrow()
    }

    /// Follows [`no_leader`](Self::no_leader).
    pub(crate) fn watch_leader(&self) -> tokio::sync::watch::Receiver<bool> {
        self.no_leader.subscribe()
    }

    /// Records what a Status said of the leader: a leader ends a leaderless spell at once; no
    /// leader counts once it has lasted [`NO_LEADER_AFTER`].
    fn leader_named(&self, has_leader: bool) {
        let given_up = {
            let mut since = lock(&self.leaderless_since);
            if has_leader {
                *since = None;
                false
            } else {
                since.get_or_insert_with(Instant::now).elapsed() >= NO_LEADER_AFTER
            }
        };
        if has_leader || given_up {
            self.leader_known(has_leader);
        }
    }

    fn leader_known(&self, has_leader: bool) {
        self.no_leader.send_if_modified(|no_leader| {
            let changed = *no_leader == has_leader;
            *no_leader = !has_leader;
            changed
        });
    }

    /// Asks the upstream's status once.
    pub(crate) async fn refresh(&self, client: &Client) -> Result<(), etcd_client::Error> {
        let mut maintenance = client.maintenance_client();
        let asked = Instant::now();
        // A hung upstream must not stop the refreshes for good.
        let status = tokio::time::timeout(Duration::from_secs(5), maintenance.status())
            .await
            .map_err(|_| {
                etcd_client::Error::WatchError("no answer to Status within 5 s".into())
            })??;
        self.leader_named(status.leader() != 0);
        let mut numbers = status.version().split('.').map(|n| n.parse::<u32>().ok());
        if let (Some(Some(major)), Some(Some(minor))) = (numbers.next(), numbers.next()) {
            let patch = numbers.next().flatten().unwrap_or(0);
            *lock(&self.version) = Some((major, minor, patch));
        }
        if let Some(h) = status.header() {
            let mut seen = lock(&self.seen);
            if seen.header.cluster_id != h.cluster_id() || seen.header.raft_term != h.raft_term() {
                tracing::info!(
                    cluster_id = h.cluster_id(),
                    member_id = h.member_id(),
                    raft_term = h.raft_term(),
                    "upstream identity"
                );
            }
            *seen = Status {
                header: PbResponseHeader {
                    cluster_id: h.cluster_id(),
                    member_id: h.member_id(),
                    revision: 0,
                    raft_term: h.raft_term(),
                },
                asked: Some(asked),
            };
        }
        Ok(())
    }

    /// Refreshes every `period` for as long as it runs.
    pub(crate) async fn keep_fresh(self, client: Client, period: Duration) {
        loop {
            if let Err(e) = self.refresh(&client).await {
                tracing::warn!(error = %e, "cannot read the upstream's status");
                // A member that answers "no leader" names none; a Status that goes unanswered
                // says nothing of the leader, and what was known stands (see NO_LEADER_AFTER).
                let named_none = matches!(&e, etcd_client::Error::GRpcStatus(s)
                    if s.message() == "etcdserver: no leader");
                if named_none {
                    self.leader_named(false);
                }
            }
            tokio::time::sleep(period).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_forms_follow_etcd_releases() {
        let plain = |v| plain_watch_refusals(Some(v));
        assert!(plain((3, 4, 0)) && plain((3, 4, 21)) && plain((3, 5, 0)) && plain((3, 5, 5)));
        assert!(!plain((3, 4, 22)) && !plain((3, 4, 23)) && !plain((3, 5, 6)));
        assert!(!plain((3, 6, 0)) && !plain((4, 0, 0)) && !plain_watch_refusals(None));
    }

    #[test]
    fn progress_answers_wait_for_synced_watches_from_3_4_25_and_3_5_8() {
        let synced = |v| {
            let headers = Headers::default();
            *lock(&headers.version) = v;
            headers.synced_progress()
        };
        assert!(!synced(None) && !synced(Some((3, 4, 24))) && !synced(Some((3, 5, 7))));
        assert!(synced(Some((3, 4, 25))) && synced(Some((3, 5, 8))) && synced(Some((3, 6, 0))));
    }
}
