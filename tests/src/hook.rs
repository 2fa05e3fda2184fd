//! A scripted hook service: behaviour set per test (delay, status, reply),
//! and a record of every call it received, with its grpc-timeout header.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use crate::Background;
use lattice_proto::{
    agent::v1 as apb,
    hooks::v1::{self as pb, hook_service_server::HookServiceServer},
};
use tonic::{Code, Request, Response, Status};

/// What the hook does with a tool result.
#[derive(Debug, Clone, Default)]
pub enum OnResult {
    /// Unset reply.
    #[default]
    Keep,
    /// Appends this text to the last text block.
    Append(String),
    /// Replaces the content with this text.
    ReplaceText(String),
    /// Flips is_error (and keeps the text).
    SetError(bool),
    /// A replacement with another tool_use_id (holding the result's text).
    WrongId,
    /// A replacement of this many bytes.
    Huge(usize),
}

/// What the hook does with a model request.
#[derive(Debug, Clone, Default)]
pub enum OnRequest {
    /// Unset reply.
    #[default]
    Keep,
    /// Appends to the system prompt.
    AppendSystem(String),
    /// Replaces the system prompt only.
    System(String),
    /// Replaces the messages with an empty list.
    EmptyMessages,
    /// Keeps only the first message (the first prompt).
    FirstMessageOnly,
    /// Appends a text to the last user message's last text block.
    AppendToLastText(String),
    /// Replaces the first text (`.0`) with the second (`.1`) in every text
    /// block of every message: a redaction of the prompts.
    ReplaceInTexts(String, String),
    /// A replacement that breaks pairing (an unanswered tool_use).
    Dangling,
    /// A message with role unspecified.
    BadRole,
}

/// The hook's behaviour.
#[derive(Debug, Clone, Default)]
pub struct Behaviour {
    /// Wait this long before answering.
    pub delay: Duration,
    /// Never answer.
    pub hang: bool,
    /// Answer with this status.
    pub fail: Option<Code>,
    /// The failing status's message (default "scripted failure").
    pub fail_message: Option<String>,
    /// Tool results.
    pub on_result: OnResult,
    /// Model requests.
    pub on_request: OnRequest,
}

/// One call the hook received.
#[derive(Debug, Clone)]
pub enum Seen {
    /// OnToolResult.
    ToolResult(pb::OnToolResultRequest),
    /// OnModelRequest.
    ModelRequest(pb::OnModelRequestRequest),
}

/// What a hook saw, with when and under which grpc-timeout.
#[derive(Debug, Clone)]
pub struct Call {
    /// The request.
    pub seen: Seen,
    /// Its grpc-timeout header.
    pub grpc_timeout: Option<String>,
    /// Its W3C traceparent header (with telemetry on).
    pub traceparent: Option<String>,
    /// When it arrived.
    pub at: Instant,
}

/// Shared state of a scripted hook.
#[derive(Debug, Default)]
pub struct State {
    /// The behaviour (change it any time).
    pub behaviour: Mutex<Behaviour>,
    /// Calls received, in order.
    pub calls: Mutex<Vec<Call>>,
}

impl State {
    /// Tool-result calls.
    pub fn tool_results(&self) -> Vec<pb::OnToolResultRequest> {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter_map(|c| match &c.seen {
                Seen::ToolResult(r) => Some(r.clone()),
                _ => None,
            })
            .collect()
    }

    /// Model-request calls.
    pub fn model_requests(&self) -> Vec<pb::OnModelRequestRequest> {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter_map(|c| match &c.seen {
                Seen::ModelRequest(r) => Some(r.clone()),
                _ => None,
            })
            .collect()
    }

    /// Sets the behaviour.
    pub fn set(&self, b: Behaviour) {
        *self.behaviour.lock().unwrap() = b;
    }
}

/// A running scripted hook.
pub struct HookServer {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// Its state.
    pub state: Arc<State>,
    server: Background,
}

impl HookServer {
    /// Starts a hook with `behaviour` on a fresh port.
    pub async fn start(behaviour: Behaviour) -> HookServer {
        let (listener, addr) = crate::bind().await;
        Self::start_on(listener, addr, behaviour).await
    }

    /// Starts a hook on a given listener.
    pub async fn start_on(
        listener: tokio::net::TcpListener,
        addr: std::net::SocketAddr,
        behaviour: Behaviour,
    ) -> HookServer {
        Self::serve(listener, addr, behaviour, None)
    }

    /// Starts a hook serving TLS (its `url` is `https://`).
    pub async fn start_tls(behaviour: Behaviour, tls: tonic::transport::ServerTlsConfig) -> HookServer {
        let (listener, addr) = crate::bind().await;
        Self::serve(listener, addr, behaviour, Some(tls))
    }

    fn serve(
        listener: tokio::net::TcpListener,
        addr: std::net::SocketAddr,
        behaviour: Behaviour,
        tls: Option<tonic::transport::ServerTlsConfig>,
    ) -> HookServer {
        let state = Arc::new(State { behaviour: Mutex::new(behaviour), calls: Mutex::new(vec![]) });
        let routes = tonic::service::Routes::new(
            HookServiceServer::new(Scripted(state.clone())).max_encoding_message_size(64 << 20),
        );
        let scheme = if tls.is_some() { "https" } else { "http" };
        let server = Background::serve_with(listener, routes, tls);
        HookServer { url: format!("{scheme}://{addr}"), state, server }
    }

    /// Starts a hook that does not stop at a call's `grpc-timeout`: served
    /// by hyper alone (tonic's server would enforce the deadline), as a
    /// service whose handler ignores its deadline would behave.
    pub async fn start_ignoring_deadlines(behaviour: Behaviour) -> HookServer {
        let (listener, addr) = crate::bind().await;
        let state = Arc::new(State { behaviour: Mutex::new(behaviour), calls: Mutex::new(vec![]) });
        let service = HookServiceServer::new(Scripted(state.clone()));
        let server = Background::serve_h2(listener, hyper_util::service::TowerToHyperService::new(service));
        HookServer { url: format!("http://{addr}"), state, server }
    }

    /// Stops the server (its port closes).
    pub fn stop(&mut self) {
        self.server.stop();
    }
}

struct Scripted(Arc<State>);

impl Scripted {
    async fn behave(&self, seen: Seen, headers: (Option<String>, Option<String>)) -> Result<Behaviour, Status> {
        let (grpc_timeout, traceparent) = headers;
        self.0.calls.lock().unwrap().push(Call { seen, grpc_timeout, traceparent, at: Instant::now() });
        let b = self.0.behaviour.lock().unwrap().clone();
        if b.hang {
            std::future::pending::<()>().await;
        }
        if !b.delay.is_zero() {
            tokio::time::sleep(b.delay).await;
        }
        if let Some(code) = b.fail {
            // A message that would leak if Lattice passed it on.
            return Err(Status::new(code, b.fail_message.as_deref().unwrap_or("scripted failure")));
        }
        Ok(b)
    }
}

/// A request's grpc-timeout and traceparent headers.
fn timeout_of<T>(r: &Request<T>) -> (Option<String>, Option<String>) {
    let header = |name: &str| r.metadata().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    (header("grpc-timeout"), header("traceparent"))
}

fn text_block(t: &str) -> apb::ContentBlock {
    apb::ContentBlock { block: Some(apb::content_block::Block::Text(apb::TextBlock { text: t.into() })) }
}

#[tonic::async_trait]
impl pb::hook_service_server::HookService for Scripted {
    async fn on_tool_result(
        &self,
        request: Request<pb::OnToolResultRequest>,
    ) -> Result<Response<pb::OnToolResultResponse>, Status> {
        let timeout = timeout_of(&request);
        let req = request.into_inner();
        let b = self.behave(Seen::ToolResult(req.clone()), timeout).await?;
        let mut r = req.result.clone().unwrap_or_default();
        let result = match b.on_result {
            OnResult::Keep => None,
            OnResult::Append(s) => {
                match r.content.last_mut() {
                    Some(t) => t.text.push_str(&s),
                    None => r.content.push(apb::TextBlock { text: s }),
                }
                Some(r)
            }
            OnResult::ReplaceText(s) => {
                r.content = vec![apb::TextBlock { text: s }];
                Some(r)
            }
            OnResult::SetError(e) => {
                r.is_error = e;
                Some(r)
            }
            OnResult::WrongId => {
                // A hook that copies the content into the id: Lattice must
                // not repeat the id anywhere.
                r.tool_use_id = format!("id-{}", r.content.iter().map(|t| t.text.as_str()).collect::<String>());
                Some(r)
            }
            OnResult::Huge(n) => {
                r.content = vec![apb::TextBlock { text: "x".repeat(n) }];
                Some(r)
            }
        };
        Ok(Response::new(pb::OnToolResultResponse { result }))
    }

    async fn on_model_request(
        &self,
        request: Request<pb::OnModelRequestRequest>,
    ) -> Result<Response<pb::OnModelRequestResponse>, Status> {
        let timeout = timeout_of(&request);
        let req = request.into_inner();
        let b = self.behave(Seen::ModelRequest(req.clone()), timeout).await?;
        let list = |messages| Some(pb::MessageList { messages });
        let reply = match b.on_request {
            OnRequest::Keep => pb::OnModelRequestResponse::default(),
            OnRequest::AppendSystem(s) => {
                pb::OnModelRequestResponse { system: Some(format!("{}{s}", req.system)), messages: None }
            }
            OnRequest::System(s) => pb::OnModelRequestResponse { system: Some(s), messages: None },
            OnRequest::EmptyMessages => pb::OnModelRequestResponse { system: None, messages: list(vec![]) },
            OnRequest::FirstMessageOnly => pb::OnModelRequestResponse {
                system: None,
                messages: list(req.messages.first().cloned().into_iter().collect()),
            },
            OnRequest::AppendToLastText(s) => {
                let mut messages = req.messages.clone();
                if let Some(m) = messages.last_mut() {
                    m.content.push(text_block(&s));
                }
                pb::OnModelRequestResponse { system: None, messages: list(messages) }
            }
            OnRequest::ReplaceInTexts(from, to) => {
                let mut messages = req.messages.clone();
                for block in messages.iter_mut().flat_map(|m| m.content.iter_mut()) {
                    if let Some(apb::content_block::Block::Text(t)) = &mut block.block {
                        t.text = t.text.replace(&from, &to);
                    }
                }
                pb::OnModelRequestResponse { system: None, messages: list(messages) }
            }
            OnRequest::Dangling => {
                let mut messages = req.messages.clone();
                let tool_use = apb::ToolUseBlock { id: "dangling".into(), name: "x".into(), input: None };
                messages.push(apb::Message {
                    role: apb::Role::Assistant as i32,
                    content: vec![apb::ContentBlock { block: Some(apb::content_block::Block::ToolUse(tool_use)) }],
                });
                pb::OnModelRequestResponse { system: None, messages: list(messages) }
            }
            OnRequest::BadRole => {
                let m = apb::Message { role: 0, content: vec![text_block("x")] };
                pb::OnModelRequestResponse { system: None, messages: list(vec![m]) }
            }
        };
        Ok(Response::new(reply))
    }
}
