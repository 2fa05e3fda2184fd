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

/// Deleting a session while the writer is behind (its queue full) waits
/// for the writer, which then deletes the session's files: the deletion is
/// neither dropped nor answered before the files are gone.
#[tokio::test]
async fn a_deletion_waits_for_a_writer_behind_and_is_never_dropped() -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("lattice-trace-delete-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let files = [dir.join("gone.jsonl"), dir.join("gone.jsonl.1")];
    for file in &files {
        std::fs::write(file, "{}\n").map_err(|e| e.to_string())?;
    }
    // A queue of one, full, and its writer not started yet (a disk behind).
    let (tracer, rx) = stuck(1);
    tracer.emit(&scope(), TraceEvent::Error { code: "OK", message: "m" }).await;
    let shared = tracer.writer.as_ref().map(|w| w.shared.clone()).ok_or("no writer")?;
    let deleting = {
        let tracer = tracer.clone();
        tokio::spawn(async move { tracer.delete("gone").await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!deleting.is_finished(), "the deletion returned while the writer had not taken it");
    let settings =
        TraceSettings { dir: dir.clone(), queue_events: 1, max_file_bytes: 1 << 20, max_age: Duration::from_secs(60) };
    std::thread::spawn(move || write_loop(settings, rx, shared));
    deleting.await.map_err(|e| e.to_string())?;
    assert!(files.iter().all(|f| !f.exists()), "the session's trace files are still there");
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

/// A writer that works answers a flush once every line before it is
/// on disk, in order.
#[tokio::test]
async fn flush_returns_once_the_lines_are_written() {
    let dir = std::env::temp_dir().join(format!("lattice-trace-unit-{}", std::process::id()));
    let settings =
        TraceSettings { dir: dir.clone(), queue_events: 16, max_file_bytes: 1 << 20, max_age: Duration::from_secs(60) };
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
    let (agent, reshaped): (Arc<[ToolSpec]>, Arc<[ToolSpec]>) = (Arc::from(vec![spec.clone()]), Arc::from(vec![spec]));
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
    ModelRequest { system: std::borrow::Cow::Borrowed(prompt), messages: messages.into(), tools: Arc::from(Vec::new()) }
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
        let messages = match (r["messages"].as_array(), r["messages_kept"].as_u64(), r["messages_added"].as_array()) {
            (Some(m), None, None) => {
                recorded += m.len();
                m.clone()
            }
            (None, Some(kept), Some(added)) => {
                let before = whole.last().map(|(_, m)| m.as_slice()).unwrap_or_default();
                let mut m =
                    before.get(..kept as usize).ok_or(format!("continues more than the file holds: {line}"))?.to_vec();
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
        let settings =
            TraceSettings { dir: dir.clone(), queue_events: 64, max_file_bytes: max, max_age: Duration::from_secs(60) };
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
