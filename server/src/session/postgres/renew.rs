//! Keeping a lease alive while its query runs.

use std::{future::Future, time::Duration};

use tokio::{sync::watch, time::Instant};
use tokio_postgres::types::Type;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::{PostgresStore, db};
use crate::session::StoreError;

/// Renews a lease of `ttl`, known held until `held_until`, every third of
/// it with `attempt` (the rows it renewed: 1, or 0 once another holder
/// took the lease), until `done`. The first attempt comes a third of the
/// lease after it was last set (at once, if that is past).
///
/// The lease is known held until `ttl` after the start of the last attempt
/// that renewed it. An attempt is given at most `timeout`, and never past
/// that moment: a database that stops answering mid-attempt cannot keep
/// the query running on a lease that has expired (and that another replica
/// may have taken). At that moment `lost` turns true, as it does at once
/// when the lease was taken over.
pub async fn keep_alive<F, Fut>(
    ttl: Duration,
    timeout: Duration,
    mut held_until: Instant,
    mut attempt: F,
    lost: watch::Sender<bool>,
    done: CancellationToken,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<u64, StoreError>>,
{
    let every = ttl / 3;
    let mut next = held_until.checked_sub(ttl - every).unwrap_or_else(Instant::now);
    loop {
        tokio::select! {
            () = done.cancelled() => return,
            () = tokio::time::sleep_until(next.min(held_until)) => {}
        }
        let started = Instant::now();
        if started >= held_until {
            warn!("the session's lease expired: the database did not renew it in time");
            let _ = lost.send(true);
            return;
        }
        let until = (started + timeout).min(held_until);
        let renewed = tokio::select! {
            () = done.cancelled() => return,
            r = tokio::time::timeout_at(until, attempt()) => r,
        };
        match renewed {
            Ok(Ok(1)) => held_until = started + ttl,
            Ok(Ok(_)) => {
                warn!("the session's lease was taken over");
                let _ = lost.send(true);
                return;
            }
            // The database is away or slow: the lease holds until it
            // expires; the next attempt comes a third of the lease later,
            // or at once when this one used that time up.
            Ok(Err(_)) | Err(_) => {}
        }
        next = started + every;
    }
}

impl PostgresStore {
    /// Renews a lease while its query runs (see [`keep_alive`]).
    /// The lease is known held until `held_until`.
    pub(super) fn renew(
        &self,
        id: String,
        token: uuid::Uuid,
        held_until: Instant,
        lost: watch::Sender<bool>,
        done: CancellationToken,
    ) {
        let store = self.clone();
        let attempt = move || {
            let (store, id) = (store.clone(), id.clone());
            async move {
                let client = store.query_conn("renew").await?;
                client
                    .exec(
                        "UPDATE lattice_sessions SET lease_expires = now() + $3 * interval '1 millisecond'
                         WHERE id = $1 AND lease_token = $2",
                        &[(&id, Type::TEXT), (&token, Type::UUID), (&store.ttl_ms(), Type::FLOAT8)],
                    )
                    .await
                    .map_err(db("renew"))
            }
        };
        tokio::spawn(keep_alive(self.lease_ttl, self.timeout, held_until, attempt, lost, done));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    };

    use super::*;

    const TTL: Duration = Duration::from_secs(15);
    const TIMEOUT: Duration = Duration::from_secs(5);

    /// Runs `keep_alive` with `attempt`; returns when `lost` turned true
    /// (after the start), or `None` if it did not within `within`.
    async fn lost_after<F, Fut>(attempt: F, within: Duration) -> Option<Duration>
    where
        F: FnMut() -> Fut + Send + 'static,
        Fut: Future<Output = Result<u64, StoreError>> + Send + 'static,
    {
        let (tx, mut rx) = watch::channel(false);
        let done = CancellationToken::new();
        let start = Instant::now();
        tokio::spawn(keep_alive(TTL, TIMEOUT, start + TTL, attempt, tx, done.clone()));
        let lost = tokio::time::timeout(within, rx.wait_for(|l| *l)).await;
        done.cancel();
        lost.ok().map(|_| start.elapsed())
    }

    /// A database that takes the first renewal and then stops answering
    /// (SIGSTOP, a failover's silent primary): the lease is declared lost
    /// exactly when the last renewal runs out, though an attempt hangs.
    #[tokio::test(start_paused = true)]
    async fn a_hanging_renewal_loses_the_lease_when_it_expires() {
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        let attempt = move || {
            let n = seen.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    return Ok(1);
                }
                std::future::pending::<()>().await;
                Ok(1)
            }
        };
        // Renewed at 5 s (held until 20 s); the next attempts hang.
        assert_eq!(lost_after(attempt, Duration::from_secs(60)).await, Some(Duration::from_secs(20)));
        assert!(calls.load(Ordering::SeqCst) >= 2);
    }

    /// Renewals that answer keep the lease for as long as the query runs.
    #[tokio::test(start_paused = true)]
    async fn answered_renewals_keep_the_lease() {
        assert_eq!(lost_after(|| async { Ok(1) }, Duration::from_secs(600)).await, None);
    }

    /// Failing renewals (a refused connection) lose it at its expiry, not
    /// before: a short outage costs no query.
    #[tokio::test(start_paused = true)]
    async fn failing_renewals_lose_the_lease_at_its_expiry() {
        let attempt = || async { Err::<u64, _>(StoreError::Unavailable("postgres")) };
        assert_eq!(lost_after(attempt, Duration::from_secs(60)).await, Some(TTL));
    }

    /// A lease kept from an earlier query, last set 8 s ago: renewed at
    /// once (its renewal was due at 5 s), and lost when that renewal hangs
    /// at the expiry it had, 7 s from now, not a whole lease later.
    #[tokio::test(start_paused = true)]
    async fn a_kept_lease_is_renewed_at_once_and_lost_at_its_own_expiry() {
        let (tx, mut rx) = watch::channel(false);
        let done = CancellationToken::new();
        let start = Instant::now();
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        let attempt = move || {
            seen.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<Result<u64, StoreError>>()
        };
        tokio::spawn(keep_alive(TTL, TIMEOUT, start + TTL - Duration::from_secs(8), attempt, tx, done.clone()));
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(calls.load(Ordering::SeqCst), 1, "the due renewal is tried at once");
        let lost = tokio::time::timeout(Duration::from_secs(60), rx.wait_for(|l| *l)).await;
        assert!(matches!(lost, Ok(Ok(_))), "the lease was never declared lost");
        assert_eq!(start.elapsed(), Duration::from_secs(7));
        done.cancel();
    }

    /// A lease another holder took is lost at once.
    #[tokio::test(start_paused = true)]
    async fn a_lease_taken_over_is_lost_at_the_first_renewal() {
        assert_eq!(lost_after(|| async { Ok(0) }, Duration::from_secs(60)).await, Some(TTL / 3));
    }
}
