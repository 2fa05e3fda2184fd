//! Channels to tool and hook services, from an endpoint in the config.
//!
//! - `http://host:port`: one HTTP/2 connection, made on the first call and
//!   remade after a failure. Behind a Kubernetes ClusterIP Service that one
//!   connection goes to one pod.
//! - `dns:///host:port`: the name is resolved at start-up and every
//!   [`RESOLVE_EVERY`]; Lattice keeps one connection per address and sends
//!   each call to the less loaded of two ready ones, taken in rotation.
//!   Point it at a headless Service and the calls spread over all its ready
//!   pods; a pod that refuses, sends GOAWAY or reports NOT_SERVING leaves
//!   the set at once (see `pool`), one that is gone from DNS at the next
//!   resolution.
//!
//! TLS: `https://host:port`, or `dns:///host:port` with a [`Tls`] setting,
//! verifies the service against the system's roots or a given CA, and can
//! present a client certificate (mutual TLS).
//!
//! Either way nothing connects at start-up, so a peer that is down then
//! blocks nothing, and the connection time counts toward each call's
//! deadline. A call the service provably never received is retried within
//! its deadline (see `call`); any other failure is the call's result.

mod call;
mod direct;
mod guard;
mod pool;
mod tls;
mod unary;

pub use crate::config::Tls;

/// How close to its deadline a call that ended CANCELLED or
/// DEADLINE_EXCEEDED must have ended to count as ended by the deadline. The
/// timers that can end it — the peer's own (from `grpc-timeout`), the
/// transport's, the caller's — fire a few scheduler ticks apart, and a call
/// cut short by one of them should be reported as the deadline, not as the
/// peer's status.
pub const DEADLINE_SLACK: Duration = Duration::from_millis(5);

/// Whether now is within [`DEADLINE_SLACK`] of `deadline`, or past it.
pub fn at_deadline(deadline: tokio::time::Instant) -> bool {
    tokio::time::Instant::now() + DEADLINE_SLACK >= deadline
}

use std::{
    sync::{Arc, atomic::AtomicUsize},
    time::Duration,
};

pub(crate) use call::Probe;
pub use call::{CallDeadline, ProbedBody};
pub use pool::HEALTH_CONNECT_TIMEOUT;
use pool::{Calls, Pool};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
pub use tls::TlsFiles;
#[cfg(test)]
use tonic::transport::Channel;
use tonic::{
    codegen::http,
    transport::{Certificate, ClientTlsConfig, Endpoint, Identity},
};
pub(crate) use unary::unary;

/// How often a `dns:///` name is resolved again.
pub const RESOLVE_EVERY: Duration = Duration::from_secs(5);

/// How the connections to every tool and hook service behave, beyond
/// their endpoints: one for the agent runtime.
#[derive(Debug, Clone)]
pub struct Transport {
    /// How often each address's health is checked
    /// (`server.peer_health_check_ms`); `None`: never.
    pub health_every: Option<Duration>,
    /// Whether a connection's small writes are gathered into fewer
    /// (`server.gather_writes`; see `lattice_net`).
    pub gather_writes: bool,
    /// The runtime's busy poller (`server.busy_poll_us`), which each call
    /// in flight keeps polling.
    pub poller: Option<Arc<crate::busy_poll::Poller>>,
}

impl Default for Transport {
    /// No health checks, writes gathered, no busy polling.
    fn default() -> Self {
        Transport { health_every: None, gather_writes: true, poller: None }
    }
}

/// Where a tool or hook service is, as the config names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// `http://host:port` or `https://host:port`.
    Uri(String),
    /// `dns:///host:port`.
    Dns {
        /// The name (or address) to resolve.
        host: String,
        /// The port every address is called on.
        port: u16,
    },
}

impl Target {
    /// Parses an endpoint from the config; the error says what is wrong
    /// without repeating the value.
    pub fn parse(endpoint: &str) -> Result<Target, String> {
        if let Some(rest) = endpoint.strip_prefix("dns:///") {
            let Some((host, port)) = rest.rsplit_once(':') else {
                return Err("a dns:/// target needs a port: dns:///host:port".into());
            };
            if host.is_empty() || host.contains('/') {
                return Err("a dns:/// target is dns:///host:port".into());
            }
            return match port.parse::<u16>() {
                Ok(port) if port > 0 => Ok(Target::Dns { host: host.to_owned(), port }),
                _ => Err("the port of a dns:/// target must be 1-65535".into()),
            };
        }
        let valid = (endpoint.starts_with("http://") || endpoint.starts_with("https://"))
            && Endpoint::from_shared(endpoint.to_owned()).is_ok_and(|e| e.uri().host().is_some_and(|h| !h.is_empty()));
        if valid {
            Ok(Target::Uri(endpoint.to_owned()))
        } else {
            Err("not an http(s)://host:port URL or a dns:///host:port target".into())
        }
    }
}

impl Tls {
    /// The PEM texts hold what they should (rustls would skip a CA file
    /// that holds no certificate, and every connection would then fail).
    pub(crate) fn validate(&self) -> Result<(), String> {
        let certificates = |pem: &str, what: &str| match CertificateDer::pem_slice_iter(pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
        {
            Ok(certs) if !certs.is_empty() => Ok(()),
            _ => Err(format!("the {what} holds no valid PEM certificate")),
        };
        if let Some(ca) = &self.ca_pem {
            certificates(ca, "CA file")?;
        }
        if let Some((cert, key)) = &self.identity {
            certificates(cert, "certificate file")?;
            PrivateKeyDer::from_pem_slice(key.as_bytes())
                .map_err(|_| "the key file holds no valid PEM private key".to_owned())?;
        }
        Ok(())
    }

    pub(crate) fn client_config(&self, host: Option<&str>) -> ClientTlsConfig {
        let mut config = ClientTlsConfig::new();
        if let Some(name) = self.server_name.as_deref().or(host) {
            config = config.domain_name(name);
        }
        config = match &self.ca_pem {
            Some(pem) => config.ca_certificate(Certificate::from_pem(pem)),
            None => config.with_native_roots(),
        };
        if let Some((cert, key)) = &self.identity {
            config = config.identity(Identity::from_pem(cert, key));
        }
        config
    }
}

/// An endpoint and its TLS setting, checked: the certificates and the key
/// parse, and TLS is asked for only where it can be used.
#[derive(Debug, Clone)]
struct Checked {
    target: Target,
    tls: Option<Arc<tls::ClientTls>>,
    /// Whether connections gather their writes.
    gather_writes: bool,
}

impl Checked {
    fn new(endpoint: &str, tls: Option<&Tls>) -> Result<Checked, String> {
        let target = Target::parse(endpoint)?;
        if let Some(tls) = tls {
            tls.validate()?;
        }
        if tls.is_some() && !uses_tls(endpoint, tls) {
            return Err("a tls setting needs an https:// or dns:/// endpoint".into());
        }
        let tls = match uses_tls(endpoint, tls) {
            true => Some(tls::ClientTls::new(&tls.cloned().unwrap_or_default()).map_err(|e| format!("TLS: {e}"))?),
            false => None,
        };
        Ok(Checked { target, tls, gather_writes: true })
    }

    /// The name a `dns:///` target's certificates must carry: its host
    /// (each address is connected to by IP).
    fn dns_host(&self) -> Option<&str> {
        match &self.target {
            Target::Dns { host, .. } => Some(host),
            Target::Uri(_) => None,
        }
    }

    /// The calls to `uri` (`scheme://host:port`): one lazy connection,
    /// over TLS when the target uses it (see [`direct`]).
    fn calls(&self, uri: &str, connect_timeout: Duration) -> Result<Calls, String> {
        let origin: http::Uri = uri.parse().map_err(|e: http::uri::InvalidUri| e.to_string())?;
        let authority = origin.authority().ok_or("the endpoint has no host and port")?;
        let tls = match &self.tls {
            // A `dns:///` target's addresses are verified against its name.
            Some(tls) => Some(tls.connector(self.dns_host().unwrap_or(authority.host()))?),
            None => None,
        };
        Ok(Calls::Direct(direct::Direct::new(authority.as_str(), connect_timeout, tls, self.gather_writes)?))
    }
}

/// Whether calls to `endpoint` use TLS: `https://`, or `dns:///` with a
/// TLS setting.
pub fn uses_tls(endpoint: &str, tls: Option<&Tls>) -> bool {
    endpoint.starts_with("https://") || (endpoint.starts_with("dns:///") && tls.is_some())
}

/// Checks an endpoint and its TLS setting without connecting (for config
/// validation); the error says what is wrong without repeating secrets.
pub fn check(endpoint: &str, tls: Option<&Tls>) -> Result<(), String> {
    Checked::new(endpoint, tls).map(|_| ())
}

/// What went wrong below gRPC, from the types in an error's source chain
/// alone, for logs: "connection refused", "TLS: invalid peer certificate:
/// UnknownIssuer", "GOAWAY PROTOCOL_ERROR from the peer". Never a message
/// text that could carry a peer's bytes (an h2 GOAWAY's debug data is
/// one); empty when no known type is in the chain.
pub(crate) fn transport_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = Some(e);
    while let Some(err) = next {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            parts.push(io.kind().to_string());
        } else if let Some(h2) = err.downcast_ref::<h2::Error>() {
            let what = if h2.is_go_away() {
                "GOAWAY"
            } else if h2.is_reset() {
                "stream reset"
            } else {
                "HTTP/2 error"
            };
            let reason = h2.reason().map(|r| format!(" {r:?}")).unwrap_or_default();
            let side = if h2.is_remote() { " from the peer" } else { "" };
            parts.push(format!("{what}{reason}{side}"));
            break;
        } else if let Some(tls) = err.downcast_ref::<rustls::Error>() {
            parts.push(format!("TLS: {tls}"));
            break;
        } else if let Some(h) = err.downcast_ref::<hyper::Error>() {
            if h.is_timeout() {
                parts.push("timed out".into());
            } else if h.is_closed() || h.is_incomplete_message() {
                parts.push("connection closed".into());
            } else if h.is_canceled() {
                parts.push("request canceled".into());
            }
        } else if err.downcast_ref::<tls::ConnectFailed>().is_some_and(|c| matches!(c, tls::ConnectFailed::NotHttp2)) {
            parts.push("the service did not agree to HTTP/2 over TLS".into());
        }
        next = err.source();
    }
    parts.dedup();
    parts.join(": ")
}

/// An error and its sources, "a: b: c" (local errors only: never a peer's bytes).
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text = format!("{text}: {s}");
        source = s.source();
    }
    text
}

/// A tool or hook service: its addresses, each with its connection and
/// readiness (see `pool`), and the calls to them (see `call`). A cheap
/// clone; every clone shares the connections. It is the transport of the
/// generated gRPC clients.
#[derive(Debug, Clone)]
pub struct Peer {
    pool: Arc<Pool>,
    /// Whether calls use TLS.
    pub tls: bool,
}

impl Peer {
    /// A peer for `endpoint` (see the module docs). Connects lazily; for a
    /// `dns:///` target it starts the resolver task, and for every address
    /// a health checker (every `transport.health_every`, if set); they end
    /// when the last clone is dropped. Needs a Tokio runtime.
    pub fn connect(
        endpoint: &str,
        tls: Option<&Tls>,
        connect_timeout: Duration,
        transport: &Transport,
    ) -> Result<Peer, String> {
        let mut checked = Checked::new(endpoint, tls)?;
        checked.gather_writes = transport.gather_writes;
        let (health_every, poller) = (transport.health_every, transport.poller.clone());
        let uses_tls = checked.tls.is_some();
        if let Some(client) = &checked.tls {
            client.watch(&tls.cloned().unwrap_or_default());
        }
        let pool = match &checked.target {
            Target::Uri(uri) => {
                let calls = checked.calls(uri, connect_timeout)?;
                let authority = Endpoint::from_shared(uri.clone())
                    .ok()
                    .and_then(|e| e.uri().authority().map(|a| a.to_string()))
                    .unwrap_or_default();
                Pool::single(endpoint.to_owned(), authority, calls, health_every, poller)
            }
            Target::Dns { host, port } => {
                let host_port = format!("{host}:{port}");
                Pool::resolving(endpoint.to_owned(), host_port, checked.clone(), connect_timeout, health_every, poller)
            }
        };
        Ok(Peer { pool, tls: uses_tls })
    }

    /// A peer over one ready channel (an in-process service in tests); its
    /// health is not checked.
    #[cfg(test)]
    pub(crate) fn over(channel: Channel) -> Peer {
        let name = "in-process".to_owned();
        Peer { pool: Pool::single(name.clone(), name, Calls::Channel(channel), None, None), tls: false }
    }

    /// A peer over several ready channels, tried in this order (in-process
    /// services in tests); their health is not checked.
    #[cfg(test)]
    pub(crate) fn over_all(channels: Vec<Channel>) -> Peer {
        Peer { pool: Pool::fixed(channels), tls: false }
    }

    /// True when no call can be sent now: a `dns:///` target with no ready
    /// address (none resolved, or every one refused, went away or said
    /// NOT_SERVING). A call would only fail, so the caller fails it at once
    /// instead. A single `http(s)://` address is always tried.
    pub fn none(&self) -> bool {
        !self.pool.single && self.pool.ready() == 0
    }

    /// Whether no call can reach the service now, as far as is known, once
    /// every address has had its first health check (waited for until
    /// `until`): a `dns:///` target with no ready address, or a single
    /// address whose last health check (or call) found it down. Before a
    /// reply's tool calls run, a hook that handles their results is asked
    /// this: its results could not be delivered through it.
    pub async fn unreachable(&self, until: tokio::time::Instant) -> bool {
        self.pool.first_checks(until).await;
        self.pool.unreachable()
    }

    /// Why an address last left the ready set ("could not connect",
    /// "health NOT_SERVING", …), or "no address" when none was resolved.
    pub fn down_reason(&self) -> String {
        self.pool.down_reason()
    }

    /// How many addresses are ready now (for a single address: whether its
    /// health check last said it can take calls).
    pub fn ready_addresses(&self) -> usize {
        self.pool.ready()
    }

    /// [`Peer::ready_addresses`], shared, for a gauge.
    pub fn ready_gauge(&self) -> Arc<AtomicUsize> {
        self.pool.ready_gauge()
    }
}

/// A `grpc-timeout` header value for `d`: microseconds while they fit the
/// header's 8 digits, milliseconds beyond.
///
/// Marked never-indexed for HPACK: each call's value is new, and indexing
/// it would evict the headers every call repeats (`:path`, `:authority`,
/// `content-type`, `te`) from both sides' tables, so that they are sent
/// and decoded in full again.
pub(crate) fn grpc_timeout(d: Duration) -> http::HeaderValue {
    let us = d.as_micros();
    let text = if us < 100_000_000 { format!("{}u", us.max(1)) } else { format!("{}m", d.as_millis().min(99_999_999)) };
    let mut value = http::HeaderValue::try_from(text).unwrap_or_else(|_| http::HeaderValue::from_static("1m"));
    value.set_sensitive(true);
    value
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse() {
        assert_eq!(Target::parse("http://hook:50071"), Ok(Target::Uri("http://hook:50071".into())));
        assert_eq!(
            Target::parse("dns:///hook.ns.svc:50071"),
            Ok(Target::Dns { host: "hook.ns.svc".into(), port: 50071 })
        );
        assert_eq!(Target::parse("dns:///[::1]:7"), Ok(Target::Dns { host: "[::1]".into(), port: 7 }));
        assert_eq!(Target::parse("https://hook:1"), Ok(Target::Uri("https://hook:1".into())));
        for bad in ["dns:///hook", "dns:///:1", "dns:///h:0", "dns:///h:x", "ftp://h", "http://", "hook:1"] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn grpc_timeouts_fit_the_header_and_stay_out_of_hpack_tables() {
        let t = |d: Duration| grpc_timeout(d);
        assert_eq!(t(Duration::from_micros(1500)), "1500u");
        assert_eq!(t(Duration::ZERO), "1u");
        assert_eq!(t(Duration::from_secs(100)), "100000m");
        assert_eq!(t(Duration::from_secs(10_000_000)), "99999999m");
        assert!(t(Duration::from_millis(3)).is_sensitive());
    }

    #[test]
    fn tls_is_checked_where_it_is_asked_for() {
        let tls = Tls { ca_pem: Some("not a certificate".into()), ..Default::default() };
        assert!(check("http://hook:1", Some(&Tls::default())).unwrap_err().contains("https://"));
        assert!(check("https://hook:1", Some(&tls)).is_err());
        assert!(check("dns:///hook:1", Some(&tls)).is_err());
        assert!(check("dns:///hook:1", None).is_ok());
        let secret = "-----BEGIN PRIVATE KEY-----\nc2VjcmV0\n-----END PRIVATE KEY-----\n";
        let with_key = Tls { identity: Some(("x".into(), secret.into())), ..Default::default() };
        assert!(!format!("{with_key:?}").contains("c2VjcmV0"));
    }
}
