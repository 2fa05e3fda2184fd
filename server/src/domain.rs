//! The server's own conversation types. The agent loop, the models and the
//! hook chain speak these; proto types exist only at the edges (`convert`).

use std::{borrow::Cow, sync::Arc};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// A JSON object (tool input, input schema).
pub type JsonObject = Map<String, Value>;

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The prompt and tool results.
    User,
    /// The model's replies.
    Assistant,
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// Who wrote it.
    pub role: Role,
    /// Its blocks, in order.
    pub content: Arc<[Block]>,
}

/// One content block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Block {
    /// Plain text.
    Text {
        /// The text.
        text: String,
    },
    /// A tool call requested by the model.
    ToolUse(ToolUse),
    /// The answer to a tool call.
    ToolResult(ToolResult),
}

/// A tool call requested by the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolUse {
    /// Unique within the conversation.
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The model's input.
    pub input: JsonObject,
}

/// The result of a tool call, as the model sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolResult {
    /// The tool_use it answers.
    pub tool_use_id: String,
    /// Text blocks.
    pub content: Vec<String>,
    /// Whether the call failed (or a hook says so).
    pub is_error: bool,
}

impl ToolResult {
    /// A one-text-block result.
    pub fn text(tool_use_id: &str, text: impl Into<String>, is_error: bool) -> Self {
        Self { tool_use_id: tool_use_id.to_owned(), content: vec![text.into()], is_error }
    }

    /// Total text length in bytes (for logs: sizes, never content).
    pub fn len(&self) -> usize {
        self.content.iter().map(String::len).sum()
    }

    /// True when there is no text at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A tool offered to the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    /// The name the model calls it by.
    pub name: String,
    /// What it does.
    pub description: String,
    /// JSON Schema of its input.
    pub input_schema: JsonObject,
}

/// What is sent to the model for one turn. It borrows the agent's system
/// prompt and the conversation where it can (a turn copies neither), and
/// owns what a hook replaced.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct ModelRequest<'a> {
    /// The system prompt.
    pub system: Cow<'a, str>,
    /// The conversation.
    pub messages: Cow<'a, [Message]>,
    /// The tools offered (the agent's, shared by every request).
    pub tools: Arc<[ToolSpec]>,
}

/// Why the model stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// It finished.
    EndTurn,
    /// It asks for tools.
    ToolUse,
    /// Output token limit.
    MaxTokens,
    /// A stop sequence.
    StopSequence,
    /// The agent's max_turns was reached (set by the loop, never by a model).
    MaxTurns,
}

/// Token counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Usage {
    /// Tokens read.
    pub input_tokens: u64,
    /// Tokens written.
    pub output_tokens: u64,
}

impl std::ops::AddAssign for Usage {
    fn add_assign(&mut self, rhs: Self) {
        self.input_tokens += rhs.input_tokens;
        self.output_tokens += rhs.output_tokens;
    }
}

/// The model's reply for one turn.
#[derive(Debug, Clone, PartialEq)]
pub struct AssistantReply {
    /// Text and tool_use blocks.
    pub content: Arc<[Block]>,
    /// Why it stopped.
    pub stop_reason: StopReason,
    /// Tokens used by this request.
    pub usage: Usage,
}

impl AssistantReply {
    /// The tool calls it asks for, in order.
    pub fn tool_uses(&self) -> impl Iterator<Item = &ToolUse> {
        self.content.iter().filter_map(|b| match b {
            Block::ToolUse(t) => Some(t),
            _ => None,
        })
    }
}

impl Message {
    /// A user message with one text block.
    pub fn user_text(text: impl Into<String>) -> Self {
        Self { role: Role::User, content: Arc::new([Block::Text { text: text.into() }]) }
    }

    /// The concatenated text blocks.
    pub fn text(&self) -> String {
        text_of(&self.content)
    }

    /// About its size encoded: the bytes of its texts, ids and names, and
    /// of its tool inputs as compact JSON. Either encoding adds a little
    /// (tags, lengths, quotes) to this; what paging a stored conversation
    /// measures a page by.
    pub fn size(&self) -> usize {
        self.content
            .iter()
            .map(|block| match block {
                Block::Text { text } => text.len(),
                Block::ToolUse(u) => u.id.len() + u.name.len() + json_len(&u.input),
                Block::ToolResult(r) => r.tool_use_id.len() + r.content.iter().map(String::len).sum::<usize>(),
            })
            .sum()
    }
}

/// The length of `value` as compact JSON, counted as it is written.
fn json_len(value: &JsonObject) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Writing to a counter does not fail, nor does serializing a map of
    // JSON values.
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}

/// Why a tool call did not execute successfully, as the hooks are told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolErrorKind {
    /// The tool answered `is_error`.
    ToolError,
    /// Its RPC failed.
    RpcFailed,
    /// It did not answer in time.
    Deadline,
    /// The agent may not call it.
    PermissionDenied,
    /// Over the per-reply limit.
    BatchLimit,
    /// No such tool.
    UnknownTool,
    /// The query was aborted while it ran.
    Cancelled,
    /// A delegated agent could not run.
    Delegation,
}

/// A tool call's failure: its kind and a short description (no tool output).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolFailure {
    /// The kind.
    pub kind: ToolErrorKind,
    /// What happened.
    pub message: String,
}

/// What produced a tool result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResultSource {
    /// A remote tool service, by endpoint.
    ToolService(String),
    /// A delegated agent, by name.
    DelegatedAgent(String),
    /// Lattice itself (blocked, unknown, cancelled).
    Lattice,
}

/// The concatenated text blocks of a content list.
pub fn text_of(content: &[Block]) -> String {
    let mut out = String::new();
    for b in content {
        if let Block::Text { text } = b {
            out.push_str(text);
        }
    }
    out
}

/// Checks the pairing rules the model APIs enforce: the conversation starts
/// with a user message, roles alternate, no message is empty, tool_use blocks
/// appear only in assistant messages and each is answered by exactly one
/// tool_result in the next (user) message, and every tool_result answers a
/// tool_use of the message before it. An empty list is valid.
///
/// The error names positions only: never content, nor ids (which, in a
/// hook's reply, could hold anything).
pub fn validate_conversation(messages: &[Message]) -> Result<(), String> {
    let mut pending: Vec<&str> = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        if i == 0 && m.role != Role::User {
            return Err("the first message must have role user".into());
        }
        if i > 0 && messages[i - 1].role == m.role {
            return Err(format!("messages {} and {i} have the same role; roles must alternate", i - 1));
        }
        if m.content.is_empty() {
            return Err(format!("message {i} has no content"));
        }
        let mut answered: Vec<&str> = Vec::new();
        for (j, b) in m.content.iter().enumerate() {
            match (b, m.role) {
                (Block::ToolUse(_), Role::User) => {
                    return Err(format!("message {i} (user) block {j} is a tool_use"));
                }
                (Block::ToolResult(_), Role::Assistant) => {
                    return Err(format!("message {i} (assistant) block {j} is a tool_result"));
                }
                (Block::ToolResult(r), Role::User) => {
                    if !pending.contains(&r.tool_use_id.as_str()) {
                        return Err(format!(
                            "message {i} block {j}: a tool_result answers no tool_use of the previous message"
                        ));
                    }
                    if answered.contains(&r.tool_use_id.as_str()) {
                        return Err(format!("message {i} block {j}: a tool_use is answered twice"));
                    }
                    answered.push(&r.tool_use_id);
                }
                _ => {}
            }
        }
        if pending.iter().any(|id| !answered.contains(id)) {
            return Err(format!("message {}: a tool_use has no tool_result in message {i}", i - 1));
        }
        pending = m
            .content
            .iter()
            .filter_map(|b| match b {
                Block::ToolUse(t) => Some(t.id.as_str()),
                _ => None,
            })
            .collect();
    }
    if !pending.is_empty() {
        return Err(format!("message {}: a tool_use has no tool_result", messages.len() - 1));
    }
    Ok(())
}

/// How a tool call went, before any hook.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallOutcome {
    /// The tool answered (maybe is_error).
    Executed,
    /// RPC failure or deadline.
    Failed,
    /// Never called.
    Blocked,
    /// Cancelled by an abort.
    Cancelled,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool_use(id: &str) -> Block {
        Block::ToolUse(ToolUse { id: id.into(), name: "t".into(), input: JsonObject::new() })
    }
    fn result(id: &str) -> Block {
        Block::ToolResult(ToolResult::text(id, "r", false))
    }
    fn msg(role: Role, content: Vec<Block>) -> Message {
        Message { role, content: content.into() }
    }

    #[test]
    fn valid_pairs_pass_and_broken_pairs_fail() {
        let ok = vec![
            Message::user_text("hi"),
            msg(Role::Assistant, vec![tool_use("a"), tool_use("b")]),
            msg(Role::User, vec![result("a"), result("b")]),
        ];
        assert_eq!(validate_conversation(&ok), Ok(()));
        assert_eq!(validate_conversation(&[]), Ok(()));

        let dangling = vec![Message::user_text("hi"), msg(Role::Assistant, vec![tool_use("a")])];
        assert!(validate_conversation(&dangling).is_err());

        let orphan = vec![msg(Role::User, vec![result("x")])];
        assert!(validate_conversation(&orphan).is_err());

        let half = vec![
            Message::user_text("hi"),
            msg(Role::Assistant, vec![tool_use("a"), tool_use("b")]),
            msg(Role::User, vec![result("a")]),
        ];
        assert!(validate_conversation(&half).is_err());

        let same_role = vec![Message::user_text("a"), Message::user_text("b")];
        assert!(validate_conversation(&same_role).is_err());

        let starts_assistant = vec![msg(Role::Assistant, vec![Block::Text { text: "x".into() }])];
        assert!(validate_conversation(&starts_assistant).is_err());
    }
}
