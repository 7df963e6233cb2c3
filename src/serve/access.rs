//! The access answers: whether a client may read a cached range, asked of etcd with the
//! client's own credentials and remembered for `access_ttl` at most.

use std::time::Duration;

use etcd_client::proto::{PbRangeRequest, PbRangeResponse};
use tonic::{Code, Request, Status};

use super::served::{Served, Slice};
use crate::sync::lock;

/// How long the upstream's answer on a client's access is used by default, from when it was
/// asked: the bound on how long a permission revoked in etcd keeps working through the server.
pub(crate) const ACCESS_TTL: Duration = Duration::from_secs(5);
/// How long the upstream is given to answer an access check.
const ACCESS_PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// Access answers remembered at most (all are forgotten past it).
const ACCESS_ENTRIES: usize = 10_000;

/// Whether etcd refused the client (rather than failing to answer).
fn is_refusal(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::PermissionDenied
            | Code::Unauthenticated
            | Code::InvalidArgument
            | Code::FailedPrecondition
    )
}

impl Served {
    /// Whether etcd answers a read of `slice`'s first key that carries no token, as it does
    /// with its auth off (with auth on, etcd refuses it: "user name is empty"; and a server
    /// whose upstream connection has a certificate refuses it itself). Asked every second while
    /// etcd refuses the server's own list.
    pub(crate) async fn answers_tokenless(&self, slice: &Slice) -> bool {
        let probe = PbRangeRequest {
            key: slice.first_key(),
            limit: 1,
            count_only: true,
            serializable: true,
            ..Default::default()
        };
        let asked = self
            .upstream
            .unary::<_, PbRangeResponse>(Request::new(probe), "/etcdserverpb.KV/Range");
        matches!(
            tokio::time::timeout(ACCESS_PROBE_TIMEOUT, asked).await,
            Ok(Ok(_))
        )
    }

    /// Whether the client with `metadata` may read `[key, end)`: the upstream is asked once per
    /// credentials and range (a one-key count, with the client's token) and its answer used
    /// for `access_ttl` from when it was asked, never longer: a permission revoked in etcd
    /// stops working here within that bound. A refusal is the upstream's error; an upstream
    /// that cannot be asked gets Unavailable, since an expired answer is no answer.
    pub(crate) async fn may_read(
        &self,
        metadata: &tonic::metadata::MetadataMap,
        key: &[u8],
        end: &[u8],
    ) -> Result<(), Status> {
        // The client's credentials as etcd reads them: the `token` header, else
        // `authorization`. An answer is remembered only for the same credentials, so that a
        // client without any never reads what one with them was allowed.
        let credentials = metadata
            .get("token")
            .or_else(|| metadata.get("authorization"))
            .map(|t| t.as_bytes().to_vec());
        let entry = (credentials, key.to_vec(), end.to_vec());
        if let Some((asked_at, answer)) = lock(&self.access).get(&entry) {
            if asked_at.elapsed() < self.access_ttl {
                return answer.clone();
            }
        }
        let probe = PbRangeRequest {
            key: key.to_vec(),
            range_end: end.to_vec(),
            limit: 1,
            count_only: true,
            serializable: true,
            ..Default::default()
        };
        // The bound runs from the question: etcd may have revoked the permission just after
        // answering.
        let asked_at = std::time::Instant::now();
        let asked = self.upstream.unary::<_, PbRangeResponse>(
            Request::from_parts(metadata.clone(), Default::default(), probe),
            "/etcdserverpb.KV/Range",
        );
        // A hung upstream must not hang reads the cache can answer.
        let asked = tokio::time::timeout(ACCESS_PROBE_TIMEOUT, asked)
            .await
            .unwrap_or_else(|_| Err(Status::deadline_exceeded("no answer")));
        let answer = match asked {
            Ok(_) => Ok(()),
            Err(status) if is_refusal(&status) => Err(status),
            Err(status) => {
                tracing::debug!(message = status.message(), "an access check got no answer");
                return Err(Status::unavailable(format!(
                    "etcd-informer cache server: cannot check the client's access with etcd: {}",
                    status.message()
                )));
            }
        };
        let mut access = lock(&self.access);
        if access.len() >= ACCESS_ENTRIES {
            access.clear();
        }
        access.insert(entry, (asked_at, answer.clone()));
        answer
    }
}
