//! OpenAI-compatible Chat Completions: `POST {base}/v1/chat/completions`.
//!
//! The base URL makes vLLM, Ollama, llama.cpp's server, LiteLLM and other
//! compatible servers work. The API has no `is_error` on tool results: an
//! error result is sent as a `tool` message whose content starts with
//! `ERROR: `. Streaming assembles `tool_calls` deltas by index and ends at
//! `data: [DONE]`.

use std::collections::BTreeMap;

use bytes::Bytes;
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use serde::{Serialize, ser::SerializeSeq as _};
use serde_json::Value;

use super::http::{Failure, HttpModel, Wire, json_body, seq, tool_input};
use crate::{
    domain::{AssistantReply, Block, Message, ModelRequest, Role, StopReason, ToolResult, ToolUse, Usage},
    model::{DeltaSink, Model, ModelError, ModelErrorKind},
    scope::Step,
};

/// How an error tool result's content starts.
pub const ERROR_PREFIX: &str = "ERROR: ";

#[derive(Debug)]
pub(super) struct OpenAi(pub(super) HttpModel);

/// The request body: exactly the post-hook request, in the API's shape,
/// written straight from the request (keys in the order a JSON object
/// sorts them).
pub(crate) fn body<'a>(http: &'a HttpModel, req: &'a ModelRequest<'_>) -> impl Serialize + 'a {
    let cfg = &http.cfg;
    Body {
        max_tokens: cfg.max_tokens,
        messages: WireMessages { system: &req.system, messages: &req.messages },
        model: &cfg.model,
        stream: cfg.stream.then_some(true),
        stream_options: cfg.stream.then_some(StreamOptions { include_usage: true }),
        temperature: cfg.temperature,
        tools: (!req.tools.is_empty()).then(|| {
            seq(&req.tools[..], |t| WireTool {
                function: WireFunction { description: &t.description, name: &t.name, parameters: &t.input_schema },
                r#type: "function",
            })
        }),
    }
}

#[derive(Serialize)]
struct Body<'a, T: Serialize> {
    max_tokens: u32,
    messages: WireMessages<'a>,
    model: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<T>,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

#[derive(Serialize)]
struct WireTool<'a> {
    function: WireFunction<'a>,
    r#type: &'static str,
}

#[derive(Serialize)]
struct WireFunction<'a> {
    description: &'a str,
    name: &'a str,
    parameters: &'a serde_json::Map<String, Value>,
}

/// The system prompt and the conversation as the API's messages: tool
/// results first, one `tool` message each, then a message's text.
struct WireMessages<'a> {
    system: &'a str,
    messages: &'a [Message],
}

#[derive(Serialize)]
struct Plain<C: Serialize> {
    content: C,
    role: &'static str,
}

#[derive(Serialize)]
struct ToolMessage<'a> {
    content: ToolText<'a>,
    role: &'static str,
    tool_call_id: &'a str,
}

#[derive(Serialize)]
struct AssistantMessage<'a> {
    content: Option<Texts<'a>>,
    role: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<ToolCalls<'a>>,
}

impl Serialize for WireMessages<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(None)?;
        if !self.system.is_empty() {
            seq.serialize_element(&Plain { content: self.system, role: "system" })?;
        }
        for m in self.messages {
            let texts = Texts(&m.content);
            let has_text = m.content.iter().any(|b| matches!(b, Block::Text { .. }));
            match m.role {
                Role::User => {
                    for b in m.content.iter() {
                        if let Block::ToolResult(r) = b {
                            let content = ToolText(r);
                            seq.serialize_element(&ToolMessage {
                                content,
                                role: "tool",
                                tool_call_id: &r.tool_use_id,
                            })?;
                        }
                    }
                    if has_text {
                        seq.serialize_element(&Plain { content: texts, role: "user" })?;
                    }
                }
                Role::Assistant => {
                    let calls = m.content.iter().any(|b| matches!(b, Block::ToolUse(_)));
                    let message = AssistantMessage {
                        content: has_text.then_some(texts),
                        role: "assistant",
                        tool_calls: calls.then_some(ToolCalls(&m.content)),
                    };
                    seq.serialize_element(&message)?;
                }
            }
        }
        seq.end()
    }
}

/// A message's text blocks, joined by a blank line, as one string.
#[derive(Clone, Copy)]
struct Texts<'a>(&'a [Block]);

impl std::fmt::Display for Texts<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut sep = "";
        for b in self.0 {
            if let Block::Text { text } = b {
                f.write_str(sep)?;
                f.write_str(text)?;
                sep = "\n\n";
            }
        }
        Ok(())
    }
}

impl Serialize for Texts<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A tool result's text, marked when it is an error.
struct ToolText<'a>(&'a ToolResult);

impl std::fmt::Display for ToolText<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_error {
            f.write_str(ERROR_PREFIX)?;
        }
        self.0.content.iter().try_for_each(|t| f.write_str(t))
    }
}

impl Serialize for ToolText<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// An assistant message's tool calls, their input as a JSON string.
struct ToolCalls<'a>(&'a [Block]);

#[derive(Serialize)]
struct WireCall<'a> {
    function: CallFunction<'a>,
    id: &'a str,
    r#type: &'static str,
}

#[derive(Serialize)]
struct CallFunction<'a> {
    arguments: String,
    name: &'a str,
}

impl Serialize for ToolCalls<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        let mut seq = s.serialize_seq(None)?;
        for b in self.0 {
            if let Block::ToolUse(t) = b {
                let arguments = serde_json::to_string(&t.input).map_err(S::Error::custom)?;
                let function = CallFunction { arguments, name: &t.name };
                seq.serialize_element(&WireCall { function, id: &t.id, r#type: "function" })?;
            }
        }
        seq.end()
    }
}

fn stop_reason(s: Option<&str>) -> StopReason {
    match s {
        Some("tool_calls" | "function_call") => StopReason::ToolUse,
        Some("length") => StopReason::MaxTokens,
        _ => StopReason::EndTurn,
    }
}

fn usage(u: &Value) -> Usage {
    Usage {
        input_tokens: u["prompt_tokens"].as_u64().unwrap_or(0),
        output_tokens: u["completion_tokens"].as_u64().unwrap_or(0),
    }
}

fn in_band_error(v: &Value) -> Option<Failure> {
    let e = v.get("error")?;
    let kind = e["type"].as_str().or(e["code"].as_str()).unwrap_or("error").to_owned();
    Some(if kind.contains("server") || kind.contains("overloaded") || kind.contains("rate") {
        Failure::retry(format!("stream error ({kind})"))
    } else {
        Failure::Fatal(ModelErrorKind::InvalidRequest, format!("stream error ({kind})"))
    })
}

#[derive(Default)]
struct PartialCall {
    id: String,
    name: String,
    arguments: String,
}

fn assemble(text: String, calls: BTreeMap<u64, PartialCall>) -> Result<Vec<Block>, Failure> {
    let mut content = Vec::new();
    if !text.is_empty() {
        content.push(Block::Text { text });
    }
    for (_, c) in calls {
        if c.id.is_empty() || c.name.is_empty() {
            return Err(Failure::invalid("a tool call lacks its id or name"));
        }
        content.push(Block::ToolUse(ToolUse { id: c.id, name: c.name, input: tool_input(&c.arguments)? }));
    }
    Ok(content)
}

#[tonic::async_trait]
impl Wire for OpenAi {
    fn request(&self, http: &HttpModel, body: &Bytes) -> reqwest::RequestBuilder {
        http.post_json("/v1/chat/completions", body).bearer_auth(&http.cfg.api_key)
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
            if let Some(f) = in_band_error(&v) {
                return Err(f);
            }
            let Some(choice) = v["choices"].get(0) else { return Err(Failure::invalid("the response has no choices")) };
            let message = &choice["message"];
            let text = message["content"].as_str().unwrap_or_default().to_owned();
            let mut calls = BTreeMap::new();
            for (i, c) in message["tool_calls"].as_array().into_iter().flatten().enumerate() {
                calls.insert(
                    i as u64,
                    PartialCall {
                        id: c["id"].as_str().unwrap_or_default().to_owned(),
                        name: c["function"]["name"].as_str().unwrap_or_default().to_owned(),
                        arguments: c["function"]["arguments"].as_str().unwrap_or_default().to_owned(),
                    },
                );
            }
            return Ok(AssistantReply {
                content: assemble(text, calls)?.into(),
                stop_reason: stop_reason(choice["finish_reason"].as_str()),
                usage: usage(&v["usage"]),
            });
        }
        let mut events = response.bytes_stream().eventsource();
        let mut text = String::new();
        let mut calls: BTreeMap<u64, PartialCall> = BTreeMap::new();
        let mut finish = None;
        let mut reply_usage = Usage::default();
        while let Some(event) = events.next().await {
            let event = event.map_err(|_| Failure::retry("the event stream broke off"))?;
            if event.data.trim() == "[DONE]" {
                return Ok(AssistantReply {
                    content: assemble(text, calls)?.into(),
                    stop_reason: stop_reason(finish.as_deref()),
                    usage: reply_usage,
                });
            }
            let v: Value =
                serde_json::from_str(&event.data).map_err(|_| Failure::invalid("a stream event is not valid JSON"))?;
            if let Some(f) = in_band_error(&v) {
                return Err(f);
            }
            if v["usage"].is_object() {
                reply_usage = usage(&v["usage"]);
            }
            let Some(choice) = v["choices"].get(0) else { continue };
            let delta = &choice["delta"];
            if let Some(piece) = delta["content"].as_str() {
                deltas.send(piece);
                *delivered |= !piece.is_empty();
                text.push_str(piece);
            }
            for c in delta["tool_calls"].as_array().into_iter().flatten() {
                let Some(index) = c["index"].as_u64() else {
                    return Err(Failure::invalid("a tool call delta has no index"));
                };
                let call = calls.entry(index).or_default();
                if let Some(id) = c["id"].as_str() {
                    call.id = id.to_owned();
                }
                if let Some(name) = c["function"]["name"].as_str() {
                    call.name.push_str(name);
                }
                if let Some(args) = c["function"]["arguments"].as_str() {
                    call.arguments.push_str(args);
                }
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                finish = Some(f.to_owned());
            }
        }
        Err(Failure::retry("the event stream ended before [DONE]"))
    }
}

#[tonic::async_trait]
impl Model for OpenAi {
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
