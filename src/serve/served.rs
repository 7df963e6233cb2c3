//! What the KV and Watch services share: the served prefixes (their caches), the upstream, the
//! headers, the access checks and the consistent-read proof.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use etcd_client::{Client, GetOptions};
use tokio::sync::watch;
use tokio::time::Instant;
use tonic::metadata::AsciiMetadataValue;
use tonic::Status;

use super::access::AccessAnswers;
use super::cache::{Position, ServedCache};
use super::forward::{RunsAs, Upstream};
use super::header::Headers;
use super::stats::{PrefixCounts, ServerMetrics};
use crate::informer::audit::AuditCounts;
use crate::listwatch::etcd::proof::{prove_range, Held, ProofFailed, WatchProgress, PROGRESS_WAIT};
#[cfg(doc)]
use crate::listwatch::etcd::EtcdListerWatcher;
use crate::reflector::RevisionHandle;
use crate::sync::lock;

/// One served prefix: its cache, and the health of the reflector that fills it.
pub(crate) struct Slice {
    pub(crate) prefix: Vec<u8>,
    pub(crate) prefix_end: Vec<u8>,
    pub(crate) cache: Arc<ServedCache>,
    pub(crate) reflected: RevisionHandle,
    /// What the prefix's audits found.
    pub(crate) audits: Arc<AuditCounts>,
    /// The consistent-read proof under way, which reads that arrive meanwhile share.
    pub(crate) proof: Mutex<Option<Arc<Proof>>>,
    /// What the server did with this prefix (its own metric series).
    pub(crate) counts: PrefixCounts,
    /// When a refusal a renewed token may end was first seen (see [`RENEWABLE`]).
    pub(crate) refused_since: Mutex<Option<SystemTime>>,
    /// Cuts the reflector's backoff short (`notify_waiters`): its next list can succeed.
    pub(crate) retry: Arc<tokio::sync::Notify>,
    /// The highest revision of a write the server forwarded that touched the prefix: the
    /// cache reaches it through its own watch.
    pub(crate) written: AtomicI64,
    /// The last proof: the cache's content at (revision, epoch) is etcd's at the third
    /// revision. Serializable reads of that content may name it too.
    pub(crate) proven: Mutex<(i64, u64, i64)>,
    /// The progress of the cache's own watch: on a trustworthy etcd, a linearizable read asks
    /// it instead of reading the range in etcd.
    pub(crate) progress: Arc<WatchProgress>,
}

/// One consistent-read proof: that the cache's content of a range at revision `since` (`len` keys) is
/// etcd's at revision `at`. Its answer goes to every read that waits on it.
pub(crate) struct Proof {
    key: Vec<u8>,
    end: Vec<u8>,
    since: i64,
    len: usize,
    at: i64,
    answer: watch::Sender<ProofAnswer>,
}

impl Proof {
    /// Whether it is about the same content as `range`.
    fn same_content(&self, range: &Range<'_>) -> bool {
        (self.since, self.len) == (range.since, range.len)
            && self.key == range.key
            && self.end == range.end
    }
}

#[derive(Clone, Copy, PartialEq)]
enum ProofAnswer {
    Pending,
    /// Whether etcd proved the content unchanged (`false` too when etcd could not be asked).
    Proven(bool),
    /// The read that was proving went away (its deadline, its client): a read waiting on it
    /// proves for itself.
    Abandoned,
}

/// Settles a proof when its reader is done with it, or went away mid-way, and clears the
/// slice's slot if it still holds it.
struct Proving<'a> {
    slice: &'a Slice,
    proof: Arc<Proof>,
}

impl Drop for Proving<'_> {
    fn drop(&mut self) {
        self.proof.answer.send_if_modified(|answer| {
            let unsettled = *answer == ProofAnswer::Pending;
            if unsettled {
                *answer = ProofAnswer::Abandoned;
            }
            unsettled
        });
        let mut slot = lock(&self.slice.proof);
        if slot.as_ref().is_some_and(|p| Arc::ptr_eq(p, &self.proof)) {
            *slot = None;
        }
    }
}

/// etcd's answers that refuse a request for who made it (rpctypes' auth errors), as the
/// reflector records them: the server's own credentials are not enough (auth turned on while
/// it runs without a user, or its user's permissions revoked).
const REFUSALS: [&str; 5] = [
    "etcdserver: user name is empty",
    "etcdserver: permission denied",
    "etcdserver: invalid auth token",
    "etcdserver: user name not found",
    "etcdserver: authentication failed",
];

/// The consistent-read proof was refused to the server's own client: etcd would answer the
/// client itself (its token), so its read is forwarded with it rather than failed.
pub(crate) const PROOF_REFUSED: &str =
    "etcd-informer cache server: etcd refused the server's consistent-read proof";

/// Refusals a renewed token may end: etcd forgets simple tokens after their TTL and when it
/// restarts, JWTs expire, and etcd answers a watch with a forgotten token "invalid auth token"
/// (3.4) or "permission denied" (3.5). The reflector authenticates again before it retries
/// (`TokenRenewal`), so these stand only once a later attempt is refused too, with nothing
/// proving the cache fresh in between.
const RENEWABLE: [&str; 2] = [
    "etcdserver: invalid auth token",
    "etcdserver: permission denied",
];

/// The refusal in `health` that stands (see [`Slice::refused`]), given `first`: when the
/// renewable refusal that may be retried was first seen (kept by the caller).
fn refusal(health: crate::reflector::Health, first: &mut Option<SystemTime>) -> Option<String> {
    // A watch stream that opens counts as connected before etcd has answered its create,
    // so `first` is forgotten only once the cache is proven fresh after it (below).
    let (error, at) = match health.last_error {
        Some((error, at)) if !health.connected => (error, at),
        _ => return None,
    };
    if !REFUSALS.iter().any(|refusal| error.contains(refusal)) {
        *first = None;
        return None;
    }
    if !RENEWABLE.iter().any(|renewable| error.contains(renewable)) {
        return Some(error);
    }
    match *first {
        // Refused again since, and never proven fresh in between.
        Some(since) if at > since && health.proven_fresh_at.is_none_or(|p| p < since) => {
            Some(error)
        }
        Some(since) if health.proven_fresh_at.is_none_or(|p| p < since) => None,
        _ => {
            *first = Some(at);
            None
        }
    }
}

impl Slice {
    /// The cache's content at revision `since` was proven to be etcd's at `at`.
    fn proved(&self, since: i64, at: i64) {
        let position = self.cache.position();
        if position.revision == since {
            *lock(&self.proven) = (since, position.epoch, at);
        }
    }

    /// The revision the cache's content at `position` is known to be etcd's at: the last
    /// proof's, if it was of this content, else the cache's own.
    pub(crate) fn proven_at(&self, position: Position) -> i64 {
        let (since, epoch, at) = *lock(&self.proven);
        if (since, epoch) == (position.revision, position.epoch) {
            at.max(position.revision)
        } else {
            position.revision
        }
    }

    /// Whether etcd's range `[key, end)` lies within the prefix, and the cache has listed and
    /// holds every key of it, and still follows etcd (not [refused](Self::refused)).
    pub(crate) fn covers(&self, key: &[u8], end: &[u8]) -> bool {
        if !self.follows_etcd() {
            return false;
        }
        if self.prefix.is_empty() {
            return !key.is_empty();
        }
        if key < self.prefix.as_slice() {
            return false;
        }
        if end.is_empty() {
            return key.starts_with(&self.prefix);
        }
        if self.prefix_end == [0] {
            return true;
        }
        end != [0] && end <= self.prefix_end.as_slice()
    }

    /// Whether the cache has listed the prefix, holds every key of it, and still follows etcd
    /// (not [refused](Self::refused)).
    pub(crate) fn follows_etcd(&self) -> bool {
        self.cache.position().synced && self.refused().is_none()
    }

    /// etcd's refusal of the cache's own list or watch, while it stands: the cache has stopped
    /// following etcd, so nothing is answered from it until a list succeeds again (etcd's
    /// answer to a forwarded request is then the one a client gets). A failure of another
    /// kind (etcd unreachable, a watch broken) is retried with the cache still served, as a
    /// member cut off from its cluster still answers serializable reads.
    pub(crate) fn refused(&self) -> Option<String> {
        refusal(self.reflected.health(), &mut lock(&self.refused_since))
    }

    /// Listed, and its watch connected and proven fresh within the source's liveness bound.
    pub(crate) fn ready(&self) -> bool {
        self.cache.position().synced && self.reflected.health().connected
    }

    /// The first key of the prefix's range (`\0` for the whole keyspace).
    pub(crate) fn first_key(&self) -> Vec<u8> {
        if self.prefix.is_empty() {
            vec![0]
        } else {
            self.prefix.clone()
        }
    }
}

/// What the KV service and the watch service share.
pub(crate) struct Served {
    /// The served prefixes; none is a prefix of another.
    pub(crate) slices: Vec<Slice>,
    /// Moves whenever any cache does: what watch sessions wait on.
    pub(crate) changed: Arc<watch::Sender<u64>>,
    pub(crate) upstream: Upstream,
    pub(crate) headers: Headers,
    /// The server's own client of the upstream, for the consistent-read proof.
    pub(crate) client: Client,
    /// What the upstream said of clients' access to ranges.
    pub(crate) access: AccessAnswers,
    /// What etcd last said of its compaction (see [`Served::etcd_holds`]).
    pub(crate) compaction: Compaction,
    pub(crate) read_timeout: Duration,
    pub(crate) metrics: ServerMetrics,
    /// Set when the server starts to drain ([`RunningServer::shutdown`]): it is no longer
    /// ready, and watch streams end.
    ///
    /// [`RunningServer::shutdown`]: super::RunningServer::shutdown
    pub(crate) draining: watch::Sender<bool>,
    /// Who a watch moved out of the history runs as in etcd.
    pub(crate) own_identity: OwnIdentity,
}

/// The server's own identity in etcd, as far as its forwarded requests can carry it: what a
/// watch it serves runs as once it falls out of the history and is forwarded. etcd checks a
/// watch's permission once, when it is created, and the server checked it then with the
/// client's token; that token may have expired since (simple tokens and JWTs do, 5 minutes
/// by default), so the rest of the watch runs as the server, which reads the whole prefix.
pub(crate) enum OwnIdentity {
    /// Nothing known: a moved watch keeps its client's token.
    ClientsToken,
    /// The client certificate of the upstream channel: a moved watch goes without a token,
    /// and etcd runs it as that certificate's common name.
    Certificate,
    /// A user and password: a moved watch goes with the server's own token.
    User {
        name: String,
        password: String,
        /// etcd's last answer to the server's login, and when it was asked: a token, or none
        /// (auth is off, or etcd refused or did not answer).
        token: tokio::sync::Mutex<Option<(Option<AsciiMetadataValue>, Instant)>>,
    },
}

/// How long the server's own token is used for further moved watches before it asks for
/// another: a burst of watches moved at once asks once, and a token this young has not
/// expired (etcd's shortest TTL is a second).
const OWN_TOKEN_REUSE: Duration = Duration::from_millis(500);
/// How long a login that gave no token is not tried again.
const NO_TOKEN_REMEMBERED: Duration = Duration::from_secs(5);
/// How long the server's login may take.
const LOGIN_TIMEOUT: Duration = Duration::from_secs(5);

impl OwnIdentity {
    /// The metadata a watch moved out of the history is forwarded with, and whose it is: the
    /// client's, with its credentials replaced by the server's identity when the server has
    /// one. Without a token for the server's user (auth is off, or etcd refused it), the
    /// client's token is kept.
    pub(crate) async fn moved_watch_metadata(
        &self,
        client: &Client,
        metadata: &tonic::metadata::MetadataMap,
    ) -> (tonic::metadata::MetadataMap, RunsAs) {
        let mut moved = metadata.clone();
        let token = match self {
            OwnIdentity::ClientsToken => return (moved, RunsAs::Client),
            OwnIdentity::Certificate => None,
            OwnIdentity::User {
                name,
                password,
                token,
            } => {
                let mut last = token.lock().await;
                let reuse = match &*last {
                    Some((Some(value), at)) if at.elapsed() < OWN_TOKEN_REUSE => Some(value),
                    Some((None, at)) if at.elapsed() < NO_TOKEN_REMEMBERED => {
                        return (moved, RunsAs::Client)
                    }
                    _ => None,
                };
                let value = match reuse {
                    Some(value) => value.clone(),
                    None => {
                        let mut login = client.auth_client();
                        let asked = Instant::now();
                        let answer = tokio::time::timeout(
                            LOGIN_TIMEOUT,
                            login.authenticate(name.clone(), password.clone()),
                        )
                        .await;
                        let value = match answer {
                            Ok(Ok(answer)) => answer.token().parse().ok(),
                            Ok(Err(error)) if error.to_string().contains("not enabled") => None,
                            Ok(Err(error)) => {
                                tracing::warn!(user = %name, %error, "etcd refused the server's own user: a watch moved out of the history keeps its client's token");
                                None
                            }
                            Err(_) => {
                                tracing::warn!(user = %name, "etcd did not answer the server's login: a watch moved out of the history keeps its client's token");
                                None
                            }
                        };
                        *last = Some((value.clone(), asked));
                        match value {
                            Some(value) => value,
                            None => return (moved, RunsAs::Client),
                        }
                    }
                };
                Some(value)
            }
        };
        moved.remove("token");
        moved.remove("authorization");
        if let Some(token) = token {
            moved.insert("token", token);
        }
        (moved, RunsAs::Server)
    }
}

/// How long etcd's answer that it holds a revision stands for later questions: compaction only
/// moves up, so a revision at or above one etcd held was held then too; a compaction made
/// straight on etcd is seen within this long.
const COMPACTION_ANSWER_TTL: Duration = Duration::from_secs(1);

/// The lowest revision etcd was last seen to hold (not compacted), and when.
#[derive(Default)]
pub(crate) struct Compaction(Mutex<Option<(i64, Instant)>>);

impl Served {
    /// Whether etcd still holds `revision` of the prefix of `slice`, as etcd itself decides a
    /// read at that revision: the cache's history may reach below a compaction made straight
    /// on etcd, and must then answer as etcd does. Asked with a serializable count of one key
    /// at that revision (no value read), or answered from an answer at most
    /// [`COMPACTION_ANSWER_TTL`] old for a revision at or below it (the pages of one list).
    pub(crate) async fn etcd_holds(&self, slice: &Slice, revision: i64) -> Result<bool, Status> {
        if let Some((held, at)) = *lock(&self.compaction.0) {
            if held <= revision && at.elapsed() < COMPACTION_ANSWER_TTL {
                return Ok(true);
            }
        }
        let asked = Instant::now();
        let options = GetOptions::new()
            .with_revision(revision)
            .with_count_only()
            .with_serializable();
        let mut kv = self.client.kv_client();
        let read = kv.get(slice.first_key(), Some(options));
        match tokio::time::timeout(self.read_timeout, read).await {
            Ok(Ok(_)) => {
                let mut known = lock(&self.compaction.0);
                if known.is_none_or(|(held, at)| at < asked || revision < held) {
                    *known = Some((revision, asked));
                }
                Ok(true)
            }
            Ok(Err(etcd_client::Error::GRpcStatus(status)))
                if status
                    .message()
                    .contains("required revision has been compacted") =>
            {
                Ok(false)
            }
            // A revision past etcd's is not compacted; the read itself will say it is future.
            Ok(Err(etcd_client::Error::GRpcStatus(status)))
                if status.message().contains("future revision") =>
            {
                Ok(true)
            }
            Ok(Err(e)) => Err(Status::unavailable(format!(
                "cannot ask etcd whether revision {revision} is compacted: {e}"
            ))),
            Err(_) => Err(Status::unavailable(format!(
                "etcd did not say within {:?} whether revision {revision} is compacted",
                self.read_timeout
            ))),
        }
    }

    /// The served prefix that holds all of etcd's range `[key, end)` and can answer it from
    /// its cache, if one does.
    pub(crate) fn slice_for(&self, key: &[u8], end: &[u8]) -> Option<usize> {
        self.slices.iter().position(|s| s.covers(key, end))
    }

    /// Every prefix ready, and the upstream's identity known.
    pub(crate) fn ready(&self) -> bool {
        !*self.draining.borrow() && self.headers.known() && self.slices.iter().all(Slice::ready)
    }

    /// Why the server is not [ready](Self::ready), in one line; `None` when it is.
    pub(crate) fn why_not_ready(&self) -> Option<String> {
        if *self.draining.borrow() {
            return Some("draining: the server is stopping".into());
        }
        for slice in &self.slices {
            if slice.ready() {
                continue;
            }
            let prefix = String::from_utf8_lossy(&slice.prefix);
            let health = slice.reflected.health();
            let listed = slice.cache.position().synced;
            let what = match (listed, health.last_error) {
                (false, Some((error, _))) => {
                    format!("the cache of {prefix} has not listed: {error}")
                }
                (false, None) => format!("the cache of {prefix} is listing"),
                (true, Some((error, _))) => {
                    format!("the watch of {prefix} is not connected: {error}")
                }
                (true, None) => format!("the watch of {prefix} is not connected"),
            };
            return Some(what);
        }
        (!self.headers.known()).then(|| "the upstream's identity is not known yet".into())
    }

    /// The lowest revision of the caches: one every cache has reached.
    pub(crate) fn revision(&self) -> i64 {
        self.slices
            .iter()
            .map(|s| s.cache.position().revision)
            .min()
            .unwrap_or(0)
    }

    /// Returns once the cache's content of the range `[key, end)` (within `slice`'s prefix) is
    /// proven to be etcd's at `target`, or with `None` at etcd's current revision, read
    /// linearizably (a linearizable read; read-your-writes for a write forwarded before it; see
    /// [`Self::current_revision`]). The cache usually reaches it through its own watch within
    /// a moment. If it does not (keys outside the range moved etcd's revision), a trustworthy
    /// etcd is asked for the watch's progress ([`WatchProgress::reach`]), whose bookmark brings
    /// the cache there; otherwise (or if that fails) [`Self::prove`]
    /// checks that the range is unchanged since the cache's revision: at once for a range of
    /// up to [`SMALL_PREFIX`] keys, after [`PROOF_GRACE`] for a larger one (etcd reads the
    /// range's values for it), and not at all while a write into the prefix through this
    /// server is on its way (its event will come). Gives up with Unavailable after
    /// `read_timeout`. Returns etcd's revision the content is now proven at (the answer's header
    /// may name it, as etcd's would). The proof never moves the cache's revision: events still
    /// on their way through the watch would be skipped.
    pub(crate) async fn linearize(
        &self,
        slice: &Slice,
        key: &[u8],
        end: &[u8],
        target: Option<i64>,
    ) -> Result<i64, Status> {
        let deadline = Instant::now() + self.read_timeout;
        let unavailable =
            |what: String| Status::unavailable(format!("etcd-informer cache server: {what}"));
        let (target, mut position) = match target {
            Some(target) => (target, slice.cache.subscribe()),
            None => self.current_target(slice, deadline).await?,
        };
        let whole = key == slice.first_key().as_slice() && end == slice.prefix_end.as_slice();
        let held = |slice: &Slice| match whole {
            true => slice.cache.revision_and_len(),
            false => match slice.cache.count_at(key, end, 0, 0) {
                Ok((count, since)) => (since, usize::try_from(count).unwrap_or(usize::MAX)),
                Err(_) => (0, 0),
            },
        };
        let coming = slice.written.load(Ordering::Relaxed) >= target;
        let by_progress = slice.progress.trusted();
        let grace = match coming {
            true => deadline,
            false if by_progress || held(slice).1 <= SMALL_PREFIX => Instant::now(),
            false => Instant::now() + PROOF_GRACE,
        };
        let mut proven_at = None;
        // The watch is asked once. Once it has passed `target` on, its bookmark is on the way
        // to the cache: awaited until then, and the range proven if it did not come.
        let (mut asked, mut awaiting) = (false, None);
        loop {
            let now = *position.borrow_and_update();
            if now.revision >= target {
                // Counted once the cache got there, and only if no range proof was tried: a
                // bookmark that did not come in time left the proof to the range (`proofs`).
                if awaiting.is_some() && proven_at.is_none() {
                    slice.counts.proved_by_progress();
                }
                return Ok(target);
            }
            if Instant::now() >= grace && by_progress && !asked {
                asked = true;
                let reach = slice.progress.reach(target);
                if tokio::time::timeout_at(deadline, reach).await == Ok(true) {
                    awaiting = Some(Instant::now() + PROGRESS_WAIT);
                }
                continue;
            }
            let awaiting_bookmark = awaiting.filter(|until| Instant::now() < *until);
            if Instant::now() >= grace
                && awaiting_bookmark.is_none()
                && proven_at != Some(now.revision)
            {
                let (since, len) = held(slice);
                proven_at = Some(since);
                let range = Range {
                    key,
                    end,
                    since,
                    len,
                };
                let proof = self.prove_shared(slice, range, target);
                if let Ok(true) = tokio::time::timeout_at(deadline, proof).await {
                    if whole {
                        slice.proved(since, target);
                    }
                    return Ok(target);
                }
            }
            let wake = match awaiting_bookmark {
                _ if Instant::now() < grace => grace,
                Some(until) => until.min(deadline),
                None => deadline,
            };
            match tokio::time::timeout_at(wake, position.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err(unavailable("the cache stopped".into())),
                Err(_) if Instant::now() < deadline => {}
                Err(_) => {
                    return Err(unavailable(format!(
                    "the cache did not reach etcd's revision {target} within {:?} (it is at {})",
                    self.read_timeout,
                    slice.cache.position().revision
                )))
                }
            }
        }
    }

    /// etcd's current revision for a linearizable read of `slice`, and the cache's position
    /// to follow: never a cache ahead of it (the store was wiped or restored, and the cache
    /// proves nothing until it is listed from the new one).
    async fn current_target(
        &self,
        slice: &Slice,
        deadline: Instant,
    ) -> Result<(i64, watch::Receiver<Position>), Status> {
        let unavailable =
            |what: String| Status::unavailable(format!("etcd-informer cache server: {what}"));
        loop {
            let mut position = slice.cache.subscribe();
            let before = *position.borrow_and_update();
            let target = tokio::time::timeout_at(deadline, self.current_revision(slice))
                .await
                .map_err(|_| {
                    unavailable("no answer from etcd for the consistent-read proof".into())
                })?
                .map_err(|e| {
                    let error = e.to_string();
                    if REFUSALS.iter().any(|refusal| error.contains(refusal)) {
                        // The server's own credentials are not enough (auth turned on while it
                        // runs without a user): see `PROOF_REFUSED`.
                        Status::permission_denied(format!("{PROOF_REFUSED}: {error}"))
                    } else {
                        unavailable(format!("consistent-read proof failed: {e}"))
                    }
                })?;
            if before.revision <= target {
                return Ok((target, position));
            }
            while position.borrow_and_update().epoch == before.epoch {
                match tokio::time::timeout_at(deadline, position.changed()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => return Err(unavailable("the cache stopped".into())),
                    Err(_) => {
                        return Err(unavailable(format!(
                            "etcd is at revision {target}, below the cache's {}: the store was wiped or restored, and the cache is not listed from it yet",
                            before.revision
                        )))
                    }
                }
            }
        }
    }

    /// etcd's current revision, read linearizably: a count of the one key equal to the prefix,
    /// since etcd counts a range by walking its index (37 ms of a 100k-key prefix, most of a
    /// list's time from the cache) and any linearizable read names the revision.
    async fn current_revision(&self, slice: &Slice) -> Result<i64, etcd_client::Error> {
        let options = GetOptions::new().with_count_only();
        let asked = std::time::Instant::now();
        let resp = self
            .client
            .kv_client()
            .get(slice.first_key(), Some(options))
            .await?;
        let Some(header) = resp.header() else {
            return Ok(0);
        };
        self.headers
            .proven(header.cluster_id(), header.raft_term(), asked);
        Ok(header.revision())
    }

    /// [`Self::prove`], shared: a read that finds a proof under way for the same content at
    /// its own target or a later revision (etcd's, read after this read arrived) waits for its
    /// answer instead of reading the prefix in etcd again; otherwise it proves, and reads that
    /// arrive meanwhile can wait on it.
    async fn prove_shared(&self, slice: &Slice, range: Range<'_>, target: i64) -> bool {
        let joined = {
            let mut slot = lock(&slice.proof);
            match slot.as_ref() {
                Some(p) if p.same_content(&range) && p.at >= target => Err(p.answer.subscribe()),
                _ => {
                    let proof = Arc::new(Proof {
                        key: range.key.to_vec(),
                        end: range.end.to_vec(),
                        since: range.since,
                        len: range.len,
                        at: target,
                        answer: watch::channel(ProofAnswer::Pending).0,
                    });
                    *slot = Some(proof.clone());
                    Ok(proof)
                }
            }
        };
        let proving = match joined {
            Ok(proof) => Some(Proving { slice, proof }),
            Err(mut answer) => {
                let settled = answer
                    .wait_for(|a| *a != ProofAnswer::Pending)
                    .await
                    .map(|a| *a);
                match settled {
                    Ok(ProofAnswer::Proven(proven)) => return proven,
                    _ => None,
                }
            }
        };
        slice.counts.proved();
        let proven = matches!(self.prove(range, target).await, Ok(true));
        if let Some(proving) = proving {
            proving
                .proof
                .answer
                .send_replace(ProofAnswer::Proven(proven));
        }
        proven
    }

    /// Whether `range` at etcd's revision `at` is the cache's content: the source's proof
    /// ([`prove_range`]), which needs no old revision while the cache holds every key, so an
    /// idle range whose revision etcd compacted still proves fresh.
    async fn prove(&self, range: Range<'_>, at: i64) -> Result<bool, ProofFailed> {
        let held = Held {
            key: range.key,
            range_end: range.end,
            since: range.since,
            cached: range.len,
            // Every key is held: a key that is not UTF-8 is escaped, a value is its bytes.
            whole: true,
        };
        let proof = prove_range(&self.client, held, Some(at), self.read_timeout).await?;
        Ok(proof.unchanged)
    }
}

/// A range of a prefix's cache as it holds it: its first key and end (etcd's forms), the
/// cache's revision, and how many keys it holds there.
#[derive(Clone, Copy)]
struct Range<'a> {
    key: &'a [u8],
    end: &'a [u8],
    since: i64,
    len: usize,
}

/// How long a linearizable read of a large prefix waits for the cache's own watch before it
/// asks etcd to prove the prefix unchanged (a read of the whole prefix in etcd).
pub(crate) const PROOF_GRACE: Duration = Duration::from_millis(50);
/// A prefix this small is proven unchanged at once: the proof costs etcd little.
const SMALL_PREFIX: usize = 1000;

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use super::*;

    /// A reflector's health after a failure with `error` at `at`.
    fn failed(error: &str, at: SystemTime) -> crate::reflector::Health {
        crate::reflector::Health {
            disconnected_since: Some(at),
            last_error: Some((error.to_owned(), at)),
            ..Default::default()
        }
    }

    #[test]
    fn a_refusal_a_renewed_token_may_end_stands_once_refused_again() {
        let t0 = SystemTime::now();
        let t1 = t0 + Duration::from_millis(800);
        for forgotten in [
            "etcd canceled the watch: etcdserver: invalid auth token",
            "etcd canceled the watch: etcdserver: permission denied",
        ] {
            let mut first = None;
            assert_eq!(refusal(failed(forgotten, t0), &mut first), None);
            // Seen again, the same failure: still none.
            assert_eq!(refusal(failed(forgotten, t0), &mut first), None);
            // Refused again after the renewal: it stands.
            let again = refusal(failed(forgotten, t1), &mut first);
            assert_eq!(again.as_deref(), Some(forgotten));
            // Proven fresh in between (the renewed retry worked): a new first refusal.
            let mut first = Some(t0);
            let mut fresh = failed(forgotten, t1);
            fresh.proven_fresh_at = Some(t0 + Duration::from_millis(400));
            assert_eq!(refusal(fresh, &mut first), None);
            assert_eq!(first, Some(t1));
        }
        // No renewal helps a client without credentials: it stands at once.
        let no_user = "etcdserver: user name is empty";
        let mut first = None;
        assert_eq!(
            refusal(failed(no_user, t0), &mut first).as_deref(),
            Some(no_user)
        );
        // Other failures are no refusal, and connected is none.
        assert_eq!(refusal(failed("connection refused", t1), &mut first), None);
        let mut connected = failed(no_user, t1);
        connected.connected = true;
        assert_eq!(refusal(connected, &mut first), None);
        // A stream that reopened (connected) between two refusals keeps the first.
        let denied = "etcdserver: permission denied";
        let mut first = None;
        assert_eq!(refusal(failed(denied, t0), &mut first), None);
        let mut reopened = failed(denied, t0);
        reopened.connected = true;
        assert_eq!(refusal(reopened, &mut first), None);
        assert_eq!(
            refusal(failed(denied, t1), &mut first).as_deref(),
            Some(denied)
        );
    }
}
