//! Hook and tool services that go away on purpose: a call the service never
//! received is retried (and one it may have received is not), and a
//! required hook with no ready address takes Lattice out of rotation.

use std::time::{Duration, Instant};

use lattice_proto::agent::v1 as pb;
use lattice_tests::{
    Lattice, assert_no_leak, canary, cfg,
    hook::{Behaviour, HookServer, OnResult},
    raw_peer::{Gate, Next},
    tool::{ToolDef, ToolServer},
};
use tonic::Code;

/// `server.peer_health_check_ms`'s default.
const HEALTH_EVERY: Duration = Duration::from_secs(1);

/// No health checks: the gate's next request is the one a query makes.
const NO_HEALTH_CHECKS: &str = "[server]\npeer_health_check_ms = 0\n";

fn redact() -> Behaviour {
    Behaviour { on_result: OnResult::ReplaceText("clean".into()), ..Default::default() }
}

fn agent(tool_url: &str, hook: &str) -> String {
    cfg::agent("x", "")
        + &cfg::turn("go", &["t"])
        + &cfg::turn("model saw {{last_tool_result}}", &[])
        + &cfg::tools(tool_url, 2000)
        + hook
}

/// The port of an `http://127.0.0.1:PORT` URL.
fn addr(url: &str) -> std::net::SocketAddr {
    url.trim_start_matches("http://").parse().unwrap()
}

/// Lattice with a gate in front of the redaction hook.
async fn behind_gate(secret: &str) -> (Lattice, ToolServer, HookServer, Gate) {
    let tools = ToolServer::start(vec![ToolDef::new("t", secret)]).await;
    let hook = HookServer::start(redact()).await;
    let gate = Gate::start(addr(&hook.url)).await;
    let hooks = cfg::hook("redact", &gate.url, &["tool_result"], 2000);
    let lattice = Lattice::start(&(NO_HEALTH_CHECKS.to_owned() + &agent(&tools.url, &hooks))).await;
    (lattice, tools, hook, gate)
}

/// A stream the hook refused before reading it (GOAWAY above its
/// last-stream-id, or REFUSED_STREAM) is sent again, and the query goes on;
/// the hook received the call once.
#[tokio::test(flavor = "multi_thread")]
async fn a_call_the_hook_never_received_is_retried() {
    for refusal in [Next::GoAwayUnprocessed, Next::RefuseStream] {
        let secret = canary();
        let (lattice, tools, hook, gate) = behind_gate(&secret).await;
        gate.arm(refusal);
        let out = lattice.query("x", "go").await;
        assert!(gate.spent(), "{refusal:?}: the call's connection went through the gate");
        assert_no_leak(&secret, &lattice, &out);
        assert_eq!(out.expect_ok().text, "model saw clean", "{refusal:?}");
        assert_eq!(hook.state.tool_results().len(), 1, "{refusal:?}: the hook got the call once");
        assert_eq!(tools.state.calls.lock().unwrap().len(), 1);
    }
}

/// A connection reset after the hook read the request is not retried: the
/// hook may have acted on it. The query aborts, failing closed.
#[tokio::test(flavor = "multi_thread")]
async fn a_call_the_hook_may_have_received_is_not_retried() {
    let secret = canary();
    let (lattice, _tools, hook, gate) = behind_gate(&secret).await;
    gate.arm(Next::ResetAfterRead);
    let out = lattice.query("x", "go").await;
    assert!(gate.spent());
    assert_eq!(out.code(), Code::Aborted, "{:?}", out.status);
    assert_eq!(out.hook_failure()["kind"], "unavailable");
    assert_eq!(hook.state.tool_results().len(), 0, "not sent again");
    assert_no_leak(&secret, &lattice, &out);
}

/// The same rule for tool calls: a refused stream is sent again and the
/// tool runs once.
#[tokio::test(flavor = "multi_thread")]
async fn a_tool_call_the_service_never_received_is_retried() {
    let tools = ToolServer::start(vec![ToolDef::new("t", "fetched")]).await;
    let gate = Gate::start(addr(&tools.url)).await;
    let lattice = Lattice::start(&(NO_HEALTH_CHECKS.to_owned() + &agent(&gate.url, ""))).await;
    for refusal in [Next::GoAwayUnprocessed, Next::RefuseStream] {
        let before = tools.state.calls.lock().unwrap().len();
        gate.arm(refusal);
        let out = lattice.query("x", "go").await;
        assert!(gate.spent(), "{refusal:?}");
        assert_eq!(out.expect_ok().text, "model saw fetched", "{refusal:?}");
        assert_eq!(tools.state.calls.lock().unwrap().len(), before + 1, "{refusal:?}: the tool ran once");
    }
}

async fn agent_state(lattice: &Lattice) -> pb::Agent {
    let request = pb::GetAgentRequest { name: "x".into() };
    lattice.client().await.get_agent(request).await.unwrap().into_inner()
}

/// Waits up to `within` for `cond`.
async fn eventually<F: std::future::Future<Output = bool>>(within: Duration, mut cond: impl FnMut() -> F) -> bool {
    let until = Instant::now() + within;
    while Instant::now() < until {
        if cond().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// A required hook whose one address stops answering: Lattice turns
/// NOT_SERVING within about a health-check period, GetAgent and the
/// `lattice_hook_ready_addresses` gauge say so, queries fail before any
/// tool call; when the hook is back, so is Lattice. A hook marked
/// `required = false` never takes Lattice out of rotation.
#[tokio::test(flavor = "multi_thread")]
async fn readiness_follows_the_required_hooks() {
    let secret = canary();
    let tools = ToolServer::start(vec![ToolDef::new("t", &secret)]).await;
    let (listener, hook_addr) = lattice_tests::bind().await;
    let mut hook = HookServer::start_on(listener, hook_addr, redact()).await;
    let endpoint = format!("dns:///{hook_addr}");
    let required = agent(&tools.url, &cfg::hook("h", &endpoint, &["tool_result"], 2000));
    let optional = required.clone() + "required = false\n";
    let lattice = Lattice::start(&required).await;
    let relaxed = Lattice::start(&optional).await;
    let gauge = format!("lattice_hook_ready_addresses{{agent=\"x\",hook=\"h\",endpoint=\"{endpoint}\"}}");
    assert!(lattice.metrics().await.contains(&format!("{gauge} 1")), "{}", lattice.metrics().await);
    let hooks = agent_state(&lattice).await.hooks;
    assert_eq!((hooks[0].ready_addresses, hooks[0].required), (1, true));
    assert_eq!(lattice.query("x", "go").await.expect_ok().text, "model saw clean");

    hook.stop();
    assert!(eventually(HEALTH_EVERY * 4, || async { !lattice.serving().await }).await, "NOT_SERVING without the hook");
    assert!(lattice.metrics().await.contains(&format!("{gauge} 0")));
    let state = agent_state(&lattice).await;
    assert_eq!((state.ready, state.hooks[0].ready_addresses), (false, 0));
    let calls = tools.state.calls.lock().unwrap().len();
    let out = lattice.query("x", "go").await;
    assert_eq!(out.hook_failure()["kind"], "unavailable");
    assert!(out.elapsed < Duration::from_millis(500), "failed at once, took {:?}", out.elapsed);
    assert_eq!(tools.state.calls.lock().unwrap().len(), calls, "no tool call while the hook is down");
    assert_no_leak(&secret, &lattice, &out);
    assert!(relaxed.serving().await, "a hook with required = false leaves readiness alone");
    assert!(!agent_state(&relaxed).await.hooks[0].required);

    let _hook = HookServer::start_on(lattice_tests::rebind(hook_addr).await, hook_addr, redact()).await;
    assert!(eventually(HEALTH_EVERY * 4, || async { lattice.serving().await }).await, "SERVING with the hook back");
    assert_eq!(agent_state(&lattice).await.hooks[0].ready_addresses, 1);
    assert_eq!(lattice.query("x", "go").await.expect_ok().text, "model saw clean");
}

/// Start-up order doesn't matter for hooks either: Lattice started before
/// its required hook is NOT_SERVING (the agent not ready) and turns
/// SERVING once the hook answers, without a restart.
#[tokio::test(flavor = "multi_thread")]
async fn a_hook_that_starts_later_is_waited_for() {
    let tools = ToolServer::start(vec![ToolDef::new("t", "data")]).await;
    let port = lattice_tests::reserve();
    let hook_addr = port.addr;
    let lattice = Lattice::start_unready(&agent(
        &tools.url,
        &cfg::hook("h", &format!("http://{hook_addr}"), &["tool_result"], 2000),
    ))
    .await;
    tokio::time::sleep(HEALTH_EVERY).await;
    assert!(!lattice.serving().await, "NOT_SERVING while the required hook is not up");
    assert!(!agent_state(&lattice).await.ready);
    let _hook = HookServer::start_on(port.listen(), hook_addr, redact()).await;
    assert!(eventually(HEALTH_EVERY * 4, || async { lattice.serving().await }).await, "SERVING once the hook is up");
    assert!(agent_state(&lattice).await.ready);
    assert_eq!(lattice.query("x", "go").await.expect_ok().text, "model saw clean");
}

/// A query that arrives before the first health check of its only
/// OnToolResult hook has ended waits for that check: the hook never came
/// up (nothing listens on its address), so the query aborts before its
/// tool runs, and the tool's side effects never happen.
#[tokio::test(flavor = "multi_thread")]
async fn a_tool_result_hook_that_never_came_up_stops_the_query_before_its_tool_runs() {
    let tools = ToolServer::start(vec![ToolDef::new("t", "data")]).await;
    let port = lattice_tests::reserve();
    let hook = cfg::hook("h", &format!("http://{}", port.addr), &["tool_result"], 2000);
    let lattice = Lattice::start_unready(&agent(&tools.url, &hook)).await;
    // At once: the first health check has not ended yet.
    let out = lattice.query("x", "go").await;
    let failure = out.hook_failure();
    assert_eq!((failure["hook"].as_str(), failure["kind"].as_str()), ("h", "unavailable"), "{failure:?}");
    assert!(tools.state.called().is_empty(), "the tool ran: {:?}", tools.state.called());
    drop(port);
}
