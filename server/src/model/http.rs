//! What the HTTP providers share: one client per model, the retry loop
//! (exponential backoff with jitter, `retry-after`, a retry budget, all
//! within the request's deadline), and the mapping of HTTP failures to
//! [`ModelError`]s that name the provider and the status, never content or
//! the key.

use std::{sync::Once, time::Duration};

use bytes::Bytes;
use serde::Serialize;
use serde_json::Value;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::{
    config::HttpModelConfig,
    domain::AssistantReply,
    model::{DeltaSink, ModelError, ModelErrorKind},
};

/// The longest `retry-after` honoured (a larger one gives up instead).
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

/// How one attempt failed.
#[derive(Debug)]
pub(super) enum Failure {
    /// Worth another attempt: 429, 5xx, overloaded, connection errors, a
    /// stream cut short.
    Retry {
        /// What happened (no content).
        message: String,
        /// The server's `retry-after`.
        retry_after: Option<Duration>,
    },
    /// Final.
    Fatal(ModelErrorKind, String),
}

impl Failure {
    pub(super) fn retry(message: impl Into<String>) -> Self {
        Failure::Retry { message: message.into(), retry_after: None }
    }

    pub(super) fn invalid(message: impl Into<String>) -> Self {
        Failure::Fatal(ModelErrorKind::InvalidResponse, message.into())
    }
}

/// One provider's wire format.
#[tonic::async_trait]
pub(super) trait Wire: Send + Sync {
    /// The HTTP request for `body`, a JSON document (URL, auth, version
    /// and content-type headers).
    fn request(&self, http: &HttpModel, body: &Bytes) -> reqwest::RequestBuilder;
    /// Reads a successful response, streamed or whole. `delivered` is set
    /// once any text went to `deltas` (the attempt can't be retried then).
    async fn read(
        &self,
        response: reqwest::Response,
        stream: bool,
        deltas: &DeltaSink,
        delivered: &mut bool,
    ) -> Result<AssistantReply, Failure>;
}

/// An HTTP model's client and settings.
#[derive(Debug)]
pub(super) struct HttpModel {
    pub(super) cfg: HttpModelConfig,
    pub(super) client: reqwest::Client,
}

static CRYPTO: Once = Once::new();

impl HttpModel {
    pub(super) fn new(cfg: HttpModelConfig) -> Result<Self, String> {
        // rustls' process-wide provider: ring, installed once.
        CRYPTO.call_once(|| {
            let _ = rustls::crypto::ring::default_provider().install_default();
        });
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .pool_idle_timeout(Duration::from_secs(60))
            .user_agent(concat!("lattice/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
        Ok(Self { cfg, client })
    }

    /// A POST of the JSON document `body` to `path` of the API.
    pub(super) fn post_json(&self, path: &str, body: &Bytes) -> reqwest::RequestBuilder {
        self.client
            .post(format!("{}{path}", self.cfg.base_url))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(body.clone())
    }

    fn error(&self, kind: ModelErrorKind, message: String) -> ModelError {
        ModelError { provider: self.cfg.provider.as_str().to_owned(), kind, message }
    }

    /// Writes a request body as JSON, once for all its attempts.
    pub(super) fn encode(&self, body: &impl Serialize) -> Result<Bytes, ModelError> {
        serde_json::to_vec(body)
            .map(Bytes::from)
            .map_err(|_| self.error(ModelErrorKind::InvalidRequest, "the request could not be written as JSON".into()))
    }

    /// Sends `body` until it succeeds, fails for good, runs out of retries,
    /// or would pass the deadline: `min(the model's deadline, the query's)`.
    /// Every attempt is cut at that deadline, and no retry waits past it.
    pub(super) async fn execute(
        &self,
        wire: &dyn Wire,
        body: &Bytes,
        query_deadline: Instant,
        deltas: &DeltaSink,
    ) -> Result<AssistantReply, ModelError> {
        let deadline = (Instant::now() + self.cfg.deadline).min(query_deadline);
        let mut retries = 0;
        let mut delivered = false;
        // Why the previous attempt failed, for an error once the deadline
        // cuts the retry.
        let mut last_failure: Option<String> = None;
        loop {
            let started = Instant::now();
            let attempt = async {
                let mut builder = wire.request(self, body);
                if crate::telemetry::enabled() {
                    let mut headers = http::HeaderMap::new();
                    crate::telemetry::inject_headers(&mut headers);
                    builder = builder.headers(headers);
                }
                let response = builder.send().await.map_err(|e| Failure::retry(describe(&e)))?;
                if !response.status().is_success() {
                    return Err(http_failure(response).await);
                }
                wire.read(response, self.cfg.stream, deltas, &mut delivered).await
            };
            let outcome = match tokio::time::timeout_at(deadline, attempt).await {
                Ok(outcome) => outcome,
                Err(_) => {
                    let message = match &last_failure {
                        Some(why) => format!("no complete answer within the deadline (the previous attempt: {why})"),
                        None => "no complete answer within the deadline".into(),
                    };
                    return Err(self.error(ModelErrorKind::Unavailable, message));
                }
            };
            let (message, retry_after) = match outcome {
                Ok(reply) => {
                    debug!(
                        provider = self.cfg.provider.as_str(),
                        retries,
                        elapsed_ms = started.elapsed().as_millis() as u64,
                        "model answered"
                    );
                    return Ok(reply);
                }
                Err(Failure::Fatal(kind, message)) => return Err(self.error(kind, message)),
                Err(Failure::Retry { message, .. }) if delivered => {
                    return Err(self.error(
                        ModelErrorKind::InvalidResponse,
                        format!("{message} after part of the reply was streamed (not retried)"),
                    ));
                }
                Err(Failure::Retry { message, retry_after }) => (message, retry_after),
            };
            if retries >= self.cfg.retries {
                return Err(
                    self.error(ModelErrorKind::Unavailable, format!("{message} (gave up after {retries} retries)"))
                );
            }
            let wait = retry_wait(Instant::now(), deadline, retry_after, retries)
                .map_err(|why| self.error(ModelErrorKind::Unavailable, format!("{message} ({why})")))?;
            warn!(provider = self.cfg.provider.as_str(), retry = retries + 1, wait_ms = wait.as_millis() as u64, reason = %message, "model request failed; retrying");
            last_failure = Some(message);
            tokio::time::sleep(wait).await;
            retries += 1;
        }
    }
}

/// How long to wait before retry number `retries + 1`: the server's
/// `retry-after`, or the backoff. An error when that wait would not end
/// before `deadline` (nothing could be tried after it), or when the server
/// asks for longer than [`MAX_RETRY_AFTER`].
fn retry_wait(
    now: Instant,
    deadline: Instant,
    retry_after: Option<Duration>,
    retries: u32,
) -> Result<Duration, String> {
    let wait = match retry_after {
        Some(w) if w > MAX_RETRY_AFTER => return Err(format!("retry-after {} s is too long", w.as_secs())),
        Some(w) => w,
        None => backoff(retries),
    };
    if now + wait >= deadline {
        return Err("no time left to retry within the deadline".into());
    }
    Ok(wait)
}

/// 0.5 s, 1 s, 2 s … capped at 8 s, each scaled by a random 50-100 %.
fn backoff(retry: u32) -> Duration {
    let base = Duration::from_millis(500).saturating_mul(1 << retry.min(4)).min(Duration::from_secs(8));
    let jitter = (uuid::Uuid::new_v4().as_u128() % 1000) as f64 / 1000.0;
    base.mul_f64(0.5 + jitter / 2.0)
}

/// A transport error, without the URL's query or anything from the body.
fn describe(e: &reqwest::Error) -> String {
    if e.is_connect() {
        "cannot connect".into()
    } else if e.is_timeout() {
        "timed out".into()
    } else if e.is_body() || e.is_decode() {
        "the response body broke off".into()
    } else {
        "the request failed".into()
    }
}

/// Maps a non-2xx response: the status and the provider's error type (not
/// its message, which may quote the request).
async fn http_failure(response: reqwest::Response) -> Failure {
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(Duration::from_secs_f64);
    let body: Value = response.json().await.unwrap_or(Value::Null);
    let error_type = body["error"]["type"].as_str().or(body["error"]["code"].as_str()).map(str::to_owned);
    let message = match error_type {
        Some(t) => format!("HTTP {status} ({t})"),
        None => format!("HTTP {status}"),
    };
    match status {
        401 => Failure::Fatal(ModelErrorKind::Unauthenticated, message),
        403 => Failure::Fatal(ModelErrorKind::PermissionDenied, message),
        408 | 409 | 429 | 500..=599 => Failure::Retry { message, retry_after },
        _ => Failure::Fatal(ModelErrorKind::InvalidRequest, message),
    }
}

/// A slice written as a JSON array of what `f` makes of each item, with no
/// copy of the items.
pub(super) struct Seq<'a, T, F>(&'a [T], F);

/// A [`Seq`] of `items`.
pub(super) fn seq<'a, T, R: Serialize, F: Fn(&'a T) -> R>(items: &'a [T], f: F) -> Seq<'a, T, F> {
    Seq(items, f)
}

impl<'a, T, R: Serialize, F: Fn(&'a T) -> R> Serialize for Seq<'a, T, F> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(&self.1))
    }
}

/// Parses a JSON body, or says it isn't one.
pub(super) async fn json_body(response: reqwest::Response) -> Result<Value, Failure> {
    let bytes = response.bytes().await.map_err(|e| Failure::retry(describe(&e)))?;
    serde_json::from_slice(&bytes).map_err(|_| Failure::invalid("the response is not valid JSON"))
}

/// Parses a tool call's input: a JSON object, empty meaning `{}`.
pub(super) fn tool_input(raw: &str) -> Result<serde_json::Map<String, Value>, Failure> {
    if raw.trim().is_empty() {
        return Ok(serde_json::Map::new());
    }
    match serde_json::from_str(raw) {
        Ok(Value::Object(o)) => Ok(o),
        _ => Err(Failure::invalid("a tool call's input is not a JSON object")),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::domain::ModelRequest;

    /// A retry waits for the server's retry-after, or the backoff, only if
    /// the wait ends before the deadline (the query's, when it is earlier).
    #[tokio::test(start_paused = true)]
    async fn no_retry_waits_past_the_deadline() {
        let now = Instant::now();
        let s = Duration::from_secs;
        assert_eq!(retry_wait(now, now + s(5), Some(s(1)), 0), Ok(s(1)));
        assert!(retry_wait(now, now + s(1), Some(s(1)), 0).is_err());
        assert!(retry_wait(now, now + s(3600), Some(s(61)), 0).unwrap_err().contains("too long"));
        // The backoff (at most 8 s) is held to the same rule.
        assert!(retry_wait(now, now + Duration::from_millis(200), None, 4).is_err());
        let backoff = retry_wait(now, now + s(60), None, 1).unwrap();
        assert!(backoff >= Duration::from_millis(500) && backoff <= s(1), "{backoff:?}");
    }

    /// A request with every kind of block, text that JSON escapes, a
    /// temperature and tools.
    fn rich_request() -> ModelRequest<'static> {
        use crate::domain::{Block, Message, Role, ToolResult, ToolSpec, ToolUse};
        let input = json!({"q": "ada \"lovelace\"", "n": [1, 2.5], "deep": {"z": null, "a": true}});
        let input = input.as_object().cloned().unwrap_or_default();
        let tools = vec![ToolSpec {
            name: "lookup".into(),
            description: "finds\nthings".into(),
            input_schema: json!({"type": "object"}).as_object().cloned().unwrap_or_default(),
        }];
        let messages = vec![
            Message::user_text("find \"ada\"\n\t\u{1}é😀"),
            Message {
                role: Role::Assistant,
                content: std::sync::Arc::new([
                    Block::Text { text: "looking".into() },
                    Block::Text { text: String::new() },
                    Block::ToolUse(ToolUse { id: "t1".into(), name: "lookup".into(), input }),
                    Block::ToolUse(ToolUse { id: "t2".into(), name: "lookup".into(), input: Default::default() }),
                ]),
            },
            Message {
                role: Role::User,
                content: std::sync::Arc::new([
                    Block::ToolResult(ToolResult {
                        tool_use_id: "t1".into(),
                        content: vec!["a".into(), "b\"".into()],
                        is_error: false,
                    }),
                    Block::ToolResult(ToolResult {
                        tool_use_id: "t2".into(),
                        content: vec!["boom".into()],
                        is_error: true,
                    }),
                    Block::Text { text: "and".into() },
                    Block::Text { text: "more".into() },
                ]),
            },
            Message {
                role: Role::Assistant,
                content: std::sync::Arc::new([Block::ToolUse(ToolUse {
                    id: "t3".into(),
                    name: "lookup".into(),
                    input: Default::default(),
                })]),
            },
        ];
        ModelRequest { system: "be \"brief\"".into(), messages: messages.into(), tools: tools.into() }
    }

    fn model(provider: crate::config::Provider, stream: bool) -> Result<HttpModel, String> {
        HttpModel::new(HttpModelConfig {
            provider,
            model: "m".into(),
            base_url: "http://127.0.0.1:1".into(),
            api_key_env: "K".into(),
            api_key: "k".into(),
            max_tokens: 512,
            temperature: Some(0.3),
            deadline: Duration::from_secs(1),
            retries: 0,
            stream,
        })
    }

    /// Each provider's body is written straight from the request, and is
    /// the same bytes as the API's JSON object for it (its keys sorted, as
    /// a JSON object writes them).
    #[test]
    fn request_bodies_are_the_apis_json_objects() -> Result<(), String> {
        use crate::config::Provider;
        let request = rich_request();
        for stream in [false, true] {
            let http = model(Provider::Anthropic, stream)?;
            let written = http.encode(&super::super::anthropic::body(&http, &request)).map_err(|e| e.message)?;
            let mut expected = json!({"max_tokens": 512, "model": "m", "system": "be \"brief\"", "temperature": 0.3,
            "tools": [{"name": "lookup", "description": "finds\nthings", "input_schema": {"type": "object"}}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "find \"ada\"\n\t\u{1}é😀"}]},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "looking"},
                    {"type": "text", "text": ""},
                    {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": "ada \"lovelace\"", "n": [1, 2.5], "deep": {"z": null, "a": true}}},
                    {"type": "tool_use", "id": "t2", "name": "lookup", "input": {}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b\""}]},
                    {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "boom"}], "is_error": true},
                    {"type": "text", "text": "and"},
                    {"type": "text", "text": "more"},
                ]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t3", "name": "lookup", "input": {}}]},
            ]});
            if stream {
                expected["stream"] = json!(true);
            }
            assert_eq!(String::from_utf8_lossy(&written), expected.to_string(), "anthropic, stream {stream}");

            let http = model(Provider::OpenAi, stream)?;
            let written = http.encode(&super::super::openai::body(&http, &request)).map_err(|e| e.message)?;
            let call = |id: &str, arguments: &str| json!({"id": id, "type": "function", "function": {"name": "lookup", "arguments": arguments}});
            let mut expected = json!({"max_tokens": 512, "model": "m", "temperature": 0.3,
            "tools": [{"type": "function", "function": {"name": "lookup", "description": "finds\nthings", "parameters": {"type": "object"}}}],
            "messages": [
                {"role": "system", "content": "be \"brief\""},
                {"role": "user", "content": "find \"ada\"\n\t\u{1}é😀"},
                {"role": "assistant", "content": "looking\n\n", "tool_calls": [
                    call("t1", r#"{"deep":{"a":true,"z":null},"n":[1,2.5],"q":"ada \"lovelace\""}"#),
                    call("t2", "{}"),
                ]},
                {"role": "tool", "tool_call_id": "t1", "content": "ab\""},
                {"role": "tool", "tool_call_id": "t2", "content": "ERROR: boom"},
                {"role": "user", "content": "and\n\nmore"},
                {"role": "assistant", "content": null, "tool_calls": [call("t3", "{}")]},
            ]});
            if stream {
                expected["stream"] = json!(true);
                expected["stream_options"] = json!({"include_usage": true});
            }
            assert_eq!(String::from_utf8_lossy(&written), expected.to_string(), "openai, stream {stream}");
        }
        // Without a system prompt, tools or temperature, those keys are left out.
        let mut http = model(Provider::Anthropic, false)?;
        http.cfg.temperature = None;
        let bare = ModelRequest { system: "".into(), messages: request.messages.clone(), tools: Vec::new().into() };
        let written = http.encode(&super::super::anthropic::body(&http, &bare)).map_err(|e| e.message)?;
        let keys: Vec<String> = serde_json::from_slice::<serde_json::Map<String, Value>>(&written)
            .map_err(|e| e.to_string())?
            .keys()
            .cloned()
            .collect();
        assert_eq!(keys, ["max_tokens", "messages", "model"]);
        http.cfg.provider = Provider::OpenAi;
        let written = http.encode(&super::super::openai::body(&http, &bare)).map_err(|e| e.message)?;
        let sent: Value = serde_json::from_slice(&written).map_err(|e| e.to_string())?;
        assert_eq!(
            sent.as_object().map(|o| o.keys().cloned().collect::<Vec<_>>()),
            Some(vec!["max_tokens".into(), "messages".into(), "model".into()])
        );
        assert_eq!(sent["messages"][0]["role"], "user", "no system message");
        Ok(())
    }
}
