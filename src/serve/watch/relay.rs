//! Relays of forwarded watches: a watch the cache cannot serve (its range outside the
//! prefix, or its start below the history) runs on its own upstream stream, its responses
//! relayed under the client's id, and goes back to the cache once etcd has caught it up.

use super::*;

impl Session {
    /// Forwards a watch on its own upstream stream, relaying its responses under the id `id`.
    /// A watch the client already heard created (`announced`: moved from the cache) is not
    /// announced again. A watch the cache can serve (`back`) goes back to it once etcd has
    /// caught it up to about the cache's revision.
    pub(super) fn forward(
        &mut self,
        id: i64,
        create: PbWatchRequestUnion,
        announced: bool,
        back: Option<Watch>,
    ) {
        let back_to = back.as_ref().map(|w| (w.slice, w.epoch));
        let caught_up = self.caught_up.clone();
        self.forwards += 1;
        let seq = self.forwards;
        let served = self.served.clone();
        let upstream = served.upstream.for_streams(self.own_upstream.as_ref());
        let metadata = self.metadata.clone();
        let tx = self.tx.clone();
        let start = match &create {
            PbWatchRequestUnion::CreateRequest(c) => c.start_revision,
            _ => 0,
        };
        let from_now = start <= 0;
        let delivered = Arc::new(AtomicI64::new(if from_now { NOT_YET } else { start - 1 }));
        let relayed = delivered.clone();
        let progress_answers = Arc::new(AtomicU64::new(0));
        let answers = progress_answers.clone();
        let answered = self.progress_answered.clone();
        // The request side: the create, then the progress requests the client's are passed
        // on as; it stays open as long as the relay runs.
        let (requests, rx) = mpsc::channel(2);
        let upstream_requests = requests.clone();
        let create = PbWatchRequest {
            request_union: Some(create),
        };
        served.metrics.forwarded("Watch");
        let task = tokio::spawn(
            async move {
                let _ = requests.send(create).await;
                // etcd checked the client's access when the watch was created; what is left
                // of it runs as the server (the client's token may have expired).
                let (metadata, runs_as) = if announced {
                    (served.own_identity)
                        .moved_watch_metadata(&served.client, &metadata)
                        .await
                } else {
                    (metadata, RunsAs::Client)
                };
                let path = PathAndQuery::from_static(WATCH_PATH);
                let opened = upstream
                    .streaming::<_, PbWatchRequest, PbWatchResponse>(
                        &metadata,
                        runs_as,
                        ReceiverStream::new(rx),
                        path,
                    )
                    .await;
                // An upstream failure cancels this watch alone, as etcd cancels one watch of a
                // stream: the client's other watches go on.
                let cancel = |created: bool, status: Status| {
                    Ok(vec![PbWatchResponse {
                        header: Some(served.headers.header(served.revision())),
                        watch_id: id,
                        created,
                        canceled: true,
                        cancel_reason: format!(
                            "rpc error: code = {:?} desc = {}",
                            status.code(),
                            status.message()
                        ),
                        ..Default::default()
                    }])
                };
                let mut responses = match opened {
                    Ok(responses) => responses.into_inner(),
                    Err(status) => {
                        let _ = tx.send(cancel(!announced, status)).await;
                        return;
                    }
                };
                let mut created = announced;
                let mut fragments = Vec::new();
                let mut wait = CACHE_CATCH_UP;
                // etcd's revision when it created the watch: the end of its catch-up.
                let mut created_at = i64::MAX;
                loop {
                    let Some(response) = responses.next().await else {
                        // The upstream ended the stream without a word for this watch.
                        let ended = Status::unavailable("the upstream ended the watch stream");
                        let _ = tx.send(cancel(!created, ended)).await;
                        break;
                    };
                    let end = match response {
                        // etcd's answer to a progress request passed on (the client's own
                        // answer is the session's): it has sent every event up to it.
                        Ok(response) if response.watch_id == -1 && !response.canceled => {
                            // Before 3.4.25 and 3.5.8 etcd answered at once, ahead of a watch
                            // still catching up: then only a watch past the revision etcd was
                            // at when it created it is taken at etcd's word (as a client of
                            // etcd itself would be).
                            let now = response.header.as_ref().map_or(0, |h| h.revision);
                            let known = relayed.load(Ordering::Relaxed);
                            let synced = served.headers.synced_progress()
                                || (known != NOT_YET && known >= created_at);
                            if synced && now > known {
                                relayed.store(now, Ordering::Relaxed);
                            }
                            answers.fetch_add(1, Ordering::Relaxed);
                            answered.notify_one();
                            false
                        }
                        Ok(mut response) => {
                            if response.created {
                                created_at = response.header.as_ref().map_or(0, |h| h.revision);
                            }
                            response.watch_id = id;
                            let canceled = response.canceled;
                            if response.created && created {
                                if !canceled && response.events.is_empty() {
                                    continue;
                                }
                                response.created = false;
                            }
                            created |= response.created;
                            // What the client has now received all of: whole revisions up to
                            // the last event (etcd splits one only when asked to fragment), or
                            // the revision of a created-from-now or a progress notification,
                            // which etcd sends only once the watch is synced.
                            let now = response.header.as_ref().map_or(0, |h| h.revision);
                            let received = match response.events.last() {
                                Some(_) if response.fragment => None,
                                Some(event) => event.kv.as_ref().map(|kv| kv.mod_revision),
                                None if response.created && from_now => Some(now),
                                None if !response.created && !canceled => Some(now),
                                None => None,
                            };
                            // A response's fragments go to the client back to back.
                            let whole = !response.fragment;
                            fragments.push(response);
                            if !whole {
                                continue;
                            }
                            if tx.send(Ok(std::mem::take(&mut fragments))).await.is_err() {
                                return;
                            }
                            if let Some(received) = received {
                                let known = relayed.load(Ordering::Relaxed);
                                if known == NOT_YET || received > known {
                                    relayed.store(received, Ordering::Relaxed);
                                }
                                let back = match back_to {
                                    Some((slice, epoch)) if !canceled => {
                                        cache_serves(&served, slice, epoch, received, &mut wait)
                                            .await
                                    }
                                    _ => false,
                                };
                                let next = received + 1;
                                if back && caught_up.send(CaughtUp { id, seq, next }).is_ok() {
                                    tracing::info!(id, next, "forwarded watch back to the cache");
                                    return;
                                }
                            }
                            canceled
                        }
                        Err(status) => {
                            let _ = tx.send(cancel(!created, status)).await;
                            true
                        }
                    };
                    if end {
                        break;
                    }
                }
                drop(requests);
            }
            .instrument(tracing::debug_span!("forwarded_watch", id)),
        );
        self.forwarded.insert(
            id,
            Forwarded {
                task,
                delivered,
                requests: upstream_requests,
                progress_answers,
                back,
                seq,
            },
        );
    }

    /// Serves a forwarded watch from the cache again from `next`, its relay having stopped
    /// there (unless the client cancelled it meanwhile, or reused its id since). Its responses
    /// so far are in the stream before any the cache sends it: no gap, no repeat. (Should the
    /// history have moved past `next` meanwhile, the cache forwards it again.)
    pub(super) fn take_back(&mut self, CaughtUp { id, seq, next }: CaughtUp) {
        if self.forwarded.get(&id).is_none_or(|f| f.seq != seq) {
            return;
        }
        let Some(Forwarded {
            back: Some(mut watch),
            task,
            ..
        }) = self.forwarded.remove(&id)
        else {
            return;
        };
        task.abort();
        watch.next = next;
        let counts = &self.served.slices[watch.slice].counts;
        counts.watches(1);
        counts.taken_back();
        self.watches.insert(id, watch);
        self.maybe_behind = true;
    }
}

/// Whether the cache of `slice` can serve a forwarded watch of `epoch` that has received every
/// event up to `received`: it follows etcd, has reached `received` (waited for up to `wait`:
/// it and the relay hear etcd each on its own stream; a wait that runs out is not made again,
/// so a lagging cache slows the relay once) and is at most [`CAUGHT_UP_WITHIN`] past it, and
/// its history reaches back to it. Never a cache behind what the client has heard: its
/// headers would go back.
async fn cache_serves(
    served: &Served,
    slice: usize,
    epoch: u64,
    received: i64,
    wait: &mut Duration,
) -> bool {
    let cached = &served.slices[slice];
    let near = |revision: i64| (revision - received).abs() <= CAUGHT_UP_WITHIN;
    if !cached.follows_etcd() || !near(cached.cache.position().revision) {
        return false;
    }
    let mut changed = served.changed.subscribe();
    let reached = tokio::time::timeout(*wait, async {
        while cached.cache.position().revision < received {
            if changed.changed().await.is_err() {
                return false;
            }
        }
        true
    })
    .await;
    if reached.is_err() {
        *wait = Duration::ZERO;
    }
    matches!(reached, Ok(true))
        && near(cached.cache.position().revision)
        && cached.cache.serves_from(received + 1, epoch)
}

/// How long a relay waits for the cache to reach what it has delivered, before it goes on
/// relaying.
const CACHE_CATCH_UP: Duration = Duration::from_millis(100);
