//! The etcd source: a [`ListerWatcher`] over a key prefix.

mod auth;
mod decode;
mod identity;
mod list;
mod options;
pub(crate) mod proof;
mod request;
mod resume;
mod versions;
mod watch;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, GetOptions, WatchOptions};
use tokio::sync::{mpsc, OnceCell};
use tokio::time::Instant;
use tracing::Instrument;

use self::auth::TokenRenewal;
#[cfg(feature = "server")]
pub(crate) use self::decode::key_text;
pub(crate) use self::decode::{key_bytes, prefix_range_end};
use self::decode::{Decoder, Undecodable};
pub(crate) use self::identity::Identity;
use self::identity::{store_changed, Tally};
use self::options::MIN_MESSAGE_BYTES;
use self::proof::{prove_range, Held, ProofFailed, WatchProgress};
use self::request::{classify, member_unreachable, named, read};
use self::versions::{progress_is_trustworthy, warn_of_known_watch_bugs};
use self::watch::{Responses, WatchTask};
use super::hedged::{hedged, Hedged, HEDGE_AFTER};
use super::{
    BoxFuture, Capabilities, Error, Freshness, KeyRevisionsSink, ListKeyRevisions, ListResult,
    ListSink, ListerWatcher, ProveFreshness, Result, Resumable, Resume, SavedCache, SourceIdentity,
    WatchStream,
};
use crate::codec::Codec;
use crate::sync::lock;

pub use options::{
    connect, connect_options, ConfigError, DecodeErrorHandler, EtcdOptions, FIRST_PAGE, LIST_PAGES,
    MAX_DECODING_MESSAGE_SIZE, RELIST_PAGES,
};

/// A [`ListerWatcher`] over every key under an etcd prefix, decoding values with a [`Codec`].
///
/// - `list` reads the prefix in pages, every page pinned to the first page's revision (and
///   checked: no key may be newer than it), decoding each page while the next is fetched;
/// - `watch(r)` watches the prefix from `r + 1`; a compacted revision, or an etcd whose revision
///   is below `r` (wiped or restored), is [`Error::Expired`], so the reflector relists;
/// - deletes carry no value unless [`EtcdOptions::prev_kv`] is set: the cache supplies it;
/// - progress notifications become bookmarks only on etcd versions whose progress revision can be
///   trusted (3.4.25+, 3.5.8+); on older ones they only prove the watch is alive;
/// - a value that does not decode is reported ([`DecodeError`](crate::DecodeError): key and revision, via `tracing`,
///   [`decode_errors`](Self::decode_errors) and [`EtcdOptions::on_decode_error`]) and the key is
///   treated as absent; nothing else is affected.
///
/// Keys are relative to the prefix and must be UTF-8 (others are reported like bad values).
///
/// Not `Clone`: a source keeps what it learned of the store (its identity, the key tally) to
/// check each re-watch, and two informers sharing one would corrupt each other's checks. Give
/// each informer its own source (sharing the `Client` is fine), or share the informer.
///
/// Usually handed to a [`SharedIndexInformer`](crate::informer::SharedIndexInformer); used alone, it lists
/// and watches:
///
/// ```no_run
/// use etcd_informer::{EtcdListerWatcher, EtcdOptions, ListerWatcher, TextCodec, WatchEvent};
/// use tokio_stream::StreamExt;
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let client = etcd_informer::connect(["127.0.0.1:2379"]).await?;
/// let options = EtcdOptions::default()
///     .with_on_decode_error(Some(std::sync::Arc::new(|e| eprintln!("skipped: {e}"))));
/// let lw = EtcdListerWatcher::with_options(client, "/config/", TextCodec, options)?;
/// let list = lw.list().await?;
/// println!("{} keys at revision {}", list.items.len(), list.revision);
/// let mut changes = lw.watch(list.revision).await?;
/// while let Some(event) = changes.next().await {
///     match event {
///         WatchEvent::Added(o) | WatchEvent::Modified(o) => println!("{} = {}", o.key(), o.value),
///         WatchEvent::Deleted { key, .. } => println!("{key} deleted"),
///         WatchEvent::Bookmark(revision) => println!("nothing new up to {revision}"),
///         // Expired (compacted): list again; anything else: watch again from the last revision.
///         WatchEvent::Error(e) => return Err(e.into()),
///     }
/// }
/// # Ok(()) }
/// ```
pub struct EtcdListerWatcher<T> {
    client: Client,
    prefix: Arc<[u8]>,
    range_end: Vec<u8>,
    codec: Arc<dyn Codec<T>>,
    options: EtcdOptions,
    decode_errors: Arc<AtomicU64>,
    /// What does not decode now, for the audit.
    undecodable: Arc<Undecodable>,
    /// The store last seen; see [`Identity`].
    identity: Arc<Mutex<Identity>>,
    /// How many keys the prefix held at a revision, by the list and the events since; a
    /// re-watch checks etcd still agrees (see [`Tally`]).
    tally: Arc<Mutex<Tally>>,
    trust_progress: Arc<OnceCell<bool>>,
    /// The live watch's progress, which proves the cache fresh where etcd's can be trusted.
    progress: Arc<WatchProgress>,
    token: TokenRenewal,
}

impl<T: Send + Sync + 'static> EtcdListerWatcher<T> {
    /// A source over `prefix` (which must end with `/`) with default options.
    pub fn new(
        client: Client,
        prefix: impl Into<Vec<u8>>,
        codec: impl Codec<T>,
    ) -> Result<Self, ConfigError> {
        Self::with_options(client, prefix, codec, EtcdOptions::default())
    }

    /// A source over `prefix` with `options`.
    pub fn with_options(
        client: Client,
        prefix: impl Into<Vec<u8>>,
        codec: impl Codec<T>,
        options: EtcdOptions,
    ) -> Result<Self, ConfigError> {
        let prefix = prefix.into();
        if !options.raw_prefix && !prefix.ends_with(b"/") {
            return Err(ConfigError::Prefix(
                String::from_utf8_lossy(&prefix).into_owned(),
            ));
        }
        if options.page_size < 1 {
            return Err(ConfigError::Option {
                name: "page_size",
                why: "must be at least 1",
            });
        }
        if options.max_message_bytes < MIN_MESSAGE_BYTES {
            return Err(ConfigError::Option {
                name: "max_message_bytes",
                why: "must be at least 2 MiB (2,097,152): etcd accepts values of 1.5 MiB",
            });
        }
        if options.page_timeout < Duration::from_millis(100) {
            return Err(ConfigError::Option {
                name: "page_timeout",
                why: "must be at least 100 ms",
            });
        }
        if options.watch_buffer < 1 {
            return Err(ConfigError::Option {
                name: "watch_buffer",
                why: "must be at least 1",
            });
        }
        if options.progress_interval.is_zero() || options.idle_timeout <= options.progress_interval
        {
            return Err(ConfigError::Option {
                name: "idle_timeout",
                why: "must be longer than a non-zero progress_interval",
            });
        }
        Ok(EtcdListerWatcher {
            client,
            range_end: prefix_range_end(&prefix),
            prefix: prefix.into(),
            codec: Arc::new(codec),
            options,
            decode_errors: Arc::new(AtomicU64::new(0)),
            undecodable: Arc::default(),
            identity: Arc::new(Mutex::new(Identity::default())),
            tally: Arc::new(Mutex::new(Tally::default())),
            trust_progress: Arc::new(OnceCell::new()),
            progress: Arc::default(),
            token: TokenRenewal::default(),
        })
    }

    /// The watched prefix, lossily as UTF-8.
    pub fn prefix(&self) -> String {
        String::from_utf8_lossy(&self.prefix).into_owned()
    }

    /// How many values failed to decode so far.
    pub fn decode_errors(&self) -> u64 {
        self.decode_errors.load(Ordering::Relaxed)
    }

    fn decoder(&self) -> Decoder<T> {
        Decoder {
            prefix: self.prefix.clone(),
            codec: self.codec.clone(),
            errors: self.decode_errors.clone(),
            on_error: self.options.on_decode_error.clone(),
            undecodable: self.undecodable.clone(),
            escape_keys: self.options.escape_keys,
        }
    }

    /// Classifies an etcd error for the prefix; an auth token etcd has forgotten is renewed
    /// before the retry.
    fn failed(&self, e: etcd_client::Error, revision: i64) -> Error {
        let error = classify(e, revision);
        self.token.note(&error);
        named(error, &self.prefix())
    }

    /// Whether the store answering is another one than last time (see [`Identity`]); records it.
    async fn store_changed(&self, header: Option<&etcd_client::ResponseHeader>) -> Option<String> {
        let header = header?;
        let seen = Identity {
            cluster_id: header.cluster_id(),
            raft_term: header.raft_term(),
        };
        let reason = store_changed(
            &self.client,
            &self.identity,
            seen,
            &self.range(),
            self.options.page_timeout,
        )
        .await;
        if reason.is_some() {
            // The new store is the reference from now on.
            *lock(&self.identity) = seen;
        }
        reason
    }

    /// The identity of the store this source last listed or watched, as it records it: what a
    /// cache filled by it holds (the cache server names it in its answers).
    #[cfg_attr(not(feature = "server"), allow(dead_code))]
    pub(crate) fn identity_handle(&self) -> Arc<Mutex<Identity>> {
        self.identity.clone()
    }

    /// [`ProveFreshness::freshness`] by the live watch's progress (a trustworthy etcd): one
    /// linearizable count of one key names etcd's revision, and a progress request on the
    /// watch's own stream brings a bookmark at it to the cache, behind every event before it.
    /// The answer is then "not yet unchanged" with the revision, and the informer waits for
    /// the bookmark. `None` when the watch did not answer in time: the range is read instead.
    async fn freshness_by_progress(
        &self,
        since: i64,
        at: Option<i64>,
    ) -> Result<Option<Freshness>> {
        let first = self.first_key();
        let options = GetOptions::new().with_count_only();
        let timeout = self.options.page_timeout;
        let current = match read(&self.client, &first, options, timeout).await {
            Hedged::Answered(resp) => resp.header().map_or(0, |h| h.revision()),
            Hedged::Failed(e) => return Err(self.failed(e, 0)),
            Hedged::TimedOut => return Ok(None),
        };
        if current < since {
            return Err(self.went_back(current, since));
        }
        let revision = at.unwrap_or(current);
        if revision > current {
            // A revision etcd has not reached: the range read says so.
            return Ok(None);
        }
        if revision <= since {
            return Ok(Some(Freshness {
                revision,
                unchanged: true,
            }));
        }
        Ok(self.progress.reach(revision).await.then_some(Freshness {
            revision,
            unchanged: false,
        }))
    }

    /// etcd's revision is below the cache's: revisions of two stores do not compare ("no key
    /// newer than the cache's revision" holds trivially in a store that went back), so no
    /// proof stands until the cache is listed from it.
    fn went_back(&self, current: i64, since: i64) -> Error {
        Error::store_replaced(
            since + 1,
            format!(
                "etcd is at revision {current}, below the cache's revision {since} of {}: the store was wiped or restored",
                self.prefix()
            ),
        )
    }

    /// The live watch's progress: the cache server's linearizable reads ask it too.
    #[cfg_attr(not(feature = "server"), allow(dead_code))]
    pub(crate) fn progress(&self) -> Arc<WatchProgress> {
        self.progress.clone()
    }

    /// The first key of the range: the prefix, or `\0` for the whole keyspace (etcd rejects an
    /// empty key; `\0` with the range end `\0` means every key).
    fn first_key(&self) -> Vec<u8> {
        if self.prefix.is_empty() {
            vec![0]
        } else {
            self.prefix.to_vec()
        }
    }

    fn range(&self) -> (Vec<u8>, Vec<u8>) {
        (self.first_key(), self.range_end.clone())
    }

    /// Whether this etcd's progress revisions can advance the watch; asked once (a failed
    /// question is asked again next time rather than remembered as "no").
    async fn trust_progress(&self) -> bool {
        if let Some(forced) = self.options.trust_progress {
            return forced;
        }
        if let Some(trust) = self.trust_progress.get() {
            return *trust;
        }
        let mut maintenance = self.client.maintenance_client();
        match tokio::time::timeout(Duration::from_secs(5), maintenance.status()).await {
            Ok(Ok(status)) => {
                warn_of_known_watch_bugs(status.version());
                let trust = progress_is_trustworthy(status.version());
                let _ = self.trust_progress.set(trust);
                trust
            }
            _ => false,
        }
    }
}

impl<T: Send + Sync + 'static> ListerWatcher<T> for EtcdListerWatcher<T> {
    /// Every capability: freshness proofs, key revisions, resuming; the liveness bound is
    /// [`EtcdOptions::idle_timeout`] (a live watch probes its stream well within it).
    fn capabilities(&self) -> Capabilities<'_> {
        Capabilities::none()
            .with_freshness(self)
            .with_key_revisions(self)
            .with_resume(self)
            .with_liveness_bound(self.options.idle_timeout)
            .with_decode_errors(EtcdListerWatcher::decode_errors(self))
    }

    fn list(&self) -> BoxFuture<'_, Result<ListResult<T>>> {
        Box::pin(self.list_inner(None))
    }

    fn list_into(&self, sink: Arc<dyn ListSink<T>>) -> BoxFuture<'_, Result<i64>> {
        Box::pin(async move { Ok(self.list_inner(Some(sink)).await?.revision) })
    }

    fn watch(&self, after_revision: i64) -> BoxFuture<'_, Result<WatchStream<T>>> {
        Box::pin(async move {
            self.token.renew_if_refused(&self.client).await;
            let trust_progress = self.trust_progress().await;
            let mut options = WatchOptions::new()
                .with_range(self.range_end.clone())
                .with_start_revision(after_revision + 1)
                .with_progress_notify();
            if self.options.prev_kv {
                options = options.with_prev_key();
            }
            // A stream opened on a member that hangs never confirms its creation: another one
            // goes out beside it, and the first confirmed wins.
            let deadline = Instant::now() + self.options.idle_timeout;
            let client = self
                .client
                .watch_client()
                .max_decoding_message_size(self.options.max_message_bytes);
            let key = self.first_key();
            let opened = hedged(HEDGE_AFTER, deadline, member_unreachable, || {
                let mut client = client.clone();
                let (key, options) = (key.clone(), options.clone());
                async move {
                    let (requests, mut responses) = client.watch(key, Some(options)).await?.split();
                    match responses.message().await? {
                        Some(created) => Ok((requests, responses, created)),
                        None => Err(etcd_client::Error::WatchError(
                            "etcd ended the watch stream before confirming it".into(),
                        )),
                    }
                }
            })
            .await;
            let (requests, responses, created) = match opened {
                Hedged::Answered(opened) => opened,
                Hedged::Failed(e) => return Err(self.failed(e, after_revision)),
                Hedged::TimedOut => {
                    return Err(Error::unavailable(format!(
                        "no member confirmed the watch of {} within {:?}",
                        self.prefix(),
                        self.options.idle_timeout
                    )))
                }
            };
            let (tx, rx) = mpsc::channel(self.options.watch_buffer);
            let task = WatchTask {
                client: self.client.clone(),
                range: self.range(),
                decoder: self.decoder(),
                identity: self.identity.clone(),
                tally: self.tally.clone(),
                name: self.prefix(),
                after: after_revision,
                delivered: after_revision,
                watch_id: created.watch_id(),
                lag_confirmed: false,
                trust_progress,
                progress_interval: self.options.progress_interval,
                idle_timeout: self.options.idle_timeout,
                tx,
                received: std::time::Instant::now(),
                token: self.token.clone(),
                progress: self.progress.clone(),
                generation: 0,
            };
            let span =
                tracing::info_span!("etcd_watch", prefix = %self.prefix(), after = after_revision);
            tokio::spawn(task.run(requests, responses, created).instrument(span));
            Ok(Box::pin(Responses {
                rx,
                current: smallvec::SmallVec::new().into_iter(),
            }) as WatchStream<T>)
        })
    }
}

impl<T: Send + Sync + 'static> ListKeyRevisions for EtcdListerWatcher<T> {
    fn key_revisions(&self, at: i64, page: KeyRevisionsSink) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.key_revisions_inner(at, page))
    }
}

impl<T: Send + Sync + 'static> ProveFreshness for EtcdListerWatcher<T> {
    /// Where etcd's progress revisions can be trusted (3.4.25+, 3.5.8+, or
    /// [`EtcdOptions::trust_progress`]), the live watch proves it: a linearizable count of one
    /// key names etcd's revision, a progress request on the watch's stream brings the cache a
    /// bookmark there, and etcd reads no value. Otherwise, or if the watch does not answer
    /// within a second (etcd's gRPC proxy never does), one linearizable (or pinned) range read of the prefix, keys only, filtered to keys
    /// modified after `since`: etcd's header revision, the number of keys under the prefix, and
    /// whether any was written. If none was, only deletes can have changed the prefix, and each
    /// lowers its count: a second read counts the prefix at `since`, and equal counts prove
    /// nothing changed. Both are etcd's own figures, so keys that do not decode need no
    /// bookkeeping, and the proof is about the two revisions it names, whatever the watch has
    /// read meanwhile. Correct on every etcd version (no progress notification needed), through
    /// the gRPC proxy too. `cached` is not needed. An etcd whose revision is below `since` went
    /// back in time (wiped or restored): [`Error::StoreReplaced`], never a proof.
    fn freshness(
        &self,
        since: i64,
        cached: Option<usize>,
        at: Option<i64>,
    ) -> BoxFuture<'_, Result<Freshness>> {
        Box::pin(async move {
            self.token.renew_if_refused(&self.client).await;
            if self.progress.trusted() {
                if let Some(fresh) = self.freshness_by_progress(since, at).await? {
                    return Ok(fresh);
                }
            }
            let first = self.first_key();
            let held = Held {
                key: &first,
                range_end: &self.range_end,
                since,
                cached: cached.unwrap_or(0),
                // Exact, and no key ever failed to decode (so none is missing from it): the
                // cache holds the whole range at `since`.
                whole: cached.is_some() && self.decode_errors() == 0,
            };
            let proof = match prove_range(&self.client, held, at, self.options.page_timeout).await {
                Ok(proof) => proof,
                Err(ProofFailed::Etcd(e, revision)) => return Err(self.failed(e, revision)),
                Err(ProofFailed::TimedOut(what)) => {
                    return Err(Error::unavailable(format!(
                        "reading {what} of {} for a freshness proof timed out after {:?}",
                        self.prefix(),
                        self.options.page_timeout
                    )))
                }
            };
            if proof.current < since {
                return Err(self.went_back(proof.current, since));
            }
            Ok(Freshness {
                revision: proof.revision,
                unchanged: proof.unchanged,
            })
        })
    }
}

impl<T: Send + Sync + 'static> Resumable for EtcdListerWatcher<T> {
    /// The prefix, and the cluster id of the last response header the source checked.
    fn identity(&self) -> SourceIdentity {
        let cluster_id = lock(&self.identity).cluster_id;
        SourceIdentity {
            name: self.prefix(),
            cluster_id: (cluster_id != 0).then_some(cluster_id),
        }
    }

    /// A one-key read, then count-only ranges of the prefix; see `resume.rs`.
    fn can_resume(&self, saved: SavedCache) -> BoxFuture<'_, Result<Resume>> {
        Box::pin(self.resume_inner(saved.revision, saved.keys, saved.cluster_id, saved.splits))
    }
}

// Nothing is pinned structurally: the fields are only moved through `&mut`.
