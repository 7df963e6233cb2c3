//! What a reconcile is given and what it asks for next.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::watched::{AnyObject, Watched};
use crate::client::Fence;
use crate::lister::Lister;
use crate::listwatch::BoxFuture;
use crate::object::Object;

/// What a reconcile asks for next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Done with this key until it changes again.
    Done,
    /// Reconcile the key again after this delay (even if it does not change).
    RequeueAfter(Duration),
    /// Done, and this reconcile wrote at this revision (the revision a
    /// [`TypedClient`](crate::client::TypedClient) write returned): the key's next reconcile
    /// waits until every watched informer's cache has applied it, so it never acts on a cache
    /// older than its own last write (read-your-writes; client-go's KEP-5647).
    Wrote(i64),
}

/// A reconcile with its types erased.
pub(crate) type Reconciler =
    Arc<dyn Fn(Context) -> BoxFuture<'static, Result<Action, String>> + Send + Sync>;

/// What a reconcile is given: the key, the key's cached object in the watched informers, their
/// listers, and the runner's name.
///
/// The objects are looked up when the reconcile starts (after any wait for the key's last
/// write, see [`Action::Wrote`]), so they stay the same throughout one reconcile; the listers
/// read the caches as they are when called. Informers are numbered in the order they were
/// passed to [`Runner::watch`](super::Runner::watch) /
/// [`Runner::watch_mapped`](super::Runner::watch_mapped), from 0.
///
/// ```no_run
/// # async fn demo(specs: etcd_informer::SharedIndexInformer<u32>, pods: etcd_informer::SharedIndexInformer<String>) {
/// use etcd_informer::runner::{Action, Context, Runner};
/// let runner = Runner::new("replicas").watch(&specs).watch(&pods);
/// let reconcile = |ctx: Context| async move {
///     match ctx.object::<u32>() {
///         Some(spec) => println!("{} wants {} replicas", ctx.key(), spec.value),
///         None => println!("{} was deleted", ctx.key()),
///     }
///     let pods = ctx.lister::<String>().expect("watched").len();
///     println!("{pods} pods cached");
///     Ok::<_, String>(Action::Done)
/// };
/// runner.run_with_context(reconcile, std::future::pending()).await;
/// # }
/// ```
pub struct Context {
    pub(super) key: String,
    pub(super) runner: Arc<str>,
    pub(super) retries: u32,
    pub(super) fence: Option<Fence>,
    /// Per watched informer, the key's object when the reconcile started.
    pub(super) objects: Vec<Option<AnyObject>>,
    pub(super) watched: Arc<[Arc<Watched>]>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("key", &self.key)
            .field("runner", &self.runner)
            .field("retries", &self.retries)
            .field(
                "cached_in",
                &self
                    .objects
                    .iter()
                    .zip(self.watched.iter())
                    .filter(|(o, _)| o.is_some())
                    .map(|(_, w)| w.informer.as_str())
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Context {
    /// The key to reconcile.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The key, by value.
    pub fn into_key(self) -> String {
        self.key
    }

    /// The runner's name.
    pub fn runner(&self) -> &str {
        &self.runner
    }

    /// How many times this key has been retried with backoff since it last succeeded (0 on a
    /// first attempt).
    pub fn retries(&self) -> u32 {
        self.retries
    }

    /// The fence to make this reconcile's writes under, when the runner is sharded: the owner
    /// record of the key's shard (see [`TypedClient::fenced`](crate::client::TypedClient::fenced)).
    /// `None` for a runner that is not sharded.
    pub fn fence(&self) -> Option<&Fence> {
        self.fence.as_ref()
    }

    /// The key's object in the first watched informer of object type `T` whose cache held the
    /// key; `None` if none did (deleted, or never there).
    pub fn object<T: Send + Sync + 'static>(&self) -> Option<Arc<Object<T>>> {
        (0..self.objects.len()).find_map(|i| self.object_in(i))
    }

    /// The key's object in the `informer`-th watched informer, if that informer's objects are
    /// `T`s and its cache held the key.
    pub fn object_in<T: Send + Sync + 'static>(&self, informer: usize) -> Option<Arc<Object<T>>> {
        let object = self.objects.get(informer)?.clone()?;
        object.downcast::<Object<T>>().ok()
    }

    /// Whether no watched informer's cache held the key: it was deleted (or was never there,
    /// e.g. a key added to the queue by hand or a key that only a mapping produces).
    pub fn is_deleted(&self) -> bool {
        self.objects.iter().all(Option::is_none)
    }

    /// The lister of the first watched informer of object type `T`.
    pub fn lister<T: Send + Sync + 'static>(&self) -> Option<&Lister<T>> {
        self.watched.iter().find_map(|w| w.lister.downcast_ref())
    }

    /// The lister of the `informer`-th watched informer, if its objects are `T`s.
    pub fn lister_at<T: Send + Sync + 'static>(&self, informer: usize) -> Option<&Lister<T>> {
        self.watched.get(informer)?.lister.downcast_ref()
    }
}

/// Turns a reconcile of keys into a reconcile of [`Context`]s, for
/// [`run_as_leader`](super::Runner::run_as_leader).
pub fn by_key<F, Fut>(reconcile: F) -> impl Fn(Context) -> Fut + Send + Sync + 'static
where
    F: Fn(String) -> Fut + Send + Sync + 'static,
{
    move |ctx: Context| reconcile(ctx.into_key())
}

pub(crate) fn erase<F, Fut, E>(reconcile: F) -> Reconciler
where
    F: Fn(Context) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
    E: fmt::Display + Send + 'static,
{
    Arc::new(move |ctx| {
        let fut = reconcile(ctx);
        Box::pin(async move { fut.await.map_err(|e| e.to_string()) })
    })
}
