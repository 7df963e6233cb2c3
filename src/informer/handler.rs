//! What handlers receive: the handler trait, a builder of closures, and the event type.

use std::sync::Arc;

use crate::object::Object;

pub use crate::queue::DeletedObject;

/// One notification, as delivered by [`SharedIndexInformer::event_stream`](crate::SharedIndexInformer::event_stream).
#[derive(Debug)]
pub enum Event<T> {
    /// A key appeared; `is_in_initial_list` is true for the objects of the first list (and the
    /// synthetic adds a late handler receives).
    Added {
        /// The object.
        object: Arc<Object<T>>,
        /// Whether it belongs to the initial state rather than a later change.
        is_in_initial_list: bool,
    },
    /// A key changed, or was resynced (then `old` and `new` are the same object).
    Updated {
        /// The state before.
        old: Arc<Object<T>>,
        /// The state after.
        new: Arc<Object<T>>,
    },
    /// A key was deleted.
    Deleted(DeletedObject<T>),
}

impl<T> Clone for Event<T> {
    fn clone(&self) -> Self {
        match self {
            Event::Added {
                object,
                is_in_initial_list,
            } => Event::Added {
                object: object.clone(),
                is_in_initial_list: *is_in_initial_list,
            },
            Event::Updated { old, new } => Event::Updated {
                old: old.clone(),
                new: new.clone(),
            },
            Event::Deleted(d) => Event::Deleted(d.clone()),
        }
    }
}

impl<T> Event<T> {
    /// The key the event is about.
    pub fn key(&self) -> &str {
        match self {
            Event::Added { object, .. } => object.key(),
            Event::Updated { new, .. } => new.key(),
            Event::Deleted(d) => d.key(),
        }
    }
}

/// Receives the changes of an informer's cache (client-go's `ResourceEventHandler`).
///
/// Calls come one at a time, in the order of the informer's queue: for one key always in
/// revision order. The cache already holds the new state when a call is made; a read of the
/// cache (a lister, an index) from within a call sees it as it is at that moment, which may be
/// later than the event: changes applied since wait in this handler's backlog. Count or act on
/// the objects the call gives, or re-read when the current state is what matters. Handlers
/// share a delivery thread while they keep up; one that blocks for over 20 ms gets that thread
/// to itself and delays only itself from then on. One that panics has that one notification
/// skipped and logged.
///
/// ```
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use etcd_informer::{DeletedObject, Object, ResourceEventHandler};
///
/// struct Service { zone: String }
///
/// /// Counts the services of one zone as they come and go.
/// struct ZoneCount { zone: String, count: AtomicUsize }
///
/// impl ResourceEventHandler<Service> for ZoneCount {
///     fn on_add(&self, svc: &Arc<Object<Service>>, _initial: bool) {
///         if svc.value.zone == self.zone {
///             self.count.fetch_add(1, Ordering::Relaxed);
///         }
///     }
///     fn on_delete(&self, svc: &DeletedObject<Service>) {
///         // Deletes carry the last value the cache held (a relist's tombstone too).
///         if svc.object().value.zone == self.zone {
///             self.count.fetch_sub(1, Ordering::Relaxed);
///         }
///     }
/// }
/// # let h = ZoneCount { zone: "a".into(), count: AtomicUsize::new(0) };
/// # h.on_add(&Arc::new(Object::new("s/1", 1, Service { zone: "a".into() })), true);
/// # assert_eq!(h.count.load(Ordering::Relaxed), 1);
/// ```
pub trait ResourceEventHandler<T>: Send + Sync + 'static {
    /// A key appeared in the cache.
    fn on_add(&self, obj: &Arc<Object<T>>, is_in_initial_list: bool) {
        let _ = (obj, is_in_initial_list);
    }
    /// A key changed; on resync `old` and `new` are the same object.
    fn on_update(&self, old: &Arc<Object<T>>, new: &Arc<Object<T>>) {
        let _ = (old, new);
    }
    /// A key left the cache.
    fn on_delete(&self, obj: &DeletedObject<T>) {
        let _ = obj;
    }
}

type AddFn<T> = Box<dyn Fn(&Arc<Object<T>>, bool) + Send + Sync>;
type UpdateFn<T> = Box<dyn Fn(&Arc<Object<T>>, &Arc<Object<T>>) + Send + Sync>;
type DeleteFn<T> = Box<dyn Fn(&DeletedObject<T>) + Send + Sync>;

/// A handler made of optional closures (client-go's `ResourceEventHandlerFuncs`).
///
/// Name the object type (`::<Service>` below) when a closure reads the object's fields: the
/// closures are type-checked before the handler meets the informer that would tell it.
///
/// ```
/// use etcd_informer::ResourceEventHandlerFuncs;
///
/// struct Service { zone: String }
///
/// let handler = ResourceEventHandlerFuncs::<Service>::new()
///     .on_add(|svc, _| println!("created: {} in {}", svc.key(), svc.value.zone))
///     .on_update(|old, new| println!("updated: {} {} -> {}", new.key(), old.value.zone, new.value.zone))
///     .on_delete(|svc| println!("deleted: {}", svc.key()));
/// # let _ = handler;
/// ```
pub struct ResourceEventHandlerFuncs<T> {
    add: Option<AddFn<T>>,
    update: Option<UpdateFn<T>>,
    delete: Option<DeleteFn<T>>,
}

impl<T> Default for ResourceEventHandlerFuncs<T> {
    fn default() -> Self {
        ResourceEventHandlerFuncs {
            add: None,
            update: None,
            delete: None,
        }
    }
}

impl<T> ResourceEventHandlerFuncs<T> {
    /// A handler that ignores everything until given closures.
    pub fn new() -> Self {
        Self::default()
    }

    /// Called on add, with whether the object is part of the initial list.
    #[must_use]
    pub fn on_add(mut self, f: impl Fn(&Arc<Object<T>>, bool) + Send + Sync + 'static) -> Self {
        self.add = Some(Box::new(f));
        self
    }

    /// Called on update (and resync, with `old` and `new` the same).
    #[must_use]
    pub fn on_update(
        mut self,
        f: impl Fn(&Arc<Object<T>>, &Arc<Object<T>>) + Send + Sync + 'static,
    ) -> Self {
        self.update = Some(Box::new(f));
        self
    }

    /// Called on delete.
    #[must_use]
    pub fn on_delete(mut self, f: impl Fn(&DeletedObject<T>) + Send + Sync + 'static) -> Self {
        self.delete = Some(Box::new(f));
        self
    }
}

impl<T: Send + Sync + 'static> ResourceEventHandler<T> for ResourceEventHandlerFuncs<T> {
    fn on_add(&self, obj: &Arc<Object<T>>, is_in_initial_list: bool) {
        if let Some(f) = &self.add {
            f(obj, is_in_initial_list)
        }
    }
    fn on_update(&self, old: &Arc<Object<T>>, new: &Arc<Object<T>>) {
        if let Some(f) = &self.update {
            f(old, new)
        }
    }
    fn on_delete(&self, obj: &DeletedObject<T>) {
        if let Some(f) = &self.delete {
            f(obj)
        }
    }
}

impl<T, H: ResourceEventHandler<T> + ?Sized> ResourceEventHandler<T> for Arc<H> {
    fn on_add(&self, obj: &Arc<Object<T>>, is_in_initial_list: bool) {
        (**self).on_add(obj, is_in_initial_list)
    }
    fn on_update(&self, old: &Arc<Object<T>>, new: &Arc<Object<T>>) {
        (**self).on_update(old, new)
    }
    fn on_delete(&self, obj: &DeletedObject<T>) {
        (**self).on_delete(obj)
    }
}

impl<T: 'static> Event<T> {
    /// Delivers this event to `handler`.
    pub fn dispatch(&self, handler: &dyn ResourceEventHandler<T>) {
        match self {
            Event::Added {
                object,
                is_in_initial_list,
            } => handler.on_add(object, *is_in_initial_list),
            Event::Updated { old, new } => handler.on_update(old, new),
            Event::Deleted(d) => handler.on_delete(d),
        }
    }
}
