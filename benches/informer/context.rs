//! The benchmark context: the etcd, loading the keys, writing updates, and each side's reader
//! (the raw etcd-client baseline's list and watch, and the informer).

use super::*;

pub(super) struct Bench {
    pub(super) args: Args,
    pub(super) endpoints: Vec<String>,
    /// The etcd we started, for its CPU time.
    pub(super) etcd_pid: Option<u32>,
    pub(super) prefix: String,
    pub(super) writer: Client,
    /// The writers' runtime (threads named [`WRITER_THREAD`]), where `writer` was connected.
    pub(super) writers: tokio::runtime::Handle,
    pub(super) version: String,
    /// The next sequence number to write (unique over the whole run).
    pub(super) next_seq: AtomicU64,
    /// Where the next batch of updates starts in the key space.
    pub(super) next_key: AtomicUsize,
}

impl Bench {
    pub(super) async fn raw_client(&self) -> Client {
        Client::connect(&self.endpoints, None)
            .await
            .unwrap_or_else(|e| fail(format!("connecting to etcd: {e}")))
    }

    pub(super) async fn informer_client(&self) -> Client {
        etcd_informer::connect(&self.endpoints)
            .await
            .unwrap_or_else(|e| fail(format!("connecting to etcd: {e}")))
    }

    pub(super) fn informer(
        &self,
        client: Client,
        page_size: i64,
    ) -> SharedIndexInformer<ConfigMap> {
        let lw = EtcdListerWatcher::with_options(
            client,
            self.prefix.clone(),
            JsonCodec::<ConfigMap>::new(),
            EtcdOptions::default().with_page_size(page_size),
        )
        .unwrap_or_else(|e| fail(e));
        SharedIndexInformer::new(
            lw,
            InformerOptions::default()
                .with_name("bench")
                .with_processing(self.args.processing),
        )
    }

    /// Reserves `n` sequence numbers and `n` keys; returns (first seq, first key index).
    pub(super) fn reserve(&self, n: usize) -> (u64, usize) {
        let seq = self.next_seq.fetch_add(n as u64, Ordering::Relaxed);
        let key = self.next_key.fetch_add(n, Ordering::Relaxed) % self.args.keys;
        (seq, key)
    }

    pub(super) fn base_json(&self, scenario: &str) -> serde_json::Map<String, Value> {
        let mut m = serde_json::Map::new();
        m.insert("scenario".into(), json!(scenario));
        m.insert("keys".into(), json!(self.args.keys));
        m.insert("value_bytes".into(), json!(self.args.value_bytes));
        m.insert("etcd_version".into(), json!(self.version));
        m.insert("runs".into(), json!(self.args.runs));
        m.insert(
            "processing".into(),
            json!(format!("{:?}", self.args.processing)),
        );
        m.insert(
            "cache".into(),
            json!(if self.args.compact {
                "compact"
            } else {
                "default"
            }),
        );
        m
    }

    pub(super) async fn current_revision(&self) -> i64 {
        let mut c = self.writer.clone();
        let resp = c
            .get(
                self.prefix.as_bytes(),
                Some(GetOptions::new().with_limit(1).with_keys_only()),
            )
            .await
            .unwrap_or_else(|e| fail(format!("get: {e}")));
        resp.header().map_or(0, |h| h.revision())
    }

    /// Loads the N keys with concurrent transactions of 128 puts.
    pub(super) async fn load(&self) {
        let started = Instant::now();
        let next = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..LOADERS {
            let next = next.clone();
            let mut client = self.writer.clone();
            let prefix = self.prefix.clone();
            let (n, size) = (self.args.keys, self.args.value_bytes);
            tasks.push(tokio::spawn(async move {
                loop {
                    let first = next.fetch_add(TXN_OPS, Ordering::Relaxed);
                    if first >= n {
                        return;
                    }
                    let ops: Vec<TxnOp> = (first..(first + TXN_OPS).min(n))
                        .map(|i| TxnOp::put(full_key(&prefix, i), make_value(i, 0, size), None))
                        .collect();
                    client
                        .txn(Txn::new().and_then(ops))
                        .await
                        .unwrap_or_else(|e| fail(format!("loading keys: {e}")));
                }
            }));
        }
        for t in tasks {
            t.await.unwrap_or_else(|e| fail(e));
        }
        let sample = make_value(0, 0, self.args.value_bytes).len();
        eprintln!(
            "loaded {} keys (values of {} bytes) in {:.1} s",
            self.args.keys,
            sample,
            started.elapsed().as_secs_f64()
        );
    }

    /// `m` puts of existing keys by W concurrent writers, as fast as etcd takes them. Returns
    /// when the first put was sent and how long all took.
    pub(super) async fn write_updates(&self, m: usize) -> (Instant, Duration) {
        let (seq0, key0) = self.reserve(m);
        let writers = self.args.writers;
        let started = Instant::now();
        let mut tasks = Vec::new();
        for w in 0..writers {
            let mut client = self.writer.clone();
            let prefix = self.prefix.clone();
            let (n, size) = (self.args.keys, self.args.value_bytes);
            tasks.push(self.writers.spawn(async move {
                for j in (w..m).step_by(writers) {
                    let i = (key0 + j) % n;
                    client
                        .put(
                            full_key(&prefix, i),
                            make_value(i, seq0 + j as u64, size),
                            None,
                        )
                        .await
                        .unwrap_or_else(|e| fail(format!("put: {e}")));
                }
            }));
        }
        for t in tasks {
            t.await.unwrap_or_else(|e| fail(e));
        }
        (started, started.elapsed())
    }

    /// A raw watch of the prefix from `revision + 1` feeding `sink` with decoded values.
    pub(super) async fn raw_watch(
        &self,
        revision: i64,
        prev_kv: bool,
        sink: Arc<Sink>,
    ) -> AbortOnDrop<()> {
        self.raw_watch_with(revision, prev_kv, move |_, decoded| match decoded {
            Ok(cm) => sink.record(&cm),
            Err(_) => {
                sink.bad.fetch_add(1, Ordering::Relaxed);
            }
        })
        .await
    }

    /// A raw watch of the prefix from `revision + 1`, handing each event's key (relative to
    /// the prefix) and decoded value to `consume`, on the watch's own task.
    pub(super) async fn raw_watch_with(
        &self,
        revision: i64,
        prev_kv: bool,
        mut consume: impl FnMut(&[u8], serde_json::Result<ConfigMap>) + Send + 'static,
    ) -> AbortOnDrop<()> {
        let client = self.raw_client().await;
        let mut options = WatchOptions::new()
            .with_range(prefix_range_end(self.prefix.as_bytes()))
            .with_start_revision(revision + 1);
        if prev_kv {
            options = options.with_prev_key();
        }
        let mut stream = client
            .watch_client()
            .max_decoding_message_size(MAX_MESSAGE)
            .watch(self.prefix.as_bytes(), Some(options))
            .await
            .unwrap_or_else(|e| fail(format!("watch: {e}")));
        let skip = self.prefix.len();
        AbortOnDrop(tokio::spawn(async move {
            let _client = client;
            loop {
                match stream.message().await {
                    Ok(Some(resp)) => {
                        for event in resp.events() {
                            let Some(kv) = event.kv() else { continue };
                            let key = kv.key().get(skip..).unwrap_or_default();
                            consume(key, serde_json::from_slice::<ConfigMap>(kv.value()));
                        }
                    }
                    Ok(None) => fail("the raw watch ended"),
                    Err(e) => fail(format!("the raw watch failed: {e}")),
                }
            }
        }))
    }

    /// A synced informer at the default page size with `handlers` handlers feeding `sinks`.
    pub(super) async fn synced_informer(&self, sinks: &[Arc<Sink>]) -> RunningInformer {
        self.synced_informer_recorded(sinks, None).await
    }

    /// [`synced_informer`](Self::synced_informer) whose metrics go to `recorder` (none: the
    /// `metrics` facade's no-op recorder).
    pub(super) async fn synced_informer_recorded(
        &self,
        sinks: &[Arc<Sink>],
        recorder: Option<&metrics_exporter_prometheus::PrometheusRecorder>,
    ) -> RunningInformer {
        let client = self.informer_client().await;
        // Metric handles are registered when the informer and its handlers are created.
        let create = || {
            let informer = self.informer(client, self.args.page_size);
            let mut registrations = Vec::new();
            for sink in sinks {
                let (a, u) = (sink.clone(), sink.clone());
                let handler = ResourceEventHandlerFuncs::new()
                    .on_add(move |o, initial| {
                        if !initial {
                            a.record(&o.value)
                        }
                    })
                    .on_update(move |_, new| u.record(&new.value));
                registrations.push(
                    informer
                        .add_event_handler(handler)
                        .unwrap_or_else(|e| fail(e)),
                );
            }
            (informer, registrations)
        };
        let (informer, registrations) = match recorder {
            Some(recorder) => metrics::with_local_recorder(recorder, create),
            None => create(),
        };
        let task = tokio::spawn(informer.clone().run());
        let deadline = Duration::from_secs(600);
        let synced = tokio::time::timeout(deadline, async {
            while !(informer.has_synced() && registrations.iter().all(|r| r.has_synced())) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await;
        if synced.is_err() {
            fail(format!("the informer did not sync within {deadline:?}"));
        }
        RunningInformer {
            informer,
            registrations,
            task,
        }
    }
}

pub(super) struct RunningInformer {
    pub(super) informer: SharedIndexInformer<ConfigMap>,
    pub(super) registrations: Vec<HandlerRegistration<ConfigMap>>,
    pub(super) task: tokio::task::JoinHandle<()>,
}

impl RunningInformer {
    /// Stops the informer and frees its cache before returning, so that tearing it down does not
    /// overlap the next measurement.
    pub(super) async fn shutdown(self) {
        stop_informer(self.informer, self.task).await;
        drop(self.registrations);
    }
}

pub(super) async fn stop_informer(
    informer: SharedIndexInformer<ConfigMap>,
    task: tokio::task::JoinHandle<()>,
) {
    informer.stop();
    task.abort();
    let _ = task.await;
    // The reflector task (aborted with `run`) is dropped later on a worker thread and would free
    // the cache then, in the middle of the next measurement: empty the cache here instead.
    informer.indexer().replace(Vec::new());
    drop(informer);
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// A paged range read of the prefix at one revision, decoded into a map (the raw baseline).
/// `page` 0 reads everything in one response.
pub(super) async fn raw_list(
    client: &Client,
    prefix: &str,
    page: i64,
) -> Res<(HashMap<String, Arc<ConfigMap>>, i64)> {
    let mut kv = client.kv_client().max_decoding_message_size(MAX_MESSAGE);
    let end = prefix_range_end(prefix.as_bytes());
    let mut map = HashMap::new();
    let mut revision = 0;
    let mut start = prefix.as_bytes().to_vec();
    loop {
        let mut options = GetOptions::new().with_range(end.clone()).with_limit(page);
        if revision != 0 {
            options = options.with_revision(revision);
        }
        let resp = kv.get(start.clone(), Some(options)).await?;
        if revision == 0 {
            revision = resp.header().map_or(0, |h| h.revision());
        }
        for kv in resp.kvs() {
            let cm: ConfigMap = serde_json::from_slice(kv.value())?;
            let key = std::str::from_utf8(&kv.key()[prefix.len()..])?.to_owned();
            map.insert(key, Arc::new(cm));
        }
        if !resp.more() {
            break;
        }
        let Some(last) = resp.kvs().last() else {
            return Err("more keys follow an empty page".into());
        };
        start = last.key().to_vec();
        start.push(0);
    }
    Ok((map, revision))
}

pub(super) fn page_label(page: i64) -> String {
    if page == 0 || page >= HUGE_PAGE {
        "unpaged".to_owned()
    } else {
        page.to_string()
    }
}
