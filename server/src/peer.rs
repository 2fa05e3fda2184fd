//! Channels to tool and hook services, from an endpoint in the config.
//!
//! - `http://host:port`: one HTTP/2 connection, made on the first call and
//!   remade after a failure. Behind a Kubernetes ClusterIP Service that one
//!   connection goes to one pod.
//! - `dns:///host:port`: the name is resolved at start-up and every
//!   [`RESOLVE_EVERY`]; Lattice keeps one connection per address and sends
//!   each call to the less loaded of two (power of two choices). Point it at
//!   a headless Service and the calls spread over all its ready pods; a pod
//!   that goes away leaves the set at the next resolution.
//!
//! Either way nothing connects at start-up, so a peer that is down then
//! blocks nothing, and the connection time counts toward each call's
//! deadline. A call that fails on a connection fails: there is no retry on
//! another address, so for a hook the query aborts as for any failure.

use std::{
    collections::HashSet,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::sync::mpsc::Sender;
use tonic::transport::{Channel, Endpoint, channel::Change};
use tracing::{info, warn};

/// How often a `dns:///` name is resolved again.
pub const RESOLVE_EVERY: Duration = Duration::from_secs(5);

/// Where a tool or hook service is, as the config names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// `http://host:port`.
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
        if endpoint.starts_with("https://") {
            return Err("TLS to tool and hook services is not supported: use http:// or dns:/// \
                        (a service mesh can encrypt the traffic)"
                .into());
        }
        let valid = endpoint.starts_with("http://")
            && Endpoint::from_shared(endpoint.to_owned()).is_ok_and(|e| e.uri().host().is_some_and(|h| !h.is_empty()));
        if valid {
            Ok(Target::Uri(endpoint.to_owned()))
        } else {
            Err("not an http://host:port URL or a dns:///host:port target".into())
        }
    }
}

/// The addresses a `dns:///` target has now; always "some" for `http://`.
#[derive(Debug, Clone, Default)]
pub struct Addresses(Option<Arc<AtomicUsize>>);

impl Addresses {
    /// True while a `dns:///` name resolves to no address: a call would wait
    /// for one until its deadline, so the caller fails it at once instead.
    pub fn none(&self) -> bool {
        self.0.as_ref().is_some_and(|n| n.load(Ordering::Relaxed) == 0)
    }
}

/// A channel to one tool or hook service.
#[derive(Debug, Clone)]
pub struct Peer {
    /// Calls go here (a cheap clone: every clone shares the connections).
    pub channel: Channel,
    /// See [`Addresses::none`].
    pub addresses: Addresses,
}

impl Peer {
    /// A channel to `endpoint` (see the module docs). Connects lazily; for a
    /// `dns:///` target it starts the resolver task, which ends when the
    /// last clone of the channel is dropped. Needs a Tokio runtime.
    pub fn connect(endpoint: &str, connect_timeout: Duration) -> Result<Peer, String> {
        match Target::parse(endpoint)? {
            Target::Uri(uri) => Ok(Peer {
                channel: settings(Endpoint::from_shared(uri).map_err(|e| e.to_string())?, connect_timeout)
                    .connect_lazy(),
                addresses: Addresses::default(),
            }),
            Target::Dns { host, port } => {
                let (channel, changes) = Channel::balance_channel(1024);
                let count = Arc::new(AtomicUsize::new(0));
                tokio::spawn(resolve(host, port, connect_timeout, changes, count.clone()));
                Ok(Peer { channel, addresses: Addresses(Some(count)) })
            }
        }
    }
}

fn settings(e: Endpoint, connect_timeout: Duration) -> Endpoint {
    e.connect_timeout(connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(20))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true)
}

/// Resolves `host:port` now and every [`RESOLVE_EVERY`], telling the
/// balancer which addresses came and went. A failed lookup keeps the last
/// addresses (calls to them fail on their own if they are gone).
async fn resolve(
    host: String,
    port: u16,
    connect_timeout: Duration,
    changes: Sender<Change<SocketAddr, Endpoint>>,
    count: Arc<AtomicUsize>,
) {
    let name = format!("{host}:{port}");
    let mut current: HashSet<SocketAddr> = HashSet::new();
    loop {
        match tokio::net::lookup_host(&name).await {
            Ok(found) => {
                let found: HashSet<SocketAddr> = found.collect();
                for gone in current.difference(&found) {
                    if changes.send(Change::Remove(*gone)).await.is_err() {
                        return;
                    }
                }
                for new in found.difference(&current) {
                    let Ok(endpoint) = Endpoint::from_shared(format!("http://{new}")) else { continue };
                    if changes.send(Change::Insert(*new, settings(endpoint, connect_timeout))).await.is_err() {
                        return;
                    }
                }
                count.store(found.len(), Ordering::Relaxed);
                if found != current {
                    info!(target_name = %name, addresses = found.len(), "resolved");
                }
                current = found;
            }
            Err(e) => {
                warn!(target_name = %name, error = %e, addresses = current.len(), "could not resolve; keeping the last addresses")
            }
        }
        tokio::select! {
            () = changes.closed() => return,
            () = tokio::time::sleep(RESOLVE_EVERY) => {}
        }
    }
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
        for bad in
            ["https://hook:1", "dns:///hook", "dns:///:1", "dns:///h:0", "dns:///h:x", "ftp://h", "http://", "hook:1"]
        {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
    }
}
