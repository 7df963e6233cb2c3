//! The writes a chaos round makes: creates, updates, deletes and transactions through the live
//! members, compactions, and waiting until every member has applied them.

use std::time::Duration;

use etcd_client::{GetOptions, Txn, TxnOp};
use tokio::time::Instant;

use super::report::ChaosError;
use super::schedule::Fault;
use super::{Chaos, POLL, WRITE_DEADLINE};

/// One write of the schedule; keys relative to the prefix.
#[derive(Debug, Clone)]
pub(super) enum Op {
    Put {
        key: String,
        value: String,
    },
    Delete {
        key: String,
    },
    /// Several puts and one delete in one revision.
    Txn {
        puts: Vec<(String, String)>,
        delete: String,
    },
}

impl Chaos {
    pub(super) fn key(&mut self) -> String {
        let i = self.rng.usize(0..self.config.keys.max(1));
        format!("ns{}/k{i:02}", i % 3)
    }

    pub(super) fn value(&mut self) -> String {
        self.values += 1;
        format!("e{}-r{}-w{}", self.epoch, self.round, self.values)
    }

    /// A key believed present, else any key.
    pub(super) fn present_key(&mut self, except: &[String]) -> String {
        let candidates: Vec<&String> = self
            .present
            .iter()
            .filter(|k| !except.contains(k))
            .collect();
        if candidates.is_empty() {
            return self.key();
        }
        candidates[self.rng.usize(0..candidates.len())].clone()
    }

    /// The next operation: half puts, a quarter deletes, a quarter transactions (only puts and
    /// transactions with `creating`).
    pub(super) fn next_op(&mut self, creating: bool) -> Op {
        let roll = self.rng.u8(0..100);
        if roll < 50 || (creating && roll < 75) {
            let key = self.key();
            let value = self.value();
            Op::Put { key, value }
        } else if roll < 75 {
            let key = self.present_key(&[]);
            Op::Delete { key }
        } else {
            let n = self.rng.usize(2..=4);
            let mut keys: Vec<String> = Vec::with_capacity(n);
            while keys.len() < n.min(self.config.keys.saturating_sub(1)).max(1) {
                let key = self.key();
                if !keys.contains(&key) {
                    keys.push(key);
                }
            }
            let delete = self.present_key(&keys);
            if keys.contains(&delete) {
                // Too few keys for a distinct delete: a plain put instead.
                let value = self.value();
                return Op::Put {
                    key: keys.swap_remove(0),
                    value,
                };
            }
            let puts = keys.into_iter().map(|k| (k, self.value())).collect();
            Op::Txn { puts, delete }
        }
    }

    /// Applies `op` through one of `writers`, retrying across them for up to
    /// [`WRITE_DEADLINE`]. Returns whether etcd confirmed it.
    pub(super) async fn apply(&mut self, op: &Op, writers: &[usize]) -> bool {
        let prefix = self.config.prefix.clone();
        let deadline = Instant::now() + WRITE_DEADLINE;
        let mut attempt = self.rng.usize(0..writers.len());
        loop {
            let mut kv = self.clients[writers[attempt % writers.len()]].kv_client();
            let result = match op {
                Op::Put { key, value } => kv
                    .put(format!("{prefix}{key}"), value.as_str(), None)
                    .await
                    .map(drop),
                Op::Delete { key } => kv.delete(format!("{prefix}{key}"), None).await.map(drop),
                Op::Txn { puts, delete } => {
                    let mut ops: Vec<TxnOp> = puts
                        .iter()
                        .map(|(k, v)| TxnOp::put(format!("{prefix}{k}"), v.as_str(), None))
                        .collect();
                    ops.push(TxnOp::delete(format!("{prefix}{delete}"), None));
                    kv.txn(Txn::new().and_then(ops)).await.map(drop)
                }
            };
            match result {
                Ok(()) => break,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!(error = %e, "chaos write failed; retrying");
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => {
                    tracing::warn!(error = %e, ?op, "chaos write given up");
                    self.writes.1 += 1;
                    return false;
                }
            }
        }
        self.writes.0 += 1;
        match op {
            Op::Put { key, .. } => {
                self.present.insert(key.clone());
            }
            Op::Delete { key } => {
                self.present.remove(key);
            }
            Op::Txn { puts, delete } => {
                self.present.remove(delete);
                self.present.extend(puts.iter().map(|(k, _)| k.clone()));
            }
        }
        true
    }

    /// `n` operations of the schedule, one after the other.
    pub(super) async fn write_ops(&mut self, n: usize, writers: &[usize], creating: bool) {
        for _ in 0..n {
            let op = self.next_op(creating);
            self.apply(&op, writers).await;
        }
    }

    /// Operations of the schedule, 20-100 ms apart, for `window`.
    pub(super) async fn write_for(&mut self, window: Duration, writers: &[usize]) {
        let start = Instant::now();
        while start.elapsed() < window {
            let op = self.next_op(false);
            self.apply(&op, writers).await;
            let pace = Duration::from_millis(self.rng.u64(20..100));
            tokio::time::sleep(pace.min(window.saturating_sub(start.elapsed()))).await;
        }
    }

    /// Deletes one to three keys believed present, so that the fault always hides deletes.
    pub(super) async fn delete_some(&mut self, writers: &[usize]) {
        for _ in 0..self.rng.usize(1..=3) {
            if self.present.is_empty() {
                break;
            }
            let key = self.present_key(&[]);
            self.apply(&Op::Delete { key }, writers).await;
        }
    }

    /// Compacts etcd to its current revision through one of `writers`.
    pub(super) async fn compact(
        &mut self,
        writers: &[usize],
        fault: Fault,
    ) -> Result<(), ChaosError> {
        let revision = self.etcd_revision(writers, fault).await?;
        let deadline = Instant::now() + WRITE_DEADLINE;
        let mut last_error = String::new();
        for attempt in 0.. {
            let mut kv = self.clients[writers[attempt % writers.len()]].kv_client();
            match kv.compact(revision, None).await {
                Ok(_) => {
                    tracing::debug!(revision, "compacted");
                    return Ok(());
                }
                // Already compacted there (no write since the last compaction): as good.
                Err(e) if e.to_string().contains("compacted") => return Ok(()),
                Err(e) => last_error = e.to_string(),
            }
            if Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(self.etcd_error(
            &fault.to_string(),
            format!("compacting to revision {revision}: {last_error}"),
        ))
    }

    /// Waits until member `t` has applied every write (its serializable revision is the
    /// cluster's), then for etcd's backend to commit (every 100 ms), so that a SIGKILL cannot
    /// land inside an apply; see `kill_corrupts`.
    pub(super) async fn quiesce(
        &self,
        t: usize,
        writers: &[usize],
        fault: Fault,
    ) -> Result<(), ChaosError> {
        let cluster = self.etcd_revision(writers, fault).await?;
        let deadline = Instant::now() + WRITE_DEADLINE;
        loop {
            let options = GetOptions::new().with_serializable().with_count_only();
            let mut kv = self.clients[t].kv_client();
            let applied = kv
                .get(self.config.prefix.as_str(), Some(options))
                .await
                .map_or(0, |r| r.header().map_or(0, |h| h.revision()));
            if applied >= cluster {
                break;
            }
            if Instant::now() >= deadline {
                return Err(self.etcd_error(
                    &fault.to_string(),
                    format!(
                        "member {t} did not apply revision {cluster} within {WRITE_DEADLINE:?}"
                    ),
                ));
            }
            tokio::time::sleep(POLL).await;
        }
        // The backend's commit cannot be observed; its interval is 100 ms.
        tokio::time::sleep(Duration::from_millis(300)).await;
        Ok(())
    }
}
