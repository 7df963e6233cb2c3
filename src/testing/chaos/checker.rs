//! The history checker: what handlers were told, checked against etcd's own history (order
//! per key, no duplicate, deletes with the last object, tombstones only after a relist), and
//! the final cache against etcd.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::informer::ResourceEventHandlerFuncs;
use crate::object::Object;
use crate::sync::lock;

/// `(mod_revision, value)` of a key: what the cache and etcd are compared on.
pub(super) type State = BTreeMap<String, (i64, String)>;

/// The store epoch written into every value (`e<epoch>-...`): 0 for the first store, bumped at
/// every wipe, so that order survives revisions starting over.
pub(super) fn epoch_of(value: &str) -> u64 {
    value
        .strip_prefix('e')
        .and_then(|rest| rest.split('-').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Seen {
    pub(super) revision: i64,
    pub(super) value: String,
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
pub(super) enum Kind {
    Add(Seen),
    Update { old: Seen, new: Seen },
    Delete { last: Seen, tombstone: bool },
}

/// One notification as the handler received it.
#[derive(Debug, Clone)]
pub(super) struct Recorded {
    pub(super) key: String,
    pub(super) kind: Kind,
    /// How many lists the informer had started when the handler received it.
    pub(super) lists: usize,
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

pub(super) type History = Arc<Mutex<Vec<Recorded>>>;

/// A handler recording every notification with the number of lists made so far.
pub(super) fn recorder(
    history: &History,
    lists: &Arc<AtomicUsize>,
) -> ResourceEventHandlerFuncs<String> {
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
pub(super) struct KeyState {
    /// The last object delivered (kept after a delete, for ordering).
    pub(super) last: Seen,
    pub(super) present: bool,
}

/// Checks the recorded history incrementally; see the module docs for the rules.
#[derive(Debug, Default)]
pub(super) struct Checker {
    /// Events of the history already checked.
    pub(super) checked: usize,
    pub(super) keys: HashMap<String, KeyState>,
}

impl Checker {
    /// Checks the events recorded since the last call; returns the violations found.
    pub(super) fn advance(&mut self, history: &History) -> Vec<String> {
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
    pub(super) fn final_mismatches(&self, etcd: &State) -> Vec<String> {
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

/// One line per key whose `(mod_revision, value)` differs between the cache and etcd.
pub(super) fn diff(cache: &State, etcd: &State) -> String {
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
}
