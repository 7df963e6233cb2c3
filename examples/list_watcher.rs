//! A ListerWatcher used by hand: list once, then watch (the seed's list-watcher example, over
//! etcd). Prints `Initial list:`, the keys, `Start watching...`, then one line per event.
mod common;

use etcd_informer::{EtcdListerWatcher, JsonCodec, ListerWatcher, WatchEvent};
use tokio_stream::StreamExt;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let shutdown = common::shutdown_signal();
    let (client, _etcd) = common::etcd().await;
    let lw = EtcdListerWatcher::new(
        client,
        common::prefix(),
        JsonCodec::<common::ConfigMap>::new(),
    )?;
    let watching = async {
        loop {
            let list = match lw.list().await {
                Ok(list) => list,
                Err(e) => {
                    eprintln!("list failed: {e}; retrying");
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    continue;
                }
            };
            say!("Initial list:");
            for cm in &list.items {
                say!("{}", cm.key());
            }
            say!("Start watching...");
            let mut revision = list.revision;
            let mut relist = false;
            while !relist {
                let mut events = match lw.watch(revision).await {
                    Ok(events) => events,
                    Err(e) if e.is_expired() => break,
                    Err(e) => {
                        eprintln!("watch failed: {e}; retrying");
                        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                        continue;
                    }
                };
                while let Some(event) = events.next().await {
                    if let Some(r) = event.revision() {
                        revision = revision.max(r);
                    }
                    match event {
                        WatchEvent::Added(cm) => say!("ADDED: {}", cm.key()),
                        WatchEvent::Modified(cm) => say!("MODIFIED: {}", cm.key()),
                        WatchEvent::Deleted { key, .. } => say!("DELETED: {key}"),
                        WatchEvent::Bookmark(_) => {}
                        WatchEvent::Error(e) => {
                            // An expired revision (compaction) needs a new list; anything else
                            // a new watch from where we were.
                            eprintln!("watch error: {e}");
                            relist = e.is_expired();
                            break;
                        }
                    }
                }
            }
        }
    };
    tokio::select! {
        _ = watching => {}
        _ = shutdown => {}
    }
    Ok(())
}
