//! The benchmark of record for the hook SDK packages: calls per second of
//! the same hook (each tool result's text replaced by its upper case, 1 KiB
//! by default) served four ways, each a process of its own on loopback:
//!
//! - **python-sdk**: `tests/bench/upper_sdk.py`, on the `lattice_hook`
//!   package (`hook-sdk/python`);
//! - **python-bare**: `tests/bench/upper_bare.py`, the same hook on bare
//!   grpcio: the generated servicer, the same thread pool (16) and message
//!   limits, without health, drain or trace context;
//! - **go-sdk**: `tests/bench/go-upper`, on the `latticehook` package
//!   (`hook-sdk/go`, built with its build.sh);
//! - **rust-sdk**: this binary serving the hook with `lattice-hook-sdk`
//!   (`--serve-rust-hook`; tokio's default runtime).
//!
//! It also times one call's Python work in-process
//! (`tests/bench/handler_cost.py`: the package's handler against the bare
//! servicer method), which the transport's run-to-run spread would hide.
//!
//! A tonic client makes OnToolResult calls over one HTTP/2 connection, as
//! Lattice does, from 1 and 16 concurrent tasks, for `--secs` per
//! measurement, in `--rounds` rounds whose order of peers rotates. Each
//! reply is checked. It prints the median calls/s, the peer's CPU per call
//! (`/proc/PID/task/*/schedstat`), and the ratios the SDKs answer for: python-sdk ÷
//! python-bare and go-sdk ÷ rust-sdk. Numbers are printed, never asserted.
//!
//! ```text
//! bash tests/setup.sh            # .venv with the lattice_hook package; Go
//! cargo build --release -p lattice-tests --bin lattice-sdkbench
//! PATH=$PWD/.venv/bin:$PATH target/release/lattice-sdkbench [--secs 3] [--rounds 3] [--clients 1,16] [--payload 1024]
//! ```

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use lattice_hook_sdk::{Hook, Status, ToolResultBlock, ToolResultCall, async_trait};
use lattice_proto::{
    agent::v1::{TextBlock, ToolResultBlock as WireBlock},
    hooks::v1::{OnToolResultRequest, hook_service_client::HookServiceClient},
};
use lattice_tests::bench::{Killed, cpu};
use tonic::transport::Endpoint;

struct Upper;

#[async_trait]
impl Hook for Upper {
    async fn on_tool_result(&self, call: ToolResultCall) -> Result<Option<ToolResultBlock>, Status> {
        Ok(Some(call.replace_text(call.text().to_uppercase())))
    }
}

/// A hook process (killed when dropped).
struct Peer {
    name: &'static str,
    url: String,
    child: Killed,
}

impl Peer {
    /// Starts `command` and reads its first line, `listening on PORT`.
    fn start(name: &'static str, mut command: Command) -> Peer {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("a first line");
        let port = line.trim().strip_prefix("listening on ").unwrap_or_else(|| panic!("{name} printed {line:?}"));
        Peer { name, url: format!("http://127.0.0.1:{port}"), child: Killed(child) }
    }

    /// CPU time the process has used.
    fn cpu(&self) -> Duration {
        cpu(self.child.pid())
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace").to_owned()
}

/// Calls/s and the peer's CPU per call, `clients` tasks for `secs`.
async fn measure(peer: &Peer, clients: usize, secs: f64, payload: &str) -> (f64, Duration) {
    let channel = Endpoint::from_shared(peer.url.clone()).expect("a URL").connect().await.expect("connects");
    let calls = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let expected = payload.to_uppercase();
    let cpu_before = peer.cpu();
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let mut client = HookServiceClient::new(channel.clone()).max_decoding_message_size(64 << 20);
            let (calls, stop, payload, expected) = (calls.clone(), stop.clone(), payload.to_owned(), expected.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let request = OnToolResultRequest {
                        tool_use_id: "t1".into(),
                        result: Some(WireBlock {
                            tool_use_id: "t1".into(),
                            content: vec![TextBlock { text: payload.clone() }],
                            is_error: false,
                        }),
                        ..Default::default()
                    };
                    let reply = client.on_tool_result(request).await.expect("a call failed").into_inner();
                    let text = reply.result.map(|r| r.content.into_iter().map(|b| b.text).collect::<String>());
                    assert_eq!(text.as_deref(), Some(expected.as_str()), "a wrong reply");
                    calls.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.expect("a client task");
    }
    let elapsed = started.elapsed();
    let n = calls.load(Ordering::Relaxed).max(1);
    (n as f64 / elapsed.as_secs_f64(), (peer.cpu().saturating_sub(cpu_before)) / n as u32)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--serve-rust-hook") {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
        println!("listening on {}", listener.local_addr().expect("an address").port());
        let stop = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        lattice_hook_sdk::Server::new(Upper).drain(Duration::ZERO).serve_on(listener, stop).await.expect("serves");
        return;
    }
    let flag = |name: &str, default: &str| {
        args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned()).unwrap_or_else(|| default.to_owned())
    };
    let secs: f64 = flag("--secs", "3").parse().expect("--secs: seconds");
    let rounds: usize = flag("--rounds", "3").parse().expect("--rounds: a count");
    let payload = "x".repeat(flag("--payload", "1024").parse().expect("--payload: bytes"));
    let clients: Vec<usize> =
        flag("--clients", "1,16").split(',').map(|c| c.parse().expect("--clients: counts")).collect();

    eprintln!("building the Go hook (hook-sdk/go/build.sh)");
    let go_binary = std::env::temp_dir().join(format!("lattice-sdkbench-go-{}", std::process::id()));
    let built = Command::new("bash")
        .arg(root().join("hook-sdk/go/build.sh"))
        .arg(root().join("tests/bench/go-upper"))
        .arg(&go_binary)
        .stdout(Stdio::null())
        .status()
        .expect("bash");
    assert!(built.success(), "building the Go hook failed (bash tests/setup.sh installs Go)");
    let python = |script: &str| {
        let mut c = Command::new("python3");
        c.arg(root().join("tests/bench").join(script)).args(["--listen", "127.0.0.1:0"]);
        c
    };
    let mut go = Command::new(&go_binary);
    go.args(["--listen", "127.0.0.1:0"]);
    let mut rust = Command::new(std::env::current_exe().expect("this binary"));
    rust.arg("--serve-rust-hook");
    let peers = [
        Peer::start("python-sdk", python("upper_sdk.py")),
        Peer::start("python-bare", python("upper_bare.py")),
        Peer::start("go-sdk", go),
        Peer::start("rust-sdk", rust),
    ];
    let _ = std::fs::remove_file(&go_binary);
    eprintln!("warming up");
    for peer in &peers {
        measure(peer, 16, 0.5, &payload).await;
    }
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "# lattice-sdkbench: {} B tool results, {secs} s per measurement, {rounds} rounds, {cores} cores",
        payload.len()
    );
    let mut results = vec![vec![(Vec::new(), Vec::new()); peers.len()]; clients.len()];
    for round in 0..rounds {
        for (ci, &c) in clients.iter().enumerate() {
            for k in 0..peers.len() {
                let i = (k + round) % peers.len();
                let (rate, cpu) = measure(&peers[i], c, secs, &payload).await;
                eprintln!("round {}: {c:>2} clients, {:<11} {rate:>8.0} calls/s", round + 1, peers[i].name);
                results[ci][i].0.push(rate);
                results[ci][i].1.push(cpu.as_secs_f64() * 1e6);
            }
        }
    }
    println!();
    println!("| clients | hook | calls/s (median) | min–max | peer CPU µs/call |");
    println!("|---:|---|---:|---:|---:|");
    let mut medians = vec![vec![0.0; peers.len()]; clients.len()];
    for (ci, &c) in clients.iter().enumerate() {
        for (i, peer) in peers.iter().enumerate() {
            let (rates, cpus) = &results[ci][i];
            let (lo, hi) = rates.iter().fold((f64::MAX, 0.0f64), |(lo, hi), &r| (lo.min(r), hi.max(r)));
            medians[ci][i] = median(rates.clone());
            println!("| {c} | {} | {:.0} | {lo:.0}–{hi:.0} | {:.0} |", peer.name, medians[ci][i], median(cpus.clone()));
        }
    }
    // The package's own share of a Python call, without the transport's
    // noise: its handler against the bare servicer method, in-process.
    let handler = Command::new("python3")
        .arg(root().join("tests/bench/handler_cost.py"))
        .arg(payload.len().to_string())
        .output()
        .expect("python3");
    let costs = String::from_utf8_lossy(&handler.stdout);
    let costs: Vec<f64> = costs.split_whitespace().filter_map(|v| v.parse().ok()).collect();
    if let [sdk, bare] = costs[..] {
        println!();
        println!(
            "one call's Python work, in-process (deserialize, hook, serialize; best of 5 × 50,000): \
             package {sdk:.2} µs, bare servicer {bare:.2} µs: the package adds {:.2} µs",
            sdk - bare
        );
    }
    println!();
    println!("| clients | python-sdk ÷ python-bare | go-sdk ÷ rust-sdk |");
    println!("|---:|---:|---:|");
    for (ci, &c) in clients.iter().enumerate() {
        let m = &medians[ci];
        println!("| {c} | {:.2} | {:.2} |", m[0] / m[1], m[2] / m[3]);
    }
}
