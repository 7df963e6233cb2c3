//! A stream's requests, handled in order as etcd handles them: creates (refused, served from
//! the cache, or forwarded once etcd has answered the checks they wait for), cancels, and
//! progress requests.

use super::*;

impl Session {
    /// Whether `id` names a watch of the stream (served, forwarded, or ended by etcd and not
    /// yet cancelled by the client).
    pub(super) fn taken(&self, id: i64) -> bool {
        self.watches.contains_key(&id)
            || self.forwarded.contains_key(&id)
            || self.ended.contains(&id)
    }

    /// etcd refused the forwarded create of watch `id`: as etcd, the stream keeps no watch
    /// under it, and an automatic id it took is the next one again.
    pub(super) fn refused_forward(&mut self, id: i64) {
        self.forwarded.remove(&id);
        if self.next_id == id + 1 {
            self.next_id = id;
        }
    }

    /// etcd did not answer the forwarded create of watch `id` in time: it is dropped, and the
    /// client told so as of a create refused, free to create it again.
    pub(super) fn unanswered_forward(&mut self, id: i64) {
        if let Some(forwarded) = self.forwarded.get(&id) {
            forwarded.task.abort();
        }
        self.refused_forward(id);
        tracing::warn!(
            id,
            "etcd did not answer a forwarded watch's creation in time"
        );
        self.refuse_create(
            "rpc error: code = Unavailable desc = etcd-informer cache server: etcd did not answer the watch's creation in time",
        );
    }

    /// The next free watch id, taken.
    pub(super) fn next_free_id(&mut self) -> i64 {
        while self.taken(self.next_id) {
            self.next_id += 1;
        }
        self.next_id += 1;
        self.next_id - 1
    }

    pub(super) fn handle(&mut self, request: PbWatchRequest) {
        match &request.request_union {
            Some(PbWatchRequestUnion::CreateRequest(create)) => {
                let mut key = create.key.clone();
                if key.is_empty() {
                    // etcd watches the empty key as `\0`.
                    key = vec![0];
                }
                // etcd refuses an empty or inverted range before it takes an id (`\0` is
                // "every key from `key`", not an end).
                let end = create.range_end.as_slice();
                if !end.is_empty() && end != [0] && key.as_slice() >= end {
                    self.refuse_create("mvcc: watcher range is empty");
                    return;
                }
                // An automatic id is taken once the watch is: a refused create leaves it free.
                let id = create.watch_id;
                if id != 0 && self.taken(id) {
                    self.refuse_create("mvcc: duplicate watch ID provided on the WatchStream");
                    return;
                }
                let slice = self.served.slice_for(&key, &create.range_end);
                let (served, metadata) = (self.served.clone(), self.metadata.clone());
                let (range_key, range_end, start) =
                    (key.clone(), create.range_end.clone(), create.start_revision);
                let checked = async move {
                    // etcd refuses a watch of a range the client may not read, on the stream;
                    // a forwarded watch is judged by etcd, once this server lets it through.
                    let Some(slice) = slice else {
                        let access = served.upstream.admit(&metadata, WATCH_PATH);
                        return Checked {
                            access,
                            replayable: false,
                        };
                    };
                    let access = (served.access)
                        .may_read(&served.upstream, &metadata, &range_key, &range_end)
                        .await;
                    let position = served.slices[slice].cache.position();
                    let replayable = access.is_err()
                        || start <= 0
                        || start > position.revision
                        || replayable(&served, slice, start).await;
                    Checked { access, replayable }
                };
                self.checking = Some(Checking {
                    id,
                    key,
                    request,
                    slice,
                    checked: Box::pin(checked),
                });
            }
            Some(PbWatchRequestUnion::CancelRequest(cancel)) => {
                let id = cancel.watch_id;
                let known = if let Some(watch) = self.watches.remove(&id) {
                    self.served.slices[watch.slice].counts.watches(-1);
                    true
                } else if let Some(forwarded) = self.forwarded.remove(&id) {
                    // etcd keeps the id of a watch it cancelled itself (compacted) until the
                    // client cancels it too, and acknowledges that cancel: so does this.
                    forwarded.task.abort();
                    true
                } else {
                    self.ended.remove(&id)
                };
                // etcd answers a cancel of an unknown watch with nothing.
                if known {
                    self.control.push_back(PbWatchResponse {
                        header: self.header(self.served.revision()),
                        watch_id: id,
                        canceled: true,
                        ..Default::default()
                    });
                }
            }
            Some(PbWatchRequestUnion::ProgressRequest(_)) => {
                if self.progress.is_some() {
                    return;
                }
                // etcd 3.4.25+ and 3.5.8+ answer for the stream's watches: with none, nothing.
                let none = self.watches.is_empty() && self.forwarded.is_empty();
                if none && self.served.headers.synced_progress() {
                    return;
                }
                // etcd (3.4.25+, 3.5.8+) answers once every watch of the stream is synced. A
                // forwarded watch's etcd is asked in turn: its last event says nothing of the
                // quiet revisions since.
                let cached = self
                    .watches
                    .iter()
                    .map(|(&id, w)| (id, self.position(w).revision))
                    .collect();
                let forwarded = self
                    .forwarded
                    .iter()
                    .filter_map(|(&id, f)| {
                        let asked = PbWatchRequest {
                            request_union: Some(PbWatchRequestUnion::ProgressRequest(
                                Default::default(),
                            )),
                        };
                        // A full request side already holds a progress request, which will
                        // be answered too.
                        match f.requests.try_send(asked) {
                            Err(mpsc::error::TrySendError::Closed(_)) => None,
                            _ => Some((id, f.progress_answers.load(Ordering::Relaxed) + 1)),
                        }
                    })
                    .collect();
                self.progress = Some(ProgressWait { cached, forwarded });
                self.answer_progress();
            }
            None => {}
        }
    }

    /// Answers a create once etcd's answers are in (see [`Checking`]): refused, forwarded, or
    /// served from the cache.
    pub(super) fn created(&mut self, checking: Checking, checked: Checked) {
        let Checking {
            id,
            key,
            request,
            slice,
            ..
        } = checking;
        let Some(PbWatchRequestUnion::CreateRequest(mut create)) = request.request_union else {
            return;
        };
        if let Err(refused) = checked.access {
            // etcd's text of the gRPC error, as grpc-go prints it; the plain form (older
            // releases) names no reason but this server's own refusal, which says what to do.
            let plain = self.served.headers.plain_watch_refusals();
            let (watch_id, refused) = match plain {
                true if refused.message() != TOKENLESS_REFUSED => (
                    create.watch_id,
                    Status::permission_denied("etcdserver: permission denied"),
                ),
                true => (create.watch_id, refused),
                false => (-1, refused),
            };
            self.control.push_back(PbWatchResponse {
                header: self.header(self.served.revision()),
                watch_id,
                created: true,
                canceled: true,
                cancel_reason: format!(
                    "rpc error: code = {:?} desc = {}",
                    refused.code(),
                    refused.message()
                ),
                ..Default::default()
            });
            return;
        }
        let id = if id != 0 { id } else { self.next_free_id() };
        let watch = slice.map(|slice| {
            let position = self.served.slices[slice].cache.position();
            Watch {
                slice,
                end: create.range_end.clone(),
                key,
                next: if create.start_revision > 0 {
                    create.start_revision
                } else {
                    position.revision + 1
                },
                epoch: position.epoch,
                prev_kv: create.prev_kv,
                no_put: create.filters.contains(&FILTER_NOPUT),
                no_delete: create.filters.contains(&FILTER_NODELETE),
                progress_notify: create.progress_notify,
                fragment: create.fragment,
            }
        });
        let watch = match watch {
            Some(watch) if checked.replayable => watch,
            // Outside the prefixes (it stays with etcd); or below the history, or compacted
            // on etcd meanwhile: etcd replays it, and it comes back to the cache once caught
            // up, or etcd cancels it as compacted, as a client of etcd would see.
            back => {
                tracing::debug!(id, start = create.start_revision, "watch forwarded");
                let requested = std::mem::take(&mut create.watch_id);
                let create = PbWatchRequestUnion::CreateRequest(create);
                self.to_forward = Some((id, requested, create, back));
                return;
            }
        };
        let position = self.served.slices[watch.slice].cache.position();
        tracing::debug!(id, from = watch.next, "watch created");
        self.served.slices[watch.slice].counts.watches(1);
        self.watches.insert(id, watch);
        self.maybe_behind = true;
        self.control.push_back(PbWatchResponse {
            header: self.header(position.revision),
            watch_id: id,
            created: true,
            ..Default::default()
        });
    }

    /// Answers a create request as etcd answers one it refuses: created and cancelled at
    /// once, under the watch id -1 (the create's own id is not taken).
    pub(super) fn refuse_create(&mut self, reason: &str) {
        self.control.push_back(PbWatchResponse {
            header: self.header(self.served.revision()),
            watch_id: -1,
            created: true,
            canceled: true,
            cancel_reason: reason.into(),
            ..Default::default()
        });
    }
}

/// Whether a watch from `start` can be replayed from the history of `slice`: it reaches back
/// that far, and etcd has not compacted `start` either (a compaction made straight on etcd).
/// When etcd cannot be asked, the history's own answer stands.
async fn replayable(served: &Served, slice: usize, start: i64) -> bool {
    let cached = &served.slices[slice];
    let position = cached.cache.position();
    if cached.cache.groups_from(start, position.epoch, 0).is_err() {
        return false;
    }
    match served.etcd_holds(cached, start).await {
        Ok(held) => held,
        Err(status) => {
            tracing::debug!(%status, start, "replaying from the history unasked");
            true
        }
    }
}
