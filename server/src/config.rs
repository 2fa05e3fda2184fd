//! The config file: TOML → raw serde structs → a validated, typed config.
//!
//! Only a TOML syntax error stops the reading (the parser reports it with
//! its line). After that every problem is collected and reported, each with
//! file, line and field path (`agents[0].hooks[1].endpoint`), so that one run
//! of `lattice check-config` shows all there is to fix: unknown keys (with a
//! "did you mean" for near misses, see `document`), values of the wrong
//! type (one per agent: an agent that does not deserialize is not validated
//! further), and every rule the validator checks.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    fmt,
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::Deserialize;
use serde_json::Value;
use toml::{
    Spanned,
    de::{DeTable, DeValue, ValueDeserializer},
};

mod document;
mod settings;
#[cfg(test)]
mod tests;
use document::{Shape, Walk, fields_of, remove_key};
pub use settings::{BUSY_POLL_MAX_US, LimitSettings, TelemetrySettings, Tls, TlsFiles, TlsSettings};

use crate::domain::{JsonObject, StopReason, ToolSpec};

/// Defaults, named so that docs and code agree.
pub mod defaults {
    /// Model requests per query.
    pub const MAX_TURNS: u32 = 10;
    /// Tool calls of one reply run at once.
    pub const PARALLEL_TOOL_CALLS: usize = 1;
    /// Tool calls one reply may ask for.
    pub const MAX_TOOL_CALLS_PER_TURN: usize = 16;
    /// A tool call's deadline.
    pub const TOOL_DEADLINE_MS: u64 = 30_000;
    /// A hook call's deadline when the hook sets none.
    pub const HOOK_DEADLINE_MS: u64 = 1_000;
    /// No hook deadline may exceed this.
    pub const HOOK_DEADLINE_CEILING_MS: u64 = 10_000;
    /// A query's deadline when the client sends none.
    pub const QUERY_DEADLINE_MS: u64 = 600_000;
    /// Nesting of delegated agents.
    pub const MAX_DELEGATION_DEPTH: u32 = 3;
    /// Queries served at once, across sessions.
    pub const MAX_CONCURRENT_QUERIES: usize = 256;
    /// Largest gRPC message to or from Lattice's clients.
    pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
    /// Largest message to or from a hook or a tool service: larger than the
    /// client's, since a hook sees the whole conversation every turn.
    pub const PEER_MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;
    /// How long start-up waits for ListTools of each tool service.
    pub const TOOL_DISCOVERY_TIMEOUT_MS: u64 = 10_000;
    /// How often each hook and tool address is health-checked.
    pub const PEER_HEALTH_CHECK_MS: u64 = 1_000;
    /// The listen address.
    pub const LISTEN: std::net::SocketAddr =
        std::net::SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 50051);
    /// Where `/metrics` is served: loopback only.
    pub const ADMIN_LISTEN: std::net::SocketAddr =
        std::net::SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 9090);
    /// Output tokens per model request.
    pub const MODEL_MAX_TOKENS: u32 = 4096;
    /// One model request's deadline, retries included.
    pub const MODEL_DEADLINE_MS: u64 = 120_000;
    /// Retries of a model request.
    pub const MODEL_RETRIES: u32 = 3;
    /// Sessions the memory store holds at most.
    pub const MAX_SESSIONS: usize = 10_000;
    /// Sessions neither queried nor read this long are deleted (a week).
    pub const IDLE_TTL_S: u64 = 7 * 24 * 3600;
    /// A crashed replica's lease expires after this.
    pub const LEASE_TTL_MS: u64 = 15_000;
    /// PostgreSQL connections per replica.
    pub const POSTGRES_POOL_SIZE: usize = 16;
    /// MiB of conversations a replica keeps (PostgreSQL store).
    pub const HISTORY_CACHE_MIB: usize = 32;
    /// `sessions.store_timeout_ms`.
    pub const STORE_TIMEOUT_MS: u64 = 5_000;
}

// ---------------------------------------------------------------- raw ----

#[derive(Debug, Default, Deserialize)]
struct RawConfig {
    #[serde(default)]
    server: RawServer,
    #[serde(default)]
    sessions: RawSessions,
    #[serde(default)]
    agents: Vec<RawAgent>,
    #[serde(default)]
    telemetry: RawTelemetry,
}

/// `[telemetry]`: OpenTelemetry traces over OTLP.
#[derive(Debug, Default, Deserialize)]
struct RawTelemetry {
    otlp_endpoint: Option<Spanned<String>>,
    service_name: Option<String>,
    sampling_ratio: Option<Spanned<f64>>,
}

/// `[sessions]`: where conversations live.
#[derive(Debug, Default, Deserialize)]
struct RawSessions {
    /// "memory" (default) or "postgres".
    store: Option<Spanned<String>>,
    /// The environment variable holding the PostgreSQL connection string.
    url_env: Option<Spanned<String>>,
    lease_ttl_ms: Option<u64>,
    idle_ttl_s: Option<u64>,
    max_sessions: Option<usize>,
    pool_size: Option<usize>,
    /// PostgreSQL: MiB of conversations each replica keeps, so that a
    /// query reads only the messages committed since (0: none kept).
    history_cache_mib: Option<Spanned<usize>>,
    /// "wait" (default): serve NOT_SERVING and retry; "exit": refuse to start.
    on_unreachable: Option<Spanned<String>>,
    /// PostgreSQL: how long any statement but a query's lease and commit
    /// may wait for the database (those have the query's deadline).
    store_timeout_ms: Option<u64>,
    /// PostgreSQL: "auto" (default) brings the schema up to date at
    /// start-up; "never" only checks it (`lattice migrate` applies it).
    migrate: Option<Spanned<String>>,
    /// PostgreSQL: prepare statements once per connection (default), or
    /// send them unnamed (PgBouncer's transaction pooling before 1.21).
    prepared_statements: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
struct RawServer {
    listen: Option<Spanned<String>>,
    admin_listen: Option<Spanned<String>>,
    health_listen: Option<Spanned<String>>,
    tls: Option<Spanned<RawServerTls>>,
    max_concurrent_queries: Option<usize>,
    max_message_bytes: Option<usize>,
    hook_max_message_bytes: Option<usize>,
    tool_max_message_bytes: Option<usize>,
    hook_deadline_ms: Option<u64>,
    hook_deadline_ceiling_ms: Option<u64>,
    query_deadline_ms: Option<u64>,
    max_delegation_depth: Option<u32>,
    tool_discovery_timeout_ms: Option<u64>,
    drain_ms: Option<u64>,
    peer_health_check_ms: Option<u64>,
    worker_threads: Option<usize>,
    busy_poll_us: Option<u64>,
    trace_dir: Option<PathBuf>,
    trace_queue_events: Option<usize>,
    trace_max_file_bytes: Option<u64>,
    trace_max_age_s: Option<u64>,
    audit_key_env: Option<Spanned<String>>,
    auth: Option<Spanned<RawAuth>>,
    #[serde(default)]
    limits: RawLimits,
}

/// `[server.limits]`: per principal.
#[derive(Debug, Default, Deserialize)]
struct RawLimits {
    queries_in_flight: Option<usize>,
    queries_per_minute: Option<u32>,
}

/// `[server.tls]`: TLS on the API listener.
#[derive(Debug, Default, Deserialize)]
struct RawServerTls {
    cert_file: Option<String>,
    key_file: Option<String>,
    client_ca_file: Option<String>,
}

/// `[server.auth]`: who may call.
#[derive(Debug, Default, Deserialize)]
struct RawAuth {
    /// "mtls", "token" or "none".
    mode: Option<Spanned<String>>,
    /// Mode "token": lines `<principal> <sha256 hex of the token>`.
    tokens_file: Option<String>,
    /// Principals that may use the admin RPCs (TestHooks).
    #[serde(default)]
    admins: Vec<String>,
    /// Named sets of principals, used as `group:<name>` in `admins` and in
    /// an agent's `principals`.
    #[serde(default)]
    groups: std::collections::BTreeMap<String, Vec<String>>,
}

#[derive(Debug, Deserialize)]
struct RawAgent {
    name: Spanned<String>,
    #[serde(default)]
    description: String,
    #[serde(default)]
    system_prompt: String,
    model: Spanned<RawModel>,
    max_turns: Option<Spanned<u32>>,
    parallel_tool_calls: Option<Spanned<usize>>,
    max_tool_calls_per_turn: Option<Spanned<usize>>,
    #[serde(default)]
    allow: Vec<String>,
    #[serde(default)]
    deny: Vec<String>,
    #[serde(default)]
    tools: Vec<RawToolSource>,
    #[serde(default)]
    delegates: Vec<RawDelegate>,
    #[serde(default)]
    hooks: Vec<RawHook>,
    /// Who may query it (with `[server.auth]` on); unset: any principal.
    principals: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
struct RawModel {
    provider: Spanned<String>,
    #[serde(default)]
    name: String,
    #[serde(default)]
    script: Vec<RawScriptTurn>,
    base_url: Option<Spanned<String>>,
    api_key_env: Option<Spanned<String>>,
    max_tokens: Option<u32>,
    temperature: Option<f64>,
    deadline_ms: Option<u64>,
    retries: Option<u32>,
    stream: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct RawScriptTurn {
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    tool_calls: Vec<RawScriptCall>,
    #[serde(default)]
    delay_ms: u64,
    #[serde(default)]
    stop_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
struct RawScriptCall {
    name: String,
    #[serde(default)]
    input: BTreeMap<String, toml::Value>,
}

#[derive(Debug, Deserialize)]
struct RawToolSource {
    endpoint: Spanned<String>,
    tls: Option<Spanned<RawTls>>,
    deadline_ms: Option<u64>,
    /// Offer only these of the discovered tools.
    only: Option<Vec<String>>,
    /// Declare the tools here instead of discovering them with ListTools.
    declare: Option<Vec<RawToolDecl>>,
}

#[derive(Debug, Deserialize)]
struct RawToolDecl {
    name: String,
    #[serde(default)]
    description: String,
    #[serde(default)]
    input_schema: BTreeMap<String, toml::Value>,
}

#[derive(Debug, Deserialize)]
struct RawDelegate {
    agent: Spanned<String>,
    tool_name: Option<String>,
    #[serde(default)]
    description: String,
    deadline_ms: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct RawHook {
    name: Spanned<String>,
    endpoint: Spanned<String>,
    tls: Option<Spanned<RawTls>>,
    events: Spanned<Vec<String>>,
    deadline_ms: Option<Spanned<u64>>,
    #[serde(default = "yes")]
    enabled: bool,
    #[serde(default = "yes")]
    required: bool,
}

/// TLS to a tool or hook service. Paths are relative to the config file.
#[derive(Debug, Deserialize)]
struct RawTls {
    /// The CA that signs the service's certificate (PEM); the system's roots
    /// when unset.
    ca_file: Option<String>,
    /// The certificate (chain) Lattice presents, for mutual TLS (PEM).
    cert_file: Option<String>,
    /// Its private key (PEM).
    key_file: Option<String>,
    /// The name the service's certificate must carry, when it is not the
    /// endpoint's host.
    server_name: Option<String>,
}

fn yes() -> bool {
    true
}

// Which tables sit under which keys (for the key check; see `document`).
static ROOT: Shape = Shape { fields: fields_of::<RawConfig>, child: root_child };
static SESSIONS: Shape = Shape { fields: fields_of::<RawSessions>, child: no_child };
static TELEMETRY: Shape = Shape { fields: fields_of::<RawTelemetry>, child: no_child };
static SERVER: Shape = Shape { fields: fields_of::<RawServer>, child: server_child };
static SERVER_TLS: Shape = Shape { fields: fields_of::<RawServerTls>, child: no_child };
static AUTH: Shape = Shape { fields: fields_of::<RawAuth>, child: no_child };
static LIMITS: Shape = Shape { fields: fields_of::<RawLimits>, child: no_child };
static AGENT: Shape = Shape { fields: fields_of::<RawAgent>, child: agent_child };
static MODEL: Shape = Shape { fields: fields_of::<RawModel>, child: model_child };
static SCRIPT_TURN: Shape = Shape { fields: fields_of::<RawScriptTurn>, child: script_turn_child };
static SCRIPT_CALL: Shape = Shape { fields: fields_of::<RawScriptCall>, child: no_child };
static TOOLS: Shape = Shape { fields: fields_of::<RawToolSource>, child: tools_child };
static TOOL_DECL: Shape = Shape { fields: fields_of::<RawToolDecl>, child: no_child };
static DELEGATE: Shape = Shape { fields: fields_of::<RawDelegate>, child: no_child };
static HOOK: Shape = Shape { fields: fields_of::<RawHook>, child: tls_child };
static TLS: Shape = Shape { fields: fields_of::<RawTls>, child: no_child };

fn no_child(_: &str) -> Option<&'static Shape> {
    None
}

fn root_child(key: &str) -> Option<&'static Shape> {
    match key {
        "server" => Some(&SERVER),
        "sessions" => Some(&SESSIONS),
        "telemetry" => Some(&TELEMETRY),
        "agents" => Some(&AGENT),
        _ => None,
    }
}

fn server_child(key: &str) -> Option<&'static Shape> {
    match key {
        "tls" => Some(&SERVER_TLS),
        "auth" => Some(&AUTH),
        "limits" => Some(&LIMITS),
        _ => None,
    }
}

fn agent_child(key: &str) -> Option<&'static Shape> {
    match key {
        "model" => Some(&MODEL),
        "tools" => Some(&TOOLS),
        "delegates" => Some(&DELEGATE),
        "hooks" => Some(&HOOK),
        _ => None,
    }
}

fn model_child(key: &str) -> Option<&'static Shape> {
    (key == "script").then_some(&SCRIPT_TURN)
}

fn script_turn_child(key: &str) -> Option<&'static Shape> {
    // A call's `input` is free-form.
    (key == "tool_calls").then_some(&SCRIPT_CALL)
}

fn tools_child(key: &str) -> Option<&'static Shape> {
    match key {
        "tls" => Some(&TLS),
        // A declared tool's `input_schema` is free-form.
        "declare" => Some(&TOOL_DECL),
        _ => None,
    }
}

fn tls_child(key: &str) -> Option<&'static Shape> {
    (key == "tls").then_some(&TLS)
}

// ---------------------------------------------------------- validated ----

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Server-wide settings.
    pub server: ServerSettings,
    /// Where conversations live.
    pub sessions: SessionSettings,
    /// The agents, in file order.
    pub agents: Vec<AgentDef>,
    /// OpenTelemetry export (`[telemetry]`).
    pub telemetry: TelemetrySettings,
}

/// Where conversations live (`[sessions]`).
#[derive(Debug, Clone)]
pub struct SessionSettings {
    /// The backend.
    pub store: StoreSettings,
    /// A crashed replica's lease expires after this.
    pub lease_ttl: Duration,
    /// Sessions neither queried nor read this long are deleted.
    pub idle_ttl: Duration,
    /// The memory store holds at most this many sessions.
    pub max_sessions: usize,
}

/// The session store backend.
#[derive(Debug, Clone)]
pub enum StoreSettings {
    /// This process's memory (one replica).
    Memory,
    /// PostgreSQL, shared by every replica.
    Postgres(PostgresSettings),
}

/// How to reach PostgreSQL.
#[derive(Clone)]
pub struct PostgresSettings {
    /// The environment variable the URL was read from.
    pub url_env: String,
    /// The connection string (never printed: see `Debug`).
    pub url: String,
    /// Connections per replica.
    pub pool_size: usize,
    /// Refuse to start when the database can't be reached (instead of
    /// serving NOT_SERVING and retrying).
    pub exit_if_unreachable: bool,
    /// Bytes of conversations this replica keeps, so that taking a lease
    /// reads only the messages committed since (0: none kept).
    pub history_cache_bytes: usize,
    /// How long any statement but a query's lease and commit may wait for
    /// the database (renewals, releases, reads, deletes, sweeps, health).
    pub store_timeout: Duration,
    /// Whether start-up brings the schema up to date (else it only checks
    /// that the schema is the one this build knows).
    pub migrate: bool,
    /// Whether statements are prepared once per connection and cached
    /// (else sent unnamed with their types: PgBouncer's transaction
    /// pooling before 1.21 carries no prepared statement).
    pub prepared_statements: bool,
}

impl fmt::Debug for PostgresSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresSettings")
            .field("url_env", &self.url_env)
            .field("url", &"<redacted>")
            .field("pool_size", &self.pool_size)
            .field("exit_if_unreachable", &self.exit_if_unreachable)
            .field("history_cache_bytes", &self.history_cache_bytes)
            .field("store_timeout", &self.store_timeout)
            .field("migrate", &self.migrate)
            .field("prepared_statements", &self.prepared_statements)
            .finish()
    }
}

/// Server-wide settings.
#[derive(Debug, Clone)]
pub struct ServerSettings {
    /// Where to listen (the CLI's `--listen` wins).
    pub listen: SocketAddr,
    /// Where `/metrics` is served, never on the API port (`None`: off; the
    /// CLI's `--admin-listen` wins).
    pub admin_listen: Option<SocketAddr>,
    /// A plaintext port that serves only `grpc.health.v1.Health`, for the
    /// kubelet's gRPC probes when the API port speaks TLS (`None`: off; the
    /// CLI's `--health-listen` wins).
    pub health_listen: Option<SocketAddr>,
    /// TLS on the API listener (`[server.tls]`); `None`: plaintext.
    pub tls: Option<TlsSettings>,
    /// Queries served at once; the excess gets RESOURCE_EXHAUSTED.
    pub max_concurrent_queries: usize,
    /// Largest gRPC message to or from a client (and so largest event).
    pub max_message_bytes: usize,
    /// Largest message to or from a hook. A model request larger than this
    /// reaches the OnModelRequest hooks (and the model) cut to its newest
    /// messages that fit.
    pub hook_max_message_bytes: usize,
    /// Largest message to or from a tool service.
    pub tool_max_message_bytes: usize,
    /// Ceiling on every hook deadline.
    pub hook_deadline_ceiling: Duration,
    /// A hook's deadline when its entry sets none.
    pub hook_default_deadline: Duration,
    /// A query's deadline when the client sends no grpc-timeout (and the cap
    /// on the one it sends).
    pub query_deadline: Duration,
    /// Nesting of delegated agents.
    pub max_delegation_depth: u32,
    /// How long start-up waits for each tool service's ListTools.
    pub tool_discovery_timeout: Duration,
    /// When set, a JSONL trace file per session is written here.
    pub trace_dir: Option<PathBuf>,
    /// Trace events waiting to be written at most (more are dropped).
    pub trace_queue_events: usize,
    /// A session's trace file is rotated before it passes this size.
    pub trace_max_file_bytes: u64,
    /// Trace files untouched this long are removed.
    pub trace_max_age: Duration,
    /// The key of the audit record's HMAC digests (`server.audit_key_env`);
    /// `None`: plain SHA-256.
    pub audit_key: Option<AuditKey>,
    /// After SIGTERM, keep accepting queries (health NOT_SERVING) this long
    /// before stopping, so that clients still routed here are served.
    pub drain: Duration,
    /// How often each address of a hook or tool service is health-checked;
    /// `None`: never (readiness then follows calls alone).
    pub peer_health_check: Option<Duration>,
    /// Tokio worker threads of `lattice serve`; `None`: one per core.
    pub worker_threads: Option<usize>,
    /// How long `lattice serve` polls for readiness instead of sleeping
    /// while a hook or tool call is in flight (`server.busy_poll_us`, see
    /// [`crate::busy_poll`]); `None`: it sleeps.
    pub busy_poll: Option<Duration>,
    /// Who may call (`[server.auth]`).
    pub auth: AuthSettings,
    /// Per-principal limits (`[server.limits]`).
    pub limits: LimitSettings,
}

/// A secret key, never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct AuditKey(pub String);

impl fmt::Debug for AuditKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// `[server.auth]`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AuthSettings {
    /// How clients prove who they are.
    pub mode: AuthMode,
    /// Principals that may use the admin RPCs (groups expanded).
    pub admins: Vec<String>,
    /// `[server.auth.groups]`: named sets of principals.
    pub groups: std::collections::BTreeMap<String, Vec<String>>,
}

/// How clients prove who they are.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum AuthMode {
    /// `mode = "none"`: open, said on purpose.
    #[default]
    None,
    /// `mode = "mtls"`: the client certificate's first URI SAN, else its
    /// first DNS SAN (needs `server.tls.client_ca_file`).
    Mtls,
    /// `mode = "token"`: a bearer token whose SHA-256 is in this file.
    Token {
        /// The tokens file (read at start-up, re-read when it changes).
        tokens_file: PathBuf,
    },
}

/// One agent.
#[derive(Debug, Clone)]
pub struct AgentDef {
    /// Unique name.
    pub name: String,
    /// What it is for.
    pub description: String,
    /// The system prompt (shared, so that what holds it knows it by its
    /// address).
    pub system_prompt: std::sync::Arc<str>,
    /// Its model.
    pub model: ModelConfig,
    /// Model requests per query.
    pub max_turns: u32,
    /// Tool calls of one reply run at once (1 = sequential).
    pub parallel_tool_calls: usize,
    /// Tool calls one reply may ask for; the rest are blocked.
    pub max_tool_calls_per_turn: usize,
    /// Which tools may run.
    pub permissions: Permissions,
    /// Remote tool services.
    pub tool_sources: Vec<ToolSourceDef>,
    /// Agents offered as tools.
    pub delegates: Vec<DelegateDef>,
    /// The hook chain, in registered order (disabled entries included).
    pub hooks: Vec<HookDef>,
    /// Who may query it when `[server.auth]` is on; `None`: any principal.
    pub principals: Option<Vec<String>>,
}

/// Which model answers.
#[derive(Debug, Clone)]
pub enum ModelConfig {
    /// The deterministic offline model.
    Scripted {
        /// Shown as `scripted/NAME`.
        name: String,
        /// One entry per turn.
        script: Vec<ScriptTurn>,
    },
    /// A model behind an HTTP API.
    Http(HttpModelConfig),
}

/// The HTTP APIs Lattice speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provider {
    /// Anthropic Messages API.
    Anthropic,
    /// OpenAI-compatible Chat Completions (OpenAI, vLLM, Ollama, llama.cpp, LiteLLM …).
    OpenAi,
}

impl Provider {
    /// The name used in config and errors.
    pub fn as_str(self) -> &'static str {
        match self {
            Provider::Anthropic => "anthropic",
            Provider::OpenAi => "openai",
        }
    }
}

/// An HTTP model's settings.
#[derive(Clone)]
pub struct HttpModelConfig {
    /// Which API.
    pub provider: Provider,
    /// The model name sent to the API.
    pub model: String,
    /// The API's base URL (without `/v1/...`).
    pub base_url: String,
    /// The environment variable the key was read from.
    pub api_key_env: String,
    /// The key itself (never printed: see `Debug`).
    pub api_key: String,
    /// Output token limit per request.
    pub max_tokens: u32,
    /// Sampling temperature (the API's default when unset).
    pub temperature: Option<f64>,
    /// One model request's deadline, retries included.
    pub deadline: Duration,
    /// Retries after the first attempt (429, 5xx, overloaded, connection errors).
    pub retries: u32,
    /// Stream the reply (text deltas reach the client as they arrive).
    pub stream: bool,
}

impl fmt::Debug for HttpModelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpModelConfig")
            .field("provider", &self.provider)
            .field("model", &self.model)
            .field("base_url", &self.base_url)
            .field("api_key_env", &self.api_key_env)
            .field("api_key", &"<redacted>")
            .field("max_tokens", &self.max_tokens)
            .field("temperature", &self.temperature)
            .field("deadline", &self.deadline)
            .field("retries", &self.retries)
            .field("stream", &self.stream)
            .finish()
    }
}

impl ModelConfig {
    /// The provider's name: `scripted`, `anthropic` or `openai`.
    pub fn provider(&self) -> &'static str {
        match self {
            ModelConfig::Scripted { .. } => "scripted",
            ModelConfig::Http(h) => h.provider.as_str(),
        }
    }

    /// `provider/name`, for GetAgent and logs.
    pub fn label(&self) -> String {
        match self {
            ModelConfig::Scripted { name, .. } => format!("scripted/{name}"),
            ModelConfig::Http(h) => format!("{}/{}", h.provider.as_str(), h.model),
        }
    }
}

/// One scripted turn.
#[derive(Debug, Clone)]
pub struct ScriptTurn {
    /// Text (may hold `{{...}}` echo placeholders).
    pub text: Option<String>,
    /// Tool calls, in order.
    pub tool_calls: Vec<(String, JsonObject)>,
    /// Wait this long before answering.
    pub delay: Duration,
    /// Reported stop reason (default: tool_use when there are calls, else end_turn).
    pub stop_reason: Option<StopReason>,
}

/// Allow / deny by tool name. Deny wins; an empty allow list allows all.
#[derive(Debug, Clone, Default)]
pub struct Permissions {
    /// Allowed names ("*" = all).
    pub allow: Vec<String>,
    /// Denied names ("*" = all).
    pub deny: Vec<String>,
}

impl Permissions {
    /// Whether a tool may run.
    pub fn allows(&self, tool: &str) -> bool {
        let hit = |list: &[String]| list.iter().any(|p| p == "*" || p == tool);
        !hit(&self.deny) && (self.allow.is_empty() || hit(&self.allow))
    }
}

/// A remote tool service of an agent.
#[derive(Debug, Clone)]
pub struct ToolSourceDef {
    /// Its gRPC endpoint: `http(s)://host:port` or `dns:///host:port`.
    pub endpoint: String,
    /// TLS settings (`https://`, or `dns:///` with TLS).
    pub tls: Option<Tls>,
    /// Each call's deadline.
    pub deadline: Duration,
    /// Offer only these discovered tools.
    pub only: Option<Vec<String>>,
    /// Tools declared in config (no discovery).
    pub declared: Option<Vec<ToolSpec>>,
}

/// An agent offered as a tool.
#[derive(Debug, Clone)]
pub struct DelegateDef {
    /// The delegated agent.
    pub agent: String,
    /// The tool name the model sees.
    pub tool_name: String,
    /// The description the model sees.
    pub description: String,
    /// The whole delegated run's deadline.
    pub deadline: Duration,
}

/// Which events a hook handles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HookEvents {
    /// OnToolResult.
    pub tool_result: bool,
    /// OnModelRequest.
    pub model_request: bool,
}

/// One hook registration.
#[derive(Debug, Clone)]
pub struct HookDef {
    /// Its name.
    pub name: String,
    /// Its HookService endpoint: `http(s)://host:port` or `dns:///host:port`.
    pub endpoint: String,
    /// TLS settings (`https://`, or `dns:///` with TLS).
    pub tls: Option<Tls>,
    /// Events it handles.
    pub events: HookEvents,
    /// Its deadline (never above the ceiling: a config asking for more is
    /// refused).
    pub deadline: Duration,
    /// Disabled entries are skipped.
    pub enabled: bool,
    /// Lattice reports NOT_SERVING while this hook has no ready address
    /// (every query of the agent would abort).
    pub required: bool,
}

// ------------------------------------------------------------- errors ----

/// One problem in the config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// 1-based line, where known.
    pub line: Option<usize>,
    /// The field, as a path (`agents[0].hooks[1].endpoint`).
    pub field: String,
    /// What is wrong.
    pub message: String,
}

/// Why a config file was refused: every problem found.
#[derive(Debug, Clone, thiserror::Error)]
pub struct ConfigError {
    /// The file.
    pub file: PathBuf,
    /// Every problem, in file order where lines are known.
    pub problems: Vec<Problem>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "invalid config {} ({} problem(s)):", self.file.display(), self.problems.len())?;
        for p in &self.problems {
            match p.line {
                Some(l) => writeln!(f, "  {}:{l}: {}: {}", self.file.display(), p.field, p.message)?,
                None => writeln!(f, "  {}: {}: {}", self.file.display(), p.field, p.message)?,
            }
        }
        Ok(())
    }
}

// --------------------------------------------------------- validation ----

/// The checks of a config that need a layer above it: parsing an endpoint
/// as the transport does, and reading certificate and token files as the
/// transport, the API listener and authentication will. The config names
/// no layer above it: whoever loads a config passes these
/// ([`crate::CHECKS`] in the server; a test may pass its own). Each answer
/// is a problem at its field's line, in the same pass as every other.
pub trait Checks: Sync {
    /// Why `endpoint` is no endpoint the transport can reach.
    fn endpoint(&self, endpoint: &str) -> Result<(), String>;
    /// Why `tls` can't be used with `endpoint` (its files, its scheme).
    fn endpoint_tls(&self, endpoint: &str, tls: Option<&Tls>) -> Result<(), String>;
    /// Why the API listener's certificate and key can't be loaded.
    fn server_tls(&self, settings: &TlsSettings) -> Result<(), String>;
    /// Why the tokens file can't be read.
    fn tokens_file(&self, path: &Path) -> Result<(), String>;
}

/// Reads and validates a config file.
pub fn load(path: &Path, checks: &dyn Checks) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
        file: path.to_owned(),
        problems: vec![Problem { line: None, field: "-".into(), message: format!("cannot read: {e}") }],
    })?;
    parse(&text, path, checks)
}

/// Parses and validates config text (`path` is for messages), as `serve`
/// needs it: the model API keys must be set.
pub fn parse(text: &str, path: &Path, checks: &dyn Checks) -> Result<Config, ConfigError> {
    parse_with(text, path, Secrets::Required, &|var| std::env::var(var).ok(), checks).map(|(config, _)| config)
}

/// [`parse`], with secrets (API keys, the database URL) looked up by `env`
/// instead of the process environment: for embedding and tests, which run
/// several servers in one process.
pub fn parse_with_env(
    text: &str,
    path: &Path,
    env: &dyn Fn(&str) -> Option<String>,
    checks: &dyn Checks,
) -> Result<Config, ConfigError> {
    parse_with(text, path, Secrets::Required, env, checks).map(|(config, _)| config)
}

/// Reads and validates a config file as `check-config` does: an API key
/// variable that is not set is a warning (CI validates configs without
/// secrets), returned beside the config.
pub fn check(path: &Path, checks: &dyn Checks) -> Result<(Config, Vec<Problem>), ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
        file: path.to_owned(),
        problems: vec![Problem { line: None, field: "-".into(), message: format!("cannot read: {e}") }],
    })?;
    parse_with(&text, path, Secrets::Optional, &|var| std::env::var(var).ok(), checks)
}

/// Whether the model API keys must be in the environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Secrets {
    Required,
    Optional,
}

fn parse_with(
    text: &str,
    path: &Path,
    secrets: Secrets,
    env: &dyn Fn(&str) -> Option<String>,
    checks: &dyn Checks,
) -> Result<(Config, Vec<Problem>), ConfigError> {
    let fail = |problems| ConfigError { file: path.to_owned(), problems };
    let doc = DeTable::parse(text).map_err(|e| {
        let line = e.span().map(|s| line_of(text, s.start));
        fail(vec![Problem { line, field: "(syntax)".into(), message: e.message().trim().to_owned() }])
    })?;
    let mut walk = Walk::default();
    walk.table(doc.get_ref(), &ROOT, "");
    let dir = path.parent().unwrap_or(Path::new("")).to_owned();
    let unknown = std::mem::take(&mut walk.unknown);
    let mut v = Validator {
        text,
        dir,
        secrets,
        env,
        checks,
        walk,
        problems: Vec::new(),
        warnings: Vec::new(),
        left_out: Vec::new(),
    };
    for u in unknown {
        v.problem(Some(u.span), u.field, u.message);
    }
    let raw = v.raw(doc.into_inner());
    let config = v.config(raw);
    if v.problems.is_empty() {
        Ok((config, v.warnings))
    } else {
        v.problems.sort_by_key(|p| p.line.unwrap_or(0));
        Err(fail(v.problems))
    }
}

/// `principals` with every `group:<name>` replaced by its members
/// (`[server.auth.groups]`); the error is an unknown group's name.
fn expand_groups(
    principals: &[String],
    groups: &std::collections::BTreeMap<String, Vec<String>>,
) -> Result<Vec<String>, String> {
    let mut out: Vec<String> = Vec::new();
    for p in principals {
        let members = match p.strip_prefix("group:") {
            Some(group) => groups.get(group).ok_or_else(|| group.to_owned())?.as_slice(),
            None => std::slice::from_ref(p),
        };
        for m in members {
            if !out.contains(m) {
                out.push(m.clone());
            }
        }
    }
    Ok(out)
}

fn unknown_group(name: &str) -> String {
    format!("no group {name:?} in [server.auth.groups]")
}

/// `server.admin_listen` (and `--admin-listen`): an address, or "off".
/// `None` inside: malformed.
pub fn parse_admin_listen(value: &str) -> Option<Option<SocketAddr>> {
    match value {
        "off" => Some(None),
        addr => addr.parse().ok().map(Some),
    }
}

/// The key a serde "missing field `key`" message names.
fn missing_field(message: &str) -> Option<&str> {
    message.strip_prefix("missing field `")?.split('`').next()
}

fn line_of(text: &str, offset: usize) -> usize {
    text.get(..offset).map_or(1, |t| t.matches('\n').count() + 1)
}

struct Validator<'a> {
    text: &'a str,
    /// The config file's directory: relative paths start here.
    dir: PathBuf,
    /// Whether a missing API key is a problem or a warning.
    secrets: Secrets,
    /// Where secrets are looked up (the process environment, normally).
    env: &'a dyn Fn(&str) -> Option<String>,
    /// The checks that need a layer above the config.
    checks: &'a dyn Checks,
    /// Every value's field path and span.
    walk: Walk,
    problems: Vec<Problem>,
    warnings: Vec<Problem>,
    /// Fields whose values were left out for their type (already reported).
    left_out: Vec<String>,
}

/// Whether `field` is `parent` or a field inside it.
fn within(field: &str, parent: &str) -> bool {
    field.strip_prefix(parent).is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']))
}

/// The raw config, its parts typed one by one so that a wrong value in one
/// agent hides nothing in another.
struct Parts {
    raw: RawConfig,
    /// Whether the file has an `agents` key at all.
    has_agents: bool,
    /// Names of agents that did not deserialize (still valid delegation targets).
    broken: HashSet<String>,
}

fn valid_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

fn toml_to_json(v: toml::Value) -> Value {
    match v {
        toml::Value::String(s) => Value::String(s),
        toml::Value::Integer(i) => Value::from(i),
        toml::Value::Float(f) => serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number),
        toml::Value::Boolean(b) => Value::Bool(b),
        toml::Value::Datetime(d) => Value::String(d.to_string()),
        toml::Value::Array(a) => Value::Array(a.into_iter().map(toml_to_json).collect()),
        toml::Value::Table(t) => Value::Object(t.into_iter().map(|(k, v)| (k, toml_to_json(v))).collect()),
    }
}

fn table_to_object(t: BTreeMap<String, toml::Value>) -> JsonObject {
    t.into_iter().map(|(k, v)| (k, toml_to_json(v))).collect()
}

impl Validator<'_> {
    /// Types the server table and each agent on its own; each failure is a
    /// problem at the path of the value it names.
    fn raw(&mut self, doc: DeTable<'_>) -> Parts {
        let mut parts = Parts { raw: RawConfig::default(), has_agents: false, broken: HashSet::new() };
        for (key, value) in doc {
            match &**key.get_ref() {
                "server" => {
                    if let Some(server) = self.typed(value, "server") {
                        parts.raw.server = server;
                    }
                }
                "sessions" => {
                    if let Some(sessions) = self.typed(value, "sessions") {
                        parts.raw.sessions = sessions;
                    }
                }
                "telemetry" => {
                    if let Some(telemetry) = self.typed(value, "telemetry") {
                        parts.raw.telemetry = telemetry;
                    }
                }
                "agents" => {
                    parts.has_agents = true;
                    let span = value.span();
                    let DeValue::Array(items) = value.into_inner() else {
                        self.problem(Some(span), "agents", "must be an array of tables: [[agents]]");
                        continue;
                    };
                    for (i, item) in items.into_iter().enumerate() {
                        let name = match item.get_ref() {
                            DeValue::Table(t) => t.iter().find_map(|(k, v)| match (&**k.get_ref(), v.get_ref()) {
                                ("name", DeValue::String(s)) => Some(s.to_string()),
                                _ => None,
                            }),
                            _ => None,
                        };
                        match self.agent_table(item, i) {
                            Some(agent) => parts.raw.agents.push(agent),
                            None => parts.broken.extend(name),
                        }
                    }
                }
                _ => {} // reported by the walk
            }
        }
        parts
    }

    /// Types one agent (see [`Self::typed`]); `None` leaves it out.
    fn agent_table(&mut self, item: Spanned<DeValue<'_>>, i: usize) -> Option<RawAgent> {
        self.typed(item, &format!("agents[{i}]"))
    }

    /// Types one table (`server`, an agent, …) found at `at`. A value of
    /// the wrong type is reported and left out (its default applies), and
    /// typing goes on, so that one typo hides none of the table's other
    /// problems. A table that still doesn't type (a required key missing)
    /// is reported and gives `None`; a required key that is missing only
    /// because its wrong value was left out is not reported twice.
    fn typed<T: serde::de::DeserializeOwned>(&mut self, value: Spanned<DeValue<'_>>, at: &str) -> Option<T> {
        let span = value.span();
        let mut value = value.into_inner();
        // The keys left out so far, relative to `at`.
        let mut removed: Vec<String> = Vec::new();
        // Each round reports one problem and removes one key: a table has
        // far fewer keys than this.
        for _ in 0..64 {
            let attempt = T::deserialize(ValueDeserializer::from(Spanned::new(span.clone(), value.clone())));
            let e = match attempt {
                Ok(typed) => return Some(typed),
                Err(e) => e,
            };
            let error_span = e.span().unwrap_or(span.clone());
            let field = self.walk.path_of(&error_span).unwrap_or(at).to_owned();
            let relative =
                if field == at { Some("") } else { field.strip_prefix(at).and_then(|f| f.strip_prefix('.')) };
            let message = e.message().trim();
            // (The span of a missing key's table may name the array that
            // holds it, `hooks` for `hooks[0]`: any removed key of that name
            // below it counts.)
            let said_already = missing_field(message).is_some_and(|key| {
                let parent = relative.unwrap_or("");
                removed.iter().any(|r| r.starts_with(parent) && (r == key || r.ends_with(&format!(".{key}"))))
            });
            if !said_already {
                self.problem(Some(error_span), field.clone(), message);
            }
            let removed_now = match (&mut value, relative) {
                (DeValue::Table(t), Some(relative)) if !relative.is_empty() => remove_key(t, relative),
                _ => false,
            };
            if !removed_now {
                return None;
            }
            removed.extend(relative.map(str::to_owned));
            self.left_out.push(field);
        }
        None
    }

    /// Records a problem; without a span, the line is the field's own. A
    /// value left out for its type was reported as such: nothing more is
    /// said of it (that it is missing, say).
    fn problem(&mut self, span: Option<std::ops::Range<usize>>, field: impl Into<String>, message: impl Into<String>) {
        let field = field.into();
        if self.left_out.iter().any(|f| within(&field, f)) {
            return;
        }
        let line = span.or_else(|| self.walk.span_of(&field)).map(|s| line_of(self.text, s.start));
        self.problems.push(Problem { line, field, message: message.into() });
    }

    /// An endpoint and its TLS table: files read, certificates and key
    /// parsed. `field` is the entry's path (`agents[0].hooks[1]`).
    fn endpoint(&mut self, e: &Spanned<String>, tls: Option<Spanned<RawTls>>, field: &str) -> Option<Tls> {
        if let Err(why) = self.checks.endpoint(e.get_ref()) {
            self.problem(Some(e.span()), format!("{field}.endpoint"), format!("{:?}: {why}", e.get_ref()));
            return None;
        }
        let (span, raw) = match tls {
            Some(t) => (Some(t.span()), Some(t.into_inner())),
            None => (None, None),
        };
        let self_dir = self.dir.clone();
        let mut read = |file: Option<String>, name: &str| {
            let file = file?;
            let path = self.dir.join(&file);
            match std::fs::read_to_string(&path) {
                Ok(pem) => Some(pem),
                Err(err) => {
                    self.problem(span.clone(), format!("{field}.tls.{name}"), format!("cannot read {file:?}: {err}"));
                    None
                }
            }
        };
        let tls = match raw {
            None => None,
            Some(raw) => {
                let path = |f: &Option<String>| f.as_ref().map(|f| self_dir.join(f));
                let files = TlsFiles { ca: path(&raw.ca_file), cert: path(&raw.cert_file), key: path(&raw.key_file) };
                let ca_pem = read(raw.ca_file, "ca_file");
                let cert = read(raw.cert_file, "cert_file");
                let key = read(raw.key_file, "key_file");
                let identity = match (cert, key) {
                    (Some(cert), Some(key)) => Some((cert, key)),
                    (None, None) => None,
                    _ => {
                        self.problem(
                            span.clone(),
                            format!("{field}.tls"),
                            "set both cert_file and key_file, or neither",
                        );
                        None
                    }
                };
                Some(Tls { ca_pem, identity, server_name: raw.server_name, files: Some(files) })
            }
        };
        if let Err(why) = self.checks.endpoint_tls(e.get_ref(), tls.as_ref()) {
            self.problem(span.or(Some(e.span())), format!("{field}.tls"), why);
        }
        tls
    }

    fn positive<T: PartialOrd + Default + Copy>(&mut self, v: &Option<Spanned<T>>, field: &str, default: T) -> T {
        match v {
            Some(s) if *s.get_ref() <= T::default() => {
                self.problem(Some(s.span()), field, "must be at least 1");
                default
            }
            Some(s) => *s.get_ref(),
            None => default,
        }
    }

    fn config(&mut self, parts: Parts) -> Config {
        let raw = parts.raw;
        let server = self.server(raw.server);
        let sessions = self.sessions(raw.sessions);
        let telemetry = self.telemetry(raw.telemetry);
        if !parts.has_agents {
            self.problem(None, "agents", "no agents are defined: add at least one [[agents]] table");
        }
        let mut seen = HashSet::new();
        for (i, a) in raw.agents.iter().enumerate() {
            if !seen.insert(a.name.get_ref().clone()) {
                self.problem(
                    Some(a.name.span()),
                    format!("agents[{i}].name"),
                    format!("duplicate agent name {:?}", a.name.get_ref()),
                );
            }
        }
        let mut names: HashSet<String> = raw.agents.iter().map(|a| a.name.get_ref().clone()).collect();
        names.extend(parts.broken);
        let mut agents = Vec::new();
        let mut spans = Vec::new();
        for (i, a) in raw.agents.into_iter().enumerate() {
            spans.push(a.name.span());
            agents.push(self.agent(i, a, &names, &server));
        }
        self.cycles(&agents, &spans);
        Config { server, sessions, agents, telemetry }
    }

    fn server(&mut self, s: RawServer) -> ServerSettings {
        let listen = match &s.listen {
            Some(l) => l.get_ref().parse().unwrap_or_else(|_| {
                self.problem(
                    Some(l.span()),
                    "server.listen",
                    format!("{:?} is not an address like 0.0.0.0:50051", l.get_ref()),
                );
                defaults::LISTEN
            }),
            None => defaults::LISTEN,
        };
        let admin_listen = match &s.admin_listen {
            Some(a) => parse_admin_listen(a.get_ref()).unwrap_or_else(|| {
                self.problem(
                    Some(a.span()),
                    "server.admin_listen",
                    format!("{:?} is not an address like 127.0.0.1:9090, nor \"off\"", a.get_ref()),
                );
                None
            }),
            None => Some(defaults::ADMIN_LISTEN),
        };
        let health_listen = s.health_listen.as_ref().and_then(|h| {
            parse_admin_listen(h.get_ref()).unwrap_or_else(|| {
                self.problem(
                    Some(h.span()),
                    "server.health_listen",
                    format!("{:?} is not an address like 0.0.0.0:8081, nor \"off\"", h.get_ref()),
                );
                None
            })
        });
        let tls = s.tls.map(|t| self.server_tls(t));
        for (v, f) in [
            (s.worker_threads.map(|v| v as u64), "server.worker_threads"),
            (s.max_concurrent_queries.map(|v| v as u64), "server.max_concurrent_queries"),
            (s.max_message_bytes.map(|v| v as u64), "server.max_message_bytes"),
            (s.hook_max_message_bytes.map(|v| v as u64), "server.hook_max_message_bytes"),
            (s.tool_max_message_bytes.map(|v| v as u64), "server.tool_max_message_bytes"),
            (s.hook_deadline_ms, "server.hook_deadline_ms"),
            (s.hook_deadline_ceiling_ms, "server.hook_deadline_ceiling_ms"),
            (s.query_deadline_ms, "server.query_deadline_ms"),
            (s.tool_discovery_timeout_ms, "server.tool_discovery_timeout_ms"),
            (s.trace_queue_events.map(|v| v as u64), "server.trace_queue_events"),
            (s.trace_max_file_bytes, "server.trace_max_file_bytes"),
            (s.trace_max_age_s, "server.trace_max_age_s"),
            (s.limits.queries_in_flight.map(|v| v as u64), "server.limits.queries_in_flight"),
            (s.limits.queries_per_minute.map(u64::from), "server.limits.queries_per_minute"),
        ] {
            if v == Some(0) {
                self.problem(None, f, "must be at least 1");
            }
        }
        let ceiling = s.hook_deadline_ceiling_ms.unwrap_or(defaults::HOOK_DEADLINE_CEILING_MS);
        if let Some(d) = s.hook_deadline_ms.filter(|d| *d > ceiling) {
            let message = format!("{d} ms is above the ceiling of {ceiling} ms (server.hook_deadline_ceiling_ms)");
            self.problem(None, "server.hook_deadline_ms", message);
        }
        // 0 is off, as is no setting.
        let busy_poll_us = s.busy_poll_us.filter(|us| *us > 0);
        if let Some(us) = busy_poll_us {
            if us > BUSY_POLL_MAX_US {
                let message = format!("{us} µs is above the limit of {} µs", BUSY_POLL_MAX_US);
                self.problem(None, "server.busy_poll_us", message);
            }
            // (worker_threads = 0 is refused above.)
            if !matches!(s.worker_threads, Some(0 | 1)) {
                let message = "needs server.worker_threads = 1 (it polls on the one thread that serves everything)";
                self.problem(None, "server.busy_poll_us", message);
            }
        }
        let auth = self.auth(s.auth, tls.as_ref());
        let audit_key = s
            .audit_key_env
            .as_ref()
            .map(|v| AuditKey(self.secret(v, "server.audit_key_env", "the audit record's HMAC key")));
        ServerSettings {
            listen,
            admin_listen,
            health_listen,
            tls,
            max_concurrent_queries: s.max_concurrent_queries.unwrap_or(defaults::MAX_CONCURRENT_QUERIES).max(1),
            max_message_bytes: s.max_message_bytes.unwrap_or(defaults::MAX_MESSAGE_BYTES).max(1),
            hook_max_message_bytes: s.hook_max_message_bytes.unwrap_or(defaults::PEER_MAX_MESSAGE_BYTES).max(1),
            tool_max_message_bytes: s.tool_max_message_bytes.unwrap_or(defaults::PEER_MAX_MESSAGE_BYTES).max(1),
            hook_deadline_ceiling: ms(ceiling),
            query_deadline: ms(s.query_deadline_ms.unwrap_or(defaults::QUERY_DEADLINE_MS)),
            max_delegation_depth: s.max_delegation_depth.unwrap_or(defaults::MAX_DELEGATION_DEPTH),
            tool_discovery_timeout: ms(s.tool_discovery_timeout_ms.unwrap_or(defaults::TOOL_DISCOVERY_TIMEOUT_MS)),
            trace_dir: s.trace_dir,
            trace_queue_events: s.trace_queue_events.unwrap_or(4096).max(1),
            trace_max_file_bytes: s.trace_max_file_bytes.unwrap_or(64 << 20).max(1),
            trace_max_age: Duration::from_secs(s.trace_max_age_s.unwrap_or(7 * 24 * 3600)),
            audit_key,
            drain: ms(s.drain_ms.unwrap_or(0)),
            peer_health_check: Some(s.peer_health_check_ms.unwrap_or(defaults::PEER_HEALTH_CHECK_MS))
                .filter(|v| *v > 0)
                .map(ms),
            worker_threads: s.worker_threads,
            busy_poll: busy_poll_us.map(Duration::from_micros),
            auth,
            limits: LimitSettings {
                queries_in_flight: s.limits.queries_in_flight,
                queries_per_minute: s.limits.queries_per_minute,
            },
            hook_default_deadline: ms(s.hook_deadline_ms.unwrap_or(defaults::HOOK_DEADLINE_MS).min(ceiling)),
        }
    }

    fn server_tls(&mut self, raw: Spanned<RawServerTls>) -> TlsSettings {
        let span = raw.span();
        let raw = raw.into_inner();
        let mut file = |f: Option<String>, key: &str| match f {
            Some(f) => self.dir.join(f),
            None => {
                self.problem(
                    Some(span.clone()),
                    format!("server.tls.{key}"),
                    "missing: [server.tls] needs a cert_file and a key_file",
                );
                PathBuf::new()
            }
        };
        let settings = TlsSettings {
            cert_file: file(raw.cert_file, "cert_file"),
            key_file: file(raw.key_file, "key_file"),
            client_ca_file: raw.client_ca_file.map(|f| self.dir.join(f)),
        };
        if settings.cert_file.as_os_str().is_empty() || settings.key_file.as_os_str().is_empty() {
            return settings;
        }
        let files = [Some(&settings.cert_file), Some(&settings.key_file), settings.client_ca_file.as_ref()];
        let missing: Vec<String> =
            files.into_iter().flatten().filter(|f| !f.exists()).map(|f| f.display().to_string()).collect();
        if !missing.is_empty() && self.secrets == Secrets::Optional {
            // check-config: like an API key, a mounted Secret is needed to
            // serve, not to check.
            let line = Some(line_of(self.text, span.start));
            let message = format!("{} not found (serving needs them: a mounted Secret?)", missing.join(", "));
            self.warnings.push(Problem { line, field: "server.tls".into(), message });
        } else if let Err(e) = self.checks.server_tls(&settings) {
            self.problem(Some(span), "server.tls", e);
        }
        settings
    }

    fn auth(&mut self, auth: Option<Spanned<RawAuth>>, tls: Option<&TlsSettings>) -> AuthSettings {
        let Some(auth) = auth else {
            // Secure by default: running open must be said.
            self.problem(
                None,
                "server.auth",
                "missing: add [server.auth] with mode = \"mtls\" (client certificates), \"token\" (bearer tokens), or \
                 mode = \"none\" to let \
                 every client run every agent and read every session",
            );
            return AuthSettings::default();
        };
        let span = auth.span();
        let raw = auth.into_inner();
        let mode = match raw.mode.as_ref().map(|m| m.get_ref().as_str()) {
            Some("none") => AuthMode::None,
            Some("mtls") => {
                if tls.is_none_or(|t| t.client_ca_file.is_none()) {
                    self.problem(
                        Some(span.clone()),
                        "server.auth.mode",
                        "mode \"mtls\" needs [server.tls] with a client_ca_file (the CA of client certificates)",
                    );
                }
                AuthMode::Mtls
            }
            Some("token") => match &raw.tokens_file {
                Some(file) => AuthMode::Token { tokens_file: self.dir.join(file) },
                None => {
                    self.problem(Some(span), "server.auth.tokens_file", "mode \"token\" needs a tokens_file");
                    AuthMode::None
                }
            },
            Some(other) => {
                let span = raw.mode.as_ref().map(|m| m.span());
                self.problem(
                    span,
                    "server.auth.mode",
                    format!("{other:?} is not a mode: \"mtls\", \"token\" or \"none\""),
                );
                AuthMode::None
            }
            None => {
                self.problem(Some(span), "server.auth.mode", "set it: \"mtls\", \"token\", or \"none\" to run open");
                AuthMode::None
            }
        };
        if let AuthMode::Token { tokens_file } = &mode
            && let Err(e) = self.checks.tokens_file(tokens_file)
        {
            self.problem(None, "server.auth.tokens_file", e);
        }
        let admins = expand_groups(&raw.admins, &raw.groups).unwrap_or_else(|unknown| {
            self.problem(None, "server.auth.admins", unknown_group(&unknown));
            Vec::new()
        });
        AuthSettings { mode, admins, groups: raw.groups }
    }

    fn telemetry(&mut self, t: RawTelemetry) -> TelemetrySettings {
        if let Some(e) = &t.otlp_endpoint
            && !(e.get_ref().starts_with("http://") || e.get_ref().starts_with("https://"))
        {
            self.problem(Some(e.span()), "telemetry.otlp_endpoint", "an OTLP/gRPC URL like http://otel-collector:4317");
        }
        if let Some(r) = &t.sampling_ratio
            && !(0.0..=1.0).contains(r.get_ref())
        {
            self.problem(Some(r.span()), "telemetry.sampling_ratio", "a fraction from 0.0 to 1.0");
        }
        TelemetrySettings {
            otlp_endpoint: t.otlp_endpoint.map(Spanned::into_inner),
            service_name: t.service_name,
            sampling_ratio: t.sampling_ratio.map(Spanned::into_inner),
        }
    }

    fn sessions(&mut self, s: RawSessions) -> SessionSettings {
        for (v, f) in [
            (s.lease_ttl_ms, "sessions.lease_ttl_ms"),
            (s.idle_ttl_s, "sessions.idle_ttl_s"),
            (s.max_sessions.map(|v| v as u64), "sessions.max_sessions"),
            (s.pool_size.map(|v| v as u64), "sessions.pool_size"),
            (s.store_timeout_ms, "sessions.store_timeout_ms"),
        ] {
            if v == Some(0) {
                self.problem(None, f, "must be at least 1");
            }
        }
        let exit_if_unreachable = match s.on_unreachable.as_ref().map(|o| (o.get_ref().as_str(), o.span())) {
            None | Some(("wait", _)) => false,
            Some(("exit", _)) => true,
            Some((other, span)) => {
                let message = format!("{other:?}: expected \"wait\" (serve NOT_SERVING and retry) or \"exit\"");
                self.problem(Some(span), "sessions.on_unreachable", message);
                false
            }
        };
        let migrate = match s.migrate.as_ref().map(|m| (m.get_ref().as_str(), m.span())) {
            None | Some(("auto", _)) => true,
            Some(("never", _)) => false,
            Some((other, span)) => {
                let message = format!(
                    "{other:?}: expected \"auto\" (bring the schema up to date at start-up) or \"never\" \
                     (`lattice migrate` does)"
                );
                self.problem(Some(span), "sessions.migrate", message);
                true
            }
        };
        let store = match s.store.as_ref().map(|v| (v.get_ref().as_str(), v.span())) {
            None | Some(("memory", _)) => {
                if let Some(var) = &s.url_env {
                    self.problem(Some(var.span()), "sessions.url_env", "only the postgres store takes a URL");
                }
                if let Some(mib) = &s.history_cache_mib {
                    let why = "only the postgres store keeps a cache (the memory store holds every conversation)";
                    self.problem(Some(mib.span()), "sessions.history_cache_mib", why);
                }
                StoreSettings::Memory
            }
            Some(("postgres", span)) => {
                let url_env = match &s.url_env {
                    Some(var) => var.clone(),
                    None => Spanned::new(span, "LATTICE_POSTGRES_URL".to_owned()),
                };
                let url = self.secret(&url_env, "sessions.url_env", "the PostgreSQL connection string");
                StoreSettings::Postgres(PostgresSettings {
                    url_env: url_env.into_inner(),
                    url,
                    pool_size: s.pool_size.unwrap_or(defaults::POSTGRES_POOL_SIZE).max(1),
                    exit_if_unreachable,
                    history_cache_bytes: s
                        .history_cache_mib
                        .as_ref()
                        .map_or(defaults::HISTORY_CACHE_MIB, |m| *m.get_ref())
                        .saturating_mul(1024 * 1024),
                    store_timeout: ms(s.store_timeout_ms.unwrap_or(defaults::STORE_TIMEOUT_MS).max(1)),
                    migrate,
                    prepared_statements: s.prepared_statements.unwrap_or(true),
                })
            }
            Some((other, span)) => {
                let message = format!("unknown store {other:?} (known: \"memory\", \"postgres\")");
                self.problem(Some(span), "sessions.store", message);
                StoreSettings::Memory
            }
        };
        SessionSettings {
            store,
            lease_ttl: ms(s.lease_ttl_ms.unwrap_or(defaults::LEASE_TTL_MS).max(1)),
            idle_ttl: Duration::from_secs(s.idle_ttl_s.unwrap_or(defaults::IDLE_TTL_S).max(1)),
            max_sessions: s.max_sessions.unwrap_or(defaults::MAX_SESSIONS).max(1),
        }
    }

    /// The value of the environment variable `var` names: a secret, never
    /// printed. Unset: a problem for `serve`, a warning for `check-config`.
    fn secret(&mut self, var: &Spanned<String>, field: &str, what: &str) -> String {
        match (self.env)(var.get_ref()) {
            Some(value) if !value.trim().is_empty() => value.trim().to_owned(),
            _ => {
                let message = format!("environment variable {:?} is not set ({what})", var.get_ref());
                match self.secrets {
                    Secrets::Required => self.problem(Some(var.span()), field, message),
                    // check-config: the value is needed to serve, not to check.
                    Secrets::Optional => {
                        let line = Some(line_of(self.text, var.span().start));
                        let message = format!("{message} (serving needs it)");
                        self.warnings.push(Problem { line, field: field.to_owned(), message });
                    }
                }
                String::new()
            }
        }
    }

    fn agent(&mut self, i: usize, a: RawAgent, agents: &HashSet<String>, server: &ServerSettings) -> AgentDef {
        let at = |f: &str| format!("agents[{i}].{f}");
        let name = a.name.get_ref().clone();
        if !valid_name(&name) {
            self.problem(Some(a.name.span()), at("name"), "must be 1-64 letters, digits, '_' or '-'");
        }
        let model_span = a.model.span();
        let model = self.model(i, a.model.into_inner(), model_span);
        let max_turns = self.positive(&a.max_turns, &at("max_turns"), defaults::MAX_TURNS);
        let parallel_tool_calls =
            self.positive(&a.parallel_tool_calls, &at("parallel_tool_calls"), defaults::PARALLEL_TOOL_CALLS);
        let max_tool_calls_per_turn = self.positive(
            &a.max_tool_calls_per_turn,
            &at("max_tool_calls_per_turn"),
            defaults::MAX_TOOL_CALLS_PER_TURN,
        );

        let mut tool_names: HashSet<String> = HashSet::new();
        let mut tool_sources = Vec::new();
        for (j, t) in a.tools.into_iter().enumerate() {
            let f = at(&format!("tools[{j}]"));
            let tls = self.endpoint(&t.endpoint, t.tls, &f);
            if t.deadline_ms == Some(0) {
                self.problem(Some(t.endpoint.span()), format!("{f}.deadline_ms"), "must be at least 1");
            }
            let declared = t.declare.map(|decls| {
                decls
                    .into_iter()
                    .map(|d| {
                        if !valid_name(&d.name) {
                            self.problem(
                                Some(t.endpoint.span()),
                                format!("{f}.declare.name"),
                                format!("{:?}: must be 1-64 letters, digits, '_' or '-'", d.name),
                            );
                        }
                        if !tool_names.insert(d.name.clone()) {
                            self.problem(
                                Some(t.endpoint.span()),
                                format!("{f}.declare.name"),
                                format!("duplicate tool name {:?}", d.name),
                            );
                        }
                        let mut schema = table_to_object(d.input_schema);
                        schema.entry("type").or_insert_with(|| Value::from("object"));
                        ToolSpec { name: d.name, description: d.description, input_schema: schema }
                    })
                    .collect()
            });
            tool_sources.push(ToolSourceDef {
                endpoint: t.endpoint.into_inner(),
                tls,
                deadline: ms(t.deadline_ms.unwrap_or(defaults::TOOL_DEADLINE_MS).max(1)),
                only: t.only,
                declared,
            });
        }

        let mut delegates = Vec::new();
        for (j, d) in a.delegates.into_iter().enumerate() {
            let f = at(&format!("delegates[{j}].agent"));
            let target = d.agent.get_ref();
            if target == &name {
                self.problem(Some(d.agent.span()), &f, "an agent cannot delegate to itself");
            } else if !agents.contains(target) {
                self.problem(Some(d.agent.span()), &f, format!("no agent named {target:?}"));
            }
            let tool_name = d.tool_name.unwrap_or_else(|| target.clone());
            if !valid_name(&tool_name) || !tool_names.insert(tool_name.clone()) {
                self.problem(Some(d.agent.span()), &f, format!("tool name {tool_name:?} is invalid or already used"));
            }
            delegates.push(DelegateDef {
                agent: d.agent.into_inner(),
                tool_name,
                description: d.description,
                deadline: ms(d.deadline_ms.unwrap_or(defaults::QUERY_DEADLINE_MS).max(1)),
            });
        }

        let mut hook_names = HashSet::new();
        let mut hooks = Vec::new();
        for (j, h) in a.hooks.into_iter().enumerate() {
            let f = |x: &str| at(&format!("hooks[{j}].{x}"));
            if !valid_name(h.name.get_ref()) {
                self.problem(Some(h.name.span()), f("name"), "must be 1-64 letters, digits, '_' or '-'");
            }
            if !hook_names.insert(h.name.get_ref().clone()) {
                self.problem(Some(h.name.span()), f("name"), format!("duplicate hook name {:?}", h.name.get_ref()));
            }
            let tls = self.endpoint(&h.endpoint, h.tls, &at(&format!("hooks[{j}]")));
            let mut events = HookEvents::default();
            for e in h.events.get_ref() {
                let seen = match e.as_str() {
                    "tool_result" => Some(std::mem::replace(&mut events.tool_result, true)),
                    "model_request" => Some(std::mem::replace(&mut events.model_request, true)),
                    _ => None,
                };
                match (e.as_str(), seen) {
                    (_, Some(true)) => {
                        self.problem(Some(h.events.span()), f("events"), format!("event {e:?} is listed twice"))
                    }
                    (_, Some(false)) => {}
                    (other, None) => self.problem(
                        Some(h.events.span()),
                        f("events"),
                        format!("unknown event {other:?} (expected \"tool_result\" or \"model_request\")"),
                    ),
                }
            }
            if h.events.get_ref().is_empty() {
                self.problem(Some(h.events.span()), f("events"), "name at least one event");
            }
            let deadline = match &h.deadline_ms {
                Some(d) if *d.get_ref() == 0 => {
                    self.problem(Some(d.span()), f("deadline_ms"), "must be at least 1");
                    server.hook_default_deadline
                }
                Some(d) if ms(*d.get_ref()) > server.hook_deadline_ceiling => {
                    let ceiling = server.hook_deadline_ceiling.as_millis();
                    let message = format!(
                        "{} ms is above the ceiling of {ceiling} ms (server.hook_deadline_ceiling_ms)",
                        d.get_ref()
                    );
                    self.problem(Some(d.span()), f("deadline_ms"), message);
                    server.hook_deadline_ceiling
                }
                Some(d) => ms(*d.get_ref()),
                None => server.hook_default_deadline,
            };
            hooks.push(HookDef {
                name: h.name.into_inner(),
                endpoint: h.endpoint.into_inner(),
                tls,
                events,
                deadline,
                enabled: h.enabled,
                required: h.required,
            });
        }

        AgentDef {
            name,
            description: a.description,
            system_prompt: a.system_prompt.into(),
            model,
            max_turns,
            parallel_tool_calls,
            max_tool_calls_per_turn,
            permissions: Permissions { allow: a.allow, deny: a.deny },
            tool_sources,
            delegates,
            hooks,
            principals: a.principals.map(|p| {
                expand_groups(&p, &server.auth.groups).unwrap_or_else(|unknown| {
                    self.problem(None, at("principals"), unknown_group(&unknown));
                    Vec::new()
                })
            }),
        }
    }

    fn model(&mut self, i: usize, m: RawModel, span: std::ops::Range<usize>) -> ModelConfig {
        let at = |f: &str| format!("agents[{i}].model.{f}");
        let provider = match m.provider.get_ref().as_str() {
            "scripted" => None,
            "anthropic" => Some(Provider::Anthropic),
            "openai" => Some(Provider::OpenAi),
            other => {
                self.problem(
                    Some(m.provider.span()),
                    at("provider"),
                    format!("unknown provider {other:?} (known: \"scripted\", \"anthropic\", \"openai\")"),
                );
                None
            }
        };
        if let Some(provider) = provider {
            return ModelConfig::Http(self.http_model(i, provider, m, span));
        }
        let mut script = Vec::new();
        for (j, t) in m.script.into_iter().enumerate() {
            let stop_reason = match t.stop_reason.as_deref() {
                None => None,
                Some("end_turn") => Some(StopReason::EndTurn),
                Some("tool_use") => Some(StopReason::ToolUse),
                Some("max_tokens") => Some(StopReason::MaxTokens),
                Some("stop_sequence") => Some(StopReason::StopSequence),
                Some(other) => {
                    self.problem(
                        Some(span.clone()),
                        at(&format!("script[{j}].stop_reason")),
                        format!("unknown stop reason {other:?}"),
                    );
                    None
                }
            };
            script.push(ScriptTurn {
                text: t.text,
                tool_calls: t.tool_calls.into_iter().map(|c| (c.name, table_to_object(c.input))).collect(),
                delay: ms(t.delay_ms),
                stop_reason,
            });
        }
        ModelConfig::Scripted { name: if m.name.is_empty() { "default".into() } else { m.name }, script }
    }

    fn http_model(
        &mut self,
        i: usize,
        provider: Provider,
        m: RawModel,
        span: std::ops::Range<usize>,
    ) -> HttpModelConfig {
        let at = |f: &str| format!("agents[{i}].model.{f}");
        if m.name.is_empty() {
            self.problem(Some(span.clone()), at("name"), "name the model (e.g. \"claude-sonnet-4-5\" or \"gpt-4o\")");
        }
        if !m.script.is_empty() {
            self.problem(Some(span.clone()), at("script"), "a script is for the scripted provider only");
        }
        let default_base = match provider {
            Provider::Anthropic => "https://api.anthropic.com",
            Provider::OpenAi => "https://api.openai.com",
        };
        let base_url = match &m.base_url {
            Some(b) => {
                let ok = reqwest::Url::parse(b.get_ref())
                    .is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some());
                if !ok {
                    self.problem(
                        Some(b.span()),
                        at("base_url"),
                        format!("{:?} is not an http:// or https:// URL", b.get_ref()),
                    );
                }
                b.get_ref().trim_end_matches('/').to_owned()
            }
            None => default_base.to_owned(),
        };
        let (api_key_env, api_key) = match &m.api_key_env {
            None => {
                self.problem(
                    Some(span.clone()),
                    at("api_key_env"),
                    "name the environment variable that holds the API key",
                );
                (String::new(), String::new())
            }
            Some(var) => (var.get_ref().clone(), self.secret(var, &at("api_key_env"), "the API key")),
        };
        if m.max_tokens == Some(0) || m.deadline_ms == Some(0) {
            self.problem(Some(span.clone()), at("max_tokens / deadline_ms"), "must be at least 1");
        }
        if m.temperature.is_some_and(|t| !(0.0..=2.0).contains(&t)) {
            self.problem(Some(span), at("temperature"), "must be between 0 and 2");
        }
        HttpModelConfig {
            provider,
            model: m.name,
            base_url,
            api_key_env,
            api_key,
            max_tokens: m.max_tokens.unwrap_or(defaults::MODEL_MAX_TOKENS).max(1),
            temperature: m.temperature,
            deadline: ms(m.deadline_ms.unwrap_or(defaults::MODEL_DEADLINE_MS).max(1)),
            retries: m.retries.unwrap_or(defaults::MODEL_RETRIES),
            stream: m.stream.unwrap_or(true),
        }
    }

    /// Delegation must form no cycle: a cycle would recurse until the depth
    /// limit on every query, so it is refused here.
    fn cycles(&mut self, agents: &[AgentDef], spans: &[std::ops::Range<usize>]) {
        let edges: HashMap<&str, Vec<&str>> =
            agents.iter().map(|a| (a.name.as_str(), a.delegates.iter().map(|d| d.agent.as_str()).collect())).collect();
        for (i, a) in agents.iter().enumerate() {
            // Depth-first search from each agent for a path back to itself.
            let mut stack: Vec<Vec<&str>> = vec![vec![a.name.as_str()]];
            let mut visited = HashSet::new();
            while let Some(path) = stack.pop() {
                let Some(&last) = path.last() else { continue };
                for next in edges.get(last).into_iter().flatten() {
                    if *next == a.name && path.len() > 1 {
                        let cycle = path.join(" -> ") + " -> " + next;
                        self.problem(
                            Some(spans[i].clone()),
                            format!("agents[{i}].delegates"),
                            format!("delegation cycle: {cycle}"),
                        );
                        return;
                    }
                    if visited.insert(*next) {
                        let mut p = path.clone();
                        p.push(next);
                        stack.push(p);
                    }
                }
            }
        }
    }
}

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}
