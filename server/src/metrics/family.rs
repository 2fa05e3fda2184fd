//! The metric families Lattice exposes: each one's name, help text and
//! type.

use prometheus_client::metrics::MetricType;

/// A metric family: name, help and type, for the exposition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Family {
    /// Queries, by agent and final gRPC code.
    Queries,
    /// Query duration, by agent.
    QueryDuration,
    /// Hook RPCs, by agent, hook, event and outcome.
    HookCalls,
    /// Hook RPC duration, by agent, hook and event.
    HookCallDuration,
    /// Tool calls, by agent, tool and outcome.
    ToolCalls,
    /// Model requests (with their retries), by agent, provider and outcome.
    ModelRequests,
    /// Model request duration, by agent and provider.
    ModelRequestDuration,
    /// Ready addresses of each hook, by agent and hook.
    HookReadyAddresses,
    /// Trace events dropped because the trace writer's queue was full.
    TraceEventsDropped,
    /// Model tokens, by agent, provider and direction (input, output).
    ModelTokens,
    /// Session histories read from PostgreSQL when a query took its lease,
    /// by how much was read (only the messages new to this replica, or
    /// the whole conversation).
    SessionHistoryReads,
    /// Bytes of conversations this replica keeps (PostgreSQL store).
    SessionHistoryCacheBytes,
    /// Kept session leases this replica handed to another that asked
    /// (PostgreSQL store, `keep_lease_ms`).
    SessionLeaseHandovers,
    /// Commit statements sent (PostgreSQL store), by whether they carried
    /// one session's commit or several (group commit).
    SessionCommitStatements,
    /// Commits sent grouped with others, in one statement.
    SessionGroupedCommits,
    /// Queries' commits (PostgreSQL store), by how they ended.
    SessionCommits,
    /// Whether the session store answers the readiness probe (PostgreSQL
    /// store).
    SessionStoreUp,
    /// Shadow hook calls, by agent, hook, outcome and agreement with the
    /// hook they shadow.
    ShadowHookCalls,
    /// Config reloads, by result.
    ConfigReloads,
    /// Turns of the busy poller (`server.busy_poll_us`).
    BusyPollTurns,
}

impl Family {
    pub(super) fn name(self) -> &'static str {
        match self {
            Family::Queries => "lattice_queries_total",
            Family::QueryDuration => "lattice_query_duration_seconds",
            Family::HookCalls => "lattice_hook_calls_total",
            Family::ShadowHookCalls => "lattice_shadow_hook_calls_total",
            Family::ConfigReloads => "lattice_config_reloads_total",
            Family::HookCallDuration => "lattice_hook_call_duration_seconds",
            Family::ToolCalls => "lattice_tool_calls_total",
            Family::ModelRequests => "lattice_model_requests_total",
            Family::ModelRequestDuration => "lattice_model_request_duration_seconds",
            Family::HookReadyAddresses => "lattice_hook_ready_addresses",
            Family::TraceEventsDropped => "lattice_trace_events_dropped_total",
            Family::ModelTokens => "lattice_model_tokens_total",
            Family::SessionHistoryReads => "lattice_session_history_reads_total",
            Family::SessionHistoryCacheBytes => "lattice_session_history_cache_bytes",
            Family::SessionLeaseHandovers => "lattice_session_lease_handovers_total",
            Family::SessionCommitStatements => "lattice_session_commit_statements_total",
            Family::SessionGroupedCommits => "lattice_session_grouped_commits_total",
            Family::SessionCommits => "lattice_session_commits_total",
            Family::SessionStoreUp => "lattice_session_store_up",
            Family::BusyPollTurns => "lattice_busy_poll_turns_total",
        }
    }

    pub(super) fn help(self) -> &'static str {
        match self {
            Family::Queries => "Queries by agent and final gRPC status code.",
            Family::QueryDuration => "Query duration from start to final result or error.",
            Family::HookCalls => {
                "Hook RPCs by outcome (ok, deadline, unavailable, status, invalid_reply, request_too_large, cancelled)."
            }
            Family::HookCallDuration => "Hook RPC duration, connecting included.",
            Family::ConfigReloads => {
                "Config reloads by result: ok, invalid (the running config stays), restart_needed (applied but for settings that need a restart)."
            }
            Family::ShadowHookCalls => {
                "Shadow hook calls by outcome, and whether their output agreed with the shadowed hook's (same, different, none)."
            }
            Family::ToolCalls => "Tool calls by outcome (executed, failed, blocked, cancelled).",
            Family::ModelRequests => {
                "Model requests (retries included) by outcome (ok, deadline, cancelled, or the error kind)."
            }
            Family::ModelRequestDuration => "Model request duration, retries included.",
            Family::HookReadyAddresses => {
                "Addresses of each hook that can take calls now (resolved, connecting, not draining)."
            }
            Family::TraceEventsDropped => {
                "Trace events not written: the trace writer's queue was full (a stalled disk)."
            }
            Family::ModelTokens => "Model tokens by direction: input (the requests) and output (the replies).",
            Family::SessionHistoryReads => {
                "Session histories read as a query took its lease: new_only (this replica knew the rest) or whole."
            }
            Family::SessionLeaseHandovers => {
                "Kept session leases handed to another replica that asked (sessions.keep_lease_ms): its client moved."
            }
            Family::SessionCommitStatements => {
                "Session commit statements sent to PostgreSQL: alone (one query's commit) or grouped (several)."
            }
            Family::SessionGroupedCommits => {
                "Query commits sent in grouped statements (with the grouped statements: the commits per statement)."
            }
            Family::SessionCommits => {
                "Query commits by outcome: stored, not_stored, lease_lost, read_back_stored and read_back_not_stored \
                 (the answer was lost, and the commit read back), unknown (COMMIT_OUTCOME_UNKNOWN)."
            }
            Family::SessionStoreUp => "1 while the session store answers the readiness probe, 0 while it does not.",
            Family::SessionHistoryCacheBytes => {
                "Conversations this replica keeps (sessions.history_cache_mib), in bytes of text and overhead."
            }
            Family::BusyPollTurns => {
                "Turns the busy poller (server.busy_poll_us) took while a hook, tool or session store call was in \
                 flight."
            }
        }
    }
}

impl Family {
    /// The name registered: a counter's without its `_total`, which the
    /// encoder adds.
    pub(super) fn base_name(self) -> &'static str {
        let name = self.name();
        name.strip_suffix("_total").unwrap_or(name)
    }

    /// The help text without its final period, which the encoder adds.
    pub(super) fn help_text(self) -> &'static str {
        let help = self.help();
        help.strip_suffix('.').unwrap_or(help)
    }

    pub(super) fn kind(self) -> MetricType {
        match self {
            Family::QueryDuration | Family::HookCallDuration | Family::ModelRequestDuration => MetricType::Histogram,
            Family::HookReadyAddresses | Family::SessionHistoryCacheBytes | Family::SessionStoreUp => MetricType::Gauge,
            _ => MetricType::Counter,
        }
    }

    /// Whether its values are owned elsewhere and read at each scrape.
    pub(super) fn observed(self) -> bool {
        matches!(
            self,
            Family::HookReadyAddresses
                | Family::TraceEventsDropped
                | Family::SessionHistoryReads
                | Family::SessionHistoryCacheBytes
                | Family::SessionLeaseHandovers
                | Family::SessionCommitStatements
                | Family::SessionGroupedCommits
                | Family::SessionCommits
                | Family::SessionStoreUp
                | Family::BusyPollTurns
        )
    }

    pub(super) const ALL: [Family; 20] = [
        Family::Queries,
        Family::QueryDuration,
        Family::HookCalls,
        Family::HookCallDuration,
        Family::ToolCalls,
        Family::ModelRequests,
        Family::ModelRequestDuration,
        Family::HookReadyAddresses,
        Family::TraceEventsDropped,
        Family::ModelTokens,
        Family::SessionHistoryReads,
        Family::SessionHistoryCacheBytes,
        Family::SessionLeaseHandovers,
        Family::SessionCommitStatements,
        Family::SessionGroupedCommits,
        Family::SessionCommits,
        Family::SessionStoreUp,
        Family::ShadowHookCalls,
        Family::ConfigReloads,
        Family::BusyPollTurns,
    ];
}
