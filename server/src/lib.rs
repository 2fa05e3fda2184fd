//! Lattice: a gRPC service that runs LLM agents, with remote tools and a
//! chain of remote hooks that shape what reaches the model.
//!
//! # Layers
//! Imports point down only, and no two modules import each other however
//! indirectly: `tests/layers.rs` checks both on every test run.
//!
//! - **core**: [`domain`], [`convert`] (the server's own conversation
//!   types and their conversions to and from proto, the only place those
//!   meet); [`config`] (the config file → a validated, typed config; the
//!   checks that read files are injected, see [`CHECKS`]); [`grpc`] (status
//!   code names); [`metrics`], [`telemetry`].
//! - **transport**: [`peer`] (one HTTP/2 connection per tool or hook
//!   address, plaintext or TLS; pools, health, the retry rule); [`busy_poll`]
//!   (`server.busy_poll_us`, a poller the agent runtime owns); [`tls`] (the
//!   API listener's TLS material, reloaded). Below them, outside this
//!   crate, `lattice_net` (gathered writes, `server.gather_writes`).
//! - **runtime**: [`agent`] (the loop), [`hooks`] (the chain: order,
//!   deadlines, fail-closed), [`tools`], [`model`] (the trait and its
//!   providers), [`session`] (stored conversations, the lease), [`trace`],
//!   [`audit`], [`events`], [`scope`] (whose work a step is).
//! - **service**: [`service`] (the gRPC service), [`status`] (its one error
//!   → status mapping), [`auth`], [`limits`], [`health`], [`dryrun`].
//! - **binary**: [`client`] (`lattice query`), [`hookcheck`],
//!   [`example_tools`], [`logging`]; and this crate root, which wires them.
//!
//! [`run`] serves a validated config on a bound listener until `shutdown`
//! resolves; `main.rs` and the tests both call it.

pub mod agent;
pub mod audit;
pub mod auth;
pub mod busy_poll;
pub mod client;
pub mod config;
pub mod convert;
pub mod domain;
pub mod dryrun;
pub mod events;
pub mod example_tools;
pub mod grpc;
pub mod health;
pub mod hookcheck;
pub mod hooks;
pub mod limits;
pub mod logging;
pub mod metrics;
pub mod model;
pub mod peer;
pub mod reconfig;
pub mod reload;
pub mod scope;
pub mod service;
pub mod session;
pub mod status;
pub mod sync;
pub mod telemetry;
pub mod tls;
pub mod tools;
pub mod trace;

use std::{future::Future, sync::Arc};

use lattice_proto::agent::v1::agent_service_server::AgentServiceServer;
use tokio::net::TcpListener;
use tracing::{info, warn};

use crate::{
    agent::Runtime,
    config::{Config, StoreSettings},
    service::AgentSvc,
    session::{MemoryStore, PostgresStore, SchemaError, SessionStore},
};

/// The config's checks that need the layers above it (see
/// [`config::Checks`]): an endpoint as the transport parses it, TLS to a
/// peer as the transport will build it, the API listener's certificate and
/// key, and the tokens file.
#[derive(Debug, Clone, Copy, Default)]
pub struct FileChecks;

/// The checks `serve`, `check-config` and `migrate` validate a config with.
pub static CHECKS: FileChecks = FileChecks;

impl config::Checks for FileChecks {
    fn endpoint(&self, endpoint: &str) -> Result<(), String> {
        peer::Target::parse(endpoint).map(drop)
    }

    fn endpoint_tls(&self, endpoint: &str, tls: Option<&config::Tls>) -> Result<(), String> {
        peer::check(endpoint, tls)
    }

    fn server_tls(&self, settings: &config::TlsSettings) -> Result<(), String> {
        tls::ServerTls::load(settings).map(drop)
    }

    fn tokens_file(&self, path: &std::path::Path) -> Result<(), String> {
        auth::TokenTable::read(path).map(drop)
    }
}

/// Why the server stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Agents could not be set up (tool discovery, endpoints).
    #[error(transparent)]
    Setup(#[from] agent::SetupError),
    /// Reflection could not be built.
    #[error("reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    /// The session store could not be set up.
    #[error("session store: {0}")]
    Store(String),
    /// The transport failed.
    #[error("transport: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// `[server.auth]` could not be set up (the tokens file).
    #[error("auth: {0}")]
    Auth(String),
    /// `[server.tls]` could not be loaded.
    #[error("tls: {0}")]
    Tls(String),
    /// The health port could not be opened.
    #[error("health port {addr}: {source}")]
    Health {
        /// `server.health_listen`.
        addr: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The admin port could not be opened.
    #[error("admin port {addr}: {source}")]
    Admin {
        /// `server.admin_listen`.
        addr: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// Serves `config` on `listener` until `shutdown` resolves, then stops
/// accepting, reports NOT_SERVING, and lets in-flight queries finish.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    serve(config, None, listener, shutdown).await
}

/// [`run`] for a config read from `path`, which is read again on SIGHUP
/// and when it changes (see [`reconfig`]): `lattice serve`.
pub async fn run_reloading(
    config: Config,
    path: std::path::PathBuf,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    serve(config, Some(path), listener, shutdown).await
}

async fn serve(
    config: Config,
    path: Option<std::path::PathBuf>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    // Opened first: a port that can't be had stops start-up at once.
    let admin = match config.server.admin_listen {
        Some(addr) => Some(TcpListener::bind(addr).await.map_err(|source| ServeError::Admin { addr, source })?),
        None => None,
    };
    let health_port = match config.server.health_listen {
        Some(addr) => Some(TcpListener::bind(addr).await.map_err(|source| ServeError::Health { addr, source })?),
        None => None,
    };
    let tls = config.server.tls.as_ref().map(tls::ServerTls::watched).transpose().map_err(ServeError::Tls)?;
    let runtime = Arc::new(Runtime::build(&config).await?);
    let busy_poll_us = runtime.busy_poll_budget().map_or(0, |d| d.as_micros() as u64);
    let metrics = runtime.metrics.clone();
    let max = config.server.max_message_bytes;
    let sessions = &config.sessions;
    let (store, postgres): (Arc<dyn SessionStore>, _) = match &sessions.store {
        StoreSettings::Memory => (Arc::new(MemoryStore::new(sessions.max_sessions, sessions.idle_ttl)), None),
        StoreSettings::Postgres(pg) => {
            let store = PostgresStore::new(pg, sessions.lease_ttl, sessions.idle_ttl)
                .map_err(ServeError::Store)?
                .poll_with(runtime.poller());
            store.observe(&metrics);
            // Migrated (or checked, with migrate = "never") before serving.
            // A schema this build can't use stops it; a database that can't
            // be reached either stops it or is waited for, NOT_SERVING.
            match store.prepare_schema().await {
                Ok(()) => {}
                Err(e @ (SchemaError::Newer { .. } | SchemaError::Behind { .. })) => {
                    return Err(ServeError::Store(e.to_string()));
                }
                Err(e) if pg.exit_if_unreachable => {
                    return Err(ServeError::Store(format!(
                        "the session store is unreachable at start-up: {e} (sessions.on_unreachable = \"exit\")"
                    )));
                }
                Err(e) => warn!(reason = %e, "session store unreachable at start-up: NOT_SERVING until it answers"),
            }
            (Arc::new(store.clone()), Some(store))
        }
    };
    let auth = Arc::new(auth::Authenticator::new(&config.server.auth, tls.clone()).map_err(ServeError::Auth)?);
    let live = Arc::new(reconfig::Live::new(runtime.clone(), config.clone()));
    if let Some(path) = path {
        tokio::spawn(reconfig::follow(Arc::downgrade(&live), path));
    }
    let agents = AgentServiceServer::new(AgentSvc::new(live.clone(), store.clone(), auth))
        .max_decoding_message_size(max)
        .max_encoding_message_size(max);

    let (health, _) = tonic_health::server::health_reporter();
    let draining = tokio_util::sync::CancellationToken::new();
    let health_svc =
        tonic_health::pb::health_server::HealthServer::new(health::Draining::new(health.clone(), draining.clone()));
    let store_ok = store.ready().await.is_ok();
    let serving = store_ok && runtime.ready().is_ok();
    health::set(&health, serving).await;
    health.set_service_status(health::LIVENESS, tonic_health::ServingStatus::Serving).await;
    // Readiness follows the runtime new queries take.
    let weak = Arc::downgrade(&live);
    let ready = move || weak.upgrade().map_or(Err("stopping".to_owned()), |live| live.current().ready());
    // Leases kept between queries are given back once the last query ended.
    let keeping = postgres.clone();
    let follow = health::follow_store(health.clone(), store, postgres, ready, draining.clone(), store_ok, serving);
    tokio::spawn(follow);

    // grpcurl 1.8 speaks only reflection v1alpha; newer tools speak v1.
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(lattice_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(lattice_proto::ERROR_DETAILS_DESCRIPTOR_SET)
        .build_v1()?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(lattice_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(lattice_proto::ERROR_DETAILS_DESCRIPTOR_SET)
        .build_v1alpha()?;

    let addr = listener.local_addr().ok();
    let handle = tokio::runtime::Handle::current();
    let worker_threads = handle.metrics().num_workers();
    let runtime = match handle.runtime_flavor() {
        tokio::runtime::RuntimeFlavor::CurrentThread => "current_thread",
        _ => "multi_thread",
    };
    let tls_on = config.server.tls.is_some();
    let addr = shown(addr);
    info!(%addr, agents = config.agents.len(), worker_threads, runtime, busy_poll_us, tls = tls_on, "serving");
    let drain = config.server.drain;
    let shutdown = async move {
        shutdown.await;
        // Stops the store watcher first, so that it can't say SERVING again.
        draining.cancel();
        health::set(&health, false).await;
        if !drain.is_zero() {
            info!(drain_ms = drain.as_millis() as u64, "draining: NOT_SERVING, still accepting queries");
            tokio::time::sleep(drain).await;
        }
        info!("shutting down: refusing new connections, finishing in-flight queries");
    };
    let mut grpc = tonic::service::Routes::builder();
    grpc.add_service(health_svc.clone()).add_service(reflection_v1).add_service(reflection_v1alpha).add_service(agents);
    // The API port serves gRPC only; /metrics is on the admin port.
    if let Some(admin) = admin {
        info!(addr = %shown(admin.local_addr().ok()), "admin port: /metrics");
        tokio::spawn(metrics::serve_admin(admin, metrics));
    }
    let stopped = tokio_util::sync::CancellationToken::new();
    if let Some(port) = health_port {
        info!(addr = %shown(port.local_addr().ok()), "health port: grpc.health.v1 only, plaintext");
        let until = stopped.clone().cancelled_owned();
        let server = tonic::transport::Server::builder().add_service(health_svc.clone());
        tokio::spawn(server.serve_with_incoming_shutdown(incoming(port), until));
    }
    let router = grpc.routes().into_axum_router();
    let server = tonic::transport::Server::builder().add_routes(router.into());
    // The events of concurrent queries on one client connection share
    // their writes (see `lattice_net`), unless `server.gather_writes` is
    // off.
    use tokio_stream::StreamExt as _;
    fn gathered<T>(accepted: std::io::Result<T>) -> std::io::Result<lattice_net::Events<T>> {
        accepted.map(lattice_net::Events::new)
    }
    let served = match (tls, config.server.gather_writes) {
        (Some(tls), true) => server.serve_with_incoming_shutdown(tls.incoming(listener).map(gathered), shutdown).await,
        (Some(tls), false) => server.serve_with_incoming_shutdown(tls.incoming(listener), shutdown).await,
        (None, true) => server.serve_with_incoming_shutdown(incoming(listener).map(gathered), shutdown).await,
        (None, false) => server.serve_with_incoming_shutdown(incoming(listener), shutdown).await,
    };
    stopped.cancel();
    if let Some(store) = keeping {
        store.give_back_kept().await;
    }
    served?;
    info!("stopped");
    Ok(())
}

/// An address for a log field: `host:port`, or "" when unknown.
fn shown(addr: Option<std::net::SocketAddr>) -> String {
    addr.map(|a| a.to_string()).unwrap_or_default()
}

pub use lattice_net::{incoming, shutdown_signal};
