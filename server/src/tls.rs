//! TLS on the API listener: `[server.tls]`.
//!
//! Lattice terminates TLS itself (rustls), so that a client's certificate
//! can name it (`[server.auth] mode = "mtls"`). The certificate, its key and
//! the client CA are files — in Kubernetes a mounted Secret, which the
//! kubelet rewrites in place when it rotates. They are re-read every
//! [`RELOAD_EVERY`]: a new connection gets the new certificate, connections
//! already open keep theirs (and their queries run to the end), and files
//! that don't load (a half-written key, a certificate that doesn't match
//! it) keep the previous ones in force and say why in the log.
//!
//! With `client_ca_file` every request must come over a connection whose
//! client certificate that CA signed. The handshake asks for a certificate
//! and checks that the client holds its key, but lets a connection without
//! one (or with one the CA did not sign) through: each request on it then
//! ends with UNAUTHENTICATED and a reason ("expired", "not signed by the
//! client CA") instead of a TLS alert that gRPC clients report as an
//! unreachable server. The health and reflection services answer anyone.

pub use crate::config::TlsSettings;

use std::{
    collections::HashMap,
    fmt, io,
    path::Path,
    sync::{Arc, Mutex, RwLock, Weak},
    time::{Duration, Instant},
};

use rustls::{
    DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig, SignatureScheme,
    client::danger::HandshakeSignatureValid,
    crypto::CryptoProvider,
    pki_types::{CertificateDer, PrivateKeyDer, UnixTime, pem::PemObject},
    server::{
        WebPkiClientVerifier,
        danger::{ClientCertVerified, ClientCertVerifier},
    },
};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, server::TlsStream};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use tracing::{debug, info, warn};

/// How often the certificate files are checked for changes.
pub const RELOAD_EVERY: Duration = crate::reload::EVERY;

/// How long a client has to finish the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a verified client certificate is trusted without checking it
/// again (a certificate that expires is refused at most this late).
const VERIFIED_FOR: Duration = Duration::from_secs(10);

/// The files' contents, as last read.
#[derive(Clone, PartialEq, Eq)]
struct Files {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl Files {
    fn read(settings: &TlsSettings) -> Result<Files, String> {
        let read = |p: &Path| std::fs::read(p).map_err(|e| format!("cannot read {}: {e}", p.display()));
        Ok(Files {
            cert: read(&settings.cert_file)?,
            key: read(&settings.key_file)?,
            client_ca: settings.client_ca_file.as_deref().map(read).transpose()?,
        })
    }
}

/// What one set of files makes: the rustls config new connections get,
/// and the checker of client certificates.
struct Loaded {
    config: Arc<ServerConfig>,
    clients: Option<ClientCheck>,
}

/// The listener's TLS, reloaded when its files change. Shared by the
/// acceptor and the authenticator (which checks client certificates).
pub struct ServerTls {
    settings: TlsSettings,
    current: RwLock<Arc<Loaded>>,
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls").field("settings", &self.settings).finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Loads the files now; the error names the file and what is wrong with
    /// it, never a key.
    pub fn load(settings: &TlsSettings) -> Result<ServerTls, String> {
        let loaded = load(&Files::read(settings)?, settings)?;
        Ok(ServerTls { settings: settings.clone(), current: RwLock::new(Arc::new(loaded)) })
    }

    /// [`ServerTls::load`], then a task that reloads the files when they
    /// change; it ends when the returned value is dropped. Needs a Tokio
    /// runtime.
    pub fn watched(settings: &TlsSettings) -> Result<Arc<ServerTls>, String> {
        let files = Files::read(settings)?;
        let loaded = load(&files, settings)?;
        let tls = Arc::new(ServerTls { settings: settings.clone(), current: RwLock::new(Arc::new(loaded)) });
        tokio::spawn(watch(Arc::downgrade(&tls), files));
        Ok(tls)
    }

    /// Whether clients must present a certificate.
    pub fn mutual(&self) -> bool {
        self.settings.client_ca_file.is_some()
    }

    fn current(&self) -> Arc<Loaded> {
        self.current.read().map(|c| c.clone()).unwrap_or_else(|poisoned| poisoned.into_inner().clone())
    }

    /// The identity in a client's certificate chain (as the connection
    /// presented it): its first URI SAN, else its first DNS SAN. Fails with
    /// UNAUTHENTICATED when there is no certificate, when the client CA did
    /// not sign it, when it has expired or names nobody. `Ok(None)` when
    /// client certificates are not asked for.
    pub fn client_identity(&self, chain: Option<&[CertificateDer<'static>]>) -> Result<Option<Arc<str>>, Status> {
        let current = self.current();
        let Some(check) = &current.clients else { return Ok(None) };
        let Some((end_entity, intermediates)) = chain.and_then(|c| c.split_first()) else {
            return Err(Status::unauthenticated(
                "present a client certificate signed by the client CA (server.tls.client_ca_file)",
            ));
        };
        check.identity(end_entity, intermediates).map(Some).map_err(Status::unauthenticated)
    }

    /// Accepted connections, each with its handshake done (on a task of its
    /// own, within [`HANDSHAKE_TIMEOUT`]) with the certificate current when
    /// it connected. TCP_NODELAY as [`crate::incoming`]. The accept loop
    /// ends when the stream is dropped.
    pub fn incoming(self: &Arc<Self>, listener: TcpListener) -> ReceiverStream<io::Result<TlsStream<TcpStream>>> {
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let tls = self.clone();
        tokio::spawn(async move {
            loop {
                let (tcp, peer) = tokio::select! {
                    _ = tx.closed() => return,
                    accepted = listener.accept() => match accepted {
                        Ok(a) => a,
                        Err(e) => {
                            // Out of file descriptors and the like: wait a
                            // little rather than spin.
                            warn!(error = %e, "accept failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    },
                };
                let _ = tcp.set_nodelay(true);
                let acceptor = TlsAcceptor::from(tls.current().config.clone());
                let tx = tx.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(stream)) => {
                            let _ = tx.send(Ok(stream)).await;
                        }
                        Ok(Err(e)) => debug!(peer = %peer, error = %e, "TLS handshake failed"),
                        Err(_) => debug!(peer = %peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        ReceiverStream::new(rx)
    }
}

/// Follows the files (see [`crate::reload`]): loads them when their bytes
/// change. A set that doesn't load is reported once and retried when the
/// files change again.
async fn watch(tls: Weak<ServerTls>, seen: Files) {
    let read = |tls: &ServerTls| Files::read(&tls.settings);
    let apply = |tls: &ServerTls, files: &Files| match load(files, &tls.settings) {
        Ok(loaded) => {
            *crate::sync::write(&tls.current) = Arc::new(loaded);
            info!(cert_file = %tls.settings.cert_file.display(), "tls: certificate reloaded; new connections use it");
        }
        Err(e) => warn!(error = %e, "tls: certificate not reloaded; the previous one stays in force"),
    };
    // Mid-rotation a file can be missing for a moment.
    let unreadable = |e: &str| debug!(error = %e, "tls: certificate files not readable; keeping the current ones");
    crate::reload::follow(tls, RELOAD_EVERY, seen, read, apply, unreadable).await;
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn load(files: &Files, settings: &TlsSettings) -> Result<Loaded, String> {
    let name = |p: &Path| p.display().to_string();
    let certs = CertificateDer::pem_slice_iter(&files.cert)
        .collect::<Result<Vec<_>, _>>()
        .ok()
        .filter(|c| !c.is_empty())
        .ok_or_else(|| format!("{}: no valid PEM certificate", name(&settings.cert_file)))?;
    let key = PrivateKeyDer::from_pem_slice(&files.key)
        .map_err(|_| format!("{}: no valid PEM private key", name(&settings.key_file)))?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?;
    let (builder, clients) = match (&files.client_ca, &settings.client_ca_file) {
        (Some(pem), Some(path)) => {
            let mut roots = RootCertStore::empty();
            let cas = CertificateDer::pem_slice_iter(pem).collect::<Result<Vec<_>, _>>().unwrap_or_default();
            for ca in cas {
                roots.add(ca).map_err(|e| format!("{}: {e}", name(path)))?;
            }
            if roots.is_empty() {
                return Err(format!("{}: no valid PEM certificate", name(path)));
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .map_err(|e| format!("{}: {e}", name(path)))?;
            let check = ClientCheck { verifier: verifier.clone(), verified: Mutex::new(HashMap::new()) };
            (builder.with_client_cert_verifier(Arc::new(AskForCertificate(verifier))), Some(check))
        }
        _ => (builder.with_no_client_auth(), None),
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(|e| format!("{} and {}: {e}", name(&settings.cert_file), name(&settings.key_file)))?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Loaded { config: Arc::new(config), clients })
}

/// Asks for a client certificate and checks the client holds its key, but
/// leaves the chain to [`ClientCheck`] per request (see the module docs).
#[derive(Debug)]
struct AskForCertificate(Arc<dyn ClientCertVerifier>);

impl ClientCertVerifier for AskForCertificate {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.0.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// Checks client certificate chains against the client CA; remembers the
/// ones it verified for [`VERIFIED_FOR`] (a connection sends its chain with
/// every request).
struct ClientCheck {
    verifier: Arc<dyn ClientCertVerifier>,
    verified: Mutex<HashMap<Vec<u8>, Verified>>,
}

/// A verified certificate's identity, and when it was verified.
type Verified = (Arc<str>, Instant);

/// Certificates remembered at most.
const VERIFIED_MAX: usize = 4096;

impl ClientCheck {
    fn identity(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
    ) -> Result<Arc<str>, String> {
        let now = Instant::now();
        if let Ok(verified) = self.verified.lock()
            && let Some((identity, at)) = verified.get(end_entity.as_ref())
            && now.duration_since(*at) < VERIFIED_FOR
        {
            return Ok(identity.clone());
        }
        self.verifier.verify_client_cert(end_entity, intermediates, UnixTime::now()).map_err(refusal)?;
        let identity: Arc<str> = identity(end_entity)?.into();
        if let Ok(mut verified) = self.verified.lock() {
            if verified.len() >= VERIFIED_MAX {
                verified.clear();
            }
            verified.insert(end_entity.to_vec(), (identity.clone(), now));
        }
        Ok(identity)
    }
}

/// Why a client certificate is refused, in words a client can act on.
fn refusal(e: rustls::Error) -> String {
    use rustls::CertificateError as E;
    match e {
        rustls::Error::InvalidCertificate(E::Expired | E::ExpiredContext { .. }) => {
            "the client certificate has expired".into()
        }
        rustls::Error::InvalidCertificate(E::NotValidYet | E::NotValidYetContext { .. }) => {
            "the client certificate is not valid yet".into()
        }
        rustls::Error::InvalidCertificate(E::UnknownIssuer | E::BadSignature) => {
            "the client certificate is not signed by the client CA (server.tls.client_ca_file)".into()
        }
        other => format!("the client certificate is not valid: {other}"),
    }
}

/// A certificate's identity: its first URI subject alternative name (a
/// SPIFFE ID, from a service mesh), else its first DNS one.
pub fn identity(cert: &CertificateDer<'_>) -> Result<String, String> {
    let parsed = webpki::EndEntityCert::try_from(cert).map_err(|e| format!("the client certificate: {e}"))?;
    let name = parsed.valid_uri_names().next().or_else(|| parsed.valid_dns_names().next());
    name.map(str::to_owned).ok_or_else(|| "the client certificate names no URI or DNS subject alternative name".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_cert(dir: &Path, name: &str) -> (String, String) {
        let cert = rcgen::generate_simple_self_signed(vec![name.to_owned()]).expect("a certificate");
        let (pem, key) = (cert.cert.pem(), cert.signing_key.serialize_pem());
        std::fs::write(dir.join("tls.crt"), &pem).unwrap();
        std::fs::write(dir.join("tls.key"), &key).unwrap();
        (pem, key)
    }

    fn settings(dir: &Path) -> TlsSettings {
        TlsSettings { cert_file: dir.join("tls.crt"), key_file: dir.join("tls.key"), client_ca_file: None }
    }

    /// New files are in force within one reload period; files that don't
    /// load leave the loaded ones in force.
    #[tokio::test(start_paused = true)]
    async fn files_are_reloaded_within_a_period_and_bad_ones_are_not() {
        let dir = std::env::temp_dir().join(format!("lattice-tls-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        write_cert(&dir, "first.test");
        let tls = ServerTls::watched(&settings(&dir)).unwrap();
        let first = tls.current();
        tokio::time::sleep(RELOAD_EVERY * 2).await;
        assert!(Arc::ptr_eq(&first, &tls.current()), "unchanged files are not reloaded");

        write_cert(&dir, "second.test");
        tokio::time::sleep(RELOAD_EVERY + Duration::from_millis(1)).await;
        let second = tls.current();
        assert!(!Arc::ptr_eq(&first, &second), "new files are in force within a period");

        std::fs::write(dir.join("tls.key"), "-----BEGIN PRIVATE KEY-----\nnot base64\n-----END PRIVATE KEY-----\n")
            .unwrap();
        tokio::time::sleep(RELOAD_EVERY * 3).await;
        assert!(Arc::ptr_eq(&second, &tls.current()), "a key that doesn't load keeps the previous one");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_client_certificate_names_its_uri_else_its_dns_san() {
        let dns = rcgen::generate_simple_self_signed(vec!["batch.example".to_owned()]).unwrap();
        assert_eq!(identity(dns.cert.der()).unwrap(), "batch.example");
        let mut params = rcgen::CertificateParams::new(vec!["web.example".to_owned()]).unwrap();
        params
            .subject_alt_names
            .insert(0, rcgen::SanType::URI("spiffe://cluster.local/ns/app/sa/web".try_into().unwrap()));
        let key = rcgen::KeyPair::generate().unwrap();
        let uri = params.self_signed(&key).unwrap();
        assert_eq!(identity(uri.der()).unwrap(), "spiffe://cluster.local/ns/app/sa/web");
    }
}
