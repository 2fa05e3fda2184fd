//! Sessions in PostgreSQL, shared by several `lattice serve` processes:
//! any replica serves any session, one query at a time across all of them,
//! no turn lost or duplicated, a crashed replica's lease expires, and a
//! database outage is UNAVAILABLE and NOT_SERVING, then heals by itself.
//! Also the memory store's limits.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use lattice_proto::agent::v1 as pb;
use lattice_tests::{
    Lattice, QueryOpts, cfg,
    hook::{Behaviour, HookServer},
    message_text,
    postgres::{Cluster, connect, until_a_statement_waits_for_a_lock},
    sample,
    tool::{ToolDef, ToolServer},
};
use tonic::Code;

const URL_ENV: &str = "LATTICE_POSTGRES_URL";

/// An agent that answers "seen N" (N: the messages it was sent), after
/// `delay_ms`, over the postgres store with `extra` session keys.
fn config(delay_ms: u64, extra: &str) -> String {
    format!("[sessions]\nstore = \"postgres\"\nurl_env = \"{URL_ENV}\"\n{extra}\n")
        + &cfg::agent("a", "")
        + &format!("[[agents.model.script]]\ntext = \"seen {{{{message_count}}}}\"\ndelay_ms = {delay_ms}\n")
}

/// `n` replicas on one fresh database.
async fn replicas(n: usize, config: &str) -> Vec<Arc<Lattice>> {
    let url = Cluster::shared().await.database().await;
    let mut all = Vec::new();
    for _ in 0..n {
        all.push(Arc::new(Lattice::spawn(config, &[(URL_ENV, &url)]).await));
    }
    all
}

fn continue_(session: &str, prompt: &str) -> QueryOpts {
    QueryOpts { agent: "a".into(), prompt: prompt.into(), session: Some(session.into()), ..Default::default() }
}

/// A store of its own on the database at `url`, as one replica would
/// have: leases of `lease_ttl`, keeping `cache` bytes of conversations.
fn replica_store(url: &str, lease_ttl: Duration, cache: usize) -> lattice_server::session::PostgresStore {
    let settings = lattice_server::config::PostgresSettings {
        url_env: "-".into(),
        url_file: None,
        url: url.to_owned(),
        pool_size: 2,
        pipeline_connections: 2,
        exit_if_unreachable: true,
        history_cache_bytes: cache,
        keep_lease: Duration::ZERO,
        store_timeout: Duration::from_secs(5),
        migrate: true,
        prepared_statements: true,
    };
    lattice_server::session::PostgresStore::new(&settings, lease_ttl, Duration::from_secs(3600)).unwrap()
}

/// A replica's `[sessions]` keys that keep leases between queries.
const KEEP: &str = "keep_lease_ms = 30000";

/// A session started on replica A is continued on B and read on C: the
/// same history everywhere. Deleted on A, it is gone on every replica,
/// and B (which ran its last query) finds it no more.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_moves_between_replicas() {
    a_session_moves_between_replicas_(&replicas(3, &config(0, "")).await, None).await;
}

/// The same with leases kept between queries: each query that moves is
/// handed the lease the last replica kept, as is the delete; A and B count
/// two handovers each.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_moves_between_replicas_that_keep_leases() {
    a_session_moves_between_replicas_(&replicas(3, &config(0, KEEP)).await, Some(2.0)).await;
}

/// `handovers`: what A's and B's `lattice_session_lease_handovers_total`
/// say at the end (None: not shown, leases are not kept).
async fn a_session_moves_between_replicas_(r: &[Arc<Lattice>], handovers: Option<f64>) {
    let first = r[0].query("a", "one").await;
    assert_eq!(first.expect_ok().text, "seen 1");
    let sid = first.session_id();
    let second = r[1].query_with(continue_(&sid, "two")).await;
    assert_eq!(second.expect_ok().text, "seen 3", "B saw A's turn");
    let on_c = r[2].session(&sid).await.unwrap();
    let texts: Vec<String> = on_c.messages.iter().map(message_text).collect();
    assert_eq!(texts, vec!["one", "seen 1", "two", "seen 3"]);
    assert_eq!(r[0].session(&sid).await.unwrap(), on_c);
    // Back on A: it continues B's turn.
    assert_eq!(r[0].query_with(continue_(&sid, "three")).await.expect_ok().text, "seen 5");
    assert_eq!(r[1].query_with(continue_(&sid, "four")).await.expect_ok().text, "seen 7");
    // Deleted on one replica, gone on all.
    r[0].client()
        .await
        .delete_session(lattice_proto::agent::v1::DeleteSessionRequest { session_id: sid.clone() })
        .await
        .unwrap();
    assert_eq!(r[2].session(&sid).await.unwrap_err().code(), Code::NotFound);
    assert_eq!(r[1].query_with(continue_(&sid, "five")).await.code(), Code::NotFound);
    for replica in &r[..2] {
        let text = replica.metrics().await;
        assert_eq!(sample(&text, "lattice_session_lease_handovers_total"), handovers, "{text}");
    }
}

/// The same session queried on A and B at once: exactly one is refused
/// (FAILED_PRECONDITION), the other completes, and the history has exactly
/// one new turn.
#[tokio::test(flavor = "multi_thread")]
async fn one_query_at_a_time_across_replicas() {
    one_query_at_a_time_across_replicas_("").await;
}

/// The same with leases kept between queries: A keeps the lease of its
/// first query; B, asking for it while A's second query uses it, is told
/// the session is busy.
#[tokio::test(flavor = "multi_thread")]
async fn one_query_at_a_time_across_replicas_that_keep_leases() {
    one_query_at_a_time_across_replicas_(KEEP).await;
}

async fn one_query_at_a_time_across_replicas_(extra: &str) {
    let r = replicas(2, &config(400, extra)).await;
    let sid = r[0].query("a", "start").await.session_id();
    let (a, b) = (r[0].clone(), r[1].clone());
    let (sa, sb) = (sid.clone(), sid.clone());
    let qa = tokio::spawn(async move { a.query_with(continue_(&sa, "from A")).await });
    let qb = tokio::spawn(async move { b.query_with(continue_(&sb, "from B")).await });
    let (oa, ob) = (qa.await.unwrap(), qb.await.unwrap());
    let mut codes = vec![oa.code(), ob.code()];
    codes.sort_by_key(|c| *c as i32);
    assert_eq!(codes, vec![Code::Ok, Code::FailedPrecondition], "{:?} {:?}", oa.status, ob.status);
    assert_eq!(r[1].session(&sid).await.unwrap().messages.len(), 4);
}

/// 50 clients, 10 sessions, queries spread over 3 replicas at random: every
/// query that succeeded is in its session exactly once, in a history of
/// exactly two messages per success; none that failed is there.
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_clients_lose_and_duplicate_no_turn() {
    concurrent_clients_lose_and_duplicate_no_turn_("").await;
}

/// The same with leases kept between queries: most queries move to
/// another replica, which asks for the lease the last one kept.
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_clients_lose_and_duplicate_no_turn_with_kept_leases() {
    concurrent_clients_lose_and_duplicate_no_turn_(KEEP).await;
}

async fn concurrent_clients_lose_and_duplicate_no_turn_(extra: &str) {
    let r = replicas(3, &config(5, extra)).await;
    let mut sessions = Vec::new();
    for i in 0..10 {
        sessions.push(r[i % 3].query("a", &format!("open {i}")).await.session_id());
    }
    let mut clients = Vec::new();
    for c in 0..50usize {
        let (r, sessions) = (r.clone(), sessions.clone());
        clients.push(tokio::spawn(async move {
            let mut done = Vec::new();
            for q in 0..4usize {
                let pick = (c * 7 + q * 13) % 10;
                let replica = &r[(c + q) % 3];
                let prompt = format!("c{c} q{q}");
                let out = replica.query_with(continue_(&sessions[pick], &prompt)).await;
                match out.code() {
                    Code::Ok => done.push((pick, prompt)),
                    Code::FailedPrecondition => {}
                    other => panic!("{prompt}: {other:?} {:?}", out.status),
                }
            }
            done
        }));
    }
    let mut succeeded: HashMap<usize, Vec<String>> = HashMap::new();
    for c in clients {
        for (pick, prompt) in c.await.unwrap() {
            succeeded.entry(pick).or_default().push(prompt);
        }
    }
    let total: usize = succeeded.values().map(Vec::len).sum();
    assert!(total >= 20, "only {total} of 200 queries got through");
    for (i, sid) in sessions.iter().enumerate() {
        let stored = r[i % 3].session(sid).await.unwrap();
        let prompts: Vec<String> = stored.messages.iter().step_by(2).skip(1).map(message_text).collect();
        let mut expected = succeeded.remove(&i).unwrap_or_default();
        let mut got = prompts.clone();
        expected.sort();
        got.sort();
        assert_eq!(got, expected, "session {i}: lost or duplicated turns");
        assert_eq!(stored.messages.len(), 2 + 2 * prompts.len());
    }
}

/// Queries' own statements share a replica's pipelined connections: 16
/// sessions querying at once on one replica open no more than
/// `pipeline_connections` of them (besides the pool's, which health and
/// reads use), where a connection per statement opens about one per query
/// in flight; and every turn is stored.
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_queries_share_a_replicas_pipelined_connections() {
    let cluster = Cluster::shared().await;
    let url = cluster.database().await;
    let database = url.rsplit('/').next().unwrap().to_owned();
    let config = config(20, "pipeline_connections = 2\npool_size = 16\n");
    let lattice = Arc::new(Lattice::spawn(&config, &[(URL_ENV, &url)]).await);
    let mut clients = Vec::new();
    for c in 0..16 {
        let lattice = lattice.clone();
        clients.push(tokio::spawn(async move {
            let sid = lattice.query("a", &format!("c{c} open")).await.session_id();
            for q in 0..5 {
                lattice.query_with(continue_(&sid, &format!("c{c} q{q}"))).await.expect_ok();
            }
            sid
        }));
    }
    let mut sessions = Vec::new();
    for c in clients {
        sessions.push(c.await.unwrap());
    }
    for (c, sid) in sessions.iter().enumerate() {
        let stored = lattice.session(sid).await.unwrap();
        let prompts: Vec<String> = stored.messages.iter().step_by(2).map(message_text).collect();
        let expected: Vec<String> =
            std::iter::once(format!("c{c} open")).chain((0..5).map(|q| format!("c{c} q{q}"))).collect();
        assert_eq!(prompts, expected, "session {c}");
    }
    let admin = connect(&cluster.admin_url("postgres")).await;
    let row = admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name = 'lattice'",
            &[&database],
        )
        .await
        .unwrap();
    let open: i64 = row.get(0);
    assert!(open <= 4, "{open} connections for 16 sessions at once: the statements did not share connections");
}

/// A replica killed mid-query (SIGKILL: no release) holds the session
/// until its lease expires; then another continues it with the history of
/// the last committed query: no half-written turn, no dangling tool_use.
#[tokio::test(flavor = "multi_thread")]
async fn a_killed_replicas_lease_expires_and_nothing_half_written_remains() {
    let tools = ToolServer::start(vec![ToolDef::new("t", "data")]).await;
    let config = "[sessions]\nstore = \"postgres\"\nurl_env = \"LATTICE_POSTGRES_URL\"\nlease_ttl_ms = 1500\n"
        .to_owned()
        + &cfg::agent("a", "")
        + &cfg::turn("calling", &["t"])
        + &cfg::turn("seen {{message_count}}", &[])
        + &cfg::tools(&tools.url, 60_000);
    let url = Cluster::shared().await.database().await;
    let mut a = Lattice::spawn(&config, &[(URL_ENV, &url)]).await;
    let b = Lattice::spawn(&config, &[(URL_ENV, &url)]).await;
    let first = a.query("a", "committed").await;
    first.expect_ok();
    let sid = first.session_id();
    let before = b.session(&sid).await.unwrap();
    assert_eq!(before.messages.len(), 4);

    tools.state.tools.lock().unwrap()[0].delay = Duration::from_secs(30);
    let in_flight = {
        let url = a.url.clone();
        let sid = sid.clone();
        tokio::spawn(async move {
            let a = Lattice::remote(&url).await;
            a.query_with(continue_(&sid, "never stored")).await
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while tools.state.calls.lock().unwrap().len() < 2 {
        assert!(Instant::now() < deadline, "the second query never reached its tool call");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    a.kill();
    let killed = Instant::now();
    let _ = in_flight.await;
    tools.state.tools.lock().unwrap()[0].delay = Duration::ZERO;

    // Refused while the dead replica's lease lasts, then served.
    let mut refused = 0;
    let out = loop {
        let out = b.query_with(continue_(&sid, "after")).await;
        match out.code() {
            Code::FailedPrecondition => refused += 1,
            _ => break out,
        }
        assert!(killed.elapsed() < Duration::from_secs(10), "the lease never expired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    out.expect_ok();
    assert!(refused > 0, "the session should have been held until the lease expired");
    assert!(killed.elapsed() >= Duration::from_millis(1000), "served after {:?}", killed.elapsed());
    let after = b.session(&sid).await.unwrap();
    let texts: Vec<String> = after.messages.iter().map(message_text).collect();
    assert!(!texts.iter().any(|t| t == "never stored"), "{texts:?}");
    assert_eq!(after.messages[..4], before.messages[..]);
    assert_eq!(after.messages.len(), 8);
}

/// PostgreSQL stopped mid-run: queries get UNAVAILABLE naming the store
/// (never its URL), health turns NOT_SERVING, nothing is half-written; once
/// it is back, queries succeed and health is SERVING, without a restart.
#[tokio::test(flavor = "multi_thread")]
async fn a_database_outage_is_unavailable_and_heals_by_itself() {
    let cluster = Cluster::private().await;
    let url = cluster.database().await;
    let lattice = Lattice::spawn(&config(0, ""), &[(URL_ENV, &url)]).await;
    let first = lattice.query("a", "before").await;
    first.expect_ok();
    let sid = first.session_id();

    cluster.stop();
    let out = lattice.query_with(continue_(&sid, "during")).await;
    assert_eq!(out.code(), Code::Unavailable, "{:?}", out.status);
    let message = out.status.as_ref().unwrap().message().to_owned();
    assert!(message.contains("session store (postgres)") && !message.contains("127.0.0.1"), "{message}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while lattice.serving().await {
        assert!(Instant::now() < deadline, "health stayed SERVING with the database down");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!lattice.serving_as("").await, "the overall status (readiness) follows the store");
    assert!(lattice.serving_as("liveness").await, "liveness does not: the process is fine");

    cluster.start().await;
    let deadline = Instant::now() + Duration::from_secs(15);
    while !lattice.serving().await {
        assert!(Instant::now() < deadline, "health did not return to SERVING");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let out = lattice.query_with(continue_(&sid, "after")).await;
    assert_eq!(out.expect_ok().text, "seen 3", "the failed query left nothing behind");
    let logs = lattice.process_logs();
    assert!(!logs.contains(&url), "the connection string reached the log");
}

/// A hook failure and a client cancel on one replica leave the shared
/// history unchanged; the next query (on another replica) sees it whole.
#[tokio::test(flavor = "multi_thread")]
async fn failed_queries_leave_the_shared_history_unchanged() {
    let hook = HookServer::start(Behaviour::default()).await;
    let config = config(0, "") + &cfg::hook("h", &hook.url, &["model_request"], 1000);
    let r = replicas(2, &config).await;
    let first = r[0].query("a", "one").await;
    first.expect_ok();
    let sid = first.session_id();
    let before = r[1].session(&sid).await.unwrap();
    hook.state.set(Behaviour { fail: Some(Code::Internal), ..Default::default() });
    r[0].query_with(continue_(&sid, "aborted")).await.hook_failure();
    // The lease was released before the client heard of the failure: a
    // retry at once, on another replica, finds the session free.
    assert_eq!(r[1].query_with(continue_(&sid, "retried")).await.hook_failure()["kind"], "status");
    hook.state.set(Behaviour { hang: true, ..Default::default() });
    let cut = QueryOpts { timeout: Some(Duration::from_millis(300)), ..continue_(&sid, "cut") };
    assert_eq!(r[1].query_with(cut).await.code(), Code::DeadlineExceeded);
    assert_eq!(r[0].session(&sid).await.unwrap(), before);
    hook.state.set(Behaviour::default());
    assert_eq!(r[1].query_with(continue_(&sid, "two")).await.expect_ok().text, "seen 3");
}

/// The memory store: a new session past `max_sessions` is refused with a
/// clear RESOURCE_EXHAUSTED; sessions idle past `idle_ttl_s` are gone.
#[tokio::test(flavor = "multi_thread")]
async fn the_memory_store_is_bounded_and_expires() {
    let config =
        "[sessions]\nmax_sessions = 2\nidle_ttl_s = 1\n".to_owned() + &cfg::agent("a", "") + &cfg::turn("hi", &[]);
    let lattice = Lattice::start(&config).await;
    let first = lattice.query("a", "1").await.session_id();
    lattice.query("a", "2").await.expect_ok();
    let full = lattice.query("a", "3").await;
    assert_eq!(full.code(), Code::ResourceExhausted, "{:?}", full.status);
    assert!(full.status.unwrap().message().contains("session store is full"));
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(lattice.session(&first).await.unwrap_err().code(), Code::NotFound);
    lattice.query("a", "4").await.expect_ok();
}

/// The lease is fenced: when another replica takes a session over (here by
/// hand, as a replica would after this one stalled past the expiry), the
/// old holder learns it has lost the lease, and its commit writes nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_lost_lease_writes_nothing() {
    use lattice_server::{
        domain::Message,
        session::{SessionStore, StoreError},
    };
    let url = Cluster::shared().await.database().await;
    let store = replica_store(&url, Duration::from_millis(600), 1 << 20);
    store.migrate().await.unwrap();
    store.acquire("s", "a", true).await.unwrap().commit(vec![Message::user_text("kept")]).await.unwrap();

    let lease = store.acquire("s", "a", false).await.unwrap();
    let client = connect(&url).await;
    client.execute("UPDATE lattice_sessions SET lease_token = gen_random_uuid() WHERE id = 's'", &[]).await.unwrap();
    tokio::time::timeout(Duration::from_secs(3), lease.lost()).await.expect("the holder learns it lost the lease");
    assert_eq!(lease.commit(vec![Message::user_text("lost")]).await.unwrap_err(), StoreError::LeaseLost);
    let rows: i64 = client.query_one("SELECT count(*) FROM lattice_messages", &[]).await.unwrap().get(0);
    assert_eq!(rows, 1, "the lost lease wrote nothing");
    assert_eq!(store.get("s").await.unwrap().messages, vec![Message::user_text("kept")]);
}

/// The leases of running queries are renewed (one task renews them all):
/// two held for over three times the lease's time to live are never
/// declared lost, stay unexpired in the database, and commit.
#[tokio::test(flavor = "multi_thread")]
async fn leases_held_past_their_time_to_live_are_renewed() {
    use lattice_server::{domain::Message, session::SessionStore};
    let url = Cluster::shared().await.database().await;
    let store = replica_store(&url, Duration::from_millis(600), 1 << 20);
    store.migrate().await.unwrap();
    let (a, b) = (store.acquire("a", "a", true).await.unwrap(), store.acquire("b", "a", true).await.unwrap());
    tokio::select! {
        () = a.lost() => panic!("a's lease was declared lost"),
        () = b.lost() => panic!("b's lease was declared lost"),
        () = tokio::time::sleep(Duration::from_secs(2)) => {}
    }
    let client = connect(&url).await;
    let held: i64 = client
        .query_one("SELECT count(*) FROM lattice_sessions WHERE lease_expires > now() AND id IN ('a', 'b')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(held, 2, "a lease expired in the database");
    a.commit(vec![Message::user_text("a")]).await.unwrap();
    b.commit(vec![Message::user_text("b")]).await.unwrap();
    assert_eq!(store.get("b").await.unwrap().messages, vec![Message::user_text("b")]);
}

/// A lease taken while the previous query's commit lands (its statement
/// waits for that commit's row lock) reads the conversation with that
/// commit's messages: the history and the count it continues from agree.
#[tokio::test(flavor = "multi_thread")]
async fn a_lease_taken_while_a_commit_lands_reads_that_commits_messages() {
    use lattice_server::{domain::Message, session::SessionStore};
    let url = Cluster::shared().await.database().await;
    let store = replica_store(&url, Duration::from_secs(15), 1 << 20);
    store.migrate().await.unwrap();
    store.acquire("s", "a", true).await.unwrap().commit(vec![Message::user_text("first")]).await.unwrap();

    // A commit in flight: the second message and the bumped count, written
    // but not yet committed, holding the session row's lock.
    let mut client = connect(&url).await;
    let commit = client.transaction().await.unwrap();
    let late = serde_json::to_string(&Message::user_text("late")).unwrap();
    commit
        .execute("INSERT INTO lattice_messages (session_id, seq, message) VALUES ('s', 1, $1)", &[&late])
        .await
        .unwrap();
    commit
        .execute("UPDATE lattice_sessions SET version = version + 1, message_count = 2 WHERE id = 's'", &[])
        .await
        .unwrap();

    let acquiring = tokio::spawn({
        let store = store.clone();
        async move { store.acquire("s", "a", false).await.map(|mut lease| std::mem::take(&mut lease.session.messages)) }
    });
    // Wait until the acquire's statement waits for the row lock: it began
    // before the commit landed.
    until_a_statement_waits_for_a_lock(&url, "the acquire").await;
    commit.commit().await.unwrap();

    let history = acquiring.await.unwrap().expect("the session is free once the commit lands");
    assert_eq!(history, vec![Message::user_text("first"), Message::user_text("late")]);
}

/// Reading a conversation in pages, on both stores: every page is as full
/// as the message limit allows, even where the store's measure of a message
/// runs far ahead of its size on the wire (text that JSON escapes sixfold,
/// as PostgreSQL stores it), and the pages together are the conversation.
#[tokio::test(flavor = "multi_thread")]
async fn a_conversation_is_read_in_full_pages_on_both_stores() {
    const LIMIT: usize = 65536;
    let url = Cluster::shared().await.database().await;
    for store in ["memory", "postgres"] {
        let sessions = match store {
            "postgres" => format!("[sessions]\nstore = \"postgres\"\nurl_env = \"{URL_ENV}\"\n"),
            _ => "[sessions]\nstore = \"memory\"\n".to_owned(),
        };
        let config =
            format!("[server]\nmax_message_bytes = {LIMIT}\n{sessions}") + &cfg::agent("a", "") + &cfg::turn("ok", &[]);
        let lattice = Lattice::start_with_env(&config, &[(URL_ENV, &url)]).await;
        let mut session = None;
        for i in 0..8 {
            let opts = QueryOpts {
                agent: "a".into(),
                prompt: format!("{i}:{}", "\u{1}".repeat(12 * 1024)),
                session: session.clone(),
                no_model_requests: true,
                ..Default::default()
            };
            session = Some(lattice.query_with(opts).await.session_id());
        }
        let sid = session.unwrap();
        let mut pages = vec![lattice.session_page(&sid, 0, "").await.unwrap()];
        while let Some(token) = pages.last().map(|p| p.next_page_token.clone()).filter(|t| !t.is_empty()) {
            pages.push(lattice.session_page(&sid, 0, &token).await.unwrap());
            assert!(pages.len() <= 16, "{store}: the pages never end");
        }
        assert!(pages.len() > 1, "{store}: a conversation larger than the limit comes in pages");
        for (page, next) in pages.iter().zip(pages.iter().skip(1)) {
            assert!(prost::Message::encoded_len(page) <= LIMIT, "{store}");
            // Full: the next page's first message would not have fitted
            // (with the room the server keeps for the token).
            let first = &next.messages[0];
            let len = prost::Message::encoded_len(first);
            let cost = 1 + prost::encoding::encoded_len_varint(len as u64) + len;
            let without_token = pb::Session { next_page_token: String::new(), ..page.clone() };
            assert!(
                prost::Message::encoded_len(&without_token) + cost + 16 > LIMIT,
                "{store}: a page of {} messages had room for the next",
                page.messages.len()
            );
        }
        let messages: Vec<String> = pages.iter().flat_map(|p| p.messages.iter().map(message_text)).collect();
        let prompts: Vec<&str> = messages.iter().step_by(2).map(|t| &t[..2]).collect();
        assert_eq!(prompts, ["0:", "1:", "2:", "3:", "4:", "5:", "6:", "7:"], "{store}");
        assert!(messages.iter().skip(1).step_by(2).all(|t| t == "ok"), "{store}");
        assert!(pages.iter().all(|p| p.total_messages == 16 && p.agent == "a"), "{store}");
    }
}

/// A store reads the page asked for, on both stores: from where, how many
/// and how large; and no more of the conversation than that (in
/// PostgreSQL, a message past the page that could not be read does not
/// fail it).
#[tokio::test(flavor = "multi_thread")]
async fn a_store_reads_only_the_page_asked_for() {
    use lattice_server::{
        domain::Message,
        session::{MemoryStore, SessionStore, StoreError},
    };
    let url = Cluster::shared().await.database().await;
    let postgres = replica_store(&url, Duration::from_secs(15), 1 << 20);
    postgres.migrate().await.unwrap();
    let stores: [(&str, Box<dyn SessionStore>); 2] =
        [("memory", Box::new(MemoryStore::default())), ("postgres", Box::new(postgres))];
    let all: Vec<Message> = (0..6).map(|i| Message::user_text(format!("{i}{}", "x".repeat(999)))).collect();
    for (name, store) in &stores {
        let lease = store.acquire_as("s", "a", Some("alice"), true).await.unwrap();
        lease.commit(all.clone()).await.unwrap();
        let page = |from, most, bytes| store.page_as("s", Some("alice"), from, most, bytes);

        let middle = page(2, 3, usize::MAX).await.unwrap();
        assert_eq!((middle.agent.as_str(), middle.total), ("a", 6), "{name}");
        assert_eq!(middle.messages, all[2..5], "{name}");
        // Sized: the page ends with the message that reaches the size (by
        // the store's measure, a little over 1,000 bytes a message here).
        let one = all[0].size();
        assert_eq!(page(0, usize::MAX, 1).await.unwrap().messages, all[..1], "{name}");
        assert_eq!(page(0, usize::MAX, one + one / 2).await.unwrap().messages, all[..2], "{name}");
        assert_eq!(page(1, usize::MAX, 2 * one + one / 2).await.unwrap().messages, all[1..4], "{name}");
        assert_eq!(page(4, usize::MAX, usize::MAX).await.unwrap().messages, all[4..], "{name}");
        // Empty: nothing asked for, or past the end.
        assert!(page(0, 0, usize::MAX).await.unwrap().messages.is_empty(), "{name}");
        let past = page(9, usize::MAX, usize::MAX).await.unwrap();
        assert!(past.messages.is_empty() && past.total == 6, "{name}");
        // Another owner's session, or none, is not found.
        let theirs = store.page_as("s", Some("bob"), 0, usize::MAX, usize::MAX).await;
        assert_eq!(theirs.unwrap_err(), StoreError::NotFound, "{name}");
        let none = store.page_as("t", None, 0, usize::MAX, usize::MAX).await;
        assert_eq!(none.unwrap_err(), StoreError::NotFound, "{name}");
    }

    // A stored message past the page that no longer parses: the page
    // before it reads, the whole conversation does not.
    let client = connect(&url).await;
    client
        .execute("UPDATE lattice_messages SET message = 'not json' WHERE session_id = 's' AND seq = 5", &[])
        .await
        .unwrap();
    let postgres = &stores[1].1;
    assert_eq!(postgres.page_as("s", None, 0, 5, usize::MAX).await.unwrap().messages, all[..5]);
    assert_eq!(postgres.page_as("s", None, 0, usize::MAX, 2 * all[0].size()).await.unwrap().messages.len(), 2);
    assert_eq!(postgres.get("s").await.unwrap_err(), StoreError::Unavailable("postgres"));
}

/// Reading a session counts as using it, on both stores: one read again
/// and again within `idle_ttl_s` outlives it, and it expires once left
/// alone.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_read_within_its_idle_time_is_kept_on_both_stores() {
    let url = Cluster::shared().await.database().await;
    for store in ["memory", "postgres"] {
        let sessions = match store {
            "postgres" => format!("[sessions]\nstore = \"postgres\"\nurl_env = \"{URL_ENV}\"\nidle_ttl_s = 1\n"),
            _ => "[sessions]\nstore = \"memory\"\nidle_ttl_s = 1\n".to_owned(),
        };
        let config = sessions + &cfg::agent("a", "") + &cfg::turn("ok", &[]);
        let lattice = Lattice::start_with_env(&config, &[(URL_ENV, &url)]).await;
        let sid = lattice.query("a", "hi").await.session_id();
        let started = Instant::now();
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_millis(600)).await;
            let read = lattice.session(&sid).await;
            assert!(read.is_ok(), "{store}: read after {:?}: {:?}", started.elapsed(), read.err());
        }
        tokio::time::sleep(Duration::from_millis(1300)).await;
        assert_eq!(lattice.session(&sid).await.unwrap_err().code(), Code::NotFound, "{store}: left alone, it expires");
    }
}

/// A replica keeps the conversations it has read and written, and taking
/// a lease then reads only the messages committed since, whichever replica
/// committed them; a replica that keeps none reads them all. A session
/// deleted and made again under the same id is another conversation, read
/// afresh.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_reads_only_the_messages_committed_since_it_knew_the_conversation() {
    use lattice_server::{
        domain::Message,
        session::{SessionStore, StoreError},
    };
    let url = Cluster::shared().await.database().await;
    let replica = |cache| replica_store(&url, Duration::from_secs(15), cache);
    let (a, b, none) = (replica(1 << 20), replica(1 << 20), replica(0));
    a.migrate().await.unwrap();
    let m = |t: &str| Message::user_text(t);
    let texts = |messages: &[Message]| messages.iter().map(Message::text).collect::<Vec<_>>();

    a.acquire("s", "a", true).await.unwrap().commit(vec![m("1"), m("2")]).await.unwrap();
    let lease = b.acquire("s", "a", false).await.unwrap();
    assert_eq!(texts(&lease.session.messages), ["1", "2"]);
    lease.commit(vec![m("3"), m("4")]).await.unwrap();

    // The first message can no longer be read from the database: only a
    // replica that reads it again fails.
    let client = connect(&url).await;
    let spoil = "UPDATE lattice_messages SET message = 'not json' WHERE session_id = 's' AND seq = 0";
    client.execute(spoil, &[]).await.unwrap();
    let lease = a.acquire("s", "a", false).await.unwrap();
    assert_eq!(texts(&lease.session.messages), ["1", "2", "3", "4"], "A read B's two");
    lease.commit(vec![m("5")]).await.unwrap();
    let lease = b.acquire("s", "a", false).await.unwrap();
    assert_eq!(texts(&lease.session.messages), ["1", "2", "3", "4", "5"], "B read A's one");
    lease.release().await;
    assert_eq!(none.acquire("s", "a", false).await.unwrap_err(), StoreError::Unavailable("postgres"));

    // Deleted (by a replica other than A) and made again under the same
    // id, longer than A knew the old one.
    none.delete("s").await.unwrap();
    let new: Vec<String> = (1..=6).map(|i| format!("new {i}")).collect();
    let lease = none.acquire("s", "a", true).await.unwrap();
    lease.commit(new.iter().map(|t| m(t)).collect()).await.unwrap();
    let lease = a.acquire("s", "a", false).await.unwrap();
    assert_eq!(texts(&lease.session.messages), new, "A read the new session, not what it knew of the old");
    lease.commit(vec![m("again")]).await.unwrap();
    let lease = b.acquire("s", "a", false).await.unwrap();
    assert_eq!(texts(&lease.session.messages)[5..], ["new 6", "again"]);
}

/// `history_cache_mib` belongs to the PostgreSQL store: with the memory
/// store (which holds every conversation anyway) it is refused, at its
/// line.
#[tokio::test(flavor = "multi_thread")]
async fn a_history_cache_is_refused_for_the_memory_store() {
    let config = "[sessions]\nstore = \"memory\"\nhistory_cache_mib = 8\n".to_owned() + &cfg::agent("a", "");
    let err = Lattice::try_start(&config).await.err().expect("refused");
    assert!(err.contains("sessions.history_cache_mib: only the postgres store keeps a cache"), "{err}");
    assert!(err.contains("test.toml:3"), "{err}");
}

/// `/metrics` counts how each lease read its history (only the messages
/// new to the replica, or the whole conversation) and shows what the
/// replica keeps; a replica that keeps none reads every history whole.
#[tokio::test(flavor = "multi_thread")]
async fn metrics_count_history_reads_by_how_much_was_read() {
    let url = Cluster::shared().await.database().await;
    let env = [(URL_ENV, url.as_str())];
    let kept = Lattice::start_with_env(&config(0, ""), &env).await;
    let none = Lattice::start_with_env(&config(0, "history_cache_mib = 0"), &env).await;
    let sid = kept.query("a", "one").await.session_id();
    kept.query_with(continue_(&sid, "two")).await.expect_ok();
    none.query_with(continue_(&sid, "three")).await.expect_ok();
    // Knows four of the six messages: reads the other two.
    assert_eq!(kept.query_with(continue_(&sid, "four")).await.expect_ok().text, "seen 7");

    let sample = |text: &str, series: &str| -> Option<f64> {
        text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    };
    let reads = |how: &str| format!("lattice_session_history_reads_total{{read=\"{how}\"}}");
    let text = kept.metrics().await;
    assert_eq!(sample(&text, &reads("new_only")), Some(2.0), "{text}");
    assert_eq!(sample(&text, &reads("whole")), Some(0.0), "{text}");
    let held = sample(&text, "lattice_session_history_cache_bytes").unwrap_or_default();
    assert!(held > 0.0, "{text}");
    let text = none.metrics().await;
    assert_eq!(sample(&text, &reads("new_only")), Some(0.0), "{text}");
    assert_eq!(sample(&text, &reads("whole")), Some(1.0), "{text}");
    assert_eq!(sample(&text, "lattice_session_history_cache_bytes"), None, "{text}");
}

/// Every query updates its session row twice (the lease, the commit).
/// Those updates stay on the row's page and write no index entry
/// (PostgreSQL's HOT updates), so a busy session does not bloat the
/// table's indexes; and the sweep still finds exactly the idle sessions.
#[tokio::test(flavor = "multi_thread")]
async fn session_row_updates_stay_on_their_page_and_idle_sessions_are_swept() {
    use lattice_server::{domain::Message, session::SessionStore};
    let url = Cluster::shared().await.database().await;
    let store = replica_store(&url, Duration::from_secs(15), 1 << 20);
    store.migrate().await.unwrap();
    store.acquire("busy", "a", true).await.unwrap().commit(vec![Message::user_text("0")]).await.unwrap();
    for i in 0..100 {
        let lease = store.acquire("busy", "a", false).await.unwrap();
        lease.commit(vec![Message::user_text(i.to_string())]).await.unwrap();
    }
    let client = connect(&url).await;
    // The server publishes its counters within seconds.
    let stats = "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'lattice_sessions'";
    let started = Instant::now();
    let (updates, hot) = loop {
        let row = client.query_one(stats, &[]).await.unwrap();
        let (updates, hot): (i64, i64) = (row.get(0), row.get(1));
        if updates >= 200 || started.elapsed() > Duration::from_secs(30) {
            break (updates, hot);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert!(updates >= 200, "the server counted {updates} updates of 200");
    // A minute's turn moves the sweep's index: a few updates may not be HOT.
    assert!(hot * 10 >= updates * 9, "{hot} of {updates} updates stayed on their page");

    // Idle for two hours (as the sweep's index knows it too), and fresh.
    store.acquire("idle", "a", true).await.unwrap().commit(vec![Message::user_text("x")]).await.unwrap();
    idle_for_two_hours(&client, "idle").await;
    assert_eq!(store.sweep().await.unwrap(), 1);
    let left: Vec<String> =
        client.query("SELECT id FROM lattice_sessions", &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(left, ["busy"]);
}

/// A session's messages go with it, deleted or swept, on a database
/// migrated from schema version 5 (whose messages referenced their session
/// with a foreign key) as on a new one; a commit's inserts fire no
/// per-message check; and a session deleted while a commit of its lapsed
/// lease lands leaves no message behind, whichever goes first.
#[tokio::test(flavor = "multi_thread")]
async fn a_sessions_messages_go_with_it_and_a_commit_checks_none_of_them() {
    use lattice_server::{domain::Message, session::SessionStore};
    let url = Cluster::shared().await.database().await;
    let store = replica_store(&url, Duration::from_secs(15), 0);
    assert_eq!(store.migrate_to(5).await.unwrap(), [1, 2, 3, 4, 5]);
    for id in ["deleted", "swept", "kept"] {
        store.acquire(id, "a", true).await.unwrap().commit(vec![Message::user_text(id)]).await.unwrap();
        let lease = store.acquire(id, "a", false).await.unwrap();
        lease.commit(vec![Message::user_text("more"), Message::user_text("still more")]).await.unwrap();
    }
    assert_eq!(store.migrate().await.unwrap(), [6]);
    let client = connect(&url).await;
    let messages = |id: &'static str| {
        let client = &client;
        async move {
            let row = client.query_one("SELECT count(*) FROM lattice_messages WHERE session_id = $1", &[&id]).await;
            row.unwrap().get::<_, i64>(0)
        }
    };
    assert_eq!((messages("deleted").await, messages("swept").await, messages("kept").await), (3, 3, 3));
    assert_eq!(store.get("kept").await.unwrap().messages.len(), 3, "migrated, the conversation reads whole");

    let triggers = "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'lattice_messages'::regclass";
    assert_eq!(client.query_one(triggers, &[]).await.unwrap().get::<_, i64>(0), 0, "nothing runs per message");

    store.delete("deleted").await.unwrap();
    idle_for_two_hours(&client, "swept").await;
    assert_eq!(store.sweep().await.unwrap(), 1);
    assert_eq!((messages("deleted").await, messages("swept").await, messages("kept").await), (0, 0, 3));

    // A lease that lapsed (another replica may delete the session then)
    // and its commit, racing a delete: the commit lands and the delete
    // finds the lease given back, or the delete goes first and the commit
    // finds no session; never messages without their session.
    let (mut landed, mut deleted_first) = (0, 0);
    for i in 0..40 {
        let id = format!("race-{i}");
        store.acquire(&id, "a", true).await.unwrap().commit(vec![Message::user_text("first")]).await.unwrap();
        let lease = store.acquire(&id, "a", false).await.unwrap();
        client
            .execute("UPDATE lattice_sessions SET lease_expires = now() - interval '1 second' WHERE id = $1", &[&id])
            .await
            .unwrap();
        let (commit, delete) = (lease.commit(vec![Message::user_text("second")]), store.delete(&id));
        let (committed, deleted) = tokio::join!(commit, delete);
        match (committed, deleted) {
            (Ok(()), _) => landed += 1,
            (Err(_), Ok(())) => deleted_first += 1,
            (Err(c), Err(d)) => panic!("both failed: {c:?}, {d:?}"),
        }
        let _ = store.delete(&id).await;
    }
    let orphans = "SELECT count(*) FROM lattice_messages m
                   WHERE NOT EXISTS (SELECT 1 FROM lattice_sessions s WHERE s.id = m.session_id)";
    assert_eq!(
        client.query_one(orphans, &[]).await.unwrap().get::<_, i64>(0),
        0,
        "{landed} landed, {deleted_first} deleted first"
    );
}

/// Session `id` last touched two hours ago, as the sweep's index knows it
/// too.
async fn idle_for_two_hours(client: &tokio_postgres::Client, id: &str) {
    let idle = "UPDATE lattice_sessions SET touched_at = now() - interval '2 hours',
                touched_minute = date_trunc('minute', now() - interval '2 hours') WHERE id = $1";
    client.execute(idle, &[&id]).await.unwrap();
}

/// `keep_lease_ms` belongs to the PostgreSQL store, and must be shorter
/// than the idle time (a kept lease would outlive its session): refused
/// otherwise, at its line.
#[tokio::test(flavor = "multi_thread")]
async fn keep_lease_ms_is_refused_where_it_cannot_work() {
    let config = "[sessions]\nstore = \"memory\"\nkeep_lease_ms = 1000\n".to_owned() + &cfg::agent("a", "");
    let err = Lattice::try_start(&config).await.err().expect("refused");
    assert!(err.contains("sessions.keep_lease_ms: only the postgres store keeps leases"), "{err}");
    assert!(err.contains("test.toml:3"), "{err}");
    let config =
        "[sessions]\nstore = \"postgres\"\nidle_ttl_s = 60\nkeep_lease_ms = 60000\n".to_owned() + &cfg::agent("a", "");
    let err =
        Lattice::try_start_with_env(&config, &[(URL_ENV, "postgres://u@127.0.0.1:1/d")]).await.err().expect("refused");
    assert!(err.contains("sessions.keep_lease_ms: must be shorter than sessions.idle_ttl_s"), "{err}");
}

/// The updates of the session rows of the database at `url` so far, once
/// PostgreSQL's statistics stop moving (a server process sends its own
/// when it ends, else up to 10 s late).
async fn session_row_updates(url: &str) -> i64 {
    let client = connect(url).await;
    let (mut last, mut since) = (-1, Instant::now());
    let give_up = Instant::now() + Duration::from_secs(15);
    loop {
        // (A statement of its own: statistics are read once per transaction.)
        let row = client
            .query_one("SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = 'lattice_sessions'", &[])
            .await
            .unwrap();
        let now: i64 = row.get(0);
        if now != last {
            (last, since) = (now, Instant::now());
        } else if since.elapsed() > Duration::from_millis(2500) || Instant::now() > give_up {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A replica that keeps leases serves a session's next queries with one
/// write each, the commit, where taking the lease is a second: counted in
/// `/metrics` (`read="kept"`) and seen by the database, whose session row
/// is updated once a query.
#[tokio::test(flavor = "multi_thread")]
async fn a_kept_lease_serves_the_sessions_next_queries_with_one_write_each() {
    let url = Cluster::shared().await.database().await;
    let mut lattice = Lattice::spawn(&config(0, KEEP), &[(URL_ENV, &url)]).await;
    let sid = lattice.query("a", "one").await.session_id();
    for (i, prompt) in ["two", "three", "four"].into_iter().enumerate() {
        let out = lattice.query_with(continue_(&sid, prompt)).await;
        assert_eq!(out.expect_ok().text, format!("seen {}", 3 + 2 * i));
    }
    let texts: Vec<String> = lattice.session(&sid).await.unwrap().messages.iter().map(message_text).collect();
    assert_eq!(texts, ["one", "seen 1", "two", "seen 3", "three", "seen 5", "four", "seen 7"]);
    let text = lattice.metrics().await;
    let reads = |how: &str| format!("lattice_session_history_reads_total{{read=\"{how}\"}}");
    assert_eq!(sample(&text, &reads("kept")), Some(3.0), "{text}");
    assert_eq!(sample(&text, &reads("new_only")), Some(0.0), "{text}");
    // Stopped, so that its connections end and their statistics are sent.
    lattice.signal("TERM");
    assert!(lattice.exited(Duration::from_secs(15)).await, "did not stop");
    // Created by an insert, then four commits and the lease given back at
    // shutdown; taking the lease would have added three updates.
    assert_eq!(session_row_updates(&url).await, 5);
}

/// A replica shutting down gives back the leases it keeps, so the
/// sessions' next queries, on another replica, are served at once (the
/// lease would last 3 s, past the 1 s a query waits for a handover). A
/// replica that crashes (SIGKILL) cannot: its sessions are busy until
/// their leases expire, as a session is whose query it was running.
#[tokio::test(flavor = "multi_thread")]
async fn kept_leases_are_given_back_at_shutdown_and_expire_after_a_crash() {
    let config = config(0, &format!("{KEEP}\nlease_ttl_ms = 3000"));
    let url = Cluster::shared().await.database().await;
    let env = [(URL_ENV, url.as_str())];
    let mut a = Lattice::spawn(&config, &env).await;
    let mut b = Lattice::spawn(&config, &env).await;
    let kept_by_a = a.query("a", "one").await.session_id();
    a.signal("TERM");
    assert!(a.exited(Duration::from_secs(15)).await, "A did not stop");
    assert_eq!(b.query_with(continue_(&kept_by_a, "two")).await.expect_ok().text, "seen 3");

    let kept_by_b = b.query("a", "one").await.session_id();
    b.kill();
    let killed = Instant::now();
    let c = Lattice::spawn(&config, &env).await;
    let mut refused = 0;
    let out = loop {
        let asked = Instant::now();
        let out = c.query_with(continue_(&kept_by_b, "two")).await;
        match out.code() {
            Code::FailedPrecondition => refused += 1,
            _ => break out,
        }
        // Refused after waiting for a handover nobody makes: a second.
        if refused == 1 {
            let took = asked.elapsed();
            assert!(took >= Duration::from_millis(900) && took < Duration::from_millis(2500), "refused after {took:?}");
        }
        assert!(killed.elapsed() < Duration::from_secs(15), "the lease never expired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(out.expect_ok().text, "seen 3");
    assert!(refused > 0, "the session should have been held until the lease expired");
    assert!(killed.elapsed() >= Duration::from_secs(2), "served after {:?}", killed.elapsed());
}

/// An unused kept lease is renewed, every third of `lease_ttl_ms`: after
/// more than twice its time to live, the session's next query on the
/// replica still uses it (one the replica had not renewed would be stale
/// and given back, and the query would take a lease anew).
#[tokio::test(flavor = "multi_thread")]
async fn an_unused_kept_lease_is_renewed() {
    let url = Cluster::shared().await.database().await;
    let config = config(0, &format!("{KEEP}\nlease_ttl_ms = 900"));
    let lattice = Lattice::start_with_env(&config, &[(URL_ENV, &url)]).await;
    let sid = lattice.query("a", "one").await.session_id();
    tokio::time::sleep(Duration::from_millis(2000)).await;
    assert_eq!(lattice.query_with(continue_(&sid, "two")).await.expect_ok().text, "seen 3");
    let text = lattice.metrics().await;
    assert_eq!(sample(&text, "lattice_session_history_reads_total{read=\"kept\"}"), Some(1.0), "{text}");
}

/// The commit statements a replica sent so far: alone, grouped, and the
/// commits the grouped ones carried.
async fn commit_statements(lattice: &Lattice) -> [f64; 3] {
    let text = lattice.metrics().await;
    let statements = |sent: &str| format!("lattice_session_commit_statements_total{{sent=\"{sent}\"}}");
    [statements("alone"), statements("grouped"), "lattice_session_grouped_commits_total".into()]
        .map(|series| sample(&text, &series).unwrap_or_else(|| panic!("no {series} in {text}")))
}

/// A replica on a fresh database, with `[sessions]` keys [`UNPIPELINED`]
/// and `extra`, and 16 sessions opened on it, session `c` with the prompt
/// "cN open": the database's URL, the replica, the sessions.
async fn sixteen_sessions(extra: &str) -> (String, Arc<Lattice>, Vec<String>) {
    let url = Cluster::shared().await.database().await;
    let keys = format!("{UNPIPELINED}\n{extra}");
    let lattice = Arc::new(Lattice::spawn(&config(0, &keys), &[(URL_ENV, &url)]).await);
    let mut sessions = Vec::new();
    for c in 0..16 {
        sessions.push(lattice.query("a", &format!("c{c} open")).await.session_id());
    }
    (url, lattice, sessions)
}

/// Each session's prompts, as stored.
async fn stored_prompts(lattice: &Lattice, sessions: &[String]) -> Vec<Vec<String>> {
    let mut all = Vec::new();
    for sid in sessions {
        let stored = lattice.session(sid).await.unwrap();
        all.push(stored.messages.iter().step_by(2).map(message_text).collect());
    }
    all
}

/// A replica's `[sessions]` keys for [`behind_a_lock`]: each statement on
/// a connection of its own, so that a commit waiting on the lock holds up
/// no other query's lease statement behind it.
const UNPIPELINED: &str = "pipeline_connections = 0\npool_size = 32";

/// The next queries of `sessions` (prompts `prompt(c)`), started while
/// the messages table is locked (a database slow to answer), so that each
/// one's commit waits on it: the first two, on their own and a moment
/// apart, are the two statements on their way; the rest queue behind
/// them, the last one after the others. The lock is released once they
/// all wait, or, with `queued_timeout`, once the queued ones (sent with
/// that timeout) have ended. The outcomes, in order.
async fn behind_a_lock(
    lattice: &Arc<Lattice>,
    url: &str,
    sessions: &[String],
    prompt: impl Fn(usize) -> String,
    queued_timeout: Option<Duration>,
) -> Vec<lattice_tests::Outcome> {
    let admin = connect(url).await;
    admin.batch_execute("BEGIN; LOCK TABLE lattice_messages IN EXCLUSIVE MODE").await.unwrap();
    let last = sessions.len() - 1;
    let mut queries = Vec::new();
    for (c, sid) in sessions.iter().enumerate() {
        if c < 3 || c == last {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let timeout = queued_timeout.filter(|_| c >= 2);
        let (lattice, opts) = (lattice.clone(), QueryOpts { timeout, ..continue_(sid, &prompt(c)) });
        queries.push(tokio::spawn(async move { lattice.query_with(opts).await }));
    }
    if queued_timeout.is_none() {
        tokio::time::sleep(Duration::from_millis(500)).await;
        admin.batch_execute("COMMIT").await.unwrap();
    }
    let mut outcomes = Vec::new();
    let mut queries = queries.into_iter();
    let first_two: Vec<_> = queries.by_ref().take(2).collect();
    for q in queries {
        outcomes.push(q.await.unwrap());
    }
    if queued_timeout.is_some() {
        // Their clients may have given up first (their own timer, on
        // `grpc-timeout`): the lock goes once Lattice has ended them too,
        // so that none is still waiting to be sent when it goes.
        let in_flight = "lattice_queries_in_flight";
        let ended = Instant::now();
        while sample(&lattice.metrics().await, in_flight) != Some(2.0) {
            assert!(ended.elapsed() < Duration::from_secs(5), "{}", lattice.metrics().await);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        admin.batch_execute("COMMIT").await.unwrap();
    }
    let mut first = Vec::new();
    for q in first_two {
        first.push(q.await.unwrap());
    }
    first.into_iter().chain(outcomes).collect()
}

/// Commits that wait at the same time go to the database together. With
/// the messages table locked (a database slow to answer), the commits of
/// 16 queries queue behind the two statements already on their way (each
/// waiting on the lock); once it is released, the rest go as one
/// statement. Every turn is stored once, in order.
#[tokio::test(flavor = "multi_thread")]
async fn commits_waiting_at_the_same_time_go_in_one_statement() {
    let (url, lattice, sessions) = sixteen_sessions("").await;
    let before = commit_statements(&lattice).await;
    let next = |c: usize| format!("c{c} next");
    for out in behind_a_lock(&lattice, &url, &sessions, next, None).await {
        out.expect_ok();
    }
    let after = commit_statements(&lattice).await;
    let sent = [0, 1, 2].map(|i| after[i] - before[i]);
    assert_eq!(sent, [2.0, 1.0, 14.0], "statements alone, grouped, and the commits grouped");
    for (c, prompts) in stored_prompts(&lattice, &sessions).await.iter().enumerate() {
        assert_eq!(prompts, &[format!("c{c} open"), format!("c{c} next")], "session {c}");
    }
}

/// A commit the database refuses fails only its own query, though it was
/// grouped with others. A trigger refuses any message saying "refuse me";
/// the statement carrying that commit and 14 others is refused whole
/// (nothing written), and each is sent again alone: 15 land, and the one
/// refused is UNAVAILABLE and stores nothing. With leases kept, so that
/// grouped commits keep theirs too: each session's next query uses its
/// kept lease.
#[tokio::test(flavor = "multi_thread")]
async fn a_commit_refused_in_a_group_fails_only_its_own_query() {
    let (url, lattice, sessions) = sixteen_sessions(KEEP).await;
    let admin = connect(&url).await;
    admin
        .batch_execute(
            "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN IF NEW.message LIKE '%refuse me%' THEN RAISE EXCEPTION 'refused'; END IF; RETURN NEW; END $$;
             CREATE TRIGGER refuse BEFORE INSERT ON lattice_messages FOR EACH ROW EXECUTE FUNCTION refuse();",
        )
        .await
        .unwrap();
    let before = commit_statements(&lattice).await;
    let prompt = |c: usize| if c == 15 { "c15 refuse me".to_owned() } else { format!("c{c} next") };
    for (c, out) in behind_a_lock(&lattice, &url, &sessions, prompt, None).await.into_iter().enumerate() {
        match c {
            15 => assert_eq!(out.code(), Code::Unavailable, "{:?}", out.status),
            _ => assert_eq!(out.expect_ok().text, "seen 3"),
        }
    }
    let after = commit_statements(&lattice).await;
    let sent = [0, 1, 2].map(|i| after[i] - before[i]);
    // The two first alone; the group refused, and its 14 commits again,
    // each alone.
    assert_eq!(sent, [16.0, 1.0, 14.0], "statements alone, grouped, and the commits grouped");
    for (c, prompts) in stored_prompts(&lattice, &sessions).await.iter().enumerate() {
        let expected: Vec<String> = match c {
            15 => vec!["c15 open".into()],
            _ => vec![format!("c{c} open"), prompt(c)],
        };
        assert_eq!(prompts, &expected, "session {c}");
    }
    let text = lattice.metrics().await;
    assert_eq!(sample(&text, "lattice_session_history_reads_total{read=\"kept\"}"), Some(16.0), "{text}");
}

/// A commit still waiting for its statement when its query's deadline
/// comes is taken back: DEADLINE_EXCEEDED, nothing written. The two
/// statements on their way wait on a locked table past those deadlines,
/// then land.
#[tokio::test(flavor = "multi_thread")]
async fn a_commit_waiting_for_its_statement_past_its_deadline_is_not_sent() {
    let (url, lattice, sessions) = sixteen_sessions("").await;
    let before = commit_statements(&lattice).await;
    let next = |c: usize| format!("c{c} next");
    let outcomes = behind_a_lock(&lattice, &url, &sessions, next, Some(Duration::from_millis(1000))).await;
    for (c, out) in outcomes.iter().enumerate() {
        match c {
            0 | 1 => assert_eq!(out.code(), Code::Ok, "{c}: {:?}", out.status),
            _ => {
                // Nothing of these queries has reached their client (their
                // events leave with their end): the client's own timer
                // (tonic's, on `grpc-timeout`, until the response's
                // headers) may tell it first. Lattice's count below says
                // how Lattice ended them.
                let code = out.code();
                assert!(matches!(code, Code::DeadlineExceeded | Code::Cancelled), "{c}: {:?}", out.status);
                assert!(out.elapsed < Duration::from_millis(1500), "{c} took {:?}", out.elapsed);
            }
        }
    }
    let text = lattice.metrics().await;
    let deadline_exceeded = "lattice_queries_total{agent=\"a\",code=\"DEADLINE_EXCEEDED\"}";
    assert_eq!(sample(&text, deadline_exceeded), Some(14.0), "{text}");
    let after = commit_statements(&lattice).await;
    assert_eq!([0, 1, 2].map(|i| after[i] - before[i]), [2.0, 0.0, 0.0], "statements alone, grouped, carried");
    for (c, prompts) in stored_prompts(&lattice, &sessions).await.iter().enumerate() {
        let expected: Vec<String> = match c {
            0 | 1 => vec![format!("c{c} open"), next(c)],
            _ => vec![format!("c{c} open")],
        };
        assert_eq!(prompts, &expected, "session {c}");
    }
}

/// `server.busy_poll_us` covers a query's statements to the session store
/// as it covers its hook and tool calls: while one is on its way, `lattice
/// serve` polls for the answer instead of sleeping. Here each query's
/// lease statement waits on a lock (the sessions table held by another
/// transaction), a new one every 25 ms, and there is no hook or tool: the
/// poller's turns (`lattice_busy_poll_turns_total`) are the store's. Each
/// waiting statement wakes it at least once; with nothing in flight it
/// takes none. Once the lock goes, every query ends OK.
#[tokio::test(flavor = "multi_thread")]
async fn busy_polling_covers_the_store_statements() {
    const QUERIES: usize = 20;
    let url = Cluster::shared().await.database().await;
    let config = "[server]\nworker_threads = 1\nbusy_poll_us = 10000\n".to_owned() + &config(0, UNPIPELINED);
    let lattice = Arc::new(Lattice::spawn(&config, &[(URL_ENV, &url)]).await);
    let turns = || async { sample(&lattice.metrics().await, "lattice_busy_poll_turns_total").expect("the metric") };
    let mut sessions = Vec::new();
    for c in 0..QUERIES {
        sessions.push(lattice.query("a", &format!("c{c} open")).await.session_id());
    }
    // Nothing in flight: the poller waits.
    let before = turns().await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(turns().await, before, "no call in flight, yet the poller turned");

    let admin = connect(&url).await;
    admin.batch_execute("BEGIN; LOCK TABLE lattice_sessions IN EXCLUSIVE MODE").await.unwrap();
    let mut queries = Vec::new();
    let mut woken = 0;
    for sid in &sessions {
        let before = turns().await;
        let (lattice, opts) = (lattice.clone(), continue_(sid, "next"));
        queries.push(tokio::spawn(async move { lattice.query_with(opts).await }));
        tokio::time::sleep(Duration::from_millis(25)).await;
        woken += usize::from(turns().await > before);
    }
    admin.batch_execute("COMMIT").await.unwrap();
    for q in queries {
        assert_eq!(q.await.unwrap().expect_ok().turns, 1);
    }
    assert_eq!(woken, QUERIES, "statements waiting that woke the poller");
}
