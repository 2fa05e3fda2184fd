//! Whose work each step of a run is: the run's agent, session, query,
//! deadline and audit record, passed by reference to every hook call, tool
//! call, model request and trace event. It sits above the domain types
//! (it holds the audit record's handle) and below everything that runs.

use crate::audit::Audit;

/// Whose work a step is: one per agent run (a delegated run has its own),
/// shared by reference with every step of the run: hook calls, tool calls,
/// model requests and trace events.
#[derive(Debug, Clone)]
pub struct Scope {
    /// The agent that runs.
    pub agent: String,
    /// The session it runs in.
    pub session_id: String,
    /// The client-facing query (shared by delegated runs).
    pub query_id: String,
    /// The run's deadline: nothing under it outlives it.
    pub deadline: tokio::time::Instant,
    /// The query's audit record, when it is kept (shared by delegated runs).
    pub audit: Option<std::sync::Arc<Audit>>,
}

/// One step of a run: its scope and its 1-based turn.
#[derive(Debug, Clone, Copy)]
pub struct Step<'a> {
    /// The run.
    pub scope: &'a Scope,
    /// 1-based turn (model request number).
    pub turn: u32,
}
