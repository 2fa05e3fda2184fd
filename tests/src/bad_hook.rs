//! A hook service whose replies do not decode: it answers OnToolResult and
//! OnModelRequest with a message whose field 1 is a varint where the
//! contract has a message. A peer that speaks gRPC but not our contract.

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
