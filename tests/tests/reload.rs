//! Changing the config of a running `lattice serve`: the file is read
//! again when it changes and on SIGHUP; a valid one is applied at once
//! (new queries take the new hook chain, a query already running keeps the
//! chain it started with); an invalid one is refused with its problems and
//! the running config stays; settings that need a restart are reported and
//! keep their running values.

use std::time::{Duration, Instant};

use lattice_proto::agent::v1 as pb;
use lattice_tests::{
    Lattice, cfg,
    hook::{Behaviour, HookServer, OnResult},
    tool::{ToolDef, ToolServer},
};

fn appender(marker: &str) -> Behaviour {
    Behaviour { on_result: OnResult::Append(marker.into()), ..Default::default() }
}

fn agent(tools: &str, hooks: &str) -> String {
    cfg::agent("x", "") + &cfg::turn("go", &["t"]) + &cfg::turn("done", &[]) + &cfg::tools(tools, 5000) + hooks
}

async fn chain_version(lattice: &Lattice) -> String {
    let request = pb::GetAgentRequest { name: "x".into() };
    lattice.client().await.get_agent(request).await.unwrap().into_inner().chain_version
}

/// Waits up to 10 s for the metric line `line`.
async fn metric(lattice: &Lattice, line: &str) {
    let started = Instant::now();
    loop {
        let text = lattice.metrics().await;
        if text.contains(line) {
            return;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "no {line} in\n{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The file changes while a query runs: new queries run on the new chain,
/// the running one finishes on its own, and each hook is told the version
/// of the chain that called it.
#[tokio::test(flavor = "multi_thread")]
async fn a_changed_file_is_applied_and_a_running_query_keeps_its_chain() {
    let tools = ToolServer::start(vec![ToolDef::new("t", "data").delay(Duration::from_millis(1500))]).await;
    let (a, b) = (HookServer::start(appender("[A]")).await, HookServer::start(appender("[B]")).await);
    let first = agent(&tools.url, &cfg::hook("h", &a.url, &["tool_result"], 2000));
    let lattice = std::sync::Arc::new(Lattice::spawn(&first, &[]).await);
    let before = chain_version(&lattice).await;

    let running = {
        let lattice = lattice.clone();
        tokio::spawn(async move { lattice.query("x", "go").await })
    };
    // The tool is running: the chain changes under the query.
    tokio::time::sleep(Duration::from_millis(300)).await;
    lattice.rewrite_config(&agent(&tools.url, &cfg::hook("h", &b.url, &["tool_result"], 2000)));
    metric(&lattice, "lattice_config_reloads_total{result=\"ok\"} 1").await;
    let after = chain_version(&lattice).await;
    assert_ne!(before, after, "the endpoint is part of the chain's version");

    let new = lattice.query("x", "go").await;
    assert_eq!(new.tool_texts(), vec!["data[B]"], "a new query takes the new chain");
    let old = running.await.unwrap();
    assert_eq!(old.tool_texts(), vec!["data[A]"], "the running query kept the chain it started with");
    old.expect_ok();
    let told = |h: &HookServer| h.state.tool_results()[0].context.clone().unwrap_or_default().chain_version;
    assert_eq!((told(&a), told(&b)), (before, after));
}

/// An invalid file is refused with its problem's line and the running
/// config stays; SIGHUP reloads an unchanged name; a change that needs a
/// restart is reported as such while the rest is applied.
#[tokio::test(flavor = "multi_thread")]
async fn an_invalid_file_changes_nothing_and_restart_settings_keep_their_values() {
    let tools = ToolServer::start(vec![ToolDef::new("t", "data")]).await;
    let (a, b) = (HookServer::start(appender("[A]")).await, HookServer::start(appender("[B]")).await);
    let first = agent(&tools.url, &cfg::hook("h", &a.url, &["tool_result"], 2000));
    let lattice = Lattice::spawn(&first, &[]).await;

    // A hook with no endpoint.
    lattice.rewrite_config(&(agent(&tools.url, "") + "[[agents.hooks]]\nname = \"h\"\nevents = [\"tool_result\"]\n"));
    metric(&lattice, "lattice_config_reloads_total{result=\"invalid\"} 1").await;
    assert_eq!(lattice.query("x", "go").await.tool_texts(), vec!["data[A]"], "the running config stays");
    let logs = lattice.process_logs();
    assert!(logs.lines().any(|l| l.contains("config reload: invalid") && l.contains("endpoint")), "{logs}");

    // A change of the hook and of a setting that needs a restart, applied
    // on SIGHUP (the file's change would do it too).
    let second = "[server]\nmax_concurrent_queries = 7\n".to_owned()
        + &agent(&tools.url, &cfg::hook("h", &b.url, &["tool_result"], 2000));
    lattice.rewrite_config(&second);
    lattice.signal("HUP");
    metric(&lattice, "lattice_config_reloads_total{result=\"restart_needed\"} 1").await;
    assert_eq!(lattice.query("x", "go").await.tool_texts(), vec!["data[B]"]);
    let logs = lattice.process_logs();
    assert!(logs.contains("server.max_concurrent_queries"), "the log says which setting needs a restart");
    // Still serving after the SIGHUP.
    assert!(lattice.serving().await);
}
