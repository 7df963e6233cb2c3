//! How the etcd source is set up and connected: [`EtcdOptions`], [`ConfigError`], and a client
//! with the connection options the source needs.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};

use crate::codec::DecodeError;
use crate::listwatch::Result;

/// Called with every value that does not decode.
pub type DecodeErrorHandler = Arc<dyn Fn(&DecodeError) + Send + Sync>;

/// The most keys in the first page of a list (see [`EtcdOptions::page_size`]).
pub const FIRST_PAGE: i64 = 10_000;

/// How many pages a list aims at (see [`EtcdOptions::page_size`]).
pub const LIST_PAGES: i64 = 10;

/// How many pages a relist aims at when the cache holds at least half the keys (see
/// [`EtcdOptions::page_size`]).
pub const RELIST_PAGES: i64 = 20;

/// The gRPC message size our clients accept. tonic's default of 4 MiB fails a page of large
/// values on every retry, forever; pages are bounded by [`EtcdOptions::page_size`] instead.
pub const MAX_DECODING_MESSAGE_SIZE: usize = 1 << 30;

/// The smallest accepted [`EtcdOptions::max_message_bytes`]: above etcd's default request limit
/// of 1.5 MiB, so that one value always fits in a page.
pub(super) const MIN_MESSAGE_BYTES: usize = 2 << 20;

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

/// Options of an [`EtcdListerWatcher`](crate::listwatch::etcd::EtcdListerWatcher).
#[derive(Clone)]
#[non_exhaustive]
pub struct EtcdOptions {
    /// The most keys per list page; default 100,000. A list reads a first page of at most
    /// [`FIRST_PAGE`] keys, learns the prefix's size from it, and reads the rest in about
    /// [`LIST_PAGES`] pages of at least `FIRST_PAGE` and at most `page_size` keys: enough pages
    /// to build the cache from one while etcd serves the next, few enough that etcd 3.4, which
    /// walks every remaining key of the range for each page, does not go quadratic (1M keys took
    /// 13 s in 10,000-key pages against 4.9 s in 100,000-key ones; BENCHMARKS.md). A relist into
    /// a cache that holds at least half the keys aims at [`RELIST_PAGES`] pages instead: its
    /// pages are mostly keys kept from the cache, so little decoding overlaps the fetching,
    /// and each page in flight weighs on the memory peak. Lower it for values of many
    /// kilobytes, to keep each message small.
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
    /// Carry a key that is not UTF-8 as text ([`escape_key`](super::decode::escape_key))
    /// instead of reporting it undecodable: for the cache server, whose clients read etcd's
    /// bytes.
    pub(crate) escape_keys: bool,
    /// A watch that has heard nothing on its stream for this long (default 1 s) probes it: it
    /// creates a second watch on the same stream and cancels it, which etcd members and etcd's
    /// gRPC proxy both answer at once (etcd versions whose progress revisions can be trusted are
    /// also asked for a progress notification). Each answer is reported as a
    /// [`WatchEvent::Bookmark`](crate::WatchEvent::Bookmark) at the revision already delivered: the stream proved alive.
    pub progress_interval: Duration,
    /// A watch that has heard nothing on its own stream for this long (default 2 s), its probe
    /// included, is on a member that stopped answering: it fails as [`Error::Unavailable`](crate::listwatch::Error::Unavailable) and
    /// the reflector watches again (opening the new stream on whichever member answers first).
    /// Only the stream counts: a read answered by another member proves nothing about the
    /// member holding the watch. It is also how long an informer stays healthy without proof
    /// ([`Capabilities::liveness_bound`](crate::listwatch::Capabilities::liveness_bound)).
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
            escape_keys: false,
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

/// A bad argument to [`EtcdListerWatcher`](crate::listwatch::etcd::EtcdListerWatcher).
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
