//! The `restart` scenario: an informer starting cold (a list) against one starting warm from
//! its snapshot (issue 26), within etcd's compaction window and past it.

use super::*;

/// What one start cost.
struct Start {
    /// Until `has_synced`.
    synced_s: f64,
    /// Until the cache held etcd's revision as of just before the start (the changes made while
    /// the informer was down applied, a relist past a compaction done).
    current_s: f64,
    /// Bytes etcd sent to gRPC clients meanwhile (its own counter; only the informer reads).
    bytes: f64,
    /// This process's resident set once the informer was current, beyond what it was before
    /// the informer was created (both after giving freed memory back).
    resident_mb: f64,
    how: String,
}

fn snapshot_options(path: &std::path::Path) -> etcd_informer::snapshot::SnapshotOptions<ConfigMap> {
    // A period longer than the measurement: only the explicit writes happen.
    etcd_informer::snapshot::SnapshotOptions::new(path, JsonCodec::<ConfigMap>::new())
        .with_period(Duration::from_secs(3600))
}

async fn informer(b: &Bench, snapshot: Option<&std::path::Path>) -> SharedIndexInformer<ConfigMap> {
    let lw = EtcdListerWatcher::with_options(
        b.informer_client().await,
        b.prefix.clone(),
        JsonCodec::<ConfigMap>::new(),
        EtcdOptions::default().with_page_size(b.args.page_size),
    )
    .unwrap_or_else(|e| fail(e));
    let mut options = InformerOptions::default().with_name("bench");
    if b.args.compact {
        options = options.with_compact_cache(JsonCodec::<ConfigMap>::new());
    }
    if b.args.unique_index {
        options = options.with_index("by-key", |o: &etcd_informer::Object<ConfigMap>| {
            vec![o.key().to_owned()]
        });
    }
    if let Some(path) = snapshot {
        options = options.with_snapshot_options(snapshot_options(path));
    }
    SharedIndexInformer::new(lw, options)
}

/// Starts an informer (warm from `snapshot` if given), measures it, and stops it.
async fn measure_start(b: &Bench, snapshot: Option<&std::path::Path>) -> Start {
    trim_malloc();
    let resident_before = rss_bytes();
    let target = b.current_revision().await;
    let endpoint = b.endpoints[0].clone();
    let before = etcd_sent_bytes(&endpoint);
    let started = Instant::now();
    let informer = informer(b, snapshot).await;
    let task = tokio::spawn(informer.clone().run());
    let deadline = Duration::from_secs(600);
    let mut synced_s = None;
    let done = tokio::time::timeout(deadline, async {
        loop {
            if synced_s.is_none() && informer.has_synced() {
                synced_s = Some(started.elapsed().as_secs_f64());
            }
            if synced_s.is_some() && informer.revision() >= target {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    if done.is_err() {
        fail(format!("the informer did not catch up within {deadline:?}"));
    }
    let current_s = started.elapsed().as_secs_f64();
    let bytes = etcd_sent_bytes(&endpoint) - before;
    trim_malloc();
    let resident_mb = rss_bytes().saturating_sub(resident_before) as f64 / 1e6;
    let how = match informer.snapshot_start() {
        Some(start) => start.to_string(),
        None => "cold start (no snapshot option)".into(),
    };
    stop_informer(informer, task).await;
    Start {
        synced_s: synced_s.unwrap_or(current_s),
        current_s,
        bytes,
        resident_mb,
        how,
    }
}

fn medians(runs: &[Start]) -> (f64, f64, f64, f64) {
    let pick = |f: fn(&Start) -> f64| median(&runs.iter().map(f).collect::<Vec<_>>());
    (
        pick(|s| s.synced_s),
        pick(|s| s.current_s),
        pick(|s| s.bytes),
        pick(|s| s.resident_mb),
    )
}

fn describe(side: &str, s: &Start) {
    eprintln!(
        "restart {side}: synced {:.3} s, current {:.3} s, {:.1} MB from etcd, {:.1} MB resident; {}",
        s.synced_s,
        s.current_s,
        s.bytes / 1e6,
        s.resident_mb,
        s.how
    );
}

/// Cold, warm within the compaction window, warm past it; three rows.
pub(super) async fn scenario_restart(b: &Bench) -> Vec<Row> {
    let dir = std::env::temp_dir().join(format!("etcd-informer-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| fail(format!("{}: {e}", dir.display())));
    let path = dir.join("restart.snap");
    let saved = dir.join("restart.snap.saved");
    let runs = b.args.runs.max(1);
    // Changes while the informer is down: 0.1% of the keys.
    let changes = (b.args.keys / 1000).max(1);

    let mut cold = Vec::new();
    for _ in 0..runs {
        let s = measure_start(b, None).await;
        describe("cold", &s);
        cold.push(s);
    }

    // The snapshot: an informer synced, written once, copied aside so every warm run starts
    // from the same file (a stopping informer writes its own).
    let _ = std::fs::remove_file(&path);
    let writer = informer(b, Some(&path)).await;
    let task = tokio::spawn(writer.clone().run());
    writer.wait_for_cache_sync().await;
    trim_malloc();
    // The peak from here on: without a reset it would be the cold lists' (None).
    let before = reset_peak_rss().then(peak_rss_bytes);
    let t = Instant::now();
    let written = writer.write_snapshot().await.unwrap_or_else(|e| fail(e));
    let write_s = t.elapsed().as_secs_f64();
    // What the write held in memory at its peak, beyond the cache itself.
    let write_peak_mb = before.map(|before| peak_rss_bytes().saturating_sub(before) as f64 / 1e6);
    if write_peak_mb.is_none() {
        eprintln!("the peak resident set could not be reset: the write's peak is not measured");
    }
    stop_informer(writer, task).await;
    let file_bytes = std::fs::metadata(&path).map_or(0, |m| m.len());
    eprintln!(
        "snapshot at revision {written:?}: {:.1} MB written in {write_s:.3} s, {:.1} MB more resident at the peak",
        file_bytes as f64 / 1e6,
        write_peak_mb.unwrap_or(f64::NAN)
    );
    std::fs::copy(&path, &saved).unwrap_or_else(|e| fail(e));
    b.write_updates(changes).await;

    let mut warm = Vec::new();
    for _ in 0..runs {
        std::fs::copy(&saved, &path).unwrap_or_else(|e| fail(e));
        let s = measure_start(b, Some(&path)).await;
        describe("warm", &s);
        if !s.how.starts_with("warm start") || s.how.contains("compaction") {
            fail(format!("expected a warm start, got: {}", s.how));
        }
        warm.push(s);
    }

    b.write_updates(changes).await;
    let now = b.current_revision().await;
    b.writer
        .clone()
        .compact(now, None)
        .await
        .unwrap_or_else(|e| fail(format!("compact: {e}")));
    let mut past = Vec::new();
    for _ in 0..runs {
        std::fs::copy(&saved, &path).unwrap_or_else(|e| fail(e));
        let s = measure_start(b, Some(&path)).await;
        describe("past compaction", &s);
        // Since issue 35 a compacted snapshot cannot be proven to be this store: cold.
        if !s.how.starts_with("cold start") || !s.how.contains("compacted") {
            fail(format!(
                "expected a cold start past a compaction, got: {}",
                s.how
            ));
        }
        past.push(s);
    }
    let _ = std::fs::remove_dir_all(&dir);

    let (cold_synced, cold_current, cold_bytes, cold_resident) = medians(&cold);
    let (warm_synced, warm_current, warm_bytes, warm_resident) = medians(&warm);
    let (past_synced, past_current, past_bytes, _) = medians(&past);
    let mut line = b.base_json("restart");
    line.insert("changes_while_down".into(), json!(changes));
    line.insert("snapshot_bytes".into(), json!(file_bytes));
    line.insert("snapshot_write_s".into(), json!(round(write_s, 3)));
    line.insert(
        "snapshot_write_peak_mb".into(),
        json!(write_peak_mb.map(|mb| round(mb, 1))),
    );
    for (name, runs) in [("cold", &cold), ("warm", &warm), ("past", &past)] {
        line.insert(
            format!("{name}_synced_s"),
            json!(runs
                .iter()
                .map(|s| round(s.synced_s, 3))
                .collect::<Vec<_>>()),
        );
        line.insert(
            format!("{name}_current_s"),
            json!(runs
                .iter()
                .map(|s| round(s.current_s, 3))
                .collect::<Vec<_>>()),
        );
        line.insert(
            format!("{name}_bytes"),
            json!(runs.iter().map(|s| s.bytes.round()).collect::<Vec<_>>()),
        );
        line.insert(
            format!("{name}_resident_mb"),
            json!(runs
                .iter()
                .map(|s| round(s.resident_mb, 1))
                .collect::<Vec<_>>()),
        );
    }
    line.insert("past_synced_s_median".into(), json!(round(past_synced, 3)));
    line.insert("past_bytes_median".into(), json!(past_bytes.round()));
    let time_ratio = warm_synced / cold_synced;
    let rows = vec![
        emit(
            line.clone(),
            &Row {
                scenario: "restart: warm to synced".into(),
                baseline: cold_synced,
                informer: warm_synced,
                ratio: time_ratio,
                unit: "s (cold / warm)".into(),
                target: "<= 0.1 (10x faster)".into(),
                met: Some(time_ratio <= 0.1),
            },
            true,
        ),
        emit(
            line.clone(),
            &Row {
                scenario: "restart: warm resident memory".into(),
                baseline: cold_resident,
                informer: warm_resident,
                ratio: warm_resident / cold_resident,
                unit: "MB once current (cold / warm)".into(),
                target: "<= 1.1".into(),
                met: Some(warm_resident / cold_resident <= 1.1),
            },
            true,
        ),
        emit(
            line.clone(),
            &Row {
                scenario: "restart: warm bytes read".into(),
                baseline: cold_bytes,
                informer: warm_bytes,
                ratio: warm_bytes / cold_bytes,
                unit: "bytes from etcd (cold / warm)".into(),
                target: "<= 0.01".into(),
                met: Some(warm_bytes / cold_bytes <= 0.01),
            },
            true,
        ),
        emit(
            line,
            &Row {
                scenario: "restart: past compaction, to current".into(),
                baseline: cold_current,
                informer: past_current,
                ratio: past_current / cold_current,
                unit: "s (cold / warm past compaction)".into(),
                target: "-".into(),
                met: None,
            },
            true,
        ),
    ];
    eprintln!(
        "restart medians: cold synced {cold_synced:.3} s current {cold_current:.3} s {:.1} MB; warm synced {warm_synced:.3} s current {warm_current:.3} s {:.3} MB; past compaction synced {past_synced:.3} s current {past_current:.3} s {:.1} MB",
        cold_bytes / 1e6,
        warm_bytes / 1e6,
        past_bytes / 1e6
    );
    rows
}
