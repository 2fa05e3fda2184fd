//! Query latency over loopback with 0, 1 and 3 hooks on both events, and one
//! hook reached by `http://`, `dns:///` and mutual TLS, to show what the hook
//! chain costs. Each query makes two model requests (two
//! OnModelRequest rounds) and one tool call (one OnToolResult round).
//!
//! Then one session continued as its conversation grows (what a query
//! costs per message of history), the same through each HTTP model
//! provider's format (a local server answering as the provider does: what
//! a request's body costs), and the session store: queries continuing sessions in the `memory` and
//! the `postgres` store, with 1 and 16 clients at once (Lattice as `deploy/`
//! runs it: `lattice serve` with one runtime thread, its default logging, no
//! trace; for the memory store also 16 clients on sessions of 4,000
//! messages; each other store's figures against the memory store's
//! measured again beside them, as the machine's speed drifts: at 16
//! clients in five rounds taking turns with it, the median of their
//! ratios); and the time of one
//! PostgreSQL commit for conversations of 10, 100 and 1,000 turns (it must
//! not grow with the conversation). Last, reading a 16 MiB conversation
//! with GetSession, one page and all of its pages, from each store (paging
//! through it must read it about once). PostgreSQL is the tests' throw-away
//! cluster (see `lattice_tests::postgres`).
//!
//! `cargo build --release -p lattice-server --bin lattice -p lattice-tests --bin lattice-bench`, then
//! `target/release/lattice-bench [QUERIES] [--only hooks,long,providers,stores,commits,pages] [--split-cores] [--stores postgres+keep,…] [--busy-poll-us N]`
//!
//! `--stores` runs only the session store rows named (and the memory
//! store's, which the others are measured against): to profile one.
//!
//! `--split-cores` runs the session store's rows with this process (the
//! clients) and Lattice on core 0 and PostgreSQL's processes on core 1, as with
//! the database on machines of its own: the memory store's rows then have
//! one core too.
//!
//! `--busy-poll-us N` runs every session store row's Lattice (the memory
//! store's too) with `server.busy_poll_us = N`.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use lattice_server::{
    config::PostgresSettings,
    domain::Message,
    session::{PostgresStore, SessionStore, connect_postgres_once},
};
use lattice_tests::{
    Lattice, QueryOpts,
    bench::{core_idle, cpu, switches, ticks},
    cfg,
    fake_api::{FakeApi, Reply},
    hook::{Behaviour, HookServer, OnResult},
    postgres::Cluster,
    sample,
    tls::TestCa,
    tool::{ToolDef, ToolServer},
};

/// The allocator `lattice serve` runs with: Lattice runs in this process,
/// and what a query costs depends on it.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    let args: Vec<String> = std::env::args().skip(1).collect();
    let queries: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(300);
    // The sections to run (all by default).
    const SECTIONS: [&str; 6] = ["hooks", "long", "providers", "stores", "commits", "pages"];
    let only = args.iter().position(|a| a == "--only").map(|i| args.get(i + 1).cloned().unwrap_or_default());
    if let Some(unknown) = only.iter().flat_map(|o| o.split(',')).find(|s| !SECTIONS.contains(s)) {
        eprintln!("lattice-bench: no section {unknown:?} (--only takes some of {})", SECTIONS.join(","));
        std::process::exit(2);
    }
    let section = |name: &str| only.as_ref().is_none_or(|o| o.split(',').any(|s| s == name));
    let tools = ToolServer::start(vec![ToolDef::new("t", "some tool output")]).await;
    if section("hooks") {
        hook_rows(queries, &tools).await;
    }
    if section("long") {
        long_sessions(&tools.url, false).await;
        long_sessions(&tools.url, true).await;
    }
    if section("providers") {
        provider_sessions("anthropic").await;
        provider_sessions("openai").await;
    }
    if section("stores") {
        let rows = args.iter().position(|a| a == "--stores").and_then(|i| args.get(i + 1)).cloned();
        let busy_poll_us = args.iter().position(|a| a == "--busy-poll-us").and_then(|i| args.get(i + 1)).cloned();
        stores(queries, args.iter().any(|a| a == "--split-cores"), rows.as_deref(), busy_poll_us.as_deref()).await;
    }
    if section("commits") {
        commits().await;
    }
    if section("pages") {
        pages().await;
    }
}

/// Query latency by number of hooks and how Lattice reaches them.
async fn hook_rows(queries: usize, tools: &ToolServer) {
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
            out.expect_ok();
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

/// Queries continuing one session as its conversation grows (memory store;
/// each query a 1 KiB prompt, two model requests and one tool call, so four
/// messages more): what a query costs per message of history. First without
/// a trace, then with one (the test harness's, rotating its files at 64 MiB).
async fn long_sessions(tools_url: &str, traced: bool) {
    let config = "[sessions]\nstore = \"memory\"\n".to_owned()
        + &cfg::agent("a", "")
        + &cfg::turn("go", &["t"])
        + &cfg::turn("done", &[])
        + &cfg::tools(tools_url, 2000);
    let lattice = if traced { Lattice::start(&config).await } else { Lattice::start_untraced(&config, &[]).await };
    println!();
    let trace = if traced { "a trace" } else { "no trace" };
    println!("one session continued (memory store, {trace}; each query: 1 KiB prompt, 2 model requests, 1 tool call)");
    session_growth(&lattice, 1024, 4, "history", |messages| messages / 4, &[1, 500, 2000]).await;
    lattice.stop().await;
}

/// One session continued through an HTTP model provider (a local server
/// answering in the provider's format): what a model request's body costs
/// as the conversation grows.
async fn provider_sessions(provider: &str) {
    const KEY_VAR: &str = "LATTICE_BENCH_MODEL_KEY";
    let reply = match provider {
        "anthropic" => serde_json::json!({"id": "msg_1", "type": "message", "role": "assistant",
            "content": [{"type": "text", "text": "y".repeat(256)}], "model": "m", "stop_reason": "end_turn",
            "usage": {"input_tokens": 3, "output_tokens": 4}}),
        _ => serde_json::json!({"id": "c1", "object": "chat.completion", "choices": [{"index": 0,
            "message": {"role": "assistant", "content": "y".repeat(256)}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}),
    };
    let api = FakeApi::start(vec![]).await;
    api.record.store(false, std::sync::atomic::Ordering::Relaxed);
    *api.fallback.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Reply::json(reply);
    let config = format!(
        "[sessions]\nstore = \"memory\"\n[[agents]]\nname = \"a\"\nsystem_prompt = \"sys\"\n[agents.model]\nprovider = {provider:?}\nname = \"m\"\nbase_url = {:?}\napi_key_env = {KEY_VAR:?}\nmax_tokens = 512\nstream = false\n",
        api.url
    );
    let lattice = Lattice::start_untraced(&config, &[(KEY_VAR, "sk-bench")]).await;
    println!();
    println!(
        "one session continued through {provider}'s API (a local server; memory store, no trace; each query: 256-byte prompt and answer, 1 model request)"
    );
    session_growth(&lattice, 256, 2, "body", |messages| messages * 300 / 1024, &[1, 1000, 4000]).await;
    lattice.stop().await;
}

/// Continues one new session of agent `a` (prompts of `prompt_bytes`, each
/// query adding `per_query` messages) to each of `sizes` queries, and
/// there times 100 queries: prints a row per size with the messages, `kib`
/// of them (the `column`), the p50, the p99, and how much the p50 grew per
/// 1,000 messages since the first row.
async fn session_growth(
    lattice: &Lattice,
    prompt_bytes: usize,
    per_query: usize,
    column: &str,
    kib: impl Fn(usize) -> usize,
    sizes: &[usize],
) {
    let prompt = "x".repeat(prompt_bytes);
    let continued = |sid: &str| QueryOpts {
        agent: "a".into(),
        prompt: prompt.clone(),
        session: Some(sid.to_owned()),
        no_model_requests: true,
        ..Default::default()
    };
    let sid = lattice.query("a", &prompt).await.session_id();
    let mut done = 1usize;
    println!("{:>9} {column:>10} {:>10} {:>10} {:>22}", "messages", "p50", "p99", "p50 more per 1,000");
    let mut first: Option<(usize, Duration)> = None;
    for &before in sizes {
        while done < before {
            lattice.query_with(continued(&sid)).await.expect_ok();
            done += 1;
        }
        let messages = per_query * done;
        let mut times = Vec::with_capacity(100);
        for _ in 0..100 {
            let out = lattice.query_with(continued(&sid)).await;
            out.expect_ok();
            times.push(out.elapsed);
            done += 1;
        }
        times.sort();
        let p50 = percentile(&times, 0.5);
        let more = match first {
            None => {
                first = Some((messages, p50));
                "-".to_owned()
            }
            Some((m0, t0)) => {
                let per = p50.saturating_sub(t0).as_secs_f64() * 1000.0 / (messages - m0) as f64;
                format!("{:.2?}", Duration::from_secs_f64(per))
            }
        };
        println!(
            "{messages:>9} {:>6} KiB {:>10.2?} {:>10.2?} {more:>22}",
            kib(messages),
            p50,
            percentile(&times, 0.99)
        );
    }
}

/// Query latency and throughput by session store and concurrency: each
/// client continues a session of its own.
async fn stores(queries: usize, split_cores: bool, rows: Option<&str>, busy_poll_us: Option<&str>) {
    let beside = std::env::current_exe().map(|exe| exe.with_file_name("lattice"));
    assert!(
        beside.is_ok_and(|p| p.exists()),
        "the session store rows run the `lattice` built beside this program: cargo build --release -p lattice-server \
         --bin lattice"
    );
    let cluster = Cluster::shared().await;
    let database = cluster.database().await;
    // TLS: a cluster of its own, accepting TLS only, reached with
    // sslmode=verify-full (the setting for a managed service).
    let ca = TestCa::new("bench-pg");
    let leaf = ca.issue("127.0.0.1");
    let tls_cluster = Cluster::tls_only(&leaf.cert_pem, &leaf.key_pem).await;
    let tls_url = format!("{}?sslmode=verify-full&sslrootcert={}", tls_cluster.database().await, ca.file.display());
    // Every core, read before any pinning (which the count follows).
    let all_cores = format!("0-{}", std::thread::available_parallelism().map_or(1, |n| n.get()) - 1);
    if split_cores {
        // Backends forked later inherit their postmaster's core.
        pin(std::process::id(), "0");
        postgres_pids().into_iter().for_each(|pid| pin(pid, "1"));
    }
    let plain = lattice_tests::postgres::connect(&database).await;
    // Over TLS as the store's own connections: verify-full with the CA.
    let tls = connect_postgres_once(&tls_url).await.unwrap();
    let (round_trip, tls_round_trip) = (bare_round_trip(&plain).await, bare_round_trip(&tls).await);
    println!();
    println!("session store: each client continuing a session of its own (1 model request a query, no trace)");
    if split_cores {
        println!("split cores: Lattice and its clients on core 0, PostgreSQL on core 1");
    }
    println!(
        "a bare statement round trip (SELECT 1, p50 of 2,000): {round_trip:.2?} plaintext, {tls_round_trip:.2?} with TLS \
         (and beside each row, below)"
    );
    println!("{:>12} {:>8} {:>9} {:>10} {:>10} {:>12}", "store", "clients", "messages", "p50", "p99", "queries/s");
    // The memory store's server, once started (the first row).
    let mut memory: Option<Arc<Lattice>> = None;
    // `pg-no-pipe`: each of a query's statements on a pooled connection
    // of its own, as before queries shared pipelined connections. `+keep`:
    // leases kept between queries (`keep_lease_ms`), so a session's next
    // query on the replica takes none.
    for (store, url) in [
        ("memory", database.as_str()),
        ("postgres", database.as_str()),
        ("postgres+tls", tls_url.as_str()),
        ("postgres+keep", database.as_str()),
        ("pg+tls+keep", tls_url.as_str()),
        ("pg-no-pipe", database.as_str()),
    ]
    .into_iter()
    .filter(|(store, _)| *store == "memory" || rows.is_none_or(|r| r.split(',').any(|row| row == *store)))
    {
        let sessions = match store {
            "memory" => "[sessions]\nstore = \"memory\"\n",
            "pg-no-pipe" => "[sessions]\nstore = \"postgres\"\nurl_env = \"BENCH_PG\"\npipeline_connections = 0\n",
            "postgres+keep" | "pg+tls+keep" => {
                "[sessions]\nstore = \"postgres\"\nurl_env = \"BENCH_PG\"\nkeep_lease_ms = 30000\n"
            }
            _ => "[sessions]\nstore = \"postgres\"\nurl_env = \"BENCH_PG\"\n",
        };
        // As deployed: a process of its own, one runtime thread, its
        // default logging; no trace: what is measured is the store.
        let poll = busy_poll_us.map(|us| format!("busy_poll_us = {us}\n")).unwrap_or_default();
        let config = "[server]\nworker_threads = 1\n".to_owned()
            + &poll
            + sessions
            + &cfg::agent("a", "")
            + &cfg::turn("ok", &[]);
        let lattice = Arc::new(Lattice::spawn_untraced(&config, &[("BENCH_PG", url)]).await);
        let Some(memory) = &memory else {
            // The memory store: the reference, kept running to be measured
            // again beside each other row; also 16 clients whose sessions
            // grow to 4,000 messages (its lease takes a list of the
            // conversation's messages; PostgreSQL reads what a replica does
            // not know from the database, which the commits section below
            // measures).
            for (clients, per_client) in [(1, queries), (16, queries / 16), (16, 2000)] {
                measure(&lattice, clients, per_client).await.print(store, clients, per_client);
            }
            memory = Some(lattice);
            continue;
        };
        // Each figure against the memory store measured just before it:
        // the machine's speed drifts within a run. So are the bare round
        // trips: the mean of theirs just before and just after the 1-client
        // figures.
        settle([&plain, &tls]).await;
        let before = (bare_round_trip(&plain).await, bare_round_trip(&tls).await);
        let memory_one = measure(memory, 1, queries).await;
        let one = measure(&lattice, 1, queries).await;
        let (round_trip, tls_round_trip) =
            ((before.0 + bare_round_trip(&plain).await) / 2, (before.1 + bare_round_trip(&tls).await) / 2);
        // At 16 clients, rounds taking turns with the memory store (which
        // goes first every other round), each round's rate against the
        // memory store's beside it: the figure is their median, as one
        // round can land on a slow or a fast stretch of this machine.
        let mut memory_rounds = Vec::new();
        let mut rounds = Vec::new();
        for round in 0..ROUNDS {
            let (m, s) = if round % 2 == 0 {
                let m = measure(memory, 16, queries / 16).await;
                (m, measure(&lattice, 16, queries / 16).await)
            } else {
                let s = measure(&lattice, 16, queries / 16).await;
                (measure(memory, 16, queries / 16).await, s)
            };
            memory_rounds.push(m);
            rounds.push(s);
        }
        let ratios: Vec<f64> = rounds.iter().zip(&memory_rounds).map(|(s, m)| s.rate / m.rate).collect();
        let (memory_sixteen, sixteen) = (Row::merged(memory_rounds), Row::merged(rounds));
        one.print(store, 1, queries);
        sixteen.print(store, 16, queries / 16);
        let added = one.p50.saturating_sub(memory_one.p50);
        let two = |rt: Duration| added.as_secs_f64() / (2.0 * rt.as_secs_f64());
        // With TLS, also against bare round trips over TLS: how much of
        // what the store adds is TLS making every round trip dearer.
        let over_tls = match store {
            "postgres+tls" | "pg+tls+keep" => format!(" ({:.2}x two bare round trips over TLS)", two(tls_round_trip)),
            _ => String::new(),
        };
        let (median, low, high) = spread(ratios);
        println!(
            "{store}: added p50 over memory ({:.2?}) {added:.2?} = {:.2}x two bare round trips ({round_trip:.2?}, \
             {tls_round_trip:.2?} with TLS, beside this row){over_tls} (goal <= 1.5); \
             queries/s at 16 clients {:.0} % of memory's ({:.0}), median of {ROUNDS} rounds ({:.0}-{:.0} %) (goal >= 80 %)",
            memory_one.p50,
            two(round_trip),
            100.0 * median,
            memory_sixteen.rate,
            100.0 * low,
            100.0 * high,
        );
        // At 16 clients the row is bound by the cores: with its clients and
        // PostgreSQL on machines of their own, what Lattice spends per query
        // is what bounds it, so its share is reported apart from theirs.
        let in_kernel =
            |r: &Row| 100.0 * r.lattice_ticks.1 as f64 / (r.lattice_ticks.0 + r.lattice_ticks.1).max(1) as f64;
        println!(
            "{store}: CPU per query at 16 clients: Lattice {:.0?} (memory store {:.0?}), {:.0} % of it in the kernel \
             ({:.0} %), its thread switched in {:.2} times a query ({:.2}); its clients {:.0?} ({:.0?}), \
             PostgreSQL {:.0?}; cores idle {}; with the clients and the database on machines of their own, an estimate: {:.0} % of \
             memory's",
            sixteen.lattice,
            memory_sixteen.lattice,
            in_kernel(&sixteen),
            in_kernel(&memory_sixteen),
            sixteen.lattice_switches,
            memory_sixteen.lattice_switches,
            sixteen.clients,
            memory_sixteen.clients,
            sixteen.database,
            idle_shares(&sixteen, &memory_sixteen),
            100.0 * memory_sixteen.lattice.as_secs_f64() / sixteen.lattice.as_secs_f64().max(1e-9)
        );
    }
    if split_cores {
        pin(std::process::id(), &all_cores);
        postgres_pids().into_iter().for_each(|pid| pin(pid, &all_cores));
    }
}

/// The share of their time cores 0 and 1 were idle in `row` (and in
/// `memory`, the memory store's beside it).
fn idle_shares(row: &Row, memory: &Row) -> String {
    let share = |(idle, all): (u64, u64)| 100.0 * idle as f64 / all.max(1) as f64;
    format!(
        "{:.0} / {:.0} % ({:.0} / {:.0} %)",
        share(row.idle[0]),
        share(row.idle[1]),
        share(memory.idle[0]),
        share(memory.idle[1])
    )
}

/// The rounds of a session store row at 16 clients (see [`stores`]).
const ROUNDS: usize = 5;

/// The median, the lowest and the highest of `values` (not empty).
fn spread(mut values: Vec<f64>) -> (f64, f64, f64) {
    values.sort_by(f64::total_cmp);
    (values[values.len() / 2], values[0], values[values.len() - 1])
}

/// One row of the session store's table: its queries' times, their rate,
/// and the CPU per query of Lattice, of its clients and of PostgreSQL;
/// and the commits a statement carried (PostgreSQL).
struct Row {
    times: Vec<Duration>,
    p50: Duration,
    rate: f64,
    lattice: Duration,
    clients: Duration,
    database: Duration,
    /// Lattice's threads switched in, per query.
    lattice_switches: f64,
    /// Lattice's CPU time in clock ticks, in user space and in the kernel.
    lattice_ticks: (u64, u64),
    /// Cores 0 and 1: idle ticks and all ticks over the row.
    idle: [(u64, u64); 2],
    per_statement: Option<f64>,
}

impl Row {
    /// Several rows' queries as one row: their times, their rate over
    /// the time they took together, their mean CPU per query.
    fn merged(rows: Vec<Row>) -> Row {
        let n = rows.iter().map(|r| r.times.len()).sum::<usize>().max(1);
        let took: f64 = rows.iter().map(|r| r.times.len() as f64 / r.rate).sum();
        let mean = |of: fn(&Row) -> Duration| {
            rows.iter().map(|r| of(r) * u32::try_from(r.times.len()).unwrap_or(u32::MAX)).sum::<Duration>()
                / u32::try_from(n).unwrap_or(u32::MAX)
        };
        let (lattice, clients, database) = (mean(|r| r.lattice), mean(|r| r.clients), mean(|r| r.database));
        let lattice_switches = rows.iter().map(|r| r.lattice_switches * r.times.len() as f64).sum::<f64>() / n as f64;
        let lattice_ticks = rows.iter().fold((0, 0), |(u, s), r| (u + r.lattice_ticks.0, s + r.lattice_ticks.1));
        let idle = [0, 1].map(|c| rows.iter().fold((0, 0), |(i, t), r| (i + r.idle[c].0, t + r.idle[c].1)));
        let statements: Vec<f64> = rows.iter().filter_map(|r| r.per_statement).collect();
        let per_statement = (!statements.is_empty()).then(|| statements.iter().sum::<f64>() / statements.len() as f64);
        let mut times: Vec<Duration> = rows.into_iter().flat_map(|r| r.times).collect();
        times.sort();
        Row {
            p50: percentile(&times, 0.5),
            rate: n as f64 / took,
            times,
            lattice,
            clients,
            database,
            lattice_switches,
            lattice_ticks,
            idle,
            per_statement,
        }
    }

    fn print(&self, store: &str, clients: usize, per_client: usize) {
        let per_statement = self.per_statement.map(|n| format!("  {n:.1} commits a statement")).unwrap_or_default();
        println!(
            "{store:>12} {clients:>8} {:>9} {:>10.2?} {:>10.2?} {:>12.0}{per_statement}",
            2 * (per_client + 1),
            self.p50,
            percentile(&self.times, 0.99),
            self.rate
        );
    }
}

/// `clients` clients at once, each continuing a session of its own (new)
/// with `per_client` queries.
async fn measure(lattice: &Arc<Lattice>, clients: usize, per_client: usize) -> Row {
    let served = lattice.pid().expect("a lattice process");
    let statements_before = commit_statements(lattice).await;
    let all = Instant::now();
    let cpu_before = (cpu(served), cpu(std::process::id()), postgres_cpu());
    let (switches_before, ticks_before) = (switches(served), ticks(served));
    let idle_before = [core_idle(0), core_idle(1)];
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let lattice = lattice.clone();
        tasks.push(tokio::spawn(async move {
            // One connection per client, kept, as a real client does.
            let mut client = lattice.client().await;
            let sid = lattice.query("a", "start").await.session_id();
            let mut times = Vec::with_capacity(per_client);
            for _ in 0..per_client {
                let opts = QueryOpts {
                    agent: "a".into(),
                    prompt: "next".into(),
                    session: Some(sid.clone()),
                    no_model_requests: true,
                    ..Default::default()
                };
                let out = Lattice::query_on(&mut client, opts).await;
                out.expect_ok();
                times.push(out.elapsed);
            }
            times
        }));
    }
    let mut times = Vec::new();
    for t in tasks {
        times.extend(t.await.unwrap());
    }
    let total = all.elapsed();
    let n = u32::try_from(times.len()).unwrap_or(u32::MAX).max(1);
    let lattice_cpu = cpu(served).saturating_sub(cpu_before.0) / n;
    let clients = cpu(std::process::id()).saturating_sub(cpu_before.1) / n;
    let database = postgres_cpu().saturating_sub(cpu_before.2) / n;
    let lattice_switches = switches(served).saturating_sub(switches_before) as f64 / f64::from(n);
    let (user, system) = ticks(served);
    let lattice_ticks = (user.saturating_sub(ticks_before.0), system.saturating_sub(ticks_before.1));
    let idle = [0, 1].map(|c| {
        let now = core_idle(c);
        (now.0.saturating_sub(idle_before[c].0), now.1.saturating_sub(idle_before[c].1))
    });
    times.sort();
    let per_statement = match (statements_before, commit_statements(lattice).await) {
        (Some(before), Some(after)) if after.1 > before.1 => Some((after.0 - before.0) / (after.1 - before.1)),
        _ => None,
    };
    Row {
        p50: percentile(&times, 0.5),
        rate: times.len() as f64 / total.as_secs_f64(),
        times,
        lattice: lattice_cpu,
        clients,
        database,
        lattice_switches,
        lattice_ticks,
        idle,
        per_statement,
    }
}

/// The commits a replica sent to PostgreSQL so far, and the statements
/// that carried them (None: the memory store).
async fn commit_statements(lattice: &Lattice) -> Option<(f64, f64)> {
    let text = lattice.metrics().await;
    let alone = sample(&text, "lattice_session_commit_statements_total{sent=\"alone\"}")?;
    let grouped = sample(&text, "lattice_session_commit_statements_total{sent=\"grouped\"}")?;
    let carried = sample(&text, "lattice_session_grouped_commits_total")?;
    Some((alone + carried, alone + grouped))
}

/// Every PostgreSQL server process on this machine.
fn postgres_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "postgres"))
        .collect()
}

/// CPU time of every PostgreSQL server process on this machine so far.
fn postgres_cpu() -> Duration {
    postgres_pids().into_iter().map(cpu).sum()
}

/// Puts every thread of process `pid` on `cores` (`taskset`'s list).
fn pin(pid: u32, cores: &str) {
    let status = std::process::Command::new("taskset")
        .args(["-a", "-p", "-c", cores, &pid.to_string()])
        .stdout(std::process::Stdio::null())
        .status();
    assert!(status.is_ok_and(|s| s.success()), "taskset could not pin process {pid} to cores {cores}");
}

/// Vacuums and checkpoints the databases of `clients` (both clusters),
/// so that what the rows before wrote is cleaned up now and not by
/// autovacuum during the next row, whose PostgreSQL core would do that
/// work too and whose CPU figure would count it.
async fn settle(clients: [&tokio_postgres::Client; 2]) {
    for client in clients {
        client.batch_execute("VACUUM ANALYZE").await.unwrap();
        client.batch_execute("CHECKPOINT").await.unwrap();
    }
}

/// The p50 of a bare statement round trip on `client` (`SELECT 1`,
/// typed, as the store sends its statements).
async fn bare_round_trip(client: &tokio_postgres::Client) -> Duration {
    let mut times = Vec::with_capacity(2000);
    for _ in 0..2000 {
        let start = Instant::now();
        client.query_typed("SELECT 1", &[]).await.unwrap();
        times.push(start.elapsed());
    }
    times.sort();
    percentile(&times, 0.5)
}

/// One PostgreSQL commit (two new messages, lease released) for
/// conversations of 10, 100 and 1,000 turns, and the acquire before it:
/// on a replica that keeps the conversations it knows (reading only what
/// was committed since), and on one that keeps none (reading them whole).
async fn commits() {
    let url = Cluster::shared().await.database().await;
    let replica = |cache: usize| {
        let settings = PostgresSettings {
            url_env: "-".into(),
            url_file: None,
            url: url.clone(),
            pool_size: 4,
            pipeline_connections: 2,
            exit_if_unreachable: true,
            history_cache_bytes: cache,
            keep_lease: Duration::ZERO,
            store_timeout: Duration::from_secs(5),
            migrate: true,
            prepared_statements: true,
        };
        PostgresStore::new(&settings, Duration::from_secs(15), Duration::from_secs(3600)).unwrap()
    };
    let (store, uncached) = (replica(1 << 26), replica(0));
    store.migrate().await.unwrap();
    let turn = [Message::user_text("a question of some length"), Message::user_text("an answer of some length too")];
    println!();
    println!("postgres commit (2 messages) by conversation length, 200 commits per row");
    println!(
        "{:>7} {:>14} {:>14} {:>14} {:>20}",
        "turns", "commit p50", "commit p99", "acquire p50", "acquire p50, no cache"
    );
    let mut base = None;
    for turns in [10usize, 100, 1000] {
        // The history in one commit, so that every row starts from the same
        // churn of its session row; then 200 commits of one turn each.
        let id = format!("bench-{turns}");
        let history: Vec<Message> = turn.iter().cycle().take(2 * turns).cloned().collect();
        store.acquire(&id, "a", true).await.unwrap().commit(history.clone()).await.unwrap();
        let (mut commit, mut acquire, mut whole) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..200 {
            let started = Instant::now();
            let mut lease = store.acquire(&id, "a", false).await.unwrap();
            acquire.push(started.elapsed());
            // What the store does, not freeing the history read.
            let history = std::mem::take(&mut lease.session);
            let started = Instant::now();
            lease.commit(turn.to_vec()).await.unwrap();
            commit.push(started.elapsed());
            drop(history);
            let started = Instant::now();
            let lease = uncached.acquire(&id, "a", false).await.unwrap();
            whole.push(started.elapsed());
            lease.release().await;
        }
        commit.sort();
        acquire.sort();
        whole.sort();
        let p50 = percentile(&commit, 0.5);
        let ratio = p50.as_secs_f64() / *base.get_or_insert(p50.as_secs_f64());
        println!(
            "{turns:>7} {:>14.2?} {:>14.2?} {:>14.2?} {:>20.2?}   commit p50 = {ratio:.2}x the 10-turn one",
            p50,
            percentile(&commit, 0.99),
            percentile(&acquire, 0.5),
            percentile(&whole, 0.5)
        );
    }
}

/// GetSession on a conversation of 16 MiB (64 prompts of 256 KiB and their
/// answers: five pages at the default 4 MiB limit), from each store: the first page, and
/// every page in turn. Reading all the pages must cost about what reading
/// the conversation once does, not once per page.
async fn pages() {
    let database = Cluster::shared().await.database().await;
    println!();
    println!("GetSession of a 16 MiB conversation (64 prompts of 256 KiB and their answers), 10 reads per row");
    println!("{:>9} {:>6} {:>14} {:>14} {:>10}", "store", "pages", "first page", "all pages", "MiB/s");
    for store in ["memory", "postgres"] {
        let sessions = match store {
            "postgres" => "[sessions]\nstore = \"postgres\"\nurl_env = \"BENCH_PG\"\n",
            _ => "[sessions]\nstore = \"memory\"\n",
        };
        let config = sessions.to_owned() + &cfg::agent("a", "") + &cfg::turn("ok", &[]);
        let lattice = Lattice::start_untraced(&config, &[("BENCH_PG", &database)]).await;
        // 64 queries: a 256 KiB prompt and a short answer each.
        let prompt = "x".repeat(256 * 1024);
        let mut sid: Option<String> = None;
        for _ in 0..64 {
            let opts = QueryOpts {
                agent: "a".into(),
                prompt: prompt.clone(),
                session: sid.clone(),
                no_model_requests: true,
                ..Default::default()
            };
            sid = Some(lattice.query_with(opts).await.session_id());
        }
        let sid = sid.unwrap_or_default();
        let (mut first, mut all, mut pages, mut bytes) = (Vec::new(), Vec::new(), 0, 0);
        for _ in 0..10 {
            let started = Instant::now();
            let mut page = lattice.session_page(&sid, 0, "").await.unwrap();
            first.push(started.elapsed());
            (pages, bytes) = (1, prost::Message::encoded_len(&page));
            while !page.next_page_token.is_empty() {
                page = lattice.session_page(&sid, 0, &page.next_page_token).await.unwrap();
                (pages, bytes) = (pages + 1, bytes + prost::Message::encoded_len(&page));
            }
            all.push(started.elapsed());
        }
        first.sort();
        all.sort();
        let (first, all) = (percentile(&first, 0.5), percentile(&all, 0.5));
        let rate = bytes as f64 / (1024.0 * 1024.0) / all.as_secs_f64();
        println!("{store:>9} {pages:>6} {first:>14.2?} {all:>14.2?} {rate:>10.0}");
        lattice.stop().await;
    }
}
