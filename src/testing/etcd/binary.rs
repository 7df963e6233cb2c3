//! Finding the etcd binary, free ports, stale directories, log tails, and probing an endpoint.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};

use super::{lock, HarnessError, DIR_PREFIX, LOG_FILE, LOG_TAIL_LINES, READINESS_KEY};

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

pub(super) fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Ports handed out in this process, so that concurrent starts never pick the same one.
pub(super) fn reserved_ports() -> &'static Mutex<HashSet<u16>> {
    static PORTS: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    PORTS.get_or_init(Default::default)
}

/// Picks `n` distinct free loopback ports (bind to port 0, read the port, release it).
pub(super) fn pick_ports(n: usize) -> Result<Vec<u16>, HarnessError> {
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
pub(super) fn sweep_stale_dirs(root: &Path) {
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

pub(super) fn log_tail(path: &Path) -> String {
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

pub(super) async fn connect(
    endpoints: &[String],
    timeout: Option<Duration>,
) -> Result<Client, HarnessError> {
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
pub(super) async fn probe(endpoint: &str, need_leader: bool) -> Result<(), String> {
    let endpoints = [endpoint.to_string()];
    let mut client = connect(&endpoints, Some(Duration::from_secs(2)))
        .await
        .map_err(|e| e.to_string())?;
    let status = client.status().await.map_err(|e| e.to_string())?;
    if need_leader {
        if status.leader() == 0 {
            return Err("no leader elected yet".into());
        }
        match client.get(READINESS_KEY, None).await {
            Ok(_) => {}
            // Auth is on (a restarted member): etcd, with its leader, refused the user-less
            // read, which is an answer too.
            Err(e) if e.to_string().contains("user name is empty") => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(())
}
