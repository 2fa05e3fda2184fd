//! Peers that speak gRPC but break the contract or the protocol:
//! - [`BadHook`]: a hook service whose replies do not decode: it answers
//!   OnToolResult and OnModelRequest with a message whose field 1 is a
//!   varint where the contract has a message;
//! - [`MalformedStatus`]: a service answering every call (hook or tool)
//!   with an OK status whose `grpc-status-details-bin` is not base64.

use std::{
    convert::Infallible,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use crate::Background;
use tonic::{
    Status,
    body::Body,
    codegen::http,
    server::{Grpc, NamedService, UnaryService},
};
use tonic_prost::ProstCodec;

/// The wrong reply.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Garbage {
    /// A varint on field 1 (a message there in the contract).
    #[prost(uint64, tag = "1")]
    pub result: u64,
}

/// Any request (its fields are skipped).
#[derive(Clone, PartialEq, prost::Message)]
pub struct AnyRequest {}

#[derive(Clone)]
struct Answer;

impl UnaryService<AnyRequest> for Answer {
    type Response = Garbage;
    type Future = Pin<Box<dyn Future<Output = Result<tonic::Response<Garbage>, Status>> + Send>>;
    fn call(&mut self, _: tonic::Request<AnyRequest>) -> Self::Future {
        Box::pin(async { Ok(tonic::Response::new(Garbage { result: 7 })) })
    }
}

#[derive(Clone)]
struct Svc;

impl NamedService for Svc {
    const NAME: &'static str = "lattice.hooks.v1.HookService";
}

impl tower::Service<http::Request<Body>> for Svc {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }
    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        Box::pin(async move {
            let mut grpc = Grpc::new(ProstCodec::<Garbage, AnyRequest>::default());
            Ok(grpc.unary(Answer, req).await)
        })
    }
}

/// A running undecodable hook.
pub struct BadHook {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    _server: Background,
}

impl BadHook {
    /// Starts it.
    pub async fn start() -> BadHook {
        let (listener, addr) = crate::bind().await;
        let server = Background::serve(listener, tonic::service::Routes::new(Svc));
        BadHook { url: format!("http://{addr}"), _server: server }
    }
}

/// Where [`MalformedStatus`] puts its status.
#[derive(Debug, Clone, Copy)]
pub enum StatusIn {
    /// An empty reply message, then trailers.
    Trailers,
    /// The response headers alone (a trailers-only reply).
    Headers,
}

/// A running peer whose every reply carries `grpc-status: 0` with a
/// `grpc-status-details-bin` that is not base64, on any path.
pub struct MalformedStatus {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    _server: Background,
}

impl MalformedStatus {
    /// The value sent as `grpc-status-details-bin`.
    pub const DETAILS: &'static str = "%%% not base64 %%%";

    /// Starts it, served by hyper alone (tonic's server writes statuses
    /// only from a `Status`).
    pub async fn start(status_in: StatusIn) -> MalformedStatus {
        use http_body_util::StreamBody;
        use hyper::body::Frame;
        type Frames =
            StreamBody<futures_util::stream::Iter<std::vec::IntoIter<Result<Frame<bytes::Bytes>, Infallible>>>>;

        let (listener, addr) = crate::bind().await;
        let status = move || {
            let mut map = http::HeaderMap::new();
            map.insert("grpc-status", http::HeaderValue::from_static("0"));
            map.insert("grpc-status-details-bin", http::HeaderValue::from_static(Self::DETAILS));
            map
        };
        let answer = hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| async move {
            use http_body_util::BodyExt as _;
            // The whole request first, as a real service reads it.
            let _ = request.into_body().collect().await;
            let mut response = http::Response::new(Frames::new(futures_util::stream::iter(match status_in {
                // An empty message: every reply of the contracts decodes from it.
                StatusIn::Trailers => {
                    vec![Ok(Frame::data(bytes::Bytes::from_static(&[0, 0, 0, 0, 0]))), Ok(Frame::trailers(status()))]
                }
                StatusIn::Headers => vec![],
            })));
            response.headers_mut().insert("content-type", http::HeaderValue::from_static("application/grpc"));
            if let StatusIn::Headers = status_in {
                response.headers_mut().extend(status());
            }
            Ok::<_, Infallible>(response)
        });
        MalformedStatus { url: format!("http://{addr}"), _server: Background::serve_h2(listener, answer) }
    }
}
