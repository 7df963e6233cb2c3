//! The shards this replica holds, as its workers see them: a reconcile starts only in a shard
//! that is held and not being handed over, and is counted until it ends, so that a shard is
//! released only once its reconciles have ended.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use super::assignment::{shard_of, ShardBy};
use crate::client::Fence;
use crate::lease::Validity;
use crate::runner::Admitted;
use crate::sync::lock;

/// One held shard.
#[derive(Debug)]
struct Held {
    /// Tells this holding from an earlier one of the same shard.
    id: u64,
    /// The owner record's key and `mod_revision`: the shard's fence.
    fence: Fence,
    /// Being handed over: no reconcile starts in it any more.
    releasing: Option<Instant>,
    in_flight: usize,
    /// Keys refused while the shard was held but could not admit them (releasing, or the
    /// lease unproven): nobody else reconciles them if this replica keeps the shard.
    refused: BTreeSet<String>,
}

/// The shards held and their reconciles in flight.
///
/// Invariant: a reconcile runs only under an [`Admitted`] taken while its shard was held and
/// not releasing, and is counted in `in_flight` until it ends; [`ShardTable::released`] hands
/// a shard back only when none is counted. [`ShardTable::drop_all`] (the lease is lost) drops
/// every shard at once and withdraws the leave of the reconciles in flight. A key refused while
/// its shard is held stays with the shard until [`ShardTable::readmit`] hands it back (the
/// shard can admit again) or the shard goes (its next owner queues all its keys).
pub(crate) struct ShardTable {
    shards: u32,
    shard_by: ShardBy,
    state: Mutex<State>,
    /// A releasing shard's last reconcile ended.
    quiet: Notify,
    /// Bumped by `drop_all`: the leave given before is withdrawn.
    epoch: watch::Sender<u64>,
    /// The lease the shards are held with: no reconcile starts once it is no longer proven,
    /// even before the coordinator hears that it is lost.
    lease: Mutex<Option<Validity>>,
}

#[derive(Default)]
struct State {
    held: BTreeMap<u32, Held>,
    next_id: u64,
}

impl ShardTable {
    pub(crate) fn new(shards: u32, shard_by: ShardBy) -> Arc<Self> {
        Arc::new(ShardTable {
            shards,
            shard_by,
            state: Mutex::default(),
            quiet: Notify::new(),
            epoch: watch::Sender::new(0),
            lease: Mutex::new(None),
        })
    }

    pub(crate) fn shard_of(&self, key: &str) -> u32 {
        shard_of(&self.shard_by, key, self.shards)
    }

    /// Holds the shards from now on with the lease behind `validity`.
    pub(crate) fn bind(&self, validity: Validity) {
        *lock(&self.lease) = Some(validity);
    }

    /// Leave to reconcile `key` now, if its shard is held and not being handed over, and the
    /// lease is still proven alive.
    pub(crate) fn admit(self: &Arc<Self>, key: &str) -> Option<Admitted> {
        let shard = self.shard_of(key);
        let mut state = lock(&self.state);
        let held = state.held.get_mut(&shard)?;
        if held.releasing.is_some() || !self.proven() {
            // The handover may be called off, or the lease go on after a late renewal, with
            // no new owner to queue the key: remember it.
            held.refused.insert(key.to_owned());
            return None;
        }
        held.in_flight += 1;
        let fence = held.fence.clone();
        let id = held.id;
        // Under the state lock, as `drop_all` bumps it: an epoch read after releasing the lock
        // could already be the one that dropped this holding, and nothing would withdraw it.
        let mut epoch = self.epoch.subscribe();
        let given = *epoch.borrow_and_update();
        drop(state);
        Some(Admitted {
            fresh_from: fence.revision(),
            fence: Some(fence),
            revoked: Box::pin(async move {
                let _ = epoch.wait_for(|e| *e != given).await;
            }),
            in_flight: Box::new(InFlight {
                table: self.clone(),
                shard,
                id,
            }),
        })
    }

    /// Records a shard acquired under its owner record's `fence`.
    pub(crate) fn insert(&self, shard: u32, fence: Fence) {
        let mut state = lock(&self.state);
        state.next_id += 1;
        let id = state.next_id;
        state.held.insert(
            shard,
            Held {
                id,
                fence,
                releasing: None,
                in_flight: 0,
                refused: BTreeSet::new(),
            },
        );
    }

    /// Whether `shard` is held (releasing or not).
    pub(crate) fn holds(&self, shard: u32) -> bool {
        lock(&self.state).held.contains_key(&shard)
    }

    /// Starts handing `shard` over: no reconcile starts in it from now on. Returns whether it
    /// was held and not releasing yet.
    pub(crate) fn begin_release(&self, shard: u32) -> bool {
        let mut state = lock(&self.state);
        match state.held.get_mut(&shard) {
            Some(held) if held.releasing.is_none() => {
                held.releasing = Some(Instant::now());
                true
            }
            _ => false,
        }
    }

    /// Keeps `shard` after all (it was assigned back before it was handed over).
    pub(crate) fn cancel_release(&self, shard: u32) -> bool {
        match lock(&self.state).held.get_mut(&shard) {
            Some(held) if held.releasing.is_some() => {
                held.releasing = None;
                true
            }
            _ => false,
        }
    }

    /// The releasing shards whose reconciles have all ended, with their fences and when their
    /// release began.
    pub(crate) fn released(&self) -> Vec<(u32, Fence, Instant)> {
        lock(&self.state)
            .held
            .iter()
            .filter_map(|(shard, held)| match held.releasing {
                Some(since) if held.in_flight == 0 => Some((*shard, held.fence.clone(), since)),
                _ => None,
            })
            .collect()
    }

    /// The keys refused in shards that can admit them again (kept after all, or the lease
    /// proven again), each once.
    pub(crate) fn readmit(&self) -> Vec<String> {
        if !self.proven() {
            return Vec::new();
        }
        lock(&self.state)
            .held
            .values_mut()
            .filter(|held| held.releasing.is_none())
            .flat_map(|held| std::mem::take(&mut held.refused))
            .collect()
    }

    /// Whether the lease the shards are held with is proven alive now.
    fn proven(&self) -> bool {
        lock(&self.lease).as_ref().is_some_and(Validity::is_valid)
    }

    /// Forgets `shard` (its owner record is gone).
    pub(crate) fn remove(&self, shard: u32) {
        lock(&self.state).held.remove(&shard);
    }

    /// The lease is lost: every shard is dropped at once, and reconciles in flight are
    /// abandoned. Returns how many shards were held.
    pub(crate) fn drop_all(&self) -> usize {
        let mut state = lock(&self.state);
        let dropped = std::mem::take(&mut state.held).len();
        // Before the lock is released: a shard inserted meanwhile is not withdrawn with these.
        self.epoch.send_modify(|e| *e += 1);
        dropped
    }

    /// The shards held (releasing or not), and those releasing.
    pub(crate) fn held(&self) -> (Vec<u32>, Vec<u32>) {
        let state = lock(&self.state);
        let held = state.held.keys().copied().collect();
        let releasing = state
            .held
            .iter()
            .filter(|(_, h)| h.releasing.is_some())
            .map(|(s, _)| *s)
            .collect();
        (held, releasing)
    }

    /// Resolves after a releasing shard's last reconcile ended (maybe before this was called:
    /// callers look at [`released`](Self::released) again after it).
    pub(crate) async fn quiet(&self) {
        self.quiet.notified().await
    }
}

/// Counts one reconcile in its shard until dropped.
struct InFlight {
    table: Arc<ShardTable>,
    shard: u32,
    id: u64,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut state = lock(&self.table.state);
        if let Some(held) = state.held.get_mut(&self.shard) {
            if held.id == self.id {
                held.in_flight -= 1;
                if held.in_flight == 0 && held.releasing.is_some() {
                    drop(state);
                    self.table.quiet.notify_one();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sharding::assignment::whole_key;

    fn table() -> Arc<ShardTable> {
        let table = ShardTable::new(4, Arc::new(whole_key));
        table.bind(Validity::until(
            Instant::now() + std::time::Duration::from_secs(60),
        ));
        table
    }

    fn key_in(table: &ShardTable, shard: u32) -> String {
        (0..)
            .map(|i| format!("k{i}"))
            .find(|k| table.shard_of(k) == shard)
            .expect("some key falls in every shard")
    }

    #[tokio::test]
    async fn a_shard_is_released_only_once_its_reconciles_have_ended() {
        let table = table();
        let key = key_in(&table, 1);
        assert!(table.admit(&key).is_none(), "not held yet");
        table.insert(1, Fence::new("/s/0001", 7));
        let first = table.admit(&key).expect("held");
        assert_eq!(first.fence, Some(Fence::new("/s/0001", 7)));
        assert!(table.begin_release(1));
        assert!(
            table.admit(&key).is_none(),
            "no reconcile starts while releasing"
        );
        assert!(table.released().is_empty(), "one reconcile still runs");
        drop(first);
        let released = table.released();
        assert_eq!(released.len(), 1);
        assert_eq!(released[0].0, 1);
        table.remove(1);
        assert!(!table.holds(1));
    }

    #[tokio::test]
    async fn no_reconcile_starts_once_the_lease_is_no_longer_proven() {
        let table = table();
        let key = key_in(&table, 3);
        table.insert(3, Fence::new("/s/0003", 5));
        assert!(table.admit(&key).is_some());
        table.bind(Validity::until(Instant::now()));
        assert!(table.admit(&key).is_none(), "the lease is past its proof");
    }

    #[tokio::test]
    async fn losing_the_lease_withdraws_the_leave_of_reconciles_in_flight() {
        let table = table();
        let key = key_in(&table, 2);
        table.insert(2, Fence::new("/s/0002", 9));
        let admitted = table.admit(&key).expect("held");
        assert_eq!(table.drop_all(), 1);
        tokio::time::timeout(std::time::Duration::from_secs(1), admitted.revoked)
            .await
            .expect("the leave is withdrawn");
        assert!(table.admit(&key).is_none());
        // A reconcile of an earlier holding ending later does not count against a new one.
        table.insert(2, Fence::new("/s/0002", 12));
        drop(admitted.in_flight);
        let again = table.admit(&key).expect("held again");
        assert!(table.begin_release(2));
        assert!(table.released().is_empty());
        drop(again);
        assert_eq!(table.released().len(), 1);
    }

    /// Polls `revoked` once: whether the leave is withdrawn already.
    fn withdrawn(mut revoked: crate::listwatch::BoxFuture<'static, ()>) -> bool {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        revoked.as_mut().poll(&mut cx).is_ready()
    }

    /// Issue 28, finding 4: a leave given while `drop_all` runs on another thread is
    /// withdrawn by that `drop_all`, whichever of the two takes the state first.
    #[test]
    fn a_leave_given_while_the_lease_is_lost_is_withdrawn_with_the_others() {
        let table = table();
        let key = key_in(&table, 0);
        let (mut given, mut missed, mut rounds) = (0, 0, 0);
        let started = std::time::Instant::now();
        while started.elapsed() < std::time::Duration::from_secs(3) {
            rounds += 1;
            table.insert(0, Fence::new("/s/0000", rounds));
            let go = Arc::new(std::sync::Barrier::new(2));
            let admitting = std::thread::spawn({
                let (table, key, go) = (table.clone(), key.clone(), go.clone());
                move || {
                    go.wait();
                    let mut all = Vec::new();
                    while let Some(admitted) = table.admit(&key) {
                        all.push(admitted);
                    }
                    all
                }
            });
            go.wait();
            for _ in 0..fastrand::usize(0..2000) {
                std::hint::spin_loop();
            }
            table.drop_all();
            for admitted in admitting.join().expect("the admitting thread") {
                given += 1;
                missed += usize::from(!withdrawn(admitted.revoked));
            }
        }
        assert_eq!(
            missed, 0,
            "{missed} of {given} leaves outlived the drop_all of their holding ({rounds} rounds)"
        );
        println!("{given} leaves given in {rounds} rounds racing drop_all: all withdrawn");
    }

    /// Issue 28, finding 2: keys refused while their shard was being handed over come back
    /// when the handover is called off.
    #[tokio::test]
    async fn keys_refused_during_a_handover_called_off_come_back() {
        let table = table();
        let (k1, k3) = (key_in(&table, 1), key_in(&table, 3));
        table.insert(1, Fence::new("/s/0001", 4));
        table.insert(3, Fence::new("/s/0003", 5));
        assert!(table.begin_release(1));
        assert!(table.begin_release(3));
        assert!(table.admit(&k1).is_none());
        assert!(table.admit(&k3).is_none());
        assert!(table.readmit().is_empty(), "both still releasing");
        assert!(table.cancel_release(1));
        assert_eq!(table.readmit(), vec![k1.clone()], "shard 1 is kept");
        assert!(table.readmit().is_empty(), "handed back once");
        // Shard 3 is handed over: its refused keys go with it (the new owner queues them all).
        assert_eq!(table.released().len(), 1);
        table.remove(3);
        table.insert(3, Fence::new("/s/0003", 9));
        assert!(table.readmit().is_empty());
        // A key refused because its shard is not held at all is nobody's to remember here.
        table.remove(1);
        assert!(table.admit(&k1).is_none());
        table.insert(1, Fence::new("/s/0001", 10));
        assert!(table.readmit().is_empty());
    }

    /// Issue 28, finding 2 (the narrower variant): keys refused while the lease's proof had
    /// lapsed come back once a renewal (accepted late) proves it again, with no `drop_all`.
    #[tokio::test]
    async fn keys_refused_while_the_lease_was_unproven_come_back_when_it_is_proven_again() {
        let table = table();
        let key = key_in(&table, 2);
        table.insert(2, Fence::new("/s/0002", 3));
        let validity = Validity::until(Instant::now());
        table.bind(validity.clone());
        assert!(table.admit(&key).is_none(), "the proof lapsed");
        assert!(table.readmit().is_empty(), "still unproven");
        validity.renewed_until(Instant::now() + std::time::Duration::from_secs(60));
        assert_eq!(table.readmit(), vec![key.clone()]);
        assert!(table.admit(&key).is_some());
    }
}
