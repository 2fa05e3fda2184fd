//! A lease on one session row: its commit, with the outcome resolved when
//! the reply is lost, and its release, both by the lease's token.

use std::sync::Arc;

use tokio::time::Instant;
use tokio_postgres::types::Type;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::{
    PostgresStore,
    conn::{Param, bounded, db},
};
use crate::{
    domain::Message,
    session::{LeaseHolder, StoreError, StoreFuture},
};

/// A lease on one session row.
#[derive(Debug)]
pub(super) struct PgLease {
    pub(super) store: PostgresStore,
    pub(super) id: String,
    pub(super) token: uuid::Uuid,
    pub(super) version: i64,
    pub(super) created: bool,
    /// The session row's creation time, and its messages when the lease
    /// was taken: where a commit's messages go in the cache.
    pub(super) born: i64,
    pub(super) count: usize,
    /// Stops the renewer.
    pub(super) done: CancellationToken,
}

/// What became of a commit statement.
enum Sent {
    /// It ran and committed.
    Committed,
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

impl PgLease {
    /// The commit statement, once.
    async fn send_commit(&self, rows: &[String]) -> Sent {
        let Ok(client) = self.store.query_conn("commit").await else { return Sent::NotWritten };
        let n = rows.len() as i64;
        // One statement, so one round trip and atomic: the version bump
        // (only with our token and the version we read), the new rows
        // numbered after the old ones, the commit's token (to read back),
        // and the release. No bump, no rows.
        let params: [Param<'_>; 5] = [
            (&self.id, Type::TEXT),
            (&self.token, Type::UUID),
            (&self.version, Type::INT8),
            (&n, Type::INT8),
            (&rows, Type::TEXT_ARRAY),
        ];
        let result = client
            .maybe_row(
                "WITH bump AS (
                     UPDATE lattice_sessions
                     SET version = version + 1, message_count = message_count + $4, last_commit = $2,
                         lease_token = NULL, lease_expires = NULL,
                         touched_at = now(), touched_minute = date_trunc('minute', now())
                     WHERE id = $1 AND lease_token = $2 AND version = $3
                     RETURNING message_count - $4 AS first
                 ), rows AS (
                     INSERT INTO lattice_messages (session_id, seq, message)
                     SELECT $1, bump.first + t.ord - 1, t.m
                     FROM bump, unnest($5::text[]) WITH ORDINALITY AS t(m, ord)
                 )
                 SELECT count(*) FROM bump",
                &params,
            )
            .await;
        // (`SELECT count(*)` returns one row; none would mean no commit.)
        match result.and_then(|row| row.map_or(Ok(0), |r| r.try_get::<_, i64>(0))) {
            Ok(1) => Sent::Committed,
            Ok(_) => Sent::LeaseGone,
            Err(e) => {
                let refused = e.as_db_error().is_some();
                db("commit")(e);
                if refused { Sent::NotWritten } else { Sent::Unknown }
            }
        }
    }

    /// Gives the lease back by token in a task of its own (see
    /// [`PostgresStore::give_back_later`]).
    fn give_back_later(&self) -> tokio::task::JoinHandle<()> {
        self.store.give_back_later(self.id.clone(), self.token, self.created)
    }

    /// After a commit that may have landed: gives the lease back by token,
    /// which fences off the commit if it is still in flight, or, if the
    /// token is gone, reads back whether the commit took it. Asked again
    /// (on another connection each time) until an answer comes or `until`;
    /// only then is the outcome unknown.
    async fn settle(&self, until: Instant) -> Result<(), StoreError> {
        let ask_once = async || -> Result<Result<(), StoreError>, StoreError> {
            if self.store.give_back(&self.id, self.token, self.created).await? {
                // Given back here: no commit under this token can land now.
                return Ok(Err(StoreError::Unavailable("postgres")));
            }
            // The token is gone: our commit took it, or the lease expired.
            Ok(if self.store.landed(&self.id, self.token).await? { Ok(()) } else { Err(StoreError::LeaseLost) })
        };
        let ask = async {
            loop {
                match ask_once().await {
                    Ok(outcome) => return outcome,
                    // No answer (a reset, a refused connection): ask again.
                    Err(_) => tokio::time::sleep(SETTLE_RETRY).await,
                }
            }
        };
        match tokio::time::timeout_at(until, ask).await {
            Ok(outcome) => outcome,
            Err(_) => {
                warn!(operation = "read back", "session store did not answer before the query's deadline");
                Err(StoreError::CommitOutcomeUnknown)
            }
        }
    }
}

/// How long a commit's read-back waits before asking the store again.
const SETTLE_RETRY: std::time::Duration = std::time::Duration::from_millis(20);

impl LeaseHolder for PgLease {
    fn commit(&self, appended: Vec<Message>, deadline: Option<Instant>) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            self.done.cancel();
            let until = deadline.unwrap_or_else(|| self.store.soon());
            let rows: Vec<String> = appended
                .iter()
                .map(|m| serde_json::to_string(m).map_err(|_| StoreError::Unavailable("postgres")))
                .collect::<Result<_, _>>()?;
            if Instant::now() >= until {
                // Not sent: nothing written.
                self.give_back_later();
                return Err(StoreError::Deadline);
            }
            let sent = match tokio::time::timeout_at(until, self.send_commit(&rows)).await {
                Ok(sent) => sent,
                Err(_) => {
                    warn!(operation = "commit", "session store did not answer before the query's deadline");
                    // Nothing can be asked after the deadline. The lease is
                    // still given back (if the commit did not take it), so
                    // that the session is free again sooner.
                    self.give_back_later();
                    return Err(StoreError::CommitOutcomeUnknown);
                }
            };
            let outcome = match sent {
                Sent::Committed => Ok(()),
                Sent::LeaseGone => Err(StoreError::LeaseLost),
                Sent::NotWritten => {
                    // The lease is given back, so that a retry finds the
                    // session free (best effort: else it expires).
                    let _ = tokio::time::timeout_at(until, self.give_back_later()).await;
                    Err(StoreError::Unavailable("postgres"))
                }
                Sent::Unknown => self.settle(until).await,
            };
            match &outcome {
                Ok(()) => {
                    debug!(session_id = %self.id, appended = rows.len(), "session committed");
                    if let Some(cache) = &self.store.cache {
                        cache.append(&self.id, self.born, self.count, appended);
                    }
                }
                Err(e) => debug!(session_id = %self.id, error = %e, "session not committed"),
            }
            outcome
        })
    }

    fn release(self: Arc<Self>) -> StoreFuture<'static, ()> {
        self.done.cancel();
        Box::pin(async move {
            let until = self.store.soon();
            bounded(until, "release", StoreError::Unavailable("postgres"), async {
                self.store.give_back(&self.id, self.token, self.created).await.map(drop)
            })
            .await
        })
    }
}
