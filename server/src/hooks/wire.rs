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

use crate::domain::ToolResult;
use lattice_proto::{agent::v1 as apb, hooks::v1 as pb};
use prost::{
    Message,
    bytes::{Buf, BufMut},
    encoding::{self, DecodeContext, WireType},
};

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
                chain_version: "0123456789abcdef".into(),
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
            context: Some(pb::HookContext {
                agent: "a".into(),
                session_id: "s".into(),
                query_id: "q".into(),
                turn: 2,
                chain_version: "v".into(),
            }),
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
                content: Arc::new([
                    Block::Text { text: "looking".into() },
                    Block::ToolUse(ToolUse {
                        id: "toolu_1".into(),
                        name: "fetch".into(),
                        input: serde_json::json!({"q": "x"}).as_object().unwrap().clone(),
                    }),
                ]),
            },
            Msg {
                role: Role::User,
                content: Arc::new([Block::ToolResult(ToolResult::text("toolu_1", "z".repeat(20_000), false))]),
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
