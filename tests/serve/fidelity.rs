//! Issue 53's answers a client acts on, each judged by etcd: the same client does the same
//! thing against etcd directly and through the server, and must see the same (item 5: creates
//! answered in order; item 8: a serializable read after a write through the server; item 10:
//! a sort with a limit; item 11: a key that is not UTF-8).

use super::*;
use etcd_client::{SortOrder, SortTarget};

/// Item 5: two creates sent back to back, the first forwarded to etcd (its range is outside
/// the served prefix) and the second served from the cache, are answered in the order they
/// were asked, with the ids etcd gives: a client that pairs answers with its requests in
/// order (etcd-client's `watch` twice, grpcurl) binds each id to its own watch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_are_answered_in_the_order_they_were_asked() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = shared_client().await;
    let p = unique_prefix("serve_create_order");
    let outside = unique_prefix("serve_create_order_outside");
    let server = start_server(&client, etcd.endpoints.clone(), &p).await;
    let via = connect([server.local_addr().to_string()])
        .await
        .expect("connect to the cache server");
    for (name, target) in [("etcd", &client), ("the cache server", &via)] {
        for run in 0..5 {
            let (mut requests, mut responses) = watch_prefix(target, &p).await;
            let prefix = || Some(WatchOptions::new().with_prefix());
            requests
                .watch(outside.as_str(), prefix())
                .await
                .expect("send");
            requests.watch(format!("{p}x"), None).await.expect("send");
            let mut answers = Vec::new();
            for _ in 0..2 {
                let r = next_response(name, &mut responses).await;
                answers.push((r.watch_id(), r.created(), r.canceled()));
            }
            assert_eq!(
                answers,
                [(1, true, false), (2, true, false)],
                "{name}, run {run}: created in the order asked"
            );
        }
    }
}

/// Item 8: a serializable read through the server right after a write through it sees the
/// write, and never names a revision below one the client was answered, as a serializable
/// read of the etcd member that took the write does (clientv3's `ordering` KV fails
/// otherwise): a write into the prefix is waited for, one elsewhere forwards the read until
/// the cache has passed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serializable_read_after_a_write_through_the_server_sees_it() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = shared_client().await;
    let p = unique_prefix("serve_read_your_write");
    let elsewhere = unique_prefix("serve_read_your_write_elsewhere");
    let server = start_server(&client, etcd.endpoints.clone(), &p).await;
    let via = connect([server.local_addr().to_string()])
        .await
        .expect("connect to the cache server");
    let serializable = || Some(GetOptions::new().with_serializable());
    for (name, target) in [("etcd", &client), ("the cache server", &via)] {
        let mut kv = target.kv_client();
        for i in 0..100 {
            let key = format!("{p}k");
            let value = format!("{name} {i}");
            let (write_key, read_key) = if i % 2 == 0 {
                (key.clone(), key.clone())
            } else {
                (format!("{elsewhere}k"), key.clone())
            };
            let written = kv
                .put(write_key, value.clone(), None)
                .await
                .expect("put")
                .header()
                .expect("header")
                .revision();
            let read = kv.get(read_key, serializable()).await.expect("get");
            let revision = read.header().expect("header").revision();
            assert!(
                revision >= written,
                "{name}, write {i}: the read names revision {revision}, below the write's {written}"
            );
            if i % 2 == 0 {
                assert_eq!(
                    read.kvs().first().map(|kv| kv.value().to_vec()),
                    Some(value.into_bytes()),
                    "{name}, write {i}: the read sees the write"
                );
            }
        }
    }
    assert!(
        server.stats().ranges_from_cache > 0,
        "reads after writes into the prefix are served from the cache"
    );
}

/// Item 10: sorts with and without a limit, by every target and order, give etcd's answer:
/// with a target other than the key and no order, etcd sorts only the keys its limit read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sorts_with_a_limit_are_etcds() {
    let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
    let client = shared_client().await;
    let p = unique_prefix("serve_sort");
    for (k, v) in [("a", "z"), ("b", "y"), ("c", "x"), ("d", "w"), ("e", "y")] {
        put(&client, &format!("{p}{k}"), v).await;
    }
    let last = put(&client, &format!("{p}b"), "y").await;
    let server = start_server(&client, etcd.endpoints.clone(), &p).await;
    caught_up(&server, last).await;
    let via = connect([server.local_addr().to_string()])
        .await
        .expect("connect to the cache server");
    let before = server.stats().ranges_from_cache;
    let targets = [
        SortTarget::Key,
        SortTarget::Version,
        SortTarget::Create,
        SortTarget::Mod,
        SortTarget::Value,
    ];
    let orders = [SortOrder::None, SortOrder::Ascend, SortOrder::Descend];
    let mut asked = 0;
    for target in targets {
        for order in orders {
            for limit in [0, 2] {
                let options = || {
                    Some(
                        GetOptions::new()
                            .with_prefix()
                            .with_serializable()
                            .with_sort(target, order)
                            .with_limit(limit),
                    )
                };
                let answer = |c: &Client| {
                    let (mut kv, p, options) = (c.kv_client(), p.clone(), options());
                    async move {
                        let r = kv.get(p, options).await.expect("get");
                        let keys: Vec<String> = (r.kvs().iter())
                            .map(|kv| kv.key_str().unwrap_or("?").to_owned())
                            .collect();
                        (keys, r.more(), r.count())
                    }
                };
                let direct = answer(&client).await;
                assert_eq!(
                    answer(&via).await,
                    direct,
                    "sort by {target:?}, {order:?}, limit {limit}: etcd (right)"
                );
                asked += 1;
            }
        }
    }
    assert_eq!(server.stats().ranges_from_cache - before, asked);
}
