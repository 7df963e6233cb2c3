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
