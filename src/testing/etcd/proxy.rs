//! A TCP proxy in front of an etcd member that can cut the link: a network partition between
//! one client and etcd, without touching etcd.

use std::io;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Forwards connections from a loopback port to `upstream`. [`cut`](Self::cut) holds every byte
/// in both directions, on open and new connections alike, as a partition does (nothing is
/// refused or reset: requests simply get no answer); [`heal`](Self::heal) lets them through
/// again. Stops when dropped.
///
/// ```no_run
/// # async fn demo(etcd: etcd_informer::testing::etcd::EtcdServer) -> std::io::Result<()> {
/// use etcd_informer::testing::etcd::TcpProxy;
/// let proxy = TcpProxy::start(&etcd.endpoint()).await?;
/// let client = etcd_informer::connect([proxy.endpoint()]).await.expect("connect");
/// proxy.cut(); // `client` hears nothing from etcd until `proxy.heal()`
/// # drop(client); Ok(()) }
/// ```
pub struct TcpProxy {
    endpoint: String,
    cut: Arc<watch::Sender<bool>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.accept.abort();
        // Ends the connections' tasks too: they stop when the sender is gone.
    }
}

impl TcpProxy {
    /// Starts forwarding to `upstream` (`host:port`, or `http://host:port`).
    pub async fn start(upstream: &str) -> io::Result<TcpProxy> {
        let upstream = upstream
            .trim_start_matches("http://")
            .trim_start_matches("https://")
            .to_owned();
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let endpoint = format!("127.0.0.1:{}", listener.local_addr()?.port());
        let cut = Arc::new(watch::Sender::new(false));
        let state = cut.clone();
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let upstream = upstream.clone();
                let cut = state.subscribe();
                tokio::spawn(async move {
                    let _ = forward(inbound, &upstream, cut).await;
                });
            }
        });
        Ok(TcpProxy {
            endpoint,
            cut,
            accept,
        })
    }

    /// Where clients connect (`127.0.0.1:PORT`).
    pub fn endpoint(&self) -> String {
        self.endpoint.clone()
    }

    /// Holds every byte from now on, both ways.
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    /// Lets bytes through again, the held ones first.
    pub fn heal(&self) {
        self.cut.send_replace(false);
    }
}

async fn forward(
    inbound: TcpStream,
    upstream: &str,
    mut cut: watch::Receiver<bool>,
) -> io::Result<()> {
    passable(&mut cut).await?;
    let outbound = TcpStream::connect(upstream).await?;
    let (mut in_read, mut in_write) = inbound.into_split();
    let (mut out_read, mut out_write) = outbound.into_split();
    let mut gone = cut.clone();
    let up = pipe(&mut in_read, &mut out_write, cut.clone());
    let down = pipe(&mut out_read, &mut in_write, cut);
    tokio::select! {
        r = up => r,
        r = down => r,
        // The proxy was dropped: close the connection.
        () = async { while gone.changed().await.is_ok() {} } => Ok(()),
    }
}

/// Waits until the link is not cut; an error once the proxy is gone.
async fn passable(cut: &mut watch::Receiver<bool>) -> io::Result<()> {
    cut.wait_for(|cut| !cut)
        .await
        .map(drop)
        .map_err(|_| io::Error::other("proxy stopped"))
}

async fn pipe(
    from: &mut (impl AsyncReadExt + Unpin),
    to: &mut (impl AsyncWriteExt + Unpin),
    mut cut: watch::Receiver<bool>,
) -> io::Result<()> {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        passable(&mut cut).await?;
        to.write_all(&buf[..n]).await?;
    }
}
