//! How what the queue pops becomes cache writes and handler events: a DeltaFIFO's deltas of
//! one key, or a RealFIFO's batch of one revision, applied in one step under the store's
//! lock.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use smallvec::SmallVec;

use super::handler::Event;
use super::options::RelistUnchanged;
use super::processor::Processor;
use super::shared_informer::SharedIndexInformer;
use crate::listwatch::SourceCapabilities;
use crate::metrics::{EventKind, InformerMetrics};
use crate::object::Object;
use crate::queue::{DeletedObject, Delta, DeltaType};
use crate::real_fifo::Batch;
use crate::store::{Retired, StoreContent, Txn};

impl<T: Send + Sync + 'static> SharedIndexInformer<T> {
    /// Runs `apply` catching a panic (an index function, a bug): it is logged and recorded in
    /// [`health`](Self::health), so it does not end `run` and the cache does not silently
    /// stop; the changes of that batch may be partly applied.
    pub(super) fn apply_guarded(&self, apply: impl FnOnce()) {
        if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(apply)) {
            let message = crate::sync::panic_message(&*panic);
            tracing::error!(informer = %self.shared.name, panic = %message, "applying a change to the cache panicked");
            self.shared.apply_panics.fetch_add(1, Ordering::Relaxed);
            if let Some(handle) = self.shared.revision.get() {
                handle.failed(format!(
                    "applying a change to the cache panicked: {message}"
                ));
            }
        }
    }

    /// Applies one key's deltas to the cache, then tells the handlers (client-go's
    /// `HandleDeltas`).
    pub(super) fn handle_deltas(&self, deltas: &[Delta<T>], is_in_initial_list: bool) {
        let processor = self.processor();
        let events = self.shared.indexer.transaction(|txn| {
            deltas
                .iter()
                .map(|d| apply_delta(txn, d, is_in_initial_list))
                .collect::<Vec<_>>()
        });
        self.distribute(&processor, events);
    }

    /// Counts and hands the notifications of one apply to the handlers, in order.
    fn distribute(
        &self,
        processor: &Processor<T>,
        events: impl IntoIterator<Item = (Event<T>, Notice)>,
    ) {
        // One clock read per apply, for the cache-to-handler latency.
        let applied = crate::metrics::ENABLED.then(std::time::Instant::now);
        for (event, notice) in events {
            match (notice, self.shared.relist_unchanged) {
                (Notice::Change, _) => {
                    self.shared.metrics.event(event_kind(&event));
                    processor.distribute(event, false, applied);
                }
                (Notice::Resync, _) | (Notice::Unchanged, RelistUnchanged::ResyncingHandlers) => {
                    processor.distribute(event, true, applied)
                }
                (Notice::Unchanged, RelistUnchanged::Everyone) => {
                    processor.distribute(event, false, applied)
                }
                (Notice::Unchanged, RelistUnchanged::Nobody) => {}
            }
        }
    }

    /// Applies one batch to the cache under one store lock, sets the cache's revision, then
    /// tells the handlers, in order.
    pub(super) fn handle_batch(&self, batch: Batch<T>) {
        let processor = self.processor();
        let indexer = &self.shared.indexer;
        let events = match batch {
            Batch::Changes { revision, deltas } => {
                let received = self.shared.received_at.take(revision);
                // Most revisions change one key: their notification needs no list.
                let events = indexer.transaction(|txn| {
                    let events: SmallVec<[_; 1]> =
                        deltas.iter().map(|d| apply_delta(txn, d, false)).collect();
                    txn.set_revision(revision.max(txn.revision()));
                    events
                });
                if let Some(received) = received {
                    self.shared.metrics.applied(received);
                }
                self.distribute(&processor, events);
                return;
            }
            Batch::Replace {
                revision,
                items,
                store_replaced,
                initial,
            } => {
                if store_replaced {
                    self.shared.received_at.clear();
                }
                let items = Arc::try_unwrap(items).unwrap_or_else(|shared| (*shared).clone());
                // Without handlers, only the metrics hear of the changes: no list of a million
                // notifications to build and drop, and no cached object decoded.
                let listening = !processor.listeners.is_empty();
                // Whether anyone hears of the keys the relist finds unchanged.
                let resync = match self.shared.relist_unchanged {
                    RelistUnchanged::ResyncingHandlers => !processor.syncing.is_empty(),
                    RelistUnchanged::Nobody => false,
                    RelistUnchanged::Everyone => true,
                };
                let metrics = &self.shared.metrics;
                // The store the list was read from: the source recorded it as it listed (a
                // store it finds replaced later is recorded then, before this content goes).
                let origin = (self.shared.source.identity())
                    .and_then(|i| i.cluster_id)
                    .unwrap_or(0);
                indexer.transaction(|txn| {
                    let mut events = Vec::new();
                    let out = if listening {
                        Replaced::Notify {
                            events: &mut events,
                            resync,
                        }
                    } else {
                        Replaced::Count(metrics)
                    };
                    apply_replace(txn, items, store_replaced, initial, out);
                    // After a wipe the revisions start over; otherwise never go back (a
                    // consistent read may have proven a later revision already).
                    let revision = if store_replaced {
                        revision
                    } else {
                        revision.max(txn.revision())
                    };
                    txn.set_revision(revision);
                    txn.set_origin(origin);
                    events
                })
            }
            Batch::Resync => indexer.transaction(|txn| {
                let mut events = Vec::new();
                txn.for_each(&mut |o| {
                    let event = Event::Updated {
                        old: o.clone(),
                        new: o,
                    };
                    events.push((event, Notice::Resync));
                });
                events
            }),
            Batch::Progress(revision) => {
                indexer.advance_revision(revision);
                Vec::new()
            }
        };
        self.distribute(&processor, events);
    }
}

/// Who a notification is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Notice {
    /// A change: every handler.
    Change,
    /// A resync: the handlers due for one.
    Resync,
    /// A key a relist found unchanged: as [`RelistUnchanged`] says.
    Unchanged,
}

/// Applies one delta to the store; returns the notification and who it is for.
fn apply_delta<T>(
    txn: &mut Txn<'_, T>,
    d: &Delta<T>,
    is_in_initial_list: bool,
) -> (Event<T>, Notice) {
    match d.kind {
        DeltaType::Deleted => {
            txn.delete(d.object.key());
            let deleted = d
                .deleted
                .clone()
                .unwrap_or_else(|| DeletedObject::Deleted(d.object.clone()));
            (Event::Deleted(deleted), Notice::Change)
        }
        DeltaType::Added | DeltaType::Updated | DeltaType::Replaced | DeltaType::Sync => {
            match txn.add(d.object.clone()) {
                Some(old) => {
                    let notice = match d.kind {
                        DeltaType::Sync => Notice::Resync,
                        DeltaType::Replaced if old.mod_revision == d.object.mod_revision => {
                            Notice::Unchanged
                        }
                        _ => Notice::Change,
                    };
                    let event = Event::Updated {
                        old,
                        new: d.object.clone(),
                    };
                    (event, notice)
                }
                None => {
                    let event = Event::Added {
                        object: d.object.clone(),
                        is_in_initial_list,
                    };
                    (event, Notice::Change)
                }
            }
        }
    }
}

fn event_kind<T>(event: &Event<T>) -> EventKind {
    match event {
        Event::Added { .. } => EventKind::Added,
        Event::Updated { .. } => EventKind::Updated,
        Event::Deleted(_) => EventKind::Deleted,
    }
}

/// Where [`apply_replace`] reports what changed.
enum Replaced<'a, T> {
    /// To handlers: every notification, in order; the unchanged keys only if `resync` (some
    /// handler hears of them).
    Notify {
        events: &'a mut Vec<(Event<T>, Notice)>,
        resync: bool,
    },
    /// Only to the metrics: no notification is built, no cached object decoded.
    Count(&'a InformerMetrics),
}

/// Replaces the store's content with a relist and reports the changes: adds, updates (resyncs
/// where the revision is unchanged) and tombstones for the keys that vanished. After a wipe
/// every cached key is retired and every listed one added.
fn apply_replace<T>(
    txn: &mut Txn<'_, T>,
    items: StoreContent<T>,
    store_replaced: bool,
    initial: bool,
    out: Replaced<'_, T>,
) {
    let mut old = txn.install(items);
    let tombstone = |o: Arc<Object<T>>| {
        (
            Event::Deleted(DeletedObject::FinalStateUnknown(o)),
            Notice::Change,
        )
    };
    match out {
        Replaced::Notify { events, resync } if !resync => {
            // Nobody hears of an unchanged key: only the changed keys are decoded, so that a
            // relist of a large, mostly unchanged prefix never holds it decoded (twice, old
            // and new) in a list of notifications.
            if store_replaced {
                old.for_each(&mut |o| events.push(tombstone(o)));
            }
            let mut changed = Vec::new();
            txn.for_each_revision(&mut |key, revision| {
                if !store_replaced && unchanged(&old, txn, key, revision) {
                    old.take(key, false);
                } else {
                    changed.push(key.to_owned());
                }
            });
            for key in changed {
                let Some(new) = txn.get(&key) else {
                    continue;
                };
                let previous = if store_replaced || old.is_empty() {
                    None
                } else {
                    old.take(&key, true)
                };
                events.push(match previous {
                    Some((_, Some(old))) => (Event::Updated { old, new }, Notice::Change),
                    _ => (
                        Event::Added {
                            object: new,
                            is_in_initial_list: initial,
                        },
                        Notice::Change,
                    ),
                });
            }
            if !store_replaced {
                old.for_each(&mut |o| events.push(tombstone(o)));
            }
        }
        Replaced::Notify { events, .. } => {
            if store_replaced {
                old.for_each(&mut |o| events.push(tombstone(o)));
            }
            txn.for_each(&mut |new| {
                let previous = if store_replaced || old.is_empty() {
                    None
                } else {
                    old.take(new.key(), true)
                };
                events.push(match previous {
                    Some((revision, Some(old))) => {
                        let same = match (old.stamp(), new.stamp()) {
                            (Some(a), Some(b)) => a == b,
                            _ => revision == new.mod_revision,
                        };
                        let notice = if same {
                            Notice::Unchanged
                        } else {
                            Notice::Change
                        };
                        (Event::Updated { old, new }, notice)
                    }
                    _ => {
                        let event = Event::Added {
                            object: new,
                            is_in_initial_list: initial,
                        };
                        (event, Notice::Change)
                    }
                });
            });
            if !store_replaced {
                old.for_each(&mut |o| events.push(tombstone(o)));
            }
        }
        Replaced::Count(metrics) => {
            if store_replaced || old.is_empty() {
                // Every key is retired, every listed one added: counted without visiting
                // each (a million keys read back at random cost a warm start 0.2 s).
                metrics.events(EventKind::Deleted, old.len() as u64);
                metrics.events(EventKind::Added, txn.len() as u64);
                return;
            }
            txn.for_each_revision(&mut |key, revision| {
                let same = unchanged(&old, txn, key, revision);
                match old.take(key, false) {
                    Some(_) if same => {}
                    Some(_) => metrics.event(EventKind::Updated),
                    None => metrics.event(EventKind::Added),
                }
            });
            metrics.events(EventKind::Deleted, old.len() as u64);
        }
    }
}

/// Whether a relist left `key` as the cache held it: the same stamp (its revisions and the
/// value's digest, as a relist's reuse compares them: a value changed under an equal
/// `mod_revision`, in a store rewritten past the cache, is a change), or the same
/// `mod_revision` for objects that carry no stamp.
fn unchanged<T>(old: &Retired<T>, txn: &Txn<'_, T>, key: &str, revision: i64) -> bool {
    match (old.stamp(key), txn.stamp(key)) {
        (Some(was), Some(is)) => was == is,
        _ => old.mod_revision(key) == Some(revision),
    }
}
