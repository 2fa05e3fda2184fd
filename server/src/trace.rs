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
//! any line that would take it past twice that), deleted with its session, and files
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

/// What the last `model_request` line queued for a session holds of its
/// query's conversation: the next request's line records only what follows
/// the part the two share.
#[derive(Debug, Clone)]
struct Chain {
    /// The query whose request it was.
    query_id: String,
    /// The line's first `sent` messages are the conversation's first.
    sent: usize,
    /// The conversation's first `committed` messages are committed, so
    /// every later query's conversation begins with them.
    committed: usize,
    /// The request's tools (held, so that the same list is known by its
    /// address).
    tools: Arc<[ToolSpec]>,
    /// The request's system prompt where it was its agent's (held, so that
    /// the same prompt is known by its address); `None` where a hook
    /// replaced it.
    system: Option<Arc<str>>,
}

/// What a request's line shares with the session's previous line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sharing {
    /// How many messages that line holds first (0: the line is whole).
    kept: usize,
    /// Whether it offered the same tools.
    tools: bool,
    /// Whether it had the same system prompt, its agent's.
    system: bool,
}

/// Sessions whose chain is known at most; past it they all start over
/// (each session's next request is recorded whole).
const CHAINS_KEPT: usize = 65_536;

/// The chains of the sessions this replica traces, shared by the query
/// path (which extends them) and the writer (which ends one when its file
/// could no longer continue it).
#[derive(Debug, Default)]
struct Chains(Mutex<HashMap<String, Chain>>);

impl Chains {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Chain>> {
        crate::sync::lock(&self.0)
    }

    /// Records that `query` sends a request whose first `shared` messages
    /// are its conversation's (of which the first `history` are committed
    /// history), offering `tools`, with `system` where its system prompt is
    /// its agent's; returns what the session's previous request line shares
    /// with it.
    fn extend(
        &self,
        session: &str,
        query: &str,
        shared: usize,
        history: usize,
        tools: &Arc<[ToolSpec]>,
        system: Option<&Arc<str>>,
    ) -> Sharing {
        let mut chains = self.lock();
        let (kept, committed) = match chains.get(session) {
            Some(c) if c.query_id == query => (c.sent.min(shared), c.committed),
            // Another query's conversation: only the committed part is
            // known to be this one's too.
            Some(c) if c.committed <= history => (c.sent.min(c.committed).min(shared), history),
            _ => (0, history),
        };
        let previous = chains.get(session).filter(|_| kept > 0);
        let same = Sharing {
            kept,
            tools: previous.is_some_and(|c| Arc::ptr_eq(&c.tools, tools)),
            system: previous.and_then(|c| c.system.as_ref()).zip(system).is_some_and(|(a, b)| Arc::ptr_eq(a, b)),
        };
        if chains.len() >= CHAINS_KEPT && !chains.contains_key(session) {
            chains.clear();
        }
        match chains.get_mut(session) {
            Some(c) => {
                if c.query_id != query {
                    c.query_id = query.to_owned();
                }
                c.sent = shared;
                c.committed = committed;
                if !Arc::ptr_eq(&c.tools, tools) {
                    c.tools = tools.clone();
                }
                if !same.system {
                    c.system = system.cloned();
                }
            }
            None => {
                let chain = Chain {
                    query_id: query.to_owned(),
                    sent: shared,
                    committed,
                    tools: tools.clone(),
                    system: system.cloned(),
                };
                chains.insert(session.to_owned(), chain);
            }
        }
        same
    }

    /// `query` committed the first `len` messages of its conversation.
    fn committed(&self, session: &str, query: &str, len: usize) {
        if let Some(c) = self.lock().get_mut(session).filter(|c| c.query_id == query) {
            c.committed = len;
        }
    }

    /// The session's next request is recorded whole.
    fn end(&self, session: &str) {
        self.lock().remove(session);
    }
}

/// How many of `sent`'s first messages are `conversation`'s first.
fn shared_prefix(sent: &[Message], conversation: &[Message]) -> usize {
    if std::ptr::eq(sent.as_ptr(), conversation.as_ptr()) {
        return sent.len().min(conversation.len());
    }
    sent.iter().zip(conversation).take_while(|(a, b)| a == b).count()
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

enum Op {
    /// A line of a session's file, its newline included.
    Line {
        session: String,
        line: String,
        kind: LineKind,
    },
    Delete(String),
    Flush(tokio::sync::oneshot::Sender<()>),
}

#[derive(Debug)]
struct Writer {
    tx: mpsc::SyncSender<Op>,
    shared: Arc<Shared>,
}

/// What the writer thread shares with the tracers.
#[derive(Debug, Default)]
struct Shared {
    /// Lines not written: a full queue, or a request whose file no longer
    /// holds the one it continues (shared with a metric).
    dropped: Arc<AtomicUsize>,
    /// Set when a flush was not answered in time; cleared when the writer
    /// finishes something.
    stalled: AtomicBool,
    /// Each session's run of requests in its file.
    chains: Chains,
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

    /// Deletes a session's trace files, if this replica wrote any.
    pub async fn delete(&self, session_id: &str) {
        if let Some(w) = &self.writer {
            w.shared.chains.end(session_id);
            w.send(Op::Delete(session_id.to_owned()));
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

impl Writer {
    /// Queues `op` unless the queue is full (then a line is counted as
    /// dropped). Whether it was queued.
    fn send(&self, op: Op) -> bool {
        let line = matches!(op, Op::Line { .. });
        match self.tx.try_send(op) {
            Ok(()) => true,
            Err(_) => {
                if line {
                    self.shared.dropped.fetch_add(1, Ordering::Relaxed);
                }
                false
            }
        }
    }
}

/// The writer thread: one op at a time, in order; ends when every sender
/// is gone.
fn write_loop(settings: TraceSettings, rx: mpsc::Receiver<Op>, shared: Arc<Shared>) {
    let reaper = Reaper::start();
    let mut swept = SystemTime::now();
    // Sessions whose file does not hold the request their next continued
    // line would continue: such lines are dropped until a whole one.
    let mut broken: HashSet<String> = HashSet::new();
    while let Ok(op) = rx.recv() {
        match op {
            Op::Line { session, line, kind } => {
                // Session ids are made by the service or validated by it
                // (letters, digits, '-'); file names are built from them only.
                let path = settings.dir.join(format!("{session}.jsonl"));
                let written = if kind == LineKind::Continued && broken.contains(&session) {
                    Ok(Appended::Orphan)
                } else {
                    append(&path, &line, kind, settings.max_file_bytes, &reaper)
                };
                // Whether the file no longer holds what the session's next
                // continued line would continue.
                let broke = match written {
                    Ok(Appended::Written { size, chain_kept }) => {
                        if kind == LineKind::Whole {
                            broken.remove(&session);
                        }
                        if chain_kept && size >= settings.max_file_bytes {
                            // Its next request is whole, and the file is
                            // rotated before it.
                            shared.chains.end(&session);
                        }
                        !chain_kept
                    }
                    Ok(Appended::Orphan) => {
                        shared.dropped.fetch_add(1, Ordering::Relaxed);
                        true
                    }
                    Err(e) => {
                        warn!(path = %path.display(), error = %e, "cannot write trace file");
                        kind != LineKind::Other
                    }
                };
                if broke {
                    shared.chains.end(&session);
                    broken.insert(session);
                }
            }
            Op::Delete(session) => {
                broken.remove(&session);
                shared.chains.end(&session);
                for name in [format!("{session}.jsonl"), format!("{session}.jsonl.1")] {
                    let path = settings.dir.join(name);
                    match reaper.remove(&path) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => warn!(path = %path.display(), error = %e, "cannot delete trace file"),
                    }
                }
            }
            Op::Flush(done) => {
                let _ = done.send(());
            }
        }
        shared.stalled.store(false, Ordering::Relaxed);
        if swept.elapsed().is_ok_and(|e| e >= SWEEP_EVERY) {
            for session in sweep(&settings.dir, settings.max_age, &reaper) {
                broken.remove(&session);
                shared.chains.end(&session);
            }
            swept = SystemTime::now();
        }
    }
}

/// Closes, on a thread of its own, the files the writer removed or
/// replaced. Freeing a large file's blocks happens at its last close and
/// takes tens of milliseconds (64 MiB: 30-50 ms); held open across the
/// removal, it is freed here instead of between one line and the next,
/// where queries wait for their flush.
struct Reaper {
    tx: Option<mpsc::Sender<std::fs::File>>,
}

impl Reaper {
    /// Starts the reaper's thread; without one, files are closed in place.
    fn start() -> Self {
        let (tx, rx) = mpsc::channel::<std::fs::File>();
        let spawned = std::thread::Builder::new().name("lattice-trace-reaper".into()).spawn(move || {
            for file in rx {
                drop(file);
            }
        });
        Self { tx: spawned.ok().map(|_| tx) }
    }

    /// Closes `file` on the reaper's thread.
    fn close(&self, file: std::fs::File) {
        if let Some(tx) = &self.tx {
            // If the thread is gone, the file comes back in the error and
            // is closed here.
            let _ = tx.send(file);
        }
    }

    /// Removes the file at `path`, its blocks freed on the reaper's thread.
    fn remove(&self, path: &Path) -> std::io::Result<()> {
        self.unlinking(path, || std::fs::remove_file(path))
    }

    /// Renames `from` over `to`, the file it replaces freed on the reaper's
    /// thread.
    fn rename_over(&self, from: &Path, to: &Path) -> std::io::Result<()> {
        self.unlinking(to, || std::fs::rename(from, to))
    }

    /// Runs `unlink`, which takes the name `path` from its file, holding
    /// that file open across it and then handing it to the reaper's thread.
    fn unlinking(&self, path: &Path, unlink: impl FnOnce() -> std::io::Result<()>) -> std::io::Result<()> {
        let held = std::fs::File::open(path);
        unlink()?;
        if let Ok(file) = held {
            self.close(file);
        }
        Ok(())
    }
}

/// Copies a trace file's lines from `file` to `out` with every model
/// request whole: a line that continues the previous request gets its
/// `messages` (the first `messages_kept` of that request's, then its
/// `messages_added`) and, where it leaves them out, that request's `system`
/// and `tools`. The error names the line that is not JSON, or that
/// continues more than the file holds.
pub fn expand(file: impl std::io::BufRead, mut out: impl std::io::Write) -> Result<(), String> {
    // The file's previous request, whole.
    let mut previous = serde_json::Map::new();
    for (n, line) in file.lines().enumerate() {
        let line = line.map_err(|e| e.to_string())?;
        let at = n + 1;
        let mut event: serde_json::Value =
            serde_json::from_str(&line).map_err(|e| format!("line {at} is not JSON: {e}"))?;
        let is_request = event["type"] == "model_request";
        if let Some(request) =
            event.get_mut("request").filter(|_| is_request).and_then(serde_json::Value::as_object_mut)
        {
            let kept = request.remove("messages_kept").map(|k| k.as_u64().unwrap_or(u64::MAX));
            let added = request.remove("messages_added");
            match (kept, added) {
                (Some(kept), Some(serde_json::Value::Array(added))) => {
                    let before = previous.get("messages").and_then(serde_json::Value::as_array).map_or(&[][..], |m| m);
                    let head = usize::try_from(kept).ok().and_then(|k| before.get(..k)).ok_or_else(|| {
                        format!(
                            "line {at} continues {kept} messages of a request; the file holds {} before it",
                            before.len()
                        )
                    })?;
                    let messages: Vec<serde_json::Value> = head.iter().cloned().chain(added).collect();
                    request.insert("messages".into(), serde_json::Value::Array(messages));
                    for key in ["system", "tools"] {
                        if !request.contains_key(key) {
                            request.insert(key.into(), previous.get(key).cloned().unwrap_or_default());
                        }
                    }
                }
                (None, None) => {}
                _ => return Err(format!("line {at}: a request with messages_kept needs messages_added")),
            }
        }
        serde_json::to_writer(&mut out, &event).map_err(|e| e.to_string())?;
        out.write_all(b"\n").map_err(|e| e.to_string())?;
        if is_request
            && let Some(serde_json::Value::Object(request)) = event.get_mut("request").map(serde_json::Value::take)
        {
            previous = request;
        }
    }
    Ok(())
}

/// What [`append`] did with a line.
#[derive(Debug, PartialEq, Eq)]
enum Appended {
    /// Written; the file's size after it, and whether the file still holds
    /// every request its next continued line may continue.
    Written { size: u64, chain_kept: bool },
    /// Not written: a continued request whose file does not hold the
    /// request it continues.
    Orphan,
}

/// Appends one line (newline included) to a session's file. A file that
/// would pass `max` is rotated before a whole request, so that each file
/// begins with one; before any other line only once it would pass twice
/// `max`, and then the requests after it start over (a continued request
/// is not written: its file would not hold the one it continues). The file
/// a rotation replaces is freed by `reaper`.
fn append(path: &Path, line: &str, kind: LineKind, max: u64, reaper: &Reaper) -> std::io::Result<Appended> {
    let size = match std::fs::metadata(path) {
        Ok(m) => m.len(),
        // Removed (swept, or its session deleted): nothing to continue.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && kind == LineKind::Continued => {
            return Ok(Appended::Orphan);
        }
        Err(_) => 0,
    };
    let len = line.len() as u64;
    let limit = if kind == LineKind::Whole { max } else { max.saturating_mul(2) };
    let rotate = size > 0 && size + len > limit;
    if rotate {
        let mut rotated = path.as_os_str().to_owned();
        rotated.push(".1");
        reaper.rename_over(path, Path::new(&rotated))?;
        if kind == LineKind::Continued {
            return Ok(Appended::Orphan);
        }
    }
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
    f.write_all(line.as_bytes())?;
    let size = if rotate { len } else { size + len };
    Ok(Appended::Written { size, chain_kept: !rotate || kind == LineKind::Whole })
}

/// Removes trace files untouched for `max_age`; returns the sessions whose
/// current file went.
fn sweep(dir: &Path, max_age: Duration, reaper: &Reaper) -> Vec<String> {
    let mut gone = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return gone };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let is_trace = name.ends_with(".jsonl") || name.ends_with(".jsonl.1");
        let old =
            e.metadata().and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok()).is_some_and(|a| a > max_age);
        if is_trace
            && old
            && reaper.remove(&e.path()).is_ok()
            && let Some(session) = name.strip_suffix(".jsonl")
        {
            gone.push(session.to_owned());
        }
    }
    gone
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tracer whose writer never takes anything off its queue (a disk
    /// that blocks forever); the receiver is returned to keep it open.
    fn stuck(queue: usize) -> (Tracer, mpsc::Receiver<Op>) {
        let (tx, rx) = mpsc::sync_channel(queue);
        let writer = Arc::new(Writer { tx, shared: Arc::default() });
        (Tracer { writer: Some(writer) }, rx)
    }

    fn scope() -> Scope {
        Scope {
            agent: "a".into(),
            session_id: "s".into(),
            query_id: "q".into(),
            deadline: tokio::time::Instant::now() + Duration::from_secs(60),
            audit: None,
        }
    }

    /// A stuck writer costs the first query's end FLUSH_WAIT, and the
    /// next ones nothing; events past the queue are dropped and counted,
    /// each `emit` returning at once.
    #[tokio::test(start_paused = true)]
    async fn a_stuck_writer_costs_one_flush_wait_and_then_nothing() {
        let (tracer, _rx) = stuck(4);
        let started = tokio::time::Instant::now();
        for _ in 0..10 {
            tracer.emit(&scope(), TraceEvent::Error { code: "OK", message: "m" }).await;
        }
        assert_eq!(started.elapsed(), Duration::ZERO, "emitting never waits");
        assert_eq!(tracer.dropped().unwrap().load(Ordering::Relaxed), 6, "4 queued, 6 dropped");

        let (tracer, _rx) = stuck(64);
        let started = tokio::time::Instant::now();
        tracer.flush().await;
        assert_eq!(started.elapsed(), FLUSH_WAIT);
        let again = tokio::time::Instant::now();
        tracer.flush().await;
        tracer.flush().await;
        assert_eq!(again.elapsed(), Duration::ZERO, "a stalled writer is not waited for again");
    }

    /// A writer that works answers a flush once every line before it is
    /// on disk, in order.
    #[tokio::test]
    async fn flush_returns_once_the_lines_are_written() {
        let dir = std::env::temp_dir().join(format!("lattice-trace-unit-{}", std::process::id()));
        let settings = TraceSettings {
            dir: dir.clone(),
            queue_events: 16,
            max_file_bytes: 1 << 20,
            max_age: Duration::from_secs(60),
        };
        let tracer = Tracer::start(settings).unwrap();
        for code in ["one", "two", "three"] {
            tracer.emit(&scope(), TraceEvent::Error { code, message: "m" }).await;
        }
        tracer.flush().await;
        let text = std::fs::read_to_string(dir.join("s.jsonl")).unwrap();
        let codes: Vec<&str> =
            text.lines().map(|l| l.split("\"code\":\"").nth(1).unwrap().split('"').next().unwrap()).collect();
        assert_eq!(codes, ["one", "two", "three"]);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A rotation keeps the file it replaces open and hands it to the
    /// reaper, which frees it; the writer goes on with the next line.
    #[test]
    fn a_rotation_hands_the_file_it_replaces_to_the_reaper() -> std::io::Result<()> {
        let dir = std::env::temp_dir().join(format!("lattice-trace-reap-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("s.jsonl");
        let (tx, reaped) = mpsc::channel();
        let reaper = Reaper { tx: Some(tx) };
        // What the reaper was handed, read through the file it holds.
        let next_reaped = || -> std::io::Result<Option<String>> {
            let Ok(mut held) = reaped.try_recv() else { return Ok(None) };
            let mut text = String::new();
            std::io::Read::read_to_string(&mut held, &mut text)?;
            Ok(Some(text))
        };
        for line in ["first\n", "second\n", "third\n"] {
            append(&path, line, LineKind::Whole, 8, &reaper)?;
        }
        let rotated = dir.join("s.jsonl.1");
        assert_eq!(std::fs::read_to_string(&path)?, "third\n");
        assert_eq!(std::fs::read_to_string(&rotated)?, "second\n");
        // The first rotation replaced nothing; the second replaced "first",
        // whose file the reaper holds open though its name is gone.
        assert_eq!(next_reaped()?.as_deref(), Some("first\n"), "the replaced file");
        assert_eq!(next_reaped()?, None, "one file replaced");
        // A removal hands its file over too.
        reaper.remove(&rotated)?;
        assert!(!rotated.exists());
        assert_eq!(next_reaped()?.as_deref(), Some("second\n"), "the removed file");
        std::fs::remove_dir_all(dir)
    }

    /// Within a query, a request continues the one before it as far as both
    /// are the conversation; across queries, as far as the conversation is
    /// committed; never past a history shorter than what was committed.
    #[test]
    fn a_request_continues_what_the_previous_one_shares_with_it() {
        let chains = Chains::default();
        let tools: Arc<[ToolSpec]> = Arc::from(Vec::new());
        assert_eq!(chains.extend("s", "q1", 3, 2, &tools, None).kept, 0, "the session's first request is whole");
        assert_eq!(chains.extend("s", "q1", 5, 2, &tools, None).kept, 3, "the same query: the whole previous request");
        assert_eq!(chains.extend("s", "q1", 4, 2, &tools, None).kept, 4, "a hook reshaped the fifth message");
        // q1 failed: q2's conversation shares q1's history only.
        assert_eq!(chains.extend("s", "q2", 3, 2, &tools, None).kept, 2);
        chains.committed("s", "q2", 6);
        chains.committed("s", "q1", 9);
        // q2 committed six messages; q3 continues its whole last request.
        assert_eq!(chains.extend("s", "q3", 7, 6, &tools, None).kept, 3);
        assert_eq!(chains.extend("s", "q3", 0, 6, &tools, None).kept, 0, "nothing shared: whole");
        assert_eq!(chains.extend("s", "q3", 8, 6, &tools, None).kept, 0, "after a whole line with nothing shared");
        // A history shorter than what was committed is not this chain's.
        assert_eq!(chains.extend("s", "q4", 3, 2, &tools, None).kept, 0);
        chains.end("s");
        assert_eq!(chains.extend("s", "q4", 4, 2, &tools, None).kept, 0, "an ended chain starts over");
        assert_eq!(chains.extend("other", "q9", 4, 2, &tools, None).kept, 0, "chains are per session");
    }

    /// A continued line leaves the tools out when they are the same list
    /// as its previous line's (a hook's list of equal tools is another),
    /// and the system prompt when both are their agent's same prompt (one a
    /// hook replaced is not the agent's, whatever its text).
    #[test]
    fn a_continued_line_leaves_out_the_tools_and_prompt_it_shares() {
        let chains = Chains::default();
        let spec = ToolSpec { name: "t".into(), description: "d".into(), input_schema: Default::default() };
        let (agent, reshaped): (Arc<[ToolSpec]>, Arc<[ToolSpec]>) =
            (Arc::from(vec![spec.clone()]), Arc::from(vec![spec]));
        let (prompt, reloaded): (Arc<str>, Arc<str>) = (Arc::from("be brief"), Arc::from("be brief"));
        let sharing = |kept, tools, system| Sharing { kept, tools, system };
        let extend = |n, tools, system| chains.extend("s", "q", n, 0, tools, system);
        assert_eq!(extend(1, &agent, Some(&prompt)), sharing(0, false, false), "whole: both are on the line");
        assert_eq!(extend(2, &agent, Some(&prompt)), sharing(1, true, true));
        assert_eq!(extend(3, &reshaped, None), sharing(2, false, false));
        assert_eq!(extend(4, &agent, Some(&prompt)), sharing(3, false, false));
        assert_eq!(extend(5, &agent, Some(&prompt)), sharing(4, true, true));
        assert_eq!(extend(6, &agent, Some(&reloaded)), sharing(5, true, false), "another agent's prompt");
        assert_eq!(extend(7, &agent, Some(&reloaded)), sharing(6, true, true));
        assert_eq!(extend(8, &agent, None), sharing(7, true, false));
        assert_eq!(extend(9, &agent, None), sharing(8, true, false), "a hook's prompt is never left out");
    }

    /// Past CHAINS_KEPT sessions every chain starts over, rather than the
    /// map growing with every session ever traced.
    #[test]
    fn chains_are_kept_for_a_bounded_number_of_sessions() {
        let chains = Chains::default();
        let tools: Arc<[ToolSpec]> = Arc::from(Vec::new());
        for i in 0..CHAINS_KEPT {
            chains.extend(&format!("s{i}"), "q", 1, 0, &tools, None);
        }
        assert_eq!(chains.extend("s0", "q", 2, 0, &tools, None).kept, 1, "a known session continues");
        assert_eq!(chains.extend("new", "q", 1, 0, &tools, None).kept, 0);
        assert_eq!(chains.lock().len(), 1, "the map started over");
        assert_eq!(chains.extend("s1", "q", 2, 0, &tools, None).kept, 0);
    }

    /// A file is rotated before a whole request that would take it past
    /// the limit; any other line rotates it only past twice the limit, and
    /// then says the file no longer holds the chain; a continued request
    /// whose file is gone, or would be rotated away, is not written.
    #[test]
    fn files_rotate_before_whole_requests_and_never_orphan_a_continued_one() -> std::io::Result<()> {
        let dir = std::env::temp_dir().join(format!("lattice-trace-chain-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("s.jsonl");
        let reaper = Reaper { tx: None };
        let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
        assert_eq!(append(&path, "c\n", LineKind::Continued, 10, &reaper)?, Appended::Orphan, "no file");
        assert!(!path.exists());
        let written = |size| Appended::Written { size, chain_kept: true };
        assert_eq!(append(&path, "whole1\n", LineKind::Whole, 10, &reaper)?, written(7));
        assert_eq!(append(&path, "cont\n", LineKind::Continued, 10, &reaper)?, written(12), "past the limit");
        assert_eq!(append(&path, "x\n", LineKind::Other, 10, &reaper)?, written(14));
        assert_eq!(append(&path, "whole2\n", LineKind::Whole, 10, &reaper)?, written(7), "rotated first");
        assert_eq!(read(&dir.join("s.jsonl.1")), "whole1\ncont\nx\n");
        assert_eq!(read(&path), "whole2\n");
        // Other lines go on to twice the limit, then rotate and end the chain.
        assert_eq!(append(&path, "other-line\n", LineKind::Other, 10, &reaper)?, written(18));
        let broke = append(&path, "more\n", LineKind::Other, 10, &reaper)?;
        assert_eq!(broke, Appended::Written { size: 5, chain_kept: false });
        assert_eq!(read(&path), "more\n");
        // A continued request that would pass twice the limit rotates the
        // file and is not written.
        assert_eq!(append(&path, "a-long-continued-line\n", LineKind::Continued, 10, &reaper)?, Appended::Orphan);
        assert!(!path.exists() && read(&dir.join("s.jsonl.1")) == "more\n");
        std::fs::remove_dir_all(dir)
    }

    /// A request with the agent's `prompt`.
    fn request<'a>(prompt: &'a str, messages: &'a [Message]) -> ModelRequest<'a> {
        ModelRequest {
            system: std::borrow::Cow::Borrowed(prompt),
            messages: messages.into(),
            tools: Arc::from(Vec::new()),
        }
    }

    /// A request as a file holds it: its query and turn, and its messages.
    type Read = ((String, u64), Vec<serde_json::Value>);

    /// The requests a file holds, each made whole again, and how many
    /// messages the file holds for them.
    fn requests_in(path: &Path) -> Result<(Vec<Read>, usize), String> {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let (mut whole, mut recorded): (Vec<Read>, usize) = (Vec::new(), 0);
        for line in text.lines() {
            let line: serde_json::Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
            if line["type"] != "model_request" {
                continue;
            }
            let r = &line["request"];
            let messages = match (r["messages"].as_array(), r["messages_kept"].as_u64(), r["messages_added"].as_array())
            {
                (Some(m), None, None) => {
                    recorded += m.len();
                    m.clone()
                }
                (None, Some(kept), Some(added)) => {
                    let before = whole.last().map(|(_, m)| m.as_slice()).unwrap_or_default();
                    let mut m = before
                        .get(..kept as usize)
                        .ok_or(format!("continues more than the file holds: {line}"))?
                        .to_vec();
                    recorded += added.len();
                    m.extend(added.iter().cloned());
                    m
                }
                _ => return Err(format!("neither whole nor continued: {line}")),
            };
            let at = (line["query_id"].as_str().unwrap_or_default().to_owned(), line["turn"].as_u64().unwrap_or(0));
            whole.push((at, messages));
        }
        Ok((whole, recorded))
    }

    fn as_json(messages: &[Message]) -> Vec<serde_json::Value> {
        messages.iter().map(|m| serde_json::to_value(m).unwrap_or_default()).collect()
    }

    /// Requests over four queries (one of them failed, one reshaped by a
    /// hook, which also replaced its system prompt) read back from the file
    /// as they were sent, while the file holds far fewer messages than they
    /// sent, and the agent's prompt only where the previous line did not
    /// have it; a small limit rotates the
    /// file, and each file still reads on its own. (With the limit, the
    /// writer is waited for after each request: a rotation then never
    /// drops one.)
    #[tokio::test]
    async fn a_trace_file_reads_back_every_request_as_sent() -> Result<(), String> {
        for (max, rotated) in [(1u64 << 20, false), (700, true)] {
            let dir = std::env::temp_dir().join(format!("lattice-trace-requests-{}-{max}", std::process::id()));
            let settings = TraceSettings {
                dir: dir.clone(),
                queue_events: 64,
                max_file_bytes: max,
                max_age: Duration::from_secs(60),
            };
            let tracer = Tracer::start(settings)?;
            let prompt: Arc<str> = Arc::from("be brief");
            // Each request's system prompt, as sent.
            let mut systems: Vec<String> = Vec::new();
            let at = |query: &str| Scope { query_id: query.into(), ..scope() };
            let text = |i: usize| Message::user_text(format!("message number {i} of the conversation"));
            let mut sent: Vec<Read> = Vec::new();
            let mut committed: Vec<Message> = Vec::new();
            for (q, outcome) in ["committed", "failed", "reshaped", "committed"].into_iter().enumerate() {
                let scope = at(&format!("q{q}"));
                let history = committed.len();
                let mut conversation = committed.clone();
                for turn in 1..=3u32 {
                    conversation.push(text(100 * q + turn as usize));
                    let reshaped: Vec<Message>;
                    let request = if outcome == "reshaped" && turn == 2 {
                        // A hook redacts the second message.
                        reshaped = conversation
                            .iter()
                            .enumerate()
                            .map(|(i, m)| if i == 1 { text(999) } else { m.clone() })
                            .collect();
                        let mut request = request(&prompt, &reshaped);
                        request.system = std::borrow::Cow::Owned("be brief, redacted".into());
                        request
                    } else {
                        request(&prompt, &conversation)
                    };
                    tracer.emit_request(&scope, turn, &request, &prompt, &conversation, history).await;
                    systems.push(request.system.to_string());
                    sent.push(((scope.query_id.clone(), u64::from(turn)), as_json(&request.messages)));
                    if rotated {
                        // A writer that keeps up.
                        tracer.flush().await;
                    }
                    tracer.emit(&scope, TraceEvent::ToolUse { turn, id: "t", name: "tool" }).await;
                }
                if outcome != "failed" {
                    tracer.committed(&scope, conversation.len());
                    committed = conversation;
                }
                // As at the end of each query.
                tracer.flush().await;
            }
            let (mut read, mut recorded) = requests_in(&dir.join("s.jsonl.1"))?;
            let (current, more) = requests_in(&dir.join("s.jsonl"))?;
            read.extend(current);
            recorded += more;
            for (at, messages) in &read {
                let sent = sent.iter().find(|(s, _)| s == at).map(|(_, m)| m);
                assert_eq!(sent, Some(messages), "{max}: {at:?} as sent");
            }
            assert_eq!(dir.join("s.jsonl.1").exists(), rotated);
            if !rotated {
                assert_eq!(read, sent, "every request, in order");
                let total: usize = sent.iter().map(|(_, m)| m.len()).sum();
                assert!(recorded * 2 < total, "{recorded} messages recorded for {total} sent");
                // The prompt: on the first line, the hook's, and the line
                // after the hook's; `expand` gives each request its own.
                let raw = std::fs::read_to_string(dir.join("s.jsonl")).map_err(|e| e.to_string())?;
                assert_eq!(raw.matches(r#""system":"#).count(), 3, "{raw}");
                let mut whole = Vec::new();
                expand(raw.as_bytes(), &mut whole)?;
                let expanded: Vec<serde_json::Value> = String::from_utf8_lossy(&whole)
                    .lines()
                    .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                    .filter(|e| e["type"] == "model_request")
                    .map(|e| e["request"]["system"].clone())
                    .collect();
                assert_eq!(expanded, systems.iter().map(|s| serde_json::json!(s)).collect::<Vec<_>>());
            } else {
                // Rotated only before whole requests: none was dropped, and
                // both files hold some.
                assert_eq!(tracer.dropped().map(|d| d.load(Ordering::Relaxed)), Some(0));
                assert!(read.len() >= 2, "{max}: {} requests read", read.len());
            }
            let _ = std::fs::remove_dir_all(dir);
        }
        Ok(())
    }

    /// `expand` gives every request its messages, prompt and tools back,
    /// leaves other lines as they are, and names a line that continues more
    /// than the file holds, or is not JSON.
    #[test]
    fn expand_makes_every_request_whole() -> Result<(), String> {
        let file = [
            r#"{"type":"model_request","turn":1,"request":{"system":"s","messages":[1,2],"tools":["a"]}}"#,
            r#"{"type":"tool_use","turn":1,"id":"t","name":"n"}"#,
            r#"{"type":"model_request","turn":2,"request":{"messages_kept":2,"messages_added":[3]}}"#,
            r#"{"type":"model_request","turn":3,"request":{"system":"t","messages_kept":1,"messages_added":[4,5],"tools":["b"]}}"#,
            r#"{"type":"model_request","turn":4,"request":{"messages_kept":3,"messages_added":[]}}"#,
        ]
        .join("\n");
        let mut out = Vec::new();
        expand(file.as_bytes(), &mut out)?;
        let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out)
            .lines()
            .map(serde_json::from_str)
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        let messages: Vec<&serde_json::Value> = lines.iter().map(|l| &l["request"]["messages"]).collect();
        let expected = [
            serde_json::json!([1, 2]),
            serde_json::Value::Null,
            serde_json::json!([1, 2, 3]),
            serde_json::json!([1, 4, 5]),
            serde_json::json!([1, 4, 5]),
        ];
        assert_eq!(messages, expected.iter().collect::<Vec<_>>());
        let tools: Vec<&serde_json::Value> = lines.iter().map(|l| &l["request"]["tools"]).collect();
        let (a, b) = (serde_json::json!(["a"]), serde_json::json!(["b"]));
        assert_eq!(tools, [&a, &serde_json::Value::Null, &a, &b, &b], "tools left out are the previous request's");
        let systems: Vec<&serde_json::Value> = lines.iter().map(|l| &l["request"]["system"]).collect();
        let (s, t) = (serde_json::json!("s"), serde_json::json!("t"));
        assert_eq!(systems, [&s, &serde_json::Value::Null, &s, &t, &t], "a prompt left out is the previous request's");
        assert!(
            lines
                .iter()
                .all(|l| l["request"].get("messages_kept").is_none() && l["request"].get("messages_added").is_none())
        );
        assert_eq!(lines[1], serde_json::json!({"type": "tool_use", "turn": 1, "id": "t", "name": "n"}));

        let orphan = r#"{"type":"model_request","turn":1,"request":{"messages_kept":1,"messages_added":[]}}"#;
        let error = expand(orphan.as_bytes(), Vec::new()).err().unwrap_or_default();
        assert!(error.contains("line 1 continues 1 messages") && error.contains("holds 0"), "{error}");
        let error = expand("{}\nnot json".as_bytes(), Vec::new()).err().unwrap_or_default();
        assert!(error.starts_with("line 2 is not JSON"), "{error}");
        Ok(())
    }
}
