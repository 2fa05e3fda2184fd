//! `grpc.health.v1.Health`, with watch streams that end when the server
//! drains.
//!
//! tonic-health's `Watch` streams live as long as their client. Graceful
//! shutdown waits for every open stream, so one client watching health
//! (a sidecar, a load balancer, `grpcurl … Watch`) would hold a stopping pod
//! until its connection dropped. Here each watch stream sends NOT_SERVING
//! and ends as soon as draining starts.
//!
//! Health also follows the session store: NOT_SERVING while it can't be
//! reached (so Kubernetes takes the pod out of its Service, and the
//! readiness probe says why), SERVING again when it answers, no restart.

use std::{pin::Pin, sync::Arc, time::Duration};

use futures_util::{Stream, StreamExt, stream};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tonic_health::{
    ServingStatus,
    pb::{HealthCheckRequest, HealthCheckResponse, health_server::Health},
    server::{HealthReporter, HealthService},
};
use tracing::{info, warn};

use crate::session::{PostgresStore, SessionStore};

/// How often the agents' readiness is looked at (reading a few counters).
const READY_CHECK_EVERY: Duration = Duration::from_millis(100);

/// How often the session store is checked, in [`READY_CHECK_EVERY`]s: 1 s.
const STORE_CHECK_TICKS: u64 = 10;

/// How often idle sessions are swept, in [`READY_CHECK_EVERY`]s: 10 min.
const SWEEP_TICKS: u64 = 6_000;

/// The name health reports the agent service under.
const AGENT_SERVICE: &str = "lattice.agent.v1.AgentService";

/// A health "service" that is SERVING while the process runs, whatever the
/// store: what a liveness probe should check (a database outage must take
/// pods out of rotation, not restart them).
pub const LIVENESS: &str = "liveness";

/// Sets the agent service's status and the overall one ("", which is what
/// Kubernetes' gRPC probes check by default).
pub async fn set(reporter: &HealthReporter, serving: bool) {
    let status = if serving { ServingStatus::Serving } else { ServingStatus::NotServing };
    reporter.set_service_status(AGENT_SERVICE, status).await;
    reporter.set_service_status("", status).await;
}

/// Follows the store and the agents until draining starts: health is
/// SERVING while the store answers and every agent is `ready` (its tools
/// discovered, its required hooks with a ready address), NOT_SERVING
/// otherwise. `store_ok` and `serving` are how things stood at start-up.
/// The agents are looked at every 100 ms, the store every second. A
/// PostgreSQL store is also migrated once it first answers (if start-up
/// could not), and swept of idle sessions now and then.
pub async fn follow_store(
    reporter: HealthReporter,
    store: Arc<dyn SessionStore>,
    postgres: Option<PostgresStore>,
    ready: impl Fn() -> Result<(), String> + Send,
    draining: CancellationToken,
    mut store_ok: bool,
    mut serving: bool,
) {
    let mut migrated = store_ok;
    let mut ticks: u64 = 0;
    loop {
        tokio::select! {
            () = draining.cancelled() => return,
            () = tokio::time::sleep(READY_CHECK_EVERY) => {}
        }
        ticks += 1;
        if ticks.is_multiple_of(STORE_CHECK_TICKS) {
            store_ok = store.ready().await.is_ok();
            if let (Some(pg), true, false) = (&postgres, store_ok, migrated) {
                match pg.prepare_schema().await {
                    Ok(()) => migrated = true,
                    Err(e) => warn!(reason = %e, "session store schema not ready: NOT_SERVING"),
                }
                store_ok = migrated;
            }
            if let (Some(pg), true) = (&postgres, store_ok && ticks.is_multiple_of(SWEEP_TICKS))
                && let Some(n) = pg.sweep().await.ok().filter(|n| *n > 0)
            {
                info!(deleted = n, "idle sessions deleted");
            }
        }
        let ok = store_ok;
        if draining.is_cancelled() {
            return;
        }
        let agents_ready = ready();
        let now = ok && agents_ready.is_ok();
        if now != serving {
            serving = now;
            match (ok, agents_ready) {
                (true, Ok(())) => info!(store = store.name(), "session store and agents ready: SERVING"),
                (false, _) => warn!(store = store.name(), "session store unreachable: NOT_SERVING"),
                (true, Err(why)) => warn!(reason = %why, "an agent is not ready: NOT_SERVING"),
            }
            set(&reporter, now).await;
        }
    }
}

/// The health service over a reporter's statuses; see the module docs.
#[derive(Debug)]
pub struct Draining {
    inner: HealthService,
    draining: CancellationToken,
}

impl Draining {
    /// Serves `reporter`'s statuses; watch streams end when `draining` is
    /// cancelled.
    pub fn new(reporter: HealthReporter, draining: CancellationToken) -> Self {
        Self { inner: HealthService::from_health_reporter(reporter), draining }
    }
}

type Watch = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Health for Draining {
    async fn check(&self, request: Request<HealthCheckRequest>) -> Result<Response<HealthCheckResponse>, Status> {
        self.inner.check(request).await
    }

    type WatchStream = Watch;

    async fn watch(&self, request: Request<HealthCheckRequest>) -> Result<Response<Watch>, Status> {
        let statuses = self.inner.watch(request).await?.into_inner();
        let draining = self.draining.clone();
        let stream = stream::unfold(Some((statuses, draining)), |state| async move {
            let (mut statuses, draining) = state?;
            tokio::select! {
                biased;
                () = draining.cancelled() => {
                    let last = HealthCheckResponse { status: ServingStatus::NotServing as i32 };
                    Some((Ok(last), None))
                }
                next = statuses.next() => next.map(|item| (item, Some((statuses, draining)))),
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }
}
