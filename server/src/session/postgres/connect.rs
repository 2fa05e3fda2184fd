//! New connections to PostgreSQL, as the pool asks for them: TLS (rustls)
//! as the connection string's `sslmode` says, the certificate files re-read
//! for each connection (rotation needs no restart), and, when one fails,
//! the reason in words an operator can act on, never the connection string.

use std::{
    io,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use deadpool_postgres::Connect;
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
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    task::JoinHandle,
};
use tokio_postgres::{
    Client, Config, NoTls, Socket,
    config::{Host, LoadBalanceHosts, SslMode as PgSslMode},
    tls::{ChannelBinding, MakeTlsConnect, TlsConnect},
};
use tracing::warn;

use super::url::{RootCert, SslMode, TlsParams, Verification};

/// Makes the pool's connections.
#[derive(Debug, Clone)]
pub struct Connector {
    tls: TlsParams,
    /// Told each time a connection is made (shared by every clone).
    made: Arc<tokio::sync::Notify>,
    /// Why each listed host failed, once said (while it stays so).
    hosts_failed: Arc<std::sync::Mutex<Option<String>>>,
    /// The file the connection string is read from again for each new
    /// connection (`[sessions] url_file`), if any.
    reread: Option<Arc<Reread>>,
}

/// A connection string read again for each new connection: a rotated
/// password (or host, or TLS file) reaches new connections without a
/// restart.
#[derive(Debug)]
struct Reread {
    path: std::path::PathBuf,
    timeout: Duration,
    /// The last string that parsed, as connections use it.
    last: std::sync::Mutex<Option<(Config, TlsParams)>>,
    /// Why the file could not be used, once said (while it stays so).
    said: std::sync::Mutex<Option<String>>,
}

impl Connector {
    /// Connections with `tls`.
    pub fn new(tls: TlsParams) -> Self {
        Self { tls, made: Arc::default(), hosts_failed: Arc::default(), reread: None }
    }

    /// Connections as the file `path` says when each is made (see
    /// [`prepared`] for `timeout`).
    pub fn reread(mut self, path: std::path::PathBuf, timeout: Duration) -> Self {
        let reread = Reread { path, timeout, last: Default::default(), said: Default::default() };
        self.reread = Some(Arc::new(reread));
        self
    }

    /// The settings a new connection uses: the file's, read now, when the
    /// string is read again and it can be used; else the last that could
    /// (or `given`, as read at start-up), and the log says why once.
    fn current(&self, given: &Config) -> (Config, TlsParams) {
        let Some(reread) = &self.reread else { return (given.clone(), self.tls.clone()) };
        let read = std::fs::read_to_string(&reread.path)
            .map_err(|e| format!("cannot read it: {}", e.kind()))
            .and_then(|text| super::url::parse(&text));
        let mut last = crate::sync::lock(&reread.last);
        let mut said = crate::sync::lock(&reread.said);
        match read {
            Ok(target) => {
                let now = (prepared(target.config, reread.timeout), target.tls);
                *last = Some(now.clone());
                *said = None;
                now
            }
            Err(why) => {
                if said.as_deref() != Some(why.as_str()) {
                    let file = reread.path.display().to_string();
                    warn!(
                        file,
                        reason = why.as_str(),
                        "session store: the connection string's file cannot be used; new connections use the last one that could"
                    );
                    *said = Some(why);
                }
                last.clone().unwrap_or_else(|| (given.clone(), self.tls.clone()))
            }
        }
    }

    /// A connection to the first of the string's hosts that takes one,
    /// tried in order one at a time as libpq does: each with the whole of
    /// `sslmode` (`allow` tries plaintext, then TLS, on a host before the
    /// next) and `target_session_attrs`. When none does, the log says why
    /// for each host (by its place in the list, never its name), once
    /// while the reasons stay the same; the error is the last host's.
    /// With `load_balance_hosts=random`, tokio-postgres picks the order
    /// and says only the last host's reason.
    async fn connect_in_turn(
        &self,
        pg: &Config,
        tls: &TlsParams,
    ) -> Result<(Client, JoinHandle<()>), tokio_postgres::Error> {
        let n = pg.get_hosts().len().max(pg.get_hostaddrs().len());
        if n <= 1 || pg.get_load_balance_hosts() == LoadBalanceHosts::Random {
            return Self::connect_as_sslmode(pg, tls).await;
        }
        let mut reasons = Vec::new();
        for i in 0..n - 1 {
            match Self::connect_as_sslmode(&one_host(pg, i), tls).await {
                Ok(made) => return Ok(self.hosts_answered(made)),
                Err(e) => reasons.push(format!("host {} of {n}: {}", i + 1, reason(&e))),
            }
        }
        let e = match Self::connect_as_sslmode(&one_host(pg, n - 1), tls).await {
            Ok(made) => return Ok(self.hosts_answered(made)),
            Err(e) => e,
        };
        reasons.push(format!("host {n} of {n}: {}", reason(&e)));
        let reasons = reasons.join("; ");
        let mut said = crate::sync::lock(&self.hosts_failed);
        if said.as_deref() != Some(reasons.as_str()) {
            warn!(reasons, "session store: no host in the connection string could be used");
            *said = Some(reasons);
        }
        Err(e)
    }

    fn hosts_answered<T>(&self, made: T) -> T {
        *crate::sync::lock(&self.hosts_failed) = None;
        made
    }

    /// Resolves when a connection is next made: the database, if it was
    /// away, is back. (Registered when called, before it is polled.)
    pub fn made(&self) -> tokio::sync::futures::Notified<'_> {
        self.made.notified()
    }

    /// A connection as the string's `sslmode` says.
    async fn connect_as_sslmode(
        pg: &Config,
        params: &TlsParams,
    ) -> Result<(Client, JoinHandle<()>), tokio_postgres::Error> {
        let tls = Rustls { params: params.clone() };
        match params.mode {
            SslMode::Disable => Self::connect_with(pg, PgSslMode::Disable, NoTls).await,
            // Plaintext first; TLS when the server refuses plaintext.
            SslMode::Allow => match Self::connect_with(pg, PgSslMode::Disable, NoTls).await {
                Err(e) if refuses_plaintext(&e) => Self::connect_with(pg, PgSslMode::Require, tls).await,
                other => other,
            },
            SslMode::Prefer => Self::connect_with(pg, PgSslMode::Prefer, tls).await,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                Self::connect_with(pg, PgSslMode::Require, tls).await
            }
        }
    }

    async fn connect_with<T>(
        pg: &Config,
        mode: PgSslMode,
        tls: T,
    ) -> Result<(Client, JoinHandle<()>), tokio_postgres::Error>
    where
        T: MakeTlsConnect<Socket> + Send,
        T::Stream: Send + 'static,
        T::TlsConnect: Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        let mut pg = pg.clone();
        pg.ssl_mode(mode);
        let (client, connection) = pg.connect(tls).await?;
        // How a connection ended is for the next statement on it to say;
        // its error's text is the server's, so it is not logged here.
        let task = tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok((client, task))
    }
}

impl Connect for Connector {
    fn connect(&self, pg: &Config) -> BoxFuture<'_, Result<(Client, JoinHandle<()>), tokio_postgres::Error>> {
        let (pg, tls) = self.current(pg);
        Box::pin(async move {
            let made = self.connect_in_turn(&pg, &tls).await;
            if made.is_ok() {
                self.made.notify_waiters();
            }
            made
        })
    }
}

/// The connection string's settings as the store uses them: a connection
/// made within `timeout` (the string's `connect_timeout` if shorter),
/// named `lattice`, and a server that vanished without a reset (a
/// failover's old primary, a cut network) noticed by the kernel, not only
/// by the store's timers: unanswered keepalives, and data left
/// unacknowledged for `timeout`, close the connection. (The string's own
/// settings win.)
pub(super) fn prepared(mut pg: Config, timeout: Duration) -> Config {
    pg.connect_timeout(pg.get_connect_timeout().copied().unwrap_or(timeout).min(timeout));
    pg.application_name("lattice");
    pg.keepalives(true);
    if pg.get_keepalives_idle() == Duration::from_secs(2 * 60 * 60) {
        pg.keepalives_idle(Duration::from_secs(10));
    }
    if pg.get_keepalives_interval().is_none() {
        pg.keepalives_interval(Duration::from_secs(5));
    }
    if pg.get_keepalives_retries().is_none() {
        pg.keepalives_retries(3);
    }
    if pg.get_tcp_user_timeout().is_none() {
        pg.tcp_user_timeout(timeout);
    }
    pg
}

/// `pg` narrowed to its host `i` (with its `hostaddr`, and its port, or
/// the one port all share), every other setting as it was.
fn one_host(pg: &Config, i: usize) -> Config {
    let mut one = Config::new();
    if let Some(user) = pg.get_user() {
        one.user(user);
    }
    if let Some(password) = pg.get_password() {
        one.password(password);
    }
    if let Some(dbname) = pg.get_dbname() {
        one.dbname(dbname);
    }
    if let Some(options) = pg.get_options() {
        one.options(options);
    }
    if let Some(name) = pg.get_application_name() {
        one.application_name(name);
    }
    match pg.get_hosts().get(i) {
        Some(Host::Tcp(host)) => {
            one.host(host);
        }
        Some(Host::Unix(path)) => {
            one.host_path(path);
        }
        None => {}
    }
    if let Some(addr) = pg.get_hostaddrs().get(i) {
        one.hostaddr(*addr);
    }
    let ports = pg.get_ports();
    if let Some(port) = if ports.len() == 1 { ports.first() } else { ports.get(i) } {
        one.port(*port);
    }
    if let Some(timeout) = pg.get_connect_timeout() {
        one.connect_timeout(*timeout);
    }
    if let Some(timeout) = pg.get_tcp_user_timeout() {
        one.tcp_user_timeout(*timeout);
    }
    one.keepalives(pg.get_keepalives()).keepalives_idle(pg.get_keepalives_idle());
    if let Some(interval) = pg.get_keepalives_interval() {
        one.keepalives_interval(interval);
    }
    if let Some(retries) = pg.get_keepalives_retries() {
        one.keepalives_retries(retries);
    }
    one.ssl_mode(pg.get_ssl_mode())
        .ssl_negotiation(pg.get_ssl_negotiation())
        .target_session_attrs(pg.get_target_session_attrs())
        .channel_binding(pg.get_channel_binding())
        .load_balance_hosts(pg.get_load_balance_hosts());
    one
}

/// Whether the server refused a plaintext connection for want of TLS
/// (its pg_hba.conf has `hostssl` lines only, or `hostnossl … reject`).
fn refuses_plaintext(e: &tokio_postgres::Error) -> bool {
    e.as_db_error().is_some_and(|db| db.code().code() == "28000" && db.message().contains("no encryption"))
}

/// Why a server that takes no writes cannot serve (a standby, or a primary
/// set read-only, as some managed services do when the disk is full), and
/// what fixes it.
pub(super) const TAKES_NO_WRITES: &str = "the server takes no writes (a standby, or set read-only): name the \
                                          primary, or list every host with target_session_attrs=read-write";

/// Why a connection could not be made or used, for a log line or a start-up
/// error: never the connection string, never what a statement carried.
pub fn reason(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        let code = db.code().code();
        return match code {
            "28000" if db.message().contains("no encryption") => {
                "the server refuses plaintext: it requires TLS (sslmode=disable, or allow against a server that \
                 also refuses TLS for this user)"
                    .to_owned()
            }
            // No client certificate, or one its pg_hba.conf line does not
            // accept (`clientcert=`, `cert`).
            "28000" if db.message().contains("certificate") => {
                format!("the server requires a client certificate it accepts: set sslcert and sslkey (SQLSTATE {code})")
            }
            "28000" => format!("the server's pg_hba.conf refuses this connection (SQLSTATE {code})"),
            "28P01" => "the server refused the password (SQLSTATE 28P01)".to_owned(),
            "3D000" => "the database does not exist (SQLSTATE 3D000)".to_owned(),
            "57P03" => "the server is starting up or shutting down (SQLSTATE 57P03)".to_owned(),
            "53300" => "the server has no connection slots left (SQLSTATE 53300)".to_owned(),
            "25006" => format!("{TAKES_NO_WRITES} (SQLSTATE 25006)"),
            _ => format!("the server refused (SQLSTATE {code})"),
        };
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(tls) = err.downcast_ref::<rustls::Error>() {
            return tls_reason(tls);
        }
        if let Some(file) = err.downcast_ref::<TlsSetupError>() {
            return file.0.clone();
        }
        if let Some(io) = err.downcast_ref::<io::Error>() {
            if let Some(tls) = io.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()) {
                return tls_reason(tls);
            }
            return match io.kind() {
                // tokio-postgres's word for a server skipped by
                // target_session_attrs=read-write.
                io::ErrorKind::PermissionDenied if io.to_string().contains("does not allow writes") => {
                    TAKES_NO_WRITES.to_owned()
                }
                io::ErrorKind::ConnectionRefused => "connection refused".to_owned(),
                io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => "the connection was reset".to_owned(),
                io::ErrorKind::TimedOut => "the connection timed out".to_owned(),
                io::ErrorKind::UnexpectedEof => "the server closed the connection".to_owned(),
                // A Unix socket path (`host=/dir`) with no server's socket in it.
                io::ErrorKind::NotFound => "no server's socket in that directory".to_owned(),
                // The system's words (a resolver's, an errno's): they name
                // neither the host nor anything else of the string.
                _ => {
                    let said = io.to_string();
                    if said.starts_with("failed to lookup address information") || said.contains("resolve") {
                        format!("the host name could not be resolved ({said})")
                    } else if said == "bytes remaining on stream" {
                        // Something else listens there (a wrong port).
                        "the server does not speak PostgreSQL's protocol: is the port right?".to_owned()
                    } else {
                        said
                    }
                }
            };
        }
        if err.to_string() == "server does not support TLS" {
            return "the server does not accept TLS (sslmode requires it)".to_owned();
        }
        if err.to_string() == "server did not use channel binding" {
            return "channel_binding=require, but the server did not bind the password to the TLS connection \
                    (SCRAM-SHA-256-PLUS): it authenticates otherwise (trust, md5, a certificate), or a pooler \
                    answers for it"
                .to_owned();
        }
        source = err.source();
    }
    if e.is_closed() {
        return "the connection was closed".to_owned();
    }
    // tokio-postgres's own words for the rest (a timeout, a protocol
    // error): they quote neither the string nor a statement's values.
    e.to_string()
}

fn tls_reason(e: &rustls::Error) -> String {
    match e {
        rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer | CertificateError::BadSignature) => {
            "the server's certificate is not signed by sslrootcert".to_owned()
        }
        rustls::Error::InvalidCertificate(
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
        ) => "the server's certificate does not name the host it was reached at (sslmode=verify-full)".to_owned(),
        rustls::Error::InvalidCertificate(
            CertificateError::Expired | CertificateError::ExpiredContext { .. } | CertificateError::NotValidYet,
        ) => "the server's certificate is expired or not yet valid".to_owned(),
        rustls::Error::AlertReceived(alert) => {
            format!(
                "the server ended the TLS handshake ({alert:?}): does it require a client certificate (sslcert, sslkey)?"
            )
        }
        other => format!("TLS: {other}"),
    }
}

/// A TLS setting that could not be used (a file unreadable or not PEM).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct TlsSetupError(String);

/// The rustls side of tokio-postgres, its config built for each new
/// connection from the files as they are now.
#[derive(Debug, Clone)]
struct Rustls {
    params: TlsParams,
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

/// RFC 5929's `tls-server-end-point` of a server certificate (DER): its
/// hash by its signature's hash function, SHA-256 for MD5 and SHA-1, as
/// PostgreSQL computes it on its side. None for a signature with no such
/// hash (Ed25519, RSASSA-PSS) or one ring lacks (SHA-224): no binding is
/// offered then, and `channel_binding=require` refuses the connection.
fn server_end_point(certificate: &[u8]) -> Option<Vec<u8>> {
    const RSA: [u8; 8] = [0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01];
    const ECDSA_SHA1: [u8; 7] = [0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x01];
    const ECDSA_SHA2: [u8; 7] = [0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03];
    use ring::digest::{SHA256, SHA384, SHA512};
    let oid = signature_algorithm(certificate)?;
    let hash = match oid {
        [rsa @ .., n] if *rsa == RSA => match n {
            0x04 | 0x05 | 0x0b => &SHA256, // md5, sha1, sha256 WithRSAEncryption
            0x0c => &SHA384,
            0x0d => &SHA512,
            _ => return None,
        },
        _ if oid == ECDSA_SHA1 => &SHA256,
        [ecdsa @ .., n] if *ecdsa == ECDSA_SHA2 => match n {
            0x02 => &SHA256,
            0x03 => &SHA384,
            0x04 => &SHA512,
            _ => return None,
        },
        _ => return None,
    };
    Some(ring::digest::digest(hash, certificate).as_ref().to_vec())
}

/// The OID of a certificate's `signatureAlgorithm` (the outer one, after
/// the signed part), read from its DER without trusting any length.
fn signature_algorithm(certificate: &[u8]) -> Option<&[u8]> {
    let (0x30, certificate, _) = der_element(certificate)? else { return None };
    let (0x30, _signed, rest) = der_element(certificate)? else { return None };
    let (0x30, algorithm, _) = der_element(rest)? else { return None };
    let (0x06, oid, _) = der_element(algorithm)? else { return None };
    Some(oid)
}

/// A DER element at the start of `der`: its tag, its content, and what
/// follows it.
fn der_element(der: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = der.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let (len, rest) = rest.split_at(n);
        (len.iter().fold(0, |acc, b| (acc << 8) | usize::from(*b)), rest)
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn self_signed(algorithm: &'static rcgen::SignatureAlgorithm) -> Vec<u8> {
        let key = rcgen::KeyPair::generate_for(algorithm).unwrap();
        let params = rcgen::CertificateParams::new(vec!["db.example".to_owned()]).unwrap();
        params.self_signed(&key).unwrap().der().to_vec()
    }

    /// The end point is the certificate's hash by its signature's hash
    /// function, as PostgreSQL computes it.
    #[test]
    fn the_end_point_is_hashed_as_the_certificate_is_signed() {
        use ring::digest::{SHA256, SHA384, digest};
        for (algorithm, hash) in [(&rcgen::PKCS_ECDSA_P256_SHA256, &SHA256), (&rcgen::PKCS_ECDSA_P384_SHA384, &SHA384)]
        {
            let der = self_signed(algorithm);
            assert_eq!(server_end_point(&der), Some(digest(hash, &der).as_ref().to_vec()), "{algorithm:?}");
        }
        // Ed25519 has no hash of its own: no binding.
        assert_eq!(server_end_point(&self_signed(&rcgen::PKCS_ED25519)), None);
    }

    /// A host of a list, narrowed to, is the same string naming it alone
    /// (every setting kept: `Config` compares them all).
    #[test]
    fn one_host_of_a_list_keeps_every_setting() {
        let settings = "user=u password=p dbname=d options='-c x=1' application_name=a connect_timeout=7 \
                        tcp_user_timeout=9 keepalives=1 keepalives_idle=11 keepalives_interval=3 \
                        keepalives_retries=4 target_session_attrs=read-write channel_binding=require \
                        sslmode=require sslnegotiation=direct";
        let list: Config =
            format!("host=a,/run/pg,c hostaddr=10.0.0.1,10.0.0.2,10.0.0.3 port=1,2,3 {settings}").parse().unwrap();
        for (i, alone) in [
            "host=a hostaddr=10.0.0.1 port=1",
            "host=/run/pg hostaddr=10.0.0.2 port=2",
            "host=c hostaddr=10.0.0.3 port=3",
        ]
        .iter()
        .enumerate()
        {
            let alone: Config = format!("{alone} {settings}").parse().unwrap();
            assert_eq!(one_host(&list, i), alone, "host {i}");
        }
        // One port for all.
        let shared: Config = "host=a,b port=5 user=u".parse().unwrap();
        assert_eq!(one_host(&shared, 1), "host=b port=5 user=u".parse::<Config>().unwrap());
        // No port: the default.
        let none: Config = "host=a,b".parse().unwrap();
        assert_eq!(one_host(&none, 0), "host=a".parse::<Config>().unwrap());
    }

    /// A certificate cut short or garbled anywhere yields no end point,
    /// and no panic.
    #[test]
    fn a_broken_certificate_has_no_end_point() {
        let der = self_signed(&rcgen::PKCS_ECDSA_P256_SHA256);
        for n in 0..der.len() {
            assert_eq!(server_end_point(&der[..n]), None, "cut at {n}");
        }
        for i in 0..der.len() {
            let mut garbled = der.clone();
            garbled[i] ^= 0xff;
            let _ = server_end_point(&garbled);
        }
        assert_eq!(server_end_point(&[0x30, 0x84, 0xff, 0xff, 0xff, 0xff]), None);
        assert_eq!(server_end_point(&[0x30, 0x80]), None);
    }
}
