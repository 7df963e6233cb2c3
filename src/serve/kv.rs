//! The KV service: Range answered from the cache for ranges inside the served prefix, the
//! same answer etcd gives (filters, sort, limit, count, revision); every other range and every
//! write forwarded to the upstream.

use std::cmp::Ordering;
use std::sync::atomic::Ordering as AtomicOrdering;
use std::sync::Arc;

use etcd_client::proto::{
    PbCompactionRequest, PbCompactionResponse, PbDeleteRequest, PbDeleteResponse, PbKvService,
    PbPutRequest, PbPutResponse, PbRangeRequest, PbRangeResponse, PbRangeStreamResponse,
    PbTxnRequest, PbTxnResponse,
};
use std::convert::Infallible;
use std::task::{Context, Poll};

use bytes::Bytes;
use etcd_client::proto::{PbKvServer, PbResponseHeader};
use tonic::body::Body;
use tonic::codegen::{http, BoxFuture, Service};
use tonic::server::{NamedService, UnaryService};
use tonic::{Request, Response, Status};
use tonic_prost::prost::Message;

use super::cache::{to_pb, Found, Kv};
use super::encode::{range_response, RangeCodec};
use super::forward::Connection;
use super::served::{Served, PROOF_REFUSED};
use super::status::{no_leader, requires_leader, stopped};

// etcd's RangeRequest enums (rpc.proto).
const SORT_NONE: i32 = 0;
const SORT_ASCEND: i32 = 1;
const SORT_DESCEND: i32 = 2;
const TARGET_KEY: i32 = 0;
const TARGET_VERSION: i32 = 1;
const TARGET_CREATE: i32 = 2;
const TARGET_MOD: i32 = 3;
const TARGET_VALUE: i32 = 4;

/// The KV service.
pub(crate) struct KvService {
    pub(crate) served: Arc<Served>,
}

/// The served prefix that can answer a Range from its cache: one holding the whole range,
/// listed, with options the cache knows, the upstream's identity known.
fn from_cache(served: &Served, r: &PbRangeRequest) -> Option<usize> {
    let known = served.headers.known()
        && (SORT_NONE..=SORT_DESCEND).contains(&r.sort_order)
        && (TARGET_KEY..=TARGET_VALUE).contains(&r.sort_target);
    known
        .then(|| served.slice_for(&r.key, &r.range_end))
        .flatten()
}

/// etcd's answer to `r` from the keys of its range at the asked revision.
pub(crate) fn answer(r: &PbRangeRequest, found: Vec<(Arc<[u8]>, Kv)>) -> (Found, bool, i64) {
    let count = found.len() as i64;
    if r.count_only {
        return (Vec::new(), false, count);
    }
    let mut kvs: Vec<(Arc<[u8]>, Kv)> = found
        .into_iter()
        .filter(|(_, kv)| {
            (r.max_mod_revision == 0 || kv.mod_revision <= r.max_mod_revision)
                && (r.min_mod_revision == 0 || kv.mod_revision >= r.min_mod_revision)
                && (r.max_create_revision == 0 || kv.create_revision <= r.max_create_revision)
                && (r.min_create_revision == 0 || kv.create_revision >= r.min_create_revision)
        })
        .collect();
    let filtered = r.max_mod_revision != 0
        || r.min_mod_revision != 0
        || r.max_create_revision != 0
        || r.min_create_revision != 0;
    if r.sort_order == SORT_NONE && !filtered && r.limit > 0 {
        // etcd reads one key past the limit in key order before it sorts by another target
        // (`Range` in its apply.go): a sort by value with no order sorts those keys only.
        kvs.truncate(usize::try_from(r.limit.saturating_add(1)).unwrap_or(usize::MAX));
    }
    let mut order = r.sort_order;
    if r.sort_target != TARGET_KEY && order == SORT_NONE {
        // etcd sorts ascending when only a target other than the key is given.
        order = SORT_ASCEND;
    }
    if order != SORT_NONE {
        let by = |a: &(Arc<[u8]>, Kv), b: &(Arc<[u8]>, Kv)| -> Ordering {
            match r.sort_target {
                TARGET_VERSION => a.1.version.cmp(&b.1.version),
                TARGET_CREATE => a.1.create_revision.cmp(&b.1.create_revision),
                TARGET_MOD => a.1.mod_revision.cmp(&b.1.mod_revision),
                TARGET_VALUE => a.1.value.cmp(&b.1.value),
                _ => a.0.cmp(&b.0),
            }
        };
        // Stable, from key order: ties stay in key order, either way, as etcd's sort leaves
        // them in the releases built with Go 1.19 or later for up to 12 keys. etcd promises
        // no order of ties (Go's `sort.Sort`): this is one it can give, and the same each time.
        if order == SORT_DESCEND {
            kvs.sort_by(|a, b| by(b, a));
        } else {
            kvs.sort_by(by);
        }
    }
    let mut more = false;
    if r.limit > 0 && kvs.len() as i64 > r.limit {
        kvs.truncate(usize::try_from(r.limit).unwrap_or(usize::MAX));
        more = true;
    }
    (kvs, more, count)
}

/// What the cache gave for a Range: the keys, or only their number (`count_only`).
enum Counted {
    Found(Found),
    Count(i64),
}

/// A Range's answer: etcd's, forwarded, or the cache's.
pub(crate) enum RangeAnswer {
    Forwarded(Response<PbRangeResponse>),
    Cached {
        header: PbResponseHeader,
        kvs: Found,
        keys_only: bool,
        more: bool,
        count: i64,
    },
}

/// Sends a Range to the upstream, with the client's credentials.
async fn forward(served: &Served, request: Request<PbRangeRequest>) -> Result<RangeAnswer, Status> {
    served.metrics.forwarded("Range");
    let connection = Connection::of(request.extensions());
    let answer: Response<PbRangeResponse> = served
        .upstream
        .unary(request, "/etcdserverpb.KV/Range")
        .await?;
    saw(
        served,
        connection.as_ref(),
        answer.get_ref().header.as_ref(),
    );
    Ok(RangeAnswer::Forwarded(answer))
}

/// The client on `connection` was answered `header`'s revision.
fn saw(served: &Served, connection: Option<&Connection>, header: Option<&PbResponseHeader>) {
    if let (Some(connection), Some(header)) = (connection, header) {
        connection.saw(served.headers.generation(), header.revision);
    }
}

/// Whether a range from `key` to `end` (a Put's key alone when `end` is empty, every key from
/// `key` when it is `\0`) overlaps the range from `from` to `to`.
fn overlaps(key: &[u8], end: &[u8], from: &[u8], to: &[u8]) -> bool {
    let starts_before_to = to.is_empty() || key < to;
    let ends_after_from = match end {
        [] => key >= from,
        [0] => true,
        end => end > from,
    };
    starts_before_to && ends_after_from
}

/// Answers a Range: from the cache when it can (see [`from_cache`]), after the access check
/// and, for a linearizable read, the freshness proof; else forwarded.
pub(crate) async fn range(
    served: &Served,
    request: Request<PbRangeRequest>,
) -> Result<RangeAnswer, Status> {
    let Some(slice) = from_cache(served, request.get_ref()) else {
        return forward(served, request).await;
    };
    if requires_leader(request.metadata()) && served.headers.no_leader() {
        return Err(no_leader());
    }
    // A drained or dropped server's cache no longer follows etcd: the client goes elsewhere.
    if *served.draining.borrow() {
        return Err(stopped());
    }
    let slice = &served.slices[slice];
    // Never a byte to a client the upstream would refuse.
    let r = request.get_ref();
    served
        .access
        .may_read(&served.upstream, request.metadata(), &r.key, &r.range_end)
        .await?;
    let connection = Connection::of(request.extensions());
    let (metadata, extensions, r) = request.into_parts();
    // etcd's revision the content is proven at: for a linearizable read, etcd's current one;
    // for a serializable read, at least every revision an answer on the connection named (its
    // own write, a read forwarded), as a serializable read of etcd's member would be: those
    // of content since replaced (a wiped store) promise nothing, and are not waited for.
    let generation = served.headers.generation();
    let target = match r.serializable {
        true => Some(connection.as_ref().map_or(0, |c| c.seen(generation))),
        false => None,
    };
    let own = slice.proven_at(slice.cache.position());
    let proven_at = match target {
        Some(seen) if own >= seen => own,
        target => {
            let proven = served.linearize(slice, &r.key, &r.range_end, target).await;
            let refused = proven
                .as_ref()
                .is_err_and(|s| s.message().starts_with(PROOF_REFUSED));
            let stopped = !slice.covers(&r.key, &r.range_end);
            // A serializable read the cache cannot name a late enough revision for, a proof
            // refused to the server (not to the client), or a cache that stopped following
            // etcd meanwhile (etcd refused its watch): etcd answers.
            if refused || stopped || (target.is_some() && proven.is_err()) {
                let request = Request::from_parts(metadata, extensions, r);
                return forward(served, request).await;
            }
            proven?
        }
    };
    // A past revision is answered from the history only while etcd holds it too; below the
    // history, or past the cache's revision, etcd answers: it is the judge of what a
    // revision holds, compacted or future.
    let held = r.revision <= 0 || served.etcd_holds(slice, r.revision).await?;
    let (key, end, at) = (&r.key, &r.range_end, r.revision);
    let found = match (held, r.count_only) {
        (false, _) => None,
        (true, true) => (slice.cache.count_at(key, end, at, proven_at).ok())
            .map(|(count, revision)| (Counted::Count(count), revision)),
        (true, false) => (slice.cache.range_at(key, end, at, proven_at).ok())
            .map(|(found, revision)| (Counted::Found(found), revision)),
    };
    let Some((found, revision)) = found else {
        return forward(served, Request::from_parts(metadata, extensions, r)).await;
    };
    let (kvs, more, count) = match found {
        Counted::Found(found) => answer(&r, found),
        Counted::Count(count) => (Vec::new(), false, count),
    };
    slice.counts.ranged();
    if let Some(connection) = &connection {
        connection.saw(generation, revision.max(proven_at));
    }
    Ok(RangeAnswer::Cached {
        header: served.headers.header(revision.max(proven_at)),
        kvs,
        keys_only: r.keys_only,
        more,
        count,
    })
}

/// Range with its answer encoded straight from the cache ([`range_response`]), in front of
/// the generated KV service, which takes every other method.
#[derive(Clone)]
pub(crate) struct KvFront {
    pub(crate) served: Arc<Served>,
    pub(crate) inner: PbKvServer<KvService>,
    /// The largest request a client may send.
    pub(crate) max_request: usize,
}

impl NamedService for KvFront {
    const NAME: &'static str = "etcdserverpb.KV";
}

/// One Range call.
struct RangeCall(Arc<Served>);

impl UnaryService<PbRangeRequest> for RangeCall {
    type Response = Bytes;
    type Future = BoxFuture<Response<Bytes>, Status>;

    fn call(&mut self, request: Request<PbRangeRequest>) -> Self::Future {
        let served = self.0.clone();
        Box::pin(async move {
            match range(&served, request).await? {
                RangeAnswer::Forwarded(answer) => {
                    let (metadata, message, extensions) = answer.into_parts();
                    let bytes = Bytes::from(message.encode_to_vec());
                    Ok(Response::from_parts(metadata, bytes, extensions))
                }
                RangeAnswer::Cached {
                    header,
                    kvs,
                    keys_only,
                    more,
                    count,
                } => {
                    // Encoding a large list takes a while: off the reactor's threads.
                    let encode = move || range_response(&header, &kvs, keys_only, more, count);
                    let bytes = if kvs_are_many(count) {
                        tokio::task::spawn_blocking(encode)
                            .await
                            .map_err(|e| Status::internal(format!("encoding failed: {e}")))?
                    } else {
                        encode()
                    };
                    Ok(Response::new(bytes))
                }
            }
        })
    }
}

/// Whether an answer is large enough to encode on a blocking thread.
fn kvs_are_many(count: i64) -> bool {
    count > 1000
}

impl Service<http::Request<Body>> for KvFront {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        if request.uri().path() != "/etcdserverpb.KV/Range" {
            return Box::pin(self.inner.call(request));
        }
        let (served, max_request) = (self.served.clone(), self.max_request);
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(RangeCodec)
                .apply_max_message_size_config(Some(max_request), Some(usize::MAX));
            Ok(grpc.unary(RangeCall(served), request).await)
        })
    }
}

#[tonic::async_trait]
impl PbKvService for KvService {
    /// Not reached behind [`KvFront`], which answers Range itself; kept typed for the trait.
    async fn range(
        &self,
        request: Request<PbRangeRequest>,
    ) -> Result<Response<PbRangeResponse>, Status> {
        match range(&self.served, request).await? {
            RangeAnswer::Forwarded(answer) => Ok(answer),
            RangeAnswer::Cached {
                header,
                kvs,
                keys_only,
                more,
                count,
            } => Ok(Response::new(PbRangeResponse {
                header: Some(header),
                kvs: kvs
                    .iter()
                    .map(|(key, kv)| to_pb(key, kv, keys_only))
                    .collect(),
                more,
                count,
            })),
        }
    }

    type RangeStreamStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<PbRangeStreamResponse, Status>> + Send>,
    >;

    async fn range_stream(
        &self,
        _request: Request<PbRangeRequest>,
    ) -> Result<Response<Self::RangeStreamStream>, Status> {
        // etcd 3.4 and 3.5 have no RangeStream either.
        Err(Status::unimplemented(
            "unknown method RangeStream for service etcdserverpb.KV",
        ))
    }

    async fn put(&self, request: Request<PbPutRequest>) -> Result<Response<PbPutResponse>, Status> {
        self.served.metrics.forwarded("Put");
        let connection = Connection::of(request.extensions());
        let key = request.get_ref().key.clone();
        let answer: Response<PbPutResponse> = (self.served.upstream)
            .unary(request, "/etcdserverpb.KV/Put")
            .await?;
        self.wrote(connection, &key, &[], answer.get_ref().header.as_ref());
        Ok(answer)
    }

    async fn delete_range(
        &self,
        request: Request<PbDeleteRequest>,
    ) -> Result<Response<PbDeleteResponse>, Status> {
        self.served.metrics.forwarded("DeleteRange");
        let connection = Connection::of(request.extensions());
        let (key, end) = (
            request.get_ref().key.clone(),
            request.get_ref().range_end.clone(),
        );
        let answer: Response<PbDeleteResponse> = (self.served.upstream)
            .unary(request, "/etcdserverpb.KV/DeleteRange")
            .await?;
        let header = answer.get_ref().header.as_ref();
        if answer.get_ref().deleted > 0 {
            self.wrote(connection, &key, &end, header);
        } else {
            // Nothing deleted: no event comes for the cache to wait for.
            saw(&self.served, connection.as_ref(), header);
        }
        Ok(answer)
    }

    async fn txn(&self, request: Request<PbTxnRequest>) -> Result<Response<PbTxnResponse>, Status> {
        self.served.metrics.forwarded("Txn");
        let connection = Connection::of(request.extensions());
        let answer: Response<PbTxnResponse> = (self.served.upstream)
            .unary(request, "/etcdserverpb.KV/Txn")
            .await?;
        // Which prefixes a transaction wrote is not told apart: a serializable read after it
        // is forwarded until the cache has passed its revision.
        saw(
            &self.served,
            connection.as_ref(),
            answer.get_ref().header.as_ref(),
        );
        Ok(answer)
    }

    async fn compact(
        &self,
        request: Request<PbCompactionRequest>,
    ) -> Result<Response<PbCompactionResponse>, Status> {
        self.served.metrics.forwarded("Compact");
        let revision = request.get_ref().revision;
        let answer = self
            .served
            .upstream
            .unary(request, "/etcdserverpb.KV/Compact")
            .await?;
        // What etcd no longer answers, the cache no longer answers either.
        for slice in &self.served.slices {
            slice.cache.compacted(revision);
        }
        Ok(answer)
    }
}

impl KvService {
    /// A write from `connection` of the range from `key` to `end` was answered with `header`:
    /// the client saw its revision, and the caches of the prefixes it touched will reach it.
    fn wrote(
        &self,
        connection: Option<Connection>,
        key: &[u8],
        end: &[u8],
        header: Option<&PbResponseHeader>,
    ) {
        let Some(header) = header else {
            return;
        };
        saw(&self.served, connection.as_ref(), Some(header));
        for slice in &self.served.slices {
            if overlaps(key, end, &slice.prefix, &slice.prefix_end) {
                slice
                    .written
                    .fetch_max(header.revision, AtomicOrdering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::object::Object;

    fn kv(key: &str, create: i64, rev: i64, version: i64, value: &str) -> (Arc<[u8]>, Kv) {
        let mut o = Object::new(key, rev, value.as_bytes().to_vec());
        o.create_revision = create;
        o.version = version;
        (key.as_bytes().into(), Arc::new(o))
    }

    fn keys(kvs: &Found) -> Vec<&str> {
        kvs.iter()
            .map(|(k, _)| std::str::from_utf8(k).unwrap())
            .collect()
    }

    #[test]
    fn filters_sort_and_limit_as_etcd() {
        let found = vec![
            kv("/a", 2, 5, 2, "z"),
            kv("/b", 3, 3, 1, "y"),
            kv("/c", 4, 6, 3, "x"),
        ];
        let mut r = PbRangeRequest {
            limit: 2,
            ..Default::default()
        };
        let (kvs, more, count) = answer(&r, found.clone());
        assert_eq!((keys(&kvs), more, count), (vec!["/a", "/b"], true, 3));
        r.sort_target = TARGET_VALUE;
        let (kvs, _, _) = answer(&r, found.clone());
        assert_eq!(keys(&kvs), vec!["/c", "/b"]);
        // With no order asked, etcd sorts only the keys its limit read: "/d" is not among them.
        let mut four = found.clone();
        four.push(kv("/d", 5, 7, 1, "w"));
        let (kvs, more, count) = answer(&r, four.clone());
        assert_eq!((keys(&kvs), more, count), (vec!["/c", "/b"], true, 4));
        r.sort_order = SORT_ASCEND;
        let (kvs, _, _) = answer(&r, four);
        assert_eq!(keys(&kvs), vec!["/d", "/c"]);
        r.sort_order = SORT_NONE;
        r.sort_order = SORT_DESCEND;
        r.sort_target = TARGET_MOD;
        r.limit = 0;
        let (kvs, more, _) = answer(&r, found.clone());
        assert_eq!((keys(&kvs), more), (vec!["/c", "/a", "/b"], false));
        let r = PbRangeRequest {
            min_mod_revision: 4,
            limit: 1,
            ..Default::default()
        };
        let (kvs, more, count) = answer(&r, found.clone());
        assert_eq!((keys(&kvs), more, count), (vec!["/a"], true, 3));
        let r = PbRangeRequest {
            count_only: true,
            limit: 1,
            ..Default::default()
        };
        let (kvs, more, count) = answer(&r, found);
        assert_eq!((kvs.len(), more, count), (0, false, 3));
    }

    #[test]
    fn a_write_touches_the_prefixes_its_range_overlaps() {
        let (p, end) = (b"/p/".as_slice(), b"/p0".as_slice());
        assert!(overlaps(b"/p/a", b"", p, end));
        assert!(!overlaps(b"/q", b"", p, end) && !overlaps(b"/o", b"", p, end));
        assert!(overlaps(b"/a", b"\0", p, end) && overlaps(b"/a", b"/p/b", p, end));
        assert!(!overlaps(b"/a", b"/p/", p, end) && !overlaps(b"/p0", b"/q", p, end));
        assert!(overlaps(b"/p/z", b"/q", p, end));
    }
}
