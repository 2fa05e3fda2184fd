//! The per-query audit record: which hooks ran on which value, in order,
//! and where the value changed — as SHA-256 hashes, never the value.

use lattice_proto::agent::v1 as apb;
use lattice_tests::{
    Lattice, assert_no_leak, canary, cfg,
    hook::{Behaviour, HookServer, OnResult},
    logs, sha256_hex,
    tool::{ToolDef, ToolServer},
};
use prost::Message as _;
use serde_json::Value;

/// The hash Lattice records for a tool result holding `text`.
fn result_hash(tool_use_id: &str, text: &str) -> String {
    let block = apb::ToolResultBlock {
        tool_use_id: tool_use_id.into(),
        content: vec![apb::TextBlock { text: text.into() }],
        is_error: false,
    };
    sha256_hex(&block.encode_to_vec())
}

/// HMAC-SHA256 of `bytes` under `key`, by Python's `hmac`.
fn hmac_hex(key: &str, bytes: &[u8]) -> String {
    let script = "import hmac, hashlib, sys; \
                  print(hmac.new(sys.argv[1].encode(), sys.stdin.buffer.read(), hashlib.sha256).hexdigest())";
    lattice_tests::piped("python3", &["-c", script, key], bytes)
}

/// The one audit event of the trace.
fn audit_of(traces: &str) -> Value {
    let audits: Vec<Value> =
        traces.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()).filter(|v| v["type"] == "audit").collect();
    assert_eq!(audits.len(), 1, "{traces}");
    audits.into_iter().next().unwrap()
}

fn entries<'a>(audit: &'a Value, event: &str) -> Vec<&'a Value> {
    let mut found: Vec<&Value> = audit["hooks"].as_array().unwrap().iter().filter(|h| h["event"] == event).collect();
    found.sort_by_key(|h| (h["subject"].as_str().unwrap().to_owned(), h["position"].as_u64()));
    found
}

fn chain(tools: &str, hooks: [&HookServer; 3]) -> String {
    cfg::agent("x", "")
        + &cfg::turn("go", &["t"])
        + &cfg::turn("done: {{last_tool_result}}", &[])
        + tools
        + &cfg::hook("a", &hooks[0].url, &["tool_result", "model_request"], 2000)
        + &cfg::hook("b", &hooks[1].url, &["tool_result"], 2000)
        + &cfg::hook("c", &hooks[2].url, &["tool_result", "model_request"], 2000)
}

/// Three hooks, the second redacting: the record shows the result's hash
/// change at hook b (and nowhere else), each hook given what the previous
/// one passed on, the model requests unchanged, and the hashes are those
/// of the values (recomputed here). The canary reaches no sink, the audit
/// log line included.
#[tokio::test(flavor = "multi_thread")]
async fn a_redaction_shows_as_a_hash_change_at_the_hook_that_made_it() {
    let secret = canary();
    let tools = ToolServer::start(vec![ToolDef::new("t", &secret)]).await;
    let (a, c) = (HookServer::start(Behaviour::default()).await, HookServer::start(Behaviour::default()).await);
    let redact = Behaviour { on_result: OnResult::ReplaceText("[REDACTED]".into()), ..Default::default() };
    let b = HookServer::start(redact).await;
    let lattice = Lattice::start(&chain(&cfg::tools(&tools.url, 2000), [&a, &b, &c])).await;
    let out = lattice.query("x", "go").await;
    assert_eq!(out.expect_ok().text, "done: [REDACTED]");
    assert_no_leak(&secret, &lattice, &out);

    let audit = audit_of(&lattice.traces());
    assert_eq!((audit["outcome"].as_str(), audit["digest"].as_str()), (Some("OK"), Some("sha256")));
    assert_eq!(audit["chain_version"].as_str().unwrap().len(), 16);
    let results = entries(&audit, "tool_result");
    let order: Vec<(&str, u64, bool)> = results
        .iter()
        .map(|h| (h["hook"].as_str().unwrap(), h["position"].as_u64().unwrap(), h["changed"].as_bool().unwrap()))
        .collect();
    assert_eq!(order, [("a", 1, false), ("b", 2, true), ("c", 3, false)]);
    let id = results[0]["subject"].as_str().unwrap();
    let (raw, redacted) = (result_hash(id, &secret), result_hash(id, "[REDACTED]"));
    assert_eq!((results[0]["digest_before"].as_str(), results[0]["digest_after"].as_str()), (Some(&*raw), Some(&*raw)));
    assert_eq!(
        (results[1]["digest_before"].as_str(), results[1]["digest_after"].as_str()),
        (Some(&*raw), Some(&*redacted))
    );
    assert_eq!(results[2]["digest_before"].as_str(), Some(&*redacted));
    let requests = entries(&audit, "model_request");
    let seen: Vec<(&str, &str, bool)> = requests
        .iter()
        .map(|h| (h["subject"].as_str().unwrap(), h["hook"].as_str().unwrap(), h["changed"].as_bool().unwrap()))
        .collect();
    assert_eq!(seen, [("turn 1", "a", false), ("turn 1", "c", false), ("turn 2", "a", false), ("turn 2", "c", false)]);
    let line = logs().lines().find(|l| l.contains("query audit")).map(str::to_owned).expect("the audit is logged too");
    assert!(
        line.contains(&format!("changed_by=b@{id}")) || line.contains(&format!("\"changed_by\":\"b@{id}\"")),
        "{line}"
    );
}

/// A hook that fails ends the record there: its entry has the failure's
/// kind and no "after" hash, and no later hook has an entry.
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_hook_ends_the_record() {
    let secret = canary();
    let tools = ToolServer::start(vec![ToolDef::new("t", &secret)]).await;
    let (a, c) = (HookServer::start(Behaviour::default()).await, HookServer::start(Behaviour::default()).await);
    let failing = Behaviour { fail: Some(tonic::Code::Internal), ..Default::default() };
    let b = HookServer::start(failing).await;
    let lattice = Lattice::start(&chain(&cfg::tools(&tools.url, 2000), [&a, &b, &c])).await;
    let out = lattice.query("x", "go").await;
    assert_eq!(out.code(), tonic::Code::Aborted);
    assert_no_leak(&secret, &lattice, &out);
    let audit = audit_of(&lattice.traces());
    assert_eq!(audit["outcome"], "ABORTED");
    let results = entries(&audit, "tool_result");
    assert_eq!(results.len(), 2, "{audit}");
    assert_eq!((results[1]["hook"].as_str(), results[1]["outcome"].as_str()), (Some("b"), Some("status")));
    assert!(results[1].get("digest_after").is_none());
}

/// With server.audit_key_env the digests are HMAC-SHA256 under that key:
/// whoever holds the key can check a value; a reader of the record can't
/// test guesses. The key never reaches a log.
#[tokio::test(flavor = "multi_thread")]
async fn a_keyed_audit_record_uses_hmac() {
    let secret = canary();
    let key = "audit-key-3f9c21";
    let tools = ToolServer::start(vec![ToolDef::new("t", &secret)]).await;
    let (a, c) = (HookServer::start(Behaviour::default()).await, HookServer::start(Behaviour::default()).await);
    let redact = Behaviour { on_result: OnResult::ReplaceText("[REDACTED]".into()), ..Default::default() };
    let b = HookServer::start(redact).await;
    let config = "[server]\naudit_key_env = \"LATTICE_TEST_AUDIT_KEY\"\n".to_owned()
        + &chain(&cfg::tools(&tools.url, 2000), [&a, &b, &c]);
    let lattice = Lattice::start_with_env(&config, &[("LATTICE_TEST_AUDIT_KEY", key)]).await;
    let out = lattice.query("x", "go").await;
    assert_eq!(out.expect_ok().text, "done: [REDACTED]");
    assert_no_leak(&secret, &lattice, &out);
    let audit = audit_of(&lattice.traces());
    assert_eq!(audit["digest"], "hmac-sha256");
    let results = entries(&audit, "tool_result");
    let id = results[0]["subject"].as_str().unwrap();
    let raw = apb::ToolResultBlock {
        tool_use_id: id.into(),
        content: vec![apb::TextBlock { text: secret.clone() }],
        is_error: false,
    };
    let expected = hmac_hex(key, &raw.encode_to_vec());
    assert_eq!(results[1]["digest_before"].as_str(), Some(&*expected));
    assert_ne!(expected, result_hash(id, &secret), "not the plain SHA-256");
    assert!(results[1]["changed"].as_bool().unwrap());
    assert!(!logs().contains(key) && !lattice.traces().contains(key), "the key is never written");
}
