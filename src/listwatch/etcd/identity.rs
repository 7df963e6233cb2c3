//! Store identity: noticing that the etcd answering now is not the store the cache was
//! filled from (cluster id, raft term, and the tally of keys at the watched revision).

use std::sync::Mutex;
use std::time::Duration;

use etcd_client::{Client, GetOptions};

use super::request::read;
use crate::listwatch::hedged::Hedged;
use crate::sync::lock;

/// Who answered: the identity of the etcd store, from response headers.
///
/// A store wiped or restored from a backup is recognised by any of: its cluster id changed (a
/// cluster recreated with another `--initial-cluster-token` or other peer URLs), its raft term
/// went down (confirmed by a linearizable read, since a member that was down may lag behind its
/// cluster's term), its revision went below the one watched, or it counts another number of
/// keys under the prefix at the watched revision than the watch did ([`Tally`]). No signal
/// catches a store recreated with the same token and peer URLs, whose term has come back up
/// to the old one, whose revision has passed the watched one before the informer reconnects,
/// and which happens to hold as many keys under the prefix at that revision: its keys stay
/// cached until they change or a relist (compaction) happens. The member id is not
/// compared: it changes whenever another member of the same store answers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Identity {
    pub(crate) cluster_id: u64,
    pub(crate) raft_term: u64,
}

/// The number of keys under the prefix at a revision, as the list and the watched events
/// since it say. When a watch is opened again from that revision, etcd's count there must
/// agree: a store wiped and written past the old revision before the informer reconnects
/// (same cluster id, no lower revision to show it) almost never holds the same number of keys
/// at that revision.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Tally {
    pub(super) revision: i64,
    pub(super) keys: i64,
}

/// Whether `seen` is another store than the one recorded: another cluster id, or a raft term
/// below the highest seen that a linearizable read confirms. Records the highest term.
pub(super) async fn store_changed(
    client: &Client,
    identity: &Mutex<Identity>,
    seen: Identity,
    range: &(Vec<u8>, Vec<u8>),
    timeout: Duration,
) -> Option<String> {
    let known = *lock(identity);
    if known.cluster_id == 0 || seen.cluster_id == 0 {
        let mut identity = lock(identity);
        identity.cluster_id = identity.cluster_id.max(seen.cluster_id);
        identity.raft_term = identity.raft_term.max(seen.raft_term);
        return None;
    }
    if seen.cluster_id != known.cluster_id {
        return Some(format!(
            "etcd's cluster id changed from {:x} to {:x}: the store was replaced",
            known.cluster_id, seen.cluster_id
        ));
    }
    if seen.raft_term < known.raft_term {
        // A member that was down may not know its cluster's term yet; a linearizable read is
        // answered only once it does.
        let options = GetOptions::new()
            .with_range(range.1.clone())
            .with_count_only();
        // Bounded: this runs on the watch's task, which must not hang with a member that
        // stopped answering. Unconfirmed, the store is not replaced.
        let term = match read(client, &range.0, options, timeout).await {
            Hedged::Answered(r) => r.header().map(|h| h.raft_term()),
            _ => None,
        };
        if term.is_some_and(|t| t < known.raft_term) {
            return Some(format!(
                "etcd's raft term went back from {} to {}: the store was wiped or restored",
                known.raft_term,
                term.unwrap_or(0)
            ));
        }
        return None;
    }
    lock(identity).raft_term = seen.raft_term;
    None
}
