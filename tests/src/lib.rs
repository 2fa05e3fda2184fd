//! Test harness for Lattice's black-box tests: a Lattice server on
//! `127.0.0.1:0` (the same `run` the binary calls), scripted hook and tool
//! services as real tonic servers on loopback, log capture, and helpers to
//! run a query and look for a canary secret in every sink.

pub mod bad_hook;
pub mod bench;
pub mod containers;
pub mod fake_api;
pub mod hook;
pub mod otlp;
pub mod postgres;
pub mod raw_peer;
pub mod reset_proxy;
pub mod tls;
pub mod tool;

use std::{
    io::Write,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, OnceLock},
    time::{Duration, Instant},
};

use lattice_proto::agent::v1::{self as pb, agent_service_client::AgentServiceClient, query_event::Event};
use tokio::{net::TcpListener, sync::oneshot, task::JoinHandle};
use tokio_stream::StreamExt;
use tonic::{Status, transport::Channel};

// ------------------------------------------------------------------ logs ----

#[derive(Clone, Default)]
struct LogBuffer(Arc<Mutex<Vec<u8>>>);

impl Write for LogBuffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

static LOGS: OnceLock<LogBuffer> = OnceLock::new();

/// Captures every log line of this test process at TRACE level (payloads
/// included), so a test can prove a value never reached a log.
pub fn capture_logs() {
    LOGS.get_or_init(|| {
        let buf = LogBuffer::default();
        let writer = buf.clone();
        let _ = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .try_init();
        buf
    });
}

/// Everything logged so far.
pub fn logs() -> String {
    LOGS.get().map(|b| String::from_utf8_lossy(&b.0.lock().unwrap()).into_owned()).unwrap_or_default()
}

// --------------------------------------------------------------- lattice ----

/// A running Lattice server.
pub struct Lattice {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// Its JSONL trace directory.
    pub trace_dir: PathBuf,
    shutdown: Option<oneshot::Sender<()>>,
    handle: Option<JoinHandle<Result<(), String>>>,
    /// When run as a process: the process and its log file.
    process: Option<(Child, PathBuf)>,
    /// Its admin port (`/metrics`), when started here.
    admin: Option<SocketAddr>,
    /// TLS to the API port (`[server.tls]`): the CA, name and client
    /// certificate this client uses.
    client_tls: Option<tonic::transport::ClientTlsConfig>,
    /// The directory made for it (traces; a process's config and log),
    /// removed when it is dropped unless the test is failing.
    scratch: PathBuf,
}

/// `config` with `server.trace_dir` set (in its `[server]` table if it has
/// one: one line more there, which line numbers in errors count) and open
/// auth unless it says otherwise (appended at the end).
fn with_test_keys(config: &str, trace_dir: &Path) -> String {
    let line = format!("trace_dir = {:?}", trace_dir.display().to_string());
    let config = if config.contains("[server]") {
        config.replacen("[server]", &format!("[server]\n{line}"), 1)
    } else {
        format!("{config}\n[server]\n{line}\n")
    };
    with_open_auth(&config)
}

/// `config` with `[server.auth] mode = "none"` unless it says how clients
/// authenticate (a config must: tests that are not about auth run open).
pub fn with_open_auth(config: &str) -> String {
    if config.contains("[server.auth]") {
        config.to_owned()
    } else {
        format!("{config}\n[server.auth]\nmode = \"none\"\n")
    }
}

/// A loopback address nothing listens on yet (bound, then released).
async fn free_addr() -> SocketAddr {
    let (l, addr) = bind().await;
    drop(l);
    addr
}

/// Where [`temp_dir`] makes its directories: `$TMPDIR/lattice-tests`.
/// `tests/run.sh` empties it before the tests and removes it after they
/// pass; after a failure it is kept for whoever looks into it.
pub fn temp_root() -> PathBuf {
    std::env::temp_dir().join("lattice-tests")
}

/// A fresh empty directory under [`temp_root`].
pub fn temp_dir(tag: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = temp_root().join(format!("{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

impl Lattice {
    /// Starts Lattice with `config` (TOML). A `[server]` table with a
    /// `trace_dir` is added unless the config has one.
    pub async fn start(config: &str) -> Lattice {
        Self::try_start(config).await.unwrap_or_else(|e| panic!("lattice did not start: {e}"))
    }

    /// Like [`Lattice::start`], returning the config or start-up error.
    pub async fn try_start(config: &str) -> Result<Lattice, String> {
        Self::try_start_with_env(config, &[]).await
    }

    /// [`Lattice::start`] with secrets (`api_key_env`, `url_env`) looked up
    /// in `env` rather than the process environment.
    pub async fn start_with_env(config: &str, env: &[(&str, &str)]) -> Lattice {
        Self::try_start_with_env(config, env).await.unwrap_or_else(|e| panic!("lattice did not start: {e}"))
    }

    /// [`Lattice::try_start`] with secrets looked up in `env`.
    pub async fn try_start_with_env(config: &str, env: &[(&str, &str)]) -> Result<Lattice, String> {
        Self::launch(config, env, true, true).await
    }

    /// [`Lattice::start_with_env`] without a trace (`server.trace_dir`
    /// unset, as by default): for benchmarks of what a query costs where
    /// nothing records it.
    pub async fn start_untraced(config: &str, env: &[(&str, &str)]) -> Lattice {
        Self::launch(config, env, true, false).await.unwrap_or_else(|e| panic!("lattice did not start: {e}"))
    }

    /// Starts Lattice and returns as soon as its health service answers,
    /// SERVING or not (for a server that starts NOT_SERVING).
    pub async fn start_unready(config: &str) -> Lattice {
        Self::launch(config, &[], false, true).await.unwrap_or_else(|e| panic!("lattice did not start: {e}"))
    }

    /// Starts Lattice; an admin port another test took between our probe
    /// and the bind (see [`free_addr`]) is retried with another.
    async fn launch(config: &str, env: &[(&str, &str)], serving: bool, traced: bool) -> Result<Lattice, String> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            match Self::launch_once(config, env, serving, traced).await {
                Err(e) if attempt < 5 && e.contains("Address already in use") => continue,
                other => return other,
            }
        }
    }

    async fn launch_once(config: &str, env: &[(&str, &str)], serving: bool, traced: bool) -> Result<Lattice, String> {
        capture_logs();
        let trace_dir = temp_dir("trace");
        let admin = free_addr().await;
        let config = if traced { with_test_keys(config, &trace_dir) } else { with_open_auth(config) };
        let lookup = |var: &str| {
            env.iter().find(|(k, _)| *k == var).map(|(_, v)| (*v).to_owned()).or_else(|| std::env::var(var).ok())
        };
        let mut cfg =
            lattice_server::config::parse_with_env(&config, Path::new("test.toml"), &lookup, &lattice_server::CHECKS)
                .map_err(|e| e.to_string())?;
        cfg.server.admin_listen = Some(admin);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        let handle = tokio::spawn(async move {
            lattice_server::run(cfg, listener, async {
                let _ = rx.await;
            })
            .await
            .map_err(|e| e.to_string())
        });
        let mut lattice = Lattice {
            url: format!("http://{addr}"),
            scratch: trace_dir.clone(),
            trace_dir,
            shutdown: Some(tx),
            handle: Some(handle),
            process: None,
            admin: Some(admin),
            client_tls: None,
        };
        // Ready when health answers (set-up, e.g. tool discovery, is done);
        // a set-up error ends `run` early.
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if lattice.handle.as_ref().is_some_and(JoinHandle::is_finished) {
                let h = lattice.handle.take().unwrap();
                return Err(h.await.map_err(|e| e.to_string())?.err().unwrap_or_else(|| "stopped".into()));
            }
            if lattice.healthy().await || (!serving && lattice.health_answers().await) {
                return Ok(lattice);
            }
            if Instant::now() > deadline {
                return Err("lattice did not become healthy within 15 s".into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Runs the `lattice` binary with `config` and extra environment
    /// variables; its logs (RUST_LOG=trace) go to a file, see
    /// [`Lattice::process_logs`].
    pub async fn spawn(config: &str, env: &[(&str, &str)]) -> Lattice {
        Self::spawn_with(config, env, None, false, true).await
    }

    /// [`Lattice::spawn`], returning once health answers, SERVING or not
    /// (a replica waiting for its database).
    pub async fn spawn_answering(config: &str, env: &[(&str, &str)]) -> Lattice {
        Self::spawn_with(config, env, None, false, false).await
    }

    /// Spawns `lattice serve` as `deploy/` runs it, for benchmarks: its
    /// default logging, thrown away, and no trace (open auth added); the
    /// `lattice` built beside the running program, if there is one.
    pub async fn spawn_untraced(config: &str, env: &[(&str, &str)]) -> Lattice {
        Self::spawn_with(config, env, None, true, true).await
    }

    /// [`Lattice::spawn`] for a config with `[server.tls]`: its clients
    /// (health checks included) connect with `tls`.
    pub async fn spawn_tls(config: &str, env: &[(&str, &str)], tls: tonic::transport::ClientTlsConfig) -> Lattice {
        Self::spawn_with(config, env, Some(tls), false, true).await
    }

    /// Spawns `lattice serve` (`quiet`: see [`Lattice::spawn_untraced`]),
    /// returning once health says SERVING (`serving`) or answers at all;
    /// a port another test took between our probe and the bind (see
    /// [`free_addr`]) is retried with others.
    async fn spawn_with(
        config: &str,
        env: &[(&str, &str)],
        tls: Option<tonic::transport::ClientTlsConfig>,
        quiet: bool,
        serving: bool,
    ) -> Lattice {
        let mut attempt = 0;
        loop {
            attempt += 1;
            match Self::spawn_once(config, env, tls.clone(), quiet, serving).await {
                Ok(lattice) => return lattice,
                Err(log) if attempt < 5 && log.contains("already in use") => continue,
                Err(log) => panic!("lattice did not start:\n{log}"),
            }
        }
    }

    async fn spawn_once(
        config: &str,
        env: &[(&str, &str)],
        tls: Option<tonic::transport::ClientTlsConfig>,
        quiet: bool,
        serving: bool,
    ) -> Result<Lattice, String> {
        let dir = temp_dir("proc");
        let trace_dir = dir.join("traces");
        let config_path = dir.join("lattice.toml");
        let admin = free_addr().await;
        let written = if quiet { with_open_auth(config) } else { with_test_keys(config, &trace_dir) };
        std::fs::write(&config_path, written).unwrap();
        let (l, addr) = bind().await;
        drop(l);
        let log_path = dir.join("lattice.log");
        // A benchmark runs the `lattice` built beside it (a release build).
        let beside = std::env::current_exe().ok().map(|exe| exe.with_file_name("lattice")).filter(|p| p.exists());
        let bin = beside.filter(|_| quiet).unwrap_or_else(|| workspace_binary("lattice"));
        let mut command = tokio::process::Command::new(bin);
        command
            .args(["--log-format", "json", "serve", "--config"])
            .arg(&config_path)
            .args(["--listen", &addr.to_string(), "--admin-listen", &admin.to_string()])
            .kill_on_drop(true);
        if quiet {
            command.stderr(std::process::Stdio::null());
        } else {
            // Everything, unless the caller's `env` says otherwise.
            command.env("RUST_LOG", "trace").stderr(std::fs::File::create(&log_path).unwrap());
        }
        command.envs(env.iter().copied());
        let child = command.spawn().expect("the lattice binary");
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut lattice = Lattice {
            url: format!("{scheme}://{addr}"),
            trace_dir,
            shutdown: None,
            handle: None,
            process: Some((Child(child), log_path.clone())),
            admin: Some(admin),
            client_tls: tls,
            scratch: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(15);
        while !(if serving { lattice.healthy().await } else { lattice.health_answers().await }) {
            let exited = lattice.process.as_mut().is_some_and(|(c, _)| c.0.try_wait().ok().flatten().is_some());
            if exited || Instant::now() >= deadline {
                return Err(std::fs::read_to_string(&log_path).unwrap_or_default());
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        Ok(lattice)
    }

    /// Replaces a process's config file with `config` (as [`Lattice::spawn`]
    /// wrote it: the test's trace directory and open auth added): `lattice
    /// serve` reloads a changed file.
    pub fn rewrite_config(&self, config: &str) {
        let path = self.scratch.join("lattice.toml");
        // Written aside and renamed over: never read half-written.
        let aside = self.scratch.join("lattice.toml.new");
        std::fs::write(&aside, with_test_keys(config, &self.trace_dir)).unwrap();
        std::fs::rename(&aside, &path).unwrap();
    }

    /// Sends the process a signal (`kill -s NAME`).
    pub fn signal(&self, name: &str) {
        let (child, _) = self.process.as_ref().expect("a process");
        let pid = child.0.id().expect("a running process");
        let ok = std::process::Command::new("kill").args(["-s", name, &pid.to_string()]).status().unwrap().success();
        assert!(ok, "kill -s {name} {pid}");
    }

    /// A client of a Lattice at `url`, without waiting for anything.
    pub fn remote_unchecked(url: &str) -> Lattice {
        let trace_dir = temp_dir("remote");
        Lattice {
            url: url.to_owned(),
            scratch: trace_dir.clone(),
            trace_dir,
            shutdown: None,
            handle: None,
            process: None,
            admin: None,
            client_tls: None,
        }
    }

    /// A client of this Lattice that connects with other TLS settings
    /// (another client certificate, or none).
    pub fn with_client_tls(&self, tls: Option<tonic::transport::ClientTlsConfig>) -> Lattice {
        let mut other = Lattice::remote_unchecked(&self.url);
        other.client_tls = tls;
        other
    }

    /// A channel to the API port (with this client's TLS settings).
    pub async fn channel(&self) -> Result<Channel, tonic::transport::Error> {
        let mut endpoint = tonic::transport::Endpoint::from_shared(self.url.clone()).expect("a URL");
        if let Some(tls) = &self.client_tls {
            endpoint = endpoint.tls_config(tls.clone())?;
        }
        endpoint.connect().await
    }

    /// A client of a Lattice running elsewhere (a container), once healthy.
    pub async fn remote(url: &str) -> Arc<Lattice> {
        let lattice = Lattice::remote_unchecked(url);
        let deadline = Instant::now() + Duration::from_secs(15);
        while !lattice.healthy().await {
            assert!(Instant::now() < deadline, "lattice at {url} is not healthy");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Arc::new(lattice)
    }

    /// The logs of a spawned process (empty for in-process servers, whose
    /// logs are [`logs`]).
    pub fn process_logs(&self) -> String {
        self.process.as_ref().map(|(_, p)| std::fs::read_to_string(p).unwrap_or_default()).unwrap_or_default()
    }

    /// The process id of a spawned process.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().and_then(|(child, _)| child.0.id())
    }

    /// Waits for a spawned process to exit (after a signal), for `within`
    /// at most: whether it did.
    pub async fn exited(&mut self, within: Duration) -> bool {
        let Some((child, _)) = &mut self.process else { return false };
        tokio::time::timeout(within, child.0.wait()).await.is_ok()
    }

    /// Kills a spawned process at once (SIGKILL: no drain, no release).
    pub fn kill(&mut self) {
        if let Some((child, _)) = &mut self.process {
            let _ = child.0.start_kill();
        }
    }

    /// Whether health says the agent service is SERVING now.
    pub async fn serving(&self) -> bool {
        self.healthy().await
    }

    /// Whether health says `service` ("" for the server as a whole) is
    /// SERVING now.
    pub async fn serving_as(&self, service: &str) -> bool {
        self.health_of(service).await == Some(tonic_health::pb::health_check_response::ServingStatus::Serving as i32)
    }

    /// The status health reports for `service`, if it answers at all.
    async fn health_of(&self, service: &str) -> Option<i32> {
        let ch = self.channel().await.ok()?;
        let request = tonic_health::pb::HealthCheckRequest { service: service.into() };
        let reply = tonic_health::pb::health_client::HealthClient::new(ch).check(request).await.ok()?;
        Some(reply.into_inner().status)
    }

    async fn health_answers(&self) -> bool {
        self.health_of("").await.is_some()
    }

    async fn healthy(&self) -> bool {
        self.serving_as("lattice.agent.v1.AgentService").await
    }

    /// A client.
    pub async fn client(&self) -> AgentServiceClient<Channel> {
        let ch = self.channel().await.expect("connecting to lattice");
        AgentServiceClient::new(ch).max_decoding_message_size(64 << 20)
    }

    /// `GET /metrics` over HTTP/1.1 on the gRPC port: the Prometheus text.
    pub async fn metrics(&self) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = self.admin.expect("an admin port (a Lattice started by this helper)").to_string();
        let addr = addr.as_str();
        let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connecting for /metrics");
        let request = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        conn.write_all(request.as_bytes()).await.expect("sending GET /metrics");
        let mut response = String::new();
        conn.read_to_string(&mut response).await.expect("reading /metrics");
        let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(head.to_ascii_lowercase().contains("content-type: application/openmetrics-text"), "{head}");
        body.to_owned()
    }

    /// Runs a query to its end.
    pub async fn query(&self, agent: &str, prompt: &str) -> Outcome {
        self.query_with(QueryOpts { agent: agent.into(), prompt: prompt.into(), ..Default::default() }).await
    }

    /// Runs a query with options to its end.
    pub async fn query_with(&self, opts: QueryOpts) -> Outcome {
        let mut client = self.client().await;
        Self::query_on(&mut client, opts).await
    }

    /// [`Lattice::query_with`] on a client (a connection) of the caller's,
    /// as a real client keeps one: the benchmarks, whose figures would
    /// otherwise include a connection's set-up per query.
    pub async fn query_on(client: &mut AgentServiceClient<Channel>, opts: QueryOpts) -> Outcome {
        let mut req = tonic::Request::new(pb::QueryRequest {
            agent: opts.agent,
            session_id: opts.session,
            prompt: opts.prompt,
            include_model_requests: !opts.no_model_requests,
        });
        if let Some(t) = opts.timeout {
            // Sent as a header only: no timer of the client's own runs over
            // the whole stream, so once the response's headers have come
            // the client sees Lattice's status. (tonic's channel still
            // times the wait for those headers by this header: a query
            // whose first events have not left by its deadline may end at
            // the client's timer first, CANCELLED "Timeout expired".)
            let v = format!("{}m", t.as_millis());
            req.metadata_mut().insert("grpc-timeout", v.parse().unwrap());
        }
        if let Some(token) = &opts.token {
            req.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
        }
        let started = Instant::now();
        let mut out = Outcome { events: vec![], status: None, elapsed: Duration::ZERO, ended: started };
        match client.query(req).await {
            Err(s) => out.status = Some(s),
            Ok(resp) => {
                let mut stream = resp.into_inner();
                while let Some(item) = stream.next().await {
                    match item {
                        Ok(e) => out.events.push(e),
                        Err(s) => {
                            out.status = Some(s);
                            break;
                        }
                    }
                }
            }
        }
        out.ended = Instant::now();
        out.elapsed = out.ended - started;
        out
    }

    /// The stored conversation of a session: every page, joined.
    pub async fn session(&self, id: &str) -> Result<pb::Session, Status> {
        let mut whole = self.session_page(id, 0, "").await?;
        while !whole.next_page_token.is_empty() {
            let page = self.session_page(id, 0, &whole.next_page_token).await?;
            whole.messages.extend(page.messages);
            whole.next_page_token = page.next_page_token;
        }
        Ok(whole)
    }

    /// One page of a session's conversation.
    pub async fn session_page(&self, id: &str, page_size: u32, page_token: &str) -> Result<pb::Session, Status> {
        let request = pb::GetSessionRequest { session_id: id.into(), page_size, page_token: page_token.into() };
        self.client().await.get_session(request).await.map(|r| r.into_inner())
    }

    /// Everything in the trace directory.
    pub fn traces(&self) -> String {
        let mut all = String::new();
        if let Ok(entries) = std::fs::read_dir(&self.trace_dir) {
            for e in entries.flatten() {
                all.push_str(&std::fs::read_to_string(e.path()).unwrap_or_default());
            }
        }
        all
    }

    /// Stops the server.
    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(h) = self.handle.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), h).await;
        }
    }
}

impl Drop for Lattice {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        // A failing test's files are kept for whoever looks into it.
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.scratch);
        }
    }
}

/// Query options.
#[derive(Debug, Clone, Default)]
pub struct QueryOpts {
    /// Agent.
    pub agent: String,
    /// Prompt.
    pub prompt: String,
    /// Session to continue.
    pub session: Option<String>,
    /// grpc-timeout to send.
    pub timeout: Option<Duration>,
    /// Don't ask for model_request events (they repeat the conversation).
    pub no_model_requests: bool,
    /// A bearer token to send (`authorization: Bearer …`).
    pub token: Option<String>,
}

/// A finished query.
#[derive(Debug)]
pub struct Outcome {
    /// Every event received.
    pub events: Vec<pb::QueryEvent>,
    /// The error status (`None` = OK).
    pub status: Option<Status>,
    /// From request to the end of the stream.
    pub elapsed: Duration,
    /// When the stream ended.
    pub ended: Instant,
}

impl Outcome {
    /// The final result of a query that succeeded; panics (with the status)
    /// if it failed.
    pub fn expect_ok(&self) -> &pb::FinalResult {
        if let Some(s) = &self.status {
            panic!("query failed: {:?} {}", s.code(), s.message());
        }
        self.final_result().expect("a final result")
    }

    /// The final result, if any.
    pub fn final_result(&self) -> Option<&pb::FinalResult> {
        self.events.iter().find_map(|e| match &e.event {
            Some(Event::Result(r)) => Some(r),
            _ => None,
        })
    }

    /// The started event, if any.
    fn started(&self) -> Option<&pb::QueryStarted> {
        self.events.iter().find_map(|e| match &e.event {
            Some(Event::Started(s)) => Some(s),
            _ => None,
        })
    }

    /// The query id from the started event.
    pub fn query_id(&self) -> String {
        self.started().map(|s| s.query_id.clone()).unwrap_or_default()
    }

    /// The session id from the started event.
    pub fn session_id(&self) -> String {
        self.started().map(|s| s.session_id.clone()).expect("a started event")
    }

    /// Tool result events, in order.
    pub fn tool_results(&self) -> Vec<&pb::ToolResultEvent> {
        self.events
            .iter()
            .filter_map(|e| match &e.event {
                Some(Event::ToolResult(t)) => Some(t),
                _ => None,
            })
            .collect()
    }

    /// The text of each tool result event, in order.
    pub fn tool_texts(&self) -> Vec<String> {
        self.tool_results().iter().map(|t| result_text(t.result.as_ref().unwrap())).collect()
    }

    /// Model request events, in order.
    pub fn model_requests(&self) -> Vec<&pb::ModelRequestEvent> {
        self.events
            .iter()
            .filter_map(|e| match &e.event {
                Some(Event::ModelRequest(r)) => Some(r),
                _ => None,
            })
            .collect()
    }

    /// Assistant texts, in order.
    pub fn assistant_texts(&self) -> Vec<String> {
        self.events
            .iter()
            .filter_map(|e| match &e.event {
                Some(Event::Assistant(a)) => Some(message_text(a.message.as_ref().unwrap())),
                _ => None,
            })
            .collect()
    }

    /// The error status's code, or OK.
    pub fn code(&self) -> tonic::Code {
        self.status.as_ref().map_or(tonic::Code::Ok, |s| s.code())
    }

    /// Everything the client received, as text (for canary searches).
    pub fn everything(&self) -> String {
        let mut s = format!("{:?}", self.events);
        if let Some(st) = &self.status {
            s.push_str(&format!("{st:?} {}", String::from_utf8_lossy(st.details())));
        }
        s
    }

    /// The HOOK_FAILED ErrorInfo metadata, panicking if the query did not
    /// end with ABORTED + HOOK_FAILED.
    pub fn hook_failure(&self) -> std::collections::HashMap<String, String> {
        use tonic_types::StatusExt;
        let st = self.status.as_ref().expect("the query should have failed");
        assert_eq!(st.code(), tonic::Code::Aborted, "{st:?}");
        let info = st.get_details_error_info().expect("ErrorInfo details");
        assert_eq!(info.reason, "HOOK_FAILED");
        assert_eq!(info.domain, "lattice.dev");
        assert!(self.final_result().is_none(), "a failed query must not also have a final result");
        info.metadata
    }
}

/// The text blocks of a tool result.
pub fn result_text(r: &pb::ToolResultBlock) -> String {
    r.content.iter().map(|t| t.text.as_str()).collect()
}

/// The text blocks of a message.
pub fn message_text(m: &pb::Message) -> String {
    m.content
        .iter()
        .filter_map(|b| match &b.block {
            Some(pb::content_block::Block::Text(t)) => Some(t.text.as_str()),
            _ => None,
        })
        .collect()
}

/// A model request read back from a trace file: its query, its turn, its
/// messages (made whole again) and how many of them its line holds.
#[derive(Debug, Clone, PartialEq)]
pub struct TracedRequest {
    /// The query's id.
    pub query_id: String,
    /// 1-based turn.
    pub turn: u64,
    /// The messages as sent.
    pub messages: Vec<serde_json::Value>,
    /// How many of them the line holds (the rest continue the file's
    /// previous request).
    pub recorded: usize,
}

/// The model requests of one trace file, each made whole again as the
/// README says to: a line with `messages_kept` takes that many messages
/// from the file's previous request, then its `messages_added`. Panics if
/// a line continues more than the file holds.
pub fn traced_requests(path: &Path) -> Vec<TracedRequest> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut requests: Vec<TracedRequest> = Vec::new();
    for line in text.lines() {
        let line: serde_json::Value = serde_json::from_str(line).expect("a trace line is JSON");
        if line["type"] != "model_request" {
            continue;
        }
        let r = &line["request"];
        let (messages, recorded) = match (r["messages"].as_array(), r["messages_kept"].as_u64()) {
            (Some(m), None) => (m.clone(), m.len()),
            (None, Some(kept)) => {
                let before = requests.last().map_or(&[][..], |p| &p.messages[..]);
                let kept =
                    before.get(..kept as usize).unwrap_or_else(|| panic!("{line} continues more than the file holds"));
                let added = r["messages_added"].as_array().expect("messages_added");
                (kept.iter().chain(added).cloned().collect(), added.len())
            }
            _ => panic!("neither whole nor continued: {line}"),
        };
        let query_id = line["query_id"].as_str().unwrap_or_default().to_owned();
        requests.push(TracedRequest { query_id, turn: line["turn"].as_u64().unwrap_or(0), messages, recorded });
    }
    requests
}

/// Asserts that `canary` reached no sink: the client's events and status,
/// the trace files and the captured logs.
pub fn assert_no_leak(canary: &str, lattice: &Lattice, outcome: &Outcome) {
    assert!(!outcome.everything().contains(canary), "canary reached the client: {}", outcome.everything());
    assert!(!lattice.traces().contains(canary), "canary reached the trace");
    assert!(!logs().contains(canary), "canary reached the logs");
}

/// The value of the sample `series` (`name{labels}`, exactly as exposed)
/// in a Prometheus text, if present.
pub fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// What `program args…` prints (trimmed) for `input` on its stdin: the
/// tests' independent check of a digest Lattice computed.
pub fn piped(program: &str, args: &[&str], input: &[u8]) -> String {
    let out = std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            child.stdin.take().expect("a stdin pipe").write_all(input)?;
            child.wait_with_output()
        })
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(out.status.success(), "{program} failed");
    String::from_utf8(out.stdout).expect("text").trim().to_owned()
}

/// SHA-256 of `bytes`, lowercase hex, by coreutils' `sha256sum`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    piped("sha256sum", &[], bytes).split_whitespace().next().unwrap_or_default().to_owned()
}

/// A unique canary secret.
pub fn canary() -> String {
    format!("CANARY-{}-{}", std::process::id(), Instant::now().elapsed().as_nanos() ^ rand_u64())
}

fn rand_u64() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
}

/// Binds 127.0.0.1:0 and returns the listener and its URL.
pub async fn bind() -> (TcpListener, SocketAddr) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = l.local_addr().unwrap();
    (l, a)
}

/// A loopback port held but not listening: connections to it are refused,
/// and no other socket (another test's listener, or an outgoing connection
/// that would otherwise pick it as its source port and connect to itself)
/// can take it until [`Reserved::listen`] serves on it.
pub struct Reserved {
    socket: tokio::net::TcpSocket,
    pub addr: SocketAddr,
}

impl Reserved {
    /// Starts listening on the reserved port.
    pub fn listen(self) -> TcpListener {
        self.socket.listen(1024).unwrap()
    }
}

/// Listens again on `addr`, a port a stopped server left. Clients still
/// reconnecting to it may hold it for a moment (an outgoing connection can
/// take a free port as its source and connect to itself until the HTTP/2
/// handshake fails), so a busy port is tried again for a few seconds.
pub async fn rebind(addr: SocketAddr) -> TcpListener {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match TcpListener::bind(addr).await {
            Ok(listener) => return listener,
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("cannot listen on {addr} again: {e}"),
        }
    }
}

/// Reserves a loopback port (see [`Reserved`]).
pub fn reserve() -> Reserved {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = socket.local_addr().unwrap();
    Reserved { socket, addr }
}

/// A port nothing listens on, held for the rest of the test process so
/// that it stays refused.
pub async fn dead_url() -> String {
    let reserved = reserve();
    let url = format!("http://{}", reserved.addr);
    std::mem::forget(reserved.socket);
    url
}

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_owned()
}

/// A binary of the workspace (built before the tests: see the README).
pub fn workspace_binary(rel: &str) -> PathBuf {
    let path = debug_dir().join(rel);
    assert!(
        path.exists(),
        "{} is missing: build it first with `cargo build --workspace --bins --examples` (the README's test command does)",
        path.display()
    );
    path
}

/// The debug build's output directory (`target/debug`, or under
/// `CARGO_TARGET_DIR`).
fn debug_dir() -> PathBuf {
    let dir =
        std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| workspace_root().join("target"));
    dir.join("debug")
}

/// TOML fragments for test configs. Compose in this order per agent:
/// `agent(..)`, `turn(..)`*, then `tools(..)`/`hook(..)`/`delegate(..)`.
pub mod cfg {
    /// An agent with the scripted model; `keys` are extra agent keys
    /// (`max_turns = 2` …), one per line.
    pub fn agent(name: &str, keys: &str) -> String {
        format!("\n[[agents]]\nname = {name:?}\n{keys}\n[agents.model]\nprovider = \"scripted\"\n")
    }

    /// A scripted turn: text and tool calls (`name` or `name:{json input}`).
    pub fn turn(text: &str, calls: &[&str]) -> String {
        let calls: Vec<String> = calls
            .iter()
            .map(|c| match c.split_once(':') {
                Some((name, input)) => format!("{{ name = {name:?}, input = {input} }}"),
                None => format!("{{ name = {c:?} }}"),
            })
            .collect();
        format!("[[agents.model.script]]\ntext = {text:?}\ntool_calls = [{}]\n", calls.join(", "))
    }

    /// A scripted turn with a delay.
    pub fn slow_turn(text: &str, delay_ms: u64) -> String {
        format!("[[agents.model.script]]\ntext = {text:?}\ndelay_ms = {delay_ms}\n")
    }

    /// A tool service (tools discovered with ListTools).
    pub fn tools(url: &str, deadline_ms: u64) -> String {
        format!("[[agents.tools]]\nendpoint = {url:?}\ndeadline_ms = {deadline_ms}\n")
    }

    /// A tool service with declared tools (no discovery).
    pub fn declared_tools(url: &str, deadline_ms: u64, names: &[&str]) -> String {
        let mut s = format!("[[agents.tools]]\nendpoint = {url:?}\ndeadline_ms = {deadline_ms}\n");
        for n in names {
            s.push_str(&format!("[[agents.tools.declare]]\nname = {n:?}\n"));
        }
        s
    }

    /// A hook.
    pub fn hook(name: &str, url: &str, events: &[&str], deadline_ms: u64) -> String {
        format!(
            "[[agents.hooks]]\nname = {name:?}\nendpoint = {url:?}\nevents = {events:?}\ndeadline_ms = {deadline_ms}\n"
        )
    }

    /// A hook that is not `required`: Lattice stays SERVING while it has no
    /// ready address (for hooks that are broken on purpose).
    pub fn optional_hook(name: &str, url: &str, events: &[&str], deadline_ms: u64) -> String {
        hook(name, url, events, deadline_ms) + "required = false\n"
    }

    /// A disabled hook.
    pub fn disabled_hook(name: &str, url: &str, events: &[&str]) -> String {
        format!("[[agents.hooks]]\nname = {name:?}\nendpoint = {url:?}\nevents = {events:?}\nenabled = false\n")
    }

    /// A delegated agent as a tool.
    pub fn delegate(agent: &str) -> String {
        format!("[[agents.delegates]]\nagent = {agent:?}\ndescription = \"delegate\"\n")
    }
}

/// A child process killed when dropped.
pub struct Child(pub tokio::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.start_kill();
    }
}

/// Waits until something accepts TCP connections on `addr`.
pub async fn wait_for_port(addr: SocketAddr, what: &str) {
    wait_for_listener(addr, what, || false).await;
}

/// Waits until something listens on `addr` (true), or until `gone` says
/// the process that was to listen has exited (false).
async fn wait_for_listener(addr: SocketAddr, what: &str, mut gone: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if listening(addr).await {
            return true;
        }
        if gone() {
            return false;
        }
        assert!(Instant::now() < deadline, "{what} did not start listening on {addr}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Whether something listens on `addr`. A connection to a port nobody
/// listens on can take that very port as its source and connect to itself
/// (TCP's simultaneous open); that is not a listener.
async fn listening(addr: SocketAddr) -> bool {
    tokio::net::TcpStream::connect(addr).await.is_ok_and(|stream| reached_a_listener(&stream))
}

/// Whether a connection reached another socket, not itself.
pub fn reached_a_listener(stream: &tokio::net::TcpStream) -> bool {
    stream.local_addr().ok() != stream.peer_addr().ok()
}

/// Starts a hook example binary (`redact`, `truncate`, `audit`) on a free
/// port with extra arguments; returns its URL and the process.
pub async fn start_example(name: &str, args: &[&str]) -> (String, Child) {
    start_example_env(name, args, &[]).await
}

/// [`start_example`] with extra environment variables.
pub async fn start_example_env(name: &str, args: &[&str], env: &[(&str, &str)]) -> (String, Child) {
    example(name, args, env, std::process::Stdio::null).await
}

/// [`start_example_env`], its log lines (stderr) written to `log`.
pub async fn start_example_logging(name: &str, args: &[&str], env: &[(&str, &str)], log: &Path) -> (String, Child) {
    example(name, args, env, || std::fs::File::create(log).expect("the example's log file").into()).await
}

async fn example(
    name: &str,
    args: &[&str],
    env: &[(&str, &str)],
    stderr: impl Fn() -> std::process::Stdio,
) -> (String, Child) {
    // The port is free when chosen but may be taken before the example binds
    // it; an example that exits at start-up is started again on another.
    for _ in 0..3 {
        let addr = free_addr().await;
        let mut child = tokio::process::Command::new(workspace_binary(&format!("examples/{name}")))
            .arg("--listen")
            .arg(addr.to_string())
            .args(args)
            .envs(env.iter().copied())
            .kill_on_drop(true)
            .stderr(stderr())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run the {name} example: {e}"));
        if wait_for_listener(addr, name, || child.try_wait().ok().flatten().is_some()).await {
            return (format!("http://{addr}"), Child(child));
        }
    }
    panic!("the {name} example exited at start-up three times")
}

/// Serves the shipped example tool service (customer lookup) in-process.
pub async fn start_example_tools() -> (String, oneshot::Sender<()>) {
    let (l, addr) = bind().await;
    let (tx, rx) = oneshot::channel::<()>();
    let stop = async {
        let _ = rx.await;
    };
    tokio::spawn(lattice_server::example_tools::serve(l, stop, Duration::ZERO));
    (format!("http://{addr}"), tx)
}

/// Starts the Python example hook (on the `lattice_hook` package, which
/// `tests/setup.sh` installs into `.venv`) on a free loopback port; returns
/// its URL and process.
pub async fn start_python_hook() -> (String, Child) {
    start_python_hook_with(&[]).await
}

/// [`start_python_hook`] with extra arguments (`--tls-cert …`); the URL is
/// `https://` when they include `--tls-cert`.
pub async fn start_python_hook_with(args: &[&str]) -> (String, Child) {
    python_hook(args, std::process::Stdio::inherit()).await
}

/// [`start_python_hook_with`], its JSON log lines (stderr) written to `log`.
pub async fn start_python_hook_logging(args: &[&str], log: &Path) -> (String, Child) {
    python_hook(args, std::fs::File::create(log).expect("the hook's log file").into()).await
}

async fn python_hook(args: &[&str], stderr: std::process::Stdio) -> (String, Child) {
    let mut command = tokio::process::Command::new("python3");
    command
        .arg(workspace_root().join("hook-sdk/examples/python/redact_hook.py"))
        .args(["--listen", "127.0.0.1:0", "--log-format", "json"])
        .args(args)
        .stderr(stderr);
    let (port, child) = start_announced(command, "the Python hook").await;
    (hook_url(args, port), child)
}

/// The URL of a hook example started with `args` on `port`: `https://`
/// when they include `--tls-cert`.
fn hook_url(args: &[&str], port: u16) -> String {
    let scheme = if args.contains(&"--tls-cert") { "https" } else { "http" };
    format!("{scheme}://127.0.0.1:{port}")
}

/// Starts `command`, a hook on the Python or Go package (or anything that
/// prints `listening on PORT` as its first line on stdout), and returns
/// the port and the process (killed when dropped). `what` names it in a
/// failure.
pub async fn start_announced(mut command: tokio::process::Command, what: &str) -> (u16, Child) {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let mut child = command
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    let mut lines = BufReader::new(child.stdout.take().expect("a stdout pipe")).lines();
    let first = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
        .await
        .unwrap_or_else(|_| panic!("{what} did not start"))
        .expect("its stdout")
        .unwrap_or_else(|| panic!("{what} exited before it listened"));
    let port = first
        .strip_prefix("listening on ")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("{what}: unexpected first line {first:?}"));
    (port, Child(child))
}

/// Builds the Go example hook (on the latticehook package, with
/// `hook-sdk/go/build.sh`, from the .proto and Debian's Go packages; once
/// per test process, into the debug build's directory, where the next
/// build replaces it) and starts it on a free loopback port with extra
/// arguments; returns its URL (`https://` when they include `--tls-cert`)
/// and process.
pub async fn start_go_hook(args: &[&str]) -> (String, Child) {
    static BUILT: tokio::sync::OnceCell<PathBuf> = tokio::sync::OnceCell::const_new();
    let binary = BUILT
        .get_or_init(|| async {
            let out = debug_dir().join("lattice-test-go-hook");
            // Built under a name of its own, then renamed: another test
            // process may be running the previous build.
            let partial = out.with_extension(std::process::id().to_string());
            let build = tokio::process::Command::new("bash")
                .arg(workspace_root().join("hook-sdk/go/build.sh"))
                .arg(workspace_root().join("hook-sdk/examples/go"))
                .arg(&partial)
                .output()
                .await
                .expect("bash");
            assert!(
                build.status.success(),
                "building the Go example failed (.ci/run installs golang-go, golang-google-grpc-dev, \
                 golang-github-golang-protobuf-1-5-dev, golang-google-protobuf-dev, protobuf-compiler, \
                 protoc-gen-go, protoc-gen-go-grpc):\n{}",
                String::from_utf8_lossy(&build.stderr)
            );
            std::fs::rename(&partial, &out).expect("the Go example hook's binary");
            out
        })
        .await;
    let mut command = tokio::process::Command::new(binary);
    command.args(["--listen", "127.0.0.1:0"]).args(args);
    let (port, child) = start_announced(command, "the Go hook").await;
    (hook_url(args, port), child)
}

/// A tonic server running in the background on a bound listener; it stops
/// (its port closes) on [`Background::stop`] or when dropped.
pub struct Background(Option<oneshot::Sender<()>>);

impl Background {
    /// Serves `routes` on `listener` (with TCP_NODELAY) until stopped.
    pub fn serve(listener: TcpListener, routes: tonic::service::Routes) -> Background {
        Self::serve_with(listener, routes, None)
    }

    /// [`Background::serve`], over TLS when `tls` is set.
    pub fn serve_with(
        listener: TcpListener,
        routes: tonic::service::Routes,
        tls: Option<tonic::transport::ServerTlsConfig>,
    ) -> Background {
        let (tx, rx) = oneshot::channel::<()>();
        let mut server = tonic::transport::Server::builder();
        if let Some(tls) = tls {
            server = server.tls_config(tls).expect("a valid server TLS config");
        }
        tokio::spawn(async move {
            let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
            let _ = server
                .add_routes(routes)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = rx.await;
                })
                .await;
        });
        Background(Some(tx))
    }

    /// Serves `service` on `listener` over HTTP/2 with hyper alone (no
    /// tonic server, which would enforce deadlines and write statuses its
    /// own way), until stopped.
    pub fn serve_h2<S, B>(listener: TcpListener, service: S) -> Background
    where
        S: hyper::service::Service<
                tonic::codegen::http::Request<hyper::body::Incoming>,
                Response = tonic::codegen::http::Response<B>,
            > + Clone
            + Send
            + 'static,
        S::Future: Send + 'static,
        S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
        B: http_body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let (stop, mut stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            loop {
                let stream = tokio::select! {
                    _ = &mut stopped => return,
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => stream,
                        Err(_) => continue,
                    },
                };
                let service = service.clone();
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Background(Some(stop))
    }

    /// Stops the server.
    pub fn stop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.stop();
    }
}
