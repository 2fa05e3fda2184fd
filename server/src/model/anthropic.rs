//! The Anthropic Messages API: `POST {base}/v1/messages`.
//!
//! Streaming reads the SSE events `message_start`, `content_block_start`,
//! `content_block_delta` (`text_delta`, `input_json_delta`),
//! `content_block_stop`, `message_delta`, `message_stop`, `ping` and
//! `error`; a stream that ends before `message_stop` is cut short.

use bytes::Bytes;
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::Value;

use super::http::{Failure, HttpModel, Wire, json_body, seq, tool_input};
use crate::{
    domain::{AssistantReply, Block, ModelRequest, Role, StopReason, ToolUse, Usage},
    model::{DeltaSink, Model, ModelError, ModelErrorKind},
    scope::Step,
};

/// The API version sent as `anthropic-version`.
pub const API_VERSION: &str = "2023-06-01";

#[derive(Debug)]
pub(super) struct Anthropic(pub(super) HttpModel);

/// The request body: exactly the post-hook request, in the API's shape,
/// written straight from the request (keys in the order a JSON object
/// sorts them).
pub(crate) fn body<'a>(http: &'a HttpModel, req: &'a ModelRequest<'_>) -> impl Serialize + 'a {
    let cfg = &http.cfg;
    Body {
        max_tokens: cfg.max_tokens,
        messages: seq(&req.messages, |m| WireMessage {
            content: seq(&m.content, WireBlock),
            role: match m.role {
                Role::User => "user",
                Role::Assistant => "assistant",
            },
        }),
        model: &cfg.model,
        stream: cfg.stream.then_some(true),
        system: (!req.system.is_empty()).then_some(&*req.system),
        temperature: cfg.temperature,
        tools: (!req.tools.is_empty()).then(|| {
            seq(&req.tools[..], |t| WireTool {
                description: &t.description,
                input_schema: &t.input_schema,
                name: &t.name,
            })
        }),
    }
}

#[derive(Serialize)]
struct Body<'a, M: Serialize, T: Serialize> {
    max_tokens: u32,
    messages: M,
    model: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    system: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<T>,
}

#[derive(Serialize)]
struct WireMessage<C: Serialize> {
    content: C,
    role: &'static str,
}

#[derive(Serialize)]
struct WireTool<'a> {
    description: &'a str,
    input_schema: &'a serde_json::Map<String, Value>,
    name: &'a str,
}

/// A text block: `{"text", "type"}`.
#[derive(Serialize)]
struct WireText<'a> {
    text: &'a str,
    r#type: &'static str,
}

/// A content block in the API's shape.
struct WireBlock<'a>(&'a Block);

impl Serialize for WireBlock<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        match self.0 {
            Block::Text { text } => WireText { text, r#type: "text" }.serialize(s),
            Block::ToolUse(t) => {
                let mut m = s.serialize_map(Some(4))?;
                m.serialize_entry("id", &t.id)?;
                m.serialize_entry("input", &t.input)?;
                m.serialize_entry("name", &t.name)?;
                m.serialize_entry("type", "tool_use")?;
                m.end()
            }
            Block::ToolResult(r) => {
                let mut m = s.serialize_map(None)?;
                m.serialize_entry("content", &seq(&r.content[..], |t| WireText { text: t, r#type: "text" }))?;
                if r.is_error {
                    m.serialize_entry("is_error", &true)?;
                }
                m.serialize_entry("tool_use_id", &r.tool_use_id)?;
                m.serialize_entry("type", "tool_result")?;
                m.end()
            }
        }
    }
}

fn stop_reason(s: Option<&str>) -> StopReason {
    match s {
        Some("tool_use") => StopReason::ToolUse,
        Some("max_tokens") => StopReason::MaxTokens,
        Some("stop_sequence") => StopReason::StopSequence,
        _ => StopReason::EndTurn,
    }
}

fn usage(u: &Value) -> Usage {
    Usage {
        input_tokens: u["input_tokens"].as_u64().unwrap_or(0),
        output_tokens: u["output_tokens"].as_u64().unwrap_or(0),
    }
}

fn block(v: &Value) -> Result<Option<Block>, Failure> {
    Ok(match v["type"].as_str() {
        Some("text") => Some(Block::Text { text: v["text"].as_str().unwrap_or_default().to_owned() }),
        Some("tool_use") => {
            let (Some(id), Some(name)) = (v["id"].as_str(), v["name"].as_str()) else {
                return Err(Failure::invalid("a tool_use block lacks its id or name"));
            };
            let input = match &v["input"] {
                Value::Object(o) => o.clone(),
                Value::Null => Default::default(),
                _ => return Err(Failure::invalid("a tool_use input is not a JSON object")),
            };
            Some(Block::ToolUse(ToolUse { id: id.into(), name: name.into(), input }))
        }
        // Other block kinds (thinking, …) are not part of the conversation
        // Lattice keeps.
        _ => None,
    })
}

/// A block being streamed.
enum Partial {
    Text(String),
    ToolUse { id: String, name: String, json: String },
    Other,
}

fn error_event(v: &Value) -> Failure {
    let kind = v["error"]["type"].as_str().unwrap_or("error").to_owned();
    match kind.as_str() {
        "overloaded_error" | "api_error" | "rate_limit_error" => Failure::retry(format!("stream error ({kind})")),
        _ => Failure::Fatal(ModelErrorKind::InvalidRequest, format!("stream error ({kind})")),
    }
}

#[tonic::async_trait]
impl Wire for Anthropic {
    fn request(&self, http: &HttpModel, body: &Bytes) -> reqwest::RequestBuilder {
        http.post_json("/v1/messages", body)
            .header("x-api-key", &http.cfg.api_key)
            .header("anthropic-version", API_VERSION)
    }

    async fn read(
        &self,
        response: reqwest::Response,
        stream: bool,
        deltas: &DeltaSink,
        delivered: &mut bool,
    ) -> Result<AssistantReply, Failure> {
        if !stream {
            let v = json_body(response).await?;
            let Some(content) = v["content"].as_array() else {
                return Err(Failure::invalid("the response has no content array"));
            };
            let mut blocks = Vec::new();
            for b in content {
                blocks.extend(block(b)?);
            }
            return Ok(AssistantReply {
                content: blocks.into(),
                stop_reason: stop_reason(v["stop_reason"].as_str()),
                usage: usage(&v["usage"]),
            });
        }
        let mut events = response.bytes_stream().eventsource();
        let mut partials: Vec<Partial> = Vec::new();
        let mut reply_usage = Usage::default();
        let mut stop = None;
        while let Some(event) = events.next().await {
            let event = event.map_err(|_| Failure::retry("the event stream broke off"))?;
            if event.event == "ping" {
                continue;
            }
            let v: Value =
                serde_json::from_str(&event.data).map_err(|_| Failure::invalid("a stream event is not valid JSON"))?;
            match v["type"].as_str().unwrap_or(event.event.as_str()) {
                "message_start" => {
                    let u = usage(&v["message"]["usage"]);
                    reply_usage.input_tokens = u.input_tokens;
                    reply_usage.output_tokens = u.output_tokens;
                }
                "content_block_start" => {
                    let b = &v["content_block"];
                    partials.push(match b["type"].as_str() {
                        Some("text") => {
                            let t = b["text"].as_str().unwrap_or_default();
                            deltas.send(t);
                            *delivered |= !t.is_empty();
                            Partial::Text(t.to_owned())
                        }
                        Some("tool_use") => Partial::ToolUse {
                            id: b["id"].as_str().unwrap_or_default().to_owned(),
                            name: b["name"].as_str().unwrap_or_default().to_owned(),
                            json: String::new(),
                        },
                        _ => Partial::Other,
                    });
                }
                "content_block_delta" => {
                    let index = v["index"].as_u64().unwrap_or(u64::MAX) as usize;
                    let delta = &v["delta"];
                    match (partials.get_mut(index), delta["type"].as_str()) {
                        (Some(Partial::Text(t)), Some("text_delta")) => {
                            let piece = delta["text"].as_str().unwrap_or_default();
                            deltas.send(piece);
                            *delivered = true;
                            t.push_str(piece);
                        }
                        (Some(Partial::ToolUse { json, .. }), Some("input_json_delta")) => {
                            json.push_str(delta["partial_json"].as_str().unwrap_or_default());
                        }
                        (Some(Partial::Other), _) | (_, Some("thinking_delta" | "signature_delta")) => {}
                        _ => return Err(Failure::invalid("a content_block_delta does not match its block")),
                    }
                }
                "content_block_stop" => {}
                "message_delta" => {
                    stop = v["delta"]["stop_reason"].as_str().map(str::to_owned);
                    if let Some(out) = v["usage"]["output_tokens"].as_u64() {
                        reply_usage.output_tokens = out;
                    }
                }
                "message_stop" => {
                    let mut content = Vec::with_capacity(partials.len());
                    for p in partials {
                        match p {
                            Partial::Text(text) => content.push(Block::Text { text }),
                            Partial::ToolUse { id, name, json } => {
                                if id.is_empty() || name.is_empty() {
                                    return Err(Failure::invalid("a tool_use block lacks its id or name"));
                                }
                                content.push(Block::ToolUse(ToolUse { id, name, input: tool_input(&json)? }));
                            }
                            Partial::Other => {}
                        }
                    }
                    return Ok(AssistantReply {
                        content: content.into(),
                        stop_reason: stop_reason(stop.as_deref()),
                        usage: reply_usage,
                    });
                }
                "error" => return Err(error_event(&v)),
                _ => {}
            }
        }
        Err(Failure::retry("the event stream ended before message_stop"))
    }
}

#[tonic::async_trait]
impl Model for Anthropic {
    async fn complete(
        &self,
        request: &ModelRequest<'_>,
        step: Step<'_>,
        deltas: DeltaSink,
    ) -> Result<AssistantReply, ModelError> {
        let body = self.0.encode(&body(&self.0, request))?;
        self.0.execute(self, &body, step.scope.deadline, &deltas).await
    }
}
