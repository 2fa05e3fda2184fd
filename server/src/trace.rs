//! Trace events: what was actually sent, after the hooks.
//!
//! Every event goes to `tracing` (target `lattice::trace`: kinds and sizes at
//! DEBUG, the post-hook payload at TRACE) and, when `server.trace_dir` is set,
//! to a JSONL file per session. Events are only ever built from post-hook
//! values; a query that fails records an `error` event whose text is the
//! error's (which never carries content).

use std::path::PathBuf;

use serde::Serialize;
use tokio::io::AsyncWriteExt;
use tracing::{debug, trace, warn};

use crate::domain::{Block, ModelRequest, Scope, StopReason, ToolResult, Usage};

/// One trace event.
#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TraceEvent<'a> {
    /// A model request as sent.
    ModelRequest {
        /// 1-based turn.
        turn: u32,
        /// The request.
        request: &'a ModelRequest,
    },
    /// The model's reply.
    AssistantMessage {
        /// 1-based turn.
        turn: u32,
        /// Its content.
        content: &'a [Block],
        /// Why it stopped.
        stop_reason: StopReason,
        /// Tokens.
        usage: Usage,
    },
    /// A tool call the model asked for.
    ToolUse {
        /// 1-based turn.
        turn: u32,
        /// The tool_use block.
        id: &'a str,
        /// The tool.
        name: &'a str,
    },
    /// A tool result as the model sees it.
    ToolResult {
        /// 1-based turn.
        turn: u32,
        /// The tool.
        tool_name: &'a str,
        /// The result.
        result: &'a ToolResult,
        /// How the call went.
        outcome: &'a str,
    },
    /// The query succeeded.
    Result {
        /// Final text.
        text: &'a str,
        /// Why it stopped.
        stop_reason: StopReason,
        /// Turns used.
        turns: u32,
        /// Tokens over all turns.
        usage: Usage,
    },
    /// The query's audit record (see [`crate::audit`]), after its
    /// `result` or `error`.
    Audit {
        /// The queried agent's chain version.
        chain_version: &'a str,
        /// The query's status code's name.
        outcome: &'a str,
        /// Every hook call, in the order they ended.
        hooks: &'a [crate::audit::AuditEntry],
    },
    /// The query failed.
    Error {
        /// The status code's name.
        code: &'a str,
        /// The error (no content).
        message: &'a str,
    },
}

impl TraceEvent<'_> {
    fn kind(&self) -> &'static str {
        match self {
            TraceEvent::ModelRequest { .. } => "model_request",
            TraceEvent::AssistantMessage { .. } => "assistant_message",
            TraceEvent::ToolUse { .. } => "tool_use",
            TraceEvent::ToolResult { .. } => "tool_result",
            TraceEvent::Result { .. } => "result",
            TraceEvent::Audit { .. } => "audit",
            TraceEvent::Error { .. } => "error",
        }
    }
}

#[derive(Serialize)]
struct Line<'a> {
    ts_ms: u128,
    agent: &'a str,
    session_id: &'a str,
    query_id: &'a str,
    #[serde(flatten)]
    event: &'a TraceEvent<'a>,
}

/// The trace sink.
#[derive(Debug, Clone, Default)]
pub struct Tracer {
    dir: Option<PathBuf>,
}

impl Tracer {
    /// A tracer writing JSONL files into `dir`, when set.
    pub fn new(dir: Option<PathBuf>) -> Self {
        Self { dir }
    }

    /// Deletes a session's trace file, if this replica wrote one.
    pub async fn delete(&self, session_id: &str) {
        let Some(dir) = &self.dir else { return };
        let path = dir.join(format!("{session_id}.jsonl"));
        match tokio::fs::remove_file(&path).await {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => warn!(path = %path.display(), error = %e, "cannot delete trace file"),
        }
    }

    /// Records one event. With no trace directory and the `lattice::trace`
    /// log target off (the default), nothing is built at all.
    pub async fn emit(&self, scope: &Scope, event: TraceEvent<'_>) {
        if self.dir.is_none() && !tracing::enabled!(target: "lattice::trace", tracing::Level::DEBUG) {
            return;
        }
        let ts_ms =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0);
        let line = Line {
            ts_ms,
            agent: &scope.agent,
            session_id: &scope.session_id,
            query_id: &scope.query_id,
            event: &event,
        };
        let json = match serde_json::to_string(&line) {
            Ok(j) => j,
            Err(e) => {
                warn!(error = %e, "trace event not serializable");
                return;
            }
        };
        debug!(target: "lattice::trace", agent = %scope.agent, session_id = %scope.session_id, query_id = %scope.query_id, event = event.kind(), bytes = json.len(), "trace");
        trace!(target: "lattice::trace", payload = %json, "trace payload");
        let Some(dir) = &self.dir else { return };
        // Session ids are UUIDs or client-chosen ids validated by the service;
        // file names are built from them only.
        let path = dir.join(format!("{}.jsonl", scope.session_id));
        let write = async {
            tokio::fs::create_dir_all(dir).await?;
            let mut f = tokio::fs::OpenOptions::new().create(true).append(true).open(&path).await?;
            f.write_all(format!("{json}\n").as_bytes()).await?;
            // tokio's File writes on a blocking thread; without the flush the
            // line may land after the client has seen the query end (or,
            // with the next event's write, out of order).
            f.flush().await
        };
        if let Err(e) = write.await {
            warn!(path = %path.display(), error = %e, "cannot write trace file");
        }
    }
}
