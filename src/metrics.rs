//! Metrics through the [`metrics`](https://docs.rs/metrics) facade (cargo feature `metrics`):
//! install any recorder (e.g. `metrics-exporter-prometheus`) and every informer, handler, work
//! queue, runner and elector reports into it. Without the feature every call here is a no-op on
//! a zero-sized handle, so nothing is allocated or counted.
//!
//! Handles are registered once (per informer, handler, queue, runner, elector) and updated with
//! plain atomic operations afterwards: no metric call allocates per event.
//!
//! | metric | type | labels | moves when |
//! | --- | --- | --- | --- |
//! | `etcd_informer_events_total` | counter | `informer`, `kind` (added, updated, deleted) | a change is applied to the cache (resyncs excluded) |
//! | `etcd_informer_relists_total` | counter | `informer`, `reason` (initial, compacted, store_replaced, error, audit) | the reflector lists: first list, watched revision compacted, store wiped or restored (or the key tally differed), restart after a panic, the audit found a difference |
//! | `etcd_informer_audits_total` | counter | `informer`, `result` (clean, repaired, skipped, failed) | an audit of the cache against etcd ends |
//! | `etcd_informer_audit_repairs_total` | counter | `informer` | an audit finds keys whose `mod_revision` differs from etcd's (an event lost), repaired by a relist |
//! | `etcd_informer_decode_errors_total` | counter | `informer` | a value under the prefix does not decode (sampled every second) |
//! | `etcd_informer_applied_revision` | gauge | `informer` | the cache reaches a new revision (sampled every second) |
//! | `etcd_informer_revision_lag` | gauge | `informer` | revisions the reflector has read and the cache has not applied yet (sampled every second) |
//! | `etcd_informer_seconds_since_proven_fresh` | gauge | `informer` | seconds since the source last proved the cache fresh: a list, an event, or an answered probe of the watch stream (sampled every second; alert above the source's idle timeout, 2 s by default) |
//! | `etcd_informer_stage_seconds` | histogram | `informer`, `stage` (watch_to_cache; cache_to_handler, also `handler`; cache_to_watcher) | a change passes a stage of the path: from the etcd watch task receiving its response to the cache applying it (revision-atomic mode), from the cache applying it to a handler (or event stream) starting on it, and, in the cache server (`informer` = its prefixes), from its cache applying a revision to the watch response carrying it being handed to each client's stream |
//! | `etcd_informer_queue_depth` | gauge | `informer` | batches (RealFifo) or keys (DeltaFifo) queued between reflector and cache (sampled every second) |
//! | `etcd_informer_handler_backlog` | gauge | `informer`, `handler` | notifications queued for a handler (or an event stream) and not delivered |
//! | `etcd_informer_handler_delivered_total` | counter | `informer`, `handler` | a notification is delivered |
//! | `etcd_informer_handler_panics_total` | counter | `informer`, `handler` | a handler panics on a notification |
//! | `etcd_informer_workqueue_depth` | gauge | `name` | keys waiting in a work queue |
//! | `etcd_informer_workqueue_adds_total` | counter | `name` | a key is added (not counting adds of a key already waiting) |
//! | `etcd_informer_workqueue_queue_duration_seconds` | histogram | `name` | a key is handed out: how long it waited |
//! | `etcd_informer_workqueue_work_duration_seconds` | histogram | `name` | a key is done: how long it was processed |
//! | `etcd_informer_workqueue_retries_total` | counter | `name` | a key is re-added with backoff |
//! | `etcd_informer_workqueue_unfinished_work_seconds` | gauge | `name` | sum of how long the keys in processing have been processing (runner: every second) |
//! | `etcd_informer_workqueue_longest_running_processor_seconds` | gauge | `name` | how long the oldest key in processing has been processing (runner: every second) |
//! | `etcd_informer_reconciles_total` | counter | `runner`, `result` (ok, error, panic, timeout) | a reconcile ends |
//! | `etcd_informer_reconcile_duration_seconds` | histogram | `runner` | a reconcile ends |
//! | `etcd_informer_runner_synced` | gauge | `runner` | 1 once every watched informer has synced and workers run, 0 while waiting |
//! | `etcd_informer_leader_is_leader` | gauge | `election`, `identity` | 1 while this candidate leads |
//! | `etcd_informer_leader_transitions_total` | counter | `election`, `identity` | this candidate starts or stops leading |
//! | `etcd_informer_shards_held` | gauge | `runner`, `member` | a sharded runner's replica gains or gives up a shard |
//! | `etcd_informer_shard_handoffs_total` | counter | `runner`, `member`, `direction` (acquired, released, lost) | a shard changes hands: taken over, handed over after its reconciles ended, or dropped with the lease |
//! | `etcd_informer_shard_handoff_seconds` | histogram | `runner`, `member`, `direction` (acquired, released) | a shard changes hands: from when this replica was assigned it (acquired) or told to give it up (released) until its owner record says so |
//! | `etcd_informer_server_watch_streams` | gauge | `prefix` (the server's prefixes, comma-separated) | a cache server's open watch streams (sampled every second) |
//! | `etcd_informer_server_watches` | gauge | `prefix` (one served prefix) | watches a cache server serves from its cache (sampled every second) |
//! | `etcd_informer_server_events_sent_total` | counter | `prefix` (one served prefix) | events a cache server sent to its watches (sampled every second) |
//! | `etcd_informer_server_slow_watch_forwards_total` | counter | `prefix` (one served prefix) | watches forwarded to etcd because the history no longer reached back to them (sampled every second) |
//! | `etcd_informer_server_watches_taken_back_total` | counter | `prefix` (one served prefix) | forwarded watches (slow ones, or created below the history) served from the cache again once etcd had caught them up (sampled every second) |
//! | `etcd_informer_server_ranges_total` | counter | `prefix` (one served prefix) | Ranges a cache server answered from its cache (sampled every second) |
//! | `etcd_informer_server_forwarded_total` | counter | `prefix` (the server's prefixes, comma-separated) | requests a cache server forwarded to etcd, passed-through Lease, Maintenance and Auth calls not counted (sampled every second) |
//! | `etcd_informer_server_forwarded_watches` | gauge | `prefix` (the server's prefixes, comma-separated) | watches a cache server forwards to etcd now, each an upstream stream (sampled every second) |
//! | `etcd_informer_server_forwarded_watches_refused_total` | counter | `prefix` (the server's prefixes, comma-separated) | watch creates refused, and slow watches cancelled, for the cap on forwarded watches (sampled every second) |
//! | `etcd_informer_server_history_revisions` | gauge | `prefix` (one served prefix) | revisions of history a cache server keeps (sampled every second) |
//! | `etcd_informer_server_history_bytes` | gauge | `prefix` (one served prefix) | bytes of history a cache server keeps (sampled every second) |
//! | `etcd_informer_server_seconds_since_proven_fresh` | gauge | `prefix` (one served prefix) | seconds since a cache server's list and watch last proved its cache fresh (sampled every second) |
//!
//! Work-queue metrics are client-go's (`workqueue_*`), labelled by the queue's name; a
//! [`Runner`](crate::runner::Runner)'s queue is named after the runner. Handlers are named
//! `<informer>#<id>`, or as given to
//! [`add_named_event_handler`](crate::SharedIndexInformer::add_named_event_handler) (the runner
//! names its handlers after itself).

use std::time::Duration;

#[cfg(feature = "metrics")]
use ::metrics::{Counter, Gauge, Histogram};

#[cfg(not(feature = "metrics"))]
use noop::{Counter, Gauge, Histogram};

/// Registers a description (the `# HELP` line) for every metric of this crate with the
/// installed recorder. Call it once, after installing the recorder. A no-op without the
/// `metrics` feature.
pub fn describe() {
    #[cfg(feature = "metrics")]
    {
        use ::metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
        describe_counter!(
            "etcd_informer_events_total",
            "Changes applied to an informer's cache, by kind (resyncs excluded)."
        );
        describe_counter!(
            "etcd_informer_relists_total",
            "Lists made by a reflector, by reason (initial, compacted, store_replaced, error, audit)."
        );
        describe_counter!(
            "etcd_informer_audits_total",
            "Audits of an informer's cache against etcd, by result (clean, repaired, skipped, failed)."
        );
        describe_counter!(
            "etcd_informer_audit_repairs_total",
            "Keys an audit found differing from etcd (a lost event), each repaired by a relist."
        );
        describe_counter!(
            "etcd_informer_decode_errors_total",
            "Values under an informer's prefix that did not decode."
        );
        describe_gauge!(
            "etcd_informer_applied_revision",
            "The etcd revision an informer's cache is at."
        );
        describe_gauge!(
            "etcd_informer_revision_lag",
            "Revisions the reflector has read that the cache has not applied yet."
        );
        describe_gauge!(
            "etcd_informer_seconds_since_proven_fresh",
            Unit::Seconds,
            "Seconds since the source last proved an informer's cache fresh (a list, an event, an answered probe of its watch)."
        );
        describe_histogram!(
            "etcd_informer_stage_seconds",
            Unit::Seconds,
            "Time a change spends on a stage of its path, by stage: watch_to_cache (the etcd watch task received it -> the cache applied it), cache_to_handler (applied -> a handler started on it)."
        );
        describe_gauge!(
            "etcd_informer_queue_depth",
            "Batches (RealFifo) or keys (DeltaFifo) queued between the reflector and the cache."
        );
        describe_gauge!(
            "etcd_informer_handler_backlog",
            "Notifications queued for a handler and not delivered yet."
        );
        describe_counter!(
            "etcd_informer_handler_delivered_total",
            "Notifications delivered to a handler."
        );
        describe_counter!(
            "etcd_informer_handler_panics_total",
            "Notifications whose handler panicked."
        );
        describe_gauge!(
            "etcd_informer_workqueue_depth",
            "Keys waiting in a work queue."
        );
        describe_counter!(
            "etcd_informer_workqueue_adds_total",
            "Keys added to a work queue."
        );
        describe_histogram!(
            "etcd_informer_workqueue_queue_duration_seconds",
            Unit::Seconds,
            "How long a key waited in a work queue before being handed out."
        );
        describe_histogram!(
            "etcd_informer_workqueue_work_duration_seconds",
            Unit::Seconds,
            "How long processing a key took."
        );
        describe_counter!(
            "etcd_informer_workqueue_retries_total",
            "Keys re-added to a work queue with backoff."
        );
        describe_gauge!(
            "etcd_informer_workqueue_unfinished_work_seconds",
            Unit::Seconds,
            "Sum of how long the keys in processing have been processing."
        );
        describe_gauge!(
            "etcd_informer_workqueue_longest_running_processor_seconds",
            Unit::Seconds,
            "How long the oldest key in processing has been processing."
        );
        describe_counter!(
            "etcd_informer_reconciles_total",
            "Reconciles, by result (ok, error, panic, timeout)."
        );
        describe_histogram!(
            "etcd_informer_reconcile_duration_seconds",
            Unit::Seconds,
            "How long reconciles took."
        );
        describe_gauge!(
            "etcd_informer_runner_synced",
            "1 once every informer a runner watches has synced, 0 while it waits."
        );
        describe_gauge!(
            "etcd_informer_leader_is_leader",
            "1 while this candidate leads its election."
        );
        describe_counter!(
            "etcd_informer_leader_transitions_total",
            "Times this candidate started or stopped leading."
        );
        describe_gauge!(
            "etcd_informer_shards_held",
            "Shards this replica of a sharded runner holds."
        );
        describe_gauge!(
            "etcd_informer_server_watch_streams",
            "Open watch streams of a cache server."
        );
        describe_gauge!(
            "etcd_informer_server_watches",
            "Watches a cache server serves from its cache."
        );
        describe_counter!(
            "etcd_informer_server_events_sent_total",
            "Events a cache server sent to its watches."
        );
        describe_counter!(
            "etcd_informer_server_slow_watch_forwards_total",
            "Watches a cache server forwarded to etcd because its history no longer reached back to them."
        );
        describe_counter!(
            "etcd_informer_server_watches_taken_back_total",
            "Forwarded watches a cache server served from its cache again once etcd had caught them up."
        );
        describe_counter!(
            "etcd_informer_server_ranges_total",
            "Ranges a cache server answered from its cache."
        );
        describe_counter!(
            "etcd_informer_server_forwarded_total",
            "Requests a cache server forwarded to etcd."
        );
        describe_gauge!(
            "etcd_informer_server_forwarded_watches",
            "Watches a cache server forwards to etcd now, each an upstream stream."
        );
        describe_counter!(
            "etcd_informer_server_forwarded_watches_refused_total",
            "Watches a cache server refused or cancelled for its cap on forwarded watches."
        );
        describe_gauge!(
            "etcd_informer_server_history_revisions",
            "Revisions of history a cache server keeps."
        );
        describe_gauge!(
            "etcd_informer_server_history_bytes",
            Unit::Bytes,
            "Bytes of history a cache server keeps."
        );
        describe_gauge!(
            "etcd_informer_server_seconds_since_proven_fresh",
            Unit::Seconds,
            "Seconds since a cache server's list and watch last proved its cache fresh."
        );
        describe_counter!(
            "etcd_informer_shard_handoffs_total",
            "Shards acquired, released, or lost with the lease."
        );
        describe_histogram!(
            "etcd_informer_shard_handoff_seconds",
            Unit::Seconds,
            "From a shard's assignment (or unassignment) to its owner record saying so."
        );
    }
}

/// Zero-sized stand-ins for the `metrics` handles when the feature is off.
#[cfg(not(feature = "metrics"))]
mod noop {
    #[derive(Clone, Default)]
    pub(crate) struct Counter;
    impl Counter {
        pub(crate) fn increment(&self, _: u64) {}
        pub(crate) fn absolute(&self, _: u64) {}
    }

    #[derive(Clone, Default)]
    pub(crate) struct Gauge;
    impl Gauge {
        pub(crate) fn set(&self, _: f64) {}
    }

    #[derive(Clone, Default)]
    pub(crate) struct Histogram;
    impl Histogram {
        pub(crate) fn record(&self, _: f64) {}
    }
}

/// `counter!`, `gauge!` and `histogram!` with the feature.
#[cfg(feature = "metrics")]
macro_rules! handle {
    ($kind:ident, $name:literal $(, $label:literal => $value:expr)*) => {
        ::metrics::$kind!($name $(, $label => $value)*)
    };
}

/// A zero-sized handle without the feature (the label expressions are not evaluated).
#[cfg(not(feature = "metrics"))]
macro_rules! handle {
    ($kind:ident, $name:literal $(, $label:literal => $value:expr)*) => {
        Default::default()
    };
}

/// Whether metrics are compiled in: guards work done only to compute a metric.
pub(crate) const ENABLED: bool = cfg!(feature = "metrics");

/// The `kind` of an applied change.
#[derive(Debug, Clone, Copy)]
pub(crate) enum EventKind {
    Added,
    Updated,
    Deleted,
}

/// The audits of one cache (an informer's, or a cache server prefix's: `informer` is the
/// reflector's name).
#[derive(Clone)]
pub(crate) struct AuditMetrics {
    clean: Counter,
    repaired: Counter,
    skipped: Counter,
    failed: Counter,
    repairs: Counter,
}

impl AuditMetrics {
    pub(crate) fn new(informer: &str) -> Self {
        let _ = informer;
        AuditMetrics {
            clean: handle!(counter, "etcd_informer_audits_total", "informer" => informer.to_owned(), "result" => "clean"),
            repaired: handle!(counter, "etcd_informer_audits_total", "informer" => informer.to_owned(), "result" => "repaired"),
            skipped: handle!(counter, "etcd_informer_audits_total", "informer" => informer.to_owned(), "result" => "skipped"),
            failed: handle!(counter, "etcd_informer_audits_total", "informer" => informer.to_owned(), "result" => "failed"),
            repairs: handle!(counter, "etcd_informer_audit_repairs_total", "informer" => informer.to_owned()),
        }
    }

    /// An audit ended so.
    pub(crate) fn audit(&self, result: AuditResult) {
        match result {
            AuditResult::Clean => self.clean.increment(1),
            AuditResult::Repaired => self.repaired.increment(1),
            AuditResult::Skipped => self.skipped.increment(1),
            AuditResult::Failed => self.failed.increment(1),
        }
    }

    /// An audit found `keys` keys differing from etcd.
    pub(crate) fn audit_repairs(&self, keys: u64) {
        self.repairs.increment(keys);
    }
}

/// One informer's metrics.
#[derive(Clone)]
pub(crate) struct InformerMetrics {
    added: Counter,
    updated: Counter,
    deleted: Counter,
    decode_errors: Counter,
    applied_revision: Gauge,
    revision_lag: Gauge,
    queue_depth: Gauge,
    since_proven_fresh: Gauge,
    watch_to_cache: Histogram,
}

impl InformerMetrics {
    pub(crate) fn new(informer: &str) -> Self {
        let _ = informer;
        InformerMetrics {
            added: handle!(counter, "etcd_informer_events_total", "informer" => informer.to_owned(), "kind" => "added"),
            updated: handle!(counter, "etcd_informer_events_total", "informer" => informer.to_owned(), "kind" => "updated"),
            deleted: handle!(counter, "etcd_informer_events_total", "informer" => informer.to_owned(), "kind" => "deleted"),
            decode_errors: handle!(counter, "etcd_informer_decode_errors_total", "informer" => informer.to_owned()),
            applied_revision: handle!(gauge, "etcd_informer_applied_revision", "informer" => informer.to_owned()),
            revision_lag: handle!(gauge, "etcd_informer_revision_lag", "informer" => informer.to_owned()),
            queue_depth: handle!(gauge, "etcd_informer_queue_depth", "informer" => informer.to_owned()),
            since_proven_fresh: handle!(gauge, "etcd_informer_seconds_since_proven_fresh", "informer" => informer.to_owned()),
            watch_to_cache: handle!(histogram, "etcd_informer_stage_seconds", "informer" => informer.to_owned(), "stage" => "watch_to_cache"),
        }
    }

    /// A revision the watch task received at `received` is applied to the cache now.
    pub(crate) fn applied(&self, received: std::time::Instant) {
        self.watch_to_cache.record(received.elapsed().as_secs_f64());
    }

    pub(crate) fn event(&self, kind: EventKind) {
        self.events(kind, 1);
    }

    /// `n` events of one kind.
    pub(crate) fn events(&self, kind: EventKind, n: u64) {
        match kind {
            EventKind::Added => self.added.increment(n),
            EventKind::Updated => self.updated.increment(n),
            EventKind::Deleted => self.deleted.increment(n),
        }
    }

    /// Publishes what is sampled: revisions, queue depth, the source's decode errors, and
    /// seconds since the cache was last proven fresh (`None`: never yet).
    pub(crate) fn sample(
        &self,
        applied: i64,
        last_synced: i64,
        queued: usize,
        decode_errors: u64,
        since_proven_fresh: Option<f64>,
    ) {
        if let Some(seconds) = since_proven_fresh {
            self.since_proven_fresh.set(seconds);
        }
        self.applied_revision.set(applied as f64);
        self.revision_lag
            .set(last_synced.saturating_sub(applied).max(0) as f64);
        self.queue_depth.set(queued as f64);
        self.decode_errors.absolute(decode_errors);
    }
}

/// How an audit of the cache against etcd ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AuditResult {
    /// The cache agreed with etcd.
    Clean,
    /// Differences were found, and a relist asked for.
    Repaired,
    /// Not a moment to audit (not synced, a relist running, changes queued, the revision
    /// compacted): tried again next period.
    Skipped,
    /// The source could not be read.
    Failed,
}

/// Why a reflector listed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RelistReason {
    Initial,
    Compacted,
    StoreReplaced,
    Error,
    Audit,
}

/// A reflector's relists, by reason.
pub(crate) struct RelistMetrics {
    initial: Counter,
    compacted: Counter,
    store_replaced: Counter,
    error: Counter,
    audit: Counter,
}

impl RelistMetrics {
    pub(crate) fn new(informer: &str) -> Self {
        let _ = informer;
        RelistMetrics {
            initial: handle!(counter, "etcd_informer_relists_total", "informer" => informer.to_owned(), "reason" => "initial"),
            compacted: handle!(counter, "etcd_informer_relists_total", "informer" => informer.to_owned(), "reason" => "compacted"),
            store_replaced: handle!(counter, "etcd_informer_relists_total", "informer" => informer.to_owned(), "reason" => "store_replaced"),
            error: handle!(counter, "etcd_informer_relists_total", "informer" => informer.to_owned(), "reason" => "error"),
            audit: handle!(counter, "etcd_informer_relists_total", "informer" => informer.to_owned(), "reason" => "audit"),
        }
    }

    pub(crate) fn relisted(&self, reason: RelistReason) {
        match reason {
            RelistReason::Initial => self.initial.increment(1),
            RelistReason::Compacted => self.compacted.increment(1),
            RelistReason::StoreReplaced => self.store_replaced.increment(1),
            RelistReason::Error => self.error.increment(1),
            RelistReason::Audit => self.audit.increment(1),
        }
    }
}

/// One handler's (or event stream's) metrics.
pub(crate) struct HandlerMetrics {
    pub(crate) backlog: Gauge,
    pub(crate) delivered: Counter,
    pub(crate) panics: Counter,
    /// From the cache applying a change to this handler starting on it.
    pub(crate) cache_to_handler: Histogram,
}

impl HandlerMetrics {
    pub(crate) fn new(informer: &str, handler: &str) -> Self {
        let _ = (informer, handler);
        HandlerMetrics {
            backlog: handle!(gauge, "etcd_informer_handler_backlog", "informer" => informer.to_owned(), "handler" => handler.to_owned()),
            delivered: handle!(counter, "etcd_informer_handler_delivered_total", "informer" => informer.to_owned(), "handler" => handler.to_owned()),
            panics: handle!(counter, "etcd_informer_handler_panics_total", "informer" => informer.to_owned(), "handler" => handler.to_owned()),
            cache_to_handler: handle!(histogram, "etcd_informer_stage_seconds", "informer" => informer.to_owned(), "stage" => "cache_to_handler", "handler" => handler.to_owned()),
        }
    }

    pub(crate) fn backlog(&self, len: usize) {
        self.backlog.set(len as f64);
    }
}

/// A work queue's metrics (client-go's workqueue metrics).
pub(crate) struct WorkQueueMetrics {
    pub(crate) depth: Gauge,
    pub(crate) adds: Counter,
    queue_duration: Histogram,
    work_duration: Histogram,
    pub(crate) retries: Counter,
    unfinished_work: Gauge,
    longest_running: Gauge,
}

impl WorkQueueMetrics {
    pub(crate) fn new(name: &str) -> Self {
        let _ = name;
        WorkQueueMetrics {
            depth: handle!(gauge, "etcd_informer_workqueue_depth", "name" => name.to_owned()),
            adds: handle!(counter, "etcd_informer_workqueue_adds_total", "name" => name.to_owned()),
            queue_duration: handle!(histogram, "etcd_informer_workqueue_queue_duration_seconds", "name" => name.to_owned()),
            work_duration: handle!(histogram, "etcd_informer_workqueue_work_duration_seconds", "name" => name.to_owned()),
            retries: handle!(counter, "etcd_informer_workqueue_retries_total", "name" => name.to_owned()),
            unfinished_work: handle!(gauge, "etcd_informer_workqueue_unfinished_work_seconds", "name" => name.to_owned()),
            longest_running: handle!(gauge, "etcd_informer_workqueue_longest_running_processor_seconds", "name" => name.to_owned()),
        }
    }

    pub(crate) fn depth(&self, len: usize) {
        self.depth.set(len as f64);
    }

    pub(crate) fn waited(&self, d: Duration) {
        self.queue_duration.record(d.as_secs_f64());
    }

    pub(crate) fn worked(&self, d: Duration) {
        self.work_duration.record(d.as_secs_f64());
    }

    pub(crate) fn in_flight(&self, unfinished: Duration, longest: Option<Duration>) {
        self.unfinished_work.set(unfinished.as_secs_f64());
        self.longest_running
            .set(longest.unwrap_or_default().as_secs_f64());
    }
}

/// How a reconcile ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReconcileResult {
    Ok,
    Error,
    Panic,
    Timeout,
}

/// A runner's metrics.
pub(crate) struct RunnerMetrics {
    ok: Counter,
    error: Counter,
    panic: Counter,
    timeout: Counter,
    duration: Histogram,
    pub(crate) synced: Gauge,
}

impl RunnerMetrics {
    pub(crate) fn new(runner: &str) -> Self {
        let _ = runner;
        RunnerMetrics {
            ok: handle!(counter, "etcd_informer_reconciles_total", "runner" => runner.to_owned(), "result" => "ok"),
            error: handle!(counter, "etcd_informer_reconciles_total", "runner" => runner.to_owned(), "result" => "error"),
            panic: handle!(counter, "etcd_informer_reconciles_total", "runner" => runner.to_owned(), "result" => "panic"),
            timeout: handle!(counter, "etcd_informer_reconciles_total", "runner" => runner.to_owned(), "result" => "timeout"),
            duration: handle!(histogram, "etcd_informer_reconcile_duration_seconds", "runner" => runner.to_owned()),
            synced: handle!(gauge, "etcd_informer_runner_synced", "runner" => runner.to_owned()),
        }
    }

    pub(crate) fn reconciled(&self, result: ReconcileResult, took: Duration) {
        match result {
            ReconcileResult::Ok => self.ok.increment(1),
            ReconcileResult::Error => self.error.increment(1),
            ReconcileResult::Panic => self.panic.increment(1),
            ReconcileResult::Timeout => self.timeout.increment(1),
        }
        self.duration.record(took.as_secs_f64());
    }

    pub(crate) fn synced(&self, synced: bool) {
        self.synced.set(if synced { 1.0 } else { 0.0 });
    }
}

/// A candidate's leadership state.
pub(crate) struct LeaderMetrics {
    is_leader: Gauge,
    transitions: Counter,
}

impl LeaderMetrics {
    pub(crate) fn new(election: &str, identity: &str) -> Self {
        let _ = (election, identity);
        LeaderMetrics {
            is_leader: handle!(gauge, "etcd_informer_leader_is_leader", "election" => election.to_owned(), "identity" => identity.to_owned()),
            transitions: handle!(counter, "etcd_informer_leader_transitions_total", "election" => election.to_owned(), "identity" => identity.to_owned()),
        }
    }

    /// This candidate started (`true`) or stopped leading.
    pub(crate) fn transition(&self, leading: bool) {
        self.is_leader.set(if leading { 1.0 } else { 0.0 });
        self.transitions.increment(1);
    }
}

/// Which way a shard changed hands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Handoff {
    Acquired,
    Released,
    Lost,
}

/// One replica's shard ownership.
pub(crate) struct ShardMetrics {
    held: Gauge,
    acquired: Counter,
    released: Counter,
    lost: Counter,
    acquire_seconds: Histogram,
    release_seconds: Histogram,
}

impl ShardMetrics {
    pub(crate) fn new(runner: &str, member: &str) -> Self {
        let _ = (runner, member);
        ShardMetrics {
            held: handle!(gauge, "etcd_informer_shards_held", "runner" => runner.to_owned(), "member" => member.to_owned()),
            acquired: handle!(counter, "etcd_informer_shard_handoffs_total", "runner" => runner.to_owned(), "member" => member.to_owned(), "direction" => "acquired"),
            released: handle!(counter, "etcd_informer_shard_handoffs_total", "runner" => runner.to_owned(), "member" => member.to_owned(), "direction" => "released"),
            lost: handle!(counter, "etcd_informer_shard_handoffs_total", "runner" => runner.to_owned(), "member" => member.to_owned(), "direction" => "lost"),
            acquire_seconds: handle!(histogram, "etcd_informer_shard_handoff_seconds", "runner" => runner.to_owned(), "member" => member.to_owned(), "direction" => "acquired"),
            release_seconds: handle!(histogram, "etcd_informer_shard_handoff_seconds", "runner" => runner.to_owned(), "member" => member.to_owned(), "direction" => "released"),
        }
    }

    /// `shards` shards changed hands this way; `took` is how long the handoff took, if timed.
    pub(crate) fn handoff(&self, direction: Handoff, shards: u64, took: Option<Duration>) {
        let (count, seconds) = match direction {
            Handoff::Acquired => (&self.acquired, Some(&self.acquire_seconds)),
            Handoff::Released => (&self.released, Some(&self.release_seconds)),
            Handoff::Lost => (&self.lost, None),
        };
        count.increment(shards);
        if let (Some(seconds), Some(took)) = (seconds, took) {
            seconds.record(took.as_secs_f64());
        }
    }

    pub(crate) fn held(&self, shards: usize) {
        self.held.set(shards as f64);
    }
}

/// A cache server's metrics (`serve`), sampled from its counters: the server's own, labelled
/// with its prefixes (comma-separated), and each served prefix's, labelled with that prefix.
#[cfg(feature = "server")]
pub(crate) struct ServerMetricHandles {
    streams: Gauge,
    forwarded: Counter,
    forwarded_watches: Gauge,
    forwarded_watches_refused: Counter,
    prefixes: Vec<PrefixMetricHandles>,
}

/// One served prefix's metrics.
#[cfg(feature = "server")]
struct PrefixMetricHandles {
    watches: Gauge,
    events: Counter,
    slow: Counter,
    taken_back: Counter,
    ranges: Counter,
    history_revisions: Gauge,
    history_bytes: Gauge,
    since_proven_fresh: Gauge,
}

/// The cache server's last stage: from its cache applying a revision to a watch response
/// carrying it being handed to the client's stream.
#[cfg(feature = "server")]
#[derive(Clone)]
pub(crate) struct ServerStage(Histogram);

#[cfg(feature = "server")]
impl ServerStage {
    pub(crate) fn new(prefix: &str) -> Self {
        let _ = prefix;
        ServerStage(
            handle!(histogram, "etcd_informer_stage_seconds", "informer" => prefix.to_owned(), "stage" => "cache_to_watcher"),
        )
    }

    /// A response whose oldest revision the cache applied at `applied` leaves now.
    pub(crate) fn sent(&self, applied: std::time::Instant) {
        self.0.record(applied.elapsed().as_secs_f64());
    }
}

#[cfg(feature = "server")]
impl ServerMetricHandles {
    /// The handles of a server of `prefixes`, registered now (with the recorder of this
    /// thread, if it has its own).
    pub(crate) fn new(prefixes: &[String]) -> Self {
        let all = prefixes.join(",");
        let _ = &all;
        ServerMetricHandles {
            streams: handle!(gauge, "etcd_informer_server_watch_streams", "prefix" => all.clone()),
            forwarded: handle!(counter, "etcd_informer_server_forwarded_total", "prefix" => all.clone()),
            forwarded_watches: handle!(gauge, "etcd_informer_server_forwarded_watches", "prefix" => all.clone()),
            forwarded_watches_refused: handle!(counter, "etcd_informer_server_forwarded_watches_refused_total", "prefix" => all),
            prefixes: prefixes
                .iter()
                .map(|p| PrefixMetricHandles::new(p))
                .collect(),
        }
    }

    /// Records the server's own counts: its open watch streams, its forwarded requests, and
    /// its forwarded watches (open, and refused for their cap).
    pub(crate) fn sample(&self, streams: u64, forwarded: u64, watches: (u64, u64)) {
        self.streams.set(streams as f64);
        self.forwarded.absolute(forwarded);
        self.forwarded_watches.set(watches.0 as f64);
        self.forwarded_watches_refused.absolute(watches.1);
    }

    /// Records the counts of the `i`th prefix: (watches, events, slow, taken_back, ranges),
    /// its history's (revisions, bytes), and the seconds since its cache was proven fresh.
    pub(crate) fn sample_prefix(
        &self,
        i: usize,
        counts: [u64; 5],
        history: (usize, usize),
        since_proven_fresh: Option<f64>,
    ) {
        let Some(p) = self.prefixes.get(i) else {
            return;
        };
        let [watches, events, slow, taken_back, ranges] = counts;
        p.watches.set(watches as f64);
        p.events.absolute(events);
        p.slow.absolute(slow);
        p.taken_back.absolute(taken_back);
        p.ranges.absolute(ranges);
        p.history_revisions.set(history.0 as f64);
        p.history_bytes.set(history.1 as f64);
        if let Some(seconds) = since_proven_fresh {
            p.since_proven_fresh.set(seconds);
        }
    }
}

#[cfg(feature = "server")]
impl PrefixMetricHandles {
    fn new(prefix: &str) -> Self {
        let _ = prefix;
        PrefixMetricHandles {
            watches: handle!(gauge, "etcd_informer_server_watches", "prefix" => prefix.to_owned()),
            events: handle!(counter, "etcd_informer_server_events_sent_total", "prefix" => prefix.to_owned()),
            slow: handle!(counter, "etcd_informer_server_slow_watch_forwards_total", "prefix" => prefix.to_owned()),
            taken_back: handle!(counter, "etcd_informer_server_watches_taken_back_total", "prefix" => prefix.to_owned()),
            ranges: handle!(counter, "etcd_informer_server_ranges_total", "prefix" => prefix.to_owned()),
            history_revisions: handle!(gauge, "etcd_informer_server_history_revisions", "prefix" => prefix.to_owned()),
            history_bytes: handle!(gauge, "etcd_informer_server_history_bytes", "prefix" => prefix.to_owned()),
            since_proven_fresh: handle!(gauge, "etcd_informer_server_seconds_since_proven_fresh", "prefix" => prefix.to_owned()),
        }
    }
}
