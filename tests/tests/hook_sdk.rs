//! Stopping peers without dropping calls: a hook served by the Rust SDK, and
//! `lattice example-tools`, drain on SIGTERM (a rolling update).

use std::time::{Duration, Instant};

use lattice_hook_sdk::{Hook, Status, ToolResultBlock, ToolResultCall};
use lattice_proto::hooks::v1::{OnToolResultRequest, hook_service_client::HookServiceClient};
use lattice_tests::{bind, workspace_binary};
use tokio::sync::oneshot;
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};

/// A hook that takes 400 ms and keeps every result.
struct Slow;

#[lattice_hook_sdk::async_trait]
impl Hook for Slow {
    async fn on_tool_result(&self, _: ToolResultCall) -> Result<Option<ToolResultBlock>, Status> {
        tokio::time::sleep(Duration::from_millis(400)).await;
        Ok(None)
    }
}

async fn status(channel: tonic::transport::Channel) -> i32 {
    let request = HealthCheckRequest { service: String::new() };
    HealthClient::new(channel).check(request).await.unwrap().into_inner().status
}

/// Asked to stop, a hook says NOT_SERVING at once, finishes the call in
/// flight, serves calls that still arrive (on its open connection and on a
/// new one) for the drain period, and only then returns.
#[tokio::test(flavor = "multi_thread")]
async fn a_hook_drains_before_it_stops() {
    let (listener, addr) = bind().await;
    let (stop, stopped) = oneshot::channel::<()>();
    let drain = Duration::from_millis(1200);
    let server = tokio::spawn(lattice_hook_sdk::Server::new(Slow).drain(drain).serve_on(listener, async {
        let _ = stopped.await;
    }));
    let url = format!("http://{addr}");
    let channel = tonic::transport::Endpoint::from_shared(url.clone()).unwrap().connect().await.unwrap();
    assert_eq!(status(channel.clone()).await, ServingStatus::Serving as i32);
    let mut client = HookServiceClient::new(channel.clone());
    let in_flight = {
        let mut client = client.clone();
        tokio::spawn(async move { client.on_tool_result(OnToolResultRequest::default()).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Before the signal: the drain starts when it arrives.
    let signalled = Instant::now();
    stop.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(status(channel.clone()).await, ServingStatus::NotServing as i32);
    assert!(in_flight.await.unwrap().is_ok(), "the call in flight completes");
    assert!(client.on_tool_result(OnToolResultRequest::default()).await.is_ok(), "served during the drain");
    let fresh = tonic::transport::Endpoint::from_shared(url).unwrap().connect().await.unwrap();
    assert!(HookServiceClient::new(fresh).on_tool_result(OnToolResultRequest::default()).await.is_ok());
    let served = tokio::time::timeout(Duration::from_secs(5), server).await.expect("the server stops after the drain");
    assert!(served.unwrap().is_ok());
    assert!(signalled.elapsed() >= drain, "stopped after {:?}", signalled.elapsed());
}

/// An example hook binary exits 0 after SIGTERM and its drain
/// (`LATTICE_HOOK_DRAIN_MS`).
#[tokio::test(flavor = "multi_thread")]
async fn an_example_hook_exits_cleanly_after_sigterm() {
    let (listener, addr) = bind().await;
    drop(listener);
    let mut child = tokio::process::Command::new(workspace_binary("examples/audit"))
        .args(["--listen", &addr.to_string(), "--file"])
        .arg(lattice_tests::temp_dir("audit").join("audit.jsonl"))
        .env("LATTICE_HOOK_DRAIN_MS", "300")
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    lattice_tests::wait_for_port(addr, "audit").await;
    let started = sigterm(child.id().unwrap());
    let exit = tokio::time::timeout(Duration::from_secs(5), child.wait()).await.expect("exits").unwrap();
    assert_eq!(exit.code(), Some(0));
    assert!(started.elapsed() >= Duration::from_millis(300), "exited before its drain: {:?}", started.elapsed());
}

/// `lattice example-tools` drains too: after SIGTERM its health says
/// NOT_SERVING while it still answers calls, then it exits 0.
#[tokio::test(flavor = "multi_thread")]
async fn the_example_tools_drain_after_sigterm() {
    use lattice_proto::tools::v1::{ListToolsRequest, tool_service_client::ToolServiceClient};
    let (listener, addr) = bind().await;
    drop(listener);
    let mut child = tokio::process::Command::new(workspace_binary("lattice"))
        .args(["example-tools", "--listen", &addr.to_string(), "--drain-ms", "800"])
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    lattice_tests::wait_for_port(addr, "example-tools").await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
    let started = sigterm(child.id().unwrap());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(status(channel.clone()).await, ServingStatus::NotServing as i32);
    assert!(ToolServiceClient::new(channel).list_tools(ListToolsRequest {}).await.is_ok(), "served while draining");
    let exit = tokio::time::timeout(Duration::from_secs(5), child.wait()).await.expect("exits").unwrap();
    assert_eq!(exit.code(), Some(0));
    assert!(started.elapsed() >= Duration::from_millis(800), "exited before its drain: {:?}", started.elapsed());
}

/// A Rust SDK hook refuses a tool result over its message limit with the
/// status tonic answers (OUT_OF_RANGE): the query aborts, kind `status`,
/// and the error says the hook may have refused the request as too large
/// (and how to raise the limit), without a byte of the result.
#[tokio::test(flavor = "multi_thread")]
async fn a_hook_refusing_a_request_as_too_large_is_named_so() {
    use lattice_tests::{Lattice, assert_no_leak, canary, cfg, tool::ToolDef, tool::ToolServer};
    let (url, _hook) =
        lattice_tests::start_example_env("redact", &[], &[("LATTICE_HOOK_MAX_MESSAGE_BYTES", "4096")]).await;
    let secret = canary();
    let tools = ToolServer::start(vec![ToolDef::new("t", &format!("{secret} {}", "x".repeat(10_000)))]).await;
    let config = cfg::agent("x", "")
        + &cfg::turn("go", &["t"])
        + &cfg::turn("{{last_tool_result}}", &[])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::hook("redact", &url, &["tool_result"], 2000);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("x", "go").await;
    let meta = out.hook_failure();
    assert_eq!(meta["kind"], "status");
    assert_eq!(meta["code"], "OUT_OF_RANGE");
    let message = out.status.as_ref().unwrap().message();
    assert!(message.contains("larger than its message limit"), "{message}");
    assert!(message.contains("LATTICE_HOOK_MAX_MESSAGE_BYTES"), "{message}");
    assert_no_leak(&secret, &lattice, &out);
}

/// An example hook in another language drains like the Rust ones: after
/// SIGTERM its health says NOT_SERVING while it still answers calls, then
/// it exits 0, not before its 800 ms drain.
async fn assert_drains(url: String, mut child: lattice_tests::Child) {
    let channel = tonic::transport::Endpoint::from_shared(url).unwrap().connect().await.unwrap();
    assert_eq!(status(channel.clone()).await, ServingStatus::Serving as i32);
    let started = sigterm(child.0.id().unwrap());
    // NOT_SERVING well before the drain ends (a loaded machine may take a
    // moment to deliver the signal to the interpreter).
    while status(channel.clone()).await != ServingStatus::NotServing as i32 {
        assert!(started.elapsed() < Duration::from_millis(600), "still SERVING {:?} after SIGTERM", started.elapsed());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let call = HookServiceClient::new(channel).on_tool_result(OnToolResultRequest::default()).await;
    assert!(call.is_ok(), "served while draining: {call:?}");
    let exit = tokio::time::timeout(Duration::from_secs(6), child.0.wait()).await.expect("exits").unwrap();
    assert_eq!(exit.code(), Some(0));
    assert!(started.elapsed() >= Duration::from_millis(800), "exited before its drain: {:?}", started.elapsed());
}

/// The Python example drains after SIGTERM.
#[tokio::test(flavor = "multi_thread")]
async fn the_python_hook_drains_after_sigterm() {
    let (url, child) = lattice_tests::start_python_hook_with(&["--drain-ms", "800"]).await;
    assert_drains(url, child).await;
}

/// The Go example drains after SIGTERM (then a graceful stop).
#[tokio::test(flavor = "multi_thread")]
async fn the_go_hook_drains_after_sigterm() {
    let (url, child) = lattice_tests::start_go_hook(&["--drain-ms", "800"]).await;
    assert_drains(url, child).await;
}

/// A hook whose code panics on a marked result, and keeps the others.
struct Panics;

#[lattice_hook_sdk::async_trait]
impl Hook for Panics {
    async fn on_tool_result(&self, call: ToolResultCall) -> Result<Option<ToolResultBlock>, Status> {
        if call.text().contains("boom") {
            panic!("a bug in the hook");
        }
        Ok(None)
    }
}

/// A Rust SDK hook whose code panics answers INTERNAL, "the hook
/// panicked": the query aborts as the hook's own INTERNAL status (kind
/// `status`), not as a call reset below gRPC (`unavailable`), and the hook
/// goes on serving.
#[tokio::test(flavor = "multi_thread")]
async fn a_panicking_hook_answers_internal_and_goes_on_serving() {
    use lattice_tests::{Lattice, assert_no_leak, canary, cfg, tool::ToolDef, tool::ToolServer};
    let (listener, addr) = bind().await;
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(lattice_hook_sdk::Server::new(Panics).drain(Duration::ZERO).serve_on(listener, async {
        let _ = stopped.await;
    }));
    let secret = canary();
    let tools =
        ToolServer::start(vec![ToolDef::new("boom", &format!("boom {secret}")), ToolDef::new("calm", "fine")]).await;
    let agent = |name: &str, tool: &str| {
        cfg::agent(name, "")
            + &cfg::turn("go", &[tool])
            + &cfg::turn("{{last_tool_result}}", &[])
            + &cfg::tools(&tools.url, 2000)
            + &cfg::hook("h", &format!("http://{addr}"), &["tool_result"], 2000)
    };
    let lattice = Lattice::start(&(agent("x", "boom") + &agent("y", "calm"))).await;
    let out = lattice.query("x", "go").await;
    let meta = out.hook_failure();
    assert_eq!(meta["kind"], "status", "{:?}", out.status);
    assert_eq!(meta["code"], "INTERNAL");
    assert_no_leak(&secret, &lattice, &out);
    assert_eq!(lattice.query("y", "go").await.expect_ok().text, "fine", "the hook still serves");
    let _ = stop.send(());
    server.await.unwrap().unwrap();
}

/// A Rust SDK hook's logs (`init_logs`) keep the rules of Lattice's: a
/// value from a request with a line break in it stays on its event's line,
/// escaped, and at trace the transport crates, which log what a peer sent,
/// log nothing unless `LATTICE_LOG_TRANSPORT=1`.
#[tokio::test(flavor = "multi_thread")]
async fn an_sdk_hooks_logs_keep_values_on_their_line_and_the_transport_quiet() {
    use lattice_hook_sdk::TextBlock;
    let forged = "toolu_1\n2026-01-01T00:00:00.000000Z  INFO forged: line\u{1b}[2K";
    let logs = |transport: bool| async move {
        let log = lattice_tests::temp_dir("sdk-logs").join("redact.log");
        let mut env = vec![("RUST_LOG", "trace")];
        if transport {
            env.push(("LATTICE_LOG_TRANSPORT", "1"));
        }
        let (url, hook) = lattice_tests::start_example_logging("redact", &["--log-format", "text"], &env, &log).await;
        let mut client = HookServiceClient::connect(url).await.unwrap();
        let result = ToolResultBlock {
            tool_use_id: forged.into(),
            content: vec![TextBlock { text: "nothing to hide".into() }],
            is_error: false,
        };
        let request = OnToolResultRequest { tool_use_id: forged.into(), result: Some(result), ..Default::default() };
        client.on_tool_result(request).await.unwrap();
        drop((client, hook));
        std::fs::read_to_string(&log).unwrap()
    };
    let text = logs(false).await;
    let checked: Vec<&str> = text.lines().filter(|l| l.contains("tool result checked")).collect();
    assert_eq!(checked.len(), 1, "{text}");
    assert!(
        checked[0].contains(r"tool_use_id=toolu_1\n2026-01-01T00:00:00.000000Z  INFO forged: line\x1b[2K"),
        "{text}"
    );
    assert!(!text.lines().any(|l| l.starts_with("2026-01-01")), "a forged line: {text}");
    assert!(!text.contains('\u{1b}'), "{text:?}");
    let transport = |text: &str| text.lines().filter(|l| l.contains(" h2::") || l.contains(" hyper")).count();
    assert_eq!(transport(&text), 0, "{text}");
    // The same calls with the opt-in: the transport crates' lines are there.
    let opted_in = logs(true).await;
    assert!(transport(&opted_in) > 0, "{opted_in}");
    assert!(opted_in.contains("LATTICE_LOG_TRANSPORT=1: transport crates may log bytes received from peers"));
}

/// Sends SIGTERM to `pid`, returning when it was sent: the clock starts
/// before the signal, because the drain starts when the signal arrives,
/// which can be before `kill` has exited.
fn sigterm(pid: u32) -> Instant {
    let sent = Instant::now();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status().unwrap().success());
    sent
}
