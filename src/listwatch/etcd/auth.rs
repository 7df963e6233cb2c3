//! Keeping an expiring auth token renewed while the source retries.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::Client;

use crate::listwatch::Error;

/// How long authenticating again may take before the retry goes ahead without it.
pub(super) const RENEW_TIMEOUT: Duration = Duration::from_secs(5);

/// Renews the auth token before the next attempt when etcd refused it (it forgets simple tokens
/// after `--auth-token-ttl`; a watch stream keeps the token it was opened with). Renewing right
/// before the retry, not when the error arrives, keeps the new token from expiring unused during
/// the backoff when the TTL is shorter than the delay. etcd 3.4 reports a refused token on a
/// watch as "permission denied", so that too renews (one Authenticate call per retry, which the
/// backoff spaces out). A client without credentials does nothing.
#[derive(Clone, Default)]
pub(super) struct TokenRenewal(Arc<AtomicBool>);

impl TokenRenewal {
    /// Remembers to renew the token if `error` says etcd refused it: by its gRPC status code
    /// when etcd sent one (Unauthenticated for a forgotten token, PermissionDenied, which etcd
    /// 3.4 answers a watch with an expired token); by the text of a watch's cancel reason,
    /// which is all etcd gives there.
    pub(super) fn note(&self, error: &Error) {
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
    pub(super) async fn renew_if_refused(&self, client: &Client) {
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
