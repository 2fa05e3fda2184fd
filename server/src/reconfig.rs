//! The running configuration, and changing it without a restart.
//!
//! `lattice serve` re-reads its config file on SIGHUP and when the file's
//! bytes change (checked every [`CHECK_EVERY`]; a Kubernetes ConfigMap
//! mounted as a directory is swapped through a symlink, which reading the
//! path follows). The whole file is validated as `check-config` does:
//!
//! - invalid: the running config stays, and every problem is logged with
//!   its line (`result = "invalid"`);
//! - valid: agents, hook chains (with their conditions and shadows), tools,
//!   models, deadlines and the hook and tool message limits are swapped at
//!   once (`ok`). Settings that need a restart (the listen addresses, the
//!   API's TLS files, `[sessions]`, `[telemetry]`, the worker threads and
//!   the rest named in `keep_running`) keep their running values;
//!   when one of them changed, the reload says which (`restart_needed`) and
//!   the rest is applied.
//!
//! A query runs on the runtime it started with, start to finish
//! ([`Live::current`] at its start), while new queries take the new one;
//! each agent's chain has a version ([`crate::audit::chain_version`]) that
//! says which chain a query ran on. Every reload is counted in
//! `lattice_config_reloads_total{result}`.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
    time::Duration,
};

use tracing::{info, warn};

use crate::{
    agent::Runtime,
    config::{self, Config, StoreSettings},
    metrics::Family,
};

/// How often the config file is compared with what was last read.
pub const CHECK_EVERY: Duration = Duration::from_secs(1);

/// The running runtime and the config it was built from.
#[derive(Debug)]
pub struct Live {
    runtime: RwLock<Arc<Runtime>>,
    /// The config in force (the file's, with the command line's overrides
    /// and the running values of what needs a restart).
    config: RwLock<Config>,
    /// The config as the file last said it, which a reload's changes are
    /// told against (the command line's overrides are no change).
    file: RwLock<Option<Config>>,
}

/// What a reload did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reloaded {
    /// Applied.
    Ok,
    /// Applied, but these settings keep their running values until a
    /// restart.
    RestartNeeded(Vec<&'static str>),
    /// Not applied: the file is not valid (or its agents could not be set
    /// up); the running config stays.
    Invalid,
}

impl Reloaded {
    fn result(&self) -> &'static str {
        match self {
            Reloaded::Ok => "ok",
            Reloaded::RestartNeeded(_) => "restart_needed",
            Reloaded::Invalid => "invalid",
        }
    }
}

impl Live {
    /// `runtime`, built from `config`.
    pub fn new(runtime: Arc<Runtime>, config: Config) -> Live {
        Live { runtime: RwLock::new(runtime), config: RwLock::new(config), file: RwLock::new(None) }
    }

    /// The runtime new queries run on: a query keeps the one it got.
    pub fn current(&self) -> Arc<Runtime> {
        crate::sync::read(&self.runtime).clone()
    }

    /// Reads `path` again and applies it (see the module docs).
    pub async fn reload(&self, path: &Path) -> Reloaded {
        let reloaded = self.reload_from(path).await;
        let runtime = self.current();
        runtime.metrics.count(Family::ConfigReloads, vec![("result", reloaded.result().to_owned())]);
        reloaded
    }

    async fn reload_from(&self, path: &Path) -> Reloaded {
        let mut new = match config::load(path, &crate::CHECKS) {
            Ok(config) => config,
            Err(e) => {
                for p in &e.problems {
                    warn!(line = p.line.unwrap_or(0), field = %p.field, problem = %p.message, "config reload: invalid; the running config stays");
                }
                return Reloaded::Invalid;
            }
        };
        let running = crate::sync::read(&self.config).clone();
        let file = crate::sync::read(&self.file).clone().unwrap_or_else(|| running.clone());
        let as_read = new.clone();
        let changed = keep_running(&file, &running, &mut new);
        let runtime = match self.current().reconfigured(&new).await {
            Ok(runtime) => Arc::new(runtime),
            Err(e) => {
                warn!(error = %e, "config reload: its agents could not be set up; the running config stays");
                return Reloaded::Invalid;
            }
        };
        let versions: Vec<String> = runtime.agents().map(|a| format!("{}={}", a.def.name, a.hooks.version())).collect();
        *crate::sync::write(&self.runtime) = runtime;
        *crate::sync::write(&self.config) = new;
        *crate::sync::write(&self.file) = Some(as_read);
        if changed.is_empty() {
            info!(agents = %versions.join(" "), "config reloaded");
            Reloaded::Ok
        } else {
            warn!(agents = %versions.join(" "), restart_needed = %changed.join(", "), "config reloaded; these settings keep their running values until a restart");
            Reloaded::RestartNeeded(changed)
        }
    }
}

/// Puts the running values of the settings a reload can't change into
/// `new`; returns the names of those the file changed since `file`.
fn keep_running(file: &Config, running: &Config, new: &mut Config) -> Vec<&'static str> {
    let mut changed = Vec::new();
    // Compared by their debug form (only the setting's name is logged).
    // The debug form hides the audit key and the database URL: those two
    // are compared by value too.
    let mut keep = |name: &'static str, differs: bool| {
        if differs {
            changed.push(name);
        }
    };
    let (f, r, n) = (&file.server, &running.server, &mut new.server);
    macro_rules! server {
        ($($field:ident => $name:literal),* $(,)?) => {
            $(
                keep($name, format!("{:?}", f.$field) != format!("{:?}", n.$field));
                n.$field = r.$field.clone();
            )*
        };
    }
    server!(
        listen => "server.listen",
        admin_listen => "server.admin_listen",
        health_listen => "server.health_listen",
        tls => "server.tls",
        max_concurrent_queries => "server.max_concurrent_queries",
        max_message_bytes => "server.max_message_bytes",
        trace_dir => "server.trace_dir",
        trace_queue_events => "server.trace_queue_events",
        trace_max_file_bytes => "server.trace_max_file_bytes",
        trace_max_age => "server.trace_max_age_s",
        drain => "server.drain_ms",
        peer_health_check => "server.peer_health_check_ms",
        worker_threads => "server.worker_threads",
        busy_poll => "server.busy_poll_us",
        gather_writes => "server.gather_writes",
        auth => "server.auth",
        limits => "server.limits",
    );
    let key = |c: &Config| c.server.audit_key.as_ref().map(|k| k.0.clone());
    keep("server.audit_key_env", key(file) != key(new));
    new.server.audit_key = running.server.audit_key.clone();
    let url = |c: &Config| match &c.sessions.store {
        // A `url_file`'s string is read again for each new connection: a
        // change to it needs no restart.
        StoreSettings::Postgres(pg) if pg.url_file.is_none() => Some(pg.url.clone()),
        StoreSettings::Postgres(_) | StoreSettings::Memory => None,
    };
    let sessions = format!("{:?}", file.sessions) != format!("{:?}", new.sessions) || url(file) != url(new);
    keep("sessions", sessions);
    new.sessions = running.sessions.clone();
    keep("telemetry", format!("{:?}", file.telemetry) != format!("{:?}", new.telemetry));
    new.telemetry = running.telemetry.clone();
    changed
}

/// Reloads `path` on SIGHUP and when its bytes change, until `live` is
/// dropped. The SIGHUP handler is installed when this is called, before
/// the future runs: a SIGHUP right after start-up reloads, it does not end
/// the process.
pub fn follow(live: std::sync::Weak<Live>, path: PathBuf) -> impl std::future::Future<Output = ()> + Send {
    #[cfg(unix)]
    let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    let read = |p: &Path| std::fs::read(p).ok();
    let mut seen = read(&path);
    // What the file says now: a reload's changes are told against it.
    if let (Some(live), Ok(file)) = (live.upgrade(), config::load(&path, &crate::CHECKS)) {
        *crate::sync::write(&live.file) = Some(file);
    }
    async move {
        loop {
            #[cfg(unix)]
            let signalled = async {
                match hangup.as_mut() {
                    Some(h) => h.recv().await.is_some(),
                    None => std::future::pending().await,
                }
            };
            #[cfg(not(unix))]
            let signalled = std::future::pending::<bool>();
            let by_signal = tokio::select! {
                s = signalled => s,
                () = tokio::time::sleep(CHECK_EVERY) => false,
            };
            let now = read(&path);
            // A file being replaced may be missing for a moment: the next
            // check reads it again.
            if !by_signal && (now.is_none() || now == seen) {
                continue;
            }
            let Some(live) = live.upgrade() else { return };
            info!(trigger = if by_signal { "SIGHUP" } else { "the file changed" }, "config reload");
            live.reload(&path).await;
            seen = now;
        }
    }
}
