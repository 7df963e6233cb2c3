//! What an operator sets on a [`CacheServer`](super::CacheServer): its options, with the
//! defaults and where each comes from.

use std::time::Duration;

use super::access::ACCESS_TTL;
use crate::informer::DEFAULT_AUDIT_PERIOD;
use crate::listwatch::etcd::EtcdOptions;

/// Options of a [`CacheServer`](super::CacheServer).
///
/// ```
/// use std::time::Duration;
/// use etcd_informer::serve::CacheServerOptions;
/// // A longer history for watchers that resume from far back, and a tighter read timeout.
/// let options = CacheServerOptions::default()
///     .with_history_revisions(50_000)
///     .with_read_timeout(Duration::from_secs(2));
/// assert_eq!(options.history_revisions, 50_000);
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct CacheServerOptions {
    /// How many revisions of history are kept for `get --rev` and watches that start in the
    /// past (default 10,000).
    pub history_revisions: usize,
    /// How many bytes of history (keys and values of the events and their previous values) are
    /// kept at most (default 64 MiB).
    pub history_bytes: usize,
    /// How long a linearizable Range may wait for the cache to be proven current before it
    /// fails with `Unavailable` (default 5 s, etcdctl's command timeout; at most a day).
    pub read_timeout: Duration,
    /// How often an idle watch created with `progress_notify` hears of the revision (default
    /// 10 minutes, etcd's; at least 1 ms, at most a day).
    pub progress_interval: Duration,
    /// The largest request a client may send (default 2 MiB: etcd's `--max-request-bytes`,
    /// 1.5 MiB, plus its gRPC allowance of 512 KiB). A larger one is refused before it is
    /// read whole, as etcd refuses it; raise it with the upstream's own limit. It is also the
    /// size at which a response to a watch created with `fragment` is split, as etcd splits
    /// one at the same limit.
    pub max_request_bytes: usize,
    /// How long etcd's answer on whether a client may read a range is used for reads and
    /// watches from the cache, from when it was asked (default 5 s): a permission revoked in
    /// etcd keeps working through the server at most this long. Past it the server asks again,
    /// and refuses with Unavailable while etcd cannot answer, so serializable reads served
    /// while etcd is down end with it.
    pub access_ttl: Duration,
    /// How often the upstream's status (member id, raft term) is read again for the headers
    /// (default 5 s); the cluster id and a term that went down come only with the content of
    /// the store they name, from the caches' lists.
    pub identity_refresh: Duration,
    /// How often each prefix's cache is audited against etcd (default
    /// [`DEFAULT_AUDIT_PERIOD`], 5 minutes; `None`: never), as an informer's is
    /// ([`InformerOptions::audit_period`](crate::InformerOptions::audit_period)): etcd's keys
    /// and `mod_revision`s at the cache's revision compared key by key, a difference (an event
    /// etcd's watch lost) repaired by a relist. Counted in [`ServerStats::audits`](super::ServerStats::audits) and
    /// `etcd_informer_audits_total{informer="cache-server <prefix>"}`.
    pub audit_period: Option<Duration>,
    /// The options of the list and watch of the prefix.
    pub etcd: EtcdOptions,
    /// TLS on the listening side (cargo feature `tls`): `None` serves plain HTTP/2.
    #[cfg(feature = "tls")]
    pub tls: Option<ServerTls>,
    /// TLS of the channel that forwards requests to the upstream (cargo feature `tls`; e.g.
    /// [`ConnectConfig::tls_options`](crate::ConnectConfig::tls_options)); endpoints without a
    /// scheme are then `https://`. `None`: plain HTTP/2. With a client certificate in it,
    /// requests without an auth token are refused (see
    /// [`trust_clients_as_server`](Self::trust_clients_as_server)).
    #[cfg(feature = "tls")]
    pub upstream_tls: Option<etcd_client::TlsOptions>,
    /// Forward requests without an auth token even when the upstream channel carries a client
    /// certificate (default `false`). etcd authorizes such a request by that certificate's
    /// common name, so every client that can reach the server then acts as the server's own
    /// etcd user: set it only for a server that nothing but trusted processes can reach. By
    /// default they are refused with PermissionDenied, saying why; clients with a token are
    /// judged by etcd by their token either way.
    pub trust_clients_as_server: bool,
    /// How long [`RunningServer::shutdown`](super::RunningServer::shutdown) waits for clients to leave (default 10 s): see
    /// there.
    pub drain_timeout: Duration,
    /// The most watches forwarded to etcd at once (default 10,000): each has an upstream
    /// stream of its own (watches outside the prefixes, below the history, or slow). A create
    /// past it is refused with etcd's "too many requests" (ResourceExhausted).
    pub max_forwarded_watches: usize,
    /// The most watches forwarded to etcd at once for one client connection (default 1,000).
    pub max_forwarded_watches_per_connection: usize,
    /// The etcd user the server's own client authenticates as (default none), for the server
    /// to run a watch that falls out of its history as itself when it forwards it to etcd:
    /// etcd checks a watch's permission once, when it is created, and the token the client
    /// created it with may have expired since. Without it, such a watch is forwarded with its
    /// client's token, or, when the upstream channel carries a client certificate, as that
    /// certificate's user.
    pub upstream_user: Option<UpstreamUser>,
}

/// An etcd user and password (see [`CacheServerOptions::upstream_user`]); its `Debug` does
/// not show the password.
#[derive(Clone)]
pub struct UpstreamUser {
    /// The user's name.
    pub name: String,
    /// Its password.
    pub password: String,
}

impl std::fmt::Debug for UpstreamUser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamUser")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// The server's TLS: its certificate and key, and for mutual TLS the CA whose certificates
/// clients must present. PEM, as etcd's `--cert-file`, `--key-file`, `--trusted-ca-file`.
#[cfg(feature = "tls")]
#[derive(Debug, Clone)]
pub struct ServerTls {
    /// The server's certificate chain, PEM.
    pub cert_pem: Vec<u8>,
    /// The server's private key, PEM.
    pub key_pem: Vec<u8>,
    /// With a CA, every client must present a certificate it signed (mutual TLS).
    pub client_ca_pem: Option<Vec<u8>>,
}

impl Default for CacheServerOptions {
    fn default() -> Self {
        CacheServerOptions {
            history_revisions: 10_000,
            history_bytes: 64 << 20,
            read_timeout: Duration::from_secs(5),
            progress_interval: Duration::from_secs(600),
            max_request_bytes: 2 << 20,
            access_ttl: ACCESS_TTL,
            identity_refresh: Duration::from_secs(5),
            audit_period: Some(DEFAULT_AUDIT_PERIOD),
            etcd: EtcdOptions::default().with_raw_prefix(true),
            #[cfg(feature = "tls")]
            tls: None,
            #[cfg(feature = "tls")]
            upstream_tls: None,
            trust_clients_as_server: false,
            drain_timeout: Duration::from_secs(10),
            max_forwarded_watches: 10_000,
            max_forwarded_watches_per_connection: 1_000,
            upstream_user: None,
        }
    }
}

impl CacheServerOptions {
    /// Sets [`history_revisions`](Self::history_revisions).
    #[must_use]
    pub fn with_history_revisions(mut self, revisions: usize) -> Self {
        self.history_revisions = revisions;
        self
    }

    /// Sets [`history_bytes`](Self::history_bytes).
    #[must_use]
    pub fn with_history_bytes(mut self, bytes: usize) -> Self {
        self.history_bytes = bytes;
        self
    }

    /// Sets [`audit_period`](Self::audit_period).
    #[must_use]
    pub fn with_audit_period(mut self, period: Option<Duration>) -> Self {
        self.audit_period = period;
        self
    }

    /// Sets [`read_timeout`](Self::read_timeout).
    #[must_use]
    pub fn with_read_timeout(mut self, timeout: Duration) -> Self {
        self.read_timeout = timeout;
        self
    }

    /// Sets [`progress_interval`](Self::progress_interval).
    #[must_use]
    pub fn with_progress_interval(mut self, interval: Duration) -> Self {
        self.progress_interval = interval;
        self
    }

    /// Sets [`max_request_bytes`](Self::max_request_bytes).
    #[must_use]
    pub fn with_max_request_bytes(mut self, bytes: usize) -> Self {
        self.max_request_bytes = bytes;
        self
    }

    /// Sets [`access_ttl`](Self::access_ttl).
    #[must_use]
    pub fn with_access_ttl(mut self, ttl: Duration) -> Self {
        self.access_ttl = ttl;
        self
    }

    /// Sets [`tls`](Self::tls).
    #[cfg(feature = "tls")]
    #[must_use]
    pub fn with_tls(mut self, tls: Option<ServerTls>) -> Self {
        self.tls = tls;
        self
    }

    /// Sets [`upstream_tls`](Self::upstream_tls).
    #[cfg(feature = "tls")]
    #[must_use]
    pub fn with_upstream_tls(mut self, tls: Option<etcd_client::TlsOptions>) -> Self {
        self.upstream_tls = tls;
        self
    }

    /// Sets [`trust_clients_as_server`](Self::trust_clients_as_server).
    #[must_use]
    pub fn with_trust_clients_as_server(mut self, trust: bool) -> Self {
        self.trust_clients_as_server = trust;
        self
    }

    /// Sets [`upstream_user`](Self::upstream_user).
    pub fn with_upstream_user(
        mut self,
        name: impl Into<String>,
        password: impl Into<String>,
    ) -> Self {
        self.upstream_user = Some(UpstreamUser {
            name: name.into(),
            password: password.into(),
        });
        self
    }

    /// Sets [`drain_timeout`](Self::drain_timeout).
    #[must_use]
    pub fn with_drain_timeout(mut self, timeout: Duration) -> Self {
        self.drain_timeout = timeout;
        self
    }

    /// Sets [`max_forwarded_watches`](Self::max_forwarded_watches) and
    /// [`max_forwarded_watches_per_connection`](Self::max_forwarded_watches_per_connection).
    #[must_use]
    pub fn with_max_forwarded_watches(mut self, in_all: usize, per_connection: usize) -> Self {
        self.max_forwarded_watches = in_all;
        self.max_forwarded_watches_per_connection = per_connection;
        self
    }

    /// Sets [`etcd`](Self::etcd) (its `raw_prefix` is forced on: any prefix can be served).
    #[must_use]
    pub fn with_etcd(mut self, etcd: EtcdOptions) -> Self {
        self.etcd = etcd;
        self
    }
}
