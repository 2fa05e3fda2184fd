//! Why a connection to PostgreSQL could not be made or used, in words an
//! operator can act on: never the connection string, never what a
//! statement carried.

use std::io;

use rustls::CertificateError;

use super::tls::TlsSetupError;

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
