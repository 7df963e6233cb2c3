//! The scenarios (see the crate docs): sync, watch and fanout, latency, memory, prevkv.

use super::*;

/// One scenario's result, for the final table.
pub(super) struct Row {
    pub(super) scenario: String,
    pub(super) baseline: f64,
    pub(super) informer: f64,
    pub(super) ratio: f64,
    pub(super) unit: String,
    pub(super) target: String,
    pub(super) met: Option<bool>,
}

pub(super) fn emit(
    mut line: serde_json::Map<String, Value>,
    row: &Row,
    lower_is_better: bool,
) -> Row {
    line.insert("baseline".into(), json!(round(row.baseline, 4)));
    line.insert("informer".into(), json!(round(row.informer, 4)));
    line.insert("ratio".into(), json!(round(row.ratio, 3)));
    line.insert("unit".into(), json!(row.unit));
    line.insert("lower_is_better".into(), json!(lower_is_better));
    line.insert("target".into(), json!(row.target));
    line.insert("target_met".into(), json!(row.met));
    println!("{}", Value::Object(line));
    Row {
        scenario: row.scenario.clone(),
        baseline: row.baseline,
        informer: row.informer,
        ratio: row.ratio,
        unit: row.unit.clone(),
        target: row.target.clone(),
        met: row.met,
    }
}

pub(super) async fn scenario_sync(b: &Bench) -> Row {
    let n = b.args.keys;
    let baseline_pages: Vec<i64> = vec![10_000, 50_000, 0];
    let mut informer_pages: Vec<i64> = Vec::new();
    for p in [b.args.page_size, 5_000, 10_000, 50_000, 100_000, HUGE_PAGE] {
        if !informer_pages.contains(&p) {
            informer_pages.push(p);
        }
    }
    let mut base_times: BTreeMap<i64, Vec<f64>> = BTreeMap::new();
    let mut inf_times: BTreeMap<i64, Vec<f64>> = BTreeMap::new();
    let mut list_only = Vec::new();
    for run in 0..b.args.runs {
        {
            // The informer's list alone (fetch + decode, no cache), to split its sync time.
            let client = b.informer_client().await;
            let lw = EtcdListerWatcher::with_options(
                client,
                b.prefix.clone(),
                JsonCodec::<ConfigMap>::new(),
                EtcdOptions::default().with_page_size(b.args.page_size),
            )
            .unwrap_or_else(|e| fail(e));
            // Each side starts with the free memory given back, as in a fresh process: a side
            // that reuses memory the previous one freed skips its page faults (~0.1 s at 100k).
            trim_malloc();
            let faults = minor_faults();
            let started = Instant::now();
            let list = lw
                .list()
                .await
                .unwrap_or_else(|e| fail(format!("list: {e}")));
            let secs = started.elapsed().as_secs_f64();
            let faults = minor_faults() - faults;
            if list.items.len() != n {
                fail(format!(
                    "list found {} keys, expected {n}",
                    list.items.len()
                ));
            }
            drop(list);
            eprintln!(
                "sync run {run}: EtcdListerWatcher::list alone, page {}: {secs:.3} s, {faults} page faults",
                page_label(b.args.page_size)
            );
            list_only.push(secs);
        }
        for &page in &baseline_pages {
            let client = b.raw_client().await;
            // Each side starts with the free memory given back, as in a fresh process: a side
            // that reuses memory the previous one freed skips its page faults (~0.1 s at 100k).
            trim_malloc();
            let faults = minor_faults();
            let started = Instant::now();
            let (map, _) = raw_list(&client, &b.prefix, page)
                .await
                .unwrap_or_else(|e| fail(format!("raw list: {e}")));
            let secs = started.elapsed().as_secs_f64();
            let faults = minor_faults() - faults;
            if map.len() != n {
                fail(format!("raw list found {} keys, expected {n}", map.len()));
            }
            drop(map);
            eprintln!(
                "sync run {run}: raw page {:>8}: {secs:.3} s, {faults} page faults",
                page_label(page)
            );
            base_times.entry(page).or_default().push(secs);
        }
        for &page in &informer_pages {
            let client = b.informer_client().await;
            let informer = b.informer(client, page);
            // Each side starts with the free memory given back, as in a fresh process: a side
            // that reuses memory the previous one freed skips its page faults (~0.1 s at 100k).
            trim_malloc();
            let faults = minor_faults();
            let started = Instant::now();
            let task = tokio::spawn(informer.clone().run());
            while !informer.has_synced() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let secs = started.elapsed().as_secs_f64();
            let faults = minor_faults() - faults;
            let cached = informer.indexer().len();
            stop_informer(informer, task).await;
            if cached != n {
                fail(format!("the informer cached {cached} keys, expected {n}"));
            }
            eprintln!(
                "sync run {run}: informer page {:>8}: {secs:.3} s, {faults} page faults",
                page_label(page)
            );
            inf_times.entry(page).or_default().push(secs);
        }
    }
    let base_med: BTreeMap<i64, f64> = base_times.iter().map(|(p, v)| (*p, median(v))).collect();
    let inf_med: BTreeMap<i64, f64> = inf_times.iter().map(|(p, v)| (*p, median(v))).collect();
    let (best_page, baseline) = base_med
        .iter()
        .min_by(|a, b| a.1.total_cmp(b.1))
        .map(|(p, t)| (*p, *t))
        .unwrap_or((0, f64::NAN));
    let informer = inf_med[&b.args.page_size];
    let (inf_best_page, inf_best) = inf_med
        .iter()
        .min_by(|a, b| a.1.total_cmp(b.1))
        .map(|(p, t)| (*p, *t))
        .unwrap_or((0, f64::NAN));
    let ratio = informer / baseline;
    let by = |m: &BTreeMap<i64, f64>| -> Value {
        Value::Object(
            m.iter()
                .map(|(p, t)| (page_label(*p), json!(round(*t, 4))))
                .collect(),
        )
    };
    let runs = |m: &BTreeMap<i64, Vec<f64>>| -> Value {
        Value::Object(
            m.iter()
                .map(|(p, t)| {
                    (
                        page_label(*p),
                        json!(t.iter().map(|x| round(*x, 4)).collect::<Vec<_>>()),
                    )
                })
                .collect(),
        )
    };
    let mut line = b.base_json("sync");
    line.insert("informer_page_size".into(), json!(b.args.page_size));
    line.insert("baseline_best_page".into(), json!(page_label(best_page)));
    line.insert("baseline_s_by_page".into(), by(&base_med));
    line.insert("informer_s_by_page".into(), by(&inf_med));
    line.insert(
        "informer_ratio_by_page".into(),
        Value::Object(
            inf_med
                .iter()
                .map(|(p, t)| (page_label(*p), json!(round(t / baseline, 3))))
                .collect(),
        ),
    );
    line.insert(
        "informer_best_page".into(),
        json!(page_label(inf_best_page)),
    );
    line.insert(
        "informer_best_ratio".into(),
        json!(round(inf_best / baseline, 3)),
    );
    line.insert(
        "informer_list_only_s".into(),
        json!(round(median(&list_only), 4)),
    );
    line.insert(
        "informer_cache_pipeline_s".into(),
        json!(round(informer - median(&list_only), 4)),
    );
    line.insert("baseline_runs".into(), runs(&base_times));
    line.insert("informer_runs".into(), runs(&inf_times));
    // A large prefix must sync clearly faster than the raw best (pages decoded while etcd
    // serves the next); a small one at least as fast.
    let need = if n >= 1_000_000 { 0.8 } else { 1.0 };
    let row = Row {
        scenario: "sync".into(),
        baseline,
        informer,
        ratio,
        unit: "s".into(),
        target: format!("<= {need}x raw best"),
        met: Some(ratio <= need),
    };
    emit(line, &row, true)
}

/// One side of one watch run.
pub(super) struct WatchRun {
    /// Events/s reaching the consumer (the last handler).
    pub(super) rate: f64,
    /// Writes/s etcd took meanwhile.
    pub(super) writes: f64,
    /// CPU µs per event of this process (consumer + writers) and of etcd.
    pub(super) own_cpu_us: f64,
    pub(super) etcd_cpu_us: f64,
    /// CPU µs and voluntary context switches (wake-ups) per event of the consumer's threads
    /// (every thread of this process but the writers').
    pub(super) consumer_cpu_us: f64,
    pub(super) wakeups: f64,
    /// The same by thread name (see `ConsumerCost::by_thread`).
    pub(super) by_thread: String,
}

/// A raw watch under the write load.
pub(super) async fn watch_baseline_once(b: &Bench, deadline: Duration) -> WatchRun {
    let m = b.args.events;
    let revision = b.current_revision().await;
    let sink = Sink::new(m, 0, false, Instant::now());
    let _watch = b.raw_watch(revision, false, sink.clone()).await;
    let cpu = CpuMark::now(b.etcd_pid);
    let consumer = ConsumerMark::now();
    let (started, took) = b.write_updates(m).await;
    let done = sink.wait("raw watch", deadline).await;
    let (own_cpu_us, etcd_cpu_us) = cpu.per_event(b.etcd_pid, m);
    let consumer = consumer.per_event(m);
    tokio::time::sleep(Duration::from_millis(50)).await;
    if sink.count() != m {
        fail(format!("raw watch: {} events, expected {m}", sink.count()));
    }
    WatchRun {
        rate: m as f64 / done.duration_since(started).as_secs_f64(),
        writes: m as f64 / took.as_secs_f64(),
        own_cpu_us,
        etcd_cpu_us,
        consumer_cpu_us: consumer.cpu_us,
        wakeups: consumer.wakeups,
        by_thread: consumer.by_thread,
    }
}

/// An informer with `handlers` handlers under the write load; the rate is the one at which the
/// last handler saw every event.
pub(super) async fn watch_informer_once(
    b: &Bench,
    handlers: usize,
    deadline: Duration,
) -> WatchRun {
    watch_informer_recorded(b, handlers, deadline, None).await
}

/// [`watch_informer_once`] with the informer's metrics going to `recorder`.
pub(super) async fn watch_informer_recorded(
    b: &Bench,
    handlers: usize,
    deadline: Duration,
    recorder: Option<&metrics_exporter_prometheus::PrometheusRecorder>,
) -> WatchRun {
    let m = b.args.events;
    let sinks: Vec<Arc<Sink>> = (0..handlers)
        .map(|_| Sink::new(m, 0, false, Instant::now()))
        .collect();
    let running = b.synced_informer_recorded(&sinks, recorder).await;
    let cpu = CpuMark::now(b.etcd_pid);
    let consumer = ConsumerMark::now();
    let (started, took) = b.write_updates(m).await;
    let mut last = started;
    for (h, sink) in sinks.iter().enumerate() {
        last = last.max(sink.wait(&format!("informer handler {h}"), deadline).await);
    }
    let (own_cpu_us, etcd_cpu_us) = cpu.per_event(b.etcd_pid, m);
    let consumer = consumer.per_event(m);
    tokio::time::sleep(Duration::from_millis(50)).await;
    for (h, sink) in sinks.iter().enumerate() {
        if sink.count() != m {
            fail(format!(
                "informer handler {h}: {} events, expected {m}",
                sink.count()
            ));
        }
    }
    running.shutdown().await;
    WatchRun {
        rate: m as f64 / last.duration_since(started).as_secs_f64(),
        writes: m as f64 / took.as_secs_f64(),
        own_cpu_us,
        etcd_cpu_us,
        consumer_cpu_us: consumer.cpu_us,
        wakeups: consumer.wakeups,
        by_thread: consumer.by_thread,
    }
}

pub(super) async fn scenario_watch(b: &Bench, name: &str, handlers: usize) -> Row {
    let m = b.args.events;
    let deadline = Duration::from_secs(60 + (m / 1000) as u64);
    let (mut base, mut inf, mut base_w, mut inf_w) = (vec![], vec![], vec![], vec![]);
    let (mut base_cpu, mut inf_cpu, mut base_etcd, mut inf_etcd) = (vec![], vec![], vec![], vec![]);
    let (mut base_own, mut inf_own, mut base_wake, mut inf_wake) = (vec![], vec![], vec![], vec![]);
    let (mut base_threads, mut inf_threads) = (vec![], vec![]);
    for run in 0..b.args.runs {
        let r = watch_baseline_once(b, deadline).await;
        eprintln!(
            "{name} run {run}: raw watch {:.0} events/s (writes {:.0}/s; per event: consumer {:.1} us CPU, {:.2} wake-ups [{}]; process {:.1} us, etcd {:.1} us)",
            r.rate, r.writes, r.consumer_cpu_us, r.wakeups, r.by_thread, r.own_cpu_us, r.etcd_cpu_us
        );
        base.push(r.rate);
        base_w.push(r.writes);
        base_cpu.push(r.consumer_cpu_us);
        base_own.push(r.own_cpu_us);
        base_wake.push(r.wakeups);
        base_etcd.push(r.etcd_cpu_us);
        base_threads.push(r.by_thread);
        let r = watch_informer_once(b, handlers, deadline).await;
        eprintln!(
            "{name} run {run}: informer ({handlers} handler(s)) {:.0} events/s (writes {:.0}/s; per event: consumer {:.1} us CPU, {:.2} wake-ups [{}]; process {:.1} us, etcd {:.1} us)",
            r.rate, r.writes, r.consumer_cpu_us, r.wakeups, r.by_thread, r.own_cpu_us, r.etcd_cpu_us
        );
        inf.push(r.rate);
        inf_w.push(r.writes);
        inf_cpu.push(r.consumer_cpu_us);
        inf_own.push(r.own_cpu_us);
        inf_wake.push(r.wakeups);
        inf_etcd.push(r.etcd_cpu_us);
        inf_threads.push(r.by_thread);
    }
    let (baseline, informer) = (median(&base), median(&inf));
    let ratio = informer / baseline;
    let r0 = |v: &[f64]| v.iter().map(|x| x.round()).collect::<Vec<_>>();
    let mut line = b.base_json(name);
    line.insert("events".into(), json!(m));
    line.insert("handlers".into(), json!(handlers));
    line.insert("writers".into(), json!(b.args.writers));
    line.insert("baseline_runs".into(), json!(r0(&base)));
    line.insert("informer_runs".into(), json!(r0(&inf)));
    line.insert(
        "per_run_ratios".into(),
        json!(base
            .iter()
            .zip(&inf)
            .map(|(b, i)| round(i / b, 3))
            .collect::<Vec<_>>()),
    );
    line.insert(
        "baseline_writes_per_s".into(),
        json!(median(&base_w).round()),
    );
    line.insert(
        "informer_writes_per_s".into(),
        json!(median(&inf_w).round()),
    );
    for (field, v) in [
        ("baseline_consumer_cpu_us_per_event", &base_cpu),
        ("informer_consumer_cpu_us_per_event", &inf_cpu),
        ("baseline_wakeups_per_event", &base_wake),
        ("informer_wakeups_per_event", &inf_wake),
        ("baseline_bench_cpu_us_per_event", &base_own),
        ("informer_bench_cpu_us_per_event", &inf_own),
        ("baseline_etcd_cpu_us_per_event", &base_etcd),
        ("informer_etcd_cpu_us_per_event", &inf_etcd),
    ] {
        line.insert(field.into(), json!(round(median(v), 2)));
    }
    // Per run: "thread name CPU us/wake-ups" per event, by thread name.
    line.insert("baseline_by_thread_runs".into(), json!(base_threads));
    line.insert("informer_by_thread_runs".into(), json!(inf_threads));
    // The performance issue's targets, for one handler and for many: the throughput ratio, and
    // the CPU the consumer's threads spend per event beyond the raw watch's (the stable
    // measure: the writers' threads, most of the process's CPU, are left out).
    let need = 0.97;
    let cpu_allowance = if handlers == 1 { 3.0 } else { 4.0 };
    let cpu_diff = median(&inf_cpu) - median(&base_cpu);
    line.insert("cpu_us_per_event_diff".into(), json!(round(cpu_diff, 1)));
    line.insert(
        "cpu_us_per_event_diff_runs".into(),
        json!(base_cpu
            .iter()
            .zip(&inf_cpu)
            .map(|(b, i)| round(i - b, 1))
            .collect::<Vec<_>>()),
    );
    let row = Row {
        scenario: name.into(),
        baseline,
        informer,
        ratio,
        unit: "events/s".into(),
        target: format!(
            ">= {need}x raw, CPU/event <= raw + {cpu_allowance} us (here {cpu_diff:+.1})"
        ),
        met: Some(ratio >= need && cpu_diff <= cpu_allowance),
    };
    emit(line, &row, false)
}

/// Latencies (µs) of K paced puts reaching `sink`.
pub(super) async fn paced_puts(b: &Bench, sink: &Sink, seq0: u64, key0: usize) -> Vec<f64> {
    let k = b.args.latency_puts;
    let mut sent = vec![0u64; k];
    let mut client = b.writer.clone();
    let mut tick = tokio::time::interval(Duration::from_nanos(1_000_000_000 / b.args.latency_rate));
    for (j, slot) in sent.iter_mut().enumerate() {
        tick.tick().await;
        let i = (key0 + j) % b.args.keys;
        let value = make_value(i, seq0 + j as u64, b.args.value_bytes);
        let key = full_key(&b.prefix, i);
        *slot = Instant::now().duration_since(sink.base).as_nanos() as u64;
        client
            .put(key, value, None)
            .await
            .unwrap_or_else(|e| fail(format!("put: {e}")));
    }
    sink.wait("latency", Duration::from_secs(60)).await;
    let mut lat: Vec<f64> = sent
        .iter()
        .zip(&sink.arrivals)
        .map(|(s, a)| (a.load(Ordering::Relaxed) as f64 - *s as f64) / 1000.0)
        .collect();
    lat.sort_by(f64::total_cmp);
    lat
}

pub(super) async fn scenario_latency(b: &Bench) -> Row {
    let k = b.args.latency_puts;
    let (mut b50, mut b99, mut i50, mut i99, mut bmax, mut imax) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    for run in 0..b.args.runs {
        {
            let (seq0, key0) = b.reserve(k);
            let revision = b.current_revision().await;
            let sink = Sink::new(k, seq0, true, Instant::now());
            let _watch = b.raw_watch(revision, false, sink.clone()).await;
            let lat = paced_puts(b, &sink, seq0, key0).await;
            let (p50, p99) = (percentile(&lat, 50.0), percentile(&lat, 99.0));
            eprintln!(
                "latency run {run}: raw watch p50 {:.3} ms p99 {:.3} ms",
                p50 / 1e3,
                p99 / 1e3
            );
            b50.push(p50);
            b99.push(p99);
            bmax.push(lat[lat.len() - 1]);
        }
        {
            let (seq0, key0) = b.reserve(k);
            let sink = Sink::new(k, seq0, true, Instant::now());
            let running = b.synced_informer(std::slice::from_ref(&sink)).await;
            let lat = paced_puts(b, &sink, seq0, key0).await;
            running.shutdown().await;
            let (p50, p99) = (percentile(&lat, 50.0), percentile(&lat, 99.0));
            eprintln!(
                "latency run {run}: informer p50 {:.3} ms p99 {:.3} ms",
                p50 / 1e3,
                p99 / 1e3
            );
            i50.push(p50);
            i99.push(p99);
            imax.push(lat[lat.len() - 1]);
        }
    }
    let ms = |v: &[f64]| round(median(v) / 1e3, 4);
    let (baseline, informer) = (median(&b99) / 1e3, median(&i99) / 1e3);
    let diff = informer - baseline;
    let mut line = b.base_json("latency");
    line.insert("puts".into(), json!(k));
    line.insert("puts_per_s".into(), json!(b.args.latency_rate));
    line.insert("baseline_p50_ms".into(), json!(ms(&b50)));
    line.insert("informer_p50_ms".into(), json!(ms(&i50)));
    line.insert("baseline_p99_ms".into(), json!(ms(&b99)));
    line.insert("informer_p99_ms".into(), json!(ms(&i99)));
    line.insert("baseline_max_ms".into(), json!(ms(&bmax)));
    line.insert("informer_max_ms".into(), json!(ms(&imax)));
    line.insert("p99_diff_ms".into(), json!(round(diff, 4)));
    let r3 = |v: &[f64]| v.iter().map(|x| round(x / 1e3, 3)).collect::<Vec<_>>();
    line.insert("baseline_p99_runs_ms".into(), json!(r3(&b99)));
    line.insert("informer_p99_runs_ms".into(), json!(r3(&i99)));
    let row = Row {
        scenario: "latency".into(),
        baseline,
        informer,
        ratio: informer / baseline,
        unit: "ms p99".into(),
        target: "p99 <= raw p99 + 0.1 ms".into(),
        met: Some(diff <= 0.1),
    };
    emit(line, &row, true)
}

/// Read your own writes: K puts one after another, each followed by `wait_for_revision` with
/// the revision the put returned. Beside each wait, when the informer's handler heard of the
/// same put (the cache held it by then): the wait's own cost is the difference. Then K/10 puts
/// outside the prefix, each waited for the same way (a revision the watch never brings).
pub(super) async fn scenario_ryw(b: &Bench) -> Row {
    let k = b.args.latency_puts;
    let (mut h50, mut h99, mut w50, mut w99) = (vec![], vec![], vec![], vec![]);
    let (mut etcd, mut e50) = (vec![], vec![]);
    for run in 0..b.args.runs {
        let (seq0, key0) = b.reserve(k);
        let sink = Sink::new(k, seq0, true, Instant::now());
        let running = b.synced_informer(std::slice::from_ref(&sink)).await;
        let mut client = b.writer.clone();
        let (mut sent, mut waited) = (Vec::with_capacity(k), Vec::with_capacity(k));
        let cpu = CpuMark::now(b.etcd_pid);
        for j in 0..k {
            let i = (key0 + j) % b.args.keys;
            let value = make_value(i, seq0 + j as u64, b.args.value_bytes);
            let started = Instant::now();
            sent.push(started.duration_since(sink.base).as_nanos() as u64);
            let put = client
                .put(full_key(&b.prefix, i), value, None)
                .await
                .unwrap_or_else(|e| fail(format!("put: {e}")));
            let revision = put.header().map_or(0, |h| h.revision());
            running
                .informer
                .wait_for_revision(revision, Duration::from_secs(10))
                .await
                .unwrap_or_else(|e| fail(e));
            waited.push(started.elapsed().as_nanos() as f64 / 1000.0);
        }
        let (_, etcd_us) = cpu.per_event(b.etcd_pid, k);
        // A revision written outside the prefix: the watch never brings it, so each wait
        // takes its head start, then etcd's proof.
        let elsewhere_key = format!("{}~ryw-elsewhere", b.prefix.trim_end_matches('/'));
        let mut elsewhere = Vec::with_capacity(k / 10);
        for _ in 0..(k / 10).max(1) {
            let started = Instant::now();
            let put = client
                .put(elsewhere_key.as_str(), "x", None)
                .await
                .unwrap_or_else(|e| fail(format!("put: {e}")));
            let revision = put.header().map_or(0, |h| h.revision());
            running
                .informer
                .wait_for_revision(revision, Duration::from_secs(10))
                .await
                .unwrap_or_else(|e| fail(e));
            elsewhere.push(started.elapsed().as_nanos() as f64 / 1000.0);
        }
        elsewhere.sort_by(f64::total_cmp);
        sink.wait("ryw", Duration::from_secs(60)).await;
        running.shutdown().await;
        let mut heard: Vec<f64> = sent
            .iter()
            .zip(&sink.arrivals)
            .map(|(s, a)| (a.load(Ordering::Relaxed) as f64 - *s as f64) / 1000.0)
            .collect();
        heard.sort_by(f64::total_cmp);
        waited.sort_by(f64::total_cmp);
        eprintln!(
            "ryw run {run}: handler heard p50 {:.3} ms p99 {:.3} ms; wait returned p50 {:.3} ms p99 {:.3} ms; etcd CPU {etcd_us:.0} us/put; written elsewhere: wait returned p50 {:.3} ms p99 {:.3} ms",
            percentile(&heard, 50.0) / 1e3,
            percentile(&heard, 99.0) / 1e3,
            percentile(&waited, 50.0) / 1e3,
            percentile(&waited, 99.0) / 1e3,
            percentile(&elsewhere, 50.0) / 1e3,
            percentile(&elsewhere, 99.0) / 1e3,
        );
        e50.push(percentile(&elsewhere, 50.0));
        etcd.push(etcd_us);
        h50.push(percentile(&heard, 50.0));
        h99.push(percentile(&heard, 99.0));
        w50.push(percentile(&waited, 50.0));
        w99.push(percentile(&waited, 99.0));
    }
    let ms = |v: &[f64]| round(median(v) / 1e3, 4);
    let (heard, waited) = (median(&h50) / 1e3, median(&w50) / 1e3);
    let mut line = b.base_json("ryw");
    line.insert("puts".into(), json!(k));
    line.insert("handler_p50_ms".into(), json!(ms(&h50)));
    line.insert("handler_p99_ms".into(), json!(ms(&h99)));
    line.insert("wait_p50_ms".into(), json!(ms(&w50)));
    line.insert("wait_p99_ms".into(), json!(ms(&w99)));
    line.insert("etcd_cpu_us_per_put".into(), json!(round(median(&etcd), 1)));
    line.insert("elsewhere_wait_p50_ms".into(), json!(ms(&e50)));
    let row = Row {
        scenario: "ryw".into(),
        baseline: heard,
        informer: waited,
        ratio: waited / heard,
        unit: "ms p50".into(),
        target: "wait p50 <= handler p50 + 0.1 ms".into(),
        met: Some(waited - heard <= 0.1),
    };
    emit(line, &row, true)
}

/// Runs a memory child; returns its JSON report.
pub(super) async fn memory_child(b: &Bench, kind: &str, handlers: usize) -> Value {
    let exe = std::env::current_exe().unwrap_or_else(|e| fail(e));
    let output = tokio::process::Command::new(exe)
        .arg("--child")
        .arg(kind)
        .arg("--endpoints")
        .arg(b.endpoints.join(","))
        .arg("--prefix")
        .arg(&b.prefix)
        .arg("--keys")
        .arg(b.args.keys.to_string())
        .arg("--page-size")
        .arg(b.args.page_size.to_string())
        .arg("--handlers")
        .arg(handlers.to_string())
        .arg("--processing")
        .arg(match b.args.processing {
            Processing::DeltaFifo => "delta-fifo",
            _ => "atomic",
        })
        .stderr(std::process::Stdio::inherit())
        .output()
        .await
        .unwrap_or_else(|e| fail(format!("running the {kind} child: {e}")));
    if !output.status.success() {
        fail(format!("the {kind} child failed: {}", output.status));
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| fail(format!("the {kind} child printed no report")));
    serde_json::from_str(line).unwrap_or_else(|e| fail(format!("{kind} child report: {e}")))
}

/// The memory scenario's row, and rows for its other targets (relist peaks, the compact cache).
pub(super) async fn scenario_memory(b: &Bench) -> (Row, Vec<Row>) {
    let n = b.args.keys as f64;
    let per = |v: &Value, field: &str| -> f64 {
        let before = v["rss_before"].as_f64().unwrap_or(f64::NAN);
        (v[field].as_f64().unwrap_or(f64::NAN) - before) / n
    };
    let h = b.args.handlers;
    let mut cols: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for run in 0..b.args.runs {
        let raw = memory_child(b, "memory-raw", 0).await;
        let inf = memory_child(b, "memory-informer", 0).await;
        let infh = memory_child(b, "memory-informer", h).await;
        let relist = memory_child(b, "relist-informer", 0).await;
        let compact = memory_child(b, "memory-compact", 0).await;
        let relist_compact = memory_child(b, "relist-compact", 0).await;
        compact_figures(&mut cols, run, &raw, &inf, &compact, &relist_compact, n);
        let field = |f: &str| relist[f].as_f64().unwrap_or(f64::NAN);
        let (before, steady, peak) = (field("rss_before"), field("rss_steady"), field("rss_peak"));
        // The cache's memory at its peak during the relist, against its steady state.
        let peak_ratio = (peak - before) / (steady - before);
        cols.entry("relist_peak_ratio")
            .or_default()
            .push(peak_ratio);
        cols.entry("relist_peak_rss_ratio")
            .or_default()
            .push(peak / steady);
        cols.entry("relist_list_s")
            .or_default()
            .push(field("relist_list_s"));
        eprintln!(
            "memory run {run}: relist after compaction: steady {:.0} MB, peak {:.0} MB (cache x{peak_ratio:.2}, process x{:.2}), list {:.2} s",
            (steady - before) / 1e6,
            (peak - before) / 1e6,
            peak / steady,
            field("relist_list_s"),
        );
        for (name, v) in [("raw", &raw), ("informer", &inf), ("informer_h", &infh)] {
            cols.entry(name).or_default().push(per(v, "rss_trimmed"));
            let untrimmed: &'static str = match name {
                "raw" => "raw_untrimmed",
                "informer" => "informer_untrimmed",
                _ => "informer_h_untrimmed",
            };
            cols.entry(untrimmed).or_default().push(per(v, "rss_after"));
        }
        eprintln!(
            "memory run {run}: raw {:.0} B/object ({:.0} untrimmed), informer {:.0} ({:.0}), with {h} handlers {:.0} ({:.0})",
            per(&raw, "rss_trimmed"),
            per(&raw, "rss_after"),
            per(&inf, "rss_trimmed"),
            per(&inf, "rss_after"),
            per(&infh, "rss_trimmed"),
            per(&infh, "rss_after"),
        );
    }
    let med = |k: &str| median(cols.get(k).map_or(&[][..], |v| &v[..]));
    let (baseline, informer) = (med("raw"), med("informer"));
    let mut line = b.base_json("memory");
    line.insert("page_size".into(), json!(b.args.page_size));
    line.insert("handlers".into(), json!(h));
    line.insert(
        "informer_with_handlers_b_per_object".into(),
        json!(med("informer_h").round()),
    );
    line.insert(
        "ratio_with_handlers".into(),
        json!(round(med("informer_h") / baseline, 3)),
    );
    line.insert(
        "baseline_untrimmed_b_per_object".into(),
        json!(med("raw_untrimmed").round()),
    );
    line.insert(
        "informer_untrimmed_b_per_object".into(),
        json!(med("informer_untrimmed").round()),
    );
    line.insert(
        "informer_with_handlers_untrimmed_b_per_object".into(),
        json!(med("informer_h_untrimmed").round()),
    );
    line.insert(
        "relist_peak_ratio".into(),
        json!(round(med("relist_peak_ratio"), 3)),
    );
    line.insert(
        "relist_peak_rss_ratio".into(),
        json!(round(med("relist_peak_rss_ratio"), 3)),
    );
    line.insert(
        "relist_list_s".into(),
        json!(round(med("relist_list_s"), 3)),
    );
    line.insert(
        "ratio_untrimmed".into(),
        json!(round(med("informer_untrimmed") / med("raw_untrimmed"), 3)),
    );
    for (name, values) in &cols {
        if name.starts_with("compact_") || name.starts_with("reads_") || name.starts_with("sync_") {
            line.insert((*name).to_owned(), json!(round(median(values), 3)));
        }
    }
    let ratio = informer / baseline;
    let row = Row {
        scenario: "memory".into(),
        baseline,
        informer,
        ratio,
        unit: "B/object".into(),
        target: "<= 1.10x raw".into(),
        met: Some(ratio <= 1.10),
    };
    // Targets checked on figures of the same JSON line: no line of their own.
    let peak = med("relist_peak_ratio");
    let compact_peak = med("compact_relist_peak_ratio");
    let kv = med("compact_kv_bytes_per_object");
    let compact = med("compact_b_per_object");
    let more = vec![
        Row {
            scenario: "relist peak".into(),
            baseline: 1.0,
            informer: peak,
            ratio: peak,
            unit: "peak / steady".into(),
            target: "<= 1.5".into(),
            met: Some(peak <= 1.5),
        },
        Row {
            scenario: "compact cache".into(),
            baseline: kv,
            informer: compact,
            ratio: compact / kv,
            unit: "B/object vs key + value".into(),
            target: "<= 1.3x key + value bytes".into(),
            met: Some(compact / kv <= 1.3),
        },
        Row {
            scenario: "compact relist peak".into(),
            baseline: 1.0,
            informer: compact_peak,
            ratio: compact_peak,
            unit: "peak / steady".into(),
            target: "<= 1.5".into(),
            met: Some(compact_peak <= 1.5),
        },
    ];
    (emit(line, &row, true), more)
}

/// The compact cache's figures of one memory run: memory per object against the raw key and
/// value bytes (target 1.5x) and the raw map, its relist peak, and what reads and the first
/// sync cost against the default cache.
fn compact_figures(
    cols: &mut BTreeMap<&'static str, Vec<f64>>,
    run: usize,
    raw: &Value,
    informer: &Value,
    compact: &Value,
    relist: &Value,
    n: f64,
) {
    let f = |v: &Value, field: &str| v[field].as_f64().unwrap_or(f64::NAN);
    let read = |v: &Value, field: &str| v["reads"][field].as_f64().unwrap_or(f64::NAN);
    let kv = f(raw, "kv_bytes") / n;
    let per = (f(compact, "rss_trimmed") - f(compact, "rss_before")) / n;
    let raw_per = (f(raw, "rss_trimmed") - f(raw, "rss_before")) / n;
    let heap_per = (f(compact, "heap") - f(compact, "heap_before")) / n;
    let (before, steady, peak) = (
        f(relist, "rss_before"),
        f(relist, "rss_steady"),
        f(relist, "rss_peak"),
    );
    let figures: [(&'static str, f64); 16] = [
        ("compact_b_per_object", per),
        ("compact_heap_b_per_object", heap_per),
        ("compact_heap_ratio_to_kv_bytes", heap_per / kv),
        ("compact_kv_bytes_per_object", kv),
        ("compact_ratio_to_kv_bytes", per / kv),
        ("compact_ratio_to_raw", per / raw_per),
        (
            "compact_relist_peak_ratio",
            (peak - before) / (steady - before),
        ),
        ("compact_relist_list_s", f(relist, "relist_list_s")),
        ("reads_get_ns_default", read(informer, "get_ns")),
        ("reads_get_ns_compact", read(compact, "get_ns")),
        ("reads_list_ms_default", read(informer, "list_ms")),
        ("reads_list_ms_compact", read(compact, "list_ms")),
        ("reads_by_index_ms_default", read(informer, "by_index_ms")),
        ("reads_by_index_ms_compact", read(compact, "by_index_ms")),
        ("sync_s_default", f(informer, "sync_s")),
        ("sync_s_compact", f(compact, "sync_s")),
    ];
    for (name, value) in figures {
        cols.entry(name).or_default().push(value);
    }
    eprintln!(
        "memory run {run}: compact {per:.0} B/object = x{:.2} the {kv:.0} key + value bytes (x{:.2} raw; heap {heap_per:.0} B, x{:.2}); relist peak x{:.2}; get {:.0} ns vs {:.0}, list {:.1} ms vs {:.1}, by_index {:.2} ms vs {:.2}, sync {:.2} s vs {:.2}",
        per / kv,
        per / raw_per,
        heap_per / kv,
        (peak - before) / (steady - before),
        read(compact, "get_ns"),
        read(informer, "get_ns"),
        read(compact, "list_ms"),
        read(informer, "list_ms"),
        read(compact, "by_index_ms"),
        read(informer, "by_index_ms"),
        f(compact, "sync_s"),
        f(informer, "sync_s"),
    );
}

/// Puts per prevkv measurement: a quarter of `--events` (prev_kv writes are slow).
pub(super) fn prevkv_events(b: &Bench) -> usize {
    (b.args.events / 4).max(1)
}

/// etcd's write rate with a raw watch open on the prefix, with or without prev_kv.
pub(super) async fn writes_with_watch(b: &Bench, prev_kv: bool) -> f64 {
    let m = prevkv_events(b);
    let revision = b.current_revision().await;
    let sink = Sink::new(m, 0, false, Instant::now());
    let _watch = b.raw_watch(revision, prev_kv, sink.clone()).await;
    let (_, took) = b.write_updates(m).await;
    sink.wait(
        if prev_kv { "prev_kv watch" } else { "watch" },
        Duration::from_secs(120),
    )
    .await;
    m as f64 / took.as_secs_f64()
}

pub(super) async fn scenario_prevkv(b: &Bench) -> Row {
    let (mut without, mut with) = (vec![], vec![]);
    for run in 0..b.args.runs {
        let w = writes_with_watch(b, false).await;
        let p = writes_with_watch(b, true).await;
        eprintln!(
            "prevkv run {run}: writes/s with a plain watch {w:.0}, with a prev_kv watch {p:.0}"
        );
        without.push(w);
        with.push(p);
    }
    let (baseline, informer) = (median(&without), median(&with));
    let mut line = b.base_json("prevkv");
    line.insert("events".into(), json!(prevkv_events(b)));
    line.insert("writers".into(), json!(b.args.writers));
    line.insert(
        "note".into(),
        json!("baseline: etcd writes/s with a plain watch; informer column: with a prev_kv watch"),
    );
    line.insert(
        "without_prev_kv_runs".into(),
        json!(without.iter().map(|x| x.round()).collect::<Vec<_>>()),
    );
    line.insert(
        "with_prev_kv_runs".into(),
        json!(with.iter().map(|x| x.round()).collect::<Vec<_>>()),
    );
    let row = Row {
        scenario: "prevkv".into(),
        baseline,
        informer,
        ratio: informer / baseline,
        unit: "writes/s".into(),
        target: "(informational)".into(),
        met: None,
    };
    emit(line, &row, false)
}

/// What the metrics cost on the watch path: CPU per event of this process (informer, one
/// handler, writers) with the informer's metrics going nowhere (the facade's no-op recorder:
/// the baseline) and into a Prometheus recorder with buckets (counters, gauges, and the stage
/// histograms with their clock reads). Lower is better.
pub(super) async fn scenario_metrics(b: &Bench) -> Row {
    let m = b.args.events;
    let deadline = Duration::from_secs(60 + (m / 1000) as u64);
    let buckets: Vec<f64> = (0..19).map(|i| 0.000_05 * 2f64.powi(i)).collect();
    let (mut off, mut on) = (vec![], vec![]);
    for run in 0..b.args.runs {
        let r = watch_informer_recorded(b, 1, deadline, None).await;
        eprintln!(
            "metrics run {run}: no recorder: {:.0} events/s, CPU/event {:.2} us",
            r.rate, r.own_cpu_us
        );
        off.push(r.own_cpu_us);
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new()
            .set_buckets(&buckets)
            .unwrap_or_else(|e| fail(e))
            .build_recorder();
        let r = watch_informer_recorded(b, 1, deadline, Some(&recorder)).await;
        let rendered = recorder.handle().render();
        if !rendered.contains("stage=\"watch_to_cache\"") {
            fail("the recorder got no stage histogram");
        }
        eprintln!(
            "metrics run {run}: Prometheus recorder: {:.0} events/s, CPU/event {:.2} us",
            r.rate, r.own_cpu_us
        );
        on.push(r.own_cpu_us);
    }
    let (baseline, informer) = (median(&off), median(&on));
    let mut line = b.base_json("metrics");
    line.insert("events".into(), json!(m));
    line.insert("no_recorder_cpu_us_runs".into(), json!(off));
    line.insert("recorder_cpu_us_runs".into(), json!(on));
    // The clock reads the stage histograms add, per event here (one apply per event, one
    // handler): Instant::now at receipt, at apply, and elapsed() at apply and at delivery.
    let t = Instant::now();
    let mut last = t;
    for _ in 0..1_000_000 {
        last = std::hint::black_box(Instant::now());
    }
    let clock_ns = last.duration_since(t).as_nanos() as f64 / 1e6;
    line.insert("clock_read_ns".into(), json!(round(clock_ns, 1)));
    let row = Row {
        scenario: "metrics".into(),
        baseline,
        informer,
        ratio: informer / baseline,
        unit: "CPU us/event".into(),
        target: format!(
            "stated, not a target (recorder - none: {:+.2} us/event)",
            informer - baseline
        ),
        met: None,
    };
    emit(line, &row, true)
}

/// The audit's cost (issue 26): a synced informer over the N keys audits its cache against
/// etcd (`audit_now`) R times: the time of each, the bytes etcd sent for it (keys only) beside
/// the bytes of a full list of the same keys, and the CPU of this process and of etcd. The
/// "baseline" column is the full list's time (an informer's sync), the "informer" column the
/// audit's: lower is better.
pub(super) async fn scenario_audit(b: &Bench) -> Row {
    let endpoint = b.endpoints.first().cloned().unwrap_or_default();
    let client = b.informer_client().await;
    let sent = etcd_sent_bytes(&endpoint);
    let started = Instant::now();
    let informer = b.informer(client, b.args.page_size);
    let task = tokio::spawn(informer.clone().run());
    while !informer.has_synced() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let list_s = started.elapsed().as_secs_f64();
    let list_bytes = etcd_sent_bytes(&endpoint) - sent;
    let (mut took, mut bytes, mut own, mut etcd) = (vec![], vec![], vec![], vec![]);
    for run in 0..b.args.runs {
        // Wait for a quiet moment: an audit is skipped while changes are queued.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let sent = etcd_sent_bytes(&endpoint);
        let cpu = CpuMark::now(b.etcd_pid);
        let mut report = None;
        for _ in 0..50 {
            report = informer.audit_now().await;
            if report.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let Some(report) = report else {
            fail(format!("the audit did not run: {:?}", informer.health()));
        };
        let (own_us, etcd_us) = cpu.per_event(b.etcd_pid, 1);
        let audit_bytes = etcd_sent_bytes(&endpoint) - sent;
        if report.differing != 0 || report.keys != b.args.keys {
            fail(format!("the audit of a quiet cache: {report:?}"));
        }
        eprintln!(
            "audit run {run}: {} keys in {:.3} s, {:.1} MB from etcd, CPU: bench {:.3} s, etcd {:.3} s",
            report.keys,
            report.took.as_secs_f64(),
            audit_bytes / 1e6,
            own_us / 1e6,
            etcd_us / 1e6
        );
        took.push(report.took.as_secs_f64());
        bytes.push(audit_bytes);
        own.push(own_us / 1e6);
        etcd.push(etcd_us / 1e6);
    }
    informer.stop();
    let _ = task.await;
    let audit_s = median(&took);
    let mut line = b.base_json("audit");
    line.insert("list_s".into(), json!(round(list_s, 3)));
    line.insert("list_mb".into(), json!(round(list_bytes / 1e6, 2)));
    line.insert(
        "audit_s_runs".into(),
        json!(took.iter().map(|t| round(*t, 3)).collect::<Vec<_>>()),
    );
    line.insert("audit_mb".into(), json!(round(median(&bytes) / 1e6, 2)));
    line.insert("audit_cpu_s".into(), json!(round(median(&own), 3)));
    line.insert("audit_etcd_cpu_s".into(), json!(round(median(&etcd), 3)));
    let row = Row {
        scenario: "audit".into(),
        baseline: list_s,
        informer: audit_s,
        ratio: audit_s / list_s,
        unit: "s".into(),
        target: "stated, not a target (the audit vs a full list)".into(),
        met: None,
    };
    emit(line, &row, true)
}
