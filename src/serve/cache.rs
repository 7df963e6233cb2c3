//! The served cache: the prefix's keys at the cache's revision, and a bounded history of the
//! revisions before it, filled by a [`Reflector`](crate::Reflector) through the [`Queue`] trait
//! (the Kubernetes apiserver's watch cache is a store fed by a reflector the same way).
//!
//! Invariants, under the one lock:
//! - `kvs` is etcd's content of the prefix at `revision` (keys absolute, as etcd has them);
//! - `history` holds every event with a revision above `first`, in order, one [`Group`] per
//!   revision that changed something, each event with the key's previous state in the cache;
//! - a Range at a revision R with `range_floor <= R <= revision` rolls `kvs` back through the
//!   groups above R; below the floor the revision is compacted, as etcd says;
//! - `epoch` changes when the store was replaced (revisions went back): every watch of an
//!   older epoch is over.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Bound;
use std::sync::{Arc, Mutex};

use etcd_client::proto::PbKeyValue;
use tokio::sync::watch;

use super::header::Headers;
use crate::listwatch::etcd::{key_bytes, key_text, Identity};
use crate::listwatch::BoxFuture;
use crate::object::Object;
use crate::queue::{DeltaType, Queue};
use crate::sync::lock;

/// A cached key's state (values are raw bytes).
pub(crate) type Kv = Arc<Object<Vec<u8>>>;

/// Keys (absolute) and their states, in key order.
pub(crate) type Found = Vec<(Arc<[u8]>, Kv)>;

/// One change of one key.
#[derive(Debug, Clone)]
pub(crate) struct Event {
    /// The absolute key.
    pub(crate) key: Arc<[u8]>,
    /// The new state; `None` for a delete.
    pub(crate) kv: Option<Kv>,
    /// The state just before, from the cache.
    pub(crate) prev: Option<Kv>,
    /// The event's revision (a delete's `mod_revision`).
    pub(crate) revision: i64,
}

impl Event {
    /// The event as etcd's watch sends it: a delete's kv holds the key and its revision.
    pub(crate) fn to_pb(&self, with_prev: bool) -> etcd_client::proto::PbEvent {
        let (kind, kv) = match &self.kv {
            Some(kv) => (0, to_pb(&self.key, kv, false)),
            None => (
                1,
                PbKeyValue {
                    key: self.key.to_vec(),
                    mod_revision: self.revision,
                    ..Default::default()
                },
            ),
        };
        etcd_client::proto::PbEvent {
            r#type: kind,
            kv: Some(kv),
            prev_kv: if with_prev {
                self.prev.as_ref().map(|p| to_pb(&self.key, p, false))
            } else {
                None
            },
        }
    }

    fn bytes(&self) -> usize {
        let value = |kv: &Option<Kv>| kv.as_ref().map_or(0, |kv| kv.value.len());
        // The key is counted twice: the event's and the object's.
        2 * self.key.len() + value(&self.kv) + value(&self.prev) + 64
    }
}

/// A key-value as etcd sends it.
pub(crate) fn to_pb(key: &[u8], kv: &Object<Vec<u8>>, keys_only: bool) -> PbKeyValue {
    PbKeyValue {
        key: key.to_vec(),
        create_revision: kv.create_revision,
        mod_revision: kv.mod_revision,
        version: kv.version,
        value: if keys_only {
            Vec::new()
        } else {
            kv.value.clone()
        },
        lease: kv.lease,
    }
}

/// Every event of one revision.
#[derive(Debug)]
pub(crate) struct Group {
    pub(crate) revision: i64,
    pub(crate) events: Vec<Event>,
    bytes: usize,
    /// When the cache applied it (metrics only).
    pub(crate) applied: Option<std::time::Instant>,
}

/// How much history the cache keeps: both bounds hold.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HistoryBounds {
    pub(crate) revisions: usize,
    pub(crate) bytes: usize,
}

/// What the cache says of a revision it cannot answer at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RevisionError {
    /// Below the oldest revision kept; the lowest one a watch may start from.
    Compacted(i64),
    /// Above the cache's revision.
    Future,
}

/// Where the cache is: revision and epoch, for waiters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Position {
    pub(crate) revision: i64,
    pub(crate) epoch: u64,
    pub(crate) synced: bool,
}

#[derive(Default)]
struct State {
    kvs: BTreeMap<Arc<[u8]>, Kv>,
    revision: i64,
    history: VecDeque<Arc<Group>>,
    history_bytes: usize,
    first: i64,
    range_floor: i64,
    epoch: u64,
    synced: bool,
    /// Changes taken from the reflector and not yet committed: a revision is applied whole.
    pending: Vec<Event>,
    /// Revisions relists skipped. Dropped with the history.
    gaps: Vec<Gap>,
}

/// Revisions a relist skipped, `(before, listed]`: its difference is one revision at `listed`.
/// A watch starting inside cannot take it (it would get changes from before its start); one
/// that was at `before` may, if the difference reads as etcd's events would (`whole`).
#[derive(Debug, Clone, Copy)]
struct Gap {
    before: i64,
    listed: i64,
    /// No key was created inside the gap and then changed, or deleted and created again: a
    /// client counting keys by version (the informer's key tally) counts the difference
    /// right. Otherwise a watch that reaches the gap is cancelled, as below a compaction.
    whole: bool,
}

impl Gap {
    /// Whether a watch from `from` cannot take the difference.
    fn refuses(&self, from: i64) -> bool {
        from > self.before + 1 && from <= self.listed || from == self.before + 1 && !self.whole
    }
}

/// The cache a [`CacheServer`](super::CacheServer) answers from; see the module's invariants.
pub(crate) struct ServedCache {
    prefix: Arc<[u8]>,
    bounds: HistoryBounds,
    state: Mutex<State>,
    position: watch::Sender<Position>,
    /// Also moved on every change of position, when shared with other caches.
    any: Option<Arc<watch::Sender<u64>>>,
    /// The identity the source records of the store it reads, and the headers that name the
    /// store the cache holds: taken as the cache takes the content (see [`Headers`]).
    identity: Option<(Arc<Mutex<Identity>>, Headers)>,
}

impl ServedCache {
    pub(crate) fn new(prefix: &[u8], bounds: HistoryBounds) -> Self {
        let (position, _) = watch::channel(Position {
            revision: 0,
            epoch: 0,
            synced: false,
        });
        ServedCache {
            prefix: prefix.into(),
            bounds,
            state: Mutex::new(State::default()),
            position,
            any: None,
            identity: None,
        }
    }

    /// Names the store the cache holds in `headers`, as `source` records it.
    pub(crate) fn with_identity(mut self, source: Arc<Mutex<Identity>>, headers: Headers) -> Self {
        self.identity = Some((source, headers));
        self
    }

    /// The cache took the content of another store (`replaced`), or more of the one it holds.
    /// Under the state lock, before the content is published: no answer names one store with
    /// the other's keys.
    fn name_store(&self, replaced: bool) {
        if let Some((source, headers)) = &self.identity {
            let identity = *lock(source);
            if replaced {
                headers.take(identity);
            } else {
                headers.follow(identity);
            }
        }
    }

    /// Also moves `any` whenever this cache's position moves (one signal for several caches).
    pub(crate) fn with_changed(mut self, any: Arc<watch::Sender<u64>>) -> Self {
        self.any = Some(any);
        self
    }

    /// Follows the cache's position.
    pub(crate) fn subscribe(&self) -> watch::Receiver<Position> {
        self.position.subscribe()
    }

    pub(crate) fn position(&self) -> Position {
        *self.position.borrow()
    }

    /// How many keys the cache holds.
    pub(crate) fn len(&self) -> usize {
        lock(&self.state).kvs.len()
    }

    /// The cache's revision and how many keys it holds there.
    pub(crate) fn revision_and_len(&self) -> (i64, usize) {
        let state = lock(&self.state);
        (state.revision, state.kvs.len())
    }

    /// (revisions, bytes) of history kept.
    pub(crate) fn history_size(&self) -> (usize, usize) {
        let state = lock(&self.state);
        (state.history.len(), state.history_bytes)
    }

    /// etcd's key of a key the source gave (relative, escaped if not UTF-8).
    fn absolute(&self, key: &str) -> Arc<[u8]> {
        let key = key_bytes(key);
        let mut k = Vec::with_capacity(self.prefix.len() + key.len());
        k.extend_from_slice(&self.prefix);
        k.extend_from_slice(&key);
        k.into()
    }

    /// The keys in `[key, end)` (etcd's range forms: empty `end` is the key alone, `\0` every
    /// key from `key` on) at `revision` (0: the cache's), and the cache's revision. `proven`:
    /// etcd's revision up to which the prefix is known unchanged beyond the cache's revision
    /// (a linearizable read's proof; 0 if none), so revisions up to it are not in the future.
    pub(crate) fn range_at(
        &self,
        key: &[u8],
        end: &[u8],
        revision: i64,
        proven: i64,
    ) -> Result<(Found, i64), RevisionError> {
        // The lock is held only to copy pointers (the keys in range, the history groups after
        // the revision asked): the reflector and every watch session wait on it.
        let (current, newer, cache_revision) = {
            let state = lock(&self.state);
            let at = self.check_revision(&state, revision, proven)?;
            let current: Found = state
                .kvs
                .range::<[u8], _>(bounds(key, end))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let newer: Vec<Arc<Group>> = match at {
                Some(at) => {
                    let start = state.history.partition_point(|g| g.revision <= at);
                    state.history.range(start..).cloned().collect()
                }
                None => Vec::new(),
            };
            (current, newer, state.revision)
        };
        if newer.is_empty() {
            return Ok((current, cache_revision));
        }
        // Undo the changes after the revision asked, newest first: each key's oldest change
        // after it holds the key's state at it (`prev`, or absent).
        let mut then: BTreeMap<Arc<[u8]>, Option<Kv>> = BTreeMap::new();
        for group in newer.iter().rev() {
            for event in group.events.iter().rev() {
                if in_range(&event.key, key, end) {
                    then.insert(event.key.clone(), event.prev.clone());
                }
            }
        }
        let mut found = Vec::with_capacity(current.len());
        let mut undone = then.into_iter().peekable();
        for (k, v) in current {
            // Keys absent now that the revision asked held (deleted since).
            while let Some((u, prev)) = undone.next_if(|(u, _)| *u < k) {
                if let Some(prev) = prev {
                    found.push((u, prev));
                }
            }
            match undone.next_if(|(u, _)| *u == k) {
                Some((k, Some(prev))) => found.push((k, prev)),
                Some((_, None)) => {}
                None => found.push((k, v)),
            }
        }
        found.extend(undone.filter_map(|(k, prev)| prev.map(|prev| (k, prev))));
        Ok((found, cache_revision))
    }

    /// Every key (relative to the prefix, in key order) with its `mod_revision`, and the
    /// cache's revision: what the audit compares with etcd. The lock is held only to copy
    /// pointers; keys that are not UTF-8 in their escaped text, as the source gives them.
    pub(crate) fn key_revisions(&self) -> (i64, Vec<(Box<str>, i64)>) {
        let (revision, kvs) = {
            let state = lock(&self.state);
            let kvs: Vec<(Arc<[u8]>, i64)> = state
                .kvs
                .iter()
                .map(|(k, v)| (k.clone(), v.mod_revision))
                .collect();
            (state.revision, kvs)
        };
        let keys = kvs
            .into_iter()
            .filter_map(|(k, r)| {
                let relative = k.get(self.prefix.len()..)?;
                Some((key_text(relative, true)?.into(), r))
            })
            .collect();
        (revision, keys)
    }

    /// How many keys `[key, end)` holds at `revision` (see [`range_at`](Self::range_at)), and
    /// the cache's revision: a count of the current content copies nothing.
    pub(crate) fn count_at(
        &self,
        key: &[u8],
        end: &[u8],
        revision: i64,
        proven: i64,
    ) -> Result<(i64, i64), RevisionError> {
        {
            let state = lock(&self.state);
            if self.check_revision(&state, revision, proven)?.is_none() {
                let count = state.kvs.range::<[u8], _>(bounds(key, end)).count();
                return Ok((count as i64, state.revision));
            }
        }
        let (found, revision) = self.range_at(key, end, revision, proven)?;
        Ok((found.len() as i64, revision))
    }

    /// Whether `revision` can be read from the cache: `None` for its current content, the
    /// revision to undo the history down to otherwise.
    fn check_revision(
        &self,
        state: &State,
        revision: i64,
        proven: i64,
    ) -> Result<Option<i64>, RevisionError> {
        if revision <= 0 {
            // The current content: never compacted, whatever etcd compacted since.
            return Ok(None);
        }
        if revision > state.revision.max(proven) {
            return Err(RevisionError::Future);
        }
        if revision < state.range_floor.max(state.first) {
            return Err(RevisionError::Compacted(state.first + 1));
        }
        // Up to `proven` the prefix is what the cache holds now.
        Ok((revision < state.revision).then_some(revision))
    }

    /// The groups with a revision of `from` or more, at most `max` of them, for a watch in
    /// `epoch`, and the revision through which they are all a watch gets (the cache's, or the
    /// last before a relist's gap); `Compacted` when the history no longer reaches back to
    /// `from`, the store was replaced since, or `from` is in a gap.
    ///
    /// A relist's difference goes to a watch only when it reads as etcd's events would: a key
    /// created and changed within the gap would come as a put with a version above 1, one
    /// deleted and created again as a create of a key the client holds, and a client counting
    /// keys by version (the informer's key tally) would count wrong. A watch that reaches
    /// such a gap is cancelled with `compact_revision` (the revision after the list), as etcd
    /// cancels a watch below its compaction, the usual cause of the relist; its client lists
    /// again.
    pub(crate) fn groups_from(
        &self,
        from: i64,
        epoch: u64,
        max: usize,
    ) -> Result<(Vec<Arc<Group>>, i64), RevisionError> {
        let state = lock(&self.state);
        if epoch != state.epoch || from <= state.first {
            return Err(RevisionError::Compacted(state.first + 1));
        }
        if let Some(gap) = state.gaps.iter().find(|gap| gap.refuses(from)) {
            return Err(RevisionError::Compacted(gap.listed + 1));
        }
        // The next gap it cannot take, if any: a watch reads up to it, then is cancelled.
        let upto = state
            .gaps
            .iter()
            .filter(|gap| !gap.whole && gap.before >= from)
            .map(|gap| gap.before)
            .min()
            .unwrap_or(state.revision);
        let start = state.history.partition_point(|g| g.revision < from);
        let groups = state
            .history
            .range(start..)
            .take_while(|g| g.revision <= upto)
            .take(max)
            .cloned()
            .collect();
        Ok((groups, upto))
    }

    /// Whether a watch of `epoch` that has received every event below `from` can be served
    /// from here on: the history reaches back to `from`, with no gap it cannot take.
    pub(crate) fn serves_from(&self, from: i64, epoch: u64) -> bool {
        let state = lock(&self.state);
        epoch == state.epoch
            && from > state.first
            && !state.gaps.iter().any(|gap| gap.refuses(from))
    }

    /// etcd compacted at `revision` (a Compact through the server): Ranges below it are
    /// compacted, and watches below it, as etcd says; the history before it goes.
    pub(crate) fn compacted(&self, revision: i64) {
        let mut state = lock(&self.state);
        state.range_floor = state.range_floor.max(revision);
        while state
            .history
            .front()
            .is_some_and(|group| group.revision < revision)
        {
            if let Some(old) = state.history.pop_front() {
                state.history_bytes -= old.bytes;
                state.first = state.first.max(old.revision);
            }
        }
        // A watch may start at the compaction revision itself, as on etcd, and always at the
        // cache's next revision (a compaction above it removed nothing of the prefix).
        state.first = state.first.max((revision - 1).min(state.revision));
    }

    fn publish(&self, state: &State) {
        self.position.send_replace(Position {
            revision: state.revision,
            epoch: state.epoch,
            synced: state.synced,
        });
        if let Some(any) = &self.any {
            any.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Applies the pending changes up to `revision`, one group per revision.
    fn apply_pending(&self, state: &mut State) {
        if state.pending.is_empty() {
            return;
        }
        let mut pending = std::mem::take(&mut state.pending);
        pending.sort_by_key(|e| e.revision);
        let mut group: Option<Group> = None;
        for mut event in pending {
            event.prev = state.kvs.get(&event.key).cloned();
            match &event.kv {
                Some(kv) => state.kvs.insert(event.key.clone(), kv.clone()),
                None => state.kvs.remove(&event.key),
            };
            if group.as_ref().is_some_and(|g| g.revision != event.revision) {
                if let Some(done) = group.take() {
                    push_group(state, done, self.bounds);
                }
            }
            let g = group.get_or_insert_with(|| Group {
                revision: event.revision,
                events: Vec::new(),
                bytes: 0,
                applied: None,
            });
            g.bytes += event.bytes();
            g.events.push(event);
        }
        if let Some(done) = group {
            state.revision = state.revision.max(done.revision);
            push_group(state, done, self.bounds);
        }
    }
}

fn push_group(state: &mut State, mut group: Group, bounds: HistoryBounds) {
    group.applied = crate::metrics::ENABLED.then(std::time::Instant::now);
    state.revision = state.revision.max(group.revision);
    state.history_bytes += group.bytes;
    state.history.push_back(Arc::new(group));
    while state.history.len() > bounds.revisions.max(1)
        || (state.history_bytes > bounds.bytes && state.history.len() > 1)
    {
        let Some(old) = state.history.pop_front() else {
            break;
        };
        state.history_bytes -= old.bytes;
        state.first = old.revision;
    }
    let first = state.first;
    state.gaps.retain(|gap| gap.listed > first);
}

/// etcd's range `[key, end)` as map bounds.
pub(crate) fn bounds<'a>(key: &'a [u8], end: &'a [u8]) -> (Bound<&'a [u8]>, Bound<&'a [u8]>) {
    if end.is_empty() {
        (Bound::Included(key), Bound::Included(key))
    } else if end == [0] {
        (Bound::Included(key), Bound::Unbounded)
    } else if key >= end {
        // Empty: a range the map accepts.
        (Bound::Included(key), Bound::Excluded(key))
    } else {
        (Bound::Included(key), Bound::Excluded(end))
    }
}

/// Whether `k` is in etcd's range `[key, end)`.
pub(crate) fn in_range(k: &[u8], key: &[u8], end: &[u8]) -> bool {
    if end.is_empty() {
        k == key
    } else if end == [0] {
        k >= key
    } else {
        k >= key && k < end
    }
}

impl Queue<Vec<u8>> for ServedCache {
    fn add_if_newer(&self, _kind: DeltaType, obj: Kv) -> bool {
        let key = self.absolute(obj.key());
        let mut state = lock(&self.state);
        let known = state.kvs.get(&key).map_or(0, |kv| kv.mod_revision);
        if obj.mod_revision <= known.max(state.revision) {
            return false;
        }
        let revision = obj.mod_revision;
        state.pending.push(Event {
            key,
            kv: Some(obj),
            prev: None,
            revision,
        });
        true
    }

    fn delete(&self, key: &str, revision: i64, _last: Option<Kv>) -> bool {
        let key = self.absolute(key);
        let mut state = lock(&self.state);
        if revision <= state.revision || !state.kvs.contains_key(&key) {
            return false;
        }
        state.pending.push(Event {
            key,
            kv: None,
            prev: None,
            revision,
        });
        true
    }

    /// The difference between the cache and the list becomes one group at the list's
    /// revision, which open watches take when it is whole (see
    /// [`groups_from`](Self::groups_from)); Ranges before it are etcd's to answer. A replaced store (or the first list) starts the
    /// history over instead, and so does a list at the cache's own revision that differs from
    /// it (an event the cache's watch lost, found by the key tally): watches caught up to that
    /// revision would never take a second group at it, so every watch ends (compacted, as
    /// after a replaced store) and its client lists the repaired content again.
    fn replace(&self, list: Vec<Kv>, revision: i64, store_replaced: bool) {
        let mut state = lock(&self.state);
        state.pending.clear();
        let listed: BTreeMap<Arc<[u8]>, Kv> = list
            .into_iter()
            .map(|o| (self.absolute(o.key()), o))
            .collect();
        let repaired_in_place = state.synced
            && revision == state.revision
            && (listed.len() != state.kvs.len()
                || listed
                    .iter()
                    .zip(&state.kvs)
                    .any(|((k, kv), (old_k, old))| {
                        k != old_k || kv.mod_revision != old.mod_revision
                    }));
        if repaired_in_place {
            tracing::warn!(
                revision,
                "the cache differed from etcd at its own revision (an event its watch lost); every watch ends and lists again"
            );
        }
        if store_replaced || !state.synced || revision < state.revision || repaired_in_place {
            let replaced = state.synced;
            state.kvs = listed;
            state.history.clear();
            state.gaps.clear();
            state.history_bytes = 0;
            state.revision = revision;
            state.first = revision;
            state.range_floor = revision;
            if replaced {
                state.epoch += 1;
                if let Some((_, headers)) = &self.identity {
                    headers.replaced();
                }
            }
            state.synced = true;
            self.name_store(true);
            tracing::info!(
                revision,
                keys = state.kvs.len(),
                replaced,
                "served cache listed"
            );
            self.publish(&state);
            return;
        }
        let mut changes = Vec::new();
        for (key, kv) in &listed {
            let same = state
                .kvs
                .get(key)
                .is_some_and(|old| old.mod_revision == kv.mod_revision);
            if !same {
                changes.push(Event {
                    key: key.clone(),
                    kv: Some(kv.clone()),
                    prev: None,
                    revision,
                });
            }
        }
        for key in state.kvs.keys() {
            if !listed.contains_key(key) {
                changes.push(Event {
                    key: key.clone(),
                    kv: None,
                    prev: None,
                    revision,
                });
            }
        }
        // In the order etcd made them, as far as the list tells: puts by their revision, then
        // the deletes (at the list's revision).
        changes.sort_by_key(|e| e.kv.as_ref().map_or(revision, |kv| kv.mod_revision));
        let before = state.revision;
        let whole = !changes.iter().any(|e| {
            e.kv.as_ref().is_some_and(|kv| {
                kv.create_revision > before && (kv.version > 1 || state.kvs.contains_key(&e.key))
            })
        });
        tracing::info!(
            revision,
            changes = changes.len(),
            whole,
            "served cache relisted; the difference goes to the watches if whole, else they end as below a compaction"
        );
        state.pending = changes;
        self.apply_pending(&mut state);
        // Revisions between the old one and the list's are gaps: no Range can be answered there.
        state.revision = state.revision.max(revision);
        state.range_floor = state.revision;
        if revision > before + 1 {
            state.gaps.push(Gap {
                before,
                listed: revision,
                whole,
            });
        }
        self.name_store(false);
        self.publish(&state);
    }

    fn resync(&self) {}

    fn commit(&self, revision: i64) {
        let mut state = lock(&self.state);
        self.apply_pending(&mut state);
        let _ = revision;
        self.name_store(false);
        self.publish(&state);
    }

    fn progress(&self, revision: i64) {
        let mut state = lock(&self.state);
        self.apply_pending(&mut state);
        // A trusted bookmark of the watch, in order behind its events: nothing else changed.
        state.revision = state.revision.max(revision);
        self.name_store(false);
        self.publish(&state);
    }

    fn room(&self) -> Option<BoxFuture<'_, ()>> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(key: &str, create: i64, rev: i64, version: i64, value: &str) -> Kv {
        let mut o = Object::new(key, rev, value.as_bytes().to_vec());
        o.create_revision = create;
        o.version = version;
        Arc::new(o)
    }

    /// A cache of `/p/` keeping `revisions` revisions of history (1 MiB at most).
    fn cache(revisions: usize) -> ServedCache {
        ServedCache::new(
            b"/p/",
            HistoryBounds {
                revisions,
                bytes: 1 << 20,
            },
        )
    }

    fn keys(found: &[(Arc<[u8]>, Kv)]) -> Vec<(String, i64)> {
        found
            .iter()
            .map(|(k, v)| (String::from_utf8_lossy(k).into_owned(), v.mod_revision))
            .collect()
    }

    #[test]
    fn ranges_roll_back_through_history() {
        let cache = cache(100);
        cache.replace(vec![obj("a", 2, 2, 1, "a1")], 3, false);
        cache.add_if_newer(DeltaType::Updated, obj("a", 2, 4, 2, "a2"));
        cache.add_if_newer(DeltaType::Added, obj("b", 4, 4, 1, "b1"));
        cache.commit(4);
        cache.delete("a", 5, None);
        cache.commit(5);
        let (now, rev) = cache.range_at(b"/p/", b"/p0", 0, 0).unwrap();
        assert_eq!((keys(&now), rev), (vec![("/p/b".into(), 4)], 5));
        let (then, _) = cache.range_at(b"/p/", b"/p0", 4, 0).unwrap();
        assert_eq!(keys(&then), vec![("/p/a".into(), 4), ("/p/b".into(), 4)]);
        let (first, _) = cache.range_at(b"/p/", b"/p0", 3, 0).unwrap();
        assert_eq!(keys(&first), vec![("/p/a".into(), 2)]);
        for (revision, count) in [(0, 1), (5, 1), (4, 2), (3, 1)] {
            let counted = cache.count_at(b"/p/", b"/p0", revision, 0);
            assert_eq!(counted, Ok((count, 5)), "at {revision}");
        }
        assert_eq!(
            cache.range_at(b"/p/", b"", 2, 0),
            Err(RevisionError::Compacted(4))
        );
        // Proven unchanged up to 7: revisions 6 and 7 are the current content, 8 is future.
        let (proven, rev) = cache.range_at(b"/p/", b"/p0", 7, 7).unwrap();
        assert_eq!((keys(&proven), rev), (vec![("/p/b".into(), 4)], 5));
        assert_eq!(
            cache.range_at(b"/p/", b"/p0", 8, 7).err(),
            Some(RevisionError::Future)
        );
        assert_eq!(
            cache.range_at(b"/p/a", b"", 6, 0),
            Err(RevisionError::Future)
        );
        let (groups, _) = cache.groups_from(4, 0, 10).unwrap();
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[1].events[0].prev.as_ref().unwrap().mod_revision, 4);
        // Revision 0 is the current content even above a compaction.
        cache.compacted(9);
        assert!(cache.range_at(b"/p/", b"/p0", 0, 0).is_ok());
        assert!(cache.range_at(b"/p/", b"/p0", 5, 9).is_err());
        assert!(
            cache.groups_from(6, 0, 10).is_ok(),
            "a watch from now is fine"
        );
    }

    #[test]
    fn relist_appends_the_difference_and_history_is_bounded() {
        let cache = cache(2);
        cache.replace(
            vec![obj("a", 2, 2, 1, "a"), obj("b", 3, 3, 1, "b")],
            3,
            false,
        );
        cache.replace(
            vec![obj("a", 2, 7, 2, "a2"), obj("c", 6, 6, 1, "c")],
            9,
            false,
        );
        // The difference is one group at 9, which a watch that was at 3 takes (a changed,
        // b deleted, c created: it reads as etcd's events would).
        let (groups, _) = cache.groups_from(4, 0, 10).unwrap();
        assert_eq!(groups.len(), 1);
        assert_eq!(groups[0].revision, 9);
        assert_eq!(groups[0].events.len(), 3);
        // The gap between 3 and 9 answers no Range, and no watch that starts inside it: it
        // would get changes from before its start.
        assert!(cache.range_at(b"/p/", b"/p0", 5, 0).is_err());
        for inside in [5, 9] {
            assert_eq!(
                cache.groups_from(inside, 0, 10).err(),
                Some(RevisionError::Compacted(10)),
                "a watch from {inside}"
            );
        }
        assert!(cache.groups_from(10, 0, 10).is_ok());
        for r in 10..13 {
            cache.add_if_newer(DeltaType::Updated, obj("c", 6, r, 2, "c"));
            cache.commit(r);
        }
        assert_eq!(
            cache.groups_from(4, 0, 10).err(),
            Some(RevisionError::Compacted(11))
        );
        assert_eq!(cache.history_size().0, 2);
        // A replaced store ends every watch of the old epoch.
        cache.replace(vec![], 2, true);
        assert!(cache.groups_from(3, 0, 10).is_err());
        assert_eq!(cache.position().epoch, 1);
    }

    /// Issue 34 item 5: a relist's difference in which a key was created and changed inside
    /// the gap (it would come as a put of version 2, which a client counting keys by version
    /// counts wrong) is no watch's: a watch behind it reads the history up to the gap and is
    /// then cancelled at the revision after the list.
    #[test]
    fn a_watch_reads_up_to_a_relists_gap_and_is_cancelled_at_it() {
        let cache = cache(100);
        cache.replace(vec![obj("a", 2, 2, 1, "a")], 3, false);
        cache.add_if_newer(DeltaType::Added, obj("b", 4, 4, 1, "b"));
        cache.commit(4);
        // "c" created at 6 and changed at 7, both inside the gap: listed at version 2.
        cache.replace(
            vec![
                obj("a", 2, 2, 1, "a"),
                obj("b", 4, 4, 1, "b"),
                obj("c", 6, 7, 2, "c2"),
            ],
            9,
            false,
        );
        let (groups, upto) = cache.groups_from(4, 0, 10).unwrap();
        let revisions: Vec<i64> = groups.iter().map(|g| g.revision).collect();
        assert_eq!((revisions, upto), (vec![4], 4));
        assert_eq!(
            cache.groups_from(5, 0, 10).err(),
            Some(RevisionError::Compacted(10))
        );
        let (groups, upto) = cache.groups_from(10, 0, 10).unwrap();
        assert_eq!((groups.len(), upto), (0, 9));
        // A Range before the list is etcd's to answer (forwarded), in the gap or not.
        assert!(cache.range_at(b"/p/", b"/p0", 4, 0).is_err());
    }

    /// Issue 34 item 8: a relist at the cache's own revision that finds a difference (an event
    /// the watch lost) reaches the watches caught up to that revision: they end, to list the
    /// repaired content; one that finds none leaves them open.
    #[test]
    fn a_relist_at_the_caches_own_revision_that_differs_ends_the_caught_up_watches() {
        let cache = cache(100);
        cache.replace(
            vec![obj("a", 2, 2, 1, "a"), obj("b", 3, 3, 1, "b")],
            3,
            false,
        );
        cache.add_if_newer(DeltaType::Updated, obj("a", 2, 5, 2, "a2"));
        cache.commit(5);
        // Nothing differs: watches stay open.
        cache.replace(
            vec![obj("a", 2, 5, 2, "a2"), obj("b", 3, 3, 1, "b")],
            5,
            false,
        );
        assert_eq!(cache.groups_from(6, 0, 10).map(|(g, _)| g.len()), Ok(0));
        // The delete of "b" at 4 was lost by the watch; the tally relist at 5 finds it.
        cache.replace(vec![obj("a", 2, 5, 2, "a2")], 5, false);
        let caught_up = cache.groups_from(6, 0, 10).map(|(g, _)| g.len());
        assert!(
            matches!(caught_up, Err(RevisionError::Compacted(_))),
            "a watch caught up to the relist's revision must learn of the difference: {caught_up:?}"
        );
        let (now, rev) = cache.range_at(b"/p/", b"/p0", 0, 0).unwrap();
        assert_eq!((keys(&now), rev), (vec![("/p/a".into(), 5)], 5));
    }
}
