//! Write Lattice hook services in Rust.
//!
//! A hook sees, and may replace, what a Lattice agent sends to its model:
//! each tool result on its way back ([`Hook::on_tool_result`]) and each model
//! request before it is sent ([`Hook::on_model_request`]). Both default to
//! "keep", so a hook implements only what it needs.
//!
//! ```no_run
//! use lattice_hook_sdk::{Hook, ToolResultCall, ToolResultBlock, Status};
//!
//! struct Shout;
//!
//! #[lattice_hook_sdk::async_trait]
//! impl Hook for Shout {
//!     async fn on_tool_result(&self, call: ToolResultCall) -> Result<Option<ToolResultBlock>, Status> {
//!         Ok(Some(call.replace_text(call.text().to_uppercase())))
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
//! A hook whose work per call is small costs less on one thread
//! (`#[tokio::main(flavor = "current_thread")]`): each call stays on the
//! thread that reads it. One that spends milliseconds of CPU on a call keeps
//! the default runtime, so that other calls go on meanwhile (the README's
//! "A hook's runtime" has the figures).
//!
//! Several hooks can run in one service, in order, each seeing the previous
//! one's output: [`Chain`]. [`Server`] sets TLS (with
//! [`Tls::require_client_ca`], mutual TLS), the drain period and the
//! message limit, and serves on an address or a bound listener. Lattice itself calls the hooks registered for an
//! agent in order, within strict deadlines, and aborts the query when any
//! call fails: returning an error `Status` from a hook is how a hook refuses
//! to let a value through.
#![warn(missing_docs)]

mod replies;

use std::{future::Future, net::SocketAddr, sync::Arc, time::Duration};

use lattice_proto::hooks::v1::{
    self as pb,
    hook_service_server::{HookService, HookServiceServer},
};
use tokio::net::TcpListener;
use tracing::Instrument;

pub use lattice_proto::agent::v1::{ContentBlock, Message, Role, TextBlock, ToolResultBlock, ToolSpec, content_block};
pub use lattice_proto::hooks::v1::{HookContext, ResultSource, SourceKind, ToolError, ToolErrorKind};
pub use serde_json::{Map as JsonMap, Value as JsonValue};

/// A tool result on its way to the model (`OnToolResult`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ToolResultCall {
    /// Where the call comes from (agent, session, query, turn).
    pub context: HookContext,
    /// The tool the model called.
    pub tool_name: String,
    /// The id of the model's tool_use block; a replacement must keep it.
    pub tool_use_id: String,
    /// The input the model sent to the tool.
    pub input: JsonMap<String, JsonValue>,
    /// The result as it stands after the previous hooks.
    pub result: ToolResultBlock,
    /// Why the call did not execute successfully, if so.
    pub error: Option<ToolError>,
    /// What produced the result.
    pub source: Option<ResultSource>,
    /// The trace this call belongs to, when Lattice exports traces.
    pub trace: Option<TraceParent>,
}

impl ToolResultCall {
    /// The result's text (its text blocks, concatenated).
    pub fn text(&self) -> String {
        text_of(&self.result)
    }

    /// A replacement of the result: one text block `text`, the same
    /// `tool_use_id` and `is_error`.
    pub fn replace_text(&self, text: impl Into<String>) -> ToolResultBlock {
        with_text(&self.result, text)
    }
}

impl From<pb::OnToolResultRequest> for ToolResultCall {
    fn from(r: pb::OnToolResultRequest) -> Self {
        ToolResultCall {
            context: r.context.unwrap_or_default(),
            tool_name: r.tool_name,
            tool_use_id: r.tool_use_id,
            input: r.input.map(json_object).unwrap_or_default(),
            result: r.result.unwrap_or_default(),
            error: r.error,
            source: r.source,
            trace: None,
        }
    }
}

/// A model request about to be sent (`OnModelRequest`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelRequestCall {
    /// Where the call comes from (`turn` is the 1-based model request).
    pub context: HookContext,
    /// The system prompt, as it stands after the previous hooks.
    pub system: String,
    /// The messages, as they stand after the previous hooks (`role()`
    /// gives each one's [`Role`]).
    pub messages: Vec<Message>,
    /// The tools offered to the model (read-only).
    pub tools: Vec<ToolSpec>,
    /// How many of the oldest messages were left out to fit the hook
    /// message limit (0 when none).
    pub omitted_messages: u32,
    /// The trace this call belongs to, when Lattice exports traces.
    pub trace: Option<TraceParent>,
}

impl From<pb::OnModelRequestRequest> for ModelRequestCall {
    fn from(r: pb::OnModelRequestRequest) -> Self {
        ModelRequestCall {
            context: r.context.unwrap_or_default(),
            system: r.system,
            messages: r.messages,
            tools: r.tools,
            omitted_messages: r.omitted_messages,
            trace: None,
        }
    }
}

/// The W3C trace context of a call: Lattice sends the `traceparent` of
/// its `hook` span with every call when it exports OpenTelemetry traces.
///
/// The SDK runs each call in a `hook_call` span (target
/// `lattice_hook_sdk`) whose `trace_id` and `parent_span_id` fields carry
/// it, so the hook's log lines join the query's trace. With the
/// `opentelemetry` feature the span's OpenTelemetry parent is Lattice's
/// span: a hook that installs a `tracing-opentelemetry` layer exports its
/// spans under Lattice's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceParent {
    /// 32 lowercase hex digits.
    pub trace_id: String,
    /// The id of Lattice's `hook` span: 16 lowercase hex digits.
    pub parent_span_id: String,
    /// Whether Lattice samples the trace.
    pub sampled: bool,
}

impl TraceParent {
    /// Parses a `traceparent` value (version 00); `None` if malformed or
    /// all-zero.
    pub fn parse(value: &str) -> Option<TraceParent> {
        let mut parts = value.trim().split('-');
        let (version, trace_id, span_id, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let hex =
            |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if version != "00" || !hex(trace_id, 32) || !hex(span_id, 16) || !hex(flags, 2) {
            return None;
        }
        if trace_id.bytes().all(|b| b == b'0') || span_id.bytes().all(|b| b == b'0') {
            return None;
        }
        let sampled = u8::from_str_radix(flags, 16).ok()? & 1 == 1;
        Some(TraceParent { trace_id: trace_id.to_owned(), parent_span_id: span_id.to_owned(), sampled })
    }

    fn of(metadata: &tonic::metadata::MetadataMap) -> Option<TraceParent> {
        metadata.get("traceparent").and_then(|v| v.to_str().ok()).and_then(TraceParent::parse)
    }

    /// The `traceparent` header value.
    pub fn header(&self) -> String {
        format!("00-{}-{}-{:02x}", self.trace_id, self.parent_span_id, u8::from(self.sampled))
    }
}

/// The span a call runs in (see [`TraceParent`]).
fn call_span(rpc: &'static str, trace: Option<&TraceParent>) -> tracing::Span {
    let span = tracing::info_span!(
        target: "lattice_hook_sdk",
        "hook_call",
        rpc,
        otel.kind = "server",
        trace_id = tracing::field::Empty,
        parent_span_id = tracing::field::Empty,
    );
    if let Some(t) = trace {
        span.record("trace_id", t.trace_id.as_str()).record("parent_span_id", t.parent_span_id.as_str());
        #[cfg(feature = "opentelemetry")]
        otel::set_parent(&span, t);
    }
    span
}

#[cfg(feature = "opentelemetry")]
mod otel {
    use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    pub(crate) fn set_parent(span: &tracing::Span, t: &super::TraceParent) {
        let (Ok(trace_id), Ok(span_id)) = (TraceId::from_hex(&t.trace_id), SpanId::from_hex(&t.parent_span_id)) else {
            return;
        };
        let flags = if t.sampled { TraceFlags::SAMPLED } else { TraceFlags::default() };
        let remote = SpanContext::new(trace_id, span_id, flags, true, TraceState::default());
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote));
    }
}

/// How [`init_logs`] writes log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line (fields as plain values; each line inside
    /// a call carries its `hook_call` span, with the query's `trace_id`).
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("{other:?} is not a log format: text or json")),
        }
    }
}

/// Logs to stderr in `format`, levels from `RUST_LOG` (default `info`),
/// as `--log-format text|json` in the examples. Does nothing if a global
/// subscriber is already set.
///
/// The rules of Lattice's own logs hold: the transport crates (h2, hyper,
/// tonic's transport, rustls, …), which log bytes a peer sent at debug and
/// trace, log nothing whatever `RUST_LOG` says unless
/// `LATTICE_LOG_TRANSPORT=1`; in text, control characters in messages and
/// values are escaped, so that a value from a request (a tool call's id)
/// can neither start a line of its own nor act on a terminal; and text is
/// coloured only on a terminal.
#[cfg(feature = "logs")]
pub fn init_logs(format: LogFormat) {
    use lattice_proto::logs::{Format, OPTED_IN_WARNING, subscriber, transport_opted_in};
    use tracing_subscriber::{EnvFilter, util::SubscriberInitExt};
    let levels = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let opted_in = transport_opted_in();
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let format = match format {
        LogFormat::Text => Format::Text,
        LogFormat::Json => Format::Json,
    };
    let _ = subscriber(format, levels, opted_in, ansi, std::io::stderr).try_init();
    if opted_in {
        tracing::warn!("{OPTED_IN_WARNING}");
    }
}

/// A message of `role` with one text block.
pub fn text_message(role: Role, text: impl Into<String>) -> Message {
    Message {
        role: role as i32,
        content: vec![ContentBlock { block: Some(content_block::Block::Text(TextBlock { text: text.into() })) }],
    }
}

/// A `google.protobuf.Struct` as JSON.
fn json_object(s: prost_types::Struct) -> JsonMap<String, JsonValue> {
    s.fields.into_iter().map(|(k, v)| (k, json_value(v))).collect()
}

fn json_value(v: prost_types::Value) -> JsonValue {
    use prost_types::value::Kind;
    match v.kind {
        None | Some(Kind::NullValue(_)) => JsonValue::Null,
        Some(Kind::BoolValue(b)) => JsonValue::Bool(b),
        Some(Kind::NumberValue(n)) => serde_json::Number::from_f64(n).map_or(JsonValue::Null, JsonValue::Number),
        Some(Kind::StringValue(s)) => JsonValue::String(s),
        Some(Kind::ListValue(l)) => JsonValue::Array(l.values.into_iter().map(json_value).collect()),
        Some(Kind::StructValue(s)) => JsonValue::Object(json_object(s)),
    }
}
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
                call.result = r;
                replaced = true;
            }
        }
        Ok(replaced.then_some(call.result))
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
        self.into_service_with_limit(max_message_bytes())
    }

    /// [`HookServer::into_service`] with a message limit of `limit` bytes.
    pub fn into_service_with_limit(self, limit: usize) -> HookServiceServer<Self> {
        HookServiceServer::new(self).max_decoding_message_size(limit).max_encoding_message_size(limit)
    }
}

#[async_trait]
impl<H: Hook> HookService for HookServer<H> {
    async fn on_tool_result(
        &self,
        request: tonic::Request<pb::OnToolResultRequest>,
    ) -> Result<tonic::Response<pb::OnToolResultResponse>, Status> {
        let trace = TraceParent::of(request.metadata());
        let span = call_span("OnToolResult", trace.as_ref());
        let call = ToolResultCall { trace, ..request.into_inner().into() };
        let result = caught("OnToolResult", self.hook.on_tool_result(call)).instrument(span).await?;
        Ok(tonic::Response::new(pb::OnToolResultResponse { result }))
    }

    async fn on_model_request(
        &self,
        request: tonic::Request<pb::OnModelRequestRequest>,
    ) -> Result<tonic::Response<pb::OnModelRequestResponse>, Status> {
        let trace = TraceParent::of(request.metadata());
        let span = call_span("OnModelRequest", trace.as_ref());
        let call = ModelRequestCall { trace, ..request.into_inner().into() };
        let change = caught("OnModelRequest", self.hook.on_model_request(call)).instrument(span).await?;
        Ok(tonic::Response::new(pb::OnModelRequestResponse {
            system: change.system,
            messages: change.messages.map(|messages| pb::MessageList { messages }),
        }))
    }
}

/// Runs a hook's handler. A panic in it answers INTERNAL, "the hook
/// panicked", which Lattice reports as the hook's own status; uncaught,
/// the call's stream would be reset, which Lattice can only report as a
/// call that failed below gRPC. The panic's message goes to stderr as
/// usual (the panic hook), never into the status.
async fn caught<T>(method: &str, handler: impl Future<Output = Result<T, Status>>) -> Result<T, Status> {
    use futures_util::FutureExt as _;
    match std::panic::AssertUnwindSafe(handler).catch_unwind().await {
        Ok(answer) => answer,
        Err(_) => {
            tracing::error!(method, "the hook panicked; answered INTERNAL");
            Err(Status::internal("the hook panicked"))
        }
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

/// The variable that sets the drain period of [`serve`] and [`Server`],
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
/// (`grpc.health.v1`) and reflection (v1 and v1alpha) included, draining
/// on SIGTERM: `Server::new(hook).serve(addr)` (see [`Server`]).
pub async fn serve(hook: impl Hook, addr: SocketAddr) -> Result<(), ServeError> {
    Server::new(hook).serve(addr).await
}

/// Serves a hook: plain or TLS, with health and reflection, and a drain.
///
/// On shutdown (SIGTERM or Ctrl-C for [`Server::serve`]) it drains, so that
/// a rolling update loses no call: health turns NOT_SERVING at once, calls
/// keep being served (in flight, and new ones on open or new connections)
/// for the drain period, then the server sends GOAWAY, finishes the calls
/// in flight and returns.
///
/// ```no_run
/// # use lattice_hook_sdk::{Hook, Server, Tls};
/// # struct Redact;
/// # #[lattice_hook_sdk::async_trait] impl Hook for Redact {}
/// # async fn run(cert: String, key: String, ca: String) -> Result<(), lattice_hook_sdk::ServeError> {
/// Server::new(Redact)
///     .tls(Tls::new(cert, key).require_client_ca(ca))
///     .drain(std::time::Duration::from_secs(10))
///     .serve("0.0.0.0:50071".parse().unwrap())
///     .await
/// # }
/// ```
#[derive(Debug)]
pub struct Server<H> {
    hook: H,
    tls: Option<Tls>,
    drain: Duration,
    max_message_bytes: usize,
}

impl<H: Hook> Server<H> {
    /// Serves `hook` over plaintext, with the drain period of
    /// [`DRAIN_ENV`] (default [`DEFAULT_DRAIN`]) and the message limit of
    /// [`MAX_MESSAGE_BYTES_ENV`] (default [`DEFAULT_MAX_MESSAGE_BYTES`]).
    pub fn new(hook: H) -> Self {
        Server { hook, tls: None, drain: drain_from_env(), max_message_bytes: max_message_bytes() }
    }

    /// Serves TLS (see [`Tls`]).
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Keeps serving this long after shutdown is asked for.
    pub fn drain(mut self, drain: Duration) -> Self {
        self.drain = drain;
        self
    }

    /// Accepts requests and replies up to `bytes` (keep it equal to
    /// Lattice's `server.hook_max_message_bytes`).
    pub fn max_message_bytes(mut self, bytes: usize) -> Self {
        self.max_message_bytes = bytes;
        self
    }

    /// Binds `addr` and serves until SIGTERM or Ctrl-C, then drains.
    pub async fn serve(self, addr: SocketAddr) -> Result<(), ServeError> {
        let signal = shutdown_signal();
        let listener = TcpListener::bind(addr).await.map_err(ServeError::Bind)?;
        self.serve_on(listener, signal).await
    }

    /// Serves on a bound listener until `shutdown` resolves, then drains
    /// and returns once the calls in flight have finished (for tests and
    /// embedding).
    pub async fn serve_on(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ServeError> {
        let Server { hook, tls, drain, max_message_bytes } = self;
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
        tracing::info!(addr = ?listener.local_addr().ok(), tls = tls.is_some(), max_message_bytes, "hook serving");
        let drained = async move {
            shutdown.await;
            // Said first, so that Kubernetes and Lattice stop sending calls
            // here; the ones that still come are served until the drain ends.
            health.set_not_serving::<HookServiceServer<HookServer<Chain>>>().await;
            health.set_service_status("", tonic_health::ServingStatus::NotServing).await;
            tracing::info!(drain_ms = drain.as_millis() as u64, "draining: NOT_SERVING, still serving calls");
            tokio::time::sleep(drain).await;
            tracing::info!("drained: GOAWAY, finishing the calls in flight");
        };
        let router = server
            .add_service(health_svc)
            .add_service(v1)
            .add_service(v1alpha)
            .add_service(HookServer::new(hook).into_service_with_limit(max_message_bytes));
        let served = match tls {
            // tonic wraps each connection in TLS itself: its bytes are records.
            Some(_) => router.serve_with_incoming_shutdown(incoming(listener), drained).await,
            // A reply in one write (see `replies`).
            None => {
                use tokio_stream::StreamExt as _;
                let incoming = incoming(listener).map(|accepted| accepted.map(replies::Replies::new));
                router.serve_with_incoming_shutdown(incoming, drained).await
            }
        };
        served.map_err(ServeError::Transport)
    }
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
            Ok(Some(call.replace_text(format!("{}{}", call.text(), self.0))))
        }
        async fn on_model_request(&self, call: ModelRequestCall) -> Result<ModelRequestChange, Status> {
            Ok(ModelRequestChange::system(format!("{}{}", call.system, self.0)))
        }
    }

    struct Keep;
    #[async_trait]
    impl Hook for Keep {}

    #[test]
    fn traceparent_is_parsed_strictly() {
        let t = TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(
            (t.trace_id.as_str(), t.parent_span_id.as_str(), t.sampled),
            ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", true)
        );
        assert_eq!(t.header(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad}");
        }
        assert!(!TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").unwrap().sampled);
    }

    fn call(text: &str) -> ToolResultCall {
        ToolResultCall {
            tool_use_id: "t1".into(),
            result: ToolResultBlock {
                tool_use_id: "t1".into(),
                content: vec![TextBlock { text: text.into() }],
                is_error: false,
            },
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

    /// The wire request becomes the SDK's call: the input as JSON, the
    /// result present even when the request left it out.
    #[test]
    fn a_wire_request_becomes_a_call_with_json_input() {
        use prost_types::{Struct, Value, value::Kind};
        let field = |k: Kind| Value { kind: Some(k) };
        let mut nested = Struct::default();
        nested.fields.insert("deep".into(), field(Kind::BoolValue(true)));
        let mut input = Struct::default();
        input.fields.insert("city".into(), field(Kind::StringValue("Paris".into())));
        input.fields.insert("n".into(), field(Kind::NumberValue(2.5)));
        input.fields.insert("nested".into(), field(Kind::StructValue(nested)));
        let wire = pb::OnToolResultRequest { tool_use_id: "t1".into(), input: Some(input), ..Default::default() };
        let call = ToolResultCall::from(wire);
        assert_eq!(
            JsonValue::Object(call.input),
            serde_json::json!({"city": "Paris", "n": 2.5, "nested": {"deep": true}})
        );
        assert_eq!(call.result, ToolResultBlock::default());
        let m = text_message(Role::Assistant, "hi");
        assert_eq!(m.role(), Role::Assistant);
    }
}
