//! The hook chain: an agent's remote hooks, called in registered order, each
//! within a strict deadline, failing closed.
//!
//! The chain is a plain fold with a `?` on every step: a hook's output is the
//! next hook's input, an unset reply keeps the value, and any failure ends the
//! fold with a [`HookError`]. The caller never gets the half-processed value
//! back on failure, so nothing pre-hook can leave through an error path.
//!
//! A hook's budget is `min(its deadline, what is left of the query's
//! deadline)`. It is sent as `grpc-timeout` and enforced here with
//! `tokio::time::timeout_at`, whatever the hook or the network does;
//! connecting (channels connect lazily) counts toward it.

use std::{fmt, sync::Arc, time::Duration};

use lattice_proto::{agent::v1 as apb, hooks::v1 as pb};
use tokio::time::Instant;
use tonic::{Code, metadata::MetadataValue, transport::Channel};
use tracing::{Instrument, debug, info_span, warn};

use crate::{
    config::{HookDef, HookEvents},
    convert::{self, DecodeError},
    domain::{JsonObject, ModelRequest, ToolResult, validate_conversation},
    metrics::{Family, Metrics},
    peer::{Addresses, Peer},
};

/// The two hook events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HookEvent {
    /// OnToolResult.
    ToolResult,
    /// OnModelRequest.
    ModelRequest,
}

impl HookEvent {
    /// The name used in config, errors and metadata.
    pub fn as_str(self) -> &'static str {
        match self {
            HookEvent::ToolResult => "tool_result",
            HookEvent::ModelRequest => "model_request",
        }
    }
}

impl fmt::Display for HookEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a failed hook call was about: a tool result or a turn's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HookSubject {
    /// The tool_use_id of the result.
    ToolUse(String),
    /// The 1-based turn of the model request.
    Turn(u32),
}

/// How a hook call failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HookFailure {
    /// It did not answer within its budget (or the budget was already spent).
    Deadline,
    /// It could not be reached: refused, reset, unresolvable.
    Unavailable,
    /// It answered with a non-OK status.
    Status(Code),
    /// Its reply was invalid; the reason names ids and positions, never content.
    InvalidReply(String),
}

impl HookFailure {
    /// The `kind` value in the ErrorInfo metadata.
    pub fn kind(&self) -> &'static str {
        match self {
            HookFailure::Deadline => "deadline",
            HookFailure::Unavailable => "unavailable",
            HookFailure::Status(_) => "status",
            HookFailure::InvalidReply(_) => "invalid_reply",
        }
    }
}

impl fmt::Display for HookFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HookFailure::Deadline => f.write_str("deadline exceeded"),
            HookFailure::Unavailable => f.write_str("unavailable"),
            HookFailure::Status(c) => write!(f, "returned status {c:?}"),
            HookFailure::InvalidReply(why) => write!(f, "invalid reply: {why}"),
        }
    }
}

/// A hook call failed. Aborts the query, always.
///
/// Its text names the agent, hook, event, subject and failure kind. It never
/// holds content, nor the hook's own status message (which could echo it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("hook {hook:?} of agent {agent:?} failed on {event} ({subject}): {failure}")]
pub struct HookError {
    /// The agent whose chain failed.
    pub agent: String,
    /// The hook's name.
    pub hook: String,
    /// The event.
    pub event: HookEvent,
    /// Which result or turn.
    pub subject: HookSubject,
    /// What went wrong.
    pub failure: HookFailure,
}

impl fmt::Display for HookSubject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HookSubject::ToolUse(id) => write!(f, "tool_use_id {id}"),
            HookSubject::Turn(t) => write!(f, "turn {t}"),
        }
    }
}

/// Where a hook call comes from.
#[derive(Debug, Clone)]
pub struct HookCtx<'a> {
    /// The session.
    pub session_id: &'a str,
    /// The query.
    pub query_id: &'a str,
    /// 1-based turn.
    pub turn: u32,
    /// The query's deadline: no hook call outlives it.
    pub deadline: Instant,
}

/// A tool call as the OnToolResult hooks see it.
#[derive(Debug, Clone)]
pub struct ToolCallView<'a> {
    /// The tool's name.
    pub tool_name: &'a str,
    /// The tool_use id.
    pub tool_use_id: &'a str,
    /// The model's raw input.
    pub input: &'a JsonObject,
    /// Why it did not execute successfully, if so.
    pub error: Option<pb::ToolError>,
    /// What produced the result.
    pub source: pb::ResultSource,
}

/// One hook, ready to call.
#[derive(Debug, Clone)]
struct Hook {
    name: String,
    events: HookEvents,
    deadline: Duration,
    client: pb::hook_service_client::HookServiceClient<Channel>,
    addresses: Addresses,
}

/// An agent's enabled hooks, in registered order.
#[derive(Debug, Clone, Default)]
pub struct HookChain {
    agent: String,
    hooks: Vec<Hook>,
    metrics: Arc<Metrics>,
}

/// A `grpc-timeout` header value for `d`: microseconds while they fit the
/// header's 8 digits, milliseconds beyond.
fn grpc_timeout(d: Duration) -> MetadataValue<tonic::metadata::Ascii> {
    let us = d.as_micros();
    let text = if us < 100_000_000 { format!("{}u", us.max(1)) } else { format!("{}m", d.as_millis().min(99_999_999)) };
    MetadataValue::try_from(text).unwrap_or_else(|_| MetadataValue::from_static("1m"))
}

impl HookChain {
    /// The chain of `agent`'s enabled hooks (disabled entries are skipped).
    /// On error, names the hook whose endpoint could not be used.
    pub fn new(
        agent: &str,
        defs: &[HookDef],
        max_message_bytes: usize,
        metrics: Arc<Metrics>,
    ) -> Result<Self, (String, String)> {
        let mut hooks = Vec::new();
        for d in defs.iter().filter(|d| d.enabled) {
            let peer = Peer::connect(&d.endpoint, d.tls.as_ref(), d.deadline).map_err(|e| (d.name.clone(), e))?;
            let client = pb::hook_service_client::HookServiceClient::new(peer.channel)
                .max_decoding_message_size(max_message_bytes)
                .max_encoding_message_size(max_message_bytes);
            hooks.push(Hook {
                name: d.name.clone(),
                events: d.events,
                deadline: d.deadline,
                client,
                addresses: peer.addresses,
            });
        }
        Ok(Self { agent: agent.to_owned(), hooks, metrics })
    }

    /// Whether any enabled hook handles tool results.
    pub fn handles_tool_results(&self) -> bool {
        self.hooks.iter().any(|h| h.events.tool_result)
    }

    fn error(&self, hook: &Hook, event: HookEvent, subject: HookSubject, failure: HookFailure) -> HookError {
        HookError { agent: self.agent.clone(), hook: hook.name.clone(), event, subject, failure }
    }

    /// Passes a tool result through every OnToolResult hook, in order.
    pub async fn on_tool_result(
        &self,
        ctx: &HookCtx<'_>,
        call: &ToolCallView<'_>,
        mut result: ToolResult,
    ) -> Result<ToolResult, HookError> {
        let subject = || HookSubject::ToolUse(call.tool_use_id.to_owned());
        for hook in self.hooks.iter().filter(|h| h.events.tool_result) {
            let request = pb::OnToolResultRequest {
                context: Some(self.context(ctx)),
                tool_name: call.tool_name.to_owned(),
                tool_use_id: call.tool_use_id.to_owned(),
                input: Some(convert::to_struct(call.input)),
                result: Some((&result).into()),
                error: call.error.clone(),
                source: Some(call.source.clone()),
            };
            let mut client = hook.client.clone();
            let reply = self
                .call(hook, ctx, HookEvent::ToolResult, subject(), request, |req| async move {
                    client.on_tool_result(req).await
                })
                .await?;
            if let Some(replacement) = reply.result {
                if replacement.tool_use_id != call.tool_use_id {
                    // The replacement's id is the hook's text: not repeated.
                    let why = "the replacement's tool_use_id differs from the result's".to_owned();
                    return Err(self.error(hook, HookEvent::ToolResult, subject(), HookFailure::InvalidReply(why)));
                }
                result = replacement.into();
            }
        }
        Ok(result)
    }

    /// Passes a model request through every OnModelRequest hook, in order.
    /// The result is for this one request: the caller's history is untouched.
    pub async fn on_model_request(
        &self,
        ctx: &HookCtx<'_>,
        mut request: ModelRequest,
    ) -> Result<ModelRequest, HookError> {
        for hook in self.hooks.iter().filter(|h| h.events.model_request) {
            let subject = || HookSubject::Turn(ctx.turn);
            let pb_request = pb::OnModelRequestRequest {
                context: Some(self.context(ctx)),
                system: request.system.clone(),
                messages: convert::messages_to_pb(&request.messages),
                tools: request.tools.iter().map(apb::ToolSpec::from).collect(),
            };
            let mut client = hook.client.clone();
            let reply = self
                .call(hook, ctx, HookEvent::ModelRequest, subject(), pb_request, |req| async move {
                    client.on_model_request(req).await
                })
                .await?;
            let invalid =
                |why: String| self.error(hook, HookEvent::ModelRequest, subject(), HookFailure::InvalidReply(why));
            if let Some(list) = reply.messages {
                let messages = convert::messages_from_pb(list.messages)
                    .map_err(|DecodeError(what)| invalid(format!("replacement messages: {what}")))?;
                validate_conversation(&messages).map_err(|why| invalid(format!("replacement messages: {why}")))?;
                request.messages = messages;
            }
            if let Some(system) = reply.system {
                request.system = system;
            }
        }
        Ok(request)
    }

    fn context(&self, ctx: &HookCtx<'_>) -> pb::HookContext {
        pb::HookContext {
            agent: self.agent.clone(),
            session_id: ctx.session_id.to_owned(),
            query_id: ctx.query_id.to_owned(),
            turn: ctx.turn,
        }
    }

    /// One hook RPC within its budget. Every way it can go wrong becomes a
    /// [`HookError`]; the hook's status message is logged by code only.
    async fn call<Req, Resp, F, Fut>(
        &self,
        hook: &Hook,
        ctx: &HookCtx<'_>,
        event: HookEvent,
        subject: HookSubject,
        message: Req,
        send: F,
    ) -> Result<Resp, HookError>
    where
        F: FnOnce(tonic::Request<Req>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let started = Instant::now();
        let call_deadline = ctx.deadline.min(started + hook.deadline);
        // One span per call; `outcome` and `elapsed_ms` are recorded when it ends.
        let span = info_span!(
            "hook",
            agent = %self.agent,
            hook = %hook.name,
            event = %event,
            subject = %subject,
            budget_ms = tracing::field::Empty,
            outcome = tracing::field::Empty,
            elapsed_ms = tracing::field::Empty,
        );
        let record = |outcome: &str| {
            let labels = vec![("agent", self.agent.clone()), ("hook", hook.name.clone()), ("event", event.to_string())];
            self.metrics.call(Family::HookCalls, Family::HookCallDuration, labels, outcome, started.elapsed());
        };
        let fail = |failure: HookFailure| {
            let elapsed_ms = started.elapsed().as_millis() as u64;
            record(failure.kind());
            span.record("outcome", failure.kind()).record("elapsed_ms", elapsed_ms);
            let code = match &failure {
                HookFailure::Status(c) => Some(*c),
                _ => None,
            };
            warn!(parent: &span, kind = failure.kind(), code = ?code, elapsed_ms, "hook failed");
            self.error(hook, event, subject.clone(), failure)
        };
        let budget = call_deadline.saturating_duration_since(started);
        if budget.is_zero() {
            return Err(fail(HookFailure::Deadline));
        }
        if hook.addresses.none() {
            return Err(fail(HookFailure::Unavailable));
        }
        span.record("budget_ms", budget.as_millis() as u64);
        let mut request = tonic::Request::new(message);
        request.metadata_mut().insert("grpc-timeout", grpc_timeout(budget));
        let outcome = tokio::time::timeout_at(call_deadline, send(request)).instrument(span.clone()).await;
        match outcome {
            Err(_elapsed) => Err(fail(HookFailure::Deadline)),
            Ok(Err(status)) => Err(fail(classify(&status, call_deadline))),
            Ok(Ok(reply)) => {
                let elapsed_ms = started.elapsed().as_millis() as u64;
                record("ok");
                span.record("outcome", "ok").record("elapsed_ms", elapsed_ms);
                debug!(parent: &span, elapsed_ms, "hook answered");
                Ok(reply.into_inner())
            }
        }
    }
}

/// Maps a failed call's status to a failure kind. Transport errors reach
/// tonic clients as `Unavailable` (refused, reset) or `Unknown`/`Internal`
/// (broken HTTP/2); a `DeadlineExceeded` or `Cancelled` from the peer's own
/// timer is a deadline; decode and size errors are invalid replies.
fn classify(status: &tonic::Status, call_deadline: Instant) -> HookFailure {
    match status.code() {
        Code::Unavailable => HookFailure::Unavailable,
        Code::DeadlineExceeded => HookFailure::Deadline,
        Code::Cancelled if Instant::now() + Duration::from_millis(5) >= call_deadline => HookFailure::Deadline,
        Code::OutOfRange | Code::ResourceExhausted
            if status.message().contains("message length too large")
                || status.message().contains("decoded message length") =>
        {
            HookFailure::InvalidReply("reply exceeds the size limit".into())
        }
        Code::Internal if status.message().contains("decode") || status.message().contains("Decode") => {
            HookFailure::InvalidReply("reply does not decode".into())
        }
        code => HookFailure::Status(code),
    }
}
