//! How an informer is set up: [`InformerOptions`] and the [`Processing`] modes.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::codec::Codec;
use crate::reflector::{Backoff, TransformFn, WatchErrorHandler};
use crate::snapshot::SnapshotOptions;
use crate::store::Indexers;

/// The backlog bound of an [`EventStream`](crate::EventStream) when [`InformerOptions::max_handler_backlog`] is
/// `None`: a stream's consumer is async code that usually keeps up, so 1024 pending events is
/// far more than it needs in bursts, and at about 100 bytes each it keeps a sleeping consumer
/// to around 100 KB plus the objects (beyond that, events merge per key).
pub const DEFAULT_STREAM_BACKLOG: usize = 1024;

/// How an informer moves changes from the watch into its cache.
///
/// | | [`Atomic`](Processing::Atomic) (default) | [`DeltaFifo`](Processing::DeltaFifo) |
/// | --- | --- | --- |
/// | queue | [`RealFifo`](crate::RealFifo): every change in order, one batch per revision | [`DeltaFifo`](crate::DeltaFifo): one slot per key, changes coalesced |
/// | a reader of the cache sees | etcd at [`SharedIndexInformer::revision`](crate::SharedIndexInformer::revision), never part of a transaction | each key at some revision; a transaction can be seen half applied |
/// | handlers see across keys | etcd's order | first-changed key first |
/// | [`revision`](crate::SharedIndexInformer::revision) | exact | a lower bound |
///
/// Atomic is the default because its guarantee is the stronger one at no measured cost
/// (BENCHMARKS.md compares both). The DeltaFifo mode is the seed's and client-go's classic
/// pipeline; the `reflector` and `controller` examples use a `DeltaFifo` by hand.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Processing {
    /// Revision-atomic, in-order processing (client-go's `RealFIFO` with batch pop).
    #[default]
    Atomic,
    /// Per-key processing through a [`DeltaFifo`](crate::DeltaFifo).
    DeltaFifo,
}

/// What handlers hear of the keys a relist finds unchanged (same `mod_revision` as cached): after
/// a compaction, a relist of a large prefix finds nearly every key unchanged.
///
/// | | handlers told of an unchanged key | relist cost |
/// | --- | --- | --- |
/// | [`ResyncingHandlers`](RelistUnchanged::ResyncingHandlers) (default) | those due for a resync, as a resync (`on_update` with old and new at one revision): client-go's `Replaced` semantics | unchanged keys decoded only when a handler is due |
/// | [`Nobody`](RelistUnchanged::Nobody) | none; the resync period stays the way to revisit every key | unchanged keys never decoded |
/// | [`Everyone`](RelistUnchanged::Everyone) | every handler, as a resync | every key decoded, one notification each |
///
/// The relist costs are those of the default [`Processing::Atomic`]; a
/// [`Processing::DeltaFifo`] relist decodes every key whatever the choice.
///
/// A [`Runner`](crate::runner::Runner) queues resyncs below live changes, so a relist told to
/// everyone still does not delay them; with the default, a relist of unchanged keys makes no
/// reconcile at all unless a resync is due.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RelistUnchanged {
    /// Handlers due for a resync get a resync of each unchanged key; others hear nothing.
    #[default]
    ResyncingHandlers,
    /// No handler hears of unchanged keys.
    Nobody,
    /// Every handler gets a resync of each unchanged key (to re-verify everything after a gap
    /// in the watch).
    Everyone,
}

/// Options of a [`SharedIndexInformer`](crate::informer::SharedIndexInformer).
///
/// Start from `default()` and change what you need; the fields say what each does.
///
/// ```
/// use std::time::Duration;
/// use etcd_informer::{InformerOptions, Processing};
///
/// #[derive(serde::Deserialize)]
/// struct Service { zone: String }
///
/// let options = InformerOptions::<Service>::default()
///     .with_name("services")
///     .with_index("zone", |s| vec![s.value.zone.clone()])
///     // A handler that falls far behind gets its backlog merged per key.
///     .with_max_handler_backlog(Some(10_000))
///     .with_resync_period(Duration::from_secs(600));
/// assert_eq!(options.processing, Processing::Atomic);
/// ```
#[non_exhaustive]
pub struct InformerOptions<T> {
    /// A name for logs, spans and handler threads (the etcd prefix, usually).
    pub name: String,
    /// The resync period of handlers added without one; zero for none.
    pub resync_period: Duration,
    /// The indexes of the cache. The default has the namespace index.
    pub indexers: Indexers<T>,
    /// Applied to every object before it is cached.
    pub transform: Option<TransformFn<T>>,
    /// Past this many pending notifications a handler's backlog is merged per key, so it stays
    /// bounded by the number of keys while every key's final state is still delivered. `None`:
    /// every notification is delivered, however far behind the handler falls; an
    /// [`event_stream`](crate::SharedIndexInformer::event_stream) is bounded anyway, at
    /// [`DEFAULT_STREAM_BACKLOG`].
    pub max_handler_backlog: Option<usize>,
    /// Called with every list or watch failure.
    pub watch_error_handler: Option<WatchErrorHandler>,
    /// The reflector's protective backoff: relists close together, and retries after etcd
    /// answered with an error (default: client-go's 800 ms doubling to 30 s, reset after 2 min).
    pub backoff: Backoff,
    /// The reflector's delays between attempts to reach an etcd that does not answer
    /// (default [`Backoff::reconnect`]: 50 ms doubling to 1 s).
    pub reconnect: Backoff,
    /// How changes reach the cache; see [`Processing`].
    pub processing: Processing,
    /// `Some`: the cache is compact ([`Indexer::compact`](crate::Indexer::compact)): it keeps each object packed, its
    /// value encoded by this codec, and decodes it on every read. Handlers still get the
    /// decoded objects as they arrive; the cost is an encode and a decode per change, a decode
    /// per read, and one more per update or delete (the old object handed to handlers). Reads
    /// see values as they come back from the codec. Best with the default [`Processing`].
    pub compact: Option<Arc<dyn Codec<T>>>,
    /// What handlers hear of the keys a relist finds unchanged; see [`RelistUnchanged`].
    pub relist_unchanged: RelistUnchanged,
    /// How often the cache is audited against etcd ([`DEFAULT_AUDIT_PERIOD`]; `None`: never):
    /// a keys-only read of the prefix at the cache's revision, compared key by key with the
    /// cache's `mod_revision`s, that finds an event the watch lost and repairs it with a
    /// relist. Revision-atomic mode only. See [the audit](crate::guide::faults_and_health).
    pub audit_period: Option<Duration>,
    /// `Some`: the cache is saved to a local file and a restart resumes from it when etcd
    /// agrees (warm restart, see [`snapshot`](crate::snapshot)); `None` (the default): every
    /// start lists the prefix.
    pub snapshot: Option<SnapshotOptions<T>>,
}

/// The default [`InformerOptions::audit_period`]: 5 minutes, the Kubernetes apiserver's
/// consistency check period (KEP-4988). An audit of 1M keys reads their keys only (75 MB
/// against a list's 207 MB at 128-byte values) in about 5 s, costing etcd about 4 s of CPU and
/// this process about 1.3 s: 1.4% and 0.4% of a core at this period (BENCHMARKS.md, "The
/// audit").
pub const DEFAULT_AUDIT_PERIOD: Duration = Duration::from_secs(300);

impl<T> InformerOptions<T> {
    /// Sets the name for logs, spans and handler threads (`name`).
    #[must_use]
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Sets the default resync period of handlers (zero for none) (`resync_period`).
    #[must_use]
    pub fn with_resync_period(mut self, resync_period: Duration) -> Self {
        self.resync_period = resync_period;
        self
    }

    /// Replaces every index of the cache (`indexers`), the default namespace index included:
    /// pass [`namespace_indexers`](crate::namespace_indexers) extended with yours to keep it,
    /// or use [`with_index`](Self::with_index) to add one beside it.
    ///
    /// ```
    /// use etcd_informer::{IndexFunc, Indexers, InformerOptions, Object};
    ///
    /// struct Service { zone: String }
    ///
    /// // Only a zone index: `by_namespace` and the namespace index are gone.
    /// let by_zone = IndexFunc::new(|s: &Object<Service>| vec![s.value.zone.clone()]);
    /// let indexers = Indexers::from([("zone".to_owned(), by_zone)]);
    /// let options = InformerOptions::default().with_indexers(indexers);
    /// assert_eq!(options.indexers.len(), 1);
    /// ```
    #[must_use]
    pub fn with_indexers(mut self, indexers: Indexers<T>) -> Self {
        self.indexers = indexers;
        self
    }

    /// Adds the index `name` beside the others (the namespace index stays): `index` gives the
    /// values an object is listed under, none or several. Read it with
    /// [`Indexer::index_keys`](crate::Indexer::index_keys) or
    /// [`Lister::by_index`](crate::Lister::by_index); an index of the same name is replaced.
    ///
    /// ```
    /// use etcd_informer::{InformerOptions, NAMESPACE_INDEX};
    ///
    /// struct Service { zone: String }
    ///
    /// // Name the type once (`::<Service>`), so that the closure can read its fields.
    /// let options = InformerOptions::<Service>::default()
    ///     .with_index("zone", |s| vec![s.value.zone.clone()]);
    /// assert!(options.indexers.contains_key("zone") && options.indexers.contains_key(NAMESPACE_INDEX));
    /// ```
    #[must_use]
    pub fn with_index(
        mut self,
        name: impl Into<String>,
        index: impl Fn(&crate::object::Object<T>) -> Vec<String> + Send + Sync + 'static,
    ) -> Self {
        self.indexers
            .insert(name.into(), crate::store::IndexFunc::new(index));
        self
    }

    /// Sets the function applied to every object before it is cached (`transform`).
    #[must_use]
    pub fn with_transform(mut self, transform: Option<TransformFn<T>>) -> Self {
        self.transform = transform;
        self
    }

    /// Sets the backlog past which a handler's notifications are merged per key (`max_handler_backlog`).
    #[must_use]
    pub fn with_max_handler_backlog(mut self, max_handler_backlog: Option<usize>) -> Self {
        self.max_handler_backlog = max_handler_backlog;
        self
    }

    /// Sets the handler called with every list or watch failure (`watch_error_handler`).
    #[must_use]
    pub fn with_watch_error_handler(
        mut self,
        watch_error_handler: Option<WatchErrorHandler>,
    ) -> Self {
        self.watch_error_handler = watch_error_handler;
        self
    }

    /// Sets the reflector's protective backoff (`backoff`).
    #[must_use]
    pub fn with_backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Sets the reflector's delays between attempts to reach etcd (`reconnect`).
    #[must_use]
    pub fn with_reconnect(mut self, reconnect: Backoff) -> Self {
        self.reconnect = reconnect;
        self
    }

    /// Sets how changes reach the cache (`processing`).
    #[must_use]
    pub fn with_processing(mut self, processing: Processing) -> Self {
        self.processing = processing;
        self
    }

    /// Sets what handlers hear of the keys a relist finds unchanged (`relist_unchanged`).
    #[must_use]
    pub fn with_relist_unchanged(mut self, relist_unchanged: RelistUnchanged) -> Self {
        self.relist_unchanged = relist_unchanged;
        self
    }

    /// Makes the cache compact, its values packed with `codec` (`compact`): a fifth to a
    /// seventh of the memory for a decode on every read (BENCHMARKS.md).
    ///
    /// ```
    /// use etcd_informer::codec::JsonCodec;
    /// use etcd_informer::InformerOptions;
    /// let options = InformerOptions::<serde_json::Value>::default()
    ///     .with_compact_cache(JsonCodec::new());
    /// assert!(options.compact.is_some());
    /// ```
    #[must_use]
    pub fn with_compact_cache(mut self, codec: impl Codec<T>) -> Self {
        self.compact = Some(Arc::new(codec));
        self
    }

    /// Sets how often the cache is audited against etcd (`audit_period`; `None`: never).
    ///
    /// ```
    /// use std::time::Duration;
    /// use etcd_informer::InformerOptions;
    /// let options = InformerOptions::<String>::default().with_audit_period(Some(Duration::from_secs(60)));
    /// assert_eq!(options.audit_period, Some(Duration::from_secs(60)));
    /// ```
    #[must_use]
    pub fn with_audit_period(mut self, audit_period: Option<Duration>) -> Self {
        self.audit_period = audit_period;
        self
    }

    // ---- Warm restart from a snapshot (issue 26) ----
    /// Saves the cache to `path` (values encoded with `codec`) every
    /// [`DEFAULT_SNAPSHOT_PERIOD`](crate::snapshot::DEFAULT_SNAPSHOT_PERIOD) and when the
    /// informer stops, and starts from that file instead of a list when etcd still has its
    /// revision (`snapshot`; see [`snapshot`](crate::snapshot)). Needs the default
    /// [`Processing::Atomic`].
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use etcd_informer::{EtcdListerWatcher, InformerOptions, JsonCodec, SharedIndexInformer};
    /// let client = etcd_informer::connect(["127.0.0.1:2379"]).await?;
    /// let lw = EtcdListerWatcher::new(client, "/registry/configmaps/", JsonCodec::<serde_json::Value>::new())?;
    /// let options = InformerOptions::default()
    ///     .with_snapshot("/var/lib/agent/configmaps.snap", JsonCodec::new());
    /// let informer = SharedIndexInformer::new(lw, options);
    /// tokio::spawn(informer.clone().run());
    /// informer.wait_for_cache_sync().await;
    /// // "warm start from the snapshot at revision 1234 (1000 keys), no list", or why cold.
    /// println!("{}", informer.snapshot_start().expect("decided once synced"));
    /// # Ok(()) }
    /// ```
    #[must_use]
    pub fn with_snapshot(self, path: impl Into<std::path::PathBuf>, codec: impl Codec<T>) -> Self {
        self.with_snapshot_options(SnapshotOptions::new(path, codec))
    }

    /// Sets the snapshot's options (`snapshot`), for a period or codec id of your own.
    #[must_use]
    pub fn with_snapshot_options(mut self, snapshot: SnapshotOptions<T>) -> Self {
        self.snapshot = Some(snapshot);
        self
    }
}

impl<T: Send + Sync + 'static> Default for InformerOptions<T> {
    fn default() -> Self {
        InformerOptions {
            name: "informer".into(),
            resync_period: Duration::ZERO,
            indexers: crate::store::namespace_indexers(),
            transform: None,
            max_handler_backlog: None,
            watch_error_handler: None,
            backoff: Backoff::default(),
            reconnect: Backoff::reconnect(),
            processing: Processing::default(),
            compact: None,
            relist_unchanged: RelistUnchanged::default(),
            audit_period: Some(DEFAULT_AUDIT_PERIOD),
            snapshot: None,
        }
    }
}

impl<T> fmt::Debug for InformerOptions<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InformerOptions")
            .field("name", &self.name)
            .field("resync_period", &self.resync_period)
            .field("indexers", &self.indexers.keys().collect::<Vec<_>>())
            .field("max_handler_backlog", &self.max_handler_backlog)
            .field("processing", &self.processing)
            .field("compact", &self.compact.is_some())
            .field("relist_unchanged", &self.relist_unchanged)
            .field("audit_period", &self.audit_period)
            .field("snapshot", &self.snapshot)
            .finish_non_exhaustive()
    }
}
