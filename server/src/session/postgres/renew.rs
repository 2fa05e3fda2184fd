//! Keeping the leases of running queries alive: one task renews every
//! lease this replica's queries hold, each a third of the way through its
//! time to live, those due at once in one statement.
//!
//! A query registers its lease when it takes it ([`Renewer::hold`]) and
//! leaves when its commit starts or its lease is released (the
//! [`Renewal`]'s end or drop): two steps on a map, where a task and a timer
//! of its own per query cost more than the rest of the store's work. Most
//! queries end long before their first renewal is due, and the task then
//! has nothing to do.
//!
//! A lease is known held until `ttl` after the start of the last statement
//! that renewed it. A renewal is given at most the store's timeout, and the
//! task watches each lease's expiry apart from the statements on their way:
//! a database that stops answering mid-renewal cannot keep a query running
//! on a lease that has expired (and that another replica may have taken).
//! At that moment the lease is lost, as it is at once when another holder
//! took it over.

use std::{
    collections::HashMap,
    future::Future,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use tokio::{
    sync::{Notify, watch},
    time::Instant,
};
use tokio_postgres::types::Type;
use tracing::warn;

use super::{Conn, Param, PostgresStore, conn::SaidOnce, db, keeper::columns};
use crate::{session::StoreError, sync::lock};

/// The leases of the replica's running queries, and the task's next wake.
#[derive(Debug)]
pub(super) struct Renewer {
    state: Mutex<State>,
    /// Wakes the task early: a lease due before it would wake, or a
    /// renewal's answer.
    wake: Notify,
    ttl: Duration,
    timeout: Duration,
    started: AtomicBool,
}

#[derive(Debug, Default)]
struct State {
    /// By lease token.
    leases: HashMap<uuid::Uuid, Running>,
    /// When the task wakes next, if it sleeps.
    wakes_at: Option<Instant>,
}

/// A running query's lease.
#[derive(Debug)]
struct Running {
    id: String,
    /// Known held until then.
    held_until: Instant,
    /// When the next renewal is due.
    due: Instant,
    /// Whether a renewal is on its way.
    trying: bool,
    lost: watch::Sender<bool>,
}

/// A lease's place in the renewer: it is renewed until this ends or is
/// dropped.
#[derive(Debug)]
pub(super) struct Renewal {
    renewer: Arc<Renewer>,
    token: uuid::Uuid,
}

impl Renewal {
    /// The lease is no longer renewed.
    pub(super) fn end(&self) {
        lock(&self.renewer.state).leases.remove(&self.token);
    }
}

impl Drop for Renewal {
    fn drop(&mut self) {
        self.end();
    }
}

/// The leases of one renewal statement: (session, token).
pub(super) type Batch = Vec<(String, uuid::Uuid)>;

impl Renewer {
    pub(super) fn new(ttl: Duration, timeout: Duration) -> Self {
        Self { state: Mutex::default(), wake: Notify::new(), ttl, timeout, started: Default::default() }
    }

    /// Renews the lease `token` of session `id`, known held until
    /// `held_until`: first a third of the lease after it was last set (at
    /// once, if that is past). The receiver turns true if it is lost.
    pub(super) fn hold(
        self: &Arc<Self>,
        id: &str,
        token: uuid::Uuid,
        held_until: Instant,
    ) -> (Renewal, watch::Receiver<bool>) {
        let (lost, rx) = watch::channel(false);
        let due = held_until.checked_sub(self.ttl - self.ttl / 3).unwrap_or_else(Instant::now);
        let mut state = lock(&self.state);
        state.leases.insert(token, Running { id: id.to_owned(), held_until, due, trying: false, lost });
        if state.wakes_at.is_none_or(|at| due < at) {
            state.wakes_at = Some(due);
            self.wake.notify_one();
        }
        drop(state);
        (Renewal { renewer: self.clone(), token }, rx)
    }

    /// Whether the task is to be started (the first time only).
    fn start(&self) -> bool {
        !self.started.swap(true, Ordering::SeqCst)
    }

    /// The task: renews the leases due with `attempt` (which answers the
    /// tokens it renewed), and declares lost those past their expiry.
    pub(super) async fn run<F, Fut>(self: Arc<Self>, attempt: F)
    where
        F: Fn(Batch) -> Fut,
        Fut: Future<Output = Result<Vec<uuid::Uuid>, StoreError>> + Send + 'static,
    {
        loop {
            let now = Instant::now();
            let (batch, wake) = self.scan(now);
            if !batch.is_empty() {
                let tokens: Vec<uuid::Uuid> = batch.iter().map(|(_, t)| *t).collect();
                let renewal = tokio::time::timeout_at(now + self.timeout, attempt(batch));
                let renewer = self.clone();
                tokio::spawn(async move {
                    let renewed = renewal.await.unwrap_or(Err(StoreError::Unavailable("postgres")));
                    renewer.answered(&tokens, now, renewed);
                });
            }
            tokio::select! {
                () = tokio::time::sleep_until(wake) => {}
                () = self.wake.notified() => {}
            }
        }
    }

    /// At `now`: declares lost the leases past their expiry, takes those
    /// due for a renewal, and says when to wake next (at the next expiry
    /// or renewal due, or a third of a lease from now).
    fn scan(&self, now: Instant) -> (Batch, Instant) {
        let every = self.ttl / 3;
        let mut state = lock(&self.state);
        let mut batch = Vec::new();
        let mut wake = now + every;
        state.leases.retain(|token, run| {
            if now >= run.held_until {
                warn!("the session's lease expired: the database did not renew it in time");
                let _ = run.lost.send(true);
                return false;
            }
            if !run.trying && now >= run.due {
                run.trying = true;
                batch.push((run.id.clone(), *token));
            }
            wake = wake.min(run.held_until);
            if !run.trying {
                wake = wake.min(run.due);
            }
            true
        });
        state.wakes_at = Some(wake);
        (batch, wake)
    }

    /// A renewal of `tokens`, started at `started`, answered `renewed`:
    /// those renewed are held for a lease from its start; those it did not
    /// find were taken over; after a failure (the database away or slow)
    /// each holds until its expiry, and is tried again a third of a lease
    /// after this try started (at once, if this one used that time up).
    fn answered(&self, tokens: &[uuid::Uuid], started: Instant, renewed: Result<Vec<uuid::Uuid>, StoreError>) {
        let mut state = lock(&self.state);
        for token in tokens {
            let Some(run) = state.leases.get_mut(token) else { continue };
            run.trying = false;
            run.due = started + self.ttl / 3;
            match &renewed {
                Ok(renewed) if renewed.contains(token) => run.held_until = run.held_until.max(started + self.ttl),
                Ok(_) => {
                    warn!("the session's lease was taken over");
                    let _ = run.lost.send(true);
                    state.leases.remove(token);
                }
                Err(_) => {}
            }
        }
        drop(state);
        self.wake.notify_one();
    }
}

impl PostgresStore {
    /// Renews the lease `token` of session `id`, known held until
    /// `held_until`, while its query runs (see [`Renewer`]).
    pub(super) fn renew(&self, id: &str, token: uuid::Uuid, held_until: Instant) -> (Renewal, watch::Receiver<bool>) {
        if self.renewer.start() {
            let store = self.clone();
            // Renewals recur every third of a lease: a database away is
            // said once.
            let said = Arc::new(SaidOnce::default());
            tokio::spawn(self.renewer.clone().run(move |batch| {
                let (store, said) = (store.clone(), said.clone());
                async move { said.run("renew", store.renew_running(batch)).await }
            }));
        }
        self.renewer.hold(id, token, held_until)
    }

    /// Renews the running queries' leases `batch` on their shared
    /// connections: the tokens renewed.
    async fn renew_running(&self, batch: Batch) -> Result<Vec<uuid::Uuid>, StoreError> {
        self.renew_leases(&self.query_conn("renew").await?, &batch).await
    }

    /// Renews the leases `leases` (session, token) on `client`, those of
    /// running queries and those kept (see `keeper`) alike: the tokens
    /// renewed (a lease not renewed was taken over).
    pub(super) async fn renew_leases(
        &self,
        client: &Conn<'_>,
        leases: &[(String, uuid::Uuid)],
    ) -> Result<Vec<uuid::Uuid>, StoreError> {
        let (ids, tokens) = columns(leases);
        let params: [Param<'_>; 3] =
            [(&ids, Type::TEXT_ARRAY), (&tokens, Type::UUID_ARRAY), (&self.ttl_ms(), Type::FLOAT8)];
        let rows = client
            .rows(
                "UPDATE lattice_sessions s SET lease_expires = now() + $3 * interval '1 millisecond'
                 FROM unnest($1::text[], $2::uuid[]) AS h(id, token)
                 WHERE s.id = h.id AND s.lease_token = h.token
                 RETURNING s.lease_token",
                &params,
            )
            .await
            .map_err(db("renew"))?;
        rows.iter().map(|r| r.try_get(0).map_err(db("renew"))).collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    const TTL: Duration = Duration::from_secs(15);
    const TIMEOUT: Duration = Duration::from_secs(5);

    /// A renewer whose statements are `attempt`, running.
    fn renewer<F, Fut>(attempt: F) -> Arc<Renewer>
    where
        F: Fn(Batch) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Vec<uuid::Uuid>, StoreError>> + Send + 'static,
    {
        let renewer = Arc::new(Renewer::new(TTL, TIMEOUT));
        tokio::spawn(renewer.clone().run(attempt));
        renewer
    }

    /// Holds a lease set just now on `renewer`; returns when it was lost
    /// (after the start), or `None` if it was not within `within`.
    async fn lost_after(renewer: &Arc<Renewer>, within: Duration) -> Option<Duration> {
        let start = Instant::now();
        let (_renewal, mut lost) = renewer.hold("s", uuid::Uuid::new_v4(), start + TTL);
        let lost = tokio::time::timeout(within, lost.wait_for(|l| *l)).await;
        lost.ok().map(|_| start.elapsed())
    }

    /// Every token asked, renewed.
    fn renew_all(batch: Batch) -> std::future::Ready<Result<Vec<uuid::Uuid>, StoreError>> {
        std::future::ready(Ok(batch.into_iter().map(|(_, t)| t).collect()))
    }

    /// A renewer whose statements renew every lease asked, and the count
    /// of its statements.
    fn counted_renewer() -> (Arc<Renewer>, Arc<AtomicUsize>) {
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        let renewer = renewer(move |batch| {
            seen.fetch_add(1, Ordering::SeqCst);
            renew_all(batch)
        });
        (renewer, calls)
    }

    /// A database that takes the first renewal and then stops answering
    /// (SIGSTOP, a failover's silent primary): the lease is declared lost
    /// exactly when the last renewal runs out, though an attempt hangs.
    #[tokio::test(start_paused = true)]
    async fn a_hanging_renewal_loses_the_lease_when_it_expires() {
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        let renewer = renewer(move |batch: Batch| {
            let n = seen.fetch_add(1, Ordering::SeqCst);
            async move {
                if n > 0 {
                    std::future::pending::<()>().await;
                }
                renew_all(batch).await
            }
        });
        // Renewed at 5 s (held until 20 s); the next attempts hang.
        assert_eq!(lost_after(&renewer, Duration::from_secs(60)).await, Some(Duration::from_secs(20)));
        assert!(calls.load(Ordering::SeqCst) >= 2);
    }

    /// Renewals that answer keep the lease for as long as the query runs,
    /// one every third of the lease.
    #[tokio::test(start_paused = true)]
    async fn answered_renewals_keep_the_lease() {
        let (renewer, calls) = counted_renewer();
        assert_eq!(lost_after(&renewer, Duration::from_secs(600)).await, None);
        assert!((119..=120).contains(&calls.load(Ordering::SeqCst)), "{calls:?}");
    }

    /// Failing renewals (a refused connection) lose it at its expiry, not
    /// before: a short outage costs no query.
    #[tokio::test(start_paused = true)]
    async fn failing_renewals_lose_the_lease_at_its_expiry() {
        let renewer = renewer(|_| async { Err::<Vec<uuid::Uuid>, _>(StoreError::Unavailable("postgres")) });
        assert_eq!(lost_after(&renewer, Duration::from_secs(60)).await, Some(TTL));
    }

    /// A lease kept from an earlier query, last set 8 s ago: renewed at
    /// once (its renewal was due at 5 s), and lost when that renewal hangs
    /// at the expiry it had, 7 s from now, not a whole lease later.
    #[tokio::test(start_paused = true)]
    async fn a_kept_lease_is_renewed_at_once_and_lost_at_its_own_expiry() {
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        let renewer = renewer(move |_| {
            seen.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<Result<Vec<uuid::Uuid>, StoreError>>()
        });
        // The task is idle, asleep for a third of a lease.
        tokio::time::sleep(Duration::from_millis(1)).await;
        let start = Instant::now();
        let (_renewal, mut lost) = renewer.hold("s", uuid::Uuid::new_v4(), start + TTL - Duration::from_secs(8));
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(calls.load(Ordering::SeqCst), 1, "the due renewal is tried at once");
        let lost = tokio::time::timeout(Duration::from_secs(60), lost.wait_for(|l| *l)).await;
        assert!(matches!(lost, Ok(Ok(_))), "the lease was never declared lost");
        assert_eq!(start.elapsed(), Duration::from_secs(7));
    }

    /// A lease another holder took is lost at once.
    #[tokio::test(start_paused = true)]
    async fn a_lease_taken_over_is_lost_at_the_first_renewal() {
        let renewer = renewer(|_| async { Ok(Vec::new()) });
        assert_eq!(lost_after(&renewer, Duration::from_secs(60)).await, Some(TTL / 3));
    }

    /// Leases due together go in one statement; one whose query ended is
    /// no longer renewed; one taken over is lost alone.
    #[tokio::test(start_paused = true)]
    async fn leases_due_together_share_a_statement() {
        let asked = Arc::new(Mutex::new(Vec::<Batch>::new()));
        let (seen, gone) = (asked.clone(), uuid::Uuid::new_v4());
        let renewer = renewer(move |batch: Batch| {
            lock(&seen).push(batch.clone());
            std::future::ready(Ok(batch.into_iter().map(|(_, t)| t).filter(|t| *t != gone).collect()))
        });
        let now = Instant::now();
        let (a, b) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
        let (_a, lost_a) = renewer.hold("a", a, now + TTL);
        let (ended, _) = renewer.hold("b", b, now + TTL);
        let (_gone, lost_gone) = renewer.hold("c", gone, now + TTL);
        tokio::time::sleep(Duration::from_secs(1)).await;
        ended.end();
        tokio::time::sleep(TTL / 3).await;
        let batches = lock(&asked).clone();
        assert_eq!(batches.len(), 1, "{batches:?}");
        let mut ids: Vec<&str> = batches[0].iter().map(|(id, _)| id.as_str()).collect();
        ids.sort_unstable();
        assert_eq!(ids, ["a", "c"]);
        assert!(*lost_gone.borrow(), "the lease taken over is lost");
        assert!(!*lost_a.borrow(), "the other one is held");
    }

    /// With no lease held, the task wakes once a third of a lease, and
    /// a lease held meanwhile waits for its own time.
    #[tokio::test(start_paused = true)]
    async fn an_idle_renewer_does_no_renewal() {
        let (renewer, calls) = counted_renewer();
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        let (held, _) = renewer.hold("s", uuid::Uuid::new_v4(), Instant::now() + TTL);
        tokio::time::sleep(TTL / 3 - Duration::from_millis(1)).await;
        assert_eq!(calls.load(Ordering::SeqCst), 0, "not due yet");
        tokio::time::sleep(Duration::from_millis(2)).await;
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        drop(held);
    }
}
