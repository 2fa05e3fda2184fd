//! The core agent service over real gRPC: the loop, tools, sessions,
//! delegation, cancellation and bad input.

use std::time::Duration;

use lattice_proto::agent::v1::{self as pb, ToolCallOutcome};
use lattice_tests::{
    Lattice, QueryOpts,
    bad_hook::{MalformedStatus, StatusIn},
    cfg, message_text,
    tool::{ToolDef, ToolServer},
};
use tokio_stream::StreamExt;
use tonic::Code;

/// One tool call: the model asks, the tool answers, and the result reaches
/// the model (echoed back) and the client, in that order.
#[tokio::test(flavor = "multi_thread")]
async fn a_tool_result_reaches_the_model() {
    let tools = ToolServer::start(vec![ToolDef::new("lookup", "found {input}")]).await;
    let config = cfg::agent("a", "")
        + &cfg::turn("looking", &["lookup:{ q = \"ada\" }"])
        + &cfg::turn("model saw: {{last_tool_result}}", &[])
        + &cfg::tools(&tools.url, 2000);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("a", "find ada").await;
    let result = out.expect_ok();
    assert_eq!(result.text, r#"model saw: found {"q":"ada"}"#);
    assert_eq!(result.turns, 2);
    assert_eq!(result.stop_reason, pb::StopReason::EndTurn as i32);
    assert!(result.usage.unwrap().input_tokens > 0);
    assert_eq!(out.tool_texts(), vec![r#"found {"q":"ada"}"#]);
    assert_eq!(out.tool_results()[0].outcome, ToolCallOutcome::Executed as i32);
    assert_eq!(tools.state.called(), vec!["lookup"]);
}

/// Several tool calls in one reply each get exactly one result, in
/// tool_use order, and the model sees them all.
#[tokio::test(flavor = "multi_thread")]
async fn several_tool_calls_get_one_result_each_in_order() {
    let tools =
        ToolServer::start(vec![ToolDef::new("one", "r1"), ToolDef::new("two", "r2"), ToolDef::new("three", "r3")])
            .await;
    let config = cfg::agent("a", "parallel_tool_calls = 3")
        + &cfg::turn("go", &["one", "two", "three"])
        + &cfg::turn("{{request}}", &[])
        + &cfg::tools(&tools.url, 2000);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("a", "go").await;
    let text = out.expect_ok().text.clone();
    assert_eq!(out.tool_texts(), vec!["r1", "r2", "r3"]);
    let ids: Vec<String> = out.tool_results().iter().map(|t| t.result.as_ref().unwrap().tool_use_id.clone()).collect();
    // Distinct ids, whatever their order (dedup alone only drops neighbours).
    let unique: std::collections::HashSet<&String> = ids.iter().collect();
    assert_eq!(unique.len(), 3, "{ids:?}");
    assert!(text.contains("r1\nr2\nr3"), "{text}");
}

/// parallel_tool_calls = 3 runs three slow calls at once; the default runs
/// them one after the other.
#[tokio::test(flavor = "multi_thread")]
async fn parallel_and_sequential_tool_calls() {
    for (keys, expected_overlap) in [("parallel_tool_calls = 3", 3), ("", 1)] {
        let slow = Duration::from_millis(300);
        let tools = ToolServer::start(vec![ToolDef::new("slow", "ok").delay(slow)]).await;
        let config =
            cfg::agent("a", keys) + &cfg::turn("go", &["slow", "slow", "slow"]) + &cfg::tools(&tools.url, 5000);
        let lattice = Lattice::start(&config).await;
        let out = lattice.query("a", "go").await;
        out.expect_ok();
        assert_eq!(tools.state.max_active.load(std::sync::atomic::Ordering::SeqCst), expected_overlap, "{keys:?}");
        if expected_overlap == 1 {
            assert!(out.elapsed >= slow * 3, "sequential took {:?}", out.elapsed);
        } else {
            assert!(out.elapsed < slow * 3, "parallel took {:?}", out.elapsed);
        }
    }
}

/// A denied tool is blocked with an error result saying why; the tool
/// service never sees the call and the loop goes on.
#[tokio::test(flavor = "multi_thread")]
async fn a_denied_tool_is_blocked_and_never_called() {
    let tools = ToolServer::start(vec![ToolDef::new("drop_tables", "dropped"), ToolDef::new("read", "data")]).await;
    let config = cfg::agent("a", "deny = [\"drop_tables\"]")
        + &cfg::turn("go", &["drop_tables", "read"])
        + &cfg::turn("{{last_tool_result}}", &[])
        + &cfg::tools(&tools.url, 2000);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("a", "go").await;
    out.expect_ok();
    let results = out.tool_results();
    assert_eq!(results[0].outcome, ToolCallOutcome::Blocked as i32);
    assert!(results[0].result.as_ref().unwrap().is_error);
    assert!(out.tool_texts()[0].contains("not permitted"), "{:?}", out.tool_texts());
    assert_eq!(out.tool_texts()[1], "data");
    assert_eq!(tools.state.called(), vec!["read"]);
}

/// More calls than max_tool_calls_per_turn: the excess is blocked.
#[tokio::test(flavor = "multi_thread")]
async fn calls_over_the_batch_limit_are_blocked() {
    let tools = ToolServer::start(vec![ToolDef::new("t", "ok")]).await;
    let config = cfg::agent("a", "max_tool_calls_per_turn = 2")
        + &cfg::turn("go", &["t", "t", "t"])
        + &cfg::tools(&tools.url, 2000);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("a", "go").await;
    out.expect_ok();
    let outcomes: Vec<i32> = out.tool_results().iter().map(|t| t.outcome).collect();
    let (e, b) = (ToolCallOutcome::Executed as i32, ToolCallOutcome::Blocked as i32);
    assert_eq!(outcomes, vec![e, e, b]);
    assert_eq!(tools.state.called().len(), 2);
}

/// The model asking for a tool the agent doesn't have gets an error result,
/// and the loop goes on to the next turn.
#[tokio::test(flavor = "multi_thread")]
async fn an_unknown_tool_gets_an_error_result() {
    let config =
        cfg::agent("a", "") + &cfg::turn("go", &["no_such_tool"]) + &cfg::turn("after: {{last_tool_result}}", &[]);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("a", "go").await;
    let text = out.expect_ok().text.clone();
    assert!(text.starts_with("after: unknown tool"), "{text}");
    assert_eq!(out.tool_results()[0].outcome, ToolCallOutcome::Blocked as i32);
}

/// A tool service that is down gives an error result, and the model goes
/// on (it sees the error).
#[tokio::test(flavor = "multi_thread")]
async fn a_tool_service_down_gives_an_error_result() {
    let url = lattice_tests::dead_url().await;
    let config = cfg::agent("a", "")
        + &cfg::turn("go", &["lookup"])
        + &cfg::turn("after: {{last_tool_result}}", &[])
        + &cfg::declared_tools(&url, 2000, &["lookup"]);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("a", "go").await;
    let text = out.expect_ok().text.clone();
    assert!(text.contains("Unavailable"), "{text}");
    assert_eq!(out.tool_results()[0].outcome, ToolCallOutcome::Failed as i32);
    assert!(out.tool_results()[0].result.as_ref().unwrap().is_error);
}

/// A tool service whose status carries a `grpc-status-details-bin` that is
/// not base64 (in its trailers, or a trailers-only reply) gives an error
/// result, and the loop goes on; so does its discovery with ListTools,
/// which fails until its timeout. (Reading such a status used to panic
/// the query's task.)
#[tokio::test(flavor = "multi_thread")]
async fn a_tool_reply_with_a_malformed_status_gives_an_error_result() {
    for status_in in [StatusIn::Trailers, StatusIn::Headers] {
        let tool = MalformedStatus::start(status_in).await;
        let config = cfg::agent("a", "")
            + &cfg::turn("go", &["lookup"])
            + &cfg::turn("after: {{last_tool_result}}", &[])
            + &cfg::declared_tools(&tool.url, 2000, &["lookup"]);
        let lattice = Lattice::start(&config).await;
        for _ in 0..2 {
            let out = lattice.query("a", "go").await;
            let text = out.expect_ok().text.clone();
            assert!(text.contains("Internal") && text.contains("malformed"), "{status_in:?}: {text}");
            assert!(!text.contains(MalformedStatus::DETAILS), "{text}");
            assert_eq!(out.tool_results()[0].outcome, ToolCallOutcome::Failed as i32);
            assert!(out.tool_results()[0].result.as_ref().unwrap().is_error);
        }
    }
}

/// A tool request over `server.tool_max_message_bytes` is not sent: the
/// model gets an error result saying so, the tool service sees no call,
/// and a smaller request to the same tool goes through.
#[tokio::test(flavor = "multi_thread")]
async fn a_tool_request_over_the_limit_is_not_sent() {
    let tools = ToolServer::start(vec![ToolDef::new("t", "done")]).await;
    let big = format!("t:{{ q = {:?} }}", "x".repeat(600));
    let config = "[server]\ntool_max_message_bytes = 512\n".to_owned()
        + &cfg::agent("a", "")
        + &cfg::turn("go", &[big.as_str()])
        + &cfg::turn("{{last_tool_result}}", &["t:{ q = \"small\" }"])
        + &cfg::turn("after: {{last_tool_result}}", &[])
        + &cfg::tools(&tools.url, 2000);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("a", "go").await;
    let results = out.tool_results();
    let first = lattice_tests::result_text(results[0].result.as_ref().unwrap());
    assert!(first.contains("was not called") && first.contains("over the limit of 512"), "{first}");
    assert_eq!(results[0].outcome, ToolCallOutcome::Failed as i32);
    assert_eq!(out.expect_ok().text, "after: done");
    assert_eq!(tools.state.called(), ["t"], "only the small request reached the tool");
}

/// A tool slower than its deadline fails at the deadline with an error
/// result; the tool service sees the call cancelled.
#[tokio::test(flavor = "multi_thread")]
async fn a_tool_past_its_deadline_fails_in_time() {
    let tools = ToolServer::start(vec![ToolDef::new("slow", "late").delay(Duration::from_secs(5))]).await;
    let config = cfg::agent("a", "")
        + &cfg::turn("go", &["slow"])
        + &cfg::turn("{{last_tool_result}}", &[])
        + &cfg::tools(&tools.url, 200);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("a", "go").await;
    let text = out.expect_ok().text.clone();
    assert!(text.contains("did not answer within"), "{text}");
    let took = out.tool_results()[0].duration_ms;
    assert!((200..400).contains(&took), "took {took} ms");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(tools.state.cancelled.lock().unwrap().len(), 1);
}

/// A model that keeps asking for tools stops at max_turns with
/// STOP_REASON_MAX_TURNS, and the stored conversation stays valid.
#[tokio::test(flavor = "multi_thread")]
async fn max_turns_stops_the_loop() {
    let tools = ToolServer::start(vec![ToolDef::new("t", "ok")]).await;
    let config = cfg::agent("a", "max_turns = 2")
        + &cfg::turn("1", &["t"])
        + &cfg::turn("2", &["t"])
        + &cfg::turn("3", &["t"])
        + &cfg::tools(&tools.url, 2000);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("a", "go").await;
    let r = out.expect_ok();
    assert_eq!(r.stop_reason, pb::StopReason::MaxTurns as i32);
    assert_eq!(r.turns, 2);
    assert_eq!(out.assistant_texts(), vec!["1", "2"]);
    // The conversation can be continued: the stored conversation is only
    // appended to (the prompt follows the trailing tool results as its own
    // message), and the model request merges the two, so its roles still
    // alternate.
    let sid = out.session_id();
    let next = lattice
        .query_with(QueryOpts {
            agent: "a".into(),
            prompt: "again".into(),
            session: Some(sid.clone()),
            ..Default::default()
        })
        .await;
    next.expect_ok();
    let sent = next.model_requests()[0];
    let roles: Vec<i32> = sent.messages.iter().map(|m| m.role).collect();
    assert!(roles.windows(2).all(|w| w[0] != w[1]), "{roles:?}");
    // Five messages from the first query, then the prompt on its own.
    let stored = lattice.session(&sid).await.unwrap();
    assert_eq!(sent.messages.len(), 5, "the prompt joined the tool results in the request");
    assert_eq!((stored.messages[4].role, stored.messages[5].role), (pb::Role::User as i32, pb::Role::User as i32));
    assert_eq!(lattice_tests::message_text(&stored.messages[5]), "again");
}

/// Cancelling the client stream mid-tool cancels the tool call: the tool
/// service observes the RPC dropped within 50 ms.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_cancel_cancels_the_tool_call() {
    let tools = ToolServer::start(vec![ToolDef::new("slow", "late").delay(Duration::from_secs(10))]).await;
    let config = cfg::agent("a", "") + &cfg::turn("go", &["slow"]) + &cfg::tools(&tools.url, 20_000);
    let lattice = Lattice::start(&config).await;
    let mut client = lattice.client().await;
    let mut stream = client
        .query(pb::QueryRequest { agent: "a".into(), prompt: "go".into(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    // Wait until the tool is running.
    while tools.state.calls.lock().unwrap().is_empty() {
        let _ = tokio::time::timeout(Duration::from_millis(10), stream.next()).await;
    }
    let dropped = std::time::Instant::now();
    drop(stream);
    drop(client);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let cancelled = tools.state.cancelled.lock().unwrap().clone();
    assert_eq!(cancelled.len(), 1, "the tool call was not cancelled");
    let after = cancelled[0].1.duration_since(dropped);
    assert!(after < Duration::from_millis(50), "cancelled {after:?} after the client went away");
}

/// A second query on a busy session is refused with FAILED_PRECONDITION;
/// the first completes undisturbed.
#[tokio::test(flavor = "multi_thread")]
async fn one_query_at_a_time_per_session() {
    let tools = ToolServer::start(vec![ToolDef::new("slow", "ok").delay(Duration::from_millis(500))]).await;
    let config =
        cfg::agent("b", "") + &cfg::turn("go", &["slow"]) + &cfg::turn("done", &[]) + &cfg::tools(&tools.url, 5000);
    let lattice2 = std::sync::Arc::new(Lattice::start(&config).await);
    let first = lattice2.query("b", "one").await;
    let sid = first.session_id();
    let l = lattice2.clone();
    let s = sid.clone();
    let slow = tokio::spawn(async move {
        l.query_with(QueryOpts { agent: "b".into(), prompt: "two".into(), session: Some(s), ..Default::default() })
            .await
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let second = lattice2
        .query_with(QueryOpts {
            agent: "b".into(),
            prompt: "three".into(),
            session: Some(sid.clone()),
            ..Default::default()
        })
        .await;
    assert_eq!(second.code(), Code::FailedPrecondition, "{:?}", second.status);
    let slow = slow.await.unwrap();
    assert_eq!(slow.expect_ok().text, "done");
    // And once it is done, the session takes queries again.
    let again = lattice2
        .query_with(QueryOpts { agent: "b".into(), prompt: "four".into(), session: Some(sid), ..Default::default() })
        .await;
    again.expect_ok();
}

/// A query that fails leaves the stored conversation exactly as it was.
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_query_leaves_the_history_unchanged() {
    let tools = ToolServer::start(vec![ToolDef::new("slow", "ok").delay(Duration::from_secs(3))]).await;
    let config =
        cfg::agent("a", "") + &cfg::turn("go", &["slow"]) + &cfg::turn("done", &[]) + &cfg::tools(&tools.url, 10_000);
    let lattice = Lattice::start(&config).await;
    // A first query that fails (deadline) leaves no session behind.
    let failed_new = lattice
        .query_with(QueryOpts {
            agent: "a".into(),
            prompt: "x".into(),
            timeout: Some(Duration::from_millis(300)),
            ..Default::default()
        })
        .await;
    assert_eq!(failed_new.code(), Code::DeadlineExceeded);
    assert_eq!(lattice.session(&failed_new.session_id()).await.unwrap_err().code(), Code::NotFound);
    // A successful query, then a failing one on the same session.
    let tools_fast = ToolServer::start(vec![ToolDef::new("slow", "ok")]).await;
    let config = cfg::agent("b", "")
        + &cfg::turn("go", &["slow"])
        + &cfg::turn("done", &[])
        + &cfg::tools(&tools_fast.url, 10_000);
    let lattice = Lattice::start(&config).await;
    let ok = lattice.query("b", "first").await;
    ok.expect_ok();
    let sid = ok.session_id();
    let before = lattice.session(&sid).await.unwrap();
    assert_eq!(before.messages.len(), 4);
    tools_fast.state.tools.lock().unwrap()[0].delay = Duration::from_secs(3);
    let failed = lattice
        .query_with(QueryOpts {
            agent: "b".into(),
            prompt: "second".into(),
            session: Some(sid.clone()),
            timeout: Some(Duration::from_millis(300)),
            ..Default::default()
        })
        .await;
    assert_eq!(failed.code(), Code::DeadlineExceeded);
    assert!(failed.elapsed < Duration::from_millis(600), "{:?}", failed.elapsed);
    assert_eq!(lattice.session(&sid).await.unwrap(), before);
}

/// Delegation: the delegated agent runs on its own fresh session and its
/// final text is the parent's tool result; the depth is bounded.
#[tokio::test(flavor = "multi_thread")]
async fn a_delegated_agent_answers_as_a_tool() {
    let config = cfg::agent("parent", "")
        + &cfg::turn("asking", &["child:{ prompt = \"what is 6x7?\" }"])
        + &cfg::turn("child said: {{last_tool_result}}", &[])
        + &cfg::delegate("child")
        + &cfg::agent("child", "system_prompt = \"child system\"")
        + &cfg::turn("42 (I saw {{message_count}} message: {{last_user_text}})", &[]);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("parent", "go").await;
    assert_eq!(out.expect_ok().text, "child said: 42 (I saw 1 message: what is 6x7?)");
    // The parent's session holds the parent's conversation only.
    let stored = lattice.session(&out.session_id()).await.unwrap();
    assert_eq!(stored.agent, "parent");
    assert_eq!(stored.messages.len(), 4);
}

/// Delegation deeper than server.max_delegation_depth is blocked.
#[tokio::test(flavor = "multi_thread")]
async fn delegation_depth_is_bounded() {
    let config = "[server]\nmax_delegation_depth = 1\n".to_owned()
        + &cfg::agent("a", "")
        + &cfg::turn("to b", &["b:{ prompt = \"go\" }"])
        + &cfg::turn("a got: {{last_tool_result}}", &[])
        + &cfg::delegate("b")
        + &cfg::agent("b", "")
        + &cfg::turn("to c", &["c:{ prompt = \"go\" }"])
        + &cfg::turn("b got: {{last_tool_result}}", &[])
        + &cfg::delegate("c")
        + &cfg::agent("c", "")
        + &cfg::turn("c answers", &[]);
    let lattice = Lattice::start(&config).await;
    let text = lattice.query("a", "go").await.expect_ok().text.clone();
    assert!(text.starts_with("a got: b got: agent \"c\" was not called: delegation depth limit"), "{text}");
}

/// A delegation cycle is refused at start-up.
#[tokio::test(flavor = "multi_thread")]
async fn a_delegation_cycle_is_refused_at_start_up() {
    let config = cfg::agent("a", "") + &cfg::delegate("b") + &cfg::agent("b", "") + &cfg::delegate("a");
    let err = Lattice::try_start(&config).await.err().expect("a cycle must be refused");
    assert!(err.contains("delegation cycle: a -> b -> a"), "{err}");
}

/// Bad input gets a clear error and nothing else happens.
#[tokio::test(flavor = "multi_thread")]
async fn bad_input_is_refused_clearly() {
    let config = "[server]\nmax_message_bytes = 65536\n".to_owned() + &cfg::agent("a", "") + &cfg::turn("hi", &[]);
    let lattice = Lattice::start(&config).await;
    let q = |agent: &str, prompt: String, session: Option<&str>| QueryOpts {
        agent: agent.into(),
        prompt,
        session: session.map(str::to_owned),
        ..Default::default()
    };
    let unknown_agent = lattice.query("nobody", "hi").await;
    assert_eq!(unknown_agent.code(), Code::NotFound);
    assert!(unknown_agent.status.unwrap().message().contains("nobody"));
    assert_eq!(lattice.query_with(q("a", "hi".into(), Some("0000-no-such-session"))).await.code(), Code::NotFound);
    assert_eq!(lattice.query_with(q("a", "hi".into(), Some("../../etc/passwd"))).await.code(), Code::NotFound);
    assert_eq!(lattice.query_with(q("a", "   ".into(), None)).await.code(), Code::InvalidArgument);
    let huge = lattice.query_with(q("a", "x".repeat(100_000), None)).await;
    assert!(matches!(huge.code(), Code::OutOfRange | Code::ResourceExhausted), "{:?}", huge.status);
    // Nothing was stored by any of them; the service still works.
    lattice.query("a", "hi").await.expect_ok();
    let mut client = lattice.client().await;
    let missing = client.get_agent(pb::GetAgentRequest { name: "nobody".into() }).await.unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    let missing = client.delete_session(pb::DeleteSessionRequest { session_id: "nope".into() }).await.unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
}

/// A client watching health does not hold up shutdown: as draining starts
/// its watch stream says NOT_SERVING and ends, and the server stops at once
/// (it used to wait until the watching client went away).
#[tokio::test(flavor = "multi_thread")]
async fn an_open_health_watch_does_not_delay_shutdown() {
    use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};
    let lattice = Lattice::start(&(cfg::agent("a", "") + &cfg::turn("hi", &[]))).await;
    let channel = tonic::transport::Endpoint::from_shared(lattice.url.clone()).unwrap().connect().await.unwrap();
    let mut watch =
        HealthClient::new(channel).watch(HealthCheckRequest { service: String::new() }).await.unwrap().into_inner();
    assert_eq!(watch.message().await.unwrap().unwrap().status, ServingStatus::Serving as i32);
    let started = std::time::Instant::now();
    lattice.stop().await; // waits at most 5 s for the server to stop
    assert!(started.elapsed() < Duration::from_secs(2), "shutdown took {:?}", started.elapsed());
    let mut last = None;
    while let Ok(Some(m)) = watch.message().await {
        last = Some(m.status);
    }
    assert_eq!(last, Some(ServingStatus::NotServing as i32));
}

/// A reply larger than one message to the client may be fails the query
/// with RESOURCE_EXHAUSTED naming the event, and nothing is stored: a new
/// session is not created, a continued one keeps its history, and both stay
/// readable. (It used to be committed, then GetSession failed for good.)
#[tokio::test(flavor = "multi_thread")]
async fn a_reply_too_large_for_the_client_is_not_committed() {
    let config = "[server]\nmax_message_bytes = 1048576\n".to_owned()
        + &cfg::agent("echo", "")
        + &cfg::turn("{{last_user_text}}{{last_user_text}}", &[]);
    let lattice = Lattice::start(&config).await;
    let big = |session: Option<String>| QueryOpts {
        agent: "echo".into(),
        prompt: "x".repeat(768 * 1024),
        session,
        no_model_requests: true,
        ..Default::default()
    };
    let out = lattice.query_with(big(None)).await;
    assert_eq!(out.code(), Code::ResourceExhausted, "{:?}", out.status);
    assert!(out.status.as_ref().unwrap().message().contains("assistant event"), "{:?}", out.status);
    assert!(out.final_result().is_none());
    assert_eq!(lattice.session(&out.session_id()).await.unwrap_err().code(), Code::NotFound);

    let small = lattice.query("echo", "hi").await;
    assert_eq!(small.expect_ok().text, "hihi");
    let sid = small.session_id();
    let out = lattice.query_with(big(Some(sid.clone()))).await;
    assert_eq!(out.code(), Code::ResourceExhausted, "{:?}", out.status);
    let stored = lattice.session(&sid).await.unwrap();
    assert_eq!(stored.messages.len(), 2, "the failed query left the history as it was");
    let next = QueryOpts { agent: "echo".into(), prompt: "yo".into(), session: Some(sid), ..Default::default() };
    assert_eq!(lattice.query_with(next).await.expect_ok().text, "yoyo");
}

/// A conversation larger than one reply may be is read in pages: each
/// within the message limit, together the whole history in order.
#[tokio::test(flavor = "multi_thread")]
async fn a_long_session_is_read_in_pages() {
    let config = "[server]\nmax_message_bytes = 65536\n".to_owned() + &cfg::agent("a", "") + &cfg::turn("ok", &[]);
    let lattice = Lattice::start(&config).await;
    let mut session = None;
    for i in 0..5 {
        let opts = QueryOpts {
            agent: "a".into(),
            prompt: format!("{i}:{}", "p".repeat(20 * 1024)),
            session: session.clone(),
            no_model_requests: true,
            ..Default::default()
        };
        session = Some(lattice.query_with(opts).await.session_id());
    }
    let sid = session.unwrap();
    let first = lattice.session_page(&sid, 0, "").await.unwrap();
    assert_eq!(first.total_messages, 10);
    assert!(first.messages.len() < 10 && !first.next_page_token.is_empty(), "{}", first.messages.len());
    assert!(prost::Message::encoded_len(&first) <= 65536);
    let whole = lattice.session(&sid).await.unwrap();
    let prompts: Vec<String> = whole.messages.iter().step_by(2).map(|m| message_text(m)[..2].to_owned()).collect();
    assert_eq!(prompts, vec!["0:", "1:", "2:", "3:", "4:"]);
    assert!(whole.messages.iter().skip(1).step_by(2).all(|m| message_text(m) == "ok"));
    let three = lattice.session_page(&sid, 3, "").await.unwrap();
    assert_eq!((three.messages.len(), three.next_page_token.as_str()), (3, "3"));
    assert_eq!(lattice.session_page(&sid, 0, "x").await.unwrap_err().code(), Code::InvalidArgument);
    assert_eq!(lattice.session_page(&sid, 0, "11").await.unwrap_err().code(), Code::InvalidArgument);
}

/// A tool service that is not up when Lattice starts no longer stops it:
/// Lattice starts NOT_SERVING, the agent answers UNAVAILABLE ("not ready"),
/// and once the service is up its tools are discovered and queries run,
/// without a restart.
#[tokio::test(flavor = "multi_thread")]
async fn a_tool_service_that_starts_later_is_discovered_later() {
    let port = lattice_tests::reserve();
    let addr = port.addr;
    let config = "[server]\ntool_discovery_timeout_ms = 300\n".to_owned()
        + &cfg::agent("a", "")
        + &cfg::turn("go", &["t"])
        + &cfg::turn("got {{last_tool_result}}", &[])
        + &cfg::tools(&format!("http://{addr}"), 2000);
    let lattice = Lattice::start_unready(&config).await;
    assert!(!lattice.serving().await, "NOT_SERVING until the agent's tools are known");
    let ready = || async {
        let request = pb::GetAgentRequest { name: "a".into() };
        lattice.client().await.get_agent(request).await.unwrap().into_inner().ready
    };
    assert!(!ready().await, "GetAgent says the agent is not ready");
    let early = lattice.query("a", "go").await;
    assert_eq!(early.code(), Code::Unavailable, "{:?}", early.status);
    assert!(early.status.unwrap().message().contains("not ready"));

    let _tools = ToolServer::start_on(port.listen(), vec![ToolDef::new("t", "late data")]).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !lattice.serving().await {
        assert!(std::time::Instant::now() < deadline, "the late tool service was never discovered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(lattice.query("a", "go").await.expect_ok().text, "got late data");
    assert!(ready().await);
}

/// With `server.drain_ms`, a stopping server says NOT_SERVING at once but
/// still serves the queries that arrive during the drain (clients that were
/// still routed to it), then stops.
#[tokio::test(flavor = "multi_thread")]
async fn a_stopping_server_serves_through_its_drain() {
    let config = "[server]\ndrain_ms = 800\n".to_owned() + &cfg::agent("a", "") + &cfg::turn("hi", &[]);
    let lattice = Lattice::start(&config).await;
    let client = Lattice::remote(&lattice.url).await;
    let url = lattice.url.clone();
    let started = std::time::Instant::now();
    let stopping = tokio::spawn(lattice.stop());
    tokio::time::sleep(Duration::from_millis(100)).await;
    let watcher = Lattice::remote_unchecked(&url);
    assert!(!watcher.serving().await, "NOT_SERVING as soon as the drain starts");
    assert_eq!(client.query("a", "during the drain").await.expect_ok().text, "hi");
    stopping.await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(800), "stopped after {:?}", started.elapsed());
}

/// Passes bytes through as they are: a client that sends whatever it likes.
#[derive(Default)]
struct RawCodec;

struct Raw;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = Raw;
    type Decoder = Raw;
    fn encoder(&mut self) -> Raw {
        Raw
    }
    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl tonic::codec::Encoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(&mut self, item: Vec<u8>, buf: &mut tonic::codec::EncodeBuf<'_>) -> Result<(), tonic::Status> {
        bytes::BufMut::put_slice(buf, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(&mut self, buf: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<Vec<u8>>, tonic::Status> {
        let n = bytes::Buf::remaining(buf);
        Ok(Some(bytes::Buf::copy_to_bytes(buf, n).to_vec()))
    }
}

/// A request that does not decode is the client's error: INVALID_ARGUMENT
/// naming the type, never INTERNAL, and never repeating the bytes. Random
/// payloads either fail that way or decode into a request that is refused
/// for what it says.
#[tokio::test(flavor = "multi_thread")]
async fn undecodable_requests_are_invalid_arguments() {
    let lattice = Lattice::start(&(cfg::agent("a", "") + &cfg::turn("hi", &[]))).await;
    let channel = tonic::transport::Endpoint::from_shared(lattice.url.clone()).unwrap().connect().await.unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/lattice.agent.v1.AgentService/Query");
    let mut seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut invalid = 0;
    for i in 0..200 {
        // The first payload is a known bad one: field 1 (agent, a string)
        // sent as a varint.
        let payload: Vec<u8> =
            if i == 0 { vec![0x08, 0x96, 0x01] } else { (0..1 + next() % 64).map(|_| next() as u8).collect() };
        grpc.ready().await.unwrap();
        let status = match grpc.server_streaming(tonic::Request::new(payload), path.clone(), RawCodec).await {
            Err(status) => status,
            Ok(response) => {
                let mut stream = response.into_inner();
                loop {
                    match stream.message().await {
                        Ok(Some(_)) => continue,
                        Ok(None) => panic!("payload {i} ran a query to the end"),
                        Err(s) => break s,
                    }
                }
            }
        };
        match status.code() {
            Code::InvalidArgument => {
                assert_eq!(status.message(), "the request does not decode as lattice.agent.v1.QueryRequest");
                invalid += 1;
            }
            Code::NotFound => assert!(i > 0, "the known bad payload decoded"),
            other => panic!("payload {i}: {other:?} {}", status.message()),
        }
    }
    assert!(invalid >= 150, "only {invalid} of 200 random payloads failed to decode");
}

/// Client input repeated in an error is cut short: a 100 kB agent name
/// gets NOT_FOUND with a short message (a long one would be refused by the
/// client as a header too large).
#[tokio::test(flavor = "multi_thread")]
async fn errors_repeat_client_input_briefly() {
    let lattice = Lattice::start(&(cfg::agent("a", "") + &cfg::turn("hi", &[]))).await;
    let name = "a".repeat(100_000);
    let out = lattice.query(&name, "hi").await;
    assert_eq!(out.code(), Code::NotFound, "{:?}", out.status);
    let message = out.status.unwrap().message().to_owned();
    assert!(message.len() < 200 && message.contains("aaaa") && message.contains("100000 bytes"), "{message}");
    let mut client = lattice.client().await;
    let missing = client.get_agent(pb::GetAgentRequest { name }).await.unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    assert!(missing.message().len() < 200);
}

/// An invalid config is refused with every problem listed, each with its
/// line and field.
#[tokio::test(flavor = "multi_thread")]
async fn an_invalid_config_lists_every_problem() {
    let config = r#"
[[agents]]
name = "a"
max_turns = 0
[agents.model]
provider = "gpt-nowhere"
[[agents.hooks]]
name = "h"
endpoint = "not a url"
events = ["tool_result", "sometimes"]
[[agents.hooks]]
name = "noport"
endpoint = "dns:///hook"
events = ["tool_result"]
[[agents.delegates]]
agent = "ghost"
"#;
    let err = Lattice::try_start(config).await.err().expect("refused");
    for expected in [
        "test.toml:4: agents[0].max_turns",
        "test.toml:6: agents[0].model.provider: unknown provider \"gpt-nowhere\"",
        "test.toml:9: agents[0].hooks[0].endpoint",
        "test.toml:10: agents[0].hooks[0].events: unknown event \"sometimes\"",
        "test.toml:13: agents[0].hooks[1].endpoint: \"dns:///hook\": a dns:/// target needs a port",
        "test.toml:16: agents[0].delegates[0].agent: no agent named \"ghost\"",
    ] {
        assert!(err.contains(expected), "missing {expected:?} in:\n{err}");
    }
    let typo = Lattice::try_start("[[agents]]\nname = \"a\"\nmax_turnz = 3\n").await.err().unwrap();
    assert!(typo.contains("test.toml:3") && typo.contains("max_turnz"), "{typo}");

    // An unknown key, a value of the wrong type and rules broken after them:
    // all reported, each at its line and field, none hiding another. (The
    // harness adds a trace_dir line under [server]: lines count from it.)
    let config = r#"
[server]
hook_deadline_ms = 50000
qeury_deadline_ms = 5
[[agents]]
name = "a"
max_turnz = 3
parallel_tool_calls = "two"
[agents.model]
provider = "scripted"
[[agents.hooks]]
name = "h"
endpoint = "http://127.0.0.1:1"
events = ["tool_result", "tool_result"]
deadline_ms = 20000
"#;
    let err = Lattice::try_start(config).await.err().expect("refused");
    for expected in [
        "test.toml:4: server.hook_deadline_ms: 50000 ms is above the ceiling of 10000 ms",
        "test.toml:5: server.qeury_deadline_ms: unknown key \"qeury_deadline_ms\"; did you mean \"query_deadline_ms\"?",
        "test.toml:8: agents[0].max_turnz: unknown key \"max_turnz\"; did you mean \"max_turns\"?",
        "test.toml:9: agents[0].parallel_tool_calls: invalid type: string \"two\"",
        "test.toml:15: agents[0].hooks[0].events: event \"tool_result\" is listed twice",
        "test.toml:16: agents[0].hooks[0].deadline_ms: 20000 ms is above the ceiling of 10000 ms",
    ] {
        assert!(err.contains(expected), "missing {expected:?} in:\n{err}");
    }
}

/// check-config validates a config whose API key variable is not set (CI
/// has no secrets): a warning naming the variable, and exit 0; `serve`
/// refuses the same config.
#[tokio::test(flavor = "multi_thread")]
async fn check_config_warns_about_missing_api_keys() {
    let dir = lattice_tests::temp_dir("check");
    let path = dir.join("lattice.toml");
    let config = "[server.auth]\nmode = \"none\"\n[[agents]]\nname = \"a\"\n[agents.model]\nprovider = \"anthropic\"\nname = \"m\"\napi_key_env = \"LATTICE_TEST_UNSET_KEY\"\n";
    std::fs::write(&path, config).unwrap();
    let check = std::process::Command::new(lattice_tests::workspace_binary("lattice"))
        .args(["check-config", "--config"])
        .arg(&path)
        .env_remove("LATTICE_TEST_UNSET_KEY")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&check.stderr);
    assert!(check.status.success(), "{stderr}");
    assert!(stderr.contains("warning:") && stderr.contains("LATTICE_TEST_UNSET_KEY"), "{stderr}");
    let serve = Lattice::try_start(config).await.err().expect("serve needs the key");
    assert!(serve.contains("LATTICE_TEST_UNSET_KEY"), "{serve}");
}

/// ListAgents and GetAgent describe the agents, their tools and their hooks
/// in order; GetSession and DeleteSession manage the stored conversation.
#[tokio::test(flavor = "multi_thread")]
async fn agents_and_sessions_can_be_inspected() {
    let tools = ToolServer::start(vec![ToolDef::new("lookup", "x")]).await;
    let config = cfg::agent("a", "max_turns = 3")
        + &cfg::turn("hi", &[])
        + &cfg::tools(&tools.url, 1500)
        + &cfg::hook("first", "http://127.0.0.1:1", &["tool_result"], 100)
        + &cfg::disabled_hook("second", "http://127.0.0.1:2", &["model_request"])
        + &cfg::agent("b", "");
    // The first hook is down: agent a is not ready, and Lattice NOT_SERVING.
    let lattice = Lattice::start_unready(&config).await;
    let mut client = lattice.client().await;
    let agents = client.list_agents(pb::ListAgentsRequest {}).await.unwrap().into_inner().agents;
    assert_eq!(agents.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(), vec!["a", "b"]);
    let a = client.get_agent(pb::GetAgentRequest { name: "a".into() }).await.unwrap().into_inner();
    assert_eq!(a.max_turns, 3);
    assert_eq!(a.model, "scripted/default");
    assert_eq!(a.tools[0].spec.as_ref().unwrap().name, "lookup");
    assert_eq!(a.tools[0].deadline_ms, 1500);
    let hooks: Vec<(&str, bool)> = a.hooks.iter().map(|h| (h.name.as_str(), h.enabled)).collect();
    assert_eq!(hooks, vec![("first", true), ("second", false)]);
    assert_eq!(a.hooks[0].deadline_ms, 100);
    assert_eq!((a.hooks[0].ready_addresses, a.hooks[0].required, a.ready), (0, true, false));

    let out = lattice.query("b", "remember me").await;
    out.expect_ok();
    let sid = out.session_id();
    let s = lattice.session(&sid).await.unwrap();
    assert_eq!(lattice_tests::message_text(&s.messages[0]), "remember me");
    let trace_file = lattice.trace_dir.join(format!("{sid}.jsonl"));
    assert!(trace_file.exists());
    client.delete_session(pb::DeleteSessionRequest { session_id: sid.clone() }).await.unwrap();
    assert_eq!(lattice.session(&sid).await.unwrap_err().code(), Code::NotFound);
    assert!(!trace_file.exists(), "DeleteSession removes the session's trace file too");
}

/// `server.worker_threads` sets how many runtime worker threads
/// `lattice serve` runs; with 1, the runtime is a current-thread one (all
/// work on one thread, no work stealing).
#[tokio::test(flavor = "multi_thread")]
async fn worker_threads_sets_the_runtime_size() {
    let agent = cfg::agent("a", "") + &cfg::turn("hi", &[]);
    for (n, flavor) in [(1usize, "current_thread"), (3, "multi_thread")] {
        let lattice = Lattice::spawn(&(format!("[server]\nworker_threads = {n}\n") + &agent), &[]).await;
        assert_eq!(lattice.query("a", "hello").await.expect_ok().text, "hi");
        let logs = lattice.process_logs();
        assert!(logs.contains(&format!("\"worker_threads\":{n}")), "{logs}");
        assert!(logs.contains(&format!("\"runtime\":\"{flavor}\"")), "{logs}");
    }
}

/// `server.busy_poll_us`: `lattice serve` polls while hook and tool calls
/// are in flight, and sleeps when none is: queries through a real hook and
/// tool service are answered as without it, and an idle server spends
/// next to no CPU (a poller that never stopped would spend a whole core).
#[tokio::test(flavor = "multi_thread")]
async fn busy_polling_serves_calls_and_sleeps_when_idle() {
    let (tools, _tools) = lattice_tests::start_example_tools().await;
    let (redact, _redact) = lattice_tests::start_example("redact", &[]).await;
    let config = "[server]\nworker_threads = 1\nbusy_poll_us = 500\n".to_owned()
        + &cfg::agent("support", "")
        + &cfg::turn("looking", &["lookup_customer:{ query = \"c-100\" }"])
        + &cfg::turn("model saw: {{last_tool_result}}", &[])
        + &cfg::tools(&tools, 5000)
        + &cfg::hook("redact", &redact, &["tool_result"], 2000);
    let lattice = Lattice::spawn(&config, &[]).await;
    for _ in 0..20 {
        let text = lattice.query("support", "Find the customers").await.expect_ok().text.clone();
        assert!(text.contains("[REDACTED:email]") && !text.contains("ada.lovelace@example.com"), "{text}");
    }
    let logs = lattice.process_logs();
    assert!(logs.contains("\"busy_poll_us\":500"), "{logs}");

    let pid = lattice.pid().expect("a spawned process");
    // utime + stime, in clock ticks (100 a second).
    let cpu_ticks = || {
        let (user, system) = lattice_tests::bench::ticks(pid);
        user + system
    };
    let turns = || async { lattice_tests::sample(&lattice.metrics().await, "lattice_busy_poll_turns_total") };
    let turned = turns().await.expect("lattice_busy_poll_turns_total");
    assert!(turned > 0.0, "the poller took no turn for 40 calls");
    let before = cpu_ticks();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle = cpu_ticks() - before;
    assert!(idle < 20, "an idle server spent {idle} ticks of 100 in a second");
    assert_eq!(turns().await, Some(turned), "the poller turned with no call in flight");
    assert_eq!(lattice.query("support", "again").await.expect_ok().turns, 2);
}

/// `lattice serve` runs without transparent huge pages: mimalloc asks the
/// kernel for them, and where the kernel compacts memory to find one on a
/// page fault (Debian's default for such requests) a query waits for it,
/// milliseconds at a time. `MIMALLOC_ALLOW_THP=1` leaves them on.
#[tokio::test]
async fn lattice_serve_runs_without_transparent_huge_pages() {
    let config = cfg::agent("a", "") + &cfg::turn("hi", &[]);
    let thp_enabled = |lattice: &Lattice| {
        let pid = lattice.pid().expect("a spawned process");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let line = status.lines().find(|l| l.starts_with("THP_enabled:")).expect("THP_enabled in /proc/PID/status");
        line.split_whitespace().nth(1).unwrap().to_owned()
    };
    let lattice = Lattice::spawn(&config, &[]).await;
    assert_eq!(lattice.query("a", "x").await.expect_ok().turns, 1);
    assert_eq!(thp_enabled(&lattice), "0");
    let opted_in = Lattice::spawn(&config, &[("MIMALLOC_ALLOW_THP", "1")]).await;
    assert_eq!(opted_in.query("a", "x").await.expect_ok().turns, 1);
    assert_eq!(thp_enabled(&opted_in), "1");
}

/// `server.busy_poll_us` is bounded and needs the one-thread runtime;
/// `server.worker_threads` is at least 1.
#[tokio::test]
async fn busy_polling_is_checked() {
    let agent = cfg::agent("a", "") + &cfg::turn("hi", &[]);
    let err =
        Lattice::try_start(&("[server]\nbusy_poll_us = 50000\n".to_owned() + &agent)).await.err().expect("refused");
    for expected in [
        "server.busy_poll_us: 50000 µs is above the limit of 10000 µs",
        "server.busy_poll_us: needs server.worker_threads = 1",
    ] {
        assert!(err.contains(expected), "missing {expected:?} in:\n{err}");
    }
    let err = Lattice::try_start(&("[server]\nworker_threads = 2\nbusy_poll_us = 100\n".to_owned() + &agent))
        .await
        .err()
        .expect("refused");
    assert!(err.contains("server.busy_poll_us: needs server.worker_threads = 1"), "{err}");
    let ok = Lattice::try_start(&("[server]\nworker_threads = 1\nbusy_poll_us = 0\n".to_owned() + &agent)).await;
    assert!(ok.is_ok(), "0 is off: {:?}", ok.err());
    // No worker thread is no runtime, not one thread: refused, whatever
    // else the section holds.
    let err = Lattice::try_start(&("[server]\nworker_threads = 0\nbusy_poll_us = 100\n".to_owned() + &agent))
        .await
        .err()
        .expect("refused");
    assert!(err.contains("server.worker_threads: must be at least 1"), "{err}");
}

/// The "starts later" tests hold their port while nothing serves it: a
/// connection is refused, nothing else can bind it, and serving on it later
/// takes connections.
#[tokio::test]
async fn a_reserved_port_refuses_until_it_listens() {
    let port = lattice_tests::reserve();
    let refused = tokio::net::TcpStream::connect(port.addr).await.unwrap_err();
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
    let taken = tokio::net::TcpListener::bind(port.addr).await.unwrap_err();
    assert_eq!(taken.kind(), std::io::ErrorKind::AddrInUse);
    let addr = port.addr;
    let listener = port.listen();
    let (connected, accepted) = tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
    assert_eq!(connected.unwrap().local_addr().unwrap(), accepted.unwrap().1);
}

/// A connection to a port nobody listens on can connect to itself; waiting
/// for a service's port does not take that for the service.
#[tokio::test]
async fn a_connection_to_itself_is_no_listener() {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = socket.local_addr().unwrap();
    let stream = socket.connect(addr).await.expect("a simultaneous open with itself");
    assert_eq!(stream.peer_addr().unwrap(), addr);
    assert!(!lattice_tests::reached_a_listener(&stream));
    let (listener, addr) = lattice_tests::bind().await;
    let (stream, _) = tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
    assert!(lattice_tests::reached_a_listener(&stream.unwrap()));
}
