//! Group commit: the commits of queries on different sessions that wait
//! at the same time go to the database as one statement.
//!
//! PostgreSQL spends more on a statement (its round trip, its transaction,
//! its WAL record of the commit) than on the rows it writes: one statement
//! carrying eight sessions' commits costs it about a quarter of what eight
//! statements do. Nothing waits to gather a group: a commit goes at once
//! when fewer than [`IN_FLIGHT`] statements are on their way, and those
//! that arrive meanwhile go together in the next one. With one query at a
//! time, every commit goes alone, as before.
//!
//! Each session's row keeps its own checks (the lease's token and the
//! version it read), so in one statement some commits may land and others
//! find their lease gone, each answered as if sent alone, and each keeps
//! its own token for the read-back of a lost reply. A statement the
//! database refuses writes nothing (its transaction rolls back); its
//! commits are then sent again one by one, so that one session's row can
//! fail only its own query.
//!
//! A commit still waiting for its turn when its query's deadline comes is
//! taken back: nothing was sent, so the query knows nothing was written.

use std::{
    mem,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
};

use futures_util::future::join_all;
use tokio::{sync::oneshot, time::Instant};
use tokio_postgres::types::Type;

use super::{
    PostgresStore,
    conn::{Param, db},
};

/// Statements of grouped commits on their way at once.
const IN_FLIGHT: usize = 2;
/// Commits in one statement, at most.
const MAX_COMMITS: usize = 64;
/// The stored text of one statement's commits, at most (a larger commit
/// goes alone).
const MAX_BYTES: usize = 1 << 20;

/// What became of a commit statement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Sent {
    /// It ran and committed, and kept the lease under its new token (not
    /// if another replica had asked for it).
    Committed { kept: bool },
    /// It ran and found the lease gone (expired and taken over): nothing
    /// was written.
    LeaseGone,
    /// It was not sent (no connection), or the server refused it (its
    /// transaction rolled back): nothing was written.
    NotWritten,
    /// It was sent and no answer came (a reset, a failover): it may have
    /// landed.
    Unknown,
}

/// One session's commit.
#[derive(Debug)]
pub(super) struct Commit {
    pub(super) id: String,
    /// The lease's token, which the commit also records (read back when
    /// its reply is lost).
    pub(super) token: uuid::Uuid,
    /// The version the lease read.
    pub(super) version: i64,
    /// The new messages, as stored.
    pub(super) rows: Vec<String>,
    /// The token to keep the lease under, if kept.
    pub(super) keep: Option<uuid::Uuid>,
    /// When its query stops waiting.
    pub(super) until: Instant,
}

impl Commit {
    fn bytes(&self) -> usize {
        self.rows.iter().map(String::len).sum()
    }
}

/// A commit waiting for its statement, and where its answer goes.
#[derive(Debug)]
struct Waiting {
    commit: Commit,
    answer: oneshot::Sender<Sent>,
}

/// The commits waiting, and the statements on their way.
#[derive(Debug, Default)]
struct Queue {
    waiting: Vec<Waiting>,
    flying: usize,
}

impl Queue {
    /// The next statement's commits: those waiting, in order, up to
    /// [`MAX_COMMITS`] and [`MAX_BYTES`] (the first always).
    fn take(&mut self) -> Vec<Waiting> {
        let (mut n, mut bytes) = (0, 0);
        for w in &self.waiting {
            bytes += w.commit.bytes();
            if n == MAX_COMMITS || (n > 0 && bytes > MAX_BYTES) {
                break;
            }
            n += 1;
        }
        let rest = self.waiting.split_off(n);
        mem::replace(&mut self.waiting, rest)
    }

    /// Takes back the commit under `token`, if it is still waiting.
    fn withdraw(&mut self, token: uuid::Uuid) -> bool {
        let before = self.waiting.len();
        self.waiting.retain(|w| w.commit.token != token);
        self.waiting.len() < before
    }
}

/// The store's commits on their way to the database.
#[derive(Debug, Default)]
pub(super) struct Group {
    queue: Mutex<Queue>,
    /// Commit statements sent with one commit, and with several; and the
    /// commits those carried.
    pub(super) alone: Arc<AtomicUsize>,
    pub(super) grouped: Arc<AtomicUsize>,
    pub(super) grouped_commits: Arc<AtomicUsize>,
}

/// A commit handed to the group: its answer comes when its statement's
/// does.
pub(super) struct Ticket {
    pub(super) answer: oneshot::Receiver<Sent>,
    token: uuid::Uuid,
}

impl Ticket {
    /// Takes the commit back if it has not been sent: true when nothing
    /// was (or will be) sent.
    pub(super) fn withdraw(&self, store: &PostgresStore) -> bool {
        crate::sync::lock(&store.group.queue).withdraw(self.token)
    }
}

impl PostgresStore {
    /// Hands `commit` to the group; a statement leaves at once if fewer
    /// than [`IN_FLIGHT`] are on their way.
    pub(super) fn send_commit(&self, commit: Commit) -> Ticket {
        let (tx, answer) = oneshot::channel();
        let token = commit.token;
        let mut queue = crate::sync::lock(&self.group.queue);
        queue.waiting.push(Waiting { commit, answer: tx });
        if queue.flying < IN_FLIGHT {
            queue.flying += 1;
            drop(queue);
            let store = self.clone();
            tokio::spawn(async move { store.fly().await });
        }
        Ticket { answer, token }
    }

    /// Sends statements until no commit waits.
    async fn fly(&self) {
        loop {
            let batch = {
                let mut queue = crate::sync::lock(&self.group.queue);
                if queue.waiting.is_empty() {
                    queue.flying -= 1;
                    return;
                }
                queue.take()
            };
            self.send_batch(batch).await;
        }
    }

    /// One statement for `batch`, each commit answered: past the last of
    /// their deadlines nobody waits, and the statement, cut off, is
    /// answered as sent without an answer.
    async fn send_batch(&self, batch: Vec<Waiting>) {
        let Some(until) = batch.iter().map(|w| w.commit.until).max() else { return };
        if let [one] = &batch[..] {
            self.group.alone.fetch_add(1, Ordering::Relaxed);
            // Cut off: sent, and no answer.
            let sent = tokio::time::timeout_at(until, self.commit_one(&one.commit)).await.unwrap_or(Sent::Unknown);
            for w in batch {
                let _ = w.answer.send(sent);
            }
            return;
        }
        self.group.grouped.fetch_add(1, Ordering::Relaxed);
        self.group.grouped_commits.fetch_add(batch.len(), Ordering::Relaxed);
        let commits: Vec<&Commit> = batch.iter().map(|w| &w.commit).collect();
        let answers = match tokio::time::timeout_at(until, self.commit_many(&commits)).await {
            // Cut off: sent, and no answer.
            Err(_) => vec![Sent::Unknown; batch.len()],
            Ok(Ok(answers)) => answers,
            Ok(Err(Sent::NotWritten)) => {
                // Refused, so nothing written: each again on its own.
                let alone = commits.iter().map(|c| async move {
                    self.group.alone.fetch_add(1, Ordering::Relaxed);
                    tokio::time::timeout_at(c.until, self.commit_one(c)).await.unwrap_or(Sent::Unknown)
                });
                join_all(alone).await
            }
            Ok(Err(other)) => vec![other; batch.len()],
        };
        for (w, sent) in batch.into_iter().zip(answers) {
            let _ = w.answer.send(sent);
        }
    }

    /// The commit statement for one session.
    async fn commit_one(&self, c: &Commit) -> Sent {
        let Ok(client) = self.query_conn("commit").await else { return Sent::NotWritten };
        let (n, ttl) = (c.rows.len() as i64, self.ttl_ms());
        let mut params: Vec<Param<'_>> = vec![
            (&c.id, Type::TEXT),
            (&c.token, Type::UUID),
            (&c.version, Type::INT8),
            (&n, Type::INT8),
            (&c.rows, Type::TEXT_ARRAY),
        ];
        let sql = match &c.keep {
            None => COMMIT,
            Some(next) => {
                params.push((next, Type::UUID));
                params.push((&ttl, Type::FLOAT8));
                COMMIT_KEEPING
            }
        };
        let result = client.maybe_row(sql, &params).await;
        // (`SELECT count(*)` returns one row; none would mean no commit.)
        let answer = result
            .and_then(|row| row.map_or(Ok((0, false)), |r| Ok((r.try_get::<_, i64>(0)?, r.try_get::<_, bool>(1)?))));
        match answer {
            Ok((1, kept)) => Sent::Committed { kept },
            Ok(_) => Sent::LeaseGone,
            Err(e) => failed(e),
        }
    }

    /// The commit statement for several sessions: each one's answer, in
    /// order, or (Err) the statement's, which is every one's.
    async fn commit_many(&self, commits: &[&Commit]) -> Result<Vec<Sent>, Sent> {
        let Ok(client) = self.query_conn("commit").await else { return Err(Sent::NotWritten) };
        let ids: Vec<&str> = commits.iter().map(|c| c.id.as_str()).collect();
        let tokens: Vec<uuid::Uuid> = commits.iter().map(|c| c.token).collect();
        let versions: Vec<i64> = commits.iter().map(|c| c.version).collect();
        let counts: Vec<i64> = commits.iter().map(|c| c.rows.len() as i64).collect();
        let keeps: Vec<Option<uuid::Uuid>> = commits.iter().map(|c| c.keep).collect();
        // The messages, each with its commit's number (from 1) and its own.
        let (mut of, mut ord, mut texts) = (Vec::new(), Vec::new(), Vec::new());
        for (k, c) in (1i64..).zip(commits) {
            for (j, text) in (1i64..).zip(&c.rows) {
                of.push(k);
                ord.push(j);
                texts.push(text.as_str());
            }
        }
        let ttl = self.ttl_ms();
        let params: [Param<'_>; 9] = [
            (&ids, Type::TEXT_ARRAY),
            (&tokens, Type::UUID_ARRAY),
            (&versions, Type::INT8_ARRAY),
            (&counts, Type::INT8_ARRAY),
            (&keeps, Type::UUID_ARRAY),
            (&ttl, Type::FLOAT8),
            (&of, Type::INT8_ARRAY),
            (&ord, Type::INT8_ARRAY),
            (&texts, Type::TEXT_ARRAY),
        ];
        let rows = client.rows(COMMIT_MANY, &params).await.map_err(failed)?;
        let mut answers = vec![Sent::LeaseGone; commits.len()];
        for row in rows {
            let (k, kept) =
                row.try_get::<_, i64>(0).and_then(|k| Ok((k, row.try_get::<_, bool>(1)?))).map_err(failed)?;
            if let Some(answer) = usize::try_from(k - 1).ok().and_then(|i| answers.get_mut(i)) {
                *answer = Sent::Committed { kept };
            }
        }
        Ok(answers)
    }
}

/// What a failed commit statement means: refused by the server (its
/// transaction rolled back), nothing was written; no answer, it may have
/// landed.
fn failed(e: tokio_postgres::Error) -> Sent {
    let refused = e.as_db_error().is_some();
    db("commit")(e);
    if refused { Sent::NotWritten } else { Sent::Unknown }
}

/// The commit: one statement, so one round trip and atomic: the version
/// bump (only with the lease's token and the version it read), the new
/// rows numbered after the old ones, the commit's token (to read back),
/// and the release. No bump, no rows. Answers the rows bumped (1 or 0),
/// and whether the lease was kept (here never).
const COMMIT: &str = "WITH bump AS (
        UPDATE lattice_sessions
        SET version = version + 1, message_count = message_count + $4, last_commit = $2,
            lease_token = NULL, lease_expires = NULL, lease_kept = false, lease_wanted = false,
            touched_at = now(), touched_minute = date_trunc('minute', now())
        WHERE id = $1 AND lease_token = $2 AND version = $3
        RETURNING message_count - $4 AS first
    ), rows AS (
        INSERT INTO lattice_messages (session_id, seq, message)
        SELECT $1, bump.first + t.ord - 1, t.m
        FROM bump, unnest($5::text[]) WITH ORDINALITY AS t(m, ord)
    )
    SELECT count(*), false FROM bump";

/// [`COMMIT`] keeping the lease under the token `$6` for `$7` ms (a token
/// of its own for each commit: the read-back tells them apart), unless
/// another replica asked for it: then it releases it.
const COMMIT_KEEPING: &str = "WITH bump AS (
        UPDATE lattice_sessions
        SET version = version + 1, message_count = message_count + $4, last_commit = $2,
            lease_token = CASE WHEN lease_wanted THEN NULL ELSE $6::uuid END,
            lease_expires = CASE WHEN lease_wanted THEN NULL ELSE now() + $7 * interval '1 millisecond' END,
            lease_kept = NOT lease_wanted, lease_wanted = false,
            touched_at = now(), touched_minute = date_trunc('minute', now())
        WHERE id = $1 AND lease_token = $2 AND version = $3
        RETURNING message_count - $4 AS first, lease_kept AS kept
    ), rows AS (
        INSERT INTO lattice_messages (session_id, seq, message)
        SELECT $1, bump.first + t.ord - 1, t.m
        FROM bump, unnest($5::text[]) WITH ORDINALITY AS t(m, ord)
    )
    SELECT count(*), coalesce(bool_or(kept), false) FROM bump";

/// [`COMMIT`] and [`COMMIT_KEEPING`] for several sessions at once: commit
/// `k` (from 1) is session `$1[k]` under the token `$2[k]` at version
/// `$3[k]`, adding `$4[k]` messages, kept under `$5[k]` for `$6` ms (or
/// released, where NULL or asked for); the messages are `$9`, each of
/// commit `$7` and numbered `$8` (from 1) in it. Each row is bumped on its
/// own checks. Answers each commit that landed, and whether it kept its
/// lease.
const COMMIT_MANY: &str = "WITH input AS (
        SELECT * FROM unnest($1::text[], $2::uuid[], $3::int8[], $4::int8[], $5::uuid[])
            WITH ORDINALITY AS i(id, token, version, n, next, k)
    ), bump AS (
        UPDATE lattice_sessions s
        SET version = s.version + 1, message_count = s.message_count + i.n, last_commit = i.token,
            lease_token = CASE WHEN i.next IS NULL OR s.lease_wanted THEN NULL ELSE i.next END,
            lease_expires = CASE WHEN i.next IS NULL OR s.lease_wanted THEN NULL
                ELSE now() + $6 * interval '1 millisecond' END,
            lease_kept = i.next IS NOT NULL AND NOT s.lease_wanted, lease_wanted = false,
            touched_at = now(), touched_minute = date_trunc('minute', now())
        FROM input i
        WHERE s.id = ANY($1) AND s.id = i.id AND s.lease_token = i.token AND s.version = i.version
        RETURNING i.k, s.id, s.message_count - i.n AS first, s.lease_kept AS kept
    ), rows AS (
        INSERT INTO lattice_messages (session_id, seq, message)
        SELECT b.id, b.first + m.ord - 1, m.message
        FROM bump b JOIN unnest($7::int8[], $8::int8[], $9::text[]) AS m(k, ord, message) ON m.k = b.k
    )
    SELECT k, kept FROM bump";

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn waiting(bytes: usize) -> (Waiting, uuid::Uuid) {
        let token = uuid::Uuid::new_v4();
        let commit = Commit {
            id: "s".into(),
            token,
            version: 0,
            rows: vec!["x".repeat(bytes)],
            keep: None,
            until: Instant::now() + Duration::from_secs(1),
        };
        (Waiting { commit, answer: oneshot::channel().0 }, token)
    }

    /// A statement takes the commits waiting, in order, up to its limits:
    /// the first always, however large.
    #[tokio::test(start_paused = true)]
    async fn a_statement_takes_the_commits_waiting_up_to_its_limits() {
        let mut queue = Queue::default();
        let tokens: Vec<uuid::Uuid> = (0..MAX_COMMITS + 3)
            .map(|_| {
                let (w, token) = waiting(10);
                queue.waiting.push(w);
                token
            })
            .collect();
        let first: Vec<uuid::Uuid> = queue.take().iter().map(|w| w.commit.token).collect();
        assert_eq!(first, tokens[..MAX_COMMITS]);
        assert_eq!(queue.take().len(), 3);
        assert!(queue.take().is_empty());

        for bytes in [MAX_BYTES + 1, 10, MAX_BYTES / 2, MAX_BYTES / 2] {
            queue.waiting.push(waiting(bytes).0);
        }
        assert_eq!(queue.take().len(), 1, "a commit over the limit goes alone");
        assert_eq!(queue.take().len(), 2, "up to the limit");
        assert_eq!(queue.take().len(), 1);
    }

    /// A commit can be taken back while it waits, not once it is taken for
    /// a statement.
    #[tokio::test(start_paused = true)]
    async fn a_waiting_commit_can_be_taken_back_until_it_is_sent() {
        let mut queue = Queue::default();
        let (a, a_token) = waiting(1);
        queue.waiting.push(a);
        let sent = queue.take();
        let (b, b_token) = waiting(1);
        queue.waiting.push(b);
        assert!(!queue.withdraw(a_token), "a is on its way");
        assert!(queue.withdraw(b_token));
        assert!(!queue.withdraw(b_token));
        assert!(queue.take().is_empty());
        assert_eq!(sent.len(), 1);
    }
}
