//! The operator's port (`--metrics-addr`): the server's own Prometheus metrics and health, apart
//! from the clients' port, whose `/metrics` and `/health` are etcd's.

use std::net::SocketAddr;

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use etcd_informer::serve::Readiness;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Installs the Prometheus recorder the library's metrics (`etcd_informer_*`) go to.
pub fn install_recorder() -> Result<PrometheusHandle, String> {
    PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))
}

/// The running admin server.
pub struct Admin {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Admin {
    pub fn stop(self) {
        self.task.abort();
    }
}

/// Serves `/metrics`, `/health`, `/readyz` and `/livez` on `addr`.
pub async fn serve(
    addr: SocketAddr,
    metrics: PrometheusHandle,
    readiness: Readiness,
) -> Result<Admin, String> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("--metrics-addr {addr}: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let ready = readiness.clone();
    let live = readiness;
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                async move {
                    let mut text = metrics.render();
                    text.push_str(&process_metrics());
                    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
                }
            }),
        )
        .route(
            "/health",
            get({
                let readiness = ready.clone();
                move || async move { health(&readiness) }
            }),
        )
        .route("/readyz", get(move || async move { health(&ready) }))
        // Alive while it runs and does not drain: a server waiting for etcd is not helped by
        // a restart, so liveness does not follow readiness.
        .route(
            "/livez",
            get(move || async move {
                if live.is_draining() {
                    (StatusCode::SERVICE_UNAVAILABLE, "draining\n")
                } else {
                    (StatusCode::OK, "ok\n")
                }
            }),
        );
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "the metrics server failed");
        }
    });
    Ok(Admin { addr, task })
}

fn health(readiness: &Readiness) -> Response {
    let (status, body) = readiness.etcd_health();
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// The process's resident memory and CPU time, as Prometheus' process collector names them
/// (Linux; nothing elsewhere).
fn process_metrics() -> String {
    let mut out = String::new();
    let page = 4096.0;
    if let Ok(statm) = std::fs::read_to_string("/proc/self/statm") {
        if let Some(resident) = statm
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse::<f64>().ok())
        {
            out.push_str("# TYPE process_resident_memory_bytes gauge\n");
            out.push_str(&format!(
                "process_resident_memory_bytes {}\n",
                resident * page
            ));
        }
    }
    if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
        // Fields after the command's closing parenthesis: utime and stime are the 12th and
        // 13th, in clock ticks (100 a second on Linux).
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map_or(Vec::new(), |(_, rest)| rest.split_whitespace().collect());
        let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok());
        if let (Some(user), Some(system)) = (ticks(11), ticks(12)) {
            out.push_str("# TYPE process_cpu_seconds_total counter\n");
            out.push_str(&format!(
                "process_cpu_seconds_total {}\n",
                (user + system) / 100.0
            ));
        }
    }
    out
}
