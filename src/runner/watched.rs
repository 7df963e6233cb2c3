//! One informer a runner watches, whatever its object type, and the runner's handler in it.

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use crate::informer::{ConsistencyError, InformerError};
use crate::listwatch::BoxFuture;
use crate::workqueue::WorkQueue;

/// A cached object of some watched informer: an `Arc<Object<T>>`.
pub(super) type AnyObject = Arc<dyn Any + Send + Sync>;

/// Looks a key up in one informer's cache.
pub(super) type Get = Box<dyn Fn(&str) -> Option<AnyObject> + Send + Sync>;

/// Waits until one informer has applied a revision.
pub(super) type WaitFor =
    Box<dyn Fn(i64, Duration) -> BoxFuture<'static, Result<(), ConsistencyError>> + Send + Sync>;

/// Adds a runner's handler (named after the runner) to one informer, feeding a queue.
pub(super) type Register = Box<
    dyn Fn(&str, &WorkQueue<String>, Queueing) -> Result<Registered, InformerError> + Send + Sync,
>;

/// What a runner's handlers queue, and how.
#[derive(Debug, Clone, Copy)]
pub(super) struct Queueing {
    /// Initial lists and resyncs below live changes.
    pub(super) priorities: bool,
    /// Resyncs (updates with old and new at one revision) queued at all.
    pub(super) resyncs: bool,
}

/// Calls its argument with every key one informer's cached objects map to.
pub(super) type ForEachKey = Box<dyn Fn(&mut dyn FnMut(String)) + Send + Sync>;

/// Calls `f` with every key the runner's informers would queue for their cached objects.
pub(crate) struct KeySource(pub(super) Vec<Arc<Watched>>);

impl KeySource {
    pub(crate) fn for_each_key(&self, f: &mut dyn FnMut(String)) {
        for w in &self.0 {
            (w.keys)(f);
        }
    }
}

/// One watched informer, whatever its object type.
pub(super) struct Watched {
    pub(super) informer: String,
    pub(super) register: Register,
    /// Every key its cached objects map to.
    pub(super) keys: ForEachKey,
    pub(super) wait_for: WaitFor,
    /// The revision the informer's cache is at.
    pub(super) revision: Box<dyn Fn() -> i64 + Send + Sync>,
    /// The key's cached object.
    pub(super) get: Get,
    /// A `Lister<T>`.
    pub(super) lister: Box<dyn Any + Send + Sync>,
}

/// A handler added to an informer for one run.
pub(super) struct Registered {
    pub(super) informer: String,
    pub(super) synced: Box<dyn Fn() -> bool + Send + Sync>,
    pub(super) unregister: Option<Box<dyn FnOnce() + Send + Sync>>,
}

/// The handlers of one run; they leave their informers when this is dropped, however the run
/// ends (returned, cancelled, leadership lost).
pub(super) struct Registrations(pub(super) Vec<Registered>);

impl Drop for Registrations {
    fn drop(&mut self) {
        for r in &mut self.0 {
            if let Some(unregister) = r.unregister.take() {
                unregister();
            }
        }
    }
}
