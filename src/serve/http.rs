//! etcd's HTTP endpoints on its client port (`/metrics`, `/health`, `/version`...), answered as
//! etcd's gRPC proxy answers `/metrics`: by the upstream. Clients and tools read them where
//! they reach etcd (etcd-client's own tests count `Authenticate` calls in `/metrics`), and the
//! requests that change what they report (writes, leases, authentication) are etcd's own.
//!
//! A `GET` of one of them ([`FORWARDED`]) is asked of the upstream over plain HTTP/1.0, one
//! connection per request, its answer read whole up to [`MAX_ANSWER`] (these endpoints are
//! scraped, not streamed); over TLS to the upstream it answers 502, saying so. Nothing else
//! is forwarded (a v2 key read or a profile of an etcd that enables them would give a client
//! that reaches only the server what only etcd's own network should reach): not found.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::Request;
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::report::Readiness;

/// etcd's read-only HTTP endpoints: metrics, health and readiness, version.
const FORWARDED: [&str; 5] = ["/metrics", "/health", "/readyz", "/livez", "/version"];

/// The server's own health on the clients' port, where etcd's gRPC proxy answers its own:
/// the paths above are etcd's.
const OWN_HEALTH: &str = "/proxy/health";

/// The largest answer read from the upstream: etcd's `/metrics` is some hundreds of KiB.
const MAX_ANSWER: u64 = 16 << 20;

/// How long one upstream may take to answer.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(5);

/// Answers a request no gRPC service took: a gRPC call is Unimplemented (as etcd answers an
/// unknown method), a `GET` of one of etcd's read-only endpoints is etcd's answer; anything
/// else is not found.
pub(crate) async fn answer(
    endpoints: Arc<[String]>,
    readiness: Readiness,
    request: Request,
) -> Response {
    let grpc = request
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|t| t.as_bytes().starts_with(b"application/grpc"));
    if grpc {
        return tonic::Status::unimplemented("").into_http();
    }
    if request.method() == Method::GET && request.uri().path() == OWN_HEALTH {
        return health(&readiness);
    }
    if request.method() != Method::GET || !FORWARDED.contains(&request.uri().path()) {
        // Go's answer for a path nothing serves, as etcd gives it.
        return (StatusCode::NOT_FOUND, "404 page not found\n").into_response();
    }
    let path = request.uri().path_and_query().map_or("/", |p| p.as_str());
    forward(&endpoints, path).await
}

/// The server's own health, as etcd answers its `/health` (see [`Readiness::etcd_health`]).
fn health(readiness: &Readiness) -> Response {
    let (status, body) = readiness.etcd_health();
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    let mut response = (status, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// Asks the upstream endpoints in turn for `path_and_query` and answers with the first answer,
/// status, content type and body; 502 naming each endpoint's failure if none answers.
async fn forward(endpoints: &[String], path_and_query: &str) -> Response {
    let mut failures = Vec::new();
    for endpoint in endpoints {
        match get(endpoint, path_and_query).await {
            Ok(answer) => return answer,
            Err(e) => failures.push(format!("{endpoint}: {e}")),
        }
    }
    let body = format!(
        "etcd-informer cache server: no upstream answered {path_and_query} ({})\n",
        failures.join("; ")
    );
    (StatusCode::BAD_GATEWAY, body).into_response()
}

async fn get(endpoint: &str, path_and_query: &str) -> Result<Response, String> {
    let address = match endpoint.split_once("://") {
        Some(("http", rest)) => rest,
        Some((scheme, _)) => {
            return Err(format!(
                "{scheme} upstreams are not asked (plain HTTP only)"
            ))
        }
        None => endpoint,
    };
    let address = address.trim_end_matches('/');
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(address)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let request = format!("GET {path_and_query} HTTP/1.0\r\nHost: {address}\r\n\r\n");
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| format!("send: {e}"))?;
        let mut answer = Vec::new();
        (&mut stream)
            .take(MAX_ANSWER + 1)
            .read_to_end(&mut answer)
            .await
            .map_err(|e| format!("read: {e}"))?;
        if answer.len() as u64 > MAX_ANSWER {
            return Err(format!("answer larger than {MAX_ANSWER} bytes"));
        }
        Ok(answer)
    };
    let answer = tokio::time::timeout(UPSTREAM_TIMEOUT, exchange)
        .await
        .map_err(|_| format!("no answer within {UPSTREAM_TIMEOUT:?}"))??;
    parse(&answer)
}

/// An HTTP/1.x answer read whole: its status, content type and body.
fn parse(answer: &[u8]) -> Result<Response, String> {
    let split = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("an answer without the end of its headers")?;
    let head = std::str::from_utf8(&answer[..split]).map_err(|_| "headers not UTF-8")?;
    let body = answer[split + 4..].to_vec();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|line| line.split(' ').nth(1))
        .and_then(|code| code.parse::<u16>().ok())
        .and_then(|code| StatusCode::from_u16(code).ok())
        .ok_or("an answer without a status")?;
    let content_type = lines.find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.eq_ignore_ascii_case("content-type")
            .then(|| HeaderValue::from_str(value.trim()).ok())
            .flatten()
    });
    let mut response = (status, body).into_response();
    if let Some(content_type) = content_type {
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, content_type);
    }
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_keeps_its_status_content_type_and_body() {
        let answer = b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; version=0.0.4\r\nDate: x\r\n\r\nline 1\r\nline 2\n";
        let response = parse(answer).unwrap();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "text/plain; version=0.0.4"
        );
        assert!(parse(b"HTTP/1.0 200 OK\r\n").is_err());
        assert!(parse(b"garbage\r\n\r\n").is_err());
    }
}
