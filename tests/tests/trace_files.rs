//! Trace files on disk: written off the query path, so a stalled disk
//! drops events (counted) instead of slowing queries; each request
//! recorded as it continues the one before; rotated by size; deleted with
//! their session; a trace_dir that can't be written stops start-up with
//! the reason.

use std::time::Duration;

use lattice_proto::agent::v1 as pb;
use lattice_tests::{
    Lattice, QueryOpts, cfg,
    hook::{Behaviour, HookServer, OnRequest},
    message_text, sample, temp_dir, traced_requests, workspace_binary,
};
use tonic::Code;

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
    assert_eq!(first.expect_ok().text, "ok");
    let sid = first.session_id();
    let file = lattice.trace_dir.join(format!("{sid}.jsonl"));
    assert!(file.exists(), "the first query's trace was written");
    std::fs::remove_file(&file).unwrap();
    let made = std::process::Command::new("mkfifo").arg(&file).status().expect("mkfifo");
    assert!(made.success());

    let many = async {
        for i in 0..40 {
            let out = lattice.query_with(in_session(&sid, &format!("q{i}"))).await;
            assert_eq!(out.expect_ok().text, "ok", "query {i}");
        }
    };
    tokio::time::timeout(Duration::from_secs(30), many).await.expect("queries are not held up by the trace writer");
    let dropped = sample(&lattice.metrics().await, "lattice_trace_events_dropped_total").unwrap_or(0.0);
    assert!(dropped > 0.0, "dropped events are counted");
    assert!(lattice.process_logs().contains("trace writer stalled"));
}

/// A request: its query, its turn, and each message's text and number of
/// blocks.
type Request = (String, u64, Vec<(String, usize)>);

/// A message's text and how many blocks it has, from a trace line.
fn traced_message(m: &serde_json::Value) -> (String, usize) {
    let blocks = m["content"].as_array().cloned().unwrap_or_default();
    let text = blocks.iter().filter(|b| b["type"] == "text").filter_map(|b| b["text"].as_str()).collect();
    (text, blocks.len())
}

/// The same of a message the client was streamed.
fn streamed_message(m: &pb::Message) -> (String, usize) {
    (message_text(m), m.content.len())
}

/// Over a session's queries (the tool's result, a hook that reshapes some
/// requests and replaces one query's system prompt, a query that fails
/// midway), the trace file gives back each request the model was sent,
/// while each line holds only what the request adds to the one before: the
/// last query's lines hold a few messages each, however long the
/// conversation, and the agent's prompt and tools are on few lines.
#[tokio::test(flavor = "multi_thread")]
async fn a_trace_file_gives_back_each_request_as_sent_and_grows_with_what_is_new() {
    let (tools, _tools) = lattice_tests::start_example_tools().await;
    let shaper = HookServer::start(Behaviour::default()).await;
    let results = HookServer::start(Behaviour::default()).await;
    let config = cfg::agent("a", "system_prompt = \"Answer in one line.\"")
        + &cfg::turn("looking", &["lookup_customer:{ query = \"c-100\" }"])
        + &cfg::turn("done", &[])
        + &cfg::tools(&tools, 5000)
        + &cfg::hook("shaper", &shaper.url, &["model_request"], 2000)
        + &cfg::hook("results", &results.url, &["tool_result"], 2000);
    let lattice = Lattice::spawn(&config, &[]).await;
    let mut sid: Option<String> = None;
    let mut streamed: Vec<Request> = Vec::new();
    // Each request's system prompt, as streamed.
    let mut systems: Vec<String> = Vec::new();
    for i in 0..12 {
        // Queries 4-5 reach the model reshaped, query 6 with the hook's
        // system prompt; query 8 fails after its first request (the tool
        // result's hook fails), so the next query continues a conversation
        // without its messages.
        shaper.state.set(Behaviour {
            on_request: match i {
                4 | 5 => OnRequest::AppendToLastText(" [shaped]".into()),
                6 => OnRequest::AppendSystem(" [hooked]".into()),
                _ => OnRequest::Keep,
            },
            ..Default::default()
        });
        results.state.set(Behaviour { fail: (i == 8).then_some(Code::Unavailable), ..Default::default() });
        let opts = QueryOpts {
            agent: "a".into(),
            prompt: format!("question {i}"),
            session: sid.clone(),
            ..Default::default()
        };
        let out = lattice.query_with(opts).await;
        if i == 8 {
            assert_eq!(out.status.as_ref().map(|s| s.code()), Some(Code::Aborted));
        } else {
            out.expect_ok();
        }
        sid.get_or_insert(out.session_id());
        for r in out.model_requests() {
            systems.push(r.system.clone());
            streamed.push((
                out.query_id(),
                u64::from(r.turn),
                r.messages.iter().map(streamed_message).collect::<Vec<_>>(),
            ));
        }
    }
    let sid = sid.unwrap_or_default();
    let traced = traced_requests(&lattice.trace_dir.join(format!("{sid}.jsonl")));
    let read: Vec<Request> =
        traced.iter().map(|r| (r.query_id.clone(), r.turn, r.messages.iter().map(traced_message).collect())).collect();
    assert_eq!(read.len(), 23, "two requests a query, one of the failed query");
    assert_eq!(read, streamed, "each request as the model was sent it");
    assert!(streamed.iter().any(|(_, _, m)| m.iter().any(|(text, _)| text.ends_with("[shaped]"))));
    // The documented reader, in Python, reads the same requests.
    let page = std::fs::read_to_string(lattice_tests::workspace_root().join("docs/observability.md")).unwrap();
    let reader = page
        .split("To read every request whole in a program of your own:\n\n```python\n")
        .nth(1)
        .and_then(|r| r.split("```").next());
    assert!(reader.is_some(), "docs/observability.md holds the Python reader");
    let file = lattice.trace_dir.join(format!("{sid}.jsonl"));
    let script = reader.unwrap_or_default().replace("DIR/SESSION_ID.jsonl", &file.display().to_string())
        + "print(json.dumps([[r['request']['messages'], r['request']['tools'], r['request']['system']] for r in requests]))\n";
    let by_python: Vec<(Vec<serde_json::Value>, serde_json::Value, String)> =
        serde_json::from_str(&lattice_tests::piped("python3", &["-c", &script], b"")).unwrap();
    let tools = &by_python[0].1.clone();
    assert!(tools.as_array().is_some_and(|t| t.len() == 2), "the agent's two tools: {tools}");
    assert!(by_python.iter().all(|(_, t, _)| t == tools), "each request offered them");
    assert_eq!(by_python.iter().map(|(_, _, s)| s.clone()).collect::<Vec<_>>(), systems);
    assert_eq!(systems.iter().filter(|s| s.ends_with("[hooked]")).count(), 2, "query 6's two requests");
    let by_python: Vec<Vec<serde_json::Value>> = by_python.into_iter().map(|(m, _, _)| m).collect();
    assert_eq!(by_python, traced.iter().map(|r| r.messages.clone()).collect::<Vec<_>>());
    // The file holds the tools once: continued lines leave them out. The
    // agent's prompt is on the first line and the one after query 6's two
    // (its hook's prompt is on both of them).
    let raw = std::fs::read_to_string(&file).unwrap();
    assert_eq!(raw.matches("\"tools\":").count(), 1, "{raw}");
    assert_eq!(raw.matches("\"system\":").count(), 4, "{raw}");
    // So does `lattice trace`.
    let expanded = std::process::Command::new(workspace_binary("lattice")).arg("trace").arg(&file).output().unwrap();
    assert!(expanded.status.success(), "{}", String::from_utf8_lossy(&expanded.stderr));
    let by_lattice: Vec<serde_json::Value> = String::from_utf8_lossy(&expanded.stdout)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|e| e["type"] == "model_request")
        .inspect(|e| assert_eq!(&e["request"]["tools"], tools))
        .inspect(|e| assert!(e["request"]["system"].as_str().is_some_and(|s| s.starts_with("Answer in one line."))))
        .map(|e| e["request"]["messages"].clone())
        .collect();
    assert_eq!(by_lattice, by_python.into_iter().map(serde_json::Value::from).collect::<Vec<_>>());
    let last = &traced[traced.len() - 2..];
    for r in last {
        assert!(
            r.messages.len() >= 40 && r.recorded <= 3,
            "{} messages, {} of them on the line",
            r.messages.len(),
            r.recorded
        );
    }
}

/// A file past trace_max_file_bytes is rotated to .1 before its next
/// request, which it begins whole, so each file reads on its own; no file
/// passes twice the size; deleting the session deletes both.
#[tokio::test(flavor = "multi_thread")]
async fn trace_files_rotate_and_go_with_their_session() {
    let config = "[server]\ntrace_max_file_bytes = 4000\n".to_owned()
        + &cfg::agent("a", "")
        + "[[agents.model.script]]\ntext = \"{{last_user_text}}\"\n";
    let lattice = Lattice::spawn(&config, &[]).await;
    let first = lattice.query("a", &"x".repeat(100)).await;
    let sid = first.session_id();
    for i in 0..11 {
        assert_eq!(
            lattice.query_with(in_session(&sid, &format!("{i:02}{}", "y".repeat(100)))).await.expect_ok().text.len(),
            102
        );
    }
    let (current, rotated) =
        (lattice.trace_dir.join(format!("{sid}.jsonl")), lattice.trace_dir.join(format!("{sid}.jsonl.1")));
    assert!(rotated.exists(), "the file was rotated");
    let size = std::fs::metadata(&current).unwrap().len();
    assert!(size <= 8000, "{size} bytes");
    for file in [&rotated, &current] {
        let first = std::fs::read_to_string(file).unwrap();
        let first = first.lines().find(|l| l.contains("\"type\":\"model_request\"")).unwrap_or_default();
        assert!(first.contains("\"messages\":["), "a file begins with a whole request: {first}");
        let requests = traced_requests(file);
        let prompt = requests.last().and_then(|r| r.messages.last()).and_then(|m| m["content"][0]["text"].as_str());
        assert!(prompt.is_some_and(|p| p.ends_with(&"y".repeat(100))), "{prompt:?}");
    }
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
