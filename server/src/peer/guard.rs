//! Statuses from peers, made safe to read.
//!
//! tonic reads a call's status with `Status::from_header_map`, which panics
//! when the status's `grpc-status-details-bin` is not base64 (tonic 0.14).
//! A hook, tool or health service must not be able to take down the task
//! that reads its reply: that task is a query's, and a query whose task
//! ended that way would end its stream as if it had succeeded. So every
//! response Lattice reads from a peer passes through [`guard`] first, its
//! headers (a trailers-only reply) and its trailers: such a status is a
//! broken reply, read as INTERNAL with no details, as grpc-go reads it.
//! For a hook that is a failed call, which aborts the query.

use std::{
    pin::Pin,
    task::{Context, Poll},
};

use base64::{
    Engine as _, alphabet,
    engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig},
};
use http_body::{Body as HttpBody, Frame, SizeHint};
use tonic::{
    body::Body,
    codegen::{Bytes, http},
};

// Named once: a lookup by `&str` parses the name every time.
pub(crate) const GRPC_STATUS: http::HeaderName = http::HeaderName::from_static("grpc-status");
const GRPC_MESSAGE: http::HeaderName = http::HeaderName::from_static("grpc-message");
const GRPC_STATUS_DETAILS: http::HeaderName = http::HeaderName::from_static("grpc-status-details-bin");

/// The base64 tonic decodes the details with: the standard alphabet,
/// padded or not.
const DETAILS: GeneralPurpose = GeneralPurpose::new(
    &alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// Replaces a status whose details do not decode with INTERNAL, saying so
/// (the header is dropped). Headers without a status, or whose details
/// decode, are left as they are.
pub(crate) fn guard(headers: &mut http::HeaderMap) {
    // Details are rare: looked for first.
    let Some(details) = headers.get(&GRPC_STATUS_DETAILS) else { return };
    if !headers.contains_key(&GRPC_STATUS) || DETAILS.decode(details.as_bytes()).is_ok() {
        return;
    }
    headers.remove(&GRPC_STATUS_DETAILS);
    headers.insert(GRPC_STATUS, http::HeaderValue::from_static("13"));
    // Percent-encoded, as grpc-message is.
    headers.insert(
        GRPC_MESSAGE,
        http::HeaderValue::from_static("the%20peer%20sent%20a%20malformed%20grpc-status-details-bin"),
    );
}

/// A response body whose trailers pass through [`guard`].
#[derive(Debug)]
pub(crate) struct GuardedBody {
    inner: Body,
}

impl HttpBody for GuardedBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let mut polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &mut polled
            && let Some(trailers) = frame.trailers_mut()
        {
            guard(trailers);
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

/// A service whose responses pass through [`guard`] (headers and
/// trailers): the channel that health checks go over.
#[derive(Debug, Clone)]
pub(crate) struct Guarded<S>(pub S);

impl<S> tower::Service<http::Request<Body>> for Guarded<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<GuardedBody>;
    type Error = S::Error;
    type Future = Pin<Box<dyn std::future::Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let call = self.0.call(request);
        Box::pin(async move {
            let mut response = call.await?;
            guard(response.headers_mut());
            Ok(response.map(|inner| GuardedBody { inner }))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(http::HeaderName, &'static str)]) -> http::HeaderMap {
        let mut map = http::HeaderMap::new();
        for (k, v) in pairs {
            map.insert(k.clone(), http::HeaderValue::from_static(v));
        }
        map
    }

    /// Details that tonic would panic on become INTERNAL; after the guard,
    /// reading the status never panics.
    #[test]
    fn malformed_details_become_internal() {
        for (status, details) in [("0", "%%%"), ("13", "not base64!"), ("5", "QUJD="), ("0", "A")] {
            let mut map = headers(&[(GRPC_STATUS, status), (GRPC_MESSAGE, "said"), (GRPC_STATUS_DETAILS, details)]);
            guard(&mut map);
            let read = tonic::Status::from_header_map(&map);
            let read = read.as_ref().map(|s| (s.code(), s.message(), s.details().is_empty()));
            assert_eq!(
                read,
                Some((tonic::Code::Internal, "the peer sent a malformed grpc-status-details-bin", true)),
                "{status} {details:?}"
            );
        }
    }

    /// Details that decode, padded or not, and headers with no status are
    /// left untouched.
    #[test]
    fn well_formed_details_and_statusless_headers_are_untouched() {
        let cases = [
            headers(&[(GRPC_STATUS, "5"), (GRPC_MESSAGE, "gone"), (GRPC_STATUS_DETAILS, "QUJD")]),
            headers(&[(GRPC_STATUS, "5"), (GRPC_STATUS_DETAILS, "QUI=")]),
            headers(&[(GRPC_STATUS, "5"), (GRPC_STATUS_DETAILS, "QUI")]),
            headers(&[(GRPC_STATUS, "0")]),
            headers(&[(GRPC_STATUS_DETAILS, "%%%"), (http::header::CONTENT_TYPE, "application/grpc")]),
        ];
        for case in cases {
            let mut map = case.clone();
            guard(&mut map);
            assert_eq!(map, case);
        }
        let mut map = headers(&[(GRPC_STATUS, "5"), (GRPC_MESSAGE, "gone"), (GRPC_STATUS_DETAILS, "QUJD")]);
        guard(&mut map);
        let status = tonic::Status::from_header_map(&map).map(|s| (s.code(), s.details().to_vec()));
        assert_eq!(status, Some((tonic::Code::NotFound, b"ABC".to_vec())));
    }
}
