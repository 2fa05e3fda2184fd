//! A query's commit and the statements that send it: one session's, or
//! several sessions' at once (see `group`), each row bumped on its own
//! checks; and what a statement's answer (or its failure) means for what
//! was written.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use tokio::time::Instant;
use tokio_postgres::types::Type;

use super::{
    PostgresStore,
    conn::{Param, db},
};

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
    pub(super) fn bytes(&self) -> usize {
        self.rows.iter().map(String::len).sum()
    }
}

impl PostgresStore {
    /// The commit statement for one session.
    pub(super) async fn commit_one(&self, c: &Commit) -> Sent {
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
    pub(super) async fn commit_many(&self, commits: &[&Commit]) -> Result<Vec<Sent>, Sent> {
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

/// How a query's commit ended, as `lattice_session_commits_total` counts
/// it (see the outcome table in docs/sessions.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    /// The database answered: stored.
    Stored,
    /// Not stored: not sent before the deadline, or refused.
    NotStored,
    /// Not stored: the lease was no longer the query's.
    LeaseLost,
    /// The answer was lost; read back on another connection: stored.
    ReadBackStored,
    /// The answer was lost; the lease given back first, or gone: not
    /// stored.
    ReadBackNotStored,
    /// The answer was lost and the store could not be asked again before
    /// the deadline (`COMMIT_OUTCOME_UNKNOWN`).
    Unknown,
}

impl Outcome {
    const ALL: [Outcome; 6] = [
        Outcome::Stored,
        Outcome::NotStored,
        Outcome::LeaseLost,
        Outcome::ReadBackStored,
        Outcome::ReadBackNotStored,
        Outcome::Unknown,
    ];

    /// Its label value.
    fn label(self) -> &'static str {
        match self {
            Outcome::Stored => "stored",
            Outcome::NotStored => "not_stored",
            Outcome::LeaseLost => "lease_lost",
            Outcome::ReadBackStored => "read_back_stored",
            Outcome::ReadBackNotStored => "read_back_not_stored",
            Outcome::Unknown => "unknown",
        }
    }
}

/// The commits that ended each way.
#[derive(Debug, Default)]
pub(super) struct Outcomes([Arc<AtomicUsize>; 6]);

impl Outcomes {
    pub(super) fn count(&self, outcome: Outcome) {
        self.0[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Each outcome's label value and count.
    pub(super) fn each(&self) -> impl Iterator<Item = (&'static str, Arc<AtomicUsize>)> + '_ {
        Outcome::ALL.iter().map(|o| (o.label(), self.0[*o as usize].clone()))
    }
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
