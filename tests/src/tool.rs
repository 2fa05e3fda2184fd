//! A scripted tool service: per-tool reply text, delay, status and is_error,
//! with a record of calls, overlaps and cancellations.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use crate::Background;
use lattice_proto::tools::v1::{self as pb, tool_service_server::ToolServiceServer};
use tonic::{Code, Request, Response, Status};

/// One scripted tool.
#[derive(Debug, Clone, Default)]
pub struct ToolDef {
    /// Its name.
    pub name: String,
    /// Its reply text (`{input}` is replaced by the input JSON).
    pub text: String,
    /// Wait this long first.
    pub delay: Duration,
    /// Answer with this status instead.
    pub fail: Option<Code>,
    /// Answer is_error.
    pub is_error: bool,
}

impl ToolDef {
    /// A tool answering `text`.
    pub fn new(name: &str, text: &str) -> Self {
        Self { name: name.into(), text: text.into(), ..Default::default() }
    }

    /// With a delay.
    pub fn delay(mut self, d: Duration) -> Self {
        self.delay = d;
        self
    }
}

/// Shared state.
#[derive(Debug, Default)]
pub struct ToolState {
    /// Tools.
    pub tools: Mutex<Vec<ToolDef>>,
    /// Calls received: (tool_use_id, tool name, when).
    pub calls: Mutex<Vec<(String, String, Instant)>>,
    /// Calls whose RPC was dropped before answering: (tool_use_id, when).
    pub cancelled: Mutex<Vec<(String, Instant)>>,
    active: AtomicUsize,
    /// The most calls seen running at once.
    pub max_active: AtomicUsize,
}

impl ToolState {
    /// Names of the tools called, in order.
    pub fn called(&self) -> Vec<String> {
        self.calls.lock().unwrap().iter().map(|c| c.1.clone()).collect()
    }
}

/// A running scripted tool service.
pub struct ToolServer {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// Its state.
    pub state: Arc<ToolState>,
    server: Background,
}

impl ToolServer {
    /// Starts a tool service offering `tools`.
    pub async fn start(tools: Vec<ToolDef>) -> ToolServer {
        Self::start_with(tools, None).await
    }

    /// Starts a tool service offering `tools`, over TLS when `tls` is set
    /// (its `url` is then `https://`).
    pub async fn start_with(tools: Vec<ToolDef>, tls: Option<tonic::transport::ServerTlsConfig>) -> ToolServer {
        let (listener, _) = crate::bind().await;
        Self::serve(listener, tools, tls)
    }

    /// Starts a tool service on a bound listener.
    pub async fn start_on(listener: tokio::net::TcpListener, tools: Vec<ToolDef>) -> ToolServer {
        Self::serve(listener, tools, None)
    }

    fn serve(
        listener: tokio::net::TcpListener,
        tools: Vec<ToolDef>,
        tls: Option<tonic::transport::ServerTlsConfig>,
    ) -> ToolServer {
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(ToolState { tools: Mutex::new(tools), ..Default::default() });
        let scheme = if tls.is_some() { "https" } else { "http" };
        let routes = tonic::service::Routes::new(ToolServiceServer::new(Scripted(state.clone())));
        let server = Background::serve_with(listener, routes, tls);
        ToolServer { url: format!("{scheme}://{addr}"), state, server }
    }

    /// Stops the server (its port closes).
    pub fn stop(&mut self) {
        self.server.stop();
    }
}

struct Scripted(Arc<ToolState>);

/// Records a cancellation when a call's future is dropped before it ends.
struct InFlight {
    state: Arc<ToolState>,
    id: String,
    done: bool,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.state.active.fetch_sub(1, Ordering::SeqCst);
        if !self.done {
            self.state.cancelled.lock().unwrap().push((self.id.clone(), Instant::now()));
        }
    }
}

#[tonic::async_trait]
impl pb::tool_service_server::ToolService for Scripted {
    async fn list_tools(&self, _: Request<pb::ListToolsRequest>) -> Result<Response<pb::ListToolsResponse>, Status> {
        let tools = self.0.tools.lock().unwrap().clone();
        Ok(Response::new(pb::ListToolsResponse {
            tools: tools
                .into_iter()
                .map(|t| pb::Tool {
                    name: t.name.clone(),
                    description: format!("scripted {}", t.name),
                    input_schema: None,
                })
                .collect(),
        }))
    }

    async fn call_tool(&self, request: Request<pb::CallToolRequest>) -> Result<Response<pb::CallToolResponse>, Status> {
        let call = request.into_inner();
        self.0.calls.lock().unwrap().push((call.tool_use_id.clone(), call.name.clone(), Instant::now()));
        let now = self.0.active.fetch_add(1, Ordering::SeqCst) + 1;
        self.0.max_active.fetch_max(now, Ordering::SeqCst);
        let mut guard = InFlight { state: self.0.clone(), id: call.tool_use_id.clone(), done: false };
        let def = self.0.tools.lock().unwrap().iter().find(|t| t.name == call.name).cloned();
        let Some(def) = def else {
            guard.done = true;
            return Err(Status::not_found("no such tool"));
        };
        if !def.delay.is_zero() {
            tokio::time::sleep(def.delay).await;
        }
        guard.done = true;
        if let Some(code) = def.fail {
            return Err(Status::new(code, format!("{} failed", def.name)));
        }
        let input = serde_json::Value::Object(lattice_server::convert::from_struct(call.input));
        let text = def.text.replace("{input}", &input.to_string());
        Ok(Response::new(pb::CallToolResponse {
            content: vec![pb::ToolContent { kind: Some(pb::tool_content::Kind::Text(text)) }],
            is_error: def.is_error,
        }))
    }
}
