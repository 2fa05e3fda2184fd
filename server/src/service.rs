//! `lattice.agent.v1.AgentService`: request validation, the event stream and
//! status mapping. The loop itself lives in `agent`.

use std::{pin::Pin, sync::Arc, time::Duration};

use futures_util::Stream;
use lattice_proto::agent::v1::{self as pb, agent_service_server::AgentService, query_event::Event as PbEvent};
use tokio::{
    sync::{Semaphore, mpsc},
    time::Instant,
};
use tonic::{Request, Response, Status};
use tracing::{Instrument, debug, info, info_span, warn};

use crate::{
    agent::{AgentError, AgentRuntime, RunCtx, Runtime},
    auth::{Authenticator, Principal},
    events::{self, EventTx, Out},
    limits::Limits,
    peer,
    reconfig::Live,
    scope::Scope,
    session::{SessionStore, StoreError},
    status,
    tools::Binding,
    trace::TraceEvent,
};

/// How long past the query's deadline the loop may take to report its own,
/// more precise error (a hook that hit the deadline) before it is dropped.
const DEADLINE_GRACE: Duration = Duration::from_millis(20);

/// The service.
#[derive(Debug, Clone)]
pub struct AgentSvc {
    /// The runtime new calls take (see [`crate::reconfig`]).
    live: Arc<Live>,
    store: Arc<dyn SessionStore>,
    /// Who is calling.
    auth: Arc<Authenticator>,
    /// Per-principal limits.
    limits: Arc<Limits>,
    /// Queries in flight across all sessions; the excess is refused.
    queries: Arc<Semaphore>,
    /// How audit records digest values.
    digest: crate::audit::Digest,
}

impl AgentSvc {
    /// A service over `live`'s runtime and `store`.
    pub fn new(live: Arc<Live>, store: Arc<dyn SessionStore>, auth: Arc<Authenticator>) -> Self {
        // Settings a reload does not change (see `reconfig`).
        let runtime = live.current();
        let limit = runtime.settings.max_concurrent_queries;
        let limits = Limits::new(runtime.settings.limits);
        let digest = match &runtime.settings.audit_key {
            Some(key) => crate::audit::Digest::keyed(key.0.as_bytes()),
            None => crate::audit::Digest::default(),
        };
        Self { live, store, auth, limits, queries: Arc::new(Semaphore::new(limit)), digest }
    }
}

impl AgentSvc {
    /// PERMISSION_DENIED unless `principal` may query `agent`: with
    /// authentication on, an agent that lists `principals` is for them only.
    fn may_query(&self, principal: &Principal, agent: &AgentRuntime) -> Result<(), Status> {
        let listed = agent.def.principals.as_ref().is_none_or(|p| p.contains(&principal.name));
        if !self.auth.enabled() || listed {
            return Ok(());
        }
        Err(Status::permission_denied(format!("{:?} may not query agent {:?}", principal.name, agent.def.name)))
    }

    /// An agent as `principal` may see it: whole for an admin (or with
    /// authentication off); without its hooks' and tools' endpoints
    /// otherwise.
    fn describe(&self, principal: &Principal, agent: &AgentRuntime) -> pb::Agent {
        let mut described = agent_to_pb(agent);
        if self.auth.enabled() && !principal.admin {
            for hook in &mut described.hooks {
                hook.endpoint.clear();
            }
            for tool in &mut described.tools {
                tool.target.clear();
            }
        }
        described
    }

    /// Whose sessions a caller sees: its own when authentication is on
    /// (another's is NOT_FOUND: its existence is not revealed), any when off.
    fn owner<'a>(&self, principal: &'a Principal) -> Option<&'a str> {
        self.auth.enabled().then_some(principal.name.as_str())
    }

    /// A call's time: its `grpc-timeout`, at most `server.query_deadline_ms`.
    fn budget(&self, runtime: &Runtime, metadata: &tonic::metadata::MetadataMap) -> Duration {
        let most = runtime.settings.query_deadline;
        metadata
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_grpc_timeout)
            .map_or(most, |d| d.min(most))
    }

    /// A query up to its first event: authenticated, authorized, admitted,
    /// its session leased; then the loop runs on a task of its own.
    /// `principal` is set as soon as the caller is known (for the audit
    /// line of a refusal).
    async fn start_query(
        &self,
        request: Request<pb::QueryRequest>,
        who: &mut Option<String>,
    ) -> Result<Response<EventStream>, Status> {
        let principal = self.auth.authenticate(&request)?;
        *who = Some(principal.name.clone());
        let parent = crate::telemetry::incoming(request.metadata());
        // The query runs on this runtime, start to finish, whatever a
        // reload does meanwhile.
        let runtime = self.live.current();
        let budget = self.budget(&runtime, request.metadata());
        let deadline = Instant::now() + budget;
        let req = request.into_inner();
        let agent = runtime
            .agent(&req.agent)
            .cloned()
            .ok_or_else(|| Status::not_found(format!("no agent named {}", status::echo(&req.agent))))?;
        // Before anything is touched: no session, no tool, no model.
        self.may_query(&principal, &agent)?;
        let admitted = self.limits.admit(&principal.name)?;
        if req.prompt.trim().is_empty() {
            return Err(Status::invalid_argument("prompt must not be empty"));
        }
        if agent.tools().is_none() {
            return Err(status::agent_error(&AgentError::NotReady(agent.def.name.clone())));
        }
        let (session_id, create) = match req.session_id {
            Some(id) if !plausible_session_id(&id) => return Err(Status::not_found("session not found")),
            Some(id) => (id, false),
            None => (crate::session::new_id(), true),
        };
        let permit = self
            .queries
            .clone()
            .try_acquire_owned()
            .map_err(|_| Status::resource_exhausted("too many queries in flight; retry later"))?;
        let mut lease = self
            .store
            .acquire_until(&session_id, &agent.def.name, self.owner(&principal), create, deadline)
            .await
            .map_err(|e| status::store_error(&e))?;
        if lease.session.agent != agent.def.name {
            let refused = Status::invalid_argument(format!("the session belongs to agent {:?}", lease.session.agent));
            // Given back before the client hears: its next query finds the
            // session free.
            lease.release_until(deadline).await;
            return Err(refused);
        }
        let query_id = uuid::Uuid::new_v4().to_string();
        let span = info_span!(
            target: crate::telemetry::SPAN_TARGET,
            "query",
            otel.kind = "server",
            agent = %agent.def.name,
            principal = %principal.name,
            session_id = %session_id,
            query_id = %query_id,
            budget_ms = budget.as_millis() as u64,
            outcome = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        );
        crate::telemetry::set_parent(&span, parent);
        debug!(parent: &span, prompt_bytes = req.prompt.len(), budget_ms = budget.as_millis() as u64, new_session = create, "query started");

        let (out_tx, out_rx) = mpsc::channel::<Out>(events::CAPACITY);
        let limit = runtime.settings.max_message_bytes;
        let scope = Scope {
            agent: agent.def.name.clone(),
            session_id: session_id.clone(),
            query_id: query_id.clone(),
            deadline,
            // Kept when it has somewhere to go (see `audit`).
            audit: (runtime.settings.trace_dir.is_some() || crate::telemetry::enabled())
                .then(|| Arc::new(crate::audit::Audit::new(self.digest.clone()))),
        };
        let ctx = RunCtx {
            scope: scope.clone(),
            depth: 0,
            events: Some(EventTx::new(out_tx.clone(), limit)),
            include_model_requests: req.include_model_requests,
        };
        let started = pb::QueryStarted { query_id, session_id: session_id.clone(), agent: agent.def.name.clone() };
        let in_flight = runtime.metrics.query_started();
        let driver = async move {
            let _permit = permit;
            let _admitted = admitted;
            let _in_flight = in_flight;
            let _ = out_tx.send(Out::Event(PbEvent::Started(started))).await;
            // The loop owns the history from here (no copy of it is kept).
            let history = std::mem::take(&mut lease.session.messages);
            let stored = history.len();
            // The loop queues its events on the response stream itself, each
            // checked against the client's limit: an event too large fails
            // the query (before anything is committed) instead of breaking
            // the stream. The loop future and everything in flight under it
            // are dropped on cancel, deadline or a lost lease.
            let run = runtime.run(&agent, &ctx, history, req.prompt);
            let began = Instant::now();
            let outcome = tokio::select! {
                r = tokio::time::timeout_at(deadline + DEADLINE_GRACE, run) => r.unwrap_or(Err(AgentError::DeadlineExceeded)),
                _ = out_tx.closed() => Err(AgentError::Cancelled),
                () = lease.lost() => Err(AgentError::Store(StoreError::LeaseLost)),
            };
            drop(ctx);
            // The final result is built and checked before the commit too.
            let outcome = outcome.and_then(|out| {
                let result = pb::FinalResult {
                    text: out.text.clone(),
                    stop_reason: pb::StopReason::from(out.stop_reason) as i32,
                    turns: out.turns,
                    usage: Some(out.usage.into()),
                };
                Ok((out, events::sized(PbEvent::Result(result), limit)?))
            });
            // Committed, and the session released, before the client sees
            // the result: its next query finds the session free. A commit
            // that fails (lease lost, store down) fails the query instead.
            // From here the stream holds back the last events, to leave with
            // the result or the failure (see `QueryEvents`).
            let _ = out_tx.send(Out::Finishing).await;
            let outcome = match outcome {
                Ok((mut out, result)) => {
                    // The messages this query appended, moved to the store.
                    let mut appended = std::mem::take(&mut out.messages);
                    let conversation = appended.len();
                    appended.drain(..stored);
                    match lease.commit_until(appended, deadline).await {
                        Ok(()) => {
                            runtime.tracer().committed(&scope, conversation);
                            Ok((out, result))
                        }
                        Err(e) => Err(AgentError::Store(e)),
                    }
                }
                Err(e) => {
                    // Released before the client hears of the failure, so
                    // that a retry finds the session free (waiting no later
                    // than the query's deadline).
                    lease.release_until(deadline).await;
                    Err(e)
                }
            };
            let elapsed_ms = began.elapsed().as_millis() as u64;
            let failure = outcome.as_ref().err().map(status::agent_error);
            let code = failure.as_ref().map_or(tonic::Code::Ok, Status::code);
            agent.metrics.query(code, began.elapsed());
            let span = tracing::Span::current();
            span.record("outcome", status::code_name(code));
            if code != tonic::Code::Ok {
                span.record("otel.status_code", "ERROR");
            }
            match outcome {
                Ok((out, result)) => {
                    let (text, stop_reason, turns, usage) = (out.text, out.stop_reason, out.turns, out.usage);
                    runtime.tracer().emit(&scope, TraceEvent::Result { text: &text, stop_reason, turns, usage }).await;
                    info!(
                        turns,
                        input_tokens = usage.input_tokens,
                        output_tokens = usage.output_tokens,
                        elapsed_ms,
                        "query succeeded"
                    );
                    audit(&runtime, &scope, agent.hooks.version(), code).await;
                    runtime.tracer().flush().await;
                    let _ = out_tx.send(Out::Event(result)).await;
                }
                Err(e) => {
                    let st = failure.unwrap_or_else(|| status::agent_error(&e));
                    runtime
                        .tracer()
                        .emit(&scope, TraceEvent::Error { code: status::code_name(st.code()), message: st.message() })
                        .await;
                    warn!(code = status::code_name(st.code()), error = %e, elapsed_ms, "query failed");
                    audit(&runtime, &scope, agent.hooks.version(), code).await;
                    runtime.tracer().flush().await;
                    let _ = out_tx.send(Out::Fail(st)).await;
                }
            }
        };
        tokio::spawn(driver.instrument(span));
        Ok(Response::new(Box::pin(events::QueryEvents::after_first(out_rx).await)))
    }
}

/// Parses a `grpc-timeout` header: 1-8 digits and a unit (H M S m u n).
fn parse_grpc_timeout(v: &str) -> Option<Duration> {
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// Writes a query's audit record, if it kept one, before the client hears
/// how it ended: to the trace file, and as one log line (an OpenTelemetry
/// event of the query's span).
async fn audit(runtime: &Runtime, scope: &Scope, chain_version: &str, code: tonic::Code) {
    let Some(audit) = &scope.audit else { return };
    let (hooks, shadows) = (audit.entries(), audit.shadow_entries());
    let outcome = status::code_name(code);
    let digest = audit.digest.algorithm();
    let event = TraceEvent::Audit { chain_version, outcome, digest, hooks: &hooks, shadows: &shadows };
    runtime.tracer().emit(scope, event).await;
    // The line carries a summary in plain fields; the whole record, with
    // the digests, is the trace file's `audit` event.
    let names = |keep: &dyn Fn(&crate::audit::AuditEntry) -> bool| {
        hooks.iter().filter(|h| keep(h)).map(|h| format!("{}@{}", h.hook, h.subject)).collect::<Vec<_>>().join(" ")
    };
    let changed_by = names(&|h| h.changed);
    let failed = names(&|h| h.outcome != "ok" && h.outcome != "not_matched");
    let not_matched = names(&|h| h.outcome == "not_matched");
    let shadows_differing = shadows
        .iter()
        .filter(|s| s.agreement != "same")
        .map(|s| format!("{}@{}:{}", s.hook, s.subject, s.agreement))
        .collect::<Vec<_>>()
        .join(" ");
    info!(target: "lattice::audit", chain_version, outcome, digest, hook_calls = hooks.len(), %changed_by, %failed, %not_matched, shadow_calls = shadows.len(), %shadows_differing, "query audit");
}

/// Session ids are made here (see [`crate::session::new_id`]; older ones
/// are UUIDs); anything else cannot exist.
fn plausible_session_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 64 && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::QueryEvent, Status>> + Send>>;

fn agent_to_pb(a: &AgentRuntime) -> pb::Agent {
    let d = &a.def;
    let specs = a.tools().map(|t| &t.specs[..]).unwrap_or_default();
    let readiness = a.hooks.readiness();
    let ready_addresses = |name: &str| readiness.iter().find(|(n, ..)| n == name).map_or(0, |(_, r, _)| *r as u32);
    pb::Agent {
        name: d.name.clone(),
        description: d.description.clone(),
        model: d.model.label(),
        max_turns: d.max_turns,
        tools: specs
            .iter()
            .map(|s| {
                let b = a.tools().and_then(|t| t.bindings.get(&s.name));
                pb::AgentTool {
                    spec: Some(s.into()),
                    target: b.map(Binding::target).unwrap_or_default(),
                    deadline_ms: b.map(|b| b.deadline().as_millis() as u64).unwrap_or_default(),
                    tls: matches!(b, Some(Binding::Remote { tls: true, .. })),
                }
            })
            .collect(),
        hooks: d
            .hooks
            .iter()
            .map(|h| pb::Hook {
                name: h.name.clone(),
                endpoint: h.endpoint.clone(),
                events: [(h.events.tool_result, "tool_result"), (h.events.model_request, "model_request")]
                    .into_iter()
                    .filter(|(on, _)| *on)
                    .map(|(_, n)| n.to_owned())
                    .collect(),
                deadline_ms: h.deadline.as_millis() as u64,
                enabled: h.enabled,
                tls: peer::uses_tls(&h.endpoint, h.tls.as_ref()),
                client_certificate: h.tls.as_ref().is_some_and(|t| t.identity.is_some()),
                ready_addresses: if h.enabled { ready_addresses(&h.name) } else { 0 },
                required: h.required,
                tools: h.conditions.tools.clone().unwrap_or_default(),
                min_messages: u32::try_from(h.conditions.min_messages).unwrap_or(u32::MAX),
                shadow_of: h.shadow_of.clone().unwrap_or_default(),
            })
            .collect(),
        parallel_tool_calls: d.parallel_tool_calls as u32,
        max_tool_calls_per_turn: d.max_tool_calls_per_turn as u32,
        allow: d.permissions.allow.clone(),
        deny: d.permissions.deny.clone(),
        ready: a.tools().is_some() && a.hooks.required_ready().is_ok(),
        chain_version: a.hooks.version().to_owned(),
    }
}

#[tonic::async_trait]
impl AgentService for AgentSvc {
    type QueryStream = EventStream;

    async fn query(&self, request: Request<pb::QueryRequest>) -> Result<Response<Self::QueryStream>, Status> {
        let mut principal = None;
        let agent = request.get_ref().agent.clone();
        let continued = request.get_ref().session_id.clone();
        let started = self.start_query(request, &mut principal).await;
        if let Err(status) = &started {
            // The audit line of a query that never ran (a query that runs
            // logs its outcome in its span).
            info!(
                principal = principal.as_deref().unwrap_or("-"),
                agent = %status::log_value(&agent),
                session_id = continued.as_deref().map(status::log_value).unwrap_or_default(),
                code = crate::grpc::code_name(status.code()),
                "query refused"
            );
        }
        started
    }

    async fn test_hooks(
        &self,
        request: Request<pb::TestHooksRequest>,
    ) -> Result<Response<pb::TestHooksResponse>, Status> {
        let principal = self.auth.authenticate(&request)?;
        if !principal.admin {
            return Err(Status::permission_denied(format!(
                "TestHooks is for admins (server.auth.admins); {:?} is not one",
                principal.name
            )));
        }
        let runtime = self.live.current();
        let budget = self.budget(&runtime, request.metadata());
        let report = crate::dryrun::test_hooks(&runtime, request.into_inner(), budget).await?;
        Ok(Response::new(report))
    }

    async fn list_agents(
        &self,
        request: Request<pb::ListAgentsRequest>,
    ) -> Result<Response<pb::ListAgentsResponse>, Status> {
        let principal = self.auth.authenticate(&request)?;
        // Each caller sees the agents it may query (an admin, all); only
        // admins see where their hooks and tools are.
        let runtime = self.live.current();
        let agents = runtime
            .agents()
            .filter(|a| principal.admin || self.may_query(&principal, a).is_ok())
            .map(|a| self.describe(&principal, a))
            .collect();
        Ok(Response::new(pb::ListAgentsResponse { agents }))
    }

    async fn get_agent(&self, request: Request<pb::GetAgentRequest>) -> Result<Response<pb::Agent>, Status> {
        let principal = self.auth.authenticate(&request)?;
        let name = request.into_inner().name;
        let runtime = self.live.current();
        let agent =
            runtime.agent(&name).ok_or_else(|| Status::not_found(format!("no agent named {}", status::echo(&name))))?;
        if !principal.admin {
            self.may_query(&principal, agent)?;
        }
        Ok(Response::new(self.describe(&principal, agent)))
    }

    async fn get_session(&self, request: Request<pb::GetSessionRequest>) -> Result<Response<pb::Session>, Status> {
        let principal = self.auth.authenticate(&request)?;
        let req = request.into_inner();
        let start = match req.page_token.as_str() {
            "" => 0,
            token => token.parse::<usize>().map_err(|_| Status::invalid_argument("page_token is not one of ours"))?,
        };
        let owner = self.owner(&principal);
        let most = if req.page_size == 0 { usize::MAX } else { req.page_size as usize };
        // What to ask the store for: it measures a page its own way, close
        // to the wire's size; an eighth more than the room makes one read
        // usually enough, and the page is trimmed to the room exactly.
        let ask = |room: usize| room.saturating_add(room / 8).max(1);
        let limit = self.live.current().settings.max_message_bytes;
        let mut stored = self
            .store
            .page_as(&req.session_id, owner, start, most, ask(limit))
            .await
            .map_err(|e| status::store_error(&e))?;
        if start > stored.total {
            return Err(Status::invalid_argument("page_token is past the end of the conversation"));
        }
        let total = stored.total;
        let mut page = pb::Session {
            session_id: req.session_id,
            agent: std::mem::take(&mut stored.agent),
            messages: Vec::new(),
            next_page_token: String::new(),
            total_messages: total as u32,
        };
        // Room for the token itself, written after the messages are chosen.
        let mut room = limit.saturating_sub(prost::Message::encoded_len(&page) + 16);
        // No more than the first read's count: a commit landing between
        // reads is not half shown.
        let most = most.min(total - start);
        loop {
            let read = stored.messages.len();
            let mut full = false;
            for message in &stored.messages {
                let message = pb::Message::from(message);
                let len = prost::Message::encoded_len(&message);
                let cost = 1 + prost::encoding::encoded_len_varint(len as u64) + len;
                // The first message always goes in: no stored message is
                // larger than one event was (see `sized`).
                if cost > room && !page.messages.is_empty() {
                    full = true;
                    break;
                }
                room = room.saturating_sub(cost);
                page.messages.push(message);
            }
            let got = page.messages.len();
            if full || read == 0 || got >= most {
                break;
            }
            // The store's measure ran ahead of the wire's: read on.
            stored = self
                .store
                .page_as(&page.session_id, owner, start + got, most - got, ask(room))
                .await
                .map_err(|e| status::store_error(&e))?;
        }
        let next = start + page.messages.len();
        if next < total {
            page.next_page_token = next.to_string();
        }
        Ok(Response::new(page))
    }

    async fn delete_session(
        &self,
        request: Request<pb::DeleteSessionRequest>,
    ) -> Result<Response<pb::DeleteSessionResponse>, Status> {
        let principal = self.auth.authenticate(&request)?;
        let id = request.into_inner().session_id;
        if !plausible_session_id(&id) {
            return Err(Status::not_found("session not found"));
        }
        self.store.delete_as(&id, self.owner(&principal)).await.map_err(|e: StoreError| status::store_error(&e))?;
        let runtime = self.live.current();
        runtime.tracer().delete(&id).await;
        info!(session_id = %id, "session deleted");
        Ok(Response::new(pb::DeleteSessionResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_headers_parse() {
        assert_eq!(parse_grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_grpc_timeout("3S"), Some(Duration::from_secs(3)));
        assert_eq!(parse_grpc_timeout("100u"), Some(Duration::from_micros(100)));
        assert_eq!(parse_grpc_timeout("123456789m"), None);
        assert_eq!(parse_grpc_timeout("m"), None);
        assert_eq!(parse_grpc_timeout(""), None);
        assert_eq!(parse_grpc_timeout("5x"), None);
    }
}
