//! `etcd-cache-server`: the cache server as an operator deploys it. See `--help`, and the
//! operator's guide (docs/operator.md).

mod admin;
mod config;

use std::process::ExitCode;
use std::time::Duration;

use etcd_informer::serve::{CacheServer, CacheServerOptions, Readiness, ServerTls};
use etcd_informer::ConnectConfig;

use config::{Refused, Settings};

/// The crate's version and the git commit it was built from.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("ETCD_INFORMER_COMMIT"),
    ")"
);

/// How often a server that is not ready says what it waits for.
const NOT_READY_LOG_PERIOD: Duration = Duration::from_secs(5);

fn main() -> ExitCode {
    let settings = match config::settings(std::env::args_os().collect()) {
        Ok(settings) => settings,
        // --help and --version print and exit 0; a bad flag or value exits 2.
        Err(Refused::Clap(e)) => {
            let _ = e.print();
            return ExitCode::from(e.exit_code().clamp(0, 255) as u8);
        }
        Err(Refused::File(why)) => {
            eprintln!("error: {why}");
            return ExitCode::from(2);
        }
    };
    if settings.print_config {
        return match serde_yaml::to_string(&settings) {
            Ok(yaml) => {
                println!("{}", yaml.trim_end());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        };
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    // Files named by flags are read before anything starts: a missing one is a usage error.
    let files = match Files::read(&settings) {
        Ok(files) => files,
        Err(why) => {
            eprintln!("error: {why}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(settings, files)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(why) => {
            tracing::error!("{why}");
            eprintln!("error: {why}");
            ExitCode::FAILURE
        }
    }
}

/// The PEM files the flags name, read.
struct Files {
    serve_tls: Option<ServerTls>,
    upstream: ConnectConfig,
}

impl Files {
    fn read(s: &Settings) -> Result<Files, String> {
        let read = |flag: &str, path: &std::path::Path| {
            std::fs::read(path).map_err(|e| format!("--{flag} {}: {e}", path.display()))
        };
        let serve_tls = match (&s.cert_file, &s.key_file) {
            (Some(cert), Some(key)) => Some(ServerTls {
                cert_pem: read("cert-file", cert)?,
                key_pem: read("key-file", key)?,
                client_ca_pem: match &s.trusted_ca_file {
                    Some(ca) => Some(read("trusted-ca-file", ca)?),
                    None => None,
                },
            }),
            _ => None,
        };
        // etcdctl's variables fill in what the flags leave unset.
        let env = ConnectConfig::from_env().map_err(|e| e.to_string())?;
        let mut upstream = ConnectConfig::new(s.endpoints.clone());
        match &s.user {
            Some(user) => upstream = upstream.user(&user.name, &user.password),
            None => {
                if let Some((name, password)) = env.credentials() {
                    upstream = upstream.user(name, password);
                }
            }
        }
        let var = |name: &str| std::env::var_os(name).map(std::path::PathBuf::from);
        if let Some(ca) = s.cacert.clone().or_else(|| var("ETCDCTL_CACERT")) {
            upstream = upstream.ca_pem(read("cacert", &ca)?);
        }
        let cert = s.cert.clone().or_else(|| var("ETCDCTL_CERT"));
        let key = s.key.clone().or_else(|| var("ETCDCTL_KEY"));
        if let (Some(cert), Some(key)) = (cert, key) {
            upstream = upstream.client_identity(read("cert", &cert)?, read("key", &key)?);
        }
        Ok(Files {
            serve_tls,
            upstream,
        })
    }
}

fn options(s: &Settings, files: &Files) -> CacheServerOptions {
    let mut options = CacheServerOptions::default()
        .with_history_revisions(s.history_revisions)
        .with_history_bytes(s.history_bytes)
        .with_read_timeout(s.read_timeout.0)
        .with_progress_interval(s.progress_interval.0)
        .with_max_request_bytes(s.max_request_bytes)
        .with_access_ttl(s.access_ttl.0)
        .with_audit_period((!s.audit_period.0.is_zero()).then_some(s.audit_period.0))
        .with_drain_timeout(s.drain_timeout.0)
        .with_max_forwarded_watches(
            s.max_forwarded_watches,
            s.max_forwarded_watches_per_connection,
        )
        .with_trust_clients_as_server(s.trust_clients_as_server)
        .with_tls(files.serve_tls.clone())
        .with_upstream_tls(files.upstream.tls_options());
    options.identity_refresh = s.identity_refresh.0;
    if let Some((name, password)) = files.upstream.credentials() {
        options = options.with_upstream_user(name, password);
    }
    options
}

async fn run(settings: Settings, files: Files) -> Result<(), String> {
    let effective = serde_yaml::to_string(&settings).unwrap_or_default();
    tracing::info!(version = VERSION, "starting with:\n{effective}");
    let metrics = match settings.metrics_addr {
        Some(_) => Some(admin::install_recorder()?),
        None => None,
    };
    let client = connect(&files.upstream).await?;
    let mut prefixes = settings.prefix.iter();
    let first = prefixes.next().cloned().unwrap_or_default();
    let mut server = CacheServer::new(client, settings.endpoints.clone(), first);
    for prefix in prefixes {
        server = server.with_prefix(prefix.as_str());
    }
    let server = server
        .with_options(options(&settings, &files))
        .bind(settings.listen_addr)
        .await
        .map_err(|e| e.to_string())?;
    let readiness = server.readiness();
    let admin = match (settings.metrics_addr, metrics) {
        (Some(addr), Some(handle)) => Some(admin::serve(addr, handle, readiness.clone()).await?),
        _ => None,
    };
    tracing::info!(
        addr = %server.local_addr(),
        metrics = ?admin.as_ref().map(|a| a.addr),
        prefixes = ?settings.prefix,
        "listening; ready once every cache has listed"
    );
    let announcing = tokio::spawn(announce_readiness(readiness, settings.endpoints.clone()));
    let drain_timeout = settings.drain_timeout;
    let signal = async move {
        shutdown_signal().await;
        tracing::info!(%drain_timeout, "stopping: draining clients");
    };
    let served = server.serve_until(signal).await;
    announcing.abort();
    if let Some(admin) = admin {
        admin.stop();
    }
    tracing::info!("stopped");
    served.map_err(|e| e.to_string())
}

/// A client of the upstream that does not wait for it: the server listens, and says it is not
/// ready, while etcd is down. With a user, etcd must give a token first: retried until it does.
async fn connect(upstream: &ConnectConfig) -> Result<etcd_client::Client, String> {
    let mut logged = None::<tokio::time::Instant>;
    loop {
        match upstream.connect_lazily().await {
            Ok(client) => return Ok(client),
            Err(e) if upstream.credentials().is_some() => {
                if logged.is_none_or(|at| at.elapsed() >= NOT_READY_LOG_PERIOD) {
                    tracing::warn!(error = %e, "waiting for etcd to authenticate the server's user");
                    logged = Some(tokio::time::Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Logs once when the server becomes ready, and every few seconds what it waits for while it
/// is not.
async fn announce_readiness(readiness: Readiness, endpoints: Vec<String>) {
    let mut was_ready = false;
    let mut last_log = None::<tokio::time::Instant>;
    loop {
        match readiness.why_not() {
            None if !was_ready => {
                tracing::info!("ready: serving from the caches");
                was_ready = true;
            }
            None => {}
            Some(why) => {
                if was_ready || last_log.is_none_or(|at| at.elapsed() >= NOT_READY_LOG_PERIOD) {
                    tracing::warn!(etcd = ?endpoints, "not ready: {why}");
                    last_log = Some(tokio::time::Instant::now());
                }
                was_ready = false;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// SIGTERM (what Kubernetes and systemd send) or Ctrl-C.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
