//! OpenTelemetry: a query is one trace, exported over OTLP/gRPC to a real
//! receiver (`lattice_tests::otlp`), and its W3C trace context reaches every
//! hook, the tool service and the model API.

use std::collections::HashSet;

use lattice_proto::agent::v1 as pb;
use lattice_tests::{
    Lattice, canary, cfg,
    fake_api::{FakeApi, Reply},
    hook::{Behaviour, HookServer},
    otlp::{Collector, SpanRecord},
    start_python_hook_logging, temp_dir,
    tool::{ToolDef, ToolServer},
};

/// The trace id and span id of a `traceparent` value.
fn ids(traceparent: &str) -> (String, String) {
    let parts: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(parts.len(), 4, "{traceparent}");
    (parts[1].to_owned(), parts[2].to_owned())
}

fn by_name<'a>(spans: &'a [SpanRecord], name: &str) -> Vec<&'a SpanRecord> {
    let mut found: Vec<&SpanRecord> = spans.iter().filter(|s| s.name == name).collect();
    found.sort_by_key(|s| s.start);
    found
}

fn attr<'a>(span: &'a SpanRecord, key: &str) -> &'a str {
    span.attributes.get(key).map(String::as_str).unwrap_or_default()
}

/// Three hooks on both events and a Python hook on tool results, a tool
/// and two turns: the client's trace continues into one `query` span, with
/// a `turn` span per turn holding its OnModelRequest `hook` spans (in
/// registered order) and its `model_request`, and a `tool_call` holding
/// the OnToolResult `hook` spans. Every hook — the Python one too — gets
/// the traceparent of its own span; no attribute holds the tool's output.
#[tokio::test(flavor = "multi_thread")]
async fn a_query_is_one_trace_across_hooks_tools_and_the_model() {
    let collector = Collector::start().await;
    let secret = canary();
    let tools = ToolServer::start(vec![ToolDef::new("t", &secret)]).await;
    let hooks = [
        HookServer::start(Behaviour::default()).await,
        HookServer::start(Behaviour::default()).await,
        HookServer::start(Behaviour::default()).await,
    ];
    let py_log = temp_dir("otel-py").join("hook.log");
    let (py_url, _py) = start_python_hook_logging(&[], &py_log).await;
    let mut config = format!("[telemetry]\notlp_endpoint = {:?}\nservice_name = \"lattice-test\"\n", collector.url)
        + &cfg::agent("x", "")
        + &cfg::turn("go", &["t"])
        + &cfg::turn("done", &[])
        + &cfg::tools(&tools.url, 2000);
    for (i, h) in hooks.iter().enumerate() {
        config += &cfg::hook(&format!("h{i}"), &h.url, &["model_request", "tool_result"], 2000);
    }
    config += &cfg::hook("py", &py_url, &["tool_result"], 2000);
    let lattice = Lattice::spawn(&config, &[("OTEL_BSP_SCHEDULE_DELAY", "100")]).await;

    // The client's own trace: the query continues it.
    let (trace_id, client_span) =
        (lattice_server::session::new_id(), lattice_server::session::new_id()[..16].to_owned());
    let mut client = lattice.client().await;
    let mut request =
        tonic::Request::new(pb::QueryRequest { agent: "x".into(), prompt: "go".into(), ..Default::default() });
    let traceparent = format!("00-{trace_id}-{client_span}-01");
    request.metadata_mut().insert("traceparent", traceparent.parse().unwrap());
    let mut stream = client.query(request).await.unwrap().into_inner();
    while stream.message().await.unwrap().is_some() {}

    let spans = collector.trace(&trace_id, |s| by_name(s, "hook").len() >= 10 && !by_name(s, "query").is_empty()).await;
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    let query = by_name(&spans, "query");
    assert_eq!(query.len(), 1, "{names:?}");
    let query = query[0];
    assert_eq!(query.parent_span_id, client_span, "the query continues the client's trace");
    assert_eq!((attr(query, "agent"), attr(query, "outcome")), ("x", "OK"));
    assert_eq!(query.service, "lattice-test");

    let turns = by_name(&spans, "turn");
    assert_eq!(turns.len(), 2, "{names:?}");
    assert!(turns.iter().all(|t| t.parent_span_id == query.span_id));
    let models = by_name(&spans, "model_request");
    assert_eq!(models.len(), 2);
    for (m, t) in models.iter().zip(&turns) {
        assert_eq!(m.parent_span_id, t.span_id, "a model request sits in its turn");
        assert_eq!(attr(m, "outcome"), "ok");
    }
    let tool_calls = by_name(&spans, "tool_call");
    assert_eq!(tool_calls.len(), 1);
    let tool_call = tool_calls[0];
    assert_eq!(tool_call.parent_span_id, turns[0].span_id);
    assert_eq!((attr(tool_call, "tool"), attr(tool_call, "outcome")), ("t", "executed"));

    let hook_spans = by_name(&spans, "hook");
    for turn in &turns {
        let order: Vec<&str> = hook_spans
            .iter()
            .filter(|h| h.parent_span_id == turn.span_id)
            .inspect(|h| assert_eq!(attr(h, "event"), "model_request"))
            .map(|h| attr(h, "hook"))
            .collect();
        assert_eq!(order, ["h0", "h1", "h2"], "OnModelRequest hooks, in registered order, in the turn");
    }
    let order: Vec<&str> = hook_spans
        .iter()
        .filter(|h| h.parent_span_id == tool_call.span_id)
        .inspect(|h| assert_eq!(attr(h, "event"), "tool_result"))
        .map(|h| attr(h, "hook"))
        .collect();
    assert_eq!(order, ["h0", "h1", "h2", "py"], "OnToolResult hooks, in registered order, in the tool call");
    assert!(hook_spans.iter().all(|h| attr(h, "outcome") == "ok"));

    // Each hook call carried the traceparent of its own span.
    for (i, h) in hooks.iter().enumerate() {
        let mine: HashSet<&str> =
            hook_spans.iter().filter(|s| attr(s, "hook") == format!("h{i}")).map(|s| s.span_id.as_str()).collect();
        let calls = h.state.calls.lock().unwrap().clone();
        assert_eq!(calls.len(), 3);
        for call in calls {
            let (t, parent) = ids(call.traceparent.as_deref().expect("a traceparent"));
            assert_eq!(t, trace_id);
            assert!(mine.contains(parent.as_str()), "h{i} got the id of its own span");
        }
    }
    let py_span = hook_spans.iter().find(|s| attr(s, "hook") == "py").unwrap();
    let py_lines = std::fs::read_to_string(&py_log).unwrap();
    let line = py_lines.lines().find(|l| l.contains("tool result checked")).expect("the Python hook logged the call");
    let line: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(line["trace_id"], trace_id.as_str(), "{line}");
    assert_eq!(line["parent_span_id"], py_span.span_id.as_str(), "{line}");

    for s in &spans {
        assert!(!format!("{:?}", s.attributes).contains(&secret), "{} holds the tool's output", s.name);
    }
}

/// The model API gets the traceparent of the `model_request` span.
#[tokio::test(flavor = "multi_thread")]
async fn the_model_api_gets_the_trace_context() {
    let collector = Collector::start().await;
    let reply = serde_json::json!({
        "id": "msg_1", "type": "message", "role": "assistant", "model": "test-model",
        "content": [{"type": "text", "text": "hello"}],
        "stop_reason": "end_turn", "stop_sequence": null,
        "usage": {"input_tokens": 3, "output_tokens": 1}
    });
    let api = FakeApi::start(vec![Reply::json(reply)]).await;
    let config = format!("[telemetry]\notlp_endpoint = {:?}\n", collector.url)
        + &format!(
            "[[agents]]\nname = \"m\"\n[agents.model]\nprovider = \"anthropic\"\nname = \"test-model\"\n\
             base_url = {:?}\napi_key_env = \"LATTICE_TEST_KEY\"\nstream = false\n",
            api.url
        );
    let lattice =
        Lattice::spawn(&config, &[("OTEL_BSP_SCHEDULE_DELAY", "100"), ("LATTICE_TEST_KEY", "test-key")]).await;
    assert_eq!(lattice.query("m", "hi").await.expect_ok().text, "hello");
    let sent = api.received();
    let traceparent = sent[0].headers.get("traceparent").expect("a traceparent to the model API");
    let (trace_id, parent) = ids(traceparent);
    let spans = collector.trace(&trace_id, |s| !by_name(s, "query").is_empty()).await;
    let model = by_name(&spans, "model_request");
    assert_eq!(model.len(), 1, "{spans:#?}");
    assert_eq!(model[0].span_id, parent);
    assert_eq!((attr(model[0], "input_tokens"), attr(model[0], "output_tokens")), ("3", "1"));
    let query = by_name(&spans, "query");
    assert_eq!(query[0].parent_span_id, "", "without a client traceparent the query is a root");
}

/// The Rust example hook, `--log-format json`: its lines are JSON, and the
/// one it logs inside a call carries the query's trace id (the SDK's
/// `hook_call` span) — the same trace as Lattice's `hook` span.
#[tokio::test(flavor = "multi_thread")]
async fn an_sdk_hooks_json_logs_carry_the_query_trace() {
    let collector = Collector::start().await;
    let log = temp_dir("sdk-json").join("redact.log");
    let (url, _hook) = lattice_tests::start_example_logging("redact", &["--log-format", "json"], &[], &log).await;
    let tools = ToolServer::start(vec![ToolDef::new("t", "mail ada@example.com")]).await;
    let config = format!("[telemetry]\notlp_endpoint = {:?}\n", collector.url)
        + &cfg::agent("x", "")
        + &cfg::turn("go", &["t"])
        + &cfg::turn("saw {{last_tool_result}}", &[])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::hook("redact", &url, &["tool_result"], 2000);
    let lattice = Lattice::spawn(&config, &[("OTEL_BSP_SCHEDULE_DELAY", "100")]).await;
    assert_eq!(lattice.query("x", "go").await.expect_ok().text, "saw mail [REDACTED:email]");
    let hook_span = loop {
        if let Some(s) = collector.spans().into_iter().find(|s| s.name == "hook") {
            break s;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<serde_json::Value> =
        text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect();
    let checked = lines.iter().find(|l| l["fields"]["message"] == "tool result checked").expect("the call's line");
    assert_eq!(checked["span"]["trace_id"], hook_span.trace_id.as_str(), "{checked}");
    assert_eq!(checked["span"]["parent_span_id"], hook_span.span_id.as_str(), "{checked}");
}
