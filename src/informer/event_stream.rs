//! The informer's changes as an async [`Stream`](tokio_stream::Stream): a handler whose
//! notifications go into a bounded channel.

use std::fmt;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio_stream::Stream;

use super::handler::Event;
use super::options::DEFAULT_STREAM_BACKLOG;
use super::processor::Listener;
use super::registration::HandlerRegistration;
use super::shared_informer::{InformerError, SharedIndexInformer};

/// The changes of an informer as a [`Stream`]; see [`SharedIndexInformer::event_stream`].
///
/// The stream ends when the informer stops (after what is buffered) or is dropped.
///
/// ```
/// use etcd_informer::testing::FakeSource;
/// use etcd_informer::{Event, SharedIndexInformer};
/// use tokio_stream::StreamExt;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let source = FakeSource::<String>::new();
/// source.put("a", "1".into());
/// let informer = SharedIndexInformer::new(source.clone(), Default::default());
/// let mut events = informer.event_stream()?;
/// tokio::spawn(informer.clone().run());
/// match events.next().await {
///     Some(Event::Added { object, is_in_initial_list }) => {
///         assert_eq!((object.key(), is_in_initial_list), ("a", true));
///     }
///     other => panic!("expected the initial add, got {other:?}"),
/// }
/// source.put("a", "2".into());
/// assert!(matches!(events.next().await, Some(Event::Updated { .. })));
/// informer.stop();
/// # Ok(()) }
/// ```
pub struct EventStream<T: Send + Sync + 'static> {
    pub(super) registration: HandlerRegistration<T>,
    pub(super) informer: SharedIndexInformer<T>,
}

impl<T: Send + Sync + 'static> SharedIndexInformer<T> {
    /// The changes as a stream of [`Event`]s, starting with an add for every cached object.
    /// Dropping the stream unregisters it.
    ///
    /// The stream's buffer is bounded: past [`InformerOptions::max_handler_backlog`](crate::InformerOptions::max_handler_backlog) pending
    /// events ([`DEFAULT_STREAM_BACKLOG`] if `None`) they are merged per key, as a handler's
    /// backlog is, so a consumer that falls behind costs memory in proportion to the number of
    /// keys, slows nobody else, and still receives every key's final state (intermediate ones
    /// may be skipped). [`EventStream::backlog`] tells how far behind it is.
    pub fn event_stream(&self) -> Result<EventStream<T>, InformerError> {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let listener = Listener::new(
            id,
            format!("{}#{id}", self.shared.name),
            &self.shared.name,
            Duration::ZERO,
            Some(
                self.shared
                    .max_handler_backlog
                    .unwrap_or(DEFAULT_STREAM_BACKLOG),
            ),
        );
        let registration = self.register(listener)?;
        Ok(EventStream {
            registration,
            informer: self.clone(),
        })
    }
}

impl<T: Send + Sync + 'static> EventStream<T> {
    /// Whether the informer has synced and every initial add has been taken from the stream.
    pub fn has_synced(&self) -> bool {
        self.registration.has_synced()
    }

    /// Events buffered for the stream and not taken yet (bounded; see
    /// [`SharedIndexInformer::event_stream`]).
    pub fn backlog(&self) -> usize {
        self.registration.backlog()
    }
}

impl<T: Send + Sync + 'static> fmt::Debug for EventStream<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventStream")
            .field("informer", &self.informer.name())
            .field("backlog", &self.backlog())
            .finish()
    }
}

impl<T: Send + Sync + 'static> Stream for EventStream<T> {
    type Item = Event<T>;
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event<T>>> {
        self.registration.listener.poll_next(cx)
    }
}

impl<T: Send + Sync + 'static> Drop for EventStream<T> {
    fn drop(&mut self) {
        // Never blocks: a stream has no delivery thread to wait for, and a drop may run on a
        // runtime thread.
        self.informer.detach(&self.registration);
    }
}
