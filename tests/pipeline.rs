//! The pipeline rules of SEMANTICS.md on the in-memory source, in the default revision-atomic
//! processing mode (the same cases run in the DeltaFIFO mode in pipeline_delta_fifo.rs).
#![cfg(feature = "testing")]

const PROCESSING: etcd_informer::Processing = etcd_informer::Processing::Atomic;
const COMPACT: bool = false;

include!("common/pipeline_cases.rs");

/// Correctness review, finding 6: with a consumer that stopped, the RealFIFO holds at most its
/// bound and the reflector waits (the watch's own buffer then fills and etcd's stream is held),
/// instead of the queue growing with the write rate.
#[tokio::test]
async fn a_stalled_consumer_holds_the_reflector_at_the_queues_bound() {
    use etcd_informer::{Indexer, RealFifo, Reflector, ReflectorOptions};
    let source: FakeSource<String> = FakeSource::new();
    let cache: Indexer<String> = Indexer::default();
    let fifo = Arc::new(RealFifo::new(Arc::new(cache)).with_max_batches(8));
    let reflector = Reflector::new(source.clone(), fifo.clone(), ReflectorOptions::default());
    let read = reflector.revision();
    let task = tokio::spawn(reflector.run());
    eventually("listed", || fifo.len() == 1).await;
    for i in 0..100 {
        source.put(&format!("k{i}"), "v".into());
    }
    eventually("the queue is full", || fifo.len() == 8).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(fifo.len(), 8, "never past its bound");
    assert!(
        read.get() < 100,
        "the reflector waits: read up to {}",
        read.get()
    );
    // The consumer comes back: everything arrives.
    let mut last = 0;
    while last < 100 {
        fifo.pop(|batch| {
            if let etcd_informer::Batch::Changes { revision, .. } = batch {
                last = revision;
            }
        })
        .await
        .unwrap();
    }
    task.abort();
}

/// Issue 50, item 5: a relist not taken for a replaced store compares each key's whole stamp
/// (revisions and the value's digest), as its reuse does: a value changed under an equal
/// `mod_revision` (a store rewritten past the cache without the tally noticing) reaches the
/// handlers as an update, not as an unchanged key.
#[tokio::test]
async fn a_relist_hears_a_value_changed_under_an_equal_mod_revision() {
    use etcd_informer::listwatch::{ListResult, ListWatch, WatchStream};
    use etcd_informer::{InformerOptions, Object, ResourceEventHandlerFuncs, SharedIndexInformer};
    let lists = Arc::new(AtomicUsize::new(0));
    let listed = lists.clone();
    let source = ListWatch::new(
        move || {
            let n = listed.fetch_add(1, Ordering::SeqCst);
            let value = if n == 0 { "before" } else { "after" };
            async move {
                let object = Object::new("a", 5, value.to_owned()).read_from(value.as_bytes());
                Ok(ListResult {
                    items: vec![object],
                    revision: 10,
                })
            }
        },
        // The first watch ends at once as if compacted: a relist that is not a replaced store.
        |_after| async {
            let ended: WatchStream<String> =
                Box::pin(tokio_stream::iter(vec![etcd_informer::WatchEvent::Error(
                    Error::expired(10, "compacted"),
                )]));
            Ok(ended)
        },
    );
    let informer = SharedIndexInformer::new(source, InformerOptions::default().with_name("stamps"));
    let updates = Arc::new(Mutex::new(Vec::new()));
    let heard = updates.clone();
    informer
        .add_event_handler(
            ResourceEventHandlerFuncs::<String>::new().on_update(move |_, new| {
                heard.lock().unwrap().push(new.value.clone());
            }),
        )
        .unwrap();
    let run = tokio::spawn(informer.clone().run());
    eventually("relisted", || lists.load(Ordering::SeqCst) >= 2).await;
    eventually("the changed value heard", || {
        updates.lock().unwrap().iter().any(|v| v == "after")
    })
    .await;
    assert_eq!(
        informer
            .lister()
            .get("a")
            .map(|o| o.value.clone())
            .as_deref(),
        Some("after")
    );
    informer.stop();
    let _ = run.await;
}

/// Issue 50, item 5: a paged list is queued on a blocking thread; if that panics, the cache
/// lacks the list, and the reflector lists again instead of watching on from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_whose_queueing_panicked_is_listed_again() {
    use etcd_informer::listwatch::{BoxFuture, ListSink};
    use etcd_informer::{
        Batch, DeltaType, Indexer, Object, Queue, RealFifo, Reflector, ReflectorOptions,
    };

    /// A RealFifo whose first `finish_replace` panics.
    struct Panicky {
        fifo: Arc<RealFifo<String>>,
        panicked: std::sync::atomic::AtomicBool,
    }
    impl Queue<String> for Panicky {
        fn add_if_newer(&self, kind: DeltaType, obj: Arc<Object<String>>) -> bool {
            self.fifo.add_if_newer(kind, obj)
        }
        fn delete(&self, key: &str, revision: i64, last: Option<Arc<Object<String>>>) -> bool {
            self.fifo.delete(key, revision, last)
        }
        fn replace(&self, list: Vec<Arc<Object<String>>>, revision: i64, store_replaced: bool) {
            self.fifo.replace(list, revision, store_replaced)
        }
        fn begin_replace(&self, reuse_from: Option<i64>) -> Option<Arc<dyn ListSink<String>>> {
            self.fifo.begin_replace(reuse_from)
        }
        fn finish_replace(&self, revision: i64, store_replaced: bool) {
            if !self.panicked.swap(true, Ordering::SeqCst) {
                panic!("a repack failed");
            }
            self.fifo.finish_replace(revision, store_replaced)
        }
        fn resync(&self) {
            self.fifo.resync()
        }
        fn commit(&self, revision: i64) {
            self.fifo.commit(revision)
        }
        fn progress(&self, revision: i64) {
            self.fifo.progress(revision)
        }
        fn room(&self) -> Option<BoxFuture<'_, ()>> {
            self.fifo.room()
        }
    }

    let source: FakeSource<String> = FakeSource::new();
    source.put("a", "1".into());
    let cache: Indexer<String> = Indexer::default();
    let fifo = Arc::new(RealFifo::new(Arc::new(cache)));
    let queue = Arc::new(Panicky {
        fifo: fifo.clone(),
        panicked: Default::default(),
    });
    let reflector = Reflector::new(source.clone(), queue, ReflectorOptions::default());
    let health = reflector.revision();
    let task = tokio::spawn(reflector.run());
    eventually("listed again", || source.list_count() >= 2).await;
    let popped = tokio::time::timeout(Duration::from_secs(10), fifo.pop(|batch| batch))
        .await
        .expect("the second list is queued")
        .unwrap();
    assert!(
        matches!(popped, Batch::Replace { .. }),
        "the relist, queued"
    );
    let last_error = health
        .health()
        .last_error
        .map(|(e, _)| e)
        .unwrap_or_default();
    assert!(last_error.contains("a repack failed"), "{last_error}");
    task.abort();
}
