//! Per-handler delivery: each handler has its own buffer, drained by its own thread (a
//! [`ResourceEventHandler`]) or by its consumer (an [`EventStream`](super::EventStream)).

use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::task::{Context, Poll, Waker};
use std::thread::ThreadId;
use std::time::Duration;

use tokio::time::Instant;

use super::handler::{Event, ResourceEventHandler};
use crate::metrics::HandlerMetrics;

/// Capacity (in events) above which a drained backlog releases its memory.
const SHRINK_ABOVE: usize = 1024;

/// The registered handlers.
///
/// Invariant: `syncing` holds the ids of the listeners whose resync was due at the last resync
/// tick; only they receive `Sync` notifications.
pub(crate) struct Processor<T> {
    pub(crate) listeners: Vec<Arc<Listener<T>>>,
    pub(crate) syncing: Vec<u64>,
}

impl<T: Send + Sync + 'static> Processor<T> {
    pub(crate) fn distribute(&self, event: Event<T>, is_sync: bool) {
        for l in &self.listeners {
            if !is_sync || self.syncing.contains(&l.id) {
                l.push(event.clone());
            }
        }
    }
}

/// One registered handler: a buffer of events drained by a dedicated thread, or polled by an
/// event stream.
///
/// Invariants: `initial_pending` counts the initial adds queued for this handler and not yet
/// returned from (or taken from the stream); the handler is synced once its informer is and
/// this is zero. With `max_backlog`, the buffer holds at most `max(max_backlog, 4 × keys)`
/// events: past its threshold it is merged per key ([`compact`]). `Buffer::dispatching` is
/// true exactly while the thread has taken a notification and not yet come back for the next
/// one: once it is false with `stopped` set, the handler is never called again.
pub(crate) struct Listener<T> {
    pub(crate) id: u64,
    pub(crate) name: String,
    pub(crate) resync_period: Duration,
    next_resync: Mutex<Instant>,
    buf: Mutex<Buffer<T>>,
    ready: Condvar,
    /// Signalled when the thread finishes a notification while someone waits for that.
    idle: Condvar,
    /// The handler's thread, so that a wait for it is never made from that thread itself.
    thread: OnceLock<ThreadId>,
    initial_pending: AtomicUsize,
    delivered: AtomicU64,
    panics: AtomicU64,
    max_backlog: Option<usize>,
    metrics: HandlerMetrics,
}

struct Buffer<T> {
    queue: VecDeque<Event<T>>,
    /// The thread waits on the condvar and nobody has woken it yet.
    waiting: bool,
    /// The stream's consumer waits for an event.
    waker: Option<Waker>,
    /// Compact when the queue grows past this (only with `max_backlog`).
    compact_at: usize,
    stopped: bool,
    /// Deliver what is queued, then end the thread (or the stream).
    closing: bool,
    /// The thread is handling a notification.
    dispatching: bool,
    /// Callers of `stop_thread_and_wait` waiting for the notification in progress.
    waiters: usize,
}

impl<T> Buffer<T> {
    /// The next event, releasing the memory of a large drained backlog.
    fn pop(&mut self) -> Option<Event<T>> {
        let e = self.queue.pop_front()?;
        if self.queue.is_empty() && self.queue.capacity() > SHRINK_ABOVE {
            // The initial list fills every backlog; do not keep that memory.
            self.queue.shrink_to_fit();
        }
        Some(e)
    }
}

impl<T: Send + Sync + 'static> Listener<T> {
    /// A listener drained by [`poll_next`](Self::poll_next) rather than by a thread.
    pub(crate) fn new(
        id: u64,
        name: String,
        informer: &str,
        resync_period: Duration,
        max_backlog: Option<usize>,
    ) -> Arc<Self> {
        let metrics = HandlerMetrics::new(informer, &name);
        Arc::new(Listener {
            id,
            name,
            resync_period,
            next_resync: Mutex::new(Instant::now() + resync_period),
            buf: Mutex::new(Buffer {
                queue: VecDeque::new(),
                waiting: false,
                waker: None,
                compact_at: max_backlog.unwrap_or(usize::MAX),
                stopped: false,
                closing: false,
                dispatching: false,
                waiters: 0,
            }),
            ready: Condvar::new(),
            idle: Condvar::new(),
            thread: OnceLock::new(),
            initial_pending: AtomicUsize::new(0),
            delivered: AtomicU64::new(0),
            panics: AtomicU64::new(0),
            max_backlog,
            metrics,
        })
    }

    /// A listener whose thread calls `handler`; the thread ends when [`stop_thread`] or
    /// [`close`] is called.
    ///
    /// [`stop_thread`]: Self::stop_thread
    /// [`close`]: Self::close
    pub(crate) fn spawn(
        id: u64,
        name: String,
        informer: &str,
        handler: Arc<dyn ResourceEventHandler<T>>,
        resync_period: Duration,
        max_backlog: Option<usize>,
    ) -> std::io::Result<Arc<Self>> {
        let listener = Self::new(id, name, informer, resync_period, max_backlog);
        let this = listener.clone();
        let thread = std::thread::Builder::new()
            .name(format!("handler-{}", listener.name))
            .spawn(move || this.run(handler))?;
        let _ = listener.thread.set(thread.thread().id());
        Ok(listener)
    }

    fn run(&self, handler: Arc<dyn ResourceEventHandler<T>>) {
        let _ = self.thread.set(std::thread::current().id());
        let span = tracing::info_span!("handler", name = %self.name);
        let _enter = span.enter();
        let mut buf = self.lock();
        loop {
            // Back for the next notification: the previous one, if any, is done.
            if std::mem::take(&mut buf.dispatching) && buf.waiters > 0 {
                self.idle.notify_all();
            }
            if buf.stopped {
                return;
            }
            let Some(event) = buf.pop() else {
                if buf.closing {
                    return;
                }
                buf.waiting = true;
                buf = self.ready.wait(buf).unwrap_or_else(|e| e.into_inner());
                buf.waiting = false;
                continue;
            };
            self.metrics.backlog(buf.queue.len());
            buf.dispatching = true;
            drop(buf);
            if catch_unwind(AssertUnwindSafe(|| event.dispatch(&*handler))).is_err() {
                self.panics.fetch_add(1, Ordering::Relaxed);
                self.metrics.panics.increment(1);
                tracing::error!(
                    key = event.key(),
                    "event handler panicked; notification skipped"
                );
            }
            self.count_delivered(&event);
            buf = self.lock();
        }
    }

    /// The next event for a stream: `None` once the listener is stopped, or closed and drained.
    pub(crate) fn poll_next(&self, cx: &mut Context<'_>) -> Poll<Option<Event<T>>> {
        let mut buf = self.lock();
        if buf.stopped {
            return Poll::Ready(None);
        }
        if let Some(event) = buf.pop() {
            self.metrics.backlog(buf.queue.len());
            drop(buf);
            self.count_delivered(&event);
            return Poll::Ready(Some(event));
        }
        if buf.closing {
            return Poll::Ready(None);
        }
        match &mut buf.waker {
            Some(w) => w.clone_from(cx.waker()),
            None => buf.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

impl<T> Listener<T> {
    fn lock(&self) -> MutexGuard<'_, Buffer<T>> {
        self.buf.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts `event` as delivered.
    fn count_delivered(&self, event: &Event<T>) {
        self.delivered.fetch_add(1, Ordering::Relaxed);
        self.metrics.delivered.increment(1);
        if is_initial(event) {
            self.initial_pending.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Queues an event for the handler; never blocks on the handler.
    pub(crate) fn push(&self, event: Event<T>) {
        if is_initial(&event) {
            self.initial_pending.fetch_add(1, Ordering::AcqRel);
        }
        let mut buf = self.lock();
        if buf.stopped {
            return;
        }
        buf.queue.push_back(event);
        if buf.queue.len() > buf.compact_at {
            let removed_initial = compact(&mut buf.queue);
            self.initial_pending
                .fetch_sub(removed_initial, Ordering::AcqRel);
            let max = self.max_backlog.unwrap_or(usize::MAX);
            // Compacting costs a pass over the backlog, so wait for it to double before the next.
            buf.compact_at = max.max(buf.queue.len().saturating_mul(2));
            tracing::debug!(handler = %self.name, backlog = buf.queue.len(), "handler backlog compacted");
        }
        self.metrics.backlog(buf.queue.len());
        // Wake the thread only if it sleeps and nobody woke it yet: each wake is a futex
        // syscall, most of the cost of delivering to a busy handler.
        let wake = std::mem::replace(&mut buf.waiting, false);
        let waker = buf.waker.take();
        drop(buf);
        if wake {
            self.ready.notify_one();
        }
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// Ends the thread (or the stream) once every queued notification is delivered.
    pub(crate) fn close(&self) {
        let mut buf = self.lock();
        buf.closing = true;
        let waker = buf.waker.take();
        drop(buf);
        self.ready.notify_all();
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// Ends the thread after the notification it is handling (or the stream at once); queued
    /// ones are dropped.
    pub(crate) fn stop_thread(&self) {
        let mut buf = self.lock();
        buf.stopped = true;
        buf.queue.clear();
        let waker = buf.waker.take();
        drop(buf);
        self.metrics.backlog(0);
        self.ready.notify_all();
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// [`stop_thread`](Self::stop_thread), then waits until the handler can no longer be
    /// called: until it returns from the notification in progress, if any, for at most
    /// `patience`. Called from the handler's own thread it does not wait (the notification in
    /// progress is the caller's own, and the thread stops once it returns). Returns whether
    /// the handler is known to be idle.
    pub(crate) fn stop_thread_and_wait(&self, patience: Duration) -> bool {
        self.stop_thread();
        if self.thread.get() == Some(&std::thread::current().id()) {
            return false;
        }
        let deadline = std::time::Instant::now() + patience;
        let mut buf = self.lock();
        buf.waiters += 1;
        while buf.dispatching {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            buf = self
                .idle
                .wait_timeout(buf, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        buf.waiters -= 1;
        let idle = !buf.dispatching;
        drop(buf);
        if !idle {
            tracing::warn!(
                handler = %self.name,
                waited = ?patience,
                "handler removed while still handling a notification"
            );
        }
        idle
    }

    pub(crate) fn initial_delivered(&self) -> bool {
        self.initial_pending.load(Ordering::Acquire) == 0
    }

    pub(crate) fn backlog(&self) -> usize {
        self.lock().queue.len()
    }

    pub(crate) fn delivered(&self) -> u64 {
        self.delivered.load(Ordering::Relaxed)
    }

    pub(crate) fn panics(&self) -> u64 {
        self.panics.load(Ordering::Relaxed)
    }

    /// Whether this handler's resync is due at `now`; if so, schedules the next one.
    pub(crate) fn take_resync(&self, now: Instant) -> bool {
        if self.resync_period.is_zero() {
            return false;
        }
        let mut next = self.next_resync.lock().unwrap_or_else(|e| e.into_inner());
        if *next > now {
            return false;
        }
        // Advance on the fixed schedule the resync ticker keeps: measuring from `now`, which is
        // always a little after the tick, would make every other tick look early.
        while *next <= now {
            *next += self.resync_period;
        }
        true
    }
}

fn is_initial<T>(event: &Event<T>) -> bool {
    matches!(
        event,
        Event::Added {
            is_in_initial_list: true,
            ..
        }
    )
}

/// Merges the backlog per key so that it holds at most two events per key (a delete then a
/// re-add), keeping each key's events in order and its final state exact. Returns how many
/// initial adds were dropped (an add followed by a delete the handler never needs to see).
fn compact<T>(queue: &mut VecDeque<Event<T>>) -> usize {
    let mut slots: Vec<Vec<Event<T>>> = Vec::new();
    let mut by_key: HashMap<Arc<str>, usize> = HashMap::new();
    let mut removed_initial = 0;
    for event in queue.drain(..) {
        let key = match &event {
            Event::Added { object, .. } => object.shared_key().clone(),
            Event::Updated { new, .. } => new.shared_key().clone(),
            Event::Deleted(d) => d.object().shared_key().clone(),
        };
        let slot = *by_key.entry(key).or_insert_with(|| {
            slots.push(Vec::new());
            slots.len() - 1
        });
        let events = &mut slots[slot];
        let merged = match (events.pop(), event) {
            (None, e) => vec![e],
            (
                Some(Event::Added {
                    is_in_initial_list, ..
                }),
                Event::Updated { new, .. },
            ) => {
                vec![Event::Added {
                    object: new,
                    is_in_initial_list,
                }]
            }
            (
                Some(Event::Added {
                    is_in_initial_list, ..
                }),
                Event::Deleted(_),
            ) => {
                removed_initial += usize::from(is_in_initial_list);
                vec![]
            }
            (Some(Event::Updated { old, .. }), Event::Updated { new, .. }) => {
                vec![Event::Updated { old, new }]
            }
            (Some(Event::Updated { .. }), Event::Deleted(d)) => vec![Event::Deleted(d)],
            (Some(prev), next) => vec![prev, next],
        };
        events.extend(merged);
    }
    queue.extend(slots.into_iter().flatten());
    removed_initial
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::informer::handler::DeletedObject;
    use crate::Object;

    fn o(key: &str, rev: i64) -> Arc<crate::Object<i64>> {
        Arc::new(Object::new(key, rev, rev))
    }

    #[test]
    fn stopping_waits_for_the_notification_in_progress_within_patience() {
        use crate::ResourceEventHandlerFuncs;
        use std::sync::atomic::AtomicBool;
        let release = Arc::new(AtomicBool::new(false));
        let entered = Arc::new(AtomicBool::new(false));
        let (r, e) = (release.clone(), entered.clone());
        let handler = ResourceEventHandlerFuncs::<i64>::new().on_add(move |_, _| {
            e.store(true, Ordering::SeqCst);
            while !r.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        let listener = Listener::spawn(0, "t".into(), "i", Arc::new(handler), Duration::ZERO, None)
            .expect("thread");
        listener.push(Event::Added {
            object: o("a", 1),
            is_in_initial_list: false,
        });
        while !entered.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        // Stuck past the patience: gives up, reporting the handler busy.
        assert!(!listener.stop_thread_and_wait(Duration::from_millis(20)));
        release.store(true, Ordering::SeqCst);
        // Once it returned, the wait succeeds.
        assert!(listener.stop_thread_and_wait(Duration::from_secs(10)));
        assert_eq!(listener.delivered(), 1);
    }

    #[test]
    fn compaction_keeps_every_final_state() {
        let mut q = VecDeque::from(vec![
            Event::Added {
                object: o("a", 1),
                is_in_initial_list: true,
            },
            Event::Updated {
                old: o("b", 1),
                new: o("b", 2),
            },
            Event::Updated {
                old: o("a", 1),
                new: o("a", 3),
            },
            Event::Updated {
                old: o("b", 2),
                new: o("b", 4),
            },
            Event::Added {
                object: o("c", 5),
                is_in_initial_list: false,
            },
            Event::Deleted(DeletedObject::Deleted(o("c", 5))),
            Event::Deleted(DeletedObject::Deleted(o("b", 4))),
            Event::Added {
                object: o("b", 9),
                is_in_initial_list: false,
            },
        ]);
        let removed = compact(&mut q);
        assert_eq!(removed, 0);
        let got: Vec<String> = q
            .iter()
            .map(|e| match e {
                Event::Added { object, .. } => {
                    format!("add {} {}", object.key(), object.mod_revision)
                }
                Event::Updated { old, new } => {
                    format!(
                        "update {} {}->{}",
                        new.key(),
                        old.mod_revision,
                        new.mod_revision
                    )
                }
                Event::Deleted(d) => format!("delete {} {}", d.key(), d.object().mod_revision),
            })
            .collect();
        assert_eq!(got, ["add a 3", "delete b 4", "add b 9"]);
    }
}
