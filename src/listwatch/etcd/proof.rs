//! Whether a range of etcd is still what a cache holds: the one proof behind the informer's
//! consistent reads ([`EtcdListerWatcher::freshness`](super::EtcdListerWatcher)) and the cache
//! server's linearizable reads.
//!
//! A cache that holds a range whole as of revision `since`, `cached` keys, is etcd's content at
//! a later revision `R` when no key of the range at `R` was written after `since` (a created or
//! changed key would be one) and the range still holds `cached` keys (a delete leaves no key
//! behind, but lowers the count): the keys at `R` are then a subset of those at `since`, of
//! the same size. This needs no old revision, so a quiet range stays provable after etcd
//! compacted past `since`. It holds only for a cache that holds every key of the range at
//! `since` ([`Held::whole`]): one that lacks a key whose value did not decode could match the
//! count with another set of keys. Otherwise the range is counted at `since` too, which
//! compaction can refuse: not proven.
//!
//! That proof reads the range in etcd, and etcd reads every value of it to filter by
//! revision. Where etcd's progress revisions can be trusted (3.4.25+, 3.5.8+), the cache's own
//! watch proves it for the price of a round trip instead ([`WatchProgress`]): etcd answers a
//! progress request once the watch has sent every event before its revision, and the answer
//! reaches the cache as a bookmark, behind those events.

use std::sync::Mutex;
use std::time::Duration;

use etcd_client::{Client, GetOptions};
use tokio::sync::futures::Notified;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::request::{classify_code, read};
use crate::listwatch::hedged::Hedged;
use crate::sync::lock;

/// The progress of a source's live watch, asked for by consistent reads: shared by the source
/// and each watch task it starts. A task's calls name its generation, so that one still
/// winding down never speaks for its successor.
#[derive(Debug, Default)]
pub(crate) struct WatchProgress {
    /// A read wants etcd's progress: the live watch sends a progress request.
    wanted: Notify,
    /// etcd answered a progress request (or the watch ended).
    answered: Notify,
    live: Mutex<Live>,
}

/// The live watch as its progress goes.
#[derive(Debug, Default)]
struct Live {
    /// Which watch task is live.
    generation: u64,
    /// The newest revision the live watch passed on to its consumer with a bookmark.
    passed: i64,
    /// The live watch turns etcd's progress into bookmarks (a trustworthy etcd).
    trusted: bool,
    /// etcd answered it at least once.
    answered_once: bool,
}

impl WatchProgress {
    /// Asks the live watch for etcd's progress until it has passed on every event up to
    /// `target` and a bookmark at or after it (which then reaches the cache in order), or
    /// [`PROGRESS_WAIT`] passes: false then, and at once where progress is not trusted or no
    /// watch is live. A member that lags behind `target` answers below it; it is asked again.
    /// A watch that never answered within that time (etcd's gRPC proxy never does) is asked
    /// no more: the next watch is.
    pub(crate) async fn reach(&self, target: i64) -> bool {
        let deadline = Instant::now() + PROGRESS_WAIT;
        loop {
            let answered = self.answered.notified();
            tokio::pin!(answered);
            answered.as_mut().enable();
            let generation = {
                let live = lock(&self.live);
                if !live.trusted {
                    return false;
                }
                if live.passed >= target {
                    return true;
                }
                live.generation
            };
            self.wanted.notify_one();
            if tokio::time::timeout_at(deadline, answered).await.is_err() {
                let mut live = lock(&self.live);
                if live.generation == generation && live.trusted && !live.answered_once {
                    live.trusted = false;
                    tracing::warn!(
                        timeout = ?PROGRESS_WAIT,
                        "the watch never answered a progress request: consistent reads read the range in etcd until it is opened again"
                    );
                }
                return false;
            }
        }
    }

    /// Whether the live watch turns etcd's progress into bookmarks.
    pub(crate) fn trusted(&self) -> bool {
        lock(&self.live).trusted
    }

    /// A watch task starts, after `after` and trusting progress or not: its generation.
    pub(super) fn started(&self, after: i64, trusted: bool) -> u64 {
        let mut live = lock(&self.live);
        *live = Live {
            generation: live.generation + 1,
            passed: after,
            trusted,
            answered_once: false,
        };
        live.generation
    }

    /// The watch task of `generation` ended: no progress to ask for until the next one starts.
    pub(super) fn ended(&self, generation: u64) {
        {
            let mut live = lock(&self.live);
            if live.generation == generation {
                live.trusted = false;
            }
        }
        self.answered.notify_waiters();
    }

    /// etcd answered the watch task of `generation` a progress request: it has passed on
    /// every event up to `revision`, and a bookmark at it.
    pub(super) fn answered(&self, generation: u64, revision: i64) {
        {
            let mut live = lock(&self.live);
            if live.generation == generation {
                live.passed = live.passed.max(revision);
                live.answered_once = true;
            }
        }
        self.answered.notify_waiters();
    }

    /// Resolves when a read wants progress (pinned across a loop, it registers once).
    pub(super) fn wanted(&self) -> Notified<'_> {
        self.wanted.notified()
    }
}

/// How long a consistent read waits for the watch's answer to a progress request before it
/// reads the range in etcd instead. etcd answers within a round trip once the watch has sent
/// what came before.
pub(crate) const PROGRESS_WAIT: Duration = Duration::from_secs(1);

/// A range a cache holds whole as of a revision.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Held<'a> {
    /// The range's first key.
    pub key: &'a [u8],
    /// The range's end (exclusive), as etcd takes it.
    pub range_end: &'a [u8],
    /// The revision the cache holds the range at.
    pub since: i64,
    /// How many keys the cache holds in the range.
    pub cached: usize,
    /// The cache holds every key of the range at `since`: none was left out because its key
    /// or value did not decode.
    pub whole: bool,
}

/// What etcd answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RangeProof {
    /// etcd's revision when it answered (the response header's).
    pub current: i64,
    /// The revision the answer is about: the one asked for, or `current`.
    pub revision: i64,
    /// The range at `revision` is the cache's content. Never true when `current` is below
    /// `since`: that is another store (wiped or restored), whose revisions do not compare.
    pub unchanged: bool,
}

/// Why etcd could not answer.
#[derive(Debug)]
pub(crate) enum ProofFailed {
    /// etcd's error, and the revision the failed read was at.
    Etcd(etcd_client::Error, i64),
    /// No answer within the timeout; says what was being read.
    TimedOut(&'static str),
}

/// Asks etcd whether `held` is the range's content at `at` (or now, read linearizably): one
/// keys-only read filtered to keys written after `since` (etcd's count is the whole range's),
/// and a count at `since` only for a cache that may lack keys. Each read is hedged across members and
/// bounded by `timeout`.
pub(crate) async fn prove_range(
    client: &Client,
    held: Held<'_>,
    at: Option<i64>,
    timeout: Duration,
) -> Result<RangeProof, ProofFailed> {
    let Held {
        key,
        range_end,
        since,
        cached,
        whole,
    } = held;
    // etcd filters by mod_revision before it applies the limit and counts the whole range:
    // one key at most comes back, and `count` is the range's size.
    let mut options = GetOptions::new()
        .with_range(range_end.to_vec())
        .with_keys_only()
        .with_min_mod_revision(since + 1)
        .with_limit(1);
    if let Some(at) = at {
        options = options.with_revision(at);
    }
    let resp = match read(client, key, options, timeout).await {
        Hedged::Answered(resp) => resp,
        Hedged::Failed(e) => return Err(ProofFailed::Etcd(e, at.unwrap_or(0))),
        Hedged::TimedOut => return Err(ProofFailed::TimedOut("the range's keys")),
    };
    let current = resp.header().map_or(0, |h| h.revision());
    let revision = at.unwrap_or(current);
    let answer = |unchanged| RangeProof {
        current,
        revision,
        unchanged,
    };
    if current < since || since == 0 || !resp.kvs().is_empty() {
        return Ok(answer(false));
    }
    if revision <= since {
        return Ok(answer(true));
    }
    if whole {
        // The keys now are some of the cache's: the same number, or fewer (a delete).
        return Ok(answer(usize::try_from(resp.count()) == Ok(cached)));
    }
    let options = GetOptions::new()
        .with_range(range_end.to_vec())
        .with_count_only()
        .with_revision(since);
    match read(client, key, options, timeout).await {
        Hedged::Answered(then) => Ok(answer(then.count() == resp.count())),
        // `since` compacted away: no proof; the caller waits for the cache instead.
        Hedged::Failed(e) if classify_code(&e) == Some(tonic::Code::OutOfRange) => {
            Ok(answer(false))
        }
        Hedged::Failed(e) => Err(ProofFailed::Etcd(e, since)),
        Hedged::TimedOut => Err(ProofFailed::TimedOut(
            "the range's count at the cache's revision",
        )),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn progress_is_asked_until_the_watch_passes_the_target_and_not_after_a_silence() {
        let progress = Arc::new(WatchProgress::default());
        // No live watch, or one that does not trust progress: no answer to wait for.
        assert!(!progress.reach(5).await);
        progress.started(3, false);
        assert!(!progress.reach(5).await);

        let generation = progress.started(3, true);
        assert!(progress.reach(3).await, "passed already");
        let watch = progress.clone();
        let answers = tokio::spawn(async move {
            // A lagging member answers below the target first, then at it.
            for revision in [4, 7] {
                watch.wanted().await;
                watch.answered(generation, revision);
            }
        });
        assert!(progress.reach(7).await);
        answers.await.expect("the watch's answers");
        // A slow answer from a watch that answered before: this read falls back, the next
        // still asks.
        assert!(!progress.reach(9).await);
        assert!(progress.trusted());

        // A watch that never answers is asked no more, until the next one starts.
        let silent = progress.started(7, true);
        assert!(!progress.reach(9).await);
        assert!(!progress.trusted());
        let next = progress.started(7, true);
        // The old watch winding down speaks for nobody.
        progress.answered(silent, 100);
        progress.ended(silent);
        assert!(progress.trusted());
        assert!(
            !progress.reach(9).await,
            "the old watch's answer did not count"
        );
        progress.ended(next);
        assert!(!progress.trusted());
    }
}
