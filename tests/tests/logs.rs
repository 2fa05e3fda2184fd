//! What Lattice's own log may hold: never bytes a peer sent, at any level.

use lattice_tests::{
    Lattice, canary, cfg,
    raw_peer::{Misbehaviour, RawPeer},
};

/// Runs one query against the `lattice` binary with `env`, where the tool
/// and the OnToolResult hook both answer with a GOAWAY frame whose debug
/// data (and a PING payload) carry `secret`; returns the process's log.
async fn log_of_a_goaway_run(secret: &str, env: &[(&str, &str)]) -> String {
    let tool = RawPeer::start(Misbehaviour::GoAway(format!("tool output {secret}").into_bytes())).await;
    let hook = RawPeer::start(Misbehaviour::GoAway(format!("hook echo {secret}").into_bytes())).await;
    let config = cfg::agent("x", "")
        + &cfg::turn("go", &["t"])
        + &cfg::turn("done", &[])
        + &cfg::declared_tools(&tool.url, 2000, &["t"])
        + &cfg::optional_hook("h", &hook.url, &["tool_result"], 1000);
    let lattice = Lattice::spawn(&config, env).await;
    let out = lattice.query("x", "go").await;
    assert_eq!(out.hook_failure()["kind"], "unavailable");
    assert!(!out.everything().contains(secret));
    lattice.process_logs()
}

/// No `RUST_LOG` value makes Lattice write what a peer sent in its HTTP/2
/// frames: a hook echoing the value, or a tool whose frames carry its raw
/// (pre-hook) output. The documented opt-in does let them through, which
/// shows the probe would see a leak.
#[tokio::test(flavor = "multi_thread")]
async fn peer_bytes_never_reach_the_log_at_any_level() {
    for level in ["debug", "trace", "info,h2=trace,hyper=trace,hyper_util=trace,tonic=trace,tower=trace"] {
        let secret = canary();
        let log = log_of_a_goaway_run(&secret, &[("RUST_LOG", level)]).await;
        assert!(log.contains("hook failed"), "RUST_LOG={level}: the log should say the hook failed:\n{log}");
        assert!(!log.contains(&secret), "RUST_LOG={level}: a peer's bytes reached the log");
    }
    let secret = canary();
    let log = log_of_a_goaway_run(&secret, &[("RUST_LOG", "trace"), ("LATTICE_LOG_TRANSPORT", "1")]).await;
    assert!(log.contains(&secret), "with LATTICE_LOG_TRANSPORT=1 the transport's frame logs are written");
}

/// JSON log fields are plain values: no `Some(…)`, no Debug-quoted lists.
/// A hook that can't be reached is logged with its endpoint and the local
/// cause of the failure.
#[tokio::test(flavor = "multi_thread")]
async fn json_log_fields_are_plain_and_a_hook_failure_says_where_and_why() {
    let dead = lattice_tests::dead_url().await;
    let tools = lattice_tests::tool::ToolServer::start(vec![lattice_tests::tool::ToolDef::new("t", "v")]).await;
    let config = cfg::agent("x", "")
        + &cfg::turn("go", &["t"])
        + &cfg::turn("done", &[])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::optional_hook("gone", &dead, &["tool_result"], 500);
    let lattice = Lattice::spawn(&config, &[("RUST_LOG", "info")]).await;
    let out = lattice.query("x", "go").await;
    assert_eq!(out.hook_failure()["kind"], "unavailable");
    assert_eq!(lattice.query("no-such-agent", "go").await.code(), tonic::Code::NotFound);
    let log = lattice.process_logs();
    let refused = log.lines().find(|l| l.contains("\"query refused\"")).expect("the refusal's audit line");
    let refused: serde_json::Value = serde_json::from_str(refused).unwrap();
    assert_eq!(refused["fields"]["agent"], "no-such-agent", "{refused}");
    let mut failed = None;
    for line in log.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        for (key, value) in v["fields"].as_object().unwrap() {
            if let Some(s) = value.as_str() {
                assert!(!s.starts_with("Some(") && !s.starts_with('[') && !s.starts_with('"'), "{key} = {s} in {line}");
            }
        }
        if v["fields"]["message"] == "hook failed" {
            failed = Some(v);
        }
    }
    let failed = failed.expect("a hook failure line");
    assert_eq!(failed["fields"]["endpoint"], dead.as_str());
    let cause = failed["fields"]["cause"].as_str().unwrap_or_default().to_lowercase();
    assert!(cause.contains("refused") || cause.contains("connect"), "{failed}");
}

/// A tool call's outcome is recorded on the tool call's own span: with
/// that span off (telemetry off), it must not land on the query's span,
/// whose `outcome` is the query's (set when it ends).
#[tokio::test(flavor = "multi_thread")]
async fn a_tool_outcome_is_not_recorded_on_the_query_span() {
    let tools = lattice_tests::tool::ToolServer::start(vec![lattice_tests::tool::ToolDef::new("t", "v")]).await;
    let config =
        cfg::agent("x", "") + &cfg::turn("go", &["t"]) + &cfg::turn("done", &[]) + &cfg::tools(&tools.url, 2000);
    let lattice = Lattice::spawn(&config, &[("RUST_LOG", "info,lattice_server=debug")]).await;
    assert_eq!(lattice.query("x", "go").await.expect_ok().text, "done");
    let log = lattice.process_logs();
    let line = log.lines().find(|l| l.contains("\"tool result\"")).expect("the tool result's debug line");
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(v["span"]["name"], "query", "{line}");
    assert!(v["span"].get("outcome").is_none(), "the query has no outcome yet: {line}");
    let done = log.lines().find(|l| l.contains("\"query succeeded\"")).unwrap();
    assert!(done.contains("\"outcome\":\"OK\""), "{done}");
}
