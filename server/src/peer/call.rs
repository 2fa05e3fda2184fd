//! One call through a [`Peer`]: the address it goes to, the transparent
//! retry of an attempt the service never received, and the `grpc-status`
//! the service itself sent.
//!
//! **Transparent retry.** An attempt is retried, on another ready address
//! when there is one, only when the request provably never reached the
//! service's application:
//! - the connection could not be made (refused, unreachable, TLS failed:
//!   tonic's [`tonic::ConnectError`]), so nothing was sent;
//! - the connection closed while the request still waited to be written
//!   (hyper reports such a request as canceled, and gives it back unsent);
//! - the service refused the stream before reading it (HTTP/2
//!   `REFUSED_STREAM`);
//! - the connection got GOAWAY and the stream's id is above its
//!   last-stream-id (RFC 9113 §6.8: such a stream was not processed), which
//!   h2 reports as a remote GOAWAY error on that stream only.
//!
//! Anything else (the service read the request and failed, answered any
//! status, reset the stream mid-call, or the deadline passed) ends the call
//! as it is. Retries stay within the call's deadline: each attempt carries
//! the time left in its `grpc-timeout`, and there is no backoff. A retried
//! request goes to the same kind of service as the first attempt, never
//! anywhere else, so for a hook the value still only ever reaches a hook.
//!
//! **Status probe.** tonic hands a client one `Status` type for everything:
//! a status the peer sent in its trailers, and errors tonic raised itself (a
//! reply that does not decode or is too large, a stream that ended early, a
//! connection that broke). Telling them apart by message text would let a
//! hook pick its own classification ("failed to decode …"), so the call
//! records the `grpc-status` it saw on the wire in a [`Probe`] carried by the
//! request's extensions, and the hook chain decides from that and from the
//! error's source chain alone.

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicI32, Ordering},
    },
    task::{Context, Poll},
};

use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::time::Instant;
use tonic::{
    body::Body,
    codegen::{Bytes, http},
};
use tracing::debug;

use super::{
    Peer,
    pool::{Calls, Slot},
};

/// The most attempts of one call on a single-address target (a retry
/// reconnects once the old connection is seen closed; a ClusterIP Service
/// may send the new connection to another pod).
const SINGLE_ATTEMPTS: usize = 5;

/// No `grpc-status` seen yet.
const NONE: i32 = -1;

/// The `grpc-status` a peer sent for one call, if any. Cloned into the
/// request's extensions; the call fills it in.
#[derive(Debug, Clone)]
pub(crate) struct Probe(Arc<AtomicI32>);

impl Default for Probe {
    fn default() -> Self {
        Self(Arc::new(AtomicI32::new(NONE)))
    }
}

impl Probe {
    /// The status code the peer sent, if it sent one.
    pub(crate) fn sent(&self) -> Option<i32> {
        Some(self.0.load(Ordering::Acquire)).filter(|c| *c != NONE)
    }

    fn record(&self, headers: &http::HeaderMap) {
        // An unparsable value is no status: tonic reports it as its own error.
        if let Some(code) = headers.get(&super::guard::GRPC_STATUS).and_then(|v| v.to_str().ok()?.parse::<i32>().ok()) {
            self.0.store(code, Ordering::Release);
        }
    }
}

/// When a call must have ended, in the request's extensions: a retry
/// carries the time left until then in its `grpc-timeout`, and none starts
/// after it. With a `Probe`, the call records the `grpc-status` the peer
/// sent there (one extension for both: each is an allocation per call).
#[derive(Debug, Clone)]
pub struct CallDeadline {
    /// The deadline.
    pub at: Instant,
    pub(crate) probe: Option<Probe>,
}

impl CallDeadline {
    /// A deadline, with no status probe.
    pub fn new(at: Instant) -> Self {
        Self { at, probe: None }
    }

    /// A deadline whose call records the peer's `grpc-status` in `probe`.
    pub(crate) fn probed(at: Instant, probe: Probe) -> Self {
        Self { at, probe: Some(probe) }
    }
}

/// `grpc-timeout`, a header name of no standard (a static name costs no
/// allocation per call).
const GRPC_TIMEOUT: http::HeaderName = http::HeaderName::from_static("grpc-timeout");

/// Why an attempt provably never reached the service (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NotSent {
    /// No connection could be made.
    Connect,
    /// The connection closed before the request was written.
    Closed,
    /// The service refused the stream (REFUSED_STREAM).
    Refused,
    /// The connection went away (GOAWAY) before this stream was processed.
    GoAway,
}

impl NotSent {
    /// Finds the reason in an error's source chain, from the errors' types
    /// alone.
    pub(crate) fn of(e: &(dyn std::error::Error + 'static)) -> Option<NotSent> {
        let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
        while let Some(err) = next {
            if err.is::<tonic::ConnectError>() {
                return Some(NotSent::Connect);
            }
            if err.is::<super::direct::NotWritten>()
                || err.downcast_ref::<hyper::Error>().is_some_and(hyper::Error::is_canceled)
            {
                return Some(NotSent::Closed);
            }
            if let Some(h2) = err.downcast_ref::<h2::Error>() {
                if h2.is_remote() && h2.is_go_away() {
                    return Some(NotSent::GoAway);
                }
                if h2.is_remote() && h2.is_reset() && h2.reason() == Some(h2::Reason::REFUSED_STREAM) {
                    return Some(NotSent::Refused);
                }
                return None;
            }
            next = err.source();
        }
        None
    }

    /// Whether the address should leave the ready set: it can't be
    /// connected to, or its service is going away (a refused stream is only
    /// load, and a closed connection is made again on the next attempt).
    pub(crate) fn address_down(self) -> bool {
        matches!(self, NotSent::Connect | NotSent::GoAway)
    }

    pub(crate) fn describe(self) -> &'static str {
        match self {
            NotSent::Connect => "could not connect",
            NotSent::Closed => "connection closed before the request was sent",
            NotSent::Refused => "stream refused (REFUSED_STREAM)",
            NotSent::GoAway => "connection going away (GOAWAY)",
        }
    }
}

/// Whether an error broke the connection under a call (an I/O error, or a
/// connection-level HTTP/2 error): the address leaves the ready set until a
/// health check connects again. A stream reset by the service is not one.
fn connection_broke(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = next {
        if let Some(h2) = err.downcast_ref::<h2::Error>() {
            return h2.is_io() || h2.is_go_away();
        }
        if err.is::<std::io::Error>() {
            return true;
        }
        next = err.source();
    }
    false
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

type ResponseFuture = Pin<Box<dyn std::future::Future<Output = Result<http::Response<ProbedBody>, BoxError>> + Send>>;

impl tower::Service<http::Request<Body>> for Peer {
    type Response = http::Response<ProbedBody>;
    type Error = BoxError;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Each attempt waits for its own address's connection.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let pool = self.pool.clone();
        Box::pin(async move {
            let (mut parts, body) = request.into_parts();
            // Read here; the attempts carry no extensions.
            let (deadline, probe) = match parts.extensions.remove::<CallDeadline>() {
                Some(CallDeadline { at, probe }) => (Some(at), probe),
                None => (None, None),
            };
            // Kept for a retry: a unary request is one message, encoded once.
            let body = body.collect().await?.to_bytes();
            // The addresses whose attempt went unsent (filled on a retry only).
            let mut tried = Vec::new();
            let mut attempts = 0;
            let mut last_error = None;
            loop {
                let Some((index, slot)) = pool.pick(&tried) else {
                    return Err(last_error.unwrap_or_else(|| tonic::Status::unavailable("no ready address").into()));
                };
                attempts += 1;
                let mut attempt = rebuild(&parts, body.clone());
                if let Some(at) = deadline {
                    let left = at.saturating_duration_since(Instant::now());
                    if left.is_zero() && attempts > 1 {
                        return Err(tonic::Status::deadline_exceeded("no time left to retry").into());
                    }
                    attempt.headers_mut().insert(GRPC_TIMEOUT, super::grpc_timeout(left));
                }
                // Polled for, if the process busy-polls, until answered.
                let in_flight = pool.poller.as_ref().map(|p| p.call());
                let sent = send(&slot, attempt).await;
                drop(in_flight);
                match sent {
                    Ok(mut response) => {
                        if let Some(p) = &probe {
                            // A trailers-only response carries its status in the headers.
                            p.record(response.headers());
                        }
                        super::guard::guard(response.headers_mut());
                        return Ok(response.map(|inner| ProbedBody { inner, probe, _load: Load::on(slot) }));
                    }
                    Err(e) => {
                        let not_sent = NotSent::of(e.as_ref());
                        let down = match not_sent {
                            Some(why) => why.address_down().then(|| why.describe()),
                            None => connection_broke(e.as_ref()).then_some("connection failed"),
                        };
                        if let Some(why) = down {
                            pool.set_ready(&slot, false, why);
                        }
                        // A single address is tried again (after a reconnect);
                        // otherwise each address once.
                        let more = !pool.single || attempts < SINGLE_ATTEMPTS;
                        match not_sent {
                            Some(why) if more => debug!(
                                endpoint = %pool.name,
                                address = %slot.addr,
                                reason = why.describe(),
                                "retrying a call the service never received"
                            ),
                            _ => return Err(e),
                        }
                        tried.push(index);
                        last_error = Some(e);
                    }
                }
            }
        })
    }
}

/// A copy of a request for one attempt (its extensions were read by the
/// call; the transports need none).
fn rebuild(parts: &http::request::Parts, body: Bytes) -> http::Request<Bytes> {
    let mut request = http::Request::new(body);
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = parts.uri.clone();
    *request.version_mut() = parts.version;
    *request.headers_mut() = parts.headers.clone();
    request
}

/// One attempt on one address.
async fn send(slot: &Arc<Slot>, request: http::Request<Bytes>) -> Result<http::Response<Body>, BoxError> {
    let _load = Load::on(slot.clone());
    match &slot.calls {
        Calls::Direct(direct) => direct.send(request).await,
        #[cfg(test)]
        Calls::Channel(channel) => {
            let request = request.map(|body| Body::new(http_body_util::Full::new(body)));
            use tower::ServiceExt;
            let channel = channel.clone().ready_oneshot().await?;
            Ok(channel.oneshot(request).await?)
        }
    }
}

/// Counts an attempt in flight on a slot while it lives.
#[derive(Debug)]
struct Load(Arc<Slot>);

impl Load {
    fn on(slot: Arc<Slot>) -> Load {
        slot.in_flight.fetch_add(1, Ordering::Relaxed);
        Load(slot)
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A response body that records the `grpc-status` of its trailers, passes
/// them through `guard::guard`, and counts its call on its address
/// until it is read.
#[derive(Debug)]
pub struct ProbedBody {
    inner: Body,
    probe: Option<Probe>,
    _load: Load,
}

impl HttpBody for ProbedBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        let mut polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &mut polled
            && let Some(trailers) = frame.trailers_mut()
        {
            // The status as the peer sent it; then made safe to read.
            if let Some(probe) = &this.probe {
                probe.record(trailers);
            }
            super::guard::guard(trailers);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
