//! Spawning: every etcd is forked by one thread that lives as long as the process, so that
//! `PR_SET_PDEATHSIG` fires only when the process exits (see the parent module's docs).

use std::io;
use std::process::{Child, Command};
use std::sync::{mpsc, OnceLock};

pub(super) struct SpawnRequest {
    cmd: Command,
    reply: mpsc::SyncSender<io::Result<Child>>,
}

/// Spawns `cmd` from the process-wide spawner thread, which never exits (see the module docs).
pub(super) fn spawn_child(cmd: Command) -> io::Result<Child> {
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
pub(super) fn set_parent_death_signal(cmd: &mut Command) {
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
pub(super) fn set_parent_death_signal(_cmd: &mut Command) {}

pub(super) fn send_signal(child: &Child, signal: libc::c_int) -> io::Result<()> {
    let pid = libc::pid_t::try_from(child.id()).map_err(io::Error::other)?;
    // SAFETY: kill(2) has no memory-safety preconditions. The child has not been reaped (we hold
    // its handle and only reap through it), so the pid still names our child.
    if unsafe { libc::kill(pid, signal) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Waits (up to 2 s) until every thread of `child` is stopped: `kill(SIGSTOP)` returns before
/// the threads are, and a thread still running could answer one more request.
pub(super) fn wait_stopped(child: &Child) {
    let dir = format!("/proc/{}/task", child.id());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while std::time::Instant::now() < deadline {
        let Ok(tasks) = std::fs::read_dir(&dir) else {
            return;
        };
        let running = tasks.flatten().any(|task| {
            std::fs::read_to_string(task.path().join("stat"))
                .ok()
                // The state follows the parenthesized command name.
                .and_then(|stat| {
                    stat.rsplit_once(')')
                        .map(|(_, rest)| rest.trim_start().to_owned())
                })
                .is_some_and(|rest| !rest.starts_with('T') && !rest.starts_with('t'))
        });
        if !running {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}
