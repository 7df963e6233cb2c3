//! Everything the server does not answer itself goes to the upstream etcd: typed calls
//! ([`Upstream::unary`]) for the KV and Cluster methods, and whole services passed through as
//! bytes ([`Passthrough`]: Lease, Maintenance, Auth, Lock, Election), with the client's
//! credentials.
//!
//! etcd takes a request without an auth token as coming from the common name of the
//! connection's client certificate (with `--client-cert-auth`), and the connection it sees is
//! the server's. So when that connection carries a certificate of its own, a token-less
//! request is refused here ([`Tokenless::Refuse`]) rather than run with the server's identity:
//! every forwarded call and every access check passes through [`Upstream`], which checks it.
//!
//! A client's forwarded streams (watches, keep-alives, snapshots, observers) ride an upstream
//! channel of that client connection's own ([`ClientIo`]). HTTP/2 has a window per stream and
//! one per connection: a client that stops reading its streams fills its own connection's
//! window, as it would fill only its own connection to etcd. On one shared connection, a few
//! megabytes left unread by one client stalled every forwarded call of every client. Unary
//! answers are read whole from the shared connection before they are relayed, so no client
//! holds its window.

use std::convert::Infallible;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes};
use etcd_client::proto::{
    PbClusterService, PbMember, PbMemberAddRequest, PbMemberAddResponse, PbMemberListRequest,
    PbMemberListResponse, PbMemberPromoteRequest, PbMemberPromoteResponse, PbMemberRemoveRequest,
    PbMemberRemoveResponse, PbMemberUpdateRequest, PbMemberUpdateResponse,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio_stream::{Stream, StreamExt};
use tonic::body::Body;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder, Streaming};
use tonic::codegen::http;
use tonic::server::NamedService;
use tonic::transport::server::Connected;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};
use tonic_prost::prost::Message;

use crate::sync::lock;
use tonic_prost::ProstCodec;

use super::header::Headers;
use super::stats::ServerMetrics;

/// The metadata a forwarded request carries over: etcd's auth token, and whether the client
/// requires a leader.
const FORWARDED_METADATA: [&str; 3] = ["token", "authorization", "hasleader"];

/// Calls whose answer etcd gives without looking at who asks: a token-less client gets them
/// even from a server that refuses token-less requests. Authenticate is how a client gets its
/// token (its password is in the request); Status is answered to anyone who can connect.
const ANSWERED_TO_ANYONE: [&str; 2] = [
    "/etcdserverpb.Auth/Authenticate",
    "/etcdserverpb.Maintenance/Status",
];

/// What becomes of a client's request that carries no auth token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tokenless {
    /// Forwarded as it is: the upstream connection has no identity of its own, so etcd answers
    /// it as it answers a client without credentials (or the operator trusts every client
    /// with the server's identity: `trust_clients_as_server`).
    Forward,
    /// Refused with PermissionDenied: etcd would take the server's certificate as the
    /// client's identity.
    Refuse,
}

/// The upstream etcd, as a gRPC channel the server forwards requests on.
#[derive(Clone)]
pub(crate) struct Upstream {
    channel: Channel,
    /// Where a client connection's own upstream connection goes.
    endpoints: Arc<[Endpoint]>,
    tokenless: Tokenless,
    metrics: ServerMetrics,
}

impl Upstream {
    pub(crate) fn new(
        endpoints: Vec<Endpoint>,
        tokenless: Tokenless,
        metrics: ServerMetrics,
    ) -> Self {
        Upstream {
            channel: Channel::balance_list(endpoints.iter().cloned()),
            endpoints: endpoints.into(),
            tokenless,
            metrics,
        }
    }

    /// The upstream for the forwarded streams of the client connection `own` stands for: its
    /// own channel, opened now if this is the first ([`ClientIo`]); the shared one for a
    /// request that came on no accepted connection.
    pub(crate) fn for_streams(&self, own: Option<&Connection>) -> Upstream {
        let Some(own) = own else {
            return self.clone();
        };
        let channel = own
            .channel
            .get_or_init(|| OwnChannel::open(&self.endpoints, self.metrics.clone()))
            .channel
            .clone();
        Upstream {
            channel,
            ..self.clone()
        }
    }

    /// Whether a client with `from`'s metadata may have `path` forwarded: with a token (etcd
    /// then judges the token, never the connection), or where token-less requests are
    /// forwarded, or for a call etcd answers to anyone.
    pub(crate) fn admit(
        &self,
        from: &tonic::metadata::MetadataMap,
        path: &str,
    ) -> Result<(), Status> {
        if self.tokenless == Tokenless::Forward
            || has_token(from)
            || ANSWERED_TO_ANYONE.contains(&path)
        {
            return Ok(());
        }
        tracing::debug!(path, "refused a request without an auth token");
        Err(Status::permission_denied(TOKENLESS_REFUSED))
    }

    /// A request to the upstream with `message` and the credentials in `from`, if
    /// [admitted](Self::admit) (always, when it runs as the server).
    fn request<M>(
        &self,
        from: &tonic::metadata::MetadataMap,
        message: M,
        path: &str,
        runs_as: RunsAs,
    ) -> Result<Request<M>, Status> {
        if runs_as == RunsAs::Client {
            self.admit(from, path)?;
        }
        let mut request = Request::new(message);
        for name in FORWARDED_METADATA {
            if let Some(value) = from.get(name) {
                request.metadata_mut().insert(name, value.clone());
            }
        }
        Ok(request)
    }

    /// Sends a unary call to `path` (`/etcdserverpb.KV/Put`...) with the client's credentials.
    pub(crate) async fn unary<Q, A>(
        &self,
        request: Request<Q>,
        path: &'static str,
    ) -> Result<Response<A>, Status>
    where
        Q: Message + Send + Sync + 'static,
        A: Message + Default + Send + Sync + 'static,
    {
        let (metadata, _, message) = request.into_parts();
        let request = self.request(&metadata, message, path, RunsAs::Client)?;
        let mut grpc =
            tonic::client::Grpc::new(self.channel.clone()).max_decoding_message_size(usize::MAX);
        grpc.ready()
            .await
            .map_err(|e| Status::unavailable(format!("upstream etcd unreachable: {e}")))?;
        let answer = grpc
            .unary(
                request,
                http::uri::PathAndQuery::from_static(path),
                ProstCodec::default(),
            )
            .await;
        if let Err(status) = &answer {
            tracing::debug!(path, code = ?status.code(), message = status.message(), "forwarded call failed");
        }
        answer
    }

    /// Opens a bidirectional stream to `path` with the credentials in `metadata`.
    pub(crate) async fn streaming<S, Q, A>(
        &self,
        metadata: &tonic::metadata::MetadataMap,
        runs_as: RunsAs,
        requests: S,
        path: http::uri::PathAndQuery,
    ) -> Result<Response<Streaming<A>>, Status>
    where
        S: Stream<Item = Q> + Send + 'static,
        Q: Message + Send + Sync + 'static,
        A: Message + Default + Send + Sync + 'static,
    {
        let request = self.request(metadata, requests, path.path(), runs_as)?;
        let mut grpc =
            tonic::client::Grpc::new(self.channel.clone()).max_decoding_message_size(usize::MAX);
        grpc.ready()
            .await
            .map_err(|e| Status::unavailable(format!("upstream etcd unreachable: {e}")))?;
        grpc.streaming(request, path, ProstCodec::<Q, A>::default())
            .await
    }

    async fn raw(
        &self,
        request: Request<Streaming<Bytes>>,
        path: http::uri::PathAndQuery,
    ) -> Result<Response<Streaming<Bytes>>, Status> {
        let (metadata, _, messages) = request.into_parts();
        // A client's error mid-stream ends what is forwarded; the upstream sees the end.
        let messages = messages.map_while(Result::ok);
        let request = self.request(&metadata, messages, path.path(), RunsAs::Client)?;
        let mut grpc =
            tonic::client::Grpc::new(self.channel.clone()).max_decoding_message_size(usize::MAX);
        grpc.ready()
            .await
            .map_err(|e| Status::unavailable(format!("upstream etcd unreachable: {e}")))?;
        grpc.streaming(request, path, RawCodec).await
    }
}

/// What the server keeps per client connection; every request on the connection carries it
/// in its extensions.
#[derive(Clone, Default)]
pub(crate) struct Connection {
    /// The connection's own upstream channel, opened with its first forwarded stream and
    /// closed once the client connection and its forwarded streams are gone.
    channel: Arc<OnceLock<OwnChannel>>,
    /// The highest revision a KV answer on the connection named, with the generation of the
    /// caches' content it was answered in ([`Headers::generation`](super::header::Headers::generation)):
    /// a serializable read on it answers at this revision or later, as etcd's member would
    /// after answering it, unless a cache replaced its content since (a wiped store's
    /// revisions say nothing of its successor's).
    seen: Arc<Mutex<(u64, i64)>>,
    /// The connection's watches forwarded to etcd, open now.
    forwarded_watches: Arc<AtomicUsize>,
}

impl Connection {
    /// A KV answer on the connection named `revision`, in the caches' `generation`.
    pub(crate) fn saw(&self, generation: u64, revision: i64) {
        let mut seen = lock(&self.seen);
        if generation > seen.0 {
            *seen = (generation, revision);
        } else if generation == seen.0 {
            seen.1 = seen.1.max(revision);
        }
    }

    /// The highest revision answered on the connection in the caches' `generation`; 0 if none
    /// was (see [`Connection::saw`]).
    pub(crate) fn seen(&self, generation: u64) -> i64 {
        match *lock(&self.seen) {
            (g, revision) if g == generation => revision,
            _ => 0,
        }
    }

    /// Takes a place for a forwarded watch if fewer than `at_most` of the connection's are open.
    pub(crate) fn forwarded_watch(&self, at_most: usize) -> bool {
        let taken = self.forwarded_watches.fetch_add(1, Ordering::Relaxed);
        if taken >= at_most {
            self.forwarded_watch_ended();
            return false;
        }
        true
    }

    /// Gives back a place [`forwarded_watch`](Self::forwarded_watch) took.
    pub(crate) fn forwarded_watch_ended(&self) {
        self.forwarded_watches.fetch_sub(1, Ordering::Relaxed);
    }

    /// The one the request with `extensions` came with (over TLS too: tonic adds the inner
    /// connection's info beside its `TlsConnectInfo`).
    pub(crate) fn of(extensions: &http::Extensions) -> Option<Connection> {
        extensions.get::<Connection>().cloned()
    }
}

/// A channel balanced over the upstream's endpoints, as the shared one is (so it connects
/// to each of them, as a client of etcd balancing over them would), counted in
/// [`ServerStats::client_upstreams`](super::ServerStats::client_upstreams) while it is open.
pub(crate) struct OwnChannel {
    channel: Channel,
    metrics: ServerMetrics,
}

impl OwnChannel {
    fn open(endpoints: &[Endpoint], metrics: ServerMetrics) -> Self {
        metrics.client_upstreams(1);
        OwnChannel {
            channel: Channel::balance_list(endpoints.iter().cloned()),
            metrics,
        }
    }
}

impl Drop for OwnChannel {
    fn drop(&mut self) {
        self.metrics.client_upstreams(-1);
    }
}

/// An accepted client connection, giving its requests its [`Connection`]. That is the only
/// connection info its requests carry: tonic's `Request::remote_addr` and `peer_certs` are
/// `None` on them (nothing here reads them).
pub(crate) struct ClientIo {
    io: TcpStream,
    own: Connection,
}

impl From<TcpStream> for ClientIo {
    fn from(io: TcpStream) -> Self {
        ClientIo {
            io,
            own: Connection::default(),
        }
    }
}

impl Connected for ClientIo {
    type ConnectInfo = Connection;

    fn connect_info(&self) -> Connection {
        self.own.clone()
    }
}

impl AsyncRead for ClientIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for ClientIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Whether the client sent an auth token, as etcd looks for one: `token`, else
/// `authorization` (etcd 3.4 and 3.5 both read either).
pub(crate) fn has_token(metadata: &tonic::metadata::MetadataMap) -> bool {
    metadata.contains_key("token") || metadata.contains_key("authorization")
}

/// What a token-less client is told by a server whose upstream connection has an identity.
pub(crate) const TOKENLESS_REFUSED: &str = "etcdserver: permission denied: this etcd-informer \
cache server refuses requests without an auth token, because etcd would run them as the \
server's own client certificate; authenticate as an etcd user (etcdctl --user), or start the \
server with --trust-clients-as-server if every client that can reach it may act as the server";

/// Whether TLS options carry a client certificate. tonic's `ClientTlsConfig` does not expose
/// it but prints it; anything but a printed `identity: None` counts as a certificate, so that
/// a change in that printing refuses more, never less (a unit test pins the printing).
#[cfg(feature = "tls")]
pub(crate) fn carries_identity(tls: &etcd_client::TlsOptions) -> bool {
    !format!("{tls:?}").contains("identity: None")
}

/// Whose credentials a forwarded request carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RunsAs {
    /// The client's: one without a token is admitted only where token-less requests are
    /// forwarded ([`Tokenless`]).
    Client,
    /// The server's own identity (a watch moved out of the history, see
    /// [`OwnIdentity`](super::served::OwnIdentity)): admitted as it is.
    Server,
}

/// Messages as bytes, neither decoded nor encoded: what a pass-through needs.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RawCodec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }

    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

/// The name of a service passed through whole.
pub(crate) trait ServiceName: Send + Sync + 'static {
    /// The gRPC service name, `etcdserverpb.Lease`...
    const NAME: &'static str;
}

macro_rules! service_name {
    ($name:ident, $text:literal) => {
        /// The upstream's `
        #[doc = $text]
        /// ` service.
        pub(crate) struct $name;
        impl ServiceName for $name {
            const NAME: &'static str = $text;
        }
    };
}

service_name!(LeaseService, "etcdserverpb.Lease");
service_name!(MaintenanceService, "etcdserverpb.Maintenance");
service_name!(AuthService, "etcdserverpb.Auth");
service_name!(LockService, "v3lockpb.Lock");
service_name!(ElectionService, "v3electionpb.Election");

/// Every method of the service `N` forwarded to the upstream as bytes, streams included
/// (lease keep-alives, snapshots), with the client's credentials.
pub(crate) struct Passthrough<N> {
    upstream: Upstream,
    /// The largest request a client may send.
    max_request: usize,
    /// Turns true when the server drains: the calls that stay open end then.
    draining: watch::Receiver<bool>,
    name: PhantomData<fn() -> N>,
}

impl<N> Clone for Passthrough<N> {
    fn clone(&self) -> Self {
        Passthrough {
            upstream: self.upstream.clone(),
            max_request: self.max_request,
            draining: self.draining.clone(),
            name: PhantomData,
        }
    }
}

impl<N: ServiceName> Passthrough<N> {
    pub(crate) fn new(
        upstream: Upstream,
        max_request: usize,
        draining: watch::Receiver<bool>,
    ) -> Self {
        Passthrough {
            upstream,
            max_request,
            draining,
            name: PhantomData,
        }
    }
}

/// The forwarded methods whose calls can stay open indefinitely: a lease's keep-alives, a
/// snapshot, an election's observer, and a lock or a campaign waiting for its turn. A drain
/// ends them as a stopping etcd does, with `etcdserver: server stopped`, so that their clients
/// go to another endpoint and let the connection close within the drain timeout; any other call
/// under way finishes.
const ENDED_BY_A_DRAIN: [&str; 5] = [
    "/etcdserverpb.Lease/LeaseKeepAlive",
    "/etcdserverpb.Maintenance/Snapshot",
    "/v3electionpb.Election/Observe",
    "/v3electionpb.Election/Campaign",
    "/v3lockpb.Lock/Lock",
];

/// The forwarded methods that answer with a stream: they ride the client connection's own
/// upstream connection ([`ClientIo`]).
const STREAMED: [&str; 3] = [
    "/etcdserverpb.Lease/LeaseKeepAlive",
    "/etcdserverpb.Maintenance/Snapshot",
    "/v3electionpb.Election/Observe",
];

/// Resolves once the server drains (or is gone).
async fn drained(mut draining: watch::Receiver<bool>) {
    let _ = draining.wait_for(|draining| *draining).await;
}

/// A forwarded answer stream that ends with etcd's "server stopped" once the server drains.
struct UntilDrained<S: Stream> {
    inner: S,
    drained: Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
    last: Option<S::Item>,
    ended: bool,
}

impl<S: Stream> UntilDrained<S> {
    fn new(inner: S, draining: watch::Receiver<bool>, last: S::Item) -> Self {
        UntilDrained {
            inner,
            drained: Box::pin(drained(draining)),
            last: Some(last),
            ended: false,
        }
    }
}

impl<S: Stream + Unpin> Stream for UntilDrained<S>
where
    S::Item: Unpin,
{
    type Item = S::Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.ended {
            return Poll::Ready(None);
        }
        if self.drained.as_mut().poll(cx).is_ready() {
            self.ended = true;
            return Poll::Ready(self.last.take());
        }
        let next = Pin::new(&mut self.inner).poll_next(cx);
        if let Poll::Ready(None) = next {
            self.ended = true;
        }
        next
    }
}

impl<N: ServiceName> NamedService for Passthrough<N> {
    const NAME: &'static str = N::NAME;
}

/// One forwarded call: the method's path.
struct Call {
    upstream: Upstream,
    path: http::uri::PathAndQuery,
    draining: watch::Receiver<bool>,
}

type ForwardedStream = Pin<Box<dyn Stream<Item = Result<Bytes, Status>> + Send>>;

impl tonic::codegen::Service<Request<Streaming<Bytes>>> for Call {
    type Response = Response<ForwardedStream>;
    type Error = Status;
    type Future = tonic::codegen::BoxFuture<Self::Response, Status>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Streaming<Bytes>>) -> Self::Future {
        let (upstream, path) = (self.upstream.clone(), self.path.clone());
        let draining = self.draining.clone();
        Box::pin(async move {
            tracing::debug!(path = %path, "passing a call through");
            let streamed = STREAMED.contains(&path.path());
            let upstream = if streamed {
                upstream.for_streams(Connection::of(request.extensions()).as_ref())
            } else {
                upstream
            };
            if !ENDED_BY_A_DRAIN.contains(&path.path()) {
                let answer = upstream.raw(request, path).await?;
                let (metadata, mut stream, extensions) = answer.into_parts();
                if streamed {
                    return Ok(Response::from_parts(
                        metadata,
                        Box::pin(stream) as ForwardedStream,
                        extensions,
                    ));
                }
                // A unary answer is read whole from the shared connection, whose window
                // must not wait on a client that does not read.
                let mut messages = Vec::new();
                while let Some(message) = stream.message().await? {
                    messages.push(Ok(message));
                }
                return Ok(Response::from_parts(
                    metadata,
                    Box::pin(tokio_stream::iter(messages)) as ForwardedStream,
                    extensions,
                ));
            }
            // etcd sends a stream's headers with its first answer (an observer of an election
            // with no leader yet, a lock still held by another, have none): the drain may
            // come first.
            let answer = tokio::select! {
                answer = upstream.raw(request, path) => answer?,
                _ = drained(draining.clone()) => return Err(super::status::stopped()),
            };
            let (metadata, stream, extensions) = answer.into_parts();
            let stopped = Err(super::status::stopped());
            let stream = Box::pin(UntilDrained::new(stream, draining, stopped));
            Ok(Response::from_parts(
                metadata,
                stream as ForwardedStream,
                extensions,
            ))
        })
    }
}

impl<N: ServiceName> tonic::codegen::Service<http::Request<Body>> for Passthrough<N> {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = tonic::codegen::BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let (upstream, max_request) = (self.upstream.clone(), self.max_request);
        let draining = self.draining.clone();
        Box::pin(async move {
            let path = request
                .uri()
                .path_and_query()
                .cloned()
                .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
            let mut grpc = tonic::server::Grpc::new(RawCodec)
                .apply_max_message_size_config(Some(max_request), Some(usize::MAX));
            let call = Call {
                upstream,
                path,
                draining,
            };
            Ok(grpc.streaming(call, request).await)
        })
    }
}

/// The Cluster service: the member list names this server alone (as etcd's gRPC proxy does),
/// so that a client that syncs its endpoints keeps talking to it; the rest is forwarded.
pub(crate) struct Cluster {
    pub(crate) upstream: Upstream,
    pub(crate) headers: Headers,
    /// This server's client URL, `http://127.0.0.1:23790`.
    pub(crate) client_url: String,
}

#[tonic::async_trait]
impl PbClusterService for Cluster {
    async fn member_add(
        &self,
        request: Request<PbMemberAddRequest>,
    ) -> Result<Response<PbMemberAddResponse>, Status> {
        self.upstream
            .unary(request, "/etcdserverpb.Cluster/MemberAdd")
            .await
    }

    async fn member_remove(
        &self,
        request: Request<PbMemberRemoveRequest>,
    ) -> Result<Response<PbMemberRemoveResponse>, Status> {
        self.upstream
            .unary(request, "/etcdserverpb.Cluster/MemberRemove")
            .await
    }

    async fn member_update(
        &self,
        request: Request<PbMemberUpdateRequest>,
    ) -> Result<Response<PbMemberUpdateResponse>, Status> {
        self.upstream
            .unary(request, "/etcdserverpb.Cluster/MemberUpdate")
            .await
    }

    async fn member_list(
        &self,
        _request: Request<PbMemberListRequest>,
    ) -> Result<Response<PbMemberListResponse>, Status> {
        let header = self.headers.header(0);
        let member = PbMember {
            id: header.member_id,
            name: "etcd-informer-cache".into(),
            peer_ur_ls: Vec::new(),
            client_ur_ls: vec![self.client_url.clone()],
            is_learner: false,
        };
        Ok(Response::new(PbMemberListResponse {
            header: Some(header),
            members: vec![member],
        }))
    }

    async fn member_promote(
        &self,
        request: Request<PbMemberPromoteRequest>,
    ) -> Result<Response<PbMemberPromoteResponse>, Status> {
        self.upstream
            .unary(request, "/etcdserverpb.Cluster/MemberPromote")
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "tls")]
    #[test]
    fn a_client_certificate_is_seen_in_tls_options() {
        use etcd_client::{Certificate, Identity, TlsOptions};
        let ca = TlsOptions::new().ca_certificate(Certificate::from_pem("ca"));
        assert!(!carries_identity(&ca));
        assert!(!carries_identity(&TlsOptions::new()));
        assert!(carries_identity(
            &ca.identity(Identity::from_pem("cert", "key"))
        ));
    }

    #[tokio::test]
    async fn token_less_requests_are_refused_only_where_the_connection_has_an_identity() {
        let endpoint = || vec![Endpoint::from_static("http://127.0.0.1:1")];
        let metrics = || ServerMetrics::new("/");
        let refuse = Upstream::new(endpoint(), Tokenless::Refuse, metrics());
        let forward = Upstream::new(endpoint(), Tokenless::Forward, metrics());
        let none = tonic::metadata::MetadataMap::new();
        let mut token = tonic::metadata::MetadataMap::new();
        token.insert("token", "t.1".parse().unwrap());
        let mut authorization = tonic::metadata::MetadataMap::new();
        authorization.insert("authorization", "t.1".parse().unwrap());
        let put = "/etcdserverpb.KV/Put";
        let refused = refuse.admit(&none, put).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        assert!(refused.message().contains("--trust-clients-as-server"));
        assert!(refuse.admit(&token, put).is_ok());
        assert!(refuse.admit(&authorization, put).is_ok());
        assert!(forward.admit(&none, put).is_ok());
        // Locks and elections write keys as the caller: the same rule.
        assert!(refuse.admit(&none, "/v3lockpb.Lock/Lock").is_err());
        assert!(refuse
            .admit(&none, "/v3electionpb.Election/Campaign")
            .is_err());
        for path in ANSWERED_TO_ANYONE {
            assert!(refuse.admit(&none, path).is_ok(), "{path}");
        }
    }
}
