//! gRPC's standard health service (`grpc.health.v1.Health/Check`), which Kubernetes' gRPC
//! probes and `grpc_health_probe` ask: SERVING while the server [is
//! ready](super::RunningServer::is_ready) (the cache listed, its watch connected and proven
//! fresh within the source's liveness bound, the upstream's identity known), NOT_SERVING
//! otherwise. `Watch` is not offered (Unimplemented).

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use tonic::body::Body;
use tonic::codegen::{http, BoxFuture, Service};
use tonic::server::{NamedService, UnaryService};
use tonic::{Request, Response, Status};

use super::served::Served;

/// `grpc.health.v1.HealthCheckResponse.ServingStatus`.
const SERVING: u8 = 1;
const NOT_SERVING: u8 = 2;

/// The health service.
#[derive(Clone)]
pub(crate) struct Health {
    pub(crate) served: Arc<Served>,
}

impl NamedService for Health {
    const NAME: &'static str = "grpc.health.v1.Health";
}

/// One Check call; the request (which names a service) is not decoded: the answer is the
/// server's.
struct Check(Health);

impl UnaryService<Bytes> for Check {
    type Response = Bytes;
    type Future = BoxFuture<Response<Bytes>, Status>;

    fn call(&mut self, _request: Request<Bytes>) -> Self::Future {
        let status = if self.0.served.ready() {
            SERVING
        } else {
            NOT_SERVING
        };
        // HealthCheckResponse { ServingStatus status = 1; }
        Box::pin(async move { Ok(Response::new(Bytes::from(vec![0x08, status]))) })
    }
}

impl Service<http::Request<Body>> for Health {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let health = self.clone();
        Box::pin(async move {
            if request.uri().path() != "/grpc.health.v1.Health/Check" {
                return Ok(Status::unimplemented("only Check is offered").into_http());
            }
            let mut grpc = tonic::server::Grpc::new(super::forward::RawCodec);
            Ok(grpc.unary(Check(health), request).await)
        })
    }
}
