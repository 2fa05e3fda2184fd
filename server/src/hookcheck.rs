//! `lattice hook check`: does a hook service honour the contract?
//!
//! A hook team runs it against its service (on a laptop or in CI) before
//! the hook aborts production queries. It drives the service with a fixed
//! battery of calls, like the ones Lattice makes, and reports each check as
//! PASS, WARN or FAIL with the reason:
//!
//! - `health`: `grpc.health.v1` Check("") answers SERVING (Kubernetes'
//!   gRPC probe and Lattice's readiness both ask it);
//! - `reflection`: the service lists `lattice.hooks.v1.HookService` through
//!   server reflection (WARN only: grpcurl needs it, Lattice doesn't);
//! - for each event the hook is registered for (`--events`): every kind of
//!   call answered OK within the deadline, with a valid reply (a tool
//!   result's replacement keeps its `tool_use_id`; a model request's
//!   replacement messages are a valid conversation), a reply with nothing
//!   set accepted as "keep"; a 1 MiB value and one near the message limit;
//!   a request with fields the hook doesn't know (a newer Lattice);
//!   `--concurrency` calls at once; and a call with a short `grpc-timeout`
//!   that is answered in time or ended at its deadline, never OK late.
//!
//! UNIMPLEMENTED for a registered event is a FAIL: every query that reaches
//! the event would abort.

use std::{
    fmt::Write as _,
    future::Future,
    time::{Duration, Instant},
};

use lattice_proto::{
    agent::v1 as apb,
    hooks::v1::{self as pb, hook_service_client::HookServiceClient},
};
use serde::Serialize;
use tonic::{Code, Request};
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};

use crate::{
    domain::{Message, validate_conversation},
    peer::{Peer, Tls},
};

mod requests;
use requests::*;

/// What to check, and how.
#[derive(Debug, Clone)]
pub struct Options {
    /// `http://host:port`, `https://host:port` or `dns:///host:port`.
    pub endpoint: String,
    /// TLS to the service (`https://`, or a `dns:///` endpoint with TLS).
    pub tls: Option<Tls>,
    /// Check OnToolResult (the hook is registered for `tool_result`).
    pub tool_result: bool,
    /// Check OnModelRequest (registered for `model_request`).
    pub model_request: bool,
    /// Each call's deadline (the hook's `deadline_ms` in Lattice's config).
    pub deadline: Duration,
    /// Lattice's `server.hook_max_message_bytes`.
    pub max_message_bytes: usize,
    /// Calls at once in the concurrency check.
    pub concurrency: usize,
    /// The hook's `tools` match condition: its OnToolResult requests name
    /// the first of them (else "lookup").
    pub tools: Option<Vec<String>>,
    /// The hook's `min_messages` match condition: its OnModelRequest
    /// requests have at least this many messages.
    pub min_messages: usize,
}

impl Options {
    /// The match conditions, as the report shows them.
    fn conditions(&self) -> String {
        let mut parts = Vec::new();
        if let Some(tools) = &self.tools {
            parts.push(format!("tools = {} (tool results of {})", tools.join(","), tools.first().map_or("", |t| t)));
        }
        if self.min_messages > 0 {
            parts.push(format!("min_messages = {}", self.min_messages));
        }
        parts.join("; ")
    }
}

/// A check's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Verdict {
    /// The service does what Lattice needs.
    Pass,
    /// Not needed by Lattice, but worth fixing.
    Warn,
    /// Lattice would abort queries (or can't run the hook safely).
    Fail,
}

impl Verdict {
    fn as_str(self) -> &'static str {
        match self {
            Verdict::Pass => "PASS",
            Verdict::Warn => "WARN",
            Verdict::Fail => "FAIL",
        }
    }
}

/// One check's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    /// Its name, e.g. `tool_result/executed`.
    pub check: String,
    /// PASS, WARN or FAIL.
    pub result: Verdict,
    /// Why.
    pub detail: String,
    /// How long it took, in milliseconds.
    pub ms: f64,
}

/// Every finding of one run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The service checked.
    pub endpoint: String,
    /// The deadline each call was given, in milliseconds (`--deadline-ms`:
    /// the hook's `deadline_ms` in Lattice's config).
    pub deadline_ms: u64,
    /// The message limit the large calls were sized to
    /// (`--max-message-bytes`: Lattice's `server.hook_max_message_bytes`).
    pub max_message_bytes: usize,
    /// The match conditions the requests were made to meet (`--tools`,
    /// `--min-messages`); empty when none.
    pub conditions: String,
    /// The checks, in the order they ran.
    pub checks: Vec<Finding>,
    /// How many passed.
    pub passed: usize,
    /// How many warned.
    pub warnings: usize,
    /// How many failed.
    pub failed: usize,
}

impl Report {
    fn new(options: &Options, checks: Vec<Finding>) -> Report {
        let count = |v| checks.iter().filter(|f| f.result == v).count();
        Report {
            endpoint: options.endpoint.clone(),
            deadline_ms: u64::try_from(options.deadline.as_millis()).unwrap_or(u64::MAX),
            max_message_bytes: options.max_message_bytes,
            conditions: options.conditions(),
            passed: count(Verdict::Pass),
            warnings: count(Verdict::Warn),
            failed: count(Verdict::Fail),
            checks,
        }
    }

    /// The report as a table, one line per check.
    pub fn table(&self) -> String {
        let width = self.checks.iter().map(|f| f.check.len()).max().unwrap_or(0);
        let mut out = format!("lattice hook check {}\n", self.endpoint);
        // What a FAIL is measured against: a hook that needs longer must be
        // given it in Lattice's config, and checked with it.
        let _ = writeln!(
            out,
            "each call's deadline: {} ms (--deadline-ms, the hook's deadline_ms in Lattice's config); \
             message limit: {} bytes (--max-message-bytes)",
            self.deadline_ms, self.max_message_bytes
        );
        if !self.conditions.is_empty() {
            let _ = writeln!(out, "match conditions: {} (as Lattice calls the hook)", self.conditions);
        }
        for f in &self.checks {
            let _ = writeln!(out, "{}  {:<width$}  {}", f.result.as_str(), f.check, f.detail);
        }
        let _ = writeln!(
            out,
            "{} checks: {} passed, {} warning(s), {} failed",
            self.checks.len(),
            self.passed,
            self.warnings,
            self.failed
        );
        out
    }
}

/// The deadline of the `grpc-timeout` check: short, but far above what a
/// call on a healthy network takes.
const SHORT_DEADLINE: Duration = Duration::from_millis(50);
/// How long the `grpc-timeout` check waits for a late answer.
const LATE_ANSWER_WAIT: Duration = Duration::from_secs(2);
const MIB: usize = 1024 * 1024;

/// Runs every check. Err only when the endpoint can't be used at all (a
/// malformed address or TLS setting); a service that doesn't answer is a
/// FAIL of each check.
pub async fn run(options: &Options) -> Result<Report, String> {
    let mut checks = Vec::new();
    // Each check gets a connection of its own, so that one that broke its
    // connection (a deadline, a reset) doesn't fail the next.
    let connect = || Peer::connect(&options.endpoint, options.tls.as_ref(), options.deadline, &Default::default());
    connect()?;
    let hooks = || connect().map(|p| HookServiceClient::new(p).max_decoding_message_size(options.max_message_bytes));
    checks.push(timed("health", health(connect()?)).await);
    checks.push(timed("reflection", reflection(connect()?)).await);
    // Requests as the hook's match conditions let Lattice send them.
    let tool_name = options.tools.as_ref().and_then(|t| t.first()).cloned().unwrap_or_else(|| "lookup".into());
    let tool_result_request = |kind: ToolKind, text: &str| {
        let mut request = requests::tool_result_request(kind, text);
        request.tool_name = tool_name.clone();
        request
    };
    let min_messages = options.min_messages;
    let model_request = |turn: u32, messages: Vec<lattice_proto::agent::v1::Message>| {
        let mut messages = messages;
        if messages.len() < min_messages {
            // An earlier conversation, long enough, before the request's
            // own messages.
            let mut earlier = conversation(min_messages.div_ceil(2), "an earlier tool's output");
            earlier.append(&mut messages);
            messages = earlier;
        }
        requests::model_request(turn, messages)
    };
    if options.tool_result {
        for kind in ToolKind::ALL {
            let request = tool_result_request(kind, "the tool's output");
            let check = format!("tool_result/{}", kind.name());
            checks.push(timed(&check, call_tool_result(hooks()?, request, options.deadline)).await);
        }
        let large = tool_result_request(ToolKind::Executed, &"x".repeat(MIB));
        checks.push(timed("tool_result/1MiB", call_tool_result(hooks()?, large, options.deadline)).await);
        let near = near_limit(options.max_message_bytes, |text| tool_result_request(ToolKind::Executed, text));
        checks.push(timed("tool_result/near_limit", call_tool_result(hooks()?, near, options.deadline)).await);
        let unknown = unknown_fields(connect()?, TOOL_RESULT_PATH, tool_result_request(ToolKind::Executed, "x"));
        checks.push(timed("tool_result/unknown_fields", unknown_field_verdict(unknown, options.deadline)).await);
        let concurrent = concurrently(options.concurrency, || {
            let client = hooks();
            let request = tool_result_request(ToolKind::Executed, "the tool's output");
            async move { call_tool_result(client?, request, options.deadline).await }
        });
        checks.push(timed("tool_result/concurrent", concurrent).await);
        let short = short_deadline(
            hooks()?,
            |mut c, r| async move { c.on_tool_result(r).await.map(drop) },
            || tool_result_request(ToolKind::Executed, "x"),
        );
        checks.push(timed("tool_result/grpc_timeout", short).await);
    }
    if options.model_request {
        let first = model_request(1, vec![user("What is the weather in Paris?")]);
        checks.push(timed("model_request/first_turn", call_model_request(hooks()?, first, options.deadline)).await);
        let long = model_request(21, conversation(20, "a tool's output"));
        checks
            .push(timed("model_request/long_conversation", call_model_request(hooks()?, long, options.deadline)).await);
        let large = model_request(2, conversation(1, &"x".repeat(MIB)));
        checks.push(timed("model_request/1MiB", call_model_request(hooks()?, large, options.deadline)).await);
        let near = near_limit(options.max_message_bytes, |text| model_request(2, conversation(1, text)));
        checks.push(timed("model_request/near_limit", call_model_request(hooks()?, near, options.deadline)).await);
        let unknown = unknown_fields(connect()?, MODEL_REQUEST_PATH, model_request(1, vec![user("hello")]));
        checks.push(timed("model_request/unknown_fields", unknown_field_verdict(unknown, options.deadline)).await);
        let concurrent = concurrently(options.concurrency, || {
            let client = hooks();
            let request = model_request(3, conversation(2, "a tool's output"));
            async move { call_model_request(client?, request, options.deadline).await }
        });
        checks.push(timed("model_request/concurrent", concurrent).await);
        let short = short_deadline(
            hooks()?,
            |mut c, r| async move { c.on_model_request(r).await.map(drop) },
            || model_request(1, vec![user("hello")]),
        );
        checks.push(timed("model_request/grpc_timeout", short).await);
    }
    Ok(Report::new(options, checks))
}

/// What a check found: its verdict and why.
type Outcome = (Verdict, String);

async fn timed(name: &str, check: impl Future<Output = Result<Outcome, String>>) -> Finding {
    let started = Instant::now();
    let (result, detail) = check.await.unwrap_or_else(|e| (Verdict::Fail, e));
    Finding { check: name.to_owned(), result, detail, ms: started.elapsed().as_secs_f64() * 1000.0 }
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

/// What a non-OK status means for Lattice.
fn status_failure(status: &tonic::Status) -> String {
    match status.code() {
        Code::Unimplemented => "UNIMPLEMENTED: every query that reaches this event would abort".to_owned(),
        Code::Unavailable => "UNAVAILABLE: the service could not be reached or refused the call".to_owned(),
        code @ (Code::OutOfRange | Code::ResourceExhausted) => {
            format!("{code:?}: the request is over the service's message limit (Lattice's is larger)")
        }
        code => format!("status {code:?}: Lattice would abort the query"),
    }
}

fn late(deadline: Duration) -> String {
    format!("no answer within the deadline ({})", ms(deadline))
}

/// A failed call: a service that ends the call as its deadline comes (as
/// one that enforces grpc-timeout does, at the same instant as our own
/// timer) did not answer in time; any other status is its answer.
fn call_failure(status: &tonic::Status, started: Instant, deadline: Duration) -> String {
    let at_deadline = started.elapsed() + crate::peer::DEADLINE_SLACK >= deadline;
    if at_deadline && matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled) {
        late(deadline)
    } else {
        status_failure(status)
    }
}

async fn health(peer: Peer) -> Result<Outcome, String> {
    let request = HealthCheckRequest { service: String::new() };
    match HealthClient::new(peer).check(request).await {
        Ok(r) => Ok(match r.into_inner().status() {
            ServingStatus::Serving => (Verdict::Pass, "SERVING".to_owned()),
            other => (Verdict::Fail, format!("{}: Lattice sends it no calls", other.as_str_name())),
        }),
        Err(s) if s.code() == Code::Unimplemented => Ok((
            Verdict::Fail,
            "no grpc.health.v1 service: Kubernetes' gRPC probe fails, and Lattice can't tell when the hook drains"
                .to_owned(),
        )),
        Err(s) => Ok((Verdict::Fail, status_failure(&s))),
    }
}

async fn reflection(peer: Peer) -> Result<Outcome, String> {
    use tonic_reflection::pb::v1alpha::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut client = ServerReflectionClient::new(peer);
    let listed = async {
        let mut replies = client.server_reflection_info(tokio_stream::once(request)).await?.into_inner();
        let reply = replies.message().await?;
        Ok::<_, tonic::Status>(reply.and_then(|r| r.message_response))
    };
    let warn = |why: &str| Ok((Verdict::Warn, format!("{why}: grpcurl can't list or describe this hook")));
    match listed.await {
        Ok(Some(MessageResponse::ListServicesResponse(list))) => {
            if list.service.iter().any(|s| s.name == "lattice.hooks.v1.HookService") {
                Ok((Verdict::Pass, "lists lattice.hooks.v1.HookService".to_owned()))
            } else {
                warn("served, but lattice.hooks.v1.HookService is not listed")
            }
        }
        Ok(_) => warn("no list of services"),
        Err(_) => warn("not served"),
    }
}

async fn call_tool_result(
    mut client: HookServiceClient<Peer>,
    request: pb::OnToolResultRequest,
    deadline: Duration,
) -> Result<Outcome, String> {
    let id = request.tool_use_id.clone();
    let mut request = Request::new(request);
    request.set_timeout(deadline);
    let started = Instant::now();
    let reply = match tokio::time::timeout(deadline, client.on_tool_result(request)).await {
        Err(_) => return Ok((Verdict::Fail, late(deadline))),
        Ok(Err(status)) => return Ok((Verdict::Fail, call_failure(&status, started, deadline))),
        Ok(Ok(reply)) => reply.into_inner(),
    };
    let took = ms(started.elapsed());
    Ok(match reply.result {
        None => (Verdict::Pass, format!("kept, in {took}")),
        Some(r) if r.tool_use_id != id => (
            Verdict::Fail,
            format!("the replacement's tool_use_id is {:?}, not {id:?}: Lattice would abort the query", r.tool_use_id),
        ),
        Some(_) => (Verdict::Pass, format!("replaced, in {took}")),
    })
}

async fn call_model_request(
    mut client: HookServiceClient<Peer>,
    request: pb::OnModelRequestRequest,
    deadline: Duration,
) -> Result<Outcome, String> {
    let mut request = Request::new(request);
    request.set_timeout(deadline);
    let started = Instant::now();
    let reply = match tokio::time::timeout(deadline, client.on_model_request(request)).await {
        Err(_) => return Ok((Verdict::Fail, late(deadline))),
        Ok(Err(status)) => return Ok((Verdict::Fail, call_failure(&status, started, deadline))),
        Ok(Ok(reply)) => reply.into_inner(),
    };
    let took = ms(started.elapsed());
    let mut changed = vec![];
    if reply.system.is_some() {
        changed.push("system");
    }
    if let Some(list) = reply.messages {
        let messages = list
            .messages
            .into_iter()
            .map(Message::try_from)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.0.to_string())
            .and_then(|m| if m.is_empty() { Err("the list is empty".to_owned()) } else { Ok(m) })
            .and_then(|m| validate_conversation(&m));
        if let Err(why) = messages {
            return Ok((Verdict::Fail, format!("invalid replacement messages ({why}): Lattice would abort the query")));
        }
        changed.push("messages");
    }
    Ok(match changed.as_slice() {
        [] => (Verdict::Pass, format!("kept, in {took}")),
        parts => (Verdict::Pass, format!("replaced {}, in {took}", parts.join(" and "))),
    })
}

/// Runs `n` calls at once; passes when every one does.
async fn concurrently<F, Fut>(n: usize, call: F) -> Result<Outcome, String>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<Outcome, String>>,
{
    let started = Instant::now();
    let results = futures_util::future::join_all((0..n).map(|_| call())).await;
    let failures: Vec<String> = results
        .into_iter()
        .filter_map(|r| match r {
            Ok((Verdict::Fail, why)) | Err(why) => Some(why),
            _ => None,
        })
        .collect();
    Ok(match failures.first() {
        None => (Verdict::Pass, format!("{n} calls at once, all answered in {}", ms(started.elapsed()))),
        Some(first) => (Verdict::Fail, format!("{} of {n} calls at once failed; the first: {first}", failures.len())),
    })
}

/// A call with a short `grpc-timeout`, waited for well past it: answered
/// in time, or ended at the deadline (DEADLINE_EXCEEDED or CANCELLED). An
/// OK after the deadline is a service that doesn't stop at it.
async fn short_deadline<R, F, Fut>(
    client: HookServiceClient<Peer>,
    call: F,
    make: impl Fn() -> R,
) -> Result<Outcome, String>
where
    F: Fn(HookServiceClient<Peer>, Request<R>) -> Fut,
    Fut: Future<Output = Result<(), tonic::Status>>,
{
    let mut request = Request::new(make());
    request.set_timeout(SHORT_DEADLINE);
    let started = Instant::now();
    let answer = tokio::time::timeout(LATE_ANSWER_WAIT, call(client, request)).await;
    let took = started.elapsed();
    let deadline = ms(SHORT_DEADLINE);
    Ok(match answer {
        Ok(Ok(())) if took <= SHORT_DEADLINE => {
            (Verdict::Pass, format!("answered in {} (within {deadline})", ms(took)))
        }
        Ok(Ok(())) => (
            Verdict::Fail,
            format!(
                "answered OK after {}, past its grpc-timeout of {deadline}: the service does not stop at the deadline (Lattice gives up on the call and aborts the query)",
                ms(took)
            ),
        ),
        Ok(Err(s)) if matches!(s.code(), Code::DeadlineExceeded | Code::Cancelled) => {
            (Verdict::Pass, format!("ended {:?} at its {deadline} deadline", s.code()))
        }
        Ok(Err(s)) => (Verdict::Fail, status_failure(&s)),
        Err(_) => (
            Verdict::Fail,
            format!("no answer {} after a grpc-timeout of {deadline}: the service ignores it", ms(LATE_ANSWER_WAIT)),
        ),
    })
}

const TOOL_RESULT_PATH: &str = "/lattice.hooks.v1.HookService/OnToolResult";
const MODEL_REQUEST_PATH: &str = "/lattice.hooks.v1.HookService/OnModelRequest";

/// A request with fields from a newer contract: the hook must ignore them
/// (proto3 keeps unknown fields) and answer as usual.
#[derive(Clone, Debug, Default)]
struct WithUnknownFields<T>(T);

/// Field numbers no version of the contract uses.
const UNKNOWN_VARINT: u32 = 9001;
const UNKNOWN_TEXT: u32 = 9002;

impl<T: prost::Message> prost::Message for WithUnknownFields<T> {
    fn encode_raw(&self, buf: &mut impl prost::bytes::BufMut) {
        self.0.encode_raw(buf);
        prost::encoding::uint64::encode(UNKNOWN_VARINT, &42, buf);
        prost::encoding::string::encode(UNKNOWN_TEXT, &"from a newer Lattice".to_owned(), buf);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: prost::encoding::WireType,
        buf: &mut impl prost::bytes::Buf,
        ctx: prost::encoding::DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        prost::encoding::skip_field(wire_type, tag, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        self.0.encoded_len()
            + prost::encoding::uint64::encoded_len(UNKNOWN_VARINT, &42)
            + prost::encoding::string::encoded_len(UNKNOWN_TEXT, &"from a newer Lattice".to_owned())
    }

    fn clear(&mut self) {
        self.0.clear();
    }
}

/// Sends `request` with unknown fields added to the method at `path`.
async fn unknown_fields<T>(peer: Peer, path: &'static str, request: T) -> Result<(), tonic::Status>
where
    T: prost::Message + Clone + Default + Send + Sync + 'static,
{
    let mut grpc = tonic::client::Grpc::new(peer);
    grpc.ready().await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let codec = tonic_prost::ProstCodec::<WithUnknownFields<T>, ()>::default();
    let _ =
        grpc.unary(Request::new(WithUnknownFields(request)), http::uri::PathAndQuery::from_static(path), codec).await?;
    Ok(())
}

async fn unknown_field_verdict(
    call: impl Future<Output = Result<(), tonic::Status>>,
    deadline: Duration,
) -> Result<Outcome, String> {
    Ok(match tokio::time::timeout(deadline, call).await {
        Ok(Ok(())) => (Verdict::Pass, "fields it doesn't know are ignored".to_owned()),
        Ok(Err(s)) => (Verdict::Fail, format!("{} (the request only had fields added)", status_failure(&s))),
        Err(_) => (Verdict::Fail, late(deadline)),
    })
}
