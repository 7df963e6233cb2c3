//! The audit: every so often, etcd's keys and `mod_revision`s at the cache's revision compared
//! key by key with the cache, so that an event the watch lost (etcd 3.4.23 loses a delete a
//! compaction lands on, and can lose events after one) is found within a period instead of at
//! the next relist, hours later. A difference is repaired by a relist: it reads the prefix
//! again, decodes only the keys whose `mod_revision` changed, and tells handlers of each
//! difference as of any change, keeping the cache etcd at one revision throughout (applying a
//! single key read now would not).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::listwatch::etcd::key_bytes;
use crate::listwatch::ListerWatcher;
use crate::listwatch::SourceCapabilities;
use crate::metrics::{AuditMetrics, AuditResult as Outcome};
use crate::sync::lock;

/// A key on which the cache and etcd disagree at the audited revision.
#[derive(Debug)]
struct Difference {
    key: Box<str>,
    cached: Option<i64>,
    etcd: Option<i64>,
}

/// The cache's keys at the audited revision, walked in key order beside etcd's pages.
struct Compare {
    cached: std::vec::IntoIter<(Box<str>, i64)>,
    next: Option<(Box<str>, i64)>,
    differences: Vec<Difference>,
    /// Differences past this many are counted, not kept.
    kept: usize,
    found: usize,
}

impl Compare {
    fn new(cached: Vec<(Box<str>, i64)>) -> Self {
        let mut cached = cached.into_iter();
        let next = cached.next();
        Compare {
            cached,
            next,
            differences: Vec::new(),
            kept: 10,
            found: 0,
        }
    }

    fn differ(&mut self, key: &str, cached: Option<i64>, etcd: Option<i64>) {
        self.found += 1;
        if self.differences.len() < self.kept {
            self.differences.push(Difference {
                key: key.into(),
                cached,
                etcd,
            });
        }
    }

    /// One of etcd's keys, in key order.
    fn etcd(&mut self, key: &str, revision: i64) {
        while let Some((cached, cached_revision)) = self.next.take() {
            let order = etcd_order(&cached, key);
            if order == std::cmp::Ordering::Less {
                self.differ(&cached, Some(cached_revision), None);
                self.next = self.cached.next();
                continue;
            }
            if order == std::cmp::Ordering::Equal {
                if cached_revision != revision {
                    self.differ(key, Some(cached_revision), Some(revision));
                }
                self.next = self.cached.next();
            } else {
                self.differ(key, None, Some(revision));
                self.next = Some((cached, cached_revision));
            }
            return;
        }
        self.differ(key, None, Some(revision));
    }

    /// etcd has no more keys: the cache's others are extra.
    fn finish(&mut self) {
        while let Some((cached, revision)) = self.next.take() {
            self.differ(&cached, Some(revision), None);
            self.next = self.cached.next();
        }
    }
}

/// etcd's order of two keys as a source gives them: a key the cache server's source carries
/// escaped (not UTF-8) sorts by its bytes, as etcd sorts it, not by its escaped text.
fn etcd_order(a: &str, b: &str) -> std::cmp::Ordering {
    key_bytes(a).cmp(&key_bytes(b))
}

/// The cache's keys (relative to the prefix, in key order) and their `mod_revision`s, and the
/// revision it holds them at.
pub(crate) type CachedKeys = Box<dyn Fn() -> (i64, Vec<(Box<str>, i64)>) + Send + Sync>;

/// What the audit needs of its cache: an informer's (handed over by the informer's `run`, so
/// that this file stays below the informer's) or a cache server prefix's.
pub(crate) struct Audited<T> {
    pub(crate) name: String,
    pub(crate) cached: CachedKeys,
    pub(crate) source: Arc<dyn ListerWatcher<T>>,
    pub(crate) metrics: AuditMetrics,
    pub(crate) counts: Arc<AuditCounts>,
    /// The reflector's relist count while the cache may be audited (synced, the watch open,
    /// nothing queued); `None` otherwise.
    pub(crate) ready: Box<dyn Fn() -> Option<u64> + Send + Sync>,
    /// Asks the reflector to relist.
    pub(crate) relist: Arc<Notify>,
    /// The relist count when this audit last asked for a relist: until it moves, the repair is
    /// under way and another audit would only find the same differences.
    pub(crate) asked_at: Mutex<Option<u64>>,
    /// Held while an audit runs: the periodic one and `audit_now` never run at once (the
    /// second waits, then audits the cache as it is then).
    pub(crate) running: tokio::sync::Mutex<()>,
}

impl<T: Send + Sync + 'static> Audited<T> {
    /// Audits every `period`; runs until dropped (its owner aborts it).
    pub(crate) async fn every(self: Arc<Self>, period: Duration) {
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.once().await;
        }
    }

    /// Audits the cache once (see the [module docs](self)) and counts it.
    pub(crate) async fn once(&self) -> Option<AuditReport> {
        let _one_at_a_time = self.running.lock().await;
        let (outcome, report) = self.compare().await;
        self.counts.ran(outcome);
        self.metrics.audit(outcome);
        report
    }

    async fn compare(&self) -> (Outcome, Option<AuditReport>) {
        let Some(relists) = (self.ready)() else {
            return (Outcome::Skipped, None);
        };
        {
            let mut asked_at = lock(&self.asked_at);
            if *asked_at == Some(relists) {
                return (Outcome::Skipped, None);
            }
            *asked_at = None;
        }
        let started = Instant::now();
        let (at, cached) = (self.cached)();
        let keys = cached.len();
        let compare = Arc::new(Mutex::new(Compare::new(cached)));
        let sink = compare.clone();
        let read = self
            .source
            .key_revisions(
                at,
                Box::new(move |page| {
                    let mut compare = lock(&sink);
                    for (key, revision) in page {
                        compare.etcd(&key, revision);
                    }
                }),
            )
            .await;
        let name = &self.name;
        match read {
            Ok(()) => {}
            Err(e) if e.is_expired() => {
                tracing::debug!(informer = %name, revision = at, error = %e, "audit skipped: the cache's revision is compacted");
                return (Outcome::Skipped, None);
            }
            Err(e) => {
                tracing::warn!(informer = %name, revision = at, error = %e, "audit failed");
                return (Outcome::Failed, None);
            }
        }
        if (self.ready)() != Some(relists) {
            // The cache was relisted meanwhile: what was read compares with nothing.
            return (Outcome::Skipped, None);
        }
        let mut compare = lock(&compare);
        compare.finish();
        let took = started.elapsed();
        let report = AuditReport {
            revision: at,
            keys,
            differing: compare.found,
            took,
        };
        if compare.found == 0 {
            tracing::debug!(informer = %name, revision = at, keys, ?took, "audit: the cache agrees with etcd");
            return (Outcome::Clean, Some(report));
        }
        for d in &compare.differences {
            tracing::warn!(
                informer = %name,
                key = %d.key,
                revision = at,
                cached_mod_revision = ?d.cached,
                etcd_mod_revision = ?d.etcd,
                "audit: the cache differs from etcd (an event was lost); relisting to repair it"
            );
        }
        if compare.found > compare.differences.len() {
            tracing::warn!(informer = %name, revision = at, more = compare.found - compare.differences.len(), "audit: more keys differ");
        }
        self.counts.repaired(compare.found as u64);
        self.metrics.audit_repairs(compare.found as u64);
        *lock(&self.asked_at) = Some(relists);
        self.relist.notify_one();
        (Outcome::Repaired, Some(report))
    }
}

/// What one audit found ([`SharedIndexInformer::audit_now`](crate::SharedIndexInformer::audit_now)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct AuditReport {
    /// The revision compared at: the cache's, or a later one a consistent read proved.
    pub revision: i64,
    /// The keys the cache held.
    pub keys: usize,
    /// Keys on which the cache and etcd differed; a relist repairs them.
    pub differing: usize,
    /// How long the audit took.
    pub took: Duration,
}

/// What the audits found, for [`InformerHealth`](super::InformerHealth).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AuditHealth {
    /// Audits that compared the whole cache with etcd.
    pub completed: u64,
    /// Audits skipped (not synced, a relist running, changes queued, the revision compacted).
    pub skipped: u64,
    /// Audits that could not read etcd.
    pub failed: u64,
    /// Keys found to differ from etcd, each repaired by a relist.
    pub repairs: u64,
}

/// [`AuditHealth`], updated by the audit task.
#[derive(Default)]
pub(crate) struct AuditCounts(Mutex<AuditHealth>);

impl AuditCounts {
    pub(crate) fn ran(&self, outcome: Outcome) {
        let mut h = lock(&self.0);
        match outcome {
            Outcome::Clean | Outcome::Repaired => h.completed += 1,
            Outcome::Skipped => h.skipped += 1,
            Outcome::Failed => h.failed += 1,
        }
    }

    fn repaired(&self, keys: u64) {
        lock(&self.0).repairs += keys;
    }

    pub(crate) fn get(&self) -> AuditHealth {
        *lock(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(k: &[(&str, i64)]) -> Vec<(Box<str>, i64)> {
        k.iter().map(|(k, r)| ((*k).into(), *r)).collect()
    }

    #[test]
    fn every_kind_of_difference_is_found_in_one_walk() {
        let mut c = Compare::new(keys(&[("a", 1), ("b", 2), ("d", 4), ("z", 9)]));
        for (k, r) in [("a", 1), ("b", 3), ("c", 3), ("d", 4)] {
            c.etcd(k, r);
        }
        c.finish();
        let found: Vec<_> = c
            .differences
            .iter()
            .map(|d| (&*d.key, d.cached, d.etcd))
            .collect();
        assert_eq!(
            found,
            [
                ("b", Some(2), Some(3)),
                ("c", None, Some(3)),
                ("z", Some(9), None)
            ]
        );
    }

    #[test]
    fn agreement_finds_nothing_and_many_differences_are_counted() {
        let mut c = Compare::new(keys(&[("a", 1), ("b", 2)]));
        c.etcd("a", 1);
        c.etcd("b", 2);
        c.finish();
        assert_eq!(c.found, 0);
        let mut c = Compare::new(Vec::new());
        for i in 0..100 {
            c.etcd(&format!("k{i:03}"), i);
        }
        c.finish();
        assert_eq!((c.found, c.differences.len()), (100, 10));
    }
}
