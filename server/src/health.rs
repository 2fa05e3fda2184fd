//! `grpc.health.v1.Health`, with watch streams that end when the server
//! drains.
//!
//! tonic-health's `Watch` streams live as long as their client. Graceful
//! shutdown waits for every open stream, so one client watching health
//! (a sidecar, a load balancer, `grpcurl … Watch`) would hold a stopping pod
//! until its connection dropped. Here each watch stream sends NOT_SERVING
//! and ends as soon as draining starts.

use std::pin::Pin;

use futures_util::{Stream, StreamExt, stream};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tonic_health::{
    ServingStatus,
    pb::{HealthCheckRequest, HealthCheckResponse, health_server::Health},
    server::{HealthReporter, HealthService},
};

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
