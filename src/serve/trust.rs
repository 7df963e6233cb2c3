//! Who acts as whom in etcd: what a watch moved out of the history runs as (the server's own
//! identity), and whether requests without a token are forwarded, decided once at start-up
//! from the options, with the warnings and the refusal an operator must see.

use std::net::SocketAddr;

use super::forward::Tokenless;
use super::options::CacheServerOptions;
use super::served::OwnIdentity;

/// Who a watch moved out of the history runs as (see [`OwnIdentity`]).
pub(super) fn own_identity(options: &CacheServerOptions) -> OwnIdentity {
    #[cfg(feature = "tls")]
    let certificate = (options.upstream_tls.as_ref()).is_some_and(super::forward::carries_identity);
    #[cfg(not(feature = "tls"))]
    let certificate = false;
    match &options.upstream_user {
        Some(user) => OwnIdentity::User {
            name: user.name.clone(),
            password: user.password.clone(),
            token: Default::default(),
        },
        None if certificate => OwnIdentity::Certificate,
        None => OwnIdentity::ClientsToken,
    }
}

/// What becomes of token-less requests, and the start-up warnings about who can reach the
/// server: etcd runs a token-less request as its connection's certificate, and the server's
/// upstream connection is its own, so with a certificate there they are refused unless the
/// operator trusts every client as the server. The error is why the server must not start
/// ([`ServeError::Unsafe`](super::ServeError::Unsafe)).
pub(super) fn tokenless_policy(
    options: &CacheServerOptions,
    listen: SocketAddr,
) -> Result<Tokenless, String> {
    #[cfg(feature = "tls")]
    let (identity, serves_tls, client_ca) = (
        options
            .upstream_tls
            .as_ref()
            .is_some_and(super::forward::carries_identity),
        options.tls.is_some(),
        options
            .tls
            .as_ref()
            .is_some_and(|t| t.client_ca_pem.is_some()),
    );
    #[cfg(not(feature = "tls"))]
    let (identity, serves_tls, client_ca) = (false, false, false);
    if !listen.ip().is_loopback() && !serves_tls {
        tracing::warn!(%listen, "the cache server listens beyond loopback without TLS: clients' tokens and data cross the network in clear");
    }
    // etcd with its auth off ignores tokens (3.4.28+, 3.5.10+): any request with any token is
    // then run as the connection's certificate, so only a client CA of the server's own stands
    // between its clients and the server's identity.
    if identity && !client_ca && !options.trust_clients_as_server {
        return Err(format!(
            "the cache server on {listen} reaches etcd with a client certificate but asks its own clients for none: any client could act as that certificate in etcd (etcd with its auth off ignores tokens). Set a client CA (--client-ca), or --trust-clients-as-server if nothing but trusted processes can reach it"
        ));
    }
    Ok(match (identity, options.trust_clients_as_server) {
        (true, true) => {
            tracing::warn!(%listen, "trust_clients_as_server: requests without an auth token run as the server's own etcd identity (its client certificate); any client that reaches this server has the server's permissions");
            Tokenless::Forward
        }
        (true, false) => {
            tracing::info!("requests without an auth token are refused: the upstream connection carries the server's client certificate");
            Tokenless::Refuse
        }
        (false, _) => Tokenless::Forward,
    })
}

#[cfg(all(test, feature = "tls"))]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::serve::options::ServerTls;

    /// What `tokenless_policy` decides for `options` listening on `listen`, and what it warns.
    fn policy(options: &CacheServerOptions, listen: &str) -> (Result<Tokenless, String>, String) {
        #[derive(Clone, Default)]
        struct Buffer(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buffer {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                crate::sync::lock(&self.0).extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_writer(move || writer.clone())
            .finish();
        let listen = listen.parse().expect("address");
        let decided =
            tracing::subscriber::with_default(subscriber, || tokenless_policy(options, listen));
        let printed = String::from_utf8_lossy(&crate::sync::lock(&buffer.0)).into_owned();
        (decided, printed)
    }

    /// Issue 54, item 4: a server that reaches etcd with a client certificate and asks its
    /// own clients for none does not start (etcd 3.4.28+ and 3.5.10+ with their auth off run
    /// any request with any token as the certificate), unless the operator trusts its clients.
    #[test]
    fn a_client_certificate_upstream_refuses_token_less_requests_and_warnings_say_why() {
        let certificate =
            etcd_client::TlsOptions::new().identity(etcd_client::Identity::from_pem("cert", "key"));
        let mutual = ServerTls {
            cert_pem: b"cert".to_vec(),
            key_pem: b"key".to_vec(),
            client_ca_pem: Some(b"ca".to_vec()),
        };
        let plain = CacheServerOptions::default();
        assert_eq!(
            policy(&plain, "127.0.0.1:1"),
            (Ok(Tokenless::Forward), String::new())
        );
        let (decided, warned) = policy(&plain, "0.0.0.0:1");
        assert_eq!(decided, Ok(Tokenless::Forward));
        assert!(warned.contains("beyond loopback without TLS"), "{warned}");
        let identity = plain.clone().with_upstream_tls(Some(certificate));
        let (decided, _) = policy(&identity, "127.0.0.1:1");
        let refused = decided.expect_err("no client CA: the server does not start");
        assert!(refused.contains("--trust-clients-as-server"), "{refused}");
        let trusting = identity.clone().with_trust_clients_as_server(true);
        let (decided, warned) = policy(&trusting, "127.0.0.1:1");
        assert_eq!(decided, Ok(Tokenless::Forward));
        assert!(warned.contains("the server's permissions"), "{warned}");
        let secured = identity.clone().with_tls(Some(mutual));
        assert_eq!(
            policy(&secured, "10.0.0.1:1"),
            (Ok(Tokenless::Refuse), String::new())
        );
        let (decided, warned) = policy(&secured.with_trust_clients_as_server(true), "10.0.0.1:1");
        assert_eq!(decided, Ok(Tokenless::Forward));
        assert!(warned.contains("the server's permissions"), "{warned}");
    }
}
