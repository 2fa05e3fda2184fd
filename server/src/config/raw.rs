//! The config file as serde reads it: one raw struct per table, every
//! value optional where the validator gives a default, spans kept for the
//! lines of problems; and each table's shape (its known keys and child
//! tables), from which unknown keys are found.

use std::{collections::BTreeMap, path::PathBuf};

use serde::Deserialize;
use toml::Spanned;

use super::document::{Shape, fields_of};

#[derive(Debug, Default, Deserialize)]
pub(super) struct RawConfig {
    #[serde(default)]
    pub(super) server: RawServer,
    #[serde(default)]
    pub(super) sessions: RawSessions,
    #[serde(default)]
    pub(super) agents: Vec<RawAgent>,
    #[serde(default)]
    pub(super) telemetry: RawTelemetry,
}

/// `[telemetry]`: OpenTelemetry traces over OTLP.
#[derive(Debug, Default, Deserialize)]
pub(super) struct RawTelemetry {
    pub(super) otlp_endpoint: Option<Spanned<String>>,
    pub(super) service_name: Option<String>,
    pub(super) sampling_ratio: Option<Spanned<f64>>,
}

/// `[sessions]`: where conversations live.
#[derive(Debug, Default, Deserialize)]
pub(super) struct RawSessions {
    /// "memory" (default) or "postgres".
    pub(super) store: Option<Spanned<String>>,
    /// The environment variable holding the PostgreSQL connection string.
    pub(super) url_env: Option<Spanned<String>>,
    /// Or a file holding it, read again for each new connection.
    pub(super) url_file: Option<Spanned<String>>,
    pub(super) lease_ttl_ms: Option<u64>,
    pub(super) idle_ttl_s: Option<u64>,
    pub(super) max_sessions: Option<usize>,
    pub(super) pool_size: Option<usize>,
    /// PostgreSQL: connections that every query's own statements share,
    /// several in flight on each (0: each statement takes a pool
    /// connection to itself).
    pub(super) pipeline_connections: Option<usize>,
    /// PostgreSQL: MiB of conversations each replica keeps, so that a
    /// query reads only the messages committed since (0: none kept).
    pub(super) history_cache_mib: Option<Spanned<usize>>,
    /// PostgreSQL: how long a replica keeps a session's lease after a
    /// query, so that the session's next query on it takes none (0: off).
    pub(super) keep_lease_ms: Option<Spanned<u64>>,
    /// "wait" (default): serve NOT_SERVING and retry; "exit": refuse to start.
    pub(super) on_unreachable: Option<Spanned<String>>,
    /// PostgreSQL: how long any statement but a query's lease and commit
    /// may wait for the database (those have the query's deadline).
    pub(super) store_timeout_ms: Option<u64>,
    /// PostgreSQL: "auto" (default) brings the schema up to date at
    /// start-up; "never" only checks it (`lattice migrate` applies it).
    pub(super) migrate: Option<Spanned<String>>,
    /// PostgreSQL: prepare statements once per connection (default), or
    /// send them unnamed (PgBouncer's transaction pooling before 1.21).
    pub(super) prepared_statements: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RawServer {
    pub(super) listen: Option<Spanned<String>>,
    pub(super) admin_listen: Option<Spanned<String>>,
    pub(super) health_listen: Option<Spanned<String>>,
    pub(super) tls: Option<Spanned<RawServerTls>>,
    pub(super) max_concurrent_queries: Option<usize>,
    pub(super) max_message_bytes: Option<usize>,
    pub(super) hook_max_message_bytes: Option<usize>,
    pub(super) tool_max_message_bytes: Option<usize>,
    pub(super) hook_deadline_ms: Option<u64>,
    pub(super) hook_deadline_ceiling_ms: Option<u64>,
    pub(super) query_deadline_ms: Option<u64>,
    pub(super) max_delegation_depth: Option<u32>,
    pub(super) tool_discovery_timeout_ms: Option<u64>,
    pub(super) drain_ms: Option<u64>,
    pub(super) peer_health_check_ms: Option<u64>,
    pub(super) worker_threads: Option<usize>,
    pub(super) busy_poll_us: Option<u64>,
    pub(super) gather_writes: Option<bool>,
    pub(super) trace_dir: Option<PathBuf>,
    pub(super) trace_queue_events: Option<usize>,
    pub(super) trace_max_file_bytes: Option<u64>,
    pub(super) trace_max_age_s: Option<u64>,
    pub(super) audit_key_env: Option<Spanned<String>>,
    pub(super) auth: Option<Spanned<RawAuth>>,
    #[serde(default)]
    pub(super) limits: RawLimits,
}

/// `[server.limits]`: per principal.
#[derive(Debug, Default, Deserialize)]
pub(super) struct RawLimits {
    pub(super) queries_in_flight: Option<usize>,
    pub(super) queries_per_minute: Option<u32>,
}

/// `[server.tls]`: TLS on the API listener.
#[derive(Debug, Default, Deserialize)]
pub(super) struct RawServerTls {
    pub(super) cert_file: Option<String>,
    pub(super) key_file: Option<String>,
    pub(super) client_ca_file: Option<String>,
}

/// `[server.auth]`: who may call.
#[derive(Debug, Default, Deserialize)]
pub(super) struct RawAuth {
    /// "mtls", "token" or "none".
    pub(super) mode: Option<Spanned<String>>,
    /// Mode "token": lines `<principal> <sha256 hex of the token>`.
    pub(super) tokens_file: Option<String>,
    /// Principals that may use the admin RPCs (TestHooks).
    #[serde(default)]
    pub(super) admins: Vec<String>,
    /// Named sets of principals, used as `group:<name>` in `admins` and in
    /// an agent's `principals`.
    #[serde(default)]
    pub(super) groups: std::collections::BTreeMap<String, Vec<String>>,
}

#[derive(Debug, Deserialize)]
pub(super) struct RawAgent {
    pub(super) name: Spanned<String>,
    #[serde(default)]
    pub(super) description: String,
    #[serde(default)]
    pub(super) system_prompt: String,
    pub(super) model: Spanned<RawModel>,
    pub(super) max_turns: Option<Spanned<u32>>,
    pub(super) parallel_tool_calls: Option<Spanned<usize>>,
    pub(super) max_tool_calls_per_turn: Option<Spanned<usize>>,
    #[serde(default)]
    pub(super) allow: Vec<String>,
    #[serde(default)]
    pub(super) deny: Vec<String>,
    #[serde(default)]
    pub(super) tools: Vec<RawToolSource>,
    #[serde(default)]
    pub(super) delegates: Vec<RawDelegate>,
    #[serde(default)]
    pub(super) hooks: Vec<RawHook>,
    /// Who may query it (with `[server.auth]` on); unset: any principal.
    pub(super) principals: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
pub(super) struct RawModel {
    pub(super) provider: Spanned<String>,
    #[serde(default)]
    pub(super) name: String,
    #[serde(default)]
    pub(super) script: Vec<RawScriptTurn>,
    pub(super) base_url: Option<Spanned<String>>,
    pub(super) api_key_env: Option<Spanned<String>>,
    pub(super) max_tokens: Option<u32>,
    pub(super) temperature: Option<f64>,
    pub(super) deadline_ms: Option<u64>,
    pub(super) retries: Option<u32>,
    pub(super) stream: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub(super) struct RawScriptTurn {
    #[serde(default)]
    pub(super) text: Option<String>,
    #[serde(default)]
    pub(super) tool_calls: Vec<RawScriptCall>,
    #[serde(default)]
    pub(super) delay_ms: u64,
    #[serde(default)]
    pub(super) stop_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
pub(super) struct RawScriptCall {
    pub(super) name: String,
    #[serde(default)]
    pub(super) input: BTreeMap<String, toml::Value>,
}

#[derive(Debug, Deserialize)]
pub(super) struct RawToolSource {
    pub(super) endpoint: Spanned<String>,
    pub(super) tls: Option<Spanned<RawTls>>,
    pub(super) deadline_ms: Option<u64>,
    /// Offer only these of the discovered tools.
    pub(super) only: Option<Vec<String>>,
    /// Declare the tools here instead of discovering them with ListTools.
    pub(super) declare: Option<Vec<RawToolDecl>>,
}

#[derive(Debug, Deserialize)]
pub(super) struct RawToolDecl {
    pub(super) name: String,
    #[serde(default)]
    pub(super) description: String,
    #[serde(default)]
    pub(super) input_schema: BTreeMap<String, toml::Value>,
}

#[derive(Debug, Deserialize)]
pub(super) struct RawDelegate {
    pub(super) agent: Spanned<String>,
    pub(super) tool_name: Option<String>,
    #[serde(default)]
    pub(super) description: String,
    pub(super) deadline_ms: Option<u64>,
}

#[derive(Debug, Deserialize)]
pub(super) struct RawHook {
    pub(super) name: Spanned<String>,
    pub(super) endpoint: Spanned<String>,
    pub(super) tls: Option<Spanned<RawTls>>,
    pub(super) events: Spanned<Vec<String>>,
    pub(super) deadline_ms: Option<Spanned<u64>>,
    #[serde(default = "yes")]
    pub(super) enabled: bool,
    #[serde(default = "yes")]
    pub(super) required: bool,
    pub(super) tools: Option<Spanned<Vec<String>>>,
    pub(super) min_messages: Option<Spanned<u64>>,
    pub(super) shadow_of: Option<Spanned<String>>,
}

/// TLS to a tool or hook service. Paths are relative to the config file.
#[derive(Debug, Deserialize)]
pub(super) struct RawTls {
    /// The CA that signs the service's certificate (PEM); the system's roots
    /// when unset.
    pub(super) ca_file: Option<String>,
    /// The certificate (chain) Lattice presents, for mutual TLS (PEM).
    pub(super) cert_file: Option<String>,
    /// Its private key (PEM).
    pub(super) key_file: Option<String>,
    /// The name the service's certificate must carry, when it is not the
    /// endpoint's host.
    pub(super) server_name: Option<String>,
}

fn yes() -> bool {
    true
}

// Which tables sit under which keys (for the key check; see `document`).
pub(super) static ROOT: Shape = Shape { fields: fields_of::<RawConfig>, child: root_child };
pub(super) static SESSIONS: Shape = Shape { fields: fields_of::<RawSessions>, child: no_child };
pub(super) static TELEMETRY: Shape = Shape { fields: fields_of::<RawTelemetry>, child: no_child };
pub(super) static SERVER: Shape = Shape { fields: fields_of::<RawServer>, child: server_child };
pub(super) static SERVER_TLS: Shape = Shape { fields: fields_of::<RawServerTls>, child: no_child };
pub(super) static AUTH: Shape = Shape { fields: fields_of::<RawAuth>, child: no_child };
pub(super) static LIMITS: Shape = Shape { fields: fields_of::<RawLimits>, child: no_child };
pub(super) static AGENT: Shape = Shape { fields: fields_of::<RawAgent>, child: agent_child };
pub(super) static MODEL: Shape = Shape { fields: fields_of::<RawModel>, child: model_child };
pub(super) static SCRIPT_TURN: Shape = Shape { fields: fields_of::<RawScriptTurn>, child: script_turn_child };
pub(super) static SCRIPT_CALL: Shape = Shape { fields: fields_of::<RawScriptCall>, child: no_child };
pub(super) static TOOLS: Shape = Shape { fields: fields_of::<RawToolSource>, child: tools_child };
pub(super) static TOOL_DECL: Shape = Shape { fields: fields_of::<RawToolDecl>, child: no_child };
pub(super) static DELEGATE: Shape = Shape { fields: fields_of::<RawDelegate>, child: no_child };
pub(super) static HOOK: Shape = Shape { fields: fields_of::<RawHook>, child: tls_child };
pub(super) static TLS: Shape = Shape { fields: fields_of::<RawTls>, child: no_child };

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
