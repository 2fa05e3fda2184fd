//! The hook client's transport: a [`Channel`] that also reports which
//! `grpc-status` the hook itself sent.
//!
//! tonic hands a client one `Status` type for everything: a status the peer
//! sent in its trailers, and errors tonic raised itself (a reply that does
//! not decode or is too large, a stream that ended early, a connection that
//! broke). Telling them apart by message text would let a hook pick its own
//! classification ("failed to decode …"), so the transport records the
//! `grpc-status` it saw on the wire in a [`Probe`] carried by the request's
//! extensions, and the chain decides from that and from the error's source
//! chain alone.

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicI32, Ordering},
    },
    task::{Context, Poll},
};

use http_body::{Body as HttpBody, Frame, SizeHint};
use tonic::{
    body::Body,
    codegen::{Bytes, http},
    transport::Channel,
};

/// No `grpc-status` seen yet.
const NONE: i32 = -1;

/// The `grpc-status` a hook sent for one call, if any. Cloned into the
/// request's extensions; the transport fills it in.
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
        if let Some(code) = headers.get("grpc-status").and_then(|v| v.to_str().ok()?.parse::<i32>().ok()) {
            self.0.store(code, Ordering::Release);
        }
    }
}

/// A [`Channel`] that fills in each request's [`Probe`].
#[derive(Debug, Clone)]
pub struct HookTransport {
    inner: Channel,
}

impl HookTransport {
    /// Wraps a channel (to a remote hook, or an in-process one in tests).
    pub fn new(inner: Channel) -> Self {
        Self { inner }
    }
}

type ResponseFuture =
    Pin<Box<dyn std::future::Future<Output = Result<http::Response<ProbedBody>, tonic::transport::Error>> + Send>>;

impl tower::Service<http::Request<Body>> for HookTransport {
    type Response = http::Response<ProbedBody>;
    type Error = tonic::transport::Error;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        tower::Service::poll_ready(&mut self.inner, cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let probe = request.extensions().get::<Probe>().cloned();
        let response = tower::Service::call(&mut self.inner, request);
        Box::pin(async move {
            let response = response.await?;
            if let Some(p) = &probe {
                // A trailers-only response carries its status in the headers.
                p.record(response.headers());
            }
            Ok(response.map(|inner| ProbedBody { inner, probe }))
        })
    }
}

/// A response body that records the `grpc-status` of its trailers.
#[derive(Debug)]
pub struct ProbedBody {
    inner: Body,
    probe: Option<Probe>,
}

impl HttpBody for ProbedBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let (Poll::Ready(Some(Ok(frame))), Some(probe)) = (&polled, &this.probe)
            && let Some(trailers) = frame.trailers_ref()
        {
            probe.record(trailers);
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
