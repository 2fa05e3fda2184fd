//! Trace files on disk: written off the query path, so a stalled disk
//! drops events (counted) instead of slowing queries; rotated by size;
//! deleted with their session; a trace_dir that can't be written stops
//! start-up with the reason.

use std::time::Duration;

use lattice_proto::agent::v1 as pb;
use lattice_tests::{Lattice, QueryOpts, cfg, sample, temp_dir, workspace_binary};

fn in_session(sid: &str, prompt: &str) -> QueryOpts {
    QueryOpts { agent: "a".into(), prompt: prompt.into(), session: Some(sid.to_owned()), ..Default::default() }
}

/// The session's trace file becomes a FIFO nobody reads: opening it blocks
/// the writer for good. Queries go on being served, and the events that
/// could not be queued are counted.
#[tokio::test(flavor = "multi_thread")]
async fn a_stalled_trace_disk_never_slows_queries() {
    let config = "[server]\ntrace_queue_events = 16\n".to_owned() + &cfg::agent("a", "") + &cfg::turn("ok", &[]);
    let lattice = Lattice::spawn(&config, &[]).await;
    let first = lattice.query("a", "hi").await;
    assert_eq!(first.ok().text, "ok");
    let sid = first.session_id();
    let file = lattice.trace_dir.join(format!("{sid}.jsonl"));
    assert!(file.exists(), "the first query's trace was written");
    std::fs::remove_file(&file).unwrap();
    let made = std::process::Command::new("mkfifo").arg(&file).status().expect("mkfifo");
    assert!(made.success());

    let many = async {
        for i in 0..40 {
            let out = lattice.query_with(in_session(&sid, &format!("q{i}"))).await;
            assert_eq!(out.ok().text, "ok", "query {i}");
        }
    };
    tokio::time::timeout(Duration::from_secs(30), many).await.expect("queries are not held up by the trace writer");
    let dropped = sample(&lattice.metrics().await, "lattice_trace_events_dropped_total").unwrap_or(0.0);
    assert!(dropped > 0.0, "dropped events are counted");
    assert!(lattice.process_logs().contains("trace writer stalled"));
}

/// A file about to pass trace_max_file_bytes is rotated to .1; deleting
/// the session deletes both.
#[tokio::test(flavor = "multi_thread")]
async fn trace_files_rotate_and_go_with_their_session() {
    let config = "[server]\ntrace_max_file_bytes = 3000\n".to_owned()
        + &cfg::agent("a", "")
        + "[[agents.model.script]]\ntext = \"{{last_user_text}}\"\n";
    let lattice = Lattice::spawn(&config, &[]).await;
    let first = lattice.query("a", &"x".repeat(500)).await;
    let sid = first.session_id();
    for i in 0..6 {
        assert_eq!(lattice.query_with(in_session(&sid, &format!("{i}{}", "y".repeat(400)))).await.ok().text.len(), 401);
    }
    let (current, rotated) =
        (lattice.trace_dir.join(format!("{sid}.jsonl")), lattice.trace_dir.join(format!("{sid}.jsonl.1")));
    assert!(rotated.exists(), "the file was rotated");
    let size = std::fs::metadata(&current).unwrap().len();
    assert!(size <= 3000, "{size} bytes");
    let last = std::fs::read_to_string(&current).unwrap();
    assert!(last.lines().last().unwrap().contains("\"type\":\"audit\""), "the newest events are in the current file");

    let mut client = lattice.client().await;
    client.delete_session(pb::DeleteSessionRequest { session_id: sid.clone() }).await.unwrap();
    assert!(!current.exists() && !rotated.exists(), "a deleted session's traces are deleted");
}

/// A trace_dir that can't be written (here: under a regular file) stops
/// `lattice serve` at start-up, saying which directory and why.
#[tokio::test(flavor = "multi_thread")]
async fn an_unwritable_trace_dir_stops_start_up() {
    let dir = temp_dir("trace-ro");
    std::fs::write(dir.join("file"), "").unwrap();
    let config = format!(
        "[server]\ntrace_dir = {:?}\n[server.auth]\nmode = \"none\"\n",
        dir.join("file/traces").display().to_string()
    ) + &cfg::agent("a", "")
        + &cfg::turn("ok", &[]);
    let path = dir.join("lattice.toml");
    std::fs::write(&path, config).unwrap();
    let out = tokio::process::Command::new(workspace_binary("lattice"))
        .args(["serve", "--config"])
        .arg(&path)
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "off"])
        .output();
    let out = tokio::time::timeout(Duration::from_secs(15), out).await.expect("it stops").unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("server.trace_dir") && stderr.contains("not writable"), "{stderr}");
}

/// A Lattice of a test that passes leaves nothing behind when dropped: its
/// trace directory, and a process's config and log with it.
#[tokio::test]
async fn a_dropped_lattice_leaves_no_files_behind() {
    let config = cfg::agent("a", "") + &cfg::turn("ok", &[]);
    let in_process = Lattice::start(&config).await;
    let spawned = Lattice::spawn(&config, &[]).await;
    let mut dirs = vec![];
    for lattice in [in_process, spawned] {
        let out = lattice.query("a", "hi").await;
        let trace = lattice.trace_dir.join(format!("{}.jsonl", out.session_id()));
        assert!(trace.exists(), "the query's trace was written");
        dirs.push(lattice.trace_dir.clone());
    }
    for dir in &dirs {
        assert!(!dir.exists(), "{} is left behind", dir.display());
    }
    // The process's own directory (config, log) went too.
    assert!(dirs[1].parent().is_some_and(|proc_dir| !proc_dir.exists()));
}
