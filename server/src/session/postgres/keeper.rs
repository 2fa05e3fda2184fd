//! The keeper: the task that tends the leases this replica keeps between
//! queries (see `kept`): gives back those another replica asked for and
//! those unused for `keep_lease_ms`, and renews the others. One statement
//! of each kind for all of them, each within the store's timeout.

use std::sync::atomic::{AtomicBool, Ordering};

use tokio_postgres::types::Type;
use tokio_util::sync::CancellationToken;

use super::{Param, PostgresStore, bounded, conn::SaidOnce, db, kept};
use crate::session::StoreError;

/// Whether the keeper runs, and its stop.
#[derive(Debug, Default)]
pub(super) struct Keeper {
    started: AtomicBool,
    stop: CancellationToken,
}

impl Keeper {
    /// Whether the replica stopped keeping leases (it is shutting down).
    pub(super) fn stopped(&self) -> bool {
        self.stop.is_cancelled()
    }
}

/// Session ids and lease tokens, as the statements' two arrays.
pub(super) fn columns(leases: &[(String, uuid::Uuid)]) -> (Vec<&str>, Vec<uuid::Uuid>) {
    leases.iter().map(|(id, token)| (id.as_str(), *token)).unzip()
}

impl PostgresStore {
    /// Starts the keeper, unless it runs.
    pub(super) fn start_keeper(&self) {
        if self.kept.is_none() || self.keeper.started.swap(true, Ordering::SeqCst) {
            return;
        }
        let store = self.clone();
        tokio::spawn(async move { store.tend().await });
    }

    /// Gives back every lease kept and keeps none from now on: at
    /// shutdown, once the last query ended, so that the sessions' next
    /// queries (on other replicas) find them free at once.
    pub async fn give_back_kept(&self) {
        self.keeper.stop.cancel();
        let Some(kept) = &self.kept else { return };
        let all = kept.drain();
        if !all.is_empty() {
            let _ = self.give_back_all(&all).await;
        }
    }

    async fn tend(self) {
        let Some(kept) = self.kept.clone() else { return };
        // Its statements recur every poll: a database away is said once.
        let said = SaidOnce::default();
        loop {
            tokio::select! {
                () = self.keeper.stop.cancelled() => return,
                () = tokio::time::sleep(kept::POLL) => {}
            }
            let due = kept.due();
            if !due.expired.is_empty() {
                let _ = said.run("release", self.give_back_all(&due.expired)).await;
            }
            if !due.renew.is_empty() {
                let started = tokio::time::Instant::now();
                // Those not renewed were lost (they expired, and another
                // replica took them): no longer kept.
                if let Ok(renewed) = said.run("renew", self.renew_all(&due.renew)).await {
                    for (id, token) in &due.renew {
                        if renewed.contains(token) {
                            kept.renewed(id, *token, started);
                        } else {
                            kept.forget(id, *token);
                        }
                    }
                }
            }
            let asked: Vec<_> = due.idle.iter().chain(&due.in_use).cloned().collect();
            if !asked.is_empty()
                && let Ok(wanted) = said.run("handover", self.wanted(&asked)).await
            {
                // Unused: handed over. In use: the session is busy (and
                // the query's commit releases the lease instead of
                // keeping it).
                let (handed, busy): (Vec<_>, Vec<_>) = asked
                    .into_iter()
                    .filter(|(id, _)| wanted.contains(id))
                    .partition(|(id, token)| kept.hand_over(id, *token));
                if !handed.is_empty() {
                    self.handovers.fetch_add(handed.len(), Ordering::Relaxed);
                    let _ = said.run("release", self.give_back_all(&handed)).await;
                }
                if !busy.is_empty() {
                    let _ = said.run("handover", self.say_busy(&busy)).await;
                }
            }
        }
    }

    /// Gives back the leases `leases` (session, token).
    async fn give_back_all(&self, leases: &[(String, uuid::Uuid)]) -> Result<Vec<String>, StoreError> {
        let sql = "UPDATE lattice_sessions s
                   SET lease_token = NULL, lease_expires = NULL, lease_kept = false, lease_wanted = false
                   FROM unnest($1::text[], $2::uuid[]) AS h(id, token)
                   WHERE s.id = h.id AND s.lease_token = h.token";
        self.on_leases("release", sql, leases).await
    }

    /// Tells the replicas that asked for the leases `leases` (in use here)
    /// that their sessions are busy.
    async fn say_busy(&self, leases: &[(String, uuid::Uuid)]) -> Result<Vec<String>, StoreError> {
        let sql = "UPDATE lattice_sessions s SET lease_kept = false
                   FROM unnest($1::text[], $2::uuid[]) AS h(id, token)
                   WHERE s.id = h.id AND s.lease_token = h.token AND s.lease_kept";
        self.on_leases("handover", sql, leases).await
    }

    /// Renews the leases `leases` on a pooled connection, within the
    /// store's timeout; returns the tokens renewed.
    async fn renew_all(&self, leases: &[(String, uuid::Uuid)]) -> Result<Vec<uuid::Uuid>, StoreError> {
        bounded(self.soon(), "renew", StoreError::Unavailable("postgres"), async {
            self.renew_leases(&self.conn("renew").await?, leases).await
        })
        .await
    }

    /// Of the leases `leases`, the sessions another replica asked for.
    async fn wanted(&self, leases: &[(String, uuid::Uuid)]) -> Result<Vec<String>, StoreError> {
        let sql = "SELECT s.id FROM unnest($1::text[], $2::uuid[]) AS h(id, token)
                   JOIN lattice_sessions s ON s.id = h.id AND s.lease_token = h.token
                   WHERE s.lease_wanted";
        self.on_leases("handover", sql, leases).await
    }

    /// `sql` (`what`) for the leases `leases` ($1 their sessions, $2 their
    /// tokens) on a pooled connection, within the store's timeout: the
    /// sessions it returns.
    async fn on_leases(
        &self,
        what: &'static str,
        sql: &'static str,
        leases: &[(String, uuid::Uuid)],
    ) -> Result<Vec<String>, StoreError> {
        let (ids, tokens) = columns(leases);
        bounded(self.soon(), what, StoreError::Unavailable("postgres"), async {
            let client = self.conn(what).await?;
            let params: [Param<'_>; 2] = [(&ids, Type::TEXT_ARRAY), (&tokens, Type::UUID_ARRAY)];
            let rows = client.rows(sql, &params).await.map_err(db(what))?;
            rows.iter().map(|r| r.try_get(0).map_err(db(what))).collect()
        })
        .await
    }
}
