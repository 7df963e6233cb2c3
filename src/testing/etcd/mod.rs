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

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use etcd_client::{Client, ConnectOptions};
use tempfile::TempDir;

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
pub struct ServerOptions {
    /// Parent directory of the temporary data directories (default: the system temp dir).
    /// `/dev/shm` keeps benchmarks off the disk.
    pub data_root: Option<PathBuf>,
    /// Extra command-line arguments appended after the harness's own (later flags win).
    pub extra_args: Vec<String>,
}

/// Locks a mutex, ignoring poisoning: the guarded state stays consistent across panics.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ---------------------------------------------------------------------------------------------
// Spawning

struct SpawnRequest {
    cmd: Command,
    reply: mpsc::SyncSender<io::Result<Child>>,
}

/// Spawns `cmd` from the process-wide spawner thread, which never exits (see the module docs).
fn spawn_child(cmd: Command) -> io::Result<Child> {
    static SPAWNER: OnceLock<Result<mpsc::Sender<SpawnRequest>, String>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("etcd-harness-spawner".into())
            .spawn(move || {
                // The sender lives in a static and is never dropped, so this loop never ends and
                // the thread (the parent of every etcd for PR_SET_PDEATHSIG) lives as long as
                // the process.
                for mut req in rx {
                    let _ = req.reply.send(req.cmd.spawn());
                }
            })
            .map(|_| tx)
            .map_err(|e| format!("cannot start the etcd spawner thread: {e}"))
    });
    let tx = spawner.as_ref().map_err(|e| io::Error::other(e.clone()))?;
    let (reply, result) = mpsc::sync_channel(1);
    tx.send(SpawnRequest { cmd, reply })
        .map_err(|_| io::Error::other("the etcd spawner thread is gone"))?;
    result
        .recv()
        .map_err(|_| io::Error::other("the etcd spawner thread dropped the request"))?
}

/// Makes the child receive SIGKILL when the thread that forked it (the spawner) exits.
#[cfg(target_os = "linux")]
fn set_parent_death_signal(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id();
    // SAFETY: the closure runs between fork and exec and only makes async-signal-safe calls
    // (prctl, getppid) without allocating.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            // The parent may have died before prctl took effect; then we were reparented.
            if libc::getppid() as u32 != parent {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn set_parent_death_signal(_cmd: &mut Command) {}

fn send_signal(child: &Child, signal: libc::c_int) -> io::Result<()> {
    let pid = libc::pid_t::try_from(child.id()).map_err(io::Error::other)?;
    // SAFETY: kill(2) has no memory-safety preconditions. The child has not been reaped (we hold
    // its handle and only reap through it), so the pid still names our child.
    if unsafe { libc::kill(pid, signal) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

// ---------------------------------------------------------------------------------------------
// Binary lookup and ports

/// Finds the etcd binary: `ETCD_BIN` if set (a path, or a name looked up on `PATH`), else
/// `etcd` on `PATH`.
pub fn find_etcd_binary() -> Result<PathBuf, HarnessError> {
    resolve_etcd_binary(
        std::env::var_os("ETCD_BIN").as_deref(),
        std::env::var_os("PATH").as_deref(),
    )
}

/// [`find_etcd_binary`] with explicit values for the `ETCD_BIN` and `PATH` variables.
pub fn resolve_etcd_binary(
    etcd_bin: Option<&OsStr>,
    path: Option<&OsStr>,
) -> Result<PathBuf, HarnessError> {
    let search = |name: &OsStr| -> Option<PathBuf> {
        std::env::split_paths(path?)
            .map(|dir| dir.join(name))
            .find(|candidate| is_executable(candidate))
    };
    match etcd_bin.filter(|b| !b.is_empty()) {
        Some(bin) if Path::new(bin).components().count() > 1 => {
            let bin = PathBuf::from(bin);
            if is_executable(&bin) {
                Ok(bin)
            } else {
                Err(HarnessError::EtcdNotFound {
                    detail: format!("ETCD_BIN={} is not an executable file", bin.display()),
                })
            }
        }
        Some(name) => search(name).ok_or_else(|| HarnessError::EtcdNotFound {
            detail: format!("ETCD_BIN={} was not found on PATH", name.to_string_lossy()),
        }),
        None => search(OsStr::new("etcd")).ok_or_else(|| HarnessError::EtcdNotFound {
            detail: "ETCD_BIN is not set and `etcd` is not on PATH".into(),
        }),
    }
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Ports handed out in this process, so that concurrent starts never pick the same one.
fn reserved_ports() -> &'static Mutex<HashSet<u16>> {
    static PORTS: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    PORTS.get_or_init(Default::default)
}

/// Picks `n` distinct free loopback ports (bind to port 0, read the port, release it).
fn pick_ports(n: usize) -> Result<Vec<u16>, HarnessError> {
    let mut reserved = lock(reserved_ports());
    // Keep every probe socket bound until all ports are chosen so none is handed out twice.
    let mut probes = Vec::new();
    let mut ports = Vec::with_capacity(n);
    while ports.len() < n {
        if probes.len() > 50 * n + 50 {
            return Err(HarnessError::Config(
                "could not find free loopback ports".into(),
            ));
        }
        let probe = TcpListener::bind(("127.0.0.1", 0))
            .map_err(|e| HarnessError::io("binding a probe socket on 127.0.0.1", e))?;
        let port = probe
            .local_addr()
            .map_err(|e| HarnessError::io("reading a probe socket's port", e))?
            .port();
        if reserved.insert(port) {
            ports.push(port);
        }
        probes.push(probe);
    }
    Ok(ports)
}

/// Removes temporary directories left behind by test processes that died without cleaning up
/// (e.g. on Ctrl-C, which skips destructors and `atexit`; their etcd died with them thanks to
/// PR_SET_PDEATHSIG). Directory names carry the creating pid; only directories whose process
/// no longer exists are removed. Runs once per root per process.
fn sweep_stale_dirs(root: &Path) {
    static SWEPT: OnceLock<Mutex<HashSet<PathBuf>>> = OnceLock::new();
    if !lock(SWEPT.get_or_init(Default::default)).insert(root.to_path_buf()) {
        return;
    }
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(DIR_PREFIX))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        if pid <= 0 || pid as u32 == std::process::id() {
            continue;
        }
        // SAFETY: signal 0 only checks whether the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone && entry.path().join(LOG_FILE).is_file() {
            tracing::debug!(dir = %entry.path().display(), "removing stale etcd directory");
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

fn log_tail(path: &Path) -> String {
    let read = || -> io::Result<String> {
        let mut file = File::open(path)?;
        let len = file.metadata()?.len();
        file.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        let text = String::from_utf8_lossy(&bytes);
        let lines: Vec<&str> = text.lines().collect();
        Ok(lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n"))
    };
    read().unwrap_or_else(|e| format!("<cannot read {}: {e}>", path.display()))
}

async fn connect(endpoints: &[String], timeout: Option<Duration>) -> Result<Client, HarnessError> {
    let mut options = ConnectOptions::new().with_connect_timeout(Duration::from_secs(2));
    if let Some(timeout) = timeout {
        options = options.with_timeout(timeout);
    }
    Client::connect(endpoints, Some(options))
        .await
        .map_err(|source| HarnessError::Connect {
            endpoints: endpoints.to_vec(),
            source,
        })
}

/// One readiness probe: the member answers `status`, and with `need_leader` it also knows a
/// leader and serves a linearizable read.
async fn probe(endpoint: &str, need_leader: bool) -> Result<(), String> {
    let endpoints = [endpoint.to_string()];
    let mut client = connect(&endpoints, Some(Duration::from_secs(2)))
        .await
        .map_err(|e| e.to_string())?;
    let status = client.status().await.map_err(|e| e.to_string())?;
    if need_leader {
        if status.leader() == 0 {
            return Err("no leader elected yet".into());
        }
        client
            .get(READINESS_KEY, None)
            .await
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Members

#[derive(Debug, Default)]
struct ProcState {
    child: Option<Child>,
    paused: bool,
}

/// One etcd process of an [`EtcdServer`] or [`EtcdCluster`]: fixed ports, a private temporary
/// directory holding the data directory and the log, and the process if it is running.
#[derive(Debug)]
pub struct EtcdMember {
    name: String,
    endpoint: String,
    ports: [u16; 2],
    bin: PathBuf,
    args: Vec<OsString>,
    data_dir: PathBuf,
    log: PathBuf,
    state: Mutex<ProcState>,
    // Declared last: removed only after `Drop::drop` has killed the process.
    dir: TempDir,
}

impl EtcdMember {
    fn new(
        bin: &Path,
        options: &ServerOptions,
        name: String,
        client_port: u16,
        peer_port: u16,
        initial_cluster: &str,
        token: &str,
    ) -> Result<Self, HarnessError> {
        let root = options.data_root.clone().unwrap_or_else(std::env::temp_dir);
        sweep_stale_dirs(&root);
        let dir = tempfile::Builder::new()
            .prefix(&format!("{DIR_PREFIX}{}-", std::process::id()))
            .tempdir_in(&root)
            .map_err(|e| {
                HarnessError::io(
                    format!("creating a temporary directory in {}", root.display()),
                    e,
                )
            })?;
        let data_dir = dir.path().join(DATA_SUBDIR);
        let endpoint = format!("http://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let mut args: Vec<OsString> = vec![
            format!("--name={name}").into(),
            OsString::from("--data-dir="),
            format!("--listen-client-urls={endpoint}").into(),
            format!("--advertise-client-urls={endpoint}").into(),
            format!("--listen-peer-urls={peer}").into(),
            format!("--initial-advertise-peer-urls={peer}").into(),
            format!("--initial-cluster={initial_cluster}").into(),
            format!("--initial-cluster-token={token}").into(),
            "--initial-cluster-state=new".into(),
            "--logger=zap".into(),
            "--log-outputs=stderr".into(),
            "--log-level=warn".into(),
        ];
        args[1].push(&data_dir);
        args.extend(options.extra_args.iter().map(OsString::from));
        Ok(EtcdMember {
            name,
            endpoint,
            ports: [client_port, peer_port],
            bin: bin.to_path_buf(),
            args,
            log: dir.path().join(LOG_FILE),
            data_dir,
            state: Mutex::default(),
            dir,
        })
    }

    /// The member name (`--name`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The client URL, `http://127.0.0.1:PORT`; stable across restarts.
    pub fn endpoint(&self) -> String {
        self.endpoint.clone()
    }

    /// The etcd data directory (`--data-dir`) inside the member's temporary directory.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The file receiving etcd's stdout and stderr.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The last lines of the log file.
    pub fn log_tail(&self) -> String {
        log_tail(&self.log)
    }

    /// The process id while the process is running (or paused).
    pub fn pid(&self) -> Option<u32> {
        lock(&self.state).child.as_ref().map(Child::id)
    }

    /// Whether the process is running (a paused process counts as running). Reaps it if it
    /// exited on its own.
    pub fn is_running(&self) -> bool {
        let mut state = lock(&self.state);
        let exited = match state.child.as_mut() {
            None => return false,
            Some(child) => !matches!(child.try_wait(), Ok(None)),
        };
        if exited {
            *state = ProcState::default();
        }
        !exited
    }

    /// Whether the process is stopped with [`pause`](Self::pause).
    pub fn is_paused(&self) -> bool {
        let state = lock(&self.state);
        state.child.is_some() && state.paused
    }

    /// A client for this member only.
    ///
    /// # Panics
    /// If the client cannot be created; see [`try_client`](Self::try_client).
    pub async fn client(&self) -> Client {
        self.try_client()
            .await
            .expect("connecting to the etcd member")
    }

    /// A client for this member only.
    pub async fn try_client(&self) -> Result<Client, HarnessError> {
        connect(std::slice::from_ref(&self.endpoint), None).await
    }

    /// Stops the process: SIGTERM, then SIGKILL if it is still running after 5 s. Data is kept.
    /// Does nothing if it is not running.
    pub async fn stop(&self) -> Result<(), HarnessError> {
        {
            let state = lock(&self.state);
            let Some(child) = state.child.as_ref() else {
                return Ok(());
            };
            let _ = send_signal(child, libc::SIGTERM);
            // A paused process handles SIGTERM only once continued.
            let _ = send_signal(child, libc::SIGCONT);
        }
        let deadline = Instant::now() + STOP_GRACE;
        loop {
            {
                let mut state = lock(&self.state);
                let Some(child) = state.child.as_mut() else {
                    return Ok(());
                };
                match child.try_wait() {
                    Ok(Some(_)) => {
                        *state = ProcState::default();
                        return Ok(());
                    }
                    Ok(None) => {}
                    Err(e) => {
                        return Err(HarnessError::io(
                            format!("waiting for etcd at {}", self.endpoint),
                            e,
                        ))
                    }
                }
            }
            if Instant::now() >= deadline {
                tracing::warn!(endpoint = %self.endpoint, "etcd ignored SIGTERM; sending SIGKILL");
                self.kill();
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Kills the process with SIGKILL and reaps it. Data is kept (etcd fsyncs its WAL). Does
    /// nothing if it is not running.
    pub fn kill(&self) {
        let mut state = lock(&self.state);
        Self::kill_locked(&mut state);
    }

    fn kill_locked(state: &mut ProcState) {
        if let Some(mut child) = state.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        state.paused = false;
    }

    /// Freezes the process with SIGSTOP: connections stay open but requests time out.
    pub fn pause(&self) -> Result<(), HarnessError> {
        self.signal_running(libc::SIGSTOP, true)
    }

    /// Continues a paused process with SIGCONT.
    pub fn resume(&self) -> Result<(), HarnessError> {
        self.signal_running(libc::SIGCONT, false)
    }

    fn signal_running(&self, signal: libc::c_int, paused: bool) -> Result<(), HarnessError> {
        let mut state = lock(&self.state);
        let child = state
            .child
            .as_ref()
            .ok_or_else(|| self.invalid("not running"))?;
        send_signal(child, signal)
            .map_err(|e| HarnessError::io(format!("signalling etcd at {}", self.endpoint), e))?;
        state.paused = paused;
        Ok(())
    }

    fn invalid(&self, state: &'static str) -> HarnessError {
        HarnessError::InvalidState {
            endpoint: self.endpoint.clone(),
            state,
        }
    }

    /// Deletes the data directory (the process must not be running).
    fn remove_data(&self) -> Result<(), HarnessError> {
        match std::fs::remove_dir_all(&self.data_dir) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(HarnessError::io(
                format!("removing {}", self.data_dir.display()),
                e,
            )),
            _ => Ok(()),
        }
    }

    /// Starts the process (it must not be running).
    fn spawn(&self) -> Result<(), HarnessError> {
        let mut state = lock(&self.state);
        if state.child.is_some() {
            return Err(self.invalid("already running"));
        }
        let open_log = || {
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.log)
                .map_err(|e| HarnessError::io(format!("opening {}", self.log.display()), e))
        };
        let (stdout, stderr) = (open_log()?, open_log()?);
        let mut cmd = Command::new(&self.bin);
        cmd.args(&self.args)
            .current_dir(self.dir.path())
            // Ours, not etcd's: etcd would warn about unknown ETCD_* variables.
            .env_remove("ETCD_BIN")
            .env_remove("ETCD_ENDPOINTS")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr);
        set_parent_death_signal(&mut cmd);
        let child = spawn_child(cmd).map_err(|source| HarnessError::Spawn {
            bin: self.bin.clone(),
            source,
        })?;
        tracing::debug!(endpoint = %self.endpoint, pid = child.id(), log = %self.log.display(), "started etcd");
        *state = ProcState {
            child: Some(child),
            paused: false,
        };
        Ok(())
    }

    /// The startup error if the process has exited (it is reaped).
    fn exit_error(&self) -> Option<HarnessError> {
        let mut state = lock(&self.state);
        let status = match state.child.as_mut()?.try_wait() {
            Ok(None) => return None,
            Ok(Some(status)) => status.to_string(),
            Err(e) => format!("unknown status ({e})"),
        };
        *state = ProcState::default();
        Some(HarnessError::Exited {
            bin: self.bin.clone(),
            endpoint: self.endpoint.clone(),
            status,
            log: self.log.clone(),
            log_tail: log_tail(&self.log),
        })
    }

    fn not_ready(&self, waited: Duration, last_error: String) -> HarnessError {
        HarnessError::NotReady {
            endpoint: self.endpoint.clone(),
            waited,
            last_error,
            log: self.log.clone(),
            log_tail: log_tail(&self.log),
        }
    }

    /// Starts the process again on the same ports and data directory and waits until it is
    /// ready; retries a few times if a port is briefly taken by someone else.
    async fn start_on_same_ports(&self, need_leader: bool) -> Result<(), HarnessError> {
        let mut attempt = 1;
        loop {
            self.spawn()?;
            match wait_ready(std::slice::from_ref(self), need_leader).await {
                Ok(()) => return Ok(()),
                Err(e) if e.is_addr_in_use() && attempt < RESTART_ATTEMPTS => {
                    tracing::debug!(endpoint = %self.endpoint, "port taken; retrying restart");
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                Err(e) => {
                    self.kill();
                    return Err(e);
                }
            }
        }
    }
}

impl Drop for EtcdMember {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        Self::kill_locked(state);
        let mut reserved = lock(reserved_ports());
        for port in self.ports {
            reserved.remove(&port);
        }
    }
}

/// Waits until every member answers (and, with `need_leader`, knows a leader and serves reads),
/// failing early if one exits.
async fn wait_ready(members: &[EtcdMember], need_leader: bool) -> Result<(), HarnessError> {
    let start = Instant::now();
    let mut ready = vec![false; members.len()];
    let mut last_error = (0, String::from("no attempt yet"));
    loop {
        for (i, member) in members.iter().enumerate() {
            if let Some(err) = member.exit_error() {
                return Err(err);
            }
            if !ready[i] {
                match probe(&member.endpoint, need_leader).await {
                    Ok(()) => ready[i] = true,
                    Err(e) => last_error = (i, e),
                }
            }
        }
        if ready.iter().all(|r| *r) {
            tracing::debug!(elapsed = ?start.elapsed(), "etcd ready");
            return Ok(());
        }
        if start.elapsed() >= READY_TIMEOUT {
            let (i, error) = last_error;
            return Err(members[i].not_ready(start.elapsed(), error));
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

static CLUSTER_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Starts `n` members forming a new cluster, with fresh ports on each attempt.
async fn start_members(
    n: usize,
    options: &ServerOptions,
    bin: &Path,
) -> Result<Vec<EtcdMember>, HarnessError> {
    if n == 0 {
        return Err(HarnessError::Config(
            "an etcd cluster needs at least one member".into(),
        ));
    }
    let mut attempt = 1;
    loop {
        let token = format!(
            "etcd-informer-{}-{}",
            std::process::id(),
            CLUSTER_COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let ports = pick_ports(2 * n)?;
        let initial_cluster = (0..n)
            .map(|i| format!("m{i}=http://127.0.0.1:{}", ports[2 * i + 1]))
            .collect::<Vec<_>>()
            .join(",");
        let members = (0..n)
            .map(|i| {
                EtcdMember::new(
                    bin,
                    options,
                    format!("m{i}"),
                    ports[2 * i],
                    ports[2 * i + 1],
                    &initial_cluster,
                    &token,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let started = match members.iter().try_for_each(EtcdMember::spawn) {
            Ok(()) => wait_ready(&members, true).await,
            Err(e) => Err(e),
        };
        match started {
            Ok(()) => return Ok(members),
            Err(e) if e.is_addr_in_use() && attempt < PORT_ATTEMPTS => {
                tracing::debug!(
                    attempt,
                    "etcd port taken meanwhile; retrying with new ports"
                );
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// EtcdServer

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
    member: EtcdMember,
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

    async fn start_with_bin(
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

// ---------------------------------------------------------------------------------------------
// EtcdCluster

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
    members: Vec<EtcdMember>,
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

// ---------------------------------------------------------------------------------------------
// Shared per-process etcd

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
