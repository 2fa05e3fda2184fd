//! The TLS side of the store's connections (rustls): the client config
//! built for each new connection from `sslrootcert`, `sslcert` and
//! `sslkey` as the files are now (rotation needs no restart), the server
//! certificate checked as `sslmode` says, and the stream, which offers
//! channel binding (see `binding`).

use std::{
    io,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use futures_util::future::BoxFuture;
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
    client::{
        WebPkiServerVerifier,
        danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    },
    crypto::CryptoProvider,
    pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime, pem::PemObject},
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::{
    Socket,
    tls::{ChannelBinding, MakeTlsConnect, TlsConnect},
};

use super::{
    binding::server_end_point,
    url::{RootCert, TlsParams, Verification},
};

/// A TLS setting that could not be used (a file unreadable or not PEM).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(super) struct TlsSetupError(pub(super) String);

/// The rustls side of tokio-postgres, its config built for each new
/// connection from the files as they are now.
#[derive(Debug, Clone)]
pub(super) struct Rustls {
    pub(super) params: TlsParams,
}

fn read(what: &str, path: &std::path::Path) -> Result<Vec<u8>, TlsSetupError> {
    std::fs::read(path).map_err(|e| TlsSetupError(format!("cannot read {what} {}: {e}", path.display())))
}

impl Rustls {
    fn config(&self) -> Result<ClientConfig, TlsSetupError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let roots = match &self.params.root {
            None => None,
            Some(RootCert::System) => {
                let mut roots = RootCertStore::empty();
                let (added, _) = roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
                if added == 0 {
                    return Err(TlsSetupError("sslrootcert=system: the system has no CA certificates".into()));
                }
                Some(roots)
            }
            Some(RootCert::File(path)) => {
                let pem = read("sslrootcert", path)?;
                let mut roots = RootCertStore::empty();
                for cert in CertificateDer::pem_slice_iter(&pem).flatten() {
                    roots.add(cert).map_err(|e| TlsSetupError(format!("sslrootcert {}: {e}", path.display())))?;
                }
                if roots.is_empty() {
                    return Err(TlsSetupError(format!("sslrootcert {}: no PEM certificate in it", path.display())));
                }
                Some(roots)
            }
        };
        let verifier: Arc<dyn ServerCertVerifier> = match (self.params.verification(), roots) {
            (Verification::None, _) | (_, None) => Arc::new(AnyCertificate(provider.clone())),
            (verification, Some(roots)) => {
                let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                    .build()
                    .map_err(|e| TlsSetupError(format!("sslrootcert: {e}")))?;
                Arc::new(Signed { webpki, check_name: verification == Verification::Full })
            }
        };
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsSetupError(format!("TLS: {e}")))?
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        let mut config = match &self.params.client {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain: Vec<CertificateDer<'static>> =
                    CertificateDer::pem_slice_iter(&read("sslcert", cert)?).flatten().collect();
                if chain.is_empty() {
                    return Err(TlsSetupError(format!("sslcert {}: no PEM certificate in it", cert.display())));
                }
                let key_der = PrivateKeyDer::from_pem_slice(&read("sslkey", key)?)
                    .map_err(|_| TlsSetupError(format!("sslkey {}: no PEM private key in it", key.display())))?;
                builder
                    .with_client_auth_cert(chain, key_der)
                    .map_err(|e| TlsSetupError(format!("sslcert and sslkey: {e}")))?
            }
        };
        // As libpq does: PostgreSQL 17 requires it of a client that starts
        // with TLS (`sslnegotiation=direct`), and earlier servers ignore it.
        config.alpn_protocols = vec![b"postgresql".to_vec()];
        Ok(config)
    }
}

impl MakeTlsConnect<Socket> for Rustls {
    type Stream = TlsStream;
    type TlsConnect = RustlsConnect;
    type Error = TlsSetupError;

    fn make_tls_connect(&mut self, host: &str) -> Result<RustlsConnect, TlsSetupError> {
        let name = ServerName::try_from(host.to_owned())
            .map_err(|_| TlsSetupError("the host is not a name or address TLS can check".into()))?;
        // Its reason is the connection's error, which whoever asked for the
        // connection logs (once, for what recurs).
        let config = self.config()?;
        Ok(RustlsConnect { name, connector: tokio_rustls::TlsConnector::from(Arc::new(config)) })
    }
}

/// One handshake.
pub struct RustlsConnect {
    name: ServerName<'static>,
    connector: tokio_rustls::TlsConnector,
}

impl TlsConnect<Socket> for RustlsConnect {
    type Stream = TlsStream;
    type Error = io::Error;
    type Future = BoxFuture<'static, io::Result<TlsStream>>;

    fn connect(self, stream: Socket) -> Self::Future {
        Box::pin(async move { self.connector.connect(self.name, stream).await.map(TlsStream) })
    }
}

/// A TLS connection to the server. It offers channel binding
/// (SCRAM-SHA-256-PLUS, `tls-server-end-point`): a password then proves
/// that the server holding it is the one at the other end of this TLS
/// connection, which with `sslmode=require` (no certificate checked) is
/// what stops a man in the middle. libpq's `channel_binding` (`prefer`,
/// the default; `require`; `disable`) says whether it is used.
pub struct TlsStream(tokio_rustls::client::TlsStream<Socket>);

impl tokio_postgres::tls::TlsStream for TlsStream {
    fn channel_binding(&self) -> ChannelBinding {
        let (_, session) = self.0.get_ref();
        let certificate = session.peer_certificates().and_then(<[_]>::first);
        certificate
            .and_then(|c| server_end_point(c.as_ref()))
            .map_or_else(ChannelBinding::none, ChannelBinding::tls_server_end_point)
    }
}

impl AsyncRead for TlsStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// `sslmode` prefer, allow, and require without `sslrootcert`: libpq
/// encrypts but does not authenticate the server. The handshake's
/// signatures are still checked (the key exchange is the certificate's).
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca` (and `require` with `sslrootcert`): signed by a root, the
/// name not checked; `verify-full`: the name too (a DNS name or an IP
/// address in the certificate's SANs).
#[derive(Debug)]
struct Signed {
    webpki: Arc<WebPkiServerVerifier>,
    check_name: bool,
}

impl ServerCertVerifier for Signed {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.webpki.verify_server_cert(end_entity, intermediates, name, ocsp, now) {
            // The chain is checked before the name: a name error means the
            // certificate is signed by a root.
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !self.check_name => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}
