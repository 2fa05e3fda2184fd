//! The hook chain over real gRPC: registered order, keep/replace, both
//! events, strict deadlines, and fail-closed on every kind of failure with
//! nothing pre-hook leaking to any sink.

use std::time::{Duration, Instant};

use lattice_proto::hooks::v1::{SourceKind, ToolErrorKind};
use lattice_tests::{
    Lattice, QueryOpts, assert_no_leak,
    bad_hook::{BadHook, MalformedStatus, StatusIn},
    canary, cfg,
    hook::{Behaviour, HookServer, OnRequest, OnResult},
    raw_peer::{Misbehaviour, RawPeer},
    result_text, sample,
    tool::{ToolDef, ToolServer},
};
use tonic::Code;

fn appender(marker: &str) -> Behaviour {
    Behaviour {
        on_result: OnResult::Append(marker.into()),
        on_request: OnRequest::AppendSystem(marker.into()),
        ..Default::default()
    }
}

/// Three hooks each append a marker: the model and the client see them in
/// registered order, and each hook saw the previous hook's output.
#[tokio::test(flavor = "multi_thread")]
async fn three_hooks_fold_in_registered_order() {
    let tools = ToolServer::start(vec![ToolDef::new("t", "data")]).await;
    let (a, b, c) = (
        HookServer::start(appender("[A]")).await,
        HookServer::start(appender("[B]")).await,
        HookServer::start(appender("[C]")).await,
    );
    let both = ["tool_result", "model_request"];
    let config = cfg::agent("x", "system_prompt = \"sys\"")
        + &cfg::turn("go", &["t"])
        + &cfg::turn("model saw {{last_tool_result}} / {{system}}", &[])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::hook("a", &a.url, &both, 1000)
        + &cfg::hook("b", &b.url, &both, 1000)
        + &cfg::hook("c", &c.url, &both, 1000);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("x", "go").await;
    assert_eq!(out.expect_ok().text, "model saw data[A][B][C] / sys[A][B][C]");
    assert_eq!(out.tool_texts(), vec!["data[A][B][C]"]);
    assert_eq!(out.model_requests()[0].system, "sys[A][B][C]");
    // Each saw the previous output.
    let seen = |h: &HookServer| result_text(h.state.tool_results()[0].result.as_ref().unwrap());
    assert_eq!((seen(&a), seen(&b), seen(&c)), ("data".into(), "data[A]".into(), "data[A][B]".into()));
    assert_eq!(b.state.model_requests()[0].system, "sys[A]");
    assert_eq!(c.state.model_requests()[1].system, "sys[A][B]");
    // And in order in time.
    let at = |h: &HookServer| h.state.calls.lock().unwrap()[0].at;
    assert!(at(&a) < at(&b) && at(&b) < at(&c));
}

/// With `server.gather_writes = false` (h2 writes as it makes the frames,
/// on the API, hook and tool connections) the chain works the same, small
/// and large values alike.
#[tokio::test(flavor = "multi_thread")]
async fn the_chain_works_alike_with_writes_not_gathered() {
    let large = "y".repeat(200_000);
    let tools = ToolServer::start(vec![ToolDef::new("t", "data"), ToolDef::new("big", &large)]).await;
    let (a, b) = (HookServer::start(appender("[A]")).await, HookServer::start(appender("[B]")).await);
    let both = ["tool_result", "model_request"];
    let config = "[server]\ngather_writes = false\n".to_owned()
        + &cfg::agent("x", "system_prompt = \"sys\"")
        + &cfg::turn("go", &["t", "big"])
        + &cfg::turn("model saw {{system}}", &[])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::hook("a", &a.url, &both, 1000)
        + &cfg::hook("b", &b.url, &both, 1000);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("x", "go").await;
    assert_eq!(out.expect_ok().text, "model saw sys[A][B]");
    assert_eq!(out.tool_texts(), vec!["data[A][B]".to_owned(), format!("{large}[A][B]")]);
}

/// An unset reply keeps the value; a set one replaces it; a replacement may
/// flip is_error either way.
#[tokio::test(flavor = "multi_thread")]
async fn keep_replace_and_flip_is_error() {
    let mut failing = ToolDef::new("bad", "tool error text");
    failing.is_error = true;
    let tools = ToolServer::start(vec![ToolDef::new("good", "fine"), failing]).await;
    let keep = HookServer::start(Behaviour::default()).await;
    let flip = HookServer::start(Behaviour::default()).await;
    let config = cfg::agent("x", "")
        + &cfg::turn("go", &["good", "bad"])
        + &cfg::turn("done", &[])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::hook("keep", &keep.url, &["tool_result"], 1000)
        + &cfg::hook("flip", &flip.url, &["tool_result"], 1000);
    let lattice = Lattice::start(&config).await;

    let out = lattice.query("x", "go").await;
    out.expect_ok();
    let errs: Vec<bool> = out.tool_results().iter().map(|t| t.result.as_ref().unwrap().is_error).collect();
    assert_eq!(errs, vec![false, true]);
    assert_eq!(out.tool_texts(), vec!["fine", "tool error text"]);

    flip.state.set(Behaviour { on_result: OnResult::SetError(true), ..Default::default() });
    let out = lattice.query("x", "go").await;
    let errs: Vec<bool> = out.tool_results().iter().map(|t| t.result.as_ref().unwrap().is_error).collect();
    assert_eq!(errs, vec![true, true]);

    flip.state.set(Behaviour { on_result: OnResult::SetError(false), ..Default::default() });
    let out = lattice.query("x", "go").await;
    let errs: Vec<bool> = out.tool_results().iter().map(|t| t.result.as_ref().unwrap().is_error).collect();
    assert_eq!(errs, vec![false, false]);

    flip.state.set(Behaviour { on_result: OnResult::ReplaceText("replaced".into()), ..Default::default() });
    let out = lattice.query("x", "go").await;
    assert_eq!(out.tool_texts(), vec!["replaced", "replaced"]);
}

/// OnToolResult runs for every result: executed, tool error, RPC failure,
/// blocked by permission, unknown tool; it is told the error kind and the
/// source.
#[tokio::test(flavor = "multi_thread")]
async fn on_tool_result_sees_every_kind_of_result() {
    let mut is_error = ToolDef::new("is_error", "nope");
    is_error.is_error = true;
    let mut rpc_fail = ToolDef::new("rpc_fail", "");
    rpc_fail.fail = Some(Code::Internal);
    let tools =
        ToolServer::start(vec![ToolDef::new("ok", "fine"), is_error, rpc_fail, ToolDef::new("denied", "x")]).await;
    let hook = HookServer::start(Behaviour::default()).await;
    let config = cfg::agent("x", "deny = [\"denied\"]")
        + &cfg::turn("go", &["ok", "is_error", "rpc_fail", "denied", "ghost"])
        + &cfg::turn("done", &[])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::hook("h", &hook.url, &["tool_result"], 1000);
    let lattice = Lattice::start(&config).await;
    lattice.query("x", "go").await.expect_ok();
    let seen = hook.state.tool_results();
    let kinds: Vec<(String, i32, i32)> = seen
        .iter()
        .map(|r| (r.tool_name.clone(), r.error.as_ref().map_or(0, |e| e.kind), r.source.as_ref().unwrap().kind))
        .collect();
    let (svc, lat) = (SourceKind::ToolService as i32, SourceKind::Lattice as i32);
    assert_eq!(
        kinds,
        vec![
            ("ok".into(), 0, svc),
            ("is_error".into(), ToolErrorKind::ToolError as i32, svc),
            ("rpc_fail".into(), ToolErrorKind::RpcFailed as i32, svc),
            ("denied".into(), ToolErrorKind::PermissionDenied as i32, lat),
            ("ghost".into(), ToolErrorKind::UnknownTool as i32, lat),
        ]
    );
    let ctx = seen[0].context.as_ref().unwrap();
    assert_eq!((ctx.agent.as_str(), ctx.turn), ("x", 1));
    assert!(!ctx.session_id.is_empty() && !ctx.query_id.is_empty());
}

/// A tool call cancelled by an abort (the client went away) is reported to
/// the OnToolResult hooks as a cancelled result.
#[tokio::test(flavor = "multi_thread")]
async fn on_tool_result_sees_cancelled_calls() {
    let tools = ToolServer::start(vec![ToolDef::new("slow", "late").delay(Duration::from_secs(10))]).await;
    let hook = HookServer::start(Behaviour::default()).await;
    let config = cfg::agent("x", "")
        + &cfg::turn("go", &["slow"])
        + &cfg::tools(&tools.url, 20_000)
        + &cfg::hook("h", &hook.url, &["tool_result"], 1000);
    let lattice = Lattice::start(&config).await;
    let out = lattice
        .query_with(QueryOpts {
            agent: "x".into(),
            prompt: "go".into(),
            timeout: Some(Duration::from_millis(300)),
            ..Default::default()
        })
        .await;
    assert_eq!(out.code(), Code::DeadlineExceeded);
    let deadline = Instant::now() + Duration::from_secs(2);
    while hook.state.tool_results().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seen = hook.state.tool_results();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].error.as_ref().unwrap().kind, ToolErrorKind::Cancelled as i32);
    // The tool service learns of the cancellation from the stream's reset,
    // which travels on its own connection: under load it can arrive after
    // the hook's call has ended.
    let cancelled = || tools.state.cancelled.lock().unwrap().len();
    while cancelled() == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(cancelled(), 1);
}

/// OnModelRequest runs before every turn with the 1-based turn; its
/// replacement reaches the model but not the stored conversation, so the
/// next turn's hooks see the whole history again.
#[tokio::test(flavor = "multi_thread")]
async fn on_model_request_shapes_one_request_only() {
    let tools = ToolServer::start(vec![ToolDef::new("t", "r")]).await;
    let hook = HookServer::start(Behaviour { on_request: OnRequest::FirstMessageOnly, ..Default::default() }).await;
    let config = cfg::agent("x", "")
        + &cfg::turn("1", &["t"])
        + &cfg::turn("2", &["t"])
        + &cfg::turn("model saw {{message_count}} message(s)", &[])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::hook("h", &hook.url, &["model_request"], 1000);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("x", "go").await;
    assert_eq!(out.expect_ok().text, "model saw 1 message(s)");
    let seen = hook.state.model_requests();
    let turns: Vec<u32> = seen.iter().map(|r| r.context.as_ref().unwrap().turn).collect();
    assert_eq!(turns, vec![1, 2, 3]);
    let sizes: Vec<usize> = seen.iter().map(|r| r.messages.len()).collect();
    assert_eq!(sizes, vec![1, 3, 5], "each turn's hook sees the whole history");
    assert!(out.model_requests().iter().all(|r| r.messages.len() == 1));
    assert_eq!(seen[0].tools.len(), 1);
    let stored = lattice.session(&out.session_id()).await.unwrap();
    assert_eq!(stored.messages.len(), 6);
}

/// A system-prompt-only replacement keeps the messages; an empty message
/// list is a replacement (not "keep"), and an invalid one: a request starts
/// with a user message, so the query aborts.
#[tokio::test(flavor = "multi_thread")]
async fn system_only_and_empty_list_replacements() {
    let hook =
        HookServer::start(Behaviour { on_request: OnRequest::System("new system".into()), ..Default::default() }).await;
    let config = cfg::agent("x", "system_prompt = \"old\"")
        + &cfg::turn("{{system}} / {{message_count}}", &[])
        + &cfg::hook("h", &hook.url, &["model_request"], 1000);
    let lattice = Lattice::start(&config).await;
    assert_eq!(lattice.query("x", "hi").await.expect_ok().text, "new system / 1");
    hook.state.set(Behaviour { on_request: OnRequest::EmptyMessages, ..Default::default() });
    let out = lattice.query("x", "hi").await;
    assert_eq!(out.hook_failure()["kind"], "invalid_reply");
    assert!(out.model_requests().is_empty(), "nothing reaches the model");
}

/// Which way a scripted hook fails, and the `kind` Lattice must report.
#[derive(Clone, Copy, Debug)]
enum Failure {
    Unimplemented,
    Internal,
    /// A live hook answering UNAVAILABLE: a status it sent, not "unreachable".
    SaysUnavailable,
    /// A hook answering INTERNAL with the words tonic uses for a reply that
    /// does not decode: still the hook's own status.
    SaysDecodeFailed,
    /// Likewise OUT_OF_RANGE with the words of tonic's size limit.
    SaysTooLarge,
    Hang,
    Down,
    /// Accepts the connection and closes it before HTTP/2.
    ClosesAtOnce,
    /// Reads the request, then resets the connection.
    ResetsAfterRead,
    WrongId,
    Dangling,
    BadRole,
    EmptyMessages,
    TooLarge,
    Undecodable,
    /// Replies OK, with a `grpc-status-details-bin` that is not base64, in
    /// the trailers after a message or in a trailers-only reply.
    MalformedDetails(StatusIn),
}

impl Failure {
    fn kind(self) -> &'static str {
        match self {
            Failure::Unimplemented
            | Failure::Internal
            | Failure::SaysUnavailable
            | Failure::SaysDecodeFailed
            | Failure::SaysTooLarge => "status",
            Failure::Hang => "deadline",
            Failure::Down | Failure::ClosesAtOnce | Failure::ResetsAfterRead => "unavailable",
            _ => "invalid_reply",
        }
    }

    /// The `code` metadata: the canonical gRPC name of the status the hook
    /// sent, for `status` failures only.
    fn code(self) -> Option<&'static str> {
        match self {
            Failure::Unimplemented => Some("UNIMPLEMENTED"),
            Failure::Internal | Failure::SaysDecodeFailed => Some("INTERNAL"),
            Failure::SaysUnavailable => Some("UNAVAILABLE"),
            Failure::SaysTooLarge => Some("OUT_OF_RANGE"),
            _ => None,
        }
    }
}

async fn failing_hook(f: Failure) -> (String, Option<HookServer>, Option<Box<dyn Send>>, Option<RawPeer>) {
    let b = |b: Behaviour| async move {
        let h = HookServer::start(b).await;
        (h.url.clone(), Some(h), None, None)
    };
    let raw = |m: Misbehaviour| async move {
        let p = RawPeer::start(m).await;
        (p.url.clone(), None, None, Some(p))
    };
    let says = |code: Code, message: &str| Behaviour {
        fail: Some(code),
        fail_message: Some(message.to_owned()),
        ..Default::default()
    };
    match f {
        Failure::Unimplemented => b(Behaviour { fail: Some(Code::Unimplemented), ..Default::default() }).await,
        Failure::Internal => b(Behaviour { fail: Some(Code::Internal), ..Default::default() }).await,
        Failure::SaysUnavailable => b(says(Code::Unavailable, "scripted failure")).await,
        Failure::SaysDecodeFailed => {
            b(says(Code::Internal, "failed to decode Protobuf message: invalid wire type")).await
        }
        Failure::SaysTooLarge => {
            b(says(Code::OutOfRange, "Error, decoded message length too large: found 9 bytes, the limit is: 1 bytes"))
                .await
        }
        Failure::ClosesAtOnce => raw(Misbehaviour::CloseAtOnce).await,
        Failure::ResetsAfterRead => raw(Misbehaviour::ResetAfterRead).await,
        Failure::EmptyMessages => b(Behaviour { on_request: OnRequest::EmptyMessages, ..Default::default() }).await,
        Failure::Hang => b(Behaviour { hang: true, ..Default::default() }).await,
        Failure::WrongId => b(Behaviour { on_result: OnResult::WrongId, ..Default::default() }).await,
        Failure::Dangling => b(Behaviour { on_request: OnRequest::Dangling, ..Default::default() }).await,
        Failure::BadRole => b(Behaviour { on_request: OnRequest::BadRole, ..Default::default() }).await,
        Failure::TooLarge => {
            b(Behaviour {
                on_result: OnResult::Huge(200_000),
                on_request: OnRequest::AppendToLastText("y".repeat(200_000)),
                ..Default::default()
            })
            .await
        }
        Failure::Down => (lattice_tests::dead_url().await, None, None, None),
        Failure::Undecodable => {
            let h = BadHook::start().await;
            (h.url.clone(), None, Some(Box::new(h)), None)
        }
        Failure::MalformedDetails(status_in) => {
            let h = MalformedStatus::start(status_in).await;
            (h.url.clone(), None, Some(Box::new(h)), None)
        }
    }
}

/// Every kind of OnToolResult failure aborts with ABORTED + HOOK_FAILED and
/// the right metadata; the canary in the tool result reaches no sink, and
/// the hook's own status message is not passed on.
#[tokio::test(flavor = "multi_thread")]
async fn every_tool_result_hook_failure_aborts_without_leaking() {
    for f in [
        Failure::Unimplemented,
        Failure::Internal,
        Failure::SaysUnavailable,
        Failure::SaysDecodeFailed,
        Failure::SaysTooLarge,
        Failure::Hang,
        Failure::Down,
        Failure::ClosesAtOnce,
        Failure::ResetsAfterRead,
        Failure::WrongId,
        Failure::TooLarge,
        Failure::Undecodable,
        Failure::MalformedDetails(StatusIn::Trailers),
        Failure::MalformedDetails(StatusIn::Headers),
    ] {
        let secret = canary();
        let tools = ToolServer::start(vec![ToolDef::new("t", &format!("the secret is {secret}"))]).await;
        let first = HookServer::start(appender("[ok]")).await;
        let (url, _keep, _keep_bad, _keep_raw) = failing_hook(f).await;
        let config = "[server]\nhook_max_message_bytes = 65536\n".to_owned()
            + &cfg::agent("x", "")
            + &cfg::turn("go", &["t"])
            + &cfg::turn("{{request}}", &[])
            + &cfg::tools(&tools.url, 2000)
            + &cfg::hook("first", &first.url, &["tool_result"], 1000)
            + &cfg::optional_hook("second", &url, &["tool_result"], 300);
        let lattice = Lattice::start(&config).await;
        let out = lattice.query("x", "go").await;
        let meta = out.hook_failure();
        assert_eq!(meta["hook"], "second", "{f:?}");
        assert_eq!(meta["event"], "tool_result");
        assert_eq!(meta["kind"], f.kind(), "{f:?}: {:?}", out.status);
        assert_eq!(meta.get("code").map(String::as_str), f.code(), "{f:?}");
        assert!(meta["tool_use_id"].starts_with("toolu_"));
        assert!(out.tool_results().is_empty(), "{f:?}: no tool result reaches the client");
        assert!(!out.status.as_ref().unwrap().message().contains("scripted failure"));
        assert_no_leak(&secret, &lattice, &out);
        // The trace records the failure, and nothing pre-hook.
        assert!(lattice.traces().contains("\"type\":\"error\""));
    }
}

/// Every kind of OnModelRequest failure aborts the same way; the prompt's
/// canary reaches no trace, log or error.
#[tokio::test(flavor = "multi_thread")]
async fn every_model_request_hook_failure_aborts_without_leaking() {
    for f in [
        Failure::Unimplemented,
        Failure::SaysUnavailable,
        Failure::Hang,
        Failure::Down,
        Failure::ClosesAtOnce,
        Failure::Dangling,
        Failure::BadRole,
        Failure::EmptyMessages,
        Failure::TooLarge,
        Failure::Undecodable,
        Failure::MalformedDetails(StatusIn::Trailers),
        Failure::MalformedDetails(StatusIn::Headers),
    ] {
        let secret = canary();
        let (url, _keep, _keep_bad, _keep_raw) = failing_hook(f).await;
        let config = "[server]\nhook_max_message_bytes = 65536\n".to_owned()
            + &cfg::agent("x", "")
            + &cfg::turn("{{request}}", &[])
            + &cfg::optional_hook("shaper", &url, &["model_request"], 300);
        let lattice = Lattice::start(&config).await;
        let out = lattice.query("x", &format!("my secret is {secret}")).await;
        let meta = out.hook_failure();
        assert_eq!(meta["hook"], "shaper");
        assert_eq!(meta["event"], "model_request");
        assert_eq!(meta["turn"], "1");
        assert_eq!(meta["kind"], f.kind(), "{f:?}: {:?}", out.status);
        assert_eq!(meta.get("code").map(String::as_str), f.code(), "{f:?}");
        assert!(out.model_requests().is_empty() && out.assistant_texts().is_empty());
        assert!(!lattice.traces().contains(&secret), "{f:?}: trace");
        assert!(!lattice_tests::logs().contains(&secret), "{f:?}: logs");
        assert!(!out.status.as_ref().unwrap().message().contains(&secret));
    }
}

/// A hook that never answers aborts the query within its deadline + 50 ms,
/// and the deadline was sent to it as grpc-timeout.
#[tokio::test(flavor = "multi_thread")]
async fn a_hook_that_never_answers_aborts_at_its_deadline() {
    let tools = ToolServer::start(vec![ToolDef::new("t", "data")]).await;
    let hook = HookServer::start(Behaviour { hang: true, ..Default::default() }).await;
    let config = cfg::agent("x", "")
        + &cfg::turn("go", &["t"])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::hook("h", &hook.url, &["tool_result"], 400);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("x", "go").await;
    assert_eq!(out.hook_failure()["kind"], "deadline");
    let call = hook.state.calls.lock().unwrap()[0].clone();
    let waited = out.ended.duration_since(call.at);
    assert!(waited >= Duration::from_millis(390) && waited <= Duration::from_millis(450), "aborted after {waited:?}");
    let sent: u64 = call.grpc_timeout.as_deref().unwrap().trim_end_matches('u').parse().unwrap();
    assert!((300_000..=400_000).contains(&sent), "grpc-timeout {sent}u");
    // The call's span carries hook, event, budget, outcome and duration.
    let logs = lattice_tests::logs();
    let line = logs.lines().find(|l| l.contains("hook failed")).expect("a hook failure log line");
    for field in ["hook=h", "event=tool_result", "budget_ms=", "outcome=", "deadline", "elapsed_ms="] {
        assert!(line.contains(field), "{field} missing from {line}");
    }
}

/// A query deadline shorter than the hook's caps the hook's budget: the
/// hook is told the shorter one, and the query ends by it with
/// DEADLINE_EXCEEDED, as it would anywhere else (not blaming the hook).
/// The prompt, which the hook never released, reaches no sink.
#[tokio::test(flavor = "multi_thread")]
async fn the_query_deadline_caps_the_hook_budget() {
    let hook = HookServer::start(Behaviour { hang: true, ..Default::default() }).await;
    let config = cfg::agent("x", "") + &cfg::turn("hi", &[]) + &cfg::hook("h", &hook.url, &["model_request"], 5000);
    let lattice = Lattice::start(&config).await;
    let secret = canary();
    let out = lattice
        .query_with(QueryOpts {
            agent: "x".into(),
            prompt: format!("my secret is {secret}"),
            timeout: Some(Duration::from_millis(400)),
            ..Default::default()
        })
        .await;
    assert_eq!(out.code(), Code::DeadlineExceeded, "{:?}", out.status);
    assert!(out.final_result().is_none() && out.model_requests().is_empty());
    assert_no_leak(&secret, &lattice, &out);
    assert!(out.elapsed < Duration::from_millis(450), "took {:?}", out.elapsed);
    let sent: u64 =
        hook.state.calls.lock().unwrap()[0].grpc_timeout.as_deref().unwrap().trim_end_matches('u').parse().unwrap();
    assert!(sent <= 400_000, "grpc-timeout {sent}u exceeds the query's deadline");
}

/// A hook that is down at start-up doesn't stop the server; queries abort
/// until it comes up, then work, without a restart.
#[tokio::test(flavor = "multi_thread")]
async fn a_hook_down_at_start_up_works_once_it_is_up() {
    let port = lattice_tests::reserve();
    let addr = port.addr;
    let config = cfg::agent("x", "")
        + &cfg::turn("hi", &[])
        + &cfg::hook("h", &format!("http://{addr}"), &["model_request"], 500);
    let lattice = Lattice::start_unready(&config).await;
    assert!(!lattice.serving().await, "a required hook that is down: NOT_SERVING");
    assert_eq!(lattice.query("x", "hi").await.hook_failure()["kind"], "unavailable");
    let hook = HookServer::start_on(port.listen(), addr, appender("!")).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let out = lattice.query("x", "hi").await;
        if out.status.is_none() {
            assert_eq!(out.model_requests()[0].system, "!");
            break;
        }
        assert!(Instant::now() < deadline, "the hook never became usable: {:?}", out.status);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!hook.state.model_requests().is_empty());
    // Its next health check brings Lattice back into rotation.
    let deadline = Instant::now() + Duration::from_secs(3);
    while !lattice.serving().await {
        assert!(Instant::now() < deadline, "still NOT_SERVING with the hook up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A `dns:///host:port` endpoint: calls go to the addresses the name
/// resolves to. A name that resolves to nothing aborts the query at once
/// (unavailable), not at the hook's deadline, and leaks nothing.
#[tokio::test(flavor = "multi_thread")]
async fn dns_endpoints_resolve_and_fail_closed_without_an_address() {
    let secret = canary();
    let tools = ToolServer::start(vec![ToolDef::new("t", &secret)]).await;
    let hook =
        HookServer::start(Behaviour { on_result: OnResult::ReplaceText("clean".into()), ..Default::default() }).await;
    let agent = |endpoint: &str| {
        cfg::agent("x", "")
            + &cfg::turn("go", &["t"])
            + &cfg::turn("model saw {{last_tool_result}}", &[])
            + &cfg::tools(&tools.url, 2000)
            + &cfg::hook("h", endpoint, &["tool_result"], 2000)
    };
    let lattice = Lattice::start(&agent(&hook.url.replace("http://", "dns:///"))).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        // The name is resolved in the background from start-up on.
        let out = lattice.query("x", "go").await;
        assert_no_leak(&secret, &lattice, &out);
        if out.status.is_none() {
            assert_eq!(out.expect_ok().text, "model saw clean");
            break;
        }
        assert!(Instant::now() < deadline, "the dns:/// hook never answered: {:?}", out.status);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(hook.state.tool_results().len(), 1);

    // A required hook (the default) with no address: NOT_SERVING, and a
    // query fails at once.
    let lattice = Lattice::start_unready(&agent("dns:///no-such-hook.invalid:50071")).await;
    assert!(!lattice.serving().await, "a required hook has no address: NOT_SERVING");
    let out = lattice.query("x", "go").await;
    assert_eq!(out.hook_failure()["kind"], "unavailable");
    assert!(out.elapsed < Duration::from_millis(1000), "took {:?} (the hook's deadline is 2 s)", out.elapsed);
    assert_no_leak(&secret, &lattice, &out);
    // Preflight: with the tool_result hook unreachable, the tool was not
    // even called (its result could only have been thrown away).
    assert_eq!(tools.state.calls.lock().unwrap().len(), 1, "only the first server's query called the tool");
}

/// Prometheus metrics at `GET /metrics` on the gRPC port count what
/// happened: queries by code, hook calls by outcome with their durations,
/// tool calls by outcome (counted before the hooks, so an aborted query's
/// calls count too; a tool the model made up is `(unknown)`), model
/// requests; label values come from the config, never from payloads.
#[tokio::test(flavor = "multi_thread")]
async fn metrics_count_queries_hook_calls_and_tool_calls() {
    let secret = canary();
    let tools = ToolServer::start(vec![ToolDef::new("t", &secret)]).await;
    let hook =
        HookServer::start(Behaviour { on_result: OnResult::ReplaceText("clean".into()), ..Default::default() }).await;
    let config = cfg::agent("x", "")
        + &cfg::turn("go", &["t", &format!("made-up-{secret}")])
        + &cfg::turn("done", &[])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::hook("h", &hook.url, &["tool_result"], 2000);
    let lattice = Lattice::start(&config).await;
    let before = lattice.metrics().await;
    assert_eq!(sample(&before, "lattice_queries_in_flight"), Some(0.0), "{before}");
    assert_eq!(sample(&before, r#"lattice_queries_total{agent="x",code="OK"}"#), None);

    lattice.query("x", "go").await.expect_ok();
    // The second query aborts at the first result's hook: its second call
    // (sequential) never runs.
    hook.state.behaviour.lock().unwrap().fail = Some(Code::PermissionDenied);
    lattice.query("x", "go").await.hook_failure();
    // An invalid reply is a failure like any other: counted, and logged.
    hook.state.set(Behaviour { on_result: OnResult::WrongId, ..Default::default() });
    assert_eq!(lattice.query("x", "go").await.hook_failure()["kind"], "invalid_reply");
    let logs = lattice_tests::logs();
    assert!(logs.lines().any(|l| l.contains("hook failed") && l.contains("invalid_reply")), "no log line");

    let m = lattice.metrics().await;
    for (series, expected) in [
        (r#"lattice_queries_total{agent="x",code="OK"}"#, 1.0),
        (r#"lattice_queries_total{agent="x",code="ABORTED"}"#, 2.0),
        (r#"lattice_hook_calls_total{agent="x",hook="h",event="tool_result",outcome="ok"}"#, 2.0),
        (r#"lattice_hook_calls_total{agent="x",hook="h",event="tool_result",outcome="status"}"#, 1.0),
        (r#"lattice_hook_calls_total{agent="x",hook="h",event="tool_result",outcome="invalid_reply"}"#, 1.0),
        (r#"lattice_hook_call_duration_seconds_count{agent="x",hook="h",event="tool_result"}"#, 4.0),
        (r#"lattice_tool_calls_total{agent="x",tool="t",outcome="executed"}"#, 3.0),
        (r#"lattice_tool_calls_total{agent="x",tool="(unknown)",outcome="blocked"}"#, 1.0),
        (r#"lattice_model_requests_total{agent="x",provider="scripted",outcome="ok"}"#, 4.0),
        (r#"lattice_query_duration_seconds_count{agent="x"}"#, 3.0),
        ("lattice_queries_in_flight", 0.0),
    ] {
        assert_eq!(sample(&m, series), Some(expected), "{series} in:\n{m}");
    }
    assert!(m.contains("# TYPE lattice_hook_call_duration_seconds histogram"), "{m}");
    assert!(!m.contains(&secret), "a payload reached the metrics:\n{m}");
}

/// A hook call cut short by the client going away is still counted, with
/// outcome `cancelled`.
#[tokio::test(flavor = "multi_thread")]
async fn a_hook_call_cut_short_by_a_cancel_is_counted() {
    let hook = HookServer::start(Behaviour { hang: true, ..Default::default() }).await;
    let config = cfg::agent("x", "") + &cfg::turn("hi", &[]) + &cfg::hook("h", &hook.url, &["model_request"], 5000);
    let lattice = Lattice::start(&config).await;
    let mut client = lattice.client().await;
    let request =
        lattice_proto::agent::v1::QueryRequest { agent: "x".into(), prompt: "hi".into(), ..Default::default() };
    let stream = client.query(request).await.unwrap().into_inner();
    let deadline = Instant::now() + Duration::from_secs(5);
    while hook.state.model_requests().is_empty() {
        assert!(Instant::now() < deadline, "the hook was never called");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(stream);
    drop(client);
    let series = r#"lattice_hook_calls_total{agent="x",hook="h",event="model_request",outcome="cancelled"}"#;
    let deadline = Instant::now() + Duration::from_secs(5);
    while sample(&lattice.metrics().await, series) != Some(1.0) {
        assert!(Instant::now() < deadline, "the cancelled call was not counted:\n{}", lattice.metrics().await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A delegated agent runs its own chain: its tool results don't reach the
/// parent's hooks, its final text does (as the parent's tool result), and
/// its own hook failure aborts the whole query.
#[tokio::test(flavor = "multi_thread")]
async fn delegated_agents_run_their_own_chain() {
    let tools = ToolServer::start(vec![ToolDef::new("inner", "inner-data")]).await;
    let parent_hook = HookServer::start(appender("[P]")).await;
    let child_hook = HookServer::start(appender("[C]")).await;
    let config = cfg::agent("parent", "")
        + &cfg::turn("asking", &["child:{ prompt = \"dig\" }"])
        + &cfg::turn("parent got {{last_tool_result}}", &[])
        + &cfg::delegate("child")
        + &cfg::hook("p", &parent_hook.url, &["tool_result"], 1000)
        + &cfg::agent("child", "")
        + &cfg::turn("digging", &["inner"])
        + &cfg::turn("child got {{last_tool_result}}", &[])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::hook("c", &child_hook.url, &["tool_result"], 1000);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("parent", "go").await;
    assert_eq!(out.expect_ok().text, "parent got child got inner-data[C][P]");
    let parent_seen = parent_hook.state.tool_results();
    assert_eq!(parent_seen.len(), 1);
    assert_eq!(parent_seen[0].tool_name, "child");
    assert_eq!(parent_seen[0].source.as_ref().unwrap().kind, SourceKind::DelegatedAgent as i32);
    assert_eq!(parent_seen[0].source.as_ref().unwrap().name, "child");
    let child_seen = child_hook.state.tool_results();
    assert_eq!(child_seen.len(), 1);
    assert_eq!(child_seen[0].tool_name, "inner");
    assert_eq!(child_seen[0].context.as_ref().unwrap().agent, "child");

    let secret = canary();
    tools.state.tools.lock().unwrap()[0].text = secret.clone();
    child_hook.state.set(Behaviour { fail: Some(Code::Internal), ..Default::default() });
    let out = lattice.query("parent", "go").await;
    let meta = out.hook_failure();
    assert_eq!((meta["agent"].as_str(), meta["hook"].as_str()), ("child", "c"));
    assert!(out.tool_results().is_empty(), "never an error text the parent model reads");
    assert_no_leak(&secret, &lattice, &out);
}

/// A disabled entry is skipped: its service is never called.
#[tokio::test(flavor = "multi_thread")]
async fn a_disabled_hook_is_skipped() {
    let off = HookServer::start(Behaviour { fail: Some(Code::Internal), ..Default::default() }).await;
    let config = cfg::agent("x", "")
        + &cfg::turn("hi", &[])
        + &cfg::disabled_hook("off", &off.url, &["tool_result", "model_request"]);
    let lattice = Lattice::start(&config).await;
    lattice.query("x", "hi").await.expect_ok();
    assert!(off.state.calls.lock().unwrap().is_empty());
}

/// Parallel tool calls: each result's chain is strictly sequential, and
/// results reach the client and the model in tool_use order even when later
/// calls finish first.
#[tokio::test(flavor = "multi_thread")]
async fn parallel_results_keep_their_order_and_their_chain() {
    let tools = ToolServer::start(vec![
        ToolDef::new("slow", "S").delay(Duration::from_millis(300)),
        ToolDef::new("mid", "M").delay(Duration::from_millis(150)),
        ToolDef::new("fast", "F"),
    ])
    .await;
    let a = HookServer::start(Behaviour { delay: Duration::from_millis(20), ..appender("a") }).await;
    let b = HookServer::start(appender("b")).await;
    let config = cfg::agent("x", "parallel_tool_calls = 3")
        + &cfg::turn("go", &["slow", "mid", "fast"])
        + &cfg::turn("{{request}}", &[])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::hook("a", &a.url, &["tool_result"], 1000)
        + &cfg::hook("b", &b.url, &["tool_result"], 1000);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("x", "go").await;
    let text = out.expect_ok().text.clone();
    assert_eq!(out.tool_texts(), vec!["Sab", "Mab", "Fab"]);
    assert!(text.ends_with("Sab\nMab\nFab"), "{text}");
    // The chains overlapped (fast's finished first) ...
    let a_order: Vec<String> = a.state.tool_results().iter().map(|r| r.tool_name.clone()).collect();
    assert_eq!(a_order, vec!["fast", "mid", "slow"]);
    // ... but within each result, b saw a's output.
    for r in b.state.tool_results() {
        assert!(result_text(r.result.as_ref().unwrap()).ends_with('a'), "{r:?}");
    }
}

/// A session whose conversation outgrew the hook message limit goes on:
/// the OnModelRequest hooks and the model see the newest messages that fit
/// (the hook is told how many were left out), while the stored history
/// keeps everything. A prompt too large on its own aborts as
/// request_too_large without blaming the hook, and the session stays usable.
#[tokio::test(flavor = "multi_thread")]
async fn a_conversation_larger_than_the_hook_limit_goes_on_in_a_window() {
    let hook = HookServer::start(Behaviour::default()).await;
    let config = "[server]\nhook_max_message_bytes = 32768\n".to_owned()
        + &cfg::agent("x", "")
        + &cfg::turn("seen {{message_count}}", &[])
        + &cfg::hook("h", &hook.url, &["model_request"], 1000);
    let lattice = Lattice::start(&config).await;
    let mut session = None;
    let mut seen = Vec::new();
    for i in 0..6 {
        let opts = QueryOpts {
            agent: "x".into(),
            prompt: format!("{i}{}", "p".repeat(10 * 1024)),
            session: session.clone(),
            ..Default::default()
        };
        let out = lattice.query_with(opts).await;
        seen.push(out.expect_ok().text.clone());
        session = Some(out.session_id());
    }
    let sid = session.unwrap();
    assert_eq!(lattice.session(&sid).await.unwrap().messages.len(), 12, "the stored history keeps everything");
    let requests = hook.state.model_requests();
    let last = requests.last().unwrap();
    assert!(last.omitted_messages > 0, "{seen:?}");
    assert_eq!(last.messages.len() as u32 + last.omitted_messages, 11);
    assert!(prost::Message::encoded_len(last) <= 32768);
    // The model saw the same window as the hook.
    assert_eq!(seen[5], format!("seen {}", last.messages.len()));
    assert!(requests[0].omitted_messages == 0 && requests[0].messages.len() == 1);

    let huge = QueryOpts {
        agent: "x".into(),
        prompt: "q".repeat(40 * 1024),
        session: Some(sid.clone()),
        ..Default::default()
    };
    let out = lattice.query_with(huge).await;
    let meta = out.hook_failure();
    assert_eq!(meta["kind"], "request_too_large");
    let message = out.status.as_ref().unwrap().message();
    assert!(message.contains("was not called") && !message.contains("failed on"), "{message}");
    assert_eq!(lattice.session(&sid).await.unwrap().messages.len(), 12);
    let next = QueryOpts { agent: "x".into(), prompt: "small".into(), session: Some(sid), ..Default::default() };
    lattice.query_with(next).await.expect_ok();
}

/// The first hook failure aborts the query at once: it does not wait for a
/// slower sibling tool call (5 s here), and that call is cancelled, which
/// the tool service observes.
#[tokio::test(flavor = "multi_thread")]
async fn a_hook_failure_does_not_wait_for_slower_tool_calls() {
    let tools =
        ToolServer::start(vec![ToolDef::new("slow", "S").delay(Duration::from_secs(5)), ToolDef::new("fast", "F")])
            .await;
    let hook = HookServer::start(Behaviour { fail: Some(Code::Internal), ..Default::default() }).await;
    let config = cfg::agent("x", "parallel_tool_calls = 2")
        + &cfg::turn("go", &["slow", "fast"])
        + &cfg::turn("{{request}}", &[])
        + &cfg::tools(&tools.url, 10_000)
        + &cfg::hook("h", &hook.url, &["tool_result"], 1000);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("x", "go").await;
    let meta = out.hook_failure();
    let failed_on = hook.state.tool_results()[0].clone();
    assert_eq!(failed_on.tool_name, "fast");
    assert_eq!(meta["tool_use_id"], failed_on.tool_use_id);
    assert!(out.elapsed < Duration::from_secs(1), "the abort waited {:?}", out.elapsed);
    let slow_id = tools.state.calls.lock().unwrap().iter().find(|c| c.1 == "slow").unwrap().0.clone();
    let deadline = Instant::now() + Duration::from_secs(2);
    while !tools.state.cancelled.lock().unwrap().iter().any(|c| c.0 == slow_id) {
        assert!(Instant::now() < deadline, "the slow tool call was not cancelled");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(out.tool_results().is_empty());
}

/// On success the trace holds what was actually sent: post-hook values, not
/// the tool's raw output.
#[tokio::test(flavor = "multi_thread")]
async fn the_trace_records_post_hook_values() {
    let secret = canary();
    let tools = ToolServer::start(vec![ToolDef::new("t", &format!("raw {secret}"))]).await;
    let hook =
        HookServer::start(Behaviour { on_result: OnResult::ReplaceText("[redacted]".into()), ..Default::default() })
            .await;
    let config = cfg::agent("x", "")
        + &cfg::turn("go", &["t"])
        + &cfg::turn("model saw {{request}}", &[])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::hook("redact", &hook.url, &["tool_result"], 1000);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("x", "go").await;
    assert!(out.expect_ok().text.contains("[redacted]"));
    let trace = lattice.traces();
    for kind in ["model_request", "assistant_message", "tool_use", "tool_result", "result"] {
        assert!(trace.contains(&format!("\"type\":\"{kind}\"")), "missing {kind} in trace");
    }
    assert!(trace.contains("[redacted]"));
    assert_no_leak(&secret, &lattice, &out);
}

/// TestHooks on a model request runs the OnModelRequest hooks only, in
/// order, and reports an invalid replacement as the hook's failure; a
/// request without a value, or with messages that are not a valid
/// conversation, is INVALID_ARGUMENT; an unknown agent NOT_FOUND.
#[tokio::test(flavor = "multi_thread")]
async fn test_hooks_dry_runs_model_request_hooks() {
    use lattice_proto::agent::v1::{self as apb, test_hooks_request::Value};
    let system =
        HookServer::start(Behaviour { on_request: OnRequest::System("new system".into()), ..Default::default() }).await;
    let results_only = HookServer::start(appender("[r]")).await;
    let dangling = HookServer::start(Behaviour { on_request: OnRequest::Dangling, ..Default::default() }).await;
    let config = cfg::agent("x", "")
        + &cfg::turn("done", &[])
        + &cfg::hook("system", &system.url, &["model_request"], 1000)
        + &cfg::hook("results", &results_only.url, &["tool_result"], 1000)
        + &cfg::agent("y", "")
        + &cfg::turn("done", &[])
        + &cfg::hook("dangling", &dangling.url, &["model_request"], 1000);
    let lattice = Lattice::start(&config).await;
    let mut client = lattice.client().await;
    let user = |text: &str| apb::Message {
        role: apb::Role::User as i32,
        content: vec![apb::ContentBlock {
            block: Some(apb::content_block::Block::Text(apb::TextBlock { text: text.into() })),
        }],
    };
    let request = |agent: &str, messages: Vec<apb::Message>| apb::TestHooksRequest {
        agent: agent.into(),
        value: Some(Value::ModelRequest(apb::TestModelRequest { turn: 3, system: "old".into(), messages })),
    };
    let report = client.test_hooks(request("x", vec![user("hi")])).await.unwrap().into_inner();
    assert!(report.completed);
    assert_eq!(report.steps.len(), 1, "the tool_result hook does not run");
    assert_eq!((report.steps[0].hook.as_str(), report.steps[0].changed), ("system", true));
    assert_eq!(report.system, "new system");
    assert_eq!(system.state.model_requests()[0].context.as_ref().unwrap().turn, 3);

    let report = client.test_hooks(request("y", vec![user("hi")])).await.unwrap().into_inner();
    assert!(!report.completed);
    let failure = report.steps[0].failure.as_ref().unwrap();
    assert_eq!(failure.kind, "invalid_reply", "{failure:?}");

    let invalid = apb::Message { role: apb::Role::Assistant as i32, ..user("first") };
    let status = client.test_hooks(request("x", vec![invalid])).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    let none = apb::TestHooksRequest { agent: "x".into(), value: None };
    assert_eq!(client.test_hooks(none).await.unwrap_err().code(), Code::InvalidArgument);
    assert_eq!(client.test_hooks(request("nobody", vec![user("hi")])).await.unwrap_err().code(), Code::NotFound);
}

/// Match conditions: a hook with `tools` sees only those tools' results,
/// one with `min_messages` only requests that long; the others go on
/// unchanged, uncalled. The dry run shows the conditions too. GetAgent
/// shows them and the chain's version, which each hook receives in its
/// request's context, and which the conditions change.
#[tokio::test(flavor = "multi_thread")]
async fn match_conditions_leave_out_what_a_hook_does_not_care_about() {
    use lattice_proto::agent::v1::{self as apb, test_hooks_request::Value};
    let tools = ToolServer::start(vec![ToolDef::new("queryDatabase", "rows"), ToolDef::new("other", "text")]).await;
    let (db, compact) = (HookServer::start(appender("[db]")).await, HookServer::start(appender("[compact]")).await);
    let agent = cfg::agent("x", "system_prompt = \"sys\"")
        + &cfg::turn("go", &["queryDatabase", "other"])
        + &cfg::turn("model saw {{system}}", &[])
        + &cfg::tools(&tools.url, 2000);
    let hooks = cfg::hook("db", &db.url, &["tool_result"], 1000)
        + "tools = [\"queryDatabase\"]\n"
        + &cfg::hook("compact", &compact.url, &["model_request"], 1000)
        + "min_messages = 3\n";
    let lattice = Lattice::start(&(agent.clone() + &hooks)).await;
    let out = lattice.query("x", "go").await;
    // The second request (the prompt, the reply with its calls, their
    // results: 3 messages) is the only one long enough for `compact`.
    assert_eq!(out.expect_ok().text, "model saw sys[compact]");
    assert_eq!(out.tool_texts(), vec!["rows[db]", "text"]);
    assert_eq!(db.state.tool_results().len(), 1, "db saw queryDatabase's result only");
    assert_eq!(db.state.tool_results()[0].tool_name, "queryDatabase");
    assert_eq!(compact.state.model_requests().len(), 1);

    let mut client = lattice.client().await;
    let info = client.get_agent(apb::GetAgentRequest { name: "x".into() }).await.unwrap().into_inner();
    assert_eq!(info.hooks[0].tools, ["queryDatabase"]);
    assert_eq!(info.hooks[1].min_messages, 3);
    assert_eq!(info.chain_version.len(), 16, "{info:?}");
    let sent = db.state.tool_results()[0].context.clone().unwrap_or_default();
    assert_eq!(sent.chain_version, info.chain_version, "the hook is told the chain's version");

    // The dry run leaves `db` out for another tool, and says so.
    let dry = apb::TestHooksRequest {
        agent: "x".into(),
        value: Some(Value::ToolResult(apb::TestToolResult {
            tool_name: "other".into(),
            input: None,
            result: Some(apb::ToolResultBlock {
                tool_use_id: "toolu_1".into(),
                content: vec![apb::TextBlock { text: "v".into() }],
                is_error: false,
            }),
        })),
    };
    let report = client.test_hooks(dry).await.unwrap().into_inner();
    assert!(report.completed);
    assert_eq!(report.steps.len(), 1);
    assert!(report.steps[0].not_matched && !report.steps[0].replaced, "{:?}", report.steps[0]);
    assert_eq!(db.state.tool_results().len(), 1, "not called by the dry run");

    // Without the conditions the chain is another one.
    let unconditioned = cfg::hook("db", &db.url, &["tool_result"], 1000)
        + &cfg::hook("compact", &compact.url, &["model_request"], 1000);
    let other = Lattice::start(&(agent + &unconditioned)).await;
    let mut client = other.client().await;
    let info_other = client.get_agent(apb::GetAgentRequest { name: "x".into() }).await.unwrap().into_inner();
    assert_ne!(info_other.chain_version, info.chain_version);
}

/// Shadow hooks: each receives what `redact` receives, in parallel; its
/// output is never applied, its failure aborts nothing, the query does not
/// wait for a slow one; the agreement of each with `redact` is counted by
/// digest and written in the audit record, never a value.
#[tokio::test(flavor = "multi_thread")]
async fn shadow_hooks_are_compared_and_never_applied() {
    let secret = canary();
    let tools = ToolServer::start(vec![ToolDef::new("t", &secret)]).await;
    let replace = |text: &str| Behaviour { on_result: OnResult::ReplaceText(text.into()), ..Default::default() };
    // `redact` answers last, so that the fast shadows have answered by
    // then and are in the query's audit record.
    let redact = HookServer::start(Behaviour { delay: Duration::from_millis(150), ..replace("clean") }).await;
    let same = HookServer::start(replace("clean")).await;
    let different = HookServer::start(replace("cleaner")).await;
    let failing = HookServer::start(Behaviour { fail: Some(Code::Internal), ..Default::default() }).await;
    let slow = HookServer::start(Behaviour { delay: Duration::from_millis(1500), ..replace("clean") }).await;
    let shadow = |name: &str, url: &str| cfg::hook(name, url, &["tool_result"], 3000) + "shadow_of = \"redact\"\n";
    let config = cfg::agent("x", "")
        + &cfg::turn("go", &["t"])
        + &cfg::turn("model saw {{last_tool_result}}", &[])
        + &cfg::tools(&tools.url, 2000)
        + &shadow("v2", &same.url)
        + &cfg::hook("redact", &redact.url, &["tool_result"], 1000)
        + &shadow("v3", &different.url)
        + &shadow("broken", &failing.url)
        + &shadow("slow", &slow.url);
    let lattice = Lattice::start(&config).await;
    let started = Instant::now();
    let out = lattice.query("x", "go").await;
    assert_eq!(out.expect_ok().text, "model saw clean", "only redact's output is applied");
    assert!(started.elapsed() < Duration::from_millis(1200), "waited for the slow shadow: {:?}", started.elapsed());
    for (hook, server) in [("v2", &same), ("v3", &different), ("broken", &failing)] {
        let seen = server.state.tool_results();
        assert_eq!(seen.len(), 1, "{hook} was called once");
        assert_eq!(result_text(seen[0].result.as_ref().unwrap()), secret, "{hook} got what redact got");
    }
    // The slow one still answers, after the query.
    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert_eq!(slow.state.tool_results().len(), 1);
    let metrics = lattice.metrics().await;
    for line in [
        "lattice_shadow_hook_calls_total{agent=\"x\",hook=\"v2\",outcome=\"ok\",agreement=\"same\"} 1",
        "lattice_shadow_hook_calls_total{agent=\"x\",hook=\"v3\",outcome=\"ok\",agreement=\"different\"} 1",
        "lattice_shadow_hook_calls_total{agent=\"x\",hook=\"broken\",outcome=\"status\",agreement=\"none\"} 1",
        "lattice_shadow_hook_calls_total{agent=\"x\",hook=\"slow\",outcome=\"ok\",agreement=\"same\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
    // The audit record, in the trace: the shadows that had answered, by
    // digest; the value itself nowhere.
    let traces = lattice.traces();
    let audit = traces.lines().find(|l| l.contains("\"type\":\"audit\"")).expect("an audit line");
    assert!(audit.contains("\"shadow_of\":\"redact\"") && audit.contains("\"agreement\":\"different\""), "{audit}");
    assert_no_leak(&secret, &lattice, &out);

    // A shadow never holds the replica out of rotation.
    drop(failing);
    let info = lattice
        .client()
        .await
        .get_agent(lattice_proto::agent::v1::GetAgentRequest { name: "x".into() })
        .await
        .unwrap()
        .into_inner();
    let v3 = info.hooks.iter().find(|h| h.name == "v3").unwrap();
    assert_eq!((v3.shadow_of.as_str(), v3.required), ("redact", false));
}
