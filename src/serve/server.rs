//! The server's start-up (`bind`: the caches, the listener, the services), its running
//! handle (readiness, stats, drain, shutdown), and the tasks that keep each prefix's cache.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::proto::{PbClusterServer, PbKvServer, PbWatchServer};
use etcd_client::Client;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;
use tonic::transport::Endpoint;
use tracing::Instrument;

use super::access::AccessAnswers;
use super::cache::{HistoryBounds, ServedCache};
use super::forward::{
    AuthService, ClientIo, Cluster, ElectionService, LeaseService, LockService, MaintenanceService,
    Passthrough, Upstream,
};
use super::header::Headers;
use super::health::Health as HealthService;
use super::kv::{KvFront, KvService};
use super::report::{sample_metrics, stats_of, Readiness};
use super::served::{Served, Slice};
use super::stats::ServerMetrics;
use super::stats::ServerStats;
use super::trust::{own_identity, tokenless_policy};
use super::watch::WatchService;
use crate::codec::RawCodec;
use crate::informer::audit::{AuditCounts, Audited};
use crate::informer::AbortOnDrop;
use crate::listwatch::etcd::prefix_range_end;
use crate::listwatch::etcd::EtcdListerWatcher;
use crate::listwatch::ListerWatcher;
use crate::metrics::{AuditMetrics, ServerMetricHandles};
use crate::queue::Queue;
use crate::reflector::{Health, Reflector, ReflectorOptions, RevisionHandle};

use super::options::CacheServerOptions;

/// The longest `read_timeout` and `progress_interval` taken: longer is "never" in practice, and
/// a clock plus `Duration::MAX` would overflow.
const LONGEST_WAIT: Duration = Duration::from_secs(24 * 3600);

/// What can go wrong starting a [`CacheServer`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// An upstream endpoint is not a valid URL.
    #[error("bad upstream endpoint {endpoint:?}: {why}")]
    Endpoint {
        /// The endpoint.
        endpoint: String,
        /// Why.
        why: String,
    },
    /// The prefix or the etcd options were refused.
    #[error(transparent)]
    Config(#[from] crate::listwatch::etcd::ConfigError),
    /// The cache did not list the prefix in time.
    #[error("the cache of {prefix} did not sync within {waited:?}")]
    NotReady {
        /// The served prefix.
        prefix: String,
        /// How long it waited.
        waited: Duration,
    },
    /// The served prefixes overlap.
    #[error("served prefixes may not overlap: {0}")]
    Prefixes(String),
    /// The gRPC server failed.
    #[error("the gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// The options would let any client act as the server in etcd: it reaches etcd with a
    /// client certificate and asks its own clients for none (see
    /// [`CacheServerOptions::trust_clients_as_server`]).
    #[error("{0}")]
    Unsafe(String),
    /// The server's task ended abnormally.
    #[error("the server's task failed: {0}")]
    Task(String),
}

/// A server of etcd's gRPC API answering from caches of one or more prefixes; see the
/// [module](super).
///
/// ```no_run
/// use etcd_informer::serve::{CacheServer, CacheServerOptions};
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let endpoints = ["127.0.0.1:2379"];
/// let client = etcd_informer::connect(endpoints).await?;
/// let server = CacheServer::new(client, endpoints, "/registry/")
///     .with_options(CacheServerOptions::default().with_history_revisions(50_000))
///     .bind("127.0.0.1:0".parse()?)
///     .await?;
/// server.ready(std::time::Duration::from_secs(30)).await?;
/// // Point etcdctl or etcd-client at it: `etcdctl --endpoints <addr> get --prefix /registry/`.
/// println!("serving at {}", server.local_addr());
/// server.shutdown().await;
/// # Ok(()) }
/// ```
pub struct CacheServer {
    client: Client,
    endpoints: Vec<String>,
    prefixes: Vec<Vec<u8>>,
    options: CacheServerOptions,
}

impl CacheServer {
    /// A server of `prefix`, listing and watching it through `client`, and forwarding what it
    /// does not answer to `endpoints` (the same etcd, `host:port` or `http://host:port`).
    pub fn new(
        client: Client,
        endpoints: impl IntoIterator<Item = impl Into<String>>,
        prefix: impl Into<Vec<u8>>,
    ) -> Self {
        CacheServer {
            client,
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            prefixes: vec![prefix.into()],
            options: CacheServerOptions::default(),
        }
    }

    /// Serves `prefix` too, from its own cache (its own list and watch of etcd). No served
    /// prefix may be a prefix of another ([`bind`](Self::bind) refuses it).
    #[must_use]
    pub fn with_prefix(mut self, prefix: impl Into<Vec<u8>>) -> Self {
        self.prefixes.push(prefix.into());
        self
    }

    /// Sets the options.
    #[must_use]
    pub fn with_options(mut self, options: CacheServerOptions) -> Self {
        self.options = options;
        self
    }

    /// Binds `addr`, starts the caches (a list and watch of each prefix) and serves. Requests
    /// that arrive before a cache has listed are forwarded.
    pub async fn bind(self, addr: SocketAddr) -> Result<RunningServer, ServeError> {
        for (i, a) in self.prefixes.iter().enumerate() {
            for b in &self.prefixes[i + 1..] {
                if a.starts_with(b) || b.starts_with(a) {
                    return Err(ServeError::Prefixes(format!(
                        "{:?} and {:?} overlap",
                        String::from_utf8_lossy(a),
                        String::from_utf8_lossy(b)
                    )));
                }
            }
        }
        #[cfg(feature = "tls")]
        let upstream_tls = self.options.upstream_tls.clone();
        #[cfg(feature = "tls")]
        let default_scheme = if upstream_tls.is_some() {
            "https"
        } else {
            "http"
        };
        #[cfg(not(feature = "tls"))]
        let default_scheme = "http";
        let mut endpoints = Vec::new();
        let mut urls = Vec::new();
        for endpoint in &self.endpoints {
            let url = if endpoint.contains("://") {
                endpoint.clone()
            } else {
                format!("{default_scheme}://{endpoint}")
            };
            urls.push(url.clone());
            let bad = |e: tonic::transport::Error| ServeError::Endpoint {
                endpoint: endpoint.clone(),
                why: e.to_string(),
            };
            let parsed = Endpoint::from_shared(url).map_err(bad)?;
            #[cfg(feature = "tls")]
            let parsed = match &upstream_tls {
                Some(tls) => parsed.tls_config(tls.clone()).map_err(bad)?,
                None => parsed,
            };
            endpoints.push(
                parsed
                    .connect_timeout(Duration::from_secs(5))
                    .tcp_nodelay(true)
                    // A connection to a member that went away without a word (a half-open
                    // TCP connection) fails within 15 s, and the forwarded watches on it are
                    // opened again elsewhere; etcd's pings policy allows one every 5 s.
                    .http2_keep_alive_interval(Duration::from_secs(10))
                    .keep_alive_timeout(Duration::from_secs(5))
                    .keep_alive_while_idle(true),
            );
        }
        if endpoints.is_empty() {
            return Err(ServeError::Endpoint {
                endpoint: String::new(),
                why: "no upstream endpoint".into(),
            });
        }
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| ServeError::Bind { addr, source })?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| ServeError::Bind { addr, source })?;
        let options = self.options;
        let tokenless = tokenless_policy(&options, local_addr).map_err(ServeError::Unsafe)?;
        let prefix_text = self
            .prefixes
            .iter()
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .collect::<Vec<_>>()
            .join(",");
        let changed = Arc::new(tokio::sync::watch::channel(0u64).0);
        let mut slices = Vec::new();
        let mut tasks = Vec::new();
        let headers = Headers::default();
        for prefix in &self.prefixes {
            let (slice, reflector) =
                start_slice(&self.client, prefix, &options, &changed, &headers)?;
            tasks.push(tokio::spawn(reflector));
            slices.push(slice);
        }
        let metrics = ServerMetrics::new(&prefix_text);
        let upstream = Upstream::new(endpoints, tokenless, metrics.clone());
        let served = Arc::new(Served {
            slices,
            changed,
            upstream: upstream.clone(),
            headers: headers.clone(),
            client: self.client.clone(),
            access: AccessAnswers::new(options.access_ttl),
            compaction: Default::default(),
            read_timeout: options.read_timeout.min(LONGEST_WAIT),
            metrics,
            draining: tokio::sync::watch::channel(false).0,
            own_identity: own_identity(&options),
        });
        // Registered here, on the caller's thread (where a thread-local recorder would be).
        let handles = ServerMetricHandles::new(
            &(self.prefixes.iter())
                .map(|p| String::from_utf8_lossy(p).into_owned())
                .collect::<Vec<_>>(),
        );
        tasks.push(tokio::spawn(
            sample_metrics(served.clone(), handles)
                .instrument(tracing::info_span!("cache_server_metrics", prefix = %prefix_text)),
        ));
        tasks.push(tokio::spawn(
            headers
                .clone()
                .keep_fresh(self.client.clone(), options.identity_refresh)
                .instrument(tracing::info_span!("upstream_identity", prefix = %prefix_text)),
        ));
        // Set again below when serving TLS.
        #[cfg_attr(not(feature = "tls"), allow(unused_mut))]
        let mut builder = tonic::transport::Server::builder().tcp_nodelay(true);
        #[cfg(feature = "tls")]
        let scheme = match &options.tls {
            Some(tls) => {
                let identity = tonic::transport::Identity::from_pem(&tls.cert_pem, &tls.key_pem);
                let mut config = tonic::transport::ServerTlsConfig::new().identity(identity);
                if let Some(ca) = &tls.client_ca_pem {
                    config = config.client_ca_root(tonic::transport::Certificate::from_pem(ca));
                }
                builder = builder.tls_config(config)?;
                "https"
            }
            None => "http",
        };
        #[cfg(not(feature = "tls"))]
        let scheme = "http";
        let client_url = format!("{scheme}://{local_addr}");
        let (stop, stopped) = oneshot::channel::<()>();
        let max_request = options.max_request_bytes;
        let grpc = tonic::service::Routes::new(KvFront {
            served: served.clone(),
            inner: PbKvServer::new(KvService {
                served: served.clone(),
            })
            .max_decoding_message_size(options.max_request_bytes)
            .max_encoding_message_size(usize::MAX),
            max_request: options.max_request_bytes,
        })
        .add_service(
            PbWatchServer::new(WatchService {
                served: served.clone(),
                // tokio's interval panics on zero.
                progress_interval: options
                    .progress_interval
                    .clamp(Duration::from_millis(1), LONGEST_WAIT),
                fragment_bytes: options.max_request_bytes,
                last_word_within: options.drain_timeout,
                forward_caps: (
                    options.max_forwarded_watches,
                    options.max_forwarded_watches_per_connection,
                ),
            })
            .max_decoding_message_size(options.max_request_bytes)
            .max_encoding_message_size(usize::MAX),
        )
        .add_service(PbClusterServer::new(Cluster {
            upstream: upstream.clone(),
            headers,
            client_url,
        }))
        .add_service(Passthrough::<LeaseService>::new(
            upstream.clone(),
            max_request,
            served.draining.subscribe(),
        ))
        .add_service(Passthrough::<MaintenanceService>::new(
            upstream.clone(),
            max_request,
            served.draining.subscribe(),
        ))
        .add_service(Passthrough::<AuthService>::new(
            upstream.clone(),
            max_request,
            served.draining.subscribe(),
        ))
        // Locks and elections live in etcd's keyspace and lease table: only etcd can
        // answer them (a lock held through the server must exclude one held on etcd).
        .add_service(Passthrough::<LockService>::new(
            upstream.clone(),
            max_request,
            served.draining.subscribe(),
        ))
        .add_service(Passthrough::<ElectionService>::new(
            upstream,
            max_request,
            served.draining.subscribe(),
        ))
        .add_service(HealthService {
            served: served.clone(),
        });
        // etcd's HTTP endpoints on the same port (HTTP/1), answered by the upstream.
        let urls: Arc<[String]> = urls.into();
        let readiness = Readiness(served.clone());
        let routes = grpc
            .into_axum_router()
            .fallback(move |request| super::http::answer(urls.clone(), readiness.clone(), request));
        let router = builder
            .accept_http1(true)
            .add_routes(tonic::service::Routes::from(routes));
        let span = tracing::info_span!("cache_server", prefix = %prefix_text, addr = %local_addr);
        let serving = tokio::spawn(
            async move {
                // Nagle's algorithm off on every accepted connection, as tonic sets it on the
                // connections it accepts itself: with it on, a response's data frame waited
                // for the client's delayed ACK of its headers, 40 ms.
                let incoming = tonic::transport::server::TcpIncoming::from(listener)
                    .with_nodelay(Some(true))
                    .map(|accepted| accepted.map(ClientIo::from));
                router
                    .serve_with_incoming_shutdown(incoming, async {
                        let _ = stopped.await;
                    })
                    .await
            }
            .instrument(span),
        );
        tracing::info!(prefix = %prefix_text, addr = %local_addr, "cache server listening");
        Ok(RunningServer {
            local_addr,
            prefix: prefix_text,
            served,
            tasks,
            serving: Some(serving),
            stop: Some(stop),
            drain_timeout: options.drain_timeout.min(LONGEST_WAIT),
        })
    }
}

/// A running [`CacheServer`]. Dropping it stops the server and its cache.
pub struct RunningServer {
    local_addr: SocketAddr,
    prefix: String,
    served: Arc<Served>,
    tasks: Vec<JoinHandle<()>>,
    serving: Option<JoinHandle<Result<(), tonic::transport::Error>>>,
    stop: Option<oneshot::Sender<()>>,
    drain_timeout: Duration,
}

impl RunningServer {
    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Waits until the server [is ready](Self::is_ready): every cache has listed its prefix,
    /// its watch is open, and the upstream's identity is known; from then on reads inside the
    /// prefixes are answered from the caches.
    pub async fn ready(&self, within: Duration) -> Result<(), ServeError> {
        let mut position = self.served.changed.subscribe();
        let wait = async {
            loop {
                position.borrow_and_update();
                if self.is_ready() {
                    return;
                }
                tokio::select! {
                    _ = position.changed() => {}
                    _ = tokio::time::sleep(Duration::from_millis(20)) => {}
                }
            }
        };
        tokio::time::timeout(within, wait)
            .await
            .map_err(|_| ServeError::NotReady {
                prefix: self.prefix.clone(),
                waited: within,
            })
    }

    /// What the server has done so far (over all its prefixes: the lowest revision, the sums
    /// of keys and history).
    pub fn stats(&self) -> ServerStats {
        stats_of(&self.served)
    }

    /// The health of each prefix's list and watch of etcd (its reflector's): whether it is
    /// connected, when it last proved the cache fresh, its relists and last error.
    pub fn health(&self) -> Vec<(String, Health)> {
        self.served
            .slices
            .iter()
            .map(|s| {
                let prefix = String::from_utf8_lossy(&s.prefix).into_owned();
                (prefix, s.reflected.health())
            })
            .collect()
    }

    /// Whether every cache has listed and its watch is connected and proven fresh within the
    /// source's liveness bound, and the upstream's identity is known: what a readiness probe
    /// should report (the gRPC health check says the same).
    pub fn is_ready(&self) -> bool {
        self.served.ready()
    }

    /// A handle that answers whether the server is ready, for as long as it is kept, also
    /// while [`shutdown`](Self::shutdown) drains it: for health endpoints of one's own.
    pub fn readiness(&self) -> Readiness {
        Readiness(self.served.clone())
    }

    /// Serves until the server fails or is shut down.
    pub async fn wait(mut self) -> Result<(), ServeError> {
        match self.serving.take() {
            Some(serving) => match serving.await {
                Ok(result) => result.map_err(ServeError::from),
                Err(e) => Err(ServeError::Task(e.to_string())),
            },
            None => Ok(()),
        }
    }

    /// Serves until the server fails, or until `signal` completes (SIGTERM, say), then drains
    /// and stops as [`shutdown`](Self::shutdown) does.
    pub async fn serve_until(
        mut self,
        signal: impl std::future::Future<Output = ()>,
    ) -> Result<(), ServeError> {
        let Some(mut serving) = self.serving.take() else {
            return Ok(());
        };
        tokio::select! {
            served = &mut serving => {
                return match served {
                    Ok(result) => result.map_err(ServeError::from),
                    Err(e) => Err(ServeError::Task(e.to_string())),
                };
            }
            () = signal => {}
        }
        self.serving = Some(serving);
        self.shutdown().await;
        Ok(())
    }

    /// Drains the server, then stops it and its caches (what the `cache_server` example does
    /// on SIGTERM). The health check says NOT_SERVING at once, so a load balancer moves new
    /// clients away; open watch streams end with Unavailable, `etcdserver: server stopped`,
    /// as etcd ends them when it stops, so that clients watch again elsewhere from their last
    /// revision (this crate's informer does, with no relist); Ranges from the cache are
    /// refused the same way; every connection is told to go (HTTP/2 GOAWAY), requests under
    /// way finish, and no new one is taken. Returns once every connection has closed, or after
    /// [`drain_timeout`](CacheServerOptions::drain_timeout). Forwarded calls that can stay
    /// open indefinitely (lease keep-alives, snapshots, election observers, a lock or a
    /// campaign still waiting) end as the watch streams do; a client that then closes its side
    /// lets its connection close.
    pub async fn shutdown(mut self) {
        self.served.draining.send_replace(true);
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(serving) = self.serving.take() {
            let abort = serving.abort_handle();
            if tokio::time::timeout(self.drain_timeout, serving)
                .await
                .is_err()
            {
                tracing::warn!(
                    prefix = %self.prefix,
                    "clients still connected after the drain timeout: closed"
                );
                abort.abort();
            }
        }
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        // Connections outlive the serving task: their watch streams end here, or they would
        // go on from a cache that no longer follows etcd.
        self.served.draining.send_replace(true);
        if let Some(serving) = &self.serving {
            serving.abort();
        }
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Starts one prefix's cache: its source (raw bytes), the cache, and the reflector between
/// them (returned as its future, to be spawned).
fn start_slice(
    client: &Client,
    prefix: &[u8],
    options: &CacheServerOptions,
    changed: &Arc<tokio::sync::watch::Sender<u64>>,
    headers: &Headers,
) -> Result<(Slice, impl std::future::Future<Output = ()>), ServeError> {
    let prefix_text = String::from_utf8_lossy(prefix).into_owned();
    // Values are bytes (they always decode), and a key that is not UTF-8 is carried escaped:
    // the cache holds every key of the prefix as etcd does.
    let mut etcd = options.etcd.clone().with_raw_prefix(true);
    etcd.escape_keys = true;
    let source = EtcdListerWatcher::with_options(client.clone(), prefix.to_vec(), RawCodec, etcd)?;
    let progress = source.progress();
    let cache = Arc::new(
        ServedCache::new(
            prefix,
            HistoryBounds {
                revisions: options.history_revisions,
                bytes: options.history_bytes,
            },
        )
        .with_changed(changed.clone())
        .with_identity(source.identity_handle(), headers.clone()),
    );
    let (reflected, audits, retry, run) = reflect(
        Arc::new(source),
        cache.clone(),
        format!("cache-server {prefix_text}"),
        options.audit_period,
    );
    let slice = Slice {
        prefix: prefix.to_vec(),
        prefix_end: prefix_range_end(prefix),
        cache,
        reflected,
        audits,
        proof: std::sync::Mutex::new(None),
        counts: Default::default(),
        refused_since: Default::default(),
        retry,
        written: Default::default(),
        proven: Default::default(),
        progress,
    };
    Ok((slice, run))
}

/// The reflector that fills `cache` from `source`, and the audit beside it (every
/// `audit_period`, as an informer's: an event etcd's watch lost is found and repaired by a
/// relist): the task to spawn, the reflector's handle, the audit's counts and the trigger that
/// cuts the reflector's backoff short. `name` labels the logs and metrics of both.
fn reflect(
    source: Arc<dyn ListerWatcher<Vec<u8>>>,
    cache: Arc<ServedCache>,
    name: String,
    audit_period: Option<Duration>,
) -> (
    RevisionHandle,
    Arc<AuditCounts>,
    Arc<tokio::sync::Notify>,
    impl std::future::Future<Output = ()>,
) {
    let relist = Arc::new(tokio::sync::Notify::new());
    let retry = Arc::new(tokio::sync::Notify::new());
    let queue: Arc<dyn Queue<Vec<u8>>> = cache.clone();
    let reflector = Reflector::new(
        source.clone(),
        queue,
        ReflectorOptions::default().with_name(name.clone()),
    )
    .with_relist_trigger(relist.clone())
    .with_retry_trigger(retry.clone());
    let handle = reflector.revision();
    let counts = Arc::new(AuditCounts::default());
    let ready = {
        let (handle, cache) = (handle.clone(), cache.clone());
        // Listed, the watch open, and every revision read applied.
        Box::new(move || {
            let health = handle.health();
            let position = cache.position();
            let quiet = position.synced && health.connected && position.revision == handle.get();
            quiet.then_some(health.relists.total())
        })
    };
    let auditor = Arc::new(Audited {
        metrics: AuditMetrics::new(&name),
        name,
        cached: Box::new(move || cache.key_revisions()),
        source,
        counts: counts.clone(),
        ready,
        relist,
        asked_at: Mutex::new(None),
        running: tokio::sync::Mutex::new(()),
    });
    let run = async move {
        let _audits = audit_period.map(|period| {
            let span = tracing::info_span!("audit", informer = %auditor.name);
            AbortOnDrop(tokio::spawn(auditor.every(period).instrument(span)))
        });
        reflector.run().await
    };
    (handle, counts, retry, run)
}

#[cfg(all(test, feature = "testing"))]
mod audit_tests {
    use super::*;
    use crate::testing::FakeSource;

    async fn until(what: &str, cond: impl Fn() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Issue 34, item 8: a served prefix is audited as an informer is. An event the watch lost
    /// (etcd 3.4.23 loses a delete a compaction lands on) is found by the next audit and
    /// repaired by a relist; audits of a cache that agrees with etcd repair nothing.
    #[tokio::test]
    async fn the_audit_repairs_an_event_the_served_cache_lost() {
        let source = FakeSource::<Vec<u8>>::new();
        source.put("a", b"1".to_vec());
        source.put("b", b"1".to_vec());
        let cache = Arc::new(ServedCache::new(
            b"/p/",
            HistoryBounds {
                revisions: 100,
                bytes: 1 << 20,
            },
        ));
        let (handle, audits, _retry, run) = reflect(
            Arc::new(source.clone()),
            cache.clone(),
            "cache-server /p/".into(),
            Some(Duration::from_millis(50)),
        );
        let task = AbortOnDrop(tokio::spawn(run));
        let keys = || {
            let (_, keys) = cache.key_revisions();
            keys.into_iter()
                .map(|(k, _)| k.to_string())
                .collect::<Vec<_>>()
        };
        until("two clean audits", || audits.get().completed >= 2).await;
        assert_eq!(audits.get().repairs, 0);
        assert_eq!(keys(), ["a", "b"]);

        source.lose_next_event();
        source.delete("a");
        let after = source.put("c", b"1".to_vec());
        until("the put after the lost delete", || {
            cache.position().revision >= after
        })
        .await;
        until("the audit repaired the cache", || keys() == ["b", "c"]).await;
        assert_eq!(audits.get().repairs, 1, "{:?}", audits.get());
        assert_eq!(handle.health().relists.audit, 1);
        drop(task);
    }
}
