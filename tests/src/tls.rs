//! Throwaway certificate authorities for the TLS tests, made fresh for each
//! test and written to a temporary directory (the config names files).

use std::path::PathBuf;

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

/// A certificate and its key, PEM, and where they were written.
pub struct Leaf {
    /// The certificate.
    pub cert_pem: String,
    /// Its private key.
    pub key_pem: String,
    /// The certificate's file.
    pub cert_file: PathBuf,
    /// The key's file.
    pub key_file: PathBuf,
}

/// A CA that issues server and client certificates.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    dir: PathBuf,
    /// The CA certificate, PEM.
    pub pem: String,
    /// Its file.
    pub file: PathBuf,
}

impl TestCa {
    /// A new CA named `name` (an ECDSA P-256 key: it signs with SHA-256).
    pub fn new(name: &str) -> TestCa {
        TestCa::new_with(name, &rcgen::PKCS_ECDSA_P256_SHA256)
    }

    /// A new CA named `name` whose key signs with `algorithm`.
    pub fn new_with(name: &str, algorithm: &'static rcgen::SignatureAlgorithm) -> TestCa {
        let dir = std::env::temp_dir().join(format!("lattice-tls-{name}-{}", crate::canary()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, format!("{name} test CA"));
        let key = KeyPair::generate_for(algorithm).expect("a key");
        let issuer = CertifiedIssuer::self_signed(params, key).expect("a CA");
        let pem = issuer.pem();
        let file = dir.join("ca.pem");
        std::fs::write(&file, &pem).expect("writing the CA");
        TestCa { issuer, dir, pem, file }
    }

    /// A certificate for `name` (a DNS name), signed by this CA; it serves
    /// as a server's or a client's.
    pub fn issue(&self, name: &str) -> Leaf {
        let params = CertificateParams::new(vec![name.to_owned()]).expect("leaf params");
        self.sign(name, params)
    }

    /// A client certificate whose only subject alternative name is `uri`
    /// (a SPIFFE ID), written as `<stem>.pem` / `<stem>.key`.
    pub fn issue_uri(&self, stem: &str, uri: &str) -> Leaf {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("leaf params");
        params.subject_alt_names = vec![rcgen::SanType::URI(uri.try_into().expect("an IA5 URI"))];
        self.sign(stem, params)
    }

    /// A certificate for `name` that expired in 2001.
    pub fn issue_expired(&self, name: &str) -> Leaf {
        let mut params = CertificateParams::new(vec![name.to_owned()]).expect("leaf params");
        params.not_before = rcgen::date_time_ymd(2000, 1, 1);
        params.not_after = rcgen::date_time_ymd(2001, 1, 1);
        self.sign(&format!("{name}-expired"), params)
    }

    /// A client TLS config that trusts this CA and expects the server to be
    /// `localhost`, presenting `client` if given.
    pub fn client_tls(&self, client: Option<&Leaf>) -> tonic::transport::ClientTlsConfig {
        let config = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(&self.pem))
            .domain_name("localhost");
        match client {
            Some(leaf) => config.identity(tonic::transport::Identity::from_pem(&leaf.cert_pem, &leaf.key_pem)),
            None => config,
        }
    }

    fn sign(&self, stem: &str, params: CertificateParams) -> Leaf {
        let name = stem;
        let key = KeyPair::generate().expect("a key");
        let cert = params.signed_by(&key, &self.issuer).expect("a certificate");
        let (cert_pem, key_pem) = (cert.pem(), key.serialize_pem());
        let cert_file = self.dir.join(format!("{name}.pem"));
        let key_file = self.dir.join(format!("{name}.key"));
        std::fs::write(&cert_file, &cert_pem).expect("writing a certificate");
        std::fs::write(&key_file, &key_pem).expect("writing a key");
        Leaf { cert_pem, key_pem, cert_file, key_file }
    }

    /// A server TLS config for `leaf`, requiring client certificates from
    /// this CA when `mutual`.
    pub fn server_config(&self, leaf: &Leaf, mutual: bool) -> tonic::transport::ServerTlsConfig {
        let config = tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(&leaf.cert_pem, &leaf.key_pem));
        if mutual { config.client_ca_root(tonic::transport::Certificate::from_pem(&self.pem)) } else { config }
    }
}

impl Drop for TestCa {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A server that takes TLS at once, as PostgreSQL 17 does for a client's
/// `sslnegotiation=direct` (no SSLRequest first): it completes the
/// handshake as a leaf, refuses a client that did not ask for the ALPN
/// protocol `postgresql` (as PostgreSQL does, against cross-protocol
/// attacks), and passes what it decrypts to a plaintext PostgreSQL.
pub struct DirectTls {
    /// Where it listens.
    pub addr: std::net::SocketAddr,
    served: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    refused: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl DirectTls {
    /// Serves as `leaf` in front of the PostgreSQL at `upstream`.
    pub async fn start(leaf: &Leaf, upstream: std::net::SocketAddr) -> DirectTls {
        use std::sync::{
            Arc,
            atomic::{AtomicUsize, Ordering},
        };

        use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
        let chain: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(leaf.cert_pem.as_bytes()).collect::<Result<_, _>>().expect("a chain");
        let key = PrivateKeyDer::from_pem_slice(leaf.key_pem.as_bytes()).expect("a key");
        let mut config =
            rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .expect("TLS versions")
                .with_no_client_auth()
                .with_single_cert(chain, key)
                .expect("a server config");
        config.alpn_protocols = vec![b"postgresql".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let addr = listener.local_addr().expect("an address");
        let (served, refused): (Arc<AtomicUsize>, Arc<AtomicUsize>) = (Arc::default(), Arc::default());
        let (counts_served, counts_refused) = (Arc::clone(&served), Arc::clone(&refused));
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (acceptor, served, refused) =
                    (acceptor.clone(), Arc::clone(&counts_served), Arc::clone(&counts_refused));
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(stream).await else {
                        refused.fetch_add(1, Ordering::Relaxed);
                        return;
                    };
                    if tls.get_ref().1.alpn_protocol() != Some(b"postgresql".as_slice()) {
                        refused.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    served.fetch_add(1, Ordering::Relaxed);
                    if let Ok(mut database) = tokio::net::TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut tls, &mut database).await;
                    }
                });
            }
        });
        DirectTls { addr, served, refused, task }
    }

    /// The connections it passed on, and those it refused (no ALPN
    /// `postgresql`, or no handshake).
    pub fn counts(&self) -> (usize, usize) {
        use std::sync::atomic::Ordering;
        (self.served.load(Ordering::Relaxed), self.refused.load(Ordering::Relaxed))
    }
}

impl Drop for DirectTls {
    fn drop(&mut self) {
        self.task.abort();
    }
}
