//! What a running server reports of itself: whether it is ready and why not (its health as
//! etcd words its own), its stats, and its metrics sampled every second.

use std::sync::Arc;
use std::time::Duration;

use super::access::answers_tokenless;
use super::served::Served;
use super::stats::{PrefixSample, ServerStats};
use crate::metrics::ServerMetricHandles;

/// Whether a [`RunningServer`](super::RunningServer) is ready, and if not why; see
/// [`RunningServer::readiness`](super::RunningServer::readiness).
#[derive(Clone)]
pub struct Readiness(pub(crate) Arc<Served>);

impl Readiness {
    /// What [`RunningServer::is_ready`](super::RunningServer::is_ready) says: every cache listed and following etcd, the
    /// upstream's identity known, and not draining.
    pub fn is_ready(&self) -> bool {
        self.0.ready()
    }

    /// Whether the server is draining ([`RunningServer::shutdown`](super::RunningServer::shutdown)): it answers clients no more.
    pub fn is_draining(&self) -> bool {
        *self.0.draining.borrow()
    }

    /// Why the server is not ready, in one line; `None` when it is.
    pub fn why_not(&self) -> Option<String> {
        self.0.why_not_ready()
    }

    /// The status and JSON body etcd's `/health` gives, for the server: 200
    /// `{"health":"true","reason":""}` while it serves, 503 `{"health":"false","reason":...}`
    /// while it is not ready or drains (load balancers and probes act on the status).
    ///
    /// The clients' port answers it at `/proxy/health`, where etcd's gRPC proxy answers its own
    /// (`/health` there is etcd's).
    pub fn etcd_health(&self) -> (u16, String) {
        match self.why_not() {
            None => (200, r#"{"health":"true","reason":""}"#.to_owned()),
            Some(why) => (
                503,
                format!(r#"{{"health":"false","reason":{}}}"#, json_string(&why)),
            ),
        }
    }
}

/// `s` as a JSON string literal.
fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

impl std::fmt::Debug for Readiness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Readiness")
            .field("ready", &self.is_ready())
            .finish()
    }
}

/// The server's counters and its caches' sizes.
pub(crate) fn stats_of(served: &Served) -> ServerStats {
    let (mut keys, mut revisions, mut bytes) = (0, 0, 0);
    for slice in &served.slices {
        let (r, b) = slice.cache.history_size();
        keys += slice.cache.len();
        revisions += r;
        bytes += b;
    }
    let prefixes: PrefixSample = served.slices.iter().map(|s| s.counts.sample()).sum();
    let mut stats = served
        .metrics
        .stats(served.revision(), keys, (revisions, bytes), prefixes);
    for slice in &served.slices {
        let audits = slice.audits.get();
        stats.audits.completed += audits.completed;
        stats.audits.skipped += audits.skipped;
        stats.audits.failed += audits.failed;
        stats.audits.repairs += audits.repairs;
    }
    stats
}

/// Samples the server's counters into the crate's metrics (`handles`) every second.
pub(crate) async fn sample_metrics(served: Arc<Served>, handles: ServerMetricHandles) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut refused = vec![false; served.slices.len()];
    loop {
        tick.tick().await;
        for (slice, was) in served.slices.iter().zip(refused.iter_mut()) {
            let error = slice.refused();
            if error.is_some() == *was {
                continue;
            }
            *was = error.is_some();
            let prefix = String::from_utf8_lossy(&slice.prefix);
            match error {
                Some(error) => {
                    tracing::error!(%prefix, %error, "etcd refuses the cache server's own list and watch (auth turned on? give the server a user, ETCDCTL_USER); every request of the prefix is forwarded and its cached watches ended until a list succeeds")
                }
                None => {
                    tracing::info!(%prefix, "etcd accepts the cache server's list again; serving the prefix from its cache")
                }
            }
            // Watch sessions look again: their watches of the prefix end.
            served.changed.send_modify(|n| *n = n.wrapping_add(1));
        }
        for (i, was) in refused.iter().enumerate() {
            if *was {
                // etcd may have turned its auth off again: then its reflector need not wait
                // out the backoff its refusals stretched (up to 30 s, every read forwarded).
                let served = served.clone();
                tokio::spawn(async move {
                    let slice = &served.slices[i];
                    if answers_tokenless(&served.upstream, slice.first_key()).await {
                        slice.retry.notify_waiters();
                    }
                });
            }
        }
        let stats = stats_of(&served);
        let watches = (stats.forwarded_watches, stats.forwarded_watches_refused);
        handles.sample(stats.watch_streams, stats.forwarded, watches);
        for (i, slice) in served.slices.iter().enumerate() {
            let s = slice.counts.sample();
            handles.sample_prefix(
                i,
                [
                    s.watches,
                    s.events_sent,
                    s.slow_forwarded,
                    s.taken_back,
                    s.ranges,
                ],
                slice.cache.history_size(),
                slice.reflected.health().seconds_since_proven_fresh(),
            );
        }
    }
}
