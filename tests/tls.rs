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
        let mut params = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
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
    _child: tokio::process::Child,
    _dir: tempfile::TempDir,
    endpoint: String,
    ca: Authority,
}

impl TlsEtcd {
    async fn start(client_cert_auth: bool) -> Self {
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
            _child: child,
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
    let options = CacheServerOptions::default().with_upstream_tls(config.tls_options());
    let refusing = CacheServer::new(client.clone(), [etcd.endpoint.clone()], "/served/")
        .with_options(options.clone())
        .bind("127.0.0.1:0".parse().unwrap())
        .await
        .expect("bind");
    refusing
        .ready(Duration::from_secs(20))
        .await
        .expect("ready");
    let tokenless = etcd_informer::connect([refusing.local_addr().to_string()])
        .await
        .unwrap();
    let refused = tokenless
        .kv_client()
        .get("/elsewhere/x", None)
        .await
        .expect_err("a token-less client would act as the server");
    assert!(
        refused.to_string().contains("--trust-clients-as-server"),
        "{refused}"
    );
    refusing.shutdown().await;
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
