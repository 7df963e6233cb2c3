//! The memory scenario's child processes: the bench re-executed with `--child`.

use etcd_informer::listwatch::{
    BoxFuture, Capabilities, Error as LwError, ListResult, ListSink, Result as LwResult,
    WatchEvent, WatchStream,
};

use super::*;

/// Syncs an informer, then ends its watch as a compaction would and samples the resident
/// memory every 5 ms while it lists and replaces everything (the relist peak).
async fn relist(client: &Client, prefix: &str, args: &Args, compact: bool) -> Res<Value> {
    let lw = etcd_source(client, prefix, args)?;
    let expire = Arc::new(Notify::new());
    let source = Expiring {
        inner: lw,
        expire: expire.clone(),
    };
    let informer = SharedIndexInformer::new(source, informer_options(args, compact));
    let task = tokio::spawn(informer.clone().run());
    while !informer.has_synced() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    trim_malloc();
    let steady = rss_bytes();
    let peak = Arc::new(AtomicU64::new(steady));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (peak, stop) = (peak.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(rss_bytes(), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let started = Instant::now();
    expire.notify_one();
    while informer.health().reflector.relists.compacted == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let listed = started.elapsed().as_secs_f64();
    // The relist is applied right after it is queued: allow for that, then a margin.
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.join();
    trim_malloc();
    let after = rss_bytes();
    let objects = informer.indexer().len();
    std::mem::forget(task);
    std::mem::forget(informer);
    Ok(json!({
        "kind": if compact { "relist-compact" } else { "relist-informer" },
        "objects": objects,
        "rss_steady": steady,
        "rss_peak": peak.load(Ordering::Relaxed),
        "rss_after_relist": after,
        "relist_list_s": listed,
    }))
}

/// The children's source: the prefix as JSON ConfigMaps, in pages of `--page-size`.
fn etcd_source(client: &Client, prefix: &str, args: &Args) -> Res<EtcdListerWatcher<ConfigMap>> {
    Ok(EtcdListerWatcher::with_options(
        client.clone(),
        prefix.to_owned(),
        JsonCodec::<ConfigMap>::new(),
        EtcdOptions::default().with_page_size(args.page_size),
    )?)
}

/// The informer's options in a child: `--processing`, and a compact cache if asked.
fn informer_options(args: &Args, compact: bool) -> InformerOptions<ConfigMap> {
    let options = InformerOptions::default().with_processing(args.processing);
    if compact {
        options.with_compact_cache(JsonCodec::<ConfigMap>::new())
    } else {
        options
    }
}

/// What reading the cache costs: `get_by_key` of random keys (ns per call), `list` of
/// everything and `by_index` of one namespace (ms per call, the result dropped after).
fn read_costs(informer: &SharedIndexInformer<ConfigMap>) -> Value {
    let indexer = informer.indexer();
    let mut keys = indexer.list_keys();
    fastrand::shuffle(&mut keys);
    keys.truncate(100_000);
    let started = Instant::now();
    let mut found = 0usize;
    for key in &keys {
        found += usize::from(indexer.get_by_key(key).is_some());
    }
    let get_ns = started.elapsed().as_nanos() as f64 / keys.len().max(1) as f64;
    assert_eq!(found, keys.len(), "every key listed is found");
    let timed = |f: &dyn Fn() -> usize| -> f64 {
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let started = Instant::now();
            let n = f();
            best = best.min(started.elapsed().as_secs_f64() * 1e3);
            std::hint::black_box(n);
        }
        best
    };
    let list_ms = timed(&|| indexer.list().len());
    let namespace = keys
        .first()
        .map(|k| k.split('/').next().unwrap_or("").to_owned());
    let by_index_ms = timed(&|| {
        let ns = namespace.as_deref().unwrap_or("");
        indexer
            .by_index(etcd_informer::NAMESPACE_INDEX, ns)
            .map_or(0, |v| v.len())
    });
    json!({ "get_ns": get_ns, "list_ms": list_ms, "by_index_ms": by_index_ms })
}

/// The etcd source, whose watch the bench can end with "compacted" once.
struct Expiring {
    inner: EtcdListerWatcher<ConfigMap>,
    expire: Arc<Notify>,
}

impl ListerWatcher<ConfigMap> for Expiring {
    fn list(&self) -> BoxFuture<'_, LwResult<ListResult<ConfigMap>>> {
        self.inner.list()
    }

    fn list_into(&self, sink: Arc<dyn ListSink<ConfigMap>>) -> BoxFuture<'_, LwResult<i64>> {
        self.inner.list_into(sink)
    }

    fn watch(&self, after: i64) -> BoxFuture<'_, LwResult<WatchStream<ConfigMap>>> {
        Box::pin(async move {
            let stream = self.inner.watch(after).await?;
            let expire = self.expire.clone();
            let expiry = ExpiryStream {
                notified: Box::pin(async move { expire.notified().await }),
                after,
                done: false,
            };
            Ok(Box::pin(tokio_stream::StreamExt::merge(stream, expiry)) as WatchStream<ConfigMap>)
        })
    }

    fn capabilities(&self) -> Capabilities<'_> {
        self.inner.capabilities()
    }
}

/// Yields one "compacted" error when notified.
struct ExpiryStream {
    notified: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
    after: i64,
    done: bool,
}

impl tokio_stream::Stream for ExpiryStream {
    type Item = WatchEvent<ConfigMap>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        if self.done {
            return std::task::Poll::Ready(None);
        }
        match std::future::Future::poll(self.notified.as_mut(), cx) {
            std::task::Poll::Ready(()) => {
                self.done = true;
                let error = LwError::expired(self.after + 1, "the bench expires the watch");
                std::task::Poll::Ready(Some(WatchEvent::Error(error)))
            }
            std::task::Poll::Pending => std::task::Poll::Pending,
        }
    }
}

pub(super) async fn run_child(args: &Args, kind: &str) -> Res<()> {
    let prefix = args.prefix.clone().ok_or("--prefix is required")?;
    let endpoints = args.endpoints.clone();
    let n = args.keys;
    let client = match kind {
        "memory-raw" => Client::connect(&endpoints, None).await?,
        _ => etcd_informer::connect(&endpoints).await?,
    };
    // Warm the connection up so that its buffers are counted before, not after.
    client
        .kv_client()
        .get(
            prefix.as_bytes(),
            Some(GetOptions::new().with_limit(1).with_keys_only()),
        )
        .await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (rss_before, heap_before) = (rss_bytes(), heap_in_use());
    let report = |objects: usize| -> Value {
        let rss_after = rss_bytes();
        trim_malloc();
        let rss_trimmed = rss_bytes();
        json!({
            "kind": kind,
            "objects": objects,
            "rss_before": rss_before,
            "rss_after": rss_after,
            "rss_trimmed": rss_trimmed,
            "heap_before": heap_before,
            "heap": heap_in_use(),
        })
    };
    let line = match kind {
        "memory-raw" => {
            let (map, _) = raw_list(&client, &prefix, args.page_size).await?;
            tokio::time::sleep(Duration::from_millis(200)).await;
            let mut line = report(map.len());
            std::mem::forget(map);
            // What etcd holds for each object: its key (relative to the prefix, as cached) and
            // its value, in bytes.
            let resp = client
                .kv_client()
                .max_decoding_message_size(MAX_MESSAGE)
                .get(prefix.as_bytes(), Some(GetOptions::new().with_prefix()))
                .await?;
            let bytes: usize = resp
                .kvs()
                .iter()
                .map(|kv| kv.key().len() - prefix.len() + kv.value().len())
                .sum();
            line["kv_bytes"] = json!(bytes);
            line
        }
        "memory-informer" | "memory-compact" => {
            let compact = kind == "memory-compact";
            let lw = etcd_source(&client, &prefix, args)?;
            let informer = SharedIndexInformer::new(lw, informer_options(args, compact));
            let seen = Arc::new(AtomicUsize::new(0));
            let mut registrations = Vec::new();
            for _ in 0..args.handlers {
                let seen = seen.clone();
                registrations.push(informer.add_event_handler(
                    ResourceEventHandlerFuncs::new().on_add(move |_, _| {
                        seen.fetch_add(1, Ordering::Relaxed);
                    }),
                )?);
            }
            let started = Instant::now();
            let task = tokio::spawn(informer.clone().run());
            while !(informer.has_synced() && registrations.iter().all(|r| r.has_synced())) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let sync_s = started.elapsed().as_secs_f64();
            tokio::time::sleep(Duration::from_millis(200)).await;
            let objects = informer.indexer().len();
            if seen.load(Ordering::Relaxed) != objects * args.handlers {
                return Err("a handler missed initial adds".into());
            }
            let mut line = report(objects);
            line["sync_s"] = json!(sync_s);
            // Measured after the memory: the objects a read decodes are dropped, but the
            // allocator may keep their pages.
            line["reads"] = read_costs(&informer);
            std::mem::forget(task);
            std::mem::forget(registrations);
            std::mem::forget(informer);
            line
        }
        "relist-informer" | "relist-compact" => {
            let mut line = relist(&client, &prefix, args, kind == "relist-compact").await?;
            line["rss_before"] = json!(rss_before);
            line
        }
        other => return Err(format!("unknown child {other}").into()),
    };
    if line["objects"].as_u64() != Some(n as u64) {
        return Err(format!("child cached {} objects, expected {n}", line["objects"]).into());
    }
    println!("{line}");
    Ok(())
}
