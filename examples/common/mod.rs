//! What every example shares: the ConfigMap-like object, arguments, and finding an etcd.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::time::Duration;

use etcd_client::Client;
use etcd_informer::testing::etcd::EtcdServer;
use etcd_informer::ConnectConfig;

/// A ConfigMap-like object, stored as JSON under `/registry/configmaps/<namespace>/<name>`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ConfigMap {
    pub namespace: String,
    pub name: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub data: BTreeMap<String, String>,
}

pub const DEFAULT_PREFIX: &str = "/registry/configmaps/";

/// `--name value` from the command line, or `default`.
pub fn arg(name: &str, default: &str) -> String {
    let flag = format!("--{name}");
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| *a == flag)
        .and_then(|i| args.get(i + 1).cloned())
        .or_else(|| {
            let with_eq = format!("{flag}=");
            args.iter()
                .find_map(|a| a.strip_prefix(&with_eq).map(str::to_owned))
        })
        .unwrap_or_else(|| default.to_owned())
}

/// The `--prefix` argument, checked to end with `/`.
pub fn prefix() -> String {
    arg("prefix", DEFAULT_PREFIX)
}

/// An etcd to talk to: `ETCD_ENDPOINTS` if set, with etcdctl's TLS and user variables (exits
/// non-zero within seconds, naming it, if it does not answer); else 127.0.0.1:2379 if it answers; else a throwaway etcd started here, if
/// the binary exists. Keep the returned server alive as long as the example runs.
pub async fn etcd() -> (Client, Option<EtcdServer>) {
    // Library warnings (undecodable values, retries) go to stderr; RUST_LOG=debug shows more.
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    if std::env::var_os("ETCD_ENDPOINTS").is_some() {
        // ETCD_ENDPOINTS with etcdctl's ETCDCTL_CACERT, ETCDCTL_CERT, ETCDCTL_KEY, ETCDCTL_USER.
        let config = ConnectConfig::from_env().unwrap_or_else(|e| {
            eprintln!("error: {e}");
            std::process::exit(2);
        });
        match tokio::time::timeout(Duration::from_secs(5), config.connect()).await {
            Ok(Ok(client)) => return (client, None),
            Ok(Err(e)) => {
                eprintln!("error: {e} (ETCD_ENDPOINTS)");
                std::process::exit(2);
            }
            Err(_) => {
                eprintln!(
                    "error: cannot reach etcd at {} (ETCD_ENDPOINTS): no answer within 5s",
                    config.endpoints().join(",")
                );
                std::process::exit(2);
            }
        }
    }
    let default = vec!["127.0.0.1:2379".to_owned()];
    if let Ok(client) = try_connect(&default, Duration::from_secs(1)).await {
        return (client, None);
    }
    match EtcdServer::start().await {
        Ok(server) => {
            eprintln!(
                "note: ETCD_ENDPOINTS is unset and nothing answers on 127.0.0.1:2379, so this example started a throwaway etcd at {} (try: ETCDCTL_API=3 etcdctl --endpoints {} put ...)",
                server.endpoint(),
                server.endpoint()
            );
            match try_connect(&server.endpoints(), Duration::from_secs(5)).await {
                Ok(client) => (client, Some(server)),
                Err(e) => {
                    eprintln!(
                        "error: the throwaway etcd at {} does not answer: {e}",
                        server.endpoint()
                    );
                    std::process::exit(2);
                }
            }
        }
        Err(e) => {
            eprintln!("error: no etcd: ETCD_ENDPOINTS is unset, nothing answers on 127.0.0.1:2379, and starting one failed: {e}");
            std::process::exit(2);
        }
    }
}

async fn try_connect(endpoints: &[String], within: Duration) -> Result<Client, String> {
    let attempt = async {
        let mut client = etcd_informer::connect(endpoints)
            .await
            .map_err(|e| e.to_string())?;
        client.status().await.map_err(|e| e.to_string())?;
        Ok(client)
    };
    tokio::time::timeout(within, attempt)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {within:?}")))
}

/// Resolves on Ctrl-C (SIGINT) or SIGTERM. The handlers are installed when this is called, not
/// when the future is first polled, so call it first thing: a signal arriving earlier would
/// kill the process instead of stopping it cleanly.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut int = signal(SignalKind::interrupt()).ok();
    let mut term = signal(SignalKind::terminate()).ok();
    async move {
        async fn recv(s: Option<&mut tokio::signal::unix::Signal>) {
            match s {
                Some(s) => {
                    s.recv().await;
                }
                None => std::future::pending().await,
            }
        }
        tokio::select! {
            _ = recv(int.as_mut()) => {}
            _ = recv(term.as_mut()) => {}
        }
    }
}

/// Prints a line and flushes, so scripts reading a pipe see it at once.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, $($arg)*);
        let _ = out.flush();
    }};
}
