//! Serving etcd's own gRPC API from a cache (cargo feature `server`): one process lists and
//! watches prefixes of etcd once (a cache each), and any number of clients (etcdctl,
//! etcd-client, this crate's [`EtcdListerWatcher`](crate::EtcdListerWatcher)) read and watch them from the caches,
//! unchanged.
//!
//! - **Range** within a served prefix is answered from its cache (the keys at the cache's
//!   revision and a bounded history): key, prefix or sub-range, `limit`/`more`/
//!   `count`, `keys_only`, `count_only`, min/max mod and create revisions, sort, and `revision`
//!   within the history. Linearizable reads (etcdctl's default) wait for the consistent-read
//!   proof. Other ranges are forwarded.
//! - **Watch** within a served prefix is served from its history: many watches per stream,
//!   `start_revision`, `prev_kv`, filters, progress, cancel. A watch that starts below the
//!   history, or falls out of it (a slow reader), is forwarded to etcd from its position, as
//!   are watches of other ranges.
//! - **Writes** (Put, DeleteRange, Txn, Compact), Lease, Maintenance and Auth are forwarded
//!   with the client's token; `Cluster.MemberList` names this server (as etcd's gRPC proxy does).
//! - **Health**: gRPC's `grpc.health.v1.Health/Check` says SERVING while the server
//!   [is ready](RunningServer::is_ready), NOT_SERVING otherwise (for Kubernetes' gRPC probes).
//!
//! **No client gets more than etcd would give it.** Requests run upstream with the client's
//! own token, never with the server's credentials. etcd takes a request without a token as
//! coming from its connection's client certificate, and forwarded requests travel on the
//! server's connection: so when [`upstream_tls`](CacheServerOptions::upstream_tls) carries a
//! certificate, token-less requests are refused with PermissionDenied (all but
//! `Auth.Authenticate` and `Maintenance.Status`, which etcd answers to anyone), unless
//! [`trust_clients_as_server`](CacheServerOptions::trust_clients_as_server). The server does
//! not authorize clients by their own certificates: that would take a second copy of etcd's
//! permission model. etcd's answer on a client's access to a cached range is used for
//! [`access_ttl`](CacheServerOptions::access_ttl) (5 s) at most: the bound on a revoked
//! permission.
//!
//! ```no_run
//! use etcd_informer::serve::CacheServer;
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let endpoints = vec!["127.0.0.1:2379".to_string()];
//! let client = etcd_informer::connect(&endpoints).await?;
//! let server = CacheServer::new(client, endpoints, "/registry/pods/")
//!     .with_prefix("/registry/nodes/")
//!     .bind("127.0.0.1:23790".parse()?)
//!     .await?;
//! server.ready(std::time::Duration::from_secs(30)).await?;
//! println!("serving pods and nodes at {}", server.local_addr());
//! server.wait().await?;
//! # Ok(()) }
//! ```
//!
//! # Where things are
//!
//! | file | what it holds |
//! | --- | --- |
//! | `options.rs` | [`CacheServerOptions`]: every setting, its default and where it comes from |
//! | `server.rs` | start-up ([`CacheServer::bind`]: the caches, the listener, the services), the running handle ([`RunningServer`]: readiness, stats, drain), the task that keeps each prefix's cache |
//! | `trust.rs` | who acts as whom in etcd: what a watch moved out of the history runs as, whether token-less requests are forwarded, and the start-up refusal of an unsafe setup |
//! | `served.rs` | what every service shares (`Served`): the served prefixes, the consistent-read proof |
//! | `cache.rs` | a prefix's cache: its keys at one revision and a bounded history of revisions |
//! | `access.rs` | the access answers: whether a client may read a cached range, asked of etcd with its token, remembered within a bound of bytes |
//! | `kv.rs` | the KV service: a Range answered from a cache or forwarded; writes forwarded |
//! | `encode.rs` | a Range answer encoded straight from the cache |
//! | `watch/` | the Watch service (`service.rs`), a stream's session (`mod.rs`: its watches, catch-up, progress), its requests in order (`requests.rs`: create, cancel, progress), the relays of forwarded watches (`relay.rs`: resumed when their upstream stream fails, capped), fragments (`fragment.rs`) |
//! | `forward.rs` | the upstream: requests forwarded with the client's token, the services only forwarded (Lease, Auth, Maintenance...) |
//! | `header.rs` | response headers as etcd's, and the leader as etcd last named it |
//! | `status.rs` | the errors the server answers with, in etcd's words |
//! | `report.rs` | what a running server reports: readiness and why not, stats, metrics samples |
//! | `health.rs`, `http.rs`, `stats.rs` | gRPC health, the HTTP endpoints, counts and metric handles |
//!
//! Imports point one way: the services (`kv`, `watch`) use `served`, `access`, `cache` and
//! `forward`; `served` uses `cache`, `forward` and `header`; nothing below imports a service
//! (`.ci/check-layers`).
//!
//! **A Range** arrives at `kv.rs`: within a served prefix and readable by the client
//! (`access.rs`), a linearizable read first waits for `Served::linearize` (`served.rs`: the
//! cache reaches etcd's current revision, or the source's proof shows the prefix unchanged),
//! then `cache.rs` finds the keys and `encode.rs` writes the answer; anything else goes
//! through `forward.rs` to etcd.
//!
//! **A watch event** comes from etcd on the prefix's informer watch (`server.rs`'s task),
//! becomes a revision of the history in `cache.rs`, and wakes every session
//! (`watch/mod.rs`) whose watches are behind: each pulls the history's groups from its
//! position when its client's stream has room, and hands them to the stream
//! (`watch/service.rs`). A watch the history cannot serve is relayed from etcd
//! (`watch/relay.rs`) and handed back to the cache once caught up.

mod access;
mod cache;
mod encode;
mod forward;
mod header;
mod health;
mod http;
mod kv;
mod options;
mod report;
mod served;
mod server;
mod stats;
mod status;
mod trust;
mod watch;

#[cfg(feature = "tls")]
pub use self::options::ServerTls;
pub use self::options::{CacheServerOptions, UpstreamUser};
pub use self::report::Readiness;
pub use self::server::{CacheServer, RunningServer, ServeError};
pub use self::stats::ServerStats;
