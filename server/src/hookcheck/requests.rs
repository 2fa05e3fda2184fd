//! The requests `lattice hook check` sends: each kind of tool result, first
//! and long conversations, and values sized near the message limit.

use super::*;

/// The kinds of tool result a hook sees.
#[derive(Debug, Clone, Copy)]
pub(super) enum ToolKind {
    Executed,
    Failed,
    Blocked,
    Cancelled,
}

impl ToolKind {
    pub(super) const ALL: [ToolKind; 4] =
        [ToolKind::Executed, ToolKind::Failed, ToolKind::Blocked, ToolKind::Cancelled];

    pub(super) fn name(self) -> &'static str {
        match self {
            ToolKind::Executed => "executed",
            ToolKind::Failed => "failed",
            ToolKind::Blocked => "blocked",
            ToolKind::Cancelled => "cancelled",
        }
    }
}

pub(super) fn context(turn: u32) -> pb::HookContext {
    pb::HookContext {
        agent: "hook-check".into(),
        session_id: "00000000-0000-4000-8000-000000000000".into(),
        query_id: "00000000-0000-4000-8000-000000000001".into(),
        turn,
        chain_version: "hook-check".into(),
    }
}

pub(super) const TOOL_USE_ID: &str = "toolu_hookcheck_1";

pub(super) fn tool_result_request(kind: ToolKind, text: &str) -> pb::OnToolResultRequest {
    use pb::{SourceKind as S, ToolErrorKind as K};
    let (is_error, error, source) = match kind {
        ToolKind::Executed => (false, None, (S::ToolService, "http://tools:50061")),
        ToolKind::Failed => {
            (true, Some((K::RpcFailed, "the tool's RPC failed: UNAVAILABLE")), (S::ToolService, "http://tools:50061"))
        }
        ToolKind::Blocked => {
            (true, Some((K::PermissionDenied, "tool call blocked by the agent's permissions")), (S::Lattice, ""))
        }
        ToolKind::Cancelled => {
            (true, Some((K::Cancelled, "the query was aborted while the call ran")), (S::Lattice, ""))
        }
    };
    let mut input = prost_types::Struct::default();
    input.fields.insert(
        "city".into(),
        prost_types::Value { kind: Some(prost_types::value::Kind::StringValue("Paris".into())) },
    );
    pb::OnToolResultRequest {
        context: Some(context(1)),
        tool_name: "lookup".into(),
        tool_use_id: TOOL_USE_ID.into(),
        input: Some(input),
        result: Some(apb::ToolResultBlock {
            tool_use_id: TOOL_USE_ID.into(),
            content: vec![apb::TextBlock { text: text.into() }],
            is_error,
        }),
        error: error.map(|(kind, message)| pb::ToolError { kind: kind as i32, message: message.into() }),
        source: Some(pb::ResultSource { kind: source.0 as i32, name: source.1.into() }),
    }
}

pub(super) fn user(text: &str) -> apb::Message {
    apb::Message { role: apb::Role::User as i32, content: vec![text_block(text)] }
}

pub(super) fn text_block(text: &str) -> apb::ContentBlock {
    apb::ContentBlock { block: Some(apb::content_block::Block::Text(apb::TextBlock { text: text.into() })) }
}

/// A conversation of a user prompt and `rounds` tool calls, each answered
/// with `output`, ending with the user's tool results.
pub(super) fn conversation(rounds: usize, output: &str) -> Vec<apb::Message> {
    use apb::content_block::Block;
    let mut messages = vec![user("Look this up, please.")];
    for i in 0..rounds {
        let id = format!("toolu_hookcheck_{i}");
        let mut input = prost_types::Struct::default();
        input
            .fields
            .insert("n".into(), prost_types::Value { kind: Some(prost_types::value::Kind::NumberValue(i as f64)) });
        messages.push(apb::Message {
            role: apb::Role::Assistant as i32,
            content: vec![
                text_block("Let me look."),
                apb::ContentBlock {
                    block: Some(Block::ToolUse(apb::ToolUseBlock {
                        id: id.clone(),
                        name: "lookup".into(),
                        input: Some(input),
                    })),
                },
            ],
        });
        messages.push(apb::Message {
            role: apb::Role::User as i32,
            content: vec![apb::ContentBlock {
                block: Some(Block::ToolResult(apb::ToolResultBlock {
                    tool_use_id: id,
                    content: vec![apb::TextBlock { text: output.into() }],
                    is_error: false,
                })),
            }],
        });
    }
    messages
}

pub(super) fn model_request(turn: u32, messages: Vec<apb::Message>) -> pb::OnModelRequestRequest {
    pb::OnModelRequestRequest {
        context: Some(context(turn)),
        system: "You are a helpful assistant.".into(),
        messages,
        tools: vec![apb::ToolSpec {
            name: "lookup".into(),
            description: "Looks a thing up.".into(),
            input_schema: None,
        }],
        omitted_messages: 0,
    }
}

/// A request whose encoding is a little under `limit`: `make` builds it
/// around a text, sized here.
pub(super) fn near_limit<R: prost::Message>(limit: usize, make: impl Fn(&str) -> R) -> R {
    let overhead = make("").encoded_len() + 16;
    // Room for a reply that grows the value a little, too.
    let size = limit.saturating_sub(overhead).saturating_sub(limit / 64);
    make(&"x".repeat(size))
}
