//! The shipped examples as real processes: the Rust example hooks, the
//! Python hook (generated from the .proto by grpcio-tools, here and now),
//! the example tool service, and the `lattice` CLI.

use lattice_tests::{
    Lattice, cfg,
    hook::{Behaviour, HookServer, OnResult},
    start_example, start_example_tools, start_python_hook, temp_dir,
    tool::ToolDef,
    tool::ToolServer,
    workspace_binary, workspace_root,
};

const PII: [&str; 4] =
    ["ada.lovelace@example.com", "+44 20 7946 0958", "4111 1111 1111 1111", "sk_live_51HxQ2eZvKYlo2CExampleKey9"];

/// The quickstart chain: the customer tool service, the `redact` example
/// and the `audit` example after it. The model, the client, the trace, the
/// logs and the audit log see only redacted values.
#[tokio::test(flavor = "multi_thread")]
async fn redact_then_audit_over_the_example_tools() {
    let (tools, _tools) = start_example_tools().await;
    let (redact, _r) = start_example("redact", &[]).await;
    let audit_file = temp_dir("audit").join("audit.jsonl");
    let (audit, _a) = start_example("audit", &["--file", audit_file.to_str().unwrap()]).await;
    let config = cfg::agent("support", "")
        + &cfg::turn("looking", &["lookup_customer:{ query = \"c-100\" }"])
        + &cfg::turn("model saw: {{last_tool_result}}", &[])
        + &cfg::tools(&tools, 5000)
        + &cfg::hook("redact", &redact, &["tool_result"], 2000)
        + &cfg::hook("audit", &audit, &["tool_result", "model_request"], 2000);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("support", "Find the customers").await;
    let text = out.expect_ok().text.clone();
    for marker in ["[REDACTED:email]", "[REDACTED:phone]", "[REDACTED:card]", "[REDACTED:api_key]"] {
        assert!(text.contains(marker), "{marker} missing: {text}");
    }
    assert!(text.contains("Grace Hopper"), "non-PII stays: {text}");
    let audit_log = std::fs::read_to_string(&audit_file).unwrap();
    assert!(audit_log.contains("[REDACTED:email]") && audit_log.contains("\"event\":\"model_request\""));
    for pii in PII {
        assert!(!out.everything().contains(pii), "{pii} reached the client");
        assert!(!lattice.traces().contains(pii), "{pii} reached the trace");
        assert!(!lattice_tests::logs().contains(pii), "{pii} reached the logs");
        assert!(!audit_log.contains(pii), "{pii} reached the audit log");
    }
}

/// The `truncate` example keeps the model request short without breaking a
/// tool_use/tool_result pair (Lattice would abort if it did), while the
/// stored conversation keeps everything.
#[tokio::test(flavor = "multi_thread")]
async fn the_truncate_example_shortens_requests_safely() {
    let tools = ToolServer::start(vec![ToolDef::new("t", "r")]).await;
    let (truncate, _t) = start_example("truncate", &["--keep-last", "2"]).await;
    let config = cfg::agent("x", "")
        + &cfg::turn("1", &["t"])
        + &cfg::turn("2", &["t"])
        + &cfg::turn("3", &["t"])
        + &cfg::turn("saw {{message_count}}", &[])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::hook("truncate", &truncate, &["model_request"], 2000);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("x", "go").await;
    assert_eq!(out.expect_ok().text, "saw 3");
    let sizes: Vec<usize> = out.model_requests().iter().map(|r| r.messages.len()).collect();
    assert_eq!(sizes, vec![1, 3, 3, 3]);
    assert_eq!(lattice.session(&out.session_id()).await.unwrap().messages.len(), 8);
}

/// A hook written in Python from the .proto alone runs in one chain with
/// Rust hooks, in registered order, each seeing the previous output.
#[tokio::test(flavor = "multi_thread")]
async fn the_python_hook_works_in_a_chain_with_rust_hooks() {
    let tools = ToolServer::start(vec![ToolDef::new("t", "mail ada@example.com")]).await;
    let (python, _py) = start_python_hook().await;
    let before =
        HookServer::start(Behaviour { on_result: OnResult::Append(" [before]".into()), ..Default::default() }).await;
    let after =
        HookServer::start(Behaviour { on_result: OnResult::Append(" [after]".into()), ..Default::default() }).await;
    let config = cfg::agent("x", "")
        + &cfg::turn("go", &["t"])
        + &cfg::turn("{{last_tool_result}}", &[])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::hook("before", &before.url, &["tool_result"], 2000)
        + &cfg::hook("python", &python, &["tool_result"], 2000)
        + &cfg::hook("after", &after.url, &["tool_result"], 2000);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("x", "go").await;
    assert_eq!(out.expect_ok().text, "mail [REDACTED:email] [before] [after]");
    let after_saw = lattice_tests::result_text(after.state.tool_results()[0].result.as_ref().unwrap());
    assert_eq!(after_saw, "mail [REDACTED:email] [before]");
    assert!(!lattice.traces().contains("ada@example.com"));

    // Registered for an event it doesn't implement: UNIMPLEMENTED aborts.
    let config = cfg::agent("y", "") + &cfg::turn("hi", &[]) + &cfg::hook("python", &python, &["model_request"], 2000);
    let lattice = Lattice::start(&config).await;
    let meta = lattice.query("y", "hi").await.hook_failure();
    assert_eq!((meta["kind"].as_str(), meta["code"].as_str()), ("status", "UNIMPLEMENTED"));
}

/// The same redaction hook in Go, Python and Rust runs in one chain, in
/// registered order: each redacts what the hook before it let through (an
/// address appended between them), and no address reaches the model or a
/// trace.
#[tokio::test(flavor = "multi_thread")]
async fn go_python_and_rust_hooks_run_in_one_chain() {
    let tools = ToolServer::start(vec![ToolDef::new("t", "mail ada@example.com")]).await;
    let (go, _go) = lattice_tests::start_go_hook(&[]).await;
    let (python, _py) = start_python_hook().await;
    let (rust, _rust) = start_example("redact", &[]).await;
    let append = |text: &str| Behaviour { on_result: OnResult::Append(text.into()), ..Default::default() };
    let bob = HookServer::start(append(" or bob@example.org")).await;
    let eve = HookServer::start(append(" or eve@example.net")).await;
    let config = cfg::agent("x", "")
        + &cfg::turn("go", &["t"])
        + &cfg::turn("{{last_tool_result}}", &[])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::hook("go", &go, &["tool_result"], 2000)
        + &cfg::hook("bob", &bob.url, &["tool_result"], 2000)
        + &cfg::hook("python", &python, &["tool_result"], 2000)
        + &cfg::hook("eve", &eve.url, &["tool_result"], 2000)
        + &cfg::hook("rust", &rust, &["tool_result"], 2000);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("x", "go").await;
    assert_eq!(out.expect_ok().text, "mail [REDACTED:email] or [REDACTED:email] or [REDACTED:email]");
    let bob_saw = lattice_tests::result_text(bob.state.tool_results()[0].result.as_ref().unwrap());
    assert_eq!(bob_saw, "mail [REDACTED:email]", "the Go hook ran first");
    let eve_saw = lattice_tests::result_text(eve.state.tool_results()[0].result.as_ref().unwrap());
    assert_eq!(eve_saw, "mail [REDACTED:email] or [REDACTED:email]", "then the Python hook");
    for address in ["ada@example.com", "bob@example.org", "eve@example.net"] {
        assert!(!lattice.traces().contains(address), "{address}");
    }
}

/// `lattice query` prints the event stream readably; `lattice check-config`
/// accepts the shipped configs and lists every problem of a broken one
/// (exit 64).
#[tokio::test(flavor = "multi_thread")]
async fn the_cli_queries_and_checks_configs() {
    let (tools, _tools) = start_example_tools().await;
    let config = cfg::agent("support", "")
        + &cfg::turn("looking", &["lookup_customer:{ query = \"turing\" }"])
        + &cfg::turn("found: {{last_tool_result}}", &[])
        + &cfg::tools(&tools, 5000);
    let lattice = Lattice::start(&config).await;
    let out = lattice_query(&lattice.url, "support", "find Alan").await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    for expected in [
        "▶ query",
        "◆ assistant (turn 1)",
        "tool_use lookup_customer",
        "◇ tool result lookup_customer",
        "Alan Turing",
        "✔ result (end_turn, 2 turn(s)",
    ] {
        assert!(stdout.contains(expected), "missing {expected:?} in:\n{stdout}");
    }
    let failed = lattice_query(&lattice.url, "nobody", "hi").await;
    assert!(!failed.status.success());
    assert!(String::from_utf8_lossy(&failed.stdout).contains("✘ NOT_FOUND"));

    // A server it cannot reach: said on stderr, with a hint.
    let dead = lattice_tests::dead_url().await;
    for (addr, expected) in [
        (dead.as_str(), "lattice serve"),
        (dead.trim_start_matches("http://"), "http://127.0.0.1:50051"),
        ("http://", "URL"),
    ] {
        let failed = lattice_query(addr, "support", "hi").await;
        let stderr = String::from_utf8_lossy(&failed.stderr);
        assert_eq!(failed.status.code(), Some(1), "{addr}: {stderr}");
        assert!(stderr.contains("lattice query: cannot reach") && stderr.contains(expected), "{addr}: {stderr}");
    }

    let shipped_dirs = [workspace_root().join("deploy/examples"), workspace_root().join("deploy/k8s")];
    for shipped in shipped_dirs.iter().flat_map(|d| std::fs::read_dir(d).unwrap().flatten()) {
        if shipped.path().extension().is_some_and(|e| e == "toml") {
            let check = std::process::Command::new(workspace_binary("lattice"))
                .arg("check-config")
                .arg("--config")
                .arg(shipped.path())
                .env("ANTHROPIC_API_KEY", "example")
                .env("OPENAI_API_KEY", "example")
                .output()
                .unwrap();
            assert!(check.status.success(), "{}: {}", shipped.path().display(), String::from_utf8_lossy(&check.stderr));
        }
    }
    let bad = temp_dir("badcfg").join("bad.toml");
    std::fs::write(&bad, "[[agents]]\nname = \"a b\"\n[agents.model]\nprovider = \"nope\"\n").unwrap();
    let check = std::process::Command::new(workspace_binary("lattice"))
        .arg("check-config")
        .arg("--config")
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(check.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&check.stderr);
    assert!(
        stderr.contains("bad.toml:2: agents[0].name") && stderr.contains("bad.toml:4: agents[0].model.provider"),
        "{stderr}"
    );
}

/// The scripted model takes a tool call's input from the prompt
/// (`{{last_user_word}}`), so "Find Grace." looks up Grace; and
/// `--show-requests` prints a tool result's JSON with its own indentation
/// under the request's.
#[tokio::test(flavor = "multi_thread")]
async fn the_cli_shows_requests_with_a_result_indented_as_sent() {
    let (tools, _tools) = start_example_tools().await;
    let config = cfg::agent("support", "")
        + &cfg::turn("looking", &["lookup_customer:{ query = \"{{last_user_word}}\" }"])
        + &cfg::turn("found", &[])
        + &cfg::tools(&tools, 5000);
    let lattice = Lattice::start(&config).await;
    let out = tokio::process::Command::new(workspace_binary("lattice"))
        .args(["query", "--addr", &lattice.url, "--agent", "support", "--show-requests", "Find Grace."])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("tool_use lookup_customer {\"query\":\"Grace\"}"), "{stdout}");
    assert!(stdout.contains("Grace Hopper") && !stdout.contains("Ada Lovelace"), "{stdout}");
    // The record is printed twice: in its tool_result event and in the next
    // model request. Each of its lines is indented under its block.
    let record_lines: Vec<&str> = stdout.lines().filter(|l| l.contains("\"name\": \"Grace Hopper\"")).collect();
    assert_eq!(record_lines.len(), 2, "{stdout}");
    for line in record_lines {
        let indent = line.len() - line.trim_start().len();
        assert!(indent >= 8, "a line of the record lost its indentation: {line:?} in\n{stdout}");
    }
}

/// `lattice query` reads events as large as the server may send (its
/// `max_message_bytes`), not only tonic's default 4 MiB: a 5 MiB reply is
/// printed, not refused as OUT_OF_RANGE after the query has succeeded.
#[tokio::test(flavor = "multi_thread")]
async fn the_cli_prints_events_over_four_mib() {
    let text = "x".repeat(5 << 20);
    let config =
        format!("[server]\nmax_message_bytes = {}\n", 16 << 20) + &cfg::agent("big", "") + &cfg::turn(&text, &[]);
    let lattice = Lattice::start(&config).await;
    let out = lattice_query(&lattice.url, "big", "hi").await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let tail = &stdout[stdout.len().saturating_sub(300)..];
    assert!(out.status.success(), "{tail}");
    assert!(stdout.contains(&text), "the reply is printed whole; the output ends: {tail}");
    assert!(stdout.contains("✔ result (end_turn, 1 turn(s)"), "{tail}");
}

/// Runs `lattice query --addr ADDR --agent AGENT PROMPT`.
async fn lattice_query(addr: &str, agent: &str, prompt: &str) -> std::process::Output {
    tokio::process::Command::new(workspace_binary("lattice"))
        .args(["query", "--addr", addr, "--agent", agent, prompt])
        .output()
        .await
        .unwrap()
}
