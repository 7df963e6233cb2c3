//! One request to etcd: a small read hedged across members and bounded in time, and how a
//! failed request is classified for the reflector.

use std::time::Duration;

use etcd_client::{Client, GetOptions};
use tokio::time::Instant;

use crate::listwatch::hedged::{hedged, Hedged, HEDGE_AFTER};
use crate::listwatch::Error;

/// A small range read starting at `key`, hedged across members (see [`hedged`]) and bounded
/// by `timeout`: reads that gate the watch must not wait on a member that hangs.
pub(super) async fn read(
    client: &Client,
    key: &[u8],
    options: GetOptions,
    timeout: Duration,
) -> Hedged<etcd_client::GetResponse, etcd_client::Error> {
    let kv = client.kv_client();
    hedged(
        HEDGE_AFTER,
        Instant::now() + timeout,
        member_unreachable,
        || {
            let mut kv = kv.clone();
            let (key, options) = (key.to_vec(), options.clone());
            async move { kv.get(key, Some(options)).await }
        },
    )
    .await
}

/// Whether an error says the member could not be reached (another one may answer).
pub(super) fn member_unreachable(e: &etcd_client::Error) -> bool {
    classify_code(e) == Some(tonic::Code::Unavailable) || broken_connection(e)
}

/// Whether the error was made on our side from a broken or refused connection: a transport or
/// I/O error, or a status of code Unknown carrying such an error as its source (one etcd sent
/// carries none).
pub(super) fn broken_connection(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(status) => {
            status.code() == tonic::Code::Unknown && std::error::Error::source(status).is_some()
        }
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        _ => false,
    }
}

/// The gRPC status code of an error etcd (or the transport) returned, if it has one.
pub(super) fn classify_code(e: &etcd_client::Error) -> Option<tonic::Code> {
    match e {
        etcd_client::Error::GRpcStatus(status) => Some(status.code()),
        _ => None,
    }
}

/// Whether a response exceeded a gRPC message size limit (the client's or etcd's).
pub(super) fn is_message_too_large(e: &etcd_client::Error) -> bool {
    use tonic::Code;
    match classify_code(e) {
        // etcd's send limit, or ours as etcd reports it.
        Some(Code::ResourceExhausted) => true,
        // Our decoder's limit. etcd uses the same code for a compacted or a future revision,
        // which its text tells apart.
        Some(Code::OutOfRange) => !e.to_string().contains("revision"),
        _ => false,
    }
}

/// Sorts etcd's errors by what recovers from them, on their gRPC status code: a compacted
/// revision (OutOfRange) needs a relist; an etcd that cannot be reached or cannot serve now
/// (transport errors, Unavailable, which includes "no leader", DeadlineExceeded, Cancelled,
/// Aborted, and Unknown made from a broken connection) is retried as soon as it answers; anything else etcd answered is retried with the
/// protective backoff.
pub(super) fn classify(e: etcd_client::Error, revision: i64) -> Error {
    use tonic::Code;
    let message = e.to_string();
    let error = match &e {
        _ if broken_connection(&e) => Error::unavailable(message),
        etcd_client::Error::GRpcStatus(status) => match status.code() {
            Code::OutOfRange if message.contains("compacted") => Error::expired(revision, message),
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Aborted => {
                Error::unavailable(message)
            }
            _ => Error::transient(message),
        },
        _ if message.contains("required revision has been compacted") => {
            Error::expired(revision, message)
        }
        _ => Error::transient(message),
    };
    error.with_source(e)
}

/// Prefixes a transient error's message with the prefix it concerns.
pub(super) fn named(mut error: Error, prefix: &str) -> Error {
    if let Error::Transient { message, .. } | Error::Unavailable { message, .. } = &mut error {
        *message = format!("{prefix}: {message}");
    }
    error
}
