//! # etcd-informer
//!
//! Kubernetes client-go's informer machinery (`tools/cache`) over any etcd key prefix: a local,
//! indexed, always-fresh cache of the prefix, and event handlers called on every change.
//!
//! The pipeline is client-go's:
//!
//! ```text
//! ListerWatcher ─▶ Reflector ─▶ RealFifo  ─▶ Indexer (cache + indexes) ─▶ handlers
//!  (etcd range +    (list, then   (a batch per  (SharedIndexInformer,      (a backlog each,
//!   watch)           watch)        revision)      Lister)                    shared thread)
//!                                 or DeltaFifo
//!                                 (per-key deltas)
//! ```
//!
//! By default ([`Processing::Atomic`]) every etcd revision (one transaction) is applied to the
//! cache under one lock, in etcd's order: the cache is always etcd at
//! [`SharedIndexInformer::revision`], and
//! [`consistent_lister`](SharedIndexInformer::consistent_lister) waits until it is at least as
//! fresh as etcd is now. [`Processing::DeltaFifo`] is client-go's classic per-key pipeline.
//!
//! - *List* is a paginated range read of the prefix, every page at the first page's revision.
//! - *Watch* starts at that revision + 1; each key's `mod_revision` is its resourceVersion.
//! - A compacted revision plays the part of HTTP 410 Gone: the reflector relists, replaces the
//!   cache and delivers tombstones ([`DeletedObject::FinalStateUnknown`]) for keys that vanished.
//! - Values are decoded by a [`Codec`] into your own type; one that does not decode is reported
//!   with its key and treated as absent.
//!
//! ## Quick start
//!
//! ```no_run
//! use etcd_informer::{EtcdListerWatcher, JsonCodec, ResourceEventHandlerFuncs, SharedIndexInformer};
//!
//! #[derive(Debug, serde::Deserialize, serde::Serialize)]
//! struct ConfigMap { data: std::collections::BTreeMap<String, String> }
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let client = etcd_informer::connect(["127.0.0.1:2379"]).await?;
//! let lw = EtcdListerWatcher::new(client, "/registry/configmaps/", JsonCodec::<ConfigMap>::new())?;
//! let informer = SharedIndexInformer::new(lw, Default::default());
//! informer.add_event_handler(
//!     ResourceEventHandlerFuncs::new()
//!         .on_add(|cm, _| println!("created: {}", cm.key()))
//!         .on_update(|_, cm| println!("updated: {}", cm.key()))
//!         .on_delete(|cm| println!("deleted: {}", cm.key())),
//! )?;
//! tokio::spawn(informer.clone().run());
//! informer.wait_for_cache_sync().await;
//! for cm in informer.lister().by_namespace("tmp")? {
//!     println!("{} {:?}", cm.key(), cm.value.data);
//! }
//! # Ok(()) }
//! ```
//!
//! ## The guide
//! [`guide`] holds the chapters, each with examples that compile: [getting
//! started](guide::getting_started), [codecs](guide::codecs), [indexes](guide::indexes),
//! [handlers](guide::handlers), [shutting down](guide::shutting_down),
//! [controllers](guide::controllers), [consistent reads](guide::consistent_reads),
//! [snapshots](guide::snapshots), [the compact cache](guide::compact_cache), [faults and
//! health](guide::faults_and_health), [metrics and operating](guide::metrics_and_operating),
//! [serving etcd's API](guide::serving), [etcd versions](guide::etcd_versions) and [coming from
//! client-go](guide::coming_from_client_go).
//!
//! ## Controllers and metrics
//! [`runner::Runner`] turns informers into a rate-limited work queue reconciled by N workers
//! (panics and timeouts isolated per key, optionally only while leading an election). With the
//! `metrics` feature, informers, handlers, queues, runners and electors report through the
//! `metrics` facade; [`metrics`] lists every metric.
//!
//! ## Indexes
//! [`InformerOptions::with_index`] adds an index beside the default namespace index
//! ([`InformerOptions::with_indexers`] replaces them all); read it with
//! [`Lister::by_index`], and count per value with [`Indexer::list_index_func_values`] and
//! [`Indexer::index_keys`] on [`SharedIndexInformer::indexer`].
//! [`HandlerRegistration::wait_synced`] waits until one handler has had the first list.
//!
//! ## Logging
//! The crate logs through [`tracing`] and prints nothing itself. Without a subscriber its logs
//! go nowhere, and a value that does not decode is dropped silently: install one that reads
//! `RUST_LOG`, e.g. `tracing_subscriber::fmt().with_env_filter(EnvFilter::from_default_env())`
//! (the `tracing-subscriber` crate with its `env-filter` feature). An outage is logged as a
//! WARN at its first failure, a WARN summary every 30 s while it lasts, and an INFO
//! `list/watch is back` with how long it was down.
//!
//! ## Ordering
//! Each handler sees changes after the cache holds them. In the default
//! [`Processing::Atomic`] mode a handler sees every change in etcd's order, revision by
//! revision, and a transaction's changes together. In the [`Processing::DeltaFifo`] mode a
//! handler sees one key's changes in revision order; across keys, in the order the DeltaFIFO
//! hands keys out: a key keeps its place in the queue while more changes for it arrive, and
//! they are delivered together. A read of the cache from within a handler sees it as it is at
//! that moment, which may be past the event being handled.

#![warn(missing_docs)]

pub mod client;
pub mod codec;
pub mod connect;
pub mod delta_fifo;
pub mod guide;
pub mod informer;
pub mod leader_election;
pub mod lister;
pub mod listwatch;
pub mod metrics;
pub mod queue;
pub mod real_fifo;
pub mod reflector;
pub mod runner;
#[cfg(feature = "server")]
pub mod serve;
pub mod sharding;
pub mod snapshot;
pub mod store;
#[cfg(feature = "testing")]
pub mod testing;
pub mod workqueue;

mod backoff;
mod lease;
mod object;
mod sync;

/// The example objects' protobuf messages (schemas in `proto/`), for the protobuf codec.
#[cfg(feature = "protobuf")]
pub mod proto {
    #![allow(missing_docs)]
    include!(concat!(env!("OUT_DIR"), "/etcd_informer.examples.rs"));
}

#[cfg(feature = "bincode")]
pub use codec::BincodeCodec;
#[cfg(feature = "json")]
pub use codec::JsonCodec;
#[cfg(feature = "protobuf")]
pub use codec::ProstCodec;
pub use codec::{Codec, DecodeError, RawCodec, TextCodec};
pub use connect::{ConnectConfig, ConnectError};
pub use delta_fifo::{Delta, DeltaFifo, DeltaType, Popped};
pub use informer::{
    ConsistencyError, Controller, ControllerConfig, DeletedObject, Event, EventStream,
    HandlerRegistration, Informer, InformerError, InformerOptions, Processing, RelistUnchanged,
    ResourceEventHandler, ResourceEventHandlerFuncs, SharedIndexInformer, SharedInformerFactory,
};
pub use lister::Lister;
pub use listwatch::etcd::{connect, connect_options, EtcdListerWatcher, EtcdOptions};
pub use real_fifo::{Batch, RealFifo};

pub use listwatch::{
    Capabilities, Freshness, ListResult, ListSink, ListWatch, ListerWatcher, WatchEvent,
    WatchStream,
};
pub use object::{
    split_key, value_digest, EncodedObject, IndexValues, Object, SharedRecord, Stamp,
};
pub use reflector::{Backoff, Health, Queue, Reflector, ReflectorOptions, RELIST_STORM_WINDOW};
pub use store::{
    namespace_index_func, namespace_indexers, IndexFunc, Indexer, Indexers, Store, StoreContent,
    StoreError, NAMESPACE_INDEX,
};

/// The README's Rust example, compiled as a doctest so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
