//! The access answers: whether a client may read a cached range, asked of etcd with the
//! client's own credentials and remembered for `access_ttl` at most, in a bounded memory.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use etcd_client::proto::{PbRangeRequest, PbRangeResponse};
use tonic::{Code, Request, Status};

use super::forward::Upstream;
use crate::sync::lock;

/// How long the upstream's answer on a client's access is used by default, from when it was
/// asked: the bound on how long a permission revoked in etcd keeps working through the server.
pub(crate) const ACCESS_TTL: Duration = Duration::from_secs(5);
/// How long the upstream is given to answer an access check.
const ACCESS_PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// The bytes of remembered answers (their credentials, keys and range ends) at most: past it
/// the expired ones are forgotten, and if that is not enough, all of them. A client that asks
/// about ever new ranges (refused ones included) holds no more than this, and nothing once
/// its answers expire.
const REMEMBERED_BYTES: usize = 8 << 20;
/// An answer about a question larger than this (its credentials, key and range end) is not
/// remembered: such a client is asked about each time, at its own cost in time.
const REMEMBERED_QUESTION: usize = 4 << 10;

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

/// A question about access: the client's credentials, the key and the range end.
type Question = (Option<Vec<u8>>, Vec<u8>, Vec<u8>);

/// etcd's answers on clients' access to ranges (see [`AccessAnswers::may_read`]).
pub(crate) struct AccessAnswers {
    ttl: Duration,
    remembered: Mutex<Remembered>,
}

#[derive(Default)]
struct Remembered {
    answers: HashMap<Question, (Instant, Result<(), Status>)>,
    /// The bytes of the questions and answers held.
    bytes: usize,
}

/// What one remembered answer costs, roughly: its question, its error text, and the entry.
fn cost(question: &Question, answer: &Result<(), Status>) -> usize {
    let (credentials, key, end) = question;
    let error = answer.as_ref().err().map_or(0, |s| s.message().len());
    credentials.as_ref().map_or(0, Vec::len) + key.len() + end.len() + error + 128
}

impl AccessAnswers {
    /// Answers used for `ttl` from when they were asked.
    pub(crate) fn new(ttl: Duration) -> Self {
        AccessAnswers {
            ttl,
            remembered: Mutex::default(),
        }
    }

    /// Whether the client with `metadata` may read `[key, end)`: the upstream is asked once
    /// per credentials and range (a one-key count, with the client's token) and its answer
    /// used for the TTL from when it was asked, never longer: a permission revoked in etcd
    /// stops working here within that bound. A refusal is the upstream's error; an upstream
    /// that cannot be asked gets Unavailable, since an expired answer is no answer.
    pub(crate) async fn may_read(
        &self,
        upstream: &Upstream,
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
        let question = (credentials, key.to_vec(), end.to_vec());
        if let Some((asked_at, answer)) = lock(&self.remembered).answers.get(&question) {
            if asked_at.elapsed() < self.ttl {
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
        let asked_at = Instant::now();
        let asked = upstream.unary::<_, PbRangeResponse>(
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
        self.remember(question, asked_at, answer.clone());
        answer
    }

    fn remember(&self, question: Question, asked_at: Instant, answer: Result<(), Status>) {
        let added = cost(&question, &answer);
        if added > REMEMBERED_QUESTION {
            return;
        }
        let mut remembered = lock(&self.remembered);
        if remembered.bytes + added > REMEMBERED_BYTES {
            let ttl = self.ttl;
            remembered.answers.retain(|_, (at, _)| at.elapsed() < ttl);
            let held = remembered.answers.iter().map(|(q, (_, a))| cost(q, a));
            remembered.bytes = held.sum();
            if remembered.bytes + added > REMEMBERED_BYTES {
                remembered.answers.clear();
                remembered.bytes = 0;
            }
        }
        if let Some((_, old)) = remembered
            .answers
            .insert(question.clone(), (asked_at, answer))
        {
            remembered.bytes -= cost(&question, &old);
        }
        remembered.bytes += added;
    }

    /// The bytes the remembered answers take (see [`REMEMBERED_BYTES`]).
    #[cfg(test)]
    fn bytes(&self) -> usize {
        lock(&self.remembered).bytes
    }
}

/// Whether etcd answers a read of `key` that carries no token, as it does with its auth off
/// (with auth on, etcd refuses it: "user name is empty"; and a server whose upstream
/// connection has a certificate refuses it itself). Asked every second while etcd refuses the
/// server's own list.
pub(crate) async fn answers_tokenless(upstream: &Upstream, key: Vec<u8>) -> bool {
    let probe = PbRangeRequest {
        key,
        limit: 1,
        count_only: true,
        serializable: true,
        ..Default::default()
    };
    let asked = upstream.unary::<_, PbRangeResponse>(Request::new(probe), "/etcdserverpb.KV/Range");
    matches!(
        tokio::time::timeout(ACCESS_PROBE_TIMEOUT, asked).await,
        Ok(Ok(_))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_stay_within_their_bytes_and_large_questions_are_not_remembered() {
        let answers = AccessAnswers::new(Duration::from_secs(60));
        let refused = || Err(Status::permission_denied("etcdserver: permission denied"));
        // A client asking about ever new ranges, each refused.
        for i in 0..50_000u32 {
            let key = format!("/registry/{i:0>1000}").into_bytes();
            answers.remember((None, key, Vec::new()), Instant::now(), refused());
            assert!(answers.bytes() <= REMEMBERED_BYTES);
        }
        let answers = AccessAnswers::new(Duration::from_secs(60));
        let huge = vec![b'k'; 1 << 20];
        answers.remember((None, huge, Vec::new()), Instant::now(), refused());
        assert_eq!(answers.bytes(), 0, "a 1 MiB key is not remembered");
    }
}
