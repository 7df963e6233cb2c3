//! What the server counts: connections, watches, events, cancellations, forwarded requests.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

use crate::informer::AuditHealth;
use crate::metrics::ServerStage;

/// Counts of what a [`RunningServer`](super::RunningServer) did; see
/// [`RunningServer::stats`](super::RunningServer::stats).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerStats {
    /// The cache's revision.
    pub revision: i64,
    /// Keys in the cache.
    pub keys: usize,
    /// Revisions of history kept.
    pub history_revisions: usize,
    /// Bytes of history kept (keys and values, events and their previous values).
    pub history_bytes: usize,
    /// Open watch streams (client connections watching).
    pub watch_streams: u64,
    /// Open watches served from the cache.
    pub watches: u64,
    /// Events sent to watches.
    pub events_sent: u64,
    /// Watches forwarded to etcd because the history no longer reached back to their
    /// position (slow readers), or they reached a relist's difference that cannot be told as
    /// etcd's events. (Watches of a replaced store are cancelled, and not counted here.)
    pub slow_watches_forwarded: u64,
    /// Forwarded watches served from the cache again once etcd had caught them up to about
    /// the cache's revision (their relay then stops): slow watches that fell out of the
    /// history, and watches created below it.
    pub watches_taken_back: u64,
    /// Ranges answered from the cache.
    pub ranges_from_cache: u64,
    /// Requests forwarded to the upstream (passed-through Lease, Maintenance and Auth calls
    /// not counted).
    pub forwarded: u64,
    /// Consistent-read proofs asked of etcd: a linearizable read whose cache has not reached
    /// etcd's revision after a moment (keys outside the prefix moved it) has etcd read the
    /// range's keys to prove it unchanged (etcd before 3.4.25 / 3.5.8; see
    /// `progress_proofs`); reads that arrive while one is under way share it.
    pub proofs: u64,
    /// Linearizable reads proven by the cache's own watch instead (etcd 3.4.25+ and 3.5.8+,
    /// whose progress revisions can be trusted): a progress request on its stream, answered
    /// once etcd has sent it everything before, and no read of the range.
    pub progress_proofs: u64,
    /// Client connections with an upstream channel of their own, open now: one is opened with
    /// a connection's first forwarded stream (a watch, a keep-alive, a snapshot, an observer)
    /// and shared by its others, so that a client that stops reading them stalls no other
    /// client. It connects to each upstream endpoint, and closes with the client connection.
    pub client_upstreams: u64,
    /// Watches forwarded to etcd open now, each on an upstream stream of its own
    /// ([`CacheServerOptions::max_forwarded_watches`](super::CacheServerOptions::max_forwarded_watches)).
    pub forwarded_watches: u64,
    /// Watch creates refused (and slow watches cancelled) because the forwarded watches were
    /// at their cap, in all or for their client connection.
    pub forwarded_watches_refused: u64,
    /// What the audits of the prefixes' caches against etcd found, summed over the prefixes
    /// ([`CacheServerOptions::audit_period`](super::CacheServerOptions::audit_period)).
    pub audits: AuditHealth,
}

/// What the whole server counts.
#[derive(Default)]
struct Counters {
    streams: AtomicI64,
    forwarded: AtomicU64,
    client_upstreams: AtomicI64,
    forwarded_watches: AtomicI64,
    forwarded_watches_refused: AtomicU64,
}

/// What one served prefix counts: summed into [`ServerStats`], and sampled into the prefix's
/// own metric series.
#[derive(Default)]
pub(crate) struct PrefixCounts {
    watches: AtomicI64,
    events_sent: AtomicU64,
    slow_forwarded: AtomicU64,
    taken_back: AtomicU64,
    ranges: AtomicU64,
    proofs: AtomicU64,
    progress_proofs: AtomicU64,
}

/// [`PrefixCounts`] read at one moment.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PrefixSample {
    pub(crate) watches: u64,
    pub(crate) events_sent: u64,
    pub(crate) slow_forwarded: u64,
    pub(crate) taken_back: u64,
    pub(crate) ranges: u64,
    pub(crate) proofs: u64,
    pub(crate) progress_proofs: u64,
}

impl std::iter::Sum for PrefixSample {
    /// The server's counts: its prefixes' summed.
    fn sum<I: Iterator<Item = PrefixSample>>(samples: I) -> Self {
        samples.fold(PrefixSample::default(), |total, s| PrefixSample {
            watches: total.watches + s.watches,
            events_sent: total.events_sent + s.events_sent,
            slow_forwarded: total.slow_forwarded + s.slow_forwarded,
            taken_back: total.taken_back + s.taken_back,
            ranges: total.ranges + s.ranges,
            proofs: total.proofs + s.proofs,
            progress_proofs: total.progress_proofs + s.progress_proofs,
        })
    }
}

impl PrefixCounts {
    pub(crate) fn watches(&self, delta: i64) {
        self.watches.fetch_add(delta, Ordering::Relaxed);
    }
    pub(crate) fn sent(&self, events: usize) {
        self.events_sent.fetch_add(events as u64, Ordering::Relaxed);
    }
    pub(crate) fn ranged(&self) {
        self.ranges.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn slow_forwarded(&self) {
        self.slow_forwarded.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn taken_back(&self) {
        self.taken_back.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn proved(&self) {
        self.proofs.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn proved_by_progress(&self) {
        self.progress_proofs.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn sample(&self) -> PrefixSample {
        PrefixSample {
            watches: self.watches.load(Ordering::Relaxed).max(0) as u64,
            events_sent: self.events_sent.load(Ordering::Relaxed),
            slow_forwarded: self.slow_forwarded.load(Ordering::Relaxed),
            taken_back: self.taken_back.load(Ordering::Relaxed),
            ranges: self.ranges.load(Ordering::Relaxed),
            proofs: self.proofs.load(Ordering::Relaxed),
            progress_proofs: self.progress_proofs.load(Ordering::Relaxed),
        }
    }
}

/// The server's counters, shared by its services.
#[derive(Clone)]
pub(crate) struct ServerMetrics(Arc<Counters>, ServerStage);

impl ServerMetrics {
    /// Counters, with the cache-to-watcher stage labelled with the served prefixes.
    pub(crate) fn new(prefixes: &str) -> Self {
        ServerMetrics(Arc::default(), ServerStage::new(prefixes))
    }

    /// A watch response whose oldest revision the cache applied at `applied` leaves now.
    pub(crate) fn response_sent(&self, applied: std::time::Instant) {
        self.1.sent(applied);
    }

    pub(crate) fn forwarded(&self, method: &'static str) {
        tracing::trace!(method, "forwarded");
        self.0.forwarded.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn session(&self, delta: i64) {
        self.0.streams.fetch_add(delta, Ordering::Relaxed);
    }
    pub(crate) fn client_upstreams(&self, delta: i64) {
        self.0.client_upstreams.fetch_add(delta, Ordering::Relaxed);
    }
    /// Takes a place for a forwarded watch if fewer than `at_most` are open.
    pub(crate) fn forwarded_watch(&self, at_most: usize) -> bool {
        let open = &self.0.forwarded_watches;
        let taken = open.fetch_add(1, Ordering::Relaxed);
        if taken >= i64::try_from(at_most).unwrap_or(i64::MAX) {
            open.fetch_sub(1, Ordering::Relaxed);
            self.0
                .forwarded_watches_refused
                .fetch_add(1, Ordering::Relaxed);
            return false;
        }
        true
    }
    /// Gives back a place [`forwarded_watch`](Self::forwarded_watch) took.
    pub(crate) fn forwarded_watch_ended(&self) {
        self.0.forwarded_watches.fetch_sub(1, Ordering::Relaxed);
    }
    /// A forwarded watch refused for its connection's cap.
    pub(crate) fn forwarded_watch_refused(&self) {
        self.0
            .forwarded_watches_refused
            .fetch_add(1, Ordering::Relaxed);
    }
}

impl ServerMetrics {
    /// The server's stats, its prefixes' counts summed in `prefixes`.
    pub(crate) fn stats(
        &self,
        revision: i64,
        keys: usize,
        history: (usize, usize),
        prefixes: PrefixSample,
    ) -> ServerStats {
        let m = &self.0;
        ServerStats {
            revision,
            keys,
            history_revisions: history.0,
            history_bytes: history.1,
            watch_streams: m.streams.load(Ordering::Relaxed).max(0) as u64,
            watches: prefixes.watches,
            events_sent: prefixes.events_sent,
            slow_watches_forwarded: prefixes.slow_forwarded,
            watches_taken_back: prefixes.taken_back,
            ranges_from_cache: prefixes.ranges,
            forwarded: m.forwarded.load(Ordering::Relaxed),
            proofs: prefixes.proofs,
            progress_proofs: prefixes.progress_proofs,
            client_upstreams: m.client_upstreams.load(Ordering::Relaxed).max(0) as u64,
            forwarded_watches: m.forwarded_watches.load(Ordering::Relaxed).max(0) as u64,
            forwarded_watches_refused: m.forwarded_watches_refused.load(Ordering::Relaxed),
            audits: AuditHealth::default(),
        }
    }
}
