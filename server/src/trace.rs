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
//! stalled. A session's file is rotated to `SESSION.jsonl.1` when it would
//! pass `server.trace_max_file_bytes`, deleted with its session, and files
//! untouched for `server.trace_max_age_s` are removed. A file removed or
//! replaced is closed on a second thread, where its blocks are freed (tens
//! of milliseconds for a large one), so that no flush waits for that.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
        mpsc,
    },
    time::{Duration, SystemTime},
};

use serde::Serialize;
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
        request: &'a ModelRequest<'a>,
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
    },
    Delete(String),
    Flush(tokio::sync::oneshot::Sender<()>),
}

#[derive(Debug)]
struct Writer {
    tx: mpsc::SyncSender<Op>,
    dropped: Arc<AtomicUsize>,
    /// Set when a flush was not answered in time; cleared when the writer
    /// finishes something.
    stalled: Arc<AtomicBool>,
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
        let writer = Arc::new(Writer { tx, dropped: Arc::default(), stalled: Arc::default() });
        let stalled = writer.stalled.clone();
        std::thread::Builder::new()
            .name("lattice-trace".into())
            .spawn(move || write_loop(settings, rx, stalled))
            .map_err(|e| format!("cannot start the trace writer: {e}"))?;
        Ok(Self { writer: Some(writer) })
    }

    /// Events dropped because the queue was full, shared, for a metric.
    pub fn dropped(&self) -> Option<Arc<AtomicUsize>> {
        self.writer.as_ref().map(|w| w.dropped.clone())
    }

    /// Deletes a session's trace files, if this replica wrote any.
    pub async fn delete(&self, session_id: &str) {
        if let Some(w) = &self.writer {
            w.send(Op::Delete(session_id.to_owned()));
        }
    }

    /// Waits until every line queued so far is written: at most
    /// [`FLUSH_WAIT`], and not at all while the writer is stalled.
    pub async fn flush(&self) {
        let Some(w) = &self.writer else { return };
        if w.stalled.load(Ordering::Relaxed) {
            return;
        }
        let (done, written) = tokio::sync::oneshot::channel();
        if !w.send(Op::Flush(done)) {
            return;
        }
        if tokio::time::timeout(FLUSH_WAIT, written).await.is_err() {
            w.stalled.store(true, Ordering::Relaxed);
            warn!("trace writer stalled: trace events are dropped until it catches up");
        }
    }

    /// Records one event. With no trace directory and the `lattice::trace`
    /// log target off (the default), nothing is built at all.
    pub async fn emit(&self, scope: &Scope, event: TraceEvent<'_>) {
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
            w.send(Op::Line { session: scope.session_id.clone(), line: json });
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
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                }
                false
            }
        }
    }
}

/// The writer thread: one op at a time, in order; ends when every sender
/// is gone.
fn write_loop(settings: TraceSettings, rx: mpsc::Receiver<Op>, stalled: Arc<AtomicBool>) {
    let reaper = Reaper::start();
    let mut swept = SystemTime::now();
    while let Ok(op) = rx.recv() {
        match op {
            Op::Line { session, line } => {
                // Session ids are made by the service or validated by it
                // (letters, digits, '-'); file names are built from them only.
                let path = settings.dir.join(format!("{session}.jsonl"));
                if let Err(e) = append(&path, &line, settings.max_file_bytes, &reaper) {
                    warn!(path = %path.display(), error = %e, "cannot write trace file");
                }
            }
            Op::Delete(session) => {
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
        stalled.store(false, Ordering::Relaxed);
        if swept.elapsed().is_ok_and(|e| e >= SWEEP_EVERY) {
            sweep(&settings.dir, settings.max_age, &reaper);
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

/// Appends one line (newline included), rotating the file first if it
/// would pass `max` (the file the rotation replaces is freed by `reaper`).
fn append(path: &Path, line: &str, max: u64, reaper: &Reaper) -> std::io::Result<()> {
    let size = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    if size > 0 && size + line.len() as u64 > max {
        let mut rotated = path.as_os_str().to_owned();
        rotated.push(".1");
        reaper.rename_over(path, Path::new(&rotated))?;
    }
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
    f.write_all(line.as_bytes())
}

/// Removes trace files untouched for `max_age`.
fn sweep(dir: &Path, max_age: Duration, reaper: &Reaper) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let is_trace = name.to_str().is_some_and(|n| n.ends_with(".jsonl") || n.ends_with(".jsonl.1"));
        let old =
            e.metadata().and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok()).is_some_and(|a| a > max_age);
        if is_trace && old {
            let _ = reaper.remove(&e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tracer whose writer never takes anything off its queue (a disk
    /// that blocks forever); the receiver is returned to keep it open.
    fn stuck(queue: usize) -> (Tracer, mpsc::Receiver<Op>) {
        let (tx, rx) = mpsc::sync_channel(queue);
        let writer = Arc::new(Writer { tx, dropped: Arc::default(), stalled: Arc::default() });
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
            append(&path, line, 8, &reaper)?;
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
}
