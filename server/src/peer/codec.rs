//! The codec of Lattice's own calls to hooks and tools: prost, with buffers
//! sized to the message.
//!
//! tonic's default codec allocates 8 KiB for each call's request and 8 KiB
//! for its reply before it knows their sizes: on a loopback hook call that
//! was the largest allocation of the call, and glibc serves such blocks
//! from its slow, sorted bins. Here a request reserves its exact encoded
//! size, and a reply's buffer starts empty and takes the size of the frames
//! that arrive. The messages and their wire format are the same.

use std::marker::PhantomData;

use prost::Message;
use tonic::{
    Status,
    codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder},
};

/// How much tonic allocates up front for a call's request or reply: none
/// (see the module docs).
const UP_FRONT: usize = 0;

/// tonic's default: a stream of messages yields to the runtime after this
/// many encoded bytes.
const YIELD_THRESHOLD: usize = 32 * 1024;

fn settings() -> BufferSettings {
    BufferSettings::new(UP_FRONT, YIELD_THRESHOLD)
}

/// A prost codec for requests `E` and replies `D`.
#[derive(Debug)]
pub(crate) struct Sized<E, D>(PhantomData<fn(E) -> D>);

impl<E, D> Default for Sized<E, D> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<E, D> Codec for Sized<E, D>
where
    E: Message + Send + 'static,
    D: Message + Default + Send + 'static,
{
    type Encode = E;
    type Decode = D;
    type Encoder = SizedEncoder<E>;
    type Decoder = SizedDecoder<D>;

    fn encoder(&mut self) -> Self::Encoder {
        SizedEncoder(PhantomData)
    }

    fn decoder(&mut self) -> Self::Decoder {
        SizedDecoder(PhantomData)
    }
}

/// Encodes into a buffer grown once, to the message's size.
#[derive(Debug)]
pub(crate) struct SizedEncoder<E>(PhantomData<fn(E)>);

impl<E: Message> Encoder for SizedEncoder<E> {
    type Item = E;
    type Error = Status;

    fn encode(&mut self, item: E, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        buf.reserve(item.encoded_len());
        item.encode_raw(buf);
        Ok(())
    }

    fn buffer_settings(&self) -> BufferSettings {
        settings()
    }
}

/// Decodes a reply; its buffer is as large as what arrived.
#[derive(Debug)]
pub(crate) struct SizedDecoder<D>(PhantomData<fn() -> D>);

impl<D: Message + Default> Decoder for SizedDecoder<D> {
    type Item = D;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<D>, Status> {
        // The same error tonic's own codec gives for a reply that does not
        // decode (the hook chain classifies it by its structure).
        D::decode(buf).map(Some).map_err(|e| Status::internal(e.to_string()))
    }

    fn buffer_settings(&self) -> BufferSettings {
        settings()
    }
}

/// One unary call through `grpc` with this codec: what a generated
/// client's method does, with sized buffers.
pub(crate) async fn unary<E, D>(
    grpc: &mut tonic::client::Grpc<super::Peer>,
    path: &'static str,
    request: tonic::Request<E>,
) -> Result<tonic::Response<D>, Status>
where
    E: Message + Send + Sync + 'static,
    D: Message + Default + Send + Sync + 'static,
{
    // A Peer is always ready (each attempt waits for its own connection).
    grpc.ready().await.map_err(|e| Status::unknown(format!("the transport was not ready: {e}")))?;
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(path);
    grpc.unary(request, path, Sized::<E, D>::default()).await
}
