//! `/metrics` as a scraper reads it: parsed with the Prometheus Python
//! client's own parser; build info, process metrics, tokens, buckets that
//! resolve a loopback hook call, and a hook call cut by its deadline
//! counted as such.

use std::time::Duration;

use lattice_tests::{
    Lattice, cfg,
    hook::{Behaviour, HookServer},
    tool::{ToolDef, ToolServer},
};
use serde_json::Value;

/// Every sample of `text`, parsed by `prometheus_client` (Python), as
/// `{"family", "type", "name", "labels", "value"}` objects.
fn parse(text: &str) -> Vec<Value> {
    let script = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
out = []
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        out.append({"family": family.name, "type": family.type, "name": s.name, "labels": s.labels, "value": s.value})
print(json.dumps(out))
"#;
    let mut child = std::process::Command::new("python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3");
    {
        use std::io::Write;
        child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "prometheus_client could not parse /metrics (pip install prometheus-client; .ci/run does):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn value(samples: &[Value], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| s["name"] == name && labels.iter().all(|(k, v)| s["labels"][*k] == *v))
        .and_then(|s| s["value"].as_f64())
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_parse_and_count_what_happened() {
    let tools = ToolServer::start(vec![ToolDef::new("t", "v")]).await;
    let fast = HookServer::start(Behaviour::default()).await;
    let slow = HookServer::start(Behaviour { delay: Duration::from_millis(400), ..Default::default() }).await;
    let config = cfg::agent("ok", "")
        + &cfg::turn("go", &["t"])
        + &cfg::turn("done", &[])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::hook("fast", &fast.url, &["tool_result"], 2000)
        + &cfg::agent("slow", "")
        + &cfg::turn("go", &["t"])
        + &cfg::turn("done", &[])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::hook("sleepy", &slow.url, &["tool_result"], 100);
    let lattice = Lattice::spawn(&config, &[]).await;
    assert_eq!(lattice.query("ok", "go").await.expect_ok().text, "done");
    assert_eq!(lattice.query("slow", "go").await.hook_failure()["kind"], "deadline");

    let samples = parse(&lattice.metrics().await);
    let version = samples.iter().find(|s| s["name"] == "lattice_build_info").expect("lattice_build_info");
    assert_eq!(version["labels"]["version"].as_str().map(|v| !v.is_empty()), Some(true));
    assert!(value(&samples, "process_resident_memory_bytes", &[]).unwrap() > 1e6);
    assert!(value(&samples, "process_cpu_seconds_total", &[]).unwrap() > 0.0);
    assert!(value(&samples, "process_open_fds", &[]).unwrap() > 3.0);
    assert!(value(&samples, "process_start_time_seconds", &[]).unwrap() > 1.7e9);

    let calls = |hook: &str, outcome: &str| {
        value(&samples, "lattice_hook_calls_total", &[("hook", hook), ("outcome", outcome)]).unwrap_or(0.0)
    };
    assert_eq!(calls("fast", "ok"), 1.0);
    assert_eq!(calls("sleepy", "deadline"), 1.0, "a call cut by its deadline is counted as such");
    let family = samples.iter().find(|s| s["name"] == "lattice_hook_calls_total").unwrap();
    assert_eq!(family["type"], "counter");
    // The smallest bucket resolves 50 µs.
    let smallest = samples.iter().find(|s| {
        s["name"] == "lattice_hook_call_duration_seconds_bucket"
            && s["labels"]["hook"] == "fast"
            && s["labels"]["le"].as_str().and_then(|le| le.parse::<f64>().ok()) == Some(0.00005)
    });
    assert!(smallest.is_some(), "a 50 µs bucket");
    assert_eq!(
        value(&samples, "lattice_hook_call_duration_seconds_bucket", &[("hook", "fast"), ("le", "+Inf")]),
        Some(1.0)
    );
    for direction in ["input", "output"] {
        let tokens = value(&samples, "lattice_model_tokens_total", &[("agent", "ok"), ("direction", direction)]);
        assert!(tokens.unwrap_or(0.0) > 0.0, "{direction} tokens counted");
    }
    assert_eq!(value(&samples, "lattice_queries_total", &[("agent", "slow"), ("code", "ABORTED")]), Some(1.0));
}
