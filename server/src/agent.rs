//! The agent loop: model request → reply → tool calls → results → next turn.
//!
//! Every value a hook may change passes through the chain before it exists
//! anywhere else: the model request goes to the OnModelRequest hooks before
//! the trace, the event stream and the model; a tool result goes to the
//! OnToolResult hooks before the trace, the stream and the next request. A
//! hook failure returns `Err` through every `?` on the way up, so the
//! conversation being built (`messages`) is dropped, never stored.

use std::{borrow::Cow, collections::HashMap, sync::Arc, time::Duration};

mod error;
mod ordered;
mod setup;
pub use error::AgentError;
pub use setup::{AgentMetrics, AgentRuntime, Runtime, SetupError};

use futures_util::future::BoxFuture;
use tokio::{sync::mpsc, time::Instant};
use tracing::{Instrument, debug, debug_span, info, warn};

use crate::{
    config::{AgentDef, Config, ServerSettings},
    domain::{
        AssistantReply, Block, Message, ModelRequest, ResultSource, Role, StopReason, ToolErrorKind, ToolResult,
        ToolUse, Usage, text_of,
    },
    events::{Event, EventTx},
    hooks::{ChainError, HookChain, HookError, ToolCallView},
    metrics::{CallMetric, Family, Metrics},
    model::{self, DeltaSink, Model, ModelError, ModelSetupError},
    scope::{Scope, Step},
    tools::{AgentTools, Binding, CallOutcome, RawResult, ToolSetupError, call_remote},
    trace::{TraceEvent, Tracer},
};

/// A successful run.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// The whole conversation after the run (to be stored).
    pub messages: Vec<Message>,
    /// The last assistant text.
    pub text: String,
    /// Why the loop stopped.
    pub stop_reason: StopReason,
    /// Model requests made.
    pub turns: u32,
    /// Tokens over all turns.
    pub usage: Usage,
}

/// One agent run's context, shared by its turns.
#[derive(Debug, Clone)]
pub struct RunCtx {
    /// Whose work it is: agent, session, query and deadline (a delegated
    /// run's deadline may be earlier than the query's).
    pub scope: Scope,
    /// 0 for the client's agent, +1 per delegation.
    pub depth: u32,
    /// Where events go (`None` for delegated runs: only their final text
    /// reaches the parent, as a tool result).
    pub events: Option<EventTx>,
    /// Stream model requests too.
    pub include_model_requests: bool,
}

impl RunCtx {
    /// Sends an event to the client, if there is one. An event too large
    /// for the client fails the run.
    async fn send(&self, event: Event<'_>) -> Result<(), AgentError> {
        match &self.events {
            Some(tx) => Ok(tx.send(event).await?),
            None => Ok(()),
        }
    }

    fn step(&self, turn: u32) -> Step<'_> {
        Step { scope: &self.scope, turn }
    }
}

impl Runtime {
    /// Runs `agent`'s loop on `history` plus `prompt`. Boxed: delegation
    /// makes it recursive.
    pub fn run<'a>(
        &'a self,
        agent: &'a Arc<AgentRuntime>,
        ctx: &'a RunCtx,
        history: Vec<Message>,
        prompt: String,
    ) -> BoxFuture<'a, Result<RunOutcome, AgentError>> {
        Box::pin(self.run_loop(agent, ctx, history, prompt))
    }

    async fn run_loop(
        &self,
        agent: &Arc<AgentRuntime>,
        ctx: &RunCtx,
        mut messages: Vec<Message>,
        prompt: String,
    ) -> Result<RunOutcome, AgentError> {
        let scope = &ctx.scope;
        let tools = agent.tools().ok_or_else(|| AgentError::NotReady(agent.def.name.clone()))?;
        let history = messages.len();
        messages.push(Message::user_text(prompt));
        let mut usage = Usage::default();
        let mut last_text = String::new();
        for turn in 1..=agent.def.max_turns {
            check_deadline(ctx)?;
            // One span per turn: its hooks, its model request, its tools.
            let span = debug_span!(target: crate::telemetry::SPAN_TARGET, "turn", turn);
            let (messages, usage, last_text) = (&mut messages, &mut usage, &mut last_text);
            let done = async {
                let request = ModelRequest {
                    system: Cow::Borrowed(&*agent.def.system_prompt),
                    messages: as_request(messages),
                    tools: tools.specs.clone(),
                };
                let request = agent.hooks.on_model_request(ctx.step(turn), request).await?;
                self.tracer.emit_request(scope, turn, &request, &agent.def.system_prompt, messages, history).await;
                if ctx.include_model_requests {
                    ctx.send(Event::ModelRequest { turn, request: &request }).await?;
                }
                let reply = self.call_model(agent, ctx, turn, &request).await?;
                drop(request);
                debug!(agent = %agent.def.name, turn, blocks = reply.content.len(), "model replied");
                *usage += reply.usage;
                self.tracer
                    .emit(
                        scope,
                        TraceEvent::AssistantMessage {
                            turn,
                            content: &reply.content,
                            stop_reason: reply.stop_reason,
                            usage: reply.usage,
                        },
                    )
                    .await;
                ctx.send(Event::Assistant { turn, content: &reply.content }).await?;
                *last_text = text_of(&reply.content);
                let uses: Vec<ToolUse> = reply.tool_uses().cloned().collect();
                for u in &uses {
                    self.tracer.emit(scope, TraceEvent::ToolUse { turn, id: &u.id, name: &u.name }).await;
                }
                if !reply.content.is_empty() {
                    messages.push(Message { role: Role::Assistant, content: reply.content });
                }
                if uses.is_empty() {
                    return Ok(Some(RunOutcome {
                        messages: std::mem::take(messages),
                        text: std::mem::take(last_text),
                        stop_reason: reply.stop_reason,
                        turns: turn,
                        usage: *usage,
                    }));
                }
                let results = self.run_tools(agent, ctx, turn, &uses).await?;
                messages
                    .push(Message { role: Role::User, content: results.into_iter().map(Block::ToolResult).collect() });
                Ok::<_, AgentError>(None)
            }
            .instrument(span)
            .await?;
            if let Some(outcome) = done {
                return Ok(outcome);
            }
        }
        Ok(RunOutcome {
            messages,
            text: last_text,
            stop_reason: StopReason::MaxTurns,
            turns: agent.def.max_turns,
            usage,
        })
    }

    /// One model request (after the hooks). Streamed text reaches the client
    /// as it arrives; the request ends by the query's deadline at the latest
    /// (DEADLINE_EXCEEDED), and is counted however it ends.
    async fn call_model(
        &self,
        agent: &AgentRuntime,
        ctx: &RunCtx,
        turn: u32,
        request: &ModelRequest<'_>,
    ) -> Result<AssistantReply, AgentError> {
        let deadline = ctx.scope.deadline;
        let record = agent.metrics.model.start(&self.metrics, deadline);
        // The sink is inactive for delegated runs (no client to see it).
        let (delta_tx, mut delta_rx) = mpsc::unbounded_channel();
        let sink = if ctx.events.is_some() {
            DeltaSink::new(delta_tx)
        } else {
            // No sender may outlive the model call, or `forward` never ends.
            drop(delta_tx);
            DeltaSink::default()
        };
        let span = debug_span!(
            target: crate::telemetry::SPAN_TARGET,
            "model_request",
            otel.kind = "client",
            model = %agent.def.model.label(),
            turn,
            messages = request.messages.len(),
            outcome = tracing::field::Empty,
            input_tokens = tracing::field::Empty,
            output_tokens = tracing::field::Empty,
        );
        let complete = agent.model.complete(request, ctx.step(turn), sink).instrument(span.clone());
        let forward = async {
            while let Some(text) = delta_rx.recv().await {
                ctx.send(Event::TextDelta { turn, text }).await?;
            }
            Ok::<_, AgentError>(())
        };
        // On the deadline the record is dropped unfinished: counted as such.
        let (reply, forwarded) = tokio::time::timeout_at(deadline, async { tokio::join!(complete, forward) })
            .await
            .map_err(|_| AgentError::DeadlineExceeded)?;
        forwarded?;
        match reply {
            // The model gave up as the query's deadline passed.
            Err(_) if Instant::now() >= deadline => Err(AgentError::DeadlineExceeded),
            Err(e) => {
                record.finish(e.kind.as_str());
                span.record("outcome", e.kind.as_str());
                Err(e.into())
            }
            Ok(reply) => {
                record.finish("ok");
                let metrics = &agent.metrics;
                metrics.tokens.add_n(&metrics.registry, "input", reply.usage.input_tokens);
                metrics.tokens.add_n(&metrics.registry, "output", reply.usage.output_tokens);
                span.record("outcome", "ok")
                    .record("input_tokens", reply.usage.input_tokens)
                    .record("output_tokens", reply.usage.output_tokens);
                Ok(reply)
            }
        }
    }

    /// Runs one reply's tool calls (up to `parallel_tool_calls` at once) and
    /// returns their post-hook results in tool_use order. Each result's
    /// chain is sequential; different results' chains may overlap.
    ///
    /// Results are taken as they finish and released to the trace and the
    /// client in tool_use order. The first failure returns at once: dropping
    /// the calls still in flight cancels each tool RPC and hook call (their
    /// services see the stream reset), without waiting for slower siblings.
    async fn run_tools<'a>(
        &'a self,
        agent: &'a Arc<AgentRuntime>,
        ctx: &'a RunCtx,
        turn: u32,
        uses: &'a [ToolUse],
    ) -> Result<Vec<ToolResult>, AgentError> {
        // No side effects whose results could only be thrown away.
        if let Some(first) = uses.first() {
            agent.hooks.preflight_tool_results(&first.id, ctx.scope.deadline).await?;
        }
        let call = |i: usize, u: &'a ToolUse| {
            let span = debug_span!(
                target: crate::telemetry::SPAN_TARGET,
                "tool_call",
                otel.kind = "client",
                tool = %u.name,
                tool_use_id = %u.id,
                outcome = tracing::field::Empty,
                result_bytes = tracing::field::Empty,
            );
            self.run_tool(agent, ctx, turn, i, u, span.clone()).instrument(span)
        };
        // One call (the usual reply) is awaited as it is: no set of
        // futures to move it into, and its wake-ups reach this task directly.
        if let [only] = uses {
            let (_, (result, outcome, duration)) = call(0, only).await?;
            self.release_result(agent, ctx, turn, only, &result, outcome, duration).await?;
            return Ok(vec![result]);
        }
        let calls = uses.iter().enumerate().map(|(i, u)| call(i, u)).collect();
        let mut ordered = ordered::InOrder::new(calls, agent.def.parallel_tool_calls);
        let mut results = Vec::with_capacity(uses.len());
        while let Some(done) = ordered.next().await {
            let (result, outcome, duration) = done?;
            let call = &uses[results.len()];
            self.release_result(agent, ctx, turn, call, &result, outcome, duration).await?;
            results.push(result);
        }
        Ok(results)
    }

    /// Sends one post-hook tool result to the trace, the log and the client.
    #[allow(clippy::too_many_arguments)]
    async fn release_result(
        &self,
        agent: &AgentRuntime,
        ctx: &RunCtx,
        turn: u32,
        call: &ToolUse,
        result: &ToolResult,
        outcome: CallOutcome,
        duration: Duration,
    ) -> Result<(), AgentError> {
        let outcome_name = outcome_name(outcome);
        self.tracer
            .emit(&ctx.scope, TraceEvent::ToolResult { turn, tool_name: &call.name, result, outcome: outcome_name })
            .await;
        debug!(agent = %agent.def.name, turn, tool = %call.name, tool_use_id = %call.id, outcome = outcome_name, bytes = result.len(), is_error = result.is_error, elapsed_ms = duration.as_millis() as u64, "tool result");
        ctx.send(Event::ToolResult { turn, tool_name: &call.name, result, outcome, duration }).await
    }

    /// One tool call and its OnToolResult chain.
    async fn run_tool(
        &self,
        agent: &Arc<AgentRuntime>,
        ctx: &RunCtx,
        turn: u32,
        index: usize,
        call: &ToolUse,
        span: tracing::Span,
    ) -> Result<(usize, (ToolResult, CallOutcome, Duration)), AgentError> {
        use ToolErrorKind as K;
        let started = Instant::now();
        let def = &agent.def;
        let raw = if index >= def.max_tool_calls_per_turn {
            let msg = format!(
                "tool call blocked: the agent allows at most {} tool calls per reply",
                def.max_tool_calls_per_turn
            );
            RawResult::lattice(&call.id, K::BatchLimit, msg, CallOutcome::Blocked)
        } else {
            match agent.tools().and_then(|t| t.bindings.get(&call.name)) {
                None => RawResult::lattice(
                    &call.id,
                    K::UnknownTool,
                    format!("unknown tool {:?}: this agent has no such tool", call.name),
                    CallOutcome::Blocked,
                ),
                Some(_) if !def.permissions.allows(&call.name) => RawResult::lattice(
                    &call.id,
                    K::PermissionDenied,
                    format!("tool {:?} is not permitted for this agent", call.name),
                    CallOutcome::Blocked,
                ),
                Some(binding) => {
                    // Armed while the call runs: if the query is aborted, the
                    // guard's drop reports a cancelled result to the hooks.
                    let guard = CancelGuard {
                        armed: true,
                        agent: agent.clone(),
                        tracer: self.tracer.clone(),
                        scope: ctx.scope.clone(),
                        call: call.clone(),
                        turn,
                    };
                    let call_deadline = ctx.scope.deadline.min(Instant::now() + binding.deadline());
                    let raw = match binding {
                        Binding::Remote { peer, max_message, endpoint, .. } => {
                            call_remote(peer, *max_message, endpoint, call, &ctx.scope, call_deadline).await
                        }
                        Binding::Agent { agent: target, .. } => self.delegate(ctx, call, target, call_deadline).await?,
                    };
                    // Cut by the query's deadline: the query is over, and the
                    // call counts as cancelled (the armed guard reports it).
                    check_deadline(ctx)?;
                    guard.disarm();
                    raw
                }
            }
        };
        check_deadline(ctx)?;
        agent.metrics.tool_call(&call.name, raw.outcome);
        // On the call's own span: `Span::current()` would be the query's
        // when this one is off.
        span.record("outcome", outcome_name(raw.outcome));
        let view = ToolCallView {
            tool_name: &call.name,
            tool_use_id: &call.id,
            input: &call.input,
            error: raw.error,
            source: raw.source,
        };
        let result = agent.hooks.on_tool_result(ctx.step(turn), &view, raw.result).await?;
        span.record("result_bytes", result.len() as u64);
        Ok((index, (result, raw.outcome, started.elapsed())))
    }

    /// Runs a delegated agent on a fresh session; its final text is the
    /// result. Its own hook failure aborts the whole query.
    async fn delegate(
        &self,
        ctx: &RunCtx,
        call: &ToolUse,
        target: &str,
        deadline: Instant,
    ) -> Result<RawResult, AgentError> {
        use ToolErrorKind as K;
        let source = ResultSource::DelegatedAgent(target.to_owned());
        let fail =
            |kind: K, message: String, outcome| RawResult::failed(&call.id, kind, message, source.clone(), outcome);
        if ctx.depth + 1 > self.settings.max_delegation_depth {
            let msg = format!(
                "agent {target:?} was not called: delegation depth limit ({}) reached",
                self.settings.max_delegation_depth
            );
            return Ok(fail(K::Delegation, msg, CallOutcome::Blocked));
        }
        let Some(prompt) = call.input.get("prompt").and_then(|p| p.as_str()).filter(|p| !p.trim().is_empty()) else {
            return Ok(fail(K::Delegation, "input.prompt must be a non-empty string".into(), CallOutcome::Blocked));
        };
        let Some(child) = self.agents.get(target) else {
            return Ok(fail(K::Delegation, format!("no agent {target:?}"), CallOutcome::Blocked));
        };
        let child_ctx = RunCtx {
            scope: Scope {
                agent: target.to_owned(),
                session_id: crate::session::new_id(),
                query_id: ctx.scope.query_id.clone(),
                deadline,
                // Its hook calls belong to the same query's record.
                audit: ctx.scope.audit.clone(),
            },
            depth: ctx.depth + 1,
            events: None,
            include_model_requests: false,
        };
        info!(parent_session = %ctx.scope.session_id, agent = %target, session_id = %child_ctx.scope.session_id, depth = child_ctx.depth, "delegating");
        match self.run(child, &child_ctx, Vec::new(), prompt.to_owned()).await {
            Ok(out) => Ok(RawResult {
                result: ToolResult::text(&call.id, out.text, false),
                error: None,
                source,
                outcome: CallOutcome::Executed,
            }),
            Err(AgentError::Hook(e)) => Err(AgentError::Hook(e)),
            Err(AgentError::DeadlineExceeded) if Instant::now() >= ctx.scope.deadline => {
                Err(AgentError::DeadlineExceeded)
            }
            Err(AgentError::DeadlineExceeded) => {
                Ok(fail(K::Deadline, format!("agent {target:?} did not finish in time"), CallOutcome::Failed))
            }
            Err(AgentError::Model(e)) => {
                Ok(fail(K::Delegation, format!("agent {target:?} failed: {e}"), CallOutcome::Failed))
            }
            // A delegated run streams no events; passed on all the same.
            Err(AgentError::NotReady(_)) => {
                Ok(fail(K::Delegation, format!("agent {target:?} is not ready yet"), CallOutcome::Failed))
            }
            Err(e @ (AgentError::Cancelled | AgentError::EventTooLarge { .. } | AgentError::Store(_))) => Err(e),
        }
    }
}

fn check_deadline(ctx: &RunCtx) -> Result<(), AgentError> {
    if Instant::now() >= ctx.scope.deadline { Err(AgentError::DeadlineExceeded) } else { Ok(()) }
}

/// The conversation as a model request carries it: adjacent messages of one
/// role merged (a prompt after a run that stopped at max_turns follows the
/// tool results), so roles alternate. The stored conversation is only ever
/// appended to, so it keeps them apart. Where roles already alternate (every
/// turn of a query but such a one) the conversation is borrowed, not copied.
fn as_request(messages: &[Message]) -> Cow<'_, [Message]> {
    if messages.windows(2).all(|pair| pair[0].role != pair[1].role) {
        return Cow::Borrowed(messages);
    }
    let mut merged: Vec<Message> = Vec::with_capacity(messages.len());
    for m in messages {
        match merged.last_mut() {
            Some(last) if last.role == m.role => {
                last.content = last.content.iter().chain(m.content.iter()).cloned().collect();
            }
            _ => merged.push(m.clone()),
        }
    }
    Cow::Owned(merged)
}

/// The outcome's name in traces and logs.
pub fn outcome_name(o: CallOutcome) -> &'static str {
    match o {
        CallOutcome::Executed => "executed",
        CallOutcome::Failed => "failed",
        CallOutcome::Blocked => "blocked",
        CallOutcome::Cancelled => "cancelled",
    }
}

/// Reports a tool call that an abort cancelled to the agent's OnToolResult
/// hooks (audit hooks see every call), in the background: the query is
/// over, so its deadline no longer applies and each hook gets its own. The
/// post-hook result reaches the trace only; a hook failure here is logged.
struct CancelGuard {
    armed: bool,
    agent: Arc<AgentRuntime>,
    tracer: Tracer,
    scope: Scope,
    call: ToolUse,
    turn: u32,
}

impl CancelGuard {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.agent.metrics.tool_call(&self.call.name, CallOutcome::Cancelled);
        if !self.agent.hooks.handles_tool_results() {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else { return };
        let (agent, tracer, call, turn) = (self.agent.clone(), self.tracer.clone(), self.call.clone(), self.turn);
        // The query is over: these calls get a deadline of their own.
        let deadline = Instant::now() + agent.def.hooks.iter().map(|h| h.deadline).sum::<Duration>();
        let scope = Scope { deadline, ..self.scope.clone() };
        handle.spawn(async move {
            let msg = "tool call cancelled: the query was aborted".to_owned();
            let raw = RawResult::lattice(&call.id, ToolErrorKind::Cancelled, msg, CallOutcome::Cancelled);
            let view = ToolCallView {
                tool_name: &call.name,
                tool_use_id: &call.id,
                input: &call.input,
                error: raw.error,
                source: raw.source,
            };
            match agent.hooks.on_tool_result(Step { scope: &scope, turn }, &view, raw.result).await {
                Ok(result) => {
                    tracer
                        .emit(
                            &scope,
                            TraceEvent::ToolResult {
                                turn,
                                tool_name: &call.name,
                                result: &result,
                                outcome: "cancelled",
                            },
                        )
                        .await
                }
                Err(e) => warn!(error = %e, "hook failed on a cancelled tool result"),
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use super::as_request;
    use crate::domain::{Block, Message, Role};

    fn said(role: Role, text: &str) -> Message {
        Message { role, content: std::sync::Arc::new([Block::Text { text: text.to_owned() }]) }
    }

    #[test]
    fn a_conversation_whose_roles_alternate_is_lent_not_copied() {
        let history = vec![
            said(Role::User, "q1"),
            said(Role::Assistant, "a1"),
            said(Role::User, "q2"),
            said(Role::Assistant, "a2"),
        ];
        let request = as_request(&history);
        let Cow::Borrowed(lent) = request else { panic!("copied: {request:?}") };
        assert!(std::ptr::eq(lent, history.as_slice()));
        assert!(matches!(as_request(&[]), Cow::Borrowed([])));
    }

    #[test]
    fn adjacent_messages_of_one_role_are_merged_in_order() {
        // A prompt after a run that stopped at max_turns follows the results.
        let history =
            vec![said(Role::User, "q1"), said(Role::Assistant, "a1"), said(Role::User, "r1"), said(Role::User, "q2")];
        let request = as_request(&history);
        assert!(matches!(request, Cow::Owned(_)), "{request:?}");
        let texts: Vec<(Role, Vec<String>)> = request
            .iter()
            .map(|m| {
                let texts = m.content.iter().map(|b| match b {
                    Block::Text { text } => text.clone(),
                    other => panic!("{other:?}"),
                });
                (m.role, texts.collect())
            })
            .collect();
        let expected = vec![
            (Role::User, vec!["q1".to_owned()]),
            (Role::Assistant, vec!["a1".to_owned()]),
            (Role::User, vec!["r1".to_owned(), "q2".to_owned()]),
        ];
        assert_eq!(texts, expected);
        // The history itself keeps them apart.
        assert_eq!(history.len(), 4);
    }
}
