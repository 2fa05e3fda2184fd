//! The trace files' writer: a thread of its own with a bounded queue,
//! rotation, deletion with the session, the age sweep, and the reaper
//! thread that closes removed files.

use super::*;

pub(super) enum Op {
    /// A line of a session's file, its newline included.
    Line {
        session: String,
        line: String,
        kind: LineKind,
    },
    /// A session's files to delete, and who waits for that.
    Delete(String, tokio::sync::oneshot::Sender<()>),
    Flush(tokio::sync::oneshot::Sender<()>),
}

#[derive(Debug)]
pub(super) struct Writer {
    pub(super) tx: mpsc::SyncSender<Op>,
    pub(super) shared: Arc<Shared>,
}

/// What the writer thread shares with the tracers.
#[derive(Debug, Default)]
pub(super) struct Shared {
    /// Lines not written: a full queue, or a request whose file no longer
    /// holds the one it continues (shared with a metric).
    pub(super) dropped: Arc<AtomicUsize>,
    /// Set when a flush was not answered in time; cleared when the writer
    /// finishes something.
    pub(super) stalled: AtomicBool,
    /// Each session's run of requests in its file.
    pub(super) chains: Chains,
}

impl Writer {
    /// Queues `op` unless the queue is full (then a line is counted as
    /// dropped). Whether it was queued.
    pub(super) fn send(&self, op: Op) -> bool {
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
pub(super) fn write_loop(settings: TraceSettings, rx: mpsc::Receiver<Op>, shared: Arc<Shared>) {
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
            Op::Delete(session, done) => {
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
                let _ = done.send(());
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
pub(super) struct Reaper {
    pub(super) tx: Option<mpsc::Sender<std::fs::File>>,
}

impl Reaper {
    /// Starts the reaper's thread; without one, files are closed in place.
    pub(super) fn start() -> Self {
        let (tx, rx) = mpsc::channel::<std::fs::File>();
        let spawned = std::thread::Builder::new().name("lattice-trace-reaper".into()).spawn(move || {
            for file in rx {
                drop(file);
            }
        });
        Self { tx: spawned.ok().map(|_| tx) }
    }

    /// Closes `file` on the reaper's thread.
    pub(super) fn close(&self, file: std::fs::File) {
        if let Some(tx) = &self.tx {
            // If the thread is gone, the file comes back in the error and
            // is closed here.
            let _ = tx.send(file);
        }
    }

    /// Removes the file at `path`, its blocks freed on the reaper's thread.
    pub(super) fn remove(&self, path: &Path) -> std::io::Result<()> {
        self.unlinking(path, || std::fs::remove_file(path))
    }

    /// Renames `from` over `to`, the file it replaces freed on the reaper's
    /// thread.
    pub(super) fn rename_over(&self, from: &Path, to: &Path) -> std::io::Result<()> {
        self.unlinking(to, || std::fs::rename(from, to))
    }

    /// Runs `unlink`, which takes the name `path` from its file, holding
    /// that file open across it and then handing it to the reaper's thread.
    pub(super) fn unlinking(&self, path: &Path, unlink: impl FnOnce() -> std::io::Result<()>) -> std::io::Result<()> {
        let held = std::fs::File::open(path);
        unlink()?;
        if let Ok(file) = held {
            self.close(file);
        }
        Ok(())
    }
}

/// What [`append`] did with a line.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Appended {
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
pub(super) fn append(path: &Path, line: &str, kind: LineKind, max: u64, reaper: &Reaper) -> std::io::Result<Appended> {
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
pub(super) fn sweep(dir: &Path, max_age: Duration, reaper: &Reaper) -> Vec<String> {
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
