//! [`EtcdCluster`]: a static cluster of `n` members.

use std::time::Duration;

use etcd_client::Client;

use super::binary::{connect, find_etcd_binary};
use super::member::{start_members, wait_ready, EtcdMember};
use super::{member, HarnessError, ServerOptions, RESTART_ATTEMPTS};

/// A static etcd cluster of `n` members on loopback, killed and deleted on drop.
///
/// ```no_run
/// use etcd_informer::testing::etcd::EtcdCluster;
///
/// #[tokio::main]
/// async fn main() -> Result<(), Box<dyn std::error::Error>> {
///     let cluster = EtcdCluster::start(3).await?;
///     let leader = cluster.leader_index().await.expect("a leader");
///     cluster.stop_member(leader).await?;
///     let mut client = cluster.member((leader + 1) % 3).client().await;
///     client.put("/k", "v", None).await?;
///     cluster.restart_member(leader).await?;
///     Ok(())
/// }
/// ```
#[derive(Debug)]
pub struct EtcdCluster {
    pub(super) members: Vec<EtcdMember>,
}

impl EtcdCluster {
    /// Starts `n` members and waits until all answer and a leader exists (up to 30 s).
    pub async fn start(n: usize) -> Result<EtcdCluster, HarnessError> {
        Self::start_with(n, ServerOptions::default()).await
    }

    /// [`start`](Self::start) with options applied to every member.
    pub async fn start_with(n: usize, options: ServerOptions) -> Result<EtcdCluster, HarnessError> {
        let bin = find_etcd_binary()?;
        let members = start_members(n, &options, &bin).await?;
        Ok(EtcdCluster { members })
    }

    /// The number of members.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Always false: a cluster has at least one member.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// All members, in index order.
    pub fn members(&self) -> &[EtcdMember] {
        &self.members
    }

    /// Member `i`.
    ///
    /// # Panics
    /// If `i >= len()`.
    pub fn member(&self, i: usize) -> &EtcdMember {
        &self.members[i]
    }

    /// The client URL of member `i`.
    ///
    /// # Panics
    /// If `i >= len()`.
    pub fn member_endpoint(&self, i: usize) -> String {
        self.members[i].endpoint()
    }

    /// The client URLs of all members.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(EtcdMember::endpoint).collect()
    }

    /// A client over all members.
    ///
    /// # Panics
    /// If the client cannot be created; see [`try_client`](Self::try_client).
    pub async fn client(&self) -> Client {
        self.try_client()
            .await
            .expect("connecting to the etcd cluster")
    }

    /// A client over all members.
    pub async fn try_client(&self) -> Result<Client, HarnessError> {
        connect(&self.endpoints(), None).await
    }

    /// Stops member `i` gracefully, keeping its data.
    pub async fn stop_member(&self, i: usize) -> Result<(), HarnessError> {
        self.members[i].stop().await
    }

    /// Kills member `i` with SIGKILL, keeping its data.
    pub fn kill_member(&self, i: usize) {
        self.members[i].kill()
    }

    /// Stops member `i` if running, starts it on the same ports and data, and waits until it
    /// answers; while a majority of members runs, also until it sees a leader and serves reads.
    pub async fn restart_member(&self, i: usize) -> Result<(), HarnessError> {
        let member = &self.members[i];
        member.stop().await?;
        let others = self
            .members
            .iter()
            .enumerate()
            .filter(|(j, m)| *j != i && m.is_running())
            .count();
        let quorum = others + 1 > self.members.len() / 2;
        member.start_on_same_ports(quorum).await
    }

    /// Wipes the whole cluster: kills every member, deletes all their data and starts them
    /// again as a fresh cluster on the same ports, with the same member names and cluster token
    /// (so the same cluster and member ids). Every key is gone and the revision starts over, as
    /// after restoring an empty backup; clients keep their endpoints. Waits until every member
    /// answers, a leader exists and reads are served (up to 30 s).
    pub async fn wipe(&self) -> Result<(), HarnessError> {
        let mut attempt = 1;
        loop {
            // The data is thrown away, so there is nothing to stop gracefully.
            self.members.iter().for_each(EtcdMember::kill);
            for member in &self.members {
                member.remove_data()?;
            }
            let started = match self.members.iter().try_for_each(EtcdMember::spawn) {
                Ok(()) => wait_ready(&self.members, true).await,
                Err(e) => Err(e),
            };
            match started {
                Ok(()) => return Ok(()),
                Err(e) if e.is_addr_in_use() && attempt < RESTART_ATTEMPTS => {
                    tracing::debug!(attempt, "port taken; retrying the cluster wipe");
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                Err(e) => {
                    self.members.iter().for_each(EtcdMember::kill);
                    return Err(e);
                }
            }
        }
    }

    /// The member serving a watch (the first whose [`EtcdMember::watchers`] is not 0): with one
    /// informer and no other watcher, the informer's member. `None` if none does, e.g. between
    /// two watches.
    pub async fn watching_member(&self) -> Option<usize> {
        let endpoints = self.endpoints();
        tokio::task::spawn_blocking(move || {
            endpoints
                .iter()
                .position(|e| member::watchers_at(e).is_some_and(|n| n > 0))
        })
        .await
        .ok()
        .flatten()
    }

    /// Freezes member `i` with SIGSTOP.
    pub fn pause_member(&self, i: usize) -> Result<(), HarnessError> {
        self.members[i].pause()
    }

    /// Continues member `i` with SIGCONT.
    pub fn resume_member(&self, i: usize) -> Result<(), HarnessError> {
        self.members[i].resume()
    }

    /// The index of the member that reports itself leader, asking each running, unpaused
    /// member's `status`; `None` if none does (e.g. during an election).
    pub async fn leader_index(&self) -> Option<usize> {
        for (i, member) in self.members.iter().enumerate() {
            if !member.is_running() || member.is_paused() {
                continue;
            }
            let Ok(mut client) = connect(&[member.endpoint()], Some(Duration::from_secs(1))).await
            else {
                continue;
            };
            if let Ok(status) = client.status().await {
                let me = status.header().map(|h| h.member_id());
                if status.leader() != 0 && me == Some(status.leader()) {
                    return Some(i);
                }
            }
        }
        None
    }
}
