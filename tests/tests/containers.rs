//! Faults a process on loopback can't show, with hooks, tools and Lattice
//! itself in containers (testcontainers; images built `FROM scratch` around
//! static binaries): a paused hook, a stopped hook restarted at a new address, a hook cut
//! off the network, containers killed mid-call, DNS by container name, and
//! SIGTERM to the server. Each case checks the outcome and that the canary
//! secret reached no sink.

use std::{
    collections::BTreeMap,
    sync::Arc,
    time::{Duration, Instant},
};

use lattice_proto::hooks::v1::ToolErrorKind;
use lattice_server::peer::RESOLVE_EVERY;
use lattice_tests::{
    Lattice, QueryOpts, assert_no_leak, canary, cfg,
    containers::{
        HOOK_PORT, LATTICE_PORT, PeerOpts, TOOL_PORT, container_ip, container_logs, docker, host_url, network_gateway,
        peer_image, start_hook, start_lattice, start_lattice_with, start_tool, unique,
    },
    hook::{Behaviour, HookServer},
    postgres::Cluster,
    start_python_hook,
    tool::{ToolDef, ToolServer},
};
use testcontainers::{ContainerAsync, GenericImage};

/// One agent: a tool call, then an answer echoing what reached the model.
fn agent_with(tools: &str, hooks: &[(&str, &str, u64)]) -> String {
    let mut c =
        cfg::agent("x", "") + &cfg::turn("go", &["fetch"]) + &cfg::turn("model saw {{last_tool_result}}", &[]) + tools;
    for (name, url, deadline) in hooks {
        c += &cfg::hook(name, url, &["tool_result"], *deadline);
    }
    c
}

/// A tool, one hook (`redact`) and Lattice itself, each a container on one
/// user-defined network, reaching each other by name as in Kubernetes.
struct OnNetwork {
    net: String,
    _tool: ContainerAsync<GenericImage>,
    hook: ContainerAsync<GenericImage>,
    hook_name: String,
    server: ContainerAsync<GenericImage>,
    client: Arc<Lattice>,
}

impl OnNetwork {
    /// `tool` and `hook` are the peers' arguments; the deadlines are in ms.
    async fn start(tag: &str, tool: &[&str], tool_deadline: u64, hook: &[&str], hook_deadline: u64) -> Self {
        let image = peer_image().await;
        let net = unique(tag);
        let (tool_name, hook_name) = (unique("tools"), unique("redact"));
        let tool_container = start_tool(&image, tool, PeerOpts::on(&net, &tool_name)).await;
        let hook = start_hook(&image, hook, PeerOpts::on(&net, &hook_name)).await;
        let config = agent_with(
            &cfg::tools(&format!("http://{tool_name}:{TOOL_PORT}"), tool_deadline),
            &[("redact", &format!("http://{hook_name}:{HOOK_PORT}"), hook_deadline)],
        );
        let server = start_lattice(&config, &net).await;
        let client = Lattice::remote(&host_url(&server, LATTICE_PORT).await).await;
        OnNetwork { net, _tool: tool_container, hook, hook_name, server, client }
    }

    /// Queries until one answers "model saw clean", every `every`, failing
    /// after `within`; no query on the way, nor the server's logs, may hold
    /// the canary.
    async fn until_recovered(&self, secret: &str, within: Duration, every: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let out = self.client.query("x", "go").await;
            assert!(!out.everything().contains(secret));
            if out.status.is_none() {
                assert_eq!(out.expect_ok().text, "model saw clean");
                break;
            }
            assert!(Instant::now() < deadline, "no recovery within {within:?}: {:?}", out.status);
            tokio::time::sleep(every).await;
        }
        assert!(!container_logs(&self.server).await.contains(secret), "the canary reached the server's logs");
    }
}

/// Three hooks in three containers on a user-defined network: registered
/// order holds and each sees the previous output.
#[tokio::test(flavor = "multi_thread")]
async fn three_hook_containers_keep_registered_order() {
    let secret = canary();
    let image = peer_image().await;
    let net = unique("order");
    let on_net = |name: &str| PeerOpts::on(&net, &unique(name));
    let a = start_hook(&image, &["--replace", "clean", "--append", "[A]"], on_net("a")).await;
    let b = start_hook(&image, &["--append", "[B]"], on_net("b")).await;
    let c = start_hook(&image, &["--append", "[C]"], on_net("c")).await;
    let tools = ToolServer::start(vec![ToolDef::new("fetch", &secret)]).await;
    let (ua, ub, uc) = (host_url(&a, HOOK_PORT).await, host_url(&b, HOOK_PORT).await, host_url(&c, HOOK_PORT).await);
    let config = agent_with(&cfg::tools(&tools.url, 2000), &[("a", &ua, 2000), ("b", &ub, 2000), ("c", &uc, 2000)]);
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("x", "go").await;
    assert_eq!(out.expect_ok().text, "model saw clean[A][B][C]");
    assert_no_leak(&secret, &lattice, &out);
}

/// The 2nd hook's container is paused mid-query: the query aborts at the
/// hook's deadline (+ 50 ms); unpaused, the next query succeeds without a
/// restart of anything.
#[tokio::test(flavor = "multi_thread")]
async fn a_paused_hook_aborts_at_its_deadline_and_recovers() {
    let secret = canary();
    let image = peer_image().await;
    let first = start_hook(&image, &["--replace", "clean", "--append", "[1]"], PeerOpts::default()).await;
    let second = start_hook(&image, &["--append", "[2]"], PeerOpts::default()).await;
    let tools = ToolServer::start(vec![ToolDef::new("fetch", &secret).delay(Duration::from_millis(300))]).await;
    let config = agent_with(
        &cfg::tools(&tools.url, 2000),
        &[("first", &host_url(&first, HOOK_PORT).await, 1000), ("second", &host_url(&second, HOOK_PORT).await, 500)],
    );
    let lattice = std::sync::Arc::new(Lattice::start(&config).await);
    let ok = lattice.query("x", "go").await;
    assert_eq!(ok.expect_ok().text, "model saw clean[1][2]");

    let l = lattice.clone();
    let query = tokio::spawn(async move { l.query("x", "go").await });
    tokio::time::sleep(Duration::from_millis(100)).await; // the tool is running
    second.pause().await.unwrap();
    let out = query.await.unwrap();
    let meta = out.hook_failure();
    assert_eq!((meta["hook"].as_str(), meta["kind"].as_str()), ("second", "deadline"));
    // The tool (300 ms) and the first hook ran, then 500 ms for the second.
    assert!(
        out.elapsed >= Duration::from_millis(800) && out.elapsed <= ok.elapsed + Duration::from_millis(550),
        "aborted after {:?} (a good query took {:?})",
        out.elapsed,
        ok.elapsed
    );
    assert_no_leak(&secret, &lattice, &out);

    second.unpause().await.unwrap();
    assert_eq!(lattice.query("x", "go").await.expect_ok().text, "model saw clean[1][2]");
}

/// A stopped hook container aborts queries (unavailable: its name no
/// longer resolves); started again with another address, as a restarted
/// Kubernetes pod, the next queries succeed: Lattice, in a container
/// itself, resolves the hook's name again when it reconnects.
#[tokio::test(flavor = "multi_thread")]
async fn a_stopped_hook_aborts_and_recovers_at_its_new_address() {
    let secret = canary();
    let on = OnNetwork::start("restart", &["--text", &secret], 2000, &["--replace", "clean"], 1000).await;
    assert_eq!(on.client.query("x", "go").await.expect_ok().text, "model saw clean");
    let first_address = container_ip(&on.hook, &on.net);

    on.hook.stop().await.unwrap();
    // Another container takes the freed address, so the hook comes back
    // elsewhere.
    let _squatter = start_tool(&peer_image().await, &[], PeerOpts::on(&on.net, &unique("squatter"))).await;
    let out = on.client.query("x", "go").await;
    assert_eq!(out.hook_failure()["kind"], "unavailable");
    assert!(!out.everything().contains(&secret));

    on.hook.start().await.unwrap();
    assert_ne!(container_ip(&on.hook, &on.net), first_address, "the restarted hook kept its address");
    on.until_recovered(&secret, Duration::from_secs(20), Duration::from_millis(200)).await;
}

/// A `dns:///` hook endpoint naming two replicas (one network alias, as a
/// headless Kubernetes Service names its ready pods): the calls spread over
/// both. With one replica stopped, queries fail closed until the next
/// resolution drops its address, then all go to the other.
#[tokio::test(flavor = "multi_thread")]
async fn a_dns_endpoint_spreads_calls_over_the_replicas() {
    let secret = canary();
    let image = peer_image().await;
    let net = unique("replicas");
    let (tool_name, alias) = (unique("tools"), unique("redact"));
    let _tool = start_tool(&image, &["--text", &secret], PeerOpts::on(&net, &tool_name)).await;
    let mut replicas = vec![];
    for marker in ["[a]", "[b]"] {
        let replica = start_hook(&image, &["--replace", "clean", "--append", marker], PeerOpts::default()).await;
        docker(&["network", "connect", "--alias", &alias, &net, replica.id()]);
        replicas.push(replica);
    }
    let config = agent_with(
        &cfg::tools(&format!("http://{tool_name}:{TOOL_PORT}"), 2000),
        &[("redact", &format!("dns:///{alias}:{HOOK_PORT}"), 1000)],
    );
    let server = start_lattice(&config, &net).await;
    let client = Lattice::remote(&host_url(&server, LATTICE_PORT).await).await;
    // Runs queries until `until`, or until `n` have answered in a row;
    // counts the answers, and the queries that failed closed.
    let run = |n: usize, until: Instant| {
        let client = client.clone();
        let secret = secret.clone();
        async move {
            let (mut seen, mut failed) = (BTreeMap::<String, usize>::new(), 0);
            while seen.values().sum::<usize>() < n && Instant::now() < until {
                let out = client.query("x", "go").await;
                assert!(!out.everything().contains(&secret));
                if out.status.is_none() {
                    *seen.entry(out.expect_ok().text.clone()).or_default() += 1;
                    continue;
                }
                // Refused, or unreachable until the deadline.
                let kind = out.hook_failure()["kind"].clone();
                assert!(kind == "unavailable" || kind == "deadline", "{kind}");
                seen.clear();
                failed += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (seen, failed)
        }
    };
    // The name is resolved in the background from start-up on.
    let (seen, _) = run(20, Instant::now() + Duration::from_secs(10)).await;
    assert_eq!(seen.keys().collect::<Vec<_>>(), ["model saw clean[a]", "model saw clean[b]"], "{seen:?}");

    replicas[0].stop().await.unwrap();
    let (_, failed) = run(usize::MAX, Instant::now() + RESOLVE_EVERY + Duration::from_secs(1)).await;
    println!("{failed} queries failed closed before the stopped replica left the set");
    // Resolved again since: every query now goes to the other replica. (A
    // dead address left in the set would fail a query each time its
    // reconnect attempt gives up, about every second.)
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        assert_eq!(client.query("x", "go").await.expect_ok().text, "model saw clean[b]");
    }
    assert!(!container_logs(&server).await.contains(&secret), "the canary reached the server's logs");
}

/// A hook container killed during a call aborts the query; nothing of the
/// pending value leaks.
#[tokio::test(flavor = "multi_thread")]
async fn a_hook_killed_mid_call_aborts_without_leaking() {
    let secret = canary();
    let image = peer_image().await;
    let slow = start_hook(&image, &["--replace", "clean", "--delay-ms", "3000"], PeerOpts::default()).await;
    let tools = ToolServer::start(vec![ToolDef::new("fetch", &secret)]).await;
    let config = agent_with(&cfg::tools(&tools.url, 2000), &[("redact", &host_url(&slow, HOOK_PORT).await, 5000)]);
    let lattice = std::sync::Arc::new(Lattice::start(&config).await);
    let l = lattice.clone();
    let query = tokio::spawn(async move { l.query("x", "go").await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    docker(&["kill", slow.id()]);
    let out = query.await.unwrap();
    let meta = out.hook_failure();
    assert_eq!(meta["hook"], "redact");
    assert!(out.elapsed < Duration::from_millis(2500), "took {:?}", out.elapsed);
    assert_no_leak(&secret, &lattice, &out);
}

/// A tool container killed mid-call gives an error tool result (not an
/// abort), and the OnToolResult chain still runs on it.
#[tokio::test(flavor = "multi_thread")]
async fn a_tool_killed_mid_call_gives_an_error_result_through_the_chain() {
    let image = peer_image().await;
    let tool = start_tool(&image, &["--delay-ms", "3000"], PeerOpts::default()).await;
    let hook = HookServer::start(Behaviour::default()).await;
    let config = agent_with(&cfg::tools(&host_url(&tool, TOOL_PORT).await, 10_000), &[("watch", &hook.url, 1000)]);
    let lattice = std::sync::Arc::new(Lattice::start(&config).await);
    let l = lattice.clone();
    let query = tokio::spawn(async move { l.query("x", "go").await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    docker(&["kill", tool.id()]);
    let out = query.await.unwrap();
    let text = out.expect_ok().text.clone();
    assert!(text.starts_with("model saw tool \"fetch\" failed"), "{text}");
    assert!(out.tool_results()[0].result.as_ref().unwrap().is_error);
    let seen = hook.state.tool_results();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].error.as_ref().unwrap().kind, ToolErrorKind::RpcFailed as i32);
}

/// Lattice itself in a container reaches its hook and tool by container
/// name on a user-defined network (as in Kubernetes), is queried through a
/// mapped port, and on SIGTERM lets the in-flight query finish and exits
/// promptly.
#[tokio::test(flavor = "multi_thread")]
async fn the_server_in_a_container_uses_dns_and_stops_cleanly_on_sigterm() {
    let secret = canary();
    let on = OnNetwork::start(
        "dns",
        &["--delay-ms", "1500", "--text", &secret],
        5000,
        &["--replace", "clean", "--append", "[h]"],
        2000,
    )
    .await;
    assert_eq!(on.client.query("x", "go").await.expect_ok().text, "model saw clean[h]");

    let c = on.client.clone();
    let in_flight = tokio::spawn(async move { c.query("x", "go").await });
    tokio::time::sleep(Duration::from_millis(400)).await;
    docker(&["kill", "--signal", "TERM", on.server.id()]);
    let signalled = Instant::now();
    // The query in flight when SIGTERM came finishes, with its result.
    let out = in_flight.await.unwrap();
    assert_eq!(out.expect_ok().text, "model saw clean[h]");
    while on.server.is_running().await.unwrap_or(false) {
        assert!(signalled.elapsed() < Duration::from_secs(5), "the server did not exit after SIGTERM");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(on.server.exit_code().await.unwrap(), Some(0));
    let logs = container_logs(&on.server).await;
    assert!(logs.contains("shutting down"), "{logs}");
    assert!(!logs.contains(&secret), "the canary reached the server's logs");
    assert!(!out.everything().contains(&secret));
}

/// A hook cut off the network mid-query (`docker network disconnect`)
/// aborts the query at its deadline; reconnected, queries work again.
#[tokio::test(flavor = "multi_thread")]
async fn a_hook_cut_off_the_network_aborts_at_its_deadline_and_recovers() {
    let secret = canary();
    // The tool takes 1 s, so the cut lands mid-query, before the hook call.
    let on =
        OnNetwork::start("cut", &["--delay-ms", "1000", "--text", &secret], 5000, &["--replace", "clean"], 700).await;
    assert_eq!(on.client.query("x", "go").await.expect_ok().text, "model saw clean");

    let c = on.client.clone();
    let query = tokio::spawn(async move { c.query("x", "go").await });
    tokio::time::sleep(Duration::from_millis(100)).await; // the tool is running
    docker(&["network", "disconnect", &on.net, &on.hook_name]);
    let out = query.await.unwrap();
    let meta = out.hook_failure();
    assert_eq!((meta["hook"].as_str(), meta["kind"].as_str()), ("redact", "deadline"));
    assert!(out.elapsed < Duration::from_millis(1000 + 700 + 250), "took {:?}", out.elapsed);
    assert!(!out.everything().contains(&secret));

    docker(&["network", "connect", &on.net, &on.hook_name]);
    on.until_recovered(&secret, Duration::from_secs(45), Duration::from_millis(500)).await;
}

/// The Python example hook (a host process on loopback) in one chain with
/// containerized Rust hooks.
#[tokio::test(flavor = "multi_thread")]
async fn the_python_hook_chains_with_containerized_rust_hooks() {
    let image = peer_image().await;
    let a = start_hook(&image, &["--append", " [A]"], PeerOpts::default()).await;
    let b = start_hook(&image, &["--append", " [B]"], PeerOpts::default()).await;
    let (python, _py) = start_python_hook().await;
    let tools = ToolServer::start(vec![ToolDef::new("fetch", "mail ada@example.com")]).await;
    let config = agent_with(
        &cfg::tools(&tools.url, 2000),
        &[
            ("a", &host_url(&a, HOOK_PORT).await, 2000),
            ("python", &python, 2000),
            ("b", &host_url(&b, HOOK_PORT).await, 2000),
        ],
    );
    let lattice = Lattice::start(&config).await;
    let out = lattice.query("x", "go").await;
    assert_eq!(out.expect_ok().text, "model saw mail [REDACTED:email] [A] [B]");
    assert_no_leak("ada@example.com", &lattice, &out);
}

/// Two Lattice containers share their sessions through PostgreSQL (a host
/// process, reached over the network's gateway): a session started on one
/// is continued on the other; one killed mid-query (docker kill), the other
/// continues the session once the dead one's lease expires, from its last
/// committed query.
#[tokio::test(flavor = "multi_thread")]
async fn lattice_containers_share_sessions_and_survive_a_killed_replica() {
    let image = peer_image().await;
    let net = unique("pg");
    let tool_name = unique("slow-tools");
    // The tool answers after 2 s: long enough to kill a replica mid-query.
    let _tool = start_tool(&image, &["--delay-ms", "2000", "--text", "data"], PeerOpts::on(&net, &tool_name)).await;
    let (gateway, subnet) = network_gateway(&net);
    let cluster = Cluster::private_on(Some((&gateway, &subnet))).await;
    let database = cluster.database().await;
    let url = database.replace("127.0.0.1", &gateway);
    let config = "[sessions]\nstore = \"postgres\"\nurl_env = \"LATTICE_POSTGRES_URL\"\nlease_ttl_ms = 1500\n"
        .to_owned()
        + &agent_with(&cfg::tools(&format!("http://{tool_name}:{TOOL_PORT}"), 10_000), &[]);
    let env = [("LATTICE_POSTGRES_URL", url.as_str())];
    let a = start_lattice_with(&config, &net, "server-a", &env).await;
    let b = start_lattice_with(&config, &net, "server-b", &env).await;
    let client_a = Lattice::remote(&host_url(&a, LATTICE_PORT).await).await;
    let client_b = Lattice::remote(&host_url(&b, LATTICE_PORT).await).await;

    let first = client_a.query("x", "go").await;
    assert_eq!(first.expect_ok().text, "model saw data");
    let sid = first.session_id();
    let again = |prompt: &str| QueryOpts {
        agent: "x".into(),
        prompt: prompt.into(),
        session: Some(sid.clone()),
        ..Default::default()
    };
    assert_eq!(client_b.query_with(again("on b")).await.expect_ok().text, "model saw data");
    let committed = client_b.session(&sid).await.unwrap();
    assert_eq!(committed.messages.len(), 8);

    // A query in flight on A (its tool takes 2 s) when A is killed.
    let in_flight = {
        let (c, opts) = (client_a.clone(), again("lost with a"));
        tokio::spawn(async move { c.query_with(opts).await })
    };
    tokio::time::sleep(Duration::from_millis(700)).await;
    docker(&["kill", a.id()]);
    let killed = Instant::now();
    assert!(in_flight.await.unwrap().final_result().is_none());

    let out = loop {
        let out = client_b.query_with(again("after the kill")).await;
        if out.code() != tonic::Code::FailedPrecondition {
            break out;
        }
        assert!(killed.elapsed() < Duration::from_secs(15), "the dead replica's lease never expired");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(out.expect_ok().text, "model saw data");
    let after = client_b.session(&sid).await.unwrap();
    assert_eq!(after.messages[..8], committed.messages[..], "the committed history is intact");
    assert_eq!(after.messages.len(), 12, "nothing of the killed query was stored");
}
