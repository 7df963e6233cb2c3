//! Per-handler delivery. Each handler has its own buffer. Handlers that keep up share one
//! delivery thread per informer (a [`Worker`]): one wake-up per event for all of them rather than
//! one per handler, which on a small machine is most of what fanout costs. A handler that holds
//! the others back keeps that thread to itself and the others move to a new one: one that takes
//! longer than [`STUCK_AFTER`] over one notification, or one that took most of the thread's
//! time for [`STUCK_AFTER`] while another handler had notifications waiting (a handler a little
//! slower than the rest, call after call). So a slow or stuck handler delays the others by about
//! [`STUCK_AFTER`], once, whatever its speed. An [`EventStream`](super::EventStream) drains its
//! buffer itself, with no thread. An inline handler is called as each notification is
//! distributed, on the informer's own task, with neither.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll, Waker};
use std::thread::ThreadId;
use std::time::Duration;

use tokio::time::Instant;

use super::backlog::{compact, is_initial, Arrivals};
use super::handler::{Event, ResourceEventHandler};
use super::watchdog::{watchdog, Watched, STUCK_AFTER};
use crate::metrics::HandlerMetrics;
use crate::sync::lock;

thread_local! {
    /// The informer whose inline handler this thread is calling (0: none).
    static IN_INLINE_HANDLER: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Panics, naming `what`, if this thread is in an inline handler of the informer `owner`:
/// `what` waits for that handler to return, which would never happen. The handler's panic is
/// caught and logged like any other, so a mistake shows instead of stalling the cache.
pub(crate) fn refuse_in_inline_handler(owner: usize, what: &str) {
    if IN_INLINE_HANDLER.with(std::cell::Cell::get) == owner {
        panic!("an inline event handler called {what} of its own informer, which waits for the handler to return; it may only read the cache (see add_inline_event_handler)");
    }
}

/// Capacity (in events) above which a drained backlog releases its memory.
const SHRINK_ABOVE: usize = 1024;

/// Records the handlers due at a resync tick in `syncing`. While an earlier resync may still be
/// queued (`drained` false), the set grows instead of being replaced: the queue merges resyncs
/// into one, so a handler due at the earlier tick and not at this one would otherwise never get
/// the resync it was due (correctness review, finding 5). A handler may then get one a tick
/// early; none misses one.
pub(crate) fn merge_due(syncing: &mut Vec<u64>, due: Vec<u64>, drained: bool) {
    if drained {
        *syncing = due;
        return;
    }
    for id in due {
        if !syncing.contains(&id) {
            syncing.push(id);
        }
    }
}

/// The registered handlers.
///
/// Invariant: `syncing` holds the ids of the listeners whose resync was due at the last resync
/// tick; only they receive `Sync` notifications.
pub(crate) struct Processor<T> {
    pub(crate) listeners: Vec<Arc<Listener<T>>>,
    pub(crate) syncing: Vec<u64>,
    /// The thread shared by the handlers that keep up, once a handler is registered.
    pool: Arc<PoolSlot<T>>,
}

impl<T: Send + Sync + 'static> Processor<T> {
    /// No handlers yet; the shared thread is named after `informer`.
    pub(crate) fn new(informer: &str) -> Self {
        Processor {
            listeners: Vec::new(),
            syncing: Vec::new(),
            pool: Arc::new(PoolSlot {
                name: format!("handlers-{informer}"),
                worker: Mutex::new(None),
            }),
        }
    }

    pub(crate) fn distribute(
        &self,
        event: Event<T>,
        is_sync: bool,
        applied: Option<std::time::Instant>,
    ) {
        // Queue for everyone first, then wake each thread once.
        let mut wake: Option<Arc<Worker<T>>> = None;
        let mut more: Vec<Arc<Worker<T>>> = Vec::new();
        for l in &self.listeners {
            if is_sync && !self.syncing.contains(&l.id) {
                continue;
            }
            if let Some(worker) = l.push_quietly(event.clone(), applied) {
                match &wake {
                    Some(w) if Arc::ptr_eq(w, &worker) => {}
                    None => wake = Some(worker),
                    Some(_) => {
                        if !more.iter().any(|w| Arc::ptr_eq(w, &worker)) {
                            more.push(worker);
                        }
                    }
                }
            }
        }
        for w in wake.iter().chain(&more) {
            w.kick();
        }
    }

    /// Registers a handler on the shared thread (started with the first handler).
    pub(crate) fn attach(
        &self,
        listener: &Arc<Listener<T>>,
        handler: Arc<dyn ResourceEventHandler<T>>,
    ) -> std::io::Result<()> {
        listener.lock().handler = Some(handler);
        self.pool.join(listener)
    }
}

impl<T> Processor<T> {
    /// Lets the shared thread end once its handlers are gone.
    pub(crate) fn shutdown(&self) {
        let worker = lock(&self.pool.worker).take();
        if let Some(worker) = worker {
            worker.lock().shutdown = true;
            worker.kick();
        }
    }
}

/// Which worker is the shared one (it changes when a handler gets stuck on it).
struct PoolSlot<T> {
    name: String,
    worker: Mutex<Option<Arc<Worker<T>>>>,
}

impl<T: Send + Sync + 'static> PoolSlot<T> {
    fn current(self: &Arc<Self>) -> std::io::Result<Arc<Worker<T>>> {
        let mut slot = lock(&self.worker);
        if let Some(worker) = &*slot {
            return Ok(worker.clone());
        }
        let worker = Worker::start(self.name.clone(), Vec::new(), Arc::downgrade(self))?;
        *slot = Some(worker.clone());
        Ok(worker)
    }

    fn join(self: &Arc<Self>, listener: &Arc<Listener<T>>) -> std::io::Result<()> {
        loop {
            let worker = self.current()?;
            let mut state = worker.lock();
            if state.dedicated || state.shutdown {
                // Raced with the watchdog moving the pool; the slot points elsewhere now.
                drop(state);
                std::thread::yield_now();
                continue;
            }
            *lock(&listener.worker) = Some(worker.clone());
            state.members.push(listener.clone());
            drop(state);
            worker.kick();
            return Ok(());
        }
    }
}

/// A delivery thread and the handlers it serves, one notification at a time, in turn.
///
/// Invariants: a listener is a member of at most one worker, and only its worker dispatches
/// its events, so each handler sees its events in order. `busy` names the member being
/// dispatched; that member never moves to another worker.
pub(crate) struct Worker<T> {
    state: Mutex<WorkerState<T>>,
    ready: Condvar,
    /// The slot this worker may be the shared worker of, to hand that role over.
    pool: Weak<PoolSlot<T>>,
    name: String,
}

struct WorkerState<T> {
    members: Vec<Arc<Listener<T>>>,
    /// Where the next scan for work starts (round robin).
    next: usize,
    sleeping: bool,
    busy: Option<(u64, std::time::Instant)>,
    /// The member that took most of the thread's time while others waited, and for how many
    /// watchdog looks in a row.
    hogging: Option<(u64, u32)>,
    /// Serves the one handler that got stuck on it; ends with it.
    dedicated: bool,
    /// No handler joins any more: end once the members are gone.
    shutdown: bool,
}

impl<T: Send + Sync + 'static> Worker<T> {
    fn start(
        name: String,
        members: Vec<Arc<Listener<T>>>,
        pool: Weak<PoolSlot<T>>,
    ) -> std::io::Result<Arc<Self>> {
        let worker = Arc::new(Worker {
            state: Mutex::new(WorkerState {
                members,
                next: 0,
                sleeping: false,
                busy: None,
                hogging: None,
                dedicated: false,
                shutdown: false,
            }),
            ready: Condvar::new(),
            pool,
            name: name.clone(),
        });
        let this = worker.clone();
        std::thread::Builder::new()
            .name(name)
            .spawn(move || this.run())?;
        watchdog().watch(Arc::downgrade(&worker) as Weak<dyn Watched>);
        Ok(worker)
    }

    fn run(self: Arc<Self>) {
        let span = tracing::info_span!("handlers", thread = %self.name);
        let _enter = span.enter();
        let me = std::thread::current().id();
        let mut finished = Vec::new();
        let mut state = self.lock();
        loop {
            let picked = Self::pick(&mut state, me, &mut finished);
            if !finished.is_empty() {
                // Dropping a handler may run any code (even drop its informer): not under the lock.
                drop(state);
                finished.clear();
                state = self.lock();
                continue;
            }
            let Some((listener, event, handler)) = picked else {
                if state.members.is_empty() && (state.dedicated || state.shutdown) {
                    return;
                }
                state.sleeping = true;
                state = self.ready.wait(state).unwrap_or_else(|e| e.into_inner());
                state.sleeping = false;
                continue;
            };
            let started = std::time::Instant::now();
            state.busy = Some((listener.id, started));
            drop(state);
            listener.deliver(event, &*handler);
            drop(handler);
            listener
                .spent_nanos
                .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            state = self.lock();
            state.busy = None;
        }
    }

    /// The next notification, taking the members in turn. A member that has ended is removed
    /// and its handler put in `finished`, and the scan stops there (to drop it unlocked).
    #[allow(clippy::type_complexity)]
    fn pick(
        state: &mut WorkerState<T>,
        me: ThreadId,
        finished: &mut Vec<Arc<dyn ResourceEventHandler<T>>>,
    ) -> Option<(Arc<Listener<T>>, Event<T>, Arc<dyn ResourceEventHandler<T>>)> {
        let mut scanned = 0;
        while scanned < state.members.len() {
            let i = state.next % state.members.len();
            let listener = state.members[i].clone();
            match listener.take_next(me) {
                Take::Event(event, handler) => {
                    state.next = i + 1;
                    return Some((listener, event, handler));
                }
                Take::Empty => {
                    state.next = i + 1;
                    scanned += 1;
                }
                Take::Gone(handler) => {
                    state.members.remove(i);
                    *lock(&listener.worker) = None;
                    finished.extend(handler);
                    return None;
                }
            }
        }
        None
    }
}

impl<T> Worker<T> {
    fn lock(&self) -> MutexGuard<'_, WorkerState<T>> {
        lock(&self.state)
    }

    /// Wakes the thread if it sleeps (each wake is a futex call: skip it when busy).
    fn kick(&self) {
        let mut state = self.lock();
        if std::mem::take(&mut state.sleeping) {
            self.ready.notify_one();
        }
    }
}

/// What a worker can do for one member.
enum Take<T> {
    Event(Event<T>, Arc<dyn ResourceEventHandler<T>>),
    Empty,
    /// Stopped, or closed and drained: its handler, to drop.
    Gone(Option<Arc<dyn ResourceEventHandler<T>>>),
}

impl<T: Send + Sync + 'static> Worker<T> {
    /// The member that holds the others back, if one does: one busy in a single notification
    /// since before `stuck_since`, or one that took most of the thread's time since the last
    /// look, while another member had notifications waiting, for [`STUCK_AFTER`] in a row.
    /// Only the member being dispatched (or, when none is, any) can be named: the one being
    /// dispatched never moves.
    fn holding_back(state: &mut WorkerState<T>, stuck_since: std::time::Instant) -> Option<u64> {
        if let Some((busy, since)) = state.busy {
            if since <= stuck_since {
                return Some(busy);
            }
        }
        // Time each member spent in its handler since the last look; the call in progress
        // counts from its start or the last look, whichever is later.
        let now = std::time::Instant::now();
        let window_start = now.checked_sub(STUCK_AFTER / 2).unwrap_or(now);
        let spent: Vec<(u64, Duration)> = state
            .members
            .iter()
            .map(|l| {
                let mut d = Duration::from_nanos(l.spent_nanos.swap(0, Ordering::Relaxed));
                if let Some((_, since)) = state.busy.filter(|(busy, _)| *busy == l.id) {
                    d += now.duration_since(since.max(window_start));
                }
                (l.id, d)
            })
            .collect();
        let total: Duration = spent.iter().map(|(_, d)| *d).sum();
        let top = spent.iter().max_by_key(|(_, d)| *d).copied();
        let hog = top.filter(|(id, d)| {
            *d * 2 > total
                && *d >= STUCK_AFTER / 4
                && state.members.iter().any(|l| l.id != *id && l.backlog() > 0)
        });
        state.hogging = match (hog, state.hogging) {
            (Some((id, _)), Some((was, looks))) if id == was => Some((id, looks + 1)),
            (Some((id, _)), _) => Some((id, 1)),
            (None, _) => None,
        };
        let (id, looks) = state.hogging?;
        // The watchdog looks every STUCK_AFTER / 2.
        let movable = state.busy.is_none_or(|(busy, _)| busy == id);
        (looks >= 2 && movable).then_some(id)
    }
}

impl<T: Send + Sync + 'static> Watched for Worker<T> {
    fn check(&self, stuck_since: std::time::Instant) {
        let mut state = self.lock();
        if state.dedicated || state.members.len() < 2 {
            return;
        }
        let Some(busy) = Self::holding_back(&mut state, stuck_since) else {
            return;
        };
        let since = state
            .busy
            .map_or_else(std::time::Instant::now, |(_, since)| since);
        let (stuck, others): (Vec<_>, Vec<_>) = state.members.drain(..).partition(|l| l.id == busy);
        let name = stuck
            .first()
            .map_or_else(|| self.name.clone(), |l| format!("handler-{}", l.name));
        let moved = match Worker::start(self.name.clone(), others.clone(), self.pool.clone()) {
            Ok(worker) => worker,
            Err(e) => {
                // Keep everyone here; the next check tries again.
                tracing::warn!(error = %e, "cannot start a thread for the handlers of a stuck one");
                state.members = stuck.into_iter().chain(others).collect();
                return;
            }
        };
        state.members = stuck;
        state.dedicated = true;
        drop(state);
        tracing::warn!(
            handler = %name,
            stuck_for = ?since.elapsed(),
            moved = others.len(),
            "handler slow to return; the others moved to another thread"
        );
        for l in &others {
            *lock(&l.worker) = Some(moved.clone());
        }
        if let Some(pool) = self.pool.upgrade() {
            let mut slot = lock(&pool.worker);
            if slot
                .as_ref()
                .is_some_and(|w| std::ptr::eq(Arc::as_ptr(w), self))
            {
                *slot = Some(moved.clone());
            }
        }
        // Events may have been queued for the moved handlers while they were still here.
        moved.kick();
    }
}

/// One registered handler: a buffer of events drained by a worker thread, or polled by an
/// event stream.
///
/// Invariants: `initial_pending` counts the initial adds queued for this handler and not yet
/// returned from (or taken from the stream); the handler is synced once its informer is and
/// this is zero. With `max_backlog`, the buffer holds at most `max(max_backlog, 4 × keys)`
/// events: past its threshold it is merged per key ([`compact`]). `Buffer::dispatching` names
/// the thread handling a notification of this handler, from when it takes the notification
/// until it comes back for the next one: once it is `None` with `stopped` set, the handler is
/// never called again.
pub(crate) struct Listener<T> {
    pub(crate) id: u64,
    pub(crate) name: String,
    pub(crate) resync_period: Duration,
    next_resync: Mutex<Instant>,
    buf: Mutex<Buffer<T>>,
    /// Signalled when a notification finishes while someone waits for that.
    idle: Condvar,
    /// The worker that delivers to this handler (none for a stream, or once it has ended).
    worker: Mutex<Option<Arc<Worker<T>>>>,
    initial_pending: AtomicUsize,
    delivered: AtomicU64,
    /// Nanoseconds spent in the handler since its worker's watchdog last looked.
    spent_nanos: AtomicU64,
    panics: AtomicU64,
    max_backlog: Option<usize>,
    metrics: HandlerMetrics,
    /// A handler called as each notification is distributed, on the informer's own task:
    /// no buffer, no thread (see `add_inline_event_handler`).
    /// With the informer it belongs to (see [`refuse_in_inline_handler`]).
    inline: Option<(Arc<dyn ResourceEventHandler<T>>, usize)>,
}

struct Buffer<T> {
    queue: VecDeque<Event<T>>,
    /// When the queued events were applied to the cache (metrics only).
    arrivals: Arrivals,
    /// The handler a worker calls; dropped when the listener ends.
    handler: Option<Arc<dyn ResourceEventHandler<T>>>,
    /// The stream's consumer waits for an event.
    waker: Option<Waker>,
    /// Compact when the queue grows past this (only with `max_backlog`).
    compact_at: usize,
    stopped: bool,
    /// Deliver what is queued, then end.
    closing: bool,
    /// The thread handling a notification of this handler.
    dispatching: Option<ThreadId>,
    /// Callers of `stop_thread_and_wait` waiting for the notification in progress.
    waiters: usize,
}

impl<T> Buffer<T> {
    /// The next event, releasing the memory of a large drained backlog.
    fn pop(&mut self, metrics: &HandlerMetrics) -> Option<Event<T>> {
        let e = self.queue.pop_front()?;
        if crate::metrics::ENABLED {
            if let Some(applied) = self.arrivals.taken() {
                metrics
                    .cache_to_handler
                    .record(applied.elapsed().as_secs_f64());
            }
        }
        if self.queue.is_empty() && self.queue.capacity() > SHRINK_ABOVE {
            // The initial list fills every backlog; do not keep that memory.
            self.queue.shrink_to_fit();
        }
        Some(e)
    }
}

impl<T: Send + Sync + 'static> Listener<T> {
    /// A listener with no handler yet: drained by [`poll_next`](Self::poll_next), or by a
    /// worker once [`Processor::attach`]ed.
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
                arrivals: Arrivals::default(),
                handler: None,
                waker: None,
                compact_at: max_backlog.unwrap_or(usize::MAX),
                stopped: false,
                closing: false,
                dispatching: None,
                waiters: 0,
            }),
            idle: Condvar::new(),
            worker: Mutex::new(None),
            initial_pending: AtomicUsize::new(0),
            delivered: AtomicU64::new(0),
            spent_nanos: AtomicU64::new(0),
            panics: AtomicU64::new(0),
            max_backlog,
            metrics,
            inline: None,
        })
    }

    /// A listener that calls `handler` as each notification is distributed, on the
    /// distributing thread: nothing is queued, no thread wakes.
    /// `owner` identifies the informer (see [`refuse_in_inline_handler`]).
    pub(crate) fn inline(
        id: u64,
        name: String,
        informer: &str,
        resync_period: Duration,
        handler: Arc<dyn ResourceEventHandler<T>>,
        owner: usize,
    ) -> Arc<Self> {
        let mut listener = Arc::into_inner(Self::new(id, name, informer, resync_period, None))
            .expect("a listener just made has no other owner");
        listener.inline = Some((handler, owner));
        Arc::new(listener)
    }

    /// The next notification for the worker on thread `me`.
    fn take_next(&self, me: ThreadId) -> Take<T> {
        let mut buf = self.lock();
        if buf.stopped || (buf.closing && buf.queue.is_empty()) {
            return Take::Gone(buf.handler.take());
        }
        let Some(handler) = buf.handler.clone() else {
            return Take::Empty;
        };
        let Some(event) = buf.pop(&self.metrics) else {
            return Take::Empty;
        };
        self.metrics.backlog(buf.queue.len());
        buf.dispatching = Some(me);
        Take::Event(event, handler)
    }

    /// Calls the handler with `event` (taken by [`take_next`](Self::take_next)).
    fn deliver(&self, event: Event<T>, handler: &dyn ResourceEventHandler<T>) {
        self.call(&event, handler);
        self.count_delivered(&event);
        let mut buf = self.lock();
        buf.dispatching = None;
        if buf.waiters > 0 {
            self.idle.notify_all();
        }
    }

    /// Calls the handler with `event`, catching (and counting) a panic.
    fn call(&self, event: &Event<T>, handler: &dyn ResourceEventHandler<T>) {
        if catch_unwind(AssertUnwindSafe(|| event.dispatch(handler))).is_err() {
            self.panics.fetch_add(1, Ordering::Relaxed);
            self.metrics.panics.increment(1);
            tracing::error!(
                handler = %self.name,
                key = event.key(),
                "event handler panicked; notification skipped"
            );
        }
    }

    /// The next event for a stream: `None` once the listener is stopped, or closed and drained.
    pub(crate) fn poll_next(&self, cx: &mut Context<'_>) -> Poll<Option<Event<T>>> {
        let mut buf = self.lock();
        if buf.stopped {
            return Poll::Ready(None);
        }
        if let Some(event) = buf.pop(&self.metrics) {
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

    /// Queues events for the handler, then wakes whoever delivers them (once); never blocks on
    /// the handler.
    pub(crate) fn push_all(&self, events: impl IntoIterator<Item = Event<T>>) {
        let mut worker = None;
        for event in events {
            worker = self.push_quietly(event, None).or(worker);
        }
        if let Some(worker) = worker {
            worker.kick();
        }
    }

    /// Queues an event; returns the worker to wake, if any (a stream's consumer is woken here).
    fn push_quietly(
        &self,
        event: Event<T>,
        applied: Option<std::time::Instant>,
    ) -> Option<Arc<Worker<T>>> {
        if let Some((handler, owner)) = &self.inline {
            // Removing the listener from the processor waits for this call (both hold its
            // lock), so once removed it is never called again.
            let outer = IN_INLINE_HANDLER.with(|c| c.replace(*owner));
            self.call(&event, &**handler);
            IN_INLINE_HANDLER.with(|c| c.set(outer));
            self.delivered.fetch_add(1, Ordering::Relaxed);
            self.metrics.delivered.increment(1);
            return None;
        }
        if is_initial(&event) {
            self.initial_pending.fetch_add(1, Ordering::AcqRel);
        }
        let mut buf = self.lock();
        if buf.stopped {
            return None;
        }
        buf.queue.push_back(event);
        buf.arrivals.pushed(applied);
        if buf.queue.len() > buf.compact_at {
            let removed_initial = compact(&mut buf.queue);
            let left = buf.queue.len();
            buf.arrivals.shrunk(left);
            self.initial_pending
                .fetch_sub(removed_initial, Ordering::AcqRel);
            let max = self.max_backlog.unwrap_or(usize::MAX);
            // Compacting costs a pass over the backlog, so wait for it to double before the next.
            buf.compact_at = max.max(buf.queue.len().saturating_mul(2));
            tracing::debug!(handler = %self.name, backlog = buf.queue.len(), "handler backlog compacted");
        }
        self.metrics.backlog(buf.queue.len());
        let waker = buf.waker.take();
        drop(buf);
        if let Some(waker) = waker {
            waker.wake();
        }
        self.worker_handle()
    }

    /// [`stop_thread`](Self::stop_thread), then waits until the handler can no longer be
    /// called: until it returns from the notification in progress, if any, for at most
    /// `patience`. Called from within the handler itself it does not wait (the notification in
    /// progress is the caller's own, and it is the last). Returns whether the handler is known
    /// to be idle.
    pub(crate) fn stop_thread_and_wait(&self, patience: Duration) -> bool {
        self.stop_thread();
        let me = std::thread::current().id();
        let deadline = std::time::Instant::now() + patience;
        let mut buf = self.lock();
        if buf.dispatching == Some(me) {
            return false;
        }
        buf.waiters += 1;
        while buf.dispatching.is_some() {
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
        let idle = buf.dispatching.is_none();
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
}

impl<T> Listener<T> {
    fn worker_handle(&self) -> Option<Arc<Worker<T>>> {
        lock(&self.worker).clone()
    }

    /// Ends delivery (the thread's or the stream's) once every queued notification is delivered.
    pub(crate) fn close(&self) {
        let mut buf = self.lock();
        buf.closing = true;
        let waker = buf.waker.take();
        drop(buf);
        if let Some(waker) = waker {
            waker.wake();
        }
        if let Some(worker) = self.worker_handle() {
            worker.kick();
        }
    }

    /// Ends delivery after the notification in progress (or the stream at once); queued ones
    /// are dropped.
    pub(crate) fn stop_thread(&self) {
        let mut buf = self.lock();
        buf.stopped = true;
        buf.queue.clear();
        buf.arrivals.shrunk(0);
        let waker = buf.waker.take();
        drop(buf);
        self.metrics.backlog(0);
        if let Some(waker) = waker {
            waker.wake();
        }
        if let Some(worker) = self.worker_handle() {
            worker.kick();
        }
    }

    fn lock(&self) -> MutexGuard<'_, Buffer<T>> {
        lock(&self.buf)
    }

    /// Counts `event` as delivered.
    fn count_delivered(&self, event: &Event<T>) {
        self.delivered.fetch_add(1, Ordering::Relaxed);
        self.metrics.delivered.increment(1);
        if is_initial(event) {
            self.initial_pending.fetch_sub(1, Ordering::AcqRel);
        }
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
        let mut next = lock(&self.next_resync);
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

#[cfg(test)]
mod tests {
    #[test]
    fn a_resync_still_queued_keeps_every_handler_due_for_it() {
        // Tick 2: A (1 s) and B (2 s) are due; the resync is queued.
        let mut syncing = Vec::new();
        super::merge_due(&mut syncing, vec![1, 2], true);
        // Tick 3, the resync not popped yet: only A is due, B must stay.
        super::merge_due(&mut syncing, vec![1], false);
        assert_eq!(syncing, [1, 2]);
        // Once it was delivered, the next tick's set stands alone.
        super::merge_due(&mut syncing, vec![1], true);
        assert_eq!(syncing, [1]);
    }

    use super::*;

    use crate::object::Object;

    fn o(key: &str, rev: i64) -> Arc<crate::object::Object<i64>> {
        Arc::new(Object::new(key, rev, rev))
    }

    #[test]
    fn stopping_waits_for_the_notification_in_progress_within_patience() {
        use crate::informer::ResourceEventHandlerFuncs;
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
        let processor = Processor::new("i");
        let listener = Listener::new(0, "t".into(), "i", Duration::ZERO, None);
        processor
            .attach(&listener, Arc::new(handler))
            .expect("thread");
        listener.push_all([Event::Added {
            object: o("a", 1),
            is_in_initial_list: false,
        }]);
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
}
