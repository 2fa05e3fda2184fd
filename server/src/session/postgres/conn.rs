//! A connection (pooled, or shared by queries' statements) and the
//! statements sent on it: prepared once per connection, or unnamed with
//! their types (PgBouncer's transaction pooling, configured or found out);
//! how a failure is logged
//! (the reason, never a value or the connection string); and the bound
//! every wait on the database has.

use std::{
    cell::RefCell,
    future::Future,
    ops::Deref,
    sync::{
        Mutex,
        atomic::{AtomicBool, AtomicU8, Ordering},
    },
};

use deadpool_postgres::ClientWrapper;

use tokio::time::Instant;
use tokio_postgres::{
    Statement,
    types::{ToSql, Type},
};
use tracing::{debug, info, warn};

use super::{failure, pool::Object, shared::Lent};
use crate::session::StoreError;

/// A statement's parameter and its type.
pub(super) type Param<'a> = (&'a (dyn ToSql + Sync), Type);

/// A connection: one of the pool's, the task's alone until it is dropped,
/// or a shared one.
pub(super) enum Handle<'a> {
    Pooled(Box<Object>),
    Shared(Lent<'a>),
}

impl Deref for Handle<'_> {
    type Target = ClientWrapper;

    fn deref(&self) -> &ClientWrapper {
        match self {
            Handle::Pooled(object) => object,
            Handle::Shared(lent) => &lent.client.client,
        }
    }
}

impl Handle<'_> {
    fn statements(&self) -> &Statements {
        match self {
            Handle::Pooled(object) => &object.statements,
            Handle::Shared(lent) => &lent.client.statements,
        }
    }
}

/// The statements prepared on one connection. Every statement's SQL is a
/// constant, so one is found by its text's address instead of by hashing
/// the text (kilobytes for a commit of several sessions), as
/// deadpool-postgres's cache does, once per statement sent.
#[derive(Debug, Default)]
pub(super) struct Statements(Mutex<Vec<(&'static str, Vec<Type>, Statement)>>);

impl Statements {
    /// `sql` with `types` prepared on `client`, once.
    async fn prepared(
        &self,
        client: &ClientWrapper,
        sql: &'static str,
        types: &[Type],
    ) -> Result<Statement, tokio_postgres::Error> {
        if let Some(statement) = Self::find(&crate::sync::lock(&self.0), sql, types) {
            return Ok(statement);
        }
        let statement = client.prepare_typed(sql, types).await?;
        // Another task may have prepared it meanwhile: the first one kept
        // serves, and this one is closed when dropped.
        let mut known = crate::sync::lock(&self.0);
        if Self::find(&known, sql, types).is_none() {
            known.push((sql, types.to_vec(), statement.clone()));
        }
        Ok(statement)
    }

    fn find(known: &[(&'static str, Vec<Type>, Statement)], sql: &'static str, types: &[Type]) -> Option<Statement> {
        known.iter().find(|(s, t, _)| std::ptr::eq(*s, sql) && t == types).map(|(_, _, statement)| statement.clone())
    }
}

/// How statements are sent: prepared once per connection or unnamed
/// (`[sessions] prepared_statements`), and several at once on shared
/// connections or one at a time on pooled ones (`pipeline_connections`).
///
/// Neither is safe through a pooler in transaction mode (PgBouncer's
/// `pool_mode = transaction`), which hands each transaction to whichever
/// server connection is free: a statement prepared on one is unknown on
/// the next, and PgBouncer (1.18 at least) can answer a statement sent
/// while an earlier one of its connection is finishing with another
/// client's reply. So statements are pipelined only once the store has
/// found no such pooler (see `pooler`), and both are turned off, for good,
/// when it finds one, then or later (a prepared statement lost).
#[derive(Debug)]
pub(super) struct Mode {
    prepared: AtomicBool,
    /// What is known of a pooler: [`UNKNOWN`], [`DIRECT`] or [`POOLED`].
    pooler: AtomicU8,
}

/// Not looked for yet: statements are not pipelined.
const UNKNOWN: u8 = 0;
/// No pooler in transaction mode: statements may be pipelined.
const DIRECT: u8 = 1;
/// A pooler in transaction mode, for good.
const POOLED: u8 = 2;

impl Mode {
    /// Statements prepared as configured, and not pipelined until
    /// [`Mode::direct`].
    pub(super) fn new(prepared: bool) -> Self {
        Self { prepared: AtomicBool::new(prepared), pooler: AtomicU8::new(UNKNOWN) }
    }

    fn prepared(&self) -> bool {
        self.prepared.load(Ordering::Relaxed)
    }

    /// Whether a query's statements may go on shared connections.
    pub(super) fn pipelined(&self) -> bool {
        self.pooler.load(Ordering::Relaxed) == DIRECT
    }

    /// Whether the store has yet to look for a pooler.
    pub(super) fn unknown(&self) -> bool {
        self.pooler.load(Ordering::Relaxed) == UNKNOWN
    }

    /// No pooler in transaction mode in front of the database: statements
    /// may be pipelined (unless one was found meanwhile).
    pub(super) fn direct(&self) {
        let _ = self.pooler.compare_exchange(UNKNOWN, DIRECT, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// A pooler in transaction mode is in front of the database (`how` it
    /// showed): statements are sent unnamed, one at a time on a
    /// connection, from now on. Said once.
    pub(super) fn transaction_pooler(&self, how: &str) {
        if self.pooler.swap(POOLED, Ordering::Relaxed) == POOLED {
            return;
        }
        if self.prepared.swap(false, Ordering::Relaxed) {
            warn!(
                how,
                "the database is reached through a pooler in transaction mode (such as PgBouncer with pool_mode = \
                 transaction): statements are sent unnamed, one at a time on each connection, from now on; set \
                 [sessions] prepared_statements = false to start so"
            );
        } else {
            info!(
                how,
                "the database is reached through a pooler in transaction mode: statements are sent one at a time on \
                 each connection"
            );
        }
    }

    /// `e` came back for a prepared statement: if it says the database
    /// lost the statement, or found its name taken (another connection's,
    /// through a pooler), a pooler in transaction mode is in front of it,
    /// and true: the statement did not run, and may be sent again.
    fn lost(&self, e: &tokio_postgres::Error) -> bool {
        let code = e.as_db_error().map(|db| db.code().code());
        if !matches!(code, Some("26000" | "42P05")) {
            return false;
        }
        self.transaction_pooler(&format!("a prepared statement lost (SQLSTATE {})", code.unwrap_or_default()));
        true
    }
}

/// A connection and how statements are sent on it.
pub(super) struct Conn<'a> {
    pub(super) client: Handle<'a>,
    /// How statements are sent.
    pub(super) mode: &'a Mode,
}

impl Conn<'_> {
    /// `statement`, its connection marked as awaiting an answer until it
    /// has one: cut off before then, the statement leaves the mark, and a
    /// pooled connection is given up (see `pool`), a shared one retired
    /// from its slot (see `shared`).
    pub(super) async fn send<T>(
        &self,
        statement: impl Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, tokio_postgres::Error> {
        self.waiting(true);
        let answer = statement.await;
        self.waiting(false);
        answer
    }

    fn waiting(&self, waiting: bool) {
        match &self.client {
            Handle::Pooled(object) => object.waiting(waiting),
            Handle::Shared(lent) => lent.waiting(waiting),
        }
    }

    /// The rows of `sql` with `params`.
    pub(super) async fn rows(
        &self,
        sql: &'static str,
        params: &[Param<'_>],
    ) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
        self.send(self.rows_now(sql, params)).await
    }

    /// The rows `sql` changed.
    pub(super) async fn exec(&self, sql: &'static str, params: &[Param<'_>]) -> Result<u64, tokio_postgres::Error> {
        self.send(self.exec_now(sql, params)).await
    }

    async fn rows_now(
        &self,
        sql: &'static str,
        params: &[Param<'_>],
    ) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
        if self.mode.prepared() {
            let sent = async {
                let statement = self.prepare(sql, params).await?;
                let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
                self.client.query(&statement, &values).await
            };
            match sent.await {
                Err(e) if self.mode.lost(&e) => {}
                answer => return answer,
            }
        }
        self.client.query_typed(sql, params).await
    }

    /// `sql` prepared on this connection, with the types of `params`.
    async fn prepare(&self, sql: &'static str, params: &[Param<'_>]) -> Result<Statement, tokio_postgres::Error> {
        let types: Vec<Type> = params.iter().map(|(_, t)| t.clone()).collect();
        self.client.statements().prepared(&self.client, sql, &types).await
    }

    /// At most one row.
    pub(super) async fn maybe_row(
        &self,
        sql: &'static str,
        params: &[Param<'_>],
    ) -> Result<Option<tokio_postgres::Row>, tokio_postgres::Error> {
        Ok(self.rows(sql, params).await?.into_iter().next())
    }

    async fn exec_now(&self, sql: &'static str, params: &[Param<'_>]) -> Result<u64, tokio_postgres::Error> {
        if self.mode.prepared() {
            let sent = async {
                let statement = self.prepare(sql, params).await?;
                let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
                self.client.execute(&statement, &values).await
            };
            match sent.await {
                Err(e) if self.mode.lost(&e) => {}
                answer => return answer,
            }
        }
        self.client.execute_typed(sql, params).await
    }
}

tokio::task_local! {
    /// Set while an operation runs [`quietly`]: the reason it last failed.
    static QUIET: RefCell<Option<String>>;
}

/// Runs `fut` with its failures logged at debug instead of warn, for an
/// operation asked again (its first attempt said why it failed) or one
/// whose caller says once what a run of failures came to: the output, and
/// the reason of the last failure, if any.
pub(super) async fn quietly<T>(fut: impl Future<Output = T>) -> (T, Option<String>) {
    QUIET
        .scope(RefCell::new(None), async {
            let out = fut.await;
            (out, QUIET.with(RefCell::take))
        })
        .await
}

/// The reason a run of failures was last said with: a failure that
/// recurs (a probe every second, every new connection while the database
/// is away) is said once, and again only when its reason changes.
#[derive(Debug, Default)]
pub(super) struct LastSaid(Mutex<Option<String>>);

impl LastSaid {
    /// Whether `reason` is new (then it is the one said from now on).
    pub(super) fn anew(&self, reason: &str) -> bool {
        let mut said = crate::sync::lock(&self.0);
        if said.as_deref() == Some(reason) {
            return false;
        }
        *said = Some(reason.to_owned());
        true
    }

    /// The run of failures ended.
    pub(super) fn clear(&self) {
        *crate::sync::lock(&self.0) = None;
    }
}

/// Says the failures of an operation that recurs on a timer (the
/// readiness probe, the renewer's and the keeper's statements) as
/// [`LastSaid`] does. A database away for an hour is a line, not one a
/// second.
#[derive(Debug, Default)]
pub(super) struct SaidOnce(LastSaid);

impl SaidOnce {
    /// Runs `fut`, operation `what`, saying its failure as above.
    pub(super) async fn run<T>(
        &self,
        what: &'static str,
        fut: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let (answer, reason) = quietly(fut).await;
        match (&answer, reason) {
            (Ok(_), _) => self.0.clear(),
            (Err(_), Some(reason)) if self.0.anew(&reason) => {
                warn!(operation = what, reason, "session store failed");
            }
            (Err(_), _) => {}
        }
        answer
    }
}

/// Says why an operation failed: at warn, unless it runs [`quietly`].
fn failed(what: &str, reason: &str, message: &str) {
    let quiet = QUIET.try_with(|last| *last.borrow_mut() = Some(reason.to_owned())).is_ok();
    if quiet {
        debug!(operation = what, reason, "{message}");
    } else {
        warn!(operation = what, reason, "{message}");
    }
}

/// Logs why an operation failed (never the connection string, never a
/// statement's values) and maps it to "unavailable".
pub(super) fn unavailable(what: &str, reason: &str) -> StoreError {
    failed(what, reason, "session store failed");
    StoreError::Unavailable("postgres")
}

pub(super) fn db(what: &'static str) -> impl Fn(tokio_postgres::Error) -> StoreError {
    move |e| unavailable(what, &failure::reason(&e))
}

/// Why the pool gave no connection.
pub(super) fn pool_reason(e: &deadpool_postgres::PoolError) -> String {
    match e {
        deadpool_postgres::PoolError::Backend(b) => failure::reason(b),
        deadpool_postgres::PoolError::Timeout(_) => "no connection within the store's timeout".to_owned(),
        other => format!("{other}"),
    }
}

pub(super) fn pool_error(what: &'static str) -> impl Fn(deadpool_postgres::PoolError) -> StoreError {
    move |e| unavailable(what, &pool_reason(&e))
}

/// `fut`, given until `until`: past it, it is dropped (a statement cut off
/// mid-way leaves its connection marked, and it is used no more) and the
/// operation fails as `late`.
pub(super) async fn bounded<T>(
    until: Instant,
    what: &'static str,
    late: StoreError,
    fut: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout_at(until, fut).await {
        Ok(result) => result,
        Err(_) => {
            failed(what, "no answer within the time allowed", "session store did not answer in time");
            Err(late)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Statements are pipelined only once no pooler was found, and a
    /// pooler found is for good: a later probe that finds none changes
    /// nothing.
    #[test]
    fn a_pooler_found_is_for_good() {
        let mode = Mode::new(true);
        assert!(mode.unknown() && !mode.pipelined() && mode.prepared());
        mode.direct();
        assert!(mode.pipelined() && !mode.unknown());
        mode.transaction_pooler("found later");
        assert!(!mode.pipelined() && !mode.prepared());
        mode.direct();
        assert!(!mode.pipelined(), "a pooler found was forgotten");
    }

    /// A statement the database never answers fails at its deadline, as
    /// the error it was given, not later.
    #[tokio::test(start_paused = true)]
    async fn a_wait_on_a_silent_database_ends_at_its_deadline() {
        let start = Instant::now();
        let until = start + Duration::from_millis(1500);
        let never = std::future::pending::<Result<(), StoreError>>();
        assert_eq!(bounded(until, "get", StoreError::Deadline, never).await, Err(StoreError::Deadline));
        assert_eq!(start.elapsed(), Duration::from_millis(1500));
        let answered = async { Ok::<_, StoreError>(7) };
        assert_eq!(bounded(until, "get", StoreError::Deadline, answered).await, Ok(7));
    }

    /// A recurring operation's failures are said at warn once for each run
    /// of them, and when their reason changes; the others at debug. An
    /// operation run quietly says its failures at debug, and its caller
    /// gets the last reason.
    #[test]
    fn failures_asked_again_are_said_once() {
        use crate::logging::capture::{captured, text};
        let fail = |reason: &'static str| async move { Err::<(), _>(unavailable("ready", reason)) };
        let logs = captured(text("debug", false), || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async {
                let said = SaidOnce::default();
                for reason in ["refused", "refused", "refused", "no route", "refused"] {
                    assert!(said.run("ready", fail(reason)).await.is_err());
                }
                assert_eq!(said.run("ready", async { Ok(()) }).await, Ok(()));
                assert!(said.run("ready", fail("refused")).await.is_err());
                let (answer, why) = quietly(fail("late")).await;
                assert!(answer.is_err());
                assert_eq!(why.as_deref(), Some("late"));
                let never = std::future::pending::<Result<(), StoreError>>();
                let (_, why) = quietly(bounded(Instant::now(), "release", StoreError::Deadline, never)).await;
                assert_eq!(why.as_deref(), Some("no answer within the time allowed"));
            });
        });
        let warned: Vec<&str> = logs.lines().filter(|l| l.contains("WARN")).collect();
        let reasons: Vec<&str> = warned.iter().filter_map(|l| l.split("reason=\"").nth(1)?.split('"').next()).collect();
        assert_eq!(reasons, ["refused", "no route", "refused", "refused"], "{logs}");
        // Each failure is there at debug (the ones said too): six runs
        // failed, and two quietly.
        let debug = logs.lines().filter(|l| l.contains("DEBUG") && l.contains("session store")).count();
        assert_eq!(debug, 6 + 2, "{logs}");
    }
}
