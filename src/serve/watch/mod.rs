//! The Watch service: many watches on one client stream, served from the cache's history.
//!
//! A session (one client stream) keeps, per watch, the next revision it owes the client, and
//! pulls the history's groups from there whenever the client's stream has room: nothing is
//! copied per watcher ahead of time, so a client that does not read holds no memory but its
//! position and its stream's buffer (`STREAM_BUFFER` responses, each of up to 1,000 revisions
//! and taking no further revision past `MAX_RESPONSE_BYTES`, or a response's fragments), and
//! never holds back other
//! clients or the cache. A watch whose position falls out of the history is forwarded to the
//! upstream from that position, as etcd would catch it up from its own store (or cancel it,
//! if etcd compacted it too). Watches of ranges outside the prefix, or from below the
//! history, are forwarded too, each on its own upstream stream. A stream's requests are
//! handled in order; a create that waits for etcd (the client's access, a start etcd may have
//! compacted) holds back the requests after it, not the stream's other watches.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::proto::{PbWatchRequest, PbWatchRequestUnion, PbWatchResponse, PbWatchService};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::codec::Streaming;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::{Request, Response, Status};
use tonic_prost::prost::Message;
use tracing::Instrument;

mod fragment;
mod relay;
mod requests;
mod service;

pub(crate) use self::service::WatchService;

use self::fragment::fragments;
use super::cache::{in_range, Position, RevisionError};
use super::forward::{Connection, RunsAs, TOKENLESS_REFUSED};
use super::served::Served;
use super::status::{no_leader, stopped};

/// What a session hands its client's stream: responses that go out back to back (one, or
/// the fragments of one), or the end of the stream.
type Group = Result<Vec<PbWatchResponse>, Status>;

/// Groups of responses waiting for the client, per stream. Past it the session waits: a
/// client that does not read stalls only itself.
const STREAM_BUFFER: usize = 16;
/// Control responses (created, canceled, progress) waiting for the client, per stream. Past
/// it the session stops reading the client's requests and skips progress notifications until
/// the client reads, as etcd blocks its receive loop: a client that sends requests and never
/// reads grows nothing.
const MAX_CONTROL: usize = 1024;
/// The bytes of requests a stream reads ahead while a create waits for etcd: past it the
/// session reads no more of the client's requests until it has handled some, as etcd reads one
/// request at a time. A stream then holds at most this and one request (up to
/// `max_request_bytes`, 2 MiB by default), however many it is sent.
const MAX_BACKLOG_BYTES: usize = 256 << 10;
/// The most revisions one response carries when a watch catches up (etcd's
/// `watchBatchMaxRevs`); a revision is never split.
const MAX_REVISIONS_PER_RESPONSE: usize = 1000;
/// The encoded events past which a catch-up response takes no further revision (it ends with
/// the revision that crossed it): what a stream's buffer holds is then bounded by this, not by
/// the history (a client that does not read kept `STREAM_BUFFER` responses of up to 1,000
/// revisions, each as large as the history allowed). etcd puts up to 1,000 revisions in one
/// catch-up response whatever their size, which a client's default 4 MiB message limit
/// (tonic's, so etcd-client's) refuses; revisions sent in more responses are what etcd sends
/// a watch that keeps up.
const MAX_RESPONSE_BYTES: usize = 1 << 20;
const WATCH_PATH: &str = "/etcdserverpb.Watch/Watch";
// etcd's WatchCreateRequest.FilterType.
const FILTER_NOPUT: i32 = 0;
const FILTER_NODELETE: i32 = 1;

/// One watch served from the cache.
struct Watch {
    /// The served prefix whose cache serves it.
    slice: usize,
    key: Vec<u8>,
    end: Vec<u8>,
    /// The next revision owed to the client: every event below it was sent.
    next: i64,
    epoch: u64,
    prev_kv: bool,
    no_put: bool,
    no_delete: bool,
    progress_notify: bool,
    fragment: bool,
}

/// One client stream.
struct Session {
    served: Arc<Served>,
    metadata: tonic::metadata::MetadataMap,
    /// The client connection's own upstream connection, for its forwarded watches.
    connection: Option<Connection>,
    tx: mpsc::Sender<Group>,
    watches: BTreeMap<i64, Watch>,
    /// Watches forwarded to the upstream.
    forwarded: BTreeMap<i64, Forwarded>,
    /// Watches the cache cancelled as compacted: etcd keeps such an id taken until the client
    /// cancels it, and acknowledges that cancel.
    ended: BTreeSet<i64>,
    /// Responses that go before any event: created, canceled, progress.
    control: VecDeque<PbWatchResponse>,
    next_id: i64,
    /// Round robin among the watches.
    turn: i64,
    /// Whether a watch may be behind the cache (set when the cache moves or a watch is
    /// created, cleared by a round that finds nothing to send).
    maybe_behind: bool,
    /// Requests read and not yet handled: they wait behind `checking`, in order, as etcd
    /// handles a stream's requests one after another.
    backlog: VecDeque<PbWatchRequest>,
    /// The encoded size of the requests in `backlog` (see [`MAX_BACKLOG_BYTES`]).
    backlog_bytes: usize,
    /// A create whose checks with etcd are under way (may the client read the range, does
    /// etcd still hold its start): the stream's other watches go on meanwhile.
    checking: Option<Checking>,
    /// A forwarded create whose answer etcd has not given yet: the stream's next requests wait
    /// for it to be relayed, so that creates are answered in order.
    /// The watch's id, the relay's word (whether the watch took its id), and how long it is
    /// waited for: an upstream that never answers the create must not hold the stream's
    /// requests for good.
    announcing: Option<(i64, oneshot::Receiver<bool>, tokio::time::Instant)>,
    /// A create to forward once the answers before it are in the client's stream: its relay
    /// answers there directly, and must not overtake them.
    to_forward: Option<(i64, i64, PbWatchRequestUnion, Option<Watch>)>,
    /// How long a stream's last word (a drain, no leader) waits behind what the client has not
    /// read yet: the server's drain timeout.
    last_word_within: Duration,
    /// The client asked for a leader (`hasleader` metadata): the stream ends when the
    /// upstream has none, as etcd ends it when its member loses the leader.
    require_leader: bool,
    /// A progress request waiting for the stream's watches to catch up (see
    /// [`Session::answer_progress`]); requests made meanwhile share its answer, as etcd's do.
    progress: Option<ProgressWait>,
    /// Woken by a forwarded watch's relay when etcd answers its progress request.
    progress_answered: Arc<Notify>,
    /// Forwarded watches whose relays stopped once etcd had caught them up, for the cache to
    /// serve again (see [`Session::take_back`]).
    caught_up: mpsc::UnboundedSender<CaughtUp>,
    /// Where [`Session::run`] hears them.
    caught_up_rx: mpsc::UnboundedReceiver<CaughtUp>,
    /// The last [`Forwarded::seq`] given.
    forwards: u64,
    /// See [`WatchService::fragment_bytes`].
    fragment_bytes: usize,
    /// See [`WatchService::forward_caps`].
    forward_caps: (usize, usize),
}

/// What a progress answer waits for: each cached watch to reach the revision the cache had
/// when it was asked, each forwarded watch to get etcd's answer (its count of answers).
struct ProgressWait {
    cached: Vec<(i64, i64)>,
    forwarded: Vec<(i64, u64)>,
}

/// A watch forwarded to the upstream: the task relaying it, the revision up to which the
/// client has received all of its events ([`NOT_YET`] before etcd created it from "now"), its
/// upstream stream's request side, and how many progress requests etcd has answered on it.
struct Forwarded {
    task: JoinHandle<()>,
    delivered: Arc<AtomicI64>,
    requests: mpsc::Sender<PbWatchRequest>,
    progress_answers: Arc<AtomicU64>,
    /// What the cache serves again once etcd has caught the watch up, if it can serve it.
    back: Option<Watch>,
    /// This forward among the session's: a relay's word that its watch is caught up is
    /// taken for this one only, not for a later watch that reuses the id.
    seq: u64,
}

/// A forwarded watch's relay stopped at a whole revision once etcd caught it up: the watch's
/// id, its [`Forwarded::seq`], and the next revision it is owed.
struct CaughtUp {
    id: i64,
    seq: u64,
    next: i64,
}

/// How far behind the cache's revision a forwarded watch's relay may be and still hand it back
/// to the cache (never ahead of it): about where a watch that keeps up is.
const CAUGHT_UP_WITHIN: i64 = 16;

/// [`Forwarded::delivered`] of a watch from etcd's next revision that etcd has not yet
/// created: it owes nothing up to any revision a progress answer could name.
const NOT_YET: i64 = i64::MAX;

/// A create request waiting for etcd's answers before it is answered.
struct Checking {
    /// The id the client asked for; 0 for the next free one, taken once the watch is.
    id: i64,
    key: Vec<u8>,
    request: PbWatchRequest,
    slice: Option<usize>,
    checked: Pin<Box<dyn std::future::Future<Output = Checked> + Send>>,
}

/// etcd's answers for a create: the client's access, and whether its start revision can be
/// replayed from the history.
struct Checked {
    access: Result<(), Status>,
    replayable: bool,
}

impl Drop for Session {
    fn drop(&mut self) {
        for forwarded in self.forwarded.values() {
            forwarded.task.abort();
        }
        for watch in self.watches.values() {
            self.served.slices[watch.slice].counts.watches(-1);
        }
    }
}

impl Session {
    async fn run(mut self, mut requests: Streaming<PbWatchRequest>, interval: Duration) {
        let mut position = self.served.changed.subscribe();
        let mut leader = self.served.headers.watch_leader();
        let mut draining = self.served.draining.subscribe();
        let mut progress = tokio::time::interval(interval);
        progress.reset();
        let tx = self.tx.clone();
        let progress_answered = self.progress_answered.clone();
        // A client may close its side of the stream and keep reading (etcd-client's `split()`
        // with the sender dropped, grpcurl): etcd keeps streaming to it, and so does this.
        let mut reading = true;
        loop {
            if self.control.is_empty() {
                if let Some((id, requested, create, back)) = self.to_forward.take() {
                    self.forward_as(id, requested, create, false, back);
                }
            }
            // Requests in order, until one waits for etcd.
            while self.checking.is_none() && self.announcing.is_none() && self.to_forward.is_none()
            {
                let Some(request) = self.backlog.pop_front() else {
                    break;
                };
                self.backlog_bytes -= request.encoded_len();
                self.handle(request);
            }
            self.answer_progress();
            let work = self.has_work();
            let room = self.control.len() + self.backlog.len() < MAX_CONTROL
                && self.backlog_bytes < MAX_BACKLOG_BYTES;
            tokio::select! {
                checked = async {
                    match self.checking.as_mut() {
                        Some(checking) => checking.checked.as_mut().await,
                        None => std::future::pending().await,
                    }
                }, if self.checking.is_some() => {
                    if let Some(checking) = self.checking.take() {
                        self.created(checking, checked);
                    }
                }
                announced = async {
                    match self.announcing.as_mut() {
                        Some((_, announcing, until)) => {
                            tokio::time::timeout_at(*until, announcing).await.ok()
                        }
                        None => None,
                    }
                }, if self.announcing.is_some() => {
                    if let Some((id, mut announcing, _)) = self.announcing.take() {
                        // The relay's answer, else (the wait ran out, the relay is gone) the
                        // client hears that etcd did not answer.
                        let answer = match announced {
                            Some(answer) => answer.ok(),
                            None => announcing.try_recv().ok(),
                        };
                        match answer {
                            Some(true) => {}
                            Some(false) => self.refused_forward(id),
                            None => self.unanswered_forward(id),
                        }
                    }
                }
                request = requests.next(), if room && reading => match request {
                    Some(Ok(request)) => {
                        self.backlog_bytes += request.encoded_len();
                        self.backlog.push_back(request);
                    }
                    Some(Err(status)) => {
                        tracing::debug!(%status, "watch stream ended by the client");
                        return;
                    }
                    None => reading = false,
                },
                // The client is gone (it dropped the response stream).
                _ = tx.closed() => return,
                changed = position.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    self.maybe_behind = true;
                }
                permit = tx.reserve(), if work => match permit {
                    Ok(permit) => {
                        if let Some((group, applied)) = self.next_response() {
                            permit.send(Ok(group));
                            if let Some(applied) = applied {
                                self.served.metrics.response_sent(applied);
                            }
                        }
                    }
                    Err(_) => return,
                },
                _ = progress.tick() => self.notify_progress(),
                // A forwarded watch's etcd answered a progress request: answer_progress sees.
                _ = progress_answered.notified(), if self.progress.is_some() => {}
                Some(caught_up) = self.caught_up_rx.recv() => self.take_back(caught_up),
                _ = async { leader.wait_for(|no_leader| *no_leader).await.is_ok() },
                    if self.require_leader =>
                {
                    return last_word(&tx, self.last_word_within, no_leader()).await;
                }
                // The server drains: the client watches again elsewhere.
                _ = async { draining.wait_for(|draining| *draining).await.is_ok() } => {
                    return last_word(&tx, self.last_word_within, stopped()).await;
                }
            }
        }
    }

    fn header(&self, revision: i64) -> Option<etcd_client::proto::PbResponseHeader> {
        Some(self.served.headers.header(revision))
    }

    /// Watches with `progress_notify` that are caught up hear of the cache's revision.
    fn notify_progress(&mut self) {
        for (id, watch) in &self.watches {
            if self.control.len() >= MAX_CONTROL {
                return;
            }
            let now = self.position(watch).revision;
            if watch.progress_notify && watch.next > now {
                self.control.push_back(PbWatchResponse {
                    header: Some(self.served.headers.header(now)),
                    watch_id: *id,
                    ..Default::default()
                });
            }
        }
    }

    /// Answers the waiting progress request once every watch has caught up (see
    /// [`ProgressWait`]), with a revision each has received every event up to.
    fn answer_progress(&mut self) {
        let Some(wait) = &self.progress else {
            return;
        };
        let cached = wait
            .cached
            .iter()
            .all(|(id, target)| self.watches.get(id).is_none_or(|w| w.next > *target));
        let forwarded = wait.forwarded.iter().all(|(id, target)| {
            self.forwarded.get(id).is_none_or(|f| {
                f.task.is_finished() || f.progress_answers.load(Ordering::Relaxed) >= *target
            })
        });
        if !(cached && forwarded) {
            return;
        }
        self.progress = None;
        // A relay that ended (its watch cancelled, awaiting the client's cancel) owes nothing.
        let forwarded = self
            .forwarded
            .values()
            .filter(|f| !f.task.is_finished())
            .map(|f| f.delivered.load(Ordering::Relaxed))
            .filter(|&r| r != NOT_YET);
        let revision = self
            .watches
            .values()
            .map(|w| (w.next - 1).min(self.position(w).revision))
            .chain(forwarded)
            .min()
            .unwrap_or_else(|| self.served.revision());
        self.control.push_back(PbWatchResponse {
            header: self.header(revision),
            watch_id: -1,
            ..Default::default()
        });
    }

    /// Where the cache of `watch`'s prefix is.
    fn position(&self, watch: &Watch) -> Position {
        self.served.slices[watch.slice].cache.position()
    }

    fn has_work(&self) -> bool {
        !self.control.is_empty() || self.maybe_behind
    }

    /// The next response owed to the client, if any, with when the cache applied the oldest
    /// revision it carries (none for control responses): control responses first, then the
    /// next watch (in turn) that is behind the cache. Watches with nothing that matches move
    /// on; a whole round without a response clears `maybe_behind` until the cache moves again,
    /// unless a watch read a batch of revisions with nothing for it and has more to read.
    fn next_response(&mut self) -> Option<(Vec<PbWatchResponse>, Option<std::time::Instant>)> {
        if let Some(response) = self.control.pop_front() {
            return Some((vec![response], None));
        }
        let mut still_behind = false;
        for _ in 0..self.watches.len() {
            let found = self
                .watches
                .range(self.turn..)
                .next()
                .or_else(|| self.watches.iter().next());
            let Some((&id, watch)) = found else {
                break;
            };
            let position = self.position(watch);
            let behind = watch.next <= position.revision || watch.epoch != position.epoch;
            let from = watch.next;
            self.turn = id.saturating_add(1);
            let slice = &self.served.slices[watch.slice];
            // The cache has stopped following etcd.
            let stopped = slice.refused().map(|error| {
                format!("etcd refuses the server's own watch of the prefix ({error})")
            });
            if let Some(why) = stopped {
                // The client watches again, and that watch is forwarded to etcd.
                self.watches.remove(&id);
                slice.counts.watches(-1);
                let cancel = PbWatchResponse {
                    header: self.header(position.revision),
                    watch_id: id,
                    canceled: true,
                    cancel_reason: format!(
                        "etcd-informer cache server: {why}; watch again (forwarded to etcd)"
                    ),
                    ..Default::default()
                };
                return Some((vec![cancel], None));
            }
            if behind {
                if let Some(found) = self.catch_up(id) {
                    return Some(found);
                }
                // A batch of revisions that held nothing for this watch, with more to read:
                // it is still behind, and nothing will publish to say so on a quiet prefix.
                still_behind |= self
                    .watches
                    .get(&id)
                    .is_some_and(|w| w.next > from && w.next <= self.position(w).revision);
            }
        }
        self.maybe_behind = still_behind;
        None
    }

    /// The events owed to watch `id`, as one response (whole revisions only), or its fragments
    /// if the watch asked for them. A watch the history no longer reaches back to is forwarded
    /// from its position, or cancelled when the store it watched was replaced.
    fn catch_up(&mut self, id: i64) -> Option<(Vec<PbWatchResponse>, Option<std::time::Instant>)> {
        let served = self.served.clone();
        let watch = self.watches.get_mut(&id)?;
        let cache = &served.slices[watch.slice].cache;
        let counts = &served.slices[watch.slice].counts;
        let (groups, upto) =
            match cache.groups_from(watch.next, watch.epoch, MAX_REVISIONS_PER_RESPONSE) {
                Ok(found) => found,
                Err(RevisionError::Future) => return None,
                Err(RevisionError::Compacted(_)) if watch.epoch == cache.position().epoch => {
                    // etcd still holds what the history dropped (or says it compacted it
                    // too): it catches the watch up from where the client is.
                    tracing::info!(id, from = watch.next, "watch behind the history forwarded");
                    let watch = self.watches.remove(&id)?;
                    counts.watches(-1);
                    counts.slow_forwarded();
                    let mut create = PbWatchRequestUnion::CreateRequest(Default::default());
                    if let PbWatchRequestUnion::CreateRequest(create) = &mut create {
                        create.key = watch.key.clone();
                        create.range_end = watch.end.clone();
                        create.start_revision = watch.next;
                        create.progress_notify = watch.progress_notify;
                        create.prev_kv = watch.prev_kv;
                        create.fragment = watch.fragment;
                        create.filters = [
                            (watch.no_put, FILTER_NOPUT),
                            (watch.no_delete, FILTER_NODELETE),
                        ]
                        .into_iter()
                        .filter_map(|(on, filter)| on.then_some(filter))
                        .collect();
                    }
                    self.forward(id, create, true, Some(watch));
                    return None;
                }
                Err(RevisionError::Compacted(compact_revision)) => {
                    // The store was replaced: the client lists again.
                    tracing::info!(id, from = watch.next, "watch of a replaced store cancelled");
                    self.watches.remove(&id);
                    self.ended.insert(id);
                    counts.watches(-1);
                    let cancel = PbWatchResponse {
                        header: self.header(cache.position().revision),
                        watch_id: id,
                        canceled: true,
                        compact_revision,
                        ..Default::default()
                    };
                    return Some((vec![cancel], None));
                }
            };
        let mut full = groups.len() == MAX_REVISIONS_PER_RESPONSE;
        let mut events = Vec::new();
        let mut bytes = 0;
        let mut last = watch.next - 1;
        let mut applied = None;
        for (n, group) in groups.iter().enumerate() {
            last = group.revision;
            for event in &group.events {
                let wanted = in_range(&event.key, &watch.key, &watch.end)
                    && !(event.kv.is_some() && watch.no_put)
                    && !(event.kv.is_none() && watch.no_delete);
                if wanted {
                    applied = applied.or(group.applied);
                    let event = event.to_pb(watch.prev_kv);
                    bytes += event.encoded_len();
                    events.push(event);
                }
            }
            if bytes >= MAX_RESPONSE_BYTES && n + 1 < groups.len() {
                // The rest of the revisions go in the next response.
                full = true;
                break;
            }
        }
        watch.next = if full { last + 1 } else { upto.max(last) + 1 };
        let fragment = watch.fragment;
        if events.is_empty() {
            return None;
        }
        counts.sent(events.len());
        let header_revision = if full { last } else { upto.max(last) };
        let response = PbWatchResponse {
            header: self.header(header_revision),
            watch_id: id,
            events,
            ..Default::default()
        };
        if !fragment {
            return Some((vec![response], applied));
        }
        Some((fragments(response, self.fragment_bytes), applied))
    }
}

/// Ends a stream with `status`, after what the client has not read yet (clientv3 moves to
/// another server on it, and takes a stream ended without it as final). A client that reads
/// nothing `within` loses it: the stream ends anyway.
async fn last_word(tx: &mpsc::Sender<Group>, within: Duration, status: Status) {
    if tokio::time::timeout(within, tx.send(Err(status)))
        .await
        .is_err()
    {
        tracing::debug!("a watch stream's last word was not read in time");
    }
}
