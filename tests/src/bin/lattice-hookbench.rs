//! The benchmark of record for what a hook call costs, against references
//! measured in the same run on the same machine.
//!
//! Every peer is a process of its own on loopback: eight hook services and
//! tool services (`lattice-test-peer`), and Lattice itself (`lattice serve`,
//! its default logging). In interleaved rounds it measures
//! - **bare**: a bare tonic client calling one hook service (OnToolResult,
//!   the same payload, the same deadline as Lattice's hook calls): latency
//!   per RPC, and the client's CPU per RPC;
//! - **direct chain**: the same client calling 1, 3 and 8 hook services one
//!   after another, passing the value along; and the same in a query's
//!   pattern: the tool, then the hooks, less the tool alone (each hook
//!   waits between calls as it does under Lattice, where a chain of one
//!   calls its hook back to back);
//! - **Lattice** with 0, 1, 3 and 8 OnToolResult hooks (and 3 on both
//!   events): queries of two scripted model turns and one tool call. The
//!   hooks' share is the difference to 0 hooks: added latency and
//!   Lattice's CPU (`/proc/PID/task/*/schedstat`) per hook call; and how
//!   many queries in a thousand took over twice the row's median (stalls).
//!
//! Then throughput with 3 hooks at 1, 8 and 64 clients against the bare-RPC
//! ceiling (bare RPC/s at the same concurrency ÷ the 4 RPCs of a query;
//! the two measured in alternating half-second slices), and against the
//! same four calls (the tool, then the three hooks) made directly by the
//! same clients, in slices of their own (what a query takes beyond them is
//! the client's own call to Lattice and Lattice's work; at 1 client, where
//! every step waits for the one before, those four calls and one bare RPC
//! are what Lattice would reach with no work of its own), with the CPU each
//! side spent per RPC or query (clients, Lattice, the peers), and payloads
//! of 1 KiB to 16 MiB through 3 hooks against three bare echoes of the
//! same payload, with Lattice's peak RSS (`VmHWM`, reset before each size's
//! measured queries: the growth a query in steady state causes; and since
//! rest) and its RSS after the large queries (their sessions deleted, so
//! what stays is Lattice's own).
//!
//! Ratios are printed with their figures, the load average, and a CSV
//! (`--csv FILE`). Numbers are printed, never asserted.
//!
//! ```text
//! cargo build --release -p lattice-server --bin lattice -p lattice-tests --bins
//! target/release/lattice-hookbench [--rounds 5] [--queries 200] [--csv hookbench.csv] [--lattice-workers N] [--lattice-busy-poll-us US] [--lattice-env K=V] [--peer-env K=V] [--only latency,throughput,payloads] [--secs 2] [--clients 1,8,64]
//! ```

use std::{
    fmt::Write as _,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use lattice_proto::{
    agent::v1::{self as apb, agent_service_client::AgentServiceClient},
    hooks::v1::{self as hpb, hook_service_client::HookServiceClient},
    tools::v1::{self as tpb, tool_service_client::ToolServiceClient},
};
use lattice_tests::{
    bench::{Killed, cpu},
    cfg,
};
use tonic::transport::{Channel, Endpoint};

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;
/// The granularity of RSS.
const PAGE: usize = 4 * KIB;
/// Hook counts of the Lattice rows.
const HOOKS: [usize; 4] = [0, 1, 3, 8];
/// Lengths of the direct chains: the Lattice rows' hook counts, where a
/// row of more calls (3 hooks on both events: 9) is set beside the longest.
const CHAINS: [usize; 3] = [1, 3, 8];
/// Payload sizes of the payload rows.
const SIZES: [usize; 4] = [KIB, 64 * KIB, MIB, 16 * MIB];

/// A peer process (killed when dropped) and its address.
struct Proc {
    child: Killed,
    addr: SocketAddr,
}

impl Proc {
    fn pid(&self) -> u32 {
        self.child.pid()
    }
}

fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// A binary next to this one (`cargo build --release` puts them together).
fn sibling(name: &str) -> PathBuf {
    let path = std::env::current_exe().unwrap().with_file_name(name);
    assert!(path.exists(), "{} is missing: build it first (see the module docs)", path.display());
    path
}

/// The `K=V` pairs of a repeatable flag (`--lattice-env`, `--peer-env`):
/// environment for the processes it names.
fn env_flags(flag: &str) -> Vec<(String, String)> {
    let all: Vec<String> = std::env::args().collect();
    all.windows(2)
        .filter(|w| w[0] == flag)
        .filter_map(|w| w[1].split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())))
        .collect()
}

fn spawn(bin: &Path, args: &[String], addr: SocketAddr, env: &[(String, String)]) -> Proc {
    let child = Command::new(bin)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
    Proc { child: Killed(child), addr }
}

/// The machine's idle time so far, all cores together (`/proc/stat`:
/// idle and iowait).
fn idle() -> Duration {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let line = stat.lines().next().unwrap_or("");
    let f: Vec<u64> = line.split_whitespace().skip(1).map(|v| v.parse().unwrap_or(0)).collect();
    let ticks = f.get(3).copied().unwrap_or(0) + f.get(4).copied().unwrap_or(0);
    Duration::from_secs_f64(ticks as f64 / USER_HZ)
}

/// Clock ticks per second in `/proc/stat` (USER_HZ: 100 on Linux).
const USER_HZ: f64 = 100.0;

/// A `/proc/PID/status` field in bytes (`VmRSS`, `VmHWM`).
fn status_bytes(pid: u32, field: &str) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':')?.trim().strip_suffix(" kB")?.trim().parse().ok())
        .map_or(0, |kb: usize| kb * KIB)
}

async fn channel(addr: SocketAddr) -> Channel {
    let endpoint = Endpoint::from_shared(format!("http://{addr}")).unwrap().tcp_nodelay(true);
    for _ in 0..200 {
        if let Ok(c) = endpoint.connect().await {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("nothing answers on {addr}");
}

fn hook_client(c: Channel) -> HookServiceClient<Channel> {
    HookServiceClient::new(c).max_decoding_message_size(usize::MAX).max_encoding_message_size(usize::MAX)
}

fn tool_result(bytes: usize) -> hpb::OnToolResultRequest {
    hpb::OnToolResultRequest {
        tool_use_id: "toolu_1".into(),
        tool_name: "fetch".into(),
        result: Some(apb::ToolResultBlock {
            tool_use_id: "toolu_1".into(),
            content: vec![apb::TextBlock { text: "x".repeat(bytes) }],
            is_error: false,
        }),
        ..Default::default()
    }
}

/// The deadline of every hook call, Lattice's (`deadline_ms` of its hooks)
/// and the references': a call with a deadline is what Lattice makes, and
/// serving one costs a peer more (gRPC servers arm a timer for it).
const HOOK_DEADLINE: Duration = Duration::from_secs(10);

/// A hook call carrying [`HOOK_DEADLINE`], as Lattice's do.
fn call(request: &hpb::OnToolResultRequest) -> tonic::Request<hpb::OnToolResultRequest> {
    let mut call = tonic::Request::new(request.clone());
    call.set_timeout(HOOK_DEADLINE);
    call
}

/// Calls `hooks` one after another with `request`, each getting the
/// previous one's result.
async fn chain(hooks: &mut [HookServiceClient<Channel>], request: &hpb::OnToolResultRequest) {
    let mut request = request.clone();
    for h in hooks.iter_mut() {
        let reply = h.on_tool_result(call(&request)).await.expect("a hook call").into_inner();
        if let Some(r) = reply.result {
            request.result = Some(r);
        }
    }
}

/// The deadline of the benchmark's tool calls (`deadline_ms` of its tool
/// services).
const TOOL_DEADLINE: Duration = Duration::from_secs(60);

/// What a query asks of its peers, made directly: the tool call, then
/// `hooks` one after another (the 3-hook agent's query with three).
async fn tool_then_hooks(
    tool: &mut ToolServiceClient<Channel>,
    hooks: &mut [HookServiceClient<Channel>],
    request: &hpb::OnToolResultRequest,
) {
    let mut call_tool = tonic::Request::new(tpb::CallToolRequest {
        tool_use_id: "toolu_1".into(),
        name: "fetch".into(),
        ..Default::default()
    });
    call_tool.set_timeout(TOOL_DEADLINE);
    tool.call_tool(call_tool).await.expect("a tool call");
    chain(hooks, request).await;
}

/// Lattice in a process of its own with `config`; waits until it answers.
async fn lattice(config: &str, dir: &Path, name: &str) -> (Proc, AgentServiceClient<Channel>) {
    let addr = free_addr();
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, config).unwrap();
    let args = ["serve", "--config", &path.display().to_string(), "--listen", &addr.to_string()].map(String::from);
    let proc = spawn(&sibling("lattice"), &args, addr, &env_flags("--lattice-env"));
    let client = AgentServiceClient::new(channel(addr).await)
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX);
    (proc, client)
}

/// One query to `agent`, read to its end.
async fn query(client: &mut AgentServiceClient<Channel>, agent: &str) -> Duration {
    query_session(client, agent).await.0
}

/// One query to `agent`, read to its end; its time and session id.
async fn query_session(client: &mut AgentServiceClient<Channel>, agent: &str) -> (Duration, String) {
    let started = Instant::now();
    let request = apb::QueryRequest { agent: agent.into(), prompt: "go".into(), ..Default::default() };
    let mut stream = match client.query(request).await {
        Ok(s) => s.into_inner(),
        Err(e) => panic!("a query failed: {:?} {}", e.code(), e.message()),
    };
    let mut session = String::new();
    while let Some(event) = stream.message().await.expect("a query's events") {
        if let Some(apb::query_event::Event::Started(s)) = event.event {
            session = s.session_id;
        }
    }
    (started.elapsed(), session)
}

/// A query whose session is deleted afterwards (so that what stays in
/// memory is Lattice's, not the sessions').
async fn query_once(client: &mut AgentServiceClient<Channel>, agent: &str) -> Duration {
    let (took, session_id) = query_session(client, agent).await;
    client.delete_session(apb::DeleteSessionRequest { session_id }).await.expect("DeleteSession");
    took
}

/// Latencies, sorted, with their CPU.
#[derive(Default, Clone)]
struct Sample {
    times: Vec<Duration>,
    cpu: Duration,
}

impl Sample {
    fn add(&mut self, other: Sample) {
        self.times.extend(other.times);
        self.cpu += other.cpu;
    }
    fn p(&self, q: f64) -> Duration {
        let mut t = self.times.clone();
        t.sort();
        t.get(((t.len().max(1) - 1) as f64 * q).round() as usize).copied().unwrap_or_default()
    }
    /// How many in a thousand took over twice the median: stalls that a
    /// p99 of a thousand can miss (it is the tenth slowest).
    fn slow_per_mille(&self) -> f64 {
        let twice = self.p(0.5) * 2;
        1000.0 * self.times.iter().filter(|t| **t > twice).count() as f64 / self.times.len().max(1) as f64
    }
    fn cpu_per(&self, calls_per_item: usize) -> Duration {
        self.cpu / (self.times.len().max(1) * calls_per_item) as u32
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs `task` from `clients` concurrent clients for `secs`: how many
/// items were done, and in how many seconds.
async fn throughput<F, Fut>(clients: usize, secs: f64, task: F) -> (f64, f64)
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let task = Arc::new(task);
    let until = Instant::now() + Duration::from_secs_f64(secs);
    let started = Instant::now();
    let mut handles = vec![];
    for c in 0..clients {
        let task = task.clone();
        handles.push(tokio::spawn(async move {
            let mut n = 0usize;
            while Instant::now() < until {
                task(c).await;
                n += 1;
            }
            n
        }));
    }
    let mut total = 0;
    for h in handles {
        total += h.await.unwrap();
    }
    (total as f64, started.elapsed().as_secs_f64())
}

/// Queries to agent `x` from `clients` concurrent clients for `secs`.
async fn query_load(client: &AgentServiceClient<Channel>, clients: usize, secs: f64) -> (f64, f64) {
    let client = client.clone();
    throughput(clients, secs, move |_| {
        let mut c = client.clone();
        async move {
            query(&mut c, "x").await;
        }
    })
    .await
}

#[tokio::main]
async fn main() {
    let arg = |name: &str| {
        let args: Vec<String> = std::env::args().collect();
        args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
    };
    let rounds: usize = arg("--rounds").and_then(|v| v.parse().ok()).unwrap_or(5);
    let per_round: usize = arg("--queries").and_then(|v| v.parse().ok()).unwrap_or(200);
    let csv_path = arg("--csv").unwrap_or_else(|| "hookbench.csv".into());
    // Lattice's `server.worker_threads` (default: one per core).
    let runtime = arg("--lattice-workers").map(|n| format!("worker_threads = {n}\n")).unwrap_or_default()
        + &arg("--lattice-busy-poll-us").map(|us| format!("busy_poll_us = {us}\n")).unwrap_or_default();
    // `--only latency,throughput,payloads` runs a subset of the sections.
    let only = arg("--only");
    // Seconds each throughput measurement runs.
    let secs: f64 = arg("--secs").and_then(|v| v.parse().ok()).unwrap_or(2.0);
    // `--clients 1,8` runs the throughput section at these client counts.
    let client_counts: Vec<usize> = arg("--clients")
        .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).filter(|&n| n > 0).collect())
        .unwrap_or_else(|| vec![1, 8, 64]);
    let section = |name: &str| only.as_deref().is_none_or(|o| o.split(',').any(|s| s == name));
    let dir = std::env::temp_dir().join(format!("lattice-hookbench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let peer = sibling("lattice-test-peer");
    let mut csv = String::from("section,metric,value,reference,ratio\n");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("lattice-hookbench: {cores} cores, load average {} at start", loadavg());

    // Eight hook services that keep the value's size, and tool services
    // answering each payload size.
    let hooks: Vec<Proc> = (0..8)
        .map(|_| {
            let addr = free_addr();
            let args = ["hook", "--listen", &addr.to_string(), "--append", ""].map(String::from);
            let mut env = env_flags("--peer-env");
            env.push(("LATTICE_HOOK_MAX_MESSAGE_BYTES".into(), (64 * MIB).to_string()));
            spawn(&peer, &args, addr, &env)
        })
        .collect();
    let tools: Vec<Proc> = SIZES
        .iter()
        .map(|size| {
            let addr = free_addr();
            let args = ["tool", "--listen", &addr.to_string(), "--bytes", &size.to_string()].map(String::from);
            spawn(&peer, &args, addr, &env_flags("--peer-env"))
        })
        .collect();
    let mut bare: Vec<HookServiceClient<Channel>> = vec![];
    for h in &hooks {
        bare.push(hook_client(channel(h.addr).await));
    }
    for t in &tools {
        drop(channel(t.addr).await);
    }

    // Lattice with 0/1/3/8 tool_result hooks and 3 on both events, on 1 KiB.
    // Every query starts a session: room for all of them.
    let limits = format!(
        "[server]\nadmin_listen = \"off\"\nmax_message_bytes = {0}\nhook_max_message_bytes = {0}\ntool_max_message_bytes = {0}\n{runtime}\
         [server.auth]\nmode = \"none\"\n[sessions]\nmax_sessions = 100000000\n",
        64 * MIB
    );
    let agent = |name: &str, tool: &Proc, hooks: &[Proc], events: &[&str]| {
        let mut c = cfg::agent(name, "")
            + &cfg::turn("go", &["fetch"])
            + &cfg::turn("done", &[])
            + &cfg::tools(&format!("http://{}", tool.addr), TOOL_DEADLINE.as_millis() as u64);
        for (i, h) in hooks.iter().enumerate() {
            let deadline_ms = HOOK_DEADLINE.as_millis() as u64;
            c += &cfg::hook(&format!("h{i}"), &format!("http://{}", h.addr), events, deadline_ms);
        }
        c
    };
    let mut rows = vec![];
    for n in HOOKS {
        let config = limits.clone() + &agent("x", &tools[0], &hooks[..n], &["tool_result"]);
        rows.push((format!("{n} hooks"), n, lattice(&config, &dir, &format!("h{n}")).await));
    }
    let both = limits.clone() + &agent("x", &tools[0], &hooks[..3], &["tool_result", "model_request"]);
    // Each query: 1 tool_result round and 2 model_request rounds.
    rows.push(("3 hooks on both events".into(), 9, lattice(&both, &dir, "both").await));
    for (_, _, (_, client)) in rows.iter_mut() {
        for _ in 0..20 {
            query(client, "x").await;
        }
    }

    // Interleaved rounds.
    let request = tool_result(KIB);
    let latency_rounds = if section("latency") { rounds } else { 0 };
    let mut bare_s = Sample::default();
    let mut direct: Vec<Sample> = vec![Sample::default(); CHAINS.len()];
    // The direct calls in a query's pattern: the tool, then 0, 1, 3 or 8
    // hooks, so that each hook waits between calls as it does under
    // Lattice (the chain above calls a single hook back to back).
    let mut direct_q: Vec<Sample> = vec![Sample::default(); CHAINS.len() + 1];
    let mut tool_direct = ToolServiceClient::new(channel(tools[0].addr).await);
    let mut lat: Vec<Sample> = vec![Sample::default(); rows.len()];
    let me = std::process::id();
    for round in 0..latency_rounds {
        let before = cpu(me);
        let mut s = Sample::default();
        for _ in 0..per_round {
            let t = Instant::now();
            bare[0].on_tool_result(call(&request)).await.unwrap();
            s.times.push(t.elapsed());
        }
        s.cpu = cpu(me) - before;
        bare_s.add(s);
        for (i, k) in CHAINS.into_iter().enumerate() {
            let mut s = Sample::default();
            for _ in 0..per_round {
                let t = Instant::now();
                chain(&mut bare[..k], &request).await;
                s.times.push(t.elapsed());
            }
            direct[i].add(s);
        }
        for (i, k) in [0].into_iter().chain(CHAINS).enumerate() {
            let mut s = Sample::default();
            for _ in 0..per_round {
                let t = Instant::now();
                tool_then_hooks(&mut tool_direct, &mut bare[..k], &request).await;
                s.times.push(t.elapsed());
            }
            direct_q[i].add(s);
        }
        for (i, (_, _, (proc, client))) in rows.iter_mut().enumerate() {
            let before = cpu(proc.pid());
            let mut s = Sample::default();
            for _ in 0..per_round {
                s.times.push(query(client, "x").await);
            }
            s.cpu = cpu(proc.pid()) - before;
            lat[i].add(s);
        }
        println!("round {}/{rounds} done, load average {}", round + 1, loadavg());
    }

    if section("latency") {
        println!();
        println!("1 KiB, {} calls or queries per row ({rounds} interleaved rounds):", rounds * per_round);
        let bare_cpu = bare_s.cpu_per(1);
        println!(
            "  bare tonic RPC: p50 {:.0} µs, p99 {:.0} µs, client CPU {:.1} µs per RPC",
            us(bare_s.p(0.5)),
            us(bare_s.p(0.99)),
            us(bare_cpu)
        );
        let _ = writeln!(csv, "bare,rpc_p50_us,{:.1},,", us(bare_s.p(0.5)));
        let _ = writeln!(csv, "bare,rpc_p99_us,{:.1},,", us(bare_s.p(0.99)));
        let _ = writeln!(csv, "bare,client_cpu_per_rpc_us,{:.1},,", us(bare_cpu));
        for (i, k) in CHAINS.into_iter().enumerate() {
            println!(
                "  direct chain of {k}: p50 {:.0} µs ({:.0} µs per call), p99 {:.0} µs, {:.0}‰ over twice the p50",
                us(direct[i].p(0.5)),
                us(direct[i].p(0.5)) / k as f64,
                us(direct[i].p(0.99)),
                direct[i].slow_per_mille()
            );
        }
        for (i, k) in CHAINS.into_iter().enumerate() {
            let added = (us(direct_q[i + 1].p(0.5)) - us(direct_q[0].p(0.5))) / k as f64;
            println!(
                "  direct, a query's pattern (the tool, then {k}): p50 {:.0} µs, {added:.0} µs per hook more than the tool alone ({:.0} µs)",
                us(direct_q[i + 1].p(0.5)),
                us(direct_q[0].p(0.5)),
            );
        }
        let base = &lat[0];
        println!(
            "  {:<22} {:>9} {:>9} {:>14} {:>14} {:>14} {:>14} {:>12} {:>12} {:>8}",
            "Lattice",
            "p50 µs",
            "p99 µs",
            "added/hook p50",
            "vs direct",
            "vs pattern",
            "added/hook p99",
            "CPU/hook µs",
            "vs bare CPU",
            "> 2×p50"
        );
        for (i, (label, calls, _)) in rows.iter().enumerate() {
            let s = &lat[i];
            let (p50, p99) = (us(s.p(0.5)), us(s.p(0.99)));
            let slow = s.slow_per_mille();
            let _ = writeln!(csv, "lattice,{label} over_twice_p50_per_mille,{slow:.0},,");
            if *calls == 0 {
                println!("  {label:<22} {p50:>9.0} {p99:>9.0} {:>93.0}‰", slow);
                let _ = writeln!(csv, "lattice,{label} p50_us,{p50:.1},,");
                continue;
            }
            let added50 = (p50 - us(base.p(0.5))) / *calls as f64;
            let added99 = (p99 - us(base.p(0.99))) / *calls as f64;
            // The direct chain of the same length (8 for 9 calls of "both").
            let j = CHAINS.iter().position(|k| k == calls).unwrap_or(CHAINS.len() - 1);
            let (d, dk) = (&direct[j], CHAINS[j] as f64);
            let (d50, d99) = (us(d.p(0.5)) / dk, us(d.p(0.99)) / dk);
            // The same hooks' share in a query's pattern, made directly.
            let q50 = (us(direct_q[j + 1].p(0.5)) - us(direct_q[0].p(0.5))) / dk;
            let cpu_per_hook = (us(s.cpu_per(1)) - us(base.cpu_per(1))) / *calls as f64;
            println!(
                "  {label:<22} {p50:>9.0} {p99:>9.0} {added50:>14.0} {:>13.2}× {:>13.2}× {added99:>14.0} {cpu_per_hook:>12.1} {:>11.2}× {slow:>7.0}‰",
                added50 / d50,
                added50 / q50,
                cpu_per_hook / us(bare_cpu)
            );
            let _ = writeln!(csv, "lattice,{label} added_p50_per_hook_us,{added50:.1},{d50:.1},{:.3}", added50 / d50);
            let _ = writeln!(
                csv,
                "lattice,{label} added_p50_per_hook_vs_pattern_us,{added50:.1},{q50:.1},{:.3}",
                added50 / q50
            );
            let _ = writeln!(csv, "lattice,{label} added_p99_per_hook_us,{added99:.1},{d99:.1},{:.3}", added99 / d99);
            let _ = writeln!(
                csv,
                "lattice,{label} cpu_per_hook_us,{cpu_per_hook:.1},{:.1},{:.3}",
                us(bare_cpu),
                cpu_per_hook / us(bare_cpu)
            );
        }
    }

    // Throughput with 3 hooks vs the bare-RPC ceiling.
    if section("throughput") {
        println!();
        println!("throughput, 3 hooks (4 RPCs a query: 3 hooks + 1 tool), 1 KiB:");
        let (three, lattice_pid) = rows.iter().find(|r| r.1 == 3).map(|r| (r.2.1.clone(), r.2.0.pid())).unwrap();
        let hook0 = bare[0].clone();
        // The same four calls made directly (a like-for-like reference:
        // the ceiling's one peer is called back to back, while a query's
        // four peers each wait between its calls).
        let tool0 = ToolServiceClient::new(channel(tools[0].addr).await);
        let hooks3: Vec<HookServiceClient<Channel>> = bare[..3].to_vec();
        // Where the CPU of each side went: this process (the clients),
        // Lattice, and the peers a query calls (three hooks and the tool).
        let peers: Vec<u32> = hooks[..3].iter().chain(&tools[..1]).map(Proc::pid).collect();
        let cpu_of = |pids: &[u32]| pids.iter().map(|p| cpu(*p)).sum::<Duration>();
        // Sides take turns in half-second slices, so that both of a pair
        // see the same machine (a shared host's speed drifts over seconds).
        let slices = (secs / 0.5).ceil().max(1.0) as usize;
        let slice = secs / slices as f64;
        for &clients in &client_counts {
            let (mut rpcs, mut rpc_secs, mut queries, mut query_secs) = (0.0, 0.0, 0.0, 0.0);
            let (mut chains, mut chain_secs) = (0.0, 0.0);
            // Lattice's queries in the slices that alternate with the chains.
            let (mut queries_by_chains, mut queries_by_chains_secs) = (0.0, 0.0);
            // CPU during the bare slices (clients, the one hook) and the
            // Lattice slices (clients, Lattice, the peers).
            let (mut bare_cpu, mut query_cpu) = ([Duration::ZERO; 2], [Duration::ZERO; 3]);
            // The machine's idle time during each side's slices.
            let mut idle_in = [Duration::ZERO; 2];
            // Two passes, each of two sides taking turns: bare and Lattice
            // (the ceiling's ratio), then the direct calls and Lattice again.
            // On a shared host what ran just before moves a side's figure by
            // several per cent, so each ratio comes from a pair of its own.
            for sides in [[0, 1], [2, 3]] {
                for _ in 0..slices {
                    for side in sides {
                        let idle_before = idle();
                        match side {
                            0 => {
                                let before = [cpu(me), cpu(hooks[0].pid())];
                                let h = hook0.clone();
                                let req = request.clone();
                                let (n, took) = throughput(clients, slice, move |_| {
                                    let mut h = h.clone();
                                    let req = call(&req);
                                    async move {
                                        h.on_tool_result(req).await.unwrap();
                                    }
                                })
                                .await;
                                (rpcs, rpc_secs) = (rpcs + n, rpc_secs + took);
                                bare_cpu[0] += cpu(me) - before[0];
                                bare_cpu[1] += cpu(hooks[0].pid()) - before[1];
                                idle_in[0] += idle().saturating_sub(idle_before);
                            }
                            3 => {
                                let (n, took) = query_load(&three, clients, slice).await;
                                (queries_by_chains, queries_by_chains_secs) =
                                    (queries_by_chains + n, queries_by_chains_secs + took);
                            }
                            1 => {
                                let before = [cpu(me), cpu(lattice_pid), cpu_of(&peers)];
                                let (n, took) = query_load(&three, clients, slice).await;
                                (queries, query_secs) = (queries + n, query_secs + took);
                                query_cpu[0] += cpu(me) - before[0];
                                query_cpu[1] += cpu(lattice_pid) - before[1];
                                query_cpu[2] += cpu_of(&peers) - before[2];
                                idle_in[1] += idle().saturating_sub(idle_before);
                            }
                            _ => {
                                let (t, h, req) = (tool0.clone(), hooks3.clone(), request.clone());
                                let (n, took) = throughput(clients, slice, move |_| {
                                    let (mut t, mut h, req) = (t.clone(), h.clone(), req.clone());
                                    async move {
                                        tool_then_hooks(&mut t, &mut h, &req).await;
                                    }
                                })
                                .await;
                                (chains, chain_secs) = (chains + n, chain_secs + took);
                            }
                        }
                    }
                }
            }
            let (rps, qps, cps) = (rpcs / rpc_secs, queries / query_secs, chains / chain_secs);
            let qps_by_chains = queries_by_chains / queries_by_chains_secs;
            let ceiling = rps / 4.0;
            println!(
                "  {clients:>3} clients: bare {rps:>7.0} RPC/s → ceiling {ceiling:>6.0} queries/s; Lattice {qps:>6.0} queries/s = {:.0} % of it",
                100.0 * qps / ceiling
            );
            println!(
                "       the query's four calls made directly: {cps:.0} chains/s; Lattice beside them {qps_by_chains:.0} queries/s = {:.0} % of it",
                100.0 * qps_by_chains / cps
            );
            // A query's time beyond its four calls made directly: the
            // client's own call to Lattice plus all Lattice does, against
            // the time of one bare RPC at this concurrency.
            let (rpc_us, beyond_us) =
                (1e6 * clients as f64 / rps, 1e6 * clients as f64 * (1.0 / qps_by_chains - 1.0 / cps));
            println!(
                "       a query's time beyond those four calls (the client's own call and Lattice's work): {beyond_us:.0} µs = {:.2} bare RPCs ({rpc_us:.0} µs)",
                beyond_us / rpc_us
            );
            if clients == 1 {
                // One client waits for every step in turn, so a query takes
                // at least its four calls and one more round trip (the
                // client's own): what Lattice would reach with no work of
                // its own, the ceiling's four RPCs a query notwithstanding.
                let bound = 1.0 / (1.0 / cps + 1.0 / rps);
                println!(
                    "       with no work of its own Lattice would reach {bound:.0} queries/s (those four calls and one bare RPC) = {:.0} % of the ceiling; it reached {:.0} % of that",
                    100.0 * bound / ceiling,
                    100.0 * qps / bound
                );
                let _ = writeln!(
                    csv,
                    "throughput,1 clients queries_per_s_vs_no_lattice_work,{qps:.0},{bound:.0},{:.3}",
                    qps / bound
                );
            }
            let per = |d: Duration, n: f64| us(d) / n.max(1.0);
            println!(
                "       CPU µs: bare RPC client {:.1} + server {:.1}; query client {:.1} + Lattice {:.1} + peers {:.1} ({:.1} per RPC)",
                per(bare_cpu[0], rpcs),
                per(bare_cpu[1], rpcs),
                per(query_cpu[0], queries),
                per(query_cpu[1], queries),
                per(query_cpu[2], queries),
                per(query_cpu[2], queries * 4.0),
            );
            // How much of the machine was idle: a side that leaves cores
            // idle is bound by waiting (wake-ups, a busy thread), not CPU.
            let idle_pct = |i: Duration, took: f64| 100.0 * i.as_secs_f64() / (took * cores as f64);
            println!(
                "       machine idle: {:.0} % during bare, {:.0} % during Lattice",
                idle_pct(idle_in[0], rpc_secs),
                idle_pct(idle_in[1], query_secs)
            );
            let _ = writeln!(
                csv,
                "throughput,{clients} clients lattice_cpu_per_query_us,{:.1},{:.1},{:.3}",
                per(query_cpu[1], queries),
                per(bare_cpu[0] + bare_cpu[1], rpcs),
                per(query_cpu[1], queries) / per(bare_cpu[0] + bare_cpu[1], rpcs)
            );
            let _ =
                writeln!(csv, "throughput,{clients} clients queries_per_s,{qps:.0},{ceiling:.0},{:.3}", qps / ceiling);
            let _ = writeln!(
                csv,
                "throughput,{clients} clients queries_per_direct_chain,{qps_by_chains:.0},{cps:.0},{:.3}",
                qps_by_chains / cps
            );
            let _ = writeln!(
                csv,
                "throughput,{clients} clients time_beyond_direct_calls_us,{beyond_us:.1},{rpc_us:.1},{:.3}",
                beyond_us / rpc_us
            );
        }
    }
    drop(rows);

    // Payloads through 3 hooks vs three bare echoes; Lattice's memory.
    if section("payloads") {
        println!();
        println!("payloads through 3 hooks (OnToolResult), each {} queries:", rounds.max(3));
        let mut config = limits.clone();
        for (i, size) in SIZES.iter().enumerate() {
            config += &agent(&format!("p{size}h0"), &tools[i], &[], &["tool_result"]);
            config += &agent(&format!("p{size}h3"), &tools[i], &hooks[..3], &["tool_result"]);
        }
        let (proc, mut client) = lattice(&config, &dir, "payloads").await;
        query_once(&mut client, &format!("p{}h3", SIZES[0])).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let rss_start = status_bytes(proc.pid(), "VmRSS");
        println!("  Lattice RSS at rest: {:.1} MiB", rss_start as f64 / MIB as f64);
        // The peak of each size is that of a query in steady state: after
        // one query of the size with and without hooks (the first grows
        // connection buffers and the allocator's arenas once), the kernel's
        // high-water mark is reset and measured from the RSS just before
        // the size's queries. The high-water mark since rest, which counts
        // what earlier queries left, is printed beside it.
        let mut hwm_since_rest = 0;
        for size in SIZES {
            let request = tool_result(size);
            let n = rounds.max(3);
            query_once(&mut client, &format!("p{size}h0")).await;
            query_once(&mut client, &format!("p{size}h3")).await;
            hwm_since_rest = hwm_since_rest.max(status_bytes(proc.pid(), "VmHWM"));
            let reset = std::fs::write(format!("/proc/{}/clear_refs", proc.pid()), "5").is_ok();
            let rss_before = status_bytes(proc.pid(), "VmRSS");
            let (mut echo, mut h0, mut h3) = (Sample::default(), Sample::default(), Sample::default());
            for _ in 0..n {
                let t = Instant::now();
                for b in bare.iter_mut().take(3) {
                    b.on_tool_result(call(&request)).await.unwrap();
                }
                echo.times.push(t.elapsed());
                h0.times.push(query_once(&mut client, &format!("p{size}h0")).await);
                h3.times.push(query_once(&mut client, &format!("p{size}h3")).await);
            }
            let added = us(h3.p(0.5)) - us(h0.p(0.5));
            let reference = us(echo.p(0.5));
            let hwm = status_bytes(proc.pid(), "VmHWM");
            hwm_since_rest = hwm_since_rest.max(hwm);
            // Without the reset (an older kernel), the mark is since rest.
            let peak = hwm.saturating_sub(if reset { rss_before } else { rss_start });
            let from_rest = hwm_since_rest.saturating_sub(rss_start);
            // RSS moves in pages: a growth of a page or two says nothing of
            // a payload that small.
            let growth = if peak <= 2 * PAGE {
                format!("{:>6} KiB, a page or two", peak / KIB)
            } else {
                format!("{:>6.1} MiB = {:>5.1}× the payload", peak as f64 / MIB as f64, peak as f64 / size as f64)
            };
            println!(
                "  {:>8}: 3 hooks add {:>9.0} µs vs 3 bare echoes {:>9.0} µs = {:>5.2}×; peak RSS growth {growth} ({:.1}× from rest)",
                human(size),
                added,
                reference,
                added / reference,
                from_rest as f64 / size as f64
            );
            let _ = writeln!(csv, "payload,{size} added_p50_us,{added:.1},{reference:.1},{:.3}", added / reference);
            let _ =
                writeln!(csv, "payload,{size} peak_rss_growth_bytes,{peak},{size},{:.3}", peak as f64 / size as f64);
            let _ = writeln!(
                csv,
                "payload,{size} peak_rss_growth_from_rest_bytes,{from_rest},{size},{:.3}",
                from_rest as f64 / size as f64
            );
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        let rss_end = status_bytes(proc.pid(), "VmRSS");
        println!(
            "  Lattice RSS 2 s after the last query: {:.1} MiB ({:+.1} MiB from rest)",
            rss_end as f64 / MIB as f64,
            (rss_end as f64 - rss_start as f64) / MIB as f64
        );
        let _ = writeln!(csv, "payload,rss_after_bytes,{rss_end},{rss_start},{:.3}", rss_end as f64 / rss_start as f64);
    }
    println!();
    println!("load average {} at the end; CSV in {csv_path}", loadavg());
    std::fs::write(&csv_path, csv).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

fn human(bytes: usize) -> String {
    if bytes >= MIB { format!("{} MiB", bytes / MIB) } else { format!("{} KiB", bytes / KIB) }
}
