//! Query latency over loopback with 0, 1 and 3 hooks on both events, to show
//! what the hook chain costs. Each query makes two model requests (two
//! OnModelRequest rounds) and one tool call (one OnToolResult round).
//!
//! `cargo run --release -p lattice-tests --bin lattice-bench [-- QUERIES]`

use std::time::{Duration, Instant};

use lattice_tests::{
    Lattice, cfg,
    hook::{Behaviour, HookServer, OnResult},
    tool::{ToolDef, ToolServer},
};

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[tokio::main]
async fn main() {
    // No log capture: the harness's TRACE capture would distort the figures.
    let _ = tracing::subscriber::set_global_default(tracing::subscriber::NoSubscriber::default());
    let queries: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(300);
    let tools = ToolServer::start(vec![ToolDef::new("t", "some tool output")]).await;
    let mut hooks = Vec::new();
    for _ in 0..3 {
        hooks
            .push(HookServer::start(Behaviour { on_result: OnResult::Append("+".into()), ..Default::default() }).await);
    }
    println!("{queries} sequential queries per row; each: 2 model requests, 1 tool call");
    println!("{:>6} {:>10} {:>10} {:>10} {:>12}", "hooks", "p50", "p95", "p99", "queries/s");
    for n in [0usize, 1, 3] {
        let mut config = cfg::agent("a", "")
            + &cfg::turn("go", &["t"])
            + &cfg::turn("{{last_tool_result}}", &[])
            + &cfg::tools(&tools.url, 2000);
        for (i, h) in hooks.iter().take(n).enumerate() {
            config += &cfg::hook(&format!("h{i}"), &h.url, &["tool_result", "model_request"], 1000);
        }
        let lattice = Lattice::start(&config).await;
        for _ in 0..20 {
            lattice.query("a", "warm up").await.ok();
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
        println!(
            "{n:>6} {:>10.2?} {:>10.2?} {:>10.2?} {:>12.0}",
            percentile(&times, 0.5),
            percentile(&times, 0.95),
            percentile(&times, 0.99),
            queries as f64 / total.as_secs_f64()
        );
        lattice.stop().await;
    }
}
