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

use std::time::Duration;

use etcd_client::{Client, GetOptions};

use super::request::{classify_code, read};
use crate::listwatch::hedged::Hedged;

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
