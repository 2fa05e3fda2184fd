//! Conversions between the domain types and the proto types, in one place.
//!
//! Decoding from proto is fallible: a peer (a hook, a client) may send a
//! block with nothing set or a role left unspecified, and that is an error,
//! never a silent default.

use lattice_proto::agent::v1 as pb;
use prost_types::value::Kind;
use serde_json::{Map, Number, Value};

use lattice_proto::hooks::v1 as hpb;

use crate::domain::{
    Block, JsonObject, Message, ModelRequest, ResultSource, Role, StopReason, ToolErrorKind, ToolFailure, ToolResult,
    ToolSpec, ToolUse, Usage,
};

/// A proto value that has no domain meaning. Names the field, never content.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {0}")]
pub struct DecodeError(pub &'static str);

// ---- JSON <-> google.protobuf.Struct ----

/// JSON object → `Struct`.
pub fn to_struct(obj: &JsonObject) -> prost_types::Struct {
    prost_types::Struct { fields: obj.iter().map(|(k, v)| (k.clone(), to_value(v))).collect() }
}

/// JSON value → `Value`. Integers beyond 2^53 lose precision, as in JSON itself.
pub fn to_value(v: &Value) -> prost_types::Value {
    let kind = match v {
        Value::Null => Kind::NullValue(0),
        Value::Bool(b) => Kind::BoolValue(*b),
        Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        Value::String(s) => Kind::StringValue(s.clone()),
        Value::Array(a) => Kind::ListValue(prost_types::ListValue { values: a.iter().map(to_value).collect() }),
        Value::Object(o) => Kind::StructValue(to_struct(o)),
    };
    prost_types::Value { kind: Some(kind) }
}

/// `Struct` → JSON object (absent = empty object).
pub fn from_struct(s: Option<prost_types::Struct>) -> JsonObject {
    s.map(|s| s.fields.into_iter().map(|(k, v)| (k, from_value(v))).collect()).unwrap_or_default()
}

/// `Value` → JSON. Whole numbers come back as integers; NaN/inf become null.
pub fn from_value(v: prost_types::Value) -> Value {
    match v.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::BoolValue(b)) => Value::Bool(b),
        Some(Kind::NumberValue(n)) => {
            if n.fract() == 0.0 && n.abs() < 9.007_199_254_740_992e15 {
                Value::Number(Number::from(n as i64))
            } else {
                Number::from_f64(n).map(Value::Number).unwrap_or(Value::Null)
            }
        }
        Some(Kind::StringValue(s)) => Value::String(s),
        Some(Kind::ListValue(l)) => Value::Array(l.values.into_iter().map(from_value).collect()),
        Some(Kind::StructValue(s)) => Value::Object(from_struct(Some(s))),
    }
}

/// An empty JSON object.
pub fn empty_object() -> JsonObject {
    Map::new()
}

// ---- content ----

impl From<&ToolResult> for pb::ToolResultBlock {
    fn from(r: &ToolResult) -> Self {
        Self {
            tool_use_id: r.tool_use_id.clone(),
            content: r.content.iter().map(|t| pb::TextBlock { text: t.clone() }).collect(),
            is_error: r.is_error,
        }
    }
}

impl From<pb::ToolResultBlock> for ToolResult {
    fn from(r: pb::ToolResultBlock) -> Self {
        Self {
            tool_use_id: r.tool_use_id,
            content: r.content.into_iter().map(|t| t.text).collect(),
            is_error: r.is_error,
        }
    }
}

impl From<&Block> for pb::ContentBlock {
    fn from(b: &Block) -> Self {
        use pb::content_block::Block as B;
        let block = match b {
            Block::Text { text } => B::Text(pb::TextBlock { text: text.clone() }),
            Block::ToolUse(t) => B::ToolUse(pb::ToolUseBlock {
                id: t.id.clone(),
                name: t.name.clone(),
                input: Some(to_struct(&t.input)),
            }),
            Block::ToolResult(r) => B::ToolResult(r.into()),
        };
        Self { block: Some(block) }
    }
}

impl TryFrom<pb::ContentBlock> for Block {
    type Error = DecodeError;
    fn try_from(b: pb::ContentBlock) -> Result<Self, DecodeError> {
        use pb::content_block::Block as B;
        Ok(match b.block.ok_or(DecodeError("content block (none set)"))? {
            B::Text(t) => Block::Text { text: t.text },
            B::ToolUse(t) => Block::ToolUse(ToolUse { id: t.id, name: t.name, input: from_struct(t.input) }),
            B::ToolResult(r) => Block::ToolResult(r.into()),
        })
    }
}

impl From<Role> for pb::Role {
    fn from(r: Role) -> Self {
        match r {
            Role::User => pb::Role::User,
            Role::Assistant => pb::Role::Assistant,
        }
    }
}

impl From<&Message> for pb::Message {
    fn from(m: &Message) -> Self {
        Self { role: pb::Role::from(m.role) as i32, content: m.content.iter().map(Into::into).collect() }
    }
}

impl TryFrom<pb::Message> for Message {
    type Error = DecodeError;
    fn try_from(m: pb::Message) -> Result<Self, DecodeError> {
        let role = match pb::Role::try_from(m.role) {
            Ok(pb::Role::User) => Role::User,
            Ok(pb::Role::Assistant) => Role::Assistant,
            _ => return Err(DecodeError("message role")),
        };
        let content = m.content.into_iter().map(Block::try_from).collect::<Result<_, _>>()?;
        Ok(Self { role, content })
    }
}

/// Domain messages → proto.
pub fn messages_to_pb(messages: &[Message]) -> Vec<pb::Message> {
    messages.iter().map(Into::into).collect()
}

/// Proto messages → domain, failing on the first invalid one.
pub fn messages_from_pb(messages: Vec<pb::Message>) -> Result<Vec<Message>, DecodeError> {
    messages.into_iter().map(Message::try_from).collect()
}

impl From<&ToolSpec> for pb::ToolSpec {
    fn from(t: &ToolSpec) -> Self {
        Self {
            name: t.name.clone(),
            description: t.description.clone(),
            input_schema: Some(to_struct(&t.input_schema)),
        }
    }
}

impl From<&ModelRequest<'_>> for pb::ModelRequestEvent {
    fn from(r: &ModelRequest<'_>) -> Self {
        Self {
            turn: 0,
            system: r.system.to_string(),
            messages: messages_to_pb(&r.messages),
            tools: r.tools.iter().map(Into::into).collect(),
        }
    }
}

impl From<StopReason> for pb::StopReason {
    fn from(s: StopReason) -> Self {
        match s {
            // A final result with ToolUse can't happen (the loop goes on), but
            // the mapping stays total.
            StopReason::EndTurn | StopReason::ToolUse => pb::StopReason::EndTurn,
            StopReason::MaxTurns => pb::StopReason::MaxTurns,
            StopReason::MaxTokens => pb::StopReason::MaxTokens,
            StopReason::StopSequence => pb::StopReason::StopSequence,
        }
    }
}

impl From<Usage> for pb::Usage {
    fn from(u: Usage) -> Self {
        Self { input_tokens: u.input_tokens, output_tokens: u.output_tokens }
    }
}

impl From<&ToolFailure> for hpb::ToolError {
    fn from(f: &ToolFailure) -> Self {
        let kind = match f.kind {
            ToolErrorKind::ToolError => hpb::ToolErrorKind::ToolError,
            ToolErrorKind::RpcFailed => hpb::ToolErrorKind::RpcFailed,
            ToolErrorKind::Deadline => hpb::ToolErrorKind::Deadline,
            ToolErrorKind::PermissionDenied => hpb::ToolErrorKind::PermissionDenied,
            ToolErrorKind::BatchLimit => hpb::ToolErrorKind::BatchLimit,
            ToolErrorKind::UnknownTool => hpb::ToolErrorKind::UnknownTool,
            ToolErrorKind::Cancelled => hpb::ToolErrorKind::Cancelled,
            ToolErrorKind::Delegation => hpb::ToolErrorKind::Delegation,
        };
        Self { kind: kind as i32, message: f.message.clone() }
    }
}

impl From<&ResultSource> for hpb::ResultSource {
    fn from(s: &ResultSource) -> Self {
        let (kind, name) = match s {
            ResultSource::ToolService(endpoint) => (hpb::SourceKind::ToolService, endpoint.clone()),
            ResultSource::DelegatedAgent(agent) => (hpb::SourceKind::DelegatedAgent, agent.clone()),
            ResultSource::Lattice => (hpb::SourceKind::Lattice, String::new()),
        };
        Self { kind: kind as i32, name }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn json_survives_a_struct_round_trip() {
        let v = json!({"a": 1, "b": [true, null, "x", 2.5], "c": {"d": -3}});
        let obj = v.as_object().unwrap().clone();
        assert_eq!(Value::Object(from_struct(Some(to_struct(&obj)))), v);
    }

    #[test]
    fn a_block_with_nothing_set_is_an_error() {
        assert!(Block::try_from(pb::ContentBlock { block: None }).is_err());
        let m = pb::Message { role: 0, content: vec![] };
        assert!(Message::try_from(m).is_err());
    }
}
