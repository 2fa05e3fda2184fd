//! Serving hooks: health, reflection, TLS, message limits, panics answered
//! as INTERNAL, and the drain on SIGTERM.

use super::*;

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
pub(crate) async fn caught<T>(method: &str, handler: impl Future<Output = Result<T, Status>>) -> Result<T, Status> {
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
pub(crate) fn drain_from_env() -> Duration {
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
pub(crate) fn incoming(listener: TcpListener) -> tonic::transport::server::TcpIncoming {
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
