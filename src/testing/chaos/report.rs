//! What a chaos round reports: [`RoundReport`] and [`ChaosError`].

use std::fmt;
use std::time::Duration;

use super::schedule::{Endpoints, Fault};
use crate::testing::etcd::HarnessError;

/// Why a chaos run stopped. Every variant names the seed, the endpoint mode, the round and the
/// fault (round 0 is the initial sync).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChaosError {
    /// Starting or controlling etcd failed.
    #[error("seed {seed}, {endpoints}, round {round} ({phase}): etcd harness: {source}")]
    Harness {
        /// The run's seed.
        seed: u64,
        /// The endpoint mode.
        endpoints: Endpoints,
        /// The round.
        round: usize,
        /// The fault, or `start`.
        phase: String,
        /// What failed.
        #[source]
        source: Box<HarnessError>,
    },
    /// A request the driver cannot do without failed (connecting, compacting).
    #[error("seed {seed}, {endpoints}, round {round} ({phase}): {what}")]
    Etcd {
        /// The run's seed.
        seed: u64,
        /// The endpoint mode.
        endpoints: Endpoints,
        /// The round.
        round: usize,
        /// The fault, or `start`.
        phase: String,
        /// What failed, with etcd's error.
        what: String,
    },
    /// The cache did not equal etcd within the deadline.
    #[error(
        "seed {seed}, {endpoints}, round {round} ({phase}): the cache still differed from etcd \
         {waited:?} after the fault ended (cache at revision {cache_revision}, etcd at \
         {etcd_revision}, {lists} lists so far); key: cache / etcd\n{diff}"
    )]
    NotConverged {
        /// The run's seed.
        seed: u64,
        /// The endpoint mode.
        endpoints: Endpoints,
        /// The round.
        round: usize,
        /// The fault, or `start`.
        phase: String,
        /// How long it waited.
        waited: Duration,
        /// The cache's revision at the end.
        cache_revision: i64,
        /// etcd's revision at the last read (0 if it could not be read).
        etcd_revision: i64,
        /// How many times the informer listed.
        lists: usize,
        /// One line per key that differs (or the last error reading etcd).
        diff: String,
    },
    /// The handler's history broke a rule.
    #[error("seed {seed}, {endpoints}, round {round} ({phase}): history violations:\n{}", violations.join("\n"))]
    Violations {
        /// The run's seed.
        seed: u64,
        /// The endpoint mode.
        endpoints: Endpoints,
        /// The round.
        round: usize,
        /// The fault, or `start`.
        phase: String,
        /// One line per violation.
        violations: Vec<String>,
    },
}

/// What one round did and measured.
#[derive(Debug, Clone)]
pub struct RoundReport {
    /// The run's seed.
    pub seed: u64,
    /// The endpoint mode.
    pub endpoints: Endpoints,
    /// The round, from 1 (0 is the initial sync).
    pub round: usize,
    /// The fault injected.
    pub fault: Fault,
    /// The member the fault hit (`None`: all of them).
    pub target: Option<usize>,
    /// The member that served the informer's watch when the round began, if one did.
    pub watching: Option<usize>,
    /// From the end of the fault until the cache equalled etcd.
    pub converged_after: Duration,
    /// After a restart or a wipe with one endpoint: from the end of the fault until the
    /// informer's member first answered a linearizable read (before that, no client of it can
    /// catch up). `None` for other faults and modes.
    pub member_answered_after: Option<Duration>,
    /// Writes (puts, deletes, transactions) that etcd confirmed.
    pub writes: usize,
    /// Writes given up after 10 s of retries (their outcome is unknown, which the
    /// checks do not mind: they compare against what etcd holds).
    pub failed_writes: usize,
    /// Lists the informer made during the round (relists).
    pub relists: usize,
    /// List and watch errors reported during the round.
    pub watch_errors: usize,
    /// Notifications the handler received during the round.
    pub events: usize,
    /// Tombstones among [`events`](Self::events).
    pub tombstones: usize,
    /// Keys etcd changed after the cache converged: a write whose reply failed and that was
    /// retried elsewhere landed late (its first attempt). The handler must follow them too.
    pub late_keys: usize,
    /// Broken history rules, one line each; empty when all is well.
    pub violations: Vec<String>,
}

impl RoundReport {
    /// `Err` with every violation, naming the seed, round and fault, if there are any.
    pub fn check(&self) -> Result<(), ChaosError> {
        if self.violations.is_empty() {
            return Ok(());
        }
        Err(ChaosError::Violations {
            seed: self.seed,
            endpoints: self.endpoints,
            round: self.round,
            phase: self.fault.to_string(),
            violations: self.violations.clone(),
        })
    }
}

impl fmt::Display for RoundReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let target = match self.target {
            None => "all members".to_string(),
            Some(t) if self.watching == Some(t) => format!("member {t}, the informer's"),
            Some(t) => format!("member {t}"),
        };
        write!(
            f,
            "seed {} {} round {} {} ({target}): converged {:?} after the fault ended{}; \
             {} writes ({} given up), {} relists, {} watch errors, {} events ({} tombstones), \
             {} keys changed after the cache converged, {} violations",
            self.seed,
            self.endpoints,
            self.round,
            self.fault,
            self.converged_after,
            match self.member_answered_after {
                Some(answered) => format!(
                    " ({:?} after its member answered a linearizable read at {answered:?})",
                    self.converged_after.saturating_sub(answered)
                ),
                None => String::new(),
            },
            self.writes,
            self.failed_writes,
            self.relists,
            self.watch_errors,
            self.events,
            self.tombstones,
            self.late_keys,
            self.violations.len()
        )
    }
}
