//! `scripted`: a deterministic offline model.
//!
//! It answers turn N of a query with entry N of its script: text and/or tool
//! calls. Text may echo what the model received, so that a demo or a test
//! shows exactly what reached the model (after the hooks):
//!
//! | placeholder | replaced by |
//! |---|---|
//! | `{{last_tool_result}}` | the text of the last tool_result block |
//! | `{{last_user_text}}` | the last text block of a user message |
//! | `{{last_user_word}}` | that block's last word, without punctuation ("Find Ada." → `Ada`) |
//! | `{{system}}` | the system prompt |
//! | `{{turn}}` | the 1-based turn |
//! | `{{message_count}}` | the number of messages |
//! | `{{tools}}` | the offered tool names, comma-separated |
//! | `{{request}}` | every text of the request (system, texts, tool results), one per line |
//!
//! Strings in a tool call's input may hold them too (`query =
//! "{{last_user_word}}"` looks up whom the prompt names).
//!
//! With no script it echoes the prompt; past the end of its script it ends
//! the turn with empty text.

use serde_json::Value;

use crate::{
    config::ScriptTurn,
    domain::{AssistantReply, Block, ModelRequest, Role, StopReason, ToolUse, Usage},
    model::{DeltaSink, Model, ModelError},
    scope::Step,
};

/// The scripted model.
#[derive(Debug, Clone)]
pub struct Scripted {
    script: Vec<ScriptTurn>,
}

impl Scripted {
    /// A model answering from `script`.
    pub fn new(script: Vec<ScriptTurn>) -> Self {
        Self { script }
    }
}

fn last_tool_result(req: &ModelRequest<'_>) -> String {
    req.messages
        .iter()
        .flat_map(|m| m.content.iter())
        .filter_map(|b| match b {
            Block::ToolResult(r) => Some(r.content.join("")),
            _ => None,
        })
        .next_back()
        .unwrap_or_default()
}

fn last_user_text(req: &ModelRequest<'_>) -> String {
    req.messages
        .iter()
        .filter(|m| m.role == Role::User)
        .flat_map(|m| m.content.iter())
        .filter_map(|b| match b {
            Block::Text { text } => Some(text.clone()),
            _ => None,
        })
        .next_back()
        .unwrap_or_default()
}

fn last_user_word(req: &ModelRequest<'_>) -> String {
    let text = last_user_text(req);
    let word = text.split_whitespace().next_back().unwrap_or_default();
    word.trim_matches(|c: char| !c.is_alphanumeric()).to_owned()
}

fn all_text(req: &ModelRequest<'_>) -> String {
    let mut lines = vec![req.system.to_string()];
    for b in req.messages.iter().flat_map(|m| m.content.iter()) {
        match b {
            Block::Text { text } => lines.push(text.clone()),
            Block::ToolResult(r) => lines.push(r.content.join("")),
            Block::ToolUse(_) => {}
        }
    }
    lines.join("\n")
}

fn render(template: &str, req: &ModelRequest<'_>, turn: u32) -> String {
    let mut out = template.to_owned();
    let subs: [(&str, &dyn Fn() -> String); 8] = [
        ("{{last_tool_result}}", &|| last_tool_result(req)),
        ("{{last_user_text}}", &|| last_user_text(req)),
        ("{{last_user_word}}", &|| last_user_word(req)),
        ("{{system}}", &|| req.system.to_string()),
        ("{{turn}}", &|| turn.to_string()),
        ("{{message_count}}", &|| req.messages.len().to_string()),
        ("{{tools}}", &|| req.tools.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(",")),
        ("{{request}}", &|| all_text(req)),
    ];
    for (key, value) in subs {
        if out.contains(key) {
            out = out.replace(key, &value());
        }
    }
    out
}

/// A tool call's input with the placeholders in its strings replaced.
fn render_value(value: &Value, req: &ModelRequest<'_>, turn: u32) -> Value {
    match value {
        Value::String(s) if s.contains("{{") => Value::String(render(s, req, turn)),
        Value::Array(items) => Value::Array(items.iter().map(|v| render_value(v, req, turn)).collect()),
        Value::Object(fields) => {
            Value::Object(fields.iter().map(|(k, v)| (k.clone(), render_value(v, req, turn))).collect())
        }
        other => other.clone(),
    }
}

/// The text in some blocks, in bytes (texts, tool results, tool names):
/// counted, not copied, for the usage figures.
fn text_bytes(blocks: &[Block]) -> usize {
    blocks
        .iter()
        .map(|b| match b {
            Block::Text { text } => text.len(),
            Block::ToolResult(r) => r.len(),
            Block::ToolUse(u) => u.name.len(),
        })
        .sum()
}

/// About four bytes a token: deterministic figures for the usage fields.
fn tokens(bytes: usize) -> u64 {
    bytes.div_ceil(4) as u64
}

#[tonic::async_trait]
impl Model for Scripted {
    async fn complete(
        &self,
        request: &ModelRequest<'_>,
        at: Step<'_>,
        _deltas: DeltaSink,
    ) -> Result<AssistantReply, ModelError> {
        let idx = at.turn.saturating_sub(1) as usize;
        let mut content = Vec::new();
        let stop_reason = match (self.script.is_empty(), self.script.get(idx)) {
            (true, _) => {
                content.push(Block::Text { text: last_user_text(request) });
                StopReason::EndTurn
            }
            (false, None) => {
                content.push(Block::Text { text: String::new() });
                StopReason::EndTurn
            }
            (false, Some(step)) => {
                if !step.delay.is_zero() {
                    tokio::time::sleep(step.delay).await;
                }
                if let Some(t) = &step.text {
                    content.push(Block::Text { text: render(t, request, at.turn) });
                }
                let prefix: String = at.scope.query_id.chars().filter(|c| *c != '-').take(12).collect();
                for (i, (name, input)) in step.tool_calls.iter().enumerate() {
                    content.push(Block::ToolUse(ToolUse {
                        id: format!("toolu_{prefix}_{}_{}", at.turn, i + 1),
                        name: name.clone(),
                        input: input.iter().map(|(k, v)| (k.clone(), render_value(v, request, at.turn))).collect(),
                    }));
                }
                step.stop_reason.unwrap_or(if step.tool_calls.is_empty() {
                    StopReason::EndTurn
                } else {
                    StopReason::ToolUse
                })
            }
        };
        let in_bytes = request.system.len() + request.messages.iter().map(|m| text_bytes(&m.content)).sum::<usize>();
        let out_bytes = text_bytes(&content);
        Ok(AssistantReply {
            content: content.into(),
            stop_reason,
            usage: Usage { input_tokens: tokens(in_bytes), output_tokens: tokens(out_bytes) },
        })
    }
}
