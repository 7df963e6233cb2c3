//! TLS, mutual TLS and a wrong CA against a real etcd started here with certificates this test
//! generates (rcgen), through `ConnectConfig` as users reach a production etcd.
#![cfg(all(feature = "testing", feature = "tls"))]

use std::time::{Duration, Instant};

use etcd_informer::{
    ConnectConfig, ConnectError, EtcdListerWatcher, InformerOptions, SharedIndexInformer, TextCodec,
};
use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};

struct Authority {
    cert: Certificate,
    key: KeyPair,
}

impl Authority {
    fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Authority { cert, key }
    }

    /// A certificate for 127.0.0.1 and its key, as PEM.
    fn issue(&self, usage: ExtendedKeyUsagePurpose) -> (String, String) {
        self.issue_named("etcd-informer test", usage)
    }

    /// A certificate for 127.0.0.1 whose common name is `name` (etcd's user, with
    /// `--client-cert-auth`), and its key, as PEM.
    fn issue_named(&self, name: &str, usage: ExtendedKeyUsagePurpose) -> (String, String) {
        let mut params = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, name);
        params
            .subject_alt_names
            .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn pem(&self) -> String {
        self.cert.pem()
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// An etcd serving clients over TLS only, killed on drop.
struct TlsEtcd {
    #[cfg_attr(not(feature = "server"), allow(dead_code))]
    child: tokio::process::Child,
    _dir: tempfile::TempDir,
    endpoint: String,
    ca: Authority,
}

impl TlsEtcd {
    async fn start(client_cert_auth: bool) -> Self {
        Self::start_with(client_cert_auth, &[]).await
    }

    /// [`Self::start`] with `extra` arguments for etcd.
    async fn start_with(client_cert_auth: bool, extra: &[&str]) -> Self {
        let ca = Authority::new("etcd-informer test CA");
        let (cert, key) = ca.issue(ExtendedKeyUsagePurpose::ServerAuth);
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, pem: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, pem).unwrap();
            path.display().to_string()
        };
        let (cert, key, ca_file) = (
            write("server.pem", &cert),
            write("server-key.pem", &key),
            write("ca.pem", &ca.pem()),
        );
        let (client_port, peer_port) = (free_port(), free_port());
        let endpoint = format!("127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let mut args = vec![
            "--name=tls".to_string(),
            format!("--data-dir={}", dir.path().join("data").display()),
            format!("--listen-client-urls=https://{endpoint}"),
            format!("--advertise-client-urls=https://{endpoint}"),
            format!("--listen-peer-urls={peer}"),
            format!("--initial-advertise-peer-urls={peer}"),
            format!("--initial-cluster=tls={peer}"),
            format!("--cert-file={cert}"),
            format!("--key-file={key}"),
            "--log-level=error".to_string(),
            "--logger=zap".to_string(),
        ];
        if client_cert_auth {
            args.push(format!("--trusted-ca-file={ca_file}"));
            args.push("--client-cert-auth".to_string());
        }
        args.extend(extra.iter().map(|a| a.to_string()));
        // The same etcd as the rest of the suite (ETCD_BIN), so TLS is tested on each version.
        let bin =
            etcd_informer::testing::etcd::find_etcd_binary().unwrap_or_else(|e| panic!("{e}"));
        let child = tokio::process::Command::new(bin)
            .args(&args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("etcd (ETCD_BIN, or the Debian package etcd-server: bash .ci/install-prerequisites)");
        let deadline = Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(&endpoint).await.is_err() {
            assert!(Instant::now() < deadline, "etcd with TLS did not start");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        TlsEtcd {
            child,
            _dir: dir,
            endpoint,
            ca,
        }
    }

    /// A config trusting this etcd's CA, and with a client certificate if `mutual`.
    fn config(&self, mutual: bool) -> ConnectConfig {
        let config = ConnectConfig::new([self.endpoint.clone()]).ca_pem(self.ca.pem());
        if mutual {
            let (cert, key) = self.ca.issue(ExtendedKeyUsagePurpose::ClientAuth);
            config.client_identity(cert, key)
        } else {
            config
        }
    }
}

/// Connects, retrying while etcd finishes starting.
async fn connect(config: &ConnectConfig) -> etcd_client::Client {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match config.connect().await {
            Ok(client) => return client,
            Err(e) => {
                assert!(Instant::now() < deadline, "cannot connect over TLS: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn informer_follows(client: etcd_client::Client) {
    client.kv_client().put("/tls/a", "1", None).await.unwrap();
    let lw = EtcdListerWatcher::new(client.clone(), "/tls/", TextCodec).unwrap();
    let informer = SharedIndexInformer::new(lw, InformerOptions::default());
    tokio::spawn(informer.clone().run());
    tokio::time::timeout(Duration::from_secs(20), informer.wait_for_cache_sync())
        .await
        .expect("synced over TLS");
    let written = client
        .kv_client()
        .put("/tls/b", "2", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    informer
        .wait_for_revision(written, Duration::from_secs(10))
        .await
        .expect("the watch delivers over TLS");
    assert_eq!(informer.lister().get("b").unwrap().value, "2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_tls_informer_syncs_and_watches() {
    let etcd = TlsEtcd::start(false).await;
    informer_follows(connect(&etcd.config(false)).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_needs_the_client_certificate() {
    let etcd = TlsEtcd::start(true).await;
    let client = connect(&etcd.config(true)).await;
    let Err(refused) = etcd.config(false).connect().await else {
        panic!("no client certificate, no connection");
    };
    assert!(matches!(refused, ConnectError::Etcd { .. }), "{refused}");
    assert!(
        refused.to_string().contains(&etcd.endpoint),
        "names the endpoint: {refused}"
    );
    informer_follows(client).await;
}

/// The cache server in front of an etcd with mutual TLS (auth off): its list and watch go over
/// the client given, its forwarded requests over `upstream_tls`. Its clients have no token, so
/// they are served only with `trust_clients_as_server`; by default they are refused.
#[cfg(feature = "server")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_server_in_front_of_mutual_tls() {
    use etcd_informer::serve::{CacheServer, CacheServerOptions};
    let etcd = TlsEtcd::start(true).await;
    let config = etcd.config(true);
    let client = connect(&config).await;
    client
        .kv_client()
        .put("/served/a", "1", None)
        .await
        .unwrap();
    client
        .kv_client()
        .put("/elsewhere/x", "2", None)
        .await
        .unwrap();
    // Issue 54, item 4: with the server's certificate upstream and no client CA of its own, a
    // client with any token would act as the server (etcd with its auth off ignores tokens
    // from 3.4.28 and 3.5.10 on): the server does not start unless told to trust its clients.
    let options = CacheServerOptions::default().with_upstream_tls(config.tls_options());
    let refused = CacheServer::new(client.clone(), [etcd.endpoint.clone()], "/served/")
        .with_options(options.clone())
        .bind("127.0.0.1:0".parse().unwrap())
        .await
        .err()
        .expect("no client CA: the server does not start");
    assert!(
        refused.to_string().contains("--trust-clients-as-server"),
        "{refused}"
    );
    let options = options.with_trust_clients_as_server(true);
    let server = CacheServer::new(client, [etcd.endpoint.clone()], "/served/")
        .with_options(options)
        .bind("127.0.0.1:0".parse().unwrap())
        .await
        .expect("bind");
    server.ready(Duration::from_secs(20)).await.expect("ready");
    let via = etcd_informer::connect([server.local_addr().to_string()])
        .await
        .unwrap();
    // A write and a read outside the prefix are forwarded over TLS; a read inside is cached.
    via.kv_client()
        .put("/served/b", "3", None)
        .await
        .expect("forwarded put");
    let outside = via
        .kv_client()
        .get("/elsewhere/x", None)
        .await
        .expect("forwarded get");
    assert_eq!(outside.kvs()[0].value_str().unwrap(), "2");
    let prefix = Some(etcd_client::GetOptions::new().with_prefix());
    let inside = via
        .kv_client()
        .get("/served/", prefix)
        .await
        .expect("cached get");
    assert_eq!(inside.count(), 2);
    assert!(server.stats().ranges_from_cache >= 1 && server.stats().forwarded >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_ca_is_one_clear_error_at_start() {
    let etcd = TlsEtcd::start(false).await;
    let _ = connect(&etcd.config(false)).await; // etcd is up
    let other = Authority::new("someone else's CA");
    let started = Instant::now();
    let wrong = ConnectConfig::new([etcd.endpoint.clone()]).ca_pem(other.pem());
    let Err(error) = wrong.connect().await else {
        panic!("a certificate from another CA is refused");
    };
    let took = started.elapsed();
    assert!(took < Duration::from_secs(10), "failed fast: {took:?}");
    assert!(
        error.to_string().contains(&etcd.endpoint),
        "names the endpoint: {error}"
    );
}

#[test]
fn environment_is_read_as_etcdctl_reads_it() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Authority::new("env CA");
    let (cert, key) = ca.issue(ExtendedKeyUsagePurpose::ClientAuth);
    let path = |name: &str, pem: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, pem).unwrap();
        p.display().to_string()
    };
    // The only test of this binary that touches these variables.
    std::env::set_var("ETCD_ENDPOINTS", "10.0.0.1:2379, 10.0.0.2:2379");
    std::env::set_var("ETCDCTL_CACERT", path("ca.pem", &ca.pem()));
    std::env::set_var("ETCDCTL_CERT", path("c.pem", &cert));
    std::env::set_var("ETCDCTL_KEY", path("k.pem", &key));
    std::env::set_var("ETCDCTL_USER", "reader:secret");
    let config = ConnectConfig::from_env().unwrap();
    assert_eq!(config.endpoints(), ["10.0.0.1:2379", "10.0.0.2:2379"]);
    let shown = format!("{config:?}");
    assert!(
        shown.contains("reader") && !shown.contains("secret"),
        "{shown}"
    );
    assert!(
        shown.contains("tls: true") && shown.contains("client_certificate: true"),
        "{shown}"
    );
    std::env::set_var("ETCDCTL_KEY", dir.path().join("missing.pem"));
    let error = ConnectConfig::from_env().unwrap_err();
    assert!(error.to_string().contains("missing.pem"), "{error}");
    for var in [
        "ETCD_ENDPOINTS",
        "ETCDCTL_CACERT",
        "ETCDCTL_CERT",
        "ETCDCTL_KEY",
        "ETCDCTL_USER",
    ] {
        std::env::remove_var(var);
    }
}

/// Nobody gets more through the cache server than etcd would give them: etcd with TLS,
/// `--client-cert-auth` and auth on, where a client's certificate is its identity, and a cache
/// server that reaches it with `root`'s certificate.
#[cfg(feature = "server")]
mod access {
    use std::time::{Duration, Instant};

    use etcd_client::{Client, GetOptions, Permission, WatchOptions};
    use etcd_informer::serve::{CacheServer, CacheServerOptions, RunningServer, ServerTls};
    use etcd_informer::ConnectConfig;
    use rcgen::ExtendedKeyUsagePurpose;

    use super::{connect, TlsEtcd};

    /// The secret the server caches, and what `limited` may read.
    const SECRET: &str = "/secret/a";
    const PUBLIC: &str = "/public/p";

    impl TlsEtcd {
        /// A config trusting this etcd's CA with a client certificate for `name`.
        fn config_as(&self, name: &str) -> ConnectConfig {
            let (cert, key) = self
                .ca
                .issue_named(name, ExtendedKeyUsagePurpose::ClientAuth);
            ConnectConfig::new([self.endpoint.clone()])
                .ca_pem(self.ca.pem())
                .client_identity(cert, key)
        }

        /// Stops (SIGSTOP) or resumes (SIGCONT) etcd: a hung upstream.
        fn signal(&self, signal: i32) {
            let pid = self.child.id().expect("etcd runs") as i32;
            // SAFETY: kill(2) on our own child's pid.
            assert_eq!(unsafe { libc::kill(pid, signal) }, 0, "signal {signal}");
        }
    }

    /// etcd with auth on: `root` (password `rootpw`, or a certificate CN=root) may do
    /// anything, `limited` (`limpw`, or CN=limited) may read `/public/` only. Returns it and a
    /// client authenticated by its CN=root certificate alone, as the issue's server is.
    async fn auth_etcd() -> (TlsEtcd, Client) {
        auth_etcd_with(&[]).await
    }

    /// [`auth_etcd`] with `extra` arguments for etcd.
    async fn auth_etcd_with(extra: &[&str]) -> (TlsEtcd, Client) {
        let etcd = TlsEtcd::start_with(true, extra).await;
        let config = etcd.config_as("root");
        let mut root = connect(&config).await;
        root.user_add("root", "rootpw", None).await.unwrap();
        root.user_grant_role("root", "root").await.unwrap();
        root.user_add("limited", "limpw", None).await.unwrap();
        root.role_add("public-reader").await.unwrap();
        root.role_grant_permission("public-reader", Permission::read("/public/").with_prefix())
            .await
            .unwrap();
        root.user_grant_role("limited", "public-reader")
            .await
            .unwrap();
        for (key, value) in [(SECRET, "s3cret"), (PUBLIC, "open"), ("/other/o", "other")] {
            root.put(key, value, None).await.unwrap();
        }
        root.auth_enable().await.unwrap();
        (etcd, root)
    }

    /// A cache server of `/secret/` with `root`'s certificate upstream, by default: TLS with
    /// a client CA (`mutual`), else plain on loopback.
    async fn cache_server(
        etcd: &TlsEtcd,
        root: &Client,
        mutual: bool,
        options: CacheServerOptions,
    ) -> RunningServer {
        let mut options = options.with_upstream_tls(etcd.config_as("root").tls_options());
        if mutual {
            let (cert, key) = etcd.ca.issue(ExtendedKeyUsagePurpose::ServerAuth);
            options = options.with_tls(Some(ServerTls {
                cert_pem: cert.into_bytes(),
                key_pem: key.into_bytes(),
                client_ca_pem: Some(etcd.ca.pem().into_bytes()),
            }));
        }
        let server = CacheServer::new(root.clone(), [etcd.endpoint.clone()], "/secret/")
            .with_options(options)
            .bind("127.0.0.1:0".parse().unwrap())
            .await
            .expect("bind");
        server.ready(Duration::from_secs(20)).await.expect("ready");
        server
    }

    /// What a client got: a summary of the answer, or the gRPC error (a watch's cancel reason
    /// counts as PermissionDenied, as etcd gives it).
    #[derive(Debug, Clone, PartialEq)]
    enum Outcome {
        Answered(String),
        Refused(tonic::Code, String),
    }

    impl Outcome {
        fn of<T>(result: Result<T, etcd_client::Error>, summary: impl FnOnce(T) -> String) -> Self {
            match result {
                Ok(answer) => Outcome::Answered(summary(answer)),
                Err(etcd_client::Error::GRpcStatus(s)) => {
                    Outcome::Refused(s.code(), s.message().to_owned())
                }
                Err(other) => Outcome::Refused(tonic::Code::Unknown, other.to_string()),
            }
        }

        /// The cache server's documented refusal of a token-less request.
        fn is_documented_refusal(&self) -> bool {
            matches!(self, Outcome::Refused(tonic::Code::PermissionDenied, m)
                if m.contains("--trust-clients-as-server"))
        }

        /// The same kind of answer (values equal; errors of the same code).
        fn same_as(&self, other: &Outcome) -> bool {
            match (self, other) {
                (Outcome::Answered(a), Outcome::Answered(b)) => a == b,
                (Outcome::Refused(a, _), Outcome::Refused(b, _)) => a == b,
                _ => false,
            }
        }
    }

    const REQUESTS: [&str; 8] = [
        "cached read",
        "watch",
        "forwarded read (allowed)",
        "forwarded read (not allowed)",
        "put",
        "lease grant",
        "auth disable",
        "snapshot",
    ];

    async fn request(client: &Client, which: &str) -> Outcome {
        let mut c = client.clone();
        let value = |r: etcd_client::GetResponse| match r.kvs().first() {
            Some(kv) => kv.value_str().unwrap_or("?").to_owned(),
            None => "(none)".to_owned(),
        };
        match which {
            "cached read" => Outcome::of(c.get(SECRET, None).await, value),
            "forwarded read (allowed)" => Outcome::of(c.get(PUBLIC, None).await, value),
            "forwarded read (not allowed)" => Outcome::of(c.get("/other/o", None).await, value),
            "put" => Outcome::of(c.put(SECRET, "pwned", None).await, |_| "put".into()),
            "lease grant" => Outcome::of(c.lease_grant(60, None).await, |_| "granted".into()),
            "auth disable" => Outcome::of(c.auth_disable().await, |_| "disabled".into()),
            "snapshot" => match c.snapshot().await {
                Ok(mut stream) => Outcome::of(stream.message().await, |m| {
                    format!("snapshot chunk: {}", m.is_some())
                }),
                Err(e) => Outcome::of(Err::<(), _>(e), |_| String::new()),
            },
            "watch" => {
                let options = Some(WatchOptions::new().with_prefix());
                let mut stream = match c.watch("/secret/", options).await {
                    Ok(stream) => stream,
                    Err(e) => return Outcome::of(Err::<(), _>(e), |_| String::new()),
                };
                let first = tokio::time::timeout(Duration::from_secs(10), stream.message())
                    .await
                    .expect("a watch is answered");
                match first {
                    Ok(Some(r)) if r.canceled() => Outcome::Refused(
                        tonic::Code::PermissionDenied,
                        r.cancel_reason().to_owned(),
                    ),
                    Ok(Some(r)) => Outcome::Answered(format!("created: {}", r.created())),
                    Ok(None) => Outcome::Refused(tonic::Code::Unknown, "stream ended".into()),
                    Err(e) => Outcome::of(Err::<(), _>(e), |_| String::new()),
                }
            }
            other => unreachable!("{other}"),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_client_gets_more_through_the_cache_server_than_from_etcd() {
        let (etcd, root) = auth_etcd().await;
        let mutual = cache_server(&etcd, &root, true, CacheServerOptions::default()).await;
        // No client CA, where anyone reaching the listener would get in: it does not start.
        let open = CacheServer::new(root.clone(), [etcd.endpoint.clone()], "/secret/")
            .with_options(
                CacheServerOptions::default()
                    .with_upstream_tls(etcd.config_as("root").tls_options()),
            )
            .bind("127.0.0.1:0".parse().unwrap())
            .await;
        assert!(
            open.is_err_and(|e| e.to_string().contains("--trust-clients-as-server")),
            "a server with no client CA in front of its certificate starts"
        );
        let a = format!("https://{}", mutual.local_addr());
        let limited = etcd.config_as("limited");
        let with_cert = |endpoint: &str| {
            let (cert, key) = etcd
                .ca
                .issue_named("limited", ExtendedKeyUsagePurpose::ClientAuth);
            ConnectConfig::new([endpoint.to_owned()])
                .ca_pem(etcd.ca.pem())
                .client_identity(cert, key)
        };
        // etcd's answers: `limited` by password token and by certificate alone.
        let direct_token = connect(&limited.clone().user("limited", "limpw")).await;
        let direct_cert = connect(&limited).await;
        let token_clients = [(
            "token client, mutual TLS",
            connect(&with_cert(&a).user("limited", "limpw")).await,
        )];
        let tokenless_clients = [("certificate-only client", connect(&with_cert(&a)).await)];
        let mut table = Vec::new();
        for which in REQUESTS {
            let by_token = request(&direct_token, which).await;
            let by_cert = request(&direct_cert, which).await;
            for (name, client) in &token_clients {
                let via = request(client, which).await;
                table.push(format!(
                    "{which} | {name} | etcd: {by_token:?} | via: {via:?}"
                ));
                assert!(
                    via.same_as(&by_token),
                    "{which}, {name}: etcd answers {by_token:?}, the server {via:?}"
                );
            }
            for (name, client) in &tokenless_clients {
                let via = request(client, which).await;
                table.push(format!(
                    "{which} | {name} | etcd: {by_cert:?} | via: {via:?}"
                ));
                assert!(
                    via.is_documented_refusal(),
                    "{which}, {name}: etcd answers the certificate {by_cert:?}, the server {via:?}"
                );
            }
        }
        for line in &table {
            eprintln!("{line}");
        }
        // Nothing was written through the server, and auth is still on.
        let mut root = root;
        let secret = root.get(SECRET, None).await.unwrap();
        assert_eq!(secret.kvs()[0].value_str().unwrap(), "s3cret");
        assert_eq!(
            request(&direct_cert, "cached read").await,
            Outcome::Refused(
                tonic::Code::PermissionDenied,
                "etcdserver: permission denied".into()
            )
        );
        // The sanity check of the table: root by token gets the secret from the cache.
        let root_via = connect(&with_cert(&a).user("root", "rootpw")).await;
        assert_eq!(
            request(&root_via, "cached read").await,
            Outcome::Answered("s3cret".into())
        );
        assert!(mutual.stats().ranges_from_cache >= 1);
        // The issue's reproduction, with etcdctl and the CN=limited certificate: refused, and
        // told why, where it used to print the secret and then overwrite it.
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, pem: String| {
            let path = dir.path().join(name);
            std::fs::write(&path, pem).unwrap();
            path.display().to_string()
        };
        let (cert, key) = etcd
            .ca
            .issue_named("limited", ExtendedKeyUsagePurpose::ClientAuth);
        let tls = [
            format!("--cacert={}", file("ca.pem", etcd.ca.pem())),
            format!("--cert={}", file("limited.pem", cert)),
            format!("--key={}", file("limited-key.pem", key)),
        ];
        for args in [vec!["get", SECRET], vec!["put", SECRET, "pwned"]] {
            let printed = etcdctl(&a, &tls, &args).await;
            assert!(
                !printed.status.success() && !printed.stdout.contains("s3cret"),
                "etcdctl {args:?}: {printed:?}"
            );
            assert!(
                printed.stderr.contains("--trust-clients-as-server"),
                "etcdctl {args:?}: {printed:?}"
            );
        }
        assert_eq!(
            root.get(SECRET, None).await.unwrap().kvs()[0]
                .value_str()
                .unwrap(),
            "s3cret"
        );
        // What the opt-in gives away: the same certificate then reads as the server, root.
        let trusting = cache_server(
            &etcd,
            &root,
            true,
            CacheServerOptions::default().with_trust_clients_as_server(true),
        )
        .await;
        let trusted = connect(&with_cert(&format!("https://{}", trusting.local_addr()))).await;
        assert_eq!(
            request(&trusted, "cached read").await,
            Outcome::Answered("s3cret".into())
        );
    }

    /// What etcdctl printed.
    #[derive(Debug)]
    struct Printed {
        status: std::process::ExitStatus,
        stdout: String,
        stderr: String,
    }

    /// Runs the etcdctl beside `ETCD_BIN` (else on `PATH`) against `endpoint`.
    async fn etcdctl(endpoint: &str, tls: &[String], args: &[&str]) -> Printed {
        let bin = std::env::var_os("ETCD_BIN")
            .map(|bin| std::path::PathBuf::from(bin).with_file_name("etcdctl"))
            .filter(|beside| beside.is_file())
            .unwrap_or_else(|| "etcdctl".into());
        let mut command = tokio::process::Command::new(bin);
        for var in [
            "ETCDCTL_ENDPOINTS",
            "ETCDCTL_USER",
            "ETCDCTL_CACERT",
            "ETCDCTL_CERT",
            "ETCDCTL_KEY",
        ] {
            command.env_remove(var);
        }
        let output = command
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={endpoint}"))
            .args(tls)
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .await
            .expect("etcdctl (the Debian package etcd-client, or beside ETCD_BIN)");
        Printed {
            status: output.status,
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        }
    }

    /// Reads the secret through `via` until it is refused; returns the refusal and when it
    /// came, failing past `within`.
    async fn read_until_refused(via: &Client, within: Duration) -> (Outcome, Duration) {
        let started = Instant::now();
        loop {
            let mut c = via.clone();
            let read = c
                .get(SECRET, Some(GetOptions::new().with_serializable()))
                .await;
            let outcome = Outcome::of(read, |r| format!("{} keys", r.kvs().len()));
            if let Outcome::Refused(..) = outcome {
                return (outcome, started.elapsed());
            }
            assert!(
                started.elapsed() < within,
                "still answered {outcome:?} after {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_revoked_role_stops_reads_within_the_bound_also_while_etcd_hangs() {
        let (etcd, mut root) = auth_etcd().await;
        root.role_add("secret-reader").await.unwrap();
        root.role_grant_permission("secret-reader", Permission::read("/secret/").with_prefix())
            .await
            .unwrap();
        let server = cache_server(&etcd, &root, true, CacheServerOptions::default()).await;
        let (cert, key) = etcd
            .ca
            .issue_named("limited", ExtendedKeyUsagePurpose::ClientAuth);
        let via = connect(
            &ConnectConfig::new([format!("https://{}", server.local_addr())])
                .ca_pem(etcd.ca.pem())
                .client_identity(cert, key)
                .user("limited", "limpw"),
        )
        .await;
        let direct = connect(&etcd.config_as("limited").user("limited", "limpw")).await;
        // The documented bound (CacheServerOptions::access_ttl), plus the time a read takes.
        let bound = Duration::from_secs(5);
        let slack = Duration::from_millis(1500);
        for hang in [false, true] {
            root.user_grant_role("limited", "secret-reader")
                .await
                .unwrap();
            // Granted: the server learns of it within the bound (a refusal is kept as long).
            let started = Instant::now();
            loop {
                let read = request(&via, "cached read").await;
                if read == Outcome::Answered("s3cret".into()) {
                    break;
                }
                assert!(started.elapsed() < bound + slack, "never granted: {read:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            root.user_revoke_role("limited", "secret-reader")
                .await
                .unwrap();
            if hang {
                // etcd hangs right after the revocation: nothing can tell the server of it.
                etcd.signal(libc::SIGSTOP);
            } else {
                let at_etcd = request(&direct, "cached read").await;
                assert!(
                    matches!(at_etcd, Outcome::Refused(tonic::Code::PermissionDenied, _)),
                    "etcd refuses at once: {at_etcd:?}"
                );
            }
            // While etcd hangs, the first read past the bound waits for the access check's
            // own timeout (1 s) before it is refused.
            let within = if hang {
                bound + Duration::from_secs(1) + slack
            } else {
                bound + slack
            };
            let (refused, after) = read_until_refused(&via, within).await;
            eprintln!("revoked (etcd hung: {hang}): refused after {after:?}: {refused:?}");
            let code = if hang {
                tonic::Code::Unavailable
            } else {
                tonic::Code::PermissionDenied
            };
            assert!(
                matches!(&refused, Outcome::Refused(c, _) if *c == code),
                "{refused:?}"
            );
            // And it stays refused: an expired answer is not used again.
            let again = request(&via, "cached read").await;
            assert!(
                matches!(&again, Outcome::Refused(c, _) if *c == code),
                "{again:?}"
            );
            if hang {
                etcd.signal(libc::SIGCONT);
            }
        }
    }

    /// A watch that falls out of the history after its client's token expired goes on, as on
    /// etcd, which checks a watch once: the server forwards the rest of it as its own
    /// certificate's user (CN=root), with no token, not as its client's expired token.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_watch_moved_out_of_the_history_runs_as_the_servers_certificate() {
        let (etcd, root) = auth_etcd_with(&["--auth-token-ttl=1"]).await;
        let mut auth = root.auth_client();
        auth.role_add("secret-reader").await.unwrap();
        auth.role_grant_permission("secret-reader", Permission::read("/secret/").with_prefix())
            .await
            .unwrap();
        auth.user_add("reader", "readerpw", None).await.unwrap();
        auth.user_grant_role("reader", "secret-reader")
            .await
            .unwrap();
        // On loopback, with no client CA: trusted by the test's choice.
        let options = CacheServerOptions::default()
            .with_history_bytes(256 << 10)
            .with_trust_clients_as_server(true);
        let server = cache_server(&etcd, &root, false, options).await;
        let reader = Client::connect(
            [server.local_addr().to_string()],
            Some(etcd_client::ConnectOptions::new().with_user("reader", "readerpw")),
        )
        .await
        .expect("reader through the server");
        let (_requests, mut responses) = reader
            .watch_client()
            .max_decoding_message_size(64 << 20)
            .watch("/secret/", Some(WatchOptions::new().with_prefix()))
            .await
            .expect("watch")
            .split();
        async fn next(
            responses: &mut etcd_client::WatchResponseStream,
        ) -> etcd_client::WatchResponse {
            tokio::time::timeout(Duration::from_secs(20), responses.message())
                .await
                .expect("an answer")
                .expect("the stream")
                .expect("open")
        }
        assert!(next(&mut responses).await.created());
        // The reader's token expires unused (TTL 1 s): a new request with it is refused.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let refused = format!("{:?}", reader.kv_client().get("/secret/a", None).await);
        assert!(
            refused.contains("invalid auth token"),
            "the test needs an expired token: {refused}"
        );
        // Then 12.8 MB, unread: the watch falls out of the 256 KiB of history (see the same
        // test in serve).
        let value = "x".repeat(64 * 1024);
        let mut written = Vec::new();
        let mut kv = root.kv_client();
        for i in 0..200 {
            let put = kv.put(format!("/secret/k{}", i % 10), value.as_str(), None);
            written.push(put.await.unwrap().header().unwrap().revision());
        }
        let last = *written.last().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while server.stats().revision < last {
            assert!(Instant::now() < deadline, "the cache reaches {last}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut delivered = Vec::new();
        while delivered.len() < written.len() {
            let r = next(&mut responses).await;
            assert!(!r.canceled(), "cancelled: {r:?}");
            delivered.extend(
                r.events()
                    .iter()
                    .filter_map(|e| e.kv().map(|kv| kv.mod_revision())),
            );
        }
        assert!(
            server.stats().slow_watches_forwarded > 0,
            "it fell out of the history"
        );
        assert_eq!(delivered, written, "every revision once, in order");
    }
}
