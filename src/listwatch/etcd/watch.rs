//! The watch task: one etcd watch stream read into events for the reflector, with its
//! liveness judged by that stream alone (a silent stream probes itself; one that stays silent
//! is dead), and the consistency checks made when it opens or falls behind.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use etcd_client::{Client, GetOptions, WatchOptions};
use smallvec::{smallvec, SmallVec};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::Stream;

use super::auth::TokenRenewal;
use super::decode::{relative_key, Decoder};
use super::identity::{store_changed, Identity, Tally};
use super::proof::WatchProgress;
use super::request::{classify, named, read};
use crate::listwatch::hedged::Hedged;
use crate::listwatch::{Error, Result, WatchEvent};
use crate::sync::lock;

/// One response's events: most responses carry one, which needs no list of its own.
pub(super) type Events<T> = SmallVec<[WatchEvent<T>; 1]>;

/// The watch stream: etcd's responses, one at a time, flattened into events. A response is
/// taken whole, so a revision's events are yielded without a wait in between.
pub(super) struct Responses<T> {
    /// Each response's events, with when the watch task received it.
    pub(super) rx: mpsc::Receiver<(std::time::Instant, Events<T>)>,
    pub(super) current: smallvec::IntoIter<[WatchEvent<T>; 1]>,
}

impl<T> Unpin for Responses<T> {}

impl<T> Stream for Responses<T> {
    type Item = WatchEvent<T>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if let Some(event) = self.current.next() {
                return Poll::Ready(Some(event));
            }
            match self.rx.poll_recv(cx) {
                Poll::Ready(Some((received, events))) => {
                    if !events.is_empty() {
                        crate::listwatch::stamp_received(received);
                    }
                    self.current = events.into_iter();
                }
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// Reads one etcd watch stream and forwards its events.
///
/// Liveness is judged by this stream alone: a stream that has heard nothing for
/// `progress_interval` probes itself (a watch created on the same stream and canceled once
/// confirmed); one that has heard nothing for `idle_timeout`, the probe's answer included, is
/// on a member that stopped answering and fails as unavailable.
pub(super) struct WatchTask<T> {
    pub(super) client: Client,
    /// The watched range, for consistency checks.
    pub(super) range: (Vec<u8>, Vec<u8>),
    pub(super) decoder: Decoder<T>,
    pub(super) identity: Arc<Mutex<Identity>>,
    pub(super) tally: Arc<Mutex<Tally>>,
    /// The prefix, for messages.
    pub(super) name: String,
    pub(super) after: i64,
    /// The newest revision sent to the reflector (or `after`): what a probe's bookmark says.
    pub(super) delivered: i64,
    /// The id etcd gave the prefix's watch; responses for other ids answer probes.
    pub(super) watch_id: i64,
    /// A linearizable read showed that the cluster is past `after` while this member lags
    /// behind it: the member's events catch up on their own.
    pub(super) lag_confirmed: bool,
    pub(super) trust_progress: bool,
    pub(super) progress_interval: Duration,
    pub(super) idle_timeout: Duration,
    pub(super) tx: mpsc::Sender<(std::time::Instant, Events<T>)>,
    /// When the response being handled arrived.
    pub(super) received: std::time::Instant,
    pub(super) token: TokenRenewal,
    /// Consistent reads ask for etcd's progress through it.
    pub(super) progress: Arc<WatchProgress>,
    /// This task's generation in `progress`.
    pub(super) generation: u64,
}

pub(super) const PUT: i32 = 0;

pub(super) const DELETE: i32 = 1;

impl<T: Send + Sync + 'static> WatchTask<T> {
    pub(super) async fn run(
        mut self,
        mut requests: etcd_client::WatchRequestSender,
        mut responses: etcd_client::WatchResponseStream,
        created: etcd_client::WatchResponse,
    ) {
        self.generation = self.progress.started(self.delivered, self.trust_progress);
        self.watch(&mut requests, &mut responses, created).await;
        self.progress.ended(self.generation);
    }

    async fn watch(
        &mut self,
        requests: &mut etcd_client::WatchRequestSender,
        responses: &mut etcd_client::WatchResponseStream,
        created: etcd_client::WatchResponse,
    ) {
        if let Err(e) = self.handle(created).await {
            self.fail(e).await;
            return;
        }
        let progress = self.progress.clone();
        let mut wanted = std::pin::pin!(progress.wanted());
        // Checked often enough that a probe goes out soon after `progress_interval` of silence.
        let mut tick = tokio::time::interval(self.progress_interval / 4);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut heard = Instant::now();
        let mut probing = false;
        loop {
            let message = tokio::select! {
                m = responses.message() => m,
                _ = tick.tick() => {
                    let silent = heard.elapsed();
                    if silent >= self.idle_timeout {
                        self.fail(Error::unavailable(format!(
                            "the watch of {} heard nothing on its stream for {silent:?}, a probe of it included; its member stopped answering",
                            self.name
                        )))
                        .await;
                        return;
                    }
                    if silent >= self.progress_interval && !probing {
                        probing = true;
                        // The prefix itself, from now: a synced watch, answered at once.
                        let probe = WatchOptions::new();
                        let mut sent = requests.watch(self.range.0.clone(), Some(probe)).await;
                        if sent.is_ok() && self.trust_progress {
                            sent = requests.request_progress().await;
                        }
                        if sent.is_err() {
                            self.fail(Error::unavailable(format!("the watch stream of {} closed", self.name))).await;
                            return;
                        }
                    }
                    continue;
                }
                _ = &mut wanted, if self.trust_progress => {
                    wanted.set(progress.wanted());
                    if requests.request_progress().await.is_err() {
                        self.fail(Error::unavailable(format!("the watch stream of {} closed", self.name))).await;
                        return;
                    }
                    continue;
                }
                _ = self.tx.closed() => return,
            };
            let response = match message {
                Ok(Some(r)) => r,
                Ok(None) => {
                    self.fail(Error::unavailable(format!(
                        "etcd ended the watch stream of {}",
                        self.name
                    )))
                    .await;
                    return;
                }
                Err(e) => {
                    let error = classify(e, self.after);
                    self.token.note(&error);
                    self.fail(named(error, &self.name)).await;
                    return;
                }
            };
            probing = false;
            if crate::metrics::ENABLED {
                self.received = std::time::Instant::now();
            }
            // etcd answers progress requests with watch id -1.
            let probe_answer = response.watch_id() != self.watch_id && response.watch_id() != -1;
            let handled = if probe_answer {
                self.answered(requests, &response).await
            } else {
                self.handle(response).await
            };
            // Waiting for the reflector to take events is not silence from etcd.
            heard = Instant::now();
            if let Err(e) = handled {
                self.fail(e).await;
                return;
            }
        }
    }

    /// A probe was answered: cancels it once created, and tells the reflector the stream is
    /// alive with a bookmark at the revision already delivered (etcd delivers a revision's
    /// events in one response, so nothing of it is left behind).
    pub(super) async fn answered(
        &mut self,
        requests: &mut etcd_client::WatchRequestSender,
        response: &etcd_client::WatchResponse,
    ) -> Result<(), Error> {
        if response.created() && !response.canceled() {
            requests.cancel(response.watch_id()).await.map_err(|_| {
                Error::unavailable(format!("the watch stream of {} closed", self.name))
            })?;
            if self.delivered > 0 {
                self.send(smallvec![WatchEvent::Bookmark(self.delivered)])
                    .await?;
            }
        }
        Ok(())
    }

    /// Forwards one response; an error ends the watch.
    pub(super) async fn handle(
        &mut self,
        mut response: etcd_client::WatchResponse,
    ) -> Result<(), Error> {
        let header_revision = response.header().map_or(0, |h| h.revision());
        if response.compact_revision() != 0 {
            return Err(Error::expired(
                self.after + 1,
                format!(
                    "etcd compacted up to revision {}",
                    response.compact_revision()
                ),
            ));
        }
        if response.canceled() {
            let reason = response.cancel_reason().to_owned();
            if reason.contains("compacted") {
                return Err(Error::expired(self.after + 1, reason));
            }
            let error = Error::transient(format!(
                "etcd canceled the watch of {}: {reason}",
                self.name
            ));
            self.token.note(&error);
            return Err(error);
        }
        if let Some(header) = response.header() {
            let seen = Identity {
                cluster_id: header.cluster_id(),
                raft_term: header.raft_term(),
            };
            if let Some(reason) = store_changed(
                &self.client,
                &self.identity,
                seen,
                &self.range,
                self.idle_timeout / 2,
            )
            .await
            {
                *lock(&self.identity) = seen;
                return Err(Error::StoreReplaced {
                    revision: self.after + 1,
                    reason,
                });
            }
        }
        if header_revision != 0 && header_revision < self.after {
            if !self.lag_confirmed {
                self.behind(header_revision).await?;
                self.lag_confirmed = true;
            }
        } else {
            self.lag_confirmed = false;
        }
        if response.created() {
            self.check_tally().await?;
        }
        let events = std::mem::take(&mut response.0.events);
        if events.is_empty() {
            if !response.created() && self.trust_progress && header_revision > self.after {
                // Nothing under the prefix changed up to the bookmark: the key tally holds there
                // too, so the next re-watch (from the bookmark) still checks it. The tally is
                // at the last revision delivered, which events move and `after` does not.
                {
                    let mut tally = lock(&self.tally);
                    if tally.revision == self.delivered {
                        tally.revision = header_revision;
                    }
                }
                self.after = header_revision;
                self.delivered = self.delivered.max(header_revision);
                self.send(smallvec![WatchEvent::Bookmark(header_revision)])
                    .await?;
            }
            if !response.created() {
                self.progress.answered(self.generation, self.delivered);
            }
            return Ok(());
        }
        // One message per response: a revision's events stay together.
        // The bookkeeping locks are taken once per response, not once per event.
        // A revision comes whole in one response, so one at or below the newest delivered
        // before this response is a repeat (etcd 3.4 repeats responses to slow watchers): it
        // must not reach the reflector nor move the tally again.
        let delivered = self.delivered;
        // The newest revision of this response, whether or not its events became any.
        let mut read = delivered;
        let mut out = {
            // Room for a bookmark after the events, allocated only for two or more.
            let mut out = Events::new();
            if events.len() > 1 {
                out.reserve_exact(events.len() + 1);
            }
            let mut tally = lock(&self.tally);
            for event in events {
                let Some(kv) = event.kv else { continue };
                let revision = kv.mod_revision;
                if revision <= delivered {
                    continue;
                }
                read = read.max(revision);
                if tally.revision <= revision {
                    tally.revision = revision;
                    match event.r#type {
                        PUT if kv.version == 1 => tally.keys += 1,
                        DELETE => tally.keys -= 1,
                        _ => {}
                    }
                }
                let decoded = match event.r#type {
                    PUT => Some(self.decoder.object(&kv)),
                    _ => None,
                };
                let forwarded = match (event.r#type, decoded) {
                    (PUT, Some(decoded)) => match decoded {
                        Some(obj) if obj.version == 1 => WatchEvent::Added(obj),
                        Some(obj) => WatchEvent::Modified(obj),
                        // Undecodable (already reported): from now on the key is absent.
                        None => match relative_key(
                            &self.decoder.prefix,
                            &kv.key,
                            self.decoder.escape_keys,
                        ) {
                            Some(key) => WatchEvent::Deleted {
                                key,
                                revision,
                                last: None,
                            },
                            None => continue,
                        },
                    },
                    (DELETE, _) => {
                        let key = self.decoder.key(&kv.key, revision);
                        let last = key
                            .as_ref()
                            .and(event.prev_kv)
                            .and_then(|p| self.decoder.object(&p));
                        // After both decodes: the key is gone, whatever they reported.
                        self.decoder.undecodable.remove(&kv.key, revision);
                        let Some(key) = key else {
                            continue;
                        };
                        WatchEvent::Deleted {
                            key,
                            revision,
                            last,
                        }
                    }
                    (other, _) => {
                        tracing::warn!(
                            event_type = other,
                            revision,
                            "unknown etcd event type; skipped"
                        );
                        continue;
                    }
                };
                out.push(forwarded);
            }
            out
        };
        // A revision whose events all were skipped (keys that are not UTF-8, which the cache
        // treats as absent) changed nothing the cache holds, but it was read: a bookmark
        // carries it to the cache's revision, so that a wait for it ends, and `delivered`
        // moves past it, so that neither this stream nor the next watch (opened from the
        // cache's revision) takes it again and counts its keys twice in the tally.
        let forwarded = out
            .last()
            .and_then(WatchEvent::revision)
            .unwrap_or(delivered);
        if read > forwarded {
            out.push(WatchEvent::Bookmark(read));
        }
        self.delivered = self.delivered.max(read);
        if !out.is_empty() {
            self.send(out).await?;
        }
        Ok(())
    }

    /// On a watch opened from the revision the tally is at: etcd must count as many keys under
    /// the prefix at that revision as the list and the events since did (see [`Tally`]).
    pub(super) async fn check_tally(&self) -> Result<(), Error> {
        let tally = *lock(&self.tally);
        if tally.revision != self.after || self.after == 0 {
            return Ok(());
        }
        let options = GetOptions::new()
            .with_range(self.range.1.clone())
            .with_count_only()
            .with_revision(self.after);
        let timeout = self.idle_timeout / 2;
        match read(&self.client, &self.range.0, options, timeout).await {
            Hedged::Answered(resp) if resp.count() != tally.keys => Err(Error::TallyDiffers {
                revision: self.after + 1,
                reason: format!(
                    "etcd counts {} keys under {} at revision {}, where the watch counted {}: the store was replaced or an event lost",
                    resp.count(),
                    self.name,
                    self.after,
                    tally.keys
                ),
            }),
            Hedged::Answered(_) => Ok(()),
            Hedged::Failed(e) => Err(named(classify(e, self.after), &self.name)),
            Hedged::TimedOut => Err(Error::unavailable(format!(
                "counting the keys of {} at revision {} got no answer within {timeout:?}",
                self.name, self.after
            ))),
        }
    }

    /// The watch reports a revision below the one it started after: either this member lags
    /// behind the cluster (its events catch up on their own: keep the stream), or the whole
    /// store went back in time (relist). A linearizable read, answered only with the cluster's
    /// current revision, tells which; without an answer, the watch is tried again.
    pub(super) async fn behind(&self, header_revision: i64) -> Result<(), Error> {
        // One key, no value: only the header's revision matters.
        let options = GetOptions::new()
            .with_range(self.range.1.clone())
            .with_limit(1)
            .with_keys_only();
        match read(&self.client, &self.range.0, options, self.idle_timeout / 2).await {
            Hedged::Answered(resp) => {
                let cluster = resp.header().map_or(0, |h| h.revision());
                if cluster < self.after {
                    return Err(Error::StoreReplaced {
                        revision: self.after + 1,
                        reason: format!(
                            "etcd is at revision {cluster}, below the watched revision {}: the store was wiped or restored",
                            self.after
                        ),
                    });
                }
                tracing::debug!(
                    member = header_revision,
                    cluster,
                    after = self.after,
                    "the member serving the watch lags behind its cluster; its events will catch up"
                );
                Ok(())
            }
            _ => Err(Error::unavailable(format!(
                "the member serving the watch of {} is at revision {header_revision}, behind the watched revision {}, and the cluster's revision could not be read",
                self.name, self.after
            ))),
        }
    }

    pub(super) async fn send(&self, events: Events<T>) -> Result<(), Error> {
        self.tx
            .send((self.received, events))
            .await
            .map_err(|_| Error::transient("the reflector stopped watching"))
    }

    /// Reports the error that ends this watch.
    pub(super) async fn fail(&self, error: Error) {
        let _ = self
            .tx
            .send((self.received, smallvec![WatchEvent::Error(error)]))
            .await;
    }
}

#[cfg(all(test, feature = "testing"))]
mod tests {
    use super::*;
    use crate::codec::TextCodec;
    use crate::listwatch::etcd::EtcdListerWatcher;
    use crate::listwatch::ListerWatcher;
    use crate::testing::etcd::{test_etcd, unique_prefix};

    /// Issue 28, finding 5: etcd 3.4.23 can send a watch response again. The repeat must
    /// change nothing: no event forwarded twice, and the key tally moved once, so that the
    /// next re-watch's tally check does not take the store for a replaced one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_repeated_response_changes_nothing_the_tally_included() {
        let etcd = test_etcd().await.unwrap_or_else(|e| panic!("{e}"));
        let client = etcd.client().await;
        let prefix = unique_prefix("repeated");
        let mut kv = client.kv_client();
        for k in ["a", "b"] {
            kv.put(format!("{prefix}{k}"), k, None).await.unwrap();
        }
        let lw = EtcdListerWatcher::new(client.clone(), prefix.as_str(), TextCodec).unwrap();
        let listed = lw.list().await.unwrap().revision;

        // etcd's own response carrying the creation of c, as the watch receives it.
        let mut watcher = client.clone();
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(listed + 1);
        let (_keep, mut stream) = watcher
            .watch(prefix.as_str(), Some(options))
            .await
            .unwrap()
            .split();
        let created = kv.put(format!("{prefix}c"), "c", None).await.unwrap();
        let created = created.header().unwrap().revision();
        let response = loop {
            let r = stream.message().await.unwrap().expect("the watch goes on");
            if !r.events().is_empty() {
                break r;
            }
        };

        let (tx, mut rx) = mpsc::channel(8);
        let mut task = WatchTask {
            client: client.clone(),
            range: lw.range(),
            decoder: lw.decoder(),
            identity: lw.identity.clone(),
            tally: lw.tally.clone(),
            name: lw.prefix(),
            after: listed,
            delivered: listed,
            watch_id: response.watch_id(),
            lag_confirmed: false,
            trust_progress: false,
            progress_interval: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(10),
            tx,
            received: std::time::Instant::now(),
            token: lw.token.clone(),
            progress: lw.progress.clone(),
            generation: 0,
        };
        task.handle(response.clone()).await.unwrap();
        task.handle(response).await.unwrap();
        drop(task.tx.clone());
        let (_, first) = rx.try_recv().expect("the response is forwarded");
        assert!(
            matches!(&first[..], [WatchEvent::Added(o)] if o.key() == "c" && o.mod_revision == created),
            "{first:?}"
        );
        assert!(rx.try_recv().is_err(), "the repeat is not forwarded");

        // The re-watch from the revision delivered checks the tally there against etcd.
        let tally = *lock(&lw.tally);
        assert_eq!((tally.revision, tally.keys), (created, 3));
        task.after = created;
        task.check_tally()
            .await
            .expect("the tally agrees with etcd: the store was not replaced");
    }
}
