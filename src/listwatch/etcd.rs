//! The etcd source: a [`ListerWatcher`] over a key prefix.

use std::collections::{HashSet, VecDeque};
use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use etcd_client::proto::PbKeyValue;
use etcd_client::{Client, ConnectOptions, GetOptions, WatchOptions};
use tokio::sync::{mpsc, OnceCell};
use tokio::time::Instant;
use tokio_stream::Stream;
use tracing::Instrument;

use super::hedged::{hedged, Hedged, HEDGE_AFTER};
use super::{
    BoxFuture, Error, Freshness, ListResult, ListSink, ListerWatcher, Result, WatchEvent,
    WatchStream,
};
use crate::codec::{Codec, DecodeError, DecodeErrorKind};
use crate::Object;

/// Called with every value that does not decode.
pub type DecodeErrorHandler = Arc<dyn Fn(&DecodeError) + Send + Sync>;

/// How long authenticating again may take before the retry goes ahead without it.
const RENEW_TIMEOUT: Duration = Duration::from_secs(5);

/// The most keys in the first page of a list (see [`EtcdOptions::page_size`]).
pub const FIRST_PAGE: i64 = 10_000;

/// How many pages a list aims at (see [`EtcdOptions::page_size`]).
pub const LIST_PAGES: i64 = 10;

/// The gRPC message size our clients accept. tonic's default of 4 MiB fails a page of large
/// values on every retry, forever; pages are bounded by [`EtcdOptions::page_size`] instead.
pub const MAX_DECODING_MESSAGE_SIZE: usize = 1 << 30;

/// Connection options every etcd client of an informer should have:
///
/// - **require leader**: without it a watch on a member cut off from its cluster hangs
///   silently, and reads may be served stale; with it the member cancels the stream with "no
///   leader" and we retry, possibly on another endpoint;
/// - **gRPC keepalive** every 5.5 minutes, giving up after 20 s without an answer, only while
///   a stream is open: etcd-client has it off, so a half-open connection would otherwise stay
///   forever. Not more often: etcd's gRPC proxy (like any Go gRPC server with the default
///   policy) closes connections that ping more often than every 5 minutes ("too many pings"),
///   and a silent watch is caught sooner by the etcd source's own probe on the watch stream
///   ([`EtcdOptions::progress_interval`], [`EtcdOptions::idle_timeout`]);
/// - a 5 s connect timeout, so an unreachable endpoint is reported, not waited on;
/// - automatic re-authentication of reads when etcd has forgotten the auth token (etcd drops
///   simple tokens after `--auth-token-ttl`, 300 s by default); watches re-authenticate in
///   the etcd source.
pub fn connect_options() -> ConnectOptions {
    ConnectOptions::new()
        .with_require_leader(true)
        .with_keep_alive(Duration::from_secs(330), Duration::from_secs(20))
        .with_keep_alive_while_idle(false)
        .with_connect_timeout(Duration::from_secs(5))
        .with_auto_token_refresh(true)
}

/// Connects to etcd with [`connect_options`].
///
/// ```no_run
/// # async fn demo() -> Result<(), etcd_client::Error> {
/// let client = etcd_informer::connect(["127.0.0.1:2379"]).await?;
/// # Ok(()) }
/// ```
pub async fn connect<E: AsRef<str>, S: AsRef<[E]>>(
    endpoints: S,
) -> Result<Client, etcd_client::Error> {
    Client::connect(endpoints, Some(connect_options())).await
}

/// Who answered: the identity of the etcd store, from response headers.
///
/// A store wiped or restored from a backup is recognised by any of: its cluster id changed (a
/// cluster recreated with another `--initial-cluster-token` or other peer URLs), its raft term
/// went down (confirmed by a linearizable read, since a member that was down may lag behind its
/// cluster's term), its revision went below the one watched, or it counts another number of
/// keys under the prefix at the watched revision than the watch did ([`Tally`]). No signal
/// catches a store recreated with the same token and peer URLs, whose term has come back up
/// to the old one, whose revision has passed the watched one before the informer reconnects,
/// and which happens to hold as many keys under the prefix at that revision: its keys stay
/// cached until they change or a relist (compaction) happens. The member id is not
/// compared: it changes whenever another member of the same store answers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Identity {
    cluster_id: u64,
    raft_term: u64,
}

/// The smallest accepted [`EtcdOptions::max_message_bytes`]: above etcd's default request limit
/// of 1.5 MiB, so that one value always fits in a page.
const MIN_MESSAGE_BYTES: usize = 2 << 20;

/// Options of an [`EtcdListerWatcher`].
#[derive(Clone)]
#[non_exhaustive]
pub struct EtcdOptions {
    /// The most keys per list page; default 100,000. A list reads a first page of at most
    /// [`FIRST_PAGE`] keys, learns the prefix's size from it, and reads the rest in about
    /// [`LIST_PAGES`] pages of at least `FIRST_PAGE` and at most `page_size` keys: enough pages
    /// to build the cache from one while etcd serves the next, few enough that etcd 3.4, which
    /// walks every remaining key of the range for each page, does not go quadratic (1M keys took
    /// 13 s in 10,000-key pages against 4.9 s in 100,000-key ones; BENCHMARKS.md). Lower it for
    /// values of many kilobytes, to keep each message small.
    pub page_size: i64,
    /// The largest gRPC message accepted from etcd (default [`MAX_DECODING_MESSAGE_SIZE`], at
    /// least 2 MiB); a list page larger than this is retried in smaller pages.
    pub max_message_bytes: usize,
    /// Give up on one page after this long (at least 100 ms; default 60 s).
    pub page_timeout: Duration,
    /// Ask etcd for the previous value of each changed key. Not needed (the cache holds the last
    /// value of every key), and it cut etcd 3.4's write throughput 5-13x in our measurements.
    pub prev_kv: bool,
    /// Accept a prefix that does not end with `/` (then `/a` also matches `/ab`); the empty
    /// prefix then watches the whole keyspace.
    pub raw_prefix: bool,
    /// A watch that has heard nothing on its stream for this long (default 1 s) probes it: it
    /// creates a second watch on the same stream and cancels it, which etcd members and etcd's
    /// gRPC proxy both answer at once (etcd versions whose progress revisions can be trusted are
    /// also asked for a progress notification). Each answer is reported as a
    /// [`WatchEvent::Bookmark`] at the revision already delivered: the stream proved alive.
    pub progress_interval: Duration,
    /// A watch that has heard nothing on its own stream for this long (default 2 s), its probe
    /// included, is on a member that stopped answering: it fails as [`Error::Unavailable`] and
    /// the reflector watches again (opening the new stream on whichever member answers first).
    /// Only the stream counts: a read answered by another member proves nothing about the
    /// member holding the watch. It is also how long an informer stays healthy without proof
    /// ([`ListerWatcher::liveness_bound`]).
    pub idle_timeout: Duration,
    /// Events buffered between the etcd stream and the reflector.
    pub watch_buffer: usize,
    /// Called with every value that does not decode (after it is logged and counted).
    pub on_decode_error: Option<DecodeErrorHandler>,
    /// Whether etcd's progress revisions may advance the watch (as bookmarks): `None` (the
    /// default) decides by the server's version (3.4.25+, 3.5.8+); `Some` forces it, for tests
    /// and for builds of etcd with the fix backported.
    pub trust_progress: Option<bool>,
}

impl EtcdOptions {
    /// Sets the keys per list page (`page_size`).
    #[must_use]
    pub fn with_page_size(mut self, page_size: i64) -> Self {
        self.page_size = page_size;
        self
    }

    /// Sets the largest gRPC message accepted from etcd (`max_message_bytes`).
    #[must_use]
    pub fn with_max_message_bytes(mut self, max_message_bytes: usize) -> Self {
        self.max_message_bytes = max_message_bytes;
        self
    }

    /// Sets the time limit of one list page (`page_timeout`).
    #[must_use]
    pub fn with_page_timeout(mut self, page_timeout: Duration) -> Self {
        self.page_timeout = page_timeout;
        self
    }

    /// Sets whether to ask etcd for the previous value of each changed key (`prev_kv`).
    #[must_use]
    pub fn with_prev_kv(mut self, prev_kv: bool) -> Self {
        self.prev_kv = prev_kv;
        self
    }

    /// Sets whether a prefix not ending with `/` is accepted (`raw_prefix`).
    #[must_use]
    pub fn with_raw_prefix(mut self, raw_prefix: bool) -> Self {
        self.raw_prefix = raw_prefix;
        self
    }

    /// Sets how long a silent watch waits before it probes its stream (`progress_interval`).
    #[must_use]
    pub fn with_progress_interval(mut self, progress_interval: Duration) -> Self {
        self.progress_interval = progress_interval;
        self
    }

    /// Sets how long a watch may hear nothing on its stream before it is dropped (`idle_timeout`).
    #[must_use]
    pub fn with_idle_timeout(mut self, idle_timeout: Duration) -> Self {
        self.idle_timeout = idle_timeout;
        self
    }

    /// Sets the events buffered between the etcd stream and the reflector (`watch_buffer`).
    #[must_use]
    pub fn with_watch_buffer(mut self, watch_buffer: usize) -> Self {
        self.watch_buffer = watch_buffer;
        self
    }

    /// Forces whether progress revisions are trusted, instead of deciding by the server's
    /// version (`trust_progress`).
    #[must_use]
    pub fn with_trust_progress(mut self, trust_progress: Option<bool>) -> Self {
        self.trust_progress = trust_progress;
        self
    }

    /// Sets the handler called with every value that does not decode (`on_decode_error`).
    #[must_use]
    pub fn with_on_decode_error(mut self, on_decode_error: Option<DecodeErrorHandler>) -> Self {
        self.on_decode_error = on_decode_error;
        self
    }
}

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            page_size: 100_000,
            max_message_bytes: MAX_DECODING_MESSAGE_SIZE,
            page_timeout: Duration::from_secs(60),
            prev_kv: false,
            raw_prefix: false,
            // A hung member is noticed within 2 s: a probe goes out after 1 s of silence and is
            // answered within milliseconds; a live stream never stays silent longer.
            progress_interval: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(2),
            watch_buffer: 1024,
            on_decode_error: None,
            trust_progress: None,
        }
    }
}

impl fmt::Debug for EtcdOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdOptions")
            .field("page_size", &self.page_size)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("page_timeout", &self.page_timeout)
            .field("prev_kv", &self.prev_kv)
            .field("raw_prefix", &self.raw_prefix)
            .field("progress_interval", &self.progress_interval)
            .field("idle_timeout", &self.idle_timeout)
            .field("watch_buffer", &self.watch_buffer)
            .field("trust_progress", &self.trust_progress)
            .finish_non_exhaustive()
    }
}

/// A bad argument to [`EtcdListerWatcher`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The prefix is empty or does not end with `/`.
    #[error(
        "prefix {0:?} must end with '/' (otherwise it also matches sibling keys, e.g. /a matches /ab); \
         set EtcdOptions::raw_prefix to watch a raw byte prefix"
    )]
    Prefix(String),
    /// An option is out of range.
    #[error("option {name} is invalid: {why}")]
    Option {
        /// The option.
        name: &'static str,
        /// Why.
        why: &'static str,
    },
}

/// A [`ListerWatcher`] over every key under an etcd prefix, decoding values with a [`Codec`].
///
/// - `list` reads the prefix in pages, every page pinned to the first page's revision (and
///   checked: no key may be newer than it), decoding each page while the next is fetched;
/// - `watch(r)` watches the prefix from `r + 1`; a compacted revision, or an etcd whose revision
///   is below `r` (wiped or restored), is [`Error::Expired`], so the reflector relists;
/// - deletes carry no value unless [`EtcdOptions::prev_kv`] is set: the cache supplies it;
/// - progress notifications become bookmarks only on etcd versions whose progress revision can be
///   trusted (3.4.25+, 3.5.8+); on older ones they only prove the watch is alive;
/// - a value that does not decode is reported ([`DecodeError`]: key and revision, via `tracing`,
///   [`decode_errors`](Self::decode_errors) and [`EtcdOptions::on_decode_error`]) and the key is
///   treated as absent; nothing else is affected.
///
/// Keys are relative to the prefix and must be UTF-8 (others are reported like bad values).
///
/// Not `Clone`: a source keeps what it learned of the store (its identity, the key tally) to
/// check each re-watch, and two informers sharing one would corrupt each other's checks. Give
/// each informer its own source (sharing the `Client` is fine), or share the informer.
///
/// Usually handed to a [`SharedIndexInformer`](crate::SharedIndexInformer); used alone, it lists
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
    /// The store last seen; see [`Identity`].
    identity: Arc<Mutex<Identity>>,
    /// How many keys the prefix held at a revision, by the list and the events since; a
    /// re-watch checks etcd still agrees (see [`Tally`]).
    tally: Arc<Mutex<Tally>>,
    trust_progress: Arc<OnceCell<bool>>,
    token: TokenRenewal,
}

/// The number of keys under the prefix at a revision, as the list and the watched events
/// since it say. When a watch is opened again from that revision, etcd's count there must
/// agree: a store wiped and written past the old revision before the informer reconnects
/// (same cluster id, no lower revision to show it) almost never holds the same number of keys
/// at that revision.
#[derive(Debug, Clone, Copy, Default)]
struct Tally {
    revision: i64,
    keys: i64,
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
            identity: Arc::new(Mutex::new(Identity::default())),
            tally: Arc::new(Mutex::new(Tally::default())),
            trust_progress: Arc::new(OnceCell::new()),
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
        }
    }

    /// Lists the prefix at one revision. Each page is decoded on a blocking thread while the
    /// next is fetched; with a `sink`, that thread also hands the page to it (and the result
    /// holds no items).
    async fn list_inner(&self, sink: Option<Arc<dyn ListSink<T>>>) -> Result<ListResult<T>> {
        self.token.renew_if_refused(&self.client).await;
        let kv = self
            .client
            .kv_client()
            .max_decoding_message_size(self.options.max_message_bytes);
        let mut revision = 0i64;
        let mut start = self.first_key();
        let mut decoding = Vec::new();
        let mut pages = 0;
        // Shrinks for good if a page is too large for one message.
        let mut max_page = self.options.page_size;
        let mut page_size = max_page.min(FIRST_PAGE);
        loop {
            let mut options = GetOptions::new()
                .with_range(self.range_end.clone())
                .with_limit(page_size);
            if revision != 0 {
                // Every page after the first is read at the first page's revision: the header of
                // each response carries etcd's *current* revision, never the one read at.
                options = options.with_revision(revision);
            }
            // A page may take a while to send, so a second attempt goes out only once the
            // first has been silent as long as a watch may be (a member that hangs).
            let deadline = Instant::now() + self.options.page_timeout;
            let got = hedged(
                self.options.idle_timeout,
                deadline,
                member_unreachable,
                || {
                    let mut kv = kv.clone();
                    let (start, options) = (start.clone(), options.clone());
                    async move { kv.get(start, Some(options)).await }
                },
            )
            .await;
            let mut resp = match got {
                Hedged::Answered(resp) => resp,
                Hedged::TimedOut => {
                    return Err(Error::unavailable(format!(
                        "list of {} timed out after {:?} (page {pages})",
                        self.prefix(),
                        self.options.page_timeout
                    )))
                }
                // A page too big for one message (large values): retry it in smaller pages,
                // rather than failing the same way on every relist forever.
                Hedged::Failed(e) if page_size > 1 && is_message_too_large(&e) => {
                    page_size = (page_size / 4).max(1);
                    max_page = page_size;
                    tracing::warn!(prefix = %self.prefix(), page_size, error = %e, "list page too large; retrying with smaller pages");
                    continue;
                }
                Hedged::Failed(e) => return Err(self.failed(e, revision)),
            };
            if revision == 0 {
                revision = resp.header().map_or(0, |h| h.revision());
                if let Some(reason) = self.store_changed(resp.header()).await {
                    return Err(Error::StoreReplaced { revision, reason });
                }
                if let Some(sink) = &sink {
                    sink.begin(revision, usize::try_from(resp.count()).unwrap_or(0));
                }
            }
            if pages == 0 {
                // The first page counts the whole range: size the rest from it.
                page_size = (resp.count() / LIST_PAGES).max(FIRST_PAGE).min(max_page);
            }
            pages += 1;
            let more = resp.more();
            let kvs: Vec<PbKeyValue> = resp.take_kvs().into_iter().map(|kv| kv.0).collect();
            if let Some(newer) = kvs.iter().find(|kv| kv.mod_revision > revision) {
                return Err(Error::transient(format!(
                    "list of {} is inconsistent: key {:?} has mod_revision {} above the list revision {revision}",
                    self.prefix(),
                    String::from_utf8_lossy(&newer.key),
                    newer.mod_revision
                )));
            }
            if more {
                match kvs.last() {
                    Some(last) => {
                        start = last.key.clone();
                        start.push(0);
                    }
                    None => {
                        return Err(Error::transient(format!(
                            "list of {}: etcd said more keys follow an empty page",
                            self.prefix()
                        )))
                    }
                }
            }
            // Decode this page on a blocking thread while the next one is fetched.
            let decoder = self.decoder();
            let sink = sink.clone();
            decoding.push(tokio::task::spawn_blocking(move || {
                let mut undecodable = 0;
                let Some(sink) = sink else {
                    let mut objects = Vec::with_capacity(kvs.len());
                    for kv in kvs {
                        match decoder.object(&kv) {
                            Some(obj) => objects.push(obj),
                            None => undecodable += 1,
                        }
                    }
                    let decoded = objects.len();
                    return (objects, decoded, undecodable);
                };
                let mut objects = Vec::with_capacity(kvs.len());
                for kv in kvs {
                    let cached = std::str::from_utf8(relative(&decoder.prefix, &kv.key))
                        .ok()
                        .and_then(|key| sink.cached(key, kv.mod_revision));
                    match cached.or_else(|| decoder.object(&kv).map(Arc::new)) {
                        Some(obj) => objects.push(obj),
                        None => undecodable += 1,
                    }
                }
                let decoded = objects.len();
                sink.page(objects);
                (Vec::new(), decoded, undecodable)
            }));
            if !more {
                break;
            }
        }
        let mut items = Vec::new();
        let mut decoded = 0;
        let mut undecodable = 0;
        for page in decoding {
            let (page, count, bad) = page.await.map_err(|e| {
                Error::transient(format!("decoding a page of {} failed: {e}", self.prefix()))
            })?;
            if items.is_empty() {
                items = page;
            } else {
                items.extend(page);
            }
            decoded += count;
            undecodable += bad;
        }
        *lock(&self.tally) = Tally {
            revision,
            keys: (decoded + undecodable) as i64,
        };
        tracing::debug!(prefix = %self.prefix(), revision, pages, items = decoded, "listed");
        Ok(ListResult { items, revision })
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
    fn decode_errors(&self) -> u64 {
        EtcdListerWatcher::decode_errors(self)
    }

    /// [`EtcdOptions::idle_timeout`]: a live watch probes its stream well within it.
    fn liveness_bound(&self) -> Option<Duration> {
        Some(self.options.idle_timeout)
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
                token: self.token.clone(),
            };
            let span =
                tracing::info_span!("etcd_watch", prefix = %self.prefix(), after = after_revision);
            tokio::spawn(task.run(requests, responses, created).instrument(span));
            Ok(Box::pin(Responses {
                rx,
                current: VecDeque::new(),
            }) as WatchStream<T>)
        })
    }

    /// One linearizable (or pinned) range read of the prefix, keys only, filtered to keys
    /// modified after `since`: etcd's header revision, the number of keys under the prefix, and
    /// whether any was written. If none was, only deletes can have changed the prefix, and each
    /// lowers its count: a second read counts the prefix at `since`, and equal counts prove
    /// nothing changed. Both are etcd's own figures, so keys that do not decode need no
    /// bookkeeping, and the proof is about the two revisions it names, whatever the watch has
    /// read meanwhile. Correct on every etcd version (no progress notification needed), through
    /// the gRPC proxy too. `cached` is not needed.
    fn freshness(
        &self,
        since: i64,
        _cached: usize,
        at: Option<i64>,
    ) -> BoxFuture<'_, Result<Freshness>> {
        Box::pin(async move {
            self.token.renew_if_refused(&self.client).await;
            // etcd filters by mod_revision before applying the limit, and counts the whole
            // range: one key at most comes back, and `count` is the prefix's size.
            let mut options = GetOptions::new()
                .with_range(self.range_end.clone())
                .with_keys_only()
                .with_min_mod_revision(since + 1)
                .with_limit(1);
            if let Some(at) = at {
                options = options.with_revision(at);
            }
            let resp = match read(
                &self.client,
                &self.first_key(),
                options,
                self.options.page_timeout,
            )
            .await
            {
                Hedged::Answered(resp) => resp,
                Hedged::Failed(e) => return Err(self.failed(e, at.unwrap_or(0))),
                Hedged::TimedOut => {
                    return Err(Error::unavailable(format!(
                        "reading the revision of {} timed out after {:?}",
                        self.prefix(),
                        self.options.page_timeout
                    )))
                }
            };
            let revision = at.unwrap_or_else(|| resp.header().map_or(0, |h| h.revision()));
            if !resp.kvs().is_empty() || revision <= since || since == 0 {
                return Ok(Freshness {
                    revision,
                    unchanged: resp.kvs().is_empty() && since > 0,
                });
            }
            let options = GetOptions::new()
                .with_range(self.range_end.clone())
                .with_count_only()
                .with_revision(since);
            let first = self.first_key();
            let unchanged = match read(&self.client, &first, options, self.options.page_timeout)
                .await
            {
                Hedged::Answered(then) => then.count() == resp.count(),
                // `since` compacted away: no proof; the caller waits for the cache instead.
                Hedged::Failed(e) if classify_code(&e) == Some(tonic::Code::OutOfRange) => false,
                Hedged::Failed(e) => return Err(self.failed(e, since)),
                Hedged::TimedOut => {
                    return Err(Error::unavailable(format!(
                        "counting the keys of {} at revision {since} timed out after {:?}",
                        self.prefix(),
                        self.options.page_timeout
                    )))
                }
            };
            Ok(Freshness {
                revision,
                unchanged,
            })
        })
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The watch stream: etcd's responses, one at a time, flattened into events. A response is
/// taken whole, so a revision's events are yielded without a wait in between.
struct Responses<T> {
    rx: mpsc::Receiver<Vec<WatchEvent<T>>>,
    current: VecDeque<WatchEvent<T>>,
}

// Nothing is pinned structurally: the fields are only moved through `&mut`.
impl<T> Unpin for Responses<T> {}

impl<T> Stream for Responses<T> {
    type Item = WatchEvent<T>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if let Some(event) = self.current.pop_front() {
                return Poll::Ready(Some(event));
            }
            match self.rx.poll_recv(cx) {
                Poll::Ready(Some(events)) => self.current = events.into(),
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// Turns etcd values into objects, reporting those that do not decode.
struct Decoder<T> {
    prefix: Arc<[u8]>,
    codec: Arc<dyn Codec<T>>,
    errors: Arc<AtomicU64>,
    on_error: Option<DecodeErrorHandler>,
}

impl<T: 'static> Decoder<T> {
    /// The key relative to the prefix; a key that is not UTF-8 is reported.
    fn key(&self, full: &[u8], revision: i64) -> Option<Arc<str>> {
        let key = relative_key(&self.prefix, full);
        if key.is_none() {
            self.report(full, revision, DecodeErrorKind::KeyNotUtf8);
        }
        key
    }

    fn object(&self, kv: &PbKeyValue) -> Option<Object<T>> {
        let key = self.key(&kv.key, kv.mod_revision)?;
        match self.codec.decode(&kv.value) {
            Ok(value) => {
                let mut obj = Object::new(key, kv.mod_revision, value);
                obj.create_revision = kv.create_revision;
                obj.version = kv.version;
                obj.lease = kv.lease;
                Some(obj)
            }
            Err(source) => {
                self.report(&kv.key, kv.mod_revision, DecodeErrorKind::Value(source));
                None
            }
        }
    }

    fn report(&self, key: &[u8], revision: i64, kind: DecodeErrorKind) {
        let error = DecodeError::new(key.to_vec(), revision, kind);
        self.errors.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(key = %error.escaped_key(), revision, %error, "undecodable key or value; treating the key as absent");
        if let Some(h) = &self.on_error {
            h(&error);
        }
    }
}

/// Reads one etcd watch stream and forwards its events.
///
/// Liveness is judged by this stream alone: a stream that has heard nothing for
/// `progress_interval` probes itself (a watch created on the same stream and canceled once
/// confirmed); one that has heard nothing for `idle_timeout`, the probe's answer included, is
/// on a member that stopped answering and fails as unavailable.
struct WatchTask<T> {
    client: Client,
    /// The watched range, for consistency checks.
    range: (Vec<u8>, Vec<u8>),
    decoder: Decoder<T>,
    identity: Arc<Mutex<Identity>>,
    tally: Arc<Mutex<Tally>>,
    /// The prefix, for messages.
    name: String,
    after: i64,
    /// The newest revision sent to the reflector (or `after`): what a probe's bookmark says.
    delivered: i64,
    /// The id etcd gave the prefix's watch; responses for other ids answer probes.
    watch_id: i64,
    /// A linearizable read showed that the cluster is past `after` while this member lags
    /// behind it: the member's events catch up on their own.
    lag_confirmed: bool,
    trust_progress: bool,
    progress_interval: Duration,
    idle_timeout: Duration,
    tx: mpsc::Sender<Vec<WatchEvent<T>>>,
    token: TokenRenewal,
}

const PUT: i32 = 0;
const DELETE: i32 = 1;

impl<T: Send + Sync + 'static> WatchTask<T> {
    async fn run(
        mut self,
        mut requests: etcd_client::WatchRequestSender,
        mut responses: etcd_client::WatchResponseStream,
        created: etcd_client::WatchResponse,
    ) {
        if let Err(e) = self.handle(created).await {
            self.fail(e).await;
            return;
        }
        // Checked often enough that a probe goes out soon after `progress_interval` of silence.
        let mut tick = tokio::time::interval(self.progress_interval / 4);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut heard = Instant::now();
        let mut probing = false;
        loop {
            let message = tokio::select! {
                m = responses.message() => m,
                _ = tick.tick() => {
                    let silent = heard.elapsed();
                    if silent >= self.idle_timeout {
                        self.fail(Error::unavailable(format!(
                            "the watch of {} heard nothing on its stream for {silent:?}, a probe of it included; its member stopped answering",
                            self.name
                        )))
                        .await;
                        return;
                    }
                    if silent >= self.progress_interval && !probing {
                        probing = true;
                        // The prefix itself, from now: a synced watch, answered at once.
                        let probe = WatchOptions::new();
                        let mut sent = requests.watch(self.range.0.clone(), Some(probe)).await;
                        if sent.is_ok() && self.trust_progress {
                            sent = requests.request_progress().await;
                        }
                        if sent.is_err() {
                            self.fail(Error::unavailable(format!("the watch stream of {} closed", self.name))).await;
                            return;
                        }
                    }
                    continue;
                }
                _ = self.tx.closed() => return,
            };
            let response = match message {
                Ok(Some(r)) => r,
                Ok(None) => {
                    self.fail(Error::unavailable(format!(
                        "etcd ended the watch stream of {}",
                        self.name
                    )))
                    .await;
                    return;
                }
                Err(e) => {
                    let error = classify(e, self.after);
                    self.token.note(&error);
                    self.fail(named(error, &self.name)).await;
                    return;
                }
            };
            probing = false;
            // etcd answers progress requests with watch id -1.
            let probe_answer = response.watch_id() != self.watch_id && response.watch_id() != -1;
            let handled = if probe_answer {
                self.answered(&mut requests, &response).await
            } else {
                self.handle(response).await
            };
            // Waiting for the reflector to take events is not silence from etcd.
            heard = Instant::now();
            if let Err(e) = handled {
                self.fail(e).await;
                return;
            }
        }
    }

    /// A probe was answered: cancels it once created, and tells the reflector the stream is
    /// alive with a bookmark at the revision already delivered (etcd delivers a revision's
    /// events in one response, so nothing of it is left behind).
    async fn answered(
        &mut self,
        requests: &mut etcd_client::WatchRequestSender,
        response: &etcd_client::WatchResponse,
    ) -> Result<(), Error> {
        if response.created() && !response.canceled() {
            requests.cancel(response.watch_id()).await.map_err(|_| {
                Error::unavailable(format!("the watch stream of {} closed", self.name))
            })?;
            if self.delivered > 0 {
                self.send(vec![WatchEvent::Bookmark(self.delivered)])
                    .await?;
            }
        }
        Ok(())
    }

    /// Forwards one response; an error ends the watch.
    async fn handle(&mut self, mut response: etcd_client::WatchResponse) -> Result<(), Error> {
        let header_revision = response.header().map_or(0, |h| h.revision());
        if response.compact_revision() != 0 {
            return Err(Error::expired(
                self.after + 1,
                format!(
                    "etcd compacted up to revision {}",
                    response.compact_revision()
                ),
            ));
        }
        if response.canceled() {
            let reason = response.cancel_reason().to_owned();
            if reason.contains("compacted") {
                return Err(Error::expired(self.after + 1, reason));
            }
            let error = Error::transient(format!(
                "etcd canceled the watch of {}: {reason}",
                self.name
            ));
            self.token.note(&error);
            return Err(error);
        }
        if let Some(header) = response.header() {
            let seen = Identity {
                cluster_id: header.cluster_id(),
                raft_term: header.raft_term(),
            };
            if let Some(reason) = store_changed(
                &self.client,
                &self.identity,
                seen,
                &self.range,
                self.idle_timeout / 2,
            )
            .await
            {
                *lock(&self.identity) = seen;
                return Err(Error::StoreReplaced {
                    revision: self.after + 1,
                    reason,
                });
            }
        }
        if header_revision != 0 && header_revision < self.after {
            if !self.lag_confirmed {
                self.behind(header_revision).await?;
                self.lag_confirmed = true;
            }
        } else {
            self.lag_confirmed = false;
        }
        if response.created() {
            self.check_tally().await?;
        }
        let events = std::mem::take(&mut response.0.events);
        if events.is_empty() {
            if !response.created() && self.trust_progress && header_revision > self.after {
                // Nothing under the prefix changed up to the bookmark: the key tally holds there
                // too, so the next re-watch still checks it.
                {
                    let mut tally = lock(&self.tally);
                    if tally.revision == self.after {
                        tally.revision = header_revision;
                    }
                }
                self.after = header_revision;
                self.delivered = self.delivered.max(header_revision);
                self.send(vec![WatchEvent::Bookmark(header_revision)])
                    .await?;
            }
            return Ok(());
        }
        // One message per response: a revision's events stay together.
        // The bookkeeping locks are taken once per response, not once per event.
        let out = {
            let mut out = Vec::with_capacity(events.len());
            let mut tally = lock(&self.tally);
            for event in events {
                let Some(kv) = event.kv else { continue };
                let revision = kv.mod_revision;
                if revision <= self.after {
                    // Already delivered before a reconnect: etcd has shipped bugs that repeat events.
                    continue;
                }
                if tally.revision <= revision {
                    tally.revision = revision;
                    match event.r#type {
                        PUT if kv.version == 1 => tally.keys += 1,
                        DELETE => tally.keys -= 1,
                        _ => {}
                    }
                }
                let decoded = match event.r#type {
                    PUT => Some(self.decoder.object(&kv)),
                    _ => None,
                };
                let forwarded = match (event.r#type, decoded) {
                    (PUT, Some(decoded)) => match decoded {
                        Some(obj) if obj.version == 1 => WatchEvent::Added(obj),
                        Some(obj) => WatchEvent::Modified(obj),
                        // Undecodable (already reported): from now on the key is absent.
                        None => match relative_key(&self.decoder.prefix, &kv.key) {
                            Some(key) => WatchEvent::Deleted {
                                key,
                                revision,
                                last: None,
                            },
                            None => continue,
                        },
                    },
                    (DELETE, _) => {
                        let Some(key) = self.decoder.key(&kv.key, revision) else {
                            continue;
                        };
                        WatchEvent::Deleted {
                            key,
                            revision,
                            last: event.prev_kv.and_then(|p| self.decoder.object(&p)),
                        }
                    }
                    (other, _) => {
                        tracing::warn!(
                            event_type = other,
                            revision,
                            "unknown etcd event type; skipped"
                        );
                        continue;
                    }
                };
                out.push(forwarded);
            }
            out
        };
        if let Some(last) = out.last().and_then(WatchEvent::revision) {
            self.delivered = self.delivered.max(last);
        }
        if !out.is_empty() {
            self.send(out).await?;
        }
        Ok(())
    }

    /// On a watch opened from the revision the tally is at: etcd must count as many keys under
    /// the prefix at that revision as the list and the events since did (see [`Tally`]).
    async fn check_tally(&self) -> Result<(), Error> {
        let tally = *lock(&self.tally);
        if tally.revision != self.after || self.after == 0 {
            return Ok(());
        }
        let options = GetOptions::new()
            .with_range(self.range.1.clone())
            .with_count_only()
            .with_revision(self.after);
        let timeout = self.idle_timeout / 2;
        match read(&self.client, &self.range.0, options, timeout).await {
            Hedged::Answered(resp) if resp.count() != tally.keys => Err(Error::StoreReplaced {
                revision: self.after + 1,
                reason: format!(
                    "etcd counts {} keys under {} at revision {}, where the watch counted {}: the store was replaced",
                    resp.count(),
                    self.name,
                    self.after,
                    tally.keys
                ),
            }),
            Hedged::Answered(_) => Ok(()),
            Hedged::Failed(e) => Err(named(classify(e, self.after), &self.name)),
            Hedged::TimedOut => Err(Error::unavailable(format!(
                "counting the keys of {} at revision {} got no answer within {timeout:?}",
                self.name, self.after
            ))),
        }
    }

    /// The watch reports a revision below the one it started after: either this member lags
    /// behind the cluster (its events catch up on their own: keep the stream), or the whole
    /// store went back in time (relist). A linearizable read, answered only with the cluster's
    /// current revision, tells which; without an answer, the watch is tried again.
    async fn behind(&self, header_revision: i64) -> Result<(), Error> {
        // One key, no value: only the header's revision matters.
        let options = GetOptions::new()
            .with_range(self.range.1.clone())
            .with_limit(1)
            .with_keys_only();
        match read(&self.client, &self.range.0, options, self.idle_timeout / 2).await {
            Hedged::Answered(resp) => {
                let cluster = resp.header().map_or(0, |h| h.revision());
                if cluster < self.after {
                    return Err(Error::StoreReplaced {
                        revision: self.after + 1,
                        reason: format!(
                            "etcd is at revision {cluster}, below the watched revision {}: the store was wiped or restored",
                            self.after
                        ),
                    });
                }
                tracing::debug!(
                    member = header_revision,
                    cluster,
                    after = self.after,
                    "the member serving the watch lags behind its cluster; its events will catch up"
                );
                Ok(())
            }
            _ => Err(Error::unavailable(format!(
                "the member serving the watch of {} is at revision {header_revision}, behind the watched revision {}, and the cluster's revision could not be read",
                self.name, self.after
            ))),
        }
    }

    async fn send(&self, events: Vec<WatchEvent<T>>) -> Result<(), Error> {
        self.tx
            .send(events)
            .await
            .map_err(|_| Error::transient("the reflector stopped watching"))
    }

    /// Reports the error that ends this watch.
    async fn fail(&self, error: Error) {
        let _ = self.tx.send(vec![WatchEvent::Error(error)]).await;
    }
}

/// A small range read starting at `key`, hedged across members (see [`hedged`]) and bounded
/// by `timeout`: reads that gate the watch must not wait on a member that hangs.
async fn read(
    client: &Client,
    key: &[u8],
    options: GetOptions,
    timeout: Duration,
) -> Hedged<etcd_client::GetResponse, etcd_client::Error> {
    let kv = client.kv_client();
    hedged(
        HEDGE_AFTER,
        Instant::now() + timeout,
        member_unreachable,
        || {
            let mut kv = kv.clone();
            let (key, options) = (key.to_vec(), options.clone());
            async move { kv.get(key, Some(options)).await }
        },
    )
    .await
}

/// `full` without `prefix`, if it is UTF-8.
fn relative_key(prefix: &[u8], full: &[u8]) -> Option<Arc<str>> {
    std::str::from_utf8(relative(prefix, full))
        .ok()
        .map(Arc::from)
}

/// `full` without `prefix`.
fn relative<'k>(prefix: &[u8], full: &'k [u8]) -> &'k [u8] {
    full.strip_prefix(prefix).unwrap_or(full)
}

/// The end of the range of keys starting with `prefix` (etcd's `GetPrefixRangeEnd`).
fn prefix_range_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // All 0xff (or empty): every key from the prefix on.
    vec![0]
}

/// Whether an error says the member could not be reached (another one may answer).
fn member_unreachable(e: &etcd_client::Error) -> bool {
    classify_code(e) == Some(tonic::Code::Unavailable) || broken_connection(e)
}

/// Whether the error was made on our side from a broken or refused connection: a transport or
/// I/O error, or a status of code Unknown carrying such an error as its source (one etcd sent
/// carries none).
fn broken_connection(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(status) => {
            status.code() == tonic::Code::Unknown && std::error::Error::source(status).is_some()
        }
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        _ => false,
    }
}

/// The gRPC status code of an error etcd (or the transport) returned, if it has one.
fn classify_code(e: &etcd_client::Error) -> Option<tonic::Code> {
    match e {
        etcd_client::Error::GRpcStatus(status) => Some(status.code()),
        _ => None,
    }
}

/// Whether a response exceeded a gRPC message size limit (the client's or etcd's).
fn is_message_too_large(e: &etcd_client::Error) -> bool {
    use tonic::Code;
    match classify_code(e) {
        // etcd's send limit, or ours as etcd reports it.
        Some(Code::ResourceExhausted) => true,
        // Our decoder's limit. etcd uses the same code for a compacted or a future revision,
        // which its text tells apart.
        Some(Code::OutOfRange) => !e.to_string().contains("revision"),
        _ => false,
    }
}

/// Sorts etcd's errors by what recovers from them, on their gRPC status code: a compacted
/// revision (OutOfRange) needs a relist; an etcd that cannot be reached or cannot serve now
/// (transport errors, Unavailable, which includes "no leader", DeadlineExceeded, Cancelled,
/// Aborted, and Unknown made from a broken connection) is retried as soon as it answers; anything else etcd answered is retried with the
/// protective backoff.
fn classify(e: etcd_client::Error, revision: i64) -> Error {
    use tonic::Code;
    let message = e.to_string();
    let error = match &e {
        _ if broken_connection(&e) => Error::unavailable(message),
        etcd_client::Error::GRpcStatus(status) => match status.code() {
            Code::OutOfRange if message.contains("compacted") => Error::expired(revision, message),
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Aborted => {
                Error::unavailable(message)
            }
            _ => Error::transient(message),
        },
        _ if message.contains("required revision has been compacted") => {
            Error::expired(revision, message)
        }
        _ => Error::transient(message),
    };
    error.with_source(e)
}

/// Prefixes a transient error's message with the prefix it concerns.
fn named(mut error: Error, prefix: &str) -> Error {
    if let Error::Transient { message, .. } | Error::Unavailable { message, .. } = &mut error {
        *message = format!("{prefix}: {message}");
    }
    error
}

/// Renews the auth token before the next attempt when etcd refused it (it forgets simple tokens
/// after `--auth-token-ttl`; a watch stream keeps the token it was opened with). Renewing right
/// before the retry, not when the error arrives, keeps the new token from expiring unused during
/// the backoff when the TTL is shorter than the delay. etcd 3.4 reports a refused token on a
/// watch as "permission denied", so that too renews (one Authenticate call per retry, which the
/// backoff spaces out). A client without credentials does nothing.
#[derive(Clone, Default)]
struct TokenRenewal(Arc<AtomicBool>);

impl TokenRenewal {
    /// Remembers to renew the token if `error` says etcd refused it: by its gRPC status code
    /// when etcd sent one (Unauthenticated for a forgotten token, PermissionDenied, which etcd
    /// 3.4 answers a watch with an expired token); by the text of a watch's cancel reason,
    /// which is all etcd gives there.
    fn note(&self, error: &Error) {
        use tonic::Code;
        let refused = match error.etcd_error() {
            Some(etcd_client::Error::GRpcStatus(status)) => matches!(
                status.code(),
                Code::Unauthenticated | Code::PermissionDenied
            ),
            Some(_) => false,
            None => {
                let message = error.to_string();
                [
                    "invalid auth token",
                    "permission denied",
                    "user name is empty",
                ]
                .iter()
                .any(|m| message.contains(m))
            }
        };
        if refused {
            self.0.store(true, Ordering::Relaxed);
        }
    }

    /// Authenticates again if a refused token was noted since the last attempt.
    async fn renew_if_refused(&self, client: &Client) {
        if self.0.swap(false, Ordering::Relaxed) {
            match tokio::time::timeout(RENEW_TIMEOUT, client.refresh_token()).await {
                Ok(Ok(())) => tracing::info!("etcd refused the auth token; authenticated again"),
                Ok(Err(e)) => tracing::warn!(error = %e, "authenticating again failed"),
                Err(_) => {
                    tracing::warn!(timeout = ?RENEW_TIMEOUT, "authenticating again got no answer")
                }
            }
        }
    }
}

/// Whether `seen` is another store than the one recorded: another cluster id, or a raft term
/// below the highest seen that a linearizable read confirms. Records the highest term.
async fn store_changed(
    client: &Client,
    identity: &Mutex<Identity>,
    seen: Identity,
    range: &(Vec<u8>, Vec<u8>),
    timeout: Duration,
) -> Option<String> {
    let known = *lock(identity);
    if known.cluster_id == 0 || seen.cluster_id == 0 {
        let mut identity = lock(identity);
        identity.cluster_id = identity.cluster_id.max(seen.cluster_id);
        identity.raft_term = identity.raft_term.max(seen.raft_term);
        return None;
    }
    if seen.cluster_id != known.cluster_id {
        return Some(format!(
            "etcd's cluster id changed from {:x} to {:x}: the store was replaced",
            known.cluster_id, seen.cluster_id
        ));
    }
    if seen.raft_term < known.raft_term {
        // A member that was down may not know its cluster's term yet; a linearizable read is
        // answered only once it does.
        let options = GetOptions::new()
            .with_range(range.1.clone())
            .with_count_only();
        // Bounded: this runs on the watch's task, which must not hang with a member that
        // stopped answering. Unconfirmed, the store is not replaced.
        let term = match read(client, &range.0, options, timeout).await {
            Hedged::Answered(r) => r.header().map(|h| h.raft_term()),
            _ => None,
        };
        if term.is_some_and(|t| t < known.raft_term) {
            return Some(format!(
                "etcd's raft term went back from {} to {}: the store was wiped or restored",
                known.raft_term,
                term.unwrap_or(0)
            ));
        }
        return None;
    }
    lock(identity).raft_term = seen.raft_term;
    None
}

/// The watch bugs fixed after `version` (SEMANTICS.md, etcd rule 19), each with what the
/// source does about it.
fn known_watch_bugs(version: &str) -> Vec<&'static str> {
    let (major, minor, patch) = parse_version(version);
    let mut bugs = Vec::new();
    let before = |m: u32, p: u32| (major, minor) == (3, m) && patch < p;
    if before(4, 24) {
        bugs.push("duplicated events (fixed in 3.4.24): dropped, every event at or below the revision delivered is skipped");
    }
    if before(4, 25) || before(5, 8) {
        bugs.push("responses going back in time, progress out of step with the stream (fixed in 3.4.25 / 3.5.8): a member behind the watched revision is checked, progress never advances the cache");
    }
    if before(4, 31) {
        bugs.push("events lost after a compaction (fixed in 3.4.31): not detectable on the stream; the key tally at each re-watch and every relist repair the cache");
    }
    if before(4, 36) {
        bugs.push("a missing delete when a watch opens at the compaction revision (fixed in 3.4.36): not detectable on the stream; the next relist repairs it");
    }
    if (major, minor) == (3, 5) && patch < 3 {
        bugs.push("a member killed during an apply can come back with its revisions off from its cluster's for good (etcd-io/etcd#13766, fixed in 3.5.3): not detectable by a client of that member alone; etcd's --experimental-initial-corrupt-check finds it");
    }
    if before(4, 38) {
        bugs.push("a watch on a future revision returning old events (fixed in 3.4.38): dropped, as duplicates");
    }
    bugs
}

/// Warns once per process and etcd version of the watch bugs that version has.
fn warn_of_known_watch_bugs(version: &str) {
    static WARNED: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let bugs = known_watch_bugs(version);
    if bugs.is_empty()
        || !lock(&WARNED)
            .get_or_insert_with(HashSet::new)
            .insert(version.to_string())
    {
        return;
    }
    tracing::warn!(
        etcd_version = version,
        bugs = %bugs.join("; "),
        "this etcd version has known watch bugs; see the README's \"etcd versions\" for what the informer does about each"
    );
}

/// `major.minor.patch` of a version string; missing or unreadable parts are 0.
fn parse_version(version: &str) -> (u32, u32, u32) {
    let mut parts = version.split('.').map(|p| {
        p.chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse::<u32>()
            .unwrap_or(0)
    });
    (
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
    )
}

/// Whether an etcd version reports progress revisions that can be trusted to advance the watch:
/// RequestProgress could report a revision ahead of undelivered events before 3.4.25 / 3.5.8.
fn progress_is_trustworthy(version: &str) -> bool {
    let (major, minor, patch) = parse_version(version);
    match (major, minor) {
        (3, 4) => patch >= 25,
        (3, 5) => patch >= 8,
        (3, m) => m > 5,
        (m, _) => m > 3,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_end_of_prefix() {
        assert_eq!(prefix_range_end(b"/a/"), b"/a0");
        assert_eq!(prefix_range_end(b"a\xff"), b"b");
        assert_eq!(prefix_range_end(b"\xff\xff"), vec![0]);
    }

    #[test]
    fn progress_trust_by_version() {
        assert!(!progress_is_trustworthy("3.4.23"));
        assert!(progress_is_trustworthy("3.4.25"));
        assert!(!progress_is_trustworthy("3.5.7"));
        assert!(progress_is_trustworthy("3.5.17"));
        assert!(progress_is_trustworthy("3.6.0"));
        assert!(!progress_is_trustworthy("garbage"));
    }

    #[test]
    fn known_watch_bugs_by_version() {
        assert_eq!(known_watch_bugs("3.4.23").len(), 5);
        assert_eq!(known_watch_bugs("3.4.30").len(), 3);
        assert_eq!(known_watch_bugs("3.4.38").len(), 0);
        assert_eq!(known_watch_bugs("3.5.1").len(), 2);
        assert!(known_watch_bugs("3.5.8").is_empty());
        assert!(known_watch_bugs("3.6.0").is_empty());
    }
}
