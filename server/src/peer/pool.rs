//! The addresses of one tool or hook service, each with its own connection
//! and a readiness that follows what the address does.
//!
//! An address is **ready** when it was resolved and nothing since says it
//! can't take a call. It leaves the set at once when
//! - a connection to it is refused (or fails in any way before a request
//!   was sent),
//! - its connection gets GOAWAY (the service is shutting down), or
//! - its `grpc.health.v1` check answers NOT_SERVING (a draining service
//!   says so first);
//!
//! and it comes back when its health check connects and answers SERVING
//! (or UNIMPLEMENTED: a service that serves no health is ready when it
//! accepts a connection). Each address is checked every
//! `server.peer_health_check_ms` (1 s); a check that times out changes
//! nothing (a slow service is not a gone one).

use std::{
    net::SocketAddr,
    sync::{
        Arc, RwLock,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::task::AbortHandle;
use tonic::transport::Channel;
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};
use tracing::{debug, info, warn};

use super::{Checked, RESOLVE_EVERY, call::NotSent, direct::Direct};

/// How long a health check's connection may take to connect.
pub const HEALTH_CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// How calls reach one address.
#[derive(Debug, Clone)]
pub(crate) enum Calls {
    /// Plaintext: a connection without a buffer task (see [`Direct`]).
    Direct(Arc<Direct>),
    /// TLS, or an in-process service: a tonic channel.
    Channel(Channel),
}

/// One address and its connection.
#[derive(Debug)]
pub(crate) struct Slot {
    /// `ip:port`, or the URL's authority for an `http(s)://` target.
    pub(crate) addr: String,
    pub(crate) calls: Calls,
    /// A connection of its own for health checks, with a short connect
    /// timeout: an address that no longer answers SYNs is told apart from a
    /// slow service.
    health: Channel,
    ready: AtomicBool,
    /// Calls on this address now (attempts in flight).
    pub(crate) in_flight: AtomicUsize,
    /// The health checker; aborted when the slot goes.
    checker: std::sync::Mutex<Option<AbortHandle>>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(h) = crate::sync::lock(&self.checker).take() {
            h.abort();
        }
    }
}

/// The slots of one endpoint.
#[derive(Debug)]
pub(crate) struct Pool {
    /// The endpoint as configured (names only, for logs).
    pub(crate) name: String,
    /// An `http(s)://` target: one slot, used even when not ready (a new
    /// connection behind a ClusterIP Service may reach another pod).
    pub(crate) single: bool,
    slots: RwLock<Arc<Vec<Arc<Slot>>>>,
    /// How many slots are ready (kept in step with the slots).
    ready: Arc<AtomicUsize>,
    /// Where the rotation of [`Pool::pick`] is.
    turn: AtomicUsize,
    /// How often each slot's health is checked, if at all.
    health_every: Option<Duration>,
    /// The resolver task, for `dns:///`; aborted when the pool goes.
    resolver: std::sync::Mutex<Option<AbortHandle>>,
}

impl Drop for Pool {
    fn drop(&mut self) {
        if let Some(h) = crate::sync::lock(&self.resolver).take() {
            h.abort();
        }
    }
}

impl Pool {
    fn new(name: String, single: bool, health_every: Option<Duration>) -> Arc<Pool> {
        Arc::new(Pool {
            name,
            single,
            health_every,
            slots: RwLock::new(Arc::new(Vec::new())),
            ready: Arc::new(AtomicUsize::new(0)),
            turn: AtomicUsize::new(0),
            resolver: std::sync::Mutex::new(None),
        })
    }

    /// A pool of one slot over `calls` (an `http(s)://` target, or an
    /// in-process channel in tests); its health is checked over `health`
    /// every `health_every`.
    pub(crate) fn single(
        name: String,
        addr: String,
        calls: Calls,
        health: Channel,
        health_every: Option<Duration>,
    ) -> Arc<Pool> {
        let pool = Pool::new(name, true, health_every);
        let slot = pool.add(addr, calls, health);
        *crate::sync::write(&pool.slots) = Arc::new(vec![slot]);
        pool.recount();
        pool
    }

    /// A pool over fixed channels, in this order, without health checks
    /// (in-process services in tests).
    #[cfg(test)]
    pub(crate) fn fixed(channels: Vec<Channel>) -> Arc<Pool> {
        let pool = Pool::new("in-process".into(), false, None);
        let slots = channels
            .into_iter()
            .enumerate()
            .map(|(i, c)| pool.add(format!("in-process-{i}"), Calls::Channel(c.clone()), c));
        *crate::sync::write(&pool.slots) = Arc::new(slots.collect());
        pool.recount();
        pool
    }

    /// A pool that follows the addresses `dns:///host:port` resolves to.
    pub(crate) fn resolving(
        name: String,
        host_port: String,
        checked: Checked,
        connect_timeout: Duration,
        health_every: Option<Duration>,
    ) -> Arc<Pool> {
        let pool = Pool::new(name, false, health_every);
        let task = tokio::spawn(resolve(Arc::downgrade(&pool), host_port, checked, connect_timeout));
        *crate::sync::lock(&pool.resolver) = Some(task.abort_handle());
        pool
    }

    /// A new slot; its health is checked over `health`.
    fn add(self: &Arc<Self>, addr: String, calls: Calls, health: Channel) -> Arc<Slot> {
        let slot = Arc::new(Slot {
            addr,
            health,
            calls,
            // With health checks, ready once the first one (made at once)
            // says so; without, ready until a call says otherwise.
            ready: AtomicBool::new(self.health_every.is_none()),
            in_flight: AtomicUsize::new(0),
            checker: std::sync::Mutex::new(None),
        });
        if let Some(every) = self.health_every {
            let task = tokio::spawn(check_health(Arc::downgrade(self), Arc::downgrade(&slot), every));
            *crate::sync::lock(&slot.checker) = Some(task.abort_handle());
        }
        slot
    }

    pub(crate) fn slots(&self) -> Arc<Vec<Arc<Slot>>> {
        crate::sync::read(&self.slots).clone()
    }

    /// How many addresses are ready now.
    pub(crate) fn ready(&self) -> usize {
        self.ready.load(Ordering::Relaxed)
    }

    /// The ready count, shared (for a gauge).
    pub(crate) fn ready_gauge(&self) -> Arc<AtomicUsize> {
        self.ready.clone()
    }

    fn recount(&self) {
        let n = self.slots().iter().filter(|s| s.ready.load(Ordering::Relaxed)).count();
        self.ready.store(n, Ordering::Relaxed);
    }

    /// Marks `slot` ready or not, saying why when it changes.
    pub(crate) fn set_ready(&self, slot: &Slot, ready: bool, why: &str) {
        if slot.ready.swap(ready, Ordering::Relaxed) != ready {
            self.recount();
            let ready_now = self.ready();
            if ready {
                info!(endpoint = %self.name, address = %slot.addr, ready = ready_now, "address ready: {why}");
            } else {
                warn!(endpoint = %self.name, address = %slot.addr, ready = ready_now, "address not ready: {why}");
            }
        }
    }

    /// The slot for the next attempt of a call: of two ready slots next to
    /// each other in a rotation, the less loaded (the first on a tie),
    /// skipping those in `tried`. A single slot is always chosen (see
    /// [`Pool::single`]).
    pub(crate) fn pick(&self, tried: &[usize]) -> Option<(usize, Arc<Slot>)> {
        let slots = self.slots();
        if self.single {
            return slots.first().map(|s| (0, s.clone()));
        }
        // Counted and indexed in place: nothing allocated per call.
        let candidates = || (0..slots.len()).filter(|i| !tried.contains(i) && slots[*i].ready.load(Ordering::Relaxed));
        let n = candidates().count();
        if n == 0 {
            return None;
        }
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        let a = candidates().nth(turn % n)?;
        let b = candidates().nth((turn + 1) % n)?;
        let load = |i: usize| slots[i].in_flight.load(Ordering::Relaxed);
        let i = if load(b) < load(a) { b } else { a };
        Some((i, slots[i].clone()))
    }

    /// Replaces the slots with those for `found`: kept where the address
    /// stays, new (ready once checked) where it is new.
    fn update(self: &Arc<Self>, found: &[SocketAddr], make: impl Fn(SocketAddr) -> Option<(Calls, Channel)>) {
        let current = self.slots();
        let mut next = Vec::with_capacity(found.len());
        for addr in found {
            let text = addr.to_string();
            if let Some(kept) = current.iter().find(|s| s.addr == text) {
                next.push(kept.clone());
            } else if let Some((calls, health)) = make(*addr) {
                next.push(self.add(text, calls, health));
            }
        }
        *crate::sync::write(&self.slots) = Arc::new(next);
        self.recount();
    }
}

/// Resolves `host_port` now and every [`RESOLVE_EVERY`]. A failed lookup
/// keeps the last addresses (their health checks say whether they are
/// still there).
async fn resolve(pool: std::sync::Weak<Pool>, host_port: String, checked: Checked, connect_timeout: Duration) {
    let scheme = if checked.tls.is_some() { "https" } else { "http" };
    let mut last: Vec<SocketAddr> = Vec::new();
    loop {
        match tokio::net::lookup_host(&host_port).await {
            Ok(found) => {
                let mut found: Vec<SocketAddr> = found.collect();
                found.sort();
                found.dedup();
                let Some(pool) = pool.upgrade() else { return };
                if found != last {
                    pool.update(&found, |addr| checked.channels(&format!("{scheme}://{addr}"), connect_timeout).ok());
                    info!(target_name = %host_port, addresses = found.len(), ready = pool.ready(), "resolved");
                    last = found;
                }
            }
            Err(e) => {
                warn!(target_name = %host_port, error = %e, addresses = last.len(), "could not resolve; keeping the last addresses")
            }
        }
        tokio::time::sleep(RESOLVE_EVERY).await;
    }
}

/// Checks one slot's health now and then `every` so often until the slot
/// goes.
async fn check_health(pool: std::sync::Weak<Pool>, slot: std::sync::Weak<Slot>, every: Duration) {
    let mut first = true;
    loop {
        if !std::mem::take(&mut first) {
            tokio::time::sleep(every).await;
        }
        let (Some(pool), Some(slot)) = (pool.upgrade(), slot.upgrade()) else { return };
        let mut client = HealthClient::new(super::guard::Guarded(slot.health.clone()));
        let mut request = tonic::Request::new(HealthCheckRequest { service: String::new() });
        request.set_timeout(every);
        let answer = tokio::time::timeout(every, client.check(request)).await;
        match answer {
            Ok(Ok(reply)) => {
                let serving = reply.get_ref().status == ServingStatus::Serving as i32;
                pool.set_ready(&slot, serving, if serving { "health SERVING" } else { "health NOT_SERVING" });
            }
            Ok(Err(status)) if status.code() == tonic::Code::Unimplemented => {
                pool.set_ready(&slot, true, "connected (no health service)");
            }
            Ok(Err(status)) => match NotSent::of(&status).filter(|why| why.address_down()) {
                Some(why) => pool.set_ready(&slot, false, why.describe()),
                None => {
                    debug!(endpoint = %pool.name, address = %slot.addr, code = crate::grpc::code_name(status.code()), "health check failed")
                }
            },
            Err(_) => debug!(endpoint = %pool.name, address = %slot.addr, "health check timed out"),
        }
    }
}
