//! The validated, typed config: what the rest of the server reads; and a
//! refused config's problems.

use std::{fmt, net::SocketAddr, path::PathBuf, time::Duration};

use super::{LimitSettings, TelemetrySettings, Tls, TlsSettings};
use crate::domain::{JsonObject, StopReason, ToolSpec};

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
    /// The environment variable the URL was read from (unless `url_file`).
    pub url_env: String,
    /// The file the URL was read from, read again for each new connection
    /// (a rotated password needs no restart).
    pub url_file: Option<std::path::PathBuf>,
    /// The connection string (never printed: see `Debug`).
    pub url: String,
    /// Pooled connections per replica (reads, deletes, sweeps, health,
    /// and queries' statements when none are pipelined).
    pub pool_size: usize,
    /// Connections per replica that every query's own statements (its
    /// lease, renewals, commit, release) share, several in flight on each
    /// (PostgreSQL's pipelining); 0: each statement takes a pooled one.
    pub pipeline_connections: usize,
    /// Refuse to start when the database can't be reached (instead of
    /// serving NOT_SERVING and retrying).
    pub exit_if_unreachable: bool,
    /// Bytes of conversations this replica keeps, so that taking a lease
    /// reads only the messages committed since (0: none kept).
    pub history_cache_bytes: usize,
    /// How long a replica keeps a session's lease after a query, so that
    /// the session's next query on it takes no lease statement (zero: the
    /// lease is released at each commit).
    pub keep_lease: Duration,
    /// How long any statement but a query's lease and commit may wait for
    /// the database (renewals, releases, reads, deletes, sweeps, health).
    pub store_timeout: Duration,
    /// Whether start-up brings the schema up to date (else it only checks
    /// that the schema is the one this build knows).
    pub migrate: bool,
    /// Whether statements are prepared once per connection and cached,
    /// until the database shows it does not keep them (else sent unnamed
    /// with their types from the start: PgBouncer's transaction pooling
    /// before 1.21 carries no prepared statement).
    pub prepared_statements: bool,
}

impl PostgresSettings {
    /// Where the connection string comes from, for messages.
    pub fn url_source(&self) -> String {
        match &self.url_file {
            Some(path) => format!("the file {}", path.display()),
            None => format!("the environment variable {}", self.url_env),
        }
    }
}

impl fmt::Debug for PostgresSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresSettings")
            .field("url_env", &self.url_env)
            .field("url_file", &self.url_file)
            .field("url", &"<redacted>")
            .field("pool_size", &self.pool_size)
            .field("pipeline_connections", &self.pipeline_connections)
            .field("exit_if_unreachable", &self.exit_if_unreachable)
            .field("history_cache_bytes", &self.history_cache_bytes)
            .field("keep_lease", &self.keep_lease)
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
    /// while a hook or tool call, or a query's session store statement, is
    /// in flight (`server.busy_poll_us`, see [`crate::busy_poll`]); `None`:
    /// it sleeps.
    pub busy_poll: Option<Duration>,
    /// Whether the small writes of Lattice's connections (API, hooks,
    /// tools) are gathered into fewer (`server.gather_writes`, see
    /// `lattice_net`).
    pub gather_writes: bool,
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
    /// (every query of the agent would abort). Never for a shadow hook.
    pub required: bool,
    /// Which values it is called for (`tools`, `min_messages`).
    pub conditions: MatchConditions,
    /// A shadow hook: the hook whose calls it receives too (`shadow_of`).
    pub shadow_of: Option<String>,
}

impl HookDef {
    /// Whether its conditions let it see `tool`'s results.
    pub fn matches_tool(&self, tool: &str) -> bool {
        self.conditions.matches_tool(tool)
    }
}

/// A hook entry's match conditions; the default lets every value through.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MatchConditions {
    /// OnToolResult only for these tools' results (`tools`); `None`: every
    /// tool's.
    pub tools: Option<Vec<String>>,
    /// OnModelRequest only for requests of at least this many messages
    /// (`min_messages`); 0: every request.
    pub min_messages: usize,
}

impl MatchConditions {
    /// Whether they let a hook see `tool`'s results.
    pub fn matches_tool(&self, tool: &str) -> bool {
        self.tools.as_ref().is_none_or(|tools| tools.iter().any(|t| t == tool))
    }

    /// Whether they let a hook see a request of `messages` messages.
    pub fn matches_request(&self, messages: usize) -> bool {
        messages >= self.min_messages
    }
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
