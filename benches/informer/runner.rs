//! The `runner` scenario: a controller's event, from etcd's response to the key in the
//! runner's queue, beside the raw watch's consumer and a controller written by hand over it;
//! and to the worker's reconcile.

use etcd_informer::runner::{Action, Runner};

use super::*;

/// The consumer's CPU per event: the raw watch's (baseline), a controller's written by hand
/// over it (the floor: [`floor_once`]), an informer's with a runner whose workers run on the
/// writers' threads (not counted: etcd's response to the key in the queue), and the same with
/// the workers counted (to the reconcile; reported, no target).
pub(super) async fn scenario_runner(b: &Bench) -> Row {
    let deadline = Duration::from_secs(60 + (b.args.events / 1000) as u64);
    let (mut raw, mut floor, mut queued, mut reconciled) = (vec![], vec![], vec![], vec![]);
    let (mut raw_threads, mut queued_threads, mut reconciled_threads) = (vec![], vec![], vec![]);
    for run in 0..b.args.runs {
        let r = watch_baseline_once(b, deadline).await;
        eprintln!(
            "runner run {run}: raw watch {:.1} us CPU per event [{}]",
            r.consumer_cpu_us, r.by_thread
        );
        raw.push(r.consumer_cpu_us);
        raw_threads.push(r.by_thread);
        let f = floor_once(b, deadline).await;
        eprintln!(
            "runner run {run}: floor (a map and a channel by hand) {:.1} us CPU per event [{}]",
            f.cpu_us, f.by_thread
        );
        floor.push(f.cpu_us);
        for (workers_counted, cpu, threads) in [
            (false, &mut queued, &mut queued_threads),
            (true, &mut reconciled, &mut reconciled_threads),
        ] {
            let c = runner_once(b, workers_counted, deadline).await;
            let to = if workers_counted {
                "reconcile"
            } else {
                "queue"
            };
            eprintln!(
                "runner run {run}: to the {to} {:.1} us CPU per event [{}]",
                c.cpu_us, c.by_thread
            );
            cpu.push(c.cpu_us);
            threads.push(c.by_thread);
        }
    }
    let (baseline, informer) = (median(&raw), median(&queued));
    let diff = informer - baseline;
    let mut line = b.base_json("runner");
    line.insert("events".into(), json!(b.args.events));
    line.insert("raw_cpu_us_per_event_runs".into(), json!(raw));
    line.insert("floor_cpu_us_per_event_runs".into(), json!(floor));
    line.insert(
        "floor_cpu_us_per_event_diff".into(),
        json!(round(median(&floor) - baseline, 1)),
    );
    line.insert("queue_cpu_us_per_event_runs".into(), json!(queued));
    line.insert("reconcile_cpu_us_per_event_runs".into(), json!(reconciled));
    line.insert("cpu_us_per_event_diff".into(), json!(round(diff, 1)));
    line.insert(
        "reconcile_cpu_us_per_event_diff".into(),
        json!(round(median(&reconciled) - baseline, 1)),
    );
    line.insert("raw_by_thread_runs".into(), json!(raw_threads));
    line.insert("queue_by_thread_runs".into(), json!(queued_threads));
    line.insert("reconcile_by_thread_runs".into(), json!(reconciled_threads));
    let allowance = 3.0;
    let row = Row {
        scenario: "runner".into(),
        baseline,
        informer,
        ratio: informer / baseline,
        unit: "us CPU/event".into(),
        target: format!(
            "to the queue <= raw + {allowance} us (here {diff:+.1}; a map and a channel by hand {:+.1}; to the reconcile {:+.1})",
            median(&floor) - baseline,
            median(&reconciled) - baseline
        ),
        met: Some(diff <= allowance),
    };
    emit(line, &row, true)
}

/// One run of the floor: a controller written by hand over the raw watch. On the watch's task,
/// each event's object replaces (and drops) the one a map of the prefix held (listed first, as
/// the informer's store is), and its key goes down a channel to a worker on the writers'
/// threads (not counted), which records the object it reads from the map. No work queue's
/// dedupe, no index, no revision check: less than any informer can do.
async fn floor_once(b: &Bench, deadline: Duration) -> ConsumerCost {
    let m = b.args.events;
    let client = b.raw_client().await;
    let (map, revision) = raw_list(&client, &b.prefix, 10_000)
        .await
        .unwrap_or_else(|e| fail(format!("the floor's list: {e}")));
    let map = Arc::new(Mutex::new(map));
    let counted = Sink::new(m, 0, false, Instant::now());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let worker = {
        let (map, counted) = (map.clone(), counted.clone());
        b.writers.spawn(async move {
            while let Some(key) = rx.recv().await {
                let held = map
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(&key)
                    .cloned();
                if let Some(cm) = held {
                    counted.record(&cm);
                }
            }
        })
    };
    let consume = move |key: &[u8], decoded: serde_json::Result<ConfigMap>| {
        let (Ok(key), Ok(cm)) = (std::str::from_utf8(key), decoded) else {
            fail("the floor's watch met a key or value it cannot read");
        };
        let cm = Arc::new(cm);
        let mut held = map.lock().unwrap_or_else(|e| e.into_inner());
        match held.get_mut(key) {
            Some(slot) => *slot = cm,
            None => drop(held.insert(key.to_owned(), cm)),
        }
        drop(held);
        let _ = tx.send(key.to_owned());
    };
    let watch = b.raw_watch_with(revision, false, consume).await;
    let consumer = ConsumerMark::now();
    b.write_updates(m).await;
    counted.wait("the floor", deadline).await;
    let cost = consumer.per_event(m);
    drop(watch);
    worker.abort();
    cost
}

/// One run: an informer (no handler of its own) and a runner over it reconciling every changed
/// key, whose workers run on the writers' threads unless `workers_counted`.
async fn runner_once(b: &Bench, workers_counted: bool, deadline: Duration) -> ConsumerCost {
    let m = b.args.events;
    let running = b.synced_informer(&[]).await;
    let informer = running.informer.clone();
    // The initial list's keys are reconciled first (counted here), then the sink is installed.
    let sink: Arc<Mutex<Option<Arc<Sink>>>> = Arc::default();
    let initial = Arc::new(AtomicUsize::new(0));
    let lister = informer.lister();
    let reconcile = {
        let (sink, initial) = (sink.clone(), initial.clone());
        move |key: String| {
            let current = sink.lock().unwrap_or_else(|e| e.into_inner()).clone();
            match current {
                Some(sink) => {
                    if let Some(o) = lister.get(&key) {
                        sink.record(&o.value);
                    }
                }
                None => {
                    initial.fetch_add(1, Ordering::Relaxed);
                }
            }
            std::future::ready(Ok::<_, std::convert::Infallible>(Action::Done))
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = Runner::new("bench")
        .watch(&informer)
        .run(reconcile, async move {
            let _ = stopped.await;
        });
    let task = match workers_counted {
        true => tokio::spawn(run),
        false => b.writers.spawn(run),
    };
    let started = Instant::now();
    while initial.load(Ordering::Relaxed) < b.args.keys {
        if started.elapsed() > deadline {
            fail("the runner did not reconcile the initial list in time");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let counted = Sink::new(m, 0, false, Instant::now());
    *sink.lock().unwrap_or_else(|e| e.into_inner()) = Some(counted.clone());
    let consumer = ConsumerMark::now();
    b.write_updates(m).await;
    counted.wait("runner", deadline).await;
    let cost = consumer.per_event(m);
    let _ = stop.send(());
    let _ = task.await;
    running.shutdown().await;
    cost
}
