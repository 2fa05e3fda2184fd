//! Trace events: what was actually sent, after the hooks.
//!
//! Every event goes to `tracing` (target `lattice::trace`: kinds and sizes at
//! DEBUG, the post-hook payload at TRACE) and, when `server.trace_dir` is set,
//! to a JSONL file per session. Events are only ever built from post-hook
//! values; a query that fails records an `error` event whose text is the
//! error's (which never carries content).
//!
//! The files are written by a thread of their own, off the query path:
//! events wait in a bounded queue (`server.trace_queue_events`), and when it
//! is full — a stalled or full disk — they are dropped and counted
//! (`lattice_trace_events_dropped_total`), never waited for. A query's end
//! waits for its lines to be written (so that a client that saw the result
//! finds them), at most [`FLUSH_WAIT`], and not at all while the writer is
//! stalled. A session's file is rotated to `SESSION.jsonl.1` before a whole
//! request that would take it past `server.trace_max_file_bytes` (and before
//! any line that would take it past twice that), deleted with its session
//! (`DeleteSession` returns once they are gone, waiting [`DELETE_WAIT`] at
//! most; a deletion is never dropped, even from a full queue), and files
//! untouched for `server.trace_max_age_s` are removed. A file removed or
//! replaced is closed on a second thread, where its blocks are freed (tens
//! of milliseconds for a large one), so that no flush waits for that.
//!
//! A session's requests share most of their messages (each continues the
//! conversation of the one before), so a `model_request` line records only
//! what its request does not share with the previous `model_request` line
//! of the same file: `messages_kept` (how many of that line's messages come
//! first) and `messages_added` (the rest, in full), and `system` and
//! `tools` only if they are not that line's. The first request of each
//! file is whole (`system`, `messages`, `tools`), so every file reads on
//! its own. What
//! the two lines share is known without reading them: the messages a
//! request shares with its query's conversation, and how much of that
//! conversation is committed (and so begins every later query's). A
//! request a hook reshaped shares only what is still equal, and is whole
//! if nothing is. Whatever breaks a file's run of requests (a line that
//! could not be queued or written, a rotation between two requests) makes
//! the next request whole; a line that would continue a request the file
//! does not hold is dropped and counted, never written.
//!
//! Here: the events and the tracer that records them. `chains` knows what
//! each file already holds of its requests; `writer` is the writer thread
//! (queue, rotation, sweep, reaper); `expand` gives `lattice trace` every
//! request whole.

use std::{
    collections::{HashMap, HashSet},
    io::Write as _,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
        mpsc,
    },
    time::{Duration, SystemTime},
};

use serde::Serialize;
use tracing::{debug, trace, warn};

use crate::domain::{Block, Message, ModelRequest, StopReason, ToolResult, ToolSpec, Usage};
use crate::scope::Scope;

mod chains;
mod expand;
#[cfg(test)]
mod tests;
mod writer;
use chains::*;
pub use expand::expand;
use writer::*;

/// One trace event.
#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TraceEvent<'a> {
    /// A model request as sent (see [`Tracer::emit_request`]).
    ModelRequest {
        /// 1-based turn.
        turn: u32,
        /// The request, whole or as it continues the file's previous one.
        request: RequestRecord<'a>,
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
        /// `sha256` or `hmac-sha256`.
        digest: &'a str,
        /// Every hook call, in the order they ended.
        hooks: &'a [crate::audit::AuditEntry],
        /// The shadow hook calls that had ended.
        #[serde(skip_serializing_if = "<[_]>::is_empty")]
        shadows: &'a [crate::audit::ShadowEntry],
    },
    /// The query failed.
    Error {
        /// The status code's name.
        code: &'a str,
        /// The error (no content).
        message: &'a str,
    },
}

/// How a `model_request` line records its request: whole, or as it
/// continues the file's previous request. Made by [`Tracer::emit_request`]
/// only, which keeps each session's run of requests.
#[derive(Debug, Serialize)]
pub struct RequestRecord<'a>(Record<'a>);

#[derive(Debug, Serialize)]
#[serde(untagged)]
enum Record<'a> {
    /// All of it: `system`, `messages`, `tools`.
    Whole(&'a ModelRequest<'a>),
    /// Its messages after the first `messages_kept`, which are those of the
    /// previous `model_request` line of the same file.
    Continued {
        /// Left out when it is the previous request's.
        #[serde(skip_serializing_if = "Option::is_none")]
        system: Option<&'a str>,
        messages_kept: usize,
        messages_added: &'a [Message],
        /// Left out when they are the previous request's.
        #[serde(skip_serializing_if = "Option::is_none")]
        tools: Option<&'a [ToolSpec]>,
    },
}

/// What a line is to the run of requests in its file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LineKind {
    /// Not a model request.
    Other,
    /// A whole model request: a file may start with it.
    Whole,
    /// A request that continues the file's previous one.
    Continued,
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

/// How long a query's end waits for its trace lines to be written.
pub const FLUSH_WAIT: Duration = Duration::from_millis(100);

/// How long deleting a session waits for its trace files to be deleted.
pub const DELETE_WAIT: Duration = Duration::from_secs(5);

/// How often files past their age are looked for.
const SWEEP_EVERY: Duration = Duration::from_secs(600);

/// Where and how trace files are written (`server.trace_*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceSettings {
    /// The directory (`server.trace_dir`).
    pub dir: PathBuf,
    /// Events waiting to be written at most; more are dropped.
    pub queue_events: usize,
    /// A session file is rotated before it passes this size.
    pub max_file_bytes: u64,
    /// Files untouched this long are removed.
    pub max_age: Duration,
}

/// The trace sink.
#[derive(Debug, Clone, Default)]
pub struct Tracer {
    writer: Option<Arc<Writer>>,
}

impl Tracer {
    /// A tracer that writes nothing to disk (events still go to `tracing`).
    pub fn off() -> Self {
        Self::default()
    }

    /// A tracer writing JSONL files into `settings.dir`, which must be
    /// writable (checked now: a read-only root filesystem is Kubernetes'
    /// default). Starts the writer thread.
    pub fn start(settings: TraceSettings) -> Result<Self, String> {
        let dir = &settings.dir;
        let check = || -> std::io::Result<()> {
            std::fs::create_dir_all(dir)?;
            let probe = dir.join(".lattice-write-check");
            std::fs::write(&probe, b"")?;
            std::fs::remove_file(&probe)
        };
        check().map_err(|e| {
            format!(
                "server.trace_dir {}: not writable: {e} (a read-only root filesystem? mount a volume there)",
                dir.display()
            )
        })?;
        let (tx, rx) = mpsc::sync_channel(settings.queue_events.max(1));
        let shared = Arc::new(Shared::default());
        let writer = Arc::new(Writer { tx, shared: shared.clone() });
        std::thread::Builder::new()
            .name("lattice-trace".into())
            .spawn(move || write_loop(settings, rx, shared))
            .map_err(|e| format!("cannot start the trace writer: {e}"))?;
        Ok(Self { writer: Some(writer) })
    }

    /// Lines not written (a full queue, or a continued request whose file
    /// no longer holds the one it continues), shared, for a metric.
    pub fn dropped(&self) -> Option<Arc<AtomicUsize>> {
        self.writer.as_ref().map(|w| w.shared.dropped.clone())
    }

    /// Deletes a session's trace files, if this replica wrote any, and
    /// waits until they are gone: at most [`DELETE_WAIT`]. Unlike a line,
    /// a deletion is never dropped: a full queue is waited for (on a
    /// blocking thread, which queues it even after the wait ends), and a
    /// stalled writer deletes the files when it catches up.
    pub async fn delete(&self, session_id: &str) {
        let Some(w) = &self.writer else { return };
        w.shared.chains.end(session_id);
        let (done, deleted) = tokio::sync::oneshot::channel();
        let (tx, op) = (w.tx.clone(), Op::Delete(session_id.to_owned(), done));
        let queued = tokio::task::spawn_blocking(move || tx.send(op).is_ok());
        let waited = async { if queued.await.unwrap_or(false) { deleted.await.is_ok() } else { false } };
        if !tokio::time::timeout(DELETE_WAIT, waited).await.unwrap_or(false) {
            warn!(session_id, "trace writer behind: the session's trace files are deleted when it catches up");
        }
    }

    /// The query of `scope` committed the first `len` messages of its
    /// conversation: the session's next query's first request continues
    /// this one's last.
    pub fn committed(&self, scope: &Scope, len: usize) {
        if let Some(w) = &self.writer {
            w.shared.chains.committed(&scope.session_id, &scope.query_id, len);
        }
    }

    /// Records a model request as sent, after the hooks: `prompt` is its
    /// agent's system prompt, `conversation` the query's conversation as it
    /// stands (the request's messages before the hooks), of which the first
    /// `history` are the session's committed history. In a trace file, the
    /// line holds only the messages after those it shares with the file's
    /// previous request, and its system prompt and tools only where they
    /// are not that request's.
    pub async fn emit_request(
        &self,
        scope: &Scope,
        turn: u32,
        request: &ModelRequest<'_>,
        prompt: &Arc<str>,
        conversation: &[Message],
        history: usize,
    ) {
        let shared = match &self.writer {
            Some(w) => {
                // The agent's prompt, unless a hook replaced it.
                let agents = matches!(&request.system, std::borrow::Cow::Borrowed(s) if std::ptr::eq(*s, &**prompt));
                w.shared.chains.extend(
                    &scope.session_id,
                    &scope.query_id,
                    shared_prefix(&request.messages, conversation),
                    history,
                    &request.tools,
                    agents.then_some(prompt),
                )
            }
            // Only the log takes it: whole.
            None => Sharing { kept: 0, tools: false, system: false },
        };
        let kept = shared.kept;
        let (record, kind) = match request.messages.get(kept..) {
            Some(added) if kept > 0 => (
                RequestRecord(Record::Continued {
                    system: (!shared.system).then_some(&request.system),
                    messages_kept: kept,
                    messages_added: added,
                    tools: (!shared.tools).then_some(&request.tools[..]),
                }),
                LineKind::Continued,
            ),
            _ => (RequestRecord(Record::Whole(request)), LineKind::Whole),
        };
        self.record(scope, TraceEvent::ModelRequest { turn, request: record }, kind).await;
    }

    /// Waits until every line queued so far is written: at most
    /// [`FLUSH_WAIT`], and not at all while the writer is stalled.
    pub async fn flush(&self) {
        let Some(w) = &self.writer else { return };
        if w.shared.stalled.load(Ordering::Relaxed) {
            return;
        }
        let (done, written) = tokio::sync::oneshot::channel();
        if !w.send(Op::Flush(done)) {
            return;
        }
        if tokio::time::timeout(FLUSH_WAIT, written).await.is_err() {
            w.shared.stalled.store(true, Ordering::Relaxed);
            warn!("trace writer stalled: trace events are dropped until it catches up");
        }
    }

    /// Records one event other than a model request (whose event only
    /// [`Tracer::emit_request`] can make). With no trace directory and the
    /// `lattice::trace` log target off (the default), nothing is built at
    /// all.
    pub async fn emit(&self, scope: &Scope, event: TraceEvent<'_>) {
        self.record(scope, event, LineKind::Other).await;
    }

    async fn record(&self, scope: &Scope, event: TraceEvent<'_>, kind: LineKind) {
        if self.writer.is_none() && !tracing::enabled!(target: "lattice::trace", tracing::Level::DEBUG) {
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
        // The line as the file takes it, newline included: the writer
        // writes it as it is (no copy of a large model request there).
        let mut json = match serde_json::to_string(&line) {
            Ok(j) => j,
            Err(e) => {
                warn!(error = %e, "trace event not serializable");
                return;
            }
        };
        debug!(target: "lattice::trace", agent = %scope.agent, session_id = %scope.session_id, query_id = %scope.query_id, event = event.kind(), bytes = json.len(), "trace");
        trace!(target: "lattice::trace", payload = %json, "trace payload");
        if let Some(w) = &self.writer {
            json.push('\n');
            if !w.send(Op::Line { session: scope.session_id.clone(), line: json, kind }) && kind != LineKind::Other {
                // The file will not hold this request: the next is whole.
                w.shared.chains.end(&scope.session_id);
            }
        }
    }
}
