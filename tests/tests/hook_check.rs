//! `lattice hook check` against real hook services: the shipped examples
//! pass every check; deliberately broken hooks fail the right checks, for
//! the right reason.

use std::time::Duration;

use lattice_tests::{
    hook::{Behaviour, HookServer, OnRequest, OnResult},
    start_example, start_go_hook, start_python_hook, workspace_binary,
};
use serde_json::Value;
use tonic::Code;

/// Runs the checker; returns whether it exited 0 and its JSON report.
async fn check(addr: &str, args: &[&str]) -> (bool, Value) {
    let out = tokio::process::Command::new(workspace_binary("lattice"))
        .args(["hook", "check", addr, "--json", "--max-message-bytes", "4194304"])
        .args(args)
        .output()
        .await
        .expect("the lattice binary (cargo build --workspace --bins)");
    let text = String::from_utf8_lossy(&out.stdout);
    let report: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{text}\n{}", String::from_utf8_lossy(&out.stderr)));
    (out.status.success(), report)
}

/// The verdict and detail of one check.
fn finding<'a>(report: &'a Value, check: &str) -> (&'a str, &'a str) {
    let f = report["checks"]
        .as_array()
        .and_then(|c| c.iter().find(|f| f["check"] == check))
        .unwrap_or_else(|| panic!("no check {check} in {report:#}"));
    (f["result"].as_str().unwrap(), f["detail"].as_str().unwrap())
}

fn failed(report: &Value) -> Vec<String> {
    report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["result"] == "FAIL")
        .map(|f| f["check"].as_str().unwrap().to_owned())
        .collect()
}

/// The Rust examples (redact for tool results, truncate for model
/// requests), the Python example and the Go example pass every check of
/// their events (with a deadline that leaves room for a 4 MiB result in a
/// debug build on a loaded machine).
#[tokio::test(flavor = "multi_thread")]
async fn the_example_hooks_pass_every_check() {
    let (redact, _r) = start_example("redact", &[]).await;
    let (ok, report) = check(&redact, &["--events", "tool_result", "--deadline-ms", "5000"]).await;
    assert!(ok, "{report:#}");
    assert_eq!(report["failed"], 0, "{report:#}");
    assert_eq!(report["warnings"], 0, "{report:#}");
    assert_eq!(finding(&report, "health").0, "PASS");
    assert_eq!(finding(&report, "tool_result/cancelled").0, "PASS");
    assert!(report["checks"].as_array().unwrap().iter().all(|f| !f["check"].as_str().unwrap().starts_with("model")));

    let (truncate, _t) = start_example("truncate", &["--keep-last", "2"]).await;
    let (ok, report) = check(&truncate, &["--events", "model_request", "--deadline-ms", "5000"]).await;
    assert!(ok, "{report:#}");
    // The long conversation is cut to its last messages: still valid.
    let (verdict, detail) = finding(&report, "model_request/long_conversation");
    assert_eq!((verdict, detail.starts_with("replaced messages")), ("PASS", true), "{detail}");

    let (python, _p) = start_python_hook().await;
    let (ok, report) = check(&python, &["--events", "tool_result", "--deadline-ms", "5000"]).await;
    assert!(ok, "{report:#}");
    assert_eq!(report["warnings"], 0, "{report:#}");

    let (go, _g) = start_go_hook(&[]).await;
    let (ok, report) = check(&go, &["--events", "tool_result", "--deadline-ms", "5000"]).await;
    assert!(ok, "{report:#}");
    assert_eq!(report["warnings"], 0, "{report:#}");
}

/// The quickstart's hook (the Rust redaction example) passes every check
/// at the deadline and message limit the quickstart's config gives it, as
/// a debug build: a tool result near the limit through it does not abort
/// the query. The report says which deadline and limit it measured against.
#[tokio::test(flavor = "multi_thread")]
async fn the_quickstart_hook_meets_the_quickstart_deadline() {
    let path = lattice_tests::workspace_root().join("deploy/examples/quickstart.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let config = lattice_server::config::parse_with_env(&text, &path, &|_| None, &lattice_server::CHECKS).unwrap();
    let hook = &config.agents[0].hooks[0];
    assert_eq!((hook.name.as_str(), hook.events.tool_result), ("redact", true));
    let deadline_ms = hook.deadline.as_millis().to_string();
    let limit = config.server.hook_max_message_bytes.to_string();

    let (redact, _r) = start_example("redact", &[]).await;
    let out = tokio::process::Command::new(workspace_binary("lattice"))
        .args(["hook", "check", &redact, "--events", "tool_result", "--deadline-ms", &deadline_ms])
        .args(["--max-message-bytes", &limit])
        .output()
        .await
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}");
    assert!(table.contains(&format!("each call's deadline: {deadline_ms} ms")), "{table}");
    assert!(table.contains(&format!("message limit: {limit} bytes")), "{table}");
    assert!(table.contains("PASS  tool_result/near_limit"), "{table}");
}

/// A hook without grpc.health.v1 or reflection (the test hook serves
/// neither): health FAILs, reflection only WARNs; the calls pass.
#[tokio::test(flavor = "multi_thread")]
async fn a_hook_without_health_fails_and_without_reflection_warns() {
    let hook = HookServer::start(Behaviour::default()).await;
    let (ok, report) = check(&hook.url, &[]).await;
    assert!(!ok);
    assert_eq!(failed(&report), ["health"], "{report:#}");
    assert!(finding(&report, "health").1.contains("no grpc.health.v1"));
    assert_eq!(finding(&report, "reflection").0, "WARN");
    assert_eq!(finding(&report, "tool_result/concurrent").0, "PASS");
}

/// A replacement with another tool_use_id fails every tool_result call.
#[tokio::test(flavor = "multi_thread")]
async fn a_hook_that_changes_the_tool_use_id_fails() {
    let hook = HookServer::start(Behaviour { on_result: OnResult::WrongId, ..Default::default() }).await;
    let (ok, report) = check(&hook.url, &["--events", "tool_result"]).await;
    assert!(!ok);
    for kind in ["executed", "failed", "blocked", "cancelled"] {
        let (verdict, detail) = finding(&report, &format!("tool_result/{kind}"));
        assert_eq!(verdict, "FAIL");
        assert!(detail.contains("tool_use_id"), "{detail}");
    }
}

/// A replacement whose tool_use is never answered breaks the pairing rules.
#[tokio::test(flavor = "multi_thread")]
async fn a_hook_that_breaks_pairing_fails() {
    let hook = HookServer::start(Behaviour { on_request: OnRequest::Dangling, ..Default::default() }).await;
    let (ok, report) = check(&hook.url, &["--events", "model_request"]).await;
    assert!(!ok);
    let (verdict, detail) = finding(&report, "model_request/first_turn");
    assert_eq!(verdict, "FAIL");
    assert!(detail.contains("invalid replacement messages"), "{detail}");
}

/// UNIMPLEMENTED for a registered event: every query would abort.
#[tokio::test(flavor = "multi_thread")]
async fn a_hook_answering_unimplemented_fails() {
    let hook = HookServer::start(Behaviour { fail: Some(Code::Unimplemented), ..Default::default() }).await;
    let (ok, report) = check(&hook.url, &["--events", "model_request"]).await;
    assert!(!ok);
    let (verdict, detail) = finding(&report, "model_request/first_turn");
    assert_eq!(verdict, "FAIL");
    assert!(detail.contains("UNIMPLEMENTED: every query that reaches this event would abort"), "{detail}");
}

/// A slow hook that ignores grpc-timeout answers OK late: FAIL. The same
/// slowness behind a server that stops at the deadline passes.
#[tokio::test(flavor = "multi_thread")]
async fn a_hook_that_ignores_grpc_timeout_fails() {
    let slow = || Behaviour { delay: Duration::from_millis(300), ..Default::default() };
    let ignoring = HookServer::start_ignoring_deadlines(slow()).await;
    let (ok, report) = check(&ignoring.url, &["--events", "tool_result"]).await;
    assert!(!ok);
    let (verdict, detail) = finding(&report, "tool_result/grpc_timeout");
    assert_eq!(verdict, "FAIL");
    assert!(detail.contains("does not stop at the deadline"), "{detail}");
    // Its other calls are answered within the 1 s deadline.
    assert_eq!(finding(&report, "tool_result/executed").0, "PASS");

    let honouring = HookServer::start(slow()).await;
    let (_, report) = check(&honouring.url, &["--events", "tool_result"]).await;
    let (verdict, detail) = finding(&report, "tool_result/grpc_timeout");
    assert_eq!(verdict, "PASS", "{detail}");
    assert!(detail.contains("at its 50.0 ms deadline"), "{detail}");
}

/// A hook slower than its deadline fails the calls; a bad address is a
/// usage error (exit 64), not a report.
#[tokio::test(flavor = "multi_thread")]
async fn a_hook_slower_than_its_deadline_fails_and_a_bad_address_is_refused() {
    let hook = HookServer::start(Behaviour { delay: Duration::from_millis(400), ..Default::default() }).await;
    let (ok, report) = check(&hook.url, &["--events", "tool_result", "--deadline-ms", "200"]).await;
    assert!(!ok);
    let (verdict, detail) = finding(&report, "tool_result/executed");
    assert_eq!(verdict, "FAIL");
    assert!(detail.contains("no answer within the deadline"), "{detail}");

    let out = tokio::process::Command::new(workspace_binary("lattice"))
        .args(["hook", "check", "ftp://nowhere:1"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(64), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A hook whose message limit is below Lattice's (the Rust SDK at 1 MiB,
/// Lattice at 4 MiB) fails the large-value checks, saying so.
#[tokio::test(flavor = "multi_thread")]
async fn a_hook_with_a_smaller_message_limit_fails_the_large_checks() {
    let (url, _hook) =
        lattice_tests::start_example_env("redact", &[], &[("LATTICE_HOOK_MAX_MESSAGE_BYTES", "1048576")]).await;
    let (ok, report) = check(&url, &["--events", "tool_result", "--deadline-ms", "5000"]).await;
    assert!(!ok);
    assert_eq!(failed(&report), ["tool_result/1MiB", "tool_result/near_limit"], "{report:#}");
    let (_, detail) = finding(&report, "tool_result/near_limit");
    assert!(detail.contains("over the service's message limit"), "{detail}");
}

/// A hook's match conditions, given to the check: every tool result it
/// is sent names the condition's tool, every model request has at least
/// `--min-messages` messages, and the report says so.
#[tokio::test(flavor = "multi_thread")]
async fn the_check_sends_what_the_match_conditions_let_through() {
    let hook = HookServer::start(Behaviour::default()).await;
    let addr = hook.url.trim_start_matches("http://").to_owned();
    let args = ["--events", "tool_result,model_request", "--tools", "queryDatabase", "--min-messages", "7"];
    let (_, report) = check(&addr, &args).await;
    // (This test hook serves no health service: that check alone fails.)
    let failed: Vec<&str> = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["result"] == "FAIL")
        .map(|f| f["check"].as_str().unwrap())
        .collect();
    assert_eq!(failed, ["health"], "{report:#}");
    assert!(report["conditions"].as_str().unwrap().contains("tools = queryDatabase"), "{report:#}");
    let results = hook.state.tool_results();
    assert!(!results.is_empty() && results.iter().all(|r| r.tool_name == "queryDatabase"));
    let requests = hook.state.model_requests();
    assert!(!requests.is_empty() && requests.iter().all(|r| r.messages.len() >= 7));

    // A condition without its event is refused.
    let out = tokio::process::Command::new(workspace_binary("lattice"))
        .args(["hook", "check", &addr, "--events", "model_request", "--tools", "x"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(64), "{}", String::from_utf8_lossy(&out.stderr));
}
