//! What a user sees of an informer without reading its code: a registration's awaitable sync,
//! and its logs through an outage of etcd (one warning, not one per retry; a line when it is
//! back), captured from a real etcd behind a link this test cuts. Its own binary, because it
//! installs the process's global `tracing` subscriber.
#![cfg(feature = "testing")]

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{converges, eventually, Captured};
use etcd_informer::testing::etcd::{test_etcd, unique_prefix, TcpProxy};
use etcd_informer::{
    connect, EtcdListerWatcher, EtcdOptions, InformerOptions, ResourceEventHandlerFuncs,
    SharedIndexInformer, TextCodec,
};

fn capture() -> Captured {
    let captured = Captured::default();
    let writer = captured.clone();
    tracing_subscriber::fmt()
        .with_env_filter("etcd_informer=debug")
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .init();
    captured
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_waits_for_its_sync_and_an_outage_is_logged_once_then_its_end() {
    let captured = capture();
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let direct = connect(&etcd.endpoints).await.expect("connect");
    let prefix = unique_prefix("logging");
    for i in 0..20 {
        direct
            .kv_client()
            .put(format!("{prefix}k{i}"), "v", None)
            .await
            .unwrap();
    }

    // A registration of an informer that is gone says so instead of waiting for ever.
    let gone = SharedIndexInformer::new(
        EtcdListerWatcher::new(direct.clone(), prefix.clone(), TextCodec).unwrap(),
        InformerOptions::default(),
    );
    let orphan = gone
        .add_event_handler(ResourceEventHandlerFuncs::new())
        .unwrap();
    drop(gone);
    assert!(!orphan.wait_synced().await);

    let proxy = TcpProxy::start(&etcd.endpoints[0]).await.expect("proxy");
    let client = connect([proxy.endpoint()]).await.expect("connect");
    let options = EtcdOptions::default()
        .with_progress_interval(Duration::from_millis(250))
        .with_idle_timeout(Duration::from_secs(1));
    let lw = EtcdListerWatcher::with_options(client.clone(), prefix.clone(), TextCodec, options)
        .unwrap();
    // Named after its prefix, so that every line of its reflector names it (its span).
    let informer = SharedIndexInformer::new(lw, InformerOptions::default().with_name(&prefix));
    let added = Arc::new(Mutex::new(0usize));
    let counter = added.clone();
    let registration = informer
        .add_event_handler(
            ResourceEventHandlerFuncs::<String>::new()
                .on_add(move |_, _| *counter.lock().unwrap() += 1),
        )
        .unwrap();
    tokio::spawn(informer.clone().run());
    let synced = tokio::time::timeout(Duration::from_secs(30), registration.wait_synced())
        .await
        .expect("the registration syncs");
    assert!(synced);
    assert_eq!(*added.lock().unwrap(), 20, "every initial add came first");

    proxy.cut();
    let ours = |level: &str, text: &str| captured.lines(&[level, &prefix, text]);
    eventually(
        "three failed retries while etcd is cut off",
        Duration::from_secs(60),
        || ours("DEBUG", "list/watch failed again").len() >= 3,
    )
    .await;
    let warnings = ours("WARN", "list/watch");
    assert_eq!(
        warnings.len(),
        1,
        "one warning for the outage, not one per retry: {warnings:#?}"
    );
    assert!(ours("INFO", "list/watch is back").is_empty());

    proxy.heal();
    direct
        .kv_client()
        .put(format!("{prefix}after"), "v", None)
        .await
        .unwrap();
    eventually(
        "a line saying the watch is back",
        Duration::from_secs(30),
        || !ours("INFO", "list/watch is back").is_empty(),
    )
    .await;
    let back = ours("INFO", "list/watch is back");
    assert!(back[0].contains("down_for="), "{}", back[0]);
    converges(&informer, &direct, &prefix, Duration::from_secs(30)).await;
    println!("{}\n{}", warnings[0], back[0]);
}
