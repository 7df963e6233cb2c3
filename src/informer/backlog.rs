//! A handler's backlog merged per key, so that a handler that falls far behind holds at most
//! two events per key and still gets every key's final state.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use super::handler::Event;

pub(super) fn is_initial<T>(event: &Event<T>) -> bool {
    matches!(
        event,
        Event::Added {
            is_in_initial_list: true,
            ..
        }
    )
}

/// Merges the backlog per key so that it holds at most two events per key (a delete then a
/// re-add), keeping each key's events in order and its final state exact. Returns how many
/// initial adds were dropped (an add followed by a delete the handler never needs to see).
pub(super) fn compact<T>(queue: &mut VecDeque<Event<T>>) -> usize {
    let mut slots: Vec<Vec<Event<T>>> = Vec::new();
    let mut by_key: HashMap<Arc<str>, usize> = HashMap::new();
    let mut removed_initial = 0;
    for event in queue.drain(..) {
        let key = match &event {
            Event::Added { object, .. } => object.shared_key().clone(),
            Event::Updated { new, .. } => new.shared_key().clone(),
            Event::Deleted(d) => d.object().shared_key().clone(),
        };
        let slot = *by_key.entry(key).or_insert_with(|| {
            slots.push(Vec::new());
            slots.len() - 1
        });
        let events = &mut slots[slot];
        let merged = match (events.pop(), event) {
            (None, e) => vec![e],
            (
                Some(Event::Added {
                    is_in_initial_list, ..
                }),
                Event::Updated { new, .. },
            ) => {
                vec![Event::Added {
                    object: new,
                    is_in_initial_list,
                }]
            }
            (
                Some(Event::Added {
                    is_in_initial_list, ..
                }),
                Event::Deleted(_),
            ) => {
                removed_initial += usize::from(is_in_initial_list);
                vec![]
            }
            (Some(Event::Updated { old, .. }), Event::Updated { new, .. }) => {
                vec![Event::Updated { old, new }]
            }
            (Some(Event::Updated { .. }), Event::Deleted(d)) => vec![Event::Deleted(d)],
            (Some(prev), next) => vec![prev, next],
        };
        events.extend(merged);
    }
    queue.extend(slots.into_iter().flatten());
    removed_initial
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::informer::handler::DeletedObject;
    use crate::object::Object;

    fn o(key: &str, rev: i64) -> Arc<crate::object::Object<i64>> {
        Arc::new(Object::new(key, rev, rev))
    }

    #[test]
    fn compaction_keeps_every_final_state() {
        let mut q = VecDeque::from(vec![
            Event::Added {
                object: o("a", 1),
                is_in_initial_list: true,
            },
            Event::Updated {
                old: o("b", 1),
                new: o("b", 2),
            },
            Event::Updated {
                old: o("a", 1),
                new: o("a", 3),
            },
            Event::Updated {
                old: o("b", 2),
                new: o("b", 4),
            },
            Event::Added {
                object: o("c", 5),
                is_in_initial_list: false,
            },
            Event::Deleted(DeletedObject::Deleted(o("c", 5))),
            Event::Deleted(DeletedObject::Deleted(o("b", 4))),
            Event::Added {
                object: o("b", 9),
                is_in_initial_list: false,
            },
        ]);
        let removed = compact(&mut q);
        assert_eq!(removed, 0);
        let got: Vec<String> = q
            .iter()
            .map(|e| match e {
                Event::Added { object, .. } => {
                    format!("add {} {}", object.key(), object.mod_revision)
                }
                Event::Updated { old, new } => {
                    format!(
                        "update {} {}->{}",
                        new.key(),
                        old.mod_revision,
                        new.mod_revision
                    )
                }
                Event::Deleted(d) => format!("delete {} {}", d.key(), d.object().mod_revision),
            })
            .collect();
        assert_eq!(got, ["add a 3", "delete b 4", "add b 9"]);
    }
}

/// When the events of a handler's backlog were applied to the cache, one entry per apply
/// rather than a timestamp per event: the cache-to-handler latency at the cost of a clock read
/// per apply and per delivery (metrics only).
///
/// Invariant: entry `(n, at)` says the events numbered up to `n` (counting every event ever
/// pushed) from the previous entry on were applied at `at`; `taken` counts the events taken.
#[derive(Default)]
pub(super) struct Arrivals {
    applies: VecDeque<(u64, Option<Instant>)>,
    pushed: u64,
    taken: u64,
}

impl Arrivals {
    /// One event was queued, applied at `at` (`None`: not timed).
    pub(super) fn pushed(&mut self, at: Option<Instant>) {
        self.pushed += 1;
        match self.applies.back_mut() {
            Some((n, last)) if *last == at => *n = self.pushed,
            _ => self.applies.push_back((self.pushed, at)),
        }
    }

    /// The next event was taken: when it was applied, if timed.
    pub(super) fn taken(&mut self) -> Option<Instant> {
        self.taken += 1;
        while self.applies.front().is_some_and(|(n, _)| *n < self.taken) {
            self.applies.pop_front();
        }
        self.applies.front().and_then(|(_, at)| *at)
    }

    /// The backlog now holds `left` events (merged or cleared): the next is counted as
    /// applied with the oldest apply that was still due, so merging never hides a wait.
    pub(super) fn shrunk(&mut self, left: usize) {
        let oldest = self
            .applies
            .iter()
            .find(|(n, _)| *n > self.taken)
            .and_then(|(_, at)| *at);
        self.taken = self.pushed - left as u64;
        while self.applies.front().is_some_and(|(n, _)| *n <= self.taken) {
            self.applies.pop_front();
        }
        if let (Some(front), Some(oldest)) = (self.applies.front_mut(), oldest) {
            front.1 = Some(oldest);
        }
    }
}

#[cfg(test)]
mod arrival_tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn each_event_is_timed_from_its_own_apply() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_millis(5);
        let mut a = Arrivals::default();
        a.pushed(Some(t0));
        a.pushed(Some(t0));
        a.pushed(Some(t1));
        a.pushed(None);
        assert_eq!(a.taken(), Some(t0));
        assert_eq!(a.taken(), Some(t0));
        assert_eq!(a.taken(), Some(t1));
        assert_eq!(a.taken(), None);
        assert_eq!(a.applies.len(), 1, "bounded by what is queued");
    }

    #[test]
    fn a_merged_backlog_keeps_the_oldest_wait() {
        let t0 = Instant::now();
        let mut a = Arrivals::default();
        for i in 0..10 {
            a.pushed(Some(t0 + Duration::from_millis(i)));
        }
        assert_eq!(a.taken(), Some(t0));
        // Nine left, merged down to three: the next is timed from the oldest still due.
        a.shrunk(3);
        assert_eq!(a.taken(), Some(t0 + Duration::from_millis(1)));
    }
}
