//! The gRPC Watch service: checks a new stream (a leader, a draining server), starts its
//! session, and hands the client the session's responses.

use super::*;
use crate::serve::status::{no_leader, requires_leader, stopped};

/// The Watch service.
pub(crate) struct WatchService {
    pub(crate) served: Arc<Served>,
    /// How often a watch created with `progress_notify` hears of the revision when idle.
    pub(crate) progress_interval: Duration,
    /// The size at which a response to a watch created with `fragment` is split.
    pub(crate) fragment_bytes: usize,
    /// See [`Session::last_word_within`].
    pub(crate) last_word_within: Duration,
    /// The most forwarded watches, in all and per client connection.
    pub(crate) forward_caps: (usize, usize),
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<PbWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl PbWatchService for WatchService {
    type WatchStream = ResponseStream;

    async fn watch(
        &self,
        request: Request<Streaming<PbWatchRequest>>,
    ) -> Result<Response<ResponseStream>, Status> {
        let (metadata, extensions, requests) = request.into_parts();
        let connection = Connection::of(&extensions);
        let require_leader = requires_leader(&metadata);
        if require_leader && self.served.headers.no_leader() {
            return Err(no_leader());
        }
        if *self.served.draining.borrow() {
            return Err(stopped());
        }
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let (caught_up, caught_up_rx) = mpsc::unbounded_channel();
        let session = Session {
            served: self.served.clone(),
            metadata,
            connection,
            tx,
            watches: BTreeMap::new(),
            forwarded: BTreeMap::new(),
            ended: BTreeSet::new(),
            control: VecDeque::new(),
            next_id: 0,
            turn: 0,
            maybe_behind: false,
            backlog: VecDeque::new(),
            backlog_bytes: 0,
            checking: None,
            announcing: None,
            to_forward: None,
            last_word_within: self.last_word_within,
            require_leader,
            progress: None,
            progress_answered: Arc::new(Notify::new()),
            caught_up,
            caught_up_rx,
            forwards: 0,
            fragment_bytes: self.fragment_bytes,
            forward_caps: self.forward_caps,
        };
        let span = tracing::info_span!("watch_session");
        self.served.metrics.session(1);
        let served = self.served.clone();
        let interval = self.progress_interval;
        tokio::spawn(
            async move {
                session.run(requests, interval).await;
                served.metrics.session(-1);
            }
            .instrument(span),
        );
        Ok(Response::new(Box::pin(Outgoing {
            rx,
            group: Default::default(),
        })))
    }
}

/// The client's side of a session: its groups, one response at a time. A group is one item of
/// the channel, so the fragments of a response never have another watch's response between
/// them, as etcd's one send loop never does (a client joins fragments of one watch id only).
struct Outgoing {
    rx: mpsc::Receiver<Group>,
    group: VecDeque<PbWatchResponse>,
}

impl Stream for Outgoing {
    type Item = Result<PbWatchResponse, Status>;

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(response) = this.group.pop_front() {
                return std::task::Poll::Ready(Some(Ok(response)));
            }
            match std::task::ready!(this.rx.poll_recv(cx)) {
                Some(Ok(group)) => this.group.extend(group),
                Some(Err(status)) => return std::task::Poll::Ready(Some(Err(status))),
                None => return std::task::Poll::Ready(None),
            }
        }
    }
}
