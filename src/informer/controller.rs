//! The controller loop: a reflector filling a DeltaFIFO, and a loop popping it into a process
//! function (client-go's `cache.Controller` with its `Config`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tracing::Instrument;

use crate::backoff::Backoff;
use crate::delta_fifo::{DeltaFifo, PopError, Popped};
use crate::listwatch::ListerWatcher;
use crate::queue::Delta;
use crate::reflector::{Reflector, ReflectorOptions, RevisionHandle, TransformFn};

/// The error of a [`ProcessFn`]: the process function's own error, whatever its type (a `&str`
/// or `String` converts with `.into()`). The controller logs it with its chain of sources.
pub type ProcessError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Processes the deltas of one key; gets whether they belong to the initial list.
pub type ProcessFn<T> = Box<dyn FnMut(&[Delta<T>], bool) -> Result<(), ProcessError> + Send>;

/// How a [`Controller`] is put together (client-go's `cache.Config`).
pub struct ControllerConfig<T, L> {
    /// The source.
    pub lister_watcher: L,
    /// The queue the reflector fills and the loop pops.
    pub queue: Arc<DeltaFifo<T>>,
    /// Called with each key's deltas, in queue order, one key at a time.
    pub process: ProcessFn<T>,
    /// Put failed deltas back (unless newer ones arrived) and retry them with a per-key backoff,
    /// instead of dropping them (client-go's `RetryOnError`).
    pub retry_on_error: bool,
    /// The reflector's options (name, resync, error hook, backoff).
    pub reflector: ReflectorOptions,
}

/// Runs a reflector and the loop that pops its queue.
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use std::time::Duration;
/// use etcd_informer::testing::FakeSource;
/// use etcd_informer::{Controller, ControllerConfig, DeltaFifo, ReflectorOptions};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let source = FakeSource::<String>::new();
/// source.put("a", "1".into());
/// let fifo = Arc::new(DeltaFifo::new(None));
/// let seen = Arc::new(Mutex::new(Vec::new()));
/// let s = seen.clone();
/// let controller = Controller::new(ControllerConfig {
///     lister_watcher: source.clone(),
///     queue: fifo.clone(),
///     process: Box::new(move |deltas, _initial| {
///         // Any error type will do; it is logged with its sources.
///         let newest = deltas.last().ok_or("no deltas")?;
///         s.lock().unwrap().push(newest.object.key().to_owned());
///         Ok(())
///     }),
///     retry_on_error: true,
///     reflector: ReflectorOptions::default(),
/// });
/// let run = tokio::spawn(controller.run());
/// while seen.lock().unwrap().is_empty() {
///     tokio::time::sleep(Duration::from_millis(10)).await;
/// }
/// fifo.close(); // the loop ends once the queue is drained
/// run.await.unwrap();
/// assert_eq!(*seen.lock().unwrap(), ["a"]);
/// # }
/// ```
pub struct Controller<T, L> {
    config: ControllerConfig<T, L>,
    transform: Option<TransformFn<T>>,
}

/// Retry delays for failed keys: 100 ms doubling to 30 s per key, cleared on success.
const RETRY_BASE: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(30);

impl<T: Send + Sync + 'static, L: ListerWatcher<T>> Controller<T, L> {
    /// A controller from its configuration.
    pub fn new(config: ControllerConfig<T, L>) -> Self {
        Controller {
            config,
            transform: None,
        }
    }

    /// Rewrites every object the source yields before it is queued (client-go's
    /// `TransformFunc`; see [`Reflector::with_transform`]).
    #[must_use]
    pub fn with_transform(mut self, transform: Option<TransformFn<T>>) -> Self {
        self.transform = transform;
        self
    }

    /// Runs until the queue is closed (or the future is dropped). `on_start` receives the
    /// reflector's revision handle once the reflector task is spawned.
    pub async fn run(self) {
        self.run_with(|_| {}).await
    }

    pub(crate) async fn run_with(self, on_start: impl FnOnce(RevisionHandle)) {
        let ControllerConfig {
            lister_watcher,
            queue,
            mut process,
            retry_on_error,
            reflector,
        } = self.config;
        let transform = self.transform;
        let span = tracing::info_span!("controller", name = %reflector.name);
        let reflector =
            Reflector::new(lister_watcher, queue.clone(), reflector).with_transform(transform);
        on_start(reflector.revision());
        let reflector = AbortOnDrop(tokio::spawn(reflector.run()));
        let mut failures: HashMap<Arc<str>, Backoff> = HashMap::new();
        async move {
            loop {
                let popped = queue
                    .pop(|deltas, initial| {
                        process(deltas, initial).map_err(|error| {
                            let key = deltas.first().map(|d| d.object.key()).unwrap_or_default();
                            let reason = chain(&*error);
                            if retry_on_error {
                                let after = failures
                                    .entry(key.into())
                                    .or_insert_with(|| {
                                        Backoff::without_reset(RETRY_BASE, RETRY_MAX, 0.0)
                                    })
                                    .next_delay();
                                tracing::warn!(
                                    key,
                                    error = &*error as &dyn std::error::Error,
                                    ?after,
                                    "processing failed; will retry"
                                );
                                PopError::Requeue { reason, after }
                            } else {
                                tracing::warn!(
                                    key,
                                    error = &*error as &dyn std::error::Error,
                                    "processing failed; dropped"
                                );
                                PopError::Drop(reason)
                            }
                        })
                    })
                    .await;
                if queue.is_closed() {
                    // Stop feeding a closed queue so that draining it ends.
                    reflector.0.abort();
                }
                match popped {
                    Popped::Processed(key) => {
                        if !failures.is_empty() {
                            failures.remove(&key);
                        }
                    }
                    Popped::Failed { .. } => {}
                    Popped::Closed => break,
                }
            }
        }
        .instrument(span)
        .await;
    }
}

/// An error and its sources, joined with ": ".
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        text.push_str(": ");
        text.push_str(&e.to_string());
        source = e.source();
    }
    text
}

/// Aborts a spawned task when dropped, so a dropped informer leaves nothing running.
pub(crate) struct AbortOnDrop<T>(pub(crate) tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
