//! A cache server: serves etcd's gRPC API for one prefix from a cache, so that any number of
//! etcdctl, etcd-client or informer processes read and watch it without loading etcd.
//!
//! ```text
//! cargo run --example cache_server -- --prefix /registry/ --listen 127.0.0.1:23790
//! ETCDCTL_API=3 etcdctl --endpoints 127.0.0.1:23790 get --prefix /registry/
//! ```
//!
//! The upstream etcd comes from ETCD_ENDPOINTS (with etcdctl's ETCDCTL_* variables), else
//! 127.0.0.1:2379, else a throwaway etcd started here. Prints one `ready:` line once the cache
//! has listed the prefix (`--prefix /registry/pods/,/registry/nodes/`: one cache each).
//! `--cert server.pem --key server-key.pem` serve TLS, and
//! `--client-ca ca.pem` mutual TLS.
//!
//! With ETCDCTL_CERT, requests without an auth token are refused (etcd would run them as this
//! server's certificate); `--trust-clients-as-server` forwards them anyway, giving every
//! client that can reach the server the server's own permissions.
mod common;

use std::time::Duration;

use etcd_informer::serve::{CacheServer, CacheServerOptions, ServerTls};
use etcd_informer::ConnectConfig;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let shutdown = common::shutdown_signal();
    let prefix = common::arg("prefix", "/registry/");
    // Loopback by default: the server checks no credentials of its own.
    let listen = common::arg("listen", "127.0.0.1:23790").parse()?;
    let (client, etcd) = common::etcd().await;
    let endpoints: Vec<String> = match (std::env::var("ETCD_ENDPOINTS"), &etcd) {
        (Ok(list), _) => list.split(',').map(str::to_owned).collect(),
        (Err(_), Some(server)) => server.endpoints(),
        (Err(_), None) => vec!["127.0.0.1:2379".to_owned()],
    };
    // --cert and --key (PEM files) serve TLS; --client-ca also asks clients for a certificate.
    let tls = match (common::arg("cert", ""), common::arg("key", "")) {
        (cert, key) if !cert.is_empty() && !key.is_empty() => {
            let client_ca = common::arg("client-ca", "");
            Some(ServerTls {
                cert_pem: std::fs::read(&cert)?,
                key_pem: std::fs::read(&key)?,
                client_ca_pem: if client_ca.is_empty() {
                    None
                } else {
                    Some(std::fs::read(&client_ca)?)
                },
            })
        }
        _ => None,
    };
    // Forwarded requests reach etcd with etcdctl's TLS variables too (ETCDCTL_CACERT...), and
    // watches that fall out of the history run as ETCDCTL_USER, the server's own user.
    let config = match std::env::var_os("ETCD_ENDPOINTS") {
        Some(_) => Some(ConnectConfig::from_env()?),
        None => None,
    };
    let upstream_tls = config.as_ref().and_then(ConnectConfig::tls_options);
    let trust = std::env::args().any(|a| a == "--trust-clients-as-server");
    let mut options = CacheServerOptions::default()
        .with_tls(tls)
        .with_upstream_tls(upstream_tls)
        .with_trust_clients_as_server(trust);
    if let Some((name, password)) = config.as_ref().and_then(ConnectConfig::credentials) {
        options = options.with_upstream_user(name, password);
    }
    // Several prefixes, comma-separated, each get their own cache.
    let mut prefixes = prefix.split(',');
    let mut server = CacheServer::new(client, endpoints, prefixes.next().unwrap_or_default());
    for more in prefixes {
        server = server.with_prefix(more);
    }
    let server = server.with_options(options).bind(listen).await?;
    server.ready(Duration::from_secs(60)).await?;
    let stats = server.stats();
    say!(
        "ready: serving {prefix} at {} (revision {}, keys: {})",
        server.local_addr(),
        stats.revision,
        stats.keys
    );
    shutdown.await;
    let stats = server.stats();
    eprintln!("stopping: {stats:?}");
    server.shutdown().await;
    Ok(())
}
