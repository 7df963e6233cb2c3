//! Measurement helpers: medians and percentiles, RSS and CPU time, and the sinks that count
//! what a watch or a handler received.

use super::*;

pub(super) fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

pub(super) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

pub(super) fn round(x: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (x * f).round() / f
}

/// A size in this process's `/proc/self/status` (`field` with its colon), in bytes; 0 if
/// unknown.
fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Resident set size of this process, in bytes.
pub(super) fn rss_bytes() -> u64 {
    status_bytes("VmRSS:")
}

/// The most this process's resident set has grown to since [`reset_peak_rss`], in bytes
/// (`VmHWM`); 0 if unknown.
pub(super) fn peak_rss_bytes() -> u64 {
    status_bytes("VmHWM:")
}

/// Starts [`peak_rss_bytes`] over from the current resident set (Linux's `clear_refs`);
/// whether it could.
pub(super) fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// CPU time (user + system) used so far by a process (this one if `pid` is `None`), in seconds;
/// 0 if unknown.
pub(super) fn cpu_seconds(pid: Option<u32>) -> f64 {
    let path = match pid {
        Some(p) => format!("/proc/{p}/stat"),
        None => "/proc/self/stat".to_owned(),
    };
    let Ok(stat) = std::fs::read_to_string(path) else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // USER_HZ is 100 on Linux.
    (ticks(11) + ticks(12)) / 100.0
}

/// CPU used by this process and by etcd between two points.
#[derive(Clone, Copy)]
pub(super) struct CpuMark {
    pub(super) own: f64,
    pub(super) etcd: f64,
}

impl CpuMark {
    pub(super) fn now(etcd_pid: Option<u32>) -> CpuMark {
        CpuMark {
            own: cpu_seconds(None),
            etcd: etcd_pid.map_or(0.0, |p| cpu_seconds(Some(p))),
        }
    }

    /// (own, etcd) CPU microseconds per event since `self`.
    pub(super) fn per_event(&self, etcd_pid: Option<u32>, events: usize) -> (f64, f64) {
        let now = CpuMark::now(etcd_pid);
        (
            (now.own - self.own) * 1e6 / events as f64,
            (now.etcd - self.etcd) * 1e6 / events as f64,
        )
    }
}

/// The name of the writers' threads, left out of [`ConsumerMark`].
pub(super) const WRITER_THREAD: &str = "bench-writer";

/// CPU time and voluntary context switches (a thread going to sleep, to be woken again) of
/// this process's threads other than the writers', per thread, read from `/proc/self/task`.
/// The scheduler's nanosecond run times make it steadier than the process's CPU ticks, and
/// the writers' CPU (most of the process's) no longer adds its noise to the consumer's.
pub(super) struct ConsumerMark {
    /// Thread id -> (name, CPU ns, voluntary switches).
    threads: HashMap<u32, (String, u64, u64)>,
}

/// What [`ConsumerMark::per_event`] measured: per event, the consumer's CPU and wake-ups, and
/// the same by thread name.
pub(super) struct ConsumerCost {
    pub(super) cpu_us: f64,
    pub(super) wakeups: f64,
    /// "name CPU us/wake-ups" per thread name, the costliest first.
    pub(super) by_thread: String,
}

impl ConsumerMark {
    pub(super) fn now() -> ConsumerMark {
        let mut threads = HashMap::new();
        let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
            return ConsumerMark { threads };
        };
        for entry in dir.flatten() {
            let Some(tid) = entry.file_name().to_str().and_then(|t| t.parse().ok()) else {
                continue;
            };
            let read = |f: &str| std::fs::read_to_string(entry.path().join(f)).unwrap_or_default();
            let name = read("comm").trim_end().to_owned();
            if name == WRITER_THREAD {
                continue;
            }
            let cpu_ns = read("schedstat")
                .split_whitespace()
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let switches = read("status")
                .lines()
                .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            threads.insert(tid, (name, cpu_ns, switches));
        }
        ConsumerMark { threads }
    }

    /// The consumer's cost per event since `self`, over the threads alive now (a thread
    /// started since counts whole; one that ended since is not counted).
    pub(super) fn per_event(&self, events: usize) -> ConsumerCost {
        let now = ConsumerMark::now();
        let n = events as f64;
        let mut by_name: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
        for (tid, (name, c, s)) in &now.threads {
            let (c0, s0) = self.threads.get(tid).map_or((0, 0), |(_, c, s)| (*c, *s));
            let entry = by_name.entry(name).or_default();
            entry.0 += c.saturating_sub(c0);
            entry.1 += s.saturating_sub(s0);
        }
        let mut named: Vec<_> = by_name.into_iter().collect();
        named.sort_by_key(|(_, (c, _))| std::cmp::Reverse(*c));
        ConsumerCost {
            cpu_us: named.iter().map(|(_, (c, _))| *c as f64).sum::<f64>() / 1e3 / n,
            wakeups: named.iter().map(|(_, (_, s))| *s as f64).sum::<f64>() / n,
            by_thread: named
                .iter()
                .filter(|(_, (c, _))| *c as f64 / 1e3 / n >= 0.05)
                .map(|(name, (c, s))| {
                    format!("{name} {:.1}/{:.2}", *c as f64 / 1e3 / n, *s as f64 / n)
                })
                .collect::<Vec<_>>()
                .join(", "),
        }
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub(super) fn trim_malloc() {
    extern "C" {
        fn malloc_trim(pad: usize) -> i32;
    }
    // SAFETY: glibc's malloc_trim only releases free memory back to the system.
    unsafe {
        malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub(super) fn trim_malloc() {}

/// The bytes the heap has handed out and not had back, chunk headers included (glibc's
/// `mallinfo2`, over every arena): unlike the RSS, it does not move with what the allocator
/// keeps cached or with the pages the kernel has not taken back. 0 if unknown.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub(super) fn heap_in_use() -> u64 {
    #[repr(C)]
    struct MallInfo2 {
        arena: usize,
        ordblks: usize,
        smblks: usize,
        hblks: usize,
        hblkhd: usize,
        usmblks: usize,
        fsmblks: usize,
        uordblks: usize,
        fordblks: usize,
        keepcost: usize,
    }
    extern "C" {
        fn mallinfo2() -> MallInfo2;
    }
    // SAFETY: glibc's mallinfo2 only reads the allocator's statistics.
    let info = unsafe { mallinfo2() };
    (info.uordblks + info.hblkhd) as u64
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub(super) fn heap_in_use() -> u64 {
    0
}

/// Counts the events a consumer receives and records when the last expected one arrived, and
/// optionally the arrival time of each sequence number (for latency).
pub(super) struct Sink {
    pub(super) target: usize,
    pub(super) count: AtomicUsize,
    pub(super) bad: AtomicUsize,
    pub(super) done_at: Mutex<Option<Instant>>,
    pub(super) done: Notify,
    pub(super) base: Instant,
    pub(super) seq_base: u64,
    /// Nanoseconds since `base` at which each sequence number arrived (0: not yet).
    pub(super) arrivals: Vec<AtomicU64>,
}

impl Sink {
    pub(super) fn new(target: usize, seq_base: u64, track: bool, base: Instant) -> Arc<Sink> {
        Arc::new(Sink {
            target,
            count: AtomicUsize::new(0),
            bad: AtomicUsize::new(0),
            done_at: Mutex::new(None),
            done: Notify::new(),
            base,
            seq_base,
            arrivals: if track {
                (0..target).map(|_| AtomicU64::new(0)).collect()
            } else {
                Vec::new()
            },
        })
    }

    pub(super) fn record(&self, cm: &ConfigMap) {
        let now = Instant::now();
        if !self.arrivals.is_empty() {
            match seq_of(cm).and_then(|s| s.checked_sub(self.seq_base)) {
                Some(i) if (i as usize) < self.arrivals.len() => {
                    let nanos = now.duration_since(self.base).as_nanos() as u64;
                    self.arrivals[i as usize].store(nanos.max(1), Ordering::Relaxed);
                }
                _ => {
                    self.bad.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            }
        }
        if self.count.fetch_add(1, Ordering::AcqRel) + 1 == self.target {
            *self.done_at.lock().unwrap_or_else(|e| e.into_inner()) = Some(now);
            self.done.notify_one();
        }
    }

    pub(super) fn count(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    pub(super) fn done_at(&self) -> Option<Instant> {
        *self.done_at.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until every expected event arrived, or fails loudly after `deadline`.
    pub(super) async fn wait(&self, what: &str, deadline: Duration) -> Instant {
        let waited = tokio::time::timeout(deadline, async {
            loop {
                if let Some(t) = self.done_at() {
                    return t;
                }
                let _ = tokio::time::timeout(Duration::from_millis(50), self.done.notified()).await;
            }
        })
        .await;
        match waited {
            Ok(t) => t,
            Err(_) => fail(format!(
                "{what}: only {} of {} events arrived within {:?} ({} unmatched)",
                self.count(),
                self.target,
                deadline,
                self.bad.load(Ordering::Relaxed)
            )),
        }
    }
}

/// Aborts a task when dropped.
pub(super) struct AbortOnDrop<T>(pub(super) tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Minor page faults of this process so far: first touches of memory, which a sync of N objects
/// pays about N × object size / 4 KiB times unless the allocator reuses memory freed before.
pub(super) fn minor_faults() -> i64 {
    // SAFETY: getrusage only writes the struct it is given.
    unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut usage) != 0 {
            return 0;
        }
        usage.ru_minflt
    }
}

/// etcd's `etcd_network_client_grpc_sent_bytes_total`, read from its `/metrics` over plain
/// HTTP/1.0 (no HTTP client dependency for one counter).
pub(super) fn etcd_sent_bytes(endpoint: &str) -> f64 {
    use std::io::{Read, Write};
    let addr = endpoint
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned();
    let mut stream = std::net::TcpStream::connect(&addr)
        .unwrap_or_else(|e| fail(format!("metrics of etcd at {addr}: {e}")));
    let _ = write!(
        stream,
        "GET /metrics HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    );
    let mut body = String::new();
    let _ = stream.read_to_string(&mut body);
    body.lines()
        .filter(|l| l.starts_with("etcd_network_client_grpc_sent_bytes_total"))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .sum()
}
