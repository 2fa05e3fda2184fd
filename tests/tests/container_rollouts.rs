//! Rolling updates of hooks and tools, as Kubernetes does them: replicas in
//! containers behind one DNS name, queries running all along, one replica
//! stopped with SIGTERM (it drains), started again, then the other. No
//! query may fail. A replica killed with SIGKILL fails only the calls that
//! were on it, closed, with nothing leaked.

use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use lattice_tests::{
    Lattice, canary, cfg,
    containers::{
        HOOK_PORT, LATTICE_PORT, PeerOpts, TOOL_PORT, container_logs, docker, host_url, peer_image, start_hook,
        start_lattice, start_tool, unique,
    },
};
use testcontainers::{ContainerAsync, GenericImage};
use tokio::task::JoinHandle;

/// How long a stopping replica keeps serving (NOT_SERVING) before it sends
/// GOAWAY and exits.
const DRAIN_MS: &str = "3000";

/// Concurrent clients of the load.
const CLIENTS: usize = 4;

/// What the load saw: answers by text, failures by kind.
#[derive(Debug, Default)]
struct Tally {
    answers: BTreeMap<String, usize>,
    failures: BTreeMap<String, usize>,
}

impl Tally {
    fn add(&mut self, other: Tally) {
        for (k, n) in other.answers {
            *self.answers.entry(k).or_default() += n;
        }
        for (k, n) in other.failures {
            *self.failures.entry(k).or_default() += n;
        }
    }

    fn failed(&self) -> usize {
        self.failures.values().sum()
    }

    fn answered(&self) -> usize {
        self.answers.values().sum()
    }
}

impl std::fmt::Display for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} queries answered {:?}, {} failed {:?}",
            self.answered(),
            self.answers,
            self.failed(),
            self.failures
        )
    }
}

/// Queries from [`CLIENTS`] clients, one after another each, until stopped;
/// no outcome may carry the canary.
struct Load {
    stop: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<Tally>>,
}

impl Load {
    fn start(client: &Arc<Lattice>, secret: &str) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..CLIENTS)
            .map(|_| {
                let (client, secret, stop) = (client.clone(), secret.to_owned(), stop.clone());
                tokio::spawn(async move {
                    let mut tally = Tally::default();
                    while !stop.load(Ordering::Relaxed) {
                        let out = client.query("x", "go").await;
                        assert!(!out.everything().contains(&secret), "the canary leaked");
                        if out.status.is_none() {
                            *tally.answers.entry(out.expect_ok().text.clone()).or_default() += 1;
                        } else {
                            let kind =
                                out.hook_failure().get("kind").cloned().unwrap_or_else(|| format!("{:?}", out.code()));
                            *tally.failures.entry(kind).or_default() += 1;
                        }
                    }
                    tally
                })
            })
            .collect();
        Load { stop, tasks }
    }

    async fn finish(self) -> Tally {
        self.stop.store(true, Ordering::Relaxed);
        let mut total = Tally::default();
        for t in self.tasks {
            total.add(t.await.unwrap());
        }
        total
    }
}

/// Runs `docker ARGS` off the runtime's threads (a stop waits for the
/// container to exit).
async fn docker_async(args: &[&str]) {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || docker(&args.iter().map(String::as_str).collect::<Vec<_>>())).await.unwrap();
}

/// Queries until one answers `text`, within `within`.
async fn until_answer(client: &Lattice, text: &str, within: Duration) {
    let until = Instant::now() + within;
    loop {
        let out = client.query("x", "go").await;
        if out.status.is_none() && out.expect_ok().text == text {
            return;
        }
        assert!(Instant::now() < until, "no answer {text:?} within {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Two replicas of a peer on `net`, both answering to `alias`.
async fn replicas(
    net: &str,
    alias: &str,
    start: impl AsyncFn(&'static str) -> ContainerAsync<GenericImage>,
) -> Vec<ContainerAsync<GenericImage>> {
    let mut replicas = vec![];
    for marker in ["[a]", "[b]"] {
        let replica = start(marker).await;
        docker_async(&["network", "connect", "--alias", alias, net, replica.id()]).await;
        replicas.push(replica);
    }
    replicas
}

/// A user-defined network, removed when dropped (after the containers on
/// it, when declared before them).
struct Network(String);

impl Network {
    async fn create(tag: &str) -> Network {
        let name = unique(tag);
        docker_async(&["network", "create", &name]).await;
        Network(name)
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        let _ = std::process::Command::new("docker").args(["network", "rm", &self.0]).output();
    }
}

/// SIGTERM one replica (it drains, then exits), start it again and wait
/// until it answers, then the same for the other: the rollout the load runs
/// through.
async fn roll(client: &Lattice, replicas: &[ContainerAsync<GenericImage>], answers: [&str; 2]) {
    for (replica, answer) in replicas.iter().zip(answers) {
        let stopping = Instant::now();
        docker_async(&["stop", "--time", "20", replica.id()]).await;
        println!("replica {answer:?} drained and stopped in {:?}", stopping.elapsed());
        docker_async(&["start", replica.id()]).await;
        until_answer(client, answer, Duration::from_secs(20)).await;
    }
}

/// A tool service (answering `secret`), two redaction hook replicas `[a]`
/// and `[b]` (with their extra arguments) behind one alias named as
/// `dns:///`, and Lattice, on a network of their own.
struct HookReplicas {
    _tool: ContainerAsync<GenericImage>,
    hooks: Vec<ContainerAsync<GenericImage>>,
    server: ContainerAsync<GenericImage>,
    client: Arc<Lattice>,
}

impl HookReplicas {
    async fn start(tag: &str, secret: &str, a: &[&str], b: &[&str], hook_deadline_ms: u64) -> HookReplicas {
        let image = peer_image().await;
        let net = unique(tag);
        let (tool_name, alias) = (unique("tools"), unique("redact"));
        let tool = start_tool(&image, &["--text", secret], PeerOpts::on(&net, &tool_name)).await;
        let hooks = replicas(&net, &alias, async |marker| {
            let mut args = vec!["--replace", "clean", "--append", marker];
            args.extend(if marker == "[a]" { a } else { b });
            start_hook(&image, &args, PeerOpts::default()).await
        })
        .await;
        let config = cfg::agent("x", "")
            + &cfg::turn("go", &["fetch"])
            + &cfg::turn("model saw {{last_tool_result}}", &[])
            + &cfg::tools(&format!("http://{tool_name}:{TOOL_PORT}"), 2000)
            + &cfg::hook("redact", &format!("dns:///{alias}:{HOOK_PORT}"), &["tool_result"], hook_deadline_ms);
        let server = start_lattice(&config, &net).await;
        let client = Lattice::remote(&host_url(&server, LATTICE_PORT).await).await;
        HookReplicas { _tool: tool, hooks, server, client }
    }
}

/// A rolling update of the redaction hook (two replicas behind one name,
/// each stopped with SIGTERM in turn while queries run) fails no query.
#[tokio::test(flavor = "multi_thread")]
async fn a_hook_rollout_fails_no_query() {
    let secret = canary();
    let on =
        HookReplicas::start("hook-rollout", &secret, &["--drain-ms", DRAIN_MS], &["--drain-ms", DRAIN_MS], 1000).await;
    let (hooks, server, client) = (&on.hooks, &on.server, &on.client);
    for answer in ["model saw clean[a]", "model saw clean[b]"] {
        until_answer(client, answer, Duration::from_secs(20)).await;
    }

    let load = Load::start(client, &secret);
    roll(client, hooks, ["model saw clean[a]", "model saw clean[b]"]).await;
    let rollout = load.finish().await;
    println!("rollout: {rollout}");
    assert_eq!(rollout.failed(), 0, "a rolling update failed queries: {:?}", rollout.failures);
    assert!(rollout.answered() > 100, "the load ran: {rollout:?}");

    assert!(!container_logs(server).await.contains(&secret), "the canary reached the server's logs");
}

/// SIGKILL of a hook replica while calls are on it (it takes 3 s per call,
/// the other none): exactly the queries on it fail, closed, as
/// `unavailable` and long before their deadline, leaking nothing; the
/// other replica serves the rest.
#[tokio::test(flavor = "multi_thread")]
async fn a_killed_hook_replica_fails_only_the_calls_on_it() {
    let secret = canary();
    let on = HookReplicas::start("hook-kill", &secret, &["--delay-ms", "3000"], &[], 8000).await;
    let (hooks, server, client) = (&on.hooks, &on.server, &on.client);
    until_answer(client, "model saw clean[b]", Duration::from_secs(20)).await;

    let load = Load::start(client, &secret);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let killing = Instant::now();
    docker_async(&["kill", hooks[0].id()]).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let tally = load.finish().await;
    println!("SIGKILL: {tally}, in {:?}", killing.elapsed());
    // The slow replica holds a call whenever the fast one is as loaded;
    // the others went to the fast one.
    assert!((1..=CLIENTS).contains(&tally.failed()), "only the calls on the killed replica fail: {tally:?}");
    assert!(tally.failures.keys().all(|k| k == "unavailable"), "{tally:?}");
    assert!(tally.answers.get("model saw clean[b]").is_some_and(|n| *n > 50), "{tally:?}");
    // Afterwards everything goes to the survivor.
    let since = Instant::now();
    while since.elapsed() < Duration::from_secs(2) {
        assert_eq!(client.query("x", "go").await.expect_ok().text, "model saw clean[b]");
    }
    assert!(!container_logs(server).await.contains(&secret), "the canary reached the server's logs");
}

/// The same rolling update for a tool service: no tool call fails.
#[tokio::test(flavor = "multi_thread")]
async fn a_tool_rollout_fails_no_tool_call() {
    let image = peer_image().await;
    let network = Network::create("tool-rollout").await;
    let net = network.0.clone();
    let alias = unique("tools");
    let tools = replicas(&net, &alias, async |marker| {
        let args = ["--text", marker, "--drain-ms", DRAIN_MS];
        start_tool(&image, &args, PeerOpts::default()).await
    })
    .await;
    let config = cfg::agent("x", "")
        + &cfg::turn("go", &["fetch"])
        + &cfg::turn("model saw {{last_tool_result}}", &[])
        + &cfg::tools(&format!("dns:///{alias}:{TOOL_PORT}"), 2000);
    let server = start_lattice(&config, &net).await;
    let client = Lattice::remote(&host_url(&server, LATTICE_PORT).await).await;
    for answer in ["model saw [a]", "model saw [b]"] {
        until_answer(&client, answer, Duration::from_secs(20)).await;
    }
    let load = Load::start(&client, "no canary here");
    roll(&client, &tools, ["model saw [a]", "model saw [b]"]).await;
    let rollout = load.finish().await;
    println!("rollout: {rollout}");
    // A failed tool call is an error result the model reads, not a failed
    // query: every answer must be one of the two replicas' texts.
    assert_eq!(rollout.failed(), 0, "{rollout:?}");
    let failed_calls: usize = rollout
        .answers
        .iter()
        .filter(|(text, _)| !["model saw [a]", "model saw [b]"].contains(&text.as_str()))
        .map(|(_, n)| n)
        .sum();
    assert_eq!(failed_calls, 0, "tool calls failed during the rollout: {:?}", rollout.answers);
    assert!(rollout.answered() > 100, "the load ran: {rollout:?}");
    drop(server);
}
