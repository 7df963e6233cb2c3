//! Relays of forwarded watches: a watch the cache cannot serve (its range outside the
//! prefix, or its start below the history) runs on its own upstream stream, its responses
//! relayed under the client's id, and goes back to the cache once etcd has caught it up. An
//! upstream stream lost after etcd created the watch is opened again from the next revision
//! the client is owed, as clientv3 resumes a watch on another member: the client sees no gap,
//! no repeat, and no cancel.

use tokio::sync::oneshot;

use super::*;
use crate::serve::forward::Upstream;

/// The first wait before a lost upstream stream is opened again; it doubles up to
/// [`RESUME_AT_MOST`] while the upstream cannot be reached, and starts over once it answers.
const RESUME_FIRST: Duration = Duration::from_millis(100);
const RESUME_AT_MOST: Duration = Duration::from_secs(2);

impl Session {
    /// Forwards a watch on its own upstream stream, relaying its responses under the id `id`.
    /// A watch the client already heard created (`announced`: moved from the cache) is not
    /// announced again; one that is not holds back the stream's next requests until its
    /// answer is relayed, as etcd answers a stream's creates in order. A watch the cache can
    /// serve (`back`) goes back to it once etcd has caught it up to about the cache's revision.
    pub(super) fn forward(
        &mut self,
        id: i64,
        create: PbWatchRequestUnion,
        announced: bool,
        back: Option<Watch>,
    ) {
        self.forward_as(id, id, create, announced, back);
    }

    /// [`Session::forward`], for a client that asked for the id `requested` (0: the next
    /// free one, which is `id`): what etcd names in the plain form of a refusal.
    pub(super) fn forward_as(
        &mut self,
        id: i64,
        requested: i64,
        create: PbWatchRequestUnion,
        announced: bool,
        back: Option<Watch>,
    ) {
        let Some(slot) =
            ForwardSlot::take(&self.served, self.connection.as_ref(), self.forward_caps)
        else {
            // etcd's own answer when it cannot take more: the client retries later, or
            // watches through another server.
            let reason = "rpc error: code = ResourceExhausted desc = etcdserver: too many requests";
            tracing::warn!(
                id,
                "a watch to forward is refused: the forwarded watches are at their cap"
            );
            if announced {
                self.control.push_back(PbWatchResponse {
                    header: self.header(self.served.revision()),
                    watch_id: id,
                    canceled: true,
                    cancel_reason: reason.into(),
                    ..Default::default()
                });
            } else {
                self.refused_forward(id);
                self.refuse_create(reason);
            }
            return;
        };
        self.forwards += 1;
        let start = match &create {
            PbWatchRequestUnion::CreateRequest(c) => c.start_revision,
            _ => 0,
        };
        let from_now = start <= 0;
        let delivered = Arc::new(AtomicI64::new(if from_now { NOT_YET } else { start - 1 }));
        let progress_answers = Arc::new(AtomicU64::new(0));
        // The client's progress requests, passed on to whichever upstream stream is open.
        let (requests, client_requests) = mpsc::channel(2);
        let (announce, announced_rx) = oneshot::channel();
        if !announced {
            let until = tokio::time::Instant::now() + self.served.read_timeout;
            self.announcing = Some((id, announced_rx, until));
        }
        self.served.metrics.forwarded("Watch");
        let relay = Relay {
            id,
            requested,
            seq: self.forwards,
            upstream: self.served.upstream.for_streams(self.connection.as_ref()),
            served: self.served.clone(),
            metadata: self.metadata.clone(),
            announced,
            tx: self.tx.clone(),
            create,
            from_now,
            relayed: delivered.clone(),
            answers: progress_answers.clone(),
            answered: self.progress_answered.clone(),
            client_requests,
            progress_pending: false,
            caught_up: self.caught_up.clone(),
            back_to: back.as_ref().map(|w| (w.slice, w.epoch)),
            created: announced,
            announce: Some(announce),
            wait: CACHE_CATCH_UP,
            _slot: slot,
        };
        let task = tokio::spawn(
            relay
                .run()
                .instrument(tracing::debug_span!("forwarded_watch", id)),
        );
        self.forwarded.insert(
            id,
            Forwarded {
                task,
                delivered,
                requests,
                progress_answers,
                back,
                seq: self.forwards,
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

/// One forwarded watch's relay (see [`Session::forward`]).
struct Relay {
    id: i64,
    /// The id the client asked for (0: the next free one).
    requested: i64,
    /// The forward's [`Forwarded::seq`].
    seq: u64,
    served: Arc<Served>,
    upstream: Upstream,
    metadata: tonic::metadata::MetadataMap,
    /// Moved from the cache: the client heard it created, and it runs as the server.
    announced: bool,
    tx: mpsc::Sender<Group>,
    /// The create request, whose start is moved on when a lost stream is opened again.
    create: PbWatchRequestUnion,
    /// Created from etcd's next revision.
    from_now: bool,
    /// [`Forwarded::delivered`].
    relayed: Arc<AtomicI64>,
    /// [`Forwarded::progress_answers`].
    answers: Arc<AtomicU64>,
    /// Woken when etcd answers a progress request.
    answered: Arc<Notify>,
    client_requests: mpsc::Receiver<PbWatchRequest>,
    /// A progress request passed on and not answered yet: asked again on a reopened stream.
    progress_pending: bool,
    caught_up: mpsc::UnboundedSender<CaughtUp>,
    /// The cache and store epoch that can serve the watch again.
    back_to: Option<(usize, u64)>,
    /// The client has heard the watch created.
    created: bool,
    /// Told once the client's answer to the create is in its stream: whether the watch took
    /// its id (not when etcd refused it).
    announce: Option<oneshot::Sender<bool>>,
    /// See [`cache_serves`].
    wait: Duration,
    /// Its place among the forwarded watches, given back when the relay ends.
    _slot: ForwardSlot,
}

/// A forwarded watch's place under the caps, in all and per client connection (see
/// [`CacheServerOptions::max_forwarded_watches`](crate::serve::CacheServerOptions::max_forwarded_watches)).
struct ForwardSlot {
    served: Arc<Served>,
    connection: Option<Connection>,
}

impl ForwardSlot {
    /// A place, if the caps `(in_all, per_connection)` leave one.
    fn take(
        served: &Arc<Served>,
        connection: Option<&Connection>,
        (in_all, per_connection): (usize, usize),
    ) -> Option<Self> {
        if let Some(connection) = connection {
            if !connection.forwarded_watch(per_connection) {
                served.metrics.forwarded_watch_refused();
                return None;
            }
        }
        if !served.metrics.forwarded_watch(in_all) {
            if let Some(connection) = connection {
                connection.forwarded_watch_ended();
            }
            return None;
        }
        Some(ForwardSlot {
            served: served.clone(),
            connection: connection.cloned(),
        })
    }
}

impl Drop for ForwardSlot {
    fn drop(&mut self) {
        self.served.metrics.forwarded_watch_ended();
        if let Some(connection) = &self.connection {
            connection.forwarded_watch_ended();
        }
    }
}

/// How one upstream stream of a relay ended.
enum Ended {
    /// The relay is over: the watch was cancelled (by etcd, or for an error a client of etcd
    /// would also get), went back to the cache, or the client is gone.
    Done,
    /// The stream failed after etcd created the watch.
    Lost(Status),
}

impl Relay {
    async fn run(mut self) {
        let mut backoff = RESUME_FIRST;
        // Attempts since the stream last relayed anything: the first of an outage is logged at
        // INFO, the retries at DEBUG (thousands of forwarded watches retry every 2 s).
        let mut retries = 0u32;
        loop {
            let relayed_before = self.relayed.load(Ordering::Relaxed);
            let lost = match self.attempt().await {
                Ended::Done => return,
                Ended::Lost(status) => status,
            };
            let delivered = self.relayed.load(Ordering::Relaxed);
            if !self.created || delivered == NOT_YET || !resumable(&lost) {
                self.cancel(lost).await;
                return;
            }
            if delivered != relayed_before {
                backoff = RESUME_FIRST;
                retries = 0;
            }
            retries += 1;
            if self.back_to_cache(delivered).await {
                return;
            }
            let next = delivered + 1;
            if retries == 1 {
                tracing::info!(id = self.id, next, error = %lost.message(), "forwarded watch's upstream stream lost: opening it again");
            } else {
                tracing::debug!(id = self.id, next, retries, error = %lost.message(), "forwarded watch's upstream stream still lost");
            }
            if let PbWatchRequestUnion::CreateRequest(create) = &mut self.create {
                create.start_revision = next;
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = self.tx.closed() => return,
            }
            backoff = (backoff * 2).min(RESUME_AT_MOST);
        }
    }

    /// Cancels the watch for `status`, as etcd cancels one watch of a stream: the client's
    /// other watches go on. One etcd never created is refused as a create is, under -1, and
    /// takes no id.
    async fn cancel(&mut self, status: Status) {
        let cancel = PbWatchResponse {
            header: Some(self.served.headers.header(self.served.revision())),
            watch_id: if self.created { self.id } else { -1 },
            created: !self.created,
            canceled: true,
            cancel_reason: format!(
                "rpc error: code = {:?} desc = {}",
                status.code(),
                status.message()
            ),
            ..Default::default()
        };
        let _ = self.tx.send(Ok(vec![cancel])).await;
        let took_id = self.created;
        self.announced(took_id);
    }

    /// The client's answer to the create is in its stream (or never will be); `took_id`: the
    /// watch keeps its id until the client cancels it.
    fn announced(&mut self, took_id: bool) {
        if let Some(announce) = self.announce.take() {
            let _ = announce.send(took_id);
        }
    }

    /// Hands the watch back to the cache, if it can serve it from past `received`.
    async fn back_to_cache(&mut self, received: i64) -> bool {
        let Some((slice, epoch)) = self.back_to else {
            return false;
        };
        if !cache_serves(&self.served, slice, epoch, received, &mut self.wait).await {
            return false;
        }
        let (id, seq, next) = (self.id, self.seq, received + 1);
        if self.caught_up.send(CaughtUp { id, seq, next }).is_err() {
            return false;
        }
        tracing::info!(id, next, "forwarded watch back to the cache");
        true
    }

    /// Opens one upstream stream for the watch and relays it until it ends.
    async fn attempt(&mut self) -> Ended {
        // etcd checked the client's access when the watch was created; what is left of a
        // watch moved from the cache, or opened again, runs as the server (the client's token
        // may have expired, or been forgotten by a restarted etcd).
        let (metadata, runs_as) = if self.announced || self.created {
            (self.served.own_identity)
                .moved_watch_metadata(&self.served.client, &self.metadata)
                .await
        } else {
            (self.metadata.clone(), RunsAs::Client)
        };
        let (upstream_requests, rx) = mpsc::channel(2);
        let _ = upstream_requests.try_send(PbWatchRequest {
            request_union: Some(self.create.clone()),
        });
        if self.progress_pending {
            let _ = upstream_requests.try_send(progress_request());
        }
        let opened = self
            .upstream
            .streaming::<_, PbWatchRequest, PbWatchResponse>(
                &metadata,
                runs_as,
                ReceiverStream::new(rx),
                PathAndQuery::from_static(WATCH_PATH),
            )
            .await;
        let mut responses = match opened {
            Ok(responses) => responses.into_inner(),
            Err(status) => return Ended::Lost(status),
        };
        let mut fragments = Vec::new();
        // etcd's revision when it created the watch: the end of its catch-up.
        let mut created_at = i64::MAX;
        let mut asking = true;
        loop {
            let response = tokio::select! {
                request = self.client_requests.recv(), if asking => {
                    match request {
                        Some(request) => {
                            self.progress_pending = true;
                            let _ = upstream_requests.send(request).await;
                        }
                        None => asking = false,
                    }
                    continue;
                }
                response = responses.next() => response,
            };
            let Some(response) = response else {
                return Ended::Lost(Status::unavailable("the upstream ended the watch stream"));
            };
            let mut response = match response {
                Ok(response) => response,
                Err(status) => return Ended::Lost(status),
            };
            if response.watch_id == -1 && !response.canceled {
                // etcd's answer to a progress request passed on (the client's own answer is
                // the session's): it has sent every event up to it. Before 3.4.25 and 3.5.8
                // etcd answered at once, ahead of a watch still catching up: then only a watch
                // past the revision etcd was at when it created it is taken at etcd's word (as
                // a client of etcd itself would be).
                // An answer without a header says nothing of a revision.
                let now = response.header.as_ref().map_or(0, |h| h.revision);
                let known = self.relayed.load(Ordering::Relaxed);
                let synced = self.served.headers.synced_progress()
                    || (known != NOT_YET && known >= created_at);
                if synced && now > known {
                    self.relayed.store(now, Ordering::Relaxed);
                }
                self.progress_pending = false;
                self.answers.fetch_add(1, Ordering::Relaxed);
                self.answered.notify_one();
                continue;
            }
            if response.created {
                created_at = response.header.as_ref().map_or(i64::MAX, |h| h.revision);
            }
            let canceled = response.canceled;
            // etcd refused the create (the client's access): it took no id, and says so under
            // id -1, or under the id asked for in the plain form of older releases.
            let refused =
                response.created && canceled && response.compact_revision == 0 && !self.created;
            response.watch_id = match refused {
                true if response.watch_id == -1 => -1,
                true => self.requested,
                false => self.id,
            };
            if response.created && self.created {
                // Created again (a reopened stream, or a watch moved from the cache).
                if !canceled && response.events.is_empty() {
                    continue;
                }
                response.created = false;
            }
            let first_created = response.created;
            self.created |= response.created;
            // What the client has now received all of: whole revisions up to the last event
            // (etcd splits one only when asked to fragment), or the revision of a
            // created-from-now or a progress notification, which etcd sends only once the
            // watch is synced.
            let now = response.header.as_ref().map(|h| h.revision);
            let received = match response.events.last() {
                Some(_) if response.fragment => None,
                Some(event) => event.kv.as_ref().map(|kv| kv.mod_revision),
                None if response.created && self.from_now => now,
                None if !response.created && !canceled => now,
                None => None,
            };
            // A response's fragments go to the client back to back.
            let whole = !response.fragment;
            fragments.push(response);
            if !whole {
                continue;
            }
            if self
                .tx
                .send(Ok(std::mem::take(&mut fragments)))
                .await
                .is_err()
            {
                return Ended::Done;
            }
            if first_created || canceled {
                self.announced(!refused);
            }
            if canceled {
                return Ended::Done;
            }
            if let Some(received) = received {
                let known = self.relayed.load(Ordering::Relaxed);
                if known == NOT_YET || received > known {
                    self.relayed.store(received, Ordering::Relaxed);
                }
                if self.back_to_cache(received).await {
                    return Ended::Done;
                }
            }
        }
    }
}

/// Whether a lost upstream stream is opened again: for what clientv3 retries on (the member
/// gone, a connection broken), not for etcd's "no leader", on which clientv3 closes the watch.
fn resumable(status: &Status) -> bool {
    use tonic::Code;
    match status.code() {
        Code::Unavailable => !status.message().contains("no leader"),
        Code::Internal | Code::Unknown => true,
        _ => false,
    }
}

fn progress_request() -> PbWatchRequest {
    PbWatchRequest {
        request_union: Some(PbWatchRequestUnion::ProgressRequest(Default::default())),
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
