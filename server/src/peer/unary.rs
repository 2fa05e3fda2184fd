//! One unary call over a [`Peer`], framed and read here.
//!
//! Hook and tool calls are unary. tonic's client runs each through a codec
//! stream and a `Streaming` decoder with buffers of their own; this frames
//! the request into one buffer and reads the reply as tonic's unary client
//! does, with the same errors (see [`unary`]).

use http_body_util::BodyExt as _;
use prost::{
    Message,
    bytes::{Buf, BufMut, BytesMut},
};
use tonic::{Code, Status, body::Body, codegen::http};

use super::{Peer, guard::GRPC_STATUS};

const GRPC_ENCODING: http::HeaderName = http::HeaderName::from_static("grpc-encoding");

/// The 5-byte prefix of a gRPC message: compressed flag and length.
const PREFIX: usize = 5;

/// One unary RPC at `path` with `request` (`len` bytes, as the caller
/// measured it for its size check), through `peer` (its retries, deadline
/// and status probe).
///
/// The request is framed here and the reply read here, as tonic's unary
/// client reads one, without its per-call machinery (a codec stream, a
/// `Streaming` decoder and their buffers): a status in the headers
/// (trailers-only) ends the call; a compressed reply, a message over
/// `max_reply` bytes, a reply that does not decode, one cut short or
/// with no message are errors tonic would raise (the same codes, no
/// source, no status from the peer); the status in the trailers, or else
/// the one the HTTP status maps to, decides the call.
pub(crate) async fn unary<Req, Resp>(
    mut peer: Peer,
    path: &'static str,
    request: tonic::Request<Req>,
    len: usize,
    max_reply: usize,
) -> Result<tonic::Response<Resp>, Status>
where
    Req: Message,
    Resp: Message + Default,
{
    use tower::Service as _;

    let (metadata, extensions, message) = request.into_parts();
    let len32 = u32::try_from(len).map_err(|_| Status::resource_exhausted("the request exceeds 4 GiB"))?;
    let mut framed = BytesMut::with_capacity(PREFIX + len);
    framed.put_u8(0);
    framed.put_u32(len32);
    message.encode_raw(&mut framed);
    let mut http = http::Request::new(Body::new(http_body_util::Full::new(framed.freeze())));
    *http.method_mut() = http::Method::POST;
    *http.uri_mut() = http::Uri::from_static(path);
    *http.version_mut() = http::Version::HTTP_2;
    *http.headers_mut() = metadata.into_headers();
    http.headers_mut().insert(http::header::TE, http::HeaderValue::from_static("trailers"));
    http.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/grpc"));
    *http.extensions_mut() = extensions;

    let response = peer.call(http).await.map_err(Status::from_error)?;
    let (parts, mut body) = response.into_parts();
    if let Some(encoding) = parts.headers.get(&GRPC_ENCODING)
        && encoding.as_bytes() != b"identity"
    {
        let name = String::from_utf8_lossy(encoding.as_bytes()).into_owned();
        return Err(Status::unimplemented(format!("Content is compressed with `{name}` which isn't supported")));
    }
    // Looked for by its parsed name first: tonic's lookup parses it.
    if parts.headers.contains_key(&GRPC_STATUS)
        && let Some(status) = Status::from_header_map(&parts.headers)
    {
        return Err(if status.code() == Code::Ok { Status::internal("Missing response message.") } else { status });
    }
    let mut buf = BytesMut::new();
    let mut reply = None;
    let trailers = loop {
        let Some(frame) = body.frame().await else {
            if !buf.is_empty() {
                return Err(Status::internal("Unexpected EOF decoding stream."));
            }
            break None;
        };
        match frame?.into_data() {
            Ok(data) => {
                buf.extend_from_slice(&data);
                // Messages after the first are decoded (one that doesn't
                // fails the call, as with tonic) and dropped.
                while let Some(message) = next_message::<Resp>(&mut buf, max_reply)? {
                    reply.get_or_insert(message);
                }
            }
            Err(frame) => break frame.into_trailers().ok(),
        }
    };
    final_status(trailers.as_ref(), parts.status)?;
    reply.map(tonic::Response::new).ok_or_else(|| Status::internal("Missing response message."))
}

/// The next whole message in `buf`, taken out of it; `None` until one has
/// arrived. Its length is checked as soon as its prefix is there.
fn next_message<M: Message + Default>(buf: &mut BytesMut, max: usize) -> Result<Option<M>, Status> {
    let Some(prefix) = buf.get(..PREFIX) else { return Ok(None) };
    match prefix[0] {
        0 => {}
        1 => {
            return Err(Status::internal(
                "protocol error: received message with compressed-flag but no grpc-encoding was specified",
            ));
        }
        flag => {
            return Err(Status::internal(format!(
                "protocol error: received message with invalid compression flag: {flag} (valid flags are 0 and 1)"
            )));
        }
    }
    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    if len > max {
        return Err(Status::out_of_range(format!(
            "Error, decoded message length too large: found {len} bytes, the limit is: {max} bytes"
        )));
    }
    if buf.len() < PREFIX + len {
        buf.reserve(PREFIX + len - buf.len());
        return Ok(None);
    }
    buf.advance(PREFIX);
    let message = buf.split_to(len).freeze();
    M::decode(message).map(Some).map_err(|e| Status::internal(e.to_string()))
}

/// How the reply ended: the `grpc-status` of its trailers, or else its
/// HTTP status mapped as gRPC maps it (a 200 without a status is UNKNOWN:
/// a stream cut short).
fn final_status(trailers: Option<&http::HeaderMap>, http: http::StatusCode) -> Result<(), Status> {
    // The usual end, told without building a `Status` (which copies the
    // trailers into its metadata).
    if trailers.and_then(|t| t.get(&GRPC_STATUS)).is_some_and(|s| s.as_bytes() == b"0") {
        return Ok(());
    }
    if let Some(status) = trailers.and_then(Status::from_header_map) {
        return if status.code() == Code::Ok { Ok(()) } else { Err(status) };
    }
    let code = match http {
        http::StatusCode::OK => {
            return Err(Status::unknown(
                "protocol error: missing grpc-status trailer, stream was terminated without a final status",
            ));
        }
        http::StatusCode::BAD_REQUEST => Code::Internal,
        http::StatusCode::UNAUTHORIZED => Code::Unauthenticated,
        http::StatusCode::FORBIDDEN => Code::PermissionDenied,
        http::StatusCode::NOT_FOUND => Code::Unimplemented,
        http::StatusCode::TOO_MANY_REQUESTS
        | http::StatusCode::BAD_GATEWAY
        | http::StatusCode::SERVICE_UNAVAILABLE
        | http::StatusCode::GATEWAY_TIMEOUT => Code::Unavailable,
        _ => Code::Unknown,
    };
    Err(Status::new(code, format!("grpc-status header missing, mapped from HTTP status code {}", http.as_u16())))
}
