//! The paged list: every page of the prefix read at one pinned revision, hedged across
//! members, split when a page is too large for a message.

use std::sync::Arc;

use etcd_client::proto::PbKeyValue;
use etcd_client::{GetOptions, GetResponse, KvClient};
use tokio::time::Instant;

use super::decode::{key_text, relative};
use super::identity::Tally;
use super::options::{FIRST_PAGE, LIST_PAGES, RELIST_PAGES};
use super::request::{is_message_too_large, member_unreachable};
use super::EtcdListerWatcher;
use crate::listwatch::hedged::{hedged, Hedged};
use crate::listwatch::{Error, KeyRevisionsSink, ListResult, ListSink, Result};
use crate::object::Stamp;
use crate::sync::lock;

impl<T: Send + Sync + 'static> EtcdListerWatcher<T> {
    /// Lists the prefix at one revision. Each page is decoded on a blocking thread while the
    /// next is fetched; with a `sink`, that thread also hands the page to it (and the result
    /// holds no items).
    pub(super) async fn list_inner(
        &self,
        sink: Option<Arc<dyn ListSink<T>>>,
    ) -> Result<ListResult<T>> {
        self.token.renew_if_refused(&self.client).await;
        // The list reports anew what does not decode.
        self.undecodable.clear();
        let kv = self
            .client
            .kv_client()
            .max_decoding_message_size(self.options.max_message_bytes);
        let mut revision = 0i64;
        let mut start = self.first_key();
        let mut decoding = Vec::new();
        let mut pages = 0;
        // Shrinks for good if a page is too large for one message.
        let mut max_page = self.options.page_size;
        let mut page_size = max_page.min(FIRST_PAGE);
        loop {
            let mut options = GetOptions::new()
                .with_range(self.range_end.clone())
                .with_limit(page_size);
            if revision != 0 {
                // Every page after the first is read at the first page's revision: the header of
                // each response carries etcd's *current* revision, never the one read at.
                options = options.with_revision(revision);
            }
            let Some(mut resp) = self
                .read_page(&kv, &start, options, page_size, revision, "list", pages)
                .await?
            else {
                // A page too big for one message (large values): retry it in smaller pages,
                // rather than failing the same way on every relist forever.
                page_size = (page_size / 4).max(1);
                max_page = page_size;
                tracing::warn!(prefix = %self.prefix(), page_size, "list page too large; retrying with smaller pages");
                continue;
            };
            if revision == 0 {
                revision = resp.header().map_or(0, |h| h.revision());
                if let Some(reason) = self.store_changed(resp.header()).await {
                    return Err(Error::StoreReplaced { revision, reason });
                }
                if let Some(sink) = &sink {
                    sink.begin(revision, usize::try_from(resp.count()).unwrap_or(0));
                }
            }
            if pages == 0 {
                // The first page counts the whole range: size the rest from it.
                let count = resp.count();
                let held = sink
                    .as_ref()
                    .map_or(0, |s| i64::try_from(s.held()).unwrap_or(i64::MAX));
                let aim = if held > 0 && held.saturating_mul(2) >= count {
                    RELIST_PAGES
                } else {
                    LIST_PAGES
                };
                page_size = (count / aim).max(FIRST_PAGE).min(max_page);
            }
            pages += 1;
            let more = resp.more();
            let kvs: Vec<PbKeyValue> = resp.take_kvs().into_iter().map(|kv| kv.0).collect();
            if let Some(newer) = kvs.iter().find(|kv| kv.mod_revision > revision) {
                return Err(Error::transient(format!(
                    "list of {} is inconsistent: key {:?} has mod_revision {} above the list revision {revision}",
                    self.prefix(),
                    String::from_utf8_lossy(&newer.key),
                    newer.mod_revision
                )));
            }
            if more {
                match kvs.last() {
                    Some(last) => {
                        start = last.key.clone();
                        start.push(0);
                    }
                    None => {
                        return Err(Error::transient(format!(
                            "list of {}: etcd said more keys follow an empty page",
                            self.prefix()
                        )))
                    }
                }
            }
            // Decode this page on a blocking thread while the next one is fetched.
            let decoder = self.decoder();
            let sink = sink.clone();
            decoding.push(tokio::task::spawn_blocking(move || {
                let mut undecodable = 0;
                let Some(sink) = sink else {
                    let mut objects = Vec::with_capacity(kvs.len());
                    for kv in kvs {
                        match decoder.object(&kv) {
                            Some(obj) => objects.push(obj),
                            None => undecodable += 1,
                        }
                    }
                    let decoded = objects.len();
                    return (objects, decoded, undecodable);
                };
                let mut objects = Vec::with_capacity(kvs.len());
                let mut kept = 0;
                for kv in kvs {
                    let key = key_text(relative(&decoder.prefix, &kv.key), decoder.escape_keys);
                    let unchanged = key.is_some_and(|key| {
                        let stamp =
                            Stamp::new(kv.mod_revision, kv.create_revision, kv.version, &kv.value);
                        sink.unchanged(&key, &stamp)
                    });
                    if unchanged {
                        kept += 1;
                        continue;
                    }
                    match decoder.object(&kv) {
                        Some(obj) => objects.push(Arc::new(obj)),
                        None => undecodable += 1,
                    }
                }
                let decoded = objects.len() + kept;
                sink.page(objects);
                (Vec::new(), decoded, undecodable)
            }));
            if !more {
                break;
            }
        }
        let mut items = Vec::new();
        let mut decoded = 0;
        let mut undecodable = 0;
        for page in decoding {
            let (page, count, bad) = page.await.map_err(|e| {
                Error::transient(format!("decoding a page of {} failed: {e}", self.prefix()))
            })?;
            if items.is_empty() {
                items = page;
            } else {
                items.extend(page);
            }
            decoded += count;
            undecodable += bad;
        }
        *lock(&self.tally) = Tally {
            revision,
            keys: (decoded + undecodable) as i64,
        };
        tracing::debug!(prefix = %self.prefix(), revision, pages, items = decoded, "listed");
        Ok(ListResult { items, revision })
    }
}

impl<T: Send + Sync + 'static> EtcdListerWatcher<T> {
    /// One page of the prefix from `start`, read hedged across members; `None` when it is too
    /// large for one message and holds more than one key (the caller reads smaller pages).
    /// `what`, `revision` and `page` name it in errors.
    #[allow(clippy::too_many_arguments)]
    async fn read_page(
        &self,
        kv: &KvClient,
        start: &[u8],
        options: GetOptions,
        page_size: i64,
        revision: i64,
        what: &str,
        page: usize,
    ) -> Result<Option<GetResponse>> {
        // A page may take a while to send, so a second attempt goes out only once the first
        // has been silent as long as a watch may be (a member that hangs).
        let deadline = Instant::now() + self.options.page_timeout;
        let got = hedged(
            self.options.idle_timeout,
            deadline,
            member_unreachable,
            || {
                let mut kv = kv.clone();
                let (start, options) = (start.to_vec(), options.clone());
                async move { kv.get(start, Some(options)).await }
            },
        )
        .await;
        match got {
            Hedged::Answered(resp) => Ok(Some(resp)),
            Hedged::Failed(e) if page_size > 1 && is_message_too_large(&e) => Ok(None),
            Hedged::Failed(e) => Err(self.failed(e, revision)),
            Hedged::TimedOut => Err(Error::unavailable(format!(
                "{what} of {} timed out after {:?} (page {page})",
                self.prefix(),
                self.options.page_timeout
            ))),
        }
    }

    /// [`ListKeyRevisions::key_revisions`](crate::listwatch::ListKeyRevisions::key_revisions): keys-only pages of the prefix at `at`, in key order,
    /// each read hedged as a list page is; keys not UTF-8 or undecodable at their
    /// `mod_revision` are left out.
    pub(super) async fn key_revisions_inner(
        &self,
        at: i64,
        mut page: KeyRevisionsSink,
    ) -> Result<()> {
        self.token.renew_if_refused(&self.client).await;
        // Keys fixed after `at` stay known as failing at their old `mod_revision`.
        self.undecodable.prune(at);
        let kv = self
            .client
            .kv_client()
            .max_decoding_message_size(self.options.max_message_bytes);
        let mut start = self.first_key();
        let mut pages = 0;
        let mut page_size = self.options.page_size;
        loop {
            let options = GetOptions::new()
                .with_range(self.range_end.clone())
                .with_keys_only()
                .with_revision(at)
                .with_limit(page_size);
            let Some(mut resp) = self
                .read_page(&kv, &start, options, page_size, at, "audit read", pages)
                .await?
            else {
                page_size = (page_size / 4).max(1);
                continue;
            };
            pages += 1;
            let more = resp.more();
            let kvs: Vec<PbKeyValue> = resp.take_kvs().into_iter().map(|kv| kv.0).collect();
            if more {
                let Some(last) = kvs.last() else {
                    return Err(Error::transient(format!(
                        "reading the keys of {}: etcd said more keys follow an empty page",
                        self.prefix()
                    )));
                };
                start = last.key.clone();
                start.push(0);
            }
            let keys = kvs
                .into_iter()
                .filter(|kv| !self.undecodable.holds(&kv.key, kv.mod_revision))
                .filter_map(|kv| {
                    let key = relative(&self.prefix, &kv.key);
                    let key = key_text(key, self.options.escape_keys)?;
                    Some((Arc::from(key), kv.mod_revision))
                })
                .collect();
            page(keys);
            if !more {
                return Ok(());
            }
        }
    }
}
