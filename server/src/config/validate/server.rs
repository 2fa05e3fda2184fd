//! The validator's `[server]`, `[server.tls]`, `[server.auth]`, `[sessions]`
//! and `[telemetry]` tables.

use super::*;

impl Validator<'_> {
    pub(super) fn server(&mut self, s: RawServer) -> ServerSettings {
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
            gather_writes: s.gather_writes.unwrap_or(true),
            auth,
            limits: LimitSettings {
                queries_in_flight: s.limits.queries_in_flight,
                queries_per_minute: s.limits.queries_per_minute,
            },
            hook_default_deadline: ms(s.hook_deadline_ms.unwrap_or(defaults::HOOK_DEADLINE_MS).min(ceiling)),
        }
    }

    pub(super) fn server_tls(&mut self, raw: Spanned<RawServerTls>) -> TlsSettings {
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

    pub(super) fn auth(&mut self, auth: Option<Spanned<RawAuth>>, tls: Option<&TlsSettings>) -> AuthSettings {
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

    pub(super) fn telemetry(&mut self, t: RawTelemetry) -> TelemetrySettings {
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

    pub(super) fn sessions(&mut self, s: RawSessions) -> SessionSettings {
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
        if let Some(keep) = &s.keep_lease_ms
            && *keep.get_ref() >= s.idle_ttl_s.unwrap_or(defaults::IDLE_TTL_S).saturating_mul(1000)
        {
            let why = "must be shorter than sessions.idle_ttl_s (a kept lease would outlive its idle session)";
            self.problem(Some(keep.span()), "sessions.keep_lease_ms", why);
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
                if let Some(file) = &s.url_file {
                    self.problem(Some(file.span()), "sessions.url_file", "only the postgres store takes a URL");
                }
                if let Some(mib) = &s.history_cache_mib {
                    let why = "only the postgres store keeps a cache (the memory store holds every conversation)";
                    self.problem(Some(mib.span()), "sessions.history_cache_mib", why);
                }
                if let Some(keep) = &s.keep_lease_ms {
                    let why = "only the postgres store keeps leases between queries (the memory store takes none)";
                    self.problem(Some(keep.span()), "sessions.keep_lease_ms", why);
                }
                StoreSettings::Memory
            }
            Some(("postgres", span)) => {
                let url_env = match &s.url_env {
                    Some(var) => var.clone(),
                    None => Spanned::new(span, "LATTICE_POSTGRES_URL".to_owned()),
                };
                let (url, url_file) = match (&s.url_file, &s.url_env) {
                    (Some(file), Some(_)) => {
                        let why = "set url_env or url_file, not both";
                        self.problem(Some(file.span()), "sessions.url_file", why);
                        (String::new(), None)
                    }
                    (Some(file), None) => (self.secret_file(file, "sessions.url_file"), Some(file.get_ref().into())),
                    (None, _) => (self.secret(&url_env, "sessions.url_env", "the PostgreSQL connection string"), None),
                };
                StoreSettings::Postgres(PostgresSettings {
                    url_env: url_env.into_inner(),
                    url_file,
                    url,
                    pool_size: s.pool_size.unwrap_or(defaults::POSTGRES_POOL_SIZE).max(1),
                    pipeline_connections: s.pipeline_connections.unwrap_or(defaults::PIPELINE_CONNECTIONS),
                    exit_if_unreachable,
                    history_cache_bytes: s
                        .history_cache_mib
                        .as_ref()
                        .map_or(defaults::HISTORY_CACHE_MIB, |m| *m.get_ref())
                        .saturating_mul(1024 * 1024),
                    keep_lease: ms(s.keep_lease_ms.as_ref().map_or(0, |k| *k.get_ref())),
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
}
