//! What a hook receives (a tool result, a model request, the call's trace
//! context) and returns (a replacement), with the helpers for common edits.

use super::*;

/// A tool result on its way to the model (`OnToolResult`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ToolResultCall {
    /// Where the call comes from (agent, session, query, turn).
    pub context: HookContext,
    /// The tool the model called.
    pub tool_name: String,
    /// The id of the model's tool_use block; a replacement must keep it.
    pub tool_use_id: String,
    /// The input the model sent to the tool.
    pub input: JsonMap<String, JsonValue>,
    /// The result as it stands after the previous hooks.
    pub result: ToolResultBlock,
    /// Why the call did not execute successfully, if so.
    pub error: Option<ToolError>,
    /// What produced the result.
    pub source: Option<ResultSource>,
    /// The trace this call belongs to, when Lattice exports traces.
    pub trace: Option<TraceParent>,
}

impl ToolResultCall {
    /// The result's text (its text blocks, concatenated).
    pub fn text(&self) -> String {
        text_of(&self.result)
    }

    /// A replacement of the result: one text block `text`, the same
    /// `tool_use_id` and `is_error`.
    pub fn replace_text(&self, text: impl Into<String>) -> ToolResultBlock {
        with_text(&self.result, text)
    }
}

impl From<pb::OnToolResultRequest> for ToolResultCall {
    fn from(r: pb::OnToolResultRequest) -> Self {
        ToolResultCall {
            context: r.context.unwrap_or_default(),
            tool_name: r.tool_name,
            tool_use_id: r.tool_use_id,
            input: r.input.map(json_object).unwrap_or_default(),
            result: r.result.unwrap_or_default(),
            error: r.error,
            source: r.source,
            trace: None,
        }
    }
}

/// A model request about to be sent (`OnModelRequest`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelRequestCall {
    /// Where the call comes from (`turn` is the 1-based model request).
    pub context: HookContext,
    /// The system prompt, as it stands after the previous hooks.
    pub system: String,
    /// The messages, as they stand after the previous hooks (`role()`
    /// gives each one's [`Role`]).
    pub messages: Vec<Message>,
    /// The tools offered to the model (read-only).
    pub tools: Vec<ToolSpec>,
    /// How many of the oldest messages were left out to fit the hook
    /// message limit (0 when none).
    pub omitted_messages: u32,
    /// The trace this call belongs to, when Lattice exports traces.
    pub trace: Option<TraceParent>,
}

impl From<pb::OnModelRequestRequest> for ModelRequestCall {
    fn from(r: pb::OnModelRequestRequest) -> Self {
        ModelRequestCall {
            context: r.context.unwrap_or_default(),
            system: r.system,
            messages: r.messages,
            tools: r.tools,
            omitted_messages: r.omitted_messages,
            trace: None,
        }
    }
}

/// The W3C trace context of a call: Lattice sends the `traceparent` of
/// its `hook` span with every call when it exports OpenTelemetry traces.
///
/// The SDK runs each call in a `hook_call` span (target
/// `lattice_hook_sdk`) whose `trace_id` and `parent_span_id` fields carry
/// it, so the hook's log lines join the query's trace. With the
/// `opentelemetry` feature the span's OpenTelemetry parent is Lattice's
/// span: a hook that installs a `tracing-opentelemetry` layer exports its
/// spans under Lattice's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceParent {
    /// 32 lowercase hex digits.
    pub trace_id: String,
    /// The id of Lattice's `hook` span: 16 lowercase hex digits.
    pub parent_span_id: String,
    /// Whether Lattice samples the trace.
    pub sampled: bool,
}

impl TraceParent {
    /// Parses a `traceparent` value (version 00); `None` if malformed or
    /// all-zero.
    pub fn parse(value: &str) -> Option<TraceParent> {
        let mut parts = value.trim().split('-');
        let (version, trace_id, span_id, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let hex =
            |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if version != "00" || !hex(trace_id, 32) || !hex(span_id, 16) || !hex(flags, 2) {
            return None;
        }
        if trace_id.bytes().all(|b| b == b'0') || span_id.bytes().all(|b| b == b'0') {
            return None;
        }
        let sampled = u8::from_str_radix(flags, 16).ok()? & 1 == 1;
        Some(TraceParent { trace_id: trace_id.to_owned(), parent_span_id: span_id.to_owned(), sampled })
    }

    pub(crate) fn of(metadata: &tonic::metadata::MetadataMap) -> Option<TraceParent> {
        metadata.get("traceparent").and_then(|v| v.to_str().ok()).and_then(TraceParent::parse)
    }

    /// The `traceparent` header value.
    pub fn header(&self) -> String {
        format!("00-{}-{}-{:02x}", self.trace_id, self.parent_span_id, u8::from(self.sampled))
    }
}

/// The span a call runs in (see [`TraceParent`]).
pub(crate) fn call_span(rpc: &'static str, trace: Option<&TraceParent>) -> tracing::Span {
    let span = tracing::info_span!(
        target: "lattice_hook_sdk",
        "hook_call",
        rpc,
        otel.kind = "server",
        trace_id = tracing::field::Empty,
        parent_span_id = tracing::field::Empty,
    );
    if let Some(t) = trace {
        span.record("trace_id", t.trace_id.as_str()).record("parent_span_id", t.parent_span_id.as_str());
        #[cfg(feature = "opentelemetry")]
        otel::set_parent(&span, t);
    }
    span
}

#[cfg(feature = "opentelemetry")]
pub(crate) mod otel {
    use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    pub(crate) fn set_parent(span: &tracing::Span, t: &super::TraceParent) {
        let (Ok(trace_id), Ok(span_id)) = (TraceId::from_hex(&t.trace_id), SpanId::from_hex(&t.parent_span_id)) else {
            return;
        };
        let flags = if t.sampled { TraceFlags::SAMPLED } else { TraceFlags::default() };
        let remote = SpanContext::new(trace_id, span_id, flags, true, TraceState::default());
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote));
    }
}

/// A message of `role` with one text block.
pub fn text_message(role: Role, text: impl Into<String>) -> Message {
    Message {
        role: role as i32,
        content: vec![ContentBlock { block: Some(content_block::Block::Text(TextBlock { text: text.into() })) }],
    }
}

/// A `google.protobuf.Struct` as JSON.
pub(crate) fn json_object(s: prost_types::Struct) -> JsonMap<String, JsonValue> {
    s.fields.into_iter().map(|(k, v)| (k, json_value(v))).collect()
}

pub(crate) fn json_value(v: prost_types::Value) -> JsonValue {
    use prost_types::value::Kind;
    match v.kind {
        None | Some(Kind::NullValue(_)) => JsonValue::Null,
        Some(Kind::BoolValue(b)) => JsonValue::Bool(b),
        Some(Kind::NumberValue(n)) => serde_json::Number::from_f64(n).map_or(JsonValue::Null, JsonValue::Number),
        Some(Kind::StringValue(s)) => JsonValue::String(s),
        Some(Kind::ListValue(l)) => JsonValue::Array(l.values.into_iter().map(json_value).collect()),
        Some(Kind::StructValue(s)) => JsonValue::Object(json_object(s)),
    }
}
/// A hook's change to a model request. `None` keeps that part; `Some`
/// replaces it (an empty message list is a real replacement).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelRequestChange {
    /// Replacement system prompt.
    pub system: Option<String>,
    /// Replacement messages.
    pub messages: Option<Vec<Message>>,
}

impl ModelRequestChange {
    /// Change nothing.
    pub fn keep() -> Self {
        Self::default()
    }

    /// Replace the messages.
    pub fn messages(messages: Vec<Message>) -> Self {
        Self { system: None, messages: Some(messages) }
    }

    /// Replace the system prompt.
    pub fn system(system: impl Into<String>) -> Self {
        Self { system: Some(system.into()), messages: None }
    }

    /// Whether this keeps everything.
    pub fn is_keep(&self) -> bool {
        self.system.is_none() && self.messages.is_none()
    }
}

/// The concatenated text of a tool result.
pub fn text_of(result: &ToolResultBlock) -> String {
    result.content.iter().map(|t| t.text.as_str()).collect()
}

/// A copy of `result` whose content is the one text block `text`.
pub fn with_text(result: &ToolResultBlock, text: impl Into<String>) -> ToolResultBlock {
    ToolResultBlock {
        tool_use_id: result.tool_use_id.clone(),
        content: vec![TextBlock { text: text.into() }],
        is_error: result.is_error,
    }
}
