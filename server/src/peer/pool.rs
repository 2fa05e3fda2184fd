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

use http_body_util::BodyExt as _;
use tokio::task::AbortHandle;
#[cfg(test)]
use tonic::transport::Channel;
use tonic::{body::Body, codegen::http};
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};
use tracing::{debug, info, warn};

use super::{Checked, RESOLVE_EVERY, call::NotSent, direct::Direct};

/// How long a health check may take to connect, when the address's
/// connection must be made again: an address that no longer answers SYNs
/// is told apart from a slow service.
pub const HEALTH_CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// How calls reach one address.
#[derive(Debug, Clone)]
pub(crate) enum Calls {
    /// Its connection (see [`Direct`]), plaintext or TLS.
    Direct(Arc<Direct>),
    /// An in-process service in tests: a tonic channel.
    #[cfg(test)]
    Channel(Channel),
}

/// One address and its connection.
#[derive(Debug)]
pub(crate) struct Slot {
    /// `ip:port`, or the URL's authority for an `http(s)://` target.
    pub(crate) addr: String,
    pub(crate) calls: Calls,
    ready: AtomicBool,
    /// Whether anything has judged the address yet: a health check's
    /// answer, or a call that could not reach it.
    judged: AtomicBool,
    /// Whether its first health check has ended, whatever it found.
    first_checked: AtomicBool,
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
    /// The busy poller that calls in flight keep polling, if any.
    pub(crate) poller: Option<Arc<crate::busy_poll::Poller>>,
    /// The resolver task, for `dns:///`; aborted when the pool goes.
    resolver: std::sync::Mutex<Option<AbortHandle>>,
    /// Told when a slot's first health check ends.
    checked: tokio::sync::Notify,
    /// Why an address last left the ready set.
    last_down: std::sync::Mutex<String>,
}

impl Drop for Pool {
    fn drop(&mut self) {
        if let Some(h) = crate::sync::lock(&self.resolver).take() {
            h.abort();
        }
    }
}

impl Pool {
    fn new(
        name: String,
        single: bool,
        health_every: Option<Duration>,
        poller: Option<Arc<crate::busy_poll::Poller>>,
    ) -> Arc<Pool> {
        Arc::new(Pool {
            name,
            single,
            health_every,
            poller,
            slots: RwLock::new(Arc::new(Vec::new())),
            ready: Arc::new(AtomicUsize::new(0)),
            turn: AtomicUsize::new(0),
            resolver: std::sync::Mutex::new(None),
            checked: tokio::sync::Notify::new(),
            last_down: std::sync::Mutex::new(String::new()),
        })
    }

    /// A pool of one slot over `calls` (an `http(s)://` target, or an
    /// in-process channel in tests); its health is checked every
    /// `health_every`.
    pub(crate) fn single(
        name: String,
        addr: String,
        calls: Calls,
        health_every: Option<Duration>,
        poller: Option<Arc<crate::busy_poll::Poller>>,
    ) -> Arc<Pool> {
        let pool = Pool::new(name, true, health_every, poller);
        let slot = pool.add(addr, calls);
        *crate::sync::write(&pool.slots) = Arc::new(vec![slot]);
        pool.recount();
        pool
    }

    /// A pool over fixed channels, in this order, without health checks
    /// (in-process services in tests).
    #[cfg(test)]
    pub(crate) fn fixed(channels: Vec<Channel>) -> Arc<Pool> {
        let pool = Pool::new("in-process".into(), false, None, None);
        let slots =
            channels.into_iter().enumerate().map(|(i, c)| pool.add(format!("in-process-{i}"), Calls::Channel(c)));
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
        poller: Option<Arc<crate::busy_poll::Poller>>,
    ) -> Arc<Pool> {
        let pool = Pool::new(name, false, health_every, poller);
        let task = tokio::spawn(resolve(Arc::downgrade(&pool), host_port, checked, connect_timeout));
        *crate::sync::lock(&pool.resolver) = Some(task.abort_handle());
        pool
    }

    /// A new slot; its health is checked on its connection.
    fn add(self: &Arc<Self>, addr: String, calls: Calls) -> Arc<Slot> {
        let slot = Arc::new(Slot {
            addr,
            calls,
            // With health checks, ready once the first one (made at once)
            // says so; without, ready until a call says otherwise.
            ready: AtomicBool::new(self.health_every.is_none()),
            judged: AtomicBool::new(false),
            first_checked: AtomicBool::new(self.health_every.is_none()),
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

    /// Waits until every address has had its first health check (or
    /// `until`): what is known of an address that was just resolved, or of
    /// a service Lattice has not called yet.
    pub(crate) async fn first_checks(&self, until: tokio::time::Instant) {
        loop {
            let notified = self.checked.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.slots().iter().all(|s| s.first_checked.load(Ordering::Acquire)) {
                return;
            }
            if tokio::time::timeout_at(until, notified).await.is_err() {
                return;
            }
        }
    }

    /// Whether no call can reach the service now, as far as is known: for
    /// a `dns:///` target, no address is ready; for a single address, the
    /// last judgement of it (a health check, a call) found it down.
    pub(crate) fn unreachable(&self) -> bool {
        let slots = self.slots();
        match self.single {
            true => slots.first().is_some_and(|s| s.judged.load(Ordering::Relaxed) && !s.ready.load(Ordering::Relaxed)),
            false => self.ready() == 0,
        }
    }

    /// Why an address last left the ready set.
    pub(crate) fn down_reason(&self) -> String {
        let why = crate::sync::lock(&self.last_down).clone();
        match why.is_empty() {
            true if self.slots().is_empty() => "no address".to_owned(),
            true => "not ready".to_owned(),
            false => why,
        }
    }

    /// Marks `slot` ready or not, saying why when it changes.
    pub(crate) fn set_ready(&self, slot: &Slot, ready: bool, why: &str) {
        slot.judged.store(true, Ordering::Relaxed);
        if !ready {
            why.clone_into(&mut crate::sync::lock(&self.last_down));
        }
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
    fn update(self: &Arc<Self>, found: &[SocketAddr], make: impl Fn(SocketAddr) -> Option<Calls>) {
        let current = self.slots();
        let mut next = Vec::with_capacity(found.len());
        for addr in found {
            let text = addr.to_string();
            if let Some(kept) = current.iter().find(|s| s.addr == text) {
                next.push(kept.clone());
            } else if let Some(calls) = make(*addr) {
                next.push(self.add(text, calls));
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
                    pool.update(&found, |addr| checked.calls(&format!("{scheme}://{addr}"), connect_timeout).ok());
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
        let direct = match &slot.calls {
            Calls::Direct(direct) => direct.clone(),
            #[cfg(test)]
            Calls::Channel(_) => return,
        };
        let mut client = HealthClient::new(super::guard::Guarded(HealthCalls(direct)));
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
        if !slot.first_checked.swap(true, Ordering::AcqRel) {
            pool.checked.notify_waiters();
        }
    }
}

/// The health checks of one address, on its connection: connecting (when
/// the connection must be made again) within [`HEALTH_CONNECT_TIMEOUT`].
#[derive(Debug, Clone)]
struct HealthCalls(Arc<Direct>);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower::Service<http::Request<Body>> for HealthCalls {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), BoxError>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let direct = self.0.clone();
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let body = body.collect().await?.to_bytes();
            direct.send_within(http::Request::from_parts(parts, body), HEALTH_CONNECT_TIMEOUT).await
        })
    }
}
