//! The config file: TOML → raw serde structs → a validated, typed config.
//!
//! Only a TOML syntax error stops the reading (the parser reports it with
//! its line). After that every problem is collected and reported, each with
//! file, line and field path (`agents[0].hooks[1].endpoint`), so that one run
//! of `lattice check-config` shows all there is to fix: unknown keys (with a
//! "did you mean" for near misses, see `document`), values of the wrong
//! type (each reported and left out, and reading goes on), and every rule
//! the validator checks.
//!
//! `raw` holds the serde structs and each table's known keys; `document`
//! walks the file for unknown keys and spans; `validate` (with `server`
//! and `agents`) turns raw into `types`, the typed config the server reads;
//! `settings` the settings types of features in higher layers. Checks that
//! read files or parse as the transport does are injected ([`Checks`]).

use std::{net::SocketAddr, path::Path};

mod document;
mod raw;
mod settings;
#[cfg(test)]
mod tests;
mod types;
mod validate;
pub use settings::{BUSY_POLL_MAX_US, LimitSettings, TelemetrySettings, Tls, TlsFiles, TlsSettings};
pub use types::*;
use validate::{Secrets, parse_with};

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
    /// `sessions.pipeline_connections`.
    pub const PIPELINE_CONNECTIONS: usize = 2;
    /// MiB of conversations a replica keeps (PostgreSQL store).
    pub const HISTORY_CACHE_MIB: usize = 32;
    /// `sessions.store_timeout_ms`.
    pub const STORE_TIMEOUT_MS: u64 = 5_000;
}

// ------------------------------------------------------------ loading ----

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

/// `server.admin_listen` (and `--admin-listen`): an address, or "off".
/// `None` inside: malformed.
pub fn parse_admin_listen(value: &str) -> Option<Option<SocketAddr>> {
    match value {
        "off" => Some(None),
        addr => addr.parse().ok().map(Some),
    }
}
