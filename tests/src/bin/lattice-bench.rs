//! Query latency over loopback with 0, 1 and 3 hooks on both events, and one
//! hook reached by `http://`, `dns:///` and mutual TLS, to show what the hook
//! chain costs. Each query makes two model requests (two
//! OnModelRequest rounds) and one tool call (one OnToolResult round).
//!
//! `cargo run --release -p lattice-tests --bin lattice-bench [-- QUERIES]`

use std::time::{Duration, Instant};

use lattice_tests::{
    Lattice, cfg,
    hook::{Behaviour, HookServer, OnResult},
    tls::TestCa,
    tool::{ToolDef, ToolServer},
};

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// How a row reaches its hooks.
#[derive(Clone, Copy)]
enum Reach {
    Http,
    Dns,
    MutualTls,
}

#[tokio::main]
async fn main() {
    // No log capture: the harness's TRACE capture would distort the figures.
    let _ = tracing::subscriber::set_global_default(tracing::subscriber::NoSubscriber::default());
    let queries: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(300);
    let tools = ToolServer::start(vec![ToolDef::new("t", "some tool output")]).await;
    let appender = || Behaviour { on_result: OnResult::Append("+".into()), ..Default::default() };
    let mut hooks = Vec::new();
    for _ in 0..3 {
        hooks.push(HookServer::start(appender()).await);
    }
    let ca = TestCa::new("bench");
    let (server_cert, client) = (ca.issue("hook.bench"), ca.issue("lattice.bench"));
    let tls_hook = HookServer::start_tls(appender(), ca.server_config(&server_cert, true)).await;
    let tls_line = format!(
        "tls = {{ ca_file = {:?}, cert_file = {:?}, key_file = {:?}, server_name = \"hook.bench\" }}\n",
        ca.file.display().to_string(),
        client.cert_file.display().to_string(),
        client.key_file.display().to_string()
    );
    println!("{queries} sequential queries per row; each: 2 model requests, 1 tool call");
    println!("{:>6} {:>14} {:>10} {:>10} {:>10} {:>12}", "hooks", "endpoint", "p50", "p95", "p99", "queries/s");
    let rows = [(0usize, Reach::Http), (1, Reach::Http), (1, Reach::Dns), (1, Reach::MutualTls), (3, Reach::Http)];
    for (n, reach) in rows {
        let mut config = cfg::agent("a", "")
            + &cfg::turn("go", &["t"])
            + &cfg::turn("{{last_tool_result}}", &[])
            + &cfg::tools(&tools.url, 2000);
        for (i, h) in hooks.iter().take(n).enumerate() {
            let events = ["tool_result", "model_request"];
            config += &match reach {
                Reach::Http => cfg::hook(&format!("h{i}"), &h.url, &events, 1000),
                Reach::Dns => cfg::hook(&format!("h{i}"), &h.url.replace("http://", "dns:///"), &events, 1000),
                Reach::MutualTls => cfg::hook(&format!("h{i}"), &tls_hook.url, &events, 1000) + &tls_line,
            };
        }
        let lattice = Lattice::start(&config).await;
        // Warm up (a dns:/// name resolves in the background first).
        let (mut warm, mut tries) = (0, 0);
        while warm < 20 {
            let out = lattice.query("a", "warm up").await;
            if out.status.is_none() {
                warm += 1;
            } else {
                tries += 1;
                assert!(tries < 100, "the hook never answered: {:?}", out.status);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let mut times = Vec::with_capacity(queries);
        let all = Instant::now();
        for _ in 0..queries {
            let out = lattice.query("a", "go").await;
            out.ok();
            times.push(out.elapsed);
        }
        let total = all.elapsed();
        times.sort();
        let endpoint = match (n, reach) {
            (0, _) => "-",
            (_, Reach::Http) => "http://",
            (_, Reach::Dns) => "dns:///",
            (_, Reach::MutualTls) => "https:// mTLS",
        };
        println!(
            "{n:>6} {endpoint:>14} {:>10.2?} {:>10.2?} {:>10.2?} {:>12.0}",
            percentile(&times, 0.5),
            percentile(&times, 0.95),
            percentile(&times, 0.99),
            queries as f64 / total.as_secs_f64()
        );
        lattice.stop().await;
    }
}
