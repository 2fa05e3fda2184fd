//! TLS to a tool or hook service, with certificates that follow their files.
//!
//! Each connection is made by [`Connect`] with the rustls config current at
//! that moment. When the config names files (`tls = { ca_file, cert_file,
//! key_file }`), they are re-read every [`RELOAD_EVERY`]: a rotated client
//! certificate or CA (a Kubernetes Secret rewritten in place) is used by the
//! next connection, connections already open keep theirs, and files that
//! don't load keep the previous ones in force and say why in the log.

pub use crate::config::TlsFiles;

use std::{
    path::PathBuf,
    sync::{Arc, RwLock, Weak},
    time::Duration,
};

use rustls::{
    ClientConfig, RootCertStore,
    pki_types::{CertificateDer, PrivateKeyDer, ServerName, pem::PemObject},
};
use tokio::net::TcpStream;
use tokio_rustls::{TlsConnector, client::TlsStream};
use tracing::{debug, info, warn};

use super::Tls;

/// How often the certificate files are checked for changes.
pub const RELOAD_EVERY: Duration = crate::reload::EVERY;

/// The PEM texts of one load.
#[derive(Clone, PartialEq, Eq)]
struct Pems {
    ca: Option<Vec<u8>>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl Pems {
    fn of(tls: &Tls) -> Pems {
        Pems {
            ca: tls.ca_pem.as_ref().map(|p| p.as_bytes().to_vec()),
            identity: tls.identity.as_ref().map(|(c, k)| (c.as_bytes().to_vec(), k.as_bytes().to_vec())),
        }
    }

    fn read(files: &TlsFiles) -> Result<Pems, String> {
        let read = |p: &PathBuf| std::fs::read(p).map_err(|e| format!("cannot read {}: {e}", p.display()));
        let identity = match (&files.cert, &files.key) {
            (Some(c), Some(k)) => Some((read(c)?, read(k)?)),
            _ => None,
        };
        Ok(Pems { ca: files.ca.as_ref().map(read).transpose()?, identity })
    }
}

/// A rustls client config, as current, and the name to verify.
pub(crate) struct ClientTls {
    current: RwLock<Arc<ClientConfig>>,
    /// The name the service's certificate must carry (`server_name`), when
    /// it is not the connected host's.
    server_name: Option<String>,
    files: Option<TlsFiles>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls").field("server_name", &self.server_name).field("files", &self.files).finish()
    }
}

impl ClientTls {
    /// The config of `tls`; the error says which part doesn't load.
    pub(crate) fn new(tls: &Tls) -> Result<Arc<ClientTls>, String> {
        let config = build(&Pems::of(tls))?;
        Ok(Arc::new(ClientTls {
            current: RwLock::new(Arc::new(config)),
            server_name: tls.server_name.clone(),
            files: tls.files.clone(),
        }))
    }

    /// Starts re-reading the files, if the setting came from files; the
    /// task ends when `self` is dropped. Needs a Tokio runtime.
    pub(crate) fn watch(self: &Arc<Self>, tls: &Tls) {
        if let Some(files) = &self.files {
            tokio::spawn(watch(Arc::downgrade(self), files.clone(), Pems::of(tls)));
        }
    }

    fn config(&self) -> Arc<ClientConfig> {
        crate::sync::read(&self.current).clone()
    }

    /// The connector of connections to `host` (an address or a name).
    pub(crate) fn connector(self: &Arc<Self>, host: &str) -> Result<Connect, String> {
        let name = self.server_name.as_deref().unwrap_or(host.trim_start_matches('[').trim_end_matches(']'));
        let name = ServerName::try_from(name.to_owned()).map_err(|_| format!("{name:?} is not a valid TLS name"))?;
        Ok(Connect { tls: self.clone(), name })
    }
}

/// Follows the files (see [`crate::reload`]): rebuilds the config when
/// their bytes change; a set that doesn't build is reported once and
/// retried when they change again.
async fn watch(tls: Weak<ClientTls>, files: TlsFiles, seen: Pems) {
    let read = |_: &ClientTls| Pems::read(&files);
    let apply = |tls: &ClientTls, pems: &Pems| match build(pems) {
        Ok(config) => {
            *crate::sync::write(&tls.current) = Arc::new(config);
            info!(files = %files, "peer tls: certificates reloaded; new connections use them");
        }
        Err(e) => {
            warn!(files = %files, error = %e, "peer tls: certificates not reloaded; the previous ones stay in force")
        }
    };
    let unreadable = |e: &str| debug!(error = %e, "peer tls: files not readable; keeping the current ones");
    crate::reload::follow(tls, RELOAD_EVERY, seen, read, apply, unreadable).await;
}

fn build(pems: &Pems) -> Result<ClientConfig, String> {
    let roots = match &pems.ca {
        Some(pem) => {
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(pem) {
                let cert = cert.map_err(|_| "the CA file holds no valid PEM certificate".to_owned())?;
                roots.add(cert).map_err(|e| format!("the CA file: {e}"))?;
            }
            if roots.is_empty() {
                return Err("the CA file holds no valid PEM certificate".into());
            }
            roots
        }
        None => {
            let mut roots = RootCertStore::empty();
            let native = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(native.certs);
            if added == 0 {
                // Every handshake will fail with an unknown issuer, which
                // the query's error says; set ca_file.
                warn!("peer tls: no ca_file is set and the system has no CA certificates");
            }
            roots
        }
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .with_root_certificates(roots);
    let mut config = match &pems.identity {
        Some((cert, key)) => {
            let chain = CertificateDer::pem_slice_iter(cert)
                .collect::<Result<Vec<_>, _>>()
                .ok()
                .filter(|c| !c.is_empty())
                .ok_or_else(|| "the certificate file holds no valid PEM certificate".to_owned())?;
            let key = PrivateKeyDer::from_pem_slice(key)
                .map_err(|_| "the key file holds no valid PEM private key".to_owned())?;
            builder.with_client_auth_cert(chain, key).map_err(|e| format!("the client certificate and key: {e}"))?
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// The TLS handshake of each new connection to one service, with the
/// config current at that moment.
#[derive(Debug, Clone)]
pub(crate) struct Connect {
    tls: Arc<ClientTls>,
    name: ServerName<'static>,
}

/// Why a TLS connection was not made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectFailed {
    /// The handshake (an untrusted or misnamed certificate, a refused
    /// client certificate).
    #[error("TLS handshake: {0}")]
    Handshake(std::io::Error),
    /// The service did not choose HTTP/2 in the handshake (ALPN).
    #[error("the service did not agree to HTTP/2 over TLS (ALPN h2)")]
    NotHttp2,
}

impl Connect {
    /// TLS over `tcp`; the service must choose HTTP/2.
    pub(crate) async fn handshake(&self, tcp: TcpStream) -> Result<TlsStream<TcpStream>, ConnectFailed> {
        let connector = TlsConnector::from(self.tls.config());
        let stream = connector.connect(self.name.clone(), tcp).await.map_err(ConnectFailed::Handshake)?;
        if stream.get_ref().1.alpn_protocol() != Some(b"h2") {
            return Err(ConnectFailed::NotHttp2);
        }
        Ok(stream)
    }
}
