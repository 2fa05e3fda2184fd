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
    gather_writes: bool,
}

impl<H: Hook> Server<H> {
    /// Serves `hook` over plaintext, with the drain period of
    /// [`DRAIN_ENV`] (default [`DEFAULT_DRAIN`]) and the message limit of
    /// [`MAX_MESSAGE_BYTES_ENV`] (default [`DEFAULT_MAX_MESSAGE_BYTES`]).
    pub fn new(hook: H) -> Self {
        Server { hook, tls: None, drain: drain_from_env(), max_message_bytes: max_message_bytes(), gather_writes: true }
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

    /// Whether a plaintext reply leaves in one write (on by default). h2
    /// writes a reply whose message is 256 bytes or more in two writes;
    /// gathered, the reply costs Lattice one wake-up instead of two. This
    /// relies on how h2 writes; turn it off if an h2 release ever serves
    /// replies wrongly through it.
    pub fn gather_writes(mut self, on: bool) -> Self {
        self.gather_writes = on;
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
        let Server { hook, tls, drain, max_message_bytes, gather_writes } = self;
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
        let served = match (tls, gather_writes) {
            // A reply in one write (see `lattice_net`). Not under TLS:
            // tonic wraps each connection in TLS itself, and its bytes are
            // records.
            (None, true) => {
                use tokio_stream::StreamExt as _;
                let incoming = incoming(listener).map(|accepted| accepted.map(lattice_net::Replies::new));
                router.serve_with_incoming_shutdown(incoming, drained).await
            }
            _ => router.serve_with_incoming_shutdown(incoming(listener), drained).await,
        };
        served.map_err(ServeError::Transport)
    }
}

pub(crate) use lattice_net::incoming;
/// Resolves on SIGTERM or Ctrl-C (see `lattice_net::shutdown_signal`).
pub use lattice_net::shutdown_signal;

#[cfg(test)]
mod tests {
    use std::{
        io,
        pin::Pin,
        sync::Arc,
        task::{Context, Poll, ready},
    };

    use lattice_net::Replies;
    use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

    /// Counts the writes that reach a socket.
    struct Counted {
        io: tokio::net::TcpStream,
        writes: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl AsyncRead for Counted {
        fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.io).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for Counted {
        fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
            let written = ready!(Pin::new(&mut self.io).poll_write(cx, buf));
            self.writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Poll::Ready(written)
        }

        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.io).poll_flush(cx)
        }

        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.io).poll_shutdown(cx)
        }
    }

    impl tonic::transport::server::Connected for Counted {
        type ConnectInfo = ();

        fn connect_info(&self) {}
    }

    /// Replies with the tool result it was given.
    struct Echo;

    #[crate::async_trait]
    impl crate::Hook for Echo {
        async fn on_tool_result(
            &self,
            call: crate::ToolResultCall,
        ) -> Result<Option<crate::ToolResultBlock>, tonic::Status> {
            let text = call.text();
            Ok(Some(call.replace_text(text)))
        }
    }

    /// Served by tonic over [`Replies`], replies of every size arrive whole,
    /// and a unary reply with a 1 KiB message is one write (h2 alone makes
    /// it two: headers and message, then trailers).
    #[tokio::test]
    async fn served_replies_arrive_whole_in_one_write_each() -> Result<(), Box<dyn std::error::Error>> {
        use lattice_proto::{
            agent::v1::{TextBlock, ToolResultBlock},
            hooks::v1::{OnToolResultRequest, hook_service_client::HookServiceClient},
        };
        use tokio_stream::StreamExt as _;

        const LIMIT: usize = 64 << 20;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let writes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = writes.clone();
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).map(move |accepted| {
            let io = accepted?;
            io.set_nodelay(true)?;
            Ok::<_, io::Error>(Replies::new(Counted { io, writes: counter.clone() }))
        });
        let served = tonic::transport::Server::builder()
            .add_service(crate::HookServer::new(Echo).into_service_with_limit(LIMIT))
            .serve_with_incoming(incoming);
        tokio::spawn(served);
        let mut client = HookServiceClient::connect(format!("http://{addr}"))
            .await?
            .max_decoding_message_size(LIMIT)
            .max_encoding_message_size(LIMIT);
        let request = |size: usize| OnToolResultRequest {
            tool_use_id: "t".into(),
            result: Some(ToolResultBlock {
                tool_use_id: "t".into(),
                content: vec![TextBlock { text: "x".repeat(size) }],
                is_error: false,
            }),
            ..Default::default()
        };
        let mut call = async |size: usize| -> Result<usize, Box<dyn std::error::Error>> {
            let reply = tokio::time::timeout(std::time::Duration::from_secs(10), client.on_tool_result(request(size)))
                .await??
                .into_inner();
            Ok(reply.result.map_or(0, |r| r.content.iter().map(|b| b.text.len()).sum()))
        };
        for size in [0, 10, 255, 256, 300, 1024, 16 * 1024, 20 * 1024, 1 << 20, 5 << 20] {
            assert_eq!(call(size).await?, size, "the reply to {size} bytes");
        }
        let calls = 20;
        let before = writes.load(std::sync::atomic::Ordering::Relaxed);
        for _ in 0..calls {
            assert_eq!(call(1024).await?, 1024);
        }
        let written = writes.load(std::sync::atomic::Ordering::Relaxed) - before;
        // A window update may take a write of its own.
        assert!((calls..=calls + 2).contains(&written), "{written} writes for {calls} replies");
        Ok(())
    }
}
