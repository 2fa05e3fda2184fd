//! The codec of every Lattice service: prost's, except that a **request**
//! that does not decode is the caller's error, and buffers are sized to
//! the message.
//!
//! tonic's prost codec answers any message that does not decode with
//! INTERNAL, as if the server had failed. A request that isn't a valid
//! `QueryRequest` (or any other request of the contract) is the client's
//! mistake, so the server answers INVALID_ARGUMENT, naming the type and
//! never repeating the bytes. A reply that does not decode stays INTERNAL.
//! Which messages are requests is said here, per type: the list must name
//! every message a service of the contract receives or returns, or the
//! generated code does not compile.
//!
//! tonic's prost codec allocates 8 KiB for every call's outgoing and
//! incoming messages before it knows their sizes; on a loopback hook call
//! those were the call's largest allocations, and glibc serves blocks of
//! that size from its slow, sorted bins. Here a message reserves exactly
//! its encoded size, and a buffer for incoming messages starts empty and
//! takes the size of the frames that arrive. The wire format is the same.

use std::marker::PhantomData;

use prost::Message;
use tonic::{
    Status,
    codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder},
};
use tonic_prost::{ProstCodec, ProstDecoder};

/// What tonic allocates up front for a call's messages: nothing (see the
/// module docs).
const UP_FRONT: usize = 0;

/// tonic's default: a stream of messages yields to the runtime after this
/// many encoded bytes.
const YIELD_THRESHOLD: usize = 32 * 1024;

fn buffer_settings() -> BufferSettings {
    BufferSettings::new(UP_FRONT, YIELD_THRESHOLD)
}

/// A message of the contract that a service receives or returns.
pub trait Payload {
    /// The message's full proto name.
    const NAME: &'static str;
    /// Whether it is a request (a client sends it, a server decodes it).
    const REQUEST: bool;
}

/// The generated services' codec (see the module docs).
#[derive(Debug, Clone)]
pub struct LatticeCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for LatticeCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for LatticeCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Payload + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = SizedEncoder<T>;
    type Decoder = PayloadDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        SizedEncoder(PhantomData)
    }

    fn decoder(&mut self) -> Self::Decoder {
        PayloadDecoder(ProstCodec::<T, U>::raw_decoder(buffer_settings()))
    }
}

/// prost's encoding, into a buffer grown once, to the message's size.
#[derive(Debug)]
pub struct SizedEncoder<T>(PhantomData<fn(T)>);

impl<T: Message> Encoder for SizedEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        buf.reserve(item.encoded_len());
        item.encode_raw(buf);
        Ok(())
    }

    fn buffer_settings(&self) -> BufferSettings {
        buffer_settings()
    }
}

/// prost's decoder, with a request's decode error made INVALID_ARGUMENT.
#[derive(Debug)]
pub struct PayloadDecoder<U>(ProstDecoder<U>);

impl<U: Message + Default + Payload> Decoder for PayloadDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0.decode(buf).map_err(|status| {
            if U::REQUEST {
                Status::invalid_argument(format!("the request does not decode as {}", U::NAME))
            } else {
                status
            }
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

macro_rules! payloads {
    ($request:literal: $($ty:path => $name:literal),* $(,)?) => {
        $(impl Payload for $ty {
            const NAME: &'static str = $name;
            const REQUEST: bool = $request;
        })*
    };
}

payloads!(true:
    crate::agent::v1::QueryRequest => "lattice.agent.v1.QueryRequest",
    crate::agent::v1::ListAgentsRequest => "lattice.agent.v1.ListAgentsRequest",
    crate::agent::v1::GetAgentRequest => "lattice.agent.v1.GetAgentRequest",
    crate::agent::v1::GetSessionRequest => "lattice.agent.v1.GetSessionRequest",
    crate::agent::v1::DeleteSessionRequest => "lattice.agent.v1.DeleteSessionRequest",
    crate::agent::v1::TestHooksRequest => "lattice.agent.v1.TestHooksRequest",
    crate::hooks::v1::OnToolResultRequest => "lattice.hooks.v1.OnToolResultRequest",
    crate::hooks::v1::OnModelRequestRequest => "lattice.hooks.v1.OnModelRequestRequest",
    crate::tools::v1::ListToolsRequest => "lattice.tools.v1.ListToolsRequest",
    crate::tools::v1::CallToolRequest => "lattice.tools.v1.CallToolRequest",
);

payloads!(false:
    crate::agent::v1::QueryEvent => "lattice.agent.v1.QueryEvent",
    crate::agent::v1::ListAgentsResponse => "lattice.agent.v1.ListAgentsResponse",
    crate::agent::v1::Agent => "lattice.agent.v1.Agent",
    crate::agent::v1::Session => "lattice.agent.v1.Session",
    crate::agent::v1::DeleteSessionResponse => "lattice.agent.v1.DeleteSessionResponse",
    crate::agent::v1::TestHooksResponse => "lattice.agent.v1.TestHooksResponse",
    crate::hooks::v1::OnToolResultResponse => "lattice.hooks.v1.OnToolResultResponse",
    crate::hooks::v1::OnModelRequestResponse => "lattice.hooks.v1.OnModelRequestResponse",
    crate::tools::v1::ListToolsResponse => "lattice.tools.v1.ListToolsResponse",
    crate::tools::v1::CallToolResponse => "lattice.tools.v1.CallToolResponse",
);
