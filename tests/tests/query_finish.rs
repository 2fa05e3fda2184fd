//! A query's last events leave with its result, once its turn is stored:
//! while the commit waits for PostgreSQL, nothing of the query reaches its
//! client; then its final reply and its result arrive together.

use std::time::{Duration, Instant};

use lattice_proto::agent::v1::{self as pb, query_event::Event};
use lattice_tests::{
    Lattice, cfg, message_text,
    postgres::{Cluster, connect, until_a_statement_waits_for_a_lock},
};
use tokio::sync::mpsc;

const URL_ENV: &str = "LATTICE_POSTGRES_URL";

#[tokio::test(flavor = "multi_thread")]
async fn the_final_reply_and_the_result_leave_together_once_stored() {
    the_final_reply_and_the_result_leave_together_once_stored_("").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_final_reply_and_the_result_leave_together_once_stored_with_kept_leases() {
    the_final_reply_and_the_result_leave_together_once_stored_("keep_lease_ms = 30000").await;
}

async fn the_final_reply_and_the_result_leave_together_once_stored_(extra: &str) {
    let url = Cluster::shared().await.database().await;
    let config = format!("[sessions]\nstore = \"postgres\"\nurl_env = \"{URL_ENV}\"\n{extra}\n")
        + &cfg::agent("a", "")
        + &cfg::turn("done", &[]);
    let lattice = Lattice::spawn(&config, &[(URL_ENV, &url)]).await;
    let session = lattice.query("a", "open").await.session_id();

    // The next commit waits: the test holds a lock that its insert of the
    // new messages conflicts with (taking the lease does not).
    let mut admin = connect(&url).await;
    let lock = admin.transaction().await.unwrap();
    lock.batch_execute("LOCK TABLE lattice_messages IN SHARE MODE").await.unwrap();

    let (seen_tx, mut seen) = mpsc::unbounded_channel::<(&'static str, Instant)>();
    let mut client = lattice.client().await;
    let request = pb::QueryRequest {
        agent: "a".into(),
        session_id: Some(session.clone()),
        prompt: "next".into(),
        ..Default::default()
    };
    let query = tokio::spawn(async move {
        let mut stream = client.query(request).await?.into_inner();
        let _ = seen_tx.send(("headers", Instant::now()));
        while let Some(event) = stream.message().await? {
            let name = match event.event {
                Some(Event::Started(_)) => "started",
                Some(Event::Assistant(_)) => "assistant",
                Some(Event::Result(_)) => "result",
                _ => "other",
            };
            let _ = seen_tx.send((name, Instant::now()));
        }
        Ok::<_, tonic::Status>(())
    });

    // The commit's statement waits for the lock…
    until_a_statement_waits_for_a_lock(&url, "the commit").await;
    // …and meanwhile nothing of the query reaches the client: not its
    // final reply, not even the response's headers.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let early: Vec<_> = std::iter::from_fn(|| seen.try_recv().ok()).map(|(name, _)| name).collect();
    assert!(early.is_empty(), "reached the client while its turn was not stored: {early:?}");

    let unlocked = Instant::now();
    lock.rollback().await.unwrap();
    query.await.unwrap().expect("the query succeeds once its commit lands");
    let arrived: Vec<_> = std::iter::from_fn(|| seen.try_recv().ok()).collect();
    let names: Vec<_> = arrived.iter().map(|(name, _)| *name).collect();
    assert_eq!(names, ["headers", "started", "assistant", "result"]);
    assert!(arrived.iter().all(|(_, at)| *at >= unlocked), "every event arrived after the commit could land");

    // Stored, once.
    let stored = lattice.session(&session).await.unwrap();
    let texts: Vec<_> = stored.messages.iter().map(message_text).collect();
    assert_eq!(texts, ["open", "done", "next", "done"]);
}
