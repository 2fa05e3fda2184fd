//! Hook requests encoded from the chain's own values.
//!
//! Every hook of a chain is sent the same request but for the value, which
//! is what the previous hook passed on. So the fields around the value are
//! encoded once per chain, and the value is encoded from what the chain
//! holds, which the request shares instead of holding a copy of it:
//! - OnToolResult: context, tool name and id, input, error and source once
//!   per result; the result straight from the chain's [`ToolResult`];
//! - OnModelRequest: context, tools and the omitted count once per turn;
//!   the messages converted to protobuf once, and again only after a hook
//!   replaced them (the next hook gets the same list otherwise).
//!
//! On the wire this is exactly prost's encoding of the generated request,
//! fields in number order (tests compare the bytes), so hooks see no
//! difference.

use std::{fmt, sync::Arc};

use http_body_util::BodyExt as _;
use lattice_proto::{agent::v1 as apb, hooks::v1 as pb};
use prost::{
    Message,
    bytes::{Buf, BufMut, BytesMut},
    encoding::{self, DecodeContext, WireType},
};
use tonic::{Code, Status, body::Body, codegen::http};

use crate::{domain::ToolResult, peer::Peer};

/// `OnToolResultRequest.result`.
const RESULT: u32 = 5;
/// `ToolResultBlock.tool_use_id`, `.content` and `.is_error`.
const BLOCK_ID: u32 = 1;
const BLOCK_CONTENT: u32 = 2;
const BLOCK_IS_ERROR: u32 = 3;
/// `TextBlock.text`.
const TEXT: u32 = 1;

/// The encoded fields of a chain's requests before and after the value
/// each hook is given (the same for every hook of the chain).
pub(super) struct Around {
    before: Vec<u8>,
    after: Vec<u8>,
}

impl Around {
    /// Encodes `request`'s fields but its `result` (which is ignored).
    pub(super) fn tool_result(mut request: pb::OnToolResultRequest) -> Arc<Around> {
        request.result = None;
        // Fields 6 and 7 follow the result; 1 to 4 precede it.
        let after = pb::OnToolResultRequest {
            error: request.error.take(),
            source: request.source.take(),
            ..Default::default()
        };
        Arc::new(Around { before: request.encode_to_vec(), after: after.encode_to_vec() })
    }

    /// Encodes `request`'s fields but `system` and `messages` (ignored).
    pub(super) fn model_request(mut request: pb::OnModelRequestRequest) -> Arc<Around> {
        request.system.clear();
        request.messages.clear();
        // Fields 4 and 5 follow the messages; 1 precedes the system prompt.
        let after = pb::OnModelRequestRequest {
            tools: std::mem::take(&mut request.tools),
            omitted_messages: std::mem::take(&mut request.omitted_messages),
            ..Default::default()
        };
        Arc::new(Around { before: request.encode_to_vec(), after: after.encode_to_vec() })
    }

    /// The OnToolResult request that carries `result`.
    pub(super) fn with_result(self: &Arc<Self>, result: Arc<ToolResult>) -> ToolResultRequest {
        ToolResultRequest { around: self.clone(), result }
    }

    /// The OnModelRequest request that carries `system` and `messages`.
    pub(super) fn with_messages(
        self: &Arc<Self>,
        system: &str,
        messages: Arc<Vec<apb::Message>>,
    ) -> ModelRequestRequest {
        ModelRequestRequest { around: self.clone(), system: system.to_owned(), messages }
    }
}

/// An OnToolResult request (see the module docs). Only ever encoded.
#[derive(Clone)]
pub(super) struct ToolResultRequest {
    around: Arc<Around>,
    result: Arc<ToolResult>,
}

impl fmt::Debug for ToolResultRequest {
    // Sizes only: the result is a pre-hook value.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolResultRequest").field("bytes", &self.encoded_len()).finish()
    }
}

/// The length of a `TextBlock` holding `text`.
fn text_block_len(text: &str) -> usize {
    if text.is_empty() {
        0
    } else {
        encoding::key_len(TEXT) + encoding::encoded_len_varint(text.len() as u64) + text.len()
    }
}

/// The length of the `ToolResultBlock` for `r`.
fn block_len(r: &ToolResult) -> usize {
    let id = if r.tool_use_id.is_empty() {
        0
    } else {
        encoding::key_len(BLOCK_ID) + encoding::encoded_len_varint(r.tool_use_id.len() as u64) + r.tool_use_id.len()
    };
    let content: usize = r
        .content
        .iter()
        .map(|t| {
            let len = text_block_len(t);
            encoding::key_len(BLOCK_CONTENT) + encoding::encoded_len_varint(len as u64) + len
        })
        .sum();
    let is_error = if r.is_error { encoding::key_len(BLOCK_IS_ERROR) + 1 } else { 0 };
    id + content + is_error
}

fn put_str(tag: u32, s: &str, buf: &mut impl BufMut) {
    encoding::encode_key(tag, WireType::LengthDelimited, buf);
    encoding::encode_varint(s.len() as u64, buf);
    buf.put_slice(s.as_bytes());
}

impl Message for ToolResultRequest {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        buf.put_slice(&self.around.before);
        let r = &*self.result;
        encoding::encode_key(RESULT, WireType::LengthDelimited, buf);
        encoding::encode_varint(block_len(r) as u64, buf);
        if !r.tool_use_id.is_empty() {
            put_str(BLOCK_ID, &r.tool_use_id, buf);
        }
        for text in &r.content {
            encoding::encode_key(BLOCK_CONTENT, WireType::LengthDelimited, buf);
            encoding::encode_varint(text_block_len(text) as u64, buf);
            if !text.is_empty() {
                put_str(TEXT, text, buf);
            }
        }
        if r.is_error {
            encoding::bool::encode(BLOCK_IS_ERROR, &true, buf);
        }
        buf.put_slice(&self.around.after);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        // Never decoded (Lattice only sends it): skipped like an unknown field.
        encoding::skip_field(wire_type, tag, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        let len = block_len(&self.result);
        self.around.before.len()
            + encoding::key_len(RESULT)
            + encoding::encoded_len_varint(len as u64)
            + len
            + self.around.after.len()
    }

    fn clear(&mut self) {}
}

/// `OnModelRequestRequest.system`.
const SYSTEM: u32 = 2;
/// `OnModelRequestRequest.messages`.
const MESSAGES: u32 = 3;

/// An OnModelRequest request (see the module docs). Only ever encoded.
#[derive(Clone)]
pub(super) struct ModelRequestRequest {
    around: Arc<Around>,
    system: String,
    messages: Arc<Vec<apb::Message>>,
}

impl fmt::Debug for ModelRequestRequest {
    // Sizes only: the messages are pre-hook values.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelRequestRequest").field("bytes", &self.encoded_len()).finish()
    }
}

impl Message for ModelRequestRequest {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        buf.put_slice(&self.around.before);
        if !self.system.is_empty() {
            encoding::string::encode(SYSTEM, &self.system, buf);
        }
        for m in self.messages.iter() {
            encoding::message::encode(MESSAGES, m, buf);
        }
        buf.put_slice(&self.around.after);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        // Never decoded (Lattice only sends it): skipped like an unknown field.
        encoding::skip_field(wire_type, tag, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        let system = if self.system.is_empty() { 0 } else { encoding::string::encoded_len(SYSTEM, &self.system) };
        self.around.before.len()
            + system
            + encoding::message::encoded_len_repeated(MESSAGES, &self.messages)
            + self.around.after.len()
    }

    fn clear(&mut self) {}
}

/// `HookService/OnToolResult`.
pub(super) const ON_TOOL_RESULT: &str = "/lattice.hooks.v1.HookService/OnToolResult";
/// `HookService/OnModelRequest`.
pub(super) const ON_MODEL_REQUEST: &str = "/lattice.hooks.v1.HookService/OnModelRequest";

/// The 5-byte prefix of a gRPC message: compressed flag and length.
const PREFIX: usize = 5;

/// One hook RPC at `path` with a request encoded from shared values
/// (`len` bytes, as the caller measured it for its size check), through
/// `peer` (its retries, deadline and status probe).
///
/// The request is framed here and the reply read here, as tonic's unary
/// client reads one, without its per-call machinery (a codec stream, a
/// `Streaming` decoder and their buffers): a status in the headers
/// (trailers-only) ends the call; a compressed reply, a message over
/// `max_reply` bytes, a reply that does not decode, one cut short or
/// with no message are errors tonic would raise (the same codes, no
/// source, no status from the hook); the status in the trailers, or else
/// the one the HTTP status maps to, decides the call.
pub(super) async fn unary<Req, Resp>(
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
    if let Some(encoding) = parts.headers.get("grpc-encoding")
        && encoding.as_bytes() != b"identity"
    {
        let name = String::from_utf8_lossy(encoding.as_bytes()).into_owned();
        return Err(Status::unimplemented(format!("Content is compressed with `{name}` which isn't supported")));
    }
    if let Some(status) = Status::from_header_map(&parts.headers) {
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

#[cfg(test)]
mod tests {
    use lattice_proto::agent::v1 as apb;

    use super::*;
    use crate::domain::{ResultSource, ToolErrorKind, ToolFailure};

    fn request(result: Option<&ToolResult>, error: bool) -> pb::OnToolResultRequest {
        let failure = ToolFailure { kind: ToolErrorKind::ToolError, message: "the tool reported an error".into() };
        let input = serde_json::json!({"q": "x", "n": [1, 2.5, null, true], "o": {"k": "v"}});
        pb::OnToolResultRequest {
            context: Some(pb::HookContext {
                agent: "a".into(),
                session_id: "s".repeat(32),
                query_id: "q".into(),
                turn: 3,
            }),
            tool_name: "fetch".into(),
            tool_use_id: "toolu_1".into(),
            input: Some(crate::convert::to_struct(input.as_object().unwrap())),
            result: result.map(apb::ToolResultBlock::from),
            error: error.then(|| (&failure).into()),
            source: Some((&ResultSource::ToolService("http://tool:1".into())).into()),
        }
    }

    #[test]
    fn bytes_are_prosts_encoding_of_the_generated_message() {
        let results = [
            ToolResult::text("toolu_1", "plain", false),
            ToolResult::text("toolu_1", "x".repeat(300), true),
            ToolResult::text("toolu_1", "", false),
            ToolResult { tool_use_id: "toolu_1".into(), content: vec![], is_error: false },
            ToolResult {
                tool_use_id: String::new(),
                content: vec!["a".into(), String::new(), "ü".into()],
                is_error: true,
            },
            ToolResult::text("toolu_1", "y".repeat(70_000), false),
        ];
        for (i, result) in results.iter().enumerate() {
            for error in [false, true] {
                let expected = request(Some(result), error).encode_to_vec();
                let shared = Around::tool_result(request(None, error)).with_result(Arc::new(result.clone()));
                assert_eq!(shared.encoded_len(), expected.len(), "result {i}, error {error}");
                assert_eq!(shared.encode_to_vec(), expected, "result {i}, error {error}");
            }
        }
    }

    #[test]
    fn a_request_whose_result_was_left_in_is_sent_without_it_around() {
        let result = ToolResult::text("toolu_1", "old", false);
        let around = Around::tool_result(request(Some(&result), false));
        let new = ToolResult::text("toolu_1", "new", false);
        let decoded =
            pb::OnToolResultRequest::decode(around.with_result(Arc::new(new.clone())).encode_to_vec().as_slice());
        assert_eq!(decoded.unwrap().result, Some(apb::ToolResultBlock::from(&new)));
    }

    fn model_request(system: &str, messages: Vec<apb::Message>) -> pb::OnModelRequestRequest {
        let tools = [crate::domain::ToolSpec {
            name: "fetch".into(),
            description: "gets a page".into(),
            input_schema: serde_json::json!({"type": "object"}).as_object().unwrap().clone(),
        }];
        pb::OnModelRequestRequest {
            context: Some(pb::HookContext { agent: "a".into(), session_id: "s".into(), query_id: "q".into(), turn: 2 }),
            system: system.into(),
            messages,
            tools: tools.iter().map(Into::into).collect(),
            omitted_messages: 7,
        }
    }

    #[test]
    fn model_request_bytes_are_prosts_encoding_of_the_generated_message() {
        use crate::domain::{Block, Message as Msg, Role, ToolUse};
        let conversation = vec![
            Msg::user_text("find it"),
            Msg {
                role: Role::Assistant,
                content: vec![
                    Block::Text { text: "looking".into() },
                    Block::ToolUse(ToolUse {
                        id: "toolu_1".into(),
                        name: "fetch".into(),
                        input: serde_json::json!({"q": "x"}).as_object().unwrap().clone(),
                    }),
                ],
            },
            Msg {
                role: Role::User,
                content: vec![Block::ToolResult(ToolResult::text("toolu_1", "z".repeat(20_000), false))],
            },
        ];
        let cases = [
            ("", vec![]),
            ("be brief", crate::convert::messages_to_pb(&conversation[..1])),
            ("", crate::convert::messages_to_pb(&conversation)),
        ];
        for (i, (system, messages)) in cases.into_iter().enumerate() {
            let expected = model_request(system, messages.clone()).encode_to_vec();
            let shared =
                Around::model_request(model_request("ignored", vec![])).with_messages(system, Arc::new(messages));
            assert_eq!(shared.encoded_len(), expected.len(), "case {i}");
            assert_eq!(shared.encode_to_vec(), expected, "case {i}");
        }
    }

    #[test]
    fn paths_name_the_contracts_service() {
        let service = pb::hook_service_server::SERVICE_NAME;
        assert_eq!(ON_TOOL_RESULT, format!("/{service}/OnToolResult"));
        assert_eq!(ON_MODEL_REQUEST, format!("/{service}/OnModelRequest"));
    }

    #[test]
    fn debug_shows_no_content() {
        let result = ToolResult::text("toolu_1", "secret-value", false);
        let shown = format!("{:?}", Around::tool_result(request(None, false)).with_result(Arc::new(result)));
        assert!(!shown.contains("secret-value"), "{shown}");
        let messages = crate::convert::messages_to_pb(&[crate::domain::Message::user_text("secret-value")]);
        let shown = format!(
            "{:?}",
            Around::model_request(model_request("", vec![])).with_messages("secret-system", Arc::new(messages))
        );
        assert!(!shown.contains("secret-value") && !shown.contains("secret-system"), "{shown}");
    }
}
