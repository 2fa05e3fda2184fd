//! OpenAI-compatible Chat Completions: `POST {base}/v1/chat/completions`.
//!
//! The base URL makes vLLM, Ollama, llama.cpp's server, LiteLLM and other
//! compatible servers work. The API has no `is_error` on tool results: an
//! error result is sent as a `tool` message whose content starts with
//! `ERROR: `. Streaming assembles `tool_calls` deltas by index and ends at
//! `data: [DONE]`.

use std::collections::BTreeMap;

use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use serde_json::{Value, json};

use super::http::{Failure, HttpModel, Wire, json_body, tool_input};
use crate::{
    domain::{AssistantReply, Block, ModelRequest, Role, Step, StopReason, ToolUse, Usage},
    model::{DeltaSink, Model, ModelError, ModelErrorKind},
};

/// How an error tool result's content starts.
pub const ERROR_PREFIX: &str = "ERROR: ";

#[derive(Debug)]
pub(super) struct OpenAi(pub(super) HttpModel);

/// The request body: exactly the post-hook request, in the API's shape.
pub(crate) fn body(http: &HttpModel, req: &ModelRequest<'_>) -> Value {
    let mut messages = Vec::new();
    if !req.system.is_empty() {
        messages.push(json!({"role": "system", "content": req.system}));
    }
    for m in req.messages.iter() {
        let texts: Vec<&str> = m
            .content
            .iter()
            .filter_map(|b| match b {
                Block::Text { text } => Some(text.as_str()),
                _ => None,
            })
            .collect();
        match m.role {
            Role::User => {
                // Tool results answer the previous assistant message's
                // tool_calls, so they come first, one `tool` message each.
                for b in m.content.iter() {
                    if let Block::ToolResult(r) = b {
                        let text = r.content.concat();
                        let content = if r.is_error { format!("{ERROR_PREFIX}{text}") } else { text };
                        messages.push(json!({"role": "tool", "tool_call_id": r.tool_use_id, "content": content}));
                    }
                }
                if !texts.is_empty() {
                    messages.push(json!({"role": "user", "content": texts.join("\n\n")}));
                }
            }
            Role::Assistant => {
                let calls: Vec<Value> = m
                    .content
                    .iter()
                    .filter_map(|b| match b {
                        Block::ToolUse(t) => Some(json!({
                            "id": t.id,
                            "type": "function",
                            "function": {"name": t.name, "arguments": Value::Object(t.input.clone()).to_string()},
                        })),
                        _ => None,
                    })
                    .collect();
                let content = if texts.is_empty() { Value::Null } else { json!(texts.join("\n\n")) };
                let mut msg = json!({"role": "assistant", "content": content});
                if !calls.is_empty() {
                    msg["tool_calls"] = json!(calls);
                }
                messages.push(msg);
            }
        }
    }
    let cfg = &http.cfg;
    let mut body = json!({"model": cfg.model, "messages": messages, "max_tokens": cfg.max_tokens});
    if !req.tools.is_empty() {
        let tools: Vec<Value> = req
            .tools
            .iter()
            .map(|t| json!({"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.input_schema}}))
            .collect();
        body["tools"] = json!(tools);
    }
    if let Some(t) = cfg.temperature {
        body["temperature"] = json!(t);
    }
    if cfg.stream {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
    }
    body
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
    fn request(&self, http: &HttpModel, body: &Value) -> reqwest::RequestBuilder {
        http.client.post(http.url("/v1/chat/completions")).bearer_auth(&http.cfg.api_key).json(body)
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
        self.0.execute(self, &body(&self.0, request), step.scope.deadline, &deltas).await
    }
}
