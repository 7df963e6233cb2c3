//! The memory scenario's child processes: the bench re-executed with `--child`.

use super::*;

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
    let rss_before = rss_bytes();
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
        })
    };
    let line = match kind {
        "memory-raw" => {
            let (map, _) = raw_list(&client, &prefix, args.page_size).await?;
            tokio::time::sleep(Duration::from_millis(200)).await;
            let line = report(map.len());
            std::mem::forget(map);
            line
        }
        "memory-informer" => {
            let lw = EtcdListerWatcher::with_options(
                client.clone(),
                prefix.clone(),
                JsonCodec::<ConfigMap>::new(),
                EtcdOptions::default().with_page_size(args.page_size),
            )?;
            let options = InformerOptions::default().with_processing(args.processing);
            let informer = SharedIndexInformer::new(lw, options);
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
            let task = tokio::spawn(informer.clone().run());
            while !(informer.has_synced() && registrations.iter().all(|r| r.has_synced())) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            let objects = informer.indexer().list_keys().len();
            if seen.load(Ordering::Relaxed) != objects * args.handlers {
                return Err("a handler missed initial adds".into());
            }
            let line = report(objects);
            std::mem::forget(task);
            std::mem::forget(registrations);
            std::mem::forget(informer);
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
