//! One etcd process ([`EtcdMember`]) and starting a set of them as one cluster.

use std::ffi::OsString;
use std::fs::OpenOptions;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use etcd_client::Client;
use tempfile::TempDir;

use super::binary::{connect, log_tail, pick_ports, probe, reserved_ports, sweep_stale_dirs};
use super::spawn::{send_signal, set_parent_death_signal, spawn_child, wait_stopped};
use super::{
    lock, HarnessError, ServerOptions, DATA_SUBDIR, DIR_PREFIX, LOG_FILE, POLL_INTERVAL,
    PORT_ATTEMPTS, READY_TIMEOUT, RESTART_ATTEMPTS, STOP_GRACE,
};

#[derive(Debug, Default)]
pub(super) struct ProcState {
    pub(super) child: Option<Child>,
    pub(super) paused: bool,
}

/// One etcd process of an [`EtcdServer`](super::EtcdServer) or [`EtcdCluster`](super::EtcdCluster): fixed ports, a private temporary
/// directory holding the data directory and the log, and the process if it is running.
#[derive(Debug)]
pub struct EtcdMember {
    pub(super) name: String,
    pub(super) endpoint: String,
    pub(super) ports: [u16; 2],
    pub(super) bin: PathBuf,
    pub(super) args: Vec<OsString>,
    pub(super) data_dir: PathBuf,
    pub(super) log: PathBuf,
    pub(super) state: Mutex<ProcState>,
    // Declared last: removed only after `Drop::drop` has killed the process.
    pub(super) dir: TempDir,
}

impl EtcdMember {
    pub(super) fn new(
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

    /// etcd's `etcd_debugging_mvcc_watcher_total` gauge: the watches this member serves (read
    /// from its `/metrics` page, blocking, 1 s timeouts); `None` if it does not answer.
    pub fn watchers(&self) -> Option<u64> {
        watchers_at(&self.endpoint)
    }

    /// The sum of `metric`'s series on this member's `/metrics` page whose labels include
    /// each of `labels` (`name="value"`), read blocking with 1 s timeouts; `None` if it does
    /// not answer or has no such series.
    ///
    /// ```no_run
    /// # fn demo(member: &etcd_informer::testing::etcd::EtcdMember) {
    /// let ranges = member.metric("grpc_server_handled_total", &[r#"grpc_method="Range""#]);
    /// # }
    /// ```
    pub fn metric(&self, metric: &str, labels: &[&str]) -> Option<f64> {
        metric_at(&self.endpoint, metric, labels)
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

    pub(super) fn kill_locked(state: &mut ProcState) {
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

    pub(super) fn signal_running(
        &self,
        signal: libc::c_int,
        paused: bool,
    ) -> Result<(), HarnessError> {
        let mut state = lock(&self.state);
        let child = state
            .child
            .as_ref()
            .ok_or_else(|| self.invalid("not running"))?;
        send_signal(child, signal)
            .map_err(|e| HarnessError::io(format!("signalling etcd at {}", self.endpoint), e))?;
        if signal == libc::SIGSTOP {
            wait_stopped(child);
        }
        state.paused = paused;
        Ok(())
    }

    pub(super) fn invalid(&self, state: &'static str) -> HarnessError {
        HarnessError::InvalidState {
            endpoint: self.endpoint.clone(),
            state,
        }
    }

    /// Deletes the data directory (the process must not be running).
    pub(super) fn remove_data(&self) -> Result<(), HarnessError> {
        match std::fs::remove_dir_all(&self.data_dir) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(HarnessError::io(
                format!("removing {}", self.data_dir.display()),
                e,
            )),
            _ => Ok(()),
        }
    }

    /// Starts the process (it must not be running).
    pub(super) fn spawn(&self) -> Result<(), HarnessError> {
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
    pub(super) fn exit_error(&self) -> Option<HarnessError> {
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

    pub(super) fn not_ready(&self, waited: Duration, last_error: String) -> HarnessError {
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
    pub(super) async fn start_on_same_ports(&self, need_leader: bool) -> Result<(), HarnessError> {
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
pub(super) async fn wait_ready(
    members: &[EtcdMember],
    need_leader: bool,
) -> Result<(), HarnessError> {
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

pub(super) static CLUSTER_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Starts `n` members forming a new cluster, with fresh ports on each attempt.
pub(super) async fn start_members(
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

/// [`EtcdMember::watchers`] of the member at `endpoint` (`http://127.0.0.1:PORT`), with a bare
/// HTTP/1.0 request.
pub(super) fn watchers_at(endpoint: &str) -> Option<u64> {
    metric_at(endpoint, "etcd_debugging_mvcc_watcher_total", &[]).map(|n| n as u64)
}

/// The sum of every series of `metric` on `endpoint`'s `/metrics` page whose labels contain
/// each of `labels` (`name="value"`), blocking with 1 s timeouts; `None` if it does not answer
/// or has no such series.
fn metric_at(endpoint: &str, metric: &str, labels: &[&str]) -> Option<f64> {
    use std::io::{Read, Write};
    let addr: std::net::SocketAddr = endpoint.strip_prefix("http://")?.parse().ok()?;
    let timeout = Duration::from_secs(1);
    let mut conn = std::net::TcpStream::connect_timeout(&addr, timeout).ok()?;
    conn.set_read_timeout(Some(timeout)).ok()?;
    conn.set_write_timeout(Some(timeout)).ok()?;
    conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .ok()?;
    let mut page = String::new();
    conn.read_to_string(&mut page).ok()?;
    page.lines()
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let rest = series.strip_prefix(metric)?;
            let matches = (rest.is_empty() || rest.starts_with('{'))
                && labels.iter().all(|label| rest.contains(label));
            matches.then(|| value.parse::<f64>().ok()).flatten()
        })
        .fold(None, |sum, n| Some(sum.unwrap_or(0.0) + n))
}
