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
