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
//! connecting (channels connect lazily) counts toward it. When the query's
//! own deadline is the one that cuts a call short, the query ends
//! DEADLINE_EXCEEDED ([`ChainError::QueryDeadline`]): the hook did nothing
//! wrong, and the value still goes nowhere.
//!
//! A failure's kind is decided from the error's structure, never from text
//! the hook controls: see `classify`.

use std::{borrow::Cow, sync::Arc, time::Duration};

use lattice_proto::{agent::v1 as apb, hooks::v1 as pb};
use prost::Message as _;
use tokio::time::Instant;
use tonic::Code;
use tracing::{Instrument, debug, debug_span, info, warn};

use crate::{
    config::{HookDef, HookEvents, MatchConditions},
    convert::{self, DecodeError},
    domain::{JsonObject, Message, ModelRequest, ResultSource, Role, ToolFailure, ToolResult, validate_conversation},
    grpc::code_name,
    metrics::{CallMetric, Family, Metrics},
    peer::{CallDeadline, Peer, Probe},
    scope::Step,
};

/// What one hook of a chain did (see [`HookChain::on_tool_result_observed`]).
#[derive(Debug)]
pub struct Observed<'a, V> {
    /// The hook.
    pub hook: &'a str,
    /// Whether its match conditions let it see the value (else it was not
    /// called, and the value went on as it was).
    pub matched: bool,
    /// How long its call took.
    pub took: Duration,
    /// Whether it sent a replacement.
    pub replaced: bool,
    /// Whether the value it passed on differs from the one it was given.
    pub changed: bool,
    /// The value it passed on, or how it failed (the chain stops there).
    pub outcome: Result<&'a V, &'a ChainError>,
}

/// Told what each hook of a chain did.
pub type Observer<'o, V> = dyn for<'a> FnMut(Observed<'a, V>) + Send + 'o;

/// Tells `observe`, if any, that `hook` failed with `e`.
fn observe_failure<V>(observe: Option<&mut &mut Observer<'_, V>>, hook: &str, started: Instant, e: &ChainError) {
    if let Some(observe) = observe {
        let outcome = Err(e);
        observe(Observed { hook, matched: true, took: started.elapsed(), replaced: false, changed: false, outcome });
    }
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
    pub error: Option<ToolFailure>,
    /// What produced the result.
    pub source: ResultSource,
}

/// One hook, ready to call.
#[derive(Debug, Clone)]
struct Hook {
    name: String,
    /// Its endpoint, as configured (for logs).
    endpoint: String,
    events: HookEvents,
    deadline: Duration,
    peer: Peer,
    /// The largest reply it may send.
    max_reply: usize,
    /// Whether Lattice is ready only while this hook has a ready address.
    required: bool,
    /// Which values it is called for.
    conditions: MatchConditions,
    /// Its calls' metrics, per event ([`HookEvent::index`]), made once.
    metrics: [Arc<CallMetric>; 2],
}

/// The outcomes a hook call's metric counts.
const OUTCOMES: &[&str] =
    &["ok", "deadline", "cancelled", "unavailable", "status", "invalid_reply", "request_too_large"];

/// An agent's enabled hooks, in registered order.
#[derive(Debug, Clone, Default)]
pub struct HookChain {
    agent: String,
    /// The hooks that run in order (every enabled hook but the shadows).
    hooks: Vec<Hook>,
    /// Shadow hooks (see `shadow`).
    shadows: Vec<shadow::Shadow>,
    /// See [`crate::audit::chain_version`].
    version: String,
    /// The largest request or reply of a hook call.
    max_message_bytes: usize,
    metrics: Arc<Metrics>,
}

impl HookChain {
    /// The chain of `agent`'s enabled hooks (disabled entries are skipped).
    /// On error, names the hook whose endpoint could not be used.
    pub fn new(
        agent: &str,
        defs: &[HookDef],
        max_message_bytes: usize,
        transport: &crate::peer::Transport,
        metrics: Arc<Metrics>,
    ) -> Result<Self, (String, String)> {
        let mut peers = Vec::new();
        for d in defs.iter().filter(|d| d.enabled) {
            // Half the deadline to connect: an address that no longer
            // answers (a pod gone without a reset) then leaves time to send
            // the call to another one.
            let peer = Peer::connect(&d.endpoint, d.tls.as_ref(), d.deadline / 2, transport)
                .map_err(|e| (d.name.clone(), e))?;
            peers.push((d.clone(), peer));
        }
        Ok(Self::over(agent, peers, max_message_bytes, metrics))
    }

    /// The chain over peers, one per enabled hook, in order (tests pass
    /// in-process peers here). Each hook's ready addresses are a gauge.
    pub fn over(agent: &str, hooks: Vec<(HookDef, Peer)>, max_message_bytes: usize, metrics: Arc<Metrics>) -> Self {
        let version = crate::audit::chain_version(&hooks.iter().map(|(d, _)| d.clone()).collect::<Vec<_>>());
        let (mut ordered, mut shadows) = (Vec::new(), Vec::new());
        let hooks = hooks.into_iter().map(|(d, peer)| {
            metrics.gauge(
                Family::HookReadyAddresses,
                vec![("agent", agent.to_owned()), ("hook", d.name.clone()), ("endpoint", d.endpoint.clone())],
                peer.ready_gauge(),
            );
            let call_metrics = [HookEvent::ToolResult, HookEvent::ModelRequest].map(|e| {
                let labels = vec![("agent", agent.to_owned()), ("hook", d.name.clone()), ("event", e.to_string())];
                metrics.call_metric(Family::HookCalls, Some(Family::HookCallDuration), labels, OUTCOMES)
            });
            let hook = Hook {
                max_reply: max_message_bytes,
                name: d.name,
                endpoint: d.endpoint,
                events: d.events,
                deadline: d.deadline,
                required: d.required,
                conditions: d.conditions,
                metrics: call_metrics,
                peer,
            };
            (d.shadow_of, hook)
        });
        for (shadow_of, hook) in hooks {
            match shadow_of {
                Some(of) => shadows.push(shadow::Shadow { of, hook }),
                None => ordered.push(hook),
            }
        }
        Self { agent: agent.to_owned(), hooks: ordered, shadows, version, max_message_bytes, metrics }
    }

    /// The version of this chain's configuration (see
    /// [`crate::audit::chain_version`]).
    pub fn version(&self) -> &str {
        &self.version
    }

    /// Adds one call to the query's audit record, if it keeps one.
    #[allow(clippy::too_many_arguments)]
    fn audit(
        &self,
        step: Step<'_>,
        hook: &Hook,
        event: HookEvent,
        subject: &HookSubject,
        position: u32,
        before: String,
        after: Result<Option<String>, &ChainError>,
    ) {
        let (outcome, after) = match after {
            Ok(after) => ("ok", Some(after.unwrap_or_else(|| before.clone()))),
            Err(ChainError::Hook(e)) => (e.failure.kind(), None),
            Err(ChainError::QueryDeadline) => ("query_deadline", None),
        };
        Self::record_entry(step, hook, event, subject, position, outcome, before, after);
    }

    /// Records in the query's audit record, if it keeps one, that `hook`'s
    /// conditions left the value out: not called, the value unchanged.
    fn audit_not_matched(
        &self,
        step: Step<'_>,
        hook: &Hook,
        event: HookEvent,
        subject: &HookSubject,
        position: u32,
        digest: &str,
    ) {
        let (before, after) = (digest.to_owned(), Some(digest.to_owned()));
        Self::record_entry(step, hook, event, subject, position, "not_matched", before, after);
    }

    /// Adds one entry to the query's audit record, if it keeps one.
    #[allow(clippy::too_many_arguments)]
    fn record_entry(
        step: Step<'_>,
        hook: &Hook,
        event: HookEvent,
        subject: &HookSubject,
        position: u32,
        outcome: &'static str,
        before: String,
        after: Option<String>,
    ) {
        let Some(audit) = &step.scope.audit else { return };
        audit.record(crate::audit::AuditEntry {
            agent: step.scope.agent.clone(),
            hook: hook.name.clone(),
            event: event.as_str(),
            subject: subject.audit_text(),
            position,
            outcome,
            changed: after.as_ref().is_some_and(|a| *a != before),
            digest_before: before,
            digest_after: after,
        });
    }

    /// Each hook's name, how many of its addresses are ready now, and
    /// whether it is required (see [`HookChain::required_ready`]).
    pub fn readiness(&self) -> Vec<(String, usize, bool)> {
        let all = self.hooks.iter().chain(self.shadows.iter().map(|s| &s.hook));
        all.map(|h| (h.name.clone(), h.peer.ready_addresses(), h.required)).collect()
    }

    /// The first required hook with no ready address, if any: while there
    /// is one, every query of this agent would abort, so Lattice reports
    /// NOT_SERVING.
    pub fn required_ready(&self) -> Result<(), String> {
        match self.hooks.iter().find(|h| h.required && h.peer.ready_addresses() == 0) {
            Some(h) => Err(format!("hook {:?} of agent {:?} has no ready address", h.name, self.agent)),
            None => Ok(()),
        }
    }

    /// Whether any enabled hook handles tool results.
    pub fn handles_tool_results(&self) -> bool {
        self.hooks.iter().any(|h| h.events.tool_result)
    }

    /// Before a reply's tool calls run: fails when an OnToolResult hook
    /// can't be reached right now (see [`Peer::unreachable`]: a `dns:///`
    /// name that resolves to nothing, or whose every address refused, went
    /// away or reports NOT_SERVING; a single address whose health check
    /// could not connect), since every result would then be thrown away
    /// after the tools' side effects. An address not checked yet is checked
    /// first, within `until`. `tool_use_id` is the first call's, for the
    /// error.
    pub async fn preflight_tool_results(&self, tool_use_id: &str, until: Instant) -> Result<(), ChainError> {
        let mut down = None;
        for hook in self.hooks.iter().filter(|h| h.events.tool_result) {
            if hook.peer.unreachable(until).await {
                down = Some(hook);
                break;
            }
        }
        let Some(hook) = down else {
            return Ok(());
        };
        let metric = &hook.metrics[HookEvent::ToolResult.index()];
        metric.start(&self.metrics, Instant::now()).finish("unavailable");
        let (event, subject) = (HookEvent::ToolResult, HookSubject::ToolUse(tool_use_id.to_owned()));
        let failure = HookFailure::Unavailable;
        let cause = hook.peer.down_reason();
        warn!(agent = %self.agent, hook = %hook.name, endpoint = %hook.endpoint, %event, %subject, kind = failure.kind(), %cause, when = "before the tool calls", "hook failed");
        Err(self.error(hook, event, subject, failure).into())
    }

    fn error(&self, hook: &Hook, event: HookEvent, subject: HookSubject, failure: HookFailure) -> HookError {
        HookError { agent: self.agent.clone(), hook: hook.name.clone(), event, subject, failure }
    }

    /// Passes a tool result through every OnToolResult hook, in order.
    pub async fn on_tool_result(
        &self,
        step: Step<'_>,
        call: &ToolCallView<'_>,
        result: ToolResult,
    ) -> Result<ToolResult, ChainError> {
        self.on_tool_result_observed(step, call, result, None).await
    }

    /// [`HookChain::on_tool_result`], telling `observe` (when set) what each
    /// hook did (a dry run of the chain reports it). Without an observer
    /// nothing more is done than a query needs: no value is compared.
    pub async fn on_tool_result_observed(
        &self,
        step: Step<'_>,
        call: &ToolCallView<'_>,
        result: ToolResult,
        mut observe: Option<&mut Observer<'_, ToolResult>>,
    ) -> Result<ToolResult, ChainError> {
        if !self.handles_tool_results() {
            return Ok(result);
        }
        let subject = || HookSubject::ToolUse(call.tool_use_id.to_owned());
        let audit = step.scope.audit.as_deref();
        let mut digest = audit.map(|a| a.digest.tool_result(&result));
        // What every hook's request carries around the result, encoded once;
        // the result is shared with each request, not copied into it.
        let around = wire::Around::tool_result(pb::OnToolResultRequest {
            context: Some(self.context(step)),
            tool_name: call.tool_name.to_owned(),
            tool_use_id: call.tool_use_id.to_owned(),
            input: Some(convert::to_struct(call.input)),
            result: None,
            error: call.error.as_ref().map(Into::into),
            source: Some((&call.source).into()),
        });
        let mut result = Arc::new(result);
        for (position, hook) in self.hooks.iter().filter(|h| h.events.tool_result).enumerate() {
            if !hook.conditions.matches_tool(call.tool_name) {
                if let Some(before) = &digest {
                    let (event, position) = (HookEvent::ToolResult, position as u32 + 1);
                    self.audit_not_matched(step, hook, event, &subject(), position, before);
                }
                if let Some(observe) = observe.as_mut() {
                    let outcome = Ok(&*result);
                    let (matched, took) = (false, Duration::ZERO);
                    observe(Observed { hook: &hook.name, matched, took, replaced: false, changed: false, outcome });
                }
                continue;
            }
            let request = around.with_result(result.clone());
            let shadows = self.shadow_tool_results(hook, step, &request, &result, call.tool_use_id);
            let send = |req, len| crate::peer::unary(hook.peer.clone(), wire::ON_TOOL_RESULT, req, len, hook.max_reply);
            let accept = |reply: pb::OnToolResultResponse| match reply.result {
                // The replacement's id is the hook's text: not repeated.
                Some(r) if r.tool_use_id != call.tool_use_id => {
                    Err("the replacement's tool_use_id differs from the result's".to_owned())
                }
                replacement => Ok(replacement.map(ToolResult::from)),
            };
            let started = Instant::now();
            match self.call(hook, step, HookEvent::ToolResult, subject(), request, send, accept).await {
                Ok(replacement) => {
                    let replaced = replacement.is_some();
                    let changed = observe.is_some() && replacement.as_ref().is_some_and(|r| *r != *result);
                    if let Some(r) = replacement {
                        result = Arc::new(r);
                    }
                    if !shadows.is_empty() {
                        let digest = shadow::digest(step);
                        let output = digest.tool_result(&result);
                        shadows.into_iter().for_each(|primary| primary.tell(Some(output.clone())));
                    }
                    if let Some(before) = digest.take() {
                        let after = audit.filter(|_| replaced).map(|a| a.digest.tool_result(&result));
                        let kept = after.clone().unwrap_or_else(|| before.clone());
                        let (event, position) = (HookEvent::ToolResult, position as u32 + 1);
                        self.audit(step, hook, event, &subject(), position, before, Ok(after));
                        digest = Some(kept);
                    }
                    if let Some(observe) = observe.as_mut() {
                        let outcome = Ok(&*result);
                        let (hook, matched, took) = (&hook.name, true, started.elapsed());
                        observe(Observed { hook, matched, took, replaced, changed, outcome });
                    }
                }
                Err(e) => {
                    if let Some(before) = digest.take() {
                        let position = position as u32 + 1;
                        self.audit(step, hook, HookEvent::ToolResult, &subject(), position, before, Err(&e));
                    }
                    observe_failure(observe.as_mut(), &hook.name, started, &e);
                    return Err(e);
                }
            }
        }
        // Each request was dropped once encoded: the value is not shared.
        Ok(Arc::try_unwrap(result).unwrap_or_else(|shared| (*shared).clone()))
    }

    /// Passes a model request through every OnModelRequest hook, in order.
    /// The result is for this one request: the caller's history is untouched.
    pub async fn on_model_request<'r>(
        &self,
        step: Step<'_>,
        request: ModelRequest<'r>,
    ) -> Result<ModelRequest<'r>, ChainError> {
        self.on_model_request_observed(step, request, None).await
    }

    /// [`HookChain::on_model_request`], telling `observe` (when set) what
    /// each hook did.
    pub async fn on_model_request_observed<'r>(
        &self,
        step: Step<'_>,
        mut request: ModelRequest<'r>,
        mut observe: Option<&mut Observer<'_, ModelRequest<'r>>>,
    ) -> Result<ModelRequest<'r>, ChainError> {
        if !self.hooks.iter().any(|h| h.events.model_request) {
            return Ok(request);
        }
        let tools: Vec<apb::ToolSpec> = request.tools.iter().map(apb::ToolSpec::from).collect();
        let mut messages = convert::messages_to_pb(&request.messages);
        // A conversation that outgrew the hook limit goes on in a window of
        // its newest messages: the hooks and the model see the same one.
        let base = pb::OnModelRequestRequest {
            context: Some(self.context(step)),
            system: request.system.to_string(),
            messages: Vec::new(),
            tools,
            omitted_messages: u32::MAX,
        };
        let omitted = window(&request.messages, &messages, base.encoded_len(), self.max_message_bytes);
        if omitted > 0 {
            info!(agent = %self.agent, turn = step.turn, omitted, kept = messages.len() - omitted, limit = self.max_message_bytes, "model request cut to the hook message limit");
            request.messages = match request.messages {
                Cow::Borrowed(all) => Cow::Borrowed(&all[omitted..]),
                Cow::Owned(mut all) => {
                    all.drain(..omitted);
                    Cow::Owned(all)
                }
            };
            messages.drain(..omitted);
        }
        // What every hook's request carries around the system prompt and
        // the messages, encoded once; the messages in protobuf are shared
        // with each request, and converted again only after a replacement.
        let around =
            wire::Around::model_request(pb::OnModelRequestRequest { omitted_messages: omitted as u32, ..base });
        let mut messages = Arc::new(messages);
        let audit = step.scope.audit.as_deref();
        let mut digest = audit.map(|a| a.digest.model_request(&request));
        for (position, hook) in self.hooks.iter().filter(|h| h.events.model_request).enumerate() {
            let position = position as u32 + 1;
            if !hook.conditions.matches_request(request.messages.len()) {
                if let Some(before) = &digest {
                    let subject = HookSubject::Turn(step.turn);
                    self.audit_not_matched(step, hook, HookEvent::ModelRequest, &subject, position, before);
                }
                if let Some(observe) = observe.as_mut() {
                    let outcome = Ok(&request);
                    let (matched, took) = (false, Duration::ZERO);
                    observe(Observed { hook: &hook.name, matched, took, replaced: false, changed: false, outcome });
                }
                continue;
            }
            let pb_request = around.with_messages(&request.system, messages.clone());
            let shadows = self.shadow_model_requests(hook, step, &pb_request, &request.system, &messages);
            let send =
                |req, len| crate::peer::unary(hook.peer.clone(), wire::ON_MODEL_REQUEST, req, len, hook.max_reply);
            let subject = HookSubject::Turn(step.turn);
            let started = Instant::now();
            let event = HookEvent::ModelRequest;
            let answer = self.call(hook, step, event, subject.clone(), pb_request, send, accept_model_request).await;
            let (replacement, system) = match answer {
                Ok(answer) => answer,
                Err(e) => {
                    if let Some(before) = digest.take() {
                        self.audit(step, hook, HookEvent::ModelRequest, &subject, position, before, Err(&e));
                    }
                    observe_failure(observe.as_mut(), &hook.name, started, &e);
                    return Err(e);
                }
            };
            let replaced = replacement.is_some() || system.is_some();
            let changed = observe.is_some()
                && (replacement.as_ref().is_some_and(|m| *m != *request.messages)
                    || system.as_ref().is_some_and(|s| *s != *request.system));
            if let Some(replaced) = replacement {
                request.messages = Cow::Owned(replaced);
                messages = Arc::new(convert::messages_to_pb(&request.messages));
            }
            if let Some(system) = system {
                request.system = Cow::Owned(system);
            }
            if !shadows.is_empty() {
                let digest = shadow::digest(step);
                let output = digest.model_request_pb(&request.system, (*messages).clone());
                shadows.into_iter().for_each(|primary| primary.tell(Some(output.clone())));
            }
            if let Some(before) = digest.take() {
                let after = audit.filter(|_| replaced).map(|a| a.digest.model_request(&request));
                let kept = after.clone().unwrap_or_else(|| before.clone());
                self.audit(step, hook, HookEvent::ModelRequest, &subject, position, before, Ok(after));
                digest = Some(kept);
            }
            if let Some(observe) = observe.as_mut() {
                let outcome = Ok(&request);
                let (hook, matched, took) = (&hook.name, true, started.elapsed());
                observe(Observed { hook, matched, took, replaced, changed, outcome });
            }
        }
        Ok(request)
    }

    fn context(&self, step: Step<'_>) -> pb::HookContext {
        pb::HookContext {
            agent: self.agent.clone(),
            session_id: step.scope.session_id.clone(),
            query_id: step.scope.query_id.clone(),
            turn: step.turn,
            chain_version: self.version.clone(),
        }
    }
}

/// How many of the oldest messages to leave out so that an OnModelRequest
/// request of `base` bytes without messages, plus the rest, fits `limit`:
/// the fewest that leave a valid conversation (starting at a user message
/// that answers no tool call). 0 when everything fits, or when no window
/// does (the first hook call then fails as request_too_large, naming sizes).
fn window(messages: &[Message], encoded: &[apb::Message], base: usize, limit: usize) -> usize {
    // Each repeated field element costs its tag, its length and its bytes.
    let sizes: Vec<usize> = encoded
        .iter()
        .map(|m| {
            let len = m.encoded_len();
            1 + prost::encoding::encoded_len_varint(len as u64) + len
        })
        .collect();
    let mut rest: usize = sizes.iter().sum();
    for (i, m) in messages.iter().enumerate() {
        let starts_cleanly =
            m.role == Role::User && !m.content.iter().any(|b| matches!(b, crate::domain::Block::ToolResult(_)));
        if starts_cleanly && base + rest <= limit {
            return i;
        }
        rest -= sizes[i];
    }
    0
}

/// Checks an OnModelRequest reply: a replacement list must decode and be a
/// valid conversation (an empty list is not one: a request starts with a
/// user message).
fn accept_model_request(reply: pb::OnModelRequestResponse) -> Result<(Option<Vec<Message>>, Option<String>), String> {
    let messages = match reply.messages {
        None => None,
        Some(list) => {
            let messages = convert::messages_from_pb(list.messages)
                .map_err(|DecodeError(what)| format!("replacement messages: {what}"))?;
            if messages.is_empty() {
                return Err("replacement messages: the list is empty".into());
            }
            validate_conversation(&messages).map_err(|why| format!("replacement messages: {why}"))?;
            Some(messages)
        }
    };
    Ok((messages, reply.system))
}

mod call;
mod error;
mod shadow;
#[cfg(test)]
mod tests;
mod wire;
pub use error::{ChainError, HookError, HookEvent, HookFailure, HookSubject};
