//! [`EtcdServer`]: a single-member etcd.

use std::path::Path;

use etcd_client::Client;

use super::binary::find_etcd_binary;
use super::member::{start_members, EtcdMember};
use super::{HarnessError, ServerOptions};

/// A single-member etcd on free loopback ports with a temporary data directory, killed and
/// deleted on drop.
///
/// ```no_run
/// use etcd_informer::testing::etcd::EtcdServer;
///
/// #[tokio::main]
/// async fn main() -> Result<(), Box<dyn std::error::Error>> {
///     let server = EtcdServer::start().await?;
///     let mut client = server.client().await;
///     client.put("/demo/key", "value", None).await?;
///
///     server.restart().await?; // same ports and data
///     let resp = client.get("/demo/key", None).await?;
///     assert_eq!(resp.kvs()[0].value(), b"value");
///
///     server.wipe().await?; // empty again, revision starts over
///     Ok(())
/// }
/// ```
#[derive(Debug)]
pub struct EtcdServer {
    pub(super) member: EtcdMember,
}

impl EtcdServer {
    /// Starts etcd with default options and waits until it serves requests (up to 30 s).
    pub async fn start() -> Result<EtcdServer, HarnessError> {
        Self::start_with(ServerOptions::default()).await
    }

    /// Starts etcd with `options` and waits until it serves requests (up to 30 s).
    pub async fn start_with(options: ServerOptions) -> Result<EtcdServer, HarnessError> {
        let bin = find_etcd_binary()?;
        Self::start_with_bin(&bin, &options).await
    }

    pub(super) async fn start_with_bin(
        bin: &Path,
        options: &ServerOptions,
    ) -> Result<EtcdServer, HarnessError> {
        let mut members = start_members(1, options, bin).await?;
        let member = members
            .pop()
            .ok_or_else(|| HarnessError::Config("no member started".into()))?;
        Ok(EtcdServer { member })
    }

    /// The client URL, `http://127.0.0.1:PORT`; stable across restarts and wipes.
    pub fn endpoint(&self) -> String {
        self.member.endpoint()
    }

    /// [`EtcdMember::metric`]: a metric from etcd's `/metrics` page.
    pub fn metric(&self, metric: &str, labels: &[&str]) -> Option<f64> {
        self.member.metric(metric, labels)
    }

    /// [`endpoint`](Self::endpoint) as a one-element list.
    pub fn endpoints(&self) -> Vec<String> {
        vec![self.member.endpoint()]
    }

    /// The etcd data directory.
    pub fn data_dir(&self) -> &Path {
        self.member.data_dir()
    }

    /// The underlying process handle, for logs and pids.
    pub fn member(&self) -> &EtcdMember {
        &self.member
    }

    /// The process id while running.
    pub fn pid(&self) -> Option<u32> {
        self.member.pid()
    }

    /// Whether the process is running (paused counts as running).
    pub fn is_running(&self) -> bool {
        self.member.is_running()
    }

    /// A client for this server.
    ///
    /// # Panics
    /// If the client cannot be created; see [`try_client`](Self::try_client).
    pub async fn client(&self) -> Client {
        self.member.client().await
    }

    /// A client for this server.
    pub async fn try_client(&self) -> Result<Client, HarnessError> {
        self.member.try_client().await
    }

    /// Stops etcd gracefully (SIGTERM, SIGKILL after 5 s), keeping its data. No-op if stopped.
    pub async fn stop(&self) -> Result<(), HarnessError> {
        self.member.stop().await
    }

    /// Starts a stopped server again on the same ports and data directory and waits until it
    /// serves requests. Fails if it is running.
    pub async fn start_again(&self) -> Result<(), HarnessError> {
        self.member.start_on_same_ports(true).await
    }

    /// [`stop`](Self::stop) then [`start_again`](Self::start_again): data and revision survive.
    pub async fn restart(&self) -> Result<(), HarnessError> {
        self.stop().await?;
        self.start_again().await
    }

    /// Stops etcd, deletes its data and starts a fresh one on the same ports: all keys are
    /// gone and the revision starts over.
    pub async fn wipe(&self) -> Result<(), HarnessError> {
        self.stop().await?;
        self.member.remove_data()?;
        self.start_again().await
    }

    /// Kills etcd with SIGKILL (simulating a crash). Data is kept. No-op if stopped.
    pub fn kill(&self) {
        self.member.kill()
    }

    /// Freezes etcd with SIGSTOP: connections stay open but requests hang.
    pub fn pause(&self) -> Result<(), HarnessError> {
        self.member.pause()
    }

    /// Continues a paused etcd with SIGCONT.
    pub fn resume(&self) -> Result<(), HarnessError> {
        self.member.resume()
    }
}
