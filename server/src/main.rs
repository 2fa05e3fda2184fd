//! The `lattice` binary: serve, check a config, run a query, or serve the
//! example tools.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode, time::Duration};

use clap::{Parser, Subcommand, ValueEnum};
use lattice_server::{client, config, example_tools, hookcheck, logging, peer::Tls, run_reloading, shutdown_signal};
use tokio::net::TcpListener;

/// mimalloc: a query's many small, short-lived allocations (frames, header
/// maps, messages) cost a fraction of glibc's, and no per-thread arena keeps
/// what a large query freed. With `MIMALLOC_PURGE_DELAY=0` (deploy/'s image
/// sets it) freed pages go back to the system at once; by default mimalloc
/// waits a second, and only later allocations end the wait. `serve` turns
/// transparent huge pages off (see [`huge_pages_off`]).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Turns transparent huge pages off for this process, unless
/// `MIMALLOC_ALLOW_THP` asks for them (`1`, `true`, `yes` or `on`, as
/// mimalloc reads it). mimalloc asks the kernel for huge pages (`madvise`),
/// and where the kernel compacts memory to find one on a page fault (its
/// default for such requests) the thread that touched the page waits: in
/// `lattice-hookbench` every Lattice process had queries of 5–8 ms instead
/// of 0.3–1.5 at the same query numbers (the 896th and the 915th in each),
/// where its memory grew. Without huge pages those were gone, and the CPU
/// per query was the same.
/// Whether they are off shows as `THP_enabled: 0` in `/proc/PID/status`.
fn huge_pages_off() {
    let opted_in = std::env::var("MIMALLOC_ALLOW_THP")
        .is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"));
    if opted_in {
        return;
    }
    #[cfg(target_os = "linux")]
    if let Err(e) = rustix::thread::disable_transparent_huge_pages(true) {
        tracing::warn!(error = %e, "transparent huge pages stay on: the kernel refused to turn them off");
    }
}

/// EX_USAGE: the config (or the command line) is wrong.
const EXIT_CONFIG: u8 = 64;

#[derive(Parser)]
#[command(name = "lattice", version, about = "Runs LLM agents over gRPC, with remote tools and remote hooks")]
struct Cli {
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the agents of a config file.
    Serve {
        /// The config file (TOML).
        #[arg(long, short)]
        config: PathBuf,
        /// Listen address (overrides server.listen).
        #[arg(long)]
        listen: Option<SocketAddr>,
        /// The admin port's address, or "off" (overrides
        /// server.admin_listen).
        #[arg(long)]
        admin_listen: Option<String>,
        /// The plaintext health-only port's address, or "off" (overrides
        /// server.health_listen).
        #[arg(long)]
        health_listen: Option<String>,
    },
    /// Bring the PostgreSQL session store's schema up to date, and exit:
    /// for `[sessions] migrate = "never"`, where the serving role may not
    /// run DDL. Reads the connection string as `serve` does.
    Migrate {
        /// The config file (TOML).
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Validate a config file and list every problem.
    CheckConfig {
        /// The config file (TOML).
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Run one query and print its event stream.
    Query {
        /// The server, e.g. http://127.0.0.1:50051.
        #[arg(long, default_value = "http://127.0.0.1:50051")]
        addr: String,
        /// The agent.
        #[arg(long)]
        agent: String,
        /// Continue this session.
        #[arg(long)]
        session: Option<String>,
        /// Print each model request as sent (after the hooks).
        #[arg(long)]
        show_requests: bool,
        /// The query's deadline in seconds.
        #[arg(long, default_value_t = 120)]
        timeout_secs: u64,
        /// A file holding the bearer token to send ([server.auth] mode
        /// "token"); LATTICE_TOKEN, if set, is used otherwise.
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// CA certificate(s) (PEM) that sign the server's certificate
        /// (an https:// address); the system's roots otherwise.
        #[arg(long)]
        ca: Option<PathBuf>,
        /// Client certificate (PEM) for mutual TLS, with --key.
        #[arg(long, requires = "key")]
        cert: Option<PathBuf>,
        /// Client private key (PEM) for mutual TLS.
        #[arg(long, requires = "cert")]
        key: Option<PathBuf>,
        /// The name the server's certificate must carry; by default the
        /// host of --addr.
        #[arg(long)]
        server_name: Option<String>,
        /// The prompt.
        prompt: String,
    },
    /// Tools for hook authors.
    Hook {
        #[command(subcommand)]
        command: HookCommand,
    },
    /// Print trace files (server.trace_dir) with every model request whole:
    /// a line that continues the file's previous request gets its
    /// `messages` back. Each file reads on its own; lines are JSON, one an
    /// event.
    Trace {
        /// The files: SESSION.jsonl, and SESSION.jsonl.1 before it for
        /// the older events.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Serve the example customer-lookup tool service.
    ExampleTools {
        /// Listen address.
        #[arg(long, default_value = "127.0.0.1:50061")]
        listen: SocketAddr,
        /// After SIGTERM, keep serving (health NOT_SERVING) this long, so
        /// that a rolling update loses no call.
        #[arg(long, default_value_t = 6000)]
        drain_ms: u64,
    },
}

#[derive(Subcommand)]
enum HookCommand {
    /// Check that a hook service honours the contract: health, reflection,
    /// every kind of call for its events, deadlines, large and concurrent
    /// calls. Prints PASS/WARN/FAIL per check; exits 1 on any FAIL.
    Check {
        /// The hook: host:port, http://host:port, https://host:port or
        /// dns:///host:port.
        addr: String,
        /// The events the hook is registered for.
        #[arg(long, value_delimiter = ',', default_value = "tool_result,model_request")]
        events: Vec<String>,
        /// Each call's deadline: the hook's deadline_ms in Lattice's config.
        #[arg(long, default_value_t = 1000)]
        deadline_ms: u64,
        /// Lattice's server.hook_max_message_bytes.
        #[arg(long, default_value_t = 16 * 1024 * 1024)]
        max_message_bytes: usize,
        /// Calls at once in the concurrency check.
        #[arg(long, default_value_t = 32)]
        concurrency: usize,
        /// The hook's `tools` match condition: tool results are sent as
        /// the first of these tools' (with the tool_result event).
        #[arg(long, value_delimiter = ',')]
        tools: Option<Vec<String>>,
        /// The hook's `min_messages` match condition: model requests have
        /// at least this many messages (with the model_request event).
        #[arg(long, default_value_t = 0)]
        min_messages: usize,
        /// CA certificate(s) (PEM) that sign the hook's certificate (TLS).
        #[arg(long)]
        ca_file: Option<PathBuf>,
        /// Client certificate (PEM) for mutual TLS, with --key-file.
        #[arg(long, requires = "key_file")]
        cert_file: Option<PathBuf>,
        /// Client private key (PEM) for mutual TLS.
        #[arg(long, requires = "cert_file")]
        key_file: Option<PathBuf>,
        /// The name the hook's certificate must carry (TLS).
        #[arg(long)]
        server_name: Option<String>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// `lattice migrate`: the session store's schema brought up to date.
async fn migrate(path: &std::path::Path) -> ExitCode {
    // As check-config reads it: a model API key is not needed to migrate.
    let config = match config::check(path, &lattice_server::CHECKS) {
        Ok((config, _)) => config,
        Err(e) => {
            eprint!("{e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let config::StoreSettings::Postgres(pg) = &config.sessions.store else {
        eprintln!("lattice migrate: {} keeps sessions in memory: there is no schema to migrate", path.display());
        return ExitCode::from(EXIT_CONFIG);
    };
    if pg.url.is_empty() {
        eprintln!("lattice migrate: {} holds no PostgreSQL connection string", pg.url_source());
        return ExitCode::from(EXIT_CONFIG);
    }
    let store =
        match lattice_server::session::PostgresStore::new(pg, config.sessions.lease_ttl, config.sessions.idle_ttl) {
            Ok(store) => store,
            Err(e) => {
                eprintln!("lattice migrate: {e}");
                return ExitCode::from(EXIT_CONFIG);
            }
        };
    match store.migrate().await {
        Ok(applied) if applied.is_empty() => {
            print_out(&format!(
                "session store schema: up to date (version {})\n",
                lattice_server::session::SCHEMA_VERSION
            ));
            ExitCode::SUCCESS
        }
        Ok(applied) => {
            let versions: Vec<String> = applied.iter().map(i32::to_string).collect();
            print_out(&format!(
                "session store schema: migrated to version {} (applied {})\n",
                lattice_server::session::SCHEMA_VERSION,
                versions.join(", ")
            ));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("lattice migrate: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Writes a command's output to stdout. A reader that went away (`| head`)
/// is no error of ours: unlike `print!`, this never panics.
fn print_out(text: &str) {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    let _ = stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush());
}

fn init_logs(format: LogFormat) {
    logging::init(match format {
        LogFormat::Text => logging::Format::Text,
        LogFormat::Json => logging::Format::Json,
    });
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `serve` reads its config first: it says how many worker threads to run.
    let mut workers = None;
    let mut loaded = None;
    if let Command::Serve { config, .. } = &cli.command {
        // Logging starts once the runtime runs (the OpenTelemetry exporter
        // lives on it); config::load logs nothing.
        match config::load(config, &lattice_server::CHECKS) {
            Ok(c) => {
                workers = c.server.worker_threads;
                loaded = Some(c);
            }
            Err(e) => {
                eprint!("{e}");
                return ExitCode::from(EXIT_CONFIG);
            }
        }
    }
    // One worker: a current-thread runtime (no work-stealing machinery to
    // pay for); otherwise a worker per core unless set.
    let mut runtime = match workers {
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        Some(n) => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
        None => tokio::runtime::Builder::new_multi_thread(),
    };
    match runtime.enable_all().build() {
        Ok(rt) => {
            let mut telemetry = None;
            if let Some(cfg) = &loaded {
                let _entered = rt.enter();
                let tracer = if cfg.telemetry.enabled(&|v| std::env::var(v).ok()) {
                    match lattice_server::telemetry::start(&cfg.telemetry) {
                        Ok((tracer, guard)) => {
                            telemetry = Some(guard);
                            Some(tracer)
                        }
                        Err(e) => {
                            eprintln!("lattice: telemetry: {e}");
                            return ExitCode::from(EXIT_CONFIG);
                        }
                    }
                } else {
                    None
                };
                logging::init_with(
                    match cli.log_format {
                        LogFormat::Text => logging::Format::Text,
                        LogFormat::Json => logging::Format::Json,
                    },
                    tracer,
                );
            }
            rt.block_on(async {
                let code = run_command(cli, loaded).await;
                // Flushes the spans still queued, while the runtime still
                // drives the exporter's connection.
                if let Some(t) = telemetry {
                    let _ = tokio::task::spawn_blocking(move || drop(t)).await;
                }
                code
            })
        }
        Err(e) => {
            eprintln!("lattice: cannot start the runtime: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run_command(cli: Cli, loaded: Option<config::Config>) -> ExitCode {
    match cli.command {
        Command::Trace { files } => {
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            for file in &files {
                let read = std::fs::File::open(file)
                    .map_err(|e| e.to_string())
                    .and_then(|f| lattice_server::trace::expand(std::io::BufReader::new(f), &mut out));
                if let Err(e) = read.and_then(|()| std::io::Write::flush(&mut out).map_err(|e| e.to_string())) {
                    eprintln!("{}: {e}", file.display());
                    return ExitCode::FAILURE;
                }
            }
            ExitCode::SUCCESS
        }
        Command::Migrate { config } => migrate(&config).await,
        Command::CheckConfig { config } => match config::check(&config, &lattice_server::CHECKS) {
            Ok((c, warnings)) => {
                for w in &warnings {
                    let line = w.line.map(|l| format!(":{l}")).unwrap_or_default();
                    eprintln!("warning: {}{line}: {}: {}", config.display(), w.field, w.message);
                }
                let mut out = format!("{}: OK ({} agent(s))\n", config.display(), c.agents.len());
                for a in &c.agents {
                    let hooks: Vec<&str> = a.hooks.iter().filter(|h| h.enabled).map(|h| h.name.as_str()).collect();
                    out += &format!("  {}: model {}, hooks [{}]\n", a.name, a.model.label(), hooks.join(" → "));
                }
                print_out(&out);
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprint!("{e}");
                ExitCode::from(EXIT_CONFIG)
            }
        },
        Command::Serve { config, listen, admin_listen, health_listen } => {
            let Some(mut cfg) = loaded else {
                eprintln!("lattice: {} was not loaded", config.display());
                return ExitCode::from(EXIT_CONFIG);
            };
            let addr = listen.unwrap_or(cfg.server.listen);
            if let Some(admin) = admin_listen {
                match config::parse_admin_listen(&admin) {
                    Some(a) => cfg.server.admin_listen = a,
                    None => {
                        eprintln!(
                            "lattice: --admin-listen {admin:?} is not an address like 127.0.0.1:9090, nor \"off\""
                        );
                        return ExitCode::from(EXIT_CONFIG);
                    }
                }
            }
            if let Some(health) = health_listen {
                match config::parse_admin_listen(&health) {
                    Some(a) => cfg.server.health_listen = a,
                    None => {
                        eprintln!(
                            "lattice: --health-listen {health:?} is not an address like 0.0.0.0:8081, nor \"off\""
                        );
                        return ExitCode::from(EXIT_CONFIG);
                    }
                }
            }
            huge_pages_off();
            let signal = shutdown_signal();
            let listener = match TcpListener::bind(addr).await {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("cannot listen on {addr}: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match run_reloading(cfg, config, listener, signal).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!(error = %e, "server failed");
                    eprintln!("lattice: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Query {
            addr,
            agent,
            session,
            show_requests,
            timeout_secs,
            token_file,
            ca,
            cert,
            key,
            server_name,
            prompt,
        } => {
            let read = |path: &PathBuf| {
                std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
            };
            let tls = if ca.is_some() || cert.is_some() || server_name.is_some() {
                let files = (
                    ca.as_ref().map(read).transpose(),
                    cert.as_ref().map(read).transpose(),
                    key.as_ref().map(read).transpose(),
                );
                match files {
                    (Ok(ca_pem), Ok(cert), Ok(key)) => {
                        Some(lattice_server::peer::Tls { ca_pem, identity: cert.zip(key), server_name, files: None })
                    }
                    (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
                        eprintln!("lattice query: {e}");
                        return ExitCode::from(EXIT_CONFIG);
                    }
                }
            } else {
                None
            };
            let token = match &token_file {
                Some(path) => match std::fs::read_to_string(path) {
                    Ok(t) => Some(t.trim().to_owned()),
                    Err(e) => {
                        eprintln!("lattice query: cannot read {}: {e}", path.display());
                        return ExitCode::from(EXIT_CONFIG);
                    }
                },
                None => std::env::var("LATTICE_TOKEN").ok().filter(|t| !t.trim().is_empty()),
            };
            let args = client::QueryArgs {
                token,
                tls,
                addr,
                agent,
                session,
                prompt,
                show_requests,
                timeout: Duration::from_secs(timeout_secs),
            };
            let mut out = std::io::stdout();
            match client::run_query(args, &mut out).await {
                Ok(()) => ExitCode::SUCCESS,
                // The status was printed with the event stream.
                Err(client::QueryError::Status(_)) => ExitCode::FAILURE,
                Err(e) => {
                    eprintln!("lattice query: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Hook {
            command:
                HookCommand::Check {
                    addr,
                    events,
                    deadline_ms,
                    max_message_bytes,
                    concurrency,
                    tools,
                    min_messages,
                    ca_file,
                    cert_file,
                    key_file,
                    server_name,
                    json,
                },
        } => {
            let read = |path: &PathBuf| std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()));
            let tls = (|| -> Result<Option<Tls>, String> {
                if ca_file.is_none() && cert_file.is_none() && server_name.is_none() {
                    return Ok(None);
                }
                let identity = match (&cert_file, &key_file) {
                    (Some(c), Some(k)) => Some((read(c)?, read(k)?)),
                    _ => None,
                };
                Ok(Some(Tls { ca_pem: ca_file.as_ref().map(read).transpose()?, identity, server_name, files: None }))
            })();
            let tls = match tls {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("lattice hook check: {e}");
                    return ExitCode::from(EXIT_CONFIG);
                }
            };
            let endpoint = if addr.contains("://") {
                addr
            } else if tls.is_some() {
                format!("https://{addr}")
            } else {
                format!("http://{addr}")
            };
            let unknown: Vec<&String> =
                events.iter().filter(|e| !matches!(e.as_str(), "tool_result" | "model_request")).collect();
            if !unknown.is_empty() || events.is_empty() {
                eprintln!("lattice hook check: --events takes tool_result and/or model_request (got {events:?})");
                return ExitCode::from(EXIT_CONFIG);
            }
            let (tool_result, model_request) =
                (events.iter().any(|e| e == "tool_result"), events.iter().any(|e| e == "model_request"));
            if tools.as_ref().is_some_and(|t| t.is_empty() || !tool_result) {
                eprintln!("lattice hook check: --tools names at least one tool, and needs the tool_result event");
                return ExitCode::from(EXIT_CONFIG);
            }
            if min_messages > 0 && !model_request {
                eprintln!("lattice hook check: --min-messages needs the model_request event");
                return ExitCode::from(EXIT_CONFIG);
            }
            let options = hookcheck::Options {
                endpoint,
                tls,
                tool_result,
                model_request,
                deadline: Duration::from_millis(deadline_ms.max(1)),
                max_message_bytes,
                concurrency: concurrency.max(1),
                tools,
                min_messages,
            };
            match hookcheck::run(&options).await {
                Ok(report) => {
                    if json {
                        print_out(&(serde_json::to_string_pretty(&report).unwrap_or_default() + "\n"));
                    } else {
                        print_out(&report.table());
                    }
                    if report.failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE }
                }
                Err(e) => {
                    eprintln!("lattice hook check: {e}");
                    ExitCode::from(EXIT_CONFIG)
                }
            }
        }
        Command::ExampleTools { listen, drain_ms } => {
            init_logs(cli.log_format);
            let signal = shutdown_signal();
            let listener = match TcpListener::bind(listen).await {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("cannot listen on {listen}: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match example_tools::serve(listener, signal, Duration::from_millis(drain_ms)).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("example tools: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
