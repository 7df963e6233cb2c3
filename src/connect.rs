//! Reaching a real deployment: endpoints, TLS (mutual TLS too) and etcd users, read the way
//! etcdctl reads them, on top of the informer's connection defaults.

use std::path::{Path, PathBuf};

use etcd_client::{Client, ConnectOptions};

use crate::listwatch::etcd::connect_options;

/// Why connecting failed; every variant names what to fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// An environment variable is set to something unusable.
    #[error("environment variable {var}: {why}")]
    Env {
        /// The variable.
        var: &'static str,
        /// What is wrong.
        why: String,
    },
    /// A certificate or key file cannot be read.
    #[error("cannot read {what} {path}: {source}")]
    File {
        /// What the file was for (`CA certificate`, `client certificate`, `client key`).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// TLS was asked for, but the crate was built without its `tls` feature.
    #[error("{what} needs TLS: build etcd-informer with the `tls` feature")]
    TlsDisabled {
        /// What asked for TLS.
        what: String,
    },
    /// etcd did not answer, refused the TLS handshake or the credentials.
    #[error("cannot reach etcd at {endpoints:?}: {source}")]
    Etcd {
        /// The endpoints tried.
        endpoints: Vec<String>,
        /// What etcd-client said.
        #[source]
        source: etcd_client::Error,
    },
}

/// How to reach etcd: endpoints, TLS and a user, with the informer's defaults
/// ([`connect_options`]: require-leader, keepalive, connect timeout, token renewal).
///
/// ```no_run
/// # async fn demo() -> Result<(), etcd_informer::ConnectError> {
/// use etcd_informer::ConnectConfig;
/// // ETCD_ENDPOINTS, ETCDCTL_CACERT, ETCDCTL_CERT, ETCDCTL_KEY and ETCDCTL_USER, as etcdctl.
/// let client = ConnectConfig::from_env()?.connect().await?;
/// // Or spelled out:
/// let client = ConnectConfig::new(["10.0.0.1:2379", "10.0.0.2:2379"])
///     .user("reader", "secret")
///     .connect()
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
pub struct ConnectConfig {
    endpoints: Vec<String>,
    user: Option<(String, String)>,
    ca: Option<Vec<u8>>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for ConnectConfig {
    /// Never shows the password or the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectConfig")
            .field("endpoints", &self.endpoints)
            .field("user", &self.user.as_ref().map(|(name, _)| name))
            .field("tls", &self.is_tls())
            .field("client_certificate", &self.identity.is_some())
            .finish()
    }
}

/// The endpoint when `ETCD_ENDPOINTS` is not set (etcd's own default).
pub const DEFAULT_ENDPOINT: &str = "127.0.0.1:2379";

impl ConnectConfig {
    /// Plain connections to `endpoints` (`host:port` or URLs).
    pub fn new<E: Into<String>>(endpoints: impl IntoIterator<Item = E>) -> Self {
        ConnectConfig {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            ..Default::default()
        }
    }

    /// From the environment, as etcdctl reads it: `ETCD_ENDPOINTS` (comma-separated, default
    /// [`DEFAULT_ENDPOINT`]; `ETCDCTL_ENDPOINTS` also works), `ETCDCTL_CACERT` (a CA file: TLS),
    /// `ETCDCTL_CERT` and `ETCDCTL_KEY` (a client certificate: mutual TLS), `ETCDCTL_USER`
    /// (`name:password`; `ETCDCTL_PASSWORD` may hold the password).
    pub fn from_env() -> Result<Self, ConnectError> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let endpoints = var("ETCD_ENDPOINTS")
            .or_else(|| var("ETCDCTL_ENDPOINTS"))
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_owned());
        let mut config = ConnectConfig::new(
            endpoints
                .split(',')
                .map(str::trim)
                .filter(|e| !e.is_empty())
                .map(String::from),
        );
        if let Some(user) = var("ETCDCTL_USER") {
            let (name, password) = match (user.split_once(':'), var("ETCDCTL_PASSWORD")) {
                (Some((name, password)), _) => (name.to_owned(), password.to_owned()),
                (None, Some(password)) => (user.clone(), password),
                (None, None) => {
                    return Err(ConnectError::Env {
                        var: "ETCDCTL_USER",
                        why: "expected name:password (or set ETCDCTL_PASSWORD)".into(),
                    })
                }
            };
            config = config.user(name, password);
        }
        if let Some(path) = var("ETCDCTL_CACERT") {
            config.ca = Some(read("CA certificate", Path::new(&path))?);
        }
        match (var("ETCDCTL_CERT"), var("ETCDCTL_KEY")) {
            (Some(cert), Some(key)) => {
                config.identity = Some((
                    read("client certificate", Path::new(&cert))?,
                    read("client key", Path::new(&key))?,
                ));
            }
            (None, None) => {}
            (Some(_), None) | (None, Some(_)) => {
                return Err(ConnectError::Env {
                    var: "ETCDCTL_CERT",
                    why: "ETCDCTL_CERT and ETCDCTL_KEY go together".into(),
                })
            }
        }
        Ok(config)
    }

    /// Authenticate as etcd user `name`.
    #[must_use]
    pub fn user(mut self, name: impl Into<String>, password: impl Into<String>) -> Self {
        self.user = Some((name.into(), password.into()));
        self
    }

    /// Use TLS, trusting the CA certificate(s) in `pem` (feature `tls`).
    #[must_use]
    pub fn ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca = Some(pem.into());
        self
    }

    /// Present this client certificate and key (PEM) for mutual TLS (feature `tls`).
    #[must_use]
    pub fn client_identity(
        mut self,
        cert_pem: impl Into<Vec<u8>>,
        key_pem: impl Into<Vec<u8>>,
    ) -> Self {
        self.identity = Some((cert_pem.into(), key_pem.into()));
        self
    }

    /// The etcd user and password given ([`user`](Self::user), `ETCDCTL_USER`), for a part
    /// that authenticates on its own (the cache server's `upstream_user`).
    pub fn credentials(&self) -> Option<(&str, &str)> {
        self.user
            .as_ref()
            .map(|(name, password)| (name.as_str(), password.as_str()))
    }

    /// The endpoints.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    fn is_tls(&self) -> bool {
        self.ca.is_some() || self.identity.is_some()
    }

    /// The endpoints as URLs: `https://` when TLS is configured and no scheme is given.
    fn urls(&self) -> Vec<String> {
        let scheme = if self.is_tls() { "https://" } else { "http://" };
        self.endpoints
            .iter()
            .map(|e| {
                if e.contains("://") {
                    e.clone()
                } else {
                    format!("{scheme}{e}")
                }
            })
            .collect()
    }

    /// The etcd-client options: [`connect_options`] plus the user and TLS.
    pub fn options(&self) -> Result<ConnectOptions, ConnectError> {
        let mut options = connect_options();
        if let Some((name, password)) = &self.user {
            options = options.with_user(name.clone(), password.clone());
        }
        if self.is_tls() {
            options = self.with_tls(options)?;
        }
        Ok(options)
    }

    #[cfg(feature = "tls")]
    fn with_tls(&self, options: ConnectOptions) -> Result<ConnectOptions, ConnectError> {
        Ok(match self.tls_options() {
            Some(tls) => options.with_tls(tls),
            None => options,
        })
    }

    /// The TLS options (CA, client certificate) of this configuration, `None` without TLS:
    /// for other connections to the same etcd (the cache server's forwarding channel).
    #[cfg(feature = "tls")]
    pub fn tls_options(&self) -> Option<etcd_client::TlsOptions> {
        use etcd_client::{Certificate, Identity, TlsOptions};
        if !self.is_tls() {
            return None;
        }
        let mut tls = TlsOptions::new();
        if let Some(ca) = &self.ca {
            tls = tls.ca_certificate(Certificate::from_pem(ca));
        }
        if let Some((cert, key)) = &self.identity {
            tls = tls.identity(Identity::from_pem(cert, key));
        }
        Some(tls)
    }

    #[cfg(not(feature = "tls"))]
    fn with_tls(&self, _options: ConnectOptions) -> Result<ConnectOptions, ConnectError> {
        Err(ConnectError::TlsDisabled {
            what: format!(
                "connecting to {:?} with a CA or client certificate",
                self.endpoints
            ),
        })
    }

    /// Connects without waiting for etcd: the connection is made on the first request, so a
    /// server can start (and say it is not ready) before etcd does. With a user, etcd is asked
    /// for a token now, and must answer.
    pub async fn connect_lazily(&self) -> Result<Client, ConnectError> {
        let urls = self.urls();
        Client::connect(&urls, Some(self.options()?))
            .await
            .map_err(|source| ConnectError::Etcd {
                endpoints: urls,
                source,
            })
    }

    /// Connects, and checks with one request that etcd answers and accepts the TLS handshake
    /// and the credentials, so that a wrong CA, certificate or password is one clear error at
    /// start rather than a watch retrying forever.
    pub async fn connect(&self) -> Result<Client, ConnectError> {
        let urls = self.urls();
        let failed = |source| ConnectError::Etcd {
            endpoints: urls.clone(),
            source,
        };
        let client = Client::connect(&urls, Some(self.options()?))
            .await
            .map_err(failed)?;
        // Status needs no permission on any key, so a user limited to one prefix passes; the
        // password was checked when connecting.
        client.maintenance_client().status().await.map_err(failed)?;
        Ok(client)
    }
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, ConnectError> {
    std::fs::read(path).map_err(|source| ConnectError::File {
        what,
        path: path.to_owned(),
        source,
    })
}
