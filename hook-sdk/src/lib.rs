//! Write Lattice hook services in Rust.
//!
//! A hook sees, and may replace, what a Lattice agent sends to its model:
//! each tool result on its way back ([`Hook::on_tool_result`]) and each model
//! request before it is sent ([`Hook::on_model_request`]). Both default to
//! "keep", so a hook implements only what it needs.
//!
//! ```no_run
//! use lattice_hook_sdk::{Hook, ToolResultCall, ToolResultBlock, Status, text_of, with_text};
//!
//! struct Shout;
//!
//! #[lattice_hook_sdk::async_trait]
//! impl Hook for Shout {
//!     async fn on_tool_result(&self, call: ToolResultCall) -> Result<Option<ToolResultBlock>, Status> {
//!         let result = call.result.unwrap_or_default();
//!         let loud = text_of(&result).to_uppercase();
//!         Ok(Some(with_text(&result, loud)))
//!     }
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     lattice_hook_sdk::serve(Shout, "127.0.0.1:50071".parse()?).await?;
//!     Ok(())
//! }
//! ```
//!
//! Several hooks can run in one service, in order, each seeing the previous
//! one's output: [`Chain`]. [`serve_tls`] serves TLS, and with
//! [`Tls::require_client_ca`] mutual TLS. Lattice itself calls the hooks registered for an
//! agent in order, within strict deadlines, and aborts the query when any
//! call fails: returning an error `Status` from a hook is how a hook refuses
//! to let a value through.
#![warn(missing_docs)]

use std::{future::Future, net::SocketAddr, sync::Arc, time::Duration};

use lattice_proto::hooks::v1::{
    self as pb,
    hook_service_server::{HookService, HookServiceServer},
};
use tokio::net::TcpListener;

pub use lattice_proto::agent::v1::{ContentBlock, Message, Role, TextBlock, ToolResultBlock, ToolSpec, content_block};
pub use lattice_proto::hooks::v1::{
    HookContext, OnModelRequestRequest as ModelRequestCall, OnToolResultRequest as ToolResultCall, ResultSource,
    SourceKind, ToolError, ToolErrorKind,
};
pub use tonic::{Code, Status, async_trait};

/// The generated contract, for anything the re-exports above don't cover.
pub use lattice_proto as proto;

/// A hook's change to a model request. `None` keeps that part; `Some`
/// replaces it (an empty message list is a real replacement).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelRequestChange {
    /// Replacement system prompt.
    pub system: Option<String>,
    /// Replacement messages.
    pub messages: Option<Vec<Message>>,
}

impl ModelRequestChange {
    /// Change nothing.
    pub fn keep() -> Self {
        Self::default()
    }

    /// Replace the messages.
    pub fn messages(messages: Vec<Message>) -> Self {
        Self { system: None, messages: Some(messages) }
    }

    /// Replace the system prompt.
    pub fn system(system: impl Into<String>) -> Self {
        Self { system: Some(system.into()), messages: None }
    }

    /// Whether this keeps everything.
    pub fn is_keep(&self) -> bool {
        self.system.is_none() && self.messages.is_none()
    }
}

/// A hook. Both methods default to keeping the value unchanged.
///
/// Return `Err(status)` to refuse: Lattice then aborts the query and the
/// value is never sent on. Register the hook in Lattice's config for the
/// events it implements.
#[async_trait]
pub trait Hook: Send + Sync + 'static {
    /// A tool result on its way to the model. `Ok(None)` keeps it;
    /// `Ok(Some(r))` replaces it (`r.tool_use_id` must stay the same;
    /// `is_error` may change either way).
    async fn on_tool_result(&self, call: ToolResultCall) -> Result<Option<ToolResultBlock>, Status> {
        let _ = call;
        Ok(None)
    }

    /// A model request about to be sent. The change applies to this one
    /// request; Lattice's stored conversation is not changed.
    async fn on_model_request(&self, call: ModelRequestCall) -> Result<ModelRequestChange, Status> {
        let _ = call;
        Ok(ModelRequestChange::keep())
    }
}

#[async_trait]
impl<H: Hook + ?Sized> Hook for Arc<H> {
    async fn on_tool_result(&self, call: ToolResultCall) -> Result<Option<ToolResultBlock>, Status> {
        (**self).on_tool_result(call).await
    }
    async fn on_model_request(&self, call: ModelRequestCall) -> Result<ModelRequestChange, Status> {
        (**self).on_model_request(call).await
    }
}

/// Several hooks in one service, called in order; each sees the previous
/// one's output, and the first error stops the chain.
#[derive(Default)]
pub struct Chain {
    hooks: Vec<Box<dyn Hook>>,
}

impl Chain {
    /// An empty chain (keeps everything).
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a hook.
    pub fn then(mut self, hook: impl Hook) -> Self {
        self.hooks.push(Box::new(hook));
        self
    }
}

#[async_trait]
impl Hook for Chain {
    async fn on_tool_result(&self, mut call: ToolResultCall) -> Result<Option<ToolResultBlock>, Status> {
        let mut replaced = false;
        for hook in &self.hooks {
            if let Some(r) = hook.on_tool_result(call.clone()).await? {
                call.result = Some(r);
                replaced = true;
            }
        }
        Ok(if replaced { call.result } else { None })
    }

    async fn on_model_request(&self, mut call: ModelRequestCall) -> Result<ModelRequestChange, Status> {
        let mut total = ModelRequestChange::keep();
        for hook in &self.hooks {
            let change = hook.on_model_request(call.clone()).await?;
            if let Some(s) = change.system {
                call.system = s.clone();
                total.system = Some(s);
            }
            if let Some(m) = change.messages {
                call.messages = m.clone();
                total.messages = Some(m);
            }
        }
        Ok(total)
    }
}

/// The concatenated text of a tool result.
pub fn text_of(result: &ToolResultBlock) -> String {
    result.content.iter().map(|t| t.text.as_str()).collect()
}

/// A copy of `result` whose content is the one text block `text`.
pub fn with_text(result: &ToolResultBlock, text: impl Into<String>) -> ToolResultBlock {
    ToolResultBlock {
        tool_use_id: result.tool_use_id.clone(),
        content: vec![TextBlock { text: text.into() }],
        is_error: result.is_error,
    }
}

/// Adapts a [`Hook`] to the generated gRPC service.
pub struct HookServer<H> {
    hook: Arc<H>,
}

impl<H: Hook> HookServer<H> {
    /// Wraps `hook`.
    pub fn new(hook: H) -> Self {
        Self { hook: Arc::new(hook) }
    }

    /// The tonic service, for embedding in your own server. Requests and
    /// replies up to [`max_message_bytes`] are accepted: the same limit as
    /// Lattice's own default (`server.hook_max_message_bytes`), instead of
    /// tonic's 4 MiB, so a large tool result reaches the hook.
    pub fn into_service(self) -> HookServiceServer<Self> {
        let limit = max_message_bytes();
        HookServiceServer::new(self).max_decoding_message_size(limit).max_encoding_message_size(limit)
    }
}

#[async_trait]
impl<H: Hook> HookService for HookServer<H> {
    async fn on_tool_result(
        &self,
        request: tonic::Request<pb::OnToolResultRequest>,
    ) -> Result<tonic::Response<pb::OnToolResultResponse>, Status> {
        let result = self.hook.on_tool_result(request.into_inner()).await?;
        Ok(tonic::Response::new(pb::OnToolResultResponse { result }))
    }

    async fn on_model_request(
        &self,
        request: tonic::Request<pb::OnModelRequestRequest>,
    ) -> Result<tonic::Response<pb::OnModelRequestResponse>, Status> {
        let change = self.hook.on_model_request(request.into_inner()).await?;
        Ok(tonic::Response::new(pb::OnModelRequestResponse {
            system: change.system,
            messages: change.messages.map(|messages| pb::MessageList { messages }),
        }))
    }
}

/// TLS for a hook service: its certificate and key, and optionally the CA
/// whose certificates clients must present (mutual TLS). Lattice connects
/// with TLS to `https://` and TLS-configured `dns:///` endpoints.
#[derive(Clone)]
pub struct Tls {
    cert_pem: String,
    key_pem: String,
    client_ca_pem: Option<String>,
}

impl std::fmt::Debug for Tls {
    // Never prints the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").field("mutual", &self.client_ca_pem.is_some()).finish_non_exhaustive()
    }
}

impl Tls {
    /// Serves with this certificate (chain) and private key, both PEM.
    pub fn new(cert_pem: impl Into<String>, key_pem: impl Into<String>) -> Self {
        Tls { cert_pem: cert_pem.into(), key_pem: key_pem.into(), client_ca_pem: None }
    }

    /// Accepts only clients that present a certificate signed by this CA
    /// (PEM): mutual TLS.
    pub fn require_client_ca(mut self, ca_pem: impl Into<String>) -> Self {
        self.client_ca_pem = Some(ca_pem.into());
        self
    }

    fn server_config(&self) -> tonic::transport::ServerTlsConfig {
        let config = tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(&self.cert_pem, &self.key_pem));
        match &self.client_ca_pem {
            Some(ca) => config.client_ca_root(tonic::transport::Certificate::from_pem(ca)),
            None => config,
        }
    }
}

/// Why serving failed.
#[derive(Debug)]
pub enum ServeError {
    /// Binding the address.
    Bind(std::io::Error),
    /// The gRPC transport.
    Transport(tonic::transport::Error),
    /// Building reflection.
    Reflection(tonic_reflection::server::Error),
}

impl std::fmt::Display for ServeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServeError::Bind(e) => write!(f, "cannot bind: {e}"),
            ServeError::Transport(e) => write!(f, "transport: {e}"),
            ServeError::Reflection(e) => write!(f, "reflection: {e}"),
        }
    }
}

impl std::error::Error for ServeError {}

/// The variable that sets the largest request or reply a hook served by
/// this SDK handles, in bytes; set it to Lattice's
/// `server.hook_max_message_bytes` when you change that.
pub const MAX_MESSAGE_BYTES_ENV: &str = "LATTICE_HOOK_MAX_MESSAGE_BYTES";

/// The default of [`MAX_MESSAGE_BYTES_ENV`]: Lattice's default hook limit.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

/// The largest request or reply: [`MAX_MESSAGE_BYTES_ENV`], else
/// [`DEFAULT_MAX_MESSAGE_BYTES`].
pub fn max_message_bytes() -> usize {
    std::env::var(MAX_MESSAGE_BYTES_ENV).ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_MAX_MESSAGE_BYTES)
}

/// The variable that sets the drain period of [`serve`] and [`serve_tls`],
/// in milliseconds.
pub const DRAIN_ENV: &str = "LATTICE_HOOK_DRAIN_MS";

/// How long [`serve`] keeps serving after SIGTERM by default: long enough
/// for Kubernetes to take the pod out of its Service's endpoints and for
/// Lattice to re-resolve a `dns:///` name (every 5 s).
pub const DEFAULT_DRAIN: Duration = Duration::from_secs(6);

/// The drain period: `LATTICE_HOOK_DRAIN_MS`, else [`DEFAULT_DRAIN`].
fn drain_from_env() -> Duration {
    std::env::var(DRAIN_ENV).ok().and_then(|v| v.parse().ok()).map_or(DEFAULT_DRAIN, Duration::from_millis)
}

/// Serves `hook` on `addr` until SIGTERM or Ctrl-C, with gRPC health
/// (`grpc.health.v1`) and reflection (v1 and v1alpha) included.
///
/// On SIGTERM it drains, so that a rolling update loses no call: health
/// turns NOT_SERVING at once, calls keep being served (in flight, and new
/// ones on open or new connections) for the drain period
/// ([`DRAIN_ENV`], default [`DEFAULT_DRAIN`]), then the server sends GOAWAY,
/// finishes the calls in flight and returns.
pub async fn serve(hook: impl Hook, addr: SocketAddr) -> Result<(), ServeError> {
    let signal = shutdown_signal();
    let listener = TcpListener::bind(addr).await.map_err(ServeError::Bind)?;
    serve_draining_on(hook, listener, None, signal, drain_from_env()).await
}

/// [`serve`] over TLS (see [`Tls`]).
pub async fn serve_tls(hook: impl Hook, addr: SocketAddr, tls: Tls) -> Result<(), ServeError> {
    let signal = shutdown_signal();
    let listener = TcpListener::bind(addr).await.map_err(ServeError::Bind)?;
    serve_draining_on(hook, listener, Some(tls), signal, drain_from_env()).await
}

/// Serves `hook` on a bound listener until `shutdown` resolves (for tests
/// and embedding), with health and reflection; no drain period.
pub async fn serve_on(
    hook: impl Hook,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    serve_draining_on(hook, listener, None, shutdown, Duration::ZERO).await
}

/// [`serve_on`] over TLS.
pub async fn serve_tls_on(
    hook: impl Hook,
    listener: TcpListener,
    tls: Tls,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    serve_draining_on(hook, listener, Some(tls), shutdown, Duration::ZERO).await
}

/// Serves `hook` on a bound listener (over TLS when `tls` is set); when
/// `shutdown` resolves, drains for `drain` (see [`serve`]) and returns once
/// the calls in flight have finished.
pub async fn serve_draining_on(
    hook: impl Hook,
    listener: TcpListener,
    tls: Option<Tls>,
    shutdown: impl Future<Output = ()> + Send,
    drain: Duration,
) -> Result<(), ServeError> {
    let (health, health_svc) = tonic_health::server::health_reporter();
    health.set_serving::<HookServiceServer<HookServer<Chain>>>().await;
    health.set_service_status("", tonic_health::ServingStatus::Serving).await;
    let v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(lattice_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(ServeError::Reflection)?;
    let v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(lattice_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .map_err(ServeError::Reflection)?;
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = &tls {
        server = server.tls_config(tls.server_config()).map_err(ServeError::Transport)?;
    }
    tracing::info!(addr = ?listener.local_addr().ok(), tls = tls.is_some(), "hook serving");
    let drained = async move {
        shutdown.await;
        // Said first, so that Kubernetes and Lattice stop sending calls here;
        // the ones that still come are served until the drain ends.
        health.set_not_serving::<HookServiceServer<HookServer<Chain>>>().await;
        health.set_service_status("", tonic_health::ServingStatus::NotServing).await;
        tracing::info!(drain_ms = drain.as_millis() as u64, "draining: NOT_SERVING, still serving calls");
        tokio::time::sleep(drain).await;
        tracing::info!("drained: GOAWAY, finishing the calls in flight");
    };
    server
        .add_service(health_svc)
        .add_service(v1)
        .add_service(v1alpha)
        .add_service(HookServer::new(hook).into_service())
        .serve_with_incoming_shutdown(incoming(listener), drained)
        .await
        .map_err(ServeError::Transport)
}

/// Accepted connections with TCP_NODELAY: without it, small gRPC frames
/// wait for delayed ACKs (~40 ms a round trip), and a hook sits on the
/// critical path of every model request and tool result.
fn incoming(listener: TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// Resolves on SIGTERM or Ctrl-C. The SIGTERM handler is installed when
/// this is called, not when the future is first polled: call it before the
/// port opens, so that a SIGTERM that comes right after is not the default
/// action (an abrupt exit).
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send {
    #[cfg(unix)]
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    async move {
        #[cfg(unix)]
        if let Some(mut term) = term {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            return;
        }
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Append(&'static str);

    #[async_trait]
    impl Hook for Append {
        async fn on_tool_result(&self, call: ToolResultCall) -> Result<Option<ToolResultBlock>, Status> {
            let r = call.result.unwrap_or_default();
            Ok(Some(with_text(&r, format!("{}{}", text_of(&r), self.0))))
        }
        async fn on_model_request(&self, call: ModelRequestCall) -> Result<ModelRequestChange, Status> {
            Ok(ModelRequestChange::system(format!("{}{}", call.system, self.0)))
        }
    }

    struct Keep;
    #[async_trait]
    impl Hook for Keep {}

    fn call(text: &str) -> ToolResultCall {
        ToolResultCall {
            tool_use_id: "t1".into(),
            result: Some(ToolResultBlock {
                tool_use_id: "t1".into(),
                content: vec![TextBlock { text: text.into() }],
                is_error: false,
            }),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_chain_folds_in_order_and_keeps_when_nobody_replaces() {
        let chain = Chain::new().then(Append("a")).then(Keep).then(Append("b"));
        let out = chain.on_tool_result(call("x")).await.unwrap().unwrap();
        assert_eq!(text_of(&out), "xab");
        let req = ModelRequestCall { system: "s".into(), ..Default::default() };
        assert_eq!(chain.on_model_request(req).await.unwrap().system.as_deref(), Some("sab"));

        let keep = Chain::new().then(Keep).then(Keep);
        assert_eq!(keep.on_tool_result(call("x")).await.unwrap(), None);
        assert!(keep.on_model_request(ModelRequestCall::default()).await.unwrap().is_keep());
    }
}
