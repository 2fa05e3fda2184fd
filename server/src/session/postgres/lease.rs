//! A lease on one session row: its commit, with the outcome resolved when
//! the reply is lost, and its release, both by the lease's token.

use std::sync::Arc;

use tokio::time::Instant;
use tokio_postgres::types::Type;
use tracing::{debug, info, warn};

use super::{
    PostgresStore,
    backoff::Backoff,
    commit::{Commit, Outcome, Sent},
    conn::{bounded, quietly},
    db, kept,
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
    /// Its token, the session as the lease found it, and what a commit
    /// needs to keep it.
    pub(super) held: kept::Held,
    pub(super) created: bool,
    /// Its place in the renewer.
    pub(super) renewal: super::renew::Renewal,
}

impl PgLease {
    /// After a commit that landed: keeps the lease under `next` for the
    /// session's next query, or (None) no longer keeps it.
    fn kept(&self, next: Option<uuid::Uuid>, appended: usize, started: Instant) {
        let Some(kept) = &self.store.kept else { return };
        kept.forget(&self.id, self.held.token);
        let Some(token) = next else { return };
        let held = kept::Held {
            token,
            version: self.held.version + 1,
            count: self.held.count + appended,
            ..self.held.clone()
        };
        let entry =
            kept::Entry { held, held_until: started + self.store.lease_ttl, idle_since: started, in_use: false };
        kept.keep(&self.id, entry);
        self.store.start_keeper();
    }

    /// Gives the lease back by token in a task of its own (see
    /// [`PostgresStore::give_back_later`]).
    fn give_back_later(&self) -> tokio::sync::oneshot::Receiver<()> {
        self.store.give_back_later(self.id.clone(), self.held.token, self.created)
    }

    /// After a commit that may have landed: gives the lease back by token,
    /// which fences off the commit if it is still in flight, or, if the
    /// token is gone, reads back whether the commit took it. Asked again
    /// (on another connection each time) until an answer comes or `until`;
    /// only then is the outcome unknown.
    async fn settle(&self, until: Instant) -> Result<(), StoreError> {
        let ask_once = async || -> Result<Result<(), StoreError>, StoreError> {
            if self.store.give_back(&self.id, self.held.token, self.created).await? {
                // Given back here: no commit under this token can land now.
                return Ok(Err(StoreError::Unavailable("postgres")));
            }
            // The token is gone: our commit took it, or the lease expired.
            Ok(if self.store.landed(&self.id, self.held.token).await? { Ok(()) } else { Err(StoreError::LeaseLost) })
        };
        let ask = async {
            if let Ok(outcome) = ask_once().await {
                return outcome;
            }
            // No answer (a reset, a refused connection): ask again, saying
            // why no more (the first attempt did, and the deadline will).
            loop {
                tokio::time::sleep(SETTLE_RETRY).await;
                if let (Ok(outcome), _) = quietly(ask_once()).await {
                    return outcome;
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

/// How long a lease that could not be given back waits before it is
/// tried again, at first, and at most (see
/// [`PostgresStore::give_back_later`]).
const GIVE_BACK_PAUSE: std::time::Duration = std::time::Duration::from_millis(50);
const GIVE_BACK_PAUSE_MAX: std::time::Duration = std::time::Duration::from_millis(250);

/// The pauses between attempts to give back a lease of time to live
/// `ttl` taken before now: none past its expiry, when nobody needs it
/// given back any more.
fn give_back_backoff(ttl: std::time::Duration) -> Backoff {
    Backoff::new(Instant::now() + ttl, GIVE_BACK_PAUSE, GIVE_BACK_PAUSE_MAX)
}

impl LeaseHolder for PgLease {
    fn commit(&self, appended: Vec<Message>, deadline: Option<Instant>) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            self.renewal.end();
            let until = deadline.unwrap_or_else(|| self.store.soon());
            let rows: Vec<String> = appended
                .iter()
                .map(|m| serde_json::to_string(m).map_err(|_| StoreError::Unavailable("postgres")))
                .collect::<Result<_, _>>()
                .inspect_err(|_| self.store.commits.count(Outcome::NotStored))?;
            let n = rows.len();
            if Instant::now() >= until {
                // Not sent: nothing written.
                self.give_back_later();
                self.store.commits.count(Outcome::NotStored);
                return Err(StoreError::Deadline);
            }
            // Kept, unless this replica is shutting down.
            let keep = (self.store.kept.is_some() && !self.store.keeper.stopped()).then(uuid::Uuid::new_v4);
            let started = Instant::now();
            let commit =
                Commit { id: self.id.clone(), token: self.held.token, version: self.held.version, rows, keep, until };
            let mut ticket = self.store.send_commit(commit);
            let sent = match tokio::time::timeout_at(until, &mut ticket.answer).await {
                Ok(Ok(sent)) => sent,
                // Dropped unanswered (the runtime is stopping): it may have
                // been sent.
                Ok(Err(_)) => Sent::Unknown,
                Err(_) if ticket.withdraw() => {
                    // Still waiting for its statement: nothing was sent.
                    self.give_back_later();
                    self.store.commits.count(Outcome::NotStored);
                    return Err(StoreError::Deadline);
                }
                Err(_) => {
                    warn!(operation = "commit", "session store did not answer before the query's deadline");
                    // Nothing can be asked after the deadline. The lease is
                    // still given back (if the commit did not take it, or
                    // under the token it was to be kept under, if it did),
                    // so that the session is free again sooner.
                    self.give_back_later();
                    if let Some(next) = keep {
                        self.store.give_back_later(self.id.clone(), next, false);
                    }
                    self.store.commits.count(Outcome::Unknown);
                    return Err(StoreError::CommitOutcomeUnknown);
                }
            };
            // The token the lease is kept under, if the commit kept it.
            let mut next = None;
            let (outcome, counted) = match sent {
                Sent::Committed { kept } => {
                    next = keep.filter(|_| kept);
                    (Ok(()), Outcome::Stored)
                }
                Sent::LeaseGone => (Err(StoreError::LeaseLost), Outcome::LeaseLost),
                Sent::NotWritten => {
                    // The lease is given back, so that a retry finds the
                    // session free (best effort: else it expires).
                    let _ = tokio::time::timeout_at(until, self.give_back_later()).await;
                    (Err(StoreError::Unavailable("postgres")), Outcome::NotStored)
                }
                Sent::Unknown => {
                    // Boxed: a commit that was answered never carries
                    // the read-back's statements.
                    let outcome = Box::pin(self.settle(until)).await;
                    if let (Ok(()), Some(next)) = (&outcome, keep) {
                        // Landed, maybe keeping the lease: not kept here.
                        self.store.give_back_later(self.id.clone(), next, false);
                    }
                    let counted = match &outcome {
                        Ok(()) => Outcome::ReadBackStored,
                        Err(StoreError::CommitOutcomeUnknown) => Outcome::Unknown,
                        Err(_) => Outcome::ReadBackNotStored,
                    };
                    (outcome, counted)
                }
            };
            self.store.commits.count(counted);
            match &outcome {
                Ok(()) => {
                    debug!(session_id = %self.id, appended = n, "session committed");
                    if let Some(cache) = &self.store.cache {
                        cache.append(&self.id, self.held.born, self.held.count, appended);
                    }
                }
                Err(e) => debug!(session_id = %self.id, error = %e, "session not committed"),
            }
            // Kept once the cache holds what was committed: the session's
            // next query reads its history there.
            self.kept(next, n, started);
            outcome
        })
    }

    fn release(self: Arc<Self>) -> StoreFuture<'static, ()> {
        self.renewal.end();
        let given_back = self.give_back_later();
        Box::pin(async move {
            let _ = given_back.await;
            Ok(())
        })
    }
}

impl PostgresStore {
    /// Gives back the lease `token` of session `id`, by token: from then on
    /// no commit in flight under it can land. Deletes the session instead
    /// when its first query `created` it (a failed query leaves nothing).
    /// Ok(true): given back here; Ok(false): the token was no longer there
    /// (committed, expired or taken over).
    pub(super) async fn give_back(&self, id: &str, token: uuid::Uuid, created: bool) -> Result<bool, StoreError> {
        if let Some(kept) = &self.kept {
            kept.forget(id, token);
        }
        let client = self.query_conn("release").await?;
        let sql = if created {
            "DELETE FROM lattice_sessions WHERE id = $1 AND lease_token = $2 AND message_count = 0"
        } else {
            "UPDATE lattice_sessions SET lease_token = NULL, lease_expires = NULL, lease_kept = false,
                 lease_wanted = false
             WHERE id = $1 AND lease_token = $2"
        };
        let n = client.exec(sql, &[(&id, Type::TEXT), (&token, Type::UUID)]).await.map_err(db("release"))?;
        if created && let Some(cache) = &self.cache {
            cache.forget(id);
        }
        Ok(n == 1)
    }

    /// [`PostgresStore::give_back`] in a task of its own, each attempt
    /// within the store's timeout. The receiver it returns resolves after
    /// the first (whoever waits for it may stop waiting sooner). If that
    /// fails (the database away, or restarting), the task asks again,
    /// pausing from [`GIVE_BACK_PAUSE`] and doubling up to
    /// [`GIVE_BACK_PAUSE_MAX`], until the lease would have expired anyway,
    /// and at once when a connection is made meanwhile: a session whose
    /// query failed is free again once the database is back, not only after
    /// `lease_ttl`. Safe to ask late: only the lease under `token` is given
    /// back.
    pub(super) fn give_back_later(
        &self,
        id: String,
        token: uuid::Uuid,
        created: bool,
    ) -> tokio::sync::oneshot::Receiver<()> {
        let store = self.clone();
        let (tried, first) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let mut again = give_back_backoff(store.lease_ttl);
            let mut tried = Some(tried);
            let (mut attempts, mut reason) = (0_u32, None);
            loop {
                attempts += 1;
                let until = store.soon().min(again.until());
                let give_back = bounded(until, "release", StoreError::Unavailable("postgres"), async {
                    store.give_back(&id, token, created).await
                });
                // The first attempt says why it failed; the others, how
                // they ended, once (below).
                let answered = if let Some(tried) = tried.take() {
                    let answered = give_back.await.is_ok();
                    let _ = tried.send(());
                    answered
                } else {
                    let (answer, why) = quietly(give_back).await;
                    reason = why.or(reason);
                    answer.is_ok()
                };
                if answered {
                    if attempts > 1 {
                        info!(attempts, "a failed query's lease was given back once the session store answered");
                    }
                    return;
                }
                // A connection made during the pause (by any statement: the
                // database is back) ends it at once.
                if !again.pause_or(store.connector.made()).await {
                    warn!(
                        attempts,
                        reason = reason.as_deref(),
                        "a lease could not be given back before it expired: its session was busy until then"
                    );
                    return;
                }
            }
        });
        first
    }

    /// Whether the commit made under `token` is the session's last.
    async fn landed(&self, id: &str, token: uuid::Uuid) -> Result<bool, StoreError> {
        let client = self.query_conn("read back").await?;
        let row = client
            .maybe_row(
                "SELECT last_commit = $2 FROM lattice_sessions WHERE id = $1",
                &[(&id, Type::TEXT), (&token, Type::UUID)],
            )
            .await
            .map_err(db("read back"))?;
        Ok(row.and_then(|r| r.try_get::<_, Option<bool>>(0).ok().flatten()).unwrap_or(false))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{config::PostgresSettings, session::SessionStore};

    /// A query on a kept lease starts its lease's and its commit's futures
    /// (a copy each, into the heap) and takes no statement there but the
    /// commit, which the group sends: neither may carry the futures of the
    /// statements it does not send (kilobytes each: taking a lease anew,
    /// a history read, a commit's read-back), which go in boxes of their
    /// own when needed.
    #[tokio::test]
    async fn a_kept_lease_queries_futures_carry_no_statement_they_do_not_send() -> Result<(), String> {
        let settings = PostgresSettings {
            url_env: "-".into(),
            url_file: None,
            // Never reached: nothing here is polled.
            url: "postgres://lattice@127.0.0.1:9/lattice".into(),
            pool_size: 1,
            pipeline_connections: 1,
            exit_if_unreachable: false,
            history_cache_bytes: 1 << 20,
            keep_lease: Duration::from_secs(30),
            store_timeout: Duration::from_secs(5),
            migrate: false,
            prepared_statements: true,
        };
        let ttl = Duration::from_secs(15);
        let store = PostgresStore::new(&settings, ttl, Duration::from_secs(3600))?;
        let deadline = Instant::now() + Duration::from_secs(1);
        let acquire = store.acquire_until("s", "a", None, false, deadline);
        let token = uuid::Uuid::new_v4();
        let (renewal, _lost) = store.renew("s", token, Instant::now() + ttl);
        let held = kept::Held { token, version: 1, count: 2, born: 1, agent: "a".into(), owner: None };
        let lease = PgLease { store: store.clone(), id: "s".into(), held, created: false, renewal };
        let commit = lease.commit(Vec::new(), Some(deadline));
        // Each was several kilobytes with the statements' futures inside.
        let (acquired, committed) = (std::mem::size_of_val(&*acquire), std::mem::size_of_val(&*commit));
        assert!(acquired <= 1024, "taking a lease: {acquired} bytes");
        assert!(committed <= 1024, "a commit: {committed} bytes");
        Ok(())
    }

    /// A lease not given back is asked about again soon at first, then
    /// every [`GIVE_BACK_PAUSE_MAX`], and no more once it would have
    /// expired anyway.
    #[tokio::test(start_paused = true)]
    async fn a_lease_not_given_back_is_asked_about_until_it_expires() {
        let ttl = Duration::from_secs(3);
        let start = Instant::now();
        let mut again = give_back_backoff(ttl);
        assert_eq!(again.until(), start + ttl);
        let mut asked = vec![Duration::ZERO];
        while again.pause().await {
            asked.push(start.elapsed());
        }
        let ms = |n: u64| Duration::from_millis(n);
        assert_eq!(asked[..6], [ms(0), ms(50), ms(150), ms(350), ms(600), ms(850)]);
        let last = asked.last().copied().unwrap_or_default();
        assert!(last < ttl && last + GIVE_BACK_PAUSE_MAX >= ttl, "last asked at {last:?}");
        assert_eq!(start.elapsed(), last, "gave up without waiting");
    }
}
