//! The settings types of features that live in higher layers (TLS to
//! peers and on the API port, telemetry, per-principal limits, busy
//! polling): defined here, with the config that fills them, so that the
//! config names no layer above it. Each feature's module implements its
//! behaviour on them.

use std::{fmt, path::PathBuf};

/// TLS to a tool or hook service.
#[derive(Clone, Default)]
pub struct Tls {
    /// PEM certificates of the CA(s) that sign the service's certificate;
    /// the system's roots when unset.
    pub ca_pem: Option<String>,
    /// A PEM certificate chain and its PEM private key that Lattice presents
    /// (mutual TLS).
    pub identity: Option<(String, String)>,
    /// The name the service's certificate must carry; by default the
    /// endpoint's host.
    pub server_name: Option<String>,
    /// The files the PEM texts were read from: set, they are re-read when
    /// they change (see `tls`).
    pub files: Option<TlsFiles>,
}

impl fmt::Debug for Tls {
    // Never prints the key.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tls")
            .field("ca", &self.ca_pem.is_some())
            .field("client_identity", &self.identity.is_some())
            .field("server_name", &self.server_name)
            .field("files", &self.files)
            .finish()
    }
}

/// Where a [`Tls`] setting's PEM texts came from, to read them again.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// The CA file.
    pub ca: Option<PathBuf>,
    /// The client certificate file.
    pub cert: Option<PathBuf>,
    /// Its key file.
    pub key: Option<PathBuf>,
}

impl fmt::Display for TlsFiles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let files: Vec<String> =
            [&self.ca, &self.cert, &self.key].into_iter().flatten().map(|p| p.display().to_string()).collect();
        f.write_str(&files.join(", "))
    }
}

/// `[server.tls]`: files, resolved against the config's directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    /// The server's PEM certificate chain.
    pub cert_file: PathBuf,
    /// Its PEM private key.
    pub key_file: PathBuf,
    /// PEM CA certificates that sign clients' certificates; set, every
    /// request needs one (mutual TLS).
    pub client_ca_file: Option<PathBuf>,
}

/// `[telemetry]`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TelemetrySettings {
    /// The OTLP/gRPC collector, e.g. `http://otel-collector:4317`.
    pub otlp_endpoint: Option<String>,
    /// `service.name` (default: `OTEL_SERVICE_NAME`, else "lattice").
    pub service_name: Option<String>,
    /// The fraction of new traces sampled (a parent's decision is kept).
    pub sampling_ratio: Option<f64>,
}

/// `[server.limits]`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LimitSettings {
    /// Queries one principal may have in flight; `None`: no limit.
    pub queries_in_flight: Option<usize>,
    /// Queries one principal may start per minute; `None`: no limit.
    pub queries_per_minute: Option<u32>,
}

/// The largest budget `server.busy_poll_us` takes (10 ms): more would be
/// a setting in the wrong unit.
pub const BUSY_POLL_MAX_US: u64 = 10_000;
