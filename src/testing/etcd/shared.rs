//! [`test_etcd`]: the etcd shared by every test of one process, and [`unique_prefix`].

use std::ffi::OsStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use etcd_client::Client;

use super::binary::{connect, resolve_etcd_binary};
use super::member::EtcdMember;
use super::server::EtcdServer;
use super::{HarnessError, ServerOptions};

/// Endpoints of the etcd shared by the tests of one process; see [`test_etcd`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestEtcd {
    /// Client URLs, as given by `ETCD_ENDPOINTS` or of the shared server.
    pub endpoints: Vec<String>,
}

impl TestEtcd {
    /// A client over [`endpoints`](Self::endpoints).
    ///
    /// # Panics
    /// If the client cannot be created; see [`try_client`](Self::try_client).
    pub async fn client(&self) -> Client {
        self.try_client()
            .await
            .expect("connecting to the test etcd")
    }

    /// A client over [`endpoints`](Self::endpoints).
    pub async fn try_client(&self) -> Result<Client, HarnessError> {
        connect(&self.endpoints, None).await
    }
}

/// The process-wide shared server. It holds only the child process handle and paths, nothing
/// tied to the tokio runtime of the test that happened to start it.
static SHARED: tokio::sync::OnceCell<EtcdServer> = tokio::sync::OnceCell::const_new();

extern "C" fn kill_shared_at_exit() {
    // Must not panic or block: try_lock, ignore errors. PR_SET_PDEATHSIG is the backstop.
    if let Some(server) = SHARED.get() {
        if let Ok(mut state) = server.member.state.try_lock() {
            EtcdMember::kill_locked(&mut state);
            let _ = std::fs::remove_dir_all(server.member.dir.path());
        }
    }
}

/// The etcd for this test process: `ETCD_ENDPOINTS` (comma-separated, used as given) if set,
/// else one [`EtcdServer`] started on first use and shared by every test of the process, across
/// their separate tokio runtimes. It is killed when the process exits.
///
/// Keys persist between tests, so give every test its own [`unique_prefix`]. Fails, saying how
/// to install etcd, when neither `ETCD_ENDPOINTS` nor an etcd binary is available.
pub async fn test_etcd() -> Result<TestEtcd, HarnessError> {
    let endpoints = std::env::var("ETCD_ENDPOINTS").ok();
    let bin = std::env::var_os("ETCD_BIN");
    test_etcd_with_env(endpoints.as_deref(), bin.as_deref()).await
}

/// [`test_etcd`] with explicit values for the `ETCD_ENDPOINTS` and `ETCD_BIN` variables (`PATH`
/// is still read from the environment).
pub async fn test_etcd_with_env(
    etcd_endpoints: Option<&str>,
    etcd_bin: Option<&OsStr>,
) -> Result<TestEtcd, HarnessError> {
    if let Some(list) = etcd_endpoints {
        let endpoints: Vec<String> = list
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(String::from)
            .collect();
        if !endpoints.is_empty() {
            return Ok(TestEtcd { endpoints });
        }
    }
    let bin = resolve_etcd_binary(etcd_bin, std::env::var_os("PATH").as_deref())?;
    let server = SHARED
        .get_or_try_init(|| async {
            let server = EtcdServer::start_with_bin(&bin, &ServerOptions::default()).await?;
            // SAFETY: registers a plain `extern "C"` function that neither unwinds nor relies on
            // thread-local state.
            if unsafe { libc::atexit(kill_shared_at_exit) } != 0 {
                tracing::warn!("atexit registration failed; relying on PR_SET_PDEATHSIG");
            }
            Ok::<_, HarnessError>(server)
        })
        .await?;
    Ok(TestEtcd {
        endpoints: server.endpoints(),
    })
}

/// A key prefix no other test (or test run) uses:
/// `/etcd-informer-test/<name>-<pid>-<counter>-<nanos>/`. Slashes in `test_name` become `_`.
pub fn unique_prefix(test_name: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let counter = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "/etcd-informer-test/{}-{}-{counter}-{nanos}/",
        test_name.replace('/', "_"),
        std::process::id()
    )
}
