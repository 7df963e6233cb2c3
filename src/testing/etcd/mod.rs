//! Throwaway etcd processes for tests, examples and benchmarks.
//!
//! * [`EtcdServer`]: one etcd process on free loopback ports with a private temporary data
//!   directory, which can be stopped, restarted, wiped, killed, paused and resumed.
//! * [`EtcdCluster`]: `n` such members forming one static cluster, whose members can be
//!   killed, restarted, paused and resumed one by one, or wiped all together.
//! * [`test_etcd`]: the etcd shared by all tests of one test binary (or the cluster named by
//!   `ETCD_ENDPOINTS`), plus [`unique_prefix`] to keep tests sharing it apart.
//!
//! The etcd binary comes from `ETCD_BIN`, else `etcd` on `PATH`. Its output goes to a log file
//! in the member's temporary directory; startup errors quote the end of that log.
//!
//! # No orphaned etcd processes
//!
//! The shared server lives in a `static`, and Rust never drops statics, so `Drop` alone cannot
//! stop it. Three mechanisms are combined:
//!
//! 1. On Linux every child gets `prctl(PR_SET_PDEATHSIG, SIGKILL)` in `pre_exec`, so the kernel
//!    kills it when its parent goes away, even if the test process is itself SIGKILLed. The
//!    "parent" for this purpose is the *thread* that forked the child, and the threads running
//!    `#[tokio::test]`s end long before the process does. So all children are forked by one
//!    dedicated thread that is started once and never exits (it blocks on a channel whose
//!    sender lives in a static): the signal then fires only when the whole process exits. If the
//!    process died between `fork` and `prctl`, the child notices that its parent changed and
//!    exits before running etcd.
//! 2. The shared server registers an `atexit` handler that kills it and removes its data
//!    directory on normal exit (also after failed tests, since libtest exits via `exit`).
//! 3. Dropping an [`EtcdServer`] or [`EtcdCluster`] SIGKILLs and reaps its processes and then
//!    removes the temporary directories.
//!
//! On other Unix systems only 2 and 3 apply. When a test process is interrupted (Ctrl-C), its
//! etcd still dies, but its temporary directory stays; the next start removes such directories
//! (they are named after the pid that created them, and only dead pids' directories go).

use std::io;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// How long a start or restart may take before it is reported as failed.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How often readiness is polled.
const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// How long [`EtcdServer::stop`] waits after SIGTERM before sending SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(5);
/// How many sets of fresh ports a first start tries when a port was taken meanwhile.
const PORT_ATTEMPTS: usize = 4;
/// How often a restart on the same ports is retried when a port is taken meanwhile.
const RESTART_ATTEMPTS: usize = 5;
/// Lines of the etcd log quoted in errors.
const LOG_TAIL_LINES: usize = 30;
const LOG_FILE: &str = "etcd.log";
/// Temporary directories are named `etcd-informer-<pid>-<random>`.
const DIR_PREFIX: &str = "etcd-informer-";
const DATA_SUBDIR: &str = "data";
const READINESS_KEY: &str = "/etcd-informer-harness/readiness";
const INSTALL_HINT: &str = "install etcd (`apt-get install etcd-server` on Debian/Ubuntu), \
or set ETCD_BIN to an etcd binary, or set ETCD_ENDPOINTS to a running etcd \
(e.g. `docker compose up -d etcd` from the repository root)";

/// Errors from starting, controlling or connecting to throwaway etcd processes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HarnessError {
    /// No usable etcd binary; the message says how to get one.
    #[error("etcd binary not found: {detail}; to run etcd-backed tests, {INSTALL_HINT}")]
    EtcdNotFound {
        /// What was looked for and where.
        detail: String,
    },
    /// The etcd binary could not be started.
    #[error("failed to spawn etcd binary {}: {source}", bin.display())]
    Spawn {
        /// The binary that was executed.
        bin: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A file system or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// etcd exited while it was starting.
    #[error("etcd ({}) for {endpoint} exited while starting ({status}); last lines of its log {}:\n{log_tail}", bin.display(), log.display())]
    Exited {
        /// The etcd binary.
        bin: PathBuf,
        /// The member's client endpoint.
        endpoint: String,
        /// How the process ended.
        status: String,
        /// The log file (deleted together with the temporary directory).
        log: PathBuf,
        /// The last lines of the log.
        log_tail: String,
    },
    /// etcd did not answer in time.
    #[error("etcd at {endpoint} not ready after {waited:?} (last error: {last_error}); last lines of its log {}:\n{log_tail}", log.display())]
    NotReady {
        /// The member's client endpoint.
        endpoint: String,
        /// How long readiness was awaited.
        waited: Duration,
        /// The last failure of the readiness probe.
        last_error: String,
        /// The log file (deleted together with the temporary directory).
        log: PathBuf,
        /// The last lines of the log.
        log_tail: String,
    },
    /// The operation does not fit the member's current state.
    #[error("etcd at {endpoint} is {state}")]
    InvalidState {
        /// The member's client endpoint.
        endpoint: String,
        /// The offending state, e.g. "not running".
        state: &'static str,
    },
    /// Connecting an etcd client failed.
    #[error("cannot connect to etcd at {endpoints:?}: {source}")]
    Connect {
        /// The endpoints given to the client.
        endpoints: Vec<String>,
        /// The underlying error.
        #[source]
        source: etcd_client::Error,
    },
    /// Invalid arguments, such as a cluster of zero members.
    #[error("invalid etcd harness configuration: {0}")]
    Config(String),
}

impl HarnessError {
    fn io(what: impl Into<String>, source: io::Error) -> Self {
        HarnessError::Io {
            what: what.into(),
            source,
        }
    }

    /// Whether etcd died because one of its ports was taken by someone else.
    fn is_addr_in_use(&self) -> bool {
        matches!(self, HarnessError::Exited { log_tail, .. } if log_tail.contains("address already in use"))
    }
}

/// Options for [`EtcdServer::start_with`] and [`EtcdCluster::start_with`].
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct ServerOptions {
    /// Parent directory of the temporary data directories (default: the system temp dir).
    /// `/dev/shm` keeps benchmarks off the disk.
    pub data_root: Option<PathBuf>,
    /// Extra command-line arguments appended after the harness's own (later flags win).
    pub extra_args: Vec<String>,
}

impl ServerOptions {
    /// Sets the parent directory of the temporary data directories (`data_root`).
    #[must_use]
    pub fn with_data_root(mut self, data_root: Option<PathBuf>) -> Self {
        self.data_root = data_root;
        self
    }

    /// Sets the extra command-line arguments appended after the harness's own (`extra_args`).
    #[must_use]
    pub fn with_extra_args(mut self, extra_args: Vec<String>) -> Self {
        self.extra_args = extra_args;
        self
    }
}

/// Locks a mutex, ignoring poisoning: the guarded state stays consistent across panics.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

mod binary;
mod cluster;
mod member;
mod proxy;
mod server;
mod shared;
mod spawn;

pub use binary::{find_etcd_binary, resolve_etcd_binary};
pub use cluster::EtcdCluster;
pub use member::EtcdMember;
pub use proxy::TcpProxy;
pub use server::EtcdServer;
pub use shared::{test_etcd, test_etcd_with_env, unique_prefix, TestEtcd};
