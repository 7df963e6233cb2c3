//! The handler watchdog: one process-wide thread that looks at every delivery worker each
//! [`STUCK_AFTER`] / 2 and has a worker move its other handlers away from one that holds them
//! back.

use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::Duration;

use crate::sync::lock;

/// How long one notification may take before the other handlers sharing its thread move to
/// another thread.
pub(crate) const STUCK_AFTER: Duration = Duration::from_millis(20);

/// A worker as the watchdog sees it.
pub(super) trait Watched: Send + Sync {
    /// Moves the other handlers off this worker if one has been stuck since before `deadline`.
    fn check(&self, stuck_since: std::time::Instant);
}

/// One process-wide thread that looks at every worker each [`STUCK_AFTER`] / 2.
pub(super) struct Watchdog {
    workers: Mutex<Vec<Weak<dyn Watched>>>,
    added: Condvar,
}

pub(super) fn watchdog() -> &'static Watchdog {
    static WATCHDOG: OnceLock<&'static Watchdog> = OnceLock::new();
    WATCHDOG.get_or_init(|| {
        let dog: &'static Watchdog = Box::leak(Box::new(Watchdog {
            workers: Mutex::new(Vec::new()),
            added: Condvar::new(),
        }));
        let started = std::thread::Builder::new()
            .name("handler-watchdog".into())
            .spawn(move || dog.run());
        if let Err(e) = started {
            tracing::error!(error = %e, "cannot start the handler watchdog; a stuck handler will delay the others");
        }
        dog
    })
}

impl Watchdog {
    pub(super) fn watch(&self, worker: Weak<dyn Watched>) {
        lock(&self.workers).push(worker);
        self.added.notify_one();
    }

    fn run(&self) {
        let mut workers = lock(&self.workers);
        loop {
            workers.retain(|w| w.strong_count() > 0);
            if workers.is_empty() {
                workers = self.added.wait(workers).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            let live: Vec<Arc<dyn Watched>> = workers.iter().filter_map(Weak::upgrade).collect();
            drop(workers);
            std::thread::sleep(STUCK_AFTER / 2);
            if let Some(stuck_since) = std::time::Instant::now().checked_sub(STUCK_AFTER) {
                for w in &live {
                    w.check(stuck_since);
                }
            }
            drop(live);
            workers = lock(&self.workers);
        }
    }
}
