//! The Anthropic and OpenAI providers against local HTTP servers that
//! speak each API's wire format: exact request bodies and headers, SSE
//! streaming with text deltas, tool calls, is_error, hook-replaced requests,
//! retries, deadlines, broken responses and refused keys. Lattice runs as
//! the real binary with the key in its environment, so the tests also read
//! its real logs for the key.

use std::time::Duration;

use lattice_proto::agent::v1::{Usage, query_event::Event};
use lattice_tests::{
    Lattice, QueryOpts, cfg,
    fake_api::{FakeApi, Reply},
    hook::{Behaviour, HookServer, OnRequest, OnResult},
    tool::{ToolDef, ToolServer},
};
use serde_json::{Value, json};
use tonic::Code;
use tonic_types::StatusExt;

const KEY_VAR: &str = "LATTICE_TEST_MODEL_KEY";
const KEY: &str = "sk-test-9f8e7d6c5b4a-DO-NOT-LEAK";

#[derive(Clone, Copy, Debug)]
enum P {
    Anthropic,
    OpenAi,
}

impl P {
    fn name(self) -> &'static str {
        match self {
            P::Anthropic => "anthropic",
            P::OpenAi => "openai",
        }
    }
}

/// An agent `m` using provider `p` at `base`; `keys` are extra model keys.
fn agent(p: P, base: &str, keys: &str) -> String {
    format!(
        "\n[[agents]]\nname = \"m\"\nsystem_prompt = \"sys\"\n[agents.model]\nprovider = {:?}\nname = \"test-model\"\nbase_url = {base:?}\napi_key_env = {KEY_VAR:?}\nmax_tokens = 512\n{keys}\n",
        p.name()
    )
}

async fn spawn(config: &str) -> Lattice {
    Lattice::spawn(config, &[(KEY_VAR, KEY)]).await
}

/// A complete Anthropic SSE stream: text in two deltas, then tool_use
/// blocks whose input arrives in two input_json_delta pieces.
fn anthropic_stream(text: &str, tools: &[(&str, &str, &str)], stop: &str, usage: (u64, u64)) -> Reply {
    let mut ev = vec![
        (
            Some("message_start"),
            json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "test-model", "stop_reason": null, "usage": {"input_tokens": usage.0, "output_tokens": 1}}}),
        ),
        (
            Some("content_block_start"),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        (Some("ping"), json!({"type": "ping"})),
    ];
    let (a, b) = text.split_at(text.len() / 2);
    for part in [a, b] {
        ev.push((
            Some("content_block_delta"),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": part}}),
        ));
    }
    ev.push((Some("content_block_stop"), json!({"type": "content_block_stop", "index": 0})));
    for (i, (id, name, input)) in tools.iter().enumerate() {
        let index = i + 1;
        ev.push((Some("content_block_start"), json!({"type": "content_block_start", "index": index, "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}}})));
        let (x, y) = input.split_at(input.len() / 2);
        for part in [x, y] {
            ev.push((Some("content_block_delta"), json!({"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": part}})));
        }
        ev.push((Some("content_block_stop"), json!({"type": "content_block_stop", "index": index})));
    }
    ev.push((Some("message_delta"), json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null}, "usage": {"output_tokens": usage.1}})));
    ev.push((Some("message_stop"), json!({"type": "message_stop"})));
    Reply::sse(&ev)
}

/// A complete OpenAI SSE stream, tool-call deltas assembled by index.
fn openai_stream(text: &str, tools: &[(&str, &str, &str)], finish: &str, usage: (u64, u64)) -> Reply {
    let chunk = |delta: Value, finish: Value| json!({"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
    let mut ev = vec![(None, chunk(json!({"role": "assistant", "content": ""}), Value::Null))];
    let (a, b) = text.split_at(text.len() / 2);
    for part in [a, b] {
        ev.push((None, chunk(json!({"content": part}), Value::Null)));
    }
    for (i, (id, name, args)) in tools.iter().enumerate() {
        ev.push((None, chunk(json!({"tool_calls": [{"index": i, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}), Value::Null)));
        let (x, y) = args.split_at(args.len() / 2);
        for part in [x, y] {
            ev.push((None, chunk(json!({"tool_calls": [{"index": i, "function": {"arguments": part}}]}), Value::Null)));
        }
    }
    ev.push((None, chunk(json!({}), json!(finish))));
    ev.push((None, json!({"id": "c1", "object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": usage.0, "completion_tokens": usage.1, "total_tokens": usage.0 + usage.1}})));
    let Reply::Sse(s) = Reply::sse(&ev) else { unreachable!() };
    Reply::Sse(s + "data: [DONE]\n\n")
}

/// A whole (non-streamed) final answer.
fn final_reply(p: P, text: &str, stop: &str) -> Reply {
    Reply::json(match p {
        P::Anthropic => {
            json!({"id": "msg_1", "type": "message", "role": "assistant", "content": [{"type": "text", "text": text}], "model": "test-model", "stop_reason": stop, "usage": {"input_tokens": 3, "output_tokens": 4}})
        }
        P::OpenAi => {
            json!({"id": "c1", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": stop}], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})
        }
    })
}

fn deltas(out: &lattice_tests::Outcome) -> Vec<(u32, String)> {
    out.events
        .iter()
        .filter_map(|e| match &e.event {
            Some(Event::TextDelta(d)) => Some((d.turn, d.text.clone())),
            _ => None,
        })
        .collect()
}

fn assert_key_never_leaks(lattice: &Lattice, out: &lattice_tests::Outcome) {
    assert!(!out.everything().contains(KEY), "the key reached the client");
    assert!(!lattice.traces().contains(KEY), "the key reached the trace");
    let logs = lattice.process_logs();
    assert!(logs.contains("query started"), "the process logs were captured");
    assert!(!logs.contains(KEY), "the key reached the logs");
}

/// Tools, hooks and the scripted exchange shared by the end-to-end tests.
async fn exchange(p: P, api: &FakeApi) -> (Lattice, lattice_tests::Outcome, ToolServer, HookServer, HookServer) {
    let mut broken = ToolDef::new("broken", "boom");
    broken.is_error = true;
    let tools = ToolServer::start(vec![ToolDef::new("lookup", "found ada"), broken]).await;
    let shaper =
        HookServer::start(Behaviour { on_request: OnRequest::AppendSystem(" [hooked]".into()), ..Default::default() })
            .await;
    let checker =
        HookServer::start(Behaviour { on_result: OnResult::Append(" [checked]".into()), ..Default::default() }).await;
    let config = agent(p, &api.url, "")
        + &cfg::tools(&tools.url, 2000)
        + &cfg::hook("shaper", &shaper.url, &["model_request"], 2000)
        + &cfg::hook("checker", &checker.url, &["tool_result"], 2000);
    let lattice = spawn(&config).await;
    let out = lattice.query("m", "find ada").await;
    (lattice, out, tools, shaper, checker)
}

/// Anthropic, end to end: a streamed reply with two tool calls (one tool
/// fails), then a streamed answer. Each request is exactly the post-hook
/// request in the Messages API's shape, byte for byte; the headers carry
/// the key and version; text deltas reach the client; usage is summed.
#[tokio::test(flavor = "multi_thread")]
async fn anthropic_runs_a_multi_turn_query_end_to_end() {
    let api = FakeApi::start(vec![
        anthropic_stream(
            "Let me check.",
            &[("toolu_1", "lookup", r#"{"q":"ada"}"#), ("toolu_2", "broken", "{}")],
            "tool_use",
            (20, 10),
        ),
        anthropic_stream("All done.", &[], "end_turn", (50, 5)),
    ])
    .await;
    let (lattice, out, ..) = exchange(P::Anthropic, &api).await;
    let result = out.expect_ok();
    assert_eq!(result.text, "All done.");
    assert_eq!(result.usage, Some(Usage { input_tokens: 70, output_tokens: 15 }));
    assert_eq!(
        deltas(&out),
        vec![(1, "Let me".into()), (1, " check.".into()), (2, "All ".into()), (2, "done.".into())]
    );

    let reqs = api.received();
    assert_eq!(reqs.len(), 2);
    for r in &reqs {
        assert_eq!((r.method.as_str(), r.path.as_str()), ("POST", "/v1/messages"));
        assert_eq!(r.headers["x-api-key"], KEY);
        assert_eq!(r.headers["anthropic-version"], "2023-06-01");
        assert!(r.headers["content-type"].starts_with("application/json"));
    }
    let tools = json!([
        {"name": "lookup", "description": "scripted lookup", "input_schema": {}},
        {"name": "broken", "description": "scripted broken", "input_schema": {}},
    ]);
    let first = json!({"model": "test-model", "max_tokens": 512, "system": "sys [hooked]", "stream": true, "tools": tools,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "find ada"}]}]});
    assert_eq!(reqs[0].body, first.to_string());
    let second = json!({"model": "test-model", "max_tokens": 512, "system": "sys [hooked]", "stream": true, "tools": tools,
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "find ada"}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "ada"}},
            {"type": "tool_use", "id": "toolu_2", "name": "broken", "input": {}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "found ada [checked]"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "boom [checked]"}], "is_error": true},
        ]},
    ]});
    assert_eq!(reqs[1].body, second.to_string());
    assert_key_never_leaks(&lattice, &out);
}

/// OpenAI Chat Completions, end to end: tool calls assembled from deltas by
/// index, arguments as JSON strings, `tool` messages with tool_call_id, an
/// error result marked in its content, the bearer key, [DONE].
#[tokio::test(flavor = "multi_thread")]
async fn openai_runs_a_multi_turn_query_end_to_end() {
    let api = FakeApi::start(vec![
        openai_stream(
            "Let me check.",
            &[("call_1", "lookup", r#"{"q":"ada"}"#), ("call_2", "broken", "{}")],
            "tool_calls",
            (20, 10),
        ),
        openai_stream("All done.", &[], "stop", (50, 5)),
    ])
    .await;
    let (lattice, out, ..) = exchange(P::OpenAi, &api).await;
    let result = out.expect_ok();
    assert_eq!(result.text, "All done.");
    assert_eq!(result.usage, Some(Usage { input_tokens: 70, output_tokens: 15 }));
    assert_eq!(
        deltas(&out),
        vec![(1, "Let me".into()), (1, " check.".into()), (2, "All ".into()), (2, "done.".into())]
    );

    let reqs = api.received();
    assert_eq!(reqs.len(), 2);
    for r in &reqs {
        assert_eq!((r.method.as_str(), r.path.as_str()), ("POST", "/v1/chat/completions"));
        assert_eq!(r.headers["authorization"], format!("Bearer {KEY}"));
    }
    let tools = json!([
        {"type": "function", "function": {"name": "lookup", "description": "scripted lookup", "parameters": {}}},
        {"type": "function", "function": {"name": "broken", "description": "scripted broken", "parameters": {}}},
    ]);
    let head = |extra: Vec<Value>| {
        let mut messages =
            vec![json!({"role": "system", "content": "sys [hooked]"}), json!({"role": "user", "content": "find ada"})];
        messages.extend(extra);
        json!({"model": "test-model", "max_tokens": 512, "stream": true, "stream_options": {"include_usage": true}, "tools": tools, "messages": messages})
    };
    assert_eq!(reqs[0].body, head(vec![]).to_string());
    let second = head(vec![
        json!({"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": r#"{"q":"ada"}"#}},
            {"id": "call_2", "type": "function", "function": {"name": "broken", "arguments": "{}"}},
        ]}),
        json!({"role": "tool", "tool_call_id": "call_1", "content": "found ada [checked]"}),
        json!({"role": "tool", "tool_call_id": "call_2", "content": "ERROR: boom [checked]"}),
    ]);
    assert_eq!(reqs[1].body, second.to_string());
    assert_key_never_leaks(&lattice, &out);
}

/// A reply cut by the output limit ends the query with STOP_REASON_MAX_TOKENS
/// (non-streamed replies).
#[tokio::test(flavor = "multi_thread")]
async fn max_tokens_stops_with_its_reason() {
    for (p, stop) in [(P::Anthropic, "max_tokens"), (P::OpenAi, "length")] {
        let api = FakeApi::start(vec![final_reply(p, "cut sh", stop)]).await;
        let lattice = spawn(&agent(p, &api.url, "stream = false")).await;
        let out = lattice.query("m", "talk").await;
        let r = out.expect_ok();
        assert_eq!(r.stop_reason, lattice_proto::agent::v1::StopReason::MaxTokens as i32, "{p:?}");
        assert_eq!(r.text, "cut sh");
        assert!(api.received()[0].body.contains("\"max_tokens\":512"));
        assert!(!api.received()[0].body.contains("\"stream\""), "{p:?}: not streamed");
    }
}

/// 429 with retry-after is retried after the time it asks for, then succeeds.
#[tokio::test(flavor = "multi_thread")]
async fn a_429_is_retried_after_retry_after() {
    for p in [P::Anthropic, P::OpenAi] {
        let limited = Reply::Body {
            status: 429,
            body: json!({"error": {"type": "rate_limit_error"}}).to_string(),
            headers: vec![("retry-after".into(), "1".into())],
        };
        let api = FakeApi::start(vec![limited, final_reply(p, "finally", "end_turn")]).await;
        let lattice = spawn(&agent(p, &api.url, "stream = false")).await;
        let out = lattice.query("m", "hi").await;
        assert_eq!(out.expect_ok().text, "finally", "{p:?}");
        let reqs = api.received();
        assert_eq!(reqs.len(), 2);
        let waited = reqs[1].at - reqs[0].at;
        assert!(
            waited >= Duration::from_millis(1000) && waited < Duration::from_millis(1500),
            "{p:?}: waited {waited:?}"
        );
    }
}

/// A retry never waits past the query's deadline: a 429 asking for 2 s
/// when the query has 800 ms left fails at once, naming the provider and
/// why it was not retried, instead of sleeping into the deadline.
#[tokio::test(flavor = "multi_thread")]
async fn no_retry_waits_past_the_query_deadline() {
    for p in [P::Anthropic, P::OpenAi] {
        let limited = Reply::Body {
            status: 429,
            body: json!({"error": {"type": "rate_limit_error"}}).to_string(),
            headers: vec![("retry-after".into(), "2".into())],
        };
        let api = FakeApi::start(vec![limited]).await;
        let lattice = spawn(&agent(p, &api.url, "stream = false")).await;
        let out = lattice
            .query_with(QueryOpts {
                agent: "m".into(),
                prompt: "hi".into(),
                timeout: Some(Duration::from_millis(800)),
                ..Default::default()
            })
            .await;
        assert_eq!(out.code(), Code::Unavailable, "{p:?}: {:?}", out.status);
        let message = out.status.as_ref().unwrap().message().to_owned();
        assert!(message.contains("HTTP 429") && message.contains("no time left to retry"), "{message}");
        assert!(out.elapsed < Duration::from_millis(500), "{p:?}: took {:?}", out.elapsed);
        assert_eq!(api.received().len(), 1);
    }
}

/// A model request cut by the query's deadline is still counted, with
/// outcome `deadline` (and one the client cancels, `cancelled`).
#[tokio::test(flavor = "multi_thread")]
async fn model_requests_cut_short_are_counted() {
    let api = FakeApi::start(vec![]).await;
    *api.fallback.lock().unwrap() = Reply::Hang(String::new());
    let lattice = spawn(&agent(P::Anthropic, &api.url, "stream = true")).await;
    let out = lattice
        .query_with(QueryOpts {
            agent: "m".into(),
            prompt: "hi".into(),
            timeout: Some(Duration::from_millis(300)),
            ..Default::default()
        })
        .await;
    assert_eq!(out.code(), Code::DeadlineExceeded, "{:?}", out.status);
    let series = r#"lattice_model_requests_total{agent="m",provider="anthropic",outcome="deadline"}"#;
    assert_eq!(lattice_tests::sample(&lattice.metrics().await, series), Some(1.0));
}

/// 500s are retried with backoff until the request deadline; the query then
/// fails in time with UNAVAILABLE naming the provider and the status.
#[tokio::test(flavor = "multi_thread")]
async fn server_errors_fail_clearly_at_the_deadline() {
    for p in [P::Anthropic, P::OpenAi] {
        let api = FakeApi::start(vec![]).await;
        *api.fallback.lock().unwrap() = Reply::status(500, json!({"error": {"type": "api_error"}}));
        let lattice = spawn(&agent(p, &api.url, "stream = false\ndeadline_ms = 1500\nretries = 20")).await;
        let out = lattice.query("m", "hi").await;
        assert_eq!(out.code(), Code::Unavailable, "{p:?}: {:?}", out.status);
        let status = out.status.as_ref().unwrap();
        assert!(status.message().contains(p.name()) && status.message().contains("HTTP 500"), "{}", status.message());
        assert_eq!(status.get_details_error_info().unwrap().metadata["provider"], p.name());
        assert!(out.elapsed < Duration::from_millis(2000), "{p:?}: took {:?}", out.elapsed);
        assert!(api.received().len() >= 2, "{p:?}: retried");
    }
}

/// When the deadline cuts a retry short, the error still says why the
/// request was being retried: the last attempt's HTTP status.
#[tokio::test(flavor = "multi_thread")]
async fn a_retry_cut_by_the_deadline_names_the_last_failure() {
    let api = FakeApi::start(vec![Reply::status(500, json!({"error": {"type": "api_error"}}))]).await;
    *api.fallback.lock().unwrap() = Reply::Hang(String::new());
    let lattice = spawn(&agent(P::OpenAi, &api.url, "stream = false\ndeadline_ms = 1500\nretries = 5")).await;
    let out = lattice.query("m", "hi").await;
    assert_eq!(out.code(), Code::Unavailable, "{:?}", out.status);
    let message = out.status.as_ref().unwrap().message().to_owned();
    assert!(message.contains("within the deadline") && message.contains("HTTP 500"), "{message}");
    assert_eq!(api.received().len(), 2, "one retry, cut by the deadline");
}

/// A stream that breaks after text was delivered fails the query with a
/// clear error; it is not retried from the middle.
#[tokio::test(flavor = "multi_thread")]
async fn a_stream_cut_after_content_fails_without_retry() {
    let anthropic_cut = Reply::sse(&[
        (
            Some("message_start"),
            json!({"type": "message_start", "message": {"usage": {"input_tokens": 1, "output_tokens": 1}}}),
        ),
        (
            Some("content_block_start"),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        (
            Some("content_block_delta"),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Half an ans"}}),
        ),
    ]);
    let openai_cut = Reply::sse(&[(
        None,
        json!({"choices": [{"index": 0, "delta": {"content": "Half an ans"}, "finish_reason": null}]}),
    )]);
    for (p, cut) in [(P::Anthropic, anthropic_cut), (P::OpenAi, openai_cut)] {
        let api = FakeApi::start(vec![cut]).await;
        *api.fallback.lock().unwrap() = final_reply(p, "must not be used", "end_turn");
        let lattice = spawn(&agent(p, &api.url, "")).await;
        let out = lattice.query("m", "hi").await;
        assert_eq!(out.code(), Code::Internal, "{p:?}: {:?}", out.status);
        assert!(
            out.status.as_ref().unwrap().message().contains("after part of the reply was streamed"),
            "{:?}",
            out.status
        );
        assert_eq!(api.received().len(), 1, "{p:?}: not retried");
        assert_eq!(deltas(&out), vec![(1, "Half an ans".to_string())]);
    }
}

/// A stream that reports an error of `kind` in the provider's own way,
/// after `text` if given.
fn stream_error(p: P, kind: &str, text: Option<&str>) -> Reply {
    let mut ev = vec![];
    match p {
        P::Anthropic => {
            ev.push((
                Some("message_start"),
                json!({"type": "message_start", "message": {"usage": {"input_tokens": 1}}}),
            ));
            ev.push((Some("ping"), json!({"type": "ping"})));
            if let Some(text) = text {
                ev.push((
                    Some("content_block_start"),
                    json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
                ));
                ev.push((
                    Some("content_block_delta"),
                    json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}),
                ));
            }
            ev.push((Some("error"), json!({"type": "error", "error": {"type": kind, "message": "details"}})));
        }
        P::OpenAi => {
            if let Some(text) = text {
                ev.push((None, json!({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]})));
            }
            ev.push((None, json!({"error": {"type": kind, "message": "details"}})));
        }
    }
    Reply::sse(&ev)
}

/// An error reported inside the stream: an overloaded server before any
/// content is retried; after content it fails the query without a retry; a
/// request error is not retried and fails as FAILED_PRECONDITION.
#[tokio::test(flavor = "multi_thread")]
async fn an_error_inside_the_stream_is_retried_only_when_nothing_was_streamed() {
    for p in [P::Anthropic, P::OpenAi] {
        let overloaded = match p {
            P::Anthropic => "overloaded_error",
            P::OpenAi => "server_error",
        };
        let invalid = "invalid_request_error";
        let good = match p {
            P::Anthropic => anthropic_stream("recovered", &[], "end_turn", (2, 3)),
            P::OpenAi => openai_stream("recovered", &[], "stop", (2, 3)),
        };

        let api = FakeApi::start(vec![stream_error(p, overloaded, None), good]).await;
        let lattice = spawn(&agent(p, &api.url, "")).await;
        let out = lattice.query("m", "hi").await;
        assert_eq!(out.expect_ok().text, "recovered", "{p:?}");
        assert_eq!(api.received().len(), 2, "{p:?}: retried once");

        let api = FakeApi::start(vec![stream_error(p, overloaded, Some("Half"))]).await;
        *api.fallback.lock().unwrap() = final_reply(p, "must not be used", "end_turn");
        let lattice = spawn(&agent(p, &api.url, "")).await;
        let out = lattice.query("m", "hi").await;
        assert_eq!(out.code(), Code::Internal, "{p:?}: {:?}", out.status);
        let message = out.status.as_ref().unwrap().message();
        assert!(message.contains("after part of the reply was streamed") && message.contains(overloaded), "{message}");
        assert_eq!(api.received().len(), 1, "{p:?}: not retried");

        let api = FakeApi::start(vec![stream_error(p, invalid, None)]).await;
        *api.fallback.lock().unwrap() = final_reply(p, "must not be used", "end_turn");
        let lattice = spawn(&agent(p, &api.url, "")).await;
        let out = lattice.query("m", "hi").await;
        assert_eq!(out.code(), Code::FailedPrecondition, "{p:?}: {:?}", out.status);
        let message = out.status.as_ref().unwrap().message();
        assert!(message.contains(p.name()) && message.contains(invalid), "{message}");
        assert_eq!(api.received().len(), 1, "{p:?}: not retried");
        assert_key_never_leaks(&lattice, &out);
    }
}

/// A response that is not JSON fails the query with a clear error.
#[tokio::test(flavor = "multi_thread")]
async fn invalid_json_fails_clearly() {
    for p in [P::Anthropic, P::OpenAi] {
        let api =
            FakeApi::start(vec![Reply::Body { status: 200, body: "{\"content\": [oops".into(), headers: vec![] }])
                .await;
        let lattice = spawn(&agent(p, &api.url, "stream = false")).await;
        let out = lattice.query("m", "hi").await;
        assert_eq!(out.code(), Code::Internal, "{p:?}");
        assert!(out.status.as_ref().unwrap().message().contains("not valid JSON"), "{:?}", out.status);
    }
}

/// A refused key fails the query with UNAUTHENTICATED (401) or
/// PERMISSION_DENIED (403), naming the provider and the status, without
/// retrying and without the key anywhere.
#[tokio::test(flavor = "multi_thread")]
async fn a_refused_key_fails_clearly_and_never_leaks() {
    for (p, status, code) in [
        (P::Anthropic, 401, Code::Unauthenticated),
        (P::OpenAi, 401, Code::Unauthenticated),
        (P::Anthropic, 403, Code::PermissionDenied),
    ] {
        let api = FakeApi::start(vec![Reply::status(
            status,
            json!({"type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key"}}),
        )])
        .await;
        let lattice = spawn(&agent(p, &api.url, "")).await;
        let out = lattice.query("m", "hi").await;
        assert_eq!(out.code(), code, "{p:?}");
        let message = out.status.as_ref().unwrap().message();
        assert!(message.contains(p.name()) && message.contains(&format!("HTTP {status}")), "{message}");
        assert_eq!(api.received().len(), 1);
        assert_key_never_leaks(&lattice, &out);
    }
}

/// Start-up refuses an unknown provider, a key variable that is not set and
/// an invalid base URL, naming each.
#[tokio::test(flavor = "multi_thread")]
async fn bad_provider_config_is_refused_at_start_up() {
    let config = "[[agents]]\nname = \"a\"\n[agents.model]\nprovider = \"cohere\"\nname = \"x\"\n\
                  [[agents]]\nname = \"b\"\n[agents.model]\nprovider = \"anthropic\"\nname = \"x\"\napi_key_env = \"LATTICE_NO_SUCH_VAR\"\nbase_url = \"ftp://nowhere\"\n";
    let err = Lattice::try_start(config).await.err().expect("refused");
    assert!(err.contains("test.toml:4: agents[0].model.provider: unknown provider \"cohere\""), "{err}");
    assert!(
        err.contains("agents[1].model.api_key_env: environment variable \"LATTICE_NO_SUCH_VAR\" is not set"),
        "{err}"
    );
    assert!(err.contains("agents[1].model.base_url: \"ftp://nowhere\" is not an http:// or https:// URL"), "{err}");
}

/// Cancelling the client stream while the model is answering cancels the
/// model request: the API sees its connection closed within 50 ms.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_cancel_cancels_the_model_request() {
    use tokio_stream::StreamExt;
    let start = json!({"type": "message_start", "message": {"usage": {"input_tokens": 1, "output_tokens": 1}}});
    let api = FakeApi::start(vec![Reply::Hang(format!("event: message_start\ndata: {start}\n\n"))]).await;
    let lattice = spawn(&agent(P::Anthropic, &api.url, "")).await;
    let mut client = lattice.client().await;
    let request =
        lattice_proto::agent::v1::QueryRequest { agent: "m".into(), prompt: "hi".into(), ..Default::default() };
    let mut stream = client.query(request).await.unwrap().into_inner();
    let _started = stream.next().await;
    let waiting = std::time::Instant::now();
    while api.received().is_empty() {
        assert!(waiting.elapsed() < Duration::from_secs(5), "the model request never arrived");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let dropped = std::time::Instant::now();
    drop(stream);
    drop(client);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let closed = api.closed.lock().unwrap().clone();
    assert_eq!(closed.len(), 1, "the model request was not cancelled");
    let after = closed[0].duration_since(dropped);
    assert!(after < Duration::from_millis(50), "cancelled {after:?} after the client went away");
}
