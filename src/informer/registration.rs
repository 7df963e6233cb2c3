//! Handlers joining and leaving a running informer: [`HandlerRegistration`], the late
//! joiner's synthetic adds, resync periods, and removal that waits for a notification in
//! progress.

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::handler::{Event, ResourceEventHandler};
use super::processor::{refuse_in_inline_handler, Listener};
use super::shared_informer::{InformerError, Shared, SharedIndexInformer};
use crate::queue::clamp_resync;
use crate::sync::lock;

/// How long [`SharedIndexInformer::remove_event_handler`] waits at most for the handler to
/// return from a notification in progress.
pub const REMOVE_PATIENCE: Duration = Duration::from_secs(10);

/// A handle on a registered handler (client-go's `ResourceEventHandlerRegistration`).
pub struct HandlerRegistration<T> {
    pub(super) listener: Arc<Listener<T>>,
    pub(super) informer: Weak<Shared<T>>,
}

impl<T> fmt::Debug for HandlerRegistration<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerRegistration")
            .field("id", &self.listener.id)
            .field("name", &self.listener.name)
            .finish()
    }
}

impl<T: Send + Sync + 'static> HandlerRegistration<T> {
    /// Whether the informer has synced and this handler has received every initial add.
    pub fn has_synced(&self) -> bool {
        let owner = Weak::as_ptr(&self.informer) as *const () as usize;
        refuse_in_inline_handler(owner, "a registration's has_synced");
        self.informer
            .upgrade()
            .is_some_and(|s| s.queue.has_synced() && self.listener.initial_delivered())
    }

    /// Waits until [`has_synced`](Self::has_synced) (client-go's `WaitForCacheSync` given this
    /// registration): true once it is, false if the informer stops or is dropped first. Cancel
    /// it by dropping the future (under [`tokio::time::timeout`], say).
    ///
    /// ```no_run
    /// # async fn demo(informer: etcd_informer::SharedIndexInformer<String>) -> Result<(), Box<dyn std::error::Error>> {
    /// use etcd_informer::ResourceEventHandlerFuncs;
    /// let registration = informer.add_event_handler(
    ///     ResourceEventHandlerFuncs::new().on_add(|o, _| println!("created: {}", o.key())),
    /// )?;
    /// tokio::spawn(informer.clone().run());
    /// if !registration.wait_synced().await {
    ///     return Err("the informer stopped before this handler synced".into());
    /// }
    /// // Every object of the first list has reached the handler.
    /// # Ok(()) }
    /// ```
    pub async fn wait_synced(&self) -> bool {
        super::shared_informer::wait_until(|| {
            self.has_synced()
                || self
                    .informer
                    .upgrade()
                    .is_none_or(|s| s.stopped.load(Ordering::Acquire))
        })
        .await;
        self.has_synced()
    }

    /// Notifications queued for this handler and not yet delivered.
    pub fn backlog(&self) -> usize {
        self.listener.backlog()
    }

    /// Notifications delivered to this handler so far.
    pub fn delivered(&self) -> u64 {
        self.listener.delivered()
    }

    /// Notifications whose handling panicked.
    pub fn panics(&self) -> u64 {
        self.listener.panics()
    }

    /// The handler's resync period as in effect (zero: never): the one asked for, raised to
    /// [`MIN_RESYNC_PERIOD`](crate::queue::MIN_RESYNC_PERIOD), and, for a handler added once the informer ran, to its resync
    /// check period.
    pub fn resync_period(&self) -> Duration {
        self.listener.resync_period
    }
}

impl<T: Send + Sync + 'static> SharedIndexInformer<T> {
    /// Registers a handler with the informer's default resync period.
    pub fn add_event_handler(
        &self,
        handler: impl ResourceEventHandler<T>,
    ) -> Result<HandlerRegistration<T>, InformerError> {
        self.add_event_handler_with_resync(handler, self.shared.default_resync)
    }

    /// Registers a handler named `name` (in logs, its thread's name and its
    /// [metrics](crate::metrics)), with the informer's default resync period.
    pub fn add_named_event_handler(
        &self,
        name: impl Into<String>,
        handler: impl ResourceEventHandler<T>,
    ) -> Result<HandlerRegistration<T>, InformerError> {
        let period = self.resync_period_for(self.shared.default_resync);
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        self.spawn_handler(id, name.into(), handler, period)
    }

    /// Registers a handler named `name` that is called on the informer's own task as each
    /// change is applied, with no thread or buffer of its own: for a handler that only hands
    /// work off, such as a controller's that enqueues a key (the [runner](crate::runner)'s
    /// is one). It saves the wake-up of a delivery thread per event.
    ///
    /// It must return at once and never block: while it runs, the cache takes no change, and
    /// every other handler waits for it (the isolation of the other `add_*` handlers, whose
    /// slow or stuck handler moves to a thread of its own, does not apply). Of its informer it
    /// may only read the cache (a lister, `get_by_key`, `by_index`): `has_synced` (the
    /// informer's or a registration's), `handler_count`, and adding or removing handlers
    /// (itself included) would wait for it to return, and panic instead. A panic is caught,
    /// logged and counted as any handler's. It hears the cached
    /// objects as initial adds before this returns, then every change and resync in order, as
    /// the others do, with the informer's default resync period.
    ///
    /// ```no_run
    /// # fn demo(informer: etcd_informer::SharedIndexInformer<String>, queue: etcd_informer::workqueue::WorkQueue<String>) -> Result<(), etcd_informer::InformerError> {
    /// use etcd_informer::ResourceEventHandlerFuncs;
    /// let (q1, q2) = (queue.clone(), queue.clone());
    /// let handler = ResourceEventHandlerFuncs::new()
    ///     .on_add(move |o, _| q1.add(o.key().to_string()))
    ///     .on_update(move |_, o| q2.add(o.key().to_string()));
    /// informer.add_inline_event_handler("enqueue", handler)?;
    /// # Ok(()) }
    /// ```
    pub fn add_inline_event_handler(
        &self,
        name: impl Into<String>,
        handler: impl ResourceEventHandler<T>,
    ) -> Result<HandlerRegistration<T>, InformerError> {
        let period = self.resync_period_for(self.shared.default_resync);
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let listener = Listener::inline(
            id,
            name.into(),
            &self.shared.name,
            period,
            Arc::new(handler),
            self.owner(),
        );
        self.register(listener)
    }

    /// Registers a handler that receives a resync every `resync_period` (zero: never; at least
    /// [`MIN_RESYNC_PERIOD`](crate::queue::MIN_RESYNC_PERIOD), at most [`MAX_RESYNC_PERIOD`](crate::queue::MAX_RESYNC_PERIOD)). Once the informer runs, a period shorter than its resync check
    /// period is raised to it.
    ///
    /// If the cache holds objects already, the handler first receives an add for each (with
    /// `is_in_initial_list` true), then the changes after them. Fails with
    /// [`InformerError::Stopped`] once the informer has stopped.
    pub fn add_event_handler_with_resync(
        &self,
        handler: impl ResourceEventHandler<T>,
        resync_period: Duration,
    ) -> Result<HandlerRegistration<T>, InformerError> {
        if self.is_stopped() {
            return Err(self.stopped_error());
        }
        let period = self.resync_period_for(resync_period);
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let name = format!("{}#{id}", self.shared.name);
        self.spawn_handler(id, name, handler, period)
    }

    fn spawn_handler(
        &self,
        id: u64,
        name: String,
        handler: impl ResourceEventHandler<T>,
        period: Duration,
    ) -> Result<HandlerRegistration<T>, InformerError> {
        let listener = Listener::new(
            id,
            name.clone(),
            &self.shared.name,
            period,
            self.shared.max_handler_backlog,
        );
        self.processor()
            .attach(&listener, Arc::new(handler))
            .map_err(|source| InformerError::Thread { name, source })?;
        self.register(listener)
    }

    /// The resync period a handler asking for `resync_period` gets, lowering the informer's
    /// resync check period to it before the informer starts.
    fn resync_period_for(&self, resync_period: Duration) -> Duration {
        let mut period = clamp_resync(resync_period);
        let mut check = lock(&self.shared.resync_check_period);
        if period.is_zero() {
            return period;
        }
        if self.shared.started.load(Ordering::Acquire) {
            if check.is_zero() {
                tracing::warn!(
                    informer = %self.shared.name,
                    requested = ?period,
                    "the informer started without resync; this handler will not be resynced"
                );
            } else if period < *check {
                tracing::warn!(
                    informer = %self.shared.name,
                    requested = ?period,
                    check_period = ?*check,
                    "handler resync period raised to the informer's resync check period"
                );
                period = period.max(*check);
            }
        } else if check.is_zero() || period < *check {
            *check = period;
        }
        period
    }

    /// Adds a listener to the processor, queueing an add for every cached object first.
    pub(super) fn register(
        &self,
        listener: Arc<Listener<T>>,
    ) -> Result<HandlerRegistration<T>, InformerError> {
        // Holding the processor while listing the cache: no change can be applied between the
        // snapshot and the registration, so there is no gap and no duplicate.
        let mut processor = self.processor();
        // Under the processor lock: `run` ending sets `stopped` before it takes the lock to
        // close the handlers, so a handler registered here is either closed by it or refused.
        if self.is_stopped() {
            drop(processor);
            listener.stop_thread();
            return Err(self.stopped_error());
        }
        listener.push_all(
            self.shared
                .indexer
                .list()
                .into_iter()
                .map(|object| Event::Added {
                    object,
                    is_in_initial_list: true,
                }),
        );
        processor.listeners.push(listener.clone());
        Ok(HandlerRegistration {
            listener,
            informer: Arc::downgrade(&self.shared),
        })
    }

    fn stopped_error(&self) -> InformerError {
        InformerError::Stopped {
            informer: self.shared.name.clone(),
        }
    }

    /// Unregisters a handler; its pending notifications are dropped. Returns once the handler
    /// can no longer be called: if it is handling a notification, when it returns from it (for
    /// at most [`REMOVE_PATIENCE`]; a handler stuck longer is logged and left to finish on its
    /// own). Called from within the handler itself, it returns at once and the handler is not
    /// called again after the notification in progress (not from an inline handler, which
    /// must not call it: see [`add_inline_event_handler`](Self::add_inline_event_handler)).
    ///
    /// Returns whether the handler was registered with this informer: a registration of
    /// another informer, or one removed already, is left alone (client-go's no-op).
    ///
    /// It blocks the calling thread while it waits: from async code, use
    /// [`remove_event_handler_async`](Self::remove_event_handler_async).
    pub fn remove_event_handler(&self, registration: &HandlerRegistration<T>) -> bool {
        let removed = self.detach(registration);
        if removed {
            registration.listener.stop_thread_and_wait(REMOVE_PATIENCE);
        }
        removed
    }

    /// [`remove_event_handler`](Self::remove_event_handler) for async code: the wait for a
    /// notification in progress happens on a blocking thread, never on the runtime's.
    pub async fn remove_event_handler_async(&self, registration: &HandlerRegistration<T>) -> bool {
        let removed = self.detach(registration);
        if removed {
            let listener = registration.listener.clone();
            let waited = tokio::task::spawn_blocking(move || {
                listener.stop_thread_and_wait(REMOVE_PATIENCE);
            });
            let _ = waited.await;
        }
        removed
    }

    /// Unregisters a handler and stops its delivery without waiting for a notification in
    /// progress; for `Drop` impls, which may run on a runtime thread and must not block it.
    pub(crate) fn detach(&self, registration: &HandlerRegistration<T>) -> bool {
        if !std::ptr::eq(registration.informer.as_ptr(), Arc::as_ptr(&self.shared)) {
            return false;
        }
        let mut processor = self.processor();
        let before = processor.listeners.len();
        processor
            .listeners
            .retain(|l| !Arc::ptr_eq(l, &registration.listener));
        let removed = processor.listeners.len() < before;
        // Not under the processor lock: the handler may be calling into the informer.
        drop(processor);
        if removed {
            registration.listener.stop_thread();
        }
        removed
    }

    /// How many handlers and event streams are registered.
    pub fn handler_count(&self) -> usize {
        self.processor().listeners.len()
    }
}
